//! The byte-level tokenizer: ids 0..=255 are the UTF-8 bytes of the text; ids above are specials.
//!
//! Used for the built-in model and, as a documented simplification, for checkpoint directories too
//! (their `tokenizer.json` is not interpreted: the `tokenizers` crate is too heavy to build here).
//! Invariant: `decode(encode(s)) == s` for every string; special and out-of-range ids decode to
//! nothing.
use crate::model::config::{BYTE_VOCAB_BOS, BYTE_VOCAB_EOS};

/// A byte-level tokenizer: ids 0..=255 are bytes, the rest specials that decode to nothing.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    vocab_size: usize,
    eos: Vec<u32>,
    bos: Option<u32>,
}

impl Tokenizer {
    /// A byte-level tokenizer of `vocab_size` ids with these specials.
    pub fn byte_level(vocab_size: usize, bos: Option<u32>, eos: Vec<u32>) -> Self {
        Tokenizer {
            vocab_size,
            eos,
            bos,
        }
    }

    /// The built-in model's tokenizer (BOS 256, EOS 257).
    pub fn builtin() -> Self {
        Tokenizer::byte_level(
            crate::model::config::BUILTIN_VOCAB,
            Some(BYTE_VOCAB_BOS),
            vec![BYTE_VOCAB_EOS],
        )
    }

    /// Text -> ids (no BOS is added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Ids -> text; invalid UTF-8 becomes U+FFFD, ids >= 256 are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Raw bytes of ids (for streaming decoders that buffer partial UTF-8 sequences).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        ids.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect()
    }

    /// Ids of the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    /// Tokens that end a generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }
    /// The beginning-of-sequence token, if any.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_utf8() {
        let t = Tokenizer::builtin();
        let s = "héllo, wörld ✓";
        let ids = t.encode(s);
        assert_eq!(ids.len(), s.len());
        assert_eq!(t.decode(&ids), s);
        let mut with_special = ids.clone();
        with_special.push(BYTE_VOCAB_EOS);
        assert_eq!(t.decode(&with_special), s);
    }
}
