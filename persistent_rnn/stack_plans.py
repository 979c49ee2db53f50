"""A stack-mode call planned (issue 26): a unidirectional stack whose layers run in one
launch per pass (``stack``), with every operation of the call inside that pass's chain; and
(``PairPlan``) a bidirectional layer or stack whose layers run both directions side by side,
one chain per layer, all of a pass's chains in one graph (``launch.one_graph``). float32,
float16 or bfloat16.

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
(``chain_graphs``; a pair plan's chains too, in one ``launch.one_graph``). The stack kernels read the forward's own (L, T, B, .) buffers, which the
call's ``Context`` keeps (``stacked``), where the full path copies them into workspaces: the
same values, bitwise the same results (tests/test_call_plans.py).

A 16-bit call (the layer's ``half``) has the full path's conversions inside its chains too,
into workspaces made once per plan (``wide``, and the backward's): the weights' 16-bit bits
copied into the plan's packed words every call (``_matrices``, ``_stack_into``: what
``stack._matrices`` packs from widened copies, without the copies), the given states, biases,
``dy``, the first layer's input and ``W_hh`` / ``W_ih`` for the products widened, the input
projections of 16-bit operands (``_projection``), the results and gradients rounded into the
call's arrays (summed in float32 with the caller's first where the plan accumulates).

Not planned: projections (never in stack mode). Stacks and bidirectional layers run one
layer-direction per launch (the ``stack`` setting off, or too large for stack mode):
``layer_plans``.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import buffers, chain_graphs, functional, launch, runtime, stack
from .buffers import select_active, workspace
from .call_plans import (_GRADIENTS, _SUM, Plan, _bits, _narrowed, _refresh, _same_memory,
                         contiguous_states, formed_input, holds)
from .halves import half_dtype, widen
from .matmul import matmul_half, matmul_steps
from .stats import RunStats

Array = Any


def stack_engine(ctx: functional.Context, data: Array, backward: bool) -> Any:
    """The stack-mode engine a call of ``ctx`` runs on, or ``None``."""
    hidden = ctx.directions[0][0].h0.shape[1]
    engine, _ = stack.engine(ctx.cell, data, hidden, ctx.num_layers, ctx.bidirectional,
                             ctx.algo, ctx.half, backward, proj="weight_hr_l0" in ctx.params)
    return engine


# (the stack kernels' arguments that are a call's arrays, not the plan's: ``stack.Around``; of
# those, the ones whose layout the plan fixes: the activations it makes, the states it makes or
# checks and makes contiguous, the ``dy`` its callers check or its workspace)
_PER_CALL = ("dy", "y", "cs", "saved", "h0", "c0", "lengths")
_ADDRESSED = frozenset(_PER_CALL) - {"lengths"}
_INDICES = tuple(range(64))  # (``_key``'s positions of its ``made`` arrays)


def _present(h: Array, c: Array | None) -> tuple:
    """``(h, c)``, or ``(h,)`` without a cell state: a call's arrays of fixed layout among the
    states (``_key``'s ``made``; never ``None``)."""
    return (h,) if c is None else (h, c)


def _matrices(xp, name: str, shape: tuple[int, int, int], words: str | None) -> Array:
    """The workspace a stack kernel reads matrices of ``shape`` (groups, rows, K) from: float32,
    or where its weights are 16-bit (``words``: ``stack._weights_dtype``) uint32 words of two
    16-bit values, (groups, rows, ceil(K/2)) as ``stack._matrices`` packs them, the padding of
    an odd K zeroed once here (``_stack_into`` writes the values' bits only)."""
    if words is None:
        return workspace(xp, name, shape, np.float32)
    groups, rows, cols = shape
    held = workspace(xp, f"plan {name} words", (groups, rows, cols + cols % 2), np.uint16)
    held[..., cols:] = 0
    return held.view(np.uint32)


class StackPlan(Plan):
    """One stack-mode call of one signature (module docstring)."""

    chained = True  # (the kernels' groups are layers, each reading the one below)

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool,
                 engine: Any):
        xp = self._signature(ctx, x, states, lengths)
        steps, batch, _ = x.shape
        self.layer_names = self._groups(ctx)
        self.num_layers = ctx.num_layers
        layers = len(self.layer_names)
        # (all parameters by name: ``Plan._same_weights`` checks them)
        self._hold_weights({n: n for names in self.layer_names for n in names.values()},
                           ctx.params)
        self._index = {n: k for k, n in enumerate(self.names)}  # (a name's place in ``into``)
        w_hh = self._layers()[0][1]
        gates, hidden = w_hh.shape[0], w_hh.shape[1]
        self.hidden = hidden
        self.state_shape = self.c_shape = (layers, batch, hidden)
        self.y_shape = (steps, batch, hidden * (1 + ctx.bidirectional))
        self.h0, self.c0 = functional._initial_states(ctx.cell, xp, None, layers, batch,
                                                      (hidden, hidden), np.float32)
        self.engine = engine
        self.backward_pass: Any = None  # (the backward's arguments, once prepared)
        self.backward_engine: Any = None
        self._fixed_key: tuple | None = None  # (``_key``'s fixed part: (backward_pass, value))
        self.sums: tuple | None = None  # (the caller's arrays a backward adds into: ``_held_sums``)
        # (per pass, its ``stack.Around.fixed``: made anew with the prepared backward)
        self.fixed_arguments: dict[Any, dict] = {}
        self.all_steps = buffers.full_lengths(xp, None, batch, steps)
        self.gi = workspace(xp, "gi", (steps * batch, gates), np.float32)
        # (what the float32 outputs and dy are selected with; the input on its bits: a 16-bit
        # input's, as ``functional._selected_input``)
        self.mask = buffers.mask_arrays(xp, self.gi.reshape(steps, batch, -1)) if lengths else None
        self.x_mask = buffers.mask_arrays(xp, _bits(x)) if lengths else None
        groups = self.kernel_groups = layers if self.chained else 2  # (a launch's groups)
        words = stack._weights_dtype(engine)
        self.stacked = dict(
            w_ih=self._w_ih_stack(xp, groups, gates, hidden, words),
            w_hh=_matrices(xp, "stack_w_hh", (groups, gates, hidden), words),
            b_ih=workspace(xp, "stack_bias2", (groups, gates), np.float32),
            b_hh=workspace(xp, "stack_bias3", (groups, gates), np.float32))
        self.zero_bias = buffers.constant_zeros(xp, (gates,), np.float32)
        # a 16-bit call's: the workspaces its conversions go through (none for a float32
        # call's, which computes on its arrays as they are)
        self.wide = self._forward_workspaces(x) if self.half is not None else {}
        # (the layer API's: its forward's activations and formed input, rewritten by every
        # call - ``Plan._own``)
        self.activations: tuple | None = None
        self.formed: Array | None = None

    @staticmethod
    def _groups(ctx: functional.Context) -> list[dict[str, str]]:
        """The parameter names of the stack kernels' groups, in order: the layers'."""
        return [ctx.directions[k][0].names for k in range(ctx.num_layers)]

    @staticmethod
    def _w_ih_stack(xp, layers: int, gates: int, hidden: int, words: str | None) -> Array:
        """The workspace the forward kernel reads the layers' ``W_ih`` from (above the first)."""
        return _matrices(xp, "stack_w_ih", (layers - 1, gates, hidden), words)

    def _forward_workspaces(self, x: Array) -> dict:
        """A 16-bit call's forward workspaces: the widened ``b_ih`` of its input projections
        and the float32 output the call's is selected in before it is rounded (the full
        path's ``result_y``)."""
        xp = self.xp
        return {"b_ih": workspace(xp, "b_ih_gi", (self.gi.shape[1],), np.float32),
                "y": workspace(xp, "result_y", self.y_shape, np.float32)}

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
        h0, c0, states = (self.h0, self.c0, ()) if hx is None else self._initial_states(hx)
        layer_input, given = self._layer_input(x, lengths)
        groups = self.state_shape[0]
        steps, batch, _ = x.shape
        held = self.activations
        if held is None:
            y = xp.empty((groups, steps, batch, self.hidden), np.float32)
            held = self._own("activations", (
                y, xp.empty_like(y) if cell.has_cell_state else None,
                xp.empty((groups, steps, batch, cell.saved * self.hidden), np.float32),
                [xp.empty(self.y_shape, np.float32) for _ in range(self.num_layers - 1)]))
        y, cs, saved, upper = held
        inputs = [layer_input, *upper]
        out = xp.empty(self.y_shape, self.x_dtype)  # (a 16-bit call's rounded in the chain)
        h_n = xp.empty(self.state_shape, self.x_dtype)
        c_n = None if cs is None else xp.empty(self.state_shape, self.x_dtype)
        args = stack.forward_arguments(
            self.stacked, self.gi.reshape(steps, batch, -1), h0, h0 if c0 is None else c0,
            self.all_steps if lengths is None else lengths, True, y, cs, saved)
        call = (given, inputs, out, h_n, c_n, lengths, y, cs, states)
        stats = stack.run_forward(self.engine, args, xp, stack.Around(
            lambda: self._before_forward(call), lambda: self._after_forward(call),
            lambda: self._key("forward", (*inputs, out, *_present(h_n, c_n)), (given, states)),
            _PER_CALL, self.fixed_arguments.setdefault("forward", {}), _ADDRESSED))
        ctx = functional.Context(cell, params, groups, False, False, self.algo, lengths, None,
                                 self.half, inputs, [[functional._Direction(
                                     self.layer_names[k], h0[k], None if c0 is None else c0[k],
                                     runtime.ForwardResult(y[k], None if cs is None else cs[k],
                                                           saved[k]))]
                                     for k in range(groups)], stats)
        ctx.plan, ctx.stacked = self, (y, cs, saved, h0, c0)
        ctx.scratch_results = self.half is not None  # (as the full path's)
        return out, (h_n if cs is None else (h_n, c_n)), ctx

    def _initial_states(self, hx: Any) -> tuple[Array, Array | None, tuple]:
        """``(h0, c0, states)`` of a call giving ``hx`` (not ``None``: the planned zeros): the
        given states as the kernels read them (``contiguous_states``), or a 16-bit call's new
        float32 ones, widened inside the (first) chain from ``states``' given arrays
        (``(given, float32)`` pairs), as ``functional`` widens them."""
        xp, cell = self.xp, self.cell
        given = hx if cell.has_cell_state else (hx, None)
        if self.half is None:
            return (*contiguous_states(xp, given), ())
        h0 = xp.empty(self.state_shape, np.float32)
        c0 = None if given[1] is None else xp.empty(self.state_shape, np.float32)
        return h0, c0, tuple((a, w) for a, w in zip(given, (h0, c0)) if a is not None)

    def _before_forward(self, call: tuple) -> None:
        """Inside the forward's chain, before its pass: the given states widened (16-bit), the
        input formed, the input projection (``_project``) and the weights and biases stacked,
        as ``functional._forward_stack`` and ``stack.forward`` make them."""
        xp, (given, inputs, _, _, _, lengths, _, _, states) = self.xp, call
        for a, wide in states:
            widen(a, wide)
        formed_input(xp, given, inputs[0], lengths, self.x_mask)
        layers = self._layers()
        self._project(call, layers)
        self._stack_weights(layers)

    def _projection(self, x: Array, w_ih: Array, b_ih: Array | None, out: Array) -> None:
        """An input projection ``x W_ih^T + b_ih`` over all steps into ``out`` (T*B, G), as
        ``functional._projected`` forms it: a 16-bit call's by the product of 16-bit operands
        (a float32 input, an upper layer's, rounded into a 16-bit workspace first: exact) and
        its bias widened."""
        if self.half is None:
            matmul_steps(x, w_ih.T, out)
        else:
            flat = x.reshape(-1, x.shape[2])
            if flat.dtype == np.float32:
                flat = self.wide["x_half"]
                _narrowed(self.xp, flat, x.reshape(flat.shape))
            matmul_half(flat, w_ih.T, self.half, out)
        if b_ih is not None:
            out += widen(b_ih, self.wide.get("b_ih"))

    def _stack_weights(self, layers: list[tuple]) -> None:
        """The kernel's groups' ``W_hh`` and biases (zeros where none) stacked into its
        workspaces (``layers``: each group's weights, ``_layers``)."""
        s = self.stacked
        _stack_into(self.xp, [w[1] for w in layers], s["w_hh"])
        for which, key in ((2, "b_ih"), (3, "b_hh")):
            _stack_into(self.xp, [self.zero_bias if w[which] is None else w[which]
                                  for w in layers], s[key])

    def _project(self, call: tuple, layers: list[tuple]) -> None:
        """Layer 0's input projection ``gi = x W_ih^T + b_ih`` and the upper layers' ``W_ih``
        stacked (their projections are inside the kernel)."""
        self._projection(call[1][0], layers[0][0], layers[0][2], self.gi)
        if len(layers) > 1:
            _stack_into(self.xp, [w[0] for w in layers[1:]], self.stacked["w_ih"])

    def _after_forward(self, call: tuple) -> None:
        """Inside the forward's chain, after its completion: the outputs (``_outputs``) and
        ``h_n``, ``c_n``, as ``functional._layer_output`` and ``_final_states`` make them."""
        xp, (_, _, _, h_n, c_n, _, y, cs, _) = self.xp, call
        self._outputs(call)
        _narrowed(xp, h_n, y[:, -1])  # (a copy; a 16-bit call's rounded)
        if cs is not None:
            _narrowed(xp, c_n, cs[:, -1])

    def _outputs(self, call: tuple) -> None:
        """Each layer's output copied (with lengths selected) into the layer above's input or
        the call's output (``_output``)."""
        _, inputs, out, _, _, lengths, y, _, _ = call
        for k, target in enumerate(inputs[1:] + [out]):
            self._output(y[k], lengths, target)

    def _output(self, y: Array, lengths: Array | None, target: Array) -> None:
        """A layer's output ``y`` (T, B, H: float32) into ``target``, selected with ``lengths``;
        a 16-bit call's output rounded (selected in float32 first, as the full path's
        ``result_y``)."""
        xp = self.xp
        if lengths is None:
            _narrowed(xp, target, y)
            return
        wide = target if target.dtype == np.float32 else self.wide["y"]
        select_active(xp, y, lengths, wide, self.mask)
        if wide is not target:
            _narrowed(xp, target, wide)

    def _key(self, what: Any, made: tuple, others: tuple) -> tuple:
        """What a pass's chain graph is keyed by beside its launches' arguments (``stack.Around``):
        the plan and which pass, its fixed arrays, weights and sums, and this call's arrays -
        ``made``, contiguous arrays whose shape and dtype the plan fixes (it makes them, or
        checks them: their address), and ``others`` (``chain_graphs.value`` of each); their numbers are the
        plan's. The fixed part's value is made once per prepared state
        (its arrays keep their memory while the plan serves: weights rebound only over the same
        memory, ``_rebind``)."""
        fixed = self._fixed_key
        if fixed is None or fixed[0] is not self.backward_pass:
            held = (self.gi, self.mask, self.x_mask, self.zero_bias, self.weights, self.sums,
                    tuple(self.wide.values()), self._held(),
                    None if self.backward_pass is None else tuple(
                        a for k, a in self.backward_pass.items()
                        if k not in ("grads", "scratch", "sums")))
            fixed = self._fixed_key = (self.backward_pass,
                                       chain_graphs.Fixed(chain_graphs.value(held)).token)
        return (what, id(self), fixed[1], chain_graphs.addresses(made, _INDICES[:len(made)]),
                tuple([chain_graphs.value(a) for a in others]))

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
        _, batch, hidden = self.state_shape
        layers, steps = self.kernel_groups, self.x_shape[0]
        shape, carry = (layers, steps, batch, cell.gates * hidden), (layers, steps + 1, batch,
                                                                      hidden)
        dgi = workspace(xp, "stack_dgi", shape, np.float32)
        dh_carry = workspace(xp, "stack_dh_carry", carry, np.float32)
        words, half = stack._weights_dtype(engine), self.half is not None
        self.fixed_arguments = {}
        self.backward_pass = dict(
            w_t=_matrices(xp, "stack_w_t", (layers, hidden, shape[3]), words),
            w_ih_t=self._w_ih_t_stack(xp, layers, hidden, shape[3], words),
            scratch=(dgi, workspace(xp, "stack_dgh", shape, np.float32) if cell.separate_dgh
                     else dgi, dh_carry, workspace(xp, "stack_dc_carry", carry, np.float32)
                     if cell.has_cell_state else dh_carry),
            # (the dy the pass reads where not the caller's: selected, or a batch-first one's
            # copied contiguous; a 16-bit call's widened into ``dy_wide``)
            dy=workspace(xp, "dy", self.y_shape, np.float32)
            if self.lengths or not (half or dy.flags.c_contiguous) else None,
            dw_hh=workspace(xp, "dw_hh", (shape[3], hidden), np.float32),
            # (where the parameter gradients are formed: float32 workspaces, or new arrays of
            # a float32 call that does not accumulate)
            grads={name: workspace(xp, "plan_grad " + name, w.shape, np.float32)
                   for name, w in zip(self.names, self.weights)}
            if self.accumulates or half else None)
        if half:
            self.backward_pass.update(self._wide_backward_workspaces())
            if self.backward_pass["dy"] is None:
                self.backward_pass["dy"] = self.backward_pass["dy_wide"]
        self.backward_pass.update(self._backward_workspaces())
        self.backward_engine = engine

    def _wide_backward_workspaces(self) -> dict:
        """A 16-bit call's backward workspaces: the float32 ``dy`` (widened), a launch's groups'
        ``W_hh`` and the ``W_ih`` of the groups whose input gradient is a product here (a
        stack's first layer; every pair's), widened, the first layer's input (widened), ``dx``,
        ``dh0`` (formed in float32, then rounded) and, where the plan accumulates, the caller's
        sums widened (``sums``, by name)."""
        xp, (steps, batch, width) = self.xp, self.x_shape
        layers = self._layers()
        return {"dy_wide": workspace(xp, "dy_wide", self.y_shape, np.float32),
                "w_hh_wide": workspace(xp, "w_hh_wide", (self.kernel_groups, *layers[0][1].shape),
                                       np.float32),
                "w_ih_wide": tuple(workspace(xp, f"w_ih_wide{k}", w[0].shape, np.float32)
                                   for k, w in enumerate(layers[:1] if self.chained else layers)),
                "x_wide": workspace(xp, "input_wide", (steps * batch, width), np.float32),
                "dx_wide": workspace(xp, "result_dx", (steps * batch, width), np.float32),
                "dh_wide": workspace(xp, "result_dh0", self.state_shape, np.float32),
                "sums": {name: workspace(xp, "plan_sum " + name, w.shape, np.float32)
                         for name, w in zip(self.names, self.weights)}
                if self.accumulates else None}

    def _held(self) -> tuple:
        """The forward's fixed arrays beyond every stack plan's (``_key``): none."""
        return ()

    @staticmethod
    def _w_ih_t_stack(xp, layers: int, hidden: int, width: int, words: str | None) -> Array:
        """The workspace the backward kernel reads the upper layers' ``W_ih^T`` from."""
        return _matrices(xp, "stack_w_ih_t", (layers - 1, hidden, width), words)

    def _backward_workspaces(self) -> dict:
        """The backward's workspaces beyond every stack plan's: none."""
        return {}


    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``Plan.backward`` by the prepared stack pass: this call's new result arrays, written
        inside its chain."""
        xp, prepared, lengths = self.xp, self.backward_pass, ctx.lengths
        y, cs, saved, h0, c0 = ctx.stacked
        args = stack.backward_arguments(
            {"w_t": prepared["w_t"], "w_ih_t": prepared["w_ih_t"]},
            dy if prepared["dy"] is None else prepared["dy"], y, cs, saved, h0,
            h0 if c0 is None else c0,
            self.all_steps if lengths is None else lengths, True, prepared["scratch"])
        dx, dh, dc, grads, into, results = self._backward_results(dy, c0 is not None, prepared,
                                                                  into)
        call = (ctx, dy, args, dx, dh, dc, grads, into, results)
        ctx.backward_stats = stack.run_backward(self.backward_engine, args, xp, stack.Around(
            lambda: self._before_backward(call), lambda: self._after_backward(call),
            lambda: self._key("backward", (dy, dx, *_present(dh, dc), *ctx.inputs,
                                           *results.values()), (ctx.reverse_index,)),
            _PER_CALL, self.fixed_arguments.setdefault("backward", {}), _ADDRESSED))
        return dx, (dh if dc is None else (dh, dc)), results

    def _backward_results(self, dy: Array, cell_state: bool, held: dict,
                          into: Mapping[str, Array] | None) -> tuple:
        """A planned backward's new result arrays ``(dx, dh0, dc0, grads, into, results)``:
        ``dc0`` ``None`` without a cell state; ``grads``: where the parameter gradients are
        formed (the held float32 workspaces, or new arrays), ``into``: the caller's arrays in
        the plan's order where the plan accumulates, ``results``: the gradients the call
        returns (none where it accumulates; a 16-bit call's new arrays of its dtype)."""
        xp = self.xp
        dx = xp.empty(self.x_shape, dy.dtype)
        dh = xp.empty(self.state_shape, dy.dtype)
        dc = xp.empty(self.state_shape, dy.dtype) if cell_state else None
        new = {n: xp.empty(w.shape, w.dtype) for n, w in zip(self.names, self.weights)} \
            if not self.accumulates else {}
        grads = held["grads"] or new
        return dx, dh, dc, grads, self._held_sums(into) if self.accumulates else None, new

    def _held_sums(self, into: Mapping[str, Array]) -> tuple:
        """The caller's arrays the backward's chains add the parameter gradients into, in the
        plan's order, held (``sums``) and keyed with its fixed arrays (``_key``): the same
        objects call after call (the layer's ``grads``), checked by identity; where the
        caller's are others, held anew and the chains keyed again."""
        if holds(self.sums, into, self.names):
            return self.sums
        self.sums, self._fixed_key = tuple(into[n] for n in self.names), None
        return self.sums

    def _formed_dy(self, dy: Array, lengths: Array | None) -> Array:
        """Inside the first backward chain, the caller's ``dy`` as the passes read it: widened
        (16-bit), selected with lengths or copied where strided into the held ``dy``, as
        ``functional.backward`` forms it."""
        held = self.backward_pass
        if held.get("dy_wide") is not None:
            dy = widen(dy, held["dy_wide"])
        if held["dy"] is None or held["dy"] is dy:
            return dy
        formed_input(self.xp, dy, held["dy"], lengths, self.mask)
        return held["dy"]

    def _before_backward(self, call: tuple) -> None:
        """Inside the backward's chain, before its pass: ``dy`` formed (``_formed_dy``), the
        carries zeroed, ``W_hh^T`` and ``W_ih^T`` stacked, as ``functional.backward`` and
        ``stack.backward`` make them."""
        xp, (ctx, dy, args, *_) = self.xp, call
        self._formed_dy(dy, ctx.lengths)
        args["dh_carry"].fill(0)
        if self.cell.has_cell_state:
            args["dc_carry"].fill(0)
        layers = self._layers()
        _stack_into(xp, [w[1].T for w in layers], args["w_t"])
        if len(layers) > 1:
            _stack_into(xp, [w[0].T for w in layers[1:]], args["w_ih_t"])

    def _after_backward(self, call: tuple) -> None:
        """Inside the backward's chain, after its completion: ``dh0``, ``dc0``
        (``stack.initial_state_gradients``), each layer's parameter gradients
        (``functional.parameter_gradients``), ``dx`` and, where the plan accumulates, the
        gradients added into its caller's, as ``functional._backward_stack`` and the layer API
        form them."""
        xp, (ctx, _, args, dx, dh, dc, grads, into, results) = self.xp, call
        layers = self._layers()
        self._state_gradients(args, [w[1] for w in layers], dh, dc)
        self._gradients(call, layers)
        self._gradients_out(grads, into, results, self.names)
        if self.half is not None:
            _narrowed(xp, dx, self.backward_pass["dx_wide"].reshape(dx.shape))

    def _state_gradients(self, args: dict, w_hh: list[Array], dh: Array, dc: Array | None,
                         rows: slice = slice(None)) -> None:
        """A pass's ``dh0``, ``dc0`` (``stack.initial_state_gradients``; ``w_hh``: its groups'
        ``W_hh``); a 16-bit call's by the widened ``W_hh`` into the float32 workspace's
        ``rows``, then rounded into the call's arrays, as the full path and its callers form
        them."""
        xp, held = self.xp, self.backward_pass
        if self.half is None:
            stack.initial_state_gradients(xp, args, w_hh, dh, dc)
            return
        _stack_into(xp, w_hh, held["w_hh_wide"])
        wide = held["dh_wide"][rows]
        stack.initial_state_gradients(xp, args, held["w_hh_wide"], wide, None)
        _narrowed(xp, dh, wide)
        if dc is not None:
            _narrowed(xp, dc, args["dc_carry"][:, 0])

    def _flat_input(self, layer_input: Array) -> Array:
        """A layer's input as its weight gradients' products take it: (T*B, X) float32 (the
        first layer's 16-bit input widened, as ``functional._layer_gradients`` does)."""
        flat = layer_input.reshape(-1, layer_input.shape[2])
        return flat if flat.dtype == np.float32 else widen(flat, self.backward_pass["x_wide"])

    def _w_ih(self, w_ih: Array, group: int) -> Array:
        """A group's ``W_ih`` as the input gradient's product takes it (16-bit: widened)."""
        if self.half is None:
            return w_ih
        return widen(w_ih, self.backward_pass["w_ih_wide"][group])

    def _gradients(self, call: tuple, layers: list[tuple]) -> None:
        """Each layer's parameter gradients, top-down, and ``dx`` from layer 0's ``dgi``
        (the layers above formed theirs inside the kernel; a 16-bit call's in float32)."""
        ctx, _, args, dx, _, _, grads, _, _ = call
        for k in range(len(layers) - 1, -1, -1):
            d, layer_input = ctx.directions[k][0], ctx.inputs[k]
            names = [d.names[n] for n in _GRADIENTS if n in d.names]
            functional.parameter_gradients(
                args["dgi"][k], args["dgh"][k], self._flat_input(layer_input),
                d.fwd.y, d.h0, "bias_ih" in d.names, tuple(grads[n] for n in names),
                self.backward_pass["dw_hh"], self.half)
        target = dx if self.half is None else self.backward_pass["dx_wide"]
        matmul_steps(args["dgi"][0], self._w_ih(layers[0][0], 0),
                     target.reshape(-1, dx.shape[2]))

    def _gradients_out(self, grads: dict, into: tuple | None, results: dict, names) -> None:
        """The parameter gradients of ``names`` formed in ``grads``: added into the caller's
        (``into``: the layer API's sums, as it adds a full call's; a 16-bit call's in float32,
        rounded once), or rounded into the call's 16-bit ``results``."""
        xp = self.xp
        for name in names:
            g = grads[name]
            if into is not None:
                total = into[self._index[name]]
                if self.half is None:
                    total += g
                else:
                    g += widen(total, self.backward_pass["sums"][name])
                    _narrowed(xp, total, g)
            elif results is not grads:
                _narrowed(xp, results[name], g)

    def _backward_current(self, ctx: functional.Context) -> bool:
        """``Plan._backward_current``, and a context this plan's forward made."""
        return ctx.stacked is not None and super()._backward_current(ctx)


class PairPlan(StackPlan):
    """Calls of a bidirectional layer or stack whose layers each run both directions side by
    side in one launch per pass (``functional._forward_pairs`` / ``_backward_pairs``): a
    ``StackPlan`` whose kernel groups are one layer's two directions, the reverse one reading
    its input reversed within each length (``functional._gather`` by the call's ``reverse``
    index: without lengths a shared constant, with them a new array per call, the context's,
    formed inside the first chain). One chain per layer, each holding its layer's operations,
    all of a pass's in one ``launch.one_graph``: on a GPU one graph launch a pass."""

    chained = False

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool,
                 engine: Any):
        super().__init__(ctx, x, states, lengths, engine)
        xp, (steps, batch, _) = self.xp, x.shape
        self.gi_reverse = workspace(xp, "gi_reverse", self.gi.shape, np.float32)
        self.gi_pair = workspace(xp, "gi_pair", (2, steps, batch, self.gi.shape[1]), np.float32)
        self.y_reversed = workspace(xp, "y_reversed", (steps, batch, self.hidden), np.float32)
        self.rows = None if lengths else buffers.reversed_rows(xp, steps, batch)
        self.reverse_scratch = functional.reverse_scratch(xp, steps, batch) if lengths else None

    @staticmethod
    def _groups(ctx: functional.Context) -> list[dict[str, str]]:
        """Every layer-direction's parameter names, in ``functional``'s order."""
        return [d.names for dirs in ctx.directions for d in dirs]

    @staticmethod
    def _w_ih_stack(xp, layers: int, gates: int, hidden: int, words: str | None) -> Array:
        """The kernel's ``W_ih`` argument, unread by unchained groups (``stack._unused``)."""
        return stack._unused(xp)

    _w_ih_t_stack = _w_ih_stack

    def _forward_workspaces(self, x: Array) -> dict:
        """``StackPlan``'s, and the 16-bit workspace an upper layer's float32 input is rounded
        into for its product (``_projection``)."""
        steps, batch, _ = x.shape
        return dict(super()._forward_workspaces(x), x_half=workspace(
            self.xp, "input_half", (steps * batch, self.y_shape[2]), half_dtype(self.half)))

    def _held(self) -> tuple:
        """The pairs' fixed arrays (``_key``)."""
        return (self.gi_reverse, self.gi_pair, self.y_reversed, self.rows, self.reverse_scratch)

    def forward(self, x: Array, hx: Any, params: Mapping[str, Array],
                lengths: Any = None) -> tuple[Array, Array | tuple, functional.Context]:
        """``Plan.forward`` of the pairs: one chain per layer and pass."""
        xp, cell, hidden = self.xp, self.cell, self.hidden
        h0, c0, states = (self.h0, self.c0, ()) if hx is None else self._initial_states(hx)
        layer_input, given = self._layer_input(x, lengths)
        steps, batch, _ = x.shape
        held = self.activations
        if held is None:
            held = self._own("activations", (
                [self._pair_activations(steps, batch) for _ in range(self.num_layers)],
                [xp.empty(self.y_shape, np.float32) for _ in range(self.num_layers - 1)],
                None if lengths is None else xp.empty((steps * batch,), np.intp)))
        kept, upper, reverse = held
        reverse = self.rows if reverse is None else reverse
        inputs = [layer_input, *upper]
        out = xp.empty(self.y_shape, self.x_dtype)  # (a 16-bit call's rounded in the chain)
        h_n = xp.empty(self.state_shape, self.x_dtype)
        c_n = xp.empty(self.state_shape, self.x_dtype) if cell.has_cell_state else None
        stats, directions = RunStats(), []
        with launch.one_graph():  # (every layer's chain: one graph, one launch)
            for layer in range(self.num_layers):
                pair = slice(2 * layer, 2 * layer + 2)
                y, cs, saved = kept[layer]
                args = stack.forward_arguments(
                    self.stacked, self.gi_pair, h0[pair], (h0 if c0 is None else c0)[pair],
                    self.all_steps if lengths is None else lengths, False, y, cs, saved)
                target = inputs[layer + 1] if layer + 1 < self.num_layers else out
                call = (layer, given, inputs[layer], target, lengths, y, cs, reverse, h_n, c_n,
                        states)
                made = (inputs[layer], target, *_present(h_n, c_n))  # (``_key``'s)
                stats.merge(stack.run_forward(self.engine, args, xp, stack.Around(
                    lambda call=call: self._before_pair(call),
                    lambda call=call: self._after_pair(call),
                    lambda layer=layer, made=made: self._key(("forward", layer), made,
                                                             (given, reverse, states)),
                    _PER_CALL, self.fixed_arguments.setdefault(("forward", layer), {}),
                    _ADDRESSED)))
                directions.append([functional._Direction(
                    self.layer_names[2 * layer + d], h0[2 * layer + d],
                    None if c0 is None else c0[2 * layer + d],
                    runtime.ForwardResult(y[d], None if cs is None else cs[d], saved[d]))
                    for d in (0, 1)])
        ctx = functional.Context(cell, params, self.num_layers, True, False, self.algo, lengths,
                                 reverse, self.half, inputs, directions, stats)
        ctx.plan, ctx.stacked = self, (kept, h0, c0)
        ctx.scratch_results = self.half is not None  # (as the full path's)
        return out, (h_n if c_n is None else (h_n, c_n)), ctx

    def _pair_activations(self, steps: int, batch: int) -> tuple[Array, Array | None, Array]:
        """A layer's ``(y, cs, saved)`` for its two directions (``cs`` None without a cell
        state)."""
        xp, cell, hidden = self.xp, self.cell, self.hidden
        y = xp.empty((2, steps, batch, hidden), np.float32)
        return (y, xp.empty_like(y) if cell.has_cell_state else None,
                xp.empty((2, steps, batch, cell.saved * hidden), np.float32))

    def _before_pair(self, call: tuple) -> None:
        """Inside a layer's forward chain, before its pass: in the first, the given states
        widened (16-bit), the input formed and with lengths the reversal index; both
        directions' input projections (``_projection``) into the kernel's pair (the reverse one
        reversed) and the layer's weights and biases stacked, as ``functional._forward_pairs``
        and ``stack.forward`` form them."""
        xp, (layer, given, layer_input, _, lengths, _, _, reverse, _, _, states) = self.xp, call
        if layer == 0:
            for a, wide in states:
                widen(a, wide)
            formed_input(xp, given, layer_input, lengths, self.x_mask)
            if lengths is not None:
                self._reversal(lengths, reverse)
        directions = self._layers()[2 * layer:2 * layer + 2]
        for (w_ih, _, b_ih, _), gi in zip(directions, (self.gi, self.gi_reverse)):
            self._projection(layer_input, w_ih, b_ih, gi)
        steps = self.gi_pair.shape[1:3]
        xp.copyto(self.gi_pair[0], self.gi.reshape(*steps, -1))
        functional._gather(reverse, self.gi_reverse.reshape(*steps, -1), self.gi_pair[1])
        self._stack_weights(directions)

    def _reversal(self, lengths: Array, reverse: Array) -> None:
        """The call's within-length reversal of ``lengths`` into ``reverse``, in the chain."""
        functional.reverse_index_into(self.xp, lengths, self.reverse_scratch, reverse)

    def _after_pair(self, call: tuple) -> None:
        """Inside a layer's forward chain, after its completion: its output (the directions
        side by side, the reverse one back in time order, zero past each length:
        ``functional._layer_output``) into the layer above's input or the call's output, and its
        rows of ``h_n``, ``c_n``."""
        xp, (layer, _, _, out, lengths, y, cs, reverse, h_n, c_n, _) = self.xp, call
        hidden, pair = self.hidden, slice(2 * layer, 2 * layer + 2)
        target = out if out.dtype == np.float32 else self.wide["y"]  # (16-bit: then rounded)
        target[:, :, :hidden] = y[0]
        target[:, :, hidden:] = functional._gather(reverse, y[1], self.y_reversed)
        if lengths is not None:
            select_active(xp, target, lengths, target, self.mask)
        if target is not out:
            _narrowed(xp, out, target)
        _narrowed(xp, h_n[pair], y[:, -1])
        if cs is not None:
            _narrowed(xp, c_n[pair], cs[:, -1])

    def _backward_workspaces(self) -> dict:
        """The directions' ``dy`` for the kernel (``dy_pair``), the reverse one's contiguous
        source, its ``dgi`` back in time order, the parts of each layer's input gradient and an
        upper layer's input gradient (the output gradient of the layer below), as
        ``functional``'s workspaces."""
        xp, (steps, batch, width) = self.xp, self.x_shape
        shape, rows, upper = (steps, batch, self.hidden), steps * batch, self.y_shape[2]
        return {"dy_pair": workspace(xp, "dy_pair", (2, *shape), np.float32),
                "gather_source": workspace(xp, "gather_source", shape, np.float32),
                "dgi_reversed": workspace(xp, "dgi_reversed", self.gi_pair.shape[1:],
                                          np.float32),
                "d_in_part": workspace(xp, "d_in_part", (rows, width), np.float32),
                "d_in_part upper": workspace(xp, "d_in_part", (rows, upper), np.float32),
                "d_layer_input": workspace(xp, "d_layer_input", (rows, upper), np.float32)}

    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``Plan.backward`` by the prepared pair passes, top-down, one chain per layer: this
        call's new result arrays, written inside the chains."""
        xp, held, lengths = self.xp, self.backward_pass, ctx.lengths
        kept, h0, c0 = ctx.stacked
        dx, dh, dc, grads, into, results = self._backward_results(dy, c0 is not None, held, into)
        made = (dy, dx, *_present(dh, dc), *results.values(), *ctx.inputs)  # (``_key``'s)
        stats = RunStats()
        with launch.one_graph():  # (every layer's chain: one graph, one launch)
            for layer in range(self.num_layers - 1, -1, -1):
                pair = slice(2 * layer, 2 * layer + 2)
                y, cs, saved = kept[layer]
                args = stack.backward_arguments(
                    {"w_t": held["w_t"], "w_ih_t": held["w_ih_t"]}, held["dy_pair"], y, cs, saved,
                    h0[pair], (h0 if c0 is None else c0)[pair],
                    self.all_steps if lengths is None else lengths, False, held["scratch"])
                call = (layer, ctx, dy, args, dx, dh, dc, grads, into, results)
                stats.merge(stack.run_backward(self.backward_engine, args, xp, stack.Around(
                    lambda call=call: self._before_pair_backward(call),
                    lambda call=call: self._after_pair_backward(call),
                    lambda layer=layer: self._key(("backward", layer), made,
                                                  (ctx.reverse_index,)),
                    _PER_CALL, self.fixed_arguments.setdefault(("backward", layer), {}),
                    _ADDRESSED)))
        ctx.backward_stats = stats
        return dx, (dh if dc is None else (dh, dc)), results

    def _before_pair_backward(self, call: tuple) -> None:
        """Inside a layer's backward chain, before its pass: the gradient of its output (the
        call's ``dy`` formed, ``_formed_dy``, at the top; else the input gradient of the layer
        above) split into the directions', the reverse one reversed; the carries zeroed and
        the layer's ``W_hh^T`` stacked, as ``functional._backward_pairs`` and ``stack.backward``
        form them."""
        xp, (layer, ctx, dy, args, *_), held = self.xp, call, self.backward_pass
        if layer + 1 < self.num_layers:
            d_out = held["d_layer_input"].reshape(self.y_shape)
        else:
            d_out = self._formed_dy(dy, ctx.lengths)
        hidden = self.hidden
        xp.copyto(held["dy_pair"][0], d_out[:, :, :hidden])
        xp.copyto(held["gather_source"], d_out[:, :, hidden:])
        functional._gather(ctx.reverse_index, held["gather_source"], held["dy_pair"][1])
        args["dh_carry"].fill(0)
        if self.cell.has_cell_state:
            args["dc_carry"].fill(0)
        _stack_into(xp, [w[1].T for w in self._layers()[2 * layer:2 * layer + 2]], args["w_t"])

    def _after_pair_backward(self, call: tuple) -> None:
        """Inside a layer's backward chain, after its completion: its rows of ``dh0``, ``dc0``,
        both directions' parameter gradients and the layer's input gradient (the reverse
        direction's ``dgi`` back in time order; the call's ``dx`` at layer 0), as
        ``functional._layer_gradients`` forms them, and the layer API's sums (a 16-bit call's
        in float32, then rounded into its arrays)."""
        xp, held = self.xp, self.backward_pass
        layer, ctx, _, args, dx, dh, dc, grads, into, results = call
        pair = slice(2 * layer, 2 * layer + 2)
        directions = self._layers()[pair]
        self._state_gradients(args, [w[1] for w in directions], dh[pair],
                              None if dc is None else dc[pair], pair)
        layer_input = ctx.inputs[layer]
        flat = self._flat_input(layer_input)
        d_in = (held["d_layer_input"] if layer else dx if self.half is None
                else held["dx_wide"]).reshape(layer_input.shape)
        for k, d in enumerate(ctx.directions[layer]):
            dgi = args["dgi"][k] if k == 0 else functional._gather(
                ctx.reverse_index, args["dgi"][k], held["dgi_reversed"])
            names = [d.names[n] for n in _GRADIENTS if n in d.names]
            functional.parameter_gradients(dgi, args["dgh"][k], flat, d.fwd.y, d.h0,
                                           "bias_ih" in d.names, tuple(grads[n] for n in names),
                                           held["dw_hh"], self.half)
            w_ih = self._w_ih(directions[k][0], 2 * layer + k)
            if k == 0:
                matmul_steps(dgi, w_ih, d_in.reshape(flat.shape[0], -1))
            else:  # (in place: the same sum)
                d_in += matmul_steps(dgi, w_ih,
                                     held["d_in_part" if layer == 0 else "d_in_part upper"])
            self._gradients_out(grads, into, results, d.names.values())
        if layer == 0 and self.half is not None:
            _narrowed(xp, dx, d_in)


def _stack_into(xp, arrays: list[Array], out: Array) -> None:
    """``xp.stack(arrays, out=out)`` as one copy per array (the same values): inside a captured
    chain, where CuPy's concatenation may stage its pointers through the pool and the host. A
    16-bit array goes in as ``stack._matrices`` packs it from its widened copy: its bits into
    ``out``'s words (``_matrices``), or widened into float32 (``call_plans._refresh``)."""
    for k, a in enumerate(arrays):
        if a.dtype == out.dtype:
            xp.copyto(out[k], a)
        else:
            _refresh(out[k], a)


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> StackPlan | None:
    """The ``StackPlan`` of a forward that ran the whole way in stack mode (a unidirectional
    stack's), the ``PairPlan`` of a bidirectional layer's or stack's that ran as pairs, or
    ``None``."""
    pair = ctx.bidirectional
    dtype = np.float32 if ctx.half is None else half_dtype(ctx.half)
    if ((ctx.num_layers < 2 and not pair) or x.dtype != dtype or "weight_hr_l0" in ctx.params
            or any(w.dtype != dtype for w in ctx.params.values())):
        return None
    engine = stack_engine(ctx, x, backward=False)
    ran = "both directions of a layer side by side" if pair else "stack of"
    if engine is None or not any(ran in d for d in ctx.stats.details):
        return None
    return (PairPlan if pair else StackPlan)(ctx, x, hx is not None, lengths is not None,
                                             engine)
