"""persistent_rnn.torch against torch.nn for the rest of torch.nn's constructor and of torch:
dropout, proj_size, 16-bit and autocast, functional_call and parametrizations, torch.func,
double backward, run records, checkpoints and the export paths that are refused."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn.torch as prt
from test_torch import B, H, I, MODES, IDS, T, TOL, assert_all_close, inputs, pair, run

D = torch.float64


def _train_outputs(module, x, lengths, seed):
    """Output and parameter gradients of one training forward under ``torch.manual_seed(seed)``."""
    module.zero_grad()
    torch.manual_seed(seed)
    inp = x if lengths is None else pack_padded_sequence(x, lengths, enforce_sorted=False)
    out, _ = module(inp)
    y = out if lengths is None else pad_packed_sequence(out)[0]
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("mode,kwargs", MODES, ids=IDS)
@pytest.mark.parametrize("packed", [False, True])
def test_dropout_draws_the_same_masks_as_torch_nn(mode, kwargs, packed):
    """Training with dropout on the library path: torch's RNG, drawn over the same elements in
    the same order as torch.nn's CPU kernels, so one seed gives identical outputs and grads."""
    ours, ref = pair(mode, kwargs, num_layers=3, bidirectional=True, dropout=0.4)
    x = torch.randn(T, B, I, dtype=D, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([3, T, 2]) if packed else None
    got = _train_outputs(ours, x, lengths, seed=11)
    assert_all_close(got, _train_outputs(ref, x, lengths, seed=11))
    assert not torch.equal(got[0], _train_outputs(ours, x, lengths, seed=12)[0])
    assert ours.last_run.algo == "gemm" and ours.last_run.backward.algo == "gemm"


def test_dropout_is_off_in_eval_and_follows_attribute_changes():
    ours, ref = pair("LSTM", {}, num_layers=2, dropout=0.5)
    x = torch.randn(T, B, I, dtype=D)
    ours.eval(), ref.eval()
    assert_all_close([ours(x)[0]], [ref(x)[0]])
    ours.train(), ref.train()
    for module in (ours, ref):
        module.dropout = 0.0  # torch.nn reads the attribute at every call
    assert_all_close([ours(x)[0]], [ref(x)[0]])
    for module in (ours, ref):
        module.dropout = 0.9
    torch.manual_seed(5)
    y = ours(x)[0]
    torch.manual_seed(5)
    assert_all_close([y], [ref(x)[0]])
    ours.dropout = 0.0
    assert not torch.allclose(y, ours(x)[0])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("algo", ["auto", "gemm"])
def test_proj_size_matches_torch_nn(packed, algo):
    """LSTMP: torch's kernels with ``algo="auto"`` on CPU (bit for bit), the library's GEMM path
    with ``algo="gemm"`` (float64 round-off)."""
    ours, ref = pair("LSTM", {}, algo=algo, num_layers=2, bidirectional=True, proj_size=2)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, B, I, dtype=D, generator=gen)
    hx = (torch.randn(4, B, 2, dtype=D, generator=gen),
          torch.randn(4, B, H, dtype=D, generator=gen))
    lengths = torch.tensor([T, 2, 4]) if packed else None
    got_out, got_grad = run(ours, x, hx, lengths, 8)
    ref_out, ref_grad = run(ref, x, hx, lengths, 8)
    assert got_out[0].shape[-1] == 4 and got_out[1].shape[-1] == 2
    if algo == "auto":
        assert_all_close(got_out + got_grad, ref_out + ref_grad, rtol=0, atol=0)
        assert ours.last_run.algo == "torch" and "CPU" in ours.last_run.fallback
    else:
        assert_all_close(got_out + got_grad, ref_out + ref_grad, rtol=0, atol=1e-9)
        assert ours.last_run.algo == "gemm" and ours.last_run.backward.algo == "gemm"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_modules_run_torch_kernels(dtype):
    ours, ref = pair("GRU", {}, algo="auto", num_layers=2)
    ours.to(dtype), ref.to(dtype)
    x = torch.randn(T, B, I, dtype=dtype)
    (y, hn), (y_ref, hn_ref) = ours(x), ref(x)
    assert y.dtype == dtype
    assert_all_close([y, hn], [y_ref, hn_ref], rtol=0, atol=0)
    assert ours.last_run.algo == "torch" and "CPU" in ours.last_run.fallback


def test_cpu_autocast_matches_torch_nn():
    """Under autocast torch.nn's LSTM runs in bfloat16; so does ours (torch's kernels with
    ``algo="auto"`` on CPU), also when the input is the bfloat16 output of an earlier autocast
    layer; ``algo="gemm"`` runs the library's 16-bit layer (tests/test_torch_half.py)."""
    ours, ref = pair("LSTM", {}, algo="auto", dtype=torch.float32, num_layers=2)
    linear = torch.nn.Linear(I, I)
    x = torch.randn(T, B, I)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inp in (x, linear(x)):
            assert inp.dtype in (torch.float32, torch.bfloat16)
            (y, (hn, cn)), (y_ref, (hn_ref, cn_ref)) = ours(inp), ref(inp)
            assert y.dtype == torch.bfloat16
            assert_all_close([y, hn, cn], [y_ref, hn_ref, cn_ref], rtol=0, atol=0)
        assert "CPU" in ours.last_run.fallback
        ours.algo = "gemm"
        h = linear(x)
        y, _ = ours(h)
        y_ref, _ = ref(h)
    assert y.dtype == torch.bfloat16 and ours.last_run.algo == "gemm"
    assert ours.last_run.dtype == "bfloat16"
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=0, atol=3e-2)


@pytest.mark.parametrize("algo", ["auto", "gemm"])
def test_functional_call_and_parametrizations_use_the_weights_given(algo):
    ours, ref = pair("LSTM", {}, algo=algo, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, I, dtype=D)
    zeros = {n: torch.zeros_like(p) for n, p in ours.named_parameters()}
    y, _ = torch.func.functional_call(ours, zeros, (x,))
    assert y.abs().max() == 0
    assert ours(x)[0].abs().max() > 0  # and the module's own weights are back
    for module in (ours, ref):
        parametrize.register_parametrization(module, "weight_hh_l1", _Symmetric())
    _, hx = inputs("LSTM", 2, True, torch.Generator().manual_seed(1))
    got, _ = run(ours, x, hx, None, 2)
    want, _ = run(ref, x, hx, None, 2)
    assert_all_close(got, want)


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return (w + w.flip(0)) / 2


def test_torch_func_grad_matches_torch_nn():
    """(torch's packed RNN kernels, which torch.func.grad differentiates through, do not run
    under torch.func transforms: torch.nn fails there too, so the input is padded.)"""
    ours, ref = pair("GRU", {}, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, I, dtype=D)

    def loss(params, module):
        y, hn = torch.func.functional_call(module, params, (x,))
        return y.pow(2).sum() + hn.sin().sum()

    params = {n: p.detach() for n, p in ours.named_parameters()}
    got = torch.func.grad(loss)(params, ours)
    want = torch.func.grad(loss)(params, ref)
    assert_all_close(list(got.values()), list(want.values()))


def test_vmap_over_the_forward():
    ours, ref = pair("RNN", {"nonlinearity": "tanh"}, num_layers=2)
    xs = torch.randn(3, T, B, I, dtype=D)
    got = torch.func.vmap(lambda x: ours(x)[0])(xs)
    assert_all_close([got], [torch.stack([ref(x)[0] for x in xs])])


@pytest.mark.parametrize("mode,kwargs", MODES, ids=IDS)
def test_double_backward_matches_torch_nn(mode, kwargs):
    """A gradient penalty (create_graph=True): the gradient of the gradient is torch.nn's."""
    ours, ref = pair(mode, kwargs, num_layers=2, bidirectional=True)
    x0, hx = inputs(mode, 2, True, torch.Generator().manual_seed(9))
    lengths = torch.tensor([T, 2, 4])
    grads = []
    for module in (ours, ref):
        x = x0.clone().requires_grad_()
        out, _ = module(pack_padded_sequence(x, lengths, enforce_sorted=False), hx)
        y = pad_packed_sequence(out)[0]
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        grads.append([x.grad] + [p.grad for p in module.parameters()])
    assert_all_close(*grads)


def test_gradgradcheck():
    module = prt.LSTM(2, 2, num_layers=2, dtype=D, algo="gemm")
    x = torch.randn(3, 2, 2, dtype=D, requires_grad=True)
    weights = {n: w.detach().clone().requires_grad_() for n, w in module.named_parameters()}

    def fn(x, *w):
        return torch.func.functional_call(module, dict(zip(weights, w)), (x,))[0]

    assert torch.autograd.gradgradcheck(fn, (x, *weights.values()), eps=1e-6, atol=1e-6)


def test_last_run_records_forward_and_backward_of_the_last_call():
    module = prt.GRU(I, H, num_layers=2, dropout=0.3, algo="gemm")
    x = torch.randn(T, B, I, requires_grad=True)
    assert module.last_run is None
    y, _ = module(x)  # training with dropout: one op call per layer, merged into one record
    assert (module.last_run.algo, module.last_run.backward) == ("gemm", None)
    y.sum().backward()
    assert module.last_run.backward.algo == "gemm"
    module.algo = "auto"
    module(x)
    assert module.last_run.algo == "torch" and module.last_run.backward is None


def test_whole_model_checkpoint_loads_with_weights_only():
    model = torch.nn.Sequential(prt.LSTM(I, H, num_layers=2, dropout=0.1, algo="gemm"))
    x = torch.randn(T, B, I)
    model(x)  # a run record exists and must not be pickled
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([torch.nn.Sequential]):  # the user's model class
        loaded = torch.load(buf, weights_only=True)
    lstm = loaded[0]
    assert type(lstm) is prt.LSTM and lstm.algo == "gemm" and lstm.last_run is None
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x)[0], model(x)[0], rtol=0, atol=0)
    assert lstm.last_run.algo == "gemm" and model[0].last_run is not lstm.last_run
    clone = copy.deepcopy(lstm)
    clone(x)
    assert clone.last_run is not lstm.last_run


def test_torchscript_and_onnx_are_refused_clearly():
    module = prt.GRU(I, H)
    x = torch.randn(T, B, I)
    with pytest.raises(RuntimeError, match="cannot be compiled with TorchScript"):
        torch.jit.script(torch.nn.Sequential(module))
    with pytest.raises(RuntimeError, match="does not support TorchScript"):
        torch.jit.trace(module, (x,))
    with pytest.raises(RuntimeError, match="does not support TorchScript"):
        torch.onnx.export(module, (x,), io.BytesIO(), dynamo=False)


def test_export_keeps_the_custom_op():
    module = prt.LSTM(I, H, num_layers=2, bidirectional=True, algo="gemm")
    x = torch.randn(T, B, I)
    program = torch.export.export(module, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "persistent_rnn.recurrence.default" in targets
    assert_all_close(list(program.module()(x)[1]), list(module(x)[1]), rtol=0, atol=0)


class _Tagger(torch.nn.Module):
    """A small model around a recurrent layer: per-step scores."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn, self.head = rnn, torch.nn.Linear(2 * H, 1, dtype=D)

    def forward(self, x, lengths=None):
        if lengths is None:
            return self.head(self.rnn(x)[0])
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return self.head(pad_packed_sequence(out, total_length=x.shape[0])[0])


def _step_grads(model, *args):
    model.zero_grad()
    loss = model(*args).pow(2).sum()
    loss.backward()
    return [loss] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph,packed", [(True, False), (False, True)],
                         ids=["fullgraph", "packed"])
def test_torch_compile_matches_eager(fullgraph, packed):
    """torch.compile of a model around our LSTM (auto: on CPU tensors under compile, the
    library's GEMM op, opaque to the compiler), forward and backward, against eager torch.nn."""
    torch.manual_seed(0)
    ours = prt.LSTM(I, H, num_layers=2, bidirectional=True, dtype=D)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, dtype=D)
    ref.load_state_dict(ours.state_dict())
    model, ref_model = _Tagger(ours), _Tagger(ref)
    ref_model.head.load_state_dict(model.head.state_dict())
    compiled = torch.compile(model, fullgraph=fullgraph)
    for seed in (1, 2):  # the second call reuses the compiled graph
        x = torch.randn(T, B, I, dtype=D, generator=torch.Generator().manual_seed(seed))
        args = (x, torch.tensor([T, 2, 4])) if packed else (x,)
        assert_all_close(_step_grads(compiled, *args), _step_grads(ref_model, *args))
    assert ours.last_run.algo == "gemm" and ours.last_run.backward.algo == "gemm"


# ---- CUDA (persistent kernel, torch's kernels where it does not run); unverified on CPU ----

def _cuda_parity(mode, kwargs, dtype, tol, batch=B, expect=None):
    torch.manual_seed(0)
    ours, ref = pair(mode, kwargs, algo="auto", dtype=dtype, num_layers=2, bidirectional=True)
    ours.cuda(), ref.cuda()
    x = torch.randn(T, batch, I, dtype=dtype, device="cuda", requires_grad=True)
    lengths = torch.randint(1, T + 1, (batch,))
    lengths[0] = T
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x was made on the default stream
    results = []
    for module in (ours, ref):
        with torch.cuda.stream(side):  # the library must follow torch's current stream
            out, _ = module(pack_padded_sequence(x, lengths, enforce_sorted=False))
            y = pad_packed_sequence(out)[0]
            (gx,) = torch.autograd.grad((y * y).sum(), x)
        side.synchronize()
        results.append((y, gx))
    assert_all_close(*results, **tol)
    if expect is not None:
        assert ours.last_run.algo == expect, ours.last_run


@pytest.fixture
def true_fp32():
    """cuDNN and cuBLAS default to TF32: the float32 reference must be true float32."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield
    torch.backends.cuda.matmul.allow_tf32 = matmul


@pytest.mark.gpu
@pytest.mark.parametrize("mode,kwargs", [MODES[0], MODES[2], MODES[3]], ids=["RNN", "GRU", "LSTM"])
def test_cuda_persistent_path_matches_torch_nn(mode, kwargs, true_fp32):
    _cuda_parity(mode, kwargs, torch.float32, {"rtol": 1e-4, "atol": 1e-5}, expect="persistent")


@pytest.mark.gpu
def test_cuda_falls_back_to_cudnn_where_the_kernel_does_not_run(true_fp32):
    _cuda_parity("LSTM", {}, torch.float64, TOL, expect="torch")          # dtype
    _cuda_parity("GRU", {}, torch.float32, {"rtol": 1e-6, "atol": 1e-7}, batch=64,
                 expect="torch")                                                 # batch


class _CudaLike:
    """What the path decisions read of a float32 CUDA tensor on device 0 (a CPU build has none)."""

    is_cuda, is_cpu = True, False
    device = torch.device("cuda", 0)
    dtype = torch.float32

    def get_device(self) -> int:
        return 0


def test_capture_runs_forced_library_algos_and_auto_torchs(monkeypatch):
    """Under a caller's CUDA-graph capture a forced "persistent" or "gemm" runs the library
    (nothing of its call reads back), "auto" torch's kernels, saying why - layers and cells."""
    from persistent_rnn.cells import CELLS
    from persistent_rnn.torch import paths
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = _CudaLike()
    path, why = paths._path("auto", CELLS["lstm"], x, H, 0, lambda: B, torch.float32)
    assert path == paths.TORCH and "CUDA graph capture: algo='auto'" in why
    for algo in ("persistent", "gemm"):
        assert paths._path(algo, CELLS["lstm"], x, H, 0, lambda: B, torch.float32) == (algo, None)
    path, why = prt.LSTMCell(I, H)._choose(x)
    assert path == paths.TORCH and "CUDA graph capture: algo='auto'" in why
    assert prt.LSTMCell(I, H, algo="persistent")._choose(x) == ("persistent", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert paths.captured_auto(x) is None


def test_forced_algos_load_the_captured_product_once_before_any_capture(monkeypatch):
    """A forced algorithm's first CUDA call on a device loads the kernel its products run under
    capture (float64's, or float32's for every other dtype), once; never during a capture."""
    import contextlib

    import numpy as np

    from persistent_rnn import matmul
    from persistent_rnn.torch import interop, paths
    loaded = []
    monkeypatch.setattr(matmul, "load_captured_kernel", loaded.append)
    monkeypatch.setattr(interop, "library_stream", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(paths, "_PREPARED", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = _CudaLike()
    paths.prepare_capture(x, torch.float32)
    assert loaded == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for dtype in (torch.float32, torch.float32, torch.float16, torch.float64, torch.float64):
        paths.prepare_capture(x, dtype)
    assert loaded == [np.float32, np.float64]


def test_a_remembered_cuda_decision_asks_about_capture_once_by_torchs_binding(monkeypatch):
    """A module's steady-state path decision on a CUDA tensor (``paths.choose``, remembered)
    asks whether the stream is capturing once, through torch's C binding (no torch.cuda Python
    frame), and the answer is part of what it remembers: a forced algorithm's decision made
    under capture is made again outside it (which loads the captured product there)."""
    import contextlib

    from persistent_rnn import matmul
    from persistent_rnn.cells import CELLS
    from persistent_rnn.torch import interop, paths
    capturing, binding_reads, python_reads, loaded = [True], [], [], []

    def binding() -> bool:
        binding_reads.append(1)
        return capturing[0]

    def python() -> bool:
        python_reads.append(1)
        return capturing[0]
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", binding)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", python)
    monkeypatch.setattr(matmul, "load_captured_kernel", loaded.append)
    monkeypatch.setattr(interop, "library_stream", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(paths, "_PREPARED", set())
    monkeypatch.setattr(paths, "_DECISIONS", {})
    x = _CudaLike()
    for _ in range(2):
        assert paths.choose("persistent", CELLS["gru"], x, H, 0, lambda: B).path == "persistent"
    assert loaded == []  # (made under capture: nothing loaded)
    binding_reads.clear(), python_reads.clear()
    paths.choose("persistent", CELLS["gru"], x, H, 0, lambda: B)
    assert (len(binding_reads), len(python_reads)) == (1, 0)
    capturing[0] = False
    paths.choose("persistent", CELLS["gru"], x, H, 0, lambda: B)
    assert len(loaded) == 1


@pytest.mark.gpu
def test_cuda_graph_capture_of_forced_persistent_modules_replays_training_steps(true_fp32):
    """A forced "persistent" LSTM's training step (forward, backward) captured by torch after
    warm-up calls runs the library's kernels, and replays on new inputs copied into the static
    ones give the eager step's output and gradients within fp32 round-off (the captured input
    projections run the library's own GEMM kernel), torch.nn's too."""
    module = prt.LSTM(I, H, num_layers=2, algo="persistent").cuda()
    reference = torch.nn.LSTM(I, H, num_layers=2).cuda()
    reference.load_state_dict(module.state_dict())
    static_x = torch.randn(T, B, I, device="cuda", requires_grad=True)

    def step() -> torch.Tensor:
        module.zero_grad(set_to_none=False)
        y, _ = module(static_x)
        (y * y).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside capture, as torch requires
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    assert module.last_run.algo == "persistent"
    for seed in (1, 2):
        torch.manual_seed(seed)
        fresh = torch.randn(T, B, I, device="cuda")
        with torch.no_grad():
            static_x.copy_(fresh)
        static_x.grad = None if static_x.grad is None else static_x.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_y.clone()] + [p.grad.clone() for p in module.parameters()]
        x = fresh.clone().requires_grad_()
        y, _ = reference(x)
        reference.zero_grad()
        (y * y).sum().backward()
        for got, want in zip(replayed, [y] + [p.grad for p in reference.parameters()]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graph_capture_of_a_forced_persistent_cell_loop_runs_the_fused_step(true_fp32):
    """Eight steps of a forced "persistent" LSTMCell, each fed the last h, captured by torch:
    replays give torch.nn's cell loop within fp32 round-off."""
    cell = prt.LSTMCell(H, H, algo="persistent").cuda()
    reference = torch.nn.LSTMCell(H, H).cuda()
    reference.load_state_dict(cell.state_dict())
    static_h = torch.randn(B, H, device="cuda")

    def loop(h: torch.Tensor, c: torch.Tensor, run) -> torch.Tensor:
        for _ in range(8):
            h, c = run(h, (h, c))
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop(static_h, torch.zeros_like(static_h), cell)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = loop(static_h, torch.zeros_like(static_h), cell)
    assert cell.last_run.algo == "persistent"
    fresh = torch.randn(B, H, device="cuda")
    static_h.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, loop(fresh, torch.zeros_like(fresh), reference),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graph_capture_runs_torch_kernels(true_fp32):
    module = prt.LSTM(I, H, num_layers=2).cuda()
    x = torch.randn(T, B, I, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module(x)  # warm-up outside capture, as torch requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, _ = module(x)
    graph.replay()
    torch.cuda.synchronize()
    assert module.last_run.algo == "torch" and "capture" in module.last_run.fallback
    torch.testing.assert_close(y, module(x)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_dropout_on_the_persistent_path_drops_at_the_rate_asked():
    """cuDNN draws dropout masks from its own generator: on the GPU the masks differ from
    torch.nn's, so check the rate (between layers, training only) instead."""
    torch.manual_seed(0)
    module = prt.RNN(64, 64, num_layers=2, dropout=0.5, nonlinearity="relu").cuda()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.eye(*p.shape) if name.startswith("weight_ih") else torch.zeros_like(p))
    x = torch.rand(1, 4, 64, device="cuda") + 1  # relu(identity) passes x, dropout zeroes half
    y, _ = module(x)
    assert module.last_run.algo == "persistent"
    assert abs((y == 0).float().mean().item() - 0.5) < 0.1
    module.eval()
    torch.testing.assert_close(module(x)[0], x)


@pytest.mark.parametrize("mode,out,dtype", [
    ("RNN_TANH", H, D), ("RNN_RELU", H, D), ("GRU", H, D), ("LSTM", H, D), ("LSTM", 2, D),
    ("GRU", H, torch.bfloat16)], ids=["RNN_TANH", "RNN_RELU", "GRU", "LSTM", "LSTMP", "GRU-bf16"])
def test_custom_ops_pass_torch_library_opcheck(mode, out, dtype):
    """torch's own checks of a custom op: schema (no hidden mutation), fake implementation
    (shapes and strides of every output, the saved activations included), autograd
    registration, and tracing through AOT dispatch with dynamic shapes."""
    from persistent_rnn.torch import ops

    gen = torch.Generator().manual_seed(10)
    layers, states = 2, 4
    x = torch.randn(T, 2, I, generator=gen).to(dtype).requires_grad_()
    h0 = torch.randn(states, 2, out, generator=gen).to(dtype).requires_grad_()
    c0 = (torch.randn(states, 2, H, generator=gen).to(dtype).requires_grad_() if mode == "LSTM"
          else None)
    cell = ops._cell(mode)
    weights = [torch.randn(shape, generator=gen).to(dtype).requires_grad_()
               for shape in ops._weight_shapes(mode, I, H, out, layers, True, True)]
    static = (mode, layers, True, "gemm", -1, 0, 1)
    args = (x, torch.tensor([T, 3]), h0, c0, weights)
    torch.library.opcheck(ops.recurrence, (*args, *static))
    y, hn, cn, saved = ops.recurrence(*args, *static)
    assert cn.numel() == (states * 2 * H if cell.has_cell_state else 0)
    grads = [torch.randn_like(t) for t in (y, hn, cn)]
    detached = [t if t is None else t.detach() for t in (x, args[1], h0, c0)]
    torch.library.opcheck(ops.recurrence_backward, (
        grads[0], grads[1], grads[2] if cell.has_cell_state else None, *detached,
        [w.detach() for w in weights], saved, *static))


@pytest.mark.slow
def test_gpu_path_choice_guards_instead_of_tracing_the_planner(monkeypatch):
    """Under fullgraph compile the persistent kernel's batch limit (pure Python planning) is one
    constant and a dynamic batch is compared with it. Checked on the CPU with an H100 profile."""
    from persistent_rnn import plan
    from persistent_rnn.torch import ops, paths

    monkeypatch.setattr(paths, "_device_profile", lambda index: plan.PROFILES["h100"])
    paths._largest_fitting_batch.cache_clear()
    cell = ops._cell("LSTM")
    assert paths.persistent_batch_limit(ops._cell("GRU"), 256, 0) == 32  # auto_max_batch
    fits = [b for b in range(1, 33) if plan.make_plan("lstm", 256, b, device="h100").fits]
    assert paths.persistent_batch_limit(cell, 256, 0) == max(fits) < 32  # the plan's limit on an H100
    assert paths.persistent_batch_limit(cell, 99999, 0) == 0
    assert "does not fit" in paths.persistent_blocker(cell, 256, 30, 0)
    assert "auto_max_batch" in paths.persistent_blocker(cell, 256, 33, 0)

    def marked(): pass  # what torch's own decorator does to a function, done without it
    torch.compiler.assume_constant_result(marked)
    assert vars(marked) and vars(marked).items() <= vars(paths.persistent_batch_limit).items()

    def shift(x):
        return x + (1 if x.shape[1] <= paths.persistent_batch_limit(cell, 256, 0) else 2)

    compiled = torch.compile(shift, fullgraph=True)
    for batch, want in [(4, 1), (64, 2), (8, 1), (40, 2)]:  # the batch dimension turns dynamic
        assert compiled(torch.zeros(3, batch)).eq(want).all()
    paths._largest_fitting_batch.cache_clear()


def test_auto_leaves_layers_in_batch_groups_to_torch(monkeypatch):
    """A 16-bit layer that fits only in batch groups (fp16 LSTM H=1024 at B = 16 on an H100) is
    not ``algo="auto"``'s: its batch limit stops below the groups, and the reason says why."""
    from persistent_rnn import plan
    from persistent_rnn.torch import ops, paths

    monkeypatch.setattr(paths, "_device_profile", lambda index: plan.PROFILES["h100"])
    paths._largest_fitting_batch.cache_clear()
    cell = ops._cell("LSTM")
    try:
        assert plan.make_plan("lstm", 1024, 16, "float16", device="h100").in_batch_groups
        assert not plan.make_plan("lstm", 1024, 8, "float16", device="h100").in_batch_groups
        whole = [b for b in range(1, 33)
                 if not plan.make_plan("lstm", 1024, b, "float16", device="h100").in_batch_groups]
        assert paths.persistent_batch_limit(cell, 1024, 0, "float16") == max(whole) < 16
        assert "batch groups" in paths.persistent_blocker(cell, 1024, 16, 0, "float16")
    finally:
        paths._largest_fitting_batch.cache_clear()
