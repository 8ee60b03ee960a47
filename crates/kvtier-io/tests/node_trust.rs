//! The node tier's trust boundary (issue 26, docs/arch/node.md "Trust"), with one user: the
//! socket's directory and reclaim, the caps on connections, frames, namespaces and time to
//! `Hello`, end of stream on every connection the node ends, verification at commit, damage
//! seen at once, and capacity shared across block sizes. Tests across users are in
//! `node_trust_uid.rs`; the allocation bound of a frame in `node_trust_alloc.rs`.
#![allow(clippy::unwrap_used)]
use kvtier::hash::SequenceHash;
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier::transfer::RemoteStore;
use kvtier_io::storage::node::{
    block_checksum, default_socket, GetAnswer, ItemAnswer, LeaseEnd, NodeClientOptions,
    NodeOptions, NodeServer, NodeStore, PutAnswer, PutEnd, Reply, Request, MAX_BATCH,
    NODE_PROTOCOL_VERSION,
};

const BLOCK: usize = 4096;

fn opts(dir: &Path, blocks: u64) -> NodeOptions {
    let mut o = NodeOptions::new(dir.join("node.sock"), blocks * BLOCK as u64);
    o.shm_dir = dir.to_path_buf();
    o
}

fn engine(n: &NodeServer, ns: &str) -> NodeStore {
    NodeStore::connect(n.socket(), ns, NodeClientOptions::default()).unwrap()
}

fn block(key: u128) -> Vec<u8> {
    (0..BLOCK).map(|i| (key as usize * 31 + i) as u8).collect()
}

fn frame(r: &Request) -> Vec<u8> {
    let body = postcard::to_stdvec(r).unwrap();
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&body);
    f
}

/// The node's reply, or `None` when it closed the connection.
fn reply(s: &mut UnixStream) -> Option<Reply> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut buf).ok()?;
    let r: Reply = postcard::from_bytes(&buf).unwrap();
    if matches!(r, Reply::Welcome { .. }) {
        s.read_exact(&mut [0u8; 1]).unwrap(); // the byte carrying the arena's descriptor
    }
    Some(r)
}

fn send(s: &mut UnixStream, r: &Request) -> Option<Reply> {
    s.write_all(&frame(r)).ok()?;
    reply(s)
}

fn hello(ns: &str) -> Request {
    Request::Hello {
        version: NODE_PROTOCOL_VERSION,
        namespace: ns.into(),
    }
}

fn raw(n: &NodeServer, ns: &str) -> UnixStream {
    let mut s = UnixStream::connect(n.socket()).unwrap();
    let w = send(&mut s, &hello(ns));
    assert!(matches!(w, Some(Reply::Welcome { .. })), "{w:?}");
    s
}

/// Whether the node ended the connection: end of stream within `within`.
fn closed_within(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    matches!(s.read(&mut [0u8; 1]), Ok(0))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for {what}");
}

fn my_uid(dir: &Path) -> u32 {
    std::fs::metadata(dir).unwrap().uid()
}

fn arena_file(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".arena"))
        .unwrap()
        .path()
}

#[test]
fn the_stale_socket_reclaim_deletes_only_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), 2);
    // A regular file at the socket's path is refused and kept, byte for byte.
    std::fs::write(&o.socket, b"precious").unwrap();
    let e = NodeServer::start(&o).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
    assert_eq!(std::fs::read(&o.socket).unwrap(), b"precious");
    std::fs::remove_file(&o.socket).unwrap();
    // So are a directory and a symlink.
    std::fs::create_dir(&o.socket).unwrap();
    assert!(NodeServer::start(&o).is_err());
    assert!(o.socket.is_dir());
    std::fs::remove_dir(&o.socket).unwrap();
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &o.socket).unwrap();
    assert!(NodeServer::start(&o).is_err());
    assert!(std::fs::symlink_metadata(&o.socket).unwrap().is_symlink());
    std::fs::remove_file(&o.socket).unwrap();
    // A stale socket (nobody listening) is replaced.
    drop(UnixListener::bind(&o.socket).unwrap());
    let n = NodeServer::start(&o).unwrap();
    engine(&n, "m").put(SequenceHash(1), &block(1)).unwrap();
}

#[test]
fn a_socket_directory_not_private_or_not_ours_is_refused() {
    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    let o = opts(&dir, 2);
    for mode in [0o777, 0o770, 0o1777, 0o702] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = NodeServer::start(&o).unwrap_err();
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::PermissionDenied,
            "{mode:o}: {e}"
        );
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A symlink to a private directory is refused too.
    let link = top.path().join("link");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let mut ol = opts(&dir, 2);
    ol.socket = link.join("node.sock");
    assert!(NodeServer::start(&ol).is_err());
    // A missing directory is created private.
    let mut on = opts(&dir, 2);
    on.socket = top.path().join("new/sub/node.sock");
    let n = NodeServer::start(&on).unwrap();
    let m = std::fs::metadata(top.path().join("new/sub")).unwrap();
    assert_eq!(m.mode() & 0o777, 0o700);
    assert_eq!(std::fs::metadata(n.socket()).unwrap().mode() & 0o777, 0o600);
    drop(n);
    // Another user's directory (needs root to make one).
    if my_uid(top.path()) == 0 {
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = NodeServer::start(&o).unwrap_err();
        assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
    } else {
        println!("skipped: the directory-of-another-user case needs root (chown)");
    }
    // The default socket is per user, never the shared /tmp/kvtier-node.
    let d = default_socket();
    assert_ne!(d, Path::new("/tmp/kvtier-node/node.sock"));
    let uid = my_uid(top.path());
    assert!(
        d == Path::new(&format!("/tmp/kvtier-node-{uid}/node.sock"))
            || std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|x| d.starts_with(x)),
        "{d:?}"
    );
}

#[test]
fn allow_uid_opens_the_socket_to_the_allowed_users_only() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut o = opts(dir.path(), 2);
    o.allowed_uids = vec![4242];
    let n = NodeServer::start(&o).unwrap();
    let sock = std::fs::metadata(n.socket()).unwrap().mode() & 0o777;
    let d = std::fs::metadata(dir.path()).unwrap().mode() & 0o777;
    assert_eq!((sock, d), (0o666, 0o711));
    engine(&n, "m").put(SequenceHash(1), &block(1)).unwrap();
}

/// Each uid that may attach has an arena of its own: this process's blocks are in its own uid's
/// arena and no other's (that a process is passed its own uid's arena alone is checked across
/// users in `node_trust_uid.rs`). The capacity is split evenly (a uid listed twice, or the
/// node's own, counts once).
#[test]
fn each_uid_has_an_arena_of_its_own_and_the_capacity_is_split() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 9);
    o.allowed_uids = vec![4242, 4243, 4242, my_uid(dir.path())];
    let n = NodeServer::start(&o).unwrap();
    // The node's own uid's arena is a 0600 file; each other uid's a memfd (no path) whose size
    // is sealed: a tenant, which holds it read-write, cannot truncate it under the node.
    let files: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".arena"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let m = std::fs::metadata(&files[0]).unwrap();
    assert_eq!((m.len(), m.mode() & 0o777), (3 * BLOCK as u64, 0o600));
    let arenas = n.arena_files().unwrap();
    assert_eq!(arenas.len(), 3);
    for (i, a) in arenas.iter().enumerate() {
        assert_eq!(a.metadata().unwrap().len(), 3 * BLOCK as u64, "arena {i}");
        if i > 0 {
            assert!(a.set_len(0).is_err(), "arena {i} is sealed");
            assert!(a.set_len(4 * BLOCK as u64).is_err(), "arena {i} is sealed");
        }
    }
    assert_eq!(n.stats().capacity, 9 * BLOCK as u64);
    let e = engine(&n, "m");
    e.put(SequenceHash(1), &block(1)).unwrap();
    let holds = |f: &std::fs::File| {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; 3 * BLOCK];
        f.read_exact_at(&mut buf, 0).unwrap();
        buf.windows(BLOCK).any(|w| w == block(1).as_slice())
    };
    let held: Vec<bool> = arenas.iter().map(holds).collect();
    assert_eq!(held, vec![true, false, false]);
    // A uid's arena holds only its own share: a block bigger than the share is refused.
    assert!(e.put(SequenceHash(2), &vec![0u8; 4 * BLOCK]).is_err());
    // A capacity too small to split is a clear error, not a node of empty arenas.
    let d2 = tempfile::tempdir().unwrap();
    let mut tiny = opts(d2.path(), 0);
    tiny.capacity = 2;
    tiny.allowed_uids = vec![4242, 4243];
    let err = NodeServer::start(&tiny).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("split between 3 users"), "{err}");
}

/// The node's own arena file has a name no one can guess (docs/arch/node.md, Definitions):
/// another user who takes every name they could predict (`kvtier-node-<pid>-<index>.arena`,
/// the pid being public) does not keep the node from starting, and two nodes of one process
/// share a `--shm-dir`. A directory stands in for the other user's file: the exclusive create
/// fails on either, the node's reclaim of dead nodes' arenas removes neither, and it needs no
/// second user.
#[test]
fn a_planted_arena_name_does_not_keep_the_node_from_starting() {
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    for i in 0..4 {
        let planted = dir.path().join(format!("kvtier-node-{pid}-{i}.arena"));
        std::fs::create_dir(planted).unwrap();
    }
    let n = NodeServer::start(&opts(dir.path(), 4)).unwrap();
    let mut o2 = opts(dir.path(), 4);
    o2.socket = dir.path().join("node2.sock");
    let n2 = NodeServer::start(&o2).unwrap();
    for (node, key) in [(&n, 1), (&n2, 2)] {
        let e = engine(node, "m");
        e.put(SequenceHash(key), &block(key)).unwrap();
        let mut out = vec![0u8; BLOCK];
        e.get(SequenceHash(key), &mut out).unwrap();
        assert_eq!(out, block(key));
    }
    let files: Vec<(String, std::fs::Metadata)> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap(),
            )
        })
        .filter(|(name, m)| name.ends_with(".arena") && m.is_file())
        .collect();
    assert_eq!(files.len(), 2, "one arena per node");
    let random = |name: &str| {
        let rest = name.strip_prefix(&format!("kvtier-node-{pid}-0-"))?;
        let hex = rest.strip_suffix(".arena")?;
        (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())
    };
    for (name, m) in &files {
        assert!(random(name).is_some(), "{name}: 64 random bits in the name");
        assert_eq!((m.mode() & 0o777, m.uid()), (0o600, my_uid(dir.path())));
    }
}

#[test]
fn connections_beyond_the_cap_are_closed_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 4);
    o.max_connections = 4;
    let n = NodeServer::start(&o).unwrap();
    let mut held: Vec<UnixStream> = (0..4).map(|_| raw(&n, "m")).collect();
    let mut extra = UnixStream::connect(n.socket()).unwrap();
    assert!(closed_within(&mut extra, Duration::from_secs(2)));
    wait_until("the node's threads", || n.stats().clients == 4);
    drop(held.pop());
    wait_until("a detach", || n.stats().clients == 3);
    let mut again = raw(&n, "m");
    assert!(matches!(
        send(&mut again, &Request::Stats),
        Some(Reply::Stats { .. })
    ));
}

#[test]
fn before_hello_frames_are_small_and_hello_is_due_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 4);
    o.hello_timeout = Duration::from_millis(300);
    let n = NodeServer::start(&o).unwrap();
    // A Hello beyond the 1 KiB pre-Hello frame: the connection ends, no reply.
    let mut big = UnixStream::connect(n.socket()).unwrap();
    assert_eq!(send(&mut big, &hello(&"x".repeat(2000))), None);
    // A namespace beyond 256 bytes is refused.
    let mut long = UnixStream::connect(n.socket()).unwrap();
    let r = send(&mut long, &hello(&"x".repeat(300)));
    assert!(
        matches!(&r, Some(Reply::Refused(why)) if why.contains("namespace")),
        "{r:?}"
    );
    // Silent, and trickling: both closed by the deadline.
    let t = Instant::now();
    let mut silent = UnixStream::connect(n.socket()).unwrap();
    let mut slow = UnixStream::connect(n.socket()).unwrap();
    let f = frame(&hello("m"));
    for b in &f[..4] {
        let _ = slow.write_all(&[*b]);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(closed_within(&mut silent, Duration::from_secs(3)));
    assert!(closed_within(&mut slow, Duration::from_secs(3)));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // After Hello the idle timeout applies, not the Hello deadline.
    let mut ok = raw(&n, "m");
    std::thread::sleep(Duration::from_millis(500));
    assert!(matches!(
        send(&mut ok, &Request::Stats),
        Some(Reply::Stats { .. })
    ));
}

#[test]
fn namespaces_are_capped_and_unused_ones_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 4);
    o.max_namespaces = 3;
    let n = NodeServer::start(&o).unwrap();
    // Many namespaces one after another: each is forgotten when its client leaves.
    for i in 0..20 {
        let s = raw(&n, &format!("ns-{i}"));
        drop(s);
        wait_until("a detach", || n.stats().clients == 0);
    }
    let held: Vec<UnixStream> = (0..3).map(|i| raw(&n, &format!("held-{i}"))).collect();
    let mut fourth = UnixStream::connect(n.socket()).unwrap();
    let r = send(&mut fourth, &hello("one-too-many"));
    assert!(
        matches!(&r, Some(Reply::Refused(why)) if why.contains("namespaces")),
        "{r:?}"
    );
    // A namespace already held still attaches.
    let _same = raw(&n, "held-0");
    drop(held);
}

#[test]
fn a_pooled_connection_the_node_closed_costs_no_io_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 4);
    o.idle_timeout = Duration::from_millis(200);
    let n = NodeServer::start(&o).unwrap();
    let c = NodeClientOptions {
        io_timeout: Duration::from_secs(3),
        ..NodeClientOptions::default()
    };
    let a = NodeStore::connect(n.socket(), "m", c).unwrap();
    a.put(SequenceHash(1), &block(1)).unwrap();
    std::thread::sleep(Duration::from_millis(600)); // the node closes the idle connection
    let t = Instant::now();
    assert_eq!(a.contains(&[SequenceHash(1)]).unwrap(), vec![true]);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "waited {:?}",
        t.elapsed()
    );
    // A protocol error: the peer sees end of stream at once.
    let mut s = raw(&n, "m");
    s.write_all(&[
        9, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    ])
    .unwrap();
    assert!(closed_within(&mut s, Duration::from_millis(500)));
}

/// A raw `Reserve` of one key: `(reservation id, offset)`.
fn reserve(s: &mut UnixStream, key: u128) -> (u64, u64) {
    let r = send(
        s,
        &Request::Reserve {
            bytes: BLOCK as u64,
            keys: vec![key],
        },
    );
    match r {
        Some(Reply::Reserved(v)) => match v[..] {
            [PutAnswer::Slot { id, offset }] => (id, offset),
            _ => panic!("no slot: {v:?}"),
        },
        other => panic!("{other:?}"),
    }
}

fn finish(s: &mut UnixStream, end: PutEnd) -> ItemAnswer {
    match send(s, &Request::Finish(vec![end])) {
        Some(Reply::Items(v)) if v.len() == 1 => v[0],
        other => panic!("{other:?}"),
    }
}

/// A raw `Lease` of one key: its lease id, if held.
fn lease(s: &mut UnixStream, key: u128) -> Option<u64> {
    match send(s, &Request::Lease(vec![key])) {
        Some(Reply::Leased(v)) => match v[..] {
            [GetAnswer::Lease { id, .. }] => Some(id),
            _ => None,
        },
        other => panic!("{other:?}"),
    }
}

fn end_lease(s: &mut UnixStream, end: LeaseEnd) -> ItemAnswer {
    match send(s, &Request::EndLeases(vec![end])) {
        Some(Reply::Items(v)) if v.len() == 1 => v[0],
        other => panic!("{other:?}"),
    }
}

/// A node other users may attach to (`--allow-uid`).
#[test]
fn bytes_changed_in_a_reserved_slot_before_commit_are_refused() {
    // Verified at commit whenever the writer committed a checksum (a verifying client always
    // does); a commit without one is published as written (the arena's writers are one uid).
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 4)).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(arena_file(dir.path()))
        .unwrap();
    let mut w = raw(&n, "m");
    let (id, offset) = reserve(&mut w, 5);
    f.write_all_at(&block(5), offset).unwrap();
    let honest = block_checksum(5, &block(5));
    // Another process rewrites one byte of the slot between the copy and the commit.
    f.write_all_at(&[block(5)[77] ^ 1], offset + 77).unwrap();
    let checksum = Some(honest);
    assert_eq!(
        finish(&mut w, PutEnd::Commit { id, checksum }),
        ItemAnswer::Mismatch
    );
    let reader = engine(&n, "m");
    assert_eq!(
        reader.contains(&[SequenceHash(5)]).unwrap(),
        vec![false],
        "never visible"
    );
    assert_eq!(n.stats().verified, 1);
    let (id6, offset) = reserve(&mut w, 6);
    f.write_all_at(&block(6), offset).unwrap();
    let unhashed = finish(
        &mut w,
        PutEnd::Commit {
            id: id6,
            checksum: None,
        },
    );
    assert_eq!(unhashed, ItemAnswer::Done);
    assert_eq!(reader.contains(&[SequenceHash(6)]).unwrap(), vec![true]);
    // An honest commit of the same key afterwards works.
    reader.put(SequenceHash(5), &block(5)).unwrap();
    let mut out = vec![0u8; BLOCK];
    reader.get(SequenceHash(5), &mut out).unwrap();
    assert_eq!(out, block(5));
    // The reservation is gone after its refusal: a second commit of it is unknown.
    assert_eq!(
        finish(&mut w, PutEnd::Commit { id, checksum }),
        ItemAnswer::Unknown
    );
}

#[test]
fn a_block_reported_damaged_is_invisible_at_once_while_another_reader_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 4)).unwrap();
    let a = engine(&n, "m");
    a.put(SequenceHash(1), &block(1)).unwrap();
    let mut r1 = raw(&n, "m");
    let l1 = lease(&mut r1, 1).expect("no lease");
    let mut r2 = raw(&n, "m");
    let l2 = lease(&mut r2, 1).expect("no lease");
    assert_eq!(end_lease(&mut r2, LeaseEnd::Damaged(l2)), ItemAnswer::Done);
    assert_eq!(
        a.contains(&[SequenceHash(1)]).unwrap(),
        vec![false],
        "gone while r1 reads"
    );
    assert_eq!(lease(&mut r2, 1), None);
    // A fresh copy can be stored at once; r1's slot is kept until its lease ends.
    a.put(SequenceHash(1), &block(1)).unwrap();
    assert_eq!(end_lease(&mut r1, LeaseEnd::Done(l1)), ItemAnswer::Done);
    assert_eq!(a.contains(&[SequenceHash(1)]).unwrap(), vec![true]);
    // A lease ended twice, or never held, is unknown.
    assert_eq!(end_lease(&mut r1, LeaseEnd::Done(l1)), ItemAnswer::Unknown);
    assert_eq!(
        end_lease(&mut r2, LeaseEnd::Damaged(l1)),
        ItemAnswer::Unknown
    );
}

#[test]
fn a_batch_longer_than_max_batch_is_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 1);
    o.capacity = 2 * MAX_BATCH as u64;
    let n = NodeServer::start(&o).unwrap();
    let mut s = raw(&n, "m");
    let keys: Vec<u128> = (0..=MAX_BATCH as u128).collect();
    let too_long = [
        Request::Reserve {
            bytes: 1,
            keys: keys.clone(),
        },
        Request::Lease(keys.clone()),
        Request::Finish(vec![PutEnd::Abort(1); MAX_BATCH + 1]),
        Request::EndLeases(vec![LeaseEnd::Done(1); MAX_BATCH + 1]),
    ];
    for r in &too_long {
        let got = send(&mut s, r);
        assert!(
            matches!(&got, Some(Reply::Refused(why)) if why.contains("batch")),
            "{got:?}"
        );
    }
    assert_eq!(n.stats().blocks, 0);
    assert_eq!(n.stats().gets, 0, "nothing of a refused batch was done");
    // MAX_BATCH is served, one answer per key, in order.
    let r = send(
        &mut s,
        &Request::Reserve {
            bytes: 1,
            keys: keys[..MAX_BATCH].to_vec(),
        },
    );
    let Some(Reply::Reserved(v)) = r else {
        panic!("{r:?}")
    };
    assert_eq!(v.len(), MAX_BATCH);
    assert!(v.iter().all(|a| matches!(a, PutAnswer::Slot { .. })));
}

#[test]
fn a_client_of_another_protocol_version_is_told_why() {
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 2)).unwrap();
    let mut s = UnixStream::connect(n.socket()).unwrap();
    let r = send(
        &mut s,
        &Request::Hello {
            version: 3,
            namespace: "m".into(),
        },
    );
    assert!(
        matches!(&r, Some(Reply::Refused(why))
            if why.contains(&format!("node protocol {NODE_PROTOCOL_VERSION}")) && why.contains("speaks 3")),
        "{r:?}"
    );
    assert_eq!(n.stats().clients, 0);
}

#[test]
fn a_second_block_size_reuses_the_ranges_of_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 4)).unwrap();
    let a = engine(&n, "model-a");
    for k in 0..4u128 {
        a.put(SequenceHash(k), &block(k)).unwrap();
    }
    // Another model with blocks twice the size, holding 0 bytes: never `Full`.
    let b = engine(&n, "model-b");
    let big: Vec<u8> = (0..2 * BLOCK).map(|i| (i * 7) as u8).collect();
    b.put(SequenceHash(100), &big).unwrap();
    b.put(SequenceHash(101), &big).unwrap();
    let mut out = vec![0u8; 2 * BLOCK];
    b.get(SequenceHash(101), &mut out).unwrap();
    assert_eq!(out, big);
    assert_eq!(n.stats().puts_full, 0);
    // a, now above its share, lost blocks to b; what it kept still reads back.
    let kept = a
        .contains(&[
            SequenceHash(0),
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
        ])
        .unwrap();
    let mut one = vec![0u8; BLOCK];
    for (k, present) in kept.iter().enumerate() {
        if *present {
            a.get(SequenceHash(k as u128), &mut one).unwrap();
            assert_eq!(one, block(k as u128));
        }
    }
}

#[test]
fn grants_are_bounded_bound_to_their_connection_and_never_replace_a_block() {
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 64)).unwrap();
    let mut a = raw(&n, "m");
    let mut b = raw(&n, "m");
    let bytes = BLOCK as u64;
    // Bounded: a batch past MAX_BATCH, no bytes or more than the arena are refused whole; a
    // Grant gets at most 1/8 of the arena (8 of 64 blocks), however many it asks for.
    for (bytes, count) in [(bytes, MAX_BATCH as u32 + 1), (0, 1), (65 * bytes, 1)] {
        let r = send(&mut a, &Request::Grant { bytes, count });
        assert!(
            matches!(r, Some(Reply::Refused(_))),
            "{bytes} x {count}: {r:?}"
        );
    }
    let Some(Reply::Granted(granted)) = send(&mut a, &Request::Grant { bytes, count: 64 }) else {
        panic!("no grant");
    };
    assert_eq!(granted.len(), 8);
    assert_eq!(n.stats().bytes_granted, 8 * bytes);
    let Some(Reply::Granted(none)) = send(&mut b, &Request::Grant { bytes, count: 1 }) else {
        panic!("no answer");
    };
    assert!(none.is_empty(), "the node's share of grants is held");
    // Another connection can neither publish nor abort a grant it does not hold.
    let (id, _) = granted[0];
    let r = send(
        &mut b,
        &Request::Finish(vec![PutEnd::Publish {
            id,
            key: 1,
            checksum: None,
        }]),
    );
    assert_eq!(r, Some(Reply::Items(vec![ItemAnswer::Unknown])));
    let r = send(&mut b, &Request::Finish(vec![PutEnd::Abort(id)]));
    assert_eq!(r, Some(Reply::Items(vec![ItemAnswer::Unknown])));
    assert_eq!(n.stats().bytes_granted, 8 * bytes, "the grant is still a's");
    // An unnamed grant cannot be committed, so it never becomes a block without a key.
    let r = send(
        &mut a,
        &Request::Finish(vec![PutEnd::Commit { id, checksum: None }]),
    );
    assert_eq!(r, Some(Reply::Items(vec![ItemAnswer::Unknown])));
    // A key stored already is answered done and keeps its bytes.
    let s = engine(&n, "m");
    s.put(SequenceHash(7), &block(7)).unwrap();
    let r = send(
        &mut a,
        &Request::Finish(vec![PutEnd::Publish {
            id,
            key: 7,
            checksum: None,
        }]),
    );
    assert_eq!(r, Some(Reply::Items(vec![ItemAnswer::Done])));
    let mut got = vec![0u8; BLOCK];
    s.get(SequenceHash(7), &mut got).unwrap();
    assert_eq!(got, block(7));
    // A publish with a checksum the slot's bytes do not match publishes nothing.
    let (id, _) = granted[1];
    let end = PutEnd::Publish {
        id,
        key: 8,
        checksum: Some(block_checksum(8, &block(8))),
    };
    let r = send(&mut a, &Request::Finish(vec![end]));
    assert_eq!(r, Some(Reply::Items(vec![ItemAnswer::Mismatch])));
    assert_eq!(s.contains(&[SequenceHash(8)]).unwrap(), vec![false]);
    // The grants a connection holds vanish with it.
    assert_eq!(n.stats().bytes_granted, 6 * bytes);
    drop(a);
    wait_until("the grants freed", || n.stats().bytes_granted == 0);
    assert_eq!(
        n.stats().abandoned_puts,
        0,
        "unnamed grants are no abandoned puts"
    );
}

/// A reservation is ended only by the connection that holds it: another connection's `Abort`
/// of it is `Unknown` (as its `Commit` or `Publish` is) and changes nothing; so is an `Abort`
/// of an id never handed out or ended already. Only an abort that freed a slot is `Done`.
#[test]
fn an_abort_of_a_reservation_the_connection_does_not_hold_is_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let n = NodeServer::start(&opts(dir.path(), 4)).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(arena_file(dir.path()))
        .unwrap();
    let mut a = raw(&n, "m");
    let mut b = raw(&n, "m");
    let (id, offset) = reserve(&mut a, 5);
    assert_eq!(finish(&mut b, PutEnd::Abort(id)), ItemAnswer::Unknown);
    assert_eq!(
        finish(&mut a, PutEnd::Abort(id + 1000)),
        ItemAnswer::Unknown
    );
    // `a`'s reservation stands: it commits, and the block is served.
    f.write_all_at(&block(5), offset).unwrap();
    let commit = PutEnd::Commit { id, checksum: None };
    assert_eq!(finish(&mut a, commit), ItemAnswer::Done);
    let reader = engine(&n, "m");
    let mut out = vec![0u8; BLOCK];
    reader.get(SequenceHash(5), &mut out).unwrap();
    assert_eq!(out, block(5));
    // The holder's abort is done once, then unknown; the key was never stored.
    let (id6, _) = reserve(&mut a, 6);
    assert_eq!(finish(&mut b, PutEnd::Abort(id6)), ItemAnswer::Unknown);
    assert_eq!(finish(&mut a, PutEnd::Abort(id6)), ItemAnswer::Done);
    assert_eq!(finish(&mut a, PutEnd::Abort(id6)), ItemAnswer::Unknown);
    assert_eq!(reader.contains(&[SequenceHash(6)]).unwrap(), vec![false]);
}
