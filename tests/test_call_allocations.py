"""Issue 26, deliverable 2: a steady-state persistent call allocates only the arrays it returns
and those its context keeps for the backward; its scratch memory (the chain's words and tagged
exchanges, the input GEMM's output, the backward's dgi/dgh, carries and W_hh^T) is reused call
after call, per thread and stream (``buffers.reused``). Held for single layers and stacks (GRU,
LSTM), bidirectional layers (one launch per direction, or both side by side), LSTM projections
and 16-bit layers, each against its explicit list (anything not yet removed named there with
its reason).

Counted on the emulated persistent path (the GPU path's host logic) with NumPy's memory handler
(``test_call_cost.numpy_alloc_sizes``): every array data allocation of more than 8 bytes. NumPy
scalars (the kernels' scalar arguments the emulator marshals: 4 or 8 bytes each) are host
objects, not buffers, and are left out by that bound; the shapes here (T=3, B=3, H=8) make
every array the library could allocate larger than 8 bytes (the smallest, a (T, B, 1) mask of
booleans or B int32 lengths, is 9 or 12). The layers run on the grid path (``grid_path``: CTAs
exchanging through the tagged exchange in global memory), so the exchange is in use.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import buffers, call_plans, launch, plans
from test_call_cost import numpy_alloc_sizes

T, B, H, I = 3, 3, 8, 5
LENGTHS = np.array([3, 1, 2], np.int32)

# (cell, backward, lengths) -> the arrays a steady-state call may allocate, by name:
# what it returns and what the context keeps for the backward (nothing else). The counted call
# is planned (call_plans): its parameter gradients are formed in the plan's workspaces and added
# into the layer's inside the chain (the full path: one new array per parameter), and the
# results its backward reads (y, cs, saved: the context's) are the plan's own, rewritten by every
# call - the layer API backpropagates only its last forward (before branch callpython: 2 and 3
# arrays more a forward, new every call).
FORWARD = {"GRU": ["output", "h_n"], "LSTM": ["output", "h_n", "c_n"]}
BACKWARD = {"GRU": ["dx", "dh0"], "LSTM": ["dx", "dh0", "dc0"]}
LENGTHS_COPY = ["the lengths as int32 (context: the backward reads them; a copy, so that the "
                "caller may change theirs)"]


def expected(cell: str, backward: bool, lengths: bool) -> list[str]:
    return (FORWARD[cell] + (LENGTHS_COPY if lengths else [])
            + (BACKWARD[cell] if backward else []))


def array_allocations(call) -> int:
    """Array allocations (over 8 bytes) of one steady-state ``call()``."""
    return sum(size > 8 for size in numpy_alloc_sizes(call))


def _call(cell: str, backward: bool, lengths: bool, seed: int = 0, **options):
    """One steady-state call (forward, or forward and backward) of a new layer; ``options``:
    the layer's (``bidirectional``, ``num_layers``, ``proj_size``, ``dtype``)."""
    layer = getattr(prnn, cell)(I, H, algo="persistent", seed=0, **options)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, B, I)).astype(layer.dtype)
    width = (layer.proj_size or H) * layer.directions
    dy = rng.standard_normal((T, B, width)).astype(layer.dtype)
    given = LENGTHS if lengths else None

    def call():
        layer.zero_grad()
        y, hn = layer.forward(x, lengths=given)
        if not backward:
            return [y, *(hn if isinstance(hn, tuple) else [hn])]
        dx, dhx = layer.backward(dy)
        return [y, dx, *(dhx if isinstance(dhx, tuple) else [dhx]), *layer.grads.values()]
    call.layer = layer
    return call


CASES = [(c, b, n) for c in ("GRU", "LSTM") for b in (False, True) for n in (False, True)]
IDS = [f"{c}-{'fwd+bwd' if b else 'fwd'}-{'lengths' if n else 'full'}" for c, b, n in CASES]


@pytest.mark.parametrize("cell,backward,lengths", CASES, ids=IDS)
def test_a_steady_state_call_allocates_only_what_it_returns_and_keeps(settings, grid_path, cell,
                                                                       backward, lengths):
    call = _call(cell, backward, lengths)
    want = expected(cell, backward, lengths)
    assert array_allocations(call) == len(want), want


# Stack mode (two unidirectional layers in one launch per pass): the same, per layer (dh and dc
# each one array whose rows are the layers'). The counted call is planned (stack_plans): its
# parameter gradients are formed in the plan's workspaces and added into the layer's inside the
# chain (the full path: 8 new arrays, one per parameter), and the activations its backward reads
# (y, cs, saved of both layers, layer 0's output) are the plan's own, as a single layer's are.
STACK_FORWARD = {"GRU": ["output", "h_n"], "LSTM": ["output", "h_n", "c_n"]}
STACK_BACKWARD = {"GRU": ["dx", "dh"]}
STACK_BACKWARD["LSTM"] = STACK_BACKWARD["GRU"] + ["dc"]


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_a_stack_mode_call_allocates_only_what_it_returns_keeps_and_lists(settings, grid_path,
                                                                          cell, backward):
    prnn.configure(stack=True)
    layer = getattr(prnn, cell)(I, H, num_layers=2, algo="persistent", seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    dy = rng.standard_normal((T, B, H)).astype(np.float32)

    def call():
        layer.zero_grad()
        layer.forward(x)
        if backward:
            layer.backward(dy)

    call()
    assert "stack" in layer.last_run.details[0]  # (stack mode ran)
    want = STACK_FORWARD[cell] + (STACK_BACKWARD[cell] if backward else [])
    assert array_allocations(call) == len(want), want


# Bidirectional layers (with lengths: the within-length reversal), one launch per direction
# (stack mode off) or both directions of a layer side by side in one (stack mode, "pairs").
def bidirectional_expected(cell: str) -> list[str]:
    """What a bidirectional fwd+bwd call with lengths may allocate. A call run as pairs or one
    layer-direction per launch is planned (stack_plans.PairPlan, layer_plans.LayersPlan): its
    gradients are summed into the layer's inside its chains from the plan's workspaces (the
    full path: 4 new arrays per layer-direction), and the activations its backward reads (every
    layer-direction's, the layers' outputs, the input with padding selected out, the
    reversal's row index) are the plan's own, as a single layer's are."""
    forward = LENGTHS_COPY + ["output", "h_n"] + (["c_n"] if cell == "LSTM" else [])
    backward = (["dx", "dh0 (every layer-direction's rows)"]
                + (["dc0 (likewise)"] if cell == "LSTM" else []))
    return forward + backward


BIDIRECTIONAL = [("GRU", 1, True), ("GRU", 1, False), ("LSTM", 2, True), ("LSTM", 2, False)]


@pytest.mark.parametrize("cell,layers,pairs", BIDIRECTIONAL,
                         ids=[f"{c}-{n}layer-{'pairs' if p else 'per-direction'}"
                              for c, n, p in BIDIRECTIONAL])
def test_a_bidirectional_call_allocates_only_what_it_returns_and_keeps(settings, grid_path, cell,
                                                                       layers, pairs):
    prnn.configure(stack=pairs)
    call = _call(cell, True, True, bidirectional=True, num_layers=layers)
    call()
    assert ("side by side" in call.layer.last_run.details[0]) == pairs  # (the path asked for)
    want = bidirectional_expected(cell)
    assert array_allocations(call) == len(want), want


# LSTM projections (proj_size P: y holds r_t, the context keeps the cell's h_t too).
# (y, hs, cs and saved: the plan's own, as FORWARD's)
PROJECTION_FORWARD = ["output", "h_n", "c_n"]
PROJECTION_BACKWARD = BACKWARD["LSTM"]  # (dW_hr too in the plan's workspace)


@pytest.mark.parametrize("lengths", [False, True], ids=["full", "lengths"])
def test_a_projection_call_allocates_only_what_it_returns_and_keeps(settings, grid_path,
                                                                    lengths):
    call = _call("LSTM", True, lengths, proj_size=4)
    want = PROJECTION_FORWARD + (LENGTHS_COPY if lengths else []) + PROJECTION_BACKWARD
    assert array_allocations(call) == len(want), want


# 16-bit layers: the float32 list, its results being the 16-bit arrays the layer returns
# (functional's float32 results are workspaces: ``scratch_results``) but for the parameter
# gradients: a planned 16-bit call (``call_plans.HalfPlan``) sums them into ``grads`` inside its
# chain from float32 workspaces, no per-call arrays. Not yet removed, on NumPy
# only: matmul.matmul_half's float32 copies of its 16-bit operands (matmul.py, outside this
# change).
HALF_EMULATION = [
    "emulation only: matmul.matmul_half on NumPy multiplies x's float32 values (a new array; "
    "on a GPU the tensor cores read the 16-bit operands as they are)",
    "emulation only: likewise W_ih's float32 values"]


@pytest.mark.parametrize("cell,half,lengths", [("GRU", "float16", False),
                                               ("LSTM", "bfloat16", True)],
                         ids=["GRU-float16-full", "LSTM-bfloat16-lengths"])
def test_a_16_bit_call_allocates_only_what_it_returns_keeps_and_lists(settings, grid_path, cell,
                                                                      half, lengths):
    call = _call(cell, True, lengths, dtype=half)
    want = [a for a in expected(cell, True, lengths) if not a.startswith(("dW", "db"))]
    want += HALF_EMULATION
    assert array_allocations(call) == len(want), want


@pytest.mark.parametrize("pair,half", [(False, "float16"), (True, "bfloat16")],
                         ids=["stack-float16-full", "pairs-bfloat16-lengths"])
def test_a_16_bit_stack_mode_call_allocates_what_a_float32_one_does(settings, grid_path, pair,
                                                                    half):
    """A 16-bit stack in stack mode, or bidirectional layer run as pairs, is planned
    (``stack_plans``: its conversions in the plan's workspaces inside the chains): the float32
    call's list and, per input projection of the 16-bit operands, ``HALF_EMULATION``."""
    prnn.configure(stack=True)
    call = _call("GRU", True, pair, dtype=half, **({"bidirectional": True} if pair
                                                    else {"num_layers": 2}))
    call()
    assert ("side by side" if pair else "stack") in call.layer.last_run.details[0]
    want = (bidirectional_expected("GRU") + 2 * HALF_EMULATION if pair
            else STACK_FORWARD["GRU"] + STACK_BACKWARD["GRU"] + HALF_EMULATION)
    assert array_allocations(call) == len(want), want


def test_a_per_call_exchange_is_counted(settings, grid_path, monkeypatch):
    """The count fails where a call allocates its chain (words and exchange, and its records'
    ring) afresh again (on the full path: a planned call holds its chain, ``call_plans``)."""
    monkeypatch.setattr(plans, "plan_of", lambda *a, **kw: None)
    call = _call("GRU", False, False)
    monkeypatch.setattr(launch, "chain_for", lambda xp, engine, groups, exchanges=():
                        launch.Chain(xp, engine, groups, exchanges))
    full = ["y (context)", "saved (context)"]  # (the full path's, new every call)
    assert array_allocations(call) == len(full + expected("GRU", False, False)) + 2


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_a_stalled_or_completed_pass_leaves_nothing_for_the_next_call(settings, grid_path, cell):
    """The reused exchange and words are reset by the next chain: a call after a stalled pass
    (restarted on the device) and after one finished by the completion kernel (restart cap
    0: CTAs gave up mid-pass) gives the undisturbed call's bits."""
    prnn.configure(emulation_timeout_ms=200, stack=False)
    call = _call(cell, True, True)
    plain = [np.array(a) for a in call()]
    with prnn.inject_stall(block=1, step=1, duration_ms=700):
        call()
    assert call.layer.last_run.restarts >= 1  # (the backward's: stalled at step 1 of 3)
    after_stall = [np.array(a) for a in call()]
    with prnn.override_settings(max_restarts=0), prnn.inject_stall(block=1, step=1,
                                                                   duration_ms=700):
        call()
    assert "completion kernel" in call.layer.last_run.fallback
    after_completion = [np.array(a) for a in call()]
    for a, b, c in zip(plain, after_stall, after_completion):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_threads_never_share_a_workspace(settings, grid_path):
    """Two threads calling the same layer at once get their own chains and workspaces (and the
    results of calls made one at a time); one thread gets the same ones call after call."""
    layer = prnn.GRU(I, H, algo="persistent", seed=0)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((T, B, I)).astype(np.float32) for _ in range(2)]
    alone = [np.array(layer.forward(x)[0]) for x in xs]
    got: dict[int, list] = {0: [], 1: []}
    start = threading.Barrier(2)

    def run(k: int) -> None:
        start.wait(timeout=60)
        for _ in range(4):
            got[k].append(np.array(layer.forward(xs[k])[0]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for k in range(2):
        assert len(got[k]) == 4
        for y in got[k]:
            np.testing.assert_array_equal(y, alone[k])

    made = {}
    both = threading.Barrier(2)

    def take(k: int) -> None:  # (both threads alive at once: a thread's id may be reused)
        made[k] = (buffers.workspace(np, "gi", (4, 2), np.float32),
                   buffers.workspace(np, "gi", (4, 2), np.float32))
        both.wait(timeout=60)

    threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert made[0][0] is made[0][1] and made[1][0] is made[1][1]
    assert made[0][0] is not made[1][0]
    kept = buffers.workspace(np, "gi", (4, 2), np.float32)
    assert buffers.release_workspaces() >= 1
    assert buffers.workspace(np, "gi", (4, 2), np.float32) is not kept


def test_shared_constants_are_read_only():
    """The zeros and step indices calls share cannot be written (NumPy): a stray write raises
    rather than changing every later call's initial state."""
    zeros = buffers.constant_zeros(np, (1, B, H), np.float32)
    assert zeros is buffers.constant_zeros(np, (1, B, H), np.float32)
    with pytest.raises(ValueError):
        zeros[0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        buffers.step_indices(np, T)[0] = 5


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_a_steady_state_gpu_call_allocates_only_what_it_returns_and_keeps(cupy, backward):
    """On the GPU, counted by CuPy's allocator (``launch.counting().allocations``): the same
    list as the emulated GRU call's (chain graphs on: the third call on is a replay)."""
    layer = prnn.GRU(I, H, algo="persistent", seed=0)
    layer.load_params({k: cupy.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((T, B, I)), np.float32)
    dy = cupy.asarray(rng.standard_normal((T, B, H)), np.float32)

    def call():
        layer.zero_grad()
        layer.forward(x)
        if backward:
            layer.backward(dy)

    for _ in range(4):
        call()
    cupy.cuda.get_current_stream().synchronize()
    with launch.counting() as counts:
        call()
    assert layer.last_run.algo == "persistent"
    want = expected("GRU", backward, False)
    assert counts.allocations == len(want), (counts, want)


def test_a_chain_belongs_to_its_engine():
    """Two engines of one configuration key (re-planned, e.g. with other shared bytes) never
    share a chain: the chain launches with its own engine; one engine gets the same chain."""
    from types import SimpleNamespace
    first, second = (launch.Engine(SimpleNamespace(grid=2), print, True, ("same",))
                     for _ in range(2))
    a = launch.chain_for(np, first, 1, ((2, 3, 4),))
    assert launch.chain_for(np, first, 1, ((2, 3, 4),)) is a and a.engine is first
    assert launch.chain_for(np, second, 1, ((2, 3, 4),)).engine is second
