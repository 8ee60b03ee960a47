//! The synchronous engine core: admission, continuous batching with chunked prefill, the G1
//! prefix cache, recompute-style preemption, the forward pass, greedy sampling, and the
//! connector calls in TensorRT-LLM's order.
//!
//! Invariants:
//! - every running request has at least one token to compute (`num_computed < tokens.len()`);
//! - one step computes at most `max_batch_tokens` tokens; a request's chunk is
//!   `min(remaining, budget left)`, so a generation request gets exactly 1;
//! - a request is reported to the connector as new exactly once, then as cached;
//! - blocks whose kvtier load failed are recomputed, and a token sampled from a step that used
//!   them is discarded;
//! - blocks of a request are freed only when no transfer can touch them (connector said so);
//! - with the prefix cache off no block is ever registered, so no request matches another's
//!   blocks: every token is computed or loaded by the connector.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvtier::connector::{SchedulerStep, StepRecord};
use kvtier::hash::HashSalt;
use kvtier::{DeviceBlockId, RequestId};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{
    EngineConfig, EngineError, EngineMetrics, FinishReason, GenerateEvent, GenerateRequest, Role,
};
use crate::block_pool::BlockPool;
use crate::connector::{EngineConnector, RequestView};
use crate::kernels::argmax;
use crate::kv_cache::KvCache;
use crate::model::{LayerHooks, Model, SeqChunk};
use crate::request::{Outbox, Request};

pub(crate) struct EngineCore {
    /// Declared (hence dropped) before `kv`: the connector's transfers read and write `kv`'s
    /// memory, and its drop waits for them.
    connector: Option<Box<dyn EngineConnector>>,
    model: Model,
    kv: KvCache,
    pool: BlockPool,
    salt: HashSalt,
    block_size: usize,
    max_num_seqs: usize,
    max_batch_tokens: usize,
    /// G1 prefix cache on: full computed blocks are registered and matched across requests.
    prefix_cache: bool,
    role: Role,
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    loading: Vec<Request>,
    saving: Vec<Request>,
    /// Prefill role: requests whose Done waits for their save.
    done_after_save: HashSet<RequestId>,
    /// Device blocks whose kvtier load failed and that no request has rolled back over yet.
    load_errors: HashSet<u32>,
    finished_ids: Vec<RequestId>,
    newly_saving: Vec<RequestId>,
    newly_loading: Vec<RequestId>,
    pub metrics: EngineMetrics,
    /// Events of this step, delivered by `flush_events` after the metrics are published.
    outbox: Outbox,
    next_seq: u64,
    /// Requests submitted but not admitted (shared with the handle for back-pressure).
    pending: Arc<AtomicUsize>,
}

struct ConnHooks<'a>(Option<&'a mut Box<dyn EngineConnector>>);

impl LayerHooks for ConnHooks<'_> {
    fn before_layer(&mut self, layer: usize) {
        if let Some(c) = self.0.as_mut() {
            c.wait_for_layer_load(layer);
        }
    }
    fn after_layer(&mut self, layer: usize) {
        if let Some(c) = self.0.as_mut() {
            c.save_kv_layer(layer);
        }
    }
}

fn dev_ids(blocks: &[u32]) -> Vec<DeviceBlockId> {
    blocks.iter().map(|b| DeviceBlockId(*b)).collect()
}

impl EngineCore {
    pub(crate) fn new(
        cfg: &EngineConfig,
        model: Model,
        model_name: &str,
        pending: Arc<AtomicUsize>,
    ) -> Result<Self, EngineError> {
        let kv = KvCache::new(&model.config, cfg.num_device_blocks, cfg.block_size)?;
        Ok(EngineCore {
            model,
            kv,
            pool: BlockPool::new(cfg.num_device_blocks),
            salt: HashSalt::new(model_name, None, None),
            block_size: cfg.block_size,
            max_num_seqs: cfg.max_num_seqs,
            max_batch_tokens: cfg.max_batch_tokens,
            prefix_cache: cfg.enable_prefix_cache,
            role: cfg.role,
            waiting: VecDeque::new(),
            running: Vec::new(),
            loading: Vec::new(),
            saving: Vec::new(),
            done_after_save: HashSet::new(),
            load_errors: HashSet::new(),
            connector: None,
            finished_ids: Vec::new(),
            newly_saving: Vec::new(),
            newly_loading: Vec::new(),
            metrics: EngineMetrics::default(),
            outbox: Vec::new(),
            next_seq: 0,
            pending,
        })
    }

    /// The G1 pool (to register with kvtier).
    pub(crate) fn kv_cache(&self) -> &KvCache {
        &self.kv
    }

    pub(crate) fn attach_connector(&mut self, c: Box<dyn EngineConnector>) {
        self.connector = Some(c);
    }

    /// Requests that can make progress by stepping.
    pub(crate) fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.finished_ids.is_empty()
    }

    /// Requests waiting on the connector (loads or saves in flight).
    pub(crate) fn has_pending(&self) -> bool {
        !self.loading.is_empty()
            || !self.saving.is_empty()
            || self.connector.as_ref().is_some_and(|c| c.has_pending())
    }

    pub(crate) fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
    }

    /// Validate and queue a request. Invalid requests get an `Error` event, never a panic.
    pub(crate) fn add_request(
        &mut self,
        id: RequestId,
        req: GenerateRequest,
        tx: UnboundedSender<GenerateEvent>,
    ) {
        self.metrics.requests_submitted += 1;
        match self.build_request(id, req, tx.clone()) {
            Ok(Some(r)) => {
                self.metrics.prompt_tokens += r.prompt_len as u64;
                self.waiting.push_back(r);
            }
            Ok(None) => {
                self.pending.fetch_sub(1, Ordering::SeqCst);
            }
            Err(e) => {
                self.pending.fetch_sub(1, Ordering::SeqCst);
                self.metrics.requests_failed += 1;
                self.outbox.push((tx, GenerateEvent::Error(e.to_string())));
            }
        }
    }

    fn build_request(
        &mut self,
        id: RequestId,
        req: GenerateRequest,
        tx: UnboundedSender<GenerateEvent>,
    ) -> Result<Option<Request>, EngineError> {
        let c = &self.model.config;
        let max_len = c.max_position_embeddings;
        let bad = |s: String| Err(EngineError::InvalidRequest(s));
        if req.prompt.is_empty() {
            return bad("empty prompt".into());
        }
        if req.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        let mut tokens = req.prompt.clone();
        if let Some(p) = &req.prefilled {
            tokens.push(p.first_token);
        }
        if let Some(t) = tokens.iter().find(|t| **t as usize >= c.vocab_size) {
            return bad(format!(
                "token id {t} is outside the vocabulary ({})",
                c.vocab_size
            ));
        }
        if req.prompt.len() >= max_len {
            return bad(format!(
                "prompt of {} tokens does not fit the maximum model length {max_len}",
                req.prompt.len()
            ));
        }
        let prompt_len = req.prompt.len();
        let stop_after_first = self.role == Role::Prefill && req.prefilled.is_none();
        let mut max_total_len = (prompt_len + req.max_tokens).min(max_len);
        if stop_after_first {
            max_total_len = max_total_len.min(prompt_len + 1);
        }
        let blocks_needed = max_total_len.div_ceil(self.block_size);
        if blocks_needed > self.pool.capacity() {
            return bad(format!(
                "request needs up to {blocks_needed} KV blocks but the engine has {}",
                self.pool.capacity()
            ));
        }
        let generated = usize::from(req.prefilled.is_some());
        let seq = self.next_seq;
        self.next_seq += 1;
        let r = Request {
            id,
            seq,
            tokens,
            prompt_len,
            max_total_len,
            ignore_eos: req.ignore_eos,
            stop_after_first,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            num_registered: 0,
            generated,
            cached_tokens: 0,
            admitted_once: false,
            tx,
            reported_once: false,
            tokens_reported: 0,
            blocks_reported: 0,
            resumed: false,
            ext_subtract: 0,
            pending_load: 0,
            finish: None,
        };
        if let Some(p) = &req.prefilled {
            self.metrics.generated_tokens += 1;
            if !r.send(&mut self.outbox, GenerateEvent::Token(p.first_token)) {
                return Ok(None);
            }
            if let Some(reason) = self.finish_reason(&r, p.first_token, req.max_tokens) {
                r.send(
                    &mut self.outbox,
                    GenerateEvent::Done {
                        finish_reason: reason,
                        usage: r.usage(),
                    },
                );
                self.metrics.requests_finished += 1;
                return Ok(None);
            }
        }
        Ok(Some(r))
    }

    fn finish_reason(
        &self,
        r: &Request,
        last: u32,
        user_max_tokens: usize,
    ) -> Option<FinishReason> {
        if !r.ignore_eos && self.model.config.eos_token_ids.contains(&last) {
            return Some(FinishReason::Stop);
        }
        if r.tokens.len() >= r.max_total_len {
            let model_max = self.model.config.max_position_embeddings;
            if r.stop_after_first && user_max_tokens > 1 && r.tokens.len() < model_max {
                return Some(FinishReason::Prefilled);
            }
            return Some(FinishReason::Length);
        }
        None
    }

    /// One engine step. Returns the number of tokens computed.
    pub(crate) fn step(&mut self) -> usize {
        self.poll_connector();
        let plan = self.schedule();
        let records = self.build_records(&plan);
        if let Some(c) = self.connector.as_mut() {
            if !records.is_empty() || !self.finished_ids.is_empty() {
                let step = SchedulerStep {
                    records,
                    finished: std::mem::take(&mut self.finished_ids),
                };
                if let Err(e) = c.build_connector_meta(&step) {
                    tracing::error!(error = %e, "build_connector_meta failed");
                }
            }
        } else {
            self.finished_ids.clear();
        }
        if plan.is_empty() {
            self.refresh_gauges();
            return 0;
        }
        self.metrics.steps += 1;
        if let Some(c) = self.connector.as_mut() {
            c.start_load_kv();
        }
        let by_id: HashMap<&RequestId, usize> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, r)| (&r.id, i))
            .collect();
        let idx: Vec<(usize, usize)> = plan
            .iter()
            .filter_map(|(id, n)| by_id.get(id).map(|i| (*i, *n)))
            .collect();
        drop(by_id);
        let chunks: Vec<SeqChunk<'_>> = idx
            .iter()
            .map(|&(i, n)| {
                let r = &self.running[i];
                SeqChunk {
                    tokens: &r.tokens[r.num_computed..r.num_computed + n],
                    start_pos: r.num_computed,
                    block_table: &r.blocks,
                    want_logits: r.num_computed + n == r.tokens.len(),
                }
            })
            .collect();
        let mut hooks = ConnHooks(self.connector.as_mut());
        let result = self.model.forward(&mut self.kv, &chunks, &mut hooks);
        drop(chunks);
        if let Some(c) = self.connector.as_mut() {
            c.forward_done();
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // Not reachable with a consistent scheduler; fail the batch rather than panic.
                tracing::error!(error = %e, "forward pass failed");
                for &(i, _) in &idx {
                    let r = &mut self.running[i];
                    r.send(
                        &mut self.outbox,
                        GenerateEvent::Error(format!("internal error: {e}")),
                    );
                    r.finish = Some(FinishReason::Length);
                }
                self.metrics.requests_failed += idx.len() as u64;
                self.reap_finished(true);
                return 0;
            }
        };
        if let Some(c) = self.connector.as_mut() {
            self.load_errors
                .extend(c.get_block_ids_with_load_errors().into_iter().map(|b| b.0));
        }
        let mut computed = 0;
        for (&(i, n), lg) in idx.iter().zip(logits) {
            computed += n;
            self.metrics.computed_tokens += n as u64;
            let bs = self.block_size;
            let r = &mut self.running[i];
            if !self.load_errors.is_empty() {
                // The KV this step attended over came partly from failed loads: roll back to
                // the first bad block and recompute from there; discard this step's output.
                let limit = r.num_computed.div_ceil(bs).min(r.blocks.len());
                if let Some(bad) = r.blocks[..limit]
                    .iter()
                    .position(|b| self.load_errors.contains(b))
                {
                    let mut failed = 0;
                    for b in &r.blocks[bad..limit] {
                        failed += usize::from(self.load_errors.remove(b));
                    }
                    let back = bad * bs;
                    tracing::warn!(request = %r.id, from = back, to = r.num_computed, "kvtier load failed; recomputing");
                    self.metrics.load_failures += failed as u64;
                    self.metrics.recomputed_tokens += (r.num_computed - back) as u64;
                    // Matched tokens that are recomputed were not served by kvtier: neither the
                    // request's usage nor the hit counter may claim them (#13).
                    let lost = (r.num_computed - back).min(r.ext_subtract);
                    self.metrics.kvtier_matched_tokens = self
                        .metrics
                        .kvtier_matched_tokens
                        .saturating_sub(lost as u64);
                    r.cached_tokens = r.cached_tokens.min(back);
                    r.num_computed = back;
                    r.num_registered = r.num_registered.min(bad);
                    r.forget_connector_view();
                    if let Some(c) = self.connector.as_mut() {
                        c.request_reset(&r.id);
                    }
                    continue;
                }
            }
            r.num_computed += n;
            r.update_hashes(self.salt, bs);
            let full = if self.prefix_cache {
                r.num_computed / bs
            } else {
                0
            };
            while r.num_registered < full.min(r.hashes.len()) {
                self.pool
                    .register(r.blocks[r.num_registered], r.hashes[r.num_registered]);
                r.num_registered += 1;
            }
            if let Some(lg) = lg {
                let tok = argmax(&lg);
                r.tokens.push(tok);
                r.generated += 1;
                self.metrics.generated_tokens += 1;
                if !r.send(&mut self.outbox, GenerateEvent::Token(tok)) {
                    r.finish = Some(FinishReason::Aborted);
                    continue;
                }
                let user_max = r.max_total_len - r.prompt_len;
                let model_max = self.model.config.max_position_embeddings;
                let eos = !r.ignore_eos && self.model.config.eos_token_ids.contains(&tok);
                r.finish = if eos {
                    Some(FinishReason::Stop)
                } else if r.tokens.len() >= r.max_total_len {
                    if r.stop_after_first && r.tokens.len() < model_max && user_max >= 1 {
                        Some(FinishReason::Prefilled)
                    } else {
                        Some(FinishReason::Length)
                    }
                } else {
                    None
                };
            }
        }
        self.reap_finished(false);
        self.refresh_gauges();
        computed
    }

    /// Move finished requests out of `running`: free or hold their blocks, send `Done`.
    fn reap_finished(&mut self, failed: bool) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_none() {
                i += 1;
                continue;
            }
            let r = self.running.remove(i);
            let reason = r.finish.unwrap_or(FinishReason::Length);
            self.finished_ids.push(r.id.clone());
            let keep = match self.connector.as_mut() {
                Some(c) => c.request_finished(&r.id, &dev_ids(&r.blocks)).must_wait(),
                None => false,
            };
            if !failed {
                self.metrics.count_end(reason);
            }
            let defer_done = keep && reason == FinishReason::Prefilled;
            if !failed && !defer_done {
                r.send(
                    &mut self.outbox,
                    GenerateEvent::Done {
                        finish_reason: reason,
                        usage: r.usage(),
                    },
                );
            }
            if keep {
                if defer_done {
                    self.done_after_save.insert(r.id.clone());
                }
                self.newly_saving.push(r.id.clone());
                self.saving.push(r);
            } else {
                self.release_blocks(&r.blocks);
            }
        }
    }

    fn refresh_gauges(&mut self) {
        self.metrics.queue_depth = self.waiting.len() as u64;
        self.metrics.running = (self.running.len() + self.loading.len()) as u64;
        self.metrics.free_device_blocks = self.pool.num_free() as u64;
        if let Some(c) = self.connector.as_ref() {
            let s = c.stats();
            self.metrics.offloaded_blocks = s.offloaded_blocks;
            self.metrics.onboarded_blocks = s.onboarded_blocks;
            self.metrics.kvtier_matched_tokens_host = s.matched_tokens_host;
            self.metrics.kvtier_matched_tokens_disk = s.matched_tokens_disk;
            self.metrics.kvtier_matched_tokens_remote = s.matched_tokens_remote;
            self.metrics.kvtier_jobs_in_flight = s.jobs_in_flight;
            self.metrics.spilled_disk_blocks = s.spilled_disk_blocks;
            self.metrics.remote_put_blocks = s.remote_put_blocks;
            self.metrics.offloaded_host_blocks = s.offloaded_host_blocks;
            self.metrics.offloaded_disk_blocks = s.offloaded_disk_blocks;
            self.metrics.offloaded_remote_blocks = s.offloaded_remote_blocks;
            self.metrics.kvtier = s.kvtier;
        }
    }

    /// Finished saves and loads, and load errors of async loads.
    fn poll_connector(&mut self) {
        let Some(c) = self.connector.as_mut() else {
            return;
        };
        if self.saving.is_empty() && self.loading.is_empty() && !c.has_pending() {
            return;
        }
        let (saved, loaded) = c.get_finished(&self.newly_saving, &self.newly_loading);
        self.newly_saving.clear();
        self.newly_loading.clear();
        self.load_errors
            .extend(c.get_block_ids_with_load_errors().into_iter().map(|b| b.0));
        for id in saved {
            if let Some(p) = self.saving.iter().position(|r| r.id == id) {
                let r = self.saving.swap_remove(p);
                self.release_blocks(&r.blocks);
                if self.done_after_save.remove(&r.id) {
                    r.send(
                        &mut self.outbox,
                        GenerateEvent::Done {
                            finish_reason: FinishReason::Prefilled,
                            usage: r.usage(),
                        },
                    );
                }
            }
        }
        let bs = self.block_size;
        for id in loaded {
            let Some(p) = self.loading.iter().position(|r| r.id == id) else {
                continue;
            };
            let mut r = self.loading.swap_remove(p);
            let end = (r.num_computed + r.pending_load)
                .div_ceil(bs)
                .min(r.blocks.len());
            let start = r.num_computed / bs;
            let mut usable = r.pending_load;
            if let Some(bad) = r.blocks[start..end]
                .iter()
                .position(|b| self.load_errors.contains(b))
            {
                let mut failed = 0;
                for b in &r.blocks[start + bad..end] {
                    failed += usize::from(self.load_errors.remove(b));
                }
                usable = ((start + bad) * bs).saturating_sub(r.num_computed);
                tracing::warn!(request = %r.id, "kvtier async load failed; recomputing");
                self.metrics.load_failures += failed as u64;
                self.metrics.recomputed_tokens += (r.pending_load - usable) as u64;
                // As in the synchronous path: recomputed tokens are no hit (#13).
                self.metrics.kvtier_matched_tokens = self
                    .metrics
                    .kvtier_matched_tokens
                    .saturating_sub((r.pending_load - usable) as u64);
                r.cached_tokens = r.cached_tokens.min(r.num_computed + usable);
                // The connector's view (position past the matched blocks) no longer holds:
                // start it over from what is really computed, with a full report of the blocks.
                r.forget_connector_view();
                if let Some(c) = self.connector.as_mut() {
                    c.request_reset(&r.id);
                }
            } else {
                r.ext_subtract = r.pending_load;
            }
            r.num_computed += usable;
            r.pending_load = 0;
            self.insert_running(r);
        }
    }

    /// Give a request's blocks back; pending load errors on them no longer concern anybody.
    fn release_blocks(&mut self, blocks: &[u32]) {
        if !self.load_errors.is_empty() {
            for b in blocks {
                self.load_errors.remove(b);
            }
        }
        self.pool.release(blocks);
    }

    fn insert_running(&mut self, r: Request) {
        let pos = self.running.partition_point(|x| x.seq < r.seq);
        self.running.insert(pos, r);
    }

    fn insert_waiting(&mut self, r: Request) {
        let pos = self.waiting.partition_point(|x| x.seq < r.seq);
        self.waiting.insert(pos, r);
    }

    fn preempt(&mut self, mut r: Request) {
        tracing::debug!(request = %r.id, "preempting (recompute)");
        if let Some(c) = self.connector.as_mut() {
            c.handle_preemptions(std::slice::from_ref(&r.id));
        }
        self.release_blocks(&r.blocks);
        r.blocks.clear();
        r.num_computed = 0;
        r.num_registered = 0;
        r.blocks_reported = 0;
        r.ext_subtract = 0;
        r.resumed = r.reported_once;
        self.metrics.preemptions += 1;
        self.pending.fetch_add(1, Ordering::SeqCst);
        self.insert_waiting(r);
    }

    /// Decide this step's batch: running requests first (oldest first, preempting the youngest
    /// when G1 is full), then new admissions while budget, sequence slots and blocks allow.
    fn schedule(&mut self) -> Vec<(RequestId, usize)> {
        let bs = self.block_size;
        let mut budget = self.max_batch_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (need, n) = {
                let r = &self.running[i];
                let n = (r.tokens.len() - r.num_computed).min(budget);
                (
                    (r.num_computed + n)
                        .div_ceil(bs)
                        .saturating_sub(r.blocks.len()),
                    n,
                )
            };
            let mut ok = true;
            while self.pool.num_free() < need {
                if self.running.len() > i + 1 {
                    if let Some(victim) = self.running.pop() {
                        self.preempt(victim);
                        preempted = true;
                    }
                } else {
                    ok = false;
                    break;
                }
            }
            if !ok {
                break;
            }
            if need > 0 {
                let Some(new) = self.pool.allocate(need) else {
                    break;
                };
                self.running[i].blocks.extend(new);
            }
            plan.push((self.running[i].id.clone(), n));
            budget -= n;
            i += 1;
        }
        if preempted {
            return plan;
        }
        while budget > 0 && self.running.len() + self.loading.len() < self.max_num_seqs {
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            r.update_hashes(self.salt, bs);
            let max_match = if self.prefix_cache {
                (r.tokens.len() - 1) / bs
            } else {
                0
            };
            let g1 = self
                .pool
                .match_prefix(&r.hashes[..max_match.min(r.hashes.len())]);
            let g1_tokens = g1.len() * bs;
            let (ext, is_async) = match self.connector.as_mut() {
                Some(c) => match c.get_num_new_matched_tokens(
                    RequestView {
                        id: &r.id,
                        tokens: &r.tokens,
                    },
                    g1_tokens,
                ) {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!(request = %r.id, error = %e, "connector match failed; computing everything");
                        (0, false)
                    }
                },
                None => (0, false),
            };
            let ext = if g1_tokens + ext >= r.tokens.len() || !ext.is_multiple_of(bs) {
                tracing::error!(request = %r.id, ext, g1_tokens, "connector matched an invalid token count; ignoring it");
                0
            } else {
                ext
            };
            let after = g1_tokens + ext;
            let n = if is_async && ext > 0 {
                0
            } else {
                (r.tokens.len() - after).min(budget)
            };
            let total = (after + n).div_ceil(bs).max(g1.len());
            let need = total - g1.len();
            let Some(new) = self.pool.allocate(need) else {
                self.pool.release(&g1);
                self.waiting.push_front(r);
                break;
            };
            self.pending.fetch_sub(1, Ordering::SeqCst);
            r.num_registered = g1.len();
            r.blocks = g1;
            r.blocks.extend(new);
            r.num_computed = g1_tokens;
            if !r.admitted_once {
                r.admitted_once = true;
                r.cached_tokens = after.min(r.prompt_len);
            }
            self.metrics.g1_prefix_hit_tokens += g1_tokens as u64;
            self.metrics.kvtier_matched_tokens += ext as u64;
            if let Some(c) = self.connector.as_mut() {
                c.update_state_after_alloc(
                    RequestView {
                        id: &r.id,
                        tokens: &r.tokens,
                    },
                    &dev_ids(&r.blocks),
                    ext,
                );
            }
            if is_async && ext > 0 {
                r.pending_load = ext;
                self.newly_loading.push(r.id.clone());
                self.loading.push(r);
                continue;
            }
            r.num_computed = after;
            r.ext_subtract = ext;
            plan.push((r.id.clone(), n));
            budget -= n;
            self.insert_running(r);
        }
        plan
    }

    /// The step contract for the scheduled requests, in TensorRT-LLM's terms.
    fn build_records(&mut self, plan: &[(RequestId, usize)]) -> Vec<StepRecord> {
        if self.connector.is_none() {
            return Vec::new();
        }
        let sched: HashMap<&RequestId, usize> = plan.iter().map(|(id, n)| (id, *n)).collect();
        let mut out = Vec::with_capacity(plan.len());
        for r in self.running.iter_mut() {
            let Some(&n) = sched.get(&r.id) else { continue };
            out.push(StepRecord {
                request_id: r.id.clone(),
                new_tokens: r.tokens[r.tokens_reported..].to_vec(),
                new_block_ids: dev_ids(&r.blocks[r.blocks_reported..]),
                num_computed_tokens: r.num_computed.saturating_sub(r.ext_subtract),
                num_scheduled_tokens: n,
                num_draft_tokens: 0,
                is_new: !r.reported_once,
                resumed_from_preemption: r.resumed,
            });
            r.reported_once = true;
            r.resumed = false;
            r.ext_subtract = 0;
            r.tokens_reported = r.tokens.len();
            r.blocks_reported = r.blocks.len();
        }
        out
    }

    /// Deliver the events queued since the last call.
    pub(crate) fn flush_events(&mut self) {
        for (tx, ev) in self.outbox.drain(..) {
            let _ = tx.send(ev);
        }
    }

    /// Fail every request (engine shutting down).
    pub(crate) fn abort_all(&mut self, why: &str) {
        for r in self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .chain(self.loading.drain(..))
        {
            r.send(&mut self.outbox, GenerateEvent::Error(why.to_owned()));
        }
        // Prefill requests still waiting for their KV to be saved never got their Done.
        for r in &self.saving {
            if self.done_after_save.contains(&r.id) {
                r.send(&mut self.outbox, GenerateEvent::Error(why.to_owned()));
            }
        }
        self.done_after_save.clear();
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
