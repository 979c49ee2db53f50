"""Batch groups (``-D PRNN_BATCH_GROUP``, ``plan.batch_group``; docs/design.md, "Batch groups"):
a grid mma pass whose staged vector does not fit shared memory for the whole batch multiplies
it group by group, through the CPU emulation of the same CUDA source.

The planner groups only where the whole batch does not fit (LSTM H 1024 at B 16 and 32: the
backward's dgh staged as 16 KB a batch row); here ``plan.batch_group`` is forced to groups of 8
rows at a small layer (H 40, B 16 and, in the full set, 17: a partial last group), so that:

* the grouped passes match the ungrouped ones bitwise (grouping moves no arithmetic: every
  n-tile multiplies the same values in the same k order), and the fp32 gradients float64 along
  the run's own states within tests/test_mma_backward.py's ``FP32_BOUND``;
* a stall restarts them bitwise identically (the further groups of a launch's first step are
  staged from its source, not gathered);
* a sabotage - each group's partial sums written at the first group's rows - fails.

CI: LSTM fp16, B 16 (two groups), the forward and backward grouped;
``PRNN_TEST_EVERY_KERNEL=1`` adds bf16, GRU and the Elman RNN and B 17.
"""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, plan as planner

from campaign import relerr
from full_set import EVERY_KERNEL
from sabotage import sabotaged
from test_mma_backward import FP32_BOUND, _backward, emulation  # noqa: F401 (a fixture)

CASES = [("lstm", "float16", 16)]
if EVERY_KERNEL:
    CASES += [(c, d, b) for c in ("lstm", "gru", "rnn_tanh") for d in ("float16", "bfloat16")
              for b in (16, 17) if (c, d, b) != CASES[0]]
GROUP = 8


@pytest.fixture
def grouped(emulation, grid_path, monkeypatch):  # noqa: F811 (the imported fixture)
    """The planner's batch groups forced to 8 rows wherever a pass may group (``groups_batch``);
    yields the set of passes (backward or not) it grouped."""
    passes = set()

    def group(cell, tile, backward, batch, limit):
        if planner.groups_batch(tile) and batch > GROUP:
            passes.add(backward)
            return GROUP
        return 0

    monkeypatch.setattr(planner, "batch_group", group)
    yield passes


def _grouped_run(passes: set, name: str, dtype: str, batch: int):
    """``_backward``'s gradients, float64 reference and stats, both passes grouped."""
    passes.clear()
    prnn.runtime._cached_engine.cache_clear()  # planned anew: the passes grouped are recorded
    got, want, stats = _backward(name, dtype, 40, batch)
    assert passes == {False, True}
    assert f"'PRNN_BATCH_GROUP': {GROUP}" in stats.details[0] and "'PRNN_MMA': 2" in stats.details[0]
    return got, want, stats


@pytest.mark.parametrize("name,dtype,batch", CASES)
def test_grouped_passes_match_the_whole_batch_bitwise_and_float64(grouped, monkeypatch, name,
                                                                  dtype, batch):
    got, want, _ = _grouped_run(grouped, name, dtype, batch)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key
    monkeypatch.setattr(planner, "batch_group", lambda *args: 0)
    prnn.runtime._cached_engine.cache_clear()
    whole, _, stats = _backward(name, dtype, 40, batch)
    assert "PRNN_BATCH_GROUP" not in stats.details[0]
    for key, value in whole.items():
        assert np.array_equal(got[key], value), key


def test_grouped_stall_restarts_bitwise_identically(grouped, settings):
    clean, _, _ = _grouped_run(grouped, "lstm", "float16", 16)
    prnn.configure(emulation_timeout_ms=300)
    with prnn.inject_stall(block=1, step=2, duration_ms=2000):
        stalled, _, stats = _grouped_run(grouped, "lstm", "float16", 16)
    assert stats.restarts >= 1 and stats.fallback is None
    for key, value in clean.items():
        assert np.array_equal(stalled[key], value), key


def test_a_group_offset_sabotage_fails(grouped, tmp_path, monkeypatch):
    # Every group's partial sums land at the first group's rows: the later rows' sums are stale.
    src = sabotaged(tmp_path, "persistent_common.cuh",
                    "part_s + r0 * kKsplit * local_rows,", "part_s,")
    real = emulate.get_module
    monkeypatch.setattr(emulate, "get_module",
                        lambda source, defines, src_dir=None: real(source, defines, src))
    got, want, _ = _grouped_run(grouped, "lstm", "float16", 16)
    assert not all(relerr(got[key], ref) <= FP32_BOUND for key, ref in want.items())  # (or NaN)
