"""Run one layer-direction's recurrence: choose the algorithm, launch, restart, fall back, report.

This is the seam between the layer code (``functional``) and the two recurrence engines: the
GEMM path (``gemm``) and the persistent kernel (on the GPU, or its CPU emulation). Inputs are
time-major and already projected: ``gi = x @ W_ih^T + b_ih`` for all steps.

Buffers and their layouts: ``buffers.py``.

Algorithm choice: ``"gemm"`` always runs the GEMM path; ``"persistent"`` runs the persistent
kernel (CuPy arrays: on the GPU; NumPy arrays: the CPU emulation of the same source, a test and
debug path) and raises ValueError when it cannot; ``"auto"`` runs the persistent kernel on CuPy
float32 data when the plan fits and the batch is at most ``Settings.auto_max_batch`` (32: on an
H200 the persistent kernel beat the GEMM path at every batch up to 32 where it fit, see
docs/benchmarks.md and bench/results/h200-2026-11-23), else GEMM; ``"auto"`` never emulates.

Restarts and completion (one code for GPU and emulation): a persistent pass is enqueued as a
fixed chain (``launch.run_chain``): the launch, up to ``Settings.max_restarts`` resume launches
(the last CTA to leave each launch computes on the device the first step not completed by every
CTA: ``cuda_src/chain.cuh``), and a one-CTA completion kernel for whatever is left after the cap
(``cuda_src/device_loop.cu``). Nothing is read back during a call; ``RunStats`` reads the chain's
record when asked. Under CUDA stream capture the whole chain is captured.

Plans and engines (compiled module, occupancy check) are cached per configuration and device;
the transposed ``W_hh`` of the backward is one small copy per call, because an optimizer may
update ``W_hh`` in place and nothing cheaper than a copy proves a cached one current.

Scratch memory (a pass's chain words and exchanges, ``launch.chain_for``; the backward's
``dgi``/``dgh``, carry and ``W_hh^T`` where the caller gives a ``slot``) is reused per thread
and stream (``buffers.reused``): a steady-state call allocates only what it returns and what
the forward's context keeps (docs/design.md, "Allocations of a persistent call").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any, Callable

import numpy as np

from . import buffers, chain_graphs, gemm, hardware, launch, plan as planner, settings
from .cells import CellSpec
from .halves import widen
from .matmul import matmul
from .stats import RunStats
from .validation import ALGOS, HALF_DTYPES

Array = Any

# The emulation plans for the GPU the tiles are sized for, so that it runs the same configurations.
EMULATED_DEVICE = hardware.PROFILES["h100"]
_MAX_STEPS = 2**31 - 1


@dataclass
class ForwardResult:
    """The state buffers of one layer-direction's forward recurrence."""

    y: Array
    cs: Array | None
    saved: Array
    hs: Array | None = None            # the cell's h_t where y holds an LSTM projection r_t


@dataclass
class BackwardResult:
    """Gradients of one layer-direction's backward recurrence."""

    dgi: Array
    dgh: Array
    dh0: Array
    dc0: Array | None
    drs: Array | None = None           # each step's gradient of r_t (an LSTM projection)


_Engine = launch.Engine
COOLDOWNS = launch.COOLDOWNS


def forward(cell: CellSpec, gi: Array, w_hh: Array, b_hh: Array | None, h0: Array,
            c0: Array | None, lengths: Array | None, algo: str, half: str | None = None,
            w_hr: Array | None = None) -> tuple[ForwardResult, RunStats]:
    """Enqueue the forward recurrence over all steps of ``gi`` (the GEMM path, or a persistent
    pass with its restarts and completion on the device: nothing is read back). ``half``:
    ``None``, or the 16-bit dtype ("float16", "bfloat16") of a layer whose fp32 data holds values
    of that dtype: W_hh is held in it and h_t rounded to it every step; its ``w_hh`` and ``w_hr``
    may be arrays of that dtype (the persistent kernels take their bits as they are, the GEMM
    path their float32 values). ``w_hr``: an LSTM's projection (P, H), or ``None``."""
    proj_size = 0 if w_hr is None else w_hr.shape[0]
    y, cs, saved = buffers.allocate_forward(cell, gi, proj_size)
    result = ForwardResult(y, cs, saved, None if w_hr is None else buffers.array_module(
        gi).empty_like(cs))
    steps, batch, _ = gi.shape
    hidden = gi.shape[2] // cell.gates
    engine, reason = (None, None) if algo == "gemm" else _engine(
        cell, gi, hidden, batch, algo, backward=False, half=half, proj_size=proj_size)
    if engine is None:
        if half is not None:
            w_hh, w_hr = widen(w_hh), widen(w_hr)
        gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=0,
                           half=half, w_hr=w_hr, hs=result.hs)
        return result, RunStats(algo="gemm", fallback=reason)
    prepared = prepare_forward(cell, engine, gi, w_hh, b_hh, h0, c0, lengths, half, w_hr, result)
    return result, prepared.run()


def forward_arrays(result: ForwardResult, h0: Array, c0: Array | None,
                   lengths: Array | None = None) -> dict[str, Array | None]:
    """The arrays a forward call supplies anew by role (``PreparedPass.run``'s ``arrays``): its
    results, its initial states (contiguous float32: as the kernels read them) and its lengths
    where it has them (contiguous int32; ``None``: the shared full lengths, not a role)."""
    return {"y": result.y, "cs": result.cs, "saved": result.saved, "hs": result.hs, "h0": h0,
            "c0": c0, "lengths": lengths}


def prepare_forward(cell: CellSpec, engine: _Engine, gi: Array, w_hh: Array, b_hh: Array | None,
                    h0: Array, c0: Array | None, lengths: Array | None, half: str | None,
                    w_hr: Array | None, result: ForwardResult) -> "PreparedPass":
    """The persistent forward pass of ``forward``'s arguments with its launches' arguments built;
    ``result``'s arrays are the ones a call supplies anew (``forward_arrays``)."""
    steps, batch, _ = gi.shape
    hidden = gi.shape[2] // cell.gates
    proj_size = 0 if w_hr is None else w_hr.shape[0]
    y, cs, saved = result.y, result.cs, result.saved
    xp = buffers.array_module(gi)
    c = partial(xp.ascontiguousarray, dtype=np.float32)  # a no-op for the usual float32 input
    bias = _zeros(xp, (cell.gates * hidden,)) if b_hh is None else c(b_hh)
    p = engine.pass_plan
    rows = (p.exchange_row,) if w_hr is None else (p.exchange_row, p.exchange_row_b)
    chain = launch.chain_for(xp, engine, 1, tuple((2, batch, r) for r in rows))
    args = dict(w_hh=buffers.weight_words(xp, w_hh, half), b_hh=bias, gi=c(gi), h0=c(h0),
                lengths=buffers.full_lengths(xp, lengths, batch, steps), y=y, saved=saved,
                steps=steps, batch=batch, hidden=hidden)
    if w_hr is None:  # persistent_forward.cu
        args.update(c0=c(h0) if c0 is None else c(c0), cs=y if cs is None else cs,
                    exchange=chain.exchanges[0])
    else:  # persistent_projection_forward.cu: exchanges of r_t (tile A's rows), h_t (tile B's)
        args.update(w_hr=buffers.weight_words(xp, w_hr, half), hs=result.hs, cs=cs, proj=proj_size,
                    c0=_zeros(xp, (batch, hidden)) if c0 is None else c(c0),
                    exchange_r=chain.exchanges[0], exchange_h=chain.exchanges[1])
    # The completion kernel (device_loop.cu); arguments it does not read are given ``bias``.
    complete = {k: args[k] for k in ("w_hh", "b_hh", "gi", "h0", "c0", "lengths", "y", "cs",
                                     "saved", "steps", "batch", "hidden")}
    complete.update(w_hr=args.get("w_hr", bias), hs=args.get("hs", y), w_ih=bias, b_ih=bias,
                    chained=0, proj=proj_size)
    return PreparedPass(chain, args, 0, steps, "prnn_complete_forward", complete,
                        forward_arrays(result, args["h0"], args["c0"],
                                       None if lengths is None else args["lengths"]))


def backward(cell: CellSpec, dy: Array, dhn: Array | None, dcn: Array | None, w_hh: Array,
             h0: Array, c0: Array | None, lengths: Array | None, fwd: ForwardResult, algo: str,
             half: str | None = None, w_hr: Array | None = None, slot: int | None = None,
             out: tuple[Array, Array | None] | None = None) -> tuple[BackwardResult, RunStats]:
    """Backward through time over all steps, enqueued like ``forward``; ``dy`` must be zero past
    each length. ``half``, ``w_hr``: as for ``forward`` (the backward itself computes in
    fp32); with ``w_hr``, ``dy``/``dhn``/``dh0`` are gradients of r (P wide). ``slot``: where
    given, the persistent pass's ``dgi``/``dgh`` and scratch are reused workspaces of that
    number (``buffers.workspace``; the caller reads ``dgi``/``dgh`` before the next backward
    of the same slot on this thread and stream); ``None``: new arrays. ``out``: ``(dh0, dc0)``
    arrays (``dc0`` ``None`` but for the LSTM) the result's ``dh0``/``dc0`` are written into
    (rows of the caller's stacked gradients: no array of their own), else new ones."""
    hidden = w_hh.shape[0] // cell.gates
    steps, batch, _ = dy.shape
    proj_size = 0 if w_hr is None else w_hr.shape[0]
    engine, reason = (None, None) if algo == "gemm" else _engine(
        cell, dy, hidden, batch, algo, backward=True, half=half, proj_size=proj_size)
    dgi, dgh = _gradient_buffers(cell, dy, hidden, None if engine is None else slot)
    if engine is None:
        if half is not None:
            w_hh, w_hr = widen(w_hh), widen(w_hr)
        drs = None if w_hr is None else buffers.array_module(dy).empty_like(dy)
        dh0, dc0 = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, fwd.y, fwd.cs, fwd.saved,
                                       dgi, dgh, dh_carry=dhn, dc_carry=dcn, stop=steps,
                                       w_hr=w_hr, hs=fwd.hs, drs=drs)
        if out is not None:
            dh0, dc0 = _copied_into(out, dh0, dc0)
        return BackwardResult(dgi, dgh, dh0, dc0, drs), RunStats(algo="gemm", fallback=reason)
    xp = buffers.array_module(dy)
    dy = xp.ascontiguousarray(dy, dtype=np.float32)  # a no-op for the usual float32 input
    prepared = prepare_backward(cell, engine, dy, w_hh, h0, c0, lengths, fwd, half, w_hr, slot,
                                dgi, dgh)
    return backward_call(prepared, w_hh, dhn, dcn, out)


def backward_arrays(dy: Array, fwd: ForwardResult, h0: Array, c0: Array | None,
                    lengths: Array | None = None) -> dict[str, Array | None]:
    """The arrays a backward call supplies anew by role (``PreparedPass.run``'s ``arrays``):
    the output gradient, the forward's results and initial states (contiguous float32) and
    lengths (as ``forward_arrays``)."""
    return {"dy": dy, "y": fwd.y, "cs": fwd.cs, "saved": fwd.saved, "hs": fwd.hs, "h0": h0,
            "c0": c0, "lengths": lengths}


def prepare_backward(cell: CellSpec, engine: _Engine, dy: Array, w_hh: Array, h0: Array,
                     c0: Array | None, lengths: Array | None, fwd: ForwardResult,
                     half: str | None, w_hr: Array | None, slot: int | None, dgi: Array,
                     dgh: Array) -> "PreparedPass":
    """The persistent backward pass of ``backward``'s arguments (``dy`` contiguous float32)
    with its launches' arguments and scratch (carries, ``W_hh^T``) in place; what a call does
    before and after the chain is ``backward_call``'s."""
    hidden = w_hh.shape[0] // cell.gates
    steps, batch, _ = dy.shape
    proj_size = 0 if w_hr is None else w_hr.shape[0]
    xp = buffers.array_module(dy)
    c = partial(xp.ascontiguousarray, dtype=np.float32)  # a no-op for the usual float32 input
    # Direct carries by step parity; the kernel's step T-1 reads parity T % 2 (dh_n, dc_n). With
    # a projection the h carry is of r (P wide): what passes through the steps past a length.
    dh_carry = _scratch(xp, slot, "dh_carry", (2, batch, dy.shape[2]), dy.dtype)
    dc_carry = dh_carry
    if cell.has_cell_state:
        dc_carry = _scratch(xp, slot, "dc_carry", (2, batch, hidden), dy.dtype)
    drs = None if w_hr is None else _scratch(xp, slot, "drs", dy.shape, dy.dtype)
    p = engine.pass_plan
    rows = (p.exchange_row,) if w_hr is None else (p.exchange_row_b, p.exchange_row)
    chain = launch.chain_for(xp, engine, 1, tuple((2, batch, r) for r in rows))
    args = dict(dy=dy, saved=fwd.saved, lengths=buffers.full_lengths(xp, lengths, batch, steps),
                dgh=dgh, dc_carry=dc_carry, steps=steps, batch=batch, hidden=hidden)
    if w_hr is None:  # persistent_backward.cu
        args.update(w_t=_transposed(xp, w_hh, half, p, _name(slot, "w_t")), y=fwd.y,
                    cs=fwd.y if fwd.cs is None else fwd.cs, h0=c(h0),
                    c0=c(h0) if c0 is None else c(c0), dgi=dgi, dh_carry=dh_carry,
                    exchange=chain.exchanges[0])
        complete, kernel = dict(args, w_ih_t=args["dy"], chained=0, per_step=0), "prnn_complete_backward"
    else:  # persistent_projection_backward.cu: exchanges of dr_t (tile B's rows), dgates_t (A's)
        args.update(w_hh_t=_transposed(xp, w_hh, half, p, _name(slot, "w_t")),
                    w_hr_t=_transposed(xp, w_hr, half, p, _name(slot, "w_hr_t")),
                    cs=fwd.cs, drs=drs,
                    c0=_zeros(xp, (batch, hidden)) if c0 is None else c(c0),
                    dr_carry=dh_carry, proj=proj_size,
                    exchange_r=chain.exchanges[0], exchange_g=chain.exchanges[1])
        complete, kernel = dict(args), "prnn_complete_projection_backward"
    for name in ("exchange", "exchange_r", "exchange_g"):
        complete.pop(name, None)
    prepared = PreparedPass(chain, args, steps - 1, -1, kernel, complete,
                            backward_arrays(dy, fwd, args.get("h0"), args["c0"],
                                            None if lengths is None else args["lengths"]))
    prepared.backward = _BackwardScratch(cell, xp, dgi, dgh, dh_carry, dc_carry, drs, half, slot,
                                         w_hr)
    return prepared


@dataclass
class _BackwardScratch:
    """What ``backward_call`` writes around a prepared backward's chain."""

    cell: CellSpec
    xp: Any
    dgi: Array
    dgh: Array
    dh_carry: Array
    dc_carry: Array
    drs: Array | None
    half: str | None
    slot: int | None
    w_hr: Array | None


def backward_call(prepared: "PreparedPass", w_hh: Array, dhn: Array | None, dcn: Array | None,
                  out: tuple[Array, Array | None] | None) -> tuple[BackwardResult, RunStats]:
    """One backward call of ``prepared`` (``prepare_backward``): the carries zeroed and given
    ``dhn``/``dcn``, the chain, then ``dh0``/``dc0`` (into ``out`` where given). (A call plan's
    later calls enqueue all of it inside the chain: ``call_plans``.)"""
    s = prepared.backward
    xp, cell = s.xp, s.cell
    zero_carries(s)
    steps = prepared.first + 1
    if dhn is not None:
        s.dh_carry[steps % 2] = dhn
    if dcn is not None and cell.has_cell_state:
        s.dc_carry[steps % 2] = dcn
    stats = prepared.run()
    # A 16-bit layer's pass on the fp32 tile (plan.widened_pass) holds this call's W_hh^T widened
    # already: its transpose, not a second widening.
    held = prepared.args.get("w_t", prepared.args.get("w_hh_t"))
    wide = (w_hh if s.half is None else held.T if held.dtype == np.float32
            else widen(w_hh) if s.slot is None else buffers.widened(xp, w_hh, f"w_hh_wide{s.slot}"))
    dh0 = initial_state_gradient(s, wide, None if out is None else out[0])
    dc0 = s.dc_carry[0] if cell.has_cell_state else None
    if dc0 is not None and out is not None:
        dc0 = _copied_into(out, dh0, dc0)[1]
    elif dc0 is not None and s.slot is not None:  # (a row of a workspace: the result's own copy)
        dc0 = dc0.copy()
    return BackwardResult(s.dgi, s.dgh, dh0, dc0, s.drs), stats


def initial_state_gradient(s: _BackwardScratch, w_hh: Array, out: Array | None = None) -> Array:
    """``dh0`` of a backward whose chain has run: the direct carry plus ``dgh_0 W_hh`` (of r
    with a projection; ``w_hh`` float32), stream-ordered, nothing read back; into ``out``
    where given."""
    dh0 = matmul(s.dgh[0], w_hh, out)
    dh0 += s.dh_carry[0]  # (in place: the same sum, one array)
    return dh0


def zero_carries(s: _BackwardScratch) -> None:
    """A backward's direct carries zeroed before its chain (one fill; the LSTM's two)."""
    s.dh_carry.fill(0)
    if s.cell.has_cell_state:
        s.dc_carry.fill(0)


def _copied_into(out: tuple[Array, Array | None], dh0: Array,
                 dc0: Array | None) -> tuple[Array, Array | None]:
    """``dh0`` and ``dc0`` (``None`` but for the LSTM) copied into ``out`` (a no-op for an
    array already there); returns ``out``'s arrays."""
    if out[0] is not dh0:
        out[0][...] = dh0
    if dc0 is None:
        return out[0], None
    out[1][...] = dc0
    return out


def _gradient_buffers(cell: CellSpec, dy: Array, hidden: int,
                      slot: int | None) -> tuple[Array, Array]:
    """``(dgi, dgh)`` of a backward: new (``buffers.allocate_backward``), or for ``slot`` the
    workspaces of that slot."""
    if slot is None:
        return buffers.allocate_backward(cell, dy, hidden)
    xp = buffers.array_module(dy)
    shape = (*dy.shape[:2], cell.gates * hidden)
    dgi = buffers.workspace(xp, f"dgi{slot}", shape, dy.dtype)
    return dgi, (buffers.workspace(xp, f"dgh{slot}", shape, dy.dtype) if cell.separate_dgh
                 else dgi)


def _name(slot: int | None, name: str) -> str | None:
    """The workspace name of ``name`` for ``slot``, ``None`` without a slot (new arrays)."""
    return None if slot is None else f"{name}{slot}"


def _scratch(xp, slot: int | None, name: str, shape: tuple[int, ...], dtype) -> Array:
    """An uninitialised array a pass uses and lets go: the workspace ``name`` of ``slot``, or
    a new one without a slot."""
    if slot is None:
        return xp.empty(shape, dtype)
    return buffers.workspace(xp, f"{name}{slot}", shape, dtype)


def _transposed(xp, m: Array, half: str | None, p: planner.PassPlan,
                scratch: str | None) -> Array:
    """``m^T`` (``W_hh^T``, a projection's ``W_hr^T``) as the backward pass ``p`` holds it,
    copied every call (an optimizer may change ``m`` in place) into the workspace ``scratch``
    (``None``: a new array): ``buffers.weight_words``, or for a 16-bit layer's pass on the fp32
    tile (``plan.widened_pass``) its values widened (``buffers.widened_words``)."""
    if half is not None and not p.defines.get("PRNN_WEIGHT_DTYPE"):
        return buffers.widened_words(xp, m.T, half, scratch)
    return buffers.weight_words(xp, m.T, half, scratch)


def _zeros(xp, shape: tuple[int, ...]) -> Array:
    """float32 zeros that a kernel reads and never writes (a shared constant, ``buffers``)."""
    return buffers.constant_zeros(xp, shape, np.float32)


@dataclass(frozen=True)
class Around:
    """Stream operations of a call plan's calls (``call_plans``) that a prepared pass enqueues
    inside its chain: ``before(arrays, fixed)`` just before the pass's first launch (after the
    chain's memset), ``after(arrays, fixed)`` just after its completion kernel - so that a
    replayed chain graph holds them and a call in steady state issues them in its one graph
    launch (docs/design.md, "What a call executes"). They read and write only the pass's own
    arguments, ``fixed`` (arrays at an address fixed for the plan: workspaces, weights,
    constants; the plan holds them) and the call's arrays of the pass's roles and of ``roles``;
    every one of those enters the chain graph's key, with the two functions' names
    (``PreparedPass.arguments_key``). Nothing in them may
    allocate or look up scratch (``buffers.reused`` makes new arrays while a stream captures).
    ``addressed``: the roles (the pass's or ``roles``) whose every call's array is a contiguous
    array of the first call's shape and dtype, never ``None`` (the plan makes them, or checks
    them before it runs): their layout is keyed once, per call only their address."""

    before: Callable[[dict, dict], None]
    after: Callable[[dict, dict], None]
    fixed: dict[str, Any]
    roles: tuple[str, ...]
    addressed: frozenset[str] = frozenset()


class PreparedPass:
    """A persistent pass's chain (``launch.chain_for``) with its launches' arguments built
    (``prepare_forward``, ``prepare_backward``): ``run`` enqueues it (``launch.run_chain``: the
    pass, its restarts and its completion kernel, decided on the device) and returns its stats
    (read lazily from the chain's record). The arrays a call supplies anew are given to ``run``
    by role (``forward_arrays``, ``backward_arrays``): the arguments that held the first call's
    arrays of a role take this call's, so one prepared pass serves the calls of one signature
    (``call_plans``), which may give it an ``around`` (``Around``: operations of its calls
    enqueued inside the chain; set before its first ``run``)."""

    def __init__(self, chain: launch.Chain, args: dict, first: int, end: int, complete: str,
                 complete_args: dict, arrays: dict[str, Array | None]):
        self.chain, self.args, self.first, self.end = chain, args, first, end
        self.complete, self.complete_args = complete, complete_args
        self.backward: _BackwardScratch | None = None
        self.around: Around | None = None
        self._arrays = arrays  # the first call's, which ``args`` hold
        self._roles: tuple | None = None  # (argument, role) pairs (``_role_lists``)
        self._static_key: tuple | None = None  # the chain graph's key but the per-call arrays
        self._detail = chain.engine.detail()

    def run(self, arrays: dict[str, Array | None] | None = None,
            captured: bool | None = None) -> RunStats:
        """Enqueue the pass with this call's ``arrays`` (by role; ``None``: the first call's,
        which the arguments hold); its stats. The launches' arguments are substituted only
        where the chain is issued launch by launch (a replayed chain graph needs its key only).
        ``captured``: ``launch.run_chain``'s. The pass is its own issuer
        (``launch.PassIssuer``), ``arrays`` the call's data."""
        return launch.run_chain(self.chain, self, self._arrays if arrays is None else arrays,
                                self.first, self.end, settings.current_stall(), self._detail,
                                captured)

    def issue_launch(self, arrays: dict[str, Array | None], start: Any,
                     stall: settings.Stall) -> None:
        """A launch of the pass (``launch.PassIssuer``), the first one after ``around.before``."""
        around = self.around
        if start is not launch.RESUME and around is not None:  # (the pass's first launch)
            around.before(arrays, around.fixed)
        launch.launch_pass(self.chain.engine, self.chain.control,
                           dict(self._arguments(0, arrays), start=start), stall)

    def issue_completion(self, arrays: dict[str, Array | None]) -> None:
        """The pass's completion kernel (``launch.PassIssuer``), then ``around.after``."""
        self.chain.complete(self.complete, **self._arguments(1, arrays))
        around = self.around
        if around is not None:
            around.after(arrays, around.fixed)

    def _arguments(self, which: int, arrays: dict[str, Array | None]) -> dict:
        """The pass's (``which`` 0) or the completion's (1) arguments with ``arrays``."""
        given = (self.args, self.complete_args)[which]
        if arrays is self._arrays:
            return given
        given = dict(given)
        for name, role in self._role_lists()[which]:
            given[name] = arrays[role]
        return given

    def _role_lists(self) -> tuple:
        """The (argument, role) pairs of ``args`` and of ``complete_args`` that hold one of the
        first call's arrays (found by identity, once)."""
        if self._roles is None:
            self._roles = (tuple(_roles(self.args, self._arrays)),
                           tuple(_roles(self.complete_args, self._arrays)))
        return self._roles

    def forget_key(self) -> None:
        """Build the key's static part again at the next call (``around.fixed`` changed)."""
        self._static_key = None

    def arguments_key(self, arrays: dict[str, Array | None]) -> tuple:
        """What a chain graph of this pass is keyed by (``launch.PassIssuer``): the arguments
        but the per-call arrays, keyed once (the prepared pass holds them), and those arrays -
        of the ``around``'s ``addressed`` roles their address (their layout keyed once, from
        the first call's), of the others their ``chain_graphs.value``; with an ``around``, its
        functions' names, its fixed arrays and its roles too. Arrays a call plan holds
        (``holding``) are keyed once too: per call only the others' addresses."""
        static = self._static_key
        if static is None:
            static = self._static_key = chain_graphs.Fixed(self._fixed_key(arrays))
        values = tuple(map(chain_graphs.value, map(arrays.__getitem__, static[2])))
        held = arrays.get(HELD)
        if held is None:
            return (static.token, chain_graphs.addresses(arrays, static[1]), values)
        part = held.key
        if part is None or part[0] is not static:  # (keyed once a static part)
            part = held.key = (static, chain_graphs.Fixed(tuple(
                [chain_graphs.value(arrays[r]) for r in held.roles])).token,
                tuple(r for r in static[1] if r not in held.roles))
        return (static.token, part[1], chain_graphs.addresses(arrays, part[2]), values)

    def _fixed_key(self, arrays: dict[str, Array | None]) -> tuple:
        """``arguments_key``'s part built once: the completion kernel, the addressed roles and the
        others (each sorted), the arguments but the per-call arrays, the layout of the
        addressed roles' arrays (``arrays``: the first keyed call's) and the ``around``'s
        part."""
        roles, complete_roles = self._role_lists()
        per_call = {name for name, _ in roles + complete_roles}
        used = {role for _, role in roles + complete_roles}
        around, around_key, addressed = self.around, None, frozenset()
        if around is not None:
            used.update(around.roles)
            addressed = around.addressed & used
            around_key = (around.before.__qualname__, around.after.__qualname__,
                          chain_graphs.arguments_key(around.fixed))
        addressed_roles = tuple(sorted(addressed))
        return (self.complete, addressed_roles, tuple(sorted(used - addressed)),
                chain_graphs.arguments_key(
                    {k: v for k, v in self.args.items() if k not in per_call}),
                chain_graphs.arguments_key(
                    {k: v for k, v in self.complete_args.items() if k not in per_call}),
                tuple([chain_graphs.value(arrays[role])[1:] for role in addressed_roles]),
                around_key)


HELD = "held arrays"  # the ``Held`` of a call's arrays copied from a plan's (``holding``)


class Held:
    """The roles of arrays a call plan holds for every call of a kind (its held results and
    initial states: ``call_plans.Plan.held_arrays``), which the calls' arrays by role, copied
    from ``holding``'s, keep: the prepared pass keys their values once (``key``, per static
    part: ``PreparedPass.arguments_key``), per call only the other roles' addresses. A copy
    may add roles, never replace these."""

    __slots__ = ("roles", "key")

    def __init__(self, roles: tuple[str, ...]):
        self.roles, self.key = roles, None


def holding(arrays: dict[str, Array | None]) -> dict[str, Array | None]:
    """``arrays`` (by role, held by a call plan) with their ``Held`` under ``HELD``: a new one
    every time, so arrays held anew are keyed anew."""
    return {**arrays, HELD: Held(tuple(r for r, a in arrays.items() if a is not None))}


def _roles(args: dict, arrays: dict[str, Array | None]):
    """(argument, role) of each of ``args`` that is one of ``arrays`` (the first role whose
    array it is)."""
    for name, value in args.items():
        for role, a in arrays.items():
            if a is not None and value is a:
                yield name, role
                break


def run_forward(cell: CellSpec, gi: Array, w_hh: Array, b_hh: Array | None, h0: Array,
                c0: Array | None, lengths: Array | None, algo: str, stats: RunStats,
                half: str | None = None) -> ForwardResult:
    """``forward`` of one layer-direction; what ran is merged into ``stats``."""
    result, run = forward(cell, gi, w_hh, b_hh, h0, c0, lengths, algo, half=half)
    stats.merge(run)
    return result


def run_backward(cell: CellSpec, dy: Array, dhn: Array | None, dcn: Array | None, w_hh: Array,
                 h0: Array, c0: Array | None, lengths: Array | None, fwd: ForwardResult,
                 algo: str, stats: RunStats, half: str | None = None) -> BackwardResult:
    """``backward`` of one layer-direction; merged into ``stats``."""
    result, run = backward(cell, dy, dhn, dcn, w_hh, h0, c0, lengths, fwd, algo, half=half)
    stats.merge(run)
    return result


def _engine(cell: CellSpec, data: Array, hidden: int, batch: int, algo: str,
            backward: bool, half: str | None = None,
            proj_size: int = 0) -> tuple[_Engine | None, str | None]:
    """The persistent engine for this pass, or ``(None, why the GEMM path runs)``.

    Raises ValueError when ``algo="persistent"`` cannot be honoured.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if algo == "gemm":
        return None, None
    if batch == 0:  # nothing to run under any algo; last_run says so rather than naming no reason
        return None, "empty batch: nothing to compute (the GEMM path returns the empty results)"
    on_gpu = buffers.array_module(data) is not np
    if algo == "auto" and not on_gpu:
        return None, None
    why = why_not_persistent(data, batch, algo)
    if why is None:
        device = planning_device(on_gpu)
        engine, why = _cached_engine(cell, hidden, batch, backward, device,
                                     on_gpu and settings.current().cooperative, not on_gpu,
                                     half or "float32", proj_size)
        if engine is not None:
            # A grid found not co-resident is a run-time condition, like a timeout: the GEMM
            # path runs (also under algo="persistent"), and last_run.fallback says why.
            cooling = COOLDOWNS.reason(engine.key)
            return (engine, None) if cooling is None else (None, cooling)
    if algo == "persistent":
        raise ValueError(f"algo='persistent' cannot run this layer: {why}")
    return None, why


def why_not_persistent(data: Array, batch: int, algo: str) -> str | None:
    """Why the persistent kernel should not run, before any plan (or ``None``). ``data``: the
    layer's float32 data, or a 16-bit layer's 16-bit input (its arrays as the layer holds them)."""
    if np.dtype(data.dtype) != np.float32 and np.dtype(data.dtype).name not in HALF_DTYPES:
        return (f"dtype is {np.dtype(data.dtype).name}: the persistent kernels compute in "
                f"float32 (weights in float32 or 16 bits); algo='gemm' runs it")
    if data.shape[0] > _MAX_STEPS:
        return f"sequence length {data.shape[0]} > {_MAX_STEPS}: the kernels' step index is 32-bit"
    limit = settings.current().auto_max_batch
    if algo == "auto" and batch > limit:
        return f"batch {batch} > {limit} (auto_max_batch): not measured beyond it"
    return None


@lru_cache(maxsize=256)
def _cached_engine(cell: CellSpec, hidden: int, batch: int, backward: bool,
                   device: hardware.DeviceProfile, cooperative: bool, emulated: bool,
                   weights: str, proj_size: int = 0) -> tuple[_Engine | None, str | None]:
    """The engine of one pass configuration on ``device`` with W_hh (and an LSTM projection's
    W_hr, ``proj_size`` > 0) held in ``weights`` (a dtype name), or why there is none (cached:
    the plan is pure, the module and the occupancy check depend only on the key)."""
    plan = planner.make_plan(cell, hidden, batch, weights, device, proj_size)
    if not plan.fits:
        return None, plan.reason
    pass_plan = plan.backward if backward else plan.forward
    engine, why = engine_of(pass_plan, device, cooperative, emulated)
    if engine is None and is_cluster(pass_plan) and pass_plan.grid > hardware.PORTABLE_CLUSTER_CTAS:
        # Not every Hopper part (nor a MIG slice, nor an SM partition) holds a 16-CTA cluster:
        # plan again with the portable size before the GEMM path.
        portable = replace(device, max_cluster_ctas=hardware.PORTABLE_CLUSTER_CTAS)
        return _cached_engine(cell, hidden, batch, backward, portable, cooperative, emulated,
                              weights, proj_size)
    return engine, why


def engine_of(pass_plan: planner.PassPlan, device: hardware.DeviceProfile, cooperative: bool,
              emulated: bool) -> tuple[_Engine | None, str | None]:
    """The engine of a planned pass: its module built (NVRTC, or g++ for the emulation) and, on
    the GPU, the grid checked against CUDA's occupancy calculator; or why it cannot run."""
    # (the shared bytes too: a launch's shape, which a chain graph replays and residency checks;
    # hashed once: the cooldowns look it up every call)
    key = chain_graphs.Fixed((device.name, emulated, pass_plan.kernel,
                              tuple(sorted(pass_plan.defines.items())), pass_plan.grid,
                              pass_plan.block, pass_plan.shared_bytes))
    if emulated:
        from . import emulate
        module = emulate.get_module(pass_plan.source, pass_plan.defines)
        return _Engine(pass_plan, module.launch, True, key, _loop_launcher(pass_plan, True)), None
    from . import kernels
    # A cluster kernel is never launched cooperatively: CUDA refuses cooperative launches of
    # kernels with a cluster shape (CUDA_ERROR_INVALID_CLUSTER_SIZE), and a cluster is
    # co-scheduled whole anyway.
    cluster = is_cluster(pass_plan)
    module = kernels.get_module(pass_plan.source, pass_plan.defines, cooperative and not cluster)
    shape = (pass_plan.kernel, pass_plan.block, pass_plan.shared_bytes)
    why = residency_problem(pass_plan, device.sm_count,
                            lambda: module.max_active_blocks(*shape),
                            lambda: module.max_active_clusters(pass_plan.kernel, pass_plan.grid,
                                                               pass_plan.block,
                                                               pass_plan.shared_bytes))
    if why is not None:
        return None, why
    return _Engine(pass_plan, module.launch, False, key, _loop_launcher(pass_plan, False)), None


def _loop_launcher(pass_plan: planner.PassPlan, emulated: bool) -> Callable[..., None]:
    """The launcher of a pass's completion kernels (built on first use)."""
    defines = loop_defines(pass_plan)

    def launch_(*args, **kw) -> None:
        if emulated:
            from . import emulate as builder
        else:
            from . import kernels as builder  # type: ignore[no-redef]
        builder.get_module(launch.LOOP_SOURCE, defines).launch(*args, **kw)
    return launch_


def loop_defines(pass_plan: planner.PassPlan) -> dict[str, int]:
    """The ``-D`` of a pass's completion kernels: its cell and the dtype its weights
    are given in (a ``plan.widened_pass``'s: the layer's 16-bit words, which the completion
    reads and whose type it rounds the state to)."""
    defines = {k: v for k, v in pass_plan.defines.items()
               if k in ("PRNN_CELL", "PRNN_WEIGHT_DTYPE")}
    if pass_plan.defines.get("PRNN_WIDENED_FROM"):
        defines["PRNN_WEIGHT_DTYPE"] = pass_plan.defines["PRNN_WIDENED_FROM"]
    return defines


def is_cluster(pass_plan: planner.PassPlan) -> bool:
    """Whether the pass runs as one thread-block cluster (its kernel built with a cluster shape)."""
    return "PRNN_CLUSTER" in pass_plan.defines


def residency_problem(pass_plan: planner.PassPlan, sm_count: int,
                      blocks_per_sm: Callable[[], int],
                      active_clusters: Callable[[], int]) -> str | None:
    """Why the pass's CTAs cannot all be resident at once on an idle device (``None``: they can).

    A cluster kernel needs one cluster of its grid to fit: ``active_clusters()`` is CUDA's
    cluster occupancy query (``cuOccupancyMaxActiveClusters``), which accounts for the GPCs a
    cluster must fit in; per-SM block occupancy cannot tell. A grid kernel needs
    ``grid <= sm_count * blocks_per_sm()`` (``cuOccupancyMaxActiveBlocksPerMultiprocessor``).
    The queries are callables so that only the one that applies runs (and tests can fake them).
    """
    if is_cluster(pass_plan):
        clusters = active_clusters()
        if clusters < 1:
            return (f"a cluster of {pass_plan.grid} CTAs x {pass_plan.block} threads of "
                    f"{pass_plan.kernel} does not fit the device (cluster occupancy {clusters})")
        return None
    per_sm = blocks_per_sm()
    if pass_plan.grid > sm_count * per_sm:
        return (f"grid {pass_plan.grid} > {sm_count} SMs x {per_sm} resident CTAs "
                f"of {pass_plan.kernel}")
    return None


@lru_cache(maxsize=None)
def _device_profile(device_id: int) -> hardware.DeviceProfile:
    return hardware.current_device()


def planning_device(on_gpu: bool) -> hardware.DeviceProfile:
    """The device profile a layer is planned for: the current GPU's, or the emulation's
    (``EMULATED_DEVICE``), with clusters no larger than ``settings.max_cluster_ctas`` and TF32
    tiles where ``settings.allow_tf32``."""
    device = _current_device() if on_gpu else EMULATED_DEVICE
    s = settings.current()
    if s.allow_tf32:
        device = replace(device, allow_tf32=True)
    if s.max_cluster_ctas is None or s.max_cluster_ctas >= device.max_cluster_ctas:
        return device
    return replace(device, max_cluster_ctas=s.max_cluster_ctas)


def _current_device() -> hardware.DeviceProfile:
    import cupy
    return _device_profile(cupy.cuda.Device().id)
