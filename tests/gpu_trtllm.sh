#!/usr/bin/env bash
# kvtier.trtllm on a GPU machine without a Rust toolchain or network: the TensorRT-LLM connector
# tests (CUDA pool variants included), the CUDA-graph decode check (tests/gpu_trtllm_graphs.py) and
# the per-step overhead benchmark. Stage on the build machine (D = a git-ignored folder that travels):
#   maturin build --release -o $D && mkdir -p $D/tests
#   cp tests/gpu_trtllm.sh $D/gpu.sh && cp tests/conftest.py tests/trtllm_*.py tests/test_trtllm_*.py \
#      tests/bench_trtllm_overhead.py tests/gpu_trtllm_graphs.py $D/tests/
# then on the GPU machine: bash $D/gpu.sh   (results in $OUT)
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__, torch.cuda.is_available())"
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site kvtier-*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD/tests PYTHONUNBUFFERED=1
lscpu | grep -E "^Model name|^CPU\(s\)"
echo "== pytest tests/test_trtllm_*.py"
(cd tests && timeout 100 python3 -m pytest -q -p no:cacheprovider -rs test_trtllm_*.py 2>&1 | tail -15)
echo "== CUDA graphs: python3 tests/gpu_trtllm_graphs.py --requests 24"
timeout 90 python3 tests/gpu_trtllm_graphs.py --requests 24 --out "$OUT/graphs.json"
echo "rc=$?"
echo "== bench cuda (Llama-3.1-8B-like per rank: 32 layers, 8 KV heads, head_dim 128, 32-token blocks, bf16)"
timeout 50 python3 tests/bench_trtllm_overhead.py --pool torch-cuda --requests 32 --prompt 512 --decode 32 \
  --layers 32 --heads 8 --head-dim 128 --block 32 --out "$OUT/bench_cuda.json" | grep -E '"(label|decode_us_mean|decode_us_p50|prefill_us_mean|offload_confirmed)"|ratio|overhead'
