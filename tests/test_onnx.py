"""ONNX export (persistent_rnn.torch.onnx): every cell exported with ``torch.onnx.export(...,
dynamo=True)`` as ONNX's own RNN/GRU/LSTM nodes, run in onnxruntime (CPU) on a time length and
batch other than the example's, against the module: outputs and final states within 1e-5.

Each export takes seconds: one export per (cell, configuration), shared by the checks."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import persistent_rnn.torch as prt
from persistent_rnn.cells import CELLS as REGISTRY, layer_args
from persistent_rnn.torch.onnx import padded_forward

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ROOT = Path(__file__).resolve().parents[1]
I, H = 5, 6
EXAMPLE = (4, 2)     # (T, B) the model is exported with
RUNS = ((7, 3), (1, 1), (3, 5))  # (T, B) onnxruntime runs it with
# torch.nn's cells (what torch.onnx exports): the drop-in module class and its keywords
CELLS = {name: (getattr(prt, layer_args(name)[0]), layer_args(name)[1])
         for name, spec in REGISTRY.items() if spec.in_torch}
# configuration: (module keywords, initial states given, lengths given)
CONFIGS = {"plain": ({}, False, False),
           "stack": ({"num_layers": 2, "bidirectional": True, "batch_first": True}, True, False),
           "lengths": ({"num_layers": 2, "bidirectional": True, "bias": False}, True, True)}


class _Model(torch.nn.Module):
    """The module with its states (and lengths) as separate graph inputs."""

    def __init__(self, rnn: torch.nn.Module, states: bool, lengths: bool) -> None:
        super().__init__()
        self.rnn, self.states, self.lengths = rnn, states, lengths

    def forward(self, x, lengths=None, h0=None, c0=None):
        hx = h0 if c0 is None else (h0, c0)
        out, state = (padded_forward(self.rnn, x, lengths, hx) if lengths is not None
                      else self.rnn(x, hx))
        return (out, *state) if isinstance(state, tuple) else (out, state)


def _inputs(model: _Model, steps: int, batch: int, seed: int) -> list[torch.Tensor | None]:
    """``[x, lengths, h0, c0]``, ``None`` where the configuration has none."""
    g = torch.Generator().manual_seed(seed)
    rnn = model.rnn
    shape = (batch, steps, I) if rnn.batch_first else (steps, batch, I)
    inputs: list[torch.Tensor | None] = [torch.randn(shape, generator=g), None, None, None]
    if model.lengths:
        lengths = torch.randint(1, steps + 1, (batch,), generator=g)
        lengths[0] = steps  # the longest fills the padded length, as pad_packed_sequence pads
        inputs[1] = lengths
    if model.states:
        count = (2 if rnn.bidirectional else 1) * rnn.num_layers
        for i in range(2 if rnn.mode == "LSTM" else 1):
            inputs[2 + i] = torch.randn(count, batch, H, generator=g)
    return inputs


def _dynamic_shapes(model: _Model, inputs: list) -> tuple:
    steps, batch = torch.export.Dim("T"), torch.export.Dim("B")
    x = {0: batch, 1: steps} if model.rnn.batch_first else {0: steps, 1: batch}
    return (x, None if inputs[1] is None else {0: batch},
            *(None if t is None else {1: batch} for t in inputs[2:]))


def _export(model: _Model) -> bytes:
    inputs = _inputs(model, *EXAMPLE, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, tuple(inputs), dynamo=True, verbose=False,
                                    dynamic_shapes=_dynamic_shapes(model, inputs))
    return program.model_proto.SerializeToString()


@pytest.fixture(scope="module")
def exported():
    """``(cell, config) -> (model, ONNX bytes)``, each exported once."""
    cache: dict = {}

    def get(cell: str, config: str):
        if (cell, config) not in cache:
            cls, kw = CELLS[cell]
            extra, states, lengths = CONFIGS[config]
            torch.manual_seed(1)
            model = _Model(cls(I, H, **kw, **extra), states, lengths).eval()
            cache[cell, config] = model, _export(model)
        return cache[cell, config]

    return get


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("cell", list(CELLS))
def test_onnxruntime_matches_the_module(exported, cell, config):
    model, onnx_bytes = exported(cell, config)
    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for seed, (steps, batch) in enumerate(RUNS, start=1):
        inputs = _inputs(model, steps, batch, seed)
        given = [t.numpy() for t in inputs if t is not None]
        got = session.run(None, dict(zip(names, given, strict=True)))
        with torch.no_grad():
            want = model(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape)
            np.testing.assert_allclose(g, w.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cell", list(CELLS))
def test_graph_is_one_standard_node_per_layer(exported, cell):
    import onnx
    graph = onnx.load_from_string(exported(cell, "lengths")[1]).graph
    kinds = [n.op_type for n in graph.node]
    node = layer_args(cell)[0]  # ONNX's RNN, GRU, LSTM: torch.nn's layer modes
    assert kinds.count(node) == 2, kinds
    assert all(n.domain in ("", "ai.onnx") for n in graph.node)
    nodes = [n for n in graph.node if n.op_type == node]
    assert all(n.input[4] for n in nodes)  # sequence_lens
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["direction"] == b"bidirectional" and attrs["hidden_size"] == H
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert all(isinstance(d, str) for d in dims[:2]), dims  # time and batch stay dynamic


def test_projection_is_refused_with_its_reason():
    model = _Model(prt.LSTM(I, H, proj_size=3), False, False).eval()
    with pytest.raises(Exception, match="proj_size: ONNX's LSTM operator has no projection"):
        _export(model)


def test_outside_onnx_export_the_padded_forward_is_packed_semantics():
    torch.manual_seed(0)
    gru = prt.GRU(I, H, bidirectional=True, batch_first=True)
    x, lengths = torch.randn(3, 6, I), torch.tensor([2, 6, 4])
    out, hn = padded_forward(gru, x, lengths)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                     enforce_sorted=False)
    ref = torch.nn.GRU(I, H, bidirectional=True, batch_first=True)
    ref.load_state_dict(gru.state_dict())
    want, want_hn = ref(packed)
    want, _ = torch.nn.utils.rnn.pad_packed_sequence(want, batch_first=True, total_length=6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(hn, want_hn)
    program = torch.export.export(gru, (x,))  # torch.export (not ONNX) keeps the library's op
    assert "persistent_rnn.recurrence.default" in {str(n.target) for n in program.graph.nodes}


def test_torchscript_exporter_stays_refused():
    with pytest.raises(RuntimeError, match=r"torch.onnx.export\(..., dynamo=True\) for ONNX"):
        torch.onnx.export(prt.LSTM(I, H), (torch.randn(3, 2, I),), io.BytesIO(), dynamo=False)


@pytest.mark.slow
def test_the_users_example_runs_in_onnxruntime(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "onnx_export.py"),
                           str(tmp_path / "tagger.onnx")], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'LSTM'" in proc.stdout and "persistent_rnn" not in proc.stdout.split("\n")[0]
    error = float(re.search(r"max \|onnxruntime - torch\| = (\S+)", proc.stdout).group(1))
    assert error <= 1e-5, proc.stdout
