//! End-to-end connector flows on host memory: leader + workers + `MemoryTransfer`, checking
//! bytes, not just counters (the rig: connector_rig/mod.rs).
#![allow(clippy::unwrap_used)]
mod connector_rig;

use connector_rig::*;
use kvtier::transfer::Blocks;

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
    rig.assert_device_kv(20, &prompt, 6, "onboarded");
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
    assert_eq!(meta.loads[0].jobs[0].src_tier(), Tier::Disk);
    rig.settle();
    rig.assert_device_kv(40, &p1, 6, "onboarded from disk");
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
    assert_eq!(meta.loads[0].jobs[0].src_tier(), Tier::Remote);
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
    assert_eq!(meta.stores[0].job.len(), 1);
    assert_eq!(
        meta.stores[0].job.src(),
        &Blocks::Device(vec![DeviceBlockId(1)])
    );
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

/// Issue 27: a prefix the engine reuses counts as a sighting whichever tier serves it. A prefix
/// vLLM keeps hitting in its own cache (G1) is never offloaded again, so without this it was
/// never "seen twice" and never reached the disk (the disk tier then held almost nothing).
#[test]
fn disk_filter_counts_a_reuse_from_any_tier() {
    let mut cfg = LeaderConfig::new(BS, SALT, 32);
    cfg.disk = Capacity::Blocks(32);
    cfg.disk_policy = DiskPolicy::filtered();
    let mut rig = Rig::new(cfg, &[BPB], None);
    let p1: Vec<u32> = (0..64).collect();
    prefill(&mut rig, "a", &p1, 0);
    rig.settle();
    assert_eq!(rig.leader.stats().disk_registered, 0, "seen once");
    // The engine's own cache holds the first two blocks: kvtier supplies blocks 2..3 (the last
    // block holds the last token, which the engine computes).
    let mut longer = p1.clone();
    longer.extend(100..116);
    let b: RequestId = "b".into();
    let got = rig
        .leader
        .get_num_new_matched_tokens(&b, &longer, 32)
        .unwrap();
    assert_eq!(got, 32);
    rig.leader
        .update_state_after_alloc(&b, &ids(0..5), Some(32))
        .unwrap();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    let s = rig.leader.stats();
    assert_eq!(
        s.disk_registered, 4,
        "two blocks hit in G1 and two loaded from G2 are each a second sighting: {s:?}"
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
        .flat_map(|s| s.job.pairs().map(|(src, _)| src.number().unwrap()))
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

/// Issue 27: with asynchronous loads and `sync_host_loads`, a hit held wholly by the host tier is
/// loaded inside the step (the engine is told "not async" at the match and the load is planned
/// sync), while a hit that needs the disk stays asynchronous; without the flag every load is
/// asynchronous. The engine's answer and the plan agree in each case.
#[test]
fn host_hits_load_in_the_step_disk_hits_asynchronously() {
    for flag in [false, true] {
        let mut cfg = LeaderConfig::new(BS, SALT, 6);
        cfg.async_loads = true;
        cfg.disk = Capacity::Blocks(32);
        cfg.disk_policy = DiskPolicy::WriteThrough;
        let mut rig = Rig::new(cfg, &[BPB], None);
        rig.leader.set_sync_host_loads(flag);
        let p1: Vec<u32> = (0..100).collect();
        prefill(&mut rig, "a", &p1, 0);
        rig.settle();
        rig.run(&step(vec![]), &[]);
        rig.settle();
        // A host hit: p1's blocks are in the 6-block host tier.
        let h: RequestId = "h".into();
        assert_eq!(
            rig.leader.get_num_new_matched_tokens(&h, &p1, 0).unwrap(),
            96
        );
        assert_eq!(rig.leader.load_is_async(&h), !flag, "host hit, flag {flag}");
        rig.leader
            .update_state_after_alloc(&h, &ids(20..27), None)
            .unwrap();
        let meta = rig.run(&step(vec![new_rec("h", &p1, ids(20..27), 0, 4)]), &[]);
        assert_eq!(meta.loads[0].jobs[0].src_tier(), Tier::Host);
        assert_eq!(meta.loads[0].sync, flag, "planned as answered");
        rig.settle();
        rig.assert_device_kv(20, &p1, 6, "onboarded from host");
        // A disk hit: p1 evicted from the host tier by p2.
        let p2: Vec<u32> = (7000..7100).collect();
        prefill(&mut rig, "b", &p2, 10);
        rig.settle();
        let c: RequestId = "c".into();
        assert_eq!(
            rig.leader.get_num_new_matched_tokens(&c, &p1, 0).unwrap(),
            96
        );
        assert!(
            rig.leader.load_is_async(&c),
            "a disk hit stays asynchronous"
        );
        rig.leader
            .update_state_after_alloc(&c, &ids(40..47), None)
            .unwrap();
        let meta = rig.run(&step(vec![new_rec("c", &p1, ids(40..47), 0, 4)]), &[]);
        assert_eq!(meta.loads[0].jobs[0].src_tier(), Tier::Disk);
        assert!(!meta.loads[0].sync);
        rig.settle();
        rig.assert_device_kv(40, &p1, 6, "onboarded from disk");
    }
}

/// Issue 26: with the node tier as the remote store (`set_near_remote`, set by the composition
/// root for `node://`), a hit held by the remote tier loads inside the step like a host hit;
/// another remote store (Redis, a shared directory) keeps it asynchronous. The engine's answer
/// and the plan agree, and the loaded KV is the prefill's.
#[test]
fn node_hits_load_in_the_step_like_host_hits() {
    for near in [false, true] {
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
        // Another engine on the machine: its host tier is empty, the node holds the prefix.
        let mut cfg = LeaderConfig::new(BS, SALT, 32);
        cfg.async_loads = true;
        cfg.remote = Some(remote.clone());
        let mut rig = Rig::new(cfg, &[BPB], Some(remote));
        rig.leader.set_sync_host_loads(true);
        rig.leader.set_near_remote(near);
        let r: RequestId = "r".into();
        assert_eq!(
            rig.leader
                .get_num_new_matched_tokens(&r, &prompt, 0)
                .unwrap(),
            96
        );
        assert_eq!(rig.leader.load_is_async(&r), !near, "near {near}");
        rig.leader
            .update_state_after_alloc(&r, &ids(8..15), None)
            .unwrap();
        let meta = rig.run(&step(vec![new_rec("r", &prompt, ids(8..15), 0, 4)]), &[]);
        assert_eq!(meta.loads[0].jobs[0].src_tier(), Tier::Remote);
        assert_eq!(meta.loads[0].sync, near, "planned as answered");
        rig.settle();
        rig.assert_device_kv(8, &prompt, 6, "onboarded from the node");
    }
}
