"""A persistent pass's chain, captured once as a CUDA graph and replayed: one launch a call.

A pass enqueues a fixed chain (``launch.run_chain``): a memset, the persistent launch,
``max_restarts`` resume launches (which exit at once unless a barrier timed out) and the
completion kernel - six stream operations (eleven before the launches settled themselves:
``cuda_src/chain.cuh``), each a CuPy call of its own with its
arguments marshalled in Python. Nothing in the chain depends on the host after it is enqueued,
so the whole chain is a CUDA graph: ``run(key, issue)`` replays the graph recorded for ``key``
in one ``cudaGraphLaunch`` on the caller's stream.

``key`` holds every value the chain's operations read - the engine, the pass's first and end
step, the stall, the settings the launches read, and each argument array's address, shape,
strides and dtype (``value``; of an array whose layout a call plan fixes, its address per call,
``addresses``, the layout once) - so a replay issues exactly what ``issue()`` would issue now:
memory at those addresses belongs to the arrays of this call, whoever held it before. A key
seen for the first time runs ``issue()`` directly (most keys of a run repeat: CuPy's pool hands
a loop the same blocks call after call, but a one-off call should not pay a capture); the
second time it is captured on a side stream (the caller's may be the legacy stream, which
cannot be captured), instantiated, and from then on replayed. The most recent ``MAX_GRAPHS``
keys are kept. Several chains enqueued as one unit (``launch.one_graph``: a planned call's
layers) are one key - every chain's - and one graph, replayed in one launch. While a chain is
captured, ``capturing()`` is true on that thread: the products
the chain holds (a planned call's, ``call_plans``) are then recorded as cuBLAS's own calls
(``matmul``, ``cublas_capture``), the bits of the direct run.

Only on CuPy arrays (the emulation has no graphs: ``launch.Chain.on_device``), with
``Settings.chain_graphs`` on, and never while the caller's stream is itself being captured (the
chain then becomes part of the caller's graph, as before).
"""
from __future__ import annotations

import itertools
import operator
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable

import numpy as np


MAX_GRAPHS = 64
_TOKENS = itertools.count()  # ``Fixed.token``s
_SEEN, _EAGER = "seen once", "capture failed"

_graphs: OrderedDict[tuple, Any] = OrderedDict()
_lock = threading.Lock()
_side = threading.local()  # per thread: device id -> the stream chains are captured on


class Fixed(tuple):
    """A part of a chain graph's key that stays the same call after call (a chain's own part,
    a prepared pass's arguments but the call's arrays): its hash computed once, where a tuple's
    is computed anew over all its items at every look-up (``run``: some hundred items a pass,
    a few µs of Python a call); compared as a tuple, by identity first. In a graph's key it
    stands by its ``token`` (``Token``)."""

    def __new__(cls, parts: tuple) -> "Fixed":
        made = super().__new__(cls, parts)
        made._hash = tuple.__hash__(made)
        made.token = Token(next(_TOKENS))  # (``next`` of a count: atomic, no lock)
        made.token.fixed = made
        return made

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # (made again where it is unpickled: a string's hash differs between processes)
        return Fixed, (tuple(self),)


class Token(int):
    """A ``Fixed``'s stand-in in a chain graph's key: an int no other ``Fixed`` of the process
    has, hashed in C where the ``Fixed``'s own ``__hash__`` is a Python call (1.2k
    instructions, as much as the rest of a key's hash; bench/snippet_instructions.py).
    ``fixed``: the parts it stands for (what the key holds, for whoever reads it). Another
    ``Fixed`` of equal parts has another token: its calls record their graph anew, never replay
    another's."""

    fixed: Fixed


def value(v: Any) -> Any:
    """What a chain reads of one argument: an array's address, shape, strides and dtype, or the
    scalar itself (a tuple's items in turn)."""
    data = getattr(v, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return (data.ptr, v.shape, v.strides, v.dtype.char)
    if isinstance(v, tuple):
        return tuple([value(x) for x in v])  # (a list: one Python call, not one an item)
    if isinstance(v, np.ndarray):  # never in a CuPy chain: a host array would be copied, not read
        raise TypeError("a chain's arguments are device arrays and scalars")
    return v


def addresses(arrays: dict, roles: tuple) -> tuple:
    """The address of each of ``arrays``' ``roles``: what a key reads per call of arrays whose
    shape, strides and dtype it holds once (``runtime.Around.addressed``; one Python call for
    them all, the rest in C)."""
    return tuple(map(_POINTER, map(arrays.__getitem__, roles)))


_POINTER = operator.attrgetter("data.ptr")


_SCALAR_TYPES = frozenset({int, float, bool, type(None), np.int32, np.int64, np.uint32, np.uint64,
                           np.float32})


def arguments_key(named: dict) -> tuple:
    """``value`` of each named argument, in order (a list, not a generator: this runs on every
    call, and scalars are taken as they are without a call)."""
    return tuple([(name, v if type(v) in _SCALAR_TYPES else value(v)) for name, v in named.items()])


def run(key: tuple, issue: Callable[[], None]) -> bool:
    """Enqueue the chain ``issue()`` enqueues, from the graph recorded for ``key`` where there is
    one (module docstring); whether a graph was launched."""
    device, stream = _where()
    full = (device, stream.ptr, key)
    with _lock:
        found = _graphs.get(full)
        if found is not None:
            _graphs.move_to_end(full)
        else:
            _graphs[full] = _SEEN
            _trim()
    if found is _SEEN:
        found = _capture(device, issue)
        with _lock:
            _graphs[full] = found
    if found is None or found is _EAGER:
        issue()
        return False
    found.launch(stream)
    return True


def capturing() -> bool:
    """Whether this thread is capturing a chain now (``matmul`` then records cuBLAS's products,
    ``cublas_capture``)."""
    return getattr(_side, "capturing", False)


def clear() -> None:
    """Forget every recorded chain (their graphs are destroyed when no longer referenced)."""
    with _lock:
        _graphs.clear()


def recorded() -> int:
    """How many chains are held as graphs (not counting keys seen once or failed)."""
    with _lock:
        return sum(1 for g in _graphs.values() if g is not _SEEN and g is not _EAGER)


def _where() -> tuple[int, Any]:
    """The current CuPy device's id and its current stream."""
    import cupy
    return cupy.cuda.Device().id, cupy.cuda.get_current_stream()


def _trim() -> None:
    while len(_graphs) > MAX_GRAPHS:
        _graphs.popitem(last=False)


def _refuse_allocation(size: int) -> Any:
    """The allocator while a chain is captured: CuPy's pool would hand the block back when the
    capture's temporaries die, and every replay would still write it - so none is taken."""
    raise NotImplementedError(f"a CuPy allocation ({size} bytes) inside a captured chain")


def _capture(device: int, issue: Callable[[], None]) -> Any:
    """``issue()`` captured on this thread's side stream of ``device`` and instantiated, or
    ``_EAGER`` (with a warning) where the capture failed: that key then always runs directly.
    Nothing may come from CuPy's pool during the capture (``_refuse_allocation``: such a chain
    runs directly); cuBLAS's own workspace is the graph's (stream-ordered, CUDA 12.2 and later)."""
    import cupy
    streams = getattr(_side, "streams", None)
    if streams is None:
        streams = _side.streams = {}
    side = streams.get(device)
    if side is None:
        side = streams[device] = cupy.cuda.Stream(non_blocking=True)
    try:
        with side, cupy.cuda.using_allocator(_refuse_allocation):
            side.begin_capture()
            _side.capturing = True
            try:
                issue()
            finally:
                _side.capturing = False
                graph = side.end_capture()
    except Exception as exc:  # noqa: BLE001 -- any failure leaves the chain to run directly
        warnings.warn(f"persistent_rnn: a pass's chain could not be captured as a CUDA graph "
                      f"({type(exc).__name__}: {exc}); it runs launch by launch", RuntimeWarning,
                      stacklevel=4)
        return _EAGER
    return graph
