//! Token blocks: an incremental token sequence that cuts full blocks and hashes them as they
//! complete (hash scheme v1, see [`crate::hash`]).
//!
//! Invariants: `hashes().len() == tokens().len() / block_size`; `hashes()[i]` is
//! `chain_block(hashes()[i-1], salt, block i's tokens)`, equal to what
//! [`sequence_hashes`](crate::hash::sequence_hashes) gives for the same tokens, however the
//! tokens were split across `append` calls; the partial tail block carries no hash.
//!
//! ```
//! use std::num::NonZeroUsize;
//! use kvtier::hash::HashSalt;
//! use kvtier::tokens::TokenBlockSequence;
//!
//! let bs = NonZeroUsize::new(4).unwrap();
//! let mut seq = TokenBlockSequence::new(HashSalt::new("my-model", None, None), bs);
//! assert_eq!(seq.append(&[1, 2, 3]).len(), 0); // no full block yet
//! assert_eq!(seq.append(&[4, 5]).len(), 1);    // block 0 completed
//! assert_eq!(seq.partial_len(), 1);            // token 5 waits in the tail
//! ```
use std::num::NonZeroUsize;

use crate::hash::{extend_chain, HashSalt, SequenceHash};

/// A request's tokens with the hashes of its full blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBlockSequence {
    salt: HashSalt,
    block_size: NonZeroUsize,
    tokens: Vec<u32>,
    hashes: Vec<SequenceHash>,
}

impl TokenBlockSequence {
    /// An empty sequence.
    pub fn new(salt: HashSalt, block_size: NonZeroUsize) -> Self {
        TokenBlockSequence {
            salt,
            block_size,
            tokens: Vec::new(),
            hashes: Vec::new(),
        }
    }

    /// A sequence holding `tokens` (their full blocks hashed).
    pub fn from_tokens(salt: HashSalt, block_size: NonZeroUsize, tokens: &[u32]) -> Self {
        let mut s = Self::new(salt, block_size);
        s.append(tokens);
        s
    }

    /// Append tokens; returns the hashes of the blocks this call completed (possibly none).
    pub fn append(&mut self, tokens: &[u32]) -> &[SequenceHash] {
        let bs = self.block_size.get();
        let before = self.hashes.len();
        self.tokens.extend_from_slice(tokens);
        extend_chain(&mut self.hashes, self.salt, &self.tokens[before * bs..], bs);
        &self.hashes[before..]
    }

    /// Keep only the first `len` tokens (e.g. rejected draft tokens, a rewind); drops the
    /// hashes of blocks that are no longer full. A `len` beyond the end changes nothing.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.hashes
            .truncate(self.tokens.len() / self.block_size.get());
    }

    /// Every token appended (and not truncated).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Hashes of the full blocks, in order.
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }

    /// The salt its blocks are hashed with.
    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size.get()
    }

    /// Tokens in the sequence.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Full blocks in the sequence.
    pub fn num_full_blocks(&self) -> usize {
        self.hashes.len()
    }

    /// Tokens in the partial tail block (0 when the sequence ends on a block boundary).
    pub fn partial_len(&self) -> usize {
        self.tokens.len() % self.block_size.get()
    }

    /// The tokens of full block `i`.
    pub fn block_tokens(&self, i: usize) -> Option<&[u32]> {
        let bs = self.block_size.get();
        (i < self.hashes.len()).then(|| &self.tokens[i * bs..(i + 1) * bs])
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::hash::{chain_block, sequence_hashes};

    fn bs(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    #[test]
    fn incremental_equals_one_shot_for_any_split() {
        let salt = HashSalt::new("m", None, None);
        let tokens: Vec<u32> = (0..100).map(|i| i * 7 + 3).collect();
        let want = sequence_hashes(salt, &tokens, 16);
        assert_eq!(want.len(), 6);
        for chunk in [1usize, 3, 15, 16, 17, 64, 100] {
            let mut s = TokenBlockSequence::new(salt, bs(16));
            let mut got = Vec::new();
            for c in tokens.chunks(chunk) {
                got.extend_from_slice(s.append(c));
            }
            assert_eq!(got, want, "chunk {chunk}");
            assert_eq!(s.hashes(), &want[..]);
            assert_eq!(s.partial_len(), 4);
            assert_eq!(s.len(), 100);
        }
    }

    #[test]
    fn append_reports_only_new_blocks() {
        let salt = HashSalt::new("m", None, None);
        let mut s = TokenBlockSequence::new(salt, bs(4));
        assert!(s.append(&[1, 2, 3]).is_empty());
        let h = s.append(&[4, 5]).to_vec();
        assert_eq!(h.len(), 1);
        assert_eq!(h[0], chain_block(None, salt, &[1, 2, 3, 4]));
        assert_eq!(s.block_tokens(0), Some(&[1, 2, 3, 4][..]));
        assert_eq!(s.block_tokens(1), None);
        assert_eq!(s.append(&[6, 7, 8, 9, 10, 11, 12]).len(), 2);
        assert_eq!(s.num_full_blocks(), 3);
    }

    #[test]
    fn truncate_drops_incomplete_blocks_and_rehashes_on_regrowth() {
        let salt = HashSalt::new("m", None, None);
        let mut s = TokenBlockSequence::from_tokens(salt, bs(4), &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(s.num_full_blocks(), 2);
        s.truncate(6);
        assert_eq!(s.num_full_blocks(), 1);
        assert_eq!(s.tokens(), &[1, 2, 3, 4, 5, 6]);
        // Different tokens after the rewind give a different block 1.
        s.append(&[70, 80]);
        let other = sequence_hashes(salt, &[1, 2, 3, 4, 5, 6, 70, 80], 4);
        assert_eq!(s.hashes(), &other[..]);
        s.truncate(100);
        assert_eq!(s.len(), 8);
    }
}
