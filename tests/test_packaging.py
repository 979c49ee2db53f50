"""The wheel: built from this checkout, installed into a fresh venv, the CUDA sources found from a
directory outside the repository (``persistent_rnn/cuda_src`` inside the installed package)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys
from pathlib import Path
import persistent_rnn
from persistent_rnn._sources import cuda_src_dir, read_source
venv = Path(sys.argv[1]).resolve()
assert venv in Path(persistent_rnn.__file__).resolve().parents, persistent_rnn.__file__
assert cuda_src_dir() == Path(persistent_rnn.__file__).resolve().parent / "cuda_src", cuda_src_dir()
sys.stdout.write(read_source("cells.cuh"))
"""


@pytest.mark.slow
def test_wheel_installs_and_finds_cuda_sources(tmp_path):
    dist, venv, outside = tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)])
    (wheel,) = dist.glob("persistent_rnn-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(wheel)])
    # numpy and friends come from this environment's site-packages via PYTHONPATH (no .pth files
    # are read from there, so the editable checkout stays invisible to the venv)
    env = dict(os.environ, PYTHONPATH=str(Path(numpy.__file__).resolve().parents[1]))
    out = _run([str(python), "-c", CHECK, str(venv)], cwd=outside, env=env)
    assert out == (ROOT / "cuda_src" / "cells.cuh").read_text()
    installed = next(venv.glob("lib/python*/site-packages/persistent_rnn/cuda_src"))
    shipped = {p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    assert shipped <= {p.name for p in installed.iterdir()}


def _run(cmd, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout
