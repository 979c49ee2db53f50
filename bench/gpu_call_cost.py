"""Where a layer call's time goes on a GPU: host submission, the device's own work, the library's
synchronisations, and the kernel's per-step cost apart from the call's.

    python bench/gpu_call_cost.py --out DIR [--cpu]

For each layer (GRU H=256 B=1, LSTM H=1024 B=4, RNN-tanh H=512 B=1; T=100, or each of
``--steps``; input 64) and each
road - the CuPy layer with ``algo="persistent"`` and ``"gemm"``, ``persistent_rnn.torch`` with
``algo="persistent"`` and torch.nn (cuDNN) - forward and forward+backward:

* ``host_us``: the call alone on the host clock, the device idle before it (a synchronisation
  before each call, none after): what the call costs the CPU, its own waits for the device
  included;
* ``loop_us``: ``--calls`` calls back to back and one synchronisation at the end, per call: what
  a training or inference loop sees;
* ``event_us``: CUDA events around one call, then a synchronisation: the device's time from the
  call's first to its last work, host gaps between them included;
* the library's counters per call (host synchronisations, launches, memsets, allocations);
* persistent rows: the latency model's **prediction** beside them (``predicted_host_us``, the
  host's time of the call; ``predicted_call_us``, its end-to-end µs back to back, to set beside
  ``loop_us``), on the planning device (``call_predictions``).

``last_run`` is never read (reading it waits for the device). Then the persistent forward's
per-step slope from back-to-back loops at T=1000 and T=3000 (the per-call cost cancels), its
forward at T=100 captured into a CUDA graph and replayed (``graph_us``: no host work), and a
cProfile of GRU calls through the CuPy layer and the torch module (``profile_*.txt``).
``--cpu`` runs the same on NumPy arrays and CPU tensors at tiny sizes: a check of the script,
its figures mean nothing.
Writes ``DIR/gpu_call_cost.json`` and prints a table.

``--stack``: only a four-layer LSTM H=384 B=4 stack's calls (issue 26's stack; in stack mode)
through the CuPy layer and torch.nn (cuDNN), forward and forward+backward at each ``--steps``,
the persistent rows beside the model's **prediction** of their host µs
(``latency.stack_call_costs``); writes ``DIR/stack_call_cost.json``.

``--inputs-ahead``: only the A/B of ``plan.CLUSTER_INPUTS_AHEAD`` (``knob_ab``): the forward
slope of GRU H=256 B=1 and RNN-tanh H=512 B=1 with the cluster passes fetching their inputs one
and two steps ahead, in one process, each beside the model's prediction; writes
``DIR/inputs_ahead.json``. ``--free-polls``: the same for ``plan.GRID_FREE_POLLS`` (2, the
kernels', and 32) on grid layers (LSTM H=1024 B=4, GRU H=1024 B=1); ``DIR/free_polls.json``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import persistent_rnn as prnn
from persistent_rnn import benchmark, latency, runtime, timing
from persistent_rnn import plan as planner
from persistent_rnn.cells import layer_args
from persistent_rnn.launch import COUNTERS

LAYERS = [("gru", 256, 1), ("lstm", 1024, 4), ("rnn_tanh", 512, 1)]
CPU_LAYERS = [("gru", 16, 1)]
# ``--stack``: issue 26's stack (cell, hidden, batch, layers), in stack mode where planned
STACK, CPU_STACK = ("lstm", 384, 4, 4), ("lstm", 16, 2, 3)
STACK_ROADS = ("persistent", "cudnn")
ROADS = ("persistent", "gemm", "prnn_torch", "cudnn")
INPUT, STEPS = 64, 100
PROFILE_WARMUP = 10  # calls before a profile (``profile``): planned and captured by then


@dataclass(frozen=True)
class Knob:
    """A planner constant an A/B sets (``knob_ab``): its name (the rows' key, the file
    ``DIR/<name>.json``), the ``plan`` attribute, the kernels' value and the one tried, the
    layers measured (on a GPU; ``cpu_layers`` on the CPU), each setting twice in the order
    A B B A, so that a drift over the run falls on both alike."""

    name: str
    attribute: str
    values: tuple[int, int]
    layers: tuple[tuple[str, int, int], ...]
    cpu_layers: tuple[tuple[str, int, int], ...]

    @property
    def order(self) -> tuple[int, ...]:
        a, b = self.values
        return a, b, b, a


KNOBS = {
    # plan.CLUSTER_INPUTS_AHEAD: the cluster layers the two-ahead passes were measured on
    # (2026-11-27: GRU slower, RNN-tanh unchanged)
    "inputs_ahead": Knob("inputs_ahead", "CLUSTER_INPUTS_AHEAD", (1, 2),
                         (("gru", 256, 1), ("rnn_tanh", 512, 1)), (("gru", 16, 1),)),
    # plan.GRID_FREE_POLLS: grid layers, whose step is mostly the exchange's round
    "free_polls": Knob("free_polls", "GRID_FREE_POLLS", (2, 32),
                       (("lstm", 1024, 4), ("gru", 1024, 1)), (("gru", 264, 1),)),
}


class Device:
    """The array module and synchronisation of the run (CuPy and CUDA, or NumPy and nothing)."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.xp = np if cpu else __import__("cupy")
        import torch
        self.torch = torch
        self.torch_device = "cpu" if cpu else "cuda"
        # CUDA events around one call on the current stream; the host clock on the CPU
        self.clock: timing.Clock = timing.CpuClock() if cpu else timing.CudaEventClock()

    def sync(self) -> None:
        if not self.cpu:
            self.xp.cuda.get_current_stream().synchronize()
            self.torch.cuda.synchronize()


def array_layer(dev: Device, road: str, cell: str, hidden: int, layers: int = 1):
    """The array layer of ``road`` ("persistent" or "gemm"), its parameters on the run's device."""
    mode, extra = layer_args(cell)
    layer = getattr(prnn, mode)(INPUT, hidden, num_layers=layers, algo=road, seed=0, **extra)
    if not dev.cpu:
        layer.load_params({k: dev.xp.asarray(v) for k, v in layer.params.items()})
    return layer


def make_call(dev: Device, road: str, cell: str, hidden: int, batch: int, steps: int,
              backward: bool, layers: int = 1) -> Callable[[], object]:
    """One call of ``road`` on fixed random inputs (never reading ``last_run``); ``layers``: a
    unidirectional stack's."""
    mode, extra = layer_args(cell)
    rng = np.random.default_rng(hidden + batch)
    x = rng.standard_normal((steps, batch, INPUT)).astype(np.float32)
    dy = rng.standard_normal((steps, batch, hidden)).astype(np.float32)
    if road in ("persistent", "gemm"):
        layer = array_layer(dev, road, cell, hidden, layers)
        xa, dya = dev.xp.asarray(x), dev.xp.asarray(dy)

        def run_layer():
            layer.forward(xa)
            if backward:
                layer.backward(dya)
        return run_layer
    torch = dev.torch
    if road == "cudnn":
        module = getattr(torch.nn, mode)(INPUT, hidden, num_layers=layers, **extra)
    else:
        import persistent_rnn.torch as prt
        module = getattr(prt, mode)(INPUT, hidden, num_layers=layers, algo="persistent", **extra)
    module = module.to(dev.torch_device)
    xt = torch.as_tensor(x, device=dev.torch_device).requires_grad_(backward)
    dyt = torch.as_tensor(dy, device=dev.torch_device)

    def run_module():
        if backward:
            y, _ = module(xt)
            y.backward(dyt)
        else:
            with torch.no_grad():
                module(xt)
    return run_module


def measure(dev: Device, call: Callable[[], object], calls: int) -> dict:
    """host_us, loop_us, event_us (medians; µs) and the library's counters per call."""
    for _ in range(1 if dev.cpu else 3):
        call()
    dev.sync()
    host = []
    for _ in range(calls):
        dev.sync()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
    dev.sync()
    before = COUNTERS.snapshot()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    dev.sync()
    loop = (time.perf_counter() - t0) / calls
    after = COUNTERS.snapshot()
    events = [dev.clock.measure(call) for _ in range(calls)]
    return {"host_us": statistics.median(host) * 1e6, "loop_us": loop * 1e6,
            "event_us": statistics.median(events) * 1e6,
            "event_spread": timing.spread(events),
            "per_call": {k: (after[k] - before[k]) / calls for k in after}}


def slope(dev: Device, cell: str, hidden: int, batch: int, lengths: tuple[int, int],
          calls: int) -> dict:
    """The persistent forward's µs per step from back-to-back loops at two sequence lengths, and
    the SM clock NVML reported while the longer one ran (the latency model assumes the boost
    clock: a step measured at a lower one is not the model's error)."""
    loops, clocks = [], []
    for steps in lengths:
        call = make_call(dev, "persistent", cell, hidden, batch, steps, False)
        with SmClock(dev) as clock:
            loops.append(measure(dev, call, calls)["loop_us"])
        clocks.append(clock.mhz)
    return {"lengths": lengths, "loop_us": loops, "sm_clock_mhz": clocks,
            "us_per_step": (loops[1] - loops[0]) / (lengths[1] - lengths[0])}


class SmClock:
    """The SM clocks NVML reports every 10 ms while the block runs: ``mhz`` = (min, median,
    max), or None without a GPU or NVML."""

    def __init__(self, dev: Device):
        self.mhz: tuple[int, int, int] | None = None
        self._samples: list[int] = []
        self._handle = None if dev.cpu else _nvml_handle(dev.xp.cuda.Device().id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "SmClock":
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._stop.set()
            self._thread.join()
        if self._samples:
            self.mhz = (min(self._samples), int(statistics.median(self._samples)),
                        max(self._samples))

    def _sample(self) -> None:
        import pynvml
        while not self._stop.wait(0.01):
            self._samples.append(pynvml.nvmlDeviceGetClockInfo(self._handle, pynvml.NVML_CLOCK_SM))


def _nvml_handle(index: int):
    """NVML's handle of CUDA device ``index`` (None where NVML cannot be used)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 -- no NVML: the clock is simply not reported
        return None


def graph_replay(dev: Device, cell: str, hidden: int, batch: int, calls: int) -> dict:
    """The persistent forward captured once into a CUDA graph (CuPy stream capture) and replayed
    ``calls`` times back to back: the device's time per call with no host work in it."""
    if dev.cpu:
        return {"graph_us": None, "note": "no CUDA graphs on the CPU"}
    cupy = dev.xp
    layer = array_layer(dev, "persistent", cell, hidden)
    x = cupy.asarray(np.random.default_rng(hidden).standard_normal((STEPS, batch, INPUT)),
                     np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            layer.forward(x)
            stream.begin_capture()
            layer.forward(x)
            graph = stream.end_capture()
            graph.launch(stream)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(calls):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
    except Exception as exc:  # noqa: BLE001 -- a capture that fails is what is reported
        return {"graph_us": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"graph_us": cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls}


def profile(dev: Device, road: str, cell: str, hidden: int, batch: int, backward: bool,
            calls: int) -> str:
    """cProfile of ``calls`` calls of ``road`` in steady state: the top functions by own time
    and by total, µs per call. The warm-up plans the call (``call_plans``: two calls that ran the
    whole way) and captures its chain graphs, so that none of that is in the profile."""
    call = make_call(dev, road, cell, hidden, batch, STEPS, backward)
    for _ in range(PROFILE_WARMUP):
        call()
    dev.sync()

    def calls_then_sync() -> None:
        for _ in range(calls):
            call()
        dev.sync()
    return benchmark.profile_text(calls_then_sync, (("tottime", 30), ("cumulative", 40)), calls)


@contextmanager
def planner_setting(attribute: str, value: int) -> Iterator[None]:
    """Layers planned inside it are planned with ``plan.<attribute>`` = ``value`` (a ``Knob``'s);
    the runtime's cached engines (their plans) are dropped on entry and on exit."""
    before = getattr(planner, attribute)
    setattr(planner, attribute, value)
    runtime._cached_engine.cache_clear()
    try:
        yield
    finally:
        setattr(planner, attribute, before)
        runtime._cached_engine.cache_clear()


def forward_ran(dev: Device, cell: str, hidden: int, batch: int) -> dict[str, int]:
    """The cluster size and input buffers of the forward kernel a call of the layer runs (read
    from ``last_run`` after the measurement: reading it waits for the device)."""
    layer = array_layer(dev, "persistent", cell, hidden)
    layer.forward(dev.xp.zeros((3, batch, INPUT), np.float32))
    details = " ".join(layer.last_run.details)
    return {name: int(m[1]) if (m := re.search(rf"'PRNN_{name.upper()}': (\d+)", details)) else 0
            for name in ("cluster", "input_buffers", "grid_free_polls")}


def knob_ab(dev: Device, knob: Knob, lengths: tuple[int, int], calls: int) -> list[dict]:
    """The A/B of ``knob`` in one process: each layer's forward slope (``slope``) with the knob
    at each value of its order (on the CPU its first two), beside the latency model's
    prediction of that forward's step on the planning device (its kernels compiled first, in
    parallel) and what ran."""
    device = runtime.planning_device(not dev.cpu)
    layers = knob.cpu_layers if dev.cpu else knob.layers
    plans = {}
    for value in knob.values:
        with planner_setting(knob.attribute, value):
            for cell, hidden, batch in layers:
                plans[value, cell] = planner.make_plan(cell, hidden, batch, device=device).forward

    def predict(key: tuple[int, str]) -> float:
        cell, hidden, batch = next(layer for layer in layers if layer[0] == key[1])
        shape = latency.PassShape(planner.resolve_cell(cell), plans[key], batch, hidden)
        return latency.step_terms(latency.pass_sass(plans[key], device.arch), shape, device).total_us
    with ThreadPoolExecutor(max_workers=len(plans)) as pool:
        predicted = dict(zip(plans, pool.map(predict, plans)))
    rows = []
    for value in knob.order[:2] if dev.cpu else knob.order:
        with planner_setting(knob.attribute, value):
            for cell, hidden, batch in layers:
                row = {"layer": f"{cell}_h{hidden}_b{batch}", knob.name: value,
                       "predicted_us": predicted[value, cell],
                       **slope(dev, cell, hidden, batch, lengths, calls),
                       "ran": forward_ran(dev, cell, hidden, batch)}
                rows.append(row)
                print(f"{knob.name} {value} {row['layer']}: {row['us_per_step']:.3f} us/step "
                      f"measured, {row['predicted_us']:.3f} predicted (ran {row['ran']}, SM clock "
                      f"MHz {row['sm_clock_mhz']})", flush=True)
    return rows


def call_predictions(dev: Device, layers: list, seq_lens: list[int]) -> dict[tuple, dict]:
    """The latency model's prediction (on the planning device) of each persistent row: per
    (layer, T, pass) the host µs of the call and its end-to-end µs per call back to back
    (``latency.call_costs``, ``StepTime.call_time_us``), the kernels compiled in parallel."""
    device = runtime.planning_device(not dev.cpu)

    def predict(layer: tuple[str, int, int]) -> dict[tuple, dict]:
        cell, hidden, batch = layer
        spec = planner.resolve_cell(cell)
        plan = planner.make_plan(spec, hidden, batch, device=device)
        found = {}
        for steps, backward in itertools.product(seq_lens, (False, True)):
            st = latency.predict_plan(spec, hidden, batch, plan, device, seq_len=steps,
                                      input_size=INPUT)
            host = sum(latency.call_costs(spec, hidden, batch, steps, INPUT, b, device).host_us
                       for b in (False, True)[:1 + backward])
            found[f"{cell}_h{hidden}_b{batch}", steps, "fwd+bwd" if backward else "fwd"] = {
                "predicted_host_us": host,
                "predicted_call_us": st.call_time_us(steps, backward)}
        return found
    with ThreadPoolExecutor(max_workers=len(layers)) as pool:
        return {k: v for part in pool.map(predict, layers) for k, v in part.items()}


def stack_rows(dev: Device, seq_lens: list[int], calls: int) -> list[dict]:
    """``--stack``: the stack's calls (``STACK``) on ``STACK_ROADS``, forward and forward +
    backward at each T, ``measure``d, the persistent rows beside the latency model's
    prediction of their host µs (``latency.stack_call_costs``: stack mode, planned)."""
    cell, hidden, batch, layers = CPU_STACK if dev.cpu else STACK
    device, spec = runtime.planning_device(not dev.cpu), planner.resolve_cell(cell)
    rows = []
    for steps, backward, road in itertools.product(seq_lens, (False, True), STACK_ROADS):
        try:
            row = measure(dev, make_call(dev, road, cell, hidden, batch, steps, backward, layers),
                          calls)
        except Exception as exc:  # noqa: BLE001 -- a road that cannot run is reported
            row = {"error": f"{type(exc).__name__}: {exc}"}
        row.update(layer=f"{cell}_h{hidden}_b{batch}_l{layers}", steps=steps, road=road,
                   passes="fwd+bwd" if backward else "fwd")
        if road == "persistent":
            row["predicted_host_us"] = sum(
                latency.stack_call_costs(spec, hidden, batch, steps, INPUT, b, device,
                                         layers).host_us for b in (False, True)[:1 + backward])
        rows.append(row)
    return rows


def ab_lines(knob: Knob, rows: list[dict]) -> list[str]:
    """Per layer of ``knob_ab``'s rows: each value's mean slope and prediction, and the tried
    value's over the kernels'."""
    lines = []
    base, tried = knob.values
    for layer in dict.fromkeys(r["layer"] for r in rows):
        mine = [r for r in rows if r["layer"] == layer]
        measured = {v: statistics.mean(r["us_per_step"] for r in mine if r[knob.name] == v)
                    for v in knob.values}
        model = {r[knob.name]: r["predicted_us"] for r in mine}
        lines.append(f"{layer}: {knob.name} {base} {measured[base]:.3f} us/step (predicted "
                     f"{model[base]:.3f}), {tried} {measured[tried]:.3f} (predicted "
                     f"{model[tried]:.3f}): {tried} / {base} {measured[tried] / measured[base]:.3f} "
                     f"measured, {model[tried] / model[base]:.3f} predicted")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu", action="store_true", help="NumPy and CPU tensors, tiny sizes")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--steps", default=str(STEPS),
                   help="the sequence lengths T of the per-call rows, comma-separated "
                        f"(default {STEPS}; issue 26 asks for 10,100,1000)")
    p.add_argument("--inputs-ahead", action="store_true",
                   help="only the A/B of plan.CLUSTER_INPUTS_AHEAD (inputs_ahead.json)")
    p.add_argument("--free-polls", action="store_true",
                   help="only the A/B of plan.GRID_FREE_POLLS (free_polls.json)")
    p.add_argument("--stack", action="store_true",
                   help="only a stack's calls beside cuDNN's and the model's host prediction "
                        "(stack_call_cost.json)")
    args = p.parse_args(argv)
    seq_lens = [3] if args.cpu else [int(t) for t in args.steps.split(",")]
    dev = Device(args.cpu)
    calls = 1 if args.cpu else args.calls
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = (3, 9) if args.cpu else (1000, 3000)
    for knob in (KNOBS[name] for name in KNOBS if getattr(args, name)):
        record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(not args.cpu),
                  "rows": knob_ab(dev, knob, lengths, 1 if args.cpu else max(2, calls // 6))}
        (args.out / f"{knob.name}.json").write_text(json.dumps(record, indent=1, default=str))
        print("\n".join(ab_lines(knob, record["rows"])))
        return 0
    if args.stack:
        record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(not args.cpu),
                  "rows": stack_rows(dev, seq_lens, calls)}
        (args.out / "stack_call_cost.json").write_text(json.dumps(record, indent=1, default=str))
        for row in record["rows"]:
            beside = (f"  predicted host {row['predicted_host_us']:.1f} (PREDICTION)"
                      if "predicted_host_us" in row else "")
            print(f"{row['layer']:22} {row['steps']:5d} {row['passes']:8} {row['road']:11} "
                  + (f"host {row['host_us']:8.1f} loop {row['loop_us']:8.1f} "
                     f"event {row['event_us']:8.1f}{beside}" if "error" not in row
                     else row["error"]), flush=True)
        return 0
    record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(not args.cpu), "rows": []}
    layers = CPU_LAYERS if args.cpu else LAYERS
    predicted = call_predictions(dev, layers, seq_lens)
    print(f"{'layer':18} {'T':>5} {'pass':8} {'road':11} {'host':>8} {'loop':>8} {'event':>8}  "
          "per call (persistent: the model's PREDICTION of host and loop µs beside)")
    for cell, hidden, batch in layers:
        for steps, backward, road in itertools.product(seq_lens, (False, True), ROADS):
            try:
                row = measure(dev, make_call(dev, road, cell, hidden, batch, steps, backward),
                              calls)
            except Exception as exc:  # noqa: BLE001 -- a road that cannot run is reported
                row = {"error": f"{type(exc).__name__}: {exc}"}
            row.update(layer=f"{cell}_h{hidden}_b{batch}", steps=steps, road=road,
                       passes="fwd+bwd" if backward else "fwd")
            model = predicted[row["layer"], steps, row["passes"]] if road == "persistent" else {}
            row.update(model)
            record["rows"].append(row)
            beside = (f"  predicted host {model['predicted_host_us']:.1f}, loop "
                      f"{model['predicted_call_us']:.1f}" if model else "")
            print(f"{row['layer']:18} {steps:5d} {row['passes']:8} {road:11} "
                  + (f"{row['host_us']:8.1f} {row['loop_us']:8.1f} {row['event_us']:8.1f}  "
                     f"{row['per_call']}{beside}" if "error" not in row else row["error"]),
                  flush=True)
    record["slopes"] = [dict(layer=f"{c}_h{h}_b{b}", **slope(dev, c, h, b, lengths, 1 if args.cpu else max(2, calls // 6)))
                        for c, h, b in (CPU_LAYERS if args.cpu else LAYERS)]
    record["graphs"] = [dict(layer=f"{c}_h{h}_b{b}", steps=STEPS, **graph_replay(dev, c, h, b, calls))
                        for c, h, b in (CPU_LAYERS if args.cpu else LAYERS)]
    for g in record["graphs"]:
        print(f"graph replay {g['layer']} forward T={g['steps']}: {g}")
    for s in record["slopes"]:
        print(f"slope {s['layer']}: {s['us_per_step']:.3f} us/step (loops {s['loop_us']}, "
              f"SM clock MHz (min, median, max) {s['sm_clock_mhz']})")
    cell, hidden, batch = (CPU_LAYERS if args.cpu else LAYERS)[0]
    for road in ("persistent", "prnn_torch"):
        for backward in (False, True):
            name = f"profile_{road}_{cell}_{'fwd_bwd' if backward else 'fwd'}.txt"
            (args.out / name).write_text(profile(dev, road, cell, hidden, batch, backward, calls))
    (args.out / "gpu_call_cost.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
