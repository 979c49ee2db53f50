"""A step-at-a-time decode loop (issue 29): the resident decoder against torch.nn's ways to run it.

    python bench/decode_loop.py --out DIR [--steps 1000] [--max-seconds S] [--cpu]

For LSTM and GRU at H in {256, 640, 1024} and B in {1, 4, 16} (input size H, each step's input
the last step's h, so the loop is a true recurrence through the host's calls), microseconds per
step of ``--steps`` steps, side by side in one process:

* ``decoder``: ``persistent_rnn.torch``'s cell ``.decoder(batch=B)``, eager (one launch a step:
  the resident CTAs project x themselves);
* ``decoder_graph``: the same loop captured once in a CUDA graph and replayed;
* ``decoder_projected``: ``step_projected`` with the input's projection given (one launch a step,
  without the in-kernel projection; the projection is computed once before the loop - what a
  per-token table gives a real decoder);
* ``fused``: the cell with ``algo="persistent"`` (the fused step kernel, one launch a step);
* ``fused_graph``: that loop captured in a CUDA graph (a forced algorithm runs the library under
  torch's capture) - the fused kernel's device time a step, beside the decoder's;
* ``torch_cell``: ``torch.nn`` cell in a Python loop (two GEMMs and a pointwise kernel);
* ``torch_cell_graph``: that loop captured in a CUDA graph;
* ``torch_layer_t1``: ``torch.nn.LSTM``/``GRU`` called with T=1 (cuDNN) every step.

**What is timed**: each road's loop after a warm-up run, to the last step's output on the caller's
stream (``benchmark.torch_stream_done``: a CUDA event after the last step, waited for alone). Not
a device-wide synchronisation: a decoder's resident kernel runs on a stream of its own until it
exits, idle ``gpu_timeout_ms`` (100 ms) after its last step, and a device sync waits for that -
the figures of 2026-11-27 (H200) did, ~100 µs a step of a 1000-step loop. A decoder road records
apart ``<road>_relaunches``, the resident kernel's relaunches in the timed loop (0: every step
found it waiting), and its exit: ``<road>_idle_tail_ms``, the wait of a device sync just after
the timed loop (the kernel leaving idle), and ``<road>_close_ms``, that of ``close()`` after one
more loop (``STOP`` posted: the kernel leaves at once). The captured loop holds only the step kernels: the
resident kernel is launched outside the graph (``resume()`` before each replay), so a replay
ends with its last step.

Each row has the latency model's prediction of the decoder's and the fused kernel's step beside
it (``latency.predict_decoder_step``; labelled a prediction). A road that fails records its error
and the run goes on. ``--cpu`` runs the roads that exist without a GPU (the decoder and the fused
kernel in the CPU emulation, torch's cell and layer) at one tiny size for a few steps: a check of
the script, its figures mean nothing. Writes ``DIR/decode_loop.json`` after every size (so a run
cut short keeps what it measured) and prints a table. The sizes run LSTM H=640 B=1 (the issue's
headline) first; ``--max-seconds`` lists the sizes not started within it as skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import persistent_rnn.torch as prt
from persistent_rnn import benchmark, latency

CELLS = ("LSTM", "GRU")
HIDDEN = (256, 640, 1024)
BATCH = (1, 4, 16)
HEADLINE = ("LSTM", 640, 1)
CPU_SIZES = [("LSTM", 16, 2), ("GRU", 16, 2)]
ROADS = ("decoder", "decoder_graph", "decoder_projected", "fused", "fused_graph", "torch_cell",
         "torch_cell_graph", "torch_layer_t1")
TIMING = ("us per step to the last step's output on the caller's stream (a CUDA event); a "
          "decoder road's <road>_idle_tail_ms: a device-wide sync just after that (its resident "
          "kernel's idle exit, not in the figure), <road>_close_ms: close() after one more loop")
CPU_ROADS = ("decoder", "decoder_projected", "fused", "torch_cell", "torch_layer_t1")


def _cell_step(mode: str, cell: Callable):
    """A step function ``x, state -> (next input, state)`` over a cell (LSTM: state (h, c))."""
    if mode == "LSTM":
        def step(x, state):
            state = cell(x, state)
            return state[0], state
    else:
        def step(x, state):
            h = cell(x, state)
            return h, h
    return step


def _decoder_step(mode: str, dec) -> Callable:
    def step(x, state):
        state = dec.step(x, state)
        return (state[0] if mode == "LSTM" else state), state
    return step


def _projected_step(mode: str, dec, gi: torch.Tensor) -> Callable:
    def step(x, state):  # x unused: the projection of the loop's first input, every step
        state = dec.step_projected(gi, state)
        return (state[0] if mode == "LSTM" else state), state
    return step


def _layer_step(layer) -> Callable:
    def step(x, state):
        y, state = layer(x.unsqueeze(0), state)
        return y[0], state
    return step


def run_loop(step: Callable, x0: torch.Tensor, steps: int) -> torch.Tensor:
    x, state = x0, None
    for _ in range(steps):
        x, state = step(x, state)
    return x


def seconds(fn: Callable[[], object]) -> float:
    """Host seconds of one ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Callable[[], object], cuda: bool, warm_up: bool = True) -> float:
    """Seconds of ``fn()`` to its last output on the caller's stream, after a warm-up run."""
    if warm_up:
        fn()
        benchmark.torch_stream_done(cuda)
    t0 = time.perf_counter()
    fn()
    benchmark.torch_stream_done(cuda)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class RoadTime:
    """A road's timed loop (``loop_s``: to its last output) and, for a decoder, its resident
    kernel: ``relaunches`` in the timed loop (0: every step found it waiting), and its exit
    after a loop - ``idle_tail_s``, a device-wide synchronisation just after the timed loop (the
    kernel leaving idle; a GPU only), ``close_s``, ``close()`` after one more loop (the kernel
    told to leave)."""
    loop_s: float
    relaunches: int | None = None
    idle_tail_s: float | None = None
    close_s: float | None = None


def road_time(road: str, mode: str, hidden: int, batch: int, steps: int,
              device: str) -> RoadTime:
    """One ``steps``-step loop of ``road``, timed."""
    cuda = device == "cuda"
    # Weights and inputs drawn on the CPU: a capture that failed leaves the CUDA generator
    # unusable, and the next road must still run.
    torch.manual_seed(0)
    cell_cls = getattr(prt, f"{mode}Cell")
    x0 = torch.randn(batch, hidden).to(device)
    with torch.no_grad():
        if road.startswith("decoder"):
            cell = cell_cls(hidden, hidden, algo="persistent").to(device)
            with cell.decoder(batch=batch) as dec:
                if road == "decoder_projected":
                    gi = torch.nn.functional.linear(x0, cell.weight_ih, cell.bias_ih)
                    step = _projected_step(mode, dec, gi)
                else:
                    step = _decoder_step(mode, dec)
                run = _loop(road, step, x0, steps, dec.resume)
                run()  # (warm-up)
                benchmark.torch_stream_done(cuda)
                before = dec.relaunches
                loop_s = timed(run, cuda, warm_up=False)
                relaunches = dec.relaunches - before
                idle_tail_s = seconds(torch.cuda.synchronize) if cuda else None
                run()  # (the resident kernel relaunched: its first step, or resume())
                benchmark.torch_stream_done(cuda)
                return RoadTime(loop_s, relaunches, idle_tail_s, seconds(dec.close))
        if road.startswith("fused"):
            step = _cell_step(mode, cell_cls(hidden, hidden, algo="persistent").to(device))
        elif road.startswith("torch_cell"):
            step = _cell_step(mode, getattr(torch.nn, f"{mode}Cell")(hidden, hidden).to(device))
        else:
            step = _layer_step(getattr(torch.nn, mode)(hidden, hidden).to(device))
        return RoadTime(timed(_loop(road, step, x0, steps), cuda))


def _loop(road: str, step: Callable, x0: torch.Tensor, steps: int,
          before_replay: Callable[[], object] | None = None) -> Callable[[], object]:
    """The road's loop: eager, or (``_graph``) captured once and replayed."""
    def loop():
        return run_loop(step, x0, steps)
    if road.endswith("_graph"):
        return benchmark.torch_graph_replay(loop, before_replay)
    return loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no size after this many seconds (the rest listed as skipped)")
    p.add_argument("--cpu", action="store_true", help="CPU tensors (the emulation), tiny sizes")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("decode_loop: no CUDA device (use --cpu for a check of the script)", file=sys.stderr)
        return 2
    steps = min(args.steps, 4) if args.cpu else args.steps
    sizes = CPU_SIZES if args.cpu else sorted(
        [(c, h, b) for c in CELLS for h in HIDDEN for b in BATCH], key=lambda s: s != HEADLINE)
    roads = CPU_ROADS if args.cpu else ROADS
    device = "cpu" if args.cpu else "cuda"
    record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(not args.cpu),
              "steps": steps, "timing": TIMING, "rows": [], "skipped": []}
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for mode, hidden, batch in sizes:
        if args.max_seconds is not None and time.perf_counter() - start > args.max_seconds:
            record["skipped"].append({"cell": mode, "hidden": hidden, "batch": batch})
            continue
        row: dict = {"cell": mode, "hidden": hidden, "batch": batch,
                     "prediction_h100": _prediction(mode, hidden, batch)}
        for road in roads:
            try:
                timing = road_time(road, mode, hidden, batch, steps, device)
            except Exception as exc:  # a road that cannot run is recorded, the others go on
                row[road] = None
                row[f"{road}_error"] = f"{type(exc).__name__}: {exc}"
                continue
            row[road] = timing.loop_s / steps * 1e6
            if timing.relaunches is not None:
                row[f"{road}_relaunches"] = timing.relaunches
            for key, s in (("idle_tail_ms", timing.idle_tail_s), ("close_ms", timing.close_s)):
                if s is not None:
                    row[f"{road}_{key}"] = s * 1e3
        record["rows"].append(row)
        print(" ".join([f"{mode} H={hidden} B={batch}:"] + [
            f"{r} {row[r]:.1f}" if row[r] is not None else f"{r} -" for r in roads]) + " µs/step",
            flush=True)
        exits = [f"{r}" + (f" idle {row[f'{r}_idle_tail_ms']:.1f} ms," if f"{r}_idle_tail_ms" in row
                           else "") + f" close() {row[f'{r}_close_ms']:.2f} ms"
                 for r in roads if f"{r}_close_ms" in row]
        if exits:
            print("  the resident kernel's exit after the loop (not in the figures): "
                  + "; ".join(exits), flush=True)
        (args.out / "decode_loop.json").write_text(json.dumps(record, indent=1))
    (args.out / "decode_loop.json").write_text(json.dumps(record, indent=1))
    if record["skipped"]:
        print(f"skipped (past --max-seconds): {len(record['skipped'])} sizes", flush=True)
    if args.cpu:
        print("(--cpu: the emulation and torch's CPU kernels; a check of the script, not figures)")
    return 0


def _prediction(mode: str, hidden: int, batch: int) -> dict | None:
    """The latency model's decoder and fused-step predictions on an H100 (None where the model
    cannot run: no NVRTC or nvdisasm)."""
    try:
        d = latency.predict_decoder_step(mode, hidden, batch, device="h100")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    keys = ("resident", "fused_step_us", "captured_us", "eager_us", "projected_us",
            "projection_us")
    return {"prediction": True, **{k: d.get(k) for k in keys}}


if __name__ == "__main__":
    sys.exit(main())
