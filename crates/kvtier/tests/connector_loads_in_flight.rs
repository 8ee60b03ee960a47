//! A request finished (or cancelled) with loads planned or in flight keeps its device blocks
//! until no copy can land in them any more; loads never handed to a worker are withdrawn.
#![allow(clippy::unwrap_used)]

use kvtier::connector::messages::{StepMetadata, WorkerReport};
use kvtier::connector::{Leader, LeaderConfig, SchedulerStep, StepRecord};
use kvtier::hash::HashSalt;
use kvtier::ids::{DeviceBlockId, RequestId};
use kvtier::transfer::TransferOutcome;

fn confirm(l: &mut Leader, m: &StepMetadata) {
    let ids: Vec<_> = m
        .stores
        .iter()
        .map(|s| s.job.id)
        .chain(m.background.iter().map(|j| j.id))
        .chain(m.loads.iter().flat_map(|l| l.jobs.iter().map(|j| j.id)))
        .collect();
    for job in ids {
        l.apply_report(WorkerReport {
            rank: 0,
            job,
            outcome: TransferOutcome::Ok,
        });
    }
}

fn filled() -> (Leader, Vec<u32>) {
    let mut l = Leader::new(LeaderConfig::new(4, HashSalt(3), 16)).unwrap();
    let prompt: Vec<u32> = (0..12).collect();
    let m = l
        .build_step(&SchedulerStep {
            records: vec![StepRecord {
                request_id: "fill".into(),
                new_tokens: prompt.clone(),
                new_block_ids: (0..3).map(DeviceBlockId).collect(),
                num_scheduled_tokens: 12,
                is_new: true,
                ..Default::default()
            }],
            finished: vec!["fill".into()],
        })
        .unwrap();
    confirm(&mut l, &m);
    (l, prompt)
}

fn empty_step(l: &mut Leader) -> StepMetadata {
    l.build_step(&SchedulerStep::default()).unwrap()
}

#[test]
fn loads_never_sent_are_withdrawn_at_finish() {
    let (mut l, prompt) = filled();
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
    // Cancelled before any metadata carried its loads: nothing can land, the blocks may go.
    assert!(!l.request_finished(&r).unwrap().must_wait());
    let m = empty_step(&mut l);
    assert!(
        m.loads.is_empty(),
        "withdrawn loads were sent: {:?}",
        m.loads
    );
    // Its sources were released, not invalidated: another request still finds them.
    let q: RequestId = "q".into();
    assert_eq!(l.get_num_new_matched_tokens(&q, &prompt, 0).unwrap(), 8);
    assert_eq!(l.stats().onboard_failed, 0);
}

#[test]
fn loads_in_flight_keep_the_blocks_until_reported() {
    let (mut l, prompt) = filled();
    let r: RequestId = "r".into();
    assert_eq!(l.get_num_new_matched_tokens(&r, &prompt, 0).unwrap(), 8);
    let devs: Vec<DeviceBlockId> = (20..23).map(DeviceBlockId).collect();
    l.update_state_after_alloc(&r, &devs, Some(8)).unwrap();
    let sent = empty_step(&mut l);
    assert_eq!(sent.loads.len(), 1);
    // Cancelled with its copies on their way: the engine must keep the blocks.
    assert!(l.request_finished(&r).unwrap().must_wait());
    let m = empty_step(&mut l);
    assert!(m.saving.contains(&r), "workers are not told to hold {r}");
    confirm(&mut l, &sent);
    assert_eq!(l.stats().active_requests, 0);
}
