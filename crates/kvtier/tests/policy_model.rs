//! Property test: the disk frequency filter against a plain reference model, over random
//! sighting sequences with non-decreasing time (the caller's monotonic clock).
//!
//! Model: a list of (hash, last sighting time, sighting number). A sighting first forgets every
//! hash last seen more than `window` ago, passes when the hash is still remembered, records the
//! sighting, then forgets least-recently-seen hashes until at most `max_tracked` remain.
#![allow(clippy::unwrap_used)]
use std::time::Duration;

use kvtier::hash::SequenceHash;
use kvtier::policy::{FilterParams, FrequencyFilter};
use proptest::prelude::*;

struct Model {
    window: u64,
    max: usize,
    entries: Vec<(u128, u64, u64)>,
    seq: u64,
}

impl Model {
    fn observe(&mut self, h: u128, now: u64) -> bool {
        let w = self.window;
        self.entries.retain(|(_, t, _)| now - t <= w);
        let pass = self.entries.iter().any(|(x, _, _)| *x == h);
        self.entries.retain(|(x, _, _)| *x != h);
        self.entries.push((h, now, self.seq));
        self.seq += 1;
        while self.entries.len() > self.max {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, _, s))| *s)
                .map(|(i, _)| i)
                .unwrap();
            self.entries.remove(oldest);
        }
        pass
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn filter_matches_model(
        window in 0u64..50,
        max in 1usize..12,
        steps in proptest::collection::vec((0u128..20, 0u64..15), 0..400),
    ) {
        let mut f = FrequencyFilter::new(FilterParams { window: Duration::from_secs(window), max_tracked: max });
        let mut m = Model { window, max, entries: Vec::new(), seq: 0 };
        let mut now = 0u64;
        for (i, (h, dt)) in steps.into_iter().enumerate() {
            now += dt;
            let got = f.observe(SequenceHash(h), Duration::from_secs(now));
            let want = m.observe(h, now);
            prop_assert_eq!(got, want, "step {} hash {} at {}", i, h, now);
            prop_assert!(f.len() <= max);
            prop_assert_eq!(f.len(), m.entries.len());
        }
    }
}
