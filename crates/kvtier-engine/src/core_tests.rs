//! What the scheduler reports to a connector, step by step, checked against TensorRT-LLM's
//! semantics (docs/arch/conn.md and docs/arch/trtllm.md) with a recording connector.
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use kvtier::connector::{BlockReuse, SchedulerStep, StepRecord};
use kvtier::{DeviceBlockId, RequestId};
use tokio::sync::mpsc::unbounded_channel;

use super::EngineCore;
use crate::api::{EngineConfig, GenerateEvent, GenerateRequest};
use crate::connector::{ConnectorStats, EngineConnector, RequestView};
use crate::model::Model;

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Match { computed: usize },
    Alloc { blocks: usize, external: usize },
    Step(SchedulerStep),
    Finished,
}

#[derive(Default)]
struct Log {
    calls: Vec<Call>,
}

struct Recorder {
    log: Arc<Mutex<Log>>,
    match_tokens: usize,
    is_async: bool,
    loading: Vec<RequestId>,
}

impl EngineConnector for Recorder {
    fn get_num_new_matched_tokens(
        &mut self,
        _r: RequestView<'_>,
        computed: usize,
    ) -> Result<(usize, bool), String> {
        self.log
            .lock()
            .unwrap()
            .calls
            .push(Call::Match { computed });
        Ok((self.match_tokens, self.is_async && self.match_tokens > 0))
    }
    fn update_state_after_alloc(
        &mut self,
        _r: RequestView<'_>,
        b: &[DeviceBlockId],
        external: usize,
    ) {
        self.log.lock().unwrap().calls.push(Call::Alloc {
            blocks: b.len(),
            external,
        });
    }
    fn build_connector_meta(&mut self, step: &SchedulerStep) -> Result<(), String> {
        if !step.records.is_empty() || !step.finished.is_empty() {
            self.log
                .lock()
                .unwrap()
                .calls
                .push(Call::Step(step.clone()));
        }
        Ok(())
    }
    fn request_finished(&mut self, _id: &RequestId, _b: &[DeviceBlockId]) -> BlockReuse {
        self.log.lock().unwrap().calls.push(Call::Finished);
        BlockReuse::Now
    }
    fn start_load_kv(&mut self) {}
    fn wait_for_layer_load(&mut self, _layer: usize) {}
    fn save_kv_layer(&mut self, _layer: usize) {}
    fn forward_done(&mut self) {}
    fn get_finished(
        &mut self,
        _f: &[RequestId],
        started: &[RequestId],
    ) -> (Vec<RequestId>, Vec<RequestId>) {
        self.loading.extend(started.iter().cloned());
        (Vec::new(), std::mem::take(&mut self.loading))
    }
    fn get_block_ids_with_load_errors(&mut self) -> Vec<DeviceBlockId> {
        Vec::new()
    }
    fn handle_preemptions(&mut self, _p: &[RequestId]) {}
    fn request_reset(&mut self, _id: &RequestId) {}
    fn has_pending(&self) -> bool {
        !self.loading.is_empty()
    }
    fn stats(&self) -> ConnectorStats {
        ConnectorStats::default()
    }
}

/// Run one request of `prompt_len` tokens to completion; return the connector calls.
fn run(
    prompt_len: usize,
    chunk: usize,
    max_tokens: usize,
    match_tokens: usize,
    is_async: bool,
) -> Vec<Call> {
    let mut cfg = EngineConfig::builtin(0);
    cfg.max_batch_tokens = chunk;
    let mut core =
        EngineCore::new(&cfg, Model::builtin(0), "m", Arc::new(AtomicUsize::new(1))).unwrap();
    let log = Arc::new(Mutex::new(Log::default()));
    core.attach_connector(Box::new(Recorder {
        log: log.clone(),
        match_tokens,
        is_async,
        loading: Vec::new(),
    }));
    let (tx, mut rx) = unbounded_channel();
    let mut req = GenerateRequest::new(
        (0..prompt_len as u32).map(|i| i % 250).collect(),
        max_tokens,
    );
    req.ignore_eos = true;
    core.add_request(RequestId::from("r"), req, tx);
    let mut done = false;
    for _ in 0..100 {
        core.step();
        core.flush_events();
        while let Ok(ev) = rx.try_recv() {
            done |= matches!(ev, GenerateEvent::Done { .. });
        }
        if done {
            break;
        }
    }
    assert!(done);
    core.step(); // reports the finished id
    let calls = log.lock().unwrap().calls.clone();
    calls
}

fn records(calls: &[Call]) -> Vec<StepRecord> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Step(s) => Some(s.records.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn worked_example_block16_prompt100_chunk64() {
    let calls = run(100, 64, 3, 0, false);
    assert_eq!(calls[0], Call::Match { computed: 0 });
    // Blocks for the first chunk only (64 tokens = 4 blocks), allocated after matching.
    assert_eq!(
        calls[1],
        Call::Alloc {
            blocks: 4,
            external: 0
        }
    );
    let r = records(&calls);
    let shape: Vec<(bool, usize, usize, usize, usize)> = r
        .iter()
        .map(|x| {
            (
                x.is_new,
                x.new_tokens.len(),
                x.new_block_ids.len(),
                x.num_computed_tokens,
                x.num_scheduled_tokens,
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (true, 100, 4, 0, 64), // new_requests: whole prompt, first chunk
            (false, 0, 3, 64, 36), // cached: rest of the context (blocks 4..7 cover 100 tokens)
            (false, 1, 0, 100, 1), // generation: the sampled token, computed = len - 1
            (false, 1, 0, 101, 1),
        ]
    );
    assert_eq!(calls.iter().filter(|c| **c == Call::Finished).count(), 1);
    let last = calls.iter().rev().find_map(|c| match c {
        Call::Step(s) => Some(s.clone()),
        _ => None,
    });
    assert_eq!(last.unwrap().finished, vec![RequestId::from("r")]);
}

#[test]
fn connector_matched_tokens_are_subtracted_from_the_first_computed_position() {
    for is_async in [false, true] {
        let calls = run(100, 64, 2, 32, is_async);
        assert_eq!(calls[0], Call::Match { computed: 0 });
        // 32 matched + a 64-token chunk = 6 blocks.
        assert_eq!(
            calls[1],
            Call::Alloc {
                blocks: if is_async { 2 } else { 6 },
                external: 32
            }
        );
        let r = records(&calls);
        assert!(r[0].is_new);
        assert_eq!(
            (r[0].num_computed_tokens, r[0].num_scheduled_tokens),
            (0, 64),
            "async {is_async}"
        );
        assert_eq!(
            (r[1].num_computed_tokens, r[1].num_scheduled_tokens),
            (96, 4),
            "async {is_async}"
        );
        assert_eq!(r.iter().filter(|x| x.is_new).count(), 1);
    }
}

/// Regression (#28): a request whose client went away was counted as finished. It ends at the
/// next token and is counted as aborted.
#[test]
fn a_request_whose_client_left_is_counted_as_aborted() {
    let cfg = EngineConfig::builtin(0);
    let mut core =
        EngineCore::new(&cfg, Model::builtin(0), "m", Arc::new(AtomicUsize::new(1))).unwrap();
    let (tx, rx) = unbounded_channel();
    let mut req = GenerateRequest::new((0..40u32).collect(), 50);
    req.ignore_eos = true;
    core.add_request(RequestId::from("gone"), req, tx);
    core.step();
    core.flush_events();
    drop(rx);
    for _ in 0..20 {
        core.step();
        core.flush_events();
    }
    assert_eq!(
        (
            core.metrics.requests_aborted,
            core.metrics.requests_finished
        ),
        (1, 0)
    );
}
