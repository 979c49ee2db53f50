"""Runtime settings (one validated object) and context-local fault injection.

The settings in force are ``current()``: the process-wide settings (the defaults, overridden by
environment variables when first needed, then by ``configure``), or inside a ``with
override_settings(...)`` block the values of that block. Blocks and ``inject_stall`` are held in
``contextvars``, so they apply to the code running in the calling thread (or asyncio task) only:
they neither leak out of the ``with`` block nor reach other threads.

Every value is checked when it is set: ``configure``, ``override_settings`` and ``Settings``
raise ``TypeError`` or ``ValueError`` naming the setting; a malformed environment variable
raises ``ValueError`` naming the variable on the first run that reads the settings (importing the
package never reads them).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator, Mapping

import numpy as np


@dataclass(frozen=True)
class Settings:
    """Runtime settings; environment variables in brackets override the defaults.

    * ``gpu_timeout_ms`` (PRNN_TIMEOUT_MS, 100, > 0): barrier wait before a GPU kernel gives up.
    * ``emulation_timeout_ms`` (PRNN_EMULATION_TIMEOUT_MS, 2000, > 0): the same for the CPU
      emulation, whose threads are scheduled far less predictably.
    * ``max_restarts`` (PRNN_MAX_RESTARTS, 3, >= 0): restarts of a persistent pass after barrier
      timeouts before the completion kernel finishes it on the device (``last_run.restarts``
      counts them).
    * ``cooperative`` (PRNN_COOPERATIVE, off): launch with cudaLaunchCooperativeKernel, which
      guarantees co-residency (or fails to launch) instead of relying on the timeout.
    * ``auto_max_batch`` (PRNN_AUTO_MAX_BATCH, 32, >= 0): largest batch ``algo="auto"`` runs
      persistently (the largest batch measured where the persistent kernel fit and beat GEMM).
    * ``emulation_max_resident`` (PRNN_EMULATION_MAX_RESIDENT, None = all, >= 1): CTAs the
      emulation runs at once (models a busy GPU).
    * ``gemm_graphs`` (PRNN_GEMM_GRAPHS, off): record the CuPy GEMM path's step loops as CUDA
      graphs and replay them (``step_graphs``; off until measured on a GPU).
    * ``chain_graphs`` (PRNN_CHAIN_GRAPHS, on): replay a persistent pass's chain of launches
      (the pass, its restarts and completion) as one CUDA graph where the same call was seen
      before (``chain_graphs``); off, every call enqueues the chain's launches one by one.
    * ``stack`` (PRNN_STACK, on): run a unidirectional stack whose layers fit the register files
      together in one persistent launch per pass (``plan.make_stack_plan``); off, every
      layer-direction is a launch of its own.
    * ``residency_cooldown_s`` (PRNN_RESIDENCY_COOLDOWN_S, 30, >= 0): after a persistent pass
      found its grid not co-resident (another stream held SMs; the completion kernel finished
      it), that configuration runs on the GEMM path for this many seconds before the persistent
      kernel is tried again; 0 tries it on every call.
    * ``max_cluster_ctas`` (PRNN_MAX_CLUSTER_CTAS, None = what the device runs, >= 0): the
      largest thread-block cluster a layer runs as on sm_90 and newer (None: 16 on H100/H200;
      8 keeps to CUDA's portable size, which takes the 8-warp cluster tiles above H 128; 0 runs
      every layer on the grid path).
    * ``allow_tf32`` (PRNN_ALLOW_TF32, off): let a float32 layer's persistent kernels multiply
      W_hh by h_{t-1} (the backward W_hh^T by dgh) on the tensor cores in TF32 (both operands
      rounded to 10-bit mantissas, fp32 sums) where the planner predicts it faster, and take the
      library's float32 GEMMs in TF32 (``matmul.matmul``); the library's counterpart of
      ``torch.backends.cuda.matmul.allow_tf32`` (docs/api.md, "TF32").
    """

    gpu_timeout_ms: float = 100.0
    emulation_timeout_ms: float = 2000.0
    max_restarts: int = 3
    cooperative: bool = False
    auto_max_batch: int = 32
    emulation_max_resident: int | None = None
    gemm_graphs: bool = False
    chain_graphs: bool = True
    stack: bool = True
    residency_cooldown_s: float = 30.0
    max_cluster_ctas: int | None = None
    allow_tf32: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _check(f.name, getattr(self, f.name)))


# name -> (environment variable, kind, smallest value); kind "float" (> smallest) and "int"
# (>= smallest) take numbers, "seconds" a number >= 0, "bool" takes True/False, "int?" an int or None.
_SPEC: dict[str, tuple[str, str, float]] = {
    "gpu_timeout_ms": ("PRNN_TIMEOUT_MS", "float", 0.0),
    "emulation_timeout_ms": ("PRNN_EMULATION_TIMEOUT_MS", "float", 0.0),
    "max_restarts": ("PRNN_MAX_RESTARTS", "int", 0),
    "cooperative": ("PRNN_COOPERATIVE", "bool", 0),
    "auto_max_batch": ("PRNN_AUTO_MAX_BATCH", "int", 0),
    "emulation_max_resident": ("PRNN_EMULATION_MAX_RESIDENT", "int?", 1),
    "gemm_graphs": ("PRNN_GEMM_GRAPHS", "bool", 0),
    "chain_graphs": ("PRNN_CHAIN_GRAPHS", "bool", 0),
    "stack": ("PRNN_STACK", "bool", 0),
    "residency_cooldown_s": ("PRNN_RESIDENCY_COOLDOWN_S", "seconds", 0),
    "max_cluster_ctas": ("PRNN_MAX_CLUSTER_CTAS", "int?", 0),
    "allow_tf32": ("PRNN_ALLOW_TF32", "bool", 0),
}
_RENAMED = {"PRNN_MAX_RELAUNCHES": "PRNN_MAX_RESTARTS"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_MAX_TIMEOUT_MS = 3.6e6  # one hour: a longer barrier wait is a mistake, not a setting
_MAX_SECONDS = 86400.0  # one day: a longer cooldown is "never", which is algo="gemm"


def _check(name: str, value: Any) -> Any:
    """``value`` as setting ``name``'s type, or TypeError/ValueError naming the setting."""
    if name not in _SPEC:
        raise ValueError(f"unknown setting {name!r}; expected one of {sorted(_SPEC)}")
    _, kind, low = _SPEC[name]
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"setting {name} must be a bool, got {type(value).__name__} {value!r}")
        return bool(value)
    if kind == "int?" and value is None:
        return None
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if kind in ("float", "seconds"):
        if not (is_int or isinstance(value, (float, np.floating))):
            raise TypeError(f"setting {name} must be a number, got {type(value).__name__} {value!r}")
        if kind == "float" and not low < value <= _MAX_TIMEOUT_MS:
            raise ValueError(f"setting {name} must be > {low:g} and <= {_MAX_TIMEOUT_MS:g}, got {value!r}")
        if kind == "seconds" and not low <= value <= _MAX_SECONDS:
            raise ValueError(f"setting {name} must be >= {low:g} and <= {_MAX_SECONDS:g}, got {value!r}")
        return float(value)
    if not is_int:
        what = "an int or None" if kind == "int?" else "an int"
        raise TypeError(f"setting {name} must be {what}, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"setting {name} must be >= {low}, got {value!r}")
    return int(value)


def _parse_env(name: str, text: str) -> Any:
    """Setting ``name`` from the text of its environment variable (checked)."""
    variable, kind, _ = _SPEC[name]
    word = text.strip().lower()
    try:
        if kind == "bool":
            if word not in _TRUE + _FALSE:
                raise ValueError(f"expected one of {_TRUE + _FALSE}")
            return word in _TRUE
        if kind == "int?" and word in ("", "none"):
            return None
        value = float(word) if kind in ("float", "seconds") else int(word)
        return _check(name, value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment variable {variable}={text!r} is invalid for setting "
                         f"{name}: {exc}") from None


def from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """The defaults overridden by the ``PRNN_*`` environment variables that are set (non-empty)."""
    environ = os.environ if environ is None else environ
    for old, new in _RENAMED.items():
        if old in environ:
            raise ValueError(f"environment variable {old} was renamed to {new}; set {new} instead")
    values = {name: _parse_env(name, environ[var]) for name, (var, _, _) in _SPEC.items()
              if environ.get(var, "") != ""}
    return Settings(**values)


_process: Settings | None = None  # read from the environment on first use
_process_lock = threading.Lock()
_scoped: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("prnn_settings", default=None)


def current() -> Settings:
    """The settings in force in the calling context."""
    global _process
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    if _process is not None:  # (read without the lock: a reference is replaced whole)
        return _process
    with _process_lock:
        if _process is None:
            _process = from_environment()
        return _process


def configure(**changes: Any) -> Settings:
    """Change settings (names of ``Settings`` fields, checked); returns the settings in force.

    Outside a ``with override_settings(...)`` block the change is process-wide; inside one it lasts
    until the block ends.
    """
    global _process
    updated = replace(current(), **_checked(changes))
    if _scoped.get() is not None:
        _scoped.set(updated)
    else:
        with _process_lock:
            _process = updated
    return updated


@contextlib.contextmanager
def override_settings(**changes: Any) -> Iterator[Settings]:
    """Within the ``with`` block (and this thread or task only), run with ``changes`` applied;
    ``configure`` inside the block changes the block's settings only."""
    token = _scoped.set(replace(current(), **_checked(changes)))
    try:
        yield _scoped.get()
    finally:
        _scoped.reset(token)


class in_force:  # noqa: N801 -- used as a function: ``with in_force(s):``
    """Within the ``with`` block (and this thread or task only), run with ``given`` itself: a
    torch module's backward runs under its forward's settings, on whatever thread torch's
    autograd engine runs it (a CUDA backward: the engine's device thread, outside the caller's
    ``override_settings``). A class, not a generator: it runs on every such backward."""

    __slots__ = ("given", "token")

    def __init__(self, given: Settings):
        self.given = given

    def __enter__(self) -> Settings:
        self.token = _scoped.set(self.given)
        return self.given

    def __exit__(self, *exc: Any) -> None:
        _scoped.reset(self.token)


def _checked(changes: Mapping[str, Any]) -> dict[str, Any]:
    return {name: _check(name, value) for name, value in changes.items()}


@dataclass(frozen=True)
class Stall:
    """A stall injected into the first launch of a persistent pass (see ``inject_stall``)."""

    block: int = -1
    step: int = -1
    duration_ms: float = 0.0
    # The kernel's (stall_block, stall_step, stall_ns) arguments, made once: a call's launches
    # pass them without making NumPy scalars each time, and a chain graph's key holds them (a
    # tuple hashed in C, where the dataclass's hash is a Python function).
    arguments: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", (np.int32(self.block), np.int32(self.step),
                                               np.uint64(int(self.duration_ms * 1e6))))


NO_STALL = Stall()
_stall: contextvars.ContextVar[Stall] = contextvars.ContextVar("prnn_stall", default=NO_STALL)


def current_stall() -> Stall:
    """The stall injected in the calling context (``NO_STALL`` outside ``inject_stall``)."""
    return _stall.get()


@contextlib.contextmanager
def inject_stall(block: int, step: int, duration_ms: float) -> Iterator[Stall]:
    """Make CTA ``block`` stall ``duration_ms`` before arriving at the barrier of step ``step``,
    in the first launch of every persistent pass (GPU or emulation) run inside the ``with``
    block by this thread (or asyncio task); other threads are not affected."""
    for name, value in (("block", block), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"inject_stall: {name} must be an int >= 0, got {value!r}")
    if isinstance(duration_ms, bool) or not isinstance(duration_ms, (int, float, np.integer, np.floating)) \
            or not 0 < duration_ms < math.inf:
        raise ValueError(f"inject_stall: duration_ms must be a finite number > 0, got {duration_ms!r}")
    token = _stall.set(Stall(int(block), int(step), float(duration_ms)))
    try:
        yield _stall.get()
    finally:
        _stall.reset(token)
