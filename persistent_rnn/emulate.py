"""CPU emulation of the cuda_src kernels: the same CUDA sources, compiled with g++ for the host.

``get_module(source, defines)`` compiles ``cuda_src/<source>`` with ``-DPRNN_EMULATION`` (so that
``hw.cuh`` takes its primitives from ``emulation.h``) and returns a module whose ``launch`` has the
GPU module's call form. Each CTA runs on one host thread with its CUDA threads as fibers
(docs/emulation.md); CTAs get their own shared memory;
``max_resident`` limits how many CTAs run at once, as on a GPU too busy to hold the whole grid.
It is a test and debug path (``algo="persistent"`` on NumPy arrays), never chosen by ``"auto"``.

The race detector (``run_with_race_detector``; docs/emulation.md) builds the sources named in
``$PRNN_EMU_RACE_DETECTOR`` with ThreadSanitizer, in a child process that has its runtime
preloaded: a pair of accesses that no barrier orders fails the launch with ``RaceError``.

Builds are kept in the verified cache (``cache``, docs/cache.md) under ``<cache>/emulation``,
keyed by a hash of the sources, options and compiler: a library is ``dlopen``ed only after its
digest matches the one recorded when it was built.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from . import cache
from ._sources import cuda_src_dir

# -O1: the emulated runs are as fast as at -O2 (fiber switches and polls dominate them), the
# build takes half as long.
CXX_FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-DPRNN_EMULATION")

# The seeded modes that make the emulated machine weaker than the GPU in one respect each (bit i
# of emulation.h's Mode is MODES[i]; docs/emulation.md "Weaker than the hardware"):
MODES = (
    "shuffle",      # CTAs start in a random order (CUDA promises none)
    "realtime",     # %globaltimer is host wall time (default: a virtual clock that stands still
                    # while any resident CTA works, so a busy host never turns a run into restarts)
    "jumpy_timer",  # the timer in 1 us steps with random forward jumps (preemption)
    "schedule",     # random fiber order, a random lagging warp, fiber switches at shared-memory
                    # accesses, random mid-step CTA stalls
    "late_copies",  # cp.async completes only at its wait, its destination NaN until then
    "delayed",      # relaxed and cluster stores land after a random delay (per address in
                    # order); a reader yields between the words of a quad
)

# The race detector: the kernel sources (stems, or "all") built with ThreadSanitizer, and the file
# prefix its reports go to (the child process's log is <prefix>.<pid>); run_with_race_detector
# sets both.
RACE_DETECTOR_ENV = "PRNN_EMU_RACE_DETECTOR"
RACE_LOG_ENV = "PRNN_EMU_RACE_LOG"
_TSAN_FLAGS = ("-fsanitize=thread", "-g1", "-DPRNN_EMU_TSAN")

# Synchronous launches run one at a time (the modes' launch count and the race detector's log are
# the process's); an asynchronous one (launch_async) runs beside them: the launcher keeps each
# launch's own state apart (emulation_launch.h).
_LAUNCH_LOCK = threading.Lock()
_ASYNC_LOCK = threading.Lock()
_running: set["AsyncLaunch"] = set()  # asynchronous launches not yet finished
_context = 0  # the emulated device context: reset_context() starts a new one
_BUILD_LOCK = threading.Lock()

_SCALARS = {
    np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
    np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double,
}
# The letters of emulation_launch.h's prnn_emu_signature_<kernel>(), one per kernel parameter.
_CODES = {np.int32: "i", np.uint32: "I", np.int64: "q", np.uint64: "Q", np.float32: "f",
          np.float64: "d"}


_active_modes: tuple[frozenset, int] | None = None  # set inside a modes() block
_launches = 0  # emulated launches since the innermost modes() block began (or the process)


def _parse_modes(names: str) -> frozenset:
    chosen = frozenset(n.strip() for n in names.split(",") if n.strip())
    unknown = chosen - set(MODES)
    if unknown:
        raise ValueError(f"unknown emulation mode(s) {sorted(unknown)}; the modes are {MODES}")
    return chosen


def active_modes() -> tuple[frozenset, int]:
    """The modes and seed of the next emulated launch: those of the innermost ``modes()`` block,
    else ``$PRNN_EMU_MODES`` (comma-separated names) and ``$PRNN_EMU_SEED``."""
    if _active_modes is not None:
        return _active_modes
    return (_parse_modes(os.environ.get("PRNN_EMU_MODES", "")),
            int(os.environ.get("PRNN_EMU_SEED", "0")))


@contextlib.contextmanager
def modes(*names: str, seed: int = 0) -> Iterator[None]:
    """Emulated launches inside run under the named ``MODES`` with random choices drawn from
    ``seed`` (``modes()``: none, whatever the environment says)."""
    global _active_modes, _launches
    chosen = _parse_modes(",".join(names))
    saved = _active_modes, _launches
    _active_modes, _launches = (chosen, seed), 0
    try:
        yield
    finally:
        _active_modes, _launches = saved


@lru_cache(maxsize=None)  # (per launch: a cached answer enters no Python frame)
def _mode_bits(chosen: frozenset) -> int:
    return sum(1 << i for i, name in enumerate(MODES) if name in chosen)


class EmulationError(RuntimeError):
    """The host build of a kernel source failed, or no host compiler exists."""


class ContextReset(EmulationError):
    """A query of an asynchronous launch made before ``reset_context()`` (as cudaStreamQuery on
    a stream of a destroyed context)."""


class RaceError(EmulationError):
    """The race detector saw a pair of accesses to the same memory that nothing orders."""


def host_compiler() -> str:
    """The C++ compiler for the emulation: ``$CXX``, else ``g++``, else ``c++``."""
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise EmulationError("the CPU emulation of the CUDA kernels needs a host C++ compiler "
                         "(g++ 11 or newer, or $CXX); none was found on PATH")


class EmulatedModule:
    """A kernel source compiled for the host; ``launch`` mirrors the GPU module's."""

    def __init__(self, library: Path, kernels: Sequence[str], race_detector: bool = False):
        self._race_log = _race_log() if race_detector else None
        self._lib = ctypes.CDLL(str(library))
        self._lib.prnn_emu_error.restype = ctypes.c_char_p
        self.kernels = tuple(kernels)

    def launch(self, kernel: str, grid: int, block: int, shared_bytes: int, args: tuple,
               max_resident: int | None = None) -> None:
        """Run ``kernel`` over ``grid`` CTAs of ``block`` threads and wait for it to finish.

        Raises TypeError when ``args`` do not match the kernel's parameters, EmulationError
        when the launch deadlocks, overruns its shared memory or outlives the watchdog, and
        RaceError when the race detector (a build it instruments) reported a race."""
        with _LAUNCH_LOCK:
            if self._race_log is None:  # (the hot path of the emulated runs: no calls to spare)
                return self._launch(kernel, grid, block, shared_bytes, args, max_resident)
            seen = _log_size(self._race_log)
            self._launch(kernel, grid, block, shared_bytes, args, max_resident)
            _check_races(self._race_log, seen, kernel)

    def launch_async(self, kernel: str, grid: int, block: int, shared_bytes: int, args: tuple,
                     max_resident: int | None = None) -> "AsyncLaunch":
        """Start ``kernel`` like ``launch`` but on a background host thread - a kernel on a
        stream of its own, running while the caller's launches run (a resident kernel that
        waits for their posts) - and return at once. ``AsyncLaunch.join`` waits (bounded) and
        raises what ``launch`` would. The arrays in ``args`` are kept alive until it ends.
        Under the race detector, a report logged while it ran fails it (and may fail a
        synchronous launch that ran beside it too: the log is the process's)."""
        entry, keep, argv = self._prepare(kernel, grid, block, shared_bytes, args)
        bits, seed = self._draw_modes()
        handle = AsyncLaunch(kernel, args)
        seen = _log_size(self._race_log)

        def run() -> None:
            error = self._run(kernel, entry, argv, bits, seed, (grid, block, shared_bytes,
                                                               max_resident))
            del keep[:]
            try:
                _check_races(self._race_log, seen, kernel)
            except RaceError as exc:
                error = error or str(exc)
            handle._finish(error)

        with _ASYNC_LOCK:
            _running.add(handle)
        handle._thread = threading.Thread(target=run, name=f"prnn-emu-{kernel}", daemon=True)
        handle._thread.start()
        return handle

    def _prepare(self, kernel: str, grid: int, block: int, shared_bytes: int,
                 args: tuple) -> tuple:
        """The checked launch's entry point, the marshalled arguments and what keeps them."""
        if kernel not in self.kernels:
            raise ValueError(f"kernel {kernel!r} is not in this module; it has {self.kernels}")
        for name, value, low, high in (("grid", grid, 1, 2**31 - 1), ("block", block, 1, 1024),
                                       ("shared_bytes", shared_bytes, 0, 2**31 - 1)):
            if not low <= value <= high:
                raise ValueError(f"{kernel}: {name} must be in {low}..{high}, got {value}")
        _check_signature(kernel, self._signature(kernel), args)
        keep, argv = _marshal(args)
        entry = getattr(self._lib, "prnn_emu_launch_" + kernel)
        entry.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p]
        entry.restype = ctypes.c_int
        return entry, keep, argv

    @staticmethod
    def _draw_modes() -> tuple[int, int]:
        """The next launch's mode bits and seed. Each launch draws its own numbers (a restart
        does not replay its launch's choices), the same ones whenever the block of launches is
        replayed from its seed."""
        global _launches
        chosen, seed = active_modes()
        _launches += 1
        return _mode_bits(chosen), hash((seed, _launches)) & (2**64 - 1)

    def _launch(self, kernel: str, grid: int, block: int, shared_bytes: int, args: tuple,
                max_resident: int | None) -> None:
        entry, keep, argv = self._prepare(kernel, grid, block, shared_bytes, args)
        bits, launch_seed = self._draw_modes()
        error = self._run(kernel, entry, argv, bits, launch_seed,
                          (grid, block, shared_bytes, max_resident))
        del keep
        if error is not None:
            raise EmulationError(error)

    def _run(self, kernel: str, entry, argv, bits: int, seed: int, shape: tuple) -> str | None:
        """Run a prepared launch (``shape``: grid, block, shared bytes, max_resident) under its
        modes; the error it ended with, or None."""
        grid, block, shared_bytes, max_resident = shape
        self._lib.prnn_emu_set_modes(ctypes.c_uint(bits), ctypes.c_ulonglong(seed))
        if not entry(grid, block, shared_bytes, max_resident or 0, argv):
            return None
        return f"emulated launch of {kernel} failed: {self._lib.prnn_emu_error().decode()}"

    def _signature(self, kernel: str) -> str:
        fn = getattr(self._lib, "prnn_emu_signature_" + kernel)
        fn.restype = ctypes.c_char_p
        return fn().decode()


class AsyncLaunch:
    """An emulated launch running on a background thread (``EmulatedModule.launch_async``)."""

    def __init__(self, kernel: str, args: tuple):
        self.kernel = kernel
        self._args = args  # the arrays the kernel reads and writes live while it runs
        self._ended = threading.Event()
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._context = _context

    def _finish(self, error: str | None) -> None:
        self._error = error
        self._args = ()
        with _ASYNC_LOCK:
            _running.discard(self)
        self._ended.set()

    def done(self) -> bool:
        """Whether the launch has ended (its kernel exited; a stream query, no waiting).
        ContextReset if ``reset_context()`` has reset its context since it started."""
        if self._context != _context:
            raise ContextReset(f"the emulated launch of {self.kernel} belongs to a context that "
                               "reset_context() reset")
        return self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: until the watchdog ends it) for the launch to
        end; TimeoutError if it is still running, EmulationError if it failed."""
        if not self._ended.wait(timeout):
            raise TimeoutError(f"the emulated launch of {self.kernel} is still running after "
                               f"{timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise EmulationError(self._error)


def running_launches() -> list[AsyncLaunch]:
    """The asynchronous emulated launches that have not ended (tests: nothing left spinning)."""
    with _ASYNC_LOCK:
        return list(_running)


def reset_context(timeout: float = 30.0) -> None:
    """Emulate a reset of the device's context (cudaDeviceReset; a test hook): every running
    asynchronous launch is killed - its array arguments, device memory that the reset frees, are
    overwritten with 0xFF bytes (a resident decoder's CTAs then read a stale mailbox and exit)
    and it is joined (``timeout`` seconds at most) - and every launch made before the reset
    raises ContextReset when queried (``AsyncLaunch.done``). Arrays that no running launch
    holds are left as they are."""
    global _context
    with _ASYNC_LOCK:
        _context += 1
        killed = list(_running)
    for handle in killed:
        for a in handle._args:
            if isinstance(a, np.ndarray) and a.flags.c_contiguous:
                a.view(np.uint8).fill(0xFF)
    for handle in killed:
        handle._ended.wait(timeout)
        if handle._thread is not None:
            handle._thread.join(timeout)


def _check_signature(kernel: str, signature: str, args: tuple) -> None:
    """TypeError unless ``args`` match the kernel's parameters in number and type."""
    if len(args) != len(signature):
        raise TypeError(f"{kernel}: expected {len(signature)} arguments, got {len(args)}")
    for i, (code, arg) in enumerate(zip(signature, args)):
        given = "p" if isinstance(arg, np.ndarray) else _CODES.get(type(arg), type(arg).__name__)
        if given != code:
            want = "an array" if code == "p" else f"np.{np.dtype(code).name}"
            raise TypeError(f"{kernel}: argument {i} must be {want}, got {type(arg).__name__}")


def _marshal(args: tuple) -> tuple[list, ctypes.Array]:
    """One pointer per kernel parameter, to a ctypes copy of its value (kernelParams style)."""
    keep: list = []
    argv = (ctypes.c_void_p * max(len(args), 1))()
    for i, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            if not arg.flags.c_contiguous:
                raise ValueError(f"kernel argument {i}: expected a C-contiguous array")
            value = ctypes.c_void_p(arg.ctypes.data)
        elif type(arg) in _SCALARS:
            value = _SCALARS[type(arg)](arg.item())
        else:
            raise TypeError(f"kernel argument {i}: expected a NumPy array or a NumPy scalar "
                            f"(np.int32, np.uint32, np.uint64, np.float32, ...), got {type(arg).__name__}")
        keep.append(value)
        argv[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
    return keep, argv


def get_module(source: str, defines: Mapping[str, int],
               src_dir: Path | None = None) -> EmulatedModule:
    """The host build of ``cuda_src/<source>`` with ``-D`` ``defines`` (built once, cached).
    ``src_dir``: another copy of cuda_src (the sabotage tests build altered kernels from one).
    ``source`` may also be the absolute path of a kernel outside it (the tests' own kernels,
    tests/cuda), which includes cuda_src's headers.
    A source that ``$PRNN_EMU_RACE_DETECTOR`` names is built with the race detector."""
    return _module(source, tuple(sorted((k, int(v)) for k, v in defines.items())),
                   Path(src_dir or cuda_src_dir()), _race_detected(source))


@lru_cache(maxsize=None)
def _module(source: str, defines: tuple, src_dir: Path, race_detector: bool) -> EmulatedModule:
    if race_detector:
        _require_tsan_runtime(source)  # before the build: a clear error, not minutes later
    with _BUILD_LOCK:
        library, kernels = _build(source, dict(defines), src_dir, race_detector)
    return EmulatedModule(library, kernels, race_detector)


def _build(source: str, defines: dict[str, int], src_dir: Path | None = None,
           race_detector: bool = False) -> tuple[Path, list[str]]:
    """The verified cached library of ``src_dir/source`` (the package's cuda_src by default) with
    ``defines`` (built if missing or bad) and its kernel names; ``race_detector``: instrumented
    with ThreadSanitizer."""
    src_dir = Path(src_dir or cuda_src_dir())
    compiler = host_compiler()
    flags = [*CXX_FLAGS, *(_TSAN_FLAGS if race_detector else ())]
    options = [*flags, f"-I{src_dir}", *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    key = hashlib.sha256("\n".join([compiler, source, (src_dir / source).read_text(), *options,
                                    _sources_digest(src_dir)]).encode()).hexdigest()[:24]
    folder = cache.cache_dir("emulation")

    def build(out: Path) -> dict:
        prelude = _prelude(folder, compiler, src_dir, flags)
        return {"kernels": _compile(compiler, options, src_dir / source, out, prelude),
                "options": options}

    entry = cache.fetch(folder, f"{Path(source).stem}-{key}", ".so", build)
    return entry.path, entry.meta["kernels"]


def _prelude(folder: Path, compiler: str, src_dir: Path, build_flags: list[str]) -> Path:
    """The precompiled prelude of the emulated builds: the C++ and system headers that the
    sources of ``src_dir`` include (parsing them was a third of a build), compiled once per
    compiler, flags (``build_flags``: a build's flags but its -I and -D) and header list into
    the verified cache. Returns the name to ``-include``: the compiler finds ``<name>.gch``
    beside it and needs no header of that name."""
    headers = sorted({name for path in sorted(src_dir.glob("*.h*"))
                      for name in re.findall(r"^\s*#\s*include <([^>]+)>", path.read_text(), re.M)})
    text = "".join(f"#include <{name}>\n" for name in headers)
    flags = [f for f in build_flags if f != "-shared"]
    key = hashlib.sha256("\n".join([compiler, _compiler_version(compiler), *flags, text])
                         .encode()).hexdigest()[:24]

    def build(out: Path) -> dict:
        header = out.with_name(out.name + ".h")  # g++ precompiles only a named file
        header.write_text(text)
        try:
            _run([compiler, *flags, "-x", "c++-header", str(header), "-o", str(out)], "the prelude")
        finally:
            header.unlink()
        return {"headers": headers}

    return cache.fetch(folder, f"prelude-{key}", ".gch", build).path.with_suffix("")


@lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    return _run([compiler, "--version"], "the compiler's version")


def _compile(compiler: str, options: list[str], path: Path, out: Path, prelude: Path) -> list[str]:
    """Build the host library of the kernel source ``path`` into ``out`` (with the precompiled
    ``prelude``); its kernel names."""
    kernels = _kernel_names(compiler, options, path)
    unit = (f'#include "{path}"\n#include "emulation_launch.h"\n'
            + "".join(f"PRNN_EMU_ENTRY({name})\n" for name in kernels))
    # The unit goes through stdin and the library straight to ``out`` (in the cache folder):
    # nothing of ours lands in TMPDIR, which may be on another filesystem.
    _run([compiler, *options, "-include", str(prelude), "-x", "c++", "-", "-o", str(out)],
         path.name, stdin=unit)
    return kernels


def _kernel_names(compiler: str, options: list[str], path: Path) -> list[str]:
    """Names of the PRNN_KERNEL functions of a source, read after preprocessing (macros too)."""
    text = _run([compiler, *[o for o in options if o not in ("-shared", "-fPIC")], "-E", "-P",
                 "-x", "c++", str(path)], path.name)
    names = sorted(set(re.findall(r'extern\s+"C"\s+void\s+(\w+)\s*\(', text)))
    if not names:
        raise EmulationError(f"{path.name}: no PRNN_KERNEL functions found")
    return names


def _run(cmd: list[str], what: str, stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=_compiler_env())
    if proc.returncode != 0:
        raise EmulationError(f"host build of {what} failed ({' '.join(cmd)}):\n{proc.stderr}")
    return proc.stdout


def _compiler_env() -> dict[str, str] | None:
    """The host compiler's environment: this process's (None), but for a preloaded
    ThreadSanitizer runtime (the race detector's child process), which would more than double the
    compiler's time."""
    preload = re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "").strip())
    kept = [p for p in preload if p and not os.path.basename(p).startswith("libtsan")]
    if len(kept) == len([p for p in preload if p]):
        return None
    env = dict(os.environ)
    env.pop("LD_PRELOAD")
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    return env


def _sources_digest(src_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(src_dir.glob("*")):
        if path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


# ---- the race detector ---------------------------------------------------------------------------

def _race_detected(source: str) -> bool:
    """Whether ``$PRNN_EMU_RACE_DETECTOR`` (source stems, comma-separated, or "all") names
    ``source``."""
    named = {n.strip() for n in os.environ.get(RACE_DETECTOR_ENV, "").split(",") if n.strip()}
    return "all" in named or Path(source).stem in named


def tsan_runtime() -> str:
    """The path of the host compiler's ThreadSanitizer runtime (EmulationError if it has none)."""
    path = _run([host_compiler(), "-print-file-name=libtsan.so"], "libtsan.so").strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise EmulationError(f"the host compiler {host_compiler()} has no ThreadSanitizer runtime "
                             "(libtsan.so): the race detector needs one (g++ 11 or newer)")
    return os.path.realpath(path)


def _require_tsan_runtime(source: str) -> None:
    """EmulationError unless this process runs with the ThreadSanitizer runtime loaded first."""
    if not hasattr(ctypes.CDLL(None), "__tsan_init") or not os.environ.get(RACE_LOG_ENV):
        raise EmulationError(
            f"{source} is to be built with the race detector (${RACE_DETECTOR_ENV}), which runs "
            "only in a process started with the ThreadSanitizer runtime preloaded: use "
            "emulate.run_with_race_detector")


def race_detector_env(sources: Sequence[str], log_prefix: Path) -> dict[str, str]:
    """The environment of a child process whose emulated builds of ``sources`` (stems, or "all")
    run under ThreadSanitizer, its reports written to ``<log_prefix>.<pid>``."""
    env = dict(os.environ)
    env.update({
        "LD_PRELOAD": " ".join(filter(None, [tsan_runtime(), env.get("LD_PRELOAD")])),
        # Reports go to the log, which each launch checks (RaceError); the process goes on, so
        # that the error names the launch and its kernel.
        "TSAN_OPTIONS": f"log_path={log_prefix} halt_on_error=0 exitcode=0",
        RACE_DETECTOR_ENV: ",".join(sources),
        RACE_LOG_ENV: str(log_prefix),
    })
    return env


def run_with_race_detector(argv: Sequence[str], sources: Sequence[str] = ("all",),
                           timeout: float | None = None,
                           capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python argv...`` in a child process whose emulated launches of ``sources`` run
    under the race detector (a race fails that launch with ``RaceError``, which names the kernel
    and holds ThreadSanitizer's report); its output is captured (``capture``) or goes to this
    process's. ThreadSanitizer must be loaded before anything else, hence the child process."""
    with tempfile.TemporaryDirectory(prefix="prnn-race-") as folder:
        env = race_detector_env(sources, Path(folder) / "tsan")
        return subprocess.run([sys.executable, *argv], env=env, capture_output=capture,
                              text=True, timeout=timeout)


def _race_log() -> Path:
    return Path(f"{os.environ[RACE_LOG_ENV]}.{os.getpid()}")


def _log_size(log: Path | None) -> int:
    return log.stat().st_size if log is not None and log.exists() else 0


def _check_races(log: Path | None, seen: int, kernel: str) -> None:
    """RaceError if ThreadSanitizer reported anything since the log had ``seen`` bytes."""
    if log is None or _log_size(log) <= seen:
        return
    with open(log, "rb") as f:
        f.seek(seen)
        reports = [r for r in f.read().decode(errors="replace").split("=" * 18 + "\n")
                   if r.strip()]
    raise RaceError(f"the race detector reported {len(reports)} data race(s) in the emulated "
                    f"launch of {kernel} (accesses that no barrier or acquire/release orders); "
                    f"the first:\n{reports[0]}")
