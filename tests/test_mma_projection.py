"""The LSTM-with-projection kernels on the tensor cores (``tiles.MMA_PROJECTION_TILES``,
``-D PRNN_MMA``: the forward's W_hh as A fragments and W_hr as B fragments of the split h_t, the
backward's W_hh^T and W_hr^T as B fragments of the split dg and drs) through the CPU emulation:

* fp16 and bf16, forward and backward (lengths, two n-tiles of which the second is partial):
  the layer against the float64 layer on the same 16-bit parameters within docs/api.md's 16-bit
  bounds;
* against the CUDA-core 16-bit projection kernels: the forward's r_t (16-bit) within one rounding
  of the dtype, the backward's fp32 gradients (before the layer rounds them, from the same
  forward) within ``FP32_BOUND``; a split that drops its low part fails it (sabotage);
* a stall of CTA 1 in both passes: the restarted results are bitwise the undisturbed ones;
* the planner: the mma tiles from ``plan.MMA_MIN_BATCH`` rows, their backward on the tensor cores
  from ``plan.MMA_BACKWARD_MIN_BATCH``, never for fp32.

CI runs fp16's backward against the CUDA-core one and its bounds and stall (one kernel built
beside tests/test_projection_persistent.py's 16-bit layers, which run the mma forward of both
dtypes against float64, and the mma tile's CUDA-core backward: B = 3); ``PRNN_TEST_EVERY_KERNEL=1``
adds bf16 throughout, the forward against the CUDA-core tiles (whose passes, what B = 1 runs,
are then held to the float64 layer: in CI the fp32 projection tests run their code), and the
sabotage.
"""
from __future__ import annotations


import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import functional, plan as planner, runtime
from persistent_rnn.tiles import MMA_PROJECTION_TILES

from sabotage import sabotaged
from test_mma_backward import FP32_BOUND
from test_mma_tiles import TOLERANCE, UNIT_ROUNDOFF
from full_set import EVERY_KERNEL

DTYPES = ["float16", "bfloat16"]
CORE_DTYPES = DTYPES if EVERY_KERNEL else DTYPES[:1]
# H 13 / P 10: two CTAs, both owning units and rows of r; odd widths end both matrices' rows in a
# padding half of a packed pair. B 9: a full n-tile and a partial one.
T, B, I, HIDDEN, PROJ = 4, 9, 5, 13, 10
LENGTHS = np.array([4, 2, 3, 4, 1, 4, 3, 4, 2])


@pytest.fixture(autouse=True)
def _on_the_grid(grid_path):
    """The emulated device without clusters: the tensor-core tiles are the grid's (in a cluster
    a 16-bit projection runs the fp32 tile widened, tests/test_projection_cluster.py)."""


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _data(seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    state = lambda width, s: rng.standard_normal((1, B, width)) * s  # noqa: E731
    return dict(x=rng.standard_normal((T, B, I)), hx=(state(PROJ, 0.5), state(HIDDEN, 0.5)),
                dy=rng.standard_normal((T, B, PROJ)), dhn=(state(PROJ, 1.0), state(HIDDEN, 1.0)))


def _layer(dtype: str, params: dict | None = None, algo: str = "persistent"):
    layer = prnn.LSTM(I, HIDDEN, proj_size=PROJ, dtype=dtype, algo=algo, seed=11)
    if params is not None:
        layer.load_params({k: np.asarray(v, layer.dtype) for k, v in params.items()})
    return layer


def _cast(layer, a):
    return tuple(np.asarray(v, layer.dtype) for v in a) if isinstance(a, tuple) else np.asarray(a, layer.dtype)


def _run(layer, data: dict) -> list[np.ndarray]:
    """Forward and backward of ``layer``: every result, as float64 (the forward's RunStats in
    ``layer.forward_run``)."""
    y, hn = layer.forward(_cast(layer, data["x"]), _cast(layer, data["hx"]), LENGTHS)
    layer.forward_run = layer.last_run
    dx, dhx = layer.backward(_cast(layer, data["dy"]), _cast(layer, data["dhn"]))
    return [np.asarray(a, np.float64) for a in (y, *hn, dx, *dhx, *layer.grads.values())]


def _ran(stats, forward_mma: bool, backward_mma: bool | None = None) -> None:
    """``stats`` is a persistent projection launch, on the tensor cores or not."""
    assert stats.algo == "persistent" and stats.emulated and stats.fallback is None, stats
    detail = stats.details[0]
    assert "prnn_projection_" in detail, stats.details
    mma = forward_mma if "forward" in detail else backward_mma
    assert ("'PRNN_MMA'" in detail) == mma, stats.details


@pytest.fixture
def emulation(settings, fresh_plans):
    prnn.configure(emulation_timeout_ms=20_000)


@pytest.mark.parametrize("dtype", CORE_DTYPES)
def test_mma_projection_within_the_16bit_bounds_of_float64(emulation, dtype):
    data = _data()
    kern = _layer(dtype)
    got = _run(kern, data)
    _ran(kern.forward_run, True, True)
    _ran(kern.last_run, True, True)
    ref = _run(_layer("float64", kern.params, "gemm"), data)
    for a, r in zip(got, ref):
        assert _relerr(a, r) <= TOLERANCE[dtype]


def _forward_and_gradients(dtype: str, data: dict, core: bool, monkeypatch):
    """The forward's y (16-bit) and the backward's fp32 gradients (unrounded) of the mma tile's
    layer, the backward on the tensor cores or (``core``) on the CUDA cores, from an mma forward
    either way (the same tile: the two backwards compare one pass)."""
    layer = _layer(dtype)
    y, _ = layer.forward(_cast(layer, data["x"]), _cast(layer, data["hx"]), LENGTHS)
    _ran(layer.last_run, True)
    ctx = layer._ctx
    if core:
        monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 10**6)
        runtime._cached_engine.cache_clear()
    dx, dhx, grads = functional.backward(ctx, _cast(layer, data["dy"]), _cast(layer, data["dhn"]))
    _ran(ctx.backward_stats, True, not core)
    return y, {"dx": dx, "dh0": dhx[0], "dc0": dhx[1], **grads}


def _core_forward(dtype: str, data: dict, params: dict, monkeypatch):
    """y of the same layer on the CUDA-core 16-bit projection tiles; its forward and backward
    (what B = 1 runs) within docs/api.md's 16-bit bounds of the float64 layer."""
    monkeypatch.setattr(planner, "MMA_MIN_BATCH", 10**6)
    runtime._cached_engine.cache_clear()
    layer = _layer(dtype, params)
    got = _run(layer, data)
    _ran(layer.forward_run, False)
    _ran(layer.last_run, False, False)
    for a, r in zip(got, _run(_layer("float64", params, "gemm"), data)):
        assert _relerr(a, r) <= TOLERANCE[dtype]
    return got[0]


@pytest.mark.parametrize("dtype", CORE_DTYPES)
def test_mma_projection_backward_matches_the_cuda_core_backward(emulation, monkeypatch,
                                                                sixteen_bit_tiles_only, dtype):
    data = _data(5)
    _, mma = _forward_and_gradients(dtype, data, False, monkeypatch)
    _, core = _forward_and_gradients(dtype, data, True, monkeypatch)
    for key, ref in core.items():
        assert _relerr(mma[key], ref) <= FP32_BOUND, key


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set (PRNN_TEST_EVERY_KERNEL=1)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_projection_forward_matches_the_cuda_core_forward(emulation, monkeypatch, dtype):
    data = _data(5)
    layer = _layer(dtype)
    y, _ = layer.forward(_cast(layer, data["x"]), _cast(layer, data["hx"]), LENGTHS)
    _ran(layer.last_run, True)
    assert _relerr(y, _core_forward(dtype, data, layer.params, monkeypatch)) <= UNIT_ROUNDOFF[dtype]


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set (PRNN_TEST_EVERY_KERNEL=1)")
def test_a_split_without_its_low_part_fails_the_comparison(emulation, monkeypatch, tmp_path):
    """fp16's split keeps hi + lo; with lo dropped (dgh and drs rounded to fp16) the backward's
    fp32 gradients leave FP32_BOUND of the CUDA-core kernel's."""
    src = sabotaged(tmp_path, "mma_split_tile.cuh", "      a[0][2 * p + 1] = pack_16bit(y[0], y[1]);",
                    "      a[0][2 * p + 1] = 0u;")
    build = prnn.emulate.get_module
    monkeypatch.setattr(prnn.emulate, "get_module", lambda source, defines: build(
        source, defines, src if source == "persistent_projection_backward.cu" else None))
    data = _data(5)
    _, mma = _forward_and_gradients("float16", data, False, monkeypatch)
    _, core = _forward_and_gradients("float16", data, True, monkeypatch)
    assert max(_relerr(mma[k], ref) for k, ref in core.items()) > 10 * FP32_BOUND


@pytest.mark.parametrize("dtype", CORE_DTYPES)
def test_mma_projection_stall_restarts_bitwise_identical(settings, fresh_plans, dtype):
    """CTA 1 stalls before publishing h_t (forward) and dr_t (backward) at step 2: both passes
    time out, restart and end with the undisturbed results, bit for bit."""
    prnn.configure(emulation_timeout_ms=300)
    data = _data(7)
    plain = _run(_layer(dtype), data)
    with prnn.inject_stall(block=1, step=2, duration_ms=1200):
        layer = _layer(dtype)
        stalled = _run(layer, data)
    for stats in (layer.forward_run, layer.last_run):
        assert stats.restarts >= 1, stats
        _ran(stats, True, True)
    for a, b in zip(plain, stalled):
        assert np.array_equal(a, b)


def test_planner_takes_the_mma_projection_tiles_from_the_mma_batches():
    h, p = 1024, 256
    for batch, forward, backward in ((1, False, False), (planner.MMA_MIN_BATCH, True, False),
                                     (planner.MMA_BACKWARD_MIN_BATCH, True, True), (8, True, True)):
        for dtype in DTYPES:
            got = planner.make_plan("lstm", h, batch, dtype, "h100", proj_size=p)
            assert got.fits and got.tile.mma == forward, (batch, dtype)
            assert ("PRNN_MMA" in got.forward.defines) == forward
            assert got.backward.defines.get("PRNN_MMA") == (2 if backward else None)
        assert not planner.make_plan("lstm", h, batch, "float32", "h100", proj_size=p).tile.mma
    # H 768 / P 384: the P <= 512 tile; H 2048 stays on the CUDA-core tiles (no mma tile serves it)
    assert planner.make_plan("lstm", 768, 8, "float16", "h100", proj_size=384).tile == MMA_PROJECTION_TILES[2]
    assert not planner.make_plan("lstm", 2048, 4, "float16", "h100", proj_size=512).tile.mma


def test_the_model_counts_a_projections_two_exchanges():
    """``prnn plan --proj-size``'s passes: two exchanges a step (r and h forward, dr and dg
    backward), both vectors' words and gathers."""
    from math import ceil

    from persistent_rnn import latency
    from persistent_rnn.cells import CELLS
    got = planner.make_plan("lstm", 1024, 8, "float16", "h100", proj_size=256)
    for p, k_len in ((got.forward, 1024 + 256), (got.backward, 4 * 1024 + 256)):
        shape, plain = (latency.PassShape(CELLS["lstm"], p, 8, 1024, proj) for proj in (256, 0))
        assert (shape.exchanges, plain.exchanges, shape.k_len) == (2, 1, k_len)
        rounds = [ceil(planner.quads_per_thread(8, row, p.block) / shape.gather_quads)
                  for row in (p.exchange_row, p.exchange_row_b)]
        assert (shape.gather_rounds, plain.gather_rounds) == (sum(rounds), rounds[0])
