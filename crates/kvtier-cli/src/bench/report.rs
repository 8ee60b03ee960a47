//! Turns run records into summaries, the comparison table, and the JSON report.
//!
//! Invariant: every figure is computed from the records and counter deltas of the same run; ratios are
//! against a baseline configuration measured in that run, never against a stored number.

use serde::Serialize;

use crate::backend::TierCounts;
pub use crate::bench::runner::percentile;
use crate::bench::runner::RunResult;

/// Fraction of prompt tokens served per tier.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct HitRates {
    /// From the engine's own G1 prefix cache.
    pub device: f64,
    /// From kvtier's host tier.
    pub host: f64,
    /// From kvtier's disk tier.
    pub disk: f64,
    /// From kvtier's remote tier.
    pub remote: f64,
}

/// One (workload, configuration) row.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The workload's name.
    pub workload: String,
    /// The configuration's name.
    pub config: String,
    /// Requests run.
    pub requests: usize,
    /// Of those, failed.
    pub errors: usize,
    /// Seconds the run took.
    pub wall_s: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile time to first token, ms.
    pub ttft_p90_ms: f64,
    /// 99th percentile time to first token, ms.
    pub ttft_p99_ms: f64,
    /// Median time from submit to the last event, ms.
    pub e2e_p50_ms: f64,
    /// Requests finished per second of the run.
    pub requests_per_s: f64,
    /// Tokens generated per second of the run.
    pub output_tokens_per_s: f64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens the engine ran through the model.
    pub computed_prompt_tokens: u64,
    /// Computed prompt tokens that had already been computed earlier in the run.
    pub recomputed_tokens: u64,
    /// Fraction of prompt tokens served per tier.
    pub hit_rate: HitRates,
    /// Blocks offloaded into each tier.
    pub offloaded_blocks: TierCounts,
    /// Blocks onboarded from each tier into G1.
    pub onboarded_blocks: TierCounts,
    /// TTFT p50 (ms) per turn index (chat round / docqa question).
    pub ttft_p50_ms_by_turn: Vec<f64>,
}

impl Summary {
    /// Summarises one run.
    pub fn new(workload: &str, config: &str, r: &RunResult) -> Self {
        let ok: Vec<_> = r.records.iter().filter(|x| x.error.is_none()).collect();
        let mut ttft: Vec<f64> = ok.iter().map(|x| x.ttft_s).collect();
        ttft.sort_by(f64::total_cmp);
        let mut e2e: Vec<f64> = ok.iter().map(|x| x.e2e_s).collect();
        e2e.sort_by(f64::total_cmp);
        let ms = |v: Option<f64>| v.map_or(0.0, |x| x * 1e3);
        let wall = r.wall.as_secs_f64().max(1e-9);
        let prompt_tokens: u64 = ok.iter().map(|x| x.prompt_tokens as u64).sum();
        let out_tokens: u64 = ok.iter().map(|x| x.output.len() as u64).sum();
        let c = r.counters;
        let computed: u64 = ok
            .iter()
            .map(|x| (x.prompt_tokens as u64).saturating_sub(u64::from(x.cached_tokens)))
            .sum();
        let recomputed: u64 = ok
            .iter()
            .map(|x| (x.seen_prefix_tokens as u64).saturating_sub(u64::from(x.cached_tokens)))
            .sum();
        let frac = |tokens: u64| {
            if prompt_tokens == 0 {
                0.0
            } else {
                tokens as f64 / prompt_tokens as f64
            }
        };
        let turns = ok.iter().map(|x| x.key.turn + 1).max().unwrap_or(0);
        let by_turn = (0..turns)
            .map(|t| {
                let mut v: Vec<f64> = ok
                    .iter()
                    .filter(|x| x.key.turn == t)
                    .map(|x| x.ttft_s)
                    .collect();
                v.sort_by(f64::total_cmp);
                ms(percentile(&v, 50.0))
            })
            .collect();
        Summary {
            workload: workload.to_string(),
            config: config.to_string(),
            requests: r.records.len(),
            errors: r.records.len() - ok.len(),
            wall_s: wall,
            ttft_p50_ms: ms(percentile(&ttft, 50.0)),
            ttft_p90_ms: ms(percentile(&ttft, 90.0)),
            ttft_p99_ms: ms(percentile(&ttft, 99.0)),
            e2e_p50_ms: ms(percentile(&e2e, 50.0)),
            requests_per_s: ok.len() as f64 / wall,
            output_tokens_per_s: out_tokens as f64 / wall,
            prompt_tokens,
            computed_prompt_tokens: computed,
            recomputed_tokens: recomputed,
            hit_rate: HitRates {
                device: frac(c.device_hit_tokens),
                host: frac(c.hit_tokens.host),
                disk: frac(c.hit_tokens.disk),
                remote: frac(c.hit_tokens.remote),
            },
            offloaded_blocks: c.offload_blocks,
            onboarded_blocks: c.onboard_blocks,
            ttft_p50_ms_by_turn: by_turn,
        }
    }
}

/// The comparison table (fixed-width, Markdown-compatible), with one TTFT p50 ratio column per
/// baseline configuration.
pub fn table(rows: &[Summary], baselines: &[String]) -> String {
    let mut out = String::new();
    out.push_str("| workload | config | reqs | TTFT p50 ms | p90 ms | p99 ms |");
    for b in baselines {
        out.push_str(&format!(" vs {b} (p50) |"));
    }
    out.push_str(
        " req/s | out tok/s | hit G1/host/disk/remote % | recomputed tok | offload host/disk/remote | \
         onboard host/disk/remote |\n",
    );
    out.push_str("|---|---|---:|---:|---:|---:|");
    out.push_str(&"---:|".repeat(baselines.len()));
    out.push_str("---:|---:|---|---:|---|---|\n");
    for r in rows {
        let ratios: String = baselines
            .iter()
            .map(|baseline| {
                let base = rows
                    .iter()
                    .find(|b| b.workload == r.workload && &b.config == baseline);
                match base {
                    Some(b) if r.ttft_p50_ms > 0.0 => {
                        format!(" {:.2}x |", b.ttft_p50_ms / r.ttft_p50_ms)
                    }
                    _ => " - |".into(),
                }
            })
            .collect();
        let h = r.hit_rate;
        out.push_str(&format!(
            "| {} | {} | {}{} | {:.1} | {:.1} | {:.1} |{} {:.2} | {:.1} | {:.0}/{:.0}/{:.0}/{:.0} | {} | {}/{}/{} | {}/{}/{} |\n",
            r.workload,
            r.config,
            r.requests,
            if r.errors > 0 { format!(" ({} err)", r.errors) } else { String::new() },
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            ratios,
            r.requests_per_s,
            r.output_tokens_per_s,
            h.device * 100.0,
            h.host * 100.0,
            h.disk * 100.0,
            h.remote * 100.0,
            r.recomputed_tokens,
            r.offloaded_blocks.host,
            r.offloaded_blocks.disk,
            r.offloaded_blocks.remote,
            r.onboarded_blocks.host,
            r.onboarded_blocks.disk,
            r.onboarded_blocks.remote,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CacheCounters;
    use crate::bench::runner::RequestRecord;
    use crate::bench::workload::RequestKey;
    use std::time::Duration;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    fn rec(turn: usize, prompt: usize, seen: usize, ttft: f64) -> RequestRecord {
        RequestRecord {
            key: RequestKey { stream: 0, turn },
            prompt_tokens: prompt,
            seen_prefix_tokens: seen,
            cached_tokens: 0,
            ttft_s: ttft,
            e2e_s: ttft * 2.0,
            submitted_at_s: 0.0,
            output: vec![1, 2],
            error: None,
        }
    }

    #[test]
    fn summary_counts_recomputation_and_hits() {
        let mut c = CacheCounters {
            device_hit_tokens: 16,
            ..Default::default()
        };
        c.hit_tokens.host = 32;
        let mut second = rec(1, 80, 48, 0.020);
        second.cached_tokens = 36;
        let r = RunResult {
            records: vec![rec(0, 40, 0, 0.010), second],
            wall: Duration::from_secs(2),
            counters: c,
        };
        let s = Summary::new("chat", "x", &r);
        // second request: 48 tokens seen before, 36 served from a cache -> 12 recomputed
        assert_eq!(s.recomputed_tokens, 12);
        assert_eq!(s.computed_prompt_tokens, 40 + 44);
        assert_eq!(s.prompt_tokens, 120);
        assert!((s.hit_rate.device - 16.0 / 120.0).abs() < 1e-12);
        assert!((s.hit_rate.host - 32.0 / 120.0).abs() < 1e-12);
        assert_eq!(s.ttft_p50_ms_by_turn, vec![10.0, 20.0]);
        assert!((s.output_tokens_per_s - 2.0).abs() < 1e-12);
        let mut other = s.clone();
        other.config = "y".into();
        other.ttft_p50_ms = 40.0;
        let t = table(&[s, other], &["x".into(), "y".into()]);
        assert!(t.contains("| vs x (p50) | vs y (p50) |"), "{t}");
        // x: 1.00x against itself, 4.00x against y (a quarter of y's p50); y: 0.25x and 1.00x.
        assert!(
            t.contains("| chat | x | 2 | 10.0 | 20.0 | 20.0 | 1.00x | 4.00x |"),
            "{t}"
        );
        assert!(
            t.contains("| chat | y | 2 | 40.0 | 20.0 | 20.0 | 0.25x | 1.00x |"),
            "{t}"
        );
        let header_cols = t.lines().next().unwrap().matches('|').count();
        for l in t.lines() {
            assert_eq!(l.matches('|').count(), header_cols, "{l}");
        }
    }
}
