//! The leader (scheduler side, one per engine): owns the slots, the G2 (host) and G3 (disk)
//! pools, the optional G4 remote store, and the books of every job in flight. It turns the
//! engine's calls into per-step metadata for the workers and the workers' reports into pool
//! changes. It performs no I/O except `RemoteStore::contains` during matching.
//!
//! Invariants:
//! - matching (`get_num_new_matched_tokens`) is side-effect free on the pools; pins are taken
//!   only in `update_state_after_alloc` (loads) and `build_step` (stores);
//! - a block being written is allocated (pinned, invisible to matching) at dispatch and
//!   registered only after every rank confirmed its store; a failed store frees it;
//! - a block that a load reads stays pinned until every rank reported the load;
//! - a block whose load failed is never matched again: a host or disk block is invalidated, a
//!   remote hash is remembered (at most `MAX_REMOTE_FAILED`) and skipped by matching until the
//!   leader puts it again;
//! - a hash is never stored twice at once (a store reserves its hash in the target pool at
//!   dispatch, `BlockPool::reserve`, so a second store of it finds the reservation), and a hash
//!   already registered in the target tier is not stored again;
//! - `request_finished` returns true exactly while a store of that request is not confirmed by
//!   every rank; the slot lives until its stores and loads are all confirmed;
//! - invalid engine input returns [`ConnectorError::InvalidInput`] and changes nothing for any
//!   other request; work planned before the error stays queued for the next metadata.
//!
//! Not thread-safe by itself: the engine's scheduler thread owns it (`&mut self`).
use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crate::connector::fasthash::FastSet;
use crate::connector::jobs::JobTable;
use crate::connector::messages::{
    remote_key_for_rank, ClusterLayout, RequestLoad, RequestStore, StepMetadata, WorkerReport,
    PROTOCOL_VERSION,
};
use crate::connector::slot::{MatchRecord, OffloadBlock, OnboardBlock, Slot, SlotState};
use crate::connector::slot_table::SlotTable;
use crate::connector::step::{SchedulerStep, StepRecord};
use crate::connector::ConnectorError;
use crate::hash::{HashSalt, SequenceHash};
use crate::ids::{BlockId, DeviceBlockId, JobId, RequestId, Tier};
use crate::policy::{FilterParams, FrequencyFilter};
use crate::pool::{BlockPool, PoolEvent, Priority, Reservation};
use crate::transfer::{BlockPair, RemoteStore, TransferJob, TransferOutcome};

/// A pool size: in blocks, or in bytes (then divided by the sum of the ranks' bytes per block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    Blocks(usize),
    Bytes(u64),
}

impl Capacity {
    fn blocks(self, layout: Option<&ClusterLayout>, what: &str) -> Result<usize, ConnectorError> {
        match self {
            Capacity::Blocks(n) => Ok(n),
            Capacity::Bytes(0) => Ok(0),
            Capacity::Bytes(b) => match layout {
                Some(l) if l.total_bytes_per_block() > 0 => {
                    Ok((b / l.total_bytes_per_block()) as usize)
                }
                _ => Err(ConnectorError::Config(format!(
                    "{what} capacity given in bytes needs the ranks' layout (bytes per block)"
                ))),
            },
        }
    }
}

/// When a block confirmed in G2 is also written to G3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskPolicy {
    /// Never spill to disk (disk still serves blocks stored there directly when there is no host pool).
    Never,
    /// Every block confirmed in G2 is copied to G3.
    WriteThrough,
    /// A block goes to G3 once the policy's frequency filter has seen it twice within its window
    /// (stored or found again in G2), sparing the SSD one-off blocks.
    Filter(FilterParams),
}

impl DiskPolicy {
    /// The original's default: seen twice within 600 s, at most 1M tracked hashes.
    pub fn filtered() -> Self {
        DiskPolicy::Filter(FilterParams {
            window: std::time::Duration::from_secs(600),
            max_tracked: 1_000_000,
        })
    }
}

/// How the leader is set up.
#[derive(Clone)]
pub struct LeaderConfig {
    /// Tokens per block (equal to the engine's).
    pub block_size: usize,
    /// Separates key spaces (model, LoRA, tenant).
    pub salt: HashSalt,
    /// The ranks' agreed layout (from the handshake, or built in-process); `None` = one rank of
    /// unknown size (capacities must then be given in blocks).
    pub layout: Option<ClusterLayout>,
    /// G2 (host) pool size; 0 = no host tier.
    pub host: Capacity,
    /// G3 (disk) pool size; 0 = no disk tier.
    pub disk: Capacity,
    pub disk_policy: DiskPolicy,
    /// Optional G4 store: consulted by matching; written (host -> remote) when `remote_put`.
    pub remote: Option<Arc<dyn RemoteStore>>,
    pub remote_put: bool,
    /// Load matched blocks asynchronously (reported via `get_finished`) instead of before the
    /// step's forward pass.
    pub async_loads: bool,
    /// Retention priority of stored blocks.
    pub priority: Priority,
}

impl std::fmt::Debug for LeaderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderConfig")
            .field("block_size", &self.block_size)
            .field("salt", &self.salt)
            .field("layout", &self.layout)
            .field("host", &self.host)
            .field("disk", &self.disk)
            .field("disk_policy", &self.disk_policy)
            .field("remote", &self.remote.is_some())
            .field("remote_put", &self.remote_put)
            .field("async_loads", &self.async_loads)
            .field("priority", &self.priority)
            .finish()
    }
}

impl LeaderConfig {
    /// A host-only configuration of `host_blocks` blocks.
    pub fn new(block_size: usize, salt: HashSalt, host_blocks: usize) -> Self {
        LeaderConfig {
            block_size,
            salt,
            layout: None,
            host: Capacity::Blocks(host_blocks),
            disk: Capacity::Blocks(0),
            disk_policy: DiskPolicy::filtered(),
            remote: None,
            remote_put: false,
            async_loads: false,
            priority: Priority::default(),
        }
    }
}

/// Remote hashes whose load failed that matching skips; beyond this many the memory starts over.
pub const MAX_REMOTE_FAILED: usize = 1 << 16;

/// Pool events the leader keeps for `take_events` before dropping the oldest.
pub const MAX_EVENTS: usize = 1 << 16;

/// A change in what the tiers hold (for KV-aware routers).
pub type KvEvent = PoolEvent;

/// Counters and gauges of the leader (pulled).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaderStats {
    pub steps: u64,
    pub active_requests: usize,
    pub jobs_in_flight: usize,
    pub match_queries: u64,
    pub matched_tokens: u64,
    /// Full blocks handed to the offload tier / confirmed / failed.
    pub offload_blocks: u64,
    pub offload_confirmed: u64,
    pub offload_failed: u64,
    /// Offload candidates skipped because the tier already held (or was writing) their hash.
    pub offload_deduplicated: u64,
    /// Offload candidates dropped because the tier had no free or evictable block.
    pub offload_dropped: u64,
    pub onboard_host_blocks: u64,
    pub onboard_disk_blocks: u64,
    pub onboard_remote_blocks: u64,
    /// Blocks whose load failed (on any rank) or whose source had vanished.
    pub onboard_failed: u64,
    /// Host -> disk copies dispatched / written and registered in G3 / failed.
    pub spill_disk_blocks: u64,
    pub spill_disk_confirmed: u64,
    pub spill_disk_failed: u64,
    /// Host -> remote puts dispatched / written by every rank / failed.
    pub remote_put_blocks: u64,
    pub remote_put_confirmed: u64,
    pub remote_put_failed: u64,
    /// Pool events dropped because nobody took them (`take_events`) in time.
    pub events_dropped: u64,
    /// Requests matched again after an allocation but before they ever ran (the engine freed
    /// their blocks to start them over, e.g. after a failed asynchronous load): recomputed.
    pub load_restarts: u64,
    /// Requests the engine marked as not cacheable (kvtier cannot key their KV): never matched,
    /// never stored.
    pub uncacheable_requests: u64,
    pub host_capacity: usize,
    pub host_free: usize,
    pub host_registered: usize,
    pub disk_capacity: usize,
    pub disk_free: usize,
    pub disk_registered: usize,
    /// The remote store's breaker and deadline counters (the leader's store: its lookups, and
    /// the ranks' loads and stores where they share it in one process).
    pub remote: crate::transfer::RemoteHealth,
}

/// What, besides its token ids, decides which blocks a request may share (see
/// [`Leader::get_num_new_matched_tokens_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestKey {
    /// The request's own identity (LoRA adapter, tenant cache salt, multimodal inputs, prompt
    /// embeddings), in one canonical string built by the adapter; `None` = the engine salt alone.
    pub identity: Option<String>,
    /// `false`: kvtier cannot key this request's KV correctly; it is never matched nor stored.
    pub cacheable: bool,
}

impl Default for RequestKey {
    fn default() -> Self {
        RequestKey {
            identity: None,
            cacheable: true,
        }
    }
}

/// One load job being planned: source tier, pairs, pinned pool blocks, remote keys.
type TierLoad = (Tier, Vec<BlockPair>, Vec<BlockId>, Vec<u128>);

/// What one in-flight job will do to the books when every rank has reported it.
#[derive(Debug)]
enum JobBooks {
    /// Device -> `tier`: the block written per pair (each reserved its hash in the pool).
    Store {
        request: RequestId,
        tier: Tier,
        blocks: Vec<BlockId>,
        /// Retention priority per block (the engine's, else the configured default).
        priorities: Vec<Priority>,
    },
    /// `src` -> device: pool blocks pinned for the read (empty for remote).
    Load {
        request: RequestId,
        src: Tier,
        pinned: Vec<BlockId>,
        /// Destination device block per pair.
        devices: Vec<DeviceBlockId>,
        /// Remote loads: the hash each pair reads (empty for host and disk).
        remote_hashes: Vec<u128>,
    },
    /// Host -> disk: `(host block read, disk block written, hash)` per pair.
    SpillDisk {
        blocks: Vec<(BlockId, BlockId, SequenceHash)>,
    },
    /// Host -> remote: host blocks read.
    PutRemote { host_blocks: Vec<BlockId> },
    /// Device -> remote (no host tier: the node tier is the engine's G2): `blocks` pairs, no
    /// pool block behind them; the engine's device blocks stay held until every rank reported.
    StoreRemote { request: RequestId, blocks: usize },
}

/// The ranks that reported a job: one bit per rank, inline for the first 64 (no allocation in
/// the common case).
#[derive(Debug)]
struct RankSet {
    low: u64,
    high: Vec<bool>,
}

impl RankSet {
    fn new(world: u32) -> Self {
        RankSet {
            low: 0,
            high: vec![false; world.saturating_sub(64) as usize],
        }
    }

    /// Mark `rank` (below the world size); false if it was marked already.
    fn insert(&mut self, rank: u32) -> bool {
        if rank < 64 {
            let bit = 1u64 << rank;
            let fresh = self.low & bit == 0;
            self.low |= bit;
            fresh
        } else {
            match self.high.get_mut(rank as usize - 64) {
                Some(seen) => !std::mem::replace(seen, true),
                None => false,
            }
        }
    }
}

#[derive(Debug)]
struct PendingJob {
    books: JobBooks,
    reported: RankSet,
    /// Ranks that have not reported yet.
    waiting: u32,
    failed: BTreeSet<usize>,
}

/// Reused buffers of the per-record store path.
#[derive(Debug, Default)]
struct Scratch {
    offloads: Vec<OffloadBlock>,
    hashes: Vec<SequenceHash>,
    reservations: Vec<Reservation>,
    seen_again: Vec<(BlockId, SequenceHash)>,
}

#[derive(Debug)]
struct SlotEntry {
    slot: Slot,
    stores_in_flight: usize,
    loads_in_flight: usize,
}

impl SlotEntry {
    fn new(slot: Slot) -> Self {
        SlotEntry {
            slot,
            stores_in_flight: 0,
            loads_in_flight: 0,
        }
    }
}

/// The scheduler-side connector. See the module documentation.
pub struct Leader {
    block_size: usize,
    salt: HashSalt,
    world: u32,
    num_device_blocks: Option<u32>,
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    disk_policy: DiskPolicy,
    disk_filter: Option<FrequencyFilter>,
    /// Origin of the filter's clock.
    started: std::time::Instant,
    remote: Option<Arc<dyn RemoteStore>>,
    remote_put: bool,
    async_loads: bool,
    priority: Priority,
    /// Engine-supplied retention priority of device blocks (TensorRT-LLM `RequestData.priorities`),
    /// set when a block is reported and used when it is stored; absent = `priority`.
    block_priorities: HashMap<DeviceBlockId, Priority>,
    slots: SlotTable<SlotEntry>,
    jobs: JobTable<PendingJob>,
    step: u64,
    /// Hashes with a disk spill in flight.
    spilling: FastSet<SequenceHash>,
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
}

impl Leader {
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
        let host = (host_blocks > 0)
            .then(|| BlockPool::new(Tier::Host, host_blocks))
            .transpose()?;
        let disk = (disk_blocks > 0)
            .then(|| BlockPool::new(Tier::Disk, disk_blocks))
            .transpose()?;
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
            host,
            disk,
            disk_policy: cfg.disk_policy,
            disk_filter: match cfg.disk_policy {
                DiskPolicy::Filter(p) => Some(FrequencyFilter::new(p)),
                _ => None,
            },
            started: std::time::Instant::now(),
            remote: cfg.remote,
            remote_put: cfg.remote_put,
            async_loads: cfg.async_loads,
            priority: cfg.priority,
            block_priorities: HashMap::new(),
            slots: SlotTable::default(),
            jobs: JobTable::default(),
            step: 0,
            spilling: FastSet::default(),
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

    pub fn world_size(&self) -> u32 {
        self.world
    }

    /// The request's slot, if the leader knows the request (read-only; for adapters and tests).
    pub fn slot(&self, req: &RequestId) -> Option<&Slot> {
        self.slots.get(req).map(|e| &e.slot)
    }

    fn new_job_id(&mut self) -> JobId {
        self.jobs.claim()
    }

    fn track(&mut self, id: JobId, books: JobBooks) {
        self.jobs.insert(
            id,
            PendingJob {
                books,
                reported: RankSet::new(self.world),
                waiting: self.world,
                failed: BTreeSet::new(),
            },
        );
    }

    fn check_device_ids(
        &self,
        req: &RequestId,
        field: &'static str,
        ids: &[DeviceBlockId],
    ) -> Result<(), ConnectorError> {
        if let Some(n) = self.num_device_blocks {
            if let Some(b) = ids.iter().find(|b| b.0 >= n) {
                return Err(ConnectorError::invalid(
                    req,
                    field,
                    format!("device block {} is beyond the engine's {n} blocks", b.0),
                ));
            }
        }
        Ok(())
    }

    // ----- matching -------------------------------------------------------------------------

    /// Which blocks of `hashes` the remote store holds for every rank (one round trip).
    fn remote_contains(&self, hashes: &[SequenceHash]) -> Vec<bool> {
        let Some(remote) = &self.remote else {
            return vec![false; hashes.len()];
        };
        if hashes.is_empty() {
            return Vec::new();
        }
        let w = self.world;
        let keys: Vec<u128> = hashes
            .iter()
            .flat_map(|h| (0..w).map(move |r| remote_key_for_rank(h.0, r, w)))
            .collect();
        match remote.contains(&keys) {
            Ok(found) if found.len() == keys.len() => found
                .chunks(w as usize)
                .map(|c| c.iter().all(|&b| b))
                .collect(),
            Ok(found) => {
                tracing::warn!(
                    asked = keys.len(),
                    answered = found.len(),
                    "remote contains answered the wrong count"
                );
                vec![false; hashes.len()]
            }
            Err(e) => {
                tracing::warn!(error = %e, "remote contains failed; treating as a miss");
                vec![false; hashes.len()]
            }
        }
    }

    /// Sources for consecutive blocks starting at `hashes[0]`, stopping at the first block no tier holds.
    fn find_sources(&self, hashes: &[SequenceHash]) -> Vec<(Tier, BlockId)> {
        let mut out = Vec::new();
        for &h in hashes {
            if let Some(b) = self.host.as_ref().and_then(|p| p.lookup(h)) {
                out.push((Tier::Host, b));
            } else if let Some(b) = self.disk.as_ref().and_then(|p| p.lookup(h)) {
                out.push((Tier::Disk, b));
            } else {
                break;
            }
        }
        if out.len() < hashes.len() && self.remote.is_some() {
            let rest = &hashes[out.len()..];
            let known_bad = rest.iter().position(|h| self.remote_failed.contains(h));
            let rest = &rest[..known_bad.unwrap_or(rest.len())];
            for (i, found) in self.remote_contains(rest).into_iter().enumerate() {
                if !found {
                    break;
                }
                out.push((Tier::Remote, BlockId(i as u32)));
            }
        }
        out
    }

    /// Tokens kvtier can supply beyond the engine's `num_computed_tokens` (block aligned; 0 if
    /// none). Side-effect free on the pools: engines may call it repeatedly. If the tiers would
    /// cover the whole prompt the last block is left out, so the engine computes at least one
    /// token. Matching a running request is an error.
    pub fn get_num_new_matched_tokens(
        &mut self,
        req: &RequestId,
        all_tokens: &[u32],
        num_computed_tokens: usize,
    ) -> Result<usize, ConnectorError> {
        self.get_num_new_matched_tokens_for(
            req,
            all_tokens,
            num_computed_tokens,
            &RequestKey::default(),
        )
    }

    /// [`Leader::get_num_new_matched_tokens`] for a request with its own identity (`key`): its
    /// blocks are hashed with the engine salt combined with `key.identity`, and a request that
    /// is not `key.cacheable` is never matched nor stored. A request's key is fixed by its
    /// first match: a different key later is an error.
    pub fn get_num_new_matched_tokens_for(
        &mut self,
        req: &RequestId,
        all_tokens: &[u32],
        num_computed_tokens: usize,
        key: &RequestKey,
    ) -> Result<usize, ConnectorError> {
        self.poll_reports();
        let bs = self.block_size;
        let salt = match &key.identity {
            Some(identity) => self.salt.for_request(identity),
            None => self.salt,
        };
        match self.slots.get(req) {
            None => {
                let slot = if key.cacheable {
                    Slot::new(req.clone(), self.block_size, salt)
                } else {
                    self.stats.uncacheable_requests += 1;
                    Slot::private(req.clone(), self.block_size, salt)
                };
                self.slots.insert(req.clone(), SlotEntry::new(slot), None);
            }
            Some(e) if e.slot.salt() != salt || e.slot.is_private() == key.cacheable => {
                return Err(ConnectorError::invalid(
                    req,
                    "identity",
                    "a request's identity (and whether it is cacheable) is fixed by its first match",
                ));
            }
            Some(_) => {}
        }
        let Some(entry) = self.slots.get_mut(req) else {
            return Err(ConnectorError::invalid(req, "request_id", "slot missing"));
        };
        if !entry.slot.can_match() {
            return Err(ConnectorError::invalid(
                req,
                "request_id",
                format!("matching a request in state {:?}", entry.slot.state()),
            ));
        }
        if entry.slot.state() == SlotState::Allocated {
            // Matched again after an allocation but before any record: the engine freed the
            // request's blocks to start it over (vLLM, after an asynchronous load failed at the
            // request's first block). Its device table is gone; it is recomputed from now on.
            entry.slot.preempt()?;
            entry.slot.refuse_external();
            self.stats.load_restarts += 1;
            tracing::debug!(request = %req, "restarted before running; recomputed from now on");
        }
        let refused = entry.slot.external_refused();
        if num_computed_tokens > all_tokens.len() {
            return Err(ConnectorError::invalid(
                req,
                "num_computed_tokens",
                format!(
                    "{num_computed_tokens} computed tokens but only {} tokens",
                    all_tokens.len()
                ),
            ));
        }
        entry.slot.set_all_tokens(all_tokens);
        self.stats.match_queries += 1;
        let device_blocks = num_computed_tokens / bs;
        let mut external = 0;
        if num_computed_tokens.is_multiple_of(bs) && !refused {
            let hashes = match self.slots.get(req) {
                Some(e) => e.slot.hashes(),
                None => &[],
            };
            let first = device_blocks.min(hashes.len());
            let found = self.find_sources(&hashes[first..]).len();
            let mut end = first + found;
            if end > first && end * bs >= all_tokens.len() {
                end -= 1;
            }
            external = (end - first) * bs;
        }
        if let Some(e) = self.slots.get_mut(req) {
            e.slot.record_match(MatchRecord {
                device_tokens: device_blocks * bs,
                external_tokens: external,
            });
        }
        self.stats.matched_tokens += external as u64;
        tracing::debug!(request = %req, num_computed_tokens, external, "matched");
        Ok(external)
    }

    // ----- allocation and onboarding --------------------------------------------------------

    /// The engine allocated `block_ids` (the request's whole table; ids already known are
    /// recognised) and accepted `num_external_tokens` (`None` = what the last match found).
    /// Pins the sources and plans the loads for the next metadata. A block whose source has
    /// vanished since matching is reported as a load error by every worker.
    pub fn update_state_after_alloc(
        &mut self,
        req: &RequestId,
        block_ids: &[DeviceBlockId],
        num_external_tokens: Option<usize>,
    ) -> Result<(), ConnectorError> {
        // No report is applied here: between matching and allocation the pools must not change,
        // so the promised blocks are still there.
        self.check_device_ids(req, "block_ids", block_ids)?;
        let external = num_external_tokens.unwrap_or(0);
        let never_matched = !self.slots.contains_key(req);
        if never_matched {
            let slot = Slot::new(req.clone(), self.block_size, self.salt);
            self.slots.insert(req.clone(), SlotEntry::new(slot), None);
        }
        let Some(e) = self.slots.get_mut(req) else {
            return Err(ConnectorError::invalid(req, "request_id", "slot missing"));
        };
        let allocated = if never_matched && external > 0 {
            Err(ConnectorError::invalid(
                req,
                "request_id",
                "external tokens for a request that was never matched",
            ))
        } else {
            e.slot.allocate(block_ids, num_external_tokens)
        };
        let onboard = match allocated {
            Ok(onboard) => onboard,
            Err(err) => {
                // The engine now waits for tokens kvtier will not load: it must recompute them,
                // and must not be offered them again.
                if external > 0 {
                    e.slot.refuse_external();
                }
                return Err(err);
            }
        };
        if onboard.is_empty() {
            return Ok(());
        }
        self.plan_loads(req, &onboard);
        Ok(())
    }

    fn plan_loads(&mut self, req: &RequestId, onboard: &[OnboardBlock]) {
        let hashes: Vec<SequenceHash> = onboard.iter().map(|b| b.hash).collect();
        let sources = self.find_sources(&hashes);
        let mut per_tier: Vec<TierLoad> = Vec::new();
        for (ob, &(tier, block)) in onboard.iter().zip(&sources) {
            let k = match per_tier.iter().position(|t| t.0 == tier) {
                Some(k) => k,
                None => {
                    per_tier.push((tier, Vec::new(), Vec::new(), Vec::new()));
                    per_tier.len() - 1
                }
            };
            let entry = &mut per_tier[k];
            match tier {
                Tier::Remote => {
                    entry.1.push(BlockPair {
                        src: entry.3.len() as u32,
                        dst: ob.device.0,
                    });
                    entry.3.push(ob.hash.0);
                }
                _ => {
                    let pool = if tier == Tier::Host {
                        self.host.as_mut()
                    } else {
                        self.disk.as_mut()
                    };
                    if let Some(p) = pool {
                        if let Err(e) = p.pin(block) {
                            tracing::error!(error = %e, "pinning a just-found block failed");
                        }
                    }
                    entry.1.push(BlockPair {
                        src: block.0,
                        dst: ob.device.0,
                    });
                    entry.2.push(block);
                    if tier == Tier::Disk {
                        // The disk tier checks the slot holds this hash's block.
                        entry.3.push(ob.hash.0);
                    }
                }
            }
        }
        let failed_devices: Vec<DeviceBlockId> =
            onboard[sources.len()..].iter().map(|b| b.device).collect();
        self.stats.onboard_failed += failed_devices.len() as u64;
        if let (Some(first), Some(e)) = (onboard.get(sources.len()), self.slots.get_mut(req)) {
            e.slot.load_failed(first.index);
        }
        if !failed_devices.is_empty() {
            tracing::warn!(request = %req, blocks = failed_devices.len(), "matched blocks vanished before allocation; reporting load errors");
        }
        let mut jobs = Vec::new();
        for (tier, pairs, pinned, keys) in per_tier {
            match tier {
                Tier::Host => self.stats.onboard_host_blocks += pairs.len() as u64,
                Tier::Disk => self.stats.onboard_disk_blocks += pairs.len() as u64,
                _ => self.stats.onboard_remote_blocks += pairs.len() as u64,
            }
            let id = self.new_job_id();
            let devices = pairs.iter().map(|p| DeviceBlockId(p.dst)).collect();
            let remote_hashes = if tier == Tier::Remote {
                keys.clone()
            } else {
                Vec::new()
            };
            jobs.push(TransferJob {
                id,
                src: tier,
                dst: Tier::Device,
                pairs,
                remote_keys: keys,
            });
            self.track(
                id,
                JobBooks::Load {
                    request: req.clone(),
                    src: tier,
                    pinned,
                    devices,
                    remote_hashes,
                },
            );
        }
        if let Some(e) = self.slots.get_mut(req) {
            e.loads_in_flight += jobs.len();
        }
        self.outbox.loads.push(RequestLoad {
            request: req.clone(),
            sync: !self.async_loads,
            jobs,
            failed_devices,
        });
    }

    // ----- steps and offloading -------------------------------------------------------------

    /// Consume one engine step and return the metadata every worker must receive for it.
    /// On invalid input the error names the first bad record; valid records are still applied
    /// and their work stays queued for the next call (the adapter must then fail the step).
    pub fn build_step(&mut self, step: &SchedulerStep) -> Result<StepMetadata, ConnectorError> {
        let (meta, mut errors) = self.build_step_lenient(step);
        if errors.is_empty() {
            Ok(meta)
        } else {
            // Put the planned work back so nothing pinned is lost.
            let mut meta = meta;
            meta.loads.append(&mut self.outbox.loads);
            meta.stores.append(&mut self.outbox.stores);
            meta.background.append(&mut self.outbox.background);
            meta.saving.append(&mut self.outbox.saving);
            self.outbox = meta;
            Err(errors.swap_remove(0))
        }
    }

    /// Like [`Leader::build_step`], but skips invalid records and returns their errors beside the
    /// metadata of everything valid (for adapters that abort single requests).
    pub fn build_step_lenient(
        &mut self,
        step: &SchedulerStep,
    ) -> (StepMetadata, Vec<ConnectorError>) {
        self.poll_reports();
        let mut errors = Vec::new();
        for (pos, rec) in step.records.iter().enumerate() {
            if let Err(e) = self.apply_record(pos, rec) {
                tracing::warn!(error = %e, "invalid step record");
                errors.push(e);
            }
        }
        for f in &step.finished {
            if let Some(e) = self.slots.get_mut(f) {
                e.slot.finish();
            }
            self.maybe_drop_slot(f);
        }
        self.bound_events();
        self.step += 1;
        self.stats.steps += 1;
        let mut meta = std::mem::take(&mut self.outbox);
        meta.version = PROTOCOL_VERSION;
        meta.step = self.step;
        self.outbox.version = PROTOCOL_VERSION;
        // The next step most likely stores about as many jobs: no regrowth on the way.
        self.outbox.stores.reserve(meta.stores.len());
        (meta, errors)
    }

    /// Apply the record at position `pos` of its step.
    fn apply_record(&mut self, pos: usize, rec: &StepRecord) -> Result<(), ConnectorError> {
        let req = &rec.request_id;
        self.check_device_ids(req, "new_block_ids", &rec.new_block_ids)?;
        let mut offloads = std::mem::take(&mut self.scratch.offloads);
        offloads.clear();
        let applied = self.apply_to_slot(pos, rec, &mut offloads);
        if applied.is_ok() && !offloads.is_empty() {
            self.dispatch_stores(req, &offloads);
        }
        self.scratch.offloads = offloads;
        applied
    }

    /// Feed `rec` to its slot (created for a new request); the blocks to offload go to `out`.
    fn apply_to_slot(
        &mut self,
        pos: usize,
        rec: &StepRecord,
        out: &mut Vec<OffloadBlock>,
    ) -> Result<(), ConnectorError> {
        let req = &rec.request_id;
        match self.slots.get_mut_at(pos, req) {
            Some(e) => e.slot.apply_into(rec, out),
            None if !rec.is_new => Err(ConnectorError::invalid(
                req,
                "request_id",
                "unknown request (not new)",
            )),
            None => {
                let mut slot = Slot::new(req.clone(), self.block_size, self.salt);
                slot.apply_into(rec, out)?;
                self.slots
                    .insert(req.clone(), SlotEntry::new(slot), Some(pos));
                Ok(())
            }
        }
    }

    /// Reserve the target tier's blocks for `offloads` (one batched pool call: one registry probe
    /// per block both deduplicates and reserves) and queue one store job for those it got.
    fn dispatch_stores(&mut self, req: &RequestId, offloads: &[OffloadBlock]) {
        if self.host.is_none() && self.remote_put && self.remote.is_some() {
            self.dispatch_remote_store(req, offloads);
        }
        let (tier, pool) = match (self.host.as_mut(), self.disk.as_mut()) {
            (Some(p), _) => (Tier::Host, p),
            (None, Some(p)) => (Tier::Disk, p),
            (None, None) => return,
        };
        let sc = &mut self.scratch;
        sc.hashes.clear();
        sc.hashes.extend(offloads.iter().map(|b| b.hash));
        sc.reservations.clear();
        pool.reserve(&sc.hashes, &mut sc.reservations);
        sc.seen_again.clear();
        let mut pairs = Vec::with_capacity(offloads.len());
        let mut books: Vec<BlockId> = Vec::with_capacity(offloads.len());
        // Disk stores bind each slot to its hash (`TransferJob::remote_keys`).
        let mut disk_keys = Vec::new();
        let mut priorities: Vec<Priority> = Vec::with_capacity(offloads.len());
        let mut dropped = 0u64;
        for (ob, r) in offloads.iter().zip(&sc.reservations) {
            match *r {
                Reservation::Allocated(blk) => {
                    pairs.push(BlockPair {
                        src: ob.device.0,
                        dst: blk.0,
                    });
                    books.push(blk);
                    if tier == Tier::Disk {
                        disk_keys.push(ob.hash.0);
                    }
                    priorities.push(
                        self.block_priorities
                            .get(&ob.device)
                            .copied()
                            .unwrap_or(self.priority),
                    );
                }
                Reservation::Registered(existing) => {
                    self.stats.offload_deduplicated += 1;
                    if tier == Tier::Host {
                        sc.seen_again.push((existing, ob.hash));
                    }
                }
                Reservation::Writing(_) => self.stats.offload_deduplicated += 1,
                Reservation::NoSpace => dropped += 1,
            }
        }
        if dropped > 0 {
            self.stats.offload_dropped += dropped;
            tracing::debug!(request = %req, dropped, "offload tier full");
        }
        if !pairs.is_empty() {
            self.stats.offload_blocks += pairs.len() as u64;
            let id = self.new_job_id();
            self.track(
                id,
                JobBooks::Store {
                    request: req.clone(),
                    tier,
                    blocks: books,
                    priorities,
                },
            );
            if let Some(e) = self.slots.get_mut(req) {
                e.stores_in_flight += 1;
            }
            self.outbox.stores.push(RequestStore {
                request: req.clone(),
                job: TransferJob {
                    id,
                    src: Tier::Device,
                    dst: tier,
                    pairs,
                    remote_keys: disk_keys,
                },
            });
        }
        if !self.scratch.seen_again.is_empty() {
            let seen = std::mem::take(&mut self.scratch.seen_again);
            self.spill_seen_again(&seen);
            self.scratch.seen_again = seen;
        }
    }

    /// With no host tier (node-only: the node's arena is this engine's G2): one device ->
    /// remote store job for `offloads`, straight from the engine's blocks. The remote store
    /// deduplicates (a block already there is not written again) and makes a block visible only
    /// once written; the request keeps its device blocks until every rank reported the job.
    fn dispatch_remote_store(&mut self, req: &RequestId, offloads: &[OffloadBlock]) {
        if offloads.is_empty() {
            return;
        }
        let mut pairs = Vec::with_capacity(offloads.len());
        let mut keys = Vec::with_capacity(offloads.len());
        for (k, ob) in offloads.iter().enumerate() {
            // A fresh value replaces whatever failed to load under this hash.
            self.remote_failed.remove(&ob.hash);
            pairs.push(BlockPair {
                src: ob.device.0,
                dst: k as u32,
            });
            keys.push(ob.hash.0);
        }
        let n = pairs.len();
        self.stats.offload_blocks += n as u64;
        self.stats.remote_put_blocks += n as u64;
        let id = self.new_job_id();
        self.track(
            id,
            JobBooks::StoreRemote {
                request: req.clone(),
                blocks: n,
            },
        );
        if let Some(e) = self.slots.get_mut(req) {
            e.stores_in_flight += 1;
        }
        self.outbox.stores.push(RequestStore {
            request: req.clone(),
            job: TransferJob {
                id,
                src: Tier::Device,
                dst: Tier::Remote,
                pairs,
                remote_keys: keys,
            },
        });
    }

    /// Blocks found again in G2 count as sightings for the disk filter.
    fn spill_seen_again(&mut self, seen: &[(BlockId, SequenceHash)]) {
        if self.disk.is_none() || self.disk_policy == DiskPolicy::Never {
            return;
        }
        for &(blk, hash) in seen {
            // A later block of the same batch may have evicted it since it was found.
            if self.host.as_ref().and_then(|h| h.hash_of(blk)) == Some(hash) {
                self.plan_spills(blk, hash, false);
            }
        }
    }

    // ----- finishing and preemption ---------------------------------------------------------

    /// The engine finished (or aborted) the request. Returns true while any of its stores is
    /// not yet confirmed by every rank: the engine must keep its device blocks until the
    /// workers report the request as saved.
    pub fn request_finished(&mut self, req: &RequestId) -> Result<bool, ConnectorError> {
        self.poll_reports();
        let Some(e) = self.slots.get_mut(req) else {
            return Err(ConnectorError::invalid(
                req,
                "request_id",
                "unknown request",
            ));
        };
        e.slot.finish();
        // Loads planned for it and not yet handed to a worker never run: nothing was copied.
        self.withdraw_unsent_loads(req);
        // Device blocks stay with the request while any of its copies may still land in them
        // (a load cancelled in flight must not write into blocks given to another request).
        let in_flight = self
            .slots
            .get(req)
            .is_some_and(|e| e.stores_in_flight > 0 || e.loads_in_flight > 0);
        if in_flight {
            self.outbox.saving.push(req.clone());
        }
        self.maybe_drop_slot(req);
        Ok(in_flight)
    }

    /// Drops `req`'s loads still waiting in the outbox and releases their sources as if they had
    /// succeeded (no block is invalidated: nothing was read).
    fn withdraw_unsent_loads(&mut self, req: &RequestId) {
        if !self.outbox.loads.iter().any(|l| &l.request == req) {
            return;
        }
        let mut kept = Vec::with_capacity(self.outbox.loads.len());
        for l in std::mem::take(&mut self.outbox.loads) {
            if &l.request != req {
                kept.push(l);
                continue;
            }
            for j in l.jobs {
                if let Some(mut pending) = self.jobs.remove(j.id) {
                    pending.failed.clear();
                    self.complete(pending);
                }
            }
        }
        self.outbox.loads = kept;
    }

    /// The engine preempted the request and freed its device blocks; it may be matched again.
    /// Forget every block of the host and disk tiers (the engine's prefix-cache reset, e.g.
    /// vLLM's `reset_cache`): registered blocks leave matching at once (pinned ones are freed
    /// when their loads release them). Stores still in flight register when they complete, so
    /// an engine clears everything by calling this with no request running (vLLM resets its
    /// prefix cache only then). The shared remote tier is left alone: other engines own its
    /// values. Returns the number of blocks forgotten.
    pub fn clear_tiers(&mut self) -> usize {
        let mut n = 0;
        for pool in [self.host.as_mut(), self.disk.as_mut()]
            .into_iter()
            .flatten()
        {
            let before = pool.num_registered();
            for b in 0..pool.capacity() {
                // Ids below capacity are always valid.
                let _ = pool.invalidate(crate::ids::BlockId(b as u32));
            }
            n += before - pool.num_registered();
        }
        tracing::info!(blocks = n, "kvtier tiers cleared (prefix cache reset)");
        n
    }

    pub fn request_preempted(&mut self, req: &RequestId) -> Result<(), ConnectorError> {
        match self.slots.get_mut(req) {
            Some(e) => e.slot.preempt(),
            None => Err(ConnectorError::invalid(
                req,
                "request_id",
                "unknown request",
            )),
        }
    }

    /// The engine's retention priority for device blocks it reports next (aligned with
    /// `blocks`); blocks stored from then on enter the host/disk pools with it, so the pools'
    /// priority-aware eviction keeps high-priority blocks longest. `None` clears them (the
    /// configured default applies again).
    pub fn set_block_priorities(&mut self, blocks: &[DeviceBlockId], priorities: Option<&[u32]>) {
        match priorities {
            Some(p) => {
                for (b, &v) in blocks.iter().zip(p) {
                    self.block_priorities.insert(*b, Priority(v));
                }
            }
            None if !self.block_priorities.is_empty() => {
                for b in blocks {
                    self.block_priorities.remove(b);
                }
            }
            None => {}
        }
    }

    /// Whether stores of `req` are still unconfirmed (false for unknown requests).
    pub fn has_pending_saves(&self, req: &RequestId) -> bool {
        self.slots.get(req).is_some_and(|e| e.stores_in_flight > 0)
    }

    /// A store (`store`) or load job of `req` completed: one lookup updates the count and
    /// drops a finished slot with nothing left in flight.
    fn job_done(&mut self, req: &RequestId, store: bool) {
        let drop = match self.slots.get_mut(req) {
            Some(e) => {
                let n = if store {
                    &mut e.stores_in_flight
                } else {
                    &mut e.loads_in_flight
                };
                *n = n.saturating_sub(1);
                e.slot.state() == SlotState::Finished
                    && e.stores_in_flight == 0
                    && e.loads_in_flight == 0
            }
            None => false,
        };
        if drop {
            self.slots.remove(req);
        }
    }

    fn maybe_drop_slot(&mut self, req: &RequestId) {
        let drop = self.slots.get(req).is_some_and(|e| {
            e.slot.state() == SlotState::Finished
                && e.stores_in_flight == 0
                && e.loads_in_flight == 0
        });
        if drop {
            self.slots.remove(req);
        }
    }

    // ----- worker reports -------------------------------------------------------------------

    /// Apply every report that arrived since the last call. Called by every public method.
    pub fn poll_reports(&mut self) {
        while let Ok(r) = self.reports_rx.try_recv() {
            self.apply_report(r);
        }
    }

    /// Apply one worker report (also usable directly by a channel that is not an mpsc).
    pub fn apply_report(&mut self, r: WorkerReport) {
        let Some(job) = self.jobs.get_mut(r.job) else {
            tracing::warn!(job = r.job.0, rank = r.rank, "report for an unknown job");
            return;
        };
        if r.rank >= self.world {
            tracing::warn!(
                job = r.job.0,
                rank = r.rank,
                "report from a rank beyond the world size"
            );
            return;
        }
        if !job.reported.insert(r.rank) {
            tracing::warn!(job = r.job.0, rank = r.rank, "duplicate report");
            return;
        }
        job.waiting = job.waiting.saturating_sub(1);
        if let TransferOutcome::Failed(f) = &r.outcome {
            for b in f {
                tracing::warn!(job = r.job.0, rank = r.rank, pair = b.pair_index, reason = %b.reason, "transfer pair failed");
                job.failed.insert(b.pair_index);
            }
        }
        if job.waiting == 0 {
            if let Some(done) = self.jobs.remove(r.job) {
                self.complete(done);
            }
        }
    }

    fn complete(&mut self, job: PendingJob) {
        let failed = job.failed;
        match job.books {
            JobBooks::Store {
                request,
                tier,
                blocks,
                priorities,
            } => {
                // Spills and remote puts follow a confirmed G2 store only when configured.
                let spills = tier == Tier::Host
                    && ((self.disk.is_some() && self.disk_policy != DiskPolicy::Never)
                        || (self.remote_put && self.remote.is_some()));
                for (i, blk) in blocks.into_iter().enumerate() {
                    let priority = priorities.get(i).copied().unwrap_or(self.priority);
                    if failed.contains(&i) {
                        // Releasing the unconfirmed block frees it and drops its reservation.
                        self.stats.offload_failed += 1;
                        self.release(tier, blk);
                        continue;
                    }
                    let pool = if tier == Tier::Host {
                        self.host.as_mut()
                    } else {
                        self.disk.as_mut()
                    };
                    let Some(pool) = pool else { continue };
                    // Without spills the writer's pin goes in the same call (one pass).
                    let confirmed = if spills {
                        pool.confirm(blk, priority)
                    } else {
                        pool.confirm_and_release(blk, priority)
                    };
                    let hash = match confirmed {
                        Ok(hash) => hash,
                        Err(e) => {
                            tracing::error!(error = %e, "confirming a stored block failed");
                            continue;
                        }
                    };
                    self.stats.offload_confirmed += 1;
                    if spills {
                        self.plan_spills(blk, hash, true);
                        self.release(tier, blk);
                    }
                }
                self.job_done(&request, true);
            }
            JobBooks::Load {
                request,
                src,
                pinned,
                devices,
                remote_hashes,
            } => {
                if let Some(e) = self.slots.get_mut(&request) {
                    let first_failed = failed
                        .iter()
                        .filter_map(|&k| devices.get(k))
                        .filter_map(|d| e.slot.index_of(*d))
                        .min();
                    if let Some(i) = first_failed {
                        e.slot.load_failed(i);
                    }
                }
                for (i, blk) in pinned.into_iter().enumerate() {
                    if failed.contains(&i) {
                        // Its bytes could not be read: never offer it again.
                        let pool = if src == Tier::Host {
                            self.host.as_mut()
                        } else {
                            self.disk.as_mut()
                        };
                        if let Some(p) = pool {
                            let _ = p.invalidate(blk);
                        }
                    }
                    self.release(src, blk);
                }
                for &i in &failed {
                    if let Some(&h) = remote_hashes.get(i) {
                        if self.remote_failed.len() >= MAX_REMOTE_FAILED {
                            self.remote_failed.clear();
                        }
                        self.remote_failed.insert(SequenceHash(h));
                    }
                }
                self.stats.onboard_failed += failed.len() as u64;
                self.job_done(&request, false);
            }
            JobBooks::SpillDisk { blocks } => {
                for (i, (hblk, dblk, hash)) in blocks.into_iter().enumerate() {
                    self.spilling.remove(&hash);
                    self.release(Tier::Host, hblk);
                    if failed.contains(&i) {
                        self.stats.spill_disk_failed += 1;
                        self.release(Tier::Disk, dblk);
                        continue;
                    }
                    if let Some(d) = self.disk.as_mut() {
                        match d.register(dblk, hash, self.priority) {
                            Ok(c) => {
                                self.stats.spill_disk_confirmed += 1;
                                let _ = d.release(c);
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "registering a spilled block failed")
                            }
                        }
                    }
                }
            }
            JobBooks::StoreRemote { request, blocks } => {
                let bad = failed.iter().filter(|&&i| i < blocks).count();
                self.stats.remote_put_failed += bad as u64;
                self.stats.remote_put_confirmed += (blocks - bad) as u64;
                self.stats.offload_failed += bad as u64;
                self.stats.offload_confirmed += (blocks - bad) as u64;
                self.job_done(&request, true);
            }
            JobBooks::PutRemote { host_blocks } => {
                let bad = failed.iter().filter(|&&i| i < host_blocks.len()).count();
                self.stats.remote_put_failed += bad as u64;
                self.stats.remote_put_confirmed += (host_blocks.len() - bad) as u64;
                for b in host_blocks {
                    self.release(Tier::Host, b);
                }
            }
        }
    }

    fn release(&mut self, tier: Tier, blk: BlockId) {
        let pool = match tier {
            Tier::Host => self.host.as_mut(),
            Tier::Disk => self.disk.as_mut(),
            _ => None,
        };
        if let Some(p) = pool {
            if let Err(e) = p.release(blk) {
                tracing::error!(error = %e, "releasing a pool block failed");
            }
        }
    }

    /// `hash` was stored in, or found again in, G2 as `host_block`: plan its copy to G3 (per the
    /// disk policy) and, on its first store, to G4.
    fn plan_spills(&mut self, host_block: BlockId, hash: SequenceHash, first_store: bool) {
        let wanted = self.disk.is_some()
            && match self.disk_policy {
                DiskPolicy::Never => false,
                DiskPolicy::WriteThrough => true,
                DiskPolicy::Filter(_) => {
                    let now = self.started.elapsed();
                    self.disk_filter
                        .as_mut()
                        .is_some_and(|f| f.observe(hash, now))
                }
            };
        let to_disk = wanted
            && !self.spilling.contains(&hash)
            && self
                .disk
                .as_ref()
                .is_some_and(|d| d.lookup(hash).is_none() && d.num_free() > 0);
        if to_disk {
            let got = self.disk.as_mut().map(|d| d.allocate(1));
            if let Some(Ok(v)) = got {
                if let Some(&dblk) = v.first() {
                    if let Some(h) = self.host.as_mut() {
                        let _ = h.pin(host_block);
                    }
                    self.spilling.insert(hash);
                    self.stats.spill_disk_blocks += 1;
                    let id = self.new_job_id();
                    self.outbox.background.push(TransferJob {
                        id,
                        src: Tier::Host,
                        dst: Tier::Disk,
                        pairs: vec![BlockPair {
                            src: host_block.0,
                            dst: dblk.0,
                        }],
                        remote_keys: vec![hash.0],
                    });
                    self.track(
                        id,
                        JobBooks::SpillDisk {
                            blocks: vec![(host_block, dblk, hash)],
                        },
                    );
                }
            }
        }
        if first_store && self.remote_put && self.remote.is_some() {
            // A fresh value replaces whatever failed to load under this hash.
            self.remote_failed.remove(&hash);
            if let Some(h) = self.host.as_mut() {
                let _ = h.pin(host_block);
            }
            self.stats.remote_put_blocks += 1;
            let id = self.new_job_id();
            self.outbox.background.push(TransferJob {
                id,
                src: Tier::Host,
                dst: Tier::Remote,
                pairs: vec![BlockPair {
                    src: host_block.0,
                    dst: 0,
                }],
                remote_keys: vec![hash.0],
            });
            self.track(
                id,
                JobBooks::PutRemote {
                    host_blocks: vec![host_block],
                },
            );
        }
    }

    // ----- observability --------------------------------------------------------------------

    pub fn stats(&self) -> LeaderStats {
        let mut s = self.stats.clone();
        s.active_requests = self.slots.len();
        s.jobs_in_flight = self.jobs.len();
        if let Some(h) = &self.host {
            s.host_capacity = h.capacity();
            s.host_free = h.num_free();
            s.host_registered = h.num_registered();
        }
        if let Some(d) = &self.disk {
            s.disk_capacity = d.capacity();
            s.disk_free = d.num_free();
            s.disk_registered = d.num_registered();
        }
        if let Some(r) = &self.remote {
            s.remote = r.health();
        }
        s
    }

    /// Bound the events nobody has taken yet: once a pool holds more than `MAX_EVENTS`, they
    /// move into the leader's queue, which keeps the newest `MAX_EVENTS`. Below that they stay
    /// in the pools, and `take_events` hands the pools' buffers over without copying them.
    fn bound_events(&mut self) {
        let over = |p: &Option<BlockPool>| p.as_ref().is_some_and(|p| p.num_events() > MAX_EVENTS);
        if over(&self.host) || over(&self.disk) || !self.events.is_empty() {
            self.collect_events();
        }
    }

    /// Move every pool's events into the leader's queue, dropping the oldest beyond `MAX_EVENTS`.
    fn collect_events(&mut self) {
        for pool in [self.host.as_mut(), self.disk.as_mut()]
            .into_iter()
            .flatten()
        {
            self.events.extend(pool.drain_events());
        }
        if self.events.len() > MAX_EVENTS {
            let excess = self.events.len() - MAX_EVENTS;
            self.events.drain(..excess);
            self.stats.events_dropped += excess as u64;
        }
    }

    /// Stored/removed events of every tier since the last call, oldest first within each tier
    /// (at most `MAX_EVENTS`; `LeaderStats::events_dropped` counts older ones that were dropped).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.poll_reports();
        let queued = |p: &Option<BlockPool>| p.as_ref().map_or(0, |p| p.num_events());
        if self.events.is_empty() && queued(&self.disk) == 0 {
            if let Some(h) = self.host.as_mut() {
                return h.take_events(); // the common case: one pool's buffer, moved
            }
        }
        self.collect_events();
        Vec::from(std::mem::take(&mut self.events))
    }

    /// Read access to the host pool (tests, metrics).
    pub fn host_pool(&self) -> Option<&BlockPool> {
        self.host.as_ref()
    }

    /// Read access to the disk pool (tests, metrics).
    pub fn disk_pool(&self) -> Option<&BlockPool> {
        self.disk.as_ref()
    }

    /// Register blocks the disk tier already holds at start (a warm restart: the disk store's
    /// `recovered()` list), so later requests match them. Call before the first step; a block
    /// whose slot is out of range or in use, or whose hash is already known, is skipped.
    /// Returns how many were registered. The disk tier still verifies each block (key and
    /// checksum) when it is loaded: one that fails is a failed load, recomputed and invalidated.
    pub fn adopt_disk_blocks(&mut self, blocks: &[(SequenceHash, BlockId)]) -> usize {
        let Some(d) = self.disk.as_mut() else {
            return 0;
        };
        let n = d.adopt(blocks, Priority::default());
        if n > 0 {
            tracing::info!(
                blocks = n,
                "disk tier: registered blocks kept from an earlier run"
            );
        }
        n
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn confirm_all(l: &mut Leader, m: &StepMetadata) {
        let jobs = m
            .stores
            .iter()
            .map(|s| s.job.id)
            .chain(m.background.iter().map(|j| j.id));
        for job in jobs.collect::<Vec<_>>() {
            l.apply_report(WorkerReport {
                rank: 0,
                job,
                outcome: TransferOutcome::Ok,
            });
        }
    }

    fn new_record(id: &str, tokens: Vec<u32>, first_block: u32) -> StepRecord {
        let blocks = (tokens.len() / 4) as u32;
        StepRecord {
            request_id: id.into(),
            num_scheduled_tokens: tokens.len(),
            new_tokens: tokens,
            new_block_ids: (first_block..first_block + blocks)
                .map(DeviceBlockId)
                .collect(),
            is_new: true,
            ..Default::default()
        }
    }

    /// A request matched again after its allocation, before it ever ran, was restarted by the
    /// engine (vLLM: an asynchronous load failed at its first block): it is recomputed from then
    /// on, as is a request whose allocation with external tokens was refused.
    #[test]
    fn restarted_or_refused_requests_are_recomputed() {
        let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 16)).unwrap();
        let prompt: Vec<u32> = (0..12).collect();
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("fill", prompt.clone(), 0)],
                finished: vec!["fill".into()],
            })
            .unwrap();
        confirm_all(&mut l, &m);
        let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();

        let r: RequestId = "r".into();
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
        l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
        // Matched again before any record: restarted; nothing external from now on.
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 0);
        assert_eq!(l.stats().load_restarts, 1);
        assert!(l.slot(&r).unwrap().device_table().is_empty());
        l.update_state_after_alloc(&r, &devs, Some(0)).unwrap();
        let mut rec = new_record("r", prompt.clone(), 20);
        rec.num_scheduled_tokens = 12;
        l.build_step(&SchedulerStep {
            records: vec![rec],
            finished: vec![],
        })
        .unwrap();

        let q: RequestId = "q".into();
        assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 0).unwrap(), 8);
        // 6 is not a whole number of blocks: refused, and never offered again.
        assert!(l.update_state_after_alloc(&q, &devs, Some(6)).is_err());
        assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 0).unwrap(), 0);
        // A request allocated with external tokens it was never matched for is refused too.
        let u: RequestId = "u".into();
        assert!(l.update_state_after_alloc(&u, &devs, Some(4)).is_err());
        assert_eq!(l.get_num_new_matched_tokens(&u, &prompt, 0).unwrap(), 0);
        assert_eq!(l.stats().load_restarts, 1);
    }

    /// Request "a" stores two blocks and every rank confirms them; returns the next metadata,
    /// which carries the background jobs (spills, remote puts) those confirmations planned.
    fn two_blocks_confirmed(l: &mut Leader) -> StepMetadata {
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("a", (0..8).collect(), 0)],
                finished: vec![],
            })
            .unwrap();
        confirm_all(l, &m);
        l.build_step(&SchedulerStep::default()).unwrap()
    }

    /// Report the first of two background jobs written, the second failed.
    fn one_written_one_failed(l: &mut Leader, m: &StepMetadata) {
        l.apply_report(WorkerReport {
            rank: 0,
            job: m.background[0].id,
            outcome: TransferOutcome::Ok,
        });
        l.apply_report(WorkerReport {
            rank: 0,
            job: m.background[1].id,
            outcome: TransferOutcome::Failed(vec![crate::transfer::BlockFailure {
                pair_index: 0,
                reason: "write failed".into(),
            }]),
        });
    }

    /// A spill counts as confirmed only once every rank wrote it (not while in flight, not failed).
    #[test]
    fn spills_are_confirmed_only_when_written() {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
        cfg.disk = Capacity::Blocks(8);
        cfg.disk_policy = DiskPolicy::WriteThrough;
        let mut l = Leader::new(cfg).unwrap();
        let m = two_blocks_confirmed(&mut l);
        assert_eq!(m.background.len(), 2);
        let s = l.stats();
        assert_eq!(
            (s.spill_disk_blocks, s.spill_disk_confirmed),
            (2, 0),
            "in flight"
        );
        one_written_one_failed(&mut l, &m);
        let s = l.stats();
        assert_eq!(
            (
                s.spill_disk_blocks,
                s.spill_disk_confirmed,
                s.spill_disk_failed
            ),
            (2, 1, 1)
        );
        assert_eq!(l.disk_pool().unwrap().num_registered(), 1);
    }

    /// A remote put counts as confirmed once every rank reported it, failed pairs excepted.
    #[test]
    fn remote_puts_are_confirmed_only_when_written() {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
        cfg.remote = Some(Arc::new(crate::connector::testing::MemoryRemoteStore::new()));
        cfg.remote_put = true;
        let mut l = Leader::new(cfg).unwrap();
        let m = two_blocks_confirmed(&mut l);
        assert_eq!(m.background.len(), 2);
        assert_eq!(l.stats().remote_put_confirmed, 0, "in flight");
        one_written_one_failed(&mut l, &m);
        let s = l.stats();
        assert_eq!(
            (
                s.remote_put_blocks,
                s.remote_put_confirmed,
                s.remote_put_failed
            ),
            (2, 1, 1)
        );
        assert_eq!(l.host_pool().unwrap().num_pinned(), 0);
    }

    /// Events come out in order per tier, are handed over once, and a leader nobody takes them
    /// from keeps only the newest `MAX_EVENTS`, counting the rest as dropped.
    #[test]
    fn events_are_ordered_bounded_and_counted() {
        let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 2)).unwrap();
        let step = |l: &mut Leader, i: u32| {
            let tokens: Vec<u32> = (0..4).map(|t| i * 4 + t).collect();
            let rec = new_record(&format!("r{i}"), tokens.clone(), i);
            let m = l
                .build_step(&SchedulerStep {
                    records: vec![rec],
                    finished: vec![format!("r{i}").as_str().into()],
                })
                .unwrap();
            confirm_all(l, &m);
            crate::hash::sequence_hashes(HashSalt(3), &tokens, 4)[0]
        };
        let h: Vec<SequenceHash> = (0..3).map(|i| step(&mut l, i)).collect();
        let host = Tier::Host;
        assert_eq!(
            l.take_events(),
            vec![
                KvEvent::Stored {
                    hash: h[0],
                    tier: host
                },
                KvEvent::Stored {
                    hash: h[1],
                    tier: host
                },
                KvEvent::Removed {
                    hash: h[0],
                    tier: host
                },
                KvEvent::Stored {
                    hash: h[2],
                    tier: host
                },
            ]
        );
        assert!(l.take_events().is_empty(), "handed over once");
        // Nobody takes events: two per step (a store and an eviction) pile up to the bound.
        let steps = (MAX_EVENTS / 2 + 10) as u32;
        let mut last = h[2];
        for i in 3..3 + steps {
            last = step(&mut l, i);
        }
        let ev = l.take_events();
        assert_eq!(ev.len(), MAX_EVENTS);
        assert_eq!(
            ev.last(),
            Some(&KvEvent::Stored {
                hash: last,
                tier: host
            })
        );
        assert_eq!(
            l.stats().events_dropped,
            2 * steps as u64 - MAX_EVENTS as u64
        );
        assert!(l.take_events().is_empty());
    }

    /// Regression: a record's offloads are reserved in order, so a block found in G2 can be evicted
    /// to make room for a later block of the same record. It must not then be spilled to disk under
    /// its old hash (its host block is being overwritten by the new store).
    #[test]
    fn a_g2_hit_evicted_by_its_own_batch_is_not_spilled() {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 2);
        cfg.disk = Capacity::Blocks(8);
        cfg.disk_policy = DiskPolicy::filtered(); // spill on the second sighting
        let mut l = Leader::new(cfg).unwrap();
        // A stores two blocks (first sighting of each); G2 is then full, A's block 0 the LRU.
        let a: Vec<u32> = (0..8).collect();
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("a", a.clone(), 0)],
                finished: vec![],
            })
            .unwrap();
        assert_eq!(m.stores.len(), 1);
        confirm_all(&mut l, &m);
        let hashes =
            crate::hash::sequence_hashes(HashSalt(3), &[&a[..], &[100, 101, 102, 103]].concat(), 4);
        let host = l.host_pool().unwrap();
        let (blk0, blk1) = (
            host.lookup(hashes[0]).unwrap(),
            host.lookup(hashes[1]).unwrap(),
        );
        assert_eq!(host.eviction_order(), vec![blk0, blk1]);
        // B repeats A's two blocks and adds a third: [hit, hit, new]; the new block evicts blk0.
        let mut b = a.clone();
        b.extend([100, 101, 102, 103]);
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("b", b, 10)],
                finished: vec![],
            })
            .unwrap();
        assert_eq!(m.stores.len(), 1);
        assert_eq!(
            m.stores[0].job.pairs,
            vec![BlockPair {
                src: 12,
                dst: blk0.0
            }]
        );
        // Only A's block 1, still in G2, is spilled on its second sighting.
        assert_eq!(m.background.len(), 1);
        assert_eq!(m.background[0].dst, Tier::Disk);
        assert_eq!(m.background[0].pairs[0].src, blk1.0);
        confirm_all(&mut l, &m);
        let disk = l.disk_pool().unwrap();
        assert!(disk.lookup(hashes[1]).is_some());
        assert_eq!(disk.lookup(hashes[0]), None);
        let host = l.host_pool().unwrap();
        assert_eq!(host.lookup(hashes[2]), Some(blk0));
        assert_eq!(host.lookup(hashes[0]), None);
        assert_eq!(host.num_pinned(), 0);
        let s = l.stats();
        assert_eq!((s.offload_deduplicated, s.spill_disk_blocks), (2, 1));
    }

    /// #14 item 1: blocks the disk tier kept from an earlier run, adopted at start, are hits
    /// loaded from disk, and every disk job names each pair's key (its sequence hash) so the
    /// disk tier can refuse a slot that holds another block.
    #[test]
    fn adopted_disk_blocks_are_hits_and_disk_jobs_carry_keys() {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
        cfg.disk = Capacity::Blocks(8);
        let mut l = Leader::new(cfg).unwrap();
        let prompt: Vec<u32> = (0..12).collect();
        let hashes = crate::hash::sequence_hashes(HashSalt(3), &prompt, 4);
        let adopted = [
            (hashes[0], BlockId(5)),
            (hashes[1], BlockId(2)),
            (hashes[0], BlockId(3)),        // a hash already adopted: skipped
            (SequenceHash(77), BlockId(2)), // a block already taken: skipped
            (SequenceHash(78), BlockId(99)), // out of range: skipped
        ];
        assert_eq!(l.adopt_disk_blocks(&adopted), 2);
        let disk = l.disk_pool().unwrap();
        assert_eq!(disk.lookup(hashes[1]), Some(BlockId(2)));
        assert_eq!((disk.num_registered(), disk.num_evictable()), (2, 2));
        let r: RequestId = "r".into();
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
        let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
        l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("r", prompt.clone(), 20)],
                finished: vec![],
            })
            .unwrap();
        let load = &m.loads[0].jobs[0];
        assert_eq!(load.src, Tier::Disk);
        assert_eq!(
            load.pairs,
            vec![BlockPair { src: 5, dst: 20 }, BlockPair { src: 2, dst: 21 }]
        );
        assert_eq!(load.remote_keys, vec![hashes[0].0, hashes[1].0]);
        // Free disk blocks are handed out lowest first after the adoption.
        assert_eq!(
            l.disk.as_mut().unwrap().allocate(2).unwrap(),
            vec![BlockId(0), BlockId(1)]
        );
    }

    /// Spills to G3 and device -> disk stores name their keys.
    #[test]
    fn disk_stores_carry_keys() {
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 0);
        cfg.host = Capacity::Blocks(0);
        cfg.disk = Capacity::Blocks(8);
        let mut l = Leader::new(cfg).unwrap();
        let a: Vec<u32> = (0..8).collect();
        let m = l
            .build_step(&SchedulerStep {
                records: vec![new_record("a", a.clone(), 0)],
                finished: vec![],
            })
            .unwrap();
        let job = &m.stores[0].job;
        assert_eq!(job.dst, Tier::Disk);
        let hashes = crate::hash::sequence_hashes(HashSalt(3), &a, 4);
        assert_eq!(job.remote_keys, vec![hashes[0].0, hashes[1].0]);
        let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
        cfg.disk = Capacity::Blocks(8);
        cfg.disk_policy = DiskPolicy::WriteThrough;
        let mut l = Leader::new(cfg).unwrap();
        let m = two_blocks_confirmed(&mut l);
        let spills: Vec<&TransferJob> = m
            .background
            .iter()
            .filter(|j| j.dst == Tier::Disk)
            .collect();
        assert_eq!(spills.len(), 2);
        for (j, h) in spills.iter().zip(&hashes) {
            assert_eq!(j.remote_keys, vec![h.0]);
        }
    }
}
