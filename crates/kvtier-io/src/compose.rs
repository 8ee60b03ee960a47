//! The composition root: the one place that turns kvtier's typed configuration into running
//! parts. Given the [`KvtierConfig`], the engine's identity ([`EngineIdentity`]: model, revision,
//! dtype, KV layout), the cluster layout (tokens per block, device blocks, bytes per block per
//! rank) and the serving role, a [`Composition`] builds the leader, each rank's transfer engine
//! (host and disk tiers) and the remote store. The reference engine (kvtier-engine) and both
//! Python adapters (through kvtier-py's `Leader` and `Worker`) call it; nothing else wires these
//! pieces, so a setting means the same under every engine.
//!
//! What it decides, once for everyone:
//! - tier sizes: `KvtierConfig::resolve_capacity` over the bytes per block summed over ranks;
//! - the hash salt and the remote namespace, both from the engine identity (with `hashing.model`
//!   replacing the engine's model name when set): two engines of different models sharing one
//!   `remote.url` use different namespaces *and* different sequence hashes, so neither can ever
//!   read the other's block;
//! - the disk policy: the `policy.disk_filter.*` frequency filter whenever there are both a
//!   host and a disk tier (with no host tier every stored block goes straight to disk);
//! - remote puts: every role but `Decode` and `Consumer` writes to the remote store; a
//!   `Consumer` stores nothing at all;
//! - the metrics endpoint (`metrics.enabled`, `metrics.port`): [`Composition::metrics`];
//! - the disk tier's files: `disk.dir`, `disk.use_o_direct`, `disk.io_backend`, one locked file
//!   set per rank (`rank<N>` under `<disk.dir>/kvtier-g3/`; `rank<N>-g<G>` for KV cache group `G`
//!   of an engine with several, [`Composition::for_group`]), kept across restarts with
//!   `disk.persist`: the leader then adopts the blocks every rank's journal holds (warm restart).
//!
//! Invariants: a `Composition` only exists for a valid configuration whose tiers hold at least
//! one block each; the leader and every rank built from equal inputs get equal capacities,
//! salts and namespaces (they may live in different processes).
//!
//! ```
//! use kvtier::config::KvtierConfig;
//! use kvtier::connector::messages::ClusterLayout;
//! use kvtier_io::compose::{Composition, EngineIdentity, ServingRole};
//!
//! let env = [("KVTIER_HOST_NUM_BLOCKS".to_string(), "8".to_string())].into();
//! let cfg = KvtierConfig::build(None, &env, None).unwrap();
//! let cluster = ClusterLayout { block_size: 16, num_device_blocks: 64, bytes_per_block: vec![4096] };
//! let c = Composition::new(&cfg, EngineIdentity::new("llama"), cluster, ServingRole::Aggregated).unwrap();
//! let leader = c.leader(None, true).unwrap();
//! assert_eq!(leader.stats().host_capacity, 8);
//! assert_ne!(c.namespace(), Composition::new(&cfg, EngineIdentity::new("qwen"),
//!     ClusterLayout { block_size: 16, num_device_blocks: 64, bytes_per_block: vec![4096] },
//!     ServingRole::Aggregated).unwrap().namespace());
//! ```
use std::sync::Arc;

use kvtier::config::{ConfigError, IoBackend, KvtierConfig, RemoteBackend, TierCapacities};
use kvtier::connector::messages::ClusterLayout;
use kvtier::connector::{Capacity, ConnectorError, DiskPolicy, Leader, LeaderConfig};
use kvtier::hash::HashSalt;
use kvtier::policy::FilterParams;
use kvtier::pool::Priority;
use kvtier::transfer::{RemoteStore, TransferError};

use crate::metrics_http::{self, StatsPublisher};
use crate::{
    DirectMode, DiskIoMode, DiskOptions, DiskStorage, EngineMemory, HostOptions, HostStorage,
    IoError, PinMode, TransferEngine,
};

/// What the engine is: whatever makes two engines' KV bytes for the same tokens differ.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineIdentity {
    /// Model name or path (vLLM passes its whole identity string here through the `salt`
    /// setting).
    pub model: String,
    /// Model revision (a checkpoint's commit or tag), if the engine knows it.
    pub revision: Option<String>,
    /// KV cache dtype.
    pub dtype: Option<String>,
    /// The KV layout's description (kind and geometry).
    pub kv_layout: Option<String>,
}

impl EngineIdentity {
    /// The identity of `model`, with no revision, dtype or layout named.
    pub fn new(model: impl Into<String>) -> Self {
        EngineIdentity {
            model: model.into(),
            ..Default::default()
        }
    }

    /// The identity as one string: the model alone when nothing else is known, else
    /// `model|revision|dtype|layout`.
    pub fn key(&self) -> String {
        if self.revision.is_none() && self.dtype.is_none() && self.kv_layout.is_none() {
            return self.model.clone();
        }
        let f = |o: &Option<String>| o.clone().unwrap_or_default();
        format!(
            "{}|{}|{}|{}",
            self.model,
            f(&self.revision),
            f(&self.dtype),
            f(&self.kv_layout)
        )
    }

    /// The remote namespace: a readable prefix of the model name plus 64 bits of the identity's
    /// hash (`[A-Za-z0-9_.-]`, at most 64 characters).
    pub fn namespace(&self) -> String {
        let tail = self.model.rsplit('/').next().unwrap_or("");
        let mut prefix: String = tail
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        if prefix.is_empty() || prefix.starts_with('.') {
            prefix.insert(0, 'm');
            prefix.truncate(40);
        }
        let h = xxhash_rust::xxh3::xxh3_64(self.key().as_bytes());
        format!("{prefix}-{h:016x}")
    }
}

/// What this engine does in disaggregated serving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServingRole {
    /// Prefill and decode in one engine.
    #[default]
    Aggregated,
    /// Computes prompts; its blocks go to the remote store for a decode engine.
    Prefill,
    /// Continues from KV another engine computed; reads the remote store, never writes it.
    Decode,
    /// vLLM's `kv_consumer`: loads from every tier and stores nothing anywhere (vLLM's role
    /// semantics: a consumer only consumes KV; its own connectors save nothing there, e.g.
    /// `is_kv_consumer` in vllm/distributed/kv_transfer/kv_connector/v1/mooncake).
    Consumer,
}

impl ServingRole {
    /// vLLM's `kv_role` as kvtier's role: `kv_both` aggregated, `kv_producer` a prefill engine,
    /// `kv_consumer` a consumer; anything else is not a role.
    pub fn from_vllm(role: &str) -> Option<Self> {
        match role {
            "kv_both" | "both" => Some(ServingRole::Aggregated),
            "kv_producer" | "producer" => Some(ServingRole::Prefill),
            "kv_consumer" | "consumer" => Some(ServingRole::Consumer),
            _ => None,
        }
    }
}

/// Why an engine's kvtier could not be composed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ComposeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A tier could not be set up.
    #[error("{0}")]
    Io(#[from] IoError),
    /// The remote store could not be opened.
    #[error("remote tier ({url}): {source}")]
    Remote {
        /// Its URL, password redacted.
        url: String,
        /// Why it could not be opened.
        #[source]
        source: TransferError,
    },
    /// The leader could not be built.
    #[error("leader: {0}")]
    Leader(#[from] ConnectorError),
    /// The metrics endpoint could not be served.
    #[error("{0}")]
    Metrics(std::io::Error),
}

/// How a rank's host tier is allocated (pinning depends on the engine's device).
#[derive(Clone, Copy, Debug)]
pub struct HostMemory {
    /// Whether to pin the host tier with CUDA.
    pub pin: PinMode,
    /// CUDA device whose primary context registers the memory.
    pub cuda_device: i32,
    /// Threads for the first touch (0 = available parallelism).
    pub touch_threads: usize,
}

impl Default for HostMemory {
    fn default() -> Self {
        HostMemory {
            pin: PinMode::Auto,
            cuda_device: 0,
            touch_threads: 0,
        }
    }
}

/// One rank's transfer engine.
pub struct RankTiers {
    /// The engine moving this rank's blocks between its tiers.
    pub engine: TransferEngine,
}

/// The resolved plan for one engine; see the module docs.
#[derive(Clone, Debug)]
pub struct Composition {
    config: KvtierConfig,
    identity: EngineIdentity,
    cluster: ClusterLayout,
    role: ServingRole,
    caps: TierCapacities,
    salt: HashSalt,
    namespace: String,
    /// This engine's KV cache group when it has several (`for_group`): its index.
    group: Option<usize>,
}

impl Composition {
    /// Check `config` against the engine's `cluster` layout and resolve every tier's capacity, the
    /// hash salt and the remote namespace from `identity`.
    pub fn new(
        config: &KvtierConfig,
        mut identity: EngineIdentity,
        cluster: ClusterLayout,
        role: ServingRole,
    ) -> Result<Self, ComposeError> {
        if let Some(b) = config
            .connector
            .block_size
            .filter(|b| *b != cluster.block_size as usize)
        {
            return Err(ConfigError::Invalid {
                setting: "connector.block_size (KVTIER_BLOCK_SIZE)".into(),
                reason: format!(
                    "{b} differs from the engine's {} tokens per block",
                    cluster.block_size
                ),
            }
            .into());
        }
        if let Some(m) = &config.hashing.model {
            identity.model = m.clone();
        }
        if identity.model.trim().is_empty() {
            tracing::warn!(
                "kvtier: the engine gave no model identity and hashing.model (KVTIER_MODEL) is \
                 unset: blocks of different models sharing a disk or remote tier are not kept apart"
            );
        }
        let total =
            usize::try_from(cluster.total_bytes_per_block()).map_err(|_| ConfigError::Invalid {
                setting: "bytes per block".into(),
                reason: "does not fit this machine".into(),
            })?;
        let on_disk = cluster
            .bytes_per_block
            .iter()
            .map(|&b| usize::try_from(b).map(crate::storage::disk::slot_bytes))
            .sum::<Result<usize, _>>()
            .map_err(|_| ConfigError::Invalid {
                setting: "bytes per block".into(),
                reason: "does not fit this machine".into(),
            })?;
        let caps = config.resolve_capacity_on_disk(total, on_disk)?;
        let salt = HashSalt::new(&identity.key(), None, config.hashing.salt.as_deref());
        let namespace = identity.namespace();
        Ok(Composition {
            config: config.clone(),
            identity,
            cluster,
            role,
            caps,
            salt,
            namespace,
            group: None,
        })
    }

    /// The name of rank `rank`'s disk file set (`rank<N>`, `rank<N>-g<G>` for a KV cache group).
    fn disk_set_name(&self, rank: usize) -> String {
        match self.group {
            Some(g) => format!("rank{rank}-g{g}"),
            None => format!("rank{rank}"),
        }
    }

    /// The plan of KV cache group `index` of `count` (vLLM's hybrid KV cache manager: one leader
    /// and one worker per rank for each group; `count` <= 1 changes nothing). The group's keys
    /// carry `descriptor` (its index and layer kind: a block is never served to another group),
    /// its remote namespace the index; it gets `1/count` of the host and disk capacity, and its
    /// own disk files (`rank<N>-g<index>`).
    pub fn for_group(mut self, index: usize, count: usize, descriptor: &str) -> Self {
        if count <= 1 {
            return self;
        }
        self.salt = self.salt.for_group(descriptor);
        self.namespace = format!("{}-g{index}", self.namespace);
        self.caps.host_blocks /= count;
        self.caps.disk_blocks /= count;
        self.group = Some(index);
        self
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &KvtierConfig {
        &self.config
    }

    /// The engine's identity (with `hashing.model` applied).
    pub fn identity(&self) -> &EngineIdentity {
        &self.identity
    }

    /// The engine's cluster layout.
    pub fn cluster(&self) -> &ClusterLayout {
        &self.cluster
    }

    /// Each tier's capacity in blocks.
    pub fn capacities(&self) -> TierCapacities {
        self.caps
    }

    /// The salt of every sequence hash this engine computes.
    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// The remote store's key space for this engine's model.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Host -> disk spilling: the frequency filter (`policy.disk_filter.*`) or every block;
    /// `Never` without both tiers (with no host tier the device's blocks go to disk directly).
    pub fn disk_policy(&self) -> DiskPolicy {
        if self.caps.disk_blocks == 0 {
            DiskPolicy::Never
        } else if self.config.policy.disk_filter.enabled {
            DiskPolicy::Filter(FilterParams::from(&self.config.policy.disk_filter))
        } else {
            DiskPolicy::WriteThrough
        }
    }

    /// Whether the leader writes blocks to the remote store.
    pub fn remote_put(&self) -> bool {
        self.caps.remote && !matches!(self.role, ServingRole::Decode | ServingRole::Consumer)
    }

    /// Whether the leader stores the engine's blocks at all (not on a `Consumer`).
    pub fn stores(&self) -> bool {
        self.role != ServingRole::Consumer
    }

    /// Opens the configured remote store under this engine's namespace (None without one).
    /// Connections are lazy: a server that is down makes operations fail, not this.
    pub fn remote_store(&self) -> Result<Option<Arc<dyn RemoteStore>>, ComposeError> {
        let Some(target) = &self.config.remote else {
            return Ok(None);
        };
        crate::storage::remote::open(target, &self.namespace)
            .map(Some)
            .map_err(|source| ComposeError::Remote {
                url: target.url.clone(),
                source,
            })
    }

    /// With `metrics.enabled`: a publisher registered with the process's Prometheus endpoint
    /// (started on `metrics.port` by the first leader of the process, joined by later ones).
    /// The leader's owner publishes its stats into it.
    pub fn metrics(&self) -> Result<Option<StatsPublisher>, ComposeError> {
        if !self.config.metrics.enabled {
            return Ok(None);
        }
        let p = StatsPublisher::new();
        metrics_http::register(self.config.metrics.port, &p).map_err(ComposeError::Metrics)?;
        Ok(Some(p))
    }

    /// The scheduler-side leader. `remote` is the store from [`Self::remote_store`] (the same
    /// one the ranks use when they share this process).
    pub fn leader(
        &self,
        remote: Option<Arc<dyn RemoteStore>>,
        async_loads: bool,
    ) -> Result<Leader, ComposeError> {
        let remote_put = self.remote_put() && remote.is_some();
        let mut leader = Leader::new(LeaderConfig {
            block_size: self.cluster.block_size as usize,
            salt: self.salt,
            layout: Some(self.cluster.clone()),
            host: Capacity::Blocks(self.caps.host_blocks),
            disk: Capacity::Blocks(self.caps.disk_blocks),
            disk_policy: self.disk_policy(),
            remote,
            remote_put,
            async_loads,
            priority: Priority::default(),
            stores: self.stores(),
        })?;
        leader.set_near_remote(
            self.config
                .remote
                .as_ref()
                .is_some_and(|t| matches!(t.backend, RemoteBackend::Node { .. })),
        );
        let d = &self.config.disk;
        if self.caps.disk_blocks > 0 && d.persist {
            // Warm restart: the blocks every rank's file set kept (each rank's store verifies
            // every block it loads; one that fails is a failed load, recomputed).
            let names: Vec<String> = (0..self.cluster.bytes_per_block.len())
                .map(|r| self.disk_set_name(r))
                .collect();
            let sets: Vec<(&str, usize)> = names
                .iter()
                .zip(&self.cluster.bytes_per_block)
                .map(|(n, b)| (n.as_str(), *b as usize))
                .collect();
            let kept = u32::try_from(self.caps.disk_blocks)
                .map(|n| crate::storage::disk::recoverable_blocks(&d.dir, n, 0, &sets))
                .unwrap_or_default();
            let adopted = leader.adopt_disk_blocks(&kept);
            if adopted > 0 {
                tracing::info!(blocks = adopted, dir = %d.dir.display(), "kvtier: disk tier warm restart");
            }
        }
        Ok(leader)
    }

    /// Rank `rank`'s transfer engine over the engine's registered memory (`device`), with the
    /// host and disk tiers sized like the leader's pools and `remote` as its remote store.
    pub fn transfer(
        &self,
        rank: u32,
        device: EngineMemory,
        host: HostMemory,
        remote: Option<Arc<dyn RemoteStore>>,
    ) -> Result<RankTiers, ComposeError> {
        let bpb = device.bytes_per_block();
        let n32 = |n: usize, setting: &str| {
            u32::try_from(n).map_err(|_| ConfigError::Invalid {
                setting: setting.into(),
                reason: format!("{n} blocks is too many"),
            })
        };
        // Device <-> disk/remote jobs go through the transfer engine's own bounce buffers.
        let mut b = TransferEngine::builder().device(device);
        if self.caps.host_blocks > 0 {
            let mut o = HostOptions::new(n32(self.caps.host_blocks, "host.gb")?, bpb);
            o.pin = host.pin;
            o.cuda_device = host.cuda_device;
            o.touch_threads = host.touch_threads;
            b = b.host(Arc::new(HostStorage::new(&o)?));
        }
        if self.caps.disk_blocks > 0 {
            let d = &self.config.disk;
            // One locked file set per rank under <disk.dir>/kvtier-g3/; a second live engine on
            // the directory gets its own (`rank0.1`, ...), a dead one's set is taken over.
            let mut o =
                DiskOptions::new(d.dir.clone(), n32(self.caps.disk_blocks, "disk.gb")?, bpb);
            o.name = self.disk_set_name(rank as usize);
            o.persist = d.persist;
            if !d.use_o_direct {
                o.direct = DirectMode::Off;
            }
            o.io = match d.io_backend {
                IoBackend::Auto => DiskIoMode::Auto,
                IoBackend::Uring => DiskIoMode::Uring,
                IoBackend::Pread => DiskIoMode::Sync,
            };
            b = b.disk(Arc::new(DiskStorage::create(&o)?));
        }
        if let Some(r) = remote {
            b = b.remote(r);
        }
        Ok(RankTiers { engine: b.build()? })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_kv_cache_group_gets_its_share_its_own_keys_and_namespace() {
        let env = [("KVTIER_HOST_NUM_BLOCKS".to_string(), "12".to_string())].into();
        let cfg = KvtierConfig::build(None, &env, None).unwrap();
        let cluster = ClusterLayout {
            block_size: 16,
            num_device_blocks: 64,
            bytes_per_block: vec![4096],
        };
        let plan = |g: Option<(usize, usize, &str)>| {
            let c = Composition::new(
                &cfg,
                EngineIdentity::new("m"),
                cluster.clone(),
                ServingRole::Aggregated,
            )
            .unwrap();
            match g {
                Some((i, n, d)) => c.for_group(i, n, d),
                None => c,
            }
        };
        let whole = plan(None);
        // One group of one: nothing changes (keys of engines without the hybrid manager stay).
        let one = plan(Some((0, 1, "0|FullAttentionSpec:None")));
        assert_eq!(one.salt(), whole.salt());
        assert_eq!(one.capacities().host_blocks, 12);
        let g0 = plan(Some((0, 3, "0|FullAttentionSpec:None")));
        let g1 = plan(Some((1, 3, "1|SlidingWindowSpec:64")));
        assert_eq!(g0.capacities().host_blocks, 4);
        assert_ne!(g0.salt(), whole.salt());
        assert_ne!(g0.salt(), g1.salt());
        assert_ne!(g0.namespace(), g1.namespace());
        assert!(crate::storage::remote::Namespace::new(g1.namespace()).is_ok());
    }

    #[test]
    fn namespace_is_valid_and_follows_the_identity() {
        let a = EngineIdentity::new("meta-llama/Llama-3.1-8B");
        let ns = a.namespace();
        assert!(ns.starts_with("Llama-3.1-8B-"), "{ns}");
        assert!(crate::storage::remote::Namespace::new(&ns).is_ok(), "{ns}");
        let mut b = a.clone();
        b.dtype = Some("fp8".into());
        assert_ne!(a.namespace(), b.namespace());
        assert_eq!(a.key(), "meta-llama/Llama-3.1-8B");
        for odd in ["", ".hidden", "x/", &"é".repeat(100)] {
            let ns = EngineIdentity::new(odd).namespace();
            assert!(
                crate::storage::remote::Namespace::new(&ns).is_ok(),
                "{odd:?} -> {ns}"
            );
        }
    }
}
