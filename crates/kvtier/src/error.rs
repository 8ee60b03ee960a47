//! The crate-level error: one `#[non_exhaustive]` enum per family of operations, gathered here.
//!
//! Invariant: nothing an engine, a file or the network controls produces a panic; it produces one
//! of these, naming what was wrong.
pub use crate::config::ConfigError;
pub use crate::connector::ConnectorError;
pub use crate::layout::LayoutError;
pub use crate::pool::PoolError;
pub use crate::transfer::TransferError;

/// Any error of kvtier, by family.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// KV layouts.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A tier's block pool.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The connector.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// Transfers.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}
