//! Stores into granted slots against a real node: after a first store the connection holds a
//! slot per pair, so the next store of as many pairs sends no `Reserve` (one round trip) and is
//! bit-exact; a key held already is done without replacing the stored bytes; a failed copy
//! publishes nothing; a connection broken before the publishes were answered fails every pair;
//! a bad `Granted` ends the connection; the pool is bounded; a store does not wait for the grants
//! the store before it asked for.
#![allow(clippy::unwrap_used)]
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteStore;

use super::*;
use crate::storage::node::batch::tests::{client, node};
use crate::storage::node::protocol::{read_frame, write_frame, ItemAnswer, PutAnswer};
use crate::storage::node::{NodeClientOptions, NodeServer, NodeStore};
use crate::sys::sock;

const BYTES: usize = 64;

fn block(key: u128, salt: u8) -> Vec<u8> {
    (0..BYTES)
        .map(|i| (i as u128 * 31 + key * 7) as u8 ^ salt)
        .collect()
}

/// Stores `keys` through `s`'s direct path, writing `block(key, salt)` into each slot; the
/// pairs each call of the device leg got.
fn store(s: &NodeStore, keys: &[u128], salt: u8) -> (Vec<PairResult>, Vec<usize>) {
    let (c, arena) = s.job_conn(1).unwrap();
    s.pool(c);
    let base = arena.addr(0, 1).unwrap();
    let mut calls = Vec::new();
    let mut fill = |items: &[(usize, usize)]| {
        calls.push(items.len());
        for &(k, addr) in items {
            arena
                .write((addr - base) as u64, &block(keys[k], salt))
                .unwrap();
        }
        Vec::new()
    };
    let out = s.store_direct(keys, BYTES, false, &mut fill).unwrap();
    (out, calls)
}

/// The blocks of `keys` as the node serves them.
fn load(s: &NodeStore, keys: &[u128]) -> Vec<Result<Vec<u8>, String>> {
    let (c, arena) = s.job_conn(1).unwrap();
    s.pool(c);
    let base = arena.addr(0, 1).unwrap();
    let mut got = vec![Vec::new(); keys.len()];
    let out = s
        .load_direct(
            keys,
            BYTES,
            false,
            Box::new(|items: &[(usize, usize)]| {
                for &(k, addr) in items {
                    let mut b = vec![0u8; BYTES];
                    arena.read((addr - base) as u64, &mut b).unwrap();
                    got[k] = b;
                }
                Vec::new()
            }),
        )
        .unwrap();
    out.into_iter()
        .zip(got)
        .map(|(r, b)| r.map(|()| b))
        .collect()
}

/// A scripted node's answer to a `Reserve` of `n` keys: slots 0..n, ids 1..=n.
fn reserved(n: usize) -> Reply {
    let slot = |i: u64| PutAnswer::Slot {
        id: i + 1,
        offset: i * BYTES as u64,
    };
    Reply::Reserved((0..n as u64).map(slot).collect())
}

/// Every pair failed for the node, none reported done.
fn all_failed(out: &[PairResult]) {
    for (k, r) in out.iter().enumerate() {
        assert!(
            r.as_ref().is_err_and(|e| e.contains("node")),
            "pair {k} reported done, never answered: {r:?}"
        );
    }
}

fn wait_granted(n: &NodeServer, bytes: u64) {
    let t = Instant::now();
    while n.stats().bytes_granted != bytes {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "granted {} bytes, not {bytes}",
            n.stats().bytes_granted
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_store_into_granted_slots_is_bit_exact_in_one_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 64 * 16 * BYTES as u64);
    let s = client(&n, false);
    let first: Vec<u128> = (0..64).collect();
    let second: Vec<u128> = (100..164).collect();
    let before = n.stats().requests;
    let (out, _) = store(&s, &first, 0);
    assert!(out.iter().all(|r| r.is_ok()));
    // Reserve, Finish, then a Grant of twice the job answered while the engine does other work.
    wait_granted(&n, 128 * BYTES as u64);
    assert_eq!(n.stats().requests - before, 3);
    let before = n.stats().requests;
    let (out, calls) = store(&s, &second, 0);
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(calls, vec![64], "one copy of every pair");
    assert_eq!(s.stores_granted(), 1);
    // No Reserve: the publishes (one round trip) and the Grant that tops the pool up again.
    wait_granted(&n, 128 * BYTES as u64);
    assert_eq!(n.stats().requests - before, 2);
    assert_eq!(n.stats().puts, 128);
    let all: Vec<u128> = first.iter().chain(&second).copied().collect();
    for (k, got) in all.iter().zip(load(&s, &all)) {
        assert_eq!(got.unwrap(), block(*k, 0), "key {k}");
    }
}

#[test]
fn a_key_held_already_is_done_without_replacing_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 64 * 16 * BYTES as u64);
    let s = client(&n, false);
    let keys: Vec<u128> = (0..16).collect();
    assert!(store(&s, &keys, 0).0.iter().all(|r| r.is_ok()));
    // The same keys again, other bytes, into granted slots: done, nothing replaced.
    let (out, calls) = store(&s, &keys, 0xff);
    assert_eq!(calls, vec![16], "went through the granted slots");
    assert!(out.iter().all(|r| r.is_ok()));
    assert_eq!(n.stats().puts, 16);
    for (k, got) in keys.iter().zip(load(&s, &keys)) {
        assert_eq!(got.unwrap(), block(*k, 0), "key {k} replaced");
    }
}

#[test]
fn a_failed_copy_publishes_nothing_and_its_slot_stays_granted() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 64 * 16 * BYTES as u64);
    let s = client(&n, false);
    assert!(store(&s, &[1, 2, 3, 4], 0).0.iter().all(|r| r.is_ok()));
    wait_granted(&n, 8 * BYTES as u64);
    let keys: Vec<u128> = vec![10, 11, 12, 13];
    let mut leg = |items: &[(usize, usize)]| {
        assert_eq!(items.len(), 4);
        vec![(2, "device copy failed".to_string())]
    };
    let out = s.store_direct(&keys, BYTES, false, &mut leg).unwrap();
    assert_eq!(out[2], Err("device copy failed".into()));
    assert!(out.iter().enumerate().all(|(k, r)| k == 2 || r.is_ok()));
    let held = s.contains(&keys.iter().map(|k| SequenceHash(*k)).collect::<Vec<_>>());
    assert_eq!(held.unwrap(), vec![true, true, false, true]);
    // Its slot went back to the pool: five granted slots kept, three asked for again.
    wait_granted(&n, 8 * BYTES as u64);
}

#[test]
fn a_connection_broken_before_the_publishes_were_answered_fails_every_pair() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = node(dir.path(), 64 * 16 * BYTES as u64);
    let s = client(&n, false);
    assert!(store(&s, &[1, 2, 3, 4], 0).0.iter().all(|r| r.is_ok()));
    wait_granted(&n, 8 * BYTES as u64);
    let mut leg = |_: &[(usize, usize)]| {
        n.shutdown(Duration::from_secs(2));
        Vec::new()
    };
    let out = s
        .store_direct(&[7, 8, 9, 10], BYTES, false, &mut leg)
        .unwrap();
    all_failed(&out);
}

#[test]
fn pools_are_bounded_and_grow_to_the_largest_job() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 1024 * 16 * BYTES as u64);
    let s = client(&n, false);
    // A job longer than a pool holds asks for no grant.
    let big: Vec<u128> = (0..JOB_MAX as u128 + 1).collect();
    assert!(store(&s, &big, 0).0.iter().all(|r| r.is_ok()));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(n.stats().bytes_granted, 0);
    let a: Vec<u128> = (1000..1008).collect();
    assert!(store(&s, &a, 0).0.iter().all(|r| r.is_ok()));
    wait_granted(&n, 16 * BYTES as u64);
    // A larger job than the pool: reserved as before, then the pool grows to twice it.
    let b: Vec<u128> = (2000..2020).collect();
    let before = n.stats().requests;
    assert!(store(&s, &b, 0).0.iter().all(|r| r.is_ok()));
    wait_granted(&n, 40 * BYTES as u64);
    assert_eq!(n.stats().requests - before, 3, "Reserve, Finish, Grant");
    // A smaller one takes from the pool, which is topped up to twice the largest job again.
    let c: Vec<u128> = (3000..3005).collect();
    let (out, _) = store(&s, &c, 0);
    assert!(out.iter().all(|r| r.is_ok()));
    wait_granted(&n, 40 * BYTES as u64);
}

#[test]
fn a_grant_answer_that_is_not_one_ends_the_connection() {
    let mut g = Granted {
        arena_bytes: 1000,
        ..Granted::default()
    };
    // The answer to a Grant of `asked` (bytes, count), owed when it comes.
    let mut answer = |asked: (u64, u32), mut r: Reply| {
        g.owed.push_back(asked);
        g.take_reply(&mut r)
    };
    let ok = (0u64, 900u64);
    assert!(answer((100, 2), Reply::Granted(vec![ok])));
    assert!(
        !answer((100, 2), Reply::Granted(vec![(1, 901)])),
        "past the arena"
    );
    assert!(
        !answer((100, 2), Reply::Granted(vec![(1, u64::MAX)])),
        "overflow"
    );
    assert!(
        !answer((100, 1), Reply::Granted(vec![ok, ok])),
        "more than asked"
    );
    assert!(
        !answer((100, 1), Reply::Items(Vec::new())),
        "another answer"
    );
    assert!(
        !g.take_reply(&mut Reply::Granted(vec![ok])),
        "an answer nothing asked for"
    );
    assert_eq!(g.take(100, 1), Some(vec![ok]));
    assert_eq!(g.take(100, 1), None);
}

/// A node of this uid at a socket in `dir` that welcomes one client with an arena of
/// `arena_bytes` (a real file, passed as the real node does) and then answers each request with
/// `script` (`None`: it closes the connection without answering, as a node that dies does).
fn scripted_node(
    dir: &Path,
    arena_bytes: u64,
    mut script: impl FnMut(&Request) -> Option<Reply> + Send + 'static,
) -> PathBuf {
    let path = dir.join("scripted.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let arena = tempfile::tempfile_in(dir).unwrap();
    arena.set_len(arena_bytes).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        while let Ok(Some(req)) = read_frame::<Request>(&mut s) {
            let reply = match &req {
                Request::Hello { .. } => Some(Reply::Welcome {
                    arena_bytes,
                    private: true,
                }),
                other => script(other),
            };
            let Some(reply) = reply else { return };
            write_frame(&mut s, &reply).unwrap();
            if matches!(reply, Reply::Welcome { .. }) {
                sock::send_fd(&s, arena.as_raw_fd()).unwrap();
            }
        }
    });
    path
}

#[test]
fn a_node_that_dies_after_reading_the_publishes_fails_every_pair() {
    let dir = tempfile::tempdir().unwrap();
    let sock = scripted_node(dir.path(), 64 * BYTES as u64, |req| match req {
        Request::Reserve { keys, .. } => Some(reserved(keys.len())),
        Request::Grant { count, .. } => Some(Reply::Granted(
            (0..u64::from(*count))
                .map(|i| (100 + i, (8 + i) * BYTES as u64))
                .collect(),
        )),
        // The commits of the first store are answered; the publishes of the second never are.
        Request::Finish(ends) if matches!(ends[0], PutEnd::Commit { .. }) => {
            Some(Reply::Items(vec![ItemAnswer::Done; ends.len()]))
        }
        _ => None,
    });
    let s = NodeStore::connect(&sock, "m", NodeClientOptions::default()).unwrap();
    assert!(store(&s, &[1, 2, 3, 4], 0).0.iter().all(|r| r.is_ok()));
    let (out, calls) = store(&s, &[5, 6, 7, 8], 0);
    assert_eq!(calls, vec![4], "copied into the granted slots");
    for (k, r) in out.iter().enumerate() {
        assert!(
            r.as_ref().is_err_and(|e| e.contains("node")),
            "pair {k} reported done, never answered: {r:?}"
        );
    }
}

#[test]
fn a_store_does_not_wait_for_the_grants_the_store_before_it_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let answered = Arc::new(AtomicBool::new(false));
    let (flag, mut grants, mut next) = (Arc::clone(&answered), 0, 100u64);
    let sock = scripted_node(dir.path(), 64 * BYTES as u64, move |req| match req {
        Request::Reserve { keys, .. } => Some(reserved(keys.len())),
        Request::Grant { count, .. } => {
            grants += 1;
            // The second Grant (after the first store through grants) is slow to answer.
            if grants == 2 {
                std::thread::sleep(Duration::from_secs(2));
                flag.store(true, Ordering::SeqCst);
            }
            let slots = (0..u64::from(*count)).map(|_| {
                next += 1;
                (next, (next % 32 + 16) * BYTES as u64)
            });
            Some(Reply::Granted(slots.collect()))
        }
        Request::Finish(ends) => Some(Reply::Items(vec![ItemAnswer::Done; ends.len()])),
        _ => None,
    });
    let s = NodeStore::connect(&sock, "m", NodeClientOptions::default()).unwrap();
    // Reserved (no grants yet); then through grants, which asks for more (answered late).
    assert!(store(&s, &[1, 2, 3, 4], 0).0.iter().all(|r| r.is_ok()));
    assert!(store(&s, &[5, 6, 7, 8], 0).0.iter().all(|r| r.is_ok()));
    assert_eq!(s.stores_granted(), 1);
    // The pool still holds a job's worth: the copy starts before the late answer came.
    let (c, arena) = s.job_conn(1).unwrap();
    s.pool(c);
    let mut early = None;
    let mut leg = |items: &[(usize, usize)]| {
        early = Some(!answered.load(Ordering::SeqCst));
        let _ = (&arena, items);
        Vec::new()
    };
    let out = s
        .store_direct(&[9, 10, 11, 12], BYTES, false, &mut leg)
        .unwrap();
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(s.stores_granted(), 2);
    assert_eq!(
        early,
        Some(true),
        "the copy waited for the grants it did not need"
    );
}

#[test]
fn a_connection_left_idle_gives_its_grants_back() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), 64 * 16 * BYTES as u64);
    let opts = NodeClientOptions {
        grants_idle: Duration::from_secs(1),
        ..NodeClientOptions::default()
    };
    let s = NodeStore::connect(n.socket(), "m", opts).unwrap();
    let first: Vec<u128> = (0..64).collect();
    let (out, _) = store(&s, &first, 0);
    assert!(out.iter().all(|r| r.is_ok()));
    // The grants the store asked for arrive, then go back once the connection sat idle.
    let t = Instant::now();
    let mut most = 0;
    while n.stats().bytes_granted != 0 || most == 0 {
        most = most.max(n.stats().bytes_granted);
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "granted {most} bytes; none given back"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(most, 128 * BYTES as u64);
    // Stores go on as before (reserving by key: no slots left).
    let second: Vec<u128> = (100..164).collect();
    let (out, calls) = store(&s, &second, 1);
    assert!(out.iter().all(|r| r.is_ok()), "{out:?}");
    assert_eq!(calls, vec![64]);
    assert_eq!(s.stores_granted(), 0);
    for (k, got) in first.iter().zip(load(&s, &first)) {
        assert_eq!(got.unwrap(), block(*k, 0), "key {k}");
    }
    for (k, got) in second.iter().zip(load(&s, &second)) {
        assert_eq!(got.unwrap(), block(*k, 1), "key {k}");
    }
}
