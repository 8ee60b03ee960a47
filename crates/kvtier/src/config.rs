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
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod remote_url;
mod value;

pub use remote_url::{parse_http_endpoint, redact_url, RedisTarget, RemoteBackend, RemoteTarget};
pub use value::{bool_reason, parse_bool as parse_bool_text, parse_u64 as parse_u64_text};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A setting has a value that cannot be used.
    #[error("{setting}: {reason}")]
    Invalid { setting: String, reason: String },
    /// A TOML file or engine map names a setting kvtier does not have.
    #[error("{source_name}: unknown setting `{setting}`")]
    Unknown {
        setting: String,
        source_name: String,
    },
    /// The TOML file could not be read or parsed.
    #[error("config file {path}: {reason}")]
    File { path: String, reason: String },
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
    Uring,
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

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostConfig {
    /// None = no host tier.
    pub size: Option<TierSize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskConfig {
    /// None = no disk tier.
    pub size: Option<TierSize>,
    pub dir: PathBuf,
    pub use_o_direct: bool,
    pub io_backend: IoBackend,
    /// Keep G3's blocks across restarts (warm restart): a new process on the same `dir` serves
    /// what the last one made durable. Off: every start is cold and files go with the process.
    pub persist: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskFilterConfig {
    pub enabled: bool,
    pub window_secs: u64,
    pub max_tracked: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// The G2 -> G3 frequency filter (applies wherever there are both a host and a disk tier).
    pub disk_filter: DiskFilterConfig,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorConfig {
    /// Overrides the engine's tokens per block (must then match the engine).
    pub block_size: Option<usize>,
    pub leader_worker_timeout_secs: u64,
    /// ZeroMQ endpoint between leader and workers; None = in process.
    pub zmq_endpoint: Option<String>,
    /// Load matched blocks asynchronously (the engine parks the request until its loads are
    /// reported finished) instead of before the forward pass that first computes it. None = the
    /// engine adapter's default (vLLM: true, TensorRT-LLM: false).
    pub async_loads: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsConfig {
    pub enabled: bool,
    pub port: u16,
}

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
    pub host: HostConfig,
    pub disk: DiskConfig,
    pub remote: Option<RemoteTarget>,
    pub policy: PolicyConfig,
    pub connector: ConnectorConfig,
    pub metrics: MetricsConfig,
    pub hashing: HashingConfig,
}

/// Block counts per tier once the block size is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCapacities {
    pub host_blocks: usize,
    pub disk_blocks: usize,
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
            },
            metrics: MetricsConfig {
                enabled: false,
                port: 6880,
            },
            hashing: HashingConfig::default(),
        }
    }
}

/// One setting: its TOML key (also the engine key), its environment name and aliases.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    pub key: &'static str,
    pub env: &'static str,
    pub aliases: &'static [&'static str],
    /// Aliases whose boolean value is the negation of the setting.
    pub negated_aliases: &'static [&'static str],
}

const fn s(key: &'static str, env: &'static str, aliases: &'static [&'static str]) -> Setting {
    Setting {
        key,
        env,
        aliases,
        negated_aliases: &[],
    }
}

/// Every setting kvtier reads.
pub const SETTINGS: &[Setting] = &[
    s("host.gb", "KVTIER_HOST_GB", &["DYN_KVBM_CPU_CACHE_GB"]),
    s(
        "host.num_blocks",
        "KVTIER_HOST_NUM_BLOCKS",
        &["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"],
    ),
    s("disk.gb", "KVTIER_DISK_GB", &["DYN_KVBM_DISK_CACHE_GB"]),
    s(
        "disk.num_blocks",
        "KVTIER_DISK_NUM_BLOCKS",
        &["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"],
    ),
    s("disk.dir", "KVTIER_DISK_DIR", &["DYN_KVBM_DISK_CACHE_DIR"]),
    s("disk.use_o_direct", "KVTIER_DISK_USE_O_DIRECT", &[]),
    s("disk.io_backend", "KVTIER_DISK_IO_BACKEND", &[]),
    s("disk.persist", "KVTIER_DISK_PERSIST", &[]),
    s("remote.url", "KVTIER_REMOTE_URL", &[]),
    Setting {
        key: "policy.disk_filter.enabled",
        env: "KVTIER_DISK_FILTER",
        aliases: &[],
        negated_aliases: &["DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER"],
    },
    s(
        "policy.disk_filter.window_secs",
        "KVTIER_DISK_FILTER_WINDOW_SECS",
        &[],
    ),
    s(
        "policy.disk_filter.max_tracked",
        "KVTIER_DISK_FILTER_MAX_TRACKED",
        &[],
    ),
    s("connector.block_size", "KVTIER_BLOCK_SIZE", &[]),
    s(
        "connector.leader_worker_timeout_secs",
        "KVTIER_LEADER_WORKER_TIMEOUT_SECS",
        &["DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"],
    ),
    s("connector.zmq_endpoint", "KVTIER_ZMQ_ENDPOINT", &[]),
    s("connector.async_loads", "KVTIER_ASYNC_LOADS", &[]),
    s("metrics.enabled", "KVTIER_METRICS", &["DYN_KVBM_METRICS"]),
    s(
        "metrics.port",
        "KVTIER_METRICS_PORT",
        &["DYN_KVBM_METRICS_PORT"],
    ),
    s("hashing.model", "KVTIER_MODEL", &[]),
    s("hashing.salt", "KVTIER_CACHE_SALT", &[]),
];

/// Keys that exclude each other across layers.
const EXCLUSIVE: &[(&str, &str)] = &[
    ("host.gb", "host.num_blocks"),
    ("disk.gb", "disk.num_blocks"),
];

/// Name of the environment variable holding the TOML file path.
pub const CONFIG_PATH_ENV: &str = "KVTIER_CONFIG";

/// A scalar as a source gave it.
#[derive(Clone, Debug, PartialEq)]
enum Raw {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// A value and the name it was given under (e.g. `DYN_KVBM_CPU_CACHE_GB`, `TOML host.gb`).
#[derive(Clone, Debug)]
struct Given {
    origin: String,
    value: Raw,
}

type Layer = BTreeMap<&'static str, Given>;

fn setting(key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.key == key)
}

/// Builds a [`KvtierConfig`] from the layers; see the module docs.
#[derive(Debug, Default)]
pub struct ConfigBuilder {
    layers: Vec<Layer>,
    errors: Vec<ConfigError>,
}

impl ConfigBuilder {
    /// Add a TOML document (`origin` names it in errors, e.g. its path).
    pub fn toml(mut self, origin: &str, text: &str) -> Self {
        match toml::from_str::<toml::Table>(text) {
            Ok(table) => {
                let mut layer = Layer::new();
                self.flatten_toml(origin, "", &table, &mut layer);
                self.layers.push(layer);
            }
            Err(e) => self.errors.push(ConfigError::File {
                path: origin.to_owned(),
                reason: e.to_string(),
            }),
        }
        self
    }

    fn flatten_toml(&mut self, origin: &str, prefix: &str, t: &toml::Table, out: &mut Layer) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            let raw = match v {
                toml::Value::Table(sub) => {
                    self.flatten_toml(origin, &key, sub, out);
                    continue;
                }
                toml::Value::String(s) => Raw::Str(s.clone()),
                toml::Value::Integer(i) => Raw::Int(*i),
                toml::Value::Float(f) => Raw::Float(*f),
                toml::Value::Boolean(b) => Raw::Bool(*b),
                other => {
                    self.errors.push(ConfigError::Invalid {
                        setting: format!("{key} (in {origin})"),
                        reason: format!("expected a string, number or boolean, got {other}"),
                    });
                    continue;
                }
            };
            self.put(out, origin, &key, raw, |k| format!("{k} (in {origin})"));
        }
    }

    fn put(
        &mut self,
        out: &mut Layer,
        source: &str,
        key: &str,
        value: Raw,
        origin: impl Fn(&str) -> String,
    ) {
        match setting(key) {
            Some(s) => {
                out.insert(
                    s.key,
                    Given {
                        origin: origin(s.key),
                        value,
                    },
                );
            }
            None => self.errors.push(ConfigError::Unknown {
                setting: key.to_owned(),
                source_name: source.to_owned(),
            }),
        }
    }

    /// Add the environment (an injected map; only `KVTIER_*` and `DYN_KVBM_*` names are read,
    /// others are ignored).
    pub fn env(mut self, env: &HashMap<String, String>) -> Self {
        let mut layer = Layer::new();
        for s in SETTINGS {
            // Aliases first so the canonical name overrides them.
            for alias in s.aliases {
                if let Some(v) = env.get(*alias) {
                    layer.insert(
                        s.key,
                        Given {
                            origin: env_origin(alias),
                            value: Raw::Str(v.clone()),
                        },
                    );
                }
            }
            for alias in s.negated_aliases {
                if let Some(v) = env.get(*alias) {
                    match parse_bool(&Raw::Str(v.clone())) {
                        Ok(b) => {
                            layer.insert(
                                s.key,
                                Given {
                                    origin: env_origin(alias),
                                    value: Raw::Bool(!b),
                                },
                            );
                        }
                        Err(reason) => self.errors.push(ConfigError::Invalid {
                            setting: env_origin(alias),
                            reason,
                        }),
                    }
                }
            }
            if let Some(v) = env.get(s.env) {
                layer.insert(
                    s.key,
                    Given {
                        origin: env_origin(s.env),
                        value: Raw::Str(v.clone()),
                    },
                );
            }
        }
        self.layers.push(layer);
        self
    }

    /// Add engine-supplied settings: a JSON object with the TOML keys, nested
    /// (`{"host": {"gb": 4}}`) or dotted (`{"host.gb": 4}`). `null` values are skipped.
    pub fn engine(mut self, value: &serde_json::Value) -> Self {
        let mut layer = Layer::new();
        match value {
            serde_json::Value::Object(map) => self.flatten_json("", map, &mut layer),
            serde_json::Value::Null => {}
            other => self.errors.push(ConfigError::Invalid {
                setting: "engine settings".into(),
                reason: format!("expected an object, got {other}"),
            }),
        }
        self.layers.push(layer);
        self
    }

    /// Add engine-supplied settings given as a string map with dotted keys.
    pub fn engine_strings(self, map: &HashMap<String, String>) -> Self {
        let obj: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        self.engine(&serde_json::Value::Object(obj))
    }

    fn flatten_json(
        &mut self,
        prefix: &str,
        map: &serde_json::Map<String, serde_json::Value>,
        out: &mut Layer,
    ) {
        for (k, v) in map {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            let raw = match v {
                serde_json::Value::Object(sub) => {
                    self.flatten_json(&key, sub, out);
                    continue;
                }
                serde_json::Value::Null => continue,
                serde_json::Value::String(s) => Raw::Str(s.clone()),
                serde_json::Value::Bool(b) => Raw::Bool(*b),
                serde_json::Value::Number(n) => match (n.as_i64(), n.as_f64()) {
                    (Some(i), _) => Raw::Int(i),
                    (None, Some(f)) => Raw::Float(f),
                    _ => Raw::Str(n.to_string()),
                },
                serde_json::Value::Array(_) => {
                    self.errors.push(ConfigError::Invalid {
                        setting: format!("{key} (engine settings)"),
                        reason: "expected a string, number or boolean, got a list".into(),
                    });
                    continue;
                }
            };
            self.put(out, "engine settings", &key, raw, |_| {
                format!("{key} (engine settings)")
            });
        }
    }

    /// Merge the layers over the defaults and validate.
    pub fn build(self) -> Result<KvtierConfig, ConfigError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let mut merged = Layer::new();
        for layer in self.layers {
            for (a, b) in EXCLUSIVE {
                if layer.contains_key(a) || layer.contains_key(b) {
                    merged.remove(a);
                    merged.remove(b);
                }
            }
            merged.extend(layer);
        }
        let mut c = KvtierConfig::default();
        let size =
            |gb: Option<&Given>, blocks: Option<&Given>| -> Result<Option<TierSize>, ConfigError> {
                if let Some(g) = blocks {
                    let n = parse_u64(g)?;
                    return Ok((n > 0).then_some(TierSize::Blocks(n)));
                }
                if let Some(g) = gb {
                    let v = parse_f64(g)?;
                    if !v.is_finite() || v < 0.0 {
                        return Err(invalid(
                            g,
                            format!("{v} is not a size in GB (a number >= 0)"),
                        ));
                    }
                    return Ok((v > 0.0).then_some(TierSize::Gb(v)));
                }
                Ok(None)
            };
        c.host.size = size(merged.get("host.gb"), merged.get("host.num_blocks"))?;
        c.disk.size = size(merged.get("disk.gb"), merged.get("disk.num_blocks"))?;
        if let Some(g) = merged.get("disk.dir") {
            let d = parse_str(g)?;
            if d.trim().is_empty() {
                return Err(invalid(g, "empty directory".into()));
            }
            c.disk.dir = PathBuf::from(d);
        }
        if let Some(g) = merged.get("disk.use_o_direct") {
            c.disk.use_o_direct = parse_bool(&g.value).map_err(|r| invalid(g, r))?;
        }
        if let Some(g) = merged.get("disk.persist") {
            c.disk.persist = parse_bool(&g.value).map_err(|r| invalid(g, r))?;
        }
        if let Some(g) = merged.get("disk.io_backend") {
            c.disk.io_backend = match parse_str(g)?.to_ascii_lowercase().as_str() {
                "auto" => IoBackend::Auto,
                "uring" | "io_uring" => IoBackend::Uring,
                "pread" => IoBackend::Pread,
                other => {
                    return Err(invalid(
                        g,
                        format!("`{other}` is not one of auto, uring, pread"),
                    ))
                }
            };
        }
        if let Some(g) = merged.get("remote.url") {
            c.remote = parse_remote(g)?;
        }
        if let Some(g) = merged.get("policy.disk_filter.enabled") {
            c.policy.disk_filter.enabled = parse_bool(&g.value).map_err(|r| invalid(g, r))?;
        }
        if let Some(g) = merged.get("policy.disk_filter.window_secs") {
            c.policy.disk_filter.window_secs = positive(g, parse_u64(g)?)?;
        }
        if let Some(g) = merged.get("policy.disk_filter.max_tracked") {
            c.policy.disk_filter.max_tracked = to_usize(g, positive(g, parse_u64(g)?)?)?;
        }
        if let Some(g) = merged.get("connector.block_size") {
            c.connector.block_size = Some(to_usize(g, positive(g, parse_u64(g)?)?)?);
        }
        if let Some(g) = merged.get("connector.leader_worker_timeout_secs") {
            c.connector.leader_worker_timeout_secs = positive(g, parse_u64(g)?)?;
        }
        if let Some(g) = merged.get("connector.zmq_endpoint") {
            let e = parse_str(g)?;
            if !(e.starts_with("tcp://") || e.starts_with("ipc://") || e.starts_with("inproc://")) {
                return Err(invalid(
                    g,
                    format!("`{e}` is not a ZeroMQ endpoint (tcp://, ipc:// or inproc://)"),
                ));
            }
            c.connector.zmq_endpoint = Some(e);
        }
        if let Some(g) = merged.get("connector.async_loads") {
            c.connector.async_loads = Some(parse_bool(&g.value).map_err(|r| invalid(g, r))?);
        }
        if let Some(g) = merged.get("metrics.enabled") {
            c.metrics.enabled = parse_bool(&g.value).map_err(|r| invalid(g, r))?;
        }
        if let Some(g) = merged.get("metrics.port") {
            let v = parse_u64(g)?;
            c.metrics.port = match u16::try_from(v) {
                Ok(p) if p > 0 => p,
                _ => return Err(invalid(g, format!("{v} is not a TCP port (1-65535)"))),
            };
        }
        if let Some(g) = merged.get("hashing.model") {
            c.hashing.model = Some(parse_str(g)?);
        }
        if let Some(g) = merged.get("hashing.salt") {
            c.hashing.salt = Some(parse_str(g)?);
        }
        c.validate()?;
        Ok(c)
    }
}

/// How an environment variable is named in errors.
fn env_origin(name: &str) -> String {
    format!("{name} (environment variable)")
}

fn invalid(g: &Given, reason: String) -> ConfigError {
    ConfigError::Invalid {
        setting: g.origin.clone(),
        reason,
    }
}

fn parse_str(g: &Given) -> Result<String, ConfigError> {
    match &g.value {
        Raw::Str(s) => Ok(s.clone()),
        other => Err(invalid(g, format!("expected a string, got {other:?}"))),
    }
}

fn parse_u64(g: &Given) -> Result<u64, ConfigError> {
    match &g.value {
        Raw::Int(i) => u64::try_from(*i).map_err(|_| invalid(g, format!("{i} is negative"))),
        Raw::Str(s) => value::parse_u64(s)
            .ok_or_else(|| invalid(g, format!("`{s}` is not a whole number >= 0"))),
        other => Err(invalid(
            g,
            format!("expected a whole number, got {other:?}"),
        )),
    }
}

fn parse_f64(g: &Given) -> Result<f64, ConfigError> {
    match &g.value {
        Raw::Int(i) => Ok(*i as f64),
        Raw::Float(f) => Ok(*f),
        Raw::Str(s) => s
            .trim()
            .parse::<f64>()
            .map_err(|_| invalid(g, format!("`{s}` is not a number"))),
        Raw::Bool(b) => Err(invalid(g, format!("expected a number, got {b}"))),
    }
}

fn parse_bool(v: &Raw) -> Result<bool, String> {
    match v {
        Raw::Bool(b) => Ok(*b),
        Raw::Int(0) => Ok(false),
        Raw::Int(1) => Ok(true),
        Raw::Str(s) => value::parse_bool(s).ok_or_else(|| bool_reason(s)),
        other => Err(format!("expected a boolean, got {other:?}")),
    }
}

fn positive(g: &Given, v: u64) -> Result<u64, ConfigError> {
    if v == 0 {
        Err(invalid(g, "must be greater than 0".into()))
    } else {
        Ok(v)
    }
}

fn to_usize(g: &Given, v: u64) -> Result<usize, ConfigError> {
    usize::try_from(v).map_err(|_| invalid(g, format!("{v} is too large")))
}

fn parse_remote(g: &Given) -> Result<Option<RemoteTarget>, ConfigError> {
    let url = parse_str(g)?;
    if url.trim().is_empty() {
        return Ok(None);
    }
    RemoteTarget::parse(&url)
        .map(Some)
        .map_err(|reason| invalid(g, reason))
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
    /// where `bytes_per_block_all_ranks` is one block's bytes summed over all TP ranks.
    pub fn resolve_capacity(
        &self,
        bytes_per_block_all_ranks: usize,
    ) -> Result<TierCapacities, ConfigError> {
        if bytes_per_block_all_ranks == 0 {
            return Err(ConfigError::Invalid {
                setting: "bytes per block".into(),
                reason: "is 0; the KV layout was not registered".into(),
            });
        }
        let blocks = |size: Option<TierSize>, setting: &str| -> Result<usize, ConfigError> {
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
            )?,
            disk_blocks: blocks(
                self.disk.size,
                "disk.gb (KVTIER_DISK_GB, DYN_KVBM_DISK_CACHE_GB)",
            )?,
            remote: self.remote.is_some(),
        })
    }
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}
