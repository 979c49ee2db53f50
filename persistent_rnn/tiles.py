"""The shipped tiles of the persistent kernels: the finite set of compile-time configurations.

A tile fixes, per family of cells (``CellSpec.tiles``: both Elman RNNs share the family "rnn"),
the hidden units owned by one CTA (``units``: all G gate rows of them; the grid is
``ceil(H/units)``) and, for each pass, how the CTA's slice of the matrix is spread over warps
(``PassTile``: ``rows`` per warp, ``ksplit`` warps sharing a row, ``kpt`` columns per lane).
``plan.py`` chooses among them; ``kernel_report`` compiles every one. Tables only: what a tile
costs and whether it fits is the planner's.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cells import CellSpec
from .hardware import HOPPER_CLUSTER_CTAS, PORTABLE_CLUSTER_CTAS, WEIGHT_BYTES


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
    mma: bool = False  # on the tensor cores (16-bit or TF32; cuda_src/mma_tile.cuh, mma_split_tile.cuh)


def _tile(units: int, forward: tuple[int, int, int], backward: tuple[int, int, int],
          cluster: int = 0, mma: bool = False) -> Tile:
    return Tile(units, PassTile(*forward), PassTile(*backward), cluster, mma)


# Per family of cells, tiles from small to large (weights per thread); the planner takes the
# cheapest one that fits. The large tiles use 8 warps (the most that still get 255 registers each,
# see resident_ctas) holding ~200 weights per thread; each staged value feeds `rows` (10) FMAs, so
# shared memory keeps pace with the FMA units. ptxas' registers for them: 230-255 of 255, zero
# spills. The middle tiles serve H = 512, 768, 1024 and 1280 with K unpadded (a larger tile would
# pad K, e.g. LSTM H=1024 to 1280 on the 10-unit tile, a fifth of its FMAs on zeros): fewer
# weights per thread, 8 gathered pairs in flight, on up to 128 SMs (an A100's 108 take the larger
# tiles). Forward tiles of
# `rows` a multiple of G over all of K (``warp_teams``: LSTM's and GRU's two smallest, LSTM's 8-unit
# ones) let each warp finish its own unit: one block barrier per step.
SHIPPED: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (4, 1, 4), (4, 4, 4)), _tile(8, (4, 1, 16), (8, 8, 8)),
             _tile(8, (4, 1, 24), (8, 8, 12)), _tile(8, (4, 1, 32), (8, 8, 16)),
             _tile(10, (10, 2, 20), (10, 8, 20))),
    "gru": (_tile(4, (3, 1, 4), (4, 4, 3)), _tile(8, (3, 1, 16), (8, 8, 6)),
            _tile(8, (6, 2, 12), (8, 8, 9)), _tile(8, (6, 2, 16), (8, 8, 12)),
            _tile(12, (9, 2, 22), (6, 4, 33))),
    "rnn": (_tile(4, (4, 4, 1), (4, 4, 1)), _tile(8, (8, 4, 4), (8, 4, 4)),
            _tile(8, (8, 4, 6), (8, 4, 6)), _tile(8, (8, 4, 8), (8, 4, 8)),
            _tile(10, (10, 4, 10), (10, 4, 10)), _tile(20, (10, 4, 19), (10, 4, 19))),
}


# 16-bit tiles: kpt even (a register holds columns 2c, 2c+1). The first three are fp32 tile
# shapes (kpt rounded up to even; docs/design.md, "16-bit weights"), at half their registers; the
# last hold 360-392 weights (180-196 registers) per thread of 8 warps: on an H100/H200 LSTM
# H 1792 (grid 128), GRU 1920 (120), RNN 3584 (128). ptxas: 228-254 registers, zero spills on
# sm_80 and sm_90 (GRU's forward at kpt 32 spilled on sm_80). (The unpadded middle tiles are
# fp32 only.)
SHIPPED_16BIT: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (4, 1, 4), (4, 4, 4)), _tile(8, (4, 1, 16), (8, 8, 8)),
             _tile(10, (10, 2, 20), (10, 8, 20)), _tile(14, (14, 2, 28), (14, 8, 28))),
    "gru": (_tile(4, (3, 1, 4), (4, 4, 4)), _tile(8, (3, 1, 16), (8, 8, 6)),
            _tile(12, (9, 2, 22), (6, 4, 34)), _tile(16, (12, 2, 30), (8, 4, 46))),
    "rnn": (_tile(4, (4, 4, 2), (4, 4, 2)), _tile(8, (8, 4, 8), (8, 4, 8)),
            _tile(20, (10, 4, 20), (10, 4, 20)), _tile(28, (14, 4, 28), (14, 4, 28))),
}


# Tensor-core tiles (issue 28; docs/design.md, "Tensor-core tiles"): 16-bit layers whose forward
# holds W_hh as mma.m16n8k16 A fragments (-D PRNN_MMA, cuda_src/mma_tile.cuh). The forward's
# PassTile reads as the CUDA-core one's - ``rows`` per warp (whole 16-row m-tiles), ``ksplit``
# warps sharing a row, a chunk of 32 * ``kpt`` columns (2 * kpt k-steps), rows * kpt weights per
# lane; kpt may be odd) - with G * units = rows * (warps / ksplit): no padding rows. The backward
# has its own PassTile, a 16-bit one: from plan.MMA_BACKWARD_MIN_BATCH rows it holds W_hh^T as B
# fragments (-D PRNN_MMA=2, cuda_src/mma_split_tile.cuh; any rows, in n-tiles of 8), below on the
# CUDA cores. LSTM's 8-unit tile at kpt 3 serves
# H 768 with a backward whose staged dgh (K = 4H padded to 3072) still fits at B = 16.
MMA_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (16, 4, 2), (4, 4, 4), mma=True), _tile(8, (32, 8, 2), (8, 8, 8), mma=True),
             _tile(8, (32, 8, 3), (8, 8, 12), mma=True), _tile(8, (32, 8, 4), (8, 8, 16), mma=True)),
    "gru": (_tile(16, (48, 8, 2), (16, 8, 6), mma=True),
            _tile(16, (48, 8, 4), (16, 8, 12), mma=True)),
    "rnn": (_tile(16, (16, 8, 2), (16, 8, 2), mma=True), _tile(16, (16, 8, 4), (16, 8, 4), mma=True),
            _tile(16, (16, 8, 8), (16, 8, 8), mma=True)),
}

# On sm_90, small layers as one cluster (as CLUSTER_TILES; the backward is CLUSTER_TILES_16BIT's):
# LSTM the fp32 cluster forward's shape (16,1,8), 4 warp teams of 4 units; GRU 3 warps of one
# m-tile each (16 rows, not whole units: no warp teams); RNN 4 warps, 2 m-tiles x 2 chunks (no
# teams: 2 warp teams over all of K, (16,1,16), spill 108 bytes - 128 weight registers beside the
# 128 words a lane waits for per n-tile).
MMA_CLUSTER_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(16, (16, 1, 8), (16, 4, 8), HOPPER_CLUSTER_CTAS, mma=True),),
    "gru": (_tile(16, (16, 1, 8), (16, 4, 6), HOPPER_CLUSTER_CTAS, mma=True),),
    "rnn": (_tile(32, (16, 2, 8), (16, 2, 8), HOPPER_CLUSTER_CTAS, mma=True),),
}
# On sm_90, the forward of mid-size LSTM and GRU layers (H up to 512) as one cluster too, 16-bit
# only, from B = 1 to plan.MMA_MID_CLUSTER_MAX_BATCH (the backward the grid's where one fits:
# plan._grid_backward): 32 units a CTA in 8 warps, the forward the grid tiles' shape with 4 times
# the rows (one row group over 8 column chunks: a lane waits for 8 words of a step), the backward
# 4 n-tiles of units over 8 chunks (its CUDA-core 16-bit pass the same PassTile); 96-128 weight
# registers a lane. ptxas (sm_90): 199-235 registers in the forward, 235-255 in the mma backward
# (204-242 in the CUDA-core one), zero spills. (The Elman RNN's 64-unit tile, H 1024: the model
# predicts its forward faster at B 2-4 only, 1.77 / 2.16 - 2.06 / 2.26 µs, slower at B 8.)
MMA_MID_CLUSTER_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(32, (128, 8, 2), (32, 8, 8), HOPPER_CLUSTER_CTAS, mma=True),),
    "gru": (_tile(32, (96, 8, 2), (32, 8, 6), HOPPER_CLUSTER_CTAS, mma=True),),
    "rnn": (),
}


# TF32 tiles (settings.allow_tf32; docs/design.md, "TF32 tiles"): fp32 layers whose forward holds
# W_hh rounded to TF32 as mma.m16n8k8 A fragments (-D PRNN_MMA without PRNN_WEIGHT_DTYPE,
# mma_tile.cuh: one weight a register, rows * kpt per lane as the fp32 CUDA-core tile) - the
# 16-bit mma tiles' shapes, at twice their weight registers - and whose backward is the fp32
# CUDA-core backward of the same PassTile (the fp32 tiles' of the same units). ptxas: 100-241
# registers, zero spills on sm_80 and sm_90. Not GRU's (48, 8, 4) (H 1024): its 192 weight
# registers beside 48 accumulators spill 144 (sm_90) and 180 bytes (sm_80). (Not the mid-size
# cluster tiles: 192-256 TF32 weight registers.)
TF32_TILES: dict[str, tuple[Tile, ...]] = {**MMA_TILES, "gru": MMA_TILES["gru"][:1]}


def mma_tiles_for(cell: CellSpec, dtype: str, cluster: bool = False,
                  tf32: bool = False, mid: bool = True) -> tuple[Tile, ...]:
    """The shipped tensor-core tiles of ``cell`` for weights of ``dtype``, grid or (``cluster``)
    cluster placement: fp32 weights have the TF32 tiles where ``tf32`` (settings.allow_tf32),
    else none. ``mid``: a 16-bit cluster's mid-size tiles too (``MMA_MID_CLUSTER_TILES``)."""
    if WEIGHT_BYTES[dtype] == 4:
        if not tf32:
            return ()
        return (MMA_CLUSTER_TILES if cluster else TF32_TILES)[cell.tiles]
    if cluster:
        return MMA_CLUSTER_TILES[cell.tiles] + (MMA_MID_CLUSTER_TILES[cell.tiles] if mid else ())
    return MMA_TILES[cell.tiles]


def tiles_for(cell: CellSpec, dtype: str = "float32") -> tuple[Tile, ...]:
    """The shipped tiles of ``cell`` for weights of ``dtype`` (both vanilla RNNs share theirs)."""
    shipped = SHIPPED if WEIGHT_BYTES[dtype] == 4 else SHIPPED_16BIT
    return shipped[cell.tiles]


# Small layers on sm_90: the whole layer in one thread-block cluster (the kernel is compiled for
# its grid), h exchanged through distributed shared memory instead of L2. More units per CTA than
# the grid tiles (96-128 weights per thread). The forward's warps each hold all gate rows of 4
# units (RNN: 8) over all of K (KSPLIT 1): a warp finishes its units by itself, and a step has no
# block barrier (persistent_common.cuh, kWarpTeams). Per cell, the preferred tile first:
# * 4 warps (one per scheduler, so nothing a warp issues waits for another warp's) of half the
#   units, in clusters of up to 16 CTAs (HOPPER_CLUSTER_CTAS: H up to 256, RNN 512, on 16 SMs;
#   at most 8 CTAs, portable, up to H 128 / 256);
# * 8 warps (two per scheduler) in clusters of up to 8 (portable): the same H on 8 SMs, where the
#   device does not run 16-CTA clusters.
CLUSTER_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(16, (16, 1, 8), (16, 4, 8), HOPPER_CLUSTER_CTAS),
             _tile(32, (16, 1, 8), (32, 8, 4), PORTABLE_CLUSTER_CTAS)),
    "gru": (_tile(16, (12, 1, 8), (16, 4, 6), HOPPER_CLUSTER_CTAS),
            _tile(32, (12, 1, 8), (32, 8, 3), PORTABLE_CLUSTER_CTAS)),
    "rnn": (_tile(32, (8, 1, 16), (16, 2, 8), HOPPER_CLUSTER_CTAS),
            _tile(64, (8, 1, 16), (16, 2, 8), PORTABLE_CLUSTER_CTAS)),
}
# 16-bit cluster tiles: the same with an even kpt (GRU's 8-warp backward 3 -> 4).
CLUSTER_TILES_16BIT: dict[str, tuple[Tile, ...]] = {
    **CLUSTER_TILES, "gru": (CLUSTER_TILES["gru"][0],
                             _tile(32, (12, 1, 8), (32, 8, 4), PORTABLE_CLUSTER_CTAS))}


def cluster_tiles_for(cell: CellSpec, dtype: str = "float32") -> tuple[Tile, ...]:
    """The shipped cluster tiles of ``cell`` for weights of ``dtype`` (sm_90 and newer), the
    preferred first."""
    shipped = CLUSTER_TILES if WEIGHT_BYTES[dtype] == 4 else CLUSTER_TILES_16BIT
    return shipped[cell.tiles]


# LSTM with projection (proj_size P; cuda_src/persistent_projection_*.cu): a CTA owns ``units``
# hidden units (their 4 gate rows) and ``proj_rows`` rows of r = W_hr h, and holds two register
# tiles over the same ``warps`` warps (``PassTile``s as above):
#   forward  ``forward``  gate rows of W_hh (K = P)      ``forward_b``  rows of W_hr (K = H)
#   backward ``backward`` rows of W_hh^T (K = 4H)        ``backward_b`` rows of W_hr^T (K = P)
# The grid is max(ceil(H/units), ceil(P/proj_rows)). One set for every dtype (kpt even): 16-bit
# weights take half the registers.
@dataclass(frozen=True)
class ProjectionTile:
    """One shipped configuration of the LSTM-with-projection kernels (both passes)."""

    units: int
    proj_rows: int
    warps: int
    forward: PassTile
    forward_b: PassTile
    backward: PassTile
    backward_b: PassTile
    mma: bool = False  # on the tensor cores (16-bit; MMA_PROJECTION_TILES)
    cluster: int = 0  # CTAs of the largest cluster it runs as (PROJECTION_CLUSTER_TILES; 0: grid)


def _ptile(units: int, proj_rows: int, warps: int, forward, forward_b, backward,
           backward_b, mma: bool = False, cluster: int = 0) -> ProjectionTile:
    return ProjectionTile(units, proj_rows, warps, PassTile(*forward), PassTile(*forward_b),
                          PassTile(*backward), PassTile(*backward_b), mma, cluster)


# Small (H <= 128, P <= 128), H 1024 / P 256 (40-48 weights per thread), H 2048 / P 512
# (160 weights per thread of 8 warps: 4H*P + P*H = 5.2 M fp32 weights over 128 CTAs).
PROJECTION_TILES: tuple[ProjectionTile, ...] = (
    _ptile(4, 2, 4, (4, 1, 4), (2, 4, 4), (2, 4, 4), (4, 4, 2)),
    _ptile(8, 2, 8, (8, 2, 4), (2, 8, 4), (2, 8, 16), (8, 8, 2)),
    _ptile(16, 4, 8, (8, 1, 16), (4, 8, 8), (4, 8, 32), (8, 4, 4)),
)


# Tensor-core projection tiles (issue 28; -D PRNN_MMA; docs/design.md, "LSTM with projection"):
# 16-bit, from plan.MMA_MIN_BATCH rows. The forward's tile A holds W_hh as A fragments
# (mma_tile.cuh: ``rows`` whole 16-row m-tiles, 4 * units = rows * warps / ksplit), its tile B
# W_hr as B fragments (mma_split_tile.cuh: rows in n-tiles of 8, the fp32 h_t split); the backward
# holds both as B fragments (split dg and drs) from plan.MMA_BACKWARD_MIN_BATCH rows, below on the
# CUDA cores with the same PassTiles (kpt even). A CTA owns 8 rows of r (proj_rows 8: a whole
# n-tile; with 2 or 4 an n-tile would be 3/4 or 1/2 zero columns and as many wasted registers,
# for the same HMMAs). The grid is max(ceil(H/8), ceil(P/8)): the CTAs past ceil(P/8) hold zeros
# in tile B, at no cost to the step (every CTA multiplies in parallel). Small: H, P <= 128 on 4
# warps; H <= 1024 with P <= 256 (tile A one k-step pair per warp) or P <= 512.
MMA_PROJECTION_TILES: tuple[ProjectionTile, ...] = (
    _ptile(8, 8, 4, (32, 4, 1), (8, 4, 1), (8, 4, 4), (8, 4, 2), mma=True),
    _ptile(8, 8, 8, (32, 8, 1), (8, 8, 4), (8, 8, 16), (4, 4, 2), mma=True),
    _ptile(8, 8, 8, (32, 8, 2), (8, 8, 4), (8, 8, 16), (8, 8, 2), mma=True),
)


# On sm_90, small projections as one thread-block cluster (cuda_src/persistent_projection.cuh;
# docs/design.md, "LSTM with projection"): both exchanges, h_t and r_t (backward dr_t and dg_t),
# through distributed shared memory, each warp reading the words it multiplies in place. The
# layer's grid, max(ceil(H/units), ceil(P/proj_rows)), is the cluster, compiled in: up to 16 CTAs
# (HOPPER_CLUSTER_CTAS), 8 where the device runs no larger (the runtime re-plans). fp32 CUDA-core
# tiles; a 16-bit layer's weights are widened into them (plan._projection_plan):
# * 4 warps (one per scheduler), 16 units and 4 rows of r a CTA: H <= 256, P <= 64 (40 weights
#   per thread in each pass);
# * 8 warps, 32 units and 8 rows of r: H <= 512, P <= 128 (80 weights per thread).
PROJECTION_CLUSTER_TILES: tuple[ProjectionTile, ...] = (
    _ptile(16, 4, 4, (16, 1, 2), (4, 4, 2), (4, 4, 8), (4, 1, 2), cluster=HOPPER_CLUSTER_CTAS),
    _ptile(32, 8, 8, (16, 1, 4), (8, 8, 2), (8, 8, 8), (8, 2, 2), cluster=HOPPER_CLUSTER_CTAS),
)


def projection_tiles_for(dtype: str, mma: bool = False,
                         cluster: bool = False) -> tuple[ProjectionTile, ...]:
    """The shipped projection tiles for weights of ``dtype``; ``mma``: the tensor-core ones
    (none for fp32, none in a cluster); ``cluster``: the cluster placement's (sm_90 and newer)."""
    if mma:
        return () if WEIGHT_BYTES[dtype] == 4 or cluster else MMA_PROJECTION_TILES
    return PROJECTION_CLUSTER_TILES if cluster else PROJECTION_TILES


# (units, dtype, arch) of projection tiles that ptxas cannot build without spilling, so they are
# not shipped there: the fp32 16-unit backward spills 208 bytes on sm_80 (before the loop) with
# the batched-poll gather, whatever its B tile and gather width (docs/design.md, "LSTM with
# projection").
PROJECTION_SPILLS = frozenset({(16, "float32", "sm_80")})


def projection_tile_ships(tile: ProjectionTile, dtype: str, arch: str) -> bool:
    """Whether ``tile`` is a shipped configuration for ``dtype`` weights on ``arch``."""
    return (tile.units, dtype, arch) not in PROJECTION_SPILLS


# Stack tiles (cuda_src/stack_forward.cu, stack_backward.cu): every layer of a unidirectional
# stack at once, one set of CTAs per layer, all compiled with one tile. The columns of the
# register tile are two halves of ksplit/2 chunks each (chunk-aligned, so that the partial sums
# of each half stay apart): forward [W_ih | W_hh] times [y_{l-1}[t]; h_l[t-1]] (layer 0 holds
# zeros in the W_ih half: its input projection is the GEMM before the recurrence, as for one
# layer), backward rows J of [W_hh,l^T | W_ih,l+1^T] times [dgh_l[t+1]; dgi_{l+1}[t]] (the top
# layer: zeros). Each half holds H (forward) or G*H (backward) columns, so K = 2H or 2GH;
# 8 warps (4 for the small RNN tiles) of 16-144 weights per thread. fp32 weights (16-bit:
# MMA_STACK_TILES below).
STACK_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (4, 2, 4), (4, 8, 4)), _tile(8, (8, 2, 8), (8, 8, 8)),
             _tile(12, (12, 2, 12), (12, 8, 12))),
    "gru": (_tile(4, (3, 2, 4), (4, 8, 3)), _tile(8, (6, 2, 8), (8, 8, 6)),
            _tile(12, (9, 2, 12), (12, 8, 9))),
    "rnn": (_tile(4, (4, 4, 2), (4, 4, 2)), _tile(8, (8, 4, 4), (8, 4, 4)),
            _tile(32, (16, 4, 8), (16, 4, 8))),
}


# 16-bit stacks on the tensor cores (docs/design.md, "Stack mode", 16-bit): the stack kernels
# with mma tiles. Forward [W_ih | W_hh] as A fragments (mma_tile.cuh: ``rows`` whole 16-row
# m-tiles, G * units = rows * warps / ksplit, so LSTM from 4 units, GRU and RNN 16), backward
# [W_hh^T | W_ih^T] as B fragments from plan.MMA_STACK_BACKWARD_MIN_BATCH rows
# (mma_split_tile.cuh; n-tiles of 8 units: LSTM's 4 and 12 units pad to 8 and 16), below on the
# fp32 stack's backward where that fits (plan._widened_stack), else on the CUDA cores (kpt
# even). ksplit 8: 4 chunks a half. H <= 128 / 256 / 384 (LSTM), 256 / 512 (GRU,
# RNN): the fp32 stack tiles' reach or more at 8-72 weight registers (forward) and 8-96
# (backward) per lane. A 4-layer LSTM stack of H 512 needs 16 units per CTA (132 SMs): that
# tile's fp16 backward (16, 8, 16) spills (224-468 bytes), so it is not built (docs/design.md).
MMA_STACK_TILES: dict[str, tuple[Tile, ...]] = {
    "lstm": (_tile(4, (16, 8, 1), (4, 8, 4), mma=True), _tile(8, (32, 8, 2), (8, 8, 8), mma=True),
             _tile(12, (48, 8, 3), (12, 8, 12), mma=True)),
    "gru": (_tile(16, (48, 8, 2), (16, 8, 6), mma=True),
            _tile(16, (48, 8, 4), (16, 8, 12), mma=True)),
    "rnn": (_tile(16, (16, 8, 2), (16, 8, 2), mma=True),
            _tile(16, (16, 8, 4), (16, 8, 4), mma=True)),
}


# TF32 stack tiles (settings.allow_tf32; docs/design.md, "TF32 tiles"): fp32 stacks whose
# forward holds [W_ih | W_hh] rounded to TF32 as m16n8k8 A fragments - the 16-bit stacks' mma
# tiles, at twice their weight registers - and whose backward is the fp32 CUDA-core stack
# backward of the same PassTile. ptxas (sm_90): 161-254 registers, zero spills. Not GRU's
# (48, 8, 4) (H 512): its forward spills 452 bytes, its backward 328. The backward stays fp32:
# in TF32 (mma_split_tile.cuh) LSTM's 12-unit one spills 336 bytes (sm_90).
TF32_STACK_TILES: dict[str, tuple[Tile, ...]] = {**MMA_STACK_TILES,
                                                 "gru": MMA_STACK_TILES["gru"][:1]}


def stack_tiles_for(cell: CellSpec, dtype: str = "float32",
                    tf32: bool = False) -> tuple[Tile, ...]:
    """The shipped stack tiles of ``cell`` for weights of ``dtype`` (both vanilla RNNs share
    theirs): fp32 ``STACK_TILES`` (``tf32``: ``TF32_STACK_TILES``), 16-bit the tensor-core
    ``MMA_STACK_TILES``."""
    if WEIGHT_BYTES[dtype] != 4:
        return MMA_STACK_TILES[cell.tiles]
    return (TF32_STACK_TILES if tf32 else STACK_TILES)[cell.tiles]
