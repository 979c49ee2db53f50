"""The recurrence as ``torch.library`` custom ops: ``persistent_rnn::recurrence`` and its backward.

Both ops are opaque to the compiler and run the library (``persistent_rnn.functional``) on the
tensors' memory (``interop``: no copies). They have fake implementations (shapes only), an autograd
formula (registered on the op with ``register_autograd`` and, for torch.func, the same formula
in the ``autograd.Function`` the modules call) and a vmap rule, so that ``torch.compile`` (also
with ``fullgraph=True``), ``torch.export`` and ``torch.func`` (``grad``, ``vmap``,
``functional_call``) see an ordinary differentiable operator. Double backward differentiates
torch's own implementation of the layer (``differentiable_grads``).

All tensors are time-major: ``x`` (T, B, I), ``lengths`` ``None`` or CPU int64 (B,)
(packed-sequence semantics), ``h0``/``c0`` ``None`` (zeros) or (L*D, B, H) (``h0`` (L*D, B, P)
for an LSTM with projection), ``weights`` in torch.nn's ``_flat_weights_names`` order (with a
projection ``weight_hr`` last in each layer-direction), all of ``x``'s dtype. float16 and
bfloat16 tensors run the library's 16-bit layers on their memory as 16-bit arrays (no copy): the
input projection multiplies the 16-bit x and W_ih (on a GPU on the tensor cores, fp32
accumulation), the rest computes in fp32 on their values, h_t rounded to the dtype every step,
W_hh held in it by the persistent kernels; the results come back in the dtype, the activations
kept for backward stay fp32. The forward returns ``(y, h_n, c_n, saved)`` where
``c_n`` is empty unless the cell is an LSTM and ``saved`` are the activations backward needs
(``functional.saved_arrays``): the op is functional, with nothing kept on the side.

Run statistics: each op call records what ran in the ``RunRecord`` registered under its
``stats_slot`` (one per module), from inside the op's real implementation, so that the record
is written at run time in eager mode and under ``torch.compile`` alike without being a traced
value; ``stats_part`` numbers the calls of one module forward (0 starts a new record, later
parts merge into it; the backward of part ``stats_parts - 1`` starts the backward record).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .. import call_plans, functional, plans, settings
from ..cells import CELLS, CellSpec, from_mode
from ..halves import half_dtype
from ..stats import RunStats
from ..validation import ALGOS
from .packing import PackedLayout
from .interop import (Array, lengths_array, library_stream, on_library_stream, to_array,
                      to_tensor)

MODES = tuple(spec.mode for spec in CELLS.values() if spec.in_torch)  # torch.nn's mode strings


@dataclass
class LastRun(RunStats):
    """``module.last_run``: what the last forward ran, and what its backward ran.

    ``algo`` is ``"persistent"``, ``"gemm"`` (the library's paths) or ``"torch"`` (torch's own
    kernels for the layer: cuDNN on the GPU, torch's CPU kernels); ``fallback`` says why the
    persistent kernel did not run (``None`` where it was not asked for: ``algo="gemm"``).
    ``backward`` is the ``RunStats`` of the library's backward, ``None`` until it ran (and on
    the ``"torch"`` path, whose backward is torch's autograd).
    """

    backward: RunStats | None = None
    dtype: str | None = None  # what the library computed for ("float32", "bfloat16", ...)

    @classmethod
    def of(cls, stats: RunStats, dtype: str | None = None) -> "LastRun":
        """A record holding a copy of ``stats`` (its device records still unread: reading them
        would wait for the GPU, which a call never does) and ``dtype``. (Copied field by field,
        not built by ``__init__`` and ``merge``: once per forward.)"""
        record = cls.__new__(cls)
        state = record.__dict__
        state.update(stats.__dict__)
        state["details"], state["_deferred"] = list(stats.details), list(stats._deferred)
        if "_held" in state:
            state["_held"] = dict(state["_held"])
        state["backward"], state["dtype"] = None, dtype
        return record


class RunRecord:
    """The mutable holder of one module's ``last_run`` (never pickled: see modules), its
    registry ``slot`` and its remembered weight views (``views``). A forward's stats are kept as
    they come and made a ``LastRun`` when ``last`` is first read (a copy per call otherwise)."""

    __slots__ = ("_last", "_pending", "slot", "views", "plan", "signature", "__weakref__")

    def __init__(self) -> None:
        self._last: LastRun | None = None
        self._pending: tuple | None = None  # (stats, dtype, backward stats or None)
        self.slot = next(_SLOTS)
        self.views = WeightViews()
        self.plan: call_plans.CallSignature | None = None  # the steady-state call's plan
        self.signature: tuple = ()  # of the last library forward that ran the whole way
        _RECORDS[self.slot] = self

    @property
    def last(self) -> LastRun | None:
        """The last run (see ``LastRun``), ``None`` before the first forward."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._last = LastRun.of(pending[0], pending[1])
            self._last.backward = pending[2]
        return self._last

    @last.setter
    def last(self, value: LastRun | None) -> None:
        self._last, self._pending = value, None

    def forward(self, part: int, stats: RunStats, dtype: str) -> None:
        """Record part ``part`` of a forward (0 starts a new record, later parts merge in)."""
        if part == 0:
            self._last, self._pending = None, (stats, dtype, None)
            return
        last = self.last
        if last is None:
            self._pending = (stats, dtype, None)
        else:
            last.merge(stats)

    def backward(self, first: bool, stats: RunStats) -> None:
        """Record a backward's stats (``first``: it starts the backward record)."""
        pending = self._pending
        if pending is not None and (first or pending[2] is None):
            self._pending = (pending[0], pending[1], stats)
            return
        last = self.last
        if last is None:
            return
        if first or last.backward is None:
            last.backward = stats
        else:
            last.backward.merge(stats)


class Recorded:
    """What every module of the library keeps beside torch.nn's: ``algo`` and a ``RunRecord``
    behind ``last_run``. The record is process-local (a registry slot): it is not saved, so
    that torch.load(weights_only=True) needs no extra class and a loaded module gets its own."""

    def _start_recording(self, algo: str) -> None:
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        self.algo = algo
        self._record = RunRecord()

    @property
    def last_run(self) -> "LastRun | None":
        """What the last forward (and its backward) ran; see ``persistent_rnn.torch.LastRun``."""
        return self._record.last

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_record", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._record = RunRecord()


_SLOTS = itertools.count()
_RECORDS: "weakref.WeakValueDictionary[int, RunRecord]" = weakref.WeakValueDictionary()


def _record_forward(slot: int, part: int, stats: RunStats, dtype: str) -> None:
    record = _RECORDS.get(slot)
    if record is not None:
        record.forward(part, stats, dtype)


def _record_backward(slot: int, first: bool, stats: RunStats) -> None:
    record = _RECORDS.get(slot)
    if record is not None:
        record.backward(first, stats)


_BY_MODE = {mode: from_mode(mode) for mode in MODES}  # (a dict: torch.compile traces it)


def _cell(mode: str) -> CellSpec:
    spec = _BY_MODE.get(mode)
    return from_mode(mode) if spec is None else spec  # from_mode: its error for a bad mode


def _params(weights: list[Tensor], num_layers: int, bidirectional: bool,
            slot: int | None = None) -> dict:
    """The weights as the library's dict of arrays (``_array``: views of their memory), under
    torch.nn's names; ``slot``: the module's ``RunRecord`` slot, whose ``WeightViews`` remembers
    the dict for the next call on the same weights."""
    record = None if slot is None else _RECORDS.get(slot)
    if record is not None:
        return record.views.get(weights, num_layers, bidirectional)
    return _fresh_params(weights, num_layers, bidirectional)


def _fresh_params(weights: list[Tensor], num_layers: int, bidirectional: bool) -> dict:
    """``_params`` made afresh."""
    names = _param_names(len(weights), num_layers, bidirectional)
    return {name: w.numpy(force=True) if w.is_cpu and w.dtype not in _HALF and w.is_contiguous()
            else _array(w) for name, w in zip(names, weights)}  # (the usual case inlined)


class WeightViews:
    """One module's weights as the library's arrays (``_params``), remembered from the last call
    and reused while they cannot be stale. Only views are remembered (contiguous weights, on the
    CPU as NumPy arrays, on a GPU as CuPy arrays over the same memory, 16-bit ones as 16-bit
    arrays): a view shares its tensor's memory, so it
    holds the current values as long as it is a view of the same tensor at the same memory and
    shape (the library reads it on torch's current stream, after whatever torch enqueued there
    to update it). Checked per call:
    the same tensor objects (parameter reassignment, ``functional_call`` and autocast's casts
    give others), each at the same ``data_ptr`` and shape and still contiguous (``.to()``,
    ``param.data = ...``, also a strided view of the same memory) and
    version counter (bumped by every in-place update: ``optimizer.step``, ``load_state_dict``'s
    copies, ``w.mul_(2)``; ``set_``)."""

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        # (the stamps of the weights, the dict): one tuple, read and replaced whole, so that
        # calls from several threads never mix the parts of two entries
        self._entry: tuple[tuple, dict] = ((), {})

    def get(self, weights: list[Tensor], num_layers: int, bidirectional: bool) -> dict:
        """``_fresh_params(weights, ...)``, from memory where nothing changed since it was made."""
        stamps, params = self._entry
        if len(stamps) == len(weights):  # (a loop, not a comprehension: no frame per call)
            for w, (known, version, pointer, shape) in zip(weights, stamps):
                # (each comparison only where the one before it held: the usual case makes all
                # of them; contiguous again: ``param.data = `` a strided view of the same memory
                # keeps the pointer, shape and version)
                if w is not known or w._version != version or w.data_ptr() != pointer \
                        or w.shape != shape or not w.is_contiguous():
                    break
            else:
                return params
        params = _fresh_params(weights, num_layers, bidirectional)
        self._remember(weights, params)
        return params

    @property
    def params(self) -> dict:
        """The remembered dict (empty where none is)."""
        return self._entry[1]

    def _remember(self, weights: list[Tensor], params: dict) -> None:
        stamps = []
        for w in weights:
            if not w.is_contiguous():
                self._entry = ((), {})  # a contiguous copy, not a view: made afresh every call
                return
            try:
                stamps.append((w, w._version, w.data_ptr(), w.shape))
            except RuntimeError:  # an inference tensor has no version counter to compare
                self._entry = ((), {})
                return
        self._entry = (tuple(stamps), params)


@lru_cache(maxsize=256)
def _param_names(count: int, num_layers: int, bidirectional: bool) -> tuple[str, ...]:
    """torch.nn's names of ``count`` weights of a stack, in ``_flat_weights_names`` order."""
    bias, proj = _layout_of(count, num_layers, bidirectional)
    return tuple(name for layer in range(num_layers)
                 for reverse in (False, True)[:1 + bidirectional]
                 for name in functional.param_names(layer, reverse, bias=bias, proj=proj))


def _layout(weights: list[Tensor], num_layers: int, bidirectional: bool) -> tuple[bool, bool]:
    """``(bias, proj)``: whether the layers have biases and an LSTM projection (``weight_hr``),
    from the number of weights per layer-direction (2 or 4, plus 1 with a projection)."""
    return _layout_of(len(weights), num_layers, bidirectional)


def _layout_of(count: int, num_layers: int, bidirectional: bool) -> tuple[bool, bool]:
    """``_layout`` of a stack of ``count`` weights."""
    per_direction = count // (num_layers * (2 if bidirectional else 1))
    return per_direction >= 4, per_direction % 2 == 1


def _sizes(weights: list[Tensor], mode: str) -> tuple[int, int]:
    """``(hidden, out)``: H and the width of h (P with a projection, else H)."""
    w_hh = weights[1]
    return w_hh.shape[0] // _cell(mode).gates, w_hh.shape[1]


_HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _half(t: Tensor) -> str | None:
    """The library's 16-bit dtype name for a float16/bfloat16 tensor, else ``None``."""
    return _HALF.get(t.dtype)


def _array(t: Tensor | None) -> Array | None:
    """``to_array`` of ``t``; a 16-bit tensor as the library's 16-bit array (``_half_array``)."""
    if t is None:
        return None
    if t.is_cpu and t.dtype not in _HALF and t.is_contiguous():
        # (to_array's usual case inlined: a call less; ``force`` only where it is needed, for
        # a tensor requiring grad or with a negative bit: it costs a detach)
        if not t.requires_grad:
            try:
                return t.numpy()
            except RuntimeError:
                pass
        return t.numpy(force=True)
    return _half_array(t) if t.dtype in _HALF else to_array(t)


def _half_array(t: Tensor) -> Array:
    """A float16 or bfloat16 tensor's memory as an array of that dtype (``halves``; no copy
    where it is contiguous). bfloat16 goes by its bits, carried as float16: NumPy has no
    bfloat16 of its own, and CuPy's DLPack import costs tens of µs a tensor where a float16 one
    is wrapped directly (``interop._cuda_array``)."""
    if t.dtype == torch.float16:
        return to_array(t)
    return to_array(t.detach().view(torch.float16)).view(half_dtype("bfloat16"))


def _hidden_arrays(cell: CellSpec, h: Tensor | None, c: Tensor | None):
    """A state (or state gradient) as the library takes it: ``h`` or ``(h, c)``; ``None`` = 0
    (also for both of an LSTM's; callers test ``h is None and c is None`` first, a call less)."""
    return (_array(h), _array(c)) if cell.has_cell_state else _array(h)


def _result(a: Array, dtype: torch.dtype) -> Tensor:
    """A library result as a tensor of ``dtype`` (16-bit results are rounded once, here, but a
    planned call's, ``call_plans``, which come in the layer's dtype: a bfloat16 array by its
    bits, carried as float16 as ``_half_array`` carries them)."""
    if type(a) is np.ndarray and a.dtype is _AS_IS.get(dtype):  # (``_results``' usual case)
        return torch.from_numpy(a)
    if a.dtype.kind == "V":
        return _result(a.view(np.float16), torch.float16).view(torch.bfloat16)
    t = torch.from_numpy(a) if type(a) is np.ndarray else to_tensor(a)  # to_tensor, inlined
    return t if t.dtype == dtype else t.to(dtype)


# NumPy's dtypes of the torch dtypes whose NumPy results are views as they are
_AS_IS = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def _results(arrays, dtype: torch.dtype) -> list[Tensor]:
    """``_result`` of each array (``None`` kept): the usual case, a NumPy result of ``dtype``
    (``_AS_IS``), wrapped at once (a call less a result, ``dtype`` read once a call)."""
    same = _AS_IS.get(dtype)
    return [a if a is None else torch.from_numpy(a) if type(a) is np.ndarray and a.dtype is same
            else _result(a, dtype) for a in arrays]


def _empty_like_none(x: Tensor) -> Tensor:
    """The placeholder returned for ``c_n`` / ``dc0`` of cells without a cell state."""
    return x.new_empty(0)


def _recurrence(x: Tensor, lengths: Optional[Tensor], h0: Optional[Tensor],
                c0: Optional[Tensor], weights: list[Tensor], mode: str, num_layers: int,
                bidirectional: bool, algo: str, stats_slot: int, stats_part: int,
                stats_parts: int) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The stacked recurrence through the library: ``(y, h_n, c_n, saved)``."""
    with library_stream(x):
        y, hn, cn, ctx = _library_forward(x, lengths, h0, c0, weights, mode, num_layers,
                                          bidirectional, algo, stats_slot, stats_part)
        saved = [to_tensor(a) for a in functional.saved_arrays(ctx)]
    return y, hn, _empty_like_none(x) if cn is None else cn, saved


class _Eager(tuple):
    """The static arguments of an eager call that ``run_recurrence`` found ``_direct`` and
    hands to ``_Recurrence`` with autograd: its forward returns the library's ``Context`` in
    place of the saved activations (``_eager_forward``), which its backward then uses as it is
    (``_eager_backward``) rather than rebuilding it from saved tensors."""

    __slots__ = ()


def _eager_forward(x: Tensor, lengths: Tensor | None, h0: Tensor | None, c0: Tensor | None,
                   weights: list[Tensor], mode: str, num_layers: int, bidirectional: bool,
                   algo: str, stats_slot: int, stats_part: int, stats_parts: int):
    """``_recurrence`` of an eager autograd call: ``(y, h_n, c_n, ctx)``, the library's
    ``functional.Context`` last (not a tensor: autograd passes it through untracked; so is
    ``c_n``, ``None`` for a cell without a cell state, rather than a placeholder). Nothing
    outside holds the context's arrays, so nothing can change them before the backward; the
    weights and ``x`` they view are saved tensors, whose version counters autograd checks."""
    return on_library_stream(x, _library_forward, x, lengths, h0, c0, weights, mode, num_layers,
                             bidirectional, algo, stats_slot, stats_part)


def _library_forward(x: Tensor, lengths: Tensor | None, h0: Tensor | None, c0: Tensor | None,
                     weights: list[Tensor], mode: str, num_layers: int, bidirectional: bool,
                     algo: str, stats_slot: int, stats_part: int):
    """``(y, h_n, c_n, ctx)`` of ``functional.forward`` on the tensors' memory, in the
    library's stream (``c_n``: ``None`` for a cell without a cell state); records the run."""
    dtype = x.dtype
    cell, half = _cell(mode), _HALF.get(dtype)
    xa = _array(x)
    hx = None if h0 is None and c0 is None else _hidden_arrays(cell, h0, c0)
    record = _RECORDS.get(stats_slot)
    params = (_fresh_params(weights, num_layers, bidirectional) if record is None
              else record.views.get(weights, num_layers, bidirectional))
    la = None if lengths is None else lengths_array(lengths, xa)
    plan = None if record is None else record.plan
    if plan is not None and plan.matches(xa, hx, params, algo, la):  # (call_plans)
        y, hn, ctx = plan.forward(xa, hx, params, la)
        record.signature = plan.key
    else:
        y, hn, ctx = functional.forward(
            cell, params, xa, hx, la, num_layers=num_layers, bidirectional=bidirectional,
            batch_first=False, algo=algo, half=half,
            scratch_results=half is not None)  # (16-bit: copied into x's dtype below)
        if record is not None:
            _plan_calls(record, ctx, xa, hx, la, stats_part)
    hn, cn = hn if cell.has_cell_state else (hn, None)
    if record is not None:
        record.forward(stats_part, ctx.stats, half or _dtype_name(dtype))
    y, hn, cn = _results((y, hn, cn), dtype)
    return y, hn, cn, ctx


def _plan_calls(record: RunRecord, ctx: functional.Context, x: Array, hx, lengths,
                part: int) -> None:
    """Plan this call's signature in the module's record (``call_plans``) when its library
    forward before this one had it too (as the layer API plans: ``layers``); ``part``: the
    call's part of its module forward (one op call per layer with dropout: alternating parts
    never plan, rather than each replacing the other's plan)."""
    if ctx.stats.algo != "persistent" and ctx.algo != "gemm":  # (an "auto" call that fell
        return  # back to the GEMM path decides anew every call: nothing to plan)
    signature = (*call_plans.signature(x, hx, lengths), part)
    if signature == record.signature:
        # (lengths planned too: the op's come from torch's packed sequences, valid)
        record.plan = plans.plan_of(ctx, x, hx, lengths, signature)
    record.signature = signature


@lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32`` (what ``last_run.dtype`` says)."""
    return str(dtype).removeprefix("torch.")


recurrence = torch.library.custom_op("persistent_rnn::recurrence", _recurrence, mutates_args=(),
                                     tags=(torch.Tag.cudagraph_unsafe,))


@recurrence.register_fake
def _(x, lengths, h0, c0, weights, mode, num_layers, bidirectional, algo, stats_slot,
      stats_part, stats_parts):
    cell = _cell(mode)
    steps, batch, _ = x.shape
    hidden, out = _sizes(weights, mode)
    num_dirs = 2 if bidirectional else 1
    y = x.new_empty((steps, batch, num_dirs * out))
    hn = x.new_empty((num_layers * num_dirs, batch, out))
    cn = (x.new_empty((num_layers * num_dirs, batch, hidden)) if cell.has_cell_state
          else _empty_like_none(x))
    saved_dtype = torch.float32 if _half(x) else x.dtype  # 16-bit layers keep fp32 activations
    saved = [x.new_empty(shape, dtype=saved_dtype) for shape in functional.saved_shapes(
        cell, steps, batch, hidden, num_layers, bidirectional, 0 if out == hidden else out)]
    return y, hn, cn, saved


def _recurrence_backward(dy: Tensor, dhn: Optional[Tensor], dcn: Optional[Tensor], x: Tensor,
                         lengths: Optional[Tensor], h0: Optional[Tensor], c0: Optional[Tensor],
                         weights: list[Tensor], saved: list[Tensor], mode: str, num_layers: int,
                         bidirectional: bool, algo: str, stats_slot: int, stats_part: int,
                         stats_parts: int) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of ``recurrence``: ``(dx, dh0, dc0, dweights)`` (``dc0`` empty unless LSTM)."""
    cell = _cell(mode)
    with library_stream(dy):
        xa = _array(x)
        ctx = functional.restore_context(
            cell, _params(weights, num_layers, bidirectional, stats_slot), xa,
            None if h0 is None and c0 is None else _hidden_arrays(cell, h0, c0),
            None if lengths is None else lengths_array(lengths, xa), [to_array(s) for s in saved],
            num_layers=num_layers, bidirectional=bidirectional, algo=algo, half=_half(x))
        dx, dh0, dc0, dweights = _library_backward(ctx, dy, dhn, dcn, x, stats_slot,
                                                   stats_part == stats_parts - 1)
    return dx, dh0, _empty_like_none(x) if dc0 is None else dc0, dweights


def _eager_backward(ctx: functional.Context, dy: Tensor, dhn: Tensor | None, dcn: Tensor | None,
                    x: Tensor, stats_slot: int, stats_part: int,
                    stats_parts: int) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``_recurrence_backward`` of an eager call whose forward's ``Context`` is at hand
    (``_eager_forward``): the same gradients, nothing rebuilt (``dc0``: ``None`` without a
    cell state)."""
    return on_library_stream(dy, _library_backward, ctx, dy, dhn, dcn, x, stats_slot,
                             stats_part == stats_parts - 1)


def _library_backward(ctx: functional.Context, dy: Tensor, dhn: Tensor | None,
                      dcn: Tensor | None, x: Tensor, stats_slot: int,
                      first: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``functional.backward`` of ``ctx`` on the gradients' memory: ``(dx, dh0, dc0,
    dweights)`` as tensors of ``x``'s dtype (weights in ``ctx.params`` order; ``dc0`` ``None``
    without a cell state); records it."""
    cell, dya = ctx.cell, _array(dy)
    plan = ctx.plan
    if (plan is not None and dhn is None and dcn is None and type(dya) is plan.x_type
            and dya.shape == plan.y_shape and dya.dtype == plan.x_dtype):  # (call_plans)
        dx, dh0, grads, _ = plan.backward(ctx, dya)  # (``_array``'s arrays are contiguous)
    else:
        dhx = None if dhn is None and dcn is None else _hidden_arrays(cell, dhn, dcn)
        dx, dh0, grads = functional.backward(ctx, dya, dhx)
    dh0, dc0 = dh0 if cell.has_cell_state else (dh0, None)
    dx, dh0, dc0, *dweights = _results((dx, dh0, dc0, *map(grads.__getitem__, ctx.params)),
                                       x.dtype)
    _record_backward(stats_slot, first, ctx.backward_stats)
    return dx, dh0, dc0, dweights


recurrence_backward = torch.library.custom_op(
    "persistent_rnn::recurrence_backward", _recurrence_backward, mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,))


@recurrence_backward.register_fake
def _(dy, dhn, dcn, x, lengths, h0, c0, weights, saved, mode, num_layers, bidirectional, algo,
      stats_slot, stats_part, stats_parts):
    hidden, out = _sizes(weights, mode)
    states = num_layers * (2 if bidirectional else 1)
    dh0 = x.new_empty((states, x.shape[1], out))
    dc0 = (x.new_empty((states, x.shape[1], hidden)) if _cell(mode).has_cell_state
           else _empty_like_none(x))
    return torch.empty_like(x), dh0, dc0, [torch.empty_like(w) for w in weights]


def _setup_context(ctx, inputs, output) -> None:
    x, lengths, h0, c0, weights, *static = inputs
    _keep(ctx, x, lengths, h0, c0, weights, tuple(static), output, forward_settings())


def _keep(ctx, x, lengths, h0, c0, weights, static: tuple, output, kept) -> None:
    """What ``recurrence``'s forward keeps for its backward (``setup_context``; ``kept``: the
    settings to run it under, ``forward_settings``)."""
    y, _, _, saved = output
    ctx.set_materialize_grads(False)  # unused outputs (often y or c_n) need no zero gradients
    if isinstance(saved, functional.Context):  # (_eager_forward's)
        ctx.library, saved = saved, ()
    else:
        ctx.library = None
        ctx.mark_non_differentiable(*saved)
    ctx.static = static
    ctx.settings = kept
    ctx.num_weights = len(weights)
    ctx.save_for_backward(x, lengths, h0, c0, y, *weights, *saved)


def forward_settings() -> settings.Settings | None:
    """What an op's ``setup_context`` keeps for its backward (``under_forward_settings``): the
    settings in force, which torch's autograd would lose (it runs a CUDA backward on its device
    thread, outside the caller's ``override_settings``). None while torch.compile traces
    (dynamo cannot trace a ``ContextVar``): that backward runs under its thread's."""
    return None if torch.compiler.is_compiling() else settings.current()


def under_forward_settings(ctx) -> contextlib.AbstractContextManager:
    """The block a backward runs in: under ``ctx.settings`` (``forward_settings``) where kept."""
    return contextlib.nullcontext() if ctx.settings is None else settings.in_force(ctx.settings)


def _backward(ctx, dy, dhn, dcn, _dsaved):
    kept = ctx.settings  # (under_forward_settings without its frame and null context)
    if kept is None:
        return _backward_in_force(ctx, dy, dhn, dcn)
    with settings.in_force(kept):
        return _backward_in_force(ctx, dy, dhn, dcn)


def _backward_in_force(ctx, dy, dhn, dcn):
    """``_backward`` under its forward's settings (``settings.in_force``)."""
    x, lengths, h0, c0, y, *rest = ctx.saved_tensors
    weights, saved = rest[:ctx.num_weights], rest[ctx.num_weights:]
    mode, num_layers, bidirectional, *_ = ctx.static
    lstm = _cell(mode).has_cell_state
    dcn = dcn if lstm else None
    if torch.is_grad_enabled():
        # create_graph=True (and torch.func.grad, which always builds it): the gradient must be
        # differentiable, which the library's backward is not; torch's implementation is.
        grads = differentiable_grads(x, lengths, h0, c0, weights, mode, num_layers,
                                     bidirectional, (dy, dhn, dcn))
        dx, dh0, dc0, *dweights = grads
    else:
        dy = torch.zeros_like(y) if dy is None else dy
        compiling = torch.compiler.is_compiling()  # (read once: _direct's, unless batched)
        batched = not compiling and _any_batched((dy, dhn, dcn))
        direct = not (batched or compiling or torch._C._is_tracing()) and _untraced_direct(
            dy, (dhn, dcn, x, h0, c0), weights, saved)
        if direct and ctx.library is not None:
            dx, dh0, dc0, dweights = _eager_backward(ctx.library, dy, dhn, dcn, x,
                                                     *ctx.static[-3:])
        else:
            if ctx.library is not None:  # an eager forward, a backward someone must see
                saved = [to_tensor(a) for a in functional.saved_arrays(ctx.library)]
            run = _flat_backward if batched else (
                _recurrence_backward if direct else recurrence_backward)
            dx, dh0, dc0, dweights = run(dy, dhn, dcn, x, lengths, h0, c0, weights, saved,
                                         *ctx.static)
    return (dx, None, None if h0 is None else dh0, None if c0 is None else dc0, list(dweights),
            *([None] * len(ctx.static)))


recurrence.register_autograd(_backward, setup_context=_setup_context)


def _any_batched(grads: tuple) -> bool:
    """Whether a gradient is batched by the legacy vmap (``_flat_backward``)."""
    for t in grads:
        if t is not None and torch._C._functorch.is_legacy_batchedtensor(t):
            return True
    return False


class _Recurrence(torch.autograd.Function):
    """``recurrence`` with the same autograd formula as a new-style ``autograd.Function``:
    torch.func transforms (``grad``, ``vmap``) take only those (not ``register_autograd``)."""

    generate_vmap_rule = True  # vmap runs the op's own (loop) rule

    @staticmethod
    def forward(x, lengths, h0, c0, static, *weights):
        if type(static) is _Eager:  # run_recurrence found the call _direct
            return _eager_forward(x, lengths, h0, c0, list(weights), *static)
        run = _recurrence if _direct(x, (h0, c0), weights) else recurrence
        return run(x, lengths, h0, c0, list(weights), *static)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, lengths, h0, c0, static, *weights = inputs
        # (an _Eager call is never compiled: its settings are read at once)
        _keep(ctx, x, lengths, h0, c0, weights, static, output,
              settings.current() if type(static) is _Eager else forward_settings())

    @staticmethod
    def backward(ctx, dy, dhn, dcn, *dsaved):
        dx, _, dh0, dc0, dweights, *_ = _backward(ctx, dy, dhn, dcn, dsaved)
        return dx, None, dh0, dc0, None, *dweights


_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types no dispatch layer has to see


def _direct(x: Tensor, tensors: tuple, *lists: list[Tensor]) -> bool:
    """Whether an op call may run its implementation (``_recurrence``, ``_recurrence_backward``)
    at once instead of through torch's dispatcher: plain CPU or CUDA tensors (``x``, then
    ``tensors`` and the ``lists``' tensors; ``None`` skipped), eager mode, no torch.func
    transform, no dispatch or function mode, no tracer. The dispatcher's layers (the op's
    autograd key, its wrappers) would run the same function after about 40 µs of Python per
    call; whoever must see the op (the compiler, torch.export, torch.func, a
    TorchDispatchMode, meta or fake tensors) still does."""
    # (torch.jit.is_tracing's own test, less its is_scripting, false outside TorchScript)
    return not (torch.compiler.is_compiling() or torch._C._is_tracing()) and _untraced_direct(
        x, tensors, *lists)


def _untraced_direct(x: Tensor, tensors: tuple, *lists: list[Tensor]) -> bool:
    """``_direct`` where the caller found neither torch.compile nor torch.jit.trace tracing."""
    if (torch._C._are_functorch_transforms_active() or torch._C._is_torch_function_mode_enabled()
            or is_in_torch_dispatch_mode() or not (x.is_cpu or x.is_cuda)
            or type(x) not in _PLAIN):
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    for ts in lists:
        for t in ts:
            if type(t) not in _PLAIN:
                return False
    return True


def run_recurrence(x: Tensor, lengths: Tensor | None, h0: Tensor | None, c0: Tensor | None,
                   weights: list[Tensor], mode: str, num_layers: int, bidirectional: bool,
                   algo: str, stats: tuple[int, int, int],
                   eager: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``recurrence``'s ``(y, h_n, c_n)`` with autograd (``stats``: slot, part, parts);
    ``c_n`` is ``None`` for a cell without a cell state. ``eager``: the caller found neither
    torch.compile nor torch.jit.trace tracing (``_direct`` need not ask again)."""
    static = (mode, num_layers, bidirectional, algo, *stats)
    if not (_untraced_direct if eager else _direct)(x, (h0, c0), weights):
        y, hn, cn, *_ = _Recurrence.apply(x, lengths, h0, c0, static, *weights)
        return y, hn, cn if _cell(mode).has_cell_state else None
    if torch.is_grad_enabled() and _any_requires_grad(x, h0, c0, weights):
        # Function.apply's own course without functorch transforms, less its binding of the
        # arguments to forward's signature (forward has no defaults to fill): 10 µs a call;
        # tensors that escaped a torch.func transform unwrapped as apply does
        # (``unwrap_dead_wrappers``, without its generator's resumption per argument)
        # (c_n: _eager_forward's, None without a cell state)
        y, hn, cn, _ = _apply_function(*[
            _unwrap_if_dead(a) if isinstance(a, Tensor) else a
            for a in (x, lengths, h0, c0, _Eager(static), *weights)])
        return y, hn, cn
    # nothing to differentiate: no autograd node, nothing kept
    y, hn, cn, _ = on_library_stream(x, _library_forward, x, lengths, h0, c0, weights,
                                     *static[:-1])
    return y, hn, cn


_apply_function = super(torch.autograd.Function, _Recurrence).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _any_requires_grad(x: Tensor, h0: Tensor | None, c0: Tensor | None,
                       weights: list[Tensor]) -> bool:
    """Whether any input of the recurrence requires grad (loops: no generator per call)."""
    if x.requires_grad or (h0 is not None and h0.requires_grad) or (
            c0 is not None and c0.requires_grad):
        return True
    for w in weights:
        if w.requires_grad:
            return True
    return False


def _flat_backward(dy, dhn, dcn, x, lengths, h0, c0, weights, saved, *static):
    """``recurrence_backward`` for gradients batched by the legacy vmap (``gradcheck``'s batched
    gradient check, ``autograd.grad(is_grads_batched=True)``): its for-loop fallback takes only
    ops without tensor lists, so weights and activations travel as one flat tensor each."""
    mode, num_layers, bidirectional, *_ = static
    flat_dweights, dx, dh0, dc0 = recurrence_backward_flat(
        dy, dhn, dcn, x, lengths, h0, c0, _flatten(weights), _flatten(saved),
        *_sizes(weights, mode), _layout(weights, num_layers, bidirectional)[0], *static)
    return dx, dh0, dc0, _unflatten(flat_dweights, [w.shape for w in weights])


def _flatten(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: Tensor, shapes: list) -> list[Tensor]:
    sizes = [torch.Size(s).numel() for s in shapes]
    return [part.view(s) for part, s in zip(flat.split(sizes), shapes)]


def _weight_shapes(mode: str, input_size: int, hidden: int, out: int, num_layers: int,
                   bidirectional: bool, bias: bool) -> list[tuple[int, ...]]:
    """torch.nn's weight shapes, in ``_flat_weights_names`` order (``out``: the width of h, the
    projection's P where it is not ``hidden``)."""
    rows, num_dirs = _cell(mode).gates * hidden, 2 if bidirectional else 1
    shapes = []
    for layer in range(num_layers):
        cols = input_size if layer == 0 else num_dirs * out
        shapes += [(rows, cols), (rows, out), *([(rows,), (rows,)] if bias else []),
                   *([(out, hidden)] if out != hidden else [])] * num_dirs
    return shapes


@torch.library.custom_op("persistent_rnn::recurrence_backward_flat", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def recurrence_backward_flat(dy: Tensor, dhn: Optional[Tensor], dcn: Optional[Tensor],
                             x: Tensor, lengths: Optional[Tensor], h0: Optional[Tensor],
                             c0: Optional[Tensor], weights: Tensor, saved: Tensor, hidden: int,
                             out: int, bias: bool, mode: str, num_layers: int,
                             bidirectional: bool, algo: str, stats_slot: int, stats_part: int,
                             stats_parts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``recurrence_backward`` with flat weights and activations: ``(dweights, dx, dh0, dc0)``;
    ``hidden``, ``out`` (``_sizes``) and ``bias`` give the weights' shapes."""
    steps, batch, input_size = x.shape
    shapes = _weight_shapes(mode, input_size, hidden, out, num_layers, bidirectional, bias)
    saved_shapes = functional.saved_shapes(_cell(mode), steps, batch, hidden, num_layers,
                                           bidirectional, 0 if out == hidden else out)
    dx, dh0, dc0, dweights = recurrence_backward(
        dy, dhn, dcn, x, lengths, h0, c0, _unflatten(weights, shapes),
        _unflatten(saved, saved_shapes), mode, num_layers, bidirectional, algo, stats_slot,
        stats_part, stats_parts)
    return _flatten(dweights), dx, dh0, dc0


def torch_recurrence(x: Tensor, lengths: Tensor | None, h0: Tensor | None, c0: Tensor | None,
                     weights: list[Tensor], mode: str, num_layers: int,
                     bidirectional: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``recurrence``'s ``(y, h_n, c_n)`` computed by torch's own kernels (``torch._VF``)."""
    from torch import _VF
    lstm = _cell(mode).has_cell_state
    run = getattr(_VF, _cell(mode).name)  # torch's functions are named as the cells
    states = (2 if bidirectional else 1) * num_layers
    has_bias = _layout(weights, num_layers, bidirectional)[0]
    hidden, out = _sizes(weights, mode)
    h0 = x.new_zeros((states, x.shape[1], out)) if h0 is None else h0
    hx = (h0, x.new_zeros((states, x.shape[1], hidden)) if c0 is None else c0) if lstm else h0
    if lengths is None:
        out = run(x, hx, weights, has_bias, num_layers, 0.0, True, bidirectional, False)
        return out[0], out[1], out[2] if lstm else None
    layout = PackedLayout.from_lengths(lengths, x.device)
    order = layout.sorted_indices
    hx = tuple(h.index_select(1, order) for h in hx) if lstm else hx.index_select(1, order)
    out = run(layout.pack(x), layout.batch_sizes, hx, weights, has_bias, num_layers, 0.0, True,
              bidirectional)
    back = layout.unsorted_indices
    y = layout.pad(out[0], steps=x.shape[0])
    return y, out[1].index_select(1, back), out[2].index_select(1, back) if lstm else None


def differentiable_grads(x, lengths, h0, c0, weights, mode, num_layers, bidirectional,
                         grad_outputs) -> list[Tensor | None]:
    """``[dx, dh0, dc0, *dweights]`` as differentiable functions of the inputs (``None`` where an
    input does not require grad), by differentiating ``torch_recurrence`` with a graph."""
    inputs = [x, h0, c0, *weights]
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    # cuDNN's RNN backward is not differentiable; torch's native implementation is.
    with torch.enable_grad(), torch.backends.cudnn.flags(enabled=False):
        outputs = torch_recurrence(x, lengths, h0, c0, weights, mode, num_layers, bidirectional)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted],
                                    [g for _, g in pairs], create_graph=True, allow_unused=True)
    result: list[Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, grads):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return result


def _loop_vmap_rule(op):
    """A vmap rule for ``op`` that calls it once per batch element and stacks the results."""
    def select(arg, dim, i):
        if dim is None:
            return arg
        if isinstance(arg, list):
            return [select(a, d, i) for a, d in zip(arg, dim)]
        return arg.select(dim, i)

    def rule(info, in_dims, *args):
        results = [op(*(select(a, d, i) for a, d in zip(args, in_dims)))
                   for i in range(info.batch_size)]
        stacked = tuple(torch.stack(parts) if isinstance(parts[0], Tensor)
                        else [torch.stack(p) for p in zip(*parts)]
                        for parts in zip(*results))
        dims = tuple(0 if isinstance(s, Tensor) else [0] * len(s) for s in stacked)
        return stacked, dims

    return rule


for _op in (recurrence, recurrence_backward):
    torch.library.register_vmap(_op, _loop_vmap_rule(_op))
