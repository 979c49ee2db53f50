"""Zero-copy hand-over between torch tensors and the library's arrays (NumPy views, DLPack).

CPU tensors become NumPy arrays and CUDA tensors CuPy arrays on the same memory; results come
back to torch the same way. CUDA work runs on torch's current stream, so the library's kernels
are ordered with torch's own work without extra synchronisation.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

Array = Any  # numpy.ndarray or cupy.ndarray


def to_array(t: torch.Tensor | None) -> Array | None:
    """The tensor's memory as a NumPy (CPU) or CuPy (CUDA) array; contiguous first if it is not."""
    if t is None:
        return None
    if not t.is_contiguous():
        t = t.detach().contiguous()
    if t.is_cuda:
        return _cuda_array(t.detach())
    return t.numpy(force=True)  # detached: np.from_dlpack's memory, in a third of its time


# torch dtypes CuPy has, as NumPy dtypes (bfloat16 is not among them: the library converts it)
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.float16: np.dtype(np.float16), torch.int32: np.dtype(np.int32),
                 torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8),
                 torch.bool: np.dtype(np.bool_)}


def _cuda_array(t: torch.Tensor) -> Array:
    """A contiguous CUDA tensor's memory as a CuPy array, ``t`` its owner. Not through DLPack:
    its stream hand-over (torch's ``__dlpack__(stream)`` makes the consumer's stream wait on
    torch's current one) is a no-op here, since every library call runs on torch's current
    stream (``library_stream``), and it cost ~13 conversions x tens of µs of Python a torch
    module's forward and backward on the H100 (bench/results/h100-2026-11-26)."""
    import cupy
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None or t.numel() == 0:
        return cupy.from_dlpack(t)
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * dtype.itemsize, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def to_tensor(a: Array | None) -> torch.Tensor | None:
    """The array's memory as a torch tensor (no copy)."""
    if a is None:
        return None
    # torch.from_numpy shares the memory as DLPack does, in half its time
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


_HOST = contextlib.nullcontext()  # CPU tensors: no device or stream to enter


def library_stream(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Run the enclosed library calls on ``t``'s device and torch's current stream there."""
    return _cuda_stream(t) if t.is_cuda else _HOST


@contextlib.contextmanager
def _cuda_stream(t: torch.Tensor) -> Iterator[None]:
    import cupy
    with torch.cuda.device(t.device):
        stream = _cupy_stream(cupy, torch.cuda.current_stream(t.device), t.device.index)
        # Under the caller's CUDA-graph capture the library's arrays come from torch's allocator:
        # the graph's private pool keeps them for every replay, where CuPy's pool would hand a
        # freed one to the next allocation while the graph still writes it.
        memory = (cupy.cuda.using_allocator(_torch_allocation)
                  if torch.cuda.is_current_stream_capturing() else _HOST)
        with cupy.cuda.Device(t.device.index), stream, memory:
            yield


_CUPY_STREAMS: dict[tuple[int, int], Any] = {}  # (stream pointer, device): CuPy's view of it
_MAX_CUPY_STREAMS = 256


def _cupy_stream(cupy, stream: torch.cuda.Stream, device: int) -> Any:
    """CuPy's view of a torch stream, made once per stream: a call's hand-over then costs a
    lookup, not a wrapper's construction (and, for ``ExternalStream``, a deprecation warning)."""
    ptr = stream.cuda_stream
    if ptr == 0:  # torch's default stream is the legacy null stream: CuPy's null stream
        return cupy.cuda.Stream.null
    view = _CUPY_STREAMS.get((ptr, device))
    if view is None:
        if len(_CUPY_STREAMS) >= _MAX_CUPY_STREAMS:  # (a program making streams without end)
            _CUPY_STREAMS.clear()
        view = (cupy.cuda.Stream.from_external(stream) if hasattr(stream, "__cuda_stream__")
                else cupy.cuda.ExternalStream(ptr, device))
        _CUPY_STREAMS[(ptr, device)] = view
    return view


class _TorchBlock:
    """A block of torch's caching allocator, returned to it when CuPy lets go of its memory."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        torch.cuda.caching_allocator_delete(self.ptr)


def _torch_allocation(size: int) -> Any:
    """A CuPy allocator (``cupy.cuda.using_allocator``) over torch's caching allocator, on
    torch's current device and stream."""
    import cupy
    device = torch.cuda.current_device()
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    ptr = torch.cuda.caching_allocator_alloc(size, device, torch.cuda.current_stream(device))
    memory = cupy.cuda.UnownedMemory(ptr, size, _TorchBlock(ptr), device)
    return cupy.cuda.MemoryPointer(memory, 0)


def lengths_array(lengths: torch.Tensor, like: Array) -> Array:
    """Sequence lengths as int32 on the array module of ``like`` (NumPy or CuPy)."""
    host = lengths.detach().to(device="cpu", dtype=torch.int32).numpy()
    if isinstance(like, np.ndarray):
        return host
    import cupy
    return cupy.asarray(host)
