//! The one table of kvtier's counters: every number the leader keeps ([`LeaderStats`]), with its
//! stats key, Prometheus name, help, kind and labels. The Python `stats()` dict, the in-process
//! Prometheus endpoint (`metrics.enabled`), `kvtier serve`'s `/metrics` and the bench all read
//! [`METRICS`], so a counter is defined once and means the same everywhere.
//!
//! Invariants: stats keys are unique; a Prometheus name has one kind and one help text, and
//! each of its series has a distinct label set; counters are monotonic for one leader (the sum
//! over leaders is monotonic while they live).
//!
//! Series with `direction`/`tier` labels: `kvtier_blocks_total` counts blocks written into a
//! tier (`offload`: G1 -> host, host -> disk (or G1 -> disk without a host tier), host ->
//! remote) and blocks loaded from a tier into G1 (`onboard`).
//!
//! ```
//! use kvtier::connector::LeaderStats;
//! use kvtier::metrics::{render_prometheus, value};
//!
//! let s = LeaderStats { offload_confirmed: 5, host_capacity: 10, onboard_host_blocks: 2, ..Default::default() };
//! assert_eq!(value(&s, "offloaded_host_blocks"), Some(5));
//! let text = render_prometheus(&[s]);
//! assert!(text.contains("kvtier_blocks_total{direction=\"offload\",tier=\"host\"} 5"));
//! assert!(text.contains("kvtier_blocks_total{direction=\"onboard\",tier=\"host\"} 2"));
//! ```
use std::fmt::Write as _;

use crate::connector::LeaderStats;

/// Prometheus metric type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only ever increases.
    Counter,
    /// May go up and down.
    Gauge,
}

impl MetricKind {
    /// The Prometheus `# TYPE` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
        }
    }
}

/// One series: a stats key and where it goes in Prometheus.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// Key in the Python `stats()` dict (unique).
    pub key: &'static str,
    /// Prometheus family name (`kvtier_*`).
    pub name: &'static str,
    /// The `# HELP` line.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: MetricKind,
    /// This series' label values.
    pub labels: &'static [(&'static str, &'static str)],
    /// Its value in a leader snapshot.
    pub value: fn(&LeaderStats) -> u64,
}

const fn m(
    key: &'static str,
    name: &'static str,
    help: &'static str,
    kind: MetricKind,
    labels: &'static [(&'static str, &'static str)],
    value: fn(&LeaderStats) -> u64,
) -> Metric {
    Metric {
        key,
        name,
        help,
        kind,
        labels,
        value,
    }
}

use MetricKind::{Counter, Gauge};

const PINNED: &str = "kvtier_pinned_blocks";
const BLOCKS: &str = "kvtier_blocks_total";
const BLOCKS_HELP: &str =
    "Blocks written into a tier (offload) or loaded from a tier into the engine (onboard)";
const BYTES: &str = "kvtier_bytes_total";
const BYTES_HELP: &str =
    "Bytes loaded from a tier into the engine (onboard; one kvtier block's bytes over every rank per block)";
const DISPATCHED: &str = "kvtier_dispatched_blocks_total";
const DISPATCHED_HELP: &str = "Blocks handed to a transfer towards a tier (in flight or done)";
const FAILED: &str = "kvtier_failed_blocks_total";
const FAILED_HELP: &str = "Blocks whose transfer failed (a failed onboard is recomputed)";
const CAPACITY: &str = "kvtier_pool_capacity_blocks";
const FREE: &str = "kvtier_pool_free_blocks";
const REGISTERED: &str = "kvtier_pool_registered_blocks";

fn u(v: usize) -> u64 {
    v as u64
}

/// G1 stores land in the host tier when there is one, else on disk when there is one, else in
/// the remote tier (a node-only engine), which `remote_put_confirmed` counts already.
fn has_host(s: &LeaderStats) -> bool {
    s.host_capacity > 0
}

/// G1 stores that landed on disk (no host tier, a disk tier).
fn offloaded_to_disk(s: &LeaderStats) -> u64 {
    if has_host(s) || s.disk_capacity == 0 {
        0
    } else {
        s.offload_confirmed
    }
}

/// Every series kvtier exports, in exposition order (a family's series are adjacent).
pub const METRICS: &[Metric] = &[
    m(
        "offloaded_host_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "offload"), ("tier", "host")],
        |s| if has_host(s) { s.offload_confirmed } else { 0 },
    ),
    m(
        "offloaded_disk_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "offload"), ("tier", "disk")],
        |s| s.spill_disk_confirmed + offloaded_to_disk(s),
    ),
    m(
        "offloaded_remote_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "offload"), ("tier", "remote")],
        |s| s.remote_put_confirmed,
    ),
    m(
        "onboard_host_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "host")],
        |s| s.onboard_host_blocks,
    ),
    m(
        "onboard_disk_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "disk")],
        |s| s.onboard_disk_blocks,
    ),
    m(
        "onboard_remote_blocks",
        BLOCKS,
        BLOCKS_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "remote")],
        |s| s.onboard_remote_blocks,
    ),
    m(
        "onboard_host_bytes",
        BYTES,
        BYTES_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "host")],
        |s| s.onboard_host_bytes,
    ),
    m(
        "onboard_disk_bytes",
        BYTES,
        BYTES_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "disk")],
        |s| s.onboard_disk_bytes,
    ),
    m(
        "onboard_remote_bytes",
        BYTES,
        BYTES_HELP,
        Counter,
        &[("direction", "onboard"), ("tier", "remote")],
        |s| s.onboard_remote_bytes,
    ),
    m(
        "offload_blocks",
        DISPATCHED,
        DISPATCHED_HELP,
        Counter,
        &[("direction", "offload"), ("from", "device")],
        |s| s.offload_blocks,
    ),
    m(
        "spill_disk_blocks",
        DISPATCHED,
        DISPATCHED_HELP,
        Counter,
        &[("direction", "offload"), ("from", "host"), ("tier", "disk")],
        |s| s.spill_disk_blocks,
    ),
    m(
        "remote_put_blocks",
        DISPATCHED,
        DISPATCHED_HELP,
        Counter,
        &[
            ("direction", "offload"),
            ("from", "host"),
            ("tier", "remote"),
        ],
        |s| s.remote_put_blocks,
    ),
    m(
        "offload_confirmed",
        "kvtier_offload_confirmed_blocks_total",
        "Blocks copied out of the engine and confirmed in the first offload tier",
        Counter,
        &[],
        |s| s.offload_confirmed,
    ),
    m(
        "spill_disk_confirmed",
        "kvtier_spill_confirmed_blocks_total",
        "Host -> disk spills written and registered",
        Counter,
        &[],
        |s| s.spill_disk_confirmed,
    ),
    m(
        "remote_put_confirmed",
        "kvtier_remote_put_confirmed_blocks_total",
        "Host -> remote puts written by every rank",
        Counter,
        &[],
        |s| s.remote_put_confirmed,
    ),
    m(
        "offload_failed",
        FAILED,
        FAILED_HELP,
        Counter,
        &[("direction", "offload"), ("from", "device")],
        |s| s.offload_failed,
    ),
    m(
        "spill_disk_failed",
        FAILED,
        FAILED_HELP,
        Counter,
        &[("direction", "offload"), ("from", "host"), ("tier", "disk")],
        |s| s.spill_disk_failed,
    ),
    m(
        "remote_put_failed",
        FAILED,
        FAILED_HELP,
        Counter,
        &[
            ("direction", "offload"),
            ("from", "host"),
            ("tier", "remote"),
        ],
        |s| s.remote_put_failed,
    ),
    m(
        "onboard_failed",
        FAILED,
        FAILED_HELP,
        Counter,
        &[("direction", "onboard")],
        |s| s.onboard_failed,
    ),
    m(
        "offload_deduplicated",
        "kvtier_offload_skipped_blocks_total",
        "Offload candidates not copied: already held (deduplicated) or no room (dropped)",
        Counter,
        &[("reason", "deduplicated")],
        |s| s.offload_deduplicated,
    ),
    m(
        "offload_dropped",
        "kvtier_offload_skipped_blocks_total",
        "Offload candidates not copied: already held (deduplicated) or no room (dropped)",
        Counter,
        &[("reason", "dropped")],
        |s| s.offload_dropped,
    ),
    m(
        "match_queries",
        "kvtier_match_queries_total",
        "Prefix lookups made by the engine",
        Counter,
        &[],
        |s| s.match_queries,
    ),
    m(
        "matched_tokens",
        "kvtier_matched_tokens_total",
        "Tokens found in an offload tier (to load instead of compute)",
        Counter,
        &[],
        |s| s.matched_tokens,
    ),
    m(
        "load_restarts",
        "kvtier_load_restarts_total",
        "Requests matched again before they ran (their first load abandoned)",
        Counter,
        &[],
        |s| s.load_restarts,
    ),
    m(
        "preempted_requests",
        "kvtier_preempted_requests_total",
        "Requests the engine preempted after they ran (their device blocks freed)",
        Counter,
        &[],
        |s| s.preempted_requests,
    ),
    m(
        "uncacheable_requests",
        "kvtier_uncacheable_requests_total",
        "Requests kvtier cannot key (adapter said so): never matched, never stored",
        Counter,
        &[],
        |s| s.uncacheable_requests,
    ),
    m(
        "events_dropped",
        "kvtier_events_dropped_total",
        "Pool events nobody took in time",
        Counter,
        &[],
        |s| s.events_dropped,
    ),
    m(
        "steps",
        "kvtier_steps_total",
        "Scheduler steps seen by the leader",
        Counter,
        &[],
        |s| s.steps,
    ),
    m(
        "remote_breaker_opened",
        "kvtier_remote_breaker_opened_total",
        "Times the remote store's circuit breaker opened (server marked down)",
        Counter,
        &[],
        |s| s.remote.breaker_opened,
    ),
    m(
        "remote_breaker_probes",
        "kvtier_remote_breaker_probes_total",
        "Probes sent to a remote server marked down",
        Counter,
        &[],
        |s| s.remote.breaker_probes,
    ),
    m(
        "remote_short_circuited",
        "kvtier_remote_short_circuited_total",
        "Remote operations refused at once while the breaker was open",
        Counter,
        &[],
        |s| s.remote.short_circuited,
    ),
    m(
        "remote_deadline_expired",
        "kvtier_remote_deadline_expired_total",
        "Remote operations that ran past their deadline (connect, read or write timeout)",
        Counter,
        &[],
        |s| s.remote.deadline_expired,
    ),
    m(
        "remote_breaker_open",
        "kvtier_remote_breaker_open",
        "1 while the remote store's circuit breaker is open or probing",
        Gauge,
        &[],
        |s| u64::from(s.remote.breaker_open),
    ),
    m(
        "active_requests",
        "kvtier_active_requests",
        "Requests the leader tracks now",
        Gauge,
        &[],
        |s| u(s.active_requests),
    ),
    m(
        "jobs_in_flight",
        "kvtier_jobs_in_flight",
        "Transfer jobs not yet confirmed by every rank",
        Gauge,
        &[],
        |s| u(s.jobs_in_flight),
    ),
    m(
        "host_capacity",
        CAPACITY,
        "Blocks per tier",
        Gauge,
        &[("tier", "host")],
        |s| u(s.host_capacity),
    ),
    m(
        "disk_capacity",
        CAPACITY,
        "Blocks per tier",
        Gauge,
        &[("tier", "disk")],
        |s| u(s.disk_capacity),
    ),
    m(
        "host_free",
        FREE,
        "Free blocks per tier",
        Gauge,
        &[("tier", "host")],
        |s| u(s.host_free),
    ),
    m(
        "disk_free",
        FREE,
        "Free blocks per tier",
        Gauge,
        &[("tier", "disk")],
        |s| u(s.disk_free),
    ),
    m(
        "host_registered",
        REGISTERED,
        "Blocks of a tier holding a findable block",
        Gauge,
        &[("tier", "host")],
        |s| u(s.host_registered),
    ),
    m(
        "disk_registered",
        REGISTERED,
        "Blocks of a tier holding a findable block",
        Gauge,
        &[("tier", "disk")],
        |s| u(s.disk_registered),
    ),
    m(
        "host_pinned",
        PINNED,
        "Blocks of a tier pinned by a load or store in flight (above 0 on an idle engine: a leak)",
        Gauge,
        &[("tier", "host")],
        |s| u(s.host_pinned),
    ),
    m(
        "disk_pinned",
        PINNED,
        "Blocks of a tier pinned by a load or store in flight (above 0 on an idle engine: a leak)",
        Gauge,
        &[("tier", "disk")],
        |s| u(s.disk_pinned),
    ),
    m(
        "fenced_device_blocks",
        "kvtier_fenced_device_blocks",
        "Engine device blocks given back while kvtier's stores still read them (fenced reuse)",
        Gauge,
        &[],
        |s| u(s.fenced_device_blocks),
    ),
];

/// The value of the series with stats key `key`.
pub fn value(s: &LeaderStats, key: &str) -> Option<u64> {
    METRICS.iter().find(|m| m.key == key).map(|m| (m.value)(s))
}

/// Every series' value, summed over `leaders` (several leaders in one process share one
/// endpoint).
pub fn values(leaders: &[LeaderStats]) -> Vec<(&'static Metric, u64)> {
    METRICS
        .iter()
        .map(|m| (m, leaders.iter().map(|s| (m.value)(s)).sum()))
        .collect()
}

/// The Prometheus text exposition (format 0.0.4) of `leaders`' summed values.
pub fn render_prometheus(leaders: &[LeaderStats]) -> String {
    let mut out = String::new();
    let mut last = "";
    for (m, v) in values(leaders) {
        if m.name != last {
            let _ = writeln!(out, "# HELP {} {}", m.name, m.help);
            let _ = writeln!(out, "# TYPE {} {}", m.name, m.kind.as_str());
            last = m.name;
        }
        out.push_str(m.name);
        if !m.labels.is_empty() {
            out.push('{');
            for (i, (k, val)) in m.labels.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{k}=\"{val}\"");
            }
            out.push('}');
        }
        let _ = writeln!(out, " {v}");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    /// A family's help, kind and label sets.
    type Family<'a> = (&'a str, MetricKind, HashSet<Vec<(&'a str, &'a str)>>);

    #[test]
    fn keys_unique_families_consistent_and_adjacent() {
        let mut keys = HashSet::new();
        let mut families: HashMap<&str, Family> = HashMap::new();
        let mut seen_order: Vec<&str> = Vec::new();
        for m in METRICS {
            assert!(keys.insert(m.key), "duplicate key {}", m.key);
            assert!(m.name.starts_with("kvtier_"), "{}", m.name);
            let f = families
                .entry(m.name)
                .or_insert_with(|| (m.help, m.kind, HashSet::new()));
            assert_eq!(
                (f.0, f.1),
                (m.help, m.kind),
                "{} is described twice",
                m.name
            );
            assert!(
                f.2.insert(m.labels.to_vec()),
                "{} repeats a label set",
                m.name
            );
            if seen_order.last() != Some(&m.name) {
                assert!(!seen_order.contains(&m.name), "{} is not adjacent", m.name);
                seen_order.push(m.name);
            }
        }
    }

    #[test]
    fn disk_only_offloads_count_on_disk_and_leaders_sum() {
        let s = LeaderStats {
            offload_confirmed: 4,
            spill_disk_confirmed: 0,
            disk_capacity: 10,
            ..Default::default()
        };
        assert_eq!(value(&s, "offloaded_host_blocks"), Some(0));
        assert_eq!(value(&s, "offloaded_disk_blocks"), Some(4));
        let text = render_prometheus(&[s.clone(), s]);
        assert!(
            text.contains("kvtier_blocks_total{direction=\"offload\",tier=\"disk\"} 8"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kvtier_pool_capacity_blocks gauge"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE kvtier_blocks_total").count(), 1);
    }

    /// A node-only engine (no host, no disk tier) stores G1 blocks straight into the remote
    /// tier: they count there, not on disk (the H200 node bench once showed them in both).
    #[test]
    fn node_only_offloads_count_in_the_remote_tier_alone() {
        let s = LeaderStats {
            offload_confirmed: 7,
            remote_put_confirmed: 7,
            ..Default::default()
        };
        assert_eq!(value(&s, "offloaded_host_blocks"), Some(0));
        assert_eq!(value(&s, "offloaded_disk_blocks"), Some(0));
        assert_eq!(value(&s, "offloaded_remote_blocks"), Some(7));
    }

    /// The Grafana dashboard in the repository only plots series this table exports.
    #[test]
    fn dashboard_uses_only_exported_series() {
        let dash = include_str!("../../../docs/grafana/kvtier.json");
        let names: HashSet<&str> = METRICS.iter().map(|m| m.name).collect();
        let mut used = 0;
        for (i, _) in dash.match_indices("kvtier_") {
            let word: String = dash[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                names.contains(word.as_str()),
                "dashboard plots unknown series {word}"
            );
            used += 1;
        }
        assert!(used >= 10, "{used}");
    }
}
