//! With kvtier on, every response must be bit-identical to a run without it: served from host
//! (G2), from disk (G3), across a prefill and a decode engine through a shared directory (G4),
//! under concurrency, and when loads fail (recomputed). Each test also checks through metric
//! deltas that the path it claims to test really ran.
#![allow(clippy::unwrap_used)]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{collect, prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier::connector::testing::{FaultRules, FaultyTransfer};
use kvtier::Tier;
use kvtier_engine::{
    ConnectorSetup, EngineConfig, EngineHandle, FinishReason, GenerateRequest, Prefilled, Role,
};

const IDLE: Duration = Duration::from_secs(60);

fn tiers(host: u64, disk: Option<(&Path, u64)>, remote: Option<&Path>) -> KvtierConfig {
    let mut c = KvtierConfig::default();
    c.host.size = Some(TierSize::Blocks(host));
    if let Some((dir, n)) = disk {
        c.disk.size = Some(TierSize::Blocks(n));
        c.disk.dir = dir.to_path_buf();
        // Spill every block (the frequency filter is tested in the core crate).
        c.policy.disk_filter.enabled = false;
    }
    c.remote = remote.map(RemoteTarget::dir);
    c.validate().unwrap();
    c
}

/// A small G1 (eviction and preemption happen) with kvtier on.
fn engine_cfg(seed: u64, kv: KvtierConfig) -> EngineConfig {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    c.connector = Some(ConnectorSetup::new(kv));
    c
}

fn check_exact(got: &[(Vec<u32>, FinishReason)], want: &[Vec<u32>], what: &str) {
    assert_eq!(got.len(), want.len());
    let exact = got.iter().zip(want).filter(|(g, w)| &g.0 == *w).count();
    assert_eq!(
        exact,
        want.len(),
        "{what}: only {exact}/{} responses identical",
        want.len()
    );
}

/// Fill, flush G1, repeat: phase 2 is served from kvtier and must match the reference.
fn fill_flush_repeat(
    cfg: EngineConfig,
    ps: &[Vec<u32>],
    max_tokens: usize,
) -> (EngineHandle, Vec<Vec<u32>>) {
    let want = reference(cfg.clone(), ps, max_tokens);
    let e = EngineHandle::start(cfg).unwrap();
    let phase1 = run_all(&e, ps.iter().map(|p| request(p, max_tokens)).collect());
    check_exact(&phase1, &want, "phase 1");
    assert!(e.wait_idle(IDLE), "kvtier did not go idle");
    e.reset_prefix_cache();
    (e, want)
}

#[test]
fn aggregated_host_tier_serves_identical_tokens() {
    let ps = prompts(8, 64);
    let (e, want) = fill_flush_repeat(engine_cfg(21, tiers(512, None, None)), &ps, 8);
    let m1 = e.metrics();
    assert!(m1.offloaded_blocks > 0, "nothing offloaded: {m1:?}");
    let phase2 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    check_exact(&phase2, &want, "phase 2 (host)");
    let m2 = e.metrics();
    assert!(
        m2.onboarded_blocks > m1.onboarded_blocks,
        "nothing onboarded: {m2:?}"
    );
    assert!(m2.kvtier_matched_tokens_host > m1.kvtier_matched_tokens_host);
    assert_eq!(m2.load_failures, 0);
    // Fewer tokens computed in phase 2 than in phase 1.
    assert!(m2.computed_tokens - m1.computed_tokens < m1.computed_tokens);
}

#[test]
fn aggregated_disk_tier_serves_identical_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let ps = prompts(8, 64);
    // The host tier holds 6 blocks: most of phase 1 survives only on disk.
    let (e, want) = fill_flush_repeat(
        engine_cfg(22, tiers(6, Some((dir.path(), 512)), None)),
        &ps,
        8,
    );
    let m1 = e.metrics();
    assert!(
        m1.spilled_disk_blocks > 0,
        "nothing spilled to disk: {m1:?}"
    );
    assert!(m1.offloaded_disk_blocks > 0, "{m1:?}");
    assert!(m1.offloaded_disk_blocks <= m1.spilled_disk_blocks);
    assert_eq!(m1.offloaded_host_blocks, m1.offloaded_blocks);
    let phase2 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    check_exact(&phase2, &want, "phase 2 (disk)");
    let m2 = e.metrics();
    assert!(
        m2.kvtier_matched_tokens_disk > m1.kvtier_matched_tokens_disk,
        "nothing served from disk: {m2:?}"
    );
    assert_eq!(m2.load_failures, 0, "{m2:?}");
}

/// No host tier at all: completed blocks go from G1 straight to disk and come back from it
/// (through the transfer engine's bounce buffers). The disk filter is left at its default
/// (enabled): without G2 there are no sightings to filter, so every block is written through.
#[test]
fn disk_only_tier_serves_identical_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut kv = KvtierConfig::default();
    kv.disk.size = Some(TierSize::Blocks(512));
    kv.disk.dir = dir.path().to_path_buf();
    kv.validate().unwrap();
    assert_eq!(kv.host.size, None);
    let ps = prompts(8, 64);
    let (e, want) = fill_flush_repeat(engine_cfg(24, kv), &ps, 8);
    let m1 = e.metrics();
    assert!(m1.offloaded_blocks > 0, "nothing offloaded: {m1:?}");
    assert_eq!(m1.spilled_disk_blocks, 0, "no host tier to spill from");
    assert_eq!(m1.offloaded_host_blocks, 0);
    assert_eq!(m1.offloaded_disk_blocks, m1.offloaded_blocks, "{m1:?}");
    for round in 0..2 {
        let before = e.metrics();
        let got = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
        check_exact(&got, &want, &format!("round {round} (disk only)"));
        let after = e.metrics();
        assert!(
            after.kvtier_matched_tokens_disk > before.kvtier_matched_tokens_disk,
            "round {round}: nothing served from disk: {after:?}"
        );
        assert!(
            after.computed_tokens - before.computed_tokens < m1.computed_tokens,
            "round {round}: disk hits saved no computation: {after:?}"
        );
        e.reset_prefix_cache();
    }
    let m = e.metrics();
    assert_eq!(m.kvtier_matched_tokens_host, 0);
    assert_eq!(m.load_failures, 0, "{m:?}");
}

#[test]
fn prefix_cache_off_repeats_come_from_kvtier_only() {
    let ps = prompts(8, 64);
    let mut cfg = engine_cfg(24, tiers(512, None, None));
    cfg.enable_prefix_cache = false;
    let want = reference(cfg.clone(), &ps, 8);
    let e = EngineHandle::start(cfg).unwrap();
    let phase1 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    check_exact(&phase1, &want, "phase 1");
    assert!(e.wait_idle(IDLE), "kvtier did not go idle");
    let m1 = e.metrics();
    // No reset: with the prefix cache on, G1 would serve part of the repeat.
    let phase2 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    check_exact(&phase2, &want, "phase 2 (prefix cache off)");
    let m2 = e.metrics();
    assert_eq!(m2.g1_prefix_hit_tokens, 0, "{m2:?}");
    assert!(m2.kvtier_matched_tokens_host > m1.kvtier_matched_tokens_host);
    assert_eq!(m2.load_failures, 0);
}

#[test]
fn concurrent_load_offloads_and_onboards_with_exact_output() {
    let ps = prompts(16, 80);
    let want = reference(EngineConfig::builtin(23), &ps, 12);
    let mut cfg = engine_cfg(23, tiers(1024, None, None));
    cfg.num_device_blocks = 30; // 16 requests of up to 9 blocks: preemption under kvtier too
    let e = EngineHandle::start(cfg).unwrap();
    let m0 = e.metrics();
    // Three waves over the same prompts, all in flight at once within a wave, with the G1
    // prefix cache flushed between waves.
    for wave in 0..3 {
        let got = run_all(&e, ps.iter().map(|p| request(p, 12)).collect());
        check_exact(&got, &want, &format!("wave {wave}"));
        e.reset_prefix_cache();
    }
    let m = e.metrics();
    assert!(m.offloaded_blocks > m0.offloaded_blocks);
    assert!(m.onboarded_blocks > m0.onboarded_blocks);
    assert!(m.preemptions > 0, "no preemption: {m:?}");
    assert_eq!(m.load_failures, 0);
}

/// kvtier with a host tier behind a transfer that fails what `rules` name.
fn faulty_setup(rules: FaultRules) -> ConnectorSetup {
    let mut setup = ConnectorSetup::new(tiers(512, None, None));
    setup.wrap_transfer = Some(Arc::new(move |inner| {
        let f = FaultyTransfer::new(inner);
        f.set_rules(rules.clone());
        Arc::new(f) as Arc<dyn kvtier::transfer::BlockTransfer>
    }));
    setup
}

fn run_with_failures(rules: FaultRules, seed: u64) {
    let ps = prompts(8, 64);
    let mut cfg = engine_cfg(seed, tiers(512, None, None));
    cfg.connector = Some(faulty_setup(rules));
    let (e, want) = fill_flush_repeat(cfg, &ps, 8);
    let m1 = e.metrics();
    let phase2 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    check_exact(&phase2, &want, "phase 2 with failing loads");
    let m2 = e.metrics();
    assert!(
        m2.load_failures > m1.load_failures,
        "no load failed: {m2:?}"
    );
    assert!(m2.recomputed_tokens > m1.recomputed_tokens);
}

#[test]
fn every_failed_load_is_recomputed_identically() {
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Host, Tier::Device));
    run_with_failures(rules, 24);
}

#[test]
fn partially_failed_loads_are_recomputed_identically() {
    // Odd host blocks fail: matches break in the middle, some blocks load and some do not.
    let mut rules = FaultRules::default();
    for b in (1..512).step_by(2) {
        rules.fail_src.insert((Tier::Host, b));
    }
    run_with_failures(rules, 25);
}

#[test]
fn disaggregated_prefill_and_decode_match_aggregated() {
    let remote = tempfile::tempdir().unwrap();
    disaggregated_round_trip(RemoteTarget::dir(remote.path()));
}

/// A private Redis server on a free port, stopped on drop.
struct RedisServer {
    child: std::process::Child,
    url: String,
}

impl RedisServer {
    fn start() -> Option<RedisServer> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let server = RedisServer {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn disaggregated_through_redis_matches_aggregated() {
    if std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("redis-server is not installed (scripts/start-services.sh installs it): skipped");
        return;
    }
    let server = RedisServer::start().expect("redis-server did not start");
    disaggregated_round_trip(RemoteTarget::parse(&server.url).unwrap());
}

fn disaggregated_round_trip(remote: RemoteTarget) {
    let ps = prompts(8, 64);
    let max_tokens = 10;
    let want = reference(EngineConfig::builtin(26), &ps, max_tokens);
    let mut kv = tiers(256, None, None);
    kv.remote = Some(remote);
    let mut pc = engine_cfg(26, kv.clone());
    pc.role = Role::Prefill;
    let mut dc = engine_cfg(26, kv);
    dc.role = Role::Decode;
    let prefill = EngineHandle::start(pc).unwrap();
    let decode = EngineHandle::start(dc).unwrap();
    // Prefill everything concurrently.
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| prefill.submit(request(p, max_tokens)).unwrap())
        .collect();
    let firsts: Vec<u32> = rxs
        .into_iter()
        .map(|rx| {
            let (toks, reason) = collect(rx);
            assert_eq!(reason, FinishReason::Prefilled);
            assert_eq!(toks.len(), 1);
            toks[0]
        })
        .collect();
    // Decode everything concurrently, from the KV the prefill engine published.
    let rxs: Vec<_> = ps
        .iter()
        .zip(&firsts)
        .map(|(p, &t)| {
            let mut r = request(p, max_tokens);
            r.prefilled = Some(Prefilled { first_token: t });
            decode.submit(r).unwrap()
        })
        .collect();
    let got: Vec<(Vec<u32>, FinishReason)> = rxs.into_iter().map(collect).collect();
    check_exact(&got, &want, "disaggregated");
    let pm = prefill.metrics();
    let dm = decode.metrics();
    assert!(
        pm.remote_put_blocks > 0,
        "prefill published nothing: {pm:?}"
    );
    // The decode side loaded from the remote, so the puts it read were confirmed.
    assert!(
        pm.offloaded_remote_blocks > 0 && pm.offloaded_remote_blocks <= pm.remote_put_blocks,
        "confirmed puts: {pm:?}"
    );
    assert!(
        dm.kvtier_matched_tokens_remote > 0,
        "decode loaded nothing from the remote: {dm:?}"
    );
    // Every full prompt block reached the decode engine without being recomputed: from the
    // remote store, or from its own G1 prefix cache for prefixes shared between prompts.
    let full: usize = ps.iter().map(|p| p.len() / 16 * 16).sum();
    assert_eq!(dm.load_failures, 0, "{dm:?}");
    // (Preemption in the tiny G1 can make a request match twice, hence >=.)
    assert!(
        dm.kvtier_matched_tokens_remote as usize + dm.g1_prefix_hit_tokens as usize >= full,
        "{dm:?}"
    );
    let prompt_tokens: usize = ps.iter().map(|p| p.len()).sum();
    let generation = (ps.len() * (max_tokens - 1)) as u64;
    let prefill_computed = dm.computed_tokens - generation;
    assert!(
        prefill_computed as usize + full
            <= prompt_tokens + ps.len() + dm.preemptions as usize * 128,
        "decode recomputed prompt blocks: {dm:?}"
    );
}

#[test]
fn decode_without_published_kv_recomputes_identically() {
    // A decode engine whose remote store is empty still gives the aggregated tokens.
    let remote = tempfile::tempdir().unwrap();
    let ps = prompts(4, 40);
    let want = reference(EngineConfig::builtin(27), &ps, 6);
    let mut dc = engine_cfg(27, tiers(64, None, Some(remote.path())));
    dc.role = Role::Decode;
    let decode = EngineHandle::start(dc).unwrap();
    for (p, w) in ps.iter().zip(&want) {
        let mut r = GenerateRequest::new(p.clone(), 6);
        r.ignore_eos = true;
        r.prefilled = Some(Prefilled { first_token: w[0] });
        let (toks, _) = decode.generate_blocking(r).unwrap();
        assert_eq!(&toks, w);
    }
    assert_eq!(decode.metrics().kvtier_matched_tokens_remote, 0);
}

#[test]
fn connector_without_tiers_is_a_clear_start_error() {
    let mut c = EngineConfig::builtin(28);
    c.connector = Some(ConnectorSetup::default());
    match EngineHandle::start(c) {
        Err(kvtier_engine::EngineError::Connector(msg)) => assert!(msg.contains("tier"), "{msg}"),
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a connector without tiers started"),
    }
}

#[test]
fn finished_request_keeps_its_blocks_until_saved() {
    // Pins the "finished, no async save" failure class: blocks a store still reads must not be
    // handed to another request.
    let held: Arc<std::sync::Mutex<Option<Arc<FaultyTransfer>>>> = Arc::default();
    let h2 = held.clone();
    let mut setup = ConnectorSetup::new(tiers(64, None, None));
    setup.wrap_transfer = Some(Arc::new(move |inner| {
        let f = Arc::new(FaultyTransfer::new(inner));
        *h2.lock().unwrap() = Some(f.clone());
        f as Arc<dyn kvtier::transfer::BlockTransfer>
    }));
    let mut cfg = EngineConfig::builtin(29);
    cfg.num_device_blocks = 24;
    cfg.connector = Some(setup);
    let e = EngineHandle::start(cfg).unwrap();
    let f = held.lock().unwrap().clone().unwrap();
    f.hold();
    let p: Vec<u32> = (0..70u32).map(|i| (i * 7 + 1) % 256).collect();
    let (toks, _) = e.generate_blocking(request(&p, 4)).unwrap();
    assert_eq!(toks.len(), 4);
    // Done arrived, but the stores are held: the request's 5 blocks are still allocated.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(e.metrics().free_device_blocks, 24 - 5, "{:?}", e.metrics());
    assert!(!e.wait_idle(Duration::from_millis(100)));
    f.release();
    assert!(e.wait_idle(IDLE));
    let m = e.metrics();
    assert_eq!(m.free_device_blocks, 24);
    assert_eq!(m.offloaded_blocks, 4);
}
