#!/usr/bin/env bash
# Yutu on a GPU, in one run: what CI cannot check (its machines have none). Parts:
#   cuda_tests             tests/engine/test_engine_cuda.py: float32 on CUDA against the CPU engine
#                          (greedy tokens equal, logprobs within 1e-4), bfloat16 against transformers in
#                          float32 (within 0.1), the prefix cache, the dense decode cache, seeded sampling
#   engine_suites_on_cuda  the engine suites (end to end, disaggregation primitives, the KV cache's host
#                          mirror, dtypes, failures) with their engines on CUDA (YUTU_TEST_DEVICE=cuda)
#   bench_cuda_sdpa        attention calls with and without cuDNN (why engines leave it out)
#   bench_cuda_graphs      a decode step of the demo model's shape, eager against a captured CUDA graph
#   bench_engine_bf16/f32  loadtests/bench_engine.py on CUDA, bfloat16 (--dtype auto there) and float32
#   bench_serving_cuda     loadtests/bench_serving.py: the mixed and 1P+1D stacks with their engines on
#                          the GPU (--device auto), against the engine alone on the GPU
# Usage: loadtests/gpu_check.sh [OUT_DIR [PART...]]   (OUT_DIR default: $OUT, else ./gpu-check; no
# PART: all). Every part runs even when one before it fails; logs and JSON land in OUT_DIR; the exit
# status is 1 if any part failed. Needs python3 with torch (CUDA), transformers, pytest and this
# project's dependencies importable (no install of the project itself), and redis-server on PATH
# for the serving part.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check}}
shift || true
PARTS=("$@")
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="libs:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()

wanted() { ((${#PARTS[@]} == 0)) || [[ " ${PARTS[*]} " == *" $1 "* ]]; }
part() {  # part NAME COMMAND...: run it (if wanted), output to the terminal and OUT_DIR/NAME.log, timed
  local name=$1; shift
  wanted "$name" || return 0
  echo "== $name"
  local started=$SECONDS
  if ! "$@" 2>&1 | tee "$OUT_DIR/$name.log"; then failed+=("$name"); fi
  echo "   $name: $((SECONDS - started)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$OUT_DIR/gpu.txt"
pytest=($PY -m pytest -p no:cacheprovider -q -o addopts=-ra)
part cuda_tests "${pytest[@]}" tests/engine/test_engine_cuda.py
part engine_suites_on_cuda env YUTU_TEST_DEVICE=cuda "${pytest[@]}" tests/engine/test_engine_e2e.py \
  tests/engine/test_engine_disagg.py tests/engine/test_engine_kv_mirror.py tests/engine/test_engine_dtype.py \
  tests/engine/test_engine_failures.py
part bench_cuda_sdpa $PY loadtests/bench_cuda_sdpa.py
part bench_cuda_graphs $PY loadtests/bench_cuda_graphs.py --out "$OUT_DIR/bench_cuda_graphs.json"
part bench_engine_bf16 $PY loadtests/bench_engine.py --dtype auto --out "$OUT_DIR/bench_engine_cuda_bf16.json"
part bench_engine_f32 $PY loadtests/bench_engine.py --dtype float32 --out "$OUT_DIR/bench_engine_cuda_f32.json"
part bench_serving_cuda $PY loadtests/bench_serving.py --stacks mixed,disagg \
  --out "$OUT_DIR/bench_serving_cuda.json"
if ((${#failed[@]})); then echo "gpu-check: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu-check: OK"
