"""16-bit layers (fp16, bf16) on the GEMM path: dtypes, storage, accuracy against float64.

The reference is the float64 layer on the same parameters (the 16-bit values, upcast exactly) and
the same inputs; it does not round h_t, so the tolerances bound what 16-bit storage of h and of the
results costs: relative error (max |ours - ref| / max |ref| per array) <= 5e-3 for fp16 and <= 3e-2
for bf16, forward and backward, with lengths and both directions; for the relu RNN the forward
only (docs/api.md, "Accuracy": its gradients are measured along the rounded states instead,
tests/test_campaign.py).
"""
from __future__ import annotations

import ml_dtypes  # a core dependency: bfloat16 NumPy arrays
import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn.buffers import round_half
from persistent_rnn.cells import CELLS as REGISTRY, layer_args

TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}
CELLS = [layer_args(name) for name in REGISTRY]


def _pair(mode: str, kw: dict, dtype: str, **layer_kw):
    """A 16-bit layer and a float64 layer with the same (16-bit) parameters."""
    ours = getattr(prnn, mode)(6, 12, dtype=dtype, seed=3, **kw, **layer_kw)
    ref = getattr(prnn, mode)(6, 12, dtype="float64", **kw, **layer_kw)
    ref.load_params({k: v.astype(np.float64) for k, v in ours.params.items()})
    return ours, ref


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _flat(out) -> list:
    return [a for item in out for a in (item if isinstance(item, tuple) else (item,))]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode,kw", CELLS)
def test_gemm_path_matches_float64(mode, kw, dtype):
    ours, ref = _pair(mode, kw, dtype, num_layers=2, bidirectional=True)
    rng = np.random.default_rng(7)
    steps, batch = 9, 4
    x = rng.standard_normal((steps, batch, 6)).astype(ours.dtype)
    shape = (4, batch, 12)
    hx = tuple(rng.standard_normal(shape).astype(ours.dtype) for _ in range(2))
    hx = hx if ours.cell.has_cell_state else hx[0]
    lengths = [9, 3, 6, 1]
    y, hn = ours.forward(x, hx, lengths)
    up = (lambda a: tuple(v.astype(np.float64) for v in a) if isinstance(a, tuple)
          else a.astype(np.float64))
    y_ref, hn_ref = ref.forward(up(x), up(hx), lengths)
    assert y.dtype == ours.dtype and all(a.dtype == ours.dtype for a in _flat([hn]))
    dy = rng.standard_normal(y.shape).astype(ours.dtype)
    dhn = tuple(rng.standard_normal(shape).astype(ours.dtype) for _ in range(2))
    dhn = dhn if ours.cell.has_cell_state else dhn[0]
    dx, dhx = ours.backward(dy, dhn)
    dx_ref, dhx_ref = ref.backward(up(dy), up(dhn))
    tol, relu = TOLERANCE[dtype], kw.get("nonlinearity") == "relu"
    forward = len(_flat([y, hn]))
    for i, (got, want) in enumerate(zip(_flat([y, hn, dx, dhx]),
                                        _flat([y_ref, hn_ref, dx_ref, dhx_ref]))):
        assert got.dtype == ours.dtype and got.shape == want.shape
        assert (relu and i >= forward) or _relerr(got, want) <= tol
    for key, g in ours.grads.items():
        assert g.dtype == ours.dtype
        assert relu or _relerr(g, ref.grads[key]) <= tol, key
    assert ours.last_run.algo == "gemm"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_h_is_rounded_every_step(dtype):
    # The recurrence rounds h_t to the dtype at every step (where the 16-bit kernels do): a
    # float64 recurrence that rounds h_t likewise agrees to fp32 accuracy, up to a last-place flip.
    ours, _ = _pair("GRU", {}, dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3, 6)).astype(ours.dtype)
    y, _ = ours.forward(x)
    p = {k: v.astype(np.float64) for k, v in ours.params.items()}
    gi = x.astype(np.float64) @ p["weight_ih_l0"].T + p["bias_ih_l0"]
    h = np.zeros((3, 12))
    cell = ours.cell
    for t in range(20):
        gh = h @ p["weight_hh_l0"].T + p["bias_hh_l0"]
        h, _, _ = cell.forward(np, gi[t], gh, h, None)
        h = round_half(np, h.astype(np.float32), dtype).astype(np.float64)
        ulp = np.abs(h) * (2.0 ** -10 if dtype == "float16" else 2.0 ** -7) + 1e-7
        assert np.all(np.abs(y[t].astype(np.float64) - h) <= ulp), t
        h = y[t].astype(np.float64)  # follow ours, so that one flip does not propagate


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_half_is_ml_dtypes_rounding(dtype):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    a = np.concatenate([a, np.float32([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.996,
                                       2.0**-25, 2.0**-24 * 1.5, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])])
    target = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore", invalid="ignore"):
        want = a.astype(target).astype(np.float32)
    got = round_half(np, a, dtype)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("dtype,np_dtype", [("float16", np.float16), ("bfloat16", None)])
def test_params_and_grads_are_16bit(dtype, np_dtype):
    layer = prnn.LSTM(3, 5, dtype=dtype, seed=0)
    want = np.dtype(np_dtype) if np_dtype else np.dtype(ml_dtypes.bfloat16)
    assert layer.dtype == want and repr(layer).find(f"dtype='{dtype}'") > 0
    assert all(v.dtype == want for v in layer.params.values())
    assert all(v.dtype == want and not v.any() for v in layer.grads.values())
    # load_params rounds into the layer's dtype
    layer.load_params({k: np.full(v.shape, 1.0 + 2.0**-12) for k, v in layer.params.items()})
    assert all(v.dtype == want and np.all(v.astype(np.float32) == 1.0)
               for v in layer.params.values())
    # gradients accumulate over backward calls, summed in fp32 and rounded once per call
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(want)
    for _ in range(2):
        y, _ = layer.forward(x)
        layer.backward(np.ones_like(y))
    once = {k: v.copy() for k, v in layer.grads.items()}
    layer.zero_grad()
    y, _ = layer.forward(x)
    layer.backward(np.ones_like(y))
    for k, v in once.items():
        twice = (2 * layer.grads[k].astype(np.float32)).astype(want)
        assert np.array_equal(v, twice), k


def test_dtype_checks_name_the_argument():
    layer = prnn.GRU(3, 4, dtype="float16")
    x = np.zeros((2, 1, 3), np.float32)
    with pytest.raises(TypeError, match="x must have dtype float16"):
        layer.forward(x)
    y, _ = layer.forward(x.astype(np.float16))
    with pytest.raises(TypeError, match="dy must have dtype float16"):
        layer.backward(np.zeros(y.shape, np.float32))
    assert prnn.GRU(3, 4, dtype="half").dtype == np.float16  # NumPy's spelling
    with pytest.raises(ValueError, match="dtype must be one of"):
        prnn.GRU(3, 4, dtype="bf16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        prnn.GRU(3, 4, dtype="int16")
    assert prnn.GRU(3, 4, dtype=np.float16).dtype == np.float16
    assert prnn.GRU(3, 4, dtype=ml_dtypes.bfloat16).dtype.name == "bfloat16"


def test_persistent_16bit_says_why_it_does_not_fit():
    layer = prnn.LSTM(3, 1793, dtype="float16", algo="persistent")  # 16-bit LSTM max: 1792
    with pytest.raises(ValueError, match="1793 > 1792"):
        layer.forward(np.zeros((2, 1, 3), np.float16))
