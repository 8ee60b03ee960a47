//! The HTTP body parsers on hostile bytes (issue 28): the committed seeds `fuzz/seeds/http_body`
//! and 4,096 fixed mutations of them (fuzz/replay.rs) through `parse_chat` and
//! `parse_completion`. Neither panics, and a body either fails with an `ApiError` or yields a
//! request that fits the model: a non-empty prompt whose length plus `max_tokens` is within the
//! context, token ids inside the vocabulary.
#![allow(clippy::unwrap_used)]

#[path = "../../../../fuzz/replay.rs"]
mod replay;

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{parse_chat, parse_completion};
use crate::backend::fake::FakeBackend;
use crate::backend::Backend;

/// Bodies accepted, over the whole run: the seeds must reach past the refusals.
static ACCEPTED: AtomicUsize = AtomicUsize::new(0);

fn http_body(data: &[u8]) {
    let b = FakeBackend::new();
    for v in [parse_chat(&b, data), parse_completion(&b, data)]
        .into_iter()
        .flatten()
    {
        ACCEPTED.fetch_add(1, Ordering::Relaxed);
        let g = &v.gen;
        assert!(!g.prompt.is_empty(), "empty prompt accepted");
        assert!(g.max_tokens >= 1, "max_tokens 0 accepted");
        assert!(
            g.prompt.len() + g.max_tokens as usize <= b.max_model_len(),
            "{} + {} tokens exceed the context {}",
            g.prompt.len(),
            g.max_tokens,
            b.max_model_len()
        );
        assert!(
            g.prompt.iter().all(|&t| t < b.vocab_size()),
            "token id outside the vocabulary"
        );
    }
}

#[test]
fn http_bodies_never_panic_and_accept_only_what_fits() {
    let n = replay::replay("http_body", http_body);
    assert!(n > replay::MUTATIONS);
    assert!(
        ACCEPTED.load(Ordering::Relaxed) >= 4,
        "the seeds no longer parse"
    );
}
