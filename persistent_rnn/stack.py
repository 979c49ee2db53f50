"""Stack mode: every layer of a unidirectional stack in one persistent launch per pass.

Where the weights of all layers fit the register files together (``plan.make_stack_plan``), the
forward of an L-layer stack is one launch of ``cuda_src/stack_forward.cu`` and its backward one
of ``stack_backward.cu`` instead of L each: layer l computes step t while layer l+1 computes
t-1 (forward; the reverse backward), so a pass takes about T + L - 1 step latencies instead of
L*T. The input projection of the layers above the first happens inside the kernel; layer 0's is
the GEMM before the launch, as for one layer.

Restart protocol (the layer kernels', per layer): each CTA records the last step it completed;
after the launch the host reads the progress once and, where a layer did not finish, launches
the stack again with each layer starting from its first step not completed by all of its CTAs
(``starts``; a finished layer's CTAs exit at once). The exchange keeps every step's words
(``stack_common.cuh``), so a relaunch needs no zeroing and replays bitwise the same results.
After ``Settings.max_restarts`` restarts the GEMM path finishes every unfinished layer from where
it stopped, in order (forward bottom-up, backward top-down), each from the completed output of
its neighbour. ``RunStats.launches`` counts the launches.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from . import buffers, gemm, hardware, plan as planner, runtime, settings
from .cells import CellSpec
from .stats import RunStats

Array = Any
Weights = tuple  # one layer's (w_ih, w_hh, b_ih or None, b_hh or None)


def engine(cell: CellSpec, data: Array, hidden: int, layers: int, bidirectional: bool,
           algo: str, half: str | None, backward: bool,
           proj: bool = False) -> tuple[runtime._Engine | None, str | None]:
    """The stack-mode engine of one pass over ``data`` (T, B, .), or ``(None, why not)``: then
    the layers run one launch per layer-direction (``None`` reason: stack mode was not asked
    for, e.g. ``algo="gemm"`` or the ``stack`` setting off). ``proj``: an LSTM projection."""
    batch = data.shape[1]
    on_gpu = buffers.array_module(data) is not np
    if algo == "gemm" or batch == 0 or (layers < 2 and not bidirectional) \
            or not settings.current().stack \
            or (algo == "auto" and not on_gpu):
        return None, None
    if proj:
        return None, "LSTM projections (proj_size) run one launch per layer-direction"
    why = runtime._why_not_persistent(data, batch, algo)
    if why is not None:
        return None, why
    device = runtime.planning_device(on_gpu)
    return _cached_engine(cell, hidden, batch, layers, bidirectional, backward, device,
                          on_gpu and settings.current().cooperative, not on_gpu, half or "float32")


@lru_cache(maxsize=64)
def _cached_engine(cell: CellSpec, hidden: int, batch: int, layers: int, bidirectional: bool,
                   backward: bool, device: hardware.DeviceProfile, cooperative: bool,
                   emulated: bool, weights: str) -> tuple[runtime._Engine | None, str | None]:
    plan = planner.make_stack_plan(cell, hidden, batch, layers, bidirectional, weights, device)
    if not plan.fits:
        return None, plan.reason
    return runtime.engine_of(plan.backward if backward else plan.forward, device, cooperative,
                             emulated)


@dataclass
class _StackPass:
    """One pass of a stack (forward or backward): its launches and their progress."""

    engine: runtime._Engine
    args: Callable[[Array], tuple]  # the kernel's buffer arguments around ``starts``
    sizes: tuple[int, int, int]     # (T, B, H)
    layers: int
    direction: int                  # +1 forward, -1 backward
    control: Array
    stats: RunStats
    what: str                       # the groups, in words (for ``RunStats.details``)

    @property
    def end(self) -> int:
        return self.sizes[0] if self.direction > 0 else -1

    def launch(self, starts: Array, stall: settings.Stall) -> None:
        """Launch the stack with each layer from ``starts[layer]`` (an int32 array on the
        data's device; stream-ordered, nothing is read back)."""
        runtime.launch_pass(self.engine, self.control, self.args(starts), self.sizes, stall)
        self.stats.launches += 1

    def next_steps(self, starts: np.ndarray) -> np.ndarray:
        """Per layer, the first step not completed by all of its CTAs (``end``: finished)."""
        words = runtime._to_host(self.control)
        per = self.engine.pass_plan.grid // self.layers
        return np.array([runtime._Control.next_step(words, int(s), self.direction,
                                                    slice(k * per, (k + 1) * per))
                         for k, s in enumerate(starts)])

    def run(self, finish: Callable[[np.ndarray], None]) -> None:
        """Launch from the first step, restart unfinished layers, then ``finish(next steps)``
        (the GEMM path completes what the kernel left)."""
        xp = buffers.array_module(self.control)
        first = 0 if self.direction > 0 else self.sizes[0] - 1
        self.launch(xp.full(self.layers, first, np.int32), settings.current_stall())  # capturable
        starts = np.full(self.layers, first)
        if runtime._capturing(self.control):
            self.stats.details.append("progress not checked (CUDA stream capture): no restart")
            finish(np.full(self.layers, self.end))
            return
        steps = self.next_steps(starts)
        while (steps != self.end).any() and self.stats.restarts < settings.current().max_restarts:
            self.stats.restarts += 1
            self.launch(xp.asarray(steps, dtype=np.int32), settings.NO_STALL)
            steps = self.next_steps(steps)
        left = [f"layer {k} steps {s}..{self.end - self.direction}"
                for k, s in enumerate(steps) if s != self.end]
        if left:
            self.stats.fallback = (f"barrier timeouts: {self.stats.restarts} restarts, "
                                   + ", ".join(left) + " on GEMM")
        self.stats.details.append(self._describe())
        finish(steps)

    def _describe(self) -> str:
        pp = self.engine.pass_plan
        where = "emulated" if self.engine.emulated else "GPU"
        return (f"{pp.kernel} ({where}, {self.what}): {pp.defines}, "
                f"grid {pp.grid} x {pp.block} threads, {pp.shared_bytes} B shared, "
                f"{self.stats.launches} launch(es)")


def _new_pass(engine_: runtime._Engine, args: Callable, sizes: tuple[int, int, int], layers: int,
              direction: int, xp, chained: bool) -> _StackPass:
    stats = RunStats(algo="persistent", emulated=engine_.emulated)
    what = f"stack of {layers} layers" if chained else "both directions of a layer side by side"
    return _StackPass(engine_, args, sizes, layers, direction,
                      runtime._Control.new(xp, engine_.pass_plan.grid), stats, what)


def _exchange(xp, engine_: runtime._Engine, layers: int, steps: int, batch: int) -> Array:
    """A stack pass's tagged exchange, zeroed: one slot per (layer, step), rows of the plan's
    ``exchange_row`` words (half a staged row, ``stack_common.cuh``)."""
    return xp.zeros((layers, steps, batch, engine_.pass_plan.exchange_row), np.uint32)


def _stacked(xp, arrays: Sequence[Array]) -> Array:
    """``arrays`` stacked on a new first axis as one contiguous float32 array."""
    return xp.ascontiguousarray(xp.stack(arrays), dtype=np.float32)


def _unused(xp) -> Array:
    """A placeholder for a kernel argument the launch never reads (W_ih of unchained groups)."""
    return xp.zeros(1, np.float32)


def _biases(xp, cell: CellSpec, weights: Sequence[Weights], which: int, hidden: int) -> Array:
    zero = xp.zeros(cell.gates * hidden, np.float32)
    return _stacked(xp, [zero if w[which] is None else w[which] for w in weights])


def _projected(y_below: Array, w: Weights, lengths: Array | None) -> Array:
    """The input projection of a layer above the first, from the layer below's output as the
    layer-by-layer path feeds it (zero past each length): ``W_ih y + b_ih`` for all steps."""
    xp = buffers.array_module(y_below)
    gi = buffers.matmul_steps(buffers.select_active(xp, y_below, lengths), w[0].T)
    return gi if w[2] is None else gi + w[2]


def forward(cell: CellSpec, engine_: runtime._Engine, gi: Array, weights: Sequence[Weights],
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
    w_ih = _stacked(xp, [w[0] for w in weights[1:]]) if chained else _unused(xp)
    lead = (w_ih, _stacked(xp, [w[1] for w in weights]),
            _biases(xp, cell, weights, 2, hidden), _biases(xp, cell, weights, 3, hidden), f32(gi),
            f32(h0), f32(h0 if c0 is None else c0), buffers.full_lengths(xp, lengths, batch, steps),
            np.int32(chained))
    tail = (y, y if cs is None else cs, saved,
            _exchange(xp, engine_, layers, steps, batch))

    def finish(next_steps: np.ndarray) -> None:
        for k, start in enumerate(next_steps):  # bottom-up: layer k reads layer k-1's output
            if start < steps:
                if not chained:
                    layer_gi = gi[k]
                else:
                    layer_gi = gi if k == 0 else _projected(y[k - 1], weights[k], lengths)
                r = results[k]
                gemm.forward_steps(cell, layer_gi, weights[k][1], weights[k][3], h0[k],
                                   None if c0 is None else c0[k], lengths, r.y, r.cs, r.saved,
                                   start=int(start))

    p = _new_pass(engine_, lambda starts: (*lead, starts, *tail), (steps, batch, hidden), layers,
                  1, xp, chained)
    p.run(finish)
    return results, p.stats


def backward(cell: CellSpec, engine_: runtime._Engine, dy: Array, dhn: Array | None,
             dcn: Array | None, weights: Sequence[Weights], h0: Array, c0: Array | None,
             lengths: Array | None, fwds: Sequence[runtime.ForwardResult], chained: bool = True
             ) -> tuple[list[runtime.BackwardResult], RunStats]:
    """The backward of a stack in stack mode. ``dy``: the top layer's output gradient (T, B, H),
    zero past each length; ``dhn``/``dcn``: (L, B, H) or ``None``; ``fwds``: each layer's
    forward buffers. Returns each layer's ``BackwardResult`` (``dh0``/``dc0`` included).
    ``chained=False``: the two directions of one layer, ``dy`` (2, T, B, H) both gradients."""
    xp = buffers.array_module(dy)
    steps, batch, hidden = dy.shape[-3:]
    layers, width = len(weights), cell.gates * hidden
    dgi = xp.empty((layers, steps, batch, width), np.float32)
    dgh = xp.empty_like(dgi) if cell.separate_dgh else dgi
    dh_carry = xp.zeros((layers, steps + 1, batch, hidden), np.float32)
    dc_carry = xp.zeros_like(dh_carry) if cell.has_cell_state else dh_carry
    if dhn is not None:
        dh_carry[:, steps] = dhn
    if dcn is not None and cell.has_cell_state:
        dc_carry[:, steps] = dcn
    exchange_gh = _exchange(xp, engine_, layers, steps, batch)
    exchange_gi = xp.zeros_like(exchange_gh) if dgh is not dgi else exchange_gh
    y = _stacked(xp, [f.y for f in fwds])
    f32 = lambda a: xp.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    w_ih_t = _stacked(xp, [w[0].T for w in weights[1:]]) if chained else _unused(xp)
    lead = (_stacked(xp, [w[1].T for w in weights]), w_ih_t,
            f32(dy), y, y if fwds[0].cs is None else _stacked(xp, [f.cs for f in fwds]),
            _stacked(xp, [f.saved for f in fwds]), f32(h0), f32(h0 if c0 is None else c0),
            buffers.full_lengths(xp, lengths, batch, steps), np.int32(chained))
    tail = (dgi, dgh, dh_carry, dc_carry, exchange_gh, exchange_gi)
    results: list[runtime.BackwardResult] = [None] * layers  # type: ignore[list-item]

    def finish(next_steps: np.ndarray) -> None:
        for k in range(layers - 1, -1, -1):  # top-down: layer k's dy comes from layer k+1's dgi
            stop, w_hh = int(next_steps[k]) + 1, weights[k][1]  # steps >= stop are complete
            dh = dh_carry[k, stop] + (dgh[k, stop] @ w_hh if stop < steps else 0.0)
            dc = dc_carry[k, stop] if cell.has_cell_state else None
            if stop > 0:
                if not chained:
                    dy_k = dy[k]
                else:
                    dy_k = dy if k == layers - 1 else buffers.matmul_steps(dgi[k + 1],
                                                                           weights[k + 1][0])
                f = fwds[k]
                dh, dc = gemm.backward_steps(cell, dy_k, w_hh, h0[k], None if c0 is None else c0[k],
                                             lengths, f.y, f.cs, f.saved, dgi[k], dgh[k],
                                             dh_carry=dh, dc_carry=dc, stop=stop)
            results[k] = runtime.BackwardResult(dgi[k], dgh[k], dh, dc)

    p = _new_pass(engine_, lambda starts: (*lead, starts, *tail), (steps, batch, hidden), layers,
                  -1, xp, chained)
    p.run(finish)
    return results, p.stats
