"""The mid-size cluster mma tiles (``tiles.MMA_MID_CLUSTER_TILES``: 32 units a CTA, LSTM and GRU H
up to 512 in one cluster; their forward planned up to ``plan.MMA_MID_CLUSTER_MAX_BATCH`` rows)
through the CPU emulation, forced at a small H (two CTAs, the second with 8 of its 32 units below
H; most of each lane's columns past H) and at any batch:

* the forward (mma_tile.cuh) and the backward on the tensor cores (mma_split_tile.cuh): the
  layer's 16-bit results against the float64 layer within docs/api.md's 16-bit bounds and the
  16-bit GEMM path within one rounding, the backward's fp32 gradients against float64 along the
  run's own states within tests/test_mma_backward.py's ``FP32_BOUND``;
* the same tile's CUDA-core 16-bit backward (below ``plan.MMA_BACKWARD_MIN_BATCH``) against
  float64 the same way.

(An H100/H200 plan runs their forward alone, the backward on the grid, ``plan._grid_backward``:
both backwards serve where no grid tile fits; the last test runs the planned mix.) CI: the LSTM,
fp16, B = 4 (one n-tile), and the planned mix; ``PRNN_TEST_EVERY_KERNEL=1``: LSTM and GRU, both
dtypes, B = 4 and the largest batch their backward fits in shared memory, 8 and 9 (two n-tiles,
a partial last one), and the CUDA-core backward.
"""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner
from persistent_rnn.tiles import MMA_MID_CLUSTER_TILES

from campaign import relerr
from test_mma_backward import (FP32_BOUND, _backward, emulation,  # noqa: F401
                               layer_within_the_16bit_bounds)
from full_set import EVERY_KERNEL

HIDDEN = 40  # two CTAs of 32 units
CASES = [("lstm", "float16", 4)]
if EVERY_KERNEL:
    CASES = [(c, d, b) for c, batches in (("lstm", (4, 8)), ("gru", (4, 9)))
             for d in ("float16", "bfloat16") for b in batches]


@pytest.fixture
def mid_cluster(emulation, monkeypatch):  # noqa: F811
    """The planner's tensor-core tiles: the cluster's mid-size ones alone (at H 40 the small
    layers' tile would serve), both passes (not ``plan._grid_backward``), at every batch
    (``emulation``; past ``plan.MMA_MID_CLUSTER_MAX_BATCH`` too)."""
    monkeypatch.setattr(planner, "mma_tiles_for",
                        lambda cell, dtype, cluster=False, *_, **__:
                        MMA_MID_CLUSTER_TILES[cell.tiles] if cluster else ())
    monkeypatch.setattr(planner, "_grid_backward", lambda plan, *_: plan)


def _ran_mid(stats, mma: int) -> None:
    assert stats.algo == "persistent" and stats.emulated and stats.fallback is None
    assert "'PRNN_UNITS': 32" in stats.details[0] and "'PRNN_CLUSTER': 2" in stats.details[0]
    assert (f"'PRNN_MMA': {mma}" in stats.details[0]) == bool(mma), stats.details


@pytest.mark.parametrize("name,dtype,batch", CASES)
def test_mid_cluster_layer_within_the_16bit_bounds(mid_cluster, name, dtype, batch):
    kern = layer_within_the_16bit_bounds(name, dtype, HIDDEN, batch)
    _ran_mid(kern.last_run, mma=2)
    kern.forward(np.zeros((2, batch, 5), kern.dtype))
    _ran_mid(kern.last_run, mma=1)


@pytest.mark.parametrize("name,dtype,batch", CASES)
def test_mid_cluster_backward_matches_float64(mid_cluster, name, dtype, batch):
    got, want, stats = _backward(name, dtype, HIDDEN, batch)
    _ran_mid(stats, mma=2)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's")
@pytest.mark.parametrize("name,dtype", [("lstm", "float16"), ("gru", "bfloat16")])
def test_mid_cluster_cuda_core_backward_matches_float64(mid_cluster, monkeypatch,
                                                        sixteen_bit_tiles_only, name, dtype):
    monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 10**6)
    prnn.runtime._cached_engine.cache_clear()
    got, want, stats = _backward(name, dtype, HIDDEN, 3)
    _ran_mid(stats, mma=0)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key


@pytest.mark.parametrize("batch", [2, 4])
def test_mid_cluster_forward_with_the_grid_backward(settings, fresh_plans, batch):
    # As planned (LSTM H 264: 9 CTAs of 32 units, the last with 8): the forward on the mid-size
    # cluster tile, the backward on the grid - B 2 the fp32 tile's (the weights widened), B 4 the
    # grid's mma tile.
    prnn.configure(emulation_timeout_ms=20_000)
    kern = layer_within_the_16bit_bounds("lstm", "float16", 264, batch)
    bwd = kern.last_run
    assert bwd.fallback is None and "PRNN_CLUSTER" not in bwd.details[0]
    assert ("'PRNN_MMA': 2" in bwd.details[0]) == (batch >= planner.MMA_BACKWARD_MIN_BATCH)
    assert ("PRNN_WEIGHT_DTYPE" in bwd.details[0]) == (batch >= planner.MMA_BACKWARD_MIN_BATCH)
    kern.forward(np.zeros((2, batch, 5), kern.dtype))
    fwd = kern.last_run.details[0]
    assert "'PRNN_UNITS': 32" in fwd and "'PRNN_CLUSTER': 9" in fwd and "'PRNN_MMA': 1" in fwd
