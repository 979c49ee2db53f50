"""Inter-CTA synchronisation latency against grid size: the floor under every persistent step.

    python bench/barrier_latency.py --out DIR [--rounds 20000] [--block 256] [--width 8] [--quick]

Three protocols of cuda_src/grid_barrier.cu (built with ``kernels.get_module``), each ``rounds``
times back to back with no work in between, per grid size:

* ``ns_per_barrier``: ``grid_barrier_rounds``, the counter barrier the persistent kernels used
  first (block barrier, fence, arrival atomic, acquire polling; kept in exchange.cuh as the
  baseline);
* ``exchange_ns_per_round``: ``exchange_rounds``, the tagged exchange they use now: every CTA
  publishes ``width`` tagged 8-byte words and gathers all ``grid * width`` of them;
* ``cluster_ns_per_round``: ``cluster_exchange_rounds``, the same within one thread-block cluster
  through distributed shared memory (built with ``PRNN_CLUSTER`` = grid; sm_90 and newer, grids of
  at most 16 CTAs - 16 is above CUDA's portable size of 8 and is what the small layers run as on
  H100/H200 -; ``None`` where the device holds no such cluster).

``--free-polls 2,16,64`` (an experiment): the tagged exchange again, built with each number of free
polls before a waiting thread reads the timer and sleeps (``-D PRNN_GRID_FREE_POLLS``,
``cuda_src/exchange.cuh``; the kernels' default is 2): ``exchange_ns_per_round_free_polls`` maps
each to its ns per round.

Each figure is the kernel's own ``%globaltimer`` measurement (``elapsed_ns``, largest over CTAs)
divided by the rounds, median over ``--repeats`` launches; the ``event_`` columns are the same from
CUDA events around the launch (launch overhead included, a cross-check). Grid sizes: powers of
two up to the SM count, and the SM count itself. The row schema of the first version is kept
(``grid``, ``block``, ``rounds``, ``ns_per_barrier``, ``event_ns_per_barrier``); the exchange
columns are added to it.
"""
from __future__ import annotations

import sys

import _study
import numpy as np

from persistent_rnn import kernels, timing

NAME = "barrier_latency"
KERNEL = "grid_barrier_rounds"
EXCHANGE_KERNEL = "exchange_rounds"
CLUSTER_KERNEL = "cluster_exchange_rounds"
MAX_CLUSTER = 16  # the largest cluster the persistent kernels use (non-portable above 8)
NO_STALL = (np.int32(-1), np.int32(-1), np.uint64(0))


def grid_sizes(sm_count: int, quick: bool) -> list[int]:
    """1, 2, 4, ... below ``sm_count``, then ``sm_count`` (only 1, 8 and all SMs when ``quick``)."""
    sizes = [1, 8, 16] if quick else [2 ** i for i in range(sm_count.bit_length()) if 2 ** i < sm_count]
    return sorted(set(sizes + [sm_count]))


def free_polls(text: str) -> tuple[int, ...]:
    """``--free-polls``: comma-separated counts, each at least 0."""
    counts = tuple(int(v) for v in text.split(",") if v.strip())
    if any(n < 0 for n in counts):
        raise ValueError(f"--free-polls: counts must be >= 0, got {text!r}")
    return counts


def _control(cp, grid: int):
    ctl = cp.zeros(2 + grid, dtype=cp.uint32)
    ctl[2:] = np.uint32(0xFFFFFFFF)  # progress[] = -1: nothing done
    return ctl


def _timed(module, kernel: str, grid: int, block: int, shared: int, args: tuple, ctl, elapsed,
           rounds: int) -> tuple[float, float]:
    """(kernel-timed, event-timed) ns per round of one launch; raises if it timed out."""
    seconds = timing.CudaEventClock().measure(lambda: module.launch(kernel, grid, block, shared, args))
    aborted = int(ctl[1].get())
    if aborted:
        raise RuntimeError(f"{kernel} timed out at grid {grid} (abort word {aborted}); grid not co-resident?")
    return float(elapsed.max().get()) / rounds, seconds * 1e9 / rounds


def _exchange(module, grid: int, block: int, rounds: int, width: int, timeout, elapsed,
              errors) -> tuple[float, float]:
    """``_timed`` of the tagged exchange of ``module`` on ``grid`` CTAs (fresh words)."""
    import cupy as cp
    length = grid * width
    words, ctl = cp.zeros((2, -(-length // 4) * 4), cp.uint32), _control(cp, grid)
    return _timed(module, EXCHANGE_KERNEL, grid, block, 0,
                  (words, ctl, np.int32(rounds), np.int32(width), timeout, *NO_STALL, elapsed,
                   errors), ctl, elapsed, rounds)


def measure(modules: dict, grid: int, block: int, rounds: int, width: int, timeout_ns: int) -> dict:
    """One launch of each protocol on ``grid`` CTAs: ns per round (kernel timer and events)."""
    import cupy as cp
    timeout = np.uint64(timeout_ns)
    elapsed = cp.zeros(grid, dtype=cp.uint64)
    ctl = _control(cp, grid)
    barrier = _timed(modules["grid"], KERNEL, grid, block, 0,
                     (ctl, np.int32(rounds), timeout, *NO_STALL, elapsed), ctl, elapsed, rounds)
    length = grid * width
    errors = cp.zeros(1, cp.uint32)
    exchange = _exchange(modules["grid"], grid, block, rounds, width, timeout, elapsed, errors)
    polls = {n: _exchange(m, grid, block, rounds, width, timeout, elapsed, errors)[0]
             for n, m in modules.get("free_polls", {}).items()}
    cluster = (None, None)
    if grid in modules.get("clusters", {}) and _cluster_fits(modules["clusters"][grid], grid, block,
                                                             length):
        ctl = _control(cp, grid)
        cluster = _timed(modules["clusters"][grid], CLUSTER_KERNEL, grid, block, 8 * -(-length // 4) * 4,
                         (ctl, np.int32(rounds), np.int32(width), timeout, *NO_STALL, elapsed, errors),
                         ctl, elapsed, rounds)
    if int(errors.get()[0]):
        raise RuntimeError(f"the exchange delivered {int(errors.get()[0])} wrong words at grid {grid}")
    return {"grid": grid, "block": block, "rounds": rounds, "width": width,
            "ns_per_barrier": barrier[0], "event_ns_per_barrier": barrier[1],
            "exchange_ns_per_round": exchange[0], "exchange_event_ns_per_round": exchange[1],
            "cluster_ns_per_round": cluster[0], "cluster_event_ns_per_round": cluster[1],
            "exchange_ns_per_round_free_polls": polls}


def _cluster_fits(module, grid: int, block: int, length: int) -> bool:
    """Whether the device holds one cluster of ``grid`` CTAs of the cluster kernel (a cluster of
    16 needs the non-portable size, which not every sm_90 part grants)."""
    try:
        return module.max_active_clusters(CLUSTER_KERNEL, grid, block, 8 * -(-length // 4) * 4) > 0
    except RuntimeError as exc:  # the occupancy query itself failed: say so, measure the rest
        print(f"cluster of {grid}: {exc}", file=sys.stderr)
        return False


def _median_row(runs: list[dict]) -> dict:
    row = dict(runs[0])
    for key, value in row.items():
        if key.endswith(("_per_barrier", "_per_round")) and value is not None:
            row[key] = float(np.median([r[key] for r in runs]))
    row["exchange_ns_per_round_free_polls"] = {
        n: float(np.median([r["exchange_ns_per_round_free_polls"][n] for r in runs]))
        for n in runs[0]["exchange_ns_per_round_free_polls"]}
    return row


def draw(ax, doc) -> None:
    """ns per round against grid size, one line per protocol (kernel timer)."""
    rows = doc["rows"]
    for key, label in (("ns_per_barrier", "counter barrier"), ("exchange_ns_per_round", "tagged exchange"),
                       ("cluster_ns_per_round", "cluster exchange (DSMEM)")):
        points = [(r["grid"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("grid size (CTAs)")
    ax.set_ylabel("ns per round (%globaltimer in kernel)")
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--width", type=int, default=8, help="words each CTA publishes per round")
    p.add_argument("--timeout-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=5, help="launches per grid size (median)")
    p.add_argument("--free-polls", type=free_polls, default=(),
                   help="comma-separated free polls to build the tagged exchange with as well "
                        "(PRNN_GRID_FREE_POLLS; the kernels' default is 2)")
    args = p.parse_args(argv)
    _study.require_gpu(NAME)
    import cupy as cp
    modules = {"grid": kernels.get_module("grid_barrier.cu", {}),
               "free_polls": {n: kernels.get_module("grid_barrier.cu", {"PRNN_GRID_FREE_POLLS": n})
                              for n in args.free_polls}}
    device = cp.cuda.Device()
    sm_count = device.attributes["MultiProcessorCount"]
    resident = min(modules["grid"].max_active_blocks(k, args.block, 0) for k in (KERNEL, EXCHANGE_KERNEL)) * sm_count
    grids = grid_sizes(sm_count, args.quick)
    if int(device.compute_capability) >= 90:
        modules["clusters"] = {g: kernels.get_module("grid_barrier.cu", {"PRNN_CLUSTER": g})
                               for g in grids if g <= MAX_CLUSTER}
    rows = []
    for grid in grids:
        if grid > resident:
            print(f"grid {grid} > {resident} co-resident CTAs: skipped", file=sys.stderr)
            continue
        rows.append(_median_row([measure(modules, grid, args.block, args.rounds, args.width,
                                         int(args.timeout_ms * 1e6)) for _ in range(args.repeats)]))
        r = rows[-1]
        cluster = "-" if r["cluster_ns_per_round"] is None else f"{r['cluster_ns_per_round']:8.1f}"
        polls = "".join(f", {n} free polls {ns:8.1f}"
                        for n, ns in r["exchange_ns_per_round_free_polls"].items())
        print(f"grid {grid:4d}: counter barrier {r['ns_per_barrier']:8.1f} ns, tagged exchange "
              f"{r['exchange_ns_per_round']:8.1f} ns{polls}, cluster {cluster} ns per round")
    settings = {"rounds": args.rounds, "block": args.block, "width": args.width,
                "free_polls": list(args.free_polls),
                "timeout_ms": args.timeout_ms, "repeats": args.repeats, "sm_count": sm_count,
                "timing": "median over launches"}
    _study.save(args.out, NAME, _study.document(settings, rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
