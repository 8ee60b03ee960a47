//! `kvtier._native.StepRecord` and the conversion of a step record from Python (a
//! `StepRecord`, a tuple or a dict) into the core's [`StepRecord`].
//!
//! Invariant: every count is extracted here so that a negative or misspelled one is a kvtier
//! `ConnectorError` naming the argument, never a bare `OverflowError` or a silently dropped
//! field. Page ids of a tuple or dict record may be `-1` (TensorRT-LLM's `BAD_PAGE_INDEX`: no
//! page), passed on as [`HOLE`] for the leader to decide (`connector::leader` `unpaged.rs`); any
//! other negative id is refused.
use kvtier::connector::slot::HOLE;
use kvtier::connector::step::StepRecord;
use kvtier::ids::{DeviceBlockId, RequestId};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::{extract_arg, Family};
use crate::seq::extract_seq;

/// One scheduled request in one step (see `_native.pyi`).
#[pyclass(name = "StepRecord", module = "kvtier._native")]
#[derive(Clone, Debug)]
pub(crate) struct PyStepRecord {
    /// The record the leader consumes.
    pub(crate) inner: StepRecord,
}

#[pymethods]
impl PyStepRecord {
    #[new]
    #[pyo3(signature = (request_id, new_tokens, new_block_ids, num_computed_tokens, num_scheduled_tokens, *, num_draft_tokens = None, is_new = false, resumed_from_preemption = false))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        request_id: String,
        new_tokens: &Bound<'_, PyAny>,
        new_block_ids: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
        num_scheduled_tokens: &Bound<'_, PyAny>,
        num_draft_tokens: Option<&Bound<'_, PyAny>>,
        is_new: bool,
        resumed_from_preemption: bool,
    ) -> PyResult<Self> {
        // Integers are extracted here, not by PyO3, so that a negative count is a kvtier
        // ConnectorError naming the argument rather than a bare OverflowError.
        let c = Family::Connector;
        let new_tokens: Vec<u32> = extract_seq(c, "new_tokens", new_tokens)?;
        let new_block_ids: Vec<u32> = extract_seq(c, "new_block_ids", new_block_ids)?;
        let num_computed_tokens = extract_arg(c, "num_computed_tokens", num_computed_tokens)?;
        let num_scheduled_tokens = extract_arg(c, "num_scheduled_tokens", num_scheduled_tokens)?;
        let num_draft_tokens = match num_draft_tokens {
            Some(v) => extract_arg(c, "num_draft_tokens", v)?,
            None => 0,
        };
        Ok(PyStepRecord {
            inner: StepRecord {
                request_id: RequestId::from(request_id),
                new_tokens,
                new_block_ids: new_block_ids.into_iter().map(DeviceBlockId).collect(),
                num_computed_tokens,
                num_scheduled_tokens,
                num_draft_tokens,
                is_new,
                resumed_from_preemption,
            },
        })
    }
    #[getter]
    fn request_id(&self) -> &str {
        self.inner.request_id.as_str()
    }
    #[getter]
    fn new_tokens(&self) -> Vec<u32> {
        self.inner.new_tokens.clone()
    }
    #[getter]
    fn new_block_ids(&self) -> Vec<u32> {
        self.inner.new_block_ids.iter().map(|b| b.0).collect()
    }
    #[getter]
    fn num_computed_tokens(&self) -> usize {
        self.inner.num_computed_tokens
    }
    #[getter]
    fn num_scheduled_tokens(&self) -> usize {
        self.inner.num_scheduled_tokens
    }
    #[getter]
    fn num_draft_tokens(&self) -> usize {
        self.inner.num_draft_tokens
    }
    #[getter]
    fn is_new(&self) -> bool {
        self.inner.is_new
    }
    #[getter]
    fn resumed_from_preemption(&self) -> bool {
        self.inner.resumed_from_preemption
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.inner)
    }
}

/// Page ids from Python: `-1` (no page) becomes [`HOLE`]; other negative or too large ids are a
/// kvtier `ConnectorError` naming `name`.
pub(crate) fn page_ids(
    family: Family,
    name: &str,
    obj: &Bound<'_, PyAny>,
) -> PyResult<Vec<DeviceBlockId>> {
    let raw: Vec<i64> = crate::seq::extract_seq(family, name, obj)?;
    raw.into_iter()
        .map(|b| match b {
            -1 => Ok(HOLE),
            // `HOLE` itself (u32::MAX) is accepted as the hole it is.
            b if (0..=i64::from(HOLE.0)).contains(&b) => Ok(DeviceBlockId(b as u32)),
            b => Err(crate::errors::new_err(
                family,
                format!("{name}: {b} is out of range (a page id, or -1 for no page, is expected)"),
            )),
        })
        .collect()
}

/// The keys of a step record given as a dict.
const RECORD_KEYS: &[&str] = &[
    "request_id",
    "new_tokens",
    "new_block_ids",
    "num_computed_tokens",
    "num_scheduled_tokens",
    "num_draft_tokens",
    "is_new",
    "resumed_from_preemption",
];

pub(crate) fn record_from_py(obj: &Bound<'_, PyAny>) -> PyResult<StepRecord> {
    if let Ok(r) = obj.cast::<PyStepRecord>() {
        return Ok(r.borrow().inner.clone());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        // (request_id, new_tokens, new_block_ids, num_computed, num_scheduled
        //  [, num_draft, is_new, resumed[, priorities]]): the cheapest form for per-step calls;
        // `priorities` (one per new block, or None) is read by `build_step`.
        let n = t.len();
        if !(5..=9).contains(&n) {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "a step record tuple has 5 to 9 items, got {n}"
            )));
        }
        let flag = |i: usize| -> PyResult<bool> {
            if i < n {
                t.get_item(i)?.extract()
            } else {
                Ok(false)
            }
        };
        let c = Family::Connector;
        return Ok(StepRecord {
            request_id: RequestId::new(t.get_item(0)?.str()?.to_str()?),
            new_tokens: extract_seq(c, "new_tokens", &t.get_item(1)?)?,
            new_block_ids: page_ids(c, "new_block_ids", &t.get_item(2)?)?,
            num_computed_tokens: extract_arg(c, "num_computed_tokens", &t.get_item(3)?)?,
            num_scheduled_tokens: extract_arg(c, "num_scheduled_tokens", &t.get_item(4)?)?,
            num_draft_tokens: if n > 5 {
                extract_arg(c, "num_draft_tokens", &t.get_item(5)?)?
            } else {
                0
            },
            is_new: flag(6)?,
            resumed_from_preemption: flag(7)?,
        });
    }
    let d = obj.cast::<PyDict>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(
            "a step record must be a StepRecord, a tuple or a dict",
        )
    })?;
    let req = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(k)?.ok_or_else(|| {
            crate::errors::new_err(Family::Connector, format!("step record without {k:?}"))
        })
    };
    // A misspelled key (`num_computed_token`) would silently drop a field: refuse it by name.
    for k in d.keys() {
        let k = k.str()?.to_string();
        if !RECORD_KEYS.contains(&k.as_str()) {
            return Err(crate::errors::new_err(
                Family::Connector,
                format!(
                    "step record has an unknown key {k:?} (known: {})",
                    RECORD_KEYS.join(", ")
                ),
            ));
        }
    }
    let opt = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { d.get_item(k) };
    let c = Family::Connector;
    let request_id: String = req("request_id")?.str()?.to_string();
    Ok(StepRecord {
        request_id: RequestId::from(request_id),
        new_tokens: extract_seq(c, "new_tokens", &req("new_tokens")?)?,
        new_block_ids: page_ids(c, "new_block_ids", &req("new_block_ids")?)?,
        num_computed_tokens: extract_arg(c, "num_computed_tokens", &req("num_computed_tokens")?)?,
        num_scheduled_tokens: extract_arg(
            c,
            "num_scheduled_tokens",
            &req("num_scheduled_tokens")?,
        )?,
        num_draft_tokens: opt("num_draft_tokens")?
            .map(|v| extract_arg(c, "num_draft_tokens", &v))
            .transpose()?
            .unwrap_or(0),
        is_new: opt("is_new")?
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or(false),
        resumed_from_preemption: opt("resumed_from_preemption")?
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or(false),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod record_tests {
    use super::*;
    use pyo3::types::PyList;

    fn family_of(py: Python<'_>, e: &PyErr) -> Option<Family> {
        Family::ALL[1..].iter().copied().find(|f| {
            crate::errors::exception_type(py, *f)
                .map(|t| e.value(py).is_instance(&t).unwrap_or(false))
                .unwrap_or(false)
        })
    }

    /// Regression (#13, unclear errors): a misspelled key in a step-record dict was accepted (its
    /// field silently took the default) and a negative count raised a bare OverflowError.
    #[test]
    fn misspelled_keys_and_negative_counts_are_kvtier_errors() {
        Python::initialize();
        Python::attach(|py| {
            let d = PyDict::new(py);
            d.set_item("request_id", "r").unwrap();
            d.set_item("new_tokens", PyList::new(py, [1u32, 2]).unwrap())
                .unwrap();
            d.set_item("new_block_ids", PyList::new(py, [0u32]).unwrap())
                .unwrap();
            d.set_item("num_computed_tokens", 0).unwrap();
            d.set_item("num_scheduled_tokens", 2).unwrap();
            assert!(record_from_py(d.as_any()).is_ok());
            d.set_item("num_draft_token", 1).unwrap();
            let e = record_from_py(d.as_any()).unwrap_err();
            assert_eq!(family_of(py, &e), Some(Family::Connector));
            assert!(e.to_string().contains("num_draft_token"), "{e}");
            d.del_item("num_draft_token").unwrap();
            d.set_item("num_computed_tokens", -1).unwrap();
            let e = record_from_py(d.as_any()).unwrap_err();
            assert!(!e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py));
            assert_eq!(family_of(py, &e), Some(Family::Connector));
            assert!(e.to_string().contains("num_computed_tokens: -1"), "{e}");
            let t = PyTuple::new(
                py,
                [
                    "r".into_pyobject(py).unwrap().into_any(),
                    PyList::new(py, [1i64]).unwrap().into_any(),
                    PyList::new(py, [-3i64]).unwrap().into_any(),
                    0i64.into_pyobject(py).unwrap().into_any(),
                    1i64.into_pyobject(py).unwrap().into_any(),
                ],
            )
            .unwrap();
            let e = record_from_py(t.as_any()).unwrap_err();
            assert_eq!(family_of(py, &e), Some(Family::Connector), "{e}");
            assert!(e.to_string().contains("new_block_ids"), "{e}");
        });
    }
}
