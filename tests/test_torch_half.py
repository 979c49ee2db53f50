"""persistent_rnn.torch with projections and in 16 bits.

* LSTMP modules on the library's GEMM path against ``torch.nn.LSTM(proj_size=P)`` in float64
  (bidirectional stacks, packed input, h0/c0, batch_first) and ``gradcheck``.
* float16/bfloat16 modules on the emulated persistent kernels (the 16-bit CUDA source run on
  the CPU) against torch.nn in float64 on the same 16-bit parameters, within docs/api.md's 16-bit
  tolerances (relative error max |error| / max |reference| <= 5e-3 fp16, 3e-2 bf16).
* autocast (CPU) with ``algo="persistent"``/``"gemm"``: torch.nn's dtypes for every output.
"""
from __future__ import annotations


import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn.torch as prt
from persistent_rnn import override_settings
from persistent_rnn.cells import CELLS, layer_args
from full_set import EVERY_KERNEL

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
I, H, P, T, B = 6, 12, 5, 7, 3
LENGTHS = torch.tensor([T, 2, 5])


def _modules(mode: str, kwargs: dict, algo: str, dtype, **ctor):
    """Our module (``dtype``) and a float64 torch.nn module with the same parameters."""
    ours = getattr(prt, mode)(I, H, algo=algo, **kwargs, **ctor).to(dtype)
    ref = getattr(torch.nn, mode)(I, H, dtype=torch.float64, **kwargs, **ctor)
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    return ours, ref


def _run(module, x, hx, lengths, dtype, seed=3):
    """Outputs and gradients (input, states, parameters) of a random projection of every output,
    with ``x`` / ``hx`` given in ``dtype``."""
    x = x.to(dtype).requires_grad_()
    hx = tuple(h.to(dtype).requires_grad_() for h in hx)
    first = module.batch_first
    inp = x if lengths is None else pack_padded_sequence(x, lengths, first, enforce_sorted=False)
    out, hn = module(inp, hx if len(hx) == 2 else hx[0])
    y = out if lengths is None else pad_packed_sequence(out, first, total_length=T)[0]
    outs = [y, *(hn if isinstance(hn, tuple) else (hn,))]
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    sum((o.double() * w).sum() for o, w in zip(outs, weights)).backward()
    return outs, [x.grad, *(h.grad for h in hx), *(p.grad for p in module.parameters())]


def _states(mode: str, states: int, out: int, gen):
    h0 = torch.randn(states, B, out, generator=gen, dtype=torch.float64)
    return (h0, torch.randn(states, B, H, generator=gen, dtype=torch.float64)) if mode == "LSTM" \
        else (h0,)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_lstmp_gemm_matches_torch_nn_float64(bidirectional, packed, batch_first):
    torch.manual_seed(1)
    ours, ref = _modules("LSTM", {}, "gemm", torch.float64, num_layers=2, proj_size=P,
                         bidirectional=bidirectional, batch_first=batch_first)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, B, I, generator=gen, dtype=torch.float64)
    hx = _states("LSTM", 2 * (2 if bidirectional else 1), P, gen)
    if batch_first:
        x = x.transpose(0, 1)
    lengths = LENGTHS if packed else None
    got, want = (_run(m, x, hx, lengths, torch.float64) for m in (ours, ref))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    assert ours.last_run.algo == "gemm" and ours.last_run.backward.algo == "gemm"


def test_lstmp_gradcheck_on_the_gemm_path():
    torch.manual_seed(4)
    module = prt.LSTM(2, 4, num_layers=2, bidirectional=True, proj_size=3, algo="gemm",
                      dtype=torch.float64)
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(4, 2, 4, dtype=torch.float64, requires_grad=True)
    params = dict(module.named_parameters())

    def f(x, h0, c0, *weights):
        y, (hn, cn) = torch.func.functional_call(module, dict(zip(params, weights)),
                                                 (x, (h0, c0)))
        return y, hn, cn

    assert torch.autograd.gradcheck(f, (x, h0, c0, *params.values()), fast_mode=True)
    assert module.last_run.algo == "gemm"


# CI builds the LSTM's 16-bit kernels in float16 and bfloat16 and the other cells' in float16
# (the rule of tests/test_half_kernels.py: bfloat16 differs in the conversions alone), but for
# the relu RNN (the tanh RNN's tiles with another activation, as in the kernel records);
# PRNN_TEST_EVERY_KERNEL=1 runs every pair.
EMULATED_CASES = [(name, dtype) for name in CELLS for dtype in (torch.float16, torch.bfloat16)
                  if EVERY_KERNEL or (dtype == torch.float16 and name != "rnn_relu")
                  or name == "lstm"]


@pytest.mark.parametrize("name, dtype", EMULATED_CASES, ids=[
    f"{n}-{'fp16' if d == torch.float16 else 'bf16'}" for n, d in EMULATED_CASES])
def test_16_bit_modules_on_the_emulated_persistent_kernels(name, dtype):
    mode, kwargs = layer_args(name)
    torch.manual_seed(5)
    ours, ref = _modules(mode, kwargs, "persistent", dtype, bidirectional=True)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, B, I, generator=gen, dtype=torch.float64).to(dtype).double()
    hx = tuple(h.to(dtype).double() for h in _states(mode, 2, H, gen))
    with override_settings(stack=False):  # the layer kernels (16-bit stacks: test_mma_stack.py)
        got_out, got_grad = _run(ours, x, hx, LENGTHS, dtype)
    want_out, want_grad = _run(ref, x, hx, LENGTHS, torch.float64)
    assert all(t.dtype == dtype for t in got_out + got_grad)
    for a, b in zip(got_out + got_grad, want_out + want_grad):
        err = (a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)
        assert err <= TOLERANCE[dtype]
    run = ours.last_run
    assert run.algo == "persistent" and run.emulated and run.dtype == str(dtype)[6:]
    assert run.backward.algo == "persistent"
    assert f"'PRNN_WEIGHT_DTYPE': {1 if dtype == torch.float16 else 2}" in run.details[0]


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name,proj", [(n, 0) for n in CELLS])
def test_cpu_autocast_follows_torch_nn_dtypes(name, proj, algo):
    """Under CPU autocast our outputs have torch.nn's dtypes (bf16 where torch's CPU autocast
    casts the layer, not GRU; an LSTMP's c_n stays float32) and its values within bf16's
    tolerance; gradients reach the float32 parameters."""
    mode, kwargs = layer_args(name)
    kwargs = dict(kwargs, **({"proj_size": proj} if proj else {}))
    torch.manual_seed(7)
    ours = getattr(prt, mode)(I, H, algo=algo, **kwargs)
    ref = getattr(torch.nn, mode)(I, H, **kwargs)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(T, B, I)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, hn = ours(x)
        out_ref, hn_ref = ref(x)
    got, want = [out, *_tuple(hn)], [out_ref, *_tuple(hn_ref)]
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=TOLERANCE[torch.bfloat16])
    sum(t.float().sum() for t in got).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in ours.parameters())
    assert ours.last_run.algo == algo and ours.last_run.dtype == str(got[0].dtype)[6:]


def test_cpu_autocast_lstmp_follows_torch_nn_dtypes():
    test_cpu_autocast_follows_torch_nn_dtypes("lstm", 3, "gemm")


def _tuple(hn):
    return hn if isinstance(hn, tuple) else (hn,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_results_are_not_reused_by_the_next_call(dtype):
    """A 16-bit module's results are copies in its dtype (the library's float32 results live in
    reused workspaces): a second call, forward and backward, leaves the first call's intact."""
    torch.manual_seed(0)
    gru = prt.GRU(6, 8, algo="gemm").to(dtype)
    x1 = torch.randn(3, 2, 6).to(dtype).requires_grad_()
    x2 = torch.randn(3, 2, 6).to(dtype).requires_grad_()
    y1, h1 = gru(x1)
    y1.float().sum().backward()
    kept = (y1.detach().clone(), h1.detach().clone(), x1.grad.clone())
    y2, h2 = gru(x2)
    (2 * y2.float()).sum().backward()
    assert not torch.equal(y1, y2)
    for before, now in zip(kept, (y1, h1, x1.grad)):
        assert torch.equal(before, now)
