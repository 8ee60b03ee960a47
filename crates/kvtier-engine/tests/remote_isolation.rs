//! Two engines of different models sharing one remote store (`remote.url = dir://…`) never share
//! a block: each writes under its own namespace (derived from its identity by the composition
//! root) with its own hash salt, so the second model finds nothing of the first and computes
//! exactly what it computes alone. A third engine of the first model does find the first's
//! blocks (so "nothing found" above is the isolation, not an empty store). Pins #16 (the remote
//! namespace of the Python bindings was one constant for every model).
#![allow(clippy::unwrap_used)]
mod common;

use std::time::Duration;

use common::{prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle};

const IDLE: Duration = Duration::from_secs(60);

fn engine(seed: u64, remote: &std::path::Path) -> EngineConfig {
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(128));
    kv.remote = Some(RemoteTarget::dir(remote));
    kv.validate().unwrap();
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 48;
    c.connector = Some(ConnectorSetup::new(kv));
    c
}

fn namespaces(root: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for scheme in std::fs::read_dir(root).unwrap().flatten() {
        for ns in std::fs::read_dir(scheme.path()).unwrap().flatten() {
            out.push(ns.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

#[test]
fn different_models_sharing_a_remote_store_never_share_a_block() {
    let remote = tempfile::tempdir().unwrap();
    let ps = prompts(4, 48);
    let max_tokens = 4;

    let a = EngineHandle::start(engine(41, remote.path())).unwrap();
    run_all(&a, ps.iter().map(|p| request(p, max_tokens)).collect());
    assert!(a.wait_idle(IDLE));
    let am = a.metrics();
    assert!(
        am.offloaded_remote_blocks >= 8,
        "model A published nothing: {am:?}"
    );
    drop(a);

    // Model B (other weights, other name): same prompts, same store.
    let want_b = reference(EngineConfig::builtin(42), &ps, max_tokens);
    let b = EngineHandle::start(engine(42, remote.path())).unwrap();
    let got = run_all(&b, ps.iter().map(|p| request(p, max_tokens)).collect());
    assert!(b.wait_idle(IDLE));
    let bm = b.metrics();
    assert_eq!(
        bm.kvtier_matched_tokens_remote, 0,
        "model B read model A's blocks: {bm:?}"
    );
    assert_eq!(bm.kvtier.onboard_remote_blocks, 0, "{bm:?}");
    let got: Vec<Vec<u32>> = got.into_iter().map(|g| g.0).collect();
    assert_eq!(got, want_b, "model B's output changed");
    assert!(bm.offloaded_remote_blocks > 0, "{bm:?}");
    drop(b);
    let ns = namespaces(remote.path());
    assert_eq!(ns.len(), 2, "one namespace per model: {ns:?}");
    assert!(
        ns.iter()
            .any(|n| n.starts_with("kvtier-builtin-llama-seed41-")),
        "{ns:?}"
    );

    // Control: another engine of model A finds A's blocks in the store.
    let c = EngineHandle::start(engine(41, remote.path())).unwrap();
    run_all(&c, ps.iter().map(|p| request(p, max_tokens)).collect());
    assert!(c.wait_idle(IDLE));
    assert!(
        c.metrics().kvtier_matched_tokens_remote > 0,
        "the same model found nothing: {:?}",
        c.metrics()
    );
}
