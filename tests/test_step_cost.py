"""The host work of one decoding step, counted (issue 29): a decoder's steady-state ``step`` and a
``persistent_rnn.torch`` cell's own step (the fused step kernel), at B=1.

On an H200 a step through the library cost 3-6x ``torch.nn.LSTMCell``'s host time while its
device work was a few µs (bench/results/h200-2026-11-27/call2-fresh: decode_loop.log,
decoder_profile.txt). Counted here as tests/test_call_cost.py counts calls (``python_calls``:
every Python function entered), the emulator not counted (``EMULATOR``: on a GPU a CuPy launch
runs in its place), in a decoding loop's steady state: each step's state is the last step's,
passed back. Also counted: the hand-overs between torch and the library a step makes
(``interop.to_array``/``to_tensor``: on a GPU each is a CuPy array or a DLPack capsule made,
tens of Python and C calls there that the CPU path does not show) and the entries into
``library_stream`` (on a GPU a context of torch's device, stream and capture state).
"""
from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import pytest
import torch
from test_call_cost import python_calls
from test_decoder_torch import _nothing_left_running  # noqa: F401 (autouse: no kernel left)

import persistent_rnn as prnn
import persistent_rnn.torch as ptorch
from persistent_rnn import emulate
from persistent_rnn.decoder import DecoderContextLost
from persistent_rnn.torch import cells as torch_cells
from persistent_rnn.torch import decoder as torch_decoder

IN, H, B = 8, 24, 1
EMULATOR = ("persistent_rnn/emulate.py", "/ctypes/")  # what a GPU runs in its place
HANDOVERS = ("to_array", "to_tensor", "library_stream")

# (API, module, road) -> limits of (Python calls, hand-overs a step: to_array + to_tensor, entries
# into library_stream): the counts after the last cut (branch decoder-host, 2026-11-28) plus 1-2
# calls; in the comments the counts now, then before that branch (main at c84b340). The decoder's
# counts did not move (its cut is in instructions: bench/step_instructions.py); the cells' fused
# step lost the checks a steady state passes (the layer API's ``_Cell._steady``), the launcher's
# and ``fused_grid``'s frames and the torch cell's four ``Module.__getattr__`` reads of its weights.
LIMITS = {
    ("numpy", "LSTMCell", "decoder"): (12, (0, 0)),   # 11 (0, 0), before 11 (0, 0)
    ("numpy", "GRUCell", "decoder"): (11, (0, 0)),    # 10 (0, 0), before 10 (0, 0)
    ("numpy", "LSTM", "decoder"): (12, (0, 0)),       # 11 (0, 0), before 11 (0, 0)
    ("numpy", "GRU", "decoder"): (11, (0, 0)),        # 10 (0, 0), before 10 (0, 0)
    ("torch", "LSTMCell", "decoder"): (17, (2, 0)),   # 16 (2, 0), before 16 (2, 0)
    ("torch", "GRUCell", "decoder"): (17, (2, 0)),    # 16 (2, 0), before 16 (2, 0)
    ("torch", "LSTM", "decoder"): (17, (2, 0)),       # 16 (2, 0), before 16 (2, 0)
    ("torch", "GRU", "decoder"): (17, (2, 0)),        # 16 (2, 0), before 16 (2, 0)
    # the cell's own call, algo="persistent" (the fused step kernel, emulated; the layer API's
    # ``forward``) and "auto" (on CPU tensors torch's own cell: the floor the library's checks and
    # choice add to)
    ("numpy", "LSTMCell", "persistent"): (16, (0, 0)),  # 15 (0, 0), before 35 (0, 0)
    ("numpy", "GRUCell", "persistent"): (15, (0, 0)),   # 14 (0, 0), before 29 (0, 0)
    ("torch", "LSTMCell", "persistent"): (43, (5, 1)),  # 42 (5, 1), before 46 (5, 1)
    ("torch", "GRUCell", "persistent"): (41, (4, 1)),   # 40 (4, 1), before 44 (4, 1)
    ("torch", "LSTMCell", "auto"): (18, (0, 0)),        # 18 (0, 0), before 18 (0, 0)
}


def _loop_step(api: str, name: str, road: str) -> Callable[[], object]:
    """One step of a decoding loop (its state carried from call to call): a decoder's
    ``step`` or the torch cell's own call, on B=1 inputs."""
    if api == "numpy":
        module = getattr(prnn, name)(IN, H, seed=0, algo="persistent",
                                     **({} if "Cell" in name else {"num_layers": 1}))
        x = np.random.default_rng(1).standard_normal((B, IN)).astype(np.float32)
    else:
        torch.manual_seed(0)
        module = getattr(ptorch, name)(IN, H, algo="persistent" if road != "auto" else road,
                                       **({} if "Cell" in name else {"num_layers": 1}))
        x = torch.randn(B, IN)
    if road == "decoder":
        dec = module.decoder(batch=B)
        assert dec.resident, dec.reason
        step = dec.step
    else:
        dec, step = None, module if api == "torch" else module.forward
    carried = [None]

    def call():
        out = step(x, carried[0])
        carried[0] = out if "Cell" in name else out[1]
    call.decoder = dec
    return call


def handovers(monkeypatch, call: Callable[[], object]) -> tuple[int, int]:
    """``(to_array + to_tensor calls, library_stream entries)`` of one ``call()`` (after a
    warm-up call), counted on the names the decoder's and the cells' modules call."""
    counts: collections.Counter = collections.Counter()
    for module in (torch_decoder, torch_cells):
        for name in HANDOVERS:
            def counted(*args, _real=getattr(module, name), _name=name):
                counts[_name] += 1
                return _real(*args)
            monkeypatch.setattr(module, name, counted)
    call()
    counts.clear()
    call()
    monkeypatch.undo()
    return counts["to_array"] + counts["to_tensor"], counts["library_stream"]


@pytest.mark.parametrize("api,name,road", list(LIMITS), ids=["-".join(k) for k in LIMITS])
def test_a_decoding_step_costs_few_python_calls_and_hand_overs(monkeypatch, settings, api, name,
                                                              road):
    prnn.configure(emulation_timeout_ms=60_000)  # (no idle exit and relaunch on a slow machine)
    call = _loop_step(api, name, road)
    try:
        with torch.no_grad():
            counted = (python_calls(call, skip=EMULATOR), handovers(monkeypatch, call))
    finally:
        if call.decoder is not None:
            call.decoder.close()
    calls, (conversions, streams) = LIMITS[api, name, road]
    assert counted[0] <= calls and counted[1][0] <= conversions and counted[1][1] <= streams, (
        f"{api} {name} {road}: (Python calls, (hand-overs, library_stream entries)) {counted} > "
        f"limits {LIMITS[api, name, road]}")


# ---- what the cuts keep -------------------------------------------------------------------------

def test_a_state_changed_in_place_is_handed_over_again():
    """The state a step returned, passed back after an in-place change, steps as the same values
    in fresh tensors do (or fails as they do): new values (``mul_``), new memory (``.data =``,
    which keeps the version counter), a new shape (``unsqueeze_``)."""
    torch.manual_seed(0)
    cell = ptorch.LSTMCell(IN, H, algo="persistent")
    x = torch.randn(B, IN)

    def fresh(state):
        return tuple(t.clone() for t in state)

    with cell.decoder(batch=B) as dec:
        for change in (lambda h: h.mul_(2), lambda h: setattr(h, "data", torch.randn(B, H))):
            state = dec.step(x, dec.step(x))
            change(state[0])
            values = fresh(state)
            got = dec.step(x, state)  # (first: the state is the last step's)
            assert all(torch.equal(g, w) for g, w in zip(got, dec.step(x, values)))
        for reshape in (lambda h: h.unsqueeze_(0),  # (a new version)
                        lambda h: setattr(h, "data", h.data.unsqueeze(0))):  # (the same one)
            state = dec.step(x, dec.step(x))
            reshape(state[0])
            with pytest.raises(ValueError, match=r"state\[0\] must have shape"):
                dec.step(x, state)


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_a_steps_outputs_stay_as_they_were_through_later_steps(api):
    """Each step's outputs are fresh memory (h' and c' one allocation of their own): what a
    caller keeps is not overwritten by the next steps."""
    call = _loop_step(api, "LSTMCell", "decoder")
    with call.decoder as dec:
        rng = np.random.default_rng(3)
        xs = rng.standard_normal((4, B, IN)).astype(np.float32)
        if api == "torch":
            xs = torch.from_numpy(xs)
        state, kept = None, []
        for x in xs:
            state = dec.step(x, state)
            kept.append((state, [_values(a) for a in state]))
        for state, values in kept:
            assert all(np.array_equal(_values(a), v) for a, v in zip(state, values))


def _values(a) -> np.ndarray:
    """A copy of an array's or a CPU tensor's values."""
    return (a.numpy() if isinstance(a, torch.Tensor) else a).copy()


def test_the_fused_step_follows_its_cells_weights():
    """The cell's step reads its weights through views remembered across steps: an in-place
    update and a reassigned parameter are both what the next step computes with (as
    torch.nn's cell)."""
    torch.manual_seed(0)
    cell = ptorch.LSTMCell(IN, H, algo="persistent")
    ref = torch.nn.LSTMCell(IN, H)
    x, state = torch.randn(B, IN), (torch.randn(B, H), torch.randn(B, H))
    with torch.no_grad():
        for update in (lambda: None, lambda: cell.weight_hh.mul_(0.5),
                       lambda: setattr(cell, "bias_ih", torch.nn.Parameter(torch.randn(4 * H)))):
            update()
            ref.load_state_dict(cell.state_dict())
            for got, want in zip(cell(x, state), ref(x, state)):
                assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def test_a_passed_back_state_meets_the_closed_decoders_error():
    """The state a step returned, passed back to a decoder closed since (here by a context
    reset, which leaves ``TorchDecoder`` its last state), gets the closed decoder's error."""
    torch.manual_seed(0)
    cell = ptorch.LSTMCell(IN, H, algo="persistent")
    x = torch.randn(B, IN)
    dec = cell.decoder(batch=B)
    state = dec.step(x, dec.step(x))
    emulate.reset_context()
    with pytest.raises(DecoderContextLost):
        dec.step(x, state)
    with pytest.raises(RuntimeError, match="closed decoder: .*context was reset"):
        dec.step(x, state)
    dec.close()


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell"])
def test_a_cells_steady_state_step_is_its_checked_step(name):
    """The layer API cell's step on what a decoding loop passes (the state it returned, arrays
    of its type, dtype and shapes: ``_Cell._steady``) is bitwise the step its full checks take
    (the same values unbatched, which only they accept), and what the checks refuse is still
    refused with the state passed back."""
    cell = getattr(prnn, name)(IN, H, seed=0, algo="persistent")
    xs = np.random.default_rng(5).standard_normal((4, B, IN)).astype(np.float32)
    state = cell.forward(xs[0])
    for x in xs[1:]:
        lstm = isinstance(state, tuple)
        checked = cell.forward(x[0], tuple(s[0] for s in state) if lstm else state[0])
        state = cell.forward(x, state)
        for got, want in zip(state if lstm else (state,), checked if lstm else (checked,)):
            assert np.array_equal(got[0], want)
    with pytest.raises(TypeError, match="dtype float32"):
        cell.forward(xs[1].astype(np.float64), state)
    with pytest.raises(ValueError, match="x must have shape"):
        cell.forward(np.zeros((B, IN + 1), np.float32), state)
    with pytest.raises(ValueError, match=r"must have shape \(B, hidden_size\) = \(2, "):
        cell.forward(np.zeros((2, IN), np.float32), state)
