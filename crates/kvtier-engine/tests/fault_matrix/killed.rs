//! A transfer thread dying mid-job (the in-process worker's executor: `FaultRules::
//! panic_direction` writes half the job's pairs, then panics), and the host tier's allocation
//! refused at start.
use std::sync::{Arc, Mutex};

use kvtier::config::{KvtierConfig, TierSize};
use kvtier::connector::testing::{FaultRules, FaultyTransfer};
use kvtier::Tier;
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineError, EngineHandle, EngineMetrics};

use super::common::{prompts, reference, request, run_all};
use super::outside::Sandbox;
use super::{disk_tiers, IDLE};

type Handle = Arc<Mutex<Option<Arc<FaultyTransfer>>>>;

/// An engine whose transfer is a `FaultyTransfer` the test can re-arm while it runs.
fn armed_engine(seed: u64, kv: KvtierConfig) -> (EngineConfig, Handle) {
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    let handle: Handle = Arc::default();
    let h = handle.clone();
    let mut setup = ConnectorSetup::new(kv);
    setup.wrap_transfer = Some(Arc::new(move |inner| {
        let f = Arc::new(FaultyTransfer::new(inner));
        *h.lock().unwrap() = Some(f.clone());
        f as Arc<dyn kvtier::transfer::BlockTransfer>
    }));
    c.connector = Some(setup);
    (c, handle)
}

fn arm(h: &Handle, dirs: &[(Tier, Tier)]) {
    let mut rules = FaultRules::default();
    rules.panic_direction.extend(dirs.iter().copied());
    h.lock().unwrap().as_ref().unwrap().set_rules(rules);
}

/// Runs `ps` concurrently, asserts every output equals `want`, waits until kvtier is idle and
/// flushes G1 (so the next phase can only hit kvtier's tiers).
fn phase(e: &EngineHandle, ps: &[Vec<u32>], want: &[Vec<u32>], what: &str) -> EngineMetrics {
    let got = run_all(e, ps.iter().map(|p| request(p, 8)).collect());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&got[i].0, w, "request {i}, {what}");
    }
    assert!(e.wait_idle(IDLE), "kvtier did not go idle ({what})");
    e.reset_prefix_cache();
    e.metrics()
}

/// Every store (G1 -> host) dies half-way: no half-written host block is ever registered (the
/// repeat is all recomputed, nothing matched), outputs identical; disarmed, the same worker
/// stores and serves again.
#[test]
fn transfer_killed_mid_store_registers_nothing_and_recovers() {
    let sb = Sandbox::new();
    let (cfg, h) = armed_engine(47, disk_tiers(64, sb.disk_dir()));
    let ps = prompts(8, 64);
    let want = reference(cfg.clone(), &ps, 8);
    let e = EngineHandle::start(cfg).unwrap();
    arm(&h, &[(Tier::Device, Tier::Host)]);
    let m1 = phase(&e, &ps, &want, "stores dying");
    let m2 = phase(&e, &ps, &want, "repeat after dead stores");
    assert!(
        m2.kvtier.offload_failed > 0,
        "no store died: {:?}",
        m2.kvtier
    );
    assert_eq!(m2.kvtier.offload_confirmed, 0, "{:?}", m2.kvtier);
    assert_eq!(
        m2.kvtier_matched_tokens, 0,
        "a block of a dead store was served: {m1:?} {m2:?}"
    );
    arm(&h, &[]);
    phase(&e, &ps, &want, "disarmed");
    let m4 = phase(&e, &ps, &want, "disarmed repeat");
    assert!(
        m4.kvtier_matched_tokens > 0,
        "the worker did not recover: {m4:?}"
    );
    e.shutdown();
    sb.assert_untouched();
}

/// Every load (host/disk -> G1) dies half-way, half its device blocks written: the requests
/// are recomputed, identically, and not counted as hits; disarmed, loads are served again.
#[test]
fn transfer_killed_mid_load_is_recomputed_and_recovers() {
    let sb = Sandbox::new();
    let (cfg, h) = armed_engine(48, disk_tiers(64, sb.disk_dir()));
    let ps = prompts(8, 64);
    let want = reference(cfg.clone(), &ps, 8);
    let e = EngineHandle::start(cfg).unwrap();
    let m1 = phase(&e, &ps, &want, "fill");
    arm(
        &h,
        &[(Tier::Host, Tier::Device), (Tier::Disk, Tier::Device)],
    );
    let m2 = phase(&e, &ps, &want, "loads dying");
    assert!(m2.load_failures > m1.load_failures, "no load died: {m2:?}");
    assert_eq!(
        m2.kvtier_matched_tokens, m1.kvtier_matched_tokens,
        "a dead load was counted as a hit"
    );
    arm(&h, &[]);
    let m3 = phase(&e, &ps, &want, "disarmed");
    assert!(
        m3.kvtier_matched_tokens > m2.kvtier_matched_tokens,
        "the worker did not recover: {m3:?}"
    );
    e.shutdown();
    sb.assert_untouched();
}

/// The host tier's allocation is refused at start (more than the machine's memory): the start
/// fails with a typed error naming the setting to change, never an abort, and leaves no file
/// behind; the process goes on and an engine with a host tier that fits serves identically.
/// (No tier grows after start: the host tier is one mapping, the disk tier is preallocated and
/// the pools' books are reserved at start, fallibly; pinning refusal is `HostPin`, host.rs.)
#[test]
fn host_allocation_refused_is_a_clear_error_and_no_file_is_left() {
    let sb = Sandbox::new();
    let mut kv = KvtierConfig::default();
    // 2^31 blocks of this engine's block: far beyond any machine's memory, within the address
    // space (the #13 abort: `host.num_blocks` 5e8).
    kv.host.size = Some(TierSize::Blocks(1 << 31));
    kv.disk.size = Some(TierSize::Blocks(64));
    kv.disk.dir = sb.disk_dir().to_path_buf();
    kv.validate().unwrap();
    let (cfg, _) = armed_engine(49, kv);
    match EngineHandle::start(cfg) {
        Err(EngineError::Connector(msg)) => {
            assert!(msg.contains("host"), "{msg}");
            assert!(
                msg.contains("host.gb") || msg.contains("host.num_blocks"),
                "the error does not name the setting: {msg}"
            );
        }
        Err(other) => panic!("not a connector error: {other:?}"),
        Ok(_) => panic!("a host tier beyond memory started"),
    }
    let own = sb.disk_dir().join("kvtier-g3");
    let left: Vec<_> = std::fs::read_dir(&own)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter().all(|n| n.to_string_lossy().ends_with(".lock")),
        "a failed start left cache files: {left:?}"
    );
    sb.assert_untouched();
    let (cfg, _) = armed_engine(49, disk_tiers(64, sb.disk_dir()));
    let ps = prompts(4, 64);
    let want = reference(cfg.clone(), &ps, 8);
    let e = EngineHandle::start(cfg).unwrap();
    phase(&e, &ps, &want, "after the refused start");
    e.shutdown();
    sb.assert_untouched();
}
