//! Model hyper-parameters: the built-in model's fixed shape, or a Hugging Face Llama `config.json`.
//!
//! Invariant: a `ModelConfig` that passed [`ModelConfig::validate`] has consistent head
//! geometry (`num_heads % num_kv_heads == 0`, even `head_dim`) and non-zero sizes, so the
//! forward pass never has to check them again.
use serde::Deserialize;

use crate::model::ModelError;

/// Token ids of the built-in byte-level vocabulary: 0..=255 are bytes, then these specials.
pub const BYTE_VOCAB_BOS: u32 = 256;
/// End of sequence in the built-in byte vocabulary.
pub const BYTE_VOCAB_EOS: u32 = 257;
/// Vocabulary size of the built-in model (256 bytes, BOS, EOS, two reserved ids).
pub const BUILTIN_VOCAB: usize = 260;

/// A Llama model's configuration (Hugging Face `config.json` names).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention (query) heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens of the vocabulary.
    pub vocab_size: usize,
    /// Longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// Epsilon of the RMS norms.
    pub rms_norm_eps: f32,
    /// Base of the rotary embedding.
    pub rope_theta: f64,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// Tokens that end a generation.
    pub eos_token_ids: Vec<u32>,
    /// The output projection is the embedding's transpose.
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    /// The built-in model: hidden 128, 2 layers, 4 heads, 2 KV heads, head dim 32, byte vocab.
    pub fn builtin() -> Self {
        ModelConfig {
            hidden_size: 128,
            intermediate_size: 256,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
            vocab_size: BUILTIN_VOCAB,
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            bos_token_id: Some(BYTE_VOCAB_BOS),
            eos_token_ids: vec![BYTE_VOCAB_EOS],
            tie_word_embeddings: false,
        }
    }

    /// f32 values of K (or V) per token per layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Refuse a configuration the forward pass cannot run (a zero size, an odd `head_dim`, ...).
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |reason: String| Err(ModelError::Config(reason));
        if self.hidden_size == 0
            || self.intermediate_size == 0
            || self.num_layers == 0
            || self.num_heads == 0
            || self.num_kv_heads == 0
            || self.head_dim == 0
            || self.vocab_size == 0
            || self.max_position_embeddings == 0
        {
            return bad(format!("every size must be non-zero: {self:?}"));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even (RoPE)", self.head_dim));
        }
        if self.vocab_size > u32::MAX as usize {
            return bad(format!("vocab_size {} too large", self.vocab_size));
        }
        Ok(())
    }

    /// Parse a Hugging Face Llama `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        if let Some(arch) = raw.architectures.as_ref().and_then(|a| a.first()) {
            if arch != "LlamaForCausalLM" {
                return Err(ModelError::Config(format!(
                    "architecture {arch} is not supported (only LlamaForCausalLM)"
                )));
            }
        }
        if let Some(s) = raw.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(ModelError::Config(format!(
                "rope_scaling {s} is not supported"
            )));
        }
        if raw.hidden_act.as_deref().is_some_and(|a| a != "silu") {
            return Err(ModelError::Config(format!(
                "hidden_act {:?} is not supported (only silu)",
                raw.hidden_act
            )));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1));
        let eos_token_ids = match raw.eos_token_id {
            None => Vec::new(),
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "eos_token_id {other} is not a number"
                )))
            }
        };
        let cfg = ModelConfig {
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: raw.rope_theta.unwrap_or(10000.0),
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    hidden_act: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_tiny_llama_script_config() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false, "bos_token_id": 1,
          "eos_token_id": 2, "torch_dtype": "bfloat16"}"#;
        let c = ModelConfig::from_hf_json(text).unwrap();
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.vocab_size, 2048);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.max_position_embeddings, 4096);
    }

    #[test]
    fn rejects_bad_head_geometry() {
        let text = r#"{"hidden_size": 96, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 3, "num_key_value_heads": 2, "vocab_size": 10}"#;
        assert!(matches!(
            ModelConfig::from_hf_json(text),
            Err(ModelError::Config(_))
        ));
    }
}
