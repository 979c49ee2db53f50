"""Every matrix product the library issues on arrays, safe inside a CUDA graph capture.

CuPy refuses every cuBLAS call while the current stream is being captured
(``NotImplementedError: calling cuBLAS API during stream capture is currently unsupported``), so a
forward captured by the caller and the GEMM path's recorded step loops (``step_graphs``) cannot
use ``cupy.matmul`` then. ``matmul(a, b, out=None)`` dispatches:

* NumPy arrays: ``numpy.matmul``;
* CuPy arrays, the current stream not capturing: ``cupy.matmul`` (cuBLAS: speed and bits as
  before);
* CuPy arrays, the current stream capturing: the library's own tiled GEMM,
  ``cuda_src/matmul.cu`` (fp32 sums for float32, fp64 for float64; strided operands, so
  transposes and views are not copied), which rounds differently from cuBLAS within the usual
  fp round-off of a K-term sum.

The kernel path takes 2-D float32 or float64 operands of one dtype (what the library's paths
issue; its 16-bit layers compute on float32 arrays); anything else under capture is a TypeError
or ValueError naming the argument.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

import numpy as np

from ._sources import cuda_src_dir, read_source

Array = Any  # numpy.ndarray or cupy.ndarray

TILE = 32  # rows and columns of C per CTA (MM_TILE of matmul.cu)
THREADS = 256  # threads per CTA (MM_THREADS)
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_MAX_INT32 = 2**31 - 1


def matmul(a: Array, b: Array, out: Array | None = None) -> Array:
    """``a @ b`` (into ``out`` where given), capture-safe on CuPy (module docstring)."""
    if isinstance(a, np.ndarray):  # (first and without calls: the CPU paths' hot loop)
        return np.matmul(a, b, out=out)
    cupy = sys.modules["cupy"]  # a non-NumPy operand of the library is a CuPy array
    if not cupy.cuda.get_current_stream().is_capturing():
        return cupy.matmul(a, b, out=out)
    return captured_matmul(cupy, a, b, out)


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
    capture (a caller that will capture its first products: the resident decoder)."""
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
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a, b: the capture-safe matmul takes 2-D operands, got {a.ndim}-D and "
                         f"{b.ndim}-D")
    if a.dtype != b.dtype or a.dtype not in _SUFFIX:
        raise TypeError(f"a, b: the capture-safe matmul takes two float32 or two float64 "
                        f"operands, got {a.dtype} and {b.dtype}")
    (m, k), (k_b, n) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"a, b: inner sizes differ, {a.shape} @ {b.shape}")
    if max(m, n, k) > _MAX_INT32 or -(-m // TILE) * -(-n // TILE) > _MAX_INT32:
        raise ValueError(f"a, b: {a.shape} @ {b.shape} is too large for the capture-safe matmul")
    return m, n, k, a.dtype


@lru_cache(maxsize=None)
def _module():
    """The compiled ``matmul.cu`` (one NVRTC build per process, per device via CuPy's cache)."""
    import cupy
    return cupy.RawModule(code=read_source("matmul.cu"),
                          options=("-I" + str(cuda_src_dir()), "--std=c++17"))
