"""Sabotaged copies of cuda_src for the tests that show an emulation mode catches a class of bug:
each test breaks one thing in a copy of the kernel sources (a barrier removed, a wait dropped, a
store made plain) and builds the emulation from that copy (``emulate.get_module(..., src_dir)``).
A replacement must match exactly once, so that a sabotage cannot silently stop applying when the
kernels change."""
from __future__ import annotations

import shutil
from pathlib import Path

from persistent_rnn._sources import cuda_src_dir

# persistent_common.cuh's lines that sabotages remove or change: the grid step's barrier after its
# product, and the number of staged vectors (two by step parity for the grid's warp teams).
TEAM_BARRIER = "  team_sync_or<kWarpTeam>(0);  // the sums visible to the team that finishes them\n"
STAGED_BUFFERS = "constexpr int kStagedBuffers = PRNN_STAGED_BUFFERS;"


def sabotaged(root: Path, file: str, old: str, new: str) -> Path:
    """A copy of cuda_src under ``root`` whose ``file`` has its one ``old`` replaced by ``new``."""
    dst = root / "cuda_src"
    if not dst.exists():
        shutil.copytree(cuda_src_dir(), dst)
    path = dst / file
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise AssertionError(f"sabotage of {file}: {old!r} occurs {count} times, not once")
    path.write_text(text.replace(old, new))
    return dst
