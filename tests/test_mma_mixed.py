"""16-bit layers whose forward runs on the grid's tensor-core tile and whose backward on another
tile (``plan._mma_forward``, ``plan.GROUPED_MMA_BACKWARD``; docs/design.md, "Tensor-core tiles"):
where no tensor-core tile holds both passes' whole batch in shared memory but a CUDA-core grid
tile does (GRU H <= 512 at B 31-33 and H <= 128 at B 34-64, the Elman RNN H 528-1024 at B 46-51
on an H100):

* the plans (pure Python): the mma forward (in batch groups where the whole batch does not fit),
  the GRU's backward the float32 layer's, widened (the CUDA-core 16-bit one is predicted slower),
  the Elman RNN's the mma tile's in batch groups; every other plan as without the rule;
* the planned mix through the CPU emulation (GRU H 16 B 32 fp16 on the emulated H100: the forward
  one CTA of the mma tile's 16 units, the backward four of the fp32 tile's 4, widened): the layer's
  16-bit results against the float64 layer within docs/api.md's 16-bit bounds and the 16-bit GEMM
  path within one rounding, the fp32 gradients against float64 along the run's own states within
  tests/test_mma_backward.py's ``FP32_BOUND``, each pass on its own tile with no fallback;
* the SASS of the planned passes (NVRTC, sm_90): zero spills, no stack frame, no local memory,
  HMMA in the time loop of the passes on the tensor cores.

tests/test_half_plan.py holds the latency model to the rule's two sides. CI: the plans (the
others' on an H100, H by 128), the GRU fp16 emulated, the SASS of GRU H 256 B 32 and RNN H 768
B 48 on sm_90; ``PRNN_TEST_EVERY_KERNEL=1``: bf16 emulated too, the others' plans on an A100
too (H by 64, B 1-64), and the SASS of every pass the rule plans on an H100 and an A100 (H 16,
32 and by 64, B 22-64, fp16 and bf16: 72 configurations) on sm_90 and sm_80.
"""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner
from persistent_rnn.cells import CELLS

from campaign import relerr
from full_set import EVERY_KERNEL
from test_mma_backward import (FP32_BOUND, _backward, emulation,  # noqa: F401 (a fixture)
                               layer_within_the_16bit_bounds)

# (cell, H, B) of the rule's shapes on an H100, with whether each pass is in batch groups
MIXED = [("gru", 16, 32, False, False), ("gru", 128, 32, False, False),
         ("gru", 256, 32, False, False), ("gru", 512, 31, False, False),
         ("gru", 128, 48, False, False), ("gru", 128, 64, True, False),
         ("rnn_tanh", 528, 46, False, True), ("rnn_tanh", 768, 48, True, True),
         ("rnn_tanh", 1024, 51, True, True)]


def _without_the_rule(monkeypatch, *args) -> planner.Plan:
    with monkeypatch.context() as m:
        m.setattr(planner, "_mma_forward", lambda plan, *_: plan)
        return planner.make_plan(*args)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cell,hidden,batch,forward_groups,backward_groups", MIXED)
def test_the_mma_forward_beside_the_planned_backward(monkeypatch, cell, hidden, batch,
                                                     forward_groups, backward_groups, dtype):
    p = planner.make_plan(cell, hidden, batch, dtype, "h100")
    before = _without_the_rule(monkeypatch, cell, hidden, batch, dtype, "h100")
    assert p.fits and before.fits and not before.tile.mma and not before.tile.cluster
    assert p.tile.mma and not p.tile.cluster and p.tile.units == 16
    assert p.forward.defines["PRNN_MMA"] == 1 and p.forward.grid == -(-hidden // 16)
    assert ("PRNN_BATCH_GROUP" in p.forward.defines) == forward_groups
    assert ("PRNN_BATCH_GROUP" in p.backward.defines) == backward_groups
    grouped = CELLS[cell].tiles in planner.GROUPED_MMA_BACKWARD
    assert grouped == backward_groups
    if grouped:  # the mma tile's backward, in batch groups
        assert p.backward.defines["PRNN_MMA"] == 2 and p.backward.grid == p.forward.grid
    else:  # the float32 layer's, widened (the fp32 kernel itself: W_hh^T widened by its copy)
        wide = planner.make_plan(cell, hidden, batch, "float32", "h100")
        assert p.backward == wide.backward and "PRNN_WEIGHT_DTYPE" not in p.backward.defines
        assert "PRNN_WEIGHT_DTYPE" in before.backward.defines  # (the CUDA-core 16-bit tile's)
    assert p.in_batch_groups == (forward_groups or backward_groups)


def test_every_other_plan_is_unchanged(monkeypatch):
    # fp32 (TF32 too), and 16-bit shapes that plan a tensor-core tile, a cluster or no tile
    # without the rule, plan as before; with it, a CUDA-core grid tile only where no mma forward
    # fits. CI: an H100, H by 128, the batches around the rule's lines; the full set: an A100 too,
    # H by 64, B 1-64.
    devices, hiddens, batches = ("h100",), range(128, 2561, 128), (2, 4, 16, 24, 31, 33, 46, 48, 64)
    if EVERY_KERNEL:
        devices, hiddens, batches = ("h100", "a100"), range(64, 2561, 64), range(1, 65)
    changed = set()
    for device in devices:
        for dtype in ("float16", "float32"):
            for cell in ("lstm", "gru", "rnn_tanh"):
                for batch in batches:
                    for hidden in hiddens:
                        args = (cell, hidden, batch, dtype, device)
                        p, before = planner.make_plan(*args), _without_the_rule(monkeypatch, *args)
                        if p != before:
                            changed.add(args)
                            assert dtype == "float16" and not before.tile.mma, args
                            assert not before.tile.cluster and p.tile.mma, args
    assert {("gru", 256, 31, "float16", "h100"), ("rnn_tanh", 768, 48, "float16", "h100")} <= changed


def _ran(stats, units: int, mma: int) -> None:
    """The pass ran persistently (emulated, no fallback) on the tile of ``units`` units a CTA,
    with ``-D PRNN_MMA`` ``mma`` (0: none)."""
    assert stats.algo == "persistent" and stats.emulated and stats.fallback is None, stats
    assert f"'PRNN_UNITS': {units}," in stats.details[0], stats.details
    assert (f"'PRNN_MMA': {mma}" in stats.details[0]) == bool(mma), stats.details
    assert "PRNN_CLUSTER" not in stats.details[0] and "PRNN_BATCH_GROUP" not in stats.details[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"] if EVERY_KERNEL else ["float16"])
def test_the_planned_mix_within_the_16bit_bounds(emulation, dtype):  # noqa: F811
    # GRU H 16 B 32 as planned for the emulated H100 (the emulation fixture's lower mma batches
    # change nothing at B 32): the forward on the mma tile, the backward on the fp32 tile
    hidden, batch = 16, 32
    p = planner.make_plan("gru", hidden, batch, dtype, prnn.runtime.EMULATED_DEVICE)
    assert p.tile.mma and p.forward.grid == 1 and p.backward.grid == 4
    kern = layer_within_the_16bit_bounds("gru", dtype, hidden, batch)
    _ran(kern.last_run, units=4, mma=0)
    kern.forward(np.zeros((2, batch, 5), kern.dtype))
    _ran(kern.last_run, units=16, mma=1)
    got, want, stats = _backward("gru", dtype, hidden, batch)
    _ran(stats, units=4, mma=0)
    for key, ref in want.items():
        assert relerr(got[key], ref) <= FP32_BOUND, key



def test_the_planned_passes_compile_clean(monkeypatch):
    # The configurations the rule plans - CI: GRU H 256 B 32 (an mma forward of the whole batch
    # beside the fp32 backward) and RNN H 768 B 48 (both passes in batch groups), fp16,
    # sm_90; the full set: every shape of the rule on an H100 and an A100 (H 16, 32 and by 64,
    # B 22-64), both 16-bit dtypes, sm_90 and sm_80 - compile with zero spills, no stack frame,
    # no local memory, the block barriers of the grid (two more in the loop of the groups), HMMA
    # in the time loop of the passes on the tensor cores and only there.
    from persistent_rnn import kernel_report, sass_analysis
    tool = sass_analysis.nvdisasm() or pytest.skip("no nvdisasm")
    shapes = [("gru", 256, 32, "float16", "h100"), ("rnn_tanh", 768, 48, "float16", "h100")]
    archs = ("sm_90",)
    if EVERY_KERNEL:
        shapes = [(c, h, b, d, dev) for dev in ("h100", "a100") for d in ("float16", "bfloat16")
                  for c in ("gru", "rnn_tanh") for b in range(22, 65)
                  for h in (16, 32, *range(64, 1025, 64))]
        archs = ("sm_90", "sm_80")
    jobs = {}
    for cell, *args in shapes:
        p = planner.make_plan(cell, *args)
        if p == _without_the_rule(monkeypatch, cell, *args):
            continue
        for pp in (p.forward, p.backward):
            for arch in archs:
                jobs.setdefault((tuple(sorted(pp.defines.items())), pp.source, arch),
                                kernel_report.Job(CELLS[cell], args[2], pp, arch, 0, "mma grid"))
    assert len(jobs) >= 2 * len(archs)
    for job in jobs.values():
        r = kernel_report._record(job, tool)
        loop, c = r["time_loop"], r["config"]
        assert r["spill_bytes"] == 0 and r["stack_frame"] == 0 and r["local_memory"] == 0, r
        assert 0 < r["registers"] <= r["planned_registers"], r
        assert 1 <= loop["block_barriers"] <= 2 + 2 * ("PRNN_BATCH_GROUP" in c), r
        assert (loop["tensor_core_mma"] > 0) == bool(c.get("PRNN_MMA")), r
