//! `TransferEngine`: kvtier's implementation of `BlockTransfer`, moving blocks between the
//! engine's memory (G1, CUDA or CPU), the host tier, the disk tier and a remote store.
//!
//! Device <-> disk and device <-> remote jobs (a configuration without a host tier, or a block
//! found only on disk or in the remote store) go through a private bounce buffer per direction:
//! a few host blocks of the engine's own, never part of the host pool, pinned when the device is
//! CUDA. A job runs in slices of half the buffer: loads read a slice from disk/remote into one
//! half, then copy the blocks that arrived intact to the device; stores copy device blocks into
//! one half, then write the ones that copied to disk/remote. The disk/remote leg of one slice
//! overlaps the device leg of the neighbouring slice, which uses the other half. The node tier
//! is the exception: its device <-> remote jobs copy between device blocks and slots of the
//! node's shared arena directly (`node::direct`), staged only on a CUDA device whose arena
//! mapping could not be registered for DMA.
//!
//! Invariants: every pair of a job is either copied completely or listed in `Failed` with its
//! reason (a bad block id, a checksum mismatch, a missing remote key, a CUDA or I/O error); pairs
//! are independent, so one failure never hides or fails another pair's data; a pair whose disk or
//! remote leg failed never touches engine memory; device memory is only touched after the job's
//! fence has passed; a bounce buffer is used by one job at a time (its mutex), each half by one
//! leg at a time, and a slice's second leg starts only after its first leg completed.
use std::sync::Arc;

use kvtier::ids::{BlockId, DeviceBlockId};
use kvtier::transfer::{
    BlockFailure, BlockTransfer, Blocks, Fence, LayerGate, RemoteStore, TransferError, TransferJob,
    TransferOutcome,
};
use kvtier::Tier;

use crate::error::IoError;
use crate::storage::disk::{DiskOptions, DiskStorage};
use crate::storage::host::{HostOptions, HostStorage};
use crate::storage::node::NodeStore;
use crate::sys::{job, mem};
use crate::transfer::cuda::{CudaCopyMethod, LayeredCopy};
use crate::transfer::device::{CopyDir, DeviceKind, DeviceSide, Order, Ordering};
use crate::transfer::memory::EngineMemory;

mod staged;
use staged::{Bounce, Bounces};

/// Builds a [`TransferEngine`] from the tiers a worker has.
#[derive(Default)]
pub struct TransferEngineBuilder {
    device: Option<EngineMemory>,
    host: Option<Arc<HostStorage>>,
    disk: Option<Arc<DiskStorage>>,
    remote: Option<Arc<dyn RemoteStore>>,
    bytes_per_block: Option<usize>,
    cuda_copy: CudaCopyMethod,
    layered_copy: LayeredCopy,
    bounce_blocks: Option<u32>,
    setup_errors: Vec<String>,
}

/// Bytes each bounce buffer aims at when the builder is not given a block count.
const BOUNCE_BYTES: usize = 64 << 20;
/// Bounds on the default bounce buffer size, in blocks.
const BOUNCE_MIN_BLOCKS: usize = 2;
const BOUNCE_MAX_BLOCKS: usize = 64;

/// Default bounce blocks for blocks of `bytes_per_block`: about [`BOUNCE_BYTES`].
fn default_bounce_blocks(bytes_per_block: usize) -> u32 {
    (BOUNCE_BYTES / bytes_per_block.max(1)).clamp(BOUNCE_MIN_BLOCKS, BOUNCE_MAX_BLOCKS) as u32
}

impl TransferEngineBuilder {
    /// Blocks in each of the two bounce buffers (loads, stores) that device <-> disk and
    /// device <-> remote jobs pass through (default: about 64 MiB, 2 to 64 blocks).
    pub fn bounce_blocks(mut self, n: u32) -> Self {
        self.bounce_blocks = Some(n.max(1));
        self
    }
    /// How CUDA copies move scattered chunks (default `Auto`).
    pub fn cuda_copy_method(mut self, m: CudaCopyMethod) -> Self {
        self.cuda_copy = m;
        self
    }
    /// How layered loads move their bytes on CUDA (default `Auto`; `KVTIER_LAYERED_COPY`
    /// overrides it).
    pub fn layered_copy(mut self, m: LayeredCopy) -> Self {
        self.layered_copy = m;
        self
    }
    /// The engine's KV memory (G1), registered: where each device block's chunks are, whether
    /// they are CUDA or CPU memory, and what keeps them allocated. The precondition of copying
    /// into engine memory is [`EngineMemory::new`]'s `# Safety` (or what a safe constructor of
    /// `EngineMemory` checked); the engine holds `memory` for its whole life.
    pub fn device(mut self, memory: EngineMemory) -> Self {
        self.device = Some(memory);
        self
    }
    /// The host tier (G2).
    pub fn host(mut self, host: Arc<HostStorage>) -> Self {
        self.host = Some(host);
        self
    }
    /// Allocate the host tier; if that fails (memory, memlock limit, no driver with
    /// `PinMode::Require`) log the error with its hint and leave the tier out (see
    /// [`TransferEngine::setup_errors`]) instead of failing the engine.
    pub fn host_from(mut self, opts: &HostOptions) -> Self {
        match HostStorage::new(opts) {
            Ok(h) => self.host = Some(Arc::new(h)),
            Err(e) => {
                tracing::error!("host tier left out: {e}");
                self.setup_errors.push(format!("host tier left out: {e}"));
            }
        }
        self
    }
    /// Create the disk tier; on failure (directory, permissions, disk full) log it and leave
    /// the tier out.
    pub fn disk_from(mut self, opts: &DiskOptions) -> Self {
        match DiskStorage::create(opts) {
            Ok(d) => self.disk = Some(Arc::new(d)),
            Err(e) => {
                tracing::error!("disk tier left out: {e}");
                self.setup_errors.push(format!("disk tier left out: {e}"));
            }
        }
        self
    }
    /// The disk tier (G3).
    pub fn disk(mut self, disk: Arc<DiskStorage>) -> Self {
        self.disk = Some(disk);
        self
    }
    /// The remote store (G4): Redis, a shared directory or the node tier.
    pub fn remote(mut self, remote: Arc<dyn RemoteStore>) -> Self {
        self.remote = Some(remote);
        self
    }
    /// Block size, needed only when no device layout, host or disk tier gives it.
    pub fn bytes_per_block(mut self, n: usize) -> Self {
        self.bytes_per_block = Some(n);
        self
    }

    /// Check that every tier agrees on the block size and open the device side.
    pub fn build(self) -> Result<TransferEngine, IoError> {
        let mut sizes: Vec<(&str, usize)> = Vec::new();
        if let Some(m) = &self.device {
            sizes.push(("device layout", m.bytes_per_block()));
        }
        if let Some(h) = &self.host {
            sizes.push(("host tier", h.block_bytes()));
        }
        if let Some(d) = &self.disk {
            sizes.push(("disk tier", d.block_bytes()));
        }
        if let Some(n) = self.bytes_per_block {
            sizes.push(("bytes_per_block", n));
        }
        let bytes_per_block = sizes
            .first()
            .map(|s| s.1)
            .ok_or_else(|| IoError::Config("no tier and no block size given".into()))?;
        if let Some(bad) = sizes.iter().find(|s| s.1 != bytes_per_block) {
            return Err(IoError::Config(format!(
                "{} has {}-byte blocks but {} has {bytes_per_block}",
                bad.0, bad.1, sizes[0].0
            )));
        }
        if bytes_per_block == 0 {
            return Err(IoError::Config("blocks of zero bytes".into()));
        }
        let device = match self.device {
            Some(memory) => Some(DeviceSide::open(
                memory,
                self.host.as_deref(),
                self.cuda_copy,
                self.layered_copy,
            )?),
            None => None,
        };
        if let (Some(dev), Some(node)) = (
            &device,
            self.remote
                .as_ref()
                .and_then(|r| r.as_any())
                .and_then(|a| a.downcast_ref::<NodeStore>()),
        ) {
            if let DeviceKind::Cuda(ordinal) = dev.kind() {
                // Device <-> arena copies are DMA once the mapping is page-locked for this
                // device (done when the arena is mapped; without it jobs are staged).
                if let Ok(o) = i32::try_from(ordinal) {
                    node.use_cuda(o);
                }
            }
        }
        let bounce = match &device {
            Some(dev) if self.disk.is_some() || self.remote.is_some() => {
                let blocks = self
                    .bounce_blocks
                    .unwrap_or_else(|| default_bounce_blocks(bytes_per_block));
                Some(Bounces {
                    load: Bounce::new(blocks, bytes_per_block, dev.kind())?,
                    store: Bounce::new(blocks, bytes_per_block, dev.kind())?,
                })
            }
            _ => None,
        };
        Ok(TransferEngine {
            bytes_per_block,
            device,
            host: self.host,
            disk: self.disk,
            remote: self.remote,
            bounce,
            setup_errors: self.setup_errors,
            node_direct_jobs: Default::default(),
        })
    }
}

/// Moves blocks between the tiers of one worker. Cheap to share (`Arc`); `execute` may run on
/// several threads at once for jobs on disjoint blocks.
pub struct TransferEngine {
    bytes_per_block: usize,
    device: Option<DeviceSide>,
    host: Option<Arc<HostStorage>>,
    disk: Option<Arc<DiskStorage>>,
    remote: Option<Arc<dyn RemoteStore>>,
    /// Present when there is a device and a disk or remote tier.
    bounce: Option<Bounces>,
    setup_errors: Vec<String>,
    /// Jobs the node tier's direct path served (device <-> arena, no staging copy).
    node_direct_jobs: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("bytes_per_block", &self.bytes_per_block)
            .field("device", &self.device.as_ref().map(|d| d.kind()))
            .field("host", &self.host)
            .field("disk", &self.disk)
            .field("remote", &self.remote.is_some())
            .field(
                "bounce_blocks",
                &self.bounce.as_ref().map(|b| b.load.blocks),
            )
            .finish()
    }
}

/// Per-pair results being collected for one job.
struct Results {
    failures: Vec<BlockFailure>,
}

impl Results {
    fn fail(&mut self, pair_index: usize, reason: impl std::fmt::Display) {
        self.failures.push(BlockFailure {
            pair_index,
            reason: reason.to_string(),
        });
    }
    fn outcome(mut self) -> TransferOutcome {
        if self.failures.is_empty() {
            TransferOutcome::Ok
        } else {
            self.failures.sort_by_key(|f| f.pair_index);
            TransferOutcome::Failed(self.failures)
        }
    }
}

impl TransferEngine {
    /// A builder with no tier yet.
    pub fn builder() -> TransferEngineBuilder {
        TransferEngineBuilder::default()
    }

    /// Tiers that were asked for but left out (`host_from`/`disk_from`), with why.
    pub fn setup_errors(&self) -> &[String] {
        &self.setup_errors
    }
    /// The host tier, if built.
    pub fn host(&self) -> Option<&Arc<HostStorage>> {
        self.host.as_ref()
    }
    /// The disk tier, if built.
    pub fn disk(&self) -> Option<&Arc<DiskStorage>> {
        self.disk.as_ref()
    }
    /// Whether the device side is CUDA or CPU memory (None without a device layout).
    pub fn device_kind(&self) -> Option<DeviceKind> {
        self.device.as_ref().map(|d| d.kind())
    }
    /// Device <-> node jobs that copied between device blocks and arena slots directly.
    pub fn node_direct_jobs(&self) -> u64 {
        self.node_direct_jobs
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    /// Whether the node tier's arena is registered with CUDA for DMA (false without a node
    /// tier, before the first attach, or on a CPU device).
    pub fn node_arena_registered(&self) -> bool {
        self.node_store().is_some_and(|n| n.arena_registered())
    }
    /// Blocks in each bounce buffer (None when no device <-> disk/remote path exists).
    pub fn bounce_blocks(&self) -> Option<usize> {
        self.bounce.as_ref().map(|b| b.load.blocks)
    }
    /// Whether the bounce buffers are pinned (page-locked for CUDA).
    pub fn bounce_pinned(&self) -> Option<bool> {
        self.bounce.as_ref().map(|b| {
            b.load
                .mem
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_pinned()
        })
    }

    /// The address of each host block of a job's host side (`None`, failed in `res`, for a
    /// bad block id).
    fn host_addrs(&self, blocks: &[BlockId], res: &mut Results) -> Vec<Option<usize>> {
        let Some(host) = &self.host else {
            return vec![None; blocks.len()];
        };
        blocks
            .iter()
            .enumerate()
            .map(|(i, b)| match host.block_addr(b.0) {
                Ok(a) => Some(a),
                Err(e) => {
                    res.fail(i, format!("host {e}"));
                    None
                }
            })
            .collect()
    }

    fn run(&self, job: &TransferJob, fence: &Fence, order: Order<'_>) -> TransferOutcome {
        let mut res = Results {
            failures: Vec::new(),
        };
        for tier in [job.src_tier(), job.dst_tier()] {
            if !self.has_tier(tier) {
                for i in 0..job.len() {
                    res.fail(i, TransferError::TierMissing(tier));
                }
                return res.outcome();
            }
        }
        use CopyDir::{DeviceToHost, HostToDevice};
        match (job.src(), job.dst()) {
            (Blocks::Host(s), Blocks::Host(d)) => self.host_to_host(s, d, &mut res),
            (Blocks::Device(d), Blocks::Host(h)) => {
                self.device_host(d, h, DeviceToHost, fence, order, &mut res)
            }
            (Blocks::Host(h), Blocks::Device(d)) => {
                self.device_host(d, h, HostToDevice, fence, order, &mut res)
            }
            (Blocks::Host(h), far @ (Blocks::Disk(_) | Blocks::Remote(_))) => {
                self.host_far(h, far, true, &mut res)
            }
            (far @ (Blocks::Disk(_) | Blocks::Remote(_)), Blocks::Host(h)) => {
                self.host_far(h, far, false, &mut res)
            }
            (Blocks::Device(d), far @ Blocks::Remote(keys)) => {
                if !self.node_direct(d, keys, DeviceToHost, fence, order, &mut res) {
                    self.staged(d, far, fence, DeviceToHost, &mut res)
                }
            }
            (far @ Blocks::Remote(keys), Blocks::Device(d)) => {
                if !self.node_direct(d, keys, HostToDevice, fence, order, &mut res) {
                    self.staged(d, far, fence, HostToDevice, &mut res)
                }
            }
            (Blocks::Device(d), far @ Blocks::Disk(_)) => {
                self.staged(d, far, fence, DeviceToHost, &mut res)
            }
            (far @ Blocks::Disk(_), Blocks::Device(d)) => {
                self.staged(d, far, fence, HostToDevice, &mut res)
            }
            (src, dst) => {
                let (src, dst) = (src.tier(), dst.tier());
                for i in 0..job.len() {
                    res.fail(i, TransferError::Unsupported { src, dst });
                }
            }
        }
        res.outcome()
    }

    /// The node tier's device <-> arena path (`node::direct`); false when the job must be
    /// staged instead (no node store, or a CUDA device and an arena not registered for DMA).
    /// `order` (a synchronous load from the node): ordered, or layered, like a host tier load;
    /// a job that is staged instead is not ordered (the engine waits for its outcome).
    fn node_direct(
        &self,
        devs: &[DeviceBlockId],
        keys: &[kvtier::hash::SequenceHash],
        way: CopyDir,
        fence: &Fence,
        order: Order<'_>,
        res: &mut Results,
    ) -> bool {
        let (Some(dev), Some(node)) = (&self.device, self.node_store()) else {
            return false;
        };
        match crate::storage::node::direct::run(
            dev,
            node,
            (devs, keys),
            fence,
            self.bytes_per_block,
            way,
            order,
        ) {
            Some(failed) => {
                self.node_direct_jobs
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for (i, why) in failed {
                    res.fail(i, why);
                }
                true
            }
            None => false,
        }
    }

    /// Whether a synchronous load `job` may be ordered on the device: host tier -> device, or
    /// remote -> device when the remote store is the node tier (whose direct path copies from
    /// the arena slots it leased, like host tier blocks).
    fn orderable(&self, job: &TransferJob) -> bool {
        job.dst_tier() == Tier::Device
            && match job.src_tier() {
                Tier::Host => true,
                Tier::Remote => self.node_store().is_some(),
                Tier::Device | Tier::Disk => false,
            }
    }

    /// Whether the host tier is pinned and registered (kernels may read it at its addresses).
    fn host_pinned(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.is_pinned())
    }

    /// The remote store when it is the node tier.
    fn node_store(&self) -> Option<&NodeStore> {
        self.remote
            .as_ref()
            .and_then(|r| r.as_any())
            .and_then(|a| a.downcast_ref::<NodeStore>())
    }

    fn host_to_host(&self, src: &[BlockId], dst: &[BlockId], res: &mut Results) {
        let srcs = self.host_addrs(src, res);
        let dsts = self.host_addrs(dst, res);
        for (s, d) in srcs.into_iter().zip(dsts) {
            let (Some(s), Some(d)) = (s, d) else { continue };
            if s == d {
                continue;
            }
            // Both are distinct whole blocks of the host mapping; the job owns the destination
            // exclusively and the source is pinned read-only (pool invariants).
            job::copy_stream(s, d, self.bytes_per_block);
        }
        mem::store_fence();
    }

    /// Device <-> host tier: `devs[i]` and `hosts[i]` are pair `i`'s blocks, `way` the direction.
    fn device_host(
        &self,
        devs: &[DeviceBlockId],
        hosts: &[BlockId],
        way: CopyDir,
        fence: &Fence,
        order: Order<'_>,
        res: &mut Results,
    ) {
        let Some(dev) = &self.device else { return };
        let host_addrs = self.host_addrs(hosts, res);
        let mut items = Vec::with_capacity(devs.len());
        for (i, (d, h)) in devs.iter().zip(host_addrs).enumerate() {
            if let Some(h) = h {
                items.push((i, d.0, h));
            }
        }
        // A job with a pair already failed is not ordered: the engine waits for its outcome.
        let order = order
            .filter(|_| res.failures.is_empty() && !way.to_host())
            .map(|mut o| {
                // Kernels may read the host tier at its addresses only when it is pinned.
                o.readable = self.host_pinned();
                o
            });
        for (i, reason) in dev.copy(&items, way, fence, order) {
            res.fail(i, reason);
        }
    }

    /// Host <-> disk or host <-> remote (`far`, the job's other side), straight from and into
    /// host tier blocks; `to_far`: the host blocks are the source.
    fn host_far(&self, hosts: &[BlockId], far: &Blocks, to_far: bool, res: &mut Results) {
        let host_addrs = self.host_addrs(hosts, res);
        let items: Vec<(usize, usize)> = host_addrs
            .into_iter()
            .enumerate()
            .filter_map(|(i, h)| h.map(|h| (i, h)))
            .collect();
        self.far_leg(far, to_far, &items, res);
    }

    /// Move whole blocks between `far` (disk or remote) and host memory: `items[k] = (pair
    /// index, host block address)`; `to_far` writes the host blocks out, else reads them in.
    /// Failures go to `res`; returns, per item, whether it was copied.
    fn far_leg(
        &self,
        far: &Blocks,
        to_far: bool,
        items: &[(usize, usize)],
        res: &mut Results,
    ) -> Vec<bool> {
        let mut ok = vec![false; items.len()];
        match far {
            Blocks::Disk(blocks) => {
                let Some(disk) = &self.disk else {
                    return Self::far_tier_missing(Tier::Disk, items, res, ok);
                };
                // Each disk block names its key (its sequence hash); the disk tier binds the
                // slot to it and refuses to serve another key's bytes.
                let mut io: Vec<(u32, u128, usize)> = Vec::with_capacity(items.len());
                let mut io_items: Vec<usize> = Vec::with_capacity(items.len());
                for (k, &(i, h)) in items.iter().enumerate() {
                    match blocks.get(i) {
                        Some(b) => {
                            io.push((b.slot.0, b.key.0, h));
                            io_items.push(k);
                        }
                        None => res.fail(i, "internal: no disk block for the pair"),
                    }
                }
                let out = if to_far {
                    disk.write_from(&io)
                } else {
                    disk.read_into(&io)
                };
                for (r, k) in out.into_iter().zip(io_items) {
                    match r {
                        Ok(()) => ok[k] = true,
                        Err(e) => res.fail(items[k].0, e),
                    }
                }
            }
            Blocks::Remote(keys) => {
                let Some(remote) = &self.remote else {
                    return Self::far_tier_missing(Tier::Remote, items, res, ok);
                };
                if let Some(node) = self.node_store() {
                    return self.node_far_leg(node, keys, to_far, items, res, ok);
                }
                for (k, &(i, h)) in items.iter().enumerate() {
                    // The key names the block in the store.
                    let Some(&key) = keys.get(i) else {
                        res.fail(i, "internal: no remote key for the pair");
                        continue;
                    };
                    let r = if to_far {
                        // `h` is a whole host block that the job holds read-only.
                        job::with_bytes(h, self.bytes_per_block, |b| remote.put(key, b))
                    } else {
                        // `h` is a whole host block that the job owns exclusively.
                        job::with_bytes_mut(h, self.bytes_per_block, |b| remote.get(key, b))
                    };
                    match r {
                        Ok(()) => ok[k] = true,
                        Err(e) => res.fail(
                            i,
                            format!("remote {}: {e}", if to_far { "put" } else { "get" }),
                        ),
                    }
                }
            }
            Blocks::Device(_) | Blocks::Host(_) => {
                for &(i, _) in items {
                    res.fail(i, "internal: far leg to a near tier");
                }
            }
        }
        ok
    }

    /// The far leg of a staged device <-> node job: the slice's blocks put or got in one batch
    /// (`storage::node::staged`: one round trip per phase, checksums of private bytes only).
    fn node_far_leg(
        &self,
        node: &NodeStore,
        keys: &[kvtier::hash::SequenceHash],
        to_far: bool,
        items: &[(usize, usize)],
        res: &mut Results,
        mut ok: Vec<bool>,
    ) -> Vec<bool> {
        let mut batch: Vec<(usize, u128, usize)> = Vec::with_capacity(items.len());
        for (k, &(i, h)) in items.iter().enumerate() {
            match keys.get(i) {
                Some(key) => batch.push((k, key.0, h)),
                None => res.fail(i, "internal: no remote key for the pair"),
            }
        }
        let ks: Vec<u128> = batch.iter().map(|b| b.1).collect();
        let addrs: Vec<usize> = batch.iter().map(|b| b.2).collect();
        // Each `addrs` entry is a whole bounce block: held read-only by a store's far leg,
        // owned exclusively by a load's (the staged path's invariants).
        let out = if to_far {
            node.put_staged(&ks, &addrs, self.bytes_per_block)
        } else {
            node.get_staged(&ks, &addrs, self.bytes_per_block)
        };
        let op = if to_far { "put" } else { "get" };
        for (&(k, _, _), r) in batch.iter().zip(out) {
            match r {
                Ok(()) => ok[k] = true,
                Err(why) => res.fail(items[k].0, format!("remote {op}: {why}")),
            }
        }
        ok
    }

    /// Every item fails: `far` is not configured (callers check `has_tier` first; this keeps the
    /// "copied or listed failed" invariant local to `far_leg`).
    fn far_tier_missing(
        far: Tier,
        items: &[(usize, usize)],
        res: &mut Results,
        ok: Vec<bool>,
    ) -> Vec<bool> {
        for &(i, _) in items {
            res.fail(i, TransferError::TierMissing(far));
        }
        ok
    }
}

impl BlockTransfer for TransferEngine {
    fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    fn has_tier(&self, tier: Tier) -> bool {
        match tier {
            Tier::Device => self.device.is_some(),
            Tier::Host => self.host.is_some(),
            Tier::Disk => self.disk.is_some(),
            Tier::Remote => self.remote.is_some(),
        }
    }

    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        match &self.device {
            Some(d) => d.fence(engine_stream),
            None => Ok(Fence::none()),
        }
    }

    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        self.logged(job, || self.run(job, fence, None))
    }

    /// Host -> device loads, and node -> device loads on the direct path, are ordered on the
    /// device (see the trait); every other job runs as `execute` does.
    fn execute_ordered(
        &self,
        job: &TransferJob,
        fence: &Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(),
    ) -> TransferOutcome {
        let mut whole = |_: Option<Arc<dyn LayerGate>>| enqueued();
        let order = self.orderable(job).then_some(Ordering {
            stream: engine_stream,
            layered: false,
            readable: false,
            enqueued: &mut whole,
        });
        self.logged(job, || self.run(job, fence, order))
    }

    /// Host -> device and node -> device loads go layer by layer where the device side can (see
    /// the trait).
    fn execute_layered(
        &self,
        job: &TransferJob,
        fence: &Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(Option<Arc<dyn LayerGate>>),
    ) -> TransferOutcome {
        let order = self.orderable(job).then_some(Ordering {
            stream: engine_stream,
            layered: true,
            readable: false,
            enqueued,
        });
        self.logged(job, || self.run(job, fence, order))
    }
}

impl TransferEngine {
    /// Run a job with its profiling and failure logs.
    fn logged(&self, job: &TransferJob, run: impl FnOnce() -> TransferOutcome) -> TransferOutcome {
        let started = std::time::Instant::now();
        let outcome = run();
        // Profiling aid (KVTIER_LOG=kvtier_io=debug): where a load's or a store's time goes.
        tracing::debug!(
            job = job.id.0,
            src = job.src_tier().label(),
            dst = job.dst_tier().label(),
            blocks = job.len(),
            bytes = job.len() * self.bytes_per_block,
            us = started.elapsed().as_micros() as u64,
            "transfer job done"
        );
        if let TransferOutcome::Failed(f) = &outcome {
            kvtier::warn_limited!(
                job = job.id.0,
                src = job.src_tier().label(),
                dst = job.dst_tier().label(),
                failed = f.len(),
                of = job.len(),
                first = f.first().map(|b| b.reason.as_str()).unwrap_or(""),
                "transfer job had failures"
            );
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_bounce_is_about_64_mib_within_bounds() {
        assert_eq!(default_bounce_blocks(2 << 20), 32);
        assert_eq!(default_bounce_blocks(256), 64);
        assert_eq!(default_bounce_blocks(48 << 20), 2);
        assert_eq!(default_bounce_blocks(0), 64);
    }
}
