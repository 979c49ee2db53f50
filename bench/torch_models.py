"""Whole-model training-step time: persistent_rnn.torch against torch.nn, side by side in one run.

    python bench/torch_models.py --out DIR [--device cpu|cuda] [--steps 20] [--warmup 3]
                                 [--algo auto|gemm|persistent] [--threads N] [--models ...]

The three models of examples/torch_models.py (DeepSpeech2-like GRU+CTC, 2-layer LSTM language
model with truncated BPTT, LSTM decoder called one step at a time), each built twice from the same
seed — once with torch.nn's layers, once with persistent_rnn.torch's — and trained on the same
synthetic batches. Steps alternate between the two (in alternating order) so that both see the
same machine state; each step (forward, backward, SGD update) is timed with
``time.perf_counter`` (after ``torch.cuda.synchronize`` on a GPU). Writes
``DIR/torch_models.json`` with device, date, commit, command, settings, the machine's load
average (other work skews CPU timings) and per model: median, mean and min step time of each,
the ratio of medians (persistent_rnn / torch.nn) and what ``last_run`` says ran.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch_models  # noqa: E402  (examples/torch_models.py)

import persistent_rnn.torch as prt  # noqa: E402
from persistent_rnn import benchmark  # noqa: E402

NAMESPACES = {"torch.nn": torch.nn, "persistent_rnn.torch": prt}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_model(name: str, device: torch.device, steps: int, warmup: int, algo: str) -> dict:
    """Alternate training steps of the two builds of model ``name``; return their timings."""
    work = torch_models.MODELS[name]
    sizes = work.sizes["full"]
    runs = {}
    for label, rnn in NAMESPACES.items():
        torch.manual_seed(0)
        model = work.build(rnn, sizes, {} if rnn is torch.nn else {"algo": algo}).to(device)
        runs[label] = (model, torch.optim.SGD(model.parameters(), lr=0.01), {}, [])
    gen = torch.Generator().manual_seed(1)
    for i in range(warmup + steps):
        data = tuple(t.to(device) for t in work.batch(gen, sizes))
        # alternate which build goes first, so that neither always inherits the other's caches
        for model, opt, carry, times in list(runs.values())[::1 if i % 2 else -1]:
            _sync(device)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            work.step(model, data, carry)
            opt.step()
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    row = {"model": name, "sizes": sizes}
    for label, (model, _, _, times) in runs.items():
        row[label] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                      "mean_ms": 1e3 * statistics.mean(times)}
    row["ratio"] = row["persistent_rnn.torch"]["median_ms"] / row["torch.nn"]["median_ms"]
    last = runs["persistent_rnn.torch"][0].rnn.last_run
    row["persistent_rnn_last_run"] = {"algo": last.algo, "fallback": last.fallback}
    return row


def main(argv: list[str] | None = None) -> int:
    """Run every model; print one line each and write the JSON."""
    p = argparse.ArgumentParser(prog="bench/torch_models.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=20, help="timed steps per model and namespace")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--algo", default="auto", choices=["auto", "gemm", "persistent"],
                   help="persistent_rnn.torch's algo (the models with projections need auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--models", nargs="+", default=list(torch_models.MODELS),
                   choices=list(torch_models.MODELS))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        row = time_model(name, device, args.steps, args.warmup, args.algo)
        rows.append(row)
        print(f"{name:14s} torch.nn {row['torch.nn']['median_ms']:8.2f} ms  persistent_rnn.torch "
              f"{row['persistent_rnn.torch']['median_ms']:8.2f} ms  ratio {row['ratio']:.3f}  "
              f"({row['persistent_rnn_last_run']['algo']})", flush=True)
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "load_average_1_5_15_min": os.getloadavg(),
        **benchmark.run_stamp(["python", *sys.argv]),
        "settings": {"steps": args.steps, "warmup": args.warmup, "algo": args.algo,
                     "timing": "time.perf_counter per training step (zero_grad, forward, "
                               "backward, SGD step), steps alternating between the two builds; "
                               "median and min"},
        "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch_models.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out / 'torch_models.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
