"""The runtime: restart loop (with a fake launcher), algorithm dispatch, settings, inject_stall,
and, through the CPU emulation of the same CUDA source, the persistent path end to end."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import chain_graphs, emulate, launch, plan as planner, runtime, tiles
from persistent_rnn.cells import CELLS
from persistent_rnn.stats import RunStats



EXIT_KERNEL = str(Path(__file__).resolve().parent / "cuda" / "chain_exit.cu")  # test-only


class FakeKernel:
    """Plays a persistent kernel in the device-side chain (launch.run_chain): launch i that runs
    steps lets every CTA complete ``done[i]`` steps from its start (CTA 0 one more, as a CTA may
    be a step ahead when the barrier times out); CTAs in ``idle`` leave their progress word
    untouched. Its CTAs then leave the launch through the kernels' own exit (chain.cuh's
    prnn_leave, emulated: tests/cuda/chain_exit.cu), whose last CTA settles it. A resume launch
    reads its start from the chain and exits at once when the pass is done. ``not_resident``:
    each launch that runs steps leaves the abort word "not co-resident"."""

    def __init__(self, done, grid, idle=(), not_resident=False, src_dir=None):
        self.done, self.grid, self.idle, self.launches = list(done), grid, idle, []
        self.not_resident, self.src_dir = not_resident, src_dir  # (src_dir: cuda_src's copy)

    def __call__(self, kernel, grid, block, shared_bytes, args, max_resident=None):
        source = "persistent_backward.cu" if kernel.endswith("backward") else "persistent_forward.cu"
        a = dict(zip((n for n, _ in launch.parameters(source, kernel)), args))
        control, steps, start = a["control"], int(a["steps"]), int(a["start"])
        stall = (int(a["stall_block"]), int(a["stall_step"]), int(a["stall_ns"]))
        assert grid == self.grid and isinstance(a["timeout_ns"], np.uint64)
        progress = control[2:2 + grid].view(np.int32)
        direction = -1 if kernel.endswith("backward") else 1
        end = steps if direction > 0 else -1
        if start == launch.RESUME:
            start = int(control[2 + grid:].view(np.int32)[0])
        if start == end:
            return  # the pass is done: a resume launch exits at once
        assert control[0] == 0 and control[1] == 0 and (progress == -1).all()  # reset
        self.launches.append((start, stall))
        assert len(self.launches) <= len(self.done), "a launch the pattern has no steps for"
        n = self.done[len(self.launches) - 1]
        last = start + direction * (n - 1)
        left = np.full(grid, last if (end - last) * direction > 0 else end - direction, np.int32)
        if n and (end - last - direction) * direction > 0:
            left[0] += direction
        left[list(self.idle)] = -1
        if self.not_resident:
            control[1] = 2  # kPrnnNotResident (exchange.cuh)
        leave = launch.arguments(EXIT_KERNEL, "prnn_test_leave", control=control, progress=left,
                                 end=end, first=start)
        emulate.get_module(EXIT_KERNEL, {}, self.src_dir).launch("prnn_test_leave", grid, 32, 0,
                                                                  leave)


def _fake_engine(fake, backward=False, key=("fake",), src_dir=None):
    """An emulated engine whose pass launch is ``fake`` (its completion kernels are
    device_loop.cu's: of the copy of cuda_src ``src_dir`` where given)."""
    pp = planner.pass_plan(CELLS["lstm"], tiles.SHIPPED["lstm"][0], backward, 16, 2)
    fake.grid = pp.grid
    loop = runtime._loop_launcher(pp, True)
    if src_dir is not None:
        def loop(*args, **kw):
            emulate.get_module(launch.LOOP_SOURCE, runtime.loop_defines(pp), src_dir).launch(
                *args, **kw)
    return launch.Engine(pp, fake, True, key, loop)


def _chain(fake, first, end, backward=False):
    """Run one pass's chain with ``fake``; its ``RunStats`` and the completion's start per run
    (``end``: the completion had nothing to do)."""
    return _pass(launch.Chain(np, _fake_engine(fake, backward), 1), first, end)


def _pass(chain, first, end):
    """One pass of ``chain`` (its engine's fake kernel, then the real completion kernel on zeroed
    buffers): its ``RunStats`` (the record not read yet) and the step the completion started
    from."""
    pp, engine = chain.engine.pass_plan, chain.engine
    buffers = {n: np.zeros(1, np.float32) for n, kind in launch.parameters(pp.source, pp.kernel)
               if kind is None and n != "control"}
    kernel = "prnn_complete_backward" if end < 0 else "prnn_complete_forward"
    own = {"chain", "groups", "grid", "ring", "slots"}
    sizes = dict(steps=10, batch=2, hidden=16, proj=0, chained=0, per_step=0)
    completion = {n: sizes[n] if kind is not None else
                  np.full(2, 10, np.int32) if n == "lengths" else np.zeros(4096, np.float32)
                  for n, kind in launch.parameters(launch.LOOP_SOURCE, kernel) if n not in own}

    class FakePass:  # (``launch.PassIssuer``: never a graph)
        def issue_launch(self, data, start, stall):
            launch.launch_pass(engine, chain.control,
                               dict(buffers, steps=10, batch=2, hidden=16, start=start), stall)

        def issue_completion(self, data):
            chain.complete(kernel, **completion)

        def arguments_key(self, data):
            return None

    stats = launch.run_chain(chain, FakePass(), None, first, end,
                             prnn.settings.current_stall(), "the fake kernel's pass")
    return stats, int(chain.starts[0])


def _restarts(done, first, end, backward=False, idle=()):
    """One pass's chain; returns ((first step left to the completion, restarts), launches that
    ran steps)."""
    fake = FakeKernel(done, 0, idle)
    stats, step = _chain(fake, first, end, backward)
    return (step, stats.restarts), fake.launches


def test_one_launch_completes(settings):
    (step, restarts), launches = _restarts([10], 0, 10)
    assert (step, restarts) == (10, 0) and [s for s, _ in launches] == [0]


def test_restart_resumes_after_the_last_step_every_cta_completed(settings):
    (step, restarts), launches = _restarts([3, 2, 100], 0, 10)
    assert (step, restarts) == (10, 2)
    assert [s for s, _ in launches] == [0, 3, 5]


def test_a_cta_that_never_ran_resumes_from_the_launch_step(settings):
    # CTA 1 completed nothing in any launch: its progress word stays untouched, which means
    # "nothing done since this launch's first step", not "nothing done at all".
    prnn.configure(max_restarts=2)
    (step, restarts), launches = _restarts([4, 3, 3], 0, 10, idle=(1,))
    assert [s for s, _ in launches] == [0, 0, 0] and (step, restarts) == (0, 2)
    (step, restarts), launches = _restarts([4, 4, 4], 0, 10)
    assert [s for s, _ in launches] == [0, 4, 8] and (step, restarts) == (10, 2)


def test_restart_cap_returns_the_step_for_the_completion(settings):
    prnn.configure(max_restarts=1)
    (step, restarts), launches = _restarts([2, 2, 2], 0, 10)
    assert (step, restarts) == (4, 1) and len(launches) == 2


def test_no_progress_is_bounded(settings):
    prnn.configure(max_restarts=3)
    (step, restarts), launches = _restarts([0] * 10, 0, 10)
    assert (step, restarts) == (0, 3) and len(launches) == 4


def test_backward_goes_down(settings):
    (step, restarts), launches = _restarts([3, 100], 9, -1, backward=True)
    assert (step, restarts) == (-1, 1) and [s for s, _ in launches] == [9, 6]
    prnn.configure(max_restarts=0)
    (step, restarts), _ = _restarts([4], 9, -1, backward=True)
    assert (step, restarts) == (5, 0)


def test_stall_reaches_only_the_first_launch(settings):
    with prnn.inject_stall(block=1, step=2, duration_ms=5):
        _, launches = _restarts([3, 100], 0, 10)
    assert launches[0][1] == (1, 2, 5_000_000)
    assert launches[1][1] == (-1, -1, 0)
    _, launches = _restarts([100], 0, 10)
    assert launches[0][1] == (-1, -1, 0)


def test_the_chain_reads_nothing_back(settings):
    with launch.counting() as n:
        (step, restarts), launches = _restarts([3, 2, 100], 0, 10)
    assert (step, restarts) == (10, 2) and n.host_syncs == 0
    # max_restarts 3: the pass, 3 resumes, the completion (each launch settled by its last CTA);
    # the fake's exits are not counted launches
    assert n.launches == 1 + 3 + 1 == launch.chain_launches(3) and n.memsets == 1


# Per pass, the steps each launch completes, and what its record must say (restarts, the step the
# completion started from; 10: none) - max_restarts 3, a forward of 10 steps.
PATTERNS = [([10], (0, 10)), ([3, 2, 100], (2, 10)), ([1, 1, 1, 1], (3, 4)),
            ([4, 100], (1, 10)), ([0, 0, 0, 0], (3, 0))]


def _recorded(stats):
    """(restarts, the completion's first step) as a pass's stats report them (read now)."""
    if stats.fallback is None:
        return stats.restarts, 10
    return stats.restarts, int(stats.fallback.split("steps ")[1].split("..")[0])


def _passes(chain, fake, patterns):
    """``patterns``' passes on one chain, in order; their stats, none read."""
    got = []
    for done in patterns:
        fake.done, fake.launches = list(done), []
        got.append(_pass(chain, 0, 10)[0])
    return got


def _check_records_read_late(chain, fake, seed):
    """Many passes of one chain, their records read only after all ran, in a shuffled order."""
    order = [i % len(PATTERNS) for i in range(3 * len(PATTERNS))]
    stats = _passes(chain, fake, [PATTERNS[i][0] for i in order])
    for i in np.random.default_rng(seed).permutation(len(order)):
        assert _recorded(stats[i]) == PATTERNS[order[i]][1], i


def test_records_of_many_passes_are_read_late_and_out_of_order(settings):
    """The ring (launch.RecordRing) holds each pass's record where the device's numbering put
    it, and the host reads the one its call got, whenever asked: no waiting, no API call."""
    fake = FakeKernel([], 0)
    chain = launch.Chain(np, _fake_engine(fake), 1)
    with launch.counting() as n:
        _check_records_read_late(chain, fake, seed=0)
    assert n.host_syncs == 0 and n.record_reads == 3 * len(PATTERNS)
    assert chain.recorded == int(chain.ledger[0]) == 3 * len(PATTERNS)


# Sabotages of the device-side chain (a copy of cuda_src each, tests/sabotage.py): the last CTA
# to leave found one too early, the exit counter not reset for the next launch, the completion
# not taking back the count of the launch after the last resume.
CHAIN_SABOTAGES = {
    "last CTA off by one": ("chain.cuh", "chain + kChainExits, 1u) == gridDim.x - 1;",
                            "chain + kChainExits, 1u) == gridDim.x - 2;"),
    "exit counter kept": ("chain.cuh", "    chain[kChainExits] = 0u;\n", ""),
    "completion not settling": ("device_loop.cu", "      chain[0] -= 1u;\n", ""),
}


@pytest.mark.parametrize("sabotage", CHAIN_SABOTAGES)
def test_a_sabotaged_chain_fails(settings, tmp_path, sabotage):
    """Each sabotage of the launches' settle or the completion's is caught by the records of
    the passes of ``PATTERNS`` (restarts, the completion's first step)."""
    from sabotage import sabotaged
    src_dir = sabotaged(tmp_path, *CHAIN_SABOTAGES[sabotage])
    fake = FakeKernel([], 0, src_dir=src_dir)
    with pytest.raises(AssertionError) as caught:
        _check_records_read_late(launch.Chain(np, _fake_engine(fake, src_dir=src_dir), 1), fake,
                                 seed=0)


def test_a_sabotaged_record_numbering_fails(settings, monkeypatch):
    """A host that expects the record of the pass before its own (an off-by-one in the sequence
    it reads) is caught."""
    record = launch.DeviceRecord
    monkeypatch.setattr(launch, "DeviceRecord", lambda ring, seq, *a: record(ring, seq - 1, *a))
    fake = FakeKernel([], 0)
    with pytest.raises(AssertionError):
        _check_records_read_late(launch.Chain(np, _fake_engine(fake), 1), fake, seed=0)


def _write_slot(ring, seq, words, first=None, last=None):
    """Slot ``seq % RING_SLOTS`` of ``ring`` as the device leaves it (``first``/``last``: its
    two sequence words where a rewrite is under way)."""
    at = 1 + (seq % launch.RING_SLOTS) * ring.stride
    ring.host[at:at + ring.stride] = [seq if first is None else first, *words,
                                      seq if last is None else last]


def _check_torn_and_overwritten_slots_are_refused():
    ring = launch.RecordRing(np, 1)
    words = [2, 0, 1, 0, 4]  # restarts, flags, completions, unused, completed_from
    _write_slot(ring, 5, words)
    assert ring.fetch(5) == words
    assert ring.fetch(5 + launch.RING_SLOTS) is False  # not written yet: pending
    assert ring.fetch(5 - launch.RING_SLOTS) is None   # overwritten by pass 5
    # The device has begun rewriting the slot for pass 5 + RING_SLOTS: its first word and some
    # of the record are the new pass's, its last word still says 5. A read must not take it.
    _write_slot(ring, 5, [0, 0, 0, 0, 4], first=5 + launch.RING_SLOTS)
    assert ring.fetch(5) is None


def test_torn_and_overwritten_slots_are_refused():
    _check_torn_and_overwritten_slots_are_refused()


def test_a_sabotaged_seqlock_fails(monkeypatch):
    """A read that checks only the slot's last sequence word takes a half-rewritten record."""
    def fetch(ring, seq):
        at = 1 + (seq % launch.RING_SLOTS) * ring.stride
        if int(ring.host[at + ring.stride - 1]) != seq:
            return None if (int(ring.host[at + ring.stride - 1]) - seq) % 2**32 < 2**31 else False
        return ring.host[at + 1:at + ring.stride - 1].tolist()
    monkeypatch.setattr(launch.RecordRing, "fetch", fetch)
    with pytest.raises(AssertionError):
        _check_torn_and_overwritten_slots_are_refused()


def test_a_record_overwritten_unread_is_lost_but_its_cooldown_is_not(settings, monkeypatch):
    """A pass whose grid was found not co-resident, then more passes than the ring holds before
    anyone reads: its own record is gone (``last_run`` says so), the cooldown starts anyway (the
    ring's count of such passes, which the cooldowns read without any record) and once only."""
    monkeypatch.setattr(launch, "RING_SLOTS", 4)
    fake = FakeKernel([], 0, not_resident=True)
    chain = launch.Chain(np, _fake_engine(fake, key=("fake", "overwritten")), 1)
    lost = _passes(chain, fake, [[0, 0, 0, 0]])[0]
    fake.not_resident = False
    later = _passes(chain, fake, [[10]] * 5)
    assert lost.restarts == 0 and lost.fallback is None
    assert any("overwritten before it was read" in d for d in lost.details)
    assert launch.COOLDOWNS.reason(("fake", "overwritten")) is not None
    launch.COOLDOWNS.clear()
    assert later[-1].restarts == 0 and later[-1].fallback is None
    assert launch.COOLDOWNS.reason(("fake", "overwritten")) is None
    del chain, lost, later  # a ring that has gone is no longer read
    import gc
    gc.collect()
    assert ("fake", "overwritten") not in launch.COOLDOWNS._rings


def test_records_of_two_threads_chains(settings):
    """Two threads, each with its chain (``chain_for``: per thread), passes interleaved; every
    record read afterwards, from this thread, in a shuffled order."""
    import threading
    runs = {}

    def run(name):
        fake = FakeKernel([], 0)
        engine = _fake_engine(fake, key=("fake", name))
        order = [(i * 3 + len(name)) % len(PATTERNS) for i in range(2 * len(PATTERNS))]
        chain = launch.chain_for(np, engine, 1)
        stats = []
        for i in order:
            fake.done, fake.launches = list(PATTERNS[i][0]), []
            assert launch.chain_for(np, engine, 1) is chain
            stats.append(_pass(chain, 0, 10)[0])
        runs[name] = order, stats

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "bb")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    pairs = [(o, s) for order, stats in runs.values() for o, s in zip(order, stats)]
    assert len(pairs) == 4 * len(PATTERNS)
    for i in np.random.default_rng(1).permutation(len(pairs)):
        assert _recorded(pairs[i][1]) == PATTERNS[pairs[i][0]][1]


def test_a_stall_entered_in_another_thread_does_not_reach_this_one(settings):
    import threading
    entered, release = threading.Event(), threading.Event()

    def stall_elsewhere():
        with prnn.inject_stall(block=0, step=1, duration_ms=50):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=stall_elsewhere)
    thread.start()
    try:
        assert entered.wait(10)
        (_, restarts), launches = _restarts([100], 0, 10)
    finally:
        release.set()
        thread.join()
    assert launches[0][1] == (-1, -1, 0) and restarts == 0


def _inputs(cell, hidden, batch, steps, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    g = cell.gates

    def f(*shape):
        return rng.standard_normal(shape).astype(dtype) * 0.5

    return (f(steps, batch, g * hidden), f(g * hidden, hidden) * dtype(hidden ** -0.5),
            f(g * hidden), f(batch, hidden), f(batch, hidden) if cell.has_cell_state else None)


def test_dispatch_errors_and_auto_on_numpy():
    cell = CELLS["gru"]
    gi, w, b, h0, c0 = _inputs(cell, 8, 2, 3)
    with pytest.raises(ValueError, match="algo"):
        runtime.run_forward(cell, gi, w, b, h0, c0, None, "fast", RunStats())
    with pytest.raises(ValueError, match="float64"):
        runtime.run_forward(cell, *(_inputs(cell, 8, 2, 3, np.float64)), None, "persistent", RunStats())
    big = _inputs(cell, 1500, 1, 1)
    with pytest.raises(ValueError, match="does not fit"):
        runtime.run_forward(cell, *big, None, "persistent", RunStats())
    stats = RunStats()
    runtime.run_forward(cell, gi, w, b, h0, c0, None, "auto", stats)
    assert stats.algo == "gemm" and stats.fallback is None and stats.restarts == 0


# ---- the persistent path end to end, through the CPU emulation of the same CUDA source ----

def _f64(a):
    return None if a is None else a.astype(np.float64)


def _run_both(cell, hidden, batch, steps, algo="persistent", seed=0):
    gi, w, b, h0, c0 = _inputs(cell, hidden, batch, steps, seed=seed)
    lengths = np.array([steps - (i * 2) % steps for i in range(batch)], np.int32)
    rng = np.random.default_rng(seed + 1)
    dy = rng.standard_normal((steps, batch, hidden)).astype(np.float32)
    dy *= (np.arange(steps)[:, None] < lengths[None, :])[:, :, None]
    dhn = rng.standard_normal((batch, hidden)).astype(np.float32)
    dcn = rng.standard_normal((batch, hidden)).astype(np.float32) if cell.has_cell_state else None
    out = {}
    for name, conv, a in (("got", lambda x: x, algo), ("ref", _f64, "gemm")):
        fs, bs = RunStats(), RunStats()
        fwd = runtime.run_forward(cell, conv(gi), conv(w), conv(b), conv(h0), conv(c0), lengths, a, fs)
        bwd = runtime.run_backward(cell, conv(dy), conv(dhn), conv(dcn), conv(w), conv(h0), conv(c0),
                                   lengths, fwd, a, bs)
        out[name] = (fwd, bwd, fs, bs)
    return out


def _assert_close(got, ref):
    fwd, bwd, _, _ = got
    rfwd, rbwd, _, _ = ref
    pairs = [(fwd.y, rfwd.y), (fwd.saved, rfwd.saved), (fwd.cs, rfwd.cs), (bwd.dgi, rbwd.dgi),
             (bwd.dgh, rbwd.dgh), (bwd.dh0, rbwd.dh0), (bwd.dc0, rbwd.dc0)]
    for a, r in pairs:
        if r is None:
            assert a is None
        elif r.size:
            err = np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)
            assert err <= 1e-5, err


@pytest.fixture
def emulation(settings, grid_path):
    """The emulation on the grid path: these tests stall CTA 1, hold CTAs back and force grid
    tiles (tests/test_emulation.py covers the cluster path too)."""
    return pytest.importorskip("persistent_rnn.emulate")


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_emulated_kernels_match_float64_gemm(emulation, cell):
    out = _run_both(CELLS[cell], 24, 3, 5)
    _assert_close(out["got"], out["ref"])
    for stats in out["got"][2:]:
        assert stats.algo == "persistent" and stats.emulated and stats.restarts == 0
        assert stats.fallback is None


@pytest.mark.parametrize("cell, hidden", [("rnn_tanh", 25), ("gru", 25), ("lstm", 25), ("gru", 26)])
def test_emulated_odd_widths_publish_whole_quads(emulation, cell, hidden):
    # Rows that end inside a quad: H = 25 exchanges 25 values per row forward (3 zeros end the
    # quad; RNN and GRU backward: 25 and 75, 3 and 1), H = 26 26 (2; GRU backward 78, 2), so the
    # writer of a row's last value also publishes the zeros after it; without them every reader
    # of that quad would wait until the deadline.
    out = _run_both(CELLS[cell], hidden, 2, 4)
    _assert_close(out["got"], out["ref"])
    for stats in out["got"][2:]:
        assert stats.algo == "persistent" and stats.restarts == 0 and stats.fallback is None


def test_emulated_stall_restarts_with_identical_results(emulation):
    prnn.configure(emulation_timeout_ms=300)
    cell = CELLS["lstm"]
    plain = _run_both(cell, 24, 2, 5, seed=3)
    with prnn.inject_stall(block=1, step=2, duration_ms=1500):
        stalled = _run_both(cell, 24, 2, 5, seed=3)
    for a, b in zip(plain["got"][:2], stalled["got"][:2]):
        for name in vars(a):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or np.array_equal(x, y), name
    assert stalled["got"][2].restarts >= 1 and stalled["got"][3].restarts >= 1
    assert stalled["got"][2].fallback is None


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_emulated_cap_finishes_on_gemm(emulation, cell):
    prnn.configure(emulation_timeout_ms=300, max_restarts=0)
    with prnn.inject_stall(block=0, step=2, duration_ms=1000):
        out = _run_both(CELLS[cell], 16, 2, 5)
    _assert_close(out["got"], out["ref"])
    fs, bs = out["got"][2:]
    assert fs.algo == "persistent" and "barrier timeouts" in fs.fallback and "barrier timeouts" in bs.fallback
    # Every CTA was resident (one stalled): no residency cooldown, the next call runs persistent.
    assert "co-resident" not in fs.fallback
    again = _run_both(CELLS[cell], 16, 2, 5)
    assert again["got"][2].algo == "persistent" and again["got"][2].fallback is None


def test_emulated_busy_gpu_makes_progress_and_stays_correct(emulation):
    # Only 2 of the 6 CTAs run at once, so no launch can pass a barrier with everyone: each
    # launch still completes at least one step (a late CTA finds the count complete), the
    # restart cap is reached and the GEMM path finishes; the results must not change.
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=2, max_restarts=2)
    out = _run_both(CELLS["gru"], 24, 2, 6)
    _assert_close(out["got"], out["ref"])
    fs, bs = out["got"][2:]
    assert fs.algo == "persistent" and fs.restarts == 2 and "barrier timeouts" in fs.fallback
    assert bs.restarts == 2 and "barrier timeouts" in bs.fallback


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_emulated_largest_tiles(emulation, monkeypatch, fresh_plans, cell):
    # The largest tiles (many rows per warp, K split over warps) normally serve H > 512; force
    # them at a small H so that the emulation checks their code path too.
    tiles_for = planner.tiles_for
    monkeypatch.setattr(planner, "tiles_for", lambda c, dtype="float32": tiles_for(c, dtype)[-1:])
    out = _run_both(CELLS[cell], 26, 2, 3)
    _assert_close(out["got"], out["ref"])
    assert f"'PRNN_UNITS': {tiles_for(CELLS[cell])[-1].units}" in out["got"][2].details[0]


def test_sequences_longer_than_the_step_index_are_refused():
    cell = CELLS["rnn_tanh"]
    gi = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(2**31, 1, 4),
                                         strides=(0, 0, 0))  # no memory behind it
    with pytest.raises(ValueError, match="sequence length 2147483648"):
        runtime._engine(cell, gi, 4, 1, "persistent", backward=False)


def test_a_grid_found_not_co_resident_cools_down_on_gemm(emulation):
    # 2 of 6 CTAs resident: the pass ends on GEMM and says the grid was not co-resident; the next
    # call of that configuration goes straight to GEMM (no launch, no timeout) while the
    # cooldown lasts, with the same results; once it has passed, the kernel is tried again.
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=2, max_restarts=0,
                   residency_cooldown_s=3600)
    first = _run_both(CELLS["gru"], 24, 2, 4)
    fs = first["got"][2]
    assert fs.algo == "persistent" and "not co-resident" in fs.fallback
    cooled = _run_both(CELLS["gru"], 24, 2, 4)
    _assert_close(cooled["got"], cooled["ref"])
    for stats in cooled["got"][2:]:
        assert stats.algo == "gemm" and "residency_cooldown_s" in stats.fallback
    prnn.configure(residency_cooldown_s=0)
    retried = _run_both(CELLS["gru"], 24, 2, 4)
    assert retried["got"][2].algo == "persistent" and "not co-resident" in retried["got"][2].fallback


def _pass_plan(cell, cluster):
    spec = CELLS[cell]
    tile = planner.cluster_tiles_for(spec)[0] if cluster else planner.tiles_for(spec)[0]
    return planner.pass_plan(spec, tile, False, 64, 2)


def test_residency_of_a_cluster_is_the_cluster_occupancy_query():
    def never():
        raise AssertionError("per-block occupancy says nothing about a cluster")

    cluster = _pass_plan("lstm", True)
    assert runtime.residency_problem(cluster, 132, never, lambda: 3) is None
    why = runtime.residency_problem(cluster, 132, never, lambda: 0)
    assert "cluster of 4 CTAs" in why and "cluster occupancy 0" in why
    grid = _pass_plan("lstm", False)  # 16 CTAs

    def no_cluster_query():
        raise AssertionError("a grid kernel has no cluster shape")

    assert runtime.residency_problem(grid, 16, lambda: 1, no_cluster_query) is None
    assert "grid 16 > 8 SMs x 1" in runtime.residency_problem(grid, 8, lambda: 1, no_cluster_query)


@pytest.mark.parametrize("cell, cluster", [("gru", True), ("gru", False)])
def test_cluster_kernels_are_never_launched_cooperatively(monkeypatch, fresh_plans, cell, cluster):
    from persistent_rnn import hardware, kernels
    asked = []

    class FakeModule:
        launch = None

        def max_active_blocks(self, *args):
            return 1

        def max_active_clusters(self, *args):
            return 1

    def get_module(source, defines, cooperative=False):
        asked.append(("PRNN_CLUSTER" in defines, cooperative))
        return FakeModule()

    monkeypatch.setattr(kernels, "get_module", get_module)
    device = hardware.PROFILES["h100"]
    if not cluster:
        monkeypatch.setattr(planner, "has_clusters", lambda dev: False)
    engine, why = runtime._cached_engine(CELLS[cell], 64, 2, False, device, True, False, "float32")
    assert why is None and engine is not None
    assert asked == [(cluster, not cluster)]  # PRNN_COOPERATIVE=1 reaches grid kernels only


@pytest.mark.parametrize("clusters_of_16", [0, 1])
def test_a_sixteen_cta_cluster_that_does_not_fit_is_planned_again_at_eight(monkeypatch, fresh_plans,
                                                                           clusters_of_16):
    """A layer planned as a 16-CTA cluster (4 warps per CTA) on a device whose cluster
    occupancy query finds no room for one (a part with smaller GPCs, a MIG slice) runs as an
    8-CTA cluster of 8 warps, not on the GEMM path; where it fits, it stays at 16."""
    from persistent_rnn import hardware, kernels
    asked = []

    class FakeModule:
        launch = None

        def __init__(self, ctas):
            self.ctas = ctas

        def max_active_clusters(self, *args):
            return clusters_of_16 if self.ctas > 8 else 1

    def get_module(source, defines, cooperative=False):
        asked.append(defines["PRNN_CLUSTER"])
        return FakeModule(defines["PRNN_CLUSTER"])

    monkeypatch.setattr(kernels, "get_module", get_module)
    engine, why = runtime._cached_engine(CELLS["lstm"], 256, 1, False, hardware.PROFILES["h100"],
                                         False, False, "float32")
    assert why is None and engine is not None
    assert engine.pass_plan.grid == (16 if clusters_of_16 else 8)
    assert asked == ([16] if clusters_of_16 else [16, 8])
    assert engine.pass_plan.block == (128 if clusters_of_16 else 256)


def test_launch_config_matches_the_driver_struct():
    import ctypes
    from persistent_rnn import kernels
    # CUlaunchConfig on a 64-bit host: 7 unsigned ints, the stream and attribute pointers at 32
    # and 40, numAttrs at 48, padded to 56.
    assert ctypes.sizeof(kernels.LaunchConfig) == 56
    assert kernels.LaunchConfig.stream.offset == 32 and kernels.LaunchConfig.num_attrs.offset == 48


def test_an_engines_key_tells_apart_launches_of_other_shared_bytes(monkeypatch):
    """The key names a launch's whole shape: a chain graph keyed by it replays that shape, and
    the residency cooldown follows it. Two passes that differ only in their shared bytes (the
    same kernel, defines, grid and block: another batch) have two keys; each hashed once
    (``chain_graphs.Fixed``: the cooldowns look it up every call)."""
    from dataclasses import replace

    from persistent_rnn import emulate, hardware
    monkeypatch.setattr(emulate, "get_module", lambda source, defines: type("M", (), {"launch": None}))
    pass_plan = planner.make_plan("gru", 64, 2, device="h100").forward
    keys = {runtime.engine_of(replace(pass_plan, shared_bytes=n), hardware.PROFILES["h100"],
                              False, True)[0].key
            for n in (pass_plan.shared_bytes, pass_plan.shared_bytes + 16)}
    assert len(keys) == 2 and all(isinstance(k, chain_graphs.Fixed) for k in keys)
