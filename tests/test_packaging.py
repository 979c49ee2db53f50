"""Installation as README.md says, into fresh venvs.

* The wheel, built from this checkout, in a venv that sees only the core dependencies (no
  extras: no CuPy, torch or matplotlib): the CUDA sources are found inside the installed package
  and every ``prnn`` command runs or stops with a one-line hint.
* README's install commands, as written (from the clone, and through a wheel), in venvs that see
  this environment's packages (so that pip finds every dependency installed and downloads
  nothing) but not its persistent_rnn: ``prnn info`` and a forward from the installed package.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from persistent_rnn.extras import install_hint

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
def dist(tmp_path_factory) -> Path:
    """A folder holding the wheel built from this checkout (``python -m build --wheel``, without
    build isolation: hatchling from the test extra, no network)."""
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
          str(ROOT)])
    return dist


@pytest.fixture(scope="module")
def venv(tmp_path_factory, dist):
    """(python, environment) of a fresh venv holding the wheel and the core dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    (wheel,) = dist.glob("persistent_rnn-*.whl")
    python = _fresh_venv(tmp / "venv")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(wheel)])
    env = _venv_env(python, tmp)
    env["PYTHONPATH"] = str(_link_core_site(tmp / "core"))
    return python, env


def _fresh_venv(path: Path) -> Path:
    """A venv without pip (pip runs from this environment with ``--python``); its python."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    return path / "bin" / "python"


def _venv_env(python: Path, tmp: Path) -> dict:
    """The environment of a command run in the venv of ``python``: its bin first, nothing of
    this environment's Python settings, a private kernel cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PRNN_CACHE_DIR=str(tmp / "cache"), PATH=f"{python.parent}:{env.get('PATH', '')}")
    return env


@pytest.mark.slow
def test_wheel_installs_and_finds_cuda_sources(venv, tmp_path):
    python, env = venv
    out = _run([str(python), "-c", CHECK, str(python.parents[1])], cwd=tmp_path, env=env)
    assert out == (ROOT / "cuda_src" / "cells.cuh").read_text()
    installed = next(python.parents[1].glob("lib/python*/site-packages/persistent_rnn/cuda_src"))
    shipped = {p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh", ".h")}
    assert shipped <= {p.name for p in installed.iterdir()}


@pytest.mark.slow
def test_the_wheel_ships_no_test_kernel(dist):
    """The kernels only tests compile (tests/cuda: the register tile alone, the 16-bit
    conversions alone) stay out of the wheel; the library's own sources are all in it."""
    (wheel,) = dist.glob("persistent_rnn-*.whl")
    names = {Path(n).name for n in zipfile.ZipFile(wheel).namelist()}
    test_only = {p.name for p in (ROOT / "tests" / "cuda").iterdir()}
    assert {"register_tile.cu", "half_convert.cu"} <= test_only
    assert not test_only & names, sorted(test_only & names)
    assert {p.name for p in (ROOT / "cuda_src").iterdir()} <= names


@pytest.mark.slow
def test_commands_without_extras(venv, tmp_path):
    python, env = venv
    prnn = str(python.parent / "prnn")
    info = _run([prnn, "info"], cwd=tmp_path, env=env)
    assert f"CuPy is not installed, so no GPU is used: {install_hint('cuda13')}" in info
    bench = _run([prnn, "bench", "--quick", "--no-progress", "--out", "b"], cwd=tmp_path, env=env)
    assert f"no plot: {install_hint('bench')}" in bench
    assert (tmp_path / "b" / "bench_results.json").is_file()
    demo = _run([prnn, "demo"], cwd=tmp_path, env=env)
    assert "|grad - finite diff|" in demo and "predicted" not in demo
    assert demo.strip().splitlines()[-1] == (
        "No predictions: the latency model reads the kernels' SASS, compiled with NVRTC "
        f"(cupy_backends is not installed): {install_hint('cuda13')}")
    kernels = subprocess.run([prnn, "kernels"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert kernels.returncode == 1 and kernels.stdout == ""
    assert kernels.stderr.strip().splitlines() == [
        "prnn kernels: error: needs the cuda13 extra (cupy_backends is not installed): "
        + install_hint("cuda13")]


# What the installed package must do: come from the venv, report, and run a forward (NumPy; and
# persistent_rnn.torch against torch.nn).
FORWARD = """
import sys
from pathlib import Path
import numpy as np
import torch
import persistent_rnn as prnn
import persistent_rnn.torch as prt
assert "torch._dynamo" not in sys.modules  # 1.4 s of import that only torch.compile needs
assert Path(sys.prefix) in Path(prnn.__file__).resolve().parents, prnn.__file__
y, _ = prnn.GRU(3, 5, seed=0).forward(np.ones((4, 2, 3), np.float32))
assert y.shape == (4, 2, 5) and np.isfinite(y).all()
lstm, ref = prt.LSTM(3, 5), torch.nn.LSTM(3, 5)
ref.load_state_dict(lstm.state_dict())
x = torch.randn(4, 2, 3)
torch.testing.assert_close(lstm(x)[0], ref(x)[0])
print("forward ok", prnn.__file__)
"""


def _readme_install_commands() -> list[str]:
    """The command lines of README.md's install block (``pip install ...``, ``python -m ...``)."""
    section = (ROOT / "README.md").read_text().split("## Install", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line]


def _site_without_this_package(dest: Path) -> Path:
    """A folder of links to everything this environment has installed but persistent_rnn
    itself (its editable install would shadow the one under test)."""
    dest.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not re.match(r"(_editable_impl_)?persistent_rnn|__editable__|__pycache__", entry.name):
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("route", ["clone", "wheel"])
def test_readme_install_commands_work_as_written(route, tmp_path):
    commands = _readme_install_commands()
    assert commands == ['pip install ".[cuda13,torch,bench]"', "pip install build",
                        "python -m build --wheel",
                        'pip install "dist/persistent_rnn-0.1.0-py3-none-any.whl'
                        '[cuda13,torch,bench]"']
    python = _fresh_venv(tmp_path / "venv")
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                         "['purelib'])"]).strip())
    (site / "installed.pth").write_text(f"{_site_without_this_package(tmp_path / 'site')}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
           "--no-build-isolation"]  # every requirement is installed already: nothing to download
    env = _venv_env(python, tmp_path)
    if route == "clone":
        _run(pip + shlex.split(commands[0])[2:], cwd=ROOT)
    else:  # the wheel into a temporary dist/, built by the venv's python without isolation
        _run(pip + shlex.split(commands[1])[2:], cwd=ROOT)
        _run([str(python)] + shlex.split(commands[2])[1:] + [
            "--no-isolation", "--outdir", str(tmp_path / "dist"), str(ROOT)], cwd=ROOT, env=env)
        _run(pip + [shlex.split(commands[3])[2].replace("dist/", f"{tmp_path}/dist/")],
             cwd=tmp_path)
    info = _run([str(python.parent / "prnn"), "info"], cwd=tmp_path, env=env)
    assert info.startswith("persistent_rnn 0.1.0\n") and "max_hidden_size" in info, info
    assert "forward ok" in _run([str(python), "-c", FORWARD], cwd=tmp_path, env=env)


def _run(cmd, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_readme_extras_table_names_each_extras_packages():
    """README's table of extras lists what pyproject.toml's extras and core dependencies install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {"(none)": project["dependencies"], **project["optional-dependencies"]}
    table = (ROOT / "README.md").read_text().split("| extra | adds | for |", 1)[1].split("\n\n")[0]
    rows = {cells[0].strip("` "): re.findall(r"`([^`]+)`", cells[1])
            for cells in (line.split("|")[1:3] for line in table.strip().splitlines()[1:])}
    names = {extra: sorted(re.match(r"[\w.-]+", dep).group(0) for dep in deps)
             for extra, deps in wanted.items()}
    assert names == {extra: sorted(listed) for extra, listed in rows.items()}
