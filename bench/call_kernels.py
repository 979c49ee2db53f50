"""The device work of one layer call, kernel by kernel: where a call's fixed cost goes.

    python bench/call_kernels.py --out DIR [--cpu]

For ``persistent_rnn.torch`` LSTM layers (``algo="persistent"``; H=1024, T=100, input 1024:
float32 at B=4 and float16 at B=8, the first timing points' layers) and torch.nn beside them,
forward and forward+backward: ``torch.profiler`` over ``--calls`` calls after warm-up, each
kernel's and memory operation's device time per call and count, and the host's time per call.
A call whose device time is far below its host time is bound by its submission; one whose
kernels beside the recurrence add up to much is bound by those. Writes ``DIR/call_kernels.json``
and ``DIR/call_kernels.txt``. ``--cpu``: CPU tensors and tiny sizes (a check of the script).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import persistent_rnn.torch as prt
from persistent_rnn import benchmark

LAYERS = [("float32", 4), ("float16", 8)]
HIDDEN, STEPS = 1024, 100
CPU_HIDDEN, CPU_STEPS = 16, 3


def make_call(road: str, dtype: torch.dtype, batch: int, hidden: int, steps: int,
              backward: bool, device: str):
    """A zero-argument call of one layer's forward (and backward)."""
    torch.manual_seed(0)
    cls = torch.nn.LSTM if road == "cudnn" else prt.LSTM
    kw = {} if road == "cudnn" else {"algo": "persistent"}
    layer = cls(hidden, hidden, **kw).to(device=device, dtype=dtype)
    x = torch.randn(steps, batch, hidden).to(device=device, dtype=dtype)
    x.requires_grad_(backward)

    def call():
        y, _ = layer(x)
        if backward:
            y.sum().backward()
    return call


def profile_call(call, calls: int, cuda: bool) -> dict:
    """Device time per call by kernel name (µs), their count per call, and host µs per call."""
    for _ in range(3):
        call()
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    kernels = {name: {"us_per_call": us, "count_per_call": n}
               for name, (us, n) in benchmark.device_activities(prof, calls).items()}
    total = sum(k["us_per_call"] for k in kernels.values())
    return {"host_us_per_call": host_us, "device_us_per_call": total, "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="CPU tensors, tiny sizes")
    args = p.parse_args(argv)
    cuda = not args.cpu
    hidden, steps = (CPU_HIDDEN, CPU_STEPS) if args.cpu else (HIDDEN, STEPS)
    record = {**benchmark.run_stamp(sys.argv), **benchmark.device_record(cuda), "rows": []}
    lines = []
    for dtype_name, batch in LAYERS:
        dtype = getattr(torch, dtype_name)
        for backward in (False, True):
            for road in ("prnn_torch", "cudnn"):
                name = f"lstm_h{hidden}_b{batch}_{dtype_name} {'fwd+bwd' if backward else 'fwd'} {road}"
                try:
                    row = profile_call(make_call(road, dtype, batch, hidden, steps, backward,
                                                 "cuda" if cuda else "cpu"), args.calls, cuda)
                except Exception as exc:  # noqa: BLE001 -- a road that cannot run is reported
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                record["rows"].append({"case": name, **row})
                rows = [f"== {name}: " + (row["error"] if "error" in row else
                        f"host {row['host_us_per_call']:.1f} us/call, device "
                        f"{row['device_us_per_call']:.1f} us/call")]
                heaviest = sorted(row.get("kernels", {}).items(),
                                  key=lambda kv: -kv[1]["us_per_call"])[:12]
                rows += [f"   {v['us_per_call']:9.1f} us x{v['count_per_call']:.1f}  {k[:110]}"
                         for k, v in heaviest]
                print("\n".join(rows), flush=True)
                lines += rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "call_kernels.json").write_text(json.dumps(record, indent=1))
    (args.out / "call_kernels.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
