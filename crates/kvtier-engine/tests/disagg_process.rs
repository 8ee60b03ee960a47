//! Disaggregated serving across processes: this test process runs the prefill engine, a child
//! process (this same test binary, running the ignored `decode_child` test) runs the decode
//! engine; the KV travels through a shared `dir://` remote store. The decode process's tokens
//! must equal an aggregated run's, and its metrics must show the KV came from the remote store.
#![allow(clippy::unwrap_used)]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{collect, prompts, reference, request};
use kvtier::config::{KvtierConfig, RemoteTarget, TierSize};
use kvtier_engine::{ConnectorSetup, EngineConfig, EngineHandle, FinishReason, Prefilled, Role};

const SEED: u64 = 31;
const MAX_TOKENS: usize = 10;
const CHILD_ENV: &str = "KVTIER_ENGINE_DECODE_CHILD_DIR";

fn engine(role: Role, remote: &Path) -> EngineConfig {
    let mut kv = KvtierConfig::default();
    kv.host.size = Some(TierSize::Blocks(128));
    kv.remote = Some(RemoteTarget::dir(remote));
    let mut c = EngineConfig::builtin(SEED);
    c.num_device_blocks = 64;
    c.role = role;
    c.connector = Some(ConnectorSetup::new(kv));
    c
}

#[test]
fn cross_process_disaggregation_matches_aggregated() {
    let work = tempfile::tempdir().unwrap();
    let remote = work.path().join("remote");
    std::fs::create_dir_all(&remote).unwrap();
    let ps = prompts(6, 48);
    let want = reference(EngineConfig::builtin(SEED), &ps, MAX_TOKENS);

    let prefill = EngineHandle::start(engine(Role::Prefill, &remote)).unwrap();
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| prefill.submit(request(p, MAX_TOKENS)).unwrap())
        .collect();
    let firsts: Vec<u32> = rxs
        .into_iter()
        .map(|rx| {
            let (t, reason) = collect(rx);
            assert_eq!(reason, FinishReason::Prefilled);
            t[0]
        })
        .collect();
    assert!(prefill.metrics().remote_put_blocks > 0);
    prefill.shutdown();

    let job = serde_json::json!({ "remote": remote, "prompts": ps, "firsts": firsts });
    std::fs::write(work.path().join("job.json"), job.to_string()).unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "decode_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, work.path())
        .status()
        .unwrap();
    assert!(status.success(), "decode process failed");
    let out: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.path().join("out.json")).unwrap())
            .unwrap();
    let got: Vec<Vec<u32>> = serde_json::from_value(out["tokens"].clone()).unwrap();
    assert_eq!(
        got, want,
        "decode process tokens differ from the aggregated run"
    );
    let remote_tokens = out["remote_tokens"].as_u64().unwrap();
    let full: usize = ps.iter().map(|p| p.len() / 16 * 16).sum();
    assert!(
        remote_tokens > 0 && remote_tokens as usize <= full,
        "remote tokens {remote_tokens}, full {full}"
    );
    assert_eq!(out["load_failures"].as_u64().unwrap(), 0);
}

/// The decode side; runs only when the parent test starts it.
#[test]
#[ignore = "started by cross_process_disaggregation_matches_aggregated in a child process"]
fn decode_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let job: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("job.json")).unwrap()).unwrap();
    let remote: PathBuf = serde_json::from_value(job["remote"].clone()).unwrap();
    let ps: Vec<Vec<u32>> = serde_json::from_value(job["prompts"].clone()).unwrap();
    let firsts: Vec<u32> = serde_json::from_value(job["firsts"].clone()).unwrap();
    let decode = EngineHandle::start(engine(Role::Decode, &remote)).unwrap();
    let rxs: Vec<_> = ps
        .iter()
        .zip(&firsts)
        .map(|(p, &t)| {
            let mut r = request(p, MAX_TOKENS);
            r.prefilled = Some(Prefilled { first_token: t });
            decode.submit(r).unwrap()
        })
        .collect();
    let tokens: Vec<Vec<u32>> = rxs.into_iter().map(|rx| collect(rx).0).collect();
    let m = decode.metrics();
    let out = serde_json::json!({
        "tokens": tokens,
        "remote_tokens": m.kvtier_matched_tokens_remote,
        "load_failures": m.load_failures,
    });
    std::fs::write(dir.join("out.json"), out.to_string()).unwrap();
}
