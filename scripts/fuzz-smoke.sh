#!/usr/bin/env bash
# Builds every fuzz target of fuzz/ and runs each on its committed corpus.
#  1. Always (stable toolchain, also part of `cargo test --workspace` in CI): every target is
#     compiled as a plain test module and replayed over fuzz/corpus/<target>
#     (crates/kvtier-io/tests/fuzz_corpus.rs, crates/kvtier/tests/fuzz_corpus_zmq.rs).
#  2. Where cargo-fuzz and a nightly toolchain are installed: each target is built with
#     libFuzzer and fuzzed for FUZZ_SECONDS (default 10) on a copy of its corpus (the committed
#     corpus is not changed).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_INCREMENTAL=0
cargo test -p kvtier-io --test fuzz_corpus
cargo test -p kvtier --features zmq --test fuzz_corpus_zmq
if command -v cargo-fuzz >/dev/null 2>&1 && rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    secs=${FUZZ_SECONDS:-10}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cd fuzz
    for t in $(cargo +nightly fuzz list); do
        mkdir -p "$work/$t"; cp seeds/$t/* "$work/$t/"; [ -d "corpus/$t" ] && cp corpus/$t/* "$work/$t/" 2>/dev/null || true
        cargo +nightly fuzz run "$t" "$work/$t" -- -max_total_time="$secs"
    done
else
    echo "fuzz-smoke: cargo-fuzz or a nightly toolchain is missing: ran the corpus replay only"
fi
