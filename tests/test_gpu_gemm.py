"""GPU variants (CuPy arrays): the GEMM path with its fused pointwise kernels against torch.nn
on the CPU, the NumPy path, and the device rules of the layers. Skipped where no GPU is present."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import buffers, gemm
from persistent_rnn.cells import CELLS
from test_layers import CASES, compare, make_layer, run_pair

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode,kw,B,T,I,H,lengths", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_parity_on_gpu(cupy, mode, kw, B, T, I, H, lengths, dtype):
    ours, ref = make_layer(mode, I, H, dtype, **kw)
    errs = run_pair(ours, ref, B, T, np.random.default_rng(B + T), lengths=lengths, xp=cupy)
    compare(errs, dtype)
    assert all(isinstance(v, cupy.ndarray) for v in ours.params.values())
    assert all(isinstance(v, cupy.ndarray) for v in ours.grads.values())


@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_kernels_match_numpy_path(cupy, name, dtype):
    cell, rng = CELLS[name], np.random.default_rng(5)
    T, B, H = 9, 5, 37
    gi = rng.standard_normal((T, B, cell.gates * H)).astype(dtype)
    w_hh = (rng.standard_normal((cell.gates * H, H)) * 0.2).astype(dtype)
    b_hh = rng.standard_normal(cell.gates * H).astype(dtype)
    h0 = rng.standard_normal((B, H)).astype(dtype)
    c0 = rng.standard_normal((B, H)).astype(dtype) if cell.has_cell_state else None
    lengths = np.array([9, 1, 4, 9, 6], dtype=np.int32)
    dy = rng.standard_normal((T, B, H)).astype(dtype)
    dy[np.arange(T)[:, None] >= lengths[None, :]] = 0
    dhn = rng.standard_normal((B, H)).astype(dtype)

    def run(xp):
        dev = (lambda a: None if a is None else xp.asarray(a))
        g, w, b, h, c, n = map(dev, (gi, w_hh, b_hh, h0, c0, lengths))
        y, cs, saved = buffers.allocate_forward(cell, g)
        gemm.forward_steps(cell, g, w, b, h, c, n, y, cs, saved, start=0)
        dgi, dgh = buffers.allocate_backward(cell, dev(dy))
        dh0, dc0 = gemm.backward_steps(cell, dev(dy), w, h, c, n, y, cs, saved, dgi, dgh,
                                       dev(dhn), None if c is None else dev(dhn), stop=T)
        out = [y, saved, dgi, dgh, dh0] + ([cs, dc0] if cs is not None else [])
        return [a.get() if xp is not np else a for a in out]

    tol = 1e-5 if dtype == np.float32 else 1e-12
    for got, want in zip(run(cupy), run(np)):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_mixed_numpy_and_cupy_is_a_type_error(cupy):
    layer = prnn.RNN(3, 4)
    x = np.zeros((5, 2, 3), np.float32)
    with pytest.raises(TypeError, match="x: numpy, hx: cupy"):
        layer.forward(x, cupy.zeros((1, 2, 4), cupy.float32))
    y, _ = layer.forward(x)
    with pytest.raises(TypeError, match="dy"):
        layer.backward(cupy.asarray(y))


def test_params_follow_the_data(cupy):
    layer = prnn.LSTM(3, 4, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((5, 2, 3))
    y_cpu, _ = layer.forward(x)
    y_gpu, _ = layer.forward(cupy.asarray(x))
    assert isinstance(layer.params["weight_hh_l0"], cupy.ndarray)
    np.testing.assert_allclose(y_gpu.get(), y_cpu, rtol=1e-12, atol=1e-14)
    layer.backward(cupy.ones_like(y_gpu))
    y_back, _ = layer.forward(x)  # and back to the CPU, gradients included
    assert isinstance(layer.params["weight_hh_l0"], np.ndarray)
    assert isinstance(layer.grads["weight_hh_l0"], np.ndarray) and layer.grads["weight_hh_l0"].any()


def test_pointwise_indices_past_two_to_the_31(cupy):
    """B*G*H > 2^31 (about 36 GB of buffers): the last batch rows equal, bit for bit, a run of
    just those rows. h0 and W_hh hold small multiples of powers of two, so every partial sum of
    h0 @ W_hh^T is exact in float32 and the result cannot depend on the order cuBLAS sums in
    (which differs between the two batch sizes): any difference is an indexing error."""
    cell, hidden, batch = CELLS["lstm"], 8192, 2**16 + 1  # B * 4H = 2^31 + 32768
    assert batch * cell.gates * hidden > 2**31
    rng = cupy.random.default_rng(0)
    gi = rng.standard_normal((1, batch, cell.gates * hidden), dtype=np.float32)
    # |h0 . w| <= 8192 * 2^-4 * 8 * 2^-12 = 1, in steps of 2^-16: exact with 24 bits
    w_hh = rng.integers(-8, 9, (cell.gates * hidden, hidden)).astype(np.float32) * 2.0**-12
    h0 = rng.integers(-1, 2, (batch, hidden)).astype(np.float32) * 2.0**-4
    c0 = rng.standard_normal((batch, hidden), dtype=np.float32)
    y, cs, saved = buffers.allocate_forward(cell, gi)
    gemm.forward_steps(cell, gi, w_hh, None, h0, c0, None, y, cs, saved, start=0)
    tail = slice(batch - 2, batch)
    y2, cs2, saved2 = buffers.allocate_forward(cell, gi[:, tail])
    gemm.forward_steps(cell, cupy.ascontiguousarray(gi[:, tail]), w_hh, None, h0[tail], c0[tail],
                       None, y2, cs2, saved2, start=0)
    for big, small in ((y, y2), (cs, cs2), (saved, saved2)):
        np.testing.assert_array_equal(big[:, tail].get(), small.get())


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_recorded_cuda_graphs_replay_the_gemm_path(cupy, name):
    """gemm_graphs on: call 1 runs directly, call 2 records, 3 and 4 replay; each equals the
    step-by-step run on its own fresh inputs."""
    from persistent_rnn import step_graphs
    from test_step_graphs import _both, _case
    cell, rng = CELLS[name], np.random.default_rng(3)
    cases = [{k: None if v is None else cupy.asarray(v, np.float32) for k, v in _case(cell, rng).items()}
             for _ in range(4)]
    for a in cases:
        a["lengths"] = a["lengths"].astype(np.int32)
    direct = [[r.get() for r in _both(cell, a)] for a in cases]
    step_graphs.clear()
    with prnn.override_settings(gemm_graphs=True):
        replayed = [[r.get() for r in _both(cell, a)] for a in cases]
    assert len(step_graphs._entries) == 2 and all(
        isinstance(e, step_graphs._Recorded) for e in step_graphs._entries.values())
    step_graphs.clear()
    for got, want in zip(replayed, direct):  # recorded products: matmul.py's kernel, not cuBLAS
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("name", sorted(CELLS))
def test_planned_gemm_calls_equal_full_calls_on_the_gpu(cupy, monkeypatch, name):
    """A layer that asked for the GEMM path plans its calls on CuPy too (``gemm_plans``): calls
    3 on of a signature run planned, each bitwise the full path's, with initial states given,
    after the weights were stepped in place (the parameters move to the GPU at the first call)."""
    from persistent_rnn import gemm_plans
    from persistent_rnn.cells import layer_args
    mode, extra = layer_args(name)
    planned, full = (getattr(prnn, mode)(5, 7, algo="gemm", seed=2, **extra) for _ in range(2))
    served, real = [], gemm_plans.GemmPlan.forward
    monkeypatch.setattr(gemm_plans.GemmPlan, "forward",
                        lambda plan, *args: served.append(1) or real(plan, *args))
    rng = np.random.default_rng(9)
    for _ in range(4):
        x = cupy.asarray(rng.standard_normal((6, 3, 5)).astype(np.float32))
        h = cupy.asarray(rng.standard_normal((1, 3, 7)).astype(np.float32))
        hx = (h, h * 0.5) if CELLS[name].has_cell_state else h
        dy = cupy.asarray(rng.standard_normal((6, 3, 7)).astype(np.float32))
        results = []
        for layer in (planned, full):
            full._plan = None  # (the reference never plans)
            layer.zero_grad()
            y, hn = layer.forward(x, hx)
            dx, _ = layer.backward(dy)
            results.append([y, dx, *(hn if isinstance(hn, tuple) else (hn,)),
                            *[g.copy() for g in layer.grads.values()]])
            for n, w in layer.params.items():
                w -= 0.1 * layer.grads[n]
        for a, b in zip(*results):
            np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    assert len(served) == 2
