//! Configuration layering, aliases, validation messages and capacity resolution.
#![allow(clippy::unwrap_used)]
use std::collections::HashMap;
use std::path::PathBuf;

use kvtier::config::*;

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn setting_of(e: &ConfigError) -> String {
    match e {
        ConfigError::Invalid { setting, .. } => setting.clone(),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn defaults_with_only_a_host_tier() {
    let c = KvtierConfig::build(None, &env(&[("DYN_KVBM_CPU_CACHE_GB", "4")]), None).unwrap();
    assert_eq!(c.host.size, Some(TierSize::Gb(4.0)));
    assert_eq!(c.disk.size, None);
    assert_eq!(c.disk.dir, PathBuf::from("/tmp"));
    assert!(c.disk.use_o_direct);
    assert_eq!(c.disk.io_backend, IoBackend::Auto);
    assert_eq!(c.remote, None);
    assert_eq!(
        c.policy.disk_filter,
        DiskFilterConfig {
            enabled: true,
            window_secs: 600,
            max_tracked: 1_000_000
        }
    );
    assert_eq!(c.connector.leader_worker_timeout_secs, 120);
    assert_eq!(
        c.metrics,
        MetricsConfig {
            enabled: false,
            port: 6880
        }
    );
}

#[test]
fn no_tier_is_an_error() {
    assert_eq!(
        KvtierConfig::build(None, &env(&[]), None),
        Err(ConfigError::NoOffloadTier)
    );
    // 0 GB means "no tier".
    assert_eq!(
        KvtierConfig::build(None, &env(&[("KVTIER_HOST_GB", "0")]), None),
        Err(ConfigError::NoOffloadTier)
    );
    // A disk tier alone is a configuration (disk-only); a remote tier alone is not.
    let c = KvtierConfig::build(None, &env(&[("DYN_KVBM_DISK_CACHE_GB", "10")]), None).unwrap();
    assert_eq!((c.host.size, c.disk.size), (None, Some(TierSize::Gb(10.0))));
    let e = KvtierConfig::build(
        None,
        &env(&[
            ("KVTIER_REMOTE_URL", "dir:///shared/kv"),
            ("KVTIER_DISK_GB", "1"),
        ]),
        None,
    )
    .unwrap_err();
    assert!(setting_of(&e).contains("remote.url"), "{e}");
    assert!(e.to_string().contains("needs a host tier"), "{e}");
    // The node tier may stand alone: its shared arena is the engine's G2 (node-only).
    let c = KvtierConfig::build(
        None,
        &env(&[
            ("KVTIER_REMOTE_URL", "node:///run/kvtier/node.sock"),
            ("KVTIER_HOST_NUM_BLOCKS", "0"),
        ]),
        None,
    )
    .unwrap();
    assert_eq!(c.host.size, None);
    assert!(c.remote.is_some());
}

#[test]
fn every_original_alias_is_read() {
    let c = KvtierConfig::build(
        None,
        &env(&[
            ("DYN_KVBM_CPU_CACHE_GB", "2.5"),
            ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "1000"),
            ("DYN_KVBM_DISK_CACHE_DIR", "/mnt/nvme"),
            ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true"),
            ("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "900"),
            ("DYN_KVBM_METRICS", "1"),
            ("DYN_KVBM_METRICS_PORT", "9100"),
        ]),
        None,
    )
    .unwrap();
    assert_eq!(c.host.size, Some(TierSize::Gb(2.5)));
    assert_eq!(c.disk.size, Some(TierSize::Blocks(1000)));
    assert_eq!(c.disk.dir, PathBuf::from("/mnt/nvme"));
    assert!(!c.policy.disk_filter.enabled);
    assert_eq!(c.connector.leader_worker_timeout_secs, 900);
    assert_eq!(
        c.metrics,
        MetricsConfig {
            enabled: true,
            port: 9100
        }
    );
    let c = KvtierConfig::build(
        None,
        &env(&[
            ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "77"),
            ("DYN_KVBM_DISK_CACHE_GB", "1"),
        ]),
        None,
    )
    .unwrap();
    assert_eq!(c.host.size, Some(TierSize::Blocks(77)));
    assert_eq!(c.disk.size, Some(TierSize::Gb(1.0)));
}

#[test]
fn layers_override_in_order() {
    let toml = r#"
        [host]
        num_blocks = 100
        [disk]
        gb = 50
        dir = "/from/toml"
        io_backend = "pread"
        [policy.disk_filter]
        window_secs = 30
        max_tracked = 10
        [metrics]
        port = 7000
    "#;
    let e = env(&[
        ("KVTIER_HOST_GB", "8"), // clears host.num_blocks from TOML
        ("KVTIER_DISK_DIR", "/from/env"),
        ("DYN_KVBM_METRICS_PORT", "7001"),
        ("KVTIER_METRICS_PORT", "7002"), // canonical name beats the alias
    ]);
    let engine = serde_json::json!({"disk": {"dir": "/from/engine"}, "policy.disk_filter.max_tracked": 20, "hashing": {"model": null}});
    let c = KvtierConfig::build(Some(toml), &e, Some(&engine)).unwrap();
    assert_eq!(c.host.size, Some(TierSize::Gb(8.0)));
    assert_eq!(c.disk.size, Some(TierSize::Gb(50.0)));
    assert_eq!(c.disk.dir, PathBuf::from("/from/engine"));
    assert_eq!(c.disk.io_backend, IoBackend::Pread);
    assert_eq!(c.policy.disk_filter.max_tracked, 20);
    assert_eq!(c.policy.disk_filter.window_secs, 30);
    assert_eq!(c.metrics.port, 7002);
    assert_eq!(c.hashing.model, None);
    // In one layer both size forms: the block count wins.
    let c = KvtierConfig::build(
        None,
        &env(&[("KVTIER_HOST_GB", "8"), ("KVTIER_HOST_NUM_BLOCKS", "5")]),
        None,
    )
    .unwrap();
    assert_eq!(c.host.size, Some(TierSize::Blocks(5)));
}

#[test]
fn engine_string_map() {
    let m: HashMap<String, String> = [
        ("host.gb", "1"),
        ("remote.url", "redis://127.0.0.1:6379"),
        ("connector.block_size", "32"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    let c = KvtierConfig::builder()
        .env(&env(&[]))
        .engine_strings(&m)
        .build()
        .unwrap();
    assert_eq!(
        c.remote,
        Some(RemoteTarget::parse("redis://127.0.0.1:6379").unwrap())
    );
    assert_eq!(c.connector.block_size, Some(32));
}

#[test]
fn invalid_values_name_the_setting_as_given() {
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case] = &[
        (
            &[("DYN_KVBM_CPU_CACHE_GB", "lots")],
            "DYN_KVBM_CPU_CACHE_GB",
            "not a number",
        ),
        (&[("KVTIER_HOST_GB", "-1")], "KVTIER_HOST_GB", "GB"),
        (
            &[("KVTIER_HOST_GB", "1"), ("DYN_KVBM_METRICS_PORT", "70000")],
            "DYN_KVBM_METRICS_PORT",
            "port",
        ),
        (
            &[
                ("KVTIER_HOST_GB", "1"),
                ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "maybe"),
            ],
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER",
            "boolean",
        ),
        (
            &[("KVTIER_HOST_GB", "1"), ("KVTIER_DISK_IO_BACKEND", "aio")],
            "KVTIER_DISK_IO_BACKEND",
            "auto, uring, pread",
        ),
        (
            &[("KVTIER_HOST_GB", "1"), ("KVTIER_REMOTE_URL", "http://x")],
            "KVTIER_REMOTE_URL",
            "redis://",
        ),
        (
            &[
                ("KVTIER_HOST_GB", "1"),
                ("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "0"),
            ],
            "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS",
            "greater than 0",
        ),
        (
            &[
                ("KVTIER_HOST_GB", "1"),
                ("KVTIER_ZMQ_ENDPOINT", "localhost:5555"),
            ],
            "KVTIER_ZMQ_ENDPOINT",
            "ZeroMQ",
        ),
        (
            &[("KVTIER_HOST_GB", "1"), ("KVTIER_DISK_DIR", " ")],
            "KVTIER_DISK_DIR",
            "empty",
        ),
    ];
    for (pairs, setting, why) in cases {
        let e = KvtierConfig::build(None, &env(pairs), None).unwrap_err();
        let msg = e.to_string();
        assert_eq!(
            setting_of(&e),
            format!("{setting} (environment variable)"),
            "{msg}"
        );
        assert!(msg.contains(why), "{msg}");
    }
}

#[test]
fn toml_errors() {
    let e = KvtierConfig::build(Some("[host]\ngbs = 4\n"), &env(&[]), None).unwrap_err();
    assert_eq!(
        e,
        ConfigError::Unknown {
            setting: "host.gbs".into(),
            source_name: "TOML".into()
        }
    );
    let e = KvtierConfig::build(Some("[host\n"), &env(&[]), None).unwrap_err();
    assert!(matches!(e, ConfigError::File { .. }), "{e}");
    let e = KvtierConfig::build(Some("[host]\ngb = \"x\"\n"), &env(&[]), None).unwrap_err();
    assert_eq!(setting_of(&e), "host.gb (in TOML)");
    let e = KvtierConfig::build(
        None,
        &env(&[("KVTIER_HOST_GB", "1")]),
        Some(&serde_json::json!({"hots": {"gb": 1}})),
    )
    .unwrap_err();
    assert_eq!(
        e,
        ConfigError::Unknown {
            setting: "hots.gb".into(),
            source_name: "engine settings".into()
        }
    );
}

#[test]
fn load_reads_the_file_named_by_kvtier_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtier.toml");
    std::fs::write(
        &path,
        "[host]\ngb = 3\n[remote]\nurl = \"dir:///shared/kv\"\n",
    )
    .unwrap();
    let c = KvtierConfig::load(&env(&[("KVTIER_CONFIG", path.to_str().unwrap())]), None).unwrap();
    assert_eq!(c.host.size, Some(TierSize::Gb(3.0)));
    assert_eq!(c.remote, Some(RemoteTarget::dir("/shared/kv")));
    let e = KvtierConfig::load(&env(&[("KVTIER_CONFIG", "/nonexistent/kvtier.toml")]), None)
        .unwrap_err();
    assert!(
        matches!(e, ConfigError::File { ref path, .. } if path == "/nonexistent/kvtier.toml"),
        "{e}"
    );
}

/// `KVTIER_CONFIG` naming something that is not a small regular file is an error naming it, never
/// a read until memory runs out (`/dev/zero`) or an `open` that blocks forever (a FIFO).
#[test]
fn kvtier_config_is_a_small_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    std::fs::write(&big, format!("# {}\n", "x".repeat(2 << 20))).unwrap();
    for (path, reason) in [
        ("/dev/zero", "not a regular file"),
        (dir.path().to_str().unwrap(), "not a regular file"),
        (big.to_str().unwrap(), "larger than"),
    ] {
        let e = KvtierConfig::load(&env(&[("KVTIER_CONFIG", path)]), None).unwrap_err();
        assert!(
            matches!(e, ConfigError::File { path: ref p, reason: ref r } if p == path && r.contains(reason)),
            "{path}: {e}"
        );
    }
}

#[test]
fn capacity_in_decimal_gb_over_all_ranks() {
    let c = KvtierConfig::build(
        None,
        &env(&[
            ("DYN_KVBM_CPU_CACHE_GB", "4"),
            ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "123"),
        ]),
        None,
    )
    .unwrap();
    // Llama-3.1-8B, 16-token blocks, TP=2: 2 MiB per block per rank.
    let bpb = 2 * 2 * 1024 * 1024;
    let caps = c.resolve_capacity(bpb).unwrap();
    assert_eq!(
        caps,
        TierCapacities {
            host_blocks: 953,
            disk_blocks: 123,
            remote: false
        }
    );
    assert_eq!(4_000_000_000 / bpb, 953);
    let e = c.resolve_capacity(8_000_000_000).unwrap_err();
    assert!(e.to_string().contains("holds no block"), "{e}");
    assert!(c.resolve_capacity(0).is_err());
}

#[test]
fn every_setting_is_documented() {
    let doc = include_str!("../../../docs/CONFIG.md");
    for s in SETTINGS {
        assert!(
            doc.contains(&format!("`{}`", s.key)),
            "{} missing from docs/CONFIG.md",
            s.key
        );
        assert!(
            doc.contains(&format!("`{}`", s.env)),
            "{} missing from docs/CONFIG.md",
            s.env
        );
        for a in s.aliases.iter().chain(s.negated_aliases) {
            assert!(
                doc.contains(&format!("`{a}`")),
                "{a} missing from docs/CONFIG.md"
            );
        }
    }
}

#[test]
fn async_loads_layers_and_stays_unset_by_default() {
    let host = ("KVTIER_HOST_NUM_BLOCKS", "8");
    let c = KvtierConfig::build(None, &env(&[host]), None).unwrap();
    assert_eq!(
        c.connector.async_loads, None,
        "unset: the engine adapter decides"
    );
    let toml = "[connector]\nasync_loads = true\n";
    let c = KvtierConfig::build(Some(toml), &env(&[host]), None).unwrap();
    assert_eq!(c.connector.async_loads, Some(true));
    let c = KvtierConfig::build(
        Some(toml),
        &env(&[host, ("KVTIER_ASYNC_LOADS", "off")]),
        None,
    )
    .unwrap();
    assert_eq!(
        c.connector.async_loads,
        Some(false),
        "environment over TOML"
    );
    let engine = serde_json::json!({"connector.async_loads": true});
    let c = KvtierConfig::build(
        Some(toml),
        &env(&[host, ("KVTIER_ASYNC_LOADS", "0")]),
        Some(&engine),
    )
    .unwrap();
    assert_eq!(
        c.connector.async_loads,
        Some(true),
        "engine over environment"
    );
    let e = KvtierConfig::build(None, &env(&[host, ("KVTIER_ASYNC_LOADS", "maybe")]), None)
        .unwrap_err();
    assert_eq!(setting_of(&e), "KVTIER_ASYNC_LOADS (environment variable)");
}

/// `disk.persist` (warm restart of G3) is on by default and can be turned off.
#[test]
fn disk_persist_defaults_on() {
    let on = KvtierConfig::build(None, &env(&[("KVTIER_DISK_GB", "1")]), None).unwrap();
    assert!(on.disk.persist);
    let off = KvtierConfig::build(
        None,
        &env(&[("KVTIER_DISK_GB", "1"), ("KVTIER_DISK_PERSIST", "false")]),
        None,
    )
    .unwrap();
    assert!(!off.disk.persist);
    let e = KvtierConfig::build(
        None,
        &env(&[("KVTIER_DISK_GB", "1"), ("KVTIER_DISK_PERSIST", "maybe")]),
        None,
    )
    .unwrap_err();
    assert_eq!(setting_of(&e), "KVTIER_DISK_PERSIST (environment variable)");
}
