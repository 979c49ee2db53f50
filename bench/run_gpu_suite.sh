#!/usr/bin/env bash
# The GPU suite in bounded time, in parts that each fit one device call (10 minutes):
#   tests    pytest -m gpu, then compute-sanitizer (memcheck, racecheck, synccheck) on
#            tests/gpu_sanitize_case.py (grid and cluster, forward and backward, fp32 and fp16,
#            a stall with restart, LSTMP, a stack)                                 ~9.3 min at most
#   bench    prnn info --json, the full prnn bench (persistent, GEMM, torch.nn/cuDNN), the
#            exchange microbenchmark against grid size, the restart cost            ~5 min at most
#   compare  the 16-bit sweep against torch.nn fp16/bf16, the GEMM path with CUDA graphs on and
#            off, LSTMP (H 1024/P 256, H 2048/P 512) and stacks of 2-4 layers against torch.nn
#                                                                                   ~8.8 min at most
#   studies  bench/batch_sweep.py and bench/hidden_sweep.py, and the small layers at clusters
#            of 16, 8 and none (PRNN_MAX_CLUSTER_CTAS; not in the default)          ~6.5 min at most
# Usage: bench/run_gpu_suite.sh [--dry-run] OUT [PART...]   (default parts: tests bench compare)
#   PYTHON=... picks the interpreter (default python3); PRNN_COMMIT=$(git rev-parse HEAD) names the
#   commit in every JSON where the copy that runs has no .git. --dry-run lists the steps, their
#   time limits and the total, and runs nothing. Each step has its own time limit; a failed or
#   timed-out step is reported and the suite goes on. Ends with bench/summarize.py OUT.
set -u
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $# -lt 1 ]; then echo "usage: $0 [--dry-run] OUT [tests|bench|compare|studies ...]" >&2; exit 2; fi
OUT=$(realpath -m "$1")
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests bench compare)
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PRNN_COMMIT=${PRNN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# nvdisasm (the latency model reads SASS) and compute-sanitizer: where the CUDA toolkit has them
NVCC=$(command -v nvcc) && export PATH="$PATH:$(dirname "$NVCC")"
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
export PRNN_SANITIZER_LOGS="$OUT"
TOTAL=0
ORDER=()
declare -A STATUS SECONDS_OF LIMIT_OF

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log and .err
  local name=$1 limit=$2; shift 2
  TOTAL=$((TOTAL + limit))
  ORDER+=("$name")
  LIMIT_OF[$name]=$limit
  echo "== $name (limit ${limit}s): $*"
  if [ $DRY = 1 ]; then STATUS[$name]=dry; SECONDS_OF[$name]=0; return; fi
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > >(tee "$OUT/$name.log") 2> >(tee "$OUT/$name.err" >&2)
  STATUS[$name]=$?
  SECONDS_OF[$name]=$((SECONDS - start))
}

bench_run() {  # bench_run NAME LIMIT_S [prnn bench options...]: prnn bench into $OUT/NAME/
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$PY" -m persistent_rnn.cli bench --out "$OUT/$name" \
    --max-seconds $((limit - 25)) --no-progress "$@"
}

part_tests() {
  step gpu_env 20 bash -c 'nvidia-smi; '"$PY"' -c "import cupy, torch, numpy; print(\"cupy\", cupy.__version__, \"torch\", torch.__version__, \"numpy\", numpy.__version__)"; which compute-sanitizer nvdisasm'
  # test_torch_module_db.py holds no GPU test and imports torch's test suite, which needs
  # expecttest (not in the device image): collecting it would stop the whole run.
  step gpu_tests 190 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout=200 -rfEs \
    --durations=15 -k "not compute_sanitizer" --ignore=tests/test_torch_module_db.py \
    --continue-on-collection-errors tests/
  # The sanitizer steps pass no --timeout to pytest: the step's limit ends the whole process group
  # (pytest and the sanitizer under it), where pytest's own would leave the sanitizer running.
  step sanitize_case 45 "$PY" tests/gpu_sanitize_case.py  # unsanitized, and warms the kernel cache
  step sanitize_memcheck 100 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    tests/test_gpu_persistent.py -k "compute_sanitizer and memcheck"
  step sanitize_racecheck 110 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    tests/test_gpu_persistent.py -k "compute_sanitizer and racecheck"
  step sanitize_synccheck 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    tests/test_gpu_persistent.py -k "compute_sanitizer and synccheck"
}

part_bench() {
  step info 30 "$PY" -m persistent_rnn.cli info --json
  [ $DRY = 1 ] || cp "$OUT/info.log" "$OUT/info.json"
  bench_run bench 190
  step barrier_latency 45 "$PY" bench/barrier_latency.py --out "$OUT"
  step restart_cost 45 "$PY" bench/restart_cost.py --out "$OUT"
}

part_compare() {
  # fp16: cuDNN's persistent algorithm where torch picks it (H multiple of 128, input 128, B 8 and
  # 16) and where it cannot (B 1-4, H 192); the issue's H 1024 first (points left when the time
  # budget is spent are skipped), then the small H (128, 192).
  bench_run bench_fp16 110 --dtype float16 --cells lstm --hidden 1024,512,192,128 \
    --batches 1,2,4,8,16 --input-size 128 --seq-len 100
  bench_run bench_bf16 45 --dtype bfloat16 --cells lstm,gru --hidden 128,1024 --batches 1,8,16 \
    --input-size 128 --seq-len 100
  PRNN_GEMM_GRAPHS=1 bench_run bench_gemm_graphs_on 45 --algos gemm --cells lstm,gru \
    --hidden 256,1024 --batches 1,8 --seq-len 100
  PRNN_GEMM_GRAPHS=0 bench_run bench_gemm_graphs_off 45 --algos gemm --cells lstm,gru \
    --hidden 256,1024 --batches 1,8 --seq-len 100
  bench_run bench_lstmp_1024_256 60 --cells lstm --hidden 1024 --proj-size 256 \
    --batches 1,2,4,8 --seq-len 100
  bench_run bench_lstmp_2048_512 60 --cells lstm --hidden 2048 --proj-size 512 \
    --batches 1,2,4,8 --seq-len 100
  for layers in 2 3 4; do
    bench_run "bench_stack_$layers" 55 --layers "$layers" --cells lstm,gru --hidden 256 \
      --batches 1,4,8 --seq-len 100
  done
}

part_studies() {
  step batch_sweep 70 "$PY" bench/batch_sweep.py --out "$OUT" --max-seconds 50
  step hidden_sweep 100 "$PY" bench/hidden_sweep.py --out "$OUT" --max-seconds 75
  # The cluster placements of the same small layers side by side: 16 CTAs of 4 warps (the
  # default on H100/H200), 8 of 8 warps (the portable size), the grid path (0), each beside
  # torch.nn and the model's prediction for that placement.
  for most in 16 8 0; do
    PRNN_MAX_CLUSTER_CTAS=$most bench_run "bench_cluster_$most" 70 --cells lstm,gru,rnn_tanh \
      --hidden 256,512,128 --batches 1,4 --seq-len 100 --algos persistent,cudnn
  done
}

[ $DRY = 1 ] || mkdir -p "$OUT" || exit 2
for part in "${PARTS[@]}"; do
  case $part in
    tests|bench|compare|studies) "part_$part" ;;
    *) echo "unknown part '$part' (tests, bench, compare, studies)" >&2; exit 2 ;;
  esac
done

echo "== summary ($OUT): parts ${PARTS[*]}, time limits ${TOTAL}s in all, commit $PRNN_COMMIT"
for name in "${ORDER[@]}"; do
  echo "  $name: exit ${STATUS[$name]} (${SECONDS_OF[$name]}s of ${LIMIT_OF[$name]}s)"
done
[ $DRY = 1 ] && exit 0
{
  echo "parts: ${PARTS[*]}"
  echo "commit: $PRNN_COMMIT"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: $0 $OUT ${PARTS[*]}"
  for name in "${ORDER[@]}"; do echo "step $name: exit ${STATUS[$name]}, ${SECONDS_OF[$name]}s of ${LIMIT_OF[$name]}s"; done
} > "$OUT/suite-$(IFS=-; echo "${PARTS[*]}").txt"
"$PY" bench/summarize.py "$OUT" | tee "$OUT/summary.txt"
