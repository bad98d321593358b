#!/usr/bin/env bash
# CUDA graphs of the decode step on a lent GPU, in one bounded run: installs the wheels under .whl/ (the
# project's Python 3.12 set plus pytest) into a throwaway folder, then runs on CUDA: the graph-replay test
# (tests/synth/test_cuda_graphs.py), the runner's decode tests, and the engine's reference equivalence (tiny
# presets), then the decode-step bench (Turbo and English tiny, graphs off/on). Output under ${OUT:-out/gpu}.
#   bash scripts/gpu_graphs_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
SITE=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl 2>&1 | tail -3
export PYTHONPATH="$SITE:$PWD"
"$PY" -c "import torch, transformers, chatterbox; print(torch.__version__, torch.cuda.get_device_name(), transformers.__version__)" \
    | tee -a "$OUT_DIR/gpu.txt"
echo "== graph replay == eager, runner, on CUDA"
SYNTH_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider -x -m "gpu or not gpu" \
    tests/synth/test_cuda_graphs.py tests/synth/test_t3_runner.py 2>&1 | tail -25 | tee "$OUT_DIR/graphs.txt"
echo "== reference equivalence on CUDA (tiny)"
SYNTH_TEST_DEVICE=cuda timeout 150 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/synth/test_engine_equivalence.py -k "english-fp32 or turbo-fp32" 2>&1 | tail -15 | tee "$OUT_DIR/equivalence.txt"
echo "== decode step, graphs off / on"
for graphs in off on; do
  for variant in turbo english; do
    timeout 60 "$PY" scripts/bench_decode_step.py --device cuda --dtype bfloat16 --variant $variant --size tiny \
        --sessions 1 8 32 --steps 20 --cuda-graphs $graphs --json "$OUT_DIR/step_${variant}_${graphs}.json" 2>&1 \
        | grep '^{' | tee -a "$OUT_DIR/steps.txt"
  done
done
echo "== decode step, full size, bf16, a voice per segment, graphs off / on"
for variant in turbo english; do
  for graphs in off on; do
    timeout 150 "$PY" scripts/bench_decode_step.py --device cuda --dtype bfloat16 --variant $variant --size full \
        --sessions 1 8 64 --voices each --steps 20 --cuda-graphs $graphs \
        --json "$OUT_DIR/step_full_${variant}_${graphs}.json" 2>&1 | grep '^{' | tee -a "$OUT_DIR/steps_full.txt"
  done
done
