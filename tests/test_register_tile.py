"""The register tile's reduce-scatter (persistent_common.cuh's TileOf) for every row count a warp
can hold, in the CPU emulation: tests/cuda/register_tile.cu against float64."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persistent_rnn import emulate

pytestmark = pytest.mark.timeout(240)

TILE_KERNEL = str(Path(__file__).resolve().parent / "cuda" / "register_tile.cu")  # test-only

# Columns per lane: 2 (a 64-column matrix; a lane takes one column at a time) and 8 (256 columns;
# a lane takes 4 adjacent columns at a time, TileOf::kSpan 4).
KPTS = (2, 8)


@pytest.mark.parametrize("kpt", KPTS)
@pytest.mark.parametrize("rows", range(1, 33))
def test_every_row_sum_reaches_one_writer(rows, kpt):
    module = emulate.get_module(TILE_KERNEL, {
        "PRNN_CELL": 0, "PRNN_UNITS": 1, "PRNN_ROWS": 1, "PRNN_KSPLIT": 1, "PRNN_KPT": kpt,
        "PRNN_WARPS": 1})
    rng = np.random.default_rng(rows)
    m = rng.standard_normal((rows, 32 * kpt)).astype(np.float32)
    v = rng.standard_normal(32 * kpt).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    module.launch("tile_rows_product", 1, 32, 0, (m, v, out, np.int32(rows)))
    want = m.astype(np.float64) @ v.astype(np.float64)
    scale = np.abs(m).astype(np.float64) @ np.abs(v).astype(np.float64)
    assert (np.abs(out[:rows] - want) <= 1e-6 * scale).all(), (out[:rows], want)
    assert np.isnan(out[rows:]).all()  # the padding rows' sums are written by nobody
