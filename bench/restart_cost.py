"""Cost of one restart of the persistent kernel: time with a stall minus time without, minus the stall.

    python bench/restart_cost.py --out DIR [--cell lstm] [--hidden 512] [--batch 4] [--seq-len 200]

``prnn.inject_stall(block=0, step=T/2, duration_ms=d)`` makes one CTA sleep ``d`` ms before a
barrier. With the barrier timeout ``--timeout-ms`` below ``d`` the other CTAs give up, the kernel
exits and the host restarts from the last completed step (``last_run.restarts`` == 1), so
``cost = t(stall) - t(no stall) - d`` is what one restart adds (timeout wait, control-block copy,
launch, weight reload). Stalls shorter than the timeout are the control: no restart, cost ~ 0.
Times are medians of CUDA-event timings of the forward pass.
"""
from __future__ import annotations

import sys

import _study
import numpy as np

import persistent_rnn as prnn
from persistent_rnn import timing
from persistent_rnn.cells import CELLS, layer_args

NAME = "restart_cost"


def forward_seconds(layer, xs, repeats: int, stall_ms: float | None) -> tuple[float, int]:
    """Median forward seconds (with a stall of ``stall_ms`` in each run if given) and the last restarts."""
    clock = timing.CudaEventClock()
    steps = xs[0].shape[0]

    def run(x):
        if stall_ms is None:
            layer.forward(x)
        else:
            with prnn.inject_stall(block=0, step=steps // 2, duration_ms=stall_ms):
                layer.forward(x)
    seconds = timing.median_seconds(run, xs, repeats, warmup=2, clock=clock)
    return seconds, layer.last_run.restarts


def draw(ax, doc) -> None:
    """Cost per stall duration; restarted runs and controls in two colours."""
    for restarted, colour in ((True, "tab:red"), (False, "tab:blue")):
        rows = [r for r in doc["rows"] if (r["restarts"] > 0) == restarted]
        ax.bar([str(r["stall_ms"]) for r in rows], [r["cost_us"] for r in rows], color=colour,
               label="restarted" if restarted else "no restart (stall < timeout)")
    ax.set_xlabel(f"stall (ms), barrier timeout {doc['settings']['timeout_ms']} ms")
    ax.set_ylabel("t(stall) - t(none) - stall  (us)")
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--cell", default="lstm", choices=tuple(CELLS))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=200)
    p.add_argument("--timeout-ms", type=float, default=5.0)
    p.add_argument("--stalls-ms", default="1,2,10,20,50", help="comma-separated stall durations")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    _study.require_gpu(NAME)
    import cupy as cp
    stalls = [float(s) for s in args.stalls_ms.split(",")][: 3 if args.quick else None]
    mode, extra = layer_args(args.cell)
    layer = getattr(prnn, mode)(64, args.hidden, algo="persistent", seed=0, **extra)
    layer.load_params({k: cp.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(0)
    xs = [cp.asarray(rng.standard_normal((args.seq_len, args.batch, 64)).astype("float32")) for _ in range(3)]
    with prnn.override_settings(gpu_timeout_ms=args.timeout_ms):
        base, _ = forward_seconds(layer, xs, args.repeats, None)
        rows = []
        for stall in stalls:
            seconds, restarts = forward_seconds(layer, xs, args.repeats, stall)
            rows.append({"stall_ms": stall, "base_us": base * 1e6, "with_stall_us": seconds * 1e6,
                         "restarts": restarts, "fallback": layer.last_run.fallback,
                         "cost_us": (seconds - base - stall / 1e3) * 1e6})
            print(f"stall {stall:6.1f} ms: restarts {restarts}, cost {rows[-1]['cost_us']:9.1f} us")
    settings = {"cell": args.cell, "hidden_size": args.hidden, "batch": args.batch, "seq_len": args.seq_len,
                "input_size": 64, "timeout_ms": args.timeout_ms, "repeats": args.repeats, "stall_block": 0,
                "stall_step": args.seq_len // 2, "timing": "CUDA events, median, forward pass"}
    _study.save(args.out, NAME, _study.document(settings, rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
