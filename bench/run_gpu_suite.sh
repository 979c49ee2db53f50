#!/usr/bin/env bash
# The GPU benchmark suite in bounded time (about 8 minutes on an H200):
#   prnn info --json, the full prnn bench, and the four studies, all into one directory,
#   then a short summary. Usage: bench/run_gpu_suite.sh [OUT_DIR]   (PYTHON=... to pick the interpreter)
# Each step has its own time limit; a failed or timed-out step is reported and the suite goes on.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-bench/results/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
declare -A STATUS

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > >(tee "$OUT/$name.log") 2> >(tee "$OUT/$name.err" >&2)
  STATUS[$name]=$?
}

step info 60 "$PY" -m persistent_rnn.cli info --json
cp "$OUT/info.log" "$OUT/info.json"
step bench 200 "$PY" -m persistent_rnn.cli bench --out "$OUT/bench" --max-seconds 170 --no-progress
step batch_sweep 70 "$PY" bench/batch_sweep.py --out "$OUT" --max-seconds 50
step hidden_sweep 100 "$PY" bench/hidden_sweep.py --out "$OUT" --max-seconds 75
step restart_cost 45 "$PY" bench/restart_cost.py --out "$OUT"
step barrier_latency 45 "$PY" bench/barrier_latency.py --out "$OUT"

echo "== summary ($OUT)"
for name in info bench batch_sweep hidden_sweep restart_cost barrier_latency; do
  echo "  $name: exit ${STATUS[$name]}"
done
"$PY" bench/summarize.py "$OUT"
