"""The planner's 16-bit (fp16/bf16) tiles: floors, register budget, boundaries, refusals, and the
tensor-core tiles it takes from ``plan.MMA_MIN_BATCH`` rows, and their tensor-core backward from
``plan.MMA_BACKWARD_MIN_BATCH`` rows (where the latency model predicts them faster)."""
from __future__ import annotations


import numpy as np
import pytest

from persistent_rnn import max_hidden_size
from persistent_rnn.cells import CELLS, FAMILY_CELLS
from persistent_rnn.hardware import PROFILES, WEIGHT_BYTES, WEIGHT_REGISTER_BUDGET
from persistent_rnn.plan import (KERNEL_DTYPES, MMA_BACKWARD_MIN_BATCH,
                                 MMA_STACK_BACKWARD_MIN_BATCH, cluster_tiles_for, make_plan,
                                 mma_tiles_for, tile_max_hidden, tiles_for, weight_registers)
from persistent_rnn.tiles import SHIPPED, SHIPPED_16BIT
from full_set import EVERY_KERNEL

HALF = ("float16", "bfloat16")
FLOORS_16BIT = {"LSTM": 1792, "GRU": 1920, "RNN": 3328}  # issue 11, on an H100/H200


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("device", ["h100", "h200"])
@pytest.mark.parametrize("cell", sorted(FLOORS_16BIT))
def test_16bit_max_hidden_size_meets_the_floor(cell, device, dtype):
    h = max_hidden_size(cell, dtype=dtype, device=device)
    assert h >= FLOORS_16BIT[cell]
    assert h > max_hidden_size(cell, device=device)  # more than fp32 holds


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("device", ["h100", "a100"])
def test_16bit_max_hidden_size_is_the_boundary(cell, device, dtype):
    h = max_hidden_size(cell, dtype, device)
    assert make_plan(cell, h, 1, dtype, device).fits
    assert not make_plan(cell, h + 1, 1, dtype, device).fits


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cell", FAMILY_CELLS)
def test_every_hidden_size_up_to_the_maximum_fits(cell, dtype):
    top = max_hidden_size(cell, dtype, "h100")
    for hidden in np.unique(np.linspace(1, top, 97).astype(int)):
        assert make_plan(cell, int(hidden), 1, dtype, "h100").fits, hidden


def test_weight_registers_stay_within_the_budget():
    # What ptxas fits with zero spills (kernel_report checks the compiled kernels).
    for dtype in KERNEL_DTYPES:
        for cell in CELLS.values():
            for tile in tiles_for(cell, dtype):
                for pt in (tile.forward, tile.backward):
                    regs = weight_registers(pt, dtype)
                    assert regs == pt.rows * pt.kpt * WEIGHT_BYTES[dtype] // 4
                    assert regs <= WEIGHT_REGISTER_BUDGET, (cell.name, dtype, tile)


def test_16bit_tiles_pack_column_pairs():
    # A register holds columns 2c and 2c+1 of one row: every lane's column count is even.
    for tiles in SHIPPED_16BIT.values():
        for tile in tiles:
            assert tile.forward.kpt % 2 == 0 and tile.backward.kpt % 2 == 0
    # The largest 16-bit tile holds about twice the weights of the largest fp32 tile.
    for kind in SHIPPED:
        fp32, half = SHIPPED[kind][-1].forward, SHIPPED_16BIT[kind][-1].forward
        assert 1.8 < half.rows * half.kpt / (fp32.rows * fp32.kpt) < 2.1


@pytest.mark.parametrize("dtype", HALF)
def test_16bit_plan_defines_the_weight_dtype(dtype):
    p = make_plan("gru", 1900, 2, dtype, "h100")
    assert p.fits and p.tile == SHIPPED_16BIT["gru"][-1]
    for pp in (p.forward, p.backward):
        assert pp.defines["PRNN_WEIGHT_DTYPE"] == KERNEL_DTYPES[dtype]
        assert pp.weight_registers * 2 == pp.weights_per_thread
        assert pp.max_hidden == tile_max_hidden(CELLS["gru"], p.tile)
    assert "PRNN_WEIGHT_DTYPE" not in make_plan("gru", 1000, 2, "float32", "h100").forward.defines


def test_16bit_plans_take_the_cheapest_tile():
    assert make_plan("lstm", 64, 1, "float16", "a100").tile == SHIPPED_16BIT["lstm"][0]
    # sm_90: small layers run as one thread-block cluster, 16-bit too
    assert make_plan("gru", 64, 1, "float16", "h100").tile == cluster_tiles_for(CELLS["gru"], "float16")[0]
    assert make_plan("lstm", 1200, 1, "float16", "h100").tile == SHIPPED_16BIT["lstm"][2]
    assert make_plan("lstm", 1700, 1, "bfloat16", "h100").tile == SHIPPED_16BIT["lstm"][3]


def test_16bit_batch_is_bounded_by_shared_memory():
    # The backward stages dgh (4H fp32 per batch row) in shared memory: at H 1792, 7 rows fit.
    assert make_plan("lstm", 1792, 7, "float16", "h100").fits
    big = make_plan("lstm", 1792, 8, "float16", "h100")
    assert not big.fits and "shared memory" in big.reason


def test_dtype_names_and_refusals():
    assert max_hidden_size("lstm", np.dtype(np.float16), "h100") == max_hidden_size(
        "lstm", np.float16, "h100") == max_hidden_size("lstm", "bfloat16", "h100")
    assert max_hidden_size("lstm", "float64", "h100") == 0
    with pytest.raises(ValueError, match="dtype must be one of"):
        max_hidden_size("lstm", "int8", "h100")
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_plan("lstm", 64, 1, "fp16", "h100")


def test_mma_tiles_hold_whole_m_tiles_within_the_budget():
    for cluster in (False, True):
        for cell in CELLS.values():
            for tile in mma_tiles_for(cell, "float16", cluster):
                fwd, bwd = tile.forward, tile.backward
                assert tile.mma and fwd.rows % 16 == 0 and bool(tile.cluster) == cluster
                assert cell.gates * tile.units % fwd.rows == 0  # no padding rows
                assert bwd.kpt % 2 == 0  # the backward is a CUDA-core 16-bit tile
                for pt in (fwd, bwd):
                    assert weight_registers(pt, "float16") <= WEIGHT_REGISTER_BUDGET
    assert mma_tiles_for(CELLS["lstm"], "float32") == ()


@pytest.mark.parametrize("dtype", HALF)
def test_16bit_plans_take_mma_tiles_from_batch_2(dtype):
    for cell, hidden, batch, device in (("lstm", 768, 16, "h100"), ("lstm", 1024, 8, "h100"),
                                        ("gru", 1000, 4, "a100"), ("rnn_relu", 2000, 2, "h100"),
                                        ("lstm", 200, 8, "h100")):
        p = make_plan(cell, hidden, batch, dtype, device)
        assert p.fits and p.tile.mma, (cell, hidden, batch, p.reason)
        assert p.forward.defines["PRNN_MMA"] == 1
        # the backward on the tensor cores too from plan.MMA_BACKWARD_MIN_BATCH rows
        assert p.backward.defines.get("PRNN_MMA") == (2 if batch >= MMA_BACKWARD_MIN_BATCH else None)
        assert bool(p.tile.cluster) == (hidden <= 256 and device == "h100")
        assert not make_plan(cell, hidden, 1, dtype, device).tile.mma
    assert not make_plan("lstm", 1024, 8, "float32", "h100").tile.mma
    # Past the mma tiles' H, the CUDA-core 16-bit tiles serve every batch.
    assert not make_plan("lstm", 1280, 4, "float16", "h100").tile.mma


def _predicted_us(cell: str, hidden: int, batch: int, p) -> float:
    """The latency model's step of pass ``p`` (h100, sm_90 SASS): a prediction."""
    from persistent_rnn import latency
    pytest.importorskip("persistent_rnn.sass_analysis").nvdisasm() or pytest.skip("no nvdisasm")
    sass = latency.pass_sass(p, "sm_90")
    return latency.step_terms(sass, latency.PassShape(CELLS[cell], p, batch, hidden),
                              PROFILES["h100"]).total_us


def test_the_model_predicts_the_planned_16bit_tile_faster(monkeypatch, sixteen_bit_tiles_only):
    # Where plan.MMA_MIN_BATCH puts the line between the 16-bit tiles (predictions of the latency
    # model, h100, forward): at B = 1 the CUDA-core tile (no slower), from B = 2 the mma tile
    # (faster) - in a cluster and on the grid. (At B = 1 the fp32 tile beats both: the next test.)
    # H 512 on the grid's tiles: the mid-size cluster tiles have their own line (further below).
    from persistent_rnn import plan as planner
    monkeypatch.setattr(planner, "MMA_MID_CLUSTER_MAX_BATCH", 0)

    def forward_us(hidden, batch, mma):  # the forward alone (the backward is the same tile)
        monkeypatch.setattr(planner, "MMA_MIN_BATCH", 1 if mma else 10**6)
        return _predicted_us("lstm", hidden, batch,
                             make_plan("lstm", hidden, batch, "float16", "h100").forward)

    # At B = 1 no slower within the model's resolution (its median error on the recorded points
    # is 3 %, bench/results/model-calibration-2026-11-26.json): at H 512 the grid's mma tile has
    # a second block barrier and fewer issue slots, predicted 2 % faster.
    for hidden in (256, 512):
        assert forward_us(hidden, 1, mma=False) <= 1.05 * forward_us(hidden, 1, mma=True)
        assert forward_us(hidden, 2, mma=True) < forward_us(hidden, 2, mma=False)


def test_the_model_predicts_the_planned_16bit_backward_faster(monkeypatch, sixteen_bit_tiles_only):
    # Where plan.MMA_BACKWARD_MIN_BATCH puts the line between the 16-bit backwards (predictions of
    # the latency model, h100): an mma tile's backward on the CUDA cores below it, on the tensor
    # cores from it. LSTM H 512 at B = 3 and 4 (the same kernels: the gather loads 8 quads at
    # both); the full set also the shapes of docs/design.md's table. (H 512 on the grid's tiles,
    # as above.)
    from persistent_rnn import plan as planner
    monkeypatch.setattr(planner, "MMA_MID_CLUSTER_MAX_BATCH", 0)

    def backward_us(cell, hidden, batch, mma):
        monkeypatch.setattr(planner, "MMA_BACKWARD_MIN_BATCH", 1 if mma else 10**6)
        p = make_plan(cell, hidden, batch, "float16", "h100").backward
        assert p.defines.get("PRNN_MMA") == (2 if mma else None)
        return _predicted_us(cell, hidden, batch, p)

    assert MMA_BACKWARD_MIN_BATCH == 4
    assert backward_us("lstm", 512, 3, mma=False) < backward_us("lstm", 512, 3, mma=True)
    assert backward_us("lstm", 512, 4, mma=True) < backward_us("lstm", 512, 4, mma=False)
    if EVERY_KERNEL:
        for cell, hidden, batch in (("lstm", 768, 16), ("lstm", 1024, 8), ("lstm", 512, 16),
                                    ("gru", 1024, 8), ("lstm", 256, 4)):
            assert backward_us(cell, hidden, batch, True) < backward_us(cell, hidden, batch, False)


def test_the_model_predicts_the_mid_cluster_tile_faster_up_to_its_batch(monkeypatch):
    # Where plan.MMA_MID_CLUSTER_MAX_BATCH puts the line for the mid-size cluster mma tiles
    # (LSTM H 512, fp16; predictions of the latency model, h100): up to it their forward faster
    # than the grid's (B = 1: the widened fp32 tile; B = 8: the mma tile), past it slower (B = 9),
    # and their own backward slower than the grid's that plan._grid_backward takes (B = 4).
    from persistent_rnn import plan as planner

    def plan(batch, mid):
        monkeypatch.setattr(planner, "MMA_MID_CLUSTER_MAX_BATCH", batch if mid else 0)
        p = make_plan("lstm", 512, batch, "float16", "h100")
        assert bool(p.tile.cluster) == mid and p.tile.units == (32 if mid else 8)
        return p

    def us(p, batch):
        return _predicted_us("lstm", 512, batch, p)

    assert planner.MMA_MID_CLUSTER_MAX_BATCH == 8
    for batch in (1, 8):
        assert us(plan(batch, True).forward, batch) < us(plan(batch, False).forward, batch)
    mid = plan(4, True)
    past = planner.pass_plan(CELLS["lstm"], mid.tile, False, 512, 9, "float16")
    assert us(past, 9) > us(plan(9, False).forward, 9)
    own = planner.pass_plan(CELLS["lstm"], mid.tile, True, 512, 4, "float16")
    assert own.defines["PRNN_MMA"] == mid.backward.defines["PRNN_MMA"] == 2
    assert us(own, 4) > us(mid.backward, 4)


def test_mid_size_16bit_layers_take_the_cluster_up_to_its_batch():
    # LSTM and GRU H 257-512 (16-bit, h100): the forward in one cluster of 32-unit CTAs up to
    # plan.MMA_MID_CLUSTER_MAX_BATCH rows (B = 1 too: not widened), on the grid past it; the
    # backward on the grid (below plan.MMA_BACKWARD_MIN_BATCH the fp32 tile's, widened); never
    # in fp32 or TF32.
    from persistent_rnn.plan import MMA_MID_CLUSTER_MAX_BATCH
    for cell, hidden in (("lstm", 384), ("lstm", 512), ("gru", 300), ("gru", 512)):
        for batch in range(1, MMA_MID_CLUSTER_MAX_BATCH + 2):
            for dtype in HALF:
                p = make_plan(cell, hidden, batch, dtype, "h100")
                mid = batch <= MMA_MID_CLUSTER_MAX_BATCH
                assert p.fits and bool(p.tile.cluster) == mid, (cell, batch)
                assert ("PRNN_CLUSTER" in p.forward.defines) == mid
                assert "PRNN_CLUSTER" not in p.backward.defines
                if mid:
                    assert p.tile.units == 32 and p.forward.grid == -(-hidden // 32)
                    assert p.forward.defines["PRNN_MMA"] == 1
                    assert p.backward.defines.get("PRNN_MMA") \
                        == (2 if batch >= MMA_BACKWARD_MIN_BATCH else None)
            full = make_plan(cell, hidden, batch, "float32", "h100")
            assert not full.tile.cluster and not full.tile.mma
    assert not make_plan("lstm", 513, 4, "float16", "h100").tile.cluster
    assert make_plan("lstm", 256, 4, "float16", "h100").tile.units == 16  # the small layers' tile



@pytest.mark.parametrize("cell,hidden,batch", [("gru", 256, 32), ("rnn_tanh", 768, 48)]
                         + ([("gru", 128, 32), ("gru", 512, 31), ("gru", 128, 64),
                             ("rnn_tanh", 528, 46), ("rnn_tanh", 1024, 51)] if EVERY_KERNEL else []))
def test_the_model_predicts_the_mma_forward_and_the_planned_backward_faster(monkeypatch, cell,
                                                                           hidden, batch):
    # Where no tensor-core tile holds both passes' whole batch but a CUDA-core grid tile does
    # (plan._mma_forward; predictions of the latency model, h100, fp16): the grid mma tile's
    # forward (in batch groups where the whole batch does not fit: RNN B 48) faster than the
    # CUDA-core tile's the layer had, and the backward plan.GROUPED_MMA_BACKWARD picks faster
    # than the others: the GRU's the float32 layer's, widened (faster than the CUDA-core 16-bit
    # one it had and the mma tile's in batch groups), the Elman RNN's the mma tile's in groups.
    from persistent_rnn import plan as planner
    p = make_plan(cell, hidden, batch, "float16", "h100")
    with monkeypatch.context() as m:
        m.setattr(planner, "_mma_forward", lambda plan, *_: plan)
        before = make_plan(cell, hidden, batch, "float16", "h100")
    assert p.tile.mma and not before.tile.mma
    grouped = planner._grouped_pass(CELLS[cell], p.tile, True, hidden, batch, "float16",
                                    PROFILES["h100"])
    wide = make_plan(cell, hidden, batch, "float32", "h100").backward
    assert p.backward in (grouped, wide)
    others = [q for q in (grouped, wide, before.backward) if q != p.backward]

    def us(q):
        return _predicted_us(cell, hidden, batch, q)

    assert us(p.forward) < us(before.forward)
    assert all(us(p.backward) < us(q) for q in others)

# Issue 28: every 16-bit shape that fits predicted no slower than the fp32 kernel of the same
# shape. CI: the widened passes (B = 1; the RNN's cluster forward at B = 2 and the GRU's grid
# backward at B = 2, beside its mma forward) and an mma forward beside the fp32 backward
# (GRU B = 32, plan._mma_forward); the full set: H 128-1024 x B 1-48 of every tile family, the
# mma passes from B = 3/4 too, in batch groups at B = 48 (RNN H 1024: plan.GROUPED_MMA_BACKWARD).
NO_SLOWER_SHAPES = ([(c, h, b) for c in ("lstm", "gru", "rnn_tanh") for h in (128, 256, 512, 1024)
                     for b in (1, 2, 3, 4, 8, 16, 24, 32, 48)] if EVERY_KERNEL else
                    [("lstm", 256, 1), ("rnn_tanh", 128, 2), ("gru", 1024, 2), ("gru", 256, 32)])


@pytest.mark.parametrize("hidden,proj", [(512, 128), (1024, 256)] if EVERY_KERNEL else [(1024, 256)])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8] if EVERY_KERNEL else [3])
def test_16bit_projections_are_predicted_no_slower_than_float32(hidden, proj, batch):
    # The LSTM with projection on the grid: its backward below plan.MMA_BACKWARD_MIN_BATCH on
    # the fp32 projection tile (plan._widened_projection); its forward on the 16-bit tiles
    # throughout. In a cluster (H 512, P 128) both passes are the fp32 tile's, widened.
    from persistent_rnn import latency
    half, full = (make_plan("lstm", hidden, batch, d, "h100", proj_size=proj)
                  for d in ("float16", "float32"))
    in_weights = "PRNN_WEIGHT_DTYPE" in half.backward.defines
    assert in_weights == (batch >= MMA_BACKWARD_MIN_BATCH and not half.tile.cluster)
    predicted = [latency.predict_plan(CELLS["lstm"], hidden, batch, p, PROFILES["h100"],
                                      proj=proj) for p in (half, full)]
    assert predicted[0].forward_us <= 1.05 * predicted[1].forward_us
    assert predicted[0].backward_us <= 1.05 * predicted[1].backward_us


@pytest.mark.parametrize("cell,hidden,batch", NO_SLOWER_SHAPES)
def test_16bit_layers_are_predicted_no_slower_than_float32(cell, hidden, batch):
    # Within the model's resolution (5 %: its median error on the recorded points is 3 %).
    # Where the 16-bit tiles are slower (the packed pairs' unpacking at B = 1, the mma n-tile's
    # whole chain at small B) the pass runs on the fp32 tile with its weights widened.
    from persistent_rnn import plan as planner
    half, full = (make_plan(cell, hidden, batch, d, "h100") for d in ("float16", "float32"))
    if not full.fits:
        return
    for backward in (False, True):
        p, q = (half.backward, full.backward) if backward else (half.forward, full.forward)
        stays = not backward and half.tile.cluster and not full.tile.cluster  # (a mid-size tile)
        if planner.widens(CELLS[cell], batch, backward, bool(full.tile.cluster)) and not stays:
            assert "PRNN_WEIGHT_DTYPE" not in p.defines  # the fp32 tile, the weights widened
            assert p.defines.get("PRNN_WIDENED_FROM") == (None if backward else 1)
        assert _predicted_us(cell, hidden, batch, p) <= 1.05 * _predicted_us(cell, hidden, batch, q)


def test_16bit_elman_stacks_widen_both_passes_where_their_mma_stack_is_slower():
    # plan.WIDENED_STACKS (pure Python): an Elman stack of H <= 256 at B = 3-4 runs both passes
    # on the fp32 stack's tiles (the forward from the 16-bit words, h_t rounded as stored);
    # elsewhere the forward stays on the tensor cores, the backward from
    # MMA_STACK_BACKWARD_MIN_BATCH; other cells never widen their forward
    from persistent_rnn.plan import make_stack_plan
    for hidden, batch, widened in ((256, 3, True), (256, 4, True), (128, 3, True),
                                   (256, 2, False), (256, 5, False), (320, 3, False)):
        p = make_stack_plan("rnn_tanh", hidden, batch, 2, dtype="float16", device="h100")
        full = make_stack_plan("rnn_tanh", hidden, batch, 2, device="h100")
        assert p.fits and p.tile.mma and p.launches == 1, (hidden, batch)
        assert ("PRNN_WIDENED_FROM" in p.forward.defines) == widened, (hidden, batch)
        assert (p.forward.grid == full.forward.grid) == widened, (hidden, batch)
        mma_backward = not widened and batch >= MMA_STACK_BACKWARD_MIN_BATCH
        assert ("PRNN_WEIGHT_DTYPE" in p.backward.defines) == mma_backward, (hidden, batch)
    for cell in ("gru", "lstm"):
        p = make_stack_plan(cell, 256, 3, 2, dtype="float16", device="h100")
        assert p.forward.defines["PRNN_MMA"] == 1 and "PRNN_WIDENED_FROM" not in p.forward.defines


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set (PRNN_TEST_EVERY_KERNEL=1)")
@pytest.mark.parametrize("cell,hidden,layers", [("lstm", 384, 4), ("gru", 512, 2),
                                                ("rnn_tanh", 256, 2), ("rnn_tanh", 320, 2)])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
def test_16bit_stacks_are_predicted_no_slower_than_float32(cell, hidden, layers, batch):
    # Stack mode (tiles.MMA_STACK_TILES; one launch a pass): the 16-bit stack's kernels no slower
    # than what an fp32 stack runs - stack mode, or one launch per layer where its stack tiles
    # stop (the GRU H 512) - within the model's resolution (5 %): each pass's kernel time, the
    # call's other terms aside (as the layers' test above; a 16-bit call's conversions are
    # latency.HALF_*_OPS). Below plan.MMA_STACK_BACKWARD_MIN_BATCH the backward is the fp32
    # stack's, widened, where that fits.
    from persistent_rnn import latency
    pytest.importorskip("persistent_rnn.sass_analysis").nvdisasm() or pytest.skip("no nvdisasm")
    half, full = (latency.predict_stack_time(cell, hidden, batch, layers, 100, dtype=d,
                                             device=PROFILES["h100"])
                  for d in ("float16", "float32"))
    assert half.plan.fits and half.plan.tile.mma
    widened = "PRNN_WEIGHT_DTYPE" not in half.plan.backward.defines
    from persistent_rnn import plan as planner
    assert widened == (planner.widens(CELLS[cell], batch, True, False, stack_hidden=hidden)
                       and full.plan.fits)
    for k, name in enumerate(("forward", "backward")):
        kernels = [(getattr(st, f"{name}_us") if st.plan.fits else getattr(st, f"apart_{name}_us"))
                   - st.calls[k].device_us for st in (half, full)]
        assert kernels[0] <= 1.05 * kernels[1], name
