#!/usr/bin/env bash
# The node tier on a CUDA machine, in one command (no Rust toolchain needed there):
#   bash scripts/gpu-node.sh [TEST_BINARY]
# TEST_BINARY is kvtier-io's lib test binary, built here with
#   cargo test --release -p kvtier-io --lib --no-run     # prints target/release/deps/kvtier_io-<hash>
# (default: $KVTIER_IO_TESTS, else the newest target/release/deps/kvtier_io-*). It runs
# storage::node::gpu_tests: a GPU KV cache (vLLM per-layer layout, 2 MiB blocks) stored through a node tier
# (device -> arena slot by DMA, the arena registered with cuMemHostRegister) and loaded back into other blocks,
# compared bit-exact, by a client of the node's uid (direct, no hashing) and a verifying one (verify=1, as toward
# a node of another uid: staged, every block hashed), with GB/s against a pinned host tier moving the same blocks in the same run; then
# transfer::cuda::gpu_tests (ordered loads seen by the engine's stream). Without a CUDA driver
# the test prints that it skipped. Environment: KVTIER_NODE_GPU_BLOCKS (default 256), OUT (default ./gpu-node-out:
# the report as markdown and the log), KVTIER_NODE_HUGE=1 (as root: the store/load test again with the arena on a tmpfs
# mounted `huge=always`, 2 MiB pages; report node-gpu-huge.md: does the page size bound the DMA rates?),
# KVTIER_NODE_COLLAPSE=1 (the store/load test again with the node collapsing its /dev/shm arena into 2 MiB pages at
# start, `kvtier node --huge-pages collapse`: report node-gpu-collapse.md), KVTIER_LAYERED=1 (transfer::cuda::gpu_tests::
# layered_loads_are_seen_layer_by_layer: every layered-load mode, kernel and copy-engine staged, bit-exact layer by layer,
# with 1 GiB and 4 GiB rates: layered.log), KVTIER_NODE_BIG_JOBS=1 (the store/load test in jobs of 512 blocks).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-${KVTIER_IO_TESTS:-}}
if [ -z "$bin" ]; then
  bin=$(ls -t "$here"/target/release/deps/kvtier_io-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
fi
[ -x "$bin" ] || { echo "no kvtier-io test binary (pass its path; see the header)" >&2; exit 2; }
out=${OUT:-$PWD/gpu-node-out}
mkdir -p "$out"
export KVTIER_NODE_GPU_REPORT="$out/node-gpu.md"
"$bin" --exact storage::node::gpu_tests::node_gpu_store_and_load_are_bit_exact_and_direct --nocapture --test-threads 1 \
  2>&1 | tee "$out/node-gpu.log"
# --exact with a name that no longer exists runs nothing and passes: say so instead.
grep -q "test result: ok. 1 passed" "$out/node-gpu.log" || { echo "the node GPU test did not run" >&2; exit 1; }
if [ -f "$KVTIER_NODE_GPU_REPORT" ]; then cat "$KVTIER_NODE_GPU_REPORT"; else echo "no report (skipped?)"; fi
# The same binary's ordered-load test (transfer::cuda::gpu_tests): host -> device loads ordered on an engine stream, both
# copy paths, checked bit-exact through what that stream reads right after kvtier says it may go on.
"$bin" --exact transfer::cuda::gpu_tests::ordered_loads_are_seen_by_the_engine_stream --nocapture --test-threads 1 \
  2>&1 | tee "$out/ordered-gpu.log"
grep -q "test result: ok. 1 passed" "$out/ordered-gpu.log" || { echo "the ordered-load GPU test did not run" >&2; exit 1; }
# Synchronous loads from the node ordered and layered like host tier loads (storage::node::gpu_tests): the engine's
# stream reads each layer right after its gate, bit-exact; a job with a missing block is not ordered.
"$bin" --exact storage::node::gpu_tests::node_loads_are_ordered_and_layered --nocapture --test-threads 1 \
  2>&1 | tee "$out/node-layered-gpu.log"
grep -q "test result: ok. 1 passed" "$out/node-layered-gpu.log" || { echo "the node layered-load GPU test did not run" >&2; exit 1; }
# The same store/load test in jobs of 512 blocks (a vLLM prefill step of 8,192 tokens; the default is 64): how much
# of the node's gap to the host tier is its per-job round trips (KVTIER_NODE_BIG_JOBS=1; report node-gpu-512.md).
if [ "${KVTIER_NODE_BIG_JOBS:-0}" = 1 ]; then
  KVTIER_NODE_GPU_JOB=512 KVTIER_NODE_GPU_REPORT="$out/node-gpu-512.md" \
    "$bin" --exact storage::node::gpu_tests::node_gpu_store_and_load_are_bit_exact_and_direct --nocapture \
    --test-threads 1 2>&1 | tee "$out/node-gpu-512.log" || true
  grep -q "test result: ok. 1 passed" "$out/node-gpu-512.log" || { echo "the 512-block-job node GPU test did not pass" >&2; exit 1; }
  cat "$out/node-gpu-512.md"
fi
# The same store/load test with the node collapsing its arena into 2 MiB pages at start (no root needed).
if [ "${KVTIER_NODE_COLLAPSE:-0}" = 1 ]; then
  KVTIER_NODE_HUGE_COLLAPSE=1 KVTIER_NODE_GPU_REPORT="$out/node-gpu-collapse.md" KVTIER_LOG=info \
    "$bin" --exact storage::node::gpu_tests::node_gpu_store_and_load_are_bit_exact_and_direct --nocapture \
    --test-threads 1 2>&1 | tee "$out/node-gpu-collapse.log" || true
  grep -q "test result: ok. 1 passed" "$out/node-gpu-collapse.log" || { echo "the collapsed-arena node GPU test did not pass" >&2; exit 1; }
  cat "$out/node-gpu-collapse.md"
fi
# Layered loads in every mode (kernel reads; copy engine through staging): bit-exact layer by layer, with rates.
if [ "${KVTIER_LAYERED:-0}" = 1 ]; then
  "$bin" --exact transfer::cuda::gpu_tests::layered_loads_are_seen_layer_by_layer --nocapture --test-threads 1 \
    2>&1 | tee "$out/layered.log"
  grep -q "test result: ok. 1 passed" "$out/layered.log" || { echo "the layered-load GPU test did not pass" >&2; exit 1; }
fi
# The same store/load test with the node's arena on 2 MiB pages (a tmpfs mounted huge=always; needs root).
if [ "${KVTIER_NODE_HUGE:-0}" = 1 ]; then
  huge=$(mktemp -d /tmp/kvtier-huge.XXXXXX)
  mount -t tmpfs -o huge=always,mode=0700,size=$(( (${KVTIER_NODE_GPU_BLOCKS:-256} * 2 + 64) * 2 ))M none "$huge"
  KVTIER_NODE_SHM_DIR="$huge" KVTIER_NODE_GPU_REPORT="$out/node-gpu-huge.md" \
    "$bin" --exact storage::node::gpu_tests::node_gpu_store_and_load_are_bit_exact_and_direct --nocapture \
    --test-threads 1 2>&1 | tee "$out/node-gpu-huge.log" || true
  grep ShmemHugePages /proc/meminfo || true
  umount "$huge"; rmdir "$huge"
  grep -q "test result: ok. 1 passed" "$out/node-gpu-huge.log" || { echo "the huge-page node GPU test did not pass" >&2; exit 1; }
  cat "$out/node-gpu-huge.md"
fi
