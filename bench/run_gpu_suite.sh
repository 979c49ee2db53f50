#!/usr/bin/env bash
# The GPU suite in parts, each sized to one device call; GPU time comes 15 minutes at a time, the
# machine's start (1-3 minutes) included, so the first call (part `first`, <= 7 minutes) answers
# what matters first and the second (<= 6 minutes) runs the part asked for next, in this order:
#   first    (call 1)  versions and tools; the model's predictions of every case (kernels compiled
#            in parallel); correctness of every kernel family through persistent_rnn.torch against
#            torch.nn on the same GPU and float64, forward and backward, last_run checked, two runs
#            bitwise equal (the TF32 tiles too: allow_tf32, a step of their own); stalls and
#            restarts, bitwise; timing at T=100 and T=300 of persistent, GEMM, persistent_rnn.torch
#            and torch.nn (cuDNN) beside the predictions, then the TF32 layer beside its fp32 and
#            cuDNN figures (bench/first_*.py)
#   tests    (call 2)  pytest -m gpu (a hung test costs only itself: bench/pytest_resume.py), then
#            compute-sanitizer memcheck and racecheck on the cluster and the grid cases apart (racecheck
#            through bench/racecheck.py: only the cluster exchange's deliberate pairs pass), and
#            synccheck (tests/gpu_sanitize_case.py --group)
#   bench    prnn info; the full prnn bench (LSTM H=1024 first); the exchange microbenchmark up to
#            clusters of 16; the restart cost
#   compare  fp16 and bf16 (persistent_rnn.torch) against torch.nn; LSTMP; a stack of 2
#   studies  the small layers at clusters of 16, 8 and none; stacks of 3 and 4
#   sweeps   bench/batch_sweep.py, bench/hidden_sweep.py, the GEMM path with CUDA graphs on and off
#   fresh    the A/B of the cluster passes' inputs one or two steps ahead
#            (plan.CLUSTER_INPUTS_AHEAD); the exchange round's parts; the decoder step's stage probe; the exchange round and a
#            grid layer's step with more free polls (--free-polls); the GPU tests, what has
#            not yet run on a GPU first; then the device time of a call by kernel, the call cost
#            at T = 10, 100, 1000, the decode loop, the hand-over's host costs, a decoding
#            step's profile
# Usage: bench/run_gpu_suite.sh [--dry-run] [--cpu] OUT [PART...]   (default part: first)
#   --dry-run lists the steps, their time limits and each part's total, and runs nothing.
#   --cpu runs part `first` without a GPU (the CPU emulation at tiny sizes: a check of the harness,
#   its figures mean nothing), each step's limit times CPU_LIMIT_SCALE (the emulation builds its
#   kernels with g++, on a machine that may be running other tests). PYTHON=... picks the interpreter (default python3);
#   PRNN_COMMIT=$(git rev-parse HEAD) names the commit in every record where the copy that runs
#   has no .git. Each step has its own time limit (a hung step is killed and reported, the rest
#   run); the item steps of `first` also end a hung item after its own limit and go on with the
#   rest. $OUT/steps.jsonl holds each step's status; `first` ends with its summary table
#   ($OUT/first_summary.txt), the other parts with bench/summarize.py OUT.
set -u
cd "$(dirname "$0")/.."
DRY=0
CPU=0
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --cpu) CPU=1 ;;
    *) break ;;
  esac
  shift
done
ALL_PARTS="first tests bench compare studies sweeps fresh"
if [ $# -lt 1 ]; then echo "usage: $0 [--dry-run] [--cpu] OUT [${ALL_PARTS// /|} ...]" >&2; exit 2; fi
OUT=$(realpath -m "$1")
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(first)
for part in "${PARTS[@]}"; do
  case " $ALL_PARTS " in
    *" $part "*) ;;
    *) echo "unknown part '$part' ($ALL_PARTS)" >&2; exit 2 ;;
  esac
  if [ $CPU = 1 ] && [ "$part" != first ]; then
    echo "--cpu runs part 'first' only (the others measure or sanitize a GPU)" >&2; exit 2
  fi
done
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PRNN_COMMIT=${PRNN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# nvdisasm (the latency model reads SASS) and compute-sanitizer: the CUDA toolkit's, else the
# copy of nvdisasm that triton ships (the device image has one under triton/backends/nvidia/bin)
NVCC=$(command -v nvcc) && export PATH="$PATH:$(dirname "$NVCC")"
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
if [ $DRY = 0 ] && ! command -v nvdisasm >/dev/null; then
  TRITON_BIN=$("$PY" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))' 2>/dev/null)
  [ -n "$TRITON_BIN" ] && [ -x "$TRITON_BIN/nvdisasm" ] && export PATH="$PATH:$TRITON_BIN"
fi
export PRNN_SANITIZER_LOGS="$OUT"  # where tests/test_gpu_persistent.py writes a sanitizer log
FIRST_FLAGS=()
[ $CPU = 1 ] && FIRST_FLAGS=(--cpu)
PART_TOTAL=0
TOTAL=0
ORDER=()
declare -A STATUS SECONDS_OF LIMIT_OF

record() {  # record NAME STATUS RC SECONDS LIMIT: one line of $OUT/steps.jsonl
  printf '{"step": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit": %s}\n' "$@" >> "$OUT/steps.jsonl"
}

CPU_LIMIT_SCALE=3

step() {  # step NAME LIMIT_S COMMAND...: run under a time limit, log to $OUT/NAME.log and .err
  local name=$1 limit=$2; shift 2
  [ $CPU = 1 ] && limit=$((limit * CPU_LIMIT_SCALE))
  TOTAL=$((TOTAL + limit))
  PART_TOTAL=$((PART_TOTAL + limit))
  ORDER+=("$name")
  LIMIT_OF[$name]=$limit
  echo "== $name (limit ${limit}s): $*"
  if [ $DRY = 1 ]; then STATUS[$name]=dry; SECONDS_OF[$name]=0; return; fi
  local start=$SECONDS rc left=$limit
  while :; do
    timeout --kill-after=3 "$left" "$@" > >(tee -a "$OUT/$name.log") 2> >(tee -a "$OUT/$name.err" >&2)
    rc=$?
    left=$((limit - (SECONDS - start)))
    # 75: bench/first_call.py ended an item that hung; run the step again for the rest
    [ $rc = 75 ] && [ $left -ge 10 ] || break
    echo "== $name: an item hung; once more for the rest (${left}s left)"
  done
  STATUS[$name]=$rc
  SECONDS_OF[$name]=$((SECONDS - start))
  local status=failed
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; 75) status=hung ;; esac
  record "$name" "$status" "$rc" "${SECONDS_OF[$name]}" "$limit"
}

first_step() {  # first_step NAME LIMIT_S STEP [ARGS...]: a step of bench/first_call.py
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$PY" bench/first_call.py "$@" --out "$OUT" "${FIRST_FLAGS[@]}"
}

bench_run() {  # bench_run NAME LIMIT_S [prnn bench options...]: prnn bench into $OUT/NAME/
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$PY" -m persistent_rnn.cli bench --out "$OUT/$name" \
    --max-seconds $((limit - 25)) --no-progress "$@"
}

sanitize() {  # sanitize TOOL GROUP LIMIT_S: compute-sanitizer over one group of the cases
  local tool=$1 group=$2 limit=$3
  # the sanitizer slows the kernels far past the barrier timeout: no restarts under it
  step "sanitize_${tool}_${group//,/_}" "$limit" env PRNN_TIMEOUT_MS=30000 PRNN_LINEINFO=1 \
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" tests/gpu_sanitize_case.py --group "$group"
}

racecheck() {  # racecheck GROUP LIMIT_S CASE_LIMIT_S CASES: bench/racecheck.py over CASES
  local group=$1 limit=$2 case_limit=$3 cases=$4
  step "sanitize_racecheck_$group" "$limit" env PRNN_TIMEOUT_MS=30000 PRNN_LINEINFO=1 "$PY" \
    bench/racecheck.py run --cases "$cases" --case-limit "$case_limit" --budget $((limit - 5))
}

part_first() {  # limits 419 s: the call's timeout_s 450 leaves room for the start of each step
  # (measured 2026-11-26 on an H100 and an H200: predict 11 s, each correct group 10-13 s, stall
  # 20-21 s, time 26-33 s before the fp16 points came)
  first_step first_env 20 env
  first_step first_predict 45 predict
  first_step first_correct_fp32 35 correct --group fp32
  first_step first_correct_tf32 25 correct --group tf32
  first_step first_correct_struct 32 correct --group struct
  first_step first_correct_half 32 correct --group half
  first_step first_stall 35 stall
  first_step first_time 150 time
  first_step first_time_tf32 30 time_tf32
  first_step first_report 15 report
}

part_tests() {  # limits 305 s
  # test_torch_module_db.py holds no GPU test and imports torch's test suite, which needs
  # expecttest (not in the device image): collecting it would stop the whole run.
  step gpu_tests 140 "$PY" bench/pytest_resume.py --budget 130 -- -m gpu -p no:cacheprovider \
    --timeout=60 -rfEs --durations=15 -k "not compute_sanitizer" \
    --ignore=tests/test_torch_module_db.py --continue-on-collection-errors tests/
  # The sanitizer steps load kernels built with a line table (PRNN_LINEINFO=1: same SASS), so
  # reports name source lines. Unsanitized first: builds those kernels for the later steps.
  step sanitize_case 45 env PRNN_LINEINFO=1 "$PY" tests/gpu_sanitize_case.py --group cluster,grid
  sanitize memcheck cluster 20
  sanitize memcheck grid 15
  # racecheck reports the cluster exchange's deliberate pairs (an LDS poll of this CTA's words
  # against another CTA's DSMEM store): bench/racecheck.py runs a process per case (2-5 s each
  # on an H100) and passes only those pairs, from the SASS and line table of the cubin the case
  # ran; anything else fails the step, named. Not cluster-fp16-lstm nor cluster16-fp32-gru: under
  # racecheck their exchange waits time out (docs/benchmarks.md).
  racecheck cluster 40 15 cluster-fp32-gru,cluster-fp32-lstm,cluster-fp32-rnn_tanh,cluster-fp32-rnn_relu
  racecheck grid 30 15 grid-fp32-lstm,grid-fp16-gru,grid-fp32-gru
  sanitize synccheck cluster,grid 15
}

part_bench() {  # limits 300 s
  step info 20 "$PY" -m persistent_rnn.cli info --json
  [ $DRY = 1 ] || cp "$OUT/info.log" "$OUT/info.json"
  bench_run bench 190
  step barrier_latency 45 "$PY" bench/barrier_latency.py --out "$OUT"
  step restart_cost 45 "$PY" bench/restart_cost.py --out "$OUT"
}

part_compare() {  # limits 325 s
  # fp16: cuDNN's persistent algorithm where torch picks it (H multiple of 128, input 128, B 8 and
  # 16) and where it cannot (B 1-4, H 192); H 1024 first (points left when the time is spent are
  # skipped). bf16 reaches the library's kernels on a GPU through persistent_rnn.torch only.
  bench_run bench_fp16 100 --dtype float16 --cells lstm --hidden 1024,512,192,128 \
    --batches 1,2,4,8,16 --input-size 128 --seq-len 100 --algos persistent,gemm,prnn_torch,cudnn
  bench_run bench_bf16 60 --dtype bfloat16 --cells lstm,gru --hidden 1024,128 --batches 1,8,16 \
    --input-size 128 --seq-len 100 --algos prnn_torch,cudnn
  bench_run bench_lstmp_1024_256 60 --cells lstm --hidden 1024 --proj-size 256 \
    --batches 1,2,4,8 --seq-len 100
  bench_run bench_lstmp_2048_512 50 --cells lstm --hidden 2048 --proj-size 512 \
    --batches 1,2,4,8 --seq-len 100
  bench_run bench_stack_2 55 --layers 2 --cells lstm,gru --hidden 256 --batches 1,4,8 --seq-len 100
}

part_studies() {  # limits 320 s
  # The cluster placements of the same small layers side by side: 16 CTAs of 4 warps (the
  # default on H100/H200), 8 of 8 warps (the portable size), the grid path (0), each beside
  # torch.nn and the model's prediction for that placement.
  for most in 16 8 0; do
    PRNN_MAX_CLUSTER_CTAS=$most bench_run "bench_cluster_$most" 70 --cells lstm,gru,rnn_tanh \
      --hidden 256,512,128 --batches 1,4 --seq-len 100 --algos persistent,cudnn
  done
  for layers in 3 4; do
    bench_run "bench_stack_$layers" 55 --layers "$layers" --cells lstm,gru --hidden 256 \
      --batches 1,4,8 --seq-len 100
  done
}

part_sweeps() {  # limits 260 s
  step batch_sweep 70 "$PY" bench/batch_sweep.py --out "$OUT" --max-seconds 50
  step hidden_sweep 100 "$PY" bench/hidden_sweep.py --out "$OUT" --max-seconds 75
  PRNN_GEMM_GRAPHS=1 bench_run bench_gemm_graphs_on 45 --algos gemm --cells lstm,gru \
    --hidden 1024,256 --batches 1,8 --seq-len 100
  PRNN_GEMM_GRAPHS=0 bench_run bench_gemm_graphs_off 45 --algos gemm --cells lstm,gru \
    --hidden 1024,256 --batches 1,8 --seq-len 100
}

part_fresh() {  # limits 360 s: what has not yet run on a GPU, in the order to learn it
  # The cluster passes fetch their inputs one step ahead again (two ahead measured slower on the
  # H200, 2026-11-27): both in one process, GRU H=256 B=1 and RNN-tanh H=512 B=1 forward slopes,
  # each beside its prediction (docs/design.md, "Inputs fetched two steps ahead in a cluster")
  step inputs_ahead 15 "$PY" bench/gpu_call_cost.py --out "$OUT" --inputs-ahead
  # the exchange round split into its parts (docs/design.md, "Latency model"): at 1 and 16 CTAs
  # the grid's round with one warp, a warp vote, one thread's quad (relaxed, release/acquire), the
  # cluster's with one warp, its own copy stored locally, the cluster barrier; the timer's costs
  step round_anatomy 10 "$PY" bench/barrier_latency.py --out "$OUT" --anatomy --rounds 3000 \
    --repeats 3
  # issue 29: where a captured decoder step's 6.36 us go (H200, 2026-11-27; 4.59 predicted): the
  # probe's %globaltimer stamps of each stage, LSTM H=640 and H=256 B=1, captured and eager, the
  # shipped kernels and those whose hand-off waits poll 64 times before they sleep
  step decoder_probe 40 "$PY" bench/decoder_probe.py --out "$OUT" --free-polls 64
  # the grid's exchange round (most of a grid step) with more polls before a waiting thread
  # reads the timer and sleeps (PRNN_GRID_FREE_POLLS; the kernels poll freely twice)
  step free_polls 10 "$PY" bench/barrier_latency.py --out "$OUT/free_polls" --quick --repeats 3 \
    --rounds 5000 --free-polls 8,32,128
  # and a grid layer's step with 32 (LSTM H=1024 B=4, GRU H=1024 B=1: A B B A, beside the model)
  step free_polls_layers 20 "$PY" bench/gpu_call_cost.py --out "$OUT" --free-polls
  # newest first (2026-11-27, after that day's H200 run): the hand-over between torch and CuPy
  # and the GEMM path's planned calls (gemm_plans) on CuPy
  # through torch's C bindings (a failure there breaks every torch module on CUDA), the torch
  # modules' planned CUDA backward, the decoder's direct step launch and single output
  # allocation, the 16-bit weight gradients in TF32 (test_half_gpu's B=8 case), the cluster
  # projection (fixed that day); then what ran clean that day: the TF32 tiles, the chain graphs,
  # the mma projection and 16-bit stacks, the captured products, the per-call allocations
  step fresh_tests 90 "$PY" bench/pytest_resume.py --budget 80 -- -m gpu -p no:cacheprovider \
    --timeout=60 -rfEs --durations=10 tests/test_gpu_torch_interop.py \
    tests/test_gpu_gemm.py::test_planned_gemm_calls_equal_full_calls_on_the_gpu \
    "tests/test_torch_features.py::test_cuda_graph_capture_of_forced_persistent_modules_replays_training_steps" \
    "tests/test_torch_features.py::test_cuda_graph_capture_of_a_forced_persistent_cell_loop_runs_the_fused_step" \
    tests/test_gpu_stack.py::test_widened_16bit_elman_stack_matches_float64 \
    tests/test_torch_call_plans.py tests/test_gpu_decoder.py tests/test_half_gpu.py \
    tests/test_gpu_projection.py tests/test_tf32.py tests/test_gpu_chain_graphs.py \
    tests/test_gpu_half_projection.py tests/test_gpu_matmul.py tests/test_call_allocations.py
  step call_kernels 20 "$PY" bench/call_kernels.py --out "$OUT"
  # issue 26: per call at T = 10, 100 and 1000 beside torch.nn (cuDNN), one process
  step gpu_call_cost 85 "$PY" bench/gpu_call_cost.py --out "$OUT" --steps 10,100,1000 --calls 15
  # ... and a four-layer LSTM stack's call in stack mode (its host predicted from the CPU
  # stand-in's measured increments, hardware.PYTHON_GROUP_US, never yet timed on a GPU)
  step stack_call_cost 10 "$PY" bench/gpu_call_cost.py --out "$OUT" --stack --steps 10,100 \
    --calls 10
  # (measured 18 s and 15 s on the H200 with its 12 s of loops, 2026-11-26 and -27)
  step decode_loop 25 "$PY" bench/decode_loop.py --out "$OUT" --max-seconds 12
  step interop_cost 10 "$PY" bench/interop_cost.py --out "$OUT"
  step decoder_profile 25 "$PY" bench/decoder_profile.py --out "$OUT"
}

[ $DRY = 1 ] || mkdir -p "$OUT" || exit 2
for part in "${PARTS[@]}"; do
  PART_TOTAL=0
  "part_$part"
  echo "== part $part: time limits ${PART_TOTAL}s"
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
  echo "command: $0 $([ $CPU = 1 ] && echo '--cpu ')$OUT ${PARTS[*]}"
  for name in "${ORDER[@]}"; do echo "step $name: exit ${STATUS[$name]}, ${SECONDS_OF[$name]}s of ${LIMIT_OF[$name]}s"; done
} > "$OUT/suite-$(IFS=-; echo "${PARTS[*]}").txt"
if [ "${PARTS[*]}" != first ]; then
  "$PY" bench/summarize.py "$OUT" | tee "$OUT/summary.txt"
fi
