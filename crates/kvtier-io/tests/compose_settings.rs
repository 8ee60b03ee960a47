//! Every documented setting, given through every source (TOML file, `KVTIER_*`, the `DYN_KVBM_*`
//! alias, vLLM's `kv_connector_extra_config` (nested, typed JSON) and TensorRT-LLM's settings
//! (dotted keys, string values)), observed in the components the composition root builds: the
//! leader's pools and policies, the rank's transfer engine and disk files, the remote store,
//! the metrics endpoint. Pins #16: settings that were parsed but read by nothing (the disk
//! filter under vLLM/TensorRT-LLM, `metrics.*`), and wiring that differed between engines.
//!
//! The adapter-level settings (`connector.leader_worker_timeout_secs`, `connector.zmq_endpoint`,
//! `connector.async_loads`, `connector.sync_host_loads`) act in the Python bindings and are observed in
//! `tests/test_settings_sources.py`; [`every_documented_key_is_covered`] keeps the two lists whole.
#![allow(clippy::unwrap_used)]
use kvtier::hash::SequenceHash;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvtier::config::{KvtierConfig, SETTINGS};
use kvtier::connector::messages::ClusterLayout;
use kvtier::connector::{DiskPolicy, Leader};
use kvtier::layout::{self, DType, DeviceLayout, TensorDesc};
use kvtier::policy::FilterParams;
use kvtier::transfer::RemoteStore;
use kvtier_io::compose::{Composition, EngineIdentity, HostMemory, RankTiers, ServingRole};
use kvtier_io::metrics_http::StatsPublisher;
use kvtier_io::{EngineMemory, PinMode, TensorMemory};

const BS: usize = 16;
/// [16 blocks, 1 layer, K/V, 16 tokens x 4 floats]: 512 bytes per block.
const SHAPE: [usize; 4] = [16, 1, 2, BS * 4];
const BPB: usize = 512;

/// The adapter-level keys, observed in tests/test_settings_sources.py.
const PY_ONLY: &[&str] = &[
    "connector.leader_worker_timeout_secs",
    "connector.zmq_endpoint",
    "connector.async_loads",
    "connector.sync_host_loads",
];

#[derive(Clone, Copy, Debug)]
enum Source {
    Toml,
    Env,
    Alias(&'static str),
    NegatedAlias(&'static str),
    /// vLLM `kv_connector_extra_config`: nested JSON with typed values.
    Vllm,
    /// TensorRT-LLM settings dict: dotted keys, string values.
    Trtllm,
}

struct Built {
    plan: Composition,
    leader: Leader,
    tiers: RankTiers,
    remote: Option<Arc<dyn RemoteStore>>,
    metrics: Option<StatsPublisher>,
    _kv: Vec<f32>,
}

fn typed(v: &str) -> serde_json::Value {
    if let Ok(b) = v.parse::<bool>() {
        return b.into();
    }
    if let Ok(i) = v.parse::<i64>() {
        return i.into();
    }
    if let Ok(f) = v.parse::<f64>() {
        return f.into();
    }
    v.into()
}

fn toml_value(v: &str) -> String {
    match typed(v) {
        serde_json::Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn nest(key: &str, v: serde_json::Value) -> serde_json::Value {
    key.rsplit('.')
        .fold(v, |acc, part| serde_json::json!({ part: acc }))
}

fn build(src: Source, key: &str, value: &str, base: &[(&str, String)]) -> Result<Built, String> {
    let mut toml: BTreeMap<String, String> = base
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let mut env = HashMap::new();
    let mut engine = None;
    let setting = SETTINGS.iter().find(|s| s.key == key).unwrap();
    match src {
        Source::Toml => {
            // In one layer `num_blocks` beats `gb`: the TOML case replaces the base's size.
            for (a, b) in [
                ("host.gb", "host.num_blocks"),
                ("disk.gb", "disk.num_blocks"),
            ] {
                if key == a {
                    toml.remove(b);
                }
            }
            toml.insert(key.into(), value.into());
        }
        Source::Env => {
            env.insert(setting.env.to_string(), value.to_string());
        }
        Source::Alias(a) | Source::NegatedAlias(a) => {
            env.insert(a.to_string(), value.to_string());
        }
        Source::Vllm => engine = Some(nest(key, typed(value))),
        Source::Trtllm => engine = Some(serde_json::json!({ key: value })),
    }
    let text: String = toml
        .iter()
        .map(|(k, v)| format!("{k} = {}\n", toml_value(v)))
        .collect();
    let cfg = KvtierConfig::build(Some(&text), &env, engine.as_ref()).map_err(|e| e.to_string())?;
    let mut kv = vec![0f32; SHAPE.iter().product()];
    let desc = TensorDesc::contiguous(
        "kv_pool",
        kv.as_mut_ptr() as usize as u64,
        SHAPE.to_vec(),
        4,
        layout::DeviceKind::Cpu,
    );
    let dl = DeviceLayout::trtllm(&desc, BS, DType::F32).unwrap();
    assert_eq!(dl.bytes_per_block(), BPB);
    let cluster = ClusterLayout {
        block_size: BS as u32,
        num_device_blocks: SHAPE[0] as u32,
        bytes_per_block: vec![BPB as u64],
    };
    let plan = Composition::new(
        &cfg,
        EngineIdentity::new("model-a"),
        cluster,
        ServingRole::Aggregated,
    )
    .map_err(|e| e.to_string())?;
    let remote = plan.remote_store().map_err(|e| e.to_string())?;
    let host = HostMemory {
        pin: PinMode::Never,
        touch_threads: 1,
        ..HostMemory::default()
    };
    let tiers = plan
        .transfer(
            0,
            EngineMemory::from_tensors(dl, vec![TensorMemory::of(&desc, None).unwrap()])
                .map_err(|e| e.to_string())?,
            host,
            remote.clone(),
        )
        .map_err(|e| e.to_string())?;
    let leader = plan
        .leader(remote.clone(), true)
        .map_err(|e| e.to_string())?;
    let metrics = plan.metrics().map_err(|e| e.to_string())?;
    Ok(Built {
        plan,
        leader,
        tiers,
        remote,
        metrics,
        _kv: kv,
    })
}

type Check = Box<dyn Fn(&Result<Built, String>) -> Result<(), String>>;

fn ok(b: &Result<Built, String>) -> Result<&Built, String> {
    b.as_ref().map_err(|e| format!("build failed: {e}"))
}

fn expect(cond: bool, what: String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what)
    }
}

fn host_blocks(n: usize) -> Check {
    Box::new(move |b| {
        let b = ok(b)?;
        let h = b.tiers.engine.host().map_or(0, |h| h.num_blocks() as usize);
        expect(
            b.leader.stats().host_capacity == n && h == n,
            format!(
                "host pool {} / tier {h}, want {n}",
                b.leader.stats().host_capacity
            ),
        )
    })
}

fn disk_blocks(n: usize) -> Check {
    Box::new(move |b| {
        let b = ok(b)?;
        let d = b.tiers.engine.disk().map_or(0, |d| d.num_blocks() as usize);
        expect(
            b.leader.stats().disk_capacity == n && d == n,
            format!(
                "disk pool {} / tier {d}, want {n}",
                b.leader.stats().disk_capacity
            ),
        )
    })
}

fn disk_policy(want: DiskPolicy) -> Check {
    Box::new(move |b| {
        let b = ok(b)?;
        expect(
            b.leader.disk_policy() == want,
            format!(
                "leader disk policy {:?}, want {want:?}",
                b.leader.disk_policy()
            ),
        )
    })
}

fn filter(window: u64, max_tracked: usize) -> DiskPolicy {
    DiskPolicy::Filter(FilterParams {
        window: Duration::from_secs(window),
        max_tracked,
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scrape(port: u16) -> String {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(c, "GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

struct Row {
    key: &'static str,
    value: String,
    base: Vec<(&'static str, String)>,
    check: Check,
}

fn rows(tmp: &Path) -> Vec<Row> {
    let d = tmp.join("disk").display().to_string();
    let base = |extra: &[(&'static str, &str)]| -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("host.num_blocks", "8".to_string()),
            ("disk.dir", d.clone()),
        ];
        v.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        v
    };
    let other_dir = tmp.join("elsewhere");
    let other = other_dir.display().to_string();
    let remote_dir = tmp.join("remote");
    let mac_dir = tmp.join("remote-keyed");
    let mac_key = tmp.join("mac.key");
    std::fs::write(&mac_key, b"a cluster secret of this test\n").unwrap();
    let with_disk = base(&[("disk.num_blocks", "4")]);
    let default_salt = {
        let b = build(Source::Toml, "host.num_blocks", "8", &base(&[])).unwrap();
        b.leader.salt()
    };
    vec![
        // 4000 bytes / 512 per block.
        Row {
            key: "host.gb",
            value: "0.000004".into(),
            base: base(&[]),
            check: host_blocks(7),
        },
        Row {
            key: "host.num_blocks",
            value: "5".into(),
            base: base(&[]),
            check: host_blocks(5),
        },
        // 40000 bytes / (4 KiB header page + 512 bytes rounded up to 4 KiB) per slot (#28: the
        // header page was left out, 78 blocks).
        Row {
            key: "disk.gb",
            value: "0.00004".into(),
            base: base(&[]),
            check: disk_blocks(4),
        },
        Row {
            key: "disk.num_blocks",
            value: "6".into(),
            base: base(&[]),
            check: disk_blocks(6),
        },
        Row {
            key: "disk.dir",
            value: other.clone(),
            base: with_disk.clone(),
            check: Box::new(move |b| {
                let b = ok(b)?;
                let files = b
                    .tiers
                    .engine
                    .disk()
                    .map(|d| d.file_paths())
                    .unwrap_or_default();
                expect(
                    !files.is_empty() && files.iter().all(|f| f.starts_with(&other_dir)),
                    format!("disk files {files:?} not under {}", other_dir.display()),
                )
            }),
        },
        Row {
            key: "disk.use_o_direct",
            value: "false".into(),
            base: with_disk.clone(),
            check: Box::new(|b| {
                let d = ok(b)?.tiers.engine.disk().cloned();
                expect(
                    d.is_some_and(|d| !d.is_direct()),
                    "disk opened with O_DIRECT".into(),
                )
            }),
        },
        Row {
            key: "disk.persist",
            value: "false".into(),
            base: with_disk.clone(),
            check: Box::new(|b| {
                let d = ok(b)?.tiers.engine.disk().cloned();
                expect(
                    d.is_some_and(|d| !d.persists()),
                    "the disk tier keeps a journal with disk.persist = false".into(),
                )
            }),
        },
        Row {
            key: "disk.io_backend",
            value: "pread".into(),
            base: with_disk.clone(),
            check: Box::new(|b| {
                let d = ok(b)?.tiers.engine.disk().cloned();
                expect(
                    d.is_some_and(|d| !d.uses_io_uring()),
                    "disk uses io_uring".into(),
                )
            }),
        },
        Row {
            key: "remote.url",
            value: format!("dir://{}", remote_dir.display()),
            base: base(&[]),
            check: Box::new(move |b| {
                let b = ok(b)?;
                let r = b.remote.as_ref().ok_or("no remote store")?;
                r.put(SequenceHash(0xabc), b"block")
                    .map_err(|e| e.to_string())?;
                let ns_dir = walk_dirs(&remote_dir)
                    .into_iter()
                    .any(|p| p.ends_with(b.plan.namespace()));
                expect(
                    b.leader.remote_put()
                        && r.contains(&[SequenceHash(0xabc)])
                            .map_err(|e| e.to_string())?
                            == vec![true]
                        && ns_dir,
                    format!(
                        "remote store under {} lacks namespace {}",
                        remote_dir.display(),
                        b.plan.namespace()
                    ),
                )
            }),
        },
        // The key file makes each value's tag a keyed MAC: the stored frame's flags say so.
        Row {
            key: "remote.mac_key_file",
            value: mac_key.display().to_string(),
            base: base(&[("remote.url", &format!("dir://{}", mac_dir.display()))]),
            check: Box::new(move |b| {
                let b = ok(b)?;
                let r = b.remote.as_ref().ok_or("no remote store")?;
                r.put(SequenceHash(0xabc), b"block")
                    .map_err(|e| e.to_string())?;
                let file = walk_files(&mac_dir).pop().ok_or("no value file")?;
                let v = std::fs::read(&file).map_err(|e| e.to_string())?;
                expect(
                    v.get(6) == Some(&2),
                    format!("{file:?} is not keyed: {:?}", v.get(..8)),
                )
            }),
        },
        Row {
            key: "policy.disk_filter.enabled",
            value: "false".into(),
            base: with_disk.clone(),
            check: disk_policy(DiskPolicy::WriteThrough),
        },
        Row {
            key: "policy.disk_filter.window_secs",
            value: "30".into(),
            base: with_disk.clone(),
            check: disk_policy(filter(30, 1_000_000)),
        },
        Row {
            key: "policy.disk_filter.max_tracked",
            value: "77".into(),
            base: with_disk.clone(),
            check: disk_policy(filter(600, 77)),
        },
        Row {
            key: "connector.block_size",
            value: "32".into(),
            base: base(&[]),
            check: Box::new(|b| match b {
                Err(e) if e.contains("connector.block_size") && e.contains("differs") => Ok(()),
                Err(e) => Err(format!("wrong error: {e}")),
                Ok(_) => Err("a block size other than the engine's was accepted".into()),
            }),
        },
        Row {
            key: "hashing.model",
            value: "model-b".into(),
            base: base(&[]),
            check: Box::new(move |b| {
                let b = ok(b)?;
                let want = EngineIdentity::new("model-b");
                expect(
                    b.plan.namespace() == want.namespace() && b.leader.salt() != default_salt,
                    format!(
                        "namespace {} / salt {:?}",
                        b.plan.namespace(),
                        b.leader.salt()
                    ),
                )
            }),
        },
        Row {
            key: "hashing.salt",
            value: "tenant-a".into(),
            base: base(&[]),
            check: Box::new(move |b| {
                let b = ok(b)?;
                expect(
                    b.leader.salt() != default_salt
                        && b.plan.namespace() == EngineIdentity::new("model-a").namespace(),
                    format!("salt {:?} (default {default_salt:?})", b.leader.salt()),
                )
            }),
        },
    ]
}

fn walk_files(root: &Path) -> Vec<std::path::PathBuf> {
    walk_dirs(root)
        .into_iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect()
}

fn walk_dirs(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                out.push(e.path());
                stack.push(e.path());
            }
        }
    }
    out
}

fn sources(key: &str) -> Vec<Source> {
    let s = SETTINGS.iter().find(|s| s.key == key).unwrap();
    let mut v = vec![Source::Toml, Source::Env, Source::Vllm, Source::Trtllm];
    v.extend(s.aliases.iter().map(|a| Source::Alias(a)));
    v.extend(s.negated_aliases.iter().map(|a| Source::NegatedAlias(a)));
    v
}

#[test]
fn every_setting_through_every_source_reaches_the_components() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("disk")).unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for row in rows(tmp.path()) {
        for src in sources(row.key) {
            let value = match src {
                // `DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=true` turns the filter off.
                Source::NegatedAlias(_) => match row.value.as_str() {
                    "false" => "true".to_string(),
                    _ => continue,
                },
                _ => row.value.clone(),
            };
            let built = build(src, row.key, &value, &row.base);
            if let Err(why) = (row.check)(&built) {
                failures.push(format!("{} via {src:?}: {why}", row.key));
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked >= 60, "{checked} cases");
}

#[test]
fn metrics_settings_start_the_endpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let base = vec![("host.num_blocks", "8".to_string())];
    // The first leader of the process binds the port (TOML first, so that source is exact).
    let port = free_port();
    let mut enabled_base = base.clone();
    enabled_base.push(("metrics.enabled", "true".into()));
    let mut served = None;
    for src in sources("metrics.port") {
        let b = build(src, "metrics.port", &port.to_string(), &enabled_base).unwrap();
        assert_eq!(b.plan.config().metrics.port, port, "{src:?}");
        let p = b
            .metrics
            .as_ref()
            .expect("metrics.enabled gave no endpoint");
        p.publish(b.leader.stats());
        let addr = kvtier_io::metrics_http::endpoint_addr().unwrap();
        assert_eq!(
            *served.get_or_insert(addr),
            addr,
            "one endpoint per process"
        );
        assert_eq!(addr.port(), port, "{src:?}: endpoint not on metrics.port");
        let text = scrape(port);
        assert!(
            text.contains("kvtier_pool_capacity_blocks{tier=\"host\"} 8"),
            "{src:?}\n{text}"
        );
    }
    let _ = tmp;
    let mut port_base = base.clone();
    port_base.push(("metrics.port", port.to_string()));
    for src in sources("metrics.enabled") {
        let on = build(src, "metrics.enabled", "true", &port_base).unwrap();
        assert!(
            on.metrics.is_some(),
            "{src:?}: metrics.enabled did not register"
        );
        let off = build(src, "metrics.enabled", "false", &port_base).unwrap();
        assert!(off.metrics.is_none(), "{src:?}");
    }
}

#[test]
fn every_documented_key_is_covered() {
    let tmp = tempfile::tempdir().unwrap();
    let mut covered: Vec<&str> = rows(tmp.path()).iter().map(|r| r.key).collect();
    covered.extend(["metrics.enabled", "metrics.port"]);
    covered.extend(PY_ONLY);
    for s in SETTINGS {
        assert!(covered.contains(&s.key), "{} has no effect test", s.key);
    }
    let py = include_str!("../../../tests/test_settings_sources.py");
    for k in PY_ONLY {
        assert!(
            py.contains(k),
            "{k} missing from tests/test_settings_sources.py"
        );
    }
}
