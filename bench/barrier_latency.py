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

``--anatomy`` (an experiment, about a second of GPU time): the parts of a round side by side at
grid sizes 1 and 16 (``ANATOMY``: each kernel of grid_barrier.cu that takes one suspect out of the
tagged and the cluster exchange, beside the full round it is part of) and the polling
machinery's own costs (``timer_probe``: a ``%globaltimer`` read, its tick, a ``__nanosleep(20)``
back-off); writes ``round_anatomy.json`` and prints the table. ``--cpu``: the same in the
emulation at 1 and 4 CTAs, a few rounds (a check of the plumbing; its figures mean nothing).

Each figure is the kernel's own ``%globaltimer`` measurement (``elapsed_ns``, largest over CTAs)
divided by the rounds, median over ``--repeats`` launches; the ``event_`` columns are the same from
CUDA events around the launch (launch overhead included, a cross-check). Grid sizes: powers of
two up to the SM count, and the SM count itself. The row schema of the first version is kept
(``grid``, ``block``, ``rounds``, ``ns_per_barrier``, ``event_ns_per_barrier``); the exchange
columns are added to it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import _study
import numpy as np

from persistent_rnn import emulate, kernels, timing

NAME = "barrier_latency"
KERNEL = "grid_barrier_rounds"
EXCHANGE_KERNEL = "exchange_rounds"
CLUSTER_KERNEL = "cluster_exchange_rounds"
MAX_CLUSTER = 16  # the largest cluster the persistent kernels use (non-portable above 8)
NO_STALL = (np.int32(-1), np.int32(-1), np.uint64(0))


ANATOMY_NAME = "round_anatomy"


@dataclass(frozen=True)
class Part:
    """One measurement of ``--anatomy``: ``kernel`` on ``block`` threads (None: ``--block``) per
    CTA; ``path`` says its arguments and build - "grid" (the exchange's, words in global memory),
    "quad" (one quad per CTA), "cluster" (the cluster exchange's, built with ``PRNN_CLUSTER`` =
    grid), "cluster_barrier" (a word carried), "cluster_bare" (nothing) - and so which full round
    it is set beside (``exchange``, or ``cluster`` for the cluster's); ``isolates``: what it takes
    out of that round."""

    name: str
    kernel: str
    block: int | None
    path: str
    isolates: str

    @property
    def cluster(self) -> bool:
        return self.path.startswith("cluster")


ANATOMY = (
    Part("exchange", EXCHANGE_KERNEL, None, "grid",
         "the full round (hardware.EXCHANGE_ROUND_NS): --block threads, --width words a CTA"),
    Part("exchange_1warp", EXCHANGE_KERNEL, 32, "grid",
         "one warp a CTA: the block barrier no longer waits for other warps"),
    Part("exchange_warp_vote", "exchange_warp_rounds", 32, "grid",
         "one warp meeting by __syncwarp + vote.any: no bar.red at all"),
    Part("quad", "quad_rounds", 1, "quad",
         "one thread, one 16-byte relaxed store, polls that never sleep: the words' way via L2"),
    Part("quad_acquire", "quad_acquire_rounds", 1, "quad",
         "the same with st.release / ld.acquire: the fences the tagged words avoid"),
    Part("cluster", CLUSTER_KERNEL, None, "cluster",
         "the full cluster round (hardware.CLUSTER_ROUND_NS)"),
    Part("cluster_1warp", CLUSTER_KERNEL, 32, "cluster", "one warp a CTA"),
    Part("cluster_local", "cluster_exchange_local_rounds", None, "cluster",
         "own copy by st.shared::cta, not mapa + st.shared::cluster"),
    Part("cluster_barrier", "cluster_barrier_rounds", None, "cluster_barrier",
         "barrier.cluster arrive.release + wait.acquire, one word carried"),
    Part("cluster_barrier_relaxed", "cluster_barrier_relaxed_rounds", None, "cluster_bare",
         "the same barrier, arrive.relaxed, nothing carried: without the release's GPU fence"),
)
ANATOMY_GRIDS = (1, 16)
CPU_GRIDS, CPU_ROUNDS, CPU_BLOCK = (1, 4), 20, 64
TIMER_WORDS = 4  # timer_probe's out[]: reads' ns, smallest step, nonzero steps, back-offs' ns


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


class Machine:
    """Where ``--anatomy`` runs: the GPU (CuPy arrays, NVRTC modules) or the emulation (NumPy,
    g++ builds; ``cpu``)."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        if cpu:
            self.xp, self.get_module = np, emulate.get_module
        else:
            import cupy
            self.xp, self.get_module = cupy, kernels.get_module

    def host(self, array) -> np.ndarray:
        return array if self.cpu else array.get()

    def cluster_fits(self, module, part: Part, grid: int, block: int, shared: int) -> bool:
        """Whether one cluster of ``grid`` CTAs of ``part`` fits (the emulation runs any)."""
        if self.cpu:
            return True
        try:
            return module.max_active_clusters(part.kernel, grid, block, shared) > 0
        except RuntimeError as exc:
            print(f"{part.name} at {grid} CTAs: {exc}", file=sys.stderr)
            return False


def part_arguments(m: Machine, part: Part, grid: int, rounds: int, width: int, timeout_ns: int,
                   elapsed, errors, stall: tuple = NO_STALL) -> tuple[tuple, int, object]:
    """(arguments, dynamic shared bytes, control words or None) of one launch of ``part``
    (``stall``: the exchanges' injected stall, (block, round, ns); the tests')."""
    xp = m.xp
    ctl = _control(xp, grid)
    timeout, length = np.uint64(timeout_ns), grid * width
    quads = -(-length // 4) * 4
    if part.path == "grid":
        return ((xp.zeros((2, quads), xp.uint32), ctl, np.int32(rounds), np.int32(width), timeout,
                 *stall, elapsed, errors), 0, ctl)
    if part.path == "quad":
        return ((xp.zeros((2, 4 * grid), xp.uint32), ctl, np.int32(rounds), timeout, elapsed,
                 errors), 0, ctl)
    if part.path == "cluster":
        return ((ctl, np.int32(rounds), np.int32(width), timeout, *stall, elapsed, errors),
                8 * quads, ctl)
    if part.path == "cluster_barrier":
        return (np.int32(rounds), elapsed, errors), 8, None  # its word's two slots
    return (np.int32(rounds), elapsed), 0, None


def measure_part(m: Machine, module, part: Part, grid: int, block: int, rounds: int, width: int,
                 timeout_ns: int) -> float | None:
    """ns per round of one launch of ``part`` on ``grid`` CTAs (largest CTA's %globaltimer over
    ``rounds``); None where its cluster does not fit. Raises where it timed out or delivered a
    wrong value."""
    elapsed, errors = m.xp.zeros(grid, m.xp.uint64), m.xp.zeros(1, m.xp.uint32)
    args, shared, ctl = part_arguments(m, part, grid, rounds, width, timeout_ns, elapsed, errors)
    if part.cluster and not m.cluster_fits(module, part, grid, block, shared):
        return None
    module.launch(part.kernel, grid, block, shared, args)
    if ctl is not None and int(m.host(ctl)[1]):
        raise RuntimeError(f"{part.kernel} timed out at grid {grid} (abort word {int(m.host(ctl)[1])})")
    if ctl is not None and (m.host(ctl)[2:].view(np.int32) != rounds - 1).any():
        raise RuntimeError(f"{part.kernel} at grid {grid}: not every CTA did its {rounds} rounds")
    if int(m.host(errors)[0]):
        raise RuntimeError(f"{part.kernel} delivered {int(m.host(errors)[0])} wrong values at grid {grid}")
    return float(m.host(elapsed).max()) / rounds


def timer_costs(m: Machine, module, rounds: int) -> dict:
    """timer_probe on one thread: ns per %globaltimer read, its smallest and mean nonzero step,
    ns per prnn_backoff (``__nanosleep(20)``)."""
    out = m.xp.zeros(TIMER_WORDS, m.xp.uint64)
    module.launch("timer_probe", 1, 1, 0, (np.int32(rounds), out))
    reads_ns, smallest, steps, backoffs_ns = (int(v) for v in m.host(out))
    return {"part": "timer", "rounds": rounds, "read_ns": reads_ns / rounds,
            "tick_min_ns": smallest if steps else None,
            "tick_mean_ns": reads_ns / steps if steps else None, "backoff_ns": backoffs_ns / rounds}


def anatomy_rows(m: Machine, grids: tuple[int, ...], block: int, rounds: int, width: int,
                 timeout_ns: int, repeats: int, clusters: bool) -> list[dict]:
    """A row per part and grid size (median over ``repeats`` launches; the cluster parts where
    ``clusters``), then the timer's row. A part that fails has its error in its row (``ns_per_round``
    None) and the others still run: a GPU slot is rare."""
    grid_module = m.get_module("grid_barrier.cu", {})
    rows = []
    for grid in grids:
        cluster_module = m.get_module("grid_barrier.cu", {"PRNN_CLUSTER": grid}) if clusters else None
        for part in ANATOMY:
            if part.cluster and cluster_module is None:
                continue
            threads = part.block or block
            row = {"part": part.name, "kernel": part.kernel, "grid": grid, "block": threads,
                   "width": width if part.path in ("grid", "cluster") else None,
                   "rounds": rounds, "ns_per_round": None}
            try:
                runs = [measure_part(m, cluster_module if part.cluster else grid_module, part,
                                     grid, threads, rounds, width, timeout_ns) for _ in range(repeats)]
                row["ns_per_round"] = None if None in runs else float(np.median(runs))
            except Exception as exc:  # noqa: BLE001 -- recorded and printed; the rest still run
                row["error"] = f"{type(exc).__name__}: {exc}"
                print(f"{part.name} at {grid} CTAs: {row['error']}", file=sys.stderr)
            rows.append(row)
    rows.append(timer_costs(m, grid_module, rounds))
    return rows


def anatomy_table(rows: list[dict]) -> str:
    """The parts beside the full round of their path (grid: ``exchange``, cluster: ``cluster``)
    at each grid size, in ns per round and as a share of that round; the timer's costs below."""
    grids = sorted({r["grid"] for r in rows if "grid" in r})
    ns = {(r["part"], r["grid"]): r["ns_per_round"] for r in rows if "grid" in r}
    lines = [f"{'part':24}" + "".join(f"{f'grid {g}':>17}" for g in grids) + "  isolates"]
    for part in ANATOMY:
        if not any((part.name, g) in ns for g in grids):
            continue
        full = "cluster" if part.cluster else "exchange"
        cells = []
        for g in grids:
            value, whole = ns.get((part.name, g)), ns.get((full, g))
            share = f" ({value / whole:4.0%})" if value is not None and whole else "       "
            cells.append(f"{'-':>10}       " if value is None else f"{value:10.1f}{share}")
        lines.append(f"{part.name:24}" + "".join(cells) + f"  {part.isolates}")
    t = next(r for r in rows if r["part"] == "timer")
    tick = "-" if t["tick_min_ns"] is None else f"{t['tick_min_ns']} ns, mean {t['tick_mean_ns']:.1f} ns"
    lines.append(f"timer: a %globaltimer read {t['read_ns']:.1f} ns, its step {tick}; "
                 f"prnn_backoff (__nanosleep(20)) {t['backoff_ns']:.1f} ns")
    return "\n".join(lines)


def draw_anatomy(ax, doc) -> None:
    """ns per round of each part, a bar per grid size."""
    rows = [r for r in doc["rows"] if r.get("ns_per_round") is not None]
    grids = sorted({r["grid"] for r in rows})
    names = [p.name for p in ANATOMY if any(r["part"] == p.name for r in rows)]
    width = 0.8 / max(len(grids), 1)
    for i, grid in enumerate(grids):
        got = {r["part"]: r["ns_per_round"] for r in rows if r["grid"] == grid}
        ax.barh([k + i * width for k in range(len(names))], [got.get(n, 0.0) for n in names],
                height=width, label=f"{grid} CTAs")
    ax.set_yticks([k + width * (len(grids) - 1) / 2 for k in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ns per round (%globaltimer in kernel)")
    ax.legend(fontsize=8)


def run_anatomy(args) -> int:
    """``--anatomy``: the parts' rows, the table printed, ``round_anatomy.json`` (and .png)."""
    m = Machine(args.cpu)
    if args.cpu:
        grids, rounds, block, clusters = CPU_GRIDS, min(args.rounds, CPU_ROUNDS), CPU_BLOCK, True
    else:
        import cupy as cp
        device = cp.cuda.Device()
        grids = tuple(g for g in ANATOMY_GRIDS if g <= device.attributes["MultiProcessorCount"])
        rounds, block, clusters = args.rounds, args.block, int(device.compute_capability) >= 90
    rows = anatomy_rows(m, grids, block, rounds, args.width, int(args.timeout_ms * 1e6),
                        args.repeats, clusters)
    print(anatomy_table(rows))
    settings = {"anatomy": True, "cpu": args.cpu, "grids": list(grids), "rounds": rounds,
                "block": block, "width": args.width, "timeout_ms": args.timeout_ms,
                "repeats": args.repeats,
                "timing": "%globaltimer in the kernel, largest CTA / rounds, median over launches",
                "isolates": {p.name: p.isolates for p in ANATOMY}}
    doc = _study.document(settings, rows, gpu=not args.cpu)
    _study.save(args.out, ANATOMY_NAME, doc, draw_anatomy)
    return 1 if any("error" in r for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU (but for ``--anatomy --cpu``)."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--rounds", type=int, default=20000)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--width", type=int, default=8, help="words each CTA publishes per round")
    p.add_argument("--timeout-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=5, help="launches per grid size (median)")
    p.add_argument("--free-polls", type=free_polls, default=(),
                   help="comma-separated free polls to build the tagged exchange with as well "
                        "(PRNN_GRID_FREE_POLLS; the kernels' default is 2)")
    p.add_argument("--anatomy", action="store_true",
                   help="the parts of a round beside the full round, at 1 and 16 CTAs")
    p.add_argument("--cpu", action="store_true",
                   help="with --anatomy: the emulation, 1 and 4 CTAs, a few rounds")
    args = p.parse_args(argv)
    if args.cpu and not args.anatomy:
        p.error("--cpu runs --anatomy only (the other figures need a GPU)")
    if args.anatomy:
        if not args.cpu:
            _study.require_gpu(NAME)
        return run_anatomy(args)
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
