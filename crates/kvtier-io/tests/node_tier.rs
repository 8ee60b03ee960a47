//! The node tier end to end: a real `NodeServer` on a Unix socket with its shared arena, and
//! `NodeStore` clients standing in for engine processes (each client is what one engine process
//! holds; the node cannot tell threads of one test from processes, it sees connections).
#![allow(clippy::unwrap_used)]
use kvtier::hash::SequenceHash;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::node::{
    block_checksum, GetAnswer, LeaseEnd, NodeClientOptions, NodeOptions, NodeServer, NodeStore,
    PutAnswer, Reply, Request, NODE_PROTOCOL_VERSION,
};

const BLOCK: usize = 4096;

fn node(dir: &Path, blocks: u64) -> NodeServer {
    let mut o = NodeOptions::new(dir.join("node.sock"), blocks * BLOCK as u64);
    o.shm_dir = dir.to_path_buf();
    NodeServer::start(&o).unwrap()
}

fn engine(n: &NodeServer, ns: &str) -> NodeStore {
    NodeStore::connect(n.socket(), ns, NodeClientOptions::default()).unwrap()
}

/// An engine that checks every block (`node://...?verify=1`).
fn verifying_engine(n: &NodeServer, ns: &str) -> NodeStore {
    let opts = NodeClientOptions {
        verify: true,
        ..NodeClientOptions::default()
    };
    NodeStore::connect(n.socket(), ns, opts).unwrap()
}

fn block(key: u128) -> Vec<u8> {
    (0..BLOCK).map(|i| (key as usize * 31 + i) as u8).collect()
}

/// Raw protocol access, as a crashing or hostile client would use it.
fn raw(n: &NodeServer, ns: &str) -> UnixStream {
    let mut s = UnixStream::connect(n.socket()).unwrap();
    let welcome = send(
        &mut s,
        &Request::Hello {
            version: NODE_PROTOCOL_VERSION,
            namespace: ns.into(),
        },
    );
    assert!(matches!(welcome, Reply::Welcome { .. }), "{welcome:?}");
    // The byte that carries the arena's descriptor (closed unread here).
    s.read_exact(&mut [0u8; 1]).unwrap();
    s
}

fn send(s: &mut UnixStream, r: &Request) -> Reply {
    let body = postcard_like(r);
    s.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
    s.write_all(&body).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut buf).unwrap();
    postcard::from_bytes(&buf).unwrap()
}

fn postcard_like(r: &Request) -> Vec<u8> {
    postcard::to_stdvec(r).unwrap()
}

/// A raw `Reserve` of one key: its slot, if granted.
fn reserve(s: &mut UnixStream, key: u128) -> Option<(u64, u64)> {
    let r = send(
        s,
        &Request::Reserve {
            bytes: BLOCK as u64,
            keys: vec![key],
        },
    );
    match r {
        Reply::Reserved(v) => match v[..] {
            [PutAnswer::Slot { id, offset }] => Some((id, offset)),
            _ => None,
        },
        other => panic!("{other:?}"),
    }
}

/// A raw `Lease` of one key: `(lease id, offset)`, if held.
fn lease(s: &mut UnixStream, key: u128) -> Option<(u64, u64)> {
    match send(s, &Request::Lease(vec![key])) {
        Reply::Leased(v) => match v[..] {
            [GetAnswer::Lease { id, offset, .. }] => Some((id, offset)),
            _ => None,
        },
        other => panic!("{other:?}"),
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn blocks_stored_by_one_engine_are_hits_for_another_of_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 16);
    let a = engine(&n, "llama-a1b2");
    let b = engine(&n, "llama-a1b2");
    for k in 1..=4u128 {
        a.put(SequenceHash(k), &block(k)).unwrap();
    }
    assert_eq!(
        b.contains(&[
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
            SequenceHash(4),
            SequenceHash(5)
        ])
        .unwrap(),
        vec![true, true, true, true, false]
    );
    let mut out = vec![0u8; BLOCK];
    for k in 1..=4u128 {
        b.get(SequenceHash(k), &mut out).unwrap();
        assert_eq!(out, block(k), "block {k} byte-exact across engines");
    }
    assert!(matches!(
        b.get(SequenceHash(9), &mut out),
        Err(TransferError::Remote(RemoteError::Missing {
            key: SequenceHash(9)
        }))
    ));
}

#[test]
fn another_model_never_sees_the_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 16);
    let a = engine(&n, "llama-1111");
    let q = engine(&n, "qwen-2222");
    a.put(SequenceHash(7), &block(7)).unwrap();
    assert_eq!(q.contains(&[SequenceHash(7)]).unwrap(), vec![false]);
    let mut out = vec![0u8; BLOCK];
    assert!(q.get(SequenceHash(7), &mut out).is_err());
    // The other model's own block of the same key is its own.
    q.put(SequenceHash(7), &block(8)).unwrap();
    q.get(SequenceHash(7), &mut out).unwrap();
    assert_eq!(out, block(8));
    a.get(SequenceHash(7), &mut out).unwrap();
    assert_eq!(out, block(7));
}

#[test]
fn an_engine_that_dies_mid_write_leaves_nothing_visible_and_no_lease() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 2);
    let survivor = engine(&n, "m");
    {
        // The dying engine reserves a slot, writes half a block and vanishes.
        let mut s = raw(&n, "m");
        reserve(&mut s, 5).expect("no slot");
        // And it leased a block it never returns.
        survivor.put(SequenceHash(6), &block(6)).unwrap();
        lease(&mut s, 6).expect("no lease");
    } // connection closed: the crash
    wait_until("the node to detach the dead engine", || {
        n.stats().abandoned_puts == 1
    });
    assert_eq!(survivor.contains(&[SequenceHash(5)]).unwrap(), vec![false]);
    // Both slots are usable again: the reservation was freed and the lease ended (block 6 can
    // be evicted for block 8 in a two-slot node).
    survivor.put(SequenceHash(7), &block(7)).unwrap();
    survivor.put(SequenceHash(8), &block(8)).unwrap();
    // Block 6, least recently used and no longer leased, was the one evicted.
    assert_eq!(
        survivor
            .contains(&[SequenceHash(6), SequenceHash(7), SequenceHash(8)])
            .unwrap(),
        vec![false, true, true]
    );
    let mut out = vec![0u8; BLOCK];
    survivor.get(SequenceHash(8), &mut out).unwrap();
    assert_eq!(out, block(8));
}

/// Copies block 2's bytes over block 1's slot (a rogue writer).
fn patch_block_1(n: &NodeServer, dir: &Path) {
    let mut s = raw(n, "m");
    let (id, off1) = lease(&mut s, 1).unwrap();
    send(&mut s, &Request::EndLeases(vec![LeaseEnd::Done(id)]));
    let arena = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        // The arena of the node's own uid (its first tenant; the only one with a file).
        .find(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with(&format!("kvtier-node-{}-0-", std::process::id()))
                && name.ends_with(".arena")
        })
        .unwrap()
        .path();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&arena)
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&block(2), off1).unwrap();
}

#[test]
fn a_block_patched_in_the_arena_is_refused_and_dropped_by_a_verifying_engine() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 4);
    let a = verifying_engine(&n, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
    a.put(SequenceHash(2), &block(2)).unwrap();
    patch_block_1(&n, dir.path());
    let mut out = vec![0u8; BLOCK];
    let err = a.get(SequenceHash(1), &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::Remote(RemoteError::Corrupt {
                key: SequenceHash(1),
                ..
            })
        ),
        "{err}"
    );
    assert_eq!(
        a.contains(&[SequenceHash(1), SequenceHash(2)]).unwrap(),
        vec![false, true],
        "the damaged block is gone"
    );
    // The checksum binds the key: the same bytes under another key do not verify.
    assert_ne!(block_checksum(1, &block(2)), block_checksum(2, &block(2)));
    assert_eq!(a.blocks_hashed(), 3, "2 puts and 1 get verified");
}

#[test]
fn a_node_serves_its_own_uid_without_hashing() {
    // Only this user can write this user's arena, and it can write the engine's memory as
    // well: the bytes are trusted as they are (docs/arch/node.md, Trust). A block patched by
    // this user is served as patched; nothing is hashed, by the clients or the node. The same
    // on a node other uids attach to: they have arenas of their own.
    let dir = tempfile::tempdir().unwrap();
    let mut o = NodeOptions::new(dir.path().join("node.sock"), 8 * BLOCK as u64);
    o.shm_dir = dir.path().to_path_buf();
    o.allowed_uids = vec![4242];
    let n = NodeServer::start(&o).unwrap();
    let a = engine(&n, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
    a.put(SequenceHash(2), &block(2)).unwrap();
    patch_block_1(&n, dir.path());
    let mut out = vec![0u8; BLOCK];
    a.get(SequenceHash(1), &mut out).unwrap();
    assert_eq!(out, block(2));
    assert_eq!(a.blocks_hashed(), 0);
    assert_eq!(n.stats().verified, 0);
    // The round trips of those operations were timed (the GPU test reports them apart).
    let rtt = a.round_trip_time();
    assert!(rtt > std::time::Duration::ZERO, "{rtt:?}");
    a.contains(&[SequenceHash(1)]).unwrap();
    assert!(
        a.round_trip_time() > rtt,
        "a new round trip adds to the total"
    );
}

#[test]
fn a_full_node_skips_stores_and_one_engine_cannot_flush_another() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 8);
    let a = engine(&n, "a");
    let b = engine(&n, "b");
    for k in 0..3u128 {
        b.put(SequenceHash(1000 + k), &block(k)).unwrap();
    }
    for k in 0..40u128 {
        a.put(SequenceHash(k), &block(k)).unwrap();
    }
    assert_eq!(
        b.contains(&[SequenceHash(1000), SequenceHash(1001), SequenceHash(1002)])
            .unwrap(),
        vec![true; 3]
    );
    // Every slot leased by readers: a put is skipped with an error, never a hang or a panic.
    let mut leases = Vec::new();
    let mut s = raw(&n, "a");
    for k in 0..40u128 {
        if let Some((id, _)) = lease(&mut s, k) {
            leases.push(id);
        }
    }
    let mut s2 = raw(&n, "b");
    for k in 1000..1003u128 {
        lease(&mut s2, k);
    }
    assert!(a.put(SequenceHash(99), &block(99)).is_err());
    assert!(n.stats().puts_full >= 1);
}

#[test]
fn a_second_node_on_a_live_socket_refuses_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(dir.path(), 2);
    let mut o = NodeOptions::new(dir.path().join("node.sock"), 2 * BLOCK as u64);
    o.shm_dir = dir.path().to_path_buf();
    let err = NodeServer::start(&o).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    n.shutdown(Duration::from_secs(2));
    assert!(!n.socket().exists(), "the socket is removed at shutdown");
    let arenas = |d: &Path| {
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".arena"))
            .count()
    };
    assert_eq!(arenas(dir.path()), 0, "the arena is removed at shutdown");
    let n2 = NodeServer::start(&o).unwrap();
    let a = engine(&n2, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
}

#[test]
fn an_engine_survives_a_node_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(dir.path(), 4);
    let a = engine(&n, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
    n.shutdown(Duration::from_secs(2));
    // The node is gone: operations fail fast with errors (misses), never hang.
    assert!(a.contains(&[SequenceHash(1)]).is_err());
    assert!(a.put(SequenceHash(2), &block(2)).is_err());
    let n2 = node(dir.path(), 4);
    // Reconnects, maps the new arena; the old blocks are gone, new ones work.
    assert_eq!(a.contains(&[SequenceHash(1)]).unwrap(), vec![false]);
    a.put(SequenceHash(2), &block(2)).unwrap();
    let mut out = vec![0u8; BLOCK];
    a.get(SequenceHash(2), &mut out).unwrap();
    assert_eq!(out, block(2));
    drop(n2);
}

#[test]
fn a_client_that_skips_hello_or_speaks_garbage_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 2);
    let mut s = UnixStream::connect(n.socket()).unwrap();
    assert!(matches!(
        send(
            &mut s,
            &Request::Reserve {
                bytes: BLOCK as u64,
                keys: vec![1],
            }
        ),
        Reply::Refused(_)
    ));
    let mut g = UnixStream::connect(n.socket()).unwrap();
    g.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let mut buf = [0u8; 1];
    g.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert_eq!(
        g.read(&mut buf).unwrap_or(0),
        0,
        "the node closes the connection"
    );
    // The node still serves others.
    let a = engine(&n, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
}
