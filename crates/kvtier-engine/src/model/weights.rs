//! Model weights: seeded random initialisation or a Hugging Face Llama safetensors checkpoint.
//!
//! Invariant: every matrix is stored row-major `[out, in]` as `nn.Linear` stores it, with exactly
//! the length its `ModelConfig` implies (checked at load time).
use std::path::Path;

use crate::model::safetensors::SafeTensors;
use crate::model::{ModelConfig, ModelError};

/// One decoder layer's weights, row-major f32.
pub struct LayerWeights {
    /// RMS norm before attention.
    pub input_norm: Vec<f32>,
    /// Query projection.
    pub wq: Vec<f32>,
    /// Key projection.
    pub wk: Vec<f32>,
    /// Value projection.
    pub wv: Vec<f32>,
    /// Attention output projection.
    pub wo: Vec<f32>,
    /// RMS norm before the MLP.
    pub post_norm: Vec<f32>,
    /// MLP gate projection.
    pub gate: Vec<f32>,
    /// MLP up projection.
    pub up: Vec<f32>,
    /// MLP down projection.
    pub down: Vec<f32>,
}

/// A Llama model's weights, row-major f32.
pub struct Weights {
    /// Token embeddings.
    pub embed: Vec<f32>,
    /// The decoder layers.
    pub layers: Vec<LayerWeights>,
    /// The final RMS norm.
    pub norm: Vec<f32>,
    /// `None` when tied to `embed`.
    pub lm_head: Option<Vec<f32>>,
}

/// SplitMix64 + Box-Muller: a tiny, portable, seeded normal generator.
struct Normal {
    state: u64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Self {
        Normal {
            state: seed ^ 0x6b76_7469_6572_0001,
            spare: None,
        }
    }
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let t = std::f64::consts::TAU * self.uniform();
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
    fn tensor(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (self.sample() * std) as f32).collect()
    }
}

impl Weights {
    /// Seeded N(0, std) weights with the stds of `make_tiny_llama.py` (embed 1.0, q/k/v 0.3, o 0.1,
    /// MLP 0.1, lm_head 0.2, norms 1): large enough that wrong KV changes the generated tokens.
    pub fn random(cfg: &ModelConfig, seed: u64) -> Self {
        let mut g = Normal::new(seed);
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.kv_dim();
        let embed = g.tensor(cfg.vocab_size * h, 1.0);
        let layers = (0..cfg.num_layers)
            .map(|_| LayerWeights {
                input_norm: vec![1.0; h],
                wq: g.tensor(q * h, 0.3),
                wk: g.tensor(kv * h, 0.3),
                wv: g.tensor(kv * h, 0.3),
                wo: g.tensor(h * q, 0.1),
                post_norm: vec![1.0; h],
                gate: g.tensor(i * h, 0.1),
                up: g.tensor(i * h, 0.1),
                down: g.tensor(h * i, 0.1),
            })
            .collect();
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(g.tensor(cfg.vocab_size * h, 0.2))
        };
        Weights {
            embed,
            layers,
            norm: vec![1.0; h],
            lm_head,
        }
    }

    /// Load `model.safetensors` (or the shards named by `model.safetensors.index.json`) from `dir`.
    pub fn load_dir(cfg: &ModelConfig, dir: &Path) -> Result<Self, ModelError> {
        let mut files = Vec::new();
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", index.display())))?;
            let mut names: Vec<String> = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.values()
                        .filter_map(|f| f.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names.dedup();
            for n in names {
                files.push(dir.join(n));
            }
        } else {
            files.push(dir.join("model.safetensors"));
        }
        let mut sts = Vec::new();
        for f in &files {
            let data = std::fs::read(f).map_err(|e| io_err(f, e))?;
            sts.push(SafeTensors::parse(data, &f.display().to_string())?);
        }
        let get = |name: &str, shape: &[usize]| -> Result<Option<Vec<f32>>, ModelError> {
            for st in &sts {
                if let Some(t) = st.get_f32(name, shape)? {
                    return Ok(Some(t));
                }
            }
            Ok(None)
        };
        let req = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
            get(name, shape)?.ok_or_else(|| ModelError::Weights(format!("tensor {name} missing")))
        };
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.kv_dim();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}.");
            layers.push(LayerWeights {
                input_norm: req(&format!("{p}input_layernorm.weight"), &[h])?,
                wq: req(&format!("{p}self_attn.q_proj.weight"), &[q, h])?,
                wk: req(&format!("{p}self_attn.k_proj.weight"), &[kv, h])?,
                wv: req(&format!("{p}self_attn.v_proj.weight"), &[kv, h])?,
                wo: req(&format!("{p}self_attn.o_proj.weight"), &[h, q])?,
                post_norm: req(&format!("{p}post_attention_layernorm.weight"), &[h])?,
                gate: req(&format!("{p}mlp.gate_proj.weight"), &[i, h])?,
                up: req(&format!("{p}mlp.up_proj.weight"), &[i, h])?,
                down: req(&format!("{p}mlp.down_proj.weight"), &[h, i])?,
            });
        }
        let embed = req("model.embed_tokens.weight", &[v, h])?;
        let lm_head = match get("lm_head.weight", &[v, h])? {
            Some(t) => Some(t),
            None if cfg.tie_word_embeddings => None,
            None => return Err(ModelError::Weights("tensor lm_head.weight missing".into())),
        };
        Ok(Weights {
            embed,
            layers,
            norm: req("model.norm.weight", &[h])?,
            lm_head,
        })
    }

    /// The weights as (Hugging Face name, shape, data), e.g. to write a checkpoint.
    pub fn named_tensors<'a>(&'a self, cfg: &ModelConfig) -> Vec<(String, Vec<usize>, &'a [f32])> {
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.kv_dim();
        let mut out: Vec<(String, Vec<usize>, &[f32])> = vec![
            ("model.embed_tokens.weight".into(), vec![v, h], &self.embed),
            ("model.norm.weight".into(), vec![h], &self.norm),
        ];
        if let Some(lm) = &self.lm_head {
            out.push(("lm_head.weight".into(), vec![v, h], lm));
        }
        for (l, w) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            out.push((format!("{p}input_layernorm.weight"), vec![h], &w.input_norm));
            out.push((format!("{p}self_attn.q_proj.weight"), vec![q, h], &w.wq));
            out.push((format!("{p}self_attn.k_proj.weight"), vec![kv, h], &w.wk));
            out.push((format!("{p}self_attn.v_proj.weight"), vec![kv, h], &w.wv));
            out.push((format!("{p}self_attn.o_proj.weight"), vec![h, q], &w.wo));
            out.push((
                format!("{p}post_attention_layernorm.weight"),
                vec![h],
                &w.post_norm,
            ));
            out.push((format!("{p}mlp.gate_proj.weight"), vec![i, h], &w.gate));
            out.push((format!("{p}mlp.up_proj.weight"), vec![i, h], &w.up));
            out.push((format!("{p}mlp.down_proj.weight"), vec![h, i], &w.down));
        }
        out
    }

    /// The output projection (the embedding when tied).
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

fn io_err(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Weights(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_is_seeded_and_roughly_normal() {
        let cfg = ModelConfig::builtin();
        let a = Weights::random(&cfg, 7);
        let b = Weights::random(&cfg, 7);
        let c = Weights::random(&cfg, 8);
        assert_eq!(a.embed, b.embed);
        assert_ne!(a.embed, c.embed);
        let n = a.embed.len() as f64;
        let mean = a.embed.iter().map(|x| *x as f64).sum::<f64>() / n;
        let var = a
            .embed
            .iter()
            .map(|x| (*x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }
}
