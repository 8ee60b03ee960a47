//! The contract between the connector's workers (which decide *what* moves) and the I/O crate
//! (which moves bytes): jobs of block pairs between two tiers, each completing with Ok or with
//! the exact blocks that failed.
//!
//! Invariants:
//! - a job never reports a block as copied unless every byte of it reached the destination;
//! - a failure names the pair (by index into `TransferJob::pairs`) and why; other pairs of the same
//!   job may still succeed;
//! - `fence` is called on the engine's thread when the job is issued and captures everything the
//!   engine has enqueued so far (CUDA: an event recorded on the engine's stream); `execute` runs
//!   later on a kvtier thread and must not touch engine memory before that fence has passed.
use serde::{Deserialize, Serialize};

use crate::hash::SequenceHash;
use crate::ids::{JobId, Tier};

/// One block copy: `src` in the job's source tier to `dst` in its destination tier.
/// Device-tier numbers are the engine's block ids; others are kvtier pool block ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockPair {
    /// The block read, in the job's source tier.
    pub src: u32,
    /// The block written, in the job's destination tier.
    pub dst: u32,
}

/// A batch of block copies between two tiers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferJob {
    /// The leader's id of the job; every rank reports it under this id.
    pub id: JobId,
    /// The tier every pair reads from.
    pub src: Tier,
    /// The tier every pair writes to.
    pub dst: Tier,
    /// The block copies, each of which succeeds or fails on its own.
    pub pairs: Vec<BlockPair>,
    /// One content key per pair where the job reads or writes a keyed tier: `keys[i]` is the
    /// sequence hash of `pairs[i]`'s block. On the disk tier the slot is bound to it (a read of
    /// a slot holding another key fails); in the remote store it is the block's address (the
    /// pair's remote-side block number is not used; each rank stores under its own key derived
    /// from it, `remote_key_for_rank`). Empty for jobs between the device and the host tier
    /// (and for unkeyed disk jobs in tests).
    pub keys: Vec<SequenceHash>,
}

impl TransferJob {
    /// The key of pair `i` ([`Self::keys`]), or why there is none.
    pub fn key(&self, i: usize) -> Result<SequenceHash, TransferError> {
        self.keys.get(i).copied().ok_or(TransferError::MissingKey {
            pair: i,
            keys: self.keys.len(),
        })
    }
}

/// Why one pair of a job failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockFailure {
    /// Index into `TransferJob::pairs`.
    pub pair_index: usize,
    /// What went wrong, for logs.
    pub reason: String,
}

/// The result of a job. `Failed` lists exactly the pairs that did not complete; all others did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferOutcome {
    /// Every pair completed.
    Ok,
    /// These pairs did not complete (each named once); all others did.
    Failed(Vec<BlockFailure>),
}

impl TransferOutcome {
    /// Every pair completed.
    pub fn is_ok(&self) -> bool {
        matches!(self, TransferOutcome::Ok)
    }
    /// Indices of the failed pairs (empty for `Ok`).
    pub fn failed_pairs(&self) -> Vec<usize> {
        match self {
            TransferOutcome::Ok => Vec::new(),
            TransferOutcome::Failed(f) => f.iter().map(|b| b.pair_index).collect(),
        }
    }
}

/// An ordering token captured on the engine's thread (e.g. a CUDA event). Opaque to the core.
pub struct Fence(pub Option<Box<dyn std::any::Any + Send>>);

impl Fence {
    /// No ordering: the engine is synchronous (or the job touches no engine memory).
    pub fn none() -> Self {
        Fence(None)
    }
}

/// Errors of the transfer layer that concern the whole engine rather than single blocks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// A pair of a job that reads or writes a keyed tier has no key (`TransferJob::keys`).
    #[error("pair {pair} has no key (the job carries {keys})")]
    MissingKey {
        /// The pair's index.
        pair: usize,
        /// How many keys the job carries.
        keys: usize,
    },
    /// A job names a tier this worker was not built with.
    #[error("tier {0:?} is not configured on this worker")]
    TierMissing(Tier),
    /// No copy path between these tiers.
    #[error("cannot copy from {src:?} to {dst:?}: unsupported direction")]
    Unsupported {
        /// The job's source tier.
        src: Tier,
        /// The job's destination tier.
        dst: Tier,
    },
    /// A CUDA driver call failed (the message names it).
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// A file or socket operation failed.
    #[error("I/O error on {what}: {source}")]
    Io {
        /// The object operated on (a path, a socket).
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Anything else, described.
    #[error("{0}")]
    Other(String),
    /// A remote store's error.
    #[error(transparent)]
    Remote(#[from] RemoteError),
}

/// Why a `RemoteStore` operation failed. A miss is `Missing`; every other variant means the value
/// or the store could not be trusted, and the caller recomputes instead of using any bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// A miss: the key is not stored.
    #[error("remote key {key:032x} is not present")]
    Missing {
        /// The key asked for.
        key: u128,
    },
    /// The value ended before a whole block.
    #[error("remote value of {key:032x} is truncated: {got} of {expected} bytes")]
    Short {
        /// The key asked for.
        key: u128,
        /// Bytes of one framed block.
        expected: usize,
        /// Bytes the store returned.
        got: usize,
    },
    /// The value's frame names another block size.
    #[error("remote value of {key:032x} holds {stored} bytes but a block is {expected}")]
    SizeMismatch {
        /// The key asked for.
        key: u128,
        /// This engine's block size.
        expected: usize,
        /// The block size the frame declares.
        stored: usize,
    },
    /// The frame's checksum or key binding does not verify.
    #[error("remote value of {key:032x} is corrupt: {reason}")]
    Corrupt {
        /// The key asked for.
        key: u128,
        /// What did not verify.
        reason: String,
    },
    /// The store did not answer (down, timed out, or its circuit breaker is open).
    #[error("remote store unavailable during {op}: {reason}")]
    Unavailable {
        /// The operation (`get`, `put`, `contains`).
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The store's URL or options are invalid.
    #[error("invalid remote store configuration: {0}")]
    Config(String),
}

/// Moves blocks between the tiers one worker (one GPU rank) owns.
pub trait BlockTransfer: Send + Sync {
    /// Bytes of one block on this rank (all layers, all planes), identical in every tier.
    fn bytes_per_block(&self) -> usize;
    /// Which tiers this worker can read and write.
    fn has_tier(&self, tier: Tier) -> bool;
    /// Capture the engine's progress on `engine_stream` (an opaque stream handle; `None` = the
    /// engine is synchronous). Called on the engine's thread; cheap.
    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError>;
    /// Run `job` to completion on the calling thread, after `fence` has passed.
    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome;
    /// Run a load whose bytes the engine's next work on `engine_stream` reads (a synchronous
    /// load), ordering that work after the copies on the device instead of on the CPU.
    ///
    /// An implementation that can (CUDA: the stream waits on the job's completion event) calls
    /// `enqueued` at most once, after it has made `engine_stream` wait for every copy of the job
    /// and only if no pair has failed by then: from that call on, whatever the engine enqueues
    /// on `engine_stream` sees the loaded bytes, so it may launch its forward pass at once. The
    /// only failure left after `enqueued` is a device error, which poisons the engine's context
    /// too. It still returns the job's final outcome, once the copies completed (the worker
    /// keeps the source blocks until then). The default runs `execute` and never calls
    /// `enqueued`: the engine then waits for completion on the CPU.
    fn execute_ordered(
        &self,
        job: &TransferJob,
        fence: &Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(),
    ) -> TransferOutcome {
        let _ = (engine_stream, enqueued);
        self.execute(job, fence)
    }
    /// [`Self::execute_ordered`], layer by layer: an implementation that can splits the copies
    /// by layer of the engine's layout and, instead of making `engine_stream` wait for the whole
    /// job, hands `enqueued` a [`LayerGate`] with which the engine's stream waits for one layer's
    /// copies right before that layer's attention reads them (vLLM's `wait_for_layer_load`),
    /// so the copy of layer `l + 1` runs beside the forward pass of layer `l`. `enqueued(None)`
    /// means what `execute_ordered`'s `enqueued` means: the stream already waits for every copy.
    /// The same rules as `execute_ordered` otherwise; the default is `execute_ordered`.
    fn execute_layered(
        &self,
        job: &TransferJob,
        fence: &Fence,
        engine_stream: u64,
        enqueued: &mut dyn FnMut(Option<std::sync::Arc<dyn LayerGate>>),
    ) -> TransferOutcome {
        self.execute_ordered(job, fence, engine_stream, &mut || enqueued(None))
    }
}

/// The per-layer completion of a layered load ([`BlockTransfer::execute_layered`]): makes an
/// engine stream wait for the copies of one layer. Layers are the engine layout's, in the order
/// the engine registered its KV tensors.
pub trait LayerGate: Send + Sync {
    /// Number of layers the gate covers.
    fn layers(&self) -> usize;
    /// Make `engine_stream` wait for every copy of `layer` (cheap: a device-side wait, the CPU
    /// does not block). A layer `>= layers()` is an error.
    fn wait_layer(&self, layer: usize, engine_stream: u64) -> Result<(), TransferError>;
}

/// A shared, content-addressed remote store (G4): Redis/Valkey, or a shared directory.
/// Keys are 128-bit sequence hashes; every value carries a checksum verified on `get`.
pub trait RemoteStore: Send + Sync {
    /// Store one block (`data`, exactly one block) under `key`, framed with its checksum.
    fn put(&self, key: u128, data: &[u8]) -> Result<(), TransferError>;
    /// Fill `out` (exactly one block) with the value of `key`; a missing, short or corrupt value is an error.
    fn get(&self, key: u128, out: &mut [u8]) -> Result<(), TransferError>;
    /// Which of `keys` are present (one round trip).
    fn contains(&self, keys: &[u128]) -> Result<Vec<bool>, TransferError>;
    /// The concrete store, for transfer engines that move some stores' bytes without a staging
    /// copy (kvtier-io's node tier: device <-> shared arena). `None` by default.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
    /// The store's circuit breaker and deadline counters (zero for a store without them).
    fn health(&self) -> RemoteHealth {
        RemoteHealth::default()
    }
}

/// What a remote store's circuit breaker and deadlines did, since the store was opened
/// (exported as `kvtier_remote_*` by [`crate::metrics::METRICS`]). Counters only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteHealth {
    /// The breaker is not closed now (open, or one probe in flight).
    pub breaker_open: bool,
    /// Times the breaker went from closed to open.
    pub breaker_opened: u64,
    /// Probes sent after a breaker window ended.
    pub breaker_probes: u64,
    /// Operations refused at once because the breaker was open or probing.
    pub short_circuited: u64,
    /// Operations that ran past their deadline (connect, read or write timeout).
    pub deadline_expired: u64,
}
