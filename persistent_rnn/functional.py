"""Multi-layer, bidirectional, variable-length recurrence over parameter dicts.

``forward`` and ``backward`` are the whole computation of a stacked ``torch.nn.RNN/GRU/LSTM``
without any state of their own: parameters come in as a dict (torch.nn names), everything
backward needs goes out in an explicit context. Used by ``layers`` (NumPy/CuPy layers) and by
``persistent_rnn.torch``.

Per layer and direction: one GEMM projects the input for all steps (``gi = x @ W_ih^T + b_ih``),
``runtime.forward`` starts the recurrence; backward starts ``runtime.backward`` and then forms
``dW_hh``, ``dW_ih``, the biases and ``dx`` as single GEMMs / reductions over all steps. The
progress of all persistent passes of the stack is checked once per call (``runtime.settle``).
The reverse direction sees each sequence reversed within its own length (a gather with an index
array), so sequences of any length, in any order, need no sorting or packing.

Arguments are assumed valid (``layers`` and the torch modules check them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import runtime
from .buffers import array_module, select_active
from .cells import CellSpec
from .stats import RunStats

Array = Any  # numpy.ndarray or cupy.ndarray


def param_names(layer: int, reverse: bool, bias: bool, proj: bool = False) -> list[str]:
    """torch.nn's parameter names of one layer-direction, in torch's order (``proj``: an LSTM
    projection's ``weight_hr`` last)."""
    suffix = f"_l{layer}" + ("_reverse" if reverse else "")
    kinds = (("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if bias else ())
             + (("weight_hr",) if proj else ()))
    return [kind + suffix for kind in kinds]


def _direction_names(params: Mapping[str, Array], layer: int, reverse: bool) -> dict[str, str]:
    """The parameter names of one layer-direction present in ``params``, by kind
    (``"weight_ih"``, ``"weight_hh"``, optionally ``"bias_ih"``, ``"bias_hh"``, ``"weight_hr"``)."""
    names = param_names(layer, reverse, bias=f"bias_ih_l{layer}" in params,
                        proj=f"weight_hr_l{layer}" in params)
    return {name.rpartition("_l")[0]: name for name in names}


@dataclass
class _Direction:
    """What backward needs of one layer-direction's forward."""

    names: dict[str, str]          # parameter names by kind (``_direction_names``)
    h0: Array                      # (B, H), or (B, P) with a projection
    c0: Array | None
    fwd: runtime.ForwardResult     # in this direction's own time order


@dataclass
class Context:
    """Everything ``backward`` needs from one ``forward`` call (reusable: backward keeps it)."""

    cell: CellSpec
    params: Mapping[str, Array]
    num_layers: int
    bidirectional: bool
    batch_first: bool
    algo: str
    lengths: Array | None          # int32 (B,) on the data's array module, or None
    reverse_index: Array | None    # (T, B) time index of the within-length reversal
    half: str | None = None        # None, or a 16-bit layer's dtype (see ``forward``)
    inputs: list[Array] = field(default_factory=list)             # each layer's input (T, B, I)
    directions: list[list[_Direction]] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)               # of the forward
    backward_stats: RunStats | None = None                          # of the last backward


def forward(cell: CellSpec, params: Mapping[str, Array], x: Array, hx: Any = None,
            lengths: Array | None = None, *, num_layers: int, bidirectional: bool,
            batch_first: bool, algo: str = "auto",
            half: str | None = None) -> tuple[Array, Any, Context]:
    """Run the stack forward; return ``(y, hn, ctx)`` in torch.nn's shapes.

    ``x``: (T, B, I), or (B, T, I) if ``batch_first``. ``hx``: ``None`` (zeros), ``h0`` of shape
    (L*D, B, H), or ``(h0, c0)`` for the LSTM. ``lengths``: ``None`` or (B,) integers in 1..T
    (packed-sequence semantics: outputs past a length are zero, states stop at the length).
    ``y``: (T, B, D*H) (batch-first if ``x`` is); ``hn``: ``h_n`` or ``(h_n, c_n)``.
    ``half``: ``None``, or "float16"/"bfloat16" for a 16-bit layer: the arrays are float32
    holding values of that dtype, the recurrence rounds h_t to it every step (docs/api.md).

    Every layer-direction is started without waiting for the previous one; their progress is
    checked once at the end (``runtime.settle``). Where a persistent pass did not finish, it is
    resumed and the layers above it run again on its completed output.
    """
    x = x.transpose(1, 0, 2) if batch_first else x
    ctx, xp, h0_all, c0_all = _new_context(cell, params, x, hx, lengths, num_layers, bidirectional,
                                           batch_first, algo, half)
    lengths, num_dirs = ctx.lengths, 2 if bidirectional else 1
    ctx.inputs = [None] * num_layers
    ctx.directions = [[] for _ in range(num_layers)]
    stats: dict[tuple[int, int], RunStats] = {}
    # Padding is selected out, not multiplied away: NaN/Inf there must not reach any result.
    layer_input, first, rerun = select_active(xp, x, lengths), 0, False
    while True:
        pending = []
        for layer in range(first, num_layers):
            ctx.inputs[layer] = layer_input
            ctx.directions[layer] = []
            for direction in range(num_dirs):
                k = layer * num_dirs + direction
                names = _direction_names(params, layer, direction == 1)
                d = _Direction(names, h0_all[k], None if c0_all is None else c0_all[k], None)
                d.fwd, stats[layer, direction], p = _start_direction(ctx, layer_input, d,
                                                                     direction == 1, rerun)
                pending += [(layer, p)] if p else []
                ctx.directions[layer].append(d)
            layer_input = _layer_output(ctx, layer)
        failed = runtime.settle(pending)
        if failed is None:
            break
        layer_input, first, rerun = _layer_output(ctx, failed), failed + 1, True
    ctx.stats = _merged(stats, rerun)
    y = layer_input.transpose(1, 0, 2) if batch_first else layer_input
    h_n = xp.stack([d.fwd.y[-1] for dirs in ctx.directions for d in dirs])
    if not cell.has_cell_state:
        return y, h_n, ctx
    return y, (h_n, xp.stack([d.fwd.cs[-1] for dirs in ctx.directions for d in dirs])), ctx


def backward(ctx: Context, dy: Array, dhn: Any = None) -> tuple[Array, Any, dict[str, Array]]:
    """Gradients of one ``forward``: return ``(dx, dhx, grads)``.

    ``dy`` has ``y``'s shape (entries past a sequence's length are ignored); ``dhn``: ``None``
    (zero), ``dh_n``, or ``(dh_n, dc_n)`` for the LSTM (either may be ``None``). ``dhx`` is
    ``dh0`` or ``(dh0, dc0)``; ``grads`` has the keys of the parameters. Progress is checked
    once, as in ``forward``; layers below a resumed one run again.
    """
    xp = array_module(dy)
    dy = dy.transpose(1, 0, 2) if ctx.batch_first else dy
    dhn, dcn = dhn if ctx.cell.has_cell_state and dhn is not None else (dhn, None)
    grads: dict[str, Array] = {}
    results: dict[tuple[int, int], runtime.BackwardResult] = {}
    stats: dict[tuple[int, int], RunStats] = {}
    num_dirs = len(ctx.directions[0])
    d_out, first, rerun = select_active(xp, dy, ctx.lengths), ctx.num_layers - 1, False
    while True:
        pending = []
        for layer in range(first, -1, -1):
            for direction, d in enumerate(ctx.directions[layer]):
                k = layer * num_dirs + direction
                hidden = d.h0.shape[1]
                dy_d = d_out[:, :, direction * hidden:(direction + 1) * hidden]
                dy_d = (_gather(ctx.reverse_index, dy_d) if direction == 1
                        else xp.ascontiguousarray(dy_d))
                w_hh, w_hr = (_param(ctx, d, kind) for kind in ("weight_hh", "weight_hr"))
                results[layer, direction], stats[layer, direction], p = runtime.backward(
                    ctx.cell, dy_d, _pick(dhn, k), _pick(dcn, k), w_hh, d.h0, d.c0, ctx.lengths,
                    d.fwd, ctx.algo, rerun, ctx.half, w_hr)
                pending += [(layer, p)] if p else []
            d_out = _layer_gradients(ctx, layer, results, grads)
        failed = runtime.settle(pending)
        if failed is None:
            break
        d_out, first, rerun = _layer_gradients(ctx, failed, results, grads), failed - 1, True
        if first < 0:
            break
    ctx.backward_stats = _merged(stats, rerun)
    dx = d_out.transpose(1, 0, 2) if ctx.batch_first else d_out
    dh = xp.stack([results[k].dh0 for k in sorted(results)])
    if not ctx.cell.has_cell_state:
        return dx, dh, grads
    return dx, (dh, xp.stack([results[k].dc0 for k in sorted(results)])), grads


def _start_direction(ctx: Context, layer_input: Array, d: _Direction, reverse: bool,
                     rerun: bool) -> tuple[runtime.ForwardResult, RunStats, runtime.Pending | None]:
    """Project the input for all steps (one GEMM) and start this direction's recurrence."""
    w_ih, w_hh, b_ih, b_hh, w_hr = (_param(ctx, d, kind) for kind in (
        "weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"))
    gi = _matmul_steps(layer_input, w_ih.T)
    if b_ih is not None:
        gi += b_ih
    if reverse:
        gi = _gather(ctx.reverse_index, gi)
    return runtime.forward(ctx.cell, gi, w_hh, b_hh, d.h0, d.c0, ctx.lengths, ctx.algo, rerun,
                           ctx.half, w_hr)


def _param(ctx: Context, d: _Direction, kind: str) -> Array | None:
    """The parameter of ``kind`` of a layer-direction, ``None`` where the layer has none."""
    name = d.names.get(kind)
    return None if name is None else ctx.params[name]


def _layer_output(ctx: Context, layer: int) -> Array:
    """The output of ``layer`` (T, B, D*H): its directions side by side, zero past lengths."""
    xp = array_module(ctx.inputs[layer])
    ys = [d.fwd.y if i == 0 else _gather(ctx.reverse_index, d.fwd.y)
          for i, d in enumerate(ctx.directions[layer])]
    # concatenate copies even one direction: y must not alias the buffers backward reads
    return select_active(xp, xp.concatenate(ys, axis=2), ctx.lengths)


def _layer_gradients(ctx: Context, layer: int, results: Mapping[tuple[int, int], Any],
                     grads: dict[str, Array]) -> Array:
    """Set the parameter gradients of ``layer`` in ``grads``; return the gradient of its input."""
    layer_input = ctx.inputs[layer]
    xp = array_module(layer_input)
    flat_input = layer_input.reshape(-1, layer_input.shape[2])
    d_in = None
    for direction, d in enumerate(ctx.directions[layer]):
        res = results[layer, direction]
        dgi = _gather(ctx.reverse_index, res.dgi) if direction == 1 else res.dgi
        dgi_2d = dgi.reshape(-1, dgi.shape[2])
        grads[d.names["weight_ih"]] = dgi_2d.T @ flat_input
        grads[d.names["weight_hh"]] = _recurrent_weight_grad(res.dgh, d.fwd.y, d.h0)
        if "bias_ih" in d.names:
            grads[d.names["bias_ih"]] = dgi_2d.sum(axis=0)
            grads[d.names["bias_hh"]] = res.dgh.reshape(-1, res.dgh.shape[2]).sum(axis=0)
        if "weight_hr" in d.names:  # dW_hr = sum_t dr_t^T h_t, one GEMM over all steps
            grads[d.names["weight_hr"]] = (res.drs.reshape(-1, res.drs.shape[2]).T
                                           @ d.fwd.hs.reshape(-1, d.fwd.hs.shape[2]))
        part = _matmul_steps(dgi, ctx.params[d.names["weight_ih"]])
        d_in = part if d_in is None else d_in + part
    return d_in if d_in is not None else xp.zeros_like(layer_input)


def _merged(stats: Mapping[tuple[int, int], RunStats], rerun: bool) -> RunStats:
    """One ``RunStats`` over all layer-directions (in order)."""
    total = RunStats()
    for key in sorted(stats):
        total.merge(stats[key])
    if rerun:
        total.details.append("layers after a restarted layer ran again on its completed output")
    return total


def _matmul_steps(a: Array, w: Array) -> Array:
    """``a`` (T, B, K) @ ``w`` (K, N) as one 2-D GEMM over all steps -> (T, B, N)."""
    steps, batch, width = a.shape
    return (a.reshape(steps * batch, width) @ w).reshape(steps, batch, w.shape[1])


def _initial_states(cell: CellSpec, xp, hx: Any, count: int, batch: int, widths: tuple[int, int],
                    dtype) -> tuple[Array, Array | None]:
    """``(h0, c0)`` of shape (L*D, B, width) each (``widths`` of h and c: (H, H), or (P, H) with
    a projection; ``c0`` only for the LSTM), zeros where not given."""
    h0, c0 = hx if cell.has_cell_state and hx is not None else (hx, None)
    h0 = xp.zeros((count, batch, widths[0]), dtype) if h0 is None else xp.ascontiguousarray(h0)
    if not cell.has_cell_state:
        return h0, None
    c0 = xp.zeros((count, batch, widths[1]), dtype) if c0 is None else xp.ascontiguousarray(c0)
    return h0, c0


def _reverse_index(xp, steps: int, batch: int, lengths: Array | None) -> Array:
    """(T, B) index reversing each sequence within its length; later steps stay in place.

    The mapping is its own inverse, so the same gather reverses and un-reverses.
    """
    t = xp.arange(steps, dtype=np.int32)[:, None]
    if lengths is None:
        return xp.broadcast_to(steps - 1 - t, (steps, batch))
    return xp.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)


def _gather(index: Array, a: Array) -> Array:
    """``a`` (T, B, X) with step ``t`` of sequence ``b`` taken from step ``index[t, b]``."""
    xp = array_module(a)
    return a[index, xp.arange(a.shape[1])[None, :]]


def _recurrent_weight_grad(dgh: Array, y: Array, h0: Array) -> Array:
    """``dW_hh = sum_t dgh_t^T h_{t-1}`` as two GEMMs (step 0 reads ``h0``, the rest ``y``)."""
    width = dgh.shape[2]
    grad = dgh[0].T @ h0
    if dgh.shape[0] > 1:
        grad += dgh[1:].reshape(-1, width).T @ y[:-1].reshape(-1, y.shape[2])
    return grad


def _pick(a: Array | None, k: int) -> Array | None:
    """Row ``k`` of a (L*D, B, H) state gradient, or ``None``."""
    return None if a is None else a[k]


def saved_arrays(ctx: Context) -> list[Array]:
    """The arrays ``backward`` needs beyond ``forward``'s own arguments, in a fixed order.

    Each later layer's input, then per layer and direction ``y``, ``cs`` (LSTM only), ``hs``
    (LSTM with projection only) and ``saved``. ``restore_context`` rebuilds the context from them; ``saved_shapes`` gives their
    shapes without running anything (the torch custom op's fake implementation).
    """
    arrays = list(ctx.inputs[1:])
    for dirs in ctx.directions:
        for d in dirs:
            arrays += [d.fwd.y, *(a for a in (d.fwd.cs, d.fwd.hs) if a is not None), d.fwd.saved]
    return arrays


def saved_shapes(cell: CellSpec, steps: int, batch: int, hidden: int, num_layers: int,
                 bidirectional: bool, proj_size: int = 0) -> list[tuple[int, ...]]:
    """The shapes of ``saved_arrays`` for a time-major input of ``steps`` x ``batch``."""
    num_dirs, out = 2 if bidirectional else 1, proj_size or hidden
    state = (steps, batch, hidden)
    per_direction = ([(steps, batch, out)] + [state] * cell.has_cell_state
                     + [state] * bool(proj_size) + [(steps, batch, cell.saved * hidden)])
    return [(steps, batch, num_dirs * out)] * (num_layers - 1) + per_direction * (
        num_layers * num_dirs)



def _new_context(cell: CellSpec, params: Mapping[str, Array], x: Array, hx: Any,
                 lengths: Any, num_layers: int, bidirectional: bool, batch_first: bool, algo: str,
                 half: Any) -> tuple["Context", Any, Array, Array | None]:
    """The ``Context`` of a call on time-major ``x``, its array module and the initial states."""
    xp = array_module(x, *params.values())
    steps, batch, _ = x.shape
    w_hh = params["weight_hh_l0"]
    widths = (w_hh.shape[1], w_hh.shape[0] // cell.gates)  # h (H, or P), c (H)
    num_dirs = 2 if bidirectional else 1
    h0_all, c0_all = _initial_states(cell, xp, hx, num_layers * num_dirs, batch, widths, x.dtype)
    if lengths is not None:
        lengths = xp.asarray(lengths, dtype=np.int32)
    ctx = Context(cell, params, num_layers, bidirectional, batch_first, algo, lengths,
                  _reverse_index(xp, steps, batch, lengths) if bidirectional else None, half)
    return ctx, xp, h0_all, c0_all

def restore_context(cell: CellSpec, params: Mapping[str, Array], x: Array, hx: Any,
                    lengths: Array | None, arrays: list[Array], *, num_layers: int,
                    bidirectional: bool, algo: str = "auto",
                    half: str | None = None) -> Context:
    """The ``Context`` of the time-major ``forward(cell, params, x, hx, lengths, ...)`` call
    whose ``saved_arrays`` are ``arrays`` (same arguments, nothing recomputed)."""
    ctx, xp, h0_all, c0_all = _new_context(cell, params, x, hx, lengths, num_layers, bidirectional,
                                           False, algo, half)
    lengths, num_dirs = ctx.lengths, 2 if bidirectional else 1
    rest = iter(arrays)
    ctx.inputs = [select_active(xp, x, lengths)] + [next(rest) for _ in range(num_layers - 1)]
    for layer in range(num_layers):
        dirs = []
        for direction in range(num_dirs):
            k = layer * num_dirs + direction
            names = _direction_names(params, layer, direction == 1)
            y = next(rest)
            cs = next(rest) if cell.has_cell_state else None
            hs = next(rest) if "weight_hr" in names else None
            fwd = runtime.ForwardResult(y, cs, next(rest), hs)
            dirs.append(_Direction(names, h0_all[k], None if c0_all is None else c0_all[k], fwd))
        ctx.directions.append(dirs)
    return ctx
