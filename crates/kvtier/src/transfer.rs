//! The contract between the connector's workers (which decide *what* moves) and the I/O crate
//! (which moves bytes): jobs of block pairs between two media, each completing with Ok or with
//! the exact blocks that failed.
//!
//! Each side of a job is a typed list of one medium's blocks ([`Blocks`], vLLM's
//! `LoadStoreSpec` idea): engine block ids, host pool blocks, disk slots each bound to the key it
//! holds ([`DiskBlock`]), remote keys. Pair `i` is element `i` of both sides.
//!
//! Invariants:
//! - both sides of a job have the same length ([`TransferJob::new`] refuses others with
//!   [`JobError::UnequalSides`], decoding a job from the wire too), so every pair names a block
//!   of each side, a disk block always carries its key and a remote block is only a key;
//! - a job never reports a block as copied unless every byte of it reached the destination;
//! - a failure names the pair (by index into both sides) and why; other pairs of the same job
//!   may still succeed;
//! - `fence` is called on the engine's thread when the job is issued and captures everything the
//!   engine has enqueued so far (CUDA: an event recorded on the engine's stream); `execute` runs
//!   later on a kvtier thread and must not touch engine memory before that fence has passed.
use serde::{Deserialize, Serialize};

use crate::hash::SequenceHash;
use crate::ids::{BlockId, DeviceBlockId, JobId, Tier};

/// A disk tier (G3) block: the slot and the key (sequence hash) it is bound to. A write stores
/// the key with the block; a read of a slot holding another key fails. `SequenceHash(0)` is the
/// unkeyed slot of tests and tools (the connector's jobs always name the block's hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DiskBlock {
    /// The slot in this rank's disk tier.
    pub slot: BlockId,
    /// The sequence hash the slot is bound to.
    pub key: SequenceHash,
}

/// One block of one side of a pair ([`Blocks::get`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Block {
    /// An engine (G1) block.
    Device(DeviceBlockId),
    /// A host pool (G2) block.
    Host(BlockId),
    /// A disk (G3) slot and its key.
    Disk(DiskBlock),
    /// A remote (G4) block: its sequence hash (each rank stores its share under its own key
    /// derived from it, `remote_key_for_rank`).
    Remote(SequenceHash),
}

impl Block {
    /// The block's tier.
    pub fn tier(&self) -> Tier {
        match self {
            Block::Device(_) => Tier::Device,
            Block::Host(_) => Tier::Host,
            Block::Disk(_) => Tier::Disk,
            Block::Remote(_) => Tier::Remote,
        }
    }

    /// The block's number in its tier (device block id, host block id, disk slot); `None` for a
    /// remote block, which is addressed by its key only.
    pub fn number(&self) -> Option<u32> {
        match self {
            Block::Device(d) => Some(d.0),
            Block::Host(b) => Some(b.0),
            Block::Disk(d) => Some(d.slot.0),
            Block::Remote(_) => None,
        }
    }
}

/// One side of a job: the blocks of one medium, in pair order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Blocks {
    /// Engine (G1) blocks, as the engine numbers them.
    Device(Vec<DeviceBlockId>),
    /// Host pool (G2) blocks.
    Host(Vec<BlockId>),
    /// Disk (G3) slots, each bound to its key.
    Disk(Vec<DiskBlock>),
    /// Remote (G4) blocks by sequence hash.
    Remote(Vec<SequenceHash>),
}

impl Blocks {
    /// The medium's tier.
    pub fn tier(&self) -> Tier {
        match self {
            Blocks::Device(_) => Tier::Device,
            Blocks::Host(_) => Tier::Host,
            Blocks::Disk(_) => Tier::Disk,
            Blocks::Remote(_) => Tier::Remote,
        }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        match self {
            Blocks::Device(v) => v.len(),
            Blocks::Host(v) => v.len(),
            Blocks::Disk(v) => v.len(),
            Blocks::Remote(v) => v.len(),
        }
    }

    /// Whether there is no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<Block> {
        match self {
            Blocks::Device(v) => v.get(i).copied().map(Block::Device),
            Blocks::Host(v) => v.get(i).copied().map(Block::Host),
            Blocks::Disk(v) => v.get(i).copied().map(Block::Disk),
            Blocks::Remote(v) => v.get(i).copied().map(Block::Remote),
        }
    }

    /// The blocks in order.
    pub fn iter(&self) -> impl Iterator<Item = Block> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }

    /// The blocks at `indices`, in that order (indices out of range are skipped).
    fn select(&self, indices: &[usize]) -> Blocks {
        fn pick<T: Copy>(v: &[T], indices: &[usize]) -> Vec<T> {
            indices.iter().filter_map(|&i| v.get(i).copied()).collect()
        }
        match self {
            Blocks::Device(v) => Blocks::Device(pick(v, indices)),
            Blocks::Host(v) => Blocks::Host(pick(v, indices)),
            Blocks::Disk(v) => Blocks::Disk(pick(v, indices)),
            Blocks::Remote(v) => Blocks::Remote(pick(v, indices)),
        }
    }
}

/// A medium whose blocks form one side of a job ([`TransferJob::from_pairs`]).
pub trait Medium: Copy {
    /// A side of these blocks.
    fn side(blocks: Vec<Self>) -> Blocks;
}

impl Medium for DeviceBlockId {
    fn side(blocks: Vec<Self>) -> Blocks {
        Blocks::Device(blocks)
    }
}

/// A host pool block (the only pool whose blocks are named by their id alone).
impl Medium for BlockId {
    fn side(blocks: Vec<Self>) -> Blocks {
        Blocks::Host(blocks)
    }
}

impl Medium for DiskBlock {
    fn side(blocks: Vec<Self>) -> Blocks {
        Blocks::Disk(blocks)
    }
}

/// A remote block, by sequence hash.
impl Medium for SequenceHash {
    fn side(blocks: Vec<Self>) -> Blocks {
        Blocks::Remote(blocks)
    }
}

/// Why a job could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// The two sides do not have one block per pair each.
    #[error("a job's sides differ in length: {src} source blocks, {dst} destination blocks")]
    UnequalSides {
        /// Blocks of the source side.
        src: usize,
        /// Blocks of the destination side.
        dst: usize,
    },
}

/// A batch of block copies from one medium to another: pair `i` copies `src` block `i` to `dst`
/// block `i`. Built by [`TransferJob::new`] or [`TransferJob::from_pairs`]; decoded jobs are
/// checked the same way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "JobParts")]
pub struct TransferJob {
    /// The leader's id of the job; every rank reports it under this id.
    pub id: JobId,
    src: Blocks,
    dst: Blocks,
}

/// A decoded job before its check.
#[derive(Deserialize)]
struct JobParts {
    id: JobId,
    src: Blocks,
    dst: Blocks,
}

impl TryFrom<JobParts> for TransferJob {
    type Error = JobError;
    fn try_from(p: JobParts) -> Result<Self, JobError> {
        TransferJob::new(p.id, p.src, p.dst)
    }
}

impl TransferJob {
    /// A job copying `src[i]` to `dst[i]` for every `i`; refused unless both sides have the
    /// same length. (Whether a direction is supported is the transfer engine's to say: it fails
    /// every pair of one it cannot copy.)
    pub fn new(id: JobId, src: Blocks, dst: Blocks) -> Result<Self, JobError> {
        if src.len() != dst.len() {
            return Err(JobError::UnequalSides {
                src: src.len(),
                dst: dst.len(),
            });
        }
        Ok(TransferJob { id, src, dst })
    }

    /// A job of the given pairs (infallible: the sides have one block per pair by construction).
    pub fn from_pairs<S: Medium, D: Medium>(
        id: JobId,
        pairs: impl IntoIterator<Item = (S, D)>,
    ) -> Self {
        let (src, dst): (Vec<S>, Vec<D>) = pairs.into_iter().unzip();
        TransferJob {
            id,
            src: S::side(src),
            dst: D::side(dst),
        }
    }

    /// The blocks read, in pair order.
    pub fn src(&self) -> &Blocks {
        &self.src
    }

    /// The blocks written, in pair order.
    pub fn dst(&self) -> &Blocks {
        &self.dst
    }

    /// The tier every pair reads from.
    pub fn src_tier(&self) -> Tier {
        self.src.tier()
    }

    /// The tier every pair writes to.
    pub fn dst_tier(&self) -> Tier {
        self.dst.tier()
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.src.len()
    }

    /// Whether the job has no pair.
    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }

    /// Pair `i`: (source block, destination block).
    pub fn pair(&self, i: usize) -> Option<(Block, Block)> {
        Some((self.src.get(i)?, self.dst.get(i)?))
    }

    /// The pairs in order.
    pub fn pairs(&self) -> impl Iterator<Item = (Block, Block)> + '_ {
        (0..self.len()).filter_map(|i| self.pair(i))
    }

    /// The same job (same id, same media) with only the pairs at `indices`, in that order: pair
    /// `k` of the result is pair `indices[k]` of `self` (indices out of range are skipped).
    pub fn subset(&self, indices: &[usize]) -> TransferJob {
        let indices: Vec<usize> = indices
            .iter()
            .copied()
            .filter(|&i| i < self.len())
            .collect();
        TransferJob {
            id: self.id,
            src: self.src.select(&indices),
            dst: self.dst.select(&indices),
        }
    }

    /// Rewrite every remote key of the job (either side) with `f` (a rank's own key of a
    /// block); other media are left as they are.
    pub fn map_remote_keys(&mut self, mut f: impl FnMut(SequenceHash) -> SequenceHash) {
        for side in [&mut self.src, &mut self.dst] {
            if let Blocks::Remote(keys) = side {
                for k in keys.iter_mut() {
                    *k = f(*k);
                }
            }
        }
    }
}

/// Why one pair of a job failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockFailure {
    /// The pair's index (into both sides of the job).
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
        key: SequenceHash,
    },
    /// The value ended before a whole block.
    #[error("remote value of {key:032x} is truncated: {got} of {expected} bytes")]
    Short {
        /// The key asked for.
        key: SequenceHash,
        /// Bytes of one framed block.
        expected: usize,
        /// Bytes the store returned.
        got: usize,
    },
    /// The value's frame names another block size.
    #[error("remote value of {key:032x} holds {stored} bytes but a block is {expected}")]
    SizeMismatch {
        /// The key asked for.
        key: SequenceHash,
        /// This engine's block size.
        expected: usize,
        /// The block size the frame declares.
        stored: usize,
    },
    /// The frame's checksum or key binding does not verify.
    #[error("remote value of {key:032x} is corrupt: {reason}")]
    Corrupt {
        /// The key asked for.
        key: SequenceHash,
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
    /// so the copy of layer `l + 1` runs beside the forward pass of layer `l`. The gate may come
    /// before the job enqueued its copies (a long load's enqueue blocks on the driver's launch
    /// queue), so the engine waits on it from its own thread, never inside `enqueued`
    /// (which runs on the job's thread). `enqueued(None)`
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
    /// Make `engine_stream` wait for every copy of `layer`: a device-side wait, once the
    /// implementation has enqueued that layer's copies (the gate may come before they are: the
    /// CPU then blocks until they are, never past that). A layer `>= layers()`, or one whose
    /// copies were never enqueued (the load failed), is an error.
    fn wait_layer(&self, layer: usize, engine_stream: u64) -> Result<(), TransferError>;
}

/// A shared, content-addressed remote store (G4): Redis/Valkey, or a shared directory.
/// Keys are sequence hashes (a rank's own key of a block, `remote_key_for_rank`); every value
/// carries a checksum verified on `get`.
pub trait RemoteStore: Send + Sync {
    /// Store one block (`data`, exactly one block) under `key`, framed with its checksum.
    fn put(&self, key: SequenceHash, data: &[u8]) -> Result<(), TransferError>;
    /// Fill `out` (exactly one block) with the value of `key`; a missing, short or corrupt value is an error.
    fn get(&self, key: SequenceHash, out: &mut [u8]) -> Result<(), TransferError>;
    /// Which of `keys` are present (one round trip).
    fn contains(&self, keys: &[SequenceHash]) -> Result<Vec<bool>, TransferError>;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn host(n: &[u32]) -> Blocks {
        Blocks::Host(n.iter().copied().map(BlockId).collect())
    }

    fn device(n: &[u32]) -> Blocks {
        Blocks::Device(n.iter().copied().map(DeviceBlockId).collect())
    }

    /// A job whose sides differ in length is refused with the typed error, built here or decoded
    /// from the wire (a peer's job is checked like one built here).
    #[test]
    fn jobs_with_unequal_sides_are_refused() {
        let e = TransferJob::new(JobId(1), device(&[1, 2]), host(&[3])).unwrap_err();
        assert_eq!(e, JobError::UnequalSides { src: 2, dst: 1 });
        let e = TransferJob::new(JobId(1), device(&[]), Blocks::Remote(vec![SequenceHash(9)]));
        assert_eq!(e.unwrap_err(), JobError::UnequalSides { src: 0, dst: 1 });
        #[derive(Serialize)]
        struct Raw {
            id: JobId,
            src: Blocks,
            dst: Blocks,
        }
        let raw = |src, dst| {
            postcard::to_stdvec(&Raw {
                id: JobId(4),
                src,
                dst,
            })
            .unwrap()
        };
        let bad = raw(device(&[1, 2]), host(&[3]));
        assert!(postcard::from_bytes::<TransferJob>(&bad).is_err());
        // Formats that carry messages carry the typed error's.
        let json = serde_json::json!({"id": 4, "src": {"Device": [1, 2]}, "dst": {"Host": [3]}});
        let e = serde_json::from_value::<TransferJob>(json).unwrap_err();
        assert!(e.to_string().contains("differ in length"), "{e}");
        let good = postcard::from_bytes::<TransferJob>(&raw(device(&[1]), host(&[3]))).unwrap();
        assert_eq!(
            good,
            TransferJob::new(JobId(4), device(&[1]), host(&[3])).unwrap()
        );
    }

    /// Pair `i` is element `i` of both sides; a disk block carries its key, a remote block is only
    /// a key.
    #[test]
    fn pairs_are_typed_by_medium() {
        let disk = |slot, key| DiskBlock {
            slot: BlockId(slot),
            key: SequenceHash(key),
        };
        let j = TransferJob::from_pairs(JobId(2), [(disk(5, 50), DeviceBlockId(20))]);
        assert_eq!(
            (j.src_tier(), j.dst_tier(), j.len()),
            (Tier::Disk, Tier::Device, 1)
        );
        assert_eq!(
            j.pair(0),
            Some((Block::Disk(disk(5, 50)), Block::Device(DeviceBlockId(20))))
        );
        assert_eq!(j.pair(1), None);
        let put = TransferJob::from_pairs(JobId(3), [(BlockId(1), SequenceHash(7))]);
        let (src, dst) = put.pair(0).unwrap();
        assert_eq!((src.number(), dst.number()), (Some(1), None));
        assert_eq!(dst.tier(), Tier::Remote);
    }

    /// `subset` keeps each pair's two blocks together (a disk slot with its key, a device block
    /// with its remote key) and the job's id and media.
    #[test]
    fn subsets_keep_pairs_together() {
        let keys: Vec<SequenceHash> = (10..14).map(SequenceHash).collect();
        let j = TransferJob::new(JobId(5), device(&[0, 1, 2, 3]), Blocks::Remote(keys)).unwrap();
        let s = j.subset(&[3, 1, 9]);
        assert_eq!(s.id, JobId(5));
        assert_eq!(s.src(), &device(&[3, 1]));
        assert_eq!(
            s.dst(),
            &Blocks::Remote(vec![SequenceHash(13), SequenceHash(11)])
        );
    }

    /// A remote error names its key as the 32 hex digits of the store's names.
    #[test]
    fn remote_errors_name_their_key_in_hex() {
        let e = RemoteError::Missing {
            key: SequenceHash(0xab),
        };
        assert_eq!(
            e.to_string(),
            "remote key 000000000000000000000000000000ab is not present"
        );
    }

    /// Only remote keys are rewritten per rank: disk keys stay sequence hashes.
    #[test]
    fn map_remote_keys_touches_remote_sides_only() {
        let disk = DiskBlock {
            slot: BlockId(1),
            key: SequenceHash(2),
        };
        let mut j = TransferJob::from_pairs(JobId(6), [(disk, BlockId(3))]);
        j.map_remote_keys(|k| SequenceHash(k.0 + 100));
        assert_eq!(j.src(), &Blocks::Disk(vec![disk]));
        let mut j = TransferJob::from_pairs(JobId(7), [(SequenceHash(4), DeviceBlockId(5))]);
        j.map_remote_keys(|k| SequenceHash(k.0 + 100));
        assert_eq!(j.src(), &Blocks::Remote(vec![SequenceHash(104)]));
        assert_eq!(j.dst(), &device(&[5]));
    }
}
