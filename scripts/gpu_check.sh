#!/usr/bin/env bash
# The GPU check for a lent H200 (one prepared script, bounded in time): equivalence tests on CUDA, then the
# engine at 1, 8, 32, 64 segments for Turbo and English in bf16 (decode-step ms, engine-side time to first
# chunk, S3Gen ms per second of audio). Writes everything under ${OUT:-out/gpu}.
#   bash scripts/gpu_check.sh            (expects `bash scripts/install.sh` to have been run, CUDA torch)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"
echo "== equivalence tests on CUDA (tiny presets)"
SYNTH_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/synth/test_engine_equivalence.py tests/synth/test_t3_runner.py tests/synth/test_alignment.py 2>&1 | tee "$OUT_DIR/equivalence.txt"
echo "== engine bench, bf16, full-size random weights"
timeout 420 "$PY" scripts/bench_engine.py --device cuda --dtype bfloat16 --threads 8 --variants turbo english \
    --segments 1 8 32 64 --tokens 96 --sequential-segments 2 --ttfa-tokens 60 \
    --out "$OUT_DIR/bench_engine_gpu.json" 2>&1 | tee "$OUT_DIR/bench.txt"
