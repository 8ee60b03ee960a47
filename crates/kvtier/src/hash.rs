//! Sequence hashes: chained, salted, 128-bit keys for full token blocks.
//!
//! Scheme v1 (test vectors: docs/arch/core.md, pinned by tests/hash_vectors.rs):
//! - `salt = xxh3_64(b"kvtier-v1\0" || model || 0 || lora || 0 || cache_salt)`;
//! - `hash(block i) = xxh3_128_with_seed(parent_le16 || tokens_as_u32_le, seed = salt)` where
//!   `parent_le16` is the previous block's hash as 16 little-endian bytes (16 zero bytes for block 0).
//!
//! Invariants: a hash identifies the whole prefix up to and including its block (chaining), so
//! two prompts share block i's key only if they share blocks 0..=i and the salt; partial tail
//! blocks carry no hash. The scheme is versioned: changing it changes `HASH_SCHEME_VERSION`.
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64};

/// Version of the hashing scheme; part of every persisted or remote key space.
pub const HASH_SCHEME_VERSION: u32 = 1;

/// The 128-bit key of a full block and, through chaining, of its whole prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u128);

/// The hash as hexadecimal (`{:032x}`: the form keys take in logs and remote store names).
impl std::fmt::LowerHex for SequenceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

/// What separates key spaces: model, LoRA adapter, tenant cache salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HashSalt(pub u64);

impl HashSalt {
    /// The salt of `model`, a LoRA adapter and a tenant's cache salt (any may be empty).
    pub fn new(model: &str, lora: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut buf = Vec::with_capacity(16 + model.len());
        buf.extend_from_slice(b"kvtier-v1\0");
        buf.extend_from_slice(model.as_bytes());
        buf.push(0);
        buf.extend_from_slice(lora.unwrap_or("").as_bytes());
        buf.push(0);
        buf.extend_from_slice(cache_salt.unwrap_or("").as_bytes());
        HashSalt(xxh3_64(&buf))
    }

    /// The salt of one request: this engine salt combined with the request's own identity (LoRA
    /// adapter, tenant cache salt, multimodal inputs, prompt embeddings: everything besides the
    /// token ids that changes its KV). Distinct identities give distinct salts, and no identity
    /// string maps back onto the engine salt itself (the domain prefix differs from `new`'s).
    pub fn for_request(self, identity: &str) -> Self {
        let mut buf = Vec::with_capacity(24 + identity.len());
        buf.extend_from_slice(b"kvtier-req-v1\0");
        buf.extend_from_slice(&self.0.to_le_bytes());
        buf.extend_from_slice(identity.as_bytes());
        HashSalt(xxh3_64(&buf))
    }
}

impl HashSalt {
    /// The salt of one KV cache group of an engine with several (vLLM's hybrid KV cache manager:
    /// a group of full-attention layers, one of sliding-window layers, ...): this engine salt
    /// combined with the group's `descriptor` (its index and layer kind). A group's blocks hold
    /// other layers' KV than another group's for the same tokens: their keys never meet.
    pub fn for_group(self, descriptor: &str) -> Self {
        let mut buf = Vec::with_capacity(24 + descriptor.len());
        buf.extend_from_slice(b"kvtier-group-v1\0");
        buf.extend_from_slice(&self.0.to_le_bytes());
        buf.extend_from_slice(descriptor.as_bytes());
        HashSalt(xxh3_64(&buf))
    }
}

/// Tokens per block hashed from a stack buffer; longer blocks use a heap buffer (same bytes).
const STACK_TOKENS: usize = 64;

/// Hash one full block given its parent's hash.
pub fn chain_block(
    parent: Option<SequenceHash>,
    salt: HashSalt,
    block_tokens: &[u32],
) -> SequenceHash {
    // The common block sizes get exact-size buffers, so the hash sees a constant length (its
    // size dispatch folds away) and no byte is zeroed only to be overwritten. Same bytes, same
    // hash, on every path.
    match block_tokens.len() {
        16 => fixed::<{ 16 + 4 * 16 }>(parent, salt, block_tokens),
        32 => fixed::<{ 16 + 4 * 32 }>(parent, salt, block_tokens),
        64 => fixed::<{ 16 + 4 * 64 }>(parent, salt, block_tokens),
        n if n <= STACK_TOKENS => {
            let mut buf = [0u8; 16 + 4 * STACK_TOKENS];
            let len = 16 + 4 * n;
            fill(&mut buf[..len], parent, block_tokens);
            SequenceHash(xxh3_128_with_seed(&buf[..len], salt.0))
        }
        n => {
            let mut v = vec![0u8; 16 + 4 * n];
            fill(&mut v, parent, block_tokens);
            SequenceHash(xxh3_128_with_seed(&v, salt.0))
        }
    }
}

#[inline(always)]
fn fixed<const N: usize>(
    parent: Option<SequenceHash>,
    salt: HashSalt,
    tokens: &[u32],
) -> SequenceHash {
    let mut buf = [0u8; N];
    fill(&mut buf, parent, tokens);
    SequenceHash(xxh3_128_with_seed(&buf, salt.0))
}

/// Write `parent_le16 || tokens_as_u32_le` into `buf` (exactly `16 + 4 * tokens.len()` bytes).
#[inline(always)]
fn fill(buf: &mut [u8], parent: Option<SequenceHash>, tokens: &[u32]) {
    let (head, body) = buf.split_at_mut(16);
    head.copy_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
    for (dst, t) in body.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
}

/// Hashes of every full block of `tokens` (the partial tail is ignored).
pub fn sequence_hashes(salt: HashSalt, tokens: &[u32], block_size: usize) -> Vec<SequenceHash> {
    let mut out = Vec::new();
    extend_chain(&mut out, salt, tokens, block_size);
    out
}

/// Append to `hashes` the hashes of every full block of `tokens`, chained from the last hash
/// already there (the blocks continue that sequence; a partial tail is ignored).
#[inline]
pub fn extend_chain(
    hashes: &mut Vec<SequenceHash>,
    salt: HashSalt,
    tokens: &[u32],
    block_size: usize,
) {
    if block_size == 0 {
        return;
    }
    hashes.reserve(tokens.len() / block_size);
    let mut parent = hashes.last().copied();
    for block in tokens.chunks_exact(block_size) {
        let h = chain_block(parent, salt, block);
        hashes.push(h);
        parent = Some(h);
    }
}
