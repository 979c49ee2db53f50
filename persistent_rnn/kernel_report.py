"""Compile every shipped persistent-kernel configuration and report its resource use.

``kernel_records`` compiles the configurations of every kernel family (``KERNEL_FAMILIES``:
the layer kernels on the grid and as clusters, the grid's tensor-core tiles in batch groups, the
LSTM projection on the grid and as a cluster, the stack, the 16-bit stack on the tensor cores),
each cell's
forward and backward kernel for every tile the planner can choose, for each architecture,
with NVRTC (no GPU needed; cached by ``kernels``), and reads ptxas' report back: registers
per thread and spill bytes. The library requires zero spills and registers within the plan.
It also disassembles each cubin with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, or one
on PATH) and counts what the time loop executes per step (``sass_loop_counts``). Command line:
``prnn kernels --arch 80,90 --json`` or ``python -m persistent_rnn.kernel_report --arch 80,90
--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterator, NamedTuple

from . import hardware, kernels, latency, plan as planner
from .cells import CELLS, PROJECTION_CELL, CellSpec
from .sass_analysis import disassemble, nvdisasm, sass_loop_counts

# Shared memory is reported at batch 8, the top of the range the latency targets are set for
# (algo="auto" runs persistently up to runtime.Settings.auto_max_batch, 32, where the plan fits).
REPORT_BATCH = 8
REPORT_STACK = 4  # layers the stack kernels' records are planned for (the grid only)
GROUPS_BATCH, GROUP_ROWS = 32, 8  # the batch groups' records: B 32 in groups of 8 rows


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers and spill bytes from an ``-Xptxas=-v`` log (one kernel per compilation)."""
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if regs is None or stores is None or loads is None:
        raise RuntimeError(f"unexpected ptxas report:\n{log}")
    return {"registers": int(regs.group(1)),
            "spill_bytes": int(stores.group(1)) + int(loads.group(1))}


def parse_stack_frame(log: str) -> int:
    """Bytes of stack frame (local memory per thread) from an ``-Xptxas=-v`` log: non-zero when an
    array is indexed at run time or registers spill, either of which puts loads and stores to
    local memory (L1/L2 latency) on the step's path."""
    frame = re.search(r"(\d+) bytes stack frame", log)
    if frame is None:
        raise RuntimeError(f"unexpected ptxas report (no stack frame):\n{log}")
    return int(frame.group(1))


def local_memory_record(log: str, time_loop: dict[str, int] | None) -> dict[str, int | None]:
    """A record's ``stack_frame`` (bytes, ptxas) and ``local_memory`` (LDL/STL instructions in
    the time loop; None without nvdisasm)."""
    return {"stack_frame": parse_stack_frame(log),
            "local_memory": None if time_loop is None else time_loop["local_memory"]}


def gather_variants(p: planner.PassPlan, largest_only: bool = False) -> list[planner.PassPlan]:
    """``p`` with each gather size the planner may build its layer kernel with
    (``plan.gather_quads``: from what a thread gathers at B=1 up to the tile's cap, by powers of
    2; the batch picks one), or ``[p]`` where it has no gather (a cluster) or a fixed one.
    ``largest_only``: the largest gather alone, the variant that holds the most registers."""
    if p.source not in ("persistent_forward.cu", "persistent_backward.cu") \
            or "PRNN_GATHER_QUADS" not in p.defines:
        return [p]
    at_batch_1 = planner.quads_per_thread(1, p.exchange_row, p.block)
    n = planner.gather_quads(p.weight_registers, at_batch_1)
    variants = []
    while n <= planner.gather_quads(p.weight_registers):
        variants.append(replace(p, defines={**p.defines, "PRNN_GATHER_QUADS": n}))
        n *= 2
    return variants[-1:] if largest_only else variants


class Job(NamedTuple):
    """One configuration ``prnn kernels`` compiles: a pass plan of a kernel family, for a cell,
    dtype and arch (``proj``: an LSTM projection's P, else 0)."""

    cell: CellSpec
    dtype: str
    plan: planner.PassPlan
    arch: str
    proj: int
    family: str


def _jobs(archs, edges_only: bool = False) -> list[Job]:
    """Every shipped configuration of every kernel family (``KERNEL_FAMILIES``, in its order).
    ``edges_only``: the configurations at the register file's edge alone (``_edges``)."""
    jobs = [Job(*job, family=name) for name, family in KERNEL_FAMILIES.items()
            if family.in_ci or not edges_only for job in family.jobs(archs, edges_only)]
    return _edges(jobs) if edges_only else jobs


def group(record: dict) -> tuple:
    """(kernel family, tile family, dtype - float32 or 16-bit -, pass, arch) of a record (or of
    ``describe``'s fields): the groups ``_edges`` picks its configurations from. Cells of one tile family
    (``CellSpec.tiles``: the two Elman cells) run the same tiles and differ in their activation
    alone, so a group's edge is built for the family's first cell in ``CELLS``. The tensor-core
    tiles (the ``mma`` families) and the fp32 tiles serving 16-bit layers (``widened``) form one
    group per placement, pass and arch (CI: a few configurations); the mma projection, the
    projection cluster and the mma and TF32 stacks one group per arch each (CI: one configuration, the
    edge of both passes - for the mma projection the backward holding the most weights, ptxas'
    register edge)."""
    if record["family"] in ("mma projection", "projection cluster", "mma stack", "tf32 stack"):
        return record["family"], "all", "16-bit", "both", record["arch"]
    if record["family"].startswith(("mma", "widened", "tf32")):
        return record["family"], "all", "16-bit", record["pass"], record["arch"]
    # fp16 and bf16 tiles hold the same words per register and differ in the conversions' few
    # instructions: one group (its edges the fp16 tiles', first in the jobs' order)
    dtype = "float32" if record["dtype"] == "float32" else "16-bit"
    return record["family"], CELLS[record["cell"]].tiles, dtype, record["pass"], record["arch"]


def _edges(jobs: list[Job]) -> list[Job]:
    """Of each ``group``, the tile holding the most weight registers per CTA and the tile with
    the fewest registers to spare beyond its weights (where a spill or a stack frame shows
    first), in ``jobs``' order: about a third of the configurations, the CI's set (the full set
    is ``prnn kernels``)."""
    groups: dict[tuple, list] = {}
    for job in jobs:
        groups.setdefault(group(describe(job)), []).append(job)
    keep = set()
    for members in groups.values():
        keep.add(id(max(members, key=lambda j: j.plan.weight_registers * j.plan.block)))
        keep.add(id(min(members, key=lambda j: j.plan.registers - j.plan.weight_registers)))
    return [job for job in jobs if id(job) in keep]


def _has_clusters(arch: str) -> bool:
    return int(arch.removeprefix("sm_")) >= 90


def _layer_jobs(archs, largest_gather_only: bool, cluster: bool, mma: bool = False,
                tf32: bool = False):
    """The layer kernels (``persistent_forward.cu``, ``persistent_backward.cu``): the grid tiles
    on every arch with every gather size (``gather_variants``), or the cluster tiles on the
    archs with clusters (sm_90 and newer). ``mma``: the tensor-core tiles instead (forward
    ``mma_tile.cuh``, backward ``mma_split_tile.cuh`` as planned at ``REPORT_BATCH``, from
    ``plan.MMA_BACKWARD_MIN_BATCH`` rows; below it the CUDA-core 16-bit backward, not listed).
    ``tf32``: float32's TF32 tiles instead (the forward; the backward in TF32 as planned at
    ``REPORT_BATCH`` and the fp32 one below ``plan.TF32_BACKWARD_MIN_BATCH``)."""
    for dtype in ("float32",) if tf32 else planner.KERNEL_DTYPES:
        for cell in CELLS.values():
            if mma or tf32:
                tiles = planner.mma_tiles_for(cell, dtype, cluster, tf32)
            else:
                tiles = (planner.cluster_tiles_for if cluster else planner.tiles_for)(cell, dtype)
            for tile in tiles:
                hidden = planner.tile_max_hidden(cell, tile)
                batches = ((False, REPORT_BATCH), (True, REPORT_BATCH))
                if tf32:
                    batches += ((True, planner.TF32_BACKWARD_MIN_BATCH - 1),)
                for backward, batch in batches:
                    planned = planner.pass_plan(cell, tile, backward, hidden, batch, dtype=dtype)
                    for p in gather_variants(planned, largest_only=largest_gather_only):
                        for arch in archs:
                            if not cluster or _has_clusters(arch):
                                yield cell, dtype, p, arch, 0


def _grouped_jobs(archs, largest_gather_only: bool):
    """The grid tensor-core tiles' passes in batch groups (``plan.batch_group``, as the planner
    runs them where the whole batch's staged vector does not fit shared memory: LSTM H 1024 at
    B 16 and 32), planned at ``GROUPS_BATCH`` rows in groups of ``GROUP_ROWS``: the group is a
    compile-time loop bound, the gather sized for a group's rows."""
    for dtype in ("float16", "bfloat16"):
        for cell in CELLS.values():
            for tile in planner.mma_tiles_for(cell, dtype):
                hidden = planner.tile_max_hidden(cell, tile)
                for backward in (False, True):
                    p = planner.pass_plan(cell, tile, backward, hidden, GROUPS_BATCH, dtype=dtype,
                                          batch_group=GROUP_ROWS)
                    for arch in archs:
                        yield cell, dtype, p, arch, 0


def _widened(jobs: Callable[[], Iterator[tuple]],
             serves: Callable[[CellSpec, planner.PassPlan], bool] = lambda cell, p: True):
    """The fp32 forwards of ``jobs()`` that ``serves`` as they serve 16-bit weights
    (``plan.widened_pass``: the weights widened, h_t rounded to fp16 or bf16 by ``-D
    PRNN_WIDENED_FROM``); the backward is the fp32 kernel itself."""
    for half in ("float16", "bfloat16"):
        for cell, dtype, p, arch, proj in jobs():
            if dtype == "float32" and "backward" not in p.kernel and serves(cell, p):
                yield cell, half, planner.widened_pass(p, half, False), arch, proj


def _widened_jobs(archs, largest_gather_only: bool, cluster: bool):
    """The fp32 tiles' forwards as they serve 16-bit layers at small batches (``_widened``)."""
    return _widened(partial(_layer_jobs, archs, largest_gather_only, cluster))


def _projection_jobs(archs, largest_gather_only: bool, mma: bool = False, cluster: bool = False):
    """The LSTM projection kernels on the grid at their tiles' largest H and P < H. ``mma``: the
    tensor-core tiles instead (16-bit; the backward as planned at ``REPORT_BATCH``, on the tensor
    cores); ``cluster``: the cluster tiles at their full cluster, on the archs with clusters:
    fp32, and the forwards widening 16-bit layers' weights (``plan.widened_pass``; their backward
    is the fp32 one)."""
    for dtype in planner.KERNEL_DTYPES:
        for ptile in planner.projection_tiles_for(dtype, mma, cluster):
            hidden, proj = planner.projection_capacity(ptile)
            if cluster:
                hidden = min(hidden, ptile.units * ptile.cluster)
            proj = min(proj, hidden - 1)
            for backward in (False, True):
                if cluster and dtype != "float32" and backward:
                    continue
                p = planner.projection_pass_plan(ptile, backward, hidden, proj, REPORT_BATCH,
                                                 dtype="float32" if cluster else dtype)
                if cluster and dtype != "float32":
                    p = planner.widened_pass(p, dtype, False)
                for arch in archs:
                    if planner.projection_tile_ships(ptile, dtype, arch) \
                            and (not cluster or _has_clusters(arch)):
                        yield PROJECTION_CELL, dtype, p, arch, proj


def _stack_jobs(archs, largest_gather_only: bool, dtypes: tuple[str, ...] = ("float32",),
                tf32: bool = False):
    """The stack kernels, planned for ``REPORT_STACK`` layers: fp32 (``dtypes``), or the 16-bit
    stacks' tensor-core tiles (``tiles.MMA_STACK_TILES``; the backward as planned at
    ``REPORT_BATCH``, on the tensor cores: below ``plan.MMA_STACK_BACKWARD_MIN_BATCH`` the fp32
    stack's backward, widened, or where that does not fit the CUDA-core 16-bit one, not
    listed). ``tf32``: float32's TF32 stack tiles
    (``tiles.TF32_STACK_TILES``: the forward in TF32, the backward fp32)."""
    for dtype in dtypes:
        for cell in CELLS.values():
            for tile in planner.stack_tiles_for(cell, dtype, tf32):
                hidden = planner.stack_max_hidden(cell, tile)
                for backward in (False, True):
                    p = planner.pass_plan(cell, tile, backward, hidden, REPORT_BATCH, dtype,
                                          stack_layers=REPORT_STACK)
                    for arch in archs:
                        yield cell, dtype, p, arch, 0


def _widened_stack_jobs(archs, largest_gather_only: bool):
    """The fp32 stack forwards as they serve the 16-bit stacks of ``plan.WIDENED_STACKS``
    (``_widened``: the tiles up to its largest H)."""
    def serves(cell: CellSpec, p: planner.PassPlan) -> bool:
        return p.max_hidden <= planner.WIDENED_STACKS.get(cell.tiles, (0, ()))[0]
    return _widened(partial(_stack_jobs, archs, largest_gather_only), serves)


@dataclass(frozen=True)
class KernelFamily:
    """A family of kernels ``prnn kernels`` compiles: ``jobs(archs, largest_gather_only)``
    yields its shipped configurations ``(cell, dtype, pass plan, arch, proj_size)`` (whether
    only the largest gather of a grid tile is wanted: the CI's edges); ``modelled``: whether the
    latency model (``latency``) predicts its steps (its records' ``model``)."""

    jobs: Callable[..., Iterator[tuple]]
    modelled: bool = True
    in_ci: bool = True  # whether the CI's set (``_edges``) builds it, else only the full set


# The kernel families, each with its configurations: a new family is one entry here
# (docs/design.md, "How to add a kernel family"). A record's ``family`` is its key.
KERNEL_FAMILIES: dict[str, KernelFamily] = {
    "grid": KernelFamily(partial(_layer_jobs, cluster=False)),
    "cluster": KernelFamily(partial(_layer_jobs, cluster=True)),
    "mma grid": KernelFamily(partial(_layer_jobs, cluster=False, mma=True)),
    "mma cluster": KernelFamily(partial(_layer_jobs, cluster=True, mma=True)),
    "tf32 grid": KernelFamily(partial(_layer_jobs, cluster=False, tf32=True)),
    "tf32 cluster": KernelFamily(partial(_layer_jobs, cluster=True, tf32=True)),
    # (the grid mma tiles in batch groups: the full set, not the CI's)
    "mma groups": KernelFamily(_grouped_jobs, in_ci=False),
    # (the fp32 tiles' forwards with one rounding more: the full set, not the CI's)
    "widened grid": KernelFamily(partial(_widened_jobs, cluster=False), in_ci=False),
    "widened cluster": KernelFamily(partial(_widened_jobs, cluster=True), in_ci=False),
    "projection": KernelFamily(_projection_jobs),
    "mma projection": KernelFamily(partial(_projection_jobs, mma=True)),
    "projection cluster": KernelFamily(partial(_projection_jobs, cluster=True)),
    "stack": KernelFamily(_stack_jobs),
    "mma stack": KernelFamily(partial(_stack_jobs, dtypes=("float16", "bfloat16"))),
    "tf32 stack": KernelFamily(partial(_stack_jobs, tf32=True)),
    "widened stack": KernelFamily(_widened_stack_jobs, in_ci=False),
}


def describe(job: Job) -> dict:
    """The planned fields of a configuration of ``_jobs`` (what ``kernel_records`` reports before
    it compiles anything)."""
    p = job.plan
    return {"family": job.family, "cell": job.cell.name, "dtype": job.dtype,
            "proj_size": job.proj,
            "pass": "backward" if "backward" in p.kernel else "forward",
            "arch": job.arch, "config": dict(p.defines), "cluster": p.defines.get("PRNN_CLUSTER", 0),
            "stack": REPORT_STACK if p.source.startswith("stack_") else 0,
            "hidden_size": p.max_hidden,
            "block": p.block, "weights_per_thread": p.weights_per_thread,
            "weight_registers": p.weight_registers, "shared_bytes": p.shared_bytes,
            "planned_registers": p.registers}


def _record(job: Job, tool: str | None) -> dict:
    p = job.plan
    compiled = kernels.compile_source(p.source, p.defines, job.arch)
    sass = disassemble(compiled.cubin_path, tool) if tool else None
    loop = sass_loop_counts(sass) if sass else None
    return {**describe(job), **parse_ptxas(compiled.log), "time_loop": loop,
            **local_memory_record(compiled.log, loop),
            "model": model_fields(job.cell, job.dtype, p, job.arch, sass, job.proj)
            if sass and KERNEL_FAMILIES[job.family].modelled else None}


# Batch sizes the report predicts a step at (B = 1 and the report's batch).
MODEL_BATCHES = (1, REPORT_BATCH)


def model_fields(cell, dtype: str, p, arch: str, sass: str, proj: int = 0) -> dict:
    """The latency model on one configuration (``persistent_rnn.latency``): instructions per batch
    row of the matrix loop against its FFMAs, and the predicted µs per step (a prediction) at
    ``MODEL_BATCHES`` on the arch's device profile (sm_80: a100, else h100)."""
    device = hardware.PROFILES["a100" if arch == "sm_80" else "h100"]
    predicted, terms = {}, None
    for batch in MODEL_BATCHES:
        terms = latency.step_terms(sass, latency.shape_at(cell, p, batch, p.max_hidden, proj),
                                   device)
        predicted[str(batch)] = round(terms.total_us, 3)
    return {"per_row_instructions": terms.per_row_instructions, "per_row_ffma": terms.per_row_ffma,
            "predicted_us": predicted, "device_profile": device.name, "prediction": True}


def kernel_records(archs=("sm_80", "sm_90"), edges_only: bool = False) -> list[dict]:
    """One record per shipped (dtype, cell, tile, pass, arch): ``family`` (its
    ``KERNEL_FAMILIES`` key), ``cell``, ``dtype`` (what W_hh
    is held in: "float32", "float16", "bfloat16"), ``proj_size`` (an LSTM projection tile's P,
    else 0), ``pass``, ``arch``, ``config``
    (the -D macros), ``cluster`` (CTAs of the thread-block cluster, 0 for a grid tile),
    ``stack`` (layers of a stack kernel's record, 0 for the layer kernels),
    ``hidden_size`` (largest H the configuration serves), ``weights_per_thread`` and
    ``weight_registers`` (16-bit: two weights per register), ``registers``,
    ``spill_bytes``, ``shared_bytes`` (dynamic shared memory at batch 8), ``planned_registers``
    (the register cap the planner counts on), ``time_loop``: the SASS counts of the time loop
    (``sass_loop_counts``: instructions, block_barriers, global_loads, async_copies,
    global_stores, atomics, fences, l1_invalidates, local_memory), or None where nvdisasm is not
    installed; ``stack_frame``/``local_memory`` (``local_memory_record``); ``model``: the latency
    model's ``model_fields`` (per batch row instructions and FFMAs of the matrix loop, predicted
    µs per step at B = 1 and 8), or None without nvdisasm or for a family the model does not
    cover. ``edges_only``: the configurations at the register file's edge alone (``_edges``),
    the CI's set."""
    archs = [a if str(a).startswith("sm_") else f"sm_{a}" for a in archs]
    tool = nvdisasm()
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(partial(_record, tool=tool), _jobs(archs, edges_only)))


def main(argv: list[str] | None = None) -> int:
    """``kernels --arch 80,90 [--json]``: print the records (JSON or a table); exit 1 on spills,
    a stack frame or registers beyond the plan."""
    parser = argparse.ArgumentParser(prog="prnn kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    records = kernel_records(tuple(f"sm_{a.strip()}" for a in args.arch.split(",") if a.strip()))
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(f"{'dtype':8} {'cell':9} {'proj':>4} {'pass':8} {'arch':6} {'cl':>2} {'H max':>6} {'block':>5} {'weights':>7} "
              f"{'regs':>4}/{'plan':<4} {'spill':>5} {'frame':>5} {'smem@B8':>8}  time loop: "
              f"{'BAR':>3} {'LDG':>3} {'STG':>3} {'ATOM':>4} {'MEMBAR':>6} {'CCTL':>4} {'LDL+STL':>7}")
        for r in records:
            loop = r["time_loop"]
            sass = ("  (no nvdisasm)" if loop is None else
                    f"  {'':11}{loop['block_barriers']:3d} {loop['global_loads']:3d} "
                    f"{loop['global_stores']:3d} {loop['atomics']:4d} {loop['fences']:6d} "
                    f"{loop['l1_invalidates']:4d} {loop['local_memory']:7d}")
            print(f"{r['dtype']:8} {r['cell']:9} {r['proj_size']:4d} {r['pass']:8} {r['arch']:6} {r['cluster']:2d} {r['hidden_size']:6d} {r['block']:5d} "
                  f"{r['weights_per_thread']:7d} {r['registers']:4d}/{r['planned_registers']:<4d} "
                  f"{r['spill_bytes']:5d} {r['stack_frame']:5d} {r['shared_bytes']:8d}{sass}")
    bad = [r for r in records
           if r["spill_bytes"] or r["stack_frame"] or r["registers"] > r["planned_registers"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
