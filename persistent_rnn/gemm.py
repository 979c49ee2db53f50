"""The GEMM path: one layer-direction's recurrence as one GEMM plus one pointwise update per step.

Written once for NumPy and CuPy. Each step computes ``h_{t-1} @ W_hh^T`` with ``matmul.matmul``
(cuBLAS on the GPU; the library's own GEMM while the stream is being captured) and then the
cell's pointwise update with the lengths mask (past a sequence's length its state is frozen and
gradients pass straight through). On NumPy the update is ``cells.py``'s reference math; on
CuPy it is one fused kernel per step from ``cuda_src/pointwise.cu`` (the same ``cells.cuh`` code
the persistent kernels run).

LSTM projections (``proj_size``, ``w_hr`` given): the recurrent state is ``r_t = W_hr h_t``
(P wide; ``y`` holds it and ``W_hh`` is G*H x P), the cell's own ``h_t`` (H wide) goes to ``hs``.
Each step is then two GEMMs (``r_{t-1} @ W_hh^T`` before the pointwise update, ``h_t @ W_hr^T``
after it); backward likewise (``dr_t @ W_hr`` into the cell's backward, ``dgh_t @ W_hh`` to the
step before) and records the masked ``dr_t`` so that ``dW_hr`` is one GEMM afterwards.

Buffers and their layout are described in ``buffers.py``. ``start`` / ``stop`` let the runtime
finish a persistent run that stopped part-way on this path. Whole passes on CuPy may be replayed
from a recorded CUDA graph (``step_graphs``, the ``gemm_graphs`` setting).
"""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import numpy as np

from . import step_graphs
from ._sources import cuda_src_dir, read_source
from .buffers import array_module, full_lengths, round_half
from .cells import CellSpec
from .matmul import matmul

Array = Any  # numpy.ndarray or cupy.ndarray

_THREADS = 256  # threads per block of the pointwise kernels
_MAX_BLOCKS = 2**31 - 1  # CUDA's limit on gridDim.x
_MAX_INT32 = 2**31 - 1


def forward_steps(cell: CellSpec, gi: Array, w_hh: Array, b_hh: Array | None, h0: Array,
                  c0: Array | None, lengths: Array | None, y: Array, cs: Array | None,
                  saved: Array, start: int, half: str | None = None, w_hr: Array | None = None,
                  hs: Array | None = None) -> None:
    """Run forward steps ``start..T-1`` in place; step ``start`` reads h_{start-1} from
    ``y[start-1]`` (``h0`` if ``start == 0``) and likewise c from ``cs``/``c0``.

    ``half`` ("float16", "bfloat16" or ``None``): a 16-bit layer's fp32 data; h_t is rounded to
    it every step, as the 16-bit persistent kernels do (c_t and the saved activations stay fp32).
    ``w_hr`` (P, H): an LSTM projection; ``y`` (T, B, P) then holds ``r_t`` (the state that
    recurs, rounded under ``half``) and ``hs`` (T, B, H) the cell's ``h_t`` (module docstring).
    """
    xp = array_module(gi)
    if xp is np and not step_graphs.eligible(xp):  # (the loop at once: no lengths to
        # convert, no kernel limits; eligible: tests/test_step_graphs.py's stand-in capture)
        _forward_loop(cell, start, half, gi=gi, w_hh=w_hh, b_hh=b_hh, h0=h0, c0=c0,
                      lengths=lengths, w_hr=w_hr, y=y, cs=cs, saved=saved, hs=hs)
        return
    steps, batch, _ = gi.shape
    _check_sizes(xp, steps, batch, saved.shape[2])
    inputs = dict(gi=gi, w_hh=w_hh, b_hh=b_hh, h0=h0, c0=c0,
                  lengths=full_lengths(xp, lengths, batch, steps), w_hr=w_hr)
    outputs = dict(y=y, cs=cs, saved=saved, hs=hs)
    if start == 0:  # a whole pass: replayed from a recorded CUDA graph
        step_graphs.run(f"forward {cell.name} {half or ''}",
                        partial(_forward_loop, cell, start, half), inputs, outputs)
    else:
        _forward_loop(cell, start, half, **inputs, **outputs)


def backward_steps(cell: CellSpec, dy: Array, w_hh: Array, h0: Array, c0: Array | None,
                   lengths: Array | None, y: Array, cs: Array | None, saved: Array, dgi: Array,
                   dgh: Array, dh_carry: Array | None, dc_carry: Array | None,
                   stop: int, w_hr: Array | None = None, hs: Array | None = None,
                   drs: Array | None = None) -> tuple[Array, Array | None]:
    """Run backward steps ``stop-1`` down to 0, filling ``dgi``/``dgh``; return ``(dh0, dc0)``.

    ``dh_carry``/``dc_carry`` are the gradients reaching h_{stop-1}/c_{stop-1} from steps
    ``>= stop`` (``dh_n``/``dc_n`` when ``stop == T``); ``None`` means zero. ``dy`` must be zero
    past each sequence's length. With a projection (``w_hr``, ``hs`` as in ``forward_steps``)
    ``dy``, ``dh_carry`` and ``dh0`` are P wide (gradients of r) and ``drs`` (T, B, P) receives
    each step's gradient of r_t (zero past a sequence's length), for ``dW_hr = sum_t drs_t^T hs_t``.
    """
    xp = array_module(dy)
    steps, batch, width = dy.shape
    _check_sizes(xp, steps, batch, saved.shape[2])
    dh0 = xp.empty((batch, width), dtype=dy.dtype)
    dc0 = xp.empty((batch, dgi.shape[2] // cell.gates), dy.dtype) if cell.has_cell_state else None
    dc_carry = dc_carry if cell.has_cell_state else None
    dgh = None if dgh is dgi else dgh
    if xp is np and not step_graphs.eligible(xp):  # (the loop at once, as forward_steps)
        _backward_loop(cell, stop, dy=dy, w_hh=w_hh, h0=h0, c0=c0, lengths=lengths, y=y, cs=cs,
                       saved=saved, dh_carry=dh_carry, dc_carry=dc_carry, w_hr=w_hr, hs=hs,
                       dgi=dgi, dgh=dgh, dh0=dh0, dc0=dc0, drs=drs)
        return dh0, dc0
    inputs = dict(dy=dy, w_hh=w_hh, h0=h0, c0=c0,
                  lengths=full_lengths(xp, lengths, batch, steps), y=y, cs=cs, saved=saved,
                  dh_carry=dh_carry, dc_carry=dc_carry, w_hr=w_hr, hs=hs)
    outputs = dict(dgi=dgi, dgh=dgh, dh0=dh0, dc0=dc0, drs=drs)
    if stop == steps:  # a whole pass: replayed from a recorded CUDA graph (step_graphs.run runs
        # the loop itself where it cannot)
        step_graphs.run(f"backward {cell.name}", partial(_backward_loop, cell, stop), inputs,
                        outputs)
    else:
        _backward_loop(cell, stop, **inputs, **outputs)
    return dh0, dc0


def _forward_loop(cell: CellSpec, start: int, half: str | None, *, gi, w_hh, b_hh, h0, c0,
                  lengths, y, cs, saved, w_hr, hs) -> None:
    xp = array_module(gi)
    gh = xp.empty(gi.shape[1:], dtype=gi.dtype)
    w_t = w_hh.T
    for t in range(start, gi.shape[0]):
        h_prev = y[t - 1] if t > 0 else h0
        c_prev = None if cs is None else (cs[t - 1] if t > 0 else c0)
        matmul(h_prev, w_t, out=gh)
        if w_hr is None:
            _pointwise_forward(cell, xp, t, lengths, gi[t], gh, b_hh, h_prev, c_prev,
                               y[t], None if cs is None else cs[t], saved[t])
        else:  # the cell's h_t into hs (its frozen value there is never read), then r_t
            hs_prev = hs[t - 1] if t > 0 else xp.zeros_like(hs[0])
            _pointwise_forward(cell, xp, t, lengths, gi[t], gh, b_hh, hs_prev, c_prev,
                               hs[t], cs[t], saved[t])
            y[t] = _where(xp, _active(xp, lengths, t), matmul(hs[t], w_hr.T), h_prev)
        if half is not None:
            y[t] = round_half(xp, y[t], half)


def _backward_loop(cell: CellSpec, stop: int, *, dy, w_hh, h0, c0, lengths, y, cs, saved,
                   dh_carry, dc_carry, w_hr, hs, dgi, dgh, dh0, dc0, drs) -> None:
    """Backward steps ``stop-1..0``; ``dgh`` is ``None`` where it is ``dgi`` (not GRU)."""
    if w_hr is not None:
        _projected_backward_loop(cell, stop, dy=dy, w_hh=w_hh, c0=c0, lengths=lengths, cs=cs,
                                 saved=saved, dh_carry=dh_carry, dc_carry=dc_carry, w_hr=w_hr,
                                 hs=hs, dgi=dgi, dh0=dh0, dc0=dc0, drs=drs)
        return
    xp = array_module(dy)
    zeros = xp.zeros(dy.shape[1:], dtype=dy.dtype)
    # The gradient reaching h_t is split in three (dy_t, the cell's direct part, the part through
    # W_hh) and summed inside the step's fused pointwise update, saving a kernel per step.
    dh_direct = zeros if dh_carry is None else xp.ascontiguousarray(dh_carry)
    dh_rec = zeros
    dc = None
    if cell.has_cell_state:
        dc = zeros if dc_carry is None else xp.ascontiguousarray(dc_carry)
    for t in range(stop - 1, -1, -1):
        h_prev = y[t - 1] if t > 0 else h0
        c_prev = None if cs is None else (cs[t - 1] if t > 0 else c0)
        dgi_t = dgi[t]
        dgh_t = dgi_t if dgh is None else dgh[t]
        dh_direct, dc = _pointwise_backward(
            cell, xp, t, lengths, dy[t], dh_direct, dh_rec, dc, saved[t], y[t],
            None if cs is None else cs[t], h_prev, c_prev, dgi_t, dgh_t)
        dh_rec = matmul(dgh_t, w_hh)
    dh0[...] = dh_direct + dh_rec
    if dc0 is not None:
        dc0[...] = dc


def _projected_backward_loop(cell: CellSpec, stop: int, *, dy, w_hh, c0, lengths, cs, saved,
                             dh_carry, dc_carry, w_hr, hs, dgi, dh0, dc0, drs) -> None:
    """``_backward_loop`` of an LSTM with projection (``dgh`` is ``dgi``).

    The gradient reaching r_t (dy_t, the part through W_hh from step t+1, and what passes
    through the frozen steps past a length) is masked into ``drs[t]``, projected back to the
    cell's h_t (``drs[t] @ W_hr``) and handed to the same pointwise backward as ``dy``."""
    xp = array_module(dy)
    no_h = xp.zeros(hs.shape[1:], dtype=dy.dtype)  # h_prev/dh parts the LSTM cell never reads
    dr = xp.zeros(dy.shape[1:], dy.dtype) if dh_carry is None else xp.array(dh_carry, dy.dtype)
    dc = xp.zeros(cs.shape[1:], dy.dtype) if dc_carry is None else xp.array(dc_carry, dy.dtype)
    for t in range(stop - 1, -1, -1):
        dr = dr + dy[t]
        active = _active(xp, lengths, t)
        drs[t] = _where(xp, active, dr, 0.0)
        c_prev = cs[t - 1] if t > 0 else c0
        _, dc = _pointwise_backward(cell, xp, t, lengths, matmul(drs[t], w_hr), no_h, no_h, dc,
                                    saved[t], hs[t], cs[t], no_h, c_prev, dgi[t], dgi[t])
        dr = _where(xp, active, matmul(dgi[t], w_hh), dr)
    dh0[...] = dr
    dc0[...] = dc


def _active(xp, lengths: Array | None, t: int) -> Array | None:
    """(B, 1) booleans: step ``t`` is within each sequence's length (``None``: all are)."""
    return None if lengths is None else (lengths > t)[:, None]


def _where(xp, active: Array | None, a: Array, b: Any) -> Array:
    """``xp.where(active, a, b)``, ``a`` itself where every sequence is active."""
    return a if active is None else xp.where(active, a, b)


def _pointwise_forward(cell, xp, t, lengths, gi_t, gh, b_hh, h_prev, c_prev, h_out, c_out,
                       saved_out) -> None:
    if xp is not np:
        _launch(cell, "forward", gi_t.dtype, gh.shape[0] * h_out.shape[1],
                (np.int32(gh.shape[0]), np.int32(h_out.shape[1]), np.int32(t), lengths,
                 xp.ascontiguousarray(gi_t), gh,
                 gh if b_hh is None else b_hh, np.int32(b_hh is not None),
                 xp.ascontiguousarray(h_prev), _contiguous(xp, c_prev, h_prev), h_out,
                 _or(c_out, h_out),
                 saved_out))
        return
    if b_hh is not None:
        gh += b_hh
    h, c, s = cell.forward(np, gi_t, gh, h_prev, c_prev)
    if lengths is None:  # every sequence active: no mask (the usual case, without calls)
        h_out[...] = h
        if c_out is not None:
            c_out[...] = c
    else:
        active = _active(np, lengths, t)
        h_out[...] = np.where(active, h, h_prev)
        if c_out is not None:
            c_out[...] = np.where(active, c, c_prev)
    saved_out[...] = s


def _pointwise_backward(cell, xp, t, lengths, dy_t, dh_direct, dh_rec, dc, saved_t, h, c,
                        h_prev, c_prev, dgi_out, dgh_out) -> tuple[Array, Array | None]:
    """One step's pointwise backward; returns the direct parts of the gradients reaching
    h_{t-1} and c_{t-1} (the part through W_hh is added by the caller)."""
    if xp is not np:
        dh_next = xp.empty_like(dh_rec)
        dc_next = None if dc is None else xp.empty_like(dc)
        _launch(cell, "backward", dy_t.dtype, dh_next.size,
                (np.int32(dh_next.shape[0]), np.int32(dh_next.shape[1]), np.int32(t), lengths,
                 xp.ascontiguousarray(dy_t), dh_direct, dh_rec, _or(dc, dh_rec), saved_t, h,
                 _or(c, h), xp.ascontiguousarray(h_prev), _contiguous(xp, c_prev, h_prev), dgi_out,
                 dgh_out,
                 dh_next, _or(dc_next, dh_next)))
        return dh_next, dc_next
    dh = dy_t + dh_direct + dh_rec
    dgi, dgh, dh_prev, dc_prev = cell.backward(np, dh, dc, saved_t, h, c, h_prev, c_prev)
    if lengths is None:  # every sequence active: no mask (the usual case, without calls)
        dgi_out[...] = dgi
        if dgh_out is not dgi_out:
            dgh_out[...] = dgh
        return dh_prev, (None if dc is None else dc_prev)
    active = _active(np, lengths, t)
    dgi_out[...] = _where(np, active, dgi, 0.0)
    if dgh_out is not dgi_out:
        dgh_out[...] = _where(np, active, dgh, 0.0)
    dh_prev = _where(np, active, dh_prev, dh)
    return dh_prev, (None if dc is None else _where(np, active, dc_prev, dc))


def _or(a: Array | None, placeholder: Array) -> Array:
    """``a``, or a valid buffer the kernel will not touch (cells without a cell state)."""
    return placeholder if a is None else a


def _contiguous(xp, a: Array | None, placeholder: Array) -> Array:
    """``_or`` for inputs that may be views (``h0``/``c0`` slices given by the caller)."""
    return placeholder if a is None else xp.ascontiguousarray(a)


def _launch(cell: CellSpec, which: str, dtype, threads: int, args: tuple) -> None:
    suffix = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}[np.dtype(dtype)]
    kernel = _module(cell.kind).get_function(f"prnn_pointwise_{which}_{suffix}")
    blocks = (threads + _THREADS - 1) // _THREADS
    if blocks:  # an empty batch launches nothing: CUDA refuses a grid of 0 blocks
        kernel((blocks,), (_THREADS,), args)


def _check_sizes(xp, steps: int, batch: int, hidden: int) -> None:
    """ValueError for sizes the pointwise kernels cannot index: their T, B, H arguments are
    32-bit and their grid has one thread per (b, j)."""
    if xp is np:
        return
    if max(steps, batch, hidden) > _MAX_INT32 or -(-batch * hidden // _THREADS) > _MAX_BLOCKS:
        raise ValueError(f"sequence length {steps}, batch {batch}, hidden_size {hidden}: too large "
                         f"for the GEMM path's pointwise kernels (each at most {_MAX_INT32}, and "
                         f"batch x hidden_size at most {_MAX_BLOCKS * _THREADS})")


@lru_cache(maxsize=None)
def _module(kind: int):
    """``pointwise.cu`` compiled for the cell of ``prnn::CellKind`` ``kind`` (one NVRTC build per
    process and cell, per device via CuPy's cache)."""
    import cupy
    return cupy.RawModule(code=read_source("pointwise.cu"), options=(
        "-I" + str(cuda_src_dir()), "--std=c++17", f"-DPRNN_CELL={kind}"))
