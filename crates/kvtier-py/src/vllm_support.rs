//! The shared remote tier (G4) for the bindings: opening the configured store, and loads from it
//! into engine memory through a host bounce buffer (kvtier-io moves remote blocks only to and from
//! host memory). Disaggregated prefill/decode on vLLM hands its KV over through this tier.
//!
//! Invariants: every process of one model opens the same store under the same namespace, so a
//! producer's puts are a consumer's hits; a `Remote -> Device` pair is reported copied only if both
//! legs (remote -> bounce, bounce -> device) copied it, and a pair whose remote leg failed (missing,
//! short or corrupt value, unreachable server) never touches the device; one mutex serialises users
//! of the bounce buffer.
use std::sync::{Arc, Mutex};

use kvtier::config::RemoteTarget;
use kvtier::layout::DeviceLayout;
use kvtier::transfer::{
    BlockFailure, BlockPair, BlockTransfer, Fence, RemoteStore, TransferError, TransferJob,
    TransferOutcome,
};
use kvtier::Tier;
use kvtier_io::{HostOptions, HostStorage, TransferEngine};

use crate::errors::{BridgeError, BridgeResult, Family};
use crate::settings::Settings;

/// Key space of kvtier's blocks in a shared store. Sequence hashes already carry the model salt.
const NAMESPACE: &str = "kvtier-v1";

/// The configured remote store (`remote.url`), or None when there is no remote tier.
pub fn remote_store(settings: &Settings) -> BridgeResult<Option<Arc<dyn RemoteStore>>> {
    let url = match &settings.config.remote {
        None => return Ok(None),
        Some(RemoteTarget::Dir(path)) => format!("dir://{}", path.display()),
        Some(RemoteTarget::Redis(url)) => url.clone(),
    };
    kvtier_io::remote::from_url(&url, NAMESPACE)
        .map(Some)
        .map_err(|e| BridgeError::local(Family::Config, format!("remote.url {url}: {e}")))
}

/// Blocks of the private host buffer that remote -> device loads pass through.
const BOUNCE_BLOCKS: u32 = 64;

/// An engine over the device layout, a private host buffer and `store`, for [`RemoteStaged`].
pub fn bounce_engine(
    layout: &DeviceLayout,
    store: &Arc<dyn RemoteStore>,
    bytes_per_block: usize,
    cuda_ordinal: Option<i32>,
) -> BridgeResult<(Arc<dyn BlockTransfer>, u32)> {
    let io = |e: kvtier_io::IoError| {
        BridgeError::local(Family::Transfer, format!("remote bounce buffer: {e}"))
    };
    let mut opts = HostOptions::new(BOUNCE_BLOCKS, bytes_per_block);
    if let Some(ordinal) = cuda_ordinal {
        opts.cuda_device = ordinal;
    }
    let engine = TransferEngine::builder()
        .device_layout(layout.clone())
        .host(Arc::new(HostStorage::new(&opts).map_err(io)?))
        .remote(Arc::clone(store))
        .build()
        .map_err(io)?;
    Ok((Arc::new(engine), BOUNCE_BLOCKS))
}

/// A transfer that runs `Remote -> Device` jobs as `Remote -> bounce` then `bounce -> Device` on
/// `bounce` (an engine with the device layout, a small host buffer of `cap` blocks and the remote
/// store); every other job goes to `main` unchanged.
pub struct RemoteStaged {
    main: Arc<dyn BlockTransfer>,
    bounce: Option<(Mutex<()>, Arc<dyn BlockTransfer>, u32)>,
}

impl RemoteStaged {
    pub fn new(
        main: Arc<dyn BlockTransfer>,
        bounce: Option<(Arc<dyn BlockTransfer>, u32)>,
    ) -> Self {
        RemoteStaged {
            main,
            bounce: bounce.map(|(e, n)| (Mutex::new(()), e, n.max(1))),
        }
    }

    fn remote_to_device(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        let Some((lock, engine, cap)) = &self.bounce else {
            return self.main.execute(job, fence);
        };
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut failures = Vec::new();
        for (chunk_no, chunk) in job.pairs.chunks(*cap as usize).enumerate() {
            let base = chunk_no * *cap as usize;
            // Remote pairs name their key by index into `remote_keys`: keep the whole key list.
            let leg1 = TransferJob {
                id: job.id,
                src: Tier::Remote,
                dst: Tier::Host,
                pairs: chunk
                    .iter()
                    .enumerate()
                    .map(|(i, p)| BlockPair {
                        src: p.src,
                        dst: i as u32,
                    })
                    .collect(),
                remote_keys: job.remote_keys.clone(),
            };
            let failed1 = match engine.execute(&leg1, &Fence::none()) {
                TransferOutcome::Ok => Vec::new(),
                TransferOutcome::Failed(f) => f,
            };
            let mut leg2 = Vec::new();
            let mut index = Vec::new();
            for (i, p) in chunk.iter().enumerate() {
                if let Some(f) = failed1.iter().find(|f| f.pair_index == i) {
                    failures.push(BlockFailure {
                        pair_index: base + i,
                        reason: format!("remote read: {}", f.reason),
                    });
                } else {
                    leg2.push(BlockPair {
                        src: i as u32,
                        dst: p.dst,
                    });
                    index.push(base + i);
                }
            }
            if leg2.is_empty() {
                continue;
            }
            let job2 = TransferJob {
                id: job.id,
                src: Tier::Host,
                dst: Tier::Device,
                pairs: leg2,
                remote_keys: Vec::new(),
            };
            if let TransferOutcome::Failed(f) = engine.execute(&job2, fence) {
                for b in f {
                    if let Some(&pair_index) = index.get(b.pair_index) {
                        failures.push(BlockFailure {
                            pair_index,
                            reason: format!("device write: {}", b.reason),
                        });
                    }
                }
            }
        }
        if failures.is_empty() {
            TransferOutcome::Ok
        } else {
            failures.sort_by_key(|f| f.pair_index);
            TransferOutcome::Failed(failures)
        }
    }
}

impl BlockTransfer for RemoteStaged {
    fn bytes_per_block(&self) -> usize {
        self.main.bytes_per_block()
    }
    fn has_tier(&self, tier: Tier) -> bool {
        self.main.has_tier(tier)
    }
    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        self.main.fence(engine_stream)
    }
    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        if job.src == Tier::Remote && job.dst == Tier::Device {
            self.remote_to_device(job, fence)
        } else {
            self.main.execute(job, fence)
        }
    }
}
