//! The layered build of a [`KvtierConfig`]: each source (TOML, environment, engine map) becomes a
//! layer of raw values tagged with the name they were given under; layers merge lowest first, and
//! typed parsing happens once, on the merged map, so every error names the setting as the user
//! spelled it.
use std::collections::{BTreeMap, HashMap};

use super::settings::{Setting, EXCLUSIVE, SETTINGS};
use super::value::{self, bool_reason};
use super::*;

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
        if let Some(g) = merged.get("remote.mac_key_file") {
            let f = parse_str(g)?;
            if !f.trim().is_empty() {
                match &mut c.remote {
                    Some(t) if !matches!(t.backend, RemoteBackend::Node { .. }) => {
                        t.mac_key_file = Some(PathBuf::from(f));
                    }
                    Some(_) => {
                        return Err(invalid(
                            g,
                            "the node tier (node://) is local shared memory and takes no MAC key"
                                .into(),
                        ))
                    }
                    None => {
                        return Err(invalid(
                            g,
                            "set remote.url (a Redis or directory store)".into(),
                        ))
                    }
                }
            }
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
        if let Some(g) = merged.get("connector.sync_host_loads") {
            c.connector.sync_host_loads = Some(parse_bool(&g.value).map_err(|r| invalid(g, r))?);
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
        .map_err(|reason| invalid(g, reason.to_string()))
}
