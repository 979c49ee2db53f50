"""Zero-copy hand-over between torch tensors and the library's arrays (NumPy views, DLPack).

CPU tensors become NumPy arrays and CUDA tensors CuPy arrays on the same memory; results come
back to torch the same way. CUDA work runs on torch's current stream, so the library's kernels
are ordered with torch's own work without extra synchronisation.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

Array = Any  # numpy.ndarray or cupy.ndarray
# torch's CUDA bindings, absent from a CPU-only build: touched only for CUDA tensors and arrays
_TORCH_CUDA = hasattr(torch._C, "_cuda_getCurrentRawStream")


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
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
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
    dtype = NUMPY_DTYPES.get(t.dtype)
    if dtype is None or t.numel() == 0:
        return cupy.from_dlpack(t)
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * dtype.itemsize, t, t.get_device())
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def to_tensor(a: Array | None) -> torch.Tensor | None:
    """The array's memory as a torch tensor (no copy), ordered after the work queued on CuPy's
    current stream as ``torch.from_dlpack`` orders it."""
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)  # shares the memory as DLPack does, in half its time
    import cupy
    if (_TORCH_CUDA and type(a) is cupy.ndarray and cupy.cuda.get_current_stream().ptr
            == torch._C._cuda_getCurrentRawStream(a.data.device_id)):
        # torch.from_dlpack orders torch's stream after CuPy's by an event only where the two
        # differ; here they are one stream (always so in ``library_stream``), so no ordering
        # (stream -1) is the same exchange, without its Python (~6 µs a tensor on the H200); an
        # unversioned capsule, which every torch version takes
        return torch._C._from_dlpack(a.__dlpack__(stream=-1))
    return torch.from_dlpack(a)


_HOST = contextlib.nullcontext()  # CPU tensors: no device or stream to enter


def library_stream(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Run the enclosed library calls on ``t``'s device and torch's current stream there."""
    return _CudaStream(t.get_device()) if t.is_cuda else _HOST


def on_library_stream(t: torch.Tensor, fn, *args):
    """``fn(*args)`` run in ``library_stream(t)``; for a CPU tensor called at once (no block
    entered: a null context's enter and exit cost more than the call's own Python)."""
    if not t.is_cuda:
        return fn(*args)
    with _CudaStream(t.get_device()):
        return fn(*args)


class _CudaStream:
    """``library_stream`` of a CUDA tensor on ``device``: torch's current device set to it for
    the block (as ``torch.cuda.device`` sets it), CuPy's device too, CuPy's current stream set to
    torch's current stream there and, under the caller's CUDA-graph capture, CuPy's allocations
    made by torch's allocator. Made of the C bindings that torch.cuda's Python calls: that Python
    cost ~10 µs an entry on the H200, entered several times a module call
    (bench/results/h200-2026-11-27)."""
    __slots__ = ("device", "previous", "entered")

    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self) -> None:
        import cupy
        device = self.device
        self.previous = torch._C._cuda_exchangeDevice(device)
        self.entered = entered = []
        try:
            ptr = torch._C._cuda_getCurrentRawStream(device)
            stream = _CUPY_STREAMS.get((ptr, device))
            contexts = [cupy.cuda.Device(device),
                        _cupy_stream(cupy, ptr, device) if stream is None else stream]
            if torch._C._cuda_isCurrentStreamCapturing():
                # Under the caller's CUDA-graph capture the library's arrays come from torch's
                # allocator: the graph's private pool keeps them for every replay, where CuPy's
                # pool would hand a freed one to the next allocation while the graph writes it.
                contexts.append(cupy.cuda.using_allocator(_torch_allocation))
            for context in contexts:
                context.__enter__()
                entered.append(context)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: object) -> None:
        entered = self.entered
        try:
            while entered:
                entered.pop().__exit__(None, None, None)
        finally:
            torch._C._cuda_maybeExchangeDevice(self.previous)


_CUPY_STREAMS: dict[tuple[int, int], Any] = {}  # (stream pointer, device): CuPy's view of it
_MAX_CUPY_STREAMS = 256


def _cupy_stream(cupy, ptr: int, device: int) -> Any:
    """CuPy's view of torch's current stream ``ptr`` on ``device``, made once per stream (and
    kept in ``_CUPY_STREAMS``): a call's hand-over then costs a lookup, not a wrapper's
    construction (and, for ``ExternalStream``, a deprecation warning)."""
    if len(_CUPY_STREAMS) >= _MAX_CUPY_STREAMS:  # (a program making streams without end)
        _CUPY_STREAMS.clear()
    if ptr == 0:  # torch's default stream is the legacy null stream: CuPy's null stream
        view = cupy.cuda.Stream.null
    else:
        stream = torch.cuda.current_stream(device)
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
