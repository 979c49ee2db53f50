"""persistent_rnn.torch: drop-in parity with torch.nn (float64), gradcheck, limits, training."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn.torch as prt
from persistent_rnn.stats import RunStats
from persistent_rnn.torch.function import RecurrentFunction
from persistent_rnn.torch.interop import to_array, to_tensor

T, B, I, H = 5, 3, 4, 3
MODES = [("RNN", {"nonlinearity": "tanh"}), ("RNN", {"nonlinearity": "relu"}), ("GRU", {}),
         ("LSTM", {})]
TOL = {"rtol": 1e-9, "atol": 1e-12}


def _pair(mode, kwargs, **ctor):
    """Our module and torch.nn's, with the same (random) parameters, in float64."""
    ours = getattr(prt, mode)(I, H, dtype=torch.float64, **kwargs, **ctor)
    ref = getattr(torch.nn, mode)(I, H, dtype=torch.float64, **kwargs, **ctor)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _inputs(mode, num_layers, bidirectional, gen, batch_first=False):
    shape = (B, T, I) if batch_first else (T, B, I)
    x = torch.randn(*shape, dtype=torch.float64, generator=gen)
    hshape = (num_layers * (2 if bidirectional else 1), B, H)
    h0 = torch.randn(*hshape, dtype=torch.float64, generator=gen)
    hx = (h0, torch.randn(*hshape, dtype=torch.float64, generator=gen)) if mode == "LSTM" else h0
    return x, hx


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _flatten(hx):
    return list(hx) if isinstance(hx, tuple) else [hx]


def _run(module, x, hx, lengths, gen_seed):
    """Forward, then backward of a random projection of every output; returns outputs and grads."""
    x, *h = _leaves(x, *_flatten(hx))
    hx = tuple(h) if len(h) == 2 else h[0]
    inp = x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, hn = module(inp, hx)
    y = out if lengths is None else pad_packed_sequence(out)[0]
    outs = [y, *_flatten(hn)]
    gen = torch.Generator().manual_seed(gen_seed)
    loss = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=gen)).sum() for o in outs)
    loss.backward()
    grads = [x.grad, *[t.grad for t in h]] + [p.grad for p in module.parameters()]
    return outs, grads


@pytest.mark.parametrize("mode,kwargs", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_torch_nn(mode, kwargs, num_layers, bidirectional, packed):
    torch.manual_seed(0)
    ours, ref = _pair(mode, kwargs, num_layers=num_layers, bidirectional=bidirectional)
    gen = torch.Generator().manual_seed(1)
    x, hx = _inputs(mode, num_layers, bidirectional, gen)
    lengths = torch.tensor([3, T, 1]) if packed else None  # unsorted, one full, one of length 1
    got_out, got_grad = _run(ours, x, hx, lengths, 7)
    ref_out, ref_grad = _run(ref, x, hx, lengths, 7)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for g, r in zip(got_out + got_grad, ref_out + ref_grad):
        torch.testing.assert_close(g, r, **TOL)
    assert isinstance(ours.last_run, RunStats)


@pytest.mark.parametrize("mode,kwargs", [MODES[2], MODES[3]], ids=["GRU", "LSTM"])
def test_batch_first_no_bias_and_packed_output_layout(mode, kwargs):
    ours, ref = _pair(mode, kwargs, batch_first=True, bias=False, num_layers=2)
    gen = torch.Generator().manual_seed(2)
    x, hx = _inputs(mode, 2, False, gen, batch_first=True)
    got, _ = _run(ours, x, hx, None, 3)
    want, _ = _run(ref, x, hx, None, 3)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **TOL)
    packed = pack_padded_sequence(x, torch.tensor([2, 5, 4]), batch_first=True, enforce_sorted=False)
    out, _ = ours(packed, hx)
    out_ref, _ = ref(packed, hx)
    torch.testing.assert_close(out.data, out_ref.data, **TOL)
    assert torch.equal(out.batch_sizes, out_ref.batch_sizes)
    assert torch.equal(out.sorted_indices, out_ref.sorted_indices)
    assert torch.equal(out.unsorted_indices, out_ref.unsorted_indices)


def test_default_hidden_state_unbatched_and_noncontiguous_input():
    ours, ref = _pair("LSTM", {}, num_layers=2, bidirectional=True)
    gen = torch.Generator().manual_seed(4)
    x_bt = torch.randn(B, T, I, dtype=torch.float64, generator=gen)
    x = x_bt.transpose(0, 1)  # (T, B, I) view, not contiguous
    assert not x.is_contiguous()
    (y, (hn, cn)), (y_ref, (hn_ref, cn_ref)) = ours(x), ref(x)
    for g, r in [(y, y_ref), (hn, hn_ref), (cn, cn_ref)]:
        torch.testing.assert_close(g, r, **TOL)
    h0 = torch.randn(4, H, dtype=torch.float64, generator=gen)
    x1 = x[:, 0]
    (y, (hn, cn)), (y_ref, (hn_ref, cn_ref)) = ours(x1, (h0, h0)), ref(x1, (h0, h0))
    assert y.shape == (T, 2 * H) and hn.shape == (4, H)
    for g, r in [(y, y_ref), (hn, hn_ref), (cn, cn_ref)]:
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("mode,kwargs", MODES, ids=lambda v: str(v))
def test_gradcheck(mode, kwargs):
    module = getattr(prt, mode)(2, 2, num_layers=2, bidirectional=True, dtype=torch.float64,
                                **kwargs)
    spec = module._spec(batch_first=False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    h0 = torch.randn(4, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    c0 = h0.detach().flip(0).clone().requires_grad_() if mode == "LSTM" else None
    weights = [w.detach().clone().requires_grad_() for w in module._flat_weights]
    lengths = torch.tensor([3, 2])

    def fn(x, h0, c0, *w):
        y, hn, cn, _ = RecurrentFunction.apply(spec, x, lengths, h0, c0, *w)
        return (y, hn) if cn is None else (y, hn, cn)

    assert torch.autograd.gradcheck(fn, (x, h0, c0, *weights), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,kwargs", [MODES[0], MODES[2], MODES[3]], ids=["RNN", "GRU", "LSTM"])
def test_persistent_algo_on_cpu_runs_the_emulated_kernel(mode, kwargs):
    """algo="persistent" on CPU tensors: the CUDA source's CPU emulation, float32, vs torch.nn."""
    torch.manual_seed(0)
    ours = getattr(prt, mode)(I, H, bidirectional=True, algo="persistent", **kwargs)
    ref = getattr(torch.nn, mode)(I, H, bidirectional=True, **kwargs)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(T, B, I)
    lengths = torch.tensor([3, T, 1])
    results = []
    for module in (ours, ref):
        xi = x.clone().requires_grad_()
        out, _ = module(pack_padded_sequence(xi, lengths, enforce_sorted=False))
        y = pad_packed_sequence(out)[0]
        (y * y).sum().backward()
        results.append([y, xi.grad] + [p.grad for p in module.parameters()])
    assert ours.last_run.algo == "persistent" and ours.last_run.emulated
    for g, r in zip(*results):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_double_backward_is_a_clear_error():
    module = prt.GRU(I, H, dtype=torch.float64)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(module(x)[0].pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        gx.sum().backward()


def test_inplace_change_of_weights_before_backward_is_detected():
    module = prt.RNN(I, H, dtype=torch.float64)
    y, _ = module(torch.randn(T, B, I, dtype=torch.float64))
    with torch.no_grad():
        module.weight_hh_l0.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_unsupported_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="dropout must be 0"):
        prt.LSTM(I, H, num_layers=2, dropout=0.5)
    with pytest.raises(ValueError, match="proj_size must be 0"):
        prt.LSTM(I, H, proj_size=2)
    with pytest.raises(ValueError, match="algo must be one of"):
        prt.GRU(I, H, algo="fastest")
    module = prt.GRU(I, H, dtype=torch.float64)
    x = torch.randn(T, B, I, dtype=torch.float64)
    with pytest.raises(ValueError, match="input dtype"):  # torch.nn's own check
        module(x.float())
    with pytest.raises(TypeError, match="hx must have the input's dtype"):
        module(x, torch.zeros(1, B, H))
    with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
        module(torch.randn(T, B, I + 1, dtype=torch.float64))


def test_drop_in_surface():
    ours, ref = prt.LSTM(I, H, num_layers=2, bidirectional=True), torch.nn.LSTM(
        I, H, num_layers=2, bidirectional=True)
    assert isinstance(ours, torch.nn.LSTM)
    assert list(ours.state_dict()) == list(ref.state_dict())
    bound = 1 / H ** 0.5
    assert all(p.abs().max() <= bound for p in ours.parameters())
    assert prt.RNN(I, H, nonlinearity="relu", algo="gemm").algo == "gemm"


def test_dlpack_hand_over_shares_memory():
    t = torch.randn(4, 3)
    a = to_array(t)
    assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr()
    back = to_tensor(a)
    assert back.data_ptr() == t.data_ptr()


def test_small_model_learns_a_synthetic_task():
    """Predict the running sign of the sum of the inputs: the loss drops within 40 steps."""
    torch.manual_seed(0)
    lstm, head = prt.LSTM(1, 16, batch_first=True), torch.nn.Linear(16, 1)
    opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.03)
    x = torch.randn(32, 12, 1)
    target = (x.cumsum(1) > 0).float()
    losses = []
    for _ in range(40):
        opt.zero_grad()
        y, _ = lstm(x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(y), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def _cuda_ready() -> bool:
    try:
        import cupy
        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy or no driver
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA torch, CuPy and a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float64, TOL), (torch.float32,
                                                              {"rtol": 1e-4, "atol": 1e-5})])
@pytest.mark.parametrize("mode,kwargs", [MODES[0], MODES[2], MODES[3]], ids=["RNN", "GRU", "LSTM"])
def test_cuda_matches_torch_nn_on_a_side_stream(mode, kwargs, dtype, tol):
    # the float32 reference must be true float32: cuDNN and cuBLAS default to TF32
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            _cuda_parity(mode, kwargs, dtype, tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32


def _cuda_parity(mode, kwargs, dtype, tol):
    torch.manual_seed(0)
    ours = getattr(prt, mode)(I, H, num_layers=2, bidirectional=True, dtype=dtype, **kwargs).cuda()
    ref = getattr(torch.nn, mode)(I, H, num_layers=2, bidirectional=True, dtype=dtype,
                                  **kwargs).cuda()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(T, B, I, dtype=dtype, device="cuda", requires_grad=True)
    assert to_array(x).data.ptr == x.data_ptr()  # CuPy sees torch's memory, no copy
    lengths = torch.tensor([3, T, 1])
    side = torch.cuda.Stream()
    results = []
    for module in (ours, ref):
        with torch.cuda.stream(side):  # the library must follow torch's current stream
            out, _ = module(pack_padded_sequence(x, lengths, enforce_sorted=False))
            y = pad_packed_sequence(out)[0]
            (gx,) = torch.autograd.grad((y * y).sum(), x)
        side.synchronize()
        results.append((y, gx))
    for g, r in zip(*results):
        torch.testing.assert_close(g, r, **tol)
