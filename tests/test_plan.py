"""The planner: sizes it promises, why it refuses, and the register/shared-memory arithmetic."""
from __future__ import annotations

from dataclasses import replace


import numpy as np
import pytest

from persistent_rnn import max_hidden_size, plan
from persistent_rnn.cells import CELLS, FAMILY_CELLS
from persistent_rnn.plan import (PROFILES, make_plan, register_cap, resident_ctas, resolve_cell,
                                 shared_bytes)
from persistent_rnn.tiles import SHIPPED
from full_set import EVERY_KERNEL

FLOORS = {"LSTM": 1024, "GRU": 1152, "RNN": 2048}        # required on an H100, fp32
TARGETS = {"LSTM": 1200, "GRU": 1400, "RNN": 2300}       # DESIGN.md's estimate



@pytest.mark.parametrize("cell", sorted(FLOORS))
@pytest.mark.parametrize("device", ["h100", "h200"])
def test_max_hidden_size_meets_floor_and_target(cell, device):
    h = max_hidden_size(cell, device=device)
    assert h >= FLOORS[cell] and h >= TARGETS[cell]


@pytest.mark.parametrize("cell", ["LSTM", "gru", "Rnn", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("device", ["h100", "a100"])
def test_max_hidden_size_is_the_boundary(cell, device):
    h = max_hidden_size(cell, device=device)
    assert make_plan(cell, h, 1, device=device).fits
    assert not make_plan(cell, h + 1, 1, device=device).fits


def test_a100_holds_less_than_h100():
    for cell in ("LSTM", "GRU", "RNN"):
        assert 0 < max_hidden_size(cell, device="a100") < max_hidden_size(cell, device="h100")


def test_names_are_case_insensitive():
    assert resolve_cell("LSTM") is resolve_cell("lstm") is CELLS["lstm"]
    assert resolve_cell("RNN") is CELLS["rnn_tanh"]
    assert max_hidden_size("rnn_relu", device="h100") == max_hidden_size("RNN", device="h100")


@pytest.mark.parametrize("cell", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("hidden", [16, 100, 512, 777])
@pytest.mark.parametrize("batch", [1, 8])
def test_plan_fits_both_passes_within_the_device(cell, hidden, batch):
    dev = PROFILES["h100"]
    p = make_plan(cell, hidden, batch, device="h100")
    assert p.fits, p.reason
    gates = CELLS[cell].gates
    for pp, k_len in ((p.forward, hidden), (p.backward, gates * hidden)):
        assert pp.grid * p.tile.units >= hidden and (pp.grid - 1) * p.tile.units < hidden
        assert pp.grid <= dev.sm_count
        assert pp.block * pp.registers <= dev.registers_per_sm
        assert pp.weights_per_thread < pp.registers
        d = pp.defines
        assert d["PRNN_KSPLIT"] * d["PRNN_KPT"] * 32 >= k_len
        assert pp.weights_per_thread == d["PRNN_ROWS"] * d["PRNN_KPT"]
        local_rows = d["PRNN_UNITS"] * (1 if pp is p.backward else gates)
        assert d["PRNN_WARPS"] == local_rows // d["PRNN_ROWS"] * d["PRNN_KSPLIT"]
        assert local_rows % d["PRNN_ROWS"] == 0
        assert pp.shared_bytes <= dev.shared_per_block
        assert pp.block == 32 * d["PRNN_WARPS"]


def test_plan_prefers_the_cheapest_tile():
    small = make_plan("lstm", 64, 4, device="a100")  # no clusters on sm_80
    large = make_plan("lstm", 1250, 4, device="h100")
    assert small.forward.weights_per_thread < large.forward.weights_per_thread
    assert small.tile == SHIPPED["lstm"][0] and large.tile == SHIPPED["lstm"][-1]


@pytest.mark.parametrize("cell, top", [("lstm", 256), ("gru", 256), ("rnn_tanh", 512)])
def test_plan_prefers_one_cluster_where_it_fits_on_sm_90(cell, top):
    four_warps, eight_warps = plan.cluster_tiles_for(CELLS[cell])
    for hidden in (1, top // 2 + 1, top):
        p = make_plan(cell, hidden, 4, device="h100")
        assert p.tile == four_warps and p.forward.block == 128
        assert p.forward.grid == p.backward.grid == p.forward.defines["PRNN_CLUSTER"] <= 16
    assert not make_plan(cell, top + 1, 4, device="h100").tile.cluster
    assert not make_plan(cell, top, 4, device="a100").tile.cluster


@pytest.mark.parametrize("cell, top", [("lstm", 256), ("gru", 256), ("rnn_tanh", 512)])
def test_a_device_of_portable_clusters_gets_eight_warps_in_eight_ctas(cell, top):
    """Where a device runs clusters of 8 CTAs at most (the portable size), the layers that would
    take 16 CTAs of 4 warps take 8 of 8 warps; those that fit 8 CTAs of 4 warps keep them."""
    four_warps, eight_warps = plan.cluster_tiles_for(CELLS[cell])
    portable = replace(PROFILES["h100"], max_cluster_ctas=8)
    p = make_plan(cell, top, 4, device=portable)
    assert p.tile == eight_warps and p.forward.grid == 8 and p.forward.block == 256
    assert "cluster of 16 CTAs > the 8" in plan._why_not(
        plan.pass_plan(CELLS[cell], four_warps, False, top, 4), portable, top)
    assert make_plan(cell, top // 2, 4, device=portable).tile == four_warps


def test_refusals_say_why():
    p = make_plan("lstm", 4000, 1, device="h100")
    assert not p.fits and "4000" in p.reason and p.forward is None
    double = make_plan("lstm", 512, 1, dtype="float64", device="h100")
    assert not double.fits and "float64" in double.reason
    # The backward of a large LSTM stages dgh (4H floats per batch row) in shared memory.
    big_batch = make_plan("lstm", 1250, 64, device="h100")
    assert not big_batch.fits and "shared memory" in big_batch.reason


def test_register_cap_allows_one_cta_per_sm():
    # CUDA's occupancy rule: a warp's registers come from one of 4 sub-partitions of 16384.
    for threads in (64, 128, 256, 288, 320, 352, 512, 1024):
        cap = register_cap(threads)
        assert resident_ctas(threads, cap) >= 1 and cap <= 255
        assert cap == 255 or resident_ctas(threads, cap + 1) == 0
    assert register_cap(256) == 255 and register_cap(320) == 168 and register_cap(512) == 128
    # The GPU run that found it: 11 warps at 184 registers hold 0 CTAs per SM.
    assert resident_ctas(352, 184) == 0 and resident_ctas(256, 255) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="cell"):
        max_hidden_size("transformer", device="h100")
    with pytest.raises(TypeError, match="cell"):
        max_hidden_size(3, device="h100")
    with pytest.raises(ValueError, match="device"):
        max_hidden_size("lstm", device="tpu")
    with pytest.raises(ValueError, match="hidden"):
        make_plan("lstm", 0, 1, device="h100")


def test_current_device_without_gpu_raises():
    from conftest import gpu_available
    if gpu_available():
        assert max_hidden_size("lstm") > 0
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            max_hidden_size("lstm")


def _layout_sample(spec) -> tuple:
    """The tiles whose layouts the canary test launches: with PRNN_TEST_EVERY_KERNEL every
    shipped tile (the grid tiles alone, then the cluster tiles, which the planner prefers where
    they fit); else one grid tile of each staged-buffer count and the first cluster tile - the
    region kinds there are (the layout is one list of regions, summed: plan.shared_layout)."""
    grid, cluster = plan.tiles_for(spec), plan.cluster_tiles_for(spec)
    if EVERY_KERNEL:
        return (*grid, *cluster)
    kinds: dict[int, object] = {}
    for tile in grid:
        kinds.setdefault(plan.staged_buffers(spec, tile), tile)
    return (*kinds.values(), *cluster[:1])


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("cell", FAMILY_CELLS)
def test_shared_bytes_are_what_the_kernel_carves_out(monkeypatch, settings, fresh_plans, cell,
                                                    backward):
    """Emulated launches (shared memory is followed by a canary the emulation checks): the
    planned bytes run, 4 bytes fewer are reported as an overrun, so the formula is exact. One
    cell per tile family: the layout is the family's tiles and the cell's G and S, which the
    other cells of a family share (the Elman cells differ in their activation alone)."""
    emulate = pytest.importorskip("persistent_rnn.emulate")
    from persistent_rnn import runtime
    from persistent_rnn.stats import RunStats
    from test_runtime import _inputs

    spec, batch = CELLS[cell], 3
    gi, w, b, h0, c0 = _inputs(spec, 24, batch, 3)
    dy = np.ones((3, batch, 24), np.float32)

    def run():
        runtime._cached_engine.cache_clear()  # plans follow the patched planner
        fwd = runtime.run_forward(spec, gi, w, b, h0, c0, None, "persistent", RunStats())
        if backward:
            runtime.run_backward(spec, dy, None, None, w, h0, c0, None, fwd, "persistent",
                                 RunStats())

    for tile in _layout_sample(spec):
        monkeypatch.setattr(plan, "tiles_for", lambda c, dtype="float32", tile=tile: () if tile.cluster else (tile,))
        monkeypatch.setattr(plan, "cluster_tiles_for", lambda c, dtype="float32", tile=tile: (tile,))
        monkeypatch.setattr(plan, "has_clusters", lambda dev, tile=tile: bool(tile.cluster))
        run()
        planned = plan.shared_bytes(spec, tile, backward, batch)
        monkeypatch.setattr(plan, "shared_bytes", lambda c, t, bwd, n, planned=planned, **kw:
                            planned - 4 if bwd == backward else shared_bytes(c, t, bwd, n, **kw))
        with pytest.raises(emulate.EmulationError, match="wrote past its"):
            run()
        monkeypatch.setattr(plan, "shared_bytes", shared_bytes)


def test_shared_layout_reaches_the_kernels_as_defines_and_sums_to_the_launch_bytes():
    """One source for a kernel's shared memory (docs/design.md, "Shared-memory layout"): each
    region of the planner's layout is a -D PRNN_SMEM_<REGION> of the pass plan, and the launch's
    bytes are those numbers summed - per batch row or fixed, each start rounded up to its
    alignment; the resident decoder takes its own layout, not the forward's, and its staged x
    (a launch argument's row) has no define."""
    region = plan.SharedRegion
    odd = (region("A", 3), region("B", 5, per_row=False), region("C", 2, align=16),
           region("D", 7, argument=True))
    assert plan.layout_bytes(odd, 1) == 12 + 20 + 8 + 28 == 68  # 32 is 16-byte aligned
    assert plan.layout_bytes(odd, 2) == 24 + 20 + 4 + 16 + 56  # 44 rounded up to 48
    assert plan.layout_defines(odd) == {"PRNN_SMEM_A": 3, "PRNN_SMEM_B": 5, "PRNN_SMEM_C": 2,
                                        "PRNN_SMEM_C_ALIGN": 16}
    lstm = CELLS["lstm"]
    grid, cluster = make_plan(lstm, 1024, 3, device="h100"), make_plan(lstm, 256, 3, device="h100")
    assert cluster.tile.cluster and not grid.tile.cluster
    for p, tile, backward in ((grid.forward, grid.tile, False), (grid.backward, grid.tile, True),
                              (cluster.forward, cluster.tile, False)):
        layout = plan.shared_layout(lstm, tile, backward)
        smem = {k: v for k, v in p.defines.items() if k.startswith("PRNN_SMEM_")}
        assert smem == plan.layout_defines(layout) and p.shared_bytes == plan.layout_bytes(layout, 3)
    assert "PRNN_SMEM_EXCHANGE_ALIGN" in cluster.forward.defines
    assert "PRNN_SMEM_EXCHANGE" not in grid.forward.defines
    from persistent_rnn import decoder
    dp, _ = decoder.plan(lstm, 256, 3, plan.resolve_device("h100"), input_size=10)
    assert {k for k in dp.defines if k.startswith("PRNN_SMEM_")} == {
        "PRNN_SMEM_STAGED", "PRNN_SMEM_PARTIAL", "PRNN_SMEM_GI", "PRNN_SMEM_WORDS"}
    assert dp.shared_bytes == plan.layout_bytes(decoder.shared_layout(
        lstm, dp.defines, cluster.forward.exchange_row, 10), 3)


def test_a_cluster_fetches_its_inputs_one_step_ahead_unless_told(monkeypatch):
    """plan.CLUSTER_INPUTS_AHEAD: a layer pass in a cluster keeps two buffers of its pointwise
    inputs (one step ahead: two was measured slower on an H200, 2026-11-27), three where a
    measurement sets it to 2, its shared memory one buffer larger; the grid keeps two either way
    and the stack kernels take no such define."""
    lstm = CELLS["lstm"]

    def plans() -> tuple:
        return (make_plan(lstm, 256, 3, device="h100"), make_plan(lstm, 1024, 3, device="h100"),
                plan.make_stack_plan(lstm, 256, 3, 2, device="h100"))

    cluster, grid, stack = plans()
    assert plan.CLUSTER_INPUTS_AHEAD == 1 and cluster.tile.cluster and not grid.tile.cluster
    for p in (cluster.forward, cluster.backward, grid.forward, grid.backward):
        assert p.defines["PRNN_INPUT_BUFFERS"] == 2
    monkeypatch.setattr(plan, "CLUSTER_INPUTS_AHEAD", 2)
    ahead, grid_ahead, stack_ahead = plans()
    assert ahead.tile == cluster.tile and (grid_ahead, stack_ahead) == (grid, stack)
    for one, two, region in ((cluster.forward, ahead.forward, "PRNN_SMEM_GI"),
                             (cluster.backward, ahead.backward, "PRNN_SMEM_INPUTS")):
        assert two.defines["PRNN_INPUT_BUFFERS"] == 3
        assert two.defines[region] * 2 == one.defines[region] * 3
        assert two.shared_bytes >= one.shared_bytes + 3 * 4 * one.defines[region] // 2
    assert not any("PRNN_INPUT_BUFFERS" in p.defines for p in (stack.forward, stack.backward))


def test_gather_quads_fit_the_batch_within_the_register_cap():
    """A grid kernel's gather loads as many quads at once as a thread gathers per step, rounded
    up to a power of 2 (every unrolled slot issues each step), capped by the registers the
    weights leave; the cluster kernels (no gather) have none; the stack kernels' is 8, 7 in a
    forward of more than 140 weights per thread (where 8 spills)."""
    assert [plan.gather_quads(128, q) for q in (1, 2, 3, 4, 5, 8, 16)] == [1, 2, 4, 4, 8, 8, 8]
    assert plan.gather_quads(160, 16) == 4 and plan.gather_quads(196, 3) == 2
    lstm = CELLS["lstm"]
    for batch, quads in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 8)):
        # LSTM H=1024: 256 threads, 256 quads per batch row of h
        p = make_plan(lstm, 1024, batch, device="h100").forward
        assert p.defines["PRNN_GATHER_QUADS"] == quads, batch
    assert "PRNN_GATHER_QUADS" not in make_plan(lstm, 64, 1, device="h100").forward.defines
    stack = plan.make_stack_plan(lstm, 384, 4, 2, False, "float32", "h100")  # 12 x 12 weights
    assert stack.fits and stack.forward.defines["PRNN_GATHER_QUADS"] == 7
    assert stack.backward.defines["PRNN_GATHER_QUADS"] == 8
    small = plan.make_stack_plan(lstm, 64, 4, 2, False, "float32", "h100")
    assert small.forward.defines["PRNN_GATHER_QUADS"] == 8


def test_grid_free_polls_are_compiled_in_only_when_set(monkeypatch):
    """``plan.GRID_FREE_POLLS`` (an experiment's knob: bench/gpu_call_cost.py --free-polls) is
    a define of grid passes only when it differs from the kernels' own default, which is
    exchange.cuh's ``PRNN_GRID_FREE_POLLS``: the shipped kernels' defines stay as recorded."""
    import re
    from persistent_rnn import _sources
    header = (_sources.cuda_src_dir() / "exchange.cuh").read_text()
    default = int(re.search(r"#define PRNN_GRID_FREE_POLLS (\d+)", header)[1])
    assert default == plan.KERNEL_GRID_FREE_POLLS == plan.GRID_FREE_POLLS
    grid, cluster = (plan.make_plan("gru", h, 1, device="h100") for h in (1024, 64))
    assert not grid.tile.cluster and cluster.tile.cluster
    assert all("PRNN_GRID_FREE_POLLS" not in p.defines for p in (grid.forward, grid.backward))
    monkeypatch.setattr(plan, "GRID_FREE_POLLS", 32)
    grid, cluster = (plan.make_plan("gru", h, 1, device="h100") for h in (1024, 64))
    assert grid.forward.defines["PRNN_GRID_FREE_POLLS"] == 32
    assert grid.backward.defines["PRNN_GRID_FREE_POLLS"] == 32
    assert "PRNN_GRID_FREE_POLLS" not in cluster.forward.defines
