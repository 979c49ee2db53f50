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
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Callable, TypeVar

import numpy as np

from .cells import CellSpec
from .halves import half_dtype, is_half, widen

Array = Any  # numpy.ndarray or cupy.ndarray
T = TypeVar("T")


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
    """An int32 array of ``count`` times ``value`` for the kernels to read (never to write):
    a shared constant (``constant``)."""
    return constant(xp, (count,), np.int32, value)


def constant_zeros(xp, shape: tuple[int, ...], dtype) -> Array:
    """Zeros of ``shape`` and ``dtype`` to be read, never written (a layer's initial states
    where none are given, a kernel's absent bias): a shared constant (``constant``)."""
    return constant(xp, shape, dtype, 0)


def constant(xp, shape: tuple[int, ...], dtype, value: int) -> Array:
    """An array of ``value`` that nobody writes, made once per (device, shape, dtype, value) and
    shared: no allocation and fill per call, and on a GPU the same address call after call (so
    a chain graph's key repeats). NumPy's is read-only (a write raises); a CuPy array has no
    such flag, so every user of one must only read it. At most ``MAX_CONSTANTS`` are kept."""
    key = ("cpu" if xp is np else xp.cuda.Device().id, shape, np.dtype(dtype).char, value)
    found = _CONSTANTS.get(key)  # (a dict read is atomic; the lock guards the insertion)
    if found is None:
        found = _constant(xp, key, lambda: xp.full(shape, value, dtype))
    return found


def step_indices(xp, steps: int) -> Array:
    """int32 ``0 .. steps-1`` as (steps, 1, 1), a shared read-only constant (``constant``)."""
    key = ("cpu" if xp is np else xp.cuda.Device().id, "steps", steps)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _constant(xp, key, lambda: xp.arange(steps, dtype=np.int32).reshape(
            steps, 1, 1))
    return found


def _constant(xp, key: tuple, make: Callable[[], Array]) -> Array:
    """The constant of ``key``, made by ``make()`` (read-only on NumPy) if there is none."""
    with _CONSTANTS_LOCK:
        found = _CONSTANTS.get(key)
        if found is None:
            if len(_CONSTANTS) >= MAX_CONSTANTS:
                _CONSTANTS.clear()
            found = make()
            if xp is np:
                found.flags.writeable = False
            _CONSTANTS[key] = found
        return found


MAX_REUSED = 128  # objects kept by ``reused``; the least recently used is let go first
_REUSED: "OrderedDict[tuple, Any]" = OrderedDict()
_REUSED_LOCK = threading.Lock()


def reused(xp, key: tuple, make: Callable[[], T]) -> T:
    """``make()``'s result, made once per ``key``, thread, device and stream and returned again
    to the later calls of the same thread on the same stream: a call's scratch memory (a pass's
    chain words and exchanges, the input GEMM's output) without an allocation per call. Another
    thread or stream gets its own, so concurrent calls never share it, and the calls of one
    stream are ordered on it (the next call writes it after this one's work has read it). Under
    CUDA stream capture ``make()`` every time: a captured graph keeps what it was captured with
    (``launch.keep_alive``) and never shares memory with eager calls."""
    if xp is np:
        stream = None
    else:
        current = xp.cuda.get_current_stream()
        if current.is_capturing():
            return make()
        stream = (xp.cuda.Device().id, current.ptr)
    full = (key, threading.get_ident(), stream)
    # A hit takes no lock: the OrderedDict's get and move_to_end are each atomic under the GIL,
    # and an entry another thread evicted in between is made again below.
    found = _REUSED.get(full)
    if found is not None:
        try:
            _REUSED.move_to_end(full)
            return found
        except KeyError:
            pass
    found = make()
    with _REUSED_LOCK:
        _REUSED[full] = found
        while len(_REUSED) > MAX_REUSED:
            _REUSED.popitem(last=False)
    return found


def release_workspaces() -> int:
    """Let go of every kept scratch array and chain (``reused``; calls under way keep theirs),
    e.g. after a run of long sequences; later calls make new ones (the layers' call plans,
    which hold theirs, are planned anew: ``generation``). Returns how many were kept."""
    global _GENERATION
    with _REUSED_LOCK:
        n = len(_REUSED)
        _REUSED.clear()
        _GENERATION += 1
    return n


_GENERATION = 0


def generation() -> int:
    """How many times ``release_workspaces`` ran: what holds scratch beyond a call
    (``call_plans``) holds it only within one generation."""
    return _GENERATION


def workspace(xp, name: str, shape: tuple[int, ...], dtype) -> Array:
    """An uninitialised scratch array of ``shape`` and ``dtype`` that this thread's calls on
    this stream reuse (``reused``); ``name`` tells apart the arrays one call holds at once."""
    return reused(xp, ("workspace", name, shape, np.dtype(dtype)), lambda: xp.empty(shape, dtype))


def widened(xp, a: Array | None, name: str) -> Array | None:
    """A 16-bit ``a``'s float32 values in the workspace ``name`` (``halves.widen``): what a
    call computes on and nothing keeps; ``a`` itself where it is not 16-bit or ``None``."""
    if not is_half(a):
        return a
    return widen(a, workspace(xp, name, a.shape, np.float32))


def reversed_rows(xp, steps: int, batch: int) -> Array:
    """The (T*B,) row index reversing every sequence of ``steps`` in time (row ``t*B + b`` from
    row ``(T-1-t)*B + b``), made once per thread and stream (``reused``) and never written.
    (Not a read-only ``constant``: NumPy's ``take`` copies read-only indices.)"""
    return reused(xp, ("reversed rows", steps, batch), lambda: (
        (steps - 1 - xp.arange(steps))[:, None] * batch + xp.arange(batch)[None, :]
    ).astype(np.intp).reshape(-1))


def active_steps(xp, steps: int, lengths: Array | None) -> Array | None:
    """(T, B, 1) booleans: step ``t`` of sequence ``b`` is within its length (``None``: all are)."""
    if lengths is None:
        return None
    return (xp.arange(steps)[:, None] < lengths[None, :])[:, :, None]


def select_active(xp, a: Array, lengths: Array | None, out: Array | None = None,
                  mask: tuple[Array, Array, Array] | None = None) -> Array:
    """``a`` (T, B, X) with zeros at steps past each sequence's length, selected (not multiplied,
    so NaN or Inf there do not survive), into ``out`` (a new array where not given); ``a``
    itself when there are no lengths. The mask is formed in a reused workspace from shared step
    indices: no array is made but the result. ``mask``: those arrays (``mask_arrays``) where
    the caller holds them (a call plan, whose chain graph reads them: no look-up while it is
    captured); else looked up."""
    if lengths is None:
        return a
    past, steps, zero = mask_arrays(xp, a) if mask is None else mask
    xp.greater_equal(steps, lengths[None, :, None], out=past)
    out = xp.empty_like(a) if out is None else out
    xp.copyto(out, a)
    xp.copyto(out, zero, where=past)
    return out


def mask_arrays(xp, a: Array) -> tuple[Array, Array, Array]:
    """What ``select_active`` selects ``a`` (T, B, X) with: the mask's workspace (``"past"``),
    the step indices and ``a``'s dtype's zero (shared constants)."""
    steps, batch = a.shape[:2]
    return (workspace(xp, "past", (steps, batch, 1), np.bool_), step_indices(xp, steps),
            constant_zeros(xp, (), a.dtype))


def column_sums(a: Array, out: Array | None = None) -> Array:
    """The sums of a 2-D array's columns (into ``out`` where given): NumPy's ``sum(axis=0)``;
    on CuPy a plain reduction kernel (``_column_sum_kernel``), since ``cupy.ndarray.sum`` may run
    CUB's device-wide reduction on an array that is one row (C- and F-contiguous at once), which
    takes its scratch from CuPy's pool: inside a captured chain (``call_plans``) the graph would
    keep memory the pool hands out again."""
    if isinstance(a, np.ndarray):
        return a.sum(axis=0, out=out)
    return _column_sum_kernel()(a, axis=0, out=out)


@lru_cache(maxsize=None)
def _column_sum_kernel():
    """CuPy's reduction kernel of ``column_sums`` (made once, on the first CuPy call)."""
    import cupy
    return cupy.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "prnn_column_sum")


def round_half(xp, a: Array, half: str | None) -> Array:
    """float32 ``a`` rounded to the nearest ``half`` value ("float16" or "bfloat16"; ties to
    even, as ml_dtypes and CUDA's conversions round), kept as float32; ``a`` itself for ``None``.

    16-bit layers compute in fp32 and round h_t here every step, where the 16-bit kernels do.
    bfloat16 is rounded on the float32 bits (the same on NumPy and CuPy); NaN stays NaN.
    """
    if half is None:
        return a
    if half == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as the cast on a GPU
            return a.astype(np.float16).astype(np.float32)
    bits = a.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return xp.where(xp.isnan(a), a, rounded.view(np.float32))


def weight_words(xp, m: Array, half: str | None, scratch: str | None = None) -> Array:
    """The matrix ``m`` (rows x K) as the persistent kernels hold it: contiguous float32, or for
    ``half`` ("float16", "bfloat16") uint32 words of two 16-bit values (columns 2c, 2c+1,
    element 0 in the low half), rows padded to even K with a zero: (rows, ceil(K/2)).

    A 16-bit layer's ``m`` is float32 holding values of ``half`` (rounded here) or an array of
    ``half`` (its bits as they are: no conversion); a contiguous one of even K, 4-byte aligned,
    is its own words (a view: the kernels read, never write, them). ``scratch``: where a copy
    is made, into the workspace of that name (what a call reads and nothing keeps: a transposed
    matrix of the backward), else a new array."""
    if half is None:
        if scratch is None or (m.dtype == np.float32 and m.flags.c_contiguous):
            return xp.ascontiguousarray(m, dtype=np.float32)
        out = workspace(xp, scratch, m.shape, np.float32)
        xp.copyto(out, m)
        return out
    if m.dtype.itemsize == 2:
        if m.dtype != half_dtype(half):
            raise TypeError(f"m: the weights of a {half} layer must be {half} or float32, "
                            f"got {m.dtype}")
        bits = m.view(np.uint16)
    elif half == "float16":
        with np.errstate(over="ignore"):
            bits = xp.ascontiguousarray(m, dtype=np.float32).astype(np.float16).view(np.uint16)
    else:
        m = xp.ascontiguousarray(m, dtype=np.float32)
        bits = (round_half(xp, m, half).view(np.uint32) >> 16).astype(np.uint16)
    rows, cols = bits.shape
    if cols % 2 == 0 and bits.flags.c_contiguous and address(bits) % 4 == 0:
        return bits.view(np.uint32)
    shape = (rows, cols + cols % 2)
    if scratch is None:
        padded = xp.zeros(shape, np.uint16)
    else:
        padded = workspace(xp, scratch, shape, np.uint16)
        padded[:, cols:] = 0
    padded[:, :cols] = bits
    return padded.view(np.uint32)


def widened_words(xp, m: Array, half: str, scratch: str | None = None) -> Array:
    """A ``half`` layer's matrix ``m`` as an fp32 tile holds it (``plan.widened_pass``): its
    16-bit values as contiguous float32 (exact; a float32 ``m`` rounded to ``half`` first, as
    ``weight_words`` rounds it), in the workspace ``scratch`` where given, else a new array."""
    if not is_half(m):
        return xp.ascontiguousarray(round_half(xp, xp.ascontiguousarray(m, dtype=np.float32),
                                               half))
    out = xp.empty(m.shape, np.float32) if scratch is None else workspace(xp, scratch, m.shape,
                                                                          np.float32)
    return widen(m, out)


def address(a: Array) -> int:
    """The address of ``a``'s first element (NumPy or CuPy)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.__array_interface__["data"][0]
