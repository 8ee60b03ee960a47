//! Pools, one per tier. (Owned by the core helper; placeholder until it lands.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("pool exhausted: {0}")]
    Exhausted(String),
}
