//! Determinism of the engine without a connector: batch invariance, chunked prefill, preemption,
//! the G1 prefix cache, and that wrong KV really changes the output.
#![allow(clippy::unwrap_used)]
mod common;

use common::{prompts, reference, request, run_all};
use kvtier_engine::kv_cache::KvCache;
use kvtier_engine::model::{Model, NoHooks, SeqChunk};
use kvtier_engine::{
    EngineConfig, EngineError, EngineHandle, FinishReason, GenerateEvent, GenerateRequest,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn logits_alone(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let bs = 16;
    let mut kv = KvCache::new(&model.config, 32, bs).unwrap();
    let table: Vec<u32> = (0..prompt.len().div_ceil(bs) as u32).collect();
    let out = model
        .forward(
            &mut kv,
            &[SeqChunk {
                tokens: prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            }],
            &mut NoHooks,
        )
        .unwrap();
    out.into_iter().next().flatten().unwrap()
}

#[test]
fn logits_bits_do_not_depend_on_batch_composition() {
    let model = Model::builtin(3);
    let ps = prompts(5, 40);
    let alone: Vec<Vec<f32>> = ps.iter().map(|p| logits_alone(&model, p)).collect();
    // All five in one batch, in reverse order, with disjoint block tables.
    let bs = 16;
    let mut kv = KvCache::new(&model.config, 64, bs).unwrap();
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| {
            let n = p.len().div_ceil(bs) as u32;
            let t: Vec<u32> = (next..next + n).rev().collect(); // scattered, descending ids
            next += n;
            t
        })
        .collect();
    let batch: Vec<SeqChunk<'_>> = ps
        .iter()
        .zip(&tables)
        .rev()
        .map(|(p, t)| SeqChunk {
            tokens: p,
            start_pos: 0,
            block_table: t,
            want_logits: true,
        })
        .collect();
    let out = model.forward(&mut kv, &batch, &mut NoHooks).unwrap();
    for (i, lg) in out.into_iter().rev().enumerate() {
        assert_eq!(bits(&lg.unwrap()), bits(&alone[i]), "prompt {i}");
    }
}

#[test]
fn logits_bits_do_not_depend_on_chunking() {
    let model = Model::builtin(4);
    let p: Vec<u32> = (0..75u32).map(|i| (i * 31 + 5) % 256).collect();
    let whole = logits_alone(&model, &p);
    for chunk in [1usize, 7, 16, 33] {
        let bs = 16;
        let mut kv = KvCache::new(&model.config, 8, bs).unwrap();
        let table: Vec<u32> = vec![5, 2, 7, 0, 3];
        let mut last = None;
        let mut pos = 0;
        while pos < p.len() {
            let end = (pos + chunk).min(p.len());
            let out = model
                .forward(
                    &mut kv,
                    &[SeqChunk {
                        tokens: &p[pos..end],
                        start_pos: pos,
                        block_table: &table,
                        want_logits: end == p.len(),
                    }],
                    &mut NoHooks,
                )
                .unwrap();
            last = out.into_iter().next().flatten();
            pos = end;
        }
        assert_eq!(bits(&last.unwrap()), bits(&whole), "chunk {chunk}");
    }
}

#[test]
fn wrong_kv_changes_the_generated_tokens() {
    // Guards the weight scales: a cache that serves wrong KV must be visible in the output.
    let model = Model::builtin(0);
    let bs = 16;
    let mut changed = 0;
    for p in prompts(6, 48) {
        let good = logits_alone(&model, &p);
        let mut kv = KvCache::new(&model.config, 32, bs).unwrap();
        let table: Vec<u32> = (0..p.len().div_ceil(bs) as u32).collect();
        let split = bs; // compute block 0, corrupt it, then the rest
        model
            .forward(
                &mut kv,
                &[SeqChunk {
                    tokens: &p[..split],
                    start_pos: 0,
                    block_table: &table,
                    want_logits: false,
                }],
                &mut NoHooks,
            )
            .unwrap();
        for v in kv.block_mut(0).iter_mut() {
            *v = -*v * 0.5;
        }
        let bad = model
            .forward(
                &mut kv,
                &[SeqChunk {
                    tokens: &p[split..],
                    start_pos: split,
                    block_table: &table,
                    want_logits: true,
                }],
                &mut NoHooks,
            )
            .unwrap()
            .into_iter()
            .next()
            .flatten()
            .unwrap();
        if kvtier_engine::kernels::argmax(&good) != kvtier_engine::kernels::argmax(&bad) {
            changed += 1;
        }
    }
    assert!(
        changed >= 3,
        "only {changed}/6 next tokens changed with corrupted KV"
    );
}

fn cfg(seed: u64) -> EngineConfig {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 128;
    c
}

#[test]
fn concurrent_batches_match_sequential_runs() {
    let ps = prompts(8, 40);
    let want = reference(cfg(1), &ps, 12);
    let e = EngineHandle::start(cfg(1)).unwrap();
    let got = run_all(&e, ps.iter().map(|p| request(p, 12)).collect());
    for (i, (toks, reason)) in got.iter().enumerate() {
        assert_eq!(toks, &want[i], "prompt {i}");
        assert_eq!(*reason, FinishReason::Length);
    }
    let m = e.metrics();
    assert_eq!(m.requests_finished, 8);
    assert_eq!(m.generated_tokens, 8 * 12);
    // Batched: fewer steps than tokens computed one request at a time.
    assert!(m.steps < 8 * 12, "steps {}", m.steps);
}

#[test]
fn chunked_prefill_matches_unchunked() {
    let ps = prompts(6, 70);
    let want = reference(cfg(2), &ps, 8);
    for budget in [5usize, 16, 23] {
        let mut c = cfg(2);
        c.max_batch_tokens = budget;
        let e = EngineHandle::start(c).unwrap();
        let got = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
        for (i, (toks, _)) in got.iter().enumerate() {
            assert_eq!(toks, &want[i], "budget {budget} prompt {i}");
        }
    }
}

#[test]
fn preemption_recomputes_identically() {
    let ps = prompts(8, 40);
    let want = reference(cfg(5), &ps, 24);
    let mut c = cfg(5);
    c.num_device_blocks = 12; // far too small for 8 concurrent requests of ~5 blocks
    c.max_batch_tokens = 64;
    let e = EngineHandle::start(c).unwrap();
    let got = run_all(&e, ps.iter().map(|p| request(p, 24)).collect());
    for (i, (toks, _)) in got.iter().enumerate() {
        assert_eq!(toks, &want[i], "prompt {i}");
    }
    assert!(
        e.metrics().preemptions > 0,
        "the test did not force a preemption"
    );
}

#[test]
fn g1_prefix_cache_hits_and_matches() {
    let ps = prompts(6, 64);
    let want = reference(cfg(6), &ps, 10);
    let e = EngineHandle::start(cfg(6)).unwrap();
    let first = run_all(&e, ps.iter().map(|p| request(p, 10)).collect());
    let hits_before = e.metrics().g1_prefix_hit_tokens;
    let again = run_all(&e, ps.iter().map(|p| request(p, 10)).collect());
    let m = e.metrics();
    assert!(
        m.g1_prefix_hit_tokens > hits_before,
        "no G1 prefix hits on repeat"
    );
    for i in 0..ps.len() {
        assert_eq!(first[i].0, want[i]);
        assert_eq!(again[i].0, want[i]);
    }
    // After a reset nothing hits.
    e.reset_prefix_cache();
    let before = e.metrics().g1_prefix_hit_tokens;
    let p: Vec<u32> = ps[1].clone();
    assert_eq!(e.generate_blocking(request(&p, 10)).unwrap().0, want[1]);
    assert_eq!(e.metrics().g1_prefix_hit_tokens, before);
}

/// Prompt tokens plus generated tokens minus one: what a request costs with nothing reused.
fn full_cost(ps: &[Vec<u32>], max_tokens: usize) -> u64 {
    ps.iter().map(|p| (p.len() + max_tokens - 1) as u64).sum()
}

#[test]
fn prefix_cache_off_recomputes_every_prompt_with_identical_tokens() {
    let ps = prompts(6, 64);
    let want = reference(cfg(6), &ps, 10);
    let run_twice = |prefix_cache: bool| {
        let mut c = cfg(6);
        c.enable_prefix_cache = prefix_cache;
        let e = EngineHandle::start(c).unwrap();
        let mut computed = Vec::new();
        for _ in 0..2 {
            let before = e.metrics().computed_tokens;
            for (i, p) in ps.iter().enumerate() {
                assert_eq!(e.generate_blocking(request(p, 10)).unwrap().0, want[i]);
            }
            computed.push(e.metrics().computed_tokens - before);
        }
        // Concurrently, too.
        let got = run_all(&e, ps.iter().map(|p| request(p, 10)).collect());
        for (i, (toks, _)) in got.iter().enumerate() {
            assert_eq!(toks, &want[i], "concurrent prompt {i}");
        }
        // The usage of a repeated prompt says what was reused.
        let mut rx = e.submit(request(&ps[0], 10)).unwrap();
        let cached = loop {
            match rx.blocking_recv() {
                Some(GenerateEvent::Done { usage, .. }) => break usage.cached_tokens,
                Some(GenerateEvent::Token(_)) => {}
                other => panic!("{other:?}"),
            }
        };
        (computed, cached, e.metrics().g1_prefix_hit_tokens)
    };
    let full = full_cost(&ps, 10);
    let (off, off_cached, off_hits) = run_twice(false);
    assert_eq!(off, vec![full, full], "prefix cache off must recompute all");
    assert_eq!(off_cached, 0);
    assert_eq!(off_hits, 0);
    // The same repeats with the cache on reuse blocks: the switch is what made the difference.
    let (on, on_cached, on_hits) = run_twice(true);
    assert!(
        on[0] < full && on[1] < on[0],
        "prefix cache on: {on:?} of {full}"
    );
    assert_eq!(on_cached, (ps[0].len() - 1) / 16 * 16);
    assert!(on_hits > 0);
}

#[test]
fn invalid_requests_get_error_events_not_panics() {
    let e = EngineHandle::start(cfg(0)).unwrap();
    let cases = vec![
        GenerateRequest::new(vec![], 4),
        GenerateRequest::new(vec![1, 2], 0),
        GenerateRequest::new(vec![1, 99_999], 4),
        GenerateRequest::new(vec![7; 5000], 4),
    ];
    for req in cases {
        let mut rx = e.submit(req).unwrap();
        match rx.blocking_recv() {
            Some(GenerateEvent::Error(_)) => {}
            other => panic!("expected an error event, got {other:?}"),
        }
    }
    // The engine still serves.
    let (toks, _) = e.generate_blocking(request(&[1, 2, 3], 3)).unwrap();
    assert_eq!(toks.len(), 3);
    assert_eq!(e.metrics().requests_failed, 4);
}

#[test]
fn full_queue_is_overloaded() {
    let mut c = cfg(0);
    c.max_waiting = 2;
    c.max_num_seqs = 1;
    let e = EngineHandle::start(c).unwrap();
    let mut rxs = Vec::new();
    let mut overloaded = 0;
    for _ in 0..40 {
        match e.submit(request(&[5; 40], 64)) {
            Ok(rx) => rxs.push(rx),
            Err(EngineError::Overloaded(_)) => overloaded += 1,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(overloaded > 0);
    assert_eq!(e.metrics().requests_rejected, overloaded);
    e.shutdown();
    // Every accepted request ends (Done or shutdown Error), none hangs.
    for mut rx in rxs {
        while let Some(ev) = rx.blocking_recv() {
            if !matches!(ev, GenerateEvent::Token(_)) {
                break;
            }
        }
    }
}

/// Write the built-in model of `seed` as a Hugging Face directory with the given EOS id.
fn write_builtin_dir(dir: &std::path::Path, seed: u64, eos: u32) {
    let model = Model::builtin(seed);
    let c = &model.config;
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": false, "bos_token_id": 256, "eos_token_id": eos});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let named = model.weights.named_tensors(c);
    let refs: Vec<(&str, Vec<usize>, &[f32])> = named
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.clone(), *d))
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        kvtier_engine::model::safetensors::write_f32(&refs),
    )
    .unwrap();
}

#[test]
fn safetensors_directory_reproduces_the_builtin_model_and_stops_at_eos() {
    let ps = prompts(3, 20);
    let want = reference(cfg(9), &ps, 16);
    // Pick a token the model generates as the checkpoint's EOS.
    let eos = want[0][5];
    let first_eos = want[0].iter().position(|t| *t == eos).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_builtin_dir(dir.path(), 9, eos);
    let mut c = cfg(9);
    c.model = kvtier_engine::ModelSource::Dir(dir.path().to_path_buf());
    let e = EngineHandle::start(c).unwrap();
    for (i, p) in ps.iter().enumerate() {
        assert_eq!(
            e.generate_blocking(request(p, 16)).unwrap().0,
            want[i],
            "prompt {i}"
        );
    }
    let (toks, reason) = e
        .generate_blocking(GenerateRequest::new(ps[0].clone(), 16))
        .unwrap();
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(toks, want[0][..=first_eos].to_vec());
    let (toks, reason) = e
        .generate_blocking(GenerateRequest::new(ps[0].clone(), 2))
        .unwrap();
    assert_eq!(
        reason,
        if first_eos < 2 {
            FinishReason::Stop
        } else {
            FinishReason::Length
        }
    );
    assert_eq!(toks.len(), 2.min(first_eos + 1));
}

#[test]
fn missing_or_corrupt_checkpoint_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cfg(0);
    c.model = kvtier_engine::ModelSource::Dir(dir.path().to_path_buf());
    assert!(matches!(
        EngineHandle::start(c.clone()),
        Err(EngineError::Model(_))
    ));
    write_builtin_dir(dir.path(), 0, 257);
    let f = dir.path().join("model.safetensors");
    let mut data = std::fs::read(&f).unwrap();
    data.truncate(data.len() / 2);
    std::fs::write(&f, data).unwrap();
    assert!(matches!(EngineHandle::start(c), Err(EngineError::Model(_))));
}
