//! Drives one workload against one running backend and records every request.
//!
//! Invariants: requests are dispatched at the workload's rate (one every `1/qps` seconds, the next idle
//! stream in round-robin order; a stream never has two requests in flight, since its next prompt contains
//! its previous answer); TTFT is measured from the moment the request is handed to the engine; the set of
//! blocks already computed in this run (`seen`) only grows, so `seen_prefix_tokens` is the number of
//! prompt tokens an ideal cache would not recompute.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::hash::{sequence_hashes, HashSalt};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::backend::{Backend, CacheCounters, GenEvent, GenRequest, SubmitError};
use crate::bench::workload::{History, RequestKey, Script, Workload};

/// What happened to one request.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Which stream and turn it was.
    pub key: RequestKey,
    /// Tokens of its prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose full blocks were already computed earlier in this run.
    pub seen_prefix_tokens: usize,
    /// Prompt tokens the engine reported as served from a cache.
    pub cached_tokens: u32,
    /// Seconds from submit to first token.
    pub ttft_s: f64,
    /// Seconds from submit to the last event.
    pub e2e_s: f64,
    /// Seconds after the start of the run at which the request was submitted.
    pub submitted_at_s: f64,
    /// The generated tokens (compared across configurations, not written).
    #[serde(skip)]
    pub output: Vec<u32>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// One workload's run on one backend.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Every request, in submission order.
    pub records: Vec<RequestRecord>,
    /// How long the run took.
    pub wall: Duration,
    /// Engine counter deltas over the run.
    pub counters: CacheCounters,
}

/// Nearest-rank percentile of an ascending slice (`None` when empty).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Progress reporting to stderr (plain lines, at most one every `every`).
pub struct Progress {
    label: String,
    total: usize,
    last: Option<Instant>,
    every: Duration,
    quiet: bool,
}

impl Progress {
    /// A progress reporter for `total` requests.
    pub fn new(label: String, total: usize, quiet: bool) -> Self {
        Progress {
            label,
            total,
            last: None,
            every: Duration::from_secs(2),
            quiet,
        }
    }

    fn tick(&mut self, done: usize, started: Instant, ttfts: &[f64]) {
        if self.quiet {
            return;
        }
        let now = Instant::now();
        let due = self
            .last
            .is_none_or(|l| now.duration_since(l) >= self.every);
        if !due && done != self.total {
            return;
        }
        self.last = Some(now);
        let mut sorted = ttfts.to_vec();
        sorted.sort_by(f64::total_cmp);
        let p50 = percentile(&sorted, 50.0).unwrap_or(0.0);
        eprintln!(
            "  [{}] {done}/{} requests, {:.1}s, TTFT p50 so far {:.1} ms",
            self.label,
            self.total,
            started.elapsed().as_secs_f64(),
            p50 * 1e3
        );
    }
}

struct Finished {
    stream: usize,
    prompt: Vec<u32>,
    record: RequestRecord,
}

async fn one_request(
    backend: Arc<dyn Backend>,
    key: RequestKey,
    prompt: Vec<u32>,
    max_tokens: u32,
    seen_prefix_tokens: usize,
    t0: Instant,
) -> (Vec<u32>, RequestRecord) {
    let submitted = Instant::now();
    let mut record = RequestRecord {
        key,
        prompt_tokens: prompt.len(),
        seen_prefix_tokens,
        cached_tokens: 0,
        ttft_s: 0.0,
        e2e_s: 0.0,
        submitted_at_s: submitted.duration_since(t0).as_secs_f64(),
        output: Vec::new(),
        error: None,
    };
    let req = GenRequest {
        prompt: prompt.clone(),
        max_tokens,
        ignore_eos: true,
        prefilled: None,
    };
    // The engine may refuse when its queue is full: back off and retry (bounded), counting the wait.
    let mut rx = None;
    for _ in 0..600 {
        match backend.submit(req.clone()) {
            Ok(r) => {
                rx = Some(r);
                break;
            }
            Err(SubmitError::Overloaded(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => {
                record.error = Some(e.to_string());
                break;
            }
        }
    }
    let Some(mut rx) = rx else {
        record
            .error
            .get_or_insert_with(|| "engine stayed overloaded for 30 s".into());
        return (prompt, record);
    };
    let mut ttft = None;
    loop {
        match rx.recv().await {
            Some(GenEvent::Token(t)) => {
                ttft.get_or_insert_with(|| submitted.elapsed());
                record.output.push(t);
            }
            Some(GenEvent::Done(done)) => {
                record.cached_tokens = done.cached_tokens;
                break;
            }
            Some(GenEvent::Error(e)) => {
                record.error = Some(e);
                break;
            }
            None => {
                record.error = Some("engine dropped the request".into());
                break;
            }
        }
    }
    record.e2e_s = submitted.elapsed().as_secs_f64();
    record.ttft_s = ttft.map_or(record.e2e_s, |t| t.as_secs_f64());
    (prompt, record)
}

/// Runs `workload` (content `script`) on `backend`.
pub async fn run(
    backend: Arc<dyn Backend>,
    workload: &Workload,
    script: &Script,
    progress: &mut Progress,
) -> RunResult {
    let block_size = backend.block_size().max(1);
    let salt = HashSalt(0);
    let before = backend.cache_counters();
    let interval = Duration::from_secs_f64(1.0 / workload.qps().max(1e-3));
    let total = workload.num_requests();
    let streams = script.streams();
    let mut history = vec![History::default(); streams];
    let mut busy = vec![false; streams];
    let mut seen: HashSet<u128> = HashSet::new();
    let mut records = Vec::with_capacity(total);
    let mut ttfts = Vec::with_capacity(total);
    let (tx, mut rx) = mpsc::unbounded_channel::<Finished>();
    let t0 = Instant::now();
    let mut next_tick = t0;
    let mut cursor = 0usize;
    let mut dispatched = 0usize;

    while records.len() < total {
        // Pick the next idle stream with turns left, round-robin.
        let pick = if dispatched < total {
            (0..streams)
                .map(|i| (cursor + i) % streams)
                .find(|&s| !busy[s] && history[s].next_turn < script.turns(s))
        } else {
            None
        };
        match pick {
            Some(s) if Instant::now() >= next_tick => {
                cursor = s + 1;
                busy[s] = true;
                dispatched += 1;
                let prompt = history[s].prompt(script, s);
                let hashes = sequence_hashes(salt, &prompt, block_size);
                let seen_blocks = hashes.iter().take_while(|h| seen.contains(&h.0)).count();
                let key = RequestKey {
                    stream: s,
                    turn: history[s].next_turn,
                };
                let backend = backend.clone();
                let tx = tx.clone();
                let max_tokens = script.answer_tokens;
                tokio::spawn(async move {
                    let (prompt, record) = one_request(
                        backend,
                        key,
                        prompt,
                        max_tokens,
                        seen_blocks * block_size,
                        t0,
                    )
                    .await;
                    let _ = tx.send(Finished {
                        stream: s,
                        prompt,
                        record,
                    });
                });
                next_tick += interval;
            }
            Some(_) => {
                // Wait for the tick or for a completion, whichever comes first.
                tokio::select! {
                    _ = tokio::time::sleep_until(next_tick.into()) => {}
                    f = rx.recv() => if let Some(f) = f { finish(f, &mut history, &mut busy, &mut seen, &mut records, &mut ttfts, salt, block_size); progress.tick(records.len(), t0, &ttfts); },
                }
            }
            None => {
                let Some(f) = rx.recv().await else { break };
                finish(
                    f,
                    &mut history,
                    &mut busy,
                    &mut seen,
                    &mut records,
                    &mut ttfts,
                    salt,
                    block_size,
                );
                progress.tick(records.len(), t0, &ttfts);
                // An idle arrival slot is not banked: the schedule resumes from now.
                if next_tick < Instant::now() {
                    next_tick = Instant::now();
                }
            }
        }
    }
    let wall = t0.elapsed();
    records.sort_by_key(|r| r.key);
    RunResult {
        records,
        wall,
        counters: backend.cache_counters().since(before),
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    f: Finished,
    history: &mut [History],
    busy: &mut [bool],
    seen: &mut HashSet<u128>,
    records: &mut Vec<RequestRecord>,
    ttfts: &mut Vec<f64>,
    salt: HashSalt,
    block_size: usize,
) {
    let s = f.stream;
    busy[s] = false;
    // The engine holds KV for the prompt and every generated token except the last (never fed back).
    let mut full = f.prompt.clone();
    full.extend_from_slice(&f.record.output[..f.record.output.len().saturating_sub(1)]);
    for h in sequence_hashes(salt, &full, block_size) {
        seen.insert(h.0);
    }
    history[s].answered(f.prompt, &f.record.output);
    ttfts.push(f.record.ttft_s);
    records.push(f.record);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::bench::workload::{ChatParams, DocQaParams};

    #[tokio::test]
    async fn chat_run_records_every_request_with_growing_history() {
        let w = Workload::Chat(ChatParams {
            users: 3,
            rounds: 3,
            system_tokens: 8,
            question_tokens: 4,
            answer_tokens: 3,
            qps: 500.0,
        });
        let script = Script::new(&w, 3, 32, 127);
        let b: Arc<dyn Backend> = Arc::new(FakeBackend::new());
        let mut p = Progress::new("t".into(), 9, true);
        let r = run(b, &w, &script, &mut p).await;
        assert_eq!(r.records.len(), 9);
        for rec in &r.records {
            assert!(rec.error.is_none());
            assert_eq!(rec.output.len(), 3);
            assert_eq!(rec.prompt_tokens, 8 + rec.key.turn * 7 + 4);
        }
        // Round 0 of the first user saw nothing; later rounds saw at least the system prompt's full blocks
        // (block size 4 -> 8 tokens) and their own history.
        let first = &r.records[0];
        assert_eq!((first.key.stream, first.key.turn), (0, 0));
        let last = r
            .records
            .iter()
            .find(|x| x.key == RequestKey { stream: 0, turn: 2 })
            .unwrap();
        assert!(
            last.seen_prefix_tokens >= 8 + 7,
            "{}",
            last.seen_prefix_tokens
        );
    }

    #[tokio::test]
    async fn docqa_outputs_are_deterministic() {
        let w = Workload::DocQa(DocQaParams {
            docs: 2,
            doc_tokens: 12,
            questions_per_doc: 2,
            question_tokens: 2,
            answer_tokens: 2,
            qps: 1000.0,
        });
        let script = Script::new(&w, 3, 32, 127);
        let mut outs = Vec::new();
        for _ in 0..2 {
            let b: Arc<dyn Backend> = Arc::new(FakeBackend::new());
            let mut p = Progress::new("t".into(), 4, true);
            let r = run(b, &w, &script, &mut p).await;
            outs.push(
                r.records
                    .iter()
                    .map(|x| (x.key, x.output.clone()))
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(outs[0], outs[1]);
        assert_eq!(outs[0].len(), 4);
    }
}
