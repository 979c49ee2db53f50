"""``decoder(batch=B)`` of the torch modules (``persistent_rnn.torch.decoder``) on CPU tensors:
the emulated resident decoder with ``algo="persistent"`` against torch.nn's float64 cell and
layer, the module's own step with ``algo="auto"`` (and why), errors naming the argument.
The shapes of tests/test_decoder.py (its builds of the resident kernel are reused)."""
from __future__ import annotations

import gc
import re

import numpy as np
import pytest
import torch

import persistent_rnn.torch as ptorch
from persistent_rnn import emulate

IN, H, B, T = 8, 24, 2, 3


@pytest.fixture(autouse=True)
def _nothing_left_running():
    yield
    if emulate.running_launches():  # (a decoder in a reference cycle: collected first)
        gc.collect()
    assert not emulate.running_launches()


def _twin(module, cls):
    ref = cls(IN, H, **({} if "Cell" in cls.__name__ else {"num_layers": module.num_layers})).double()
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    return ref


def test_cell_decoder_runs_resident_in_the_emulation_and_matches_torch():
    torch.manual_seed(0)
    cell = ptorch.LSTMCell(IN, H, algo="persistent")
    ref = _twin(cell, torch.nn.LSTMCell)
    xs = torch.randn(T, B, IN)
    with cell.decoder(batch=B) as dec:
        assert dec.resident and dec.path == "library"
        state, want = None, None
        for x in xs:
            state = dec.step(x, state)
            want = ref(x.double(), want)
            assert isinstance(state[0], torch.Tensor) and state[0].dtype == torch.float32
            for got, w in zip(state, want):
                assert (got.double() - w).abs().max() < 2e-6
        dec.resume()  # (running: nothing to relaunch)
        assert dec.relaunches == 0
        with pytest.raises(ValueError, match="x has batch size 3"):
            dec.step(torch.zeros(3, IN))
        with pytest.raises(TypeError, match=r"state\[0\] must have dtype float32"):
            dec.step(xs[0], (state[0].double(), state[1]))


def test_layer_decoder_matches_torch_and_auto_on_cpu_runs_torchs_step():
    torch.manual_seed(1)
    gru = ptorch.GRU(IN, H, num_layers=2, algo="persistent")
    ref = _twin(gru, torch.nn.GRU)
    xs = torch.randn(T, B, IN)
    want, _ = ref(xs.double())
    with gru.decoder(batch=B) as dec:
        assert dec.resident
        hn = None
        for t, x in enumerate(xs):
            y, hn = dec.step(x, hn)
            assert y.shape == (B, H) and hn.shape == (2, B, H)
            assert (y.double() - want[t]).abs().max() < 2e-6
    auto = ptorch.GRU(IN, H, num_layers=2)
    auto.load_state_dict(gru.state_dict())
    with auto.decoder(batch=B) as dec:
        assert not dec.resident and dec.path == "torch" and "CPU" in dec.reason
        dec.resume()  # (nothing resident: nothing to relaunch)
        y, hn = dec.step(xs[0])
    plain = torch.nn.GRU(IN, H, num_layers=2)
    plain.load_state_dict(gru.state_dict())
    with torch.no_grad():
        y_ref, hn_ref = plain(xs[:1])
    assert torch.equal(y, y_ref[0]) and torch.equal(hn, hn_ref)
    with pytest.raises(ValueError, match="unidirectional"):
        ptorch.GRU(IN, H, bidirectional=True).decoder(batch=B)


def test_the_rnnt_greedy_example_decodes_the_same_tokens_both_ways(capsys):
    """examples/rnnt_greedy.py at a tiny size on the CPU (the emulated decoder; the builds of the
    tests above): torch.nn's cell and the decoder emit the same tokens."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "rnnt_greedy.py"
    spec = importlib.util.spec_from_file_location("rnnt_greedy", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--device", "cpu", "--hidden", str(H), "--embed", str(IN), "--frames",
                         "4", "--vocab", "8", "--max-symbols", "2"]) == 0
    out = capsys.readouterr().out
    assert "decoder (resident): the same tokens" in out
    assert len(re.findall(r"\d+ tokens", out)) == 2 and "0 tokens" not in out
