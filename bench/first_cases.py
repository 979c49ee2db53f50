"""What the first GPU call checks and times (bench/first_call.py): the cases, at GPU size and at
the tiny size the ``--cpu`` harness check runs them in the emulation.

The tiny sizes repeat those of tests/gpu_sanitize_case.py (cluster cells at H 40, 16-bit at
H 64, LSTMP 128/32, a stack of two at H 64; batch 2), so the emulated builds the test suite
already made serve the ``--cpu`` run too. The emulation would place a layer on the grid only
above H 256, which it runs slowly; the grid cases run at H 40 there instead, with clusters
turned off (``max_cluster_ctas=0``, ``FORCE_GRID``) - the same grid kernels, fewer CTAs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GROUPS = ("fp32", "tf32", "struct", "half")
# max |ours - reference| / max |reference| over every output and gradient: against float64 on
# the CPU (the same weights and inputs, upcast), and against torch.nn on the same device.
# 16-bit: the library rounds h_t to the dtype every step (docs/api.md), torch.nn computes its
# own way, so both sit near the dtype's rounding; these catch wrong results, not rounding.
# TF32 (a float32 case with ``allow_tf32``): docs/api.md's bound, "TF32" (fp16's 10-bit mantissa).
TOLERANCE = {"float32": 2e-5, "tf32": 5e-3, "float16": 1e-2, "bfloat16": 5e-2}
SEQ_LENS = (100, 300)  # timing: the slope between them is the per-step cost, the rest per call
CPU_SEQ_LENS = (2, 3)
FORCE_GRID = {"max_cluster_ctas": 0}  # the settings that put a tiny emulated layer on the grid


@dataclass(frozen=True)
class Case:
    """A layer run through ``persistent_rnn.torch`` (algo="persistent") against torch.nn.

    ``placement``: the path the persistent kernel must take ("cluster" or "grid"; None: not
    checked); ``lengths``: packed input of unequal lengths; ``options``: torch.nn's keywords
    (``nonlinearity``, ``proj_size``, ``num_layers``, ``bidirectional``); ``settings``: the
    library's settings the case runs under (``allow_tf32``: the TF32 tiles, which ``last_run``
    must show); ``tiny``: the ``--cpu`` size (hidden, proj_size), at ``tiny_batch``.
    """

    name: str
    group: str
    mode: str
    hidden: int
    batch: int
    dtype: str = "float32"
    placement: str | None = None
    lengths: bool = False
    options: dict = field(default_factory=dict)
    tiny: tuple[int, int] = (40, 0)
    steps: int = 12
    input_size: int = 32
    settings: dict = field(default_factory=dict)
    tiny_batch: int = 2

    @property
    def tf32(self) -> bool:
        """Whether the case must run the TF32 tiles (forward and backward)."""
        return bool(self.settings.get("allow_tf32"))

    def tolerance(self) -> float:
        """Its bound on the relative error (``TOLERANCE``)."""
        return TOLERANCE["tf32" if self.tf32 else self.dtype]

    def cell(self) -> str:
        """The planner's and the model's cell name."""
        if self.mode == "RNN":
            return "rnn_" + self.options.get("nonlinearity", "tanh")
        return self.mode.lower()

    def sized(self, cpu: bool) -> "Case":
        """The case as it runs: itself on a GPU, at its tiny size for the emulation."""
        if not cpu:
            return self
        hidden, proj = self.tiny
        options = dict(self.options, **({"proj_size": proj} if proj else {}))
        return replace(self, hidden=hidden, batch=self.tiny_batch, steps=4, input_size=24,
                       options=options)


def _rnn(nonlinearity: str) -> dict:
    return {"nonlinearity": nonlinearity}


CASES = (
    # fp32 single layers on both paths: small layers as one thread-block cluster, large on the grid
    Case("rnn_tanh_h128_b3", "fp32", "RNN", 128, 3, options=_rnn("tanh")),
    Case("rnn_relu_h128_b3", "fp32", "RNN", 128, 3, options=_rnn("relu")),
    Case("gru_h256_b1", "fp32", "GRU", 256, 1, placement="cluster"),
    Case("lstm_h256_b3", "fp32", "LSTM", 256, 3, placement="cluster"),
    Case("rnn_tanh_h512_b1", "fp32", "RNN", 512, 1, options=_rnn("tanh")),
    Case("lstm_h1024_b4", "fp32", "LSTM", 1024, 4, placement="grid"),
    Case("gru_h1024_b4", "fp32", "GRU", 1024, 4, placement="grid"),
    # TF32 tiles (allow_tf32): the headline layer, where the planner takes them forward (B >= 3
    # on the grid) and backward (B >= 4); in the emulation at H 40 B 4 on the grid
    Case("lstm_h1024_b4_tf32", "tf32", "LSTM", 1024, 4, placement="grid",
         settings={"allow_tf32": True}, tiny_batch=4),
    # projection, stacks, bidirectional with lengths
    Case("lstmp_h1024_p256_b4", "struct", "LSTM", 1024, 4, options={"proj_size": 256},
         tiny=(128, 32)),
    Case("lstm_stack2_h256_b3", "struct", "LSTM", 256, 3, options={"num_layers": 2},
         tiny=(64, 0)),
    Case("gru_bidir_h256_b3_lengths", "struct", "GRU", 256, 3, lengths=True,
         options={"bidirectional": True}),
    Case("lstm_stack2_bidir_h128_b4_lengths", "struct", "LSTM", 128, 4, lengths=True,
         options={"num_layers": 2, "bidirectional": True}),
    # 16-bit through the torch modules (W_hh held in 16 bits, fp32 compute)
    Case("lstm_h256_b3_fp16", "half", "LSTM", 256, 3, "float16", tiny=(64, 0)),
    # the mid-size 16-bit forward in one 16-CTA cluster, its backward on the grid
    # (tiles.MMA_MID_CLUSTER_TILES, 2026-11-27: never run on a GPU before)
    Case("lstm_h512_b4_fp16", "half", "LSTM", 512, 4, "float16", tiny=(64, 0)),
    Case("lstm_h1024_b8_fp16", "half", "LSTM", 1024, 8, "float16", tiny=(64, 0)),
    Case("gru_h256_b3_bf16", "half", "GRU", 256, 3, "bfloat16", tiny=(64, 0)),
    Case("lstm_h1024_b8_bf16", "half", "LSTM", 1024, 8, "bfloat16", tiny=(64, 0)),
)


# The cases the test suite's run of the ``--cpu`` check takes (``sample=True``): each road of
# the harness once - a cluster and a grid layer, a grid layer on the TF32 tiles, a projection, a
# bidirectional stack with lengths, 16-bit through the module. Before a GPU slot the whole check runs (docs/benchmarks.md).
CPU_SAMPLE = ("lstm_h256_b3", "lstm_h1024_b4", "lstm_h1024_b4_tf32", "lstmp_h1024_p256_b4",
              "lstm_stack2_bidir_h128_b4_lengths", "gru_h256_b3_bf16")


def group_cases(group: str, cpu: bool, sample: bool = False) -> list[Case]:
    """The cases of ``group`` as they run: on a GPU all of them; at the ``--cpu`` check's tiny
    sizes, one case per distinct run (several GPU cases shrink to the same layer there, e.g. the
    two tanh RNNs or the two fp16 LSTMs, and would only repeat it; a placement stays distinct:
    the grid cases run with clusters off); ``sample``: the ``CPU_SAMPLE`` cases alone."""
    seen, out = set(), []
    for case in CASES:
        if case.group != group or (sample and case.name not in CPU_SAMPLE):
            continue
        sized = case.sized(cpu)
        run = (sized.mode, sized.hidden, sized.batch, sized.dtype, sized.placement, sized.lengths,
               sized.steps, sized.input_size, tuple(sorted(sized.options.items())),
               tuple(sorted(sized.settings.items())))
        if not cpu or run not in seen:
            seen.add(run)
            out.append(sized)
    return out


@dataclass(frozen=True)
class Stall:
    """A stall injected into CTA ``block`` of a layer (CuPy arrays; NumPy in the emulation):
    the pass must restart and give the bits of the run without the stall."""

    name: str
    mode: str
    hidden: int
    batch: int
    block: int
    placement: str | None = None
    num_layers: int = 1
    tiny_hidden: int = 40
    steps: int = 16

    def sized(self, cpu: bool) -> "Stall":
        """Itself on a GPU; the tiny size (and 6 steps) in the emulation."""
        return replace(self, hidden=self.tiny_hidden, batch=2, steps=6) if cpu else self


STALLS = (
    Stall("stall_grid_lstm_h1024_b4", "LSTM", 1024, 4, block=1, placement="grid"),
    Stall("stall_cluster_gru_h256_b1", "GRU", 256, 1, block=1, placement="cluster"),
    Stall("stall_stack2_lstm_h256_b3", "LSTM", 256, 3, block=1, num_layers=2, tiny_hidden=64),
)


@dataclass(frozen=True)
class TimingConfig:
    """A layer timed with every algorithm side by side (``tiny``: its ``--cpu`` hidden size, at
    ``tiny_batch``; ``settings``: the library's settings it runs under, as ``Case``'s)."""

    name: str
    cell: str
    hidden: int
    batch: int
    dtype: str = "float32"
    input_size: int = 64
    tiny: int = 40
    settings: dict = field(default_factory=dict)
    tiny_batch: int = 2

    def sized(self, cpu: bool) -> "TimingConfig":
        """Itself on a GPU; the tiny size in the emulation."""
        return replace(self, hidden=self.tiny, batch=self.tiny_batch, input_size=24) if cpu \
            else self


def _half(cell: str, hidden: int, batch: int) -> TimingConfig:
    # input 128: one of cuDNN's conditions for its own persistent fp16 kernel
    return TimingConfig(f"{cell}_h{hidden}_b{batch}_fp16", cell, hidden, batch, "float16",
                        input_size=128, tiny=64)


# issue 28's fp16 points against torch.nn in fp16 (cuDNN's persistent kernel where torch picks it:
# H a multiple of 128, B a multiple of 8), the headline LSTM H=1024 B=8 first; H=512 at B 4 and 8
# runs its forward in a 16-CTA cluster since 2026-11-27 (tiles.MMA_MID_CLUSTER_TILES: their first
# measurement), its backward and the rest on the grid
HALF_TIMING = (_half("lstm", 1024, 8),) + tuple(
    _half("lstm", h, b) for h in (512, 768, 1024) for b in (4, 8, 16) if (h, b) != (1024, 8)
) + (_half("gru", 1024, 8),)
TIMING = (
    TimingConfig("lstm_h1024_b4", "lstm", 1024, 4),
    TimingConfig("gru_h256_b1", "gru", 256, 1),
    TimingConfig("lstm_h256_b1", "lstm", 256, 1),
    TimingConfig("rnn_tanh_h512_b1", "rnn_tanh", 512, 1),
) + HALF_TIMING
# what the --cpu check times (the others repeat the same code at the tiny sizes): the fp32
# headline and the 16-bit one
CPU_TIMING = (TIMING[0], HALF_TIMING[0])
TIMING_ALGOS = ("persistent", "gemm", "prnn_torch", "cudnn")
# The TF32 tiles timed (step ``time_tf32``): the headline layer with ``allow_tf32``, the library's
# two roads, set beside the same layer's fp32 and cuDNN figures of ``TIMING`` (``first_report``)
TF32_TIMING = replace(TIMING[0], name="lstm_h1024_b4_tf32", settings={"allow_tf32": True},
                      tiny_batch=4)
TF32_ALGOS = ("persistent", "prnn_torch")


def prediction_jobs(cpu: bool) -> list[dict]:
    """Every distinct layer the call runs, as the model's arguments (GPU sizes; ``tf32``: planned
    as with ``allow_tf32``, ``prnn plan ... --tf32``). The ``--cpu`` check predicts
    ``CPU_TIMING`` and ``TF32_TIMING`` only (on the h100 profile): the rest repeat the same code."""
    jobs: dict[tuple, dict] = {}  # (cell, hidden, batch, dtype, layers, bidirectional, proj, tf32)
    for t in (*(CPU_TIMING if cpu else TIMING), TF32_TIMING):
        jobs.setdefault((t.cell, t.hidden, t.batch, t.dtype, 1, False, 0,
                         bool(t.settings.get("allow_tf32"))), {"name": t.name, "timing": True})
    if not cpu:
        for c in CASES:
            # a stack, or a bidirectional layer (the stack kernel runs both directions at once);
            # a projection is listed with the model's note (it has no projection kernels)
            jobs.setdefault((c.cell(), c.hidden, c.batch, c.dtype, c.options.get("num_layers", 1),
                             c.options.get("bidirectional", False), c.options.get("proj_size", 0),
                             c.tf32), {"name": c.name})
        for s in STALLS:
            jobs.setdefault((s.mode.lower(), s.hidden, s.batch, "float32", s.num_layers, False, 0,
                             False), {"name": s.name})
    return [dict(job, cell=k[0], hidden=k[1], batch=k[2], dtype=k[3], layers=k[4],
                 bidirectional=k[5], proj_size=k[6], tf32=k[7]) for k, job in jobs.items()]
