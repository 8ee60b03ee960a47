//! Two reference engines attached to one node tier (`kvtier node`, here a `NodeServer` in the
//! test process): the second engine's prompts are served from blocks the first stored, with
//! tokens identical to a run without kvtier; an engine that goes away mid-run leaves the other
//! correct. (Each engine is what one engine process holds: its own leader, workers and node
//! connections; the node only sees connections.)
#![allow(clippy::unwrap_used)]
mod common;

use std::path::Path;
use std::time::Duration;

use common::{prompts, reference, request, run_all};
use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle};
use kvtier_io::storage::node::{NodeOptions, NodeServer};

const IDLE: Duration = Duration::from_secs(60);

fn node(dir: &Path) -> NodeServer {
    let mut o = NodeOptions::new(dir.join("node.sock"), 64 << 20);
    o.shm_dir = dir.to_path_buf();
    NodeServer::start(&o).unwrap()
}

/// A node-only engine: no host tier of its own, the node's arena is its G2 (device <-> arena).
fn engine_cfg(seed: u64, socket: &Path) -> EngineConfig {
    engine_cfg_with(seed, socket, None)
}

/// An engine whose own host tier (`host` blocks) stages puts in front of the node.
fn engine_cfg_with(seed: u64, socket: &Path, host: Option<u64>) -> EngineConfig {
    let mut kv = KvtierConfig::default();
    kv.host.size = host.map(TierSize::Blocks);
    kv.remote = Some(RemoteTarget::parse(&format!("node://{}", socket.display())).unwrap());
    kv.validate().unwrap();
    let mut c = EngineConfig::builtin(seed);
    c.num_device_blocks = 24;
    c.max_batch_tokens = 96;
    c.connector = Some(ConnectorSetup::new(kv));
    c
}

#[test]
fn a_second_engine_is_served_from_blocks_the_first_stored() {
    second_engine_served(None);
}

#[test]
fn a_second_engine_is_served_through_host_staging_tiers() {
    second_engine_served(Some(16));
}

fn second_engine_served(host: Option<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path());
    let ps = prompts(8, 64);
    let want = reference(engine_cfg_with(31, n.socket(), host), &ps, 8);

    let a = EngineHandle::start(engine_cfg_with(31, n.socket(), host)).unwrap();
    let got_a = run_all(&a, ps.iter().map(|p| request(p, 8)).collect());
    assert!(a.wait_idle(IDLE));
    assert!(
        got_a.iter().map(|g| &g.0).eq(want.iter()),
        "engine A differs"
    );
    assert!(
        n.stats().puts > 0,
        "engine A stored nothing in the node: {:?}",
        n.stats()
    );

    let b = EngineHandle::start(engine_cfg_with(31, n.socket(), host)).unwrap();
    let got_b = run_all(&b, ps.iter().map(|p| request(p, 8)).collect());
    assert!(
        got_b.iter().map(|g| &g.0).eq(want.iter()),
        "engine B differs"
    );
    let mb = b.metrics();
    assert!(
        mb.kvtier_matched_tokens_remote > 0,
        "engine B loaded nothing from the node: {mb:?}"
    );
    a.shutdown();
    b.shutdown();
}

#[test]
fn an_engine_leaving_mid_run_leaves_the_other_correct() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path());
    let ps = prompts(10, 80);
    let want = reference(engine_cfg(32, n.socket()), &ps, 6);
    let a = EngineHandle::start(engine_cfg(32, n.socket())).unwrap();
    let b = EngineHandle::start(engine_cfg(32, n.socket())).unwrap();
    // A is torn down while its requests are in flight (its streams end early).
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| a.submit(request(p, 6)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    a.shutdown();
    drop(rxs);
    drop(a);
    let got = run_all(&b, ps.iter().map(|p| request(p, 6)).collect());
    assert!(got.iter().map(|g| &g.0).eq(want.iter()), "engine B differs");
    // And again, now partly from the node.
    let again = run_all(&b, ps.iter().map(|p| request(p, 6)).collect());
    assert!(
        again.iter().map(|g| &g.0).eq(want.iter()),
        "engine B differs on replay"
    );
    b.shutdown();
}
