#!/usr/bin/env bash
# The engine on a GPU, in one run: what CI cannot check (its machines have none).
#   1. tests/engine/test_engine_cuda.py: float32 on CUDA against the CPU engine (greedy tokens equal,
#      logprobs within 1e-4), bfloat16 against transformers in float32 (within 0.1), the prefix cache,
#      the dense decode cache against paged attention, seeded sampling;
#   2. the engine suites (end to end, disaggregation primitives, dtypes, failures) with their engines
#      on CUDA (YUTU_TEST_DEVICE=cuda), against their CPU references;
#   3. loadtests/bench_cuda_sdpa.py: attention calls with and without cuDNN (why engines leave it out);
#   4. loadtests/bench_engine.py on CUDA in bfloat16 (what --dtype auto picks there) and float32.
# Usage: loadtests/gpu_check.sh [OUT_DIR]   (default: $OUT, else ./gpu-check). Every part runs even
# when one before it fails; logs and the benches' JSON land in OUT_DIR; the exit status is 1 if any
# part failed. Needs python3 with torch (CUDA), transformers, tokenizers, safetensors, pytest, and
# this project's other imports (pyzmq, redis-py) importable; no install of the project itself.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="libs:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()

part() {  # part NAME COMMAND...: run it, its output to the terminal and OUT_DIR/NAME.log, timed
  local name=$1; shift
  echo "== $name"
  local started=$SECONDS
  if ! "$@" 2>&1 | tee "$OUT_DIR/$name.log"; then failed+=("$name"); fi
  echo "   $name: $((SECONDS - started)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name(), '| transformers', transformers.__version__)" | tee -a "$OUT_DIR/gpu.txt"
pytest=($PY -m pytest -p no:cacheprovider -q -o addopts=-ra)
part cuda_tests "${pytest[@]}" tests/engine/test_engine_cuda.py
part engine_suites_on_cuda env YUTU_TEST_DEVICE=cuda "${pytest[@]}" tests/engine/test_engine_e2e.py \
  tests/engine/test_engine_disagg.py tests/engine/test_engine_dtype.py tests/engine/test_engine_failures.py
part bench_cuda_sdpa $PY loadtests/bench_cuda_sdpa.py
part bench_engine_bf16 $PY loadtests/bench_engine.py --dtype auto --out "$OUT_DIR/bench_engine_cuda_bf16.json"
part bench_engine_f32 $PY loadtests/bench_engine.py --dtype float32 --out "$OUT_DIR/bench_engine_cuda_f32.json"
if ((${#failed[@]})); then echo "gpu-check: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu-check: OK"
