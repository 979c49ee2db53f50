"""Register-file partition of the persistent kernels: the launch plan, or why a layer does not fit.

Pure Python, no GPU needed. The kernels in ``cuda_src/persistent_*.cu`` are compiled in a finite
set of *tiles* (``tiles.py``). A tile fixes, per cell, the hidden units owned by one CTA
(``units``: all G gate rows of them; the grid is ``ceil(H/units)``) and, for each pass, how the
CTA's slice of the matrix (forward: ``G*units`` rows of ``W_hh``, ``K = H`` columns; backward:
``units`` rows of ``W_hh^T``, ``K = G*H``) is spread over warps (``PassTile``): ``rows`` per warp,
``ksplit`` warps sharing a row (each a chunk of ``32*kpt`` columns), ``kpt`` columns per lane.
A thread holds ``rows*kpt`` weights: fp32, one per register, or 16-bit (fp16/bf16, the layer's
dtype), a packed pair of adjacent columns per register, so 16-bit tiles hold twice the weights in
the same registers (``kpt`` even). The register cap per thread (``-maxrregcount``) is what lets
one CTA of that many threads sit on one SM, and ptxas must fit the weights with zero spills
(checked by ``kernel_report``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

from . import cells
from .cells import PROJECTION_CELL, CellSpec
from .hardware import (MAX_REGISTERS_PER_THREAD, PROFILES, REGISTER_ALLOCATION_UNIT,
                       REGISTERS_PER_SM, SUB_PARTITIONS, WARP, WEIGHT_BYTES, DeviceProfile,
                       current_device)
from . import validation
from .tiles import (MMA_MID_CLUSTER_TILES, PROJECTION_TILES, PassTile, ProjectionTile, Tile,
                    cluster_tiles_for, mma_tiles_for, projection_tile_ships, projection_tiles_for,
                    stack_tiles_for, tiles_for)
from .validation import dtype_name

# The dtypes the persistent kernels hold W_hh in, and their -D PRNN_WEIGHT_DTYPE
# (cuda_src/persistent_common.cuh).
KERNEL_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def weight_registers(tile: PassTile, dtype: str) -> int:
    """Registers one thread's weights occupy: ``rows*kpt`` weights of ``WEIGHT_BYTES[dtype]``."""
    return tile.rows * tile.kpt * WEIGHT_BYTES[dtype] // 4


def has_clusters(dev: DeviceProfile) -> bool:
    """Whether layers may run as thread-block clusters on the device: compute capability 9.0
    and newer, and clusters of at least one CTA allowed (``max_cluster_ctas``)."""
    return int(dev.arch.removeprefix("sm_")) >= 90 and dev.max_cluster_ctas > 0


@dataclass(frozen=True)
class PassPlan:
    """Launch plan of one pass (forward or backward) of one tile."""

    kernel: str                # entry point in the .cu file
    source: str                # file in cuda_src/
    defines: dict[str, int]    # the -D macros: the compile-time configuration
    grid: int
    block: int
    shared_bytes: int
    weights_per_thread: int
    weight_registers: int      # registers those weights occupy (16-bit: two per register)
    registers: int             # -maxrregcount: the expected (and maximum) registers per thread
    max_hidden: int            # largest H the compiled tile serves
    exchange_row: int          # words per batch row of the tagged exchange buffer (padded_length)
    exchange_row_b: int = 0    # an LSTM projection's: the same for its second tile's exchange


@dataclass(frozen=True)
class Plan:
    """The plan of one layer-direction: both passes, or the reason it does not fit (what
    limits it, ``not_fit_reason``) and, in ``tried``, why each shipped tile does not."""

    fits: bool
    reason: str | None = None
    tile: Tile | ProjectionTile | None = None
    forward: PassPlan | None = None
    backward: PassPlan | None = None
    tried: tuple[str, ...] = ()

    @property
    def in_batch_groups(self) -> bool:
        """Whether a pass multiplies the batch in groups of rows (``batch_group``: the whole
        batch's staged vector does not fit shared memory)."""
        return any(p is not None and "PRNN_BATCH_GROUP" in p.defines
                   for p in (self.forward, self.backward))


def resident_ctas(threads: int, registers: int, registers_per_sm: int = REGISTERS_PER_SM) -> int:
    """CTAs of ``threads`` threads at ``registers`` per thread that an SM's register file holds.

    CUDA's occupancy rule: each warp's registers (rounded up to the allocation unit) come from
    one of the SM's 4 sub-partitions, so an SM holds ``4 * floor(sub-partition file / per-warp)``
    warps; a CTA of 10 warps at 200 registers (2 warps per sub-partition) does not fit at all.
    """
    per_warp = -(-registers * WARP // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    warps_per_sm = SUB_PARTITIONS * (registers_per_sm // SUB_PARTITIONS // per_warp)
    return warps_per_sm // -(-threads // WARP)


def register_cap(threads: int, registers_per_sm: int = REGISTERS_PER_SM) -> int:
    """Most registers per thread that still let one CTA of ``threads`` threads fit on an SM."""
    cap = MAX_REGISTERS_PER_THREAD
    while cap > 0 and resident_ctas(threads, cap, registers_per_sm) < 1:
        cap -= 1
    return cap


def tile_max_hidden(cell: CellSpec, tile: Tile) -> int:
    """Largest H both passes of ``tile`` serve (column capacity, and a cluster's units; the grid
    is checked per device)."""
    fwd, bwd = tile.forward, tile.backward
    top = min(fwd.ksplit * WARP * fwd.kpt, bwd.ksplit * WARP * bwd.kpt // cell.gates)
    return min(top, tile.units * tile.cluster) if tile.cluster else top


def padded_length(tile: PassTile) -> int:
    """Columns a pass's register tile spans, ``ksplit * 32 * kpt``: the length of a staged vector
    row in shared memory and of a row of the tagged exchange (``persistent_common.cuh``)."""
    return tile.ksplit * WARP * tile.kpt


def warp_teams(cell: CellSpec, tile: PassTile) -> bool:
    """Whether each warp of a layer's forward with ``tile`` finishes its own units
    (``-D PRNN_WARP_TEAMS``, ``kWarpTeams`` of persistent_common.cuh): it holds all G gate rows
    of them over all of K (``ksplit`` 1), so the partial sums need a warp barrier, not a block
    barrier."""
    return tile.ksplit == 1 and tile.rows % cell.gates == 0


def staged_buffers(cell: CellSpec, tile: Tile, stack: bool = False) -> int:
    """Staged copies of h_{t-1} a layer's forward keeps (``-D PRNN_STAGED_BUFFERS``,
    ``kStagedBuffers``): two, by step parity, on the grid with warp teams (a warp may gather
    step t while another still multiplies step t-1's), else one (a cluster reads the exchange
    in its own shared memory; the stack kernels keep one)."""
    return 2 if warp_teams(cell, tile.forward) and not (tile.cluster or stack) else 1


# Steps ahead a layer pass in a cluster fetches its pointwise inputs (1 or 2; ``input_buffers``).
# One: two ahead (three buffers, 86955c7 / 057d690) was predicted to hide the fetch's wait
# (GRU H=256 B=1 forward 1.43 -> 1.13 us/step) but measured slower on an H200 (forward slope,
# bench/gpu_call_cost.py): GRU H=256 B=1 1.443 -> 1.625 / 1.617, RNN-tanh H=512 B=1 1.467 ->
# 1.493 / 1.475 (2026-11-26, ce61c64 -> 2026-11-27, a1f19a2; docs/design.md). A measurement
# may set it to 2, dropping the runtime's cached engines (bench/gpu_call_cost.py's
# cluster_inputs_ahead, the GPU suite's A/B).
CLUSTER_INPUTS_AHEAD = 1

# Polls a grid pass's waiting thread makes before it starts reading the timer and sleeping
# between polls (``-D PRNN_GRID_FREE_POLLS``, exchange.cuh's ``PrnnGridWait``, whose default is
# ``KERNEL_GRID_FREE_POLLS``). The measured exchange round is most of a grid step; whether more
# free polls shorten it is for a GPU to say: bench/barrier_latency.py --free-polls (the bare
# round), bench/gpu_call_cost.py --free-polls (a grid layer's step, setting this and dropping
# the runtime's cached engines). Only a value other than the kernels' default is compiled in,
# so the shipped kernels' defines and SASS stay as recorded.
KERNEL_GRID_FREE_POLLS = 2
GRID_FREE_POLLS = KERNEL_GRID_FREE_POLLS


def input_buffers(tile: Tile, stack: bool = False) -> int:
    """Buffers by step of a layer pass's pointwise inputs (the forward's gi, the backward's dy,
    h, c, saved; ``-D PRNN_INPUT_BUFFERS``, ``kInputBuffers``): in a cluster one more than
    ``CLUSTER_INPUTS_AHEAD`` (its fetch of step t's inputs waits for the product of the step it
    is issued in, as that frees the buffer), else two (the grid fetches a step ahead before its
    product; the stack kernels keep two)."""
    return CLUSTER_INPUTS_AHEAD + 1 if tile.cluster and not stack else 2


@dataclass(frozen=True)
class SharedRegion:
    """One region of a kernel's dynamic shared memory, passed as ``-D PRNN_SMEM_<name>=words``
    (``cuda_src/shared_layout.cuh``): ``words`` 4-byte words per batch row, or in all where not
    ``per_row`` (per-CTA constants); ``align``: bytes its start is rounded up to (``>4``: also
    ``-D PRNN_SMEM_<name>_ALIGN``); ``argument``: a row the kernel takes from a launch argument
    instead (the resident decoder's staged x, whose width is the layer's input size), no define."""

    name: str
    words: int
    per_row: bool = True
    align: int = 4
    argument: bool = False


def layout_bytes(layout: tuple[SharedRegion, ...], batch: int) -> int:
    """Bytes of dynamic shared memory ``layout`` takes at ``batch`` rows: its regions one after
    another, each start rounded up to its alignment (as ``SharedCarver`` carves them)."""
    end = 0
    for region in layout:
        end = -(-end // region.align) * region.align
        end += 4 * region.words * (batch if region.per_row else 1)
    return end


def layout_defines(layout: tuple[SharedRegion, ...]) -> dict[str, int]:
    """The ``-D`` macros that give a kernel ``layout``: ``PRNN_SMEM_<name>`` (and ``_ALIGN``)."""
    defines = {}
    for region in (r for r in layout if not r.argument):
        defines[f"PRNN_SMEM_{region.name}"] = region.words
        if region.align > 4:
            defines[f"PRNN_SMEM_{region.name}_ALIGN"] = region.align
    return defines


def shared_layout(cell: CellSpec, tile: Tile, backward: bool, stack: bool = False,
                  batch_group: int = 0) -> tuple[SharedRegion, ...]:
    """The dynamic shared memory of one CTA of a pass, region by region in the kernel's order:
    the one place it is sized (the kernels carve it from ``layout_defines``).

    Forward (``persistent_forward.cu``): h_{t-1} staged, STAGED [``staged_buffers``][padded]
    per batch row (two by step parity on the grid with warp teams; a cluster stages no vector,
    its STAGED holds the odd steps' partial sums, [ksplit][G*units], in max(padded, that) words);
    the product's partial sums, PARTIAL [ksplit][G*units]; gi by step, GI
    [``input_buffers``][G][units]; c_{t-1} and h_{t-1} of the
    owned units, C and H [units] each; b_hh, BIAS [G][units] in all; the lengths, LENGTHS [1].
    Backward (``persistent_backward.cu``): dgh_{t+1} staged, STAGED [padded] (a cluster's: the
    odd steps' partial sums, [ksplit][units], as the forward's); PARTIAL
    [ksplit][units]; the read-only inputs by step (dy, h, h_prev, [c, c_prev], saved: fetched
    during an earlier step), INPUTS [``input_buffers``][inputs][units]; the dh and dc carries,
    CARRIES [2][units]; LENGTHS [1]. ``padded = ksplit * 32 * kpt``.
    Then a cluster tile's copy of the exchange, EXCHANGE [2][padded] tagged words per batch row,
    16-byte aligned (a grid tile's exchange is in global memory).
    ``stack``: the stack kernels (``stack_*.cu``): one staged buffer, and the forward keeps b_ih
    beside b_hh (BIAS [2][G][units]). ``batch_group`` > 0 (``batch_group``): STAGED holds that
    many batch rows in all, not one per batch row.
    """
    pt = tile.backward if backward else tile.forward
    units, padded = tile.units, padded_length(pt)
    region = SharedRegion

    def staged(words: int) -> SharedRegion:
        if batch_group:
            return region("STAGED", batch_group * words, per_row=False)
        return region("STAGED", words)

    partials = pt.ksplit * (units if backward else cell.gates * units)
    # A cluster's product reads the exchange in place (kDirectRead): its STAGED holds the odd
    # steps' partial sums, in a padded row where they fit (the layout - and SASS - the small
    # layers' cluster kernels were measured and calibrated with), past it where 8 chunks of the
    # mid-size tiles' 96-128 rows do not.
    vector = max(padded, partials) if tile.cluster else padded
    if backward:
        inputs = 3 + 2 * cell.has_cell_state + cell.saved
        layout = (staged(vector), region("PARTIAL", partials),
                  region("INPUTS", input_buffers(tile, stack) * inputs * units),
                  region("CARRIES", 2 * units),
                  region("LENGTHS", 1))
    else:
        rows = cell.gates * units
        layout = (staged(staged_buffers(cell, tile, stack) * vector),
                  region("PARTIAL", partials),
                  region("GI", input_buffers(tile, stack) * rows),
                  region("C", units), region("H", units),
                  region("BIAS", (2 if stack else 1) * rows, per_row=False),
                  region("LENGTHS", 1))
    return layout + ((region("EXCHANGE", 2 * padded, align=16),) if tile.cluster else ())


def shared_bytes(cell: CellSpec, tile: Tile, backward: bool, batch: int,
                 stack: bool = False, batch_group: int = 0) -> int:
    """Dynamic shared memory of one CTA of a pass at ``batch`` rows: ``shared_layout``'s bytes.
    ``tests/test_plan.py`` checks with emulated launches that the kernel carves and uses exactly
    this."""
    return layout_bytes(shared_layout(cell, tile, backward, stack, batch_group), batch)


def groups_batch(tile: Tile) -> bool:
    """Whether a layer kernel's pass of ``tile`` may multiply the batch in groups of rows
    (``batch_group``): the grid's tensor-core tiles. (A cluster reads the exchange in place, and
    its EXCHANGE region holds every batch row: no group makes it smaller; the stack and
    projection kernels stage their own vectors.)"""
    return tile.mma and not tile.cluster


def batch_group(cell: CellSpec, tile: Tile, backward: bool, batch: int, limit: int) -> int:
    """Batch rows a pass of ``tile`` stages at once (``-D PRNN_BATCH_GROUP``, ``kBatchGroup`` of
    persistent_common.cuh; docs/design.md, "Tensor-core tiles": batch groups): 0 - the whole
    batch - where its shared memory fits ``limit`` bytes (or the tile does not group,
    ``groups_batch``), else the largest multiple of 8 rows (whole n-tiles) below the batch whose
    layout fits (each further group costs the step a gather and two block barriers), or 0 where
    not even 8 fit."""
    if not groups_batch(tile) or shared_bytes(cell, tile, backward, batch) <= limit:
        return 0
    for group in range((batch - 1) // 8 * 8, 0, -8):
        if shared_bytes(cell, tile, backward, batch, batch_group=group) <= limit:
            return group
    return 0


# The smallest batch whose 16-bit layers take the tensor-core tiles first (``tiles.MMA_TILES``,
# ``MMA_CLUSTER_TILES``): at B = 1 the latency model predicts the CUDA-core tiles faster (an n-tile
# of 8 columns costs an mma chain whatever B; the CUDA-core grid tiles with warp teams pass one
# block barrier a step, the mma tiles two), from B = 2 the mma tiles (tests/test_half_plan.py holds
# the model to it; docs/design.md, "Tensor-core tiles").
MMA_MIN_BATCH = 2
# The smallest batch whose mma tiles run their backward on the tensor cores too (``-D PRNN_MMA=2``,
# cuda_src/mma_split_tile.cuh: W_hh^T as B fragments, dgh split into two 16-bit parts); below it
# their CUDA-core 16-bit backward. The latency model (h100) predicts the CUDA-core backward
# faster or equal at B = 2 (LSTM H 512: 2.54 against 2.70 µs; the n-tile of 8 rows costs the
# same at any B) and 3 (LSTM H 512), the mma backward faster from B = 4 at every shape sampled
# (tests/test_half_plan.py holds both sides).
MMA_BACKWARD_MIN_BATCH = 4
# The same for a 16-bit stack's backward (``tiles.MMA_STACK_TILES``). Below it the backward runs
# on the fp32 stack's backward where the fp32 stack fits in stack mode, W_hh^T and W_ih^T widened
# by the copies the backward makes every call (``widens``, ``_widened_stack``), else on the
# CUDA-core 16-bit stack backward (a 2-layer GRU of H 385-512, past the fp32 stack tiles). The
# latency model (h100, T = 100, µs of the stack kernel in a pass, the call's other terms aside)
# predicts the CUDA-core 16-bit backward slower than the fp32 one at B = 1-2 (its pairs unpacked
# into fp32 FMAs; 4-layer LSTM H 384: B 1 379 against 367, B 2 428 / 402; 2-layer GRU H 256 B 2
# 358 / 335; 4-layer RNN H 512 B 1 301 / 284), the mma backward faster from B = 3 (2-layer GRU
# H 256 345 / 349, 4-layer LSTM H 128 367 / 400, RNN H 512 357 / 364) or within 3 % (LSTM H 384
# 444 / 436, B 4 458 / 471) - not a 2-layer RNN H 256's (310 / 283 at B 3, about equal from
# B = 5: ``WIDENED_STACKS``) - and faster than the CUDA-core 16-bit one (2-layer GRU H 512 at
# B 3: 570 against 633 µs a whole pass; docs/design.md, "Stack mode"). tests/test_half_plan.py
# holds both sides.
MMA_STACK_BACKWARD_MIN_BATCH = 3
# The 16-bit stacks whose two passes both run on the fp32 stack's tiles, widened, where that fits
# (``widens``), by tile family: (largest H, the batches). An Elman stack's mma tile holds 16 units
# a CTA (an m16 tile is 16 rows, an Elman cell's 16 units), twice the fp32 stack tile's, so half
# the CTAs do each step; the latency model (h100, T = 100, the stack kernel's time in a pass,
# 16-bit over fp32) predicts it slower up to H 256 at B = 3-4 - 2 layers H 256 B 3 forward 1.076,
# backward 1.096, B 4 1.037 / 1.056; H 192 B 3 1.063 / 1.083, 3 layers 1.070 / 1.090 - and
# faster from H 320 (B 3 0.919 / 0.956), from B = 5 (H 256 1.002 / 1.019, B 6 0.968 / 0.985) and
# below B = 3 (its forward: H 128 B 2 0.911, H 256 0.968; the backward is widened there anyway,
# ``MMA_STACK_BACKWARD_MIN_BATCH``); docs/design.md, "Stack mode". tests/test_half_plan.py holds
# both sides.
WIDENED_STACKS = {"rnn": (256, range(3, 5))}
# The largest batch whose 16-bit layers run their forward on a cluster's mid-size mma tiles (32
# units a CTA, ``tiles.MMA_MID_CLUSTER_TILES``: LSTM and GRU H 257-512 in one cluster of up to 16
# CTAs, the exchange in distributed shared memory instead of L2; from B = 1,
# ``_mid_cluster_candidates``). The latency model (h100, fp16, µs a step) predicts their forward
# faster than the grid's up to B = 8 (LSTM H 512: B 1 1.61 against the widened fp32 tile's 2.10,
# B 2 1.68 / 2.15, B 3 1.77 / 2.19, B 4 1.81 / 2.20, B 8 2.23 / 2.32; GRU H 512 B 1 1.56 / 2.07,
# B 8 2.11 / 2.28), slower from B = 9 (a second n-tile on 16 SMs: LSTM H 512 3.16 / 2.57), and
# their backward slower than the grid's wherever it would run on them (LSTM H 512 B 4 3.08
# against 2.91, B 8 4.12 / 3.54: the product on 16 SMs and its G*H words a batch row stored into
# every CTA cost more than the grid's L2 exchange saves), so the backward is the grid's
# (``_grid_backward``; below MMA_BACKWARD_MIN_BATCH the fp32 grid tile's, widened).
# tests/test_half_plan.py holds both sides.
MMA_MID_CLUSTER_MAX_BATCH = 8
# Where no tensor-core tile holds a 16-bit layer's whole batch in both passes but a CUDA-core grid
# tile does (GRU H <= 512 at B 31-33 and H <= 128 at B 34-64, the Elman RNN H 528-1024 at B 46-51
# on an H100: the mma tile's backward stages more of dgh), the forward runs on the grid's mma tile
# (in batch groups where the whole batch does not fit) and the backward on the mma tile in
# batch groups for these tile families, else on the fp32 tile, widened (``_mma_forward``). The
# latency model (h100, fp16, µs a step; CUDA-core forward / backward -> mma forward, mma backward
# in groups) predicts the mma forward faster at every such shape swept (H by 64, every B: 1-52 %
# faster):
# GRU H 128 B 32 5.15 / 6.22 -> 3.11, 8.18 (24 + 8 rows); H 256 B 32 6.75 / 8.14 -> 3.55, 8.69;
# H 512 B 32 7.05 / 8.98 -> 3.83, 9.23; H 128 B 48 7.30 / 8.73 -> 4.20, 9.38; H 128 B 64 8.93 /
# 10.98 -> 6.69 (48 + 16), 12.11; RNN H 528 B 46 11.25 / 11.25 -> 6.02, 9.01 (40 + 6); H 768 B 48
# 12.20 / 12.20 -> 8.65 (40 + 8), 9.36; H 1024 B 48 13.19 / 13.19 -> 9.13, 9.84. The GRU's
# grouped backward is slower (1.01-1.52 times the CUDA-core one's: its further group gathers 3H
# words a row), the RNN's faster (0.74-0.80). (The a100 profile agrees but for GRU H 144-512 at
# B 22-24, whose grouped backward it predicts 9-14 % faster; the planner's lines are the h100's.)
# The other families' backward runs on the fp32 tile, widened, where the float32 layer fits:
# the CUDA-core 16-bit backward is predicted slower still (GRU H 64-512 B 32-64, 1.005-1.06 times
# the fp32 one's: H 128 B 32 6.22 against 6.05, B 41 8.03 / 7.57; H 512 B 32 8.98 / 8.93).
# tests/test_half_plan.py holds both sides; docs/design.md, "Tensor-core tiles".
GROUPED_MMA_BACKWARD = ("rnn",)  # by tile family (``CellSpec.tiles``)
# The smallest batch whose float32 layers take the TF32 tiles (``tiles.TF32_TILES``,
# ``MMA_CLUSTER_TILES``) where settings.allow_tf32, by placement. The latency model (h100)
# predicts their forward faster from B = 3 on the grid (LSTM H 512 2.27 against 2.42 µs, H 1024
# 2.65 / 2.82, GRU H 512 2.24 / 2.40, RNN H 1024 2.31 / 2.56) and B = 4 in a cluster (LSTM H 256
# 1.33 / 1.52, GRU H 128 1.25 / 1.31, RNN H 512 1.35 / 1.43); at B = 2 a cluster's is slower (an
# n-tile costs its whole chain: LSTM H 256 1.31 / 1.27, GRU H 128 1.21 / 1.10), the grid's within
# 1-5 % (LSTM H 1024 2.55 / 2.57), inside the model's error: not worth TF32's rounding.
TF32_MIN_BATCH = {"grid": 3, "cluster": 4}
# The smallest batch whose TF32 tiles run the backward in TF32 too (-D PRNN_MMA=2 on fp32
# weights: W_hh^T and dgh rounded to TF32, mma_split_tile.cuh), below it the fp32 backward of
# the same units: the model predicts it faster from B = 4 at every shape sampled (LSTM H 1024
# 4.18 against 4.29 µs, H 256 1.76 / 1.90, GRU H 256 1.52 / 1.66, RNN H 512 1.40 / 1.52) and
# slower or within 1-4 % at B = 3 (LSTM H 1024 4.00 / 3.94, H 256 1.76 / 1.79).
TF32_BACKWARD_MIN_BATCH = 4
# The smallest batch whose float32 stacks take the TF32 stack tiles (``tiles.TF32_STACK_TILES``:
# the forward in TF32, the backward fp32) where settings.allow_tf32. The latency model (h100, µs
# a step) predicts their forward faster from B = 3: a 4-layer LSTM H 384 3.26 against 3.85
# (B 4 3.30 / 4.08, B 8 3.48 / 5.05), a 2-layer GRU H 256 3.26 / 3.43 (B 4 3.27 / 3.55), whose
# backward on the TF32 tile's 16 units is 2-3 % slower (3.52 / 3.46, 3.69 / 3.60: the pair of
# passes still faster). At B = 2 the GRU's is within 3 % (2.82 / 2.89), the model's error: not
# worth TF32's rounding (the LSTM's 3.20 / 3.60; B 1 2.97 / 3.01).
TF32_STACK_MIN_BATCH = 3
# Below these batches a 16-bit layer's pass runs on the fp32 tile where that fits, its weights
# widened to fp32 (exactly: ``widened_pass``): per weight the packed pair's unpacking costs an
# instruction more than an fp32 register, and the tensor cores' n-tile of 8 columns costs its
# whole mma chain at any B, so the latency model (h100) predicts the fp32 tile faster than every
# 16-bit tile there: the forward at B = 1 (LSTM H 1024: 2.32 against 2.66 µs) and, for the
# Elman RNN in a cluster, at B = 2 (H 128: 1.35 against 1.46; on the grid, H 1024, the mma tile
# wins: 2.16 against 2.35), the backward below MMA_BACKWARD_MIN_BATCH (GRU H 1024 B 2: 2.92
# against 3.27). From there the 16-bit tiles are no slower (tests/test_half_plan.py holds both
# sides; docs/design.md, "Tensor-core tiles").
WIDENED_CLUSTER_FORWARD_BELOW = {"rnn": 3}  # by tile family (``CellSpec.tiles``)


GATHER_QUADS_MAX = 8  # tagged quads in flight per thread of a gather, at most


def quads_per_thread(batch: int, row_words: int, threads: int) -> int:
    """16-byte quads of a [batch][row_words] tagged exchange that each of ``threads`` threads
    gathers per step (thread x takes quads x, x + threads, ...)."""
    return -(-batch * row_words // (4 * threads))


def gather_quads(weight_registers: int, quads_per_thread: int = GATHER_QUADS_MAX) -> int:
    """Tagged quads a thread of a grid kernel's gather loads at once (``-D PRNN_GATHER_QUADS``,
    ``kGatherQuads`` of persistent_common.cuh; four registers each): enough for the
    ``quads_per_thread`` it gathers per step, rounded up to a power of 2 (a step issues every
    one of the N unrolled slots, wanted or not: at B=1 an LSTM H=1024 thread gathers 1 quad),
    and at most what the register cap leaves beside the weights with zero spills (ptxas, sm_80
    and sm_90; the largest tiles hold 190-200 registers of weights: the LSTM backward's (196,
    200) spill 16-40 bytes at 4, the RNN backward's (190) 184 bytes at 2 on sm_80, ptxas's
    allocation not being monotonic), as L2 round trips are what a step waits on. Between 150 and
    192 weight registers it is 4 whatever the batch: at 2, sm_80's ptxas spills the RNN
    backward (190) 184 bytes and the fp16 GRU 16-unit forward (180: 360 16-bit weights) 152
    bytes, where 4 spills nothing."""
    if weight_registers > 192:
        return min(2, 1 << max(0, quads_per_thread - 1).bit_length())
    if weight_registers > 150:
        return 4
    return min(GATHER_QUADS_MAX, 1 << max(0, quads_per_thread - 1).bit_length())


STACK_GATHER_QUADS = 8  # a stack kernel's gather: tagged quads in flight per thread
# What only the layer forward (persistent_forward.cu) reads: not passed to the stack kernels.
_LAYER_ONLY_DEFINES = ("PRNN_WARP_TEAMS", "PRNN_STAGED_BUFFERS", "PRNN_INPUT_BUFFERS")


def stack_gather_quads(tile: Tile, backward: bool, dtype: str = "float32") -> int:
    """Tagged quads a thread of a stack kernel's gather loads at once (``-D PRNN_GATHER_QUADS``
    of ``stack_*.cu``): 8, but 7 in a forward of more than 140 weights per thread, 4 where those
    are TF32's (an mma tile of fp32 weights). ptxas's allocation is not monotonic in it: the LSTM
    12-unit tile's forward (144 weights) spills 4 bytes at 8 on sm_80 (the reduce-scatter's
    levels halve to ceil(n/2) rows), 6 or 7 nothing; its backward spills 60-112 bytes at 1-4 and
    7, nothing at 8; the RNN 16-row tile's forward spills at 7 (sm_80, sm_90); LSTM's 12-unit
    TF32 forward (144 weight registers) spills 16-24 bytes at 5-8 on sm_80, nothing at 4."""
    pt = tile.backward if backward else tile.forward
    if backward or pt.rows * pt.kpt <= 140:
        return STACK_GATHER_QUADS
    return 4 if tile.mma and not KERNEL_DTYPES[dtype] else STACK_GATHER_QUADS - 1


def pass_plan(cell: CellSpec, tile: Tile, backward: bool, hidden: int, batch: int,
              dtype: str = "float32", stack_layers: int = 0, batch_group: int = 0) -> PassPlan:
    """The launch plan of one pass of ``tile`` for ``hidden`` units and ``batch`` rows, with
    weights held in ``dtype`` (fp32 configurations carry no ``PRNN_WEIGHT_DTYPE``: 0 is the
    default). ``stack_layers`` > 0: the stack kernels (``cuda_src/stack_*.cu``) over that many
    unidirectional layers, one set of ``ceil(hidden/units)`` CTAs per layer (a
    ``tiles.STACK_TILES`` tile), whose exchange rows are half a staged row
    (``stack_common.cuh``). ``batch_group`` > 0: the layer kernel stages that many batch rows at
    once (``batch_group``; 0: the whole batch)."""
    if stack_layers:
        plain = pass_plan(cell, tile, backward, hidden, batch, dtype)
        name = "backward" if backward else "forward"
        defines = {k: v for k, v in plain.defines.items()
                   if k not in _LAYER_ONLY_DEFINES and not k.startswith("PRNN_SMEM_")}
        if tile.mma and backward:  # (16-bit: on the tensor cores from its own batch; TF32: never)
            defines.pop("PRNN_MMA", None)
            if KERNEL_DTYPES[dtype] and batch >= MMA_STACK_BACKWARD_MIN_BATCH:
                defines["PRNN_MMA"] = 2
        defines["PRNN_GATHER_QUADS"] = stack_gather_quads(tile, backward, dtype)
        defines.update(layout_defines(shared_layout(cell, tile, backward, stack=True)))
        return replace(plain, kernel=f"prnn_stack_{name}", source=f"stack_{name}.cu",
                       defines=defines, grid=stack_layers * plain.grid,
                       shared_bytes=shared_bytes(cell, tile, backward, batch, stack=True),
                       max_hidden=stack_max_hidden(cell, tile),
                       exchange_row=plain.exchange_row // 2)
    pt = tile.backward if backward else tile.forward
    local_rows = tile.units if backward else cell.gates * tile.units
    warps = local_rows // pt.rows * pt.ksplit
    block = warps * WARP
    defines = {"PRNN_CELL": cell.kind, "PRNN_UNITS": tile.units, "PRNN_ROWS": pt.rows,
               "PRNN_KSPLIT": pt.ksplit, "PRNN_KPT": pt.kpt, "PRNN_WARPS": warps}
    if KERNEL_DTYPES[dtype]:
        defines["PRNN_WEIGHT_DTYPE"] = KERNEL_DTYPES[dtype]
    if tile.mma and not backward:  # the tensor-core forward (cuda_src/mma_tile.cuh)
        defines["PRNN_MMA"] = 1
    least = MMA_BACKWARD_MIN_BATCH if KERNEL_DTYPES[dtype] else TF32_BACKWARD_MIN_BATCH
    if tile.mma and backward and batch >= least:  # (mma_split_tile.cuh; 16-bit or TF32)
        defines["PRNN_MMA"] = 2
    if not backward:
        defines["PRNN_WARP_TEAMS"] = int(warp_teams(cell, pt))
        defines["PRNN_STAGED_BUFFERS"] = staged_buffers(cell, tile)
    defines["PRNN_INPUT_BUFFERS"] = input_buffers(tile)
    grid = math.ceil(hidden / tile.units)
    if tile.cluster:  # compiled in, so that an ordinary launch runs the grid as one cluster
        defines["PRNN_CLUSTER"] = grid
    else:  # a cluster has no gather (kDirectRead); a batch group's gather takes its rows
        quads = quads_per_thread(min(batch, batch_group or batch), padded_length(pt), block)
        defines["PRNN_GATHER_QUADS"] = gather_quads(weight_registers(pt, dtype), quads)
        if GRID_FREE_POLLS != KERNEL_GRID_FREE_POLLS:
            defines["PRNN_GRID_FREE_POLLS"] = GRID_FREE_POLLS
    if batch_group:
        defines["PRNN_BATCH_GROUP"] = batch_group
    defines.update(layout_defines(shared_layout(cell, tile, backward, batch_group=batch_group)))
    return PassPlan(
        kernel="prnn_persistent_backward" if backward else "prnn_persistent_forward",
        source="persistent_backward.cu" if backward else "persistent_forward.cu",
        defines=defines, grid=grid, block=block,
        shared_bytes=shared_bytes(cell, tile, backward, batch, batch_group=batch_group),
        weights_per_thread=pt.rows * pt.kpt, weight_registers=weight_registers(pt, dtype),
        registers=register_cap(block),
        max_hidden=tile_max_hidden(cell, tile), exchange_row=padded_length(pt))


def _why_not(p: PassPlan, dev: DeviceProfile, hidden: int) -> str | None:
    if hidden > p.max_hidden:
        return f"hidden_size {hidden} > {p.max_hidden} served by the tile"
    if p.grid > dev.sm_count:
        return f"grid {p.grid} CTAs > {dev.sm_count} SMs (one CTA per SM)"
    if "PRNN_CLUSTER" in p.defines and p.grid > dev.max_cluster_ctas:
        return f"a cluster of {p.grid} CTAs > the {dev.max_cluster_ctas} the device runs"
    if p.block > dev.max_threads_per_block:
        return f"block {p.block} threads > {dev.max_threads_per_block}"
    if resident_ctas(p.block, p.registers, dev.registers_per_sm) < 1 \
            or p.registers > dev.max_registers_per_thread:
        return f"{p.block} threads x {p.registers} registers exceed the SM's register file"
    if p.shared_bytes > min(dev.shared_per_block, dev.shared_per_sm):
        return f"{p.shared_bytes} bytes of shared memory > {dev.shared_per_block}"
    return None



def projection_capacity(tile: ProjectionTile) -> tuple[int, int]:
    """Largest ``(H, P)`` both passes of ``tile`` serve by their columns (the grid aside)."""
    cols = lambda pt: pt.ksplit * WARP * pt.kpt  # noqa: E731
    hidden = min(cols(tile.forward_b), cols(tile.backward) // 4)
    return hidden, min(cols(tile.forward), cols(tile.backward_b))


def projection_shared_layout(tile: ProjectionTile, backward: bool) -> tuple[SharedRegion, ...]:
    """The dynamic shared memory of one CTA of a projection pass, region by region in the
    kernel's order (as ``shared_layout``; tile A's padded K is ``padded A``, tile B's
    ``padded B``; per batch row unless said).

    Forward: r_{t-1} staged STAGED [padded A], h_t staged STAGED_B [padded B], partial sums
    PARTIAL [ksplit A][4*units] and PARTIAL_B [ksplit B][proj_rows], gi of two steps
    GI [2][4][units], c_{t-1} and h_{t-1} of the owned units C, H [units] each, r_{t-1} of the
    owned rows R [proj_rows], b_hh BIAS [4][units] in all, LENGTHS [1].
    Backward: dg_{t+1} staged STAGED [padded A], dr_t staged STAGED_B [padded B], partial sums
    PARTIAL [ksplit A][proj_rows] and PARTIAL_B [ksplit B][units], inputs of two steps
    INPUTS [2][6][units] (c, c_prev, saved i f g o) and DY [2][proj_rows], the dc carry
    DC [units], the dr carry DR [proj_rows], LENGTHS [1].
    A grid tile's exchanges are in global memory; a cluster tile stages no vector (STAGED and
    STAGED_B are empty: its warps read the exchanges in place) and its copies of them follow, each
    [2][padded] tagged words per batch row, 16-byte aligned, in the order the kernel begins them:
    forward r (EXCHANGE, padded A) then h (EXCHANGE_B, padded B), backward dr (EXCHANGE_B) then
    dg (EXCHANGE).
    """
    a, b = (tile.backward, tile.backward_b) if backward else (tile.forward, tile.forward_b)
    units, rows, cell = tile.units, tile.proj_rows, PROJECTION_CELL
    region = SharedRegion
    staged = tuple(region(name, 0 if tile.cluster else padded_length(pt))  # (none in a cluster)
                   for name, pt in (("STAGED", a), ("STAGED_B", b)))
    exchanges = (region("EXCHANGE", 2 * padded_length(a), align=16),
                 region("EXCHANGE_B", 2 * padded_length(b), align=16)) if tile.cluster else ()
    if backward:
        inputs = 2 * cell.has_cell_state + cell.saved
        return staged + (region("PARTIAL", a.ksplit * rows), region("PARTIAL_B", b.ksplit * units),
                         region("INPUTS", 2 * inputs * units), region("DY", 2 * rows),
                         region("DC", units), region("DR", rows),
                         region("LENGTHS", 1)) + exchanges[::-1]
    gate_rows = cell.gates * units
    return staged + (region("PARTIAL", a.ksplit * gate_rows), region("PARTIAL_B", b.ksplit * rows),
                     region("GI", 2 * gate_rows), region("C", units), region("H", units),
                     region("R", rows), region("BIAS", gate_rows, per_row=False),
                     region("LENGTHS", 1)) + exchanges


def projection_shared_bytes(tile: ProjectionTile, backward: bool, batch: int) -> int:
    """Dynamic shared memory of one CTA of a projection pass at ``batch`` rows:
    ``projection_shared_layout``'s bytes (``tests/test_projection_persistent.py`` checks them
    with emulated launches)."""
    return layout_bytes(projection_shared_layout(tile, backward), batch)


def projection_pass_plan(tile: ProjectionTile, backward: bool, hidden: int, proj: int,
                         batch: int, dtype: str = "float32") -> PassPlan:
    """The launch plan of one pass of a projection ``tile`` (like ``pass_plan``); its exchanges'
    rows: ``exchange_row`` tile A's padded length, ``exchange_row_b`` tile B's. A cluster tile's
    grid is its cluster (``-D PRNN_CLUSTER``), no larger than ``units * cluster`` units serve."""
    a, b = (tile.backward, tile.backward_b) if backward else (tile.forward, tile.forward_b)
    defines = {"PRNN_CELL": PROJECTION_CELL.kind, "PRNN_UNITS": tile.units,
               "PRNN_PROJ_ROWS": tile.proj_rows, "PRNN_ROWS": a.rows, "PRNN_KSPLIT": a.ksplit,
               "PRNN_KPT": a.kpt, "PRNN_ROWS_B": b.rows, "PRNN_KSPLIT_B": b.ksplit,
               "PRNN_KPT_B": b.kpt, "PRNN_WARPS": tile.warps}
    if KERNEL_DTYPES[dtype]:
        defines["PRNN_WEIGHT_DTYPE"] = KERNEL_DTYPES[dtype]
    if tile.mma and not backward:  # W_hh as A fragments, W_hr as B fragments (split h_t)
        defines["PRNN_MMA"] = 1
    if tile.mma and backward and batch >= MMA_BACKWARD_MIN_BATCH:  # both as B fragments
        defines["PRNN_MMA"] = 2
    grid = max(math.ceil(hidden / tile.units), math.ceil(proj / tile.proj_rows))
    if tile.cluster:  # (no gather: its warps read the exchanges in place)
        defines["PRNN_CLUSTER"] = grid
    else:
        defines["PRNN_GATHER_QUADS"] = gather_quads(weight_registers(a, dtype))
    defines.update(layout_defines(projection_shared_layout(tile, backward)))
    block = tile.warps * WARP
    which = "backward" if backward else "forward"
    top = projection_capacity(tile)[0]
    return PassPlan(
        kernel=f"prnn_projection_{which}", source=f"persistent_projection_{which}.cu",
        defines=defines, grid=grid,
        block=block, shared_bytes=projection_shared_bytes(tile, backward, batch),
        weights_per_thread=a.rows * a.kpt + b.rows * b.kpt,
        weight_registers=weight_registers(a, dtype) + weight_registers(b, dtype),
        registers=register_cap(block),
        max_hidden=min(top, tile.units * tile.cluster) if tile.cluster else top,
        exchange_row=padded_length(a), exchange_row_b=padded_length(b))


def _projection_plan(hidden: int, proj: int, batch: int, dtype: str, dev: DeviceProfile) -> Plan:
    """``make_plan`` of an LSTM with projection: the cheapest projection tile that fits, the
    cluster tiles first where the device has clusters (as the plain layers: both exchanges stay
    in the cluster; a 16-bit layer's weights widened into them at every batch, ``widened_pass``:
    the same kernels as fp32), then the tensor-core tiles for 16-bit weights from
    ``MMA_MIN_BATCH`` rows, then the CUDA-core grid tiles."""
    tried: list[tuple[object, int, str]] = []
    mma = projection_tiles_for(dtype, mma=True) if batch >= MMA_MIN_BATCH else ()
    cluster = projection_tiles_for(dtype, cluster=True) if has_clusters(dev) else ()
    for tile in cluster + mma + projection_tiles_for(dtype):
        held = "float32" if tile.cluster else dtype  # the registers' dtype
        if not projection_tile_ships(tile, held, dev.arch):
            tried.append((tile, 0, f"not built for {dtype} on {dev.arch} (ptxas spills)"))
            continue
        fwd = projection_pass_plan(tile, False, hidden, proj, batch, held)
        bwd = projection_pass_plan(tile, True, hidden, proj, batch, held)
        top_proj = projection_capacity(tile)[1]
        reason = (f"proj_size {proj} > {top_proj} served by the tile" if proj > top_proj
                  else _why_not(fwd, dev, hidden) or _why_not(bwd, dev, hidden))
        if reason is None and tile.cluster:
            return Plan(True, None, tile, widened_pass(fwd, dtype, False) if dtype != held else fwd,
                        bwd)
        if reason is None:
            return _widened_projection(Plan(True, None, tile, fwd, bwd), hidden, proj, batch,
                                       dtype, dev)
        tried.append((tile, top_proj, reason))
    return _no_fit(f"{PROJECTION_CELL.name} H={hidden} proj_size={proj} B={batch}"
                   f"{_dtype_words(dtype)} does not fit {dev.name}", tried)


def _widened_projection(plan: Plan, hidden: int, proj: int, batch: int, dtype: str,
                        dev: DeviceProfile) -> Plan:
    """``plan`` of a ``dtype`` LSTM with projection with its backward on the fp32 projection tile
    below ``MMA_BACKWARD_MIN_BATCH`` rows where that fits (``widens``; W_hh^T and W_hr^T widened
    by the copies the backward makes every call): predicted 5-7 % faster than the 16-bit
    backward at B = 2-3 (H 512-1024, h100). Its forward stays on the 16-bit tiles: at B = 1 they
    are within 2 % of fp32, from B = 2 faster."""
    if dtype == "float32" or not widens(PROJECTION_CELL, batch, True, False):
        return plan
    wide = _projection_plan(hidden, proj, batch, "float32", dev)
    return replace(plan, backward=wide.backward) if wide.fits else plan


def make_plan(cell: CellSpec | str, hidden: int, batch: int, dtype: str = "float32",
              device: DeviceProfile | str | None = None, proj_size: int = 0) -> Plan:
    """Plan both passes of ``cell`` at ``hidden`` units and ``batch`` rows on ``device``.

    Returns the cluster tile where the device has clusters and it fits (its exchange never
    leaves the cluster), else the cheapest shipped grid tile (fewest weights per thread, hence
    least work per step) whose forward and backward both fit, or a ``Plan`` with ``fits=False``
    and the reason. 16-bit layers of ``MMA_MIN_BATCH`` rows or more try the tensor-core tiles
    first, in each placement (``tiles.MMA_CLUSTER_TILES``, ``tiles.MMA_TILES``), their backward
    on the tensor cores from ``MMA_BACKWARD_MIN_BATCH`` rows; a cluster's mid-size mma tiles
    (``tiles.MMA_MID_CLUSTER_TILES``) come after its CUDA-core tiles, up to
    ``MMA_MID_CLUSTER_MAX_BATCH`` rows, for the forward (the backward the grid's,
    ``_grid_backward``). Below those batches a 16-bit layer's passes run on the fp32 tile where
    it fits, its weights widened (``widens``; not a mid-size cluster tile's forward). Where a
    16-bit layer's first fitting tile is a CUDA-core grid tile, its forward runs on the grid's
    mma tile where that fits (``_mma_forward``). Where no tile holds the whole batch in shared
    memory, the grid's tensor-core tiles are tried again in batch groups (``batch_group``), the
    cheapest first.
    ``dtype``: the weights' dtype ("float32", "float16", "bfloat16"; "float64" never fits).
    ``proj_size``: an LSTM's projection (0: none; else 0 < proj_size < hidden), planned on
    ``PROJECTION_CLUSTER_TILES`` and ``PROJECTION_TILES`` (``_projection_plan``).
    """
    cell = resolve_cell(cell)
    dev = resolve_device(device)
    dtype = dtype_name("dtype", dtype)
    if hidden < 1 or batch < 1:
        raise ValueError(f"hidden ({hidden}) and batch ({batch}) must be >= 1")
    proj_size = validation.proj_size(proj_size, hidden, cell.projection)
    if dtype not in KERNEL_DTYPES:
        return Plan(False, f"dtype {dtype} is not supported by the persistent kernels "
                           f"({', '.join(KERNEL_DTYPES)})")
    if proj_size:
        return _projection_plan(hidden, proj_size, batch, dtype, dev)
    tried: list[tuple[object, int, str]] = []
    candidates = (_mma_candidates(cell, batch, dtype, dev, True) + cluster_tiles_for(cell, dtype)
                  + _mid_cluster_candidates(cell, batch, dtype) if has_clusters(dev) else ())
    candidates += _mma_candidates(cell, batch, dtype, dev, False) + tiles_for(cell, dtype)
    found = _first_fitting(cell, candidates, hidden, batch, dtype, dev, tried)
    if found is not None:
        i, plan = found
        if plan.tile in MMA_MID_CLUSTER_TILES[cell.tiles]:
            plan = _grid_backward(plan, candidates[i + 1:], cell, hidden, batch, dtype, dev)
        else:
            plan = _mma_forward(plan, candidates[:i], cell, hidden, batch, dtype, dev)
        return _widened(plan, cell, hidden, batch, dtype, dev)
    # Only where no tile holds the whole batch: the tiles that can, in batch groups (so that a
    # layer that fits without them keeps its plan).
    for tile in (t for t in candidates if groups_batch(t)):
        fwd, bwd = (_grouped_pass(cell, tile, b, hidden, batch, dtype, dev) for b in (False, True))
        if _why_not(fwd, dev, hidden) is None and _why_not(bwd, dev, hidden) is None:
            return Plan(True, None, tile, fwd, bwd)
    return _no_fit(f"{cell.name} H={hidden} B={batch}{_dtype_words(dtype)} does not fit "
                   f"{dev.name}", tried)


def _first_fitting(cell: CellSpec, tiles: tuple[Tile, ...], hidden: int, batch: int,
                   dtype: str, dev: DeviceProfile,
                   tried: list | None = None) -> tuple[int, Plan] | None:
    """``(index, plan)`` of the first of ``tiles`` whose forward and backward both fit ``dev``,
    else ``None``; ``tried`` collects ``(tile, largest H, reason)`` of those before it."""
    for i, tile in enumerate(tiles):
        fwd, bwd = (pass_plan(cell, tile, b, hidden, batch, dtype) for b in (False, True))
        reason = _why_not(fwd, dev, hidden) or _why_not(bwd, dev, hidden)
        if reason is None:
            return i, Plan(True, None, tile, fwd, bwd)
        if tried is not None:
            tried.append((tile, min(fwd.max_hidden, bwd.max_hidden), reason))
    return None


def _mma_candidates(cell: CellSpec, batch: int, dtype: str, dev: DeviceProfile,
                    cluster: bool) -> tuple[Tile, ...]:
    """The tensor-core tiles ``make_plan`` tries first in a placement: a 16-bit layer's from
    ``MMA_MIN_BATCH`` rows (a cluster's mid-size ones: ``_mid_cluster_candidates``), a float32
    layer's TF32 tiles where ``dev.allow_tf32``, from ``TF32_MIN_BATCH`` rows of the placement."""
    if dtype == "float32":
        least = TF32_MIN_BATCH["cluster" if cluster else "grid"]
        return mma_tiles_for(cell, dtype, cluster, tf32=True) \
            if dev.allow_tf32 and batch >= least else ()
    return mma_tiles_for(cell, dtype, cluster, mid=False) if batch >= MMA_MIN_BATCH else ()


def _mid_cluster_candidates(cell: CellSpec, batch: int, dtype: str) -> tuple[Tile, ...]:
    """The mid-size cluster mma tiles ``make_plan`` tries after the small layers' cluster tiles
    (which serve every H they do), for the forward (``_grid_backward``): a 16-bit layer's up to
    ``MMA_MID_CLUSTER_MAX_BATCH`` rows, from B = 1 (no CUDA-core cluster tile serves their H; the
    model predicts their forward faster than the fp32 grid tile's there: LSTM H 512 1.61 against
    2.10 µs, GRU 1.56 / 2.07)."""
    return MMA_MID_CLUSTER_TILES[cell.tiles] \
        if dtype != "float32" and batch <= MMA_MID_CLUSTER_MAX_BATCH else ()


def _grid_backward(plan: Plan, rest: tuple[Tile, ...], cell: CellSpec, hidden: int, batch: int,
                   dtype: str, dev: DeviceProfile) -> Plan:
    """``plan`` of a mid-size cluster tile with the backward of the first tile of ``rest`` (the
    grid's) whose passes fit: the model predicts the cluster's backward slower
    (``MMA_MID_CLUSTER_MAX_BATCH``). Its own where none fits."""
    found = _first_fitting(cell, rest, hidden, batch, dtype, dev)
    return plan if found is None else replace(plan, backward=found[1].backward)


def _mma_forward(plan: Plan, before: tuple[Tile, ...], cell: CellSpec, hidden: int, batch: int,
                 dtype: str, dev: DeviceProfile) -> Plan:
    """``plan`` of a 16-bit layer on a CUDA-core grid tile, where ``before`` (the tiles tried
    before it, none of which holds both passes' whole batch) has a grid mma tile whose forward
    fits: that forward (in batch groups where the whole batch does not), and for the
    ``GROUPED_MMA_BACKWARD`` families the mma tile's backward in batch groups where that fits,
    else the float32 layer's backward, widened, where that fits, else ``plan``'s. Unchanged
    otherwise (an mma ``plan``, float32 and TF32)."""
    if dtype == "float32" or plan.tile.mma:
        return plan
    for tile in (t for t in before if groups_batch(t)):
        forward = _grouped_pass(cell, tile, False, hidden, batch, dtype, dev)
        if _why_not(forward, dev, hidden) is None:
            backward = _grouped_pass(cell, tile, True, hidden, batch, dtype, dev)
            if cell.tiles not in GROUPED_MMA_BACKWARD or _why_not(backward, dev, hidden):
                wide = make_plan(cell, hidden, batch, "float32", dev)
                backward = widened_pass(wide.backward, dtype, True) if wide.fits \
                    else plan.backward
            return replace(plan, tile=tile, forward=forward, backward=backward)
    return plan


def _grouped_pass(cell: CellSpec, tile: Tile, backward: bool, hidden: int, batch: int,
                  dtype: str, dev: DeviceProfile) -> PassPlan:
    """``pass_plan`` of a layer kernel on ``dev``, in batch groups where the whole batch's shared
    memory does not fit it (``batch_group``)."""
    limit = min(dev.shared_per_block, dev.shared_per_sm)
    return pass_plan(cell, tile, backward, hidden, batch, dtype,
                     batch_group=batch_group(cell, tile, backward, batch, limit))


def widens(cell: CellSpec, batch: int, backward: bool, cluster: bool,
           stack_hidden: int = 0) -> bool:
    """Whether a 16-bit layer's pass at ``batch`` rows runs on the fp32 tile (``cluster``:
    whether that is a cluster tile) where it fits: ``MMA_MIN_BATCH``,
    ``WIDENED_CLUSTER_FORWARD_BELOW``, ``MMA_BACKWARD_MIN_BATCH``; ``stack_hidden`` > 0: a
    16-bit stack's of that H in stack mode, on the fp32 stack's (``WIDENED_STACKS``, and its
    backward below ``MMA_STACK_BACKWARD_MIN_BATCH``)."""
    if stack_hidden:
        largest, batches = WIDENED_STACKS.get(cell.tiles, (0, ()))
        return (stack_hidden <= largest and batch in batches) or (
            backward and batch < MMA_STACK_BACKWARD_MIN_BATCH)
    if backward:
        return batch < MMA_BACKWARD_MIN_BATCH
    return batch < (WIDENED_CLUSTER_FORWARD_BELOW.get(cell.tiles, MMA_MIN_BATCH) if cluster
                    else MMA_MIN_BATCH)


def widened_pass(p: PassPlan, dtype: str, backward: bool) -> PassPlan:
    """The fp32 pass ``p`` serving a ``dtype`` (16-bit) layer. The forward takes the layer's
    16-bit words of W_hh, widens them into its fp32 registers as it loads them (exact: the
    products are the 16-bit tiles') and rounds h_t to ``dtype`` where it stores it, as the 16-bit
    tiles do (``-D PRNN_WIDENED_FROM``); the backward, which stores no state, is the fp32 kernel
    itself, given W_hh^T widened by the copy it makes every call anyway (``runtime``)."""
    if backward:
        return p
    return replace(p, defines={**p.defines, "PRNN_WIDENED_FROM": KERNEL_DTYPES[dtype]})


def weight_dtype(p: PassPlan, dtype: str) -> str:
    """The dtype a pass of a ``dtype`` layer holds its weights in (its registers): the layer's,
    or float32 for a ``widened_pass``."""
    return dtype if p.defines.get("PRNN_WEIGHT_DTYPE") else "float32"


def _widened(plan: Plan, cell: CellSpec, hidden: int, batch: int, dtype: str,
             dev: DeviceProfile) -> Plan:
    """``plan`` of a ``dtype`` layer with the passes that ``widens`` on the fp32 tile where
    the float32 plan fits (``widened_pass``); ``plan.tile`` is the forward's."""
    if dtype == "float32" or not widens(cell, batch, True, False):  # (the backward's is widest)
        return plan
    wide = make_plan(cell, hidden, batch, "float32", dev)
    if not wide.fits:
        return plan
    cluster = bool(wide.tile.cluster)
    # (a forward in a cluster stays there where the fp32 tile is the grid's: the mid-size tiles'
    # at B = 1, _mid_cluster_candidates)
    forward = widens(cell, batch, False, cluster) and (cluster or not plan.tile.cluster)
    backward = widens(cell, batch, True, cluster)
    return replace(plan, tile=wide.tile if forward else plan.tile,
                   forward=widened_pass(wide.forward, dtype, False) if forward else plan.forward,
                   backward=widened_pass(wide.backward, dtype, True) if backward else plan.backward)


# What limits a layer, by the words of the reasons ``_why_not`` and the projection planner give
_LIMITS = (("served by the tile", "registers"), ("not built for", "registers"),
           ("register file", "registers"), ("shared memory", "shared memory"),
           ("cluster of", "cluster size"), ("SMs", "SM count"), ("threads >", "block size"))


def _dtype_words(dtype: str) -> str:
    return "" if dtype == "float32" else f" {dtype}"


def _no_fit(head: str, tried: list[tuple[object, int, str]]) -> Plan:
    """The ``Plan`` of a layer no tile runs: ``not_fit_reason`` and every tile's reason."""
    return Plan(False, not_fit_reason(head, [(top, why) for _, top, why in tried]),
                tried=tuple(f"{tile}: {why}" for tile, _, why in tried))


def not_fit_reason(head: str, tried: list[tuple[int, str]]) -> str:
    """``head`` and what limits the layer, one line: each limit (registers, shared memory,
    cluster size, SM count, block size) once, with its first detail, over the tiles whose
    register tile holds the layer — or, where none does, the registers of the one that holds
    the most (``tried``: each tile's capacity and reason)."""
    def limit(why: str) -> str:
        return next((name for words, name in _LIMITS if words in why), "other")

    holding = [why for _, why in tried if limit(why) != "registers" or "register file" in why]
    if not holding:
        holding = [max(tried, key=lambda t: t[0])[1]] if tried else []
    found: dict[str, str] = {}
    for why in holding:
        found.setdefault(limit(why), why)
    return f"{head}: limited by " + "; ".join(f"{name} ({why})" for name, why in found.items())


def not_fit_lines(cell: CellSpec | str, hidden: int, batch: int, dtype: str = "float32",
                  device: DeviceProfile | str | None = None, proj_size: int = 0) -> list[str]:
    """Why a layer does not fit and what to do, in two lines a person can act on: what limits
    it (``Plan.reason``), then the largest hidden size that fits at this batch and dtype and
    what ``algo="auto"`` runs instead. (``[]`` where the layer fits.)"""
    dev = resolve_device(device)
    plan = make_plan(cell, hidden, batch, dtype, dev, proj_size)
    if plan.fits:
        return []
    top = max_hidden_size(resolve_cell(cell).name, dtype, dev, batch, proj_size)
    where = f"at B={batch} {dtype}" + (f" with proj_size={proj_size}" if proj_size else "")
    largest = (f"the largest hidden size that fits {where} is {top}" if top
               else f"no hidden size fits {where}")
    return [plan.reason, f"{largest}; algo=\"auto\" runs the layer on the GEMM path instead "
                         f"(persistent_rnn.torch: torch's kernels, cuDNN on a GPU)"]



def stack_max_hidden(cell: CellSpec, tile: Tile) -> int:
    """Largest H a stack tile serves: each half of its columns holds H (forward) or G*H
    (backward) values."""
    fwd, bwd = tile.forward, tile.backward
    return min(fwd.ksplit // 2 * WARP * fwd.kpt, bwd.ksplit // 2 * WARP * bwd.kpt // cell.gates)


@dataclass(frozen=True)
class StackPlan:
    """How a stack of ``layers`` layers runs: in stack mode (``fits``) one launch per pass for
    all layers, else one launch per layer-direction (``reason`` says why not stack mode).
    ``launches``: persistent kernel launches per forward or backward without restarts."""

    fits: bool
    layers: int
    directions: int
    launches: int
    reason: str | None = None
    tile: Tile | None = None
    forward: PassPlan | None = None
    backward: PassPlan | None = None

    def steps_in_series(self, steps: int) -> int:
        """Step latencies a pass of ``steps`` steps waits through one after another: the
        wavefront of a unidirectional stack in stack mode ``steps + layers - 1``; the two
        directions side by side ``layers * steps``; one launch per layer-direction
        ``layers * directions * steps``: a pass's time is about this times the step of its
        kernel, plus per-launch work (``latency.predict_stack_time``)."""
        if not self.fits:
            return self.launches * steps
        return steps + self.layers - 1 if self.directions == 1 else self.layers * steps


def make_stack_plan(cell: CellSpec | str, hidden: int, batch: int, layers: int,
                    bidirectional: bool = False, dtype: str = "float32",
                    device: DeviceProfile | str | None = None) -> StackPlan:
    """Plan a stack of ``layers`` layers of ``cell`` (``hidden`` units, ``batch`` rows).

    Stack mode where the weights fit the register files together: a unidirectional stack runs
    all its layers in one launch per pass (a wavefront); a bidirectional stack runs the two
    directions of each layer side by side in one launch, layer after layer (layer l+1 needs
    both directions of layer l at every step). The cheapest ``tiles.STACK_TILES`` tile (fewest
    weights per thread; 16-bit weights: ``tiles.MMA_STACK_TILES``, on the tensor cores, the
    backward from ``MMA_STACK_BACKWARD_MIN_BATCH`` rows) whose grid,
    ``groups * ceil(hidden/units)`` CTAs (groups: the layers, or the two directions) at one per
    SM, fits the device with both passes; below ``MMA_STACK_BACKWARD_MIN_BATCH`` rows a 16-bit
    stack's backward is the float32 stack's, the weights widened, where that fits
    (``_widened_stack``).
    Otherwise the layers run one launch per layer-direction and ``reason`` says why.
    """
    cell = resolve_cell(cell)
    dev = resolve_device(device)
    dtype = dtype_name("dtype", dtype)
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    directions = 2 if bidirectional else 1
    apart = partial(StackPlan, False, layers, directions, layers * directions)
    if layers == 1 and not bidirectional:
        return apart("one layer: the layer kernel runs it")
    if dtype not in KERNEL_DTYPES:
        return apart(f"dtype {dtype} is not supported by the persistent kernels")
    if hidden < 1 or batch < 1:
        raise ValueError(f"hidden ({hidden}) and batch ({batch}) must be >= 1")
    groups = 2 if bidirectional else layers
    what = "the two directions of a layer" if bidirectional else f"{layers} layers"
    tried = []
    for tile in _tf32_stack_candidates(cell, batch, dtype, dev) + stack_tiles_for(cell, dtype):
        fwd = pass_plan(cell, tile, False, hidden, batch, dtype, stack_layers=groups)
        bwd = pass_plan(cell, tile, True, hidden, batch, dtype, stack_layers=groups)
        reason = _why_not(fwd, dev, hidden) or _why_not(bwd, dev, hidden)
        if reason is None:
            return _widened_stack(StackPlan(True, layers, directions,
                                            layers if bidirectional else 1, None, tile, fwd, bwd),
                                  cell, hidden, batch, bidirectional, dtype, dev)
        tried.append(f"units {tile.units}: {reason}")
    return apart(f"{what} of {cell.name} H={hidden} B={batch} do not fit {dev.name} together: "
                 + "; ".join(tried))


def _widened_stack(plan: StackPlan, cell: CellSpec, hidden: int, batch: int,
                   bidirectional: bool, dtype: str, dev: DeviceProfile) -> StackPlan:
    """``plan`` of a ``dtype`` stack with the passes that ``widens`` on the float32 stack's
    where that fits (``widened_pass``: the backward takes its matrices as float32, the forward
    the 16-bit words and rounds h_t as stored, ``stack._weights_dtype``); ``plan.tile`` stays
    the 16-bit one. Its own where not: the forward and backward launches share nothing a tile
    shapes (the forward's buffers are (L, T, B, .) arrays, each pass has its own exchange), so
    the backward's tile and grid need not be the forward's."""
    passes = [widens(cell, batch, backward, False, stack_hidden=hidden)
              for backward in (False, True)]
    if dtype == "float32" or not any(passes):
        return plan
    wide = make_stack_plan(cell, hidden, batch, plan.layers, bidirectional, "float32", dev)
    if not wide.fits:
        return plan
    forward, backward = plan.forward, widened_pass(wide.backward, dtype, True)
    if passes[0]:
        forward = widened_pass(wide.forward, dtype, False)
    return replace(plan, forward=forward, backward=backward)


def _tf32_stack_candidates(cell: CellSpec, batch: int, dtype: str,
                           dev: DeviceProfile) -> tuple[Tile, ...]:
    """The TF32 stack tiles ``make_stack_plan`` tries first: a float32 stack's where
    ``dev.allow_tf32``, from ``TF32_STACK_MIN_BATCH`` rows."""
    if dtype != "float32" or not dev.allow_tf32 or batch < TF32_STACK_MIN_BATCH:
        return ()
    return stack_tiles_for(cell, dtype, tf32=True)


def max_hidden_size(cell: str, dtype: str = "float32", device: DeviceProfile | str | None = None,
                    batch: int = 1, proj_size: int = 0) -> int:
    """Largest hidden size whose persistent forward and backward both fit ``device`` (0 if none).

    ``cell``: "RNN", "GRU", "LSTM" (any case; also "rnn_tanh", "rnn_relu"); ``dtype``: the
    weights' dtype, "float32", "float16" or "bfloat16" (16-bit kernels hold twice the weights in
    the same registers; "float64": 0); ``device``: a profile name ("h100", "h200", "a100"), a
    ``DeviceProfile``, or None for the current GPU. ``proj_size``: an LSTM's projection P (0:
    none): the largest H > P whose W_hh (4H x P) and W_hr (P x H) fit.
    """
    spec = resolve_cell(cell)
    dev = resolve_device(device)
    dtype = dtype_name("dtype", dtype)
    proj_size = validation.proj_size(proj_size, proj_size + 1, spec.projection)
    if dtype not in KERNEL_DTYPES:
        return 0
    if proj_size:
        return _max_projected_hidden(proj_size, dtype, dev, batch)
    best = 0
    mma = mma_tiles_for(spec, dtype) if batch >= MMA_MIN_BATCH else ()
    for tile in mma + tiles_for(spec, dtype):  # (the mma tiles: where a CUDA-core one may not)
        top = min(tile_max_hidden(spec, tile), dev.sm_count * tile.units)
        for hidden in range(top, best, -1):
            if make_plan(spec, hidden, batch, dtype, dev).fits:
                best = hidden
                break
    return best


def _max_projected_hidden(proj: int, dtype: str, dev: DeviceProfile, batch: int) -> int:
    """``max_hidden_size`` with a projection, by bisection over H in (P, the largest tile's top]:
    whether a tile fits is monotone in H (its grid grows with H; its columns, registers and shared
    memory do not), and so is whether any does (a scan of every H tried all tiles at each)."""
    fits, beyond = proj, 1 + max(min(projection_capacity(t)[0], dev.sm_count * t.units)
                                 for t in PROJECTION_TILES)
    while beyond - fits > 1:  # every H in (P, fits] fits, `beyond` does not
        mid = (fits + beyond) // 2
        if _projection_plan(mid, proj, batch, dtype, dev).fits:
            fits = mid
        else:
            beyond = mid
    return fits if fits > proj else 0


def resolve_cell(cell: CellSpec | str) -> CellSpec:
    """A ``CellSpec`` from a spec or a name ("RNN" = tanh RNN, "GRU", "LSTM", "rnn_relu", ...)."""
    return cells.resolve(cell)


def resolve_device(device: DeviceProfile | str | None) -> DeviceProfile:
    """A profile from a name, a profile, or None (the current CuPy device)."""
    if isinstance(device, DeviceProfile):
        return device
    if isinstance(device, str):
        if device.lower() not in PROFILES:
            raise ValueError(f"device must be one of {sorted(PROFILES)} or None, got {device!r}")
        return PROFILES[device.lower()]
    if device is not None:
        raise TypeError(f"device must be a profile name, DeviceProfile or None, got {type(device).__name__}")
    return current_device()
