"""The 16-bit persistent kernels (W_hh as packed fp16/bf16 pairs in registers), through the CPU
emulation of the same CUDA source, and the conversions they are built on.

* ``hw.cuh``'s conversions (tests/cuda/half_convert.cu) against ml_dtypes, bit for bit (emulated;
  on a GPU in the gpu suite).
* Every cell in float16 and the LSTM in bfloat16 (every cell in both with
  PRNN_TEST_EVERY_KERNEL=1), forward and backward with lengths: against the float64 layer on the
  same (16-bit) parameters within 5e-3 (fp16) / 3e-2 (bf16) relative error (the relu RNN: its
  forward; docs/api.md, "Accuracy"), and against the 16-bit GEMM path, which rounds h_t at the
  same point, within one rounding of the dtype (measured: mostly bitwise equal; at these seeds
  for relu too, whose gradients may differ where the two fp32 sums round a state differently).
  tests/campaign.py checks every path against float64 along its own rounded states.
* The largest 16-bit tiles (forced at a small H), odd H (a padded last word) and a stall that
  makes the barrier time out: the restarted run is bitwise identical to an undisturbed one.
* From B = 2 (``plan.MMA_MIN_BATCH``) the forwards run on the tensor-core tiles
  (cuda_src/mma_tile.cuh; tests/test_mma_tiles.py), from B = 4 (``MMA_BACKWARD_MIN_BATCH``) the
  backwards too (mma_split_tile.cuh; tests/test_mma_backward.py): the layer tests above (B = 3, a
  cluster) run the mma forward and the CUDA-core backward, the stalls (B = 2, grid and cluster)
  both on the tensor cores (the backward forced at B = 2).
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, plan as planner
from persistent_rnn.cells import CELLS as REGISTRY, FAMILY_CELLS, layer_args
from full_set import EVERY_KERNEL

TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
CELLS = [layer_args(name) for name in REGISTRY]
HALF = ("float16", "bfloat16")
# CI builds every cell's kernels in float16 and the LSTM's in bfloat16 (the emulated builds are
# most of these tests' time; bfloat16 differs from float16 only in the conversions, tested bit
# for bit below, and runs on the GPU in the gpu suite); PRNN_TEST_EVERY_KERNEL=1 runs them all.


def _in_ci(cell_name: str, dtype: str) -> bool:
    return EVERY_KERNEL or dtype == "float16" or cell_name == "lstm"


LAYER_CASES = [(mode, kw, dtype) for name, (mode, kw) in zip(REGISTRY, CELLS) for dtype in HALF
               if _in_ci(name, dtype)]
TILE_CASES = [(cell, dtype) for cell in FAMILY_CELLS for dtype in HALF if _in_ci(cell, dtype)]
# The conversions alone, a test-only kernel (not shipped) on cuda_src's headers.
CONVERSIONS = str(Path(__file__).resolve().parent / "cuda" / "half_convert.cu")


@pytest.fixture
def emulation(settings):
    """A generous barrier timeout: the emulated CTAs share two cores with other work."""
    prnn.configure(emulation_timeout_ms=20_000)


def _special_floats() -> np.ndarray:
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.996, 65520, 2.0**-14, 2.0**-24,
             2.0**-25, 1.5 * 2.0**-24, 2.0**-25 * 1.0000001, 1 + 2.0**-11, 1 + 3 * 2.0**-11,
             1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.3895314e38, -3.3895314e38, 3.4028235e38]
    return np.float32(edges)


def _random_floats(n: int, seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    near_one = np.random.default_rng(seed + 1).standard_normal(n).astype(np.float32)
    return np.concatenate([bits.view(np.float32), near_one, _special_floats()])


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bitwise equal, NaN matching any NaN."""
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan)
                and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)))


def _convert(launch_module, xp, values: np.ndarray, words: np.ndarray):
    n = values.size
    f16, bf16 = xp.empty(n, np.float32), xp.empty(n, np.float32)
    launch_module.launch("round_to_16bit", 4, 64, 0, (xp.asarray(values), f16, bf16, np.int32(n)))
    m = words.size
    p16, pbf = xp.empty(2 * m, np.float32), xp.empty(2 * m, np.float32)
    launch_module.launch("unpack_16bit_pairs", 4, 64, 0, (xp.asarray(words), p16, pbf, np.int32(m)))
    return [a if xp is np else a.get() for a in (f16, bf16, p16, pbf)]


def _check_conversions(got, values, words):
    f16, bf16, p16, pbf = got
    with np.errstate(over="ignore", invalid="ignore"):
        assert _same(f16, values.astype(np.float16).astype(np.float32))
        assert _same(bf16, values.astype(ml_dtypes.bfloat16).astype(np.float32))
    halves = words.view(np.uint16)  # little-endian: element 0 is the low half
    assert _same(p16, halves.view(np.float16).astype(np.float32))
    assert _same(pbf, halves.view(ml_dtypes.bfloat16).astype(np.float32))


def test_emulated_conversions_are_ml_dtypes():
    values = _random_floats(100_000, 0)
    words = np.random.default_rng(2).integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32)
    module = emulate.get_module(CONVERSIONS, {})
    _check_conversions(_convert(module, np, values, words), values, words)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_conversion_source_compiles_for_the_gpu(arch):
    from persistent_rnn import kernels
    log = kernels.compile_source(CONVERSIONS, {}, arch).log
    assert log.count("Used") == 2 and "spill" not in log.replace(" 0 bytes spill", "")


@pytest.mark.gpu
def test_gpu_conversions_are_ml_dtypes(cupy):
    from persistent_rnn import kernels
    values = _random_floats(1_000_000, 3)
    words = np.random.default_rng(4).integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32)
    module = kernels.get_module(CONVERSIONS, {})
    _check_conversions(_convert(module, cupy, values, words), values, words)


def _layers(mode, kw, dtype, hidden=13, **layer_kw):
    """The emulated 16-bit layer, the 16-bit GEMM layer and the float64 layer, same parameters."""
    kern = getattr(prnn, mode)(5, hidden, dtype=dtype, algo="persistent", seed=11, **kw, **layer_kw)
    gemm = getattr(prnn, mode)(5, hidden, dtype=dtype, algo="gemm", **kw, **layer_kw)
    ref = getattr(prnn, mode)(5, hidden, dtype="float64", algo="gemm", **kw, **layer_kw)
    gemm.load_params(kern.params)
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    return kern, gemm, ref


def _run(layer, x, hx, lengths, dy, dhn):
    cast = (lambda a: None if a is None else
            tuple(v.astype(layer.dtype) for v in a) if isinstance(a, tuple) else a.astype(layer.dtype))
    y, hn = layer.forward(cast(x), cast(hx), lengths)
    fwd_stats = layer.last_run
    dx, dhx = layer.backward(cast(dy), cast(dhn))
    out = [y, *(hn if isinstance(hn, tuple) else (hn,)), dx, *(dhx if isinstance(dhx, tuple) else (dhx,)),
           *layer.grads.values()]
    return [np.asarray(a, np.float64) for a in out], fwd_stats, layer.last_run


def _data(mode, layer, steps, batch, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, batch, 5)).astype(np.float32)
    shape = (layer.num_layers * layer.directions, batch, layer.hidden_size)
    pair = tuple(rng.standard_normal(shape).astype(np.float32) * 0.5 for _ in range(2))
    hx = pair if layer.cell.has_cell_state else pair[0]
    dy = rng.standard_normal((steps, batch, layer.directions * layer.hidden_size)).astype(np.float32)
    dpair = tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    return x, hx, dy, (dpair if layer.cell.has_cell_state else dpair[0])


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _within_one_rounding(a, b, dtype) -> bool:
    """Equal up to the unit roundoff of ``dtype`` relative to the array: fp32 sums in another
    order may flip a rounding of h_t, and the flip propagates."""
    return _relerr(a, b) <= UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("mode,kw,dtype", LAYER_CASES)
def test_emulated_16bit_kernels_match_float64_and_the_gemm_path(emulation, mode, kw, dtype):
    kern, gemm, ref = _layers(mode, kw, dtype)
    x, hx, dy, dhn = _data(mode, kern, steps=7, batch=3)
    lengths = [7, 2, 5]
    got, fwd, bwd = _run(kern, x, hx, lengths, dy, dhn)
    assert fwd.algo == bwd.algo == "persistent" and fwd.emulated and fwd.fallback is None
    assert f"'PRNN_WEIGHT_DTYPE': {planner.KERNEL_DTYPES[dtype]}" in fwd.details[0]
    assert "'PRNN_MMA': 1" in fwd.details[0]  # B >= plan.MMA_MIN_BATCH: the tensor-core forward
    # B < plan.MMA_BACKWARD_MIN_BATCH: the fp32 backward, W_hh^T widened (plan.widens)
    assert "PRNN_MMA" not in bwd.details[0] and "PRNN_WEIGHT_DTYPE" not in bwd.details[0]
    want, _, _ = _run(ref, x, hx, lengths, dy, dhn)
    same_rounding, _, _ = _run(gemm, x, hx, lengths, dy, dhn)
    forward = 3 if kern.cell.has_cell_state else 2  # y, hn (, cn): relu's bound is its forward
    for i, (a, r, g) in enumerate(zip(got, want, same_rounding)):
        relu_gradient = kw.get("nonlinearity") == "relu" and i >= forward
        assert relu_gradient or _relerr(a, r) <= TOLERANCE[dtype]
        # The GEMM path rounds h_t where the kernel does: equal but for fp32 summation order.
        assert _within_one_rounding(a, g, dtype)


@pytest.mark.parametrize("cell,dtype", TILE_CASES)
def test_emulated_largest_16bit_tiles(emulation, monkeypatch, grid_path, fresh_plans,
                                     sixteen_bit_tiles_only, cell, dtype):
    # The largest tiles (14-16 rows per warp, ~390 weights per thread) normally serve H > 1280;
    # force them at a small, odd H (a padded last word per row) so the emulation runs their code.
    tiles_for = planner.tiles_for
    monkeypatch.setattr(planner, "tiles_for", lambda c, d="float32": tiles_for(c, d)[-1:])
    monkeypatch.setattr(planner, "mma_tiles_for", lambda *_, **__: ())  # (tests/test_mma_tiles.py)
    mode, kw = layer_args(cell)
    kern, gemm, _ = _layers(mode, kw, dtype, hidden=31)
    x, hx, dy, dhn = _data(mode, kern, steps=3, batch=2)
    got, fwd, _ = _run(kern, x, hx, None, dy, dhn)
    units = tiles_for(prnn.plan.resolve_cell(cell), dtype)[-1].units
    assert f"'PRNN_UNITS': {units}" in fwd.details[0] and fwd.algo == "persistent"
    want, _, _ = _run(gemm, x, hx, None, dy, dhn)
    for a, g in zip(got, want):
        assert _within_one_rounding(a, g, dtype)


def _sixteen_bit_states(a: np.ndarray, dtype: str) -> bool:
    """Whether every value of float32 ``a`` is a ``dtype`` value (what a 16-bit layer's y holds)."""
    return np.array_equal(a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
                          .astype(np.float32), a)


@pytest.mark.parametrize("mode,dtype", [("GRU", "float16"), ("LSTM", "bfloat16")])
def test_16bit_layers_of_one_row_run_on_the_fp32_tiles(emulation, mode, dtype):
    # plan.widens: at B = 1 both passes run on the fp32 tile, the weights widened to fp32 and the
    # forward's h_t rounded to the 16-bit type (-D PRNN_WIDENED_FROM) as the 16-bit tiles do.
    kern, gemm, ref = _layers(mode, {}, dtype)
    x, hx, dy, dhn = _data(mode, kern, steps=6, batch=1)
    kern.forward(x.astype(dtype))
    assert _sixteen_bit_states(kern._ctx.directions[0][0].fwd.y, dtype)  # (the kernel's y)
    got, fwd, bwd = _run(kern, x, hx, None, dy, dhn)
    assert fwd.algo == bwd.algo == "persistent" and fwd.fallback is None and bwd.fallback is None
    assert f"'PRNN_WIDENED_FROM': {planner.KERNEL_DTYPES[dtype]}" in fwd.details[0]
    assert "PRNN_WEIGHT_DTYPE" not in fwd.details[0] and "PRNN_WEIGHT_DTYPE" not in bwd.details[0]
    want, _, _ = _run(ref, x, hx, None, dy, dhn)
    same_rounding, _, _ = _run(gemm, x, hx, None, dy, dhn)
    for a, r, g in zip(got, want, same_rounding):
        assert _relerr(a, r) <= TOLERANCE[dtype] and _within_one_rounding(a, g, dtype)


def test_a_widened_forward_finished_by_the_completion_kernel_keeps_16bit_states(
        settings, grid_path):
    # The completion kernel of a pass on the fp32 tile rounds the state as the pass does
    # (runtime.loop_defines gives it the 16-bit type): without it y would hold fp32 values.
    prnn.configure(emulation_timeout_ms=200, max_restarts=0)
    kern, gemm, _ = _layers("GRU", {}, "float16", hidden=40)
    x, hx, dy, dhn = _data("GRU", kern, steps=6, batch=1)
    with prnn.inject_stall(block=1, step=2, duration_ms=700):
        y, _ = kern.forward(x.astype(np.float16), hx.astype(np.float16))
    run = kern.last_run
    assert "finished by the completion kernel" in run.fallback and "PRNN_WIDENED_FROM" in run.details[0]
    assert _sixteen_bit_states(kern._ctx.directions[0][0].fwd.y, "float16")
    want, _ = gemm.forward(x.astype(np.float16), hx.astype(np.float16))
    assert _within_one_rounding(np.asarray(y, np.float64), np.asarray(want, np.float64), "float16")


@pytest.mark.parametrize("mode,dtype", [(m, d) for m in ("LSTM", "GRU") for d in HALF
                                         if _in_ci(m.lower(), d)])
@pytest.mark.parametrize("cluster", [True, False])
def test_stall_restarts_bitwise_identically(emulation, request, monkeypatch, fresh_plans, mode,
                                            dtype, cluster):
    # H 40: a grid of 2 CTAs as one cluster (the small-layer path on sm_90), or of 10 grid tiles.
    # The backward on the tensor cores at B 2 (planned from plan.MMA_BACKWARD_MIN_BATCH rows).
    monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 2)
    prnn.configure(stack=False)  # the layer kernels (16-bit stacks: tests/test_mma_stack.py)
    if not cluster:
        request.getfixturevalue("grid_path")
    kern, _, _ = _layers(mode, {}, dtype, hidden=40, bidirectional=True)
    x, hx, dy, dhn = _data(mode, kern, steps=6, batch=2)
    clean, fwd, _ = _run(kern, x, hx, [6, 4], dy, dhn)
    assert ("PRNN_CLUSTER" in fwd.details[0]) == cluster and "'PRNN_MMA': 1" in fwd.details[0]
    kern.zero_grad()
    prnn.configure(emulation_timeout_ms=300)
    with prnn.inject_stall(block=1, step=3, duration_ms=2000):
        stalled, fwd, bwd = _run(kern, x, hx, [6, 4], dy, dhn)
    assert fwd.restarts >= 1 and bwd.restarts >= 1 and "'PRNN_MMA': 2" in bwd.details[0]
    assert fwd.algo == bwd.algo == "persistent" and fwd.fallback is None and bwd.fallback is None
    for a, b in zip(stalled, clean):
        assert np.array_equal(a, b)
