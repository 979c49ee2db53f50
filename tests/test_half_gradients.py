"""A 16-bit layer's weight-gradient products in TF32 (``functional.gradient_tf32``): dW_ih, dW_hh
and an LSTM projection's dW_hr take the fp32 gate gradients rounded to TF32 times the layer's
16-bit activations and inputs (exact in TF32), whatever ``settings.allow_tf32`` says; a float32
layer's follow the setting. On NumPy the TF32-rounded operands' ``numpy.matmul`` (what the
emulated engine computes, bit for bit on every path: tests/test_call_plans.py), on CuPy cuBLAS
with ``CUBLAS_COMPUTE_32F_FAST_TF32`` (tests/test_matmul.py; on a GPU tests/test_half_gpu.py)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import functional, latency, matmul, plan as planner
from persistent_rnn.cells import CELLS
from persistent_rnn.halves import narrow, widen


def _gradients(rng, steps: int = 5, batch: int = 3, gates: int = 24, width: int = 6,
               half: str = "float16") -> tuple:
    """Random fp32 gate gradients (T, B, G) and 16-bit activations (float32 holding 16-bit
    values): ``dgi``, ``dgh``, the input rows (T*B, I), ``y`` (T, B, H), ``h0`` (B, H)."""
    def held(shape):
        return widen(narrow(rng.standard_normal(shape).astype(np.float32), half))
    dgi, dgh = (rng.standard_normal((steps, batch, gates)).astype(np.float32) for _ in range(2))
    return dgi, dgh, held((steps * batch, width)), held((steps, batch, width)), held((batch, width))


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_16_bit_weight_gradients_are_tf32_products(settings, half):
    # parameter_gradients and projection_gradient of a 16-bit layer: bitwise numpy.matmul of the
    # TF32-rounded operands (the 16-bit ones unchanged by it), not the plain fp32 products (a
    # float32 layer's, allow_tf32 off) - on random data TF32's rounding of dgi shows.
    dgi, dgh, x, y, h0 = _gradients(np.random.default_rng(0), half=half)
    t = matmul.tf32_rounded
    for a in (x, y, h0):
        np.testing.assert_array_equal(t(a), a)
    w_ih, w_hh, b_ih, b_hh = functional.parameter_gradients(dgi, dgh, x, y, h0, True, half=half)
    gates, width = dgh.shape[2], y.shape[2]
    np.testing.assert_array_equal(w_ih, np.matmul(t(dgi.reshape(-1, gates)).T, x))
    want = np.matmul(t(dgh[0]).T, h0)
    want += np.matmul(t(dgh[1:].reshape(-1, gates)).T, y[:-1].reshape(-1, width))
    np.testing.assert_array_equal(w_hh, want)
    fp32 = functional.parameter_gradients(dgi, dgh, x, y, h0, True)
    assert not np.array_equal(w_ih, fp32[0]) and not np.array_equal(w_hh, fp32[1])
    np.testing.assert_array_equal(b_ih, fp32[2])  # (the bias sums stay fp32 sums)
    np.testing.assert_array_equal(b_hh, fp32[3])
    rng = np.random.default_rng(1)
    drs, hs = (rng.standard_normal(y.shape).astype(np.float32) for _ in range(2))  # (fp32 h_t)
    np.testing.assert_array_equal(
        functional.projection_gradient(drs, hs, half=half),
        np.matmul(t(drs.reshape(-1, width)).T, t(hs.reshape(-1, width))))
    prnn.configure(allow_tf32=True)  # a float32 layer's follow the setting
    np.testing.assert_array_equal(functional.parameter_gradients(dgi, dgh, x, y, h0, False)[0],
                                  w_ih)


@pytest.mark.parametrize("dtype,algo,proj", [("float16", "gemm", 0), ("bfloat16", "gemm", 4),
                                             ("float16", "persistent", 4)])
def test_a_16_bit_layers_backward_asks_for_tf32_products(settings, monkeypatch, dtype, algo,
                                                         proj):
    # Every product of a 16-bit layer's backward in functional (its weight gradients: dW_ih,
    # dW_hh's two, dW_hr) asks matmul for TF32 (True); a float32 layer's for the setting (None).
    asked = []
    product = functional.matmul

    def spy(a, b, out=None, tf32=None):
        asked.append(tf32)
        return product(a, b, out, tf32)
    monkeypatch.setattr(functional, "matmul", spy)
    rng = np.random.default_rng(2)
    for layer_dtype, want in ((dtype, True), ("float32", None)):
        layer = prnn.LSTM(5, 8, proj_size=proj, bidirectional=True, algo=algo, seed=1,
                          dtype=layer_dtype)
        x = rng.standard_normal((4, 2, 5)).astype(layer.dtype)
        y, _ = layer.forward(x)
        asked.clear()
        layer.backward(np.ones_like(y))
        assert asked == [want] * (2 * (3 + bool(proj))), layer_dtype


def test_the_model_prices_a_16_bit_backwards_weight_gradients_at_tf32s_rate():
    # latency._gemm_us's tf32 (matmul's): True at TF32's rate on any profile, False fp32 on one
    # that allows TF32, None the profile's. LSTM H 1024 B 8 T 100, input 1024 (h100): the
    # backward's terms beside its steps 682 -> 482 us (predictions; the H200 measured 2 x 264.6 us
    # of SIMT SGEMM there, docs/design.md; the terms: tests/test_half_projection.py).
    h100 = planner.resolve_device("h100")
    tf32, flops = replace(h100, allow_tf32=True), 2.0 * 800 * 4096 * 1024
    assert latency._gemm_us(flops, h100, tf32=True) == latency._gemm_us(flops, tf32) \
        < latency._gemm_us(flops, h100) == latency._gemm_us(flops, tf32, tf32=False)

    def cost(half):
        return latency.call_costs(CELLS["lstm"], 1024, 8, 100, 1024, True, h100, half).device_us
    assert (round(cost(False)), round(cost(True))) == (662, 482)
