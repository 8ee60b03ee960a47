//! The fault matrix (#13): each row injects one fault under the real engine with kvtier on and
//! checks that every response is identical to a run without kvtier, and that what kvtier reports
//! (usage.cached_tokens, hit counters) does not count what failed. docs/arch/io.md has the table.
#![allow(clippy::unwrap_used)]
mod common;

use std::sync::Arc;

use common::{prompts, reference, request};
use kvtier::config::{KvtierConfig, TierSize};
use kvtier::connector::testing::{FaultRules, FaultyTransfer};
use kvtier::Tier;
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle, GenerateEvent, GenerateRequest};

fn host_tier() -> KvtierConfig {
    let mut c = KvtierConfig::default();
    c.host.size = Some(TierSize::Blocks(512));
    c.validate().unwrap();
    c
}

fn cfg_with(seed: u64, rules: FaultRules) -> EngineConfig {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    let mut setup = ConnectorSetup::new(host_tier());
    setup.wrap_transfer = Some(Arc::new(move |inner| {
        let f = FaultyTransfer::new(inner);
        f.set_rules(rules.clone());
        Arc::new(f) as Arc<dyn kvtier::transfer::BlockTransfer>
    }));
    c.connector = Some(setup);
    c
}

/// Tokens and usage.cached_tokens of each request, run concurrently.
fn run_usage(e: &EngineHandle, reqs: Vec<GenerateRequest>) -> Vec<(Vec<u32>, usize)> {
    let rxs: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
    rxs.into_iter()
        .map(|mut rx| {
            let mut toks = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(GenerateEvent::Token(t)) => toks.push(t),
                    Some(GenerateEvent::Done { usage, .. }) => return (toks, usage.cached_tokens),
                    Some(GenerateEvent::Error(e)) => panic!("request failed: {e}"),
                    None => panic!("closed"),
                }
            }
        })
        .collect()
}

/// Regression (#13, wrong reporting): when every kvtier load failed and the prompt was
/// recomputed, `usage.cached_tokens` and the hit counter still counted the failed loads.
#[test]
fn failed_loads_are_recomputed_and_not_reported_as_cached() {
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Host, Tier::Device));
    let cfg = cfg_with(31, rules);
    let ps = prompts(6, 64);
    let want = reference(cfg.clone(), &ps, 6);
    let e = EngineHandle::start(cfg).unwrap();
    let first = run_usage(&e, ps.iter().map(|p| request(p, 6)).collect());
    assert!(e.wait_idle(std::time::Duration::from_secs(60)));
    e.reset_prefix_cache();
    let m1 = e.metrics();
    assert!(m1.offloaded_blocks > 0, "{m1:?}");
    // One at a time, so no request shares G1 blocks with another of this phase.
    let mut second = Vec::new();
    for p in &ps {
        second.extend(run_usage(&e, vec![request(p, 6)]));
        e.reset_prefix_cache();
    }
    let m2 = e.metrics();
    for (i, ((t1, _), (t2, cached))) in first.iter().zip(&second).enumerate() {
        assert_eq!(t1, &want[i], "request {i}, phase 1");
        assert_eq!(t2, &want[i], "request {i}, phase 2");
        assert_eq!(*cached, 0, "request {i}: failed loads reported as cached tokens");
    }
    assert!(m2.load_failures > m1.load_failures, "no load failed: {m2:?}");
    assert_eq!(
        m2.kvtier_matched_tokens, m1.kvtier_matched_tokens,
        "failed loads counted as kvtier hits"
    );
}
