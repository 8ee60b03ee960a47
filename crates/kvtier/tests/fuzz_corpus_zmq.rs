//! The `zmq_wire` cargo-fuzz target of `fuzz/` run as a plain test over its committed corpus
//! (the other targets: `crates/kvtier-io/tests/fuzz_corpus.rs`, which says how the shim works).
#![cfg(feature = "zmq")]
#![allow(unused_attributes)] // the target's `#![no_main]`, meaningful only under cargo-fuzz
#![allow(unused_imports)] // its `use libfuzzer_sys::fuzz_target;`: the shim is in scope already
#![allow(clippy::unwrap_used)]

extern crate self as libfuzzer_sys;

/// `fuzz_target!(|data: &[u8]| { .. })` as `pub(crate) fn run(data: &[u8]) { .. }`.
#[macro_export]
macro_rules! fuzz_target {
    (|$data:ident: &[u8]| $body:block) => {
        pub(crate) fn run($data: &[u8]) $body
    };
}

#[path = "../../../fuzz/fuzz_targets/zmq_wire.rs"]
mod zmq_wire;

#[test]
fn zmq_wire_corpus() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/zmq_wire");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let r = std::panic::catch_unwind(|| zmq_wire::run(&bytes));
        assert!(r.is_ok(), "input {} panics", path.display());
        n += 1;
    }
    assert!(n > 0, "empty corpus {}", dir.display());
}
