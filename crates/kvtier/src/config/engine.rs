//! Engine settings: the keys an engine adapter passes next to kvtier's configuration keys (block
//! size, ranks, salt, link, ...), typed and validated here, and the configuration built from the
//! rest, in one place ([`EngineSettings::load`]).
//!
//! Invariants: a key is either an engine key (`ENGINE_KEYS`) or a configuration key, never
//! both; each engine key is read through one typed accessor that refuses (never truncates) an
//! out-of-range value with a [`ConfigError`] naming the key; an engine key that has a
//! configuration counterpart (`async_loads`, `block_size`, `zmq_endpoint`) wins over it.
use std::collections::HashMap;

use serde_json::Value;

use super::{bool_reason, parse_bool_text, parse_u64_text, ConfigError, KvtierConfig};

/// The largest `world_size` accepted.
pub(crate) const MAX_WORLD_SIZE: u32 = 1 << 16;

/// The values of the `link` setting.
pub(crate) const LINKS: &[&str] = &["engine", "in_process", "zmq"];

/// Keys the adapters pass that are not kvtier configuration keys.
pub(crate) const ENGINE_KEYS: &[&str] = &[
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
    "layered_sync_loads",
    "layered_group_loads",
    "early_sync_loads",
    "recompute_tail_blocks",
    "recompute_tail_blocks_default",
    "zmq_endpoint",
    "test_load_delay_ms",
    "role",
    "kv_cache_group",
    "kv_cache_groups",
    "kv_cache_group_kind",
    "sliding_window",
    "null_block",
    // Informational keys some adapters pass along; accepted and ignored here.
    "backend_module",
];

/// An engine's settings: its own keys and kvtier's configuration.
#[derive(Debug)]
pub struct EngineSettings {
    keys: HashMap<String, Value>,
    /// kvtier's own settings (defaults < TOML < environment < the engine's map).
    pub config: KvtierConfig,
}

fn bad(key: &str, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        setting: key.to_string(),
        reason: reason.to_string(),
    }
}

impl EngineSettings {
    /// Split `map` (the engine's settings, JSON values) into engine keys and configuration keys
    /// and build the configuration from the environment `env` and the latter.
    pub fn load(
        map: serde_json::Map<String, Value>,
        env: &HashMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let mut keys = HashMap::new();
        let mut engine = serde_json::Map::new();
        for (key, value) in map {
            if ENGINE_KEYS.contains(&key.as_str()) {
                keys.insert(key, value);
            } else if !value.is_null() {
                engine.insert(key, value);
            }
        }
        let config = KvtierConfig::load(env, Some(&Value::Object(engine)))?;
        let settings = EngineSettings { keys, config };
        // Checked here, not first when read: an explicit 0 was taken as "not given" and the
        // leader waited the whole leader-worker timeout for an in-process worker's layout.
        settings.bytes_per_block()?;
        Ok(settings)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).filter(|v| !v.is_null())
    }

    /// `key` as a whole number >= 0 (a JSON number or its text); `None` if absent or null.
    fn usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| bad(key, format!("{n} is not a non-negative integer"))),
            Some(Value::String(s)) => parse_u64_text(s)
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| bad(key, format!("{s:?} is not a non-negative integer"))),
            Some(v) => Err(bad(key, format!("{v} is not a non-negative integer"))),
        }
    }

    /// `key` as a whole number that fits a `u32` (refused, never truncated, when it does not).
    fn u32(&self, key: &str) -> Result<Option<u32>, ConfigError> {
        match self.usize(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| bad(key, format!("{v} is out of range: at most {}", u32::MAX))),
        }
    }

    /// `key` as a boolean (JSON bool, 0/1, or the text kvtier's one boolean parser accepts).
    fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) => parse_bool_text(s)
                .map(Some)
                .ok_or_else(|| bad(key, bool_reason(s))),
            Some(Value::Number(n)) if n.as_u64() == Some(0) => Ok(Some(false)),
            Some(Value::Number(n)) if n.as_u64() == Some(1) => Ok(Some(true)),
            Some(v) => Err(bad(key, format!("{v} is not a boolean"))),
        }
    }

    /// `key` as a string; `None` if absent or null.
    fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(bad(key, format!("{v} is not a string"))),
        }
    }

    /// Whether loads are asynchronous: the `async_loads` key (e.g. at the top of vLLM's
    /// `kv_connector_extra_config`), else `connector.async_loads` (TOML < `KVTIER_ASYNC_LOADS`
    /// < engine keys), else the adapter's `async_loads_default`, else false.
    pub fn async_loads(&self) -> Result<bool, ConfigError> {
        Ok(self
            .bool("async_loads")?
            .or(self.config.connector.async_loads)
            .or(self.bool("async_loads_default")?)
            .unwrap_or(false))
    }

    /// Whether a hit held wholly by the host tier loads inside the step although loads are
    /// asynchronous (`crate::connector::Leader::set_sync_host_loads`): the `sync_host_loads`
    /// key, else `connector.sync_host_loads` (TOML < `KVTIER_SYNC_HOST_LOADS` < engine keys),
    /// else the adapter's `sync_host_loads_default`, else false.
    pub fn sync_host_loads(&self) -> Result<bool, ConfigError> {
        Ok(self
            .bool("sync_host_loads")?
            .or(self.config.connector.sync_host_loads)
            .or(self.bool("sync_host_loads_default")?)
            .unwrap_or(false))
    }

    /// How many blocks outside the host tier, after a host-tier prefix, a hit may end with and
    /// still load that prefix inside the step, leaving them to be recomputed
    /// (`crate::connector::Leader::set_recompute_tail`): the `recompute_tail_blocks` key, else
    /// the adapter's `recompute_tail_blocks_default`, else 0 (off).
    pub fn recompute_tail_blocks(&self) -> Result<usize, ConfigError> {
        Ok(self
            .usize("recompute_tail_blocks")?
            .or(self.usize("recompute_tail_blocks_default")?)
            .unwrap_or(0))
    }

    /// Tokens per block: the `block_size` key, else the configuration's; 1..=`u32::MAX`.
    pub fn block_size(&self) -> Result<usize, ConfigError> {
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

    /// The engine's tensor-parallel world size (`world_size`, default 1; 1..=65536).
    pub fn world_size(&self) -> Result<u32, ConfigError> {
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

    /// This process's rank (`rank`); `None` if not given.
    pub fn rank(&self) -> Result<Option<usize>, ConfigError> {
        self.usize("rank")
    }

    /// The engine's hash salt text (`salt`).
    pub fn salt(&self) -> Result<Option<String>, ConfigError> {
        self.string("salt")
    }

    /// Bytes of one block over every rank (`bytes_per_block`); absent: learnt from the workers'
    /// layouts. An explicit 0 is refused (a block holds bytes).
    pub fn bytes_per_block(&self) -> Result<Option<usize>, ConfigError> {
        match self.usize("bytes_per_block")? {
            Some(0) => Err(bad(
                "bytes_per_block",
                "0 is not a block size (omit the key to take it from the workers' layouts)",
            )),
            v => Ok(v),
        }
    }

    /// The engine's device blocks (`num_device_blocks`), at most `u32::MAX`.
    pub fn num_device_blocks(&self) -> Result<Option<u32>, ConfigError> {
        self.u32("num_device_blocks")
    }

    /// The engine's device blocks (`num_device_blocks`) as a count.
    pub fn num_device_blocks_usize(&self) -> Result<Option<usize>, ConfigError> {
        self.usize("num_device_blocks")
    }

    /// The engine's KV cache group this leader or worker serves, of how many, and the group's
    /// layer kind (`kv_cache_group`, `kv_cache_groups`, `kv_cache_group_kind`; vLLM's hybrid KV
    /// cache manager): `None` for an engine of one group.
    pub fn kv_cache_group(&self) -> Result<Option<(usize, usize, String)>, ConfigError> {
        let count = self.usize("kv_cache_groups")?.unwrap_or(1);
        if count <= 1 {
            return Ok(None);
        }
        let index = self.usize("kv_cache_group")?.unwrap_or(0);
        if index >= count {
            return Err(bad(
                "kv_cache_group",
                format!("{index} is not below kv_cache_groups ({count})"),
            ));
        }
        let kind = self.string("kv_cache_group_kind")?.unwrap_or_default();
        Ok(Some((index, count, format!("{index}|{kind}"))))
    }

    /// The attention window of a sliding-window group in tokens (`sliding_window`) and the
    /// engine's id for a position without a block (`null_block`).
    pub fn sliding_window(&self) -> Result<(Option<usize>, Option<u32>), ConfigError> {
        Ok((self.usize("sliding_window")?, self.u32("null_block")?))
    }

    /// The `link` key: `None` (unset) or one of `engine`, `in_process`, `zmq`; anything else is refused naming the
    /// values accepted (#28: `link="bogus"` was taken as the default).
    pub fn link(&self) -> Result<Option<String>, ConfigError> {
        match self.string("link")? {
            None => Ok(None),
            Some(l) if LINKS.contains(&l.as_str()) => Ok(Some(l)),
            Some(l) => Err(bad(
                "link",
                format!("{l:?} is not one of {}", LINKS.join(", ")),
            )),
        }
    }

    /// The in-process channel key pairing a Leader with its Workers (`channel`, default
    /// "default").
    pub fn channel(&self) -> Result<String, ConfigError> {
        Ok(self
            .string("channel")?
            .unwrap_or_else(|| "default".to_string()))
    }

    /// The engine's tensor layout name (`layout`).
    pub fn layout(&self) -> Result<Option<String>, ConfigError> {
        self.string("layout")
    }

    /// The KV element type the engine names (`dtype`).
    pub fn dtype(&self) -> Result<Option<String>, ConfigError> {
        self.string("dtype")
    }

    /// The serving role (`role`: vLLM's `kv_role` or kvtier's names).
    pub fn role(&self) -> Result<Option<String>, ConfigError> {
        self.string("role")
    }

    /// Whether the engine's finished ids are the ones still saving (`finished_ids_are_saving`).
    pub fn finished_ids_are_saving(&self) -> Result<bool, ConfigError> {
        Ok(self.bool("finished_ids_are_saving")?.unwrap_or(false))
    }

    /// Whether synchronous loads are ordered on the engine's stream (`ordered_sync_loads`).
    pub fn ordered_sync_loads(&self) -> Result<bool, ConfigError> {
        Ok(self.bool("ordered_sync_loads")?.unwrap_or(false))
    }

    /// Whether ordered synchronous loads may go layer by layer (`layered_sync_loads`).
    pub fn layered_sync_loads(&self) -> Result<bool, ConfigError> {
        Ok(self.bool("layered_sync_loads")?.unwrap_or(false))
    }

    /// Whether a model with several KV cache groups may layer its ordered loads too
    /// (`layered_group_loads`; vLLM's adapter asks the worker).
    pub fn layered_group_loads(&self) -> Result<bool, ConfigError> {
        Ok(self.bool("layered_group_loads")?.unwrap_or(false))
    }

    /// Whether an adapter whose scheduler and worker share the engine's thread may start a
    /// step's synchronous loads when the scheduler builds the step, before the engine prepares
    /// its inputs (`early_sync_loads`; vLLM's adapter asks the worker).
    pub fn early_sync_loads(&self) -> Result<bool, ConfigError> {
        Ok(self.bool("early_sync_loads")?.unwrap_or(false))
    }

    /// A delay added to every load, for tests (`test_load_delay_ms`; 0 = none).
    pub fn test_load_delay_ms(&self) -> Result<Option<usize>, ConfigError> {
        Ok(self.usize("test_load_delay_ms")?.filter(|ms| *ms > 0))
    }

    /// The ZeroMQ endpoint of the leader <-> worker channel: the `zmq_endpoint` key, else
    /// `connector.zmq_endpoint` (`KVTIER_ZMQ_ENDPOINT`).
    pub fn zmq_endpoint(&self) -> Result<Option<String>, ConfigError> {
        Ok(self
            .string("zmq_endpoint")?
            .or_else(|| self.config.connector.zmq_endpoint.clone())
            .filter(|e| !e.trim().is_empty()))
    }

    /// How long the leader and its workers wait for each other
    /// (`connector.leader_worker_timeout_secs`).
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.config.connector.leader_worker_timeout_secs)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, Value)]) -> EngineSettings {
        let mut map = serde_json::Map::new();
        map.insert("host.num_blocks".into(), Value::from(4));
        for (k, v) in pairs {
            map.insert((*k).to_string(), v.clone());
        }
        EngineSettings::load(map, &HashMap::new()).unwrap()
    }

    /// An explicit `bytes_per_block: 0` was taken as "not given" (the leader then waited the
    /// leader-worker timeout for an in-process worker): refused when the settings are built.
    #[test]
    fn zero_bytes_per_block_is_refused_at_load() {
        let mut map = serde_json::Map::new();
        map.insert("bytes_per_block".into(), Value::from(0));
        map.insert("host.num_blocks".into(), Value::from(4));
        let e = EngineSettings::load(map, &HashMap::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bytes_per_block") && e.contains("0 is not"),
            "{e}"
        );
        let s = settings(&[("bytes_per_block", Value::from(4096))]);
        assert_eq!(s.bytes_per_block().unwrap(), Some(4096));
        assert_eq!(settings(&[]).bytes_per_block().unwrap(), None);
    }

    /// Regression (#28): `block_size = 2**32 + 16` became 16 (silent truncation to 32 bits),
    /// `link = "bogus"` was accepted, and `world_size = 10**6` gave an error that did not name
    /// the problem. Each is refused with an error naming the key and the range.
    #[test]
    fn out_of_range_settings_are_refused_by_name() {
        let s = settings(&[("block_size", Value::from((1u64 << 32) + 16))]);
        let e = s.block_size().unwrap_err().to_string();
        assert!(
            e.contains("block_size") && e.contains("out of range"),
            "{e}"
        );
        let s = settings(&[("world_size", Value::from(1_000_000))]);
        let e = s.world_size().unwrap_err().to_string();
        assert!(e.contains("world_size") && e.contains("1..=65536"), "{e}");
        let s = settings(&[("num_device_blocks", Value::from(1u64 << 33))]);
        let e = s.num_device_blocks().unwrap_err().to_string();
        assert!(e.contains("num_device_blocks"), "{e}");
        let s = settings(&[("link", Value::from("bogus"))]);
        let e = s.link().unwrap_err().to_string();
        assert!(e.contains("link") && e.contains("zmq"), "{e}");
        let s = settings(&[("link", Value::from("zmq"))]);
        assert_eq!(s.link().unwrap().as_deref(), Some("zmq"));
        let s = settings(&[("block_size", Value::from(16))]);
        assert_eq!(s.block_size().unwrap(), 16);
        // A count: the user's value, else the adapter's default, else off; no negative counts.
        let s = settings(&[("recompute_tail_blocks", Value::from(8))]);
        assert_eq!(s.recompute_tail_blocks().unwrap(), 8);
        let s = settings(&[
            ("recompute_tail_blocks_default", Value::from(16)),
            ("recompute_tail_blocks", Value::from(0)),
        ]);
        assert_eq!(
            s.recompute_tail_blocks().unwrap(),
            0,
            "the user's 0 turns it off"
        );
        let s = settings(&[("recompute_tail_blocks_default", Value::from(16))]);
        assert_eq!(s.recompute_tail_blocks().unwrap(), 16);
        assert_eq!(settings(&[]).recompute_tail_blocks().unwrap(), 0);
        let e = settings(&[("recompute_tail_blocks", Value::from(-1))])
            .recompute_tail_blocks()
            .unwrap_err()
            .to_string();
        assert!(e.contains("recompute_tail_blocks"), "{e}");
        // A switch is a boolean: the string "false" must not turn it on (Python's bool("false")
        // would), and what is no boolean is refused by name.
        let s = settings(&[("layered_group_loads", Value::from("false"))]);
        assert!(!s.layered_group_loads().unwrap());
        let s = settings(&[("layered_group_loads", Value::from("sometimes"))]);
        let e = s.layered_group_loads().unwrap_err().to_string();
        assert!(e.contains("layered_group_loads"), "{e}");
        let s = settings(&[("layered_group_loads", Value::from(true))]);
        assert!(s.layered_group_loads().unwrap());
        assert!(!settings(&[]).layered_group_loads().unwrap());
        assert!(!settings(&[]).early_sync_loads().unwrap());
        let s = settings(&[("early_sync_loads", Value::from(true))]);
        assert!(s.early_sync_loads().unwrap());
        let e = settings(&[("early_sync_loads", Value::from("soon"))])
            .early_sync_loads()
            .unwrap_err()
            .to_string();
        assert!(e.contains("early_sync_loads"), "{e}");
    }

    /// The engine's `async_loads` wins over the configuration's, which wins over the
    /// adapter's default; engine keys never reach the configuration and vice versa.
    #[test]
    fn engine_keys_and_configuration_keys_are_split_and_layered() {
        let s = settings(&[("async_loads_default", Value::from(true))]);
        assert!(s.async_loads().unwrap());
        let s = settings(&[
            ("async_loads_default", Value::from(true)),
            ("connector.async_loads", Value::from(false)),
        ]);
        assert!(!s.async_loads().unwrap());
        let s = settings(&[
            ("async_loads", Value::from("yes")),
            ("connector.async_loads", Value::from(false)),
        ]);
        assert!(s.async_loads().unwrap());
        assert!(!settings(&[]).async_loads().unwrap());
        assert_eq!(settings(&[]).channel().unwrap(), "default");
        assert_eq!(
            settings(&[("test_load_delay_ms", Value::from(0))])
                .test_load_delay_ms()
                .unwrap(),
            None
        );
    }
}
