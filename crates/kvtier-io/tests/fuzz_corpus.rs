//! The cargo-fuzz targets of `fuzz/` run as plain tests over their seeds and mutations of them
//! (fuzz/replay.rs; #28: one target no longer compiled and nothing built them in CI). Each target file is compiled here
//! as a module, its `fuzz_target!` turned into a function by the shim below, and run on every
//! corpus input: a target that stops compiling, or an input that makes one panic, fails
//! `cargo test`. (The ZeroMQ target needs kvtier's `zmq` feature; `scripts/fuzz-smoke.sh`
//! builds every target with cargo-fuzz where a nightly toolchain is installed.)
#![allow(unused_attributes)] // the targets' `#![no_main]`, meaningful only under cargo-fuzz
#![allow(unused_imports)] // their `use libfuzzer_sys::fuzz_target;`: the shim is in scope already
#![allow(clippy::unwrap_used)]

// `use libfuzzer_sys::fuzz_target;` in the targets resolves to this crate's shim.
extern crate self as libfuzzer_sys;

#[path = "../../../fuzz/fuzz_targets/config_toml.rs"]
mod config_toml;
#[path = "../../../fuzz/fuzz_targets/disk_header.rs"]
mod disk_header;
#[path = "../../../fuzz/fuzz_targets/disk_journal.rs"]
mod disk_journal;
#[path = "../../../fuzz/fuzz_targets/node_books.rs"]
mod node_books;
#[path = "../../../fuzz/fuzz_targets/node_frames.rs"]
mod node_frames;
#[path = "../../../fuzz/fuzz_targets/pool_ops.rs"]
mod pool_ops;
#[path = "../../../fuzz/fuzz_targets/remote_frame.rs"]
mod remote_frame;
#[path = "../../../fuzz/fuzz_targets/settings_maps.rs"]
mod settings_maps;
#[path = "../../../fuzz/fuzz_targets/step_metadata.rs"]
mod step_metadata;

#[path = "../../../fuzz/replay.rs"]
mod replay;
use replay::replay;

#[test]
fn pool_ops_corpus() {
    replay("pool_ops", pool_ops::run);
}

#[test]
fn config_toml_corpus() {
    replay("config_toml", config_toml::run);
}

#[test]
fn remote_frame_corpus() {
    replay("remote_frame", remote_frame::run);
}

#[test]
fn step_metadata_corpus() {
    replay("step_metadata", step_metadata::run);
}

#[test]
fn node_frames_corpus() {
    replay("node_frames", node_frames::run);
    // The seeds reach past the Hello: the target checks real requests, not only refusals.
    let seed = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/node_frames/put"),
    )
    .unwrap();
    assert_eq!(
        kvtier_io::storage::node::decode_request_stream(&seed).len(),
        3
    );
}

#[test]
fn settings_maps_corpus() {
    replay("settings_maps", settings_maps::run);
}

#[test]
fn node_books_corpus() {
    replay("node_books", node_books::run);
}

#[test]
fn disk_journal_corpus() {
    replay("disk_journal", disk_journal::run);
}

#[test]
fn disk_header_corpus() {
    replay("disk_header", disk_header::run);
}
