//! The crate-level error: one `#[non_exhaustive]` enum per family of operations, gathered here.
//!
//! Invariant: nothing an engine, a file or the network controls produces a panic; it produces one
//! of these, naming what was wrong.
pub use crate::config::ConfigError;
pub use crate::connector::ConnectorError;
pub use crate::layout::LayoutError;
pub use crate::pool::PoolError;
pub use crate::transfer::TransferError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
}
