"""The capture-safe matmul (persistent_rnn/matmul.py, cuda_src/matmul.cu) without a GPU: the
kernel run by the CPU emulation against float64 NumPy products on strided, non-square operands
(a sabotaged kernel fails the same check), its NVRTC build, the argument checks, that every
product the library issues on arrays goes through ``matmul.matmul``, and the ``cublasGemmEx``
problem a chain's capture records (``cublas_capture``) carried out on the CPU, and the compute
type a TF32 product passes eagerly and captured (``settings.allow_tf32``, cuBLAS faked)."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import persistent_rnn
from persistent_rnn import chain_graphs, cublas_capture, emulate, matmul
from persistent_rnn._sources import read_source
from sabotage import sabotaged

pytestmark = pytest.mark.timeout(240)

UNIT_ROUNDOFF = {np.float32: 2.0**-24, np.float64: 2.0**-53}

# (m, k, n, layout of A, layout of B, out transposed): sizes that are not multiples of the tile,
# K = 1, one row / one column, K over several slices with a partial last one, transposed and
# row-strided operands, a transposed output.
CASES = [
    (5, 7, 3, "rows", "rows", False),
    (33, 1, 65, "cols", "rows", False),
    (64, 70, 32, "rows", "cols", True),
    (1, 40, 1, "cols", "cols", False),
    (37, 33, 31, "strided", "cols", False),
    (3, 96, 45, "rows", "strided", True),
]


def _operand(rng, rows: int, cols: int, layout: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(base, view)``: a (rows, cols) view with ``layout``'s strides of the contiguous
    ``base`` that the kernel gets, starting at its first element."""
    shape = {"rows": (rows, cols), "cols": (cols, rows), "strided": (2 * rows, cols)}[layout]
    base = rng.standard_normal(shape).astype(dtype)
    view = {"rows": base, "cols": base.T, "strided": base[::2]}[layout]
    return base, view


def _check(module, case, dtype, rng) -> None:
    """One emulated product of ``case`` against float64, within the bound of a k-term sum
    rounded in ``dtype`` (k + 1 unit roundoffs of sum |a_ik| |b_kj|)."""
    m, k, n, a_layout, b_layout, out_transposed = case
    a_base, a = _operand(rng, m, k, a_layout, dtype)
    b_base, b = _operand(rng, k, n, b_layout, dtype)
    out_base = np.full((n, m) if out_transposed else (m, n), np.nan, dtype)
    out = out_base.T if out_transposed else out_base
    suffix = matmul._SUFFIX[np.dtype(dtype)]
    tiles = -(-m // matmul.TILE) * -(-n // matmul.TILE)
    module.launch(f"prnn_matmul_{suffix}", tiles, matmul.THREADS, matmul.shared_bytes(dtype),
                  (a_base, b_base, out_base, *matmul.launch_sizes(a, b, out)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    bound = (k + 1) * UNIT_ROUNDOFF[dtype] * (np.abs(a.astype(np.float64)) @ np.abs(b))
    err = np.abs(out - want)
    assert np.all(err <= bound), (case, dtype, float(np.max(err - bound)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_kernel_equals_float64_products(dtype):
    module = emulate.get_module("matmul.cu", matmul.DEFINES)
    rng = np.random.default_rng(5)
    for case in CASES:
        _check(module, case, dtype, rng)


@pytest.mark.parametrize("old, new", [
    ("    for (int kk = 0; kk < depth; ++kk) {", "    for (int kk = 0; kk + 1 < depth; ++kk) {"),
    ("tile[r * dst_row + c * dst_col] =", "tile[c * dst_row + r * dst_col] ="),
    ("c[(long long)i * c_row + (long long)j * c_col]", "c[(long long)i * c_row + j]"),
])
def test_a_sabotaged_kernel_fails_the_check(tmp_path, old, new):
    """A slice's last k dropped, a tile staged transposed, the output's column stride ignored:
    each fails the bound of the test above on at least one case."""
    src = sabotaged(tmp_path, "matmul.cu", old, new)
    module = emulate.get_module("matmul.cu", matmul.DEFINES, src_dir=src)
    failures = 0
    for case in CASES:
        try:
            _check(module, case, np.float32, np.random.default_rng(5))
        except AssertionError:
            failures += 1
    assert failures > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_without_spills(arch):
    """Both kernels build with NVRTC for the shipped architectures (no GPU needed), no spills."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc
    prog = nvrtc.createProgram(read_source("matmul.cu"), "matmul.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", *matmul.compile_options(), "-Xptxas=-v"])
    finally:
        log = nvrtc.getProgramLog(prog)
    for name in ("prnn_matmul_f32", "prnn_matmul_f64"):
        assert f"entry function '{name}'" in log, name
    assert log.count("0 bytes spill stores, 0 bytes spill loads") >= 2, log


def test_numpy_operands_take_numpy_matmul():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    out = np.empty((4, 5))
    assert matmul.matmul(a, b, out=out) is out
    np.testing.assert_array_equal(out, np.matmul(a, b))


@pytest.mark.parametrize("a, b, error, match", [
    (np.zeros((2, 3, 4)), np.zeros((4, 5)), ValueError, "2-D"),
    (np.zeros((2, 3), np.float32), np.zeros((3, 5)), TypeError, "float32 and float64"),
    (np.zeros((2, 3), np.float16), np.zeros((3, 5), np.float16), TypeError, "float16"),
    (np.zeros((2, 3)), np.zeros((4, 5)), ValueError, "inner sizes differ"),
])
def test_operands_the_kernel_does_not_take_are_refused(a, b, error, match):
    """Checked before anything is enqueued (NumPy arrays stand in: shapes and dtypes matter)."""
    with pytest.raises(error, match=match):
        matmul._checked(a, b)


def test_every_library_product_goes_through_matmul():
    """No ``@`` and no matmul/dot/tensordot/einsum call on arrays in the library outside
    matmul.py (the torch wrapper is torch's: its cuBLAS captures)."""
    package = Path(persistent_rnn.__file__).parent
    names = {"matmul", "dot", "tensordot", "einsum", "inner", "vdot"}
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "matmul.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            op = getattr(node, "op", None)
            if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(op, ast.MatMult):
                found.append(f"{path.name}:{node.lineno} @")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in names):
                found.append(f"{path.name}:{node.lineno} .{node.func.attr}(")
    assert not found, found


class _DeviceView:
    """A NumPy array seen as the CuPy array ``cublas_capture`` reads: ``data.ptr`` its address,
    everything else the array's own."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def __getattr__(self, name):
        return getattr(self.a, name)

    @property
    def T(self):
        return _DeviceView(self.a.T)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.a.__array_interface__["data"][0])


def _column_major(x: _DeviceView, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """``op(X)`` (rows x cols) as cuBLAS reads it from ``x``'s memory: X column-major with
    leading dimension ``ld`` (op 0), or its transpose (op 1)."""
    item, base = x.itemsize, x.a
    if op == 0:
        return as_strided(base, (rows, cols), (item, ld * item))
    return as_strided(base, (cols, rows), (item, ld * item)).T


# The products a planned call's chain records (call_plans): the input projection x W_ih^T,
# dW_ih = dgi^T x, dW_hh's two (dgh_0^T h0, dgh_{1:}^T y_{:-1}), dx = dgi W_ih, dh0 = dgh_0 W_hh
# - operands C-ordered, transposed views, row slices - and shapes with a 1.
_PRODUCTS = [
    lambda r: (r((8, 3)), r((12, 3)).T), lambda r: (r((8, 12)).T, r((8, 3))),
    lambda r: (r((2, 12))[0:1].T, r((1, 4))), lambda r: (r((3, 2, 12))[1:].reshape(-1, 12).T,
                                                       r((3, 2, 4))[:-1].reshape(-1, 4)),
    lambda r: (r((8, 12)), r((12, 3))), lambda r: (r((1, 12)), r((12, 4))),
    lambda r: (r((5, 1)), r((1, 7))), lambda r: (r((1, 9)), r((2, 9)).T)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("product", range(len(_PRODUCTS)))
def test_captured_cublas_problem_is_the_product(dtype, product):
    """``cublas_capture.gemm_problem`` (the column-major ``cublasGemmEx`` call ``cupy.matmul``
    makes) computes ``a @ b`` when cuBLAS's reading of the memory is carried out on the CPU."""
    rng = np.random.default_rng(product)
    a, b = _PRODUCTS[product](lambda shape: rng.standard_normal(shape).astype(dtype))
    out = np.empty((a.shape[0], b.shape[1]), dtype)
    op_1, op_2, m, n, k, first, ld_1, second, ld_2, ldc = cublas_capture.gemm_problem(
        _DeviceView(a), _DeviceView(b), _DeviceView(out))
    assert ldc == out.shape[1] and (m, n, k) == (out.shape[1], out.shape[0], a.shape[1])
    got = _column_major(first, op_1, m, k, ld_1) @ _column_major(second, op_2, k, n, ld_2)
    np.testing.assert_allclose(got.T, a @ b, rtol=1e-5 if dtype == np.float32 else 1e-12)


def test_captured_cublas_refuses_what_cupy_would_not_issue_as_one_gemm():
    """Where ``cupy.matmul`` reduces, copies an operand or writes a temporary, the captured
    call refuses (the chain's capture then fails and it runs launch by launch); bad operands
    get errors naming them; an empty product needs no call."""
    f = np.float32
    view = _DeviceView
    problem = cublas_capture.gemm_problem
    with pytest.raises(NotImplementedError, match="1 x 1"):
        problem(view(np.ones((1, 4), f)), view(np.ones((4, 1), f)), view(np.empty((1, 1), f)))
    with pytest.raises(NotImplementedError, match="strided operand"):
        problem(view(np.ones((4, 8), f)[:, :3]), view(np.ones((3, 2), f)),
                view(np.empty((4, 2), f)))
    with pytest.raises(NotImplementedError, match="strided out"):
        problem(view(np.ones((4, 3), f)), view(np.ones((3, 2), f)),
                view(np.empty((2, 4), f).T))
    shared = np.ones((4, 4), f)
    with pytest.raises(NotImplementedError, match="overlaps"):
        problem(view(shared), view(np.ones((4, 4), f)), view(shared))
    with pytest.raises(TypeError, match="two float32 or two float64"):
        problem(view(np.ones((4, 3), f)), view(np.ones((3, 2))), view(np.empty((4, 2), f)))
    with pytest.raises(ValueError, match=r"out: expected a float32 array of shape \(4, 2\)"):
        problem(view(np.ones((4, 3), f)), view(np.ones((3, 2), f)), view(np.empty((2, 4), f)))
    with pytest.raises(ValueError, match="matching inner sizes"):
        problem(view(np.ones((4, 3), f)), view(np.ones((2, 2), f)), view(np.empty((4, 2), f)))
    assert problem(view(np.ones((4, 0), f)), view(np.ones((0, 2), f)),
                   view(np.empty((4, 2), f))) is None


def _fake_cupy(monkeypatch, calls: list):
    """A CuPy stand-in for ``matmul._gemm_ex`` on the CPU: cuBLAS's binding records its
    ``gemmEx`` calls in ``calls`` (CuPy's cuBLAS library cannot load without a GPU)."""
    import cupy_backends.cuda.libs as libs
    cublas = types.SimpleNamespace(
        CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_POINTER_MODE_HOST=0, CUBLAS_COMPUTE_32F=68,
        CUBLAS_GEMM_DEFAULT=-1, getPointerMode=lambda handle: 0,
        gemmEx=lambda *args: calls.append(("cupy", args)))
    monkeypatch.setitem(vars(libs), "cublas", cublas)  # (its __getattr__ would load cuBLAS)
    runtime = types.SimpleNamespace(CUDA_R_16F=2, CUDA_R_16BF=14, CUDA_R_32F=0)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=runtime, device=types.SimpleNamespace(get_cublas_handle=lambda: 7)))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_a_captured_16_bit_product_issues_the_eager_gemm_ex(monkeypatch, dtype):
    """While a chain is captured, a 16-bit layer's input projection (``_gemm_ex``) issues cuBLAS's
    ``gemmEx`` through ``cublas_capture.gemm_ex`` with exactly the arguments CuPy's binding gets
    eagerly (the eager call's bits when replayed); what would allocate inside the capture (an
    operand to copy, an output cuBLAS cannot write in place) is refused, so the capture fails
    and the chain runs launch by launch."""
    calls: list = []
    cupy = _fake_cupy(monkeypatch, calls)
    monkeypatch.setattr(cublas_capture, "gemm_ex",
                        lambda cp, *args: calls.append(("captured", args)))
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(dtype) for s in ((12, 5), (39, 5)))
    out = np.empty((12, 39), np.float32)
    operands = (_DeviceView(x), _DeviceView(w).T, _DeviceView(out))
    matmul._gemm_ex(cupy, *operands, 39)
    monkeypatch.setattr(chain_graphs, "capturing", lambda: True)
    matmul._gemm_ex(cupy, *operands, 39)
    assert [c[0] for c in calls] == ["cupy", "captured"] and calls[0][1] == calls[1][1]
    with pytest.raises(NotImplementedError, match="strided 16-bit operand"):
        matmul._gemm_ex(cupy, _DeviceView(np.ones((4, 8), dtype)[:, ::2]),
                        _DeviceView(np.ones((4, 4), dtype)), _DeviceView(np.empty((4, 4),
                                                                                np.float32)), 4)
    with pytest.raises(NotImplementedError, match="out: cuBLAS cannot write it in place"):
        matmul.tensor_core_matmul(cupy, _DeviceView(x), _DeviceView(w).T,
                                  _DeviceView(np.empty((39, 12), np.float32)).T)


def test_the_captured_gemm_ex_calls_cublas_with_its_prototype(monkeypatch):
    """``cublas_capture.gemm_ex`` (what records a product into a captured chain) sets CuPy's
    handle to CuPy's current stream, then calls ``cublasGemmEx`` with CuPy's binding's arguments
    in cuBLAS's order, each as the prototype's C type (cublas_api.h: the handle and the six
    pointers 64-bit, the rest int); a cuBLAS status other than 0 raises, naming the call."""
    import ctypes
    prototype = ["handle", "transa", "transb", "m", "n", "k", "alpha*", "A*", "Atype", "lda",
                 "B*", "Btype", "ldb", "beta*", "C*", "Ctype", "ldc", "computeType", "algo"]
    assert [t for t in cublas_capture.GEMM_EX_ARGTYPES] == [
        ctypes.c_void_p if name == "handle" or name.endswith("*") else ctypes.c_int
        for name in prototype]
    calls: list = []

    def record(name, status=0):
        return lambda *args: (calls.append((name, args)), status)[1]
    library = types.SimpleNamespace(cublasSetStream_v2=record("stream"),
                                    cublasGemmEx=record("gemm"))
    monkeypatch.setattr(cublas_capture, "_library", lambda: library)
    stream = types.SimpleNamespace(ptr=0x7F00_0000_1000)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    handle, pointers = 0x5500_0000_2000, [0x7F10_0000_0000 + 64 * i for i in range(5)]
    args = (handle, 1, 0, 39, 12, 5, pointers[0], pointers[1], 2, 5, pointers[2], 2, 5,
            pointers[3], pointers[4], 0, 39, 68, -1)
    cublas_capture.gemm_ex(cupy, *args)
    assert [name for name, _ in calls] == ["stream", "gemm"]
    assert [a.value for a in calls[0][1]] == [handle, stream.ptr]
    passed = [a.value if isinstance(a, ctypes.c_void_p) else a for a in calls[1][1]]
    assert passed == list(args)
    assert [type(a) for a in calls[1][1]] == [
        ctypes.c_void_p if t is ctypes.c_void_p else int for t in cublas_capture.GEMM_EX_ARGTYPES]
    library.cublasGemmEx = record("gemm", status=13)
    with pytest.raises(RuntimeError, match="cublasGemmEx failed with cuBLAS status 13"):
        cublas_capture.gemm_ex(cupy, *args)


def _fake_cuda(monkeypatch, calls: list, capturing: list):
    """A CuPy stand-in for ``matmul.matmul`` on float32 arrays (``_DeviceView``s) on the CPU:
    ``cupy.matmul``, CuPy's cuBLAS binding and ``cublas_capture.gemm_ex`` record their calls in
    ``calls``; the current stream captures while ``capturing[0]`` (a chain's capture then)."""
    import sys
    from cupy._core import _routines_linalg  # noqa: F401  (CuPy's own setting, read as it is)
    import cupy_backends.cuda.libs as libs
    cublas = types.SimpleNamespace(
        CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_32F_PEDANTIC=69, CUBLAS_COMPUTE_32F_FAST_TF32=77,
        CUBLAS_COMPUTE_64F=70, CUBLAS_COMPUTE_64F_PEDANTIC=71, CUBLAS_GEMM_DEFAULT=-1,
        CUBLAS_GEMM_DEFAULT_TENSOR_OP=99, gemmEx=lambda *args: calls.append(("binding", args)))
    monkeypatch.setitem(vars(libs), "cublas", cublas)
    monkeypatch.setattr(cublas_capture, "gemm_ex",
                        lambda cp, *args: calls.append(("captured", args)))
    monkeypatch.setattr(chain_graphs, "capturing", lambda: capturing[0])
    stream = types.SimpleNamespace(is_capturing=lambda: capturing[0])
    cuda = types.SimpleNamespace(
        get_current_stream=lambda: stream, Device=lambda: types.SimpleNamespace(
            compute_capability="90"),
        runtime=types.SimpleNamespace(CUDA_R_32F=0, CUDA_R_64F=1),
        device=types.SimpleNamespace(get_cublas_handle=lambda: 7))
    fake = types.SimpleNamespace(cuda=cuda, matmul=lambda *a, **k: calls.append(("cupy", a)))
    monkeypatch.setitem(sys.modules, "cupy", fake)


@pytest.mark.parametrize("shape", [(12, 5, 39), (1, 5, 1)])
def test_tf32_products_pass_their_compute_type_eager_and_captured(monkeypatch, settings, shape):
    """With ``settings.allow_tf32`` a float32 product is cuBLAS's ``gemmEx`` with
    ``CUBLAS_COMPUTE_32F_FAST_TF32`` passed per call: eagerly through CuPy's binding (not
    ``cupy.matmul``, whose compute type is CuPy's process-wide setting), and while a chain is
    captured through ``cublas_capture.gemm_ex`` with the same arguments (a 1 x 1 product
    too: one GEMM both ways). Off, the eager product is ``cupy.matmul``'s and the captured one
    asks for CuPy's compute type (fp32 by default); float64 products take no TF32."""
    from cupy._core import _routines_linalg as linalg
    calls: list = []
    capturing = [False]
    _fake_cuda(monkeypatch, calls, capturing)
    m, k, n = shape
    rng = np.random.default_rng(0)

    def product(dtype):
        x, w = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (n, k)))
        out = np.empty((m, n), dtype)
        for capturing[0] in (False, True):
            matmul.matmul(_DeviceView(x), _DeviceView(w).T, _DeviceView(out))
        return [(where, args[:-2], None if where == "cupy" else args[-2])
                for where, args in calls[-2:]]

    import persistent_rnn as prnn
    prnn.configure(allow_tf32=True)
    (eager, args, compute), (captured, captured_args, captured_compute) = product(np.float32)
    assert (eager, captured) == ("binding", "captured") and args == captured_args
    assert compute == captured_compute == 77
    if m * n == 1:  # (cupy.matmul reduces a 1 x 1 product: refused under capture)
        return
    assert [(where, c) for where, _, c in product(np.float64)] == [("cupy", None), ("captured", 70)]
    prnn.configure(allow_tf32=False)
    cupys = 68 if linalg.get_compute_type(np.float32) != linalg.COMPUTE_TYPE_TF32 else 77
    assert [(where, c) for where, _, c in product(np.float32)] == [("cupy", None),
                                                                 ("captured", cupys)]


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_an_explicit_tf32_overrides_the_setting_eager_and_captured(monkeypatch, settings,
                                                                  allow_tf32):
    """``matmul(..., tf32=True)`` (a 16-bit layer's weight gradients) passes
    ``CUBLAS_COMPUTE_32F_FAST_TF32`` eagerly and captured whatever ``settings.allow_tf32`` says;
    ``tf32=False`` is ``cupy.matmul`` eagerly and CuPy's compute type captured, the setting on
    or off."""
    calls: list = []
    capturing = [False]
    _fake_cuda(monkeypatch, calls, capturing)
    persistent_rnn.configure(allow_tf32=allow_tf32)
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((12, 39), (5, 39)))
    out = np.empty((12, 5), np.float32)
    for tf32 in (True, False):
        for capturing[0] in (False, True):
            matmul.matmul(_DeviceView(x), _DeviceView(w).T, _DeviceView(out), tf32)
    from cupy._core import _routines_linalg as linalg
    cupys = 77 if linalg.get_compute_type(np.float32) == linalg.COMPUTE_TYPE_TF32 else 68
    assert [(where, None if where == "cupy" else args[-2]) for where, args in calls] == [
        ("binding", 77), ("captured", 77), ("cupy", None), ("captured", cupys)]
