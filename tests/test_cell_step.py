"""The layer API's cells (``prnn.RNNCell/GRUCell/LSTMCell``) and the fused step kernel: one step
on NumPy by the GEMM step and by the emulated fused kernel against torch.nn's float64 cell; a
loop of steps (forward and backpropagation through time) against the whole-sequence layer of the
same weights; the kernel's NVRTC build for sm_80 and sm_90 (zero spills, no local memory)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import persistent_rnn as prnn
from persistent_rnn import cell_step
from persistent_rnn.cells import CELLS, layer_args

CASES = [(f"{layer_args(n)[0]}Cell", layer_args(n)[0], layer_args(n)[1]) for n in CELLS]
CASE_IDS = list(CELLS)
# The cells torch.nn has (the others' math: test_cells.py's central differences)
TORCH_CASES = [case for case, spec in zip(CASES, CELLS.values()) if spec.in_torch]
TORCH_IDS = [name for name, spec in CELLS.items() if spec.in_torch]
ALGOS = [("gemm", "float64", 1e-12), ("gemm", "float32", 2e-6), ("persistent", "float32", 2e-6)]
INPUT, HIDDEN = 5, 7


def _state(rng, name: str, shape, dtype):
    h = rng.standard_normal(shape).astype(dtype)
    return (h, rng.standard_normal(shape).astype(dtype)) if name == "LSTMCell" else h


def _flat(obj) -> list:
    return [a for o in obj for a in _flat(o)] if isinstance(obj, (tuple, list)) else [obj]


def _torch_twin(name: str, kwargs: dict, cell):
    ref = getattr(torch.nn, name)(INPUT, HIDDEN, **kwargs).double()
    ref.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64))
                         for k, v in cell.params.items()})
    return ref


def _close(got, want, rtol: float, what: str) -> None:
    scale = max(float(np.abs(want).max()), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("algo,dtype,rtol", ALGOS, ids=["gemm-f64", "gemm-f32", "fused-f32"])
@pytest.mark.parametrize("name,mode,kwargs", TORCH_CASES, ids=TORCH_IDS)
def test_step_forward_backward_match_torch_nn_float64(name, mode, kwargs, algo, dtype, rtol):
    """forward and backward of one step, batched and unbatched, against torch.nn float64."""
    rng = np.random.default_rng(3)
    cell = getattr(prnn, name)(INPUT, HIDDEN, dtype=dtype, algo=algo, seed=2, **kwargs)
    ref = _torch_twin(name, kwargs, cell)
    for shape in ((4,), ()):
        x = rng.standard_normal((*shape, INPUT)).astype(dtype)
        hx = _state(rng, name, (*shape, HIDDEN), dtype)
        out = cell.forward(x, hx)
        assert cell.last_run.algo == algo and cell.last_run.emulated == (algo == "persistent")
        xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
        hxt = [torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in _flat(hx)]
        ref.zero_grad()
        want = _flat(ref(xt, tuple(hxt) if name == "LSTMCell" else hxt[0]))
        cotangents = [rng.standard_normal(o.shape).astype(dtype) for o in _flat(out)]
        cell.zero_grad()
        dx, dhx = cell.backward(*cotangents)
        sum((w * torch.from_numpy(c.astype(np.float64))).sum()
            for w, c in zip(want, cotangents)).backward()
        got = _flat(out) + [dx] + _flat(dhx) + [cell.grads[k] for k in cell.params]
        expect = ([w.detach().numpy() for w in want] + [xt.grad.numpy()]
                  + [h.grad.numpy() for h in hxt] + [p.grad.numpy() for p in ref.parameters()])
        assert len(got) == len(expect)
        for i, (g, w) in enumerate(zip(got, expect)):
            assert g.dtype == np.dtype(dtype) and g.shape == w.shape, (i, g.shape, w.shape)
            _close(g, w, rtol, f"{name} {shape} #{i}")


@pytest.mark.parametrize("name,mode,kwargs", CASES, ids=CASE_IDS)
def test_fused_kernel_equals_gemm_step_and_is_bitwise_stable(name, mode, kwargs):
    """The emulated fused kernel: the same bits on every call, within float32 round-off of the
    GEMM step (no bias and a zero default state included; one partial batch tile, then a full
    tile and a partial one)."""
    rng = np.random.default_rng(5)
    for bias, batch in ((True, 3), (False, 3), (True, 6)):
        fused = getattr(prnn, name)(INPUT, HIDDEN, bias=bias, algo="persistent", seed=4, **kwargs)
        gemm = getattr(prnn, name)(INPUT, HIDDEN, bias=bias, algo="gemm", seed=4, **kwargs)
        x = rng.standard_normal((batch, INPUT)).astype(np.float32)
        first, second = _flat(fused.forward(x)), _flat(fused.forward(x))
        assert all(np.array_equal(a, b) for a, b in zip(first, second))
        for a, b in zip(first, _flat(gemm.forward(x))):
            _close(a, b, 2e-6, f"{name} bias={bias} batch={batch}")


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name,mode,kwargs", CASES, ids=CASE_IDS)
def test_cell_loop_equals_whole_sequence_layer(name, mode, kwargs, algo):
    """T steps of the cell (forward, then backpropagation through time with the step functions)
    equal the one-layer ``prnn.<mode>`` forward and backward with the same weights."""
    steps, batch = 4, 3
    rng = np.random.default_rng(9)
    layer = getattr(prnn, mode)(INPUT, HIDDEN, algo="gemm", seed=6, **kwargs)
    cell = getattr(prnn, name)(INPUT, HIDDEN, algo=algo, **kwargs)
    cell.load_params({k.removesuffix("_l0"): v for k, v in layer.params.items()})
    x = rng.standard_normal((steps, batch, INPUT)).astype(np.float32)
    dy = rng.standard_normal((steps, batch, HIDDEN)).astype(np.float32)
    y, _ = layer.forward(x)
    dx_layer, _ = layer.backward(dy)
    lstm = name == "LSTMCell"
    h = np.zeros((batch, HIDDEN), np.float32)
    c = np.zeros_like(h) if lstm else None
    contexts = []
    for t in range(steps):
        h, c, ctx, _ = cell_step.step_forward(cell.cell, cell.params, x[t], h, c, algo)
        _close(h, y[t], 2e-6, f"{name} step {t}")
        contexts.append(ctx)
    dh, dc = np.zeros_like(h), (np.zeros_like(h) if lstm else None)
    grads = {k: np.zeros_like(v) for k, v in cell.params.items()}
    for t in reversed(range(steps)):
        dxt, dh, dc, g = cell_step.step_backward(contexts[t], cell.params, dy[t] + dh, dc)
        _close(dxt, dx_layer[t], 2e-6, f"{name} dx {t}")
        for k in grads:
            grads[k] += g[k]
    for k in grads:
        _close(grads[k], layer.grads[k + "_l0"], 2e-6, f"{name} grad {k}")


@pytest.mark.parametrize("name,mode,kwargs", CASES, ids=CASE_IDS)
def test_bad_arguments_are_named(name, mode, kwargs):
    """Wrong shapes, dtypes, algo, 16-bit dtypes, float64 on the fused kernel, backward first."""
    cell = getattr(prnn, name)(INPUT, HIDDEN, **kwargs)
    x = np.zeros((2, INPUT), np.float32)
    with pytest.raises(ValueError, match=r"x must have shape \(B, input_size\)"):
        cell.forward(np.zeros((2, INPUT + 1), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        cell.forward(np.zeros((1, 2, INPUT), np.float32))
    with pytest.raises(TypeError, match="x must have dtype float32"):
        cell.forward(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"hx(\[0\])? must have shape"):
        cell.forward(x, _state(np.random.default_rng(0), name, (3, HIDDEN), np.float32))
    with pytest.raises(prnn.validation.CallOrderError, match="backward needs a preceding"):
        cell.backward(np.zeros((2, HIDDEN), np.float32))
    with pytest.raises(ValueError, match="algo must be one of"):
        getattr(prnn, name)(INPUT, HIDDEN, algo="fast", **kwargs)
    with pytest.raises(ValueError, match="cells run float32 and float64"):
        getattr(prnn, name)(INPUT, HIDDEN, dtype="float16", **kwargs)
    double = getattr(prnn, name)(INPUT, HIDDEN, dtype="float64", algo="persistent", **kwargs)
    with pytest.raises(ValueError, match="cannot run this cell: dtype is float64"):
        double.forward(x.astype(np.float64))


def test_fused_step_compiles_without_spills_or_local_memory():
    """NVRTC builds the fused step kernels of every cell for sm_80 and sm_90 with zero spills
    and no stack frame (the gates stay in registers)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels
    for arch in ("sm_80", "sm_90"):
        for cell in CELLS.values():
            defines = {"PRNN_CELL": cell.kind, "PRNN_BATCH_TILE": cell_step.BATCH_TILE}
            log = kernels.compile_source(cell_step.FUSED_SOURCE, defines, arch).log
            assert "'prnn_fused_step_f32'" in log, (arch, cell.name)
            frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) "
                                r"bytes spill loads", log)
            assert frames == [("0", "0", "0")], (cell.name, log)


def test_fused_step_writes_into_given_buffers():
    """With ``out`` buffers the fused step returns them, filled (what a captured CUDA graph
    replays: no allocation), with the bits of a call that allocates."""
    cell = prnn.LSTMCell(INPUT, HIDDEN, algo="persistent", seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, INPUT)).astype(np.float32)
    h, c = (rng.standard_normal((2, HIDDEN)).astype(np.float32) for _ in range(2))
    out = (np.full((2, HIDDEN), np.nan, np.float32), np.full((2, HIDDEN), np.nan, np.float32),
           np.full((2, 4 * HIDDEN), np.nan, np.float32))
    got = cell_step.fused_step(cell.cell, cell.params, x, h, c, out=out)
    assert all(g is o for g, o in zip(got, out))
    want = cell_step.fused_step(cell.cell, cell.params, x, h, c)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_fused_step_takes_strided_operands_as_their_contiguous_copies():
    """Strided x, h, c and weights (copied where they are not C-contiguous, and only there)
    give the bits of their contiguous copies."""
    cell = prnn.LSTMCell(INPUT, HIDDEN, algo="persistent", seed=1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, INPUT)).astype(np.float32)
    h, c = (rng.standard_normal((2, HIDDEN)).astype(np.float32) for _ in range(2))

    def strided(a):
        wide = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
        wide[..., ::2] = a
        return wide[..., ::2]

    params = {k: strided(v) for k, v in cell.params.items()}
    got = cell_step.fused_step(cell.cell, params, strided(x), strided(h), strided(c))
    want = cell_step.fused_step(cell.cell, cell.params, x, h, c)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
