//! The adapter from the engine's connector hooks to kvtier's connector core (`Leader` + `Worker`).
//!
//! Invariant: this module only translates; it holds no cache logic of its own.
use crate::api::{EngineConfig, EngineError};
use crate::connector::{ConnectorSetup, EngineConnector};
use crate::model::ModelConfig;

pub(crate) fn build(
    _setup: &ConnectorSetup,
    _cfg: &EngineConfig,
    _model: &ModelConfig,
    _model_name: &str,
) -> Result<Box<dyn EngineConnector>, EngineError> {
    Err(EngineError::Connector(
        "the kvtier connector is not available in this build yet".into(),
    ))
}
