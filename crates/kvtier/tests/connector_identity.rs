//! Request identity end to end (leader + worker on `MemoryTransfer`): requests with different
//! identities (model, adapter, tenant salt) share no block, uncacheable requests are neither matched
//! nor stored, a request's identity cannot change; and a preemption waits only for the preempted
//! requests' jobs. The rig: connector_rig/mod.rs.
#![allow(clippy::unwrap_used)]
mod connector_rig;

use connector_rig::*;

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
        read: true,
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
