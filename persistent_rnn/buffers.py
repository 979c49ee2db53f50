"""Buffers of one layer-direction's recurrence and the array helpers both engines use.

Written once for NumPy and CuPy (the array module of the inputs decides). Buffers (T steps,
batch B, hidden H, cell with G gates, S saved activations per unit):

* ``y``     (T, B, H)   h_t for every step (frozen past a sequence's length), so ``y[T-1]``
                        is the final state; the layer zeroes outputs past lengths afterwards.
                        With an LSTM projection of size P: (T, B, P), r_t = W_hr h_t.
* ``hs``    (T, B, H)   the cell's own h_t, with a projection only.
* ``cs``    (T, B, H)   c_t for every step (LSTM only, else ``None``), frozen likewise.
* ``saved`` (T, B, S*H) activations the cell's backward needs.
* ``dgi``, ``dgh`` (T, B, G*H) gradients of the input and recurrent pre-activations (the same
  array unless the cell is GRU).
* ``drs``   (T, B, P)   with a projection: the gradient of each r_t, zero past a length.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from .cells import CellSpec
from .matmul import matmul

Array = Any  # numpy.ndarray or cupy.ndarray


def array_module(*arrays: Array):
    """Return ``cupy`` if any of ``arrays`` is a CuPy array, else ``numpy``.

    Does not import CuPy: a CuPy array can only exist once CuPy has been imported.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        for a in arrays:  # (a loop, not any(...): no generator to run per array, per call)
            if isinstance(a, cupy.ndarray):
                return cupy
    return np


def allocate_forward(cell: CellSpec, gi: Array,
                     proj_size: int = 0) -> tuple[Array, Array | None, Array]:
    """Allocate ``(y, cs, saved)`` for the forward recurrence over ``gi`` (T, B, G*H); ``y`` is
    ``proj_size`` wide where that is not 0 (an LSTM projection)."""
    xp = array_module(gi)
    steps, batch, width = gi.shape
    hidden = width // cell.gates
    y = xp.empty((steps, batch, proj_size or hidden), dtype=gi.dtype)
    cs = xp.empty((steps, batch, hidden), gi.dtype) if cell.has_cell_state else None
    saved = xp.empty((steps, batch, cell.saved * hidden), dtype=gi.dtype)
    return y, cs, saved


def allocate_backward(cell: CellSpec, dy: Array, hidden: int | None = None) -> tuple[Array, Array]:
    """Allocate ``(dgi, dgh)`` (T, B, G*H) for the backward recurrence (one array unless GRU);
    ``hidden``: H where ``dy`` is not H wide (an LSTM projection)."""
    xp = array_module(dy)
    steps, batch, width = dy.shape
    hidden = hidden or width
    dgi = xp.empty((steps, batch, cell.gates * hidden), dtype=dy.dtype)
    return dgi, (xp.empty_like(dgi) if cell.separate_dgh else dgi)


def full_lengths(xp, lengths: Array | None, batch: int, steps: int) -> Array:
    """``lengths`` as contiguous int32 on ``xp`` (what the kernels read, never write); ``None``
    means every sequence runs all ``steps`` (``constant_ints``)."""
    if lengths is None:
        return constant_ints(xp, batch, steps)
    return xp.ascontiguousarray(xp.asarray(lengths, dtype=np.int32))


_CONSTANTS: dict[tuple, Array] = {}
_CONSTANTS_LOCK = threading.Lock()
MAX_CONSTANTS = 1024  # a bound: the sequence lengths of a long run with varying T


def constant_ints(xp, count: int, value: int) -> Array:
    """An int32 array of ``count`` times ``value`` for the kernels to read (never to write). On
    a GPU it is made once per (device, count, value) and shared: no allocation and fill per
    call, and the same address call after call (so a chain graph's key repeats); NumPy: a new
    array (as cheap as a lookup)."""
    if xp is np:
        return np.full(count, value, np.int32)
    key = (xp.cuda.Device().id, count, value)
    with _CONSTANTS_LOCK:
        found = _CONSTANTS.get(key)
        if found is None:
            if len(_CONSTANTS) >= MAX_CONSTANTS:
                _CONSTANTS.clear()
            found = _CONSTANTS[key] = xp.full(count, value, np.int32)
        return found


def active_steps(xp, steps: int, lengths: Array | None) -> Array | None:
    """(T, B, 1) booleans: step ``t`` of sequence ``b`` is within its length (``None``: all are)."""
    if lengths is None:
        return None
    return (xp.arange(steps)[:, None] < lengths[None, :])[:, :, None]


def select_active(xp, a: Array, lengths: Array | None) -> Array:
    """``a`` (T, B, X) with zeros at steps past each sequence's length, selected (not multiplied,
    so NaN or Inf there do not survive); ``a`` itself when there are no lengths."""
    if lengths is None:
        return a
    return xp.where(active_steps(xp, a.shape[0], lengths), a, xp.zeros((), a.dtype))


def matmul_steps(a: Array, w: Array) -> Array:
    """``a`` (T, B, K) @ ``w`` (K, N) as one 2-D GEMM over all steps -> (T, B, N)."""
    steps, batch, width = a.shape
    return matmul(a.reshape(steps * batch, width), w).reshape(steps, batch, w.shape[1])


def round_half(xp, a: Array, half: str | None) -> Array:
    """float32 ``a`` rounded to the nearest ``half`` value ("float16" or "bfloat16"; ties to
    even, as ml_dtypes and CUDA's conversions round), kept as float32; ``a`` itself for ``None``.

    16-bit layers compute in fp32 and round h_t here every step, where the 16-bit kernels do.
    bfloat16 is rounded on the float32 bits (CuPy has no bfloat16 arrays); NaN stays NaN.
    """
    if half is None:
        return a
    if half == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as the cast on a GPU
            return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return xp.where(xp.isnan(a), a, rounded.view(np.float32))


def weight_words(xp, m: Array, half: str | None) -> Array:
    """The matrix ``m`` (float32, rows x K) as the persistent kernels hold it: contiguous float32,
    or for ``half`` ("float16", "bfloat16") uint32 words of two 16-bit values (columns 2c, 2c+1,
    element 0 in the low half), rows padded to even K with a zero: (rows, ceil(K/2))."""
    m = xp.ascontiguousarray(m, dtype=np.float32)
    if half is None:
        return m
    if half == "float16":
        with np.errstate(over="ignore"):
            bits = m.astype(np.float16).view(np.uint16)
    else:
        bits = (round_half(xp, m, half).view(np.uint32) >> 16).astype(np.uint16)
    rows, cols = m.shape
    padded = xp.zeros((rows, cols + cols % 2), np.uint16)
    padded[:, :cols] = bits
    return padded.view(np.uint32)
