"""persistent_rnn.torch: drop-in parity with torch.nn (float64), gradients, paths, limits, training.

The library's own path (``algo="gemm"``, and the emulated persistent kernel) must equal torch.nn
to float64 round-off; ``algo="auto"`` on CPU tensors runs torch's own kernels and must say so.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn.torch as prt
from persistent_rnn.cells import CELLS, layer_args
from persistent_rnn.torch.interop import to_array, to_tensor

T, B, I, H = 5, 3, 4, 3
MODES = [layer_args(name) for name in CELLS]  # (torch.nn class name, its cell arguments)
IDS = [spec.mode for spec in CELLS.values()]


def modes(*cells: str) -> list:
    """(torch.nn class name, cell arguments) of ``cells``, each with its id: the class name, or
    the class name and nonlinearity where two cells share a class."""
    return [pytest.param(*layer_args(c), id=CELLS[c].mode) for c in cells]
TOL = {"rtol": 1e-9, "atol": 1e-12}


def pair(mode, kwargs, algo="gemm", dtype=torch.float64, **ctor):
    """Our module and torch.nn's, with the same (random) parameters."""
    ours = getattr(prt, mode)(I, H, dtype=dtype, algo=algo, **kwargs, **ctor)
    ref = getattr(torch.nn, mode)(I, H, dtype=dtype, **kwargs, **ctor)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def inputs(mode, num_layers, bidirectional, gen, batch_first=False, dtype=torch.float64):
    shape = (B, T, I) if batch_first else (T, B, I)
    x = torch.randn(*shape, dtype=dtype, generator=gen)
    hshape = (num_layers * (2 if bidirectional else 1), B, H)
    h0 = torch.randn(*hshape, dtype=dtype, generator=gen)
    hx = (h0, torch.randn(*hshape, dtype=dtype, generator=gen)) if mode == "LSTM" else h0
    return x, hx


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _flatten(hx):
    return list(hx) if isinstance(hx, tuple) else [hx]


def run(module, x, hx, lengths, gen_seed):
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


def assert_all_close(got, want, **tol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **(tol or TOL))


@pytest.mark.parametrize("mode,kwargs", MODES, ids=IDS)
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_library_path_matches_torch_nn(mode, kwargs, num_layers, bidirectional, packed):
    torch.manual_seed(0)
    ours, ref = pair(mode, kwargs, num_layers=num_layers, bidirectional=bidirectional)
    gen = torch.Generator().manual_seed(1)
    x, hx = inputs(mode, num_layers, bidirectional, gen)
    lengths = torch.tensor([3, T, 1]) if packed else None  # unsorted, one full, one of length 1
    got_out, got_grad = run(ours, x, hx, lengths, 7)
    ref_out, ref_grad = run(ref, x, hx, lengths, 7)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert_all_close(got_out + got_grad, ref_out + ref_grad)
    run_ = ours.last_run
    assert (run_.algo, run_.fallback, run_.backward.algo) == ("gemm", None, "gemm")


@pytest.mark.parametrize("mode,kwargs", MODES, ids=IDS)
def test_auto_on_cpu_runs_torch_kernels_and_says_so(mode, kwargs):
    torch.manual_seed(0)
    ours, ref = pair(mode, kwargs, algo="auto", num_layers=2, bidirectional=True)
    gen = torch.Generator().manual_seed(1)
    x, hx = inputs(mode, 2, True, gen)
    lengths = torch.tensor([3, T, 1])
    got_out, got_grad = run(ours, x, hx, lengths, 7)
    ref_out, ref_grad = run(ref, x, hx, lengths, 7)
    assert_all_close(got_out + got_grad, ref_out + ref_grad, rtol=0, atol=0)  # the same kernels
    assert ours.last_run.algo == "torch" and "CPU tensors" in ours.last_run.fallback


@pytest.mark.parametrize("mode,kwargs", modes("gru", "lstm"))
def test_batch_first_no_bias_and_packed_output_layout(mode, kwargs):
    ours, ref = pair(mode, kwargs, batch_first=True, bias=False, num_layers=2)
    gen = torch.Generator().manual_seed(2)
    x, hx = inputs(mode, 2, False, gen, batch_first=True)
    got, _ = run(ours, x, hx, None, 3)
    want, _ = run(ref, x, hx, None, 3)
    assert_all_close(got, want)
    packed = pack_padded_sequence(x, torch.tensor([2, 5, 4]), batch_first=True,
                                  enforce_sorted=False)
    out, _ = ours(packed, hx)
    out_ref, _ = ref(packed, hx)
    torch.testing.assert_close(out.data, out_ref.data, **TOL)
    assert torch.equal(out.batch_sizes, out_ref.batch_sizes)
    assert torch.equal(out.sorted_indices, out_ref.sorted_indices)
    assert torch.equal(out.unsorted_indices, out_ref.unsorted_indices)


@pytest.mark.parametrize("mode,kwargs", modes("rnn_tanh", "lstm"))
def test_default_hidden_state_unbatched_and_noncontiguous_input(mode, kwargs):
    ours, ref = pair(mode, kwargs, num_layers=2, bidirectional=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, T, I, dtype=torch.float64, generator=gen).transpose(0, 1)
    assert not x.is_contiguous()
    (y, hn), (y_ref, hn_ref) = ours(x), ref(x)
    assert_all_close([y, *_flatten(hn)], [y_ref, *_flatten(hn_ref)])
    h0 = torch.randn(4, H, dtype=torch.float64, generator=gen)
    hx = (h0, h0.flip(0)) if mode == "LSTM" else h0
    (y, hn), (y_ref, hn_ref) = ours(x[:, 0], hx), ref(x[:, 0], hx)
    assert y.shape == (T, 2 * H) and _flatten(hn)[0].shape == (4, H)
    assert_all_close([y, *_flatten(hn)], [y_ref, *_flatten(hn_ref)])


@pytest.mark.parametrize("mode,kwargs", [*MODES, ("LSTM", {"proj_size": 1})],
                         ids=[*IDS, "LSTMP"])
def test_gradcheck_with_batched_gradients(mode, kwargs):
    """gradcheck of a bidirectional 2-layer stack on the GEMM path in float64 (packed input,
    h0/c0, every weight; LSTMP included) with its batched-gradient check: the backward runs
    under (legacy) vmap."""
    module = getattr(prt, mode)(2, 2, num_layers=2, bidirectional=True, dtype=torch.float64,
                                algo="gemm", **kwargs)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    h0 = torch.randn(4, 2, kwargs.get("proj_size", 2), dtype=torch.float64, generator=gen,
                     requires_grad=True)
    c0 = torch.randn(4, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    hx = (h0, c0) if mode == "LSTM" else h0
    weights = {n: w.detach().clone().requires_grad_() for n, w in module.named_parameters()}
    lengths = torch.tensor([3, 2])

    def fn(x, *state_and_weights):
        state, w = state_and_weights[:len(_flatten(hx))], state_and_weights[len(_flatten(hx)):]
        hx_ = tuple(state) if len(state) == 2 else state[0]
        out, hn = torch.func.functional_call(module, dict(zip(weights, w)),
                                             (pack_padded_sequence(x, lengths), hx_))
        return (pad_packed_sequence(out)[0], *_flatten(hn))

    assert torch.autograd.gradcheck(fn, (x, *_flatten(hx), *weights.values()), eps=1e-6,
                                    atol=1e-7, check_batched_grad=True)


@pytest.mark.parametrize("mode,kwargs", modes("rnn_tanh", "gru", "lstm"))
def test_persistent_algo_on_cpu_runs_the_emulated_kernel(mode, kwargs):
    """algo="persistent" on CPU tensors: the CUDA source's CPU emulation, float32, vs torch.nn."""
    torch.manual_seed(0)
    ours, ref = pair(mode, kwargs, algo="persistent", dtype=torch.float32, bidirectional=True)
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
    assert ours.last_run.backward.algo == "persistent"
    assert_all_close(*results, rtol=1e-4, atol=1e-5)


def test_inplace_change_of_weights_before_backward_is_detected():
    module = prt.RNN(I, H, dtype=torch.float64, algo="gemm")
    y, _ = module(torch.randn(T, B, I, dtype=torch.float64))
    with torch.no_grad():
        module.weight_hh_l0.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_bad_arguments_are_torch_nn_errors_or_clear():
    with pytest.raises(ValueError, match="algo must be one of"):
        prt.GRU(I, H, algo="fastest")
    with pytest.raises(ValueError, match="proj_size argument is only supported for LSTM"):
        prt.GRU(I, H, proj_size=2)
    with pytest.raises(ValueError, match="Unknown nonlinearity"):
        prt.RNN(I, H, nonlinearity="sigmoid")
    for algo in ("auto", "gemm"):
        module = prt.GRU(I, H, dtype=torch.float64, algo=algo)
        x = torch.randn(T, B, I, dtype=torch.float64)
        with pytest.raises((ValueError, RuntimeError), match="dtype"):  # torch.nn's own check
            module(x.float())
        with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
            module(torch.randn(T, B, I + 1, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="Expected hidden size"):
            module(x, torch.zeros(2, B, H, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="hx should also be 2-D but got 3-D tensor"):
            module(x[:, 0], torch.zeros(1, 1, H, dtype=torch.float64))


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("mode,kwargs,proj", [(m, k, 0) for m, k in MODES] + [("LSTM", {}, 2)],
                         ids=[*IDS, "LSTMP"])
def test_states_of_another_dtype_or_device_raise_runtime_error_as_torch_nn(mode, kwargs, proj,
                                                                           algo):
    """h0 (c0) of another dtype than the input, or on another device: torch.nn raises
    RuntimeError (its kernels' messages for the dtype, its own for the device); so does ours,
    naming the state. (Batched, unbatched and packed input take the same check.)"""
    ctor = {"proj_size": proj} if proj else {}
    ours, ref = pair(mode, kwargs, algo=algo, dtype=torch.float32, **ctor)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, B, I, generator=gen)
    width = proj or H

    def states(dtype_h, dtype_c=torch.float32, device="cpu"):
        h = torch.randn(1, B, width, generator=gen).to(dtype_h).to(device)
        return (h, torch.randn(1, B, H, generator=gen).to(dtype_c)) if mode == "LSTM" else h

    calls = [(states(torch.float64), "(hx|h_0) dtype \\(torch.float64\\) does not match")]
    if mode == "LSTM":
        calls.append((states(torch.float32, torch.float64), "c_0 dtype \\(torch.float64\\)"))
    for hx, message in calls:
        for args in ((x, hx), (x[:, 0], _map_states(hx, lambda t: t[:, 0])),
                     (pack_padded_sequence(x, [T, T - 1, 2]), hx)):
            with pytest.raises(RuntimeError):
                ref(*args)
            with pytest.raises(RuntimeError, match=message):
                ours(*args)
    for module in (ours, ref):
        with pytest.raises(RuntimeError, match="Input and hidden tensors are not at the same "
                                               "device, found input tensor at cpu and hidden "
                                               "tensor at meta"):
            module(x, states(torch.float32, device="meta"))


def _map_states(hx, fn):
    return tuple(fn(t) for t in hx) if isinstance(hx, tuple) else fn(hx)


@pytest.mark.parametrize("algo", ["auto", "gemm"])
def test_empty_batch_and_empty_sequence_as_torch_nn(algo):
    ours, ref = pair("LSTM", {}, algo=algo, num_layers=2, bidirectional=True)
    x = torch.randn(T, 0, I, dtype=torch.float64, requires_grad=True)
    y, (hn, cn) = ours(x)
    assert y.shape == (T, 0, 2 * H) and hn.shape == cn.shape == (4, 0, H)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for module in (ours, ref):
        with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0"):
            module(torch.randn(0, B, I, dtype=torch.float64))


def test_library_algos_refuse_what_they_cannot_run():
    x = torch.randn(T, B, I)
    with pytest.raises(ValueError, match="algo='persistent' cannot run this layer: lstm H=4096 "
                                         "proj_size=2 B=3 does not fit"):
        prt.LSTM(I, 4096, proj_size=2, algo="persistent")(x)
    with pytest.raises(ValueError, match="algo='gemm' cannot run this layer: dtype torch.int32"):
        prt.GRU(I, H, algo="gemm")(x.int())
    with pytest.raises(ValueError, match="algo='persistent' cannot run this layer"):
        prt.GRU(I, H, algo="persistent", dtype=torch.float64)(x.double())
    module = prt.GRU(I, H, algo="gemm")
    module.algo = "fastest"  # attributes are read at every call
    with pytest.raises(ValueError, match="algo must be one of"):
        module(x)


def test_drop_in_surface():
    ours = prt.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=2, dropout=0.25)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=2, dropout=0.25)
    # not a torch.nn.LSTM subclass on purpose: torch.compile graph-breaks on those
    assert isinstance(ours, torch.nn.RNNBase) and not isinstance(ours, torch.nn.LSTM)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [p.shape for p in ours.parameters()] == [p.shape for p in ref.parameters()]
    assert repr(ours) == repr(ref)
    bound = 1 / H ** 0.5
    assert all(p.abs().max() <= bound for p in ours.parameters())
    rnn = prt.RNN(I, H, 1, "relu", False, True)  # torch.nn's positional form
    assert (rnn.mode, rnn.nonlinearity, rnn.bias, rnn.batch_first, rnn.algo) == (
        "RNN_RELU", "relu", False, True, "auto")


def test_dlpack_hand_over_shares_memory():
    t = torch.randn(4, 3)
    a = to_array(t)
    assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr()
    back = to_tensor(a)
    assert back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("algo", ["auto", "gemm"])
def test_small_model_learns_a_synthetic_task(algo):
    """Predict the running sign of the sum of the inputs: the loss drops within 40 steps."""
    torch.manual_seed(0)
    lstm, head = prt.LSTM(1, 16, batch_first=True, algo=algo), torch.nn.Linear(16, 1)
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


def test_nan_in_padding_reaches_no_result():
    """Packed semantics: what lies past a sequence's length is never read (the library selects it
    out, the module pads with zeros), so NaN there changes nothing, gradients included."""
    from persistent_rnn.torch import ops

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(T, 2, I, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = [torch.randn(s, dtype=torch.float64, generator=gen, requires_grad=True)
               for s in ops._weight_shapes("GRU", I, H, H, 2, True, True)]
    lengths = torch.tensor([T, 2])
    results = []
    for fill in (0.0, float("nan")):
        xi = x.detach().clone()
        xi[2:, 1] = fill
        xi.requires_grad_()
        y, hn, _ = ops.run_recurrence(xi, lengths, None, None, weights, "GRU", 2, True, "gemm",
                                      (-1, 0, 1))
        grads = torch.autograd.grad((y.sum() + hn.sum()), [xi, *weights])
        results.append([y, hn, grads[0][:, 0], grads[0][:2, 1], *grads[1:]])
    assert_all_close(*results)
