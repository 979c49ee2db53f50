"""Chains replayed as CUDA graphs on a GPU (marked ``gpu``): the replays give the bits the
launch-by-launch chains give, forward and backward, for a layer, a stack in one launch and the
torch module; a stall inside a replayed chain still restarts it. See tests/test_chain_graphs.py
for the cache's policy without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import buffers, chain_graphs, launch

pytestmark = pytest.mark.gpu
# A layer plans from its third call, and CuPy's pool alternates two sets of blocks while a layer
# holds its last forward: a key is captured at its second sighting, so calls 5 and on replay.
CALLS = 10


def _layer(cupy, mode: str, layers: int, dtype: str = "float32", proj: int = 0,
           bidirectional: bool = False, batch_first: bool = False):
    layer = getattr(prnn, mode)(16, 64, num_layers=layers, algo="persistent", seed=1, dtype=dtype,
                                proj_size=proj, bidirectional=bidirectional,
                                batch_first=batch_first)
    layer.load_params({k: cupy.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(2)
    major = (3, 9) if batch_first else (9, 3)
    x = cupy.asarray(rng.standard_normal((*major, 16)), layer.dtype)
    dy = cupy.asarray(rng.standard_normal((*major, (proj or 64) * layer.directions)),
                      layer.dtype)
    return layer, x, dy


def _call(layer, x, dy) -> list[np.ndarray]:
    """One forward and backward from zeroed gradients (the layer API adds into ``grads``)."""
    layer.zero_grad()
    y, hn = layer.forward(x, lengths=[9, 7, 4])
    fwd = layer.last_run
    dx, _ = layer.backward(dy)
    assert fwd.algo == layer.last_run.algo == "persistent" and fwd.fallback is None
    return [a.get() for a in (y, *(hn if isinstance(hn, tuple) else (hn,)), dx,
                              *layer.grads.values())]


@pytest.mark.parametrize("mode,layers", [("GRU", 1), ("LSTM", 1), ("LSTM", 2), ("RNN", 3)])
def test_replayed_chains_give_the_direct_bits(cupy, mode, layers):
    layer, x, dy = _layer(cupy, mode, layers)
    with prnn.override_settings(chain_graphs=False):
        want = _call(layer, x, dy)
    chain_graphs.clear()
    with launch.counting() as counts:
        got = [_call(layer, x, dy) for _ in range(CALLS)]
    assert counts.graph_launches >= 2, counts
    for results in got:
        for a, b in zip(results, want):
            np.testing.assert_array_equal(a, b)


def test_a_stall_in_a_replayed_chain_restarts_it(cupy):
    layer, x, dy = _layer(cupy, "GRU", 1)
    want = _call(layer, x, dy)
    chain_graphs.clear()
    with prnn.override_settings(gpu_timeout_ms=20.0), prnn.inject_stall(0, 3, 200.0):
        with launch.counting() as counts:
            for _ in range(CALLS):
                y, _ = layer.forward(x, lengths=[9, 7, 4])
                assert layer.last_run.restarts == 1 and layer.last_run.fallback is None
                np.testing.assert_array_equal(y.get(), want[0])
    assert counts.graph_launches >= 2, counts


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_torch_module_replays_its_chains(cupy, dtype):
    """The torch module's calls (planned from the third: ``call_plans``, 16-bit modules'
    conversions inside the chains) replayed, bitwise the first, direct call."""
    torch = pytest.importorskip("torch")
    import persistent_rnn.torch as prt
    torch.manual_seed(0)
    module = prt.LSTM(16, 64, algo="persistent").cuda().to(getattr(torch, dtype))
    x = torch.randn(9, 3, 16, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)

    def call():
        x.grad = None
        module.zero_grad()
        y, _ = module(x)
        y.square().sum().backward()
        return [t.detach().view(torch.int16 if t.element_size() == 2 else t.dtype).cpu().numpy()
                for t in (y, x.grad, *(p.grad for p in module.parameters()))]

    with prnn.override_settings(chain_graphs=False):
        want = call()
    chain_graphs.clear()
    with launch.counting() as counts:
        got = [call() for _ in range(CALLS)]
    assert counts.graph_launches >= 2, counts
    for results in got:
        for a, b in zip(results, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode,lengths,dtype,proj", [("GRU", None, "float32", 0),
                                                     ("LSTM", [9, 7, 4], "float32", 0),
                                                     ("GRU", [9, 7, 4], "float16", 0),
                                                     ("LSTM", None, "float16", 0),
                                                     ("LSTM", [9, 7, 4], "float32", 24),
                                                     ("LSTM", None, "float16", 24)])
def test_planned_calls_replay_their_chains_with_the_full_calls_bits(cupy, monkeypatch, mode,
                                                                    lengths, dtype, proj):
    """A layer's planned calls (``call_plans``) on a GPU, each on other values in the same
    input arrays: their chains replayed as graphs keyed by the prepared passes hold the
    operations moved into them (``runtime.Around``: the input's bias, the output's and h_n's
    (c_n's) copies or selections; dy's selection, the carries' zeros, W_hh^T's copy, dc0), so
    a replay that runs none of their Python still gives every call the bits of a layer that
    never plans (a replay without them would leave the bias out, or leave the output, h_n,
    c_n or dc0 as the pool's block held them: another call's values). A float16 layer's
    chains hold its conversions and its 16-bit input projection too (``call_plans.HalfPlan``:
    cuBLAS's gemmEx recorded with the eager call's arguments, ``cublas_capture.gemm_ex``); an
    LSTM projection's, W_hr^T's copy and dW_hr."""
    layer, x, dy = _layer(cupy, mode, 1, dtype, proj)
    full, _, _ = _layer(cupy, mode, 1, dtype, proj)
    _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, lengths)


@pytest.mark.parametrize("mode,layers,bidirectional,lengths,stack,proj", [
    ("LSTM", 2, False, [9, 7, 4], True, 0), ("GRU", 3, False, None, True, 0),
    ("GRU", 1, True, [9, 7, 4], True, 0), ("LSTM", 1, True, None, True, 0),
    ("LSTM", 2, True, [9, 7, 4], True, 0), ("GRU", 2, False, [9, 7, 4], False, 0),
    ("LSTM", 2, True, None, False, 0), ("GRU", 1, True, [9, 7, 4], False, 0),
    ("LSTM", 2, True, [9, 7, 4], True, 24)])
def test_planned_stacks_and_pairs_replay_their_chains_with_the_full_calls_bits(
        cupy, settings, monkeypatch, mode, layers, bidirectional, lengths, stack, proj):
    """The same for a stack in stack mode (``stack_plans.StackPlan``: the input's projection,
    the weights' stacking, the layers' outputs, the gradients and the sums inside its one chain
    per pass), a bidirectional layer's directions side by side (``PairPlan``: the reversals
    and gathers too) and, with the ``stack`` setting off, stacks and bidirectional layers run
    one layer-direction per launch (``layer_plans.LayersPlan``; an LSTM projection stack always
    runs so); a pass of several chains (two
    layers of pairs, layer-directions) replayed as one graph (``launch.one_graph``: one graph
    launch a pass). Written 2026-11-27 on a machine without a GPU: not run yet (the pairs of
    two layers and the layer-directions since the fifth session)."""
    from persistent_rnn import layer_plans, stack_plans
    prnn.configure(stack=stack)
    layer, x, dy = _layer(cupy, mode, layers, proj=proj, bidirectional=bidirectional)
    full, _, _ = _layer(cupy, mode, layers, proj=proj, bidirectional=bidirectional)
    last = _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, lengths)
    assert type(layer._plan) is (layer_plans.LayersPlan if not stack or proj else
                                 stack_plans.PairPlan if bidirectional else stack_plans.StackPlan)
    assert last.graph_units == last.graph_launches == 2, last  # (one graph a pass)


@pytest.mark.parametrize("mode,layers,bidirectional,lengths", [
    ("GRU", 2, False, [9, 7, 4]), ("LSTM", 1, True, None)])
def test_planned_16_bit_layer_directions_replay_their_chains_with_the_full_calls_bits(
        cupy, settings, monkeypatch, mode, layers, bidirectional, lengths):
    """float16 stacks and bidirectional layers run one layer-direction per launch (the
    ``stack`` setting off: ``layer_plans.HalfLayersPlan``, the conversions inside the chains,
    an upper layer's input rounded into a 16-bit workspace for the captured ``gemmEx``)
    replayed, bitwise a layer that never plans. Written 2026-11-27 (fifth session) without a
    GPU: not run yet."""
    from persistent_rnn import layer_plans
    prnn.configure(stack=False)
    layer, x, dy = _layer(cupy, mode, layers, "float16", bidirectional=bidirectional)
    full, _, _ = _layer(cupy, mode, layers, "float16", bidirectional=bidirectional)
    _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, lengths)
    assert type(layer._plan) is layer_plans.HalfLayersPlan


@pytest.mark.parametrize("mode,layers,bidirectional,lengths", [
    ("GRU", 2, False, [9, 7, 4]), ("LSTM", 1, True, None), ("LSTM", 2, True, [9, 7, 4])])
def test_planned_16_bit_stack_mode_calls_replay_their_chains_with_the_full_calls_bits(
        cupy, settings, monkeypatch, mode, layers, bidirectional, lengths):
    """float16 stacks in stack mode and float16 pairs (``stack_plans.StackPlan`` /
    ``PairPlan`` with the conversions inside the chains: the weights' 16-bit bits copied into
    the plan's packed words, the captured ``gemmEx`` of 16-bit operands) replayed, bitwise a
    layer that never plans. Written 2026-11-27 (branch half-stack-plans) without a GPU: not
    run yet."""
    from persistent_rnn import stack_plans
    prnn.configure(stack=True)
    layer, x, dy = _layer(cupy, mode, layers, "float16", bidirectional=bidirectional)
    full, _, _ = _layer(cupy, mode, layers, "float16", bidirectional=bidirectional)
    _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, lengths)
    assert type(layer._plan) is (stack_plans.PairPlan if bidirectional
                                 else stack_plans.StackPlan)
    assert ("side by side" if bidirectional else "stack of") in layer.last_run.details[0]


@pytest.mark.parametrize("mode,layers,bidirectional,lengths", [
    ("GRU", 1, False, None), ("LSTM", 1, False, [7, 9, 4]), ("LSTM", 2, False, None),
    ("GRU", 2, True, [7, 9, 4])])
def test_planned_batch_first_calls_replay_their_chains_with_the_full_calls_bits(
        cupy, monkeypatch, mode, layers, bidirectional, lengths):
    """Batch-first layers' planned calls (the input's and dy's transposes inside the chains:
    ``layers``, ``call_plans.Plan.backward``) replayed, bitwise a layer that never plans.
    Written 2026-11-27 (fifth session) without a GPU: not run yet."""
    layer, x, dy = _layer(cupy, mode, layers, bidirectional=bidirectional, batch_first=True)
    full, _, _ = _layer(cupy, mode, layers, bidirectional=bidirectional, batch_first=True)
    _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, lengths)


def _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy,
                                       lengths) -> launch.Counters:
    """Twelve planned calls of ``layer`` on other values in the same arrays, their chains
    replayed at least four times without a host synchronisation, bitwise ``full``'s calls,
    which never plan; what the last call did. (A replay needs the arrays at the addresses of an
    earlier call: each call holds its outputs through its backward, as a training step does, so
    CuPy's pool hands every call the blocks of the call two before.)"""
    rng = np.random.default_rng(3)
    values = [(rng.standard_normal(x.shape), rng.standard_normal(dy.shape)) for _ in range(12)]

    def call(layer, vx, vdy):
        x[...], dy[...] = cupy.asarray(vx, x.dtype), cupy.asarray(vdy, dy.dtype)
        layer.zero_grad()
        y, hn = layer.forward(x, lengths=lengths)
        dx, dhx = layer.backward(dy)
        return [a.get() for a in (y, *(hn if isinstance(hn, tuple) else (hn,)), dx,
                                  *(dhx if isinstance(dhx, tuple) else (dhx,)),
                                  *layer.grads.values())]

    want = []
    for vx, vdy in values:
        full._plan = None  # (never planned)
        want.append(call(full, vx, vdy))
    replays = []
    run = chain_graphs.run

    def counted(key, issue):  # (a replay: a graph launched, nothing issued from Python)
        issued = []
        launched = run(key, lambda: (issued.append(1), issue()))
        replays.append(launched and not issued)
        return launched
    monkeypatch.setattr(chain_graphs, "run", counted)
    chain_graphs.clear()
    got, counted_calls = [], []
    for vx, vdy in values:
        with launch.counting() as counts:
            got.append(call(layer, vx, vdy))
        counted_calls.append(counts)
    assert layer._plan is not None and layer._plan.backward_pass is not None
    assert sum(replays) >= 4 and not any(c.host_syncs for c in counted_calls), \
        (replays, counted_calls)
    for results, expected in zip(got, want):
        for a, b in zip(results, expected):
            np.testing.assert_array_equal(a, b)
    return counted_calls[-1]


def test_records_reach_the_host_from_replayed_chains(cupy, monkeypatch):
    """The device records on a GPU (``launch.RecordRing``: page-locked host memory that the
    completion kernel writes, mapped at its host address): calls replayed as graphs with a stall in
    one of them, every record read after all ran, newest first, with no wait once the device has
    finished; a record read before the device got there waits (one counted sync) and is right;
    with a ring of 4 slots the records 4 calls back are lost and say so."""
    layer, x, _ = _layer(cupy, "GRU", 1)
    chain_graphs.clear()
    stalled = CALLS // 2
    runs = []
    with prnn.override_settings(gpu_timeout_ms=20.0), launch.counting() as counts:
        for i in range(CALLS):
            if i == stalled:
                with prnn.inject_stall(0, 3, 200.0):
                    layer.forward(x, lengths=[9, 7, 4])
            else:
                layer.forward(x, lengths=[9, 7, 4])
            runs.append(layer.last_run)
    assert counts.graph_launches >= 2 and counts.host_syncs == counts.record_reads == 0, counts
    cupy.cuda.Device().synchronize()
    with launch.counting() as counts:
        restarts = [run.restarts for run in reversed(runs)][::-1]
    assert restarts == [int(i == stalled) for i in range(CALLS)], restarts
    assert counts.host_syncs == 0 and counts.record_reads == CALLS, counts
    ring = layer._plan.forward_pass.chain.ring  # (planned: the lengths are the same each call)
    assert ring.device.data.ptr == ring.host.ctypes.data  # unified addressing

    with prnn.override_settings(gpu_timeout_ms=20.0), prnn.inject_stall(0, 3, 200.0):
        layer.forward(x, lengths=[9, 7, 4])
        with launch.counting() as counts:
            assert layer.last_run.restarts == 1
    assert counts.host_syncs == 1, counts  # the read waited for the stalled pass

    monkeypatch.setattr(launch, "RING_SLOTS", 4)
    buffers.release_workspaces()  # new chains, whose rings have 4 slots
    runs = []
    for _ in range(6):
        layer.forward(x)
        runs.append(layer.last_run)
    cupy.cuda.Device().synchronize()
    assert [run.restarts for run in runs] == [0] * 6
    assert [any("overwritten" in d for d in run.details) for run in runs] == [True] * 2 + [False] * 4
