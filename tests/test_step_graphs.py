"""The GEMM path replayed from recorded step loops (``step_graphs``): on the CPU with a stand-in
for CUDA's stream capture (the recorded loop is simply re-run over the workspace), which checks
the bookkeeping: every input copied in, every output copied out, one recording per
configuration, the first call direct, the cache bounded. ``test_gpu_gemm.py`` repeats the
comparison with real CUDA graphs."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import buffers, gemm, step_graphs
from persistent_rnn.cells import CELLS


@pytest.fixture
def fake_capture(monkeypatch):
    """NumPy arrays take the graph path; ``recorded`` lists each recording's name."""
    recorded = []

    def capture(xp, issue):
        recorded.append(1)
        return issue

    monkeypatch.setattr(step_graphs, "eligible", lambda xp: True)
    monkeypatch.setattr(step_graphs, "_where", lambda xp: (0, 0))
    monkeypatch.setattr(step_graphs, "_private_memory", lambda xp: contextlib.nullcontext())
    monkeypatch.setattr(step_graphs, "_capture", capture)
    step_graphs.clear()
    with prnn.override_settings(gemm_graphs=True):
        yield recorded
    step_graphs.clear()


def _case(cell, rng, steps=6, batch=3, hidden=5):
    g = cell.gates
    f = (lambda *s: rng.standard_normal(s))  # noqa: E731
    return dict(gi=f(steps, batch, g * hidden), w_hh=f(g * hidden, hidden) * 0.3, b_hh=f(g * hidden),
                h0=f(batch, hidden), c0=f(batch, hidden) if cell.has_cell_state else None,
                lengths=np.array([steps, 2, 4][:batch], np.int32), dy=f(steps, batch, hidden),
                dhn=f(batch, hidden), dcn=f(batch, hidden) if cell.has_cell_state else None)


def _both(cell, a):
    y, cs, saved = buffers.allocate_forward(cell, a["gi"])
    gemm.forward_steps(cell, a["gi"], a["w_hh"], a["b_hh"], a["h0"], a["c0"], a["lengths"], y, cs,
                       saved, start=0)
    xp = buffers.array_module(y)
    dy = a["dy"] * (xp.arange(len(y))[:, None] < a["lengths"][None, :])[:, :, None]
    dgi, dgh = buffers.allocate_backward(cell, dy)
    dh0, dc0 = gemm.backward_steps(cell, dy, a["w_hh"], a["h0"], a["c0"], a["lengths"], y, cs,
                                   saved, dgi, dgh, a["dhn"], a["dcn"], stop=len(y))
    return [r for r in (y, cs, saved, dgi, dgh, dh0, dc0) if r is not None]


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_relu"])
def test_replays_equal_direct_runs_on_fresh_inputs(fake_capture, name):
    cell, rng = CELLS[name], np.random.default_rng(0)
    cases = [_case(cell, rng) for _ in range(4)]
    with prnn.override_settings(gemm_graphs=False):
        direct = [_both(cell, a) for a in cases]
    for a, want in zip(cases, direct):  # call 1 direct, call 2 records, 3 and 4 replay
        for got, ref in zip(_both(cell, a), want):
            np.testing.assert_array_equal(got, ref)
    assert len(fake_capture) == 2  # one forward and one backward recording


def test_one_recording_per_configuration_and_a_bounded_cache(fake_capture, monkeypatch):
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 4)  # two shapes x (forward, backward)
    cell, rng = CELLS["gru"], np.random.default_rng(1)
    for steps in (3, 4, 3, 4, 3, 4):  # two shapes: recorded once each, then replayed
        _both(cell, _case(cell, rng, steps=steps))
    assert len(fake_capture) == 4 and len(step_graphs._entries) == 4
    _both(cell, _case(cell, rng, steps=5))  # a third shape evicts the oldest two
    steps_kept = {key[2][0][1][0][0] for key in step_graphs._entries}  # T of gi / dy
    assert len(step_graphs._entries) == 4 and steps_kept == {4, 5}


def test_partial_passes_and_the_default_run_directly(fake_capture):
    cell, rng = CELLS["lstm"], np.random.default_rng(2)
    a = _case(cell, rng)
    y, cs, saved = (np.zeros_like(b) for b in buffers.allocate_forward(cell, a["gi"]))
    for _ in range(3):  # resumed passes (after a persistent kernel stopped) are never recorded
        gemm.forward_steps(cell, a["gi"], a["w_hh"], a["b_hh"], a["h0"], a["c0"], None, y, cs,
                           saved, start=2)
    with prnn.override_settings(gemm_graphs=False):
        for _ in range(3):
            _both(cell, a)
    assert fake_capture == [] and prnn.Settings().gemm_graphs is False


def test_tf32_loops_run_directly(fake_capture):
    # A recorded loop's products would be matmul.cu's fp32 where the direct loop's are TF32
    # (allow_tf32): with the setting on nothing is recorded, and every call is the direct one.
    cell, rng = CELLS["gru"], np.random.default_rng(3)
    a = _case(cell, rng)
    with prnn.override_settings(allow_tf32=True):
        runs = [_both(cell, a) for _ in range(3)]
    assert fake_capture == []
    for run in runs[1:]:
        for got, ref in zip(run, runs[0]):
            np.testing.assert_array_equal(got, ref)
