"""16-bit layers' input projection on a GPU (marked ``gpu``: skipped without one; written where
none was available). ``matmul.matmul_half`` on CuPy arrays: cuBLAS gemmEx on the tensor cores
(16-bit operands, fp32 accumulation and output) against float64 and against the fp32 GEMM of the
converted operands (what ran before); under capture the library's kernel, replayed. The fp16
CuPy layer and the fp16/bf16 torch modules, whose projections now run there, within the bounds
of docs/api.md ("16-bit layers") and of the CPU's fp32 GEMM path. The CPU side of the same code
is tests/test_half_projection.py."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import matmul
from persistent_rnn.halves import half_dtype, widen

pytestmark = pytest.mark.gpu

HALF = ["float16", "bfloat16"]
# (m, k, n, a transposed, b transposed): off any tile, K = 1, single rows and columns, and the
# library's own layout (T*B, I) @ W_ih^T at a size where cuBLAS takes tensor-core kernels.
SHAPES = [(5, 7, 3, False, True), (33, 1, 65, True, False), (64, 70, 96, False, True),
          (1, 300, 1, True, True), (128, 64, 256, False, False), (800, 512, 1024, False, True)]
# Tensor cores sum exact products in fp32 with their own (undocumented) rounding, reported as
# truncation: a unit of 2^-23 per addition rather than round-to-nearest's 2^-24.
UNIT = 2.0**-23


def _device_half(cupy, host: np.ndarray, half: str):
    """A CuPy array of ``half`` holding ``host``'s 16-bit values (by their bits)."""
    return cupy.asarray(host.view(np.uint16)).view(half_dtype(half))


def _host64(cupy, a, half: str) -> np.ndarray:
    """A CuPy 16-bit array's values in float64, converted on the host (not by the library)."""
    return cupy.ascontiguousarray(a.view(np.uint16)).get().view(half_dtype(half)).astype(
        np.float64)


def _operands(cupy, rng, m, k, n, a_t, b_t, half):
    a = rng.standard_normal((k, m) if a_t else (m, k)).astype(half_dtype(half))
    b = rng.standard_normal((n, k) if b_t else (k, n)).astype(half_dtype(half))
    a, b = _device_half(cupy, a, half), _device_half(cupy, b, half)
    return (a.T if a_t else a), (b.T if b_t else b)


def _bound(a64: np.ndarray, b64: np.ndarray, unit: float) -> np.ndarray:
    return (a64.shape[1] + 2) * unit * (np.abs(a64) @ np.abs(b64))


@pytest.mark.parametrize("half", HALF)
def test_tensor_core_products_match_float64_and_the_fp32_gemm(cupy, half):
    """Within a k-term fp32 sum of float64, and of the fp32 GEMM of the converted operands
    (cupy.matmul of float32: the products are exact in both, only the sums differ); ``out``
    contiguous, rows of a larger stride, and transposed (written through a copy)."""
    rng = np.random.default_rng(0)
    for m, k, n, a_t, b_t in SHAPES:
        a, b = _operands(cupy, rng, m, k, n, a_t, b_t, half)
        a64, b64 = _host64(cupy, a, half), _host64(cupy, b, half)
        want, bound = a64 @ b64, _bound(a64, b64, UNIT)
        fp32 = cupy.matmul(cupy.asarray(a64.astype(np.float32)),
                           cupy.asarray(b64.astype(np.float32))).get()
        wider = cupy.full((m, n + 3), np.nan, np.float32)
        transposed = cupy.full((n, m), np.nan, np.float32).T
        for out in (None, wider[:, :n], transposed):
            got = matmul.matmul_half(a, b, half, out)
            assert got.dtype == np.float32 and (out is None or got is out)
            got = got.get()
            assert np.all(np.abs(got - want) <= bound), (m, k, n, a_t, b_t)
            assert np.all(np.abs(got - fp32) <= 2 * bound), (m, k, n, a_t, b_t)
        assert np.isnan(wider[:, n:].get()).all()


@pytest.mark.parametrize("half", HALF)
def test_float32_operands_holding_16bit_values_and_empty_products(cupy, half):
    """A lower layer's float32 output (16-bit values) is narrowed exactly: the same product as
    its 16-bit array; empty products: zeros (K = 0) or empty results."""
    rng = np.random.default_rng(1)
    a, b = _operands(cupy, rng, 40, 24, 48, False, True, half)
    wide = cupy.asarray(_host64(cupy, a, half).astype(np.float32))
    np.testing.assert_array_equal(matmul.matmul_half(wide, b, half).get(),
                                  matmul.matmul_half(a, b, half).get())
    zero_k = matmul.matmul_half(a[:, :0], b[:0], half)
    assert zero_k.shape == (40, 48) and not zero_k.get().any()
    assert matmul.matmul_half(a[:0], b, half).shape == (0, 48)


@pytest.mark.parametrize("half", HALF)
def test_captured_half_products_replay_within_round_off(cupy, half):
    """On a capturing stream (no cuBLAS call there): the captured kernel of the float32 values,
    recorded and replayed, within round-to-nearest fp32's bound of float64."""
    rng = np.random.default_rng(2)
    stream = cupy.cuda.Stream(non_blocking=True)
    matmul.load_captured_kernel(np.float32)  # (no module is loaded under capture)
    for m, k, n, a_t, b_t in SHAPES[:4]:
        with stream:
            a, b = _operands(cupy, rng, m, k, n, a_t, b_t, half)
            into = cupy.full((m, n), np.nan, np.float32)
            widen(a), widen(b)  # (CuPy's conversion kernels compiled and loaded before capture)
            stream.begin_capture()
            matmul.matmul_half(a, b, half, into)
            graph = stream.end_capture()
            graph.launch(stream)
        stream.synchronize()
        a64, b64 = _host64(cupy, a, half), _host64(cupy, b, half)
        assert np.all(np.abs(into.get() - a64 @ b64) <= _bound(a64, b64, 2.0**-24))


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _layer_run(layer, x, dy, lengths, xp):
    """Forward and backward of a 16-bit layer on ``xp`` copies of x, dy; results on the host in
    float64."""
    y, hn = layer.forward(xp.asarray(x), lengths=lengths)
    dx, dhx = layer.backward(xp.asarray(dy))
    arrays = [y, *(hn if isinstance(hn, tuple) else (hn,)), dx, *layer.grads.values()]
    return [np.asarray(a.get() if hasattr(a, "get") else a, np.float64) for a in arrays]


@pytest.mark.parametrize("algo", ["gemm", "auto"])
@pytest.mark.parametrize("mode,kw", [("GRU", {}), ("LSTM", {}), ("LSTM", {"proj_size": 24})])
def test_fp16_cupy_layers_match_float64_and_the_cpu_layer(cupy, mode, kw, algo):
    """An fp16 stack (2 layers, bidirectional, lengths) on CuPy - its projections on the tensor
    cores - within docs/api.md's 5e-3 of the float64 layer, and within two fp16 units (2^-10)
    of the same layer on NumPy (the fp32 GEMMs of converted operands: the same rounding points,
    sums in another order)."""
    def make(dtype, algo_):
        return getattr(prnn, mode)(48, 64, num_layers=2, bidirectional=True, dtype=dtype,
                                   algo=algo_, seed=0, **kw)
    gpu, cpu, ref = make("float16", algo), make("float16", "gemm"), make("float64", "gemm")
    ref.load_params({k: v.astype(np.float64) for k, v in gpu.params.items()})
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 4, 48)).astype(np.float16)
    dy = rng.standard_normal((9, 4, 2 * kw.get("proj_size", 64))).astype(np.float16)
    lengths = [9, 4, 7, 9]
    got = _layer_run(gpu, x, dy, lengths, cupy)
    same = _layer_run(cpu, x, dy, lengths, np)
    want = _layer_run(ref, x.astype(np.float64), dy.astype(np.float64), lengths, np)
    for i, (a, s, r) in enumerate(zip(got, same, want)):
        assert _relerr(a, r) <= 5e-3, i
        assert _relerr(a, s) <= 2.0**-10, i


@pytest.mark.parametrize("dtype_name,bound", [("float16", 5e-3), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("algo", ["gemm", "persistent"])
def test_16bit_torch_modules_match_float64(cupy, dtype_name, bound, algo):
    """fp16/bf16 torch LSTM on CUDA (weights reach the library as 16-bit views, the projection
    on the tensor cores): y, h_n, c_n, dx and the weight gradients within docs/api.md's bound
    of torch.nn in float64; the views are the parameters' own memory."""
    torch = pytest.importorskip("torch")
    import persistent_rnn.torch as prt
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(4)
    module = prt.LSTM(64, 128, algo=algo).to(device="cuda", dtype=dtype)
    ref = torch.nn.LSTM(64, 128).to(device="cuda", dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    x = torch.randn(12, 8, 64, device="cuda").to(dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y, (hn, cn) = module(x)
    y64, (hn64, cn64) = ref(x64)
    y.float().sum().backward()
    y64.sum().backward()
    assert module.last_run.algo == algo
    pairs = [(y, y64), (hn, hn64), (cn, cn64), (x.grad, x64.grad)] + [
        (p.grad, q.grad) for p, q in zip(module.parameters(), ref.parameters())]
    for i, (a, r) in enumerate(pairs):
        assert _relerr(a.detach().double().cpu().numpy(), r.detach().cpu().numpy()) <= bound, i
    views = module._record.views.params  # (ops.WeightViews)
    assert views["weight_ih_l0"].data.ptr == module.weight_ih_l0.data_ptr()
