"""cells.py (the NumPy reference every path mirrors) against torch.nn's single-step cells."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from persistent_rnn.cells import CELLS, cell_spec, layer_args

B, I, H = 4, 3, 6


def torch_cell(name: str) -> torch.nn.Module:
    """torch.nn's single-step cell of ``name`` (``torch.nn.RNNCell(I, H, nonlinearity=...)``)."""
    mode, kwargs = layer_args(name)
    return getattr(torch.nn, f"{mode}Cell")(I, H, **kwargs)


@pytest.mark.parametrize("name", sorted(n for n, spec in CELLS.items() if spec.in_torch))
def test_step_matches_torch_cell(name):
    torch.manual_seed(0)
    cell, ref = CELLS[name], torch_cell(name).double()
    rng = np.random.default_rng(0)
    x, h_prev, c_prev = (rng.standard_normal(s) for s in ((B, I), (B, H), (B, H)))
    w_ih, w_hh, b_ih, b_hh = (p.detach().numpy() for p in
                              (ref.weight_ih, ref.weight_hh, ref.bias_ih, ref.bias_hh))
    gi, gh = x @ w_ih.T + b_ih, h_prev @ w_hh.T + b_hh
    h, c, saved = cell.forward(np, gi, gh, h_prev, c_prev if cell.has_cell_state else None)
    assert saved.shape == (B, cell.saved * H)

    xt, ht, ct = (torch.tensor(a, requires_grad=True) for a in (x, h_prev, c_prev))
    out = ref(xt, (ht, ct)) if cell.has_cell_state else ref(xt, ht)
    h_ref, c_ref = out if cell.has_cell_state else (out, None)
    np.testing.assert_allclose(h, h_ref.detach().numpy(), rtol=1e-13, atol=1e-14)
    if cell.has_cell_state:
        np.testing.assert_allclose(c, c_ref.detach().numpy(), rtol=1e-13, atol=1e-14)

    # backward: gradients of the pre-activations reproduce torch's weight and state gradients
    dh, dc = rng.standard_normal((B, H)), rng.standard_normal((B, H))
    loss = (h_ref * torch.tensor(dh)).sum() + (
        (c_ref * torch.tensor(dc)).sum() if cell.has_cell_state else 0)
    loss.backward()
    dgi, dgh, dh_direct, dc_prev = cell.backward(
        np, dh, dc if cell.has_cell_state else None, saved, h, c, h_prev,
        c_prev if cell.has_cell_state else None)
    np.testing.assert_allclose(dgi.T @ x, ref.weight_ih.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dgh.T @ h_prev, ref.weight_hh.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dgi @ w_ih, xt.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dh_direct + dgh @ w_hh, ht.grad.numpy(), rtol=1e-12, atol=1e-13)
    if cell.has_cell_state:
        np.testing.assert_allclose(dc_prev, ct.grad.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_backward_is_the_gradient_of_the_forward(name):
    """Every cell, torch.nn's or not: the backward's dgi, dgh, direct dh_prev and dc_prev are the
    central differences of ``sum(dh * h) + sum(dc * c)`` in gi, gh, h_prev and c_prev (float64)."""
    cell, rng = CELLS[name], np.random.default_rng(1)
    gi, gh = rng.standard_normal((B, cell.gates * H)), rng.standard_normal((B, cell.gates * H))
    h_prev, c_prev, dh, dc = (rng.standard_normal((B, H)) for _ in range(4))
    if not cell.has_cell_state:
        c_prev = dc = None

    def loss(gi, gh, h_prev, c_prev):
        h, c, _ = cell.forward(np, gi, gh, h_prev, c_prev)
        return (dh * h).sum() + ((dc * c).sum() if cell.has_cell_state else 0.0)

    def numeric(k):
        args, grad, eps = [gi, gh, h_prev, c_prev], np.zeros_like((gi, gh, h_prev, c_prev)[k]), 1e-6
        for idx in np.ndindex(grad.shape):
            step = np.zeros_like(grad)
            step[idx] = eps
            up, down = list(args), list(args)
            up[k], down[k] = args[k] + step, args[k] - step
            grad[idx] = (loss(*up) - loss(*down)) / (2 * eps)
        return grad

    h, c, saved = cell.forward(np, gi, gh, h_prev, c_prev)
    got = cell.backward(np, dh, dc, saved, h, c, h_prev, c_prev)
    for k, g in enumerate(got if cell.has_cell_state else got[:3]):
        np.testing.assert_allclose(g, numeric(k), rtol=1e-6, atol=1e-8, err_msg=str(k))


def test_cell_spec_lookup():
    assert cell_spec("rnn", "relu") is CELLS["rnn_relu"]
    assert cell_spec("LSTM").gates == 4 and cell_spec("GRU").gates == 3
    with pytest.raises(ValueError, match="nonlinearity"):
        cell_spec("RNN", "gelu")
    with pytest.raises(ValueError, match="mode"):
        cell_spec("QRNN")


def _cuda_cells() -> tuple[dict[str, int], dict[str, tuple[int, int, bool]]]:
    """``prnn::CellKind``'s enumerators and each ``Cell<KIND>``'s (G, S, has_c), read from
    cells.cuh: its own body, or the body of the template it derives from (``ElmanCell<Act>``)."""
    import re

    from persistent_rnn._sources import read_source

    src = read_source("cells.cuh")
    enum = re.search(r"enum\s+CellKind\s*\{([^}]*)\}", src).group(1)
    kinds = {k.strip(): int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", enum)}
    bodies = dict(re.findall(r"struct\s+(\w+)\s*\{(.*?)\n\};", src, re.S))
    shapes = {}
    for kind, base, body in re.findall(
            r"struct\s+Cell<(\w+)>\s*(?::\s*(\w+)<\w+>\s*)?\{(.*?)\};", src, re.S):
        body = bodies[base] if base else body
        gates = re.search(r"constexpr int G = (\d+)", body).group(1)
        saved = re.search(r"constexpr int S = (\d+)", body).group(1)
        has_c = re.search(r"constexpr bool has_c = (true|false)", body).group(1)
        shapes[kind] = (int(gates), int(saved), has_c == "true")
    return kinds, shapes


def test_registry_matches_the_cuda_cells():
    """Each ``CellSpec.kind`` is the CUDA ``CellKind`` of the same name and its ``Cell<>`` has
    the spec's gates, saved activations and cell state: a mismatch would run another cell's
    math."""
    kinds, shapes = _cuda_cells()
    assert kinds == {spec.mode: spec.kind for spec in CELLS.values()}
    assert shapes == {spec.mode: (spec.gates, spec.saved, spec.has_cell_state)
                      for spec in CELLS.values()}


def test_names_and_messages_derive_from_the_registry():
    from persistent_rnn import plan, validation
    from persistent_rnn.cells import LAYER_MODES, NONLINEARITIES, from_mode, resolve

    assert LAYER_MODES == ("RNN", "LSTM", "GRU") and NONLINEARITIES == ("tanh", "relu")
    assert validation.NONLINEARITIES is NONLINEARITIES
    assert resolve("RNN") is CELLS["rnn_tanh"] and plan.resolve_cell("Gru") is CELLS["gru"]
    for spec in CELLS.values():
        assert from_mode(spec.mode) is spec and resolve(spec.name.upper()) is spec
    with pytest.raises(ValueError, match="'RNN', 'LSTM', 'GRU', 'rnn_tanh'.*got 'lstmp'"):
        resolve("lstmp")
    with pytest.raises(ValueError, match="nonlinearity must be one of 'tanh', 'relu'"):
        cell_spec("RNN", "gelu")
