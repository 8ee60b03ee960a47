//! The table of every setting kvtier reads: its TOML key (also the engine key), its environment
//! name and the original `DYN_KVBM_*` aliases. Invariant: a key absent from [`SETTINGS`] is
//! refused by every layer, so `docs/CONFIG.md` and this table are the whole surface.
/// One setting: its TOML key (also the engine key), its environment name and aliases.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    /// The TOML key, also the engine key (e.g. `host.gb`).
    pub key: &'static str,
    /// The environment variable (`KVTIER_*`).
    pub env: &'static str,
    /// Older names of the variable (`DYN_KVBM_*`); the `KVTIER_*` name wins.
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
    s("remote.mac_key_file", "KVTIER_REMOTE_MAC_KEY_FILE", &[]),
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
    s("connector.sync_host_loads", "KVTIER_SYNC_HOST_LOADS", &[]),
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
pub(super) const EXCLUSIVE: &[(&str, &str)] = &[
    ("host.gb", "host.num_blocks"),
    ("disk.gb", "disk.num_blocks"),
];

/// Name of the environment variable holding the TOML file path.
pub const CONFIG_PATH_ENV: &str = "KVTIER_CONFIG";
