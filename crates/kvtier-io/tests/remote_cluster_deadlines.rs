//! Regression (#28): in cluster mode the Redis store keeps the single server's bound
//! `min(connect, t) + 2t` for every operation, and follows `MOVED` and `ASK` as the Redis Cluster
//! specification says, against scripted fake nodes in this test: a node that hangs, a seed that
//! drips its slot map, redirects in a loop. Before, cluster mode ran on the `redis` crate's
//! `ClusterConnection`, whose timeout applied to each read (a dripping node held an operation as
//! long as it kept sending) and which read values whole, of any size.
#![allow(clippy::unwrap_used)]
mod deadline_support;

use kvtier::hash::SequenceHash;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadline_support::{assert_unavailable_within, timed};
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::remote::{encode_value, RedisOptions, RedisStore, HEADER_LEN};

const CONNECT: Duration = Duration::from_millis(200);
const T: Duration = Duration::from_millis(300);
/// `min(connect, t) + 2t`, plus slack for a loaded 2-core CI machine.
const BOUND: Duration = Duration::from_millis(200 + 2 * 300 + 700);
const BLOCK: usize = 4096;
const NS: &str = "cd";

/// What a fake node does with one command.
enum Act {
    Reply(Vec<u8>),
    /// Sends the bytes one at a time, `gap` apart, then hangs.
    Drip(Vec<u8>, Duration),
    Hang,
}

type Script = dyn Fn(&[Vec<u8>]) -> Act + Send + Sync;

/// A fake cluster node on loopback running `script` on every command it reads; it records the
/// commands' names.
struct Node {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

fn read_command(r: &mut BufReader<TcpStream>) -> Option<Vec<Vec<u8>>> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let n: usize = line.trim().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).ok()?;
        let len: usize = line.trim().strip_prefix('$')?.parse().ok()?;
        let mut a = vec![0u8; len + 2];
        r.read_exact(&mut a).ok()?;
        a.truncate(len);
        args.push(a);
    }
    Some(args)
}

fn node(script: Arc<Script>) -> Node {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let (script, log) = (Arc::clone(&script), Arc::clone(&log));
            std::thread::spawn(move || {
                let mut w = s.try_clone().unwrap();
                let mut r = BufReader::new(s);
                while let Some(cmd) = read_command(&mut r) {
                    log.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&cmd[0]).to_uppercase());
                    match script(&cmd) {
                        Act::Reply(b) => {
                            if w.write_all(&b).is_err() {
                                return;
                            }
                        }
                        Act::Drip(b, gap) => {
                            for x in b {
                                if w.write_all(&[x]).is_err() {
                                    return;
                                }
                                std::thread::sleep(gap);
                            }
                            std::thread::sleep(Duration::from_secs(20));
                            return;
                        }
                        Act::Hang => {
                            std::thread::sleep(Duration::from_secs(20));
                            return;
                        }
                    }
                }
            });
        }
    });
    Node { port, seen }
}

/// `CLUSTER SLOTS`: every slot on the node at `port`.
fn slots_on(port: u16) -> Vec<u8> {
    format!("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:{port}\r\n").into_bytes()
}

/// The hash slot a real node computes for `key` (keys here carry no hash tag).
fn slot_of(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key) % 16384
}

fn is(cmd: &[Vec<u8>], name: &str) -> bool {
    cmd[0].eq_ignore_ascii_case(name.as_bytes())
}

fn store(seed: u16) -> RedisStore {
    let opts = RedisOptions {
        connect_timeout: CONNECT,
        io_timeout: T,
        lookup_timeout: T,
        pool_size: 2,
        backoff: Duration::ZERO,
        cluster_seeds: vec![format!("redis://127.0.0.1:{seed}")],
        ..RedisOptions::default()
    };
    RedisStore::open("redis://cluster", NS, opts).unwrap()
}

fn assert_unavailable_in_bound<V: std::fmt::Debug>(
    what: &str,
    r: Result<V, TransferError>,
    took: Duration,
) {
    assert_unavailable_within(what, r, took, Duration::ZERO, BOUND);
}

/// The `GET` reply holding key `k`'s frame of `BLOCK` bytes of `fill`.
fn get_reply(k: u128, fill: u8) -> Vec<u8> {
    let mut r = format!("${}\r\n", HEADER_LEN + BLOCK).into_bytes();
    r.extend(encode_value(NS, k, &vec![fill; BLOCK]));
    r.extend_from_slice(b"\r\n");
    r
}

#[test]
fn hung_node_every_operation_within_the_bound() {
    let hung = node(Arc::new(|_: &[Vec<u8>]| Act::Hang));
    let hp = hung.port;
    let seed = node(Arc::new(move |c: &[Vec<u8>]| {
        if is(c, "CLUSTER") {
            Act::Reply(slots_on(hp))
        } else {
            Act::Hang
        }
    }));
    let s = store(seed.port);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert_unavailable_in_bound("get", r, t);
    let (r, t) = timed(|| s.put(SequenceHash(1), &out));
    assert_unavailable_in_bound("put", r, t);
    let keys: Vec<u128> = (0..500).collect();
    let (r, t) = timed(|| s.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>()));
    assert_unavailable_in_bound("contains", r, t);
    assert!(hung.seen.lock().unwrap().contains(&"GET".to_string()));
}

#[test]
fn dripping_slot_map_and_node_within_the_bound() {
    let seed = node(Arc::new(|c: &[Vec<u8>]| {
        if is(c, "CLUSTER") {
            Act::Drip(slots_on(1), Duration::from_millis(20))
        } else {
            Act::Hang
        }
    }));
    let s = store(seed.port);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert_unavailable_in_bound("get (slot map dripping)", r, t);

    let dripping = node(Arc::new(|c: &[Vec<u8>]| {
        let k = 5u128;
        if is(c, "GET") {
            Act::Drip(get_reply(k, 1), Duration::from_millis(20))
        } else {
            Act::Drip(b":1\r\n".repeat(100), Duration::from_millis(20))
        }
    }));
    let dp = dripping.port;
    let seed = node(Arc::new(move |_: &[Vec<u8>]| Act::Reply(slots_on(dp))));
    let s = store(seed.port);
    let (r, t) = timed(|| s.get(SequenceHash(5), &mut out));
    assert_unavailable_in_bound("get (value dripping)", r, t);
    let (r, t) = timed(|| s.contains(&(0..100).map(SequenceHash).collect::<Vec<_>>()));
    assert_unavailable_in_bound("contains (replies dripping)", r, t);
}

/// `MOVED` is followed and remembered; `ASK` is followed after `ASKING` and not remembered;
/// a value reached through a redirect is still checked against its key.
#[test]
fn moved_and_ask_are_followed() {
    let k = 9u128;
    let b = node(Arc::new(move |c: &[Vec<u8>]| {
        if is(c, "ASKING") {
            Act::Reply(b"+OK\r\n".to_vec())
        } else if is(c, "GET") {
            Act::Reply(get_reply(k, 7))
        } else if is(c, "EXISTS") {
            Act::Reply(b":1\r\n".to_vec())
        } else {
            Act::Reply(b"+OK\r\n".to_vec())
        }
    }));
    let bp = b.port;
    // Node A owns every slot in the map, but answers MOVED (or ASK) to B for every key.
    let ask = Arc::new(Mutex::new(false));
    let asking = Arc::clone(&ask);
    let a = node(Arc::new(move |c: &[Vec<u8>]| {
        let kind = if *asking.lock().unwrap() {
            "ASK"
        } else {
            "MOVED"
        };
        let slot = slot_of(&c[1]);
        Act::Reply(format!("-{kind} {slot} 127.0.0.1:{bp}\r\n").into_bytes())
    }));
    let ap = a.port;
    let seed = node(Arc::new(move |_: &[Vec<u8>]| Act::Reply(slots_on(ap))));
    let s = store(seed.port);

    // MOVED: followed, and the next operation on that slot goes straight to B.
    let mut out = vec![0u8; BLOCK];
    s.get(SequenceHash(k), &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 7));
    s.get(SequenceHash(k), &mut out).unwrap();
    let at_a = |seen: &Arc<Mutex<Vec<String>>>| {
        seen.lock().unwrap().iter().filter(|c| *c == "GET").count()
    };
    assert_eq!(at_a(&a.seen), 1, "the MOVED slot was not remembered");
    assert_eq!(s.contains(&[SequenceHash(k)]).unwrap(), vec![true]);

    // ASK: a fresh store (fresh map) is sent to B with ASKING, every time.
    *ask.lock().unwrap() = true;
    let s = store(seed.port);
    s.get(SequenceHash(k), &mut out).unwrap();
    s.get(SequenceHash(k), &mut out).unwrap();
    assert_eq!(at_a(&a.seen), 3, "an ASK redirect was remembered");
    let seen_b = b.seen.lock().unwrap().clone();
    assert_eq!(seen_b.iter().filter(|c| *c == "ASKING").count(), 2);
    // A key of another block reached through the redirect is refused, not served.
    let r = s.get(SequenceHash(k + 1), &mut out);
    assert!(
        matches!(r, Err(TransferError::Remote(RemoteError::Corrupt { .. }))),
        "{r:?}"
    );
}

/// Two nodes that send each other's clients back and forth: an error after a few redirects,
/// within the bound, never a loop.
#[test]
fn redirect_loop_ends() {
    let other = Arc::new(Mutex::new(0u16));
    let to_a = Arc::clone(&other);
    let b = node(Arc::new(move |_: &[Vec<u8>]| {
        Act::Reply(format!("-MOVED 1 127.0.0.1:{}\r\n", *to_a.lock().unwrap()).into_bytes())
    }));
    let bp = b.port;
    let a = node(Arc::new(move |c: &[Vec<u8>]| {
        if is(c, "CLUSTER") {
            Act::Reply(slots_on(bp))
        } else {
            Act::Reply(format!("-MOVED 1 127.0.0.1:{bp}\r\n").into_bytes())
        }
    }));
    *other.lock().unwrap() = a.port;
    let s = store(a.port);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert!(r.is_err(), "{r:?}");
    assert!(t < BOUND, "{t:?}");
    let hops = a.seen.lock().unwrap().len() + b.seen.lock().unwrap().len();
    assert!(hops <= 8, "{hops} commands for one get");
}

/// A seed that accepts and never answers, listed first, must not take every operation's deadline:
/// it gets half the time left, the next seed answers, and once it failed it is asked last.
#[test]
fn a_hung_seed_does_not_stop_the_cluster() {
    // The good node's slot map names itself: its port is known once it listens.
    let own = Arc::new(Mutex::new(0u16));
    let me = Arc::clone(&own);
    let good = node(Arc::new(move |c: &[Vec<u8>]| {
        if is(c, "CLUSTER") {
            Act::Reply(slots_on(*me.lock().unwrap()))
        } else if is(c, "GET") {
            Act::Reply(b"$-1\r\n".to_vec())
        } else {
            Act::Reply(b"+OK\r\n".to_vec())
        }
    }));
    *own.lock().unwrap() = good.port;
    let hung = node(Arc::new(|_: &[Vec<u8>]| Act::Hang));
    let opts = RedisOptions {
        connect_timeout: CONNECT,
        io_timeout: T,
        lookup_timeout: T,
        pool_size: 2,
        cluster_seeds: vec![
            format!("redis://127.0.0.1:{}", hung.port),
            format!("redis://127.0.0.1:{}", good.port),
        ],
        ..RedisOptions::default()
    };
    let s = RedisStore::open("redis://cluster", NS, opts).unwrap();
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert!(
        matches!(
            r,
            Err(TransferError::Remote(RemoteError::Missing {
                key: SequenceHash(1)
            }))
        ),
        "{r:?} after {t:?}"
    );
    assert!(t < BOUND, "{t:?}");
}
