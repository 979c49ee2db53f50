"""The chain graph cache (persistent_rnn.chain_graphs) without a GPU: what a key holds, the
policy (a key runs directly the first time, is captured the second, replayed after), the bound,
a capture that fails, and that the library's own capture holds no arrays. The replay itself runs
on a GPU in tests/test_gpu_chain_graphs.py."""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import chain_graphs, launch, settings


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class _DeviceArray:
    """What ``value`` reads of a CuPy array."""

    def __init__(self, ptr: int, shape=(2, 3), strides=(12, 4), dtype=np.float32):
        self.data, self.shape, self.strides = _Pointer(ptr), shape, strides
        self.dtype = np.dtype(dtype)


class _Graph:
    def __init__(self):
        self.launched = []

    def launch(self, stream):
        self.launched.append(stream.ptr)


class _Stream:
    ptr = 77


@pytest.fixture
def fake_gpu(monkeypatch):
    """chain_graphs on a fake device: captures return a _Graph after running ``issue`` (as a
    capture records what it issues); yields the list of captures."""
    captures = []

    def capture(device, issue):
        issue()
        captures.append(_Graph())
        return captures[-1]

    monkeypatch.setattr(chain_graphs, "_where", lambda: (0, _Stream()))
    monkeypatch.setattr(chain_graphs, "_capture", capture)
    chain_graphs.clear()
    yield captures
    chain_graphs.clear()


def test_value_is_address_shape_strides_and_dtype():
    a = _DeviceArray(4096)
    assert chain_graphs.value(a) == (4096, (2, 3), (12, 4), "f")
    assert chain_graphs.value(_DeviceArray(4096, strides=(4, 8))) != chain_graphs.value(a)
    assert chain_graphs.value(_DeviceArray(8192)) != chain_graphs.value(a)
    assert chain_graphs.value((a, 3, None)) == (chain_graphs.value(a), 3, None)
    assert chain_graphs.value(np.int32(5)) == 5
    with pytest.raises(TypeError, match="device arrays"):
        chain_graphs.value(np.zeros(3))
    assert chain_graphs.addresses({"a": a, "b": _DeviceArray(8192)}, ("b", "a")) == (8192, 4096)
    key = chain_graphs.arguments_key({"x": a, "steps": 4})
    assert key == (("x", chain_graphs.value(a)), ("steps", 4))


def test_first_call_direct_second_captured_then_replayed(fake_gpu):
    issued = []
    assert chain_graphs.run(("k",), lambda: issued.append(1)) is False
    assert issued == [1] and fake_gpu == []
    assert chain_graphs.run(("k",), lambda: issued.append(2)) is True
    assert issued == [1, 2] and len(fake_gpu) == 1 and fake_gpu[0].launched == [77]
    assert chain_graphs.run(("k",), lambda: issued.append(3)) is True
    assert issued == [1, 2] and fake_gpu[0].launched == [77, 77]
    assert chain_graphs.recorded() == 1
    assert chain_graphs.run(("other",), lambda: issued.append(4)) is False  # a new key: direct
    assert issued == [1, 2, 4]


def test_the_cache_keeps_the_most_recent_keys(fake_gpu, monkeypatch):
    monkeypatch.setattr(chain_graphs, "MAX_GRAPHS", 3)
    for k in range(5):
        chain_graphs.run((k,), lambda: None)
        chain_graphs.run((k,), lambda: None)
    assert chain_graphs.recorded() == 3
    issued = []
    assert chain_graphs.run((0,), lambda: issued.append(0)) is False  # evicted: seen anew
    assert chain_graphs.run((4,), lambda: issued.append(4)) is True
    assert issued == [0]


def test_a_failed_capture_runs_the_chain_directly_from_then_on(monkeypatch):
    monkeypatch.setattr(chain_graphs, "_where", lambda: (0, _Stream()))
    chain_graphs.clear()
    monkeypatch.setattr(chain_graphs, "_capture", lambda device, issue: chain_graphs._EAGER)
    issued = []
    for i in range(3):
        assert chain_graphs.run(("k",), lambda i=i: issued.append(i)) is False
    assert issued == [0, 1, 2] and chain_graphs.recorded() == 0
    chain_graphs.clear()


def test_a_fixed_key_part_is_hashed_once():
    """``Fixed``: its items hashed when it is made, never at a look-up; equal to its tuple, and
    hashed as it. Sabotage: a ``__hash__`` that hashes the items again fails it."""
    hashed = []

    class Item:
        def __hash__(self) -> int:
            hashed.append(1)
            return 7
    item = Item()
    fixed = chain_graphs.Fixed((item, 3))
    assert len(hashed) == 1
    table = {(fixed, 1): "graph"}
    assert table[(fixed, 1)] == "graph" and hash(fixed) == hash((item, 3))
    assert fixed == (item, 3) and len(hashed) == 2  # (the last hash: the plain tuple's)


def test_a_fixed_key_part_stands_in_a_key_by_its_token():
    """``Fixed.token``: an int hashed in C (no Python ``__hash__``), its ``Fixed`` readable from
    it, never another ``Fixed``'s - one of equal parts too (its calls record their own graph)."""
    fixed, again = chain_graphs.Fixed(("gru", 3)), chain_graphs.Fixed(("gru", 3))
    token = fixed.token
    assert isinstance(token, int) and type(token).__hash__ is int.__hash__
    assert token.fixed is fixed and again == fixed and again.token != token
    assert {(token, 1): "graph"}.get((again.token, 1)) is None


def test_a_fixed_key_part_unpickled_is_hashed_where_it_lands():
    """A ``Fixed`` pickled in another process (another string hash seed) or copied is made anew
    where it lands: its hash is the parts' there, so a look-up finds it. Sabotage: pickling its
    cached hash with it fails it."""
    made = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; from persistent_rnn import chain_graphs; "
         "sys.stdout.buffer.write(pickle.dumps(chain_graphs.Fixed(('gru', 3))))"],
        capture_output=True, check=True, env={**os.environ, "PYTHONHASHSEED": "1"}).stdout
    for landed in (pickle.loads(made), copy.deepcopy(chain_graphs.Fixed(("gru", 3)))):
        assert isinstance(landed, chain_graphs.Fixed) and hash(landed) == hash(("gru", 3))
        assert {("gru", 3): "graph"}[landed] == "graph"


def test_never_a_graph_on_numpy_or_with_the_setting_off(monkeypatch):
    """A chain of NumPy words (the emulation) is issued launch by launch, as is one of device
    words with the ``chain_graphs`` setting off; one of device words with it on is looked up."""
    looked_up, issued = [], []
    monkeypatch.setattr(chain_graphs, "run", lambda key, issue: looked_up.append(key) or True)
    monkeypatch.setattr(launch, "_issue_chain", lambda *args: issued.append(1))
    monkeypatch.setattr(launch, "_chain_key", lambda chain: "chain")
    on_numpy = launch.Chain(np, SimpleNamespace(pass_plan=SimpleNamespace(grid=1), key="e"), 1)
    on_device = _Chain()
    assert not on_numpy.on_device and on_device.on_device
    for chain in (on_numpy, on_device):
        chain.published = True  # (as ``run_chain`` finds a stream not being captured)

    def enqueue(chain) -> None:
        launch._enqueue([(chain, _Issuer(("arguments",)), None, settings.NO_STALL, 0, 1)])
    enqueue(on_numpy)
    with prnn.override_settings(chain_graphs=False):
        enqueue(on_device)
    assert issued == [1, 1] and looked_up == []
    enqueue(on_device)
    assert issued == [1, 1] and len(looked_up) == 1


def test_the_librarys_own_capture_holds_no_arrays(monkeypatch):
    monkeypatch.setattr(launch, "capturing", lambda a: True)
    launch.release_captured()
    monkeypatch.setattr(launch, "_issue", lambda pending: launch.keep_alive(_DeviceArray(64)))
    launch._holding_nothing(())
    assert launch.release_captured() == 0
    launch.keep_alive(_DeviceArray(64))  # a user's capture: held until released
    assert launch.release_captured() == 1


def test_an_emulated_chain_is_never_keyed(monkeypatch, stub_chains):
    """run_chain on NumPy words issues directly and never builds the key (whose ``value`` refuses
    host arrays)."""
    chain = type("C", (), {"words": np.zeros(8, np.uint32), "ring": launch.RecordRing(np, 1),
                           "recorded": 0, "on_device": False, "groups": 1,  # (a NumPy chain)
                           "engine": type("E", (), {"emulated": True})()})()
    ran = []
    stub_chains(lambda *a: ran.append(a))

    class Unkeyed(_Issuer):
        def arguments_key(self, data):
            raise AssertionError("the key is built only for a chain that may be a graph")
    launch.run_chain(chain, Unkeyed(), None, 0, 4, settings.NO_STALL, "")
    assert len(ran) == 1


def test_the_chains_own_key_part_is_built_once_per_ring(monkeypatch):
    """``run_chain``'s key holds the chain's words (its exchanges lie before them) and where it
    publishes; built once, and again when the ring (a new numbering) is another object - so a
    new ring never replays a graph that publishes into the old one."""
    values, keys = [], []
    monkeypatch.setattr(chain_graphs, "value", lambda v: values.append(v) or id(v))
    monkeypatch.setattr(chain_graphs, "run", lambda key, issue: keys.append(key) or True)
    chain = type("C", (), {"engine": type("E", (), {"key": "engine"})(), "words": object(),
                           "graph_key": None, "publish": (object(), 8), "published": True,
                           "on_device": True})()
    pending = [(chain, _Issuer(("arguments",)), None, settings.NO_STALL, 0, 1)]
    for _ in range(2):
        launch._enqueue(pending)
    assert len(values) == 2 and keys[0][-1][0] is keys[1][-1][0]
    chain.publish = (object(), 8)
    launch._enqueue(pending)
    assert len(values) == 4 and keys[2][-1][0] != keys[0][-1][0]


class _Issuer:
    """A pass issuer (``launch.PassIssuer``) whose launches do nothing, keyed by ``key`` (``None``:
    never a graph)."""

    def __init__(self, key: tuple | None = None):
        self.key = key

    def issue_launch(self, data, start, stall):
        pass

    def issue_completion(self, data):
        pass

    def arguments_key(self, data):
        return self.key


class _Chain:
    """What ``run_chain`` and ``_chain_key`` read of a chain (emulated words, a ring)."""

    def __init__(self):
        self.words, self.ring = np.zeros(8, np.uint32), launch.RecordRing(np, 1)
        self.engine = type("E", (), {"key": "engine", "emulated": True})()
        self.recorded, self.graph_key, self.untouched, self.groups = 0, None, True, 1
        self.on_device = True  # (as device words: their chains may be graphs)

    def new_ring(self):  # (``Chain.new_ring``: a new numbering)
        self.ring, self.recorded = launch.RecordRing(np, 1), 0
        return self.ring


def test_one_graph_enqueues_its_chains_as_one_unit(monkeypatch, stub_chains):
    """``launch.one_graph``: the chains given inside the block are issued at its end, in order,
    as one graph keyed by every chain's key (one replay: one launch); each pass is numbered for
    its record when it is given (a chain given twice: two numbers)."""
    issued, keys = [], []
    stub_chains(lambda chain, *a: issued.append(chain))
    monkeypatch.setattr(chain_graphs, "value", id)

    def run(key, issue):  # (a capture: the unit's chains issued once, then a graph launched)
        keys.append(key)
        issue()
        return True
    monkeypatch.setattr(chain_graphs, "run", run)
    a, b = _Chain(), _Chain()
    with launch.counting() as counted:
        with launch.one_graph():
            for chain, seq in ((a, 1), (b, 1), (a, 2)):
                launch.run_chain(chain, _Issuer(("arguments",)), None, 0, 4, settings.NO_STALL,
                                 "")
                assert issued == [] and chain.recorded == seq
    assert issued == [a, b, a] and len(keys) == 1 and len(keys[0]) == 3 + 3
    assert (counted.graph_units, counted.graph_launches) == (1, 1)
    with launch.counting() as counted:  # (outside a block: a unit a chain)
        launch.run_chain(b, _Issuer(("arguments",)), None, 0, 4, settings.NO_STALL, "")
    assert (counted.graph_units, len(keys), b.recorded) == (1, 2, 2)


def test_a_one_graph_block_left_by_an_exception_enqueues_nothing(monkeypatch, stub_chains):
    """A block an exception leaves issues none of its chains, which start a new ring (their
    numbering ran ahead of the device) and fill their progress words anew."""
    issued = []
    stub_chains(lambda chain, *a: issued.append(chain))
    a = _Chain()
    with pytest.raises(RuntimeError):
        with launch.one_graph():
            launch.run_chain(a, _Issuer(), None, 0, 4, settings.NO_STALL, "")
            raise RuntimeError("a planned call failed part way")
    assert issued == [] and a.ring is None and not a.untouched
    launch.run_chain(a, _Issuer(), None, 0, 4, settings.NO_STALL, "")  # (later: as before)
    assert issued == [a] and a.ring is not None and a.recorded == 1


class _FakeCupy:
    """What ``chain_graphs._capture`` calls of CuPy: a stream that captures (``begin_capture``,
    ``end_capture`` giving a ``_Graph``) and the thread's allocator (``using_allocator``), which
    ``alloc`` calls as CuPy's arrays do."""

    def __init__(self):
        self.cuda, self.allocator, self.captures = self, None, []

    def Stream(self, non_blocking=False):  # noqa: N802 -- CuPy's name
        fake = self

        class Side:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self):
                fake.captures.append("begin")

            def end_capture(self):
                fake.captures.append("end")
                return _Graph()
        return Side()

    def using_allocator(self, allocator):
        import contextlib

        @contextlib.contextmanager
        def using():
            before, self.allocator = self.allocator, allocator
            try:
                yield
            finally:
                self.allocator = before
        return using()

    def alloc(self, size):
        return self.allocator(size) if self.allocator else size


def test_a_capture_that_would_allocate_runs_the_chain_directly(monkeypatch):
    """A block CuPy's pool handed out during the capture would go back to the pool when the
    capture's temporaries die while every replay still writes it: the capture refuses any
    allocation (that chain then runs launch by launch), and one that allocates nothing is
    captured whole."""
    import sys
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(chain_graphs._side, "streams", {}, raising=False)
    seen = []
    graph = chain_graphs._capture(0, lambda: seen.append(chain_graphs.capturing()))
    assert isinstance(graph, _Graph) and seen == [True] and not chain_graphs.capturing()
    assert fake.captures == ["begin", "end"]
    with pytest.warns(RuntimeWarning, match="a CuPy allocation \\(256 bytes\\)"):
        assert chain_graphs._capture(0, lambda: fake.alloc(256)) is chain_graphs._EAGER
    assert fake.captures[2:] == ["begin", "end"] and fake.allocator is None
    assert fake.alloc(256) == 256  # after the capture the thread's allocator is back


def test_the_ring_on_a_gpu_is_mapped_pinned_memory_seen_by_cupy_at_its_host_address():
    """``launch.RecordRing``'s GPU branch with CuPy 14's own memory classes (``UnownedMemory``,
    ``MemoryPointer``, ``ndarray``: made without a driver) and stand-ins for what needs one
    (``PinnedMemory``: ``cudaHostAlloc``; ``pointerGetAttributes``: unified addressing maps the
    block at its host address): the block is asked for mapped and portable, zeroed, the device
    array is the host words at their address and holds the block alive, and the ring remembers
    the stream its device writes are ordered on."""
    import ctypes
    import gc
    import types
    import weakref
    cupy = pytest.importorskip("cupy")
    asked = []

    class Pinned:  # (CuPy 14: PinnedMemory(size, flags=0), .ptr)
        def __init__(self, size, flags=0):
            self.buffer = (ctypes.c_uint8 * size)(*([0xAB] * size))
            self.ptr = ctypes.addressof(self.buffer)
            asked.append((size, flags))
    runtime = cupy.cuda.runtime
    stream = _Stream()
    xp = types.SimpleNamespace(ndarray=cupy.ndarray, cuda=types.SimpleNamespace(
        PinnedMemory=Pinned, UnownedMemory=cupy.cuda.UnownedMemory,
        MemoryPointer=cupy.cuda.MemoryPointer, Device=lambda: types.SimpleNamespace(id=0),
        get_current_stream=lambda: stream, runtime=types.SimpleNamespace(
            hostAllocMapped=runtime.hostAllocMapped, hostAllocPortable=runtime.hostAllocPortable,
            pointerGetAttributes=lambda p: types.SimpleNamespace(devicePointer=p))))
    ring = launch.RecordRing(xp, 3)
    n = 1 + launch.RING_SLOTS * ring.stride
    assert asked == [(4 * n, runtime.hostAllocMapped | runtime.hostAllocPortable)] == [(4 * n, 3)]
    assert ring.host.shape == (n,) and not ring.host.any() and ring.stream is stream
    assert isinstance(ring.device, cupy.ndarray) and ring.device.dtype == np.uint32
    assert ring.device.shape == (n,) and ring.device.data.ptr == ring.host.ctypes.data
    block = weakref.ref(ring._memory)
    device = ring.device
    del ring
    gc.collect()
    assert block() is not None and device.data.mem.ptr == device.data.ptr  # held by the array


def test_a_chain_the_callers_capture_records_is_issued_not_replayed(monkeypatch):
    """``run_chain`` asks the stream whether it is being captured (``Chain.published``);
    ``_enqueue`` reads that answer instead of asking again: a chain under a caller's capture is
    issued launch by launch and never looked up as a graph, a published one is."""
    issued, looked_up = [], []
    monkeypatch.setattr(chain_graphs, "run", lambda key, issue: looked_up.append(key) or True)
    monkeypatch.setattr(launch, "_chain_key", lambda chain: "chain")
    chain = SimpleNamespace(published=False, on_device=True, graph_key=None)  # (device words)
    monkeypatch.setattr(launch, "_issue_chain", lambda *args: issued.append(1))
    pending = [(chain, _Issuer(("arguments",)), None, settings.NO_STALL, 0, 1)]
    launch._enqueue(pending)
    assert issued == [1] and looked_up == []
    chain.published = True
    launch._enqueue(pending)
    assert issued == [1] and len(looked_up) == 1 and looked_up[0][-1][-1] == ("arguments",)
