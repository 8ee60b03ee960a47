//! In-memory and fault-injecting implementations of the transfer traits, for the tests of every
//! crate (and for running the connector without any device).
//!
//! Invariants: [`MemoryTransfer`] copies whole blocks or reports the pair failed (never a partial
//! block reported Ok); [`FaultyTransfer`] fails exactly the pairs its rules name, passes every
//! other pair to the inner transfer unchanged, and maps failure indices back to the caller's job.
//!
//! Locks: each tier's bytes sit behind their own mutex, taken one at a time (never two at once).
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::hash::SequenceHash;
use crate::ids::Tier;
use crate::transfer::{
    Block, BlockFailure, BlockTransfer, Fence, RemoteStore, TransferError, TransferJob,
    TransferOutcome,
};

/// Blocks of `bytes_per_block` bytes per tier, in `Vec<u8>`s.
pub struct MemoryTransfer {
    bytes_per_block: usize,
    tiers: HashMap<Tier, Mutex<Vec<u8>>>,
    remote: Option<Arc<dyn RemoteStore>>,
}

impl MemoryTransfer {
    /// Tiers with 0 blocks are absent (`has_tier` false).
    pub fn new(
        bytes_per_block: usize,
        device_blocks: usize,
        host_blocks: usize,
        disk_blocks: usize,
    ) -> Self {
        let mut tiers = HashMap::new();
        for (t, n) in [
            (Tier::Device, device_blocks),
            (Tier::Host, host_blocks),
            (Tier::Disk, disk_blocks),
        ] {
            if n > 0 {
                tiers.insert(t, Mutex::new(vec![0u8; n * bytes_per_block]));
            }
        }
        MemoryTransfer {
            bytes_per_block,
            tiers,
            remote: None,
        }
    }

    /// Add a G4 store, reached by the keys of a job's remote side.
    pub fn with_remote(mut self, remote: Arc<dyn RemoteStore>) -> Self {
        self.remote = Some(remote);
        self
    }

    fn range(&self, block: u32) -> std::ops::Range<usize> {
        let s = block as usize * self.bytes_per_block;
        s..s + self.bytes_per_block
    }

    /// Overwrite one block (tests fill device blocks with known bytes this way).
    pub fn write_block(&self, tier: Tier, block: u32, data: &[u8]) -> Result<(), TransferError> {
        if data.len() != self.bytes_per_block {
            return Err(TransferError::Other(format!(
                "block data is {} bytes, expected {}",
                data.len(),
                self.bytes_per_block
            )));
        }
        let m = self
            .tiers
            .get(&tier)
            .ok_or(TransferError::TierMissing(tier))?;
        let mut v = m
            .lock()
            .map_err(|_| TransferError::Other("tier lock poisoned".into()))?;
        let r = self.range(block);
        let dst = v
            .get_mut(r)
            .ok_or_else(|| TransferError::Other(format!("{tier:?} block {block} out of range")))?;
        dst.copy_from_slice(data);
        Ok(())
    }

    /// A copy of one block.
    pub fn read_block(&self, tier: Tier, block: u32) -> Result<Vec<u8>, TransferError> {
        let m = self
            .tiers
            .get(&tier)
            .ok_or(TransferError::TierMissing(tier))?;
        let v = m
            .lock()
            .map_err(|_| TransferError::Other("tier lock poisoned".into()))?;
        v.get(self.range(block))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| TransferError::Other(format!("{tier:?} block {block} out of range")))
    }

    /// Copy one pair: remote blocks by key, the others by number (disk keys are not checked).
    fn copy_pair(&self, src: Block, dst: Block) -> Result<(), String> {
        let mut buf = vec![0u8; self.bytes_per_block];
        match (src, src.number()) {
            (Block::Remote(key), _) => {
                let r = self.remote.as_ref().ok_or("no remote store")?;
                r.get(key, &mut buf).map_err(|e| e.to_string())?;
            }
            (_, Some(n)) => buf = self.read_block(src.tier(), n).map_err(|e| e.to_string())?,
            (_, None) => return Err("a block without a number".into()),
        }
        match (dst, dst.number()) {
            (Block::Remote(key), _) => {
                let r = self.remote.as_ref().ok_or("no remote store")?;
                r.put(key, &buf).map_err(|e| e.to_string())?;
            }
            (_, Some(n)) => self
                .write_block(dst.tier(), n, &buf)
                .map_err(|e| e.to_string())?,
            (_, None) => return Err("a block without a number".into()),
        }
        Ok(())
    }
}

impl BlockTransfer for MemoryTransfer {
    fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }
    fn has_tier(&self, tier: Tier) -> bool {
        if tier == Tier::Remote {
            self.remote.is_some()
        } else {
            self.tiers.contains_key(&tier)
        }
    }
    fn fence(&self, _engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        Ok(Fence::none())
    }
    fn execute(&self, job: &TransferJob, _fence: &Fence) -> TransferOutcome {
        let failures: Vec<BlockFailure> = job
            .pairs()
            .enumerate()
            .filter_map(|(i, (src, dst))| {
                self.copy_pair(src, dst).err().map(|reason| BlockFailure {
                    pair_index: i,
                    reason,
                })
            })
            .collect();
        if failures.is_empty() {
            TransferOutcome::Ok
        } else {
            TransferOutcome::Failed(failures)
        }
    }
}

/// A content-addressed store in memory.
#[derive(Default)]
pub struct MemoryRemoteStore {
    map: Mutex<HashMap<SequenceHash, Vec<u8>>>,
}

impl MemoryRemoteStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
    /// Values stored.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }
    /// Whether no value is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RemoteStore for MemoryRemoteStore {
    fn put(&self, key: SequenceHash, data: &[u8]) -> Result<(), TransferError> {
        let mut m = self
            .map
            .lock()
            .map_err(|_| TransferError::Other("poisoned".into()))?;
        m.insert(key, data.to_vec());
        Ok(())
    }
    fn get(&self, key: SequenceHash, out: &mut [u8]) -> Result<(), TransferError> {
        let m = self
            .map
            .lock()
            .map_err(|_| TransferError::Other("poisoned".into()))?;
        let v = m
            .get(&key)
            .ok_or_else(|| TransferError::Other(format!("remote key {:032x} missing", key.0)))?;
        if v.len() != out.len() {
            return Err(TransferError::Other(format!(
                "remote key {:032x} has {} bytes",
                key.0,
                v.len()
            )));
        }
        out.copy_from_slice(v);
        Ok(())
    }
    fn contains(&self, keys: &[SequenceHash]) -> Result<Vec<bool>, TransferError> {
        let m = self
            .map
            .lock()
            .map_err(|_| TransferError::Other("poisoned".into()))?;
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }
}

/// Which pairs a [`FaultyTransfer`] fails.
#[derive(Clone, Debug, Default)]
pub struct FaultRules {
    /// Fail every pair reading `(tier, block)`.
    pub fail_src: HashSet<(Tier, u32)>,
    /// Fail every pair writing `(tier, block)`.
    pub fail_dst: HashSet<(Tier, u32)>,
    /// Fail every pair of every job in this direction.
    pub fail_direction: HashSet<(Tier, Tier)>,
    /// Fail the fence (the whole job's pairs fail at the worker).
    pub fail_fence: bool,
    /// Sleep before each job.
    pub delay: Option<Duration>,
    /// Jobs in this direction copy the first half of their pairs (rounded up) and then panic:
    /// the transfer thread dies mid-job, leaving the destination half-written.
    pub panic_direction: HashSet<(Tier, Tier)>,
}

/// Wraps a transfer and fails the pairs its rules name; can also hold every job until released.
pub struct FaultyTransfer {
    inner: Arc<dyn BlockTransfer>,
    rules: Mutex<FaultRules>,
    held: Mutex<bool>,
    cv: Condvar,
}

impl FaultyTransfer {
    /// Forward to `inner`, with no fault armed.
    pub fn new(inner: Arc<dyn BlockTransfer>) -> Self {
        FaultyTransfer {
            inner,
            rules: Mutex::new(FaultRules::default()),
            held: Mutex::new(false),
            cv: Condvar::new(),
        }
    }

    /// A [`MemoryTransfer`] of `bytes_per_block`-byte blocks (`device_blocks` on the device,
    /// `host_blocks` in the host tier) whose reads of the host blocks `fail` fail.
    pub fn failing_host_reads(
        bytes_per_block: usize,
        device_blocks: usize,
        host_blocks: usize,
        fail: impl IntoIterator<Item = u32>,
    ) -> Arc<Self> {
        let faulty = Arc::new(Self::new(Arc::new(MemoryTransfer::new(
            bytes_per_block,
            device_blocks,
            host_blocks,
            0,
        ))));
        faulty.set_rules(FaultRules {
            fail_src: fail.into_iter().map(|b| (Tier::Host, b)).collect(),
            ..FaultRules::default()
        });
        faulty
    }

    /// Replace the armed faults (jobs started from now on see them).
    pub fn set_rules(&self, rules: FaultRules) {
        if let Ok(mut r) = self.rules.lock() {
            *r = rules;
        }
    }

    /// Jobs started from now on wait until [`FaultyTransfer::release`].
    pub fn hold(&self) {
        if let Ok(mut h) = self.held.lock() {
            *h = true;
        }
    }

    /// Let held jobs run (see [`FaultyTransfer::hold`]).
    pub fn release(&self) {
        if let Ok(mut h) = self.held.lock() {
            *h = false;
        }
        self.cv.notify_all();
    }
}

impl BlockTransfer for FaultyTransfer {
    fn bytes_per_block(&self) -> usize {
        self.inner.bytes_per_block()
    }
    fn has_tier(&self, tier: Tier) -> bool {
        self.inner.has_tier(tier)
    }
    fn fence(&self, engine_stream: Option<u64>) -> Result<Fence, TransferError> {
        let fail = self.rules.lock().map(|r| r.fail_fence).unwrap_or(false);
        if fail {
            return Err(TransferError::Other("injected fence failure".into()));
        }
        self.inner.fence(engine_stream)
    }
    fn execute(&self, job: &TransferJob, fence: &Fence) -> TransferOutcome {
        if let Ok(mut h) = self.held.lock() {
            while *h {
                h = match self.cv.wait(h) {
                    Ok(h) => h,
                    Err(_) => break,
                };
            }
        }
        let rules = self.rules.lock().map(|r| r.clone()).unwrap_or_default();
        if let Some(d) = rules.delay {
            std::thread::sleep(d);
        }
        let direction = (job.src_tier(), job.dst_tier());
        if rules.panic_direction.contains(&direction) {
            let half = job.len().div_ceil(2);
            let first: Vec<usize> = (0..half).collect();
            let _ = self.inner.execute(&job.subset(&first), fence);
            // The injected fault itself (tests only): what a dying transfer thread looks like.
            std::panic::panic_any(format!(
                "injected: transfer died mid-job ({:?} -> {:?}, {half} of {} pairs written)",
                direction.0,
                direction.1,
                job.len()
            ));
        }
        // A remote block has no number: the block rules never name it.
        let named = |rule: &HashSet<(Tier, u32)>, b: Block| {
            b.number().is_some_and(|n| rule.contains(&(b.tier(), n)))
        };
        let mut failures = Vec::new();
        let mut pass_idx = Vec::new();
        for (i, (src, dst)) in job.pairs().enumerate() {
            let bad = rules.fail_direction.contains(&direction)
                || named(&rules.fail_src, src)
                || named(&rules.fail_dst, dst);
            if bad {
                failures.push(BlockFailure {
                    pair_index: i,
                    reason: "injected fault".into(),
                });
            } else {
                pass_idx.push(i);
            }
        }
        if !pass_idx.is_empty() {
            let sub = job.subset(&pass_idx);
            if let TransferOutcome::Failed(f) = self.inner.execute(&sub, fence) {
                for b in f {
                    failures.push(BlockFailure {
                        pair_index: pass_idx.get(b.pair_index).copied().unwrap_or(b.pair_index),
                        reason: b.reason,
                    });
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
