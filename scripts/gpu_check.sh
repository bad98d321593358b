#!/usr/bin/env bash
# The GPU check, one prepared script for a lent H200 (a Python 3.12 image with its own CUDA torch, no
# network). Each stage is bounded by `timeout`, writes what it measured under $OUT_DIR, and the most important
# comes first, so a stage that fails or runs out of time leaves the others' figures.
#
#   bash scripts/fetch_gpu_wheels.sh        # here, once: .whl/ (what the image lacks, ~54 MB)
#   git archive <old commit> synth agent_server static | tar -x -C .gpu_old   # optional: the code to compare
#   on the device (carry .whl and .gpu_old; $OUT is the folder that comes back): bash scripts/gpu_check.sh
#   here, the same stages end to end on tiny weights and the CPU:  bash scripts/gpu_check.sh --device cpu
#
# Stages: (1) the engine's tests on CUDA: graph replay == eager, the decode over row/key buckets, equivalence
# with chatterbox's reference; (2) the decode step of full-size Turbo, a voice per segment: ms and ops per step,
# fp32 eager and bf16 with graphs; (3) the real server's capacity, Turbo, N sessions streaming an LLM reply
# (first audio, audio seconds per second, underruns), old code beside new; (4) more decode steps: Turbo fp32
# with graphs, English bf16 with graphs; (5) the vocoder's batched render ticks, eager vs captured graphs
# (`use_graphs`: a CUDA graph per (batch, bucket), no compiler; GPU_COMPILE=1 adds torch.compile's, about a
# minute per shape), Turbo, 24-token chunks. Stage 3 runs a third server with `--vocoder-graphs on` on CUDA.
# Bounds (the `timeout`s): stage 1 165 s, 2 60 s, 3 400 s, 4 180 s, 5 230 s, so two device calls back to back,
# GPU_STAGES="1 3" (the default) then GPU_STAGES="2 4 5", each fits one command's 10 minutes.
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
    # 64 twice: the vocoder-graphs server captures each (batch, bucket) the first time it meets it, inside the
    # measured rounds; its second round at 64 is the one that shows replays alone
    SIZE=full; DTYPE=bfloat16; STEP_SESSIONS="1 8 64"; CAPACITY_SESSIONS="1 16 64 64"; SLOTS=64
    RENDER_BATCHES="1 8 32 64"
else
    PY=.venv/bin/python
    export PYTHONPATH=$PWD
    SIZE=tiny; DTYPE=float32; STEP_SESSIONS="1 4"; CAPACITY_SESSIONS="1 2"; SLOTS=16
    RENDER_BATCHES="1"  # the CPU's inductor takes about a minute per compiled shape
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
          'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())" | tee "$OUT_DIR/versions.txt"
STAGES=${GPU_STAGES:-1 3}  # then GPU_STAGES="2 4 5"; a rerun can take fewer
stage() { echo; echo "== $1 ($(date +%T))"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }

if want 1; then
    stage "1. engine tests on $DEVICE"
    SYNTH_TEST_DEVICE=$DEVICE timeout 120 "$PY" -m pytest -q -p no:cacheprovider -p no:warnings -m "gpu or not gpu" \
        tests/synth/test_t3_runner.py tests/synth/test_reference_equivalence.py tests/synth/test_engine_equivalence.py \
        tests/synth/test_render_graphs.py \
        2>&1 | tail -12 | tee "$OUT_DIR/tests.txt"
fi
graphs=auto  # CPU: eager; CUDA: on, unless the replay test fails
[ "$DEVICE" = cuda ] && graphs=on
if [ "$DEVICE" = cuda ] && ! SYNTH_TEST_DEVICE=cuda timeout 45 "$PY" -m pytest -q -p no:cacheprovider -p no:warnings \
        -m gpu tests/synth/test_cuda_graphs.py > "$OUT_DIR/cuda_graphs.txt" 2>&1; then
    graphs=off; echo "CUDA graphs failed their test: the server stages run with --cuda-graphs off" | tee -a "$OUT_DIR/tests.txt"
fi

step() {  # variant dtype graphs
    timeout 60 "$PY" scripts/bench_decode_step.py --device "$DEVICE" --size "$SIZE" --variant "$1" --dtype "$2" \
        --cuda-graphs "$3" --sessions $STEP_SESSIONS --voices each --steps 20 \
        --json "$OUT_DIR/step_$1_$2_graphs-$3.json" 2>&1 | grep '^{' | tee -a "$OUT_DIR/steps.txt"
}
want 2 && stage "2. decode step, $SIZE, a voice per segment" && step turbo float32 off

if want 3; then
    stage "3. server capacity, Turbo, old vs new (and new with the vocoder's graphs)"
    old=(); [ -d .gpu_old/agent_server ] && old=(--repo "old=.gpu_old" --server-args-for "old=--device $DEVICE")
    vgraphs=(); [ "$DEVICE" = cuda ] && vgraphs=(--repo vgraphs=. --server-args-for
        "vgraphs=--device $DEVICE --dtype $DTYPE --cuda-graphs $graphs --vocoder-graphs on")
    timeout 400 "$PY" scripts/bench_capacity.py --variant turbo --weights "random-$SIZE" --sessions $CAPACITY_SESSIONS \
        "${old[@]}" --repo new=. --server-args-for "new=--device $DEVICE --dtype $DTYPE --cuda-graphs $graphs" \
        "${vgraphs[@]}" --server-start-timeout-s 100 --out "$OUT_DIR/capacity_turbo" -- --max-slots "$SLOTS" 2>&1 \
        | tail -22 | tee "$OUT_DIR/capacity.txt"
fi

if want 4 && [ "$DEVICE" = cuda ]; then
    stage "4. decode step with graphs (if they passed): Turbo $DTYPE and fp32, English $DTYPE"
    step turbo "$DTYPE" "$graphs"; step turbo float32 "$graphs"; step english "$DTYPE" "$graphs"
fi
if want 5; then
    stage "5. vocoder render ticks, Turbo, eager vs captured graphs (GPU_COMPILE=1: also torch.compile), batches $RENDER_BATCHES"
    # its per-batch lines are in the log as they come, so a stage cut short by its bound keeps what it measured
    compile=(); [ "${GPU_COMPILE:-0}" = 1 ] && compile=(--compile)
    timeout 230 "$PY" scripts/bench_vocoder.py --mode batched --device "$DEVICE" --preset "$SIZE" --variants turbo \
        --shapes chunk_24 --batch-sizes $RENDER_BATCHES --graphs "${compile[@]}" --reps 5 \
        --out "$OUT_DIR/vocoder_batched.json" 2>&1 | grep -E "graphs|compiled|eager_ms|^turbo|^variant" \
        | tee "$OUT_DIR/vocoder.txt"
fi
stage "done"
