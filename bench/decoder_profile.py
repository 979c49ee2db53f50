"""Where a decoding step's time goes: the host's functions in eager steps, the device's kernels
in a captured loop.

    python bench/decoder_profile.py --out DIR [--cpu]

For ``persistent_rnn.torch.LSTMCell`` (H=640, B=1, ``algo="persistent"``): its resident decoder
(``decoder.step``: one step kernel a step, the input projection inside the resident CTAs) and
the cell's own call (the fused step kernel), and ``torch.nn.LSTMCell``
beside them. For each: a cProfile of ``--steps`` eager steps (the top functions by own time) and
``torch.profiler``'s device time per kernel per step over a CUDA-graph replay of the same loop
(the device alone, no host work). Writes ``DIR/decoder_profile.txt``. ``--cpu``: CPU tensors,
the emulation, tiny sizes, no graph (a check of the script).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

import persistent_rnn.torch as prt
from persistent_rnn import benchmark

HIDDEN, BATCH = 640, 1
CPU_HIDDEN = 16


def _loop(step, x0: torch.Tensor, steps: int):
    def loop():
        x, state = x0, None
        for _ in range(steps):
            state = step(x, state)
            x = state[0]
        return x
    return loop


def host_profile(loop) -> str:
    """cProfile of one call of ``loop`` (after one warm-up call): the top 25 by own time."""
    loop()
    return benchmark.profile_text(loop)


def device_profile(loop, steps: int, before_replay: Callable[[], object] | None) -> str:
    """Device µs per step by kernel over a CUDA-graph replay of ``loop`` (the second replay,
    each after ``before_replay()``)."""
    replay = benchmark.torch_graph_replay(loop, before_replay)
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    rows = sorted(((us, n, name) for name, (us, n)
                   in benchmark.device_activities(prof, steps).items()), reverse=True)
    return "\n".join(f"{us:9.2f} us/step x{n:.2f}  {name[:110]}" for us, n, name in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--cpu", action="store_true", help="CPU tensors, the emulation, tiny sizes")
    args = p.parse_args(argv)
    device, hidden = ("cpu", CPU_HIDDEN) if args.cpu else ("cuda", HIDDEN)
    steps = min(args.steps, 3) if args.cpu else args.steps
    torch.manual_seed(0)
    x0 = torch.randn(BATCH, hidden).to(device)
    ours = prt.LSTMCell(hidden, hidden, algo="persistent").to(device)
    theirs = torch.nn.LSTMCell(hidden, hidden).to(device)
    sections = []
    with torch.no_grad(), ours.decoder(batch=BATCH) as dec:
        for name, step, before_replay in (
                ("decoder.step", dec.step, dec.resume), ("prt.LSTMCell (fused step)", ours, None),
                ("torch.nn.LSTMCell", theirs, None)):
            loop = _loop(step, x0, steps)
            sections.append(f"== {name}: host, {steps} eager steps\n{host_profile(loop)}")
            if not args.cpu:
                try:
                    text = device_profile(loop, steps, before_replay)
                except Exception as exc:  # noqa: BLE001 -- a capture that fails is reported
                    text = f"{type(exc).__name__}: {exc}"
                sections.append(f"== {name}: device, a captured loop replayed\n{text}")
            print(sections[-1][:3000], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decoder_profile.txt").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
