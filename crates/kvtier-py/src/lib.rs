//! Python bindings (PyO3, abi3): a thin layer over the kvtier leader and worker, built by maturin
//! into the extension module `kvtier._native` of the Python package `kvtier`.
//!
//! Invariant: no cache logic lives here. Each binding converts Python arguments into kvtier's
//! types, calls the core, and converts results and errors back; every Rust error reaches Python as
//! an exception of the `kvtier.KvtierError` tree ([`errors`]) and no panic crosses into the engine.
//!
//! Tensor descriptors convert into the core's layouts without Python:
//!
//! ```
//! use _native::tensor::{DeviceKind, TensorDesc};
//! let shape = vec![8, 2, 2, 64];
//! let desc = TensorDesc {
//!     data_ptr: 0x1000,
//!     strides: TensorDesc::contiguous_strides(&shape, 2),
//!     shape,
//!     itemsize: 2,
//!     dtype: "float16".into(),
//!     device: DeviceKind::Cpu,
//!     device_index: 0,
//!     owner: None,
//! };
//! let layout = desc.trtllm_layout(16).unwrap();
//! assert_eq!(layout.bytes_per_block(), 64 * 2 * 2 * 2);
//! ```
#![forbid(unsafe_code)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

use pyo3::prelude::*;

pub(crate) mod completions;
pub mod errors;
pub(crate) mod leader;
pub(crate) mod node;
pub(crate) mod promises;
pub(crate) mod records;
pub(crate) mod rendezvous;
pub(crate) mod seq;
pub(crate) mod settings;
pub mod tensor;
pub(crate) mod vllm_support;
pub(crate) mod worker;

/// Installs a `tracing` subscriber that writes kvtier's logs to stderr, filtered by `filter` (an
/// `EnvFilter` directive such as "kvtier=debug") or else `KVTIER_LOG`. Returns False if a
/// subscriber was already installed.
#[pyfunction]
#[pyo3(signature = (filter = None))]
fn init_logging(filter: Option<&str>) -> bool {
    use tracing_subscriber::EnvFilter;
    let filter = match filter {
        Some(f) => EnvFilter::try_new(f).unwrap_or_else(|_| EnvFilter::new("info")),
        None => EnvFilter::try_from_env("KVTIER_LOG").unwrap_or_else(|_| EnvFilter::new("warn")),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init()
        .is_ok()
}

/// kvtier's counter table (`kvtier::metrics::METRICS`): one dict per series with its stats `key`,
/// Prometheus `name`, `help`, `kind` ("counter" or "gauge") and `labels`.
#[pyfunction]
fn metrics_table(py: Python<'_>) -> PyResult<Vec<Py<pyo3::types::PyDict>>> {
    let mut out = Vec::with_capacity(kvtier::metrics::METRICS.len());
    for m in kvtier::metrics::METRICS {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("key", m.key)?;
        d.set_item("name", m.name)?;
        d.set_item("help", m.help)?;
        d.set_item("kind", m.kind.as_str())?;
        d.set_item("labels", m.labels.to_vec())?;
        out.push(d.unbind());
    }
    Ok(out)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<tensor::TensorDesc>()?;
    m.add_class::<records::PyStepRecord>()?;
    m.add_class::<leader::PyLeader>()?;
    m.add_class::<worker::PyWorker>()?;
    m.add_class::<completions::PyCompletions>()?;
    m.add_class::<completions::PyAllGroups>()?;
    m.add_class::<promises::PyPromises>()?;
    m.add_class::<node::PyNodeServer>()?;

    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(node::default_node_socket, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_table, m)?)?;
    m.add_function(wrap_pyfunction!(leader::match_groups, m)?)?;
    m.add_function(wrap_pyfunction!(worker::configured_tiers, m)?)?;
    Ok(())
}
