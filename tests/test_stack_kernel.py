"""Stack mode: the planner places every layer of a unidirectional stack in one launch (and the
two directions of a bidirectional layer side by side) where their weights fit the register
files together; the wavefront kernels (``cuda_src/stack_*.cu``) run the stack through the CPU
emulation against the float64 GEMM path, with stalls in any layer and CTAs that are not
co-resident."""
from __future__ import annotations


import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner
from full_set import EVERY_KERNEL


pytestmark = pytest.mark.timeout(600)


def test_four_lstm_layers_of_384_fit_one_launch_on_an_h100():
    p = planner.make_stack_plan("LSTM", 384, 4, 4, device="h100")
    assert p.fits and p.launches == 1 and p.reason is None
    for pp in (p.forward, p.backward):
        assert pp.grid <= 132 and pp.grid % 4 == 0 and pp.source.startswith("stack_")
        assert pp.shared_bytes <= planner.resolve_device("h100").shared_per_block
    # each layer's CTAs hold [W_ih | W_hh] (forward) and [W_hh^T | W_ih^T of the layer above]
    units = p.tile.units
    assert p.forward.weights_per_thread * p.forward.block * (p.forward.grid // 4) >= 8 * 384 * 384
    assert units * (p.forward.grid // 4) >= 384


def test_a_stack_pass_waits_through_t_plus_l_minus_1_steps():
    """The wavefront's depth, the hook of the latency model: 4 layers of 100 steps wait through
    103 step latencies in stack mode against 400 in four launches (0.26x at equal step time)."""
    stack = planner.make_stack_plan("LSTM", 384, 4, 4, device="h100")
    apart = planner.make_stack_plan("LSTM", 1024, 4, 4, device="h100")
    assert (stack.steps_in_series(100), apart.steps_in_series(100)) == (103, 400)
    bidir = planner.make_stack_plan("GRU", 64, 2, 3, bidirectional=True, device="h100")
    assert bidir.steps_in_series(100) == 300  # against 600 for six launches


def test_stacks_that_do_not_fit_run_one_launch_per_layer_with_the_reason():
    big = planner.make_stack_plan("LSTM", 1024, 4, 3, device="h100")
    assert not big.fits and big.launches == 3 and "do not fit" in big.reason
    many = planner.make_stack_plan("LSTM", 384, 4, 6, device="h100")  # 6 x 32 CTAs > 132 SMs
    assert not many.fits and "SMs" in many.reason
    bidir = planner.make_stack_plan("GRU", 64, 2, 3, bidirectional=True, device="h100")
    assert bidir.fits and bidir.launches == 3 and bidir.forward.grid == 2 * 64 // bidir.tile.units
    big_bidir = planner.make_stack_plan("LSTM", 1024, 2, 3, bidirectional=True, device="h100")
    assert not big_bidir.fits and big_bidir.launches == 6 and "two directions" in big_bidir.reason
    wide = planner.make_stack_plan("GRU", 64, 2, 3, dtype="float64", device="h100")
    assert not wide.fits and "float64" in wide.reason
    with pytest.raises(ValueError, match="layers"):
        planner.make_stack_plan("GRU", 64, 2, 0, device="h100")


def test_launches_count_one_per_layer_direction_without_stack_mode(settings):
    prnn.configure(stack=False)
    layer = prnn.GRU(3, 16, num_layers=2, bidirectional=True, algo="persistent", seed=0)
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    layer.forward(x)
    assert layer.last_run.launches == 4
    gemm = prnn.GRU(3, 16, num_layers=2, algo="gemm", seed=0)
    gemm.forward(x)
    assert gemm.last_run.launches == 0


STEPS, BATCH, HIDDEN, LAYERS = 8, 2, 64, 3
LENGTHS = [8, 5]
CTAS_PER_LAYER = HIDDEN // 4  # the emulated H100 plans the 4-unit stack tile at H = 64


def _layers(mode, seed=0):
    persistent = getattr(prnn, mode)(5, HIDDEN, num_layers=LAYERS, algo="persistent", seed=seed)
    reference = getattr(prnn, mode)(5, HIDDEN, num_layers=LAYERS, algo="gemm", dtype="float64",
                                    seed=seed)
    return persistent, reference


def _inputs(mode, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS, BATCH, 5)).astype(np.float32)
    state = lambda: 0.5 * rng.standard_normal((LAYERS, BATCH, HIDDEN)).astype(np.float32)  # noqa: E731
    hx = (state(), state()) if mode == "LSTM" else state()
    dy = rng.standard_normal((STEPS, BATCH, HIDDEN)).astype(np.float32)
    dhn = (state(), state()) if mode == "LSTM" else state()
    return x, hx, dy, dhn


def _as64(a):
    return tuple(_as64(v) for v in a) if isinstance(a, tuple) else a.astype(np.float64)


def _flat(*arrays):
    out = []
    for a in arrays:
        out += _flat(*a) if isinstance(a, (tuple, list)) else [a.copy()]
    return out


def _forward(layer, x, hx):
    y, hn = layer.forward(x, hx, lengths=LENGTHS)
    return _flat(y, hn), layer.last_run


def _assert_close(got, ref, rtol=1e-5):
    for a, b in zip(got, ref):
        scale = max(np.abs(b).max(), 1e-30)
        assert np.abs(a - b).max() <= rtol * scale, np.abs(a - b).max() / scale


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_stack_forward_runs_in_one_launch_and_matches_float64(settings, mode):
    layer, reference = _layers(mode)
    x, hx, _, _ = _inputs(mode)
    got, stats = _forward(layer, x, hx)
    assert (stats.algo, stats.launches, stats.restarts, stats.fallback) == ("persistent", 1, 0, None)
    assert "prnn_stack_forward" in stats.details[-1]
    ref, _ = _forward(reference, x.astype(np.float64), _as64(hx))
    _assert_close(got, ref)
    with prnn.override_settings(stack=False):  # one launch per layer: the same results
        apart, per_layer = _forward(layer, x, hx)
    assert per_layer.launches == LAYERS
    _assert_close(got, apart, 1e-6)


def _stall_cases(mode):
    """(layer, step) of each stall: four spread over the stack; the LSTM's every layer at the
    first, a middle and the last step with PRNN_TEST_EVERY_KERNEL=1 (each case is a whole
    emulated pass: the full set is most of these tests' time)."""
    if mode == "LSTM" and EVERY_KERNEL:
        return [(layer, step) for layer in range(LAYERS) for step in (0, STEPS // 2, STEPS - 1)]
    return [(0, 0), (1, STEPS // 2), (2, STEPS - 1), (1, STEPS - 1)]


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_stack_forward_stalls_give_bitwise_identical_results(settings, mode):
    # Restarts replay bitwise; only the completion after the restart cap would not. The virtual
    # clock has no spurious timeouts, so a few restarts suffice (each is a launch in the chain).
    prnn.configure(emulation_timeout_ms=300, max_restarts=8)
    layer, _ = _layers(mode, seed=2)
    x, hx, _, _ = _inputs(mode, seed=3)
    plain, _ = _forward(layer, x, hx)
    for stalled_layer, step in _stall_cases(mode):
        block = stalled_layer * CTAS_PER_LAYER + 1
        with prnn.inject_stall(block=block, step=step, duration_ms=900):
            stalled, stats = _forward(layer, x, hx)
        for a, b in zip(plain, stalled):
            np.testing.assert_array_equal(a, b)
        assert stats.fallback is None and stats.launches == 1 + stats.restarts
        if (stalled_layer, step) != (LAYERS - 1, STEPS - 1):  # nobody waits on the very last step
            assert stats.restarts >= 1, (stalled_layer, step)


def test_stack_forward_layers_need_not_be_co_resident(settings):
    """With room for one layer's CTAs at a time, each layer finds the one below complete in the
    exchange (a slot per step): no timeout at all."""
    prnn.configure(emulation_max_resident=CTAS_PER_LAYER)
    layer, _ = _layers("GRU", seed=4)
    x, hx, _, _ = _inputs("GRU", seed=5)
    held, stats = _forward(layer, x, hx)
    assert (stats.launches, stats.restarts) == (1, 0)
    prnn.configure(emulation_max_resident=None)
    free, _ = _forward(layer, x, hx)
    for a, b in zip(held, free):
        np.testing.assert_array_equal(a, b)


def test_stack_forward_finishes_every_layer_on_the_completion_after_the_restart_cap(settings):
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=6, max_restarts=1)
    layer, reference = _layers("LSTM", seed=6)
    x, hx, _, _ = _inputs("LSTM", seed=7)
    got, stats = _forward(layer, x, hx)
    assert stats.restarts == 1 and stats.launches == 2
    assert "completion kernel" in stats.fallback and "layer 2" in stats.fallback
    ref, _ = _forward(reference, x.astype(np.float64), _as64(hx))
    _assert_close(got, ref)


def _backward(layer, x, hx, dy, dhn, stall=None):
    """Forward (undisturbed), then backward (under ``stall``): the gradients and their stats."""
    layer.zero_grad()
    layer.forward(x, hx, lengths=LENGTHS)
    if stall is None:
        dx, dhx = layer.backward(dy, dhn)
    else:
        with prnn.inject_stall(**stall):
            dx, dhx = layer.backward(dy, dhn)
    return _flat(dx, dhx, list(layer.grads.values())), layer.last_run


def _backward64(reference, x, hx, dy, dhn):
    return _backward(reference, x.astype(np.float64), _as64(hx), dy.astype(np.float64),
                     _as64(dhn))[0]


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_stack_backward_runs_in_one_launch_and_matches_float64(settings, mode):
    layer, reference = _layers(mode, seed=8)
    x, hx, dy, dhn = _inputs(mode, seed=9)
    got, stats = _backward(layer, x, hx, dy, dhn)
    assert (stats.algo, stats.launches, stats.restarts, stats.fallback) == ("persistent", 1, 0, None)
    assert "prnn_stack_backward" in stats.details[-1]
    _assert_close(got, _backward64(reference, x, hx, dy, dhn))


# (CI: the LSTM's, the stack backward's largest kernel; every cell in the full set - the stall
# and restart code is the same stack kernel for all)
@pytest.mark.parametrize("mode", ["LSTM"] + (["GRU", "RNN"] if EVERY_KERNEL else []))
def test_stack_backward_stalls_give_bitwise_identical_results(settings, mode):
    prnn.configure(emulation_timeout_ms=300, max_restarts=8)  # as for the forward
    layer, _ = _layers(mode, seed=10)
    x, hx, dy, dhn = _inputs(mode, seed=11)
    plain, _ = _backward(layer, x, hx, dy, dhn)
    for stalled_layer, step in _stall_cases(mode):
        stall = dict(block=stalled_layer * CTAS_PER_LAYER + 1, step=step, duration_ms=900)
        stalled, stats = _backward(layer, x, hx, dy, dhn, stall)
        for a, b in zip(plain, stalled):
            np.testing.assert_array_equal(a, b)
        assert stats.fallback is None and stats.launches == 1 + stats.restarts
        if (stalled_layer, step) != (0, 0):  # the backward's very last step: nobody waits on it
            assert stats.restarts >= 1, (stalled_layer, step)


def test_stack_backward_finishes_every_layer_on_the_completion_after_the_restart_cap(settings):
    layer, reference = _layers("GRU", seed=12)
    x, hx, dy, dhn = _inputs("GRU", seed=13)
    layer.zero_grad()
    layer.forward(x, hx, lengths=LENGTHS)
    with prnn.override_settings(emulation_timeout_ms=200, emulation_max_resident=6, max_restarts=1):
        dx, dhx = layer.backward(dy, dhn)
    stats = layer.last_run
    assert stats.restarts == 1 and stats.launches == 2 and "layer 0" in stats.fallback
    _assert_close(_flat(dx, dhx, list(layer.grads.values())),
                  _backward64(reference, x, hx, dy, dhn))


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_bidirectional_layers_run_both_directions_in_one_launch(settings, mode):
    layer = getattr(prnn, mode)(5, HIDDEN, num_layers=2, bidirectional=True, algo="persistent",
                                seed=14)
    reference = getattr(prnn, mode)(5, HIDDEN, num_layers=2, bidirectional=True, algo="gemm",
                                    dtype="float64", seed=14)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((STEPS, BATCH, 5)).astype(np.float32)
    dy = rng.standard_normal((STEPS, BATCH, 2 * HIDDEN)).astype(np.float32)

    def run(net, x, dy, stall=None):
        net.zero_grad()
        y, hn = net.forward(x, lengths=LENGTHS)
        forward = net.last_run
        if stall is None:
            dx, dhx = net.backward(dy)
        else:
            with prnn.inject_stall(**stall):
                dx, dhx = net.backward(dy)
        return _flat(y, hn, dx, dhx, list(net.grads.values())), forward, net.last_run

    got, fwd, bwd = run(layer, x, dy)
    for stats, kernel in ((fwd, "prnn_stack_forward"), (bwd, "prnn_stack_backward")):
        assert (stats.algo, stats.launches, stats.restarts) == ("persistent", 2, 0)  # one per layer
        assert kernel in stats.details[-1] and "both directions" in stats.details[-1]
    _assert_close(got, run(reference, x.astype(np.float64), dy.astype(np.float64))[0])
    # A stall in the reverse direction's CTA 1 of the top layer's backward, at a middle step.
    prnn.configure(emulation_timeout_ms=300, max_restarts=8)
    stalled, _, bwd = run(layer, x, dy, dict(block=CTAS_PER_LAYER + 1, step=STEPS // 2,
                                             duration_ms=900))
    assert bwd.restarts >= 1 and bwd.fallback is None
    for a, b in zip(got, stalled):
        np.testing.assert_array_equal(a, b)


def test_predicted_stack_forward_is_at_most_half_of_four_launches():
    """The latency model's prediction (not a measurement) for 4 LSTM layers of 384, T = 100,
    B = 4 on an H100: the wavefront (103 steps of the stack kernel's heavier step) against four
    single-layer launches of 100 steps each (0.45x forward since the per-call host work overlaps
    the GPU and is no longer counted per launch: issue 26)."""
    latency = pytest.importorskip("persistent_rnn.latency")
    st = latency.predict_stack_time("LSTM", 384, 4, 4, 100, device="h100")
    assert st.plan.fits and st.plan.launches == 1
    assert st.forward_us <= 0.5 * st.apart_forward_us, (st.forward_us, st.apart_forward_us)
    assert st.backward_us < st.apart_backward_us
    record = latency.plan_report("LSTM", 384, 4, 4, device="h100")["stack_mode"]
    assert record["fits"] and record["launches_per_pass"] == 1 and record["prediction"]
    assert record["forward_pass_us"] == st.forward_us


@pytest.mark.parametrize("mode, layers, bidirectional", [("RNN", 2, False), ("GRU", 4, False),
                                                         ("LSTM", 1, True)])
def test_stacks_of_other_depths_match_float64(settings, mode, layers, bidirectional):
    make = getattr(prnn, mode)
    layer = make(3, 32, num_layers=layers, bidirectional=bidirectional, algo="persistent", seed=16)
    reference = make(3, 32, num_layers=layers, bidirectional=bidirectional, algo="gemm",
                     dtype="float64", seed=16)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((6, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((6, 3, 32 * (1 + bidirectional))).astype(np.float32)

    def run(net, x, dy):
        net.zero_grad()
        y, hn = net.forward(x, lengths=[6, 2, 5])
        forward = net.last_run
        dx, dhx = net.backward(dy)
        return _flat(y, hn, dx, dhx, list(net.grads.values())), forward, net.last_run

    got, fwd, bwd = run(layer, x, dy)
    for stats in (fwd, bwd):
        assert stats.launches == (layers if bidirectional else 1) and stats.restarts == 0
    _assert_close(got, run(reference, x.astype(np.float64), dy.astype(np.float64))[0])
