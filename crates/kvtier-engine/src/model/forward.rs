//! The batched forward pass: embeddings, per layer (RMSNorm, Q/K/V, RoPE, KV write, paged
//! grouped-query attention, O, RMSNorm, SwiGLU MLP), final norm and LM head.
//!
//! Invariants: every K/V row is written into the cache before any attention of the same layer
//! reads it, so a chunk attends to itself exactly as a later step would; attention reads keys in
//! ascending position order with a fixed-order softmax; the per-layer hooks run before and after
//! each layer (where a connector waits for loads and issues saves).
use crate::kernels::{add_in_place, dot, linear, rms_norm, swiglu};
use crate::kv_cache::KvCache;
use crate::model::{Model, ModelError};

/// One sequence's contribution to a batch: `tokens` at positions `start_pos..`, whose KV lives in
/// the blocks of `block_table` (which must cover `start_pos + tokens.len()` positions).
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The tokens to run.
    pub tokens: &'a [u32],
    /// Position of the first of them.
    pub start_pos: usize,
    /// The sequence's KV blocks, in order.
    pub block_table: &'a [u32],
    /// Compute the logits of the last token of this chunk.
    pub want_logits: bool,
}

/// Called around each layer of a forward pass.
pub trait LayerHooks {
    /// Before layer `layer` reads the KV cache (a connector waits for that layer's loads here).
    fn before_layer(&mut self, _layer: usize) {}
    /// After layer `layer` wrote its KV (a connector may issue that layer's saves here).
    fn after_layer(&mut self, _layer: usize) {}
}

/// Hooks that do nothing.
pub struct NoHooks;
impl LayerHooks for NoHooks {}

impl Model {
    /// Run one forward pass. Returns, per chunk, the last token's logits when `want_logits`.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        hooks: &mut dyn LayerHooks,
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let c = &self.config;
        let bs = kv.block_size();
        // Validate before touching anything.
        for (i, s) in batch.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(ModelError::Batch(format!("chunk {i} has no tokens")));
            }
            if end > c.max_position_embeddings {
                return Err(ModelError::Batch(format!(
                    "chunk {i} reaches position {end} > max {}",
                    c.max_position_embeddings
                )));
            }
            if s.block_table.len() * bs < end {
                return Err(ModelError::Batch(format!(
                    "chunk {i}: {} blocks cannot hold {end} positions",
                    s.block_table.len()
                )));
            }
            if let Some(b) = s
                .block_table
                .iter()
                .find(|b| **b as usize >= kv.num_blocks())
            {
                return Err(ModelError::Batch(format!(
                    "chunk {i}: block {b} out of range"
                )));
            }
            if let Some(t) = s.tokens.iter().find(|t| **t as usize >= c.vocab_size) {
                return Err(ModelError::Batch(format!(
                    "chunk {i}: token {t} >= vocab {}",
                    c.vocab_size
                )));
            }
        }
        let (h, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        let (qd, kvd, inter) = (nh * hd, c.kv_dim(), c.intermediate_size);
        // Flatten rows: (chunk index, position).
        let rows: Vec<(usize, usize)> = batch
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.tokens.len()).map(move |j| (i, s.start_pos + j)))
            .collect();
        let t = rows.len();
        let mut x = vec![0f32; t * h];
        let mut r = 0;
        for s in batch {
            for &tok in s.tokens {
                let tok = tok as usize;
                x[r * h..(r + 1) * h].copy_from_slice(&self.weights.embed[tok * h..(tok + 1) * h]);
                r += 1;
            }
        }
        let mut hbuf = vec![0f32; t * h];
        let mut q = vec![0f32; t * qd];
        let mut k = vec![0f32; t * kvd];
        let mut v = vec![0f32; t * kvd];
        let mut att = vec![0f32; t * qd];
        let mut o = vec![0f32; t * h];
        let mut g = vec![0f32; t * inter];
        let mut u = vec![0f32; t * inter];
        let group = nh / nkv;
        let scale = 1.0 / (hd as f32).sqrt();
        let max_pos = rows.iter().map(|r| r.1).max().unwrap_or(0);
        let mut scores = vec![0f32; max_pos + 1];
        let mut acc = vec![0f32; hd];

        for (l, lw) in self.weights.layers.iter().enumerate() {
            hooks.before_layer(l);
            rms_norm(&x, &lw.input_norm, c.rms_norm_eps, &mut hbuf);
            linear(&hbuf, &lw.wq, h, qd, &mut q);
            linear(&hbuf, &lw.wk, h, kvd, &mut k);
            linear(&hbuf, &lw.wv, h, kvd, &mut v);
            for (ri, &(ci, pos)) in rows.iter().enumerate() {
                for head in 0..nh {
                    self.rope
                        .apply(&mut q[ri * qd + head * hd..ri * qd + (head + 1) * hd], pos);
                }
                for head in 0..nkv {
                    self.rope.apply(
                        &mut k[ri * kvd + head * hd..ri * kvd + (head + 1) * hd],
                        pos,
                    );
                }
                let blk = batch[ci].block_table[pos / bs] as usize;
                kv.token_mut(blk, l, 0, pos % bs)
                    .copy_from_slice(&k[ri * kvd..(ri + 1) * kvd]);
                kv.token_mut(blk, l, 1, pos % bs)
                    .copy_from_slice(&v[ri * kvd..(ri + 1) * kvd]);
            }
            for (ri, &(ci, pos)) in rows.iter().enumerate() {
                let table = batch[ci].block_table;
                for head in 0..nh {
                    let kh = head / group;
                    let qv = &q[ri * qd + head * hd..ri * qd + (head + 1) * hd];
                    let mut m = f32::NEG_INFINITY;
                    for (j, sc) in scores.iter_mut().enumerate().take(pos + 1) {
                        let kt = kv.token(table[j / bs] as usize, l, 0, j % bs);
                        let s = dot(qv, &kt[kh * hd..(kh + 1) * hd]) * scale;
                        *sc = s;
                        if s > m {
                            m = s;
                        }
                    }
                    let mut sum = 0f32;
                    acc.fill(0.0);
                    for (j, sc) in scores.iter().enumerate().take(pos + 1) {
                        let e = (sc - m).exp();
                        sum += e;
                        let vt = kv.token(table[j / bs] as usize, l, 1, j % bs);
                        for (a, vv) in acc.iter_mut().zip(&vt[kh * hd..(kh + 1) * hd]) {
                            *a += e * vv;
                        }
                    }
                    let inv = 1.0 / sum;
                    for (dst, a) in att[ri * qd + head * hd..ri * qd + (head + 1) * hd]
                        .iter_mut()
                        .zip(&acc)
                    {
                        *dst = a * inv;
                    }
                }
            }
            linear(&att, &lw.wo, qd, h, &mut o);
            add_in_place(&mut x, &o);
            rms_norm(&x, &lw.post_norm, c.rms_norm_eps, &mut hbuf);
            linear(&hbuf, &lw.gate, h, inter, &mut g);
            linear(&hbuf, &lw.up, h, inter, &mut u);
            swiglu(&mut g, &u);
            linear(&g, &lw.down, inter, h, &mut o);
            add_in_place(&mut x, &o);
            hooks.after_layer(l);
        }

        let mut out = Vec::with_capacity(batch.len());
        let mut last_row = 0usize;
        let mut normed = vec![0f32; h];
        for s in batch {
            last_row += s.tokens.len();
            if s.want_logits {
                let r = last_row - 1;
                rms_norm(
                    &x[r * h..(r + 1) * h],
                    &self.weights.norm,
                    c.rms_norm_eps,
                    &mut normed,
                );
                let mut logits = vec![0f32; c.vocab_size];
                linear(
                    &normed,
                    self.weights.lm_head(),
                    h,
                    c.vocab_size,
                    &mut logits,
                );
                out.push(Some(logits));
            } else {
                out.push(None);
            }
        }
        Ok(out)
    }
}
