//! Property: whatever the schedule - block size, G1 size (eviction, preemption), token budget
//! (chunking), sequence limit (batching), kvtier on or off, arrival order - every response equals
//! the response of the same prompt run alone on a roomy engine.
#![allow(clippy::unwrap_used)]
mod common;

use std::collections::HashMap;
use std::sync::Mutex;

use common::{request, run_all};
use kvtier::config::{KvtierConfig, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle};
use proptest::prelude::*;

const SEED: u64 = 41;

type Memo = HashMap<(Vec<u32>, usize), Vec<u32>>;

/// Reference answers, computed once per (prompt, max_tokens) on a roomy engine, alone.
fn reference(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    static CACHE: Mutex<Option<(EngineHandle, Memo)>> = Mutex::new(None);
    let mut g = CACHE.lock().unwrap();
    let (e, memo) = g.get_or_insert_with(|| {
        let mut c = EngineConfig::builtin(SEED);
        c.max_num_seqs = 1;
        (EngineHandle::start(c).unwrap(), HashMap::new())
    });
    memo.entry((prompt.to_vec(), max_tokens))
        .or_insert_with(|| {
            e.reset_prefix_cache();
            e.generate_blocking(request(prompt, max_tokens)).unwrap().0
        })
        .clone()
}

#[derive(Debug, Clone)]
struct Case {
    block_size: usize,
    num_device_blocks: usize,
    max_batch_tokens: usize,
    max_num_seqs: usize,
    kvtier_host_blocks: Option<u64>,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    repeat: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![4usize, 8, 16]),
        1usize..100,
        1usize..5,
        prop::option::of(4u64..64),
        prop::collection::vec(prop::collection::vec(0u32..256, 1..60), 1..6),
        1usize..8,
        any::<bool>(),
        0usize..30,
    )
        .prop_map(
            |(block_size, budget, seqs, host, mut prompts, max_tokens, repeat, extra_blocks)| {
                // Share prefixes between some prompts so the caches have something to find.
                if prompts.len() > 1 {
                    let head: Vec<u32> = prompts[0].iter().copied().take(20).collect();
                    for p in prompts.iter_mut().skip(1).step_by(2) {
                        let mut q = head.clone();
                        q.extend_from_slice(p);
                        *p = q;
                    }
                }
                let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(1) + max_tokens;
                Case {
                    block_size,
                    num_device_blocks: longest.div_ceil(block_size) + extra_blocks,
                    max_batch_tokens: budget,
                    max_num_seqs: seqs,
                    kvtier_host_blocks: host,
                    prompts,
                    max_tokens,
                    repeat,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_schedule_gives_the_solo_answer(c in case()) {
        let mut cfg = EngineConfig::builtin(SEED);
        cfg.block_size = c.block_size;
        cfg.num_device_blocks = c.num_device_blocks;
        cfg.max_batch_tokens = c.max_batch_tokens;
        cfg.max_num_seqs = c.max_num_seqs;
        if let Some(h) = c.kvtier_host_blocks {
            let mut kv = KvtierConfig::default();
            kv.host.size = Some(TierSize::Blocks(h));
            cfg.connector = Some(ConnectorSetup::new(kv));
        }
        let e = EngineHandle::start(cfg).unwrap();
        let rounds = if c.repeat { 2 } else { 1 };
        for round in 0..rounds {
            let got = run_all(&e, c.prompts.iter().map(|p| request(p, c.max_tokens)).collect());
            for (p, (toks, _)) in c.prompts.iter().zip(&got) {
                prop_assert_eq!(toks, &reference(p, c.max_tokens), "round {}", round);
            }
            e.reset_prefix_cache();
        }
    }
}
