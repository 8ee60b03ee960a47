//! The disk tier's store: one locked file set in kvtier's own subdirectory, its in-memory table
//! of what each slot holds, and (with `persist`) the journal that lets a restart serve the
//! blocks again.
//!
//! Invariants:
//! - files live in `<dir>/kvtier-g3/` (see `dir`): data files `<set>-NNNNN.kvblk` (0600), the
//!   journal `<set>.index`, the lock `<set>.lock`; the store holds the set's exclusive `flock` for
//!   its lifetime, so two live stores never share files, and a dead store's files are taken over
//!   by the next store of that name (reclaimed, or served again with `persist`);
//! - slot `s` lives in file `s / blocks_per_file` at offset `(s % blocks_per_file) * slot_bytes`,
//!   all 4 KiB aligned: one header page, then the payload padded to 4 KiB;
//! - `meta[s]` (lock `meta`) holds the generation and key of the last *completed* write of slot
//!   `s` (generation 0 = none); it is cleared before a write starts, so a failed or torn write
//!   never leaves readable data; a read succeeds only if the slot's header and payload verify
//!   against `meta[s]`, the set id and the key the job asks for (see `format`);
//! - durability point (`persist`): a completed write is visible to this process at once; it is
//!   recorded in the journal, and so visible to a restart, only after its data file was
//!   `fdatasync`ed; records are batched by a flusher thread, which flushes whatever is queued
//!   every [`FLUSH_AGE`] and as soon as a write queues the [`FLUSH_RECORDS`]th record (writers
//!   never wait for an `fdatasync`); [`DiskStorage::sync`] and drop flush too. A crash loses at most the
//!   unflushed records (about the last `FLUSH_AGE` plus one `fdatasync`): those blocks are misses,
//!   never wrong;
//! - without `persist`, a store starts cold (its files truncated) and removes its data files
//!   and journal when dropped; a failed start removes what it created in either mode.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvtier::hash::SequenceHash;
use kvtier::ids::BlockId;

use super::dir::{self, SetLock};
use super::fault::FaultInjector;
use super::files;
use super::format::HEADER_BYTES;
use super::index::{self, Geometry, Index, Record};
use crate::error::{BlockIoError, IoError};
use crate::sys::file;
use crate::sys::mem::IO_ALIGN;
use crate::sys::uring::Ring;

/// Journal records queued before a flush is forced.
pub const FLUSH_RECORDS: usize = 256;
/// Age of the oldest queued record after which the next write flushes.
pub const FLUSH_AGE: Duration = Duration::from_millis(20);

/// Which system interface moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DiskIoMode {
    /// io_uring if the kernel allows it, else pread/pwrite.
    #[default]
    Auto,
    /// io_uring, or fail to open (no fallback).
    Uring,
    /// pread/pwrite from the calling thread.
    Sync,
}

/// Whether to bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// O_DIRECT where the file system supports it, buffered I/O otherwise (logged).
    #[default]
    Auto,
    /// O_DIRECT or fail to open.
    Require,
    /// Buffered I/O through the page cache.
    Off,
}

/// How to build a [`DiskStorage`].
#[derive(Clone, Debug)]
pub struct DiskOptions {
    /// The configured directory (`disk.dir`); kvtier's files go into its subdirectory
    /// [`super::SUBDIR`], and `dir` itself is never chmodded.
    pub dir: PathBuf,
    /// Slots of the store (the disk tier's capacity in blocks).
    pub num_blocks: u32,
    /// Bytes of one block (every slot's payload size).
    pub block_bytes: usize,
    /// Slots per cache file (0 = about 1 GiB per file).
    pub blocks_per_file: u32,
    /// Which system interface moves the bytes.
    pub io: DiskIoMode,
    /// Whether to bypass the page cache.
    pub direct: DirectMode,
    /// File set name (e.g. `rank0`): a restart with the same name re-opens the same files; a
    /// second live store of the name gets `name.1`, `name.2`, ...
    pub name: String,
    /// In-flight requests per io_uring.
    pub queue_depth: u32,
    /// Keep the blocks across restarts (journal + files kept on drop). Off: cold start, files
    /// removed on drop.
    pub persist: bool,
    /// Faults to inject into reads and writes (tests); `None` in production.
    pub faults: Option<Arc<FaultInjector>>,
}

impl DiskOptions {
    /// Options for `num_blocks` slots of `block_bytes` under `dir`; the rest at their defaults.
    pub fn new(dir: impl Into<PathBuf>, num_blocks: u32, block_bytes: usize) -> Self {
        DiskOptions {
            dir: dir.into(),
            num_blocks,
            block_bytes,
            blocks_per_file: 0,
            io: DiskIoMode::Auto,
            direct: DirectMode::Auto,
            name: "kvtier".into(),
            queue_depth: 32,
            persist: false,
            faults: None,
        }
    }
}

pub(super) struct CacheFile {
    pub path: PathBuf,
    /// The open file. Replaced by a fresh one when its path was deleted (#28: the tier stayed
    /// dead for the process); each operation holds its own `Arc` until it completed, so a
    /// replaced descriptor is never closed under an operation in flight.
    pub file: std::sync::RwLock<Arc<std::fs::File>>,
    /// The file's length (its slots).
    pub len: u64,
}

impl CacheFile {
    /// The file operations use now.
    pub(super) fn current(&self) -> Arc<std::fs::File> {
        Arc::clone(&self.file.read().unwrap_or_else(|p| p.into_inner()))
    }
}

/// What the store knows of one slot.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SlotMeta {
    pub generation: u64,
    pub key: u128,
}

#[derive(Default)]
struct Pending {
    recs: Vec<Record>,
    dirty: Vec<bool>,
    since: Option<Instant>,
}

/// The journal and the records waiting for their data to be made durable; shared with the
/// flusher thread.
struct Journal {
    /// Lock order: `index` before `pending`; `index` also serialises flushes.
    index: Mutex<Index>,
    pending: Mutex<Pending>,
    index_path: PathBuf,
    /// Duplicated descriptors of the data files (same open files), for `fdatasync`.
    data: Vec<(PathBuf, std::fs::File)>,
    blocks_per_file: u32,
    /// Set when the store drops; the flusher exits.
    stop: Mutex<bool>,
    wake: std::sync::Condvar,
}

impl Journal {
    /// Queue one completed write's record; true if a flush is due.
    fn push(&self, r: Record) -> bool {
        let mut p = lock(&self.pending);
        if let Some(d) = p.dirty.get_mut((r.slot / self.blocks_per_file) as usize) {
            *d = true;
        }
        p.recs.push(r);
        let since = *p.since.get_or_insert_with(Instant::now);
        p.recs.len() >= FLUSH_RECORDS || since.elapsed() >= FLUSH_AGE
    }

    /// Make the queued records' data durable, then append the records.
    fn flush(&self) -> Result<(), IoError> {
        let mut ix = lock(&self.index);
        let (recs, dirty) = {
            let mut p = lock(&self.pending);
            p.since = None;
            let n = p.dirty.len();
            (
                std::mem::take(&mut p.recs),
                std::mem::replace(&mut p.dirty, vec![false; n]),
            )
        };
        if recs.is_empty() {
            return Ok(());
        }
        // The durability point: the data before the records that name it.
        for ((path, f), d) in self.data.iter().zip(dirty) {
            if d {
                f.sync_data().map_err(|source| IoError::Disk {
                    path: path.clone(),
                    what: "fdatasync of a cache file",
                    source,
                })?;
            }
        }
        ix.append(&recs).map_err(|source| IoError::Disk {
            path: self.index_path.clone(),
            what: "appending to the journal",
            source,
        })
    }

    /// The flusher thread: every `FLUSH_AGE`, flush what is queued (so a quiet store's last
    /// writes do not wait for the next write to become durable), until `stop`.
    fn run_flusher(&self) {
        let mut stop = lock(&self.stop);
        loop {
            // Woken early by a writer that queued FLUSH_RECORDS (or by drop).
            stop = match self.wake.wait_timeout(stop, FLUSH_AGE) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            if *stop {
                return;
            }
            drop(stop);
            let queued = !lock(&self.pending).recs.is_empty();
            if queued {
                if let Err(e) = self.flush() {
                    tracing::warn!(error = %e, "disk tier: journal flush failed; the blocks it held are not kept across a restart");
                }
            }
            stop = lock(&self.stop);
        }
    }
}

/// How long dropping a [`DiskStorage`] waits for its journal flusher to stop.
const FLUSHER_JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The disk tier.
pub struct DiskStorage {
    pub(super) dir: PathBuf,
    set: String,
    pub(super) files: Vec<CacheFile>,
    pub(super) blocks_per_file: u32,
    pub(super) num_blocks: u32,
    pub(super) block_bytes: usize,
    pub(super) slot_bytes: usize,
    pub(super) direct: bool,
    pub(super) use_uring: bool,
    pub(super) queue_depth: u32,
    pub(super) set_id: u64,
    pub(super) meta: Mutex<Vec<SlotMeta>>,
    pub(super) next_generation: AtomicU64,
    journal: Option<Arc<Journal>>,
    flusher: Option<std::thread::JoinHandle<()>>,
    recovered: Vec<(SequenceHash, BlockId)>,
    /// Idle rings, taken by one operation at a time.
    pub(super) rings: Mutex<Vec<Ring>>,
    pub(super) faults: Option<Arc<FaultInjector>>,
    /// Declared last: released after everything above is closed.
    _lock: SetLock,
}

impl std::fmt::Debug for DiskStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStorage")
            .field("dir", &self.dir)
            .field("set", &self.set)
            .field("num_blocks", &self.num_blocks)
            .field("block_bytes", &self.block_bytes)
            .field("direct", &self.direct)
            .field("io_uring", &self.use_uring)
            .field("persist", &self.journal.is_some())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Everything `open_set` builds before the store exists.
struct OpenedSet {
    files: Vec<CacheFile>,
    direct: bool,
    set_id: u64,
    index: Option<Index>,
    forgotten: u64,
}

impl DiskStorage {
    /// Open the store's file set under `opts.dir` (see the module docs): warm with `persist`
    /// if the set's journal matches this geometry, cold otherwise.
    pub fn create(opts: &DiskOptions) -> Result<Self, IoError> {
        if opts.num_blocks == 0 || opts.block_bytes == 0 {
            return Err(IoError::Config(
                "disk tier needs at least one non-empty block".into(),
            ));
        }
        dir::check_name(&opts.name)?;
        let sub = dir::own_dir(&opts.dir)?;
        let set_lock = dir::lock_set(&sub, &opts.name)?;
        let set = set_lock.set.clone();
        let g = geometry(opts.num_blocks, opts.block_bytes, opts.blocks_per_file);
        let (blocks_per_file, slot_bytes) = (g.blocks_per_file, g.slot_bytes as usize);
        let opened = match open_set(&sub, &set, opts, g) {
            Ok(o) => o,
            Err(e) => {
                // A failed start leaves nothing behind but the (empty) lock file.
                remove_set_files(&sub, &set);
                return Err(e);
            }
        };
        let use_uring = match opts.io {
            DiskIoMode::Sync => false,
            DiskIoMode::Auto | DiskIoMode::Uring => match Ring::new(opts.queue_depth.max(1)) {
                Ok(r) => {
                    drop(r);
                    true
                }
                Err(e) if opts.io == DiskIoMode::Uring => {
                    remove_set_files(&sub, &set);
                    return Err(IoError::Disk {
                        path: sub.clone(),
                        what: "creating an io_uring",
                        source: e,
                    });
                }
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); disk tier uses pread/pwrite");
                    false
                }
            },
        };
        let mut meta = vec![SlotMeta::default(); opts.num_blocks as usize];
        let mut recovered = Vec::new();
        let mut max_gen = 0;
        if let Some(ix) = &opened.index {
            for r in ix.live() {
                meta[r.slot as usize] = SlotMeta {
                    generation: r.generation,
                    key: r.key,
                };
                if r.key != 0 {
                    recovered.push((SequenceHash(r.key), BlockId(r.slot)));
                }
            }
            max_gen = ix.max_generation();
        }
        let nfiles = opened.files.len();
        let (journal, flusher) = match opened.index {
            None => (None, None),
            Some(ix) => {
                let mut data = Vec::with_capacity(nfiles);
                for f in &opened.files {
                    let dup = f.current().try_clone().map_err(|source| IoError::Disk {
                        path: f.path.clone(),
                        what: "duplicating a cache file's descriptor",
                        source,
                    })?;
                    data.push((f.path.clone(), dup));
                }
                let j = Arc::new(Journal {
                    index: Mutex::new(ix),
                    pending: Mutex::new(Pending {
                        dirty: vec![false; nfiles],
                        ..Pending::default()
                    }),
                    index_path: dir::index_path(&sub, &set),
                    data,
                    blocks_per_file,
                    stop: Mutex::new(false),
                    wake: std::sync::Condvar::new(),
                });
                let jf = Arc::clone(&j);
                let h = std::thread::Builder::new()
                    .name("kvtier-g3-flush".into())
                    .spawn(move || jf.run_flusher())
                    .map_err(|source| IoError::Disk {
                        path: sub.clone(),
                        what: "starting the journal flusher thread",
                        source,
                    })?;
                (Some(j), Some(h))
            }
        };
        tracing::info!(
            dir = %sub.display(),
            set = %set,
            blocks = opts.num_blocks,
            direct = opened.direct,
            io_uring = use_uring,
            persist = opts.persist,
            recovered = recovered.len(),
            dropped = opened.forgotten,
            "disk tier ready"
        );
        Ok(DiskStorage {
            dir: sub,
            set,
            files: opened.files,
            blocks_per_file,
            num_blocks: opts.num_blocks,
            block_bytes: opts.block_bytes,
            slot_bytes,
            direct: opened.direct,
            use_uring,
            queue_depth: opts.queue_depth.max(1),
            set_id: opened.set_id,
            meta: Mutex::new(meta),
            next_generation: AtomicU64::new(max_gen + 1),
            journal,
            flusher,
            recovered,
            rings: Mutex::new(Vec::new()),
            faults: opts.faults.clone(),
            _lock: set_lock,
        })
    }

    /// Slots of the store.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Bytes of one block.
    pub(crate) fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    /// True if the files are opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
    /// True if I/O goes through io_uring.
    pub fn uses_io_uring(&self) -> bool {
        self.use_uring
    }
    /// kvtier's own subdirectory, where the files are (not the configured `disk.dir`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The file set this store holds (`name`, or `name.N` if `name` was taken).
    pub fn set_name(&self) -> &str {
        &self.set
    }
    /// True if the store keeps its blocks across restarts.
    pub fn persists(&self) -> bool {
        self.journal.is_some()
    }
    /// Blocks found at start (journal of an earlier run): `(key, slot)`. They read back (or
    /// fail verification, never serve other bytes) like blocks written by this process; the
    /// leader registers them in its disk pool so they are hits.
    pub fn recovered(&self) -> &[(SequenceHash, BlockId)] {
        &self.recovered
    }
    /// Paths of the cache files (for tests and diagnostics).
    pub fn file_paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }
    /// Path of the journal (with `persist`).
    pub fn index_path(&self) -> Option<PathBuf> {
        self.journal
            .as_ref()
            .map(|_| dir::index_path(&self.dir, &self.set))
    }
    /// Where slot `slot` starts: (file index, byte offset of its header).
    pub fn slot_position(&self, slot: u32) -> Option<(usize, u64)> {
        (slot < self.num_blocks).then(|| {
            (
                (slot / self.blocks_per_file) as usize,
                (slot % self.blocks_per_file) as u64 * self.slot_bytes as u64,
            )
        })
    }

    /// Write one unkeyed block from `data` (tests and tools; the connector's jobs carry keys).
    pub fn write_block(&self, slot: u32, data: &[u8]) -> Result<(), BlockIoError> {
        self.write_block_keyed(slot, 0, data)
    }

    /// Write one block from `data`, bound to `key` (its sequence hash).
    pub fn write_block_keyed(&self, slot: u32, key: u128, data: &[u8]) -> Result<(), BlockIoError> {
        self.check_len(data.len())?;
        self.write_from(&[(slot, key, data.as_ptr() as usize)])
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Read one block into `out` (checked against the key its last write named).
    pub fn read_block(&self, slot: u32, out: &mut [u8]) -> Result<(), BlockIoError> {
        self.read_block_keyed(slot, 0, out)
    }

    /// Read one block into `out`; fails unless the slot holds `key`'s block (0: any key).
    pub fn read_block_keyed(
        &self,
        slot: u32,
        key: u128,
        out: &mut [u8],
    ) -> Result<(), BlockIoError> {
        self.check_len(out.len())?;
        self.read_into(&[(slot, key, out.as_mut_ptr() as usize)])
            .pop()
            .unwrap_or(Ok(()))
    }

    fn check_len(&self, len: usize) -> Result<(), BlockIoError> {
        if len != self.block_bytes {
            return Err(BlockIoError::Other(format!(
                "buffer of {len} bytes for a block of {} bytes",
                self.block_bytes
            )));
        }
        Ok(())
    }

    /// Make every completed write durable and journaled now (a no-op without `persist`).
    pub fn sync(&self) -> Result<(), IoError> {
        self.flush()
    }

    /// Called once per completed write: queue its journal record, flush if due.
    pub(super) fn written(&self, slot: u32, generation: u64, key: u128, payload_hash: u64) {
        let Some(j) = &self.journal else { return };
        let due = j.push(Record {
            slot,
            generation,
            key,
            payload_hash,
        });
        if due {
            // The flusher does the fdatasyncs: writers never wait for them.
            j.wake.notify_one();
        }
    }

    fn flush(&self) -> Result<(), IoError> {
        match &self.journal {
            Some(j) => j.flush(),
            None => Ok(()),
        }
    }

    /// Records in the journal file (tests and diagnostics; 0 without `persist`).
    pub fn journal_records(&self) -> u64 {
        self.journal
            .as_ref()
            .map(|j| lock(&j.index).num_records())
            .unwrap_or(0)
    }

    pub(super) fn meta(&self) -> MutexGuard<'_, Vec<SlotMeta>> {
        lock(&self.meta)
    }

    pub(super) fn next_gen(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }
}

/// The bytes one slot of a block of `block_bytes` takes in a cache file: the header page and the
/// payload rounded up to the I/O alignment (what `disk.gb` is divided by).
pub fn slot_bytes(block_bytes: usize) -> usize {
    HEADER_BYTES + block_bytes.div_ceil(IO_ALIGN) * IO_ALIGN
}

/// The geometry of a store of `num_blocks` blocks of `block_bytes` (`blocks_per_file` 0: about
/// 1 GiB per file).
fn geometry(num_blocks: u32, block_bytes: usize, blocks_per_file: u32) -> Geometry {
    let slot_bytes = slot_bytes(block_bytes);
    let blocks_per_file = if blocks_per_file == 0 {
        ((1usize << 30) / slot_bytes).clamp(1, u32::MAX as usize) as u32
    } else {
        blocks_per_file
    };
    Geometry {
        num_blocks,
        blocks_per_file,
        block_bytes: block_bytes as u64,
        slot_bytes: slot_bytes as u64,
    }
}

/// The blocks a warm restart of the file sets `sets` (one per rank: set name and that rank's
/// block bytes; `num_blocks` and `blocks_per_file` as in [`DiskOptions`]) under `dir` would
/// serve: the `(key, slot)` pairs every set's journal holds alike, read without opening or
/// locking the sets. For a leader that lives apart from its workers' disk stores: a hint only
/// (the stores verify every block when it is loaded; one that fails is a failed load).
pub fn recoverable_blocks(
    dir: &Path,
    num_blocks: u32,
    blocks_per_file: u32,
    sets: &[(&str, usize)],
) -> Vec<(SequenceHash, BlockId)> {
    let sub = dir.join(dir::SUBDIR);
    let mut common: Option<std::collections::HashMap<u32, u128>> = None;
    for &(set, block_bytes) in sets {
        if dir::check_name(set).is_err() {
            return Vec::new();
        }
        let g = geometry(num_blocks, block_bytes, blocks_per_file);
        let Some(live) = index::read_live(&dir::index_path(&sub, set), g) else {
            return Vec::new();
        };
        let here = live
            .into_iter()
            .filter(|r| r.key != 0)
            .map(|r| (r.slot, r.key));
        common = Some(match common {
            None => here.collect(),
            Some(prev) => here.filter(|(s, k)| prev.get(s) == Some(k)).collect(),
        });
    }
    let mut out: Vec<(SequenceHash, BlockId)> = common
        .unwrap_or_default()
        .into_iter()
        .map(|(s, k)| (SequenceHash(k), BlockId(s)))
        .collect();
    out.sort_unstable_by_key(|b| b.1 .0);
    out
}

/// Open the data files and the journal of `set` (holding its lock).
fn open_set(sub: &Path, set: &str, opts: &DiskOptions, g: Geometry) -> Result<OpenedSet, IoError> {
    let ipath = dir::index_path(sub, set);
    let (mut index, warm) = if opts.persist {
        let (ix, replay) = Index::open(&ipath, g, true).map_err(|source| IoError::Disk {
            path: ipath.clone(),
            what: "opening the journal",
            source,
        })?;
        if replay.torn_tail > 0 {
            tracing::warn!(
                set,
                records = replay.torn_tail,
                "disk tier: dropped a torn journal tail"
            );
        }
        if !replay.warm {
            tracing::info!(
                set,
                "disk tier: no usable journal for this geometry; starting cold"
            );
        }
        (Some(ix), replay.warm)
    } else {
        let _ = std::fs::remove_file(&ipath);
        (None, false)
    };
    let set_id = index
        .as_ref()
        .map(|i| i.set_id)
        .unwrap_or_else(index::new_set_id);
    let nfiles = g.num_blocks.div_ceil(g.blocks_per_file);
    let mut direct = opts.direct != DirectMode::Off;
    let mut out = Vec::with_capacity(nfiles as usize);
    let mut forgotten = 0u64;
    for f in 0..nfiles {
        let first = f * g.blocks_per_file;
        let slots = g.blocks_per_file.min(g.num_blocks - first);
        let len = slots as u64 * g.slot_bytes;
        let path = dir::data_path(sub, set, f);
        let o = files::open_data_file(&path, len, direct, opts.direct, !warm)?;
        direct = o.direct;
        if let Some(ix) = index.as_mut() {
            // Slots the file no longer holds in full (cut short, deleted, replaced) are gone.
            for s in 0..slots {
                if (s as u64 + 1) * g.slot_bytes > o.old_len && ix.is_live(first + s) {
                    ix.forget(first + s);
                    forgotten += 1;
                }
            }
        }
        out.push(CacheFile {
            path,
            file: std::sync::RwLock::new(Arc::new(o.file)),
            len,
        });
    }
    dir::remove_data_files_from(sub, set, nfiles);
    if forgotten > 0 {
        tracing::warn!(
            set,
            blocks = forgotten,
            "disk tier: dropped blocks of cut-short or missing files"
        );
        if let Some(ix) = index.as_mut() {
            ix.compact().map_err(|source| IoError::Disk {
                path: ipath.clone(),
                what: "compacting the journal",
                source,
            })?;
        }
    }
    file::sync_dir(sub).map_err(|source| IoError::Disk {
        path: sub.to_owned(),
        what: "fsync of the cache directory",
        source,
    })?;
    Ok(OpenedSet {
        files: out,
        direct,
        set_id,
        index,
        forgotten,
    })
}

/// Remove the data files and journal of `set` (its lock is held by the caller).
fn remove_set_files(sub: &Path, set: &str) {
    dir::remove_data_files_from(sub, set, 0);
    match std::fs::remove_file(dir::index_path(sub, set)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("removing the journal of {set}: {e}"),
    }
}

impl Drop for DiskStorage {
    fn drop(&mut self) {
        if let Some(j) = &self.journal {
            *lock(&j.stop) = true;
            j.wake.notify_all();
        }
        if let Some(h) = self.flusher.take() {
            // Bounded (#13, shutdown(timeout) everywhere): a flusher stuck in a hung disk's
            // fsync is left behind (it owns its journal through an Arc) rather than hanging the
            // engine's shutdown; the journal then keeps its last completed flush, and every block
            // a later store loads is verified anyway.
            let t0 = std::time::Instant::now();
            while !h.is_finished() && t0.elapsed() < FLUSHER_JOIN_TIMEOUT {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            if !h.is_finished() {
                tracing::warn!(
                    timeout = ?FLUSHER_JOIN_TIMEOUT,
                    "disk tier: journal flusher still busy (a hung disk?); not waiting for it"
                );
                return;
            }
            let _ = h.join();
        }
        if self.journal.is_some() {
            if let Err(e) = self.flush() {
                tracing::warn!(error = %e, "disk tier: final journal flush failed");
            }
            return;
        }
        remove_set_files(&self.dir, &self.set);
    }
}
