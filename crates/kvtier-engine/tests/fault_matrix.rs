//! The fault matrix (#13): each row injects one fault under the real engine with kvtier on and
//! checks that every response is identical to a run without kvtier, and that what kvtier reports
//! (usage.cached_tokens, hit counters, spills) does not count what failed. docs/arch/io.md has the
//! table. Disk EIO/ENOSPC are injected at the transfer level (`FaultyTransfer`); torn and
//! truncated blocks by damaging the disk tier's real files while the engine runs; Redis faults on
//! a private `redis-server` (killed, SIGSTOPped, values copied between keys).
#![allow(clippy::unwrap_used)]
mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier::connector::testing::{FaultRules, FaultyTransfer};
use kvtier::Tier;
use kvtier_engine::{
    ConnectorSetup, EngineConfig, EngineHandle, FinishReason, GenerateEvent, GenerateRequest,
    Prefilled, Role,
};

const IDLE: Duration = Duration::from_secs(60);

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
        assert_eq!(
            *cached, 0,
            "request {i}: failed loads reported as cached tokens"
        );
    }
    assert!(
        m2.load_failures > m1.load_failures,
        "no load failed: {m2:?}"
    );
    assert_eq!(
        m2.kvtier_matched_tokens, m1.kvtier_matched_tokens,
        "failed loads counted as kvtier hits"
    );
}

/// Host tier of `host` blocks plus a disk tier of 512 blocks in `dir` (every block spilled).
fn disk_tiers(host: u64, dir: &Path) -> KvtierConfig {
    let mut c = KvtierConfig::default();
    c.host.size = Some(TierSize::Blocks(host));
    c.disk.size = Some(TierSize::Blocks(512));
    c.disk.dir = dir.to_path_buf();
    c.policy.disk_filter.enabled = false;
    c.validate().unwrap();
    c
}

fn engine(seed: u64, kv: KvtierConfig, rules: Option<FaultRules>) -> EngineConfig {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    let mut setup = ConnectorSetup::new(kv);
    if let Some(rules) = rules {
        setup.wrap_transfer = Some(Arc::new(move |inner| {
            let f = FaultyTransfer::new(inner);
            f.set_rules(rules.clone());
            Arc::new(f) as Arc<dyn kvtier::transfer::BlockTransfer>
        }));
    }
    c.connector = Some(setup);
    c
}

/// Phase 1 fills the tiers, `fault` runs, G1 is flushed, phase 2 repeats the prompts: both
/// phases must equal the reference (no kvtier). Returns the metrics after phase 1 and 2.
fn fill_fault_repeat(
    cfg: EngineConfig,
    fault: impl FnOnce(),
) -> (kvtier_engine::EngineMetrics, kvtier_engine::EngineMetrics) {
    let ps = prompts(8, 64);
    let want = reference(cfg.clone(), &ps, 8);
    let e = EngineHandle::start(cfg).unwrap();
    let p1 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    assert!(e.wait_idle(IDLE), "kvtier did not go idle");
    fault();
    e.reset_prefix_cache();
    let m1 = e.metrics();
    let p2 = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&p1[i].0, w, "request {i}, phase 1");
        assert_eq!(&p2[i].0, w, "request {i}, phase 2 (after the fault)");
    }
    let m2 = e.metrics();
    e.shutdown();
    (m1, m2)
}

/// Disk reads fail (EIO at the transfer level): recomputed, identical.
#[test]
fn disk_read_eio_is_recomputed_identically() {
    let dir = tempfile::tempdir().unwrap();
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Disk, Tier::Device));
    rules.fail_direction.insert((Tier::Disk, Tier::Host));
    let (m1, m2) = fill_fault_repeat(engine(41, disk_tiers(6, dir.path()), Some(rules)), || {});
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    assert!(
        m2.load_failures > m1.load_failures,
        "no disk load failed: {m2:?}"
    );
}

/// Disk writes fail (ENOSPC at the transfer level): nothing is served from disk, identical.
#[test]
fn disk_write_enospc_skips_the_store_identically() {
    let dir = tempfile::tempdir().unwrap();
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Host, Tier::Disk));
    rules.fail_direction.insert((Tier::Device, Tier::Disk));
    let (_, m2) = fill_fault_repeat(engine(42, disk_tiers(6, dir.path()), Some(rules)), || {});
    assert_eq!(
        m2.offloaded_disk_blocks, 0,
        "a failed spill was counted: {m2:?}"
    );
    assert_eq!(m2.kvtier_matched_tokens_disk, 0, "{m2:?}");
}

fn disk_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Every disk tier file is torn (a range zeroed in the middle of each block area) while the
/// engine runs: the damaged blocks fail verification and are recomputed, identically.
#[test]
fn torn_disk_blocks_are_recomputed_identically() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let (m1, m2) = fill_fault_repeat(engine(43, disk_tiers(6, dir.path()), None), move || {
        for f in disk_files(&d) {
            let h = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
            let len = h.metadata().unwrap().len();
            let mut off = 4096;
            while off + 4096 < len {
                h.write_all_at(&[0xa5; 512], off + 100).unwrap();
                off += 64 * 1024;
            }
        }
    });
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    assert!(
        m2.load_failures > m1.load_failures,
        "no torn block was detected: {m2:?}"
    );
}

/// Every disk tier file is truncated to zero: loads fail, recomputed, identically.
#[test]
fn truncated_disk_files_are_recomputed_identically() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let (m1, m2) = fill_fault_repeat(engine(44, disk_tiers(6, dir.path()), None), move || {
        for f in disk_files(&d) {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(0)
                .unwrap();
        }
    });
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    assert!(m2.load_failures > m1.load_failures, "{m2:?}");
}

/// A private `redis-server` on a free port, killed on drop.
struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Option<Redis> {
        if Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            assert_eq!(
                std::env::var("KVTIER_SKIP_REDIS").as_deref(),
                Ok("1"),
                "redis-server not found (scripts/start-services.sh) and KVTIER_SKIP_REDIS is not 1"
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let r = Redis {
            child,
            port,
            _dir: dir,
        };
        let t0 = Instant::now();
        while r.cli(&["PING"]) != "PONG" {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(r)
    }
    fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    }
    fn url(&self) -> String {
        format!(
            "redis://127.0.0.1:{}?io_timeout_ms=300&lookup_timeout_ms=100&connect_timeout_ms=200&backoff_ms=200",
            self.port
        )
    }
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(
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

/// A prefill engine publishes every prompt to the remote store at `url`, `fault` runs, then a
/// decode engine continues each request from the store: the outputs must equal the reference.
/// Returns the decode engine's metrics and how long the decode phase took.
fn disagg_with_fault(url: &str, fault: impl FnOnce()) -> (kvtier_engine::EngineMetrics, Duration) {
    let ps = prompts(6, 64);
    let max_tokens = 6;
    let want = reference(EngineConfig::builtin(45), &ps, max_tokens);
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(256));
    kv.remote = Some(RemoteTarget::parse(url).expect("a valid redis url"));
    kv.validate().unwrap();
    let mut pc = engine(45, kv.clone(), None);
    pc.role = Role::Prefill;
    let mut dc = engine(45, kv, None);
    dc.role = Role::Decode;
    let prefill = EngineHandle::start(pc).unwrap();
    let firsts: Vec<u32> = ps
        .iter()
        .map(|p| prefill.submit(request(p, max_tokens)).unwrap())
        .collect::<Vec<_>>()
        .into_iter()
        .map(|rx| collect(rx).0[0])
        .collect();
    assert!(prefill.wait_idle(IDLE));
    prefill.shutdown();
    fault();
    let decode = EngineHandle::start(dc).unwrap();
    let t0 = Instant::now();
    let got: Vec<_> = ps
        .iter()
        .zip(&firsts)
        .map(|(p, &t)| {
            let mut r = request(p, max_tokens);
            r.prefilled = Some(Prefilled { first_token: t });
            decode.submit(r).unwrap()
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(collect)
        .collect();
    let took = t0.elapsed();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[i].0, w, "request {i} after the remote fault");
    }
    let m = decode.metrics();
    decode.shutdown();
    (m, took)
}

/// Control row: the healthy store really serves the decode engine (so the rows below test the
/// remote path).
#[test]
fn remote_healthy_serves_the_decode_engine() {
    let Some(r) = Redis::start() else { return };
    let (m, _) = disagg_with_fault(&r.url(), || {});
    assert!(m.kvtier_matched_tokens_remote > 0, "{m:?}");
    assert_eq!(m.load_failures, 0, "{m:?}");
}

/// Redis down (killed before the decode engine starts): misses, recomputed, bounded time.
#[test]
fn remote_down_is_recomputed_identically_within_the_bound() {
    let Some(mut r) = Redis::start() else { return };
    let url = r.url();
    let (_, took) = disagg_with_fault(&url, || {
        let _ = r.child.kill();
        let _ = r.child.wait();
    });
    assert!(
        took < Duration::from_secs(20),
        "decode took {took:?} against a dead store"
    );
}

/// Redis stops answering (SIGSTOP) before the decode engine starts: every lookup fails within
/// `lookup_timeout`, the breaker short-circuits the rest, outputs identical, bounded time.
#[test]
fn remote_stalled_is_recomputed_identically_within_the_bound() {
    let Some(r) = Redis::start() else { return };
    let (_, took) = disagg_with_fault(&r.url(), || r.signal("STOP"));
    r.signal("CONT");
    assert!(
        took < Duration::from_secs(20),
        "decode took {took:?} against a stalled store"
    );
}

/// Forged values: every kvtier value is overwritten by a copy of another block's value (the
/// #13 forgery): none is served, all recomputed, identically.
#[test]
fn remote_forged_values_are_rejected_and_recomputed_identically() {
    let Some(r) = Redis::start() else { return };
    let (m, _) = disagg_with_fault(&r.url(), || {
        let keys: Vec<String> = r
            .cli(&["--scan", "--pattern", "kvtier:*"])
            .lines()
            .map(str::to_string)
            .collect();
        assert!(keys.len() > 1, "nothing was published: {keys:?}");
        // Rotate: every key receives the value of another key.
        let n = keys.len();
        assert_eq!(
            r.cli(&["COPY", &keys[n - 1], "kvtier-fuzz-tmp", "REPLACE"]),
            "1"
        );
        for i in (1..n).rev() {
            assert_eq!(r.cli(&["COPY", &keys[i - 1], &keys[i], "REPLACE"]), "1");
        }
        assert_eq!(
            r.cli(&["COPY", "kvtier-fuzz-tmp", &keys[0], "REPLACE"]),
            "1"
        );
    });
    assert!(m.load_failures > 0, "no forged value was detected: {m:?}");
}
