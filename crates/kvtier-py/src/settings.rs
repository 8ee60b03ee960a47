//! Engine-supplied settings: a Python dict turned into the adapter's own keys plus a validated
//! [`KvtierConfig`] (defaults < `$KVTIER_CONFIG` TOML < `KVTIER_*`/`DYN_KVBM_*` environment <
//! the dict's remaining keys, which are kvtier configuration keys).
//!
//! Invariant: this is the only place the bindings read the process environment; everything after
//! works from the resulting values. A bad value is a `ConfigError` naming the key.
use std::collections::HashMap;

use kvtier::config::KvtierConfig;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::{BridgeError, BridgeResult, Family};

/// Where the leader listens when a `zmq` link is asked for and no endpoint is configured: a Unix
/// socket in the user's private directory ([`kvtier::connector::zmq_auth::private_dir`], 0700),
/// named after the `channel` setting. No fixed TCP port (#13: any local user could take a
/// well-known one first); another user cannot reach the socket; a second live leader on the same
/// channel fails to bind ("address in use") instead of taking the first one's ranks.
pub fn default_zmq_endpoint(channel: &str) -> BridgeResult<String> {
    let dir = kvtier::connector::zmq_auth::private_dir().map_err(BridgeError::from)?;
    let plain = !channel.is_empty()
        && channel.len() <= 40
        && channel
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    let name = if plain {
        channel.to_owned()
    } else {
        // Deterministic for one build (leader and ranks run the same one).
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        channel.hash(&mut h);
        format!("{:016x}", h.finish())
    };
    Ok(format!("ipc://{}/zmq-{name}.sock", dir.display()))
}

/// Keys the adapters pass that are not kvtier configuration keys.
/// The largest `world_size` accepted.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;

/// The values of the `link` setting.
pub const LINKS: &[&str] = &["engine", "in_process", "zmq"];

const ADAPTER_KEYS: &[&str] = &[
    "block_size",
    "world_size",
    "rank",
    "async_loads",
    "async_loads_default",
    "sync_host_loads",
    "sync_host_loads_default",
    "salt",
    "bytes_per_block",
    "num_device_blocks",
    "link",
    "channel",
    "layout",
    "dtype",
    "finished_ids_are_saving",
    "ordered_sync_loads",
    "zmq_endpoint",
    "test_load_delay_ms",
    "role",
    // Informational keys some adapters pass along; accepted and ignored here.
    "backend_module",
];

/// The settings as the bindings use them.
#[derive(Debug)]
pub struct Settings {
    adapter: HashMap<String, serde_json::Value>,
    /// kvtier's own settings (defaults < TOML < environment < the engine's map).
    pub config: KvtierConfig,
}

fn bad(key: &str, reason: impl std::fmt::Display) -> BridgeError {
    BridgeError::local(Family::Config, format!("{key}: {reason}"))
}

/// Converts a Python value (None, bool, int, float, str, list/tuple, dict) to JSON.
pub fn to_json(key: &str, v: &Bound<'_, PyAny>) -> BridgeResult<serde_json::Value> {
    use serde_json::Value;
    if v.is_none() {
        return Ok(Value::Null);
    }
    if v.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(v.extract::<bool>().map_err(|e| bad(key, e))?));
    }
    if v.is_instance_of::<PyInt>() {
        let i: i64 = v.extract().map_err(|e| bad(key, e))?;
        return Ok(Value::from(i));
    }
    if v.is_instance_of::<PyFloat>() {
        let f: f64 = v.extract().map_err(|e| bad(key, e))?;
        return serde_json::Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| bad(key, format!("{f} is not a finite number")));
    }
    if v.is_instance_of::<PyString>() {
        return Ok(Value::String(v.extract().map_err(|e| bad(key, e))?));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        let mut map = serde_json::Map::new();
        for (k, val) in d.iter() {
            let k: String = k.str().map_err(|e| bad(key, e))?.to_string();
            let sub = format!("{key}.{k}");
            map.insert(k, to_json(&sub, &val)?);
        }
        return Ok(Value::Object(map));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let mut out = Vec::new();
        for item in v.try_iter().map_err(|e| bad(key, e))? {
            out.push(to_json(key, &item.map_err(|e| bad(key, e))?)?);
        }
        return Ok(Value::Array(out));
    }
    Err(bad(
        key,
        format!(
            "unsupported value of type {}",
            v.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ),
    ))
}

impl Settings {
    /// Split `dict` into adapter keys and configuration keys and build the configuration.
    pub fn from_py(dict: Option<&Bound<'_, PyDict>>) -> BridgeResult<Self> {
        let mut adapter = HashMap::new();
        let mut engine = serde_json::Map::new();
        if let Some(d) = dict {
            for (k, v) in d.iter() {
                let key: String = k
                    .extract()
                    .map_err(|_| bad("settings", "keys must be strings"))?;
                let value = to_json(&key, &v)?;
                if ADAPTER_KEYS.contains(&key.as_str()) {
                    adapter.insert(key, value);
                } else if !value.is_null() {
                    engine.insert(key, value);
                }
            }
        }
        let env: HashMap<String, String> = std::env::vars().collect();
        let engine = serde_json::Value::Object(engine);
        let config = KvtierConfig::load(&env, Some(&engine))?;
        Ok(Settings { adapter, config })
    }

    fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.adapter.get(key).filter(|v| !v.is_null())
    }

    /// The adapter setting `key` as a whole number >= 0 (a JSON number or its text); `None` if
    /// absent or null.
    pub fn usize(&self, key: &str) -> BridgeResult<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(serde_json::Value::Number(n)) => n
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| bad(key, format!("{n} is not a non-negative integer"))),
            Some(serde_json::Value::String(s)) => kvtier::config::parse_u64_text(s)
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| bad(key, format!("{s:?} is not a non-negative integer"))),
            Some(v) => Err(bad(key, format!("{v} is not a non-negative integer"))),
        }
    }

    /// The adapter setting `key` as a boolean (JSON bool, 0/1, or the text kvtier's one boolean
    /// parser accepts); `None` if absent or null.
    pub fn bool(&self, key: &str) -> BridgeResult<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
            Some(serde_json::Value::String(s)) => kvtier::config::parse_bool_text(s)
                .map(Some)
                .ok_or_else(|| bad(key, kvtier::config::bool_reason(s))),
            Some(serde_json::Value::Number(n)) if n.as_u64() == Some(0) => Ok(Some(false)),
            Some(serde_json::Value::Number(n)) if n.as_u64() == Some(1) => Ok(Some(true)),
            Some(v) => Err(bad(key, format!("{v} is not a boolean"))),
        }
    }

    /// The adapter setting `key` as a string; `None` if absent or null.
    pub fn string(&self, key: &str) -> BridgeResult<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(bad(key, format!("{v} is not a string"))),
        }
    }

    /// Whether loads are asynchronous: the `async_loads` setting (engine-supplied, e.g. vLLM's
    /// `kv_connector_extra_config`), else `connector.async_loads` (TOML < `KVTIER_ASYNC_LOADS` <
    /// engine keys), else the adapter's `async_loads_default`, else false.
    pub fn async_loads(&self) -> BridgeResult<bool> {
        Ok(self
            .bool("async_loads")?
            .or(self.config.connector.async_loads)
            .or(self.bool("async_loads_default")?)
            .unwrap_or(false))
    }

    /// Whether a hit held wholly by the host tier loads inside the step although loads are
    /// asynchronous (`kvtier::connector::Leader::set_sync_host_loads`): the `sync_host_loads`
    /// setting, else `connector.sync_host_loads` (TOML < `KVTIER_SYNC_HOST_LOADS` < engine keys),
    /// else the adapter's `sync_host_loads_default`, else false.
    pub fn sync_host_loads(&self) -> BridgeResult<bool> {
        Ok(self
            .bool("sync_host_loads")?
            .or(self.config.connector.sync_host_loads)
            .or(self.bool("sync_host_loads_default")?)
            .unwrap_or(false))
    }

    /// Tokens per block: the `block_size` setting, else the configuration's.
    pub fn block_size(&self) -> BridgeResult<usize> {
        let b = self
            .usize("block_size")?
            .or(self.config.connector.block_size)
            .ok_or_else(|| {
                bad(
                    "block_size",
                    "required (tokens per block; TensorRT-LLM tokens_per_block, vLLM block_size)",
                )
            })?;
        // Refused, never truncated (#28: 2**32 + 16 became 16).
        if b == 0 || u32::try_from(b).is_err() {
            return Err(bad(
                "block_size",
                format!(
                    "{b} is out of range: tokens per block must be 1..={}",
                    u32::MAX
                ),
            ));
        }
        Ok(b)
    }

    /// The engine's tensor-parallel world size (`world_size`, default 1; 1..=[`MAX_WORLD_SIZE`]).
    pub fn world_size(&self) -> BridgeResult<u32> {
        let w = self.usize("world_size")?.unwrap_or(1);
        u32::try_from(w)
            .ok()
            .filter(|w| (1..=MAX_WORLD_SIZE).contains(w))
            .ok_or_else(|| {
                bad(
                    "world_size",
                    format!(
                        "{w} is out of range: the tensor-parallel world size must be \
                         1..={MAX_WORLD_SIZE}"
                    ),
                )
            })
    }

    /// The adapter setting `key` as a whole number that fits a `u32` (refused, never
    /// truncated, when it does not); `None` if absent or null.
    pub fn u32(&self, key: &str) -> BridgeResult<Option<u32>> {
        match self.usize(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| bad(key, format!("{v} is out of range: at most {}", u32::MAX))),
        }
    }

    /// The `link` setting: `None` (unset) or one of [`LINKS`]; anything else is refused naming
    /// the values accepted (#28: `link="bogus"` was taken as the default).
    pub fn link(&self) -> BridgeResult<Option<String>> {
        match self.string("link")? {
            None => Ok(None),
            Some(l) if LINKS.contains(&l.as_str()) => Ok(Some(l)),
            Some(l) => Err(bad(
                "link",
                format!("{l:?} is not one of {}", LINKS.join(", ")),
            )),
        }
    }

    /// The ZeroMQ endpoint of the leader <-> worker channel: the `zmq_endpoint` setting, else
    /// `connector.zmq_endpoint` (`KVTIER_ZMQ_ENDPOINT`).
    pub fn zmq_endpoint(&self) -> BridgeResult<Option<String>> {
        Ok(self
            .string("zmq_endpoint")?
            .or_else(|| self.config.connector.zmq_endpoint.clone())
            .filter(|e| !e.trim().is_empty()))
    }

    /// [`Settings::zmq_endpoint`], else [`default_zmq_endpoint`] of the channel.
    pub fn zmq_endpoint_or_default(&self) -> BridgeResult<String> {
        match self.zmq_endpoint()? {
            Some(e) => Ok(e),
            None => default_zmq_endpoint(&self.channel()?),
        }
    }

    /// How long the leader and its workers wait for each other
    /// (`connector.leader_worker_timeout_secs`).
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.config.connector.leader_worker_timeout_secs)
    }

    /// The in-process channel key pairing a Leader with its Workers.
    pub fn channel(&self) -> BridgeResult<String> {
        Ok(self
            .string("channel")?
            .unwrap_or_else(|| "default".to_string()))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, Bound<'_, PyAny>)]) -> BridgeResult<Settings> {
        let py = pairs[0].1.py();
        let d = PyDict::new(py);
        d.set_item("host.num_blocks", 4).unwrap();
        for (k, v) in pairs {
            d.set_item(k, v).unwrap();
        }
        Settings::from_py(Some(&d))
    }

    /// Regression (#28): `block_size = 2**32 + 16` became 16 (silent truncation to 32 bits),
    /// `link = "bogus"` was accepted, and `world_size = 10**6` gave an error that did not name
    /// the problem. Each is refused with an error naming the key and the range.
    #[test]
    fn out_of_range_settings_are_refused_by_name() {
        Python::initialize();
        Python::attach(|py| {
            let int = |v: u64| v.into_pyobject(py).unwrap().into_any();
            let s = settings(&[("block_size", int((1 << 32) + 16))]).unwrap();
            let e = s.block_size().unwrap_err().to_string();
            assert!(
                e.contains("block_size") && e.contains("out of range"),
                "{e}"
            );
            let s = settings(&[("world_size", int(1_000_000))]).unwrap();
            let e = s.world_size().unwrap_err().to_string();
            assert!(e.contains("world_size") && e.contains("1..=65536"), "{e}");
            let s = settings(&[("num_device_blocks", int(1 << 33))]).unwrap();
            let e = s.u32("num_device_blocks").unwrap_err().to_string();
            assert!(e.contains("num_device_blocks"), "{e}");
            let s = settings(&[("link", "bogus".into_pyobject(py).unwrap().into_any())]).unwrap();
            let e = s.link().unwrap_err().to_string();
            assert!(e.contains("link") && e.contains("zmq"), "{e}");
            let s = settings(&[("link", "zmq".into_pyobject(py).unwrap().into_any())]).unwrap();
            assert_eq!(s.link().unwrap().as_deref(), Some("zmq"));
            let s = settings(&[("block_size", int(16))]).unwrap();
            assert_eq!(s.block_size().unwrap(), 16);
        });
    }
}
