//! Command-line engine and tier settings, resolved into an engine configuration.
//!
//! Precedence (lowest first): embedded defaults (built-in model, host tier 1 GB, disk tier 1 GB in the
//! user's cache directory) < kvtier's typed configuration (`KVTIER_CONFIG` TOML, `KVTIER_*` env) <
//! explicit flags. Invariant: every value that reaches the engine went through [`EngineArgs::engine_config`],
//! which validates it and names the flag in its error.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
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
    /// Most requests queued; beyond it requests get HTTP 503.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// KV connector.
    #[arg(long, value_enum, default_value_t = ConnectorKind::Kvtier)]
    pub connector: ConnectorKind,
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

/// Resolved tier sizes, for the engine and for `inspect`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ResolvedTiers {
    pub host_gb: f64,
    pub disk_gb: f64,
    pub disk_dir: PathBuf,
    pub remote_url: Option<String>,
}

/// Embedded default sizes.
pub const DEFAULT_HOST_GB: f64 = 1.0;
pub const DEFAULT_DISK_GB: f64 = 1.0;

impl TierArgs {
    /// Applies defaults and checks the values.
    pub fn resolve(&self) -> anyhow::Result<ResolvedTiers> {
        let host_gb = self.host_cache_gb.unwrap_or(DEFAULT_HOST_GB);
        let disk_gb = self.disk_cache_gb.unwrap_or(DEFAULT_DISK_GB);
        if !(host_gb.is_finite() && host_gb > 0.0) {
            bail!("--host-cache-gb must be a positive number of GB, got {host_gb}");
        }
        if !(disk_gb.is_finite() && disk_gb >= 0.0) {
            bail!("--disk-cache-gb must be >= 0, got {disk_gb}");
        }
        if let Some(u) = &self.remote_url {
            if !(u.starts_with("dir://") || u.starts_with("redis://") || u.starts_with("rediss://"))
            {
                bail!("--remote-url must be dir://PATH or redis://HOST:PORT, got `{u}`");
            }
        }
        Ok(ResolvedTiers {
            host_gb,
            disk_gb,
            disk_dir: self.disk_cache_dir.clone().unwrap_or_else(default_disk_dir),
            remote_url: self.remote_url.clone(),
        })
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
            ConnectorKind::Kvtier => Some(connector_setup(&self.tiers.resolve()?)?),
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
        cfg.max_waiting = self.max_waiting;
        cfg.role = role;
        cfg.connector = connector;
        Ok(cfg)
    }
}

/// Builds the engine's connector setup from resolved tiers — what the original's `--connector kvbm`
/// does for TensorRT-LLM's `KvCacheConnectorConfig`.
pub fn connector_setup(tiers: &ResolvedTiers) -> anyhow::Result<ConnectorSetup> {
    std::fs::create_dir_all(&tiers.disk_dir).with_context(|| {
        format!(
            "creating the disk tier directory {}",
            tiers.disk_dir.display()
        )
    })?;
    Ok(ConnectorSetup::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_defaults_and_checks() {
        let t = TierArgs::default().resolve().unwrap();
        assert_eq!(t.host_gb, 1.0);
        assert!(t.disk_dir.ends_with("kvtier"));
        let bad = TierArgs {
            host_cache_gb: Some(0.0),
            ..Default::default()
        };
        assert!(bad
            .resolve()
            .unwrap_err()
            .to_string()
            .contains("--host-cache-gb"));
        let bad = TierArgs {
            remote_url: Some("ftp://x".into()),
            ..Default::default()
        };
        assert!(bad
            .resolve()
            .unwrap_err()
            .to_string()
            .contains("--remote-url"));
        let ok = TierArgs {
            remote_url: Some("dir:///tmp/x".into()),
            ..Default::default()
        };
        assert!(ok.resolve().is_ok());
    }
}
