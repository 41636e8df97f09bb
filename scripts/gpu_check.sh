#!/usr/bin/env bash
# The GPU checks of parity in one command (one 10-minute device call), for the first machine with CUDA:
#   scripts/gpu_check.sh [OUT_DIR]        (default: /tmp/gpu_check when $OUT is set, else runs/gpu_check;
#                                          with $OUT set, gpu_summary.json and logs.tgz are copied there
#                                          after every step, so a call cut short still returns them)
#   DEVICE=cpu SMOKE=1 scripts/gpu_check.sh /tmp/x   (a dry run of the same steps on the CPU, at tiny
#                                                    sizes: checks the script itself, not a GPU)
# 0. parity compile for this GPU's architecture (bf16, the Qwen3-0.6B shape and `small`): every
#    binary's registers, spills, shared memory and tensor-core use, one binary per batch size; it
#    also fills Triton's cache, so the timed steps below do not pay for first compiles; meanwhile,
#    in the background, the bitwise suite's tiny models in both dtypes (step 1 needs them next),
#    then bench gemm's candidate tiles (warm_gemm: its rc is recorded when bench gemm begins, 198
#    if still compiling then)
# 1. the bitwise suite on CUDA (PARITY_TEST_DEVICE=cuda), in three steps so that no test can cost
#    the others: bitwise_core first (the standard controls, required to fail, then >= 1,000
#    generated cases on the aligned Triton kernels, each check's counts appended to
#    bitwise_core.progress.jsonl as it ends, so a cut still counts them), bitwise later (the rest of tests/parity but the
#    compile-only tests, which CI runs), tma last (the persistent TMA GEMM, never run on a GPU
#    before: a fault there is sticky for its process); one line per test, so a step cut short
#    still names what passed
# 2. parity check --device cuda (small preset, bf16 and fp32; its `graphs` case replays CUDA graphs;
#    a case that cannot run, a graph that fails to capture say, is an error in the JSON and fails
#    the step only on the aligned backend)
# 3. parity bench kernels / learner / rollout on CUDA, bf16, the Qwen3-0.6B shape and `small`
#    (decode as CUDA graphs, as the engine runs it, and eager beside it: rows 'decode-eager';
#    each decode row says how its steps ran, so a capture that failed is seen, not hidden), and
#    parity bench gemm: the aligned GEMM's candidate tiles per weight shape of the 0.6B model
#    against cuBLAS at decode and prefill row counts, each checked bit for bit across M, and
#    parity bench sampler: one sampling step at Qwen3's vocabulary, PyTorch ops vs the fused pass,
#    parity bench attention: decode attention per schedule (walk, split) at 1-4K keys vs standard
# 4. a short asynchronous training run per backend (toy task, bf16): the learner's kernel-mismatch
#    figure is exactly 0 on aligned kernels and > 0 on standard ones (run right after bench learner,
#    before bench rollout, the rest of the bitwise suite and bench gemm / attention / sampler)
# 5. with the time left, the GEMM tiles by row count that bench gemm proposed (--gemm-tiles; used
#    only where the device's probe finds a ladder's tiles give the same bits, as the JSON's
#    aligned_kernels line reports): parity check on the 0.6B shape (the
#    rows across batch sizes, decode steps, graphs and the engine, bit for bit with them in force),
#    then bench kernels and bench learner on that shape again
# 6. with the time still left, parity bench async on the GPU (sync vs async at lag 8, one repetition)
# Steps run in the order of what the issue's targets and its list need (bitwise_core, check, bench
# kernels, bench learner, the training runs, bench rollout first; bench gemm's TMA tiles in a call
# of their own, last). Each step runs under
# its own time limit and no step runs past DEADLINE seconds from the start (default 470, the
# issue's "under 8 minutes", which leaves the session's device time for a rerun; at most the device
# call's timeout_s minus 25: a step with too little time left is cut to it, or skipped under 20 s,
# rc 199); the script goes on after a failure; the
# summary (gpu_summary.json: per step rc, seconds, parsed results) is rewritten after every step,
# so a run cut short still leaves one. Step logs keep stdout (NAME.log, where JSON is parsed) and
# stderr (NAME.err) apart. Work files go to OUT_DIR; when $OUT is set (a device call's folder
# that comes back) only gpu_summary.json and logs.tgz (every log, no weights) are copied there.
# Nothing is installed: it runs on the machine's torch and triton with the repo on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:+/tmp/gpu_check}}"
OUT_DIR="${OUT_DIR:-runs/gpu_check}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
if [ -n "${SMOKE:-}" ]; then  # tiny sizes for a dry run of the script on a CPU
    BIG=tiny; SMALL=tiny; BATCHES=1,8; PREFILL=16; NSEQ=16; BIG_NSEQ=8; LEN=32; REPS=1; STEPS=2; GEMM_ROWS=4,16; GEMM_TILES=--candidates=64x128x64x4x3,64x32x64x4x4; TMA_TILES=--candidates=64x128x64x4x1+tma; ATT_BATCHES=1; ATT_CONTEXTS=70; TILED_BATCHES=8
    CORE=tests/parity/test_bitwise.py::test_a_thousand_generated_cases; WARM_TINY=; CORE_LIMIT=130
else
    BIG=qwen3-0.6b; SMALL=small; BATCHES=1,64,256; PREFILL=128; NSEQ=256; BIG_NSEQ=128; LEN=256; REPS=5; STEPS=8; GEMM_ROWS=64,256,8192; ATT_BATCHES=1,8,64; ATT_CONTEXTS=1024,4096; TILED_BATCHES=64,256
    GEMM_TILES=--candidates=64x128x64x4x3,64x64x64x4x4,64x32x64x4x4,64x16x64x4x6,64x256x64x4x3,128x128x64x8x3,128x256x64x8x3
    TMA_TILES=--candidates=128x128x64x8x4+tma,128x256x64x8x3+tma; WARM_TINY=tiny,tiny-moe,tiny-qwen2; CORE_LIMIT=150
    # the rest of tests/parity: not the core step's tests, the GPU-only TMA file (a step of its own),
    # nor the files that test the CPU (CI runs them): the compile-only tests, the interpreter's
    # (skipped on a GPU), the native CPU kernels' (skipped or CPU-only, but their import builds the
    # C kernels: GEMM rows, float32 GEMM, AMX GEMM, float mode, GQA attention) and the
    # learner-memory tests (their models are built on the CPU)
    TESTS="$(ls tests/parity/test_*.py | grep -v -e test_triton_cuda -e test_triton_compile -e test_triton.py \
             -e test_gemm_rows -e test_gemm_f32 -e test_amx_gemm -e test_float_mode -e test_native_attention \
             -e test_learner_memory)"
    # (the controls first: seconds, and a cut of the thousand cases then loses none of them)
    CORE="tests/parity/test_bitwise.py::test_control_standard_float32_differs tests/parity/test_bitwise.py::test_control_standard_bfloat16_differs tests/parity/test_bitwise.py::test_control_standard_engine_differs tests/parity/test_bitwise.py::test_control_same_suite_on_aligned_passes tests/parity/test_bitwise.py::test_a_thousand_generated_cases"
fi
STEPS_FILE="$OUT_DIR/steps.tsv"
: > "$STEPS_FILE"

DEADLINE="${DEADLINE:-470}"
case "$DEADLINE" in ''|*[!0-9]*) echo "DEADLINE must be whole seconds, got '$DEADLINE'" >&2; exit 2 ;; esac
SKIPPED=199  # the rc recorded for a step skipped for lack of time
step() {  # step NAME LIMIT_S COMMAND...: run, log to NAME.log / NAME.err, record rc and seconds
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS left=$((DEADLINE - SECONDS - 12))  # 12 s: the kill grace, the summary, the tar
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    local rc=$SKIPPED
    if [ "$limit" -ge 20 ]; then  # under 20 s a step would spend its time importing torch
        echo "=== $name (limit ${limit}s): $*"
        timeout -k 10 "$limit" "$@" > "$OUT_DIR/$name.log" 2> "$OUT_DIR/$name.err"
        rc=$?
    else
        echo "=== $name: skipped, $((DEADLINE - SECONDS)) s left before the ${DEADLINE} s deadline" \
            | tee "$OUT_DIR/$name.err"
        : > "$OUT_DIR/$name.log"
    fi
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEPS_FILE"
    tail -n 3 "$OUT_DIR/$name.log" "$OUT_DIR/$name.err" 2>/dev/null | cut -c1-300
    echo "--- $name: rc=$rc, $((SECONDS - t0)) s"
    summarize > /dev/null
    deliver
}

deliver() {  # with $OUT set: the summary and the logs there now (a kill at the call's limit keeps them;
    # each is written beside its name and renamed, so a kill mid-write keeps the previous whole one)
    if [ -n "${OUT:-}" ] && [ "$OUT_DIR" != "$OUT" ]; then
        cp "$OUT_DIR/gpu_summary.json" "$OUT/summary.part" 2>/dev/null \
            && mv -f "$OUT/summary.part" "$OUT/gpu_summary.json"
        tar -czf "$OUT/logs.part" -C "$OUT_DIR" --exclude='*.safetensors' --exclude='*.pt' . 2>/dev/null \
            && mv -f "$OUT/logs.part" "$OUT/logs.tgz"
    fi
}

summarize() {  # gpu_summary.json from the steps so far (JSON outputs parsed where printed)
    "$PY" - "$OUT_DIR" <<'EOF'
"""Gather the steps' results into gpu_summary.json (JSON outputs parsed where a step printed one)."""
import datetime
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

out = pathlib.Path(sys.argv[1])
summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": (out / "gpu.txt").read_text().strip(), "steps": {}}


def parse(name: str, entry: dict) -> None:
    """A step's results into `entry` (its logs, JUnit XML, progress lines, metrics)."""
    text = (out / f"{name}.log").read_text(errors="replace")
    err = out / f"{name}.err"
    errtext = err.read_text(errors="replace") if err.exists() else ""
    lines = text.splitlines()
    for i, line in enumerate(lines):  # the JSON document: from the first line that opens one
        if line.startswith(("{", "[")):
            try:
                entry["result"] = json.loads("\n".join(lines[i:]))
                break
            except ValueError:
                continue
    tests = name.startswith("bitwise") or name == "tma"
    if tests and (out / f"{name}.xml").exists():
        suite = ET.parse(out / f"{name}.xml").getroot().find("testsuite")
        entry["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    elif tests:  # cut short before pytest wrote its XML: the verbose log's test lines
        words = [w for line in lines if "::" in line for w in line.split() if w.isupper()]
        entry["tests_before_cut"] = {w.lower(): words.count(w) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        entry["last_test"] = next((line.split()[0] for line in reversed(lines) if "::" in line), None)
    progress = out / f"{name}.progress.jsonl"
    if progress.exists() and progress.stat().st_size:  # the generated cases' checks so far (whole lines only: a cut may leave half of one)
        checks = []
        for x in progress.read_text().splitlines():
            try:
                checks.append(json.loads(x))
            except ValueError:
                pass
        entry["generated_cases"] = {"checks": len(checks), "comparisons": sum(c["comparisons"] for c in checks),
                                    "mismatches": sum(c["mismatches"] for c in checks),
                                    "errors": sum(1 for c in checks if c["error"])}
    if name.startswith("train_"):
        metrics = out / name / "metrics.jsonl"
        rows = []
        for x in metrics.read_text().splitlines() if metrics.exists() else []:
            try:  # (whole lines only: a cut may leave half of the last one)
                rows.append(json.loads(x))
            except ValueError:
                pass
        kernel = [r["mismatch/kernel_max_abs"] for r in rows if "mismatch/kernel_max_abs" in r]
        entry["learner_steps"] = len(rows)
        entry["kernel_max_abs_max"] = max(kernel) if kernel else None
    if entry["rc"] != 0:
        entry["tail"] = (text.strip().splitlines() + errtext.strip().splitlines())[-8:]


for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    entry = {"rc": int(rc), "seconds": int(seconds)}
    try:
        parse(name, entry)
    except Exception as exc:  # (a half-written file must not stop the summary of the other steps)
        entry["summary_error"] = f"{type(exc).__name__}: {exc}"[:300]
    summary["steps"][name] = entry
(out / "gpu_summary.part").write_text(json.dumps(summary, indent=1))
(out / "gpu_summary.part").replace(out / "gpu_summary.json")
print(json.dumps({k: {x: v[x] for x in ("rc", "seconds")} for k, v in summary["steps"].items()}))
EOF
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"; } \
    > "$OUT_DIR/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print(torch.__version__, triton.__version__,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" \
    >> "$OUT_DIR/gpu.txt" 2>&1
# what the steps import beyond torch and triton (the box's own site-packages: nothing is installed)
"$PY" -c "import importlib.util, sys; print(sys.version.split()[0], *(f'{m} ' + getattr(importlib.import_module(m),
      '__version__', '?') if importlib.util.find_spec(m) else f'{m} MISSING' for m in
      ('numpy', 'pytest', 'hypothesis', 'safetensors', 'tokenizers', 'jinja2', 'matplotlib')))" >> "$OUT_DIR/gpu.txt" 2>&1
cat "$OUT_DIR/gpu.txt"

ARCH=$("$PY" -c "import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print(f'sm_{c[0]}{c[1]}')" 2>/dev/null || echo sm_90)
# compiled in the background (compile-only, on spare CPU cores, into Triton's cache): the bitwise
# suite's tiny models in both dtypes while step 0 runs (bitwise_core needs them next), then bench
# gemm's candidate tiles (niced: the timed steps keep their cores), so that bench gemm times tiles
# instead of waiting for about twenty compiles. Each compile's timeout pid goes to warm.pid: a
# kill of the block alone would leave the compile running (timeout is a process group of its own).
WARM_T0=$SECONDS
: > "$OUT_DIR/warm.pid"  # (not a pid left from an earlier run in this folder)
warm() {  # warm NICE LIMIT ARGS...: one background compile, its timeout's pid in warm.pid
    local n=$1 limit=$2
    shift 2
    timeout -k 5 "$limit" nice -n "$n" "$PY" -m parity.cli compile --arch "$ARCH" --json "$@" &
    echo $! > "$OUT_DIR/warm.pid"
    wait $!
}
{ if [ -n "$WARM_TINY" ]; then warm 0 120 --presets $WARM_TINY --dtype float32,bfloat16; fi
  warm 5 60 --presets $SMALL --dtype float32  # (parity check's float32 rows; step 0 compiles bf16)
  warm 10 300 --presets $BIG --dtype bfloat16 --gemm-candidates ${GEMM_TILES#--candidates=},${TMA_TILES#--candidates=}
} > "$OUT_DIR/warm_gemm.log" 2> "$OUT_DIR/warm_gemm.err" &
WARM=$!
stop_warm() {  # the background block, then the compile it is waiting on
    kill "$WARM" 2>/dev/null
    [ -s "$OUT_DIR/warm.pid" ] && kill "$(cat "$OUT_DIR/warm.pid")" 2>/dev/null
}
finish() {  # on every exit, a signal's too: the background compile stopped, the results copied out
    stop_warm
    summarize  # the steps' rc and seconds, on stdout
    deliver
}
trap finish EXIT
trap 'exit 143' TERM; trap 'exit 130' INT  # (bash runs these once the current step has ended)
step compile 55 "$PY" -m parity.cli compile --arch "$ARCH" --presets $BIG,$SMALL --dtype bfloat16 \
    --batch 64 --json
pytest_step() {  # pytest_step NAME LIMIT TESTS...: the tests on $DEVICE, one line each, junit XML
    local name=$1 limit=$2
    shift 2
    : > "$OUT_DIR/$name.progress.jsonl"
    step "$name" "$limit" env PARITY_TEST_DEVICE="$DEVICE" PARITY_TEST_PROGRESS="$OUT_DIR/$name.progress.jsonl" \
        "$PY" -m pytest -o addopts= -v -p no:cacheprovider \
        --durations=10 --junitxml="$OUT_DIR/$name.xml" "$@"
}
pytest_step bitwise_core "$CORE_LIMIT" $CORE
step check 35 "$PY" -m parity.cli check --device "$DEVICE" --preset $SMALL --dtype bfloat16,float32 \
    --rounds 2 --json --cases batch,padding,offset,decode,graphs,engine,autograd
step bench_kernels 90 "$PY" -m parity.cli bench kernels --device "$DEVICE" --presets $BIG,$SMALL \
    --dtypes bfloat16 --batches $BATCHES --prefill-len $PREFILL --reps $REPS --eager-decode --json
step bench_learner 45 "$PY" -m parity.cli bench learner --device "$DEVICE" --presets $BIG,$SMALL \
    --dtypes bfloat16 --batch 8 --length $LEN --reps $REPS --json
for k in aligned standard; do
    step "train_$k" 35 "$PY" -m parity.cli train configs/toy_async.toml --overwrite --set steps=$STEPS \
        --set model.device="$DEVICE" --set model.preset=$SMALL --set model.dtype=bfloat16 \
        --set model.kernels=$k --set run_dir="$OUT_DIR/train_$k"
done
step bench_rollout 40 "$PY" -m parity.cli bench rollout --device "$DEVICE" --preset $SMALL --dtypes bfloat16 \
    --num-seqs $NSEQ --max-num-seqs $NSEQ --reps 2 --json
step bench_rollout_big 40 "$PY" -m parity.cli bench rollout --device "$DEVICE" --preset $BIG --dtypes bfloat16 \
    --num-seqs $BIG_NSEQ --max-num-seqs $BIG_NSEQ --reps 1 --json
if [ -n "${SMOKE:-}" ]; then REST=(tests/parity/test_bitwise.py::test_one_vs_two_threads); else
    REST=($TESTS); for t in $CORE; do REST+=(--deselect "$t"); done; fi
pytest_step bitwise 60 "${REST[@]}"
# warm_gemm's row: rc (198: still compiling when bench gemm began) and the seconds from its start
# to then (its own compile time is the "seconds" of its JSON)
if kill -0 "$WARM" 2>/dev/null; then warm_rc=198; else wait "$WARM"; warm_rc=$?; fi
printf 'warm_gemm\t%s\t%s\n' "$warm_rc" "$((SECONDS - WARM_T0))" >> "$STEPS_FILE"
step bench_gemm 55 "$PY" -m parity.cli bench gemm --device "$DEVICE" --preset $BIG --dtype bfloat16 \
    --rows $GEMM_ROWS --reps 2 "$GEMM_TILES" --json
step bench_attention 30 "$PY" -m parity.cli bench attention --device "$DEVICE" --preset $BIG \
    --batches $ATT_BATCHES --contexts $ATT_CONTEXTS --reps 3 --json
step bench_sampler 20 "$PY" -m parity.cli bench sampler --device "$DEVICE" --preset $BIG \
    --batches $BATCHES --reps 3 --json
pytest_step tma 30 tests/parity/test_triton_cuda.py
step bench_gemm_tma 30 "$PY" -m parity.cli bench gemm --device "$DEVICE" --preset $BIG --dtype bfloat16 \
    --rows $GEMM_ROWS --reps 2 "$TMA_TILES" --json
# step 5, with the time left, when bench gemm proposed a ladder that is not just the default tile
if "$PY" -c "import json, sys; lines = open(sys.argv[1]).read().splitlines()
doc = json.loads('\n'.join(lines[next(i for i, x in enumerate(lines) if x.startswith('{')):]))
sys.exit(0 if any(t != [64, 128, 64, 4, 3] for e in doc['gemm_tiles'] for _, t in e[3]) else 1)" \
        "$OUT_DIR/bench_gemm.log" 2>/dev/null; then
    step check_tiled 45 "$PY" -m parity.cli check --device "$DEVICE" --preset $BIG --dtype bfloat16 \
        --rounds 2 --json --cases batch,decode,graphs,engine --gemm-tiles "$OUT_DIR/bench_gemm.log"
    step bench_kernels_tiled 60 "$PY" -m parity.cli bench kernels --device "$DEVICE" --presets $BIG \
        --dtypes bfloat16 --batches $TILED_BATCHES --prefill-len $PREFILL --reps $REPS --json \
        --gemm-tiles "$OUT_DIR/bench_gemm.log"
    step bench_learner_tiled 30 "$PY" -m parity.cli bench learner --device "$DEVICE" --presets $BIG \
        --dtypes bfloat16 --batch 8 --length $LEN --reps $REPS --json --gemm-tiles "$OUT_DIR/bench_gemm.log"
fi

# 6. with whatever time is left: asynchronous against synchronous training on this GPU (the learner
#    and its rollout worker sharing it, so not the published two-GPU setting)
step bench_async 60 "$PY" -m parity.cli bench async --device "$DEVICE" --preset $SMALL --dtype bfloat16 \
    --lags 8 --steps $STEPS --reps 1 --json
if [ "$warm_rc" = 198 ]; then stop_warm; wait "$WARM" 2>/dev/null || true; fi  # (its 143 is not the run's)
# finish (the EXIT trap) writes the summary once more and copies the results out
