"""torch.nn's semantics at the edges, on every algorithm (``persistent`` on NumPy is the CPU
emulation of the CUDA kernels): NaN and Inf propagation through relu, NaN/Inf in the padding past a
sequence's length (ignored: not one result changes), T = 0 (a clear error) and B = 0 (empty
results, as torch.nn)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import persistent_rnn as prnn

ALGOS = ("gemm", "persistent")
pytestmark = pytest.mark.timeout(300)


def _layer(mode, algo, **kw):
    return getattr(prnn, mode)(5, 16, algo=algo, seed=1, dtype="float32", **kw)


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _relu_pair(algo, seed):
    """A relu RNN of the library, torch.nn's with the same weights, and a fresh input."""
    layer = _layer("RNN", algo, nonlinearity="relu")
    ref = torch.nn.RNN(5, 16, nonlinearity="relu")
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in layer.params.items()})
    return layer, ref, np.random.default_rng(seed).standard_normal((4, 3, 5)).astype(np.float32)


@pytest.mark.parametrize("algo", ALGOS)
def test_relu_propagates_nan_like_torch(algo, xp=np):
    layer, ref, x = _relu_pair(algo, seed=0)
    x[1, 2, 0] = np.nan  # sequence 2 turns NaN from step 1 on, in every unit
    y = _host(layer.forward(xp.asarray(x))[0])
    with torch.no_grad():
        y_ref, _ = ref(torch.from_numpy(x))
    assert layer.last_run.algo == algo
    np.testing.assert_array_equal(np.isnan(y), torch.isnan(y_ref).numpy())
    assert np.isnan(y[1:, 2]).all() and not np.isnan(y[:, :2]).any()


@pytest.mark.parametrize("algo", ALGOS)
def test_relu_propagates_inf_like_torch(algo, xp=np):
    # +Inf in one input turns some units Inf (relu keeps it; the persistent kernels exchange it
    # as Inf, not as the NaN an Inf with tag bits would be), then NaN where Inf - Inf meet.
    layer, ref, x = _relu_pair(algo, seed=4)
    x[0, 1, 3] = np.inf
    with np.errstate(invalid="ignore"):  # Inf - Inf in the GEMM path's matmul
        y = _host(layer.forward(xp.asarray(x))[0])
    with torch.no_grad():
        y_ref = ref(torch.from_numpy(x))[0].numpy()
    assert layer.last_run.algo == algo and np.isposinf(y[0, 1]).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(y_ref))
    np.testing.assert_array_equal(np.isposinf(y), np.isposinf(y_ref))
    np.testing.assert_allclose(y[np.isfinite(y_ref)], y_ref[np.isfinite(y_ref)], rtol=1e-5, atol=1e-5)


def _padding_case(mode, algo, poison: float, xp=np):
    """forward + backward of a 2-layer bidirectional layer with ``poison`` (0, NaN or Inf) in
    the padding of ``x`` and ``dy``; returns every result."""
    layer = _layer(mode, algo, num_layers=2, bidirectional=True)
    rng = np.random.default_rng(3)
    steps, lengths = 6, np.array([6, 2, 4], np.int32)
    x = rng.standard_normal((steps, 3, 5)).astype(np.float32)
    past = np.arange(steps)[:, None] >= lengths[None, :]
    x[past] = poison
    y, hn = layer.forward(xp.asarray(x), lengths=lengths)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy[past] = poison
    dx, dhx = layer.backward(xp.asarray(dy))
    states = lambda s: list(s) if isinstance(s, tuple) else [s]  # noqa: E731
    results = [y, *states(hn), dx, *states(dhx), *layer.grads.values()]
    return [_host(a) for a in results], layer.last_run


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("algo", ALGOS)
def test_nan_and_inf_in_padding_change_nothing(mode, algo, xp=np):
    clean, stats = _padding_case(mode, algo, 0.0, xp)
    assert stats.algo == algo
    for poison in (np.nan, np.inf):
        got, _ = _padding_case(mode, algo, poison, xp)
        for a, b in zip(got, clean):
            assert np.isfinite(a).all()
            np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ALGOS)
def test_relu_nan_on_the_gpu(cupy, algo):
    test_relu_propagates_nan_like_torch(algo, cupy)


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ALGOS)
def test_relu_inf_on_the_gpu(cupy, algo):
    test_relu_propagates_inf_like_torch(algo, cupy)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("algo", ALGOS)
def test_padding_on_the_gpu(cupy, mode, algo):
    test_nan_and_inf_in_padding_change_nothing(mode, algo, cupy)


@pytest.mark.parametrize("algo", ("auto", *ALGOS))
def test_no_time_steps_is_a_clear_error(algo):
    layer = _layer("GRU", algo)
    with pytest.raises(ValueError, match=r"at least one time step"):
        layer.forward(np.zeros((0, 2, 5), np.float32))
    first = _layer("GRU", algo, batch_first=True)
    with pytest.raises(ValueError, match=r"at least one time step"):
        first.forward(np.zeros((2, 0, 5), np.float32))


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_empty_batch_matches_torch_under_every_algo(mode):
    ref = getattr(torch.nn, mode)(5, 16, num_layers=2, bidirectional=True)
    y_ref, hn_ref = ref(torch.zeros(4, 0, 5))
    h_ref = hn_ref[0] if mode == "LSTM" else hn_ref
    for algo in ("auto", *ALGOS):
        layer = _layer(mode, algo, num_layers=2, bidirectional=True)
        y, hn = layer.forward(np.zeros((4, 0, 5), np.float32), lengths=np.zeros(0, np.int64))
        h = hn[0] if mode == "LSTM" else hn
        assert y.shape == tuple(y_ref.shape) and h.shape == tuple(h_ref.shape)
        dx, _ = layer.backward(np.zeros_like(y))
        assert dx.shape == (4, 0, 5)
        assert all(not g.any() for g in layer.grads.values())
        # the GEMM path returned the empty results; under any other algo last_run says why
        assert layer.last_run.algo == "gemm"
        assert (layer.last_run.fallback is None) == (algo == "gemm"), layer.last_run
        if algo != "gemm":
            assert layer.last_run.fallback.startswith("empty batch: nothing to compute")
