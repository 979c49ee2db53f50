"""The round's anatomy (cuda_src/grid_barrier.cu's parts of an exchange round, bench/barrier_latency.py
--anatomy) in the CPU emulation: each part ends, counts its rounds and delivers the right values,
also with delayed stores and random schedules; its waits end where the grid is not co-resident or
a CTA stalls; and a part whose protocol is broken on purpose (tests/sabotage.py) fails. Each part
is launched with the arguments the bench script gives it."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from persistent_rnn import emulate
from sabotage import sabotaged

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
try:
    import barrier_latency
finally:
    sys.path.remove(str(Path(__file__).resolve().parent.parent / "bench"))

pytestmark = pytest.mark.timeout(240)

PARTS = {p.name: p for p in barrier_latency.ANATOMY}
TIMEOUT_NS = 300_000_000
CPU = barrier_latency.Machine(cpu=True)


class Ran(NamedTuple):
    abort: int
    progress: np.ndarray | None  # per CTA, the last round done (None: the part records none)
    errors: int
    elapsed: np.ndarray
    words: np.ndarray | None  # the grid's exchanged words (the grid and quad parts)


def _run(name: str, grid: int, width: int = 3, rounds: int = 25, block: int | None = None,
         src_dir: Path | None = None, timeout_ns: int = TIMEOUT_NS, max_resident: int | None = None,
         stall: tuple[int, int, int] = (-1, -1, 0)) -> Ran:
    """One emulated launch of part ``name`` on ``grid`` CTAs (of ``block`` threads: the part's
    own, or 64), built from ``src_dir``; an exchange's CTA ``stall[0]`` waits ``stall[2]`` ns
    before round ``stall[1]``."""
    part = PARTS[name]
    module = emulate.get_module("grid_barrier.cu", {"PRNN_CLUSTER": grid} if part.cluster else {},
                                src_dir)
    elapsed, errors = np.zeros(grid, np.uint64), np.zeros(1, np.uint32)
    stall_args = (np.int32(stall[0]), np.int32(stall[1]), np.uint64(stall[2]))
    args, shared, ctl = barrier_latency.part_arguments(CPU, part, grid, rounds, width, timeout_ns,
                                                       elapsed, errors, stall_args)
    module.launch(part.kernel, grid, block or part.block or 64, shared, args,
                  max_resident=max_resident)
    return Ran(abort=0 if ctl is None else int(ctl[1]),
               progress=None if ctl is None else ctl[2:].view(np.int32),
               errors=int(errors[0]), elapsed=elapsed,
               words=args[0] if part.path in ("grid", "quad") else None)


def _delivered(ran: Ran, rounds: int = 25) -> bool:
    """Every CTA did every round, in time, every value right."""
    done = ran.progress is None or (ran.progress == rounds - 1).all()
    return ran.abort == 0 and ran.errors == 0 and done and (ran.elapsed > 0).all()


# exchange_warp_vote (3, 70): 53 quads over 32 threads, a second quad for some; quad 17: two
# batches of 16 quads in flight; the clusters of 1 and 4 the bench's CPU run builds.
@pytest.mark.parametrize("name, grid, width", [
    ("exchange_warp_vote", 4, 3), ("exchange_warp_vote", 3, 70), ("quad", 5, 1), ("quad", 17, 1),
    ("quad_acquire", 4, 1), ("cluster_local", 4, 3), ("cluster_local", 1, 5),
    ("cluster_barrier", 1, 1), ("cluster_barrier", 4, 1), ("cluster_barrier_relaxed", 4, 1)])
def test_each_part_delivers_every_round(name, grid, width):
    ran = _run(name, grid, width)
    assert _delivered(ran), ran
    if name.startswith("quad"):  # round 24's tag in slot 0, round 23's in slot 1, every word
        tags = ran.words & np.uint32(3)
        assert (tags[0] == 1 + 12 % 3).all() and (tags[1] == 1 + 11 % 3).all()


@pytest.mark.parametrize("mode", ["delayed", "schedule"])
@pytest.mark.parametrize("name", ["exchange_warp_vote", "quad", "quad_acquire", "cluster_local",
                                  "cluster_barrier", "cluster_barrier_relaxed"])
def test_each_part_survives_late_stores_and_random_schedules(name, mode):
    """Delayed: a quad's four words land apart and late (its reader checks every word's tag);
    schedule: a lagging warp, fibers switched at shared-memory accesses."""
    with emulate.modes(mode, seed=5):
        assert _delivered(_run(name, 4))


def test_the_quad_waits_end_where_the_grid_is_not_co_resident():
    """The quads' free polls (1024, no timer) end, and so does the wait after them: the abort
    word says the grid was not co-resident."""
    ran = _run("quad", 4, max_resident=2, timeout_ns=20_000_000)
    assert ran.abort == 2 and ran.errors == 0


def test_the_warp_vote_exchange_times_out_on_a_stalled_cta():
    ran = _run("exchange_warp_vote", 4, stall=(2, 4, 900_000_000), timeout_ns=20_000_000)
    assert ran.abort == 1 and ran.errors == 0
    assert (np.delete(ran.progress, 2) == 3).all() and ran.progress[2] in (3, 4)


def test_the_timer_probe_counts_reads_steps_and_sleeps():
    """On the emulation's virtual clock every read is 1 ns after the one before, and a back-off
    with nothing else to run waits at least a quantum (1 ms) of it."""
    assert _timer_probe() == (50, 1, 50, True)


def _timer_probe(src_dir: Path | None = None, rounds: int = 50) -> tuple[int, int, int, bool]:
    out = np.zeros(barrier_latency.TIMER_WORDS, np.uint64)
    emulate.get_module("grid_barrier.cu", {}, src_dir).launch("timer_probe", 1, 1, 0,
                                                              (np.int32(rounds), out))
    return int(out[0]), int(out[1]), int(out[2]), int(out[3]) >= rounds * 1_000_000


def test_the_bench_runs_every_part_in_the_emulation(tmp_path, capsys):
    rows = barrier_latency.anatomy_rows(CPU, (1, 4), 64, 10, 3, TIMEOUT_NS, 1, clusters=True)
    assert {(r["part"], r["grid"]) for r in rows if "grid" in r} == {
        (p.name, g) for p in barrier_latency.ANATOMY for g in (1, 4)}
    assert all(r["ns_per_round"] > 0 for r in rows if "grid" in r)
    table = barrier_latency.anatomy_table(rows)
    assert "exchange_warp_vote" in table and "(100%)" in table and "__nanosleep(20)" in table


def test_a_part_that_fails_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """A slot is rare: a part that times out (here quad's waits, on a grid whose CTAs cannot all
    be resident) has its error in its row, and every other part is measured."""
    module = emulate.get_module("grid_barrier.cu", {})
    quad = PARTS["quad"].kernel

    def launch(kernel, grid, block, shared, args, max_resident=None):
        module.launch(kernel, grid, block, shared, args,
                      max_resident=2 if kernel == quad else max_resident)
    fake = type("Module", (), {"launch": staticmethod(launch)})()
    machine = barrier_latency.Machine(cpu=True)
    monkeypatch.setattr(machine, "get_module", lambda source, defines: (
        fake if not defines else emulate.get_module(source, defines)))
    rows = barrier_latency.anatomy_rows(machine, (4,), 64, 5, 3, 20_000_000, 1, clusters=False)
    failed = {r["part"]: r["error"] for r in rows if "error" in r}
    assert list(failed) == ["quad"] and "timed out" in failed["quad"]
    assert all(r["ns_per_round"] > 0 for r in rows if "grid" in r and r["part"] != "quad")
    assert "quad at 4 CTAs: RuntimeError" in capsys.readouterr().err


# ---- sabotages: each breaks the protocol of one part, which must then fail ----------------------

def test_a_warp_vote_in_a_block_of_two_warps_fails():
    """exchange_warp_rounds meets by a warp vote, which holds only in a block of one warp. With two
    (5 CTAs of 32 words: the first warp publishes, only the second gathers quads 32-39) the first
    publishes round r+1 into the slot the second, polling, still reads round r-1 from. When the
    second falls behind depends on the host's threads: one of three launches must show it (each
    did in 12 of 12 tries)."""
    for _ in range(3):
        if not _delivered(_run("exchange_warp_vote", 5, width=32, block=64, rounds=60,
                               timeout_ns=20_000_000), rounds=60):
            return
    pytest.fail("three launches of two warps meeting by a warp vote all delivered every round")


def test_quads_in_one_slot_fail(tmp_path):
    """The quads' two slots by round parity: in one, a CTA overwrites round r's quad with r+1's
    while a slower CTA still waits for r's."""
    src = sabotaged(tmp_path, "grid_barrier.cu", "unsigned* slot = words + (size_t)(r & 1) * len;",
                    "unsigned* slot = words;")
    with emulate.modes("schedule", seed=5):
        assert not _delivered(_run("quad", 4, src_dir=src, timeout_ns=20_000_000))


def test_a_local_store_for_the_wrong_cta_fails(tmp_path):
    """cluster_exchange_local_rounds stores locally only this CTA's own copy: taking CTA 0 for
    every CTA's own leaves CTA 0 without the others' words."""
    src = sabotaged(tmp_path, "grid_barrier.cu", "if (cta == (int)blockIdx.x % PRNN_CLUSTER) {",
                    "if (cta == 0) {")
    ran = _run("cluster_local", 4, src_dir=src, timeout_ns=20_000_000)
    assert ran.abort == 1


def test_the_cluster_barrier_is_what_delivers_its_word(tmp_path):
    """Without the barrier in the loop a CTA reads its word before the previous CTA stored it
    (delayed stores land late), or runs ahead and exits while the others still store into it."""
    src = sabotaged(tmp_path, "grid_barrier.cu",
                    "    prnn_cluster_sync();\n    if (threadIdx.x == 0) {\n      wrong",
                    "    if (threadIdx.x == 0) {\n      wrong")
    with emulate.modes("delayed", seed=5):
        try:
            assert _run("cluster_barrier", 4, src_dir=src).errors > 0
        except emulate.EmulationError as exc:
            assert "after that block exited" in str(exc)


def test_a_timer_probe_that_loses_its_last_read_fails(tmp_path):
    src = sabotaged(tmp_path, "grid_barrier.cu", "    last = t;\n", "")
    assert _timer_probe(src) != (50, 1, 50, True)
