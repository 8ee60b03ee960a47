//! Incremental detokenization for streaming.
//!
//! Invariant: the concatenation of every delta returned by [`Detokenizer::push`] followed by
//! [`Detokenizer::finish`] equals `codec.decode(all_tokens)`. Text that ends in an incomplete UTF-8
//! sequence (decoded as U+FFFD) is held back until a later token completes it or the stream ends.

use std::sync::Arc;

use crate::backend::TextCodec;

/// Turns a stream of token ids into a stream of text deltas.
pub struct Detokenizer {
    codec: Arc<dyn TextCodec>,
    tokens: Vec<u32>,
    emitted: usize,
}

impl Detokenizer {
    /// A detokenizer with no tokens yet.
    pub fn new(codec: Arc<dyn TextCodec>) -> Self {
        Detokenizer {
            codec,
            tokens: Vec::new(),
            emitted: 0,
        }
    }

    /// Adds one token; returns the text that is now final (possibly empty).
    pub fn push(&mut self, token: u32) -> String {
        self.tokens.push(token);
        let text = self.codec.decode(&self.tokens);
        if text.ends_with('\u{FFFD}') {
            return String::new();
        }
        self.take_from(text)
    }

    /// Flushes whatever is held back.
    pub fn finish(&mut self) -> String {
        let text = self.codec.decode(&self.tokens);
        self.take_from(text)
    }

    /// All tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn take_from(&mut self, text: String) -> String {
        // Decoding more tokens can in principle rewrite earlier text; never re-emit, never split a char.
        if self.emitted > text.len() || !text.is_char_boundary(self.emitted) {
            return String::new();
        }
        let delta = text[self.emitted..].to_string();
        self.emitted = text.len();
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::ByteCodec;

    #[test]
    fn holds_back_partial_utf8() {
        let mut d = Detokenizer::new(Arc::new(ByteCodec));
        let bytes = "aé€".as_bytes().to_vec();
        let mut out = String::new();
        let mut deltas = Vec::new();
        for b in &bytes {
            let delta = d.push(u32::from(*b));
            deltas.push(delta.clone());
            out.push_str(&delta);
        }
        out.push_str(&d.finish());
        assert_eq!(out, "aé€");
        assert_eq!(deltas, vec!["a", "", "é", "", "", "€"]);
    }

    #[test]
    fn finish_flushes_invalid_tail() {
        let mut d = Detokenizer::new(Arc::new(ByteCodec));
        assert_eq!(d.push(0xE2), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.tokens(), &[0xE2]);
    }
}
