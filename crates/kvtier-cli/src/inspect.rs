//! `kvtier inspect`: print the resolved configuration, tier sizes in GB and blocks, and a summary of
//! what the disk tier directory holds.
//!
//! Invariant: read-only — it never creates, changes or deletes a file (the disk directory may not exist).

use std::path::Path;

use anyhow::Context;
use clap::Args;
#[cfg(test)]
use kvtier::config::RemoteTarget;
use kvtier::config::{KvtierConfig, RemoteBackend};
use kvtier_engine::{EngineHandle, Role};

use crate::settings::{ConnectorKind, EngineArgs};

/// `kvtier inspect` flags.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The engine and tier settings whose state to show.
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Files and bytes under a directory (recursive), plus the largest few files.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DirSummary {
    /// Whether the directory exists.
    pub exists: bool,
    /// Files under it.
    pub files: u64,
    /// Bytes of those files.
    pub bytes: u64,
    /// The largest files (path, bytes), largest first.
    pub largest: Vec<(String, u64)>,
}

/// Summarises `dir` without modifying it.
pub fn summarize_dir(dir: &Path) -> DirSummary {
    let mut s = DirSummary {
        exists: dir.is_dir(),
        ..Default::default()
    };
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                stack.push(e.path());
            } else if md.is_file() {
                s.files += 1;
                s.bytes += md.len();
                let rel = e
                    .path()
                    .strip_prefix(dir)
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                all.push((rel, md.len()));
            }
        }
    }
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(5);
    s.largest = all;
    s
}

/// `cfg` as inspect shows it: a Redis URL's password replaced by `***`.
pub fn redacted(cfg: &KvtierConfig) -> KvtierConfig {
    let mut c = cfg.clone();
    if let Some(t) = &mut c.remote {
        t.url = kvtier_io::storage::remote::redact_url(&t.url);
        if let RemoteBackend::Redis(r) = &mut t.backend {
            for seed in &mut r.cluster_seeds {
                *seed = kvtier_io::storage::remote::redact_url(seed);
            }
        }
    }
    c
}

/// Runs inspect.
pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let cfg = args
        .engine
        .tiers
        .kvtier_config()
        .context("resolving the kvtier configuration")?;
    // Everything inspect prints about the configuration comes from the redacted copy.
    let cfg = redacted(&cfg);
    // Start the engine without a connector only to learn the model's KV geometry.
    let mut probe = args.engine.clone();
    probe.connector = ConnectorKind::None;
    let engine =
        EngineHandle::start(probe.engine_config(Role::Aggregated)?).context("loading the model")?;
    let m = engine.model_config().clone();
    let model_name = engine.model_name();
    engine.shutdown();
    // f32 K and V, every layer.
    let bytes_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4;
    let bytes_per_block = bytes_per_token * args.engine.block_size;
    let caps = cfg.resolve_capacity_on_disk(
        bytes_per_block,
        kvtier_io::storage::disk::slot_bytes(bytes_per_block),
    )?;
    let device_gb = (args.engine.num_device_blocks * bytes_per_block) as f64 / 1e9;
    let gb = |blocks: usize| (blocks * bytes_per_block) as f64 / 1e9;
    let disk = summarize_dir(&cfg.disk.dir);
    let connector = format!("{:?}", args.engine.connector).to_lowercase();
    if args.json {
        let v = serde_json::json!({
            "model": {"name": model_name, "layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                      "vocab_size": m.vocab_size, "max_position_embeddings": m.max_position_embeddings},
            "engine": {"block_size": args.engine.block_size, "num_device_blocks": args.engine.num_device_blocks,
                       "max_num_seqs": args.engine.max_num_seqs, "max_batch_tokens": args.engine.max_batch_tokens,
                       "connector": connector},
            "kv_bytes_per_token": bytes_per_token,
            "kv_bytes_per_block": bytes_per_block,
            "capacity": caps,
            "disk_contents": disk,
            "kvtier_config": cfg,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "model       {model_name}: {} layers, {} KV heads x {} dims, vocab {}, context {}",
        m.num_layers, m.num_kv_heads, m.head_dim, m.vocab_size, m.max_position_embeddings
    );
    println!("connector   {connector}");
    println!(
        "KV          {bytes_per_token} B/token, {bytes_per_block} B/block ({} tokens)",
        args.engine.block_size
    );
    println!(
        "G1 device   {} blocks ({device_gb:.3} GB)",
        args.engine.num_device_blocks
    );
    println!(
        "G2 host     {} blocks ({:.3} GB)",
        caps.host_blocks,
        gb(caps.host_blocks)
    );
    println!(
        "G3 disk     {} blocks ({:.3} GB) in {}",
        caps.disk_blocks,
        gb(caps.disk_blocks),
        cfg.disk.dir.display()
    );
    if disk.exists {
        println!(
            "            holds {} files, {:.1} MB",
            disk.files,
            disk.bytes as f64 / 1e6
        );
        for (name, len) in &disk.largest {
            println!("              {name}  {:.1} MB", *len as f64 / 1e6);
        }
    } else {
        println!("            (directory does not exist yet)");
    }
    match &cfg.remote {
        Some(r) => println!("G4 remote   {r:?}"),
        None => println!("G4 remote   (none)"),
    }
    println!("\nresolved configuration (defaults < $KVTIER_CONFIG < KVTIER_*/DYN_KVBM_* < flags):");
    println!(
        "{}",
        toml::to_string_pretty(&cfg).unwrap_or_else(|e| format!("(cannot print: {e})"))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#13, security): `kvtier inspect` printed the Redis password.
    #[test]
    fn inspect_never_shows_a_redis_password() {
        let cfg = KvtierConfig {
            remote: Some(RemoteTarget::parse("redis://u:hunter2@h:6379").unwrap()),
            ..KvtierConfig::default()
        };
        let r = redacted(&cfg);
        let shown = format!(
            "{:?}{}{}",
            r.remote,
            toml::to_string_pretty(&r).unwrap(),
            serde_json::to_string(&r).unwrap()
        );
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redis://u:***@h:6379"), "{shown}");
    }

    #[test]
    fn summarizes_without_touching() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("a"), vec![0u8; 10]).unwrap();
        std::fs::write(d.path().join("sub/b"), vec![0u8; 30]).unwrap();
        let s = summarize_dir(d.path());
        assert!(s.exists);
        assert_eq!((s.files, s.bytes), (2, 40));
        assert_eq!(s.largest[0], ("sub/b".to_string(), 30));
        let none = summarize_dir(&d.path().join("missing"));
        assert!(!none.exists);
        assert!(!d.path().join("missing").exists());
    }
}
