//! In-process pairing of a Leader with the Workers of the same engine: the channel their job
//! reports travel on, and the layouts the Workers registered (from which a Leader that was not
//! told `bytes_per_block` sizes its pools).
//!
//! Invariants: one rendezvous serves one engine. A Leader claims the newest unclaimed rendezvous
//! of its channel key (or opens a fresh one); a Worker joins the newest one that has no Worker of
//! its rank yet (or opens a fresh one). So the TensorRT-LLM order (workers, then the scheduler)
//! and the vLLM order (worker, then scheduler) both pair up, and engines built one after another
//! in one process never share a rendezvous. The registry lock guards only the map; each
//! rendezvous's state has its own lock and condition variable.
//!
//! Checked exhaustively with loom (`--features loom`, `loom_tests` below, scripts/
//! check-concurrency.sh): the feature swaps the locks and the condition variable for loom's.
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "loom")]
use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(feature = "loom"))]
use std::sync::{Condvar, Mutex, MutexGuard};

use kvtier::connector::messages::{RankLayout, WorkerReport};

#[derive(Default)]
struct State {
    layouts: BTreeMap<u32, RankLayout>,
    claimed: bool,
}

/// See the module documentation.
pub(crate) struct Rendezvous {
    state: Mutex<State>,
    cv: Condvar,
    reports_tx: Mutex<Sender<WorkerReport>>,
    reports_rx: Mutex<Option<Receiver<WorkerReport>>>,
}

type Registry = Mutex<HashMap<String, Vec<Arc<Rendezvous>>>>;

#[cfg(not(feature = "loom"))]
fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Under loom: one registry per explored execution.
#[cfg(feature = "loom")]
fn registry() -> &'static Registry {
    loom::lazy_static! {
        static ref R: Registry = Mutex::new(HashMap::new());
    }
    &R
}

impl Rendezvous {
    fn new() -> Arc<Self> {
        let (tx, rx) = channel();
        Arc::new(Rendezvous {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            reports_tx: Mutex::new(tx),
            reports_rx: Mutex::new(Some(rx)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The rendezvous a new Leader on `key` uses.
    pub(crate) fn for_leader(key: &str) -> Arc<Self> {
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        let list = reg.entry(key.to_string()).or_default();
        // Drop rendezvous nobody else holds any more.
        list.retain(|r| Arc::strong_count(r) > 1);
        if let Some(r) = list.iter().rev().find(|r| !r.lock().claimed) {
            r.lock().claimed = true;
            return Arc::clone(r);
        }
        let r = Rendezvous::new();
        r.lock().claimed = true;
        list.push(Arc::clone(&r));
        r
    }

    /// The rendezvous a new Worker of `rank` on `key` joins.
    pub(crate) fn for_worker(key: &str, rank: u32) -> Arc<Self> {
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        let list = reg.entry(key.to_string()).or_default();
        list.retain(|r| Arc::strong_count(r) > 1);
        if let Some(r) = list.last() {
            if !r.lock().layouts.contains_key(&rank) {
                return Arc::clone(r);
            }
        }
        let r = Rendezvous::new();
        list.push(Arc::clone(&r));
        r
    }

    /// Where a Worker's reports go.
    pub(crate) fn report_sender(&self) -> Sender<WorkerReport> {
        self.reports_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The receiving end, taken once by the Leader.
    pub(crate) fn take_receiver(&self) -> Option<Receiver<WorkerReport>> {
        self.reports_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// A worker's layout for its rank (a later one replaces it); wakes a waiting leader.
    pub(crate) fn register(&self, layout: RankLayout) {
        self.lock().layouts.insert(layout.rank, layout);
        self.cv.notify_all();
    }

    /// The layouts registered so far, waiting up to `timeout` until `rank` is among them.
    pub(crate) fn wait_for(&self, rank: u32, timeout: Duration) -> Option<Vec<RankLayout>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        while !st.layouts.contains_key(&rank) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = match self.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        Some(st.layouts.values().cloned().collect())
    }
}

/// Rank `rank`'s layout of a two-rank test engine.
#[cfg(test)]
fn layout(rank: u32) -> RankLayout {
    RankLayout {
        rank,
        world_size: 2,
        block_size: 16,
        bytes_per_block: 4096,
        num_device_blocks: 8,
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;

    #[test]
    fn trtllm_and_vllm_orders_pair_up_and_engines_do_not_share() {
        let key = "test-pairing";
        // vLLM order: worker first.
        let w0 = Rendezvous::for_worker(key, 0);
        w0.register(layout(0));
        let l = Rendezvous::for_leader(key);
        assert!(Arc::ptr_eq(&w0, &l));
        // A second engine: its leader must not claim the first one.
        let l2 = Rendezvous::for_leader(key);
        assert!(!Arc::ptr_eq(&l, &l2));
        let w1 = Rendezvous::for_worker(key, 0);
        assert!(Arc::ptr_eq(&w1, &l2));
        w1.register(layout(0));
        let w1b = Rendezvous::for_worker(key, 1);
        assert!(Arc::ptr_eq(&w1b, &l2));
        w1b.register(layout(1));
        assert_eq!(
            l2.wait_for(1, Duration::from_millis(1)).map(|v| v.len()),
            Some(2)
        );
        assert!(l.wait_for(1, Duration::from_millis(1)).is_none());
    }
}

/// Every interleaving (loom) of one engine's Leader and Workers starting on their threads.
#[cfg(all(test, feature = "loom"))]
mod loom_tests {
    use super::*;

    /// A Leader waiting for rank 0's layout is woken by the Worker's registration, whichever
    /// runs first (a lost wakeup is a deadlock loom reports).
    #[test]
    fn register_wakes_the_waiting_leader() {
        loom::model(|| {
            let r = Rendezvous::new();
            let w = Arc::clone(&r);
            let t = loom::thread::spawn(move || w.register(layout(0)));
            let got = r.wait_for(0, Duration::from_secs(3600));
            assert_eq!(got.map(|v| v.len()), Some(1));
            t.join()
                .unwrap_or_else(|_| panic!("worker thread panicked"));
        });
    }

    /// A Leader and two Workers of one engine, started concurrently on their own threads (the
    /// TensorRT-LLM and vLLM orders and every interleaving between), meet in one rendezvous and
    /// the Leader sees both layouts.
    #[test]
    fn leader_and_workers_started_concurrently_pair_up() {
        loom::model(|| {
            let key = "loom-pairing";
            let workers: Vec<_> = (0..2u32)
                .map(|rank| {
                    loom::thread::spawn(move || {
                        let r = Rendezvous::for_worker(key, rank);
                        r.register(layout(rank));
                        r
                    })
                })
                .collect();
            let l = Rendezvous::for_leader(key);
            let got = l.wait_for(0, Duration::from_secs(3600));
            assert!(got.is_some());
            let ws: Vec<_> = workers
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| panic!("worker thread panicked"))
                })
                .collect();
            for w in &ws {
                assert!(Arc::ptr_eq(w, &l), "a worker and its leader did not pair");
            }
            assert_eq!(
                l.wait_for(1, Duration::from_secs(3600)).map(|v| v.len()),
                Some(2)
            );
        });
    }
}
