"""The torch modules' hand-over of CUDA tensors (marked ``gpu``): ``to_array`` shares memory
with the tensor for every dtype it maps (writes through the array show in the tensor), keeps
the tensor alive, falls back to DLPack for the rest; a module's remembered CUDA weight views see
an optimizer's in-place update on the next call; ``library_stream`` sets torch's device and
CuPy's device and stream to the tensor's and torch's current stream (a side stream, a capture's)
in a few Python calls and restores them; ``to_tensor`` there shares memory without torch's
DLPack Python, and where CuPy's stream is not torch's still orders torch's after CuPy's work."""
from __future__ import annotations

import functools
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


# The hand-over's C path (issue 26: torch.cuda's Python cost ~10 µs a library_stream entry and
# ~6 µs a to_tensor on the H200): the same device, streams and ordering as torch's own calls.

_BINDINGS = ("_cuda_exchangeDevice", "_cuda_maybeExchangeDevice", "_cuda_getCurrentRawStream",
             "_cuda_isCurrentStreamCapturing", "_from_dlpack")


def _entered(t) -> None:
    from persistent_rnn.torch.interop import library_stream
    with library_stream(t):
        pass


def _python_calls(call) -> int:
    """Python functions entered during ``call()``, ``call`` itself not counted."""
    from profiling import run_profiled
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_back.f_code is not run_profiled.__code__:
            count += 1

    run_profiled(call, hook)
    return count


def test_torchs_cuda_bindings_the_hand_over_calls_exist():
    assert [name for name in _BINDINGS if not hasattr(torch._C, name)] == []


def test_library_stream_is_torchs_device_and_stream_made_once_and_restored(cupy):
    from persistent_rnn.torch.interop import library_stream
    x = torch.ones(4, device="cuda")
    device = torch.cuda.current_device()
    outside = cupy.cuda.get_current_stream()
    side = torch.cuda.Stream()
    views = []
    for stream in (None, side, side):
        with torch.cuda.stream(stream), library_stream(x):
            assert cupy.cuda.Device().id == torch.cuda.current_device() == x.get_device()
            views.append(cupy.cuda.get_current_stream())
            ptr = torch.cuda.current_stream().cuda_stream
            assert views[-1].ptr == ptr and (stream is None or ptr == side.cuda_stream)
            if ptr == 0:  # torch's legacy default stream: CuPy's null stream
                assert views[-1] is cupy.cuda.Stream.null
        assert torch.cuda.current_device() == device
        assert cupy.cuda.get_current_stream() is outside
    assert views[1] is views[2]  # one CuPy view per torch stream, not one per call
    with pytest.raises(KeyError), torch.cuda.stream(side), library_stream(x):
        raise KeyError  # an exception in the block leaves nothing set
    assert cupy.cuda.get_current_stream() is outside and torch.cuda.current_device() == device


def test_library_stream_switches_to_the_tensors_device_and_back(cupy):
    from persistent_rnn.torch.interop import library_stream
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: no other device to switch to")
    x = torch.ones(4, device="cuda:1")
    with torch.cuda.device(0):
        with library_stream(x):
            assert torch.cuda.current_device() == 1 and cupy.cuda.Device().id == 1
            assert cupy.cuda.get_current_stream().ptr == torch.cuda.current_stream(1).cuda_stream
        assert torch.cuda.current_device() == 0 and cupy.cuda.Device().id == 0


def test_library_stream_under_a_capture_is_the_capture_stream(cupy):
    from persistent_rnn.torch.interop import library_stream
    x = torch.ones(4, device="cuda")
    y = cupy.full(4, 2.0, np.float32)
    y *= 3  # (CuPy's kernels compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), library_stream(x):
        assert cupy.cuda.get_current_stream().ptr == torch.cuda.current_stream().cuda_stream
        y = cupy.full(4, 2.0, np.float32)
        y *= 3
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(y.get(), np.full(4, 6.0, np.float32))


def test_a_library_stream_entry_is_a_few_python_calls(cupy):
    x = torch.ones(4, device="cuda")
    for stream in (None, torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            _entered(x)  # (its CuPy stream view made)
            # library_stream, _CudaStream's __init__, __enter__ and __exit__ (4), the rest C
            # calls (through torch.cuda.device and torch.cuda.current_stream: over 20)
            assert _python_calls(functools.partial(_entered, x)) <= 5


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "bool"])
def test_to_tensor_in_library_stream_shares_memory_without_python(cupy, dtype):
    from persistent_rnn.torch.interop import library_stream, to_tensor
    x = torch.ones(4, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()), library_stream(x):
        for shape in ((2, 3), (0, 3)):
            a = (cupy.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
            t = to_tensor(a)
            assert t.shape == shape and t.dtype == getattr(torch, dtype) and t.is_cuda
            assert not a.size or t.data_ptr() == a.data.ptr
            np.testing.assert_array_equal(t.cpu().numpy(), a.get())
            # CuPy's current stream is torch's: no event to make, no Python past to_tensor's
            # own (0 calls; torch.from_dlpack, torch.cuda.current_stream and more: 5 at least)
            assert _python_calls(functools.partial(to_tensor, a)) <= 1


def _written_late(cupy, value: float, n: int = 1 << 20):
    """A CuPy array written with ``value`` on CuPy's current stream after ~50 ms of spinning
    there (zeros until then, its zeros already written)."""
    a = cupy.zeros(n, np.float32)
    cupy.cuda.get_current_stream().synchronize()
    view = torch.from_dlpack(a)  # (the same memory)
    with torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr)):
        torch.cuda._sleep(100_000_000)
        view.fill_(value)
    return a


def test_to_tensor_in_library_stream_is_ordered_on_torchs_stream(cupy):
    from persistent_rnn.torch.interop import library_stream, to_tensor
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), library_stream(x):
        a = _written_late(cupy, 5.0)
        total = to_tensor(a).sum()  # on torch's current stream: after the write
    side.synchronize()
    assert total.item() == 5.0 * a.size


def test_to_tensor_where_cupys_stream_is_not_torchs_waits_for_cupys_work(cupy):
    """Outside ``library_stream`` CuPy's current stream may be another: there the hand-over
    makes torch's stream wait on CuPy's (torch.from_dlpack's event), the C path would not."""
    from persistent_rnn.torch.interop import to_tensor
    with cupy.cuda.Stream(non_blocking=True):
        a = _written_late(cupy, 3.0)
        total = to_tensor(a).sum()  # on torch's default stream, not CuPy's
    torch.cuda.synchronize()
    assert total.item() == 3.0 * a.size
