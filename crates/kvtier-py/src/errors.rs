//! The Python exception tree and the bridge from kvtier's Rust errors to it.
//!
//! Invariant: every error that leaves Rust towards Python is one of these exception types (or a
//! built-in `TypeError`/`ValueError` raised while converting arguments), carrying the Rust error's
//! message; nothing here panics. The tree mirrors the Rust error families one to one:
//!
//! ```text
//! KvtierError(Exception)          kvtier::Error
//! ├── ConfigError                 kvtier::config::ConfigError
//! ├── LayoutError (+ ValueError)  kvtier::layout::LayoutError   (a bad tensor is a bad value)
//! ├── PoolError                   kvtier::pool::PoolError
//! ├── ConnectorError              kvtier::connector::ConnectorError
//! └── TransferError               kvtier::transfer::TransferError
//! ```
//!
//! The types are created once per interpreter (guarded by a `PyOnceLock`) with the module name
//! `kvtier`, so `kvtier.LayoutError` is the same object as `kvtier._native.LayoutError`.
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// One family of kvtier errors, as seen from Python.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `kvtier.KvtierError`, the root: errors of no narrower family.
    Base,
    /// `kvtier.ConfigError`: settings ([`kvtier::config::ConfigError`]).
    Config,
    /// `kvtier.LayoutError`: KV tensor layouts ([`kvtier::layout`]).
    Layout,
    /// `kvtier.PoolError`: a tier's block pool ([`kvtier::pool::PoolError`]).
    Pool,
    /// `kvtier.ConnectorError`: the leader, the workers and their channel.
    Connector,
    /// `kvtier.TransferError`: copies between tiers.
    Transfer,
}

impl Family {
    /// Every family, root first (the order the exception types are created in).
    pub const ALL: [Family; 6] = [
        Family::Base,
        Family::Config,
        Family::Layout,
        Family::Pool,
        Family::Connector,
        Family::Transfer,
    ];

    /// The Python class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Family::Base => "KvtierError",
            Family::Config => "ConfigError",
            Family::Layout => "LayoutError",
            Family::Pool => "PoolError",
            Family::Connector => "ConnectorError",
            Family::Transfer => "TransferError",
        }
    }

    fn doc(self) -> &'static str {
        match self {
            Family::Base => "Base class of every error kvtier raises.",
            Family::Config => "Invalid or inconsistent kvtier configuration.",
            Family::Layout => {
                "A KV-cache tensor or layout that does not fit the model geometry (also a ValueError)."
            }
            Family::Pool => "A kvtier block pool could not satisfy a request.",
            Family::Connector => {
                "The engine called the connector with input it cannot accept, or in the wrong order."
            }
            Family::Transfer => "Moving KV blocks between tiers failed.",
        }
    }

    fn index(self) -> usize {
        match self {
            Family::Base => 0,
            Family::Config => 1,
            Family::Layout => 2,
            Family::Pool => 3,
            Family::Connector => 4,
            Family::Transfer => 5,
        }
    }
}

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn make_type<'py>(
    py: Python<'py>,
    family: Family,
    bases: Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "kvtier")?;
    ns.set_item("__doc__", family.doc())?;
    let ty = py
        .import("builtins")?
        .getattr("type")?
        .call1((family.class_name(), bases, ns))?;
    Ok(ty.cast_into::<PyType>()?)
}

fn types(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    TYPES.get_or_try_init(py, || {
        let base = make_type(
            py,
            Family::Base,
            PyTuple::new(py, [py.get_type::<PyException>()])?,
        )?;
        let mut out = vec![base.clone().unbind()];
        for family in &Family::ALL[1..] {
            let bases = if *family == Family::Layout {
                PyTuple::new(
                    py,
                    [
                        base.clone().into_any(),
                        py.get_type::<PyValueError>().into_any(),
                    ],
                )?
            } else {
                PyTuple::new(py, [base.clone()])?
            };
            out.push(make_type(py, *family, bases)?.unbind());
        }
        Ok(out)
    })
}

/// The Python class of `family`.
pub fn exception_type(py: Python<'_>, family: Family) -> PyResult<Bound<'_, PyType>> {
    Ok(types(py)?[family.index()].bind(py).clone())
}

/// A Python exception of `family` carrying `message`. If the classes themselves cannot be
/// created (interpreter shutting down), falls back to `RuntimeError` with the same message.
pub fn new_err(family: Family, message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match exception_type(py, family) {
        Ok(ty) => PyErr::from_type(ty, message),
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(message),
    })
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for family in Family::ALL {
        m.add(family.class_name(), exception_type(m.py(), family)?)?;
    }
    Ok(())
}

/// The bridge type: any kvtier error (or one raised by this crate) on its way to Python.
/// `?` converts the Rust families into it; `PyErr::from` turns it into the matching exception.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// An error of the core crates, mapped to its family by `kvtier_family`.
    #[error(transparent)]
    Kvtier(#[from] kvtier::Error),
    /// An error this crate detects itself (argument shapes, call order), with its family.
    #[error("{message}")]
    Local {
        /// The exception type it becomes.
        family: Family,
        /// The exception's message.
        message: String,
    },
}

impl BridgeError {
    /// An error this crate detects, raised in Python as `family`'s exception.
    pub fn local(family: Family, message: impl Into<String>) -> Self {
        BridgeError::Local {
            family,
            message: message.into(),
        }
    }

    /// The family whose exception type this error becomes in Python.
    pub fn family(&self) -> Family {
        match self {
            BridgeError::Local { family, .. } => *family,
            BridgeError::Kvtier(e) => kvtier_family(e),
        }
    }
}

fn kvtier_family(e: &kvtier::Error) -> Family {
    match e {
        kvtier::Error::Config(_) => Family::Config,
        kvtier::Error::Layout(_) => Family::Layout,
        kvtier::Error::Pool(_) => Family::Pool,
        kvtier::Error::Connector(_) => Family::Connector,
        kvtier::Error::Transfer(_) => Family::Transfer,
        // `kvtier::Error` is non-exhaustive: a family added later still reaches Python, as the base.
        #[allow(unreachable_patterns)]
        _ => Family::Base,
    }
}

macro_rules! bridge_from {
    ($($t:ty),*) => {$(
        impl From<$t> for BridgeError {
            fn from(e: $t) -> Self {
                BridgeError::Kvtier(kvtier::Error::from(e))
            }
        }
    )*};
}
bridge_from!(
    kvtier::config::ConfigError,
    kvtier::layout::LayoutError,
    kvtier::pool::PoolError,
    kvtier::connector::ConnectorError,
    kvtier::transfer::TransferError
);

impl From<BridgeError> for PyErr {
    fn from(e: BridgeError) -> PyErr {
        new_err(e.family(), e.to_string())
    }
}

/// Extracts argument `name` as `T`; an integer that does not fit `T` (negative where an unsigned
/// count is expected, or too large) is a kvtier error of `family` naming the argument, not
/// Python's bare `OverflowError`. Other conversion failures (a string where an int is expected)
/// stay `TypeError`.
pub fn extract_arg<'py, T>(family: Family, name: &str, obj: &Bound<'py, PyAny>) -> PyResult<T>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    match obj.extract::<T>().map_err(Into::<PyErr>::into) {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
            let shown = crate::seq::shown(obj);
            Err(new_err(
                family,
                format!("{name}: {shown} is out of range (a non-negative integer is expected)"),
            ))
        }
        // A wrong type: a TypeError naming the argument (as PyO3's own extraction does).
        Err(e)
            if e.get_type(obj.py())
                .is(obj.py().get_type::<pyo3::exceptions::PyTypeError>()) =>
        {
            Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "argument '{name}': {}",
                e.value(obj.py())
            )))
        }
        Err(e) => Err(e),
    }
}

/// [`extract_arg`] for an optional argument (`None` or absent: `None`).
pub fn extract_opt_arg<'py, T>(
    family: Family,
    name: &str,
    obj: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<T>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    match obj {
        Some(o) if !o.is_none() => extract_arg(family, name, o).map(Some),
        _ => Ok(None),
    }
}

/// A `timeout` argument in seconds as a [`Duration`](std::time::Duration): finite and
/// non-negative, capped at an hour; anything else (negative, NaN, infinite) is a kvtier error of
/// `family` naming the argument, never a panic in `Duration::from_secs_f64`.
pub fn timeout_arg(family: Family, name: &str, seconds: f64) -> PyResult<std::time::Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(new_err(
            family,
            format!("{name}: {seconds} is not a number of seconds >= 0"),
        ));
    }
    Ok(std::time::Duration::from_secs_f64(seconds.min(3600.0)))
}

/// Shorthand for results of binding functions.
pub type BridgeResult<T> = Result<T, BridgeError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_map_to_their_classes() {
        let e: BridgeError = kvtier::layout::LayoutError::Mismatch {
            tensor: "kv".into(),
            reason: "bad".into(),
        }
        .into();
        assert_eq!(e.family(), Family::Layout);
        let e: BridgeError = kvtier::config::ConfigError::Invalid {
            setting: "x".into(),
            reason: "y".into(),
        }
        .into();
        assert_eq!(e.family(), Family::Config);
        assert_eq!(e.to_string(), "x: y");
    }

    #[test]
    fn layout_error_is_value_error_and_kvtier_error() {
        Python::initialize();
        Python::attach(|py| {
            let err = PyErr::from(BridgeError::local(Family::Layout, "shape mismatch"));
            assert!(err.is_instance_of::<PyValueError>(py));
            let base = exception_type(py, Family::Base).unwrap();
            assert!(err.value(py).is_instance(&base).unwrap());
            assert_eq!(err.value(py).to_string(), "shape mismatch");
            let transfer = PyErr::from(BridgeError::local(Family::Transfer, "io"));
            assert!(!transfer.is_instance_of::<PyValueError>(py));
            assert!(transfer.value(py).is_instance(&base).unwrap());
        });
    }
}
