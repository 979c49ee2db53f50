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

Restart protocol (one loop for GPU and emulation): zero the ``PrnnControl`` words with every
CTA's progress set to "nothing done", launch, read the progress back (one small copy per launch),
and launch again (a restart) from the first step not completed by every CTA; after
``Settings.max_restarts`` restarts the remaining steps run on the GEMM path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable

import numpy as np

from . import buffers, gemm, hardware, plan as planner, settings
from .cells import CellSpec
from .stats import RunStats
from .validation import ALGOS

Array = Any

# The emulation plans for the GPU the tiles are sized for, so that it runs the same configurations.
EMULATED_DEVICE = hardware.PROFILES["h100"]


@dataclass
class ForwardResult:
    """The state buffers of one layer-direction's forward recurrence."""

    y: Array
    cs: Array | None
    saved: Array


@dataclass
class BackwardResult:
    """Gradients of one layer-direction's backward recurrence."""

    dgi: Array
    dgh: Array
    dh0: Array
    dc0: Array | None


@dataclass(frozen=True)
class _Engine:
    """How a persistent pass runs: its plan, a ``launch`` callable and the barrier timeout."""

    pass_plan: planner.PassPlan
    launch: Callable[..., None]
    timeout_ns: int
    emulated: bool


def run_forward(cell: CellSpec, gi: Array, w_hh: Array, b_hh: Array | None, h0: Array,
                c0: Array | None, lengths: Array | None, algo: str, stats: RunStats,
                half: str | None = None) -> ForwardResult:
    """Run the forward recurrence over all steps of ``gi`` and record what ran in ``stats``.

    ``half``: ``None``, or the 16-bit dtype ("float16", "bfloat16") of a layer whose fp32 data
    holds values of that dtype: W_hh is held in it and h_t rounded to it every step."""
    y, cs, saved = buffers.allocate_forward(cell, gi)
    steps, batch, _ = gi.shape
    engine, reason = _engine(cell, gi, w_hh.shape[1], batch, algo, backward=False, half=half)
    if engine is None:
        gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=0, half=half)
        stats.merge(RunStats(algo="gemm", fallback=reason))
        return ForwardResult(y, cs, saved)
    xp = buffers.array_module(gi)
    c = partial(xp.ascontiguousarray, dtype=np.float32)  # a no-op for the usual float32 input
    hidden = y.shape[2]
    bias = xp.zeros(cell.gates * hidden, gi.dtype) if b_hh is None else c(b_hh)
    c0_arg = c(h0) if c0 is None else c(c0)
    fixed = (c(w_hh), bias, c(gi), c(h0), c0_arg, buffers.full_lengths(xp, lengths, batch, steps),
             y, y if cs is None else cs, saved)
    step, restarts = run_with_restarts(engine, fixed, (steps, batch, hidden), first=0, end=steps, xp=xp)
    run = RunStats(algo="persistent", restarts=restarts, emulated=engine.emulated,
                   details=[_describe(engine, restarts)])
    if step < steps:
        run.fallback = f"barrier timeouts: {restarts} restarts, steps {step}..{steps - 1} on GEMM"
        gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=step,
                           half=half)
    stats.merge(run)
    return ForwardResult(y, cs, saved)


def run_backward(cell: CellSpec, dy: Array, dhn: Array, dcn: Array | None, w_hh: Array,
                 h0: Array, c0: Array | None, lengths: Array | None, fwd: ForwardResult,
                 algo: str, stats: RunStats, half: str | None = None) -> BackwardResult:
    """Run backward through time over all steps; ``dy`` must be zero past each length.
    ``half``: as for ``run_forward`` (the backward itself computes in fp32)."""
    dgi, dgh = buffers.allocate_backward(cell, dy)
    steps, batch, hidden = dy.shape
    engine, reason = _engine(cell, dy, hidden, batch, algo, backward=True, half=half)
    if engine is None:
        dh0, dc0 = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, fwd.y, fwd.cs, fwd.saved,
                                       dgi, dgh, dh_carry=dhn, dc_carry=dcn, stop=steps)
        stats.merge(RunStats(algo="gemm", fallback=reason))
        return BackwardResult(dgi, dgh, dh0, dc0)
    xp = buffers.array_module(dy)
    c = partial(xp.ascontiguousarray, dtype=np.float32)  # a no-op for the usual float32 input
    # Direct carries by step parity; the kernel's step T-1 reads parity T % 2 (dh_n, dc_n).
    dh_carry = xp.zeros((2, batch, hidden), dy.dtype)
    dc_carry = xp.zeros((2, batch, hidden), dy.dtype) if cell.has_cell_state else dh_carry
    if dhn is not None:
        dh_carry[steps % 2] = dhn
    if dcn is not None and cell.has_cell_state:
        dc_carry[steps % 2] = dcn
    fixed = (c(w_hh.T), c(dy), fwd.y, fwd.y if fwd.cs is None else fwd.cs, fwd.saved, c(h0),
             c(h0) if c0 is None else c(c0), buffers.full_lengths(xp, lengths, batch, steps),
             dgi, dgh, dh_carry, dc_carry)
    step, restarts = run_with_restarts(engine, fixed, (steps, batch, hidden), first=steps - 1, end=-1, xp=xp)
    run = RunStats(algo="persistent", restarts=restarts, emulated=engine.emulated,
                   details=[_describe(engine, restarts)])
    stop = step + 1  # steps >= stop are complete, with their carries at parity stop % 2
    dh_c = dh_carry[stop % 2] + (dgh[stop] @ w_hh if stop < steps else 0.0)
    dc_c = dc_carry[stop % 2] if cell.has_cell_state else None
    if stop > 0:
        run.fallback = f"barrier timeouts: {restarts} restarts, steps {stop - 1}..0 on GEMM"
        dh0, dc0 = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, fwd.y, fwd.cs, fwd.saved,
                                       dgi, dgh, dh_carry=dh_c, dc_carry=dc_c, stop=stop)
    else:
        dh0, dc0 = dh_c, dc_c
    stats.merge(run)
    return BackwardResult(dgi, dgh, dh0, dc0)


def run_with_restarts(engine: _Engine, fixed: tuple, sizes: tuple[int, int, int], first: int, end: int,
             xp) -> tuple[int, int]:
    """Launch the persistent pass from step ``first`` towards ``end`` (exclusive), restarting
    after barrier timeouts; returns ``(next step to run, restarts)``, where the next step equals
    ``end`` when the kernel completed every step.

    ``fixed``: the kernel's leading (buffer) arguments; ``sizes``: (T, B, H). The same loop serves
    the GPU and the emulation: only ``engine.launch`` differs.
    """
    p = engine.pass_plan
    max_restarts = settings.current().max_restarts
    direction = 1 if end > first else -1
    step, restarts = first, 0
    while True:
        # progress[] = "last step done" = the step before the resume step, in the run's direction.
        control = np.full(2 + p.grid, step - direction, dtype=np.int32)
        control[:2] = 0
        control = xp.asarray(control.view(np.uint32))
        stall = settings.current_stall() if restarts == 0 else settings.NO_STALL
        engine.launch(p.kernel, p.grid, p.block, p.shared_bytes,
                      (*fixed, control, *(np.int32(s) for s in sizes), np.int32(step),
                       np.uint64(engine.timeout_ns), *stall.args()))
        progress = _to_host(control)[2:].view(np.int32)
        done = int(progress.min()) if direction > 0 else int(progress.max())
        step = done + direction
        if (end - step) * direction <= 0 or restarts >= max_restarts:
            return step, restarts
        restarts += 1


def _describe(engine: _Engine, restarts: int) -> str:
    p = engine.pass_plan
    where = "emulated" if engine.emulated else "GPU"
    return (f"{p.kernel} ({where}): {p.defines}, grid {p.grid} x {p.block} threads, "
            f"{p.shared_bytes} B shared, {restarts + 1} launch(es)")


def _to_host(a: Array) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _engine(cell: CellSpec, data: Array, hidden: int, batch: int, algo: str,
            backward: bool, half: str | None = None) -> tuple[_Engine | None, str | None]:
    """The persistent engine for this pass, or ``(None, why the GEMM path runs)``.

    Raises ValueError when ``algo="persistent"`` cannot be honoured.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if algo == "gemm" or batch == 0:  # an empty batch has nothing to run, under every algo
        return None, None
    xp = buffers.array_module(data)
    on_gpu = xp is not np
    if algo == "auto" and not on_gpu:
        return None, None
    device = _current_device() if on_gpu else EMULATED_DEVICE
    plan, why = _plan(cell, data, hidden, batch, algo, device, half)
    if why is not None:
        if algo == "persistent":
            raise ValueError(f"algo='persistent' cannot run this layer: {why}")
        return None, why
    pass_plan = plan.backward if backward else plan.forward
    if on_gpu:
        return _gpu_engine(pass_plan, device, algo)
    from . import emulate
    module = emulate.get_module(pass_plan.source, pass_plan.defines)
    launch = partial(module.launch, max_resident=settings.current().emulation_max_resident)
    return _Engine(pass_plan, launch, int(settings.current().emulation_timeout_ms * 1e6), True), None


def _plan(cell: CellSpec, data: Array, hidden: int, batch: int, algo: str,
          device: hardware.DeviceProfile,
          half: str | None) -> tuple[planner.Plan | None, str | None]:
    """The plan of this layer-direction, or why the persistent kernel cannot (or should not) run."""
    if np.dtype(data.dtype) != np.float32:
        return None, f"dtype is {np.dtype(data.dtype).name}; the persistent kernels run float32 only"
    if half is not None:
        return None, f"dtype {half}: the 16-bit persistent kernels are not built yet"
    limit = settings.current().auto_max_batch
    if algo == "auto" and batch > limit:
        return None, f"batch {batch} > {limit} (auto_max_batch): not measured beyond it"
    plan = planner.make_plan(cell, hidden, batch, half or "float32", device)
    return (plan, None) if plan.fits else (None, plan.reason)


def _gpu_engine(pass_plan: planner.PassPlan, device: hardware.DeviceProfile,
                algo: str) -> tuple[_Engine | None, str | None]:
    """The GPU engine, after checking that the whole grid can be resident at once."""
    from . import kernels
    module = kernels.get_module(pass_plan.source, pass_plan.defines, settings.current().cooperative)
    per_sm = module.max_active_blocks(pass_plan.kernel, pass_plan.block, pass_plan.shared_bytes)
    if pass_plan.grid > device.sm_count * per_sm:
        why = (f"grid {pass_plan.grid} > {device.sm_count} SMs x {per_sm} resident CTAs "
               f"of {pass_plan.kernel}")
        if algo == "persistent":
            raise ValueError(f"algo='persistent' cannot run this layer: {why}")
        return None, why
    return _Engine(pass_plan, module.launch, int(settings.current().gpu_timeout_ms * 1e6), False), None


@lru_cache(maxsize=None)
def _device_profile(device_id: int) -> hardware.DeviceProfile:
    return hardware.current_device()


def _current_device() -> hardware.DeviceProfile:
    import cupy
    return _device_profile(cupy.cuda.Device().id)
