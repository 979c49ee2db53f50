"""The capture-safe matmul (persistent_rnn/matmul.py, cuda_src/matmul.cu) without a GPU: the
kernel run by the CPU emulation against float64 NumPy products on strided, non-square operands
(a sabotaged kernel fails the same check), its NVRTC build, the argument checks, and that every
product the library issues on arrays goes through ``matmul.matmul``."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import persistent_rnn
from persistent_rnn import emulate, matmul
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
