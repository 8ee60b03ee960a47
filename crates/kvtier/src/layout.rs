//! KV layouts. (Owned by the core helper; placeholder until it lands.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("tensor {tensor}: {reason}")]
    Mismatch { tensor: String, reason: String },
}
