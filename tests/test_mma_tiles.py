"""The tensor-core forward tiles (cuda_src/mma_tile.cuh, ``tiles.MMA_TILES`` and
``MMA_CLUSTER_TILES``) through the CPU emulation, whose mma follows the PTX ISA's fragment layouts
(tests/test_mma.py holds it to plain products).

* Every cell, fp16 and bf16, grid and cluster placement: the forward (y, h_n, c_n) against the
  float64 layer on the same 16-bit parameters within docs/api.md's 16-bit bounds, against the
  16-bit GEMM path (which rounds h_t where the kernel does) within one rounding of the dtype, and
  bitwise equal run to run on fresh inputs.
* B = 1, 8, 17 and 32 (one to four n-tiles of 8, a partial last one): against the CUDA-core 16-bit
  tile of the same layer within one rounding (both sum fp32 products, in other orders).
* A stall that times the exchange out: the restarted forward is bitwise the undisturbed one.

CI runs two grid cases and B = 17 (tests/test_half_kernels.py's 16-bit layers run the mma
forwards of every cell in a cluster, and stalls, since the planner takes them from B = 2);
``PRNN_TEST_EVERY_KERNEL=1`` runs every cell with both dtypes on both placements, every B and
both stalls.
"""
from __future__ import annotations


import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner
from persistent_rnn.cells import layer_args
from full_set import EVERY_KERNEL

TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}  # docs/api.md, "Accuracy" (16-bit)
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# (cell, dtype, placement). CI: two grid cases - tests/test_half_kernels.py's 16-bit layers
# (B = 2 and 3, from plan.MMA_MIN_BATCH) already run the mma forward of every cell and dtype in a
# cluster against float64 and the GEMM path, and its stalls on the grid and in a cluster.
CASES = [("lstm", "float16", "grid"), ("rnn_tanh", "bfloat16", "grid")]
if EVERY_KERNEL:
    CASES = [(c, d, p) for c in ("lstm", "gru", "rnn_tanh", "rnn_relu")
             for d in ("float16", "bfloat16") for p in ("grid", "cluster")]
BATCHES = (1, 8, 17, 32) if EVERY_KERNEL else (17,)


@pytest.fixture
def emulation(settings, fresh_plans, monkeypatch):
    """A generous barrier timeout, and the mma tiles taken at every batch (B = 1 too)."""
    prnn.configure(emulation_timeout_ms=20_000)
    monkeypatch.setattr(planner, "MMA_MIN_BATCH", 1)


def _layers(name: str, dtype: str, hidden: int):
    mode, kw = layer_args(name)
    kern = getattr(prnn, mode)(5, hidden, dtype=dtype, algo="persistent", seed=7, **kw)
    gemm = getattr(prnn, mode)(5, hidden, dtype=dtype, algo="gemm", **kw)
    ref = getattr(prnn, mode)(5, hidden, dtype="float64", algo="gemm", **kw)
    gemm.load_params(kern.params)
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    return kern, gemm, ref


def _inputs(layer, steps: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, batch, 5)).astype(layer.dtype)
    shape = (1, batch, layer.hidden_size)
    h0 = (rng.standard_normal(shape) * 0.5).astype(layer.dtype)
    hx = (h0, (rng.standard_normal(shape) * 0.5).astype(layer.dtype)) if layer.cell.has_cell_state else h0
    return x, hx


def _forward(layer, x, hx) -> list[np.ndarray]:
    y, hn = layer.forward(x, hx)
    return [np.asarray(a, np.float64) for a in (y, *(hn if isinstance(hn, tuple) else (hn,)))]


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _ran_mma(layer, cluster: bool) -> None:
    run = layer.last_run
    assert run.algo == "persistent" and run.emulated and run.fallback is None
    assert "'PRNN_MMA': 1" in run.details[0], run.details
    assert ("PRNN_CLUSTER" in run.details[0]) == cluster, run.details


def _check(name, dtype, hidden, batch, cluster, seed=3):
    kern, gemm, ref = _layers(name, dtype, hidden)
    x, hx = _inputs(kern, 4, batch, seed)
    got = _forward(kern, x, hx)
    _ran_mma(kern, cluster)
    x64 = x.astype(np.float64)
    hx64 = tuple(h.astype(np.float64) for h in hx) if isinstance(hx, tuple) else hx.astype(np.float64)
    for a, r, g in zip(got, _forward(ref, x64, hx64), _forward(gemm, x, hx)):
        assert _relerr(a, r) <= TOLERANCE[dtype]
        assert _relerr(a, g) <= UNIT_ROUNDOFF[dtype]
    fresh = _inputs(kern, 4, batch, seed + 1)  # run to run, on fresh inputs: bitwise
    once, again = _forward(kern, *fresh), _forward(kern, *fresh)
    assert all(np.array_equal(a, b) for a, b in zip(once, again))


@pytest.mark.parametrize("name,dtype,placement", CASES)
def test_mma_forward_matches_float64_and_the_gemm_path(emulation, request, name, dtype, placement):
    if placement == "grid":
        request.getfixturevalue("grid_path")
        _check(name, dtype, hidden=40, batch=9, cluster=False)
    else:
        _check(name, dtype, hidden=24, batch=3, cluster=True)


@pytest.mark.parametrize("batch", BATCHES)
def test_mma_forward_matches_the_cuda_core_tile(emulation, grid_path, monkeypatch, batch):
    kern, _, _ = _layers("lstm", "float16", 40)
    x, hx = _inputs(kern, 3, batch, batch)
    got = _forward(kern, x, hx)
    _ran_mma(kern, cluster=False)
    monkeypatch.setattr(planner, "mma_tiles_for", lambda *_, **__: ())
    prnn.runtime._cached_engine.cache_clear()
    core = _forward(kern, x, hx)
    assert "PRNN_MMA" not in kern.last_run.details[0]
    for a, b in zip(got, core):
        assert _relerr(a, b) <= UNIT_ROUNDOFF["float16"]


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (CI: tests/test_half_kernels.py's stalls)")
@pytest.mark.parametrize("placement", ["grid", "cluster"])
def test_mma_stall_restarts_bitwise_identically(emulation, request, placement):
    cluster = placement == "cluster"
    if not cluster:
        request.getfixturevalue("grid_path")
    kern, _, _ = _layers("lstm", "float16", 24)
    x, hx = _inputs(kern, 6, 3, 9)
    clean = _forward(kern, x, hx)
    _ran_mma(kern, cluster)
    prnn.configure(emulation_timeout_ms=300)
    with prnn.inject_stall(block=1, step=3, duration_ms=2000):
        stalled = _forward(kern, x, hx)
    assert kern.last_run.restarts >= 1 and kern.last_run.fallback is None
    assert all(np.array_equal(a, b) for a, b in zip(stalled, clean))
