"""A representative set of the persistent kernels in small cases, for compute-sanitizer.

Run as ``compute-sanitizer --tool memcheck python tests/gpu_sanitize_case.py`` (and racecheck,
synccheck); exits 1 when a result differs from the float64 GEMM reference or a case did not run
the kernel it is meant to (placement, restarts, launches). Used by test_gpu_persistent.py.

The cases: every cell in the thread-block-cluster placement and LSTM/GRU in the grid placement,
forward and backward (lengths, h0/c0), fp32 and fp16 weights, a stall that restarts the grid
kernel (results bitwise equal to the run without it), an LSTM with projection and a two-layer
stack in stack mode (one launch per pass). ``--cpu`` runs the same cases on NumPy arrays (the CPU
emulation of the same kernels): a check of the case list where there is no GPU.
``--only NAME[,NAME]`` runs a subset (names as printed); ``--group cluster|grid|other[,...]``
the cases of a placement (``cluster``: the cluster-placed cases, ``grid``: the grid-placed ones,
``other``: the stall, LSTMP and stack cases), so that a sanitizer can run over each apart.
``--cubins`` prints ``cubin: PATH`` after each case for every kernel module it loaded first (on
the GPU): what a racecheck report's ``kernel+offset`` refers to (bench/racecheck.py).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import persistent_rnn as prnn
from persistent_rnn import plan, runtime, settings
from persistent_rnn.cells import CELLS
from persistent_rnn.stats import RunStats

FP32_TOL, FP16_TOL = 1e-5, 5e-3  # max-abs relative error against float64 (docs/api.md)
INPUT, STEPS, BATCH = 24, 4, 2
GRID_HIDDEN = 300  # above the cluster tile's capacity for LSTM and GRU: the grid placement
# The stall outlasts the barrier timeout by far, also under the sanitizer's slow-down.
STALL_TIMEOUT_MS, STALL_MS = 2000.0, 5000.0


@dataclass
class Case:
    """One case: its name, what it runs, and what it must show beyond accuracy."""

    name: str
    run: Callable[[Any], list[str]]  # xp -> problems (empty: passed)


def run_cells_case(xp, cell, hidden: int = 40, batch: int = 2, steps: int = 3) -> float:
    """Forward and backward of ``cell`` through the runtime, persistent vs GEMM (float64); the
    worst relative error (2-norm) over y, saved, dgi, dgh and dh0."""
    rng = np.random.default_rng(0)
    g = cell.gates
    host = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in
            ((steps, batch, g * hidden), (g * hidden, hidden), (g * hidden,), (batch, hidden),
             (batch, hidden), (steps, batch, hidden), (batch, hidden), (batch, hidden))]
    host[1] /= np.float32(np.sqrt(hidden))
    lengths = xp.asarray(np.array([steps, steps - 1][:batch], np.int32))
    host[5][steps - 1, 1:] = 0  # dy is zero past each length
    results = {}
    for dtype, algo in ((np.float32, "persistent"), (np.float64, "gemm")):
        gi, w, b, h0, c0, dy, dhn, dcn = (xp.asarray(a, dtype) for a in host)
        if not cell.has_cell_state:
            c0 = dcn = None
        fwd = runtime.run_forward(cell, gi, w, b, h0, c0, lengths, algo, RunStats())
        bwd = runtime.run_backward(cell, dy, dhn, dcn, w, h0, c0, lengths, fwd, algo, RunStats())
        results[algo] = [fwd.y, fwd.saved, bwd.dgi, bwd.dgh, bwd.dh0]
    worst = 0.0
    for a, r in zip(results["persistent"], results["gemm"]):
        if r.size:
            worst = max(worst, float(xp.linalg.norm(a.astype(xp.float64) - r) / xp.linalg.norm(r)))
    return worst


def cells_case(cell) -> Callable[[Any], list[str]]:
    """``run_cells_case`` of ``cell`` (the cluster placement at its small size) as a case."""
    def run(xp) -> list[str]:
        worst = run_cells_case(xp, cell)
        return [] if worst <= FP32_TOL else [f"relative error {worst:.2e} > {FP32_TOL:g}"]
    return run


def _layer_run(xp, layer, seed: int) -> tuple[list, RunStats, RunStats]:
    """Forward (lengths, random h0/c0) and backward of ``layer``: every result, both passes' stats."""
    rng = np.random.default_rng(seed)
    dtype = layer.dtype
    states = layer.num_layers * (1 + layer.bidirectional)
    out = layer.proj_size or layer.hidden_size
    h0 = xp.asarray(rng.standard_normal((states, BATCH, out)), dtype)
    hx = (h0, xp.asarray(rng.standard_normal((states, BATCH, layer.hidden_size)), dtype)) \
        if layer.mode == "LSTM" else h0
    x = xp.asarray(rng.standard_normal((STEPS, BATCH, INPUT)), dtype)
    layer.zero_grad()
    y, hn = layer.forward(x, hx, [STEPS, STEPS - 1])
    fwd = layer.last_run
    dx, dhx = layer.backward(xp.asarray(rng.standard_normal(y.shape), dtype))
    flat = [y, *(hn if isinstance(hn, tuple) else (hn,)), dx,
            *(dhx if isinstance(dhx, tuple) else (dhx,)), *layer.grads.values()]
    return flat, fwd, layer.last_run


def _rel(xp, a, b) -> float:
    """Max-abs error of ``a`` over the max-abs of the float64 ``b``."""
    return float(xp.abs(a.astype(xp.float64) - b).max() / max(float(xp.abs(b).max()), 1e-30))


def layer_case(mode: str, hidden: int, dtype: str = "float32", placement: str | None = None,
               launches: int | None = None, **kw) -> Callable[[Any], list[str]]:
    """A case of the layer API: ``mode`` persistent in ``dtype`` against the float64 GEMM layer
    on the same parameters; ``placement`` ("grid"/"cluster") and ``launches`` per pass checked."""
    def run(xp) -> list[str]:
        problems = []
        if placement is not None:
            dev = runtime.EMULATED_DEVICE if xp is np else plan.resolve_device(None)
            cell = "rnn_tanh" if mode == "RNN" else mode
            tile = plan.make_plan(cell, hidden, BATCH, dtype, dev, kw.get("proj_size", 0)).tile
            if ("cluster" if tile.cluster else "grid") != placement:
                problems.append(f"planned {'cluster' if tile.cluster else 'grid'}, not {placement}")
        make = getattr(prnn, mode)
        layer = make(INPUT, hidden, dtype=dtype, algo="persistent", seed=3, **kw)
        ref = make(INPUT, hidden, dtype="float64", algo="gemm", seed=3, **kw)
        ref.load_params(layer.params)  # the same values, in float64 (a layer moves to x's device)
        got, fwd, bwd = _layer_run(xp, layer, seed=hidden)
        want, _, _ = _layer_run(xp, ref, seed=hidden)
        problems += _stats_problems(fwd, bwd, launches)
        tol = FP32_TOL if dtype == "float32" else FP16_TOL
        worst = max(_rel(xp, a, b) for a, b in zip(got, want))
        if worst > tol:
            problems.append(f"relative error {worst:.2e} > {tol:g}")
        return problems
    return run


def _stats_problems(fwd: RunStats, bwd: RunStats, launches: int | None) -> list[str]:
    problems = []
    for name, s in (("forward", fwd), ("backward", bwd)):
        if s.algo != "persistent" or s.fallback is not None:
            problems.append(f"{name} ran {s.algo} (fallback {s.fallback})")
        if launches is not None and s.launches != launches:
            problems.append(f"{name} took {s.launches} launches, not {launches}")
    return problems


def stall_case(xp) -> list[str]:
    """A stall in the grid LSTM's forward and backward: a restart each, results bitwise equal."""
    def layer():
        return prnn.LSTM(INPUT, GRID_HIDDEN, algo="persistent", seed=4)
    with settings.override_settings(gpu_timeout_ms=STALL_TIMEOUT_MS,
                                    emulation_timeout_ms=STALL_TIMEOUT_MS):
        plain, _, _ = _layer_run(xp, layer(), seed=9)
        with prnn.inject_stall(block=1, step=STEPS // 2, duration_ms=STALL_MS):
            stalled, fwd, bwd = _layer_run(xp, layer(), seed=9)
    problems = _stats_problems(fwd, bwd, None)
    if fwd.restarts < 1 or bwd.restarts < 1:
        problems.append(f"no restart (forward {fwd.restarts}, backward {bwd.restarts})")
    if not all(bool(xp.array_equal(a, b)) for a, b in zip(plain, stalled)):
        problems.append("results after the restart differ from those without a stall")
    return problems


def cases() -> list[Case]:
    """Every case, in the order they run."""
    out = [Case(f"cluster-fp32-{name}", cells_case(cell)) for name, cell in sorted(CELLS.items())]
    return out + [
        Case("grid-fp32-lstm", layer_case("LSTM", GRID_HIDDEN, placement="grid")),
        Case("grid-fp32-gru", layer_case("GRU", GRID_HIDDEN, placement="grid")),
        Case("cluster-fp16-lstm", layer_case("LSTM", 64, "float16", placement="cluster")),
        # H 256: 16 CTAs of 4 warps (a non-portable cluster size), or 8 of 8 where it does not fit
        Case("cluster16-fp32-gru", layer_case("GRU", 256, placement="cluster")),
        Case("grid-fp16-gru", layer_case("GRU", GRID_HIDDEN, "float16", placement="grid")),
        Case("stall-restart-grid-lstm", stall_case),
        Case("lstmp-fp32", layer_case("LSTM", 128, proj_size=32)),
        Case("stack-fp32-lstm-2", layer_case("LSTM", 64, num_layers=2, launches=1)),
    ]


GROUPS = ("cluster", "grid", "other")


def group_of(name: str) -> str:
    """The group a case belongs to, by its name's placement prefix."""
    prefix = name.split("-")[0]
    return "cluster" if prefix.startswith("cluster") else "grid" if prefix == "grid" else "other"


def main(argv: list[str] | None = None) -> int:
    """Run the cases (``--cpu``: on NumPy, emulated); exit 1 if any failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="NumPy arrays: the CPU emulation")
    p.add_argument("--only", help="comma-separated case names")
    p.add_argument("--group", help=f"comma-separated groups of cases: {', '.join(GROUPS)}")
    p.add_argument("--cubins", action="store_true",
                   help="after each case, print the cubins of the kernel modules it loaded")
    args = p.parse_args(argv)
    groups = args.group.split(",") if args.group else GROUPS
    if set(groups) - set(GROUPS):
        p.error(f"--group takes {', '.join(GROUPS)}, got {args.group!r}")
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    chosen = [c for c in cases() if (not args.only or c.name in args.only.split(","))
              and group_of(c.name) in groups]
    status = 0
    printed = 0
    for case in chosen:
        problems = case.run(xp)
        print(f"{case.name}: {'ok' if not problems else '; '.join(problems)}", flush=True)
        status |= bool(problems)
        if args.cubins and xp is not np:
            from persistent_rnn import kernels
            loaded = kernels.loaded_cubins()
            for path in loaded[printed:]:
                print(f"cubin: {path}", flush=True)
            printed = len(loaded)
    if xp is not np:
        xp.cuda.Device().synchronize()
    print(f"{len(chosen)} cases, {'all passed' if not status else 'FAILED'}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
