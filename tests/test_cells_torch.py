"""persistent_rnn.torch's RNNCell, GRUCell and LSTMCell as drop-ins for torch.nn's: results and
gradients on random batched inputs against torch.nn in float64, the default zero state, the
path each dtype and device takes (``last_run``), and torch.nn's errors for bad input.
(PyTorch's own module_db samples of the cells run in tests/test_torch_module_db.py.)"""
from __future__ import annotations

import pytest
import torch

import persistent_rnn.torch as prt
from persistent_rnn.cells import CELLS, layer_args
from torch_calls import forward_backward, raised, tensors

# (class name, constructor kwargs) per cell of the registry: RNNCell tanh/relu, GRUCell, LSTMCell
CASES = [(f"{layer_args(n)[0]}Cell", layer_args(n)[1]) for n in CELLS]
CASE_IDS = list(CELLS)
RUNS = [("gemm", torch.float64, 1e-12), ("gemm", torch.float32, 2e-6),
        ("persistent", torch.float32, 2e-6)]


def make(name: str, kwargs: dict, algo: str, dtype: torch.dtype, seed: int = 0):
    """Our cell in ``dtype`` and torch.nn's float64 twin with the same parameters."""
    torch.manual_seed(seed)
    ours = getattr(prt, name)(3, 6, algo=algo, **kwargs).to(dtype)
    ref = getattr(torch.nn, name)(3, 6, **kwargs).double()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def random_args(name: str, batch: int, dtype: torch.dtype, with_state: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=gen, dtype=torch.float64)
    if not with_state:
        return (x.to(dtype).requires_grad_(),)
    states = [torch.randn(batch, 6, generator=gen, dtype=torch.float64)
              for _ in range(2 if name == "LSTMCell" else 1)]
    states = [s.to(dtype).requires_grad_() for s in states]
    return (x.to(dtype).requires_grad_(), tuple(states) if name == "LSTMCell" else states[0])


def run(cell, args, seed: int):
    """Outputs, then the gradients of inputs and parameters of a random projection of them."""
    return [t for part in forward_backward(cell, args, seed) for t in part]


@pytest.mark.parametrize("algo,dtype,rtol", RUNS, ids=["gemm-f64", "gemm-f32", "fused-f32"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_step_and_gradients_match_torch_nn_float64(name, kwargs, algo, dtype, rtol):
    """Batched random input with and without a state (torch.nn's zeros): every output and
    gradient within ``rtol`` of torch.nn's float64 cell (relative to the largest value)."""
    for with_state in (True, False):
        ours, ref = make(name, kwargs, algo, dtype)
        args = random_args(name, 4, dtype, with_state, seed=7)
        got = run(ours, args, seed=1)
        assert ours.last_run.algo == algo and ours.last_run.backward.algo == "gemm"
        want = run(ref, [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor)
                         else tuple(t.detach().double().requires_grad_() for t in a)
                         for a in args], seed=1)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            scale = float(w.detach().abs().max())
            assert g.dtype == dtype, i
            torch.testing.assert_close(g.double(), w, rtol=rtol, atol=rtol * scale,
                                       msg=lambda m: f"{name} state={with_state} #{i}: {m}")


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_fused_step_is_bitwise_reproducible(name, kwargs):
    """The emulated fused kernel gives the same bits on every call."""
    ours, _ = make(name, kwargs, "persistent", torch.float32)
    args = random_args(name, 3, torch.float32, True, seed=3)
    with torch.no_grad():
        first, second = tensors(ours(*args)), tensors(ours(*args))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_auto_runs_torch_where_the_library_does_not(name, kwargs):
    """algo="auto": CPU tensors, float64 and float16 run torch's cell (bit for bit torch.nn's),
    and last_run says why; a forced algo refuses dtypes the library cannot run."""
    for dtype, why in ((torch.float32, "CPU tensors"), (torch.float64, "CPU tensors"),
                       (torch.float16, "dtype torch.float16")):
        ours, _ = make(name, kwargs, "auto", dtype)
        twin = getattr(torch.nn, name)(3, 6, **kwargs).to(dtype)
        twin.load_state_dict(ours.state_dict())
        args = random_args(name, 2, dtype, True, seed=5)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(tensors(ours(*args)), tensors(twin(*args))))
        assert ours.last_run.algo == "torch" and why in ours.last_run.fallback
    half, _ = make(name, kwargs, "gemm", torch.float16)
    with pytest.raises(ValueError, match="algo='gemm' cannot run this cell: dtype torch.float16"):
        half(*random_args(name, 2, torch.float16, True, seed=5))
    double, _ = make(name, kwargs, "persistent", torch.float64)
    with pytest.raises(ValueError, match="cannot run this cell: dtype is float64"):
        double(*random_args(name, 2, torch.float64, True, seed=5))
    with pytest.raises(ValueError, match="algo must be one of"):
        getattr(prt, name)(3, 6, algo="fast", **kwargs)


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_bad_input_raises_as_torch_nn(name, kwargs, algo):
    """Wrong sizes, dimensions, batch, state dtype and (LSTM) a state that is not a pair raise
    exactly torch.nn's exception and message with the library forced."""
    ours, _ = make(name, kwargs, algo, torch.float32)
    ref = getattr(torch.nn, name)(3, 6, **kwargs)
    lstm = name == "LSTMCell"

    def state(*shape, dtype=torch.float32):
        h = torch.randn(*shape, dtype=dtype)
        return (h, torch.randn(*shape)) if lstm else h
    bad = [(torch.randn(2, 4), state(2, 6)), (torch.randn(2, 3), state(2, 7)),
           (torch.randn(2, 3), state(3, 6)), (torch.randn(1, 2, 3), None),
           (torch.randn(2, 3), state(1, 2, 6)), (torch.randn(3), state(2, 6)),
           (torch.randn(2, 3), state(2, 6, dtype=torch.float64)), (torch.randn(2, 4), None),
           (torch.randn(2, 3), state(6))]
    if lstm:
        bad += [(torch.randn(2, 3), (torch.randn(2, 6),) * 3)]
    for i, args in enumerate(bad):
        args = args if args[1] is not None else args[:1]
        want = raised(ref, args)
        assert want is not None, i
        assert raised(ours, args) == want, i


def test_unknown_nonlinearity_raises_as_torch_nn():
    """RNNCell's nonlinearity is checked by torch.nn's forward: the same RuntimeError."""
    for cls in (torch.nn.RNNCell, prt.RNNCell):
        cell = cls(3, 6, nonlinearity="gelu")
        with pytest.raises(RuntimeError, match="Unknown nonlinearity: gelu"):
            cell(torch.randn(2, 3))


def test_torch_func_and_compile_run_the_library_step():
    """torch.func.grad and vmap through the cell equal torch.nn's; torch.compile(fullgraph=True)
    traces the library's op (forward and backward ran it)."""
    ours, ref = make("LSTMCell", {}, "gemm", torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    grads = [torch.func.grad(lambda p, m=m: torch.func.functional_call(m, p, (x,))[0].sin().sum())(
        {k: v.detach() for k, v in m.named_parameters()}) for m in (ours, ref)]
    for k in grads[1]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-12, atol=1e-12)
    xs = torch.randn(4, 2, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda a: ours(a)[0])(xs),
                               torch.stack([ref(a)[0] for a in xs]), rtol=1e-12, atol=1e-12)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    h, c = compiled(x)
    (h.sum() + c.sum()).backward()
    assert ours.last_run.algo == "gemm" and ours.last_run.backward.algo == "gemm"
    torch.testing.assert_close(h, ref(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
def test_one_output_gradient_and_empty_sizes(algo):
    """test_nn's cases: LSTMCell's backward from h' alone or c' alone (the other gradient is
    undefined) reaches the input; zero hidden size and zero batch give torch.nn's empty results."""
    cell = prt.LSTMCell(2, 3, algo=algo)
    for i in range(2):
        s = torch.randn(1, 2, requires_grad=True)
        cell(s)[i].sum().backward()
        assert s.grad is not None and s.grad.abs().sum() > 0, i
    for name, kwargs in CASES:
        for shape, hidden in (((3, 10), 0), ((0, 10), 4)):
            ours = getattr(prt, name)(10, hidden, algo=algo, **kwargs)
            ref = getattr(torch.nn, name)(10, hidden, **kwargs)
            ref.load_state_dict(ours.state_dict())
            x = torch.randn(*shape)
            got, want = tensors(ours(x)), tensors(ref(x))
            assert [g.shape for g in got] == [w.shape for w in want], (name, shape, hidden)
            assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
def test_inference_step_equals_the_op(algo):
    """Under no_grad the step skips the op's dispatch: the same bits and the same record as the
    op that autograd records."""
    ours, _ = make("GRUCell", {}, algo, torch.float32)
    x, h = random_args("GRUCell", 3, torch.float32, True, seed=4)
    graph = ours(x, h)
    assert graph.grad_fn is not None and ours.last_run.algo == algo
    with torch.no_grad():
        plain = ours(x, h)
    assert plain.grad_fn is None and torch.equal(plain, graph) and ours.last_run.algo == algo
