"""What the torch hand-over costs the host, operation by operation.

    python bench/interop_cost.py --out DIR [--cpu]

Mean µs per operation over ``--repeats`` back-to-back repetitions (no synchronisation inside the
loop or after it: host time, the GPU's work queued; a device-wide sync would also wait for the
decoder's resident kernel to leave, idle ``gpu_timeout_ms`` after its last step): entering and leaving ``library_stream`` on torch's
default and on a side stream, ``to_array`` and ``to_tensor`` of a small tensor, an empty CuPy
array, and single steps of a small LSTM cell - ``persistent_rnn.torch.LSTMCell`` (the fused step
kernel), its resident decoder (each step given the last one's state, as a decoding loop passes
it: the steady state's checks), and ``torch.nn.LSTMCell`` - so a decoding step's host time can be
split into its parts. Writes ``DIR/interop_cost.json``. ``--cpu``: CPU tensors (a check of the
script; the CPU path has no stream to enter).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import persistent_rnn.torch as prt
from persistent_rnn import benchmark
from persistent_rnn.torch.interop import library_stream, to_array, to_tensor

HIDDEN, BATCH = 64, 1
CPU_HIDDEN = 8


def mean_us(op: Callable[[], object], repeats: int) -> float:
    """Mean host µs of ``op`` over ``repeats`` calls (after as many warm-up calls, ten at most)."""
    for _ in range(min(10, repeats)):
        op()
    t0 = time.perf_counter()
    for _ in range(repeats):
        op()
    return (time.perf_counter() - t0) / repeats * 1e6


def _entered(t: torch.Tensor) -> None:
    with library_stream(t):
        pass


def operations(device: str, hidden: int,
               resources: contextlib.ExitStack) -> dict[str, Callable[[], object]]:
    """The timed operations by name (the decoder they step is closed with ``resources``)."""
    torch.manual_seed(0)
    t = torch.randn(BATCH, hidden).to(device)
    array = to_array(t)
    ops: dict[str, Callable[[], object]] = {
        "library_stream": lambda: _entered(t),
        "to_array": lambda: to_array(t),
        "to_tensor": lambda: to_tensor(array),
    }
    if device == "cuda":
        import cupy
        side = torch.cuda.Stream()

        def on_side() -> None:
            with torch.cuda.stream(side):
                _entered(t)
        ops["library_stream (side stream)"] = on_side
        ops["cupy.empty"] = lambda: cupy.empty((BATCH, 4 * hidden), "float32")
    cell = prt.LSTMCell(hidden, hidden, algo="persistent").to(device)
    reference = torch.nn.LSTMCell(hidden, hidden).to(device)
    decoder = resources.enter_context(cell.decoder(batch=BATCH))
    ops["prt.LSTMCell step"] = lambda: cell(t)
    ops["decoder.step"] = _fed_back(decoder.step, t)
    ops["torch.nn.LSTMCell step"] = lambda: reference(t)
    return ops


def _fed_back(step: Callable[..., object], x: torch.Tensor) -> Callable[[], object]:
    """``step(x, state)`` with the state its last call returned (None at first)."""
    state = None

    def op() -> object:
        nonlocal state
        state = step(x, state)
        return state
    return op


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--cpu", action="store_true", help="CPU tensors (a check of the script)")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    repeats, hidden = (min(args.repeats, 3), CPU_HIDDEN) if args.cpu else (args.repeats, HIDDEN)
    record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(not args.cpu),
              "repeats": repeats, "us": {}}
    with torch.no_grad(), contextlib.ExitStack() as resources:
        for name, op in operations(device, hidden, resources).items():
            record["us"][name] = mean_us(op, repeats)
            print(f"{record['us'][name]:9.2f} us  {name}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interop_cost.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
