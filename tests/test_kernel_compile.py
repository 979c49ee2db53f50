"""Every shipped kernel configuration compiles with NVRTC (no GPU needed) with zero spills, and
the SASS of its time loop (read with nvdisasm) holds no fence, atomic or L1 invalidate."""
from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from persistent_rnn import kernel_report, kernels, sass_analysis
from persistent_rnn.cells import CELLS
from persistent_rnn.kernel_report import gather_variants
from persistent_rnn.plan import (KERNEL_DTYPES, PROJECTION_TILES, PassTile, cluster_tiles_for,
                                 mma_tiles_for, pass_plan, projection_tile_ships, resident_ctas,
                                 stack_tiles_for, tile_max_hidden, tiles_for)
from persistent_rnn.tiles import MMA_PROJECTION_TILES, PROJECTION_CLUSTER_TILES, SHIPPED, Tile
from persistent_rnn.plan import layout_defines, shared_layout
from persistent_rnn.plan import warp_teams as warp_teams_of
from full_set import EVERY_KERNEL

# Compiling every shipped configuration (~240 NVRTC builds, cached afterwards) takes longer than
# the default per-test timeout on a cold cache and a busy 2-core machine.
pytestmark = pytest.mark.timeout(1800)

_SMALL = Tile(4, PassTile(4, 4, 1), PassTile(4, 4, 1))  # a small tanh RNN forward
FORWARD_DEFINES = {"PRNN_CELL": 0, "PRNN_UNITS": 4, "PRNN_ROWS": 4, "PRNN_KSPLIT": 4,
                   "PRNN_KPT": 1, "PRNN_WARPS": 4, "PRNN_GATHER_QUADS": 1,
                   **layout_defines(shared_layout(CELLS["rnn_tanh"], _SMALL, False))}


# CI builds the configurations at the register file's edge (kernel_report._edges: of each kernel
# family, tile family, dtype, pass and arch, the tile with the most weight registers and the tile
# with the fewest registers to spare, at its largest gather), on sm_90: where a spill, a stack
# frame or a longer time loop would show first (the relu RNN's kernels, the tanh RNN's tiles with
# another activation, and sm_80 only in the full set). The full set is one command,
# `PRNN_TEST_EVERY_KERNEL=1 pytest tests/test_kernel_compile.py` (or `prnn kernels --arch 80,90`,
# which exits 1 on a spill), run before a kernel change lands.


ARCHS = ("sm_80", "sm_90")
# The archs compiled: CI's edges on sm_90 (the H100/H200 the library targets first); the full set
# on both (sm_80's A100 allocations differ: a kernel change runs the full set before it lands).
COMPILED_ARCHS = ARCHS if EVERY_KERNEL else ("sm_90",)


LAYER_FAMILIES = ("grid", "cluster", "mma grid", "mma cluster")  # persistent_forward/backward.cu
TF32_FAMILIES = ("tf32 grid", "tf32 cluster")  # the same kernels, float32 layers in TF32


@pytest.fixture(scope="module")
def records():
    return kernel_report.kernel_records(COMPILED_ARCHS, edges_only=not EVERY_KERNEL)


def test_every_configuration_is_listed():
    # Grid tiles on both archs, each with every gather size the planner may pick (1 to 8 quads,
    # by the batch); plus the cluster tiles (4 and 8 warps) per cell and pass on sm_90, per dtype;
    # the LSTM projection tiles on both archs, per dtype; the stack tiles (fp32) on both archs;
    # the 16-bit stacks' tensor-core tiles and the float32 stacks' TF32 tiles on both archs.
    # (Each other family's test checks its own configurations.)
    every = [kernel_report.describe(job) for job in kernel_report._jobs(ARCHS)]
    listed = [r for r in every if r["family"] in (*LAYER_FAMILIES, "projection", "stack")]
    grids = sum(len(gather_variants(pass_plan(c, t, bwd, tile_max_hidden(c, t),
                                              kernel_report.REPORT_BATCH, d))) * 2
                for c in CELLS.values() for d in KERNEL_DTYPES for t in tiles_for(c, d)
                for bwd in (False, True))
    expected = grids + sum(len(cluster_tiles_for(c, d)) * 2 for c in CELLS.values()
                           for d in KERNEL_DTYPES)
    # The mma tiles, forward (PRNN_MMA 1) and backward (2): grid on both archs, with every
    # gather size; cluster on sm_90.
    mma = sum(len(gather_variants(pass_plan(c, t, bwd, tile_max_hidden(c, t),
                                            kernel_report.REPORT_BATCH, d))) * 2
              for c in CELLS.values() for d in KERNEL_DTYPES for t in mma_tiles_for(c, d)
              for bwd in (False, True))
    mma += 2 * sum(len(mma_tiles_for(c, d, cluster=True)) for c in CELLS.values()
                   for d in KERNEL_DTYPES)
    assert sum(bool(r["config"].get("PRNN_MMA")) for r in listed) == mma
    assert all(r["family"].startswith("mma") == bool(r["config"].get("PRNN_MMA")) for r in listed)
    assert all(r["config"]["PRNN_MMA"] == (2 if r["pass"] == "backward" else 1)
               for r in listed if r["family"].startswith("mma"))
    expected += mma
    projections = sum(2 * projection_tile_ships(t, d, a) for t in PROJECTION_TILES
                      for d in KERNEL_DTYPES for a in ARCHS)
    stacks = sum(len(stack_tiles_for(c)) * 2 * 2 for c in CELLS.values())
    assert len(listed) == expected + projections + stacks
    projected = [r for r in listed if r["proj_size"]]
    assert len(projected) == projections
    assert all(r["cell"] == "lstm" and not r["cluster"] and not r["stack"]
               and 0 < r["proj_size"] < r["hidden_size"] for r in projected)
    assert sum(r["stack"] > 0 for r in listed) == stacks
    # The mma projection tiles (16-bit), both passes on the tensor cores, on both archs.
    mma_projected = [r for r in every if r["family"] == "mma projection"]
    assert len(mma_projected) == len(MMA_PROJECTION_TILES) * 2 * 2 * len(ARCHS)
    assert all(r["config"]["PRNN_MMA"] == (2 if r["pass"] == "backward" else 1)
               and r["dtype"] != "float32" and 0 < r["proj_size"] < r["hidden_size"]
               for r in mma_projected)
    # The projection cluster tiles at their full cluster on sm_90: fp32 both passes, and the
    # forwards that widen fp16 and bf16 weights.
    clustered = [r for r in every if r["family"] == "projection cluster"]
    assert len(clustered) == len(PROJECTION_CLUSTER_TILES) * 4
    assert all(r["arch"] == "sm_90" and r["cluster"] == 16 and not r["config"].get("PRNN_MMA")
               and "PRNN_WEIGHT_DTYPE" not in r["config"]
               and ("PRNN_WIDENED_FROM" in r["config"]) == (r["dtype"] != "float32")
               and 0 < r["proj_size"] < r["hidden_size"] for r in clustered)
    # 16-bit stacks on the tensor cores: forward PRNN_MMA 1, backward 2, both archs.
    # The grid mma tiles in batch groups (B 32 in groups of 8), both 16-bit dtypes and archs.
    grouped = [r for r in every if r["family"] == "mma groups"]
    assert len(grouped) == sum(len(mma_tiles_for(c, d)) * 2 * len(ARCHS) for c in CELLS.values()
                               for d in ("float16", "bfloat16"))
    assert all(r["config"]["PRNN_BATCH_GROUP"] == 8 and not r["cluster"] for r in grouped)
    mma_stacks = [r for r in every if r["family"] == "mma stack"]
    assert len(mma_stacks) == sum(len(stack_tiles_for(c, d)) * 2 * 2 for c in CELLS.values()
                                  for d in ("float16", "bfloat16"))
    assert all(r["stack"] and r["config"]["PRNN_MMA"] == (2 if r["pass"] == "backward" else 1)
               for r in mma_stacks)
    # float32 stacks in TF32 (the same stack kernels): the forward on the tensor cores
    # (PRNN_MMA 1, no PRNN_WEIGHT_DTYPE), the backward fp32 on the CUDA cores, both archs.
    tf32_stacks = [r for r in every if r["family"] == "tf32 stack"]
    assert len(tf32_stacks) == sum(len(stack_tiles_for(c, tf32=True)) * 2 * 2
                                   for c in CELLS.values())
    assert all(r["stack"] and r["dtype"] == "float32" and "PRNN_WEIGHT_DTYPE" not in r["config"]
               and r["config"].get("PRNN_MMA") == (None if r["pass"] == "backward" else 1)
               for r in tf32_stacks)
    for dtype in KERNEL_DTYPES:
        for cell in CELLS:
            for pass_ in ("forward", "backward"):
                for arch in ARCHS:
                    mine = [r for r in listed if not r["stack"] and not r["proj_size"]
                            and not r["config"].get("PRNN_MMA")
                            and (r["dtype"], r["cell"], r["pass"], r["arch"]) == (dtype, cell, pass_, arch)]
                    clusters = [r for r in mine if r["cluster"]]
                    shipped = len(cluster_tiles_for(CELLS[cell], dtype)) if arch == "sm_90" else 0
                    assert len(clusters) == shipped
                    grid = {tuple(sorted((k, v) for k, v in r["config"].items()
                                         if k != "PRNN_GATHER_QUADS")) for r in mine if not r["cluster"]}
                    assert len(grid) == len(tiles_for(CELLS[cell], dtype))
                    assert {r["block"] for r in clusters} == ({128, 256} if shipped else set())


def test_the_widened_forwards_are_the_fp32_forwards_rounding_to_16_bits():
    # plan.widened_pass: the fp32 tiles' forwards serving 16-bit layers at small batches, once per
    # 16-bit dtype (the full set builds them: kernel_report.KernelFamily.in_ci).
    every = [kernel_report.describe(job) for job in kernel_report._jobs(ARCHS)]
    fp32 = [r for r in every if r["family"] in ("grid", "cluster") and r["dtype"] == "float32"
            and r["pass"] == "forward"]
    for family in ("grid", "cluster"):
        widened = [r for r in every if r["family"] == f"widened {family}"]
        plain = [r for r in fp32 if r["family"] == family]
        assert len(widened) == 2 * len(plain) > 0
        for dtype in ("float16", "bfloat16"):
            mine = [r for r in widened if r["dtype"] == dtype]
            assert [{**r["config"], "PRNN_WIDENED_FROM": KERNEL_DTYPES[dtype]} for r in plain] \
                == [r["config"] for r in mine]
    assert not kernel_report.KERNEL_FAMILIES["widened grid"].in_ci


def test_the_records_cover_every_kernel_family_tile_family_dtype_pass_and_arch(records):
    every = [kernel_report.describe(job) for job in kernel_report._jobs(COMPILED_ARCHS)
             if EVERY_KERNEL or kernel_report.KERNEL_FAMILIES[job.family].in_ci]
    assert {kernel_report.group(r) for r in records} == {kernel_report.group(r) for r in every}
    if not EVERY_KERNEL:  # each group's register edges: the most weights, the least to spare
        for key in {kernel_report.group(r) for r in every}:
            mine = [r for r in every if kernel_report.group(r) == key]
            kept = [r for r in records if kernel_report.group(r) == key]
            most = max(r["weight_registers"] * r["block"] for r in mine)
            least = min(r["planned_registers"] - r["weight_registers"] for r in mine)
            assert most in {r["weight_registers"] * r["block"] for r in kept}, key
            assert least in {r["planned_registers"] - r["weight_registers"] for r in kept}, key
    else:
        assert len(records) == len(every)


def test_zero_spills_and_registers_within_plan(records):
    for r in records:
        assert r["spill_bytes"] == 0, r
        assert 0 < r["registers"] <= r["planned_registers"], r
        # What the GPU's occupancy calculator will say: one CTA of this block fits an SM.
        assert resident_ctas(r["block"], r["registers"]) >= 1, r
        # The weights really are in registers: there are more registers than weight registers.
        assert r["registers"] > r["weight_registers"], r


def test_largest_tiles_use_most_of_the_register_file():
    planned = [kernel_report.describe(job) for job in kernel_report._jobs(COMPILED_ARCHS)]
    for dtype in KERNEL_DTYPES:  # 16-bit: two weights per register
        for cell, tiles in SHIPPED.items():
            for pass_ in ("forward", "backward"):
                biggest = max(r["block"] * r["weight_registers"] for r in planned
                              if r["pass"] == pass_ and r["cell"].startswith(cell[:3])
                              and r["dtype"] == dtype)
                assert biggest >= 0.7 * 65536, (dtype, cell, pass_)


def test_cli_json(capsys, monkeypatch):
    every = kernel_report._jobs
    monkeypatch.setattr(kernel_report, "_jobs", lambda archs, *_: list(every(archs, True))[:6])
    assert kernel_report.main(["--arch", "90", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["arch"] for r in out} == {"sm_90"}
    assert {"cell", "dtype", "pass", "arch", "config", "hidden_size", "registers", "spill_bytes",
            "shared_bytes", "planned_registers", "time_loop", "stack_frame", "local_memory"} <= set(out[0])
    assert set(sass_analysis.SASS_KINDS) <= set(out[0]["time_loop"])


# What one step of the time loop may contain (static SASS counts, sass_analysis.sass_loop_counts):
# the tagged exchange needs no fence, no atomic and no L1 invalidate; two block barriers per step
# (staged vector + timeout vote; partial sums) per exchange: the LSTM projection kernels exchange
# twice per step, so 4 (the stack kernels gather two vectors before one vote: 2). The old counter
# barrier had 4-5, 3, 1 and 4. No local memory: the reduce-scatter's accumulators indexed at run
# time once cost 64-128 bytes of stack and ~70 LDL/STL per step in most large tiles.
LOOP_LIMITS = {"block_barriers": 2, "atomics": 0, "fences": 0, "l1_invalidates": 0,
               "local_memory": 0}


def test_time_loop_sass_stays_short(records):
    assert sass_analysis.nvdisasm(), "nvdisasm missing: install the test extra (nvidia-cuda-nvdisasm)"
    for r in records:
        loop = r["time_loop"]
        for kind, most in LOOP_LIMITS.items():
            exchanges = 2 if r["proj_size"] else 1
            # Batch groups (the "mma groups" family): two more in the loop of the groups, around
            # each further group's gather (passed once per group but the first).
            groups = 2 if kind == "block_barriers" and "PRNN_BATCH_GROUP" in r["config"] else 0
            assert loop[kind] <= most * exchanges + groups, (kind, r)
        assert r["stack_frame"] == 0 and r["local_memory"] == 0 and r["spill_bytes"] == 0, r
        # The loop was found: it publishes (stores) and gathers (loads) every step.
        assert loop["global_stores"] >= 1 and loop["global_loads"] >= 1, r
        # A layer's forward whose warps finish their own units (kWarpTeams): in a cluster no
        # block barrier in a step, on the grid one (the staged vector's); every other pass meets
        # at one at least.
        c = r["config"]
        warp_teams = (r["pass"] == "forward" and r["family"] in (*LAYER_FAMILIES, *TF32_FAMILIES)
                      and warp_teams_of(CELLS[r["cell"]], PassTile(
                          c["PRNN_ROWS"], c["PRNN_KSPLIT"], c["PRNN_KPT"])))
        if warp_teams:
            assert loop["block_barriers"] == (0 if r["cluster"] else 1), r
        else:  # every CUDA-core cluster forward of a layer has teams (GRU's and RNN's mma
            # ones do not; a projection's step meets after each of its two products)
            assert (not r["cluster"] or r["pass"] == "backward" or c.get("PRNN_MMA")
                    or r["proj_size"]), r
            assert loop["block_barriers"] >= 1, r
        # An mma tile's product is on the tensor cores (and only an mma tile's).
        assert (loop["tensor_core_mma"] > 0) == bool(c.get("PRNN_MMA")), r


def test_sass_loop_counts_finds_the_loop_with_the_barrier():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
    .L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
    .L_x_1:
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   MEMBAR.SC.GPU ;
        /*0060*/                   CCTL.IVALL ;
        /*0070*/                   ATOMG.E.ADD.STRONG.GPU PT, R3, desc[UR4][R6.64], R0 ;
        /*0080*/                   STG.E [R8.64], R3 ;
        /*0088*/                   STL [R1+0x4], R3 ;
        /*0090*/              @!P1 BRA `(.L_x_2) ;
        /*00a0*/                   EXIT ;
    .L_x_2:
        /*00b0*/                   LDG.E.STRONG.GPU R2, desc[UR4][R4.64] ;
        /*00c0*/                   BRA `(.L_x_1) ;
    """
    counts = sass_analysis.sass_loop_counts(sass)
    assert counts == {"block_barriers": 1, "global_loads": 1, "async_copies": 0, "global_stores": 1,
                      "atomics": 1, "fences": 1, "l1_invalidates": 1, "local_memory": 1,
                      "tensor_core_mma": 0, "instructions": 9}


def test_stack_frame_is_read_from_the_ptxas_report():
    log = ("ptxas info    : Used 240 registers, used 1 barriers, 64 bytes cumulative stack size\n"
           "ptxas info    : Compile time = 1 ms\n"
           "ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert kernel_report.parse_stack_frame(log) == 64
    assert kernel_report.local_memory_record(log, {"local_memory": 3}) == {"stack_frame": 64,
                                                                          "local_memory": 3}
    with pytest.raises(RuntimeError, match="stack frame"):
        kernel_report.parse_stack_frame("ptxas info    : Used 240 registers")


def test_compile_error_raises_with_log():
    with pytest.raises(RuntimeError, match="PRNN_CELL") as info:
        kernels.compile_source("persistent_forward.cu", {"PRNN_UNITS": 4}, "sm_90")
    assert "error" in str(info.value)


def _elf_extent(image: bytes) -> int:
    """Where the last of an ELF64's header tables and file-backed sections ends."""
    assert image[:4] == b"\x7fELF" and image[4] == 2, "not an ELF64 image"
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
    for i in range(shnum):
        _, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize)
        if kind != 8:  # SHT_NOBITS occupies no bytes of the file
            ends.append(offset + size)
    return max(ends)


def test_cached_cubin_is_a_complete_elf(tmp_path, monkeypatch):
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path))
    compiled = kernels.compile_source("persistent_forward.cu", FORWARD_DEFINES, "sm_90")
    image = compiled.cubin_path.read_bytes()
    assert _elf_extent(image) == len(image)
    tool = sass_analysis.cuda_tool("cuobjdump")
    if tool is None:
        return  # the ELF check above already fails on an image one byte short
    listing = subprocess.run([tool, "-elf", str(compiled.cubin_path)], capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "prnn_persistent_forward" in listing.stdout


GRID_PARTS = ("grid_barrier_rounds", "exchange_rounds", "exchange_word_round_trip",
              "exchange_warp_rounds", "quad_rounds", "quad_acquire_rounds", "timer_probe")


@pytest.mark.parametrize("defines, arch, names", [
    ({}, "sm_80", GRID_PARTS),
    ({}, "sm_90", GRID_PARTS),
    ({"PRNN_CLUSTER": 8}, "sm_90", ("cluster_exchange_rounds", "cluster_exchange_local_rounds",
                                    "cluster_barrier_rounds", "cluster_barrier_relaxed_rounds")),
])
def test_exchange_microbenchmark_kernels_compile(defines, arch, names):
    """The kernels bench/barrier_latency.py launches (the round's anatomy too; and the word
    format's own) exist under their names, with zero spills."""
    log = kernels.compile_source("grid_barrier.cu", defines, arch).log
    for name in names:
        assert f"'{name}'" in log
    assert "bytes spill" in log and all(int(n) == 0 for n in re.findall(r"(\d+) bytes spill", log))


def _kernel_opcodes(sass: str, kernel: str) -> list[str]:
    """The opcodes of ``kernel``'s section of an ``nvdisasm -c`` listing."""
    section = sass.split(f".text.{kernel}:", 1)[1].split(".section", 1)[0]
    return [op for op, *_ in sass_analysis.parse(section)[0]]


def test_the_round_anatomy_kernels_take_out_what_they_say():
    """The SASS of the anatomy's parts (sm_90; bench/barrier_latency.py --anatomy) differs from
    the full rounds' in what each isolates: the relaxed quad stores and polls with 16-byte strong
    accesses and no L1 invalidate, where the release/acquire quad adds a fence before its store and
    an L1 invalidate after each poll; the warp-vote exchange has no block barrier where the full
    round has its bar.red; the cluster's local copy is a shared store (STS) where the full round
    stores its own copy like the others (a generic ST to the mapa address); the cluster barrier is
    the hardware's arrive and wait, fenced where it releases and not where it is relaxed."""
    tool = sass_analysis.nvdisasm()
    if tool is None:
        pytest.skip("no nvdisasm")
    grid, cluster = (sass_analysis.disassemble(kernels.compile_source("grid_barrier.cu", d, "sm_90")
                                               .cubin_path, tool)
                     for d in ({}, {"PRNN_CLUSTER": 8}))
    relaxed, acquire = (_kernel_opcodes(grid, k) for k in ("quad_rounds", "quad_acquire_rounds"))
    for ops in (relaxed, acquire):
        assert "STG.E.128.STRONG.GPU" in ops and "LDG.E.128.STRONG.GPU" in ops
    assert "CCTL.IVALL" not in relaxed and acquire.count("CCTL.IVALL") >= 16  # 16 polls in flight
    assert acquire.count("MEMBAR.ALL.GPU") == relaxed.count("MEMBAR.ALL.GPU") + 1
    warp, full = (_kernel_opcodes(grid, k) for k in ("exchange_warp_rounds", "exchange_rounds"))
    assert not any(op.startswith("BAR.") for op in warp) and "VOTE.ANY" in warp
    assert "BAR.RED.OR.DEFER_BLOCKING" in full
    local, stored = (_kernel_opcodes(cluster, k)
                     for k in ("cluster_exchange_local_rounds", "cluster_exchange_rounds"))
    assert local.count("STS") > stored.count("STS") == 1  # (the full round's: zeroing its copy)
    assert local.count("ST.E.STRONG.GPU") == stored.count("ST.E.STRONG.GPU")
    barrier, bare = (_kernel_opcodes(cluster, k)
                     for k in ("cluster_barrier_rounds", "cluster_barrier_relaxed_rounds"))
    for ops in (barrier, bare):
        assert ops.count("UCGABAR_ARV") == ops.count("UCGABAR_WAIT") > 1
    # every released arrival is fenced (and the errors' atomic); a relaxed one is not (only the
    # release of the launch's first meeting)
    assert barrier.count("MEMBAR.ALL.GPU") >= barrier.count("UCGABAR_ARV")
    assert bare.count("MEMBAR.ALL.GPU") == 1


def test_cluster_code_is_refused_on_sm_80():
    with pytest.raises(RuntimeError, match="PRNN_CLUSTER needs sm_90"):
        kernels.compile_source("grid_barrier.cu", {"PRNN_CLUSTER": 2}, "sm_80")


def test_every_cluster_kernel_declares_its_cluster_shape():
    """A kernel planned as a cluster is launched as a plain grid of its compiled-in cluster shape
    (``__cluster_dims__``, hw.cuh's ``PRNN_CLUSTER_DIMS``): without it the occupancy query says
    no cluster fits and the launch would run separate CTAs whose DSMEM stores miss. The H200 run
    of 2026-11-27 found the projection kernels without it; the emulation cannot tell. One
    configuration of each cluster kernel, its cubin's ``EIATTR_CTA_PER_CLUSTER`` against its grid."""
    tool = sass_analysis.cuda_tool("cuobjdump")
    assert tool, "cuobjdump (the nvidia-cuda-cuobjdump wheel of the test extras) is missing"
    first: dict[tuple[str, str], kernel_report.Job] = {}
    for job in kernel_report._jobs(("sm_90",)):
        if "PRNN_CLUSTER" in job.plan.defines:
            first.setdefault((job.plan.source, job.plan.kernel), job)
    assert {kernel for _, kernel in first} >= {"prnn_persistent_forward", "prnn_persistent_backward",
                                                "prnn_projection_forward",
                                                "prnn_projection_backward"}, sorted(first)
    for (source, kernel), job in sorted(first.items()):
        cubin = kernels.compile_source(source, job.plan.defines, "sm_90").cubin_path
        elf = subprocess.run([tool, "-elf", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
        shape = re.search(r"EIATTR_CTA_PER_CLUSTER\s+Format:\s+\S+\s+Value:\s+(\S+) (\S+) (\S+)",
                          elf)
        assert shape, f"{kernel} ({source}) is built without a cluster shape"
        assert [int(v, 16) for v in shape.groups()] == [job.plan.grid, 1, 1], (kernel, shape.groups())


def test_no_generic_lambda_in_the_cuda_sources():
    """NVRTC 13.0 (the H100 image's of 2026-11-26) compiles a lambda with an ``auto`` parameter
    inside a kernel as a host function and refuses it; 13.5 (CI's) accepts it. CI compiles with
    13.5 only, so the sources are held to what 13.0 takes: functors instead."""
    from persistent_rnn._sources import cuda_src_dir
    generic = re.compile(r"\[[^\]\n]*\]\s*\([^)]*\bauto\b")
    tests_cuda = Path(__file__).resolve().parent / "cuda"  # the test-only kernels
    found = [f"{path.name}:{n}" for folder in (cuda_src_dir(), tests_cuda)
             for path in sorted(folder.glob("*.cu*"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if generic.search(line)]
    assert not found, f"generic lambdas (NVRTC 13.0 refuses them in kernels): {found}"
    assert generic.search("[&](const unsigned* slot, auto sink) {")  # the pattern finds one
