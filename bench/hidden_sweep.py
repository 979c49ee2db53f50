"""TFLOP/s against hidden size, up to the persistent kernel's ``max_hidden_size`` on this GPU.

    python bench/hidden_sweep.py --out DIR [--batch 4] [--seq-len 100] [--quick]

Hidden sizes: powers of two from 128 and the cell's ``prnn.max_hidden_size`` itself; algorithms
persistent, GEMM and cuDNN (torch, TF32 off); forward and forward+backward.
"""
from __future__ import annotations

import sys

import _study

import persistent_rnn as prnn
from persistent_rnn import benchmark

NAME = "hidden_sweep"


def hidden_sizes(largest: int, quick: bool) -> tuple[int, ...]:
    """128, 256, ... below ``largest``, then ``largest`` (every other power when ``quick``)."""
    sizes, h = [], 128
    while h < largest:
        sizes.append(h)
        h *= 4 if quick else 2
    return tuple(sizes + [largest])


def main(argv: list[str] | None = None) -> int:
    """Run the study; exit status 2 without a GPU."""
    p = _study.parser(NAME, __doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=100)
    args = p.parse_args(argv)
    _study.require_gpu(NAME)
    rows, skipped, settings = [], [], {}
    cells = ("lstm",) if args.quick else ("rnn_tanh", "gru", "lstm")
    for cell in cells:
        largest = prnn.max_hidden_size(cell)
        sweep = benchmark.Sweep(cells=(cell,), hidden_sizes=hidden_sizes(largest, args.quick),
                                seq_lens=(args.seq_len,), batches=(args.batch,),
                                max_seconds=args.max_seconds / len(cells))
        results = benchmark.benchmark(sweep, True, sys.argv, progress=True)
        rows += results["points"]
        skipped += results["skipped"]
        settings[cell] = {**results["settings"], "max_hidden_size": largest}
    doc = _study.document(settings, rows)
    doc.update(skipped=skipped, flops_formula=benchmark.FLOPS_FORMULA)
    _study.save(args.out, NAME, doc, _study.tflops_lines("hidden_size", "hidden size"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
