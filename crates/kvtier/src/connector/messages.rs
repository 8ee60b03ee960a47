//! The typed, versioned messages between the leader and its workers: the per-step metadata
//! (leader -> every worker, carried by the engine or by the channel) and the workers' reports
//! (worker -> leader, over the channel).
//!
//! Invariants: every message carries [`PROTOCOL_VERSION`]; decoding a message of another version
//! fails with [`ConnectorError::Handshake`] instead of misreading it. Block ids in a message are
//! identical on every rank; only the bytes behind them differ per rank.
use serde::{Deserialize, Serialize};

use crate::connector::ConnectorError;
use crate::hash::SequenceHash;
use crate::ids::{DeviceBlockId, JobId, RequestId};
use crate::transfer::{TransferJob, TransferOutcome};

/// Version of the leader <-> worker messages. Bumped on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 3;

/// The loads of one request in one step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestLoad {
    /// The request the loads fill.
    pub request: RequestId,
    /// Sync loads complete before the forward pass reads layer 0 (`wait_for_layer_load`);
    /// async ones are reported through `get_finished`.
    pub sync: bool,
    /// One job per source tier, destination `Tier::Device`.
    pub jobs: Vec<TransferJob>,
    /// Device blocks the leader promised but can no longer supply (their source vanished between
    /// matching and allocation). Every worker reports them as load errors.
    pub failed_devices: Vec<DeviceBlockId>,
}

/// The stores of one request in one step (source `Tier::Device`), gated on the end of the
/// step's forward pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestStore {
    /// The request the store reads.
    pub request: RequestId,
    /// Its blocks, device -> the offload tier.
    pub job: TransferJob,
}

/// Everything every worker must do in one step. Built by `Leader::build_step`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMetadata {
    /// [`PROTOCOL_VERSION`] of the leader that built it.
    pub version: u32,
    /// The leader's step counter (starts at 1).
    pub step: u64,
    /// Loads to start this step.
    pub loads: Vec<RequestLoad>,
    /// Stores to start once the forward pass ends.
    pub stores: Vec<RequestStore>,
    /// Copies between kvtier's own tiers (host -> disk, host -> remote); they touch no engine
    /// memory and may run at once.
    pub background: Vec<TransferJob>,
    /// Requests for which `request_finished` answered "saves in flight" since the previous
    /// metadata: only these are ever reported saved by the workers.
    pub saving: Vec<RequestId>,
    /// Finished requests whose device blocks this step hands to another request while their
    /// stores may still read them (`Leader::request_finished_fenced`): a worker waits for their
    /// jobs before anything of this step runs, and the engine must not write those blocks
    /// before (vLLM: `handle_preemptions`).
    pub fence: Vec<RequestId>,
}

impl StepMetadata {
    /// Nothing to do this step.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty()
            && self.stores.is_empty()
            && self.background.is_empty()
            && self.saving.is_empty()
            && self.fence.is_empty()
    }

    /// Encode (postcard).
    pub fn to_bytes(&self) -> Result<Vec<u8>, ConnectorError> {
        postcard::to_stdvec(self).map_err(|e| ConnectorError::Codec(format!("step metadata: {e}")))
    }

    /// Decode and check the version.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ConnectorError> {
        check_version(bytes, "step metadata has")?;
        postcard::from_bytes(bytes)
            .map_err(|e| ConnectorError::Codec(format!("step metadata: {e}")))
    }
}

/// The one answer every rank gets about one asynchronous load (TensorRT-LLM with TP > 1,
/// [`crate::connector::Leader::set_load_verdicts`]): issued by the leader once every rank
/// reported every job of the load, so it is the same on every rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadVerdict {
    /// The request the load filled.
    pub request: RequestId,
    /// `None`: every rank loaded every block. `Some(t)`: some rank failed a block (or its source
    /// vanished) whose first token is `t`; every rank recomputes from token `t` on.
    pub recompute_from: Option<u64>,
}

/// A batch of [`LoadVerdict`]s as it crosses from the leader's process to every rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadVerdicts {
    /// [`PROTOCOL_VERSION`] of the leader that issued them.
    pub version: u32,
    /// The verdicts, in the order the leader issued them.
    pub verdicts: Vec<LoadVerdict>,
}

impl LoadVerdicts {
    /// Encode (postcard).
    pub fn to_bytes(&self) -> Result<Vec<u8>, ConnectorError> {
        postcard::to_stdvec(self).map_err(|e| ConnectorError::Codec(format!("load verdicts: {e}")))
    }

    /// Decode and check the version.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ConnectorError> {
        check_version(bytes, "load verdicts have")?;
        postcard::from_bytes(bytes)
            .map_err(|e| ConnectorError::Codec(format!("load verdicts: {e}")))
    }
}

/// A worker's report of one finished job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The rank that ran the job.
    pub rank: u32,
    /// The job.
    pub job: JobId,
    /// How it went, pair by pair.
    pub outcome: TransferOutcome,
}

/// What one rank tells the leader when it connects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLayout {
    /// This rank's index (0-based).
    pub rank: u32,
    /// Ranks of the engine.
    pub world_size: u32,
    /// Tokens per block (must be equal on every rank and in the leader's configuration).
    pub block_size: u32,
    /// Bytes of one block on this rank (all layers, all planes).
    pub bytes_per_block: u64,
    /// Number of device (G1) blocks the engine allocated on this rank (equal on every rank).
    pub num_device_blocks: u32,
}

/// The layout every rank agreed on, from which the leader sizes its pools.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterLayout {
    /// Tokens per block.
    pub block_size: u32,
    /// Device (G1) blocks on every rank.
    pub num_device_blocks: u32,
    /// Per rank, in rank order.
    pub bytes_per_block: Vec<u64>,
}

impl ClusterLayout {
    /// Agree on a layout from the ranks' reports, or explain the disagreement.
    pub fn agree(ranks: &[RankLayout], expected_block_size: u32) -> Result<Self, ConnectorError> {
        let Some(first) = ranks.first() else {
            return Err(ConnectorError::Handshake(
                "no rank reported a layout".into(),
            ));
        };
        let world = first.world_size as usize;
        if ranks.len() != world {
            return Err(ConnectorError::Handshake(format!(
                "{} ranks reported but world size is {world}",
                ranks.len()
            )));
        }
        let mut sorted: Vec<&RankLayout> = ranks.iter().collect();
        sorted.sort_by_key(|r| r.rank);
        for (i, r) in sorted.iter().enumerate() {
            if r.rank as usize != i {
                return Err(ConnectorError::Handshake(format!(
                    "ranks must be 0..{world} exactly once; got rank {} at position {i}",
                    r.rank
                )));
            }
            if r.world_size != first.world_size {
                return Err(ConnectorError::Handshake(format!(
                    "rank {} says world size {}, rank {} says {}",
                    r.rank, r.world_size, first.rank, first.world_size
                )));
            }
            if r.block_size != expected_block_size {
                return Err(ConnectorError::Handshake(format!(
                    "layout mismatch: rank {} has {} tokens per block, the leader expects {expected_block_size}",
                    r.rank, r.block_size
                )));
            }
            if r.num_device_blocks != first.num_device_blocks {
                return Err(ConnectorError::Handshake(format!(
                    "layout mismatch: rank {} has {} device blocks, rank {} has {}",
                    r.rank, r.num_device_blocks, first.rank, first.num_device_blocks
                )));
            }
            if r.bytes_per_block == 0 {
                return Err(ConnectorError::Handshake(format!(
                    "layout mismatch: rank {} reports 0 bytes per block",
                    r.rank
                )));
            }
        }
        Ok(ClusterLayout {
            block_size: expected_block_size,
            num_device_blocks: first.num_device_blocks,
            bytes_per_block: sorted.iter().map(|r| r.bytes_per_block).collect(),
        })
    }

    /// Ranks of the engine.
    pub fn world_size(&self) -> usize {
        self.bytes_per_block.len()
    }

    /// Bytes of one block summed over all ranks (what one pool block id costs in total).
    pub fn total_bytes_per_block(&self) -> u64 {
        self.bytes_per_block.iter().sum()
    }
}

/// Check the version a message starts with (its first field) before decoding the rest, whose
/// shape may differ between versions: another version is a [`ConnectorError::Handshake`].
fn check_version(bytes: &[u8], what: &str) -> Result<(), ConnectorError> {
    let (version, _) = postcard::take_from_bytes::<u32>(bytes)
        .map_err(|e| ConnectorError::Codec(format!("message version: {e}")))?;
    if version != PROTOCOL_VERSION {
        return Err(ConnectorError::Handshake(format!(
            "{what} protocol version {version}, this build speaks {PROTOCOL_VERSION}"
        )));
    }
    Ok(())
}

/// The remote (G4) key of one rank's share of a block: the sequence hash itself for a single
/// rank, otherwise a hash of (sequence hash, rank, world size), so ranks never overwrite each
/// other and a fleet with another tensor-parallel size never reads a foreign layout.
pub fn remote_key_for_rank(hash: SequenceHash, rank: u32, world_size: u32) -> SequenceHash {
    if world_size <= 1 {
        return hash;
    }
    let mut buf = [0u8; 24];
    buf[..16].copy_from_slice(&hash.0.to_le_bytes());
    buf[16..20].copy_from_slice(&rank.to_le_bytes());
    buf[20..].copy_from_slice(&world_size.to_le_bytes());
    SequenceHash(xxhash_rust::xxh3::xxh3_128_with_seed(
        &buf,
        0x6b76_7469_6572,
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_rejects_other_versions() {
        let m = StepMetadata {
            version: PROTOCOL_VERSION,
            step: 3,
            ..Default::default()
        };
        let b = m.to_bytes().unwrap();
        assert_eq!(StepMetadata::from_bytes(&b).unwrap(), m);
        let old = StepMetadata { version: 0, ..m };
        let e = StepMetadata::from_bytes(&old.to_bytes().unwrap()).unwrap_err();
        assert!(matches!(e, ConnectorError::Handshake(_)));
    }

    /// A message of another version whose body no longer decodes (version 2's jobs of untyped
    /// pairs) is a version mismatch, not a codec error: the version is checked first.
    #[test]
    fn other_versions_are_refused_before_their_body_is_decoded() {
        let mut b = postcard::to_stdvec(&(PROTOCOL_VERSION - 1)).unwrap();
        b.extend_from_slice(&[0xFF; 9]);
        let e = StepMetadata::from_bytes(&b).unwrap_err();
        assert!(matches!(e, ConnectorError::Handshake(_)), "{e}");
        let e = LoadVerdicts::from_bytes(&b).unwrap_err();
        assert!(matches!(e, ConnectorError::Handshake(_)), "{e}");
    }

    /// Every medium of a job crosses the wire as itself.
    #[test]
    fn jobs_of_every_medium_round_trip() {
        use crate::ids::{BlockId, DeviceBlockId, JobId};
        use crate::transfer::DiskBlock;
        let h = |k| SequenceHash(k);
        let m = StepMetadata {
            version: PROTOCOL_VERSION,
            step: 1,
            background: vec![
                TransferJob::from_pairs(
                    JobId(1),
                    [(
                        BlockId(3),
                        DiskBlock {
                            slot: BlockId(4),
                            key: h(5),
                        },
                    )],
                ),
                TransferJob::from_pairs(JobId(2), [(BlockId(6), h(7))]),
            ],
            stores: vec![RequestStore {
                request: "r".into(),
                job: TransferJob::from_pairs(JobId(3), [(DeviceBlockId(8), BlockId(9))]),
            }],
            ..Default::default()
        };
        assert_eq!(StepMetadata::from_bytes(&m.to_bytes().unwrap()).unwrap(), m);
    }

    #[test]
    fn layout_agreement_sums_bytes_and_names_mismatches() {
        let r = |rank, bs, bpb| RankLayout {
            rank,
            world_size: 2,
            block_size: bs,
            bytes_per_block: bpb,
            num_device_blocks: 64,
        };
        let l = ClusterLayout::agree(&[r(1, 16, 300), r(0, 16, 200)], 16).unwrap();
        assert_eq!(l.total_bytes_per_block(), 500);
        assert_eq!(l.bytes_per_block, vec![200, 300]);
        let e = ClusterLayout::agree(&[r(0, 16, 200), r(1, 32, 300)], 16).unwrap_err();
        assert!(
            e.to_string().contains("rank 1 has 32 tokens per block"),
            "{e}"
        );
    }
}
