"""Data-parallel scaling study: measured per-step time plus a ring all-reduce cost model.

At a fixed global batch (512 by default) ``p`` GPUs each run a per-GPU batch ``b = global / p``.
One training step on one GPU costs the layer's forward + backward at batch ``b`` (measured with
the library: CuPy on a GPU if present, NumPy otherwise, or read from a JSON file) plus the
all-reduce of the weight gradients, modelled as a ring all-reduce::

    t_allreduce(p) = 2 (p - 1) / p * bytes / bandwidth + 2 (p - 1) * latency

Within a node (``p <= --gpus-per-node``) the ring runs over NVLink, beyond it the ring crosses
InfiniBand, whose (slower) link bounds the whole ring. With ``--overlap f`` a fraction ``f`` of the
backward pass hides all-reduce time (gradients are reduced while earlier steps still run):
``t_step = t_fwd + t_bwd + max(0, t_allreduce - f * t_bwd)``. Efficiency is the strong-scaling
efficiency ``t_step(1) / (p * t_step(p))``. See docs/scaling.md.

    python bench/scaling.py --cell lstm --hidden 1024 --out bench/results/scaling
    python bench/scaling.py --from-json bench/results/some_bench.json --hidden 1024
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

GATES = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


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
    gates, dirs = GATES[cell], 2 if bidirectional else 1
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
    """Projected step time, throughput and efficiency for each GPU count in ``counts``."""
    rows, base = [], None
    for p in counts:
        compute = compute_at(global_batch // p)
        fabric = fabric_for(p, gpus_per_node, intra, inter)
        allreduce = ring_allreduce_seconds(nbytes, p, fabric)
        step = step_seconds(compute, allreduce, overlap)
        base = step if p == 1 else base
        rows.append({
            "gpus": p, "per_gpu_batch": global_batch // p, "fabric": fabric.name,
            "fwd_ms": compute.fwd_s * 1e3, "bwd_ms": compute.bwd_s * 1e3,
            "allreduce_ms": allreduce * 1e3, "step_ms": step * 1e3,
            "samples_per_s": global_batch / step,
            "efficiency": base / (p * step) if base is not None else None,
        })
    return rows


def _gpu_present() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver or no device: measure on the CPU
        return False


def measure_layer(cell: str, input_size: int, hidden: int, num_layers: int, bidirectional: bool,
                  seq_len: int, batch: int, dtype: str, repeats: int, algo: str) -> StepTime:
    """Median forward and backward time of one persistent_rnn layer stack at ``batch``."""
    import numpy as np

    import persistent_rnn as prnn

    gpu = _gpu_present()
    if gpu:
        import cupy as xp
        sync = lambda: xp.cuda.get_current_stream().synchronize()  # noqa: E731
    else:
        xp, sync = np, (lambda: None)
    mode = "RNN" if cell.startswith("rnn") else cell.upper()
    kwargs = {"nonlinearity": cell[4:]} if mode == "RNN" else {}
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


def load_measurements(path: str | Path) -> dict[int, StepTime]:
    """Read per-batch forward/backward times from a bench results JSON.

    Accepted: a list of records, or an object whose ``"results"`` or ``"measurements"`` is one.
    Each record has ``batch`` (or ``batch_size``) and either ``fwd_ms`` and ``bwd_ms`` or
    ``step_ms`` (forward + backward, split 1:2 as for GEMM-bound recurrences).
    """
    data = json.loads(Path(path).read_text())
    records = data if isinstance(data, list) else data.get("results", data.get("measurements"))
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: expected a list of records under 'results' or 'measurements'")
    out = {}
    for rec in records:
        batch = rec.get("batch", rec.get("batch_size"))
        if batch is None:
            raise ValueError(f"{path}: record without 'batch' or 'batch_size': {rec}")
        if "fwd_ms" in rec and "bwd_ms" in rec:
            out[int(batch)] = StepTime(rec["fwd_ms"] / 1e3, rec["bwd_ms"] / 1e3)
        elif "step_ms" in rec:
            out[int(batch)] = StepTime(rec["step_ms"] / 3e3, 2 * rec["step_ms"] / 3e3)
        else:
            raise ValueError(f"{path}: record needs 'fwd_ms' and 'bwd_ms' or 'step_ms': {rec}")
    return out


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", choices=sorted(GATES), default="lstm")
    ap.add_argument("--input-size", type=int, default=None, help="default: --hidden")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--bidirectional", action="store_true")
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32")
    ap.add_argument("--algo", default="auto", help="persistent_rnn algo for the measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--min-batch", type=int, default=2, help="smallest per-GPU batch")
    ap.add_argument("--max-gpus", type=int, default=256)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    for name, fab in FABRICS.items():
        ap.add_argument(f"--{name}-bandwidth", type=float, default=fab.bandwidth, help="bytes/s")
        ap.add_argument(f"--{name}-latency", type=float, default=fab.latency, help="seconds per hop")
    ap.add_argument("--overlap", type=float, default=0.0,
                    help="fraction of backward that hides all-reduce time (0..1)")
    ap.add_argument("--from-json", help="read per-batch times from this JSON instead of measuring")
    ap.add_argument("--out", default="bench/results/scaling", help="writes OUT.json and OUT.png")
    return ap


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the study from the command line; returns the projected rows."""
    args = _parser().parse_args(argv)
    input_size = args.input_size or args.hidden
    counts = gpu_counts(args.global_batch, args.min_batch, args.max_gpus)
    if not counts:
        raise ValueError(f"--global-batch {args.global_batch} admits no per-GPU batch >= "
                         f"--min-batch {args.min_batch}")
    batches = sorted({args.global_batch // p for p in counts})
    if args.from_json:
        measured, source = load_measurements(args.from_json), f"json:{args.from_json}"
    else:
        measured = {b: measure_layer(args.cell, input_size, args.hidden, args.layers,
                                     args.bidirectional, args.seq_len, b, args.dtype,
                                     args.repeats, args.algo) for b in batches}
        source = "cupy" if _gpu_present() else "numpy"
    fabrics = {name: Fabric(name, getattr(args, f"{name}_bandwidth"), getattr(args, f"{name}_latency"))
               for name in FABRICS}
    nbytes = gradient_bytes(args.cell, input_size, args.hidden, args.layers, args.bidirectional,
                            args.dtype)
    rows = project(interpolate(measured), nbytes, args.global_batch, counts, args.gpus_per_node,
                   fabrics["nvlink"], fabrics["infiniband"], args.overlap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = {"config": config, "source": source, "gradient_bytes": nbytes,
              "fabrics": {k: asdict(v) for k, v in fabrics.items()},
              "measured": {str(b): asdict(t) for b, t in sorted(measured.items())},
              "projection": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    title = (f"{args.cell} H={args.hidden} T={args.seq_len} {args.dtype}, global batch "
             f"{args.global_batch}, overlap {args.overlap:g} ({source})")
    plot(rows, title, out.with_suffix(".png"))
    for r in rows:
        print(f"{r['gpus']:4d} GPUs  b={r['per_gpu_batch']:4d}  {r['fabric']:10s} "
              f"step {r['step_ms']:9.3f} ms  all-reduce {r['allreduce_ms']:8.3f} ms  "
              f"eff {100 * r['efficiency']:5.1f} %")
    return rows


if __name__ == "__main__":
    main()
