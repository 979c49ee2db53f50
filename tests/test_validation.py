"""One test per bad input: the error's type and that its message names the argument, what was
expected and what was given."""
from __future__ import annotations

import re
import sys
import types
import warnings

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn.validation import CallOrderError

RNG = np.random.default_rng(0)


def _x(T=5, B=2, I=3, dtype=np.float32):
    return RNG.standard_normal((T, B, I)).astype(dtype)


def _raises(exc, *fragments):
    """``pytest.raises`` whose message must contain every fragment (escaped)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


@pytest.mark.parametrize("arg,value,exc", [
    ("input_size", 0, ValueError), ("hidden_size", -3, ValueError), ("num_layers", 0, ValueError),
    ("hidden_size", 2.5, TypeError), ("input_size", True, TypeError)])
def test_non_positive_sizes(arg, value, exc):
    kw = dict(input_size=3, hidden_size=4, num_layers=1)
    kw[arg] = value
    with _raises(exc, arg, "positive int", repr(value)):
        prnn.LSTM(**kw)


def test_unknown_algo():
    with _raises(ValueError, "algo", "'persistent'", "'fast'"):
        prnn.GRU(3, 4, algo="fast")


def test_unknown_nonlinearity():
    with _raises(ValueError, "nonlinearity", "'relu'", "'sigmoid'"):
        prnn.RNN(3, 4, nonlinearity="sigmoid")


def test_nonlinearity_only_for_rnn():
    with pytest.raises(TypeError, match="nonlinearity"):
        prnn.GRU(3, 4, nonlinearity="relu")


def test_unknown_dtype():
    with _raises(ValueError, "dtype", "float32", "'int8'"):
        prnn.RNN(3, 4, dtype="int8")


@pytest.mark.parametrize("shape,given", [((5, 2), "(5, 2)"), ((5, 2, 3, 1), "(5, 2, 3, 1)"),
                                         ((5, 2, 4), "(5, 2, 4)")])
def test_x_wrong_rank_or_size(shape, given):
    with _raises(ValueError, "x must have shape", "(T, B, input_size)", "3)", given):
        prnn.RNN(3, 4).forward(np.zeros(shape, np.float32))


def test_x_batch_first_wording():
    with _raises(ValueError, "(B, T, input_size)", "(2, 5)"):
        prnn.RNN(3, 4, batch_first=True).forward(np.zeros((2, 5), np.float32))


def test_x_integer_dtype():
    with _raises(TypeError, "x", "float32", "int64"):
        prnn.RNN(3, 4).forward(np.ones((5, 2, 3), dtype=np.int64))


def test_x_other_float_dtype():
    with _raises(TypeError, "x", "float64", "float32"):
        prnn.RNN(3, 4, dtype="float64").forward(_x())


def test_x_not_an_array():
    with _raises(TypeError, "x", "numpy.ndarray", "list"):
        prnn.RNN(3, 4).forward([[[0.0] * 3]])


def test_hx_wrong_shape():
    with _raises(ValueError, "hx", "(num_layers * num_directions, B, hidden_size)", "(2, 2, 4)",
                 "(1, 2, 4)"):
        prnn.GRU(3, 4, bidirectional=True).forward(_x(), np.zeros((1, 2, 4), np.float32))


def test_hx_wrong_batch():
    with _raises(ValueError, "hx", "(1, 2, 4)", "(1, 3, 4)"):
        prnn.RNN(3, 4).forward(_x(), np.zeros((1, 3, 4), np.float32))


def test_lstm_hx_not_a_pair():
    with _raises(TypeError, "hx", "pair (h, c)", "ndarray"):
        prnn.LSTM(3, 4).forward(_x(), np.zeros((1, 2, 4), np.float32))


def test_lstm_c0_wrong_shape():
    h0 = np.zeros((1, 2, 4), np.float32)
    with _raises(ValueError, "hx[1]", "(1, 2, 4)", "(1, 2, 5)"):
        prnn.LSTM(3, 4).forward(_x(), (h0, np.zeros((1, 2, 5), np.float32)))


@pytest.mark.parametrize("missing", [0, 1])
def test_lstm_hx_pair_with_none_is_refused_as_torch_nn_refuses_it(missing):
    # torch.nn.LSTM takes hx=None or both states; (h0, None) was taken as c0 = 0 (issue 19)
    hx = [np.zeros((1, 2, 4), np.float32)] * 2
    hx[missing] = None
    with _raises(TypeError, "hx must be None or a pair (h0, c0)", f"None for hx[{missing}]"):
        prnn.LSTM(3, 4).forward(_x(), tuple(hx))


def test_lstm_dhn_pair_may_hold_none():
    # a zero gradient may be None in the pair, as autograd passes None for an unused output
    layer, x, results = prnn.LSTM(3, 4, seed=0), _x(), []
    for dcn in (None, np.zeros((1, 2, 4), np.float32)):
        y, (hn, _) = layer.forward(x)
        results.append(layer.backward(np.zeros_like(y), (np.ones_like(hn), dcn))[0])
    assert np.array_equal(*results) and np.abs(results[0]).max() > 0


def test_gru_hx_given_a_pair():
    h0 = np.zeros((1, 2, 4), np.float32)
    with _raises(TypeError, "hx", "single array", "tuple"):
        prnn.GRU(3, 4).forward(_x(), (h0, h0))


def test_hx_integer_dtype():
    with _raises(TypeError, "hx", "float32", "int32"):
        prnn.RNN(3, 4).forward(_x(), np.zeros((1, 2, 4), np.int32))


@pytest.mark.parametrize("lengths,fragments", [
    ([5], ("lengths", "(2,)", "(1,)")),
    ([5, 5, 5], ("lengths", "(2,)", "(3,)")),
    ([0, 5], ("lengths", "1..5", "min 0")),
    ([3, 6], ("lengths", "1..5", "max 6")),
])
def test_lengths_wrong_count_or_range(lengths, fragments):
    with _raises(ValueError, *fragments):
        prnn.LSTM(3, 4).forward(_x(), lengths=lengths)


def test_lengths_not_integers():
    with _raises(TypeError, "lengths", "integers", "float64"):
        prnn.RNN(3, 4).forward(_x(), lengths=np.array([2.0, 5.0]))


def test_empty_lengths_list_with_an_empty_batch():
    # [] becomes a float64 NumPy array; with B = 0 it is an empty integer sequence (issue 19)
    for lengths in ([], (), np.zeros(0, np.int64)):
        y, hn = prnn.GRU(3, 4).forward(_x(B=0), lengths=lengths)
        assert y.shape == (5, 0, 4) and hn.shape == (1, 0, 4)
    with _raises(ValueError, "lengths", "(2,)", "(0,)"):
        prnn.GRU(3, 4).forward(_x(), lengths=[])


@pytest.mark.parametrize("arg", ["x", "hx", "dy"])
def test_non_native_byte_order_is_named(arg):
    # '>f4' is also called float32: the message must say what differs (issue 19)
    layer = prnn.RNN(3, 4)
    swapped = np.dtype(np.float32).newbyteorder("S")
    x, hx = _x(), np.zeros((1, 2, 4), np.float32)
    order = "big" if swapped.byteorder == ">" else "little"
    fragments = (f"{arg} must have dtype float32", f"float32 in {order}-endian byte order",
                 repr(swapped.str), ".astype('float32')")
    if arg == "dy":
        y, _ = layer.forward(x)
        with _raises(TypeError, *fragments):
            layer.backward(y.astype(swapped))
        return
    with _raises(TypeError, *fragments):
        layer.forward(x.astype(swapped) if arg == "x" else x, hx.astype(swapped) if arg == "hx"
                      else hx)


@pytest.mark.parametrize("shape", [(5, 2, 3), (5, 2), (5, 2, 4, 1), (4, 2, 4)])
def test_dy_wrong_rank_or_size(shape):
    layer = prnn.RNN(3, 4)
    y, _ = layer.forward(_x())
    with _raises(ValueError, "dy", "(T, B, D*H)", "(5, 2, 4)", str(shape)):
        layer.backward(np.zeros(shape, np.float32))


def test_dy_integer_dtype():
    layer = prnn.RNN(3, 4)
    y, _ = layer.forward(_x())
    with _raises(TypeError, "dy", "float32", "int64"):
        layer.backward(np.zeros(y.shape, np.int64))


def test_dhn_wrong_shape():
    layer = prnn.GRU(3, 4, num_layers=2)
    y, hn = layer.forward(_x())
    with _raises(ValueError, "dhn", "(2, 2, 4)", "(1, 2, 4)"):
        layer.backward(np.zeros_like(y), np.zeros((1, 2, 4), np.float32))


def test_lstm_dhn_not_a_pair():
    layer = prnn.LSTM(3, 4)
    y, (h, c) = layer.forward(_x())
    with _raises(TypeError, "dhn", "pair (h, c)", "ndarray"):
        layer.backward(np.zeros_like(y), np.zeros_like(h))


def test_lstm_dcn_wrong_shape():
    layer = prnn.LSTM(3, 4)
    y, (h, c) = layer.forward(_x())
    with _raises(ValueError, "dhn[1]", "(1, 2, 4)", "(2, 2, 4)"):
        layer.backward(np.zeros_like(y), (np.zeros_like(h), np.zeros((2, 2, 4), np.float32)))


def test_backward_before_forward():
    with _raises(CallOrderError, "backward", "forward"):
        prnn.RNN(3, 4).backward(np.zeros((5, 2, 4), np.float32))


def test_backward_twice():
    layer = prnn.RNN(3, 4)
    y, _ = layer.forward(_x())
    layer.backward(np.zeros_like(y))
    with pytest.raises(RuntimeError, match="once per forward"):
        layer.backward(np.zeros_like(y))
    assert issubclass(CallOrderError, ValueError)


def test_load_params_missing_key():
    layer = prnn.LSTM(3, 4)
    params = dict(layer.params)
    del params["bias_hh_l0"]
    with _raises(ValueError, "params", "missing", "'bias_hh_l0'"):
        layer.load_params(params)


def test_load_params_unknown_key():
    layer = prnn.LSTM(3, 4)
    params = dict(layer.params, weight_hh_l1=np.zeros((16, 4)))
    with _raises(ValueError, "params", "unknown", "'weight_hh_l1'"):
        layer.load_params(params)


def test_load_params_wrong_shape():
    layer = prnn.GRU(3, 4)
    params = dict(layer.params, weight_ih_l0=np.zeros((12, 4)))
    with _raises(ValueError, "params['weight_ih_l0']", "(12, 3)", "(12, 4)"):
        layer.load_params(params)


def test_load_params_not_a_mapping():
    with _raises(TypeError, "params", "mapping", "list"):
        prnn.GRU(3, 4).load_params([1, 2])


def test_load_params_keeps_values_and_dtype():
    layer = prnn.GRU(3, 4, dtype="float64")
    new = {k: np.full(v.shape, 0.5, np.float32) for k, v in layer.params.items()}
    layer.load_params(new)
    assert all(v.dtype == np.float64 and np.all(v == 0.5) for v in layer.params.values())
    new["weight_ih_l0"][...] = 1.0  # a copy was taken
    assert np.all(layer.params["weight_ih_l0"] == 0.5)


def test_load_params_is_all_or_nothing():
    layer = prnn.LSTM(3, 4, num_layers=2)
    before = {k: v.copy() for k, v in layer.params.items()}
    new = {k: np.full(v.shape, 0.25) for k, v in layer.params.items()}
    new["bias_hh_l1"] = np.full(new["bias_hh_l1"].shape, "x")  # the last key fails to convert
    with _raises(TypeError, "params['bias_hh_l1']", "float32"):
        layer.load_params(new)
    for k, v in layer.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("make", [lambda: prnn.GRU(3, 4), lambda: prnn.GRUCell(3, 4)],
                         ids=["layer", "cell"])
@pytest.mark.parametrize("bad,what", [(np.complex128, "complex128"), (object, "object")])
def test_load_params_refuses_values_that_are_no_real_numbers(make, bad, what):
    """Complex values would lose their imaginary part and objects such as None become NaN: a
    TypeError naming the parameter, nothing loaded (layers and cells alike)."""
    module = make()
    before = {k: v.copy() for k, v in module.params.items()}
    new = {k: v.astype(np.float64) for k, v in module.params.items()}
    key = next(iter(new))
    new[key] = (new[key] + 1j) if bad is np.complex128 else np.full(new[key].shape, None, object)
    with _raises(TypeError, f"params[{key!r}]", "float32", what), warnings.catch_warnings():
        warnings.simplefilter("error")
        module.load_params(new)
    for k, v in module.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_numpy_and_cupy_mixed(monkeypatch):
    """The module check itself, with a stand-in ``cupy`` (the real one needs a GPU to make arrays;
    test_gpu_gemm.py repeats this with real CuPy arrays)."""
    class FakeCupyArray:
        ndim, shape, dtype = 3, (1, 2, 4), np.dtype(np.float32)

    FakeCupyArray.__module__ = "cupy"
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeCupyArray))
    with _raises(TypeError, "all be NumPy or all CuPy", "x: numpy", "hx: cupy"):
        prnn.RNN(3, 4).forward(_x(), FakeCupyArray())
