#!/usr/bin/env bash
# The GPU check, one prepared script for a lent H200 (Python 3.12 image with its own CUDA torch, no network):
# every stage is bounded by `timeout` and writes what it measured under $OUT_DIR, most important first, so a
# stage that fails or runs out of time leaves the others' figures.
#
#   bash scripts/fetch_gpu_wheels.sh                     # here, once: .whl/ (what the image lacks)
#   git archive <old commit> synth agent_server | tar -x -C .gpu_old   # optional: the code to compare with
#   device run: bash scripts/gpu_check.sh  (carry .whl and .gpu_old; $OUT is the folder that comes back)
#   here, on the CPU, the same stages end to end on tiny weights: bash scripts/gpu_check.sh --device cpu
#
# Stages: (1) the engine tests on CUDA (graph replay == eager, bf16/fp16 end to end, equivalence with
# chatterbox's reference); (2) the decode step per row bucket: ms, ops and host syncs per step, CUDA graphs
# on and off, bf16, 1 and many voices; (3) the real server's capacity (N sessions streaming an LLM reply:
# time to first audio, audio seconds per second, underruns), the old code beside the new; (4) the vocoder's
# batched render ticks, eager and compiled.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:-cuda}
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ "$DEVICE" = cuda ]; then
    PY=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 3; }
    # chatterbox/__init__ imports the watermarker (resemble-perth, 34 MB, never used by synth/): an empty module
    mkdir -p /tmp/site/perth && printf 'PerthImplicitWatermarker = None\n' > /tmp/site/perth/__init__.py
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
    WEIGHTS=random-full; ENGINE_SEGMENTS="1 8 32 64"; CAPACITY_SESSIONS="1 16 64"; DTYPE=bfloat16
else
    PY=.venv/bin/python
    export PYTHONPATH=$PWD
    WEIGHTS=random-tiny; ENGINE_SEGMENTS="1 4"; CAPACITY_SESSIONS="1 2"; DTYPE=float32
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
          'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee "$OUT_DIR/versions.txt"
stage() { echo; echo "== $1 ($(date +%T))"; }

stage "1. engine tests on $DEVICE"
SYNTH_TEST_DEVICE=$DEVICE timeout 150 "$PY" -m pytest -q -p no:cacheprovider -x -W ignore \
    tests/synth/test_cuda_graphs.py tests/synth/test_dtypes.py tests/synth/test_reference_equivalence.py \
    2>&1 | tail -15 | tee "$OUT_DIR/tests.txt"

stage "2. decode step per bucket ($DTYPE, graphs on/off)"
timeout 170 "$PY" scripts/bench_engine.py --device "$DEVICE" --dtype "$DTYPE" --weights "$WEIGHTS" \
    --decode-step --segments $ENGINE_SEGMENTS --variants turbo english --cuda-graphs on off \
    --out "$OUT_DIR/decode_step.json" 2>&1 | grep -v "it/s\]" | tail -30 | tee "$OUT_DIR/decode_step.txt"

stage "3. server capacity, turbo, old vs new"
old=(); [ -d .gpu_old/agent_server ] && old=(--repo "old=.gpu_old" --server-args-for "old=--device $DEVICE")
timeout 240 "$PY" scripts/bench_capacity.py --variant turbo --weights "$WEIGHTS" --sessions $CAPACITY_SESSIONS \
    "${old[@]}" --repo new=. --server-args-for "new=--device $DEVICE --dtype $DTYPE" \
    --server-start-timeout-s 120 --out "$OUT_DIR/capacity_turbo" 2>&1 | tail -20 | tee "$OUT_DIR/capacity.txt"

stage "4. vocoder render ticks, eager and compiled"
compile=(); [ "$DEVICE" = cuda ] && compile=(--compile)
timeout 100 "$PY" scripts/bench_vocoder.py --mode batched --device "$DEVICE" --preset "${WEIGHTS#random-}" \
    --variants turbo --shapes chunk_24 --batch-sizes 1 64 --reps 5 "${compile[@]}" \
    --out "$OUT_DIR/vocoder_batched.json" 2>&1 | tail -8 | tee "$OUT_DIR/vocoder.txt"
stage "done"
