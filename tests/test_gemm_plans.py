"""The GEMM path's planned calls (``gemm_plans``): bitwise the full path's results and gradients,
through the layer API and the torch modules; which calls they serve and which they leave to the
full path (and its checks)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import persistent_rnn as prnn
import persistent_rnn.torch as prt
from persistent_rnn import functional, gemm_plans
from persistent_rnn.cells import CELLS, layer_args

H, INPUT, T, B = 6, 5, 4, 3


class _Planned:
    """Counts the forwards ``GemmPlan`` ran and the full path's."""

    def __init__(self, monkeypatch):
        self.planned = self.full = 0
        planned, full = gemm_plans.GemmPlan.forward, functional.forward

        def counted_planned(plan, *args):
            self.planned += 1
            return planned(plan, *args)

        def counted_full(*args, **kwargs):
            self.full += 1
            return full(*args, **kwargs)
        monkeypatch.setattr(gemm_plans.GemmPlan, "forward", counted_planned)
        monkeypatch.setattr(functional, "forward", counted_full)


def _layer(cell: str, dtype: str = "float32", **kwargs):
    mode, extra = layer_args(cell)
    return getattr(prnn, mode)(INPUT, H, algo="gemm", seed=1, dtype=dtype, **extra, **kwargs)


def _results(layer, x, dy, hx) -> list[np.ndarray]:
    layer.zero_grad()
    y, hn = layer.forward(x, hx)
    dx, dhx = layer.backward(dy)
    flat = [y, dx]
    for state in (hn, dhx):
        flat += list(state) if isinstance(state, tuple) else [state]
    return [np.array(a) for a in flat] + [g.copy() for g in layer.grads.values()]


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("states", [False, True])
def test_planned_gemm_calls_equal_full_calls_bitwise(monkeypatch, cell, dtype, states):
    """Calls 3 on of a signature run planned (two full calls plan it), each on fresh random
    input and after the weights were stepped in place: bitwise the full path's results and
    gradients, forward and backward, with or without initial states."""
    rng = np.random.default_rng(7)
    planned, full = _layer(cell, dtype), _layer(cell, dtype)
    hits = _Planned(monkeypatch)
    for call in range(5):
        x = rng.standard_normal((T, B, INPUT)).astype(dtype)
        dy = rng.standard_normal((T, B, H)).astype(dtype)
        hx = None
        if states:
            h = rng.standard_normal((1, B, H)).astype(dtype)
            hx = (h, rng.standard_normal((1, B, H)).astype(dtype)) if CELLS[cell].has_cell_state \
                else h
        full._plan = None  # (the reference never plans)
        for a, b in zip(_results(planned, x, dy, hx), _results(full, x, dy, hx)):
            np.testing.assert_array_equal(a, b)
        for layer in (planned, full):  # an optimizer's step: in place, the same arrays
            for name, w in layer.params.items():
                w -= 0.1 * layer.grads[name]
    assert hits.planned == 3 and hits.full == 5 + 2


@pytest.mark.parametrize("options", [{"batch_first": True}, {"bias": False}],
                         ids=["batch-first", "no-bias"])
def test_batch_first_and_biasless_planned_gemm_calls_equal_full_calls(monkeypatch, options):
    rng = np.random.default_rng(3)
    planned, full = _layer("gru", **options), _layer("gru", **options)
    shape = (B, T, INPUT) if options.get("batch_first") else (T, B, INPUT)
    hits = _Planned(monkeypatch)
    for _ in range(4):
        x = rng.standard_normal(shape).astype(np.float32)
        dy = rng.standard_normal(shape[:2] + (H,)).astype(np.float32)
        full._plan = None
        for a, b in zip(_results(planned, x, dy, None), _results(full, x, dy, None)):
            np.testing.assert_array_equal(a, b)
    assert hits.planned == 2


def test_what_a_gemm_plan_does_not_serve_takes_the_full_path(monkeypatch):
    """Another shape, initial states given after calls without, a state of the wrong shape (the
    full path's error), new weight arrays over other memory, lengths: the full path."""
    rng = np.random.default_rng(5)
    layer = _layer("lstm")
    x = rng.standard_normal((T, B, INPUT)).astype(np.float32)
    layer.forward(x)
    layer.forward(x)
    hits = _Planned(monkeypatch)
    layer.forward(x)
    assert (hits.planned, hits.full) == (1, 0)
    layer.forward(x[:2])
    state = np.zeros((1, B, H), np.float32)
    layer.forward(x, (state, state))
    with pytest.raises(ValueError, match="hx"):
        layer.forward(x, (state[:, :2], state))
    layer.forward(x, lengths=np.array([T, 2, 1]))
    assert (hits.planned, hits.full) == (1, 3)
    layer.forward(x)  # (the plan kept: those calls planned nothing)
    assert (hits.planned, hits.full) == (2, 3)
    layer.params["weight_hh_l0"] = layer.params["weight_hh_l0"].copy()
    layer.forward(x)  # (planned again, over the new array)
    assert (hits.planned, hits.full) == (2, 4)
    layer.forward(x)
    assert (hits.planned, hits.full) == (3, 4)


def test_a_planned_calls_output_is_the_callers(monkeypatch):
    """What a planned call returns is a new array (as the full path's): writing into it changes
    no gradient of the backward, which reads the forward's own buffers."""
    rng = np.random.default_rng(6)
    planned, full = _layer("gru"), _layer("gru")
    x = rng.standard_normal((T, B, INPUT)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)
    hits = _Planned(monkeypatch)
    for layer in (planned, full):
        for _ in range(3):
            full._plan = None  # (the reference never plans)
            layer.zero_grad()
            y, hn = layer.forward(x)
            y[...], hn[...] = 7.0, 7.0
            dx, _ = layer.backward(dy)
    assert hits.planned == 1
    for name in planned.grads:
        np.testing.assert_array_equal(planned.grads[name], full.grads[name])


def test_only_calls_that_asked_for_the_gemm_path_are_planned(monkeypatch):
    """``algo="auto"`` (and any projection, 16-bit or multi-layer call) keeps the full path."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((T, B, INPUT)).astype(np.float32)
    hits = _Planned(monkeypatch)
    for layer in (prnn.GRU(INPUT, H, algo="auto", seed=1), _layer("lstm", proj_size=2),
                  _layer("gru", "float16"), _layer("gru", num_layers=2),
                  _layer("gru", bidirectional=True)):
        for _ in range(3):
            layer.forward(x.astype(layer.dtype) if layer.dtype != np.float32 else x)
    assert hits.planned == 0


@pytest.mark.parametrize("mode", ["RNN", "GRU", "LSTM"])
def test_torch_modules_plan_gemm_calls_bitwise(monkeypatch, mode):
    """persistent_rnn.torch's modules with ``algo="gemm"``: planned calls match torch.nn's
    and the full path's bitwise, outputs and gradients, under autograd and without."""
    torch.manual_seed(0)
    planned = getattr(prt, mode)(INPUT, H, algo="gemm")
    full = getattr(prt, mode)(INPUT, H, algo="gemm")
    full.load_state_dict(planned.state_dict())
    hits = _Planned(monkeypatch)
    for call in range(4):
        x = torch.randn(T, B, INPUT, requires_grad=True)
        outs = []
        for module in (planned, full):
            module._record.plan = None if module is full else module._record.plan
            module.zero_grad()
            xi = x.detach().clone().requires_grad_(True)
            y, hn = module(xi)
            (y.sum() + (hn[0] if mode == "LSTM" else hn).square().sum()).backward()
            outs.append([y.detach(), xi.grad] + [p.grad.clone() for p in module.parameters()])
            with torch.no_grad():
                outs[-1].append(module(xi)[0])
                for p in module.parameters():  # an optimizer's step: in place
                    p -= 0.1 * p.grad
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    assert hits.planned >= 4


def test_a_gemm_plan_without_its_bias_is_caught(monkeypatch):
    """Sabotage: a plan that leaves out ``b_ih`` (its full path's ``gi += b_ih``) differs."""
    rng = np.random.default_rng(4)
    real = gemm_plans.GemmPlan.forward

    def biasless(plan, *args):
        saved, plan.b_ih = plan.b_ih, None
        try:
            return real(plan, *args)
        finally:
            plan.b_ih = saved
    monkeypatch.setattr(gemm_plans.GemmPlan, "forward", biasless)
    planned, full = _layer("gru"), _layer("gru")
    x = rng.standard_normal((T, B, INPUT)).astype(np.float32)
    for _ in range(2):
        planned.forward(x)
    full._plan = None
    assert not np.array_equal(planned.forward(x)[0], full.forward(x)[0])
