"""Which plan serves a call's signature: ``call_plans`` for a single layer-direction
(``gemm_plans`` for one whose caller asked for the GEMM path),
``stack_plans`` for a stack that ran in stack mode or a bidirectional layer or stack that ran as
pairs, ``layer_plans`` for a stack or bidirectional layer that ran one layer-direction per launch
(docs/design.md, planned calls); batch-first calls of each through a time-major view. The one
entry point of all three for the layer API and the torch modules."""
from __future__ import annotations

from typing import Any

from . import buffers, call_plans, functional, gemm_plans, layer_plans, stack_plans

Array = Any


def plan_of(ctx: functional.Context, x: Array, hx: Any, lengths: Any, key: tuple = (),
            accumulates: bool = False) -> "call_plans.CallSignature | None":
    """The plan of a forward that ran the whole way (``functional.forward`` of ``x``, ``hx``,
    ``lengths`` gave ``ctx``), or ``None`` where its signature is not planned; ``key``: the
    caller's signature of the call (``call_plans.signature``), which the plan keeps
    (``Plan.key``): a planned call is the last call of its signature (so that another thread's
    calls in between plan nothing rather than taking the plan over every other call). Calls
    with lengths are planned too: a plan's caller gives it valid lengths (the torch modules'
    packed input, whose lengths ``PackedLayout`` derives; the layer API checks them before a
    planned call as its full path does). ``accumulates``: its backward adds the parameter
    gradients into its caller's arrays inside the chain (``Plan.backward``'s ``into``: the layer
    API's ``grads``)."""
    given, x = x, call_plans._time_major(x, ctx.batch_first)  # (the plans' time-major view)
    if ctx.num_layers > 1 or ctx.bidirectional:
        plan = None
        if ctx.stats.algo == "persistent" and call_plans.runs_here(buffers.array_module(x)):
            plan = (stack_plans.plan_of(ctx, x, hx, lengths)
                    or layer_plans.plan_of(ctx, x, hx, lengths))
    else:
        plan = call_plans.plan_of(ctx, x, hx, lengths) or gemm_plans.plan_of(ctx, x, hx, lengths)
    if plan is not None:
        plan.key, plan.accumulates, plan.given_shape = key, accumulates, given.shape
    return plan
