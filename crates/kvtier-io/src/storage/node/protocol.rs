//! The node tier's wire protocol: length-prefixed postcard messages over a Unix stream socket.
//! Only control travels on the socket; block bytes go through the shared arena.
//!
//! Invariants: a frame is a 4-byte little-endian length then that many bytes of postcard; a
//! frame longer than the reader's limit ([`MAX_HELLO_FRAME`] before `Hello`, [`MAX_FRAME`]
//! after) or one that does not decode is an error (the connection is closed), never a panic; a
//! frame's body is read as its bytes arrive, so memory grows with the bytes received, never with
//! the length a peer declares; every request gets exactly one reply, in order; a batch request
//! (`Reserve`, `Finish`, `Lease`, `EndLeases`) of at most [`MAX_BATCH`] items is answered by one
//! reply with exactly one answer per item, in the items' order (a longer batch is refused whole);
//! `Hello` is variant 0 of `Request` and `Welcome`, `Refused` variants 0 and 1 of `Reply` in
//! every version, so a peer of another version is refused with a reason. The node's `Welcome`
//! is followed by one byte carrying the arena's file descriptor (`SCM_RIGHTS`).
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::sys::sock;

/// Version of this protocol; a client of another version is refused at `Hello` (v4: batched
/// reserve/finish and lease/end, optional checksums, `Welcome::private`; v5: `Grant` and
/// `PutEnd::Publish`, slots granted before their keys are known).
pub const NODE_PROTOCOL_VERSION: u32 = 5;

/// Largest frame either side accepts (a `Contains` of 64k keys fits).
pub const MAX_FRAME: usize = 4 << 20;

/// Largest frame the node reads before a client's `Hello` (a `Hello` with the longest
/// namespace fits).
pub const MAX_HELLO_FRAME: usize = 1 << 10;

/// Most items in one `Reserve`, `Grant`, `Finish`, `Lease` or `EndLeases`: the node refuses a longer
/// batch (its work and its reply per request stay bounded), and clients split longer jobs into
/// batches of this many (each reply fits a frame: at most ~45 bytes an item).
pub const MAX_BATCH: usize = 4096;

/// Client -> node. `Hello` stays variant 0 in every version, so a client of another version is
/// told why it is refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The first message: protocol version and the namespace (model identity) this client
    /// stores and reads.
    Hello {
        /// This client's [`NODE_PROTOCOL_VERSION`].
        version: u32,
        /// The namespace every later request of this connection is in.
        namespace: String,
    },
    /// Which of these keys the node holds (answered `Present`).
    Contains(Vec<u128>),
    /// Reserve a slot of `bytes` for each key (answered `Reserved`, one answer per key, in
    /// order); at most [`MAX_BATCH`] keys.
    Reserve {
        /// Bytes of every block of the batch.
        bytes: u64,
        /// The blocks' content keys.
        keys: Vec<u128>,
    },
    /// Commit or abort reservations (answered `Items`, one per item, in order); at most
    /// [`MAX_BATCH`] items.
    Finish(Vec<PutEnd>),
    /// Lease the blocks of these keys for reading (answered `Leased`, one answer per key, in
    /// order); at most [`MAX_BATCH`] keys.
    Lease(Vec<u128>),
    /// End leases, or report their bytes damaged (answered `Items`, one per item, in order);
    /// at most [`MAX_BATCH`] items.
    EndLeases(Vec<LeaseEnd>),
    /// The node's counters (answered `Stats`).
    Stats,
    /// Grant up to `count` slots of `bytes` for this client's next puts, before their keys are
    /// known (answered `Granted`, possibly fewer: the node caps what a client and all clients
    /// hold); each is published with `PutEnd::Publish` or given back with `PutEnd::Abort`,
    /// and vanishes when the connection ends. At most [`MAX_BATCH`].
    Grant {
        /// Bytes of each slot.
        bytes: u64,
        /// Slots wanted.
        count: u32,
    },
}

/// The end of one reservation, in a `Finish`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PutEnd {
    /// Publish reservation `id`. With a checksum the node re-hashes the slot and publishes it
    /// only if they agree; without one (only a private node accepts that) it is published as
    /// written.
    Commit {
        /// The reservation's id.
        id: u64,
        /// [`block_checksum`] of the bytes written, if the writer computed it.
        checksum: Option<u64>,
    },
    /// Give up reservation or grant `id` (the write failed, or the slot is not wanted): the
    /// block stays absent and the slot is free.
    Abort(u64),
    /// Publish grant `id` (`Request::Grant`) as the block of `key`, as `Commit` does (with a
    /// checksum, only if the slot's bytes hash to it). Answered `Done` also when the key is
    /// stored (or being written) already: the grant is then given back, nothing published.
    Publish {
        /// The grant's id.
        id: u64,
        /// The block's content key.
        key: u128,
        /// [`block_checksum`] of the bytes written, if the writer computed it.
        checksum: Option<u64>,
    },
}

/// The end of one lease, in an `EndLeases`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseEnd {
    /// The reader copied (or gave up on) the bytes of lease `id`.
    Done(u64),
    /// The bytes of lease `id` failed their checksum: the node drops the block at once.
    Damaged(u64),
}

/// The node's answer for one key of a `Reserve`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PutAnswer {
    /// Write the block at `offset`, then commit reservation `id`.
    Slot {
        /// The reservation's id.
        id: u64,
        /// Where in the arena to write.
        offset: u64,
    },
    /// The block is stored already (or being written by someone else): nothing to do.
    Present,
    /// The node has no room: the put is skipped.
    Full,
}

/// The node's answer for one key of a `Lease`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GetAnswer {
    /// Read the `bytes` of the block at `offset`, then end lease `id`.
    Lease {
        /// The lease's id.
        id: u64,
        /// Where in the arena the bytes are.
        offset: u64,
        /// Bytes of the block as stored.
        bytes: u64,
        /// The checksum its writer committed and the node verified (every block of a
        /// multi-tenant node has one; a private node's blocks may not).
        checksum: Option<u64>,
    },
    /// The node does not hold the key.
    Missing,
}

/// The node's answer for one item of a `Finish` or an `EndLeases`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ItemAnswer {
    /// Applied: the block is published, the reservation aborted, the lease ended or the block
    /// dropped.
    Done,
    /// This connection holds no such reservation or lease: nothing was applied.
    Unknown,
    /// The slot's bytes do not match the checksum committed: the reservation was dropped.
    Mismatch,
}

/// Node -> client. `Welcome` and `Refused` stay variants 0 and 1 in every version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// `Hello` accepted; the next byte on the socket carries the arena's file descriptor
    /// (`SCM_RIGHTS`), which the client checks and maps read-write.
    Welcome {
        /// Bytes of the arena.
        arena_bytes: u64,
        /// Whether only the node's own uid may attach (no `--allow-uid`): every process that
        /// can write the arena is then of one user, trusted alike (see docs/arch/node.md, Trust).
        private: bool,
    },
    /// The request was refused (wrong version, no `Hello` first, a batch too long, ...): the
    /// reason.
    Refused(String),
    /// For `Contains`: one flag per key, in order.
    Present(Vec<bool>),
    /// For `Reserve`: one answer per key, in order.
    Reserved(Vec<PutAnswer>),
    /// For `Lease`: one answer per key, in order.
    Leased(Vec<GetAnswer>),
    /// For `Finish` and `EndLeases`: one answer per item, in order.
    Items(Vec<ItemAnswer>),
    /// The node's counters, as `NodeStats` names them.
    Stats {
        /// Connections attached now.
        clients: u64,
        /// Blocks held in the arena now.
        blocks: u64,
        /// Arena bytes those blocks use.
        bytes_used: u64,
        /// Arena bytes in all.
        capacity: u64,
        /// Puts committed.
        puts: u64,
        /// Puts skipped because the node was full.
        puts_full: u64,
        /// Gets asked for.
        gets: u64,
        /// Of those, keys the node did not hold.
        get_misses: u64,
        /// Committed blocks evicted to make room.
        evictions: u64,
        /// Puts begun and never committed.
        abandoned_puts: u64,
        /// Blocks the node's disk tier holds.
        disk_blocks: u64,
        /// Blocks spilled from the arena to the disk tier.
        disk_spills: u64,
        /// Gets served from the disk tier.
        disk_hits: u64,
        /// Requests served after `Hello` (round trips).
        requests: u64,
        /// Commits whose slot the node hashed against the committed checksum.
        verified: u64,
        /// Arena bytes held by slots granted and not yet published.
        bytes_granted: u64,
    },
    /// For `Grant`: `(grant id, arena offset)` of each slot granted (at most `count`).
    Granted(Vec<(u64, u64)>),
}

/// Write one frame.
pub(super) fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(|e| io::Error::other(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("node frame of {} bytes exceeds {MAX_FRAME}", body.len()),
        ));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()
}

/// How long a client polls for the node's answer before it sleeps in `read` ([`spin_readable`]).
pub(super) const CLIENT_SPIN: Duration = Duration::from_micros(200);
/// How long a node's connection polls for the next request after an answer, by default
/// (`NodeOptions::poll`, `kvtier node --poll-us`).
pub const NODE_POLL: Duration = Duration::from_micros(50);

/// Wait up to `spin` for bytes (or the end) to read on `stream`, polling without sleeping and
/// yielding the CPU between polls: a reader asleep in `read` pays the scheduler's wake-up on
/// every frame, most of a node round trip's cost (perf of `benches/node_batch.rs`: wake-ups and
/// task switches, not the books). The stream stays blocking: each poll is one non-blocking peek,
/// and the caller's blocking read follows either way.
pub(super) fn spin_readable(stream: &UnixStream, spin: Duration) {
    let t = Instant::now();
    // Bytes, the end, or an error: the blocking read sees it.
    while !sock::readable_now(stream) && t.elapsed() < spin {
        std::thread::yield_now();
    }
}

/// Bytes of a frame's body allocated before they arrive (see [`read_frame_max`]).
const READ_AHEAD: usize = 32 << 10;

/// Read one frame of at most [`MAX_FRAME`] bytes (`Ok(None)` at a clean end of stream before a
/// frame starts).
pub(super) fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<T>> {
    read_frame_max(r, MAX_FRAME)
}

/// Read one frame of at most `max` bytes (see [`read_frame`]).
pub(super) fn read_frame_max<T: for<'de> Deserialize<'de>>(
    r: &mut impl Read,
    max: usize,
) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("node frame of {n} bytes exceeds {max}"),
        ));
    }
    // At most READ_AHEAD bytes up front (a batch of a few thousand items in one read call,
    // where growing from nothing took a read call per doubling), then grown as bytes arrive: a
    // peer that declares a long frame and sends nothing costs at most READ_AHEAD.
    let mut body = Vec::with_capacity(n.min(READ_AHEAD));
    r.take(n as u64).read_to_end(&mut body)?;
    if body.len() != n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    postcard::from_bytes(&body)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("node frame: {e}")))
}

/// The requests a node reads from `bytes`, frame by frame as its connection does (the first
/// frame under [`MAX_HELLO_FRAME`], the others under [`MAX_FRAME`]), up to the end of the bytes
/// or the first frame refused; each request decoded re-encodes to a frame that decodes to it.
/// For the fuzz target `node_frames` (fuzz/fuzz_targets/node_frames.rs).
/// Feature `testing`.
#[cfg(any(test, feature = "testing"))]
pub fn decode_request_stream(bytes: &[u8]) -> Vec<Request> {
    let mut r = bytes;
    let mut out = Vec::new();
    loop {
        let max = if out.is_empty() {
            MAX_HELLO_FRAME
        } else {
            MAX_FRAME
        };
        match read_frame_max::<Request>(&mut r, max) {
            Ok(Some(req)) => out.push(req),
            Ok(None) | Err(_) => return out,
        }
    }
}

/// `msg` as one frame's bytes (for the fuzz target's round trip).
/// Feature `testing`.
#[cfg(any(test, feature = "testing"))]
pub fn encode_request(msg: &Request) -> io::Result<Vec<u8>> {
    let mut v = Vec::new();
    write_frame(&mut v, msg)?;
    Ok(v)
}

/// The checksum of a block in the arena, bound to its key: a block copied into another key's
/// slot does not verify.
pub fn block_checksum(key: u128, bytes: &[u8]) -> u64 {
    let seed = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64_with_seed(bytes, seed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_errors() {
        let reqs = [
            Request::Hello {
                version: NODE_PROTOCOL_VERSION,
                namespace: "m".into(),
            },
            Request::Contains(vec![1, u128::MAX]),
            Request::Reserve {
                bytes: 9,
                keys: vec![u128::MAX, 0, 7],
            },
            Request::Finish(vec![
                PutEnd::Commit {
                    id: 3,
                    checksum: Some(u64::MAX),
                },
                PutEnd::Commit {
                    id: 4,
                    checksum: None,
                },
                PutEnd::Abort(5),
            ]),
            Request::Lease(vec![2, 3]),
            Request::EndLeases(vec![LeaseEnd::Done(8), LeaseEnd::Damaged(9)]),
            Request::Stats,
            Request::Grant {
                bytes: u64::MAX,
                count: u32::MAX,
            },
            Request::Finish(vec![PutEnd::Publish {
                id: 6,
                key: u128::MAX,
                checksum: Some(7),
            }]),
        ];
        for r in &reqs {
            let mut buf = Vec::new();
            write_frame(&mut buf, r).unwrap();
            let got: Request = read_frame(&mut buf.as_slice()).unwrap().unwrap();
            assert_eq!(&got, r);
        }
        let replies = [
            Reply::Welcome {
                arena_bytes: 1 << 40,
                private: true,
            },
            Reply::Refused("no".into()),
            Reply::Present(vec![true, false]),
            Reply::Reserved(vec![
                PutAnswer::Slot {
                    id: 1,
                    offset: u64::MAX,
                },
                PutAnswer::Present,
                PutAnswer::Full,
            ]),
            Reply::Leased(vec![
                GetAnswer::Lease {
                    id: 1,
                    offset: 2,
                    bytes: 3,
                    checksum: Some(4),
                },
                GetAnswer::Lease {
                    id: 5,
                    offset: 6,
                    bytes: 7,
                    checksum: None,
                },
                GetAnswer::Missing,
            ]),
            Reply::Items(vec![
                ItemAnswer::Done,
                ItemAnswer::Unknown,
                ItemAnswer::Mismatch,
            ]),
            Reply::Granted(vec![(1, u64::MAX), (u64::MAX, 0)]),
        ];
        for r in &replies {
            let mut buf = Vec::new();
            write_frame(&mut buf, r).unwrap();
            let got: Reply = read_frame(&mut buf.as_slice()).unwrap().unwrap();
            assert_eq!(&got, r);
        }
        // A full batch fits a frame, answers included.
        let big = Reply::Leased(vec![
            GetAnswer::Lease {
                id: u64::MAX,
                offset: u64::MAX,
                bytes: u64::MAX,
                checksum: Some(u64::MAX),
            };
            MAX_BATCH
        ]);
        write_frame(&mut Vec::new(), &big).unwrap();
        let granted = Reply::Granted(vec![(u64::MAX, u64::MAX); MAX_BATCH]);
        write_frame(&mut Vec::new(), &granted).unwrap();
        let reserve = Request::Reserve {
            bytes: u64::MAX,
            keys: vec![u128::MAX; MAX_BATCH],
        };
        write_frame(&mut Vec::new(), &reserve).unwrap();
        // Oversized length prefix: refused before allocating.
        let huge = (u32::MAX).to_le_bytes();
        assert!(read_frame::<Request>(&mut huge.as_slice()).is_err());
        // Beyond the reader's limit.
        let mut big = Vec::new();
        write_frame(&mut big, &Request::Contains(vec![u128::MAX; 200])).unwrap();
        assert!(read_frame_max::<Request>(&mut big.as_slice(), MAX_HELLO_FRAME).is_err());
        // Garbage body.
        let mut bad = 3u32.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(read_frame::<Request>(&mut bad.as_slice()).is_err());
        // Truncated body.
        let mut short = 10u32.to_le_bytes().to_vec();
        short.push(1);
        assert!(read_frame::<Request>(&mut short.as_slice()).is_err());
        assert!(read_frame::<Request>(&mut [].as_slice()).unwrap().is_none());
    }

    #[test]
    fn hello_and_its_answers_keep_their_variant_numbers_across_versions() {
        // What a version 3 client sends (variant 0, version, namespace) decodes as a Hello, so
        // the node can tell it why it is refused; Welcome and Refused keep variants 0 and 1.
        let v3_hello = [0u8, 3, 1, b'm'];
        assert_eq!(
            postcard::from_bytes::<Request>(&v3_hello).unwrap(),
            Request::Hello {
                version: 3,
                namespace: "m".into()
            }
        );
        let refused = postcard::to_stdvec(&Reply::Refused("x".into())).unwrap();
        assert_eq!(refused[0], 1);
        let welcome = postcard::to_stdvec(&Reply::Welcome {
            arena_bytes: 1,
            private: false,
        })
        .unwrap();
        assert_eq!(welcome[0], 0);
    }

    #[test]
    fn checksums_are_bound_to_the_key() {
        let data = vec![7u8; 64];
        assert_ne!(block_checksum(1, &data), block_checksum(2, &data));
        assert_ne!(block_checksum(1 << 64, &data), block_checksum(1, &data));
    }
}
