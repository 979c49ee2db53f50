"""TFLOP/s of the recurrence against batch size (1..64): persistent vs GEMM vs cuDNN, per cell.

    python bench/batch_sweep.py --out DIR [--hidden 512] [--seq-len 100] [--quick]

Runs the ``prnn bench`` engine (same timing, FLOP formula and JSON points) at one hidden size.
"""
from __future__ import annotations

import sys

import _study

from persistent_rnn import benchmark

NAME = "batch_sweep"


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=100)
    args = p.parse_args(argv)
    _study.require_gpu(NAME)
    cells = ("lstm",) if args.quick else ("lstm", "gru", "rnn_tanh")  # headline first (time budget)
    sweep = benchmark.Sweep(cells=cells, hidden_sizes=(args.hidden,), seq_lens=(args.seq_len,),
                            max_seconds=args.max_seconds)
    results = benchmark.benchmark(sweep, True, sys.argv, progress=True)
    doc = _study.document(results["settings"], results["points"])
    doc.update(fp32_peak_tflops=results["fp32_peak_tflops"], skipped=results["skipped"],
               flops_formula=benchmark.FLOPS_FORMULA)
    _study.save(args.out, NAME, doc, _study.tflops_lines("batch", "batch size"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
