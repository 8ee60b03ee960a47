//! The Llama decoder: configuration, weights, and the batched forward pass over the paged KV cache.
//!
//! Invariant (batch invariance): the logits of a token, and the K/V it writes, depend only on the
//! token ids and positions of its own sequence and on the KV cache contents of its own blocks -
//! never on which other sequences share the batch or how the prompt was split into chunks.
pub mod config;
mod forward;
pub mod safetensors;
pub mod weights;

use std::path::Path;

pub use config::ModelConfig;
pub use forward::{LayerHooks, NoHooks, SeqChunk};
pub use weights::Weights;

use crate::kernels::Rope;

/// Why a model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The configuration is unusable.
    #[error("model config: {0}")]
    Config(String),
    /// The weights are missing, malformed or of the wrong shape.
    #[error("model weights: {0}")]
    Weights(String),
    /// A batch the forward pass cannot run.
    #[error("invalid batch: {0}")]
    Batch(String),
}

/// A Llama model: configuration, weights and rotary tables.
pub struct Model {
    /// Its configuration.
    pub config: ModelConfig,
    /// Its weights.
    pub weights: Weights,
    rope: Rope,
}

impl Model {
    /// Check `config` and build the model.
    pub fn new(config: ModelConfig, weights: Weights) -> Result<Self, ModelError> {
        config.validate()?;
        let rope = Rope::new(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
        );
        Ok(Model {
            config,
            weights,
            rope,
        })
    }

    /// The built-in seeded random model.
    pub fn builtin(seed: u64) -> Self {
        let config = ModelConfig::builtin();
        let weights = Weights::random(&config, seed);
        let rope = Rope::new(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
        );
        Model {
            config,
            weights,
            rope,
        }
    }

    /// A Hugging Face Llama directory: `config.json` + safetensors weights.
    pub fn load_dir(dir: &Path) -> Result<Self, ModelError> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| ModelError::Config(format!("{}: {e}", cfg_path.display())))?;
        let config = ModelConfig::from_hf_json(&text)?;
        let weights = Weights::load_dir(&config, dir)?;
        Model::new(config, weights)
    }
}
