//! Match holds: an engine that allocates a matched request scheduling passes later
//! (TensorRT-LLM's KVCacheManagerV2 matches and allocates apart) would otherwise find a host or
//! disk block its match offered evicted by the stores planned in between, and the load fail where
//! the match promised it: a failed load the engine recovers only by recomputing, which a
//! sliding-window layer group cannot do (its pages behind the window are gone). With holds on
//! ([`Leader::enable_match_holds`]) a match pins the host and disk blocks it offers until the
//! request's allocation has pinned them for its own load.
//!
//! Invariants: a request holds at most the pins of its last match (a new match gives the old
//! ones back first); every hold is given back exactly once: after the allocation planned its
//! loads, or at the request's next match, preemption or finish, or, where holds expire, after
//! [`MAX_HOLD_STEPS`] engine steps (a request the engine dropped without a word holds nothing for
//! long); a model with a sliding-window layer group keeps its holds until one of the others
//! (no expiry: a failed load there could only be recomputed into blocks without a page); a
//! remote source is never held (the store keeps it); with holds off nothing here pins.
use std::collections::HashMap;

use crate::connector::leader::Leader;
use crate::ids::{BlockId, RequestId, Tier};
use crate::pool::Pinned;

/// Engine steps after which an unallocated match's hold is given back: long enough for a request
/// that waits for device capacity between its match and its allocation (an executor iteration is
/// milliseconds to tens of them: 1,024 of them are seconds), short enough that a request the
/// engine dropped without a word pins nothing for long. Past it the match's load may fail, as
/// without holds.
pub(super) const MAX_HOLD_STEPS: u64 = 1024;

/// The pins of one request's last match and the step it was taken in.
#[derive(Debug)]
struct Held {
    pins: Vec<Pinned>,
    step: u64,
}

/// Every request's held match (see the module documentation).
#[derive(Debug)]
pub(super) struct Holds {
    by_request: HashMap<RequestId, Held>,
    /// Whether holds are given back after [`MAX_HOLD_STEPS`] steps.
    expire: bool,
}

impl Holds {
    /// Pins held now, over every request.
    pub(super) fn pins(&self) -> usize {
        self.by_request.values().map(|h| h.pins.len()).sum()
    }
}

impl Leader {
    /// Hold the host and disk blocks each match offers until the request's allocation (see the
    /// module documentation). For engines that may allocate a matched request passes later.
    /// `expire`: give a hold back after `MAX_HOLD_STEPS` (1,024) steps without an allocation (a full
    /// attention model, whose failed load is recomputed); `false` for a model with sliding-window
    /// layer groups, every group's leader alike (a failed load in any group rewinds the request,
    /// and a window group cannot recompute behind its window).
    pub fn enable_match_holds(&mut self, expire: bool) {
        match self.holds.as_mut() {
            Some(h) => h.expire = expire,
            None => {
                self.holds = Some(Holds {
                    by_request: HashMap::new(),
                    expire,
                })
            }
        }
    }

    /// Blocks held by matches not yet allocated (0 with holds off).
    pub fn held_blocks(&self) -> usize {
        self.holds.as_ref().map_or(0, Holds::pins)
    }

    /// Replace `req`'s hold by pins on `sources` (its new match's host and disk blocks).
    pub(super) fn hold_match(&mut self, req: &RequestId, sources: &[(Tier, BlockId)]) {
        if self.holds.is_none() {
            return;
        }
        self.drop_hold(req);
        let mut pins = Vec::new();
        for &(tier, block) in sources {
            if let Some(Ok(pin)) = self.tiers.get_mut(tier).map(|p| p.pin(block)) {
                pins.push(pin);
            }
        }
        if let Some(h) = self.holds.as_mut() {
            if !pins.is_empty() {
                let step = self.step;
                h.by_request.insert(req.clone(), Held { pins, step });
            }
        }
    }

    /// Give `req`'s hold back (nothing if it holds none).
    pub(crate) fn drop_hold(&mut self, req: &RequestId) {
        let held = self.holds.as_mut().and_then(|h| h.by_request.remove(req));
        if let Some(held) = held {
            self.release_pins(held.pins);
        }
    }

    /// Give back the holds taken [`MAX_HOLD_STEPS`] or more steps ago.
    pub(super) fn expire_holds(&mut self) {
        let now = self.step;
        let old: Vec<RequestId> = match self.holds.as_ref() {
            Some(h) if h.expire => h
                .by_request
                .iter()
                .filter(|(_, held)| now.saturating_sub(held.step) >= MAX_HOLD_STEPS)
                .map(|(r, _)| r.clone())
                .collect(),
            _ => return,
        };
        for r in old {
            tracing::debug!(request = %r, "a match was not allocated in time; its hold is given back");
            self.drop_hold(&r);
        }
    }

    fn release_pins(&mut self, pins: Vec<Pinned>) {
        for pin in pins {
            if let Some(pool) = self.tiers.get_mut(pin.tier()) {
                if let Err(e) = pool.release(pin) {
                    tracing::error!(error = %e, "giving back a match hold failed");
                }
            }
        }
    }
}
