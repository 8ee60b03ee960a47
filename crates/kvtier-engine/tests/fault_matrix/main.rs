//! The fault matrix (#13): each row injects one fault under the real engine with kvtier on and
//! checks that every response is identical to a run without kvtier, that what kvtier reports
//! (usage.cached_tokens, hit counters, spills) does not count what failed, and that nothing
//! outside kvtier's own files changed (`outside::Sandbox`). docs/arch/io.md has the table. Disk
//! EIO/ENOSPC are injected at the transfer level (`FaultyTransfer`); torn and truncated blocks by
//! damaging the disk tier's real files while the engine runs; a transfer thread dying mid-job in
//! `killed`; Redis faults on a private `redis-server` (killed, restarted, SIGSTOPped, values
//! copied between keys) in `remote`.
#![allow(clippy::unwrap_used)]
#[path = "../common/mod.rs"]
mod common;
mod killed;
mod outside;
mod remote;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, TierSize};
use kvtier::connector::testing::{FaultRules, FaultyTransfer};
use kvtier::Tier;
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle, GenerateEvent, GenerateRequest};
use outside::Sandbox;

const IDLE: Duration = Duration::from_secs(60);

/// A host tier only; `dir` is `disk.dir` all the same (kvtier must not touch it).
fn host_tier(dir: &Path) -> KvtierConfig {
    let mut c = KvtierConfig::default();
    c.host.size = Some(TierSize::Blocks(512));
    c.disk.dir = dir.to_path_buf();
    c.validate().unwrap();
    c
}

fn cfg_with(seed: u64, rules: FaultRules, dir: &Path) -> EngineConfig {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    let mut setup = ConnectorSetup::new(host_tier(dir));
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
    let sb = Sandbox::new();
    let cfg = cfg_with(31, rules, sb.disk_dir());
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
    e.shutdown();
    sb.assert_untouched();
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
    let sb = Sandbox::new();
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Disk, Tier::Device));
    rules.fail_direction.insert((Tier::Disk, Tier::Host));
    let (m1, m2) = fill_fault_repeat(engine(41, disk_tiers(6, sb.disk_dir()), Some(rules)), || {});
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    assert!(
        m2.load_failures > m1.load_failures,
        "no disk load failed: {m2:?}"
    );
    sb.assert_untouched();
}

/// Disk writes fail (ENOSPC at the transfer level): nothing is served from disk, identical.
#[test]
fn disk_write_enospc_skips_the_store_identically() {
    let sb = Sandbox::new();
    let mut rules = FaultRules::default();
    rules.fail_direction.insert((Tier::Host, Tier::Disk));
    rules.fail_direction.insert((Tier::Device, Tier::Disk));
    let (_, m2) = fill_fault_repeat(engine(42, disk_tiers(6, sb.disk_dir()), Some(rules)), || {});
    assert_eq!(
        m2.offloaded_disk_blocks, 0,
        "a failed spill was counted: {m2:?}"
    );
    assert_eq!(m2.kvtier_matched_tokens_disk, 0, "{m2:?}");
    sb.assert_untouched();
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
    let sb = Sandbox::new();
    let d = sb.disk_dir().join("kvtier-g3");
    let (m1, m2) = fill_fault_repeat(engine(43, disk_tiers(6, sb.disk_dir()), None), move || {
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
    sb.assert_untouched();
}

/// Every disk tier file is truncated to zero: loads fail, recomputed, identically.
#[test]
fn truncated_disk_files_are_recomputed_identically() {
    let sb = Sandbox::new();
    let d = sb.disk_dir().join("kvtier-g3");
    let (m1, m2) = fill_fault_repeat(engine(44, disk_tiers(6, sb.disk_dir()), None), move || {
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
    sb.assert_untouched();
}

/// Every disk tier file is deleted while the engine runs: the open descriptors keep the old
/// inodes, so the engine keeps serving them, identically (the restart case, where deleted
/// files are gone, is `kvtier-io/tests/disk_restart.rs`).
#[test]
fn deleted_disk_files_keep_serving_identically() {
    let sb = Sandbox::new();
    let d = sb.disk_dir().join("kvtier-g3");
    let (m1, _) = fill_fault_repeat(engine(50, disk_tiers(6, sb.disk_dir()), None), move || {
        let files = disk_files(&d);
        assert!(!files.is_empty());
        for f in files {
            std::fs::remove_file(&f).unwrap();
        }
    });
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    sb.assert_untouched();
}

/// The content of every data file is replaced by another data file's (same sizes, valid
/// headers of other slots): verification rejects every moved block, recomputed identically.
#[test]
fn replaced_disk_file_contents_are_rejected_identically() {
    use std::os::unix::fs::FileExt;
    let sb = Sandbox::new();
    let d = sb.disk_dir().join("kvtier-g3");
    let (m1, m2) = fill_fault_repeat(engine(51, disk_tiers(6, sb.disk_dir()), None), move || {
        let mut data: Vec<_> = disk_files(&d)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "kvblk"))
            .collect();
        data.sort();
        let bytes: Vec<Vec<u8>> = data.iter().map(|p| std::fs::read(p).unwrap()).collect();
        if data.len() == 1 {
            // One file of the 512 slots: shift them by one (each slot gets its neighbour's
            // header and payload).
            let b = &bytes[0];
            assert_eq!(b.len() % 512, 0, "not 512 slots");
            let slot = b.len() / 512;
            let h = std::fs::OpenOptions::new()
                .write(true)
                .open(&data[0])
                .unwrap();
            h.write_all_at(&b[slot..], 0).unwrap();
        } else {
            for (i, p) in data.iter().enumerate() {
                let from = &bytes[(i + 1) % bytes.len()];
                let h = std::fs::OpenOptions::new().write(true).open(p).unwrap();
                h.write_all_at(&from[..from.len().min(bytes[i].len())], 0)
                    .unwrap();
            }
        }
    });
    assert!(m1.spilled_disk_blocks > 0, "{m1:?}");
    assert!(
        m2.load_failures > m1.load_failures,
        "no moved block was detected: {m2:?}"
    );
    sb.assert_untouched();
}
