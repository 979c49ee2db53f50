"""The resident decoder on a real GPU (marked ``gpu``): ``step(x)`` (the resident CTAs project x
themselves) within float32 round-off of the float64 reference and of the layer's persistent
kernel called with T=1 (a grid tile at H=640), and bitwise the same across an idle exit as
undisturbed; ``step_projected`` bitwise the T=1 kernel on its own projection; one launch a step
and no host synchronisation; a greedy loop captured in a CUDA graph and replayed gives the
eager loop's bits (the decoder's steps are the same kernels either way); close leaves nothing
running."""
from __future__ import annotations

import time

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import launch, runtime
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


def _float64(layer, xs):
    twin = type(layer)(IN, H, algo="gemm", dtype="float64")
    twin.load_params({k: v.get().astype(np.float64) for k, v in layer.params.items()})
    return twin.forward(xs.get().astype(np.float64))[0]


def _decode(dec, xs, idle_after=None):
    out, state = [], None
    for t, x in enumerate(xs):
        y, state = dec.step(x, state)
        out.append(y.get())
        if t == idle_after:
            time.sleep(0.05)  # idle past the deadline: the kernel exits, the next step relaunches
    return out


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_gpu_decoder_matches_float64_and_is_bitwise_across_an_idle_exit(cupy, mode, settings):
    cp = cupy
    layer, xs = _layer(cp, mode), _inputs(cp)
    with layer.decoder(batch=B) as dec:
        assert dec.resident, dec.reason
        want = _decode(dec, xs)
    y64 = _float64(layer, xs)
    cells = _cell_loop(layer, xs)  # (the sequence path's projection: cuBLAS)
    for t in range(T):
        assert np.abs(want[t] - y64[t]).max() < 1e-5, t
        assert np.abs(want[t] - cells[t]).max() < 1e-5, t
    prnn.configure(gpu_timeout_ms=5)
    with layer.decoder(batch=B) as dec:
        got = _decode(dec, xs, idle_after=2)
        assert dec.relaunches >= 1
        dec.check()
    for t in range(T):
        assert np.array_equal(got[t], want[t]), t


def test_gpu_step_projected_equals_the_sequence_kernel_on_the_same_projections(cupy):
    """The caller's projections (b_ih included): the whole-sequence kernel's bits on them."""
    cp = cupy
    layer, xs = _layer(cp), _inputs(cp)
    p = layer.params
    gi = cp.stack([x @ p["weight_ih_l0"].T + p["bias_ih_l0"] for x in xs])
    zeros = cp.zeros((B, H), np.float32)
    with prnn.override_settings(**PER_LAYER):
        res, stats = runtime.forward(layer.cell, gi, p["weight_hh_l0"], p["bias_hh_l0"], zeros,
                                     zeros, None, "persistent")
    assert stats.algo == "persistent"
    with layer.decoder(batch=B) as dec:
        state = None
        for t in range(T):
            y, state = dec.step_projected(gi[t], state)
            assert np.array_equal(y.get(), res.y[t].get()), t


def test_gpu_decoder_step_is_one_launch_without_a_host_sync(cupy):
    cp = cupy
    layer, xs = _layer(cp), _inputs(cp)
    with layer.decoder(batch=B) as dec:
        y, state = dec.step(xs[0])
        before = dec.relaunches
        with launch.counting() as n:
            for x in xs[1:]:
                y, state = dec.step(x, state)
        relaunched = dec.relaunches - before
    # the step kernel (and relaunches): the projection is the resident CTAs' own work
    assert n.launches == len(xs) - 1 + relaunched and n.host_syncs == 0


def test_gpu_decoder_loop_captured_in_a_cuda_graph(cupy):
    """A 4-step loop (the step's output fed back through the caller's product) captured once
    and replayed: every replay the same bits, the eager loop's within the caller's product's
    round-off (cuBLAS eagerly, matmul.cu captured). The resident kernel runs outside the graph
    (launched by the decoder before the capture); a replay whose kernel has gone takes its
    slices over."""
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
        dec.resume()  # (a replay runs no host code: the resident kernel relaunched first)
        graph.launch(stream)
        stream.synchronize()
        assert np.array_equal(out.get(), first)  # replays: the same bits
        live = [int(w) & 3 == 0 for w in dec._resident.state.get()]
        assert all(live), "a resumed replay's steps ran on the step kernel, not resident"
    # captured, the caller's products are matmul.cu's, not cuBLAS's: within their round-off
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-7)


def test_gpu_torch_decoder_loop_captured_by_torch_replays_after_other_allocations(cupy):
    """The torch cell's decoder in ``torch.cuda.graph``: the library's arrays come from the
    graph's pool (``interop.library_stream``), so a replay after other CuPy and torch
    allocations gives the first replay's bits; the loop has no product but the decoder's (its
    kernels' own projection, the same eager and captured), so the eager loop's bits too."""
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
        dec.resume()  # (a replay runs no host code: the resident kernel relaunched first)
        graph.replay()
        torch.cuda.synchronize()
        first = out.clone()
        assert torch.equal(first, want)  # the same kernels as the eager loop's
        clutter = [cupy.full((B, 4 * H), -7.0, np.float32) for _ in range(8)]
        clutter += [torch.full((B, 4 * H), -7.0, device="cuda") for _ in range(8)]
        dec.resume()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)  # nothing the graph uses was handed out again
        del clutter
