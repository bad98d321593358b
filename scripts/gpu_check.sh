#!/usr/bin/env bash
# The GPU check: ONE device call of at most 8 minutes on a lent H100/H200 (Python 3.12 with its own CUDA torch, no
# network), the most important stage first. Each stage is bounded by `timeout -s INT` (pytest and the servers stop
# cleanly and keep what they wrote); a stage that fails or runs out of time is recorded and the next one runs.
#
#   here, once:        bash scripts/fetch_gpu_wheels.sh     # .whl/: what the image lacks (carried, ~25 MB)
#   the device call:   bash scripts/gpu_check.sh            # carry .whl; timeout_s 540; $OUT comes back
#   here, end to end:  bash scripts/gpu_check.sh --device cpu   # the same stages on tiny weights and the CPU
#   a second call, when device time is left (issue 36's GPU figure):
#                      GPU_CHECK_STAGES="0 4" bash scripts/gpu_check.sh    # timeout_s 330
#
# Stages and their bounds (s): 0 smoke 35 (the wheels' install included) | 1 parity 165 | 2 capacity 190 | 3 decode
# step, TF32, English, vocoder ticks 100. One deadline holds over all of them: GPU_CHECK_BUDGET_S (490 s on CUDA; the
# machine's start and the transfers come on top: ask for timeout_s 540). A command gets its stage's bound or what is
# left of the budget, whichever is less, and one with under 5 s left is not started ("out of time (budget)"), so the
# results and the bundle are always written before the device call's own limit.
#  0. the wheels, the imports, nvidia-smi, a background GPU-memory log (gpumem.csv, every second)
#  1. graph replay == eager at the runner level (decode + sampling: Turbo and English, tiny and full, fp32 and bf16;
#     the vocoder's render graphs), then the engine through graphs, ops and host syncs per step on CUDA, the runner
#     and the equivalence with chatterbox's own inference
#  2. the real server's capacity: Turbo bf16, full size, random weights, 1 / 16 / 64 / 128 sessions (first audio
#     alone is N = 1), graphs (auto: the start-up check may fall back, `engine_after` says) versus graphs off
#  3. decode step ms against the memory floor (Turbo bf16 at 1 / 64 / 128 rows), the vocoder's TF32 SNR against
#     fp32, English bf16, then the vocoder's render ticks eager vs graphs (is --vocoder-graphs worth its default?)
#  4. (only when GPU_CHECK_STAGES names it; stage 0 always runs) jobs beside live sessions: Turbo bf16 full size, 16
#     and 64 sessions with 2 s between turns, 128 slots, alone then beside 32 jobs: live first audio p95 beside the
#     jobs against alone, and the jobs' share of the capacity live leaves (jobs_turbo.json and .png); 240 s
#
# What comes back ($OUT; 6 files, no folder): gpu_check.log (everything printed), results.json (each stage's status,
# seconds and figures, rewritten after every stage), capacity_turbo.json (rewritten after every round) and .png,
# gpumem.csv, bundle.tar.gz (every stage's whole output: test logs, server logs, JSON; re-packed after every stage);
# stage 4 adds jobs_turbo.json and .png (8 files at most).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:-cuda}
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
CHECK_START=$(date +%s)
if [ "$DEVICE" = cuda ]; then
    PY=python3
    SIZE=full; DTYPE=bfloat16; SESSIONS="1 16 64 128"; STEP_ROWS="1 64 128"; ENGLISH_ROWS="1 64"
    RENDER_BATCHES="1 16 64"
    BUDGET_S=${GPU_CHECK_BUDGET_S:-490}
    SMOKE_S=35; PARITY_S=50; VOCODER_PARITY_S=35; ENGINE_TESTS_S=60; STEP_COUNTS_S=20; CAPACITY_S=190; STEP_S=25
    TF32_S=25; ENGLISH_S=25; TICKS_S=25; JOBS_S=240; JOB_SESSIONS="16 64"; JOB_LOAD=32; JOB_CHARS=5000; JOB_WINDOW_S=20; JOB_SLOTS=128
else
    PY=${PY:-.venv/bin/python}
    SIZE=tiny; DTYPE=float32; SESSIONS="1 2"; STEP_ROWS="1 4"; ENGLISH_ROWS="1"; RENDER_BATCHES="1"
    BUDGET_S=${GPU_CHECK_BUDGET_S:-3600}
    SMOKE_S=120; PARITY_S=120; VOCODER_PARITY_S=120; ENGINE_TESTS_S=300; STEP_COUNTS_S=0; CAPACITY_S=400; STEP_S=200; TF32_S=300
    ENGLISH_S=200; TICKS_S=300; JOBS_S=300; JOB_SESSIONS="1"; JOB_LOAD=2; JOB_CHARS=3000; JOB_WINDOW_S=4; JOB_SLOTS=2
fi
STAGES=" ${GPU_CHECK_STAGES:-1 2 3} "
wants() { [[ "$STAGES" == *" $1 "* ]]; }  # stage 0 always runs: the wheels and the imports the others need
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -p no:warnings -rs -m "gpu or not gpu")

stage() { STAGE=$1; STAGE_START=$(date +%s); echo; echo "== $1: $2 ($(date +%T), ${DEVICE})"; }
# record STATUS [FILE...]: this stage's status and seconds into results.json, with the JSON (or JSON lines) files
record() {
    local status=$1; shift
    "$PY" - "$OUT_DIR/results.json" "$STAGE" "$status" "$(( $(date +%s) - STAGE_START ))" "$DEVICE" "$@" <<'EOF'
import json, sys
from pathlib import Path
path, stage, status, seconds, device, *files = sys.argv[1:]
results = json.loads(Path(path).read_text()) if Path(path).exists() else {"device": device, "stages": {}}
figures = {}


def lines(text):  # JSON lines (or lines of which some are JSON; one cut off by a timeout is kept as text)
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except ValueError:
                yield {"unparsed": line}


for name in files:
    p = Path(name)
    if not p.exists():
        continue
    text = p.read_text(errors="replace")
    try:
        figures[p.name] = json.loads(text)
    except ValueError:
        figures[p.name] = list(lines(text))
results["stages"][stage] = {"status": status, "seconds": int(seconds), **({"figures": figures} if figures else {})}
Path(path).write_text(json.dumps(results, indent=1))
EOF
    tar -czf "$WORK.tar.gz" -C "$WORK" . && mv -f "$WORK.tar.gz" "$OUT_DIR/bundle.tar.gz"  # (never half a bundle)
    echo "-- $STAGE: $status ($(( $(date +%s) - STAGE_START )) s; $(( $(date +%s) - CHECK_START )) s in all)"
}
# left_s: seconds left of the whole check's budget
left_s() { echo $(( CHECK_START + BUDGET_S - $(date +%s) )); }
# bounded NAME SECONDS CMD...: the command under `timeout -s INT` (then KILL 5 s later), for SECONDS or what is left
# of the budget (less the kill's grace), its whole output in $WORK/NAME.txt and on the console; returns its status
# (124 or 137: out of time; 125: not started, the budget is spent)
bounded() {
    local name=$1 seconds=$2 left; shift 2
    left=$(( $(left_s) - 5 ))
    [ "$left" -lt "$seconds" ] && seconds=$left
    if [ "$seconds" -lt 5 ]; then
        echo "-- $name: not started, the check's budget (${BUDGET_S} s) is spent" | tee "$WORK/$name.txt"
        return 125
    fi
    timeout -s INT -k 5 "$seconds" "$@" 2>&1 | tee "$WORK/$name.txt"
    return "${PIPESTATUS[0]}"
}
outcome() {
    case $1 in 0) echo ok ;; 124|137) echo "out of time" ;; 125) echo "out of time (budget)" ;; *) echo "failed ($1)" ;;
    esac
}

# ---- 0. smoke ------------------------------------------------------------------------------------------------------
stage 0 "smoke: wheels, imports, device, memory log"
status=ok
# the carried wheels (on the GPU machine; GPU_CHECK_WHEELS=1 does it on a CPU too: the wheel set's smoke test in a
# venv of the image's packages, BENCHMARKS.md "GPU check, issue 34")
if [ "${GPU_CHECK_WHEELS:-$([ "$DEVICE" = cuda ] && echo 1 || echo 0)}" = 1 ]; then
    # into /tmp/site, which goes AFTER the image's site-packages (a .pth file, not PYTHONPATH): a carried wheel never
    # shadows a package the image has; fetch_gpu_wheels.sh carries only what the image lacks
    if timeout -s INT 25 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl > "$WORK/wheels.txt" 2>&1; then
        site=$("$PY" -c "import site; print(site.getsitepackages()[0])")
        echo /tmp/site > "$site/zz_gpu_check_wheels.pth" 2>/dev/null \
            || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"  # a read-only image: last on the path
    else
        cat "$WORK/wheels.txt"; status="failed (wheel install)"
    fi
    # chatterbox/__init__ imports the watermarker (resemble-perth, 34 MB, never used by synth/): an empty module
    mkdir -p /tmp/site/perth && printf 'PerthImplicitWatermarker = None\n' > /tmp/site/perth/__init__.py
fi
MEMLOG=
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$WORK/gpu.txt"
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 > "$OUT_DIR/gpumem.csv" 2>&1 &
    MEMLOG=$!
else
    echo "device cpu: no nvidia-smi, no memory log" | tee "$OUT_DIR/gpumem.csv"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bounded versions $(( SMOKE_S - ($(date +%s) - STAGE_START) )) "$PY" -c "
import json, torch, transformers, tokenizers, numpy, chatterbox
import synth.engine, synth.t3_runner, agent_server.cli
cuda = torch.cuda.is_available()
print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,
                  'tokenizers': tokenizers.__version__, 'numpy': numpy.__version__,
                  'cuda': cuda and torch.cuda.get_device_name(), 'capability': cuda and torch.cuda.get_device_capability(),
                  'memory_gb': cuda and round(torch.cuda.mem_get_info()[1] / 1e9, 1)}))
" || status="failed (imports)"
grep '^{' "$WORK/versions.txt" > "$WORK/versions.json" || true
record "$status" "$WORK/versions.json"

# ---- 1. parity -----------------------------------------------------------------------------------------------------
if wants 1; then
stage 1 "parity: graph replay == eager (runner level, vocoder), then the engine's tests on $DEVICE"
export SYNTH_TEST_DEVICE=$DEVICE SYNTH_PARITY_JSON=$WORK/parity.jsonl
# the decode + sampling graphs, then the vocoder's, each bounded on its own (a slow first half never eats the second)
bounded parity "$PARITY_S" "${PYTEST[@]}" tests/synth/test_graph_parity.py -k "not vocoder"
parity=$?
bounded vocoder_parity "$VOCODER_PARITY_S" "${PYTEST[@]}" tests/synth/test_graph_parity.py -k vocoder
vocoder_parity=$?
engine_tests=(tests/synth/test_cuda_graphs.py tests/synth/test_t3_runner.py tests/synth/test_engine_equivalence.py
              tests/synth/test_reference_equivalence.py)
[ "$DEVICE" = cpu ] && engine_tests=(tests/synth/test_cuda_graphs.py tests/synth/test_engine_graphs.py)
bounded engine_tests "$ENGINE_TESTS_S" "${PYTEST[@]}" "${engine_tests[@]}"
engine=$?
counts=skipped  # ops and host syncs of eager steps on CUDA (a graph replay dispatches no op to count); the CPU
if [ "$STEP_COUNTS_S" -gt 0 ]; then  # runs them in CI
    bounded step_counts "$STEP_COUNTS_S" env SYNTH_TEST_CUDA_GRAPHS=off "${PYTEST[@]}" tests/synth/test_step_counts.py
    counts=$(outcome $?)
fi
unset SYNTH_TEST_DEVICE SYNTH_PARITY_JSON
record "parity $(outcome $parity); vocoder parity $(outcome $vocoder_parity); engine tests $(outcome $engine); step\
 counts $counts" "$WORK/parity.jsonl"
fi

# ---- 2. capacity ---------------------------------------------------------------------------------------------------
if wants 2; then
stage 2 "capacity: Turbo $DTYPE $SIZE, sessions $SESSIONS, graphs auto vs off"
capacity_args=(--variant turbo --weights "random-$SIZE" --sessions $SESSIONS --server-start-timeout-s 90
               --out "$OUT_DIR/capacity_turbo" --log-dir "$WORK")
# the code before, when carried (git archive <commit> synth agent_server static | tar -x -C .gpu_old; ignored)
[ -d .gpu_old/agent_server ] && capacity_args+=(--repo "old=.gpu_old" --server-args-for
    "old=--device $DEVICE --dtype $DTYPE")
bounded capacity "$CAPACITY_S" "$PY" scripts/bench_capacity.py "${capacity_args[@]}" \
    --repo graphs=. --server-args-for "graphs=--device $DEVICE --dtype $DTYPE --cuda-graphs auto" \
    --repo eager=. --server-args-for "eager=--device $DEVICE --dtype $DTYPE --cuda-graphs off"
record "$(outcome $?)" "$OUT_DIR/capacity_turbo.json"
fi

# ---- 3. decode step, TF32, English ---------------------------------------------------------------------------------
if wants 3; then
stage 3 "decode step vs the memory floor (Turbo $DTYPE), the vocoder's TF32 SNR, English $DTYPE"
bounded step_turbo "$STEP_S" "$PY" scripts/bench_decode_step.py --device "$DEVICE" --size "$SIZE" --variant turbo \
    --dtype "$DTYPE" --cuda-graphs auto --sessions $STEP_ROWS --voices each --steps 20 --json "$WORK/step_turbo.json"
turbo=$?
tf32_variants=(turbo english); [ "$DEVICE" = cpu ] && tf32_variants=(turbo)
bounded tf32 "$TF32_S" "$PY" scripts/vocoder_tf32_snr.py --device "$DEVICE" --preset "$SIZE" \
    --variants "${tf32_variants[@]}" --streams "$([ "$DEVICE" = cuda ] && echo 8 || echo 1)" --json "$WORK/tf32.json"
tf32=$?
bounded step_english "$ENGLISH_S" "$PY" scripts/bench_decode_step.py --device "$DEVICE" --size "$SIZE" \
    --variant english --dtype "$DTYPE" --cuda-graphs auto --sessions $ENGLISH_ROWS --voices each --steps 20 \
    --json "$WORK/step_english.json"
english=$?
bounded ticks "$TICKS_S" "$PY" scripts/bench_vocoder.py --mode batched --device "$DEVICE" --preset "$SIZE" \
    --variants turbo --shapes chunk_24 --batch-sizes $RENDER_BATCHES --graphs --reps 5 --out "$WORK/ticks.json"
ticks=$?
record "turbo step $(outcome $turbo); tf32 $(outcome $tf32); english step $(outcome $english); ticks $(outcome $ticks)" \
    "$WORK/step_turbo.json" "$WORK/tf32.json" "$WORK/step_english.json" "$WORK/ticks.json"
fi

# ---- 4. jobs beside live sessions (issue 36) -----------------------------------------------------------------------
if wants 4; then
stage 4 "jobs: Turbo $DTYPE $SIZE, sessions $JOB_SESSIONS with 2 s between turns, alone then beside $JOB_LOAD jobs"
bounded jobs "$JOBS_S" "$PY" scripts/bench_capacity.py --variant turbo --weights "random-$SIZE" \
    --sessions $JOB_SESSIONS --repeat 2 --think-s 2 --job-load "$JOB_LOAD" --job-chars "$JOB_CHARS" \
    --job-window-s "$JOB_WINDOW_S" --server-start-timeout-s 90 --out "$OUT_DIR/jobs_turbo" --log-dir "$WORK" \
    -- --device "$DEVICE" --dtype "$DTYPE" --max-slots "$JOB_SLOTS"
record "$(outcome $?)" "$OUT_DIR/jobs_turbo.json"
fi

[ -n "$MEMLOG" ] && kill "$MEMLOG" 2>/dev/null
STAGE=all; STAGE_START=$CHECK_START
record "done"
echo "== done in $(( $(date +%s) - CHECK_START )) s; results: $OUT_DIR/results.json"
exec >&- 2>&-  # tee sees the end of its input: wait until it has written the log's last lines
wait "$TEE_PID" 2>/dev/null || true
