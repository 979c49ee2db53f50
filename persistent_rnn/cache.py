"""The on-disk cache of built kernels: a private directory whose artefacts are loaded only after
their digest matches the one recorded when they were built (docs/cache.md).

Both builders use it: ``kernels`` (NVRTC cubins, in ``<cache>/nvrtc``) and ``emulate`` (g++
shared libraries, in ``<cache>/emulation``). An entry is two files in one folder:

* the artefact, ``<key>-<digest>.<suffix>``, written under a temporary name in the same folder
  and renamed into place, so it is never seen half-written and never rewritten in place (a
  process that has it mapped keeps its inode);
* the record ``<key>.json``, written the same way after the artefact: the artefact's name, size
  and SHA-256, the builder's metadata (compiler log, kernel names) and a digest of all that.

``fetch`` returns the entry only when the record is intact and the artefact's bytes match it;
otherwise it warns (``CacheWarning``) unless nothing was there, builds afresh and records the new
entry. A name no record lists is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_RECORD_FORMAT = 1


class CacheError(RuntimeError):
    """The cache directory cannot be trusted (not a directory, not ours, writable by others)."""


class CacheWarning(RuntimeWarning):
    """A cache entry failed verification and is being rebuilt."""


@dataclass(frozen=True)
class Entry:
    """A verified cache entry: the artefact's path and the metadata its builder recorded."""

    path: Path
    meta: dict[str, Any]


def cache_root() -> Path:
    """``$PRNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/persistent_rnn``, else
    ``~/.cache/persistent_rnn`` (not created)."""
    root = os.environ.get("PRNN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "persistent_rnn")
    return Path(root)


def cache_dir(*parts: str) -> Path:
    """The private folder ``<cache root>/<parts...>``, created with mode 0o700 and checked.

    Raises CacheError, naming the folder and ``PRNN_CACHE_DIR``, if the root or the folder is not
    a directory, is owned by another user, or is writable by group or others.
    """
    folders = [cache_root()]
    for part in parts:
        folders.append(folders[-1] / part)
    for folder in folders:
        try:
            folder.mkdir(mode=0o700, parents=True)
        except FileExistsError:  # a directory (checked below) or a file (refused below)
            pass
        _check_private(folder)
    return folders[-1]


def _check_private(folder: Path) -> None:
    info = os.stat(folder)
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise CacheError(f"kernel cache directory {folder} {problem}: anything written there "
                         f"could be loaded as code. Point PRNN_CACHE_DIR at a private directory "
                         f"(or fix its owner and permissions: chmod 700).")


def fetch(folder: Path, key: str, suffix: str, build: Callable[[Path], dict[str, Any]]) -> Entry:
    """The verified entry ``key`` of ``folder``, built (and recorded) if it is missing or bad.

    ``build(path)`` must write the artefact to ``path`` (a fresh temporary name in ``folder``)
    and return its JSON-serialisable metadata. Concurrent builders of one key are safe: each
    renames complete files into place and the last record written wins.
    """
    entry = load(folder, key)
    if entry is not None:
        return entry
    fd, name = tempfile.mkstemp(prefix=f".{key}.", suffix=f".tmp{suffix}", dir=folder)
    os.close(fd)
    built = Path(name)
    try:
        return _store(folder, key, suffix, built, build(built))
    finally:
        built.unlink(missing_ok=True)


def load(folder: Path, key: str) -> Entry | None:
    """Entry ``key`` if its record is intact and its artefact matches it; None otherwise (with a
    CacheWarning when a record was there but something failed to verify)."""
    record_path = folder / f"{key}.json"
    try:
        text = record_path.read_text()
    except FileNotFoundError:
        return None
    problem = _verify(folder, text)
    if isinstance(problem, Entry):
        return problem
    warnings.warn(f"kernel cache entry {record_path} {problem}; rebuilding it", CacheWarning,
                  stacklevel=2)
    return None


def _verify(folder: Path, text: str) -> Entry | str:
    """The entry ``text`` (a record) describes, or what is wrong with it."""
    try:
        record = json.loads(text)
        body = record["body"]
        if record["check"] != _digest(_canonical(body).encode()):
            return "has a record that does not match its own digest"
        if body["format"] != _RECORD_FORMAT:
            return f"has record format {body['format']}, not {_RECORD_FORMAT}"
        name, size, sha256, meta = body["artefact"], body["size"], body["sha256"], body["meta"]
        if Path(name).name != name:
            return "names an artefact outside its folder"
        artefact = folder / name
    except (ValueError, KeyError, TypeError):
        return "has a damaged record"
    try:
        data = artefact.read_bytes()
    except OSError as exc:
        return f"lost its artefact ({exc.strerror})"
    if len(data) != size or _digest(data) != sha256:
        return f"has an artefact {artefact.name} that does not match its recorded digest"
    return Entry(artefact, meta)


def _store(folder: Path, key: str, suffix: str, built: Path, meta: dict[str, Any]) -> Entry:
    data = built.read_bytes()
    sha256 = _digest(data)
    artefact = folder / f"{key}-{sha256[:16]}{suffix}"
    os.replace(built, artefact)
    body = {"format": _RECORD_FORMAT, "artefact": artefact.name, "size": len(data),
            "sha256": sha256, "meta": meta}
    record = json.dumps({"check": _digest(_canonical(body).encode()), "body": body}, indent=1)
    _write_atomically(folder / f"{key}.json", record.encode())
    return Entry(artefact, meta)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
