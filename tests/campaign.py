"""A seeded differential campaign: random configurations of every path against float64.

Each case is drawn from one integer seed (``draw_case``) and checked by ``run_case``:

* ``layer``: a ``persistent_rnn`` layer (``algo`` "persistent" on the CPU emulation, over one
  thread-block cluster or the grid, with a CTA stalled at a random block and step or CTAs
  held back by ``emulation_max_resident``, and the emulation's weaker-machine modes drawn too:
  ``CASE_MODES``, docs/emulation.md; "gemm"; "auto") in float32, float16 or bfloat16,
  multi-layer, bidirectional, batch-first, with lengths and h0/c0, forward and backward,
  against float64 (``check_layer``, the measures of docs/api.md "Accuracy"; float32 persistent
  cases with ``allow_tf32`` or not, docs/api.md "TF32"); a stalled run must equal an undisturbed
  one bit for bit, and ``last_run`` must say what ran; the long profile's LSTM cases have a
  projection (``proj_size``) now and then. The call is then repeated on new data and weights
  updated in place (``check_repeat``): the planned path, bit for bit a fresh layer's.
* ``module``: a ``persistent_rnn.torch`` module (``algo`` "auto", "gemm", "persistent") against
  ``torch.nn`` on the same weights and data (padded or packed), outputs and every gradient; its
  call repeated as a layer's (``check_module_repeat``).
* ``bad``: a bad argument (``BAD_INPUTS``): the layer raises ``TypeError``/``ValueError``
  naming the argument; the torch module raises what ``torch.nn`` raises. Never a crash or hang.

A failure raises ``CampaignFailure`` with the case, its seed and a one-line reproducer. The CI
slice (tests/test_campaign.py) runs a fixed set of seeds of the ``ci`` profile (a few small
kernel configurations, so that the emulation builds are shared); the long run draws cases of the
``long`` profile until time is up (hidden sizes around tile boundaries up to 300, and now and
then the largest tiles at ``max_hidden_size``)::

    python -m tests.campaign --minutes 30 [--seed S] [--profile long]
    python -m tests.campaign --case SEED --kind layer --profile long     # replay one case
    python -m tests.campaign --minutes 30 --race-detector    # every emulated kernel under TSan

``--race-detector`` runs the campaign again in a child process with every emulated kernel built
with the race detector (docs/emulation.md): a race fails its case. It is not drawn per case (the
detector is process-wide) and not in the CI slice: each kernel configuration costs a
ThreadSanitizer build and its launches run about 20 times slower.

A new layer option is one field of ``Case``, one line in ``draw_case`` and its use in
``_layer``/``_module`` (and the references follow the library's own functional code).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import persistent_rnn as prnn
from persistent_rnn import emulate, functional, hardware, matmul, plan as planner, runtime
from persistent_rnn.buffers import active_steps
from persistent_rnn.cells import CELLS as REGISTRY, layer_args

# Every cell of the registry, most gates first (the order the CI slice's seeds were chosen in).
CELLS = tuple(sorted(REGISTRY, key=lambda name: -REGISTRY[name].gates))
TORCH_CELLS = tuple(name for name in CELLS if REGISTRY[name].in_torch)  # module and bad cases
KINDS = ("layer", "module", "bad")
PASSES = ("forward", "backward")
# Unit roundoff of the 16-bit dtypes (half the spacing of values in [1, 2)); 0 for fp32.
UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# docs/api.md: relative error against the float64 layer that does not round h_t.
FREE_RUNNING = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
FP32 = 2e-5  # fp32 arithmetic (one step, or a backward through time) relative to the array
# docs/api.md: a 16-bit layer's weight gradients take its fp32 gate gradients in TF32 (each
# product within 2^-11): their sums within two of TF32's unit roundoff of the array's largest
# value, beside the result's rounding (measured worst of about 15,000 GEMM-path cases: 1.15).
TF32_PRODUCTS = 2.0**-10
MODULE_F64 = 1e-9  # torch modules against torch.nn, both float64
TF32 = 5e-3  # docs/api.md, "TF32": every result against float64 where W_hh ran in TF32
TF32_P = 0.4  # a float32 persistent case allows TF32 with this probability
PROJ_P = 0.3  # an LSTM layer case of the long profile has a projection with this probability

# A stalled CTA sleeps past the barrier timeout once; the timeout is long enough that the
# emulated grid (up to STALL_MAX_GRID host threads on a shared machine) never times out by itself.
STALL_TIMEOUT_MS, STALL_MS, STALL_MAX_GRID = 1000, 2500, 16
RESIDENT_TIMEOUT_MS = 200
# The emulation modes a persistent case may run under (emulate.MODES but "realtime": the campaign
# wants deadlines that do not depend on the machine's load), each drawn with this probability.
CASE_MODES = ("shuffle", "jumpy_timer", "schedule", "late_copies", "delayed")
MODE_P = 0.35


class CampaignFailure(AssertionError):
    """A case whose results or behaviour are wrong; the message says how to replay it."""


@dataclass(frozen=True)
class Case:
    """One drawn configuration (everything ``run_case`` needs besides the seed's data)."""

    seed: int
    kind: str
    profile: str
    cell: str = "gru"
    input_size: int = 3
    hidden: int = 8
    num_layers: int = 1
    bidirectional: bool = False
    batch_first: bool = False
    bias: bool = True
    batch: int = 2
    steps: int = 3
    lengths: bool = False
    hx: bool = False
    dtype: str = "float32"
    algo: str = "gemm"
    path: str = "cluster"                  # exchange of the emulated persistent kernel
    stall: tuple[int, int] | None = None   # (block, step)
    max_resident: int | None = None
    stack: bool = True                     # the `stack` setting: stack mode where the plan fits
    bad: str = ""                          # name in BAD_INPUTS
    modes: tuple[str, ...] = ()            # emulation modes (emulate.modes), seeded by `seed`
    tf32: bool = False                     # settings.allow_tf32 (float32 persistent cases)
    proj: int = 0                          # an LSTM layer's proj_size
    kind_given: bool = True                # drawn for a named kind (else the kind was drawn too)

    def command(self) -> str:
        """The one-line command that replays this case."""
        kind = f"--kind {self.kind} " if self.kind_given else ""
        detector = " --race-detector" if os.environ.get(emulate.RACE_DETECTOR_ENV) else ""
        return (f"PYTHONPATH=. python -m tests.campaign --case {self.seed} {kind}"
                f"--profile {self.profile}{detector}")


# ---- drawing ---------------------------------------------------------------------------------

def _hidden(rng: np.random.Generator, profile: str) -> int:
    """Hidden sizes around tile boundaries (multiples of 4, 8, 20, 28, 32, 64 and +-1)."""
    if profile == "ci":
        return int(rng.choice([13, 40]))
    if rng.random() < 0.5:
        return int(rng.integers(1, 301))
    unit = int(rng.choice([4, 8, 12, 14, 16, 20, 28, 32, 64]))
    return int(max(1, min(300, unit * rng.integers(1, 301 // unit + 1) + rng.integers(-1, 2))))


def draw_case(seed: int, profile: str = "ci", kind: str | None = None) -> Case:
    """The case of ``seed`` (``kind`` None: drawn too). Draw a new option after the others, so
    that the seeds of the CI slice keep their cases."""
    return _with_proj(_with_tf32(_with_modes(_draw_options(seed, profile, kind))))


def _draw_options(seed: int, profile: str, kind: str | None) -> Case:
    rng = np.random.default_rng(seed)
    kind_given = kind is not None
    kind = kind or str(rng.choice(KINDS, p=[0.55, 0.2, 0.25]))
    small = profile == "ci"
    cells = CELLS if kind == "layer" else TORCH_CELLS  # the others run torch.nn's modules
    base = dict(seed=seed, kind=kind, kind_given=kind_given, profile=profile, cell=str(rng.choice(cells)),
                input_size=int(rng.integers(1, 7)), bidirectional=bool(rng.random() < 0.4),
                batch_first=bool(rng.random() < 0.3), bias=bool(rng.random() < 0.85),
                lengths=bool(rng.random() < 0.5), hx=bool(rng.random() < 0.7))
    if kind == "bad":
        return Case(**base, bad=str(rng.choice(sorted(BAD_INPUTS))),
                    algo=str(rng.choice(prnn.validation.ALGOS)), hidden=int(rng.integers(1, 9)),
                    batch=int(rng.integers(1, 4)), steps=int(rng.integers(1, 5)))
    base.update(hidden=_hidden(rng, profile), num_layers=int(rng.integers(1, 3 if small else 4)),
                batch=int(rng.integers(1, 5 if small else 10)),
                steps=int(rng.integers(1, 6 if small else 13)), path=str(rng.choice(["cluster",
                                                                                   "grid"])))
    if kind == "module":
        algo = str(rng.choice(["auto", "gemm", "persistent"]))
        dtype = "float32" if algo == "persistent" else str(rng.choice(["float32", "float64"]))
        if base["cell"] == "rnn_relu" and algo == "auto":
            dtype = "float64"  # see run_module_case: float32 relu gradients have no float64 bound
        return Case(**base, algo=algo, dtype=dtype)
    algo = str(rng.choice(["persistent", "gemm", "auto"], p=[0.65, 0.3, 0.05]))
    case = Case(**base, algo=algo, dtype=str(rng.choice(["float32", "float16", "bfloat16"],
                                                         p=[0.5, 0.25, 0.25])))
    if algo != "persistent":
        return case
    if profile == "long" and rng.random() < 0.08:  # the largest tiles, at a few small shapes
        top = planner.max_hidden_size(case.cell, case.dtype, emulated_profile("grid"))
        return dataclasses.replace(case, hidden=int(top - rng.integers(0, 3)), path="grid", stack=False,
                                   num_layers=1, bidirectional=False, batch=1,
                                   steps=int(rng.integers(1, 3)), lengths=False)
    grid = _grid(case)
    roll = rng.random()
    if roll < 0.2 and case.steps > 1 and grid <= STALL_MAX_GRID:
        # a stall costs STALL_MS per pass: one or two layer-directions
        return dataclasses.replace(case, stall=(int(rng.integers(0, grid)),
                                                int(rng.integers(0, case.steps))),
                                   num_layers=1, stack=False)
    if roll < 0.3 and case.path == "grid" and grid > 1:
        return dataclasses.replace(case, max_resident=int(rng.integers(1, grid + 1)),
                                   num_layers=1, bidirectional=False, stack=False)
    # Drawn from a generator of its own, so that the other fields of the CI seeds stay as they were.
    return dataclasses.replace(case, stack=bool(np.random.default_rng([seed, 18]).random() < 0.5))


def _with_modes(case: Case) -> Case:
    """A persistent case with its emulation modes, from a generator of its own (the other fields
    of the CI seeds stay as they were)."""
    if case.kind != "layer" or case.algo != "persistent":
        return case
    rng = np.random.default_rng([case.seed, 27])
    return dataclasses.replace(case, modes=tuple(m for m in CASE_MODES if rng.random() < MODE_P))


def _with_tf32(case: Case) -> Case:
    """A float32 persistent case with ``allow_tf32`` or not, from a generator of its own (the
    TF32 tiles run from ``plan.TF32_MIN_BATCH`` rows, outside stack mode: ``ran_tf32``)."""
    if case.kind == "bad" or case.algo != "persistent" or case.dtype != "float32":
        return case
    return dataclasses.replace(case, tf32=bool(np.random.default_rng([case.seed, 28]).random()
                                               < TF32_P))


def _with_proj(case: Case) -> Case:
    """An LSTM layer case of the long profile with a projection or not, from a generator of its
    own (not with a stall or CTAs held back, whose draws read the plan without one)."""
    if (case.kind != "layer" or case.profile != "long" or not REGISTRY[case.cell].projection
            or case.hidden < 2 or case.stall or case.max_resident or not case.stack
            and case.hidden > 300):
        return case
    rng = np.random.default_rng([case.seed, 29])
    return dataclasses.replace(case, proj=int(rng.integers(1, case.hidden)) if rng.random()
                               < PROJ_P else 0)


def emulated_profile(path: str, tf32: bool = False) -> hardware.DeviceProfile:
    """The emulated device: an H100 (small layers as one cluster), or one without clusters;
    ``tf32``: as ``settings.allow_tf32`` plans it (``runtime``)."""
    h100 = hardware.PROFILES["h100"]
    h100 = dataclasses.replace(h100, allow_tf32=True) if tf32 else h100
    if path == "cluster":
        return h100
    return dataclasses.replace(h100, name="h100 without clusters", arch="sm_80")


def _plan(case: Case) -> planner.Plan:
    """The plan of one layer-direction of the case's persistent passes."""
    return planner.make_plan(case.cell, case.hidden, case.batch, case.dtype,
                             emulated_profile(case.path, case.tf32), proj_size=case.proj)


def _grid(case: Case, name: str = "forward") -> int:
    """CTAs of the case's persistent pass ``name`` (0 where no plan fits)."""
    p = _plan(case)
    return getattr(p, name).grid if p.fits else 0


def _stacked(case: Case) -> bool:
    """Whether the case's persistent passes run in stack mode (all layers, or both directions
    of a layer, in one launch): allowed, more than one layer-direction, no projection (no stack
    kernel has one), and the plan fits."""
    return (case.algo == "persistent" and case.stack and (case.num_layers > 1 or case.bidirectional)
            and not case.proj
            and planner.make_stack_plan(case.cell, case.hidden, case.batch, case.num_layers,
                                        case.bidirectional, case.dtype,
                                        emulated_profile(case.path, case.tf32)).fits)


def ran_tf32(case: Case) -> bool:
    """Whether the case's forward runs the TF32 tiles (docs/api.md, "TF32": allowed, from the
    plan's rows; ``_check_stats`` checks ``last_run`` says so)."""
    return case.tf32 and "PRNN_MMA" in _pass_defines(case, "forward")


def _pass_defines(case: Case, name: str) -> dict:
    """The compile-time defines of the case's persistent pass ``name`` (its stack's in stack
    mode)."""
    if not _stacked(case):
        return getattr(_plan(case), name).defines
    return getattr(planner.make_stack_plan(case.cell, case.hidden, case.batch, case.num_layers,
                                           case.bidirectional, case.dtype,
                                           emulated_profile(case.path, case.tf32)), name).defines


def _held_back(case: Case, name: str | None = None) -> bool:
    """Whether ``max_resident`` keeps CTAs of one step apart in pass ``name`` (None: in either;
    the backward's grid may be the larger; a single step waits for nobody)."""
    return case.max_resident is not None and case.steps > 1 and any(
        case.max_resident < _grid(case, n) for n in ((name,) if name else PASSES))


@contextlib.contextmanager
def emulated_device(path: str):
    """Plan the CPU emulation for ``path`` ("cluster" or "grid") inside the block."""
    saved = runtime.EMULATED_DEVICE
    runtime.EMULATED_DEVICE = emulated_profile(path)
    try:
        yield
    finally:
        runtime.EMULATED_DEVICE = saved


def features(case: Case) -> set[str]:
    """The options a layer case exercises (the CI slice must cover ``LAYER_FEATURES``)."""
    got = {case.cell, case.dtype, case.algo}
    if case.algo == "persistent":
        got.add(case.path)
        got |= {"stall"} if case.stall else set()
        got |= {"held back"} if _held_back(case) else set()
        got |= {"stack"} if _stacked(case) else set()
        got |= {"tf32"} if ran_tf32(case) else set()
        got |= set(case.modes)
    flags = {"multi-layer": case.num_layers > 1, "bidirectional": case.bidirectional,
             "batch_first": case.batch_first, "no bias": not case.bias,
             "lengths": case.lengths, "hx": case.hx, "projection": bool(case.proj)}
    return got | {name for name, on in flags.items() if on}


LAYER_FEATURES = set(CELLS) | {"float32", "float16", "bfloat16", "persistent", "gemm", "auto",
                               "cluster", "grid", "stall", "held back", "stack", "multi-layer",
                               "bidirectional", "batch_first", "no bias", "lengths", "hx",
                               "tf32", *CASE_MODES}


# ---- data ------------------------------------------------------------------------------------

def _dtype(name: str) -> np.dtype:
    return prnn.validation.float_dtype("dtype", name)


def _data(case: Case, rng: np.random.Generator) -> dict[str, Any]:
    """x, hx, lengths, dy, dhn as float64 arrays holding values of the case's dtype."""
    dirs = 2 if case.bidirectional else 1
    lead = (case.batch, case.steps) if case.batch_first else (case.steps, case.batch)
    width = case.proj or case.hidden  # h's (c stays H wide)
    pair = REGISTRY[case.cell].has_cell_state
    q = lambda a: a.astype(_dtype(case.dtype)).astype(np.float64)  # noqa: E731
    states = lambda scale: (tuple(q(scale * rng.standard_normal(  # noqa: E731
        (case.num_layers * dirs, case.batch, w))) for w in (width, case.hidden)[:2 if pair else 1]))
    hx = states(0.5)
    dhn = states(1.0)
    lengths = None
    if case.lengths:
        lengths = rng.integers(1, case.steps + 1, case.batch)
        lengths[rng.integers(case.batch)] = case.steps  # torch's padded output has T steps
    return dict(x=q(rng.standard_normal(lead + (case.input_size,))),
                hx=(hx if pair else hx[0]) if case.hx else None, lengths=lengths,
                dy=q(rng.standard_normal(lead + (dirs * width,))),
                dhn=dhn if pair else dhn[0])


def _cast(a: Any, dtype) -> Any:
    if a is None:
        return None
    return tuple(v.astype(dtype) for v in a) if isinstance(a, tuple) else a.astype(dtype)


def _flat(a: Any) -> list:
    return list(a) if isinstance(a, tuple) else [a]


def _layer(case: Case, dtype: str, algo: str, params: dict | None = None):
    mode, kw = layer_args(case.cell)
    layer = getattr(prnn, mode)(case.input_size, case.hidden, num_layers=case.num_layers,
                                bias=case.bias, batch_first=case.batch_first,
                                bidirectional=case.bidirectional, dtype=dtype, algo=algo,
                                proj_size=case.proj, seed=case.seed, **kw)
    if params is not None:
        layer.load_params(params)
    return layer


def _inputs(layer, data: dict) -> tuple:
    """A forward's x, hx, lengths in the layer's dtype."""
    return data["x"].astype(layer.dtype), _cast(data["hx"], layer.dtype), data["lengths"]


def _run_layer(layer, data: dict):
    """Forward and backward; results as float64, the forward's context and both RunStats."""
    dt = layer.dtype
    y, hn = layer.forward(*_inputs(layer, data))
    ctx, fwd = layer._ctx, layer.last_run  # the context: the states the run went through
    dx, dhx = layer.backward(data["dy"].astype(dt), _cast(data["dhn"], dt))
    out = {"y": y, "dx": dx}
    out.update({f"hn[{i}]": a for i, a in enumerate(_flat(hn))})
    out.update({f"dhx[{i}]": a for i, a in enumerate(_flat(dhx))})
    out.update(layer.grads)
    return {k: np.asarray(v, np.float64) for k, v in out.items()}, ctx, fwd, layer.last_run


# ---- references and measures -----------------------------------------------------------------

def relerr(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (absolute where ref is all zeros); NaN where a is NaN."""
    scale = float(np.abs(ref).max(initial=0.0))
    err = float(np.abs(a - ref).max(initial=0.0))
    return err / scale if scale > 0 else err


def trajectory_reference(ctx: functional.Context, data: dict) -> tuple[float, dict]:
    """float64 along the states a run went through: every step recomputed in float64 from the
    run's own h_{t-1} (and c_{t-1}), and the backward in float64 through those states.

    Returns the forward's worst per-element excess (``max (|h - h64| - u |h64|) / max |h64|``
    over every layer-direction, u the unit roundoff of the dtype; ~0 means each state is h64
    rounded once) and the float64 results of the backward (``functional.backward`` on a float64
    context of the same states). With 16-bit h_t, a state that another rounding left a little
    different flips relu's derivative where the pre-activation is near zero; measured along the
    run's own states, no flip remains between it and its reference.
    """
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    params = {k: f64(v) for k, v in ctx.params.items()}
    cell, u = ctx.cell, UNIT_ROUNDOFF[ctx.half or "float32"]
    ref = copy.copy(ctx)  # the same lengths, layout and states; float64 everything else
    ref.params, ref.algo, ref.half = params, "gemm", None
    ref.inputs = [f64(a) for a in ctx.inputs]
    ref.directions, excess = [], 0.0
    for layer, dirs in enumerate(ctx.directions):
        ref.directions.append([])
        for direction, d in enumerate(dirs):
            fwd64, err = _replay_direction(cell, params, ref, layer, direction, d, u)
            excess = max(excess, err)
            ref.directions[layer].append(functional._Direction(d.names, f64(d.h0), f64(d.c0),
                                                                fwd64))
    dy = data["dy"].transpose(1, 0, 2) if ctx.batch_first else data["dy"]
    ref.batch_first = False
    dx, dhx, grads = functional.backward(ref, dy, data["dhn"])
    dx = dx.transpose(1, 0, 2) if ctx.batch_first else dx
    out = {"dx": dx, **{f"dhx[{i}]": a for i, a in enumerate(_flat(dhx))}, **grads}
    return excess, out


def _replay_direction(cell, params, ref, layer: int, direction: int, d,
                      u: float) -> tuple[Any, float]:
    """One layer-direction's steps in float64 from the run's states h (rounded with unit
    roundoff ``u``) and c (fp32); returns (ForwardResult, excess)."""
    w_ih, w_hh = params[d.names["weight_ih"]], params[d.names["weight_hh"]]
    b_ih, b_hh = ((params[d.names["bias_ih"]], params[d.names["bias_hh"]])
                  if "bias_ih" in d.names else (0.0, 0.0))
    gi = matmul.matmul_steps(ref.inputs[layer], w_ih.T) + b_ih
    if direction == 1:
        gi = functional._gather(ref.reverse_index, gi)
    y = np.asarray(d.fwd.y, np.float64)
    h_prev = np.concatenate([np.asarray(d.h0, np.float64)[None], y[:-1]])
    cs = None if d.fwd.cs is None else np.asarray(d.fwd.cs, np.float64)
    c_prev = None if cs is None else np.concatenate([np.asarray(d.c0, np.float64)[None], cs[:-1]])
    steps, batch, hidden = y.shape
    gh = matmul.matmul_steps(h_prev, w_hh.T) + b_hh
    flat = lambda a: None if a is None else a.reshape(steps * batch, -1)  # noqa: E731
    h, c, saved = cell.forward(np, flat(gi), flat(gh), flat(h_prev), flat(c_prev))
    h = h.reshape(y.shape)
    active = active_steps(np, steps, ref.lengths)
    if active is not None:  # past a length the state is frozen, as in every engine
        h = np.where(active, h, h_prev)
    excess = _excess(y, h, u)
    if cs is not None:
        c = c.reshape(cs.shape)
        excess = max(excess, _excess(cs, c if active is None else np.where(active, c, c_prev), 0.0))
    saved64 = saved.reshape(steps, batch, -1) if saved.shape[1] else np.zeros((steps, batch, 0))
    return runtime.ForwardResult(y, cs, saved64), excess


def _excess(got: np.ndarray, want: np.ndarray, u: float) -> float:
    """max over elements of (|got - want| - u |want|), relative to max |want| (0 if within)."""
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return max(0.0, float((np.abs(got - want) - u * np.abs(want)).max(initial=0.0)) / scale)


def check_layer(case: Case, out: dict, ctx, ref64: dict, data: dict,
                tf32: bool = False) -> dict[str, float]:
    """The accuracy measures of docs/api.md for one run; returns the worst error of each.

    * every cell and dtype, along the run's own states (``trajectory_reference``): each state
      within one rounding of its float64 step, every gradient within one rounding of the
      float64 backward through those states (+ fp32 arithmetic);
    * against the float64 layer that never rounds h_t: the forward of every cell, and the
      gradients of every cell but relu (whose derivative jumps where rounding moves a
      pre-activation across zero), within ``FREE_RUNNING[dtype]``.

    ``tf32``: TF32 allowed (docs/api.md, "TF32": the tiles' W_hh and the float32 GEMMs): every
    measure within ``TF32``.
    An LSTM projection's case has the second measure only (``trajectory_reference`` replays
    steps without W_hr).
    """
    u = UNIT_ROUNDOFF[case.dtype]
    tag = " tf32" if tf32 else f" {case.dtype}"
    step, limit, free = (TF32, TF32, TF32) if tf32 else (FP32, u + FP32, FREE_RUNNING[case.dtype])
    worst = {} if case.proj else _check_trajectory(case, out, ctx, data, tag, step, limit)
    forward_only = case.cell == "rnn_relu"
    for key, want in ref64.items():
        if forward_only and not (key == "y" or key.startswith("hn")):
            continue
        err = relerr(out[key], want)
        measure = "float64 forward" if key == "y" or key.startswith("hn") else "float64 backward"
        worst[measure + tag] = max(worst.get(measure + tag, 0.0), err)
        _require(case, err <= free, f"{key}: relative error {err:.3g} against the float64 "
                                    f"layer > {free}")
    return worst


def _check_trajectory(case: Case, out: dict, ctx, data: dict, tag: str, step: float,
                      limit: float) -> dict[str, float]:
    """``check_layer``'s first measure, along the run's own states; the worst errors (a 16-bit
    layer's weight gradients within ``TF32_PRODUCTS`` more: their products in TF32)."""
    excess, traj = trajectory_reference(ctx, data)
    worst = {"trajectory forward" + tag: excess}
    _require(case, excess <= step, f"a state is {excess:.3g} past one rounding of its "
                                   f"float64 step (tolerance {step})")
    for key, want in traj.items():
        err = relerr(out[key], want)
        worst["trajectory backward" + tag] = max(worst.get("trajectory backward" + tag, 0.0), err)
        bound = limit + (TF32_PRODUCTS if ctx.half and key.startswith("weight_") else 0.0)
        _require(case, err <= bound, f"{key}: relative error {err:.3g} against float64 along "
                                     f"the run's states > {bound:.3g}")
    return worst


def _require(case: Case, ok: bool, what: str) -> None:
    if not ok:
        raise CampaignFailure(f"{what}\n  case: {case}\n  reproduce: {case.command()}")


# ---- the three kinds of case -----------------------------------------------------------------

def _settings(case: Case) -> dict:
    common = dict(stack=case.stack, allow_tf32=case.tf32)
    if case.stall is not None:
        return dict(common, emulation_timeout_ms=STALL_TIMEOUT_MS, max_restarts=10)
    if case.max_resident is not None:
        # The short timeout only where CTAs are held back: a whole grid of resident CTAs on a
        # busy machine can take longer than that between two steps (a seed-25 run timed out).
        timeout_ms = RESIDENT_TIMEOUT_MS if _held_back(case) else 10_000
        return dict(common, emulation_timeout_ms=timeout_ms, max_restarts=1,
                    emulation_max_resident=case.max_resident)
    # generous: the emulation shares busy cores
    return dict(common, emulation_timeout_ms=10_000)


def run_layer_case(case: Case) -> dict[str, float]:
    """A layer case (see the module docstring); returns its worst errors."""
    data = _data(case, np.random.default_rng(case.seed + 1))
    ours = _layer(case, case.dtype, case.algo)
    ref = _layer(case, "float64", "gemm", {k: v.astype(np.float64) for k, v in ours.params.items()})
    with _running(case):
        plain = None
        if case.stall is not None:
            plain, _, _, _ = _run_layer(ours, data)
            ours.zero_grad()
            with prnn.inject_stall(block=case.stall[0], step=case.stall[1], duration_ms=STALL_MS):
                out, ctx, fwd, bwd = _run_layer(ours, data)
        else:
            out, ctx, fwd, bwd = _run_layer(ours, data)
    ref64, _, _, _ = _run_layer(ref, data)
    _check_stats(case, fwd, bwd)
    if plain is not None and fwd.fallback is None and bwd.fallback is None:
        for key, a in plain.items():
            _require(case, np.array_equal(a, out[key], equal_nan=True),
                     f"{key}: the stalled (restarted) run differs from the undisturbed one")
    worst = check_layer(case, out, ctx, ref64, data, case.tf32)  # (before the layer's next call)
    if case.max_resident is None:  # (CTAs held back: a fallback's bits are the GEMM path's)
        with _running(case):
            check_repeat(case, ours)
    return worst


@contextlib.contextmanager
def _running(case: Case):
    """The case's emulated device, settings and emulation modes inside the block."""
    with emulated_device(case.path), prnn.override_settings(**_settings(case)), \
            emulate.modes(*case.modes, seed=case.seed):
        yield


def check_repeat(case: Case, ours) -> None:
    """The case's call repeated (docs/design.md, planned calls): a forward of new data of the same
    shapes (the call that plans the signature), the weights updated in place, then a forward and
    backward of new data without dhn (what a planned backward takes), which must be bit for bit a
    fresh layer's with the same weights (the full path). Persistent layers must have planned it."""
    rng = np.random.default_rng([case.seed, 3])
    ours.forward(*_inputs(ours, _data(case, rng)))
    for p in ours.params.values():  # (in place: the plan keeps the arrays, not their values)
        p[...] = (p.astype(np.float64) * (1 + 0.1 * rng.standard_normal(p.shape))).astype(p.dtype)
    data = dict(_data(case, rng), dhn=None)
    planned = ours._plan is not None
    _require(case, planned or case.algo != "persistent" or ours.last_run.algo != "persistent",
             f"the call's signature was not planned: {ours.last_run}")
    ours.zero_grad()
    got, _, _, _ = _run_layer(ours, data)
    fresh = _layer(case, case.dtype, case.algo, {k: v.copy() for k, v in ours.params.items()})
    want, _, _, _ = _run_layer(fresh, data)
    for key, a in want.items():
        _require(case, np.array_equal(got[key], a, equal_nan=True),
                 f"{key}: the {'planned' if planned else 'repeated'} call differs from a fresh "
                 f"layer's (max |difference| {np.nanmax(np.abs(got[key] - a)):.3g})")


def _check_stats(case: Case, fwd, bwd) -> None:
    """``last_run`` says what ran: the algorithm, the exchange path, restarts, fallbacks."""
    for name, s in (("forward", fwd), ("backward", bwd)):
        if case.algo != "persistent":
            _require(case, s.algo == "gemm" and not s.emulated, f"{name} ran {s}, not gemm")
            continue
        _require(case, s.algo == "persistent" and s.emulated, f"{name}: last_run {s}")
        stacked = any("prnn_stack_" in d for d in s.details)
        _require(case, stacked == _stacked(case),
                 f"{name}: stack mode {'used' if stacked else 'not used'}: {s.details}")
        clustered = any("PRNN_CLUSTER" in d for d in s.details)
        tile = _plan(case).tile  # (a projection's: no cluster field while it has no cluster tile)
        want = not stacked and case.path == "cluster" and getattr(tile, "cluster", 0) > 0
        _require(case, clustered == want, f"{name} ran on the wrong exchange path: {s.details}")
        if case.dtype == "float32" and s.fallback is None:  # (fp32: PRNN_MMA is a TF32 tile)
            tf32 = any("PRNN_MMA" in d for d in s.details)
            want = case.tf32 and "PRNN_MMA" in _pass_defines(case, name)
            _require(case, tf32 == want, f"{name}: TF32 tiles {'used' if tf32 else 'not used'} "
                                         f"(allow_tf32 {case.tf32}): {s.details}")
        if _held_back(case, name):  # a launch times out: restarts, the GEMM path when they run out
            _require(case, s.restarts >= 1 or "barrier timeouts" in (s.fallback or ""),
                     f"{name}: CTAs held back but neither a restart nor a fallback: {s}")
        else:
            _require(case, s.fallback is None, f"{name}: unexpected fallback: {s}")
    if case.stall is None:
        return
    # nobody waits after a pass's last step: forward's T-1, backward's 0 (it runs down)
    for name, s, last in (("forward", fwd, case.steps - 1), ("backward", bwd, 0)):
        if 1 < _grid(case, name) and case.stall[0] < _grid(case, name):
            _require(case, s.restarts >= 1 or case.stall[1] == last,
                     f"{name}: a stalled CTA caused no restart: {s}")


def _torch_module(case: Case, library: bool):
    """The case's ``persistent_rnn.torch`` module (or ``torch.nn``'s) in float64, seeded."""
    import torch
    import persistent_rnn.torch as ptorch
    mode, kw = layer_args(case.cell)
    torch.manual_seed(case.seed)
    ns, extra = (ptorch, {"algo": case.algo}) if library else (torch.nn, {})
    return getattr(ns, mode)(case.input_size, case.hidden, num_layers=case.num_layers,
                             bias=case.bias, batch_first=case.batch_first,
                             bidirectional=case.bidirectional, **kw, **extra).double()


def run_module(module, data: dict, dtype, batch_first: bool) -> dict[str, np.ndarray]:
    """A torch module's forward (packed where ``lengths``) and backward of
    ``sum(y * dy) + sum(h_n * dh_n)`` in ``dtype``: outputs and every gradient, float64."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    t = lambda a: torch.tensor(a, dtype=dtype, requires_grad=True)  # noqa: E731
    x = t(data["x"])
    states = None if data["hx"] is None else [t(h) for h in _flat(data["hx"])]
    hx = None if states is None else (tuple(states) if len(states) == 2 else states[0])
    module.zero_grad()
    if data["lengths"] is None:
        y, hn = module(x, hx)
    else:
        packed = pack_padded_sequence(x, torch.tensor(data["lengths"]), batch_first=batch_first,
                                      enforce_sorted=False)
        y, hn = module(packed, hx)
        y, _ = pad_packed_sequence(y, batch_first=batch_first, total_length=x.shape[
            1 if batch_first else 0])
    loss = (y * torch.tensor(data["dy"], dtype=dtype)).sum()
    for h, d in zip(_flat(hn), _flat(data["dhn"])):
        loss = loss + (h * torch.tensor(d, dtype=dtype)).sum()
    loss.backward()
    out = {"y": y, "dx": x.grad, **{f"hn[{i}]": h for i, h in enumerate(_flat(hn))},
           **{f"dhx[{i}]": s.grad for i, s in enumerate(states or [])},
           **{k: p.grad for k, p in module.named_parameters()}}
    return {k: v.detach().double().numpy() for k, v in out.items()}


def run_module_case(case: Case) -> dict[str, float]:
    """A torch-module case: ours against torch.nn in float64 (outputs and every gradient)."""
    import torch
    data = _data(case, np.random.default_rng(case.seed + 1))
    ours, ref = _torch_module(case, True), _torch_module(case, False)
    dtype = getattr(torch, case.dtype)
    ours.to(dtype).load_state_dict(ref.state_dict())  # the same weights, in ours' dtype
    ref.load_state_dict(ours.state_dict())
    with emulated_device(case.path), prnn.override_settings(**_settings(case)):
        got = run_module(ours, data, dtype, case.batch_first)
    ran = ours.last_run
    want = run_module(ref, data, torch.float64, case.batch_first)
    expect = "torch" if case.algo == "auto" else case.algo  # auto on CPU: torch's kernels
    _require(case, ran.algo == expect and (expect == "torch" or ran.fallback is None)
             and (expect == "torch" or ran.backward is not None)
             and ran.emulated == (expect == "persistent"), f"last_run {ran} (expected {expect})")
    tf32 = case.tf32  # (the tiles and the float32 GEMMs in TF32)
    tol = MODULE_F64 if case.dtype == "float64" else TF32 if tf32 else FREE_RUNNING["float32"]
    # relu in float32: a pre-activation within rounding of zero flips the derivative between
    # any two float32 runs, so its gradients are held to the library layer's (checked against
    # float64 along its own states by the layer cases), its outputs to torch.nn's.
    same_layer = case.dtype == "float32" and case.cell == "rnn_relu"
    if same_layer:
        layer = _layer(case, "float32", case.algo, {k: v.detach().float().numpy()
                                                    for k, v in ours.state_dict().items()})
        with emulated_device(case.path), prnn.override_settings(**_settings(case)):
            lib, _, _, _ = _run_layer(layer, data)
    worst = 0.0
    for key, w in want.items():
        gradient = not (key == "y" or key.startswith("hn"))
        err = relerr(got[key], lib[key] if same_layer and gradient else w)
        worst = max(worst, err)
        against = "the library layer" if same_layer and gradient else "torch.nn"
        _require(case, err <= tol, f"{key}: relative error {err:.3g} against {against} > {tol}")
    with emulated_device(case.path), prnn.override_settings(**_settings(case)):
        check_module_repeat(case, ours, dtype)
    return {f"torch.nn {'tf32' if tf32 else case.dtype}": worst}


def check_module_repeat(case: Case, ours, dtype) -> None:
    """``check_repeat`` for a torch module: the call again on new data (which plans its
    signature), the weights updated in place, and once more (planned where persistent), bit for
    bit a fresh module's with the same weights."""
    import torch
    rng = np.random.default_rng([case.seed, 3])
    run_module(ours, _data(case, rng), dtype, case.batch_first)
    noise = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=noise, dtype=p.dtype))
    data = _data(case, rng)
    _require(case, ours._record.plan is not None or case.algo != "persistent"
             or ours.last_run.algo != "persistent",
             f"the module's call was not planned: {ours.last_run}")
    got = run_module(ours, data, dtype, case.batch_first)
    fresh = _torch_module(case, True).to(dtype)
    fresh.load_state_dict(ours.state_dict())
    want = run_module(fresh, data, dtype, case.batch_first)
    for key, a in want.items():
        _require(case, np.array_equal(got[key], a, equal_nan=True),
                 f"{key}: the module's repeated call differs from a fresh module's (max "
                 f"|difference| {np.nanmax(np.abs(got[key] - a)):.3g})")


# ---- bad inputs ------------------------------------------------------------------------------
# Each turns a good call's arrays into (x, hx, lengths) with one mistake and names the argument
# the layer's error must name; ``run_bad_case`` also hands the mistake to the torch module and
# torch.nn.

@dataclass(frozen=True)
class Good:
    """A good call: x (in the case's layout), h (one state array), the cell's kind, B, T."""

    x: np.ndarray
    h: np.ndarray
    lstm: bool
    batch: int
    steps: int
    batch_first: bool

    def state(self, h: Any) -> Any:
        """``h`` as the cell's state: a pair (h, the good c) for the LSTM."""
        return (h, self.h) if self.lstm else h


BAD_INPUTS: dict[str, Callable[[Good], tuple[tuple, str]]] = {
    "x rank 2": lambda g: ((g.x[0], None, None), "x"),
    "x rank 4": lambda g: ((g.x[..., None], None, None), "x"),
    "x input size": lambda g: ((np.concatenate([g.x, g.x[..., :1]], 2), None, None), "x"),
    "x no steps": lambda g: ((g.x[:, :0] if g.batch_first else g.x[:0], None, None), "x"),
    "x float64": lambda g: ((g.x.astype(np.float64), None, None), "x"),
    "x int64": lambda g: ((g.x.astype(np.int64), None, None), "x"),
    "x big-endian": lambda g: ((g.x.astype(">f4"), None, None), "x"),
    "x list": lambda g: ((g.x.tolist(), None, None), "x"),
    "x None": lambda g: ((None, None, None), "x"),
    "hx layers": lambda g: ((g.x, g.state(np.concatenate([g.h, g.h[:1]])), None), "hx"),
    "hx batch": lambda g: ((g.x, g.state(np.concatenate([g.h, g.h[:, :1]], 1)), None), "hx"),
    "hx hidden": lambda g: ((g.x, g.state(np.concatenate([g.h, g.h[..., :1]], 2)), None), "hx"),
    "hx rank 2": lambda g: ((g.x, g.state(g.h[0]), None), "hx"),
    "hx float64": lambda g: ((g.x, g.state(g.h.astype(np.float64)), None), "hx"),
    "hx pair for a single state": lambda g: ((g.x, (g.h,) * (3 if g.lstm else 2), None), "hx"),
    "hx pair with None": lambda g: ((g.x, (g.h, None) if g.lstm else [g.h], None), "hx"),
    "lengths count": lambda g: ((g.x, None, [1] * (g.batch + 1)), "lengths"),
    "lengths zero": lambda g: ((g.x, None, [0] * g.batch), "lengths"),
    "lengths past T": lambda g: ((g.x, None, [g.steps + 1] * g.batch), "lengths"),
    "lengths float": lambda g: ((g.x, None, [1.0] * g.batch), "lengths"),
    "lengths empty": lambda g: ((g.x, None, []), "lengths"),
}


def run_bad_case(case: Case) -> dict[str, float]:
    """The layer raises TypeError/ValueError naming the argument; the torch module raises what
    torch.nn raises."""
    rng = np.random.default_rng(case.seed + 1)
    lead = (case.batch, case.steps) if case.batch_first else (case.steps, case.batch)
    dirs = 2 if case.bidirectional else 1
    good = Good(rng.standard_normal(lead + (case.input_size,)).astype(np.float32),
                rng.standard_normal((case.num_layers * dirs, case.batch, case.hidden)).astype(
                    np.float32), REGISTRY[case.cell].has_cell_state, case.batch, case.steps,
                case.batch_first)
    (x, hx, lengths), name = BAD_INPUTS[case.bad](good)
    layer = _layer(case, "float32", case.algo)
    try:
        with emulated_device(case.path), prnn.override_settings(**_settings(case)):
            layer.forward(x, hx, lengths)
    except (TypeError, ValueError) as exc:
        _require(case, name in str(exc), f"{case.bad}: the error does not name {name!r}: {exc!r}")
    else:
        _require(case, False, f"{case.bad}: accepted")
    _torch_agrees(case, x, hx, lengths, name)
    return {}


def _torch_agrees(case: Case, x, hx, lengths, name: str) -> None:
    """The same mistake through the torch module (algo gemm: no kernel fit to confuse things)
    and torch.nn: the same exception type (or both none)."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence

    def to_tensor(a):
        if isinstance(a, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(a, a.dtype.newbyteorder("=")))
        if isinstance(a, (tuple, list)) and a and not np.isscalar(a[0]):
            return type(a)(to_tensor(v) for v in a)
        return a

    def call(module):
        try:
            tx = to_tensor(x)
            if lengths is not None:
                tx = pack_padded_sequence(tx, torch.tensor(lengths), batch_first=case.batch_first,
                                          enforce_sorted=False)
            module(tx, to_tensor(hx))
            return None, ""
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            return type(exc), str(exc)

    ours = dataclasses.replace(case, algo="gemm")
    mine, theirs = call(_torch_module(ours, True).float()), call(_torch_module(ours, False).float())
    # torch.nn's error type, or (where torch.nn fails deep in a kernel) a clear one naming it
    named = mine[0] in (TypeError, ValueError) and theirs[0] is not None and name in mine[1]
    _require(case, mine[0] == theirs[0] or named, f"{case.bad}: the torch module raised "
                                                  f"{mine[0]}, torch.nn {theirs[0]}")


# ---- running ---------------------------------------------------------------------------------

RUNNERS = {"layer": run_layer_case, "module": run_module_case, "bad": run_bad_case}


def run_case(case: Case) -> dict[str, float]:
    """Run one case; raises ``CampaignFailure`` (with the reproducer) where it fails. An
    unexpected exception is a failure too, reported the same way. A case starts with no
    configuration cooling down (``runtime.COOLDOWNS``: an earlier case's CTAs held back would send
    a later case of the same configuration to the GEMM path), so that its reproducer reproduces it."""
    runtime.COOLDOWNS.clear()
    try:
        return RUNNERS[case.kind](case)
    except CampaignFailure:
        raise
    except Exception as exc:
        raise CampaignFailure(f"{type(exc).__name__}: {exc}\n  case: {case}\n  reproduce: "
                              f"{case.command()}") from exc


def campaign(seconds: float, seed: int, profile: str, out=sys.stdout) -> dict:
    """Draw and run cases from ``seed`` until ``seconds`` have passed; a summary dict. Stops at
    the first failure (re-raised after the summary line)."""
    seeds = np.random.default_rng(seed)
    start, done, configs, worst = time.monotonic(), {k: 0 for k in KINDS}, set(), {}
    while time.monotonic() - start < seconds:
        case = draw_case(int(seeds.integers(2**31)), profile)
        t0 = time.monotonic()
        try:
            errs = run_case(case)
        except CampaignFailure as exc:
            print(f"FAILED after {sum(done.values())} passing cases: {exc}", file=out, flush=True)
            raise
        done[case.kind] += 1
        configs.add(_configuration(case))
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(f"ok {case.kind:6} {time.monotonic() - t0:6.1f}s seed {case.seed} {_brief(case)}",
              file=out, flush=True)
    summary = {"seed": seed, "profile": profile, "cases": sum(done.values()), **done,
               "kernel configurations": len(configs - {None}),
               "worst": {k: float(f"{v:.3g}") for k, v in sorted(worst.items())},
               "seconds": round(time.monotonic() - start)}
    print(f"campaign passed: {summary}", file=out, flush=True)
    return summary


def _configuration(case: Case) -> tuple | None:
    """The emulated kernel build a case ran (cell, weights, exchange, compile-time tile)."""
    if case.algo != "persistent":
        return None
    return case.cell, case.dtype, tuple(sorted(_plan(case).forward.defines.items()))


def _brief(case: Case) -> str:
    if case.kind == "bad":
        return f"{case.cell} {case.bad!r}"
    extra = (f" stall {case.stall}" if case.stall else "") + (
        f" resident {case.max_resident}" if case.max_resident else "") + (
        f" modes {','.join(case.modes)}" if case.modes else "") + (" tf32" if case.tf32 else "") + (
        f" proj {case.proj}" if case.proj else "")
    path = "/" + case.path if case.algo == "persistent" else ""
    return (f"{case.cell} {case.dtype} {case.algo}{path}"
            f" H{case.hidden} B{case.batch} T{case.steps} L{case.num_layers}"
            f"{' bi' if case.bidirectional else ''}{' len' if case.lengths else ''}"
            f"{' hx' if case.hx else ''}{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="run cases for this long")
    p.add_argument("--seed", type=int, default=None, help="campaign seed (default: from time)")
    p.add_argument("--profile", choices=("ci", "long"), default="long")
    p.add_argument("--case", type=int, default=None, help="replay one case of this seed")
    p.add_argument("--kind", choices=KINDS, default=None, help="with --case: its kind")
    p.add_argument("--race-detector", action="store_true",
                   help="every emulated kernel under the race detector (a child process; slow)")
    args = p.parse_args(argv)
    if args.race_detector and not os.environ.get(emulate.RACE_DETECTOR_ENV):
        argv = sys.argv[1:] if argv is None else argv
        return emulate.run_with_race_detector(["-m", "tests.campaign", *argv],
                                              capture=False).returncode
    if args.case is not None:
        case = draw_case(args.case, args.profile, args.kind)
        print(case)
        print(run_case(case))
        return 0
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"campaign seed {seed} (replay: --seed {seed}), profile {args.profile}", flush=True)
    campaign(args.minutes * 60, seed, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
