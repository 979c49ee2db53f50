"""The wheel: built from this checkout and installed into a fresh venv that sees only the core
dependencies (no extras: no CuPy, torch or matplotlib); the CUDA sources are found inside the
installed package and every ``prnn`` command runs or stops with a one-line hint."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys
from pathlib import Path
import persistent_rnn
from persistent_rnn._sources import cuda_src_dir, read_source
venv = Path(sys.argv[1]).resolve()
assert venv in Path(persistent_rnn.__file__).resolve().parents, persistent_rnn.__file__
assert cuda_src_dir() == Path(persistent_rnn.__file__).resolve().parent / "cuda_src", cuda_src_dir()
for extra in ("cupy", "cupy_backends", "torch", "matplotlib"):
    try:
        __import__(extra)
    except ImportError:
        continue
    raise AssertionError(f"{extra} is visible in the venv")
sys.stdout.write(read_source("cells.cuh"))
"""


def _core_requirements() -> list[str]:
    """The distribution names of pyproject's ``dependencies`` (no extras)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [dep.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for dep in deps]


def _link_core_site(dest: Path) -> Path:
    """A folder of links to this environment's installations of the core dependencies only:
    what ``pip install persistent-rnn`` brings, without network and without anything else."""
    dest.mkdir()
    for name in _core_requirements():
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source = Path(dist.locate_file(top))
            if top in ("..", "__pycache__") or not source.exists() or (dest / top).exists():
                continue
            (dest / top).symlink_to(source)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, environment) of a fresh venv holding the wheel and the core dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist, venv = tmp / "dist", tmp / "venv"
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)])
    (wheel,) = dist.glob("persistent_rnn-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(wheel)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(_link_core_site(tmp / "core")),
               PRNN_CACHE_DIR=str(tmp / "cache"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    return python, env


@pytest.mark.slow
def test_wheel_installs_and_finds_cuda_sources(venv, tmp_path):
    python, env = venv
    out = _run([str(python), "-c", CHECK, str(python.parents[1])], cwd=tmp_path, env=env)
    assert out == (ROOT / "cuda_src" / "cells.cuh").read_text()
    installed = next(python.parents[1].glob("lib/python*/site-packages/persistent_rnn/cuda_src"))
    shipped = {p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    assert shipped <= {p.name for p in installed.iterdir()}


@pytest.mark.slow
def test_commands_without_extras(venv, tmp_path):
    python, env = venv
    prnn = str(python.parent / "prnn")
    info = _run([prnn, "info"], cwd=tmp_path, env=env)
    assert 'CuPy is not installed, so no GPU is used: pip install "persistent-rnn[cuda13]"' in info
    bench = _run([prnn, "bench", "--quick", "--no-progress", "--out", "b"], cwd=tmp_path, env=env)
    assert 'no plot: pip install "persistent-rnn[bench]"' in bench
    assert (tmp_path / "b" / "bench_results.json").is_file()
    assert "|grad - finite diff|" in _run([prnn, "demo"], cwd=tmp_path, env=env)
    kernels = subprocess.run([prnn, "kernels"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert kernels.returncode == 1 and kernels.stdout == ""
    assert kernels.stderr.strip().splitlines() == [
        "prnn kernels: error: needs the cuda13 extra (cupy_backends is not installed): "
        'pip install "persistent-rnn[cuda13]"']


def _run(cmd, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout
