//! Helpers shared by the integration tests: prompts, running a batch of requests concurrently.
#![allow(dead_code)]
#![allow(clippy::unwrap_used)]

use kvtier_engine::{EngineConfig, EngineHandle, FinishReason, GenerateEvent, GenerateRequest};

/// Deterministic pseudo-text prompts of varying lengths that share prefixes in groups.
pub(crate) fn prompts(n: usize, base_len: usize) -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..base_len as u32).map(|i| (i * 37 + 11) % 256).collect();
    (0..n)
        .map(|i| {
            let mut p: Vec<u32> = if i % 2 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            let extra = 5 + (i * 13) % 40;
            p.extend((0..extra as u32).map(|j| (j * 101 + i as u32 * 7 + 3) % 256));
            p
        })
        .collect()
}

pub(crate) fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt.to_vec(), max_tokens);
    r.ignore_eos = true;
    r
}

/// Submit all requests at once, then collect every answer (tokens, finish reason).
pub(crate) fn run_all(
    engine: &EngineHandle,
    reqs: Vec<GenerateRequest>,
) -> Vec<(Vec<u32>, FinishReason)> {
    let rxs: Vec<_> = reqs
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut toks = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(GenerateEvent::Token(t)) => toks.push(t),
                    Some(GenerateEvent::Done { finish_reason, .. }) => {
                        return (toks, finish_reason)
                    }
                    Some(GenerateEvent::Error(e)) => panic!("request failed: {e}"),
                    None => panic!("stream closed without Done"),
                }
            }
        })
        .collect()
}

/// Run requests one at a time on a fresh engine: the reference answers.
pub(crate) fn reference(
    cfg: EngineConfig,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let mut cfg = cfg;
    cfg.max_num_seqs = 1;
    cfg.connector = None;
    let e = EngineHandle::start(cfg).unwrap();
    let out = prompts
        .iter()
        .map(|p| e.generate_blocking(request(p, max_tokens)).unwrap().0)
        .collect();
    e.shutdown();
    out
}

/// The tokens and finish reason of one streamed request (a streamed error or a closed stream fails
/// the test).
pub(crate) fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenerateEvent>,
) -> (Vec<u32>, FinishReason) {
    let mut toks = Vec::new();
    loop {
        match rx.blocking_recv() {
            Some(GenerateEvent::Token(t)) => toks.push(t),
            Some(GenerateEvent::Done { finish_reason, .. }) => return (toks, finish_reason),
            Some(GenerateEvent::Error(e)) => panic!("{e}"),
            None => panic!("closed"),
        }
    }
}
