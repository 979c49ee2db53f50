"""The ``prnn`` command: ``info``, ``bench``, ``kernels``, ``plan`` and ``demo`` (also
``python -m persistent_rnn.cli``).

    prnn info [--json]                       GPU, clocks, versions, largest hidden sizes
    prnn bench [--quick] [--json] [--out DIR] [sweep options]
    prnn kernels [--arch 80,90] [--json]     compiled kernel configurations (kernel_report)
    prnn plan CELL HIDDEN [--batch B] [--verbose] [--json]   placement, predicted µs/step
    prnn demo [--out DIR]                    every cell on NumPy; predicted vs recorded cuDNN

Every command runs with the core dependencies alone (``prnn kernels`` and ``prnn plan`` need
NVRTC: without the ``cuda13`` extra they stop with one line saying so) and ends with a one-line
error, never a traceback, on bad options, an unwritable ``--out`` or a reader that closed the pipe.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from . import benchmark
from .cells import PROJECTION_CELL
from .extras import install_hint
from .hardware import PORTABLE_CLUSTER_CTAS

DEFAULT_OUT = "prnn_bench_results"
# The extra that installs each optional top-level module a command may import.
EXTRAS = {"cupy": "cuda13", "cupy_backends": "cuda13", "torch": "torch", "matplotlib": "bench"}


def _positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: a comma-separated list of positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _choices(allowed: tuple[str, ...]):
    """argparse type: a comma-separated subset of ``allowed``."""
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip().lower() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, "
                                             f"got {text!r}")
        return values
    return parse


def _at_least(low: float, kind=int):
    """argparse type: a number >= ``low``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= {low}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``prnn`` argument parser with its five subcommands."""
    parser = argparse.ArgumentParser(prog="prnn", description="persistent_rnn command line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,bench,kernels,plan,demo}")
    p_info = sub.add_parser("info", help="GPU, clocks, driver/CUDA versions, max hidden sizes")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    b = sub.add_parser("bench", help="sweep batch/hidden/T/cell/pass over the algorithms",
                       description="Benchmark sweep; defaults depend on --quick and on whether a GPU is present.")
    b.add_argument("--quick", action="store_true", help="a short sweep")
    b.add_argument("--json", action="store_true", help="results JSON to stdout, table to stderr")
    b.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=f"output directory (default {DEFAULT_OUT})")
    b.add_argument("--cpu", action="store_true", help="run the NumPy GEMM path even where a GPU is present")
    b.add_argument("--cells", type=_choices(benchmark.CELL_NAMES), help="e.g. lstm,gru")
    b.add_argument("--batches", type=_positive_ints, help=f"default {','.join(map(str, benchmark.BATCHES))}")
    b.add_argument("--hidden", type=_positive_ints, help="hidden sizes, e.g. 256,512")
    b.add_argument("--seq-len", type=_positive_ints, help="sequence lengths T")
    b.add_argument("--passes", type=_choices(benchmark.PASSES), help="forward,forward_backward")
    b.add_argument("--algos", type=_choices(benchmark.BENCH_ALGOS),
                   help=",".join(benchmark.BENCH_ALGOS))
    b.add_argument("--dtype", choices=benchmark.BENCH_DTYPES,
                   help="layer dtype, torch.nn in the same dtype (default float32)")
    b.add_argument("--input-size", type=_at_least(1), help="layer input size (default 64)")
    b.add_argument("--proj-size", type=_at_least(1),
                   help="LSTM projection width P (torch.nn's proj_size; --cells lstm only)")
    b.add_argument("--layers", type=_at_least(1),
                   help="stacked layers per point (default 1; persistent: stack mode where it fits)")
    b.add_argument("--repeats", type=_at_least(10), help="timed repetitions per point, >= 10 (default 10)")
    b.add_argument("--max-seconds", type=_at_least(1.0, float), help="time budget; later points are skipped")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.add_parser("kernels", help="compiled kernel configurations (prnn kernels --help)", add_help=False)
    pl = sub.add_parser("plan", help="placement of a layer and its predicted µs per step (no GPU needed)")
    pl.add_argument("cell", help="RNN, GRU, LSTM, rnn_tanh, rnn_relu")
    pl.add_argument("hidden", type=_at_least(1), help="hidden size")
    pl.add_argument("--batch", type=_at_least(1), default=1, help="batch size (default 1)")
    pl.add_argument("--layers", type=_at_least(1), default=1, help="stacked layers (default 1)")
    pl.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    pl.add_argument("--proj-size", type=_at_least(1), default=0,
                    help="LSTM projection width P (torch.nn's proj_size; LSTM only)")
    pl.add_argument("--device", choices=("h100", "h200", "a100"), default="h100")
    pl.add_argument("--json", action="store_true", help="print JSON instead of text")
    pl.add_argument("--verbose", action="store_true",
                    help="where the layer does not fit, every tile tried and why")
    pl.add_argument("--decoder", action="store_true",
                    help="also predict a resident decoder's step and the fused step (float32)")
    pl.add_argument("--tf32", action="store_true",
                    help="plan as with settings.allow_tf32 (float32: the TF32 tensor-core tiles "
                         "where predicted faster)")
    d = sub.add_parser("demo", help="forward/backward of every cell (NumPy); without a GPU, "
                                    "predicted persistent step times beside recorded cuDNN ones")
    d.add_argument("--out", type=Path, default=Path("out"), help="where the plot goes (default out)")
    return parser


def _sweep_from_args(args: argparse.Namespace, gpu: bool) -> benchmark.Sweep:
    """The default sweep with the options given on the command line."""
    given = {"cells": args.cells, "batches": args.batches, "hidden_sizes": args.hidden,
             "seq_lens": args.seq_len, "passes": args.passes, "algos": args.algos,
             "dtype": args.dtype, "input_size": args.input_size, "proj_size": args.proj_size,
             "num_layers": args.layers, "repeats": args.repeats, "max_seconds": args.max_seconds}
    sweep = replace(benchmark.default_sweep(gpu, args.quick), **{k: v for k, v in given.items() if v is not None})
    if sweep.proj_size and sweep.cells != (PROJECTION_CELL.name,):
        raise ValueError(f"--proj-size needs --cells {PROJECTION_CELL.name} (only the "
                         f"{PROJECTION_CELL.label} has a projection), got cells "
                         f"{','.join(sweep.cells)}")
    return sweep


def run_info(args: argparse.Namespace, argv: list[str]) -> int:
    """``prnn info`` (with ``--json``, stamped with the commit, command and date of the run)."""
    from . import info
    report = info.collect()
    if args.json:
        report.update(benchmark.run_stamp(["prnn", *argv]))
    print(json.dumps(report, indent=1) if args.json else info.format_text(report))
    return 0


def _writable(folder: Path) -> None:
    """OSError unless files can be created in ``folder`` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    """``prnn bench``: sweep, table (stdout, or stderr with --json), JSON and PNG into --out."""
    try:
        _writable(args.out)  # before the sweep, not after minutes of it
    except OSError as exc:
        return _error("bench", f"--out {args.out}: cannot write there ({exc.strerror or exc})")
    gpu = not args.cpu and benchmark.gpu_available()
    try:
        results = benchmark.benchmark(_sweep_from_args(args, gpu), gpu, ["prnn", *argv],
                                      progress=not args.no_progress)
    except ValueError as exc:
        return _error("bench", str(exc))
    try:
        json_path, png_path = benchmark.write_outputs(results, args.out)
    except OSError as exc:
        return _error("bench", f"--out {args.out}: cannot write there ({exc.strerror or exc})")
    table = sys.stderr if args.json else sys.stdout
    print(benchmark.format_table(results), file=table)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else
                                  f" (no plot: {install_hint('bench')})"),
          file=table)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """``prnn plan``: the planner's placement and the latency model's prediction (exit 1: no fit)."""
    from . import latency, plan
    try:
        device = replace(plan.resolve_device(args.device), allow_tf32=True) if args.tf32 \
            else args.device
        record = latency.plan_report(args.cell, args.hidden, args.batch, args.layers, args.dtype,
                                     device, args.proj_size)
    except ValueError as exc:
        return _error("plan", str(exc))
    if not record["fits"]:
        return _plan_not_fit(args, record)
    if getattr(args, "decoder", False) and args.dtype == "float32":
        record["decoder"] = latency.predict_decoder_step(args.cell, args.hidden, args.batch,
                                                         device=args.device, layers=args.layers)
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    proj = f" proj_size={args.proj_size}" if args.proj_size else ""
    print(f"{record['cell']} H={args.hidden}{proj} B={args.batch} layers={args.layers} {args.dtype} on {args.device}")
    tile = record["tile"]
    print(f"placement: {tile['placement']}, {tile['units']} units per CTA{_tensor_cores(tile)}")
    # (a backward on another tile than the forward's: how many units a CTA of it holds)
    units = (f", {tile['backward_units']} units per CTA"
             if tile["backward_units"] != tile["units"] else "")
    widened = tile.get("widened") or []
    if widened:
        print(f"  ({' and '.join(widened)} on the fp32 tile"
              f"{units if widened == ['backward'] else ''}, {args.dtype} weights widened "
              f"to fp32: predicted faster than the {args.dtype} tiles at this batch)")
    if tile["backward_placement"] != tile["placement"]:
        print(f"  (backward on the {tile['backward_placement']}{units}: predicted faster there)")
    if record["forward"]["ctas"] > PORTABLE_CLUSTER_CTAS and tile["cluster"]:
        print(f"  (a cluster of {record['forward']['ctas']} CTAs: larger than CUDA's portable "
              f"{PORTABLE_CLUSTER_CTAS}; where the GPU cannot hold it, the layer is planned "
              f"again at {PORTABLE_CLUSTER_CTAS}, and PRNN_MAX_CLUSTER_CTAS caps it)")
    for name in ("forward", "backward"):
        p, t = record[name], record[f"{name}_terms"]
        print(f"{name:8}: {p['ctas']} CTAs x {p['block']} threads, {p['registers']} registers "
              f"({p['weights_per_thread']} weights per thread), {p['shared_bytes']} B shared"
              f"{_groups(p, args.batch)}; "
              f"predicted {t['total_us']:.2f} µs/step (issue {t['issue_us']:.2f}, matrix "
              f"{t['matrix_us']:.2f}, barriers {t['barrier_us']:.2f}, exchange {t['exchange_us']:.2f} "
              f"[{t['exchange']}], pointwise {t['pointwise_us']:.2f}, prefetch "
              f"{t['prefetch_us']:.2f})")
    calls = record["per_call"]
    layer = " of one layer" if args.layers > 1 else ""
    print(f"per call{layer} (predicted; input size {calls['input_size']}, host: API calls plus "
          f"the library's Python - a planned call: one graph launch, the Python measured on the "
          f"CPU as a replay runs it, scaled to the host time an H200's run measured):")
    _print_call_rows(calls["rows"])
    whole = record.get("stack_per_call")
    if whole and whole["rows"]:
        print(f"per call of the stack of {args.layers} ({whole['mode']}; predicted: one graph "
              f"launch a pass for all its chains, the Python a layer's plus each further "
              f"layer's measured increment):")
        _print_call_rows(whole["rows"])
    if args.layers > 1:
        print(f"stack of {args.layers}, one launch per layer: predicted "
              f"{record['stack_forward_us']:.2f} / {record['stack_backward_us']:.2f} µs per step")
        sm = record.get("stack_mode", {"fits": False, "reason": "a projection has no stack mode"})
        if sm["fits"]:
            print(f"stack mode: 1 launch per pass, {sm['ctas']} CTAs x {sm['block']} threads "
                  f"({sm['units']} units per CTA per layer), {sm['steps_in_series']} steps in "
                  f"series at T={sm['seq_len']}; predicted pass {sm['forward_pass_us']:.0f} / "
                  f"{sm['backward_pass_us']:.0f} µs (one launch per layer: "
                  f"{sm['apart_forward_pass_us']:.0f} / {sm['apart_backward_pass_us']:.0f} µs)"
                  + _tensor_cores(sm))
            if sm["widened"]:
                print(f"  ({' and '.join(sm['widened'])} on the fp32 stack's tiles, {args.dtype} "
                      f"weights widened to fp32: predicted faster than the {args.dtype} stack's at "
                      "this batch)")
        else:
            print(f"stack mode: no ({sm['reason']})")
    if "decoder" in record:
        _print_decoder(record["decoder"])
    print(f"(a prediction of the latency model, not a measurement: {record['calibration']})")
    return 0


def _print_call_rows(rows: list[dict]) -> None:
    """``prnn plan``'s per-call lines (``latency.per_call_report``'s rows, or a stack's)."""
    for row in rows:
        print(f"  T={row['seq_len']:<5} host {row['forward_host_us']:.0f} / "
              f"{row['backward_host_us']:.0f} µs ({row['forward_api_calls']} / "
              f"{row['backward_api_calls']} calls + {row['forward_python_us']:.0f} / "
              f"{row['backward_python_us']:.0f} µs Python), GPU beside the steps "
              f"{row['forward_device_us']:.0f} / {row['backward_device_us']:.0f} µs; end to end "
              f"{row['forward_us_per_step']:.2f} µs/step forward, "
              f"{row['forward_backward_us_per_step']:.2f} forward+backward")


def _print_decoder(d: dict) -> None:
    """``prnn plan --decoder``'s lines (predictions)."""
    print(f"fused step kernel: predicted {d['fused_step_us']:.2f} µs a step (input size "
          f"{d['input_size']}), {d['fused_eager_us']:.2f} µs eager (host-bound: its Python "
          f"counted on the CPU, scaled to the H200's host, and its launch; through the torch "
          f"cell {d['torch_fused_eager_us']:.2f})")
    if not d["resident"]:
        print(f"resident decoder: no ({d['reason']})")
        return
    stack = (f" ({d['layers']} layers: one resident launch, one launch a step)"
             if d.get("layers", 1) > 1 else "")
    print(f"resident decoder{stack}: {d['ctas']} CTAs held; predicted per step {d['captured_us']:.2f} µs "
          f"captured in a CUDA graph (projection {d['projection_us']:.2f}, hand-offs "
          f"{d['handoff_us']:.2f}, resident step after the post {d['resident_step_us']:.2f}), "
          f"{d['eager_us']:.2f} µs eager (host {d['host_us']:.2f}; through the torch module "
          f"{d['torch_eager_us']:.2f}); step_projected "
          f"{d['projected_us']:.2f} µs captured")
    left = d["ahead_left_us"]
    when = ("the graph's gap hides it back to back" if left == 0 else
            f"{left:.2f} µs of it left back to back; {d['captured_between_us']:.2f} µs a step with "
            f"the caller's kernels between steps (assumed to take >= {d['ahead_us']:.2f} µs)")
    print(f"  recurrent half (W_hh h + b_hh, {d['ahead_us']:.2f} µs) computed between steps from "
          f"the decoder's last h': {when}; a state other than the last output recomputes it "
          "inside the step")
    if "w_ih" in d:
        print(f"  projection: {d['w_ih']}")
    print(f"  ({d['measured_miss']})")


def _tensor_cores(record: dict) -> str:
    """What of a plan record (a layer's tile, or the stack-mode record) runs on the tensor
    cores, as a clause of ``prnn plan``'s line ("" for none)."""
    passes = "forward and backward" if record.get("tensor_cores_backward") else "forward"
    if record.get("tf32"):
        return f", {passes} on the tensor cores in TF32 (mma.m16n8k8)"
    return f", {passes} on the tensor cores (mma.m16n8k16)" if record.get("tensor_cores") else ""


def _plan_not_fit(args: argparse.Namespace, record: dict) -> int:
    """``prnn plan`` of a layer that does not fit (exit 1): what limits it, the largest hidden
    size that fits and what runs instead (``plan.not_fit_lines``); every tile tried only with
    ``--json`` or ``--verbose``."""
    from . import plan
    lines = plan.not_fit_lines(args.cell, args.hidden, args.batch, args.dtype, args.device,
                               args.proj_size)
    if args.json:
        print(json.dumps({**record, "explanation": lines}, indent=1))
        return 1
    print("\n".join(lines))
    if args.verbose:
        print("tiles tried:", *record["tried"], sep="\n  ")
    else:
        print("(every tile tried and why: --verbose or --json)")
    return 1


def _groups(p: dict, batch: int) -> str:
    """A pass's batch groups (plan.batch_group), as ``prnn plan`` shows them."""
    group = p.get("batch_group", 0)
    if not group:
        return ""
    return f" ({-(-batch // group)} batch groups of {group} rows: the whole batch does not fit)"


def run_kernels(argv: list[str]) -> int:
    """``prnn kernels``: kernel_report's own parser and table (``prnn kernels --help``)."""
    from . import kernel_report
    try:
        return kernel_report.main(argv)
    except ValueError as exc:  # an --arch the kernels cannot be built for
        return _error("kernels", str(exc))


def _error(command: str, message: str, status: int = 2) -> int:
    print(f"prnn {command}: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``prnn`` console script; returns the exit status.

    A missing optional dependency ends the command with one line naming the extra to install
    (status 1); a closed stdout (``prnn kernels | head``) ends it quietly (status 141, as for a
    process killed by SIGPIPE)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # here, so that a closed pipe is seen below and not at exit
        return status
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        command = argv[0] if argv else "prnn"
        return _error(command, f"needs the {extra} extra ({exc.name} is not installed): "
                               + install_hint(extra), status=1)
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["kernels"]:  # its own parser, so that `prnn kernels --help` shows its options
        return run_kernels(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return run_info(args, argv)
    if args.command == "bench":
        return run_bench(args, argv)
    if args.command == "plan":
        return run_plan(args)
    from . import demo
    demo.main(["--out", str(args.out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
