"""The host work of a steady-state decoder step, counted, and its fast path's equivalence.

A resident decoder's step is host-bound on a GPU (H200, bench/results/h200-2026-11-26, call 4:
~230-290 µs of host time a step through the torch module, ~240 Python calls; each ~1 µs there).
Its steady state takes a fast path: identity and shape checks of what a loop passes back (the
last step's outputs), the kernel's constant arguments made once per launch of the resident
kernel. Counted here as in tests/test_call_cost.py (``python_calls``), without the emulator
(``persistent_rnn/emulate.py`` and ctypes below it: on a GPU a CuPy launch runs instead), so
the counts are what the GPU path's own Python also runs. Anything else a caller passes (a
list, a strided view, None) takes the full checks and gives the same bits.

The shapes of tests/test_decoder.py (its emulated builds are reused).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_call_cost import python_calls
from test_decoder_torch import _nothing_left_running  # noqa: F401 (autouse: no kernel left)

import persistent_rnn as prnn
import persistent_rnn.torch as ptorch
from persistent_rnn import decoder as decoding
from persistent_rnn import launch

IN, H, B = 8, 24, 2
EMULATOR = ("persistent_rnn/emulate.py", "/ctypes/")  # what a GPU runs in its place

# (API, cell or layer) -> limit of Python calls in a steady-state step (``step_calls``): the
# counts measured with this file's ``step_calls`` after the host-cost work (branch dec-host)
# plus 2, before it in the comments (main at 056329a: settings read, validation and np.int32
# per step, generator expressions, no_grad and a nullcontext per torch step).
LIMITS = {
    ("numpy", "LSTMCell"): 12,   # now 10, before 27
    ("numpy", "GRUCell"): 11,    # now 9, before 22
    ("numpy", "LSTM"): 13,       # now 11 (one step kernel for both layers), 14 with one a
                                 # layer, before 33 (2 layers)
    ("torch", "LSTMCell"): 21,   # now 19, before 55
    ("torch", "GRUCell"): 18,    # now 16, before 38
    ("torch", "LSTM"): 23,       # now 21 (one step kernel), 24 with one a layer, before 67
}


def _decoder(api: str, name: str):
    """A resident decoder of ``name`` (a 2-layer layer, or a cell), its input and its state."""
    layers = {} if name.endswith("Cell") else {"num_layers": 2}
    if api == "numpy":
        dec = getattr(prnn, name)(IN, H, seed=0, **layers, algo="persistent").decoder(batch=B)
        x = np.random.default_rng(1).standard_normal((B, IN)).astype(np.float32)
    else:
        torch.manual_seed(0)
        dec = getattr(ptorch, name)(IN, H, algo="persistent", **layers).decoder(batch=B)
        x = torch.randn(B, IN)
    assert dec.resident, dec.reason
    out = dec.step(x)
    return dec, x, out if name.endswith("Cell") else out[1]


def step_calls(api: str, name: str) -> int:
    """Python calls of one steady-state step (the last step's state passed back), the emulator
    not counted."""
    dec, x, state = _decoder(api, name)
    with dec:
        return python_calls(lambda: dec.step(x, state), skip=EMULATOR)


@pytest.mark.parametrize("api,name", list(LIMITS), ids=[f"{a}-{n}" for a, n in LIMITS])
def test_a_steady_state_step_costs_few_python_calls(api, name, settings):
    prnn.configure(emulation_timeout_ms=60_000)  # (no idle exit and relaunch on a slow machine)
    counted = step_calls(api, name)
    assert counted <= LIMITS[api, name], f"{api} {name}: {counted} Python calls a step"


def test_what_the_fast_path_refuses_takes_the_full_checks_with_the_same_bits():
    """A strided x, state and gi, a list state and a None state give the bits of contiguous
    arrays (the full checks make them so); bad input still gets the full checks' errors."""
    cell = prnn.LSTMCell(IN, H, seed=0, algo="persistent")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, IN)).astype(np.float32)
    h, c = (rng.standard_normal((B, H)).astype(np.float32) for _ in range(2))
    gi = rng.standard_normal((B, 4 * H)).astype(np.float32)

    def strided(a):
        wide = np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)
        wide[:, ::2] = a
        return wide[:, ::2]

    with cell.decoder(batch=B) as dec:
        for step in (dec.step, dec.step_projected):
            a = x if step == dec.step else gi
            want = step(a, (h, c))
            for got in (step(strided(a), (strided(h), strided(c))), step(a, [h, c])):
                assert all(np.array_equal(g, w) for g, w in zip(got, want))
            zeros = np.zeros((B, H), np.float32)
            assert all(np.array_equal(g, w) for g, w in zip(step(a), step(a, (zeros, zeros))))
        with pytest.raises(TypeError, match=r"state\[1\] must have dtype float32"):
            dec.step(x, (h, c.astype(np.float64)))
        with pytest.raises(ValueError, match=r"gi must have shape \(batch, G\*hidden_size\)"):
            dec.step_projected(gi[:, 1:], (h, c))
    with pytest.raises(RuntimeError, match="closed decoder"):
        dec.step(x, (h, c))


def test_a_torch_step_needs_no_grad_mode():
    """An input that requires grad steps as one that does not (the hand-over reads memory
    detached), and the outputs record no autograd history."""
    torch.manual_seed(0)
    cell = ptorch.GRUCell(IN, H, algo="persistent")
    x = torch.randn(B, IN, requires_grad=True)
    with cell.decoder(batch=B) as dec:
        h = dec.step(x)
        assert not h.requires_grad and h.grad_fn is None
        assert torch.equal(h, dec.step(x.detach()))


def test_the_wait_deadline_is_read_at_each_launch_of_the_resident_kernel(settings):
    """The step kernel's wait (``WAIT_DEADLINES`` idle deadlines) is the setting read when the
    resident kernel was launched: a change takes effect at the next (re)launch."""
    prnn.configure(emulation_timeout_ms=20)
    cell = prnn.GRUCell(IN, H, seed=0, algo="persistent")
    x = np.zeros((B, IN), np.float32)
    with cell.decoder(batch=B) as dec:
        resident, layers = dec._resident, dec._layers
        assert layers._step_tail[-1] == decoding.WAIT_DEADLINES * 20_000_000
        prnn.configure(emulation_timeout_ms=2000)
        h = dec.step(x)
        if resident.launches == 1:  # (still running: the deadline of its launch)
            assert layers._step_tail[-1] == decoding.WAIT_DEADLINES * 20_000_000
        resident.running.join(10)  # idle past 20 ms: exited
        dec.step(x, h)
        assert layers._step_tail[-1] == decoding.WAIT_DEADLINES * launch.timeout_ns(True)
        assert launch.timeout_ns(True) == 2_000_000_000
