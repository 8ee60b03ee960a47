//! The direct paths' batches against a real node: a connection broken between the phases fails
//! every pair still open (never reports it done), a job longer than `MAX_BATCH` is split, and a
//! verifying connection never goes direct (its jobs are staged: `staged_tests.rs`).
#![allow(clippy::unwrap_used)]
use std::time::Duration;

use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteStore;

use super::*;
use crate::storage::node::{
    NodeClientOptions, NodeOptions, NodeServer, NodeStore, MAX_BATCH as BATCH,
};

/// A node of `capacity` bytes in `dir`. Shared with `staged_tests.rs`.
pub(crate) fn node(dir: &std::path::Path, capacity: u64) -> NodeServer {
    let mut o = NodeOptions::new(dir.join("node.sock"), capacity);
    o.shm_dir = dir.to_path_buf();
    NodeServer::start(&o).unwrap()
}

/// A client of `n`; `verify`: one that checks every block (`NodeClientOptions::verify`).
pub(crate) fn client(n: &NodeServer, verify: bool) -> NodeStore {
    let opts = NodeClientOptions {
        verify,
        // These tests count the node's requests and granted bytes: idle grants stay (only
        // `a_connection_left_idle_gives_its_grants_back` has them given back).
        grants_idle: std::time::Duration::from_secs(3600),
        ..NodeClientOptions::default()
    };
    NodeStore::connect(n.socket(), "m", opts).unwrap()
}

/// A device leg that copies nothing and fails nothing.
fn no_copy() -> Box<DeviceLeg<'static>> {
    Box::new(|_: &[(usize, usize)]| Vec::new())
}

/// The same, called once per part.
pub(crate) fn no_copy_parts(_: &[(usize, usize)]) -> Vec<(usize, String)> {
    Vec::new()
}

#[test]
fn a_connection_broken_between_reserve_and_finish_fails_every_open_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(dir.path(), 16 * 64);
    let s = client(&n, false);
    s.put(SequenceHash(5), &[5u8; 64]).unwrap();
    let keys: Vec<u128> = (0..6).collect();
    let mut copied = 0;
    // The node goes away while the device copy runs: its connections end, its books with it.
    let mut leg = |items: &[(usize, usize)]| {
        copied = items.len();
        n.shutdown(Duration::from_secs(2));
        Vec::new()
    };
    let out = s.store_direct(&keys, 64, false, &mut leg).unwrap();
    assert_eq!(copied, 5);
    for (k, r) in out.iter().enumerate().take(5) {
        assert!(
            r.as_ref().is_err_and(|e| e.contains("node")),
            "pair {k} reported done after the break: {r:?}"
        );
    }
    assert_eq!(out[5], Ok(()), "stored before: done without a copy");
}

#[test]
fn a_connection_broken_during_the_copy_fails_every_open_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(dir.path(), 16 * 64);
    let s = client(&n, false);
    for k in 0..4u128 {
        s.put(SequenceHash(k), &[k as u8; 64]).unwrap();
    }
    let keys: Vec<u128> = (0..6).collect();
    let leg = Box::new(|_: &[(usize, usize)]| {
        n.shutdown(Duration::from_secs(2));
        Vec::new()
    });
    let out = s.load_direct(&keys, 64, false, leg).unwrap();
    for (k, r) in out.iter().enumerate() {
        assert!(r.is_err(), "pair {k} reported done after the break: {r:?}");
    }
    assert!(
        out[0].as_ref().unwrap_err().starts_with("node: "),
        "{out:?}"
    );
    assert!(
        out[5].as_ref().unwrap_err().contains("not present"),
        "{out:?}"
    );
}

#[test]
fn a_job_longer_than_a_batch_takes_one_round_trip_per_batch_and_phase() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 2 * BATCH as u64 + 8);
    let s = client(&n, false);
    let keys: Vec<u128> = (0..BATCH as u128 + 1).collect();
    let before = n.stats().requests;
    // Stores go in parts (`pipeline.rs`): 4 of 1,025 pairs, one Reserve and one Finish each.
    let out = s.store_direct(&keys, 2, false, &mut no_copy_parts).unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{:?}", &out[..4]);
    assert_eq!(n.stats().requests - before, 8, "4 Reserve + 4 Finish");
    assert_eq!(n.stats().puts, keys.len() as u64);
    let before = n.stats().requests;
    // An ordered load leases every pair before its one copy.
    let out = s.load_direct(&keys, 2, false, no_copy()).unwrap();
    assert!(out.iter().all(|r| r.is_ok()));
    assert_eq!(n.stats().requests - before, 4, "2 Lease + 2 EndLeases");
}

#[test]
fn a_private_node_goes_direct_hashing_nothing_and_a_verifying_connection_never_does() {
    for verify in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let n = node(dir.path(), 16 * 64);
        let s = client(&n, verify);
        let keys: Vec<u128> = (0..8).collect();
        let before = n.stats().requests;
        let stored = s.store_direct(&keys, 64, false, &mut no_copy_parts);
        let loaded = s.load_direct(&keys, 64, false, no_copy());
        if verify {
            // A slot's checksum says nothing about what a DMA moves a moment apart from it.
            assert!(
                stored.is_none() && loaded.is_none(),
                "a verifying job went direct"
            );
            assert_eq!(
                n.stats().requests - before,
                0,
                "nothing sent for a staged job"
            );
        } else {
            assert!(stored.unwrap().iter().all(|r| r.is_ok()));
            assert!(loaded.unwrap().iter().all(|r| r.is_ok()));
            assert_eq!(
                n.stats().requests - before,
                5,
                "one round trip per phase, and a Grant to top the pool up"
            );
        }
        assert_eq!(s.blocks_hashed(), 0, "verify: {verify}");
        assert_eq!(n.stats().verified, 0, "verify: {verify}");
    }
}
