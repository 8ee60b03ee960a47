//! The shared remote tier (G4) for the bindings: opening the configured store. Disaggregated
//! prefill/decode on vLLM hands its KV over through this tier; `Remote -> Device` loads go through
//! kvtier-io's `TransferEngine` (its own bounce buffer).
//!
//! Invariant: every process of one model opens the same store under the same namespace, so a
//! producer's puts are a consumer's hits.
use std::sync::Arc;

use kvtier::config::RemoteTarget;
use kvtier::transfer::RemoteStore;

use crate::errors::{BridgeError, BridgeResult, Family};
use crate::settings::Settings;

/// Key space of kvtier's blocks in a shared store. Sequence hashes already carry the model salt.
const NAMESPACE: &str = "kvtier-v1";

/// The configured remote store (`remote.url`), or None when there is no remote tier.
pub fn remote_store(settings: &Settings) -> BridgeResult<Option<Arc<dyn RemoteStore>>> {
    let url = match &settings.config.remote {
        None => return Ok(None),
        Some(RemoteTarget::Dir(path)) => format!("dir://{}", path.display()),
        Some(RemoteTarget::Redis(url)) => url.clone(),
    };
    kvtier_io::remote::from_url(&url, NAMESPACE)
        .map(Some)
        .map_err(|e| BridgeError::local(Family::Config, format!("remote.url {url}: {e}")))
}
