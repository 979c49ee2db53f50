"""A layer's planned steady-state call (persistent_rnn.call_plans) on the emulated path: bitwise
the full path's results, used only while every input is as planned (anything else takes the full
path: its checks and errors), across stalls, cooldowns, settings, new weights and released
workspaces; and the chain graph's key of a prepared pass (what a GPU replay is keyed by), built
once but for the call's own arrays. The GPU's graphs themselves: tests/test_gpu_chain_graphs.py."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import (buffers, call_plans, chain_graphs, functional, launch, layer_plans,
                            runtime, stack_plans)
from persistent_rnn.validation import CallOrderError
from full_set import EVERY_KERNEL
from profiling import run_profiled

H, I = 16, 3


def _layer(cell: str, seed: int = 0, **kw):
    return getattr(prnn, cell)(I, H, algo="persistent", seed=seed, **kw)


def _data(seed: int, steps: int = 4, batch: int = 2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps, batch, I)).astype(np.float32),
            rng.standard_normal((steps, batch, H)).astype(np.float32))


def _flat(*results) -> list[np.ndarray]:
    out = []
    for r in results:
        out += [np.array(a) for a in (r if isinstance(r, tuple) else (r,))]
    return out


def _planned_and_full_calls_equal(planned, full, x, dy, hx=None, lengths=None,
                                  sgd: bool = False) -> list[tuple]:
    """One forward and backward of ``planned`` and of ``full`` (its plan dropped: the reference
    never plans) from zeroed gradients: every result and gradient bitwise equal. ``sgd``: each
    then steps its parameters in place (a new plan would not be made for new weights). Returns
    each layer's ``(y, dx)``."""
    results, outputs = [], []
    for layer in (planned, full):
        full._plan = None
        layer.zero_grad()
        y, hn = layer.forward(x, hx, lengths=lengths)
        dx, dhx = layer.backward(dy)
        results.append(_flat(y, hn, dx, dhx) + [g.copy() for g in layer.grads.values()])
        outputs.append((y, dx))
        if sgd:
            for name, w in layer.params.items():
                w -= 0.01 * layer.grads[name]
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    return outputs


def _step(layer, x, dy) -> list[np.ndarray]:
    """Forward and backward; every result and the accumulated gradients, copied."""
    layer.zero_grad()
    y, hn = layer.forward(x)
    dx, dhx = layer.backward(dy)
    return _flat(y, hn, dx, dhx) + [g.copy() for g in layer.grads.values()]


def _numpy_pointers(monkeypatch) -> None:
    """``chain_graphs.value`` and ``addresses`` on NumPy arrays, their data pointers standing in
    for device pointers (``value`` otherwise as on a GPU: shape, strides, dtype)."""
    monkeypatch.setattr(chain_graphs, "value", lambda v: (
        (v.__array_interface__["data"][0], v.shape, v.strides, v.dtype.char)
        if isinstance(v, np.ndarray) else tuple(chain_graphs.value(u) for u in v)
        if isinstance(v, tuple) else v))
    monkeypatch.setattr(chain_graphs, "addresses", lambda arrays, roles: tuple(
        [arrays[role].__array_interface__["data"][0] for role in roles]))


def _issued_keys(monkeypatch) -> list:
    """Every chain graph's key (``chain_graphs.run``, eligible on NumPy), the chain issued
    as it is (never replayed); returns the list they are appended to."""
    keys = []
    monkeypatch.setattr(launch.Chain, "on_device", True)
    monkeypatch.setattr(chain_graphs, "run",
                        lambda key, issue: keys.append(key) or issue() or False)
    return keys


class _Hits:
    """Counts the planned forwards and backwards that ran (``Plan.forward`` / ``backward``
    without falling back to ``functional.backward``)."""

    def __init__(self, monkeypatch):
        self.forwards = self.backwards = 0
        forward, backward = call_plans.Plan.forward, call_plans.Plan._planned_backward

        def counted_forward(plan, *args):
            self.forwards += 1
            return forward(plan, *args)

        def counted_backward(plan, *args):
            self.backwards += 1
            return backward(plan, *args)
        monkeypatch.setattr(call_plans.Plan, "forward", counted_forward)
        monkeypatch.setattr(call_plans.Plan, "_planned_backward", counted_backward)


# What enqueues device work on an array: the library's products and NumPy's (CuPy's stand-in)
# copies, fills and sums (in-place operators and new empty arrays excepted).
_ARRAY_WORK = {"matmul", "copyto", "fill", "sum", "where", "take", "ascontiguousarray"}


def _array_work(call) -> int:
    """Products, copies, fills and sums run during ``call()`` (profile events of Python and C
    functions of those names)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        name = (frame.f_code.co_name if event == "call"
                else getattr(arg, "__name__", "") if event == "c_call" else "")
        count += name in _ARRAY_WORK
    run_profiled(call, profile)
    return count


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_a_planned_call_enqueues_everything_inside_its_chain(settings, monkeypatch, stub_chains, cell):
    """Issue 26: a planned forward and backward enqueue all their device work inside their
    chains (``runtime.Around``), so that on a GPU the replayed chain graph is the call's one API
    call (``latency.call_costs``): with the chains stubbed (what a replay stands in for), no
    product, copy, fill or sum runs beside them, nor the layer API's accumulation of the
    parameter gradients (in place, which ``_array_work`` does not see: the gradients stay as
    they were) - where the full path runs several."""
    layer = _layer(cell)
    x, dy = _data(0)
    for _ in range(3):  # (planned from the second call; the third ran planned)
        layer.forward(x)
        layer.backward(dy)
    assert layer._plan is not None and layer._plan.backward_pass is not None
    stub_chains()
    grads = {name: g.copy() for name, g in layer.grads.items()}
    assert _array_work(lambda: layer.forward(x)) == 0
    assert _array_work(lambda: layer.backward(dy)) == 0
    for name, g in layer.grads.items():
        np.testing.assert_array_equal(g, grads[name])
    layer._plan = None  # the full path: its products and copies beside the chains
    assert _array_work(lambda: (layer.forward(x), layer.backward(dy))) > 8


def test_a_strided_input_is_copied_inside_the_chain(settings, monkeypatch, stub_chains):
    """A layer API call on a strided view of its input (batch-major memory seen time-major) is
    planned too: the plan copies it into the call's contiguous input inside its chain, bitwise
    the full path, with nothing beside the chain."""
    hits = _Hits(monkeypatch)
    planned, full = _layer("LSTM"), _layer("LSTM")
    for seed in range(4):
        x, dy = _data(seed)
        strided = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
        assert not strided.flags.c_contiguous
        got = _step(planned, strided, dy)
        full._plan = None
        for a, b in zip(got, _step(full, x, dy)):
            np.testing.assert_array_equal(a, b)
    assert (hits.forwards, hits.backwards) == (2, 1)
    stub_chains()
    assert _array_work(lambda: planned.forward(strided)) == 0
    assert hits.forwards == 3


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_the_layer_apis_held_results_are_never_returned(settings, grid_path, monkeypatch, cell):
    """The layer API's plan keeps its forward's results (y, cs, saved) as its own, rewritten by
    every call (its backward reads only the last forward's): what a call returns is new - an
    earlier call's output and states stay as they were, and a caller writing into them changes
    no gradient. Against a layer that never plans; sabotage: the output made the held ``y``
    fails it."""
    hits = _Hits(monkeypatch)
    planned, full = _layer(cell), _layer(cell)
    for seed in range(3):  # (calls 1 and 2 plan the forward, call 3 the backward)
        x, dy = _data(seed)
        planned.forward(x)
        planned.backward(dy)
    (x, dy), (x2, _) = _data(3), _data(4)
    y, hn = planned.forward(x2)  # (planned: the held results hold x2's)
    kept = _flat(y, hn)
    planned.zero_grad()
    y4, hn4 = y, hn
    y, hn = planned.forward(x)  # (planned: rewrites the held results)
    for a, b in zip(_flat(y4, hn4), kept):  # (call 4's output and states stay call 4's)
        np.testing.assert_array_equal(a, b)
    returned = _flat(y, hn)
    for a in (y, *(hn if isinstance(hn, tuple) else (hn,))):  # (the caller's to write)
        a[...] = np.nan
    got = _flat(*planned.backward(dy)) + [g.copy() for g in planned.grads.values()]
    full._plan = None  # (the reference never plans)
    want_y, want_hn = full.forward(x)
    want = _flat(*full.backward(dy)) + [g.copy() for g in full.grads.values()]
    for a, b in zip(returned + got, _flat(want_y, want_hn) + want):
        np.testing.assert_array_equal(a, b)
    assert (hits.forwards, hits.backwards) == (3, 1)


@pytest.mark.parametrize("half", [None, "float16"], ids=["float32", "float16"])
def test_a_layers_gradients_replaced_are_what_the_plan_adds_into(settings, grid_path,
                                                                 monkeypatch, half):
    """The planned backward adds into the layer's ``grads`` arrays it holds with its fixed ones
    (``Plan._keep_sums``); a caller who puts new arrays there gets them summed into, bitwise as
    the full path, the chain keyed again (its graph key holds them). Sabotage: the first call's
    arrays kept, or not keyed again, fails it."""
    _numpy_pointers(monkeypatch)
    keys = _issued_keys(monkeypatch)
    hits = _Hits(monkeypatch)
    planned, full = _layer("GRU", dtype=half or "float32"), _layer("GRU", dtype=half or "float32")
    for seed in range(4):  # (calls 1 and 2 plan the forward, call 3 the backward; 4 planned)
        x, dy = (a.astype(planned.dtype) for a in _data(seed))
        planned.forward(x)
        planned.backward(dy)
    x, dy = (a.astype(planned.dtype) for a in _data(4))
    for layer in (planned, full):
        layer.grads = {k: np.full_like(g, 0.5) for k, g in layer.grads.items()}
    full._plan = None
    for layer in (planned, full):
        layer.forward(x)
        layer.backward(dy)
    for name in planned.grads:
        np.testing.assert_array_equal(planned.grads[name], full.grads[name])
    assert hits.backwards == 2
    backward_key = _leaves(keys[-3])  # (the planned call's backward, before the full ones')
    assert all(chain_graphs.value(g) in backward_key for g in planned.grads.values())


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
 # (an Elman cell's plan is a GRU's: no c)
def test_planned_calls_equal_full_calls_bitwise(settings, grid_path, monkeypatch, cell):
    hits = _Hits(monkeypatch)
    planned, full = _layer(cell), _layer(cell)
    for seed in range(4):  # call 1 full, call 2 full and planned, then planned
        x, dy = _data(seed)
        got = _step(planned, x, dy)
        full._plan = None  # (the reference never plans)
        want = _step(full, x, dy)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        assert planned.last_run.algo == "persistent"
    assert (hits.forwards, hits.backwards) == (2, 1)


def test_layers_of_one_shape_sharing_gradient_workspaces_accumulate_their_own(
        settings, grid_path, monkeypatch):
    """The layer API's planned backward forms its parameter gradients in workspaces (by name and
    shape: every plan of those shapes on the thread shares them; no per-call arrays) and adds
    them into the layer's ``grads`` inside its chain: two layers of one shape called in turn
    (forward, forward, backward, backward), their gradients accumulating over the calls, are
    bitwise the full path's."""
    hits = _Hits(monkeypatch)
    planned, full = (_layer("GRU", 0), _layer("GRU", 1)), (_layer("GRU", 0), _layer("GRU", 1))
    for seed in range(5):  # (calls 3-5 forward planned, 4-5 backward)
        x, dy = _data(seed)
        results = []
        for layers in (planned, full):
            for layer in full:
                layer._plan = None  # (the reference never plans)
            ys = [layer.forward(x) for layer in layers]
            results.append(_flat(*ys, *[layer.backward(dy) for layer in layers])
                           + [g.copy() for layer in layers for g in layer.grads.values()])
        for a, b in zip(*results):
            np.testing.assert_array_equal(a, b)
    assert (hits.forwards, hits.backwards) == (6, 4)
    first, second = (layer._plan.backward_pass.around.fixed["grads"] for layer in planned)
    assert all(a is b for a, b in zip(first, second))  # (shared)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_planned_calls_with_initial_states(settings, grid_path, monkeypatch, cell):
    """Calls giving initial states are planned too (as given: an array, an LSTM's tuple), bitwise
    the full path's; a list pair, a state of another shape or dtype, none: the full path."""
    hits = _Hits(monkeypatch)
    planned, full = _layer(cell), _layer(cell)
    rng = np.random.default_rng(5)

    def state():
        h = rng.standard_normal((1, 2, H)).astype(np.float32)
        return h if cell == "GRU" else (h, rng.standard_normal((1, 2, H)).astype(np.float32))

    for seed in range(4):
        x, dy = _data(seed)
        _planned_and_full_calls_equal(planned, full, x, dy, state())
    assert (hits.forwards, hits.backwards) == (2, 1)
    x, _ = _data(0)
    if cell == "LSTM":
        planned.forward(x, list(state()))
        with pytest.raises(TypeError, match=r"hx\[1\] must have dtype float32"):
            planned.forward(x, (state()[0], state()[1].astype(np.float64)))
    else:
        with pytest.raises(ValueError, match="hx must have shape"):
            planned.forward(x, state()[:, :1])
    planned.forward(x)
    assert hits.forwards == 2


def test_bad_input_after_planning_gets_the_full_checks(settings):
    layer = _layer("GRU")
    x, dy = _data(0)
    for _ in range(3):
        layer.forward(x)
        layer.backward(dy)
    assert layer._plan is not None
    with pytest.raises(TypeError, match="x must have dtype float32"):
        layer.forward(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"x must have shape"):
        layer.forward(x[..., :2])
    with pytest.raises(TypeError, match="x must be a numpy.ndarray"):
        layer.forward(None)
    with pytest.raises(TypeError, match="x must be a numpy.ndarray"):
        layer.forward(x.tolist())
    layer.forward(x)
    with pytest.raises(ValueError, match="dy must have shape"):
        layer.backward(dy[:2])
    with pytest.raises(TypeError, match="dy must have dtype float32"):
        layer.backward(dy.astype(np.float64))
    layer.backward(np.asfortranarray(dy))  # (not contiguous: the full path, the same values)
    with pytest.raises(CallOrderError):
        layer.backward(dy)


def test_a_changed_input_or_state_takes_the_full_path(settings, monkeypatch):
    hits = _Hits(monkeypatch)
    layer, full = _layer("LSTM"), _layer("LSTM")
    x, dy = _data(0)
    for _ in range(3):
        layer.forward(x)
    assert hits.forwards == 1
    h0 = np.ones((1, 2, H), np.float32)
    for call in (lambda l: l.forward(x, (h0, h0)), lambda l: l.forward(x, lengths=[4, 2]),
                 lambda l: l.forward(_data(1, steps=3)[0])):
        for a, b in zip(_flat(*call(layer)), _flat(*call(full))):
            np.testing.assert_array_equal(a, b)
    assert hits.forwards == 1


def test_new_weights_settings_and_released_workspaces_are_seen(settings, grid_path,
                                                                monkeypatch):
    hits = _Hits(monkeypatch)
    layer = _layer("GRU")
    x, dy = _data(0)
    for _ in range(3):
        _step(layer, x, dy)
    assert hits.forwards == 1
    reference = _layer("GRU", seed=1)

    def check():
        reference.load_params(layer.params)
        reference._plan = None
        for a, b in zip(_step(layer, x, dy), _step(reference, x, dy)):
            np.testing.assert_array_equal(a, b)

    layer.params["weight_hh_l0"] *= 0.5  # in place: the planned call reads it
    check()
    assert hits.forwards == 2
    layer.load_params(_layer("GRU", seed=2).params)  # new arrays: the full path (planned anew)
    check()
    assert hits.forwards == 2
    check()
    assert hits.forwards == 3
    with prnn.override_settings(max_restarts=1):  # other settings: the full path
        check()
    check()  # (and back: the full path again)
    assert hits.forwards == 3
    buffers.release_workspaces()  # the plan's scratch let go: the full path
    check()
    assert hits.forwards == 3
    check()
    assert hits.forwards == 4
    assert layer._plan.generation == buffers.generation()


def test_a_stall_in_a_planned_call_restarts_bitwise(settings, grid_path, monkeypatch):
    prnn.configure(emulation_timeout_ms=200, stack=False)
    hits = _Hits(monkeypatch)
    layer = _layer("GRU")
    x, dy = _data(0, steps=7)
    for _ in range(3):
        plain = _step(layer, x, dy)
    layer.zero_grad()
    events = _issued_events(layer, monkeypatch)
    with prnn.inject_stall(block=1, step=3, duration_ms=700):
        y, hn = layer.forward(x)
        forward = layer.last_run
        dx, dhx = layer.backward(dy)
    assert events == _one_chain() * 2, events  # (the moved operations once a pass)
    stalled = _flat(y, hn, dx, dhx) + list(layer.grads.values())
    for a, b in zip(plain, stalled):
        np.testing.assert_array_equal(a, b)
    for stats in (forward, layer.last_run):
        assert stats.restarts >= 1 and stats.fallback is None
    assert (hits.forwards, hits.backwards) == (2, 1)  # (the stalled pair planned)


def test_a_cooling_configuration_is_not_planned(settings, grid_path):
    layer = _layer("GRU")
    x, _ = _data(0)
    for _ in range(3):
        layer.forward(x)
    launch.COOLDOWNS.start(layer._plan.engine.key)
    layer.forward(x)
    assert layer.last_run.algo == "gemm" and "co-resident" in layer.last_run.fallback


def test_a_prepared_pass_keys_its_chain_graph_once_but_for_the_calls_arrays(settings,
                                                                          monkeypatch, stub_chains):
    """What a GPU replay is keyed by (``PreparedPass.arguments_key``), with NumPy addresses standing in
    for device pointers: the planned calls' static part is one object, built once; the key
    differs between calls only by the new arrays, and names every argument the full path's
    key names, and everything the operations moved into the chain (``runtime.Around``) read
    and write: the input GEMM's operands, output and bias, the mask's arrays, ``W_hh``, the
    scratch of ``dW_hh``, the parameter gradients' workspaces and the layer's gradients they are
    added into, and this call's input, output, ``h_n`` (``c_n``), ``dy``, ``dh0`` (``dc0``),
    ``dx``. (An LSTM with lengths: every role; a GRU's
    plan and one without lengths have a subset of them.)"""
    cell, lengths = "LSTM", [4, 2]
    _numpy_pointers(monkeypatch)
    keys = []

    def run(key, issue):  # (the chain issued as it is: a replay would issue the same)
        # (the one chain's arguments: an addressed role's value is its address and the layout
        # the static part holds)
        token, addresses, values = key[-1][-1]
        static = token.fixed
        keys.append((static, tuple((a, *layout) for a, layout in zip(addresses, static[5]))
                     + values))
        issue()
        return False
    monkeypatch.setattr(launch.Chain, "on_device", True)
    monkeypatch.setattr(chain_graphs, "run", run)
    layer = _layer(cell)
    x, dy = _data(0)
    kept = []  # (each call's arrays held: new addresses every call)
    for _ in range(5):
        y, hn = layer.forward(x, lengths=lengths)
        kept.append((layer._ctx, y, hn, *layer.backward(dy)))
    plan = layer._plan
    forward, backward = plan.forward_pass, plan.backward_pass
    for i in (3, 4):  # (calls 4 and 5: forward and backward planned; keys: F1 B1 F2 B2 ...)
        for prepared, (static, values) in ((forward, keys[2 * i]), (backward, keys[2 * i + 1])):
            assert static is prepared._static_key
            per_call = dict(zip(static[1] + static[2], values))
            assert set(static[1]) == {"y", "cs", "saved", "h0", "c0", "x"} | (
                {"out", "h_n", "c_n"} if prepared is forward else {"dy", "dc0", "dh0", "dx"})
            names, fixed = static[-1][:2], dict(static[-1][2])
            assert names == tuple(f"Plan._{f}_{'backward' if prepared is backward else 'forward'}"
                                  for f in ("before", "after"))
            assert fixed["mask"] == chain_graphs.value(plan.mask) != (None, None, None)
            if prepared is forward:
                _, y, hn, _, _ = kept[i]
                assert per_call["out"] == chain_graphs.value(y)
                assert per_call["h_n"] == chain_graphs.value(hn[0])
                assert per_call["c_n"] == chain_graphs.value(hn[1])
                assert fixed["gi"] == chain_graphs.value(plan.gi)
                assert fixed["gi"][0] == chain_graphs.value(prepared.args["gi"])[0]
                assert fixed["b_ih"] == chain_graphs.value(layer.params["bias_ih_l0"])
                assert fixed["w_ih_t"] == chain_graphs.value(layer.params["weight_ih_l0"].T)
                assert per_call["x"] == chain_graphs.value(kept[i][0].inputs[0])
            else:
                ctx, _, _, dx, (dh, dc) = kept[i]
                assert per_call["dy_in"] == chain_graphs.value(dy)
                assert per_call["dc0"] == chain_graphs.value(dc)
                assert per_call["dh0"] == chain_graphs.value(dh)
                assert per_call["dx"] == chain_graphs.value(dx)
                assert per_call["x"] == chain_graphs.value(ctx.inputs[0])
                # (the layer's gradients it adds into: held with the fixed arrays, the same
                # objects every call)
                assert fixed["sums"] == tuple(chain_graphs.value(layer.grads[n])
                                              for n in plan.gradient_names)
                # (where they are formed first: the plan's workspaces)
                assert [g[1] for g in fixed["grads"]] == [layer.params[n].shape
                                                          for n in plan.gradient_names]
                assert fixed["w_hh"] == chain_graphs.value(layer.params["weight_hh_l0"])
                assert fixed["w_ih"] == chain_graphs.value(layer.params["weight_ih_l0"])
                assert fixed["dw_hh"][1] == layer.params["weight_hh_l0"].shape
    (static, first), planned = keys[4], keys[6]  # (calls 3 and 4: forwards planned)
    roles = static[1] + static[2]
    assert planned[0] is static and static is forward._static_key
    assert planned[1][roles.index("h0")] == first[roles.index("h0")]  # the zeros
    # (the layer API's plan: the results its backward reads its own, the output this call's)
    assert planned[1][roles.index("y")] == first[roles.index("y")]
    assert planned[1][roles.index("out")] != first[roles.index("out")]
    per_call = {name for name, _ in forward._role_lists()[0]}
    assert per_call == {"y", "saved", "cs", "h0", "c0", "lengths"}
    assert {n for n, _ in static[3]} | per_call == set(forward.args)


def _issued_events(layer, monkeypatch) -> list[str]:
    """From now on, what the chains of ``layer``'s planned passes issue, in order: each chain
    (``launch._issue_chain``) as "chain" ... "end", its pass's launches, its completion, and the
    operations moved into it (``runtime.Around``) as "before" and "after"."""
    events: list[str] = []
    issue, launch_pass, complete = launch._issue_chain, launch.launch_pass, launch.Chain.complete

    def issued(*a):
        events.append("chain")
        issue(*a)
        events.append("end")
    monkeypatch.setattr(launch, "_issue_chain", issued)
    monkeypatch.setattr(launch, "launch_pass", lambda *a: (events.append("launch"),
                                                            launch_pass(*a)))
    monkeypatch.setattr(launch.Chain, "complete", lambda *a, **k: (events.append("complete"),
                                                                   complete(*a, **k)))
    for prepared in (layer._plan.forward_pass, layer._plan.backward_pass):
        a = prepared.around
        prepared.around = runtime.Around(
            lambda *z, f=a.before: (events.append("before"), f(*z)),
            lambda *z, f=a.after: (events.append("after"), f(*z)), a.fixed, a.roles)
    return events


def _one_chain() -> list[str]:
    """A planned pass's events (``_issued_events``): the moved operations inside its chain."""
    from persistent_rnn import settings
    launches = 1 + settings.current().max_restarts  # (the pass and its resume launches)
    return ["chain", "before"] + ["launch"] * launches + ["complete", "after", "end"]


def test_a_planned_call_issues_its_moved_operations_inside_the_chain(settings, monkeypatch):
    """The operations of a planned call moved into its chain (``runtime.Around``) are issued
    by the chain itself (``launch._issue_chain``: what a GPU captures as one graph), the
    ``before`` ones just before the pass's first launch, the ``after`` ones just after the
    completion kernel, once a pass (a stall's restarts: below)."""
    layer = _layer("LSTM")
    x, dy = _data(0)
    for _ in range(3):
        _step(layer, x, dy)
    events = _issued_events(layer, monkeypatch)
    _step(layer, x, dy)  # (bitwise the full path: the tests above)
    assert events == _one_chain() * 2, events


def _lengths_steps(cell: str, planned, full, seeds) -> None:
    """Forward and backward with other lengths every call (a list, then an array), bitwise; the
    input NaN past each length (selected out inside the planned chain: no result sees it)."""
    for seed in seeds:
        x, dy = _data(seed, steps=5)
        lengths = np.random.default_rng(seed).integers(1, 6, 2)
        lengths[0] = 5
        x[lengths[1]:, 1] = np.nan
        _planned_and_full_calls_equal(planned, full, x, dy,
                                      lengths=lengths.tolist() if seed % 2 else lengths)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_calls_with_lengths_are_planned_bitwise(settings, monkeypatch, stub_chains, cell):
    """Lengths (a per-call role of the prepared passes) of other values every call: planned,
    bitwise the full path, the input's selection too inside the chain (stubbed: nothing runs
    beside it); bad lengths after planning get the full path's errors."""
    hits = _Hits(monkeypatch)
    planned, full = _layer(cell), _layer(cell)
    _lengths_steps(cell, planned, full, range(5))
    assert (hits.forwards, hits.backwards) == (3, 2)
    x, dy = _data(0, steps=5)
    with monkeypatch.context() as m:
        stub_chains()
        assert _array_work(lambda: planned.forward(x, lengths=[5, 2])) == 0
        assert _array_work(lambda: planned.backward(dy)) == 0
    assert (hits.forwards, hits.backwards) == (4, 3)
    with pytest.raises(ValueError, match=r"lengths must be in 1\.\.5"):
        planned.forward(x, lengths=[5, 0])
    with pytest.raises(ValueError, match=r"lengths must have shape \(batch,\) = \(2,\)"):
        planned.forward(x, lengths=[5, 2, 1])
    with pytest.raises(TypeError, match="lengths must hold integers"):
        planned.forward(x, lengths=[5.0, 2.0])
    assert hits.forwards == 4


def test_planned_calls_with_the_first_calls_lengths_are_caught(settings, monkeypatch):
    """Sabotage: a prepared backward that keeps the first call's lengths (not a per-call role)
    fails the check above."""
    backward_arrays = runtime.backward_arrays
    monkeypatch.setattr(runtime, "backward_arrays",
                        lambda dy, fwd, h0, c0, lengths=None: backward_arrays(dy, fwd, h0, c0))
    with pytest.raises(AssertionError):
        _lengths_steps("GRU", _layer("GRU"), _layer("GRU"), range(5))


def test_a_planned_input_left_unselected_is_caught(settings, monkeypatch):
    """Sabotage: a planned chain that copies the input instead of selecting it with lengths
    lets the padding's NaN into the gradients: the check above fails."""
    def copied(xp, given, x, lengths, mask):
        if given is not None:
            xp.copyto(x, given)
    monkeypatch.setattr(call_plans, "formed_input", copied)
    with pytest.raises(AssertionError):
        _lengths_steps("GRU", _layer("GRU"), _layer("GRU"), range(5))


# 16-bit layers: tests/test_half_kernels.py's shapes (the emulated 16-bit kernels it builds; H odd:
# the forward's W_hh words are a padded copy, refreshed inside the chain): a cell without a cell
# state in float16 and one with it in bfloat16 (the others with PRNN_TEST_EVERY_KERNEL=1).
HALF_I, HALF_H, HALF_B = 5, 13, 3
HALF_CASES = [("GRU", "float16"), ("LSTM", "bfloat16")] + (
    [("LSTM", "float16"), ("RNN", "float16"), ("GRU", "bfloat16")] if EVERY_KERNEL else [])


def _half_layer(cell: str, dtype: str):
    return getattr(prnn, cell)(HALF_I, HALF_H, algo="persistent", seed=11, dtype=dtype)


def _bits(a) -> np.ndarray:
    """An array's bits (16-bit results: of float16 and bfloat16 alike)."""
    a = np.array(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _half_steps(planned, full, seeds, states: bool, lengths: bool) -> None:
    """Forward and backward calls of ``planned`` and of ``full`` (which never plans), each
    followed by an in-place SGD step of the parameters: every result, gradient and parameter
    bitwise equal, of the layer's dtype (16-bit layers', and projections' of any dtype: input
    size ``HALF_I``, batch ``HALF_B``; stacks and bidirectional layers too)."""
    cell, dtype = planned.cell.has_cell_state, planned.dtype
    hidden = planned.hidden_size
    width = planned.proj_size or hidden
    count = planned.num_layers * planned.directions
    for seed in seeds:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((4, HALF_B, HALF_I)).astype(dtype)
        dy = rng.standard_normal((4, HALF_B, width * planned.directions)).astype(dtype)
        pair = tuple(rng.standard_normal((count, HALF_B, n)).astype(dtype)
                     for n in (width, hidden))
        hx = (pair if cell else pair[0]) if states else None
        given = [4, 2, int(rng.integers(1, 5))] if lengths else None
        results = []
        for layer in (planned, full):
            full._plan = None
            y, hn = layer.forward(x, hx, given)
            dx, dhx = layer.backward(dy)
            results.append(_flat(y, hn, dx, dhx) + [g.copy() for g in layer.grads.values()])
            for name, p in layer.params.items():  # (in place: the plan reads them anew)
                p[...] = (p.astype(np.float32) - 0.1 * layer.grads[name].astype(np.float32))
        for a, b in zip(*results):
            assert a.dtype == b.dtype == dtype
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("cell,dtype", HALF_CASES)
def test_16_bit_planned_calls_equal_full_calls_bitwise(settings, monkeypatch, cell, dtype):
    """A 16-bit layer's calls are planned (``call_plans.HalfPlan``), with and without initial
    states and lengths, bitwise the full path's: outputs, states, input and state gradients in
    the layer's dtype and the gradients accumulated into ``grads`` (in float32, rounded once),
    across in-place updates of the 16-bit weights."""
    hits = _Hits(monkeypatch)
    planned, full = _half_layer(cell, dtype), _half_layer(cell, dtype)
    _half_steps(planned, full, range(4), states=False, lengths=False)
    assert isinstance(planned._plan, call_plans.HalfPlan)
    assert (hits.forwards, hits.backwards) == (2, 1)
    _half_steps(planned, full, range(4, 8), states=True, lengths=True)
    assert (hits.forwards, hits.backwards) == (4, 2)


@pytest.mark.parametrize("cell,dtype,hidden,proj", [("GRU", "float16", HALF_H, 0),
                                                    ("LSTM", "bfloat16", HALF_H, 0),
                                                    ("LSTM", "float32", 12, 6)])
def test_a_16_bit_planned_call_enqueues_everything_inside_its_chain(settings, monkeypatch, stub_chains, cell,
                                                                    dtype, hidden, proj):
    """Issue 26: a 16-bit planned call's conversions run inside its chains too - with the chains
    stubbed, no product, copy, fill, sum or conversion (``astype``) runs beside them: neither the
    initial states' widening nor the results' rounding into the layer's dtype, nor the layer's
    float32 sums of its gradients (which stay as they were) - where the full path runs them. So
    does an LSTM projection's (its dW_hr, W_hr^T's copy; test_projection_persistent.py's
    sizes)."""
    layer = getattr(prnn, cell)(HALF_I, hidden, proj_size=proj, algo="persistent", seed=11,
                                dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, HALF_B, HALF_I)).astype(layer.dtype)
    dy = rng.standard_normal((4, HALF_B, proj or hidden)).astype(layer.dtype)
    h, c = (rng.standard_normal((1, HALF_B, n)).astype(layer.dtype) for n in (proj or hidden,
                                                                            hidden))
    hx = (h, c) if cell == "LSTM" else h
    if dtype == "float32":  # (its plan reads given states in place, through ascontiguousarray)
        hx = None
    for _ in range(3):
        layer.forward(x, hx)
        layer.backward(dy)
    assert layer._plan.backward_pass is not None
    stub_chains()
    monkeypatch.setattr(sys.modules[__name__], "_ARRAY_WORK", _ARRAY_WORK | {"astype"})
    grads = {name: g.copy() for name, g in layer.grads.items()}
    assert _array_work(lambda: layer.forward(x, hx)) == 0
    assert _array_work(lambda: layer.backward(dy)) == 0
    for name, g in layer.grads.items():
        np.testing.assert_array_equal(_bits(g), _bits(grads[name]))
    layer._plan = None
    with np.errstate(over="ignore"):  # (the chains stubbed: the results never written)
        assert _array_work(lambda: (layer.forward(x, hx), layer.backward(dy))) > 12


@pytest.mark.parametrize("sabotage", ["stale W_hh words", "narrowed by truncation"] + (
    ["b_hh widened once", "the first call's dy"] if EVERY_KERNEL else []))
def test_a_missed_16_bit_conversion_in_the_chain_is_caught(settings, monkeypatch, sabotage):
    """Sabotages of the conversions inside a 16-bit plan's chains fail the bitwise check: the
    forward's W_hh words or b_hh not converted anew after an in-place update, results narrowed
    by dropping bits (as ``halves.narrow`` does for values already bfloat16) rather than
    rounded, the backward widening the first planned call's dy rather than this call's."""
    plan = call_plans.HalfPlan
    if sabotage == "stale W_hh words":
        monkeypatch.setattr(call_plans, "_refresh", lambda held, m: None)
    elif sabotage == "b_hh widened once":
        forward_fixed = plan._forward_fixed
        monkeypatch.setattr(plan, "_forward_fixed", lambda self, b_ih, b_hh: {
            **forward_fixed(self, b_ih, b_hh), "b_hh": None})
    elif sabotage == "narrowed by truncation":
        monkeypatch.setattr(call_plans, "_narrowed", lambda xp, out, a: out.view(
            np.uint16).__setitem__(..., a.view(np.uint32) >> 16))
    else:
        before, first = plan._before_backward, {}

        def stale(self, arrays, fixed):
            first.setdefault("dy", arrays["dy_in"].copy())
            before(self, {**arrays, "dy_in": first["dy"]}, fixed)
        monkeypatch.setattr(plan, "_before_backward", stale)
    with pytest.raises(AssertionError):  # (the first planned backward: the fourth call)
        _half_steps(_half_layer("LSTM", "bfloat16"), _half_layer("LSTM", "bfloat16"),
                    range(5 if sabotage == "the first call's dy" else 3), states=False,
                    lengths=False)


# LSTM projections (weight_hr): tests/test_projection_persistent.py's sizes (its emulated
# kernels; 16-bit: H and P odd, both matrices' words padded copies refreshed in the chain).
PROJECTION_CASES = [("float32", 12, 6), ("bfloat16", 9, 5)] + (
    [("float16", 9, 5)] if EVERY_KERNEL else [])


@pytest.mark.parametrize("dtype,hidden,proj", PROJECTION_CASES)
def test_projection_calls_are_planned_bitwise(settings, monkeypatch, dtype, hidden, proj):
    """An LSTM with a projection (W_hr, h P wide, c H wide) plans its calls too: bitwise the full
    path with initial states and lengths, across in-place weight updates (dW_hr formed inside
    the backward's chain, W_hh^T and W_hr^T copied anew; the calls without states and lengths
    are the 16-bit tests' plans above)."""
    hits = _Hits(monkeypatch)
    planned, full = (prnn.LSTM(HALF_I, hidden, proj_size=proj, algo="persistent", seed=11,
                               dtype=dtype) for _ in range(2))
    _half_steps(planned, full, range(4), states=True, lengths=True)
    assert planned._plan is not None and planned._plan.proj == proj
    assert (hits.forwards, hits.backwards) == (2, 1)


# Stack mode (stack_plans.StackPlan): test_call_allocations' stack shapes (its emulated stack
# kernels, on the grid path), two layers.
ST, SB, SH, SI = 3, 3, 8, 5


class _StackHits:
    """Counts the planned stack forwards and backwards that ran."""

    def __init__(self, monkeypatch):
        self.forwards = self.backwards = 0
        for cls in (stack_plans.StackPlan, stack_plans.PairPlan, layer_plans.LayersPlan):
            self._count(monkeypatch, cls, "forward", "forwards")
            self._count(monkeypatch, cls, "_planned_backward", "backwards")

    def _count(self, monkeypatch, cls, method: str, counter: str) -> None:
        run = cls.__dict__[method]

        def counted(plan, *args):
            setattr(self, counter, getattr(self, counter) + 1)
            return run(plan, *args)
        monkeypatch.setattr(cls, method, counted)


def _stack_layer(cell: str, pair: bool = False, layers: int = 0, stack: bool = True):
    """Two layers in stack mode, or (``pair``) a bidirectional layer's (``layers``: a stack's,
    one by default) two directions side by side (test_call_allocations' pairs at these
    shapes); without ``stack`` (the setting off) one layer-direction per launch."""
    prnn.configure(stack=stack)
    return getattr(prnn, cell)(SI, SH, num_layers=layers or (1 if pair else 2),
                               bidirectional=pair, algo="persistent", seed=3)


def _stack_steps(cell: str, planned, full, seeds, extras: bool) -> None:
    """Training steps of a planned stack and one never planned, bitwise: forward, backward and
    an in-place update of every weight (an optimizer's); ``extras``: initial states and other
    lengths every call (the input NaN past each length)."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((ST, SB, SI)).astype(np.float32)
        dy = rng.standard_normal((ST, SB, SH * planned.directions)).astype(np.float32)
        hx = lengths = None
        if extras:
            lengths = np.array([ST, *rng.integers(1, ST + 1, SB - 1)], np.int32)
            x[lengths[1]:, 1] = np.nan
            shape = (planned.num_layers * planned.directions, SB, SH)
            h = rng.standard_normal(shape).astype(np.float32)
            hx = h if cell == "GRU" else (h, rng.standard_normal(shape).astype(np.float32))
        _planned_and_full_calls_equal(planned, full, x, dy, hx, lengths, sgd=True)


STACK_CASES = [("GRU", True, False, 2), ("LSTM", False, False, 2), ("LSTM", True, False, 2),
               ("GRU", True, True, 1), ("LSTM", True, True, 2)]


@pytest.mark.parametrize("cell,extras,pair,layers", STACK_CASES,
                         ids=[f"{c}-{'states+lengths' if e else 'plain'}-"
                              f"{'pairs' if p else 'stack'}-{n}" for c, e, p, n in STACK_CASES])
def test_stack_mode_calls_are_planned_bitwise(settings, grid_path, monkeypatch, stub_chains,
                                              cell, extras, pair, layers):
    """A two-layer stack that runs in stack mode, and bidirectional layers whose directions run
    side by side (``PairPlan``, one chain per layer: the reversals inside the chains too), plan
    their calls (every operation of the call inside its chains): bitwise the full path's, across
    in-place weight updates, with initial states and lengths or without; with the chains stubbed
    nothing runs beside them, nor the layer API's accumulation (the gradients stay as they
    were)."""
    hits = _StackHits(monkeypatch)
    planned, full = (_stack_layer(cell, pair, layers) for _ in range(2))
    _stack_steps(cell, planned, full, range(4), extras)
    assert type(planned._plan) is (stack_plans.PairPlan if pair else stack_plans.StackPlan)
    assert (hits.forwards, hits.backwards) == (2, 1)
    assert ("side by side" if pair else "stack of 2 layers") in planned.last_run.details[0]
    x = np.ones((ST, SB, SI), np.float32)
    dy = np.ones((ST, SB, SH * planned.directions), np.float32)
    lengths = [ST, 1, 2] if extras else None
    hx = planned._plan.h0 if cell == "GRU" else (planned._plan.h0, planned._plan.c0)
    hx = hx if extras else None
    grads = {name: g.copy() for name, g in planned.grads.items()}
    stub_chains()
    assert _array_work(lambda: planned.forward(x, hx, lengths=lengths)) == 0
    assert _array_work(lambda: planned.backward(dy)) == 0
    assert (hits.forwards, hits.backwards) == (3, 2)
    for name, g in planned.grads.items():
        np.testing.assert_array_equal(g, grads[name])


@pytest.mark.parametrize("pair,stack", [(False, True), (True, True), (True, False)],
                         ids=["stack", "pairs", "layer-directions"])
def test_a_stack_plans_held_activations_are_never_returned(settings, grid_path, monkeypatch,
                                                           pair, stack):
    """The layer API's stack, pair and layer-direction plans keep their forward's activations
    (each layer's y, cs, saved, the layers' outputs, the formed input, the reversal index) as
    their own,
    rewritten by every call, as a single layer's plan does (``test_the_layer_apis_held_results_
    are_never_returned``): a call's output and states stay as they were after the next call, and
    a caller writing into them changes no gradient."""
    hits = _StackHits(monkeypatch)
    planned, full = (_stack_layer("LSTM", pair, 2, stack) for _ in range(2))
    lengths = np.array([ST, 1, 2], np.int32)
    data = []
    for seed in range(5):
        rng = np.random.default_rng(seed)
        data.append((rng.standard_normal((ST, SB, SI)).astype(np.float32),
                     rng.standard_normal((ST, SB, SH * planned.directions)).astype(np.float32)))
    for x, dy in data[:3]:  # (calls 1 and 2 plan the forward, call 3 the backward)
        planned.forward(x, lengths=lengths)
        planned.backward(dy)
    y, hn = planned.forward(data[4][0], lengths=lengths)
    kept = _flat(y, hn)
    planned.zero_grad()
    (x, dy), earlier = data[3], (y, hn)
    y, hn = planned.forward(x, lengths=lengths)  # (rewrites the held activations)
    for a, b in zip(_flat(*earlier), kept):
        np.testing.assert_array_equal(a, b)
    returned = _flat(y, hn)
    for a in (y, *hn):  # (the caller's to write)
        a[...] = np.nan
    got = _flat(*planned.backward(dy)) + [g.copy() for g in planned.grads.values()]
    full._plan = None  # (the reference never plans)
    want_y, want_hn = full.forward(x, lengths=lengths)
    want = _flat(*full.backward(dy)) + [g.copy() for g in full.grads.values()]
    for a, b in zip(returned + got, _flat(want_y, want_hn) + want):
        np.testing.assert_array_equal(a, b)
    assert (hits.forwards, hits.backwards) == (3, 1)


MULTI_CHAIN = [("layers", None), ("layers", "float16"), ("stack", None), ("pairs", "float16")]


@pytest.mark.parametrize("plan,half", MULTI_CHAIN,
                         ids=[f"{p}-{h or 'float32'}" for p, h in MULTI_CHAIN])
def test_multi_chain_plans_add_into_the_layers_gradients_replaced(settings, grid_path,
                                                                  monkeypatch, plan, half):
    """The layer-direction plan (``LayersPlan``: a bidirectional layer, the stack setting off),
    a stack's in stack mode and a bidirectional layer's pairs hold the layer's ``grads`` their
    chains add into as a single layer's plan does (``Plan._keep_sums``,
    ``StackPlan._held_sums``): new arrays there are summed into, bitwise as the full path, and
    every chain keyed again. Sabotage: one chain keyed again only, or a stack plan's sums not
    keyed again, fails it."""
    hits = _StackHits(monkeypatch)
    prnn.configure(stack=plan != "layers")
    shape = {"num_layers": 2} if plan == "stack" else {"bidirectional": True}
    planned, full = (prnn.GRU(SI, SH, algo="persistent", seed=3, dtype=half or "float32",
                              **shape) for _ in range(2))
    _numpy_pointers(monkeypatch)
    keys = _issued_keys(monkeypatch)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((ST, SB, SI)).astype(planned.dtype),
             rng.standard_normal((ST, SB, SH * planned.directions)).astype(planned.dtype))
            for _ in range(5)]
    for x, dy in data[:4]:  # (calls 1 and 2 plan the forward, call 3 the backward; 4 planned)
        planned.forward(x)
        planned.backward(dy)
    for layer in (planned, full):
        layer.grads = {k: np.full_like(g, 0.5) for k, g in layer.grads.items()}
    full._plan = None
    for layer in (planned, full):
        layer.forward(data[4][0])
        layer.backward(data[4][1])
        if layer is planned:  # (its backward's one graph: after the settings, a part a chain)
            chains = [_leaves(part) for part in keys[-1][3:]]
    for name in planned.grads:
        np.testing.assert_array_equal(planned.grads[name], full.grads[name])
    kind = {"layers": layer_plans.LayersPlan, "stack": stack_plans.StackPlan,
            "pairs": stack_plans.PairPlan}[plan]
    assert isinstance(planned._plan, kind) and hits.backwards == 2
    assert len(chains) == (1 if plan != "layers" else 2)
    assert all(chain_graphs.value(g) in chain for chain in chains for g in planned.grads.values())


PLANNED_ROADS = [("layer", True, {}), ("stack", True, {"num_layers": 2}),
                 ("pairs", True, {"bidirectional": True}),
                 ("layer-directions", False, {"bidirectional": True})]


@pytest.mark.parametrize("stack,shape", [(s, k) for _, s, k in PLANNED_ROADS],
                         ids=[name for name, _, _ in PLANNED_ROADS])
def test_a_planned_call_does_not_ask_the_stream_again(settings, grid_path, monkeypatch,
                                                      stub_chains, stack, shape):
    """A planned call's plan has just found the stream not being captured (``matches`` and the
    backward's check: ``call_plans._where``, on a GPU an API call): its chains are enqueued
    without asking again (``launch.run_chain``'s ``captured``), forward and backward, for a
    layer, a stack, pairs and layer-directions - the chains stubbed, as a replay issues none of
    their launches. Sabotage: a plan that does not say so fails it."""
    prnn.configure(stack=stack)
    layer = prnn.GRU(SI, SH, algo="persistent", seed=3, **shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ST, SB, SI)).astype(np.float32)
    dy = rng.standard_normal((ST, SB, SH * layer.directions)).astype(np.float32)
    for _ in range(4):  # (calls 1 and 2 plan the forward, 3 the backward)
        layer.forward(x)
        layer.backward(dy)
    asked = []
    stub_chains()
    monkeypatch.setattr(launch, "capturing", lambda a: asked.append(a) or False)
    layer.forward(x)
    layer.backward(dy)
    assert layer._plan is not None and asked == []


@pytest.mark.parametrize("sabotage", ["weights stacked once", "outputs copied unselected",
                                      "the first call's reversal"])
def test_a_sabotaged_stack_plan_is_caught(settings, grid_path, monkeypatch, sabotage):
    """Sabotage: a planned stack whose forward's chain reads the weights as they were when
    planned (an optimizer's in-place updates unseen), or copies each layer's output where
    lengths select it, or a planned pair whose chain reverses by the first planned call's
    lengths, fails the bitwise check above."""
    cell, pair = "LSTM", False
    if sabotage == "the first call's reversal":
        reversal, done = stack_plans.PairPlan._reversal, set()

        def once(plan, lengths, reverse):
            if id(plan) not in done:  # (the first planned call's lengths, kept)
                done.add(id(plan))
                plan.first_reversal = reverse
                reversal(plan, lengths, reverse)
            else:
                plan.xp.copyto(reverse, plan.first_reversal)
        monkeypatch.setattr(stack_plans.PairPlan, "_reversal", once)
        cell, pair = "GRU", True
    elif sabotage == "weights stacked once":
        layers, frozen = stack_plans.StackPlan._layers, {}

        def stale(plan):
            if id(plan) not in frozen:
                frozen[id(plan)] = [tuple(None if w is None else w.copy() for w in ws)
                                    for ws in layers(plan)]
            return frozen[id(plan)]
        before = stack_plans.StackPlan._before_forward

        def stale_before(plan, call):
            plan._layers = lambda: stale(plan)
            try:
                before(plan, call)
            finally:
                del plan._layers
        monkeypatch.setattr(stack_plans.StackPlan, "_before_forward", stale_before)
    else:
        after = stack_plans.StackPlan._after_forward
        monkeypatch.setattr(stack_plans.StackPlan, "_after_forward",
                            lambda plan, call: after(plan, (*call[:5], None, *call[6:])))
    with pytest.raises(AssertionError):
        _stack_steps(cell, _stack_layer(cell, pair), _stack_layer(cell, pair), range(4), True)


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set (PRNN_TEST_EVERY_KERNEL=1): stalls")
@pytest.mark.parametrize("pair,stack", [(False, True), (True, True), (True, False)],
                         ids=["stack", "pairs", "layer-directions"])
def test_a_stall_in_a_planned_stack_call_restarts_bitwise(settings, grid_path, monkeypatch, pair,
                                                          stack):
    """A stall inside a planned stack's chain restarts it on the device (``stack._run``'s
    resume launches), the operations moved into the chain issued once a pass: bitwise the
    unstalled call; also a stall in a pass of several chains in one graph (two layers of pairs,
    or of layer-directions: ``launch.one_graph``)."""
    prnn.configure(emulation_timeout_ms=200)
    hits = _StackHits(monkeypatch)
    layer = _stack_layer("GRU", pair, 2, stack)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, SB, SI)).astype(np.float32)
    dy = rng.standard_normal((7, SB, SH * layer.directions)).astype(np.float32)
    for _ in range(3):
        plain = _step(layer, x, dy)
    layer.zero_grad()
    with prnn.inject_stall(block=1, step=3, duration_ms=700):
        y, hn = layer.forward(x)
        forward = layer.last_run
        dx, dhx = layer.backward(dy)
    for a, b in zip(plain, _flat(y, hn, dx, dhx) + list(layer.grads.values())):
        np.testing.assert_array_equal(a, b)
    for stats in (forward, layer.last_run):
        assert stats.restarts >= 1 and stats.fallback is None
    assert (hits.forwards, hits.backwards) == (2, 1)


# Stacks and bidirectional layers run one layer-direction per launch (layer_plans.LayersPlan):
# the ``stack`` setting off (a shape with no stack kernel runs the same full path).
LAYERS_CASES = [("GRU", True, 2, False), ("LSTM", False, 2, False), ("LSTM", True, 1, True),
                ("GRU", False, 2, True)] + ([("GRU", False, 1, True), ("LSTM", True, 2, True),
                                             ("GRU", True, 3, False)] if EVERY_KERNEL else [])


@pytest.mark.parametrize("cell,extras,layers,pair", LAYERS_CASES,
                         ids=[f"{c}-{'states+lengths' if e else 'plain'}-{n}-"
                              f"{'bidirectional' if p else 'stack'}"
                              for c, e, n, p in LAYERS_CASES])
def test_layer_direction_calls_are_planned_bitwise(settings, grid_path, monkeypatch,
                                                   stub_chains, cell, extras, layers, pair):
    """A stack or bidirectional layer run one layer-direction per launch plans its calls
    (``LayersPlan``: every layer-direction's chain, with its operations, in one graph a pass):
    bitwise the full path's, across in-place weight updates, with initial states and lengths or
    without; with the chains stubbed nothing runs beside them, nor the layer API's accumulation;
    one graph unit a pass where the full path enqueues one a layer-direction."""
    hits = _StackHits(monkeypatch)
    planned, full = (_stack_layer(cell, pair, layers, stack=False) for _ in range(2))
    _stack_steps(cell, planned, full, range(5), extras)
    assert type(planned._plan) is layer_plans.LayersPlan
    assert (hits.forwards, hits.backwards) == (3, 2)
    x = np.ones((ST, SB, SI), np.float32)
    dy = np.ones((ST, SB, SH * planned.directions), np.float32)
    lengths = [ST, 1, 2] if extras else None
    hx = planned._plan.h0 if cell == "GRU" else (planned._plan.h0, planned._plan.c0)
    hx = hx if extras else None
    with launch.counting() as counted:
        planned.forward(x, hx, lengths=lengths)
        planned.backward(dy)
    chains = 2 * layers * planned.directions
    assert (counted.graph_units, counted.launches) == (
        2, chains * launch.chain_launches(launch.settings.current().max_restarts))
    grads = {name: g.copy() for name, g in planned.grads.items()}
    stub_chains()
    assert _array_work(lambda: planned.forward(x, hx, lengths=lengths)) == 0
    assert _array_work(lambda: planned.backward(dy)) == 0
    assert (hits.forwards, hits.backwards) == (5, 4)
    for name, g in planned.grads.items():
        np.testing.assert_array_equal(g, grads[name])
    full._plan = None
    with launch.counting() as counted:
        full.forward(x, hx, lengths=lengths)
        full.backward(dy)
    assert counted.graph_units == chains


PROJECTION_LAYERS_CASES = [(2, False, True), (1, True, False)] + (
    [(2, True, True), (2, False, False)] if EVERY_KERNEL else [])


@pytest.mark.parametrize("layers,pair,extras", PROJECTION_LAYERS_CASES,
                         ids=[f"{n}-{'bidirectional' if p else 'stack'}-"
                              f"{'states+lengths' if e else 'plain'}"
                              for n, p, e in PROJECTION_LAYERS_CASES])
def test_projection_stacks_are_planned_bitwise(settings, grid_path, monkeypatch, layers, pair,
                                               extras):
    """LSTM projection stacks and bidirectional layers (never in stack mode: one
    layer-direction per launch) plan their calls (``LayersPlan`` with each layer-direction's
    ``W_hr``, ``hs``, ``W_hr^T`` and ``dW_hr``): bitwise the full path, with initial states and
    lengths or without (test_call_plans' projection shapes: H=12, P=6)."""
    hits = _StackHits(monkeypatch)
    planned, full = (prnn.LSTM(SI, 12, num_layers=layers, bidirectional=pair, proj_size=6,
                               algo="persistent", seed=3) for _ in range(2))
    for seed in range(5):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((ST, SB, SI)).astype(np.float32)
        dy = rng.standard_normal((ST, SB, 6 * planned.directions)).astype(np.float32)
        hx = lengths = None
        if extras:
            lengths = np.array([ST, *rng.integers(1, ST + 1, SB - 1)], np.int32)
            x[lengths[1]:, 1] = np.nan
            count = layers * planned.directions
            hx = tuple(rng.standard_normal((count, SB, w)).astype(np.float32) for w in (6, 12))
        _planned_and_full_calls_equal(planned, full, x, dy, hx, lengths, sgd=True)
    assert type(planned._plan) is layer_plans.LayersPlan
    assert (hits.forwards, hits.backwards) == (3, 2)


def test_a_projection_stack_plan_leaving_out_dw_hr_is_caught(settings, grid_path, monkeypatch):
    """Sabotage: a planned projection stack whose backward's chains leave ``dW_hr`` out (the
    gradients' workspace keeps the last full call's) fails the check above."""
    projection_gradient = functional.projection_gradient  # (the chains pass out, the full path not)
    monkeypatch.setattr(functional, "projection_gradient",
                        lambda drs, hs, out=None, half=None: out if out is not None
                        else projection_gradient(drs, hs, out, half))
    with pytest.raises(AssertionError):
        test_projection_stacks_are_planned_bitwise(settings, grid_path, monkeypatch, 2, False,
                                                   False)


@pytest.mark.parametrize("sabotage", ["the reverse input ungathered", "outputs unselected",
                                      "W_hh^T copied once"])
def test_a_sabotaged_layers_plan_is_caught(settings, grid_path, monkeypatch, sabotage):
    """Sabotage: a planned bidirectional stack whose reverse direction reads its input
    projection in time order, or leaves its layers' outputs unselected past the lengths, or
    transposes ``W_hh`` as it was when planned (an optimizer's in-place updates
    unseen), fails the bitwise check above."""
    plan = layer_plans.LayersPlan
    if sabotage == "the reverse input ungathered":
        before = plan._before_forward

        def ungathered(plan, arrays, fixed):
            before(plan, arrays, fixed)
            if fixed["k"] % 2:
                plan.xp.copyto(fixed["gi"], fixed["gi_out"].reshape(fixed["gi"].shape))
        monkeypatch.setattr(plan, "_before_forward", ungathered)
    elif sabotage == "outputs unselected":
        after = plan._after_forward
        monkeypatch.setattr(plan, "_after_forward", lambda plan, arrays, fixed: after(
            plan, dict(arrays, lengths=None), fixed))
    else:
        before, frozen = plan._before_backward, {}

        def stale(plan, arrays, fixed):
            weights = frozen.setdefault((id(plan), fixed["k"]), tuple(
                None if w is None else w.copy() for w in fixed["weights"]))
            before(plan, arrays, dict(fixed, weights=weights))
        monkeypatch.setattr(plan, "_before_backward", stale)
    with pytest.raises(AssertionError):  # (5 steps: the 5th the second planned backward)
        _stack_steps("LSTM", _stack_layer("LSTM", True, 2, stack=False),
                     _stack_layer("LSTM", True, 2, stack=False), range(5), True)


# Batch-first layer API calls (the plans see a time-major view: the input and ``dy`` formed
# inside the chains, ``y`` and ``dx`` returned as views, as the full path returns them).
BATCH_FIRST_CASES = [("GRU", True, 1, False, True), ("LSTM", False, 2, False, True),
                     ("GRU", True, 1, True, True), ("LSTM", False, 2, True, False)]


def _batch_first_steps(cell: str, planned, full, seeds, extras: bool) -> None:
    """``_stack_steps`` of batch-first layers: the input, ``dy`` and results batch-major."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((SB, ST, SI)).astype(np.float32)
        dy = rng.standard_normal((SB, ST, SH * planned.directions)).astype(np.float32)
        hx = lengths = None
        if extras:
            lengths = np.array([ST, *rng.integers(1, ST + 1, SB - 1)], np.int32)
            x[1, lengths[1]:] = np.nan
            shape = (planned.num_layers * planned.directions, SB, SH)
            h = rng.standard_normal(shape).astype(np.float32)
            hx = h if cell == "GRU" else (h, rng.standard_normal(shape).astype(np.float32))
        for y, dx in _planned_and_full_calls_equal(planned, full, x, dy, hx, lengths, sgd=True):
            assert y.shape == (SB, ST, dy.shape[2]) and dx.shape == x.shape


@pytest.mark.parametrize("cell,extras,layers,pair,stack", BATCH_FIRST_CASES,
                         ids=[f"{c}-{'states+lengths' if e else 'plain'}-{n}-"
                              f"{'bidirectional' if p else 'stack'}-"
                              f"{'stack-mode' if s else 'layer-directions'}"
                              for c, e, n, p, s in BATCH_FIRST_CASES])
def test_batch_first_calls_are_planned_bitwise(settings, grid_path, monkeypatch, stub_chains,
                                               cell, extras, layers, pair, stack):
    """A batch-first layer plans its calls on every planned path (a layer's ``Plan``, stack
    mode, pairs, layer-directions): bitwise the full path's, with initial states and lengths or
    without; with the chains stubbed nothing runs beside them (the transposes inside too)."""
    hits, stack_hits = _Hits(monkeypatch), _StackHits(monkeypatch)
    prnn.configure(stack=stack)
    planned, full = (getattr(prnn, cell)(SI, SH, num_layers=layers, bidirectional=pair,
                                         batch_first=True, algo="persistent", seed=3)
                     for _ in range(2))
    _batch_first_steps(cell, planned, full, range(5), extras)
    ran = (hits.forwards + stack_hits.forwards, hits.backwards + stack_hits.backwards)
    assert ran == (3, 2), ran
    x = np.ones((SB, ST, SI), np.float32)
    dy = np.ones((SB, ST, SH * planned.directions), np.float32)
    h = np.zeros((layers * planned.directions, SB, SH), np.float32)
    hx = None if not extras else h if cell == "GRU" else (h, h.copy())
    stub_chains()
    assert _array_work(lambda: planned.forward(x, hx, [ST, 1, 2] if extras else None)) == 0
    assert _array_work(lambda: planned.backward(dy)) == 0
    assert ran == (hits.forwards + stack_hits.forwards - 1,
                   hits.backwards + stack_hits.backwards - 1)


def test_a_batch_first_dy_read_in_place_is_caught(settings, grid_path, monkeypatch):
    """Sabotage: a planned batch-first layer whose backward's pass reads the caller's ``dy``
    time-major without forming it (no copy: rows of the wrong steps) fails the check above."""
    form = call_plans.formed_input
    monkeypatch.setattr(call_plans, "formed_input", lambda xp, given, x, lengths, mask: (
        form(xp, given, x, lengths, mask) if lengths is not None or given is None
        or given.shape[2] != SH else xp.copyto(x, given.transpose(1, 0, 2).reshape(x.shape))))
    prnn.configure(stack=True)
    planned, full = (prnn.GRU(SI, SH, batch_first=True, algo="persistent", seed=3)
                     for _ in range(2))
    with pytest.raises(AssertionError):
        _batch_first_steps("GRU", planned, full, range(5), False)


# 16-bit stacks and bidirectional layers run one layer-direction per launch
# (layer_plans.HalfLayersPlan; H = 13: W_hh's words padded copies, refreshed in the chains).
HALF_LAYERS_CASES = [("GRU", "float16", 2, False, True), ("LSTM", "bfloat16", 1, True, False)] + (
    [("LSTM", "float16", 2, True, True), ("GRU", "bfloat16", 1, True, True),
     ("LSTM", "bfloat16", 2, False, False)] if EVERY_KERNEL else [])


def _half_layers(cell: str, dtype: str, layers: int, pair: bool, proj: int = 0):
    prnn.configure(stack=False)
    return getattr(prnn, cell)(HALF_I, HALF_H, num_layers=layers, bidirectional=pair,
                               proj_size=proj, algo="persistent", seed=11, dtype=dtype)


def _a_16_bit_call_runs_inside_its_chains(planned, hits, cell: str, layers: int, extras: bool,
                                          stub_chains, monkeypatch) -> None:
    """A planned 16-bit multi-layer call with its chains stubbed (``stub_chains``): no product,
    copy, fill, sum or conversion beside them, the plan's hits counted (``hits``), and the
    layer's ``grads`` as they were."""
    x = np.ones((4, HALF_B, HALF_I), planned.dtype)
    dy = np.ones((4, HALF_B, HALF_H * planned.directions), planned.dtype)
    h = np.zeros((layers * planned.directions, HALF_B, HALF_H), planned.dtype)
    hx = None if not extras else h if cell == "GRU" else (h, h.copy())
    lengths = [4, 2, 1] if extras else None
    stub_chains()
    monkeypatch.setattr(sys.modules[__name__], "_ARRAY_WORK", _ARRAY_WORK | {"astype"})
    grads = {name: g.copy() for name, g in planned.grads.items()}
    # (with lengths: validation.lengths' conversion of them on the host, the full path's check)
    assert _array_work(lambda: planned.forward(x, hx, lengths)) == int(extras)
    assert _array_work(lambda: planned.backward(dy)) == 0
    assert (hits.forwards, hits.backwards) == (4, 3)
    for name, g in planned.grads.items():
        np.testing.assert_array_equal(_bits(g), _bits(grads[name]))


@pytest.mark.parametrize("cell,dtype,layers,pair,extras", HALF_LAYERS_CASES,
                         ids=[f"{c}-{d}-{n}-{'bidirectional' if p else 'stack'}-"
                              f"{'states+lengths' if e else 'plain'}"
                              for c, d, n, p, e in HALF_LAYERS_CASES])
def test_16_bit_layer_direction_calls_are_planned_bitwise(settings, monkeypatch, stub_chains,
                                                          cell, dtype, layers, pair, extras):
    """16-bit stacks and bidirectional layers run one layer-direction per launch plan their
    calls with the conversions inside the chains (``HalfLayersPlan``): bitwise the full path's
    results, gradients and sums in the layer's dtype, with initial states and lengths or without,
    across in-place updates of the 16-bit weights; with the chains stubbed no product, copy,
    fill, sum or conversion runs beside them, and ``grads`` stay as they were."""
    hits = _StackHits(monkeypatch)
    planned, full = (_half_layers(cell, dtype, layers, pair) for _ in range(2))
    _half_steps(planned, full, range(5), states=extras, lengths=extras)
    assert type(planned._plan) is layer_plans.HalfLayersPlan
    assert (hits.forwards, hits.backwards) == (3, 2)
    _a_16_bit_call_runs_inside_its_chains(planned, hits, cell, layers, extras, stub_chains,
                                          monkeypatch)


@pytest.mark.parametrize("sabotage", ["stale W_hh words", "narrowed by truncation",
                                      "the upper input unrounded"])
def test_a_missed_16_bit_conversion_in_a_layers_plan_is_caught(settings, monkeypatch,
                                                               stub_chains, sabotage):
    """Sabotages of a 16-bit layers plan's conversions fail the check above: the passes' W_hh
    words (padded copies: H odd) not refreshed after an in-place update, results narrowed by
    dropping bits rather than rounded, an upper layer's product taking its float32 input's
    rounding workspace stale (never written)."""
    if sabotage == "stale W_hh words":
        monkeypatch.setattr(layer_plans, "_refresh", lambda held, m: None)
    elif sabotage == "narrowed by truncation":
        monkeypatch.setattr(layer_plans, "_narrowed", lambda xp, out, a: (
            xp.copyto(out, a) if out.dtype == a.dtype else out.view(np.uint16).__setitem__(
                ..., a.view(np.uint32) >> 16)))
    else:
        narrowed = layer_plans._narrowed
        monkeypatch.setattr(layer_plans, "_narrowed", lambda xp, out, a: None if (
            out.shape == (4 * HALF_B, HALF_H)) else narrowed(xp, out, a))  # (the input's rows)
    with pytest.raises(AssertionError):
        _half_steps(_half_layers("GRU", "bfloat16", 2, False),
                    _half_layers("GRU", "bfloat16", 2, False), range(5), states=False,
                    lengths=False)


# 16-bit stacks in stack mode and 16-bit bidirectional pairs (stack_plans: the weights' 16-bit
# words packed inside the chains; H = 13: odd, their last word padded).
HALF_STACK_CASES = [("GRU", "float16", 2, False, True), ("LSTM", "bfloat16", 2, False, False),
                    ("LSTM", "float16", 1, True, True), ("GRU", "bfloat16", 2, True, False)] + (
    [("LSTM", "bfloat16", 2, True, True), ("GRU", "bfloat16", 3, False, True),
     ("LSTM", "float16", 2, False, True)] if EVERY_KERNEL else [])


def _half_stack(cell: str, dtype: str, layers: int, pair: bool):
    prnn.configure(stack=True)
    return getattr(prnn, cell)(HALF_I, HALF_H, num_layers=layers, bidirectional=pair,
                               algo="persistent", seed=11, dtype=dtype)


@pytest.mark.parametrize("cell,dtype,layers,pair,extras", HALF_STACK_CASES,
                         ids=[f"{c}-{d}-{n}-{'pairs' if p else 'stack'}-"
                              f"{'states+lengths' if e else 'plain'}"
                              for c, d, n, p, e in HALF_STACK_CASES])
def test_16_bit_stack_mode_calls_are_planned_bitwise(settings, monkeypatch, stub_chains, cell,
                                                     dtype, layers, pair, extras):
    """16-bit stacks in stack mode and 16-bit bidirectional layers run as pairs plan their calls
    (``StackPlan`` / ``PairPlan`` with the conversions inside the chains: the weights' 16-bit
    words packed anew every call): bitwise the full path's results, gradients and sums in the
    layer's dtype, with initial states and lengths or without, across in-place updates of the
    16-bit weights; with the chains stubbed no product, copy, fill, sum or conversion runs
    beside them, and ``grads`` stay as they were."""
    hits = _StackHits(monkeypatch)
    planned, full = (_half_stack(cell, dtype, layers, pair) for _ in range(2))
    _half_steps(planned, full, range(5), states=extras, lengths=extras)
    assert type(planned._plan) is (stack_plans.PairPlan if pair else stack_plans.StackPlan)
    assert ("side by side" if pair else f"stack of {layers} layers") in planned.last_run.details[0]
    assert (hits.forwards, hits.backwards) == (3, 2)
    _a_16_bit_call_runs_inside_its_chains(planned, hits, cell, layers, extras, stub_chains,
                                          monkeypatch)


STACK_SABOTAGES = {"stale packed words": (2, False), "narrowed by truncation": (1, True),
                   "the upper input unrounded": (2, True)}


@pytest.mark.parametrize("sabotage", list(STACK_SABOTAGES))
def test_a_missed_16_bit_conversion_in_a_stack_plan_is_caught(settings, monkeypatch, sabotage):
    """Sabotages of a 16-bit stack or pair plan fail the check above: the stacked 16-bit words
    of the weights left as they were first packed (an in-place update unseen), results narrowed
    by dropping bits rather than rounded, an upper pair's product taking its float32 input's
    rounding workspace stale (never written)."""
    layers, pair = STACK_SABOTAGES[sabotage]
    if sabotage == "stale packed words":
        packed = set()

        def once(held, m):  # (each workspace's words packed at the first call only)
            address = held.__array_interface__["data"][0]
            if held.dtype != np.uint32 or address not in packed:
                packed.add(address)
                call_plans._refresh(held, m)
        monkeypatch.setattr(stack_plans, "_refresh", once)
    elif sabotage == "narrowed by truncation":
        monkeypatch.setattr(stack_plans, "_narrowed", lambda xp, out, a: (
            xp.copyto(out, a) if out.dtype == a.dtype else out.view(np.uint16).__setitem__(
                ..., a.view(np.uint32) >> 16)))
    else:
        narrowed = stack_plans._narrowed
        monkeypatch.setattr(stack_plans, "_narrowed", lambda xp, out, a: None if (
            out.shape == (4 * HALF_B, 2 * HALF_H)) else narrowed(xp, out, a))  # (the input's)
    with pytest.raises(AssertionError):
        _half_steps(_half_stack("GRU", "bfloat16", layers, pair),
                    _half_stack("GRU", "bfloat16", layers, pair), range(5), states=False,
                    lengths=False)


def _held_arrays(held) -> list[np.ndarray]:
    """The arrays in ``held`` (a function's closure and defaults: the call's tuples and lists of
    arrays; other objects, the plan and the context, not looked into)."""
    if isinstance(held, np.ndarray):
        return [held]
    if isinstance(held, (tuple, list)):
        return [a for h in held for a in _held_arrays(h)]
    return []


def _unkeyed(read: list[dict], leaves: set) -> set[str]:
    """The names of the arrays among the arguments ``read`` (by name, each launch's or
    operation's) whose value the key's ``leaves`` (``_leaves``) lack - but the chain's own
    words and exchanges, which its own part of the key holds."""
    return {name for named in read for name, v in named.items()
            if isinstance(v, np.ndarray) and not name.startswith("exchange")
            and name not in ("starts", "control", "chain", "ring")
            and chain_graphs.value(v) not in leaves}


def _leaves(key) -> set:
    """Every tuple inside ``key`` (the values of arrays among them: ``chain_graphs.value``), a
    ``chain_graphs.Token``'s parts too."""
    found, todo = set(), [key]
    while todo:
        k = todo.pop()
        if isinstance(k, chain_graphs.Token):
            k = k.fixed
        if isinstance(k, tuple):
            found.add(k)
            todo.extend(k)
    return found


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (nothing launched: values unset)
@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_a_held_call_key_holds_every_launch_argument(settings, monkeypatch, cell):
    """A planned layer call without initial states or lengths, whose arrays by role are copied
    from the plan's held ones (``runtime.holding``): its graph's key (NumPy addresses standing
    in for device pointers) holds the value of every array each launch of its chain reads - the
    held ones (results, zero states) through their part's token, keyed once, the call's own
    (input, outputs, ``dy``, gradients) new every call - but the chain's own words; and every
    array of the call the operations inside its chain work on (``runtime.Around``). Sabotage:
    a held role left out of the held part, or a role out of the per-call addresses, fails it."""
    _numpy_pointers(monkeypatch)
    read, checked, held = [], [], []
    for name in ("_before_forward", "_after_forward", "_before_backward", "_after_backward"):
        def operation(plan, arrays, fixed, f=getattr(call_plans.Plan, name)):
            read.append({role: a for role, a in arrays.items() if role != runtime.HELD})
            f(plan, arrays, fixed)
        monkeypatch.setattr(call_plans.Plan, name, operation)  # (before the plan holds them)
    # (an addressed array's whole value: the key holds its address per call, its layout once)
    monkeypatch.setattr(chain_graphs, "addresses", lambda arrays, roles: tuple(
        chain_graphs.value(arrays[r]) for r in roles))
    monkeypatch.setattr(launch, "launch_pass", lambda engine, control, named, stall: read.append(
        named))
    monkeypatch.setattr(launch.Chain, "complete", lambda chain, kernel, **named: read.append(
        named))

    def run(key, issue):  # (the chain issued: what it reads, against the key)
        read.clear()
        issue()
        leaves, arguments = _leaves(key), key[-1][-1]
        held.append(arguments[1] if len(arguments) == 4 else None)
        checked.append(_unkeyed(read, leaves))
        return False
    monkeypatch.setattr(launch.Chain, "on_device", True)
    monkeypatch.setattr(chain_graphs, "run", run)
    layer = _layer(cell)
    x, dy = _data(0)
    kept = []  # (each call's arrays held: new addresses every call)
    for _ in range(5):
        y, hn = layer.forward(x.copy())
        kept.append((y, hn, layer.backward(dy.copy())))
    assert checked[-4:] == [set()] * 4, checked  # (calls 4 and 5: forward and backward planned)
    assert None not in held[-4:] and held[-4] == held[-2] and held[-3] == held[-1]  # (once)
    assert held[-4] != held[-3]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (nothing launched: values unset)
@pytest.mark.parametrize("cell,pair,stack,lengths", [("GRU", False, True, None),
                                                     ("LSTM", True, True, [ST, 1, 2]),
                                                     ("GRU", False, False, [ST, 1, 2])],
                         ids=["stack", "pairs-lengths", "layer-directions-lengths"])
def test_a_planned_multi_chain_key_holds_every_launch_argument(settings, grid_path, monkeypatch,
                                                               cell, pair, stack, lengths):
    """A planned call of several layers (a stack in stack mode, two layers of pairs, layer-
    directions one per launch): its one graph's key (``launch.one_graph``, NumPy addresses
    standing in for device pointers) holds the value of every array each launch of its chains
    reads - the per-call arrays (outputs, saved buffers, given states and lengths, ``dy`` where
    the kernel reads the caller's: without lengths) new every call - but the chains' own words
    and exchanges, which their chains' part of the key holds; and, in stack mode and as pairs,
    of every array of the call the operations inside its chains work on (``stack.Around``'s:
    the arrays their functions hold). Sabotage: a per-call argument left out of
    ``stack_plans._PER_CALL`` (keyed once with the fixed ones), or an output left out of a
    plan's ``_key``, fails it."""
    _numpy_pointers(monkeypatch)
    # (an addressed array's whole value: the key holds its address per call, its layout once)
    monkeypatch.setattr(chain_graphs, "addresses", lambda arrays, roles: tuple(
        chain_graphs.value(arrays[r]) for r in roles))
    read, checked, operations = [], [], []
    monkeypatch.setattr(launch, "launch_pass", lambda engine, control, named, stall: read.append(
        named))
    monkeypatch.setattr(launch.Chain, "complete", lambda chain, kernel, **named: read.append(
        named))
    around = stack_plans.stack.Around
    monkeypatch.setattr(stack_plans.stack, "Around", lambda before, *rest: operations.append(
        before) or around(before, *rest))

    def run(key, issue):  # (the chains issued: what they read, against the key)
        read.clear()
        issue()
        leaves = _leaves(key)
        missing = _unkeyed(read, leaves)
        missing |= {f"operations' array {a.shape}" for f in operations
                    for a in _held_arrays([c.cell_contents for c in f.__closure__ or ()]
                                          + list(f.__defaults__ or ()))
                    if chain_graphs.value(a) not in leaves}
        operations.clear()
        checked.append(missing)
        return False
    monkeypatch.setattr(launch.Chain, "on_device", True)
    monkeypatch.setattr(chain_graphs, "run", run)
    hits = _StackHits(monkeypatch)
    layer = _stack_layer(cell, pair, 2 if pair else 0, stack)
    rng, kept = np.random.default_rng(0), []
    for _ in range(5):  # (each call's arrays new and held: new addresses every call)
        x = rng.standard_normal((ST, SB, SI)).astype(np.float32)
        h = rng.standard_normal((layer.num_layers * layer.directions, SB, SH)).astype(np.float32)
        given = None if lengths is None else np.array(lengths, np.int32)
        y, hn = layer.forward(x, h if cell == "GRU" else (h, h.copy()), lengths=given)
        kept.append((x, h, given, y, hn, layer.backward(np.ones_like(y))))
    assert (hits.forwards, hits.backwards) == (3, 2)  # (planned: calls 3-5, backwards 4-5)
    assert checked[-4:] == [set()] * 4, checked  # (calls 4 and 5: forward and backward planned)


@pytest.mark.parametrize("path", ["call", "layers", "stack"])
def test_a_planned_16_bit_gradient_product_out_of_tf32_is_caught(settings, monkeypatch, path):
    """Sabotage: a planned 16-bit call whose chain takes its weight gradients' products in fp32
    (``functional.parameter_gradients`` without the layer's ``half``, where the chains call it:
    with ``out``) fails the bitwise checks above - the single layer's, the layer-directions',
    stack mode's."""
    gradients = functional.parameter_gradients

    def fp32(*args, **kw):  # (the chains pass out, scratch and half by position)
        return gradients(*args[:8], **kw)
    monkeypatch.setattr(functional, "parameter_gradients", fp32)
    make = {"call": lambda: _half_layer("LSTM", "float16"),
            "layers": lambda: _half_layers("GRU", "float16", 2, False),
            "stack": lambda: _half_stack("GRU", "float16", 2, False)}[path]
    with pytest.raises(AssertionError):
        _half_steps(make(), make(), range(4), states=False, lengths=False)
