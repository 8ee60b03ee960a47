//! The node's own disk tier (G3 behind the shared arena): blocks evicted from a full arena are
//! read back bit-exact from disk (promoted into the arena under a lease), a node restarted on
//! the same disk directory serves them (warm restart, a new arena), a damaged disk block is a
//! miss and never bytes, and namespaces stay apart on disk.
#![allow(clippy::unwrap_used)]
use kvtier::hash::SequenceHash;
use std::path::Path;

use kvtier::transfer::RemoteStore;
use kvtier_io::storage::node::{NodeClientOptions, NodeOptions, NodeServer, NodeStore};

const BLOCK: usize = 8192;

fn node(dir: &Path, arena_blocks: u64, disk_blocks: u64) -> NodeServer {
    NodeServer::start(&opts(dir, arena_blocks, disk_blocks)).unwrap()
}

fn opts(dir: &Path, arena_blocks: u64, disk_blocks: u64) -> NodeOptions {
    let mut o = NodeOptions::new(dir.join("node.sock"), arena_blocks * BLOCK as u64);
    o.shm_dir = dir.to_path_buf();
    o.disk_dir = Some(dir.join("g3"));
    o.disk_bytes = disk_blocks * BLOCK as u64;
    o
}

fn client(n: &NodeServer, ns: &str) -> NodeStore {
    NodeStore::connect(n.socket(), ns, NodeClientOptions::default()).unwrap()
}

fn block(key: u128) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (key as usize * 131 + i * 7 + i / 97) as u8)
        .collect()
}

#[test]
fn evicted_blocks_come_back_from_disk_and_survive_a_node_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<u128> = (1..=20).collect();
    {
        let n = node(dir.path(), 4, 64);
        let a = client(&n, "m");
        for &k in &keys {
            a.put(SequenceHash(k), &block(k)).unwrap();
        }
        let s = n.stats();
        assert_eq!(s.blocks, 4, "the arena holds 4: {s:?}");
        assert_eq!(s.disk_spills, 16, "16 evicted blocks spilled: {s:?}");
        assert_eq!(
            a.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
                .unwrap(),
            vec![true; 20]
        );
        // Another model never sees them, on disk either.
        let q = client(&n, "other");
        assert_eq!(
            q.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
                .unwrap(),
            vec![false; 20]
        );
        let mut out = vec![0u8; BLOCK];
        assert!(q.get(SequenceHash(1), &mut out).is_err());
        // Every block reads back bit-exact (most of them promoted from disk into the arena).
        for &k in &keys {
            out.fill(0);
            a.get(SequenceHash(k), &mut out).unwrap();
            assert_eq!(out, block(k), "block {k}");
        }
        assert!(n.stats().disk_hits >= 16, "{:?}", n.stats());
    } // the node stops: what the arena held goes to disk too
    let n = node(dir.path(), 4, 64);
    assert_eq!(n.stats().disk_blocks, 20, "warm restart: {:?}", n.stats());
    let b = client(&n, "m");
    assert_eq!(
        b.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())
            .unwrap(),
        vec![true; 20]
    );
    let mut out = vec![0u8; BLOCK];
    for &k in &keys {
        b.get(SequenceHash(k), &mut out).unwrap();
        assert_eq!(out, block(k), "block {k} after the restart");
    }
}

#[test]
fn a_damaged_disk_block_is_a_miss_never_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 2, 16);
    let a = client(&n, "m");
    for k in 1..=6u128 {
        a.put(SequenceHash(k), &block(k)).unwrap();
    }
    assert_eq!(n.stats().disk_spills, 4);
    // Flip one byte in every data file of the node's disk set: each spilled block's payload.
    let sub = dir.path().join("g3").join(kvtier_io::storage::disk::SUBDIR);
    for e in std::fs::read_dir(&sub).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "kvblk") {
            let mut bytes = std::fs::read(&p).unwrap();
            for slot in 0..4 {
                let at = slot * (BLOCK + 4096) + 4096 + 11;
                if at < bytes.len() {
                    bytes[at] ^= 0x40;
                }
            }
            std::fs::write(&p, bytes).unwrap();
        }
    }
    let mut out = vec![0u8; BLOCK];
    let mut misses = 0;
    for k in 1..=6u128 {
        match a.get(SequenceHash(k), &mut out) {
            Ok(()) => assert_eq!(out, block(k), "block {k}: wrong bytes served"),
            Err(_) => misses += 1,
        }
    }
    assert_eq!(misses, 4, "the 4 damaged disk blocks are misses");
    assert_eq!(
        a.contains(&[
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
            SequenceHash(4)
        ])
        .unwrap(),
        vec![false; 4],
        "dropped"
    );
}

#[test]
fn a_block_damaged_in_the_arena_is_not_spilled_when_it_carries_a_checksum() {
    // A verifying client's blocks carry the checksum verified at commit, checked again at
    // spill time. (Other blocks carry none: their bytes, written by the arena's one uid, are
    // spilled as they are and checksummed by the disk tier then.)
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 2, 16);
    let verifying = NodeClientOptions {
        verify: true,
        ..NodeClientOptions::default()
    };
    let a = NodeStore::connect(n.socket(), "m", verifying).unwrap();
    a.put(SequenceHash(1), &block(1)).unwrap();
    a.put(SequenceHash(2), &block(2)).unwrap();
    // A rogue writer flips a byte of block 1 in the arena.
    let arena = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".arena"))
        .unwrap()
        .path();
    let all = std::fs::read(&arena).unwrap();
    let at = all
        .windows(BLOCK)
        .position(|w| w == block(1).as_slice())
        .unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&arena)
        .unwrap();
    f.write_all_at(&[all[at + 5] ^ 1], (at + 5) as u64).unwrap();
    // Block 3 evicts block 1 (least recently used): its damaged bytes must not reach the disk.
    a.put(SequenceHash(3), &block(3)).unwrap();
    assert_eq!(n.stats().disk_spills, 0, "{:?}", n.stats());
    assert_eq!(
        a.contains(&[SequenceHash(1), SequenceHash(2), SequenceHash(3)])
            .unwrap(),
        vec![false, true, true]
    );
    let mut out = vec![0u8; BLOCK];
    assert!(
        a.get(SequenceHash(1), &mut out).is_err(),
        "damaged bytes were served"
    );
}
