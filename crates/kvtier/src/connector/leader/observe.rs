//! What the leader tells the outside: counters and gauges ([`LeaderStats`], pulled) and the
//! pools' stored/removed events ([`KvEvent`], for KV-aware routers).
//!
//! Invariant: events are bounded. At most `MAX_EVENTS` wait in the leader's queue (the oldest
//! beyond that are dropped and counted in `LeaderStats::events_dropped`); each event is handed
//! out once, in order within its tier.
use crate::connector::leader::Leader;
use crate::pool::{BlockPool, PoolEvent};

/// Pool events the leader keeps for `take_events` before dropping the oldest.
pub const MAX_EVENTS: usize = 1 << 16;

/// A change in what the tiers hold (for KV-aware routers).
pub type KvEvent = PoolEvent;

/// Counters and gauges of the leader (pulled).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaderStats {
    /// Steps built.
    pub steps: u64,
    /// Requests with a slot now.
    pub active_requests: usize,
    /// Transfer jobs dispatched and not yet reported by every rank.
    pub jobs_in_flight: usize,
    /// Matches asked for (`get_num_new_matched_tokens`).
    pub match_queries: u64,
    /// Tokens those matches offered.
    pub matched_tokens: u64,
    /// Full blocks handed to the offload tier / confirmed / failed.
    pub offload_blocks: u64,
    /// Of those, written by every rank and registered.
    pub offload_confirmed: u64,
    /// Of those, failed on some rank.
    pub offload_failed: u64,
    /// Offload candidates skipped because the tier already held (or was writing) their hash.
    pub offload_deduplicated: u64,
    /// Offload candidates dropped because the tier had no free or evictable block.
    pub offload_dropped: u64,
    /// Blocks loaded from the host tier (counted when the load completed, failed pairs left out).
    pub onboard_host_blocks: u64,
    /// Blocks loaded from the disk tier (completed, failed pairs left out).
    pub onboard_disk_blocks: u64,
    /// Blocks loaded from the remote tier (completed, failed pairs left out).
    pub onboard_remote_blocks: u64,
    /// Bytes loaded from the host tier into the engine: the loaded blocks (as
    /// `onboard_host_blocks`) times one kvtier block's bytes over every rank (the layout's
    /// `bytes_per_block`; a block holds the layers the leader was configured for, so with one
    /// leader per KV cache group only that group's). 0 without a layout.
    pub onboard_host_bytes: u64,
    /// Bytes loaded from the disk tier into the engine (as `onboard_host_bytes`).
    pub onboard_disk_bytes: u64,
    /// Bytes loaded from the remote tier into the engine (as `onboard_host_bytes`).
    pub onboard_remote_bytes: u64,
    /// Blocks whose load failed (on any rank) or whose source had vanished.
    pub onboard_failed: u64,
    /// Host -> disk copies dispatched / written and registered in G3 / failed.
    pub spill_disk_blocks: u64,
    /// Of those, written and registered in G3.
    pub spill_disk_confirmed: u64,
    /// Of those, failed.
    pub spill_disk_failed: u64,
    /// Host -> remote puts dispatched / written by every rank / failed.
    pub remote_put_blocks: u64,
    /// Of those, written by every rank.
    pub remote_put_confirmed: u64,
    /// Of those, failed.
    pub remote_put_failed: u64,
    /// Pool events dropped because nobody took them (`take_events`) in time.
    pub events_dropped: u64,
    /// Requests matched again after an allocation but before they ever ran (the engine freed
    /// their blocks to start them over, e.g. after a failed asynchronous load): recomputed.
    pub load_restarts: u64,
    /// Requests the engine preempted after they ran (reported, or inferred from a new match of
    /// a running request); each is counted once per preemption.
    pub preempted_requests: u64,
    /// Requests the engine marked as not cacheable (kvtier cannot key their KV): never matched,
    /// never stored.
    pub uncacheable_requests: u64,
    /// Blocks of the host tier.
    pub host_capacity: usize,
    /// Of those, free or evictable.
    pub host_free: usize,
    /// Of those, holding a registered hash.
    pub host_registered: usize,
    /// Blocks of the disk tier.
    pub disk_capacity: usize,
    /// Of those, free or evictable.
    pub disk_free: usize,
    /// Of those, holding a registered hash.
    pub disk_registered: usize,
    /// Host blocks pinned now (a load reads them or a store writes them): a count that stays
    /// above 0 on an idle engine is a leak.
    pub host_pinned: usize,
    /// Disk blocks pinned now (see `host_pinned`).
    pub disk_pinned: usize,
    /// Device blocks the engine got back while stores still read them (fenced reuse), now.
    pub fenced_device_blocks: usize,
    /// The remote store's breaker and deadline counters (the leader's store: its lookups, and
    /// the ranks' loads and stores where they share it in one process).
    pub remote: crate::transfer::RemoteHealth,
}

impl Leader {
    /// A snapshot of the counters, with the gauges (requests, jobs, pool occupancy) read now.
    pub fn stats(&self) -> LeaderStats {
        let mut s = self.stats.clone();
        s.active_requests = self.slots.len();
        s.jobs_in_flight = self.jobs.len();
        if let Some(h) = &self.tiers.host {
            s.host_capacity = h.capacity();
            s.host_free = h.num_free();
            s.host_registered = h.num_registered();
            s.host_pinned = h.num_pinned();
        }
        if let Some(d) = &self.tiers.disk {
            s.disk_capacity = d.capacity();
            s.disk_free = d.num_free();
            s.disk_registered = d.num_registered();
            s.disk_pinned = d.num_pinned();
        }
        s.fenced_device_blocks = self.fences.len();
        if let Some(r) = &self.remote {
            s.remote = r.health();
        }
        s
    }

    /// Bound the events nobody has taken yet: once a pool holds more than `MAX_EVENTS`, they
    /// move into the leader's queue, which keeps the newest `MAX_EVENTS`. Below that they stay
    /// in the pools, and `take_events` hands the pools' buffers over without copying them.
    pub(super) fn bound_events(&mut self) {
        let over = |p: &Option<BlockPool>| p.as_ref().is_some_and(|p| p.num_events() > MAX_EVENTS);
        if over(&self.tiers.host) || over(&self.tiers.disk) || !self.events.is_empty() {
            self.collect_events();
        }
    }

    /// Move every pool's events into the leader's queue, dropping the oldest beyond `MAX_EVENTS`.
    fn collect_events(&mut self) {
        for pool in self.tiers.iter_mut() {
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
        if self.events.is_empty() && queued(&self.tiers.disk) == 0 {
            if let Some(h) = self.tiers.host.as_mut() {
                return h.take_events(); // the common case: one pool's buffer, moved
            }
        }
        self.collect_events();
        Vec::from(std::mem::take(&mut self.events))
    }
}
