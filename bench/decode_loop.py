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
* ``torch_cell``: ``torch.nn`` cell in a Python loop (two GEMMs and a pointwise kernel);
* ``torch_cell_graph``: that loop captured in a CUDA graph;
* ``torch_layer_t1``: ``torch.nn.LSTM``/``GRU`` called with T=1 (cuDNN) every step.

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
ROADS = ("decoder", "decoder_graph", "decoder_projected", "fused", "torch_cell",
         "torch_cell_graph", "torch_layer_t1")
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


def timed(fn: Callable[[], object], cuda: bool) -> float:
    """Seconds of ``fn()`` (one warm-up run first), synchronised on the GPU."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def road_seconds(road: str, mode: str, hidden: int, batch: int, steps: int, device: str) -> float:
    """Seconds of one ``steps``-step loop of ``road``."""
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
                return _timed_loop(road, step, x0, steps, cuda, dec.resume)
        if road == "fused":
            step = _cell_step(mode, cell_cls(hidden, hidden, algo="persistent").to(device))
        elif road.startswith("torch_cell"):
            step = _cell_step(mode, getattr(torch.nn, f"{mode}Cell")(hidden, hidden).to(device))
        else:
            step = _layer_step(getattr(torch.nn, mode)(hidden, hidden).to(device))
        return _timed_loop(road, step, x0, steps, cuda)


def _timed_loop(road: str, step: Callable, x0: torch.Tensor, steps: int, cuda: bool,
                before_replay: Callable[[], object] | None = None) -> float:
    def loop():
        return run_loop(step, x0, steps)
    if road.endswith("_graph"):
        return timed(benchmark.torch_graph_replay(loop, before_replay), cuda)
    return timed(loop, cuda)


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
              "steps": steps, "rows": [], "skipped": []}
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
                row[road] = road_seconds(road, mode, hidden, batch, steps, device) / steps * 1e6
            except Exception as exc:  # a road that cannot run is recorded, the others go on
                row[road] = None
                row[f"{road}_error"] = f"{type(exc).__name__}: {exc}"
        record["rows"].append(row)
        print(" ".join([f"{mode} H={hidden} B={batch}:"] + [
            f"{r} {row[r]:.1f}" if row[r] is not None else f"{r} -" for r in roads]) + " µs/step",
            flush=True)
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
