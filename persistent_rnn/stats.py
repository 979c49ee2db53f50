"""What a forward or backward run did, reported as ``layer.last_run``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStats:
    """Statistics of the last forward or backward call of a layer.

    ``algo`` is ``"persistent"`` when the persistent kernel (or its CPU emulation) ran the
    recurrence and ``"gemm"`` otherwise; ``restarts`` counts launches repeated after a barrier timeout;
    ``fallback`` is ``None`` or the reason why (part of) the run went to the GEMM path;
    ``launches`` counts the persistent kernel launches of the pass (restarts included; 0 on the
    GEMM path): a stack in stack mode takes one, otherwise one per layer-direction.
    """

    algo: str = "gemm"
    restarts: int = 0
    fallback: str | None = None
    emulated: bool = False
    launches: int = 0
    details: list[str] = field(default_factory=list)

    def merge(self, other: "RunStats") -> None:
        """Fold the stats of one layer-direction's recurrence into this run's."""
        if other.algo == "persistent":
            self.algo = "persistent"
        self.restarts += other.restarts
        self.launches += other.launches
        self.emulated = self.emulated or other.emulated
        if other.fallback and not self.fallback:
            self.fallback = other.fallback
        self.details.extend(other.details)
