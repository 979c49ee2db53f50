"""LSTM projections (``proj_size``) on the GEMM path: the layer API against ``torch.nn.LSTM``
in float64, the GEMM path's resume semantics (``start`` / ``stop`` with carries) and the
arguments' checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import persistent_rnn as prnn
from persistent_rnn import buffers, gemm
from persistent_rnn.cells import CELLS

I, H, P, T, B = 3, 7, 4, 6, 3
LENGTHS = [6, 2, 4]


def _reference(num_layers: int, bidirectional: bool, batch_first: bool = False):
    """A float64 ``torch.nn.LSTM`` with a projection and the library's layer with its weights."""
    ref = torch.nn.LSTM(I, H, num_layers, bidirectional=bidirectional, proj_size=P,
                        batch_first=batch_first, dtype=torch.float64)
    layer = prnn.LSTM(I, H, num_layers, bidirectional=bidirectional, proj_size=P,
                      batch_first=batch_first, dtype="float64", algo="gemm")
    layer.load_params({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    return ref, layer


@pytest.mark.parametrize("num_layers,bidirectional", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("lengths,initial", [(None, False), (LENGTHS, True)])
def test_layer_matches_torch_nn_float64(num_layers, bidirectional, lengths, initial):
    torch.manual_seed(num_layers + 2 * bidirectional)
    ref, layer = _reference(num_layers, bidirectional)
    states = num_layers * (2 if bidirectional else 1)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(states, B, P, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(states, B, H, dtype=torch.float64, requires_grad=True)
    hx = (h0, c0) if initial else None
    if lengths is None:
        y, (hn, cn) = ref(x, hx)
    else:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths),
                                                         enforce_sorted=False)
        y, (hn, cn) = ref(packed, hx)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=T)
    dy, dhn, dcn = torch.randn_like(y), torch.randn_like(hn), torch.randn_like(cn)
    torch.autograd.backward((y, hn, cn), (dy, dhn, dcn))

    out, (h_n, c_n) = layer.forward(x.detach().numpy(),
                                    (h0.detach().numpy(), c0.detach().numpy()) if initial
                                    else None, lengths)
    dx, (dh0, dc0) = layer.backward(dy.numpy(), (dhn.numpy(), dcn.numpy()))
    assert out.shape == (T, B, P * (2 if bidirectional else 1)) and h_n.shape == (states, B, P)
    assert c_n.shape == (states, B, H) and layer.last_run.algo == "gemm"
    for got, want in [(out, y), (h_n, hn), (c_n, cn), (dx, x.grad)]:
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=0, atol=1e-9)
    if initial:
        np.testing.assert_allclose(dh0, h0.grad.numpy(), rtol=0, atol=1e-9)
        np.testing.assert_allclose(dc0, c0.grad.numpy(), rtol=0, atol=1e-9)
    assert set(layer.grads) == set(dict(ref.named_parameters()))
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(layer.grads[name], p.grad.numpy(), rtol=0, atol=1e-9,
                                   err_msg=name)


def test_batch_first_and_parameter_shapes():
    torch.manual_seed(5)
    ref, layer = _reference(2, True, batch_first=True)
    assert layer.param_shapes() == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    x = torch.randn(B, T, I, dtype=torch.float64)
    y, _ = ref(x)
    np.testing.assert_allclose(layer.forward(x.numpy())[0], y.detach().numpy(), rtol=0,
                               atol=1e-9)


def _setup(rng):
    cell = CELLS["lstm"]
    gi = rng.standard_normal((T, B, 4 * H))
    w_hh = rng.standard_normal((4 * H, P)) * 0.4
    w_hr = rng.standard_normal((P, H)) * 0.5
    b_hh = rng.standard_normal(4 * H)
    h0, c0 = rng.standard_normal((B, P)), rng.standard_normal((B, H))
    return cell, gi, w_hh, w_hr, b_hh, h0, c0


def _forward(cell, gi, w_hh, w_hr, b_hh, h0, c0, lengths):
    y, cs, saved = buffers.allocate_forward(cell, gi, P)
    hs = np.empty_like(cs)
    gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=0, w_hr=w_hr,
                       hs=hs)
    return y, cs, saved, hs


def test_forward_resumes_at_start():
    """What a persistent run leaves unfinished, the GEMM path completes bit for bit."""
    rng = np.random.default_rng(1)
    cell, gi, w_hh, w_hr, b_hh, h0, c0 = _setup(rng)
    lengths = np.array(LENGTHS, dtype=np.int32)
    full = _forward(cell, gi, w_hh, w_hr, b_hh, h0, c0, lengths)
    assert full[0].shape == (T, B, P) and full[3].shape == (T, B, H)
    resumed = [np.full_like(a, np.nan) for a in full]
    for a, b in zip(resumed, full):
        a[:3] = b[:3]
    y, cs, saved, hs = resumed
    gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=3, w_hr=w_hr,
                       hs=hs)
    for a, b in zip(resumed, full):
        np.testing.assert_array_equal(a, b)
    for b, n in enumerate(LENGTHS):  # r and c frozen past each length
        assert np.all(full[0][n:, b] == full[0][n - 1, b])
        assert np.all(full[1][n:, b] == full[1][n - 1, b])


def test_backward_split_at_stop():
    """Backward over the top steps, then the rest from their carries: the full gradients."""
    rng = np.random.default_rng(2)
    cell, gi, w_hh, w_hr, b_hh, h0, c0 = _setup(rng)
    lengths = np.array(LENGTHS, dtype=np.int32)
    y, cs, saved, hs = _forward(cell, gi, w_hh, w_hr, b_hh, h0, c0, lengths)
    dy = np.where((np.arange(T)[:, None] < lengths)[:, :, None], rng.standard_normal(y.shape), 0)
    dhn, dcn = rng.standard_normal((B, P)), rng.standard_normal((B, H))

    def run(stop, dh, dc, tail=slice(None), h0=h0, c0=c0, lengths=lengths):
        dgi, _ = buffers.allocate_backward(cell, dy[tail], H)
        drs = np.empty_like(dy[tail])
        dh0, dc0 = gemm.backward_steps(cell, dy[tail], w_hh, h0, c0, lengths, y[tail], cs[tail],
                                       saved[tail], dgi, dgi, dh, dc, stop, w_hr=w_hr,
                                       hs=hs[tail], drs=drs)
        return dgi, drs, dh0, dc0

    dgi, drs, dh0, dc0 = run(T, dhn, dcn)
    past = np.arange(T)[:, None] >= lengths[None, :]
    assert np.all(dgi[past] == 0) and np.all(drs[past] == 0)
    k = 3  # the tail k..T-1 as a run of its own gives the carries reaching r_{k-1}, c_{k-1}
    _, _, top_h, top_c = run(T - k, dhn, dcn, slice(k, T), y[k - 1], cs[k - 1], lengths - k)
    dgi2, drs2, dh0b, dc0b = run(k, top_h, top_c)
    for got, want in [(dgi2[:k], dgi[:k]), (drs2[:k], drs[:k]), (dh0b, dh0), (dc0b, dc0)]:
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def test_auto_runs_gemm_and_says_why_persistent_refuses():
    layer = prnn.LSTM(I, H, proj_size=P, algo="auto", seed=0)
    x = np.random.default_rng(3).standard_normal((T, B, I)).astype(np.float32)
    layer.forward(x)
    assert layer.last_run.algo == "gemm"
    forced = prnn.LSTM(I, H, proj_size=P, algo="persistent", seed=0)
    with pytest.raises(ValueError, match="proj_size"):
        forced.forward(x)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(proj_size=H), ValueError, "proj_size has to be smaller than hidden_size"),
    (dict(proj_size=-1), ValueError, "proj_size should be a positive integer or zero"),
    (dict(proj_size=1.5), TypeError, "proj_size must be an int"),
    (dict(proj_size=True), TypeError, "proj_size must be an int"),
])
def test_bad_proj_size(kwargs, error, match):
    with pytest.raises(error, match=match):
        prnn.LSTM(I, H, **kwargs)


@pytest.mark.parametrize("cls", [prnn.GRU, prnn.RNN])
def test_proj_size_is_lstm_only(cls):
    with pytest.raises(ValueError, match="only supported for LSTM"):
        cls(I, H, proj_size=2)
    assert cls(I, H, proj_size=0).proj_size == 0


def test_state_widths_checked():
    layer = prnn.LSTM(I, H, proj_size=P, dtype="float64")
    x = np.zeros((T, B, I))
    with pytest.raises(ValueError, match=r"hx\[0\].*proj_size"):
        layer.forward(x, (np.zeros((1, B, H)), np.zeros((1, B, H))))
    with pytest.raises(ValueError, match=r"hx\[1\].*hidden_size"):
        layer.forward(x, (np.zeros((1, B, P)), np.zeros((1, B, P))))
