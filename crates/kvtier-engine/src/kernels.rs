//! Hand-written f32 kernels with a fixed reduction order.
//!
//! Invariant (batch invariance): every output element is produced by one call of a function whose
//! loop order depends only on the vector lengths of the model (hidden size, head dim, ...), never
//! on how many tokens or sequences are in the batch. Rust does not contract `a * b + c` into FMA
//! nor reassociate float sums, so the same inputs give the same bits in any batch, any chunking,
//! any thread.

/// Dot product with eight fixed lanes, combined in a fixed tree, then the tail.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail
}

/// `y[t][o] = dot(x[t], w[o])` for `rows` input rows; `w` is row-major `[out_dim, in_dim]` (the
/// Hugging Face `nn.Linear` layout), `x` is `[rows, in_dim]`, `y` is `[rows, out_dim]`.
pub fn linear(x: &[f32], w: &[f32], in_dim: usize, out_dim: usize, y: &mut [f32]) {
    let rows = x.len() / in_dim.max(1);
    debug_assert_eq!(w.len(), in_dim * out_dim);
    debug_assert_eq!(y.len(), rows * out_dim);
    for (o, wr) in w.chunks_exact(in_dim).enumerate().take(out_dim) {
        for t in 0..rows {
            y[t * out_dim + o] = dot(&x[t * in_dim..(t + 1) * in_dim], wr);
        }
    }
}

/// RMSNorm of each row of `x` (`[rows, dim]`) into `y`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, y: &mut [f32]) {
    let dim = weight.len();
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ss = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((yv, xv), wv) in yr.iter_mut().zip(xr).zip(weight) {
            *yv = (xv * inv) * wv;
        }
    }
}

/// SiLU(gate) * up, element-wise, in place into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
    }
}

/// Element-wise `x += d`.
pub fn add_in_place(x: &mut [f32], d: &[f32]) {
    for (a, b) in x.iter_mut().zip(d) {
        *a += b;
    }
}

/// Rotary position embedding tables (Hugging Face "rotate half" convention).
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Rotary embedding tables for positions `0..max_pos` of a `head_dim` head.
    pub fn new(head_dim: usize, max_pos: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for i in 0..half {
                let inv_freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
                let ang = p as f64 * inv_freq;
                cos.push(ang.cos() as f32);
                sin.push(ang.sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotate one head vector (`2 * half` long) for position `pos` (must be < max_pos).
    pub fn apply(&self, v: &mut [f32], pos: usize) {
        let h = self.half;
        let c = &self.cos[pos * h..(pos + 1) * h];
        let s = &self.sin[pos * h..(pos + 1) * h];
        for i in 0..h {
            let a = v[i];
            let b = v[i + h];
            v[i] = a * c[i] - b * s[i];
            v[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// Index of the largest value; ties go to the lowest index; NaN never wins.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if x > bv {
            bv = x;
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_exact_small_integers() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..19).map(|i| (i % 3) as f32).collect();
        let want: f32 = (0..19).map(|i| (i * (i % 3)) as f32).sum();
        assert_eq!(dot(&a, &b), want);
    }

    #[test]
    fn linear_rows_are_independent_of_row_count() {
        let in_dim = 37;
        let out_dim = 5;
        let w: Vec<f32> = (0..in_dim * out_dim)
            .map(|i| ((i * 7919) % 101) as f32 / 37.0 - 1.3)
            .collect();
        let x: Vec<f32> = (0..3 * in_dim)
            .map(|i| ((i * 104729) % 89) as f32 / 13.0 - 3.1)
            .collect();
        let mut y3 = vec![0.0; 3 * out_dim];
        linear(&x, &w, in_dim, out_dim, &mut y3);
        for r in 0..3 {
            let mut y1 = vec![0.0; out_dim];
            linear(
                &x[r * in_dim..(r + 1) * in_dim],
                &w,
                in_dim,
                out_dim,
                &mut y1,
            );
            let a: Vec<u32> = y1.iter().map(|f| f.to_bits()).collect();
            let b: Vec<u32> = y3[r * out_dim..(r + 1) * out_dim]
                .iter()
                .map(|f| f.to_bits())
                .collect();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn rope_position_zero_is_identity_and_preserves_norm() {
        let rope = Rope::new(8, 16, 10000.0);
        let orig = vec![1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 0.5, 0.25];
        let mut v = orig.clone();
        rope.apply(&mut v, 0);
        assert_eq!(v, orig);
        rope.apply(&mut v, 7);
        assert_ne!(v, orig);
        let n0 = dot(&orig, &orig);
        let n1 = dot(&v, &v);
        assert!((n0 - n1).abs() < 1e-4);
    }

    #[test]
    fn argmax_ties_lowest_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN]), 1);
    }
}
