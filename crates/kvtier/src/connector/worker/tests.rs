//! Unit tests of the worker's waits.
#![allow(clippy::unwrap_used)]
use super::*;
use crate::connector::messages::{RequestStore, PROTOCOL_VERSION};
use crate::connector::testing::{FaultyTransfer, MemoryTransfer};
use crate::ids::BlockId;

/// A worker whose transfers are held, with `stores` (job id, request) bound and submitted.
fn worker_with_held_stores(stores: &[(u64, &str)]) -> (Worker, Arc<FaultyTransfer>) {
    let faulty = Arc::new(FaultyTransfer::new(Arc::new(MemoryTransfer::new(
        8, 4, 4, 0,
    ))));
    let (tx, _rx) = channel();
    let mut w = Worker::new(faulty.clone(), WorkerLink::in_process(0, 1, tx));
    let stores = stores
        .iter()
        .map(|&(id, request)| RequestStore {
            request: request.into(),
            job: TransferJob::from_pairs(
                JobId(id),
                [(DeviceBlockId(id as u32), BlockId(id as u32))],
            ),
        })
        .collect();
    faulty.hold();
    w.bind(&StepMetadata {
        version: PROTOCOL_VERSION,
        step: 1,
        stores,
        ..Default::default()
    });
    w.forward_done(None);
    (w, faulty)
}

/// Releases the held transfers after `after`.
fn release_after(faulty: Arc<FaultyTransfer>, after: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        faulty.release();
    })
}

#[test]
fn waiting_for_all_requests_waits_for_every_requests_store() {
    let (mut w, faulty) = worker_with_held_stores(&[(1, "a"), (2, "b")]);
    let releaser = release_after(faulty, Duration::from_millis(150));
    let t = Instant::now();
    w.wait_for_all_requests();
    assert!(
        t.elapsed() >= Duration::from_millis(120),
        "returned after {:?}",
        t.elapsed()
    );
    assert_eq!(w.jobs_in_flight(), 0, "a store is still running");
    releaser.join().unwrap();
}

#[test]
fn waiting_for_requests_outlasts_its_log_interval() {
    let (mut w, faulty) = worker_with_held_stores(&[(1, "r")]);
    let releaser = release_after(faulty, Duration::from_millis(300));
    let r: RequestId = "r".into();
    let t = Instant::now();
    w.wait_for_requests_logging(Some(std::slice::from_ref(&r)), Duration::from_millis(20));
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "gave up after {:?}",
        t.elapsed()
    );
    assert_eq!(w.jobs_in_flight(), 0);
    releaser.join().unwrap();
}

/// A step's metadata bound a second time (an adapter that started the step early and then
/// bound it again) is refused: bound twice, the request's store would be counted twice and run
/// once, and the finished request would never be reported saved (its blocks held forever).
#[test]
fn a_step_bound_twice_is_bound_once() {
    let mem = Arc::new(MemoryTransfer::new(8, 4, 4, 0));
    let (tx, _rx) = channel();
    let mut w = Worker::new(mem, WorkerLink::in_process(0, 1, tx));
    let meta = StepMetadata {
        version: PROTOCOL_VERSION,
        step: 7,
        stores: vec![RequestStore {
            request: "a".into(),
            job: TransferJob::from_pairs(JobId(1), [(DeviceBlockId(1), BlockId(1))]),
        }],
        saving: vec!["a".into()],
        ..Default::default()
    };
    w.bind(&meta);
    w.bind(&meta);
    w.forward_done(None);
    w.wait_for_all_requests();
    let r = w.get_finished(&["a".into()], None);
    assert_eq!(r.saved, vec![RequestId::from("a")], "{r:?}");
}
