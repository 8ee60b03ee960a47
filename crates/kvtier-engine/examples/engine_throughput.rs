//! Throughput of the reference engine, with ratios against baselines measured in the same run:
//! continuous batching vs one request at a time, and repeated prompts served from kvtier's host
//! tier vs recomputed (G1 prefix cache flushed in both cases).
//!
//! Run: `cargo run -p kvtier-engine --example engine_throughput` (the dev profile builds this
//! crate with opt-level 3). Prints one markdown table.
use std::time::{Duration, Instant};

use kvtier::config::{KvtierConfig, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle, GenerateEvent, GenerateRequest};

fn prompts(n: usize, len: usize, salt: u32) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            (0..len as u32)
                .map(|j| (j * 131 + i * 17 + salt * 7 + 3) % 256)
                .collect()
        })
        .collect()
}

fn run(e: &EngineHandle, ps: &[Vec<u32>], max_tokens: usize) -> anyhow::Result<(Duration, usize)> {
    let t = Instant::now();
    let mut rxs = Vec::new();
    for p in ps {
        let mut r = GenerateRequest::new(p.clone(), max_tokens);
        r.ignore_eos = true;
        rxs.push(e.submit(r)?);
    }
    let mut generated = 0;
    for mut rx in rxs {
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenerateEvent::Token(_) => generated += 1,
                GenerateEvent::Done { .. } => break,
                GenerateEvent::Error(err) => anyhow::bail!(err),
            }
        }
    }
    Ok((t.elapsed(), generated))
}

fn main() -> anyhow::Result<()> {
    let (n, len, gen) = (16, 256, 32);
    let ps = prompts(n, len, 0);
    let total_tokens = n * (len + gen);
    println!("| workload | config | seconds | tokens/s | ratio |");
    println!("|---|---|---|---|---|");

    // Batching.
    let mut solo_cfg = EngineConfig::builtin(0);
    solo_cfg.max_num_seqs = 1;
    let solo = EngineHandle::start(solo_cfg)?;
    let (t_solo, _) = run(&solo, &ps, gen)?;
    solo.shutdown();
    let batched = EngineHandle::start(EngineConfig::builtin(0))?;
    let (t_batch, _) = run(&batched, &ps, gen)?;
    batched.shutdown();
    let tps = |t: Duration| total_tokens as f64 / t.as_secs_f64();
    println!(
        "| {n} x ({len} prompt + {gen} gen) | max_num_seqs 1 (baseline) | {:.2} | {:.0} | 1.00 |",
        t_solo.as_secs_f64(),
        tps(t_solo)
    );
    println!(
        "| {n} x ({len} prompt + {gen} gen) | max_num_seqs 16, 256 tokens/step | {:.2} | {:.0} | {:.2} |",
        t_batch.as_secs_f64(),
        tps(t_batch),
        t_solo.as_secs_f64() / t_batch.as_secs_f64()
    );

    // Repeated prompts after a G1 flush: recompute vs kvtier host tier.
    let (rlen, rgen) = (1024, 8);
    let rps = prompts(n, rlen, 1);
    let mut base = EngineConfig::builtin(0);
    base.num_device_blocks = 128;
    let mut with_kv = base.clone();
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(2048));
    with_kv.connector = Some(ConnectorSetup::new(kv));
    let mut phase2 = Vec::new();
    for (name, cfg) in [
        ("no kvtier (recompute, baseline)", base),
        ("kvtier host tier", with_kv),
    ] {
        let e = EngineHandle::start(cfg)?;
        run(&e, &rps, rgen)?;
        e.wait_idle(Duration::from_secs(120));
        e.reset_prefix_cache();
        let (t, _) = run(&e, &rps, rgen)?;
        let m = e.metrics();
        e.shutdown();
        phase2.push((name, t, m.onboarded_blocks));
    }
    let t0 = phase2[0].1.as_secs_f64();
    for (name, t, onboarded) in phase2 {
        println!(
            "| repeat {n} x ({rlen} prompt + {rgen} gen) after G1 flush | {name} (onboarded {onboarded} blocks) | {:.2} | {:.0} | {:.2} |",
            t.as_secs_f64(),
            (n * (rlen + rgen)) as f64 / t.as_secs_f64(),
            t0 / t.as_secs_f64()
        );
    }
    Ok(())
}
