#!/usr/bin/env bash
# What a session with a lent GPU runs, in one go (issue 24), from the repository root:
#   1. the GPU tier, `make test-gpu`, on the offline path (python3 already imports a CUDA torch:
#      used directly with the repository on PYTHONPATH, nothing installed);
#   2. `make bench-gpu` (fresh processes per system, --repeat 3 with the order alternating) on a
#      GPT-2-medium-like shape (d 1024, seq 1024; 12 layers to fit the time), world size 1.
# Logs go to $OUT (or ./gpu-session-logs): env.txt, tier.log, bench.log, bench-gpu.jsonl,
# summary.txt. Each part has its own time limit; a failing part does not stop the next one. The
# tier runs with -v, so a tier cut by its limit still names each test's result in tier.log. On
# the 2026-11-27 H100 run the tier's first 36 of 41 tests took 290 s and a bench launch ~18 s
# (5 systems x 2 passes: 188 s): about 11 minutes in all, inside a 15-minute lease only with
# BENCH_LIMIT_S trimmed; give the tier most of the time.
set -u
cd "$(dirname "$0")/.."
LOGS="${OUT:-gpu-session-logs}"
mkdir -p "$LOGS"
PY="${PY:-python3}"
TIER_LIMIT_S="${TIER_LIMIT_S:-360}"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-200}"
# TIER_TESTS: test files / node ids in the order to run them (pytest keeps the command line's
# order), so a tier cut by its limit has reached those first; empty: every gpu test, collected.
TIER_TESTS="${TIER_TESTS:-}"

{
    date -u
    git rev-parse HEAD 2>/dev/null || echo "(not a git checkout)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1
    "$PY" -c 'import megatron.core as m; print("megatron.core", getattr(m, "__version__", "?"))' \
        2>&1 | tail -1
} | tee "$LOGS/env.txt"

if ! "$PY" -c 'import sys, torch, pytest; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    echo "!! $PY does not import a CUDA build of torch and pytest: make will build .venv-gpu" \
        "(needs a pip index)" | tee -a "$LOGS/env.txt"
fi
TIMEOUT_ARG=""
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then TIMEOUT_ARG="--timeout 150"; fi

start=$(date +%s)
timeout "$TIER_LIMIT_S" make test-gpu PY="$PY" \
    GPU_TEST_ARGS="-v -rs -m gpu -p no:cacheprovider $TIMEOUT_ARG $TIER_TESTS" >"$LOGS/tier.log" 2>&1
tier_rc=$?
tier_s=$(($(date +%s) - start))
tail -25 "$LOGS/tier.log"

start=$(date +%s)
# SYSTEMS overrides the list; 3 warm-up steps let bucket_size="auto" systems re-plan in warm-up.
SYSTEMS="${SYSTEMS:-torch_ddp_gabv,megabuf_ar_overlap,megabuf_distopt_overlap,mcore_ddp_overlap,mcore_distopt_overlap}"
timeout "$BENCH_LIMIT_S" make bench-gpu PY="$PY" BENCH_GPU_OUT="$LOGS/bench-gpu.jsonl" \
    BENCH_GPU_ARGS="--world-size 1 --models gpt_small:4 --gpt-width 1024 --gpt-depth 12 \
--gpt-seq-len 1024 --warmup 3 --steps 6 --hooks none --systems $SYSTEMS" >"$LOGS/bench.log" 2>&1
bench_rc=$?
bench_s=$(($(date +%s) - start))
tail -40 "$LOGS/bench.log"

{
    echo "tier: exit $tier_rc in ${tier_s} s (limit $TIER_LIMIT_S s; 124 = cut by the limit)"
    echo "bench: exit $bench_rc in ${bench_s} s (limit $BENCH_LIMIT_S s; 124 = cut by the limit)"
    grep -E "passed|failed" "$LOGS/tier.log" | tail -1
    # a process that aborted at exit (issue 48) fails the session even where its parent went on
    aborts=$(cat "$LOGS/tier.log" "$LOGS/bench.log" | grep -c "terminate called")
    echo "aborts at exit ('terminate called' in the logs): $aborts"
} | tee "$LOGS/summary.txt"
[ "$tier_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && ! grep -q "terminate called" "$LOGS/tier.log" \
    "$LOGS/bench.log"
