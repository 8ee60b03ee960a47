//! Stores and steps: each engine step's records feed their slots; the full blocks they produce
//! are reserved in the store tier (G2, else G3) and written by one store job per record; a
//! request finishes once its copies are confirmed.
//!
//! Invariants: a block being written is reserved (pinned, hidden from matching) at dispatch
//! and registered only when every rank confirmed it, a failed one is freed; a hash already held
//! or being written by the store tier is not stored again; invalid records are refused one by
//! one and the work planned for valid ones stays queued; `request_finished` returns true exactly
//! while a store or load of the request is in flight (the engine keeps its device blocks);
//! `request_finished_fenced` answers `Fenced` instead while only stores are, and the blocks
//! are fenced (`fences`) until those stores are confirmed.
use std::collections::BTreeSet;

use crate::connector::leader::books::{JobBooks, RequestJob};
use crate::connector::leader::{DiskPolicy, Leader, SlotEntry};
use crate::connector::messages::{RequestStore, StepMetadata, PROTOCOL_VERSION};
use crate::connector::slot::{OffloadBlock, Slot};
use crate::connector::step::{SchedulerStep, StepRecord};
use crate::connector::ConnectorError;
use crate::hash::SequenceHash;
use crate::ids::{BlockId, DeviceBlockId, JobId, RequestId, Tier};
use crate::pool::{Priority, Reservation, Reserved};
use crate::transfer::{DiskBlock, TransferJob};

/// When the engine may reuse a finished request's device blocks (`Leader::request_finished`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "reusing device blocks a copy still reads or writes corrupts KV"]
pub enum BlockReuse {
    /// No copy reads or writes them any more: the engine may reuse them now.
    Now,
    /// A store or load of the request is in flight on some rank: keep them until a worker
    /// reports the request saved (`FinishedReport::saved`).
    AfterSaved,
    /// Only stores still read them (`Leader::request_finished_fenced`): the engine may reuse
    /// them now, provided a step that hands one out lets the workers wait for the request
    /// (`StepMetadata::fence`) before anything writes the block. The workers never report
    /// the request saved.
    Fenced,
}

impl BlockReuse {
    /// Whether the engine must wait for the request to be reported saved (the engines' boolean;
    /// false for [`BlockReuse::Fenced`]).
    pub fn must_wait(self) -> bool {
        self == BlockReuse::AfterSaved
    }
}

/// A device -> remote store of a node-only engine: `blocks` pairs, no pool block behind them.
#[derive(Debug)]
pub(super) struct RemoteStoreBooks {
    request: RequestId,
    blocks: usize,
}

/// What a completed store does to the books: device -> `tier`.
#[derive(Debug)]
pub(super) struct StoreBooks {
    request: RequestId,
    tier: Tier,
    /// The writer's reservation per pair (its block is the pair's destination); the books own
    /// it until the store completes, which confirms or aborts it.
    blocks: Vec<Reserved>,
    /// Retention priority per block (the engine's, else the configured default).
    priorities: Vec<Priority>,
}

/// The store job `id` of `pairs` (device block, reserved pool block, hash) into the pool of
/// `tier`: disk slots are bound to their hash, host blocks are named by id.
fn pool_store_job(
    id: JobId,
    tier: Tier,
    pairs: &[(DeviceBlockId, BlockId, SequenceHash)],
) -> TransferJob {
    let pairs = pairs.iter().copied();
    match tier {
        Tier::Disk => {
            TransferJob::from_pairs(id, pairs.map(|(d, slot, key)| (d, DiskBlock { slot, key })))
        }
        // `store_target` is the host or the disk pool.
        _ => TransferJob::from_pairs(id, pairs.map(|(d, b, _)| (d, b))),
    }
}

impl Leader {
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
        self.expire_holds();
        self.stats.steps += 1;
        let mut meta = std::mem::take(&mut self.outbox);
        self.fences
            .collect(&step.records, self.block_size, &mut meta);
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
        // A sliding-window group: blocks the window left may be free; null blocks are holes.
        let owned;
        let rec = if self.window.is_some() {
            self.window_advanced(req, rec.num_computed_tokens);
            match self.map_null(&rec.new_block_ids) {
                std::borrow::Cow::Borrowed(_) => rec,
                std::borrow::Cow::Owned(ids) => {
                    owned = StepRecord {
                        new_block_ids: ids,
                        ..rec.clone()
                    };
                    &owned
                }
            }
        } else {
            rec
        };
        let mut offloads = std::mem::take(&mut self.scratch.offloads);
        offloads.clear();
        let applied = self.apply_to_slot(pos, rec, &mut offloads);
        if applied.is_ok() && self.window.is_some() {
            let computed = self.slots.get(req).map_or(0, |e| e.slot.position());
            self.keep_window_offloads(&mut offloads, computed);
        }
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
        if !self.stores {
            return;
        }
        if self.tiers.host.is_none() && self.remote_put() {
            self.dispatch_remote_store(req, offloads);
        }
        let Some((tier, pool)) = self.tiers.store_target() else {
            return;
        };
        let sc = &mut self.scratch;
        sc.hashes.clear();
        sc.hashes.extend(offloads.iter().map(|b| b.hash));
        sc.reservations.clear();
        pool.reserve(&sc.hashes, &mut sc.reservations);
        sc.seen_again.clear();
        // (device block, reserved block, hash) per pair.
        let mut pairs: Vec<(DeviceBlockId, BlockId, SequenceHash)> =
            Vec::with_capacity(offloads.len());
        let mut books: Vec<Reserved> = Vec::with_capacity(offloads.len());
        let mut priorities: Vec<Priority> = Vec::with_capacity(offloads.len());
        let mut dropped = 0u64;
        for (ob, r) in offloads.iter().zip(sc.reservations.drain(..)) {
            match r {
                Reservation::Allocated(res) => {
                    pairs.push((ob.device, res.block(), ob.hash));
                    books.push(res);
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
            let id = self.track(JobBooks::Store(StoreBooks {
                request: req.clone(),
                tier,
                blocks: books,
                priorities,
            }));
            self.queue_store(req, pool_store_job(id, tier, &pairs));
        }
        if !self.scratch.seen_again.is_empty() {
            let seen = std::mem::take(&mut self.scratch.seen_again);
            self.spill_seen_again(&seen);
            self.scratch.seen_again = seen;
        }
    }

    /// The engine finished (or aborted) the request. While any of its stores or loads is not
    /// yet confirmed by every rank the answer is [`BlockReuse::AfterSaved`]: the engine must keep
    /// its device blocks until the workers report the request as saved.
    pub fn request_finished(&mut self, req: &RequestId) -> Result<BlockReuse, ConnectorError> {
        self.finish(req, false)
    }

    /// Like [`Leader::request_finished`] for engines that report every block they hand out and
    /// let the workers act before anything writes one (vLLM: the step's records and
    /// `handle_preemptions`): while only stores still read the request's blocks the answer is
    /// [`BlockReuse::Fenced`], and each later step that hands one of them to a request carries
    /// this request in `StepMetadata::fence` until its stores are confirmed. A request with a
    /// load in flight is still [`BlockReuse::AfterSaved`] (a cancelled load may land late).
    pub fn request_finished_fenced(
        &mut self,
        req: &RequestId,
    ) -> Result<BlockReuse, ConnectorError> {
        self.finish(req, true)
    }

    fn finish(&mut self, req: &RequestId, fence: bool) -> Result<BlockReuse, ConnectorError> {
        self.poll_reports();
        let Some(e) = self.slots.get_mut(req) else {
            return Err(ConnectorError::invalid(
                req,
                "request_id",
                "unknown request",
            ));
        };
        e.slot.finish();
        self.drop_hold(req);
        // Loads planned for it and not yet handed to a worker never run: nothing was copied.
        self.withdraw_unsent_loads(req);
        // Device blocks stay with the request while any of its copies may still land in them
        // (a load cancelled in flight must not write into blocks given to another request).
        let (stores, loads) = self
            .slots
            .get(req)
            .map_or((0, 0), |e| (e.stores_in_flight, e.loads_in_flight));
        let reuse = match (stores, loads) {
            (0, 0) => BlockReuse::Now,
            (_, 0) if fence => BlockReuse::Fenced,
            _ => BlockReuse::AfterSaved,
        };
        match reuse {
            BlockReuse::AfterSaved => self.outbox.saving.push(req.clone()),
            BlockReuse::Fenced => {
                if let Some(e) = self.slots.get(req) {
                    self.fences.add(req, e.slot.device_table());
                }
            }
            BlockReuse::Now => {}
        }
        self.maybe_drop_slot(req);
        Ok(reuse)
    }

    /// Device blocks given back by [`Leader::request_finished_fenced`] whose stores are not yet
    /// confirmed.
    pub fn fenced_blocks(&self) -> usize {
        self.fences.len()
    }

    /// The engine preempted the request and freed its device blocks; it may be matched again.
    pub fn request_preempted(&mut self, req: &RequestId) -> Result<(), ConnectorError> {
        self.drop_hold(req);
        match self.slots.get_mut(req) {
            Some(e) => {
                if e.slot.is_running() {
                    self.stats.preempted_requests += 1;
                }
                e.cut = None;
                e.offer = None;
                e.slot.preempt()
            }
            None => Err(ConnectorError::invalid(
                req,
                "request_id",
                "unknown request",
            )),
        }
    }

    /// The engine names `req` among the step's preempted requests (vLLM's
    /// `preempted_req_ids`): it is preempted if it ran since it was last matched; a request
    /// kvtier does not know, or one already found preempted by a new match
    /// ([`Leader::get_num_new_matched_tokens_for`]), is left alone. Returns whether it was
    /// preempted now.
    pub fn request_preempted_if_running(
        &mut self,
        req: &RequestId,
    ) -> Result<bool, ConnectorError> {
        match self.slots.get(req) {
            Some(e) if e.slot.is_running() => self.request_preempted(req).map(|()| true),
            _ => Ok(false),
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

    /// With no host tier (node-only: the node's arena is this engine's G2): one device ->
    /// remote store job for `offloads`, straight from the engine's blocks. The remote store
    /// deduplicates (a block already there is not written again) and makes a block visible only
    /// once written; the request keeps its device blocks until every rank reported the job.
    fn dispatch_remote_store(&mut self, req: &RequestId, offloads: &[OffloadBlock]) {
        if offloads.is_empty() {
            return;
        }
        for ob in offloads {
            // A fresh value replaces whatever failed to load under this hash.
            self.remote_failed.remove(&ob.hash);
        }
        let n = offloads.len();
        self.stats.offload_blocks += n as u64;
        self.stats.remote_put_blocks += n as u64;
        let id = self.track(JobBooks::StoreRemote(RemoteStoreBooks {
            request: req.clone(),
            blocks: n,
        }));
        let job = TransferJob::from_pairs(id, offloads.iter().map(|ob| (ob.device, ob.hash)));
        self.queue_store(req, job);
    }

    /// Hand a device -> pool or remote store job of `req` to the workers (the next metadata) and
    /// count it in flight for the request (its device blocks stay held until every rank
    /// reported it).
    fn queue_store(&mut self, req: &RequestId, job: TransferJob) {
        if let Some(e) = self.slots.get_mut(req) {
            e.stores_in_flight += 1;
        }
        self.outbox.stores.push(RequestStore {
            request: req.clone(),
            job,
        });
    }

    pub(super) fn complete_remote_store(&mut self, b: RemoteStoreBooks, failed: &BTreeSet<usize>) {
        let RemoteStoreBooks { request, blocks } = b;
        let bad = failed.iter().filter(|&&i| i < blocks).count();
        self.stats.remote_put_failed += bad as u64;
        self.stats.remote_put_confirmed += (blocks - bad) as u64;
        self.stats.offload_failed += bad as u64;
        self.stats.offload_confirmed += (blocks - bad) as u64;
        self.job_done(&request, RequestJob::Store);
    }

    /// Every rank reported the store `b`: confirm the written blocks (then plan their spills),
    /// free the failed ones.
    pub(super) fn complete_store(&mut self, b: StoreBooks, failed: &BTreeSet<usize>) {
        let StoreBooks {
            request,
            tier,
            blocks,
            priorities,
        } = b;
        // Spills and remote puts follow a confirmed G2 store only when configured.
        let spills = tier == Tier::Host
            && ((self.tiers.disk.is_some() && self.disk_policy != DiskPolicy::Never)
                || self.remote_put());
        for (i, res) in blocks.into_iter().enumerate() {
            let priority = priorities.get(i).copied().unwrap_or(self.priority);
            if failed.contains(&i) {
                // Aborting the unconfirmed block frees it and drops its reservation.
                self.stats.offload_failed += 1;
                self.tiers.abort(res);
                continue;
            }
            let Some(pool) = self.tiers.get_mut(res.tier()) else {
                continue;
            };
            if !spills {
                // The writer's pin goes in the same call (one pass).
                match pool.confirm_and_release(res, priority) {
                    Ok(_) => self.stats.offload_confirmed += 1,
                    Err(e) => tracing::error!(error = %e, "confirming a stored block failed"),
                }
                continue;
            }
            match pool.confirm(res, priority) {
                Ok((pin, hash)) => {
                    self.stats.offload_confirmed += 1;
                    self.plan_spills(pin.block(), hash, true);
                    self.tiers.release(pin);
                }
                Err(e) => tracing::error!(error = %e, "confirming a stored block failed"),
            }
        }
        self.job_done(&request, RequestJob::Store);
    }
}
