//! Regression (#28): the Redis store keeps its deadline `min(connect, t) + 2t` for every operation
//! (a lookup of many blocks, `get`, `put`) whatever the server does, against a fake server in this
//! test that hangs after the request, drips its reply a byte at a time, or sends half a reply.
//! Before, the `redis` crate's timeout applied to each read, so a dripping server (or a lookup of
//! many blocks, one reply per block) held an operation for as long as it kept sending; and a
//! value far larger than one frame was read (and allocated) whole before it was refused.
#![allow(clippy::unwrap_used)]
mod deadline_support;

use kvtier::hash::SequenceHash;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadline_support::{assert_unavailable_within, timed};
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::remote::{encode_value, RedisOptions, RedisStore, HEADER_LEN};

const CONNECT: Duration = Duration::from_millis(200);
const T: Duration = Duration::from_millis(300);
/// `min(connect, t) + 2t`, plus slack for a loaded 2-core CI machine.
const BOUND: Duration = Duration::from_millis(200 + 2 * 300 + 700);

/// What the fake server does once it has read (the start of) a request.
#[derive(Clone)]
enum Shape {
    /// Never answers.
    Hang,
    /// Sends `reply` one byte every `gap`, then hangs.
    Drip(Vec<u8>, Duration),
    /// Sends the first `n` bytes of `reply` at once, then hangs.
    Half(Vec<u8>, usize),
    /// Answers `+OK` to every command (of bulk-string arguments without `\r\n*` in them),
    /// recording what it read.
    Ok(Arc<std::sync::Mutex<Vec<u8>>>),
}

struct Fake {
    port: u16,
    accepted: Arc<AtomicUsize>,
}

/// Holds `s` open, reading and discarding, until the client goes away or 20 s pass.
fn hang(mut s: TcpStream) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let until = Instant::now() + Duration::from_secs(20);
    let mut buf = [0u8; 4096];
    while Instant::now() < until {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return,
        }
    }
}

fn fake(shape: Shape) -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            count.fetch_add(1, Ordering::SeqCst);
            let shape = shape.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                if let Shape::Ok(seen) = &shape {
                    loop {
                        let n = s.read(&mut buf).unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        let mut seen = seen.lock().unwrap();
                        let before = seen.windows(3).filter(|w| w == b"\r\n*").count();
                        let first = seen.is_empty();
                        seen.extend_from_slice(&buf[..n]);
                        let after = seen.windows(3).filter(|w| w == b"\r\n*").count();
                        let cmds = after - before + usize::from(first);
                        let ok = b"+OK\r\n".repeat(cmds);
                        drop(seen);
                        if s.write_all(&ok).is_err() {
                            return;
                        }
                    }
                }
                if s.read(&mut buf).unwrap_or(0) == 0 {
                    return;
                }
                match shape {
                    Shape::Ok(_) => {}
                    Shape::Hang => {}
                    Shape::Drip(reply, gap) => {
                        for b in reply {
                            if s.write_all(&[b]).is_err() {
                                return;
                            }
                            std::thread::sleep(gap);
                        }
                    }
                    Shape::Half(reply, n) => {
                        if s.write_all(&reply[..n]).is_err() {
                            return;
                        }
                    }
                }
                hang(s);
            });
        }
    });
    Fake { port, accepted }
}

fn store(f: &Fake) -> RedisStore {
    let opts = RedisOptions {
        connect_timeout: CONNECT,
        io_timeout: T,
        lookup_timeout: T,
        pool_size: 2,
        // No breaker: every operation reaches the fake server.
        backoff: Duration::ZERO,
        ..RedisOptions::default()
    };
    RedisStore::open(&format!("redis://127.0.0.1:{}", f.port), "dl", opts).unwrap()
}

fn assert_unavailable_in_bound<V: std::fmt::Debug>(
    what: &str,
    r: Result<V, TransferError>,
    took: Duration,
) {
    assert_unavailable_within(what, r, took, T - Duration::from_millis(50), BOUND);
}

const BLOCK: usize = 4096;

/// A `GET` reply's start: the bulk length of one frame of `BLOCK` bytes.
fn bulk_prefix() -> Vec<u8> {
    format!("${}\r\n", HEADER_LEN + BLOCK).into_bytes()
}

#[test]
fn hung_server_every_operation_within_the_bound() {
    let f = fake(Shape::Hang);
    let s = store(&f);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert_unavailable_in_bound("get", r, t);
    let (r, t) = timed(|| s.put(SequenceHash(1), &out));
    assert_unavailable_in_bound("put", r, t);
    let keys: Vec<u128> = (0..500).collect();
    let (r, t) = timed(|| s.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>()));
    assert_unavailable_in_bound("contains", r, t);
    // Every timed-out connection was dropped: each operation connected anew.
    assert_eq!(f.accepted.load(Ordering::SeqCst), 3);
}

/// A lookup of many blocks whose replies trickle in (each within the old per-read timeout) ends
/// at its one deadline: the old client waited blocks x gap (here 2,000 x 4 bytes x 20 ms).
#[test]
fn dripping_lookup_of_many_blocks_within_the_bound() {
    let keys: Vec<u128> = (0..2000).collect();
    let reply: Vec<u8> = keys.iter().flat_map(|_| b":1\r\n".to_vec()).collect();
    let f = fake(Shape::Drip(reply, Duration::from_millis(20)));
    let s = store(&f);
    let (r, t) = timed(|| s.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>()));
    assert_unavailable_in_bound("contains", r, t);
}

#[test]
fn dripping_get_and_put_within_the_bound() {
    let mut get_reply = bulk_prefix();
    get_reply.extend(encode_value("dl", 1, &[0u8; BLOCK]));
    let f = fake(Shape::Drip(get_reply, Duration::from_millis(20)));
    let s = store(&f);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert_unavailable_in_bound("get", r, t);

    // A status line that takes 4 s to arrive in full.
    let mut put_reply = b"+".to_vec();
    put_reply.extend(std::iter::repeat_n(b'O', 40));
    put_reply.extend_from_slice(b"\r\n");
    let f = fake(Shape::Drip(put_reply, Duration::from_millis(100)));
    let s = store(&f);
    let (r, t) = timed(|| s.put(SequenceHash(1), &out));
    assert_unavailable_in_bound("put", r, t);
}

#[test]
fn half_replies_within_the_bound() {
    let mut get_reply = bulk_prefix();
    get_reply.extend(encode_value("dl", 1, &[0u8; BLOCK]));
    let n = get_reply.len() / 2;
    let f = fake(Shape::Half(get_reply, n));
    let s = store(&f);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(1), &mut out));
    assert_unavailable_in_bound("get", r, t);

    let f = fake(Shape::Half(b":1\r\n:0\r\n:1\r\n".to_vec(), 8));
    let s = store(&f);
    let (r, t) = timed(|| s.contains(&[SequenceHash(1), SequenceHash(2), SequenceHash(3)]));
    assert_unavailable_in_bound("contains", r, t);
}

/// Regression (#28): a 1 GB value under a block's key was read whole (54 s, 3.2 GB of memory, an
/// abort under a memory limit). The reply's length prefix is checked against the one frame
/// expected: a typed error at once, after reading at most the 40-byte header, never the value.
#[test]
fn oversized_value_is_refused_from_its_length_prefix() {
    let gb: u64 = 1 << 30;
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(b"KVT4");
    header[4..6].copy_from_slice(&2u16.to_le_bytes());
    header[8..16].copy_from_slice(&(gb - HEADER_LEN as u64).to_le_bytes());
    header[16..32].copy_from_slice(&7u128.to_le_bytes());
    let mut reply = format!("${gb}\r\n").into_bytes();
    reply.extend_from_slice(&header);
    reply.extend(std::iter::repeat_n(0u8, 1 << 20));
    let n = reply.len();
    let f = fake(Shape::Half(reply, n));
    let s = store(&f);
    let mut out = vec![0u8; BLOCK];
    let (r, t) = timed(|| s.get(SequenceHash(7), &mut out));
    match r {
        Err(TransferError::Remote(RemoteError::SizeMismatch {
            key,
            expected,
            stored,
        })) => {
            assert_eq!((key, expected), (SequenceHash(7), BLOCK));
            assert_eq!(stored as u64, gb - HEADER_LEN as u64);
        }
        other => panic!("expected SizeMismatch, got {other:?}"),
    }
    assert!(t < T, "refused after {t:?}: it waited for the value");
    // A short value is refused the same way (no header to read).
    let f = fake(Shape::Half(b"$10\r\n0123456789\r\n".to_vec(), 17));
    let s = store(&f);
    let r = s.get(SequenceHash(7), &mut out);
    assert!(
        matches!(
            r,
            Err(TransferError::Remote(RemoteError::Short { got: 10, .. }))
        ),
        "{r:?}"
    );
}

/// kvtier's own client sends the URL's credentials and database on each new connection.
#[test]
fn credentials_and_database_are_sent_on_connect() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let f = fake(Shape::Ok(Arc::clone(&seen)));
    let s = RedisStore::open(
        &format!("redis://alice:s3cret@127.0.0.1:{}/3", f.port),
        "dl",
        RedisOptions::default(),
    )
    .unwrap();
    s.put(SequenceHash(1), b"v").unwrap();
    let seen = seen.lock().unwrap().clone();
    let text = String::from_utf8_lossy(&seen);
    assert!(
        text.starts_with("*3\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n$6\r\ns3cret\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n*3\r\n$3\r\nSET\r\n"),
        "{text:?}"
    );
}

/// Regression (#28): one GET that missed its deadline on a busy machine marked a healthy store
/// down (24 loads failed and were recomputed). A missed deadline counts towards `trip_after`
/// (3) consecutive failures; only then does the breaker open.
#[test]
fn one_missed_deadline_does_not_mark_the_server_down() {
    use kvtier_io::storage::remote::BreakerState;
    let f = fake(Shape::Hang);
    let opts = RedisOptions {
        connect_timeout: CONNECT,
        io_timeout: Duration::from_millis(100),
        lookup_timeout: Duration::from_millis(100),
        backoff: Duration::from_secs(5),
        ..RedisOptions::default()
    };
    let s = RedisStore::open(&format!("redis://127.0.0.1:{}", f.port), "dl", opts).unwrap();
    let mut out = vec![0u8; BLOCK];
    for i in 1..=2 {
        assert!(s.get(SequenceHash(1), &mut out).is_err());
        assert_eq!(
            s.breaker_stats().state,
            BreakerState::Closed,
            "after {i} missed deadline(s)"
        );
    }
    assert!(s.get(SequenceHash(1), &mut out).is_err());
    assert_eq!(
        s.breaker_stats().state,
        BreakerState::Open,
        "third in a row"
    );
    assert_eq!(s.health().deadline_expired, 3);
}
