//! Unit tests of the leader's books that need its private state; the behaviour seen from
//! outside is tested in `tests/connector_flow.rs` and `tests/connector_props.rs`.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use super::*;
use crate::connector::messages::StepMetadata;
use crate::connector::step::{SchedulerStep, StepRecord};
use crate::hash::HashSalt;
use crate::ids::{BlockId, DeviceBlockId, RequestId, Tier};
use crate::transfer::{Blocks, DiskBlock, TransferJob, TransferOutcome};

fn confirm_all(l: &mut Leader, m: &StepMetadata) {
    let jobs = m
        .stores
        .iter()
        .map(|s| s.job.id)
        .chain(m.background.iter().map(|j| j.id));
    for job in jobs.collect::<Vec<_>>() {
        l.apply_report(WorkerReport {
            rank: 0,
            job,
            outcome: TransferOutcome::Ok,
        });
    }
}

/// One step of the single record `rec`, nothing finished.
fn run_step(l: &mut Leader, rec: StepRecord) -> StepMetadata {
    l.build_step(&SchedulerStep {
        records: vec![rec],
        finished: vec![],
    })
    .unwrap()
}

fn new_record(id: &str, tokens: Vec<u32>, first_block: u32) -> StepRecord {
    let blocks = (tokens.len() / 4) as u32;
    StepRecord {
        request_id: id.into(),
        num_scheduled_tokens: tokens.len(),
        new_tokens: tokens,
        new_block_ids: (first_block..first_block + blocks)
            .map(DeviceBlockId)
            .collect(),
        is_new: true,
        ..Default::default()
    }
}

/// Stores the full blocks of `tokens` (a finished request `id`) in the host tier, confirmed.
fn stored(l: &mut Leader, id: &str, tokens: Vec<u32>, first_block: u32) {
    let m = l
        .build_step(&SchedulerStep {
            records: vec![new_record(id, tokens, first_block)],
            finished: vec![id.into()],
        })
        .unwrap();
    confirm_all(l, &m);
}

/// A request matched again after its allocation, before it ever ran, was restarted by the
/// engine (vLLM: an asynchronous load failed at its first block): it is recomputed from then
/// on, as is a request whose allocation with external tokens was refused.
#[test]
fn restarted_or_refused_requests_are_recomputed() {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 16)).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    stored(&mut l, "fill", prompt.clone(), 0);
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();

    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
    // Matched again before any record: restarted; nothing external from now on.
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 0);
    assert_eq!(l.stats().load_restarts, 1);
    assert!(l.slot(&r).unwrap().device_table().is_empty());
    l.update_state_after_alloc(&r, &devs, Some(0)).unwrap();
    let mut rec = new_record("r", prompt.clone(), 20);
    rec.num_scheduled_tokens = 12;
    run_step(&mut l, rec);

    let q: RequestId = "q".into();
    assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 0).unwrap(), 8);
    // 6 is not a whole number of blocks: refused, and never offered again.
    assert!(l.update_state_after_alloc(&q, &devs, Some(6)).is_err());
    assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 0).unwrap(), 0);
    // A request allocated with external tokens it was never matched for is refused too.
    let u: RequestId = "u".into();
    assert!(l.update_state_after_alloc(&u, &devs, Some(4)).is_err());
    assert_eq!(l.get_num_new_matched_tokens(&u, &prompt, 0).unwrap(), 0);
    assert_eq!(l.stats().load_restarts, 1);
}

/// Request "a" stores two blocks and every rank confirms them; returns the next metadata,
/// which carries the background jobs (spills, remote puts) those confirmations planned.
fn two_blocks_confirmed(l: &mut Leader) -> StepMetadata {
    let m = run_step(l, new_record("a", (0..8).collect(), 0));
    confirm_all(l, &m);
    l.build_step(&SchedulerStep::default()).unwrap()
}

/// Report the first of two background jobs written, the second failed.
fn one_written_one_failed(l: &mut Leader, m: &StepMetadata) {
    l.apply_report(WorkerReport {
        rank: 0,
        job: m.background[0].id,
        outcome: TransferOutcome::Ok,
    });
    l.apply_report(WorkerReport {
        rank: 0,
        job: m.background[1].id,
        outcome: TransferOutcome::Failed(vec![crate::transfer::BlockFailure {
            pair_index: 0,
            reason: "write failed".into(),
        }]),
    });
}

/// A spill counts as confirmed only once every rank wrote it (not while in flight, not failed).
#[test]
fn spills_are_confirmed_only_when_written() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
    cfg.disk = Capacity::Blocks(8);
    cfg.disk_policy = DiskPolicy::WriteThrough;
    let mut l = Leader::new(cfg).unwrap();
    let m = two_blocks_confirmed(&mut l);
    assert_eq!(m.background.len(), 2);
    let s = l.stats();
    assert_eq!(
        (s.spill_disk_blocks, s.spill_disk_confirmed),
        (2, 0),
        "in flight"
    );
    one_written_one_failed(&mut l, &m);
    let s = l.stats();
    assert_eq!(
        (
            s.spill_disk_blocks,
            s.spill_disk_confirmed,
            s.spill_disk_failed
        ),
        (2, 1, 1)
    );
    assert_eq!(l.disk_pool().unwrap().num_registered(), 1);
}

/// A spill's disk block is reserved at dispatch as a store's is: its hash is hidden from
/// matching and refuses a second spill while in flight; confirmed when written, freed (and
/// spillable again) when the write failed.
#[test]
fn spills_reserve_their_disk_blocks_and_confirm_them() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
    cfg.disk = Capacity::Blocks(8);
    cfg.disk_policy = DiskPolicy::WriteThrough;
    let mut l = Leader::new(cfg).unwrap();
    let hashes = crate::hash::sequence_hashes(HashSalt(3), &(0..8).collect::<Vec<u32>>(), 4);
    let m = two_blocks_confirmed(&mut l);
    assert_eq!(m.background.len(), 2);
    let disk = l.disk_pool().unwrap();
    assert_eq!((disk.num_reserved(), disk.num_registered()), (2, 0));
    for (j, h) in m.background.iter().zip(&hashes) {
        assert_eq!(disk.lookup(*h), None, "a spill in flight is matchable");
        let Blocks::Disk(d) = j.dst() else {
            panic!("a spill writes disk blocks: {j:?}")
        };
        assert_eq!(Some(d[0].slot), disk.reserved_block(*h), "{j:?}");
    }
    // Seen again while in flight: no second spill of either hash.
    let host_blocks: Vec<BlockId> = hashes
        .iter()
        .map(|h| l.host_pool().unwrap().lookup(*h).unwrap())
        .collect();
    for (b, h) in host_blocks.iter().zip(&hashes) {
        l.plan_spills(*b, *h, false);
    }
    assert!(l.outbox.background.is_empty(), "{:?}", l.outbox.background);
    one_written_one_failed(&mut l, &m);
    let disk = l.disk_pool().unwrap();
    assert_eq!((disk.num_reserved(), disk.num_registered()), (0, 1));
    assert!(
        disk.lookup(hashes[0]).is_some(),
        "the written spill is not matchable"
    );
    assert_eq!(disk.lookup(hashes[1]), None);
    assert_eq!(disk.num_free(), 8, "the failed spill's block was not freed");
    // The failed hash may be spilled again, the written one not.
    l.plan_spills(host_blocks[0], hashes[0], false);
    l.plan_spills(host_blocks[1], hashes[1], false);
    assert_eq!(l.outbox.background.len(), 1);
    assert_eq!(l.stats().spill_disk_blocks, 3);
    assert!(l.disk_pool().unwrap().reserved_block(hashes[1]).is_some());
}

/// A remote put counts as confirmed once every rank reported it, failed pairs excepted.
#[test]
fn remote_puts_are_confirmed_only_when_written() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
    cfg.remote = Some(Arc::new(crate::connector::testing::MemoryRemoteStore::new()));
    cfg.remote_put = true;
    let mut l = Leader::new(cfg).unwrap();
    let m = two_blocks_confirmed(&mut l);
    assert_eq!(m.background.len(), 2);
    assert_eq!(l.stats().remote_put_confirmed, 0, "in flight");
    one_written_one_failed(&mut l, &m);
    let s = l.stats();
    assert_eq!(
        (
            s.remote_put_blocks,
            s.remote_put_confirmed,
            s.remote_put_failed
        ),
        (2, 1, 1)
    );
    assert_eq!(l.host_pool().unwrap().num_pinned(), 0);
}

/// Events come out in order per tier, are handed over once, and a leader nobody takes them
/// from keeps only the newest `MAX_EVENTS`, counting the rest as dropped.
#[test]
fn events_are_ordered_bounded_and_counted() {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 2)).unwrap();
    let step = |l: &mut Leader, i: u32| {
        let tokens: Vec<u32> = (0..4).map(|t| i * 4 + t).collect();
        let rec = new_record(&format!("r{i}"), tokens.clone(), i);
        let m = l
            .build_step(&SchedulerStep {
                records: vec![rec],
                finished: vec![format!("r{i}").as_str().into()],
            })
            .unwrap();
        confirm_all(l, &m);
        crate::hash::sequence_hashes(HashSalt(3), &tokens, 4)[0]
    };
    let h: Vec<SequenceHash> = (0..3).map(|i| step(&mut l, i)).collect();
    let host = Tier::Host;
    assert_eq!(
        l.take_events(),
        vec![
            KvEvent::Stored {
                hash: h[0],
                tier: host
            },
            KvEvent::Stored {
                hash: h[1],
                tier: host
            },
            KvEvent::Removed {
                hash: h[0],
                tier: host
            },
            KvEvent::Stored {
                hash: h[2],
                tier: host
            },
        ]
    );
    assert!(l.take_events().is_empty(), "handed over once");
    // Nobody takes events: two per step (a store and an eviction) pile up to the bound.
    let steps = (MAX_EVENTS / 2 + 10) as u32;
    let mut last = h[2];
    for i in 3..3 + steps {
        last = step(&mut l, i);
    }
    let ev = l.take_events();
    assert_eq!(ev.len(), MAX_EVENTS);
    assert_eq!(
        ev.last(),
        Some(&KvEvent::Stored {
            hash: last,
            tier: host
        })
    );
    assert_eq!(
        l.stats().events_dropped,
        2 * steps as u64 - MAX_EVENTS as u64
    );
    assert!(l.take_events().is_empty());
}

/// Regression: a record's offloads are reserved in order, so a block found in G2 can be evicted
/// to make room for a later block of the same record. It must not then be spilled to disk under
/// its old hash (its host block is being overwritten by the new store).
#[test]
fn a_g2_hit_evicted_by_its_own_batch_is_not_spilled() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 2);
    cfg.disk = Capacity::Blocks(8);
    cfg.disk_policy = DiskPolicy::filtered(); // spill on the second sighting
    let mut l = Leader::new(cfg).unwrap();
    // A stores two blocks (first sighting of each); G2 is then full, A's block 0 the LRU.
    let a: Vec<u32> = (0..8).collect();
    let m = run_step(&mut l, new_record("a", a.clone(), 0));
    assert_eq!(m.stores.len(), 1);
    confirm_all(&mut l, &m);
    let hashes =
        crate::hash::sequence_hashes(HashSalt(3), &[&a[..], &[100, 101, 102, 103]].concat(), 4);
    let host = l.host_pool().unwrap();
    let (blk0, blk1) = (
        host.lookup(hashes[0]).unwrap(),
        host.lookup(hashes[1]).unwrap(),
    );
    assert_eq!(host.eviction_order(), vec![blk0, blk1]);
    // B repeats A's two blocks and adds a third: [hit, hit, new]; the new block evicts blk0.
    let mut b = a.clone();
    b.extend([100, 101, 102, 103]);
    let m = run_step(&mut l, new_record("b", b, 10));
    assert_eq!(m.stores.len(), 1);
    assert_eq!(
        m.stores[0].job,
        TransferJob::from_pairs(m.stores[0].job.id, [(DeviceBlockId(12), blk0)])
    );
    // Only A's block 1, still in G2, is spilled on its second sighting.
    assert_eq!(m.background.len(), 1);
    assert_eq!(m.background[0].dst_tier(), Tier::Disk);
    assert_eq!(m.background[0].src(), &Blocks::Host(vec![blk1]));
    confirm_all(&mut l, &m);
    let disk = l.disk_pool().unwrap();
    assert!(disk.lookup(hashes[1]).is_some());
    assert_eq!(disk.lookup(hashes[0]), None);
    let host = l.host_pool().unwrap();
    assert_eq!(host.lookup(hashes[2]), Some(blk0));
    assert_eq!(host.lookup(hashes[0]), None);
    assert_eq!(host.num_pinned(), 0);
    let s = l.stats();
    assert_eq!((s.offload_deduplicated, s.spill_disk_blocks), (2, 1));
}

/// #14 item 1: blocks the disk tier kept from an earlier run, adopted at start, are hits
/// loaded from disk, and every disk job names each pair's key (its sequence hash) so the
/// disk tier can refuse a slot that holds another block.
#[test]
fn adopted_disk_blocks_are_hits_and_disk_jobs_carry_keys() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
    cfg.disk = Capacity::Blocks(8);
    let mut l = Leader::new(cfg).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    let hashes = crate::hash::sequence_hashes(HashSalt(3), &prompt, 4);
    let adopted = [
        (hashes[0], BlockId(5)),
        (hashes[1], BlockId(2)),
        (hashes[0], BlockId(3)),         // a hash already adopted: skipped
        (SequenceHash(77), BlockId(2)),  // a block already taken: skipped
        (SequenceHash(78), BlockId(99)), // out of range: skipped
    ];
    assert_eq!(l.adopt_disk_blocks(&adopted), 2);
    let disk = l.disk_pool().unwrap();
    assert_eq!(disk.lookup(hashes[1]), Some(BlockId(2)));
    assert_eq!((disk.num_registered(), disk.num_evictable()), (2, 2));
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
    let m = run_step(&mut l, new_record("r", prompt.clone(), 20));
    let load = &m.loads[0].jobs[0];
    assert_eq!(
        load.src(),
        &Blocks::Disk(vec![
            DiskBlock {
                slot: BlockId(5),
                key: hashes[0]
            },
            DiskBlock {
                slot: BlockId(2),
                key: hashes[1]
            }
        ])
    );
    assert_eq!(
        load.dst(),
        &Blocks::Device(vec![DeviceBlockId(20), DeviceBlockId(21)])
    );
    // Free disk blocks are handed out lowest first after the adoption.
    let pins = l.tiers.disk.as_mut().unwrap().allocate(2).unwrap();
    let blocks: Vec<BlockId> = pins.iter().map(|p| p.block()).collect();
    assert_eq!(blocks, vec![BlockId(0), BlockId(1)]);
    for pin in pins {
        l.tiers.release(pin);
    }
}

/// Spills to G3 and device -> disk stores name their keys.
#[test]
fn disk_stores_carry_keys() {
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 0);
    cfg.host = Capacity::Blocks(0);
    cfg.disk = Capacity::Blocks(8);
    let mut l = Leader::new(cfg).unwrap();
    let a: Vec<u32> = (0..8).collect();
    let m = run_step(&mut l, new_record("a", a.clone(), 0));
    let job = &m.stores[0].job;
    let hashes = crate::hash::sequence_hashes(HashSalt(3), &a, 4);
    let Blocks::Disk(written) = job.dst() else {
        panic!("a store to the disk tier writes disk blocks: {job:?}")
    };
    assert_eq!(
        written.iter().map(|b| b.key).collect::<Vec<_>>(),
        vec![hashes[0], hashes[1]]
    );
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 4);
    cfg.disk = Capacity::Blocks(8);
    cfg.disk_policy = DiskPolicy::WriteThrough;
    let mut l = Leader::new(cfg).unwrap();
    let m = two_blocks_confirmed(&mut l);
    let spills: Vec<&TransferJob> = m
        .background
        .iter()
        .filter(|j| j.dst_tier() == Tier::Disk)
        .collect();
    assert_eq!(spills.len(), 2);
    for (j, h) in spills.iter().zip(&hashes) {
        let Blocks::Disk(written) = j.dst() else {
            panic!("a spill writes disk blocks: {j:?}")
        };
        assert_eq!(written.iter().map(|b| b.key).collect::<Vec<_>>(), vec![*h]);
    }
}

/// Regression (#28): a failed load was still counted in `kvtier_hit_tokens_total` (derived from
/// `onboard_<tier>_blocks`, counted when the load was sent). Only pairs every rank loaded count,
/// once the load completed.
#[test]
fn failed_loads_are_not_counted_as_hits() {
    // One rank of 96 bytes per block: the bytes loaded are counted per block actually loaded.
    let mut cfg = LeaderConfig::new(4, HashSalt(3), 16);
    cfg.layout = Some(crate::connector::messages::ClusterLayout {
        block_size: 4,
        num_device_blocks: 64,
        bytes_per_block: vec![96],
    });
    let mut l = Leader::new(cfg).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    stored(&mut l, "fill", prompt.clone(), 0);
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
    let mut rec = new_record("r", prompt.clone(), 20);
    rec.num_scheduled_tokens = 4;
    let m = run_step(&mut l, rec);
    let job = m.loads[0].jobs[0].id;
    assert_eq!(m.loads[0].jobs[0].len(), 2);
    assert_eq!(
        l.stats().onboard_host_blocks,
        0,
        "not counted while in flight"
    );
    l.apply_report(WorkerReport {
        rank: 0,
        job,
        outcome: TransferOutcome::Failed(vec![crate::transfer::BlockFailure {
            pair_index: 1,
            reason: "checksum".into(),
        }]),
    });
    let s = l.stats();
    assert_eq!((s.onboard_host_blocks, s.onboard_failed), (1, 1), "{s:?}");
    assert_eq!(
        (
            s.onboard_host_bytes,
            s.onboard_disk_bytes,
            s.onboard_remote_bytes
        ),
        (96, 0, 0),
        "{s:?}"
    );
}

/// One request "fill" of three blocks (tokens 0..12), stored and confirmed in the host tier.
fn filled_leader() -> (Leader, Vec<u32>) {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 16)).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    stored(&mut l, "fill", prompt.clone(), 0);
    (l, prompt)
}

/// The engine waits for every token it is offered: a match is whole blocks, starts at a block
/// boundary, and leaves at least one prompt token to compute (the adapters offer the leader's
/// answer as it is; vLLM's adapter clipped it before issue 29).
#[test]
fn matches_are_whole_blocks_within_the_prompt() {
    let (mut l, prompt) = filled_leader();
    let mut k = 0;
    for len in 1..=20usize {
        let tokens: Vec<u32> = (0..len as u32).collect();
        for computed in [0, 2, 4, 8] {
            if computed > len {
                continue;
            }
            k += 1;
            let r: RequestId = format!("m{k}").into();
            let n = l.get_num_new_matched_tokens(&r, &tokens, computed).unwrap();
            assert_eq!(n % 4, 0, "len {len} computed {computed}: {n}");
            assert!(
                n == 0 || computed + n < len,
                "len {len} computed {computed}: {n}"
            );
            if computed % 4 != 0 {
                assert_eq!(n, 0, "a match starts at a block boundary");
            }
        }
    }
    let r: RequestId = "whole".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
}

/// vLLM preempts a request without telling the connector before it matches it again: a match
/// of a running request is its preemption (counted once), and the step's `preempted_req_ids`
/// then leave it alone; an unknown request is left alone too.
#[test]
fn a_running_request_matched_again_was_preempted() {
    let (mut l, prompt) = filled_leader();
    let r: RequestId = "r".into();
    let s: RequestId = "s".into();
    let mut rec = new_record("r", prompt.clone(), 20);
    rec.num_scheduled_tokens = 12;
    run_step(&mut l, rec);
    let mut rec = new_record("s", prompt.clone(), 30);
    rec.num_scheduled_tokens = 12;
    run_step(&mut l, rec);
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    assert_eq!(l.stats().preempted_requests, 1);
    assert!(l.slot(&r).unwrap().device_table().is_empty());
    assert!(!l.request_preempted_if_running(&r).unwrap());
    assert!(l.request_preempted_if_running(&s).unwrap());
    assert!(!l.request_preempted_if_running(&s).unwrap());
    assert!(!l.request_preempted_if_running(&"unknown".into()).unwrap());
    assert_eq!(l.stats().preempted_requests, 2);
}

/// An allocation the leader refuses after the engine accepted external tokens: exactly the
/// promised blocks (from the first one the match left to kvtier) are failed loads.
#[test]
fn a_refused_allocation_fails_the_promised_blocks() {
    let (mut l, prompt) = filled_leader();
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    let q: RequestId = "q".into();
    assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 4).unwrap(), 4);
    // 6 is not a whole number of blocks: refused; the block after the engine's prefix fails.
    let a = l.allocate(&q, &devs, 6);
    assert!(a.refused.is_some());
    assert_eq!(a.failed_devices, vec![DeviceBlockId(21)]);
    // Never matched: its two promised blocks fail, from its first block.
    let u: RequestId = "u".into();
    let a = l.allocate(&u, &devs, 8);
    assert!(a.refused.is_some());
    assert_eq!(a.failed_devices, devs[..2].to_vec());
    // More promised than allocated: clipped to the table.
    let w: RequestId = "w".into();
    assert_eq!(
        l.allocate(&w, &devs[..1], 8).failed_devices,
        devs[..1].to_vec()
    );
    let ok: RequestId = "ok".into();
    assert_eq!(l.get_num_new_matched_tokens(&ok, &prompt, 0).unwrap(), 8);
    let a = l.allocate(&ok, &devs, 8);
    assert!(a.refused.is_none() && a.failed_devices.is_empty());
}

/// The engine's per-source hit metrics: the tokens it accepted, split by the tiers the last
/// allocation planned to load from, clipped to what it accepted, asked once.
#[test]
fn hit_sources_follow_the_planned_loads() {
    let (mut l, prompt) = filled_leader();
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    assert!(l.allocate(&r, &devs, 8).refused.is_none());
    assert_eq!(l.take_hit_sources(&r, 4), vec![(Tier::Host, 4)]);
    assert_eq!(l.take_hit_sources(&r, 8), vec![]);
    let s: RequestId = "s".into();
    assert_eq!(l.get_num_new_matched_tokens(&s, &prompt, 0).unwrap(), 8);
    assert!(l.allocate(&s, &devs, 8).refused.is_none());
    assert_eq!(l.take_hit_sources(&s, 8), vec![(Tier::Host, 8)]);
    assert_eq!(l.take_hit_sources(&"unknown".into(), 8), vec![]);
}

/// TensorRT-LLM's KVCacheManagerV2 cuts an offer between matching and allocation
/// (`cancel_load`; trtllm.py kept this rule before issue 29): a tail cut loads the offer up to
/// the cut, a head cut is matched again from its end, a new match forgets the cut, and only an
/// asynchronous offer has a load start.
#[test]
fn cuts_of_an_offer_are_applied_at_allocation() {
    let (mut l, _) = filled_leader();
    l.async_loads = true;
    let prompt: Vec<u32> = (0..16).collect();
    let devs: Vec<DeviceBlockId> = (20..24).map(DeviceBlockId).collect();
    let offer = |l: &mut Leader, id: &str| {
        let r: RequestId = id.into();
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 12);
        r
    };
    let plain = offer(&mut l, "plain");
    assert_eq!(l.allocate_offer(&plain, &devs).unwrap(), Some(0));
    assert_eq!(l.take_hit_sources(&plain, 100), vec![(Tier::Host, 12)]);

    let tail = offer(&mut l, "tail");
    l.cancel_load(&tail, 8, 12).unwrap();
    assert_eq!(l.allocate_offer(&tail, &devs).unwrap(), Some(0));
    assert_eq!(l.take_hit_sources(&tail, 100), vec![(Tier::Host, 8)]);

    let head = offer(&mut l, "head");
    l.cancel_load(&head, 0, 4).unwrap();
    assert_eq!(l.allocate_offer(&head, &devs).unwrap(), Some(4));
    assert_eq!(l.take_hit_sources(&head, 100), vec![(Tier::Host, 8)]);

    let again = offer(&mut l, "again");
    l.cancel_load(&again, 8, 12).unwrap();
    offer(&mut l, "again");
    assert_eq!(l.allocate_offer(&again, &devs).unwrap(), Some(0));
    assert_eq!(l.take_hit_sources(&again, 100), vec![(Tier::Host, 12)]);

    l.async_loads = false;
    let sync = offer(&mut l, "sync");
    assert_eq!(l.allocate_offer(&sync, &devs).unwrap(), None);
    l.cancel_load(&"unknown".into(), 0, 4).unwrap();
}

/// A leader of 4-token blocks over `host_blocks` host blocks, match holds as given (`None` off,
/// else whether they expire), holding the first 12 tokens of the 13-token prompt it returns.
fn holding_leader(host_blocks: usize, holds: Option<bool>) -> (Leader, Vec<u32>) {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), host_blocks)).unwrap();
    if let Some(expire) = holds {
        l.enable_match_holds(expire);
    }
    let prompt: Vec<u32> = (0..13).collect();
    stored(&mut l, "fill", prompt[..12].to_vec(), 0);
    (l, prompt)
}

/// A step's planned loads: (blocks loaded by its jobs, blocks listed failed).
fn load_outcome(m: &StepMetadata) -> (usize, usize) {
    let loaded = m.loads.iter().flat_map(|x| &x.jobs).map(|j| j.len()).sum();
    let failed = m.loads.iter().map(|x| x.failed_devices.len()).sum();
    (loaded, failed)
}

/// TensorRT-LLM's KVCacheManagerV2 may allocate a matched request passes later, and the stores
/// planned in between may evict what the match offered. With match holds the offered host blocks
/// stay, so the load is planned whole; without them the same sequence fails the load (the gap
/// the holds close, which a sliding-window group could only recover by computing into blocks
/// without a page).
#[test]
fn a_held_match_survives_the_stores_planned_before_its_allocation() {
    for holds in [false, true] {
        let (mut l, prompt) = holding_leader(4, holds.then_some(true));
        let r: RequestId = "r".into();
        assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 12);
        assert_eq!(l.held_blocks(), if holds { 3 } else { 0 });
        // Another request's four blocks are stored before `r` is allocated: the host tier (four
        // blocks) evicts the least recently used ones it may.
        stored(&mut l, "other", (100..116).collect(), 10);
        let devs: Vec<DeviceBlockId> = (20..24).map(DeviceBlockId).collect();
        let a = l.allocate(&r, &devs, 12);
        assert!(a.refused.is_none());
        assert_eq!(l.held_blocks(), 0, "the allocation gives the hold back");
        let m = l
            .build_step(&SchedulerStep {
                records: vec![],
                finished: vec![],
            })
            .unwrap();
        let (loaded, failed) = load_outcome(&m);
        if holds {
            assert_eq!((loaded, failed), (3, 0));
        } else {
            assert_eq!((loaded, failed), (0, 3));
        }
    }
}

/// A hold is given back by a new match, a finish, a preemption, or after `MAX_HOLD_STEPS` steps
/// without an allocation: never kept for a request the engine dropped.
#[test]
fn a_match_hold_is_given_back_without_an_allocation() {
    let (mut l, prompt) = holding_leader(8, Some(true));
    let (a, b, c): (RequestId, RequestId, RequestId) = ("a".into(), "b".into(), "c".into());
    assert_eq!(l.get_num_new_matched_tokens(&a, &prompt, 0).unwrap(), 12);
    assert_eq!(l.get_num_new_matched_tokens(&a, &prompt, 0).unwrap(), 12);
    assert_eq!(l.held_blocks(), 3, "a new match replaces the hold");
    assert_eq!(l.get_num_new_matched_tokens(&a, &prompt, 4).unwrap(), 8);
    assert_eq!(l.held_blocks(), 2);
    assert_eq!(l.request_finished(&a).unwrap(), BlockReuse::Now);
    assert_eq!(l.held_blocks(), 0);
    l.get_num_new_matched_tokens(&b, &prompt, 0).unwrap();
    l.request_preempted(&b).unwrap();
    assert_eq!(l.held_blocks(), 0);
    l.get_num_new_matched_tokens(&c, &prompt, 0).unwrap();
    for _ in 1..holds::MAX_HOLD_STEPS {
        l.build_step(&SchedulerStep::default()).unwrap();
    }
    assert_eq!(l.held_blocks(), 3);
    l.build_step(&SchedulerStep::default()).unwrap();
    assert_eq!(l.held_blocks(), 0);
    // Every pin is back: the host tier's blocks can all be evicted again.
    let host = l.tiers.host.as_ref().unwrap();
    assert!((0..8).all(|i| host.pin_count(BlockId(i)).unwrap_or(0) == 0));
}

/// With windows (holds that do not expire) a match waiting for its allocation longer than
/// `MAX_HOLD_STEPS` keeps its blocks, so its load is still planned whole; it is given back at the
/// allocation, a new match, preemption or finish like any hold.
#[test]
fn a_hold_without_expiry_outlives_max_hold_steps() {
    let (mut l, prompt) = holding_leader(4, Some(false));
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 12);
    for _ in 0..holds::MAX_HOLD_STEPS + 8 {
        l.build_step(&SchedulerStep::default()).unwrap();
    }
    assert_eq!(l.held_blocks(), 3);
    // Another request's stores fill the host tier meanwhile: the held blocks stay.
    stored(&mut l, "other", (100..116).collect(), 10);
    let devs: Vec<DeviceBlockId> = (20..24).map(DeviceBlockId).collect();
    assert!(l.allocate(&r, &devs, 12).refused.is_none());
    assert_eq!(l.held_blocks(), 0);
    let m = l.build_step(&SchedulerStep::default()).unwrap();
    assert_eq!(load_outcome(&m), (3, 0));
}
