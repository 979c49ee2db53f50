"""cuBLAS products recorded inside the library's own chain graphs, as ``cupy.matmul`` makes them.

CuPy's cuBLAS bindings set the handle's stream before every call and refuse a stream that is
being captured, although cuBLAS itself records its kernels under stream capture (CUDA 12.2 and
later allocate its workspace stream-ordered while capturing; PyTorch captures cuBLAS the same
way). A planned call's chain (``call_plans``, ``chain_graphs``) holds its input projection and its
gradient products, so while a chain is captured ``matmul.matmul`` calls here: the same
``cublasGemmEx`` that ``cupy.matmul`` issues for two 2-D operands - the same operand layout,
transposes, leading dimensions, compute type and algorithm, on CuPy's own handle - called
through the cuBLAS library CuPy loaded (``cuda.pathfinder``'s, never one found anew), with the
stream set by cuBLAS's own ``cublasSetStream``. A replayed chain then computes the bits of the
eager call it stands for (``tests/test_gpu_chain_graphs.py`` holds that on a GPU). A 16-bit
layer's input projection (``matmul.tensor_core_matmul``: 16-bit operands, fp32 output and
accumulation) issues its own ``gemmEx``, with the same arguments eager or captured: while a chain
is captured it calls ``gemm_ex`` here rather than CuPy's binding.

With ``settings.allow_tf32`` (or ``matmul.matmul``'s ``tf32``: a 16-bit layer's weight gradients)
a float32 product is the library's own call, not ``cupy.matmul``'s:
the same ``cublasGemmEx`` with ``CUBLAS_COMPUTE_32F_FAST_TF32`` passed as its compute type
(``matmul(..., tf32=True)``), eagerly through CuPy's binding (``matmul.tf32_matmul``) and while a
chain is captured through ``gemm_ex``, so that the replay computes the eager call's bits. Passed
per call, it leaves CuPy's process-wide compute type (``CUPY_TF32``,
``cupy._core.set_compute_type``: CuPy 14.2 has no other) to the user's own ``cupy.matmul``.

What ``cupy.matmul`` would not compute as one GEMM (a 1 x 1 result, which it reduces instead;
an operand it would copy first; an output it would write through a temporary) raises
``NotImplementedError``: the capture then fails and that chain runs launch by launch
(``chain_graphs``), with cupy's own products.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache, partial
from typing import Any

import numpy as np

Array = Any  # cupy.ndarray

_ONE = {np.dtype(np.float32): np.ones(1, np.float32), np.dtype(np.float64): np.ones(1, np.float64)}
_ZERO = {np.dtype(np.float32): np.zeros(1, np.float32),
         np.dtype(np.float64): np.zeros(1, np.float64)}


def matmul(cupy, a: Array, b: Array, out: Array, tf32: bool = False) -> Array:
    """``out = a @ b`` (2-D float32 or float64 operands of one dtype, ``out`` C-contiguous of the
    result's shape and dtype) by ``cublasGemmEx`` on the current stream, as ``cupy.matmul``
    (module docstring); ``tf32``: float32 operands in TF32 (``CUBLAS_COMPUTE_32F_FAST_TF32``).
    Through ``gemm_ex`` where the stream is being captured, else CuPy's binding. TypeError /
    ValueError naming the argument for operands it does not take; NotImplementedError where
    ``cupy.matmul`` would not issue one GEMM."""
    problem = gemm_problem(a, b, out, tf32)
    if problem is None:  # an empty product: what cupy.matmul writes (no cuBLAS call)
        if out.size:
            out.fill(0)
        return out
    from cupy_backends.cuda.libs import cublas
    kind, compute = _types(cupy, cublas, a.dtype, tf32)
    algo = (cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP if int(cupy.cuda.Device().compute_capability) >= 80
            else cublas.CUBLAS_GEMM_DEFAULT)
    gemm = (partial(gemm_ex, cupy) if cupy.cuda.get_current_stream().is_capturing()
            else cublas.gemmEx)
    op_1, op_2, m, n, k, first, ld_1, second, ld_2, ldc = problem
    gemm(cupy.cuda.device.get_cublas_handle(), op_1, op_2, m, n, k,
         _ONE[a.dtype].ctypes.data, first.data.ptr, kind, ld_1, second.data.ptr, kind, ld_2,
         _ZERO[a.dtype].ctypes.data, out.data.ptr, kind, ldc, compute, algo)
    return out


def gemm_ex(cupy, handle: int, op_1: int, op_2: int, m: int, n: int, k: int, alpha: int,
            a: int, a_type: int, lda: int, b: int, b_type: int, ldb: int, beta: int, c: int,
            c_type: int, ldc: int, compute: int, algo: int) -> None:
    """``cublasGemmEx`` with CuPy's binding's arguments (pointers as ints), on CuPy's current
    stream set by cuBLAS's own ``cublasSetStream`` (module docstring): what records the product
    into a stream being captured."""
    library = _library()
    _check(library.cublasSetStream_v2(ctypes.c_void_p(handle),
                                      ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)),
           "cublasSetStream")
    _check(library.cublasGemmEx(
        ctypes.c_void_p(handle), op_1, op_2, m, n, k, ctypes.c_void_p(alpha), ctypes.c_void_p(a),
        a_type, lda, ctypes.c_void_p(b), b_type, ldb, ctypes.c_void_p(beta), ctypes.c_void_p(c),
        c_type, ldc, compute, algo), "cublasGemmEx")


def gemm_problem(a: Array, b: Array, out: Array, tf32: bool = False) -> tuple | None:
    """The column-major problem ``cupy.matmul`` hands ``cublasGemmEx`` for ``out = a @ b``:
    ``(op_1, op_2, m, n, k, first, ld_1, second, ld_2, ldc)`` of ``C = op_1(first) op_2(second)``
    (ops 0: N, 1: T), or ``None`` for an empty product. cuBLAS sees the row-major ``out`` (r, c)
    as the column-major ``out^T`` (c, r) = ``b^T a^T``: CuPy takes ``a^T`` (k, r) and ``b``
    (k, c), each as it lies in memory (``_operand``), and computes
    ``out^T = op(b) op(a^T)``. ``tf32``: the library's own TF32 call, which ``cupy.matmul``
    never makes: a 1 x 1 product is one GEMM too."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a, b: expected 2-D operands of matching inner sizes, got "
                         f"{a.shape} @ {b.shape}")
    if a.dtype != b.dtype or a.dtype not in _ONE:
        raise TypeError(f"a, b: a captured cuBLAS product takes two float32 or two float64 "
                        f"operands, got {a.dtype} and {b.dtype}")
    (rows, k), cols = a.shape, b.shape[1]
    if out.shape != (rows, cols) or out.dtype != a.dtype:
        raise ValueError(f"out: expected a {a.dtype} array of shape {(rows, cols)}, got "
                         f"{out.dtype} {out.shape}")
    if not out.flags.c_contiguous:
        raise NotImplementedError("a strided out: cupy.matmul writes a temporary")
    if not (rows and cols and k):
        return None
    if rows == 1 and cols == 1 and not tf32:
        raise NotImplementedError("a 1 x 1 product: cupy.matmul computes it as a reduction")
    if overlaps(out, a) or overlaps(out, b):
        raise NotImplementedError("out overlaps an operand: cupy.matmul writes a temporary")
    a_t, op_a, ld_a = _operand(a.T, 0)
    b, op_b, ld_b = _operand(b, 1)
    return op_b, op_a, cols, rows, k, b, ld_b, a_t, ld_a, cols


def _operand(x: Array, trans: int) -> tuple[Array, int, int]:
    """An operand as CuPy's ``_mat_to_cublas_contiguous`` gives it: Fortran-ordered as it is
    (op ``trans``, leading dimension its column stride, at least its rows), C-ordered as its
    transpose (op ``1 - trans``, its row stride); any other layout CuPy would copy first."""
    item = x.itemsize
    if x.flags.f_contiguous:
        return x, trans, max(x.strides[1] // item, x.shape[0])
    if not x.flags.c_contiguous:
        raise NotImplementedError("a strided operand: cupy.matmul copies it first")
    return x, 1 - trans, x.strides[0] // item


def overlaps(x: Array, y: Array) -> bool:
    """Whether the memory spans of two arrays may share bytes (CuPy's ``may_share_bounds``)."""
    def span(a: Array) -> tuple[int, int]:
        low = a.data.ptr + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
        high = a.data.ptr + sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0)
        return low, high + a.itemsize
    (lo_x, hi_x), (lo_y, hi_y) = span(x), span(y)
    return x.size > 0 and y.size > 0 and lo_x < hi_y and lo_y < hi_x


def _types(cupy, cublas, dtype, tf32: bool) -> tuple[int, int]:
    """``(cudaDataType, cublasComputeType)`` of the call for ``dtype``: with ``tf32`` (float32)
    TF32's, whatever CuPy's setting; otherwise ``cupy.matmul``'s under its current compute-type
    setting (``CUPY_TF32``, ``cupy._core.set_compute_type``)."""
    if tf32:
        return cupy.cuda.runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F_FAST_TF32
    from cupy._core import _routines_linalg as linalg
    setting = linalg.get_compute_type(dtype)
    if dtype == np.float64:
        pedantic = setting == linalg.COMPUTE_TYPE_PEDANTIC
        return (cupy.cuda.runtime.CUDA_R_64F,
                cublas.CUBLAS_COMPUTE_64F_PEDANTIC if pedantic else cublas.CUBLAS_COMPUTE_64F)
    compute = (cublas.CUBLAS_COMPUTE_32F_PEDANTIC if setting == linalg.COMPUTE_TYPE_PEDANTIC
               else cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if setting == linalg.COMPUTE_TYPE_TF32
               else cublas.CUBLAS_COMPUTE_32F)
    return cupy.cuda.runtime.CUDA_R_32F, compute


# cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
# ldc, computeType, algo) (cublas_api.h, as CuPy's binding calls it): handle and pointers 64-bit,
# enums and sizes int
GEMM_EX_ARGTYPES = (
    ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with cuBLAS status {status}")


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The cuBLAS library CuPy loaded (``cuda.pathfinder`` caches what it found for CuPy),
    opened without loading anything new (``RTLD_NOLOAD``)."""
    from cuda import pathfinder
    loaded = pathfinder.load_nvidia_dynamic_lib("cublas")
    library = ctypes.CDLL(loaded.abs_path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    for name in ("cublasSetStream_v2", "cublasGemmEx"):
        getattr(library, name).restype = ctypes.c_int
    library.cublasSetStream_v2.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    library.cublasGemmEx.argtypes = GEMM_EX_ARGTYPES
    return library

