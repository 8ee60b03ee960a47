//! Offload policy: the G2 -> G3 frequency filter.
//!
//! Device -> host (G1 -> G2) is write-through: every full block as it completes (the leader's
//! slots hand them out; there is no switch, since nothing else fills the host tier). Host ->
//! remote (G2 -> G4) puts every block stored in G2 when a remote tier is configured and the
//! role writes to it. Host -> disk (G2 -> G3) puts only blocks that pass the frequency filter:
//! a hash must be seen a second time within the decay window (measured from its previous
//! sighting) before it is written to disk, sparing the SSD one-off blocks. The filter
//! remembers at most `max_tracked` hashes; when full, it forgets the least recently seen. The
//! leader drives it ([`crate::connector::DiskPolicy::Filter`]); the composition root builds that
//! from [`DiskFilterConfig`] (`policy.disk_filter.*`), identically for every engine.
//!
//! Pure: time is passed in as a [`Duration`] since any fixed origin (the caller's monotonic
//! clock), so the filter never reads a clock and tests are deterministic.
//!
//! Invariants: the filter holds at most `max_tracked` hashes; a hash is "seen twice within the
//! window" exactly when its previous sighting is at most `window` before `now` and it was not
//! forgotten for room in between; time going backwards counts as no time elapsed.
//!
//! ```
//! use std::time::Duration;
//! use kvtier::hash::SequenceHash;
//! use kvtier::policy::{FilterParams, FrequencyFilter};
//!
//! let defaults = kvtier::config::KvtierConfig::default().policy.disk_filter;
//! let mut f = FrequencyFilter::new(FilterParams::from(&defaults));
//! let h = SequenceHash(42);
//! assert!(!f.observe(h, Duration::from_secs(10)));
//! assert!(f.observe(h, Duration::from_secs(200))); // 2nd sighting within 600 s
//! ```
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::config::DiskFilterConfig;
use crate::hash::SequenceHash;

/// The filter's parameters (from [`DiskFilterConfig`] or set directly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterParams {
    /// A second sighting counts only within this long of the previous one.
    pub window: Duration,
    /// Hashes remembered at most.
    pub max_tracked: usize,
}

impl From<&DiskFilterConfig> for FilterParams {
    fn from(c: &DiskFilterConfig) -> Self {
        FilterParams {
            window: Duration::from_secs(c.window_secs),
            max_tracked: c.max_tracked,
        }
    }
}

/// "Seen twice within the window" over a bounded set of hashes.
///
/// `last_seen` maps a hash to its last sighting (time and a sighting number); `order` lists
/// sightings oldest first, with stale entries (a hash seen again later) skipped lazily by their
/// sighting number, and is compacted when it grows past twice the table, so both stay
/// O(max_tracked).
#[derive(Debug)]
pub struct FrequencyFilter {
    params: FilterParams,
    last_seen: HashMap<u128, Sighting>,
    order: VecDeque<(u128, Sighting)>,
    next_seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sighting {
    at: Duration,
    seq: u64,
}

impl FrequencyFilter {
    /// An empty filter.
    pub fn new(params: FilterParams) -> Self {
        FrequencyFilter {
            params,
            last_seen: HashMap::new(),
            order: VecDeque::new(),
            next_seq: 0,
        }
    }

    /// Record a sighting of `hash` at `now`; true when it is the second (or later) sighting
    /// within the window of the previous one.
    pub fn observe(&mut self, hash: SequenceHash, now: Duration) -> bool {
        if self.params.max_tracked == 0 {
            return false;
        }
        self.expire(now);
        let prev = self.last_seen.get(&hash.0).copied();
        let pass = prev.is_some_and(|p| now.saturating_sub(p.at) <= self.params.window);
        // Keep each hash's time monotonic so `order` stays sorted by time.
        let at = prev.map_or(now, |p| p.at.max(now));
        let sighting = Sighting {
            at,
            seq: self.next_seq,
        };
        self.next_seq += 1;
        self.last_seen.insert(hash.0, sighting);
        self.order.push_back((hash.0, sighting));
        while self.last_seen.len() > self.params.max_tracked {
            self.forget_oldest();
        }
        if self.order.len() > 2 * self.params.max_tracked.max(16) {
            self.compact();
        }
        pass
    }

    /// Hashes currently remembered.
    pub fn len(&self) -> usize {
        self.last_seen.len()
    }

    /// Whether no hash is remembered.
    pub fn is_empty(&self) -> bool {
        self.last_seen.is_empty()
    }

    fn is_live(&self, h: u128, s: Sighting) -> bool {
        self.last_seen.get(&h).is_some_and(|l| l.seq == s.seq)
    }

    /// Forget sightings older than the window (they can no longer make a hash pass).
    fn expire(&mut self, now: Duration) {
        while let Some(&(h, s)) = self.order.front() {
            if now.saturating_sub(s.at) <= self.params.window {
                break;
            }
            self.order.pop_front();
            if self.is_live(h, s) {
                self.last_seen.remove(&h);
            }
        }
    }

    fn forget_oldest(&mut self) {
        while let Some((h, s)) = self.order.pop_front() {
            if self.is_live(h, s) {
                self.last_seen.remove(&h);
                return;
            }
        }
    }

    /// Drop stale sightings; the live ones keep their order.
    fn compact(&mut self) {
        let order = std::mem::take(&mut self.order);
        self.order = order
            .into_iter()
            .filter(|(h, s)| self.is_live(*h, *s))
            .collect();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn h(i: u128) -> SequenceHash {
        SequenceHash(i)
    }

    fn filter(window: u64, max: usize) -> FrequencyFilter {
        FrequencyFilter::new(FilterParams {
            window: secs(window),
            max_tracked: max,
        })
    }

    #[test]
    fn second_sighting_within_window_passes() {
        let mut f = filter(600, 100);
        assert!(!f.observe(h(1), secs(0)));
        assert!(f.observe(h(1), secs(599)));
        assert!(
            f.observe(h(1), secs(1199)),
            "window runs from the previous sighting"
        );
        assert!(!f.observe(h(2), secs(1200)));
        assert!(!f.observe(h(2), secs(1801)), "601 s later: too late");
        assert!(f.observe(h(2), secs(1802)));
    }

    #[test]
    fn exactly_at_the_window_edge_passes() {
        let mut f = filter(10, 100);
        assert!(!f.observe(h(1), secs(5)));
        assert!(f.observe(h(1), secs(15)));
    }

    #[test]
    fn expired_hashes_are_forgotten() {
        let mut f = filter(10, 100);
        for i in 0..50 {
            f.observe(h(i), secs(0));
        }
        assert_eq!(f.len(), 50);
        f.observe(h(999), secs(11));
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn table_is_bounded_and_forgets_least_recently_seen() {
        let mut f = filter(1_000, 3);
        f.observe(h(1), secs(1));
        f.observe(h(2), secs(2));
        f.observe(h(3), secs(3));
        f.observe(h(1), secs(4)); // 1 is now the most recent
        f.observe(h(4), secs(5)); // evicts 2
        assert_eq!(f.len(), 3);
        assert!(!f.observe(h(2), secs(6)), "2 was forgotten");
        // ...which evicted 3 (oldest of 3, 1, 4).
        assert!(f.observe(h(1), secs(7)));
        assert!(!f.observe(h(3), secs(8)));
        assert!(f.len() <= 3);
    }

    #[test]
    fn bounded_under_churn() {
        let mut f = filter(1_000_000, 20);
        for i in 0..10_000u128 {
            f.observe(h(i % 37), secs(i as u64));
            assert!(f.len() <= 20);
            assert!(f.order.len() <= 2 * 20 + 1);
        }
    }

    #[test]
    fn time_going_backwards_counts_as_zero() {
        let mut f = filter(10, 100);
        f.observe(h(1), secs(100));
        assert!(f.observe(h(1), secs(50)));
    }

    #[test]
    fn params_follow_the_config() {
        let c = crate::config::KvtierConfig::default().policy.disk_filter;
        assert_eq!(
            FilterParams::from(&c),
            FilterParams {
                window: secs(600),
                max_tracked: 1_000_000
            }
        );
    }
}
