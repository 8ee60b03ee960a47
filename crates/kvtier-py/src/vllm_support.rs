//! The bindings' door to the composition root ([`kvtier_io::compose`]): the Python `Leader` and
//! `Worker` (under vLLM and TensorRT-LLM alike) get their leader, transfer engine and remote
//! store only through [`composition`], the same code the reference engine uses.
//!
//! Invariant: every process of one model derives the same composition from the same settings
//! (identity from the adapter's `salt` setting, or `hashing.model`), so a producer's puts are a
//! consumer's hits, under a remote namespace no other model shares.
use kvtier::connector::messages::ClusterLayout;
use kvtier_io::compose::{ComposeError, Composition, EngineIdentity, ServingRole};

use crate::errors::{BridgeError, BridgeResult, Family};
use crate::settings::Settings;

/// The engine's identity: the adapter's `salt` setting (vLLM: `vllm|model|cache dtype|dtype|revision`;
/// TensorRT-LLM: its model identity), replaced by `hashing.model` when that is set.
pub(crate) fn identity(settings: &Settings) -> BridgeResult<EngineIdentity> {
    Ok(EngineIdentity::new(
        settings
            .salt()
            .map_err(BridgeError::from)?
            .unwrap_or_default(),
    ))
}

/// The composition for this engine over `cluster`.
pub(crate) fn composition(
    settings: &Settings,
    cluster: ClusterLayout,
) -> BridgeResult<Composition> {
    let plan = Composition::new(
        &settings.config,
        identity(settings)?,
        cluster,
        role(settings)?,
    )
    .map_err(bridge)?;
    Ok(
        match settings.kv_cache_group().map_err(BridgeError::from)? {
            Some((index, count, descriptor)) => plan.for_group(index, count, &descriptor),
            None => plan,
        },
    )
}

/// The engine's serving role from the adapter's `role` setting (vLLM's `kv_role`: `kv_both`,
/// `kv_producer`, `kv_consumer`, or their short forms); aggregated when unset.
pub(crate) fn role(settings: &Settings) -> BridgeResult<ServingRole> {
    match settings.role().map_err(BridgeError::from)? {
        None => Ok(ServingRole::Aggregated),
        Some(r) => ServingRole::from_vllm(&r).ok_or_else(|| {
            BridgeError::local(
                Family::Config,
                format!("role: {r:?} is not one of kv_both, kv_producer, kv_consumer"),
            )
        }),
    }
}

/// A composition error as the matching Python exception.
pub(crate) fn bridge(e: ComposeError) -> BridgeError {
    match e {
        ComposeError::Config(c) => c.into(),
        ComposeError::Leader(c) => c.into(),
        ComposeError::Io(io) => BridgeError::local(Family::Transfer, io.to_string()),
        ComposeError::Remote { .. } | ComposeError::Metrics(_) => {
            BridgeError::local(Family::Config, e.to_string())
        }
        other => BridgeError::local(Family::Connector, other.to_string()),
    }
}
