"""16-bit persistent kernels on a GPU (marked ``gpu``: skipped without one; not run where this
was written). fp16 layers on CuPy up to the new ``max_hidden_size``: against the float64 layer on
the same parameters (CPU) and the 16-bit GEMM path on the GPU; a stall restarts bitwise
identically. The layer API takes bfloat16 on NumPy only; its kernels are covered by the emulation and the
conversion test in tests/test_half_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn.cells import CELLS as REGISTRY, layer_args

pytestmark = pytest.mark.gpu

CELLS = [layer_args(name) for name in REGISTRY]


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _run(cupy, layer, x, dy, lengths, gpu=True):
    """Forward and backward (on CuPy copies of x, dy where ``gpu``); every result on the host."""
    y, hn = layer.forward(cupy.asarray(x) if gpu else x, lengths=lengths)
    fwd = layer.last_run
    dx, dhx = layer.backward(cupy.asarray(dy) if gpu else dy)
    arrays = [y, *(hn if isinstance(hn, tuple) else (hn,)), dx, *layer.grads.values()]
    host = [a.get() if hasattr(a, "get") else a for a in arrays]
    return [np.asarray(a, np.float64) for a in host], fwd, layer.last_run


def _layer(mode, kw, hidden, dtype, algo):
    return getattr(prnn, mode)(64, hidden, dtype=dtype, algo=algo, seed=0, **kw)


@pytest.mark.parametrize("mode,kw", CELLS)
@pytest.mark.parametrize("size", ["small", "max"])
@pytest.mark.parametrize("batch", [1, 4])
def test_fp16_persistent_matches_float64(cupy, mode, kw, size, batch):
    """Within 5e-3 of float64 (docs/api.md's bound: y and h_n for every cell, the gradients too
    except the relu RNN's, which have none: a rounded pre-activation near zero flips relu's
    derivative), and within two fp16 units of the largest value (2^-10) of the 16-bit GEMM path:
    both round at the same places, but the register tile and cuBLAS sum in different orders, so
    an intermediate's rounding can flip and carry through the steps (the H100 run of 2026-11-26
    measured 6.4e-4 for the RNN cells at their largest H). The relu RNN's gradients must be no
    further from float64 than the 16-bit GEMM path's (at H 3584, B 4 both are ~0.15 away on the
    weights; the emulated kernel was 4.3e-4 from the GEMM path)."""
    top = prnn.max_hidden_size(mode if not kw else "rnn_" + kw["nonlinearity"], "float16")
    hidden = 256 if size == "small" else top
    kern = _layer(mode, kw, hidden, "float16", "persistent")
    ref = _layer(mode, kw, hidden, "float64", "gemm")
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    gemm = _layer(mode, kw, hidden, "float16", "gemm")
    gemm.load_params(kern.params)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, batch, 64)).astype(np.float16)
    dy = rng.standard_normal((12, batch, hidden)).astype(np.float16)
    lengths = [12] + [7] * (batch - 1)
    got, fwd, bwd = _run(cupy, kern, x, dy, lengths)
    assert fwd.algo == bwd.algo == "persistent" and not fwd.emulated and fwd.fallback is None
    if batch == 1 and size == "small":  # plan.widens: both passes on the fp32 tile
        assert "PRNN_WIDENED_FROM" in fwd.details[0] and "PRNN_WEIGHT_DTYPE" not in bwd.details[0]
    want, _, _ = _run(cupy, ref, x.astype(np.float64), dy.astype(np.float64), lengths, gpu=False)
    same, _, _ = _run(cupy, gemm, x, dy, lengths)
    relu_gradients = kw.get("nonlinearity") == "relu"
    forward_outputs = 3 if mode == "LSTM" else 2  # y, h_n (and c_n), then the gradients
    for i, (a, r, g) in enumerate(zip(got, want, same)):
        gradient = i >= forward_outputs
        bound = 1.25 * _relerr(g, r) + 2.0**-10 if gradient and relu_gradients else 5e-3
        assert _relerr(a, r) <= bound, i
        assert _relerr(a, g) <= 2.0**-10, i


def test_fp16_lstm_batch_8_gradients_in_tf32_within_the_bound(cupy):
    """fp16 LSTM H=1024 B=8 (the H200 profile's shape of 2026-11-27), its weight gradients'
    products in TF32 on cuBLAS (docs/api.md, "16-bit layers"): every result and gradient within
    5e-3 of float64, the weight gradients within 2^-10 of the 16-bit GEMM path's on the GPU
    (TF32 as well: the same products, summed in another order)."""
    kern = _layer("LSTM", {}, 1024, "float16", "persistent")
    ref = _layer("LSTM", {}, 1024, "float64", "gemm")
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    gemm = _layer("LSTM", {}, 1024, "float16", "gemm")
    gemm.load_params(kern.params)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 8, 64)).astype(np.float16)
    dy = rng.standard_normal((12, 8, 1024)).astype(np.float16)
    got, fwd, bwd = _run(cupy, kern, x, dy, None)
    assert fwd.algo == bwd.algo == "persistent" and not bwd.emulated and bwd.fallback is None
    want, _, _ = _run(cupy, ref, x.astype(np.float64), dy.astype(np.float64), None, gpu=False)
    same, _, _ = _run(cupy, gemm, x, dy, None)
    weights = [i for i, name in enumerate(["y", "h", "c", "dx", *kern.grads])
               if name.startswith("weight_")]
    assert len(weights) == 2
    for i, (a, r, g) in enumerate(zip(got, want, same)):
        assert _relerr(a, r) <= 5e-3, i
        assert i not in weights or _relerr(a, g) <= 2.0**-10, i


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_fp16_stall_restarts_bitwise_identically(cupy, settings, mode):
    hidden = prnn.max_hidden_size(mode, "float16")
    layer = _layer(mode, {}, hidden, "float16", "persistent")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, 2, 64)).astype(np.float16)
    dy = rng.standard_normal((10, 2, hidden)).astype(np.float16)
    clean, _, _ = _run(cupy, layer, x, dy, None)
    layer.zero_grad()
    prnn.configure(gpu_timeout_ms=20)
    with prnn.inject_stall(block=3, step=5, duration_ms=200):
        stalled, fwd, bwd = _run(cupy, layer, x, dy, None)
    assert fwd.restarts >= 1 and bwd.restarts >= 1 and fwd.fallback is None
    for a, b in zip(stalled, clean):
        assert np.array_equal(a, b)
