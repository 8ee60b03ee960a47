//! Names of remote values: a validated namespace plus the 128-bit sequence hash, prefixed with the
//! hash scheme version so that two schemes never read each other's values.
//!
//! Invariant: a [`Namespace`] holds 1..=64 characters from `[A-Za-z0-9_.-]` and does not start with
//! `.`, so it is safe both inside a Redis key and as one path component; the names built here are
//! injective in (scheme version, namespace, key).
use kvtier::hash::HASH_SCHEME_VERSION;
use kvtier::transfer::RemoteError;

/// A validated namespace: separates deployments (models, tenants, test runs) sharing one store.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Namespace {
    /// Longest namespace accepted, in characters.
    pub const MAX_LEN: usize = 64;

    /// Validate `ns` (1..=64 of `[A-Za-z0-9_.-]`, not starting with `.`).
    pub fn new(ns: &str) -> Result<Self, RemoteError> {
        let ok_chars = ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if ns.is_empty() || ns.len() > Self::MAX_LEN || !ok_chars || ns.starts_with('.') {
            return Err(RemoteError::Config(format!(
                "namespace {ns:?} must be 1..={} characters of [A-Za-z0-9_.-], not starting with '.'",
                Self::MAX_LEN
            )));
        }
        Ok(Namespace(ns.to_owned()))
    }

    /// The namespace as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The Redis key of `key`: `kvtier:v<scheme>:<ns>:<32 lowercase hex digits>`.
    pub fn redis_key(&self, key: u128) -> String {
        format!("kvtier:v{HASH_SCHEME_VERSION}:{}:{key:032x}", self.0)
    }

    /// The directory (relative to a store's root) that holds this namespace's files.
    pub fn dir_component(&self) -> String {
        format!("kvtier-v{HASH_SCHEME_VERSION}/{}", self.0)
    }
}

/// The 32 lowercase hex digits of `key`.
pub(crate) fn hex(key: u128) -> String {
    format!("{key:032x}")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn redis_key_format() {
        let ns = Namespace::new("llama-8b_t1.x").unwrap();
        assert_eq!(
            ns.redis_key(0xab),
            "kvtier:v1:llama-8b_t1.x:000000000000000000000000000000ab"
        );
        assert_eq!(
            ns.redis_key(u128::MAX).len(),
            "kvtier:v1:llama-8b_t1.x:".len() + 32
        );
        assert_eq!(ns.dir_component(), "kvtier-v1/llama-8b_t1.x");
    }

    #[test]
    fn bad_namespaces_are_rejected() {
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a:b",
            "a b",
            "ü",
            &"x".repeat(65),
        ] {
            assert!(
                matches!(Namespace::new(bad), Err(RemoteError::Config(_))),
                "{bad:?} accepted"
            );
        }
        assert!(Namespace::new(&"x".repeat(64)).is_ok());
    }
}
