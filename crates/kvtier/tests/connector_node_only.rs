//! A leader with no host tier and a remote store (node-only: the node tier's arena is the
//! engine's G2): full blocks are stored device -> remote as store jobs the request waits for,
//! failures are counted and never matched as hits, and the blocks stored are matched as remote
//! hits by a second leader (another engine process) sharing the store.
#![allow(clippy::unwrap_used)]
use std::sync::Arc;

use kvtier::connector::testing::MemoryRemoteStore;
use kvtier::connector::{Capacity, Leader, LeaderConfig, SchedulerStep, StepRecord, WorkerReport};
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::transfer::{BlockFailure, Blocks, RemoteStore, TransferOutcome};
use kvtier::{DeviceBlockId, RequestId};

const BS: usize = 4;

fn leader(remote: &Arc<MemoryRemoteStore>) -> Leader {
    let mut cfg = LeaderConfig::new(BS, HashSalt(9), 0);
    cfg.host = Capacity::Blocks(0);
    cfg.remote = Some(remote.clone());
    cfg.remote_put = true;
    Leader::new(cfg).unwrap()
}

fn record(id: &str, tokens: Vec<u32>) -> StepRecord {
    StepRecord {
        request_id: id.into(),
        num_scheduled_tokens: tokens.len(),
        new_block_ids: (0..(tokens.len() / BS) as u32).map(DeviceBlockId).collect(),
        new_tokens: tokens,
        is_new: true,
        ..Default::default()
    }
}

#[test]
fn node_only_stores_go_device_to_remote_and_are_waited_for() {
    let remote = Arc::new(MemoryRemoteStore::new());
    let mut l = leader(&remote);
    assert!(l.host_pool().is_none());
    let prompt: Vec<u32> = (0..12).collect();
    let m = l
        .build_step(&SchedulerStep {
            records: vec![record("a", prompt.clone())],
            finished: vec![],
        })
        .unwrap();
    assert_eq!(m.stores.len(), 1);
    let job = &m.stores[0].job;
    let hashes = sequence_hashes(HashSalt(9), &prompt, BS);
    assert_eq!(
        job.src(),
        &Blocks::Device((0..3).map(DeviceBlockId).collect())
    );
    // The remote side is the blocks' hashes: no block numbers.
    assert_eq!(job.dst(), &Blocks::Remote(hashes.clone()));
    // The engine must keep the device blocks while the store is in flight.
    let a: RequestId = "a".into();
    assert!(
        l.request_finished(&a).unwrap().must_wait(),
        "finished while its store reads G1"
    );
    // The worker wrote blocks 0 and 2; block 1 failed (e.g. a full node).
    for (k, h) in hashes.iter().enumerate() {
        if k != 1 {
            remote.put(*h, &[k as u8; 8]).unwrap();
        }
    }
    l.apply_report(WorkerReport {
        rank: 0,
        job: job.id,
        outcome: TransferOutcome::Failed(vec![BlockFailure {
            pair_index: 1,
            reason: "the kvtier node is full; store skipped".into(),
        }]),
    });
    let s = l.stats();
    assert_eq!(
        (
            s.remote_put_blocks,
            s.remote_put_confirmed,
            s.remote_put_failed
        ),
        (3, 2, 1)
    );
    assert!(!l.has_pending_saves(&a), "the store was reported");

    // Another engine on the same store matches the prefix up to the failed block.
    let mut other = leader(&remote);
    let q: RequestId = "q".into();
    let mut longer = prompt.clone();
    longer.extend(100..104);
    assert_eq!(
        other.get_num_new_matched_tokens(&q, &longer, 0).unwrap(),
        BS
    );
}
