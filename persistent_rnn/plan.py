"""Register-file partition of the persistent kernels: the launch plan, or why a layer does not fit.

Pure Python, no GPU needed. The kernels in ``cuda_src/persistent_*.cu`` are compiled in a finite
set of *tiles* (``SHIPPED``). A tile fixes, per cell, the hidden units owned by one CTA
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
from dataclasses import dataclass

from . import cells
from .cells import CELLS, CellSpec
from .hardware import (MAX_REGISTERS_PER_THREAD, PROFILES, REGISTER_ALLOCATION_UNIT,
                       REGISTERS_PER_SM, SUB_PARTITIONS, WARP, WEIGHT_BYTES, DeviceProfile,
                       current_device)
from .validation import dtype_name

# The dtypes the persistent kernels hold W_hh in, and their -D PRNN_WEIGHT_DTYPE
# (cuda_src/persistent_common.cuh).
KERNEL_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}

@dataclass(frozen=True)
class PassTile:
    """How one pass spreads the CTA's matrix slice over warps (see the module docstring)."""

    rows: int
    ksplit: int
    kpt: int


@dataclass(frozen=True)
class Tile:
    """One shipped compile-time configuration of a cell's kernels: both passes."""

    units: int
    forward: PassTile
    backward: PassTile
    cluster: int = 0  # CTAs of the one thread-block cluster the layer runs in (0: the whole grid)


def _tile(units: int, forward: tuple[int, int, int], backward: tuple[int, int, int],
          cluster: int = 0) -> Tile:
    return Tile(units, PassTile(*forward), PassTile(*backward), cluster)


# Per cell kind, tiles from small to large (weights per thread); the planner takes the cheapest
# one that fits. The large tiles use 8 warps (the most that still get 255 registers each, see
# resident_ctas) holding ~200 weights per thread; each staged value feeds `rows` (10) FMAs, so
# shared memory keeps pace with the FMA units. ptxas' registers for them: 230-255 of 255, zero
# spills. The middle tiles serve H = 512, 768, 1024 and 1280 with K unpadded (issue 15: LSTM
# H=1024 ran the 10-unit tile, K padded to 1280, a fifth of its FMAs on zeros): fewer weights per
# thread, 8 gathered pairs in flight, on up to 128 SMs (an A100's 108 take the larger tiles).
SHIPPED: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (4, 1, 4), (4, 4, 4)), _tile(8, (4, 1, 16), (8, 8, 8)),
             _tile(8, (8, 2, 12), (8, 8, 12)), _tile(8, (8, 2, 16), (8, 8, 16)),
             _tile(10, (10, 2, 20), (10, 8, 20))),
    "gru": (_tile(4, (3, 1, 4), (4, 4, 3)), _tile(8, (3, 1, 16), (8, 8, 6)),
            _tile(8, (6, 2, 12), (8, 8, 9)), _tile(8, (6, 2, 16), (8, 8, 12)),
            _tile(12, (9, 2, 22), (6, 4, 33))),
    "rnn": (_tile(4, (4, 4, 1), (4, 4, 1)), _tile(8, (8, 4, 4), (8, 4, 4)),
            _tile(8, (8, 4, 6), (8, 4, 6)), _tile(8, (8, 4, 8), (8, 4, 8)),
            _tile(10, (10, 4, 10), (10, 4, 10)), _tile(20, (10, 4, 19), (10, 4, 19))),
}


# 16-bit tiles: kpt even (a register holds columns 2c, 2c+1). The first three are the fp32 tiles
# of before issue 15 (kpt rounded up to even), at half their registers; the last hold 360-392
# weights (180-196 registers) per thread of 8 warps: on an H100/H200 LSTM H 1792 (grid 128), GRU
# 1920 (120), RNN 3584 (128). ptxas: 228-254 registers, zero spills on sm_80 and sm_90 (GRU's
# forward at kpt 32 spilled on sm_80). (The unpadded middle tiles are fp32 only so far.)
SHIPPED_16BIT: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (4, 1, 4), (4, 4, 4)), _tile(8, (4, 1, 16), (8, 8, 8)),
             _tile(10, (10, 2, 20), (10, 8, 20)), _tile(14, (14, 2, 28), (14, 8, 28))),
    "gru": (_tile(4, (3, 1, 4), (4, 4, 4)), _tile(8, (3, 1, 16), (8, 8, 6)),
            _tile(12, (9, 2, 22), (6, 4, 34)), _tile(16, (12, 2, 30), (8, 4, 46))),
    "rnn": (_tile(4, (4, 4, 2), (4, 4, 2)), _tile(8, (8, 4, 8), (8, 4, 8)),
            _tile(20, (10, 4, 20), (10, 4, 20)), _tile(28, (14, 4, 28), (14, 4, 28))),
}


def tiles_for(cell: CellSpec, dtype: str = "float32") -> tuple[Tile, ...]:
    """The shipped tiles of ``cell`` for weights of ``dtype`` (both vanilla RNNs share theirs)."""
    shipped = SHIPPED if WEIGHT_BYTES[dtype] == 4 else SHIPPED_16BIT
    return shipped["rnn" if cell.gates == 1 else cell.name]


def weight_registers(tile: PassTile, dtype: str) -> int:
    """Registers one thread's weights occupy: ``rows*kpt`` weights of ``WEIGHT_BYTES[dtype]``."""
    return tile.rows * tile.kpt * WEIGHT_BYTES[dtype] // 4


# Small layers on sm_90: the whole layer in one thread-block cluster of up to CLUSTER_CTAS CTAs
# (the portable maximum; the kernel is compiled for its grid), h exchanged through distributed
# shared memory instead of L2. More units per
# CTA than the grid tiles (8 warps x 96-128 weights), so that H up to 256 (LSTM, GRU) or 512 (RNN)
# fits in 8 SMs. The planner prefers them wherever they fit.
CLUSTER_CTAS = 8
CLUSTER_TILES: dict[str, Tile] = {
    "lstm": _tile(32, (32, 2, 4), (32, 8, 4), CLUSTER_CTAS),
    "gru": _tile(32, (24, 2, 4), (32, 8, 3), CLUSTER_CTAS),
    "rnn": _tile(64, (16, 2, 8), (16, 2, 8), CLUSTER_CTAS),
}
# 16-bit cluster tiles: the same with an even kpt (GRU's backward 3 -> 4).
CLUSTER_TILES_16BIT: dict[str, Tile] = {
    **CLUSTER_TILES, "gru": _tile(32, (24, 2, 4), (32, 8, 4), CLUSTER_CTAS)}


def cluster_tile_for(cell: CellSpec, dtype: str = "float32") -> Tile:
    """The shipped cluster tile of ``cell`` for weights of ``dtype`` (sm_90 and newer)."""
    shipped = CLUSTER_TILES if WEIGHT_BYTES[dtype] == 4 else CLUSTER_TILES_16BIT
    return shipped["rnn" if cell.gates == 1 else cell.name]


def has_clusters(dev: DeviceProfile) -> bool:
    """Whether the device runs thread-block clusters (compute capability 9.0 and newer)."""
    return int(dev.arch.removeprefix("sm_")) >= 90


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


@dataclass(frozen=True)
class Plan:
    """The plan of one layer-direction: both passes, or the reason it does not fit."""

    fits: bool
    reason: str | None = None
    tile: Tile | None = None
    forward: PassPlan | None = None
    backward: PassPlan | None = None


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


def shared_bytes(cell: CellSpec, tile: Tile, backward: bool, batch: int) -> int:
    """Dynamic shared memory of one CTA of a pass: what the kernel carves out, in its order.

    Forward (``persistent_forward.cu``): h_{t-1} staged [B][padded], partial sums
    [B][ksplit][G*units], gi of two steps [2][B][G][units], c_{t-1} and h_{t-1} [B][units] each,
    b_hh [G][units], lengths [B].
    Backward (``persistent_backward.cu``): dgh_{t+1} staged [B][padded], partial sums
    [B][ksplit][units], read-only inputs of two steps [2][B][inputs][units] (dy, h, h_prev,
    [c, c_prev], saved), dh and dc carries [2][B][units], lengths [B]. The next step's inputs are
    prefetched during the step, hence two. ``padded = ksplit * 32 * kpt``. Every word is 4 bytes.
    Then, 16-byte aligned, a cluster tile's copy of the exchange, [2][B][padded] 8-byte tagged
    words (a grid tile's exchange is in global memory).
    ``tests/test_plan.py`` checks this against an emulated launch.
    """
    pt = tile.backward if backward else tile.forward
    units, gates = tile.units, cell.gates
    padded = padded_length(pt)
    if backward:
        inputs = 3 + 2 * cell.has_cell_state + cell.saved
        per_row = padded + pt.ksplit * units + 2 * inputs * units + 2 * units
        constants = 0
    else:
        per_row = padded + pt.ksplit * gates * units + 2 * gates * units + 2 * units
        constants = gates * units
    fixed = 4 * (batch * per_row + constants + batch)
    return -(-fixed // 16) * 16 + 16 * batch * padded if tile.cluster else fixed


def pass_plan(cell: CellSpec, tile: Tile, backward: bool, hidden: int, batch: int,
              dtype: str = "float32") -> PassPlan:
    """The launch plan of one pass of ``tile`` for ``hidden`` units and ``batch`` rows, with
    weights held in ``dtype`` (fp32 configurations carry no ``PRNN_WEIGHT_DTYPE``: 0 is the
    default)."""
    pt = tile.backward if backward else tile.forward
    local_rows = tile.units if backward else cell.gates * tile.units
    warps = local_rows // pt.rows * pt.ksplit
    block = warps * WARP
    defines = {"PRNN_CELL": cell.kind, "PRNN_UNITS": tile.units, "PRNN_ROWS": pt.rows,
               "PRNN_KSPLIT": pt.ksplit, "PRNN_KPT": pt.kpt, "PRNN_WARPS": warps}
    if KERNEL_DTYPES[dtype]:
        defines["PRNN_WEIGHT_DTYPE"] = KERNEL_DTYPES[dtype]
    grid = math.ceil(hidden / tile.units)
    if tile.cluster:  # compiled in, so that an ordinary launch runs the grid as one cluster
        defines["PRNN_CLUSTER"] = grid
    return PassPlan(
        kernel="prnn_persistent_backward" if backward else "prnn_persistent_forward",
        source="persistent_backward.cu" if backward else "persistent_forward.cu",
        defines=defines, grid=grid, block=block,
        shared_bytes=shared_bytes(cell, tile, backward, batch),
        weights_per_thread=pt.rows * pt.kpt, weight_registers=weight_registers(pt, dtype),
        registers=register_cap(block),
        max_hidden=tile_max_hidden(cell, tile), exchange_row=padded_length(pt))


def _why_not(p: PassPlan, dev: DeviceProfile, hidden: int) -> str | None:
    if hidden > p.max_hidden:
        return f"hidden_size {hidden} > {p.max_hidden} served by the tile"
    if p.grid > dev.sm_count:
        return f"grid {p.grid} CTAs > {dev.sm_count} SMs (one CTA per SM)"
    if p.block > dev.max_threads_per_block:
        return f"block {p.block} threads > {dev.max_threads_per_block}"
    if resident_ctas(p.block, p.registers, dev.registers_per_sm) < 1 \
            or p.registers > dev.max_registers_per_thread:
        return f"{p.block} threads x {p.registers} registers exceed the SM's register file"
    if p.shared_bytes > min(dev.shared_per_block, dev.shared_per_sm):
        return f"{p.shared_bytes} bytes of shared memory > {dev.shared_per_block}"
    return None


def make_plan(cell: CellSpec | str, hidden: int, batch: int, dtype: str = "float32",
              device: DeviceProfile | str | None = None) -> Plan:
    """Plan both passes of ``cell`` at ``hidden`` units and ``batch`` rows on ``device``.

    Returns the cluster tile where the device has clusters and it fits (its exchange never
    leaves the cluster), else the cheapest shipped grid tile (fewest weights per thread, hence
    least work per step) whose forward and backward both fit, or a ``Plan`` with ``fits=False``
    and the reason.
    ``dtype``: the weights' dtype ("float32", "float16", "bfloat16"; "float64" never fits).
    """
    cell = resolve_cell(cell)
    dev = resolve_device(device)
    dtype = dtype_name("dtype", dtype)
    if hidden < 1 or batch < 1:
        raise ValueError(f"hidden ({hidden}) and batch ({batch}) must be >= 1")
    if dtype not in KERNEL_DTYPES:
        return Plan(False, f"dtype {dtype} is not supported by the persistent kernels "
                           f"({', '.join(KERNEL_DTYPES)})")
    tried = []
    candidates = ((cluster_tile_for(cell, dtype),) if has_clusters(dev) else ())
    candidates += tiles_for(cell, dtype)
    for tile in candidates:
        fwd = pass_plan(cell, tile, False, hidden, batch, dtype)
        bwd = pass_plan(cell, tile, True, hidden, batch, dtype)
        reason = _why_not(fwd, dev, hidden) or _why_not(bwd, dev, hidden)
        if reason is None:
            return Plan(True, None, tile, fwd, bwd)
        tried.append(f"{tile}: {reason}")
    return Plan(False, f"{cell.name} H={hidden} B={batch} does not fit {dev.name}: " + "; ".join(tried))


def max_hidden_size(cell: str, dtype: str = "float32", device: DeviceProfile | str | None = None,
                    batch: int = 1) -> int:
    """Largest hidden size whose persistent forward and backward both fit ``device`` (0 if none).

    ``cell``: "RNN", "GRU", "LSTM" (any case; also "rnn_tanh", "rnn_relu"); ``dtype``: the
    weights' dtype, "float32", "float16" or "bfloat16" (16-bit kernels hold twice the weights in
    the same registers; "float64": 0); ``device``: a profile name ("h100", "h200", "a100"), a
    ``DeviceProfile``, or None for the current GPU.
    """
    spec = resolve_cell(cell)
    dev = resolve_device(device)
    dtype = dtype_name("dtype", dtype)
    if dtype not in KERNEL_DTYPES:
        return 0
    best = 0
    for tile in tiles_for(spec, dtype):
        top = min(tile_max_hidden(spec, tile), dev.sm_count * tile.units)
        for hidden in range(top, best, -1):
            if make_plan(spec, hidden, batch, dtype, dev).fits:
                best = hidden
                break
    return best


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
