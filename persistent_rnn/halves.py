"""16-bit arrays as a 16-bit layer holds them, and their float32 values.

A 16-bit layer (``dtype="float16"`` or ``"bfloat16"``) keeps its parameters (and a torch module
its tensors) in that dtype and computes on their float32 values, which are exact. float16 arrays
are NumPy's and CuPy's own dtype; bfloat16 arrays are ``ml_dtypes.bfloat16`` on NumPy and CuPy
(CuPy from 14). Conversions go through the 16 bits of a value, so they run the same on either
array module whatever its support for bfloat16 arithmetic.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray
HALF_DTYPES = ("float16", "bfloat16")


def half_dtype(half: str) -> np.dtype:
    """The NumPy dtype of ``half`` ("float16" or "bfloat16"); ValueError naming ``half``."""
    if half == "float16":
        return np.dtype(np.float16)
    if half == "bfloat16":
        import ml_dtypes  # (a core dependency, imported where a bfloat16 array is made)
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"half must be one of {HALF_DTYPES}, got {half!r}")


def is_half(a: Array | None) -> bool:
    """Whether ``a`` is an array of a 16-bit float dtype (float16, bfloat16)."""
    return a is not None and a.dtype.itemsize == 2 and a.dtype.kind in "fV"


def widen(a: Array | None, out: Array | None = None) -> Array | None:
    """The float32 values of a 16-bit array (exact; into ``out``, float32 of ``a``'s shape,
    where given, else a new array), ``a`` itself where it is not 16-bit or ``None``."""
    if not is_half(a):
        return a
    if a.dtype.name == "bfloat16":  # a bfloat16 is the high half of its float32
        if out is None:  # (the shift in place: one new array)
            words = a.view(np.uint16).astype(np.uint32)
        else:
            words = out.view(np.uint32)
            words[...] = a.view(np.uint16)
        words <<= 16
        return words.view(np.float32) if out is None else out
    if out is None:
        return a.astype(np.float32)
    out[...] = a
    return out


def narrow(a: Array, half: str) -> Array:
    """``a`` as an array of ``half`` (``a`` itself where it is one already). A float32 ``a``
    must hold values of that dtype (a 16-bit layer's h_t): they are kept exactly (bfloat16 by
    dropping the low 16 bits, which are zero)."""
    dtype = half_dtype(half)
    if a.dtype == dtype:
        return a
    if dtype.name == "bfloat16":
        return (a.view(np.uint32) >> 16).astype(np.uint16).view(dtype)
    return a.astype(dtype)
