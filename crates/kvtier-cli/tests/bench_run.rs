//! `kvtier bench` end to end on the real reference engine (built-in model), small workloads: the three
//! baselines really differ in what they reuse, the disk tier's offloads and hits are counted, and the
//! report carries kvtier's ratios against both engine-only baselines.
#![allow(clippy::unwrap_used)]

use kvtier_cli::bench::command::{run, BenchArgs};
use serde_json::Value;

fn row<'a>(v: &'a Value, workload: &str, config: &str) -> &'a Value {
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["workload"] == workload && r["config"] == config)
        .unwrap_or_else(|| panic!("no row {workload}/{config}"))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cache_prefix_cache_and_disk_tier_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // Chat: two users share a 64-token system prompt, which G1's prefix cache keeps. Docqa: six
    // 256-token documents visited round-robin, twice each: 96 blocks of history against a G1 of 24
    // blocks and a host tier of 61, so second visits find their document on disk only.
    let args = BenchArgs::parse_flags(&[
        "--out",
        out.to_str().unwrap(),
        "--workloads",
        "chat,docqa",
        "--users",
        "2",
        "--rounds",
        "2",
        "--system-tokens",
        "64",
        "--chat-qps",
        "200",
        "--configs",
        "no-cache,engine,kvtier-disk",
        "--docs",
        "6",
        "--doc-tokens",
        "256",
        "--questions-per-doc",
        "2",
        "--question-tokens",
        "16",
        "--answer-tokens",
        "4",
        "--docqa-qps",
        "200",
        "--num-device-blocks",
        "24",
        "--disk-cache-gb",
        "0.05",
        "--quiet",
    ])
    .unwrap();
    run(args).await.unwrap();
    let v: Value = serde_json::from_slice(&std::fs::read(out.join("bench.json")).unwrap()).unwrap();
    assert_eq!(v["outputs_identical"], true, "{}", v["mismatches"]);

    for w in ["chat", "docqa"] {
        let none = row(&v, w, "no-cache");
        assert_eq!(none["hit_rate"]["device"], 0.0);
        assert_eq!(
            u(&none["computed_prompt_tokens"]),
            u(&none["prompt_tokens"]),
            "no-cache reused something: {none}"
        );
        let engine = row(&v, w, "engine");
        assert_eq!(u(&engine["prompt_tokens"]), u(&none["prompt_tokens"]));
        assert!(u(&engine["computed_prompt_tokens"]) <= u(&none["computed_prompt_tokens"]));
    }
    let engine = row(&v, "chat", "engine");
    assert!(
        u(&engine["computed_prompt_tokens"])
            < u(&row(&v, "chat", "no-cache")["computed_prompt_tokens"]),
        "the prefix cache reused nothing: {engine}"
    );

    let disk = row(&v, "docqa", "kvtier-disk");
    assert!(
        disk["hit_rate"]["disk"].as_f64().unwrap() > 0.0,
        "disk served nothing: {disk}"
    );
    assert!(u(&disk["onboarded_blocks"]["disk"]) > 0, "{disk}");
    assert!(
        u(&disk["offloaded_blocks"]["disk"]) > 0,
        "disk served hits but no offload to disk was counted: {disk}"
    );
    assert!(u(&disk["offloaded_blocks"]["host"]) > 0, "{disk}");

    let ratios: Vec<(&str, &str)> = v["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["config"].as_str().unwrap(),
                r["baseline"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ratios,
        [
            ("kvtier-disk", "no-cache"),
            ("kvtier-disk", "engine"),
            ("kvtier-disk", "no-cache"),
            ("kvtier-disk", "engine")
        ]
    );
    assert_eq!(v["target"]["baseline"], "engine");
    let md = std::fs::read_to_string(out.join("bench.md")).unwrap();
    assert!(
        md.contains("| vs no-cache (p50) | vs engine (p50) |"),
        "{md}"
    );
    assert!(out.join("bench.png").is_file());
}
