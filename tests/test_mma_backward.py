"""The tensor-core backward tile (cuda_src/mma_split_tile.cuh, ``-D PRNN_MMA=2``: W_hh^T as B
fragments, each fp32 dgh value split into 16-bit parts: its rounding, the rounding of the rest)
through the CPU emulation, whose mma follows the PTX ISA's fragment layouts.

docs/api.md promises fp32 gradients, so these tests read the backward's fp32 results
(``functional.backward``, before the layer rounds them to its dtype):

* against float64 along the run's own states (tests/campaign.py's ``trajectory_reference``: the
  exact gradient of the rounded computation) within ``FP32_BOUND`` - the CUDA-core 16-bit
  backward's fp32 FMAs measure 1-4e-7 on these cases, the split 2-6e-7 (fp16: two parts, about
  22 significant bits a value; bf16: three, 24; docs/design.md, "Tensor-core tiles");
* against the CUDA-core 16-bit backward of the same tile (``plan.MMA_BACKWARD_MIN_BATCH``
  raised) within the same bound;
* fp16 gradients of 2^-20 (below fp16's normal range, 2^-14): the split's per-row power-of-two
  scale keeps them to the same bound (without it the low part would be subnormal or zero);
* the layer's 16-bit results: against the float64 layer within docs/api.md's 16-bit bounds and
  against the 16-bit GEMM path within one rounding.

tests/test_half_kernels.py's stalls (B = 2, the backward forced on the tensor cores, grid and
cluster) restart it bitwise identically. CI: the LSTM, fp16 on the grid and bf16 in a cluster,
on kernels those stalls build; ``PRNN_TEST_EVERY_KERNEL=1`` runs every cell, both dtypes, both
placements and B = 3 and 17 on the grid (three n-tiles, a partial last one), 16 in a cluster
(the largest batch whose cluster tile fits in shared memory at H 24).
"""
from __future__ import annotations


import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import functional, plan as planner
from persistent_rnn.cells import layer_args

from campaign import relerr, trajectory_reference
from test_mma_tiles import TOLERANCE, UNIT_ROUNDOFF, _layers as forward_layers
from full_set import EVERY_KERNEL

# Relative error of the fp32 gradients held (measured, every cell and placement, B 3 to 17:
# <= 6e-7, as the CUDA-core backward's).
FP32_BOUND = 2e-6
# (cell, dtype, placement, hidden, batch). CI: the layers tests/test_half_kernels.py's stalls
# build (LSTM H 40 B 2, the mma backward forced), so only the CUDA-core reference is a new build.
CASES = [("lstm", "float16", "grid", 40, 2), ("lstm", "bfloat16", "cluster", 40, 2)]
CORE_CASES = CASES[:1]
if EVERY_KERNEL:
    CASES = CORE_CASES = [(c, d, p, 40 if p == "grid" else 24, b)
                          for c in ("lstm", "gru", "rnn_tanh") for d in ("float16", "bfloat16")
                          for p in ("grid", "cluster") for b in (3, 17 if p == "grid" else 16)]


@pytest.fixture
def emulation(settings, fresh_plans, monkeypatch):
    """A generous barrier timeout, the mma tiles (forward and backward) at every batch, and the
    weight gradients' products in fp32: these tests hold the backward tile's gradients to
    ``FP32_BOUND``, where a 16-bit layer's products in TF32 (``functional.gradient_tf32``,
    tests/test_half_gradients.py) would measure TF32's rounding instead."""
    prnn.configure(emulation_timeout_ms=20_000)
    monkeypatch.setattr(planner, "MMA_MIN_BATCH", 1)
    monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 1)
    monkeypatch.setattr(functional, "gradient_tf32", lambda half: None)


def _backward(name: str, dtype: str, hidden: int, batch: int, scale: float = 1.0):
    """The fp32 gradients of an emulated 16-bit layer's backward (unrounded), the float64 ones
    along the run's states, and the backward's RunStats."""
    mode, kw = layer_args(name)
    layer = getattr(prnn, mode)(5, hidden, dtype=dtype, algo="persistent", seed=7, **kw)
    rng = np.random.default_rng(batch)
    cast = lambda a: a.astype(layer.dtype)  # noqa: E731
    shape = (1, batch, hidden)
    pair = lambda s: tuple(cast(rng.standard_normal(shape) * s) for _ in range(2))  # noqa: E731
    one = layer.cell.has_cell_state is False
    x = cast(rng.standard_normal((4, batch, 5)))
    hx = pair(0.5)[0] if one else pair(0.5)
    dy = cast(rng.standard_normal((4, batch, hidden)) * scale)
    dhn = pair(scale)[0] if one else pair(scale)
    layer.forward(x, hx)
    ctx = layer._ctx
    dx, dhx, grads = functional.backward(ctx, dy, dhn)
    f64 = lambda a: tuple(v.astype(np.float64) for v in a) if isinstance(a, tuple) else a.astype(np.float64)  # noqa: E731
    _, want = trajectory_reference(ctx, {"dy": f64(dy), "dhn": f64(dhn)})
    dhx = dhx if isinstance(dhx, tuple) else (dhx,)
    got = {"dx": dx, **{f"dhx[{i}]": a for i, a in enumerate(dhx)}, **grads}
    return {k: np.asarray(v, np.float64) for k, v in got.items()}, want, ctx.backward_stats


def _layer_run(layer, data) -> list[np.ndarray]:
    """A layer's forward and backward on ``data`` (x, hx, dy, dhn): its results (16-bit arrays
    but for float64) as float64."""
    cast = lambda a: tuple(v.astype(layer.dtype) for v in a) if isinstance(a, tuple) else a.astype(layer.dtype)  # noqa: E731
    x, hx, dy, dhn = (cast(a) for a in data)
    flat = lambda a: list(a) if isinstance(a, tuple) else [a]  # noqa: E731
    y, hn = layer.forward(x, hx)
    dx, dhx = layer.backward(dy, dhn)
    return [np.asarray(a, np.float64) for a in [y, *flat(hn), dx, *flat(dhx), *layer.grads.values()]]


def _ran(stats, cluster: bool, mma: bool) -> None:
    assert stats.algo == "persistent" and stats.emulated and stats.fallback is None
    assert ("'PRNN_MMA': 2" in stats.details[0]) == mma, stats.details
    assert ("PRNN_CLUSTER" in stats.details[0]) == cluster, stats.details


def _placed(request, placement: str) -> bool:
    if placement == "grid":
        request.getfixturevalue("grid_path")
    return placement == "cluster"


@pytest.mark.parametrize("name,dtype,placement,hidden,batch", CASES)
def test_mma_backward_matches_float64(emulation, request, name, dtype, placement, hidden, batch):
    cluster = _placed(request, placement)
    got, want, stats = _backward(name, dtype, hidden, batch)
    _ran(stats, cluster, mma=True)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key


@pytest.mark.parametrize("name,dtype,placement,hidden,batch", CORE_CASES)
def test_mma_backward_matches_the_cuda_core_backward(emulation, request, monkeypatch,
                                                     sixteen_bit_tiles_only, name, dtype,
                                                     placement, hidden, batch):
    cluster = _placed(request, placement)
    got, _, stats = _backward(name, dtype, hidden, batch)
    _ran(stats, cluster, mma=True)
    monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 10**6)
    prnn.runtime._cached_engine.cache_clear()
    core, _, stats = _backward(name, dtype, hidden, batch)
    _ran(stats, cluster, mma=False)
    for key, ref in core.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key


def layer_within_the_16bit_bounds(name: str, dtype: str, hidden: int, batch: int):
    """What the layer returns (16-bit; forward and backward, random inputs): against the float64
    layer within docs/api.md's 16-bit bound, against the 16-bit GEMM path (h_t rounded where the
    kernel rounds it) within one rounding of the dtype. Returns the kernel's layer (its
    ``last_run``: the backward's)."""
    kern, gemm, ref = forward_layers(name, dtype, hidden)  # (tests/test_mma_tiles.py's)
    rng = np.random.default_rng(batch)
    shape = (1, batch, hidden)
    state = lambda s: tuple(rng.standard_normal(shape) * s for _ in range(2))  # noqa: E731
    hx, dhn = (state(0.5), state(1.0)) if kern.cell.has_cell_state else (state(0.5)[0], state(1.0)[0])
    data = (rng.standard_normal((4, batch, 5)), hx, rng.standard_normal((4, batch, hidden)), dhn)
    got = _layer_run(kern, data)
    for a, r, g in zip(got, _layer_run(ref, data), _layer_run(gemm, data)):
        assert relerr(a, r) <= TOLERANCE[dtype]
        assert relerr(a, g) <= UNIT_ROUNDOFF[dtype]
    return kern


@pytest.mark.parametrize("name,dtype,placement,hidden,batch", CASES)
def test_mma_backward_layer_within_the_16bit_bounds(emulation, request, name, dtype, placement,
                                                    hidden, batch):
    cluster = _placed(request, placement)
    kern = layer_within_the_16bit_bounds(name, dtype, hidden, batch)
    _ran(kern.last_run, cluster, mma=True)


def test_mma_backward_keeps_small_fp16_gradients(emulation, grid_path):
    # dy, dhn of 2^-20: dgh far below fp16's normal range; the split scales each row into it.
    got, want, stats = _backward("lstm", "float16", 40, 2, scale=2.0**-20)
    _ran(stats, cluster=False, mma=True)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key
