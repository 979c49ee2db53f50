"""GPU variants (CuPy arrays) of the capture-safe matmul (persistent_rnn/matmul.py): eager products
are cuBLAS's, bit for bit; products on a capturing stream run matmul.cu's kernel, record, replay
and equal float64 products within the round-off of a k-term sum; products a chain capture records
(``cublas_capture``) are cuBLAS's own, eager and replayed."""
from __future__ import annotations

import numpy as np
import pytest

from persistent_rnn import matmul

pytestmark = pytest.mark.gpu

# (m, k, n, A transposed, B transposed): not multiples of the tile, K = 1, K over several slices.
SHAPES = [(5, 7, 3, False, True), (33, 1, 65, True, False), (64, 70, 96, False, True),
          (1, 300, 1, True, True), (128, 64, 256, False, False)]
UNIT_ROUNDOFF = {np.float32: 2.0**-24, np.float64: 2.0**-53}


def _operands(cupy, rng, m, k, n, a_t, b_t, dtype):
    """(a, b) of shapes (m, k), (k, n) on the GPU, transposed views where asked."""
    a = rng.standard_normal((k, m) if a_t else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if b_t else (k, n)).astype(dtype)
    a, b = cupy.asarray(a), cupy.asarray(b)
    return (a.T if a_t else a), (b.T if b_t else b)


def _assert_close_to_float64(got, a, b, dtype):
    a64, b64 = a.get().astype(np.float64), b.get().astype(np.float64)
    bound = (a.shape[1] + 1) * UNIT_ROUNDOFF[dtype] * (np.abs(a64) @ np.abs(b64))
    assert np.all(np.abs(got.get() - a64 @ b64) <= bound)


def test_eager_products_are_cublas_bit_for_bit(cupy):
    rng = np.random.default_rng(0)
    for m, k, n, a_t, b_t in SHAPES:
        a, b = _operands(cupy, rng, m, k, n, a_t, b_t, np.float32)
        np.testing.assert_array_equal(matmul.matmul(a, b).get(), (a @ b).get())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_captured_products_replay_within_round_off(cupy, dtype):
    """Recorded on a capturing stream (where cupy.matmul refuses), into a fresh array and into
    ``out``; the replays equal float64 products, and cuBLAS's within the same bound."""
    rng = np.random.default_rng(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    for m, k, n, a_t, b_t in SHAPES:
        with stream:  # (operands made on the stream that replays: ordered before the graph)
            a, b = _operands(cupy, rng, m, k, n, a_t, b_t, dtype)
            into = cupy.full((m, n), np.nan, dtype)
            stream.begin_capture()
            fresh = matmul.matmul(a, b)
            matmul.matmul(a, b, out=into)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        for got in (fresh, into):
            _assert_close_to_float64(got, a, b, dtype)
        _assert_close_to_float64(a @ b, a, b, dtype)  # (the bound holds for cuBLAS as well)


def test_the_kernel_runs_outside_capture_too(cupy):
    """``captured_matmul`` only enqueues: on an ordinary stream it gives the same values."""
    rng = np.random.default_rng(2)
    for m, k, n, a_t, b_t in SHAPES:
        a, b = _operands(cupy, rng, m, k, n, a_t, b_t, np.float32)
        _assert_close_to_float64(matmul.captured_matmul(cupy, a, b), a, b, np.float32)


# A planned call's chain products (call_plans) at a layer's sizes (T=9, B=3, I=40, G=3*64, H=64):
# x W_ih^T, dgi^T x, dgh_0^T h0, dgh_{1:}^T y_{:-1}, dgi W_ih, dgh_0 W_hh, as (a, b) makers.
T, B, I, G, H = 9, 3, 40, 192, 64
CHAIN_PRODUCTS = [
    lambda r: (r((T * B, I)), r((G, I)).T), lambda r: (r((T * B, G)).T, r((T * B, I))),
    lambda r: (r((T, B, G))[0].T, r((B, H))),
    lambda r: (r((T, B, G))[1:].reshape(-1, G).T, r((T, B, H))[:-1].reshape(-1, H)),
    lambda r: (r((T * B, G)), r((G, I))), lambda r: (r((B, G)), r((G, H)))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_captured_in_a_chain_are_cupys_bit_for_bit(cupy, dtype):
    """``cublas_capture.matmul`` (what ``matmul`` records while a chain is captured) gives
    ``cupy.matmul``'s bits: called eagerly, and recorded on a capturing stream and replayed."""
    from persistent_rnn import cublas_capture
    rng = np.random.default_rng(2)
    stream = cupy.cuda.Stream(non_blocking=True)
    for make in CHAIN_PRODUCTS:
        with stream:
            a, b = make(lambda shape: cupy.asarray(rng.standard_normal(shape).astype(dtype)))
            want = cupy.matmul(a, b)
            eager = cublas_capture.matmul(cupy, a, b, cupy.empty_like(want))
            replayed = cupy.full_like(want, np.nan)
            stream.begin_capture()
            cublas_capture.matmul(cupy, a, b, replayed)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        np.testing.assert_array_equal(eager.get(), want.get())
        np.testing.assert_array_equal(replayed.get(), want.get())


def test_16_bit_products_captured_in_a_chain_are_the_eager_bits(cupy, monkeypatch):
    """``matmul_half`` while a chain is captured (a 16-bit plan's input projection,
    ``call_plans.HalfPlan``) records cuBLAS's ``gemmEx`` with the eager call's arguments
    (``cublas_capture.gemm_ex``): replayed, the eager product's bits."""
    from persistent_rnn import chain_graphs
    rng = np.random.default_rng(4)
    stream = cupy.cuda.Stream(non_blocking=True)
    capturing = [False]
    monkeypatch.setattr(chain_graphs, "capturing", lambda: capturing[0])
    for half in ("float16", "bfloat16"):
        dtype = matmul.half_dtype(half)
        x = cupy.asarray(rng.standard_normal((27, 16)).astype(dtype))
        w = cupy.asarray(rng.standard_normal((192, 16)).astype(dtype))
        with stream:
            want = matmul.tensor_core_matmul(cupy, x, w.T)
            replayed = cupy.full_like(want, np.nan)
            stream.begin_capture()
            capturing[0] = True  # (as chain_graphs._capture sets it)
            matmul.matmul_half(x, w.T, half, replayed)
            capturing[0] = False
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        np.testing.assert_array_equal(replayed.get(), want.get())


@pytest.mark.parametrize("rows", [1, 37])
def test_column_sums_record_without_scratch(cupy, rows):
    """``buffers.column_sums`` (a planned backward's bias gradients, inside its chain): CuPy's
    sums within round-off of NumPy's, a row its own sums exactly, recorded on a capturing stream
    with no allocation (``ndarray.sum`` may take CUB's scratch from the pool for one row)."""
    from persistent_rnn import buffers, launch
    rng = np.random.default_rng(rows)
    host = rng.standard_normal((rows, 96)).astype(np.float32)
    a = cupy.asarray(host)
    eager = buffers.column_sums(a)  # (the kernel built outside the capture)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.full(96, np.nan, np.float32)
        with launch.counting() as counts:
            stream.begin_capture()
            buffers.column_sums(a, out)
            graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert counts.allocations == 0
    np.testing.assert_array_equal(out.get(), eager.get())
    np.testing.assert_allclose(out.get(), host.sum(axis=0), rtol=1e-5, atol=1e-5)
    if rows == 1:
        np.testing.assert_array_equal(out.get(), host[0])
