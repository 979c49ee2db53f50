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
    with pytest.raises(Exception):  # CuPy has no bfloat16: DLPack says so
        to_array(torch.zeros(2, device="cuda", dtype=torch.bfloat16))


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
