//! Sequences from Python (token ids, block ids, request ids, step records), extracted with a
//! bound.
//!
//! Invariant: what a sequence claims is never trusted for an allocation. PyO3's own `Vec<T>`
//! extraction reserves `len(obj)` items before reading one, so an object whose `__len__` lies
//! (or a `range(10**10)`) aborted the engine's process (allocation failure) or raised a
//! `PanicException` ("capacity overflow"). Here the reservation is capped, the items are read
//! one by one, and a sequence of more than [`MAX_ITEMS`] items is a kvtier error naming the
//! argument. An item that does not convert is named by its index, its value shown at most
//! [`SHOWN`] characters long (not the whole sequence's repr).
use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::{new_err, Family};

/// The most items kvtier takes in one sequence: 64 Mi, above any context length (tokens), any
/// block table or any step's requests.
pub(crate) const MAX_ITEMS: usize = 1 << 26;

/// The most items reserved before reading them.
const RESERVE: usize = 1 << 16;

/// The most characters of a value an error message shows.
pub(crate) const SHOWN: usize = 80;

/// `repr(obj)`, cut to [`SHOWN`] characters.
pub(crate) fn shown(obj: &Bound<'_, PyAny>) -> String {
    let r = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    match r.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}...", &r[..cut]),
        None => r,
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// Extracts argument `name` as a `Vec<T>` from a sequence (list, tuple, NumPy array, any object
/// with `__getitem__` but a str or a dict). An item too large or negative for `T` is a kvtier
/// error of `family`; an item of the wrong type a `TypeError`; both name the item's index.
pub(crate) fn extract_seq<'py, T>(
    family: Family,
    name: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Vec<T>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    let not_a_sequence = || {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "argument '{name}': '{}' is not a sequence",
            type_name(obj)
        ))
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyDict>() {
        return Err(not_a_sequence());
    }
    if !obj.hasattr("__getitem__")? {
        return Err(not_a_sequence());
    }
    let too_long = |n: &dyn std::fmt::Display| {
        new_err(
            family,
            format!("{name}: {n} items is more than kvtier takes (at most {MAX_ITEMS})"),
        )
    };
    // `len()` is only a hint: an object without one, or whose `__len__` fails, is read anyway.
    let hint = match obj.len() {
        Ok(n) => n,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
            return Err(too_long(&"more than 2**63"));
        }
        Err(_) => 0,
    };
    if hint > MAX_ITEMS {
        return Err(too_long(&hint));
    }
    // An exact list or tuple's length is its real item count (no `__len__` of a subclass to lie):
    // PyO3's own conversion, faster, reserves exactly that; an item that does not convert is read
    // again below, where the error names it.
    if obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>() {
        if let Ok(v) = obj.extract::<Vec<T>>() {
            return Ok(v);
        }
    }
    let mut out = Vec::with_capacity(hint.min(RESERVE));
    for (i, item) in obj.try_iter()?.enumerate() {
        if i >= MAX_ITEMS {
            return Err(too_long(&"more"));
        }
        let item = item?;
        match item.extract::<T>().map_err(Into::<PyErr>::into) {
            Ok(v) => out.push(v),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
                return Err(new_err(
                    family,
                    format!(
                        "{name}: {} at index {i} is out of range (a non-negative integer is expected)",
                        shown(&item)
                    ),
                ));
            }
            Err(e)
                if e.get_type(obj.py())
                    .is(obj.py().get_type::<pyo3::exceptions::PyTypeError>()) =>
            {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "argument '{name}': item {i}: {}",
                    e.value(obj.py())
                )));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// [`extract_seq`] for an optional argument (`None` or absent: `None`).
pub(crate) fn extract_opt_seq<'py, T>(
    family: Family,
    name: &str,
    obj: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Vec<T>>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    match obj {
        Some(o) if !o.is_none() => extract_seq(family, name, o).map(Some),
        _ => Ok(None),
    }
}

/// [`extract_seq`] of a part of argument `name`; the part's own name (`item`, e.g. `name[key]`) is
/// built only when the part does not convert, read again to name it in the error (these run on
/// every step: no formatting on the way that succeeds).
fn extract_named<'py, T>(
    family: Family,
    name: &str,
    obj: &Bound<'py, PyAny>,
    item: impl FnOnce() -> String,
) -> PyResult<Vec<T>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    extract_seq(family, name, obj).or_else(|_| extract_seq(family, &item(), obj))
}

/// A dict of sequences by request id (`{request: [group or block, ...]}`), each value read by
/// [`extract_seq`] and named `name[request]`. A dict's own size is its real one (never a
/// `__len__` it defines), so only its values need the bound.
pub(crate) fn extract_seq_map<'py, T>(
    family: Family,
    name: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<HashMap<String, Vec<T>>>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    let d = obj.cast::<PyDict>().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "argument '{name}': '{}' is not a dict",
            type_name(obj)
        ))
    })?;
    let mut out = HashMap::with_capacity(d.len().min(RESERVE));
    for (k, v) in d.iter() {
        let key: String = k.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "argument '{name}': key {} is not a str",
                shown(&k)
            ))
        })?;
        let seq = extract_named(family, name, &v, || format!("{name}[{}]", shown(&k)))?;
        out.insert(key, seq);
    }
    Ok(out)
}

/// One `(a, b, c)` triple of sequences per KV cache group, `None` where the group could not
/// answer (the workers' `get_finished` answers), each sequence read by [`extract_seq`].
pub(crate) type Triples<A, B, C> = Vec<Option<(Vec<A>, Vec<B>, Vec<C>)>>;

/// [`Triples`] from argument `name` (a sequence of `None` or 3-item sequences).
pub(crate) fn extract_triples<'py, A, B, C>(
    family: Family,
    name: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<Triples<A, B, C>>
where
    A: pyo3::conversion::FromPyObjectOwned<'py>,
    B: pyo3::conversion::FromPyObjectOwned<'py>,
    C: pyo3::conversion::FromPyObjectOwned<'py>,
{
    let items: Vec<Bound<'py, PyAny>> = extract_seq(family, name, obj)?;
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if item.is_none() {
            out.push(None);
            continue;
        }
        let at = || format!("{name}[{i}]");
        let parts: Vec<Bound<'py, PyAny>> = extract_named(family, name, item, at)?;
        let [a, b, c] = parts.as_slice() else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "argument '{}': expected None or 3 sequences, got {} items",
                at(),
                parts.len()
            )));
        };
        out.push(Some((
            extract_named(family, name, a, || format!("{}[0]", at()))?,
            extract_named(family, name, b, || format!("{}[1]", at()))?,
            extract_named(family, name, c, || format!("{}[2]", at()))?,
        )));
    }
    Ok(out)
}
