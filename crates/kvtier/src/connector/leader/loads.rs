//! Loads: allocation (`update_state_after_alloc`) pins the matched sources and plans one load
//! job per source tier; a completed load releases them, and a failed one is never offered again.
//!
//! Invariants: a pool block a load reads is pinned from planning until every rank reported the
//! load (or the load is withdrawn unsent), its `Pinned` token held by the load's books; a host
//! or disk block whose load failed is invalidated, a remote hash whose load failed is skipped by
//! matching (at most `MAX_REMOTE_FAILED` remembered); a block whose source vanished since
//! matching (or cannot be pinned) is reported to the engine as a failed load
//! (`failed_devices`), never as loaded.
use crate::connector::leader::books::{JobBooks, RequestJob};
use crate::connector::leader::{Leader, SlotEntry};
use crate::connector::messages::RequestLoad;
use crate::connector::slot::{OnboardBlock, Slot, HOLE};
use crate::connector::ConnectorError;
use crate::hash::SequenceHash;
use crate::ids::{BlockId, DeviceBlockId, JobId, RequestId, Tier};
use crate::pool::Pinned;
use crate::transfer::{DiskBlock, TransferJob};
use std::collections::BTreeSet;

/// Remote hashes whose load failed that matching skips; beyond this many the memory starts over.
pub const MAX_REMOTE_FAILED: usize = 1 << 16;

/// What a completed load does to the books: `src` -> device.
#[derive(Debug)]
pub(super) struct LoadBooks {
    request: RequestId,
    src: Tier,
    /// The pins of the pool blocks read, one per pair (empty for remote); the books own them
    /// until the load completes or is withdrawn.
    pinned: Vec<Pinned>,
    /// Destination device block per pair.
    devices: Vec<DeviceBlockId>,
    /// Remote loads: the hash each pair reads (empty for host and disk).
    remote_hashes: Vec<SequenceHash>,
}

/// What [`Leader::allocate`] did with an engine's allocation.
#[derive(Debug, Default)]
pub struct Allocation {
    /// Why the leader refused the allocation (`None`: accepted).
    pub refused: Option<ConnectorError>,
    /// Device blocks the engine was promised external tokens in that kvtier will not load (the
    /// allocation was refused): the engine must treat them as failed loads and recompute them.
    pub failed_devices: Vec<DeviceBlockId>,
}

/// The device blocks of `block_ids` that `num_external_tokens` promised, from block
/// `first_block` on (clipped to the table): what a refused allocation fails.
pub fn promised_blocks(
    block_ids: &[DeviceBlockId],
    first_block: usize,
    num_external_tokens: usize,
    block_size: usize,
) -> &[DeviceBlockId] {
    let count = num_external_tokens / block_size.max(1);
    let start = first_block.min(block_ids.len());
    let end = first_block.saturating_add(count).min(block_ids.len());
    &block_ids[start..end]
}

/// The tiers a request's hits come from, in the order they are offered.
const HIT_TIERS: [Tier; 3] = [Tier::Host, Tier::Disk, Tier::Remote];

/// One load job being planned for a source tier.
struct TierLoad {
    tier: Tier,
    /// The source block (its pool block; unused for remote) and its hash, per pair.
    sources: Vec<(BlockId, SequenceHash)>,
    /// The device block each pair fills.
    devices: Vec<DeviceBlockId>,
    /// The pins of the pool blocks it reads, one per pair (host and disk).
    pinned: Vec<Pinned>,
}

impl TierLoad {
    /// The load job `id`: the source side in the tier's medium (host blocks, disk slots bound
    /// to their hash, remote hashes), the device blocks as destination.
    fn job(&self, id: JobId) -> TransferJob {
        let pairs = self
            .sources
            .iter()
            .copied()
            .zip(self.devices.iter().copied());
        match self.tier {
            Tier::Disk => TransferJob::from_pairs(
                id,
                pairs.map(|((slot, key), d)| (DiskBlock { slot, key }, d)),
            ),
            Tier::Remote => TransferJob::from_pairs(id, pairs.map(|((_, h), d)| (h, d))),
            // `HIT_TIERS`: the host pool.
            Tier::Host | Tier::Device => {
                TransferJob::from_pairs(id, pairs.map(|((b, _), d)| (b, d)))
            }
        }
    }
}

impl Leader {
    /// The engine allocated `block_ids` (the request's whole table; ids already known are
    /// recognised) and accepted `num_external_tokens` (`None` = what the last match found).
    /// Pins the sources and plans the loads for the next metadata, then gives the match's hold
    /// back (`holds.rs`). A block whose source has vanished since matching is reported as a load
    /// error by every worker.
    pub fn update_state_after_alloc(
        &mut self,
        req: &RequestId,
        block_ids: &[DeviceBlockId],
        num_external_tokens: Option<usize>,
    ) -> Result<(), ConnectorError> {
        let planned = self.allocate_and_plan(req, block_ids, num_external_tokens);
        self.drop_hold(req);
        planned
    }

    fn allocate_and_plan(
        &mut self,
        req: &RequestId,
        block_ids: &[DeviceBlockId],
        num_external_tokens: Option<usize>,
    ) -> Result<(), ConnectorError> {
        // No report is applied here: between matching and allocation the pools must not change,
        // so the promised blocks are still there.
        self.check_device_ids(req, "block_ids", block_ids)?;
        let external = num_external_tokens.unwrap_or(0);
        if external > 0 {
            if let Some(e) = self.slots.get_mut(req) {
                e.hit_blocks = [0; 3];
            }
        }
        // A sliding-window group: the engine's null blocks (before the window) are holes.
        let null_free = self.map_null(block_ids).into_owned();
        let mapped = null_free.as_slice();
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
            e.slot.allocate(mapped, num_external_tokens)
        };
        let mut onboard = match allocated {
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
        // A reuse of the prefix is a sighting for the disk filter whichever tier serves it: the
        // engine's own cache (its hit) or kvtier (the blocks it loads). Without this, a prefix the
        // engine keeps hitting in G1 is never "seen twice" in G2 and never reaches the disk.
        let reused = e
            .slot
            .last_match()
            .map_or(0, |m| m.device_tokens / self.block_size)
            + onboard.len();
        if reused > 0 {
            self.reuse_seen(req, reused);
        }
        if self.window.is_some() {
            // Only the blocks inside the window of the hit's end are loaded.
            let end = onboard.last().map_or(0, |b| b.index + 1);
            let from = self.hit_first_block(end);
            onboard.retain(|b| b.index >= from && b.device != HOLE);
        }
        if onboard.is_empty() {
            return Ok(());
        }
        self.plan_loads(req, &onboard);
        Ok(())
    }

    /// [`Leader::update_state_after_alloc`] for engines that must hear which promised blocks to
    /// fail when the allocation is refused: the `num_external_tokens` the engine accepted,
    /// starting at the first block its last match left to kvtier, are returned as failed
    /// (never loaded, so recomputed), and the request is offered no external tokens again.
    pub fn allocate(
        &mut self,
        req: &RequestId,
        block_ids: &[DeviceBlockId],
        num_external_tokens: usize,
    ) -> Allocation {
        let first = self
            .slots
            .get(req)
            .and_then(|e| e.slot.last_match())
            .map_or(0, |m| m.device_tokens / self.block_size);
        match self.update_state_after_alloc(req, block_ids, Some(num_external_tokens)) {
            Ok(()) => Allocation::default(),
            Err(e) => Allocation {
                refused: Some(e),
                // Never the engine's null block (a sliding-window group's positions before the
                // window): it holds nothing to recompute.
                failed_devices: promised_blocks(
                    block_ids,
                    first,
                    num_external_tokens,
                    self.block_size,
                )
                .iter()
                .copied()
                .filter(|b| Some(*b) != self.null_block)
                .collect(),
            },
        }
    }

    /// Where the `num_external_tokens` the engine accepted for `req` come from, in tokens per
    /// tier (host, then disk, then remote; tiers supplying none left out), as its last
    /// allocation planned them; asked once per allocation (the answer is taken).
    pub fn take_hit_sources(
        &mut self,
        req: &RequestId,
        num_external_tokens: usize,
    ) -> Vec<(Tier, usize)> {
        let bs = self.block_size;
        let Some(e) = self.slots.get_mut(req) else {
            return Vec::new();
        };
        let blocks = std::mem::take(&mut e.hit_blocks);
        let mut left = num_external_tokens;
        let mut out = Vec::new();
        for (tier, n) in HIT_TIERS.into_iter().zip(blocks) {
            let tokens = (n * bs).min(left);
            if tokens > 0 {
                out.push((tier, tokens));
                left -= tokens;
            }
        }
        out
    }

    /// Pin the sources of `onboard` and queue their load jobs (one per source tier) in the outbox.
    fn plan_loads(&mut self, req: &RequestId, onboard: &[OnboardBlock]) {
        let hashes: Vec<SequenceHash> = onboard.iter().map(|b| b.hash).collect();
        let sources = self.find_sources(&hashes);
        let mut per_tier: Vec<TierLoad> = Vec::new();
        // Blocks with a source, pinned where it is a pool: a block that cannot be pinned
        // (unreachable: it was just found registered) ends the run, as a vanished source does.
        let mut planned = 0;
        for (ob, &(tier, block)) in onboard.iter().zip(&sources) {
            let pin = match tier {
                Tier::Remote => None,
                _ => match self.tiers.get_mut(tier).map(|p| p.pin(block)) {
                    Some(Ok(pin)) => Some(pin),
                    Some(Err(e)) => {
                        tracing::error!(error = %e, "pinning a just-found block failed");
                        break;
                    }
                    None => break,
                },
            };
            planned += 1;
            let k = match per_tier.iter().position(|t| t.tier == tier) {
                Some(k) => k,
                None => {
                    per_tier.push(TierLoad {
                        tier,
                        sources: Vec::new(),
                        devices: Vec::new(),
                        pinned: Vec::new(),
                    });
                    per_tier.len() - 1
                }
            };
            let entry = &mut per_tier[k];
            // The disk tier checks the slot holds this hash's block; the remote store reads it.
            entry.sources.push((block, ob.hash));
            entry.devices.push(ob.device);
            entry.pinned.extend(pin);
        }
        let failed_devices: Vec<DeviceBlockId> =
            onboard[planned..].iter().map(|b| b.device).collect();
        self.stats.onboard_failed += failed_devices.len() as u64;
        if let (Some(first), Some(e)) = (onboard.get(planned), self.slots.get_mut(req)) {
            e.slot.load_failed(first.index);
        }
        if !failed_devices.is_empty() {
            tracing::warn!(request = %req, blocks = failed_devices.len(), "matched blocks vanished before allocation; reporting load errors");
        }
        if let Some(e) = self.slots.get_mut(req) {
            for t in &per_tier {
                if let Some(k) = HIT_TIERS.iter().position(|&h| h == t.tier) {
                    e.hit_blocks[k] = t.devices.len();
                }
            }
        }
        let mut jobs = Vec::new();
        for mut load in per_tier {
            let remote_hashes = if load.tier == Tier::Remote {
                load.sources.iter().map(|&(_, h)| h).collect()
            } else {
                Vec::new()
            };
            let id = self.track(JobBooks::Load(LoadBooks {
                request: req.clone(),
                src: load.tier,
                pinned: std::mem::take(&mut load.pinned),
                devices: load.devices.clone(),
                remote_hashes,
            }));
            jobs.push(load.job(id));
        }
        let mut sync = !self.async_loads;
        if let Some(e) = self.slots.get_mut(req) {
            e.loads_in_flight += jobs.len();
            // As the engine was told at the match (a host hit whose block moved to disk since
            // loads as the engine scheduled it: synchronously, a failure reported in the step).
            sync = e.load_sync.unwrap_or(sync);
        }
        if !sync {
            self.open_verdict(req, jobs.len(), onboard.get(planned).map(|b| b.index));
        }
        self.outbox.loads.push(RequestLoad {
            request: req.clone(),
            sync,
            jobs,
            failed_devices,
        });
    }

    /// Every rank reported the load `b`: mark the request's first failed block, invalidate the
    /// sources that could not be read, release the pins.
    pub(super) fn complete_load(&mut self, b: LoadBooks, failed: &BTreeSet<usize>) {
        let LoadBooks {
            request,
            src,
            pinned,
            devices,
            remote_hashes,
        } = b;
        let mut first_failed = None;
        let mut load_start = None;
        if let Some(e) = self.slots.get_mut(&request) {
            first_failed = failed
                .iter()
                .filter_map(|&k| devices.get(k))
                .filter_map(|d| e.slot.index_of(*d))
                .min();
            if let Some(i) = first_failed {
                e.slot.load_failed(i);
            }
            load_start = devices.iter().filter_map(|d| e.slot.index_of(*d)).min();
        }
        if !failed.is_empty() && first_failed.is_none() {
            // A failed block outside the request's table (unreachable): recompute all this job
            // loaded, never blocks before it (the engine's own, possibly shared with others).
            first_failed = Some(load_start.unwrap_or(0));
        }
        self.load_job_verdict(&request, first_failed);
        for (i, pin) in pinned.into_iter().enumerate() {
            if failed.contains(&i) {
                // Its bytes could not be read: never offer it again.
                if let Some(p) = self.tiers.get_mut(src) {
                    let _ = p.invalidate(pin.block());
                }
            }
            self.tiers.release(pin);
        }
        for &i in failed {
            if let Some(&h) = remote_hashes.get(i) {
                if self.remote_failed.len() >= MAX_REMOTE_FAILED {
                    self.remote_failed.clear();
                }
                self.remote_failed.insert(h);
            }
        }
        self.stats.onboard_failed += failed.len() as u64;
        // Only blocks that every rank loaded count as hits (#28: a failed load was counted in
        // kvtier_hit_tokens_total, which is derived from these).
        let loaded = devices.len().saturating_sub(failed.len()) as u64;
        let s = &mut self.stats;
        let (blocks, bytes) = match src {
            Tier::Host => (&mut s.onboard_host_blocks, &mut s.onboard_host_bytes),
            Tier::Disk => (&mut s.onboard_disk_blocks, &mut s.onboard_disk_bytes),
            _ => (&mut s.onboard_remote_blocks, &mut s.onboard_remote_bytes),
        };
        *blocks += loaded;
        *bytes += loaded * self.block_bytes;
        self.job_done(&request, RequestJob::Load);
    }

    /// Drops `req`'s loads still waiting in the outbox and releases their sources as if they had
    /// succeeded (no block is invalidated: nothing was read).
    pub(super) fn withdraw_unsent_loads(&mut self, req: &RequestId) {
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
}
