//! Engine-supplied settings: a Python dict turned into the adapter's own keys plus a validated
//! [`KvtierConfig`] (defaults < `$KVTIER_CONFIG` TOML < `KVTIER_*`/`DYN_KVBM_*` environment <
//! the dict's remaining keys, which are kvtier configuration keys).
//!
//! Invariant: this is the only place the bindings read the process environment; everything after
//! works from the resulting values. A bad value is a `ConfigError` naming the key.
use std::collections::HashMap;

use kvtier::config::EngineSettings;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::{BridgeError, BridgeResult, Family};

/// Where the leader listens when a `zmq` link is asked for and no endpoint is configured: a Unix
/// socket in the user's private directory ([`kvtier::connector::zmq_auth::private_dir`], 0700),
/// named after the `channel` setting. No fixed TCP port (#13: any local user could take a
/// well-known one first); another user cannot reach the socket; a second live leader on the same
/// channel fails to bind ("address in use") instead of taking the first one's ranks.
pub(crate) fn default_zmq_endpoint(channel: &str) -> BridgeResult<String> {
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

/// The settings as the bindings use them: kvtier's [`EngineSettings`] (engine keys and the
/// configuration, split and typed in the core), read from a Python dict.
#[derive(Debug)]
pub(crate) struct Settings(EngineSettings);

impl std::ops::Deref for Settings {
    type Target = EngineSettings;
    fn deref(&self) -> &EngineSettings {
        &self.0
    }
}

fn bad(key: &str, reason: impl std::fmt::Display) -> BridgeError {
    BridgeError::local(Family::Config, format!("{key}: {reason}"))
}

/// How deep a setting's lists and dicts may nest: a self-referential list (`x.append(x)`) or a
/// deeply nested one overflowed the stack of the engine's thread (SIGSEGV) before this bound.
pub(crate) const MAX_DEPTH: usize = 32;

/// Converts a Python value (None, bool, int, float, str, list/tuple, dict) to JSON.
pub(crate) fn to_json(key: &str, v: &Bound<'_, PyAny>) -> BridgeResult<serde_json::Value> {
    to_json_at(key, v, 0)
}

fn to_json_at(key: &str, v: &Bound<'_, PyAny>, depth: usize) -> BridgeResult<serde_json::Value> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return Err(bad(
            key,
            format!("nests deeper than {MAX_DEPTH} lists or dicts (or contains itself)"),
        ));
    }
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
            map.insert(k, to_json_at(&sub, &val, depth + 1)?);
        }
        return Ok(Value::Object(map));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let mut out = Vec::new();
        for item in v.try_iter().map_err(|e| bad(key, e))? {
            out.push(to_json_at(key, &item.map_err(|e| bad(key, e))?, depth + 1)?);
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
    /// The dict's values as JSON, split and built by [`EngineSettings::load`] with the process
    /// environment.
    pub(crate) fn from_py(dict: Option<&Bound<'_, PyDict>>) -> BridgeResult<Self> {
        let mut map = serde_json::Map::new();
        if let Some(d) = dict {
            for (k, v) in d.iter() {
                let key: String = k
                    .extract()
                    .map_err(|_| bad("settings", "keys must be strings"))?;
                let value = to_json(&key, &v)?;
                map.insert(key, value);
            }
        }
        let env: HashMap<String, String> = std::env::vars().collect();
        Ok(Settings(EngineSettings::load(map, &env)?))
    }

    /// [`EngineSettings::zmq_endpoint`], else [`default_zmq_endpoint`] of the channel.
    pub(crate) fn zmq_endpoint_or_default(&self) -> BridgeResult<String> {
        match self.zmq_endpoint()? {
            Some(e) => Ok(e),
            None => default_zmq_endpoint(&self.channel()?),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Python values reach the core's typed engine settings unchanged (the range checks are
    /// the core's: `config::engine` tests).
    #[test]
    fn python_values_reach_the_engine_settings() {
        Python::initialize();
        Python::attach(|py| {
            let d = PyDict::new(py);
            d.set_item("host.num_blocks", 4).unwrap();
            d.set_item("block_size", (1u64 << 32) + 16).unwrap();
            d.set_item("link", "zmq").unwrap();
            let s = Settings::from_py(Some(&d)).unwrap();
            let e = s.block_size().unwrap_err().to_string();
            assert!(
                e.contains("block_size") && e.contains("out of range"),
                "{e}"
            );
            assert_eq!(s.link().unwrap().as_deref(), Some("zmq"));
        });
    }
}
