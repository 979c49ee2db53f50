"""Multi-layer, bidirectional, variable-length recurrence over parameter dicts.

``forward`` and ``backward`` are the whole computation of a stacked ``torch.nn.RNN/GRU/LSTM``
without any state of their own: parameters come in as a dict (torch.nn names), everything
backward needs goes out in an explicit context. Used by ``layers`` (NumPy/CuPy layers) and by
``persistent_rnn.torch``.

Per layer and direction: one GEMM projects the input for all steps (``gi = x @ W_ih^T + b_ih``),
``runtime.forward`` starts the recurrence; backward starts ``runtime.backward`` and then forms
``dW_hh``, ``dW_ih``, the biases and ``dx`` as single GEMMs / reductions over all steps. A
persistent pass's restarts and completion are decided on the device (``launch``): nothing is
read back during a call.
The reverse direction sees each sequence reversed within its own length (a gather with an index
array), so sequences of any length, in any order, need no sorting or packing.

16-bit layers (``half``): the arrays given (input, states, parameters, output gradients) may be
of the 16-bit dtype, as the layer keeps them, or float32 holding its values. The input
projection multiplies the 16-bit input and ``W_ih`` as they are (``matmul.matmul_half``: the
tensor cores on a GPU); ``W_hh`` and ``W_hr`` go to ``runtime`` as they are (the persistent
kernels hold their bits); everything else computes on float32 values, converted where it needs
them (``halves.widen``: a no-op for float32): the states and biases per call, stack mode's
weights, and in backward ``dy``, the input and ``W_ih`` (its float32 GEMMs with the fp32
gradients); what nothing keeps into reused workspaces (``buffers.widened``).

The reverse direction's arrays are gathered by rows (``_gather``) into reused workspaces, and
the call's ``dh0``/``dc0`` are one array each whose rows every layer-direction's backward
writes: a steady-state call allocates what it returns and what its context keeps
(docs/design.md, "Allocations of a persistent call").

Arguments are assumed valid (``layers`` and the torch modules check them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from . import runtime, stack
from .buffers import (address, array_module, column_sums, constant_zeros, reversed_rows,
                      select_active, step_indices, widened, workspace)
from .cells import CellSpec
from .halves import widen
from .matmul import matmul, matmul_half, matmul_steps
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
    (``"weight_ih"``, ``"weight_hh"``, optionally ``"bias_ih"``, ``"bias_hh"``, ``"weight_hr"``;
    one dict per layout, shared: read it, never change it)."""
    return _names_by_kind(layer, reverse, f"bias_ih_l{layer}" in params,
                          f"weight_hr_l{layer}" in params)


@lru_cache(maxsize=1024)
def _names_by_kind(layer: int, reverse: bool, bias: bool, proj: bool) -> dict[str, str]:
    return {name.rpartition("_l")[0]: name for name in param_names(layer, reverse, bias, proj)}


@dataclass
class _Direction:
    """What backward needs of one layer-direction's forward."""

    names: dict[str, str]          # parameter names by kind (``_direction_names``)
    h0: Array                      # (B, H), or (B, P) with a projection
    c0: Array | None
    fwd: runtime.ForwardResult     # in this direction's own time order


_NO_STATS = RunStats()  # a forward's stats until its pass sets them (never merged into)


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
    reverse_index: Array | None    # (T*B,) row index of the within-length reversal
    half: str | None = None        # None, or a 16-bit layer's dtype (see ``forward``)
    inputs: list[Array] = field(default_factory=list)             # each layer's input (T, B, I)
    directions: list[list[_Direction]] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)               # of the forward
    backward_stats: RunStats | None = None                          # of the last backward
    scratch_results: bool = False  # results in reused workspaces (see ``forward``)
    plan: Any = None               # the ``call_plans.Plan`` that ran the forward, if one did
    stacked: Any = None            # a planned stack's buffers, all layers' (``stack_plans``)


def forward(cell: CellSpec, params: Mapping[str, Array], x: Array, hx: Any = None,
            lengths: Array | None = None, *, num_layers: int, bidirectional: bool,
            batch_first: bool, algo: str = "auto", half: str | None = None,
            scratch_results: bool = False) -> tuple[Array, Any, Context]:
    """Run the stack forward; return ``(y, hn, ctx)`` in torch.nn's shapes.

    ``x``: (T, B, I), or (B, T, I) if ``batch_first``. ``hx``: ``None`` (zeros), ``h0`` of shape
    (L*D, B, H), or ``(h0, c0)`` for the LSTM. ``lengths``: ``None`` or (B,) integers in 1..T
    (packed-sequence semantics: outputs past a length are zero, states stop at the length).
    ``y``: (T, B, D*H) (batch-first if ``x`` is); ``hn``: ``h_n`` or ``(h_n, c_n)``.
    ``half``: ``None``, or "float16"/"bfloat16" for a 16-bit layer: the arrays are of that
    dtype or float32 holding its values (module docstring), the recurrence computes in float32
    and rounds h_t to the dtype every step (docs/api.md).
    ``scratch_results``: the caller converts the results at once and keeps none of them (a
    16-bit layer rounding them into its dtype), so ``y``, ``hn`` and ``backward``'s ``dx``,
    ``dhx`` are reused workspaces (``buffers.workspace``: valid until this thread's next call
    on this stream), not new arrays.

    Stack mode (``stack``): a unidirectional stack whose layers fit the register files together
    runs in one launch. Otherwise every layer-direction is enqueued without waiting for the
    previous one; restarts and the completion of an unfinished pass happen on the device.
    """
    x = x.transpose(1, 0, 2) if batch_first else x
    ctx, xp, h0_all, c0_all = _new_context(cell, params, x, hx, lengths, num_layers, bidirectional,
                                           batch_first, algo, half)
    ctx.scratch_results = scratch_results
    layer_input = x if ctx.lengths is None else _selected_input(xp, x, ctx.lengths)
    engine, why = stack.engine(cell, x, h0_all.shape[2], num_layers, bidirectional, algo, half,
                               backward=False, proj="weight_hr_l0" in params)
    if engine is not None:
        layer_input = _forward_stack(ctx, engine, layer_input, h0_all, c0_all)
    else:
        layer_input = _forward_layers(ctx, layer_input, h0_all, c0_all)
        if why is not None and num_layers > 1:
            ctx.stats.details.append(f"stack mode not used: {why}")
    y = layer_input.transpose(1, 0, 2) if batch_first else layer_input
    h_n = _final_states(ctx, xp, [d.fwd.y[-1] for dirs in ctx.directions for d in dirs], "h_n")
    if not cell.has_cell_state:
        return y, h_n, ctx
    return y, (h_n, _final_states(ctx, xp, [d.fwd.cs[-1] for dirs in ctx.directions
                                            for d in dirs], "c_n")), ctx


def _final_states(ctx: Context, xp, arrays: list[Array], name: str) -> Array:
    """``h_n`` or ``c_n`` (``name``) stacked from ``arrays``: a new array, or the workspace of
    ``name`` for ``scratch_results``."""
    if ctx.scratch_results:
        return _stacked_scratch(xp, arrays, f"result_{name}")
    return _stacked(xp, arrays)


def _result_array(ctx: Context, xp, name: str, shape: tuple[int, ...], dtype) -> Array:
    """An array the call returns: new, or for ``scratch_results`` the workspace of ``name``."""
    if ctx.scratch_results:
        return workspace(xp, f"result_{name}", shape, dtype)
    return xp.empty(shape, dtype)


def _selected_input(xp, x: Array, lengths: Array) -> Array:
    """The layer's input with zeros past each length: padding is selected out, not multiplied
    away (NaN/Inf there must not reach any result). A 16-bit input is selected on its bits
    (+0.0 is all zero bits in every float format)."""
    if x.dtype.itemsize == 2:
        return select_active(xp, x.view(np.uint16), lengths).view(x.dtype)
    return select_active(xp, x, lengths)


def _stacked(xp, arrays: list[Array], fresh: bool = False) -> Array:
    """``xp.stack(arrays)``: a new array, in a fifth of the time for the usual single one.
    ``fresh``: arrays that nothing else holds, so a single one is returned as a view of itself
    and the rows, in order, of one array (a stack's) as that array."""
    if len(arrays) == 1:
        return arrays[0][None] if fresh else arrays[0][None].copy()
    whole = _rows_of(arrays) if fresh else None
    return xp.stack(arrays) if whole is None else whole


def _rows_of(arrays: list[Array]) -> Array | None:
    """The contiguous array whose rows 0, 1, ... ``arrays`` are, or ``None``."""
    whole = arrays[0].base
    if (whole is None or whole.shape != (len(arrays), *arrays[0].shape)
            or not whole.flags.c_contiguous):
        return None
    start, step = address(whole), whole.strides[0]
    if all(a.base is whole and address(a) == start + k * step for k, a in enumerate(arrays)):
        return whole
    return None


def _stacked_scratch(xp, arrays: list[Array], name: str) -> Array:
    """``xp.stack(arrays)`` into the reused workspace ``name`` (what a kernel reads during this
    call and nothing keeps: the initial states of a stack's backward)."""
    out = workspace(xp, name, (len(arrays), *arrays[0].shape), arrays[0].dtype)
    return xp.stack(arrays, out=out)


def _forward_layers(ctx: Context, layer_input: Array, h0_all: Array,
                    c0_all: Array | None) -> Array:
    """One launch per layer-direction (or the GEMM path); sets ``ctx``'s layers and stats and
    returns the last layer's output."""
    num_dirs = 2 if ctx.bidirectional else 1
    stats: dict[tuple[int, int], RunStats] = {}
    for layer in range(ctx.num_layers):
        ctx.inputs[layer] = layer_input
        ctx.directions[layer] = []
        for direction in range(num_dirs):
            k = layer * num_dirs + direction
            d = _Direction(_direction_names(ctx.params, layer, direction == 1), h0_all[k],
                           None if c0_all is None else c0_all[k], None)
            d.fwd, stats[layer, direction] = _start_direction(ctx, layer_input, d, direction == 1)
            ctx.directions[layer].append(d)
        layer_input = _layer_output(ctx, layer)
    ctx.stats = _merged(stats)
    return layer_input


def _forward_stack(ctx: Context, engine: Any, layer_input: Array, h0_all: Array,
                   c0_all: Array | None) -> Array:
    """The whole unidirectional stack in stack mode (``stack.forward``); sets ``ctx``'s layers
    and stats as ``_forward_layers`` does and returns the last layer's output."""
    if ctx.bidirectional:
        return _forward_pairs(ctx, engine, layer_input, h0_all, c0_all)
    names = [_direction_names(ctx.params, layer, False) for layer in range(ctx.num_layers)]
    weights = [_wide(ctx, _weights(ctx, n)) for n in names]
    results, ctx.stats = stack.forward(ctx.cell, engine,
                                       _input_projection(ctx, layer_input, names[0], "gi"),
                                       weights, h0_all, c0_all, ctx.lengths)
    for layer, fwd in enumerate(results):
        ctx.inputs[layer] = layer_input
        ctx.directions[layer] = [_Direction(names[layer], h0_all[layer],
                                            None if c0_all is None else c0_all[layer], fwd)]
        layer_input = _layer_output(ctx, layer)
    return layer_input


def _forward_pairs(ctx: Context, engine: Any, layer_input: Array, h0_all: Array,
                   c0_all: Array | None) -> Array:
    """A bidirectional stack in stack mode: per layer, one launch runs both directions side by
    side (the reverse one on its input reversed within each length, as ``_start_direction``
    feeds it); the layers one after another. Sets ``ctx`` as ``_forward_layers`` does."""
    xp = array_module(layer_input)
    ctx.stats = RunStats()
    for layer in range(ctx.num_layers):
        names = [_direction_names(ctx.params, layer, reverse) for reverse in (False, True)]
        gi = [_input_projection(ctx, layer_input, n, slot) for n, slot in
              zip(names, ("gi", "gi_reverse"))]
        pair = slice(2 * layer, 2 * layer + 2)
        c0 = None if c0_all is None else c0_all[pair]
        both = workspace(xp, "gi_pair", (2, *gi[0].shape), gi[0].dtype)
        xp.copyto(both[0], gi[0])
        _gather(ctx.reverse_index, gi[1], both[1])
        results, stats = stack.forward(ctx.cell, engine, both,
                                       [_wide(ctx, _weights(ctx, n)) for n in names],
                                       h0_all[pair], c0,
                                       ctx.lengths, chained=False)
        ctx.stats.merge(stats)
        ctx.inputs[layer] = layer_input
        ctx.directions[layer] = [
            _Direction(names[d], h0_all[2 * layer + d], None if c0 is None else c0[d], results[d])
            for d in (0, 1)]
        layer_input = _layer_output(ctx, layer)
    return layer_input


def _wide(ctx: Context, arrays: tuple) -> tuple:
    """``arrays`` (any may be ``None``) as the float32 values a 16-bit layer computes on
    (``halves.widen``); as they are for other layers."""
    if ctx.half is None:
        return arrays
    return tuple(widen(a) for a in arrays)


def _weights(ctx: Context, names: Mapping[str, str]) -> tuple:
    """``(w_ih, w_hh, b_ih, b_hh)`` of one layer-direction (biases ``None`` without bias), as
    the layer holds them (a 16-bit layer's possibly 16-bit: ``_wide``)."""
    params = ctx.params
    if "bias_ih" not in names:
        return params[names["weight_ih"]], params[names["weight_hh"]], None, None
    return (params[names["weight_ih"]], params[names["weight_hh"]], params[names["bias_ih"]],
            params[names["bias_hh"]])


def backward(ctx: Context, dy: Array, dhn: Any = None) -> tuple[Array, Any, dict[str, Array]]:
    """Gradients of one ``forward``: return ``(dx, dhx, grads)``.

    ``dy`` has ``y``'s shape (entries past a sequence's length are ignored); ``dhn``: ``None``
    (zero), ``dh_n``, or ``(dh_n, dc_n)`` for the LSTM (either may be ``None``). ``dhx`` is
    ``dh0`` or ``(dh0, dc0)``; ``grads`` has the keys of the parameters.
    """
    xp = array_module(dy)
    dy = dy.transpose(1, 0, 2) if ctx.batch_first else dy
    dhn, dcn = dhn if ctx.cell.has_cell_state and dhn is not None else (dhn, None)
    if ctx.half is not None:  # (the gradients are fp32 from here on; dy read, never kept)
        dy, dhn, dcn = widened(xp, dy, "dy_wide"), widen(dhn), widen(dcn)
    grads: dict[str, Array] = {}
    results: dict[tuple[int, int], runtime.BackwardResult] = {}
    d_out = dy if ctx.lengths is None else select_active(
        xp, dy, ctx.lengths, workspace(xp, "dy", dy.shape, dy.dtype))  # (read, never kept)
    engine, why = stack.engine(ctx.cell, dy, ctx.directions[0][0].h0.shape[1], ctx.num_layers,
                               ctx.bidirectional, ctx.algo, ctx.half, backward=True,
                               proj="weight_hr_l0" in ctx.params)
    if engine is not None:
        d_out = _backward_stack(ctx, engine, d_out, dhn, dcn, results, grads)
    else:
        d_out = _backward_layers(ctx, d_out, dhn, dcn, results, grads)
        if why is not None and ctx.num_layers > 1:
            ctx.backward_stats.details.append(f"stack mode not used: {why}")
    dx = d_out.transpose(1, 0, 2) if ctx.batch_first else d_out
    # dh0 and dc0 are rows of the call's own arrays (``_state_gradients``): no copy
    dh = _stacked(xp, [results[k].dh0 for k in sorted(results)], fresh=True)
    if not ctx.cell.has_cell_state:
        return dx, dh, grads
    return dx, (dh, _stacked(xp, [results[k].dc0 for k in sorted(results)], fresh=True)), grads


def _backward_layers(ctx: Context, d_out: Array, dhn: Array | None, dcn: Array | None,
                     results: dict, grads: dict[str, Array]) -> Array:
    """One launch per layer-direction (or the GEMM path), top-down; fills ``results`` and
    ``grads``, sets ``ctx.backward_stats`` and returns the gradient of the first layer's input."""
    xp = array_module(d_out)
    stats: dict[tuple[int, int], RunStats] = {}
    num_dirs = len(ctx.directions[0])
    dh, dc = _state_gradients(ctx, xp, d_out)
    for layer in range(ctx.num_layers - 1, -1, -1):
        for direction, d in enumerate(ctx.directions[layer]):
            k = layer * num_dirs + direction
            w_hh, w_hr = _param(ctx, d, "weight_hh"), _param(ctx, d, "weight_hr")
            results[layer, direction], stats[layer, direction] = runtime.backward(
                ctx.cell, _direction_gradient(ctx, xp, d_out, direction, d.h0.shape[1]),
                _pick(dhn, k), _pick(dcn, k), w_hh, d.h0, d.c0, ctx.lengths, d.fwd, ctx.algo,
                ctx.half, w_hr, slot=direction, out=(dh[k], _pick(dc, k)))
        d_out = _layer_gradients(ctx, layer, results, grads)
    ctx.backward_stats = _merged(stats)
    return d_out


def _state_gradients(ctx: Context, xp, d_out: Array) -> tuple[Array, Array | None]:
    """The call's ``dh0`` (L*D, B, width of h) and, for the LSTM, ``dc0`` (L*D, B, H): arrays
    (``_result_array``) whose rows each layer-direction's backward writes (returned as they
    are)."""
    first = ctx.directions[0][0]
    count, batch = ctx.num_layers * len(ctx.directions[0]), first.h0.shape[0]
    dh = _result_array(ctx, xp, "dh0", (count, batch, first.h0.shape[1]), d_out.dtype)
    if first.c0 is None:
        return dh, None
    return dh, _result_array(ctx, xp, "dc0", (count, batch, first.c0.shape[1]), d_out.dtype)


def _direction_gradient(ctx: Context, xp, d_out: Array, direction: int, width: int) -> Array:
    """The gradient of one direction's output (its part of ``d_out``), contiguous and, for the
    reverse direction, in its own time order: a reused workspace per direction (the backward
    reads it, nothing keeps it)."""
    part = d_out[:, :, direction * width:(direction + 1) * width]
    if direction == 1:
        return _gather(ctx.reverse_index, part,
                       workspace(xp, "dy_reversed", part.shape, part.dtype))
    if len(ctx.directions[0]) == 1 and part.flags.c_contiguous:
        return part
    return _copied(xp, part, "dy_direction")


def _copied(xp, a: Array, name: str) -> Array:
    """A contiguous copy of ``a`` in the workspace ``name`` (read within the call, never kept)."""
    out = workspace(xp, name, a.shape, a.dtype)
    xp.copyto(out, a)
    return out


def _backward_stack(ctx: Context, engine: Any, d_out: Array, dhn: Array | None,
                    dcn: Array | None, results: dict, grads: dict[str, Array]) -> Array:
    """The whole unidirectional stack in stack mode (``stack.backward``): the gradient reaching
    each layer's output from the layer above is formed inside the kernel, so only the first
    layer's input gradient is a GEMM here. Fills ``results`` and ``grads`` as
    ``_backward_layers`` does."""
    xp = array_module(d_out)
    if ctx.bidirectional:
        return _backward_pairs(ctx, engine, d_out, dhn, dcn, results, grads)
    dirs = [ctx.directions[layer][0] for layer in range(ctx.num_layers)]
    c0 = None if dirs[0].c0 is None else _stacked_scratch(xp, [d.c0 for d in dirs], "c0s")
    per_layer, ctx.backward_stats = stack.backward(
        ctx.cell, engine, xp.ascontiguousarray(d_out), dhn, dcn,
        [_wide(ctx, _weights(ctx, d.names)) for d in dirs],
        _stacked_scratch(xp, [d.h0 for d in dirs], "h0s"), c0, ctx.lengths, [d.fwd for d in dirs],
        out=_state_gradients(ctx, xp, d_out))
    for layer in range(ctx.num_layers - 1, -1, -1):
        results[layer, 0] = per_layer[layer]
        d_out = _layer_gradients(ctx, layer, results, grads, input_grad=layer == 0)
    return d_out


def _backward_pairs(ctx: Context, engine: Any, d_out: Array, dhn: Array | None,
                    dcn: Array | None, results: dict, grads: dict[str, Array]) -> Array:
    """A bidirectional stack in stack mode, top-down: per layer one launch runs the backward of
    both directions side by side. Fills ``results`` and ``grads`` as ``_backward_layers`` does."""
    xp = array_module(d_out)
    ctx.backward_stats = RunStats()
    dh, dc = _state_gradients(ctx, xp, d_out)
    for layer in range(ctx.num_layers - 1, -1, -1):
        dirs, pair = ctx.directions[layer], slice(2 * layer, 2 * layer + 2)
        hidden = dirs[0].h0.shape[1]
        dy = workspace(xp, "dy_pair", (2, *d_out.shape[:2], hidden), d_out.dtype)
        xp.copyto(dy[0], d_out[:, :, :hidden])
        _gather(ctx.reverse_index, d_out[:, :, hidden:], dy[1])
        c0 = None if dirs[0].c0 is None else _stacked_scratch(xp, [d.c0 for d in dirs], "c0s")
        per_direction, stats = stack.backward(
            ctx.cell, engine, dy, None if dhn is None else dhn[pair],
            None if dcn is None else dcn[pair],
            [_wide(ctx, _weights(ctx, d.names)) for d in dirs],
            _stacked_scratch(xp, [d.h0 for d in dirs], "h0s"), c0, ctx.lengths,
            [d.fwd for d in dirs], chained=False, out=(dh[pair], None if dc is None else dc[pair]))
        ctx.backward_stats.merge(stats)
        for direction, res in enumerate(per_direction):
            results[layer, direction] = res
        d_out = _layer_gradients(ctx, layer, results, grads)
    return d_out


def _start_direction(ctx: Context, layer_input: Array, d: _Direction,
                     reverse: bool) -> tuple[runtime.ForwardResult, RunStats]:
    """Project the input for all steps (one GEMM) and run this direction's recurrence."""
    w_ih, w_hh, b_ih, b_hh = _weights(ctx, d.names)
    w_hr = None if "weight_hr" not in d.names else ctx.params[d.names["weight_hr"]]
    xp = array_module(layer_input)
    slot = "gi_reverse" if reverse else "gi"
    # (W_hh and W_hr as they are: runtime takes 16-bit weights; a 16-bit b_hh widened)
    if ctx.half is not None:
        b_hh = widened(xp, b_hh, f"b_hh_{slot}")
    # gi is read by the recurrence alone (never kept): a reused workspace per direction
    gi = _projected(layer_input, w_ih, b_ih, slot, ctx.half)
    if reverse:
        gi = _gather(ctx.reverse_index, gi, workspace(xp, "gi_reversed", gi.shape, gi.dtype))
    return runtime.forward(ctx.cell, gi, w_hh, b_hh, d.h0, d.c0, ctx.lengths, ctx.algo,
                           ctx.half, w_hr)


def _param(ctx: Context, d: _Direction, kind: str) -> Array | None:
    """The parameter of ``kind`` of a layer-direction, ``None`` where the layer has none."""
    name = d.names.get(kind)
    return None if name is None else ctx.params[name]


def _input_projection(ctx: Context, layer_input: Array, names: Mapping[str, str],
                      slot: str) -> Array:
    """``layer_input @ W_ih^T + b_ih`` for all steps: one GEMM (``_projected``)."""
    w_ih, _, b_ih, _ = _weights(ctx, names)
    return _projected(layer_input, w_ih, b_ih, slot, ctx.half)


def _projected(layer_input: Array, w_ih: Array, b_ih: Array | None, slot: str,
               half: str | None) -> Array:
    """``_input_projection`` with the weights given, into the reused workspace ``slot`` (the
    recurrence reads it and nothing keeps it; ``buffers.workspace``) where the dtypes agree.
    A 16-bit layer's: a float32 product of the 16-bit operands (``matmul.matmul_half``)."""
    steps, batch, _ = layer_input.shape
    if half is not None:
        xp = array_module(layer_input)
        out = workspace(xp, slot, (steps * batch, w_ih.shape[0]), np.float32)
        gi = matmul_half(layer_input.reshape(steps * batch, -1), w_ih.T, half, out).reshape(
            steps, batch, w_ih.shape[0])
        b_ih = widened(xp, b_ih, f"b_ih_{slot}")
    else:
        out = (workspace(array_module(layer_input), slot, (steps * batch, w_ih.shape[0]),
                         w_ih.dtype) if layer_input.dtype == w_ih.dtype else None)
        gi = matmul_steps(layer_input, w_ih.T, out)
    if b_ih is not None:
        gi += b_ih
    return gi


def _layer_output(ctx: Context, layer: int) -> Array:
    """The output of ``layer`` (T, B, D*H): its directions side by side, zero past lengths."""
    dirs = ctx.directions[layer]
    returned = ctx.scratch_results and layer == ctx.num_layers - 1
    # a copy even of one direction: y must not alias the buffers backward reads
    if len(dirs) == 1 and ctx.lengths is None and not returned:  # (the usual case: fewer calls)
        return dirs[0].fwd.y.copy()
    forward = dirs[0].fwd.y
    xp = array_module(forward)
    width = forward.shape[2]
    # (the one array made: the call's output, or the layer above's input)
    out = (_result_array(ctx, xp, "y", (*forward.shape[:2], len(dirs) * width), forward.dtype)
           if returned else xp.empty((*forward.shape[:2], len(dirs) * width), forward.dtype))
    if len(dirs) == 1:  # (selected into out: no copy first)
        if ctx.lengths is None:
            xp.copyto(out, forward)
            return out
        return select_active(xp, forward, ctx.lengths, out)
    backward = dirs[1].fwd.y
    out[:, :, :width] = forward
    out[:, :, width:] = _gather(ctx.reverse_index, backward,
                                workspace(xp, "y_reversed", backward.shape, backward.dtype))
    return select_active(xp, out, ctx.lengths, out)


def _layer_gradients(ctx: Context, layer: int, results: Mapping[tuple[int, int], Any],
                     grads: dict[str, Array], input_grad: bool = True) -> Array | None:
    """Set the parameter gradients of ``layer`` in ``grads``; return the gradient of its input
    (``None`` without ``input_grad``: stack mode formed it inside the kernel)."""
    layer_input = ctx.inputs[layer]
    xp = array_module(layer_input)
    flat_input = layer_input.reshape(-1, layer_input.shape[2])
    if ctx.half is not None:  # (a 16-bit first input: float32 for the GEMM with fp32 dgi)
        flat_input = widened(xp, flat_input, "input_wide")
    d_in = None
    for direction, d in enumerate(ctx.directions[layer]):
        res = results[layer, direction]
        dgi = res.dgi if direction == 0 else _gather(
            ctx.reverse_index, res.dgi, workspace(xp, "dgi_reversed", res.dgi.shape,
                                                  res.dgi.dtype))
        names = [d.names[n] for n in PARAMETER_GRADIENTS if n in d.names]
        grads.update(zip(names, parameter_gradients(dgi, res.dgh, flat_input, d.fwd.y, d.h0,
                                                    "bias_ih" in d.names, half=ctx.half)))
        if "weight_hr" in d.names:
            grads[d.names["weight_hr"]] = projection_gradient(res.drs, d.fwd.hs, half=ctx.half)
        if input_grad:
            w_ih = ctx.params[d.names["weight_ih"]]
            if ctx.half is not None:
                w_ih = widened(xp, w_ih, f"w_ih_wide{direction}")
            part = matmul_steps(dgi, w_ih, _input_gradient_target(ctx, xp, layer, d_in, dgi,
                                                                  w_ih))
            if d_in is None:
                d_in = part
            else:  # (in place: the same sum)
                d_in += part
    if not input_grad:
        return None
    return d_in if d_in is not None else xp.zeros(layer_input.shape, flat_input.dtype)


def _input_gradient_target(ctx: Context, xp, layer: int, d_in: Array | None, dgi: Array,
                           w_ih: Array) -> Array | None:
    """Where a direction's part of a layer's input gradient goes (2-D): a new array for the
    first layer's (the call's ``dx``; a workspace for ``scratch_results``), reused workspaces
    for what is read within the call (the second direction's part, added in place; a higher
    layer's input gradient, the output gradient of the layer below)."""
    if d_in is None and layer == 0 and not ctx.scratch_results:
        return None
    name = ("d_in_part" if d_in is not None else "d_layer_input" if layer else "result_dx")
    return workspace(xp, name, (dgi.shape[0] * dgi.shape[1], w_ih.shape[1]), dgi.dtype)


def _merged(stats: Mapping[tuple[int, int], RunStats]) -> RunStats:
    """One ``RunStats`` over all layer-directions (in order); a single layer-direction's own
    (made for this call: nothing else holds it)."""
    if len(stats) == 1:
        for only in stats.values():
            return only
    total = RunStats()
    for key in sorted(stats):
        total.merge(stats[key])
    return total


def _initial_states(cell: CellSpec, xp, hx: Any, count: int, batch: int, widths: tuple[int, int],
                    dtype) -> tuple[Array, Array | None]:
    """``(h0, c0)`` of shape (L*D, B, width) each (``widths`` of h and c: (H, H), or (P, H) with
    a projection; ``c0`` only for the LSTM), zeros where not given."""
    h0, c0 = hx if cell.has_cell_state and hx is not None else (hx, None)
    # Zeros not given are a shared read-only constant: nothing writes an initial state.
    h0 = (constant_zeros(xp, (count, batch, widths[0]), dtype) if h0 is None
          else xp.ascontiguousarray(h0))
    if not cell.has_cell_state:
        return h0, None
    c0 = (constant_zeros(xp, (count, batch, widths[1]), dtype) if c0 is None
          else xp.ascontiguousarray(c0))
    return h0, c0


def _reverse_index(xp, steps: int, batch: int, lengths: Array | None) -> Array:
    """The (T*B,) row index reversing each sequence within its length (later steps stay in
    place): row ``t*B + b`` of a (T, B, X) array seen as (T*B, X) rows comes from row
    ``s*B + b``, ``s = lengths[b]-1-t``. Without lengths a shared constant; with them the one
    new array (the context keeps it), formed in workspaces.

    The mapping is its own inverse, so the same gather reverses and un-reverses.
    """
    if lengths is None:
        return reversed_rows(xp, steps, batch)
    out = xp.empty((steps * batch,), np.intp)
    reverse_index_into(xp, lengths, reverse_scratch(xp, steps, batch), out)
    return out


def reverse_scratch(xp, steps: int, batch: int) -> tuple[Array, Array, Array, Array]:
    """What ``reverse_index_into`` computes with: the step indices (T, 1), the workspaces of
    the rows and of the steps past each length (T, B), the batch indices (1, B)."""
    return (step_indices(xp, steps)[:, :, 0],
            workspace(xp, "reverse_rows", (steps, batch), np.intp),
            workspace(xp, "reverse_past", (steps, batch), np.bool_),
            step_indices(xp, batch).reshape(1, batch))


def reverse_index_into(xp, lengths: Array, scratch: tuple, out: Array) -> None:
    """``_reverse_index`` of ``lengths`` into ``out`` (T*B,) with ``reverse_scratch``'s arrays
    (held by a call plan, whose chain computes it: nothing looked up)."""
    t, rows, past, batch_index = scratch
    xp.subtract(lengths[None, :], t, out=rows)
    rows -= 1
    xp.greater_equal(t, lengths[None, :], out=past)
    xp.copyto(rows, t, where=past)
    rows *= rows.shape[1]
    rows += batch_index
    xp.copyto(out, rows.reshape(-1))


def _gather(index: Array, a: Array, out: Array | None = None) -> Array:
    """``a`` (T, B, X) with its rows (as (T*B, X)) taken by ``index`` (``_reverse_index``),
    into ``out`` (contiguous, ``a``'s shape) where given, else a new array."""
    xp = array_module(a)
    steps, batch, width = a.shape
    out = xp.empty(a.shape, a.dtype) if out is None else out
    if not a.flags.c_contiguous:  # (a direction's part of a gradient: take would copy it)
        a = _copied(xp, a, "gather_source")
    # (NumPy: "clip", valid indices anyway, gathers into out without a buffer)
    extra = {"mode": "clip"} if xp is np else {}
    xp.take(a.reshape(steps * batch, width), index, axis=0, out=out.reshape(steps * batch, width),
            **extra)
    return out


# The parameter gradients ``parameter_gradients`` forms, in its order (a layer without biases:
# the first two).
PARAMETER_GRADIENTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def parameter_gradients(dgi: Array, dgh: Array, flat_input: Array, y: Array, h0: Array,
                        bias: bool, out: tuple | None = None, scratch: Array | None = None,
                        half: str | None = None) -> tuple:
    """One layer-direction's ``(dW_ih, dW_hh, db_ih, db_hh)`` (the biases' only with ``bias``)
    from its gate gradients ``dgi``, ``dgh`` (T, B, G), its input as rows (T*B, I), its outputs
    ``y`` (T, B, H) and initial state ``h0`` (B, H): new arrays, or written into ``out``'s
    (``PARAMETER_GRADIENTS`` order) with ``scratch`` the workspace of ``dW_hh``'s second product
    - what a planned call's chain computes in place (``call_plans``), with the same products
    and sums. ``half``: the layer's 16-bit dtype, its products then in TF32
    (``gradient_tf32``)."""
    targets = out if out is not None else (None,) * len(PARAMETER_GRADIENTS)
    dgi_2d, tf32 = dgi.reshape(-1, dgi.shape[2]), gradient_tf32(half)
    w_ih = matmul(dgi_2d.T, flat_input, targets[0], tf32)
    w_hh = _recurrent_weight_grad(dgh, y, h0, targets[1], scratch, tf32)
    if not bias:
        return w_ih, w_hh
    return (w_ih, w_hh, column_sums(dgi_2d, targets[2]),
            column_sums(dgh.reshape(-1, dgh.shape[2]), targets[3]))


def projection_gradient(drs: Array, hs: Array, out: Array | None = None,
                        half: str | None = None) -> Array:
    """An LSTM projection's ``dW_hr = sum_t dr_t^T h_t`` (``drs``: the backward's dr_t, ``hs``
    the forward's h_t, both (T, B, H)): one product over all steps, into ``out`` where given;
    in TF32 for a 16-bit layer (``half``, ``gradient_tf32``)."""
    return matmul(drs.reshape(-1, drs.shape[2]).T, hs.reshape(-1, hs.shape[2]), out,
                  gradient_tf32(half))


def gradient_tf32(half: str | None) -> bool | None:
    """``matmul``'s ``tf32`` for a layer's weight-gradient products: a 16-bit layer's (``half``)
    always in TF32, on the tensor cores (their second operands, the layer's 16-bit activations
    and inputs, are exact in TF32; the fp32 gate gradients rounded to it: docs/api.md, "16-bit
    layers"), a float32 layer's as ``settings.allow_tf32`` says (``None``)."""
    return True if half is not None else None


def _recurrent_weight_grad(dgh: Array, y: Array, h0: Array, out: Array | None = None,
                           scratch: Array | None = None, tf32: bool | None = None) -> Array:
    """``dW_hh = sum_t dgh_t^T h_{t-1}`` as two GEMMs (step 0 reads ``h0``, the rest ``y``), into
    ``out`` where given; the second product in ``scratch`` (else a reused workspace); ``tf32``:
    ``matmul``'s."""
    width = dgh.shape[2]
    grad = matmul(dgh[0].T, h0, out, tf32)
    if dgh.shape[0] > 1:  # (the second product in a reused workspace: only grad is new)
        if scratch is None:
            scratch = workspace(array_module(grad), "dw_hh", grad.shape, grad.dtype)
        grad += matmul(dgh[1:].reshape(-1, width).T, y[:-1].reshape(-1, y.shape[2]), scratch,
                       tf32)
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
    if half is not None:  # (the recurrence's states are float32)
        hx = _widened_states(hx)
    h0_all, c0_all = _initial_states(cell, xp, hx, num_layers * num_dirs, batch, widths,
                                     np.float32 if half is not None else x.dtype)
    if lengths is not None:
        lengths = xp.asarray(lengths, dtype=np.int32)
    # (every field given: no default factory runs per call; ``stats`` is set by the pass)
    ctx = Context(cell, params, num_layers, bidirectional, batch_first, algo, lengths,
                  _reverse_index(xp, steps, batch, lengths) if bidirectional else None, half,
                  [None] * num_layers, [[] for _ in range(num_layers)], _NO_STATS)
    return ctx, xp, h0_all, c0_all


def _widened_states(hx: Any) -> Any:
    """``hx`` (``None``, ``h0`` or ``(h0, c0)``, any of them ``None``) in float32 values."""
    if isinstance(hx, (tuple, list)):
        return tuple(widen(h) for h in hx)
    return widen(hx)


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
    ctx.inputs = ([x if lengths is None else _selected_input(xp, x, lengths)]
                  + [next(rest) for _ in range(num_layers - 1)])
    ctx.directions, ctx.stats = [], RunStats()
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
