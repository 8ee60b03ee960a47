//! `EngineHandle`: the thread-safe front of the engine. A background thread owns the
//! `EngineCore` and runs the step loop; the handle sends it commands over a channel.
//!
//! Invariants: only the step thread touches the core (no lock around the model or the KV cache);
//! `pending` counts requests submitted and not yet admitted, and `submit` refuses beyond
//! `max_waiting`; the last handle dropped (or `shutdown`) stops and joins the thread, and every
//! request still open then gets an `Error` event.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvtier::RequestId;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::api::{
    EngineConfig, EngineError, EngineMetrics, FinishReason, GenerateEvent, GenerateRequest,
    ModelSource,
};
use crate::core::EngineCore;
use crate::model::{Model, ModelConfig};
use crate::tokenizer::Tokenizer;

enum Command {
    Submit(RequestId, GenerateRequest, UnboundedSender<GenerateEvent>),
    ResetPrefixCache,
    /// Answered once nothing is running, waiting, loading, saving or transferring.
    WaitIdle(mpsc::Sender<()>),
    Shutdown,
}

struct Shared {
    metrics: Mutex<EngineMetrics>,
    pending: Arc<AtomicUsize>,
    rejected: AtomicU64,
}

struct Inner {
    tx: Mutex<Option<mpsc::Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    model_name: String,
    model_config: ModelConfig,
    max_waiting: usize,
    next_id: AtomicU64,
}

impl Inner {
    fn stop(&self) {
        let tx = self.tx.lock().ok().and_then(|mut g| g.take());
        if let Some(tx) = tx {
            let _ = tx.send(Command::Shutdown);
        }
        let th = self.thread.lock().ok().and_then(|mut g| g.take());
        if let Some(th) = th {
            if th.join().is_err() {
                tracing::error!("engine step thread panicked");
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Handle to a running engine. Cheap to clone; all clones drive the same engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl EngineHandle {
    /// Load the model, build the connector (if configured) and start the step thread.
    pub fn start(cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        cfg.validate()?;
        let (model, model_name) = match &cfg.model {
            ModelSource::BuiltIn { seed } => (
                Model::builtin(*seed),
                format!("kvtier-builtin-llama-seed{seed}"),
            ),
            ModelSource::Dir(dir) => {
                let m = Model::load_dir(dir)?;
                let name = dir
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| dir.display().to_string());
                (m, name)
            }
        };
        let c = &model.config;
        let tokenizer = match &cfg.model {
            ModelSource::BuiltIn { .. } => Tokenizer::builtin(),
            ModelSource::Dir(_) => {
                Tokenizer::byte_level(c.vocab_size, c.bos_token_id, c.eos_token_ids.clone())
            }
        };
        if c.vocab_size < 256 {
            return Err(EngineError::Config(format!(
                "vocab_size {} < 256: the byte-level tokenizer needs at least 256 ids",
                c.vocab_size
            )));
        }
        let model_config = model.config.clone();
        let pending = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            metrics: Mutex::new(EngineMetrics::default()),
            pending: pending.clone(),
            rejected: AtomicU64::new(0),
        });
        let mut core = EngineCore::new(&cfg, model, &model_name, pending)?;
        // Built once: each build allocates the host tier and creates the disk files.
        if let Some(setup) = &cfg.connector {
            let c = crate::kvtier_connector::build(setup, &cfg, &model_name, core.kv_cache())?;
            core.attach_connector(c);
        }
        let (tx, rx) = mpsc::channel();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvtier-engine".into())
            .spawn(move || step_loop(&mut core, rx, &sh))
            .map_err(|e| EngineError::Config(format!("cannot spawn the engine thread: {e}")))?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                tx: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
                shared,
                tokenizer: Arc::new(tokenizer),
                model_name,
                model_config,
                max_waiting: cfg.max_waiting,
                next_id: AtomicU64::new(0),
            }),
        })
    }

    /// Queue a request. Its events arrive on the returned receiver. `Overloaded` when
    /// `max_waiting` requests are already waiting; invalid requests get an `Error` event.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<GenerateEvent>, EngineError> {
        let sh = &self.inner.shared;
        let prev = sh.pending.fetch_add(1, Ordering::SeqCst);
        if prev >= self.inner.max_waiting {
            sh.pending.fetch_sub(1, Ordering::SeqCst);
            sh.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::Overloaded(prev));
        }
        let (etx, erx) = unbounded_channel();
        let id = RequestId::from(format!(
            "req-{}",
            self.inner.next_id.fetch_add(1, Ordering::Relaxed)
        ));
        let sent = match self.inner.tx.lock() {
            Ok(g) => g
                .as_ref()
                .map(|tx| tx.send(Command::Submit(id, req, etx)).is_ok())
                .unwrap_or(false),
            Err(_) => false,
        };
        if !sent {
            sh.pending.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::ShutDown);
        }
        Ok(erx)
    }

    /// Submit and wait for the whole answer (blocking; not for use inside an async runtime).
    pub fn generate_blocking(
        &self,
        req: GenerateRequest,
    ) -> Result<(Vec<u32>, FinishReason), EngineError> {
        let mut rx = self.submit(req)?;
        let mut out = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenerateEvent::Token(t) => out.push(t),
                GenerateEvent::Done { finish_reason, .. } => return Ok((out, finish_reason)),
                GenerateEvent::Error(e) => return Err(EngineError::InvalidRequest(e)),
            }
        }
        Err(EngineError::ShutDown)
    }

    /// The engine's tokenizer.
    pub fn tokenizer(&self) -> Arc<Tokenizer> {
        self.inner.tokenizer.clone()
    }

    /// The model's name (as served on `/v1/models`).
    pub fn model_name(&self) -> String {
        self.inner.model_name.clone()
    }

    /// The model's configuration.
    pub fn model_config(&self) -> &ModelConfig {
        &self.inner.model_config
    }

    /// A snapshot of the counters (updated after every step).
    pub fn metrics(&self) -> EngineMetrics {
        let sh = &self.inner.shared;
        let mut m = sh.metrics.lock().map(|g| g.clone()).unwrap_or_default();
        m.requests_rejected = sh.rejected.load(Ordering::Relaxed);
        m.queue_depth = sh.pending.load(Ordering::SeqCst) as u64;
        m
    }

    /// Forget the engine's G1 prefix cache (blocks stay allocated to their requests).
    pub fn reset_prefix_cache(&self) {
        if let Ok(g) = self.inner.tx.lock() {
            if let Some(tx) = g.as_ref() {
                let _ = tx.send(Command::ResetPrefixCache);
            }
        }
    }

    /// Block until the engine is idle: no request running or waiting and no kvtier transfer in
    /// flight (offloads confirmed, spills and remote puts done). `false` on timeout.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let (tx, rx) = mpsc::channel();
        let sent = match self.inner.tx.lock() {
            Ok(g) => g
                .as_ref()
                .map(|c| c.send(Command::WaitIdle(tx)).is_ok())
                .unwrap_or(false),
            Err(_) => false,
        };
        sent && rx.recv_timeout(timeout).is_ok()
    }

    /// Stop the step thread; open requests get an `Error` event. Idempotent.
    pub fn shutdown(&self) {
        self.inner.stop();
    }
}

fn step_loop(core: &mut EngineCore, rx: mpsc::Receiver<Command>, shared: &Shared) {
    let mut idle_waiters: Vec<mpsc::Sender<()>> = Vec::new();
    loop {
        if !idle_waiters.is_empty() && !core.has_work() && !core.has_pending() {
            for w in idle_waiters.drain(..) {
                let _ = w.send(());
            }
        }
        let cmd = if core.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(Command::Shutdown),
            }
        } else if core.has_pending() {
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Command::Shutdown),
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => Some(Command::Shutdown),
            }
        };
        match cmd {
            // Take every queued command before stepping so arrivals batch together.
            Some(Command::Submit(id, req, tx)) => core.add_request(id, req, tx),
            Some(Command::ResetPrefixCache) => core.reset_prefix_cache(),
            Some(Command::WaitIdle(w)) => idle_waiters.push(w),
            Some(Command::Shutdown) => {
                core.abort_all("engine shut down");
                break;
            }
            None => {
                core.step();
            }
        }
        if let Ok(mut m) = shared.metrics.lock() {
            *m = core.metrics.clone();
        }
        core.flush_events();
    }
    core.flush_events();
    if let Ok(mut m) = shared.metrics.lock() {
        *m = core.metrics.clone();
    }
}
