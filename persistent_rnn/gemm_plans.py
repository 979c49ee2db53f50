"""A layer's steady-state call on the GEMM path, planned once per call signature (issue 26).

``call_plans`` plans a persistent call. A call whose caller asked for the GEMM path
(``algo="gemm"``: the library's reference path on NumPy, cuBLAS products and fused pointwise
kernels on a GPU) re-derives as much every time from its signature: the context's checks and
initial states, the direction's names and weights, the input projection's workspace, the stack
engine it will not use, the layer's output and final states through the general multi-layer
code. A ``GemmPlan`` keeps what depends only on the signature and serves exactly the calls a
``call_plans.Plan`` would (``call_plans.CallSignature.matches``: the same array type, shape and
dtype, the same weights or views of their memory, initial states given as when planned, the
same settings, thread, device and stream). Its forward is the full path's operation for operation, so its
results are bitwise the full path's: the input projection ``x W_ih^T + b_ih`` into the
workspace the full path uses, ``runtime.forward``'s GEMM path, then ``y`` and ``h_n`` (``c_n``)
copied out as ``functional.forward`` copies them. Its backward is the full path's: the context
it builds is the one ``functional.backward`` takes (``ctx.plan`` stays ``None``).

Planned: one unidirectional layer-direction of float32 or float64 without a projection, called
without lengths and with ``algo="gemm"`` (an ``"auto"`` call that fell back to the GEMM path
keeps the full path, which decides anew every call whether the persistent kernel may run).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import call_plans, functional, runtime
from .buffers import array_module, workspace
from .matmul import matmul_steps

Array = Any


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any) -> "GemmPlan | None":
    """The plan of a single layer-direction's forward on the GEMM path that ran the whole way
    (``functional.forward`` of the time-major ``x``, ``hx``, ``lengths`` gave ``ctx``), or
    ``None`` where its signature is not planned (module docstring)."""
    d = ctx.directions[0][0]
    if not (ctx.algo == "gemm" and ctx.num_layers == 1 and not ctx.bidirectional
            and ctx.half is None and lengths is None and "weight_hr" not in d.names
            and x.dtype in (np.float32, np.float64)
            and ctx.params[d.names["weight_ih"]].dtype == x.dtype
            and call_plans.runs_here(array_module(x))):
        return None
    return GemmPlan(ctx, x, hx is not None)


class GemmPlan(call_plans.CallSignature):
    """One layer's GEMM-path call of one signature (module docstring): ``matches`` (every
    plan's) says whether a call may use it, ``forward`` runs it."""

    def __init__(self, ctx: functional.Context, x: Array, states: bool) -> None:
        d = ctx.directions[0][0]
        xp = self._signature(ctx, x, states, False)
        self._hold_weights(d.names, ctx.params)
        w_ih, w_hh, b_ih, b_hh = functional._weights(ctx, d.names)
        self.w_ih_t, self.w_hh, self.b_ih, self.b_hh = w_ih.T, w_hh, b_ih, b_hh
        self.h0, self.c0 = d.h0, d.c0  # (the zeros of calls without initial states)
        self.state_shape = (1, *d.h0.shape)
        self.c_shape = None if d.c0 is None else (1, *d.c0.shape)
        steps, batch, _ = x.shape
        # (functional's own workspace for the projection: ``_projected``'s "gi")
        self.gi = workspace(xp, "gi", (steps * batch, w_ih.shape[0]), w_ih.dtype)

    def _rebind(self, params: Mapping[str, Array]) -> bool:
        """Whether new arrays over the planned weights' memory may serve (``_same_memory``);
        the plan then reads them (no prepared pass holds any)."""
        weights = tuple(params.get(name) for name in self.names.values())
        if not all(call_plans._same_memory(new, old) for new, old in zip(weights, self.weights)):
            return False
        self.weights = weights
        biased = self.b_ih is not None
        self.w_ih_t, self.w_hh = weights[0].T, weights[1]
        self.b_ih, self.b_hh = (weights[2], weights[3]) if biased else (None, None)
        return True

    def forward(self, x: Array, hx: Any, params: Mapping[str, Array],
                lengths: Any = None) -> tuple[Array, Array | tuple, functional.Context]:
        """``functional.forward(cell, params, x, hx, algo="gemm", ...)`` of a matching call
        (``matches``), bitwise: its ``(y, hn, ctx)``."""
        cell = self.cell
        h0, c0 = (self.h0, self.c0) if hx is None else self._given_states(hx)
        gi = matmul_steps(x, self.w_ih_t, self.gi)
        if self.b_ih is not None:
            gi += self.b_ih
        fwd, stats = runtime.forward(cell, gi, self.w_hh, self.b_hh, h0, c0, None, "gemm")
        ctx = functional.Context(cell, params, 1, False, False, self.algo, None, None, None, [x],
                                 [[functional._Direction(self.names, h0, c0, fwd)]], stats)
        h_n = fwd.y[-1][None].copy()
        if c0 is None:
            return fwd.y.copy(), h_n, ctx
        return fwd.y.copy(), (h_n, fwd.cs[-1][None].copy()), ctx
