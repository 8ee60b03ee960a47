//! Prometheus exposition for `serve`: HTTP-level metrics recorded as they happen, plus the engine's
//! snapshot copied in at scrape time.
//!
//! Invariant: the recorder is owned by this struct (never installed globally), so several servers in one
//! process (tests, bench) keep separate metrics. All names start with `kvtier_`; tier-specific series carry
//! a `tier` label (`host`, `disk`, `remote`, `device`).

use std::time::Duration;

use metrics::Label;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

use crate::backend::{Sample, SampleKind};

/// Buckets for latency histograms, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A private Prometheus recorder and its render handle.
pub struct Exporter {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl Default for Exporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Exporter {
    /// A fresh recorder with the HTTP metrics described.
    pub fn new() -> Self {
        let builder = PrometheusBuilder::new();
        let builder = match builder.set_buckets(LATENCY_BUCKETS) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("latency buckets rejected ({e}); using summaries");
                PrometheusBuilder::new()
            }
        };
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let me = Exporter { recorder, handle };
        me.with(|| {
            metrics::describe_counter!("kvtier_http_requests_total", "HTTP requests by endpoint and status");
            metrics::describe_histogram!(
                "kvtier_request_ttft_seconds",
                metrics::Unit::Seconds,
                "Time from request arrival to the first generated token"
            );
            metrics::describe_histogram!(
                "kvtier_request_e2e_seconds",
                metrics::Unit::Seconds,
                "Time from request arrival to the last generated token"
            );
            metrics::describe_counter!("kvtier_prompt_tokens_total", "Prompt tokens of finished requests");
            metrics::describe_counter!("kvtier_generated_tokens_total", "Tokens generated for finished requests");
            metrics::describe_counter!(
                "kvtier_cached_prompt_tokens_total",
                "Prompt tokens served from a cache (G1 prefix cache or an offload tier) instead of computed"
            );
            metrics::describe_gauge!("kvtier_requests_in_flight", "Requests being generated now");
        });
        me
    }

    /// Runs `f` with this exporter as the metrics recorder of the current thread.
    pub fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// Counts one HTTP request.
    pub fn http_request(&self, endpoint: &'static str, status: u16) {
        self.with(|| metrics::counter!("kvtier_http_requests_total", "endpoint" => endpoint, "status" => status.to_string()).increment(1));
    }

    /// Records a finished generation.
    pub fn finished(
        &self,
        ttft: Option<Duration>,
        e2e: Duration,
        prompt: u32,
        generated: u32,
        cached: u32,
    ) {
        self.with(|| {
            if let Some(t) = ttft {
                metrics::histogram!("kvtier_request_ttft_seconds").record(t.as_secs_f64());
            }
            metrics::histogram!("kvtier_request_e2e_seconds").record(e2e.as_secs_f64());
            metrics::counter!("kvtier_prompt_tokens_total").increment(u64::from(prompt));
            metrics::counter!("kvtier_generated_tokens_total").increment(u64::from(generated));
            metrics::counter!("kvtier_cached_prompt_tokens_total").increment(u64::from(cached));
        });
    }

    /// Moves the in-flight gauge.
    pub fn in_flight(&self, delta: f64) {
        self.with(|| metrics::gauge!("kvtier_requests_in_flight").increment(delta));
    }

    /// Copies an engine snapshot in and renders the text exposition format.
    pub fn render(&self, samples: &[Sample]) -> String {
        self.with(|| {
            for s in samples {
                let labels: Vec<Label> = s
                    .labels
                    .iter()
                    .map(|(k, v)| Label::new(*k, v.clone()))
                    .collect();
                match s.kind {
                    SampleKind::Counter => {
                        metrics::describe_counter!(s.name, s.help);
                        let v = if s.value.is_finite() && s.value > 0.0 {
                            s.value as u64
                        } else {
                            0
                        };
                        metrics::counter!(s.name, labels).absolute(v);
                    }
                    SampleKind::Gauge => {
                        metrics::describe_gauge!(s.name, s.help);
                        metrics::gauge!(s.name, labels).set(s.value);
                    }
                }
            }
        });
        self.handle.run_upkeep();
        self.handle.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_snapshot_and_http_metrics() {
        let e = Exporter::new();
        e.http_request("completions", 200);
        e.finished(
            Some(Duration::from_millis(3)),
            Duration::from_millis(9),
            10,
            4,
            8,
        );
        let s = vec![Sample {
            name: "kvtier_offload_blocks_total",
            labels: vec![("tier", "host".into())],
            kind: SampleKind::Counter,
            value: 7.0,
            help: "blocks offloaded",
        }];
        let text = e.render(&s);
        assert!(
            text.contains("kvtier_offload_blocks_total{tier=\"host\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_http_requests_total{endpoint=\"completions\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(text.contains("kvtier_generated_tokens_total 4"), "{text}");
        assert!(
            text.contains("kvtier_request_ttft_seconds_bucket"),
            "{text}"
        );
        // A second, independent exporter does not see the first one's values.
        let other = Exporter::new();
        assert!(!other
            .render(&[])
            .contains("kvtier_generated_tokens_total 4"));
    }
}
