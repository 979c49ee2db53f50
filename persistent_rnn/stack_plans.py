"""A stack-mode call planned (issue 26): a unidirectional float32 stack whose layers run in one
launch per pass (``stack``), with every operation of the call inside that pass's chain.

As ``call_plans.Plan`` does for one layer-direction (its checks, ``matches``, and its
``backward``'s choice between the prepared pass and the full path are inherited), a
``StackPlan`` keeps what depends only on the call's signature - the engines, the workspaces
the stack kernels read (layer 0's input projection, the stacked weights and biases, the
backward's gate gradients and carries), the kernels' arguments but this call's arrays - and a
call makes only its new arrays and enqueues one chain per pass (``stack.run_forward`` /
``run_backward`` with a ``stack.Around``), which holds every operation of the call as
``functional``'s stack mode makes them: forward - the input formed (copied where strided,
selected with lengths), layer 0's input GEMM and bias, the weights and biases stacked (an
optimizer may have changed them in place), then each layer's output copied (selected with
lengths) into the layer above's input or the call's output, ``h_n`` and ``c_n``; backward -
``dy`` selected with lengths, the carries zeroed, ``W_hh^T`` and ``W_ih^T`` stacked, then
``dh0``, ``dc0``, every layer's parameter gradients, ``dx`` and the layer API's sums of the
gradients. So on a GPU a call in steady state is one graph launch per pass
(``chain_graphs``). The stack kernels read the forward's own (L, T, B, .) buffers, which the
call's ``Context`` keeps (``stacked``), where the full path copies them into workspaces: the
same values, bitwise the same results (tests/test_call_plans.py).

Not planned here: 16-bit stacks (their weights are packed into words: ``stack._matrices``),
bidirectional layers and stacks that do not fit stack mode (``call_plans.plan_of``).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import buffers, chain_graphs, functional, runtime, settings, stack
from .buffers import matmul_steps, select_active, workspace
from .call_plans import _GRADIENTS, Plan, _same_memory, _where, formed_input

Array = Any


def stack_engine(ctx: functional.Context, data: Array, backward: bool) -> Any:
    """The stack-mode engine a unidirectional float32 call of ``ctx`` runs on, or ``None``."""
    hidden = ctx.directions[0][0].h0.shape[1]
    engine, _ = stack.engine(ctx.cell, data, hidden, ctx.num_layers, False, ctx.algo, None,
                             backward, proj="weight_hr_l0" in ctx.params)
    return engine


class StackPlan(Plan):
    """One stack-mode call of one signature (module docstring)."""

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool,
                 engine: Any):
        self.states, self.lengths = states, lengths
        self.key: tuple = ()
        self.accumulates = False
        self.cell, self.algo, self.half, self.proj = ctx.cell, ctx.algo, None, 0
        self.xp = xp = buffers.array_module(x)
        self.x_type, self.x_shape, self.x_dtype = type(x), x.shape, x.dtype
        self.where, self.settings = _where(xp), settings.current()
        self.generation = buffers.generation()
        layers, (steps, batch, _) = ctx.num_layers, x.shape
        self.layer_names = [ctx.directions[k][0].names for k in range(layers)]
        # (all parameters by name: ``Plan._same_weights`` checks them)
        self.names = {n: n for names in self.layer_names for n in names.values()}
        self.weights = tuple(ctx.params[n] for n in self.names)
        w_hh = self._layers()[0][1]
        gates, hidden = w_hh.shape[0], w_hh.shape[1]
        self.hidden = hidden
        self.state_shape = self.c_shape = (layers, batch, hidden)
        self.y_shape = (steps, batch, hidden)
        self.h0, self.c0 = functional._initial_states(ctx.cell, xp, None, layers, batch,
                                                      (hidden, hidden), np.float32)
        self.engine = engine
        self.backward_pass: Any = None  # (the backward's arguments, once prepared)
        self.backward_engine: Any = None
        self.gradient_roles: tuple[str, ...] = ()
        self.mask = buffers.mask_arrays(xp, x) if lengths else None
        self.all_steps = buffers.full_lengths(xp, None, batch, steps)
        self.gi = workspace(xp, "gi", (steps * batch, gates), np.float32)
        self.stacked = dict(
            w_ih=workspace(xp, "stack_w_ih", (layers - 1, gates, hidden), np.float32),
            w_hh=workspace(xp, "stack_w_hh", (layers, gates, hidden), np.float32),
            b_ih=workspace(xp, "stack_bias2", (layers, gates), np.float32),
            b_hh=workspace(xp, "stack_bias3", (layers, gates), np.float32))
        self.zero_bias = buffers.constant_zeros(xp, (gates,), np.float32)

    def _layers(self) -> list[tuple]:
        """Each layer's ``(w_ih, w_hh, b_ih, b_hh)`` (biases ``None`` without them): the
        weights the plan holds now (``_rebind``)."""
        params = dict(zip(self.names, self.weights))
        return [tuple(params.get(names.get(kind)) for kind in functional.PARAMETER_GRADIENTS)
                for names in self.layer_names]

    def _rebind(self, params: Mapping[str, Array]) -> bool:
        """``Plan._same_weights`` of new array objects over the planned ones' memory: kept (the
        chains read the plan's weights when they are issued)."""
        weights = tuple(params.get(name) for name in self.names)
        if not all(_same_memory(new, old) for new, old in zip(weights, self.weights)):
            return False
        self.weights = weights
        return True

    def forward(self, x: Array, hx: Any, params: Mapping[str, Array],
                lengths: Any = None) -> tuple[Array, Array | tuple, functional.Context]:
        """``Plan.forward`` of a stack: ``functional.forward`` of a matching call."""
        xp, cell = self.xp, self.cell
        h0, c0 = (self.h0, self.c0) if hx is None else _contiguous(
            xp, hx if cell.has_cell_state else (hx, None))
        layer_input, given = x, None
        if lengths is not None or not x.flags.c_contiguous:  # (formed in the chain)
            layer_input, given = xp.empty(x.shape, x.dtype), x
        layers = self.state_shape[0]
        steps, batch, _ = x.shape
        y = xp.empty((layers, steps, batch, self.hidden), np.float32)
        cs = xp.empty_like(y) if cell.has_cell_state else None
        saved = xp.empty((layers, steps, batch, cell.saved * self.hidden), np.float32)
        inputs = [layer_input] + [xp.empty(self.y_shape, np.float32) for _ in range(layers - 1)]
        out = xp.empty(self.y_shape, np.float32)
        h_n = xp.empty(self.state_shape, np.float32)
        c_n = None if cs is None else xp.empty(self.state_shape, np.float32)
        args = stack.forward_arguments(
            self.stacked, self.gi.reshape(steps, batch, -1), h0, h0 if c0 is None else c0,
            self.all_steps if lengths is None else lengths, True, y, cs, saved)
        call = (given, inputs, out, h_n, c_n, lengths, y, cs)
        stats = stack.run_forward(self.engine, args, xp, stack.Around(
            lambda: self._before_forward(call), lambda: self._after_forward(call),
            lambda: self._key("forward", (given, tuple(inputs), out, h_n, c_n))))
        ctx = functional.Context(cell, params, layers, False, False, self.algo, lengths, None,
                                 None, inputs, [[functional._Direction(
                                     self.layer_names[k], h0[k], None if c0 is None else c0[k],
                                     runtime.ForwardResult(y[k], None if cs is None else cs[k],
                                                           saved[k]))]
                                     for k in range(layers)], stats)
        ctx.plan, ctx.stacked = self, (y, cs, saved, h0, c0)
        return out, (h_n if cs is None else (h_n, c_n)), ctx

    def _before_forward(self, call: tuple) -> None:
        """Inside the forward's chain, before its pass: the input formed, layer 0's input
        projection ``gi = x W_ih^T + b_ih`` and the weights and biases stacked, as
        ``functional._forward_stack`` and ``stack.forward`` make them."""
        xp, (given, inputs, _, _, _, lengths, _, _) = self.xp, call
        formed_input(xp, given, inputs[0], lengths, self.mask)
        layers = self._layers()
        matmul_steps(inputs[0], layers[0][0].T, self.gi)
        if layers[0][2] is not None:
            self.gi += layers[0][2]
        s = self.stacked
        if len(layers) > 1:
            xp.stack([w[0] for w in layers[1:]], out=s["w_ih"])
        xp.stack([w[1] for w in layers], out=s["w_hh"])
        for which, key in ((2, "b_ih"), (3, "b_hh")):
            xp.stack([self.zero_bias if w[which] is None else w[which] for w in layers],
                     out=s[key])

    def _after_forward(self, call: tuple) -> None:
        """Inside the forward's chain, after its completion: each layer's output copied (with
        lengths selected) into the layer above's input or the call's output, and ``h_n``,
        ``c_n``, as ``functional._layer_output`` and ``_final_states`` make them."""
        xp, (_, inputs, out, h_n, c_n, lengths, y, cs) = self.xp, call
        for k, target in enumerate(inputs[1:] + [out]):
            if lengths is None:
                xp.copyto(target, y[k])
            else:
                select_active(xp, y[k], lengths, target, self.mask)
        xp.copyto(h_n, y[:, -1])
        if cs is not None:
            xp.copyto(c_n, cs[:, -1])

    def _key(self, what: str, arrays: tuple) -> tuple:
        """What a pass's chain graph is keyed by beside its launches' arguments (``stack.Around``):
        the plan and which pass, its fixed arrays and weights, and this call's ``arrays`` (on a
        GPU: ``chain_graphs.value``)."""
        held = (self.gi, self.mask, self.zero_bias, self.weights,
                None if self.backward_pass is None else (self.backward_pass["dw_hh"],
                                                         self.backward_pass["dy"]))
        return what, id(self), chain_graphs.value(held + arrays)

    def plan_backward(self, ctx: functional.Context, dy: Array) -> None:
        """After a backward of this plan's context that ran the whole way in stack mode:
        prepare the later ones (their engine and the workspaces the full path uses)."""
        stats = ctx.backward_stats
        if stats is None or stats.algo != "persistent":
            return
        engine = stack_engine(ctx, dy, backward=True)
        if engine is None:
            return
        xp, cell = self.xp, self.cell
        layers, batch, hidden = self.state_shape
        steps = self.x_shape[0]
        shape, carry = (layers, steps, batch, cell.gates * hidden), (layers, steps + 1, batch,
                                                                      hidden)
        dgi = workspace(xp, "stack_dgi", shape, np.float32)
        dh_carry = workspace(xp, "stack_dh_carry", carry, np.float32)
        self.backward_pass = dict(
            w_t=workspace(xp, "stack_w_t", (layers, hidden, shape[3]), np.float32),
            w_ih_t=workspace(xp, "stack_w_ih_t", (layers - 1, hidden, shape[3]), np.float32),
            scratch=(dgi, workspace(xp, "stack_dgh", shape, np.float32) if cell.separate_dgh
                     else dgi, dh_carry, workspace(xp, "stack_dc_carry", carry, np.float32)
                     if cell.has_cell_state else dh_carry),
            dy=workspace(xp, "dy", self.y_shape, np.float32) if self.lengths else None,
            dw_hh=workspace(xp, "dw_hh", (shape[3], hidden), np.float32),
            grads={name: workspace(xp, "plan_grad " + name, w.shape, np.float32)
                   for name, w in zip(self.names, self.weights)} if self.accumulates else None)
        self.backward_engine = engine

    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``Plan.backward`` by the prepared stack pass: this call's new result arrays, written
        inside its chain."""
        xp, prepared, lengths = self.xp, self.backward_pass, ctx.lengths
        y, cs, saved, h0, c0 = ctx.stacked
        args = stack.backward_arguments(
            {"w_t": prepared["w_t"], "w_ih_t": prepared["w_ih_t"]},
            dy if lengths is None else prepared["dy"], y, cs, saved, h0,
            h0 if c0 is None else c0, self.all_steps if lengths is None else lengths, True,
            prepared["scratch"])
        dx = xp.empty(self.x_shape, dy.dtype)
        dh = xp.empty(self.state_shape, np.float32)
        dc = None if c0 is None else xp.empty(self.state_shape, np.float32)
        grads = prepared["grads"] or {n: xp.empty(w.shape, w.dtype)
                                      for n, w in zip(self.names, self.weights)}
        into = tuple(into[n] for n in self.names) if self.accumulates else None
        call = (ctx, dy, args, dx, dh, dc, grads, into)
        ctx.backward_stats = stack.run_backward(self.backward_engine, args, xp, stack.Around(
            lambda: self._before_backward(call), lambda: self._after_backward(call),
            lambda: self._key("backward", (dy, dx, dh, dc, tuple(grads.values()), into,
                                           tuple(ctx.inputs)))))
        return dx, (dh if dc is None else (dh, dc)), ({} if self.accumulates else grads)

    def _before_backward(self, call: tuple) -> None:
        """Inside the backward's chain, before its pass: ``dy`` selected with lengths, the
        carries zeroed, ``W_hh^T`` and ``W_ih^T`` stacked, as ``functional.backward`` and
        ``stack.backward`` make them."""
        xp, (ctx, dy, args, *_) = self.xp, call
        if ctx.lengths is not None:
            select_active(xp, dy, ctx.lengths, args["dy"], self.mask)
        args["dh_carry"].fill(0)
        if self.cell.has_cell_state:
            args["dc_carry"].fill(0)
        layers = self._layers()
        xp.stack([w[1].T for w in layers], out=args["w_t"])
        if len(layers) > 1:
            xp.stack([w[0].T for w in layers[1:]], out=args["w_ih_t"])

    def _after_backward(self, call: tuple) -> None:
        """Inside the backward's chain, after its completion: ``dh0``, ``dc0``
        (``stack.initial_state_gradients``), each layer's parameter gradients
        (``functional.parameter_gradients``), ``dx`` and, where the plan accumulates, the
        gradients added into its caller's, as ``functional._backward_stack`` and the layer API
        form them."""
        xp, (ctx, _, args, dx, dh, dc, grads, into) = self.xp, call
        layers = self._layers()
        stack.initial_state_gradients(xp, args, [w[1] for w in layers], dh, dc)
        for k in range(len(layers) - 1, -1, -1):
            d, layer_input = ctx.directions[k][0], ctx.inputs[k]
            names = [d.names[n] for n in _GRADIENTS if n in d.names]
            functional.parameter_gradients(
                args["dgi"][k], args["dgh"][k], layer_input.reshape(-1, layer_input.shape[2]),
                d.fwd.y, d.h0, "bias_ih" in d.names, tuple(grads[n] for n in names),
                self.backward_pass["dw_hh"])
        matmul_steps(args["dgi"][0], layers[0][0], dx.reshape(-1, dx.shape[2]))
        if into is not None:  # (as the layer API adds a full call's: ``layers``)
            for total, name in zip(into, self.names):
                total += grads[name]

    def _backward_current(self, ctx: functional.Context) -> bool:
        """``Plan._backward_current``, and a context this plan's forward made."""
        return ctx.stacked is not None and super()._backward_current(ctx)


def _contiguous(xp, states: tuple) -> tuple:
    """The given initial states as the kernels read them: as they are where contiguous (the
    usual case: nothing to enqueue), else copied, as ``functional._initial_states`` does."""
    return tuple(a if a is None or a.flags.c_contiguous else xp.ascontiguousarray(a)
                 for a in states)


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> StackPlan | None:
    """The ``StackPlan`` of a forward that ran the whole way in stack mode, or ``None``."""
    if (ctx.num_layers < 2 or ctx.bidirectional or ctx.half is not None
            or x.dtype != np.float32 or "weight_hr_l0" in ctx.params):
        return None
    engine = stack_engine(ctx, x, backward=False)
    if engine is None or not any("stack of" in d for d in ctx.stats.details):
        return None
    return StackPlan(ctx, x, hx is not None, lengths is not None, engine)
