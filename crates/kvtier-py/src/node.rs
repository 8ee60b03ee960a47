//! `kvtier._native.NodeServer`: the node tier (`kvtier node`) started from Python, so a vLLM or
//! TensorRT-LLM installation (the wheel, no CLI binary) can run one shared host cache per machine
//! (`python -m kvtier.node`). The server runs on its own threads; this object owns it.
//!
//! Invariant: the server is shut down (socket and arena removed) by `shutdown` or when the
//! object is dropped; a start failure is a `ConfigError` naming the socket, never a panic.
use std::path::PathBuf;
use std::sync::Mutex;

use kvtier_io::storage::node::{HugePages, NodeOptions, NodeServer, SharePolicy};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{extract_arg, timeout_arg, BridgeError, Family};

/// A running node service (see `_native.pyi`).
#[pyclass(name = "NodeServer", module = "kvtier._native")]
pub(crate) struct PyNodeServer {
    inner: Mutex<Option<NodeServer>>,
    socket: PathBuf,
}

#[pymethods]
impl PyNodeServer {
    #[new]
    // One keyword argument per `kvtier node` flag: pyo3 maps Python's keywords onto them.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (socket, capacity_bytes, shm_dir = None, allowed_uids = None, share = "equal".to_string(), disk_dir = None, disk_bytes = None, huge_pages = "advise".to_string()))]
    fn new(
        socket: PathBuf,
        capacity_bytes: &Bound<'_, PyAny>,
        shm_dir: Option<PathBuf>,
        allowed_uids: Option<&Bound<'_, PyAny>>,
        share: String,
        disk_dir: Option<PathBuf>,
        disk_bytes: Option<&Bound<'_, PyAny>>,
        huge_pages: String,
    ) -> PyResult<Self> {
        let disk_bytes: u64 = match disk_bytes {
            Some(b) => extract_arg(Family::Config, "disk_bytes", b)?,
            None => 0,
        };
        let capacity_bytes: u64 = extract_arg(Family::Config, "capacity_bytes", capacity_bytes)?;
        let allowed_uids: Vec<u32> = match allowed_uids {
            Some(u) => crate::seq::extract_seq(Family::Config, "allowed_uids", u)?,
            None => Vec::new(),
        };
        if capacity_bytes == 0 {
            return Err(
                BridgeError::local(Family::Config, "capacity_bytes must be positive").into(),
            );
        }
        let mut opts = NodeOptions::new(socket.clone(), capacity_bytes);
        if let Some(d) = shm_dir {
            opts.shm_dir = d;
        }
        opts.allowed_uids = allowed_uids;
        opts.share = SharePolicy::parse(&share)
            .map_err(|e| BridgeError::local(Family::Config, format!("share: {e}")))?;
        if disk_dir.is_some() && disk_bytes == 0 {
            return Err(BridgeError::local(Family::Config, "disk_dir needs disk_bytes > 0").into());
        }
        opts.disk_dir = disk_dir;
        opts.disk_bytes = disk_bytes;
        opts.huge_pages = HugePages::parse(&huge_pages).ok_or_else(|| {
            BridgeError::local(
                Family::Config,
                format!("huge_pages must be 'advise' or 'collapse', got {huge_pages:?}"),
            )
        })?;
        let server = NodeServer::start(&opts).map_err(|e| {
            BridgeError::local(
                Family::Config,
                format!("starting the kvtier node on {}: {e}", socket.display()),
            )
        })?;
        Ok(PyNodeServer {
            inner: Mutex::new(Some(server)),
            socket,
        })
    }

    /// The socket engines attach to (`remote.url = "node://" + socket`).
    #[getter]
    fn socket(&self) -> String {
        self.socket.display().to_string()
    }

    /// The node's counters.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = g.as_ref().map(|n| n.stats()) {
            for (k, v) in [
                ("clients", s.clients),
                ("blocks", s.blocks),
                ("bytes_used", s.bytes_used),
                ("capacity", s.capacity),
                ("puts", s.puts),
                ("puts_full", s.puts_full),
                ("gets", s.gets),
                ("get_misses", s.get_misses),
                ("evictions", s.evictions),
                ("abandoned_puts", s.abandoned_puts),
                ("disk_blocks", s.disk_blocks),
                ("disk_spills", s.disk_spills),
                ("disk_hits", s.disk_hits),
                ("requests", s.requests),
                ("verified", s.verified),
                ("bytes_granted", s.bytes_granted),
            ] {
                d.set_item(k, v)?;
            }
        }
        Ok(d.unbind())
    }

    /// Stop serving within `timeout` seconds; removes the socket and the arena. Idempotent.
    #[pyo3(signature = (timeout = 5.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = timeout_arg(Family::Base, "timeout", timeout)?;
        let taken = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut n) = taken {
            py.detach(move || n.shutdown(t));
        }
        Ok(())
    }
}

/// The node socket a user's `kvtier node` and engines use when none is named: per user
/// (`$XDG_RUNTIME_DIR/kvtier-node/node.sock`, else `/tmp/kvtier-node-<uid>/node.sock`).
#[pyfunction]
pub(crate) fn default_node_socket() -> String {
    kvtier_io::storage::node::default_socket()
        .display()
        .to_string()
}
