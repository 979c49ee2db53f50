"""The torch modules' hand-over of CUDA tensors (marked ``gpu``): ``to_array`` shares memory
with the tensor for every dtype it maps (writes through the array show in the tensor), keeps
the tensor alive, falls back to DLPack for the rest; a module's remembered CUDA weight views see
an optimizer's in-place update on the next call."""
from __future__ import annotations

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "bool"])
def test_to_array_shares_the_tensors_memory(cupy, dtype):
    from persistent_rnn.torch.interop import to_array
    t = (torch.arange(24, device="cuda") % 5).to(getattr(torch, dtype)).reshape(2, 3, 4)
    a = to_array(t)
    assert a.shape == (2, 3, 4) and a.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a.get(), t.cpu().numpy())
    a[1, 2, 3] = 1
    assert t[1, 2, 3].item() == 1
    assert a.data.ptr == t.data_ptr()


def test_to_array_of_a_view_an_empty_tensor_and_bfloat16(cupy):
    from persistent_rnn.torch.interop import to_array
    base = torch.randn(4, 6, device="cuda")
    view = base[1:3, ::2]  # not contiguous: copied first
    np.testing.assert_array_equal(to_array(view).get(), view.cpu().numpy())
    sliced = base[2:]  # contiguous, at an offset into its storage
    assert to_array(sliced).data.ptr == sliced.data_ptr()
    assert to_array(torch.empty(0, 3, device="cuda")).shape == (0, 3)
    bf16 = torch.randn(2, 3, device="cuda").to(torch.bfloat16)
    try:
        a = to_array(bf16)
    except (TypeError, ValueError, BufferError, RuntimeError):
        return  # a CuPy without bfloat16 (before 14) refuses it through DLPack
    assert a.shape == (2, 3) and a.dtype.itemsize == 2 and a.data.ptr == bf16.data_ptr()
    np.testing.assert_array_equal(a.view(cupy.uint16).get(),
                                  bf16.view(torch.int16).cpu().numpy().view(np.uint16))


def test_library_arrays_under_a_torch_capture_come_from_the_graph_pool(cupy):
    from persistent_rnn.torch.interop import library_stream
    x = torch.ones(4, device="cuda")
    with library_stream(x):
        outside = cupy.empty(1 << 20, np.float32)
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph), library_stream(x):
        inside = cupy.empty(1 << 20, np.float32)
        inside.fill(3.0)
    grew = torch.cuda.memory_allocated() - before
    assert grew >= inside.nbytes  # torch's allocator, not CuPy's pool
    graph.replay()
    torch.cuda.synchronize()
    assert float(inside[0]) == 3.0 and outside.nbytes == inside.nbytes


def test_the_array_keeps_its_tensor_alive(cupy):
    from persistent_rnn.torch.interop import to_array
    a = to_array(torch.full((1024,), 7.0, device="cuda"))
    gc.collect()
    torch.cuda.empty_cache()
    torch.empty(1024, device="cuda").fill_(-1.0)  # would take the freed block
    assert float(a.sum()) == 7.0 * 1024


def test_remembered_cuda_weights_see_an_optimizer_step(cupy):
    import persistent_rnn.torch as prt
    torch.manual_seed(0)
    ours = prt.GRU(8, 16, algo="persistent").cuda()
    ref = torch.nn.GRU(8, 16).cuda()
    ref.load_state_dict(ours.state_dict())
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.5)
    x = torch.randn(5, 3, 8, device="cuda")
    for _ in range(3):
        optimizer.zero_grad()
        ours(x)[0].square().sum().backward()
        optimizer.step()  # in place: the remembered views must see it
        ref.load_state_dict(ours.state_dict())
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=False):
            torch.testing.assert_close(ours(x)[0], ref(x)[0], rtol=1e-5, atol=1e-5)
        assert ours.last_run.algo == "persistent"


def test_library_stream_is_torchs_current_stream_and_made_once(cupy):
    from persistent_rnn.torch.interop import library_stream
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    views = []
    for _ in range(2):
        with torch.cuda.stream(side), library_stream(x):
            views.append(cupy.cuda.get_current_stream())
            assert views[-1].ptr == side.cuda_stream
    assert views[0] is views[1]  # one CuPy view per torch stream, not one per call
    with library_stream(x):
        assert cupy.cuda.get_current_stream().ptr == torch.cuda.current_stream().cuda_stream
