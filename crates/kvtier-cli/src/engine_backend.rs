//! [`Backend`] over the reference engine (`kvtier_engine::EngineHandle`).
//!
//! Invariant: a pure translation layer — requests and events map one to one, engine errors map to
//! [`SubmitError`] variants, and the engine's metric snapshot maps to `kvtier_*` samples without any
//! arithmetic beyond ratios and token→block conversions (offload tiers move whole blocks).

use std::sync::Arc;

use kvtier_engine::{
    EngineError, EngineHandle, EngineMetrics, GenerateEvent, GenerateRequest, Prefilled,
};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::backend::{
    Backend, CacheCounters, Finished, GenEvent, GenRequest, Sample, SampleKind, SubmitError,
    TextCodec, TierCounts,
};

/// The engine's tokenizer as a [`TextCodec`].
struct Codec(Arc<kvtier_engine::Tokenizer>);

impl TextCodec for Codec {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.0.encode(text)
    }
    fn decode(&self, tokens: &[u32]) -> String {
        self.0.decode(tokens)
    }
}

/// A running reference engine.
pub struct EngineBackend {
    handle: EngineHandle,
    block_size: usize,
    num_device_blocks: usize,
    max_model_len: usize,
}

impl EngineBackend {
    /// Starts an engine.
    pub fn start(cfg: kvtier_engine::EngineConfig) -> Result<Self, EngineError> {
        let block_size = cfg.block_size;
        let num_device_blocks = cfg.num_device_blocks;
        let handle = EngineHandle::start(cfg)?;
        // A request must fit both the model's positions and G1 (the engine refuses larger ones).
        let max_model_len = handle
            .model_config()
            .max_position_embeddings
            .min(num_device_blocks * block_size);
        Ok(EngineBackend {
            handle,
            block_size,
            num_device_blocks,
            max_model_len,
        })
    }

    /// The engine's own metrics.
    pub fn engine_metrics(&self) -> EngineMetrics {
        self.handle.metrics()
    }
}

fn sat_u32(x: usize) -> u32 {
    u32::try_from(x).unwrap_or(u32::MAX)
}

impl Backend for EngineBackend {
    fn model_name(&self) -> String {
        self.handle.model_name()
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn vocab_size(&self) -> u32 {
        sat_u32(self.handle.model_config().vocab_size)
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn codec(&self) -> Arc<dyn TextCodec> {
        Arc::new(Codec(self.handle.tokenizer()))
    }

    fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError> {
        let mut g = GenerateRequest::new(req.prompt, req.max_tokens as usize);
        g.ignore_eos = req.ignore_eos;
        g.prefilled = req.prefilled.map(|first_token| Prefilled { first_token });
        let mut inner = self.handle.submit(g).map_err(|e| match e {
            EngineError::Overloaded(_) => SubmitError::Overloaded(e.to_string()),
            EngineError::InvalidRequest(m) => SubmitError::Invalid(m),
            other => SubmitError::Unavailable(other.to_string()),
        })?;
        let (tx, rx) = unbounded_channel();
        // Forward on the runtime so a dropped client receiver also drops the engine's receiver
        // (the engine then aborts the request).
        tokio::spawn(async move {
            while let Some(ev) = inner.recv().await {
                let ev = match ev {
                    GenerateEvent::Token(t) => GenEvent::Token(t),
                    GenerateEvent::Done {
                        finish_reason,
                        usage,
                    } => GenEvent::Done(Finished {
                        finish_reason,
                        prompt_tokens: sat_u32(usage.prompt_tokens),
                        completion_tokens: sat_u32(usage.completion_tokens),
                        cached_tokens: sat_u32(usage.cached_tokens),
                    }),
                    GenerateEvent::Error(e) => GenEvent::Error(e),
                };
                if tx.send(ev).is_err() {
                    break;
                }
            }
        });
        Ok(rx)
    }

    fn samples(&self) -> Vec<Sample> {
        samples_of(
            &self.handle.metrics(),
            self.block_size,
            self.num_device_blocks,
        )
    }

    fn cache_counters(&self) -> CacheCounters {
        counters_of(&self.handle.metrics(), self.block_size)
    }

    fn reset_prefix_cache(&self) {
        self.handle.reset_prefix_cache();
    }

    fn shutdown(&self) {
        self.handle.shutdown();
    }
}

/// The bench's typed counters from an engine snapshot.
pub fn counters_of(m: &EngineMetrics, _block_size: usize) -> CacheCounters {
    let v = |key: &str| kvtier::metrics::value(&m.kvtier, key).unwrap_or(0);
    let hit = TierCounts {
        host: m.kvtier_matched_tokens_host,
        disk: m.kvtier_matched_tokens_disk,
        remote: m.kvtier_matched_tokens_remote,
    };
    CacheCounters {
        device_hit_tokens: m.g1_prefix_hit_tokens,
        hit_tokens: hit,
        // Blocks written into / loaded from each tier, from kvtier's one counter table.
        offload_blocks: TierCounts {
            host: v("offloaded_host_blocks"),
            disk: v("offloaded_disk_blocks"),
            remote: v("offloaded_remote_blocks"),
        },
        onboard_blocks: TierCounts {
            host: v("onboard_host_blocks"),
            disk: v("onboard_disk_blocks"),
            remote: v("onboard_remote_blocks"),
        },
    }
}

fn counter(name: &'static str, help: &'static str, value: u64) -> Sample {
    Sample {
        name,
        labels: vec![],
        kind: SampleKind::Counter,
        value: value as f64,
        help,
    }
}

fn labelled(
    name: &'static str,
    help: &'static str,
    kind: SampleKind,
    label: (&'static str, &str),
    value: f64,
) -> Sample {
    Sample {
        name,
        labels: vec![(label.0, label.1.to_string())],
        kind,
        value,
        help,
    }
}

/// `kvtier_*` samples from an engine snapshot.
pub fn samples_of(m: &EngineMetrics, block_size: usize, num_device_blocks: usize) -> Vec<Sample> {
    let c = counters_of(m, block_size);
    let mut s = vec![
        labelled(
            "kvtier_engine_requests_total",
            "Engine requests by outcome",
            SampleKind::Counter,
            ("state", "submitted"),
            m.requests_submitted as f64,
        ),
        labelled(
            "kvtier_engine_requests_total",
            "Engine requests by outcome",
            SampleKind::Counter,
            ("state", "finished"),
            m.requests_finished as f64,
        ),
        labelled(
            "kvtier_engine_requests_total",
            "Engine requests by outcome",
            SampleKind::Counter,
            ("state", "failed"),
            m.requests_failed as f64,
        ),
        labelled(
            "kvtier_engine_requests_total",
            "Engine requests by outcome",
            SampleKind::Counter,
            ("state", "aborted"),
            m.requests_aborted as f64,
        ),
        labelled(
            "kvtier_engine_requests_total",
            "Engine requests by outcome",
            SampleKind::Counter,
            ("state", "rejected"),
            m.requests_rejected as f64,
        ),
        counter(
            "kvtier_engine_prompt_tokens_total",
            "Prompt tokens of admitted requests",
            m.prompt_tokens,
        ),
        counter(
            "kvtier_engine_generated_tokens_total",
            "Tokens generated by the engine",
            m.generated_tokens,
        ),
        counter(
            "kvtier_engine_computed_tokens_total",
            "Tokens run through the forward pass (recomputation included)",
            m.computed_tokens,
        ),
        counter(
            "kvtier_engine_recomputed_tokens_total",
            "Tokens the engine computed again (preemption, failed loads)",
            m.recomputed_tokens,
        ),
        counter(
            "kvtier_engine_preemptions_total",
            "Requests preempted for lack of G1 blocks",
            m.preemptions,
        ),
        counter("kvtier_engine_steps_total", "Engine steps", m.steps),
        counter(
            "kvtier_load_failures_total",
            "Device blocks whose kvtier load failed (recomputed)",
            m.load_failures,
        ),
        counter(
            "kvtier_connector_offloaded_blocks_total",
            "Blocks copied out of G1 by kvtier, as the connector reports",
            m.offloaded_blocks,
        ),
        counter(
            "kvtier_connector_onboarded_blocks_total",
            "Blocks copied into G1 by kvtier, as the connector reports",
            m.onboarded_blocks,
        ),
        Sample {
            name: "kvtier_engine_queue_depth",
            labels: vec![],
            kind: SampleKind::Gauge,
            value: m.queue_depth as f64,
            help: "Requests waiting for admission",
        },
        Sample {
            name: "kvtier_engine_running",
            labels: vec![],
            kind: SampleKind::Gauge,
            value: m.running as f64,
            help: "Requests running",
        },
        Sample {
            name: "kvtier_transfer_jobs_in_flight",
            labels: vec![],
            kind: SampleKind::Gauge,
            value: m.kvtier_jobs_in_flight as f64,
            help: "kvtier transfer jobs (stores, loads, spills) not yet confirmed",
        },
        labelled(
            "kvtier_pool_capacity_blocks",
            "Blocks per tier",
            SampleKind::Gauge,
            ("tier", "device"),
            num_device_blocks as f64,
        ),
        labelled(
            "kvtier_pool_free_blocks",
            "Free blocks per tier",
            SampleKind::Gauge,
            ("tier", "device"),
            m.free_device_blocks as f64,
        ),
        labelled(
            "kvtier_pool_occupancy_ratio",
            "Used fraction of each tier",
            SampleKind::Gauge,
            ("tier", "device"),
            if num_device_blocks == 0 {
                0.0
            } else {
                1.0 - m.free_device_blocks as f64 / num_device_blocks as f64
            },
        ),
        labelled(
            "kvtier_hit_tokens_total",
            "Prompt tokens served from a cache tier instead of computed",
            SampleKind::Counter,
            ("tier", "device"),
            m.g1_prefix_hit_tokens as f64,
        ),
    ];
    let prompt = m.prompt_tokens.max(1) as f64;
    s.push(labelled(
        "kvtier_hit_rate",
        "Fraction of prompt tokens served from each tier since start",
        SampleKind::Gauge,
        ("tier", "device"),
        m.g1_prefix_hit_tokens as f64 / prompt,
    ));
    for (tier, hit) in [
        ("host", c.hit_tokens.host),
        ("disk", c.hit_tokens.disk),
        ("remote", c.hit_tokens.remote),
    ] {
        s.push(labelled(
            "kvtier_hit_tokens_total",
            "Prompt tokens served from a cache tier instead of computed",
            SampleKind::Counter,
            ("tier", tier),
            hit as f64,
        ));
        s.push(labelled(
            "kvtier_hit_rate",
            "Fraction of prompt tokens served from each tier since start",
            SampleKind::Gauge,
            ("tier", tier),
            hit as f64 / prompt,
        ));
    }
    // Every kvtier counter and gauge, from the one table (`kvtier_blocks_total{direction,tier}`,
    // pools, failures, ...), exactly as vLLM's and TensorRT-LLM's in-process endpoint has them.
    for (def, value) in kvtier::metrics::values(std::slice::from_ref(&m.kvtier)) {
        s.push(Sample {
            name: def.name,
            labels: def
                .labels
                .iter()
                .map(|(k, v)| (*k, (*v).to_string()))
                .collect(),
            kind: match def.kind {
                kvtier::metrics::MetricKind::Counter => SampleKind::Counter,
                _ => SampleKind::Gauge,
            },
            value: value as f64,
            help: def.help,
        });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(samples: &[Sample], name: &str, labels: &[(&'static str, &str)]) -> f64 {
        let want: Vec<(&str, String)> = labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
        samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
            .unwrap()
    }

    #[test]
    fn offloads_are_counted_per_tier() {
        let m = EngineMetrics {
            kvtier_matched_tokens_disk: 64,
            kvtier: kvtier::connector::LeaderStats {
                host_capacity: 100,
                offload_confirmed: 40,
                spill_disk_confirmed: 25,
                spill_disk_blocks: 27,
                remote_put_blocks: 4,
                remote_put_confirmed: 3,
                onboard_disk_blocks: 4,
                ..Default::default()
            },
            ..Default::default()
        };
        let c = counters_of(&m, 16);
        assert_eq!(
            c.offload_blocks,
            TierCounts {
                host: 40,
                disk: 25,
                remote: 3
            }
        );
        assert_eq!(c.onboard_blocks.disk, 4);
        let s = samples_of(&m, 16, 8);
        let b = "kvtier_blocks_total";
        let off = |t| [("direction", "offload"), ("tier", t)];
        assert_eq!(sample(&s, b, &off("host")), 40.0);
        assert_eq!(sample(&s, b, &off("disk")), 25.0);
        assert_eq!(sample(&s, b, &off("remote")), 3.0);
        assert_eq!(
            sample(&s, b, &[("direction", "onboard"), ("tier", "disk")]),
            4.0
        );
        assert_eq!(
            sample(&s, "kvtier_hit_tokens_total", &[("tier", "disk")]),
            64.0
        );
    }
}
