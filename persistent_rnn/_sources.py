"""Locate the CUDA sources shipped with the package.

In a wheel they live at ``persistent_rnn/cuda_src``; in a source checkout (or an editable
install) at ``cuda_src/`` beside the package.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def cuda_src_dir() -> Path:
    """Return the directory holding ``hw.cuh``, ``cells.cuh`` and the kernels."""
    for candidate in (_PACKAGE_DIR / "cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if (candidate / "hw.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"persistent_rnn: CUDA sources not found in {_PACKAGE_DIR / 'cuda_src'} "
        f"or {_PACKAGE_DIR.parent / 'cuda_src'}; the installation is incomplete")


def read_source(name: str) -> str:
    """Return the text of ``cuda_src/<name>``."""
    return (cuda_src_dir() / name).read_text()
