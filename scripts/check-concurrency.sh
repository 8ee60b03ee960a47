#!/usr/bin/env bash
# Miri on kvtier-io's unsafe host/device/bounce code paths that Miri can run, and loom on the
# Python bindings' rendezvous and on the worker's task queue (#13). Needs a nightly toolchain with Miri
# (`rustup toolchain install nightly --component miri`); loom comes from crates.io like any
# dependency. Uses its own target dirs (Miri's and loom's builds do not mix with the normal one).
# What Miri cannot run is left out here, not hidden: mmap with flags other than
# MAP_PRIVATE|MAP_ANONYMOUS (the shared node arena), io_uring and O_DIRECT disk I/O, CUDA FFI,
# the x86 streaming-store intrinsics (inline assembly; `copy_stream` takes its plain-copy path).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-$PWD/target}
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-permissive-provenance -Zmiri-disable-isolation}"

echo "== miri: kvtier-io unit tests (aligned buffers, streaming copies, host tier mapping, layered CPU loads)"
CARGO_TARGET_DIR=$target/miri cargo +nightly miri test -p kvtier-io --lib -- \
  sys::mem storage::host::tests::blocks_round_trip storage::host::tests::impossible_size \
  transfer::layout:: transfer::cpu_layered::

echo "== miri: kvtier-io transfer engine, device <-> host <-> remote on CPU memory"
CARGO_TARGET_DIR=$target/miri cargo +nightly miri test -p kvtier-io \
  --test transfer_roundtrip --test paged_roundtrip --test bounce -- \
  contiguous_pool_layout_round_trip bad_ids_fail_only_their_pairs host_remote_round_trip_and_missing_key \
  core_device_layouts_round_trip \
  every_layout_round_trips_through_the_host_tier device_remote_device_round_trip_and_missing_key

echo "== loom: rendezvous of a Leader with its Workers (every interleaving)"
CARGO_TARGET_DIR=$target/loom cargo test -p kvtier-py --features loom --lib loom_tests

echo "== loom: the worker's task queue (two executors, the feeding worker, the queue closing)"
CARGO_TARGET_DIR=$target/loom cargo test -p kvtier --features loom --lib loom_tests
