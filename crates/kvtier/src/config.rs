//! Configuration: one typed struct, [`KvtierConfig`], built once from layered sources and
//! validated with messages that name the setting (by the name it was given under) and the reason.
//!
//! Layers, lowest first: built-in defaults < TOML file (path in `KVTIER_CONFIG`) < environment
//! (`KVTIER_*`, and the original `DYN_KVBM_*` names as aliases; the `KVTIER_*` name wins when
//! both are set) < engine-supplied settings (e.g. vLLM's `kv_connector_extra_config`, as JSON or
//! a string map, with the TOML key names, nested or dotted). Every setting is listed in
//! `docs/CONFIG.md` and in [`SETTINGS`].
//!
//! Invariants:
//! - the environment is an injected map: nothing here reads the process environment, so tests
//!   never mutate it (`KvtierConfig::load` is the one entry point that reads a file, the TOML
//!   named by `KVTIER_CONFIG`);
//! - sizes are kept as requested (GB or blocks); [`KvtierConfig::resolve_capacity`] turns them
//!   into block counts once the bytes per block (summed over all TP ranks) are known;
//! - a tier's `gb` and `num_blocks` exclude each other across layers: a higher layer setting one
//!   clears the other from lower layers; in one layer both may be set and `num_blocks` wins
//!   (the `*_OVERRIDE_NUM_BLOCKS` semantics);
//! - a built config has at least one offload tier; a disk tier may stand alone (disk-only: the
//!   device's blocks go to disk and come back from it directly, written through as they
//!   complete, since the G2->G3 frequency filter needs G2 sightings); a Redis or directory
//!   remote tier needs a host tier (puts to it are made from host memory), while the node tier
//!   (`remote.url = node://...`) may stand alone: node-only, its shared arena is the engine's
//!   G2 (stores go device -> arena slot, loads arena -> device).
//!
//! ```
//! use std::collections::HashMap;
//! use kvtier::config::{KvtierConfig, TierSize};
//!
//! let env: HashMap<String, String> = [("DYN_KVBM_CPU_CACHE_GB", "4")]
//!     .into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
//! let engine = serde_json::json!({"disk": {"num_blocks": 1000, "dir": "/mnt/nvme"}});
//! let cfg = KvtierConfig::build(None, &env, Some(&engine))?;
//! assert_eq!(cfg.host.size, Some(TierSize::Gb(4.0)));
//! // 2 MiB per block per rank, TP = 2.
//! let caps = cfg.resolve_capacity(2 * 2 * 1024 * 1024)?;
//! assert_eq!((caps.host_blocks, caps.disk_blocks), (953, 1000));
//! # Ok::<(), kvtier::config::ConfigError>(())
//! ```
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod builder;
mod engine;
mod remote_url;
mod settings;
mod value;

pub use builder::ConfigBuilder;
pub use engine::EngineSettings;
pub use settings::{Setting, CONFIG_PATH_ENV, SETTINGS};

pub use remote_url::{
    parse_http_endpoint, redact_url, HttpEndpointError, RedisTarget, RemoteBackend, RemoteTarget,
    RemoteUrlError,
};
pub use value::{bool_reason, parse_bool as parse_bool_text, parse_u64 as parse_u64_text};

/// Why a configuration could not be built; each names the setting as it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting has a value that cannot be used.
    #[error("{setting}: {reason}")]
    Invalid {
        /// The setting, by the name it was given under.
        setting: String,
        /// Why the value cannot be used.
        reason: String,
    },
    /// A TOML file or engine map names a setting kvtier does not have.
    #[error("{source_name}: unknown setting `{setting}`")]
    Unknown {
        /// The unknown key.
        setting: String,
        /// Where it was given (the TOML file, "engine settings").
        source_name: String,
    },
    /// The TOML file could not be read or parsed.
    #[error("config file {path}: {reason}")]
    File {
        /// The file (or the origin a TOML text was given under).
        path: String,
        /// The read or parse error.
        reason: String,
    },
    /// Neither a host, disk nor remote tier is configured.
    #[error(
        "no offload tier configured: set host.gb (KVTIER_HOST_GB, DYN_KVBM_CPU_CACHE_GB) or \
         host.num_blocks (KVTIER_HOST_NUM_BLOCKS, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS)"
    )]
    NoOffloadTier,
}

/// Disk I/O engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IoBackend {
    /// io_uring when the kernel allows it, else pread/pwrite.
    #[default]
    Auto,
    /// io_uring, or fail (no fallback).
    Uring,
    /// pread/pwrite.
    Pread,
}

/// A requested tier size, as the user gave it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum TierSize {
    /// Decimal gigabytes (1 GB = 1e9 bytes) across all TP ranks.
    Gb(f64),
    /// A number of blocks.
    Blocks(u64),
}

/// The host (G2) tier.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostConfig {
    /// None = no host tier.
    pub size: Option<TierSize>,
}

/// The disk (G3) tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskConfig {
    /// None = no disk tier.
    pub size: Option<TierSize>,
    /// The directory holding kvtier's cache files (`disk.dir`).
    pub dir: PathBuf,
    /// Bypass the page cache with O_DIRECT where the file system supports it.
    pub use_o_direct: bool,
    /// Which system interface moves the bytes.
    pub io_backend: IoBackend,
    /// Keep G3's blocks across restarts (warm restart): a new process on the same `dir` serves
    /// what the last one made durable. Off: every start is cold and files go with the process.
    pub persist: bool,
}

/// The G2 -> G3 frequency filter: spill a host block to disk only on its second sighting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskFilterConfig {
    /// Whether the filter applies (off: every host block is spilled).
    pub enabled: bool,
    /// The decay window in seconds: a second sighting counts only within it.
    pub window_secs: u64,
    /// Hashes remembered at most (the least recently seen are forgotten first).
    pub max_tracked: usize,
}

/// The tiers' policies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// The G2 -> G3 frequency filter (applies wherever there are both a host and a disk tier).
    pub disk_filter: DiskFilterConfig,
}

/// The connector (leader and workers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorConfig {
    /// Overrides the engine's tokens per block (must then match the engine).
    pub block_size: Option<usize>,
    /// How long the leader and its workers wait for each other at start.
    pub leader_worker_timeout_secs: u64,
    /// ZeroMQ endpoint between leader and workers; None = in process.
    pub zmq_endpoint: Option<String>,
    /// Load matched blocks asynchronously (the engine parks the request until its loads are
    /// reported finished) instead of before the forward pass that first computes it. None = the
    /// engine adapter's default (vLLM: true, TensorRT-LLM: false).
    pub async_loads: Option<bool>,
    /// With asynchronous loads, load a hit held wholly by the host tier inside the step
    /// (`KVTIER_SYNC_HOST_LOADS`; unset: the adapter's default, on under vLLM).
    pub sync_host_loads: Option<bool>,
}

/// The Prometheus endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsConfig {
    /// Serve `/metrics`.
    pub enabled: bool,
    /// Its TCP port.
    pub port: u16,
}

/// What the sequence hashes are salted with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HashingConfig {
    /// Model identity mixed into every sequence hash (the engine's model name when unset).
    pub model: Option<String>,
    /// Tenant cache salt for requests that carry none.
    pub salt: Option<String>,
}

/// The whole configuration. Build it with [`KvtierConfig::load`] or [`KvtierConfig::build`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvtierConfig {
    /// The host (G2) tier.
    pub host: HostConfig,
    /// The disk (G3) tier.
    pub disk: DiskConfig,
    /// The shared remote (G4) tier, if any.
    pub remote: Option<RemoteTarget>,
    /// The tiers' policies.
    pub policy: PolicyConfig,
    /// The connector.
    pub connector: ConnectorConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The hash salt's parts.
    pub hashing: HashingConfig,
}

/// Block counts per tier once the block size is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCapacities {
    /// Host tier blocks (0: no host tier).
    pub host_blocks: usize,
    /// Disk tier blocks (0: no disk tier).
    pub disk_blocks: usize,
    /// Whether a remote tier is configured (its size is the store's own).
    pub remote: bool,
}

impl Default for KvtierConfig {
    /// The built-in defaults (no tier configured, so not valid on its own).
    fn default() -> Self {
        KvtierConfig {
            host: HostConfig::default(),
            disk: DiskConfig {
                size: None,
                dir: PathBuf::from("/tmp"),
                use_o_direct: true,
                io_backend: IoBackend::Auto,
                persist: true,
            },
            remote: None,
            policy: PolicyConfig {
                disk_filter: DiskFilterConfig {
                    enabled: true,
                    window_secs: 600,
                    max_tracked: 1_000_000,
                },
            },
            connector: ConnectorConfig {
                block_size: None,
                leader_worker_timeout_secs: 120,
                zmq_endpoint: None,
                async_loads: None,
                sync_host_loads: None,
            },
            metrics: MetricsConfig {
                enabled: false,
                port: 6880,
            },
            hashing: HashingConfig::default(),
        }
    }
}

impl KvtierConfig {
    /// A builder over the built-in defaults; add layers lowest first.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder::default()
    }

    /// Defaults < TOML text (if any) < `env` < `engine` (if any). Pure: no file is read.
    pub fn build(
        toml_text: Option<&str>,
        env: &HashMap<String, String>,
        engine: Option<&serde_json::Value>,
    ) -> Result<Self, ConfigError> {
        let mut b = Self::builder();
        if let Some(t) = toml_text {
            b = b.toml("TOML", t);
        }
        b = b.env(env);
        if let Some(e) = engine {
            b = b.engine(e);
        }
        b.build()
    }

    /// Like [`build`](Self::build), reading the TOML file named by `KVTIER_CONFIG` in `env`.
    pub fn load(
        env: &HashMap<String, String>,
        engine: Option<&serde_json::Value>,
    ) -> Result<Self, ConfigError> {
        let mut b = Self::builder();
        if let Some(path) = env.get(CONFIG_PATH_ENV).filter(|p| !p.trim().is_empty()) {
            let text = read_file(Path::new(path))?;
            b = b.toml(path, &text);
        }
        b = b.env(env);
        if let Some(e) = engine {
            b = b.engine(e);
        }
        b.build()
    }

    /// Cross-setting checks; `build` calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let has_host = self.host.size.is_some();
        if !has_host && self.disk.size.is_none() && self.remote.is_none() {
            return Err(ConfigError::NoOffloadTier);
        }
        let node = self
            .remote
            .as_ref()
            .is_some_and(|r| matches!(r.backend, RemoteBackend::Node { .. }));
        if !has_host && self.remote.is_some() && !node {
            return Err(ConfigError::Invalid {
                setting: "remote.url (KVTIER_REMOTE_URL)".into(),
                reason: "a Redis or directory remote tier needs a host tier (blocks are put to \
                         the remote store from host memory): set host.gb or host.num_blocks \
                         (only the node tier, node://, may stand alone)"
                    .into(),
            });
        }
        Ok(())
    }

    /// Turn the requested sizes into block counts: `blocks = floor(GB * 1e9 / bytes_per_block)`,
    /// where `bytes_per_block_all_ranks` is one block's bytes summed over all TP ranks. The disk
    /// tier is sized by the same bytes here; [`Self::resolve_capacity_on_disk`] counts what a
    /// disk slot really takes (its header page, alignment).
    pub fn resolve_capacity(
        &self,
        bytes_per_block_all_ranks: usize,
    ) -> Result<TierCapacities, ConfigError> {
        self.resolve_capacity_on_disk(bytes_per_block_all_ranks, bytes_per_block_all_ranks)
    }

    /// As [`Self::resolve_capacity`], with `disk.gb` divided by `disk_bytes_per_block_all_ranks`,
    /// the bytes one block's disk slots take on all ranks (payload rounded up to the I/O
    /// alignment plus the header page: #28, the files were 1.25x `disk.gb` at 16 KiB blocks).
    pub fn resolve_capacity_on_disk(
        &self,
        bytes_per_block_all_ranks: usize,
        disk_bytes_per_block_all_ranks: usize,
    ) -> Result<TierCapacities, ConfigError> {
        if bytes_per_block_all_ranks == 0 {
            return Err(ConfigError::Invalid {
                setting: "bytes per block".into(),
                reason: "is 0; the KV layout was not registered".into(),
            });
        }
        let blocks = |size: Option<TierSize>,
                      setting: &str,
                      bytes_per_block_all_ranks: usize|
         -> Result<usize, ConfigError> {
            match size {
                None => Ok(0),
                Some(TierSize::Blocks(n)) => usize::try_from(n).map_err(|_| ConfigError::Invalid {
                    setting: setting.into(),
                    reason: format!("{n} blocks is too many"),
                }),
                Some(TierSize::Gb(gb)) => {
                    let n = (gb * 1e9 / bytes_per_block_all_ranks as f64).floor();
                    if n < 1.0 {
                        return Err(ConfigError::Invalid {
                            setting: setting.into(),
                            reason: format!(
                                "{gb} GB holds no block of {bytes_per_block_all_ranks} bytes"
                            ),
                        });
                    }
                    if n >= u32::MAX as f64 {
                        return Err(ConfigError::Invalid {
                            setting: setting.into(),
                            reason: format!("{gb} GB is more than 2^32 blocks"),
                        });
                    }
                    Ok(n as usize)
                }
            }
        };
        Ok(TierCapacities {
            host_blocks: blocks(
                self.host.size,
                "host.gb (KVTIER_HOST_GB, DYN_KVBM_CPU_CACHE_GB)",
                bytes_per_block_all_ranks,
            )?,
            disk_blocks: blocks(
                self.disk.size,
                "disk.gb (KVTIER_DISK_GB, DYN_KVBM_DISK_CACHE_GB)",
                disk_bytes_per_block_all_ranks.max(1),
            )?,
            remote: self.remote.is_some(),
        })
    }
}

/// The largest configuration file kvtier reads (a TOML file of settings is a few KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A configuration file's text: a regular file of at most [`MAX_CONFIG_BYTES`]. `/dev/zero` was read
/// until memory ran out, and a FIFO blocked the engine's start forever on `open`.
fn read_file(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let err = |reason: String| ConfigError::File {
        path: path.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| err(e.to_string()))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(err(format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    Ok(text)
}
