//! The `zmq_wire` cargo-fuzz target of `fuzz/` run as a plain test over its seeds and mutations of them
//! (the other targets: `crates/kvtier-io/tests/fuzz_corpus.rs`, which says how the shim works).
#![cfg(feature = "zmq")]
#![allow(unused_attributes)] // the target's `#![no_main]`, meaningful only under cargo-fuzz
#![allow(unused_imports)] // its `use libfuzzer_sys::fuzz_target;`: the shim is in scope already
#![allow(clippy::unwrap_used)]

extern crate self as libfuzzer_sys;

#[path = "../../../fuzz/fuzz_targets/zmq_wire.rs"]
mod zmq_wire;

#[path = "../../../fuzz/replay.rs"]
mod replay;

#[test]
fn zmq_wire_corpus() {
    replay::replay("zmq_wire", zmq_wire::run);
}
