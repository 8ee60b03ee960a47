//! Warm restart of G3 through the whole stack (#14 item 1): an engine fills the disk tier and
//! stops; a new engine on the same `disk.dir` serves the same prompts from disk from its first
//! request on, with tokens identical to a run without kvtier. With `disk.persist = false` the
//! new engine starts cold.
#![allow(clippy::unwrap_used)]
mod common;

use std::time::Duration;

use common::{prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle};

fn cfg(dir: &std::path::Path, persist: bool) -> EngineConfig {
    let mut kv = KvtierConfig::default();
    kv.disk.size = Some(TierSize::Blocks(512));
    kv.disk.dir = dir.to_path_buf();
    kv.disk.persist = persist;
    kv.validate().unwrap();
    let mut c = EngineConfig::builtin(31);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    c.connector = Some(ConnectorSetup::new(kv));
    c
}

/// Run `ps` on a fresh engine; returns the tokens and the disk-matched tokens.
fn run(c: EngineConfig, ps: &[Vec<u32>]) -> (Vec<Vec<u32>>, u64) {
    let e = EngineHandle::start(c).unwrap();
    let got = run_all(&e, ps.iter().map(|p| request(p, 8)).collect());
    assert!(e.wait_idle(Duration::from_secs(60)));
    let m = e.metrics();
    assert_eq!(m.load_failures, 0, "{m:?}");
    e.shutdown();
    drop(e);
    (
        got.into_iter().map(|g| g.0).collect(),
        m.kvtier_matched_tokens_disk,
    )
}

#[test]
fn restarted_engine_serves_the_disk_tier_with_identical_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let ps = prompts(6, 64);
    let want = reference(cfg(dir.path(), true), &ps, 8);
    let (first, hits) = run(cfg(dir.path(), true), &ps);
    assert_eq!(first, want);
    assert_eq!(hits, 0, "a fresh directory has nothing to serve");
    let (second, hits) = run(cfg(dir.path(), true), &ps);
    assert_eq!(second, want, "tokens after a warm restart differ");
    assert!(
        hits >= 6 * 48,
        "the restarted engine did not serve from disk: {hits}"
    );
    // Persist off: cold, nothing served, and the files go with the engine.
    let (third, hits) = run(cfg(dir.path(), false), &ps);
    assert_eq!(third, want);
    assert_eq!(hits, 0);
}
