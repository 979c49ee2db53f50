"""Stack mode: every layer of a unidirectional stack in one persistent launch per pass.

Where the weights of all layers fit the register files together (``plan.make_stack_plan``), the
forward of an L-layer stack is one launch of ``cuda_src/stack_forward.cu`` and its backward one
of ``stack_backward.cu`` instead of L each: layer l computes step t while layer l+1 computes
t-1 (forward; the reverse backward), so a pass takes about T + L - 1 step latencies instead of
L*T. The input projection of the layers above the first happens inside the kernel; layer 0's is
the GEMM before the launch, as for one layer.

Restarts and completion (``launch``, the layer passes' device-side chain, per layer): each CTA
records the last step it completed; the last CTA to leave a launch computes each layer's first
step not completed by all of its CTAs (``starts``: the settle, ``cuda_src/chain.cuh``) and the resume launches run the stack again from
there (a finished layer's CTAs exit at once). The exchange keeps every step's words
(``stack_common.cuh``), so a relaunch needs no zeroing and replays bitwise the same results.
After ``Settings.max_restarts`` restarts the completion kernel finishes every unfinished layer
from where it stopped, in order (forward bottom-up, backward top-down), each from the completed
output of its neighbour. Nothing is read back during the call; ``RunStats`` reads the chain's
record lazily.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from . import buffers, chain_graphs, hardware, launch, plan as planner, runtime, settings
from .cells import CellSpec
from .matmul import matmul
from .stats import RunStats

Array = Any
Weights = tuple  # one layer's (w_ih, w_hh, b_ih or None, b_hh or None)


def engine(cell: CellSpec, data: Array, hidden: int, layers: int, bidirectional: bool,
           algo: str, half: str | None, backward: bool,
           proj: bool = False) -> tuple[launch.Engine | None, str | None]:
    """The stack-mode engine of one pass over ``data`` (T, B, .), or ``(None, why not)``: then
    the layers run one launch per layer-direction (``None`` reason: stack mode was not asked
    for, e.g. ``algo="gemm"`` or the ``stack`` setting off). ``proj``: an LSTM projection."""
    if algo == "gemm" or (layers < 2 and not bidirectional):  # (first: no work per call)
        return None, None
    batch = data.shape[1]
    on_gpu = buffers.array_module(data) is not np
    if batch == 0 or not settings.current().stack or (algo == "auto" and not on_gpu):
        return None, None
    if proj:
        return None, "LSTM projections (proj_size) run one launch per layer-direction"
    why = runtime.why_not_persistent(data, batch, algo)
    if why is not None:
        return None, why
    device = runtime.planning_device(on_gpu)
    return _cached_engine(cell, hidden, batch, layers, bidirectional, backward, device,
                          on_gpu and settings.current().cooperative, not on_gpu, half or "float32")


@lru_cache(maxsize=64)
def _cached_engine(cell: CellSpec, hidden: int, batch: int, layers: int, bidirectional: bool,
                   backward: bool, device: hardware.DeviceProfile, cooperative: bool,
                   emulated: bool, weights: str) -> tuple[launch.Engine | None, str | None]:
    plan = planner.make_stack_plan(cell, hidden, batch, layers, bidirectional, weights, device)
    if not plan.fits:
        return None, plan.reason
    return runtime.engine_of(plan.backward if backward else plan.forward, device, cooperative,
                             emulated)


@dataclass(frozen=True)
class Around:
    """Stream operations of a planned stack call (``stack_plans``) that its pass enqueues inside
    its chain, as ``runtime.Around`` does for one layer-direction: ``before()`` just before the
    pass's first launch (after the chain's memsets), ``after()`` just after its completion
    kernel; ``key()``: every array they read or write (``chain_graphs.value``) and what they do
    - the chain graph's key holds it beside the launches' arguments. Nothing in them may
    allocate or look up scratch. ``per_call``: the names of the kernel's arguments that are
    this call's arrays; the others are the plan's, the same every call while ``fixed`` (a dict
    the plan keeps per prepared pass, emptied when what the pass holds changes) is kept: the
    key's part over them is built once into it (``_planned_key``). A planned call runs only
    where its plan found the stream not being captured (``call_plans._where``): ``_run`` tells
    ``launch.run_chain`` so."""

    before: Callable[[], None]
    after: Callable[[], None]
    key: Callable[[], tuple]
    per_call: tuple[str, ...]
    fixed: dict
    # ``per_call``'s names whose every call's array is contiguous, of the first call's shape and
    # dtype (the plan makes them, or checks them): their layout keyed once, per call only their
    # address (``chain_graphs.addresses``), as ``runtime.Around.addressed``
    addressed: frozenset[str] = frozenset()


def _run(engine_: launch.Engine, args: dict, layers: int, direction: int, xp, chained: bool,
         complete: str, complete_args: dict, exchanges: tuple[tuple[str, ...], ...],
         around: Around | None = None) -> RunStats:
    """Enqueue a stack pass's whole chain (``launch.run_chain``): the stack kernel with ``args``
    and each launch's ``starts``, its completion kernel ``complete`` with ``complete_args``
    (``around``'s operations before and after them inside it, where given).
    ``exchanges``: per tagged exchange buffer, the kernel arguments given it. Each has one slot
    per (layer, step) of the plan's ``exchange_row`` words (half a staged row,
    ``stack_common.cuh``) and is the chain's own (``launch.chain_for``: reused per thread and
    stream, zeroed by the chain's memset, once per pass as the kernels need; a restart
    does not zero them: ``launch.Chain``). Nothing is
    read back. A planned call's chain, exchanges and first starts are found once, into
    ``around.fixed`` (its plan serves one thread and stream)."""
    held = None if around is None else around.fixed.get("pass")
    if held is None:
        held = _pass_of(engine_, args, layers, direction, xp, chained, exchanges)
        if around is not None:
            around.fixed["pass"] = held
    chain, exchange_args, first, end, first_starts, detail = held
    issuer = _StackPass(engine_, chain, {**args, **exchange_args}, first_starts, complete,
                        complete_args, around, exchanges)
    return launch.run_chain(chain, issuer, None, first, end, settings.current_stall(), detail,
                            None if around is None else False, group="layer")


class _StackPass:
    """A stack pass's issuer for one call (``launch.PassIssuer``; its data ``None``: the pass
    holds the call's arguments): the stack kernel with ``args`` and each launch's starts, its
    completion ``complete`` with ``complete_args``, ``around``'s operations before and after
    them (where given), keyed by ``_arguments_key`` or, planned, ``_planned_key``."""

    __slots__ = ("engine", "chain", "args", "first_starts", "complete", "complete_args",
                 "around", "exchanges")

    def __init__(self, engine_: launch.Engine, chain: launch.Chain, args: dict,
                 first_starts: Array, complete: str, complete_args: dict, around: Around | None,
                 exchanges: tuple[tuple[str, ...], ...]):
        self.engine, self.chain, self.args, self.first_starts = engine_, chain, args, first_starts
        self.complete, self.complete_args = complete, complete_args
        self.around, self.exchanges = around, exchanges

    def issue_launch(self, data: None, start: Any, stall: settings.Stall) -> None:
        around, resume = self.around, start is launch.RESUME
        if not resume and around is not None:  # (the pass's first launch)
            around.before()
        starts = self.chain.starts if resume else self.first_starts
        launch.launch_pass(self.engine, self.chain.control, dict(self.args, starts=starts),
                           stall)

    def issue_completion(self, data: None) -> None:
        self.chain.complete(self.complete, **self.complete_args)
        if self.around is not None:
            self.around.after()

    def arguments_key(self, data: None) -> tuple:
        if self.around is None:
            return _arguments_key(self.complete, self.first_starts, self.args, self.complete_args)
        return _planned_key(self.complete, self.first_starts, self.args, self.complete_args,
                            self.around, self.exchanges)


def _pass_of(engine_: launch.Engine, args: dict, layers: int, direction: int, xp,
             chained: bool, exchanges: tuple[tuple[str, ...], ...]) -> tuple:
    """``_run``'s ``(chain, exchange arguments, first step, end, first launch's starts,
    detail)``."""
    steps = args["steps"]
    shape = (layers, steps, args["batch"], engine_.pass_plan.exchange_row)
    chain = launch.chain_for(xp, engine_, layers, (shape,) * len(exchanges),
                             restart_zeroes=False)
    first, end = (0, steps) if direction > 0 else (steps - 1, -1)
    what = f"stack of {layers} layers" if chained else "both directions of a layer side by side"
    return (chain, {name: buffer for names, buffer in zip(exchanges, chain.exchanges)
                    for name in names}, first, end, buffers.constant_ints(xp, layers, first),
            engine_.detail(what))


def _arguments_key(complete: str, first_starts: Array, args: dict, complete_args: dict
                   ) -> tuple:
    """What a stack pass's chain graph is keyed by beside the chain's own (``launch.run_chain``):
    the completion kernel and every argument of the pass's and the completion's launches."""
    return (complete, chain_graphs.value(first_starts), chain_graphs.arguments_key(args),
            chain_graphs.arguments_key(complete_args))


def _planned_key(complete: str, first_starts: Array, args: dict, complete_args: dict,
                 around: Around, exchanges: tuple[tuple[str, ...], ...]) -> tuple:
    """``_arguments_key`` of a planned call's pass, and ``around.key()``: the arguments but
    ``around.per_call``'s (those the pass has) keyed once into ``around.fixed`` (with which of
    the completion's arguments are which of those, by identity, and the layout of the
    ``around.addressed`` ones), per call only those arrays (the addressed ones' addresses).
    The exchanges are left out: they lie in the chain's words' allocation, which its own key
    holds (``launch._chain_key``)."""
    fixed = around.fixed.get("arguments")
    if fixed is None:
        names = tuple(name for name in around.per_call if name in args)
        roles = tuple((name, role) for name, v in complete_args.items() for role in names
                      if v is args[role])
        skip = {*names, *(name for name, _ in roles), *(n for group in exchanges for n in group)}
        addressed = tuple(name for name in names if name in around.addressed)
        fixed = around.fixed["arguments"] = chain_graphs.Fixed((
            *_arguments_key(complete, first_starts,
                            {k: v for k, v in args.items() if k not in skip},
                            {k: v for k, v in complete_args.items() if k not in skip}),
            roles, tuple([chain_graphs.value(args[name])[1:] for name in addressed]), addressed,
            tuple(name for name in names if name not in around.addressed)))
    return (fixed.token, chain_graphs.addresses(args, fixed[-2]),
            tuple([chain_graphs.value(args[name]) for name in fixed[-1]]), around.key())


def _stacked(xp, arrays: Sequence[Array], name: str) -> Array:
    """``arrays`` stacked on a new first axis as one contiguous float32 array: the workspace
    ``name`` (``buffers.workspace``; what the kernels read of this call's weights and forward
    buffers, copied every call because an optimizer may change the weights in place)."""
    out = buffers.workspace(xp, name, (len(arrays), *arrays[0].shape), np.float32)
    return xp.stack(arrays, out=out)


def _matrices(xp, arrays: Sequence[Array], name: str, half: str | None) -> Array:
    """The matrices ``arrays`` (each rows x K, one per layer) as the stack kernels hold them:
    ``_stacked`` float32 (layers, rows, K), or for a 16-bit stack (``half``) uint32 words of
    two 16-bit values, (layers, rows, ceil(K/2)) (``buffers.weight_words``, rounding the
    float32 values the layers hold: exact, they are 16-bit values)."""
    stacked = _stacked(xp, arrays, name)
    if half is None:
        return stacked
    layers, rows, cols = stacked.shape
    return buffers.weight_words(xp, stacked.reshape(layers * rows, cols), half, f"{name}_words")


def _weights_dtype(engine_: launch.Engine) -> str | None:
    """The 16-bit dtype whose words the engine's stack kernels take their weights as (their
    own, or the words an fp32 stack forward widens: ``plan.widened_pass``), or ``None``
    (fp32)."""
    defines = engine_.pass_plan.defines
    code = defines.get("PRNN_WEIGHT_DTYPE", 0) or defines.get("PRNN_WIDENED_FROM", 0)
    return next((name for name, c in planner.KERNEL_DTYPES.items() if code and c == code), None)


def _unused(xp) -> Array:
    """A placeholder for a kernel argument the launch never reads (W_ih of unchained groups)."""
    return buffers.constant_zeros(xp, (1,), np.float32)


def _biases(xp, cell: CellSpec, weights: Sequence[Weights], which: int, hidden: int) -> Array:
    zero = buffers.constant_zeros(xp, (cell.gates * hidden,), np.float32)
    return _stacked(xp, [zero if w[which] is None else w[which] for w in weights],
                    f"stack_bias{which}")


def forward(cell: CellSpec, engine_: launch.Engine, gi: Array, weights: Sequence[Weights],
            h0: Array, c0: Array | None, lengths: Array | None, chained: bool = True
            ) -> tuple[list[runtime.ForwardResult], RunStats]:
    """The forward of a stack in stack mode. ``gi``: layer 0's input projection (T, B, G*H);
    ``weights``: per layer ``(w_ih, w_hh, b_ih, b_hh)``; ``h0``/``c0``: (L, B, H).
    ``chained=False``: the groups are the two directions of one layer (each in its own time
    order), ``gi`` (2, T, B, G*H) holds both input projections and nothing passes between
    them."""
    xp = buffers.array_module(gi)
    steps, batch, _ = gi.shape[-3:]
    layers, hidden = len(weights), weights[0][1].shape[1]
    y = xp.empty((layers, steps, batch, hidden), np.float32)
    cs = xp.empty_like(y) if cell.has_cell_state else None
    saved = xp.empty((layers, steps, batch, cell.saved * hidden), np.float32)
    results = [runtime.ForwardResult(y[k], None if cs is None else cs[k], saved[k])
               for k in range(layers)]
    f32 = lambda a: xp.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    half = _weights_dtype(engine_)
    w_ih = (_matrices(xp, [w[0] for w in weights[1:]], "stack_w_ih", half) if chained
            else _unused(xp))
    args = forward_arguments(dict(
        w_ih=w_ih, w_hh=_matrices(xp, [w[1] for w in weights], "stack_w_hh", half),
        b_ih=_biases(xp, cell, weights, 2, hidden), b_hh=_biases(xp, cell, weights, 3, hidden)),
        f32(gi), f32(h0), f32(h0 if c0 is None else c0),
        buffers.full_lengths(xp, lengths, batch, steps), chained, y, cs, saved)
    return results, run_forward(engine_, args, xp)


def forward_arguments(weights: dict, gi: Array, h0: Array, c0: Array, lengths: Array,
                      chained: bool, y: Array, cs: Array | None, saved: Array) -> dict:
    """The stack forward kernel's arguments: ``weights`` (its stacked ``w_ih``, ``w_hh``,
    ``b_ih``, ``b_hh``), the float32 ``gi``, ``h0``, ``c0`` (an Elman or GRU stack's: ``h0``),
    int32 ``lengths`` and the pass's buffers (``cs``: ``None`` without a cell state)."""
    layers, steps, batch, hidden = y.shape
    return dict(weights, gi=gi, h0=h0, c0=c0, lengths=lengths, chained=chained, y=y,
                cs=y if cs is None else cs, saved=saved, steps=steps, batch=batch,
                hidden=hidden)


def run_forward(engine_: launch.Engine, args: dict, xp, around: Around | None = None
                ) -> RunStats:
    """Enqueue a stack forward's chain with ``args`` (``forward_arguments``; ``around``: a
    planned call's operations inside it); its stats."""
    # The completion kernel (device_loop.cu; W_hh stands in for the W_hr it does not read).
    complete = dict(args, w_hr=args["w_hh"], hs=args["y"], proj=0)
    return _run(engine_, args, args["y"].shape[0], 1, xp, args["chained"],
                "prnn_complete_forward", complete, (("exchange",),), around)


def backward(cell: CellSpec, engine_: launch.Engine, dy: Array, dhn: Array | None,
             dcn: Array | None, weights: Sequence[Weights], h0: Array, c0: Array | None,
             lengths: Array | None, fwds: Sequence[runtime.ForwardResult], chained: bool = True,
             out: tuple[Array, Array | None] | None = None
             ) -> tuple[list[runtime.BackwardResult], RunStats]:
    """The backward of a stack in stack mode. ``dy``: the top layer's output gradient (T, B, H),
    zero past each length; ``dhn``/``dcn``: (L, B, H) or ``None``; ``fwds``: each layer's
    forward buffers. Returns each layer's ``BackwardResult`` (``dh0``/``dc0`` included).
    ``chained=False``: the two directions of one layer, ``dy`` (2, T, B, H) both gradients.
    ``out``: ``(dh0, dc0)`` (L, B, H) arrays (``dc0`` ``None`` but for the LSTM) the layers'
    ``dh0``/``dc0`` are rows of (the caller's stacked gradients), else new ones."""
    xp = buffers.array_module(dy)
    steps, batch, hidden = dy.shape[-3:]
    layers, width = len(weights), cell.gates * hidden
    # dgi, dgh and the carries are scratch (reused workspaces): the caller reads dgi and dgh
    # before the next stack backward of this thread and stream; dh0 and dc0 go to ``out``
    shape = (layers, steps, batch, width)
    dgi = buffers.workspace(xp, "stack_dgi", shape, np.float32)
    dgh = buffers.workspace(xp, "stack_dgh", shape, np.float32) if cell.separate_dgh else dgi
    carry = (layers, steps + 1, batch, hidden)
    dh_carry = buffers.workspace(xp, "stack_dh_carry", carry, np.float32)
    dh_carry.fill(0)
    dc_carry = dh_carry
    if cell.has_cell_state:
        dc_carry = buffers.workspace(xp, "stack_dc_carry", carry, np.float32)
        dc_carry.fill(0)
    if dhn is not None:
        dh_carry[:, steps] = dhn
    if dcn is not None and cell.has_cell_state:
        dc_carry[:, steps] = dcn
    y = _stacked(xp, [f.y for f in fwds], "stack_y")
    f32 = lambda a: xp.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    half = _weights_dtype(engine_)
    w_ih_t = (_matrices(xp, [w[0].T for w in weights[1:]], "stack_w_ih_t", half) if chained
              else _unused(xp))
    args = backward_arguments(
        dict(w_t=_matrices(xp, [w[1].T for w in weights], "stack_w_t", half), w_ih_t=w_ih_t),
        f32(dy), y, None if fwds[0].cs is None else _stacked(xp, [f.cs for f in fwds], "stack_cs"),
        _stacked(xp, [f.saved for f in fwds], "stack_saved"), f32(h0),
        f32(h0 if c0 is None else c0), buffers.full_lengths(xp, lengths, batch, steps), chained,
        (dgi, dgh, dh_carry, dc_carry))
    stats = run_backward(engine_, args, xp)
    dh0 = xp.empty((layers, batch, hidden), np.float32) if out is None else out[0]
    dc0 = None
    if cell.has_cell_state:
        dc0 = xp.empty((layers, batch, hidden), np.float32) if out is None else out[1]
    initial_state_gradients(xp, args, [w[1] for w in weights], dh0, dc0)
    results = [runtime.BackwardResult(dgi[k], dgh[k], dh0[k], None if dc0 is None else dc0[k])
               for k in range(layers)]
    return results, stats


def backward_arguments(weights: dict, dy: Array, y: Array, cs: Array | None, saved: Array,
                       h0: Array, c0: Array, lengths: Array, chained: bool,
                       scratch: tuple[Array, Array, Array, Array]) -> dict:
    """The stack backward kernel's arguments: ``weights`` (its stacked ``w_t``, ``w_ih_t``), the
    float32 ``dy``, the forward's stacked buffers (``cs``: ``None`` without a cell state),
    ``h0``, ``c0``, int32 ``lengths`` and ``scratch``: ``dgi``, ``dgh``, the two carries."""
    dgi, dgh, dh_carry, dc_carry = scratch
    layers, steps, batch, hidden = y.shape
    return dict(weights, dy=dy, y=y, cs=y if cs is None else cs, saved=saved, h0=h0, c0=c0,
                lengths=lengths, chained=chained, dgi=dgi, dgh=dgh, dh_carry=dh_carry,
                dc_carry=dc_carry, steps=steps, batch=batch, hidden=hidden)


def run_backward(engine_: launch.Engine, args: dict, xp, around: Around | None = None
                 ) -> RunStats:
    """Enqueue a stack backward's chain with ``args`` (``backward_arguments``; ``around``: a
    planned call's operations inside it); its stats."""
    # (GRU's dgi and dgh are exchanged separately; otherwise one exchange serves both)
    exchanges = ((("exchange_gh",), ("exchange_gi",)) if args["dgh"] is not args["dgi"]
                 else (("exchange_gh", "exchange_gi"),))
    return _run(engine_, args, args["y"].shape[0], -1, xp, args["chained"],
                "prnn_complete_backward", dict(args, per_step=1), exchanges, around)


def initial_state_gradients(xp, args: dict, w_hh: Sequence[Array], dh0: Array,
                            dc0: Array | None) -> None:
    """After a stack backward with ``args`` (``backward_arguments``), each layer's ``dh0`` = its
    direct carry + ``W_hh^T dgh_0`` into the rows of ``dh0`` (``w_hh``: the layers' ``W_hh``)
    and, with a cell state, ``dc0`` its carry: stream-ordered, nothing read back."""
    dgh, dh_carry = args["dgh"], args["dh_carry"]
    for k, w in enumerate(w_hh):
        matmul(dgh[k, 0], w, out=dh0[k])
        dh0[k] += dh_carry[k, 0]  # (in place: the same sum)
    if dc0 is not None:
        xp.copyto(dc0, args["dc_carry"][:, 0])
