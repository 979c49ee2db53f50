"""The planner's 16-bit (fp16/bf16) tiles: floors, register budget, boundaries, refusals."""
from __future__ import annotations

import numpy as np
import pytest

from persistent_rnn import max_hidden_size
from persistent_rnn.cells import CELLS, FAMILY_CELLS
from persistent_rnn.hardware import WEIGHT_BYTES, WEIGHT_REGISTER_BUDGET
from persistent_rnn.plan import (KERNEL_DTYPES, cluster_tiles_for, make_plan, tile_max_hidden,
                                 tiles_for, weight_registers)
from persistent_rnn.tiles import SHIPPED, SHIPPED_16BIT

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
