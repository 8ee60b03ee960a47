//! The engine-neutral connector: per-request slots (pure state machines), the leader that owns
//! them with the pools, the workers that own memory and execute transfers, and the messages
//! between them. Adapters (TensorRT-LLM, vLLM, the reference engine) only translate into
//! [`step::SchedulerStep`] and back.
//!
//! Invariant: nothing the engine passes in can panic this module; invalid input becomes a
//! [`ConnectorError`] naming the request and the field, and leaves every other request untouched.
pub mod completions;
pub(crate) mod fasthash;
pub mod groups;
pub(crate) mod jobs;
pub mod leader;
pub mod messages;
pub mod promises;
pub mod recovery;
pub mod slot;
pub(crate) mod slot_table;
pub mod step;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod worker;
#[cfg(feature = "zmq")]
pub mod zmq;
#[cfg(feature = "zmq")]
pub mod zmq_auth;

pub use completions::{AllGroups, Completions, FailedLoad, Finished, StepNotice};
pub use leader::{
    BlockReuse, Capacity, DiskPolicy, KvEvent, Leader, LeaderConfig, LeaderStats, RequestKey,
};
pub use messages::{
    ClusterLayout, LoadVerdict, LoadVerdicts, RankLayout, RequestLoad, RequestStore, StepMetadata,
    WorkerReport, PROTOCOL_VERSION,
};
pub use promises::{Allocation, HitSplit, Promises, StepOutbox};
pub use recovery::LoadRecovery;
pub use slot::{MatchRecord, OffloadBlock, OnboardBlock, Slot, SlotState};
pub use step::{SchedulerStep, StepRecord};
pub use worker::{FinishedReport, ReportSink, ShutdownError, Worker, WorkerLink};

/// Errors of the connector (leader, workers, their channel).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    /// The engine passed something the connector cannot accept; nothing was changed.
    #[error("request {request}: {field}: {reason}")]
    InvalidInput {
        /// The request it concerns.
        request: String,
        /// The argument that was wrong.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The connector's configuration is unusable.
    #[error("connector configuration: {0}")]
    Config(String),
    /// A pool operation failed where the connector's books said it could not.
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// The transfer layer refused a whole operation.
    #[error(transparent)]
    Transfer(#[from] crate::transfer::TransferError),
    /// A message could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
    /// Leader and worker disagree on the protocol version or the KV layout.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The leader <-> worker channel failed or timed out.
    #[error("channel: {0}")]
    Channel(String),
}

impl ConnectorError {
    pub(crate) fn invalid(
        request: &crate::ids::RequestId,
        field: &'static str,
        reason: impl Into<String>,
    ) -> Self {
        ConnectorError::InvalidInput {
            request: request.to_string(),
            field,
            reason: reason.into(),
        }
    }
}
