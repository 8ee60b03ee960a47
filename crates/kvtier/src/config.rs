//! Configuration: one typed struct. (Owned by the core helper; placeholder until it lands.)
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{setting}: {reason}")]
    Invalid { setting: String, reason: String },
}
