//! How the node divides its arena among the namespaces (models) attached: each namespace's
//! *fair share* is `capacity * weight / sum of the weights of the namespaces attached now`.
//! Eviction takes from the namespace most above its share; a namespace at or below its share
//! loses blocks only to its own puts (`books.rs`). Shares are soft: an idle node lets any
//! namespace fill it, and a namespace above its share keeps its blocks until someone needs room.
//!
//! Policies (`kvtier node --share`, `python -m kvtier.node --share`):
//! - `equal` (the default): every namespace weighs 1;
//! - `weighted:NAME=W,NAME=W,...`: the namespaces matching NAME weigh W (an integer, 1..=1000000),
//!   every other namespace 1. A namespace is `<model name>-<16 hex digits of the identity>`
//!   (`EngineIdentity::namespace`); NAME matches it whole, or its model part (without the
//!   `-<16 hex>` suffix), so `weighted:Llama-3.1-8B=3,Qwen3-0.6B=1` needs no hashes.
//!
//! Invariant: parsing either yields a policy or an error naming the bad part; weights are >= 1,
//! so every attached namespace has a positive share.

/// Why a `--share` policy text was refused; each names the bad part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharePolicyError {
    /// Neither `equal` nor `weighted:...`.
    #[error("`{0}`: a share policy is `equal` or `weighted:NAME=W,...`")]
    Kind(String),
    /// An entry without `=`.
    #[error("`{0}`: expected NAME=WEIGHT")]
    Entry(String),
    /// An entry with an empty name.
    #[error("`{0}`: empty namespace name")]
    EmptyName(String),
    /// A weight that is not an integer.
    #[error("`{0}`: the weight must be an integer")]
    NotInteger(String),
    /// A weight outside 1..=1000000.
    #[error("`{0}`: the weight must be 1..={MAX_WEIGHT}")]
    Range(String),
    /// `weighted:` with no entry.
    #[error("`{0}`: no NAME=WEIGHT given")]
    Empty(String),
}

/// The capacity policy of a node (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum SharePolicy {
    /// Every attached namespace gets the same share.
    #[default]
    Equal,
    /// Shares in proportion to these weights (by namespace or model name); others weigh 1.
    Weighted(Vec<(String, u32)>),
}

const MAX_WEIGHT: u32 = 1_000_000;

impl SharePolicy {
    /// Parse `equal` or `weighted:NAME=W,...`.
    pub fn parse(text: &str) -> Result<Self, SharePolicyError> {
        let t = text.trim();
        if t == "equal" {
            return Ok(SharePolicy::Equal);
        }
        let Some(list) = t.strip_prefix("weighted:") else {
            return Err(SharePolicyError::Kind(t.to_owned()));
        };
        let mut out = Vec::new();
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((name, w)) = part.rsplit_once('=') else {
                return Err(SharePolicyError::Entry(part.to_owned()));
            };
            let name = name.trim();
            if name.is_empty() {
                return Err(SharePolicyError::EmptyName(part.to_owned()));
            }
            let w: u32 = w
                .trim()
                .parse()
                .map_err(|_| SharePolicyError::NotInteger(part.to_owned()))?;
            if !(1..=MAX_WEIGHT).contains(&w) {
                return Err(SharePolicyError::Range(part.to_owned()));
            }
            out.push((name.to_owned(), w));
        }
        if out.is_empty() {
            return Err(SharePolicyError::Empty(t.to_owned()));
        }
        Ok(SharePolicy::Weighted(out))
    }

    /// The weight of `namespace` (1 unless a weighted entry matches it).
    pub fn weight(&self, namespace: &str) -> u32 {
        let SharePolicy::Weighted(list) = self else {
            return 1;
        };
        // The model part: the namespace without its `-<16 hex>` identity suffix.
        let model = match namespace.rsplit_once('-') {
            Some((m, h)) if h.len() == 16 && h.chars().all(|c| c.is_ascii_hexdigit()) => m,
            _ => namespace,
        };
        list.iter()
            .find(|(n, _)| n == namespace || n == model)
            .map_or(1, |(_, w)| *w)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_match_whole_names_or_model_parts() {
        assert_eq!(SharePolicy::parse("equal").unwrap(), SharePolicy::Equal);
        let p = SharePolicy::parse("weighted: Llama-3.1-8B=3, q-00ff00ff00ff00ff=2").unwrap();
        assert_eq!(p.weight("Llama-3.1-8B-0123456789abcdef"), 3);
        assert_eq!(p.weight("q-00ff00ff00ff00ff"), 2);
        assert_eq!(p.weight("Llama-3.1-8B"), 3, "a whole name");
        assert_eq!(p.weight("Llama-3.1-8B-x"), 1, "`x` is no identity suffix");
        assert_eq!(p.weight("other-0123456789abcdef"), 1);
        assert_eq!(SharePolicy::Equal.weight("x"), 1);
        for bad in [
            "",
            "fair",
            "weighted:",
            "weighted:a",
            "weighted:=2",
            "weighted:a=0",
            "weighted:a=x",
            "weighted:a=2000000",
        ] {
            assert!(SharePolicy::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
