"""The CuPy GEMM path's step loops recorded once per shape as CUDA graphs and replayed.

A loop of T steps issues about 2T kernels from Python; replaying a CUDA graph issues them in
one launch. ``run(name, loop, inputs, outputs)`` calls ``loop(**inputs, **outputs)``, a
stream-ordered function that reads ``inputs`` and writes every element of ``outputs``:

* the first call with a configuration (name, array shapes and dtypes, device, stream) runs the
  loop directly;
* the second records it as a graph over a private workspace: arrays of the same shapes, and a
  memory pool of its own for the loop's temporaries (so that no memory the graph touches is
  handed to anyone else while it lives); then it is replayed;
* every later call copies ``inputs`` into the workspace, replays the graph and copies the
  workspace's ``outputs`` out, all on the caller's stream, under the entry's lock.

The most recent ``MAX_GRAPHS`` configurations are kept. Only with CuPy arrays, only with the
``gemm_graphs`` setting on (off by default: not yet measured on a GPU), never with
``allow_tf32`` on (a recorded loop's products are ``matmul.cu``'s fp32, the direct loop's TF32:
the calls would differ), and never while the caller's stream is itself being captured.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from . import settings
from .buffers import array_module

Array = Any
MAX_GRAPHS = 8


@dataclass
class _Recorded:
    """One recorded loop: its workspace, the replay and what keeps its memory alive."""

    workspace: dict[str, Array | None]
    replay: Callable[[], None]
    keep: Any  # the private memory pool (and graph) the replay writes through
    lock: threading.Lock = field(default_factory=threading.Lock)


_SEEN, _EAGER = "seen once", "recording failed"
_entries: OrderedDict[tuple, _Recorded | str] = OrderedDict()
_entries_lock = threading.Lock()


def run(name: str, loop: Callable[..., None], inputs: Mapping[str, Array | None],
        outputs: Mapping[str, Array | None]) -> None:
    """``loop(**inputs, **outputs)``, from a recorded graph where possible (module docstring)."""
    arrays = {**inputs, **outputs}
    xp = array_module(*(a for a in arrays.values() if a is not None))
    current = settings.current()
    # (with allow_tf32 a direct loop's products are TF32, a recorded one's matmul.cu's fp32)
    if not (current.gemm_graphs and not current.allow_tf32 and eligible(xp)):
        loop(**arrays)
        return
    key = (name, _where(xp), tuple((k, None if a is None else (a.shape, a.dtype.str))
                                   for k, a in arrays.items()))
    with _entries_lock:
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _SEEN
        elif entry is _SEEN:
            entry = _entries[key] = _record_or_eager(xp, loop, arrays)
        _entries.move_to_end(key)
        while len(_entries) > MAX_GRAPHS:
            _entries.popitem(last=False)
    if isinstance(entry, str):
        loop(**arrays)
        return
    with entry.lock:
        for k, a in inputs.items():
            if a is not None:
                entry.workspace[k][...] = a
        entry.replay()
        for k, a in outputs.items():
            if a is not None:
                a[...] = entry.workspace[k]


def clear() -> None:
    """Drop every recorded graph (and the memory it holds)."""
    with _entries_lock:
        _entries.clear()


def _record_or_eager(xp, loop: Callable[..., None], arrays: Mapping[str, Array | None]):
    """``_record``, or ``_EAGER`` (with a warning) where CUDA refuses to capture the loop."""
    try:
        return _record(xp, loop, arrays)
    except RuntimeError as exc:  # CuPy's CUDARuntimeError / CUBLASError during capture
        warnings.warn(f"persistent_rnn: recording the GEMM path as a CUDA graph failed ({exc}); "
                      f"this configuration runs step by step", RuntimeWarning, stacklevel=3)
        return _EAGER


def _record(xp, loop: Callable[..., None], arrays: Mapping[str, Array | None]) -> _Recorded:
    """Allocate the workspace and record ``loop`` over it (nothing runs yet)."""
    with _private_memory(xp) as keep:
        workspace = {k: None if a is None else xp.empty(a.shape, a.dtype) for k, a in arrays.items()}
        replay = _capture(xp, lambda: loop(**workspace))
    return _Recorded(workspace, replay, keep)


def eligible(xp) -> bool:
    """CuPy arrays on a stream that is not being captured already."""
    if xp is np:
        return False
    return not xp.cuda.get_current_stream().is_capturing()


def _where(xp) -> tuple[int, int]:
    """(device id, stream handle): a workspace serves one stream of one device."""
    return xp.cuda.Device().id, xp.cuda.get_current_stream().ptr


@contextlib.contextmanager
def _private_memory(xp) -> Iterator[Any]:
    """Allocations inside come from a pool of their own, returned (to keep alive)."""
    pool = xp.cuda.MemoryPool()
    with xp.cuda.using_allocator(pool.malloc):
        yield pool


def _capture(xp, issue: Callable[[], None]) -> Callable[[], None]:
    """Record what ``issue`` enqueues as a CUDA graph; return its launch on the current stream."""
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            issue()
        finally:
            graph = stream.end_capture()
    return graph.launch
