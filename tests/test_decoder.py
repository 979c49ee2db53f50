"""The resident decoder (``persistent_rnn.decoder``, ``cuda_src/resident_decoder.cu``) in the CPU
emulation: ``step(x)`` (each CTA projects its own rows of x W_ih^T) against the float64
reference and the layer's persistent kernel (T=1 calls) to float32 round-off, ``step_projected``
(the caller's projection) bitwise equal to the whole-sequence kernel on the same projected
inputs (the cluster tile and the grid tile); every step bitwise the same run to run and across
idle exits, takeovers by the step kernel and stalls inside steps; the recurrent half computed
ahead between steps bitwise the step computed whole (every cell, a stack, whatever state the
caller passes); its lifetimes (close, garbage collection, an exception in the loop, two
decoders on one module, decoders on two threads, a reset of the context) leave no emulated
kernel running; bad input gets errors naming the argument; a step is one launch and no host
synchronisation; the big-layer rule and the shared-memory limit.

Cheap on purpose (CI): LSTM (and GRU for the launch count) at H=24, B=2, a few steps; the
latency model's decoder prediction (SASS), the sabotaged step kernel and the race detector's
scenario run with PRNN_TEST_EVERY_KERNEL=1.
"""
from __future__ import annotations

import gc
import re
import threading
import time
import weakref
from dataclasses import replace

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import decoder as decoding
from persistent_rnn import emulate, hardware, launch, runtime
from persistent_rnn.cells import CELLS
from persistent_rnn.functional import _projected
from full_set import EVERY_KERNEL

IN, H, B, T = 8, 24, 2, 4
PER_LAYER = dict(stack=False)  # the sequence path: the layer kernel per layer (not stack mode's)
PLACEMENTS = {"cluster": {}, "grid": dict(max_cluster_ctas=0)}  # the emulated H100's, and grid


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """Every test ends with no emulated resident kernel running."""
    yield
    if emulate.running_launches():  # (a decoder in a reference cycle: collected first)
        gc.collect()
    left = emulate.running_launches()
    for handle in left:  # (so that one failure does not spill into the next test)
        handle.join(30)
    assert not left, f"emulated launches still running: {[h.kernel for h in left]}"


def _inputs(seed: int = 1, steps: int = T):
    return np.random.default_rng(seed).standard_normal((steps, B, IN)).astype(np.float32)


def _cell_loop(layer, xs):
    """The layer's persistent kernel one step per call (T=1): each step's output."""
    out, state = [], None
    with prnn.override_settings(**PER_LAYER):
        for x in xs:
            y, state = layer.forward(x[None], state)
            out.append(y[0])
    return out


def _decode(dec, xs, between=None):
    out, state = [], None
    for t, x in enumerate(xs):
        if between is not None:
            between(t)
        y, state = dec.step(x, state)
        out.append(y)
    return out


def _equal(got, want) -> None:
    for t, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"step {t}: max |diff| {np.abs(a - b).max()}"


def _close(got, want, tol: float = 2e-6) -> None:
    """Within float32 round-off (the decoder's projection sums in its own order)."""
    for t, (a, b) in enumerate(zip(got, want)):
        assert np.abs(np.asarray(a, np.float64) - b).max() < tol, f"step {t}"


def _float64_twin(layer):
    twin = type(layer)(layer.input_size, layer.hidden_size, num_layers=layer.num_layers,
                       algo="gemm", dtype="float64")
    twin.load_params({k: v.astype(np.float64) for k, v in layer.params.items()})
    return twin


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_steps_match_float64_and_step_projected_equals_the_sequence_kernel(placement, settings):
    """LSTM (GRU: the torch decoder against torch.nn, test_decoder_torch.py), on the tile the
    layer runs: a cluster's (built as a grid, PRNN_WORD_SPAN) and the grid's."""
    prnn.configure(**PLACEMENTS[placement])
    layer = prnn.LSTM(IN, H, algo="persistent", seed=0)
    xs = _inputs()
    with layer.decoder(batch=B) as dec:
        assert dec.resident and dec.reason is None
        assert ("PRNN_WORD_SPAN" in dec._resident.plans[0].defines) == (placement == "cluster")
        got = _decode(dec, xs)
    # step(x): the projection is the kernel's own (not the sequence path's GEMM): float64's
    # result and the per-step layer kernel's to float32 round-off
    y64, _ = _float64_twin(layer).forward(xs.astype(np.float64))
    _close(got, y64)
    _close(got, _cell_loop(layer, xs))
    # step_projected: the caller's projections, bitwise the whole-sequence kernel on them
    p = layer.params
    w, b = p["weight_ih_l0"], p["bias_ih_l0"]
    gi = np.stack([_projected(x[None], w, b, "test", None)[0].copy()
                   for x in xs])  # (a copy: the product lands in a reused workspace)
    zeros = np.zeros((B, H), np.float32)
    with prnn.override_settings(**PER_LAYER):
        res, stats = runtime.forward(layer.cell, gi, p["weight_hh_l0"], p["bias_hh_l0"], zeros,
                                     zeros, None, "persistent")
    assert stats.algo == "persistent" and "prnn_persistent_forward" in stats.details[0]
    with layer.decoder(batch=B) as dec:  # the caller's projections: the step kernel alone
        state, projected = None, []
        for g in gi:
            y, state = dec.step_projected(g, state)
            projected.append(y)
        with pytest.raises(ValueError, match=r"gi must have shape \(batch, G\*hidden_size\)"):
            dec.step_projected(gi[0][:, 1:])
    _equal(projected, list(res.y))
    _close(projected, y64)


def test_a_two_layer_decoder_matches_float64_and_the_per_layer_kernels():
    layer = prnn.LSTM(IN, H, num_layers=2, algo="persistent", seed=3)
    xs = _inputs(seed=2, steps=3)
    with layer.decoder(batch=B) as dec:
        got = _decode(dec, xs)
        rng = np.random.default_rng(4)
        h0 = tuple(rng.standard_normal((2, B, H)).astype(np.float32) for _ in range(2))
        y, hn = dec.step(xs[0], h0)  # any state, not only the last output
    twin = _float64_twin(layer)
    _close(got, twin.forward(xs.astype(np.float64))[0])
    _close(got, _cell_loop(layer, xs))
    y_ref, hn_ref = twin.forward(xs[:1].astype(np.float64), tuple(a.astype(np.float64) for a in h0))
    _close([y, *hn[0], *hn[1]], [y_ref[0], *hn_ref[0], *hn_ref[1]])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_stack_steps_in_one_launch_bitwise_the_per_layer_chain(kind, settings):
    """A 2-layer decoder's resident side is one launch (both layers' CTAs side by side) and its
    step one step kernel launch that posts and waits layer after layer; its outputs are bitwise
    those of two cell decoders chained (layer 1 fed layer 0's h'), also with every slice of both
    layers taken over by the step kernel, and with step_projected; LSTM also with idle exits
    between steps (one relaunch for both layers) and a CTA of each layer stalled inside a step
    past the idle deadline (GRU and RNN: those too with PRNN_TEST_EVERY_KERNEL=1)."""
    lstm = kind == "LSTM"
    layer = getattr(prnn, kind)(IN, H, num_layers=2, seed=3, algo="persistent")
    p = layer.params
    cells = [getattr(prnn, f"{kind}Cell")(IN if n == 0 else H, H, algo="persistent")
             for n in range(2)]
    for n, cell in enumerate(cells):
        cell.load_params({k: p[f"{k}_l{n}"] for k in cell.params})

    def h_of(state):
        return state[0] if lstm else state

    def parts(state):  # a stack's state as a list of arrays
        return list(state) if lstm else [state]

    xs = _inputs(seed=2, steps=3)
    decs = [cell.decoder(batch=B) for cell in cells]
    want, states = [], [None, None]
    for x in xs:
        for n, dec in enumerate(decs):
            states[n] = dec.step(x if n == 0 else h_of(states[0]), states[n])
        want.append([h_of(states[1]), *(np.stack(s) for s in zip(*map(parts, states)))])
    gi = np.random.default_rng(6).standard_normal((B, layer.cell.gates * H)).astype(np.float32)
    below = h_of(decs[0].step_projected(gi))
    want_gi = [h_of(decs[1].step(below)), below]
    for dec in decs:
        dec.close()

    def decode(between=None, take_over=False):
        with layer.decoder(batch=B) as dec:
            resident = dec._resident
            assert resident.grid == 2 * resident.slices == dec.sms_held and resident.launches == 1
            if take_over:  # every resident CTA idle past its deadline, never relaunched
                dec.step(xs[0])
                dec._resident.running.join(10)
                dec._layers.ensure = lambda: None
            got, state, launches = [], None, dec.relaunches
            with launch.counting() as count:
                for t, x in enumerate(xs):
                    if between is not None:
                        between(t)
                    y, state = dec.step(x, state)
                    got.append([y, *parts(state)])
            relaunched = dec.relaunches - launches
            assert count.launches == len(xs) + relaunched  # one step kernel a step
            if not take_over:
                y, hn = dec.step_projected(gi)
                _equal([y, h_of(hn)[0]], want_gi)
        for a, b in zip(got, want):
            _equal(a, b)
        return relaunched

    decode()
    decode(take_over=True)
    if not (lstm or EVERY_KERNEL):
        return
    prnn.configure(emulation_timeout_ms=20)
    assert decode(between=lambda t: time.sleep(0.1)) >= 1
    # (an idle CTA leaves after the timeout: it must outlast the emulated CTAs' start skew on a
    # loaded machine, or they are never all resident at once for the stall to happen in)
    prnn.configure(emulation_timeout_ms=250)
    with prnn.inject_stall(block=1, step=2, duration_ms=400):  # inside step 2, CTA 1 of each layer
        decode()


def test_an_odd_input_size_and_batch_project_as_float64_and_take_over_bitwise():
    """input_size 131 (not whole quads: x staged element by element; more than one pass of a
    warp's loads), batch 5 (two passes of the projection's batch rows), no bias; a decoder whose
    resident kernel has gone (every slice the step kernel's) gives the same bits."""
    cell = prnn.LSTMCell(131, H, bias=False, seed=7, algo="persistent")
    xs = np.random.default_rng(8).standard_normal((3, 5, 131)).astype(np.float32)
    twin = prnn.LSTMCell(131, H, bias=False, algo="gemm", dtype="float64")
    twin.load_params({k: v.astype(np.float64) for k, v in cell.params.items()})
    with cell.decoder(batch=5) as dec:
        assert dec.resident, dec.reason
        want, state, ref = [], None, None
        for x in xs:
            state = dec.step(x, state)
            ref = twin.forward(x.astype(np.float64), ref)
            want.append(state)
            _close(state, ref)
    with cell.decoder(batch=5) as dec:
        resident = dec._resident
        dec.step(xs[0])
        resident.running.join(30)  # idle exit; no relaunch: the step kernel takes every slice
        dec._layers.ensure = lambda: None
        got, state = [], None
        for x in xs:
            state = dec.step(x, state)
            got.append(state)
    for a, b in zip(got, want):
        _equal(a, b)


def test_w_ih_held_in_shared_memory_or_read_from_l2_gives_the_same_bits(monkeypatch):
    """The plan holds a resident CTA's rows of W_ih in shared memory where they fit a block
    beside the step's (LSTM H=640: 32 rows x 640 columns), else the projection reads them from
    L2; at B=1 (passes of one batch row) both give the same bits, and the float64 step's."""
    lstm, h100 = CELLS["lstm"], hardware.PROFILES["h100"]
    held, _ = decoding.plan(lstm, 640, 1, h100)
    assert held.w_ih_held and held.resident_shared_bytes == held.shared_bytes + 4 * 32 * 640
    wide, _ = decoding.plan(lstm, 640, 1, h100, input_size=2000)  # 256000 B of rows
    assert not wide.w_ih_held and wide.resident_shared_bytes == wide.shared_bytes
    assert "do not fit" in wide.w_ih_note() and "81920 B a CTA" in held.w_ih_note()
    cell = prnn.LSTMCell(37, H, seed=4, algo="persistent")
    xs = np.random.default_rng(5).standard_normal((3, 1, 37)).astype(np.float32)

    def decode():
        with cell.decoder(batch=1) as dec:
            states, state = [], None
            for x in xs:
                state = dec.step(x, state)
                states.append(state)
            return dec._resident.plans[0].w_ih_held, states

    was_held, want = decode()
    plan = decoding.plan  # the same tile, its rows not held (as a plan whose rows do not fit)
    monkeypatch.setattr(decoding, "plan", lambda *a: (
        replace(plan(*a)[0], w_ih_held=False, resident_shared_bytes=plan(*a)[0].shared_bytes), None))
    now_held, got = decode()
    assert was_held and not now_held
    for a, b in zip(got, want):
        _equal(a, b)
    twin = prnn.LSTMCell(37, H, algo="gemm", dtype="float64")
    twin.load_params({k: v.astype(np.float64) for k, v in cell.params.items()})
    state = None
    for x, hc in zip(xs, got):
        state = twin.forward(x.astype(np.float64), state)
        _close(hc, state)


def test_idle_exits_takeovers_and_stalls_keep_the_results_bitwise(settings):
    """Idle past the deadline between steps (the kernel exits, the next step relaunches it or
    takes its slices over), steps taken over by the step kernel alone, and a CTA stalled inside
    a step for longer than the idle deadline: the same bits as an undisturbed decoder."""
    layer = prnn.LSTM(IN, H, algo="persistent", seed=0)
    xs = _inputs(steps=5)
    with layer.decoder(batch=B) as dec:
        want = _decode(dec, xs)
    prnn.configure(emulation_timeout_ms=20)
    with layer.decoder(batch=B) as dec:
        got = _decode(dec, xs, between=lambda t: time.sleep(0.15))  # 0.15 s idle > 20 ms
        assert dec.relaunches >= 1
    _equal(got, want)
    with layer.decoder(batch=B) as dec:
        resident = dec._resident
        dec.step(xs[0])
        resident.running.join(10)  # idle exit; no relaunch: the step kernel takes every slice
        dec._layers.ensure = lambda: None
        got = _decode(dec, xs)
        assert all(int(w) & 3 == decoding.GONE for w in resident.state)
    _equal(got, want)
    # (an idle CTA leaves after the timeout: it must outlast the emulated CTAs' start skew on a
    # loaded machine, or they are never all resident at once for the stall to happen in)
    prnn.configure(emulation_timeout_ms=250)
    with prnn.inject_stall(block=1, step=2, duration_ms=400):  # inside step 2, CTA 1
        with layer.decoder(batch=B) as dec:
            _await_resident(dec)
            got = _decode(dec, xs)
            # the other CTAs went idle while CTA 1 stalled: their slices were taken over (and
            # the launch relaunched once CTA 1 left too)
            gone = [int(w) & 3 == decoding.GONE for w in dec._resident.state]
            assert dec.relaunches >= 1 or any(gone)
    _equal(got, want)


def _await_resident(dec, timeout_s: float = 20.0) -> None:
    """Until every resident CTA has taken its slice (an emulated CTA's thread may start late on
    a loaded machine: its slice's first steps are then the step kernel's, and a stall injected
    there would never happen)."""
    deadline = time.monotonic() + timeout_s
    while any(int(w) & 3 == decoding.GONE for w in dec._resident.state):
        assert time.monotonic() < deadline, "the resident CTAs did not start"
        time.sleep(0.001)


def _ahead_counts(dec) -> tuple[int, int]:
    """The emulation's count of resident steps that used their recurrent half computed ahead,
    and that recomputed it (resident_decoder.cu, prnn_emu_decoder_ahead): the module's, all
    decoders on it together."""
    import ctypes
    counts = (ctypes.c_ulonglong * 2).in_dll(dec._layers.module._lib, "prnn_emu_decoder_ahead")
    return counts[0], counts[1]


def _every_kernel(*params):
    return pytest.param(*params, marks=pytest.mark.skipif(
        not EVERY_KERNEL, reason="two more emulation builds (~8 s): PRNN_TEST_EVERY_KERNEL=1"))


@pytest.mark.parametrize("kind,placement", [
    ("LSTMCell", "cluster"), ("LSTMCell", "grid"), ("GRUCell", "cluster"), ("RNNCell", "cluster"),
    ("LSTM", "cluster"), _every_kernel("GRUCell", "grid"), _every_kernel("RNNCell", "grid")])
def test_the_recurrent_half_computed_ahead_gives_todays_bits(kind, placement, settings):
    """Between steps each resident CTA computes W_hh h_{t-1} + b_hh from the layer's own last h'
    (the post's h_{t-1} is compared with it, bit for bit, before use): the steps are bitwise the
    step kernel's alone (every slice taken over: the whole step computed at once, as before),
    whether the caller passes back the decoder's last output (the ahead sums used), that output
    changed in place (the same address, other bits: recomputed; in a 2-layer stack ("LSTM")
    layer 1's h only), another array with its bits, or a new state."""
    prnn.configure(**PLACEMENTS[placement])
    stack = kind == "LSTM"
    module = (prnn.LSTM(IN, H, num_layers=2, seed=4, algo="persistent") if stack
              else getattr(prnn, kind)(IN, H, seed=4, algo="persistent"))
    xs = _inputs(seed=9, steps=6)

    def with_h(state, h):  # the state with h replaced
        return (h, state[1]) if isinstance(state, tuple) else h

    def decode(dec):
        out, state = [], None
        for t, x in enumerate(xs):
            h = state[0] if isinstance(state, tuple) else state
            if t == 3:
                h.reshape(-1, B, H)[-1, 0, 1] += 0.5  # in place: the ahead sums are for old bits
            elif t == 4:
                state = with_h(state, h.copy())  # the same bits, elsewhere
            elif t == 5:
                fresh = np.random.default_rng(10).standard_normal(h.shape)
                state = with_h(state, fresh.astype(np.float32))
            time.sleep(0.02)  # (the caller's kernels: time for the ahead sums)
            if stack:
                y, state = dec.step(x, state)
                out.append([y, *state])
            else:
                state = dec.step(x, state)
                out.append(list(state) if isinstance(state, tuple) else [state])
        return out

    idle_ms = prnn.settings.current().emulation_timeout_ms
    prnn.configure(emulation_timeout_ms=20)
    with module.decoder(batch=B) as dec:
        dec.step(xs[0])
        dec._resident.running.join(30)  # idle exits: the step kernel takes every slice
        dec._layers.ensure = lambda: None
        want = decode(dec)
    prnn.configure(emulation_timeout_ms=idle_ms)
    with module.decoder(batch=B) as dec:
        before = _ahead_counts(dec)
        got = decode(dec)
        used, recomputed = (a - b for a, b in zip(_ahead_counts(dec), before))
        grid, layers = dec._resident.slices, len(dec._resident.plans)
    for a, b in zip(got, want):
        _equal(a, b)
    # both paths ran: steps 1, 2 and 4 (the last output's bits) use the ahead sums in each CTA
    # that had them ready, steps 3 (the top layer) and 5 (every layer) recompute them there
    # (undisturbed, exactly: used 3 * grid * layers + grid * (layers - 1), recomputed
    # grid * (1 + layers); a CTA late for a step - a loaded machine - counts in neither)
    assert used > 0 and 0 < recomputed <= grid * (1 + layers), (used, recomputed, grid)
    assert used + recomputed <= grid * layers * (len(xs) - 1), (used, recomputed, grid)


@pytest.mark.skipif(not EVERY_KERNEL, reason="a sabotaged build (~4 s): PRNN_TEST_EVERY_KERNEL=1")
def test_a_step_kernel_that_skips_the_takeover_is_caught(tmp_path, monkeypatch):
    """The takeover check above fails on a sabotaged step kernel that counts a gone slice as done
    (its outputs are then never written)."""
    from sabotage import sabotaged
    src = sabotaged(tmp_path, decoding.SOURCE, "if ((v >> 2) >= step) {",
                    "if ((v >> 2) >= step || (v & 3u) == kGone) {")
    monkeypatch.setattr(decoding, "_module",
                        lambda xp, defines: emulate.get_module(decoding.SOURCE, defines, src))
    layer = prnn.LSTM(IN, H, algo="persistent", seed=0)
    xs = _inputs(steps=2)
    want = _cell_loop(layer, xs)  # (as the decoder's to round-off: test_steps_match_float64...)
    with layer.decoder(batch=B) as dec:
        resident = dec._resident
        state = dec.step(xs[0])[1]
        resident.running.join(30)  # idle exit, and no relaunch: every slice gone
        dec._layers.ensure = lambda: None
        y, _ = dec.step(xs[1], state)
    assert not np.allclose(y, want[1], atol=1e-3)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_busy_gpu_runs_the_decoder_partly_resident(layers, settings):
    """One resident CTA at a time (``emulation_max_resident``: a GPU whose other work holds the
    SMs; a stack's upper layer's CTAs start only after its lower layer's have left): the slices
    whose CTAs cannot start are the step kernel's, the same bits."""
    layer = prnn.LSTM(IN, H, num_layers=layers, algo="persistent", seed=0)
    xs = _inputs(steps=3)
    with layer.decoder(batch=B) as dec:
        want = _decode(dec, xs)
    prnn.configure(emulation_max_resident=1, emulation_timeout_ms=50)
    with layer.decoder(batch=B) as dec:
        assert dec._resident.grid > layers
        got = _decode(dec, xs)
    _equal(got, want)


@pytest.mark.parametrize("seed", [3])  # (seeds 0-12 pass: run by hand)
def test_a_weaker_machine_keeps_the_results_bitwise(seed, settings):
    """Every seeded mode of the emulation at once (random fiber order and stalls, stores landing
    late, cp.async late, a jumpy timer, CTAs started in random order) with a short deadline: the
    post, the takeovers and the relaunches still give the undisturbed bits."""
    layer = prnn.LSTM(IN, H, algo="persistent", seed=0)
    xs = _inputs(steps=4)
    with layer.decoder(batch=B) as dec:
        want = _decode(dec, xs)
    prnn.configure(emulation_timeout_ms=20)
    with emulate.modes("shuffle", "schedule", "delayed", "late_copies", "jumpy_timer", seed=seed):
        with layer.decoder(batch=B) as dec:
            got = _decode(dec, xs, between=lambda t: time.sleep(0.05 * (t % 2)))
    _equal(got, want)


def test_close_gc_and_an_exception_leave_nothing_running():
    cell = prnn.LSTMCell(IN, H, seed=0, algo="persistent")
    x = _inputs()[0]
    dec = cell.decoder(batch=B)
    state = weakref.ref(dec._resident.state)
    h, c = dec.step(x)
    dec.close()
    dec.close()  # idempotent
    assert dec.closed and not emulate.running_launches() and state() is None
    with pytest.raises(RuntimeError, match="closed decoder"):
        dec.step(x, (h, c))
    dec = cell.decoder(batch=B)
    dec.step(x)
    del dec
    gc.collect()
    assert not emulate.running_launches()
    with pytest.raises(KeyError):
        with cell.decoder(batch=B) as dec:
            dec.step(x)
            raise KeyError("the caller's loop failed")
    assert dec.closed and not emulate.running_launches()


@pytest.mark.parametrize("layers", [1, 2])
def test_close_ends_the_resident_kernel_at_once_not_at_its_idle_deadline(layers, monkeypatch):
    """close() posts STOP to every layer's mailbox, which every waiting resident CTA sees at its
    next poll: the launch ends within seconds under an idle deadline of a minute of wall time
    (the realtime clock), and the steps before it are bitwise those of a decoder left to exit
    idle. (A timed decode loop may end with it instead of a device-wide sync, which waits for
    the idle exit.) A kernel that ignores STOP fails here, at ``JOIN_S`` (made 5 s)."""
    monkeypatch.setattr(decoding, "JOIN_S", 5.0)
    layer = prnn.LSTM(IN, H, num_layers=layers, seed=7, algo="persistent")
    xs = _inputs(seed=7, steps=3)
    with prnn.override_settings(emulation_timeout_ms=20):
        with layer.decoder(batch=B) as dec:
            want = _decode(dec, xs)
    with prnn.override_settings(emulation_timeout_ms=60_000), emulate.modes("realtime"):
        dec = layer.decoder(batch=B)
        got = _decode(dec, xs)
        t0 = time.monotonic()
        dec.close()
        took = time.monotonic() - t0
    assert not emulate.running_launches() and dec.relaunches == 0
    assert took < 5.0, f"close() took {took:.1f} s"
    _equal(got, want)


def test_a_reset_context_closes_the_decoder_with_a_clear_error(monkeypatch, settings):
    """A device reset (emulate.reset_context: the resident launch killed, its device memory
    poisoned, later queries failing as cudaStreamQuery does on a destroyed context): the next
    step raises DecoderContextLost naming what happened and what to do, the decoder is closed,
    close() and garbage collection neither hang nor raise, whether the resident kernel was
    waiting or had gone idle; a new decoder then steps as before."""
    unraisable: list = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    cell = prnn.LSTMCell(IN, H, seed=0, algo="persistent")
    x = _inputs()[0]
    with cell.decoder(batch=B) as dec:
        want = dec.step(x, dec.step(x))
    dec = cell.decoder(batch=B)
    state = dec.step(x)
    resident = dec._resident
    emulate.reset_context()
    assert not emulate.running_launches()
    assert int(resident.box[0]) == 0xFFFFFFFF  # (the resident kernel's memory: poisoned)
    with pytest.raises(decoding.DecoderContextLost, match="context was reset.*make a new decoder"):
        dec.step(x, state)
    assert dec.closed and not emulate.running_launches()
    with pytest.raises(RuntimeError, match="closed decoder: .*context was reset"):
        dec.step(x, state)
    dec.close()
    prnn.configure(emulation_timeout_ms=20)
    idle = cell.decoder(batch=B)  # reset while idle: its launch ended before the reset
    idle._resident.running.join(10)
    emulate.reset_context()
    with pytest.raises(decoding.DecoderContextLost):
        idle.check()
    assert idle.closed
    idle = cell.decoder(batch=B)
    idle._resident.running.join(10)
    emulate.reset_context()
    del idle
    gc.collect()
    assert not unraisable and not emulate.running_launches()
    with cell.decoder(batch=B) as dec:
        _equal(dec.step(x, dec.step(x)), want)


def test_two_decoders_on_one_module_and_on_two_threads():
    cell = prnn.LSTMCell(IN, H, seed=5, algo="persistent")
    xs = _inputs(steps=3)

    def loop(dec, out):
        h = None
        for x in xs:
            h = dec.step(x, h)
            out.append(h)

    want: list = []
    with cell.decoder(batch=B) as dec:
        loop(dec, want)
    a, b = cell.decoder(batch=B), cell.decoder(batch=B)  # interleaved, one module
    got_a, got_b, h_a, h_b = [], [], None, None
    for x in xs:
        h_a = a.step(x, h_a)
        h_b = b.step(x, h_b)
        got_a.append(h_a)
        got_b.append(h_b)
    a.close()
    b.close()
    _equal(got_a, want)
    _equal(got_b, want)
    outs = [[], []]
    decs = [cell.decoder(batch=B) for _ in outs]
    threads = [threading.Thread(target=loop, args=(d, o)) for d, o in zip(decs, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for d in decs:
        d.close()
    for out in outs:
        _equal(out, want)


def test_bad_input_gets_errors_naming_the_argument():
    cell = prnn.LSTMCell(IN, H, seed=0, algo="persistent")
    x = _inputs()[0]
    hc = (np.zeros((B, H), np.float32), np.zeros((B, H), np.float32))
    with pytest.raises(ValueError, match="batch"):
        cell.decoder(batch=0)
    with cell.decoder(batch=B) as dec:
        with pytest.raises(ValueError, match="x has batch size 3.*batch=2"):
            dec.step(np.zeros((3, IN), np.float32))
        with pytest.raises(ValueError, match=r"x must have shape \(batch, input_size\)"):
            dec.step(np.zeros((B, IN + 1), np.float32))
        with pytest.raises(TypeError, match="x must have dtype float32"):
            dec.step(x.astype(np.float64))
        with pytest.raises(TypeError, match="x must be a numpy.ndarray or cupy.ndarray"):
            dec.step(x.tolist())
        with pytest.raises(ValueError, match=r"state\[1\] must have shape \(batch, hidden_size\)"):
            dec.step(x, (hc[0], np.zeros((B, H + 1), np.float32)))
        with pytest.raises(TypeError, match="state must be a pair"):
            dec.step(x, hc[0])
        with pytest.raises(TypeError, match=r"state\[0\] must have dtype float32"):
            dec.step(x, (hc[0].astype(np.float64), hc[1]))
        dec.step(x, hc)  # still usable after the errors


def test_a_step_is_one_launch_and_no_host_synchronisation():
    cell = prnn.GRUCell(IN, H, seed=5, algo="persistent")
    xs = _inputs()
    with cell.decoder(batch=B) as dec:
        h = dec.step(xs[0])
        before = dec.relaunches  # (idle exits: the virtual clock runs while every CTA waits)
        with launch.counting() as n:
            for x in xs[1:]:
                h = dec.step(x, h)
        relaunched = dec.relaunches - before
    # (the projection is the step kernel's and the resident kernel's own work: on a GPU too)
    assert n.launches == len(xs) - 1 + relaunched and n.host_syncs == 0


def test_the_big_layer_rule_and_float64_fall_back_with_a_reason():
    lstm = CELLS["lstm"]
    h100 = hardware.PROFILES["h100"]
    for hidden in (640, 1024):  # grids of 80 and 128 CTAs: one SM left for the step kernel
        fits, why = decoding.plan(lstm, hidden, 1, h100)
        assert fits is not None and why is None and fits.grid < h100.sm_count
    whole, why = decoding.plan(lstm, 1024, 1, replace(h100, sm_count=128))
    assert whole is None and "grid < SM count" in why
    # a stack: its layers' grids together (2 x 80 CTAs at H=640; 2 x 16 at H=256)
    plans, why = decoding.plan_layers(lstm, 640, 1, h100, 640, 2)
    assert plans == [] and "its 2 layers' kernels take the whole GPU (160 CTAs" in why
    plans, why = decoding.plan_layers(lstm, 256, 1, h100, 64, 2)
    assert why is None and [p.input_size for p in plans] == [64, 256]
    # the staged x grows the shared memory with input_size and batch: past a block, refused
    small, _ = decoding.plan(lstm, 256, 4, h100, input_size=14000)
    big, why = decoding.plan(lstm, 256, 4, h100, input_size=15000)
    assert small is not None and small.shared_bytes > 4 * 4 * 14000 and big is None
    assert "shared memory" in why and "input_size 15000" in why
    cell = prnn.LSTMCell(15000, 8, seed=0, algo="persistent")
    with pytest.warns(RuntimeWarning, match="shared memory"):
        dec = cell.decoder(batch=4)
    with dec:
        assert not dec.resident and "input_size 15000" in dec.reason
        x = np.random.default_rng(0).standard_normal((4, 15000)).astype(np.float32)
        gemm = prnn.LSTMCell(15000, 8, seed=0, algo="gemm")  # (the GEMM step on NumPy)
        assert all(np.array_equal(a, b) for a, b in zip(dec.step(x), gemm.forward(x)))
    cell = prnn.GRUCell(IN, H, dtype="float64", seed=0, algo="persistent")
    x = _inputs()[0].astype(np.float64)
    with pytest.warns(RuntimeWarning, match="float64"):
        dec = cell.decoder(batch=B)
    with dec:
        assert not dec.resident
        gemm = prnn.GRUCell(IN, H, dtype="float64", seed=0, algo="gemm")
        assert np.array_equal(dec.step(x), gemm.forward(x))


@pytest.mark.parametrize("algo", ["auto", "gemm"])
def test_a_numpy_decoder_steps_as_its_cells_algo_chooses(algo):
    """The cell's or layer's ``algo`` as its calls take it: "gemm", and "auto" on NumPy arrays
    (the emulation is a test path), run the GEMM step each step - no resident kernel, no
    warning, its reason said - bitwise the cell's own step; "persistent" is resident (above)."""
    import warnings
    x = _inputs()[0]
    for module in (prnn.LSTMCell(IN, H, seed=0, algo=algo),
                   prnn.LSTM(IN, H, num_layers=2, seed=0, algo=algo)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dec = module.decoder(batch=B)
        with dec:
            assert not dec.resident and dec.sms_held == 0 and f"algo='{algo}'" in dec.reason
            state = dec.step(x)
        if isinstance(module, prnn.LSTMCell):
            assert all(np.array_equal(a, b) for a, b in zip(state, module.forward(x)))
        else:  # (a layer's step: its top layer's h', and the (L, B, H) state)
            y, (h, c) = module.forward(x[None])
            out, (dh, dc) = state
            assert np.array_equal(out, y[0]) and np.array_equal(dh, h) and np.array_equal(dc, c)


@pytest.mark.parametrize("hidden,batch", [(1024, 1), (256, 4)])
def test_the_kernels_compile_for_the_gpu_without_spills(hidden, batch):
    """NVRTC builds both kernels of the largest resident grid tile (LSTM H=1024, B=1: its weights
    take the most registers) and of a cluster tile (H=256, B=4, PRNN_WORD_SPAN) for sm_90 with
    no stack frame and no spills."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels
    dp, _ = decoding.plan(CELLS["lstm"], hidden, batch, hardware.PROFILES["h100"])
    assert ("PRNN_WORD_SPAN" in dp.defines) == (hidden == 256)
    log = kernels.compile_source(decoding.SOURCE, dp.defines, "sm_90").log
    frames = re.findall(r"Function properties for (\w+)\n[^\n]*?(\d+) bytes stack frame, (\d+) bytes "
                        r"spill stores, (\d+) bytes spill loads", log)
    assert sorted(f[0] for f in frames) == ["prnn_decoder_step", "prnn_resident_decoder"]
    assert all(f[1:] == ("0", "0", "0") for f in frames), log


@pytest.mark.skipif(not EVERY_KERNEL, reason="reads SASS (NVRTC and nvdisasm, ~3 s): "
                    "PRNN_TEST_EVERY_KERNEL=1")
def test_the_held_rows_of_w_ih_are_read_from_shared_memory():
    """The resident kernel's SASS (sm_90, LSTM H=640 B=1): the projection's column loops over
    the held rows (passes of 1 and of 4 batch rows: 8 and 32 FFMA, unrolled twice) load from
    shared memory only; those over rows in global memory (a plan that does not hold them) load
    W_ih with LDG."""
    from persistent_rnn import kernels
    from persistent_rnn.sass_analysis import disassemble, nvdisasm, parse
    if nvdisasm() is None:
        pytest.skip("nvdisasm is not installed")
    dp, _ = decoding.plan(CELLS["lstm"], 640, 1, hardware.PROFILES["h100"])
    cubin = kernels.compile_source(decoding.SOURCE, dp.defines, "sm_90").cubin_path
    code, labels = parse(disassemble(cubin, nvdisasm()).split(".text.prnn_resident_decoder")[-1])
    loops = [[op.split(".")[0] for op, *_ in code[labels[to]:i + 1]]
             for i, (op, _, to, _) in enumerate(code)
             if op.startswith("BRA") and to in labels and labels[to] < i]
    columns = [ops for ops in loops if ops.count("FFMA") >= 8 and "SHFL" not in ops and len(ops) < 100]
    held = [ops.count("FFMA") for ops in columns if "LDS" in ops and not {"LDG", "LD"} & set(ops)]
    from_l2 = [ops.count("FFMA") for ops in columns if "LDG" in ops]
    assert sorted(held) == [8, 32] and sorted(from_l2) == [8, 32], columns


@pytest.mark.skipif(not EVERY_KERNEL, reason="reads SASS (NVRTC and nvdisasm, ~5 s): "
                    "PRNN_TEST_EVERY_KERNEL=1")
def test_prnn_plan_predicts_a_decoder_step(capsys, monkeypatch):
    """The latency model's decoder terms add up (predictions; the SASS of LSTM H=640 B=1's grid
    forward), and the CLI prints them."""
    from persistent_rnn import latency
    from persistent_rnn.sass_analysis import nvdisasm
    if nvdisasm() is None:
        pytest.skip("nvdisasm is not installed")
    d = latency.predict_decoder_step("LSTM", 640, 1, device="h100")
    assert d["prediction"] and d["resident"] and d["ctas"] == 80 and d["launches_per_step"] == 1
    gap = hardware.GRAPH_GAP_US
    assert d["projected_us"] == pytest.approx(gap + d["handoff_us"] + d["resident_step_us"])
    # the post seen by the 80 resident CTAs and their done words seen by the step kernel, each
    # the exchange round measured at 80 CTAs; x staged, one L2 round trip
    round_us = hardware.exchange_round_ns(hardware.EXCHANGE_ROUND_NS, 80) / 1000
    trip = hardware.L2_LATENCY / hardware.PROFILES["h100"].clock_mhz
    assert d["handoff_us"] == pytest.approx(2 * round_us + trip)
    assert d["captured_us"] == pytest.approx(d["projection_us"] + d["projected_us"])
    assert 0 < d["resident_step_us"] < d["projected_us"] < d["captured_us"]
    # the recurrent half, computed between steps: the forward step's terms but its pointwise
    # loop and barriers, and one barrier of its own; the graph's gap hides it back to back
    p = prnn.plan.make_plan(CELLS["lstm"], 640, 1, "float32", hardware.PROFILES["h100"]).forward
    shape = latency.PassShape(CELLS["lstm"], p, 1, 640)
    t = latency.step_terms(latency.pass_sass(p, "sm_90"), shape, hardware.PROFILES["h100"])
    barrier = hardware.BLOCK_BARRIER / hardware.PROFILES["h100"].clock_mhz
    assert d["ahead_us"] + d["resident_step_us"] == pytest.approx(
        t.issue_us + t.matrix_us + t.barrier_us + t.pointwise_us + barrier)
    assert t.pointwise_us + t.barrier_us < d["resident_step_us"] < d["ahead_us"] < gap
    assert d["ahead_left_us"] == 0 and d["captured_between_us"] == d["captured_us"]
    # eager, host-bound: the step's counted Python at the stand-in's µs per instruction, scaled
    # to the H200's host, and its CUDA calls (the resident step's two queries and launch; the
    # fused step's launch); through the torch module its counted Python instead
    def host(road: str, calls: int) -> float:
        python = hardware.STEP_INSTRUCTIONS[road] * hardware.STAND_IN_US_PER_INSTRUCTION
        return hardware.GPU_PYTHON_RATIO[0] * python + calls * hardware.API_CALL_HOST_US
    assert d["host_us"] == pytest.approx(host("decoder", 3)) and d["eager_us"] == d["host_us"]
    assert d["torch_eager_us"] == pytest.approx(host("torch-decoder", 3))
    assert d["fused_eager_us"] == d["fused_host_us"] == pytest.approx(host("fused", 1))
    assert d["torch_fused_eager_us"] == pytest.approx(host("torch-cell", 1))
    assert d["eager_us"] < d["torch_eager_us"] and d["fused_eager_us"] < d["torch_fused_eager_us"]
    assert d["captured_us"] < d["eager_us"] < d["fused_eager_us"]
    monkeypatch.setattr(hardware, "GRAPH_GAP_US", 0.1)  # back to back, less than it is left
    short = latency.predict_decoder_step("LSTM", 640, 1, device="h100")
    assert short["ahead_left_us"] == pytest.approx(d["ahead_us"] - 0.1)
    assert short["captured_us"] == pytest.approx(short["captured_between_us"]
                                                 + short["ahead_left_us"])
    assert short["captured_between_us"] == pytest.approx(d["captured_us"] - gap + 0.1)
    monkeypatch.undo()
    # the projection from W_ih's rows held in shared memory: one wavefront a cycle - the CTA's
    # 32 rows x 20 column steps, and x's row once for each warp's 4 rows (8 warps) - after a
    # shared-memory latency and the sums' butterflies; two passes at B=5, of 4 batch rows each
    cycle = 1 / hardware.PROFILES["h100"].clock_mhz
    tail = hardware.SHARED_LATENCY + 5 * (hardware.SHUFFLE_LATENCY + hardware.FP_LATENCY)
    assert d["w_ih_held"] and "81920 B a CTA" in d["w_ih"]
    assert d["projection_us"] == pytest.approx((20 * (32 + 8) + tail) * cycle)
    d5 = latency.predict_decoder_step("LSTM", 640, 5, device="h100")
    assert d5["projection_us"] == pytest.approx((2 * 20 * (32 + 8 * 4) + tail) * cycle)
    # rows too wide to hold (32 x 2000 columns: 256000 B): from L2 at the SM's share of it, after
    # a round trip
    wide = latency.predict_decoder_step("LSTM", 640, 1, input_size=2000, device="h100")
    share = hardware.L2_BANDWIDTH_GBPS / hardware.PROFILES["h100"].sm_count * 1e3  # bytes/µs
    tail += hardware.L2_LATENCY - hardware.SHARED_LATENCY
    assert not wide["w_ih_held"] and "read from L2 each step" in wide["w_ih"]
    assert wide["projection_us"] == pytest.approx(tail * cycle + 4 * 32 * 2000 / share)
    # a stack of 2 (input size H: the same layer twice) is one launch: one gap, each layer's
    # hand-offs, projection and resident step
    d2 = latency.predict_decoder_step("LSTM", 640, 1, device=replace(hardware.PROFILES["h100"],
                                                                     sm_count=200), layers=2)
    assert d2["launches_per_step"] == 1 and d2["ctas"] == 160
    assert d2["captured_us"] == pytest.approx(gap + 2 * (d["captured_us"] - gap), rel=1e-3)
    assert d2["projected_us"] == pytest.approx(d2["captured_us"] - d["projection_us"], rel=1e-3)
    from persistent_rnn import cli
    cli._print_decoder(d)  # (prnn plan --decoder's lines; the whole plan is test_cli's)
    out = capsys.readouterr().out
    assert "resident decoder: 80 CTAs held; predicted per step" in out and "fused step" in out
    assert "projection: W_ih held in shared memory (32 rows x 640 columns" in out
    assert "computed between steps from the decoder's last h': the graph's gap hides it" in out


def test_an_eager_fused_step_is_host_bound_in_the_model(monkeypatch):
    """The model's eager fused step (no SASS read: a layer too big to be resident) is the longer
    of its GPU time and its host's - the step's counted instructions at the stand-in's µs per
    instruction, scaled to the H200's host, and its launch - and follows the counts."""
    from persistent_rnn import latency
    d = latency.predict_decoder_step("LSTM", 2048, 1, device="h100")
    assert not d["resident"] and d["fused_step_us"] < d["fused_host_us"] == d["fused_eager_us"]
    python = hardware.STEP_INSTRUCTIONS["fused"] * hardware.STAND_IN_US_PER_INSTRUCTION
    assert d["fused_host_us"] == pytest.approx(hardware.GPU_PYTHON_RATIO[0] * python
                                               + hardware.API_CALL_HOST_US)
    assert d["fused_eager_us"] < d["torch_fused_eager_us"]
    monkeypatch.setitem(hardware.STEP_INSTRUCTIONS, "fused", 0)  # no Python: the GPU or launch
    bare = latency.predict_decoder_step("LSTM", 2048, 1, device="h100")
    assert bare["fused_eager_us"] == max(bare["fused_step_us"], hardware.API_CALL_HOST_US)


def test_prnn_plan_prints_the_decoder_prediction(capsys):
    """``prnn plan --decoder``'s lines from a record (the model's own figures: the test above)."""
    from persistent_rnn import cli
    record = {"input_size": 640, "fused_step_us": 3.3, "fused_host_us": 31.4,
              "fused_eager_us": 31.4, "torch_fused_eager_us": 99.9, "host_us": 22.2,
              "torch_eager_us": 55.5, "resident": True, "ctas": 80,
              "captured_us": 4.1, "projection_us": 2.3, "handoff_us": 0.6, "resident_step_us": 0.7,
              "eager_us": 22.2, "projected_us": 1.8, "w_ih": "W_ih read from L2 each step: why",
              "ahead_us": 0.9, "ahead_left_us": 0.4, "captured_between_us": 3.7,
              "measured_miss": "measured: the miss"}
    cli._print_decoder(record)
    cli._print_decoder({**record, "resident": False, "reason": "its kernel takes the whole GPU"})
    out = capsys.readouterr().out
    assert "resident decoder: 80 CTAs held; predicted per step 4.10 µs captured" in out
    assert "22.20 µs eager (host 22.20; through the torch module 55.50)" in out
    assert "3.30 µs a step (input size 640), 31.40 µs eager" in out and "torch cell 99.90" in out
    assert "projection 2.30" in out
    assert "step_projected 1.80 µs" in out and "fused step kernel: predicted 3.30 µs" in out
    assert "resident decoder: no (its kernel takes the whole GPU)" in out
    assert ("recurrent half (W_hh h + b_hh, 0.90 µs) computed between steps from the decoder's "
            "last h': 0.40 µs of it left back to back; 3.70 µs a step with the caller's kernels "
            "between steps (assumed to take >= 0.90 µs)") in out
    assert "  projection: W_ih read from L2 each step: why" in out
    assert "  (measured: the miss)" in out


RACE_SCENARIO = """
import time
import numpy as np
import persistent_rnn as prnn
xs = np.random.default_rng(1).standard_normal((4, 2, 8)).astype(np.float32)
for layer in (prnn.LSTMCell(8, 24, seed=0, algo="persistent"),
              prnn.LSTM(8, 24, num_layers=2, seed=0, algo="persistent")):
    with prnn.override_settings(emulation_timeout_ms=20), layer.decoder(batch=2) as dec:
        state = None
        for t, x in enumerate(xs):
            state = dec.step(x, state)  # (a stack's: layer 1 reads layer 0's h' in one launch)
            state = state[1] if isinstance(layer, prnn.LSTM) else state
            time.sleep(0.2 * (t == 1))  # idle: exits, takeovers, a relaunch
print("decoded")
"""


@pytest.mark.skipif(not EVERY_KERNEL, reason="a race-detector build and child process (~15 s): "
                    "PRNN_TEST_EVERY_KERNEL=1")
def test_the_decoder_has_no_race():
    """The resident kernel (an asynchronous launch) and the step kernels beside it under
    ThreadSanitizer - a cell's, and a 2-layer stack's, whose step kernel posts layer 1 after
    layer 0's outputs: no pair of accesses that nothing orders (docs/emulation.md)."""
    proc = emulate.run_with_race_detector(["-c", RACE_SCENARIO], sources=(decoding.SOURCE[:-3],),
                                          timeout=600)
    assert proc.returncode == 0 and "decoded" in proc.stdout, proc.stderr[-4000:]


def test_a_replayed_step_launch_is_the_next_step():
    """A CUDA graph replays a step's launch with its arguments unchanged: the kernel numbers
    the step itself (the mailbox's counter), so the replayed launch is a new step that the
    resident CTAs compute - the same outputs from the same inputs - not a stale one."""
    cell = prnn.LSTMCell(IN, H, seed=3, algo="persistent")
    x = _inputs()[0]
    with cell.decoder(batch=B) as dec:
        want_h, want_c = dec.step(x)
        resident = dec._resident
        h0, c0 = np.zeros((B, H), np.float32), np.zeros((B, H), np.float32)
        outputs = [(np.full((B, H), np.nan, np.float32), np.full((B, H), np.nan, np.float32))
                   for _ in range(2)]
        for h_out, c_out in outputs:  # (the same x, state and step arguments twice)
            dec._layers.step(x, None, h0, c0, h_out, c_out)
        dec.check()
    for h_out, c_out in outputs:
        assert np.array_equal(h_out, want_h) and np.array_equal(c_out, want_c)


def test_resume_relaunches_an_idle_resident_kernel(settings):
    """``resume()`` (before a captured loop's replay, which runs no host code) relaunches the
    resident kernel that went idle, so the next steps run resident, not taken over - each
    relaunched CTA computing its recurrent half ahead from the step it revives at, before it
    waits; on a closed decoder it raises."""
    cell = prnn.LSTMCell(IN, H, seed=2, algo="persistent")
    xs = _inputs()
    prnn.configure(emulation_timeout_ms=20)
    with cell.decoder(batch=B) as dec:
        state = dec.step(xs[0])
        resident = dec._resident
        resident.running.join(10)  # idle past its deadline: exited
        assert resident.ended()
        prnn.configure(emulation_timeout_ms=2000)  # (the relaunched kernel stays up meanwhile)
        dec.resume()
        assert not resident.ended() and dec.relaunches == 1
        dec.resume()  # running: nothing to do
        assert dec.relaunches == 1
        before = _ahead_counts(dec)
        time.sleep(0.02)
        got = dec.step(xs[1], state)
        assert 0 < _ahead_counts(dec)[0] - before[0] <= resident.grid  # (grid: undisturbed)
    with cell.decoder(batch=B) as dec:  # undisturbed
        _equal(got, dec.step(xs[1], dec.step(xs[0])))
    with pytest.raises(RuntimeError, match="closed"):
        dec.resume()
