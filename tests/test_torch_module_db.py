"""PyTorch's own module samples for nn.RNN/GRU/LSTM (and, at the end, nn.RNNCell/GRUCell/LSTMCell),
run through persistent_rnn.torch with the library forced.

``torch.testing._internal.common_modules.module_db`` (shipped in torch's wheel) describes how
PyTorch tests its recurrent modules: constructor arguments (bias, batch_first, bidirectional,
nonlinearity, proj_size, two layers), forward inputs (unbatched input with and without h0/c0,
packed sequences), a no-batch-dim reference and the error inputs. Every sample here builds
torch.nn's module and ours with the same ``state_dict`` and checks, with ``algo`` forced so that
the library — not torch's fallback — runs (``last_run`` proves it):

* forward outputs and states, and the gradients of the input, h0/c0 and every parameter, against
  torch.nn in float64 (float64 samples to 1e-9 relative; float32 ones to float32 round-off);
* the no-batch-dim reference (an unbatched input equals a batch of one), non-contiguous input and
  states, eval mode equal to training mode (no dropout in the samples), contiguous results;
* the error inputs raise torch.nn's exception types and messages;
* repr, factory kwargs, construction on the meta device, ``.float()``/``.double()``, the
  state_dict both ways and a whole-module ``torch.save``/``torch.load`` round trip;
* test_nn's argument checks: wrong sizes and dimensions raise torch.nn's exceptions and messages;
* on the GEMM path in float64: gradcheck and gradgradcheck (fast mode) of every sample.

``algo="persistent"`` on CPU tensors runs the CUDA kernels' CPU emulation in float32 (the
kernels hold float32 or 16-bit weights: float64 is refused by design); ``proj_size`` samples run
its LSTMP kernels.
"""
from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence
from torch.testing._internal import common_modules  # needs 'expecttest' (the [test] extra)

import persistent_rnn.torch as prt
from torch_calls import forward_backward, raised, tensors

NAMES = ("RNN", "GRU", "LSTM")
# (algo, dtype): the GEMM path in both float dtypes, the emulated persistent kernels in float32
RUNS = [("gemm", torch.float64), ("gemm", torch.float32), ("persistent", torch.float32)]
RUN_IDS = ["gemm-float64", "gemm-float32", "persistent-float32"]
# relative tolerances against torch.nn in float64; atol is the same times the largest |value|
RTOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def module_info(name: str):
    """torch's ModuleInfo of ``torch.nn.<name>``."""
    cls = getattr(torch.nn, name)
    return next(info for info in common_modules.module_db if info.module_cls is cls)


def samples(name: str, dtype: torch.dtype, requires_grad: bool = True, seed: int = 0) -> list:
    """torch's ModuleInputs for ``name`` (RNN and GRU with their packed-sequence samples), drawn
    from a seeded generator (torch's sample functions use the global one)."""
    info = module_info(name)
    extra = {} if name == "LSTM" else {"with_packed_sequence": True}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return info.module_inputs_func(info, device="cpu", dtype=dtype,
                                       requires_grad=requires_grad, training=True, **extra)


def build(name: str, sample, dtype: torch.dtype, algo: str):
    """Our module and torch.nn's float64 one with the same parameters (ours in ``dtype``)."""
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    ours = getattr(prt, name)(*args, **kwargs, algo=algo).to(dtype)
    ref = getattr(torch.nn, name)(*args, **kwargs).double()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def leaves(obj, dtype: torch.dtype | None = None):
    """A copy of a forward argument (tensor, tuple of tensors, PackedSequence) whose tensors are
    new leaves (in ``dtype`` if given) that keep ``requires_grad``."""
    if isinstance(obj, PackedSequence):
        return obj._replace(data=leaves(obj.data, dtype))
    if isinstance(obj, tuple):
        return tuple(leaves(o, dtype) for o in obj)
    t = obj.detach().to(dtype or obj.dtype).clone()
    return t.requires_grad_(obj.requires_grad)




def noncontiguous(obj):
    """The same values in memory with a stride of 2 along the last dimension."""
    if isinstance(obj, PackedSequence):
        return obj._replace(data=noncontiguous(obj.data))
    if isinstance(obj, tuple):
        return tuple(noncontiguous(o) for o in obj)
    t = torch.repeat_interleave(obj.detach(), 2, dim=-1)[..., ::2]
    assert not t.is_contiguous()
    return t.requires_grad_(obj.requires_grad)




def assert_close(got, want, rtol: float, what: str) -> None:
    """Elementwise within ``rtol`` relative to the largest magnitude of ``want`` (a component
    that is near zero where the others are not is judged on the layer's scale)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, f"{what}[{i}]: missing gradient"
        scale = max(float(w.detach().abs().max()), 1.0) if w.numel() else 1.0
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"{what}[{i}]: {m}")


def assert_library_ran(module, algo: str, dtype: torch.dtype) -> None:
    """The forward and its backward ran the library's ``algo``, not torch's kernels."""
    run = module.last_run
    assert run is not None and run.algo == algo and run.fallback is None, run
    assert run.backward is not None and run.backward.algo == algo, run
    assert run.emulated == (algo == "persistent") and run.restarts == 0, run
    assert run.dtype == str(dtype).removeprefix("torch."), run


def matches_torch_nn(name: str, index: int, sample, dtype: torch.dtype, algo: str, ran) -> tuple:
    """Sample ``index``: our module's outputs and every gradient equal torch.nn's float64 ones,
    and ``ran(module, algo, dtype)`` holds; ``(module, args, (outputs, input grads, parameter
    grads), label)``."""
    ours, ref = build(name, sample, dtype, algo)
    args = sample.forward_input.args
    what = f"{name} sample {index} {sample.constructor_input.kwargs}"
    got = forward_backward(ours, leaves(args), index)
    ran(ours, algo, dtype)
    want = forward_backward(ref, leaves(args, torch.float64), index)
    for part, g, w in zip(("outputs", "input grads", "parameter grads"), got, want):
        assert_close(g, w, RTOL[dtype], f"{what}: {part}")
    return ours, args, got, what


def selected(sample, algo: str) -> bool:
    """Whether ``algo`` runs this sample. The emulated persistent kernels (a few tenths of a
    second a call here) skip the ``batch_first=True`` twin of each sample: the module transposes
    before the op, so the kernels see the same time-major tensors (every sample runs on the
    GEMM path, which shares that transpose)."""
    return algo != "persistent" or not sample.constructor_input.kwargs.get("batch_first")


@pytest.mark.parametrize("algo,dtype", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_samples_match_torch_nn(name, algo, dtype):
    """Every sample: outputs, states and all gradients equal torch.nn's (float64), the library
    ran, results are contiguous; eval mode equals training mode."""
    chosen = [(i, s) for i, s in enumerate(samples(name, dtype)) if selected(s, algo)]
    for index, sample in chosen:
        ours, args, got, what = matches_torch_nn(name, index, sample, dtype, algo,
                                                 assert_library_ran)
        assert all(t.is_contiguous() for t in got[0] + got[1] + got[2]), what
        ours.eval()
        with torch.no_grad():
            assert_close(tensors(ours(*leaves(args))), got[0], 0.0, f"{what}: eval mode")
    # every sample of the run (LSTM: half of them with proj_size=2)
    assert len(chosen) == {"RNN": 64, "GRU": 32, "LSTM": 32}[name] // (
        2 if algo == "persistent" else 1)


@pytest.mark.parametrize("algo,dtype", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_no_batch_dim_reference_and_noncontiguous_inputs(name, algo, dtype):
    """torch's no-batch-dim reference (our unbatched result equals our batch of one), and
    non-contiguous input and states give the contiguous results and gradients."""
    checked = 0
    for index, sample in enumerate(samples(name, dtype)):
        if not selected(sample, algo):
            continue
        ours, _ = build(name, sample, dtype, algo)
        args = sample.forward_input.args
        what = f"{name} sample {index} {sample.constructor_input.kwargs}"
        if sample.reference_fn is not None and not isinstance(args[0], PackedSequence):
            with torch.no_grad():
                got = tensors(ours(*leaves(args)))
                want = tensors(sample.reference_fn(ours, *leaves(args)))
            assert_close(got, want, 0.0, f"{what}: no-batch-dim reference")
            assert ours.last_run.algo == algo
        if isinstance(args[0], PackedSequence) and algo == "persistent":
            continue  # the packed layout is the same gather for every sample; gemm covers it
        contiguous = forward_backward(ours, leaves(args), index)
        strided = forward_backward(ours, noncontiguous(args), index)
        assert_library_ran(ours, algo, dtype)
        for part, g, w in zip(("outputs", "input grads", "parameter grads"), strided, contiguous):
            assert_close(g, w, 0.0, f"{what}: non-contiguous {part}")
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name", NAMES)
def test_error_inputs_raise_torch_nn_errors(name, algo):
    """torch's error inputs: the same exception types and messages as torch.nn, construction and
    forward (with the library forced: its checks must not pre-empt or replace torch.nn's)."""
    info = module_info(name)
    for dtype in (torch.float32, torch.float64):
        errors = info.module_error_inputs_func(info, device="cpu", dtype=dtype,
                                               requires_grad=False, training=True)
        assert errors
        for error in errors:
            sample = error.module_error_input
            c_args, c_kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
            pairs = ((getattr(torch.nn, name), {}), (getattr(prt, name), {"algo": algo}))
            for cls, extra in pairs:
                with pytest.raises(error.error_type, match=error.error_regex):
                    module = cls(*c_args, **c_kwargs, **extra)
                    if error.error_on == common_modules.ModuleErrorEnum.FORWARD_ERROR:
                        module(*sample.forward_input.args, **sample.forward_input.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_module_surface_as_torch_nn(name):
    """repr, factory kwargs, construction on the meta device, the state_dict both ways and a
    whole-module save/load (torch.load's default weights_only) that runs the same."""
    for index, sample in enumerate(samples(name, torch.float64)):
        args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        ours, ref = build(name, sample, torch.float64, "gemm")
        assert repr(ours) == repr(ref) and str(ours) == str(ref)
        made = getattr(prt, name)(*args, **kwargs, dtype=torch.float64, device="cpu")
        assert all(p.dtype == torch.float64 and p.device.type == "cpu"
                   for p in made.parameters())
        with torch.device("meta"):
            meta = getattr(prt, name)(*args, **kwargs)
        assert [(n, p.shape, p.dtype, p.is_meta) for n, p in meta.named_parameters()] == [
            (n, p.shape, torch.float32, True) for n, p in ref.named_parameters()]
        back = getattr(torch.nn, name)(*args, **kwargs).double()
        back.load_state_dict(ours.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(back.parameters(), ours.parameters()))
        buffer = io.BytesIO()
        torch.save(ours, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        assert type(loaded) is type(ours) and loaded.algo == "gemm" and loaded.last_run is None
        copied = pickle.loads(pickle.dumps(ours))
        fwd = sample.forward_input.args
        with torch.no_grad():
            want = tensors(ours(*leaves(fwd)))
            for other in (loaded, copied):
                assert_close(tensors(other(*leaves(fwd))), want, 0.0, f"{name} {index} pickled")
                assert other.last_run.algo == "gemm"
            for convert, dtype in ((ours.float, torch.float32), (ours.double, torch.float64)):
                convert()  # torch's test_forward: the conversion methods, then a forward
                ours(*leaves(fwd, dtype))
                assert all(p.dtype == dtype for p in ours.parameters())
                assert ours.last_run.dtype == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("name", NAMES)
def test_train_flag_is_read_only_where_torch_nn_reads_it(name):
    """torch's train/eval probe: with ``training`` deleted the library's forward fails on that
    attribute, as torch.nn's ModuleInfo declares (train_and_eval_differ: dropout between
    layers), and with no other error."""
    assert module_info(name).train_and_eval_differ
    sample = samples(name, torch.float64)[0]
    ours, _ = build(name, sample, torch.float64, "gemm")
    del ours.training
    with pytest.raises(AttributeError, match="'training'"):
        ours(*leaves(sample.forward_input.args))


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_and_gradgradcheck_on_gemm(name):
    """torch's test_grad/test_gradgrad in float64 on the library's GEMM path (fast mode: one
    random direction per input), input, states and all parameters at once, on the
    ``batch_first=False`` samples (every sample's gradients equal torch.nn's to 1e-9 above):
    gradcheck on each; gradgradcheck, whose graph of the gradient is torch's recompute
    (docs/torch.md), on the bidirectional ones with biases (each input kind and nonlinearity)."""
    for index, sample in enumerate(samples(name, torch.float64)):
        kwargs = sample.constructor_input.kwargs
        if kwargs["batch_first"]:
            continue
        ours, _ = build(name, sample, torch.float64, "gemm")
        fn, inputs = _as_function(ours, leaves(sample.forward_input.args))
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True), (name, index)
        assert ours.last_run.algo == "gemm"
        if kwargs["bias"] and kwargs["bidirectional"]:
            assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True), (name, index)


def _as_function(module, args) -> tuple:
    """``(fn, inputs)``: ``module`` on ``args`` as a function of the forward's tensors and the
    parameters (for gradcheck), and the current values of those."""
    flat, names = tensors(args), [n for n, _ in module.named_parameters()]

    def fn(*inputs):
        rebuilt = _rebuild(args, iter(inputs[:len(flat)]))
        weights = dict(zip(names, inputs[len(flat):]))
        return tuple(tensors(torch.func.functional_call(module, weights, rebuilt)))

    return fn, (*flat, *module.parameters())


def _rebuild(template, values):
    """``template`` (forward arguments) with its tensors replaced, in order, from ``values``."""
    if isinstance(template, PackedSequence):
        return template._replace(data=next(values))
    if isinstance(template, tuple):
        return tuple(_rebuild(t, values) for t in template)
    return next(values)


# test_nn's argument checks (its test_rnn_args_check and the projection variant), in our words:
# (what is wrong, input shape, h shape, c shape) for a 2-layer module of input 3, hidden 4, h of
# width W (4, or the projection's 2); None: the default state.
BAD_CALLS = [
    ("input size", (5, 2, 4), None, None),
    ("1-D input", (3,), None, None),
    ("4-D input", (2, 5, 2, 3), None, None),
    ("h layers", (5, 2, 3), (1, 2, "W"), (2, 2, 4)),
    ("h batch", (5, 2, 3), (2, 3, "W"), (2, 2, 4)),
    ("h width", (5, 2, 3), (2, 2, 5), (2, 2, 4)),
    ("2-D h for batched input", (5, 2, 3), (2, "W"), (2, 4)),
    ("3-D h for unbatched input", (5, 3), (2, 1, "W"), (2, 1, 4)),
    ("c shape", (5, 2, 3), (2, 2, "W"), (2, 2, 5)),
    ("c batch", (5, 2, 3), (2, 2, "W"), (2, 3, 4)),
]


def _bad_call_args(name: str, width: int, x_shape, h_shape, c_shape, gen):
    def make(shape):
        return torch.randn(*[width if d == "W" else d for d in shape], generator=gen)
    if h_shape is None:
        return (make(x_shape),)
    hx = (make(h_shape), make(c_shape)) if name == "LSTM" else make(h_shape)
    return make(x_shape), hx




@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name,proj", [("RNN", 0), ("GRU", 0), ("LSTM", 0), ("LSTM", 2)],
                         ids=["RNN", "GRU", "LSTM", "LSTMP"])
def test_bad_arguments_raise_as_torch_nn(name, proj, algo):
    """Wrong input sizes and dimensions, wrong h/c shapes: ours raises exactly torch.nn's
    exception and message with the library forced."""
    kwargs = {"proj_size": proj} if proj else {}
    ours = getattr(prt, name)(3, 4, num_layers=2, algo=algo, **kwargs)
    ref = getattr(torch.nn, name)(3, 4, num_layers=2, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for what, *shapes in BAD_CALLS:
        if name != "LSTM" and what.startswith("c "):
            continue
        args = _bad_call_args(name, proj or 4, *shapes, gen)
        want = raised(ref, args)
        assert want is not None, what
        assert raised(ours, args) == want, what


# ---- the cells: PyTorch's module_db samples of nn.RNNCell/GRUCell/LSTMCell ----------------------
# The library's step (persistent_rnn.torch.cells) with algo forced: the GEMM step in both float
# dtypes and the emulated fused step kernel in float32. A cell's backward is always the GEMM one.
CELL_NAMES = ("RNNCell", "GRUCell", "LSTMCell")


def cell_samples(name: str, dtype: torch.dtype, seed: int = 0) -> list:
    """torch's ModuleInputs for the cell ``name``, drawn from a seeded generator."""
    info = module_info(name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                       training=True)


def assert_cell_step_ran(cell, algo: str, dtype: torch.dtype) -> None:
    """The forward ran the library's ``algo`` step (the fused kernel emulated for
    "persistent") and its backward the library's GEMM backward."""
    run = cell.last_run
    assert run is not None and run.algo == algo and run.fallback is None, run
    assert run.emulated == (algo == "persistent"), run
    assert run.launches == (1 if algo == "persistent" else 0), run
    assert run.backward is not None and run.backward.algo == "gemm", run
    assert run.dtype == str(dtype).removeprefix("torch."), run


@pytest.mark.parametrize("algo,dtype", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cell_samples_match_torch_nn(name, algo, dtype):
    """Every cell sample (unbatched, with and without a state): outputs and every gradient equal
    torch.nn's float64 ones; the no-batch-dim reference; non-contiguous input and states."""
    chosen = cell_samples(name, dtype)
    for index, sample in enumerate(chosen):
        ours, args, got, what = matches_torch_nn(name, index, sample, dtype, algo,
                                                 assert_cell_step_ran)
        with torch.no_grad():
            reference = tensors(sample.reference_fn(ours, *leaves(args)))
        assert_close(reference, got[0], 0.0, f"{what}: no-batch-dim reference")
        strided = forward_backward(ours, noncontiguous(args), index)
        for part, g, w in zip(("outputs", "input grads", "parameter grads"), strided, got):
            assert_close(g, w, 0.0, f"{what}: non-contiguous {part}")
    assert len(chosen) == {"RNNCell": 3, "GRUCell": 2, "LSTMCell": 2}[name]


@pytest.mark.parametrize("algo", ["gemm", "persistent"])
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cell_error_inputs_raise_torch_nn_errors(name, algo):
    """torch's error inputs of the cells: the same exception types and messages, the library
    forced (its checks must neither pre-empt nor replace torch.nn's)."""
    info = module_info(name)
    errors = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32,
                                           requires_grad=False, training=True)
    assert errors
    for error in errors:
        sample = error.module_error_input
        c_args, c_kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        for cls, extra in ((getattr(torch.nn, name), {}), (getattr(prt, name), {"algo": algo})):
            module = cls(*c_args, **c_kwargs, **extra)
            with pytest.raises(error.error_type, match=error.error_regex):
                module(*sample.forward_input.args, **sample.forward_input.kwargs)


@pytest.mark.parametrize("name", CELL_NAMES)
def test_cell_surface_as_torch_nn(name):
    """repr, isinstance, factory kwargs, meta construction, the state_dict both ways and a
    whole-module save/load (weights_only) and pickle that run the same."""
    for index, sample in enumerate(cell_samples(name, torch.float64)):
        args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        ours, ref = build(name, sample, torch.float64, "gemm")
        assert repr(ours) == repr(ref) and isinstance(ours, getattr(torch.nn, name))
        made = getattr(prt, name)(*args, **kwargs, dtype=torch.float64, device="cpu")
        assert all(p.dtype == torch.float64 for p in made.parameters())
        with torch.device("meta"):
            meta = getattr(prt, name)(*args, **kwargs)
        assert [(n, p.shape, p.is_meta) for n, p in meta.named_parameters()] == [
            (n, p.shape, True) for n, p in ref.named_parameters()]
        back = getattr(torch.nn, name)(*args, **kwargs).double()
        back.load_state_dict(ours.state_dict())
        assert list(back.state_dict()) == list(ours.state_dict())
        buffer = io.BytesIO()
        torch.save(ours, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
        assert type(loaded) is type(ours) and loaded.algo == "gemm" and loaded.last_run is None
        fwd = sample.forward_input.args
        with torch.no_grad():
            want = tensors(ours(*leaves(fwd)))
            for other in (loaded, pickle.loads(pickle.dumps(ours)), back):
                assert_close(tensors(other(*leaves(fwd))), want, 1e-12, f"{name} {index}")


@pytest.mark.parametrize("name", CELL_NAMES)
def test_cell_gradcheck_and_gradgradcheck_on_gemm(name):
    """torch's test_grad/test_gradgrad for the cells in float64 on the library's GEMM step."""
    for index, sample in enumerate(cell_samples(name, torch.float64)):
        ours, _ = build(name, sample, torch.float64, "gemm")
        fn, inputs = _as_function(ours, leaves(sample.forward_input.args))
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True), (name, index)
        assert ours.last_run.algo == "gemm"
        assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True), (name, index)
