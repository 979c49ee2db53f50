"""Launching a persistent pass with its restart loop and completion decided on the device.

A call enqueues, per persistent pass, a fixed chain and reads nothing back (``cuda_src/
chain.cuh``, ``device_loop.cu``): a memset, the pass launch, ``max_restarts`` resume launches
(each exits at once when the pass is done) and a one-CTA completion kernel that finishes
whatever the launches left (only after the restart cap; it needs no co-residency). The last CTA
to leave each launch settles it for the next (each group's next step, from the CTAs' progress):
no kernel of its own. So a call never returns a partial result and never synchronises. What
happened (restarts, the completion, a grid found not co-resident) is in the chain's device
record, which the completion publishes into a ring of slots in page-locked host memory
(``RecordRing``: no API call of its own, so a chain replayed as one CUDA graph is one API call
in all) and ``DeviceRecord`` reads lazily, when ``last_run`` is asked for. The residency cooldown (``COOLDOWNS``) learns of a grid found not
co-resident from a count the device keeps in the same ring, at the next call of the same
configuration, without blocking.

``COUNTERS`` / ``counting()`` count what the runtime paths do: host synchronisations
(device-to-host reads of control words or records that wait for the device), kernel launches and
memsets, so that tests hold a steady-state call to 0 synchronisations.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from . import buffers, chain_graphs, settings
from ._sources import cuda_src_dir
from .stats import RunStats

Array = Any

RESUME = np.int32(-2**31)  # kResumeFromChain: a resume launch reads its start from the chain
LOOP_SOURCE = "device_loop.cu"  # the completion kernels
HEAD = 4                   # record words before the per-group completion starts (device_loop.cu)
DONE, NOT_RESIDENT = 1, 2  # record flags
UNTOUCHED = np.uint32(0xFFFFFFFF)  # progress of a CTA that completed no step (int32 -1)
LEDGER = 2                 # chain words no memset resets: passes recorded, not-resident total
ZEROED = 1                 # after the ledger: the exchange words a restart zeroes (chain.cuh)
SLOT_EXTRA = 2             # a ring slot's words beside the record: its sequence number, twice
RING_SLOTS = 256           # records a chain keeps for the host (a power of two: sequences wrap)
EXCHANGE_ALIGN = 64        # words (256 bytes): each exchange of a chain starts aligned
COMPLETE_THREADS = {False: 256, True: 32}  # GPU, emulation


@dataclass
class Counters:
    """What the runtime paths did since ``reset``: host synchronisations (reads of device words
    that wait for the device), kernel launches (persistent, completion; those enqueued
    while a chain is captured included), memsets and chains launched as one CUDA graph."""

    host_syncs: int = 0
    launches: int = 0
    memsets: int = 0
    allocations: int = 0  # CuPy device allocations (from its pool or not); only under counting()
    record_reads: int = 0  # device records folded into stats (on the GPU: may wait for it)
    graph_launches: int = 0  # chains replayed as one CUDA graph (chain_graphs)
    # units of chains enqueued together (each ``run_chain`` outside ``one_graph``, each such
    # block): what a GPU launches as one CUDA graph where chain graphs apply, on any engine
    graph_units: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    # (both take the lock without ``with``: its context-manager protocol costs half as much again,
    # and every call pays them - bench/snippet_instructions.py)
    def add(self, what: str, n: int = 1) -> None:
        lock = self._lock
        lock.acquire()
        try:
            setattr(self, what, getattr(self, what) + n)
        finally:
            lock.release()

    def unit(self, replayed: bool) -> None:
        """A graph unit enqueued (``_enqueue``), ``replayed`` as one CUDA graph or not: both
        counts in one call and one hold of the lock."""
        lock = self._lock
        lock.acquire()
        try:
            self.graph_units += 1
            self.graph_launches += replayed
        finally:
            lock.release()

    def snapshot(self) -> dict[str, int]:
        return {"host_syncs": self.host_syncs, "launches": self.launches, "memsets": self.memsets,
                "allocations": self.allocations, "record_reads": self.record_reads,
                "graph_launches": self.graph_launches, "graph_units": self.graph_units}


COUNTERS = Counters()


@contextlib.contextmanager
def counting() -> Iterator[Counters]:
    """Count what the runtime does inside the block: yields a ``Counters`` of the difference.
    Where CuPy sees a GPU, its device allocations in this thread are counted too (through
    ``cupy.cuda.using_allocator``); NumPy allocations are not device allocations."""
    before = COUNTERS.snapshot()
    out = Counters()
    try:
        with _counting_allocations():
            yield out
    finally:
        for k, v in COUNTERS.snapshot().items():
            setattr(out, k, v - before[k])


@contextlib.contextmanager
def _counting_allocations() -> Iterator[None]:
    try:
        import cupy
        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or no driver: nothing allocates on a device
        has_gpu = False
    if not has_gpu:
        yield
        return
    allocate = cupy.cuda.get_allocator()

    def counted(size: int):
        COUNTERS.add("allocations")
        return allocate(size)

    with cupy.cuda.using_allocator(counted):
        yield


@dataclass(frozen=True)
class Engine:
    """How a persistent pass runs: its plan, a ``launch`` callable (GPU or emulated module) and
    ``loop``, the module of its completion kernels (``device_loop.cu``); ``key``
    names the configuration on its device (the residency cooldown's key)."""

    pass_plan: Any
    launch: Callable[..., None]
    emulated: bool
    key: tuple = ()
    loop: Callable[..., None] | None = None
    _details: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def detail(self, what: str = "") -> str:
        """What ``last_run.details`` says of a pass on this engine (``what``: which pass, as a
        stack's "stack of 3 layers"), formatted once per engine and ``what``: the plan's
        defines make it a few µs of Python a call."""
        made = self._details.get(what)
        if made is None:
            pp, where = self.pass_plan, "emulated" if self.emulated else "GPU"
            made = self._details[what] = (
                f"{pp.kernel} ({where}{', ' + what if what else ''}): {pp.defines}, grid "
                f"{pp.grid} x {pp.block} threads, {pp.shared_bytes} B shared; restarts and "
                "completion on the device")
        return made


class Cooldowns:
    """Configurations whose grid was found not co-resident (a pass ended on the completion path
    after timeouts while some of its CTAs had not started: another stream held SMs), and when.
    For ``Settings.residency_cooldown_s`` after that such a configuration goes straight to the
    GEMM path instead of paying the timeouts again. The device counts such passes per chain in
    the first word of the chain's record ring (``RecordRing``), which ``reason`` reads for every
    ring of the configuration - a word of host memory, no API call, no record decoded, no wait -
    and a count grown since the last look starts the cooldown."""

    def __init__(self) -> None:
        self._since: dict[tuple, float] = {}
        self._rings: dict[tuple, tuple[weakref.ref, ...]] = {}  # per key, while they live
        self._lock = threading.RLock()  # (a ring's end, a weakref callback, may come under it)

    def start(self, key: tuple) -> None:
        with self._lock:
            self._since[key] = time.monotonic()

    def watch(self, key: tuple, ring: "RecordRing") -> None:
        """Read ``ring``'s count of not co-resident passes at every ``reason(key)`` while the
        ring lives."""
        with self._lock:
            ref = weakref.ref(ring, lambda gone, key=key: self._forget(key, gone))
            self._rings[key] = self._rings.get(key, ()) + (ref,)

    def _forget(self, key: tuple, gone: weakref.ref) -> None:
        with self._lock:
            left = tuple([ref for ref in self._rings.get(key, ()) if ref is not gone])
            if left:
                self._rings[key] = left
            else:
                self._rings.pop(key, None)

    def reason(self, key: tuple) -> str | None:
        """Why ``key`` runs on the GEMM path now (``None``: try the persistent kernel)."""
        if not self._since and not self._rings:  # (dict reads are atomic)
            return None
        for ref in self._rings.get(key, ()):  # (a tuple: replaced, never changed, by watch)
            ring = ref()
            if ring is not None and ring.host.item(0) != ring.taken and ring.take():
                self.start(key)
        # (no lock: a dict read is atomic; and no second hash of the long key while no
        # configuration has a cooldown recorded, as in every call of a run that never saw one)
        since = self._since.get(key) if self._since else None
        if since is None:
            return None
        cooldown = settings.current().residency_cooldown_s
        ago = time.monotonic() - since
        if ago >= cooldown:
            return None
        return (f"grid not co-resident {ago:.1f} s ago (another stream held SMs): GEMM path "
                f"until residency_cooldown_s ({cooldown:g} s) has passed")

    def clear(self) -> None:
        """Forget every cooldown, and the not co-resident passes the rings have counted so far."""
        with self._lock:
            rings = [ref() for refs in self._rings.values() for ref in refs]
        for ring in rings:
            if ring is not None:
                ring.take()
        with self._lock:
            self._since.clear()


COOLDOWNS = Cooldowns()


def to_host(a: Array) -> np.ndarray:
    """A host copy of device words (NumPy: itself); counted as a host synchronisation."""
    COUNTERS.add("host_syncs")
    return a if isinstance(a, np.ndarray) else a.get()


def capturing(a: Array) -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph (never for NumPy)."""
    if isinstance(a, np.ndarray):
        return False
    import cupy
    return cupy.cuda.get_current_stream().is_capturing()


class RecordRing:
    """Where a chain's completion kernel publishes each pass's record (``prnn_publish_record``,
    device_loop.cu): ``RING_SLOTS`` slots the device writes directly - on the GPU page-locked host
    memory, which unified addressing maps into every device at its host address; in the emulation
    a NumPy array - so that reading a record is no API call. Its first word is the count of the
    chain's passes that ended on the completion with the grid not co-resident (``Cooldowns``);
    then pass ``seq`` (1, 2, ... in the order of the chain's stream: the device numbers them,
    ``Chain.ledger``) goes to slot ``seq % RING_SLOTS`` between two copies of ``seq`` (a
    seqlock: ``fetch``). The ring belongs to one chain and stays at one address, so a chain
    graph's key repeats call after call."""

    def __init__(self, xp, groups: int):
        self.stride = HEAD + groups + SLOT_EXTRA
        n = 1 + RING_SLOTS * self.stride
        self.stream = None  # where the device writes it (a wait synchronises it)
        if xp is np:
            self.host = self.device = np.zeros(n, np.uint32)
        else:
            self._memory = xp.cuda.PinnedMemory(4 * n, xp.cuda.runtime.hostAllocMapped
                                                | xp.cuda.runtime.hostAllocPortable)
            self.host = np.frombuffer((ctypes.c_uint32 * n).from_address(self._memory.ptr),
                                      np.uint32)
            self.host.fill(0)
            pointer = xp.cuda.runtime.pointerGetAttributes(self._memory.ptr).devicePointer
            memory = xp.cuda.UnownedMemory(pointer, 4 * n, self._memory, xp.cuda.Device().id)
            self.device = xp.ndarray((n,), np.uint32, xp.cuda.MemoryPointer(memory, 0))
            self.stream = xp.cuda.get_current_stream()
        self.taken = 0  # the count of not co-resident passes the cooldowns have taken
        self._lock = threading.Lock()

    def fetch(self, seq: int) -> list[int] | None | bool:
        """The words of pass ``seq``'s record (``HEAD + groups``), ``False`` while it is not
        written yet, ``None`` once a later pass has overwritten it (or is overwriting it: the two
        copies of the number differ)."""
        h, at = self.host, 1 + (seq % RING_SLOTS) * self.stride
        after = int(h[at + self.stride - 1])
        if after != seq:
            return None if (after - seq) % 2**32 < 2**31 else False
        words = h[at + 1:at + self.stride - 1].tolist()
        return words if int(h[at]) == seq else None

    def take(self) -> bool:
        """Whether the device has counted a not co-resident pass since the last ``take``."""
        with self._lock:
            count = self.host.item(0)
            if count == self.taken:
                return False
            self.taken = count
            return True

    def wait(self) -> None:
        """Wait for the device to have written every record enqueued so far (counted)."""
        COUNTERS.add("host_syncs")
        if self.stream is not None:
            self.stream.synchronize()


class DeviceRecord:
    """The record of one pass's chain (restarts, completion per group, flags): pass ``seq`` of
    ``ring``, decoded on first ``poll`` or ``read`` that finds it written. ``poll`` never
    blocks; ``read`` waits for the device (a counted sync) if it has not got there. A record a
    later pass overwrote before anyone read it decodes as ``lost`` (``RING_SLOTS`` later passes
    of the same chain were enqueued first; the cooldowns do not read records: ``Cooldowns``)."""

    def __init__(self, ring: RecordRing, seq: int, groups: int, end: int, group: str = ""):
        self.ring, self.seq, self.groups, self.end, self.group = ring, seq, groups, end, group
        self._decoded: dict | None = None

    def poll(self) -> bool:
        """Decode the record if the device has written it (no wait); whether it is decoded."""
        if self._decoded is None:
            words = self.ring.fetch(self.seq)
            if words is False:
                return False
            self._decode(words)
        return True

    def read(self) -> dict:
        """The decoded record: ``restarts``, ``completed_from`` (per group, ``end``: none),
        ``not_resident``, ``lost``; waits for the device if it has not finished (counted)."""
        COUNTERS.add("record_reads")
        if not self.poll():
            self.ring.wait()
            if not self.poll():  # (the stream has passed the chain: its record must be there)
                self._decode(None)
        return self._decoded  # type: ignore[return-value]

    def __call__(self, stats: RunStats) -> None:
        """Fold the decoded record into ``stats`` (``RunStats.awaiting``'s fold): restarts,
        launches, fallback."""
        r = self.read()
        if r["lost"]:
            stats.details.append(f"the device record of this pass was overwritten before it was "
                                 f"read ({RING_SLOTS} later passes of its chain came first): its "
                                 "restarts and completion are not known")
            return
        stats.restarts += r["restarts"]
        stats.launches += r["restarts"]
        last = self.end - (1 if self.end > 0 else -1)
        left = [(f"{self.group} {g} " if self.group else "") + f"steps {s}..{last}"
                for g, s in enumerate(r["completed_from"]) if s != self.end]
        if left:
            stats.fallback = (f"barrier timeouts: {r['restarts']} restarts, "
                              + ", ".join(left) + " finished by the completion kernel")
            if r["not_resident"]:
                stats.fallback += ("; the grid was not co-resident (another stream held SMs): "
                                   "GEMM path for this configuration for "
                                   f"{settings.current().residency_cooldown_s:g} s")

    def _decode(self, words: list[int] | None) -> None:
        g = self.groups
        with _DECODING:
            if self._decoded is not None:
                return
            if words is None:
                self._decoded = {"restarts": 0, "completions": 0, "completed_from": [self.end] * g,
                                 "not_resident": False, "lost": True}
                return
            # The per-group starts are written only when the completion ran (``completions``).
            completed = ([_int32(v) for v in words[HEAD:HEAD + g]] if words[2]
                         else [self.end] * g)
            self._decoded = {"restarts": words[0], "completions": words[2],
                             "completed_from": completed,
                             "not_resident": bool(words[1] & NOT_RESIDENT), "lost": False}


# Every record's decoding (``DeviceRecord._decode``): one lock for all (each record decodes once,
# when its stats are read), not one made by every call.
_DECODING = threading.Lock()


def _int32(word: int) -> int:
    """A uint32 word's value as int32."""
    return word - (1 << 32) if word >= 1 << 31 else word


class Chain:
    """The device words of one pass's chain (record, control words, starts, ledger;
    cuda_src/chain.cuh), the pass's tagged exchange buffers, the ring its records go to
    (``RecordRing``, made by the first pass that records one) and the launches that drive it.

    The exchanges (``exchanges``: their shapes, uint32 words) lie in the same allocation just
    before the words, each padded to ``EXCHANGE_ALIGN`` words, so that ``reset``'s memset
    zeroes them with the record and the counters: a chain reused call after call
    (``chain_for``) starts every pass from zeroed exchanges, also after a stalled or aborted
    one, without an allocation. (An exchange must start zeroed: tag 0 is never published, so
    no launch of the pass can take a stale word for one it waits on. A cluster kernel keeps its
    exchange in shared memory and never reads this one.) ``restart_zeroes``: whether a restart
    zeroes them too (the settle, chain.cuh: a layer's exchanges by step parity; not a stack's,
    one slot per step, whose finished layers' words a restarted layer above still reads).

    The progress words are left "untouched" by every launch's settle, so the memset need not
    reset them: they are filled so when the chain is made, and by ``reset`` only after a pass
    whose enqueueing failed part way (``run_chain``: its launches may or may not have run).

    The ledger (after ``starts``; no memset resets it) numbers the passes that published a
    record; ``recorded`` counts the same passes on the host - the calls of a chain are ordered
    on its stream (``chain_for``) - so pass ``recorded`` of the host is the device's pass of that
    number, whose record is in that slot of the ring (``run_chain``'s stats)."""

    # whether the words are device memory, which a CUDA graph may replay (``_enqueue``; a CuPy
    # chain's own attribute, a NumPy chain's the class's)
    on_device = False

    def __init__(self, xp, engine: Engine, groups: int,
                 exchanges: tuple[tuple[int, ...], ...] = (), restart_zeroes: bool = True):
        grid = engine.pass_plan.grid
        self.engine, self.groups, self.grid = engine, groups, grid
        sizes = [math.prod(shape) for shape in exchanges]
        padded = [-(-n // EXCHANGE_ALIGN) * EXCHANGE_ALIGN for n in sizes]
        self._lead = sum(padded)
        self._buffer = xp.empty(self._lead + HEAD + groups + 2 + grid + groups + LEDGER
                                + ZEROED, dtype=np.uint32)
        self._buffer[-1] = self._lead if restart_zeroes else 0
        self._progress = self._buffer[self._lead + HEAD + groups + 2:][:grid]
        self._progress.fill(UNTOUCHED)
        offsets = list(itertools.accumulate([0] + padded[:-1]))
        self.exchanges = tuple(self._buffer[o:o + n].reshape(shape)
                               for o, n, shape in zip(offsets, sizes, exchanges))
        self.words = self._buffer[self._lead:]
        self.control = self.words[HEAD + groups:]
        self.starts = self.words[HEAD + groups + 2 + grid:-LEDGER - ZEROED].view(np.int32)
        self.ledger = self.words[-LEDGER - ZEROED:-ZEROED]
        self.recorded = 0     # passes that published a record (``run_chain``)
        self.published = False  # whether the last pass did (not under a user's capture)
        self.ring: RecordRing | None = None  # made by the first pass that records (``new_ring``)
        self.graph_key: tuple | None = None  # (ring, key part): ``_chain_key``
        if not isinstance(self.words, np.ndarray):
            self.on_device = True
        self.untouched = True  # whether the progress words are "untouched" now (``reset``)
        # where the completion publishes the record: the ring, or nowhere (``run_chain``)
        self.publish: tuple[Array, int] = (self.words, 0)

    def new_ring(self) -> RecordRing:
        """A new ring for this chain's records and a new numbering: the ledger zeroed (on the
        chain's stream, before any pass that records into the ring). Never under a user's
        capture; again after a pass whose enqueueing failed part way (``run_chain``: its completion
        may or may not be on the stream)."""
        self.ledger.fill(0)
        self.ring = RecordRing(buffers.array_module(self.words), self.groups)
        self.recorded = 0
        COOLDOWNS.watch(self.engine.key, self.ring)
        return self.ring

    def reset(self) -> None:
        """Exchanges, record and counters zero: one memset on the stream; a second fills the
        progress words "untouched" where no settle has left them so (``untouched``)."""
        w, head = self._buffer, self._lead + HEAD + self.groups + 2
        fill = not self.untouched
        COUNTERS.add("memsets", 1 + fill)
        self.untouched = True
        if isinstance(w, np.ndarray):  # (fill: no temporary array)
            w[:head].fill(0)
            if fill:
                self._progress.fill(UNTOUCHED)
            return
        import cupy
        stream = cupy.cuda.get_current_stream().ptr
        cupy.cuda.runtime.memsetAsync(w.data.ptr, 0, 4 * head, stream)
        if fill:
            cupy.cuda.runtime.memsetAsync(self._progress.data.ptr, 0xFF, 4 * self.grid, stream)

    def complete(self, kernel: str, **named: Any) -> None:
        """Launch a completion kernel (``prnn_complete_*``, device_loop.cu) with ``named``
        arguments (the chain's own are added: its words and where it publishes the record,
        ``publish``)."""
        ring, slots = self.publish
        self._loop(kernel, COMPLETE_THREADS[self.engine.emulated], chain=self.words,
                   groups=self.groups, grid=self.grid, ring=ring, slots=slots, **named)

    def _loop(self, kernel: str, threads: int, **named: Any) -> None:
        COUNTERS.add("launches")
        keep_alive(self.words, *named.values())
        extra = {"max_resident": 1} if self.engine.emulated else {}
        self.engine.loop(kernel, 1, threads, 0, arguments(LOOP_SOURCE, kernel, **named), **extra)


def chain_for(xp, engine: Engine, groups: int, exchanges: tuple[tuple[int, ...], ...] = (),
              restart_zeroes: bool = True) -> Chain:
    """The ``Chain`` (words and exchanges) a pass of ``engine`` runs with: in steady state the
    same one call after call, per thread and stream (``buffers.reused``: concurrent calls never
    share one; under a user's CUDA stream capture a new one, which ``keep_alive`` holds with
    the graph). Its ``reset``, the chain's first operation, zeroes what a pass reads.
    ``restart_zeroes``: ``Chain``'s."""
    # (keyed by the engine object, not its ``key``: a re-planned engine of the same key may
    # differ, e.g. in shared bytes; the chain holds its engine, so the id is not reused)
    return buffers.reused(xp, ("chain", id(engine), groups, exchanges, restart_zeroes),
                          lambda: Chain(xp, engine, groups, exchanges, restart_zeroes))


def timeout_ns(emulated: bool) -> int:
    """A kernel's bounded wait, in ns: the setting for the emulation or for the GPU."""
    s = settings.current()
    return int((s.emulation_timeout_ms if emulated else s.gpu_timeout_ms) * 1e6)


def launch_pass(engine: Engine, control: Array, named: dict, stall: settings.Stall) -> None:
    """Launch ``engine``'s pass with its kernel's ``named`` arguments (``arguments``) plus the
    control words, the timeout (``timeout_ns``) and ``stall``."""
    s, p = settings.current(), engine.pass_plan
    extra = {"max_resident": s.emulation_max_resident} if engine.emulated else {}
    block, step, ns = stall.arguments
    args = arguments(p.source, p.kernel, **named, control=control,
                     timeout_ns=timeout_ns(engine.emulated), stall_block=block, stall_step=step,
                     stall_ns=ns)
    COUNTERS.add("launches")
    keep_alive(control, *named.values())
    engine.launch(p.kernel, p.grid, p.block, p.shared_bytes, args, **extra)


_CAPTURED: list[Array] = []
_CAPTURED_LOCK = threading.Lock()


def keep_alive(*arrays: Any) -> None:
    """Under CUDA stream capture, hold the device arrays a captured launch uses (the graph reads
    and writes them on every replay, so they must outlive it; CuPy would otherwise return them
    to its pool when the call's references go). ``release_captured`` lets them go."""
    if not arrays or getattr(_OWN_CAPTURE, "active", False) or not capturing(arrays[0]):
        return
    with _CAPTURED_LOCK:
        _CAPTURED.extend(a for a in arrays if not isinstance(a, (int, np.generic)))


def release_captured() -> int:
    """Let go of the arrays held for captured launches (call once every graph that captured a
    persistent_rnn call is destroyed); returns how many were held."""
    with _CAPTURED_LOCK:
        n = len(_CAPTURED)
        _CAPTURED.clear()
    return n


def chain_launches(max_restarts: int) -> int:
    """Kernel launches ``run_chain`` enqueues per pass: the pass, ``max_restarts`` resume
    launches and the completion (each launch's settle is done by its last CTA: chain.cuh; held
    by tests against ``counting``; the latency model's per-call term counts them)."""
    return max_restarts + 2


CHAIN_MEMSETS = 1  # Chain.reset in steady state (the record reaches the host from the completion)


class PassIssuer(Protocol):
    """What ``run_chain`` enqueues of one pass, given a call's ``data`` (the issuer's own: a
    prepared pass's arrays by role, ``runtime.PreparedPass``; a stack pass's, ``stack``). One
    object serves its every call: nothing is made per call to carry them."""

    def issue_launch(self, data: Any, start: Any, stall: settings.Stall) -> None:
        """Launch the pass (``start``: its first start, then ``RESUME``)."""

    def issue_completion(self, data: Any) -> None:
        """Launch the pass's completion kernel (``Chain.complete``)."""

    def arguments_key(self, data: Any) -> tuple | None:
        """A key of every argument the pass's and the completion's launches take beyond the
        chain's own (``chain_graphs.arguments_key``); ``None``: the chain is never a graph."""


def run_chain(chain: Chain, issuer: PassIssuer, data: Any, first: int, end: int,
              stall: settings.Stall, detail: str, captured: bool | None = None,
              group: str = "") -> RunStats:
    """Enqueue the whole chain of a pass with a call's ``data``: ``issuer.issue_launch`` launches
    the pass (``first``, then ``RESUME``), ``issuer.issue_completion`` the completion kernel
    (``Chain.complete``). Nothing is read back. With a key (``issuer.arguments_key``), a chain
    seen before is replayed as one CUDA graph (``chain_graphs``). Outside a user's capture the
    completion publishes the record (``Chain.recorded`` counts it). Inside ``one_graph`` the
    chain is enqueued with the block's others at its end, all of them one graph. ``captured``:
    whether the stream is being captured, where the caller has just asked it (a call plan's
    check: ``call_plans._where``); ``None``: ``run_chain`` asks (on a GPU an API call).

    Returns the pass's stats: the persistent kernel, one launch, ``detail``; its record
    (restarts, launches, fallback) read lazily (``RunStats.awaiting``). Under CUDA stream capture
    nothing is recorded (the details say so). ``group``: what a group is called in ``fallback``
    ("layer" in a stack; "": one pass)."""
    record = chain.published = not (capturing(chain.words) if captured is None else captured)
    # where the completion publishes the record: the ring, or under a user's capture nowhere
    # (the chain's own words, with no slots: never written)
    chain.publish = ((chain.ring or chain.new_ring()).device, RING_SLOTS) if record \
        else (chain.words, 0)
    # (a tuple - nothing else made per call: a replay never issues the chain launch by launch)
    pending = (chain, issuer, data, stall, first, end)
    block = _GROUP.pending
    if block is None:
        _enqueue((pending,))
    else:
        block.append(pending)
    emulated = chain.engine.emulated
    if not record:
        return RunStats(algo="persistent", emulated=emulated, launches=1, details=[
            detail, "captured: restarts and completion run on the device at replay; last_run "
                    "does not report them"])
    chain.recorded += 1  # (in a group before it is enqueued: the pass is numbered now)
    return RunStats.awaiting("persistent", emulated, 1, [detail], DeviceRecord(
        chain.ring, chain.recorded % 2**32, chain.groups, end, group))


class _Group(threading.local):
    """Per thread: the chains of the enclosing ``one_graph``, or None (a class default: a thread
    that never entered a block reads it without the exception ``getattr``'s default costs)."""

    pending: list | None = None


_GROUP = _Group()


class one_graph:  # noqa: N801 -- used as a function: ``with launch.one_graph():``
    """The chains ``run_chain`` is given inside the block are enqueued together at its end, in
    their order, as one unit: one CUDA graph replayed in one launch where chain graphs apply
    (``chain_graphs``), counted once in ``Counters.graph_units`` - a planned call of several
    chains (``stack_plans``) is one graph launch a pass. Nothing in the block may wait for their
    results (nothing runs before its end); a block inside another is part of the outer one. A
    block left by an exception enqueues nothing (its chains' rings start anew: ``new_ring``).
    (A class, not a generator: two Python calls a block.)"""

    def __enter__(self) -> None:
        self.pending = None if _GROUP.pending is not None else []
        if self.pending is not None:
            _GROUP.pending = self.pending

    def __exit__(self, kind, exc, traceback) -> None:
        pending = self.pending
        if pending is None:  # (inside another block: enqueued at its end)
            return
        _GROUP.pending = None
        if kind is not None:
            _failed(pending)
        elif pending:
            _enqueue(pending)


def _enqueue(pending: Sequence[tuple]) -> None:
    """Enqueue ``pending``'s chains (``run_chain``'s tuples) in order: replayed as one graph where
    every one has a key and the stream may take graphs (not capturing: ``Chain.published``, as
    ``run_chain`` found the stream; device words, ``Chain.on_device``; the ``chain_graphs``
    setting on), else issued launch by launch."""
    try:
        replayed = False
        first = pending[0][0]
        s = settings.current()
        if first.published and first.on_device and s.chain_graphs:
            key = [s.cooperative, s.max_restarts, s.gpu_timeout_ms]
            for chain, issuer, data, stall, first, end in pending:  # (no comprehension's frame)
                arguments = issuer.arguments_key(data)
                if arguments is None:
                    key = None
                    break
                key.append((_chain_key(chain), stall.arguments, first, end, arguments))
            if key is None:
                _issue(pending)
            else:
                replayed = chain_graphs.run(tuple(key), partial(_holding_nothing, pending))
        else:
            _issue(pending)
    except BaseException:
        COUNTERS.unit(False)
        _failed(pending)
        raise
    COUNTERS.unit(replayed)


def _issue(pending: Sequence[tuple]) -> None:
    """Issue ``pending``'s chains launch by launch, in order (``_issue_chain``)."""
    for chain, issuer, data, stall, first, _ in pending:
        _issue_chain(chain, issuer, data, first, stall)


def _failed(pending: Sequence[tuple]) -> None:
    """After ``pending``'s enqueueing failed part way (or never began): their chains' next passes
    start a new ring and numbering, and fill their progress words anew (``Chain.reset``: the
    launches may have left some behind)."""
    for chain, *_ in pending:
        chain.ring = None
        chain.untouched = False


def _chain_key(chain: Chain) -> int:
    """The chain's own part of its graph key (``_enqueue``): its engine, words (its exchanges
    lie before them, in the same allocation) and where it publishes - fixed for the chain's
    life but for the ring (``new_ring``), so it is built again only when that is another
    object; its ``chain_graphs.Fixed.token``."""
    held, publish = chain.graph_key, chain.publish
    if held is None or held[0] is not publish[0]:
        held = chain.graph_key = (publish[0], chain_graphs.Fixed((
            chain.engine.key, chain_graphs.value(chain.words), chain_graphs.value(publish))).token)
    return held[1]


def _issue_chain(chain: Chain, issuer: PassIssuer, data: Any, first: int,
                 stall: settings.Stall) -> None:
    chain.reset()
    issuer.issue_launch(data, first, stall)
    for _ in range(settings.current().max_restarts):
        issuer.issue_launch(data, RESUME, settings.NO_STALL)
    issuer.issue_completion(data)


_OWN_CAPTURE = threading.local()


def _holding_nothing(pending: Sequence[tuple]) -> None:
    """``_issue(pending)`` as the library's own capture: ``keep_alive`` holds no arrays for it (a
    chain graph is keyed by the addresses of the call that replays it, not tied to arrays).
    Given to ``chain_graphs.run`` as a ``partial`` (no closure made on every call: a replay
    never runs it)."""
    _OWN_CAPTURE.active = True
    try:
        _issue(pending)
    finally:
        _OWN_CAPTURE.active = False


_SCALAR_TYPES = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64,
                 "unsigned long long": np.uint64, "float": np.float32}


@lru_cache(maxsize=None)
def parameters(source: str, kernel: str) -> tuple[tuple[str, type | None], ...]:
    """The parameters of ``kernel`` in ``cuda_src/<source>``, read from its declaration: per
    parameter its name and its NumPy scalar type (``None``: a pointer, an array is passed)."""
    text = re.sub(r"//[^\n]*", "", (cuda_src_dir() / source).read_text())
    match = re.search(rf"PRNN_KERNEL\s+void\s+(?:\w+\s+)*{kernel}\s*\(([^)]*)\)", text)
    if match is None:
        raise ValueError(f"{source} declares no kernel {kernel!r}")
    params = []
    for declaration in match.group(1).split(","):
        words = declaration.replace("*", " * ").split()
        name, kind = words[-1], " ".join(w for w in words[:-1] if w != "const")
        params.append((name, None if "*" in kind else _SCALAR_TYPES[kind]))
    return tuple(params)


def arguments(source: str, kernel: str, **named: Any) -> tuple:
    """``kernel``'s arguments in its parameter order, from ``named`` (one value per parameter,
    scalars converted to the parameter's type). Raises TypeError naming what is missing or
    unknown: the builders of every kernel family are checked against the CUDA declaration."""
    params = parameters(source, kernel)
    names = [n for n, _ in params]
    missing, unknown = [n for n in names if n not in named], [n for n in named if n not in names]
    if missing or unknown:
        raise TypeError(f"{kernel}: missing arguments {missing}, unknown arguments {unknown}")
    values = []
    for n, kind in params:  # (a loop, not a generator: no Python frame per argument)
        value = named[n]
        if kind is not None:
            # NumPy scalars are immutable: one per (type, value) serves every launch, where
            # making them cost an allocation each (about 70 a pass)
            key = (kind, value)
            made = _SCALARS_MADE.get(key)
            if made is None:
                if len(_SCALARS_MADE) >= MAX_SCALARS:
                    _SCALARS_MADE.clear()
                made = _SCALARS_MADE[key] = kind(value)
            value = made
        values.append(value)
    return tuple(values)


MAX_SCALARS = 4096  # converted scalars kept (steps and starts vary with the sequences)
_SCALARS_MADE: dict[tuple, Any] = {}
