//! The leader (scheduler side, one per engine): owns the slots, the G2 (host) and G3 (disk)
//! pools, the optional G4 remote store, and the books of every job in flight. It turns the
//! engine's calls into per-step metadata for the workers and the workers' reports into pool
//! changes. It performs no I/O except `RemoteStore::contains` during matching.
//!
//! One concept per file: [`config`] (how it is set up), `matching` (what the tiers can supply),
//! `loads` (allocation, onboarding and load completion), `stores` (steps, offloads, finishing),
//! `spills` (background host -> disk / remote copies), `books` (jobs in flight and worker
//! reports), `tiers` (the host-or-disk choice), [`observe`] (stats and events), `verdicts` (one
//! answer per asynchronous load that every rank acts on alike: TensorRT-LLM), `unpaged` (page ids
//! without a page: TensorRT-LLM's `-1`).
//!
//! Invariants:
//! - matching (`get_num_new_matched_tokens`) is side-effect free on the pools; pins are taken
//!   only in `update_state_after_alloc` (loads), `build_step` (stores) and when a confirmed
//!   store plans its spills;
//! - a block being written is allocated (pinned, invisible to matching) at dispatch and
//!   registered only after every rank confirmed its store; a failed store frees it;
//! - a block that a load reads stays pinned until every rank reported the load;
//! - a block whose load failed is never matched again: a host or disk block is invalidated, a
//!   remote hash is remembered (at most `MAX_REMOTE_FAILED`) and skipped by matching until the
//!   leader puts it again;
//! - a hash is never stored twice at once (a store reserves its hash in the target pool at
//!   dispatch, `BlockPool::reserve`, so a second store of it finds the reservation), and a hash
//!   already registered in the target tier is not stored again;
//! - `request_finished` returns true exactly while a store or a load of that request is not
//!   confirmed by every rank; the slot lives until its stores and loads are all confirmed;
//!   `request_finished_fenced` gives blocks that only stores still read back at once, and every
//!   step that hands one of them out names that request in its `fence` (`fences`);
//! - invalid engine input returns [`ConnectorError::InvalidInput`] and changes nothing for any
//!   other request; work planned before the error stays queued for the next metadata.
//!
//! Not thread-safe by itself: the engine's scheduler thread owns it (`&mut self`).
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crate::connector::fasthash::FastSet;
use crate::connector::jobs::JobTable;
use crate::connector::messages::{StepMetadata, WorkerReport, PROTOCOL_VERSION};
use crate::connector::slot::{OffloadBlock, Slot};
use crate::connector::slot_table::SlotTable;
use crate::connector::ConnectorError;
use crate::hash::{HashSalt, SequenceHash};
use crate::ids::{BlockId, DeviceBlockId, RequestId};
use crate::policy::FrequencyFilter;
use crate::pool::{BlockPool, Priority, Reservation};
use crate::transfer::RemoteStore;

mod books;
pub mod config;
mod fences;
mod holds;
mod loads;
mod matching;
pub mod observe;
mod offers;
mod spills;
mod stores;
#[cfg(test)]
mod tests;
mod tiers;
mod unpaged;
mod verdicts;
mod window;
#[cfg(test)]
mod window_tests;

use books::PendingJob;
pub use config::{Capacity, DiskPolicy, LeaderConfig, RequestKey};
pub use loads::{promised_blocks, Allocation, MAX_REMOTE_FAILED};
pub use observe::{KvEvent, LeaderStats, MAX_EVENTS};
pub use stores::BlockReuse;
use tiers::Tiers;
pub use window::window_first;

/// Reused buffers of the per-record store path.
#[derive(Debug, Default)]
struct Scratch {
    offloads: Vec<OffloadBlock>,
    hashes: Vec<SequenceHash>,
    reservations: Vec<Reservation>,
    seen_again: Vec<(BlockId, SequenceHash)>,
}

/// A request's slot and the count of its jobs in flight (the slot lives until both are 0 after
/// it finished).
#[derive(Debug)]
struct SlotEntry {
    slot: Slot,
    stores_in_flight: usize,
    loads_in_flight: usize,
    /// Whether the load of the last match runs inside the engine's step (synchronous), decided
    /// at the match from where the hit lies (see [`Leader::set_sync_host_loads`]); `None`
    /// before any match with a hit.
    load_sync: Option<bool>,
    /// Whether every block of the last match's hit lies in the host tier (no disk, remote or
    /// node block): a load that fails only with the device.
    host_tier_hit: bool,
    /// Blocks the last allocation planned to load from host, disk and remote (the request's
    /// hit sources, [`Leader::take_hit_sources`]).
    hit_blocks: [usize; 3],
    /// Tokens `[start, end)` of the last offer the engine will not consume (`offers.rs`).
    cut: Option<(usize, usize)>,
    /// The request's key as its last match gave it (a head cut is matched again with it).
    key: Option<RequestKey>,
    /// The engine's computed tokens at the last match when it offered an asynchronous load not
    /// yet allocated (`offers.rs`).
    offer: Option<usize>,
    /// With load verdicts: the asynchronous load awaiting its verdict (`verdicts.rs`).
    verdict: Option<verdicts::Pending>,
}

impl SlotEntry {
    fn new(slot: Slot) -> Self {
        SlotEntry {
            slot,
            stores_in_flight: 0,
            loads_in_flight: 0,
            load_sync: None,
            host_tier_hit: false,
            hit_blocks: [0; 3],
            cut: None,
            key: None,
            offer: None,
            verdict: None,
        }
    }
}

/// The scheduler-side connector. See the module documentation.
pub struct Leader {
    block_size: usize,
    salt: HashSalt,
    world: u32,
    num_device_blocks: Option<u32>,
    /// One block's bytes over every rank (the layout's; 0 without one): what a loaded block
    /// adds to the `onboard_*_bytes` counters.
    block_bytes: u64,
    /// The G2 (host) and G3 (disk) pools.
    tiers: Tiers,
    disk_policy: DiskPolicy,
    disk_filter: Option<FrequencyFilter>,
    /// Origin of the filter's clock.
    started: std::time::Instant,
    remote: Option<Arc<dyn RemoteStore>>,
    remote_put: bool,
    /// Whether the engine's blocks are stored at all (`LeaderConfig::stores`).
    stores: bool,
    async_loads: bool,
    /// With asynchronous loads: load a hit held wholly by the host tier synchronously.
    sync_host_loads: bool,
    /// The remote tier is this machine's node tier: its hits count as host hits for
    /// `sync_host_loads` ([`Leader::set_near_remote`]).
    near_remote: bool,
    /// With `sync_host_loads`: a hit whose host part is a prefix followed by at most this many
    /// blocks elsewhere offers only that prefix, in the step ([`Leader::set_recompute_tail`]).
    recompute_tail: usize,
    priority: Priority,
    /// Engine-supplied retention priority of device blocks (TensorRT-LLM `RequestData.priorities`),
    /// set when a block is reported and used when it is stored; absent = `priority`.
    block_priorities: HashMap<DeviceBlockId, Priority>,
    slots: SlotTable<SlotEntry>,
    jobs: JobTable<PendingJob>,
    step: u64,
    /// Remote hashes whose load failed (corrupt, short or missing value): never matched again.
    remote_failed: FastSet<SequenceHash>,
    outbox: StepMetadata,
    /// Per-step scratch buffers, kept to avoid allocating on every record.
    scratch: Scratch,
    reports_rx: Receiver<WorkerReport>,
    reports_tx: Sender<WorkerReport>,
    stats: LeaderStats,
    /// Pool events not yet taken, oldest first, at most `MAX_EVENTS` (older ones are dropped).
    events: std::collections::VecDeque<KvEvent>,
    /// Device blocks given back while stores still read them (`request_finished_fenced`).
    fences: fences::ReuseFences,
    /// Load verdicts not yet taken; `None`: verdicts are off (`verdicts.rs`).
    verdicts: Option<Vec<crate::connector::messages::LoadVerdict>>,
    /// The attention window of a sliding-window group, in tokens (`window`); `None`: full.
    window: Option<usize>,
    /// The engine's id for a position without a block (vLLM's null block), mapped to a hole.
    null_block: Option<DeviceBlockId>,
    /// Requests whose page ids had a hole this leader cannot take (`unpaged.rs`).
    unpaged: unpaged::Unpaged,
    /// Matches' pins held until their allocation; `None`: holds are off (`holds.rs`).
    holds: Option<holds::Holds>,
}

impl Leader {
    /// A leader with empty pools sized by `cfg`; refuses a configuration without any tier.
    pub fn new(cfg: LeaderConfig) -> Result<Leader, ConnectorError> {
        if cfg.block_size == 0 {
            return Err(ConnectorError::Config("block_size must be > 0".into()));
        }
        if let Some(l) = &cfg.layout {
            if l.block_size as usize != cfg.block_size {
                return Err(ConnectorError::Config(format!(
                    "block_size {} differs from the ranks' {}",
                    cfg.block_size, l.block_size
                )));
            }
            if l.world_size() == 0 {
                return Err(ConnectorError::Config("layout has no ranks".into()));
            }
        }
        let host_blocks = cfg.host.blocks(cfg.layout.as_ref(), "host")?;
        let disk_blocks = cfg.disk.blocks(cfg.layout.as_ref(), "disk")?;
        if host_blocks == 0 && disk_blocks == 0 && cfg.remote.is_none() {
            return Err(ConnectorError::Config(
                "at least one offload tier (host, disk or remote) must be configured".into(),
            ));
        }
        let tiers = Tiers::new(host_blocks, disk_blocks)?;
        let (reports_tx, reports_rx) = channel();
        let world = cfg.layout.as_ref().map_or(1, |l| l.world_size() as u32);
        tracing::info!(
            block_size = cfg.block_size,
            world,
            host_blocks,
            disk_blocks,
            remote = cfg.remote.is_some(),
            "kvtier leader ready"
        );
        Ok(Leader {
            block_size: cfg.block_size,
            salt: cfg.salt,
            world,
            num_device_blocks: cfg.layout.as_ref().map(|l| l.num_device_blocks),
            block_bytes: cfg.layout.as_ref().map_or(0, |l| l.total_bytes_per_block()),
            tiers,
            disk_policy: cfg.disk_policy,
            disk_filter: match cfg.disk_policy {
                DiskPolicy::Filter(p) => Some(FrequencyFilter::new(p)),
                _ => None,
            },
            started: std::time::Instant::now(),
            remote: cfg.remote,
            remote_put: cfg.remote_put,
            stores: cfg.stores,
            async_loads: cfg.async_loads,
            sync_host_loads: false,
            recompute_tail: 0,
            near_remote: false,
            priority: cfg.priority,
            block_priorities: HashMap::new(),
            slots: SlotTable::default(),
            jobs: JobTable::default(),
            step: 0,
            remote_failed: FastSet::default(),
            outbox: StepMetadata {
                version: PROTOCOL_VERSION,
                ..Default::default()
            },
            scratch: Scratch::default(),
            reports_rx,
            reports_tx,
            stats: LeaderStats::default(),
            events: std::collections::VecDeque::new(),
            fences: fences::ReuseFences::default(),
            verdicts: None,
            window: None,
            null_block: None,
            unpaged: unpaged::Unpaged::default(),
            holds: None,
        })
    }

    /// Where workers (in-process, or the channel's receiving thread) send their reports.
    pub fn report_sender(&self) -> Sender<WorkerReport> {
        self.reports_tx.clone()
    }

    /// Whether loads are asynchronous (TensorRT-LLM / vLLM: the second value of the match answer).
    pub fn loads_are_async(&self) -> bool {
        self.async_loads
    }

    /// With asynchronous loads, load a hit that lies wholly in the host tier (G2) inside the
    /// engine's step instead (synchronous: the engine schedules the request at once, and a GPU
    /// worker orders the copies ahead of the forward pass on the engine's stream), leaving hits
    /// that touch the disk or remote tier asynchronous. A host-to-device copy cannot fail for a
    /// reason a retry would fix, and the engine skips the steps an asynchronous load costs
    /// (waiting in its queue, then being picked up again; #27). Off by default; the vLLM
    /// adapter turns it on (`connector.sync_host_loads`).
    pub fn set_sync_host_loads(&mut self, on: bool) {
        self.sync_host_loads = on;
    }

    /// With [`Self::set_sync_host_loads`], a hit whose leading blocks lie in the host tier (or
    /// the node tier, [`Self::set_near_remote`]) and whose other blocks, after them, are at most
    /// `blocks` offers only the leading part, loaded inside the step, and leaves the tail to the
    /// engine to recompute in that same step, instead of loading the whole hit asynchronously
    /// (which costs vLLM the steps of an asynchronous load for the whole request, while
    /// recomputing a few blocks costs a few more tokens of a forward pass it runs anyway; #27,
    /// "a short hit must not cost extra scheduler steps"). Not with sliding windows (their
    /// offers follow the window). 0 (the default) turns it off.
    pub fn set_recompute_tail(&mut self, blocks: usize) {
        self.recompute_tail = blocks;
    }

    /// The remote tier is this machine's node tier (`node://`): its arena is host memory the
    /// engine copies from directly, so with [`Self::set_sync_host_loads`] a hit held by the
    /// host and node tiers alone loads inside the step too (issue 26: the node as the engine's
    /// G2). A failed node load is a failed sync load: its blocks are reported and recomputed.
    /// Set by the composition root from the remote URL's scheme.
    pub fn set_near_remote(&mut self, on: bool) {
        self.near_remote = on;
    }

    /// Whether the load of `req`'s last match is asynchronous (the second value of the match
    /// answer for engines that take one per request: vLLM).
    pub fn load_is_async(&self, req: &RequestId) -> bool {
        match self.slots.get(req).and_then(|e| e.load_sync) {
            Some(sync) => !sync,
            None => self.async_loads,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The salt of every sequence hash this leader computes.
    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// When blocks confirmed in G2 are also written to G3.
    pub fn disk_policy(&self) -> DiskPolicy {
        self.disk_policy
    }

    /// Whether blocks are put to the remote store (false for a decode-only engine).
    pub fn remote_put(&self) -> bool {
        self.remote_put && self.remote.is_some()
    }

    /// Ranks that must report every job before it completes.
    pub fn world_size(&self) -> u32 {
        self.world
    }

    /// The request's slot, if the leader knows the request (read-only; for adapters and tests).
    pub fn slot(&self, req: &RequestId) -> Option<&Slot> {
        self.slots.get(req).map(|e| &e.slot)
    }

    /// Refuses device block ids beyond the engine's table (when the layout gives its size). An
    /// engine whose null block is [`HOLE`] itself (TensorRT-LLM's `-1`, `BAD_PAGE_INDEX`, passed
    /// as `u32::MAX`) names positions without a block by it: those are holes, not ids.
    pub(super) fn check_device_ids(
        &self,
        req: &RequestId,
        field: &'static str,
        ids: &[DeviceBlockId],
    ) -> Result<(), ConnectorError> {
        let holes = self.null_block == Some(crate::connector::slot::HOLE);
        if let Some(n) = self.num_device_blocks {
            if let Some(b) = ids
                .iter()
                .find(|b| b.0 >= n && !(holes && **b == crate::connector::slot::HOLE))
            {
                return Err(ConnectorError::invalid(
                    req,
                    field,
                    format!("device block {} is beyond the engine's {n} blocks", b.0),
                ));
            }
        }
        Ok(())
    }

    /// Read access to the host pool (tests, metrics).
    pub fn host_pool(&self) -> Option<&BlockPool> {
        self.tiers.host.as_ref()
    }

    /// Read access to the disk pool (tests, metrics).
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.tiers.disk.as_ref()
    }
}
