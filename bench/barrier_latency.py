"""Grid-barrier latency: nanoseconds per barrier against grid size (the floor under every step).

    python bench/barrier_latency.py --out DIR [--rounds 20000] [--block 256] [--quick]

Runs ``grid_barrier_rounds`` (cuda_src/grid_barrier.cu, built with ``kernels.get_module``): every
CTA passes ``rounds`` consecutive grid barriers of ``hw.cuh`` (no work in between). ``ns_per_barrier``
is the kernel's own ``%globaltimer`` measurement (``elapsed_ns``, largest over CTAs) divided by the
rounds; ``event_ns_per_barrier`` is the same from CUDA events around the launch (includes launch
overhead, a cross-check). Grid sizes: powers of two up to the SM count, and the SM count itself.
"""
from __future__ import annotations

import sys

import _study
import numpy as np

from persistent_rnn import kernels, timing

NAME = "barrier_latency"
KERNEL = "grid_barrier_rounds"
NO_STALL = np.int32(-1)


def grid_sizes(sm_count: int, quick: bool) -> list[int]:
    """1, 2, 4, ... below ``sm_count``, then ``sm_count`` (only 1, 8 and all SMs when ``quick``)."""
    sizes = [1, 8] if quick else [2 ** i for i in range(sm_count.bit_length()) if 2 ** i < sm_count]
    return sorted(set(sizes + [sm_count]))


def measure(module, grid: int, block: int, rounds: int, timeout_ns: int) -> dict:
    """One launch of ``rounds`` barriers on ``grid`` CTAs: kernel-timed and event-timed ns per barrier."""
    import cupy as cp
    ctl = cp.zeros(2 + grid, dtype=cp.uint32)
    ctl[2:] = np.uint32(0xFFFFFFFF)  # progress[] = -1: nothing done (resume step 0 minus one)
    elapsed = cp.zeros(grid, dtype=cp.uint64)
    args = (ctl, np.int32(rounds), np.uint64(timeout_ns), NO_STALL, NO_STALL, np.uint64(0), elapsed)
    seconds = timing.CudaEventClock().measure(lambda: module.launch(KERNEL, grid, block, 0, args))
    aborted = int(ctl[1].get())
    if aborted:
        raise RuntimeError(f"{KERNEL} timed out at grid {grid} (abort word {aborted}); grid not co-resident?")
    return {"grid": grid, "block": block, "rounds": rounds,
            "ns_per_barrier": float(elapsed.max().get()) / rounds,
            "event_ns_per_barrier": seconds * 1e9 / rounds}


def draw(ax, doc) -> None:
    """ns per barrier against grid size (kernel timer and CUDA events)."""
    grids = [r["grid"] for r in doc["rows"]]
    ax.plot(grids, [r["ns_per_barrier"] for r in doc["rows"]], marker="o", label="%globaltimer in kernel")
    ax.plot(grids, [r["event_ns_per_barrier"] for r in doc["rows"]], marker="x", linestyle="--",
            label="CUDA events / rounds")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("grid size (CTAs)")
    ax.set_ylabel("ns per grid barrier")
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--timeout-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=5, help="launches per grid size (median)")
    args = p.parse_args(argv)
    _study.require_gpu(NAME)
    import cupy as cp
    module = kernels.get_module("grid_barrier.cu", {})
    sm_count = cp.cuda.Device().attributes["MultiProcessorCount"]
    resident = module.max_active_blocks(KERNEL, args.block, 0) * sm_count
    rows = []
    for grid in grid_sizes(sm_count, args.quick):
        if grid > resident:
            print(f"grid {grid} > {resident} co-resident CTAs: skipped", file=sys.stderr)
            continue
        runs = [measure(module, grid, args.block, args.rounds, int(args.timeout_ms * 1e6))
                for _ in range(args.repeats)]
        rows.append({**runs[0], **{k: float(np.median([r[k] for r in runs]))
                                   for k in ("ns_per_barrier", "event_ns_per_barrier")}})
        print(f"grid {grid:4d}: {rows[-1]['ns_per_barrier']:8.1f} ns per barrier "
              f"(events {rows[-1]['event_ns_per_barrier']:8.1f})")
    settings = {"rounds": args.rounds, "block": args.block, "timeout_ms": args.timeout_ms,
                "repeats": args.repeats, "sm_count": sm_count, "timing": "median over launches"}
    _study.save(args.out, NAME, _study.document(settings, rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
