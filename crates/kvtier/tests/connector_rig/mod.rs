//! The connector rig shared by the end-to-end connector tests: one leader and its workers on
//! `MemoryTransfer` (host memory standing in for each rank's device), driven step by step as an
//! engine would, with KV bytes that are a function of the prefix, so a misplaced block shows.
#![allow(clippy::unwrap_used)]
#![allow(dead_code, unused_imports)] // each test file uses part of the rig
pub(crate) use std::sync::Arc;

pub(crate) use kvtier::connector::testing::{
    FaultRules, FaultyTransfer, MemoryRemoteStore, MemoryTransfer,
};
pub(crate) use kvtier::connector::{
    Capacity, ClusterLayout, ConnectorError, DiskPolicy, Leader, LeaderConfig, RequestKey,
    SchedulerStep, StepMetadata, StepRecord, Worker, WorkerLink,
};
pub(crate) use kvtier::hash::{sequence_hashes, HashSalt};
pub(crate) use kvtier::transfer::{BlockTransfer, RemoteStore};
pub(crate) use kvtier::{DeviceBlockId, RequestId, Tier};

pub(crate) const BS: usize = 16;
pub(crate) const BPB: usize = 64;
pub(crate) const DEV: usize = 64;
pub(crate) const SALT: HashSalt = HashSalt(42);

/// The KV an engine would compute for block `i` of `tokens` on `rank`: a function of the prefix.
pub(crate) fn kv_bytes(tokens: &[u32], i: usize, rank: u32, bpb: usize) -> Vec<u8> {
    let h = sequence_hashes(SALT, &tokens[..(i + 1) * BS], BS)[i].0 ^ (rank as u128 * 0x9e37);
    (0..bpb)
        .map(|k| (h >> ((k % 16) * 8)) as u8 ^ k as u8)
        .collect()
}

/// Tokens of a request and the (block index, device block) pairs a forward pass computes.
pub(crate) type Computed = (Vec<u32>, Vec<(usize, u32)>);

pub(crate) struct Rank {
    pub(crate) mem: Arc<MemoryTransfer>,
    pub(crate) faulty: Arc<FaultyTransfer>,
    pub(crate) worker: Worker,
    pub(crate) bpb: usize,
}

pub(crate) struct Rig {
    pub(crate) leader: Leader,
    pub(crate) ranks: Vec<Rank>,
}

impl Rig {
    pub(crate) fn new(
        cfg: LeaderConfig,
        bpbs: &[usize],
        remote: Option<Arc<dyn RemoteStore>>,
    ) -> Rig {
        let mut cfg = cfg;
        cfg.layout = Some(ClusterLayout {
            block_size: BS as u32,
            num_device_blocks: DEV as u32,
            bytes_per_block: bpbs.iter().map(|&b| b as u64).collect(),
        });
        let leader = Leader::new(cfg).unwrap();
        let world = bpbs.len() as u32;
        let ranks = bpbs
            .iter()
            .enumerate()
            .map(|(r, &bpb)| {
                let mut m = MemoryTransfer::new(bpb, DEV, 64, 64);
                if let Some(rs) = &remote {
                    m = m.with_remote(rs.clone());
                }
                let mem = Arc::new(m);
                let faulty = Arc::new(FaultyTransfer::new(mem.clone()));
                let link = WorkerLink::in_process(r as u32, world, leader.report_sender());
                let worker = Worker::new(faulty.clone() as Arc<dyn BlockTransfer>, link);
                Rank {
                    mem,
                    faulty,
                    worker,
                    bpb,
                }
            })
            .collect();
        Rig { leader, ranks }
    }

    /// Run one engine step: metadata to every rank, loads awaited, "forward" writes the KV of
    /// the blocks computed by this step, stores queued.
    pub(crate) fn run(&mut self, step: &SchedulerStep, computed: &[Computed]) -> StepMetadata {
        let meta = self.leader.build_step(step).unwrap();
        let bytes = meta.to_bytes().unwrap();
        for r in &mut self.ranks {
            let m = StepMetadata::from_bytes(&bytes).unwrap();
            r.worker.bind(&m);
            r.worker.start_load(None);
            r.worker.wait_for_layer_load(0);
            for (tokens, blocks) in computed {
                for &(i, dev) in blocks {
                    r.mem
                        .write_block(
                            Tier::Device,
                            dev,
                            &kv_bytes(tokens, i, r.worker.rank(), r.bpb),
                        )
                        .unwrap();
                }
            }
            r.worker.forward_done(None);
        }
        meta
    }

    pub(crate) fn settle(&mut self) {
        for r in &mut self.ranks {
            r.worker.wait_idle();
        }
        self.leader.poll_reports();
    }

    /// Rank 0's device blocks `first..first + n` hold blocks `0..n` of `tokens`' KV, bit-exact.
    pub(crate) fn assert_device_kv(&self, first: u32, tokens: &[u32], n: u32, what: &str) {
        for i in 0..n {
            assert_eq!(
                self.ranks[0]
                    .mem
                    .read_block(Tier::Device, first + i)
                    .unwrap(),
                kv_bytes(tokens, i as usize, 0, BPB),
                "{what}: block {i}"
            );
        }
    }
}

pub(crate) fn ids(v: std::ops::Range<u32>) -> Vec<DeviceBlockId> {
    v.map(DeviceBlockId).collect()
}

/// A scheduler record of a request's first step.
pub(crate) fn new_rec(
    req: &str,
    tokens: &[u32],
    blocks: Vec<DeviceBlockId>,
    computed: usize,
    scheduled: usize,
) -> StepRecord {
    StepRecord {
        is_new: true,
        ..cont(req, tokens, blocks, computed, scheduled)
    }
}

/// A scheduler record of a running request's later step.
pub(crate) fn cont(
    req: &str,
    tokens: &[u32],
    blocks: Vec<DeviceBlockId>,
    computed: usize,
    scheduled: usize,
) -> StepRecord {
    StepRecord {
        request_id: req.into(),
        new_tokens: tokens.to_vec(),
        new_block_ids: blocks,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        ..Default::default()
    }
}

pub(crate) fn step(records: Vec<StepRecord>) -> SchedulerStep {
    SchedulerStep {
        records,
        finished: vec![],
    }
}

/// Fill request "a" (prompt of `n` tokens, blocks 0..) into the host tier through two prefill chunks.
pub(crate) fn prefill(rig: &mut Rig, req: &str, prompt: &[u32], first_dev: u32) {
    let nb = prompt.len().div_ceil(BS) as u32;
    let r: RequestId = req.into();
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&r, prompt, 0)
            .unwrap(),
        0
    );
    rig.leader
        .update_state_after_alloc(&r, &ids(first_dev..first_dev + nb), Some(0))
        .unwrap();
    let full = prompt.len() / BS;
    let chunk1 = (0..full.min(4))
        .map(|i| (i, first_dev + i as u32))
        .collect();
    rig.run(
        &step(vec![new_rec(
            req,
            prompt,
            ids(first_dev..first_dev + nb),
            0,
            64.min(prompt.len()),
        )]),
        &[(prompt.to_vec(), chunk1)],
    );
    if prompt.len() > 64 {
        let chunk2 = (4..full).map(|i| (i, first_dev + i as u32)).collect();
        rig.run(
            &step(vec![cont(req, &[], vec![], 64, prompt.len() - 64)]),
            &[(prompt.to_vec(), chunk2)],
        );
    }
}
