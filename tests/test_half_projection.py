"""16-bit layers' input projection and conversions on the CPU (persistent_rnn/halves.py,
matmul.matmul_half, functional on 16-bit arrays, buffers.weight_words of 16-bit weights).

On NumPy the product is numpy.matmul of the float32 values, so a 16-bit layer's results are
bitwise those of the float32 arrays the callers used to convert (checked here); the dispatch to
cuBLAS gemmEx (not capturing) and to the captured kernel (capturing) is checked with stubs, and
gemmEx's column-major problem against a NumPy model of cuBLAS's semantics reading the operands'
memory. The GPU runs are tests/test_gpu_half_projection.py."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from persistent_rnn import functional, matmul
from persistent_rnn.buffers import weight_words
from persistent_rnn.cells import cell_spec
from persistent_rnn.halves import half_dtype, narrow, widen

HALF = ["float16", "bfloat16"]


def _half_values(rng, shape, half) -> np.ndarray:
    """Random normal values of ``half``, as an array of that dtype."""
    return rng.standard_normal(shape).astype(np.float32).astype(half_dtype(half))


@pytest.mark.parametrize("half", HALF)
def test_widen_and_narrow_are_exact_on_every_bit_pattern(half):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    a = bits.view(half_dtype(half))
    wide = widen(a)
    assert wide.dtype == np.float32
    ref = a.astype(np.float32)  # NumPy's / ml_dtypes' own conversion
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(wide[finite], ref[finite])
    assert np.array_equal(np.isnan(wide), np.isnan(ref))
    back = narrow(wide[finite], half)
    assert back.dtype == half_dtype(half)
    np.testing.assert_array_equal(back.view(np.uint16), bits[finite])
    assert narrow(a, half) is a and widen(wide) is wide and widen(None) is None


def test_half_dtype_names_the_argument():
    with pytest.raises(ValueError, match="half must be one of"):
        half_dtype("float32")


@pytest.mark.parametrize("half", HALF)
def test_numpy_product_is_numpy_matmul_of_the_float32_values(half):
    rng = np.random.default_rng(0)
    x = _half_values(rng, (12, 7), half)
    w = _half_values(rng, (9, 7), half)
    want = np.matmul(x.astype(np.float32), w.astype(np.float32).T)
    got = matmul.matmul_half(x, w.T, half)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    out = np.empty((12, 9), np.float32)
    assert matmul.matmul_half(x.astype(np.float32), w.T, half, out) is out  # a float32 operand
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("a, b, half, error, match", [
    (np.zeros((2, 3), np.float16), np.zeros((3, 4), np.float16), "float32", ValueError, "half"),
    (np.zeros((2, 3), np.float64), np.zeros((3, 4), np.float16), "float16", TypeError, "^a: "),
    (np.zeros((2, 3), np.float16), np.zeros((3, 4), ml_dtypes.bfloat16), "float16", TypeError,
     "^b: "),
])
def test_matmul_half_refuses_what_it_does_not_take(a, b, half, error, match):
    with pytest.raises(error, match=match):
        matmul.matmul_half(a, b, half)


@pytest.mark.parametrize("a, b, match", [
    (np.zeros((2, 3, 1)), np.zeros((3, 4)), "2-D"),
    (np.zeros((2, 3)), np.zeros((4, 4)), "inner sizes differ"),
])
def test_gemm_sizes_are_checked(a, b, match):
    with pytest.raises(ValueError, match=match):
        matmul._sizes(a, b)


class _Stream:
    def __init__(self, capturing: bool):
        self.capturing = capturing

    def is_capturing(self) -> bool:
        return self.capturing


class _Device:
    """Stands in for a CuPy array: the dispatch's isinstance(a, numpy.ndarray) is False."""

    def __init__(self, a: np.ndarray):
        self.a, self.dtype = a, a.dtype


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("half", HALF)
def test_cupy_operands_dispatch_on_the_stream_capturing(monkeypatch, capturing, half):
    """Not capturing: the tensor-core product of the operands narrowed to ``half``; capturing:
    the captured kernel's product of their float32 values (no cuBLAS call under capture)."""
    calls = []
    fake = SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: _Stream(capturing)))
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    monkeypatch.setattr(matmul, "widen", lambda x: ("wide", x))
    monkeypatch.setattr(matmul, "narrow", lambda x, h: ("narrow", x, h))
    monkeypatch.setattr(matmul, "captured_matmul", lambda *args: calls.append(("captured", args)))
    monkeypatch.setattr(matmul, "tensor_core_matmul",
                        lambda *args: calls.append(("tensor cores", args)))
    a = _Device(np.zeros((2, 3), half_dtype(half)))
    b = _Device(np.zeros((3, 4), np.float32))
    matmul.matmul_half(a, b, half, "out")
    if capturing:
        assert calls == [("captured", (fake, ("wide", a), ("wide", b), "out"))]
    else:
        assert calls == [("tensor cores", (fake, ("narrow", a, half), ("narrow", b, half), "out"))]


_CUBLAS = SimpleNamespace(CUBLAS_OP_N=0, CUBLAS_OP_T=1)
_XP = SimpleNamespace(ascontiguousarray=np.ascontiguousarray)


def _column_major(x: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
    """The memory of ``x`` from its first element read as cuBLAS reads a column-major
    (rows, cols) matrix of leading dimension ``ld``."""
    item = x.itemsize
    return as_strided(x, shape=(rows, cols), strides=(item, ld * item), writeable=False)


def _cublas_gemm(problem, out: np.ndarray) -> None:
    """cuBLAS's ``C = op(A) op(B)`` of ``_column_major_problem``'s arguments, in float64 (the
    model of its semantics: column-major storage, ``op`` N or T, leading dimensions), written
    into ``out``'s memory as the column-major C."""
    op_a, op_b, m, n, k, a, lda, b, ldb, c, ldc = problem
    assert c is out and lda >= max(1, k if op_a else m) and ldb >= max(1, n if op_b else k)
    assert ldc >= max(1, m)
    left = _column_major(a, k, m, lda).T if op_a else _column_major(a, m, k, lda)
    right = _column_major(b, n, k, ldb).T if op_b else _column_major(b, k, n, ldb)
    item = out.itemsize
    target = as_strided(out, shape=(m, n), strides=(item, ldc * item))
    target[...] = left.astype(np.float64) @ right.astype(np.float64)


def _layouts(rng, rows, cols, half):
    """The same matrix (rows, cols) as a contiguous array, a transposed view, a slice of wider
    rows, and a view of strided rows and columns (copied before cuBLAS sees it)."""
    base = _half_values(rng, (rows, cols), half)
    wide = np.zeros((rows, cols + 3), base.dtype)
    wide[:, :cols] = base
    spread = np.zeros((2 * rows, 2 * cols), base.dtype)
    spread[::2, ::2] = base
    return [base, np.ascontiguousarray(base.T).T, wide[:, :cols], spread[::2, ::2]]


@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (1, 4, 6), (6, 1, 1), (3, 8, 1)])
def test_gemm_ex_column_major_problem_computes_a_at_b(m, k, n):
    """out = a @ b as cuBLAS computes out^T = b^T a^T from the operands' memory, for every
    layout of either operand, into a contiguous out and into rows of a larger stride."""
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    for a in _layouts(rng, m, k, "float16"):
        for b in _layouts(rng, k, n, "float16"):
            want = a.astype(np.float64) @ b.astype(np.float64)
            for wider in (0, 2):
                holder = np.full((m, n + wider), np.nan, np.float32)
                out = holder[:, :n]
                ldc = matmul._row_stride(out)
                assert ldc == (n + wider if m > 1 else n)
                _cublas_gemm(matmul._column_major_problem(_XP, _CUBLAS, a, b, out, ldc), out)
                np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
                assert np.isnan(holder[:, n:]).all()  # nothing written past the rows


def test_an_output_cublas_cannot_write_is_refused_as_rows():
    out = np.zeros((4, 6), np.float32)
    assert matmul._row_stride(out) == 6
    assert matmul._row_stride(out.T) is None
    assert matmul._row_stride(out[:, ::2]) is None
    assert matmul._row_stride(out[:1, ::2]) is None and matmul._row_stride(out[:, :1]) == 6


def _layer_data(rng, mode, half, steps=5, batch=3, inputs=4, hidden=6, layers=2, proj=0,
                bidirectional=True):
    """Random 16-bit parameters, input and states of a stack, and their float32 copies."""
    from persistent_rnn.layers import LSTM, GRU
    cls = {"LSTM": LSTM, "GRU": GRU}[mode]
    layer = cls(inputs, hidden, num_layers=layers, bidirectional=bidirectional,
                proj_size=proj, dtype=half, seed=1)
    dirs = 2 if bidirectional else 1
    x = _half_values(rng, (steps, batch, inputs), half)
    h0 = _half_values(rng, (layers * dirs, batch, proj or hidden), half)
    hx = (h0, _half_values(rng, (layers * dirs, batch, hidden), half)) if mode == "LSTM" else h0
    return layer, x, hx


def _wide_all(a):
    if isinstance(a, dict):
        return {k: v.astype(np.float32) for k, v in a.items()}
    if isinstance(a, tuple):
        return tuple(v.astype(np.float32) for v in a)
    return a.astype(np.float32)


def _flat(a) -> list:
    return list(a) if isinstance(a, tuple) else [a]


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("mode,proj", [("GRU", 0), ("LSTM", 0), ("LSTM", 3)])
def test_numpy_results_equal_those_of_the_converted_float32_arrays(half, mode, proj):
    """functional on the layer's 16-bit arrays as they are == functional on their float32
    copies (what the callers passed before), bit for bit: forward and backward, two
    bidirectional layers, lengths."""
    rng = np.random.default_rng(2)
    layer, x, hx = _layer_data(rng, mode, half, proj=proj)
    cell, lengths = cell_spec(mode), np.array([5, 2, 4], np.int32)
    kw = dict(num_layers=2, bidirectional=True, batch_first=False, algo="gemm", half=half)
    runs = []
    dy = np.linspace(-1, 1, 5 * 3 * 2 * (proj or 6), dtype=np.float32).astype(half_dtype(half))
    for convert in (lambda a: a, _wide_all):
        y, hn, ctx = functional.forward(cell, convert(layer.params), convert(x), convert(hx),
                                        lengths, **kw)
        dx, dhx, grads = functional.backward(ctx, convert(dy.reshape(y.shape)))
        runs.append([y, *_flat(hn), dx, *_flat(dhx), *grads.values()])
    for got, want in zip(*runs):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("half", HALF)
def test_the_projection_takes_the_16bit_input_and_weights_as_they_are(monkeypatch, half):
    """The first layer's product gets the layer's own W_ih (no converted copy) and the 16-bit
    input; the second layer's input is the first layer's float32 output."""
    rng = np.random.default_rng(3)
    layer, x, hx = _layer_data(rng, "GRU", half, bidirectional=False)
    seen = []
    real = functional.matmul_half

    def spy(a, b, h, out=None):
        seen.append((a, b, h))
        return real(a, b, h, out)

    monkeypatch.setattr(functional, "matmul_half", spy)
    layer.forward(x, hx)
    (a0, b0, h0), (a1, b1, _) = seen
    assert h0 == half and a0.dtype == half_dtype(half) and a1.dtype == np.float32
    assert np.shares_memory(b0, layer.params["weight_ih_l0"])
    assert np.shares_memory(b1, layer.params["weight_ih_l1"])


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("cols", [6, 7])
def test_weight_words_of_16bit_weights_are_those_of_their_float32_values(half, cols):
    rng = np.random.default_rng(4)
    w = _half_values(rng, (5, cols), half)
    want = weight_words(np, w.astype(np.float32), half)
    got = weight_words(np, w, half)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(weight_words(np, w.T, half),
                                  weight_words(np, w.astype(np.float32).T, half))
    assert np.shares_memory(got, w) == (cols % 2 == 0)  # its own words: no copy
    with pytest.raises(TypeError, match="^m: "):
        weight_words(np, w, "float16" if half == "bfloat16" else "bfloat16")


def test_torch_weights_are_16bit_views_that_see_in_place_updates():
    """A bfloat16 module's weights reach the library as views of the tensors (remembered per
    module, ``ops.WeightViews``); an in-place update after a call is seen by the next call."""
    torch = pytest.importorskip("torch")
    import persistent_rnn.torch as prt
    torch.manual_seed(0)
    module = prt.GRU(4, 6, algo="gemm").to(torch.bfloat16)
    ref = torch.nn.GRU(4, 6).double()
    x = torch.randn(5, 2, 4).to(torch.bfloat16)
    for scale in (1.0, 0.5):
        with torch.no_grad():
            if scale != 1.0:
                module.weight_ih_l0.mul_(scale)  # in place: the same tensor and memory
            for name, p in module.named_parameters():
                getattr(ref, name).copy_(p.double())
        y, _ = module(x)
        want, _ = ref(x.double())
        assert (y.double() - want).abs().max() < 2e-2
    weight = module._record.views.params["weight_ih_l0"]  # (ops.WeightViews)
    assert weight.dtype == half_dtype("bfloat16")
    assert np.shares_memory(weight, module.weight_ih_l0.detach().view(torch.int16).numpy())


def test_the_model_projects_a_16bit_forward_on_the_tensor_cores():
    """Latency model (predictions): a 16-bit layer's forward call costs its input GEMM at the
    tensor-core rate (hw.TENSOR_GEMM_PEAK_FRACTION of the mma peak), its backward its two weight
    gradients' GEMMs at TF32's rate (functional.gradient_tf32) and dh0's and dx's fp32 as before,
    each beside its conversions; at LSTM H=1024 B=8 T=100 input 1024 the projection's GEMM is
    about a quarter."""
    from persistent_rnn import hardware, latency
    lstm, h200 = cell_spec("LSTM"), hardware.PROFILES["h200"]
    flops = 2.0 * 800 * 1024 * 4096
    fp32, tensor = latency._gemm_us(flops, h200), latency._gemm_us(flops, h200, True)
    assert 0.2 < tensor / fp32 < 0.35  # measured on the H200: 55.9 against 210 us
    calls = {half: [latency.call_costs(lstm, 1024, 8, 100, 1024, b, h200, half)
                    for b in (False, True)] for half in (False, True)}
    # (less the 16-bit call's conversions inside its chains: latency.HALF_*_OPS short kernels)
    convert = {b: ops * hardware.EMPTY_LAUNCH_US
               for b, ops in ((False, latency.HALF_FORWARD_OPS), (True, latency.HALF_BACKWARD_OPS))}
    saved = calls[False][0].device_us - calls[True][0].device_us
    assert abs(saved - (fp32 - tensor - convert[False])) < 1e-9
    tf32 = latency._gemm_us(flops, h200, tf32=True)  # (dW_ih's and dW_hh's flops alike here)
    added = calls[True][1].device_us - calls[False][1].device_us
    assert abs(added - (convert[True] - 2 * (fp32 - tf32))) < 1e-9


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_a_16bit_input_does_not_keep_the_persistent_kernels_away(dtype):
    """Stack mode's and the runtime's first check sees a 16-bit layer's input as it is now."""
    from persistent_rnn import runtime
    assert runtime.why_not_persistent(np.zeros((2, 1, 3), dtype), 1, "persistent") is None
    assert "float64" in runtime.why_not_persistent(np.zeros((2, 1, 3)), 1, "persistent")
