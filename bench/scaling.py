"""Data-parallel scaling study: measured per-step time plus a ring all-reduce cost model.

At a fixed global batch (512 by default) ``p`` GPUs each run a per-GPU batch ``b = global / p``.
One training step on one GPU costs the layer's forward + backward at batch ``b`` (measured with
the library: CuPy on a GPU if present, NumPy otherwise, or read from a JSON file) plus the
all-reduce of the weight gradients, modelled as a ring all-reduce::

    t_allreduce(p) = 2 (p - 1) / p * bytes / bandwidth + 2 (p - 1) * latency

Within a node (``p <= --gpus-per-node``) the ring runs over NVLink, beyond it the ring crosses
InfiniBand, whose (slower) link bounds the whole ring. With ``--overlap f`` a fraction ``f`` of the
backward pass hides all-reduce time (gradients are reduced while earlier steps still run):
``t_step = t_fwd + t_bwd + max(0, t_allreduce - f * t_bwd)``. Efficiency is the throughput of
``p`` GPUs over ``p`` times the best one-GPU throughput at any per-GPU batch of the sweep, so it
never exceeds 1 (equal to ``t_step(1) / (p * t_step(p))`` where a larger batch is never slower per
sample). See docs/scaling.md.

    python bench/scaling.py --cell lstm --hidden 1024 --out bench/results/scaling
    python bench/scaling.py --from-json bench/results/RUN/bench/bench_results.json \
        --cell lstm --hidden 1024 --algo persistent
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from persistent_rnn.benchmark import gpu_available
from persistent_rnn.cells import CELLS, layer_args

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# The layer a measurement is of, and its defaults when this script measures it.
LAYER_DEFAULTS = {"cell": "lstm", "input_size": None, "hidden_size": 1024, "num_layers": 1,
                  "bidirectional": False, "seq_len": 100, "dtype": "float32", "algo": "auto"}
FLAGS = {"cell": "--cell", "input_size": "--input-size", "hidden_size": "--hidden",
         "num_layers": "--layers", "bidirectional": "--bidirectional", "seq_len": "--seq-len",
         "dtype": "--dtype", "algo": "--algo"}


@dataclass(frozen=True)
class Fabric:
    """An interconnect for the ring all-reduce: per-GPU bus bandwidth (bytes/s), per-hop latency (s)."""

    name: str
    bandwidth: float
    latency: float


# Defaults: H100 NVLink 4 reaches ~360 GB/s NCCL bus bandwidth with a few microseconds per hop;
# one 400 Gb/s NDR InfiniBand NIC per GPU gives ~45 GB/s and ~10 us per hop across nodes.
FABRICS = {
    "nvlink": Fabric("nvlink", 360e9, 5e-6),
    "infiniband": Fabric("infiniband", 45e9, 10e-6),
}


@dataclass(frozen=True)
class StepTime:
    """Measured (or given) time of one layer's forward and backward pass at one batch size."""

    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        """Forward plus backward time."""
        return self.fwd_s + self.bwd_s


def ring_allreduce_seconds(nbytes: float, p: int, fabric: Fabric) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``p`` ranks (zero for one rank)."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    return 2 * (p - 1) / p * nbytes / fabric.bandwidth + 2 * (p - 1) * fabric.latency


def fabric_for(p: int, gpus_per_node: int, intra: Fabric, inter: Fabric) -> Fabric:
    """The fabric that bounds a ring over ``p`` GPUs: NVLink inside one node, else the network."""
    return intra if p <= gpus_per_node else inter


def step_seconds(compute: StepTime, allreduce_s: float, overlap: float) -> float:
    """One data-parallel step: compute plus the all-reduce time not hidden behind backward."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return compute.total_s + max(0.0, allreduce_s - overlap * compute.bwd_s)


def gradient_bytes(cell: str, input_size: int, hidden: int, num_layers: int,
                   bidirectional: bool, dtype: str) -> int:
    """Bytes of all weight gradients of a layer stack (torch.nn parameter shapes, with biases)."""
    gates, dirs = CELLS[cell].gates, 2 if bidirectional else 1
    count = 0
    for layer in range(num_layers):
        in_size = input_size if layer == 0 else hidden * dirs
        count += dirs * (gates * hidden * (in_size + hidden) + 2 * gates * hidden)
    return count * ITEMSIZE[dtype]


def gpu_counts(global_batch: int, min_batch: int, max_gpus: int) -> list[int]:
    """Powers of two ``p`` with ``global_batch / p`` an integer of at least ``min_batch``."""
    counts, p = [], 1
    while p <= max_gpus and global_batch % p == 0 and global_batch // p >= min_batch:
        counts.append(p)
        p *= 2
    return counts


def project(compute_at: Callable[[int], StepTime], nbytes: int, global_batch: int,
            counts: Sequence[int], gpus_per_node: int, intra: Fabric, inter: Fabric,
            overlap: float) -> list[dict]:
    """Projected step time, throughput and efficiency for each GPU count in ``counts``.

    Efficiency is ``samples/s on p GPUs / (p * best one-GPU samples/s)``, the best taken over the
    per-GPU batches of ``counts`` (compute only): at most 1, even where a smaller per-GPU batch is
    faster per sample (caches) and ``t_step(1) / (p * t_step(p))`` would pass 1.
    """
    computes = {p: compute_at(global_batch // p) for p in counts}
    best = max((global_batch // p) / computes[p].total_s for p in counts)
    rows = []
    for p in counts:
        compute = computes[p]
        fabric = fabric_for(p, gpus_per_node, intra, inter)
        allreduce = ring_allreduce_seconds(nbytes, p, fabric)
        step = step_seconds(compute, allreduce, overlap)
        rows.append({
            "gpus": p, "per_gpu_batch": global_batch // p, "fabric": fabric.name,
            "fwd_ms": compute.fwd_s * 1e3, "bwd_ms": compute.bwd_s * 1e3,
            "allreduce_ms": allreduce * 1e3, "step_ms": step * 1e3,
            "samples_per_s": global_batch / step,
            "efficiency": global_batch / step / (p * best),
        })
    return rows


def measure_layer(cell: str, input_size: int, hidden: int, num_layers: int, bidirectional: bool,
                  seq_len: int, batch: int, dtype: str, repeats: int, algo: str) -> StepTime:
    """Median forward and backward time of one persistent_rnn layer stack at ``batch``."""
    import numpy as np

    import persistent_rnn as prnn

    gpu = gpu_available()
    if gpu:
        import cupy as xp
        sync = lambda: xp.cuda.get_current_stream().synchronize()  # noqa: E731
    else:
        xp, sync = np, (lambda: None)
    mode, kwargs = layer_args(cell)
    layer = getattr(prnn, mode)(input_size, hidden, num_layers=num_layers,
                                bidirectional=bidirectional, dtype=dtype, algo=algo, seed=0, **kwargs)
    if gpu:
        layer.load_params({k: xp.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((seq_len, batch, input_size)).astype(dtype))
    dy = xp.asarray(rng.standard_normal((seq_len, batch, hidden * (2 if bidirectional else 1)))
                    .astype(dtype))
    fwd, bwd = [], []
    for _ in range(repeats + 1):  # the first run warms up (kernel build, allocator)
        sync()
        t0 = time.perf_counter()
        layer.forward(x)
        sync()
        t1 = time.perf_counter()
        layer.backward(dy)
        sync()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return StepTime(statistics.median(fwd[1:]), statistics.median(bwd[1:]))


def load_measurements(path: str | Path,
                      want: dict[str, Any] | None = None) -> tuple[dict[int, StepTime], dict]:
    """Per-batch forward/backward times read from a JSON file, and the layer they are of.

    ``want`` maps keys of ``LAYER_DEFAULTS`` to the values asked for (None or missing: any).
    Read are:

    * ``prnn bench``'s results (``points``): the points of one cell, hidden size, sequence length
      and dtype (each one the file has several of must be asked for) and one ``algo``; ``auto``
      takes, per batch, ``persistent`` where it was measured (it fits) and ``gemm`` elsewhere.
      The forward time is the ``forward`` point's, the backward time ``forward_backward`` minus
      it; batches without both are left out.
    * this script's own output (``config`` and ``measured``);
    * hand-written records: a list, or one under ``"results"`` or ``"measurements"``, each with
      ``batch`` (or ``batch_size``) and ``fwd_ms`` + ``bwd_ms``, or ``step_ms`` (split 1 : 2).

    Raises ValueError, naming the option, where the file does not hold what ``want`` asks for.
    """
    want = {key: None for key in LAYER_DEFAULTS} | (want or {})
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "points" in data:
        return _from_bench(path, data, want)
    if isinstance(data, dict) and "measured" in data and "config" in data:
        layer = {key: data["config"].get(key) for key in LAYER_DEFAULTS}
        _agree(path, layer, want)
        return {int(b): StepTime(**t) for b, t in data["measured"].items()}, layer
    records = data if isinstance(data, list) else data.get("results", data.get("measurements"))
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: neither prnn bench results, this script's output nor a list of "
                         f"records under 'results' or 'measurements'")
    layer = {key: LAYER_DEFAULTS[key] if want[key] is None else want[key] for key in want}
    return {_batch(path, rec): _record_time(path, rec) for rec in records}, layer


def _batch(path: str | Path, rec: dict) -> int:
    batch = rec.get("batch", rec.get("batch_size"))
    if batch is None:
        raise ValueError(f"{path}: record without 'batch' or 'batch_size': {rec}")
    return int(batch)


def _record_time(path: str | Path, rec: dict) -> StepTime:
    if "fwd_ms" in rec and "bwd_ms" in rec:
        return StepTime(rec["fwd_ms"] / 1e3, rec["bwd_ms"] / 1e3)
    if "step_ms" in rec:
        return StepTime(rec["step_ms"] / 3e3, 2 * rec["step_ms"] / 3e3)
    raise ValueError(f"{path}: record needs 'fwd_ms' and 'bwd_ms' or 'step_ms': {rec}")


def _agree(path: str | Path, layer: dict, want: dict) -> None:
    """ValueError where an option asks for another layer than the file's."""
    for key, value in want.items():
        if value is not None and layer.get(key) is not None and layer[key] != value:
            raise ValueError(f"{path} measured {key} {layer[key]!r}, but {FLAGS[key]} asks for "
                             f"{value!r}")


def _from_bench(path: str | Path, data: dict, want: dict) -> tuple[dict[int, StepTime], dict]:
    """``load_measurements`` for ``prnn bench``'s results (one layer, one direction)."""
    layer = {"input_size": data.get("settings", {}).get("input_size"), "num_layers": 1,
             "bidirectional": False}
    _agree(path, layer, want)
    points = data["points"]
    for key in ("cell", "hidden_size", "seq_len", "dtype"):
        values = sorted({p[key] for p in points})
        chosen = want[key]
        if chosen is None and len(values) == 1:
            chosen = values[0]
        if chosen is None or chosen not in values:
            raise ValueError(f"{path} has points for {key} {', '.join(map(str, values))}: choose "
                             f"one with {FLAGS[key]}")
        points = [p for p in points if p[key] == chosen]
        layer[key] = chosen
    layer["algo"] = want["algo"] or "auto"
    seconds = {(p["algo"], p["pass"], p["batch"]): p["us_per_step"] * p["seq_len"] / 1e6
               for p in points}
    measured = {}
    for batch in sorted({p["batch"] for p in points}):
        for algo in ("persistent", "gemm") if layer["algo"] == "auto" else (layer["algo"],):
            fwd = seconds.get((algo, "forward", batch))
            both = seconds.get((algo, "forward_backward", batch))
            if fwd is not None and both is not None:
                measured[batch] = StepTime(fwd, max(both - fwd, 0.0))
                break
    if not measured:
        algos = sorted({p["algo"] for p in points})
        raise ValueError(f"{path} has no batch with forward and forward_backward points of algo "
                         f"{layer['algo']!r} for this layer (it has {', '.join(algos)}): choose "
                         f"one with --algo")
    return measured, layer


def interpolate(measured: dict[int, StepTime]) -> Callable[[int], StepTime]:
    """Step time at any batch inside the measured range, linear between measured batches."""
    batches = sorted(measured)

    def at(b: int) -> StepTime:
        if b in measured:
            return measured[b]
        if not batches[0] <= b <= batches[-1]:
            raise ValueError(f"batch {b} is outside the measured range {batches[0]}..{batches[-1]}")
        hi = next(x for x in batches if x > b)
        lo = max(x for x in batches if x < b)
        w = (b - lo) / (hi - lo)
        return StepTime((1 - w) * measured[lo].fwd_s + w * measured[hi].fwd_s,
                        (1 - w) * measured[lo].bwd_s + w * measured[hi].bwd_s)
    return at


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Efficiency and step-time breakdown against the GPU count, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = [r["gpus"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(p, [100 * r["efficiency"] for r in rows], "o-")
    left.set(xscale="log", xlabel="GPUs (global batch fixed)", ylabel="scaling efficiency (%)",
             ylim=(0, 105), title="strong-scaling efficiency")
    compute = [r["fwd_ms"] + r["bwd_ms"] for r in rows]
    exposed = [r["step_ms"] - c for r, c in zip(rows, compute)]
    labels = [f"{r['gpus']}\nb={r['per_gpu_batch']}" for r in rows]
    right.bar(labels, compute, label="fwd + bwd")
    right.bar(labels, exposed, bottom=compute, label="exposed all-reduce")
    right.set(ylabel="ms per step", title="step time")
    right.tick_params(axis="x", labelsize=7)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/scaling.py", description=__doc__.split("\n\n")[0])
    layer = ap.add_argument_group(
        "the layer", "measured with these (defaults: lstm, H=1024, T=100, float32, input size H, "
        "1 layer, algo auto); with --from-json they pick the measurements from the file")
    layer.add_argument("--cell", choices=sorted(CELLS))
    layer.add_argument("--input-size", type=int, help="default: the hidden size")
    layer.add_argument("--hidden", dest="hidden_size", type=int)
    layer.add_argument("--layers", dest="num_layers", type=int)
    layer.add_argument("--bidirectional", action="store_true", default=None)
    layer.add_argument("--seq-len", type=int)
    layer.add_argument("--dtype", choices=sorted(ITEMSIZE))
    layer.add_argument("--algo", help="persistent_rnn algo (auto, persistent, gemm; or cudnn in a "
                                      "prnn bench file)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--global-batch", type=int,
                    help="default 512; with --from-json the largest batch in the file")
    ap.add_argument("--min-batch", type=int, default=2, help="smallest per-GPU batch")
    ap.add_argument("--max-gpus", type=int, default=256)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    for name, fab in FABRICS.items():
        ap.add_argument(f"--{name}-bandwidth", type=float, default=fab.bandwidth, help="bytes/s")
        ap.add_argument(f"--{name}-latency", type=float, default=fab.latency, help="seconds per hop")
    ap.add_argument("--overlap", type=float, default=0.0,
                    help="fraction of backward that hides all-reduce time (0..1)")
    ap.add_argument("--from-json", help="read per-batch times from this JSON instead of measuring: "
                                        "prnn bench's results, this script's output or records")
    ap.add_argument("--out", default="bench/results/scaling", help="writes OUT.json and OUT.png")
    return ap


def _counts(global_batch: int, min_batch: int, max_gpus: int) -> list[int]:
    counts = gpu_counts(global_batch, min_batch, max_gpus)
    if not counts:
        raise ValueError(f"--global-batch {global_batch} admits no per-GPU batch >= "
                         f"--min-batch {min_batch}")
    return counts


def _measure(args: argparse.Namespace, want: dict) -> tuple[dict[int, StepTime], dict, str, int]:
    """Measurements (read or taken), their layer, where they come from, and the global batch."""
    if args.from_json:
        measured, layer = load_measurements(args.from_json, want)
        global_batch = args.global_batch or max(measured)
        _counts(global_batch, args.min_batch, args.max_gpus)
        return measured, layer, f"json:{args.from_json}", global_batch
    layer = {key: LAYER_DEFAULTS[key] if value is None else value for key, value in want.items()}
    layer["input_size"] = layer["input_size"] or layer["hidden_size"]
    global_batch = args.global_batch or 512
    batches = sorted({global_batch // p for p in _counts(global_batch, args.min_batch, args.max_gpus)})
    measured = {b: measure_layer(layer["cell"], layer["input_size"], layer["hidden_size"],
                                 layer["num_layers"], layer["bidirectional"], layer["seq_len"], b,
                                 layer["dtype"], args.repeats, layer["algo"]) for b in batches}
    return measured, layer, "cupy" if gpu_available() else "numpy", global_batch


def study(args: argparse.Namespace) -> list[dict]:
    """Measure or read, project, write OUT.json and OUT.png, print one line per GPU count."""
    want = {key: getattr(args, key) for key in LAYER_DEFAULTS}
    measured, layer, source, global_batch = _measure(args, want)
    layer["input_size"] = layer["input_size"] or layer["hidden_size"]
    counts = _counts(global_batch, max(args.min_batch, min(measured)), args.max_gpus)
    fabrics = {name: Fabric(name, getattr(args, f"{name}_bandwidth"), getattr(args, f"{name}_latency"))
               for name in FABRICS}
    nbytes = gradient_bytes(layer["cell"], layer["input_size"], layer["hidden_size"],
                            layer["num_layers"], layer["bidirectional"], layer["dtype"])
    rows = project(interpolate(measured), nbytes, global_batch, counts, args.gpus_per_node,
                   fabrics["nvlink"], fabrics["infiniband"], args.overlap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {**{k: v for k, v in vars(args).items() if k != "out"}, **layer,
              "global_batch": global_batch}
    report = {"config": config, "source": source, "gradient_bytes": nbytes,
              "fabrics": {k: asdict(v) for k, v in fabrics.items()},
              "measured": {str(b): asdict(t) for b, t in sorted(measured.items())},
              "projection": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (f"{layer['cell']} H={layer['hidden_size']} T={layer['seq_len']} {layer['dtype']} "
             f"{layer['algo']}, global batch {global_batch}, overlap {args.overlap:g} ({source})")
    plot(rows, title, out.with_suffix(".png"))
    for r in rows:
        print(f"{r['gpus']:4d} GPUs  b={r['per_gpu_batch']:4d}  {r['fabric']:10s} "
              f"step {r['step_ms']:9.3f} ms  all-reduce {r['allreduce_ms']:8.3f} ms  "
              f"eff {100 * r['efficiency']:5.1f} %")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the study from the command line; returns the projected rows.

    Files that cannot be read or do not hold what was asked for end with a one-line error
    (``SystemExit(2)``), not a traceback."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return study(args)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    main()
