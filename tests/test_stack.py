"""A whole stack through the CPU emulation: progress read once per forward and once per backward,
a restart in one layer reruns the layers after it with bitwise-identical results, plans and
engines cached across calls, and parameters updated in place never served stale."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import launch, plan as planner

pytestmark = pytest.mark.timeout(300)


def _data(layer, steps=5, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, batch, layer.input_size)).astype(np.float32)
    dy = rng.standard_normal((steps, batch, layer.hidden_size * layer.directions)).astype(np.float32)
    return x, dy


def _run(layer, x, dy, lengths=None):
    layer.zero_grad()
    y, hn = layer.forward(x, lengths=lengths)
    fwd = layer.last_run
    dx, dhx = layer.backward(dy)
    flat = [y, *(hn if isinstance(hn, tuple) else [hn]), dx,
            *(dhx if isinstance(dhx, tuple) else [dhx]), *layer.grads.values()]
    return [a.copy() for a in flat], fwd, layer.last_run


def test_nothing_is_read_back_during_a_call(settings):
    prnn.configure(stack=False)  # one launch per layer-direction (stack mode: test_stack_kernel)
    layer = prnn.GRU(3, 16, num_layers=3, bidirectional=True, algo="persistent", seed=0)
    x, dy = _data(layer)
    with launch.counting() as n:
        _, fwd, bwd = _run(layer, x, dy, lengths=[5, 3])
        assert n.host_syncs == 0  # restarts and completion of all 3 x 2 layer-directions: device
    assert fwd.algo == bwd.algo == "persistent" and fwd.restarts == bwd.restarts == 0
    assert fwd.launches == bwd.launches == 6


@pytest.mark.parametrize("mode", ["LSTM", "RNN"])
def test_each_layer_restarts_on_the_device_with_identical_results(settings, grid_path, mode):
    prnn.configure(emulation_timeout_ms=300, stack=False)  # one launch per layer (not stack mode)
    layer = getattr(prnn, mode)(3, 16, num_layers=3, algo="persistent", seed=1)
    x, dy = _data(layer, seed=2)
    plain, _, _ = _run(layer, x, dy)
    # The stall hits the first launch of every layer-direction: each restarts once on the device
    # (the layers above consume only completed output: stream order).
    with prnn.inject_stall(block=1, step=2, duration_ms=900):
        stalled, fwd, bwd = _run(layer, x, dy)
    for a, b in zip(plain, stalled):
        np.testing.assert_array_equal(a, b)
    for stats in (fwd, bwd):
        assert stats.restarts == 3 and stats.fallback is None and stats.launches == 6


def test_plans_and_engines_are_built_once(monkeypatch, fresh_plans, settings):
    prnn.configure(stack=False)  # the layer kernels' plans (stack mode: test_stack_kernel)
    calls = []
    make_plan = planner.make_plan
    monkeypatch.setattr(planner, "make_plan", lambda *a, **k: calls.append(a[1:3]) or make_plan(*a, **k))
    layer = prnn.LSTM(3, 16, num_layers=2, bidirectional=True, algo="persistent", seed=0)
    x, dy = _data(layer)
    for _ in range(3):
        _run(layer, x, dy)
    assert calls == [(16, 2), (16, 2)]  # forward and backward pass, once for all layers and calls


def test_weights_updated_in_place_are_used(settings):
    persistent = prnn.LSTM(3, 16, algo="persistent", seed=0)
    reference = prnn.LSTM(3, 16, algo="gemm", dtype="float64", seed=0)
    x, dy = _data(persistent, seed=4)
    _run(persistent, x, dy)
    for layer in (persistent, reference):  # an optimizer step: in place, same arrays
        layer.params["weight_hh_l0"] *= np.float32(-0.5)
    got, _, _ = _run(persistent, x, dy)
    ref, _, _ = _run(reference, x.astype(np.float64), dy.astype(np.float64))
    for a, b in zip(got, ref):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
