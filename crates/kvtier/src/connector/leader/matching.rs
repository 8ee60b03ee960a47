//! Matching: how many of a request's next tokens the tiers can supply.
//!
//! Invariants: matching looks the pools up and changes nothing in them, except that with match
//! holds on it pins the host and disk blocks it offers until the allocation (`holds.rs`); a source is
//! a consecutive run of blocks from the first block the engine does not hold, host before disk
//! before remote, stopping at the first block no tier holds; a remote hash whose load failed
//! is not offered; the whole prompt is never offered (the engine computes at least one token).
use crate::connector::leader::{Leader, RequestKey, SlotEntry};
use crate::connector::messages::remote_key_for_rank;
use crate::connector::slot::{MatchRecord, Slot, SlotState};
use crate::connector::ConnectorError;
use crate::hash::SequenceHash;
use crate::ids::{BlockId, RequestId, Tier};

impl Leader {
    /// Which blocks of `hashes` the remote store holds for every rank (one round trip).
    pub(super) fn remote_contains(&self, hashes: &[SequenceHash]) -> Vec<bool> {
        let Some(remote) = &self.remote else {
            return vec![false; hashes.len()];
        };
        if hashes.is_empty() {
            return Vec::new();
        }
        let w = self.world;
        let keys: Vec<SequenceHash> = hashes
            .iter()
            .flat_map(|&h| (0..w).map(move |r| remote_key_for_rank(h, r, w)))
            .collect();
        match remote.contains(&keys) {
            Ok(found) if found.len() == keys.len() => found
                .chunks(w as usize)
                .map(|c| c.iter().all(|&b| b))
                .collect(),
            Ok(found) => {
                crate::warn_limited!(
                    asked = keys.len(),
                    answered = found.len(),
                    "remote contains answered the wrong count"
                );
                vec![false; hashes.len()]
            }
            Err(e) => {
                crate::warn_limited!(error = %e, "remote contains failed; treating as a miss");
                vec![false; hashes.len()]
            }
        }
    }

    /// Sources for consecutive blocks starting at `hashes[0]`, stopping at the first block no tier holds.
    pub(super) fn find_sources(&self, hashes: &[SequenceHash]) -> Vec<(Tier, BlockId)> {
        let mut out = Vec::new();
        for &h in hashes {
            if let Some(b) = self.tiers.host.as_ref().and_then(|p| p.lookup(h)) {
                out.push((Tier::Host, b));
            } else if let Some(b) = self.tiers.disk.as_ref().and_then(|p| p.lookup(h)) {
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
    /// none). Engines may call it repeatedly: nothing changes in the pools but the request's
    /// match hold (`holds.rs`, when on), which each call replaces. If the tiers would
    /// cover the whole prompt the last block is left out, so the engine computes at least one
    /// token. Matching a running request means the engine preempted it (counted in
    /// `preempted_requests`); matching a finished one is an error.
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
    /// is not `key.cacheable` is never matched nor stored, and one that may not `key.read` is
    /// matched nothing (and stored). A request's identity is fixed by its first match: a
    /// different one later is an error.
    pub fn get_num_new_matched_tokens_for(
        &mut self,
        req: &RequestId,
        all_tokens: &[u32],
        num_computed_tokens: usize,
        key: &RequestKey,
    ) -> Result<usize, ConnectorError> {
        self.match_limited(req, all_tokens, num_computed_tokens, key, None, true)
    }

    /// [`Leader::get_num_new_matched_tokens_for`] with the hit's end (in tokens) at most `limit`
    /// (one KV cache group of several: `groups::match_groups` lowers it until every group
    /// agrees); `count`: whether this call counts in the match statistics (only the agreed one
    /// does). With a sliding window ([`Leader::set_window`]) a hit needs only the blocks inside
    /// the window of its end.
    pub(crate) fn match_limited(
        &mut self,
        req: &RequestId,
        all_tokens: &[u32],
        num_computed_tokens: usize,
        key: &RequestKey,
        limit: Option<usize>,
        count: bool,
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
        if entry.slot.is_running() {
            // Matched again after it ran: the engine preempted it and freed its device blocks
            // without saying so first (vLLM tells the connector no other way before matching).
            entry.slot.preempt()?;
            self.stats.preempted_requests += 1;
            tracing::debug!(request = %req, "matched while running: preempted");
        }
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
        // A new match is a new offer: a cut of the previous one no longer applies.
        entry.cut = None;
        entry.key = Some(key.clone());
        if count {
            self.stats.match_queries += 1;
        }
        let device_blocks = num_computed_tokens / bs;
        let mut external = 0;
        let mut host_only = false;
        let mut host_tier_hit = false;
        let mut offered: Vec<(Tier, BlockId)> = Vec::new();
        if num_computed_tokens.is_multiple_of(bs) && !refused && key.read {
            let hashes = match self.slots.get(req) {
                Some(e) => e.slot.hashes(),
                None => &[],
            };
            let first = device_blocks.min(hashes.len());
            // The whole prompt is never offered (the engine computes at least one token).
            let mut cap = hashes.len();
            if cap * bs >= all_tokens.len() {
                cap = cap.saturating_sub(1);
            }
            if let Some(l) = limit {
                cap = cap.min(l / bs);
            }
            if cap > first {
                let near = |t: Tier| t == Tier::Host || (self.near_remote && t == Tier::Remote);
                let (end, sources) = match self.window {
                    None => {
                        let mut sources = self.find_sources(&hashes[first..cap]);
                        // A near prefix and a short far tail: offer the prefix, in the step.
                        if self.async_loads && self.sync_host_loads && self.recompute_tail > 0 {
                            let lead = sources.iter().take_while(|(t, _)| near(*t)).count();
                            let tail = sources.len() - lead;
                            if lead > 0 && tail > 0 && tail <= self.recompute_tail {
                                sources.truncate(lead);
                            }
                        }
                        (first + sources.len(), sources)
                    }
                    Some(_) => self.window_sources(hashes, first, cap),
                };
                external = (end - first) * bs;
                host_only = sources.iter().all(|(t, _)| near(*t));
                host_tier_hit = sources.iter().all(|(t, _)| *t == Tier::Host);
                offered = sources;
            }
        }
        if count && external > 0 {
            self.hold_match(req, &offered);
        } else {
            self.drop_hold(req);
        }
        let load_sync = !self.async_loads || (self.sync_host_loads && host_only);
        if let Some(e) = self.slots.get_mut(req) {
            e.load_sync = (external > 0).then_some(load_sync);
            e.host_tier_hit = external > 0 && host_tier_hit;
            e.offer = (!load_sync && external > 0).then_some(device_blocks * bs);
            e.slot.record_match(MatchRecord {
                device_tokens: device_blocks * bs,
                external_tokens: external,
            });
        }
        if count {
            self.stats.matched_tokens += external as u64;
        }
        tracing::debug!(request = %req, num_computed_tokens, external, "matched");
        Ok(external)
    }

    /// How `req`'s last match loads when every KV cache group must load it alike
    /// (`groups::match_groups`): `None` with nothing to load; `Some(true)` inside the step from
    /// the host tier alone (a load that fails only with the device); `Some(false)` otherwise.
    pub(crate) fn joint_load_mode(&self, req: &RequestId) -> Option<bool> {
        let e = self.slots.get(req)?;
        e.load_sync.map(|sync| sync && e.host_tier_hit)
    }

    /// Load `req`'s last match asynchronously (another group's part must load so).
    pub(crate) fn load_asynchronously(&mut self, req: &RequestId) {
        if let Some(e) = self.slots.get_mut(req) {
            if e.load_sync == Some(true) {
                e.load_sync = Some(false);
                e.offer = e.slot.last_match().map(|m| m.device_tokens);
            }
        }
    }
}
