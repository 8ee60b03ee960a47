//! Sliding-window groups and the join of several groups (`window`, `connector::groups`): what
//! is stored, matched, loaded and fenced, as vLLM's hybrid KV cache manager hands it out.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::connector::groups::match_groups;
use crate::connector::messages::StepMetadata;
use crate::connector::step::{SchedulerStep, StepRecord};
use crate::hash::HashSalt;
use crate::ids::{DeviceBlockId, RequestId};
use crate::transfer::TransferOutcome;

const NULL: DeviceBlockId = DeviceBlockId(0);

fn ids(v: &[u32]) -> Vec<DeviceBlockId> {
    v.iter().copied().map(DeviceBlockId).collect()
}

/// A leader of 4-token blocks; `window`: a sliding-window group of that many tokens.
fn leader(salt: u64, window: Option<usize>) -> Leader {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(salt), 64)).unwrap();
    l.set_window(window, Some(NULL));
    l
}

fn step(l: &mut Leader, rec: StepRecord, finished: &[&str]) -> StepMetadata {
    l.build_step(&SchedulerStep {
        records: vec![rec],
        finished: finished.iter().map(|f| (*f).into()).collect(),
    })
    .unwrap()
}

fn confirm(l: &mut Leader, m: &StepMetadata) {
    for s in &m.stores {
        l.apply_report(WorkerReport {
            rank: 0,
            job: s.job.id,
            outcome: TransferOutcome::Ok,
        });
    }
}

fn rec(id: &str, tokens: Vec<u32>, blocks: &[u32], computed: usize, new: bool) -> StepRecord {
    StepRecord {
        request_id: id.into(),
        num_scheduled_tokens: tokens.len() - if new { computed } else { 0 },
        new_tokens: tokens,
        new_block_ids: ids(blocks),
        num_computed_tokens: computed,
        is_new: new,
        ..Default::default()
    }
}

fn store_srcs(m: &StepMetadata) -> Vec<u32> {
    m.stores
        .iter()
        .flat_map(|s| s.job.pairs().filter_map(|(src, _)| src.number()))
        .collect()
}

/// A 24-token request "fill" (blocks 1..=6) computed and finished in one step, its stores confirmed.
fn filled(l: &mut Leader) -> StepMetadata {
    let m = step(
        l,
        rec("fill", (0..24).collect(), &[1, 2, 3, 4, 5, 6], 0, true),
        &["fill"],
    );
    confirm(l, &m);
    m
}

#[test]
fn a_window_group_stores_and_loads_only_the_window_of_the_hits_end() {
    let mut l = leader(3, Some(8));
    // Window 8 of 4-token blocks: a replay of the prompt ends at block 5 or 6, whose windows
    // start at block 3 ((20 + 1 - 8) / 4) and 4: blocks 0..3 are never stored.
    assert_eq!(store_srcs(&filled(&mut l)), vec![4, 5, 6]);
    let r: RequestId = "r".into();
    let mut prompt: Vec<u32> = (0..24).collect();
    prompt.push(99);
    // Blocks 4 and 5 are the window of a hit ending at block 6: 24 tokens.
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 24);
    // vLLM's table: its null block before the window ((24 + 1 - 8) / 4 = 4 blocks), then blocks.
    let table = ids(&[0, 0, 0, 0, 30, 31, 32]);
    l.update_state_after_alloc(&r, &table, Some(24)).unwrap();
    let m = step(
        &mut l,
        rec("r", prompt, &[0, 0, 0, 0, 30, 31, 32], 24, true),
        &[],
    );
    let dst: Vec<u32> = m
        .loads
        .iter()
        .flat_map(|x| {
            x.jobs
                .iter()
                .flat_map(|j| j.pairs().filter_map(|(_, d)| d.number()))
        })
        .collect();
    assert_eq!(dst, vec![30, 31]);
    // The full-attention leader would have found nothing at block 0.
    let mut full = leader(3, None);
    filled(&mut full);
    assert_eq!(full.stats().offload_blocks, 6);
}

#[test]
fn a_hit_is_claimed_only_when_every_group_supplies_its_part() {
    let mut full = leader(3, None);
    let mut win = leader(4, Some(8));
    filled(&mut full);
    filled(&mut win);
    let mut prompt: Vec<u32> = (0..24).collect();
    prompt.push(99);
    let mut both = [&mut full, &mut win];
    assert_eq!(
        match_groups(&mut both, &"a".into(), &prompt, 0, &RequestKey::default()).unwrap(),
        24
    );
    // The exact prompt: its last block is never offered; the window of block 5 is stored.
    let exact: Vec<u32> = (0..24).collect();
    assert_eq!(
        match_groups(&mut both, &"b".into(), &exact, 0, &RequestKey::default()).unwrap(),
        20
    );
    // Diverging after 16 tokens: the full group holds 4 blocks, the window group not the window
    // of any end up to block 4 (blocks 2 and 3, 1 and 2, ...): a miss in every group.
    let half: Vec<u32> = (0..16).chain(500..509).collect();
    let c: RequestId = "c".into();
    assert_eq!(
        match_groups(&mut both, &c, &half, 0, &RequestKey::default()).unwrap(),
        0
    );
    assert_eq!(
        full.slot(&c).unwrap().last_match().unwrap().external_tokens,
        0
    );
    assert_eq!(full.stats().matched_tokens, 24 + 20);
}

#[test]
fn blocks_the_window_left_are_forgotten_and_fenced_while_stores_read_them() {
    let mut l = leader(3, Some(8));
    let d: RequestId = "d".into();
    // Two blocks computed: both inside the window, both stored (in flight, not confirmed).
    let m = step(&mut l, rec("d", (0..8).collect(), &[1, 2], 0, true), &[]);
    assert_eq!(store_srcs(&m), vec![1, 2]);
    let m = step(&mut l, rec("d", (8..12).collect(), &[3], 8, false), &[]);
    assert!(m.fence.is_empty());
    // At 12 computed tokens the window starts at block 1: vLLM freed block 0 (device 1) and
    // hands it back to "d" for block 3. The step waits for d's stores, and block 3 is device 1.
    let m = step(&mut l, rec("d", (12..16).collect(), &[1], 12, false), &[]);
    assert_eq!(m.fence, vec![d.clone()]);
    assert_eq!(store_srcs(&m), vec![1]);
    assert_eq!(l.slot(&d).unwrap().device_table().len(), 4);
}

/// TensorRT-LLM's VSWA names a page the window left by `-1` (`BAD_PAGE_INDEX`, passed as
/// [`crate::connector::slot::HOLE`]): a leader whose null block is that hole takes it as a hole,
/// while any other id beyond the engine's table stays refused, and a leader without that null
/// block refuses the hole like any out-of-range id.
#[test]
fn the_hole_is_accepted_only_as_the_engines_null_block() {
    let hole = crate::connector::slot::HOLE;
    let make = |null: Option<DeviceBlockId>| {
        let mut cfg = LeaderConfig::new(4, HashSalt(5), 64);
        cfg.layout = Some(crate::connector::messages::ClusterLayout {
            block_size: 4,
            num_device_blocks: 16,
            bytes_per_block: vec![64],
        });
        let mut l = Leader::new(cfg).unwrap();
        l.set_window(Some(8), null);
        l
    };
    let r: RequestId = "r".into();
    let with_hole = make(Some(hole));
    assert!(with_hole
        .check_device_ids(&r, "new_block_ids", &[hole, DeviceBlockId(3)])
        .is_ok());
    assert!(with_hole
        .check_device_ids(&r, "new_block_ids", &[DeviceBlockId(16)])
        .is_err());
    let plain = make(Some(NULL));
    assert!(plain
        .check_device_ids(&r, "new_block_ids", &[hole])
        .is_err());
}

/// A leader with asynchronous loads that loads host-tier hits in the step (vLLM's default),
/// holding `host` host blocks and `disk` disk blocks (with no host tier, stores go to disk).
fn loading_leader(salt: u64, window: Option<usize>, host: usize, disk: usize) -> Leader {
    let mut cfg = LeaderConfig::new(4, HashSalt(salt), host);
    cfg.disk = config::Capacity::Blocks(disk);
    cfg.async_loads = true;
    let mut l = Leader::new(cfg).unwrap();
    l.set_window(window, Some(NULL));
    l.set_sync_host_loads(true);
    l
}

/// Every group loads a hit the same way (vLLM takes one answer per request): in the step only
/// when every group's part lies in the host tier alone; one group's part on disk makes every
/// group's load asynchronous (vLLM recomputes a hybrid model's failed load only while it waits).
#[test]
fn every_group_loads_a_hit_alike_in_the_step_only_from_the_host_tier() {
    let mut prompt: Vec<u32> = (0..24).collect();
    prompt.push(99);
    for disk_window in [false, true] {
        let mut full = loading_leader(3, None, 64, 0);
        let mut win = if disk_window {
            loading_leader(4, Some(8), 0, 64)
        } else {
            loading_leader(4, Some(8), 64, 0)
        };
        filled(&mut full);
        filled(&mut win);
        let r: RequestId = "r".into();
        let mut both = [&mut full, &mut win];
        assert_eq!(
            match_groups(&mut both, &r, &prompt, 0, &RequestKey::default()).unwrap(),
            24
        );
        assert_eq!(
            full.load_is_async(&r),
            disk_window,
            "disk part: {disk_window}"
        );
        assert_eq!(
            win.load_is_async(&r),
            disk_window,
            "disk part: {disk_window}"
        );
        // Alone, the full group's host-tier hit loads in the step.
        let solo: RequestId = "solo".into();
        assert_eq!(
            full.get_num_new_matched_tokens(&solo, &prompt, 0).unwrap(),
            24
        );
        assert!(!full.load_is_async(&solo));
    }
}
