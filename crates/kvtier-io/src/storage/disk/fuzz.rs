//! Entry points of the disk tier's decoders for the fuzz targets of `fuzz/` (`disk_journal`,
//! `disk_header`), which reach them from outside the crate: a journal replayed from bytes and a
//! block header verified from bytes, through the very code a restart and a read run. Not an API
//! for engines (hidden from the docs).
//!
//! Invariant: each function here only converts between plain values and the crate-private types,
//! and calls the decoder; no rule of its own.
use super::format::{self, Expect, Header};
use super::index::{self, Geometry, Record};

/// The geometry the fuzz targets use (a journal written for another one is never replayed).
pub const NUM_BLOCKS: u32 = 64;
const GEOMETRY: Geometry = Geometry {
    num_blocks: NUM_BLOCKS,
    blocks_per_file: 16,
    block_bytes: 4096,
    slot_bytes: 8192,
};

/// One journal record: `(slot, generation, key, payload checksum)`.
pub type JournalRecord = (u32, u64, u128, u64);

/// The bytes of a journal whose superblock names `set_id` and the targets' geometry, holding
/// `records` in order, each with a valid checksum.
pub fn journal(set_id: u64, records: &[JournalRecord]) -> Vec<u8> {
    let recs: Vec<Record> = records
        .iter()
        .map(|&(slot, generation, key, payload_hash)| Record {
            slot,
            generation,
            key,
            payload_hash,
        })
        .collect();
    index::journal_bytes(&GEOMETRY, set_id, &recs)
}

/// The live table a restart rebuilds from `journal`, sorted by slot; `None` when the superblock
/// is not a valid one for the targets' geometry (the set then starts cold).
pub fn replay(journal: &[u8]) -> Option<Vec<JournalRecord>> {
    let mut live: Vec<JournalRecord> = index::replay_bytes(journal, GEOMETRY)?
        .into_iter()
        .map(|r| (r.slot, r.generation, r.key, r.payload_hash))
        .collect();
    live.sort_unstable();
    Some(live)
}

/// A block slot's header page and payload as the store writes them for the given fields.
pub fn block(set_id: u64, slot: u32, generation: u64, key: u128, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; format::HEADER_BYTES];
    Header {
        slot,
        generation,
        len: payload.len() as u64,
        payload_hash: format::payload_hash(payload, generation),
        set_id,
        key,
    }
    .encode(&mut out);
    out.extend_from_slice(payload);
    out
}

/// Whether a read of slot `slot` expecting block `key` of `generation` in set `set_id` accepts
/// `bytes` (a header page followed by the payload); `Err` says why not.
pub fn verify(
    bytes: &[u8],
    set_id: u64,
    slot: u32,
    generation: u64,
    key: u128,
    payload_len: usize,
) -> Result<(), String> {
    let split = format::HEADER_BYTES.min(bytes.len());
    let (header, payload) = bytes.split_at(split);
    let want = Expect {
        slot,
        generation,
        set_id,
        key,
        len: payload_len as u64,
    };
    format::verify(header, payload, &want)
}
