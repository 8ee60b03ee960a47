//! Direct jobs in parts against a real node: bit-exact through the arena, one round trip per
//! part and phase with every part's opening sent before the previous part's copy, and a
//! connection broken in the middle of a job: the parts the node answered done stay done, every
//! other pair fails (never reported done).
#![allow(clippy::unwrap_used)]
use std::time::Duration;

use super::*;
use crate::storage::node::batch::tests::{client, no_copy_parts, node};

fn block(key: u128, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u128 * 13 + key * 101 + 7) as u8)
        .collect()
}

#[test]
fn parts_split_evenly_above_twice_the_minimum() {
    assert_eq!(part_len(1), 1);
    assert_eq!(part_len(2 * MIN_PART - 1), 2 * MIN_PART - 1);
    assert_eq!(part_len(2 * MIN_PART), MIN_PART);
    assert_eq!(part_len(512), 128);
    assert_eq!(part_len(600), 150);
    assert_eq!(part_len(100 * MAX_BATCH), MAX_BATCH);
}

#[test]
fn a_job_in_parts_is_bit_exact_with_one_round_trip_per_part_and_phase() {
    const N: usize = 600;
    const BYTES: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), (2 * N * BYTES) as u64);
    let s = client(&n, false);
    let (c, arena) = s.job_conn(1).unwrap();
    s.pool(c);
    let base = arena.addr(0, 1).unwrap();
    let keys: Vec<u128> = (0..N as u128).map(|k| 0x5000 + k).collect();
    let before = n.stats().requests;
    let mut parts = Vec::new();
    let mut fill = |items: &[(usize, usize)]| {
        parts.push(items.iter().map(|i| i.0).collect::<Vec<_>>());
        for &(k, addr) in items {
            arena
                .write((addr - base) as u64, &block(keys[k], BYTES))
                .unwrap();
        }
        Vec::new()
    };
    let out = s.store_direct(&keys, BYTES, false, &mut fill).unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    let want: Vec<Vec<usize>> = (0..4).map(|p| (p * 150..(p + 1) * 150).collect()).collect();
    assert_eq!(parts, want, "four parts in order, each copied once");
    assert_eq!(
        n.stats().requests - before,
        8,
        "a Reserve and a Finish per part"
    );
    assert_eq!(n.stats().puts, N as u64);

    // Loaded in parts (reversed keys), every byte the one stored under its key.
    let back: Vec<u128> = keys.iter().rev().copied().collect();
    let before = n.stats().requests;
    let mut got = vec![Vec::new(); N];
    let mut read = |items: &[(usize, usize)]| {
        for &(k, addr) in items {
            let mut b = vec![0u8; BYTES];
            arena.read((addr - base) as u64, &mut b).unwrap();
            got[k] = b;
        }
        Vec::new()
    };
    let out = s.load_in_parts(&back, BYTES, false, &mut read).unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    for (k, key) in back.iter().enumerate() {
        assert_eq!(got[k], block(*key, BYTES), "pair {k} (key {key:#x})");
    }
    assert_eq!(
        n.stats().requests - before,
        8,
        "a Lease and an EndLeases per part"
    );
    assert_eq!(n.stats().gets, N as u64);
}

#[test]
fn a_connection_broken_midway_fails_every_pair_the_node_did_not_answer_done() {
    const N: usize = 512; // four parts of 128
    for load in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mut n = node(dir.path(), (N * 64) as u64);
        let s = client(&n, false);
        let keys: Vec<u128> = (0..N as u128).collect();
        if load {
            assert!(s
                .store_direct(&keys, 64, false, &mut no_copy_parts)
                .unwrap()
                .iter()
                .all(|r| r.is_ok()));
        }
        // The node goes away while the third part is copied, once it has answered every
        // request sent so far (R0, R1, E0, R2, E1, R3: `pipeline.rs`): parts 0 and 1 were
        // answered done, parts 2 and 3 can never be.
        let before = n.stats().requests;
        let mut calls = 0;
        let mut leg = |_: &[(usize, usize)]| {
            calls += 1;
            if calls == 3 {
                let t = std::time::Instant::now();
                while n.stats().requests < before + 6 {
                    assert!(t.elapsed() < Duration::from_secs(20), "the node stalled");
                    std::thread::sleep(Duration::from_millis(1));
                }
                n.shutdown(Duration::from_secs(2));
            }
            Vec::new()
        };
        let out = if load {
            s.load_in_parts(&keys, 64, false, &mut leg).unwrap()
        } else {
            s.store_direct(&keys, 64, false, &mut leg).unwrap()
        };
        assert!(
            (3..=4).contains(&calls),
            "{calls} parts copied (load: {load})"
        );
        let failed = |r: &PairResult| r.as_ref().is_err_and(|e| e.contains("node"));
        for (k, r) in out.iter().enumerate() {
            match k / 128 {
                0 | 1 => assert_eq!(
                    *r,
                    Ok(()),
                    "pair {k}: its part was answered done (load: {load})"
                ),
                _ => assert!(
                    failed(r),
                    "pair {k} reported done after the break (load: {load}): {r:?}"
                ),
            }
        }
    }
}
