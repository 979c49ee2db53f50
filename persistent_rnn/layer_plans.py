"""A stack or bidirectional call that runs one layer-direction per launch, planned (issue 26).

Where a float32 stack or bidirectional layer does not run in stack mode or as pairs (the
``stack`` setting off, or a shape with no stack kernel: ``stack.engine``), ``functional`` runs
each layer-direction's pass in turn (``_forward_layers`` / ``_backward_layers``). A
``LayersPlan`` keeps, per layer-direction, a prepared pass (``runtime.prepare_forward`` /
``prepare_backward``) whose chain holds that layer-direction's operations (``runtime.Around``),
and runs all of a pass's chains in one ``launch.one_graph``: on a GPU a call in steady state is
one graph launch per pass. Inside the chains, as ``functional`` makes them: forward - in the
first, the input formed (copied where strided, selected with lengths) and, bidirectional with
lengths, the call's within-length reversal index; in each, its input projection and bias (the
reverse direction's gathered into its time order); after each layer's last direction the layer's
output (the directions side by side, the reverse one gathered back, selected with lengths) into
the layer above's input or the call's output; each direction's rows of ``h_n`` / ``c_n``.
Backward, top-down - in the first chain ``dy`` selected with lengths; before each layer's first
direction both directions' output gradients formed (the reverse one gathered); the carries
zeroed and ``W_hh^T`` copied anew; after each pass its rows of ``dh0`` / ``dc0``, its parameter
gradients, its part of the layer's input gradient (the reverse direction's ``dgi`` gathered
back; added to the first direction's in place) and the layer API's sums. Bitwise the full path
(tests/test_call_plans.py).

LSTM projections too (each layer-direction's ``W_hr`` as the full path passes it, ``hs`` a new
array per call, ``W_hr^T`` copied anew, ``dW_hr`` beside the other gradients). Not planned:
16-bit layers (their conversions), calls whose layer-directions did not all run persistent.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import buffers, functional, launch, runtime, settings
from .buffers import matmul_steps, select_active, workspace
from .call_plans import (_GRADIENTS, Plan, _projection_gradient, _same_memory, _where,
                         contiguous_states, formed_input)
from .stats import RunStats

Array = Any
_PASS_DETAIL = "restarts and completion on the device"  # (``PreparedPass``'s detail ends so)


class LayersPlan(Plan):
    """Calls of a stack or bidirectional layer of one signature run one layer-direction per
    launch (module docstring)."""

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool,
                 engine: Any):
        self.states, self.lengths = states, lengths
        self.key: tuple = ()
        self.accumulates = False
        self.cell, self.algo, self.half = ctx.cell, ctx.algo, None
        self.xp = xp = buffers.array_module(x)
        self.x_type, self.x_shape, self.x_dtype = type(x), x.shape, x.dtype
        self.given_shape = x.shape  # (``Plan``'s)
        self.where, self.settings = _where(xp), settings.current()
        self.generation = buffers.generation()
        self.num_layers, self.directions = ctx.num_layers, 1 + ctx.bidirectional
        self.bidirectional = ctx.bidirectional
        self.direction_names = [d.names for dirs in ctx.directions for d in dirs]
        self.names = {n: n for names in self.direction_names for n in names.values()}
        self._index = {n: k for k, n in enumerate(self.names)}  # (a name's place in ``sums``)
        self.weights = tuple(ctx.params[n] for n in self.names)
        steps, batch, _ = x.shape
        # (H; h and y are P wide with an LSTM projection, ``width``)
        hidden = ctx.params["weight_hh_l0"].shape[0] // ctx.cell.gates
        width = self.width = ctx.directions[0][0].h0.shape[1]
        self.hidden, self.engine = hidden, engine
        self.proj = width if "weight_hr_l0" in ctx.params else 0
        count = len(self.direction_names)
        self.state_shape, self.c_shape = (count, batch, width), (count, batch, hidden)
        self.y_shape = (steps, batch, width * self.directions)
        self.h0, self.c0 = functional._initial_states(ctx.cell, xp, None, count, batch,
                                                      (width, hidden), np.float32)
        self.notes = [d for d in ctx.stats.details if d.startswith("stack mode not used")]
        self.mask = buffers.mask_arrays(xp, x) if lengths else None
        self.rows = buffers.reversed_rows(xp, steps, batch) if ctx.bidirectional else None
        self.reverse_scratch = (functional.reverse_scratch(xp, steps, batch)
                                if lengths and ctx.bidirectional else None)
        self.backward_passes: list[runtime.PreparedPass] | None = None
        self.backward_pass: Any = None  # (``Plan.backward``'s test: the passes, once prepared)
        self.backward_engine: Any = None
        self.held_grads: dict | None = None  # (an accumulating plan's gradients: ``plan_backward``)
        self.dy_formed = False  # (whether the top passes read ``dy`` formed: ``plan_backward``)
        gates = ctx.cell.gates * hidden
        held = {"gi": workspace(xp, "gi", (steps * batch, gates), np.float32),
                "gi_reverse": workspace(xp, "gi_reverse", (steps * batch, gates), np.float32),
                "gi_reversed": workspace(xp, "gi_reversed", (steps, batch, gates), np.float32),
                "y_reversed": workspace(xp, "y_reversed", (steps, batch, width), np.float32)}
        self.forward_passes = []
        for k, names in enumerate(self.direction_names):
            d = ctx.directions[k // self.directions][k % self.directions]
            reverse = k % self.directions == 1
            gi = held["gi_reversed" if reverse else "gi"].reshape(steps, batch, gates)
            prepared = runtime.prepare_forward(
                ctx.cell, engine, gi, ctx.params[names["weight_hh"]],
                ctx.params.get(names.get("bias_hh")), d.h0, d.c0, ctx.lengths, None,
                ctx.params.get(names.get("weight_hr")), d.fwd)
            prepared.around = runtime.Around(
                self._before_forward, self._after_forward,
                {"k": k, "weights": self._weights_of(k), "gi_out": held[
                    "gi_reverse" if reverse else "gi"], "gi": gi, "y_reversed":
                    held["y_reversed"], "mask": self.mask, "rows": self.rows},
                ("x", "x_given", "out", "h_n", "c_n", "reverse", "y_first"))
            self.forward_passes.append(prepared)

    def _weights_of(self, k: int) -> tuple:
        """Layer-direction ``k``'s ``(w_ih, w_hh, b_ih, b_hh, w_hr)`` (``None`` where it has
        none): the weights the plan holds now (``_rebind``)."""
        params = dict(zip(self.names, self.weights))
        names = self.direction_names[k]
        return tuple(params.get(names.get(kind)) for kind in _GRADIENTS)

    def _rebind(self, params: Mapping[str, Array]) -> bool:
        """``Plan._same_weights`` of new array objects over the planned ones' memory: kept, and
        the passes' operations read them (the same memory: the same chain graph keys)."""
        weights = tuple(params.get(name) for name in self.names)
        if not all(_same_memory(new, old) for new, old in zip(weights, self.weights)):
            return False
        self.weights = weights
        for k, prepared in enumerate(self.forward_passes + (self.backward_passes or [])):
            prepared.around.fixed["weights"] = self._weights_of(k % len(self.direction_names))
        return True

    def forward(self, x: Array, hx: Any, params: Mapping[str, Array],
                lengths: Any = None) -> tuple[Array, Array | tuple, functional.Context]:
        """``Plan.forward`` of the layer-directions: their chains in one graph."""
        xp, cell, steps = self.xp, self.cell, self.x_shape[0]
        h0, c0 = (self.h0, self.c0) if hx is None else contiguous_states(
            xp, hx if cell.has_cell_state else (hx, None))
        layer_input, given = x, None
        if lengths is not None or not x.flags.c_contiguous:  # (formed in the first chain)
            layer_input, given = xp.empty(x.shape, x.dtype), x
        reverse = self.rows
        if lengths is not None and self.bidirectional:  # (formed in the first chain)
            reverse = xp.empty((steps * x.shape[1],), np.intp)
        inputs = [layer_input] + [xp.empty(self.y_shape, np.float32)
                                  for _ in range(self.num_layers - 1)]
        out = xp.empty(self.y_shape, np.float32)
        h_n = xp.empty(self.state_shape, np.float32)
        c_n = xp.empty(self.c_shape, np.float32) if cell.has_cell_state else None
        stats, directions = RunStats(), [[] for _ in range(self.num_layers)]
        first_y = None
        with launch.one_graph():  # (every layer-direction's chain: one graph, one launch)
            for k, prepared in enumerate(self.forward_passes):
                layer, direction = divmod(k, self.directions)
                y, cs, saved = buffers.allocate_forward(cell, prepared.args["gi"], self.proj)
                fwd = runtime.ForwardResult(y, cs, saved, xp.empty_like(cs) if self.proj else None)
                arrays = runtime.forward_arrays(fwd, h0[k], None if c0 is None else c0[k],
                                                lengths)
                arrays.update(x=inputs[layer], x_given=given, reverse=reverse, y_first=first_y,
                              h_n=h_n[k], c_n=None if c_n is None else c_n[k],
                              out=inputs[layer + 1] if layer + 1 < self.num_layers else out)
                stats.merge(prepared.run(arrays))
                directions[layer].append(functional._Direction(
                    self.direction_names[k], h0[k], None if c0 is None else c0[k], fwd))
                first_y = fwd.y if direction == 0 else None
        stats.details.extend(self.notes)
        ctx = functional.Context(cell, params, self.num_layers, self.bidirectional, False,
                                 self.algo, lengths, reverse, None, inputs, directions, stats)
        ctx.plan = self
        return out, (h_n if c_n is None else (h_n, c_n)), ctx

    def _before_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's forward chain, before its pass: in the first, the input
        formed and (bidirectional, with lengths) the reversal index; its input projection and
        bias, the reverse direction's gathered (``functional._start_direction``)."""
        xp, k, lengths = self.xp, fixed["k"], arrays["lengths"]
        if k == 0:
            formed_input(xp, arrays["x_given"], arrays["x"], lengths, self.mask)
            if lengths is not None and self.bidirectional:
                functional.reverse_index_into(xp, lengths, self.reverse_scratch,
                                              arrays["reverse"])
        w_ih, _, b_ih = fixed["weights"][:3]
        gi = matmul_steps(arrays["x"], w_ih.T, fixed["gi_out"])
        if b_ih is not None:
            gi += b_ih
        if k % self.directions == 1:
            functional._gather(arrays["reverse"], gi, fixed["gi"])

    def _after_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's forward chain, after its completion: its rows of ``h_n``,
        ``c_n``; after a layer's last direction the layer's output (``functional._layer_output``)
        into the layer above's input or the call's output."""
        xp, y, lengths = self.xp, arrays["y"], arrays["lengths"]
        xp.copyto(arrays["h_n"], y[-1])
        if arrays["cs"] is not None:
            xp.copyto(arrays["c_n"], arrays["cs"][-1])
        if fixed["k"] % self.directions != self.directions - 1:
            return
        target = arrays["out"]
        if self.directions == 1:
            if lengths is None:
                xp.copyto(target, y)
            else:
                select_active(xp, y, lengths, target, self.mask)
            return
        width = self.width
        target[:, :, :width] = arrays["y_first"]
        target[:, :, width:] = functional._gather(arrays["reverse"], y, fixed["y_reversed"])
        if lengths is not None:
            select_active(xp, target, lengths, target, self.mask)

    def plan_backward(self, ctx: functional.Context, dy: Array) -> None:
        """After a backward of this plan's context that ran the whole way, every layer-direction
        persistent: prepare the later ones' passes (``runtime.prepare_backward`` of the
        workspaces ``functional`` uses)."""
        stats = ctx.backward_stats
        count = len(self.direction_names)
        if stats is None or sum(d.endswith(_PASS_DETAIL) for d in stats.details) != count:
            return
        xp, cell, hidden = self.xp, self.cell, self.hidden
        steps, batch, _ = self.x_shape
        engine, _ = runtime._engine(cell, dy, hidden, batch, self.algo, backward=True,
                                    proj_size=self.proj)
        if engine is None:
            return
        # (the caller's dy selected, or a batch-first one's copied contiguous, where the pass
        # would read it)
        self.dy_formed = self.lengths or not dy.flags.c_contiguous
        shape = (steps, batch, self.width)
        rows, upper = steps * batch, self.y_shape[2]
        held = {"dy": workspace(xp, "dy", self.y_shape, np.float32),
                "dy_direction": workspace(xp, "dy_direction", shape, np.float32),
                "dy_reversed": workspace(xp, "dy_reversed", shape, np.float32),
                "gather_source": workspace(xp, "gather_source", shape, np.float32),
                "dgi_reversed": workspace(xp, "dgi_reversed", (steps, batch, cell.gates * hidden),
                                          np.float32),
                "d_layer_input": workspace(xp, "d_layer_input", (rows, upper), np.float32),
                "d_in_part": workspace(xp, "d_in_part", (rows, self.x_shape[2]), np.float32),
                "d_in_part upper": workspace(xp, "d_in_part", (rows, upper), np.float32),
                "dw_hh": workspace(xp, "dw_hh", (cell.gates * hidden, self.width), np.float32)}
        self.held_grads = ({name: workspace(xp, "plan_grad " + name, w.shape, np.float32)
                            for name, w in zip(self.names, self.weights)}
                           if self.accumulates else None)
        passes = []
        for k in range(count):
            layer, direction = divmod(k, self.directions)
            d = ctx.directions[layer][direction]
            pass_dy = self._direction_dy(layer, direction, dy, held)
            dgi, dgh = runtime._gradient_buffers(cell, pass_dy, hidden, direction)
            weights = self._weights_of(k)
            prepared = runtime.prepare_backward(cell, engine, pass_dy, weights[1], d.h0, d.c0,
                                                ctx.lengths, d.fwd, None, weights[4], direction,
                                                dgi, dgh)
            prepared.around = runtime.Around(
                self._before_backward, self._after_backward,
                dict(held, k=k, weights=self._weights_of(k)),
                ("dy_in", "x", "dh0", "dc0", "dx", "reverse", "grads", "sums"))
            passes.append(prepared)
        self.backward_passes = self.backward_pass = passes
        self.backward_engine = engine

    def _direction_dy(self, layer: int, direction: int, dy: Array, held: dict) -> Array:
        """The output gradient a layer-direction's backward pass reads (``functional
        ._direction_gradient``'s): one direction's - the call's ``dy`` (selected with lengths)
        or the layer above's input gradient; the directions' own workspaces where there are
        two."""
        if self.directions == 2:
            return held["dy_reversed" if direction else "dy_direction"]
        if layer + 1 < self.num_layers:
            return held["d_layer_input"].reshape(self.y_shape)
        return held["dy"] if self.dy_formed else dy

    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``Plan.backward`` by the prepared passes, top-down, all in one graph: this call's new
        result arrays, written inside the chains."""
        xp, lengths = self.xp, ctx.lengths
        dx = xp.empty(self.x_shape, np.float32)
        dh = xp.empty(self.state_shape, np.float32)
        dc = xp.empty(self.c_shape, np.float32) if self.cell.has_cell_state else None
        grads = self.held_grads or {n: xp.empty(w.shape, w.dtype)
                                    for n, w in zip(self.names, self.weights)}
        sums = tuple(into[n] for n in self.names) if self.accumulates else None
        stats = RunStats()
        with launch.one_graph():  # (every layer-direction's chain: one graph, one launch)
            for layer in range(self.num_layers - 1, -1, -1):
                for direction, d in enumerate(ctx.directions[layer]):
                    k = layer * self.directions + direction
                    prepared = self.backward_passes[k]
                    pass_dy = dy if (self.directions == 1 and layer + 1 == self.num_layers
                                     and not self.dy_formed) else prepared.args["dy"]
                    arrays = runtime.backward_arrays(pass_dy, d.fwd, d.h0, d.c0, lengths)
                    arrays.update(dy_in=dy, x=ctx.inputs[layer], dh0=dh[k],
                                  dc0=None if dc is None else dc[k], dx=dx,
                                  reverse=ctx.reverse_index, grads=tuple(grads.values()),
                                  sums=sums)
                    stats.merge(prepared.run(arrays))
        ctx.backward_stats = stats
        return dx, (dh if dc is None else (dh, dc)), ({} if self.accumulates else grads)

    def _before_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's backward chain, before its pass: in the first, ``dy``
        selected with lengths; before a layer's first direction of two, both directions'
        output gradients formed (``functional._direction_gradient``); the carries zeroed and
        ``W_hh^T`` copied anew (``runtime.prepare_backward``)."""
        xp, k = self.xp, fixed["k"]
        layer, direction = divmod(k, self.directions)
        lengths = arrays["lengths"]
        top = layer + 1 == self.num_layers
        if top and direction == 0 and self.dy_formed:
            formed_input(xp, arrays["dy_in"], fixed["dy"], lengths, self.mask)
        if self.directions == 2 and direction == 0:
            d_out = (fixed["d_layer_input"].reshape(self.y_shape) if not top
                     else fixed["dy"] if self.dy_formed else arrays["dy_in"])
            width = self.width
            xp.copyto(fixed["dy_direction"], d_out[:, :, :width])
            xp.copyto(fixed["gather_source"], d_out[:, :, width:])
            functional._gather(arrays["reverse"], fixed["gather_source"], fixed["dy_reversed"])
        prepared = self.backward_passes[k]
        runtime.zero_carries(prepared.backward)
        w_hr = fixed["weights"][4]  # (an LSTM projection's: its transpose too)
        for arg, w in (("w_t", fixed["weights"][1]),) if w_hr is None else (
                ("w_hh_t", fixed["weights"][1]), ("w_hr_t", w_hr)):
            xp.copyto(prepared.args[arg], w.T)

    def _after_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's backward chain, after its completion: its ``dh0``, ``dc0``
        rows, its parameter gradients and its part of the layer's input gradient (the reverse
        direction's ``dgi`` gathered back; the call's ``dx`` at layer 0), as
        ``runtime.backward_call`` and ``functional._layer_gradients`` form them, and the layer
        API's sums."""
        xp, k = self.xp, fixed["k"]
        layer, direction = divmod(k, self.directions)
        s = self.backward_passes[k].backward
        w_ih, w_hh = fixed["weights"][:2]
        runtime.initial_state_gradient(s, w_hh, arrays["dh0"])
        if arrays["dc0"] is not None:
            xp.copyto(arrays["dc0"], s.dc_carry[0])
        layer_input = arrays["x"]
        flat = layer_input.reshape(-1, layer_input.shape[2])
        dgi = s.dgi if direction == 0 else functional._gather(arrays["reverse"], s.dgi,
                                                               fixed["dgi_reversed"])
        names = self.direction_names[k]
        grads = dict(zip(self.names, arrays["grads"]))
        ordered = tuple(grads[names[n]] for n in _GRADIENTS if n in names)
        functional.parameter_gradients(dgi, s.dgh, flat, arrays["y"], arrays["h0"],
                                       "bias_ih" in names, ordered, fixed["dw_hh"])
        if "weight_hr" in names:
            _projection_gradient(s, arrays["hs"], ordered[-1])
        if direction == 0:
            target = arrays["dx"] if layer == 0 else fixed["d_layer_input"]
            matmul_steps(dgi, w_ih, target.reshape(flat.shape[0], -1))
        else:  # (in place: the same sum)
            d_in = arrays["dx"] if layer == 0 else fixed["d_layer_input"].reshape(
                layer_input.shape)
            d_in += matmul_steps(dgi, w_ih, fixed["d_in_part" if layer == 0
                                                  else "d_in_part upper"])
        if arrays["sums"] is not None:  # (as the layer API adds a full call's: ``layers``)
            for name in names.values():
                total = arrays["sums"][self._index[name]]
                total += grads[name]

    def _backward_current(self, ctx: functional.Context) -> bool:
        """``Plan._backward_current``, and a context this plan's forward made."""
        return ctx.plan is self and super()._backward_current(ctx)


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> LayersPlan | None:
    """The ``LayersPlan`` of a float32 stack's or bidirectional layer's forward that ran one
    layer-direction per launch, every one persistent, or ``None``."""
    count = ctx.num_layers * (1 + ctx.bidirectional)
    if (count < 2 or ctx.half is not None or x.dtype != np.float32
            or sum(d.endswith(_PASS_DETAIL) for d in ctx.stats.details) != count):
        return None
    w_hr = ctx.params.get("weight_hr_l0")
    engine, _ = runtime._engine(ctx.cell, x, ctx.params["weight_hh_l0"].shape[0] // ctx.cell.gates,
                                x.shape[1], ctx.algo, backward=False,
                                proj_size=0 if w_hr is None else w_hr.shape[0])
    if engine is None:
        return None
    return LayersPlan(ctx, x, hx is not None, lengths is not None, engine)
