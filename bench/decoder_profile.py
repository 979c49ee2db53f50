"""Where a decoding step's time goes: the host's functions in eager steps, the device's kernels
in a captured loop.

    python bench/decoder_profile.py --out DIR [--cpu]

For ``persistent_rnn.torch.LSTMCell`` (H=640, B=1, ``algo="persistent"``): its resident decoder
(``decoder.step``: one step kernel a step, the input projection inside the resident CTAs) and
the cell's own call (the fused step kernel), and ``torch.nn.LSTMCell``
beside them. For each: a cProfile of ``--steps`` eager steps (the top functions by own time) and
``torch.profiler``'s device time per kernel per step over a CUDA-graph replay of the same loop
(the device alone, no host work) - for the library's cell over eager steps instead: with
``algo="persistent"`` it refuses capture (docs/torch.md; under capture ``"auto"`` runs torch's
cell). Each profiled loop is waited for on the caller's stream, and the decoder is closed inside
the profile: its resident kernel leaves at once, not at its idle deadline (``gpu_timeout_ms``
after the last step), which the profiler's closing device-wide synchronisation would wait for.
Kernels launched less than once a step (the resident kernel's launch, whose device time is its
lifetime - waits between steps included -, the decoder's STOP, a zero state) are listed per loop,
apart from the per-step ones. Writes ``DIR/decoder_profile.txt``. ``--cpu``: CPU tensors, the
emulation, tiny sizes, no device profile (a check of the script).
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
RESIDENT_KERNEL = "prnn_resident_decoder"  # (resident_decoder.cu)
NOT_CAPTURABLE = ("not capturable: algo='persistent' refuses CUDA graph capture (docs/torch.md), "
                  "so these are eager steps")


def _loop(step, x0: torch.Tensor, steps: int):
    def loop():
        x, state = x0, None
        for _ in range(steps):
            state = step(x, state)
            x = state[0]
        return x
    return loop


def host_profile(loop, steps: int) -> str:
    """cProfile of one call of ``loop`` of ``steps`` steps (after one warm-up call): the top 25
    by own time, µs per step."""
    loop()
    return benchmark.profile_text(loop, calls=steps)


def device_profile(run: Callable[[], object], steps: int,
                   end: Callable[[], object] | None = None) -> str:
    """Device time by kernel over one ``run()`` of ``steps`` steps (a captured loop's replay, or
    the eager loop), after a warm-up run; each run waited for on the caller's stream, then
    ``end()`` (a decoder's ``close``) inside the profile."""
    run()
    benchmark.torch_stream_done(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        benchmark.torch_stream_done(True)
        if end is not None:
            end()
    return activity_table(benchmark.device_activities(prof, steps), steps)


def activity_table(found: dict[str, tuple[float, float]], steps: int) -> str:
    """``found`` (``benchmark.device_activities``: µs and count per step by name) as text: the
    kernels launched at least once a step per step, with their sum, then the others per loop."""
    rows = sorted(((us, n, name) for name, (us, n) in found.items()), reverse=True)
    per_step = [r for r in rows if r[1] >= 1]
    lines = [f"{us:9.2f} us/step x{n:.2f}  {name[:110]}" for us, n, name in per_step]
    lines.append(f"{sum(us for us, _, _ in per_step):9.2f} us/step in all")
    once = [r for r in rows if r[1] < 1]
    if once:
        lines.append(f"less than once a step (per loop of {steps} steps, not step work):")
    for us, n, name in once:
        note = ("  (its lifetime: the waits between steps included)"
                if name.startswith(RESIDENT_KERNEL) else "")
        lines.append(f"{us * steps:9.2f} us x{n * steps:.0f}  {name[:110]}{note}")
    return "\n".join(lines)


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
        # (name, step, captured, before each replay, the end of the profiled run)
        for name, step, captured, before_replay, end in (
                ("decoder.step", dec.step, True, dec.resume, dec.close),
                ("prt.LSTMCell (fused step)", ours, False, None, None),
                ("torch.nn.LSTMCell", theirs, True, None, None)):
            loop = _loop(step, x0, steps)
            sections.append(f"== {name}: host, {steps} eager steps\n{host_profile(loop, steps)}")
            if not args.cpu:
                title = "a captured loop replayed" if captured else NOT_CAPTURABLE
                try:
                    run = benchmark.torch_graph_replay(loop, before_replay) if captured else loop
                    text = device_profile(run, steps, end)
                except Exception as exc:  # noqa: BLE001 -- a road that fails is reported
                    text = f"{type(exc).__name__}: {exc}"
                sections.append(f"== {name}: device, {title}\n{text}")
            print(sections[-1][:3000], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decoder_profile.txt").write_text("\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
