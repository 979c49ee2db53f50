"""Print a short summary of a bench/run_gpu_suite.sh output directory.

    python bench/summarize.py DIR

Reads what is there (missing files are reported, not fatal): the device and fp32 peak; for every
``prnn bench`` run under DIR (``*/bench_results.json``: the full sweep, the 16-bit, projection,
stack and GEMM-graph runs) the best TFLOP/s per algorithm at batch 1, 4 and 8, the algorithms'
µs per step side by side, and each persistent point's measured µs per step beside the latency
model's prediction with the relative error (median and worst over the run) - a prediction, not a
measurement; issue 17's targets over all runs (met or missed, with the points that miss); the
exchange floor (counter barrier, tagged exchange, cluster), the exchange round's parts
(``round_anatomy.json``) and the restart cost.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from barrier_latency import anatomy_table  # (bench/ is the script's folder)

ALGO_ORDER = ("persistent", "gemm", "prnn_torch", "cudnn")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"  {path.name}: not available ({type(exc).__name__})")
        return None


def bench_lines(results: dict) -> list[str]:
    """Best TFLOP/s per (pass, batch, algo) over cells and hidden sizes, with the peak fraction."""
    lines = []
    for pass_ in ("forward", "forward_backward"):
        for batch in (1, 4, 8):
            best: dict[str, dict] = {}
            for p in (p for p in results["points"] if p["pass"] == pass_ and p["batch"] == batch):
                if p["tflops"] > best.get(p["algo"], {"tflops": -1.0})["tflops"]:
                    best[p["algo"]] = p
            cells = ", ".join(f"{a} {p['tflops']:.2f} ({p['cell']} H={p['hidden_size']}"
                              + (f", {100 * p['peak_fraction']:.1f}% peak)" if p["peak_fraction"] else ")")
                              for a, p in sorted(best.items()))
            lines.append(f"  {pass_:16} B={batch}: {cells or '-'}")
    return lines


def _shape(p: dict) -> tuple:
    """What identifies a layer and pass, whatever algorithm ran it."""
    return (p["cell"], p["pass"], p.get("dtype", "float32"), p["hidden_size"], p.get("proj_size", 0),
            p.get("num_layers", 1), p["seq_len"], p["batch"])


def _label(shape: tuple) -> str:
    cell, pass_, dtype, hidden, proj, layers, seq_len, batch = shape
    return (f"{cell} {pass_} {dtype} H={hidden}" + (f" P={proj}" if proj else "")
            + (f" L={layers}" if layers > 1 else "") + f" T={seq_len} B={batch}")


def side_by_side_lines(results: dict) -> list[str]:
    """µs per step of every algorithm measured at each shape (a '!' after a figure whose calls
    restarted or fell back), and persistent over cuDNN."""
    table: dict[tuple, dict[str, float]] = {}
    marked: set[tuple] = set()
    for p in results["points"]:
        table.setdefault(_shape(p), {})[p["algo"]] = p["us_per_step"]
        if p.get("restarts") or p.get("fallback"):
            marked.add((_shape(p), p["algo"]))
    lines = []
    for shape, by_algo in sorted(table.items()):
        algos = "  ".join(f"{a} {by_algo[a]:8.2f}" + ("!" if (shape, a) in marked else "")
                          for a in ALGO_ORDER if a in by_algo)
        ratio = (f"  persistent/cudnn {by_algo['persistent'] / by_algo['cudnn']:.2f}x"
                 if {"persistent", "cudnn"} <= set(by_algo) else "")
        lines.append(f"    {_label(shape):52} {algos}{ratio}")
    return lines


def prediction_lines(results: dict) -> list[str]:
    """Measured against predicted µs per step of every persistent point that has a prediction,
    with the relative error (predicted - measured) / measured, and its median and worst |error|."""
    lines, errors = [], []
    for p in sorted(results["points"], key=_shape):
        predicted = p.get("predicted_us_per_step")
        if p["algo"] != "persistent" or predicted is None:
            continue
        error = (predicted - p["us_per_step"]) / p["us_per_step"]
        errors.append(abs(error))
        lines.append(f"    {_label(_shape(p)):52} measured {p['us_per_step']:8.2f}  "
                     f"predicted {predicted:8.2f}  error {100 * error:+6.1f}%")
    unpredicted = {p.get("prediction_note") for p in results["points"]
                   if p["algo"] == "persistent" and p.get("predicted_us_per_step") is None}
    if errors:
        lines.insert(0, f"  latency model (a prediction, persistent_rnn.latency) vs measured, "
                        f"us/step: median |error| {100 * statistics.median(errors):.1f}%, "
                        f"worst {100 * max(errors):.1f}% over {len(errors)} points")
    lines += [f"  no prediction: {note}" for note in sorted(n for n in unpredicted if n)]
    return lines


def bench_run_lines(path: Path, results: dict) -> list[str]:
    """Everything printed for one ``prnn bench`` results file."""
    settings = results.get("settings", {})
    graphs = settings.get("prnn_settings", {}).get("gemm_graphs")
    head = (f"  {path.parent.name}: {len(results['points'])} points, {len(results['skipped'])} skipped"
            f" ({settings.get('dtype', 'float32')}"
            + (f", gemm_graphs {'on' if graphs else 'off'}" if graphs is not None else "")
            + f"; commit {str(results.get('commit', '?'))[:12]}); best TFLOP/s:")
    return [head, *bench_lines(results), "  us/step side by side:", *side_by_side_lines(results),
            *prediction_lines(results)]


def _single(p: dict, dtype: str) -> bool:
    """A one-layer point without projection at T = 100 in ``dtype`` (what the targets speak of)."""
    return (p.get("dtype", "float32") == dtype and not p.get("proj_size") and p.get("num_layers", 1) == 1
            and p["seq_len"] == 100)


def _verdict(name: str, checks: list[tuple[str, float, float]]) -> str:
    """One target's line: met or missed, with each (point, measured, bound) that misses."""
    if not checks:
        return f"  target {name}: not measured"
    missed = [f"{label} {value:.2f} > {bound:.2f}" for label, value, bound in checks if value > bound]
    return (f"  target {name}: {'met' if not missed else 'MISSED'} ({len(checks)} points"
            + (f"; {', '.join(missed)})" if missed else ")"))


def target_lines(runs: list[dict]) -> list[str]:
    """Issue 17's targets, measured: fp32 forward µs per step (small layers at B 1 <= 1.0; LSTM and
    GRU H 1024 B 4 <= 2.5), persistent <= cuDNN at B <= 8 for H >= 256 (fp32), and fp16 LSTM
    H 1024 at B 8 and 16 <= 0.67x torch.nn."""
    points = [p for r in runs for p in r["points"]]
    by_shape: dict[tuple, dict[str, float]] = {}
    for p in points:
        by_shape.setdefault(_shape(p), {})[p["algo"]] = p["us_per_step"]
    persistent = [p for p in points if p["algo"] == "persistent" and p["pass"] == "forward"
                  and _single(p, "float32")]
    small = [(_label(_shape(p)), p["us_per_step"], 1.0) for p in persistent
             if p["hidden_size"] <= 256 and p["batch"] == 1]
    big = [(_label(_shape(p)), p["us_per_step"], 2.5) for p in persistent
           if p["cell"] in ("lstm", "gru") and p["hidden_size"] == 1024 and p["batch"] == 4]
    versus, half = [], []
    for shape, us in sorted(by_shape.items()):
        cell, _, dtype, hidden, proj, layers, seq_len, batch = shape
        if not {"persistent", "cudnn"} <= set(us) or proj or layers > 1 or seq_len != 100:
            continue
        if dtype == "float32" and hidden >= 256 and batch <= 8:
            versus.append((_label(shape), us["persistent"], us["cudnn"]))
        if dtype == "float16" and cell == "lstm" and hidden == 1024 and batch in (8, 16):
            half.append((_label(shape) + " persistent/cudnn", us["persistent"] / us["cudnn"], 0.67))
    return ["  issue 17 targets (measured):",
            _verdict("small layers (H <= 256, B 1) forward <= 1.0 us/step", small),
            _verdict("LSTM/GRU H 1024 B 4 forward <= 2.5 us/step", big),
            _verdict("persistent <= cuDNN at B <= 8, H >= 256 (fp32, us/step)", versus),
            _verdict("fp16 LSTM H 1024 B 8, 16 <= 0.67x torch.nn", half)]


def barrier_lines(barrier: dict) -> list[str]:
    """The exchange floor at one CTA and at the largest grid, per protocol measured."""
    first, last = barrier["rows"][0], barrier["rows"][-1]
    lines = [f"  grid barrier: {last['ns_per_barrier']:.0f} ns at {last['grid']} CTAs "
             f"(1 CTA: {first['ns_per_barrier']:.0f} ns)"]
    if last.get("exchange_ns_per_round") is not None:
        lines.append(f"  tagged exchange: {last['exchange_ns_per_round']:.0f} ns per round at "
                     f"{last['grid']} CTAs (1 CTA: {first['exchange_ns_per_round']:.0f} ns)")
    clusters = [r for r in barrier["rows"] if r.get("cluster_ns_per_round") is not None]
    if clusters:
        lines.append(f"  cluster exchange: {clusters[-1]['cluster_ns_per_round']:.0f} ns per round at "
                     f"{clusters[-1]['grid']} CTAs")
    return lines


def anatomy_lines(anatomy: dict) -> list[str]:
    """The exchange round's parts beside the full round (``barrier_latency.py --anatomy``'s table:
    docs/design.md, "The round's anatomy", says how to read it)."""
    return ["  the exchange round's parts (round_anatomy.json):"] + [
        f"    {line}" for line in anatomy_table(anatomy["rows"]).splitlines()]


def main(argv: list[str]) -> int:
    """Summarise ``argv[0]``."""
    out = Path(argv[0])
    info = _load(out / "info.json")
    if info and info.get("gpu"):
        dev = info["device"]
        print(f"  device: {dev['name']}, fp32 peak {dev['fp32_peak_tflops']:.1f} TFLOP/s")
    elif info:
        print(f"  device: {info['reason']}")
    found = sorted(out.glob("*/bench_results.json"))
    if not found:
        print("  bench_results.json: not available (no */bench_results.json)")
    runs = []
    for path in found:
        results = _load(path)
        if results:
            runs.append(results)
            print("\n".join(bench_run_lines(path, results)))
    if runs:
        print("\n".join(target_lines(runs)))
    barrier = _load(out / "barrier_latency.json")
    if barrier and barrier["rows"]:
        print("\n".join(barrier_lines(barrier)))
    anatomy = _load(out / "round_anatomy.json")
    if anatomy and anatomy["rows"]:
        print("\n".join(anatomy_lines(anatomy)))
    restart = _load(out / "restart_cost.json")
    if restart:
        costs = [r["cost_us"] for r in restart["rows"] if r["restarts"] > 0]
        print(f"  restart cost: median {statistics.median(costs):.0f} us over {len(costs)} stalls"
              if costs else "  restart cost: no run restarted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["."]))
