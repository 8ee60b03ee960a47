//! Newtype identifiers shared by every layer.
//!
//! Invariant: an id of one kind is never usable where another kind is expected; the tier a
//! block id belongs to always travels with it where the two could be confused.
use compact_str::CompactString;
use serde::{Deserialize, Serialize};

/// The engine's request id, as a string (TensorRT-LLM uses ints, vLLM strings; both map here).
///
/// Ids of up to 24 bytes (every TensorRT-LLM id, vLLM's `cmpl-…` ids up to that length) are
/// stored inline: comparing, hashing and cloning them touch no heap memory, which keeps the
/// leader's per-record slot lookup to the map's own cache line. Serialised as a plain string.
#[derive(Clone, Debug, Default, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(CompactString);

impl std::hash::Hash for RequestId {
    /// As the id's `str` hashes (consistent with `eq`, which is byte equality).
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.as_str().hash(state)
    }
}

impl PartialEq for RequestId {
    /// Byte equality (as `str`'s), with ids of 8 to 16 bytes compared as two overlapping
    /// words: the leader compares a record's id with its slot's on every record.
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        match (word_pair(a), word_pair(b)) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        }
    }
}

/// The first and the last 8 bytes of an id of 8 to 16 bytes.
#[inline]
fn word_pair(s: &[u8]) -> Option<(u64, u64)> {
    let head: [u8; 8] = s.get(..8)?.try_into().ok()?;
    let tail: [u8; 8] = s.get(s.len().checked_sub(8)?..)?.try_into().ok()?;
    (s.len() <= 16).then(|| (u64::from_ne_bytes(head), u64::from_ne_bytes(tail)))
}

impl RequestId {
    /// The id of an engine request.
    pub fn new(id: impl AsRef<str>) -> Self {
        RequestId(CompactString::new(id.as_ref()))
    }

    /// The id as the engine gave it.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        RequestId(CompactString::new(s))
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        RequestId(CompactString::from(s))
    }
}

impl From<u64> for RequestId {
    fn from(v: u64) -> Self {
        use compact_str::ToCompactString;
        RequestId(v.to_compact_string())
    }
}

/// A block index in the engine's own (G1) KV cache, as the engine numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceBlockId(pub u32);

/// A block index inside one kvtier pool (G2 host, G3 disk, G4 remote). Identical on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

/// Identifies one transfer job from the leader's plan to its completion report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct JobId(pub u64);

/// The storage tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tier {
    /// G1: the engine's KV cache (GPU memory, or CPU memory for CPU engines).
    Device,
    /// G2: host memory owned by kvtier (pinned when CUDA is present).
    Host,
    /// G3: local disk.
    Disk,
    /// G4: shared remote store.
    Remote,
}

impl Tier {
    /// The lowercase name used in metrics labels and logs.
    pub fn label(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_compare_as_strings_at_every_length() {
        for n in 0..40 {
            let a: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            assert_eq!(RequestId::from(a.as_str()), RequestId::from(a.clone()));
            for k in 0..n {
                let mut b = a.clone().into_bytes();
                b[k] = b'#';
                let b = String::from_utf8(b).unwrap_or_default();
                assert_ne!(
                    RequestId::from(a.as_str()),
                    RequestId::from(b),
                    "len {n}, byte {k}"
                );
            }
            assert_ne!(
                RequestId::from(a.as_str()),
                RequestId::from(format!("{a}x"))
            );
        }
    }
}
