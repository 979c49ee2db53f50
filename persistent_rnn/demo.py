"""``python -m persistent_rnn.demo [--out DIR]``: what the library does, on any machine.

First, on NumPy: forward and backward of a small bidirectional two-layer stack per cell with
unsorted sequence lengths (shapes, what ran, timings, a gradient check against a central finite
difference). Then, on a machine without a GPU, what the library is for: the latency model's
predicted microseconds per step of the persistent kernels for typical layers on the H100 profile
beside cuDNN's recorded figures (``RECORDED``), every figure labelled predicted or measured,
and a plot of them (``DIR/demo_persistent_vs_cudnn.png``). On a GPU, ``make demo`` measures the
real thing instead (``prnn bench --quick``: persistent, GEMM and cuDNN side by side, plotted).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import persistent_rnn as prnn
from persistent_rnn.cells import CELLS, layer_args
from persistent_rnn.extras import install_hint

T, B, I, H = 16, 4, 8, 32


def _loss(layer, x, lengths, dy) -> float:
    y, _ = layer.forward(x, lengths=lengths)
    return float((y * dy).sum())


def run_cell(name: str, layer) -> str:
    """Forward, backward and a finite-difference check of one layer; one summary line."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I))
    lengths = np.array([16, 5, 11, 1])
    start = time.perf_counter()
    y, _ = layer.forward(x, lengths=lengths)
    fwd_ms = (time.perf_counter() - start) * 1e3
    forward_run = layer.last_run
    dy = rng.standard_normal(y.shape)
    start = time.perf_counter()
    dx, _ = layer.backward(dy)
    bwd_ms = (time.perf_counter() - start) * 1e3
    w = layer.params["weight_hh_l0"]
    eps, old = 1e-6, w[3, 5]
    w[3, 5] = old + eps
    up = _loss(layer, x, lengths, dy)
    w[3, 5] = old - eps
    down = _loss(layer, x, lengths, dy)
    w[3, 5] = old
    fd_err = abs((up - down) / (2 * eps) - layer.grads["weight_hh_l0"][3, 5])
    return (f"{name:9s} y {tuple(y.shape)}  dx {tuple(dx.shape)}  algo={forward_run.algo:<10s} "
            f"restarts={forward_run.restarts}  fwd {fwd_ms:6.1f} ms  bwd {bwd_ms:6.1f} ms  "
            f"|grad - finite diff| = {fd_err:.1e}")


def run_cells() -> None:
    """Print one summary line per cell."""
    print(f"persistent_rnn {prnn.__version__} demo on NumPy: T={T} B={B} input={I} hidden={H}, "
          f"2 layers, bidirectional, lengths [16, 5, 11, 1], float64")
    kw = dict(num_layers=2, bidirectional=True, dtype="float64", seed=0)
    for spec in CELLS.values():
        mode, args = layer_args(spec.name)
        print(run_cell(spec.label, getattr(prnn, mode)(I, H, **args, **kw)))


@dataclass(frozen=True)
class Layer:
    """A layer (or stack) the demo predicts: cell, sizes, dtype, number of layers."""

    cell: str
    hidden: int
    batch: int
    dtype: str = "float32"
    layers: int = 1

    @property
    def label(self) -> str:
        stack = f", {self.layers} layers" if self.layers > 1 else ""
        half = "" if self.dtype == "float32" else f" {self.dtype}"
        return f"{CELLS[self.cell].label} H={self.hidden} B={self.batch}{half}{stack}"


TYPICAL = (Layer("gru", 256, 1), Layer("lstm", 256, 1), Layer("rnn_tanh", 512, 1),
           Layer("lstm", 1024, 4), Layer("lstm", 1024, 4, "float16"),
           Layer("lstm", 384, 4, layers=4))
PROFILE = "h100"
SEQ_LEN = 100  # the recorded runs' T; the predictions include per-call terms spread over it
INPUT_SIZE = 64  # the recorded runs' input size
# cuDNN's figures as docs/benchmarks.md cites them (prnn bench, fp32, TF32 off, T=100)
RECORDED = Path("bench/results/h200-2026-11-23/bench/bench_results.json")
PASSES = ("forward", "forward_backward")


def predicted_us(layer: Layer, device: str = PROFILE) -> dict[str, float]:
    """The latency model's predicted µs per step of ``layer``'s persistent forward and
    forward+backward at ``SEQ_LEN`` steps (per-call terms included), on ``device``'s profile."""
    from . import latency
    if layer.layers == 1:
        st = latency.predict_step_time(layer.cell, layer.hidden, layer.batch, layer.dtype, device)
        return {p: st.benchmark_us(SEQ_LEN, backward=p != "forward") for p in PASSES}
    stack = latency.predict_stack_time(layer.cell, layer.hidden, layer.batch, layer.layers,
                                       SEQ_LEN, input_size=INPUT_SIZE, dtype=layer.dtype,
                                       device=device)
    fwd = stack.forward_us if stack.plan.fits else stack.apart_forward_us
    bwd = stack.backward_us if stack.plan.fits else stack.apart_backward_us
    return {"forward": fwd / SEQ_LEN, "forward_backward": (fwd + bwd) / SEQ_LEN}


def recorded_cudnn(layer: Layer, results: dict | None) -> dict[str, float]:
    """cuDNN's measured µs per step of ``layer`` in ``results`` (a ``prnn bench`` JSON), by
    pass; empty where that run has no such point."""
    found = {}
    for point in (results or {}).get("points", ()):
        if (point["algo"] == "cudnn" and point["cell"] == layer.cell
                and point["hidden_size"] == layer.hidden and point["batch"] == layer.batch
                and point["dtype"] == layer.dtype and point["seq_len"] == SEQ_LEN
                and point.get("num_layers", 1) == layer.layers):
            found[point["pass"]] = point["us_per_step"]
    return found


def _recorded_results() -> dict | None:
    """The recorded run (``RECORDED`` in the source tree this package runs from) or ``None``."""
    path = Path(__file__).resolve().parents[1] / RECORDED
    return json.loads(path.read_text()) if path.is_file() else None


def _figures(values: dict[str, float]) -> str:
    return "".join(f"{values[p]:10.1f}" if p in values else f"{'-':>10s}" for p in PASSES)


def compare(layers: tuple[Layer, ...] | None = None, device: str = PROFILE) -> list[dict]:
    """Print predicted persistent beside measured cuDNN µs per step of ``layers`` (default
    ``TYPICAL``); return the rows. (The predictions come first: without NVRTC, the
    ``ModuleNotFoundError`` leaves nothing half printed.)"""
    from . import latency
    results = _recorded_results()
    rows = []
    for layer in TYPICAL if layers is None else layers:
        try:
            predicted, note = predicted_us(layer, device), None
        except ValueError as exc:  # the planner's reason: it does not fit
            predicted, note = {}, str(exc)
        rows.append({"layer": layer.label, "predicted": predicted, "note": note,
                     "measured": recorded_cudnn(layer, results)})
    source = (f"{RECORDED} ({results['device']}, {results['date'][:10]}, prnn bench, fp32, "
              f"TF32 off, T={SEQ_LEN})" if results else
              f"not in this installation ({RECORDED} of the source tree)")
    print(f"\nWhat the GPU kernels are for, without a GPU: microseconds per step at T={SEQ_LEN}")
    print(f"  predicted = persistent kernels, latency model on the {device.upper()} profile "
          f"({latency.CALIBRATION})")
    print(f"  measured  = torch.nn on cuDNN, recorded: {source}")
    print(f"{'':30s}{'predicted persistent':>20s}   {'measured cuDNN':>20s}")
    print(f"{'layer':30s}{'forward':>10s}{'fwd+bwd':>10s}   {'forward':>10s}{'fwd+bwd':>10s}")
    for row in rows:
        print(f"{row['layer']:30s}{_figures(row['predicted'])}   {_figures(row['measured'])}")
        if row["note"]:
            print(f"  ({row['note']})")
    print("  ('-': not recorded. Predictions are not measurements; the recorded cuDNN run was on "
          "an H200, which no H100 run has repeated yet.)")
    return rows


def plot(rows: list[dict], out: Path, device: str = PROFILE) -> Path:
    """Bars of predicted persistent and measured cuDNN µs per step, one panel per pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=False)
    x = np.arange(len(rows))
    for ax, name in zip(axes, PASSES):
        for shift, kind, label, style in (
                (-0.2, "predicted", f"predicted: persistent ({device.upper()} profile)",
                 dict(hatch="//", color="tab:blue", alpha=0.6)),
                (0.2, "measured", "measured: cuDNN (recorded H200 run)",
                 dict(color="tab:orange"))):
            values = [r[kind].get(name, np.nan) for r in rows]
            ax.bar(x + shift, values, 0.4, label=label, **style)
        ax.set_xticks(x, [r["layer"] for r in rows], rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{name.replace('_', ' + ')}, T={SEQ_LEN}")
        ax.set_ylabel("µs per step (lower is better)")
        ax.set_ylim(0, 1.3 * np.nanmax([r[k].get(name, 0.0) for r in rows
                                         for k in ("predicted", "measured")] + [1.0]))
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo_persistent_vs_cudnn.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """The NumPy run, then (without a GPU) the predicted-against-recorded comparison."""
    parser = argparse.ArgumentParser(prog="python -m persistent_rnn.demo")
    parser.add_argument("--out", type=Path, default=Path("out"), help="where the plot goes")
    args = parser.parse_args(argv)
    run_cells()
    from .benchmark import gpu_available
    if gpu_available():
        print("\nA GPU is present: `prnn bench --quick` (make demo runs it next) measures the "
              "persistent kernels beside cuDNN on it.")
        return
    try:
        rows = compare()
    except ModuleNotFoundError as exc:  # the predictions compile the kernels with NVRTC
        print(f"\nNo predictions: the latency model reads the kernels' SASS, compiled with NVRTC "
              f"({exc.name} is not installed): {install_hint('cuda13')}")
        return
    try:
        print(f"wrote {plot(rows, args.out)}")
    except ModuleNotFoundError:
        print(f"no plot: {install_hint('bench')}")


if __name__ == "__main__":
    main()
