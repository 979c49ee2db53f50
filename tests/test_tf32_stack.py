"""TF32 stacks (``settings.allow_tf32``): float32 stacks in stack mode on ``tiles.TF32_STACK_TILES``
(the stack forward's [W_ih | W_hh] rounded to TF32 as mma_tile.cuh's m16n8k8 A fragments, the
backward the fp32 CUDA-core stack backward), through the CPU emulation.

* 2-layer LSTM and GRU stacks and a bidirectional LSTM pair, forward and backward with lengths:
  one launch per pass, ``last_run`` the TF32 stack forward, every result and gradient against the
  float64 stack within docs/api.md's TF32 bound, bitwise run to run.
* One step of a relu RNN stack from a TF32-exact h0, the GEMMs kept fp32: layer 0's h_1 equals
  float64 of W_hh rounded to TF32 up to fp32's sums, and not float64 of W_hh itself (weights left
  unrounded fail it).
* A stall in the forward restarts bitwise identically.
* The planner takes them only with ``allow_tf32`` and from ``plan.TF32_STACK_MIN_BATCH`` rows,
  where the latency model puts the line (``PRNN_TEST_EVERY_KERNEL=1``: the model's figures and
  ``prnn plan --tf32``'s stack-mode line).

CI: all of the above at B 3 (about 15 s). ``PRNN_TEST_EVERY_KERNEL=1``: the Elman stacks too, and
a second n-tile (B 9).
"""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import matmul
from persistent_rnn import plan as planner
from persistent_rnn.cells import layer_args
from full_set import EVERY_KERNEL
from test_mma_stack import _relerr, _run
from test_tf32 import TOLERANCE, _round_tf32

HIDDEN, STEPS = 13, 5
CASES = [("lstm", False), ("gru", False), ("lstm", True)]
if EVERY_KERNEL:
    CASES += [("rnn_tanh", False), ("rnn_relu", True)]
BATCHES = (3, 9) if EVERY_KERNEL else (3,)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def tf32(settings, fresh_plans):
    """TF32 allowed and a generous barrier timeout (the emulated CTAs share two cores)."""
    prnn.configure(emulation_timeout_ms=20_000, allow_tf32=True)


def _layers(name: str, bidirectional: bool):
    mode, kw = layer_args(name)
    make = getattr(prnn, mode)
    layers = 1 if bidirectional else 2
    kern = make(5, HIDDEN, num_layers=layers, bidirectional=bidirectional, algo="persistent",
                seed=5, **kw)
    ref = make(5, HIDDEN, num_layers=layers, bidirectional=bidirectional, dtype="float64",
               algo="gemm", **kw)
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    return kern, ref


def _inputs(layer, batch: int, seed: int = 1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS, batch, 5)).astype(dtype)
    dy = rng.standard_normal((STEPS, batch, layer.directions * HIDDEN)).astype(dtype)
    lengths = [STEPS] + [int(n) for n in rng.integers(1, STEPS + 1, batch - 1)]
    return x, dy, lengths


def _ran_tf32_stack(forward, backward) -> None:
    """One launch per pass: the stack forward on the TF32 tile, the fp32 stack backward."""
    for stats, kernel in ((forward, "prnn_stack_forward"), (backward, "prnn_stack_backward")):
        assert (stats.algo, stats.launches, stats.restarts, stats.fallback) == (
            "persistent", 1, 0, None), stats
        assert kernel in stats.details[-1] and "PRNN_WEIGHT_DTYPE" not in stats.details[-1]
    assert "'PRNN_MMA': 1" in forward.details[-1], forward.details
    assert "PRNN_MMA" not in backward.details[-1], backward.details


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,bidirectional", CASES)
def test_tf32_stack_matches_float64(tf32, name, bidirectional, batch):
    kern, ref = _layers(name, bidirectional)
    x, dy, lengths = _inputs(kern, batch)
    got, fwd, bwd = _run(kern, x, dy, lengths)
    _ran_tf32_stack(fwd, bwd)
    want, _, _ = _run(ref, *_inputs(kern, batch, dtype=np.float64)[:2], lengths)
    for i, (a, r) in enumerate(zip(got, want)):
        assert _relerr(a, r) <= TOLERANCE, i
    fresh = _inputs(kern, batch, seed=2)  # run to run, on fresh inputs: bitwise
    first, again = _run(kern, *fresh)[0], _run(kern, *fresh)[0]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_tf32_stack_rounds_the_weights_to_tf32(tf32, monkeypatch):
    # One step of layer 0 from h0 exact in TF32, the input GEMM fp32: h_1 = relu(W_ih x + b +
    # W_hh h0) with W_hh the kernel's only rounding - float64 of W_hh rounded to TF32 up to
    # fp32's sums, and not float64 of W_hh.
    monkeypatch.setattr(matmul, "tf32_rounded", lambda a, out=None: a)
    kern, ref = _layers("rnn_relu", False)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 3, 5)).astype(np.float32)
    h0 = _round_tf32(rng.standard_normal((2, 3, HIDDEN)).astype(np.float32))
    y, hn = kern.forward(x, h0)
    assert "'PRNN_MMA': 1" in kern.last_run.details[-1] and kern.last_run.launches == 1
    got = np.asarray(hn[0], np.float64)
    w = kern.params["weight_hh_l0"]
    terms = np.abs(h0[0].astype(np.float64)) @ np.abs(w.astype(np.float64)).T \
        + np.abs(x[0].astype(np.float64)) @ np.abs(kern.params["weight_ih_l0"]).T + 1.0
    fp32_sums = 2.0**-20 * terms
    exact = ref.forward(x.astype(np.float64), h0.astype(np.float64))[1][0]
    ref.load_params(dict(ref.params, weight_hh_l0=_round_tf32(w).astype(np.float64)))
    rounded = ref.forward(x.astype(np.float64), h0.astype(np.float64))[1][0]
    assert (np.abs(got - rounded) <= fp32_sums).all()
    assert not (np.abs(got - exact) <= fp32_sums).all()  # TF32's rounding shows


def test_tf32_stack_stall_restarts_bitwise_identically(tf32):
    kern, _ = _layers("lstm", False)
    x, dy, lengths = _inputs(kern, 3, seed=3)
    plain, _, _ = _run(kern, x, dy, lengths)
    prnn.configure(emulation_timeout_ms=300, max_restarts=8)
    with prnn.inject_stall(block=1, step=STEPS // 2, duration_ms=900):
        y, hn = kern.forward(x, lengths=lengths)
    stats = kern.last_run
    assert stats.fallback is None and stats.restarts >= 1 and "'PRNN_MMA': 1" in stats.details[-1]
    for a, b in zip(plain, [y, *hn]):
        np.testing.assert_array_equal(a, np.asarray(b, np.float64))


def test_the_planner_takes_tf32_stack_tiles_only_where_allowed_and_from_their_batch():
    h100 = planner.resolve_device("h100")
    allowed = planner.replace(h100, allow_tf32=True)
    least = planner.TF32_STACK_MIN_BATCH
    for cell, hidden, layers in (("LSTM", 384, 4), ("GRU", 256, 2), ("RNN", 512, 4)):
        for batch in (least - 1, least, 16):
            off = planner.make_stack_plan(cell, hidden, batch, layers, device=h100)
            on = planner.make_stack_plan(cell, hidden, batch, layers, device=allowed)
            assert off.fits and on.fits and not off.tile.mma
            assert on.tile.mma == (batch >= least), (cell, batch)
            if on.tile.mma:
                assert on.forward.defines["PRNN_MMA"] == 1 and "PRNN_MMA" not in on.backward.defines
                assert "PRNN_WEIGHT_DTYPE" not in on.forward.defines
    pair = planner.make_stack_plan("LSTM", 256, 4, 1, bidirectional=True, device=allowed)
    assert pair.fits and pair.tile.mma


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (NVRTC builds of the stack kernels)")
def test_the_model_predicts_tf32_stacks_faster_from_their_batch(capsys):
    from persistent_rnn import latency
    allowed = planner.replace(planner.resolve_device("h100"), allow_tf32=True)
    for batch in (planner.TF32_STACK_MIN_BATCH, 8):
        on, off = (latency.predict_stack_time("LSTM", 384, batch, 4, 100, device=d)
                   for d in (allowed, "h100"))
        assert on.plan.tile.mma and not off.plan.tile.mma
        assert on.forward_us < off.forward_us
    from persistent_rnn import cli
    assert cli.main(["plan", "LSTM", "384", "--batch", "4", "--layers", "4", "--tf32",
                     "--device", "h100"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stack mode"))
    assert "1 launch per pass" in line and "forward on the tensor cores in TF32" in line
