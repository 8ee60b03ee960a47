//! The engine-neutral connector: per-request slots (pure state machines), the leader that owns
//! them with the pools, the workers that own memory and execute transfers, and the messages
//! between them. Adapters (TensorRT-LLM, vLLM, the reference engine) only translate into
//! [`step::SchedulerStep`] and back.
pub mod step;

pub use step::{SchedulerStep, StepRecord};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    #[error("request {request}: {field}: {reason}")]
    InvalidInput {
        request: String,
        field: &'static str,
        reason: String,
    },
}
