"""Batch groups (``-D PRNN_BATCH_GROUP``, ``plan.batch_group``; docs/design.md, "Tensor-core
tiles": batch groups): a grid mma pass whose staged vector does not fit shared memory for the
whole batch multiplies it group by group, through the CPU emulation of the same CUDA source.

The planner groups only where the whole batch does not fit (LSTM H 1024 at B 16 and 32: the
backward's dgh staged as 16 KB a batch row); here it groups the passes of a small layer (H 40,
B 16 and, in the full set, 17: a partial last group) on an emulated device whose shared memory
holds groups of 8 rows but not the whole batch, so that:

* the fp32 gradients match float64 along the run's own states within
  tests/test_mma_backward.py's ``FP32_BOUND``, what the layer returns (forward and backward) the
  float64 layer within docs/api.md's 16-bit bounds, and the grouped passes the ungrouped ones
  bitwise (grouping moves no arithmetic: every n-tile multiplies the same values in the same k
  order);
* a stall restarts them bitwise identically (the further groups of a launch's first step are
  staged from its source, not gathered);
* the kernels carve exactly ``plan.shared_layout``'s bytes (a grouped STAGED region is fixed);
* a sabotage - each group's partial sums written at the first group's rows - fails.

CI: LSTM fp16, B 16 (two groups), the forward and backward grouped: float64 (gradients and the
layer), the stall, the shared bytes and the sabotage (two kernels and a sabotaged backward
built); the planner's sizes and the latency model's terms of the grouped backward (one NVRTC
build). The full set (``PRNN_TEST_EVERY_KERNEL=1``): grouped against the whole batch bitwise,
LSTM, GRU and the Elman RNN, fp16 and bf16, B 16 and 17 (a partial last group), LSTM fp16 and
RNN bf16 at B 32 (the GRU's and RNN's backwards grouped, their forwards, which stage less than a
backward's group of 8 rows, whole), and ``max_hidden_size`` at B 32.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, plan as planner
from persistent_rnn.cells import CELLS

from campaign import relerr
from full_set import EVERY_KERNEL
from sabotage import sabotaged
from test_mma_backward import (FP32_BOUND, _backward, emulation,  # noqa: F401 (a fixture)
                               layer_within_the_16bit_bounds)

CASES = [(c, d, b) for c in ("lstm", "gru", "rnn_tanh") for d in ("float16", "bfloat16")
         for b in (16, 17)] + [("lstm", "float16", 32), ("rnn_tanh", "bfloat16", 32)]  # (full set)
HIDDEN = 40


def _limit(name: str, dtype: str, batch: int) -> tuple[int, set]:
    """Shared memory per CTA that holds the first mma tile serving ``HIDDEN``'s passes in groups
    of 8 rows but not its backward's whole batch (so that the planner's own rule groups it), and
    the passes (backward or not) it groups: the forward too where its whole batch does not fit
    either (LSTM; the GRU's and RNN's forwards stage less than their backwards' groups)."""
    cell = CELLS[name]
    tile = next(t for t in planner.mma_tiles_for(cell, dtype)
                if planner.tile_max_hidden(cell, t) >= HIDDEN)
    limit = max(planner.shared_bytes(cell, tile, b, batch, batch_group=8) for b in (False, True))
    grouped = {b for b in (False, True) if planner.shared_bytes(cell, tile, b, batch) > limit}
    assert True in grouped
    return limit, grouped


@pytest.fixture
def grouped(emulation, grid_path, monkeypatch):  # noqa: F811 (the imported fixture)
    """Places a 16-bit layer where the planner groups its passes (on the mma tiles): an emulated
    device whose shared memory per CTA is ``_limit``'s (or, ``whole``, the device's: the whole
    batch at once); checks the plan."""
    from persistent_rnn import runtime
    device = runtime.EMULATED_DEVICE
    # The mma tiles alone for 16-bit layers: where a CUDA-core tile holds the whole batch in less
    # shared memory (the RNN's, at H 40), the planner would take it and group nothing.
    tiles_for = planner.tiles_for
    monkeypatch.setattr(planner, "tiles_for", lambda cell, dtype="float32":
                        tiles_for(cell, dtype) if dtype == "float32" else ())

    def place(name: str, dtype: str, batch: int, whole: bool = False) -> None:
        limit, passes = ((device.shared_per_block, set()) if whole
                         else _limit(name, dtype, batch))
        monkeypatch.setattr(runtime, "EMULATED_DEVICE",
                            replace(device, shared_per_block=limit, shared_per_sm=limit))
        plan = planner.make_plan(name, HIDDEN, batch, dtype, runtime.EMULATED_DEVICE)
        assert {b for b, p in ((False, plan.forward), (True, plan.backward))
                if "PRNN_BATCH_GROUP" in p.defines} == passes
        runtime._cached_engine.cache_clear()  # (planned on this device)

    yield place


def _run(place, name: str, dtype: str, batch: int, whole: bool = False):
    """``_backward``'s gradients, float64 reference and stats of a layer ``place``d: grouped, or
    (``whole``) the whole batch at once."""
    place(name, dtype, batch, whole)
    got, want, stats = _backward(name, dtype, HIDDEN, batch)
    _ran_grouped(stats, not whole)
    return got, want, stats


def _ran_grouped(stats, grouped: bool) -> None:
    assert ("'PRNN_BATCH_GROUP'" in stats.details[0]) == grouped
    assert "'PRNN_MMA': 2" in stats.details[0]


def _passes(layer, data) -> tuple[list[np.ndarray], list]:
    """The layer's forward and backward on ``data`` (x, hx, dy, dhn): its results and the two
    passes' RunStats."""
    x, hx, dy, dhn = data
    y, (h, c) = layer.forward(x, hx)
    forward = layer.last_run
    dx, (dh, dc) = layer.backward(dy, dhn)
    return ([np.asarray(a) for a in (y, h, c, dx, dh, dc, *layer.grads.values())],
            [forward, layer.last_run])


def test_grouped_passes_match_float64_and_restart_bitwise(grouped, settings):
    got, want, _ = _run(grouped, "lstm", "float16", 16)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key
    # A stall: both passes restart mid-sequence, their launches' first steps staging the second
    # group from y[t-1] and dgh[t+1] (the first step's `first`), and end bitwise identical.
    layer = prnn.LSTM(5, HIDDEN, dtype="float16", algo="persistent", seed=7)
    rng = np.random.default_rng(3)
    half = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    data = (half(4, 16, 5), (half(1, 16, HIDDEN), half(1, 16, HIDDEN)), half(4, 16, HIDDEN),
            (half(1, 16, HIDDEN), half(1, 16, HIDDEN)))
    clean, _ = _passes(layer, data)
    layer.zero_grad()
    prnn.configure(emulation_timeout_ms=300)
    with prnn.inject_stall(block=1, step=2, duration_ms=700):
        stalled, stats = _passes(layer, data)
    for run in stats:
        assert run.restarts >= 1 and run.fallback is None and "PRNN_BATCH_GROUP" in run.details[0]
    for a, b in zip(stalled, clean):
        assert np.array_equal(a, b)


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set (PRNN_TEST_EVERY_KERNEL=1)")
@pytest.mark.parametrize("name,dtype,batch", CASES)
def test_grouped_passes_match_the_whole_batch_bitwise(grouped, name, dtype, batch):
    got, want, _ = _run(grouped, name, dtype, batch)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key
    whole, _, _ = _run(grouped, name, dtype, batch, whole=True)
    for key, value in whole.items():
        assert np.array_equal(got[key], value), key


def test_grouped_layer_within_the_16bit_bounds(grouped):
    # What the layer returns, forward and backward (y, h_n, c_n, dx, dh0, dc0, the weights'
    # gradients): the grouped passes against the float64 layer and the 16-bit GEMM path.
    grouped("lstm", "float16", 16)
    kern = layer_within_the_16bit_bounds("lstm", "float16", HIDDEN, 16)
    _ran_grouped(kern.last_run, True)


def test_grouped_shared_bytes_are_what_the_kernels_carve_out(grouped, monkeypatch):
    # The planned bytes run (the emulation checks a canary past them: _grouped_run's runs);
    # 4 bytes fewer for either grouped pass are an overrun, so plan.shared_layout is exact.
    real = planner.shared_bytes
    for backward in (False, True):
        monkeypatch.setattr(planner, "shared_bytes", lambda c, t, bwd, n, stack=False,
                            batch_group=0: real(c, t, bwd, n, stack, batch_group)
                            - (4 if batch_group and bwd == backward else 0))
        with pytest.raises(emulate.EmulationError, match="wrote past its"):
            _run(grouped, "lstm", "float16", 16)


def test_a_group_offset_sabotage_fails(grouped, tmp_path, monkeypatch):
    # The backward's every group's partial sums land at the first group's rows: the later rows'
    # sums are stale (or never written).
    src = sabotaged(tmp_path, "persistent_common.cuh",
                    "part_s + r0 * kKsplit * local_rows,", "part_s,")
    real = emulate.get_module
    monkeypatch.setattr(emulate, "get_module", lambda source, defines, src_dir=None: real(
        source, defines, src if source == "persistent_backward.cu" else src_dir))
    got, want, _ = _run(grouped, "lstm", "float16", 16)
    assert not all(relerr(got[key], ref) <= FP32_BOUND for key, ref in want.items())  # (or NaN)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lstm_1024_fits_at_batch_8_16_and_32(dtype):
    # Issue 28's sizes: the backward in groups of 8 rows from B 16 (dgh staged, 16 KB a row),
    # the forward whole; nothing grouped where the whole batch fits (B 8, H 768 at B 16).
    device = planner.resolve_device("h100")
    limit = min(device.shared_per_block, device.shared_per_sm)
    for hidden, batch, group in ((1024, 8, 0), (1024, 16, 8), (1024, 32, 8), (768, 16, 0),
                                 (768, 32, 16)):
        plan = planner.make_plan("lstm", hidden, batch, dtype, device)
        assert plan.fits and plan.tile.mma and not plan.tile.cluster, (hidden, batch)
        assert "PRNN_BATCH_GROUP" not in plan.forward.defines
        assert plan.backward.defines.get("PRNN_BATCH_GROUP", 0) == group, (hidden, batch)
        assert plan.backward.shared_bytes <= limit
        if group:  # the largest group that fits (the fewest groups)
            assert planner.shared_bytes(CELLS["lstm"], plan.tile, True, batch,
                                        batch_group=group + 8) > limit
    if EVERY_KERNEL:  # (bf16 plans the same tiles; the GRU's and RNN's: docs/design.md, 1024
        # and 2048 at B 32, before 512 and 1024)
        assert planner.max_hidden_size("lstm", dtype, device, 32) == 1024  # (before: 128)


def test_the_model_counts_each_further_group():
    # LSTM H 1024 fp16 backward: B 16 and 32 run one kernel (groups of 8 rows; B 8 the whole
    # batch: 2 barriers, 4 gather rounds, docs/design.md). Each further group passes two block
    # barriers and gathers its 8 rows (4 rounds of 8 quads a thread); the product counts the
    # groups' n-tiles.
    from persistent_rnn import latency
    from persistent_rnn.sass_analysis import nvdisasm
    if not nvdisasm():
        pytest.skip("no nvdisasm")
    device = planner.resolve_device("h100")
    steps, terms = {}, {}
    for batch in (16, 32):
        p = planner.make_plan("lstm", 1024, batch, "float16", device).backward
        shape = latency.PassShape(CELLS["lstm"], p, batch, 1024)
        sass = latency.pass_sass(p, device.arch)
        steps[batch], terms[batch] = (latency.step_loop(sass, shape),
                                      latency.step_terms(sass, shape, device))
    assert {b: latency.block_barriers(s) for b, s in steps.items()} == {16: 4, 32: 8}
    assert {b: s.shape.gather_rounds for b, s in steps.items()} == {16: 8, 32: 16}
    assert all(s.groups_head is not None for s in steps.values())
    assert 1.9 <= terms[32].matrix_us / terms[16].matrix_us <= 2.1  # twice the n-tiles
    assert terms[16].total_us < terms[32].total_us
