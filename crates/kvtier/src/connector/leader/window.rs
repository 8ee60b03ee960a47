//! Sliding-window groups: a leader serving one KV cache group whose layers attend only the last
//! `window` tokens (vLLM's `SlidingWindowSpec` under its hybrid KV cache manager) stores and
//! loads only what that attention reads.
//!
//! Invariants (the block arithmetic is vLLM's `SlidingWindowManager.get_num_skipped_tokens`:
//! a token at position `p` attends tokens `p + 1 - window ..= p`):
//! - a hit ending at block `end` needs blocks `[window_first(end * bs), end)` of this group and
//!   no other: matching claims it only when the tiers hold all of those, and loads only those;
//!   the engine holds no block (its null block, mapped to [`HOLE`]) before them;
//! - a block is stored only in the step that computes it and only if it lies in the window of a
//!   hit ending at one of the step's last two block boundaries (a replay of the prompt ends at
//!   the last or the one before); blocks the window has left are never stored;
//! - once the engine's window passed a block it may free the block and hand it out again (to any
//!   request, even this one): the slot forgets those ids, and while the request has stores in
//!   flight, the step names it in `fence` so the workers wait for them before anything writes.
use std::borrow::Cow;

use crate::connector::leader::Leader;
use crate::connector::slot::{OffloadBlock, HOLE};
use crate::hash::SequenceHash;
use crate::ids::{BlockId, DeviceBlockId, RequestId, Tier};

/// The first block a query at token position `tokens` (the next token to compute) attends with
/// a window of `window` tokens (`None`: full attention, block 0).
pub fn window_first(window: Option<usize>, block_size: usize, tokens: usize) -> usize {
    match window {
        None => 0,
        Some(w) => (tokens + 1).saturating_sub(w) / block_size.max(1),
    }
}

impl Leader {
    /// Serve a sliding-window group: its layers attend the last `window` tokens (vLLM: the
    /// spec's `sliding_window` plus `extra_retained_tokens`), and the engine marks a position
    /// without a block with `null_block` (vLLM's block 0). `None`: full attention (default).
    pub fn set_window(&mut self, window: Option<usize>, null_block: Option<DeviceBlockId>) {
        self.window = window.filter(|w| *w > 0);
        self.null_block = null_block;
    }

    /// The attention window in tokens, if this leader serves a sliding-window group.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// `ids` with the engine's null block as [`HOLE`] (borrowed when it holds none).
    pub(super) fn map_null<'a>(&self, ids: &'a [DeviceBlockId]) -> Cow<'a, [DeviceBlockId]> {
        match self.null_block {
            Some(n) if ids.contains(&n) => Cow::Owned(
                ids.iter()
                    .map(|b| if *b == n { HOLE } else { *b })
                    .collect(),
            ),
            _ => Cow::Borrowed(ids),
        }
    }

    /// The blocks a hit ending at block `end` needs from this group start here.
    pub(super) fn hit_first_block(&self, end: usize) -> usize {
        window_first(self.window, self.block_size, end * self.block_size)
    }

    /// The largest hit end `e` in `first + 1 ..= cap` whose window blocks
    /// `[max(first, hit_first_block(e)), e)` the tiers all hold, and their sources (`first` and
    /// no sources when there is none).
    pub(super) fn window_sources(
        &self,
        hashes: &[SequenceHash],
        first: usize,
        cap: usize,
    ) -> (usize, Vec<(Tier, BlockId)>) {
        let span = &hashes[first..cap];
        let mut found: Vec<Option<(Tier, BlockId)>> = span
            .iter()
            .map(|&h| {
                if let Some(b) = self.tiers.host.as_ref().and_then(|p| p.lookup(h)) {
                    Some((Tier::Host, b))
                } else {
                    self.tiers
                        .disk
                        .as_ref()
                        .and_then(|p| p.lookup(h))
                        .map(|b| (Tier::Disk, b))
                }
            })
            .collect();
        if self.remote.is_some() {
            let missing: Vec<usize> = (0..span.len())
                .filter(|&i| found[i].is_none() && !self.remote_failed.contains(&span[i]))
                .collect();
            let asked: Vec<SequenceHash> = missing.iter().map(|&i| span[i]).collect();
            for (k, there) in self.remote_contains(&asked).into_iter().enumerate() {
                if there {
                    found[missing[k]] = Some((Tier::Remote, BlockId(k as u32)));
                }
            }
        }
        // last_missing[i]: one past the last block of span[..i] no tier holds (0: none).
        let mut last_missing = vec![0usize; span.len() + 1];
        for i in 0..span.len() {
            last_missing[i + 1] = if found[i].is_none() {
                i + 1
            } else {
                last_missing[i]
            };
        }
        for end in (first + 1..=cap).rev() {
            let start = self.hit_first_block(end).max(first);
            if start < end && last_missing[end - first] <= start - first {
                let sources = found[start - first..end - first]
                    .iter()
                    .map(|s| s.unwrap_or((Tier::Host, BlockId(0))))
                    .collect();
                return (end, sources);
            }
        }
        (first, Vec::new())
    }

    /// Of a step's offloads for a request whose computed tokens reach `computed` after it, keep
    /// the blocks inside the window of a hit ending at its last two block boundaries.
    pub(super) fn keep_window_offloads(&self, offloads: &mut Vec<OffloadBlock>, computed: usize) {
        if self.window.is_none() {
            return;
        }
        let last = (computed / self.block_size).saturating_sub(1);
        let from = self.hit_first_block(last);
        offloads.retain(|o| o.index >= from && o.device != HOLE);
    }

    /// The engine may have freed `req`'s blocks before the window of a query at
    /// `num_computed_tokens`: forget their ids, and fence the request while it has stores in
    /// flight (a freed block may be handed out and written in this very step).
    pub(super) fn window_advanced(&mut self, req: &RequestId, num_computed_tokens: usize) {
        let Some(w) = self.window else {
            return;
        };
        let before = window_first(Some(w), self.block_size, num_computed_tokens);
        let Some(e) = self.slots.get_mut(req) else {
            return;
        };
        let forgotten = e.slot.forget_device_ids_before(before);
        if forgotten > 0 && e.stores_in_flight > 0 && !self.outbox.fence.contains(req) {
            self.outbox.fence.push(req.clone());
        }
    }
}
