"""The sweep engine behind ``prnn bench``: time one layer per point, write JSON, table and plot.

A point is (cell, pass, algo, batch, hidden_size, seq_len, dtype, proj_size, num_layers): a
unidirectional layer with ``input_size`` inputs - one layer, or a stack of ``num_layers`` (which
persistent_rnn runs in stack mode where the planner places it, ``settings.stack``), and for the
LSTM an optional projection of width ``proj_size`` (torch.nn's ``proj_size``). ``pass`` is
``forward`` or ``forward_backward``; ``algo`` is ``gemm`` or ``persistent`` (persistent_rnn's
layers with that ``algo``), ``prnn_torch`` (the drop-in ``persistent_rnn.torch`` module with
``algo="persistent"`` on CUDA tensors: the same kernels behind torch's dispatch, and the way
bfloat16 reaches them on a GPU) or ``cudnn`` (``torch.nn``'s RNN/GRU/LSTM on CUDA, with TF32 off
for fp32). The time covers the layer call, input projection included; ``us_per_step`` is it
divided by ``seq_len``.

``restarts`` and ``fallback`` of a library point are those of *every* call it made (warm-up and
timed, forward and backward: restarts summed, the first fallback), so a point that fell back to
the GEMM path in any call is never reported as the persistent kernel's time; ``passes_checked``
says how many passes' ``last_run`` were read. ``spread`` is (slowest - fastest) / median of the
timed repeats: differences below it are noise.

FLOPs counted (the recurrence only; G gates, batch B, hidden H), per step and layer:
forward ``2*G*B*H^2`` (``W_hh h_{t-1}``), forward_backward ``4*G*B*H^2`` (plus the backward
recurrence's ``W_hh^T dgh_t``; the weight-gradient GEMM ``dW_hh`` is not counted); with a
projection of width P, ``2*B*(G*H*P + P*H)`` forward (``W_hh r_{t-1}`` and ``W_hr h_t``), twice
that for forward_backward; a stack counts every layer's recurrence (not the input projections of
the layers above the first).
``tflops = flops_per_step / us_per_step / 1e6``; ``peak_fraction = tflops / fp32 peak``
(``info.fp32_peak_tflops``). ``activation_bytes`` are those of ``y``, ``cs`` (LSTM) and ``saved``:
``T*B*H*(1 + [LSTM] + S)*itemsize`` (4 for 16-bit layers, which keep them in fp32); with a
projection or a stack, the arrays of ``functional.saved_shapes``.

Each persistent (and ``prnn_torch``) point also carries ``predicted_us_per_step``: the latency
model's *prediction* (``persistent_rnn.latency``, per-call terms spread over T steps as
``StepTime.benchmark_us``), or
``None`` with ``prediction_note`` saying why (the model does not cover the projection kernels).

``dtype`` "float16" or "bfloat16" times 16-bit layers against ``torch.nn`` converted to the same
dtype (``.half()`` / ``.to(torch.bfloat16)``; fp16 is where torch may pick cuDNN's persistent
kernel). persistent_rnn's bfloat16 layers take NumPy arrays only (the layer API's CuPy path does not take bfloat16), so on a
GPU their ``persistent``/``gemm`` points are skipped with the reason; ``prnn_torch`` runs them.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import info, timing
from .cells import CELLS, FAMILY_CELLS, layer_args
from .functional import saved_shapes
from .plan import resolve_cell
from .validation import ALGOS, DTYPES, HALF_DTYPES, float_dtype

# 2: points gained proj_size, num_layers, predicted_us_per_step, prediction_note; 3: the
# prnn_torch algorithm, restarts/fallback over all of a point's calls (passes_checked), the
# repeats' spread, and nvrtc in the stamp
SCHEMA_VERSION = 3
PASSES = ("forward", "forward_backward")
# What a point can measure: each algorithm persistent_rnn can be told to run, and torch's cuDNN.
BENCH_ALGOS = (*(a for a in ALGOS if a != "auto"), "prnn_torch", "cudnn")
TORCH_ALGOS = ("prnn_torch", "cudnn")  # the algorithms that run torch modules on CUDA tensors
# what a sweep measures unless told: prnn_torch (the same kernels behind torch's dispatch) is
# asked for by name, where the torch modules' path is the question (bf16, the first GPU call)
DEFAULT_ALGOS = tuple(a for a in BENCH_ALGOS if a != "prnn_torch")
CELL_NAMES = tuple(CELLS)
HEADLINE_CELL = "lstm"  # the project's headline layer (LSTM H=1024): a GPU sweep measures it first
BATCHES = (1, 2, 4, 8, 16, 32, 64)
BENCH_DTYPES = tuple(d for d in DTYPES if d != "float64")  # what torch's cuDNN runs too
FLOPS_FORMULA = ("recurrence only, per step: forward 2*G*B*H^2; forward_backward 4*G*B*H^2 "
                 "(forward W_hh h plus backward W_hh^T dgh); G = gates (rnn 1, gru 3, lstm 4); "
                 "with a projection of width P: 2*B*(G*H*P + P*H) forward; times num_layers")
PEAK_FORMULA = "SMs x max SM clock x FP32 lanes per SM (128; 64 on sm_80) x 2"
JSON_NAME, PLOT_NAME = "bench_results.json", "bench_tflops.png"
COMMIT_ENV = "PRNN_COMMIT"
NO_PROJECTION_MODEL = "the latency model does not cover the LSTM projection kernels"


@dataclass(frozen=True)
class Sweep:
    """What ``prnn bench`` measures (every combination) and how."""

    cells: tuple[str, ...]
    hidden_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    batches: tuple[int, ...] = BATCHES
    passes: tuple[str, ...] = PASSES
    algos: tuple[str, ...] = DEFAULT_ALGOS
    dtype: str = "float32"
    input_size: int = 64
    proj_size: int = 0
    num_layers: int = 1
    repeats: int = 10
    warmup: int = 2
    input_sets: int = 3
    max_seconds: float = 600.0


def default_sweep(gpu: bool, quick: bool) -> Sweep:
    """The sweep ``prnn bench`` runs unless told otherwise (small NumPy sizes without a GPU)."""
    if not gpu:
        return Sweep(cells=FAMILY_CELLS, hidden_sizes=(64,) if quick else (64, 128),
                     seq_lens=(16,) if quick else (32,), algos=("gemm",), max_seconds=25 if quick else 300)
    if quick:
        return Sweep(cells=(HEADLINE_CELL,), hidden_sizes=(512,), seq_lens=(50,), max_seconds=120)
    # The headline (LSTM H=1024) first: points left when the time budget runs out are skipped.
    others = tuple(name for name in FAMILY_CELLS if name != HEADLINE_CELL)
    return Sweep(cells=(HEADLINE_CELL, *others), hidden_sizes=(1024, 256, 512), seq_lens=(100,),
                 max_seconds=300)


@dataclass
class Point:
    """One measured point of the sweep (the results JSON's ``points`` entries)."""

    cell: str
    pass_: str
    algo: str
    batch: int
    hidden_size: int
    seq_len: int
    dtype: str
    us_per_step: float
    flops_per_step: int
    tflops: float
    peak_fraction: float | None
    activation_bytes: int | None
    restarts: int
    fallback: str | None
    proj_size: int = 0
    num_layers: int = 1
    predicted_us_per_step: float | None = None
    prediction_note: str | None = None
    passes_checked: int = 0
    spread: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The JSON record (``pass_`` is written ``pass``)."""
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return d


def recurrence_flops_per_step(cell: str, batch: int, hidden: int, pass_: str, proj_size: int = 0,
                              num_layers: int = 1) -> int:
    """FLOPs of one step's recurrent matrix products, over all ``num_layers`` layers (see the
    module docstring)."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    gates = resolve_cell(cell).gates
    per_batch = gates * hidden * proj_size + proj_size * hidden if proj_size else gates * hidden * hidden
    forward = 2 * batch * per_batch * num_layers
    return forward if pass_ == "forward" else 2 * forward


def activation_bytes(cell: str, batch: int, hidden: int, seq_len: int, dtype: str, proj_size: int = 0,
                     num_layers: int = 1) -> int:
    """Bytes a persistent_rnn forward keeps for backward (``functional.saved_shapes``: ``y``,
    ``cs`` (LSTM), the projection's ``hs``, ``saved``, the inputs of the layers above the first)."""
    shapes = saved_shapes(resolve_cell(cell), seq_len, batch, hidden, num_layers, False, proj_size)
    itemsize = 4 if dtype in HALF_DTYPES else np.dtype(dtype).itemsize
    return sum(int(np.prod(s)) for s in shapes) * itemsize


def gpu_available() -> bool:
    """Whether CuPy sees a CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except (ImportError, RuntimeError):  # no CuPy; no driver or device (CUDA errors): the CPU
        return False


def torch_cuda_available() -> bool:
    """Whether torch with CUDA is importable (the ``cudnn`` algorithm)."""
    try:
        import torch
        return torch.cuda.is_available()
    except (ImportError, OSError):  # torch missing, or its libraries do not load: no cudnn
        return False


def git_commit() -> str:
    """The commit of the code that runs: ``PRNN_COMMIT`` where set (a copy without ``.git``, as
    on the device machine, is told it), else ``git rev-parse HEAD`` of the source tree, else
    ``"unknown"``."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout (an installed wheel)
        return "unknown"


def nvrtc_version() -> str | None:
    """The NVRTC version CuPy compiles with (``"13.0"``; it changes the SASS, and so the kernels'
    speed and the latency model's predictions), or None where CuPy or NVRTC is missing."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        return ".".join(map(str, nvrtc.getVersion()))
    except (ImportError, OSError, RuntimeError):  # no CuPy, or libnvrtc does not load
        return None


def run_stamp(argv: Sequence[str]) -> dict[str, str | None]:
    """What every recorded result carries about its run: ``commit`` (``git_commit``),
    ``command`` (``argv`` joined), ``date`` (UTC, ISO 8601) and ``nvrtc`` (``nvrtc_version``)."""
    return {"commit": git_commit(), "command": " ".join(argv),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "nvrtc": nvrtc_version()}


@dataclass
class CallTally:
    """What the library ran in every call of a point: restarts summed, the first fallback."""

    passes: int = 0
    restarts: int = 0
    fallback: str | None = None

    def add(self, stats: Any) -> None:
        """Count one pass's ``last_run`` (a ``RunStats``; None: the pass reported nothing)."""
        self.passes += 1
        if stats is None:
            self.fallback = self.fallback or "the pass left no last_run"
            return
        self.restarts += stats.restarts
        self.fallback = self.fallback or stats.fallback


def _inputs(xp, rng, sets: int, seq_len: int, batch: int, input_size: int, hidden: int, dtype: str):
    """``sets`` fresh random (x, dy) pairs on the array module ``xp`` (``hidden``: the output
    width, P for a projected LSTM)."""
    np_dtype = float_dtype("dtype", dtype)
    return [(xp.asarray(rng.standard_normal((seq_len, batch, input_size)).astype(np_dtype)),
             xp.asarray(rng.standard_normal((seq_len, batch, hidden)).astype(np_dtype)))
            for _ in range(sets)]


def _prnn_case(sweep: Sweep, cell: str, algo: str, backward: bool, batch: int, hidden: int, seq_len: int,
               xp, tally: CallTally | None = None) -> tuple[Callable, list]:
    """A call running one persistent_rnn layer with ``algo`` on ``xp`` arrays (every pass's
    ``last_run`` counted in ``tally``, where given), and its inputs."""
    tally = CallTally() if tally is None else tally
    import persistent_rnn as prnn
    if sweep.dtype == "bfloat16" and xp is not np:
        raise ValueError("bfloat16 layers take NumPy arrays only (the layer API's CuPy path does not take bfloat16)")
    mode, extra = layer_args(cell)
    layer = getattr(prnn, mode)(sweep.input_size, hidden, dtype=sweep.dtype, algo=algo, seed=0,
                                **_shape_args(sweep), **extra)
    if xp is not np:
        layer.load_params({k: xp.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(batch * 7919 + hidden)

    def run(pair):
        layer.forward(pair[0])
        tally.add(layer.last_run)
        if backward:
            layer.backward(pair[1])
            tally.add(layer.last_run)
    return run, _inputs(xp, rng, sweep.input_sets, seq_len, batch, sweep.input_size,
                        sweep.proj_size or hidden, sweep.dtype)


def _shape_args(sweep: Sweep) -> dict[str, int]:
    """The layer arguments of the sweep's stack depth and projection (torch.nn's names; the
    projection only where one is asked for, since only the LSTM takes it)."""
    return {"num_layers": sweep.num_layers, **({"proj_size": sweep.proj_size} if sweep.proj_size else {})}


def _torch_case(sweep: Sweep, cell: str, algo: str, backward: bool, batch: int, hidden: int,
                seq_len: int, tally: CallTally, device: str):
    """A call running a torch module on ``device`` tensors - ``torch.nn``'s (cuDNN on CUDA) for
    ``cudnn``, ``persistent_rnn.torch``'s with ``algo="persistent"`` for ``prnn_torch`` (every
    pass's ``last_run`` counted in ``tally``) - and its inputs."""
    import torch
    mode, extra = layer_args(cell)
    dtype = getattr(torch, sweep.dtype)
    if algo == "cudnn":
        make = getattr(torch.nn, mode)
    else:
        import persistent_rnn.torch as prnn_torch
        extra = {**extra, "algo": "persistent"}
        make = getattr(prnn_torch, mode)
    module = make(sweep.input_size, hidden, **_shape_args(sweep), **extra).to(device=device,
                                                                              dtype=dtype)
    rng = np.random.default_rng(batch * 7919 + hidden)
    # fp32 on the host, converted by torch (torch takes no ml_dtypes bfloat16 arrays)
    pairs = [(torch.as_tensor(x, device=device).to(dtype).requires_grad_(backward),
              torch.as_tensor(dy, device=device).to(dtype))
             for x, dy in _inputs(np, rng, sweep.input_sets, seq_len, batch, sweep.input_size,
                                  sweep.proj_size or hidden, "float32")]

    def run(pair):
        y, _ = module(pair[0])
        if algo == "prnn_torch":
            tally.add(module.last_run)
        if backward:
            y.backward(pair[1])
            if algo == "prnn_torch":
                tally.add(module.last_run.backward if module.last_run else None)
    return run, pairs


def measure_point(sweep: Sweep, cell: str, pass_: str, algo: str, batch: int, hidden: int, seq_len: int,
                  gpu: bool, peak_tflops: float | None) -> Point:
    """Time one point (raises ValueError where ``algo`` cannot run it, e.g. the plan does not fit).

    Without ``gpu`` the library runs on NumPy arrays (``persistent``: the CPU emulation) and the
    torch algorithms on CPU tensors: a check of the harness, not a measurement of either."""
    backward = pass_ == "forward_backward"
    clock: timing.Clock = timing.CudaEventClock() if gpu else timing.CpuClock()
    tally, act, predicted = CallTally(), None, (None, None)
    if algo in TORCH_ALGOS:
        run, inputs = _torch_case(sweep, cell, algo, backward, batch, hidden, seq_len, tally,
                                  "cuda" if gpu else "cpu")
    else:
        xp = __import__("cupy") if gpu else np
        run, inputs = _prnn_case(sweep, cell, algo, backward, batch, hidden, seq_len, xp, tally)
    if algo != "cudnn":
        act = activation_bytes(cell, batch, hidden, seq_len, sweep.dtype, sweep.proj_size,
                               sweep.num_layers)
    samples = timing.sample_seconds(run, inputs, sweep.repeats, sweep.warmup, clock)
    seconds = statistics.median(samples)
    if algo in ("persistent", "prnn_torch") and gpu:
        predicted = predicted_us_per_step(sweep, cell, pass_, batch, hidden, seq_len)
    us = seconds * 1e6 / seq_len
    flops = recurrence_flops_per_step(cell, batch, hidden, pass_, sweep.proj_size, sweep.num_layers)
    tflops = flops / us / 1e6
    return Point(cell, pass_, algo, batch, hidden, seq_len, sweep.dtype, us, flops, tflops,
                 tflops / peak_tflops if peak_tflops else None, act, tally.restarts,
                 tally.fallback, sweep.proj_size, sweep.num_layers, *predicted, tally.passes,
                 timing.spread(samples))


def predicted_us_per_step(sweep: Sweep, cell: str, pass_: str, batch: int, hidden: int,
                          seq_len: int, device: Any = None) -> tuple[float | None, str | None]:
    """The latency model's *prediction* of a persistent point's µs per step - the per-step terms
    plus each call's terms spread over ``seq_len`` steps (``StepTime.benchmark_us``); a stack as
    the runtime places it (stack mode where ``settings.stack`` is on and the stack plan fits) -
    and ``None``, or ``(None, why)`` where the model has no figure. ``device``: a profile or
    name (``plan.resolve_device``; None: the current GPU). Never raises for a model failure: the
    measurement stands without its prediction."""
    from . import latency, runtime, settings
    from . import plan as planner
    if sweep.proj_size:
        return None, NO_PROJECTION_MODEL
    backward = pass_ == "forward_backward"
    try:
        # the profile the runtime plans for (clusters capped by settings.max_cluster_ctas)
        dev = runtime.planning_device(True) if device is None else planner.resolve_device(device)
        if sweep.num_layers > 1:
            st = latency.predict_stack_time(cell, hidden, batch, sweep.num_layers, seq_len,
                                            input_size=sweep.input_size, dtype=sweep.dtype,
                                            device=dev)
            stacked = settings.current().stack and st.plan.fits
            fwd, bwd = ((st.forward_us, st.backward_us) if stacked
                        else (st.apart_forward_us, st.apart_backward_us))
            if fwd is None:
                return None, f"no plan fits: {st.plan.reason}"
            return (fwd + (bwd if backward else 0.0)) / seq_len, None
        spec = resolve_cell(cell)
        plan = planner.make_plan(spec, hidden, batch, sweep.dtype, dev)
        if not plan.fits:
            return None, f"no plan fits: {plan.reason}"
        st = latency.predict_plan(spec, hidden, batch, plan, dev, seq_len=seq_len,
                                  input_size=sweep.input_size)
        return st.benchmark_us(seq_len, backward), None
    except (RuntimeError, ValueError, OSError) as exc:  # no nvdisasm, a compile failure: no figure
        return None, f"no prediction: {type(exc).__name__}: {exc}"


def run_sweep(sweep: Sweep, gpu: bool, peak_tflops: float | None,
              progress: bool = True) -> tuple[list[Point], list[dict]]:
    """Measure every combination of ``sweep`` (a tqdm bar on stderr); (points, skipped with reasons).

    Points that cannot run (the plan does not fit, the kernel fails to launch) and those left when
    ``sweep.max_seconds`` has passed are recorded as skipped instead of stopping the sweep.
    """
    from tqdm import tqdm
    combos = list(itertools.product(sweep.cells, sweep.hidden_sizes, sweep.seq_lens, sweep.passes,
                                    sweep.algos, sweep.batches))
    deadline = time.monotonic() + sweep.max_seconds
    points, skipped = [], []
    for cell, hidden, seq_len, pass_, algo, batch in tqdm(combos, file=sys.stderr, disable=not progress,
                                                         desc="prnn bench", unit="pt", leave=False):
        where = {"cell": cell, "pass": pass_, "algo": algo, "batch": batch, "hidden_size": hidden,
                 "seq_len": seq_len, "proj_size": sweep.proj_size, "num_layers": sweep.num_layers}
        if time.monotonic() > deadline:
            skipped.append({**where, "reason": f"time budget of {sweep.max_seconds:g} s spent"})
            continue
        try:
            points.append(measure_point(sweep, cell, pass_, algo, batch, hidden, seq_len, gpu, peak_tflops))
        except (ValueError, RuntimeError) as exc:  # does not fit / failed launch: record, go on
            skipped.append({**where, "reason": f"{type(exc).__name__}: {exc}"})
    return points, skipped


def device_record(gpu: bool) -> dict[str, Any]:
    """``device``, ``driver``, ``cuda`` and the device details for the results JSON."""
    if not gpu:
        return {"device": "cpu", "driver": None, "cuda": None, "device_info": None,
                "note": "CPU run (NumPy GEMM path, wall-clock timing): GPU figures need a GPU"}
    gi = info.gpu_info()
    return {"device": gi["device"]["name"], "driver": gi["driver_version"], "cuda": gi["cuda_runtime_version"],
            "device_info": gi}


def settings_record(sweep: Sweep, gpu: bool) -> dict[str, Any]:
    """The sweep, persistent_rnn's runtime settings (``gemm_graphs``, ``stack``, ...) and the
    timing/torch settings it ran with."""
    from . import settings
    s = {f.name: getattr(sweep, f.name) for f in fields(sweep)}
    s["prnn_settings"] = asdict(settings.current())
    s["timing"] = ("CUDA events" if gpu else "time.perf_counter") + \
        f", median of {sweep.repeats} after {sweep.warmup} warm-up, rotating {sweep.input_sets} input sets"
    if set(TORCH_ALGOS) & set(sweep.algos):
        import torch
        s["torch_version"] = torch.__version__
        s["torch.backends.cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        s["torch.backends.cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return s


def disable_tf32() -> None:
    """Keep torch's fp32 in fp32 (no TF32 in cuBLAS or cuDNN) so the comparison is like for like."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def torch_graph_replay(fn: Callable[[], object],
                       before_replay: Callable[[], object] | None = None) -> Callable[[], None]:
    """``fn`` (torch CUDA work) captured once in a ``torch.cuda.CUDAGraph`` after a warm-up run
    on a side stream; returns a replay, preceded by ``before_replay()`` where given (a
    decoder's ``resume``: a replay runs no host code)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        if before_replay is not None:
            before_replay()
        graph.replay()
    return replay


def torch_stream_done(cuda: bool) -> None:
    """Wait until torch's current stream has done its work so far: a CUDA event recorded there
    and waited for (nothing on the CPU). Not a device-wide synchronisation, which also waits for
    kernels on other streams - a resident decoder's kernel runs on its own until it exits, idle
    ``gpu_timeout_ms`` after its last step, so a device sync after a decode loop adds that."""
    if cuda:
        import torch
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


def device_activities(prof: Any, per: int) -> dict[str, tuple[float, float]]:
    """From a ``torch.profiler`` run: each device activity (kernel, memory copy or set) by name,
    its µs and its count per ``per`` (calls, steps). Host ranges are left out: their device
    time is the sum of their kernels', which would count those twice."""
    from torch.autograd import DeviceType
    found = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.device_type != DeviceType.CPU:
            found[e.key] = (us / per, e.count / per)
    return found


def profile_text(fn: Callable[[], object],
                 sorts: Sequence[tuple[str, int]] = (("tottime", 25),), calls: int = 1) -> str:
    """cProfile of one ``fn()`` (warm it up first) that makes ``calls`` calls of what is
    profiled: the top functions under each ``(key, count)`` of ``sorts`` ("tottime" or
    "cumulative"), in µs per call to the nanosecond (pstats' own listing rounds to the
    millisecond: a call of 100 µs reads as 0.000)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = pstats.Stats(prof).stats  # {(file, line, name): (primitive, calls, own s, total s, _)}
    out = [f"cProfile of {calls} call(s), per call: calls made, own µs, cumulative µs"]
    for key, count in sorts:
        column = {"tottime": 2, "cumulative": 3}[key]
        out.append(f"-- by {key}")
        for (file, line, name), row in sorted(rows.items(), key=lambda kv: -kv[1][column])[:count]:
            out.append(f"{row[1] / calls:9.2f} {row[2] * 1e6 / calls:10.3f} "
                       f"{row[3] * 1e6 / calls:10.3f}  {name} ({file}:{line})")
    return "\n".join(out) + "\n"


def resolve_sweep(sweep: Sweep, gpu: bool) -> Sweep:
    """Drop algorithms this machine cannot run (``cudnn`` and ``prnn_torch`` without torch CUDA;
    only ``gemm`` on CPU)."""
    algos = tuple(a for a in sweep.algos
                  if (a == "gemm" or gpu) and (a not in TORCH_ALGOS or torch_cuda_available()))
    if not algos:
        raise ValueError(f"none of the algorithms {sweep.algos} can run here "
                         f"({'GPU' if gpu else 'CPU: only gemm'})")
    return replace(sweep, algos=algos)


def benchmark(sweep: Sweep, gpu: bool, argv: Sequence[str], progress: bool = True) -> dict[str, Any]:
    """Run ``sweep`` and return the results document (see docs/benchmarks.md for the schema)."""
    sweep = resolve_sweep(sweep, gpu)
    if set(TORCH_ALGOS) & set(sweep.algos) and sweep.dtype == "float32":
        disable_tf32()
    device = device_record(gpu)
    peak = device["device_info"]["device"]["fp32_peak_tflops"] if gpu else None
    points, skipped = run_sweep(sweep, gpu, peak, progress)
    return {
        "schema_version": SCHEMA_VERSION, **device, "fp32_peak_tflops": peak, **run_stamp(argv),
        "settings": settings_record(sweep, gpu), "flops_formula": FLOPS_FORMULA, "peak_formula": PEAK_FORMULA,
        "points": [p.to_json() for p in points], "skipped": skipped,
    }


def format_table(results: dict[str, Any]) -> str:
    """The points as an aligned text table, with a header line naming the device."""
    head = f"{'cell':8} {'pass':16} {'algo':10} {'B':>3} {'H':>5} {'P':>4} {'L':>2} {'T':>4} " \
           f"{'us/step':>9} {'pred':>7} {'TFLOP/s':>8} {'%peak':>6} {'act MiB':>8} {'rest':>4} fallback"
    lines = [f"prnn bench on {results['device']} (commit {results['commit'][:12]}, {results['date']}, "
             f"NVRTC {results.get('nvrtc') or '-'})", head]
    for p in results["points"]:
        peak = f"{100 * p['peak_fraction']:6.2f}" if p["peak_fraction"] is not None else f"{'-':>6}"
        act = f"{p['activation_bytes'] / 2**20:8.2f}" if p["activation_bytes"] is not None else f"{'-':>8}"
        pred = p.get("predicted_us_per_step")
        pred = f"{pred:7.2f}" if pred is not None else f"{'-':>7}"
        lines.append(f"{p['cell']:8} {p['pass']:16} {p['algo']:10} {p['batch']:3d} {p['hidden_size']:5d} "
                     f"{p.get('proj_size', 0):4d} {p.get('num_layers', 1):2d} {p['seq_len']:4d} "
                     f"{p['us_per_step']:9.2f} {pred} {p['tflops']:8.4f} {peak} {act} "
                     f"{p['restarts']:4d} {p['fallback'] or '-'}")
    if results["skipped"]:
        lines.append(f"{len(results['skipped'])} points skipped (see 'skipped' in the JSON), e.g. "
                     f"{results['skipped'][0]['reason'][:160]}")
    if any(p.get("predicted_us_per_step") is not None for p in results["points"]):
        lines.append("pred: the latency model's prediction of us/step (persistent_rnn.latency), not a "
                     "measurement")
    if results["device"] == "cpu":
        lines.append(results["note"])
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """PNG of TFLOP/s against batch size, one line per algorithm, one panel per (cell, H, T, pass)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(p["cell"], p["hidden_size"], p["seq_len"], p["pass"]) for p in results["points"]})
    cols = 2
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for algo in sorted({p["algo"] for p in results["points"]}):
            pts = sorted((p["batch"], p["tflops"]) for p in results["points"]
                         if (p["cell"], p["hidden_size"], p["seq_len"], p["pass"]) == panel and p["algo"] == algo)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=algo)
        ax.set_xscale("log", base=2)
        batches = sorted({p["batch"] for p in results["points"]})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title("{} H={} T={} {}".format(*panel), fontsize=9)
        ax.set_xlabel("batch size")
        ax.set_ylabel("TFLOP/s (recurrence)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"prnn bench: {results['device']}, commit {results['commit'][:12]}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the suptitle
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out: Path) -> tuple[Path, Path | None]:
    """Write the results JSON and, where matplotlib is installed (the ``bench`` extra), the plot
    into ``out`` (created); their paths (None for a plot not drawn)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / JSON_NAME, out / PLOT_NAME
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    try:
        plot(results, png_path)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        return json_path, None
    return json_path, png_path
