//! How a leader is set up: pool sizes, the disk policy, the remote tier, and a request's key.
//!
//! Invariant: every value here is plain data, checked once by `Leader::new`; nothing here
//! changes after the leader is built.
use std::sync::Arc;

use crate::connector::messages::ClusterLayout;
use crate::connector::ConnectorError;
use crate::hash::HashSalt;
use crate::policy::FilterParams;
use crate::pool::Priority;
use crate::transfer::RemoteStore;

/// A pool size: in blocks, or in bytes (then divided by the sum of the ranks' bytes per block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// A number of blocks.
    Blocks(usize),
    /// Bytes across all ranks.
    Bytes(u64),
}

impl Capacity {
    /// The size in blocks, given the ranks' layout (needed for a size in bytes).
    pub(super) fn blocks(
        self,
        layout: Option<&ClusterLayout>,
        what: &str,
    ) -> Result<usize, ConnectorError> {
        match self {
            Capacity::Blocks(n) => Ok(n),
            Capacity::Bytes(0) => Ok(0),
            Capacity::Bytes(b) => match layout {
                Some(l) if l.total_bytes_per_block() > 0 => {
                    Ok((b / l.total_bytes_per_block()) as usize)
                }
                _ => Err(ConnectorError::Config(format!(
                    "{what} capacity given in bytes needs the ranks' layout (bytes per block)"
                ))),
            },
        }
    }
}

/// When a block confirmed in G2 is also written to G3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskPolicy {
    /// Never spill to disk (disk still serves blocks stored there directly when there is no host pool).
    Never,
    /// Every block confirmed in G2 is copied to G3.
    WriteThrough,
    /// A block goes to G3 once the policy's frequency filter has seen it twice within its window
    /// (stored or found again in G2), sparing the SSD one-off blocks.
    Filter(FilterParams),
}

impl DiskPolicy {
    /// The original's default: seen twice within 600 s, at most 1M tracked hashes.
    pub fn filtered() -> Self {
        DiskPolicy::Filter(FilterParams {
            window: std::time::Duration::from_secs(600),
            max_tracked: 1_000_000,
        })
    }
}

/// How the leader is set up.
#[derive(Clone)]
pub struct LeaderConfig {
    /// Tokens per block (equal to the engine's).
    pub block_size: usize,
    /// Separates key spaces (model, LoRA, tenant).
    pub salt: HashSalt,
    /// The ranks' agreed layout (from the handshake, or built in-process); `None` = one rank of
    /// unknown size (capacities must then be given in blocks).
    pub layout: Option<ClusterLayout>,
    /// G2 (host) pool size; 0 = no host tier.
    pub host: Capacity,
    /// G3 (disk) pool size; 0 = no disk tier.
    pub disk: Capacity,
    /// Which device blocks go to disk, and when.
    pub disk_policy: DiskPolicy,
    /// Optional G4 store: consulted by matching; written (host -> remote) when `remote_put`.
    pub remote: Option<Arc<dyn RemoteStore>>,
    /// Put stored blocks to `remote` (false for a decode-only engine: it only reads).
    pub remote_put: bool,
    /// Load matched blocks asynchronously (reported via `get_finished`) instead of before the
    /// step's forward pass.
    pub async_loads: bool,
    /// Retention priority of stored blocks.
    pub priority: Priority,
    /// Store the engine's full blocks at all (false for vLLM's `kv_consumer`: it only loads).
    pub stores: bool,
}

impl std::fmt::Debug for LeaderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderConfig")
            .field("block_size", &self.block_size)
            .field("salt", &self.salt)
            .field("layout", &self.layout)
            .field("host", &self.host)
            .field("disk", &self.disk)
            .field("disk_policy", &self.disk_policy)
            .field("remote", &self.remote.is_some())
            .field("remote_put", &self.remote_put)
            .field("async_loads", &self.async_loads)
            .field("priority", &self.priority)
            .field("stores", &self.stores)
            .finish()
    }
}

impl LeaderConfig {
    /// A host-only configuration of `host_blocks` blocks.
    pub fn new(block_size: usize, salt: HashSalt, host_blocks: usize) -> Self {
        LeaderConfig {
            block_size,
            salt,
            layout: None,
            host: Capacity::Blocks(host_blocks),
            disk: Capacity::Blocks(0),
            disk_policy: DiskPolicy::filtered(),
            remote: None,
            remote_put: false,
            async_loads: false,
            priority: Priority::default(),
            stores: true,
        }
    }
}

/// What, besides its token ids, decides which blocks a request may share (see
/// `Leader::get_num_new_matched_tokens_for`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestKey {
    /// The request's own identity (LoRA adapter, tenant cache salt, multimodal inputs, prompt
    /// embeddings), in one canonical string built by the adapter; `None` = the engine salt alone.
    pub identity: Option<String>,
    /// `false`: kvtier cannot key this request's KV correctly; it is never matched nor stored.
    pub cacheable: bool,
    /// `false`: the request must compute its whole prompt (vLLM's `skip_reading_prefix_cache`:
    /// prompt logprobs, pooling, or the user's wish): it is matched 0 tokens, and its blocks are
    /// still stored for others.
    pub read: bool,
}

impl Default for RequestKey {
    fn default() -> Self {
        RequestKey {
            identity: None,
            cacheable: true,
            read: true,
        }
    }
}
