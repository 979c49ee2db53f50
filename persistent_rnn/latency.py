"""A per-step latency model of the persistent kernels, read from their SASS: a *prediction*.

One step of a persistent pass is a chain of phases separated by block barriers (docs/design.md,
"Latency model"), so its time is modelled as the sum of a few named terms, each one function of
the ``StepLoop`` that ``step_loop`` reads from the SASS once:

* ``issue``: every instruction one warp executes in a step outside the matrix loop (the time
  loop's SASS, each inner loop multiplied by its trip count), times the warps that share a
  scheduler, at one instruction per scheduler and cycle;
* ``matrix``: the matrix loop, per batch row the larger of its issue time and its dependent chain;
* ``barriers``: the block barriers of the step;
* ``exchange``: moving h_t (dgh_t) between CTAs - a counter grid barrier (fence, atomic, polls,
  then the staging copy: public round trips), or tagged words through L2 or in a cluster's
  distributed shared memory: the exchange round measured on the device at the pass's CTA count
  (``hardware.EXCHANGE_ROUND_NS`` / ``CLUSTER_ROUND_NS``) plus what the step moves beyond it;
* ``pointwise``: the dependent chain of the cell's pointwise step (MUFU, FMA and shared loads, the
  critical path through the registers of its SASS), per pointwise iteration;
* ``prefetch``: the wait for the next step's inputs where their copy is issued too late to hide.

A benchmark of T steps adds per-call terms once (``call_us``): the host's work for the call and
the GEMMs around the recurrence (input projection; backward: weight gradients and dx); a pass's
kernel in one call adds its launches and its weights' load (``pass_kernel_us``).

The constants are in ``hardware.py`` with their sources; the few fitted ones come from
``bench/model_calibration.py``, which also records the model's error on the measured runs
(``CALIBRATION``). Nothing here needs a GPU: the cubins come from NVRTC (cached).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from . import hardware as hw
from . import kernels
from . import plan as planner
from .cells import CellSpec
from .hardware import DeviceProfile
from .sass_analysis import (TimeLoop, critical_path, disassemble, exchange_word_bytes, loop_kind,
                            nvdisasm, opcode_base, own_instructions, ready_path, steady_step,
                            step_atomic, time_loop)

# The model's error on the recorded runs of today's kernels
# (bench/results/model-calibration-2026-11-26.json and -2026-11-27.json; tests/test_latency.py
# holds both to the model).
CALIBRATION = ("calibrated on 19 points of today's kernels measured on an H200 and an H100 "
               "(2026-11-26): median |error| 3 %, worst 25 % (fp16 LSTM H=1024 B=8 forward over, "
               "fp32 LSTM H=1024 B=4 forward 11-16 % under); on the H200's 16 points of "
               "2026-11-27 (no refit, its cluster passes two steps ahead as they ran) median 10 %, "
               "worst 23 % (the same fp16 forward over, the fp32 LSTM forward 8-16 % under); the "
               "host per call's Python scaled by that run's measured 101 / 121 µs over the CPU "
               "stand-in of its code")

# The decoder step as measured against the model (not a calibration: the step is not fitted).
DECODER_MEASURED = ("measured on an H200 (2026-11-27, LSTM H=640 B=1, a captured loop): the step "
                    "kernel 6.36 µs a step against 4.59 predicted with the hand-offs priced as "
                    "measured exchange rounds (1.95 when each was one L2 round trip) - 28 % under "
                    "on that one point (bench/decoder_probe.py is to split it)")


@dataclass(frozen=True)
class PassShape:
    """What the model needs to know of one pass besides its SASS: the cell, the tile's
    compile-time configuration (``plan.PassPlan``), the batch and the hidden size (``proj``: an
    LSTM projection kernel's P, else 0)."""

    cell: CellSpec
    plan: planner.PassPlan
    batch: int
    hidden: int
    proj: int = 0

    @property
    def backward(self) -> bool:
        return "backward" in self.plan.kernel

    @property
    def k_len(self) -> int:
        """Length of the exchanged vector per batch row (forward H, backward G*H; an LSTM
        projection's two vectors together: P more)."""
        return (self.cell.gates * self.hidden if self.backward else self.hidden) + self.proj

    @property
    def exchanges(self) -> int:
        """Exchanges a step waits on one after the other: an LSTM projection's two (forward r
        and h, backward dr and dg; ``persistent_projection_*.cu``), else one."""
        return 2 if self.proj else 1

    @property
    def stack(self) -> bool:
        """Whether the pass is a stack kernel's (``cuda_src/stack_*.cu``)."""
        return self.plan.source.startswith("stack_")

    @property
    def gathers(self) -> int:
        """Vectors of ``k_len`` gathered one after another per step: a stack kernel's layer
        between two others waits for its own and its neighbour's (counted for every layer)."""
        return 2 if self.stack else 1

    @property
    def units(self) -> int:
        return self.plan.defines["PRNN_UNITS"]

    @property
    def warp_teams(self) -> bool:
        """Whether each warp finishes its own units (persistent_common.cuh, ``kWarpTeams``): a
        layer's forward whose warps hold all gate rows of their units over all of K."""
        return (self.plan.source == "persistent_forward.cu"
                and planner.warp_teams(self.cell, _tile_of(self).forward))

    @property
    def team_units(self) -> int:
        """Units one team of the pointwise step finishes: a warp's (warp teams) or the CTA's."""
        return self.units // self.warps if self.warp_teams else self.units

    @property
    def team_threads(self) -> int:
        """Threads of one such team."""
        return 32 if self.warp_teams else 32 * self.warps

    @property
    def warps(self) -> int:
        return self.plan.defines["PRNN_WARPS"]

    @property
    def quads(self) -> int:
        """16-byte quads of 4-byte tagged words one step publishes (and every CTA loads)."""
        return self.batch * -(-self.k_len // 4)

    @property
    def gather_quads(self) -> int:
        """Quads a thread of the gather loads at once: the planner's ``PRNN_GATHER_QUADS``
        (``plan.gather_quads``, ``plan.stack_gather_quads``), the kernels' ``kGatherQuads``."""
        return self.plan.defines["PRNN_GATHER_QUADS"]

    @property
    def batch_group(self) -> int:
        """Batch rows the pass stages at once (``plan.batch_group``): the batch, or a group."""
        return min(self.batch, self.plan.defines.get("PRNN_BATCH_GROUP") or self.batch)

    @property
    def groups(self) -> int:
        """Batch groups a step multiplies one after the other (1: the whole batch at once)."""
        return -(-self.batch // self.batch_group)

    @property
    def group_gather_rounds(self) -> int:
        """Batches of ``gather_quads`` a thread of the gather goes through per gathered group of
        rows (the whole batch but with batch groups): thread x takes quad slots x, x + threads,
        ... of the exchange's [rows][exchange_row] rows (slots past K are skipped, but hold their
        place); per gathered vector (``gathers``); an LSTM projection's two exchanges
        together."""
        rows = (self.plan.exchange_row,) + ((self.plan.exchange_row_b,) if self.proj else ())
        return sum(math.ceil(planner.quads_per_thread(self.batch_group, row, 32 * self.warps)
                             / self.gather_quads) for row in rows)

    @property
    def gather_rounds(self) -> int:
        """Batches of ``gather_quads`` a thread gathers per step: ``group_gather_rounds`` per
        batch group."""
        return self.groups * self.group_gather_rounds


def _tile_of(shape: PassShape) -> planner.Tile:
    d = shape.plan.defines
    pt = planner.PassTile(d["PRNN_ROWS"], d["PRNN_KSPLIT"], d["PRNN_KPT"])
    return planner.Tile(d["PRNN_UNITS"], pt, pt, d.get("PRNN_CLUSTER", 0))


def shape_at(cell: CellSpec, p: planner.PassPlan, batch: int, hidden: int,
             proj: int = 0) -> PassShape:
    """``p``'s configuration at another batch and hidden size (its shared memory re-sized as the
    planner would; ``proj``: an LSTM projection kernel's P, its shared memory kept)."""
    if proj:
        return PassShape(cell, p, batch, hidden, proj)
    shaped = replace(p, shared_bytes=planner.shared_bytes(
        cell, _tile_of(PassShape(cell, p, batch, hidden)), "backward" in p.kernel, batch,
        stack=p.source.startswith("stack_"),
        batch_group=p.defines.get("PRNN_BATCH_GROUP", 0)))
    return PassShape(cell, shaped, batch, hidden)


@dataclass(frozen=True)
class StepTerms:
    """Predicted microseconds of one step of one pass, by term (a prediction, see ``CALIBRATION``).

    ``issue_us``: instructions of the busiest scheduler outside the matrix loop; ``matrix_us``:
    the matrix loop, per batch row the larger of its issue time and its dependent chain;
    ``barrier_us``: block barriers;
    ``exchange_us``: the exchange (``exchange_us``: a measured round for the tagged ones, round
    trips for the counter barrier) plus, through L2, the exposed time every CTA's copy of the
    vector takes at L2 bandwidth;
    ``pointwise_us``: the pointwise step's dependent chain. ``instructions``: what one warp
    executes per step; ``exchange``: "counter", "l2" or "cluster"; ``per_row_instructions`` and
    ``per_row_ffma``: the matrix loop's instructions and FFMAs per batch row; ``prefetch_us``: the
    wait for the next step's gi where its copy is issued too late to be hidden (``prefetch_us``)."""

    issue_us: float
    matrix_us: float
    barrier_us: float
    exchange_us: float
    pointwise_us: float
    instructions: int
    exchange: str
    per_row_instructions: int
    per_row_ffma: int
    prefetch_us: float = 0.0

    @property
    def total_us(self) -> float:
        """The step: the sum of the terms (the phases are separated by barriers)."""
        return (self.issue_us + self.matrix_us + self.barrier_us + self.exchange_us
                + self.pointwise_us + self.prefetch_us)

    def dominant(self) -> str:
        """The name of the largest term."""
        terms = {"issue": self.issue_us, "matrix": self.matrix_us, "barriers": self.barrier_us,
                 "exchange": self.exchange_us, "pointwise": self.pointwise_us,
                 "prefetch": self.prefetch_us}
        return max(terms, key=terms.get)


# The per-thread loops a team runs over its own units (the others spread over the whole block).
_TEAM_LOOPS = ("pointwise", "prefetch")


def loop_items(kind: str, shape: PassShape, counter: bool) -> float | None:
    """Items a per-thread loop of ``kind`` spreads over the block's threads (thread x takes items
    x, x + threads, ...) for ``shape`` (the pointwise step and the prefetch: over a team's
    threads, ``PassShape.team_threads``, each team its own items); None for the loops every
    thread runs alike (the matrix loop, its levels, waits, "other")."""
    cell, b, units = shape.cell, shape.batch, shape.team_units
    if kind == "pointwise":
        return b * units
    if kind == "prefetch":  # the forward copies one gate of gi per item; the backward's items
        # are (batch row, unit), each copying all of that unit's inputs (dy, h, c, saved)
        return b * units if shape.backward else b * cell.gates * units
    if kind == "copy":  # counter kernels stage 4-byte values as quads (tagged words: as quads)
        if counter:
            return b * shape.plan.defines["PRNN_KSPLIT"] * 32 * shape.plan.defines["PRNN_KPT"] / 4
        return shape.quads
    if kind in ("chunks", "scan"):  # quad slots of the gather
        return shape.batch * shape.plan.exchange_row / 4
    return None


def loop_trips(kind: str, shape: PassShape, counter: bool, in_groups: bool = False) -> float:
    """Trip count per step of an inner loop of ``kind`` (see ``loop_kind``) for ``shape``:
    per-thread loops over n items (``loop_items``) run ceil(n / threads) times (the gather:
    ``PassShape.group_gather_rounds``); waits once, and then only the poll that finds its words
    (``ready_path``; the wait itself is the ``exchange`` term); the matrix loop once per batch
    row. ``in_groups``: the loop sits in the loop of the batch groups (``groups_loop``), which
    runs once per group: there an mma loop takes a group's n-tiles, the gather's loops run for
    every group but the first (per trip of the groups loop: (groups - 1) / groups of a gather)
    and the staging of a launch's first step not at all."""
    if kind == "matrix":
        return shape.batch
    if kind == "mma":  # n-tiles of 8 batch rows
        return math.ceil(shape.batch / 8) / (shape.groups if in_groups else 1)
    if kind == "groups":
        return shape.groups
    if kind == "levels":
        return math.log2(_rows_pow2(shape.plan.defines["PRNN_ROWS"]))
    if in_groups and kind in ("copy", "fallback", "other"):
        return 0
    if kind in ("chunks", "scan"):  # (an LSTM projection's two gathers: each its share)
        rounds = math.ceil(shape.group_gather_rounds / shape.exchanges)
        return rounds * (shape.groups - 1) / shape.groups if in_groups else rounds
    if kind == "fallback":
        return 0
    items = loop_items(kind, shape, counter)
    if items is None:
        return 1
    return math.ceil(items / (shape.team_threads if kind in _TEAM_LOOPS else 32 * shape.warps))


def loop_warps(kind: str, shape: PassShape, counter: bool) -> int:
    """Warps of the block that execute an inner loop of ``kind``: a per-thread loop over n items
    only in the first ceil(n / 32) warps (the others skip it), every other loop in all; with
    warp teams, the team loops in every warp."""
    items = loop_items(kind, shape, counter)
    if items is None or (shape.warp_teams and kind in _TEAM_LOOPS):
        return shape.warps
    return max(1, min(shape.warps, math.ceil(items / 32)))


def _rows_pow2(rows: int) -> int:
    return 1 << max(0, (rows - 1).bit_length())


def _latency(op: str) -> float:
    base = opcode_base(op)
    if base == "MUFU":
        return hw.MUFU_LATENCY
    if base in ("LDS", "LD"):
        return hw.SHARED_LATENCY
    if base == "LDL":
        return hw.L1_LATENCY
    if base == "LDG":
        return hw.L2_LATENCY
    if base == "SHFL":
        return hw.SHUFFLE_LATENCY
    if base == "HMMA":
        return hw.HMMA_LATENCY
    return hw.FP_LATENCY


@dataclass(frozen=True)
class StepLoop:
    """One pass's time loop as the terms read it: ``kinds`` and ``trips`` of its inner loops
    (``loop_kind``, ``loop_trips``; by header), ``steady``: what a step whose waits succeed
    reaches (``steady_step``), ``weight``: how often such a step executes each instruction of the
    loop's body, ``counter``: whether the exchange is a counter grid barrier (an arrival atomic
    per step)."""

    loop: TimeLoop
    shape: PassShape
    counter: bool
    kinds: dict[int, str]
    trips: dict[int, float]
    steady: frozenset[int]
    weight: dict[int, float]
    groups_head: int | None = None  # the loop of the batch groups (``groups_loop``), if any

    def ops(self) -> list[str]:
        """The opcodes of the loop's body."""
        return [self.loop.code[i][0] for i in self.loop.body]

    def inside(self, kind: str) -> set[int]:
        """The instructions of the inner loops of ``kind``."""
        return set().union(*[b for h, b in self.loop.inner.items() if self.kinds[h] == kind])

    def in_groups(self) -> set[int]:
        """The instructions of the loops nested in the loop of the batch groups that are not
        its product (the further groups' gathers, a launch's first step's staging)."""
        if self.groups_head is None:
            return set()
        outer = self.loop.inner[self.groups_head]
        return set().union(*[b for h, b in self.loop.inner.items()
                             if b < outer and self.kinds[h] != "mma"])

    def runs(self, head: int) -> float:
        """Trips per step of the inner loop ``head``, the loop of the batch groups' included
        where it sits in it."""
        inside = self.groups_head is not None and head != self.groups_head \
            and self.loop.inner[head] < self.loop.inner[self.groups_head]
        return self.trips[head] * (self.trips[self.groups_head] if inside else 1)

    def chain(self, head: int) -> float:
        """Cycles of the dependent chain through the steady instructions of the inner loop at
        ``head`` (not those of loops nested in it)."""
        own = sorted(own_instructions(self.loop, head) & self.steady)
        return critical_path([self.loop.code[i] for i in own], _latency)


def step_loop(sass: str, shape: PassShape) -> StepLoop:
    """The ``StepLoop`` of the pass ``shape`` whose cubin disassembles to ``sass``."""
    loop = time_loop(sass, converged=True)  # what a step issues: no BRA.DIV fallbacks
    counter = any(step_atomic(loop.code[i][0]) for i in loop.body)  # an arrival counter
    kinds = {h: loop_kind(loop, h) for h in loop.inner}
    groups_head = groups_loop(loop, kinds)
    outer = loop.inner[groups_head] if groups_head is not None else frozenset()
    trips = {h: loop_trips(k, shape, counter, loop.inner[h] < outer) for h, k in kinds.items()}
    steady = steady_step(loop, [h for h, k in kinds.items() if k == "spin"])
    weight = {i: 1.0 if i in steady else 0.0 for i in loop.body}
    for head, body in loop.inner.items():
        for i in body:
            weight[i] *= trips[head]
        if kinds[head] == "spin":  # a wait issues one poll that finds its words
            for i in body - ready_path(loop, head):
                weight[i] = 0.0
    return StepLoop(loop, shape, counter, kinds, trips, steady, weight, groups_head)


def groups_loop(loop: TimeLoop, kinds: dict[int, str]) -> int | None:
    """The header of the loop of the batch groups (``-D PRNN_BATCH_GROUP``): a "groups" loop,
    or - a group of 8 rows, one n-tile, whose product's loop the compiler folds into it - an
    mma loop holding loops that are not waits (the further groups' gathers); None if none."""
    for h, kind in kinds.items():
        nested = [kinds[c] for c, b in loop.inner.items() if b < loop.inner[h]]
        if kind == "groups" or (kind == "mma" and set(nested) - {"spin"}):
            return h
    return None


def _cycle_us(device: DeviceProfile) -> float:
    return 1.0 / device.clock_mhz


def issue_us(step: StepLoop, device: DeviceProfile, only: str | None = None) -> float:
    """The ``issue`` term: the busiest scheduler's instructions outside the matrix loop (warp w
    issues on scheduler w % 4, and runs an instruction for as many of its warps as execute it: a
    per-thread loop runs in the first warps only, ``loop_warps``); ``only``: those of the inner
    loops of that kind alone (the decoder's model: its pointwise loop)."""
    loop, shape = step.loop, step.shape
    active = {h: loop_warps(k, shape, step.counter) for h, k in step.kinds.items()}
    share = {i: math.ceil(min([shape.warps] + [active[h] for h, b in loop.inner.items() if i in b])
                          / hw.SCHEDULERS_PER_SM) for i in loop.body}
    in_matrix = (step.inside("matrix") | step.inside("mma")) - step.in_groups()
    counted = loop.body if only is None else step.inside(only)
    return (sum(step.weight[i] * share[i] for i in counted if i not in in_matrix)
            / hw.ISSUE_PER_CYCLE * _cycle_us(device))


def row_instructions(step: StepLoop) -> float:
    """Instructions of the matrix loop (an mma tile's: its n-tile loop) per batch row."""
    product = (step.inside("matrix") | step.inside("mma")) - step.in_groups()
    return sum(step.weight[i] for i in product) / step.shape.batch


def row_chain(step: StepLoop) -> float:
    """Cycles of a batch row's dependent chain: the matrix loop's FFMAs and the shuffles and
    local memory of the reduce-scatter levels."""
    return sum(step.chain(h) * (1 if step.kinds[h] == "matrix" else step.trips[h])
               for h in step.loop.inner if step.kinds[h] in ("matrix", "levels"))


def hmma_interval(op: str) -> int:
    """Cycles of a sub-partition's tensor core per HMMA ``op``: m16n8k16 (fp16, bf16) or
    m16n8k8 .TF32 (hardware.py has the figures and their source)."""
    return hw.HMMA_TF32_INTERVAL if ".TF32" in op else hw.HMMA_INTERVAL


def mma_tile_cycles(step: StepLoop, head: int) -> float:
    """Cycles of one n-tile of an mma tile's product (the loop ``head``), the largest of: the
    busiest scheduler's issue (its warps' instructions), its tensor core (their HMMAs, one per
    ``hmma_interval``), the SM's shared memory (every warp's 16-byte B loads, ``MMA_B_LOAD_CONFLICT``
    of the placement times the 4 wavefronts of a conflict-free one) and the dependent chain (HMMA latency along an
    accumulator set)."""
    loop, warps = step.loop, step.shape.warps
    sharing = math.ceil(warps / hw.SCHEDULERS_PER_SM)
    body = loop.inner[head] - step.in_groups()
    per_trip = {i: step.weight[i] / step.runs(head) for i in body}
    ops = {i: loop.code[i][0] for i in body}
    hmma = sum(w * hmma_interval(ops[i]) for i, w in per_trip.items()
               if opcode_base(ops[i]) == "HMMA")
    quads = sum(w for i, w in per_trip.items()
                if opcode_base(ops[i]) in ("LDS", "LD") and ops[i].endswith(".128"))
    conflict = hw.MMA_B_LOAD_CONFLICT[exchange_kind(step)]
    wavefronts = warps * quads * 4 * conflict  # 512 bytes a warp: 4 at best
    return max(sharing * sum(per_trip.values()) / hw.ISSUE_PER_CYCLE,
               sharing * hmma,
               wavefronts * 128 / hw.SHARED_BYTES_PER_CYCLE, step.chain(head))


def matrix_us(step: StepLoop, device: DeviceProfile) -> float:
    """The ``matrix`` term: a batch row's product is issue-bound when the warps sharing a
    scheduler hide its latency, else its dependent chain (``row_chain``); an mma tile's, per
    n-tile of 8 rows, ``mma_tile_cycles``."""
    mma = [h for h, kind in step.kinds.items() if kind == "mma"]
    if mma:
        return sum(step.runs(h) * mma_tile_cycles(step, h) for h in mma) * _cycle_us(device)
    sharing = math.ceil(step.shape.warps / hw.SCHEDULERS_PER_SM)  # warps per scheduler
    per_row = max(sharing * row_instructions(step) / hw.ISSUE_PER_CYCLE, row_chain(step))
    return step.shape.batch * per_row * _cycle_us(device)


def matrix_ffma(step: StepLoop) -> int:
    """FFMAs of the matrix loop's body (per batch row)."""
    return sum(1 for h, kind in step.kinds.items() if kind == "matrix"
               for i in step.loop.inner[h] if opcode_base(step.loop.code[i][0]) == "FFMA")


def block_barriers(step: StepLoop) -> int:
    """Block barriers a step passes (those of a wait's slow path aside; those in the loop of the
    batch groups once per group but the first)."""
    loop, in_spin = step.loop, step.inside("spin")
    groups = loop.inner[step.groups_head] if step.groups_head is not None else frozenset()
    return sum(step.shape.groups - 1 if i in groups else 1 for i in loop.body
               if opcode_base(loop.code[i][0]) == "BAR" and i not in in_spin)


def barrier_us(step: StepLoop, device: DeviceProfile) -> float:
    """The ``barriers`` term."""
    return block_barriers(step) * hw.BLOCK_BARRIER * _cycle_us(device)


def l2_traffic_us(step: StepLoop) -> float:
    """Every CTA reads the whole vector from L2 each step: at large B that is bandwidth, not
    latency."""
    shape = step.shape
    value_bytes = 4 if step.counter else exchange_word_bytes(step.ops())
    return (shape.plan.grid * shape.batch * shape.k_len * shape.gathers * value_bytes
            / (hw.L2_BANDWIDTH_GBPS * 1e3))


def exchange_kind(step: StepLoop) -> str:
    """How h_t moves between CTAs: "counter" (an arrival atomic), "cluster" (generic stores into
    the cluster's shared memory) or "l2" (tagged words through L2)."""
    if step.counter:
        return "counter"
    return "cluster" if "ST" in {opcode_base(op) for op in step.ops()} else "l2"


def exchange_us(step: StepLoop, device: DeviceProfile) -> float:
    """The ``exchange`` term, by ``exchange_kind``: the counter barrier from public round trips;
    the tagged exchanges from the rounds measured on the device (``hw.EXCHANGE_ROUND_NS``,
    ``hw.CLUSTER_ROUND_NS``) at the pass's CTA count, plus what the step moves beyond a round."""
    cycle_us, shape = _cycle_us(device), step.shape
    l2_us = hw.L2_LATENCY * cycle_us
    kind = exchange_kind(step)
    if kind == "counter":  # fence waits for the stores, atomic, polls, then the staging copy
        return 4 * l2_us + shape.plan.grid * hw.ATOMIC_SERIAL_NS / 1000 + l2_traffic_us(step)
    if kind == "cluster":
        return cluster_exchange_us(step)
    # A measured round (its one batch of quads per thread), one more round trip per further
    # batch a thread gathers (gather_quads in flight; a stack's layer gathers two vectors), and
    # the exposed part of the L2 traffic beyond the round's.
    # An LSTM projection waits on two exchanges a step, each a measured round.
    extra_rounds = shape.gathers * shape.gather_rounds - shape.exchanges
    round_bytes = shape.exchanges * shape.plan.grid ** 2 * hw.EXCHANGE_ROUND_WORDS * 4
    extra_traffic = max(0.0, l2_traffic_us(step) - round_bytes / (hw.L2_BANDWIDTH_GBPS * 1e3))
    return (shape.exchanges * hw.exchange_round_ns(hw.EXCHANGE_ROUND_NS, shape.plan.grid) / 1000
            + extra_rounds * l2_us + hw.EXCHANGE_TRAFFIC_EXPOSED * extra_traffic)


def remote_stores(step: StepLoop) -> float:
    """Store instructions into the cluster's shared memory one CTA issues per step: the generic
    stores (``ST``) of the step, per warp that runs them (``loop_warps``)."""
    loop, shape = step.loop, step.shape
    total = 0.0
    for i in loop.body:
        if opcode_base(loop.code[i][0]) != "ST" or not step.weight[i]:
            continue
        warps = [loop_warps(step.kinds[h], shape, step.counter) for h, b in loop.inner.items() if i in b]
        total += step.weight[i] * min([shape.warps] + warps)
    return total


def cluster_exchange_us(step: StepLoop) -> float:
    """A cluster's exchange: the measured cluster round at the pass's CTA count (one store
    instruction per destination CTA from one warp) per exchange the step waits on (an LSTM
    projection's two: ``PassShape.exchanges``) plus the CTA's further store instructions into
    the cluster's shared memory (``remote_stores``), ``hw.DSMEM_STORE_NS`` each: every warp of
    a warp team publishes its own units to every CTA."""
    shape = step.shape
    ctas = shape.plan.grid
    extra = max(0.0, remote_stores(step) - shape.exchanges * ctas)
    return (shape.exchanges * hw.exchange_round_ns(hw.CLUSTER_ROUND_NS, ctas)
            + extra * hw.DSMEM_STORE_NS) / 1000


def prefetch_us(step: StepLoop, device: DeviceProfile) -> float:
    """The ``prefetch`` term: the wait at the step's end for the next step's inputs (a 4-byte
    ``cp.async`` per item from L2, ``hw.PREFETCH_LATENCY``) where it is not hidden. A cluster
    issues them after its product (``step_product``: the buffer is free only then) and waits for
    them after the pointwise step, so only the pointwise chain hides them. A pass fetching two
    steps ahead (``plan.CLUSTER_INPUTS_AHEAD`` 2, three buffers) gets no more credit: the model
    said the next step would hide the fetch, and the H200 measured it slower (2026-11-27,
    docs/design.md).
    The grid issues them before its product, under the product, the pointwise step and the
    gather (longer than a round trip)."""
    if exchange_kind(step) != "cluster" or "prefetch" not in step.kinds.values():
        return 0.0
    return max(0.0, hw.PREFETCH_LATENCY * _cycle_us(device) - pointwise_us(step, device))


def pointwise_us(step: StepLoop, device: DeviceProfile) -> float:
    """The ``pointwise`` term: the dependent chain of each pointwise loop, per iteration."""
    total = 0.0
    for head, kind in step.kinds.items():
        if kind == "pointwise":
            total += step.chain(head) * step.trips[head] * _cycle_us(device)
    return total


def step_terms(sass: str, shape: PassShape, device: DeviceProfile) -> StepTerms:
    """The model's terms for one step of the pass ``shape`` whose cubin disassembles to ``sass``."""
    step = step_loop(sass, shape)
    return StepTerms(issue_us=issue_us(step, device), matrix_us=matrix_us(step, device),
                     barrier_us=barrier_us(step, device), exchange_us=exchange_us(step, device),
                     pointwise_us=pointwise_us(step, device),
                     instructions=round(sum(step.weight.values())), exchange=exchange_kind(step),
                     per_row_instructions=round(row_instructions(step)),
                     per_row_ffma=matrix_ffma(step), prefetch_us=prefetch_us(step, device))


@lru_cache(maxsize=512)
def _sass(source: str, defines: tuple, arch: str, src_dir: str | None) -> str:
    compiled = kernels.compile_source(source, dict(defines), arch, Path(src_dir) if src_dir else None)
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm is not installed (the nvidia-cuda-nvdisasm wheel): the "
                           "latency model reads the kernels' SASS")
    return disassemble(compiled.cubin_path, tool)


def pass_sass(p: planner.PassPlan, arch: str, src_dir: Path | None = None) -> str:
    """The SASS of a planned pass (NVRTC, cached; ``src_dir``: another commit's ``cuda_src``)."""
    return _sass(p.source, tuple(sorted(p.defines.items())), arch, str(src_dir) if src_dir else None)


def _gemm_us(flops: float, device: DeviceProfile, tensor_cores: bool = False,
             tf32: bool | None = None) -> float:
    """A cuBLAS GEMM of ``flops``: fp32 (SGEMM on the FP32 lanes), or with ``tensor_cores``
    16-bit operands summed in fp32 (gemmEx: a 16-bit layer's input projection), each at its
    fraction of the peak (``hw.GEMM_PEAK_FRACTION``, ``hw.TENSOR_GEMM_PEAK_FRACTION``). An fp32
    GEMM in TF32 (``tf32``, ``matmul.matmul``'s: ``None`` meaning the device profile's
    ``allow_tf32``, ``settings.allow_tf32``; ``CUBLAS_COMPUTE_32F_FAST_TF32``, sm_80 and newer)
    runs on the tensor cores at TF32's rate (``hw.HMMA_TF32_INTERVAL``) and the 16-bit GEMM's
    fraction of it (no TF32 GEMM measured)."""
    major, minor = (int(c) for c in device.arch.removeprefix("sm_")[:2])
    if tensor_cores:  # the mma's FMA per cycle of a sub-partition (hw.HMMA_INTERVAL)
        per_sm, fraction = hw.SUB_PARTITIONS * hw.MMA_FMA / hw.HMMA_INTERVAL, \
            hw.TENSOR_GEMM_PEAK_FRACTION
    elif (device.allow_tf32 if tf32 is None else tf32) and major >= 8:
        per_sm, fraction = hw.SUB_PARTITIONS * hw.MMA_TF32_FMA / hw.HMMA_TF32_INTERVAL, \
            hw.TENSOR_GEMM_PEAK_FRACTION
    else:
        per_sm, fraction = hw.fp32_lanes_per_sm(major, minor), hw.GEMM_PEAK_FRACTION
    peak = device.sm_count * device.clock_mhz * 1e6 * per_sm * 2
    return hw.GEMM_LAUNCH_US + flops / (fraction * peak) * 1e6


# Operations a planned call enqueues inside its chain (``runtime.Around``; read from call_plans,
# 2026-11-27): nodes of the chain's graph, no API call of their own while it is replayed, but
# kernels (or copies, memsets) on the device all the same, and calls of their own when the chain
# is issued launch by launch: forward - the input GEMM, its bias add, the output's and h_n's
# copies (LSTM: c_n's too); backward - the carries' zero fill (LSTM: two), W_hh^T's copy, dh0's
# GEMM and add (LSTM: dc0's copy), dW_ih, dW_hh (two GEMMs and an add), the two bias sums, dx.
# Without lengths (with them the output's and dy's selections are three operations each where a
# copy is one, or none). A planned call in steady state issues nothing else (its products:
# tests/test_call_plans.py); before the products moved into the chain it issued 1 / 9 calls
# beside it (4 / 11 and the LSTM's 5 / 13 before the copies did).
FORWARD_CHAIN_OPS = 4
BACKWARD_CHAIN_OPS = 11
# A 16-bit layer's planned call converts inside its chains too (``call_plans.HalfPlan``; read
# from it, 2026-11-27), each a short elementwise kernel: forward - b_hh and b_ih widened (its
# results are rounded where a float32 call copies them: no more operations); backward - dy, the
# input, W_ih and W_hh widened, dh0, dx and the four parameter gradients rounded into the call's
# arrays (the layer API, which sums them into its own, widens those four sums as well: four more).
HALF_FORWARD_OPS = 2
HALF_BACKWARD_OPS = 10
# Device time the settle adds to the end of the pass's launch (cuda_src/chain.cuh: each CTA
# fences and counts itself out on one word, the last reads the progress and writes the starts):
# about one round of the counter barrier of a full grid, 1.47 us for 132 CTAs on the H200
# (hardware.ATOMIC_SERIAL_NS's source) - a prediction. It replaced a settle kernel per launch
# (hardware.EMPTY_LAUNCH_US each; 2026-11-27, branch chain-launches). A resume launch of a
# finished layer-direction exits before it counts itself (nothing to settle); a stack's counts
# (its CTAs took a start order), not modelled here.
SETTLE_TAIL_US = 1.5


@dataclass(frozen=True)
class CallCost:
    """What one layer-direction call costs beside its recurrence's steps - a prediction:
    ``api_calls`` (kernel launches, memsets, graph launches: the chain's record reaches the
    host from its completion kernel, no call of its own), ``host_us``
    (the host's time: those calls at ``hw.API_CALL_HOST_US`` each plus ``python_us``, the
    library's Python of the call measured on the CPU as a replay runs it (its key built),
    ``hw.PYTHON_FORWARD_US`` / ``PYTHON_BACKWARD_US``, times the GPU host's measured ratio to
    it, ``hw.GPU_PYTHON_RATIO``) and ``device_us`` (GPU time beside the
    steps: the chain's launches that exit at once - the backward's after loading its weights
    (persistent_backward.cu) -, the settle at the end of the pass's launch
    (``SETTLE_TAIL_US``), the GEMMs, the small kernels)."""

    api_calls: int
    host_us: float
    device_us: float
    python_us: float = 0.0

    @property
    def api_us(self) -> float:
        """The host time of the API calls alone (``host_us`` less the Python)."""
        return self.host_us - self.python_us


def call_costs(cell: CellSpec, hidden: int, batch: int, seq_len: int, input_size: int,
               backward: bool, device: DeviceProfile, half: bool = False,
               planned: bool = True) -> CallCost:
    """``CallCost`` of a forward or backward call of one layer-direction whose persistent pass runs
    the device-side chain (``launch.chain_launches`` at the current ``max_restarts``), in
    steady state. A planned call (``call_plans``: a single unidirectional layer of any dtype,
    with or without a projection, since 2026-11-27) with ``chain_graphs`` on is one graph
    launch from the host, the chain with the operations enqueued inside it
    (``FORWARD_CHAIN_OPS``, ``BACKWARD_CHAIN_OPS``, a 16-bit layer's conversions
    ``HALF_FORWARD_OPS``, ``HALF_BACKWARD_OPS``; their nodes still run on the device), and
    the planned call's Python (``hw.PYTHON_*_US``: the 16-bit and projection plans' Python
    counted alike, tests/test_call_cost.py); a call not planned (``planned`` False) issues
    those operations as calls of their own beside the chain's graph, with the full path's
    Python (``hw.PYTHON_FULL_*_US``). A layer-direction of a stack or bidirectional layer is
    priced here as planned (its device terms: ``stack_call_costs`` sums them); the whole call's
    host terms are ``stack_call_costs``'. ``half``: a 16-bit layer, whose forward projects its
    input on the tensor cores and whose backward takes its weight gradients' products in TF32
    (``functional.gradient_tf32``; ``dh0`` and ``dx`` as a float32 layer's)."""
    from . import launch, settings
    rows, gh = seq_len * batch, cell.gates * hidden
    chain = launch.chain_launches(settings.current().max_restarts)
    lstm = int(cell.has_cell_state)
    if not backward:  # (flops, tensor_cores, tf32) of each GEMM
        gemms = [(2.0 * rows * input_size * gh, half, None)]
        inside = FORWARD_CHAIN_OPS + lstm + (HALF_FORWARD_OPS if half else 0)
    else:  # dh0, dW_ih, dW_hh, dx
        weights = True if half else None  # (functional.gradient_tf32)
        gemms = [(2.0 * batch * gh * hidden, False, None),
                 (2.0 * rows * gh * input_size, False, weights),
                 (2.0 * rows * gh * hidden, False, weights),
                 (2.0 * rows * gh * input_size, False, None)]
        inside = BACKWARD_CHAIN_OPS + 2 * lstm + (HALF_BACKWARD_OPS if half else 0)
    graphs = settings.current().chain_graphs
    calls = (1 if graphs and planned else 1 + inside if graphs
             else chain + launch.CHAIN_MEMSETS + inside)
    # fills, copies, adds: short kernels, inside the chain's graph or not
    small = inside - len(gemms) + launch.CHAIN_MEMSETS
    device_us = ((chain - 1) * hw.EMPTY_LAUNCH_US + SETTLE_TAIL_US
                 + sum(_gemm_us(flops, device, tensor_cores, tf32)
                       for flops, tensor_cores, tf32 in gemms)
                 + small * hw.EMPTY_LAUNCH_US)
    if backward:  # its resume launches load W_hh^T (fp32, from L2) before they exit
        resumes = settings.current().max_restarts
        device_us += resumes * gh * hidden * 4 / (hw.L2_BANDWIDTH_GBPS * 1e3)
    python = hw.GPU_PYTHON_RATIO[backward] * (
        (hw.PYTHON_BACKWARD_US if backward else hw.PYTHON_FORWARD_US) if planned
        else hw.PYTHON_FULL_BACKWARD_US if backward else hw.PYTHON_FULL_FORWARD_US)
    return CallCost(calls, calls * hw.API_CALL_HOST_US + python, device_us, python)


def stack_call_costs(cell: CellSpec, hidden: int, batch: int, seq_len: int, input_size: int,
                     backward: bool, device: DeviceProfile, layers: int,
                     bidirectional: bool = False, stack_mode: bool = True, half: bool = False,
                     planned: bool = True) -> CallCost:
    """``CallCost`` of a whole forward or backward call of a stack of ``layers`` layers or a
    bidirectional layer (stack), in steady state: in stack mode (``stack_mode``: a
    unidirectional stack in one launch per pass, or a bidirectional one's pairs) or one
    layer-direction per launch. Planned (``stack_plans``, ``layer_plans``; every dtype since
    2026-11-27) with ``chain_graphs`` on, it is one graph launch a pass for all its chains
    (``launch.one_graph``), and its Python that of a single layer's planned call
    (``hw.PYTHON_*_US``) plus, per further layer-direction, the increment of its mode measured
    as a replay runs it (``hw.PYTHON_GROUP_US``); not planned, each layer-direction's
    ``call_costs``. The device terms beside the steps are the layer-directions' (``call_costs``):
    a unidirectional stack's forward in stack mode projects layer 0's input only (the layers
    above project theirs inside the kernel); otherwise every layer-direction's (the backward:
    its weight gradients; dx counted for every layer, an overestimate of the unidirectional
    stack's, whose upper dx are in the kernel)."""
    directions = 2 if bidirectional else 1
    inputs = [input_size] + [directions * hidden] * (layers - 1)
    projected = inputs[:1] if stack_mode and not (bidirectional or backward) else inputs
    parts = [call_costs(cell, hidden, batch, seq_len, i, backward, device, half, planned)
             for i in projected for _ in range(directions)]
    device_us = sum(p.device_us for p in parts)
    if not planned:
        return CallCost(sum(p.api_calls for p in parts), sum(p.host_us for p in parts),
                        device_us, sum(p.python_us for p in parts))
    from . import settings
    mode = "layers" if not stack_mode else "pairs" if bidirectional else "stack"
    calls = 1 if settings.current().chain_graphs else sum(p.api_calls for p in parts)
    python = parts[0].python_us + (layers * directions - 1) * hw.GPU_PYTHON_RATIO[backward] \
        * hw.PYTHON_GROUP_US[mode][backward]
    return CallCost(calls, calls * hw.API_CALL_HOST_US + python, device_us, python)


def pass_kernel_us(step_us: float, p: planner.PassPlan, seq_len: int, backward: bool,
                   launches: int) -> float:
    """Device microseconds of a pass's persistent kernel in one call (what a profiler shows for
    it): ``seq_len`` steps, the weights' load of its first launch (every CTA's register tile,
    from L2, where the previous call left them) and ``launches`` launches (the pass and the
    chain's resume launches, ``launch.chain_launches``), each ``hw.EMPTY_LAUNCH_US``. A forward
    resume launch of a complete pass exits before it loads its weights (persistent_forward.cu);
    a backward one loads them first (persistent_backward.cu)."""
    weights_us = p.weight_registers * 4 * p.block * p.grid / (hw.L2_BANDWIDTH_GBPS * 1e3)
    loads = launches if backward else 1
    return seq_len * step_us + loads * weights_us + launches * hw.EMPTY_LAUNCH_US


def call_us(cell: CellSpec, hidden: int, batch: int, seq_len: int, input_size: int,
            backward: bool, device: DeviceProfile, half: bool = False) -> float:
    """Per-call device microseconds beside the recurrence (``CallCost.device_us``): what a call
    adds to its steps on the GPU. Its host work overlaps the GPU (nothing is read back), so a
    call's end-to-end time is the larger of the two (``StepTime.call_time_us``)."""
    return call_costs(cell, hidden, batch, seq_len, input_size, backward, device,
                      half).device_us


@dataclass(frozen=True)
class StepTime:
    """``predict_step_time``'s answer - a prediction of the latency model, not a measurement
    (its error on the recorded runs: ``calibration``).

    ``forward_us`` / ``backward_us``: microseconds per step of the persistent forward and
    backward kernels in steady state; ``forward`` / ``backward``: their terms (``StepTerms``);
    ``forward_call_us`` / ``backward_call_us``: what each call adds once (host work, GEMMs;
    ``benchmark_us`` spreads it over T steps); ``plan``: the launch plan the figures are for."""

    forward_us: float
    backward_us: float
    forward: StepTerms
    backward: StepTerms
    forward_call_us: float
    backward_call_us: float
    plan: planner.Plan
    calibration: str = CALIBRATION
    forward_host_us: float = 0.0
    backward_host_us: float = 0.0

    def call_time_us(self, seq_len: int, backward: bool = False) -> float:
        """End-to-end microseconds of one call of ``seq_len`` steps among back-to-back calls: the
        GPU's work (steps and per-call terms) or the host's, whichever is longer - no call
        waits for the GPU, so the host queues the next while this one runs."""
        def one(step: float, device: float, host: float) -> float:
            return max(seq_len * step + device, host)
        total = one(self.forward_us, self.forward_call_us, self.forward_host_us)
        if backward:
            total += one(self.backward_us, self.backward_call_us, self.backward_host_us)
        return total

    def benchmark_us(self, seq_len: int, backward: bool = False) -> float:
        """Microseconds per step of a benchmark call of ``seq_len`` steps (forward, or forward
        and backward), per-call terms included (``call_time_us`` / ``seq_len``)."""
        return self.call_time_us(seq_len, backward) / seq_len


def predict_plan(cell: CellSpec, hidden: int, batch: int, plan: planner.Plan,
                 device: DeviceProfile, src_dir: Path | None = None, seq_len: int = 100,
                 input_size: int = 64, proj: int = 0) -> StepTime:
    """The model's prediction for a fitting ``plan`` (``src_dir``: sources of another commit;
    ``proj``: an LSTM projection's P - its per-call terms are the plain LSTM's of ``hidden``)."""
    terms = []
    for p in (plan.forward, plan.backward):
        shape = PassShape(cell, p, batch, hidden, proj)
        terms.append(step_terms(pass_sass(p, device.arch, src_dir), shape, device))
    calls = [call_costs(cell, hidden, batch, seq_len, input_size, b, device, _half(plan))
             for b in (False, True)]
    return StepTime(terms[0].total_us, terms[1].total_us, terms[0], terms[1],
                    calls[0].device_us, calls[1].device_us, plan,
                    forward_host_us=calls[0].host_us, backward_host_us=calls[1].host_us)


def _half(plan: planner.Plan) -> bool:
    """Whether ``plan`` is a 16-bit layer's (its weights held in 16 bits, or widened into an
    fp32 tile: ``plan.widened_pass``)."""
    defines = plan.forward.defines
    return bool(defines.get("PRNN_WEIGHT_DTYPE") or defines.get("PRNN_WIDENED_FROM"))


def predict_step_time(cell: str, hidden: int, batch: int, dtype: str = "float32",
                      device: DeviceProfile | str | None = None) -> StepTime:
    """Predicted microseconds per step of the persistent forward and backward of one layer.

    ``cell``: "RNN", "GRU", "LSTM" (or "rnn_tanh", "rnn_relu"); ``hidden``, ``batch``: sizes;
    ``dtype``: the weights' dtype; ``device``: "h100", "h200", "a100", a ``DeviceProfile`` or
    None (the current GPU). Reads the SASS of the kernels the planner picks (compiled with NVRTC,
    no GPU needed). Raises ValueError where the persistent kernel does not fit (the planner's
    reason). The figures are the latency model's predictions (docs/design.md, "Latency model").
    """
    spec = planner.resolve_cell(cell)
    dev = planner.resolve_device(device)
    plan = planner.make_plan(spec, hidden, batch, dtype, dev)
    if not plan.fits:
        raise ValueError(plan.reason)
    return predict_plan(spec, hidden, batch, plan, dev)


STACK_REPORT_STEPS = 100  # the sequence length ``prnn plan`` predicts a stack's pass at


@dataclass(frozen=True)
class StackTime:
    """``predict_stack_time``'s answer - predictions of the latency model, not measurements.

    ``forward_us`` / ``backward_us``: one pass of the stack as the planner places it (stack
    mode: ``steps_in_series`` steps of the stack kernel's step, one call's per-call terms);
    ``apart_forward_us`` / ``apart_backward_us``: the same stack as one launch per
    layer-direction in sequence (each layer's per-call terms included), where the layer kernel
    fits (else ``None``); ``plan``: the stack plan; ``calls``: the whole call's forward and
    backward ``CallCost`` (``stack_call_costs``) as it runs - in stack mode where it fits,
    else one layer-direction per launch (``None`` where neither fits)."""

    forward_us: float | None
    backward_us: float | None
    apart_forward_us: float | None
    apart_backward_us: float | None
    plan: planner.StackPlan
    calibration: str = CALIBRATION
    calls: tuple[CallCost, CallCost] | None = None

    def call_time_us(self, seq_len: int, backward: bool = False) -> float:
        """End-to-end microseconds of one call of the stack (its passes as it runs them) among
        back-to-back calls: per pass the GPU's work or the host's, whichever is longer (as
        ``StepTime.call_time_us``)."""
        passes = ((self.forward_us, self.backward_us) if self.plan.fits
                  else (self.apart_forward_us, self.apart_backward_us))
        total = max(passes[0], self.calls[0].host_us)
        if backward:
            total += max(passes[1], self.calls[1].host_us)
        return total


def predict_stack_time(cell: str, hidden: int, batch: int, layers: int, seq_len: int,
                       bidirectional: bool = False, input_size: int = 64,
                       dtype: str = "float32",
                       device: DeviceProfile | str | None = None) -> StackTime:
    """Predicted microseconds of one forward and one backward pass of a stack of ``layers``
    layers over ``seq_len`` steps, in stack mode (``plan.make_stack_plan``) and as one launch per
    layer-direction. A prediction (the model's calibration error: ``CALIBRATION``); the stack
    kernels' step is read from their SASS like the layer kernels'."""
    spec = planner.resolve_cell(cell)
    dev = planner.resolve_device(device)
    sp = planner.make_stack_plan(spec, hidden, batch, layers, bidirectional, dtype, dev)
    directions = 2 if bidirectional else 1
    inputs = [input_size] + [directions * hidden] * (layers - 1)
    apart, calls = [None, None], None
    one = planner.make_plan(spec, hidden, batch, dtype, dev)
    if one.fits:
        st = predict_plan(spec, hidden, batch, one, dev, seq_len=seq_len)
        calls = tuple(stack_call_costs(spec, hidden, batch, seq_len, input_size, b, dev, layers,
                                       bidirectional, False, _half(one)) for b in (False, True))
        for k, step in enumerate((st.forward_us, st.backward_us)):
            apart[k] = directions * layers * seq_len * step + calls[k].device_us
    if not sp.fits:
        return StackTime(None, None, apart[0], apart[1], sp, calls=calls)
    passes = []
    calls = tuple(stack_call_costs(spec, hidden, batch, seq_len, input_size, b, dev, layers,
                                   bidirectional, True, dtype != "float32") for b in (False, True))
    for (p, backward), cost in zip(((sp.forward, False), (sp.backward, True)), calls):
        step = step_terms(pass_sass(p, dev.arch), PassShape(spec, p, batch, hidden), dev).total_us
        # (the device time beside the steps: ``stack_call_costs``; the host's work overlaps it)
        passes.append(sp.steps_in_series(seq_len) * step + cost.device_us)
    return StackTime(passes[0], passes[1], apart[0], apart[1], sp, calls=calls)


def plan_report(cell: str, hidden: int, batch: int = 1, layers: int = 1, dtype: str = "float32",
                device: DeviceProfile | str | None = "h100", proj_size: int = 0) -> dict:
    """``prnn plan``'s record: the placement (tile, grid or cluster, CTAs, block, registers,
    shared memory, or why it does not fit) and, where it fits, the model's predicted µs per step
    (``forward_us``, ``backward_us`` for one layer; ``stack_forward_us`` / ``stack_backward_us``
    for ``layers`` layers, one launch each, in sequence) with their terms - predictions, labelled
    with the model's calibration error. ``proj_size``: an LSTM's projection P (its kernels'
    two exchanges a step modelled; the per-call terms are those of the LSTM without one)."""
    spec = planner.resolve_cell(cell)
    dev = planner.resolve_device(device)
    plan = planner.make_plan(spec, hidden, batch, dtype, dev, proj_size)
    record: dict = {"cell": spec.name, "hidden_size": hidden, "batch": batch, "layers": layers,
                    "dtype": dtype, "device": dev.name, "fits": plan.fits, "reason": plan.reason,
                    "proj_size": proj_size}
    if not plan.fits:
        return {**record, "tried": list(plan.tried)}
    cluster = plan.tile.cluster
    record["tile"] = {"units": plan.tile.units, "cluster": cluster,
                      # (another tile's backward: plan._grid_backward, plan._mma_forward)
                      "backward_units": plan.backward.defines.get("PRNN_UNITS", plan.tile.units),
                      "placement": "cluster" if cluster else "grid",
                      # (a mid-size cluster tile's forward, the grid's backward: plan._grid_backward)
                      "backward_placement": "cluster" if "PRNN_CLUSTER" in plan.backward.defines
                                            else "grid",
                      "tensor_cores": getattr(plan.tile, "mma", False),
                      "tensor_cores_backward": plan.backward.defines.get("PRNN_MMA") == 2,
                      # W_hh in TF32 (settings.allow_tf32): a float32 layer's mma forward
                      "tf32": getattr(plan.tile, "mma", False) and dtype == "float32",
                      # the passes of a 16-bit layer on the fp32 tile (plan.widened_pass)
                      "widened": [name for name, p in (("forward", plan.forward),
                                                       ("backward", plan.backward))
                                  if planner.weight_dtype(p, dtype) != dtype]}
    for name, p in (("forward", plan.forward), ("backward", plan.backward)):
        record[name] = {"ctas": p.grid, "block": p.block, "registers": p.registers,
                        "weights_per_thread": p.weights_per_thread, "shared_bytes": p.shared_bytes,
                        # rows staged at once (plan.batch_group): 0, the whole batch
                        "batch_group": p.defines.get("PRNN_BATCH_GROUP", 0),
                        "defines": dict(p.defines)}
    st = predict_plan(spec, hidden, batch, plan, dev, proj=proj_size)
    record.update({"prediction": True, "calibration": CALIBRATION,
                   "forward_us": st.forward_us, "backward_us": st.backward_us,
                   "stack_forward_us": layers * st.forward_us,
                   "stack_backward_us": layers * st.backward_us,
                   "launches_per_pass": layers,
                   "forward_terms": terms_dict(st.forward), "backward_terms": terms_dict(st.backward),
                   "forward_dominant": st.forward.dominant(), "backward_dominant": st.backward.dominant(),
                   "per_call": per_call_report(spec, hidden, batch, plan, dev, proj_size)})
    if layers > 1 and not proj_size:  # (stack mode has no projection)
        record["stack_mode"] = stack_report(spec, hidden, batch, layers, dtype, dev)
        record["stack_per_call"] = stack_per_call_report(spec, hidden, batch, layers, dtype, dev)
    return record


PER_CALL_STEPS = (10, 100, 1000)  # the sequence lengths ``prnn plan`` predicts a call at
PER_CALL_INPUT = 64                # ... with this input size


def per_call_report(cell: CellSpec, hidden: int, batch: int, plan: planner.Plan,
                    device: DeviceProfile, proj: int = 0) -> dict:
    """``prnn plan``'s per-call record of one layer-direction (predictions): per T in
    ``PER_CALL_STEPS`` the host µs and API calls of a forward and a backward call, the device
    µs beside the steps, and the end-to-end µs per step of a forward and of a forward+backward
    call (``StepTime.benchmark_us``: back-to-back calls, the longer of host and GPU)."""
    rows = []
    for steps in PER_CALL_STEPS:
        st = predict_plan(cell, hidden, batch, plan, device, seq_len=steps,
                          input_size=PER_CALL_INPUT, proj=proj)
        fwd, bwd = (call_costs(cell, hidden, batch, steps, PER_CALL_INPUT, b, device,
                               _half(plan)) for b in (False, True))
        rows.append({"seq_len": steps, "forward_host_us": fwd.host_us,
                     "backward_host_us": bwd.host_us, "forward_python_us": fwd.python_us,
                     "backward_python_us": bwd.python_us, "forward_api_calls": fwd.api_calls,
                     "backward_api_calls": bwd.api_calls, "forward_device_us": fwd.device_us,
                     "backward_device_us": bwd.device_us,
                     "forward_us_per_step": st.benchmark_us(steps),
                     "forward_backward_us_per_step": st.benchmark_us(steps, True)})
    return {"prediction": True, "input_size": PER_CALL_INPUT, "python_included": True,
            "rows": rows}


def stack_per_call_report(cell: CellSpec, hidden: int, batch: int, layers: int, dtype: str,
                          device: DeviceProfile) -> dict:
    """``prnn plan --layers``' per-call record of the whole stack's call (predictions): per T
    in ``PER_CALL_STEPS`` the host µs (API calls and Python) and the device µs beside the steps
    of a forward and a backward call as the stack runs (``StackTime.calls``: in stack mode
    where it fits, else one layer-direction per launch), and its end-to-end µs per step
    (``StackTime.call_time_us`` / T)."""
    rows, mode = [], None
    for steps in PER_CALL_STEPS:
        st = predict_stack_time(cell.name, hidden, batch, layers, steps, input_size=PER_CALL_INPUT,
                                dtype=dtype, device=device)
        if st.calls is None:
            return {"prediction": True, "mode": None, "rows": []}
        mode = "stack mode" if st.plan.fits else "one launch per layer"
        fwd, bwd = st.calls
        rows.append({"seq_len": steps, "forward_host_us": fwd.host_us,
                     "backward_host_us": bwd.host_us, "forward_python_us": fwd.python_us,
                     "backward_python_us": bwd.python_us, "forward_api_calls": fwd.api_calls,
                     "backward_api_calls": bwd.api_calls, "forward_device_us": fwd.device_us,
                     "backward_device_us": bwd.device_us,
                     "forward_us_per_step": st.call_time_us(steps) / steps,
                     "forward_backward_us_per_step": st.call_time_us(steps, True) / steps})
    return {"prediction": True, "mode": mode, "input_size": PER_CALL_INPUT, "rows": rows}


def stack_report(cell: CellSpec, hidden: int, batch: int, layers: int, dtype: str,
                 device: DeviceProfile, seq_len: int = STACK_REPORT_STEPS) -> dict:
    """``prnn plan``'s stack-mode record of a unidirectional stack: whether all layers run in one
    launch per pass, the placement, and the predicted µs of a pass of ``seq_len`` steps in stack
    mode and as one launch per layer (predictions)."""
    st = predict_stack_time(cell.name, hidden, batch, layers, seq_len, dtype=dtype, device=device)
    sp = st.plan
    record = {"fits": sp.fits, "reason": sp.reason, "launches_per_pass": sp.launches,
              "steps_in_series": sp.steps_in_series(seq_len), "seq_len": seq_len,
              "prediction": True, "forward_pass_us": st.forward_us,
              "backward_pass_us": st.backward_us, "apart_forward_pass_us": st.apart_forward_us,
              "apart_backward_pass_us": st.apart_backward_us}
    if sp.fits:
        # a 16-bit stack's passes on the fp32 stack's (plan._widened_stack)
        widened = [name for name, p in (("forward", sp.forward), ("backward", sp.backward))
                   if planner.weight_dtype(p, dtype) != dtype]
        record.update({"units": sp.forward.defines["PRNN_UNITS"], "ctas": sp.forward.grid,
                       "block": sp.forward.block,
                       "tensor_cores": sp.tile.mma and "forward" not in widened,
                       "tensor_cores_backward": sp.backward.defines.get("PRNN_MMA") == 2,
                       "tf32": sp.tile.mma and dtype == "float32",  # (plan.TF32_STACK_MIN_BATCH)
                       "widened": widened,
                       "weights_per_thread": [sp.forward.weights_per_thread,
                                              sp.backward.weights_per_thread]})
    return record


def terms_dict(t: StepTerms) -> dict:
    """A ``StepTerms`` as a JSON-ready dict (its total included)."""
    return {"total_us": t.total_us, "issue_us": t.issue_us, "matrix_us": t.matrix_us,
            "barrier_us": t.barrier_us, "exchange_us": t.exchange_us,
            "pointwise_us": t.pointwise_us, "prefetch_us": t.prefetch_us, "exchange": t.exchange,
            "instructions": t.instructions,
            "per_row_instructions": t.per_row_instructions, "per_row_ffma": t.per_row_ffma}


# ---- the resident decoder (persistent_rnn/decoder.py): predictions ----------------------------

def decoder_projection_us(rows: int, inputs: int, batch: int, held: bool,
                          device: DeviceProfile) -> float:
    """Predicted microseconds of a resident CTA's projection of one step (``resident_decoder.cu``'s
    ``project_pass``): its ``rows`` rows of W_ih (``inputs`` columns) against the batch's staged
    x, one warp per ``PROJ_ROWS`` rows and ``kBatch`` batch rows (1 where the batch is 1, else
    ``PROJ_BATCH``), then each sum's butterfly (5 dependent shuffles and additions). ``held``
    (the rows in shared memory): every load is a shared-memory wavefront, one a cycle
    (``SHARED_BYTES_PER_CYCLE``: 128 bytes, a warp's 32 floats) - each pass reads every row once
    and each warp's group of rows reads its kBatch rows of x - or the warps' instructions at one
    per scheduler and cycle where those are more, after a shared-memory latency. Otherwise the
    rows come from L2 each step: an L2 round trip, and their bytes at the SM's share of
    ``L2_BANDWIDTH_GBPS`` once per pass."""
    from . import decoder
    k_batch = 1 if batch == 1 else decoder.PROJ_BATCH
    passes = -(-batch // k_batch)
    columns = -(-inputs // hw.WARP)  # a lane's column steps
    butterfly = 5 * (hw.SHUFFLE_LATENCY + hw.FP_LATENCY)
    cycle = _cycle_us(device)
    if not held:
        share_gbps = hw.L2_BANDWIDTH_GBPS / device.sm_count
        return (hw.L2_LATENCY + butterfly) * cycle + passes * 4.0 * rows * inputs / (share_gbps * 1e3)
    groups = -(-rows // decoder.PROJ_ROWS)
    items = groups * passes  # one warp each
    loads = items * columns * (decoder.PROJ_ROWS + k_batch)  # a warp's loads: one wavefront each
    ffma = items * columns * decoder.PROJ_ROWS * k_batch
    issue = (loads + ffma) / (hw.SCHEDULERS_PER_SM * hw.ISSUE_PER_CYCLE)
    return (max(loads * hw.WARP * 4 / hw.SHARED_BYTES_PER_CYCLE, issue) + hw.SHARED_LATENCY
            + butterfly) * cycle


def decoder_handoff_round_us(ctas: int) -> float:
    """One hand-off between a resident decoder layer's ``ctas`` CTAs and its step kernel
    (predicted µs): the post seen by them, or their done words seen by the step kernel, each
    priced as the exchange round measured at that CTA count (``hw.EXCHANGE_ROUND_NS``: a store
    and the polls that see it across the CTAs, with a block barrier). (Before the H200's decoder
    step was measured each was one bare L2 round trip: 1.95 µs predicted against 6.36 measured
    at LSTM H=640 B=1, ``DECODER_MEASURED``.)"""
    return hw.exchange_round_ns(hw.EXCHANGE_ROUND_NS, ctas) / 1000


def decoder_handoff_us(ctas: int, device: DeviceProfile) -> float:
    """A resident decoder layer's hand-offs in one step (predicted µs): the post's and the done
    words' (``decoder_handoff_round_us`` each), and x staged after the post, one L2 round
    trip."""
    return 2 * decoder_handoff_round_us(ctas) + hw.L2_LATENCY * _cycle_us(device)


def predict_decoder_step(cell: str, hidden: int, batch: int, input_size: int | None = None,
                         device: DeviceProfile | str | None = None, layers: int = 1) -> dict:
    """Predicted GPU microseconds of one step of a resident decoder (``decoder.py``) and of the
    fused step kernel (``cell_step.fused_step``) - the latency model's predictions, not
    measurements. A decoder step in a captured loop is one launch: the gap before the step
    kernel (``GRAPH_GAP_US``), three dependent hand-offs through L2 (``decoder_handoff_us``: the
    post seen by the resident CTAs and the done words seen by the step kernel, each a measured
    exchange round at the resident grid's CTA count; x staged beside the caller's h_{t-1}
    compared with the CTA's own, one L2 round trip), the projection inside each CTA (``decoder_projection_us``: its G*units
    rows of W_ih from shared memory where the plan holds them there, ``w_ih_held``, else from
    L2) and what is left of the resident step after the post (``resident_step_us``): the layer
    forward's step (its tile, as the decoder runs it) from its SASS without its exchange -
    its pointwise loop (issue and dependent chain) and its barriers. The rest of that step (the
    product, the row sums, staging h: ``ahead_us``, with one more barrier) is the recurrent half,
    which each resident CTA computes between steps from the layer's own last h' (the caller's
    h_{t-1} when it passes back the last output); it starts when the step kernel does (both wait
    for the same done words, and its staging round trip is within the post's hand-off), so it
    delays a step only by what the gap between steps leaves of it:
    ``captured_us`` back to back (a gap of ``GRAPH_GAP_US``), ``captured_between_us`` with the
    caller's kernels between steps (an embedding, a joint, an argmax: assumed to take at least
    ``ahead_us`` - the gap alone, not: the graph's gaps between them as well - so none is
    left). A stack of ``layers`` is still one launch a step: the step kernel posts each layer
    after the one below has finished, so every layer adds its hand-offs, projection (layer n > 0
    projects the h' below it: input size ``hidden``) and resident step to the one gap; a
    further layer's recurrent half has that layer's wait too, so only layer 0's can be left
    over. Eagerly a step takes the longer of host and GPU (``eager_us``); the host's part
    (``host_us``) is the step's Python - the layer API's steady-state step, counted in
    instructions on the CPU (``hw.STEP_INSTRUCTIONS``), at the CPU stand-in's µs per instruction
    (``hw.STAND_IN_US_PER_INSTRUCTION``) times the H200 host's ratio (``hw.GPU_PYTHON_RATIO``) -
    plus its calls into CUDA (``hw.STEP_API_CALLS``) at ``API_CALL_HOST_US`` each; the same
    for the fused step (``fused_host_us``, ``fused_eager_us``), and both through the torch
    module (``torch_eager_us``, ``torch_fused_eager_us``: its cell's decoder, its cell with
    ``algo="persistent"``). ``projected_us``: a
    captured ``step_projected`` back to back (the caller gives layer 0's x W_ih^T + b_ih, e.g.
    from a per-token table: no projection there). The fused step (one layer): a gap, W_ih and
    W_hh read from L2 by every tile of ``cell_step.BATCH_TILE`` batch rows, at its SMs' share of
    ``L2_BANDWIDTH_GBPS`` (a CTA an SM, up to the SM count: ``cell_step.fused_grid``), two L2
    round trips."""
    from . import cell_step, decoder
    spec = planner.resolve_cell(cell)
    dev = planner.resolve_device(device)
    inputs = hidden if input_size is None else input_size
    gh = spec.gates * hidden
    round_trip = hw.L2_LATENCY * _cycle_us(dev)

    def weights_us(columns: int) -> float:  # G*H rows of fp32 weights read from L2
        tiles = -(-batch // cell_step.BATCH_TILE)  # (each tile's warps read every row)
        share = min(cell_step.fused_grid(batch, hidden), dev.sm_count) / dev.sm_count
        return 4.0 * gh * columns * tiles / (hw.L2_BANDWIDTH_GBPS * 1e3 * share)

    def host_us(road: str, calls: int) -> float:  # an eager step's host: Python and CUDA calls
        python = hw.STEP_INSTRUCTIONS[road] * hw.STAND_IN_US_PER_INSTRUCTION
        return hw.GPU_PYTHON_RATIO[0] * python + calls * hw.API_CALL_HOST_US

    fused = hw.GRAPH_GAP_US + weights_us(inputs + hidden) + 2 * round_trip
    fused_host = host_us("fused", hw.STEP_API_CALLS["fused"])
    torch_fused = host_us("torch-cell", hw.STEP_API_CALLS["fused"])
    record = {"prediction": True, "calibration": CALIBRATION,
              "measured_miss": DECODER_MEASURED, "cell": spec.name,
              "hidden_size": hidden, "batch": batch, "input_size": inputs, "layers": layers,
              "device": dev.name, "fused_step_us": fused, "fused_host_us": fused_host,
              "fused_eager_us": max(fused, fused_host),
              "torch_fused_eager_us": max(fused, torch_fused)}
    plans, why = decoder.plan_layers(spec, hidden, batch, dev, inputs, layers)
    record.update(resident=why is None, reason=why)
    if why is not None:
        return record
    p = planner.make_plan(spec, hidden, batch, "float32", dev).forward  # the decoder's tile
    shape = PassShape(spec, p, batch, hidden)
    sass = pass_sass(p, dev.arch)
    t = step_terms(sass, shape, dev)
    compute = t.issue_us + t.matrix_us + t.barrier_us + t.pointwise_us
    after_post = (issue_us(step_loop(sass, shape), dev, only="pointwise") + t.pointwise_us
                  + t.barrier_us)
    ahead = compute - after_post + hw.BLOCK_BARRIER * _cycle_us(dev)
    left_over = max(0.0, ahead - hw.GRAPH_GAP_US)  # (back to back; layer 0's only)
    projections = [decoder_projection_us(q.w_ih_rows, q.input_size, batch, q.w_ih_held, dev)
                   for q in plans]
    handoffs = sum(decoder_handoff_us(q.grid, dev) for q in plans)
    between = hw.GRAPH_GAP_US + handoffs + layers * after_post + sum(projections[1:])
    captured_between = between + projections[0]
    host = host_us("decoder", hw.STEP_API_CALLS["decoder"])
    torch_host = host_us("torch-decoder", hw.STEP_API_CALLS["decoder"])
    record.update(ctas=sum(q.grid for q in plans), resident_step_us=layers * after_post,
                  ahead_us=ahead, ahead_left_us=left_over, handoff_us=handoffs,
                  handoff_round_us=decoder_handoff_round_us(plans[0].grid),
                  round_trip_us=round_trip,
                  projection_us=sum(projections), w_ih_held=plans[0].w_ih_held,
                  w_ih=plans[0].w_ih_note(), captured_us=captured_between + left_over,
                  captured_between_us=captured_between,
                  host_us=host, eager_us=max(captured_between, host),
                  torch_eager_us=max(captured_between, torch_host),
                  projected_us=between + left_over, launches_per_step=1)
    return record
