//! Fenced block reuse (`Leader::request_finished_fenced`): a finished request whose stores are
//! still in flight gives its device blocks back at once, and the step that hands one of them to
//! another request makes the workers wait for those stores before anything writes the block.
//! The engine modelled is vLLM's: it frees a finished request's blocks when `request_finished`
//! says False (vllm/v1/core/sched/scheduler.py `_free_request`), may allocate them to the next
//! request in the very next schedule, and calls the connector's `handle_preemptions` before the
//! step writes any block (vllm/v1/worker/gpu_model_runner.py `execute_model`). The rig's
//! transfer is held, so the stores are still in flight when the next request reuses the blocks.
#![allow(clippy::unwrap_used)]
mod connector_rig;

use std::time::{Duration, Instant};

use connector_rig::*;
use kvtier::connector::BlockReuse;

/// `req` arrives with `all_tokens`: kvtier matches `want` tokens, then vLLM allocates `blocks`.
fn match_and_alloc(
    rig: &mut Rig,
    req: &RequestId,
    all_tokens: &[u32],
    want: usize,
    blocks: &[DeviceBlockId],
    external: Option<usize>,
) {
    assert_eq!(
        rig.leader
            .get_num_new_matched_tokens(req, all_tokens, 0)
            .unwrap(),
        want
    );
    rig.leader
        .update_state_after_alloc(req, blocks, external)
        .unwrap();
}

/// Request "a" computes `prompt` into device blocks 0..n with its stores held in flight, then
/// finishes through the fenced call.
fn finish_a_with_stores_held(rig: &mut Rig, prompt: &[u32]) -> RequestId {
    let a: RequestId = "a".into();
    let nb = prompt.len().div_ceil(BS) as u32;
    match_and_alloc(rig, &a, prompt, 0, &ids(0..nb), Some(0));
    rig.ranks[0].faulty.hold();
    let full: Vec<(usize, u32)> = (0..prompt.len() / BS).map(|i| (i, i as u32)).collect();
    rig.run(
        &step(vec![new_rec("a", prompt, ids(0..nb), 0, prompt.len())]),
        &[(prompt.to_vec(), full)],
    );
    a
}

#[test]
fn a_reused_block_waits_for_the_store_that_reads_it() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (500..580).collect(); // 5 full blocks
    let a = finish_a_with_stores_held(&mut rig, &prompt);
    let reuse = rig.leader.request_finished_fenced(&a).unwrap();
    assert_eq!(reuse, BlockReuse::Fenced);
    assert!(!reuse.must_wait(), "vLLM frees the blocks now");
    assert_eq!(rig.leader.fenced_blocks(), 5);

    // The next request gets a's blocks 0..5 (fresh allocations: nothing computed yet).
    let other: Vec<u32> = (9000..9080).collect();
    let b: RequestId = "b".into();
    match_and_alloc(&mut rig, &b, &other, 0, &ids(0..5), Some(0));
    let meta = rig
        .leader
        .build_step(&step(vec![new_rec("b", &other, ids(0..5), 0, 80)]))
        .unwrap();
    assert_eq!(meta.fence, vec![a.clone()]);
    assert!(meta.saving.is_empty(), "a is never reported saved");

    // The worker's step (bind; the vLLM adapter waits earlier, in handle_preemptions, through
    // `wait_for_requests`) must not return before the held store read the blocks; only then
    // may the forward pass overwrite them.
    let faulty = rig.ranks[0].faulty.clone();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        faulty.release();
    });
    let t = Instant::now();
    let m = StepMetadata::from_bytes(&meta.to_bytes().unwrap()).unwrap();
    rig.ranks[0].worker.bind(&m);
    let waited = t.elapsed();
    // The forward pass: b's KV overwrites the blocks (at once, whatever the worker did).
    for i in 0..5u32 {
        rig.ranks[0]
            .mem
            .write_block(Tier::Device, i, &kv_bytes(&other, i as usize, 0, BPB))
            .unwrap();
    }
    rig.ranks[0].worker.start_load(None);
    rig.ranks[0].worker.forward_done(None);
    releaser.join().unwrap();
    rig.settle();
    rig.leader.build_step(&step(vec![])).unwrap();
    assert_eq!(rig.leader.fenced_blocks(), 0, "a's stores are confirmed");

    // a's prompt again: its blocks come from the host tier, bit-exact a's KV (not b's).
    let c: RequestId = "c".into();
    match_and_alloc(&mut rig, &c, &prompt, 64, &ids(30..35), None);
    rig.run(&step(vec![new_rec("c", &prompt, ids(30..35), 0, 16)]), &[]);
    rig.settle();
    rig.assert_device_kv(30, &prompt, 4, "a's KV, as stored");
    assert!(
        waited >= Duration::from_millis(250),
        "the step went on after {waited:?}, before a's stores read its blocks"
    );
}

#[test]
fn only_the_blocks_a_step_writes_are_fenced() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (500..580).collect();
    let a = finish_a_with_stores_held(&mut rig, &prompt);
    assert_eq!(
        rig.leader.request_finished_fenced(&a).unwrap(),
        BlockReuse::Fenced
    );
    // A new request whose first 3 blocks are engine prefix-cache hits on a's blocks 0..3 (read
    // only) and whose fresh blocks are others: no fence.
    let mut hit = prompt[..48].to_vec();
    hit.extend(7000..7040);
    let meta = rig
        .leader
        .build_step(&step(vec![new_rec(
            "d",
            &hit,
            ids(0..3).into_iter().chain(ids(40..43)).collect(),
            48,
            40,
        )]))
        .unwrap();
    assert!(meta.fence.is_empty(), "{:?}", meta.fence);
    // A running request that grows into a's block 4: fenced.
    let meta = rig
        .leader
        .build_step(&step(vec![cont("d", &[1, 2, 3], ids(4..5), 88, 3)]))
        .unwrap();
    assert_eq!(meta.fence, vec![a.clone()]);
    rig.ranks[0].faulty.release();
    rig.settle();
}

#[test]
fn unfenced_finish_and_in_flight_loads_still_hold_the_blocks() {
    let mut rig = Rig::new(LeaderConfig::new(BS, SALT, 32), &[BPB], None);
    let prompt: Vec<u32> = (500..580).collect();
    let a = finish_a_with_stores_held(&mut rig, &prompt);
    // The plain call (TensorRT-LLM, the reference engine): the blocks stay until saved.
    assert_eq!(
        rig.leader.request_finished(&a).unwrap(),
        BlockReuse::AfterSaved
    );
    assert_eq!(rig.leader.fenced_blocks(), 0);
    rig.ranks[0].faulty.release();
    rig.settle();

    // A request whose load is in flight: a cancelled load may land late, so it is held even
    // through the fenced call.
    let r: RequestId = "r".into();
    match_and_alloc(&mut rig, &r, &prompt, 64, &ids(20..25), None);
    rig.ranks[0].faulty.hold();
    let meta = rig.leader.build_step(&step(vec![])).unwrap();
    assert_eq!(meta.loads.len(), 1);
    rig.ranks[0].worker.bind(&meta);
    rig.ranks[0].worker.start_load(None);
    assert_eq!(
        rig.leader.request_finished_fenced(&r).unwrap(),
        BlockReuse::AfterSaved
    );
    rig.ranks[0].faulty.release();
    rig.settle();
}
