"""The race detector (docs/emulation.md, "The race detector"): the emulated kernels built with
ThreadSanitizer, run in a child process (emulate.run_with_race_detector), where switching between
a CTA's threads is no happens-before edge and only barriers and acquire/release order them. The
kernels are race-free under it, and a barrier removed from them is a reported race in the plain
schedule, where the results alone show nothing (only a random schedule exposes it,
test_emulation_modes.py). Each ThreadSanitizer build costs a few seconds and its runs several
times a plain one's: five builds here (forward and backward on the grid and as a cluster, one
sabotaged forward), two child processes."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from persistent_rnn import emulate
from sabotage import TEAM_BARRIER, sabotaged

SCENARIO = str(Path(__file__).with_name("race_scenario.py"))


def _tsan_missing() -> str:
    try:
        emulate.tsan_runtime()
    except emulate.EmulationError as error:
        return str(error)
    return ""


pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(bool(_tsan_missing()), reason=_tsan_missing() or "-")]


def _detect(*argv: str, sources: tuple[str, ...]) -> subprocess.CompletedProcess:
    return emulate.run_with_race_detector([SCENARIO, *argv], sources, timeout=280)


def test_a_gru_forward_and_backward_have_no_race():
    """A small GRU's forward and backward on the grid (CTAs exchanging through global memory)
    and as a cluster of several CTAs (distributed shared memory), against float64."""
    proc = _detect("grid:24", "cluster:40",
                   sources=("persistent_forward", "persistent_backward"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split("\n")[:2] == ["ok grid:24", "ok cluster:40"], proc.stdout


def test_a_missing_block_barrier_is_a_race_in_the_plain_schedule(tmp_path):
    """The grid step's product without the barrier after it (the sabotage of
    test_a_missing_block_barrier_shows_in_a_random_schedule): in the plain schedule the warps
    move in step and the results come out right, but the pointwise threads' reads of the partial
    sums are ordered after other warps' writes by nothing, which the detector reports, naming
    the kernel and the summing function."""
    src = sabotaged(tmp_path, "persistent_common.cuh", TEAM_BARRIER, "")
    proc = _detect("grid:24", "--forward-only", "--src", str(src), sources=("persistent_forward",))
    assert proc.returncode != 0, proc.stdout
    assert "RaceError: the race detector reported" in proc.stderr, proc.stderr[-6000:]
    assert "in the emulated launch of prnn_persistent_forward" in proc.stderr
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr
    assert "row_sum" in proc.stderr


def test_a_detector_build_needs_the_runtime_preloaded(monkeypatch):
    """In a process without ThreadSanitizer's runtime (this one) a detector build is refused
    before it is compiled, with the way to run it."""
    monkeypatch.setenv(emulate.RACE_DETECTOR_ENV, "grid_barrier")
    with pytest.raises(emulate.EmulationError, match="run_with_race_detector"):
        emulate.get_module("grid_barrier.cu", {})


def test_the_compiler_runs_without_the_preloaded_runtime(monkeypatch):
    """The child's builds run g++ without ThreadSanitizer's runtime (it more than doubles their
    time), other preloads kept."""
    monkeypatch.setenv("LD_PRELOAD", "/lib/libtsan.so.2:/lib/libother.so")
    assert emulate._compiler_env()["LD_PRELOAD"] == "/lib/libother.so"
    monkeypatch.setenv("LD_PRELOAD", "/lib/libtsan.so.2")
    assert "LD_PRELOAD" not in emulate._compiler_env()
    monkeypatch.setenv("LD_PRELOAD", "/lib/libother.so")
    assert emulate._compiler_env() is None
