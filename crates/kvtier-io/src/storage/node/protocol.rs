//! The node tier's wire protocol: length-prefixed postcard messages over a Unix stream socket.
//! Only control travels on the socket; block bytes go through the shared arena.
//!
//! Invariants: a frame is a 4-byte little-endian length then that many bytes of postcard; a
//! frame longer than the reader's limit ([`MAX_HELLO_FRAME`] before `Hello`, [`MAX_FRAME`]
//! after) or one that does not decode is an error (the connection is closed), never a panic; a
//! frame's body is read as its bytes arrive, so memory grows with the bytes received, never with
//! the length a peer declares; every request gets exactly one reply, in order. The node's
//! `Welcome` is followed by one byte carrying the arena's file descriptor (`SCM_RIGHTS`).
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Version of this protocol; a client of another version is refused at `Hello`.
pub const NODE_PROTOCOL_VERSION: u32 = 3;

/// Largest frame either side accepts (a `Contains` of 64k keys fits).
pub const MAX_FRAME: usize = 4 << 20;

/// Largest frame the node reads before a client's `Hello` (a `Hello` with the longest
/// namespace fits).
pub const MAX_HELLO_FRAME: usize = 1 << 10;

/// Client -> node.
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
    /// Reserve a slot for `key` (answered `PutSlot`, `AlreadyPresent` or `Full`).
    BeginPut {
        /// The block's content key.
        key: u128,
        /// Bytes of the block.
        bytes: u64,
    },
    /// Publish the written slot `id` with the checksum of its bytes.
    CommitPut {
        /// The `PutSlot` id.
        id: u64,
        /// [`block_checksum`] of the bytes written.
        checksum: u64,
    },
    /// Give up the reserved slot (the write failed); the block stays absent.
    AbortPut(u64),
    /// Lease the block of this key for reading (answered `Lease` or `Missing`).
    BeginGet(u128),
    /// End lease `id`: the client copied (or gave up on) the bytes.
    EndGet(u64),
    /// The bytes of lease `id` failed their checksum: drop the block.
    Damaged(u64),
    /// The node's counters (answered `Stats`).
    Stats,
}

/// Node -> client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// `Hello` accepted; the next byte on the socket carries the arena's file descriptor
    /// (`SCM_RIGHTS`), which the client checks and maps read-write.
    Welcome {
        /// Bytes of the arena.
        arena_bytes: u64,
    },
    /// The request was refused (wrong version, no `Hello` first, ...): the reason.
    Refused(String),
    /// For `Contains`: one flag per key, in order.
    Present(Vec<bool>),
    /// Write the block at `offset`, then `CommitPut { id, .. }`.
    PutSlot {
        /// The reservation's id.
        id: u64,
        /// Where in the arena to write.
        offset: u64,
    },
    /// The block is stored already (or being written by someone else).
    AlreadyPresent,
    /// The node has no room: the put is skipped.
    Full,
    /// Read the `bytes` of the block at `offset`, check `checksum`, then `EndGet(id)`.
    Lease {
        /// The lease's id.
        id: u64,
        /// Where in the arena the bytes are.
        offset: u64,
        /// Bytes of the block as stored.
        bytes: u64,
        /// The checksum its writer committed.
        checksum: u64,
    },
    /// The node does not hold the key.
    Missing,
    /// The commit, abort, end of lease or damage report was applied.
    Done,
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
    },
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
    // Grown as bytes arrive (read_to_end doubles from a small start): a peer that declares a
    // long frame and sends nothing costs nothing.
    let mut body = Vec::new();
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
        let mut buf = Vec::new();
        write_frame(
            &mut buf,
            &Request::BeginPut {
                key: u128::MAX,
                bytes: 9,
            },
        )
        .unwrap();
        let got: Request = read_frame(&mut buf.as_slice()).unwrap().unwrap();
        assert_eq!(
            got,
            Request::BeginPut {
                key: u128::MAX,
                bytes: 9
            }
        );
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
    fn checksums_are_bound_to_the_key() {
        let data = vec![7u8; 64];
        assert_ne!(block_checksum(1, &data), block_checksum(2, &data));
        assert_ne!(block_checksum(1 << 64, &data), block_checksum(1, &data));
    }
}
