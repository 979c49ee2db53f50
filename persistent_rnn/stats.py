"""What a forward or backward run did, reported as ``layer.last_run``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# Fields a device record may still have to fill in (``defer``): reading one folds them in first.
# (``details`` is not among them: notes are appended during a call, which must not wait.)
_LAZY = frozenset({"restarts", "fallback", "launches"})


@dataclass
class RunStats:
    """Statistics of the last forward or backward call of a layer.

    ``algo`` is ``"persistent"`` when the persistent kernel (or its CPU emulation) ran the
    recurrence and ``"gemm"`` otherwise; ``restarts`` counts launches repeated after a barrier timeout;
    ``fallback`` is ``None`` or the reason why (part of) the run did not finish on the persistent
    kernel; ``launches`` counts the persistent kernel launches of the pass that ran steps
    (restarts included; 0 on the GEMM path): a stack in stack mode takes one, otherwise one per
    layer-direction. The restart loop runs on the device (``launch``): ``restarts``, ``fallback``
    and ``launches`` are read from its record when first asked for (on the GPU that waits for
    the call's work), not during the call.
    """

    algo: str = "gemm"
    restarts: int = 0
    fallback: str | None = None
    emulated: bool = False
    launches: int = 0
    details: list[str] = field(default_factory=list)
    _deferred: list[Callable[["RunStats"], None]] = field(default_factory=list, repr=False,
                                                          compare=False)

    def __getattribute__(self, name: str):
        if name in _LAZY:
            pending = object.__getattribute__(self, "_deferred")
            if pending:
                object.__setattr__(self, "_deferred", [])
                for fold in pending:
                    fold(self)
        return object.__getattribute__(self, name)

    def defer(self, fold: Callable[["RunStats"], None]) -> None:
        """Fold a device record into these stats when one of them is first read."""
        object.__getattribute__(self, "_deferred").append(fold)

    def merge(self, other: "RunStats") -> None:
        """Fold the stats of one layer-direction's recurrence into this run's (device records
        still unread stay unread: they are folded in when these stats are read)."""
        get, put = object.__getattribute__, object.__setattr__
        if other.algo == "persistent":
            self.algo = "persistent"
        put(self, "restarts", get(self, "restarts") + get(other, "restarts"))
        put(self, "launches", get(self, "launches") + get(other, "launches"))
        self.emulated = self.emulated or other.emulated
        if get(other, "fallback") and not get(self, "fallback"):
            put(self, "fallback", get(other, "fallback"))
        get(self, "details").extend(get(other, "details"))
        get(self, "_deferred").extend(get(other, "_deferred"))
