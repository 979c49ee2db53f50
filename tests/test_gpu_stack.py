"""Stack mode on a GPU (skipped without one): stacks of 2-4 layers in one launch per pass (the
two directions of a bidirectional layer side by side) against the float64 GEMM path and torch.nn
(cuDNN) in the same run, and a stall in an upper layer replayed bitwise. Not yet run on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn

pytestmark = pytest.mark.gpu
HIDDEN, BATCH, STEPS, INPUT = 256, 4, 32, 48
CASES = [("LSTM", 2, False), ("GRU", 3, False), ("RNN", 4, False), ("LSTM", 4, False),
         ("GRU", 2, True)]


def _run(cp, layer, x, dy):
    layer.zero_grad()
    y, hn = layer.forward(x)
    forward = layer.last_run
    dx, dhx = layer.backward(dy)
    flat = [y, *(hn if isinstance(hn, tuple) else (hn,)), dx,
            *(dhx if isinstance(dhx, tuple) else (dhx,)), *layer.grads.values()]
    return [cp.asarray(a, cp.float64) for a in flat], forward, layer.last_run


def _rel(cp, a, b):
    return float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-30))


@pytest.mark.parametrize("mode, layers, bidirectional", CASES)
def test_stack_mode_matches_float64_and_cudnn(cupy, mode, layers, bidirectional):
    make = getattr(prnn, mode)
    layer = make(INPUT, HIDDEN, num_layers=layers, bidirectional=bidirectional,
                 algo="persistent", seed=3)
    reference = make(INPUT, HIDDEN, num_layers=layers, bidirectional=bidirectional, algo="gemm",
                     dtype="float64", seed=3)
    rng = np.random.default_rng(4)
    x = cupy.asarray(rng.standard_normal((STEPS, BATCH, INPUT)), cupy.float32)
    dy = cupy.asarray(rng.standard_normal((STEPS, BATCH, HIDDEN * (1 + bidirectional))),
                      cupy.float32)
    got, fwd, bwd = _run(cupy, layer, x, dy)
    for stats, kernel in ((fwd, "prnn_stack_forward"), (bwd, "prnn_stack_backward")):
        assert stats.algo == "persistent" and not stats.emulated and stats.fallback is None
        assert stats.launches == (layers if bidirectional else 1) and kernel in stats.details[-1]
    ref, _, _ = _run(cupy, reference, x.astype(cupy.float64), dy.astype(cupy.float64))
    for a, b in zip(got, ref):
        assert _rel(cupy, a, b) <= 1e-5
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA: no cuDNN to compare with")
    torch.backends.cudnn.allow_tf32 = False
    net = getattr(torch.nn, mode)(INPUT, HIDDEN, num_layers=layers,
                                  bidirectional=bidirectional).cuda()
    net.load_state_dict({k: torch.as_tensor(cupy.asnumpy(v)) for k, v in layer.params.items()})
    y_torch, _ = net(torch.as_tensor(x, device="cuda"))
    assert _rel(cupy, cupy.asarray(y_torch.detach(), cupy.float64), ref[0]) <= 1e-4


def test_stall_in_an_upper_layer_replays_bitwise(cupy, settings):
    prnn.configure(gpu_timeout_ms=20)
    layer = prnn.LSTM(INPUT, HIDDEN, num_layers=3, algo="persistent", seed=5)
    rng = np.random.default_rng(6)
    x = cupy.asarray(rng.standard_normal((STEPS, BATCH, INPUT)), cupy.float32)
    dy = cupy.asarray(rng.standard_normal((STEPS, BATCH, HIDDEN)), cupy.float32)
    plain, _, _ = _run(cupy, layer, x, dy)
    per_layer = prnn.plan.make_stack_plan("LSTM", HIDDEN, BATCH, 3).forward.grid // 3
    with prnn.inject_stall(block=per_layer + 1, step=STEPS // 2, duration_ms=200):
        stalled, fwd, bwd = _run(cupy, layer, x, dy)
    assert fwd.restarts >= 1 and bwd.restarts >= 1 and fwd.fallback is bwd.fallback is None
    for a, b in zip(plain, stalled):
        assert bool(cupy.array_equal(a, b))


def test_widened_16bit_elman_stack_matches_float64(cupy):
    """A 2-layer fp16 Elman stack at H 256, B 3 (``plan.WIDENED_STACKS``): both passes on the
    fp32 stack's kernels, the forward from the 16-bit words (``PRNN_WIDENED_FROM``), against
    the float64 GEMM path within docs/api.md's 16-bit bound, forward and backward."""
    layer = prnn.RNN(INPUT, HIDDEN, num_layers=2, dtype="float16", algo="persistent", seed=3)
    reference = prnn.RNN(INPUT, HIDDEN, num_layers=2, algo="gemm", dtype="float64")
    reference.load_params({k: cupy.asnumpy(v).astype(np.float64) for k, v in layer.params.items()})
    rng = np.random.default_rng(5)
    x = cupy.asarray(rng.standard_normal((STEPS, 3, INPUT)), cupy.float16)
    dy = cupy.asarray(rng.standard_normal((STEPS, 3, HIDDEN)), cupy.float16)
    got, fwd, bwd = _run(cupy, layer, x, dy)
    assert "'PRNN_WIDENED_FROM': 1" in fwd.details[-1] and "PRNN_MMA" not in fwd.details[-1]
    for stats, kernel in ((fwd, "prnn_stack_forward"), (bwd, "prnn_stack_backward")):
        assert stats.algo == "persistent" and not stats.emulated and stats.fallback is None
        assert stats.launches == 1 and kernel in stats.details[-1]
    ref, _, _ = _run(cupy, reference, x.astype(cupy.float64), dy.astype(cupy.float64))
    for a, b in zip(got, ref):
        assert _rel(cupy, a, b) <= 5e-3
