#!/usr/bin/env bash
# TensorRT-LLM connector tests + per-step overhead benchmark on a GPU machine without a Rust
# toolchain or network. Prepare on the build machine:
#   maturin build --release -o .dev && mkdir -p .dev/tests .dev/wheels
#   cp tests/gpu_trtllm.sh .dev/gpu.sh && cp tests/conftest.py tests/trtllm_driver.py \
#      tests/test_trtllm_*.py tests/bench_trtllm_overhead.py .dev/tests/
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#      --implementation cp -d .dev/wheels pytest numpy     # used only if missing there
# then on the GPU machine, from the repository root: bash .dev/gpu.sh  (results in $OUT)
set -u
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
extra=()
python3 -c "import numpy" 2>/dev/null || extra+=(wheels/numpy-*.whl)
python3 -m pytest --version 2>/dev/null || extra+=(wheels/pytest-*.whl wheels/pluggy-*.whl wheels/iniconfig-*.whl wheels/packaging-*.whl wheels/pygments-*.whl)
pip install -q --no-deps --no-index --target /tmp/site kvtier-*.whl "${extra[@]}" 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD/tests
lscpu | grep -E "^Model name|^CPU\(s\)"
echo "== pytest"
(cd tests && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs . 2>&1 | tail -25)
echo "== bench cuda (Llama-3.1-8B-like per rank: 32 layers, 8 KV heads, head_dim 128, 32-token blocks, bf16)"
timeout 110 python3 tests/bench_trtllm_overhead.py --pool torch-cuda --requests 64 --prompt 512 --decode 64 \
  --layers 32 --heads 8 --head-dim 128 --block 32 --out "$OUT/bench_cuda_64.json" | tail -60
echo "== bench cpu numpy (same call pattern, small blocks)"
timeout 40 python3 tests/bench_trtllm_overhead.py --pool numpy --requests 64 --prompt 512 --decode 64 \
  --layers 32 --heads 1 --head-dim 8 --block 32 --out "$OUT/bench_numpy_64.json" | tail -50
