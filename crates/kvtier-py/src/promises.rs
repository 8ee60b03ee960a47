//! `kvtier._native.Promises`: the books of an engine's scheduler side over its leaders (one per
//! KV cache group), a thin shell around [`kvtier::connector::Promises`]: which asynchronous loads
//! the engine is owed a report of, and what the next step's metadata carries to the workers.
//!
//! Invariant: no rule lives here; arguments are converted, the core decides. No lock: PyO3's
//! borrow flag gives each call exclusive access.
use std::collections::{HashMap, HashSet};

use kvtier::connector::{Allocation, HitSplit, Promises};
use kvtier::ids::{DeviceBlockId, RequestId};
use pyo3::prelude::*;

use crate::errors::Family;
use crate::seq::extract_seq;

/// `(sync_loads, delayed_frees, failed_loads, failed_async, recv_groups, delayed_groups)`.
type Outbox = (
    bool,
    Vec<String>,
    HashMap<String, Vec<u32>>,
    HashSet<String>,
    HashMap<String, Vec<usize>>,
    HashMap<String, Vec<usize>>,
);

fn by_request<V>(v: Vec<(RequestId, V)>) -> HashMap<String, V> {
    v.into_iter().map(|(q, x)| (q.to_string(), x)).collect()
}

/// The scheduler side's promise books (see `_native.pyi`).
#[pyclass(name = "Promises", module = "kvtier._native")]
#[derive(Default)]
pub(crate) struct PyPromises {
    books: Promises,
}

#[pymethods]
impl PyPromises {
    #[new]
    fn py_new() -> Self {
        Self::default()
    }

    /// The engine allocated a request's blocks (`kvtier::connector::Allocation`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, external_tokens, is_async, groups, complete, loading, failed, hit_sources = None))]
    fn allocated(
        &mut self,
        request_id: String,
        external_tokens: u64,
        is_async: bool,
        groups: usize,
        complete: bool,
        loading: &Bound<'_, PyAny>,
        failed: &Bound<'_, PyAny>,
        hit_sources: Option<HitSplit>,
    ) -> PyResult<()> {
        let loading: Vec<usize> = extract_seq(Family::Connector, "loading", loading)?;
        let failed: Vec<u32> = extract_seq(Family::Connector, "failed", failed)?;
        self.books.allocated(Allocation {
            request: RequestId::from(request_id),
            external_tokens,
            is_async,
            groups,
            complete,
            loading,
            failed: failed.into_iter().map(DeviceBlockId).collect(),
            hit_sources,
        });
        Ok(())
    }

    /// Group 0's hit sources taken at allocation, once (None: ask its leader).
    fn take_hit_sources(&mut self, request_id: String) -> Option<HitSplit> {
        self.books.take_hit_sources(&RequestId::from(request_id))
    }

    /// What the step's metadata carries besides the plans; `built`: the plans were built.
    fn take_step(&mut self, built: bool) -> Outbox {
        let o = self.books.take_step(built);
        (
            o.sync_loads,
            o.delayed_frees.into_iter().map(|q| q.to_string()).collect(),
            o.failed_loads
                .into_iter()
                .map(|(q, b)| (q.to_string(), b.into_iter().map(|b| b.0).collect()))
                .collect(),
            o.failed_async.into_iter().map(|q| q.to_string()).collect(),
            by_request(o.recv_groups),
            by_request(o.delayed_groups),
        )
    }

    /// The engine is told these requests were received.
    fn received(&mut self, request_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_ids: Vec<String> = extract_seq(Family::Connector, "request_ids", request_ids)?;
        let ids: Vec<RequestId> = request_ids.into_iter().map(RequestId::from).collect();
        self.books.received(&ids);
        Ok(())
    }

    /// The request finished; True while the engine still waits for its `finished_recving`.
    fn request_finished(&mut self, request_id: String) -> bool {
        self.books.request_finished(&RequestId::from(request_id))
    }

    /// The finished request's blocks stay with the engine until its stores are done.
    fn delay_free(
        &mut self,
        request_id: String,
        groups: &Bound<'_, PyAny>,
        several: bool,
    ) -> PyResult<()> {
        let groups: Vec<usize> = extract_seq(Family::Connector, "groups", groups)?;
        self.books
            .delay_free(RequestId::from(request_id), groups, several);
        Ok(())
    }
}
