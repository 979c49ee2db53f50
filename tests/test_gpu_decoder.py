"""The resident decoder on a real GPU (marked ``gpu``; written without a GPU - not yet run): its
steps bitwise equal to the layer's persistent kernel called with T=1 (a grid tile at H=640),
across an idle exit;
two launches a step and no host synchronisation; a greedy loop captured in a CUDA graph and
replayed gives the eager loop's bits; close leaves nothing running."""
from __future__ import annotations

import time

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import launch
from persistent_rnn.matmul import matmul

pytestmark = pytest.mark.gpu
IN, H, B, T = 64, 640, 1, 6
PER_LAYER = dict(stack=False)


def _layer(cp, mode="LSTM"):
    layer = getattr(prnn, mode)(IN, H, algo="persistent", seed=0)
    layer.forward(_inputs(cp)[:1])  # a layer's parameters follow its first input to the GPU
    return layer


def _inputs(cp):
    return cp.asarray(np.random.default_rng(1).standard_normal((T, B, IN)).astype(np.float32))


def _cell_loop(layer, xs):
    out, state = [], None
    with prnn.override_settings(**PER_LAYER):
        for x in xs:
            y, state = layer.forward(x[None], state)
            out.append(y[0].get())
    return out


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_gpu_decoder_equals_the_grid_kernel_across_an_idle_exit(cupy, mode, settings):
    cp = cupy
    layer, xs = _layer(cp, mode), _inputs(cp)
    want = _cell_loop(layer, xs)
    prnn.configure(gpu_timeout_ms=5)
    with layer.decoder(batch=B) as dec:
        assert dec.resident, dec.reason
        state = None
        for t, x in enumerate(xs):
            y, state = dec.step(x, state)
            assert np.array_equal(y.get(), want[t]), t
            if t == 2:
                time.sleep(0.05)  # idle past the deadline: the kernel exits, the next step relaunches
        assert dec.relaunches >= 1
        dec.check()


def test_gpu_decoder_step_is_two_launches_without_a_host_sync(cupy):
    cp = cupy
    layer, xs = _layer(cp), _inputs(cp)
    with layer.decoder(batch=B) as dec:
        y, state = dec.step(xs[0])
        before = dec.relaunches
        with launch.counting() as n:
            for x in xs[1:]:
                y, state = dec.step(x, state)
        relaunched = dec.relaunches - before
    # the counters see the step kernel (and relaunches); the projection's GEMM is cuBLAS's
    assert n.launches == len(xs) - 1 + relaunched and n.host_syncs == 0


def test_gpu_decoder_loop_captured_in_a_cuda_graph(cupy):
    """A 4-step loop (the step's output fed back) captured once and replayed: every replay the
    same bits, the eager loop's within the products' round-off. The resident kernel runs outside the graph (launched by the decoder before the
    capture); a replay whose kernel has gone takes its slices over."""
    cp = cupy
    layer = _layer(cp)
    w = cp.asarray(np.random.default_rng(2).standard_normal((H, IN)).astype(np.float32) * 0.05)
    x0 = _inputs(cp)[0]

    def loop(dec):
        x, state = x0, None
        for _ in range(4):
            y, state = dec.step(x, state)
            x = matmul(y, w)  # (the library's GEMM under capture)
        return y

    with layer.decoder(batch=B) as dec:
        want = loop(dec).get()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            out = loop(dec)
            graph = stream.end_capture()
            graph.launch(stream)
        stream.synchronize()
        first = out.get()
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(out.get(), first)  # replays: the same bits
    # captured, the products are matmul.cu's, not cuBLAS's: equal within their round-off
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-7)


def test_gpu_torch_decoder_loop_captured_by_torch_replays_after_other_allocations(cupy):
    """The torch cell's decoder in ``torch.cuda.graph``: the library's arrays come from the
    graph's pool (``interop.library_stream``), so a replay after other CuPy and torch
    allocations gives the first replay's bits."""
    import torch
    import persistent_rnn.torch as prt
    torch.manual_seed(0)
    cell = prt.LSTMCell(H, H, algo="persistent").cuda()
    x0 = torch.randn(B, H).cuda()

    def loop(dec):
        x, state = x0, None
        for _ in range(4):
            state = dec.step(x, state)
            x = state[0]
        return x

    with torch.no_grad(), cell.decoder(batch=B) as dec:
        assert dec.resident, dec.reason
        want = loop(dec).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loop(dec)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = loop(dec)
        graph.replay()
        torch.cuda.synchronize()
        first = out.clone()
        # captured, the products are matmul.cu's, not cuBLAS's: equal within their round-off
        torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-7)
        clutter = [cupy.full((B, 4 * H), -7.0, np.float32) for _ in range(8)]
        clutter += [torch.full((B, 4 * H), -7.0, device="cuda") for _ in range(8)]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)  # nothing the graph uses was handed out again
        del clutter
