//! Command-line engine and tier settings, resolved into an engine configuration.
//!
//! Precedence (lowest first): embedded defaults (built-in model, host tier 1 GB, disk tier 1 GB in the
//! user's cache directory) < kvtier's typed configuration (`KVTIER_CONFIG` TOML, `KVTIER_*` env) <
//! explicit flags. Invariant: every value that reaches the engine went through [`EngineArgs::engine_config`],
//! which validates it and names the flag in its error.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use std::collections::HashMap;

use kvtier::config::{KvtierConfig, CONFIG_PATH_ENV};
use kvtier_engine::{ConnectorSetup, EngineConfig, ModelSource, Role};

/// `--connector`: which KV connector the engine runs (the original's `--connector kvbm` flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConnectorKind {
    /// kvtier: offload to host, disk and (optionally) remote tiers; onboard on prefix hits.
    #[value(alias = "kvbm")]
    Kvtier,
    /// No connector: the engine's own G1 prefix cache only.
    None,
}

/// `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DisaggMode {
    /// Prefill and decode in this server.
    Agg,
    /// Compute prompts and first tokens; publish KV to the shared tier.
    Prefill,
    /// Get first tokens from `--prefill-url`, continue from KV found in the shared tier.
    Decode,
}

impl DisaggMode {
    /// The engine role.
    pub fn role(self) -> Role {
        match self {
            DisaggMode::Agg => Role::Aggregated,
            DisaggMode::Prefill => Role::Prefill,
            DisaggMode::Decode => Role::Decode,
        }
    }

    /// Label used in `/health`.
    pub fn label(self) -> &'static str {
        match self {
            DisaggMode::Agg => "agg",
            DisaggMode::Prefill => "prefill",
            DisaggMode::Decode => "decode",
        }
    }
}

/// Engine flags shared by `serve`, `inspect` and (partly) `bench`.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Hugging Face Llama directory (config.json + safetensors). Default: the built-in seeded model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Seed of the built-in model's random weights.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// G1 (engine KV cache) capacity in blocks.
    #[arg(long, default_value_t = 256)]
    pub num_device_blocks: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Token budget of one forward pass (chunked prefill).
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Most requests queued (at least 1); beyond it requests get HTTP 503.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// KV connector.
    #[arg(long, value_enum, default_value_t = ConnectorKind::Kvtier)]
    pub connector: ConnectorKind,
    /// Turn the engine's own G1 prefix cache off: no computed block is reused across requests
    /// (with `--connector none`, every prompt is computed in full).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// The offload tiers' sizes and places.
    #[command(flatten)]
    pub tiers: TierArgs,
}

/// Tier overrides (each beats the kvtier configuration file and environment).
#[derive(Debug, Clone, Default, Args)]
pub struct TierArgs {
    /// Host (G2) tier size in GB (decimal).
    #[arg(long, value_name = "GB")]
    pub host_cache_gb: Option<f64>,
    /// Disk (G3) tier size in GB (decimal); 0 disables the disk tier.
    #[arg(long, value_name = "GB")]
    pub disk_cache_gb: Option<f64>,
    /// Disk tier directory. Default: $XDG_CACHE_HOME/kvtier or ~/.cache/kvtier.
    #[arg(long, value_name = "DIR")]
    pub disk_cache_dir: Option<PathBuf>,
    /// Shared remote (G4) tier, e.g. `dir:///shared/kv` or `redis://127.0.0.1:6379`.
    #[arg(long, value_name = "URL")]
    pub remote_url: Option<String>,
    /// Send every host block to disk, not only blocks offloaded twice within the filter window
    /// (the original's DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER).
    #[arg(long)]
    pub no_disk_filter: bool,
}

/// The user's cache directory for the disk tier.
pub fn default_disk_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("kvtier");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".cache").join("kvtier");
    }
    std::env::temp_dir().join("kvtier")
}

/// Embedded default sizes (decimal GB).
pub const DEFAULT_HOST_GB: f64 = 1.0;
/// Embedded default disk tier size (decimal GB).
pub const DEFAULT_DISK_GB: f64 = 1.0;

/// The embedded defaults as the lowest TOML layer: host 1 GB, disk 1 GB in the user's cache directory.
pub fn defaults_toml() -> String {
    let dir = default_disk_dir();
    let mut t = toml::Table::new();
    let mut host = toml::Table::new();
    host.insert("gb".into(), toml::Value::Float(DEFAULT_HOST_GB));
    let mut disk = toml::Table::new();
    disk.insert("gb".into(), toml::Value::Float(DEFAULT_DISK_GB));
    disk.insert("dir".into(), toml::Value::String(dir.display().to_string()));
    t.insert("host".into(), toml::Value::Table(host));
    t.insert("disk".into(), toml::Value::Table(disk));
    t.to_string()
}

/// Largest configuration file read (a configuration is a few hundred bytes).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads a configuration file: a regular file of at most [`MAX_CONFIG_BYTES`], so that
/// `KVTIER_CONFIG=/dev/zero` (or a FIFO, or a huge file) is an error, not a read until memory
/// runs out.
pub fn read_config_file(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        bail!("not a regular file");
    }
    if meta.len() > MAX_CONFIG_BYTES {
        bail!(
            "{} bytes is larger than the {MAX_CONFIG_BYTES}-byte limit",
            meta.len()
        );
    }
    let mut text = String::new();
    f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        bail!("larger than the {MAX_CONFIG_BYTES}-byte limit");
    }
    Ok(text)
}

impl TierArgs {
    /// The flags that were given, as an engine-settings layer (TOML key names).
    pub fn overrides(&self) -> anyhow::Result<serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let Some(gb) = self.host_cache_gb {
            if !(gb.is_finite() && gb > 0.0) {
                bail!("--host-cache-gb must be a positive number of GB, got {gb}");
            }
            m.insert("host.gb".into(), gb.into());
        }
        if let Some(gb) = self.disk_cache_gb {
            // 0 turns the tier off (the configuration reads a size of 0 as "off").
            if !(gb.is_finite() && gb >= 0.0) {
                bail!("--disk-cache-gb must be a number of GB >= 0 (0 disables the disk tier), got {gb}");
            }
            m.insert("disk.gb".into(), gb.into());
        }
        if let Some(d) = &self.disk_cache_dir {
            m.insert("disk.dir".into(), d.display().to_string().into());
        }
        if let Some(u) = &self.remote_url {
            m.insert("remote.url".into(), u.clone().into());
        }
        if self.no_disk_filter {
            m.insert("policy.disk_filter.enabled".into(), false.into());
        }
        Ok(serde_json::Value::Object(m))
    }

    /// The kvtier configuration: embedded defaults < `KVTIER_CONFIG` TOML < `KVTIER_*` / `DYN_KVBM_*`
    /// environment < these flags.
    pub fn kvtier_config(&self) -> anyhow::Result<KvtierConfig> {
        let env: HashMap<String, String> = std::env::vars().collect();
        self.kvtier_config_with_env(&env)
    }

    /// [`kvtier_config`](Self::kvtier_config) with an injected environment (tests).
    pub fn kvtier_config_with_env(
        &self,
        env: &HashMap<String, String>,
    ) -> anyhow::Result<KvtierConfig> {
        let mut b = KvtierConfig::builder().toml("kvtier embedded defaults", &defaults_toml());
        if let Some(path) = env.get(CONFIG_PATH_ENV).filter(|p| !p.trim().is_empty()) {
            let text = read_config_file(Path::new(path))
                .with_context(|| format!("reading {CONFIG_PATH_ENV}={path}"))?;
            b = b.toml(path, &text);
        }
        b = b.env(env).engine(&self.overrides()?);
        Ok(b.build()?)
    }
}

impl EngineArgs {
    /// The model source.
    pub fn model_source(&self) -> ModelSource {
        match &self.model {
            Some(d) => ModelSource::Dir(d.clone()),
            None => ModelSource::BuiltIn {
                seed: self.model_seed,
            },
        }
    }

    /// The engine configuration for `role`.
    pub fn engine_config(&self, role: Role) -> anyhow::Result<EngineConfig> {
        if let Some(d) = &self.model {
            if !d.join("config.json").is_file() {
                bail!(
                    "--model {}: no config.json there (expected a Hugging Face Llama directory)",
                    d.display()
                );
            }
        }
        let connector = match self.connector {
            ConnectorKind::None => None,
            ConnectorKind::Kvtier => Some(connector_setup(&self.tiers.kvtier_config()?)?),
        };
        if role != Role::Aggregated && connector.is_none() {
            bail!("--disaggregation-mode prefill|decode needs --connector kvtier (KV travels through kvtier's shared tier)");
        }
        let mut cfg = EngineConfig::builtin(self.model_seed);
        cfg.model = self.model_source();
        cfg.block_size = self.block_size;
        cfg.num_device_blocks = self.num_device_blocks;
        cfg.max_num_seqs = self.max_num_seqs;
        cfg.max_batch_tokens = self.max_batch_tokens;
        if self.max_waiting == 0 {
            bail!("--max-waiting must be at least 1 (it is how many requests may queue; 0 would refuse every request with 503)");
        }
        cfg.max_waiting = self.max_waiting;
        cfg.role = role;
        cfg.enable_prefix_cache = !self.no_prefix_cache;
        cfg.connector = connector;
        Ok(cfg)
    }
}

/// Builds the engine's connector setup from the kvtier configuration — what the original's
/// `--connector kvbm` flag does for TensorRT-LLM's `KvCacheConnectorConfig`.
pub fn connector_setup(cfg: &KvtierConfig) -> anyhow::Result<ConnectorSetup> {
    if cfg.disk.size.is_some() && std::fs::symlink_metadata(&cfg.disk.dir).is_err() {
        // Private, as docs/CONFIG.md says (#28: create_dir_all made it 0755); an existing
        // directory is left as it is.
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&cfg.disk.dir)
            .with_context(|| {
                format!(
                    "creating the disk tier directory {}",
                    cfg.disk.dir.display()
                )
            })?;
    }
    Ok(ConnectorSetup::new(cfg.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#28): `disk.dir` was created 0755 while docs/CONFIG.md says 0700.
    #[test]
    fn missing_disk_dir_is_created_private() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a").join("b");
        let env: HashMap<String, String> = [
            ("KVTIER_HOST_NUM_BLOCKS", "4"),
            ("KVTIER_DISK_NUM_BLOCKS", "4"),
            ("KVTIER_DISK_DIR", dir.to_str().unwrap()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cfg = KvtierConfig::build(None, &env, None).unwrap();
        connector_setup(&cfg).unwrap();
        for d in [&dir, &tmp.path().join("a")] {
            let mode = std::fs::metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
    }
    use kvtier::config::{RemoteTarget, TierSize};

    #[test]
    fn defaults_then_file_then_env_then_flags() {
        let none = HashMap::new();
        let c = TierArgs::default().kvtier_config_with_env(&none).unwrap();
        assert_eq!(c.host.size, Some(TierSize::Gb(1.0)));
        assert_eq!(c.disk.size, Some(TierSize::Gb(1.0)));
        assert!(c.disk.dir.ends_with("kvtier"));

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("k.toml");
        std::fs::write(&file, "[host]\ngb = 3.0\n").unwrap();
        let mut env = HashMap::new();
        env.insert(CONFIG_PATH_ENV.to_string(), file.display().to_string());
        let c = TierArgs::default().kvtier_config_with_env(&env).unwrap();
        assert_eq!(c.host.size, Some(TierSize::Gb(3.0)));
        env.insert("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS".into(), "77".into());
        let c = TierArgs::default().kvtier_config_with_env(&env).unwrap();
        assert_eq!(c.host.size, Some(TierSize::Blocks(77)));
        let flags = TierArgs {
            host_cache_gb: Some(0.5),
            remote_url: Some("dir:///tmp/shared".into()),
            ..Default::default()
        };
        let c = flags.kvtier_config_with_env(&env).unwrap();
        assert_eq!(c.host.size, Some(TierSize::Gb(0.5)));
        assert_eq!(c.remote, Some(RemoteTarget::dir("/tmp/shared")));
        assert!(c.policy.disk_filter.enabled);
        let c = TierArgs {
            no_disk_filter: true,
            ..Default::default()
        }
        .kvtier_config_with_env(&env)
        .unwrap();
        assert!(!c.policy.disk_filter.enabled);
    }

    #[test]
    fn bad_flags_name_themselves() {
        let none = HashMap::new();
        let bad = TierArgs {
            host_cache_gb: Some(0.0),
            ..Default::default()
        };
        assert!(bad
            .kvtier_config_with_env(&none)
            .unwrap_err()
            .to_string()
            .contains("--host-cache-gb"));
        let bad = TierArgs {
            remote_url: Some("ftp://x".into()),
            ..Default::default()
        };
        assert!(bad.kvtier_config_with_env(&none).is_err());
    }

    /// Regression (#13, unclear errors): `--disk-cache-gb 0` was refused though `--help` says it
    /// disables the tier.
    #[test]
    fn disk_cache_gb_zero_disables_the_disk_tier() {
        let none = HashMap::new();
        let c = TierArgs {
            disk_cache_gb: Some(0.0),
            ..Default::default()
        }
        .kvtier_config_with_env(&none)
        .unwrap();
        assert_eq!(c.disk.size, None);
        assert!(c.host.size.is_some());
        for bad in [-1.0, f64::NAN] {
            let e = TierArgs {
                disk_cache_gb: Some(bad),
                ..Default::default()
            }
            .kvtier_config_with_env(&none)
            .unwrap_err();
            assert!(e.to_string().contains("--disk-cache-gb"), "{e}");
        }
    }

    /// Regression (#13, unclear errors): `KVTIER_CONFIG=/dev/zero` was read until memory ran out.
    #[test]
    fn config_file_must_be_a_small_regular_file() {
        let mut env = HashMap::new();
        env.insert(CONFIG_PATH_ENV.to_string(), "/dev/zero".to_string());
        let e = TierArgs::default()
            .kvtier_config_with_env(&env)
            .unwrap_err();
        assert!(format!("{e:#}").contains("not a regular file"), "{e:#}");
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
        env.insert(CONFIG_PATH_ENV.to_string(), big.display().to_string());
        let e = TierArgs::default()
            .kvtier_config_with_env(&env)
            .unwrap_err();
        assert!(format!("{e:#}").contains("limit"), "{e:#}");
    }

    /// Regression (#13, unclear errors): `--max-waiting 0` made every request 503; it is refused.
    #[test]
    fn max_waiting_zero_is_refused_by_name() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let cli = Cli::try_parse_from(["kvtier", "--max-waiting", "0"]).unwrap();
        let e = cli.engine.engine_config(Role::Aggregated).unwrap_err();
        assert!(
            e.to_string().contains("--max-waiting must be at least 1"),
            "{e}"
        );
        let cli =
            Cli::try_parse_from(["kvtier", "--max-waiting", "1", "--connector", "none"]).unwrap();
        assert_eq!(
            cli.engine
                .engine_config(Role::Aggregated)
                .unwrap()
                .max_waiting,
            1
        );
    }
}
