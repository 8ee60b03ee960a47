//! The disk tier's index: an append-only journal of `(slot, key, generation, payload checksum)`
//! records, one file per file set, so a restart rebuilds its table by reading the journal, not
//! the blocks.
//!
//! Layout: a 4 KiB superblock (magic, version, the set's geometry and its random set id, a
//! checksum), then 64-byte records, each with its own checksum (xxh3-64 seeded with the set id).
//!
//! Invariants:
//! - a record is appended only after the data it names was made durable (`fdatasync` of the data
//!   file, done by the store before `append`): any record that survives a crash names bytes that
//!   reached the disk, unless a later write of the same slot overwrote them, which the slot's own
//!   header (generation, key) then exposes at read time;
//! - replay applies records in file order, the highest generation per slot wins, and it stops at
//!   the first record that is torn or fails its checksum (the tail a crash cut); that tail is
//!   truncated away before new records are appended;
//! - a superblock that fails its checksum or names another geometry makes the set cold (a new
//!   set id: every block header written under an old id is foreign from then on);
//! - `live` is the table the durable journal describes; compaction rewrites the journal as one
//!   record per live slot (temporary file, fsync, rename, fsync of the directory).
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::sys::file;

const SUPER_BYTES: usize = 4096;
const REC_BYTES: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"KVTIDX01");
const VERSION: u32 = 1;
const REC_PUT: u32 = 1;

/// What a set's files look like; a journal written for another geometry is not replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub num_blocks: u32,
    pub blocks_per_file: u32,
    pub block_bytes: u64,
    pub slot_bytes: u64,
}

/// One slot's durable contents as the journal records them (`generation == 0`: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Record {
    pub slot: u32,
    pub generation: u64,
    pub key: u128,
    pub payload_hash: u64,
}

/// The open journal of one file set (owned by the store's flush lock).
#[derive(Debug)]
pub(crate) struct Index {
    path: PathBuf,
    file: File,
    pub set_id: u64,
    geometry: Geometry,
    /// Append offset (end of the last whole record).
    end: u64,
    records: u64,
    live: Vec<Record>,
}

/// What opening found.
#[derive(Debug, Default)]
pub(crate) struct Replay {
    /// True if the journal was replayed (same geometry, valid superblock).
    pub warm: bool,
    /// Records dropped from the tail (torn or failing their checksum).
    pub torn_tail: u64,
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(x)
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(x)
}

fn encode_super(g: &Geometry, set_id: u64) -> Vec<u8> {
    let mut b = vec![0u8; SUPER_BYTES];
    b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&g.num_blocks.to_le_bytes());
    b[16..20].copy_from_slice(&g.blocks_per_file.to_le_bytes());
    b[24..32].copy_from_slice(&g.block_bytes.to_le_bytes());
    b[32..40].copy_from_slice(&g.slot_bytes.to_le_bytes());
    b[40..48].copy_from_slice(&set_id.to_le_bytes());
    let h = xxh3_64(&b[..56]);
    b[56..64].copy_from_slice(&h.to_le_bytes());
    b
}

/// The set id of a valid superblock written for geometry `g`.
fn decode_super(b: &[u8], g: &Geometry) -> Option<u64> {
    if b.len() < SUPER_BYTES
        || u64_at(b, 56) != xxh3_64(&b[..56])
        || u64_at(b, 0) != MAGIC
        || u32_at(b, 8) != VERSION
    {
        return None;
    }
    let on_disk = Geometry {
        num_blocks: u32_at(b, 12),
        blocks_per_file: u32_at(b, 16),
        block_bytes: u64_at(b, 24),
        slot_bytes: u64_at(b, 32),
    };
    (on_disk == *g).then(|| u64_at(b, 40))
}

fn encode_record(r: &Record, set_id: u64, out: &mut [u8]) {
    out[..REC_BYTES].fill(0);
    out[0..4].copy_from_slice(&REC_PUT.to_le_bytes());
    out[4..8].copy_from_slice(&r.slot.to_le_bytes());
    out[8..16].copy_from_slice(&r.generation.to_le_bytes());
    out[16..32].copy_from_slice(&r.key.to_le_bytes());
    out[32..40].copy_from_slice(&r.payload_hash.to_le_bytes());
    let h = xxh3_64_with_seed(&out[..56], set_id);
    out[56..64].copy_from_slice(&h.to_le_bytes());
}

fn decode_record(b: &[u8], set_id: u64, num_blocks: u32) -> Option<Record> {
    if u64_at(b, 56) != xxh3_64_with_seed(&b[..56], set_id) || u32_at(b, 0) != REC_PUT {
        return None;
    }
    let mut k = [0u8; 16];
    k.copy_from_slice(&b[16..32]);
    let r = Record {
        slot: u32_at(b, 4),
        generation: u64_at(b, 8),
        key: u128::from_le_bytes(k),
        payload_hash: u64_at(b, 32),
    };
    (r.slot < num_blocks && r.generation != 0).then_some(r)
}

/// A fresh random set id (time, process id and an address; never 0).
pub(crate) fn new_set_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let local = 0u8;
    let mut b = [0u8; 32];
    b[..16].copy_from_slice(&t.to_le_bytes());
    b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
    b[24..32].copy_from_slice(&(&local as *const u8 as usize as u64).to_le_bytes());
    xxh3_64(&b) | 1
}

fn open_rw(path: &Path, truncate: bool) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Bytes of the journal read at a time during replay (a whole number of records).
const REPLAY_CHUNK: usize = 1024 * REC_BYTES;

/// Apply the whole, valid records of `file` after the superblock to `live` (highest generation
/// per slot wins), stopping at the first torn or failing one; returns how many were applied.
/// Streams the journal a chunk at a time (#28: it was read whole, 310 MB of memory for a
/// 300 MB journal).
fn apply_records(
    file: &File,
    set_id: u64,
    num_blocks: u32,
    live: &mut [Record],
) -> std::io::Result<usize> {
    apply_records_from(|buf, at| file.read_at(buf, at), set_id, num_blocks, live)
}

/// [`apply_records`] over any positional reader (`read(buf, offset)`, `Ok(0)` at the end): the
/// file, or a journal in memory (the `disk_journal` fuzz target).
fn apply_records_from(
    mut read: impl FnMut(&mut [u8], u64) -> std::io::Result<usize>,
    set_id: u64,
    num_blocks: u32,
    live: &mut [Record],
) -> std::io::Result<usize> {
    let mut good = 0usize;
    let mut buf = vec![0u8; REPLAY_CHUNK];
    let mut at = SUPER_BYTES as u64;
    loop {
        // Fill the chunk (a short read is not the end of the file).
        let mut n = 0;
        while n < buf.len() {
            match read(&mut buf[n..], at + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        for chunk in buf[..n].chunks(REC_BYTES) {
            let rec = (chunk.len() == REC_BYTES)
                .then(|| decode_record(chunk, set_id, num_blocks))
                .flatten();
            let Some(r) = rec else { return Ok(good) };
            let cur = &mut live[r.slot as usize];
            if r.generation > cur.generation {
                *cur = r;
            }
            good += 1;
        }
        if n < buf.len() {
            return Ok(good);
        }
        at += n as u64;
    }
}

/// The superblock of `file`, if it has a whole one.
fn read_super(file: &File) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; SUPER_BYTES];
    let mut n = 0;
    while n < SUPER_BYTES {
        match file.read_at(&mut b[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    b.truncate(n);
    Ok(b)
}

/// The live table of the journal at `path`, read without changing it (no lock needed: a torn
/// tail is ignored, compaction replaces the file atomically). `None` if it does not exist or
/// was not written for `g`.
pub(crate) fn read_live(path: &Path, g: Geometry) -> Option<Vec<Record>> {
    let file = File::open(path).ok()?;
    let set_id = decode_super(&read_super(&file).ok()?, &g)?;
    let mut live = vec![Record::default(); g.num_blocks as usize];
    apply_records(&file, set_id, g.num_blocks, &mut live).ok()?;
    Some(live.into_iter().filter(|r| r.generation != 0).collect())
}

/// The live table (slot, generation, key, payload hash) that replaying `journal` (a whole
/// journal file's bytes) gives for geometry `g`, through the same superblock check and record
/// loop as [`Index::open`]; `None` when the superblock is not valid for `g`.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn replay_bytes(journal: &[u8], g: Geometry) -> Option<Vec<Record>> {
    let set_id = decode_super(journal.get(..SUPER_BYTES)?, &g)?;
    let mut live = vec![Record::default(); g.num_blocks as usize];
    let read = |buf: &mut [u8], at: u64| -> std::io::Result<usize> {
        let from = usize::try_from(at).unwrap_or(usize::MAX).min(journal.len());
        let n = buf.len().min(journal.len() - from);
        buf[..n].copy_from_slice(&journal[from..from + n]);
        Ok(n)
    };
    apply_records_from(read, set_id, g.num_blocks, &mut live).ok()?;
    Some(live.into_iter().filter(|r| r.generation != 0).collect())
}

/// A journal's bytes as [`Index`] writes them: the superblock for `g` and `set_id`, then one
/// record per entry of `records` (the `disk_journal` fuzz target builds its inputs with this).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn journal_bytes(g: &Geometry, set_id: u64, records: &[Record]) -> Vec<u8> {
    let mut out = encode_super(g, set_id);
    let at = out.len();
    out.resize(at + records.len() * REC_BYTES, 0);
    for (r, dst) in records.iter().zip(out[at..].chunks_mut(REC_BYTES)) {
        encode_record(r, set_id, dst);
    }
    out
}

impl Index {
    /// Open the journal at `path`: replay it if `warm_ok` and it was written for `g`, else
    /// start it cold (new set id, no records).
    pub(crate) fn open(
        path: &Path,
        g: Geometry,
        warm_ok: bool,
    ) -> std::io::Result<(Index, Replay)> {
        let file = open_rw(path, !warm_ok)?;
        let head = if warm_ok {
            read_super(&file)?
        } else {
            Vec::new()
        };
        let mut live = vec![Record::default(); g.num_blocks as usize];
        let mut replay = Replay::default();
        let set_id = match warm_ok.then(|| decode_super(&head, &g)).flatten() {
            Some(id) => id,
            None => {
                let id = new_set_id();
                file.set_len(0)?;
                file.write_all_at(&encode_super(&g, id), 0)?;
                file.sync_data()?;
                let ix = Index {
                    path: path.to_owned(),
                    file,
                    set_id: id,
                    geometry: g,
                    end: SUPER_BYTES as u64,
                    records: 0,
                    live,
                };
                return Ok((ix, replay));
            }
        };
        replay.warm = true;
        let good = apply_records(&file, set_id, g.num_blocks, &mut live)?;
        let len = file.metadata()?.len();
        let body = len.saturating_sub(SUPER_BYTES as u64);
        let whole = (good * REC_BYTES) as u64;
        replay.torn_tail = body.saturating_sub(whole).div_ceil(REC_BYTES as u64);
        let end = SUPER_BYTES as u64 + whole;
        if end < len {
            file.set_len(end)?;
            file.sync_data()?;
        }
        Ok((
            Index {
                path: path.to_owned(),
                file,
                set_id,
                geometry: g,
                end,
                records: good as u64,
                live,
            },
            replay,
        ))
    }

    /// Slots with durable contents, as the journal describes them.
    pub(crate) fn live(&self) -> impl Iterator<Item = &Record> {
        self.live.iter().filter(|r| r.generation != 0)
    }

    /// True if the journal has durable contents for `slot`.
    pub(crate) fn is_live(&self, slot: u32) -> bool {
        self.live
            .get(slot as usize)
            .is_some_and(|r| r.generation != 0)
    }

    /// The highest generation the journal knows of.
    pub(crate) fn max_generation(&self) -> u64 {
        self.live.iter().map(|r| r.generation).max().unwrap_or(0)
    }

    /// Forget `slot` (its data is gone, e.g. its file was cut short); written out by the
    /// next compaction.
    pub(crate) fn forget(&mut self, slot: u32) {
        if let Some(r) = self.live.get_mut(slot as usize) {
            *r = Record::default();
        }
    }

    /// Append `recs` (whose data the caller already made durable) and make them durable;
    /// compacts the journal when it has grown to more than twice the live table.
    pub(crate) fn append(&mut self, recs: &[Record]) -> std::io::Result<()> {
        if recs.is_empty() {
            return Ok(());
        }
        let mut buf = vec![0u8; recs.len() * REC_BYTES];
        for (r, out) in recs.iter().zip(buf.chunks_mut(REC_BYTES)) {
            encode_record(r, self.set_id, out);
        }
        self.file.write_all_at(&buf, self.end)?;
        self.file.sync_data()?;
        self.end += buf.len() as u64;
        self.records += recs.len() as u64;
        for r in recs {
            if let Some(cur) = self.live.get_mut(r.slot as usize) {
                if r.generation > cur.generation {
                    *cur = *r;
                }
            }
        }
        if self.records > 2 * self.geometry.num_blocks as u64 + 4096 {
            self.compact()?;
        }
        Ok(())
    }

    /// Rewrite the journal as one record per live slot.
    pub(crate) fn compact(&mut self) -> std::io::Result<()> {
        let tmp = self.path.with_extension("index.tmp");
        let mut f = open_rw(&tmp, true)?;
        f.write_all(&encode_super(&self.geometry, self.set_id))?;
        let live: Vec<Record> = self.live().copied().collect();
        let mut buf = vec![0u8; REC_BYTES * 1024];
        for part in live.chunks(1024) {
            for (r, out) in part.iter().zip(buf.chunks_mut(REC_BYTES)) {
                encode_record(r, self.set_id, out);
            }
            f.write_all(&buf[..part.len() * REC_BYTES])?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            file::sync_dir(dir)?;
        }
        self.file = f;
        self.records = live.len() as u64;
        self.end = (SUPER_BYTES + live.len() * REC_BYTES) as u64;
        Ok(())
    }

    /// Records in the journal file (tests and diagnostics).
    pub(crate) fn num_records(&self) -> u64 {
        self.records
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const G: Geometry = Geometry {
        num_blocks: 8,
        blocks_per_file: 4,
        block_bytes: 4096,
        slot_bytes: 8192,
    };

    fn rec(slot: u32, generation: u64) -> Record {
        Record {
            slot,
            generation,
            key: (slot as u128) << 64 | generation as u128,
            payload_hash: generation * 3,
        }
    }

    /// Regression (#28): the journal was read whole at start (a 300 MB index took 310 MB of
    /// memory). Replay streams it: a 12.8 MB journal replays within a bounded buffer.
    #[test]
    fn replay_streams_the_journal() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("big.index");
        let (ix, _) = Index::open(&p, G, true).unwrap();
        let set_id = ix.set_id;
        drop(ix);
        let n = 200_000usize;
        let mut body = vec![0u8; n * REC_BYTES];
        for (i, out) in body.chunks_mut(REC_BYTES).enumerate() {
            encode_record(&rec((i % 8) as u32, i as u64 + 1), set_id, out);
        }
        body.extend_from_slice(&[7u8; 10]); // a torn tail
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&body).unwrap();
        drop((f, body));
        let ((ix, r), peak) =
            crate::sys::count_alloc::peak_during(|| Index::open(&p, G, true).unwrap());
        assert!(r.warm);
        assert_eq!((ix.records, r.torn_tail), (n as u64, 1));
        assert_eq!(ix.max_generation(), n as u64);
        assert_eq!(ix.live().count(), 8);
        assert!(peak < 1 << 20, "replay held {peak} bytes at once");
    }

    #[test]
    fn replay_keeps_the_newest_record_per_slot() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.index");
        let (mut ix, r) = Index::open(&p, G, true).unwrap();
        assert!(!r.warm);
        ix.append(&[rec(1, 5), rec(2, 6)]).unwrap();
        ix.append(&[rec(1, 7)]).unwrap();
        let id = ix.set_id;
        drop(ix);
        let (ix, r) = Index::open(&p, G, true).unwrap();
        assert!(r.warm);
        assert_eq!(ix.set_id, id);
        let live: Vec<Record> = ix.live().copied().collect();
        assert_eq!(live, vec![rec(1, 7), rec(2, 6)]);
        assert_eq!(ix.max_generation(), 7);
    }

    #[test]
    fn torn_tail_is_dropped_and_truncated() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.index");
        let (mut ix, _) = Index::open(&p, G, true).unwrap();
        ix.append(&[rec(0, 1), rec(3, 2), rec(4, 3)]).unwrap();
        drop(ix);
        // Cut the last record in half, then flip a byte of the second.
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 20).unwrap();
        f.write_all_at(&[0xAA], SUPER_BYTES as u64 + 64 + 10)
            .unwrap();
        drop(f);
        let (mut ix, r) = Index::open(&p, G, true).unwrap();
        assert_eq!(r.torn_tail, 2);
        assert_eq!(ix.live().copied().collect::<Vec<_>>(), vec![rec(0, 1)]);
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            (SUPER_BYTES + 64) as u64
        );
        // New records go after the good prefix.
        ix.append(&[rec(5, 9)]).unwrap();
        drop(ix);
        let (ix, _) = Index::open(&p, G, true).unwrap();
        assert_eq!(
            ix.live().copied().collect::<Vec<_>>(),
            vec![rec(0, 1), rec(5, 9)]
        );
    }

    #[test]
    fn other_geometry_or_bad_superblock_starts_cold() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.index");
        let (mut ix, _) = Index::open(&p, G, true).unwrap();
        ix.append(&[rec(0, 1)]).unwrap();
        let id = ix.set_id;
        drop(ix);
        let g2 = Geometry {
            block_bytes: 8192,
            slot_bytes: 12288,
            ..G
        };
        let (ix, r) = Index::open(&p, g2, true).unwrap();
        assert!(!r.warm);
        assert_ne!(ix.set_id, id);
        assert_eq!(ix.live().count(), 0);
        drop(ix);
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&[0x55], 13).unwrap();
        drop(f);
        let (ix, r) = Index::open(&p, g2, true).unwrap();
        assert!(!r.warm, "a corrupted superblock is not trusted");
        assert_eq!(ix.live().count(), 0);
    }

    #[test]
    fn compaction_keeps_the_live_table() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.index");
        let (mut ix, _) = Index::open(&p, G, true).unwrap();
        for g in 1..=100u64 {
            ix.append(&[rec((g % 8) as u32, g)]).unwrap();
        }
        ix.compact().unwrap();
        assert_eq!(ix.num_records(), 8);
        let before: Vec<Record> = ix.live().copied().collect();
        drop(ix);
        let (ix, _) = Index::open(&p, G, true).unwrap();
        assert_eq!(ix.live().copied().collect::<Vec<_>>(), before);
    }
}
