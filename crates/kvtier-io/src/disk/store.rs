//! Cache files of the disk tier and block reads/writes on them.
//!
//! Invariants:
//! - the cache directory is created with mode 0700 and every file with mode 0600; files are
//!   preallocated at creation and removed when the storage is dropped (the disk tier's index
//!   lives in memory, so nothing on disk outlives the process that wrote it);
//! - slot `s` lives in file `s / blocks_per_file` at offset `(s % blocks_per_file) * slot_bytes`,
//!   all 4 KiB aligned: one header page, then the payload padded to 4 KiB;
//! - `generations[s]` is the generation of the last *completed* write of slot `s` (0 = none);
//!   it is cleared before a write starts, so a failed or torn write never leaves readable data;
//! - a read succeeds only if the slot verifies against `generations[s]` (see `format`); a
//!   failure is reported for exactly that slot.
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::fault::{Fault, FaultInjector, FaultOp};
use super::format::{self, Header, HEADER_BYTES};
use crate::error::{BlockIoError, IoError};
use crate::sys::file::{self, IoReq, IoSeg};
use crate::sys::mem::{self, AlignedBuf, IO_ALIGN};
use crate::sys::uring::Ring;

/// Which system interface moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DiskIoMode {
    /// io_uring if the kernel allows it, else pread/pwrite.
    #[default]
    Auto,
    Uring,
    Sync,
}

/// Whether to bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DirectMode {
    /// O_DIRECT where the file system supports it, buffered I/O otherwise (logged).
    #[default]
    Auto,
    Require,
    Off,
}

/// How to build a [`DiskStorage`].
#[derive(Clone, Debug)]
pub struct DiskOptions {
    pub dir: PathBuf,
    pub num_blocks: u32,
    pub block_bytes: usize,
    /// Slots per cache file (0 = about 1 GiB per file).
    pub blocks_per_file: u32,
    pub io: DiskIoMode,
    pub direct: DirectMode,
    /// File name prefix (e.g. `rank0`), so several workers can share one directory.
    pub name: String,
    /// In-flight requests per io_uring.
    pub queue_depth: u32,
    pub faults: Option<Arc<FaultInjector>>,
}

impl DiskOptions {
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
            faults: None,
        }
    }
}

struct CacheFile {
    path: PathBuf,
    file: File,
}

/// The disk tier.
pub struct DiskStorage {
    dir: PathBuf,
    files: Vec<CacheFile>,
    blocks_per_file: u32,
    num_blocks: u32,
    block_bytes: usize,
    slot_bytes: usize,
    direct: bool,
    use_uring: bool,
    queue_depth: u32,
    generations: Vec<AtomicU64>,
    next_generation: AtomicU64,
    /// Idle rings, taken by one operation at a time.
    rings: Mutex<Vec<Ring>>,
    faults: Option<Arc<FaultInjector>>,
}

impl std::fmt::Debug for DiskStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStorage")
            .field("dir", &self.dir)
            .field("num_blocks", &self.num_blocks)
            .field("block_bytes", &self.block_bytes)
            .field("direct", &self.direct)
            .field("io_uring", &self.use_uring)
            .finish()
    }
}

fn disk_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(std::io::Error) -> IoError + 'a {
    move |source| IoError::Disk {
        path: path.to_owned(),
        what,
        source,
    }
}

/// One block operation prepared for submission.
struct Op {
    index: usize,
    slot: u32,
    generation: u64,
    header: AlignedBuf,
    staging: Option<AlignedBuf>,
    req: IoReq,
    /// Bytes the operation must move to succeed (before any injected shortening).
    full_len: usize,
    fault: Option<Fault>,
}

impl DiskStorage {
    /// Create the directory (0700) and the preallocated cache files (0600).
    pub fn create(opts: &DiskOptions) -> Result<Self, IoError> {
        if opts.num_blocks == 0 || opts.block_bytes == 0 {
            return Err(IoError::Config(
                "disk tier needs at least one non-empty block".into(),
            ));
        }
        let dir = &opts.dir;
        std::fs::create_dir_all(dir).map_err(disk_err(dir, "creating the cache directory"))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(disk_err(dir, "setting the cache directory's mode to 0700"))?;
        let payload = opts.block_bytes.div_ceil(IO_ALIGN) * IO_ALIGN;
        let slot_bytes = HEADER_BYTES + payload;
        let blocks_per_file = if opts.blocks_per_file == 0 {
            ((1usize << 30) / slot_bytes).clamp(1, u32::MAX as usize) as u32
        } else {
            opts.blocks_per_file
        };
        let nfiles = opts.num_blocks.div_ceil(blocks_per_file);
        let mut direct = opts.direct != DirectMode::Off;
        let mut files = Vec::with_capacity(nfiles as usize);
        for f in 0..nfiles {
            let slots = blocks_per_file.min(opts.num_blocks - f * blocks_per_file);
            let len = slots as u64 * slot_bytes as u64;
            let path = dir.join(format!("{}-{f:05}.kvblk", opts.name));
            let (file, d) = open_file(&path, len, direct, opts.direct)?;
            direct = d;
            files.push(CacheFile { path, file });
        }
        let use_uring = match opts.io {
            DiskIoMode::Sync => false,
            DiskIoMode::Auto | DiskIoMode::Uring => match Ring::new(opts.queue_depth.max(1)) {
                Ok(r) => {
                    drop(r);
                    true
                }
                Err(e) if opts.io == DiskIoMode::Uring => {
                    return Err(IoError::Disk {
                        path: dir.clone(),
                        what: "creating an io_uring",
                        source: e,
                    })
                }
                Err(e) => {
                    tracing::warn!("io_uring unavailable ({e}); disk tier uses pread/pwrite");
                    false
                }
            },
        };
        tracing::info!(dir = %dir.display(), blocks = opts.num_blocks, direct, io_uring = use_uring, "disk tier ready");
        Ok(DiskStorage {
            dir: dir.clone(),
            files,
            blocks_per_file,
            num_blocks: opts.num_blocks,
            block_bytes: opts.block_bytes,
            slot_bytes,
            direct,
            use_uring,
            queue_depth: opts.queue_depth.max(1),
            generations: (0..opts.num_blocks).map(|_| AtomicU64::new(0)).collect(),
            next_generation: AtomicU64::new(1),
            rings: Mutex::new(Vec::new()),
            faults: opts.faults.clone(),
        })
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    pub fn block_bytes(&self) -> usize {
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
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Paths of the cache files (for tests and diagnostics).
    pub fn file_paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
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

    /// Write one block from `data`.
    pub fn write_block(&self, slot: u32, data: &[u8]) -> Result<(), BlockIoError> {
        self.check_len(data.len())?;
        self.write_from(&[(slot, data.as_ptr() as usize)])
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Read one block into `out`.
    pub fn read_block(&self, slot: u32, out: &mut [u8]) -> Result<(), BlockIoError> {
        self.check_len(out.len())?;
        self.read_into(&[(slot, out.as_mut_ptr() as usize)])
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

    /// Write blocks: `items[i] = (slot, address of block_bytes to write)`. The addresses must
    /// stay valid and unwritten until this returns. One result per item.
    pub(crate) fn write_from(&self, items: &[(u32, usize)]) -> Vec<Result<(), BlockIoError>> {
        let mut results: Vec<Result<(), BlockIoError>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.queue_depth as usize * 2) {
            results.extend(self.run_batch(chunk, true));
        }
        results
    }

    /// Read blocks: `items[i] = (slot, address of block_bytes to fill)`. A failed item may
    /// leave garbage at its address but is reported as failed.
    pub(crate) fn read_into(&self, items: &[(u32, usize)]) -> Vec<Result<(), BlockIoError>> {
        let mut results: Vec<Result<(), BlockIoError>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(self.queue_depth as usize * 2) {
            results.extend(self.run_batch(chunk, false));
        }
        results
    }

    fn run_batch(&self, items: &[(u32, usize)], write: bool) -> Vec<Result<(), BlockIoError>> {
        let op_name = if write { "write" } else { "read" };
        let mut results: Vec<Option<Result<(), BlockIoError>>> =
            (0..items.len()).map(|_| None).collect();
        let mut deleted: Vec<Option<bool>> = vec![None; self.files.len()];
        let mut ops: Vec<Op> = Vec::with_capacity(items.len());
        for (index, &(slot, addr)) in items.iter().enumerate() {
            match self.prepare(slot, addr, write, &mut deleted) {
                Ok(op) => ops.push(Op { index, ..op }),
                Err(e) => results[index] = Some(Err(e)),
            }
        }
        // Injected errno faults never reach the kernel.
        let mut reqs = Vec::with_capacity(ops.len());
        let mut issued = Vec::with_capacity(ops.len());
        for (k, op) in ops.iter().enumerate() {
            if let Some(Fault::Errno(e)) = op.fault {
                results[op.index] = Some(Err(BlockIoError::Io {
                    slot: op.slot,
                    op: op_name,
                    source: std::io::Error::from_raw_os_error(e),
                }));
                continue;
            }
            reqs.push(op.req.clone());
            issued.push(k);
        }
        let outcomes = self.submit(&reqs);
        for (k, outcome) in issued.into_iter().zip(outcomes) {
            let op = &ops[k];
            let want = op.full_len;
            let r = match outcome {
                Err(source) => Err(BlockIoError::Io {
                    slot: op.slot,
                    op: op_name,
                    source,
                }),
                Ok(got) if got < want => Err(BlockIoError::Short {
                    slot: op.slot,
                    op: op_name,
                    got,
                    want,
                }),
                Ok(_) if write => {
                    self.generations[op.slot as usize].store(op.generation, Ordering::Release);
                    Ok(())
                }
                Ok(_) => self.finish_read(op, items[op.index].1),
            };
            results[op.index] = Some(r);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(BlockIoError::Other("operation was not run".into()))))
            .collect()
    }

    /// Build the request for one slot (header page + payload, or one staging buffer).
    fn prepare(
        &self,
        slot: u32,
        addr: usize,
        write: bool,
        deleted: &mut [Option<bool>],
    ) -> Result<Op, BlockIoError> {
        let (file_idx, offset) = self
            .slot_position(slot)
            .ok_or(BlockIoError::OutOfRange(slot))?;
        let cf = &self.files[file_idx];
        let gone = *deleted[file_idx]
            .get_or_insert_with(|| cf.file.metadata().map(|m| m.nlink() == 0).unwrap_or(true));
        if gone {
            if write {
                self.generations[slot as usize].store(0, Ordering::Release);
            }
            return Err(BlockIoError::FileDeleted {
                slot,
                path: cf.path.clone(),
            });
        }
        let fault = self
            .faults
            .as_ref()
            .and_then(|f| f.take(if write { FaultOp::Write } else { FaultOp::Read }, slot));
        let header =
            AlignedBuf::new(HEADER_BYTES).map_err(|e| BlockIoError::Other(e.to_string()))?;
        let mut op = Op {
            index: 0,
            slot,
            generation: 0,
            header,
            staging: None,
            req: IoReq {
                fd: cf.file.as_raw_fd(),
                offset,
                segs: Vec::new(),
                write,
            },
            full_len: 0,
            fault,
        };
        let aligned = addr.is_multiple_of(IO_ALIGN) && self.block_bytes.is_multiple_of(IO_ALIGN);
        let zero_copy = aligned || !self.direct;
        if write {
            self.generations[slot as usize].store(0, Ordering::Release);
            op.generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller guarantees `addr..addr+block_bytes` is valid and unwritten
            // until this call returns.
            let payload = unsafe { mem::slice(addr, self.block_bytes) };
            let h = Header {
                slot,
                generation: op.generation,
                len: self.block_bytes as u64,
                payload_hash: format::payload_hash(payload, op.generation),
            };
            if zero_copy {
                h.encode(op.header.as_mut_slice());
            } else {
                let mut st = AlignedBuf::new(self.slot_bytes)
                    .map_err(|e| BlockIoError::Other(e.to_string()))?;
                let s = st.as_mut_slice();
                h.encode(&mut s[..HEADER_BYTES]);
                s[HEADER_BYTES..HEADER_BYTES + self.block_bytes].copy_from_slice(payload);
                op.staging = Some(st);
            }
        } else {
            op.generation = self.generations[slot as usize].load(Ordering::Acquire);
            if op.generation == 0 {
                return Err(BlockIoError::NotWritten(slot));
            }
            if !zero_copy {
                op.staging = Some(
                    AlignedBuf::new(self.slot_bytes)
                        .map_err(|e| BlockIoError::Other(e.to_string()))?,
                );
            }
        }
        op.req.segs = match &op.staging {
            Some(st) => vec![IoSeg {
                addr: st.addr(),
                len: self.slot_bytes,
            }],
            None => {
                // Buffered I/O of an unaligned size needs no padding; O_DIRECT only gets here
                // with aligned sizes.
                vec![
                    IoSeg {
                        addr: op.header.addr(),
                        len: HEADER_BYTES,
                    },
                    IoSeg {
                        addr,
                        len: self.block_bytes,
                    },
                ]
            }
        };
        op.full_len = op.req.total_len();
        if let Some(Fault::Short(n)) = op.fault {
            let mut total = 0;
            let mut segs = Vec::new();
            for s in &op.req.segs {
                let take = s.len.min(n.saturating_sub(total));
                if take > 0 {
                    segs.push(IoSeg {
                        addr: s.addr,
                        len: take,
                    });
                }
                total += take;
            }
            op.req.segs = segs;
        }
        Ok(op)
    }

    fn finish_read(&self, op: &Op, dst: usize) -> Result<(), BlockIoError> {
        let (hdr, payload_addr) = match &op.staging {
            Some(st) => (
                st.as_slice()[..HEADER_BYTES].to_vec(),
                st.addr() + HEADER_BYTES,
            ),
            None => (op.header.as_slice().to_vec(), dst),
        };
        if let Some(Fault::FlipByte(k)) = op.fault {
            let k = k.min(self.block_bytes - 1);
            // SAFETY: `payload_addr` is either our staging buffer or the caller's block, both
            // valid and exclusively ours until this call returns.
            let p = unsafe { mem::slice_mut(payload_addr, self.block_bytes) };
            p[k] ^= 0x01;
        }
        // SAFETY: as above; the slice is dropped before the caller regains the memory.
        let payload = unsafe { mem::slice(payload_addr, self.block_bytes) };
        format::verify(&hdr, payload, op.slot, op.generation).map_err(|what| {
            BlockIoError::Corrupt {
                slot: op.slot,
                what,
            }
        })?;
        if op.staging.is_some() {
            // SAFETY: `dst` is the caller's block (valid, exclusive for this call), the staging
            // buffer is ours; they do not overlap.
            unsafe { mem::copy(payload_addr, dst, self.block_bytes) };
        }
        Ok(())
    }

    fn submit(&self, reqs: &[IoReq]) -> Vec<std::io::Result<usize>> {
        if reqs.is_empty() {
            return Vec::new();
        }
        if self.use_uring {
            let ring = self.rings.lock().ok().and_then(|mut r| r.pop());
            let ring = match ring {
                Some(r) => Ok(r),
                None => Ring::new(self.queue_depth),
            };
            if let Ok(mut ring) = ring {
                // SAFETY: every segment is a header/staging buffer owned by an `Op` that lives
                // until the caller has consumed the results, or a caller block valid for the
                // whole operation (see `write_from`/`read_into`).
                let out = unsafe { ring.run(reqs) };
                if let Ok(mut r) = self.rings.lock() {
                    r.push(ring);
                }
                return out;
            }
        }
        // SAFETY: as above.
        reqs.iter().map(|r| unsafe { file::run_sync(r) }).collect()
    }
}

impl Drop for DiskStorage {
    fn drop(&mut self) {
        for f in &self.files {
            if let Err(e) = std::fs::remove_file(&f.path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("removing {}: {e}", f.path.display());
                }
            }
        }
    }
}

/// Create one cache file, preallocate it and probe O_DIRECT; returns the file and whether it
/// is opened with O_DIRECT.
fn open_file(
    path: &Path,
    len: u64,
    want_direct: bool,
    mode: DirectMode,
) -> Result<(File, bool), IoError> {
    if want_direct {
        match file::open_cache_file(path, true) {
            Ok(f) => {
                preallocate(&f, path, len)?;
                match probe_direct(&f) {
                    Ok(()) => return Ok((f, true)),
                    Err(e) if mode == DirectMode::Require => {
                        return Err(IoError::Disk { path: path.to_owned(), what: "O_DIRECT I/O", source: e })
                    }
                    Err(e) => tracing::warn!(
                        "O_DIRECT I/O fails on {} ({e}); the disk tier uses buffered I/O",
                        path.display()
                    ),
                }
            }
            Err(e) if mode == DirectMode::Require => {
                return Err(IoError::Disk { path: path.to_owned(), what: "opening with O_DIRECT", source: e })
            }
            Err(e) => tracing::warn!(
                "O_DIRECT is not supported for {} ({e}, e.g. tmpfs); the disk tier uses buffered I/O",
                path.display()
            ),
        }
    }
    let f = file::open_cache_file(path, false).map_err(disk_err(path, "creating a cache file"))?;
    preallocate(&f, path, len)?;
    Ok((f, false))
}

fn preallocate(f: &File, path: &Path, len: u64) -> Result<(), IoError> {
    match file::preallocate(f, len) {
        Ok(true) => Ok(()),
        Ok(false) => {
            tracing::warn!(
                "{}: file system cannot preallocate; the file is sparse",
                path.display()
            );
            Ok(())
        }
        Err(source) => Err(IoError::Disk {
            path: path.to_owned(),
            what: "preallocating (is the disk full? lower disk_bytes or free space)",
            source,
        }),
    }
}

fn probe_direct(f: &File) -> std::io::Result<()> {
    let buf = AlignedBuf::new(IO_ALIGN)?;
    let w = IoReq {
        fd: f.as_raw_fd(),
        offset: 0,
        segs: vec![IoSeg {
            addr: buf.addr(),
            len: IO_ALIGN,
        }],
        write: true,
    };
    // SAFETY: `buf` is ours and lives across both calls.
    unsafe { file::run_sync(&w) }?;
    let r = IoReq { write: false, ..w };
    // SAFETY: as above.
    unsafe { file::run_sync(&r) }?;
    Ok(())
}
