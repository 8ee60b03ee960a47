//! The step contract: one record per scheduled request per engine step, plus the requests that
//! finished. This is everything the connector learns about an engine's schedule.
//!
//! Invariant: `new_block_ids` are the device blocks appended to the request's table since its
//! last record; the slot, which owns the table, recognises ids it has already seen (TensorRT-LLM
//! reports a new request's blocks both at allocation and in its first record).
use serde::{Deserialize, Serialize};

use crate::ids::{DeviceBlockId, RequestId};

/// One scheduled request in one step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    /// The request.
    pub request_id: RequestId,
    /// Tokens appended to the request since its last record (the whole prompt for a new one).
    pub new_tokens: Vec<u32>,
    /// Device blocks appended to the request's block table since its last record.
    pub new_block_ids: Vec<DeviceBlockId>,
    /// Tokens whose KV the engine already holds before this step's forward pass.
    pub num_computed_tokens: usize,
    /// Tokens this step's forward pass computes (including speculative draft tokens).
    pub num_scheduled_tokens: usize,
    /// Of `num_scheduled_tokens`, how many are unverified draft tokens (never offloaded until accepted).
    pub num_draft_tokens: usize,
    /// First time this request is scheduled (TensorRT-LLM `new_requests`, vLLM `scheduled_new_reqs`).
    pub is_new: bool,
    /// Scheduled again after preemption: the device table is rebuilt from `new_block_ids`.
    pub resumed_from_preemption: bool,
}

/// One engine step as the connector sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerStep {
    /// Every scheduled request, in the scheduler's order.
    pub records: Vec<StepRecord>,
    /// Requests that finished since the previous step.
    pub finished: Vec<RequestId>,
}
