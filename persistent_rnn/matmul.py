"""Every matrix product the library issues on arrays, safe inside a CUDA graph capture.

CuPy refuses every cuBLAS call while the current stream is being captured
(``NotImplementedError: calling cuBLAS API during stream capture is currently unsupported``), so a
forward captured by the caller and the GEMM path's recorded step loops (``step_graphs``) cannot
use ``cupy.matmul`` then. ``matmul(a, b, out=None)`` dispatches:

* NumPy arrays: ``numpy.matmul``;
* CuPy arrays, the current stream not capturing: ``cupy.matmul`` (cuBLAS: speed and bits as
  before);
* CuPy arrays, the current stream capturing one of the library's own chains
  (``chain_graphs.capturing()``: a planned call's input projection and gradients): cuBLAS's
  ``gemmEx`` called as ``cupy.matmul`` calls it (``cublas_capture``), so that the replayed
  graph computes the eager call's bits;
* CuPy arrays, the current stream capturing anything else (the caller's capture, the GEMM
  path's step graphs): the library's own tiled GEMM,
  ``cuda_src/matmul.cu`` (fp32 sums for float32, fp64 for float64; strided operands, so
  transposes and views are not copied), which rounds differently from cuBLAS within the usual
  fp round-off of a K-term sum.

The kernel path takes 2-D float32 or float64 operands of one dtype; anything else under
capture is a TypeError or ValueError naming the argument.

With ``settings.allow_tf32`` (docs/api.md, "TF32") a product of two float32 operands is taken in
TF32, as ``torch.backends.cuda.matmul.allow_tf32`` takes torch's, and with ``matmul(...,
tf32=True)`` whatever the setting (a 16-bit layer's weight gradients, ``functional.gradient_tf32``):

* NumPy arrays: ``numpy.matmul`` of the operands rounded to TF32 (``tf32_rounded``: what the
  tensor cores take), so the CPU emulation computes what the GPU does up to the order of the sums
  (and cuBLAS's own rounding of the operands, which it does not document);
* CuPy arrays, not capturing: cuBLAS ``gemmEx`` with ``CUBLAS_COMPUTE_32F_FAST_TF32`` passed as
  the call's compute type (``tf32_matmul``), not ``cupy.matmul``: CuPy's own TF32 setting is
  process-wide, and the user's ``cupy.matmul`` calls keep theirs;
* CuPy arrays, capturing one of the library's chains: the same call, recorded
  (``cublas_capture.matmul`` with ``tf32``);
* CuPy arrays, capturing anything else: ``captured_matmul``, fp32 as before.

``matmul_half(a, b, half, out=None)`` is the product of 16-bit operands (a 16-bit layer's input
projection), float32 out; it dispatches:

* NumPy arrays: ``numpy.matmul`` of their float32 values (exact: what the CPU emulation always
  computed);
* CuPy arrays, not capturing: cuBLAS ``gemmEx`` on the tensor cores, 16-bit operands, fp32
  accumulation and output (``CUBLAS_COMPUTE_32F``); fp16 and bf16 products are exact in fp32,
  so this is the fp32 GEMM of the converted operands up to the order of the sums;
* CuPy arrays, the current stream capturing one of the library's own chains (a planned 16-bit
  call's input projection, ``call_plans``): the same ``gemmEx`` with the same arguments, issued
  through ``cublas_capture.gemm_ex`` (recorded: the eager call's bits); what would allocate (a
  float32 operand to narrow, one to copy, an output cuBLAS cannot write in place, no output)
  raises ``NotImplementedError`` - the capture then fails and the chain runs launch by launch;
* CuPy arrays, capturing anything else: ``captured_matmul`` of their float32 values.
"""
from __future__ import annotations

import sys
from functools import lru_cache, partial
from typing import Any

import numpy as np

from . import chain_graphs, cublas_capture, settings
from .buffers import workspace
from ._sources import cuda_src_dir, read_source
from .halves import half_dtype, narrow, widen

Array = Any  # numpy.ndarray or cupy.ndarray

TILE = 32  # rows and columns of C per CTA (MM_TILE of matmul.cu)
THREADS = 256  # threads per CTA (MM_THREADS)
DEFINES = {"PRNN_MM_TILE": TILE, "PRNN_MM_THREADS": THREADS}  # matmul.cu's shape: from here only
_F32 = np.dtype(np.float32)
_SUFFIX = {_F32: "f32", np.dtype(np.float64): "f64"}
_MAX_INT32 = 2**31 - 1
_CUDA_TYPES = {"float16": "CUDA_R_16F", "bfloat16": "CUDA_R_16BF"}  # cudaDataType names
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # gemmEx's alpha and beta (host)


def matmul(a: Array, b: Array, out: Array | None = None, tf32: bool | None = None) -> Array:
    """``a @ b`` (into ``out`` where given), capture-safe on CuPy; two float32 operands in TF32
    where ``tf32``, ``None`` meaning ``settings.allow_tf32`` (module docstring)."""
    if tf32 is None:
        tf32 = settings.current().allow_tf32
    tf32 = tf32 and a.dtype == _F32 and b.dtype == _F32
    if isinstance(a, np.ndarray):  # (first: the CPU paths' hot loop)
        if not tf32:
            return np.matmul(a, b, out=out)
        return np.matmul(tf32_rounded(a, workspace(np, "tf32 a", a.shape, _F32)),
                         tf32_rounded(b, workspace(np, "tf32 b", b.shape, _F32)), out=out)
    cupy = sys.modules["cupy"]  # a non-NumPy operand of the library is a CuPy array
    if not cupy.cuda.get_current_stream().is_capturing():
        return tf32_matmul(cupy, a, b, out) if tf32 else cupy.matmul(a, b, out=out)
    if chain_graphs.capturing() and out is not None:
        return cublas_capture.matmul(cupy, a, b, out, tf32)
    return captured_matmul(cupy, a, b, out)


def matmul_steps(a: Array, w: Array, out: Array | None = None) -> Array:
    """``a`` (T, B, K) @ ``w`` (K, N) as one 2-D GEMM over all steps -> (T, B, N) (into
    ``out``, (T*B, N), where given)."""
    steps, batch, width = a.shape
    return matmul(a.reshape(steps * batch, width), w, out).reshape(steps, batch, w.shape[1])


def tf32_rounded(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A float32 array's values rounded to TF32 as the tensor cores take them: to a 10-bit
    mantissa, to nearest with ties away from zero (``cvt.rna.tf32.f32``), NaN kept NaN - the
    NumPy counterpart of ``hw.cuh``'s ``prnn_tf32_bits`` (emulation.h's bit arithmetic). Into
    ``out`` (float32, ``x``'s shape) where given: ``matmul`` rounds its operands into
    workspaces, so that an emulated call allocates nothing for it (but where a NaN or opposite
    infinities make ``x``'s sum NaN: then a mask finds the NaN)."""
    rounded = np.empty(x.shape, np.float32) if out is None else out
    bits = rounded.view(np.uint32)
    np.add(x.view(np.uint32), np.uint32(0x1000), out=bits)
    np.bitwise_and(bits, np.uint32(0xFFFFE000), out=bits)
    if np.isnan(x.sum(dtype=np.float32)):  # (the rounding can carry a NaN to inf or a sign)
        bits[np.isnan(x)] = 0x7FFFFFFF
    return rounded


def tf32_matmul(cupy, a: Array, b: Array, out: Array | None = None) -> Array:
    """``a @ b`` of two float32 CuPy arrays in TF32, eagerly: the ``cublasGemmEx`` a captured
    chain records (``cublas_capture.matmul`` with ``tf32``), issued through CuPy's binding. An
    operand cuBLAS does not read as it lies is copied C-contiguous first, and an output it
    cannot write in place (strided, or sharing an operand's memory) is written through a
    temporary - as ``cupy.matmul`` does; the capture refuses both (nothing may allocate)."""
    m, n, _ = _sizes(a, b)
    a, b = (x if x.flags.c_contiguous or x.flags.f_contiguous else cupy.ascontiguousarray(x)
            for x in (a, b))
    direct = (out is not None and out.flags.c_contiguous
              and not cublas_capture.overlaps(out, a) and not cublas_capture.overlaps(out, b))
    target = out if direct else cupy.empty((m, n), np.float32)
    cublas_capture.matmul(cupy, a, b, target, tf32=True)
    if out is None or target is out:
        return target
    out[...] = target
    return out


def matmul_half(a: Array, b: Array, half: str, out: Array | None = None) -> Array:
    """``a @ b`` of 16-bit operands as float32 (into ``out``, float32, where given), by the
    module docstring's dispatch. ``a``, ``b``: 2-D arrays of ``half`` ("float16", "bfloat16"),
    or float32 arrays holding values of it (a lower layer's output: narrowed, exactly, where the
    tensor cores take it). TypeError / ValueError naming the argument otherwise."""
    dtype = half_dtype(half)
    for name, x in (("a", a), ("b", b)):
        if x.dtype != dtype and x.dtype != np.float32:
            raise TypeError(f"{name}: matmul_half takes {half} (or float32 holding {half} values) "
                            f"operands, got {x.dtype}")
    if isinstance(a, np.ndarray):
        return np.matmul(widen(a), widen(b), out=out)
    cupy = sys.modules["cupy"]
    if not cupy.cuda.get_current_stream().is_capturing():
        return tensor_core_matmul(cupy, narrow(a, half), narrow(b, half), out)
    if chain_graphs.capturing():  # (nothing may be allocated: the graph would keep it)
        if out is None or a.dtype != dtype or b.dtype != dtype:
            raise NotImplementedError("a captured 16-bit product takes 16-bit operands and an "
                                      "output (a conversion or a new array would allocate)")
        return tensor_core_matmul(cupy, a, b, out)
    return captured_matmul(cupy, widen(a), widen(b), out)


def tensor_core_matmul(cupy, a: Array, b: Array, out: Array | None = None) -> Array:
    """``a @ b`` of two CuPy arrays of one 16-bit dtype as float32, by cuBLAS ``gemmEx``
    (tensor cores, fp32 accumulation) on the current stream; ``out``: float32 (m, n)."""
    m, n, k = _sizes(a, b)
    if a.dtype != b.dtype or a.dtype.name not in _CUDA_TYPES:
        raise TypeError(f"a, b: the tensor-core matmul takes two float16 or two bfloat16 "
                        f"operands, got {a.dtype} and {b.dtype}")
    if out is None:
        out = cupy.empty((m, n), np.float32)
    elif out.shape != (m, n) or out.dtype != np.float32:
        raise ValueError(f"out: expected shape {(m, n)} and dtype float32, got {out.shape} "
                         f"and {out.dtype}")
    rows = _row_stride(out)  # cuBLAS writes rows of a stride; anything else via a copy
    if rows is None and chain_graphs.capturing():
        raise NotImplementedError("out: cuBLAS cannot write it in place (a temporary would be "
                                  "allocated inside a captured chain)")
    target = out if rows is not None else cupy.empty((m, n), np.float32)
    if m and n:
        if k == 0:  # an empty sum: zeros (cuBLAS would be asked for a 0-deep product)
            target.fill(0)
        else:
            _gemm_ex(cupy, a, b, target, rows or max(n, 1))
    if target is not out:
        out[...] = target
    return out


def _gemm_ex(cupy, a: Array, b: Array, out: Array, ldc: int) -> None:
    """``out = a @ b`` through ``cublasGemmEx`` (``_column_major_problem``), alpha 1 and beta 0
    from host memory, on the handle CuPy keeps per device: CuPy's binding, or while a chain is
    captured ``cublas_capture.gemm_ex`` with the same arguments (CuPy's refuses a capture)."""
    from cupy_backends.cuda.libs import cublas
    op_1, op_2, m, n, k, first, ld_1, second, ld_2, c, ldc = _column_major_problem(
        cupy, cublas, a, b, out, ldc)
    gemm = (partial(cublas_capture.gemm_ex, cupy) if chain_graphs.capturing()
            else cublas.gemmEx)
    kind = getattr(cupy.cuda.runtime, _CUDA_TYPES[a.dtype.name])
    handle = cupy.cuda.device.get_cublas_handle()  # (each cuBLAS call takes CuPy's current stream)
    mode = cublas.getPointerMode(handle)
    if mode != cublas.CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        gemm(handle, op_1, op_2, m, n, k, _ONE.ctypes.data, first.data.ptr, kind, ld_1,
             second.data.ptr, kind, ld_2, _ZERO.ctypes.data, c.data.ptr,
             cupy.cuda.runtime.CUDA_R_32F, ldc, cublas.CUBLAS_COMPUTE_32F,
             cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        if mode != cublas.CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(handle, mode)


def _column_major_problem(cupy, cublas, a: Array, b: Array, out: Array, ldc: int) -> tuple:
    """cuBLAS's arguments for ``out = a @ b``: ``(op_1, op_2, m', n', k, first, ld_1, second,
    ld_2, out, ldc)`` of ``C = op_1(first) op_2(second)``. cuBLAS is column-major: the
    row-major ``out`` (m, n) of row stride ``ldc`` is the column-major ``out^T`` (n, m), so it
    computes ``out^T = b^T a^T``, each operand's memory read as the column-major matrix it is
    (``_operand``)."""
    (m, k), n = a.shape, b.shape[1]
    b, op_b, ldb = _operand(cupy, b, cublas)
    a, op_a, lda = _operand(cupy, a, cublas)
    return op_b, op_a, n, m, k, b, ldb, a, lda, out, ldc


def _operand(cupy, x: Array, cublas) -> tuple[Array, int, int]:
    """``(x, op, ld)``: a 2-D operand (r, c) for ``_gemm_ex``, which needs its transpose in
    column-major order. Rows of a stride (``ld >= c``) are that transpose as they are (op N);
    columns of a stride (a transposed view, ``ld >= r``) are ``x`` itself (op T); anything else
    is copied contiguous first (by its 16 bits: no arithmetic on the dtype)."""
    item = x.itemsize
    (r, c), (s0, s1) = x.shape, (x.strides[0] // item, x.strides[1] // item)
    if (s1 == 1 or c <= 1) and (r <= 1 or s0 >= max(c, 1)):
        return x, cublas.CUBLAS_OP_N, max(c, 1) if r <= 1 else s0
    if (s0 == 1 or r <= 1) and (c <= 1 or s1 >= max(r, 1)):
        return x, cublas.CUBLAS_OP_T, max(r, 1) if c <= 1 else s1
    if chain_graphs.capturing():
        raise NotImplementedError("a strided 16-bit operand: its copy would be allocated inside "
                                  "a captured chain")
    return cupy.ascontiguousarray(x.view(np.uint16)).view(x.dtype), cublas.CUBLAS_OP_N, max(c, 1)


def _row_stride(out: Array) -> int | None:
    """The row stride (in elements) of an (m, n) ``out`` whose rows cuBLAS can write, else
    ``None``."""
    (m, n), (s0, s1) = out.shape, (out.strides[0] // out.itemsize, out.strides[1] // out.itemsize)
    if (s1 == 1 or n <= 1) and (m <= 1 or s0 >= max(n, 1)):
        return max(n, 1) if m <= 1 else s0
    return None


def captured_matmul(cupy, a: Array, b: Array, out: Array | None = None) -> Array:
    """``a @ b`` on CuPy arrays with ``matmul.cu``'s kernel (no cuBLAS call): enqueued on the
    current stream, so recorded where that stream is being captured."""
    m, n, k, dtype = _checked(a, b)
    if out is None:
        out = cupy.empty((m, n), dtype)
    elif out.shape != (m, n) or out.dtype != dtype:
        raise ValueError(f"out: expected shape {(m, n)} and dtype {dtype}, got {out.shape} "
                         f"and {out.dtype}")
    tiles = -(-m // TILE) * -(-n // TILE)
    if tiles:  # an empty product launches nothing: CUDA refuses a grid of 0 blocks
        kernel = _module().get_function(f"prnn_matmul_{_SUFFIX[dtype]}")
        kernel((tiles,), (THREADS,), (a, b, out, *launch_sizes(a, b, out)),
               shared_mem=shared_bytes(dtype))
    return out


def load_captured_kernel(dtype) -> None:
    """Compile and load the kernel ``matmul`` runs under capture for ``dtype`` now, outside any
    capture (for a caller about to capture its first products)."""
    _module().get_function(f"prnn_matmul_{_SUFFIX[np.dtype(dtype)]}")


def launch_sizes(a: Array, b: Array, out: Array) -> tuple:
    """The kernel's scalar arguments: m, n, k (int32) and the element strides (int64) of
    ``a``, ``b``, ``out``, row then column."""
    strides = [np.int64(s // x.itemsize) for x in (a, b, out) for s in x.strides]
    return (np.int32(a.shape[0]), np.int32(b.shape[1]), np.int32(a.shape[1]), *strides)


def shared_bytes(dtype) -> int:
    """The kernel's dynamic shared memory: one padded TILE x TILE slice each of A and B."""
    return 2 * TILE * (TILE + 1) * np.dtype(dtype).itemsize


def _checked(a: Array, b: Array) -> tuple[int, int, int, np.dtype]:
    """``(m, n, k, dtype)`` of ``a @ b`` for the kernel; TypeError / ValueError otherwise."""
    if a.dtype != b.dtype or a.dtype not in _SUFFIX:
        raise TypeError(f"a, b: the capture-safe matmul takes two float32 or two float64 "
                        f"operands, got {a.dtype} and {b.dtype}")
    m, n, k = _sizes(a, b)
    if -(-m // TILE) * -(-n // TILE) > _MAX_INT32:
        raise ValueError(f"a, b: {a.shape} @ {b.shape} is too large for the capture-safe matmul")
    return m, n, k, a.dtype


def _sizes(a: Array, b: Array) -> tuple[int, int, int]:
    """``(m, n, k)`` of ``a @ b``: 2-D operands of matching inner sizes, each size a 32-bit
    int (what the kernel and cuBLAS take); ValueError naming the operands otherwise."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a, b: the library's matmul takes 2-D operands, got {a.ndim}-D and "
                         f"{b.ndim}-D")
    (m, k), (k_b, n) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"a, b: inner sizes differ, {a.shape} @ {b.shape}")
    if max(m, n, k) > _MAX_INT32:
        raise ValueError(f"a, b: {a.shape} @ {b.shape} is too large for a 32-bit GEMM")
    return m, n, k


@lru_cache(maxsize=None)
def _module():
    """The compiled ``matmul.cu`` (one NVRTC build per process, per device via CuPy's cache)."""
    import cupy
    return cupy.RawModule(code=read_source("matmul.cu"), options=compile_options())


def compile_options() -> tuple[str, ...]:
    """NVRTC's options for ``matmul.cu``: the include path and its shape (``DEFINES``)."""
    return ("-I" + str(cuda_src_dir()), "--std=c++17",
            *(f"-D{name}={value}" for name, value in DEFINES.items()))
