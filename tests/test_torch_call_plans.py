"""The torch modules' planned steady-state call (persistent_rnn.call_plans through
``ops._library_forward`` / ``_library_backward``) on CPU tensors with ``algo="persistent"`` (the
emulated persistent path): bitwise a module that never plans, forward and backward, across
optimizer steps (weights updated in place: new views of the same memory), initial states and
stalls; anything else (other shapes, packed input, new parameters, bad input) takes the full path
with torch.nn's errors. The layer API's plans: tests/test_call_plans.py."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import persistent_rnn as prnn
import persistent_rnn.torch as prt
from persistent_rnn import call_plans, layer_plans, plans, stack_plans

from test_call_plans import SB, SH, SI, ST, _Hits, _StackHits  # (planned calls that ran)

H, I = 16, 3


def _pair(cell: str, device: str = "cpu"):
    """A module that plans and one that never does (its record's plan dropped every call), with
    the same weights, each with its optimizer."""
    torch.manual_seed(0)
    planned = getattr(prt, cell)(I, H, algo="persistent").to(device)
    full = getattr(prt, cell)(I, H, algo="persistent").to(device)
    full.load_state_dict(planned.state_dict())
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (planned, full)]


def _states(cell: str, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(100 + seed)
    h = torch.randn(1, 2, H, generator=g).to(device)
    return h if cell == "GRU" else (h, torch.randn(1, 2, H, generator=g).to(device))


def _train_step(module, optimizer, x, hx, run=lambda backward: backward()) -> list[torch.Tensor]:
    """A forward, a backward of a weighted sum of every output (called through ``run``) and an
    SGD step: the outputs, every gradient (input, states, parameters), copied."""
    optimizer.zero_grad()
    x = x.clone().requires_grad_()
    states = () if hx is None else hx if isinstance(hx, tuple) else (hx,)
    states = tuple(s.clone().requires_grad_() for s in states)
    y, hn = module(x, None if hx is None else states if isinstance(hx, tuple) else states[0])
    hn = hn if isinstance(hn, tuple) else (hn,)
    weights = torch.arange(y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape).sin()
    run((y * weights).sum().backward)
    got = [y.detach().clone(), *(h.detach().clone() for h in hn), x.grad.clone(),
           *(s.grad.clone() for s in states), *(p.grad.clone() for p in module.parameters())]
    optimizer.step()
    return got


def _assert_steps_equal(pairs, cell: str, seeds, states: bool, device: str = "cpu",
                        run=lambda backward: backward()) -> None:
    for seed in seeds:
        x = torch.randn(4, 2, I, generator=torch.Generator().manual_seed(seed)).to(device)
        hx = _states(cell, seed, device) if states else None
        results = []
        for module, optimizer in pairs:
            pairs[1][0]._record.plan = None  # (the reference never plans)
            results.append(_train_step(module, optimizer, x, hx, run))
        for a, b in zip(*results):
            assert torch.equal(a, b)
        assert pairs[0][0].last_run.algo == "persistent"


@pytest.mark.parametrize("states", [False, True], ids=["zeros", "states"])
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_planned_module_calls_equal_full_calls_bitwise(settings, monkeypatch, cell, states):
    """Training steps (forward, backward, SGD's in-place step): planned from the third call on,
    across the steps' new weight views, bitwise the module that never plans."""
    hits = _Hits(monkeypatch)
    pairs = _pair(cell)
    _assert_steps_equal(pairs, cell, range(5), states)
    assert (hits.forwards, hits.backwards) == (3, 2)
    with torch.no_grad():  # (no autograd: the same plan)
        pairs[0][0](torch.randn(4, 2, I), _states(cell, 0) if states else None)
    assert hits.forwards == 4


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_backwards_on_autograds_own_thread_are_planned_too(settings, monkeypatch, cell):
    """torch's autograd runs a CUDA backward on a device thread of its own, outside the caller's
    ``override_settings`` (the H200 run of 2026-11-27: the torch modules' backward never planned
    on CUDA, some 2 ms of Python a training step). The same steps, every backward on one other
    thread (as that device thread), under a settings block: planned from the third call on,
    under the forward's settings, bitwise the module that never plans."""
    hits = _Hits(monkeypatch)
    pairs = _pair(cell)
    with ThreadPoolExecutor(max_workers=1) as device_thread:
        _assert_steps_equal(pairs, cell, range(5), True,
                            run=lambda backward: device_thread.submit(backward).result())
    assert (hits.forwards, hits.backwards) == (3, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_planned_module_calls_on_cuda_equal_full_calls_bitwise(cupy, settings, monkeypatch, cell):
    """The same on CUDA tensors (the plan's stream and device checks, CuPy memory in the weight
    rule, the replayed chain graphs): planned from the third call on, bitwise the module that
    never plans."""
    hits = _Hits(monkeypatch)
    pairs = _pair(cell, "cuda")
    _assert_steps_equal(pairs, cell, range(5), True, "cuda")
    assert (hits.forwards, hits.backwards) == (3, 2)
    assert not pairs[0][0].last_run.emulated


def test_other_calls_take_the_full_path_with_torch_errors(settings, monkeypatch):
    """After planning: other lengths, packed input, a new parameter object, bad input (torch.nn's
    errors, as torch.nn.LSTM raises them) take the full path; the plan serves again after."""
    hits = _Hits(monkeypatch)
    pairs = _pair("LSTM")
    planned, full = pairs[0][0], pairs[1][0]
    _assert_steps_equal(pairs, "LSTM", range(3), False)
    assert hits.forwards == 1
    reference = torch.nn.LSTM(I, H)
    wrong_states = (torch.zeros(1, 3, H), torch.zeros(1, 3, H))
    for bad in ((torch.randn(4, 2, I + 1),), (torch.randn(4, 2, I, dtype=torch.float64),),
                (torch.randn(4, 2, 2, I),), (torch.randn(4, 2, I), wrong_states)):
        with pytest.raises(Exception) as want:
            reference(*bad)
        with pytest.raises(type(want.value)) as got:
            planned(*bad)
        assert str(got.value) == str(want.value)
    packed = pack_padded_sequence(torch.randn(4, 2, I), torch.tensor([4, 2]))
    for call in (lambda m: m(torch.randn(3, 2, I, generator=torch.Generator().manual_seed(1))),
                 lambda m: m(packed)[0].data):
        full._record.plan = None
        with torch.no_grad():
            a, b = call(planned), call(full)
        assert torch.equal(a if isinstance(a, torch.Tensor) else a[0],
                           b if isinstance(b, torch.Tensor) else b[0])
    assert hits.forwards == 1
    _assert_steps_equal(pairs, "LSTM", range(3, 5), False)  # (the plan kept through them)
    assert hits.forwards == 3
    with torch.no_grad():
        for module, _ in pairs:  # new parameter objects (new memory): the full path
            module.weight_hh_l0 = torch.nn.Parameter(torch.full((4 * H, H), 0.01))
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m, _ in pairs]
    # (the first the full path, which plans anew - the call before had its signature -, the
    # second planned)
    _assert_steps_equal(pairs, "LSTM", range(5, 7), False)
    assert hits.forwards == 4


def test_new_weight_memory_is_caught_by_the_bitwise_check(settings, monkeypatch):
    """Sabotage: a plan that took any weights of the planned shapes for its own (memory not
    compared) runs the old weights after a parameter is reassigned: the check above fails."""
    monkeypatch.setattr(call_plans, "_same_memory", lambda a, b: a.shape == b.shape)
    pairs = _pair("GRU")
    _assert_steps_equal(pairs, "GRU", range(3), False)
    for module, _ in pairs:
        module.weight_hh_l0 = torch.nn.Parameter(torch.full((3 * H, H), 0.01))
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m, _ in pairs]
    with pytest.raises(AssertionError):
        _assert_steps_equal(pairs, "GRU", range(3, 4), False)


def test_a_stall_in_a_planned_module_call_restarts_bitwise(settings, grid_path, monkeypatch):
    prnn.configure(emulation_timeout_ms=200, stack=False)
    hits = _Hits(monkeypatch)
    torch.manual_seed(0)
    module = prt.GRU(I, H, algo="persistent")
    x = torch.randn(7, 2, I)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # (the weights stay as they are)
    for _ in range(3):
        plain = _train_step(module, optimizer, x, None)
    with prnn.inject_stall(block=1, step=3, duration_ms=700):
        stalled = _train_step(module, optimizer, x, None)
    for a, b in zip(plain, stalled):
        assert torch.equal(a, b)
    run = module.last_run
    for stats in (run, run.backward):
        assert stats.restarts >= 1 and stats.fallback is None
    assert (hits.forwards, hits.backwards) == (2, 1)  # (the stalled pair planned)


def test_calls_from_another_thread_in_turn_leave_the_plan(settings, monkeypatch):
    """A plan serves its own thread; another thread's calls in between take the full path (the
    same results) and plan nothing: no plan is prepared per call while two threads take turns."""
    import threading
    hits, made = _Hits(monkeypatch), []
    plan_of = plans.plan_of
    monkeypatch.setattr(plans, "plan_of",
                        lambda *a, **kw: made.append(1) or plan_of(*a, **kw))
    torch.manual_seed(0)
    module = prt.GRU(I, H, algo="persistent")
    x = torch.randn(4, 2, I)
    with torch.no_grad():
        want = [module(x)[0] for _ in range(3)][-1]
        assert (hits.forwards, len(made)) == (1, 1)
        for _ in range(3):
            got = []
            worker = threading.Thread(target=lambda: got.append(module(x)[0]))
            worker.start()
            worker.join()
            assert torch.equal(got[0], want) and torch.equal(module(x)[0], want)
    assert (hits.forwards, len(made)) == (4, 1)


@pytest.mark.parametrize("kw,shape", [({"batch_first": True}, (2, 4, I)), ({}, (4, I)),
                                      ({"bias": False}, (4, 2, I))],
                         ids=["batch-first", "unbatched", "no-bias"])
def test_other_module_layouts_plan_bitwise(settings, monkeypatch, kw, shape):
    """Batch-first input (a strided view of it reaches the plan), unbatched input and a layer
    without biases: planned, bitwise a module that never plans (with a ``h_n`` gradient too:
    that backward takes the full path)."""
    hits = _Hits(monkeypatch)
    torch.manual_seed(0)
    planned, full = (prt.LSTM(I, H, algo="persistent", **kw) for _ in range(2))
    full.load_state_dict(planned.state_dict())
    for seed in range(5):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        results = []
        for module in (planned, full):
            full._record.plan = None
            module.zero_grad()
            x_ = x.clone().requires_grad_()
            y, (h, c) = module(x_)
            (y.sin().sum() + (h.sum() if seed == 4 else 0)).backward()
            results.append([y, h, c, x_.grad, *(p.grad for p in module.parameters())])
        for a, b in zip(*results):
            assert torch.equal(a, b)
    assert (hits.forwards, hits.backwards) == (3, 1)


def _packed_steps(cell: str, seeds, pairs=None, batch: int = 2) -> None:
    """Training steps on packed sequences of other lengths every call (the first always the
    longest), bitwise a module that never plans (``pairs``: ``_pair``'s, of their input size
    and dtype)."""
    pairs = _pair(cell) if pairs is None else pairs
    first = pairs[0][0]
    dtype = first.weight_hh_l0.dtype
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, batch, first.input_size, generator=g).to(dtype)
        lengths = torch.randint(1, 6, (batch,), generator=g)
        lengths[0] = 5
        results = []
        for module, optimizer in pairs:
            pairs[1][0]._record.plan = None
            optimizer.zero_grad()
            x_ = x.clone().requires_grad_()
            y, hn = module(pack_padded_sequence(x_, lengths, enforce_sorted=False))
            y.data.sin().sum().backward()
            results.append([y.data, *(hn if isinstance(hn, tuple) else (hn,)), x_.grad,
                            *(p.grad for p in module.parameters())])
            optimizer.step()
        for a, b in zip(*results):
            assert torch.equal(a, b)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_packed_sequences_plan_bitwise(settings, monkeypatch, cell):
    """Packed input (lengths: a per-call array of the prepared passes) is planned, forward and
    backward, bitwise the full path with the lengths of each call."""
    hits = _Hits(monkeypatch)
    _packed_steps(cell, range(5))
    assert (hits.forwards, hits.backwards) == (3, 2)


def test_planned_calls_with_the_first_calls_lengths_are_caught(settings, monkeypatch):
    """Sabotage: prepared passes that keep the first call's lengths (not a per-call role) give
    other results than the full path with the lengths of the call: the check above fails."""
    from persistent_rnn import runtime
    forward_arrays = runtime.forward_arrays
    monkeypatch.setattr(runtime, "forward_arrays",
                        lambda result, h0, c0, lengths=None: forward_arrays(result, h0, c0))
    with pytest.raises(AssertionError):
        _packed_steps("GRU", range(5))


# 16-bit modules: tests/test_torch_half.py's sizes (its emulated 16-bit kernels).
HALF_I, HALF_H, HALF_B = 6, 12, 3


def _half_pairs(cell: str, dtype: torch.dtype):
    """``_pair``'s modules in ``dtype`` (``.to(dtype)``: 16-bit parameters)."""
    torch.manual_seed(0)
    modules = [getattr(prt, cell)(HALF_I, HALF_H, algo="persistent").to(dtype) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in modules]


@pytest.mark.parametrize("cell,dtype,packed", [("GRU", torch.float16, False),
                                                ("LSTM", torch.bfloat16, True)])
def test_16_bit_modules_plan_bitwise(settings, monkeypatch, cell, dtype, packed):
    """float16 and bfloat16 modules' training steps (with initial states, or on packed
    sequences of other lengths every call) are planned (``call_plans.HalfPlan``: results and
    gradients come in the module's dtype), bitwise a module that never plans, across SGD's
    in-place steps."""
    hits = _Hits(monkeypatch)
    pairs = _half_pairs(cell, dtype)
    if packed:
        _packed_steps(cell, range(5), pairs, HALF_B)
        assert isinstance(pairs[0][0]._record.plan, call_plans.HalfPlan)
        assert (hits.forwards, hits.backwards) == (3, 2)
        return
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(4, HALF_B, HALF_I, generator=g).to(dtype)
        states = [torch.randn(1, HALF_B, HALF_H, generator=g).to(dtype) for _ in range(2)]
        results = []
        for module, optimizer in pairs:
            pairs[1][0]._record.plan = None  # (the reference never plans)
            results.append(_train_step(module, optimizer, x,
                                       tuple(states) if cell == "LSTM" else states[0]))
        for a, b in zip(*results):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert isinstance(pairs[0][0]._record.plan, call_plans.HalfPlan)
    assert (hits.forwards, hits.backwards) == (3, 2)


@pytest.mark.parametrize("bidirectional,stack,dtype", [
    (True, True, torch.float32), (True, False, torch.float32), (True, False, torch.float16)],
    ids=["pairs", "layer-directions", "layer-directions-float16"])
def test_planned_stack_module_calls_equal_full_calls_bitwise(settings, grid_path, monkeypatch,
                                                             bidirectional, stack, dtype):
    """A bidirectional two-layer LSTM module as pairs (test_call_plans' shapes and kernels;
    ``bidirectional=False``: a stack in stack mode, the same road through the op, checked by the
    layer API's tests) plans its calls too (``stack_plans``): training steps with initial
    states bitwise the module that never plans (the layer API's plans: also without states,
    with lengths); without the ``stack`` setting one layer-direction per launch
    (``layer_plans``; a float16 module's too, its conversions inside the chains)."""
    prnn.configure(stack=stack)
    hits = _StackHits(monkeypatch)
    torch.manual_seed(0)
    modules = [prt.LSTM(SI, SH, num_layers=2, algo="persistent",
                        bidirectional=bidirectional).to(dtype) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in modules]
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(ST, SB, SI, generator=g).to(dtype)
        states = 2 * (1 + bidirectional)
        hx = (torch.randn(states, SB, SH, generator=g).to(dtype),
              torch.randn(states, SB, SH, generator=g).to(dtype))
        results = []
        for module, optimizer in pairs:
            modules[1]._record.plan = None  # (the reference never plans)
            results.append(_train_step(module, optimizer, x, hx))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    assert type(modules[0]._record.plan) is (
        layer_plans.HalfLayersPlan if dtype != torch.float32 else layer_plans.LayersPlan
        if not stack else stack_plans.PairPlan if bidirectional else stack_plans.StackPlan)
    assert (hits.forwards, hits.backwards) == (3, 2)
