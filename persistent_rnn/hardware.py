"""The GPU limits the planner sizes the persistent kernels by: one table, no GPU needed.

``WARP`` .. ``MAX_REGISTERS_PER_THREAD`` hold on every supported architecture (sm_80, sm_90);
``PROFILES`` are the named devices the planner and the CPU emulation plan for; ``current_device``
reads the same fields from the current CuPy device. Figures from NVIDIA's CUDA C++ Programming
Guide (compute capability tables) and the A100/H100 whitepapers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

WARP = 32
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated to a warp in units of 256
SUB_PARTITIONS = 4  # an SM's register file is split among 4 schedulers; a warp lives in one
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536  # every supported GPU; the shipped tiles are sized for it
# Bytes per weight of the dtypes the persistent kernels hold W_hh in: fp32 one weight per 32-bit
# register, 16-bit a packed pair of adjacent columns per register (persistent_common.cuh).
WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Most registers of weights one thread of a shipped tile holds (8 warps at the 255 cap): the rest
# (accumulators, staged values, 16-bit conversions, addresses) must fit beside them. ptxas kept
# every shipped tile within it with zero spills on sm_80 and sm_90 (fp32: 190-200, 16-bit: 180-196).
WEIGHT_REGISTER_BUDGET = 200
PORTABLE_CLUSTER_CTAS = 8      # the largest cluster every sm_90+ device runs (CUDA Programming Guide)
HOPPER_CLUSTER_CTAS = 16       # H100/H200 with CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
DEFAULT_FP32_LANES = 128  # FP32 FMA lanes per SM (sm_86, sm_89, sm_90)
FP32_LANES = {(8, 0): 64}  # where it differs, by compute capability (A100: 64)


def fp32_lanes_per_sm(major: int, minor: int) -> int:
    """FP32 FMA lanes per SM of a compute capability (the fp32 peak's per-SM width)."""
    return FP32_LANES.get((major, minor), DEFAULT_FP32_LANES)


@dataclass(frozen=True)
class DeviceProfile:
    """The device properties the planner needs."""

    name: str
    sm_count: int
    registers_per_sm: int = REGISTERS_PER_SM
    max_registers_per_thread: int = MAX_REGISTERS_PER_THREAD
    shared_per_block: int = 232448  # opt-in maximum of dynamic shared memory per block (sm_90)
    shared_per_sm: int = 233472
    max_threads_per_block: int = 1024
    arch: str = "sm_90"
    clock_mhz: float = 1980.0  # maximum SM clock (the latency model's cycles -> time)
    # CTAs of the largest thread-block cluster the planner may place a layer in (sm_90 and newer):
    # 8 is CUDA's portable maximum; Hopper runs 16 once a kernel allows a non-portable size
    # (kernels.py sets the attribute; the runtime re-plans at 8 where a 16-CTA cluster does not fit).
    max_cluster_ctas: int = PORTABLE_CLUSTER_CTAS
    # Whether a float32 layer may run on the TF32 tensor-core tiles (settings.allow_tf32, applied
    # by runtime.planning_device; a profile's field so that every plan cache keys on it).
    allow_tf32: bool = False


PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 132, max_cluster_ctas=HOPPER_CLUSTER_CTAS),
    "h200": DeviceProfile("h200", 132, max_cluster_ctas=HOPPER_CLUSTER_CTAS),
    "a100": DeviceProfile("a100", 108, shared_per_block=166912, shared_per_sm=167936, arch="sm_80",
                          clock_mhz=1410.0),
}


def current_device() -> DeviceProfile:
    """The profile of the current CuPy device (RuntimeError where there is no GPU or no CuPy)."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"CuPy is not installed ({exc}); pass device='h100' etc.") from exc
    try:
        dev = cupy.cuda.Device()
        attrs = dev.attributes
    except RuntimeError as exc:  # CuPy's CUDARuntimeError: no driver or no GPU
        raise RuntimeError(f"no CUDA device available to plan for ({exc}); pass device='h100' etc.") from exc
    return DeviceProfile(
        name=f"cuda:{dev.id}", sm_count=attrs["MultiProcessorCount"],
        registers_per_sm=attrs["MaxRegistersPerMultiprocessor"],
        shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
        shared_per_sm=attrs["MaxSharedMemoryPerMultiprocessor"],
        max_threads_per_block=attrs["MaxThreadsPerBlock"], arch=f"sm_{dev.compute_capability}",
        clock_mhz=attrs["ClockRate"] / 1000.0,
        max_cluster_ctas=HOPPER_CLUSTER_CTAS if dev.compute_capability == "90" else PORTABLE_CLUSTER_CTAS)


# ---- the per-step latency model (persistent_rnn/latency.py; docs/design.md, "Latency model") ----
# Public figures, in SM cycles unless the name says otherwise. Sources: NVIDIA's Hopper tuning guide
# and CUDA C++ Programming Guide (one warp instruction issued per scheduler and clock, 4 schedulers
# per SM); Jia et al., "Dissecting the NVIDIA Volta/Turing GPU Architecture via Microbenchmarking"
# (2018/2019: dependent FP32 latency 4 cycles, MUFU about 20); Luo et al., "Benchmarking and
# Dissecting the Nvidia Hopper GPU Architecture" (2024: shared memory about 30 cycles, distributed
# shared memory about 200, L2 hit 200-270 cycles). Figures marked "fitted" are the few that
# bench/model_calibration.py fits to the recorded runs of today's kernels (H200 and H100,
# 2026-11-26); each stays within its public or measured range (FIT_RANGES there).
ISSUE_PER_CYCLE = 1.0          # warp instructions a scheduler issues per cycle
SCHEDULERS_PER_SM = SUB_PARTITIONS
FP_LATENCY = 4                 # dependent FFMA/FADD/integer ALU result
MUFU_LATENCY = 20              # ex2 / rcp / tanh.approx on the special-function unit
SHARED_LATENCY = 30            # ld.shared hit
L1_LATENCY = 35                # ld.local hitting L1 (a stack frame the compiler spills arrays to)
DSMEM_LATENCY = 200            # a store into another CTA's shared memory (cluster), until visible
SHUFFLE_LATENCY = 24           # shfl.sync
# Tensor cores (the mma tiles' HMMA.16816.F32: mma.sync.m16n8k16, fp16/bf16 in, fp32 accumulate).
# Issue interval: NVIDIA's H100 whitepaper, 989.4 dense fp16 TFLOPS (fp32 accumulate) at 1830 MHz
# on 132 SMs = 512 FMA per cycle per sub-partition, so a 16x8x16 mma (2048 FMA) every 4 cycles -
# the peak, which mma.sync is reported not to reach on Hopper (Luo et al. 2024: wgmma's), so a
# bound. Latency: about 33 cycles for m16n8k16 with fp32 accumulation, measured on A100 by Sun et
# al., "Dissecting Tensor Cores via Microbenchmarks" (IEEE TPDS 2022); taken for Hopper's mma.sync.
HMMA_INTERVAL = 4              # cycles between HMMA.16816 of one sub-partition's tensor core
HMMA_LATENCY = 33              # dependent HMMA.16816.F32 (accumulator to accumulator)
MMA_FMA = 16 * 8 * 16          # FMA of one m16n8k16
# TF32 (the TF32 tiles' HMMA.1688.F32.TF32: mma.sync.m16n8k8 .tf32): the same whitepaper gives
# dense TF32 at half the fp16 rate, 494.7 against 989.4 TFLOPS, so 256 FMA per cycle per
# sub-partition and a 16x8x8 mma (1024 FMA) every 4 cycles: the same interval per instruction
# for half the k. Its latency is taken as the m16n8k16's (our sources give no Hopper TF32 figure).
HMMA_TF32_INTERVAL = 4         # cycles between HMMA.1688.F32.TF32 of one sub-partition
MMA_TF32_FMA = 16 * 8 * 8      # FMA of one m16n8k8
SHARED_BYTES_PER_CYCLE = 128   # shared memory bandwidth per SM: 32 banks x 4 bytes (CUDA Guide)
# Wavefronts of an mma tile's 16-byte B load per conflict-free one: the grid's are conflict-free (a
# quarter-warp's two batch rows read a pair of k-steps in opposite orders), a cluster's words are
# read in the plain order, two rows on the same banks (docs/design.md, "Tensor-core tiles").
MMA_B_LOAD_CONFLICT = {"l2": 1, "cluster": 2}
L2_LATENCY = 400               # an L2 round trip under load, 200 ns: the counter barrier of one
                               # CTA (2 block barriers + fence, atomic, poll: 3 round trips)
                               # measured 674 ns (bench/results/h200-2026-11-23/barrier_latency.json)
L2_BANDWIDTH_GBPS = 5500       # L2 -> SM aggregate (H100 class; Chips and Cheese measured 5.5-7 TB/s)
BLOCK_BARRIER = 205            # fitted (205; 297 on the counter-barrier kernels): bar.sync once the
                               # last warp arrives, plus the warps' skew
ATOMIC_SERIAL_NS = 6.1         # per CTA: same-address atomics queue at one L2 slice (the counter
                               # barrier's growth from 1 to 132 CTAs, 674 -> 1472 ns, recorded in
                               # bench/results/h200-2026-11-23/barrier_latency.json)
# The exchange rounds of today's kernels, measured on the H200 by bench/barrier_latency.py
# (bench/results/h200-2026-11-26/call1-fresh/barrier_latency.json; tests/test_latency.py holds
# these tables to that file): ns per round of grid_barrier.cu's exchange loop by CTA count. A round
# is what a step's exchange is with no work around it: every CTA publishes 8 tagged words (one warp,
# one store instruction per destination), waits until it has seen every CTA's words - the
# store's way to L2 or into the cluster's shared memory, the poll that sees them, and a poll that
# missed them by a little costing a whole poll more - and meets its block's barrier. The tagged
# exchange through L2 grows from 865 ns (up to 8 CTAs) to 1638 ns (128): the round ends when the
# last CTA's words are seen, the L2 round trips of CTAs far from the words' L2 partition included.
EXCHANGE_ROUND_NS = {1: 864.9, 2: 868.2, 4: 867.0, 8: 877.7, 16: 1283.8, 32: 1427.1, 64: 1467.5,
                     128: 1638.2, 132: 1654.5}
CLUSTER_ROUND_NS = {1: 547.0, 2: 630.7, 4: 571.5, 8: 592.8, 16: 626.3}
EXCHANGE_ROUND_WORDS = 8       # words each CTA publishes per round there (--width)
# A store instruction into another CTA's shared memory (the cluster's publish: one per destination
# CTA) after the first: the least-squares slope of CLUSTER_ROUND_NS against the CTA count, whose
# round publishes one more per CTA (measured, 3.0 ns; bench/model_calibration.py derives it).
DSMEM_STORE_NS = 3.0
# Cycles from a 4-byte cp.async of the next step's gi (an L2 hit: the input GEMM wrote it just
# before) to its data in shared memory (fitted; public L2 hit latencies are 222-339 cycles unloaded
# (an L40 mapped SM by SM, arXiv 2606.22588), the measured one-CTA tagged-exchange round, a store
# and a load through L2 with a block barrier, is 865 ns = 1713 cycles: the range 222..1713).
PREFETCH_LATENCY = 812         # fitted (812)
# The share of the gather's L2 traffic beyond the measured round's that a step waits for (fitted,
# 0..1: 0 where the loads' bandwidth hides under their round trips, 1 where it adds to them).
EXCHANGE_TRAFFIC_EXPOSED = 0.47  # fitted (0.47)


def exchange_round_ns(table: dict[int, float], ctas: int) -> float:
    """A measured round at ``ctas`` CTAs, interpolated in log2 of the CTA count between the
    recorded sizes (held at the ends)."""
    sizes = sorted(table)
    if ctas <= sizes[0] or ctas >= sizes[-1]:
        return table[sizes[0] if ctas <= sizes[0] else sizes[-1]]
    hi = next(n for n in sizes if n >= ctas)
    lo = sizes[sizes.index(hi) - 1]
    share = (math.log2(ctas) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + share * (table[hi] - table[lo])


# Per call (a benchmark of T steps pays them once). HOST_*: the host work per call of the runtime
# the recorded H200 runs measured (a host sync per call, docs/design.md "Latency model"), fitted;
# only bench/model_calibration.py uses them, to predict those runs.
HOST_FORWARD_US = 500.0        # fitted (501)
HOST_BACKWARD_US = 775.0       # fitted (775)
# The per-call terms of the library's runtime (latency.call_costs): counted API calls times
# public costs.
# NVIDIA, "Getting Started with CUDA Graphs" (A. Gray, 2019): kernels of 2.9 us launched back to
# back without a sync take 3.8 us each (the host's launch rate bounds them), 3.4 us as a graph.
API_CALL_HOST_US = 3.8         # host time of one kernel launch or memset call (runtime API)
GRAPH_GAP_US = 0.5             # device time between kernels in a stream or graph (3.4 - 2.9 us)
EMPTY_LAUNCH_US = 2.0          # device time of a launch that exits at once (estimate: dispatch and
                               # retire of its CTAs plus the gap); resume launches
GEMM_LAUNCH_US = 5.0           # a cuBLAS call's floor (launch and a small grid)
# The Python of one steady-state layer call besides its API calls: the layer API's persistent
# GRU (H=8, B=1, T=1) on the CPU as a replay runs it on a GPU - a planned call (call_plans)
# whose chain graph's key is built over the call's arrays, the replay stubbed (since the ninth
# session of 2026-11-27 the key hashed as the replay's look-up hashes it):
# `bench/call_breakdown.py --stubbed`'s "replayed stand-in" rows. ``PYTHON_H200_RUN_US``: that
# stand-in of the code the H200 run of 2026-11-27 ran, the median of four runs' medians
# (bench/results/cpu-2026-11-27/replayed-338fad5-after-*, the shared 2-core development CPU),
# which the H200's ratio below is taken against. ``PYTHON_*_US``: those figures times the
# measured after / before ratio of every cut since, each the median of interleaved pairs of runs
# of the two codes on the same machine (docs/design.md, "The planned call's Python": branches,
# runs, ratios). NumPy stands for CuPy there: CuPy's own Python per array is not in it; each
# allocation cut counts as NumPy's ``empty`` (about 0.2 µs) times the ratio below, where the
# H200's host measured 1.90 µs a ``cupy.empty`` (bench/results/h200-2026-11-27/call2-fresh/
# interop_cost.log). The tenth session's cut (2026-11-28) is taken as the ratio of the
# instructions its call executes (`bench/call_instructions.py`, callgrind: deterministic, where
# the times of the loaded machine moved by more than the cut): forward 0.943, backward 0.963;
# the eleventh's (2026-11-28: a pass its own issuer, the held context and arrays keyed once,
# the key's fixed parts by token, the weights compared in C) likewise, against the tenth's
# measured code (f9db969): forward 0.789, backward 0.849.
PYTHON_H200_RUN_US = (18.4, 27.4)  # measured (forward, backward)
PYTHON_FORWARD_US = 6.8        # measured ratios x 18.4 (forward)
PYTHON_BACKWARD_US = 8.3       # measured ratios x 27.4 (forward+backward less forward, per run)
# The GPU host's time for that Python against the CPU stand-in's: the layer API's planned
# persistent calls on an H200 (bench/results/h200-2026-11-27, `bench/gpu_call_cost.py`'s host µs
# per call: GRU H=256 B=1, LSTM H=1024 B=4, RNN-tanh H=512 B=1 at T = 10, 100 and 1000, two runs)
# took a median of 101.2 µs forward (59-186) and 121.2 µs more forward+backward; less the one
# graph launch each (API_CALL_HOST_US), over the stand-in's 18.4 / 27.4 µs of that code
# (``PYTHON_H200_RUN_US``). What the stand-in leaves out: CuPy's Python per array (its pool, the
# key's attributes of CuPy arrays). Applied to every CPU-measured Python term of a call
# (latency.call_costs, stack_call_costs): the stack, pair and full-path terms, and the cuts in
# ``PYTHON_*_US`` since that run, were not measured on a GPU.
GPU_PYTHON_RATIO = ((101.2 - API_CALL_HOST_US) / PYTHON_H200_RUN_US[0],  # measured (forward)
                    (121.2 - API_CALL_HOST_US) / PYTHON_H200_RUN_US[1])  # measured (backward)
# A planned stack's or bidirectional layer's call (one graph launch a pass for all its chains,
# latency.stack_call_costs): the Python above plus, per layer-direction beyond the first, the
# increment of its mode - "stack" (a unidirectional stack in stack mode: per layer), "pairs" (a
# bidirectional layer's directions side by side), "layers" (one layer-direction per launch) -
# (forward, backward) µs, measured as above ("replayed stand-in", GRU H=8 B=1 T=1, float32): a
# run of that call beside a single layer's in the same minute, (its median less the single
# layer's; backward: forward+backward less forward) divided by its further layer-directions
# (a three-layer stack in stack mode: 2, the same one layer-direction per launch: 2, a
# bidirectional layer's pair: 1), then times the measured after / before ratio of that
# increment for every cut since (docs/design.md, "The planned call's Python").
PYTHON_GROUP_US = {"stack": (4.6, 8.1), "pairs": (12.8, 19.8), "layers": (12.2, 14.3)}
# The same for a call that is not planned (a 16-bit or projection layer: its full path, checks
# and set-up included): the same layer's call with the chain stubbed at 41d5ca8, before any call
# was planned, the median of nine runs' medians (bench/results/cpu-2026-11-27/stubbed-*-before-*/,
# main at 41d5ca8 beside each branch commit); a lower bound for 16-bit and projection layers,
# whose full path does more.
PYTHON_FULL_FORWARD_US = 77.4  # measured (forward)
PYTHON_FULL_BACKWARD_US = 99.2  # measured (forward+backward less forward, per run)
GEMM_PEAK_FRACTION = 0.5       # of the fp32 peak a large cuBLAS SGEMM reaches
# Of the tensor-core peak above, a cuBLAS GEMM of fp16 operands with fp32 output reaches: measured
# on the H200, torch.mm(..., out_dtype=torch.float32) of 800x1024 @ 1024x4096 in 55.9 us (its fp32
# GEMM of the same operands 210 us, 0.53 of the fp32 peak), bench/call_kernels.py,
# bench/results/h200-2026-11-26. One shape, one GPU: cuDNN's own fp16 GEMM of it took 13 us.
TENSOR_GEMM_PEAK_FRACTION = 0.125
# An eager decoding step's host time (latency.predict_decoder_step: ``host_us``, ``fused_host_us``
# and the torch module's ``torch_*``): the Python of a steady-state step as a GPU runs it -
# counted in instructions on the CPU (`bench/step_instructions.py`, callgrind: an LSTM cell, input
# and hidden size 8, B=1, the launches stubbed, the resident launch's query answered in C;
# bench/results/cpu-2026-11-28/steps-13e5608; taken for every cell, size and stack: their steps
# run the same code, a view or two apart) - at the CPU stand-in's µs per instruction:
# ``PYTHON_FORWARD_US`` was 8.6 µs for that stand-in's forward of 81,997 instructions
# (`bench/call_instructions.py` at f9db969, the same folder). latency.py scales it by the H200
# host's ratio (``GPU_PYTHON_RATIO[0]``) and adds the step's calls into CUDA (``STEP_API_CALLS``)
# at ``API_CALL_HOST_US`` each: a resident step's capture and stream queries
# (``cudaStreamIsCapturing``, ``cudaStreamQuery``) and its launch; the fused step's launch (its
# ``cudaGetDevice`` reads the runtime's thread state: not priced). The torch module's rows (its
# cell's decoder, its cell with algo="persistent") hand CPU tensors over as NumPy arrays: a GPU's
# CuPy arrays and DLPack capsules cost more Python than that.
STAND_IN_US_PER_INSTRUCTION = 8.6 / 81_997  # measured (µs / instructions of the stand-in forward)
STEP_INSTRUCTIONS = {"decoder": 28_335, "fused": 52_529,  # counted (a step, the layer API)
                     "torch-decoder": 69_460, "torch-cell": 199_183}  # counted (torch, CPU)
STEP_API_CALLS = {"decoder": 3, "fused": 1}
