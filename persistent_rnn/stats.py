"""What a forward or backward run did, reported as ``layer.last_run``."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

# Fields a device record may still have to fill in (``defer``): reading one folds them in first.
# (``details`` is not among them: notes are appended during a call, which must not wait.)
_LAZY = ("restarts", "fallback", "launches")


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

    # While a device record is pending, the lazy fields are kept in ``_held`` and absent from
    # the instance (and, below, from the class), so that reading one reaches ``__getattr__``,
    # which folds the records in first; every other read is a plain attribute read (the GEMM
    # path, and a persistent call's stats once read, never pass through Python here).
    def __getattr__(self, name: str):
        held = self.__dict__.get("_held")
        if held is None or name not in _LAZY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._fold()
        return self.__dict__[name]

    def _fold(self) -> None:
        """Put the held fields back and fold every pending record into them."""
        self.__dict__.update(self.__dict__.pop("_held"))
        pending, self._deferred = self._deferred, []
        for fold in pending:  # (they read and write the fields as attributes: all are back)
            fold(self)

    @classmethod
    def awaiting(cls, algo: str, emulated: bool, launches: int, details: list[str],
                 fold: Callable[["RunStats"], None]) -> "RunStats":
        """Stats of a run whose device record is still to be folded in (``fold``): what
        ``RunStats(...)`` then ``defer(fold)`` make, made at once (every persistent pass's
        call makes one)."""
        stats = cls.__new__(cls)
        stats.__dict__ = {"algo": algo, "emulated": emulated, "details": details,
                          "_deferred": [fold],
                          "_held": {**_LAZY_DEFAULTS, "launches": launches}}
        return stats

    def defer(self, fold: Callable[["RunStats"], None]) -> None:
        """Fold a device record into these stats when one of them is first read (the lazy
        fields moved into ``_held`` first, once: reads then reach ``__getattr__``)."""
        state = self.__dict__
        if "_held" not in state:
            state["_held"] = dict(zip(_LAZY, map(state.pop, _LAZY)))  # (no Python frame)
        self._deferred.append(fold)

    def merge(self, other: "RunStats") -> None:
        """Fold the stats of one layer-direction's recurrence into this run's (device records
        still unread stay unread: they are folded in when these stats are read)."""
        for fold in other._deferred:  # (first: it moves this run's lazy fields into ``_held``)
            self.defer(fold)
        state = self.__dict__
        mine = state.get("_held") or state  # (the lazy fields where they are now)
        theirs = other.__dict__.get("_held") or other.__dict__
        if other.algo == "persistent":
            self.algo = "persistent"
        mine["restarts"] += theirs["restarts"]
        mine["launches"] += theirs["launches"]
        if theirs["fallback"] and not mine["fallback"]:
            mine["fallback"] = theirs["fallback"]
        self.emulated = self.emulated or other.emulated
        self.details.extend(other.details)


# The lazy fields' defaults (``awaiting``), as the dataclass declares them.
_LAZY_DEFAULTS = {f.name: f.default for f in fields(RunStats) if f.name in _LAZY}
for _name in _LAZY:  # (the dataclass's defaults live in __init__; see __getattr__)
    delattr(RunStats, _name)
