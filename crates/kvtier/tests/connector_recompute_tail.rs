//! Issue 27 ("a short hit must not cost extra scheduler steps"): with `sync_host_loads`, a hit
//! whose first blocks lie in the host tier and whose last few lie only on disk offers just the
//! host prefix, loaded inside the step (`Leader::set_recompute_tail`), so the engine recomputes
//! the few disk blocks in that step instead of waiting for an asynchronous load of everything.
//! A longer disk tail, a hit that starts on disk, or the rule turned off keep the whole hit,
//! asynchronously. Bytes are checked, not just counts (the rig: connector_rig/mod.rs).
#![allow(clippy::unwrap_used)]
mod connector_rig;

use connector_rig::*;

/// A rig whose host tier holds 6 blocks, written through to a disk tier, with asynchronous
/// loads, `sync_host_loads` and `recompute_tail` = `tail`; p1 (6 full blocks) was prefilled,
/// then p2, which shares p1's first 3 blocks and adds 3 of its own, evicted p1's last 3 blocks
/// from the host tier (they stay on disk).
fn mixed_rig(tail: usize, p1: &[u32]) -> Rig {
    let mut cfg = LeaderConfig::new(BS, SALT, 6);
    cfg.async_loads = true;
    cfg.disk = Capacity::Blocks(32);
    cfg.disk_policy = DiskPolicy::WriteThrough;
    let mut rig = Rig::new(cfg, &[BPB], None);
    rig.leader.set_sync_host_loads(true);
    rig.leader.set_recompute_tail(tail);
    prefill(&mut rig, "a", p1, 0);
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    let mut p2: Vec<u32> = p1[..3 * BS].to_vec();
    p2.extend(9000..9052);
    // p2's shared prefix is a host hit, loaded in the step; its own 3 blocks are computed.
    let b: RequestId = "b".into();
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&b, &p2, 0).unwrap(),
        48
    );
    rig.leader
        .update_state_after_alloc(&b, &ids(10..17), None)
        .unwrap();
    let computed: Vec<(usize, u32)> = (3..6).map(|i| (i, 10 + i as u32)).collect();
    rig.run(
        &step(vec![new_rec("b", &p2, ids(10..17), 48, 52)]),
        &[(p2.clone(), computed)],
    );
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    rig
}

/// The source tiers of request `r`'s load, as planned for the engine.
fn load_tiers(rig: &mut Rig, r: &str, prompt: &[u32], dev: u32) -> (Vec<Tier>, bool) {
    let nb = prompt.len().div_ceil(BS) as u32;
    rig.leader
        .update_state_after_alloc(&r.into(), &ids(dev..dev + nb), None)
        .unwrap();
    let meta = rig.run(
        &step(vec![new_rec(r, prompt, ids(dev..dev + nb), 0, 4)]),
        &[],
    );
    let tiers = meta.loads[0].jobs.iter().map(|j| j.src_tier()).collect();
    (tiers, meta.loads[0].sync)
}

#[test]
fn a_host_prefix_with_a_short_disk_tail_loads_in_the_step() {
    let p1: Vec<u32> = (0..100).collect();
    // Off (the default for every engine but vLLM): the whole 6-block hit, asynchronously.
    let mut rig = mixed_rig(0, &p1);
    let r: RequestId = "r".into();
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&r, &p1, 0).unwrap(),
        96
    );
    assert!(rig.leader.load_is_async(&r));
    let (tiers, sync) = load_tiers(&mut rig, "r", &p1, 30);
    assert!(
        tiers.contains(&Tier::Disk) && tiers.contains(&Tier::Host),
        "{tiers:?}"
    );
    assert!(!sync);
    rig.settle();
    rig.assert_device_kv(30, &p1, 6, "whole hit, asynchronously");

    // A tail of 3 disk blocks, 3 allowed: the host prefix alone, in the step.
    let mut rig = mixed_rig(3, &p1);
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&r, &p1, 0).unwrap(),
        48
    );
    assert!(
        !rig.leader.load_is_async(&r),
        "the prefix loads in the step"
    );
    let (tiers, sync) = load_tiers(&mut rig, "r", &p1, 30);
    assert_eq!(tiers, vec![Tier::Host]);
    assert!(sync, "planned as answered");
    rig.settle();
    rig.assert_device_kv(30, &p1, 3, "the host prefix");

    // 2 allowed: the tail is too long to recompute; the whole hit, asynchronously.
    let mut rig = mixed_rig(2, &p1);
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&r, &p1, 0).unwrap(),
        96
    );
    assert!(rig.leader.load_is_async(&r));
}

#[test]
fn a_hit_that_starts_on_disk_or_lies_wholly_on_disk_stays_whole_and_asynchronous() {
    let p1: Vec<u32> = (0..100).collect();
    let mut rig = mixed_rig(8, &p1);
    // p1's first 3 blocks go too (another 6-block prompt evicts every host block).
    let p3: Vec<u32> = (20_000..20_100).collect();
    prefill(&mut rig, "c", &p3, 40);
    rig.settle();
    rig.run(&step(vec![]), &[]);
    rig.settle();
    let r: RequestId = "r".into();
    assert_eq!(
        rig.leader.get_num_new_matched_tokens(&r, &p1, 0).unwrap(),
        96
    );
    assert!(
        rig.leader.load_is_async(&r),
        "no host prefix: nothing to load in the step"
    );
    let (tiers, sync) = load_tiers(&mut rig, "r", &p1, 50);
    assert_eq!(tiers, vec![Tier::Disk]);
    assert!(!sync);
    rig.settle();
    rig.assert_device_kv(50, &p1, 6, "from disk");
}
