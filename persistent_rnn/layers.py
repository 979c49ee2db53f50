"""``RNN``, ``GRU`` and ``LSTM`` layers: parameters, gradients, state and checks.

Shapes, gate order, equations, parameter names and initialisation follow ``torch.nn``. Arrays
decide the device: NumPy inputs run on the CPU, CuPy inputs on the current GPU, and the
parameters and gradients follow the data (moved once when the device changes, then kept there).

16-bit layers (``dtype="float16"`` or ``"bfloat16"``) keep parameters and gradients in that
dtype, as ``torch.nn`` modules after ``.half()`` do; each call multiplies the 16-bit input by
``W_ih`` as they are (on a GPU on the tensor cores, fp32 accumulation), computes the rest in fp32
on their values (exact), rounds h_t to the dtype every step (where the 16-bit kernels do) and
returns 16-bit arrays. bfloat16 layers take NumPy arrays of ``ml_dtypes.bfloat16`` only: the
layer API's CuPy path has not been run with CuPy's bfloat16 arrays (on a GPU, use the torch modules).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import call_plans, functional, plans, validation
from .buffers import array_module, widened
from .cells import CellSpec, cell_spec
from .validation import CallOrderError
from .stats import RunStats

Array = Any


class _Recurrent:
    """A stack of recurrent layers over one cell; see ``RNN``, ``GRU`` and ``LSTM``."""

    mode = ""
    nonlinearity = "tanh"  # only RNN lets it be chosen

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False, proj_size: int = 0,
                 dtype: Any = "float32", algo: str = "auto", seed: int | None = None):
        self.input_size = validation.positive_int("input_size", input_size)
        self.hidden_size = validation.positive_int("hidden_size", hidden_size)
        self.cell: CellSpec = cell_spec(self.mode, self.nonlinearity)
        self.proj_size = validation.proj_size(proj_size, self.hidden_size,
                                              self.cell.projection)
        self.num_layers = validation.positive_int("num_layers", num_layers)
        self.bias, self.batch_first, self.bidirectional = bool(bias), bool(batch_first), bool(
            bidirectional)
        self.dtype = validation.float_dtype("dtype", dtype)
        self._half = self.dtype.name if self.dtype.name in validation.HALF_DTYPES else None
        self.algo = validation.choice("algo", algo, validation.ALGOS)
        self.params = self._init_params(seed)
        self.grads = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.last_run: RunStats | None = None
        self._ctx: functional.Context | None = None
        self._y_shape: tuple[int, ...] = ()
        self._plan: call_plans.CallSignature | None = None  # the steady-state call's plan
        self._last_signature: tuple = ()  # of the last call that ran the whole way

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.input_size}, {self.hidden_size}, "
                f"num_layers={self.num_layers}, bias={self.bias}, batch_first={self.batch_first}, "
                f"bidirectional={self.bidirectional}, "
                + (f"proj_size={self.proj_size}, " if self.proj_size else "")
                + f"dtype={self.dtype.name!r}, "
                f"algo={self.algo!r})")

    @property
    def directions(self) -> int:
        """1, or 2 when bidirectional."""
        return 2 if self.bidirectional else 1

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names (``torch.nn``'s, in its order) and shapes."""
        rows, hidden = self.cell.gates * self.hidden_size, self.hidden_size
        out = self.proj_size or hidden  # the width of h (r with a projection)
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(self.num_layers):
            width = self.input_size if layer == 0 else out * self.directions
            for d in range(self.directions):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                shapes["weight_ih" + sfx] = (rows, width)
                shapes["weight_hh" + sfx] = (rows, out)
                if self.bias:
                    shapes["bias_ih" + sfx] = (rows,)
                    shapes["bias_hh" + sfx] = (rows,)
                if self.proj_size:
                    shapes["weight_hr" + sfx] = (self.proj_size, hidden)
        return shapes

    def _init_params(self, seed: int | None) -> dict[str, Array]:
        # torch.nn's initialisation: every parameter U(-1/sqrt(H), 1/sqrt(H))
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(self.hidden_size)
        return {k: rng.uniform(-bound, bound, size=s).astype(self.dtype)
                for k, s in self.param_shapes().items()}

    def load_params(self, mapping: Mapping[str, Any]) -> None:
        """Replace every parameter from ``mapping`` (names as in ``params``; any arrays, e.g. a
        ``torch`` state_dict's tensors as NumPy); values are copied in the layer's dtype onto
        the parameters' current device."""
        validation.params_mapping(mapping, self.param_shapes())
        xp = self._module()
        loaded = {key: validation.param_array(xp, key, mapping[key], self.dtype)
                  for key in self.params}
        self.params.update(loaded)  # only once every value converted: all or nothing

    def zero_grad(self) -> None:
        """Set every gradient to zero."""
        for g in self.grads.values():
            g[...] = 0

    def forward(self, x: Array, hx: Any = None, lengths: Any = None) -> tuple[Array, Any]:
        """Run the layer on ``x`` (T, B, input_size), or (B, T, input_size) if ``batch_first``.

        ``hx``: ``None`` (zeros) or h0 (num_layers * D, B, H); LSTM: ``(h0, c0)`` (with
        ``proj_size`` P: h0 is (num_layers * D, B, P), c0 stays H wide).
        ``lengths``: ``None`` or B integers in 1..T (packed-sequence semantics: a sequence's
        state stops at its length and its outputs past it are zero; any order).
        Returns ``(y, hn)``: y (T, B, D * H), or D * P (batch-first likewise), hn like ``hx``.
        """
        plan = self._plan
        if plan is not None and plan.matches(x, hx, self.params, self.algo, lengths):  # call_plans
            if self.batch_first:  # (the plan's time-major view: transposed inside its chain)
                x = x.transpose(1, 0, 2)
            if lengths is not None:  # (x and hx are as planned: checked as the full path does)
                lengths = validation.lengths(lengths, x.shape[1], x.shape[0], plan.xp)
            self._ctx = None
            y, hn, ctx = plan.forward(x, hx, self.params, lengths)
            if self.batch_first:  # (as the full path returns it: a view)
                y, ctx.batch_first = y.transpose(1, 0, 2), True
            self._last_signature = plan.key
            self._ctx, self._y_shape, self.last_run = ctx, y.shape, ctx.stats
            return y, hn
        if x is None:
            raise TypeError("x must be a numpy.ndarray or cupy.ndarray, got None")
        h0, c0 = validation.state("hx", hx, self.cell.has_cell_state)
        xp = validation.common_module(x=x, hx=h0, **({"hx[1]": c0} if c0 is not None else {}))
        self._check_module(xp)
        validation.array("x", x, (None, None, self.input_size), self._x_dims(), self.dtype)
        batch, steps = (x.shape[0], x.shape[1]) if self.batch_first else (x.shape[1], x.shape[0])
        validation.has_steps("x", x, steps, self._x_dims())
        self._check_state("hx", h0, c0, batch)
        if lengths is not None:
            lengths = validation.lengths(lengths, batch, steps, xp)
        self._to_device(xp)
        self._ctx = None
        # (16-bit arrays as they are: functional converts what it computes on)
        y, hn, ctx = functional.forward(
            self.cell, self.params, x, hx, lengths,
            num_layers=self.num_layers, bidirectional=self.bidirectional,
            batch_first=self.batch_first, algo=self.algo, half=self._half,
            scratch_results=self._half is not None)  # (rounded into new arrays by _store)
        self._ctx, self._y_shape, self.last_run = ctx, tuple(y.shape), ctx.stats
        self._plan_calls(ctx, x, hx, lengths)
        return self._store(y), self._store(hn)

    def _plan_calls(self, ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> None:
        """Plan this call's signature (``call_plans``) when the call before that ran the whole
        way had it too (a one-off call plans nothing): a persistent call's, or one that asked for
        the GEMM path (an ``"auto"`` call that fell back to it decides anew every call)."""
        if ctx.stats.algo != "persistent" and ctx.algo != "gemm":
            return
        signature = call_plans.signature(x, hx, lengths)
        if signature == self._last_signature:
            self._plan = plans.plan_of(ctx, x, hx, lengths, signature, accumulates=True)
        self._last_signature = signature

    def backward(self, dy: Array, dhn: Any = None) -> tuple[Array, Any]:
        """Backward of the last ``forward``: ``dy`` like ``y``, ``dhn`` like ``hn`` (``None``:
        zero). Adds the parameter gradients into ``grads``; returns ``(dx, dhx)`` with dhx like
        ``hx`` (zeros-initial states get gradients too). Once per forward."""
        ctx = self._ctx
        plan = None if ctx is None else ctx.plan
        if (plan is not None and dhn is None and type(dy) is plan.x_type
                and dy.shape == self._y_shape and dy.dtype == self.dtype
                and dy.flags.c_contiguous):  # (what the checks below read: call_plans)
            self._ctx = None
            dx, dhx, grads, added = plan.backward(ctx, dy, self.grads)
            if added:  # (all inside its chain: the sums, the results in the layer's dtype)
                self.last_run = ctx.backward_stats
                return dx, dhx
            return self._gradients(ctx, dx, dhx, grads)
        if ctx is None:
            raise CallOrderError("backward needs a preceding forward (and runs once per forward); "
                                 "call forward first")
        if dy is None:
            raise TypeError("dy must be a numpy.ndarray or cupy.ndarray, got None")
        dh, dc = validation.state("dhn", dhn, self.cell.has_cell_state, partial=True)
        xp = validation.common_module(dy=dy, dhn=dh, **({"dhn[1]": dc} if dc is not None else {}))
        if xp is not self._module():
            raise TypeError(f"dy must be on the forward's device ({self._device_name()}), "
                            f"got {xp.__name__}")
        dims = "(B, T, D*H)" if self.batch_first else "(T, B, D*H)"
        validation.array("dy", dy, self._y_shape, dims, self.dtype)
        batch = self._y_shape[0] if self.batch_first else self._y_shape[1]
        self._check_state("dhn", dh, dc, batch)
        self._ctx = None
        return self._gradients(ctx, *functional.backward(ctx, dy, dhn))

    def _gradients(self, ctx: functional.Context, dx: Array, dhx: Any,
                   grads: dict[str, Array]) -> tuple[Array, Any]:
        """Add a backward's parameter gradients into ``grads``; its ``(dx, dhx)`` as returned."""
        for key, g in grads.items():
            if self._half is None:
                self.grads[key] += g
            else:  # summed in fp32 (into g, the call's own), rounded once
                g += widened(self._module(), self.grads[key], "grad_wide")
                self.grads[key][...] = g
        self.last_run = ctx.backward_stats
        if self._half is None:
            return dx, dhx
        return self._store(dx), self._store(dhx)

    def _store(self, a: Any) -> Any:
        """A result (an array, a pair of them) in the layer's dtype (16-bit: rounded once)."""
        if self._half is None:
            return a
        if isinstance(a, (tuple, list)):
            return tuple(self._store(v) for v in a)
        return a.astype(self.dtype)

    def _check_module(self, xp) -> None:
        """TypeError for a bfloat16 layer given CuPy arrays (a path never run on a GPU)."""
        if self._half == "bfloat16" and xp is not np:
            raise TypeError("dtype='bfloat16' layers take NumPy arrays only (the layer API's "
                            "CuPy path does not take bfloat16); use dtype='float16' on CuPy, or "
                            "persistent_rnn.torch with torch.bfloat16 tensors")

    def _x_dims(self) -> str:
        return "(B, T, input_size)" if self.batch_first else "(T, B, input_size)"

    def _check_state(self, name: str, h: Array | None, c: Array | None, batch: int) -> None:
        states = self.num_layers * self.directions
        cell = (f"{name}[1]", c, self.hidden_size, "hidden_size")
        h_width = (self.proj_size, "proj_size") if self.proj_size else (self.hidden_size,
                                                                        "hidden_size")
        pairs = (((f"{name}[0]", h, *h_width), cell) if self.cell.has_cell_state
                 else ((name, h, *h_width),))
        for label, a, width, width_name in pairs:
            if a is not None:
                validation.array(label, a, (states, batch, width),
                                 f"(num_layers * num_directions, B, {width_name})", self.dtype)

    def decoder(self, batch: int):
        """A resident decoder of this layer for ``batch`` rows: single steps with W_hh held in
        registers between them (``persistent_rnn.decoder``; docs/api.md). Unidirectional, no
        projection; the weights are those of this call. A context manager."""
        from .cell_step import step_forward
        from .decoder import Decoder
        if self.bidirectional or self.proj_size:
            raise ValueError("decoder(): a decoder steps a unidirectional layer without a "
                             "projection (bidirectional=False, proj_size=0)")
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        layers = [{n: self.params[f"{n}_l{i}"] for n in names if f"{n}_l{i}" in self.params}
                  for i in range(self.num_layers)]
        return Decoder(self.cell, layers, batch, self.input_size, self.hidden_size, stacked=True,
                       fallback=step_forward, algo=self.algo)

    def _module(self):
        """The array module the parameters live on (``numpy`` or ``cupy``)."""
        return array_module(next(iter(self.params.values())))

    def _device_name(self) -> str:
        xp = self._module()
        return "CuPy/GPU" if xp is not np else "NumPy/CPU"

    def _to_device(self, xp) -> None:
        """Move parameters and gradients to ``xp``'s device if they are elsewhere (once)."""
        if self._module() is xp:
            return
        move = xp.asarray if xp is not np else (lambda a: a.get())
        self.params = {k: move(v) for k, v in self.params.items()}
        self.grads = {k: move(v) for k, v in self.grads.items()}


class RNN(_Recurrent):
    """Elman RNN, ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, act ``tanh`` or ``relu``.

    ``RNN(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    bidirectional=False, proj_size=0, dtype="float32", algo="auto", seed=None,
    nonlinearity="tanh")``; ``proj_size`` must be 0 (torch.nn's rule: LSTM only).
    """

    mode = "RNN"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False, proj_size: int = 0,
                 dtype: Any = "float32", algo: str = "auto", seed: int | None = None,
                 nonlinearity: str = "tanh"):
        self.nonlinearity = validation.choice("nonlinearity", nonlinearity,
                                              validation.NONLINEARITIES)
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, bidirectional,
                         proj_size, dtype, algo, seed)


class GRU(_Recurrent):
    """GRU with ``torch.nn.GRU``'s gates r, z, n and equations; same constructor as ``LSTM``
    (``proj_size`` must be 0: torch.nn's rule)."""

    mode = "GRU"


class LSTM(_Recurrent):
    """LSTM with ``torch.nn.LSTM``'s gates i, f, g, o; ``hx``/``hn`` are ``(h, c)`` pairs.

    ``LSTM(input_size, hidden_size, num_layers=1, bias=True, batch_first=False,
    bidirectional=False, proj_size=0, dtype="float32", algo="auto", seed=None)``.
    ``proj_size`` P (0 < P < hidden_size) projects each step's h_t to ``W_hr h_t`` (P wide), as
    ``torch.nn.LSTM(proj_size=P)``: that is the state that recurs and the output, ``weight_hr_l{k}``
    (P, hidden_size) the extra parameter, c stays hidden_size wide.
    """

    mode = "LSTM"
