//! The Redis backend of the remote store against a real `redis-server` (one private server per
//! test): bit-exact round trips, presence, misses, damaged values, and outages that must turn into
//! bounded errors.
#![allow(clippy::unwrap_used)]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::remote::{encode_value, from_url, HEADER_LEN};
use remote_support::{block, RedisServer};

const MIB2: usize = 2 << 20;

fn remote_err(r: Result<(), TransferError>) -> RemoteError {
    match r {
        Err(TransferError::Remote(e)) => e,
        other => panic!("expected a remote error, got {other:?}"),
    }
}

fn fast_url(s: &RedisServer) -> String {
    format!(
        "{}?connect_timeout_ms=300&io_timeout_ms=500&lookup_timeout_ms=300&pool=4&backoff_ms=400&max_backoff_ms=400",
        s.url()
    )
}

/// Sleeps past `fast_url`'s backoff window.
fn after_backoff() {
    std::thread::sleep(Duration::from_millis(450));
}

#[test]
fn round_trip_is_bit_exact() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&srv.url(), "rt")?;
    let keys: Vec<u128> = (0..6).map(|i| (i as u128) << 100 | 0xdead_beef).collect();
    for (i, &k) in keys.iter().enumerate() {
        store.put(SequenceHash(k), &block(i as u64, MIB2))?;
    }
    for (i, &k) in keys.iter().enumerate() {
        let mut out = vec![0u8; MIB2];
        store.get(SequenceHash(k), &mut out)?;
        assert!(out == block(i as u64, MIB2), "block {i} differs");
    }
    // Small blocks and overwrite with new content.
    store.put(SequenceHash(keys[0]), &block(99, 4096))?;
    let mut out = vec![0u8; 4096];
    store.get(SequenceHash(keys[0]), &mut out)?;
    assert_eq!(out, block(99, 4096));
    // The stored value is exactly header + payload under the documented key name.
    let mut raw = srv.raw()?;
    let name = format!("kvtier:v1:rt:{:032x}", keys[0]);
    let stored: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut raw)?;
    assert_eq!(stored, encode_value("rt", keys[0], &block(99, 4096)));
    assert_eq!(stored.len(), HEADER_LEN + 4096);
    Ok(())
}

#[test]
fn contains_and_missing() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&srv.url(), "c")?;
    assert_eq!(store.contains(&[])?, Vec::<bool>::new());
    store.put(SequenceHash(1), b"one")?;
    store.put(SequenceHash(3), b"three")?;
    assert_eq!(
        store.contains(&[
            SequenceHash(0),
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
            SequenceHash(1),
            SequenceHash(u128::MAX)
        ])?,
        vec![false, true, false, true, true, false]
    );
    let mut out = [0u8; 3];
    assert_eq!(
        remote_err(store.get(SequenceHash(2), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(2)
        }
    );
    // Namespaces are separate key spaces.
    let other = from_url(&srv.url(), "c2")?;
    assert_eq!(
        other.contains(&[SequenceHash(1), SequenceHash(3)])?,
        vec![false, false]
    );
    assert_eq!(
        remote_err(other.get(SequenceHash(1), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(1)
        }
    );
    Ok(())
}

#[test]
fn damaged_values_are_errors_never_bytes() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&srv.url(), "bad")?;
    let mut raw = srv.raw()?;
    let name = |k: u128| format!("kvtier:v1:bad:{k:032x}");
    let good = block(7, 1000);
    let framed = encode_value("bad", 10, &good);
    let mut out = vec![0u8; 1000];

    // Garbage over a key.
    store.put(SequenceHash(10), &good)?;
    let _: () = redis::cmd("SET")
        .arg(name(10))
        .arg(vec![0x5au8; HEADER_LEN + 1000])
        .query(&mut raw)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(10), &mut out)),
        RemoteError::Corrupt {
            key: SequenceHash(10),
            ..
        }
    ));

    // One flipped payload bit.
    let mut flipped = framed.clone();
    flipped[HEADER_LEN + 500] ^= 0x10;
    let _: () = redis::cmd("SET")
        .arg(name(10))
        .arg(&flipped)
        .query(&mut raw)?;
    let e = remote_err(store.get(SequenceHash(10), &mut out));
    assert!(
        matches!(&e, RemoteError::Corrupt { reason, .. } if reason.contains("tag mismatch")),
        "{e:?}"
    );

    // Truncated value.
    let _: () = redis::cmd("SET")
        .arg(name(10))
        .arg(&framed[..HEADER_LEN + 999])
        .query(&mut raw)?;
    assert_eq!(
        remote_err(store.get(SequenceHash(10), &mut out)),
        RemoteError::Short {
            key: SequenceHash(10),
            expected: HEADER_LEN + 1000,
            got: HEADER_LEN + 999
        }
    );

    // A value that is not even a header.
    let _: () = redis::cmd("SET").arg(name(10)).arg("x").query(&mut raw)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(10), &mut out)),
        RemoteError::Short { got: 1, .. }
    ));

    // A valid value of another key filed under this one.
    let _: () = redis::cmd("SET")
        .arg(name(11))
        .arg(&framed)
        .query(&mut raw)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(11), &mut out)),
        RemoteError::Corrupt {
            key: SequenceHash(11),
            ..
        }
    ));

    // A block of another size (e.g. another layout under the same namespace).
    store.put(SequenceHash(12), &good[..999])?;
    assert_eq!(
        remote_err(store.get(SequenceHash(12), &mut out)),
        RemoteError::SizeMismatch {
            key: SequenceHash(12),
            expected: 1000,
            stored: 999
        }
    );

    // A value of the wrong Redis type is an error too.
    let _: () = redis::cmd("DEL").arg(name(13)).query(&mut raw)?;
    let _: i64 = redis::cmd("LPUSH").arg(name(13)).arg("a").query(&mut raw)?;
    assert!(remote_err(store.get(SequenceHash(13), &mut out))
        .to_string()
        .contains("get"));

    // A fresh put repairs a damaged key.
    store.put(SequenceHash(10), &good)?;
    store.get(SequenceHash(10), &mut out)?;
    assert_eq!(out, good);
    Ok(())
}

/// Runs `f` and returns its result and how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

#[test]
fn killed_server_gives_bounded_errors_and_recovers() -> Result<()> {
    let Some(mut srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&fast_url(&srv), "kill")?;
    let data = block(1, 64 << 10);
    store.put(SequenceHash(1), &data)?;
    srv.kill();

    let mut out = vec![0u8; 64 << 10];
    let (r, t) = timed(|| store.get(SequenceHash(1), &mut out));
    assert!(
        matches!(remote_err(r), RemoteError::Unavailable { op: "get", .. }),
        "get"
    );
    assert!(t < Duration::from_secs(3), "get took {t:?}");
    after_backoff();
    let (r, t) = timed(|| store.put(SequenceHash(2), &data));
    assert!(matches!(
        remote_err(r),
        RemoteError::Unavailable { op: "put", .. }
    ));
    assert!(t < Duration::from_secs(3), "put took {t:?}");
    after_backoff();
    let (r, t) = timed(|| store.contains(&[SequenceHash(1), SequenceHash(2)]));
    assert!(matches!(
        r,
        Err(TransferError::Remote(RemoteError::Unavailable {
            op: "contains",
            ..
        }))
    ));
    assert!(t < Duration::from_secs(3), "contains took {t:?}");

    // The same server comes back (empty: persistence is off); the store reconnects by itself
    // once the backoff window has passed.
    srv.spawn()?;
    after_backoff();
    assert_eq!(store.contains(&[SequenceHash(1)])?, vec![false]);
    store.put(SequenceHash(1), &data)?;
    store.get(SequenceHash(1), &mut out)?;
    assert_eq!(out, data);
    Ok(())
}

#[test]
fn restarted_server_is_reached_through_stale_pooled_connections() -> Result<()> {
    let Some(mut srv) = RedisServer::start() else {
        return Ok(());
    };
    // pool=1: the next operation after the restart reuses the dead connection.
    let store = from_url(&format!("{}?pool=1", srv.url()), "stale")?;
    store.put(SequenceHash(5), b"abc")?;
    srv.kill();
    srv.spawn()?;
    // First use of the stale connection fails inside, is retried on a fresh one, and succeeds.
    assert_eq!(store.contains(&[SequenceHash(5)])?, vec![false]);
    store.put(SequenceHash(5), b"xyz")?;
    let mut out = [0u8; 3];
    store.get(SequenceHash(5), &mut out)?;
    assert_eq!(&out, b"xyz");
    Ok(())
}

#[test]
fn hung_server_times_out_instead_of_hanging() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&fast_url(&srv), "hang")?;
    let data = block(3, MIB2);
    store.put(SequenceHash(1), &data)?;
    srv.signal("STOP");
    let mut out = vec![0u8; MIB2];
    // Each operation, on its own, ends with Unavailable within its timeouts.
    let (r, t) = timed(|| store.get(SequenceHash(1), &mut out));
    after_backoff();
    let (r2, t2) = timed(|| store.put(SequenceHash(2), &data));
    after_backoff();
    let (r3, t3) = timed(|| store.contains(&[SequenceHash(1)]));
    // Inside the backoff window that follows, operations fail at once.
    let fast: Vec<_> = (0..20)
        .map(|_| timed(|| store.get(SequenceHash(1), &mut out)))
        .collect();
    srv.signal("CONT");
    for (name, e, t) in [
        ("get", remote_err(r), t),
        ("put", remote_err(r2), t2),
        ("contains", remote_err(r3.map(drop)), t3),
    ] {
        assert!(
            matches!(e, RemoteError::Unavailable { .. }),
            "{name}: {e:?}"
        );
        // Bound: connect 0.3 s + read/write 0.5 s each, no retry on timeouts.
        assert!(t < Duration::from_secs(3), "{name} took {t:?}");
        assert!(
            t >= Duration::from_millis(250),
            "{name} failed without waiting: {t:?}"
        );
    }
    for (r, t) in fast {
        let e = remote_err(r);
        assert!(e.to_string().contains("marked down"), "{e}");
        assert!(t < Duration::from_millis(50), "fail-fast get took {t:?}");
    }
    // After the server resumes and the window passes, operations work again (the timed-out
    // connections were dropped, not reused with a stale reply in them).
    after_backoff();
    store.get(SequenceHash(1), &mut out)?;
    assert!(out == data);
    store.put(SequenceHash(2), &data)?;
    assert_eq!(
        store.contains(&[SequenceHash(1), SequenceHash(2), SequenceHash(3)])?,
        vec![true, true, false]
    );
    Ok(())
}

#[test]
fn concurrent_threads_share_the_pool() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store: Arc<dyn RemoteStore> = from_url(&format!("{}?pool=2", srv.url()), "mt")?;
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || -> Result<()> {
                for i in 0..20u64 {
                    let key = u128::from(t) << 64 | u128::from(i);
                    let data = block(t * 1000 + i, 8192 + i as usize);
                    store.put(SequenceHash(key), &data)?;
                    let mut out = vec![0u8; data.len()];
                    store.get(SequenceHash(key), &mut out)?;
                    anyhow::ensure!(out == data, "thread {t} block {i} differs");
                }
                Ok(())
            })
        })
        .collect();
    for th in threads {
        th.join().expect("thread panicked")?;
    }
    let keys: Vec<u128> = (0..6u128).map(|t| t << 64 | 19).collect();
    assert_eq!(
        store.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())?,
        vec![true; 6]
    );
    Ok(())
}

#[test]
fn ttl_and_db_options_apply() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&format!("{}/2?ttl_s=100", srv.url()), "ttl")?;
    store.put(SequenceHash(9), b"v")?;
    let mut raw = srv.raw()?;
    let name = format!("kvtier:v1:ttl:{:032x}", 9u128);
    let _: () = redis::cmd("SELECT").arg(2).query(&mut raw)?;
    let pttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut raw)?;
    assert!(pttl > 90_000 && pttl <= 100_000, "pttl {pttl}");
    let _: () = redis::cmd("SELECT").arg(0).query(&mut raw)?;
    let exists: bool = redis::cmd("EXISTS").arg(&name).query(&mut raw)?;
    assert!(!exists, "value landed in db 0");
    Ok(())
}

/// Regression (#13, forged remote values): a Redis value copied from another block with its
/// 16-byte key field patched to the victim's key was accepted and served, because the checksum
/// covered the payload only. Format version 2 binds the key (and the namespace) into the tag; a
/// version-1 value reads as a clean miss.
#[test]
fn forged_value_with_patched_key_is_rejected_and_old_frames_miss() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&srv.url(), "forge")?;
    let mut raw = srv.raw()?;
    let name = |k: u128| format!("kvtier:v1:forge:{k:032x}");
    let (victim, donor) = (0x51u128, 0x52u128);
    store.put(SequenceHash(donor), &block(1, 4096))?;
    let mut forged: Vec<u8> = redis::cmd("GET").arg(name(donor)).query(&mut raw)?;
    forged[16..32].copy_from_slice(&victim.to_le_bytes());
    let _: () = redis::cmd("SET")
        .arg(name(victim))
        .arg(&forged)
        .query(&mut raw)?;
    let mut out = vec![0u8; 4096];
    let e = remote_err(store.get(SequenceHash(victim), &mut out));
    assert!(
        matches!(&e, RemoteError::Corrupt { key, .. } if *key == SequenceHash(victim)),
        "forged value accepted or misreported: {e:?}"
    );

    // The same value copied into another namespace under the same key.
    let other = from_url(&srv.url(), "forge2")?;
    let copied: Vec<u8> = redis::cmd("GET").arg(name(donor)).query(&mut raw)?;
    let _: () = redis::cmd("SET")
        .arg(format!("kvtier:v1:forge2:{donor:032x}"))
        .arg(&copied)
        .query(&mut raw)?;
    assert!(matches!(
        remote_err(other.get(SequenceHash(donor), &mut out)),
        RemoteError::Corrupt { .. }
    ));

    // A value written by format version 1 (payload-only checksum) is a miss, never bytes.
    let payload = block(2, 4096);
    let mut v1 = Vec::new();
    v1.extend_from_slice(b"KVT4");
    v1.extend_from_slice(&1u16.to_le_bytes());
    v1.extend_from_slice(&0u16.to_le_bytes());
    v1.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v1.extend_from_slice(&victim.to_le_bytes());
    v1.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&payload).to_le_bytes());
    v1.extend_from_slice(&payload);
    let _: () = redis::cmd("SET")
        .arg(name(victim))
        .arg(&v1)
        .query(&mut raw)?;
    assert_eq!(
        remote_err(store.get(SequenceHash(victim), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(victim)
        }
    );
    Ok(())
}

/// Regression (#13, hangs): a Redis that stopped answering stalled every request for ~19.5x
/// `io_timeout` (each caller and pool connection waited out its own timeouts, again after every
/// short backoff). Now: each operation ends within its deadline (`io_timeout` for get/put,
/// `lookup_timeout` for contains, plus the connect bound), the circuit breaker lets one probe
/// through per window and fails everything else at once, and the counters say so.
#[test]
fn stalled_server_costs_one_deadline_per_window_not_per_caller() -> Result<()> {
    use kvtier_io::storage::remote::{BreakerState, RedisOptions, RedisStore};
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let opts = RedisOptions {
        connect_timeout: Duration::from_millis(200),
        io_timeout: Duration::from_millis(400),
        lookup_timeout: Duration::from_millis(100),
        pool_size: 4,
        backoff: Duration::from_millis(150),
        max_backoff: Duration::from_millis(600),
        ..RedisOptions::default()
    };
    let store = Arc::new(RedisStore::open(&srv.url(), "stall", opts)?);
    store.put(SequenceHash(1), &block(1, 4096))?;
    srv.signal("STOP");
    let run_for = Duration::from_millis(2500);
    let t0 = Instant::now();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut worst = (Duration::ZERO, Duration::ZERO); // (get/put, contains)
                let mut out = vec![0u8; 4096];
                let mut n = 0u64;
                while t0.elapsed() < run_for {
                    let (r, t) = timed(|| {
                        if i % 2 == 0 {
                            store.get(SequenceHash(1), &mut out)
                        } else {
                            store.put(SequenceHash(2), &out)
                        }
                    });
                    assert!(r.is_err(), "a stopped server answered");
                    worst.0 = worst.0.max(t);
                    let (r, t) = timed(|| store.contains(&[SequenceHash(1), SequenceHash(2)]));
                    assert!(r.is_err());
                    worst.1 = worst.1.max(t);
                    n += 2;
                }
                (worst, n)
            })
        })
        .collect();
    let mut ops = 0;
    for th in threads {
        let ((io, lookup), n) = th.join().unwrap();
        ops += n;
        // Bound: connect (200 ms) + deadline, with slack for a loaded 2-core CI machine running
        // other test binaries at once (the defect was ~19.5x io_timeout: 7.8 s here).
        assert!(
            io < Duration::from_millis(200 + 2 * 400 + 1500),
            "get/put took {io:?}"
        );
        assert!(
            lookup < Duration::from_millis(100 + 2 * 100 + 1500),
            "contains took {lookup:?}"
        );
    }
    let s = store.breaker_stats();
    srv.signal("CONT");
    // Windows of 150, 300, 600, 600... ms over 2.5 s: about 6 probes. Everything else failed fast.
    assert!(s.opened >= 1 && s.probes >= 2, "{s:?}");
    // At the first failure every caller already admitted (8 threads; 4 of them hold the pool's
    // connections) may still reach the server once; after that, one probe per window.
    assert!(
        s.attempted <= 8 + s.probes + 1,
        "more than one operation per window reached the stalled server: {s:?} of {ops} ops"
    );
    assert!(s.short_circuited + s.attempted >= ops, "{s:?} vs {ops}");
    assert_ne!(s.state, BreakerState::Closed);
    // Once the server answers again, the next probe closes the breaker.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut out = vec![0u8; 4096];
    while store.get(SequenceHash(1), &mut out).is_err() {
        assert!(
            Instant::now() < deadline,
            "never recovered: {:?}",
            store.breaker_stats()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(store.breaker_stats().state, BreakerState::Closed);
    Ok(())
}

/// Regression (#28): a 1 GB value under a block's key was read whole (54 s, 3.2 GB). A value
/// larger than one frame is refused from the reply's length prefix with a typed error, having
/// read at most its header, and the store goes on working (the connection holding the rest of
/// the reply was dropped).
#[test]
fn oversized_value_is_refused_without_reading_it() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = from_url(&srv.url(), "big")?;
    let big = encode_value("big", 5, &vec![1u8; 64 << 20]);
    let mut raw = srv.raw()?;
    let _: () = redis::cmd("SET")
        .arg(format!("kvtier:v1:big:{:032x}", 5u128))
        .arg(&big)
        .query(&mut raw)?;
    drop(big);
    let mut out = vec![0u8; 4096];
    let (r, t) = timed(|| store.get(SequenceHash(5), &mut out));
    assert_eq!(
        remote_err(r),
        RemoteError::SizeMismatch {
            key: SequenceHash(5),
            expected: 4096,
            stored: 64 << 20
        }
    );
    assert!(t < Duration::from_secs(2), "took {t:?}");
    store.put(SequenceHash(6), &block(6, 4096))?;
    store.get(SequenceHash(6), &mut out)?;
    assert_eq!(out, block(6, 4096));
    Ok(())
}
