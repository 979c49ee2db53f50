"""A layer's steady-state persistent call, planned once per call signature (issue 26).

A call of a layer re-derives, every time, what depends only on its signature: the argument
checks, the initial states, the engine, the workspaces, the chain, the launches' arguments and
the chain graph's key over every argument. A ``Plan`` keeps all of that for one signature of a
layer (``layers``; a torch module's ``RunRecord``, ``torch.ops``) after a call that ran the whole
way: a later call whose every input is identical where it matters (the same array type, shape
and dtype; the same parameter objects, or arrays over exactly their memory (``_same_memory``:
the torch modules' new views of weights an optimizer updated in place);
the same settings object, thread, device and stream; initial states given as they were when
planned, of the same shapes, or none; no lengths, or lengths of the same shape, any valid
values: the caller's to check) does
identity checks, then only what differs from call to call - the new result arrays, the
prepared pass (``runtime.PreparedPass``, whose chain graph key is the static part kept plus
the new arrays' addresses) - and builds the same ``functional.Context``. Every operation of the
call on the device touches only arrays of that key and is enqueued inside the chain
(``runtime.Around``): the input GEMM into the plan's workspace and its bias, the output and
state copies; the backward's carries, ``W_hh^T``, ``dh0`` and ``dc0``, the parameter and input
gradients (the layer API's sums of them too), with lengths the selections - so a replayed chain
graph holds them all and a call in steady state is one graph launch (its products recorded
through ``cublas_capture``). Anything else (``matches`` false) takes the full path with its
checks, so bad input still gets torch.nn's errors.

Planned: a single unidirectional layer-direction whose persistent engine ran (on the GPU, or its
emulation), float32 or 16-bit (``HalfPlan``: its conversions inside the chains too), with an LSTM
projection or without (its ``W_hr``, ``hs`` and ``dW_hr`` as the full path's); forward and
backward; with lengths or without (lengths: a per-call role of the prepared passes; the input's
selection inside the forward's chain too, ``formed_input``); batch-first or not (a time-major
view: the input and ``dy`` formed inside the chains); and a stack that runs in stack mode,
one chain per pass, a bidirectional layer or stack run as pairs, one chain per
layer, or a stack or bidirectional layer run one layer-direction per launch, one chain each
(``stack_plans``' ``StackPlan`` and ``PairPlan``, ``layer_plans.LayersPlan``, built on
``Plan``; a pass's chains in one ``launch.one_graph``: one graph launch; every dtype). Never under
CUDA stream capture (``buffers.reused`` then hands out fresh scratch that the capture keeps), never
after ``buffers.release_workspaces`` (a plan holds its scratch: ``buffers.generation``), never
while the configuration cools down after a grid found not co-resident (the full path then runs the
GEMM path and says why). A layer keeps one plan, the last planned signature's (planned when two
calls in a row that ran the whole way had it), and the plan keeps its scratch (workspaces, chain)
while it lives, also past ``buffers.MAX_REUSED``'s bound.
"""
from __future__ import annotations

import operator
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from . import buffers, functional, launch, runtime, settings
from .buffers import address, select_active, workspace
from .halves import half_dtype, widen
from .matmul import matmul_half, matmul_steps

Array = Any
_SUM = "sum of "  # (a parameter's name so prefixed: the workspace its 16-bit sum is widened into)
# The parameter gradients a planned backward forms, in its order (``functional``'s, then an LSTM
# projection's ``dW_hr``).
_GRADIENTS = (*functional.PARAMETER_GRADIENTS, "weight_hr")
# The roles of a plan's chains whose arrays it makes, or checks before it runs them: contiguous,
# of one shape and dtype every call (``runtime.Around.addressed``) - the forward's results and
# the call's new arrays, the input the pass reads (``matches``, ``formed_input``) and the initial
# states (the planned zeros, or given ones checked, made contiguous: ``_given_states``), ``dy``
# where the pass reads the caller's (the callers check it so), the gradients returned.
_ADDRESSED = frozenset({"y", "cs", "saved", "hs", "h0", "c0", "x", "out", "h_n", "c_n", "dy",
                        "dh0", "dc0", "dx"})


def _where(xp) -> tuple:
    """What scratch memory is keyed by beside its name (``buffers.reused``): the thread, and on
    a GPU the device and stream; ``None`` while the stream is being captured."""
    if xp is np:
        return (threading.get_ident(),)
    stream = xp.cuda.get_current_stream()
    if stream.is_capturing():
        return None
    return threading.get_ident(), xp.cuda.Device().id, stream.ptr


def runs_here(xp) -> bool:
    """Whether a plan may serve calls on this thread's current stream (never one being captured:
    ``_where``)."""
    return _where(xp) is not None


def signature(x: Array, hx: Any, lengths: Any) -> tuple:
    """What two calls in a row must share for the second to plan its signature (``plan_of``):
    also the thread (and on a GPU the device and stream) a plan serves, so that calls from two
    threads in turn never replace each other's plan (a plan costs a pass's preparation)."""
    return type(x), x.shape, x.dtype, hx is None, lengths is None, _where(buffers.array_module(x))


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> "Plan | None":
    """The plan of a single layer-direction's forward that ran the whole way (``functional.forward``
    of ``x``, ``hx``, ``lengths`` gave ``ctx``), or ``None`` where its signature is not planned
    (``plans.plan_of``, which also gives it the caller's key)."""
    if not (ctx.num_layers == 1 and not ctx.bidirectional and ctx.stats.algo == "persistent"
            and x.dtype == (np.float32 if ctx.half is None else half_dtype(ctx.half))
            and runs_here(buffers.array_module(x))):
        return None
    plan = (Plan if ctx.half is None else HalfPlan)(ctx, x, hx is not None, lengths is not None)
    return plan if plan.engine is not None else None


def _same_memory(a: Any, b: Array) -> bool:
    """Whether ``a`` is an array of ``b``'s type over the memory ``b`` covers, laid out alike."""
    if type(a) is not type(b) or a.shape != b.shape or a.strides != b.strides \
            or a.dtype != b.dtype:
        return False
    if type(b) is np.ndarray:
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return a.data.ptr == b.data.ptr  # (CuPy)


class CallSignature:
    """What a planned call was made from and which later calls it may serve (``matches``: the
    checks every plan shares - ``Plan`` here, ``gemm_plans.GemmPlan``). A subclass sets the
    names, weights and initial states (``names``, ``weights``, ``c0``, ``state_shape``,
    ``c_shape``) that ``matches`` reads, and how it takes new arrays over the planned weights'
    memory (``_rebind``)."""

    engine: Any = None  # the persistent engine the plan runs (None: nothing to cool down)

    def _signature(self, ctx: functional.Context, x: Array, states: bool, lengths: bool) -> Any:
        """What every plan keeps of the call it was made from (what ``matches`` compares, where
        it may serve, the settings and workspaces it was made under); returns ``x``'s array
        module."""
        self.states = states  # whether the calls give initial states (else zeros)
        self.lengths = lengths  # whether the calls give lengths (else all T steps)
        self.key: tuple = ()  # the signature of its calls as its holder knows it (``plan_of``)
        self.accumulates = False  # whether its backward adds into its caller's (``plan_of``)
        self.cell, self.algo, self.half = ctx.cell, ctx.algo, ctx.half
        self.xp = xp = buffers.array_module(x)
        self.x_type, self.x_shape, self.x_dtype = type(x), x.shape, x.dtype
        self.given_shape = x.shape  # (the caller's: batch-major for a batch-first layer)
        self.where, self.settings = _where(xp), settings.current()
        # (a backward's own: torch's autograd runs a CUDA backward on its device thread, not
        # the forward's; the backward's workspaces are keyed by the thread that planned it)
        self.backward_where: tuple | None = None
        self.generation = buffers.generation()
        return xp

    def matches(self, x: Array, hx: Any, params: Mapping[str, Array], algo: str,
                lengths: Any = None) -> bool:
        """Whether a forward of ``x``, ``hx`` and ``lengths`` (valid ones: the caller's) with
        ``params`` may run this plan: everything the full path would check or derive is as
        when it was planned."""
        if (type(x) is not self.x_type or x.shape != self.given_shape or x.dtype != self.x_dtype
                or (lengths is not None) != self.lengths
                or (hx is not None) != self.states or (hx is not None and not self._states(hx))
                or algo != self.algo or settings.current() is not self.settings
                or buffers.generation() != self.generation or _where(self.xp) != self.where):
            return False
        return self._same_weights(params) and (
            self.engine is None or launch.COOLDOWNS.reason(self.engine.key) is None)

    def _states(self, hx: Any) -> bool:
        """Whether ``hx`` holds initial states the full path's checks would pass: an array (the
        LSTM: a tuple of two) of the input's type and dtype and the planned shape."""
        if self.c0 is None:
            return (type(hx) is self.x_type and hx.shape == self.state_shape
                    and hx.dtype == self.x_dtype)
        return (type(hx) is tuple and len(hx) == 2 and type(hx[0]) is self.x_type
                and type(hx[1]) is self.x_type and hx[0].shape == self.state_shape
                and hx[1].shape == self.c_shape and hx[0].dtype == self.x_dtype
                and hx[1].dtype == self.x_dtype)

    def _hold_weights(self, names: dict[str, str], params: Mapping[str, Array]) -> None:
        """Hold the planned weights: ``names`` (role -> parameter name, as a direction's; or
        each name itself) and ``params``' objects of them, in that order (``_same_weights``)."""
        self.names = names
        # (a layer has W_ih and W_hh at least: the getter makes a tuple, in C)
        self._planned_weights = operator.itemgetter(*names.values())
        self.weights = tuple(params[name] for name in names.values())

    def _same_weights(self, params: Mapping[str, Array]) -> bool:
        """Whether ``params`` holds the planned weight objects (an array object keeps its
        memory: in-place updates are read by the plan's arguments as by a new call's), or new
        arrays over the very memory of the planned ones (``_same_memory``: the torch modules'
        views of parameters an optimizer updated in place), which the plan then keeps."""
        try:  # (the identities compared in C: a fifth of the loop's instructions saved)
            if False not in map(operator.is_, self._planned_weights(params), self.weights):
                return True
        except KeyError:  # (a parameter missing: ``_rebind`` refuses it)
            pass
        return self._rebind(params)

    def _rebind(self, params: Mapping[str, Array]) -> bool:
        """``_same_weights`` of new array objects: whether the plan may serve them (it then
        keeps them)."""
        raise NotImplementedError

    def _given_states(self, hx: Any) -> tuple[Array, Array | None]:
        """Row 0 of the given initial states ``hx`` (``h0``, the LSTM's ``(h0, c0)``),
        contiguous, as ``functional._initial_states`` makes them."""
        h0, c0 = contiguous_states(self.xp, hx if self.c0 is not None else (hx, None))
        return h0[0], None if c0 is None else c0[0]


class Plan(CallSignature):
    """One layer's persistent call of one signature (module docstring): ``matches`` says whether
    a call may use it, ``forward`` / ``backward`` run it."""

    def __init__(self, ctx: functional.Context, x: Array, states: bool, lengths: bool = False):
        d = ctx.directions[0][0]
        xp = self._signature(ctx, x, states, lengths)
        self._hold_weights(d.names, ctx.params)
        w_ih, w_hh, b_ih, b_hh = functional._weights(ctx, d.names)
        # (``plan_backward``: the parameter gradients' names in their order, and those of them
        # that are roles of the backward's chain: the call's new arrays)
        self.gradient_names: tuple[str, ...] = ()
        self.gradient_roles: tuple[str, ...] = ()
        self.w_hh, self.b_ih, self.w_ih_t = w_hh, b_ih, w_ih.T
        # an LSTM projection's W_hr (P, H): h (and y) P wide, c H wide
        self.w_hr = ctx.params[d.names["weight_hr"]] if "weight_hr" in d.names else None
        self.proj = 0 if self.w_hr is None else self.w_hr.shape[0]
        self.h0, self.c0 = d.h0, d.c0  # (the zeros of calls without initial states)
        self.state_shape = (1, *d.h0.shape)
        self.c_shape = None if d.c0 is None else (1, *d.c0.shape)
        steps, batch, _ = x.shape
        self.gi = workspace(xp, "gi", (steps * batch, w_ih.shape[0]),
                            w_ih.dtype if self.half is None else np.float32)
        self.gi_steps = gi = self.gi.reshape(steps, batch, w_ih.shape[0])
        self.hidden = w_ih.shape[0] // ctx.cell.gates  # (H; h is P wide with a projection)
        self.y_shape = (steps, batch, w_hh.shape[1])  # (what a backward's dy must be)
        engine, _ = runtime._engine(ctx.cell, gi, self.hidden, batch, ctx.algo, backward=False,
                                    half=self.half, proj_size=self.proj)
        self.engine = engine
        self.backward_pass: runtime.PreparedPass | None = None
        self.backward_engine: Any = None
        self.dy_pass: Array | None = None  # (the dy the backward's pass reads, where not dy)
        if engine is None:  # (cooling down since the call: no plan, ``plan_of``)
            return
        self.forward_pass = runtime.prepare_forward(ctx.cell, engine, gi, w_hh,
                                                    self._pass_bias(b_hh), d.h0, d.c0,
                                                    ctx.lengths, self.half, self.w_hr, d.fwd)
        # what a call's output and input selections read (held: no look-up inside a captured
        # chain; a 16-bit input is selected on its bits, as ``functional._selected_input``)
        self.mask = buffers.mask_arrays(xp, gi) if lengths else None
        self.x_mask = buffers.mask_arrays(xp, _bits(x)) if lengths else None
        self.forward_pass.around = runtime.Around(
            self._before_forward, self._after_forward, self._forward_fixed(b_ih, b_hh),
            ("x", "x_given", "out", "h_n") + (() if self.c0 is None else ("c_n",))
            + self._state_roles(), _ADDRESSED)
        # (the layer API's: its forward's results and formed input, rewritten by every call)
        self.results: runtime.ForwardResult | None = None
        self.formed: Array | None = None
        # the direction of the calls without initial states where the results are held (the
        # same every call: ``forward``), and those calls' arrays by role but the call's own
        # (the direction's results and states; without lengths)
        self.direction: functional._Direction | None = None
        self.held_arrays: dict[str, Array | None] = {}
        self.held_backward_arrays: dict[str, Array | None] = {}  # (their backward's, but dy)
        # (the layer API's: the context of its forward, rewritten by every call - it
        # backpropagates only its last forward, whose results the plan holds: ``_own``)
        self.context: functional.Context | None = None

    def _pass_bias(self, b_hh: Array | None) -> Array | None:
        """The ``b_hh`` the forward's pass reads (a float32 layer's own)."""
        return b_hh

    def _forward_fixed(self, b_ih: Array | None, b_hh: Array | None) -> dict:
        """The forward chain's ``fixed`` arrays (``runtime.Around``)."""
        return {"gi": self.gi, "w_ih_t": self.w_ih_t, "b_ih": b_ih, "mask": self.mask,
                "x_mask": self.x_mask}

    def _state_roles(self) -> tuple[str, ...]:
        """The forward chain's roles beyond the output's: none (the initial states the caller
        gives are the pass's own ``h0``, ``c0``)."""
        return ()

    def _rebind(self, params: Mapping[str, Array]) -> bool:
        """``_same_weights`` of new array objects: where each is over the planned one's memory
        (the same address, shape, strides and dtype) the plan's arguments read what the new
        arrays hold, and the plan keeps the new objects; else ``False``."""
        weights = tuple(params.get(name) for name in self.names.values())
        for new, old in zip(weights, self.weights):
            if not _same_memory(new, old):
                return False
        w_ih, w_hh = weights[0], weights[1]
        self.weights, self.w_hh, self.w_ih_t = weights, w_hh, w_ih.T
        self.w_hr = weights[-1] if self.proj else None
        self.b_ih = weights[2] if self.b_ih is not None else None
        fixed = self.forward_pass.around.fixed  # (the same memory: the same keys)
        fixed["b_ih"], fixed["w_ih_t"] = self.b_ih, self.w_ih_t
        if "b_hh_wide" in fixed:  # (a 16-bit plan's: converted inside its chain)
            fixed["b_hh"] = weights[3] if self.b_ih is not None else None
            for key, w in (("w_hh", w_hh), ("w_hr", self.w_hr)):  # (``HalfPlan``)
                if fixed[key] is not None:  # (else the pass reads the weight's memory)
                    fixed[key] = w
        if self.backward_pass is not None:
            self.backward_pass.around.fixed.update(w_hh=w_hh, w_ih=w_ih, w_hr=self.w_hr)
        return True

    def forward(self, x: Array, hx: Any, params: Mapping[str, Array],
                lengths: Any = None) -> tuple[Array, Array | tuple, functional.Context]:
        """``functional.forward(cell, params, x, hx, lengths, algo=...)`` of a matching call
        (``matches``: ``params`` holds the planned weights); ``lengths``: valid int32 on the
        input's array module, as the callers make them (``validation.lengths``,
        ``torch.interop.lengths_array``)."""
        xp, cell = self.xp, self.cell
        h0, c0, states = (self.h0, self.c0, {}) if hx is None else self._initial_states(hx)
        layer_input, given = self._layer_input(x, lengths)
        fwd = self.results
        if fwd is None:
            y, cs, saved = buffers.allocate_forward(cell, self.gi_steps, self.proj)  # (gi: chain)
            fwd = self._own("results", runtime.ForwardResult(
                y, cs, saved, xp.empty_like(cs) if self.proj else None))
        cs, d = fwd.cs, self.direction
        held = hx is None and d is not None and d.fwd is fwd  # (the plan's zeros, held results)
        if held and lengths is None:  # (a copy of a dict: its keys' hashes are not redone)
            arrays = self.held_arrays.copy()
        else:
            arrays = runtime.forward_arrays(fwd, h0, c0, lengths)
            arrays.update(states)
        if not held:
            d = functional._Direction(self.names, h0, c0, fwd)
            if hx is None and fwd is self.results:
                self.direction = d
                self.held_arrays = runtime.holding(runtime.forward_arrays(fwd, h0, c0, None))
                self.held_backward_arrays = runtime.holding(
                    runtime.backward_arrays(None, fwd, h0, c0, None))
        arrays["x"], arrays["x_given"] = layer_input, given
        dtype = self.x_dtype  # (the layer's: a 16-bit layer's results are converted in the chain)
        arrays["out"] = out = xp.empty(self.y_shape, dtype)  # (written in the chain)
        arrays["h_n"] = h_n = xp.empty(self.state_shape, dtype)
        if cs is not None:
            arrays["c_n"] = c_n = xp.empty(self.c_shape, dtype)
        stats = self.forward_pass.run(arrays, captured=False)  # (``matches`` asked: ``_where``)
        ctx = self.context
        if ctx is None:
            ctx = functional.Context(cell, params, 1, False, False, self.algo, lengths, None,
                                     self.half, [layer_input], [[d]], stats)
            ctx.plan, ctx.scratch_results = self, self.half is not None  # (as the full path's)
            self._own("context", ctx)
        else:  # (the held one, as a new one would be made)
            ctx.params, ctx.lengths, ctx.batch_first = params, lengths, False
            ctx.inputs[0], ctx.directions[0][0] = layer_input, d
            ctx.stats, ctx.backward_stats = stats, None
        return out, (h_n if cs is None else (h_n, c_n)), ctx

    def _layer_input(self, x: Array, lengths: Any) -> tuple[Array, Array | None]:
        """``(layer_input, given)``: the input the (first) pass reads and the caller's it is
        formed from inside the (first) chain - with lengths the input zero past each length, as
        functional's ``_selected_input``, or a strided input copied (its products reading rows
        in place) into the plan's (the layer API's, held: ``formed``) or a new array; else
        ``x`` itself, ``given`` None."""
        if lengths is None and x.flags.c_contiguous:
            return x, None
        formed = self.formed
        if formed is None:
            formed = self._own("formed", self.xp.empty(x.shape, x.dtype))
        return formed, x

    def _own(self, name: str, made: Any) -> Any:
        """``made``, a forward's new arrays the backward reads (``results``: ``y``, ``cs``,
        ``saved``, ``hs``; a stack's ``activations``; ``formed``: the input the pass reads where
        the given one is not it; ``context``: the call's ``functional.Context``),
        returned; kept as the plan's own where its caller backpropagates only its last forward
        (the layer API: ``accumulates``), every later call writing them anew (never returned:
        the output, ``h_n`` and ``c_n`` are copies, new every call)."""
        if self.accumulates:
            setattr(self, name, made)
        return made

    def _initial_states(self, hx: Any) -> tuple[Array, Array | None, dict]:
        """``(h0, c0, roles)``: the pass's initial states of a call giving ``hx`` (not ``None``:
        the planned zeros) and the per-call arrays they are formed from inside the chain (none:
        as functional's, contiguous, row 0 of a layer, are the caller's)."""
        return (*self._given_states(hx), {})

    def _before_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside the forward's chain, before its pass (``runtime.Around``): a strided input
        (the layer API takes any view) copied into this call's contiguous one, the input GEMM and its
        bias, ``gi = x W_ih^T + b_ih``, as ``functional.forward`` forms them."""
        formed_input(self.xp, arrays["x_given"], arrays["x"], arrays["lengths"], fixed["x_mask"])
        matmul_steps(arrays["x"], fixed["w_ih_t"], fixed["gi"])
        if fixed["b_ih"] is not None:
            fixed["gi"] += fixed["b_ih"]

    def _after_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside the forward's chain, after its completion: the output (``y`` copied, or
        selected with lengths) and ``h_n`` (LSTM: ``c_n``; a state stays as it was past its
        length), into this call's new arrays, as ``functional.forward`` makes them."""
        xp, y, lengths = self.xp, arrays["y"], arrays["lengths"]
        if lengths is None:
            xp.copyto(arrays["out"], y)
        else:
            buffers.select_active(xp, y, lengths, arrays["out"], fixed["mask"])
        xp.copyto(arrays["h_n"], y[-1:])
        if self.c0 is not None:
            xp.copyto(arrays["c_n"], arrays["cs"][-1:])

    def backward(self, ctx: functional.Context, dy: Array,
                 into: Mapping[str, Array] | None = None) -> tuple[Array, Any, dict, bool]:
        """``functional.backward(ctx, dy)`` of this plan's forward's context, ``dy`` contiguous
        of the output's shape and dtype (the callers' checks: ``layers``, ``torch.ops``' arrays
        are contiguous), no ``dhn``; and whether the
        parameter gradients were also added into ``into``'s arrays of their names (an
        accumulating plan's, ``plan_of``; given by its every call), inside the chain."""
        prepared = self.backward_pass
        if prepared is None or not self._backward_current(ctx):
            result = functional.backward(ctx, dy)
            if prepared is None:
                self.backward_where = _where(self.xp)
                self.plan_backward(ctx, _time_major(dy, ctx.batch_first))
            return (*result, False)
        if not ctx.batch_first:
            return (*self._planned_backward(ctx, dy, into), self.accumulates)
        # (a batch-first layer's: dy seen time-major, formed inside the chain; dx seen back)
        dx, dhx, grads = self._planned_backward(ctx, dy.transpose(1, 0, 2), into)
        return dx.transpose(1, 0, 2), dhx, grads, self.accumulates

    def _planned_backward(self, ctx: functional.Context, dy: Array,
                          into: Mapping[str, Array] | None) -> tuple[Array, Any, dict]:
        """``backward`` by the prepared pass: this call's new result arrays, written inside its
        chain (``_after_backward``: ``dh0``, ``dc0``, the parameter and input gradients, and
        their sums into ``into``'s where the plan accumulates)."""
        xp, d, lengths = self.xp, ctx.directions[0][0], ctx.lengths
        dy_pass = dy if self.dy_pass is None else self.dy_pass
        if d is self.direction and lengths is None:  # (as the forward's ``held_arrays``)
            arrays = self.held_backward_arrays.copy()
            arrays["dy"] = dy_pass
        else:
            arrays = runtime.backward_arrays(dy_pass, d.fwd, d.h0, d.c0, lengths)
        if self.dy_pass is not None:  # (formed into ``dy_pass`` in the chain)
            arrays["dy_in"] = dy
        arrays["x"] = ctx.inputs[0]
        arrays["dh0"] = dh = xp.empty(self.state_shape, dy.dtype)
        if self.c0 is not None:
            arrays["dc0"] = dc = xp.empty(self.c_shape, dy.dtype)
        arrays["dx"] = dx = xp.empty(self.x_shape, dy.dtype)
        grads = {} if not self.gradient_roles else {  # (none where the plan accumulates)
            name: xp.empty(w.shape, w.dtype) for name, w in zip(self.names.values(), self.weights)}
        arrays.update(grads)  # (by their parameters' names: the ``gradient_roles``)
        if self.accumulates:
            self._keep_sums(into, self.gradient_names, (self.backward_pass,))
        ctx.backward_stats = self.backward_pass.run(arrays, captured=False)  # (``_where``)
        return dx, (dh if self.c0 is None else (dh, dc)), grads

    @staticmethod
    def _keep_sums(into: Mapping[str, Array], names: tuple[str, ...],
                   passes: Sequence[runtime.PreparedPass]) -> None:
        """The caller's arrays the backward's chains add the parameter gradients into, held
        with their fixed arrays (``sums``, in ``names``' order): the same objects call after
        call (the layer's ``grads``), checked by identity; where the caller's are others, held
        anew and the chains keyed again (``PreparedPass.forget_key``)."""
        if holds(passes[0].around.fixed.get("sums"), into, names):
            return
        sums = tuple(into[name] for name in names)
        for prepared in passes:
            prepared.around.fixed["sums"] = sums
            prepared.forget_key()

    def plan_backward(self, ctx: functional.Context, dy: Array) -> None:
        """After a backward of this plan's context that ran the whole way: prepare its pass for
        the later ones (where its persistent engine ran)."""
        if ctx.backward_stats is None or ctx.backward_stats.algo != "persistent":
            return
        d = ctx.directions[0][0]
        batch, hidden = dy.shape[1], self.hidden
        engine, _ = runtime._engine(self.cell, dy, hidden, batch, self.algo, backward=True,
                                    half=self.half, proj_size=self.proj)
        if engine is None:
            return
        xp, lengths = self.xp, ctx.lengths
        dy = self._pass_dy(dy)
        if lengths is not None or not dy.flags.c_contiguous:  # (the dy the chain reads,
            # selected or copied into ``backward``'s workspace: a batch-first call's is strided)
            self.dy_pass = workspace(xp, "dy", dy.shape, dy.dtype)
            formed_input(xp, dy, self.dy_pass, lengths, None)
            dy = self.dy_pass
        dgi, dgh = runtime._gradient_buffers(self.cell, dy, hidden, 0)
        prepared = runtime.prepare_backward(self.cell, engine, dy, self.w_hh, d.h0, d.c0, lengths,
                                            d.fwd, self.half, self.w_hr, 0, dgi, dgh)
        self.gradient_names = tuple(self.names[n] for n in _GRADIENTS if n in self.names)
        # (the call's new arrays, where it returns them; where the plan accumulates, none: the
        # gradients formed in held workspaces, as a 16-bit call's always are, and added into
        # the caller's)
        self.gradient_roles = () if self.accumulates else self.gradient_names
        weights = dict(zip(self.names.values(), self.weights))
        fixed = {"w_hh": self.w_hh, "w_ih": self.w_ih_t.T, "w_hr": self.w_hr, "mask": self.mask,
                 "dw_hh": workspace(xp, "dw_hh", self.w_hh.shape, np.float32),
                 "grads": tuple(workspace(xp, "plan_grad " + name, weights[name].shape,
                                          np.float32) for name in self.gradient_names)
                 if self.accumulates or self.half is not None else None}
        self.backward_pass, self.backward_engine = prepared, engine
        fixed.update(self._backward_fixed())
        prepared.around = runtime.Around(
            self._before_backward, self._after_backward, fixed,
            ("x", "dh0", "dx", *self.gradient_roles)
            + (() if self.dy_pass is None else ("dy_in",))
            + (() if self.c0 is None else ("dc0",)), _ADDRESSED | set(self.gradient_roles))

    def _pass_dy(self, dy: Array) -> Array:
        """The ``dy`` the backward's pass reads of a call's (before any selection): its own."""
        return dy

    def _backward_fixed(self) -> dict:
        """The backward chain's ``fixed`` arrays beyond those of every plan: none."""
        return {}

    def _before_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside the backward's chain, before its pass (``runtime.Around``): with lengths the
        caller's ``dy`` selected into the one the pass reads, the carries zeroed and ``W_hh^T``
        copied anew (an optimizer may have changed ``W_hh`` in place), as
        ``functional.backward`` and ``runtime.backward_call`` do them."""
        xp, prepared = self.xp, self.backward_pass
        formed_input(xp, arrays.get("dy_in"), arrays["dy"], arrays["lengths"], fixed["mask"])
        runtime.zero_carries(prepared.backward)
        for arg, key in self._transposes():
            xp.copyto(prepared.args[arg], fixed[key].T)

    def _transposes(self) -> tuple[tuple[str, str], ...]:
        """The backward pass's transposed weights, copied anew every call: (its argument, the
        weight's key in the chain's ``fixed``)."""
        return (("w_t", "w_hh"),) if self.w_hr is None else (("w_hh_t", "w_hh"),
                                                              ("w_hr_t", "w_hr"))

    def _after_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside the backward's chain, after its completion: this call's results into its new
        arrays, as ``functional.backward`` forms them - ``dh0`` (``runtime.initial_state_gradient``),
        an LSTM's ``dc0`` (the direct carry's row 0), the parameter gradients
        (``functional.parameter_gradients``; where the plan accumulates, into its held
        workspaces, then added into the caller's) and ``dx``."""
        xp, s = self.xp, self.backward_pass.backward
        runtime.initial_state_gradient(s, fixed["w_hh"], arrays["dh0"][0])
        if self.c0 is not None:
            xp.copyto(arrays["dc0"], s.dc_carry[:1])
        x = arrays["x"]
        grads = fixed["grads"] or tuple(arrays[role] for role in self.gradient_roles)
        functional.parameter_gradients(
            s.dgi, s.dgh, x.reshape(-1, x.shape[2]), arrays["y"], arrays["h0"],
            "bias_ih" in self.names, grads, fixed["dw_hh"], self.half)
        if self.proj:
            functional.projection_gradient(s.drs, arrays["hs"], grads[-1], self.half)
        matmul_steps(s.dgi, fixed["w_ih"], arrays["dx"].reshape(-1, x.shape[2]))
        if self.accumulates:  # (as the layer API adds a full call's: ``layers``)
            for total, g in zip(fixed["sums"], grads):
                total += g

    def _backward_current(self, ctx: functional.Context) -> bool:
        """Whether the prepared backward may run now (what ``matches`` checks of a forward)."""
        return (settings.current() is self.settings and buffers.generation() == self.generation
                and _where(self.xp) == self.backward_where and self._same_weights(ctx.params)
                and launch.COOLDOWNS.reason(self.backward_engine.key) is None)



def holds(held: tuple | None, into: Mapping[str, Array], names: Sequence[str]) -> bool:
    """Whether ``held`` (or ``None``) is ``into``'s arrays of ``names``, in order, the very
    objects (a plan's held sums: ``Plan._keep_sums``, ``StackPlan._held_sums``)."""
    if held is None:
        return False
    for name, a in zip(names, held):  # (a loop: no generator's frame)
        if into[name] is not a:
            return False
    return True


def contiguous_states(xp, states: tuple) -> tuple:
    """The given initial states as the kernels read them: as they are where contiguous (the
    usual case: nothing to enqueue), else copied, as ``functional._initial_states`` does."""
    return tuple(a if a is None or a.flags.c_contiguous else xp.ascontiguousarray(a)
                 for a in states)


def _bits(a: Array) -> Array:
    """``a`` as it is selected: a 16-bit array on its bits (+0.0 is all zero bits)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _time_major(a: Array, batch_first: bool) -> Array:
    """A batch-first layer's array (B, T, X) seen time-major (a view; itself otherwise, or back:
    the transposition is its own inverse)."""
    return a.transpose(1, 0, 2) if batch_first else a


def formed_input(xp, given: Array | None, x: Array, lengths: Array | None,
                 mask: tuple | None) -> None:
    """Inside a forward's chain, the call's layer input ``x`` formed from the ``given`` one where
    they differ (``None``: they do not): selected with ``lengths`` (``functional._selected_input``;
    ``mask``: the plan's ``buffers.mask_arrays`` of its bits), else copied (a strided input);
    in a backward's, the ``dy`` its pass reads so (a batch-first call's is strided)."""
    if given is None:
        return
    if lengths is None:
        xp.copyto(x, given)
    else:
        select_active(xp, _bits(given), lengths, _bits(x), mask)


def _narrowed(xp, out: Array, a: Array) -> None:
    """``a`` (float32) rounded into ``out`` of a 16-bit dtype, as ``astype`` and torch's ``.to``
    round (to nearest, ties to even): a 16-bit layer's results and gradients."""
    xp.copyto(out, a, casting="unsafe")


def _refresh(held: Array, m: Array) -> None:
    """A 16-bit ``m`` (a weight, or its transpose) into ``held``, the pass's own copy of it
    (``runtime``: float32 values, or ``buffers.weight_words``' 16-bit pairs, a padded last
    column staying zero), inside the chain: an optimizer may have changed ``m`` in place."""
    if held.dtype == np.float32:
        widen(m, held)
    else:
        held.view(np.uint16)[:, :m.shape[1]] = m.view(np.uint16)


class HalfPlan(Plan):
    """The ``Plan`` of a 16-bit layer's call (``functional``'s ``half``): as a float32 layer's,
    with its conversions inside the chains too, as the full path makes them - the input
    projection of the 16-bit operands (``matmul.matmul_half``), the biases and given initial
    states widened (``halves.widen``) into the plan's workspaces or the call's float32 arrays, the
    results rounded into the layer's dtype (``_narrowed``); in the backward ``dy``, the input,
    ``W_ih`` and ``W_hh`` widened, the gradients rounded into the parameters' dtype (or, where the
    plan accumulates, summed in float32 with the caller's and rounded there, as ``layers``
    does). A weight the pass holds as a copy (odd sizes, ``W_hh^T``) is copied anew."""

    def _pass_bias(self, b_hh: Array | None) -> Array | None:
        """The float32 workspace the pass reads ``b_hh`` from (widened inside the chain)."""
        if b_hh is None:
            return None
        return workspace(self.xp, "b_hh_gi", b_hh.shape, np.float32)

    def _forward_fixed(self, b_ih: Array | None, b_hh: Array | None) -> dict:
        """A float32 layer's, and the 16-bit ``W_hh`` (``W_hr``) and ``b_hh`` the chain converts
        for the pass (a weight ``None`` where the pass reads its memory: no copy of it to
        refresh), the widened biases and output."""
        xp, args = self.xp, self.forward_pass.args
        fixed = super()._forward_fixed(b_ih, b_hh)
        for key, w in (("w_hh", self.w_hh), ("w_hr", self.w_hr)):
            held = args.get(key)  # (a view of the weight's memory: the pass reads the weight)
            view = held is None or address(held) == address(w.view(np.uint16))
            fixed[key], fixed[key + " words"] = (None, None) if view else (w, held)
        fixed.update(b_hh=b_hh, b_hh_wide=None if b_hh is None else args["b_hh"],
                     b_ih_wide=None if b_ih is None else workspace(xp, "b_ih_gi", b_ih.shape,
                                                                   np.float32),
                     y_wide=None if self.mask is None else workspace(xp, "result_y", self.y_shape,
                                                                     np.float32))
        return fixed

    def _state_roles(self) -> tuple[str, ...]:
        """The given 16-bit initial states (widened into the call's float32 ``h0``, ``c0``)."""
        if not self.states:
            return ()
        return ("hx_given",) + (() if self.c0 is None else ("cx_given",))

    def _initial_states(self, hx: Any) -> tuple[Array, Array | None, dict]:
        """New float32 initial states of a call giving ``hx`` (16-bit, widened into them inside
        the chain, as functional widens them) and the given arrays by role."""
        xp = self.xp
        h0 = xp.empty(self.state_shape[1:], np.float32)
        if self.c0 is None:
            return h0, None, {"hx_given": hx[0]}
        return h0, xp.empty(self.c_shape[1:], np.float32), {"hx_given": hx[0][0],
                                                                "cx_given": hx[1][0]}

    def _before_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside the forward's chain, before its pass: the initial states and biases widened,
        ``W_hh``'s copy refreshed, the input copied where strided and projected by the 16-bit
        product, ``gi = x W_ih^T + b_ih`` (``functional._projected``)."""
        if "hx_given" in arrays:
            widen(arrays["hx_given"], arrays["h0"])
            if self.c0 is not None:
                widen(arrays["cx_given"], arrays["c0"])
        for key in ("w_hh", "w_hr"):
            if fixed[key] is not None:
                _refresh(fixed[key + " words"], fixed[key])
        if fixed["b_hh"] is not None:
            widen(fixed["b_hh"], fixed["b_hh_wide"])
        formed_input(self.xp, arrays["x_given"], arrays["x"], arrays["lengths"], fixed["x_mask"])
        x = arrays["x"]
        matmul_half(x.reshape(-1, x.shape[2]), fixed["w_ih_t"], self.half, fixed["gi"])
        if fixed["b_ih"] is not None:
            fixed["gi"] += widen(fixed["b_ih"], fixed["b_ih_wide"])

    def _after_forward(self, arrays: dict, fixed: dict) -> None:
        """Inside the forward's chain, after its completion: the output (selected into the
        float32 ``result_y`` with lengths), ``h_n`` and ``c_n`` rounded into the call's
        16-bit arrays (``functional``'s scratch results and the callers' conversion)."""
        xp, y, lengths = self.xp, arrays["y"], arrays["lengths"]
        if lengths is not None:
            y = select_active(xp, y, lengths, fixed["y_wide"], fixed["mask"])
        _narrowed(xp, arrays["out"], y)
        _narrowed(xp, arrays["h_n"], arrays["y"][-1:])
        if self.c0 is not None:
            _narrowed(xp, arrays["c_n"], arrays["cs"][-1:])

    def _pass_dy(self, dy: Array) -> Array:
        """The float32 workspace a call's 16-bit ``dy`` is widened into (``functional``'s)."""
        self.dy_pass = buffers.widened(self.xp, dy, "dy_wide")
        return self.dy_pass

    def _backward_fixed(self) -> dict:
        """The float32 workspaces the backward's chain widens into and computes in: ``dy`` (the
        pass's where it has no lengths), ``W_hh`` (where the pass holds 16-bit ``W_hh^T``),
        ``W_ih``, the input, ``dx``, ``dh0`` (the parameter gradients': every plan's ``grads``)
        and where the plan accumulates the caller's sums widened."""
        xp, held = self.xp, self.backward_pass.args[self._transposes()[0][0]]
        steps, batch, _ = self.x_shape
        w_ih = self.w_ih_t.T
        fixed = {"dy_wide": workspace(xp, "dy_wide", self.y_shape, np.float32),
                 "w_hh_wide": None if held.dtype == np.float32 else workspace(
                     xp, "w_hh_wide0", self.w_hh.shape, np.float32),
                 "w_ih_wide": workspace(xp, "w_ih_wide0", w_ih.shape, np.float32),
                 "x_wide": workspace(xp, "input_wide", (steps * batch, self.x_shape[2]),
                                     np.float32),
                 "dx_wide": workspace(xp, "result_dx", (steps * batch, self.x_shape[2]),
                                      np.float32),
                 "dh_wide": workspace(xp, "result_dh0", self.state_shape, np.float32)}
        if self.accumulates:
            for name, w in zip(self.names.values(), self.weights):
                fixed[_SUM + name] = workspace(xp, "plan_sum " + name, w.shape, np.float32)
        return fixed

    def _before_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside the backward's chain, before its pass: the caller's ``dy`` widened (and with
        lengths selected into the pass's), the carries zeroed, ``W_hh^T`` copied anew."""
        xp, prepared = self.xp, self.backward_pass
        widen(arrays["dy_in"], fixed["dy_wide"])
        if arrays["lengths"] is not None:
            select_active(xp, fixed["dy_wide"], arrays["lengths"], arrays["dy"], fixed["mask"])
        runtime.zero_carries(prepared.backward)
        for arg, key in self._transposes():
            _refresh(prepared.args[arg], fixed[key].T)

    def _after_backward(self, arrays: dict, fixed: dict) -> None:
        """Inside the backward's chain, after its completion: ``dh0`` (by ``W_hh``'s float32
        values, as ``runtime.backward_call`` takes them), ``dc0``, the parameter gradients from
        the widened input and ``dx`` from the widened ``W_ih``, in float32 as
        ``functional.backward`` forms them, then rounded into the call's 16-bit arrays (summed
        into the caller's first where the plan accumulates)."""
        xp, s = self.xp, self.backward_pass.backward
        w_hh = fixed["w_hh_wide"]
        w_hh = (self.backward_pass.args[self._transposes()[0][0]].T if w_hh is None
                else widen(fixed["w_hh"], w_hh))
        runtime.initial_state_gradient(s, w_hh, fixed["dh_wide"][0])
        _narrowed(xp, arrays["dh0"], fixed["dh_wide"])
        if self.c0 is not None:
            _narrowed(xp, arrays["dc0"], s.dc_carry[:1])
        x = arrays["x"]
        x = widen(x.reshape(-1, x.shape[2]), fixed["x_wide"])
        names, grads = self.gradient_names, fixed["grads"]
        functional.parameter_gradients(s.dgi, s.dgh, x, arrays["y"], arrays["h0"],
                                       "bias_ih" in self.names, grads, fixed["dw_hh"], self.half)
        if self.proj:
            functional.projection_gradient(s.drs, arrays["hs"], grads[-1], self.half)
        matmul_steps(s.dgi, widen(fixed["w_ih"], fixed["w_ih_wide"]), fixed["dx_wide"])
        _narrowed(xp, arrays["dx"].reshape(fixed["dx_wide"].shape), fixed["dx_wide"])
        for k, (name, g) in enumerate(zip(names, grads)):
            if self.accumulates:  # (as ``layers`` adds a full call's: in float32, rounded once)
                total = fixed["sums"][k]
                g += widen(total, fixed[_SUM + name])
                _narrowed(xp, total, g)
            else:
                _narrowed(xp, arrays[name], g)
