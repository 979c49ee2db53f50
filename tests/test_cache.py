"""The kernel cache runs only what it built: a private directory, every artefact checked against
the digest recorded at build time, damaged or planted artefacts rebuilt (never loaded), builds
that work whatever filesystem TMPDIR is on.

Loading a shared library twice by one path returns the first one loaded, so tests that tamper
with a ``.so`` load it in fresh interpreters."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from persistent_rnn import cache, emulate
from persistent_rnn.cells import CELLS
from persistent_rnn.plan import layout_defines, shared_layout
from persistent_rnn.tiles import PassTile, Tile

ROOT = Path(__file__).resolve().parents[1]

# Builds grid_barrier.cu for the host, runs it over 2 CTAs for 3 rounds, prints the library path.
EMULATE = """
import numpy as np
from persistent_rnn import emulate
module = emulate.get_module("grid_barrier.cu", {})
ctl, elapsed = np.zeros(4, np.uint32), np.zeros(2, np.uint64)
module.launch("grid_barrier_rounds", 2, 32, 0, (ctl, np.int32(3), np.uint64(10**9), np.int32(-1),
              np.int32(-1), np.uint64(0), elapsed))
assert ctl[0] == 6, ctl
print(emulate._build("grid_barrier.cu", {})[0])
"""

PLANTED = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PRNN_TEST_MARKER"), "w");
    if (f) fclose(f);
}
"""


def _python(code: str, cache_root: Path, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), PRNN_CACHE_DIR=str(cache_root), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=240)


def _emulate(cache_root: Path, **env: str) -> subprocess.CompletedProcess:
    proc = _python(EMULATE, cache_root, **env)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _counting_builder(content: bytes = b"artefact"):
    calls = []

    def build(path: Path) -> dict:
        calls.append(path)
        path.write_bytes(content)
        return {"kernels": ["k"]}
    return build, calls


# -- the directory ---------------------------------------------------------------------------

def test_cache_dir_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path / "a" / "cache"))
    folder = cache.cache_dir("emulation")
    assert folder == tmp_path / "a" / "cache" / "emulation"
    for path in (folder, folder.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_group_or_world_writable_cache_dir_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("PRNN_CACHE_DIR", str(root))
    with pytest.raises(cache.CacheError, match="PRNN_CACHE_DIR") as info:
        emulate._build("grid_barrier.cu", {})
    assert str(root) in str(info.value) and "writable by group or others" in str(info.value)
    assert not any(root.rglob("*.so"))


def test_writable_subfolder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path / "cache"))
    cache.cache_dir("emulation").chmod(0o777)
    with pytest.raises(cache.CacheError, match="emulation"):
        cache.cache_dir("emulation")


def test_foreign_owned_cache_dir_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)
    else:  # cannot give a directory away: be someone else instead
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    monkeypatch.setenv("PRNN_CACHE_DIR", str(root))
    with pytest.raises(cache.CacheError, match="owned by uid"):
        emulate._build("grid_barrier.cu", {})


def test_cache_root_that_is_a_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(cache.CacheError, match="is not a directory"):
        cache.cache_dir()


# -- entries (no compiler needed) --------------------------------------------------------------

def test_entry_is_built_once_then_verified(tmp_path):
    build, calls = _counting_builder()
    first = cache.fetch(tmp_path, "key", ".bin", build)
    again = cache.fetch(tmp_path, "key", ".bin", build)
    assert len(calls) == 1 and again == first
    assert first.path.read_bytes() == b"artefact" and first.meta == {"kernels": ["k"]}
    assert calls[0].parent == tmp_path  # built under a temporary name in the cache folder
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.path.name, "key.json"])


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "replace"])
def test_damaged_artefact_is_rebuilt_with_a_warning(tmp_path, damage):
    build, calls = _counting_builder()
    path = cache.fetch(tmp_path, "key", ".bin", build).path
    if damage == "corrupt":
        path.write_bytes(b"artefacX")
    elif damage == "truncate":
        path.write_bytes(b"artef")
    elif damage == "delete":
        path.unlink()
    else:  # a planted file renamed over the real one
        (tmp_path / "planted").write_bytes(b"planted!")
        os.replace(tmp_path / "planted", path)
    with pytest.warns(cache.CacheWarning, match="rebuilding"):
        entry = cache.fetch(tmp_path, "key", ".bin", build)
    assert len(calls) == 2 and entry.path.read_bytes() == b"artefact"


@pytest.mark.parametrize("edit", [
    lambda r: r["body"]["meta"].update(kernels=["planted"]),    # the kernel list / log
    lambda r: r["body"].update(artefact="../elsewhere.bin"),      # outside the folder
    lambda r: r.update(check="0" * 64),
    lambda r: r["body"].pop("sha256"),
])
def test_tampered_record_is_rebuilt_with_a_warning(tmp_path, edit):
    build, calls = _counting_builder()
    cache.fetch(tmp_path, "key", ".bin", build)
    record = json.loads((tmp_path / "key.json").read_text())
    edit(record)
    (tmp_path / "key.json").write_text(json.dumps(record))
    with pytest.warns(cache.CacheWarning):
        entry = cache.fetch(tmp_path, "key", ".bin", build)
    assert len(calls) == 2 and entry.meta == {"kernels": ["k"]}


@pytest.mark.parametrize("text", ["", "{", "[]", '{"check": 1}', "\0" * 10])
def test_damaged_record_is_rebuilt_with_a_warning(tmp_path, text):
    build, calls = _counting_builder()
    cache.fetch(tmp_path, "key", ".bin", build)
    (tmp_path / "key.json").write_text(text)
    with pytest.warns(cache.CacheWarning, match="damaged record|own digest"):
        cache.fetch(tmp_path, "key", ".bin", build)
    assert len(calls) == 2


def test_artefact_without_a_record_is_never_loaded(tmp_path):
    build, calls = _counting_builder()
    name = cache.fetch(tmp_path, "key", ".bin", build).path.name
    (tmp_path / "key.json").unlink()
    (tmp_path / name).write_bytes(b"planted!")
    entry = cache.fetch(tmp_path, "key", ".bin", build)
    assert len(calls) == 2 and entry.path.read_bytes() == b"artefact"


def test_concurrent_builders_of_one_key_all_get_a_verified_entry(tmp_path):
    def build(path: Path) -> dict:
        path.write_bytes(b"part one ")
        time.sleep(0.05)  # let the builders overlap
        with open(path, "ab") as out:
            out.write(b"part two")
        return {"kernels": ["k"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        with ThreadPoolExecutor(8) as pool:
            entries = list(pool.map(lambda _: cache.fetch(tmp_path, "key", ".bin", build), range(8)))
    assert {e.path.read_bytes() for e in entries} == {b"part one part two"}
    assert cache.load(tmp_path, "key") in entries
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_failed_build_leaves_nothing_behind(tmp_path):
    def build(path: Path) -> dict:
        path.write_bytes(b"half")
        raise RuntimeError("compiler crashed")
    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.fetch(tmp_path, "key", ".bin", build)
    assert list(tmp_path.iterdir()) == []


# -- the emulation's shared libraries (g++) ----------------------------------------------------

def _built_library(cache_root: Path) -> Path:
    library = Path(_emulate(cache_root).stdout.split()[-1])
    assert library.parent == cache_root / "emulation" and library.suffix == ".so"
    return library


def test_planted_library_is_not_loaded(tmp_path):
    root, marker = tmp_path / "cache", tmp_path / "constructor-ran"
    library = _built_library(root)
    planted = tmp_path / "planted.so"
    subprocess.run([emulate.host_compiler(), "-shared", "-fPIC", "-x", "c", "-", "-o", str(planted)],
                   input=PLANTED, text=True, check=True, timeout=120)
    os.replace(planted, library)
    proc = _emulate(root, PRNN_TEST_MARKER=str(marker))
    assert not marker.exists(), "the planted library's constructor ran"
    assert "CacheWarning" in proc.stderr and "rebuilding" in proc.stderr


def test_truncated_library_is_rebuilt(tmp_path):
    root = tmp_path / "cache"
    library = _built_library(root)
    size = library.stat().st_size
    with open(library, "r+b") as out:
        out.truncate(size // 2)
    proc = _emulate(root)  # rc 0: no SIGBUS, no dlopen error
    assert "CacheWarning" in proc.stderr
    assert Path(proc.stdout.split()[-1]).stat().st_size == size


def _other_filesystem(path: Path) -> Path | None:
    """A writable directory on another device than ``path``, or None."""
    device = os.stat(path).st_dev
    for candidate in ("/dev/shm", "/tmp", "/var/tmp", str(Path.home())):
        try:
            if os.stat(candidate).st_dev != device and os.access(candidate, os.W_OK):
                return Path(candidate)
        except OSError:
            continue
    return None


def test_builds_with_tmpdir_on_another_filesystem(tmp_path):
    root = tmp_path / "cache"
    other = _other_filesystem(tmp_path)
    if other is None:
        pytest.skip(f"no writable directory on another filesystem than {tmp_path}")
    tmpdir = Path(tempfile.mkdtemp(prefix="prnn-test-tmpdir-", dir=other))
    try:
        code = EMULATE + ("from persistent_rnn import kernels\n"
                          "kernels.compile_source('grid_barrier.cu', {}, 'sm_90')\n")
        proc = _python(code, root, TMPDIR=str(tmpdir))
        assert proc.returncode == 0, proc.stderr
        assert list(tmpdir.iterdir()) == []
    finally:
        shutil.rmtree(tmpdir)


# -- NVRTC cubins ------------------------------------------------------------------------------

_SMALL = Tile(4, PassTile(4, 4, 1), PassTile(4, 4, 1))  # a small tanh RNN forward
FORWARD = {"PRNN_CELL": 0, "PRNN_UNITS": 4, "PRNN_ROWS": 4, "PRNN_KSPLIT": 4, "PRNN_KPT": 1,
           "PRNN_WARPS": 4, "PRNN_GATHER_QUADS": 1,
           **layout_defines(shared_layout(CELLS["rnn_tanh"], _SMALL, False))}


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels as module
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path / "cache"))
    return module


def test_cubin_cache_is_private_and_hit(kernels, tmp_path):
    first = kernels.compile_source("persistent_forward.cu", FORWARD, "sm_80")
    assert first.cubin_path.parent == tmp_path / "cache" / "nvrtc"
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    mtime = first.cubin_path.stat().st_mtime_ns
    again = kernels.compile_source("persistent_forward.cu", FORWARD, "sm_80")
    assert again == first and again.cubin_path.stat().st_mtime_ns == mtime
    assert "0 bytes spill stores" in again.log
    other = kernels.compile_source("persistent_forward.cu", {**FORWARD, "PRNN_CELL": 1}, "sm_80")
    assert other.cubin_path != first.cubin_path


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_cubin_is_rebuilt(kernels, damage):
    first = kernels.compile_source("persistent_forward.cu", FORWARD, "sm_90")
    image = first.cubin_path.read_bytes()
    damaged = bytearray(image[: len(image) // 2] if damage == "truncate" else image)
    damaged[len(damaged) // 2] ^= 0xFF
    first.cubin_path.write_bytes(bytes(damaged))
    with pytest.warns(cache.CacheWarning, match="rebuilding"):
        again = kernels.compile_source("persistent_forward.cu", FORWARD, "sm_90")
    assert again.cubin_path.read_bytes() == image and "spill stores" in again.log
