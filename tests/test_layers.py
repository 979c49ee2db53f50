"""Layers against torch.nn on the CPU: outputs, final states and every gradient.

Each case loads the same weights into a ``persistent_rnn`` layer and a ``torch.nn`` module, runs
both on the same fresh random input (lengths through ``pack_padded_sequence`` with
``enforce_sorted=False``), back-propagates the same random ``dy``/``dhn`` and compares
relative errors (max |ours - torch| / max |torch|): <= 1e-10 in float64, <= 1e-5 in float32.
Also: finite differences, accumulation, device/dtype rules of the layer class.

``run_pair`` and ``compare`` are reused by ``test_properties.py`` and ``test_gpu_gemm.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn as prnn

TOL = {"float64": 1e-10, "float32": 1e-5}


def make_layer(mode: str, I: int, H: int, dtype: str = "float64", **kw):
    """A persistent_rnn layer and a torch.nn module with the same (torch-initialised) weights."""
    nonlinearity = kw.pop("nonlinearity", "tanh")
    extra = {"nonlinearity": nonlinearity} if mode == "RNN" else {}
    ref = getattr(torch.nn, mode)(I, H, **kw, **extra).double()
    ours = getattr(prnn, mode)(I, H, **kw, **extra, dtype=dtype, algo="gemm")
    ours.load_params({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    return ours, ref


def random_inputs(layer, B: int, T: int, rng: np.random.Generator, lengths: bool, hx: bool):
    """x, hx (or None), lengths (unsorted, or None) in the layer's dtype and layout."""
    D = 2 if layer.bidirectional else 1
    shape = (B, T, layer.input_size) if layer.batch_first else (T, B, layer.input_size)
    x = rng.standard_normal(shape).astype(layer.dtype)
    state = None
    if hx:
        hs = [rng.standard_normal((layer.num_layers * D, B, layer.hidden_size)).astype(layer.dtype)
              for _ in range(2 if isinstance(layer, prnn.LSTM) else 1)]
        state = tuple(hs) if isinstance(layer, prnn.LSTM) else hs[0]
    lens = None
    if lengths:
        lens = rng.integers(1, T + 1, size=B)
        lens[rng.integers(B)] = T  # torch's padded output has T steps only if one sequence does
    return x, state, lens


def torch_run(ref, x, hx, lengths, dy, dhn, batch_first: bool):
    """torch.nn forward + backward in float64: (y, hn, dx, dhx, grads) as NumPy."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    states = None
    if hx is not None:
        states = [torch.tensor(h, dtype=torch.float64, requires_grad=True)
                  for h in (hx if isinstance(hx, tuple) else (hx,))]
    arg = None if states is None else (tuple(states) if len(states) == 2 else states[0])
    ref.zero_grad()
    if lengths is None:
        y, hn = ref(xt, arg)
    else:
        packed = pack_padded_sequence(xt, torch.tensor(lengths), batch_first=batch_first,
                                      enforce_sorted=False)
        y, hn = ref(packed, arg)
        steps = x.shape[1 if batch_first else 0]
        y, _ = pad_packed_sequence(y, batch_first=batch_first, total_length=steps)
    hns = hn if isinstance(hn, tuple) else (hn,)
    dhns = dhn if isinstance(dhn, tuple) else (dhn,)
    loss = (y * torch.tensor(dy)).sum() + sum((h * torch.tensor(d)).sum()
                                              for h, d in zip(hns, dhns))
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    dhx = None if states is None else tuple(s.grad.numpy() for s in states)
    return (y.detach().numpy(), tuple(h.detach().numpy() for h in hns), xt.grad.numpy(), dhx,
            grads)


def relerr(ours, ref) -> float:
    """max |ours - ref| / max |ref| (absolute if ref is all zeros)."""
    ours = ours.get() if hasattr(ours, "get") else np.asarray(ours)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = float(np.abs(ref).max(initial=0.0))
    err = float(np.abs(ours.astype(np.float64) - ref).max(initial=0.0))
    return err / scale if scale > 0 else err


def run_pair(ours, ref, B, T, rng, lengths=True, hx=True, xp=np):
    """Run both; return {name: relative error} over y, hn, dx, dhx and every gradient."""
    x, state, lens = random_inputs(ours, B, T, rng, lengths, hx)
    D = 2 if ours.bidirectional else 1
    yshape = (B, T, D * ours.hidden_size) if ours.batch_first else (T, B, D * ours.hidden_size)
    dy = rng.standard_normal(yshape).astype(ours.dtype)
    hshape = (ours.num_layers * D, B, ours.hidden_size)
    dhn = tuple(rng.standard_normal(hshape).astype(ours.dtype)
                for _ in range(2 if isinstance(ours, prnn.LSTM) else 1))
    dhn = dhn if isinstance(ours, prnn.LSTM) else dhn[0]
    ty, thn, tdx, tdhx, tgrads = torch_run(ref, x, state, lens, dy, dhn, ours.batch_first)

    def dev(a):  # onto the device under test (lengths stay on the host, like torch's)
        if a is None or xp is np:
            return a
        return tuple(xp.asarray(v) for v in a) if isinstance(a, tuple) else xp.asarray(a)

    ours.zero_grad()
    y, hn = ours.forward(dev(x), dev(state), lens)
    dx, dhx = ours.backward(dev(dy), dev(dhn))
    hns = hn if isinstance(hn, tuple) else (hn,)
    dhxs = dhx if isinstance(dhx, tuple) else (dhx,)
    errs = {"y": relerr(y, ty), "dx": relerr(dx, tdx)}
    errs.update({f"hn[{i}]": relerr(a, b) for i, (a, b) in enumerate(zip(hns, thn))})
    if tdhx is not None:
        errs.update({f"dhx[{i}]": relerr(a, b) for i, (a, b) in enumerate(zip(dhxs, tdhx))})
    errs.update({k: relerr(ours.grads[k], g) for k, g in tgrads.items()})
    assert set(ours.grads) == set(tgrads)
    return errs


def compare(errs: dict, dtype: str) -> None:
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL[dtype], f"{worst}: relative error {errs[worst]:.3g} > {TOL[dtype]}"


# mode, kwargs, B, T, I, H, lengths
CASES = [
    ("RNN", dict(), 1, 1, 3, 5, False),
    ("RNN", dict(nonlinearity="relu", num_layers=2), 4, 9, 4, 7, True),
    ("RNN", dict(bidirectional=True, batch_first=True, bias=False), 3, 12, 2, 6, True),
    ("GRU", dict(), 8, 50, 5, 9, True),
    ("GRU", dict(num_layers=3, bidirectional=True), 2, 7, 3, 5, False),
    ("GRU", dict(batch_first=True, bias=False, num_layers=2), 5, 6, 4, 3, True),
    ("LSTM", dict(), 1, 20, 2, 11, True),
    ("LSTM", dict(num_layers=2, bidirectional=True), 6, 10, 3, 7, True),  # unsorted lengths
    ("LSTM", dict(num_layers=3, batch_first=True), 3, 5, 6, 4, False),
    ("LSTM", dict(bidirectional=True, bias=False), 7, 1, 3, 13, True),
]


@pytest.mark.parametrize("mode,kw,B,T,I,H,lengths", CASES)
def test_parity_float64(mode, kw, B, T, I, H, lengths):
    ours, ref = make_layer(mode, I, H, "float64", **kw)
    errs = run_pair(ours, ref, B, T, np.random.default_rng(B * 100 + T), lengths=lengths)
    compare(errs, "float64")


@pytest.mark.parametrize("mode,kw", [("RNN", dict(bidirectional=True)),
                                     ("GRU", dict(num_layers=2)),
                                     ("LSTM", dict(num_layers=2, bidirectional=True))])
def test_parity_float32(mode, kw):
    ours, ref = make_layer(mode, 4, 9, "float32", **kw)
    errs = run_pair(ours, ref, 4, 12, np.random.default_rng(7))
    compare(errs, "float32")
    assert ours.params["weight_hh_l0"].dtype == np.float32


def test_unsorted_lengths_two_layer_bidirectional_lstm():
    """Sequences of every length, shuffled: the reverse direction runs within each length."""
    ours, ref = make_layer("LSTM", 3, 5, "float64", num_layers=2, bidirectional=True)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 4, 3))
    lens = np.array([3, 8, 1, 5])
    y, (h, c) = ours.forward(x, lengths=lens)
    ty, thn, *_ = torch_run(ref, x, None, lens, np.zeros_like(y), (np.zeros_like(h),) * 2, False)
    assert relerr(y, ty) <= 1e-10 and relerr(h, thn[0]) <= 1e-10 and relerr(c, thn[1]) <= 1e-10
    assert np.all(y[3:, 0] == 0) and np.all(y[1:, 2] == 0) and np.any(y[2, 0] != 0)


def _loss(layer, x, hx, lens, dy, dhn):
    y, hn = layer.forward(x, hx, lens)
    hns, dhns = (hn, dhn) if isinstance(hn, tuple) else ((hn,), (dhn,))
    return float((y * dy).sum() + sum((h * d).sum() for h, d in zip(hns, dhns)))


@pytest.mark.parametrize("mode", ["RNN", "GRU", "LSTM"])
def test_finite_differences(mode):
    """Central differences on random coordinates of x, h0 and every parameter (float64)."""
    rng = np.random.default_rng(11)
    layer = getattr(prnn, mode)(3, 4, num_layers=2, bidirectional=True, dtype="float64", seed=5)
    x, hx, lens = random_inputs(layer, 3, 6, rng, lengths=True, hx=True)
    y, hn = layer.forward(x, hx, lens)
    dy = rng.standard_normal(y.shape)
    dhn = tuple(rng.standard_normal(h.shape) for h in hn) if mode == "LSTM" else \
        rng.standard_normal(hn.shape)
    dx, dhx = layer.backward(dy, dhn)
    h0 = hx[0] if mode == "LSTM" else hx
    dh0 = dhx[0] if mode == "LSTM" else dhx
    targets = [("x", x, dx), ("h0", h0, dh0)] + [(k, layer.params[k], layer.grads[k])
                                                 for k in layer.params]
    eps = 1e-6
    for name, arr, grad in targets:
        for _ in range(2):
            idx = tuple(rng.integers(s) for s in arr.shape)
            old = arr[idx]
            arr[idx] = old + eps
            up = _loss(layer, x, hx, lens, dy, dhn)
            arr[idx] = old - eps
            down = _loss(layer, x, hx, lens, dy, dhn)
            arr[idx] = old
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - grad[idx]) <= 1e-6 * max(1.0, abs(numeric)), (name, idx)


def test_backward_accumulates_and_zero_grad():
    layer = prnn.GRU(3, 4, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((5, 2, 3))
    y, _ = layer.forward(x)
    layer.backward(np.ones_like(y))
    once = {k: g.copy() for k, g in layer.grads.items()}
    y, _ = layer.forward(x)
    layer.backward(np.ones_like(y))
    for k, g in layer.grads.items():
        np.testing.assert_allclose(g, 2 * once[k], rtol=1e-12)
    layer.zero_grad()
    assert all(not g.any() for g in layer.grads.values())


def test_params_follow_torch_names_shapes_and_init():
    layer = prnn.LSTM(3, 16, num_layers=2, bidirectional=True, seed=1)
    ref = torch.nn.LSTM(3, 16, num_layers=2, bidirectional=True)
    assert list(layer.params) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert layer.params[k].shape == tuple(v.shape) and layer.params[k].dtype == np.float32
        assert np.abs(layer.params[k]).max() <= 0.25  # U(-1/sqrt(16), 1/sqrt(16))
    assert np.abs(layer.params["weight_hh_l0"]).max() > 0.2  # not all tiny
    again = prnn.LSTM(3, 16, num_layers=2, bidirectional=True, seed=1)
    assert all(np.array_equal(layer.params[k], again.params[k]) for k in layer.params)
    assert set(prnn.RNN(2, 3, bias=False).params) == {"weight_ih_l0", "weight_hh_l0"}


def test_non_contiguous_input_and_last_run():
    layer = prnn.RNN(3, 4, dtype="float64", seed=2)
    base = np.random.default_rng(1).standard_normal((3, 6, 5))
    x = base.transpose(1, 0, 2)[:, :, ::2][:, :, :3]  # (6, 3, 3) strided view
    y, hn = layer.forward(x)
    y2, hn2 = layer.forward(np.ascontiguousarray(x))
    np.testing.assert_array_equal(y, y2)
    assert layer.last_run.algo == "gemm" and layer.last_run.restarts == 0
    assert layer.last_run.fallback is None
