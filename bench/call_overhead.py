"""Host cost of one layer call on the CPU: the library's roads against torch.nn, side by side.

    python bench/call_overhead.py [--out DIR] [--calls 200] [--rounds 25] [--hidden 8]
                                  [--batch 1] [--steps 1] [--threads 1]

A small GRU (H=8, B=1, T=1 by default: the arithmetic is negligible, so what is timed is the
Python and dispatch work of a call) run by every road a user has to the same layer:
``torch.nn.GRU``, ``persistent_rnn.torch.GRU`` with ``algo="auto"`` (torch's kernels on the
CPU) and ``algo="gemm"`` (the library through the custom op), and the layer API
``persistent_rnn.GRU(algo="gemm")`` on NumPy. Three passes: the forward under
``torch.no_grad`` (inference), the forward with autograd recording (the parameters require
grad; the layer API has no such mode and runs its plain forward) and forward + backward. Every
road runs in the same process on the same weights; the rounds interleave the roads in short
runs of ``--calls`` calls each (alternating their order), so that every road sees the same
machine state even on a shared machine, and each call is timed with ``time.perf_counter_ns``.
The figure is the median over all timed calls (also the 10th percentile); ``ratio`` is the
median over torch.nn's. Writes ``DIR/call_overhead.json`` (device, date, commit, command,
the machine's load average before and after) when ``--out`` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import persistent_rnn as prnn
import persistent_rnn.torch as prt
from persistent_rnn import benchmark

Call = Callable[[], object]


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def roads(hidden: int, batch: int, steps: int, mode: str) -> dict[str, Call]:
    """One zero-argument call per road, all on the same weights and input."""
    torch.manual_seed(0)
    reference = torch.nn.GRU(hidden, hidden)
    modules = {"torch.nn.GRU": reference,
               "persistent_rnn.torch.GRU(algo='auto')": prt.GRU(hidden, hidden, algo="auto"),
               "persistent_rnn.torch.GRU(algo='gemm')": prt.GRU(hidden, hidden, algo="gemm")}
    for module in modules.values():
        module.load_state_dict(reference.state_dict())
    x = torch.randn(steps, batch, hidden, requires_grad=mode == "forward+backward")
    calls = {label: _torch_call(module, x, mode) for label, module in modules.items()}
    layer = prnn.GRU(hidden, hidden, algo="gemm")
    layer.load_params({k: v.detach().numpy() for k, v in reference.state_dict().items()})
    calls["persistent_rnn.GRU(algo='gemm') (NumPy)"] = _layer_call(
        layer, x.detach().numpy(), mode == "forward+backward")
    return calls


def _torch_call(module: torch.nn.Module, x: torch.Tensor, mode: str) -> Call:
    if mode == "forward":
        def forward() -> object:
            with torch.no_grad():
                return module(x)
        return forward
    if mode == "forward (autograd)":
        return lambda: module(x)

    def train_step() -> object:
        y, h = module(x)
        y.sum().backward()
        return h
    return train_step


def _layer_call(layer: prnn.GRU, x: np.ndarray, backward: bool) -> Call:
    dy = np.ones((x.shape[0], x.shape[1], layer.hidden_size), np.float32)
    if not backward:
        return lambda: layer.forward(x)

    def train_step() -> object:
        layer.forward(x)
        return layer.backward(dy)
    return train_step


def time_roads(calls: dict[str, Call], count: int, rounds: int,
               warmup: int = 50) -> dict[str, list[int]]:
    """Per road, the ns of each of ``count * rounds`` calls (rounds interleave the roads in
    runs of ``count`` calls), after ``warmup`` untimed calls of each."""
    for call in calls.values():  # warm-up: first-call work (caches, lazy imports) is not timed
        for _ in range(warmup):
            call()
    times: dict[str, list[int]] = {label: [] for label in calls}
    clock = time.perf_counter_ns
    for r in range(rounds):
        order = list(calls.items())
        for label, call in order[::1 if r % 2 == 0 else -1]:
            record = times[label]
            for _ in range(count):
                start = clock()
                call()
                record.append(clock() - start)
    return times


def summarize(times: dict[str, list[int]]) -> list[dict]:
    """Median and 10th percentile per road in µs, and the ratio of medians over torch.nn's."""
    base = statistics.median(times["torch.nn.GRU"])
    rows = []
    for label, ns in times.items():
        median = statistics.median(ns)
        rows.append({"road": label, "median_us": median / 1e3,
                     "p10_us": float(np.percentile(ns, 10)) / 1e3, "ratio": median / base,
                     "calls": len(ns)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Time every road, forward and forward + backward; print a table, write the JSON."""
    p = argparse.ArgumentParser(prog="bench/call_overhead.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="output directory (created)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per road and round")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--hidden", type=int, default=8, help="input and hidden size")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="sequence length T")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    passes = {}
    for name in ("forward", "forward (autograd)", "forward+backward"):
        calls = roads(args.hidden, args.batch, args.steps, name)
        passes[name] = summarize(time_roads(calls, args.calls, args.rounds))
        print(f"{name} (GRU H={args.hidden} B={args.batch} T={args.steps}, CPU)")
        for row in passes[name]:
            print(f"  {row['road']:42s} {row['median_us']:8.1f} µs  (p10 {row['p10_us']:7.1f})"
                  f"  x{row['ratio']:.2f}")
    if args.out is not None:
        doc = {"device": "cpu", "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
               "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
               "numpy_version": np.__version__, "python": platform.python_version(),
               "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
               **benchmark.run_stamp(["python", *sys.argv]),
               "settings": {"cell": "GRU", "hidden": args.hidden, "input": args.hidden,
                            "batch": args.batch, "steps": args.steps, "calls": args.calls,
                            "rounds": args.rounds,
                            "timing": "time.perf_counter_ns per call, rounds interleaving the "
                                      "roads in runs of `calls` calls, 50 untimed warm-up "
                                      "calls per road; median and 10th percentile; forward "
                                      "under torch.no_grad; forward (autograd): parameters "
                                      "requiring grad, no backward; forward+backward: "
                                      "y.sum().backward() / layer.backward"},
               "passes": passes}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "call_overhead.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out / 'call_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
