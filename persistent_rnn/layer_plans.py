"""A stack or bidirectional call that runs one layer-direction per launch, planned (issue 26).

Where a stack or bidirectional layer does not run in stack mode or as pairs (the
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
array per call, ``W_hr^T`` copied anew, ``dW_hr`` beside the other gradients), and 16-bit
layers (``HalfLayersPlan``: their conversions inside the chains). Not planned: calls whose
layer-directions did not all run persistent, parameters of another dtype than the input's.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import buffers, functional, launch, runtime
from .buffers import address, select_active, workspace
from .call_plans import (_GRADIENTS, _SUM, Plan, _bits, _narrowed, _refresh, _same_memory,
                         contiguous_states, formed_input)
from .halves import half_dtype, widen
from .matmul import matmul_half, matmul_steps
from .stats import RunStats

Array = Any
_PASS_DETAIL = "restarts and completion on the device"  # (``PreparedPass``'s detail ends so)
# (the forward roles every layer-direction's pass has, of arrays the plan makes or checks)
_FORWARD_ADDRESSED = frozenset({"y", "cs", "saved", "hs", "h0", "c0", "x", "out", "h_n", "c_n"})


class LayersPlan(Plan):
    """Calls of a stack or bidirectional layer of one signature run one layer-direction per
    launch (module docstring)."""

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool,
                 engine: Any):
        xp = self._signature(ctx, x, states, lengths)
        self.num_layers, self.directions = ctx.num_layers, 1 + ctx.bidirectional
        self.bidirectional = ctx.bidirectional
        self.direction_names = [d.names for dirs in ctx.directions for d in dirs]
        self._hold_weights({n: n for names in self.direction_names for n in names.values()},
                           ctx.params)
        self._index = {n: k for k, n in enumerate(self.names)}  # (a name's place in ``sums``)
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
        # (what the float32 outputs and dy are selected with; the input on its bits: a 16-bit
        # input's, as ``functional._selected_input``)
        self.mask = buffers.mask_arrays(xp, held["gi_reversed"]) if lengths else None
        self.x_mask = buffers.mask_arrays(xp, _bits(x)) if lengths else None
        self.forward_passes = []
        for k, names in enumerate(self.direction_names):
            d = ctx.directions[k // self.directions][k % self.directions]
            slot = "gi_reverse" if k % self.directions else "gi"
            gi = held["gi_reversed" if slot == "gi_reverse" else "gi"].reshape(steps, batch, gates)
            b_hh = ctx.params.get(names.get("bias_hh"))
            prepared = runtime.prepare_forward(
                ctx.cell, engine, gi, ctx.params[names["weight_hh"]], self._pass_bias(b_hh, slot),
                d.h0, d.c0, ctx.lengths, self.half, ctx.params.get(names.get("weight_hr")), d.fwd)
            fixed = {"k": k, "weights": self._weights_of(k), "gi_out": held[slot], "gi": gi,
                     "y_reversed": held["y_reversed"], "mask": self.mask, "x_mask": self.x_mask,
                     "rows": self.rows}
            fixed.update(self._forward_fixed(prepared, slot, fixed["weights"]))
            prepared.around = runtime.Around(
                self._before_forward, self._after_forward, fixed,
                ("x", "x_given", "out", "h_n", "c_n", "reverse", "y_first", "hx_given",
                 "cx_given"), self._addressed(k, ctx.cell.has_cell_state))
            self.forward_passes.append(prepared)
        # (the layer API's: its forward's activations and formed input, rewritten by every
        # call - ``Plan._own``)
        self.activations: tuple | None = None
        self.formed: Array | None = None

    def _addressed(self, k: int, cell_state: bool) -> frozenset[str]:
        """Layer-direction ``k``'s forward roles whose arrays the plan makes or checks, never
        ``None`` (``runtime.Around.addressed``): its activations, states, input, output and
        rows of ``h_n`` (``c_n``), and a reverse direction's ``y_first``."""
        addressed = _FORWARD_ADDRESSED | ({"y_first"} if k % self.directions else set())
        return frozenset(addressed if cell_state else addressed - {"c_n"})

    def _pass_bias(self, b_hh: Array | None, slot: str) -> Array | None:
        """The ``b_hh`` a layer-direction's forward pass reads: a float32 layer's own."""
        return b_hh

    def _forward_fixed(self, prepared: runtime.PreparedPass, slot: str, weights: tuple) -> dict:
        """A forward chain's fixed arrays beyond every plan's: none."""
        return {}

    def _initial_states(self, hx: Any) -> tuple[Array, Array | None, dict]:
        """``(h0, c0, roles)`` of a call giving ``hx`` (not ``None``: the planned zeros): the
        given states as the kernels read them (``contiguous_states``; no roles: nothing formed
        in the chain)."""
        h0, c0 = contiguous_states(self.xp, hx if self.cell.has_cell_state else (hx, None))
        return h0, c0, {}

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
        h0, c0, states = (self.h0, self.c0, {}) if hx is None else self._initial_states(hx)
        layer_input, given = self._layer_input(x, lengths)
        held = self.activations
        if held is None:
            held = self._own("activations", self._activations(x, lengths))
        results, upper, reverse = held
        reverse = self.rows if reverse is None else reverse
        inputs = [layer_input, *upper]
        dtype = self.x_dtype  # (the layer's: a 16-bit layer's results rounded in the chain)
        out = xp.empty(self.y_shape, dtype)
        h_n = xp.empty(self.state_shape, dtype)
        c_n = xp.empty(self.c_shape, dtype) if cell.has_cell_state else None
        stats, directions = RunStats(), [[] for _ in range(self.num_layers)]
        states = {"hx_given": None, "cx_given": None, **states}
        first_y = None
        with launch.one_graph():  # (every layer-direction's chain: one graph, one launch)
            for k, prepared in enumerate(self.forward_passes):
                layer, direction = divmod(k, self.directions)
                fwd = results[k]
                arrays = runtime.forward_arrays(fwd, h0[k], None if c0 is None else c0[k],
                                                lengths)
                arrays.update(states, x=inputs[layer], x_given=given, reverse=reverse,
                              y_first=first_y, h_n=h_n[k], c_n=None if c_n is None else c_n[k],
                              out=inputs[layer + 1] if layer + 1 < self.num_layers else out)
                stats.merge(prepared.run(arrays, captured=False))  # (``_where``)
                directions[layer].append(functional._Direction(
                    self.direction_names[k], h0[k], None if c0 is None else c0[k], fwd))
                first_y = fwd.y if direction == 0 else None
        stats.details.extend(self.notes)
        ctx = functional.Context(cell, params, self.num_layers, self.bidirectional, False,
                                 self.algo, lengths, reverse, self.half, inputs, directions, stats)
        ctx.plan, ctx.scratch_results = self, self.half is not None  # (as the full path's)
        return out, (h_n if c_n is None else (h_n, c_n)), ctx

    def _activations(self, x: Array, lengths: Any) -> tuple:
        """A forward's new activations: each layer-direction's results (``y``, ``cs``,
        ``saved``, a projection's ``hs``), the layers' outputs the layers above read, and
        (bidirectional, with lengths) the reversal index (``None``: the plan's ``rows``)."""
        xp, cell = self.xp, self.cell
        results = []
        for prepared in self.forward_passes:
            y, cs, saved = buffers.allocate_forward(cell, prepared.args["gi"], self.proj)
            results.append(runtime.ForwardResult(y, cs, saved,
                                                 xp.empty_like(cs) if self.proj else None))
        reverse = None
        if lengths is not None and self.bidirectional:  # (formed in the first chain)
            reverse = xp.empty((x.shape[0] * x.shape[1],), np.intp)
        return (results, [xp.empty(self.y_shape, np.float32) for _ in range(self.num_layers - 1)],
                reverse)

    def _before_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's forward chain, before its pass: in the first, the input
        formed and (bidirectional, with lengths) the reversal index; its input projection and
        bias, the reverse direction's gathered (``functional._start_direction``)."""
        xp, k, lengths = self.xp, fixed["k"], arrays["lengths"]
        if k == 0:
            formed_input(xp, arrays["x_given"], arrays["x"], lengths, self.x_mask)
            if lengths is not None and self.bidirectional:
                functional.reverse_index_into(xp, lengths, self.reverse_scratch,
                                              arrays["reverse"])
        gi = self._project(arrays, fixed)
        if k % self.directions == 1:
            functional._gather(arrays["reverse"], gi, fixed["gi"])

    def _project(self, arrays: dict, fixed: dict) -> Array:
        """A layer-direction's input projection and bias, ``gi = x W_ih^T + b_ih``
        (``functional._projected``), into its workspace; returned (T, B, G)."""
        w_ih, _, b_ih = fixed["weights"][:3]
        gi = matmul_steps(arrays["x"], w_ih.T, fixed["gi_out"])
        if b_ih is not None:
            gi += b_ih
        return gi

    def _after_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's forward chain, after its completion: its rows of ``h_n``,
        ``c_n``; after a layer's last direction the layer's output (``functional._layer_output``)
        into the layer above's input or the call's output."""
        xp, y, lengths = self.xp, arrays["y"], arrays["lengths"]
        _narrowed(xp, arrays["h_n"], y[-1])  # (a copy, or 16-bit: rounded, as the callers do)
        if arrays["cs"] is not None:
            _narrowed(xp, arrays["c_n"], arrays["cs"][-1])
        if fixed["k"] % self.directions != self.directions - 1:
            return
        out = arrays["out"]  # (a 16-bit call's output formed in float32 first, then rounded)
        target = out if out.dtype == np.float32 else fixed["y_wide"]
        if self.directions == 1:
            if lengths is None:
                xp.copyto(target, y)
            else:
                select_active(xp, y, lengths, target, self.mask)
        else:
            width = self.width
            target[:, :, :width] = arrays["y_first"]
            target[:, :, width:] = functional._gather(arrays["reverse"], y, fixed["y_reversed"])
            if lengths is not None:
                select_active(xp, target, lengths, target, self.mask)
        if target is not out:
            _narrowed(xp, out, target)

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
                                    half=self.half, proj_size=self.proj)
        if engine is None:
            return
        # (the caller's dy selected, or a batch-first one's copied contiguous, where the pass
        # would read it)
        self.dy_formed = self._forms_dy(dy)
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
        held.update(self._backward_workspaces())
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
                                                ctx.lengths, d.fwd, self.half, weights[4],
                                                direction, dgi, dgh)
            fixed = dict(held, k=k, weights=weights, **self._backward_fixed(k, weights))
            if self.accumulates:  # (the gradients formed in held workspaces, then summed into
                # the caller's, which ``_keep_sums`` holds: no per-call arrays of theirs)
                fixed["grads"] = tuple(self.held_grads.values())
            prepared.around = runtime.Around(
                self._before_backward, self._after_backward, fixed,
                ("dy_in", "x", "dh0", "dc0", "dx", "reverse")
                + (() if self.accumulates else ("grads",)))
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
        return self._top_dy(held, dy)

    def _top_dy(self, held: dict, dy: Array) -> Array:
        """The top layer's output gradient as its passes read it: the caller's ``dy``, or where
        it is formed (``dy_formed``) its selection or contiguous copy."""
        return held["dy"] if self.dy_formed else dy

    def _backward_workspaces(self) -> dict:
        """The backward chains' workspaces beyond every plan's: none."""
        return {}

    def _backward_fixed(self, k: int, weights: tuple) -> dict:
        """A backward chain's fixed arrays beyond every plan's (layer-direction ``k``'s, of
        ``weights``): none."""
        return {}

    def _forms_dy(self, dy: Array) -> bool:
        """Whether the top passes read the caller's ``dy`` formed (``_form_dy``): selected with
        lengths, or a batch-first one's (strided) copied contiguous."""
        return self.lengths or not dy.flags.c_contiguous

    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``Plan.backward`` by the prepared passes, top-down, all in one graph: this call's new
        result arrays, written inside the chains."""
        xp, lengths, dtype = self.xp, ctx.lengths, self.x_dtype  # (16-bit: rounded in the chain)
        dx = xp.empty(self.x_shape, dtype)
        dh = xp.empty(self.state_shape, dtype)
        dc = xp.empty(self.c_shape, dtype) if self.cell.has_cell_state else None
        grads = self.held_grads or {n: xp.empty(w.shape, w.dtype)
                                    for n, w in zip(self.names, self.weights)}
        if self.accumulates:
            self._keep_sums(into, tuple(self.names), self.backward_passes)
        per_call = {} if self.accumulates else {"grads": tuple(grads.values())}
        stats = RunStats()
        with launch.one_graph():  # (every layer-direction's chain: one graph, one launch)
            for layer in range(self.num_layers - 1, -1, -1):
                for direction, d in enumerate(ctx.directions[layer]):
                    k = layer * self.directions + direction
                    prepared = self.backward_passes[k]
                    pass_dy = dy if (self.directions == 1 and layer + 1 == self.num_layers
                                     and not self.dy_formed) else prepared.args["dy"]
                    arrays = runtime.backward_arrays(pass_dy, d.fwd, d.h0, d.c0, lengths)
                    arrays.update(per_call, dy_in=dy, x=ctx.inputs[layer], dh0=dh[k],
                                  dc0=None if dc is None else dc[k], dx=dx,
                                  reverse=ctx.reverse_index)
                    stats.merge(prepared.run(arrays, captured=False))  # (``_where``)
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
            self._form_dy(arrays, fixed)
        if self.directions == 2 and direction == 0:
            d_out = (fixed["d_layer_input"].reshape(self.y_shape) if not top
                     else self._top_dy(fixed, arrays["dy_in"]))
            width = self.width
            xp.copyto(fixed["dy_direction"], d_out[:, :, :width])
            xp.copyto(fixed["gather_source"], d_out[:, :, width:])
            functional._gather(arrays["reverse"], fixed["gather_source"], fixed["dy_reversed"])
        prepared = self.backward_passes[k]
        runtime.zero_carries(prepared.backward)
        w_hr = fixed["weights"][4]  # (an LSTM projection's: its transpose too)
        for arg, w in (("w_t", fixed["weights"][1]),) if w_hr is None else (
                ("w_hh_t", fixed["weights"][1]), ("w_hr_t", w_hr)):
            self._transpose_into(prepared.args[arg], w)

    def _form_dy(self, arrays: dict, fixed: dict) -> None:
        """In the first backward chain, the caller's ``dy`` formed as ``_top_dy`` reads it."""
        formed_input(self.xp, arrays["dy_in"], fixed["dy"], arrays["lengths"], self.mask)

    def _transpose_into(self, held: Array, w: Array) -> None:
        """A weight's transpose copied anew into the pass's copy of it."""
        self.xp.copyto(held, w.T)

    def _after_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside a layer-direction's backward chain, after its completion: its ``dh0``, ``dc0``
        rows, its parameter gradients and its part of the layer's input gradient (the reverse
        direction's ``dgi`` gathered back; the call's ``dx`` at layer 0), as
        ``runtime.backward_call`` and ``functional._layer_gradients`` form them, and the layer
        API's sums."""
        xp, k = self.xp, fixed["k"]
        layer, direction = divmod(k, self.directions)
        s = self.backward_passes[k].backward
        w_ih, w_hh = self._wide_weights(fixed, direction)
        runtime.initial_state_gradient(s, w_hh, self._wide(arrays["dh0"], fixed, "dh_wide", k))
        if arrays["dc0"] is not None:
            _narrowed(xp, arrays["dc0"], s.dc_carry[0])
        layer_input = arrays["x"]
        flat = self._wide(layer_input.reshape(-1, layer_input.shape[2]), fixed, "x_wide")
        dgi = s.dgi if direction == 0 else functional._gather(arrays["reverse"], s.dgi,
                                                               fixed["dgi_reversed"])
        names = self.direction_names[k]
        grads = self._gradient_targets(arrays, fixed)
        ordered = tuple(grads[names[n]] for n in _GRADIENTS if n in names)
        functional.parameter_gradients(dgi, s.dgh, flat, arrays["y"], arrays["h0"],
                                       "bias_ih" in names, ordered, fixed["dw_hh"], self.half)
        if "weight_hr" in names:
            functional.projection_gradient(s.drs, arrays["hs"], ordered[-1], self.half)
        dx = self._wide(arrays["dx"], fixed, "dx_wide")
        if direction == 0:
            target = dx if layer == 0 else fixed["d_layer_input"]
            matmul_steps(dgi, w_ih, target.reshape(flat.shape[0], -1))
        else:  # (in place: the same sum)
            d_in = dx.reshape(layer_input.shape) if layer == 0 else fixed[
                "d_layer_input"].reshape(layer_input.shape)
            d_in += matmul_steps(dgi, w_ih, fixed["d_in_part" if layer == 0
                                                  else "d_in_part upper"])
        self._gradients_out(arrays, fixed, names, grads, layer == 0 and k % self.directions
                            == self.directions - 1)

    def _wide_weights(self, fixed: dict, direction: int) -> tuple[Array, Array]:
        """``W_ih`` and ``W_hh`` as the backward's products take them (a float32 layer's own)."""
        return fixed["weights"][0], fixed["weights"][1]

    def _wide(self, a: Array, fixed: dict, name: str, row: int | None = None) -> Array:
        """Where a 16-bit plan computes ``a`` in float32 (the workspace ``name``): ``a`` itself
        for a float32 plan."""
        return a

    def _gradient_targets(self, arrays: dict, fixed: dict) -> dict:
        """Where a backward chain forms the parameter gradients, by name: the call's arrays (or
        where the plan accumulates its held workspaces)."""
        return dict(zip(self.names, self._gradient_arrays(arrays, fixed)))

    def _gradient_arrays(self, arrays: dict, fixed: dict) -> tuple:
        """The parameter gradients' arrays of a backward chain, in ``names``' order: where the
        plan accumulates its held workspaces (``fixed``), else the call's new ones."""
        return fixed["grads"] if self.accumulates else arrays["grads"]

    def _gradients_out(self, arrays: dict, fixed: dict, names: dict, grads: dict,
                       last: bool) -> None:
        """After a pass's gradients (``last``: the call's last pass): the layer API's sums
        (as it adds a full call's: ``layers``)."""
        if self.accumulates:
            for name in names.values():
                total = fixed["sums"][self._index[name]]
                total += grads[name]

    def _backward_current(self, ctx: functional.Context) -> bool:
        """``Plan._backward_current``, and a context this plan's forward made."""
        return ctx.plan is self and super()._backward_current(ctx)


class HalfLayersPlan(LayersPlan):
    """The ``LayersPlan`` of a 16-bit stack's or bidirectional layer's calls (``functional``'s
    ``half``), with the conversions of the full path inside the chains too, as
    ``call_plans.HalfPlan`` holds a single layer's: given initial states and the biases widened,
    the pass's copies of ``W_hh`` (``W_hr``) refreshed, the input projection of 16-bit operands
    (a layer above the first: its float32 input rounded, exactly, into a 16-bit workspace first,
    as ``matmul_half`` does), the output, ``h_n`` and ``c_n`` rounded into the call's 16-bit
    arrays; in the backward ``dy``, the first layer's input and the weights widened, ``dx``,
    ``dh0``, ``dc0`` and the gradients rounded (summed in float32 with the caller's first where
    the plan accumulates, as ``layers`` does)."""

    def _pass_bias(self, b_hh: Array | None, slot: str) -> Array | None:
        """The float32 workspace a pass reads ``b_hh`` from (widened inside its chain)."""
        return None if b_hh is None else workspace(self.xp, f"b_hh_{slot}", b_hh.shape,
                                                   np.float32)

    def _forward_fixed(self, prepared: runtime.PreparedPass, slot: str, weights: tuple) -> dict:
        """The pass's widened biases, its copies of ``W_hh`` / ``W_hr`` where it holds copies
        (``None`` where it reads the weight's memory), the 16-bit workspace an upper layer's
        input is rounded into, and the float32 output the top layer's is formed in."""
        xp, args, (steps, batch, _) = self.xp, prepared.args, self.x_shape
        fixed = {"b_hh_wide": args["b_hh"] if weights[3] is not None else None,
                 "b_ih_wide": workspace(xp, f"b_ih_{slot}", args["b_hh"].shape, np.float32),
                 "x_half": workspace(xp, "input_half", (steps * batch, self.y_shape[2]),
                                     half_dtype(self.half)),
                 "y_wide": workspace(xp, "result_y", self.y_shape, np.float32)}
        for key, w in (("w_hh", weights[1]), ("w_hr", weights[4])):
            held = args.get(key)  # (a view of the weight's memory: nothing to refresh)
            view = held is None or address(held) == address(w.view(np.uint16))
            fixed[key + " words"] = None if view else held
        return fixed

    def _initial_states(self, hx: Any) -> tuple[Array, Array | None, dict]:
        """New float32 initial states of a call giving ``hx`` (widened into them inside the
        first chain, as ``functional`` widens them) and by role each given array with its
        float32 one."""
        xp = self.xp
        h0 = xp.empty(self.state_shape, np.float32)
        if self.c0 is None:
            return h0, None, {"hx_given": (hx, h0)}
        c0 = xp.empty(self.c_shape, np.float32)
        return h0, c0, {"hx_given": (hx[0], h0), "cx_given": (hx[1], c0)}

    def _project(self, arrays: dict, fixed: dict) -> Array:
        """In the first chain the given states widened; the pass's weight copies refreshed and
        ``b_hh`` widened; ``gi = x W_ih^T + b_ih`` by the 16-bit product
        (``functional._projected``)."""
        if fixed["k"] == 0:
            for given in (arrays["hx_given"], arrays["cx_given"]):
                if given is not None:
                    widen(*given)
        w_ih, w_hh, b_ih, b_hh, w_hr = fixed["weights"]
        for w, key in ((w_hh, "w_hh"), (w_hr, "w_hr")):
            if fixed[key + " words"] is not None:
                _refresh(fixed[key + " words"], w)
        if b_hh is not None:
            widen(b_hh, fixed["b_hh_wide"])
        x = arrays["x"]
        x = x.reshape(-1, x.shape[2])
        if x.dtype == np.float32:  # (a layer above the first: its values are 16-bit ones)
            x = fixed["x_half"]
            _narrowed(self.xp, x, arrays["x"].reshape(x.shape))
        gi = matmul_half(x, w_ih.T, self.half, fixed["gi_out"])
        if b_ih is not None:
            gi += widen(b_ih, fixed["b_ih_wide"])
        return gi.reshape(self.x_shape[0], self.x_shape[1], -1)


    def _forms_dy(self, dy: Array) -> bool:
        """Always: the caller's 16-bit ``dy`` is widened (``_form_dy``)."""
        return True

    def _top_dy(self, held: dict, dy: Array) -> Array:
        """The widened ``dy``, selected with lengths (``functional.backward``'s)."""
        return held["dy"] if self.lengths else held["dy_wide"]

    def _form_dy(self, arrays: dict, fixed: dict) -> None:
        """The caller's ``dy`` widened, and selected with lengths."""
        widen(arrays["dy_in"], fixed["dy_wide"])
        if arrays["lengths"] is not None:
            select_active(self.xp, fixed["dy_wide"], arrays["lengths"], fixed["dy"], self.mask)

    def _backward_workspaces(self) -> dict:
        """The float32 workspaces the backward's chains widen into and compute in: ``dy``, the
        first layer's input, ``dx``, ``dh0`` and every parameter gradient (where the plan
        accumulates, the caller's sums widened too)."""
        xp, (steps, batch, width) = self.xp, self.x_shape
        held = {"dy_wide": workspace(xp, "dy_wide", self.y_shape, np.float32),
                "x_wide": workspace(xp, "input_wide", (steps * batch, width), np.float32),
                "dx_wide": workspace(xp, "result_dx", (steps * batch, width), np.float32),
                "dh_wide": workspace(xp, "result_dh0", self.state_shape, np.float32)}
        for name, w in zip(self.names, self.weights):
            held["grad " + name] = workspace(xp, "plan_grad " + name, w.shape, np.float32)
            if self.accumulates:
                held[_SUM + name] = workspace(xp, "plan_sum " + name, w.shape, np.float32)
        return held

    def _backward_fixed(self, k: int, weights: tuple) -> dict:
        """The float32 ``W_ih`` and ``W_hh`` of layer-direction ``k`` (widened inside its chain;
        ``W_hh``'s only where its pass holds 16-bit ``W_hh^T``: else that copy's transpose)."""
        xp, direction = self.xp, k % self.directions
        return {"w_ih_wide": workspace(xp, f"w_ih_wide{direction}", weights[0].shape,
                                       np.float32),
                "w_hh_wide": workspace(xp, f"w_hh_wide{direction}", weights[1].shape,
                                       np.float32)}

    def _transpose_into(self, held: Array, w: Array) -> None:
        """A 16-bit weight's transpose into the pass's copy (16-bit pairs, or widened)."""
        _refresh(held, w.T)

    def _wide_weights(self, fixed: dict, direction: int) -> tuple[Array, Array]:
        """``W_ih`` and ``W_hh`` in float32, as ``functional`` and ``runtime.backward_call``
        take them."""
        w_ih, w_hh = fixed["weights"][:2]
        args = self.backward_passes[fixed["k"]].args
        held = args.get("w_t", args.get("w_hh_t"))
        return (widen(w_ih, fixed["w_ih_wide"]),
                held.T if held.dtype == np.float32 else widen(w_hh, fixed["w_hh_wide"]))

    def _wide(self, a: Array, fixed: dict, name: str, row: int | None = None) -> Array:
        """The float32 workspace ``name`` (its row ``row``) that ``a`` is computed in; the
        first layer's 16-bit input widened into its own."""
        if name == "x_wide":
            return a if a.dtype == np.float32 else widen(a, fixed["x_wide"])
        return fixed[name] if row is None else fixed[name][row]

    def _gradient_targets(self, arrays: dict, fixed: dict) -> dict:
        """The float32 workspaces of the parameter gradients."""
        return {name: fixed["grad " + name] for name in self.names}

    def _gradients_out(self, arrays: dict, fixed: dict, names: dict, grads: dict,
                       last: bool) -> None:
        """The pass's ``dh0`` row, its gradients (summed into the caller's first where the plan
        accumulates, in float32, as ``layers`` does) and, after the last pass, ``dx`` rounded
        into the call's 16-bit arrays."""
        xp = self.xp
        _narrowed(xp, arrays["dh0"], fixed["dh_wide"][fixed["k"]])
        given = dict(zip(self.names, self._gradient_arrays(arrays, fixed)))
        for name in names.values():
            g = grads[name]
            if self.accumulates:
                total = fixed["sums"][self._index[name]]
                g += widen(total, fixed[_SUM + name])
                _narrowed(xp, total, g)
            else:
                _narrowed(xp, given[name], g)
        if last:
            _narrowed(xp, arrays["dx"], fixed["dx_wide"].reshape(arrays["dx"].shape))

def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> LayersPlan | None:
    """The ``LayersPlan`` of a float32 stack's or bidirectional layer's forward that ran one
    layer-direction per launch, every one persistent, or ``None``."""
    count = ctx.num_layers * (1 + ctx.bidirectional)
    dtype = np.float32 if ctx.half is None else half_dtype(ctx.half)
    if (count < 2 or x.dtype != dtype or any(w.dtype != dtype for w in ctx.params.values())
            or sum(d.endswith(_PASS_DETAIL) for d in ctx.stats.details) != count):
        return None
    w_hr = ctx.params.get("weight_hr_l0")
    engine, _ = runtime._engine(ctx.cell, x, ctx.params["weight_hh_l0"].shape[0] // ctx.cell.gates,
                                x.shape[1], ctx.algo, backward=False, half=ctx.half,
                                proj_size=0 if w_hr is None else w_hr.shape[0])
    if engine is None:
        return None
    return (LayersPlan if ctx.half is None else HalfLayersPlan)(
        ctx, x, hx is not None, lengths is not None, engine)
