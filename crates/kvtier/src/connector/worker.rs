//! The worker (one per GPU rank): runs the jobs of each step's metadata through its
//! [`BlockTransfer`] on a small pool of kvtier threads, and reports every finished job both to
//! the leader (through its [`WorkerLink`]) and to the engine (`get_finished`,
//! `take_load_errors`).
//!
//! Invariants:
//! - stores read engine memory only after the fence captured in `forward_done` (the end of the
//!   step's forward pass);
//! - sync loads of a step are complete before `wait_for_layer_load` returns, or, with ordered
//!   sync loads (`set_ordered_sync_loads`), the engine's stream is made to wait for their copies
//!   on the device first ([`BlockTransfer::execute_ordered`]); with layered sync loads
//!   (`set_layered_sync_loads`, a step started with `start_load_layered`) layer by layer instead
//!   ([`BlockTransfer::execute_layered`]): `wait_for_layer` makes the stream wait for one
//!   layer's copies; a sync load that the engine never waited for before its forward pass ended
//!   is not run and is reported as failed, and a layered one with a layer never waited for is
//!   reported failed (its blocks in `take_load_errors` at once) and its stores are dropped;
//! - a load that failed on any pair puts those device blocks in `take_load_errors` and its
//!   request in `load_failed`, never in `loaded`;
//! - a finished request is reported saved only if the leader answered "saves in flight" for it
//!   (the metadata's `saving` list, or the engine's word where its finished list holds only such
//!   requests: `set_finished_ids_are_saving`), and only when no store of it is pending on this
//!   rank (the engine passes it in only after the last step that could have stored for it);
//!   vLLM frees the blocks of any other finished request at once and must never hear of it again;
//! - a panic inside a transfer is caught and reported as the failure of every pair of its job.
//!
//! Threading: the engine thread owns `Worker` (`&mut self`); executor threads share only the
//! task queue (a mutex around the receiver) and the completion channel.
use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::connector::messages::{RequestLoad, StepMetadata, WorkerReport};
use crate::connector::ConnectorError;
use crate::ids::{DeviceBlockId, JobId, RequestId};
use crate::transfer::{Block, BlockTransfer, Blocks, Fence, TransferJob, TransferOutcome};

mod errors;
mod executor;
mod layered;
mod verdicts;
use executor::{executor, fail_all, Done, Note, Order, Task};
use layered::StepGate;

/// Where a worker's reports go.
pub trait ReportSink: Send + Sync {
    /// Deliver one finished job's report; an error means the leader is gone.
    fn send(&self, report: WorkerReport) -> Result<(), ConnectorError>;
}

impl ReportSink for Sender<WorkerReport> {
    fn send(&self, report: WorkerReport) -> Result<(), ConnectorError> {
        Sender::send(self, report).map_err(|_| ConnectorError::Channel("leader is gone".into()))
    }
}

/// A worker's identity and its way to the leader.
#[derive(Clone)]
pub struct WorkerLink {
    /// This worker's rank (0-based).
    pub rank: u32,
    /// Ranks of the engine (tensor-parallel size).
    pub world_size: u32,
    sink: Arc<dyn ReportSink>,
}

impl WorkerLink {
    /// A worker in the leader's process: reports go straight into the leader's queue
    /// (`Leader::report_sender`).
    pub fn in_process(rank: u32, world_size: u32, leader: Sender<WorkerReport>) -> Self {
        WorkerLink {
            rank,
            world_size,
            sink: Arc::new(leader),
        }
    }

    /// A worker whose reports travel through any sink (e.g. the ZeroMQ client).
    pub fn new(rank: u32, world_size: u32, sink: Arc<dyn ReportSink>) -> Self {
        WorkerLink {
            rank,
            world_size,
            sink,
        }
    }
}

/// What `get_finished` returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinishedReport {
    /// Finished requests whose stores are all done on this rank.
    pub saved: Vec<RequestId>,
    /// Requests whose async loads all succeeded on this rank.
    pub loaded: Vec<RequestId>,
    /// Requests whose async loads ended with at least one failed block (those device blocks
    /// are in `take_load_errors`); the engine must recompute them.
    pub load_failed: Vec<RequestId>,
    /// Load verdicts on (`Worker::set_load_verdicts`): loads some rank failed, and their recompute token.
    pub recompute: Vec<(RequestId, u64)>,
}

enum JobInfo {
    Store { request: RequestId },
    Load { request: RequestId, sync: bool },
    Background,
}

struct LoadState {
    pending: usize,
    failed: bool,
    sync: bool,
}

/// One rank's worker. See the module documentation.
pub struct Worker {
    rank: u32,
    transfer: Arc<dyn BlockTransfer>,
    link: WorkerLink,
    task_tx: Option<Sender<Task>>,
    done_tx: Sender<Note>,
    done_rx: Receiver<Note>,
    threads: Vec<JoinHandle<()>>,
    /// Loads and stores of the bound step not yet handed to the executor.
    bound_loads: Vec<RequestLoad>,
    bound_stores: Vec<(RequestId, TransferJob)>,
    jobs: HashMap<JobId, JobInfo>,
    stores_pending: HashMap<RequestId, usize>,
    loads: HashMap<RequestId, LoadState>,
    sync_pending: usize,
    /// Sync load jobs (still running) whose copies the engine's stream already waits for.
    sync_enqueued: HashSet<JobId>,
    ordered_sync_loads: bool,
    layered_sync_loads: bool,
    /// The bound step's layered sync loads whose copies are enqueued.
    gates: Vec<StepGate>,
    /// Device blocks of the bound step's layered sync load jobs (reported failed at once when a
    /// layer was never waited for).
    layered_dsts: HashMap<JobId, Vec<DeviceBlockId>>,
    /// Jobs reported failed before they finished (a layer never waited for): their outcome is
    /// a failure whatever the copies did.
    failed_early: HashSet<JobId>,
    /// Finished requests passed in by the engine, with the bind count when they were passed.
    finished_waiting: HashMap<RequestId, u64>,
    /// Requests the leader declared saving (from the metadata).
    saving: HashSet<RequestId>,
    finished_are_saving: bool,
    binds: u64,
    /// The step of the last metadata bound: the same step bound again is refused.
    bound_step: u64,
    loads_ready: Vec<(RequestId, bool)>,
    started_loading: HashSet<RequestId>,
    load_errors: Vec<DeviceBlockId>,
    /// `load_errors` holds only the blocks of sync loads (`errors.rs`).
    sync_load_errors_only: bool,
    /// Requests whose sync load failed in the bound step: their stores of this step read KV
    /// computed over bad blocks and are failed instead of run.
    poisoned: HashSet<RequestId>,
    /// Load verdicts received and not yet acted on; `None`: verdicts are off (`verdicts.rs`).
    verdicts: Option<HashMap<RequestId, Option<u64>>>,
}

impl Worker {
    /// A worker with two executor threads.
    pub fn new(transfer: Arc<dyn BlockTransfer>, link: WorkerLink) -> Self {
        Self::with_threads(transfer, link, 2)
    }

    /// A worker with `threads` executor threads (at least one).
    pub fn with_threads(
        transfer: Arc<dyn BlockTransfer>,
        link: WorkerLink,
        threads: usize,
    ) -> Self {
        let (task_tx, task_rx) = channel::<Task>();
        let task_rx = Arc::new(Mutex::new(task_rx));
        let (done_tx, done_rx) = channel::<Note>();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&task_rx);
            let done = done_tx.clone();
            let transfer = Arc::clone(&transfer);
            let link = link.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kvtier-w{}-{i}", link.rank))
                .spawn(move || executor(rx, done, transfer, link));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => tracing::error!(error = %e, "could not start a kvtier executor thread"),
            }
        }
        Worker {
            rank: link.rank,
            transfer,
            link,
            task_tx: Some(task_tx),
            done_tx,
            done_rx,
            threads: handles,
            bound_loads: Vec::new(),
            bound_stores: Vec::new(),
            jobs: HashMap::new(),
            stores_pending: HashMap::new(),
            loads: HashMap::new(),
            sync_pending: 0,
            sync_enqueued: HashSet::new(),
            ordered_sync_loads: false,
            layered_sync_loads: false,
            gates: Vec::new(),
            layered_dsts: HashMap::new(),
            failed_early: HashSet::new(),
            finished_waiting: HashMap::new(),
            saving: HashSet::new(),
            finished_are_saving: false,
            binds: 0,
            bound_step: 0,
            loads_ready: Vec::new(),
            started_loading: HashSet::new(),
            load_errors: Vec::new(),
            sync_load_errors_only: false,
            poisoned: HashSet::new(),
            verdicts: None,
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// For engines whose `get_finished` list holds only requests for which `request_finished`
    /// answered true (TensorRT-LLM, kvtier's reference engine): report them without waiting for
    /// the next metadata's `saving` list. Off by default (vLLM passes every finished request).
    pub fn set_finished_ids_are_saving(&mut self, yes: bool) {
        self.finished_are_saving = yes;
    }

    /// Order sync loads on the device: `start_load`'s engine stream waits for their copies
    /// (where the transfer can), and `wait_for_layer_load` returns once that wait is enqueued
    /// instead of when the copies completed. Only for engines whose forward pass runs on the
    /// stream they pass to `start_load` (vLLM: `torch.cuda.current_stream()`). Off by default.
    pub fn set_ordered_sync_loads(&mut self, yes: bool) {
        self.ordered_sync_loads = yes;
    }

    /// The transfer this worker runs its jobs through.
    pub fn transfer(&self) -> &Arc<dyn BlockTransfer> {
        &self.transfer
    }

    fn submit(&mut self, jobs: Vec<TransferJob>, fence: Fence, order: Option<Order>) {
        if jobs.is_empty() {
            return;
        }
        let task = Task {
            jobs,
            fence,
            order,
            queued: std::time::Instant::now(),
        };
        let rejected = match &self.task_tx {
            Some(tx) if !self.threads.is_empty() => tx.send(task).err().map(|e| e.0),
            _ => Some(task),
        };
        if let Some(task) = rejected {
            tracing::error!("kvtier executor is not running; failing its jobs");
            for job in task.jobs {
                let outcome = fail_all(&job, "executor not running");
                self.finish_here(job, outcome);
            }
        }
    }

    /// Report a job that never reached the executor (as the executor would have).
    fn finish_here(&mut self, job: TransferJob, outcome: TransferOutcome) {
        let _ = self.link.sink.send(WorkerReport {
            rank: self.rank,
            job: job.id,
            outcome: outcome.clone(),
        });
        let _ = self.done_tx.send(Note::Done(Done { job, outcome }));
    }

    /// Take the step's metadata (every rank receives the same). Background copies start now.
    /// First waits for the jobs of the requests in `meta.fence`: this step hands their device
    /// blocks to other requests (the engine's adapter may have waited already, earlier in the
    /// step, with [`Worker::wait_for_requests`]; then this returns at once).
    pub fn bind(&mut self, meta: &StepMetadata) {
        if meta.step != 0 && meta.step == std::mem::replace(&mut self.bound_step, meta.step) {
            tracing::error!(step = meta.step, "step metadata bound twice; ignored");
            return;
        }
        if !meta.fence.is_empty() {
            self.wait_for_requests(&meta.fence);
        }
        self.drain();
        self.binds += 1;
        self.saving.extend(meta.saving.iter().cloned());
        for l in &meta.loads {
            self.note_load_errors(l.failed_devices.iter().copied(), l.sync);
            let st = self.loads.entry(l.request.clone()).or_insert(LoadState {
                pending: 0,
                failed: false,
                sync: l.sync,
            });
            st.failed |= !l.failed_devices.is_empty();
            st.pending += l.jobs.len();
            if l.sync {
                self.sync_pending += l.jobs.len();
            }
            for j in &l.jobs {
                self.jobs.insert(
                    j.id,
                    JobInfo::Load {
                        request: l.request.clone(),
                        sync: l.sync,
                    },
                );
            }
            if l.jobs.is_empty() && !l.sync {
                self.check_load_done(&l.request);
            } else if l.jobs.is_empty() {
                self.loads.remove(&l.request);
            }
        }
        self.bound_loads
            .extend(meta.loads.iter().filter(|l| !l.jobs.is_empty()).cloned());
        for s in &meta.stores {
            *self.stores_pending.entry(s.request.clone()).or_insert(0) += 1;
            self.jobs.insert(
                s.job.id,
                JobInfo::Store {
                    request: s.request.clone(),
                },
            );
            self.bound_stores.push((s.request.clone(), s.job.clone()));
        }
        for j in &meta.background {
            self.jobs.insert(j.id, JobInfo::Background);
        }
        self.submit(meta.background.clone(), Fence::none(), None);
    }

    /// Start the bound step's loads (engine thread, before the forward pass).
    pub fn start_load(&mut self, engine_stream: Option<u64>) {
        self.start_load_layered(engine_stream, false);
    }

    /// [`Self::start_load`]; with `layered` (and [`Self::set_layered_sync_loads`]) the step's
    /// ordered sync loads go layer by layer: the engine then calls [`Self::wait_for_layer`] for
    /// every layer before its forward pass reads it (an engine that may skip a layer's hook in
    /// this step, e.g. a step replayed as one CUDA graph, must pass false).
    pub fn start_load_layered(&mut self, engine_stream: Option<u64>, layered: bool) {
        if self.bound_loads.is_empty() {
            return;
        }
        let loads = std::mem::take(&mut self.bound_loads);
        let order = engine_stream
            .filter(|_| self.ordered_sync_loads)
            .map(|stream| Order {
                stream,
                layered: layered && self.layered_sync_loads,
            });
        let (ordered, plain): (Vec<RequestLoad>, Vec<RequestLoad>) =
            loads.into_iter().partition(|l| l.sync && order.is_some());
        let flat = |v: Vec<RequestLoad>| v.into_iter().flat_map(|l| l.jobs).collect::<Vec<_>>();
        let ordered = flat(ordered);
        if order.is_some_and(|o| o.layered) {
            for j in &ordered {
                if let Blocks::Device(dsts) = j.dst() {
                    self.layered_dsts.insert(j.id, dsts.clone());
                }
            }
        }
        self.submit_after_fence(flat(plain), engine_stream, "loads", None);
        self.submit_after_fence(ordered, engine_stream, "loads", order);
    }

    /// Block until the step's sync loads are done, or (ordered sync loads) until the engine's
    /// stream waits for their copies; all layers at once (an engine without a stream to give).
    pub fn wait_for_layer_load(&mut self, layer: usize) {
        self.wait_for_layer(Some(layer), None);
    }

    /// The forward pass has been enqueued: capture its end and queue the step's stores.
    /// Sync loads nobody waited for are reported failed (the forward did not see their data).
    pub fn forward_done(&mut self, engine_stream: Option<u64>) {
        if !self.layered_dsts.is_empty() {
            // An engine that skipped every layer's hook never waited for the gates to arrive:
            // take them now, so that a layer nobody waited for is seen below.
            self.wait_enqueued();
        }
        let unawaited: Vec<JobId> = self
            .gates
            .iter()
            .filter(|g| g.awaited.iter().any(|a| !a))
            .map(|g| g.job)
            .collect();
        for job in unawaited {
            layered::kvtier_warn_unawaited(job);
            self.fail_layered_now(job);
        }
        // Jobs still in `layered_dsts` whose gate never came: they are sync jobs the engine
        // never waited for (counted in `sync_pending`), failed by their outcome or below.
        self.gates.clear();
        self.layered_dsts.clear();
        let loads = std::mem::take(&mut self.bound_loads);
        for l in loads {
            if l.sync {
                tracing::error!(request = %l.request, "sync load was not awaited before the forward pass; reporting it failed");
                self.poisoned.insert(l.request.clone());
                for j in l.jobs {
                    let o = fail_all(&j, "not awaited before the forward pass");
                    self.finish_here(j, o);
                }
            } else {
                self.bound_loads.push(l);
            }
        }
        if !self.bound_loads.is_empty() {
            self.start_load(engine_stream);
        }
        self.drain();
        let poisoned = std::mem::take(&mut self.poisoned);
        let mut stores = Vec::new();
        for (req, job) in std::mem::take(&mut self.bound_stores) {
            if poisoned.contains(&req) {
                tracing::warn!(request = %req, "a load of this request failed; its stores of this step are dropped");
                let o = fail_all(&job, "computed over a failed load");
                self.finish_here(job, o);
            } else {
                stores.push(job);
            }
        }
        if stores.is_empty() {
            return;
        }
        self.submit_after_fence(stores, engine_stream, "stores", None);
    }

    /// Requests whose saves / async loads finished on this rank. `finished`: requests the engine
    /// finished since the last call (kept until saved). `started_loading`: for engines that
    /// require it (TensorRT-LLM), only these requests (accumulated over calls) are reported as
    /// loaded; `None` reports every request this rank loaded.
    pub fn get_finished(
        &mut self,
        finished: &[RequestId],
        started_loading: Option<&[RequestId]>,
    ) -> FinishedReport {
        self.drain();
        for r in finished {
            self.finished_waiting.entry(r.clone()).or_insert(self.binds);
        }
        let mut out = FinishedReport::default();
        let (stores_pending, loads, saving, trust, binds) = (
            &self.stores_pending,
            &self.loads,
            &mut self.saving,
            self.finished_are_saving,
            self.binds,
        );
        self.finished_waiting.retain(|r, passed_at| {
            let declared = trust || saving.contains(r);
            // A finished request's blocks are released only after its loads on this rank
            // finished too (a cancelled load must not land in blocks handed to another request).
            let idle = stores_pending.get(r).copied().unwrap_or(0) == 0 && !loads.contains_key(r);
            if declared && idle {
                saving.remove(r);
                out.saved.push(r.clone());
                false
            } else {
                // A request the leader never declared saving had no saves in flight; once two
                // metadata have passed without it, forget it (never report it).
                declared || binds <= *passed_at + 2
            }
        });
        if let Some(s) = started_loading {
            self.started_loading.extend(s.iter().cloned());
        }
        let gate = started_loading.is_some() || !self.started_loading.is_empty();
        let mut keep = Vec::new();
        for (r, failed) in std::mem::take(&mut self.loads_ready) {
            if gate && !self.started_loading.contains(&r) {
                keep.push((r, failed));
                continue;
            }
            if self.verdicts.is_some() {
                if self.report_by_verdict(&r, failed, &mut out) {
                    self.started_loading.remove(&r);
                } else {
                    keep.push((r, failed));
                }
                continue;
            }
            self.started_loading.remove(&r);
            if failed {
                out.load_failed.push(r);
            } else {
                out.loaded.push(r);
            }
        }
        self.loads_ready = keep;
        out.saved.sort();
        out
    }

    /// Number of jobs handed out and not yet finished on this rank.
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Wait until every job handed to the executor has finished (tests, shutdown); gives up,
    /// with an error in the log, when no job finishes for `WAIT_TIMEOUT`.
    pub fn wait_idle(&mut self) {
        self.wait_idle_until(None);
    }

    /// [`Self::wait_idle`] bounded by `timeout` in all: true when every submitted job finished
    /// within it, false (and an error in the log) when time ran out first.
    pub fn wait_idle_within(&mut self, timeout: Duration) -> bool {
        self.wait_idle_until(Some(Instant::now() + timeout))
    }

    fn wait_idle_until(&mut self, deadline: Option<Instant>) -> bool {
        loop {
            let unsubmitted: usize = self.bound_loads.iter().map(|l| l.jobs.len()).sum::<usize>()
                + self.bound_stores.len();
            if self.jobs.len() <= unsubmitted {
                return true;
            }
            let wait = deadline.map_or(WAIT_TIMEOUT, |d| {
                d.saturating_duration_since(Instant::now())
                    .min(WAIT_TIMEOUT)
            });
            match self.done_rx.recv_timeout(wait) {
                Ok(n) => self.on_note(n),
                Err(_) => {
                    tracing::error!(
                        rank = self.rank,
                        jobs = self.jobs.len(),
                        "kvtier worker: no job finished within {wait:?}; stopped waiting"
                    );
                    return false;
                }
            }
        }
    }

    /// Wait until the submitted jobs of `requests` (their loads into and stores from device
    /// blocks) have finished: the engine is about to reuse those requests' device blocks (vLLM's
    /// `handle_preemptions`). Other requests' jobs keep running.
    ///
    /// It never gives up while an executor may still run one of those jobs: the engine writes
    /// their blocks next, so a copy that outlived the wait would store torn KV under its hash or
    /// land in another request's blocks. It says so in the log every `WAIT_TIMEOUT`, and stops
    /// only if the executors are gone.
    pub fn wait_for_requests(&mut self, requests: &[RequestId]) {
        if !requests.is_empty() {
            self.wait_for_requests_logging(Some(requests), WAIT_TIMEOUT);
        }
    }

    /// [`Self::wait_for_requests`] for every request with a submitted job: the engine may reuse
    /// any device block a copy still uses, and the adapter cannot say which (it lost a step's
    /// fence to an adapter error). Background jobs (host <-> disk/remote) touch no device block
    /// and keep running.
    pub fn wait_for_all_requests(&mut self) {
        self.wait_for_requests_logging(None, WAIT_TIMEOUT);
    }

    /// `requests`: whose jobs to wait for; `None`: every request's.
    fn wait_for_requests_logging(&mut self, requests: Option<&[RequestId]>, every: Duration) {
        let started = Instant::now();
        let wanted: Option<HashSet<&RequestId>> = requests.map(|r| r.iter().collect());
        let unsubmitted: HashSet<JobId> = self
            .bound_loads
            .iter()
            .flat_map(|l| l.jobs.iter().map(|j| j.id))
            .chain(self.bound_stores.iter().map(|(_, j)| j.id))
            .collect();
        loop {
            self.drain();
            let busy = self.jobs.iter().any(|(id, info)| {
                !unsubmitted.contains(id)
                    && match info {
                        JobInfo::Store { request } | JobInfo::Load { request, .. } => {
                            wanted.as_ref().is_none_or(|w| w.contains(request))
                        }
                        JobInfo::Background => false,
                    }
            });
            if !busy {
                break;
            }
            match self.done_rx.recv_timeout(every) {
                Ok(n) => self.on_note(n),
                Err(RecvTimeoutError::Timeout) => {
                    tracing::error!(
                        rank = self.rank,
                        waited = ?started.elapsed(),
                        "kvtier worker: jobs of requests whose device blocks the engine reuses next are still running; still waiting (a copy cut short would corrupt KV)"
                    );
                }
                Err(RecvTimeoutError::Disconnected) => {
                    tracing::error!(
                        rank = self.rank,
                        "kvtier worker: the executors are gone; stopped waiting"
                    );
                    break;
                }
            }
        }
    }

    /// Hand `jobs` to the executor behind a fence on `engine_stream`; if the fence cannot be
    /// taken, every pair of every job fails here (nothing may touch engine memory unfenced).
    fn submit_after_fence(
        &mut self,
        jobs: Vec<TransferJob>,
        engine_stream: Option<u64>,
        what: &str,
        order: Option<Order>,
    ) {
        if jobs.is_empty() {
            return;
        }
        match self.transfer.fence(engine_stream) {
            Ok(f) => self.submit(jobs, f, order),
            Err(e) => {
                tracing::error!(error = %e, "fence for {what} failed; {what} fail");
                for j in jobs {
                    let o = fail_all(&j, &format!("fence failed: {e}"));
                    self.finish_here(j, o);
                }
            }
        }
    }

    fn drain(&mut self) {
        while let Ok(n) = self.done_rx.try_recv() {
            self.on_note(n);
        }
    }

    fn check_load_done(&mut self, req: &RequestId) {
        if let Some(st) = self.loads.get(req) {
            if st.pending == 0 {
                if !st.sync {
                    self.loads_ready.push((req.clone(), st.failed));
                }
                self.loads.remove(req);
            }
        }
    }

    fn on_note(&mut self, n: Note) {
        match n {
            Note::Enqueued(id, gate) => {
                if let Some(JobInfo::Load {
                    sync: true,
                    request,
                }) = self.jobs.get(&id)
                {
                    self.sync_enqueued.insert(id);
                    if let Some(gate) = gate {
                        let awaited = vec![false; gate.layers()];
                        self.gates.push(StepGate {
                            job: id,
                            request: request.clone(),
                            gate,
                            awaited,
                        });
                    }
                }
            }
            Note::Done(d) => self.on_done(d),
        }
    }

    fn on_done(&mut self, d: Done) {
        let Some(info) = self.jobs.remove(&d.job.id) else {
            tracing::warn!(job = d.job.id.0, "completion for an unknown job");
            return;
        };
        match info {
            JobInfo::Store { request } => {
                if let TransferOutcome::Failed(f) = &d.outcome {
                    tracing::warn!(request = %request, failed = f.len(), "store failed");
                }
                if let Some(n) = self.stores_pending.get_mut(&request) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.stores_pending.remove(&request);
                    }
                }
            }
            JobInfo::Load { request, sync } => {
                let early = self.failed_early.remove(&d.job.id);
                let failed = if early {
                    // Already in `load_errors` (`fail_layered_now`).
                    (0..d.job.len()).collect()
                } else {
                    d.outcome.failed_pairs()
                };
                let dst = d.job.dst();
                let dsts = failed
                    .iter()
                    .filter(|_| !early)
                    .filter_map(|&i| match dst.get(i) {
                        Some(Block::Device(b)) => Some(b),
                        _ => None,
                    });
                self.note_load_errors(dsts, sync);
                if sync {
                    self.sync_enqueued.remove(&d.job.id);
                    self.sync_pending = self.sync_pending.saturating_sub(1);
                    if !failed.is_empty() && !early {
                        self.poisoned.insert(request.clone());
                    }
                }
                if let Some(st) = self.loads.get_mut(&request) {
                    st.failed |= !failed.is_empty();
                    st.pending = st.pending.saturating_sub(1);
                }
                self.check_load_done(&request);
            }
            JobInfo::Background => {}
        }
    }
}

/// How long `wait_idle` waits for the next job to finish before it gives up (and says so in the
/// log); `wait_for_requests` logs at this interval and keeps waiting.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long dropping a [`Worker`] waits for its executor threads (see [`Worker::shutdown`]).
pub(crate) const DROP_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(60);

/// Executor threads that had not stopped when [`Worker::shutdown`]'s time ran out (each still
/// runs a transfer; it stops on its own when that returns, and nothing waits for it).
#[derive(Debug, thiserror::Error)]
#[error("kvtier worker rank {rank}: executor threads {threads:?} did not stop within {timeout:?}")]
pub struct ShutdownError {
    /// The worker's rank.
    pub rank: u32,
    /// The names of the threads still running.
    pub threads: Vec<String>,
    /// The time they were given.
    pub timeout: Duration,
}

impl Worker {
    /// Stop the executor threads: no new job is taken, the queued ones run to their end, and
    /// each thread is joined. Waits at most `timeout` in all; threads still running then are
    /// named in the error and left to finish on their own (they hold only their own clones of
    /// the transfer and the link).
    pub fn shutdown(mut self, timeout: Duration) -> Result<(), ShutdownError> {
        self.stop_threads(timeout)
    }

    fn stop_threads(&mut self, timeout: Duration) -> Result<(), ShutdownError> {
        self.task_tx = None;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(100);
        while self.threads.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        let mut stuck = Vec::new();
        for h in self.threads.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            } else {
                stuck.push(h.thread().name().unwrap_or("kvtier executor").to_string());
            }
        }
        if stuck.is_empty() {
            Ok(())
        } else {
            Err(ShutdownError {
                rank: self.rank,
                threads: stuck,
                timeout,
            })
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Err(e) = self.stop_threads(DROP_SHUTDOWN_TIMEOUT) {
            tracing::error!(error = %e, "kvtier worker dropped while transfers still ran");
        }
    }
}

#[cfg(test)]
mod tests;
