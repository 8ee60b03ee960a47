//! End-to-end connector flows on host memory: leader + workers + `MemoryTransfer`, checking
//! bytes, not just counters.
#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use kvtier::connector::testing::{FaultRules, FaultyTransfer, MemoryRemoteStore, MemoryTransfer};
use kvtier::connector::{
    Capacity, ClusterLayout, ConnectorError, DiskPolicy, Leader, LeaderConfig, RequestKey,
    SchedulerStep, StepMetadata, StepRecord, Worker, WorkerLink,
};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::transfer::{BlockTransfer, RemoteStore};
use kvtier::{DeviceBlockId, RequestId, Tier};

const BS: usize = 16;
const BPB: usize = 64;
const DEV: usize = 64;
const SALT: HashSalt = HashSalt(42);

/// The KV an engine would compute for block `i` of `tokens` on `rank`: a function of the prefix.
fn kv_bytes(tokens: &[u32], i: usize, rank: u32, bpb: usize) -> Vec<u8> {
    let h = sequence_hashes(SALT, &tokens[..(i + 1) * BS], BS)[i].0 ^ (rank as u128 * 0x9e37);
    (0..bpb)
        .map(|k| (h >> ((k % 16) * 8)) as u8 ^ k as u8)
        .collect()
}

/// Tokens of a request and the (block index, device block) pairs a forward pass computes.
type Computed = (Vec<u32>, Vec<(usize, u32)>);

struct Rank {
    mem: Arc<MemoryTransfer>,
    faulty: Arc<FaultyTransfer>,
    worker: Worker,
    bpb: usize,
}

struct Rig {
    leader: Leader,
    ranks: Vec<Rank>,
}

impl Rig {
    fn new(cfg: LeaderConfig, bpbs: &[usize], remote: Option<Arc<dyn RemoteStore>>) -> Rig {
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
    fn run(&mut self, step: &SchedulerStep, computed: &[Computed]) -> StepMetadata {
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

    fn settle(&mut self) {
        for r in &mut self.ranks {
            r.worker.wait_idle();
        }
        self.leader.poll_reports();
    }
}

fn ids(v: std::ops::Range<u32>) -> Vec<DeviceBlockId> {
    v.map(DeviceBlockId).collect()
}

fn new_rec(
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
        is_new: true,
        ..Default::default()
    }
}

fn cont(
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

fn step(records: Vec<StepRecord>) -> SchedulerStep {
    SchedulerStep {
        records,
        finished: vec![],
    }
}

/// Fill request "a" (prompt of `n` tokens, blocks 0..) into the host tier through two prefill chunks.
fn prefill(rig: &mut Rig, req: &str, prompt: &[u32], first_dev: u32) {
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

#[test]
fn offload_then_onboard_from_host_is_bit_exact() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (1000..1100).collect();
    prefill(&mut rig, "a", &prompt, 0);
    rig.settle();
    let s = rig.leader.stats();
    assert_eq!(s.offload_confirmed, 6, "{s:?}");
    assert!(!rig
        .leader
        .request_finished(&"a".into())
        .unwrap()
        .must_wait());

    // Same prompt, the engine's own cache was reset: 6 full blocks come from the host.
    let b: RequestId = "b".into();
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&b, &prompt, 0)
            .unwrap(),
        96
    );
    // Matching is side-effect free: asking again gives the same answer and pins nothing.
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&b, &prompt, 0)
            .unwrap(),
        96
    );
    assert_eq!(rig.leader.host_pool().unwrap().num_pinned(), 0);
    rig.leader
        .update_state_after_alloc(&b, &ids(20..27), None)
        .unwrap();
    assert_eq!(rig.leader.host_pool().unwrap().num_pinned(), 6);
    let meta = rig.run(&step(vec![new_rec("b", &prompt, ids(20..27), 0, 4)]), &[]);
    assert_eq!(meta.loads.len(), 1);
    assert!(
        meta.stores.is_empty(),
        "onboarded blocks are not stored again"
    );
    rig.settle();
    for i in 0..6u32 {
        assert_eq!(
            rig.ranks[0].mem.read_block(Tier::Device, 20 + i).unwrap(),
            kv_bytes(&prompt, i as usize, 0, BPB),
            "block {i}"
        );
    }
    assert_eq!(rig.leader.host_pool().unwrap().num_pinned(), 0);
    assert!(rig.ranks[0].worker.take_load_errors().is_empty());
}

#[test]
fn full_prompt_hit_leaves_one_block_to_compute() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (0..96).collect();
    prefill(&mut rig, "a", &prompt, 0);
    rig.settle();
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&"b".into(), &prompt, 0)
            .unwrap(),
        80
    );
    // With the first two blocks in the engine's own cache, kvtier supplies blocks 2..5.
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&"c".into(), &prompt, 32)
            .unwrap(),
        48
    );
}

#[test]
fn saves_in_flight_keep_a_finished_request_unsaved() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    rig.ranks[0].faulty.hold();
    let prompt: Vec<u32> = (0..40).collect();
    let a: RequestId = "a".into();
    rig.leader
        .update_state_after_alloc(&a, &ids(0..3), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("a", &prompt, ids(0..3), 0, 40)]),
        &[(prompt.clone(), vec![(0, 0), (1, 1)])],
    );
    assert!(
        rig.leader.request_finished(&a).unwrap().must_wait(),
        "stores are in flight"
    );
    let f = rig.ranks[0]
        .worker
        .get_finished(std::slice::from_ref(&a), None);
    assert!(f.saved.is_empty(), "{f:?}");
    rig.ranks[0].faulty.release();
    rig.settle();
    let f = rig.ranks[0].worker.get_finished(&[], None);
    assert!(
        f.saved.is_empty(),
        "the leader's 'saving' answer has not reached the worker yet"
    );
    let meta = rig.run(&step(vec![]), &[]);
    assert_eq!(meta.saving, vec![a.clone()]);
    let f = rig.ranks[0].worker.get_finished(&[], None);
    assert_eq!(f.saved, vec![a.clone()]);
    assert_eq!(rig.leader.stats().offload_confirmed, 2);
    assert_eq!(rig.leader.stats().active_requests, 0);
}

#[test]
fn failed_async_load_is_reported_failed_never_loaded() {
    let mut cfg = LeaderConfig::new(BS, SALT, 32);
    cfg.async_loads = true;
    let mut rig = Rig::new(cfg, &[BPB], None);
    let prompt: Vec<u32> = (500..600).collect();
    prefill(&mut rig, "a", &prompt, 0);
    rig.settle();
    let host_block_of_3 = {
        let h = sequence_hashes(SALT, &prompt, BS)[3];
        rig.leader.host_pool().unwrap().lookup(h).unwrap()
    };
    rig.ranks[0].faulty.set_rules(FaultRules {
        fail_src: [(Tier::Host, host_block_of_3.0)].into_iter().collect(),
        ..Default::default()
    });
    let b: RequestId = "b".into();
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&b, &prompt, 0)
            .unwrap(),
        96
    );
    rig.leader
        .update_state_after_alloc(&b, &ids(30..37), None)
        .unwrap();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    let f = rig.ranks[0].worker.get_finished(&[], None);
    assert_eq!(f.loaded, Vec::<RequestId>::new());
    assert_eq!(f.load_failed, vec![b.clone()]);
    assert_eq!(
        rig.ranks[0].worker.take_load_errors(),
        vec![DeviceBlockId(33)]
    );
    // The unreadable host block is no longer offered.
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&"c".into(), &prompt, 0)
            .unwrap(),
        48
    );
    assert_eq!(rig.leader.stats().onboard_failed, 1);
}

#[test]
fn disk_write_through_serves_after_host_eviction() {
    let mut cfg = LeaderConfig::new(BS, SALT, 6);
    cfg.disk = Capacity::Blocks(32);
    cfg.disk_policy = DiskPolicy::WriteThrough;
    let mut rig = Rig::new(cfg, &[BPB], None);
    let p1: Vec<u32> = (0..100).collect();
    prefill(&mut rig, "a", &p1, 0);
    rig.settle();
    rig.run(&step(vec![]), &[]); // carries the spills
    rig.settle();
    assert_eq!(rig.leader.stats().disk_registered, 6);
    // A second prompt evicts the first one from the 6-block host tier.
    let p2: Vec<u32> = (7000..7100).collect();
    prefill(&mut rig, "b", &p2, 10);
    rig.settle();
    let h1 = sequence_hashes(SALT, &p1, BS);
    assert_eq!(rig.leader.host_pool().unwrap().peek_prefix(&h1), 0);
    let c: RequestId = "c".into();
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&c, &p1, 0).unwrap(),
        96
    );
    rig.leader
        .update_state_after_alloc(&c, &ids(40..47), None)
        .unwrap();
    let meta = rig.run(&step(vec![new_rec("c", &p1, ids(40..47), 0, 4)]), &[]);
    assert_eq!(meta.loads[0].jobs[0].src, Tier::Disk);
    rig.settle();
    for i in 0..6u32 {
        assert_eq!(
            rig.ranks[0].mem.read_block(Tier::Device, 40 + i).unwrap(),
            kv_bytes(&p1, i as usize, 0, BPB)
        );
    }
    assert!(rig.leader.stats().onboard_disk_blocks >= 6);
}

#[test]
fn remote_handover_between_two_leaders_tp2() {
    let store = Arc::new(MemoryRemoteStore::new());
    let remote: Arc<dyn RemoteStore> = store.clone();
    let mut pcfg = LeaderConfig::new(BS, SALT, 32);
    pcfg.remote = Some(remote.clone());
    pcfg.remote_put = true;
    let mut prefill_rig = Rig::new(pcfg, &[BPB, 2 * BPB], Some(remote.clone()));
    let prompt: Vec<u32> = (300..400).collect();
    prefill(&mut prefill_rig, "a", &prompt, 0);
    prefill_rig.settle();
    prefill_rig.run(&step(vec![]), &[]); // carries the remote puts
    prefill_rig.settle();
    assert_eq!(store.len(), 12, "6 blocks x 2 ranks");

    // The decode side: another leader, host tier empty, same remote store.
    let mut dcfg = LeaderConfig::new(BS, SALT, 32);
    dcfg.remote = Some(remote.clone());
    let mut decode = Rig::new(dcfg, &[BPB, 2 * BPB], Some(remote));
    let d: RequestId = "a".into();
    assert_eq!(
        decode
            .leader
            .get_num_new_matched_tokens(&d, &prompt, 0)
            .unwrap(),
        96
    );
    decode
        .leader
        .update_state_after_alloc(&d, &ids(8..15), None)
        .unwrap();
    let meta = decode.run(&step(vec![new_rec("a", &prompt, ids(8..15), 0, 4)]), &[]);
    assert_eq!(meta.loads[0].jobs[0].src, Tier::Remote);
    decode.settle();
    for (rank, bpb) in [(0u32, BPB), (1, 2 * BPB)] {
        for i in 0..6u32 {
            assert_eq!(
                decode.ranks[rank as usize]
                    .mem
                    .read_block(Tier::Device, 8 + i)
                    .unwrap(),
                kv_bytes(&prompt, i as usize, rank, bpb),
                "rank {rank} block {i}"
            );
        }
    }
}

#[test]
fn failed_remote_load_is_not_matched_again() {
    let store = Arc::new(MemoryRemoteStore::new());
    let remote: Arc<dyn RemoteStore> = store.clone();
    let mut pcfg = LeaderConfig::new(BS, SALT, 32);
    pcfg.remote = Some(remote.clone());
    pcfg.remote_put = true;
    let mut producer = Rig::new(pcfg, &[BPB], Some(remote.clone()));
    let prompt: Vec<u32> = (500..600).collect();
    prefill(&mut producer, "a", &prompt, 0);
    producer.settle();
    producer.run(&step(vec![]), &[]); // carries the remote puts
    producer.settle();
    assert_eq!(store.len(), 6);

    // A consumer whose remote reads of block 2 fail (a corrupt value): the request loads blocks
    // 0..5, block 2 fails, and from then on matching stops before block 2.
    let mut ccfg = LeaderConfig::new(BS, SALT, 32);
    ccfg.remote = Some(remote.clone());
    let mut consumer = Rig::new(ccfg, &[BPB], Some(remote));
    consumer.ranks[0].faulty.set_rules(FaultRules {
        fail_dst: [(Tier::Device, 10)].into_iter().collect(),
        ..Default::default()
    });
    let a: RequestId = "a".into();
    assert_eq!(
        consumer
            .leader
            .get_num_new_matched_tokens(&a, &prompt, 0)
            .unwrap(),
        96
    );
    consumer
        .leader
        .update_state_after_alloc(&a, &ids(8..15), None)
        .unwrap();
    consumer.run(&step(vec![new_rec("a", &prompt, ids(8..15), 0, 4)]), &[]);
    consumer.settle();
    assert_eq!(consumer.leader.stats().onboard_failed, 1);
    assert_eq!(consumer.ranks[0].worker.take_load_errors(), ids(10..11));
    // Another request with the same prompt: only the blocks before the failed one match.
    let b: RequestId = "b".into();
    assert_eq!(
        consumer
            .leader
            .get_num_new_matched_tokens(&b, &prompt, 0)
            .unwrap(),
        2 * BS
    );
}

#[test]
fn tp2_store_is_confirmed_only_when_both_ranks_report() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB, BPB], None);
    rig.ranks[1].faulty.hold();
    let prompt: Vec<u32> = (0..32).collect();
    let a: RequestId = "a".into();
    rig.leader
        .update_state_after_alloc(&a, &ids(0..2), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("a", &prompt, ids(0..2), 0, 32)]),
        &[(prompt.clone(), vec![(0, 0), (1, 1)])],
    );
    rig.ranks[0].worker.wait_idle();
    rig.leader.poll_reports();
    assert_eq!(rig.leader.stats().offload_confirmed, 0);
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&"x".into(), &prompt, 0)
            .unwrap(),
        0,
        "not visible before confirmation"
    );
    assert!(rig.leader.request_finished(&a).unwrap().must_wait());
    rig.ranks[1].faulty.release();
    rig.settle();
    assert_eq!(rig.leader.stats().offload_confirmed, 2);
    assert!(!rig.leader.has_pending_saves(&a));
}

#[test]
fn failed_store_frees_its_block_and_is_not_matched() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB, BPB], None);
    rig.ranks[1].faulty.set_rules(FaultRules {
        fail_src: [(Tier::Device, 1)].into_iter().collect(),
        ..Default::default()
    });
    let prompt: Vec<u32> = (0..48).collect();
    let a: RequestId = "a".into();
    rig.leader
        .update_state_after_alloc(&a, &ids(0..3), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("a", &prompt, ids(0..3), 0, 48)]),
        &[(prompt.clone(), vec![(0, 0), (1, 1), (2, 2)])],
    );
    rig.settle();
    let s = rig.leader.stats();
    assert_eq!((s.offload_confirmed, s.offload_failed), (2, 1));
    assert_eq!(
        (s.host_registered, s.host_free),
        (2, 32),
        "the failed block went back to the free list"
    );
    // Block 1 is missing, so only block 0 is a contiguous prefix.
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&"b".into(), &prompt, 0)
            .unwrap(),
        16
    );
}

#[test]
fn invalid_engine_input_names_request_and_field_and_spares_others() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (0..40).collect();
    let field = |e: ConnectorError| match e {
        ConnectorError::InvalidInput { request, field, .. } => (request, field),
        other => panic!("unexpected {other:?}"),
    };
    rig.leader
        .update_state_after_alloc(&"a".into(), &ids(0..3), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("a", &prompt, ids(0..3), 0, 16)]),
        &[(prompt.clone(), vec![(0, 0)])],
    );

    let e = rig
        .leader
        .build_step(&step(vec![cont("ghost", &[], vec![], 0, 1)]))
        .unwrap_err();
    assert_eq!(field(e), ("ghost".into(), "request_id"));
    let e = rig
        .leader
        .build_step(&step(vec![cont("a", &[], ids(64..65), 16, 16)]))
        .unwrap_err();
    assert_eq!(field(e), ("a".into(), "new_block_ids"));
    let e = rig
        .leader
        .build_step(&step(vec![cont("a", &[], vec![], 16, 40)]))
        .unwrap_err();
    assert_eq!(field(e), ("a".into(), "num_scheduled_tokens"));
    let e = rig
        .leader
        .update_state_after_alloc(&"q".into(), &ids(70..71), Some(0))
        .unwrap_err();
    assert_eq!(field(e), ("q".into(), "block_ids"));
    let e = rig.leader.request_finished(&"nobody".into()).unwrap_err();
    assert_eq!(field(e), ("nobody".into(), "request_id"));

    // "a" is untouched by the errors: its next chunk offloads exactly block 1.
    let meta = rig.run(
        &step(vec![cont("a", &[], vec![], 16, 16)]),
        &[(prompt.clone(), vec![(1, 1)])],
    );
    assert_eq!(meta.stores.len(), 1);
    assert_eq!(meta.stores[0].job.pairs.len(), 1);
    assert_eq!(meta.stores[0].job.pairs[0].src, 1);
    rig.settle();
    assert!(!rig
        .leader
        .request_finished(&"a".into())
        .unwrap()
        .must_wait());
    let e = rig
        .leader
        .build_step(&step(vec![cont("a", &[40], vec![], 32, 8)]))
        .unwrap_err();
    assert_eq!(
        field(e),
        ("a".into(), "request_id"),
        "a step for a finished request"
    );
}

#[test]
fn sync_load_not_awaited_is_reported_failed() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (0..100).collect();
    prefill(&mut rig, "a", &prompt, 0);
    rig.settle();
    let b: RequestId = "b".into();
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(&b, &prompt, 0)
            .unwrap(),
        96
    );
    rig.leader
        .update_state_after_alloc(&b, &ids(20..27), None)
        .unwrap();
    let meta = rig
        .leader
        .build_step(&step(vec![new_rec("b", &prompt, ids(20..27), 0, 4)]))
        .unwrap();
    let w = &mut rig.ranks[0].worker;
    w.bind(&meta);
    w.forward_done(None); // the engine skipped start_load / wait_for_layer_load
    w.wait_idle();
    let mut errs = w.take_load_errors();
    errs.sort();
    assert_eq!(errs, ids(20..26));
    rig.leader.poll_reports();
    assert_eq!(
        rig.leader.host_pool().unwrap().num_pinned(),
        0,
        "pins released"
    );
}

#[test]
fn disk_filter_spills_only_blocks_seen_twice() {
    let mut cfg = LeaderConfig::new(BS, SALT, 32);
    cfg.disk = Capacity::Blocks(32);
    cfg.disk_policy = DiskPolicy::filtered();
    let mut rig = Rig::new(cfg, &[BPB], None);
    let p1: Vec<u32> = (0..64).collect();
    prefill(&mut rig, "a", &p1, 0);
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    assert_eq!(
        rig.leader.stats().disk_registered,
        0,
        "seen once: not on disk"
    );
    // The same prompt computed again (the engine declined the match): every block is seen twice.
    let b: RequestId = "b".into();
    rig.leader
        .update_state_after_alloc(&b, &ids(10..14), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("b", &p1, ids(10..14), 0, 64)]),
        &[(p1.clone(), (0..4).map(|i| (i, 10 + i as u32)).collect())],
    );
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    let s = rig.leader.stats();
    assert_eq!(
        (
            s.offload_deduplicated,
            s.disk_registered,
            s.offload_confirmed
        ),
        (4, 4, 4),
        "{s:?}"
    );
}

/// Regression: stores computed in the same step as a failed sync load read KV computed over bad
/// blocks; they must never be registered (the original served wrong KV after failed loads).
#[test]
fn failed_sync_load_drops_the_stores_of_that_step() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let pa: Vec<u32> = (0..100).collect();
    prefill(&mut rig, "a", &pa, 0);
    rig.settle();
    let mut pb: Vec<u32> = pa[..96].to_vec();
    pb.extend(5000..5032);
    let hb = sequence_hashes(SALT, &pb, BS);
    let host3 = rig.leader.host_pool().unwrap().lookup(hb[3]).unwrap();
    rig.ranks[0].faulty.set_rules(FaultRules {
        fail_src: [(Tier::Host, host3.0)].into_iter().collect(),
        ..Default::default()
    });
    let b: RequestId = "b".into();
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&b, &pb, 0).unwrap(),
        96
    );
    rig.leader
        .update_state_after_alloc(&b, &ids(20..28), None)
        .unwrap();
    let meta = rig.run(
        &step(vec![new_rec("b", &pb, ids(20..28), 96, 32)]),
        &[(pb.clone(), vec![(6, 26), (7, 27)])],
    );
    assert_eq!(meta.stores.len(), 1, "blocks 6 and 7 were planned");
    rig.settle();
    assert_eq!(
        rig.ranks[0].worker.take_load_errors(),
        vec![DeviceBlockId(23)]
    );
    let s = rig.leader.stats();
    assert_eq!(s.offload_failed, 2, "{s:?}");
    assert_eq!(rig.leader.host_pool().unwrap().peek_prefix(&hb), 3);
    // The engine recomputes from block 3; those blocks are offloaded again, correctly.
    let meta = rig.run(
        &step(vec![cont("b", &[], vec![], 48, 80)]),
        &[(pb.clone(), (3..8).map(|i| (i, 20 + i as u32)).collect())],
    );
    let stored: Vec<u32> = meta
        .stores
        .iter()
        .flat_map(|s| s.job.pairs.iter().map(|p| p.src))
        .collect();
    assert_eq!(
        stored,
        vec![23, 26, 27],
        "blocks 4 and 5 are still in the host tier"
    );
    rig.settle();
    assert_eq!(rig.leader.host_pool().unwrap().peek_prefix(&hb), 8);
}

/// Regression (vLLM frees a request's blocks at once when `request_finished` answers false, and
/// asserts if the request is later reported saved): a finished request without saves in flight
/// is never reported saved, even though it is passed to `get_finished`.
#[test]
fn request_without_saves_in_flight_is_never_reported_saved() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (0..40).collect();
    let a: RequestId = "a".into();
    rig.leader
        .update_state_after_alloc(&a, &ids(0..3), Some(0))
        .unwrap();
    rig.run(
        &step(vec![new_rec("a", &prompt, ids(0..3), 0, 40)]),
        &[(prompt.clone(), vec![(0, 0), (1, 1)])],
    );
    rig.settle();
    assert!(!rig.leader.request_finished(&a).unwrap().must_wait());
    for _ in 0..4 {
        rig.run(&step(vec![]), &[]);
        let f = rig.ranks[0]
            .worker
            .get_finished(std::slice::from_ref(&a), None);
        assert!(f.saved.is_empty(), "{f:?}");
    }
    // An engine that passes only requests answered "saving" may say so.
    rig.ranks[0].worker.set_finished_ids_are_saving(true);
    let f = rig.ranks[0]
        .worker
        .get_finished(std::slice::from_ref(&a), None);
    assert_eq!(f.saved, vec![a]);
}

/// Stores request `req` (prompt of whole blocks, identity `key`) into the host tier in one step.
fn store_with_key(rig: &mut Rig, req: &str, prompt: &[u32], first_dev: u32, key: &RequestKey) {
    let nb = prompt.len().div_ceil(BS) as u32;
    let r: RequestId = req.into();
    rig.leader
        .get_num_new_matched_tokens_for(&r, prompt, 0, key)
        .unwrap();
    let devs = ids(first_dev..first_dev + nb);
    rig.leader
        .update_state_after_alloc(&r, &devs, Some(0))
        .unwrap();
    let blocks = (0..prompt.len() / BS)
        .map(|i| (i, first_dev + i as u32))
        .collect();
    rig.run(
        &step(vec![new_rec(req, prompt, devs, 0, prompt.len())]),
        &[(prompt.to_vec(), blocks)],
    );
    rig.settle();
}

fn key(identity: Option<&str>, cacheable: bool) -> RequestKey {
    RequestKey {
        identity: identity.map(str::to_owned),
        cacheable,
    }
}

/// Pins the per-request identity: two tenants (cache salts), two LoRA adapters or a request with
/// no identity never share a block of an equal prompt; equal identities do.
#[test]
fn requests_with_different_identities_share_nothing() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (500..564).collect(); // 4 full blocks
    store_with_key(&mut rig, "a", &prompt, 0, &key(Some("salt=tenant-a"), true));
    assert_eq!(rig.leader.stats().offload_confirmed, 4);
    let probe = |rig: &mut Rig, id: &str, k: &RequestKey| {
        rig.leader
            .get_num_new_matched_tokens_for(&id.into(), &prompt, 0, k)
            .unwrap()
    };
    assert_eq!(probe(&mut rig, "b", &key(Some("salt=tenant-b"), true)), 0);
    assert_eq!(probe(&mut rig, "c", &key(None, true)), 0);
    assert_eq!(probe(&mut rig, "d", &key(Some("lora=x"), true)), 0);
    // The same identity shares the prefix (the last block is left for the engine to compute).
    assert_eq!(probe(&mut rig, "e", &key(Some("salt=tenant-a"), true)), 48);
}

/// Pins `cacheable = false`: such a request is never matched and none of its blocks is stored.
#[test]
fn uncacheable_requests_are_neither_matched_nor_stored() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (700..764).collect();
    store_with_key(&mut rig, "a", &prompt, 0, &key(None, false));
    let s = rig.leader.stats();
    assert_eq!((s.offload_blocks, s.uncacheable_requests), (0, 1), "{s:?}");
    store_with_key(&mut rig, "b", &prompt, 8, &key(None, true));
    assert_eq!(rig.leader.stats().offload_confirmed, 4);
    // Even with the blocks in the tier, an uncacheable request is offered nothing.
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens_for(&"c".into(), &prompt, 0, &key(None, false))
            .unwrap(),
        0
    );
}

/// A request's identity is fixed by its first match: changing it is an error, not a silent
/// re-key of blocks already hashed.
#[test]
fn a_request_identity_cannot_change() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (0..40).collect();
    let r: RequestId = "a".into();
    rig.leader
        .get_num_new_matched_tokens_for(&r, &prompt, 0, &key(Some("salt=1"), true))
        .unwrap();
    let err = rig
        .leader
        .get_num_new_matched_tokens_for(&r, &prompt, 0, &key(Some("salt=2"), true))
        .unwrap_err();
    assert!(matches!(err, ConnectorError::InvalidInput { .. }), "{err}");
    assert!(rig
        .leader
        .get_num_new_matched_tokens_for(&r, &prompt, 0, &key(Some("salt=1"), false))
        .is_err());
    assert!(rig
        .leader
        .get_num_new_matched_tokens_for(&r, &prompt, 0, &key(Some("salt=1"), true))
        .is_ok());
}

#[test]
fn waiting_for_preempted_requests_waits_for_their_jobs_only() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    rig.ranks[0].faulty.hold();
    let pa: Vec<u32> = (0..40).collect();
    let pb: Vec<u32> = (100..140).collect();
    let (a, b): (RequestId, RequestId) = ("a".into(), "b".into());
    rig.leader
        .update_state_after_alloc(&a, &ids(0..3), Some(0))
        .unwrap();
    rig.leader
        .update_state_after_alloc(&b, &ids(3..6), Some(0))
        .unwrap();
    rig.run(
        &step(vec![
            new_rec("a", &pa, ids(0..3), 0, 40),
            new_rec("b", &pb, ids(3..6), 0, 40),
        ]),
        &[
            (pa.clone(), vec![(0, 0), (1, 1)]),
            (pb.clone(), vec![(0, 3), (1, 4)]),
        ],
    );
    let in_flight = rig.ranks[0].worker.jobs_in_flight();
    assert!(
        in_flight >= 2,
        "both requests' stores are held ({in_flight})"
    );
    // A request with no jobs: returns at once although other stores are stuck (wait_idle would block).
    let t = std::time::Instant::now();
    rig.ranks[0].worker.wait_for_requests(&["c".into()]);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(rig.ranks[0].worker.jobs_in_flight(), in_flight);
    // a's stores: returns only once they ran.
    let faulty = rig.ranks[0].faulty.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        faulty.release();
    });
    let t = std::time::Instant::now();
    rig.ranks[0]
        .worker
        .wait_for_requests(std::slice::from_ref(&a));
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(150),
        "returned before a's stores ran"
    );
    releaser.join().unwrap();
    rig.settle();
    assert_eq!(rig.leader.stats().offload_confirmed, 4);
}
