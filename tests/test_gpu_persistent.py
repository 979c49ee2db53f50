"""The persistent kernels on a real GPU: accuracy up to the largest planned sizes, restarts that
do not change results, contention between streams, and compute-sanitizer (all marked ``gpu``)."""
from __future__ import annotations

import contextvars
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import runtime
from persistent_rnn.cells import CELLS
from persistent_rnn.stats import RunStats

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).resolve().parent


def _host_inputs(cell, hidden, batch, steps, seed):
    rng = np.random.default_rng(seed)
    g = cell.gates

    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    lengths = np.array([steps - (3 * i) % steps for i in range(batch)], np.int32)
    dy = f(steps, batch, hidden) * (np.arange(steps)[:, None] < lengths[None, :])[:, :, None]
    return dict(gi=f(steps, batch, g * hidden), w=f(g * hidden, hidden) / np.float32(np.sqrt(hidden)),
                b=f(g * hidden), h0=f(batch, hidden), c0=f(batch, hidden), dy=dy.astype(np.float32),
                dhn=f(batch, hidden), dcn=f(batch, hidden), lengths=lengths)


def _run(cp, cell, host, dtype, algo):
    a = {k: cp.asarray(v, dtype if k != "lengths" else np.int32) for k, v in host.items()}
    c0, dcn = (a["c0"], a["dcn"]) if cell.has_cell_state else (None, None)
    fs, bs = RunStats(), RunStats()
    fwd = runtime.run_forward(cell, a["gi"], a["w"], a["b"], a["h0"], c0, a["lengths"], algo, fs)
    bwd = runtime.run_backward(cell, a["dy"], a["dhn"], dcn, a["w"], a["h0"], c0, a["lengths"], fwd,
                               algo, bs)
    outs = {"y": fwd.y, "saved": fwd.saved, "cs": fwd.cs, "dgi": bwd.dgi, "dgh": bwd.dgh,
            "dh0": bwd.dh0, "dc0": bwd.dc0}
    return outs, fs, bs


def _assert_close(cp, got, ref, tol=1e-5):
    for name, r in ref.items():
        if r is None or r.size == 0:
            continue
        err = float(cp.linalg.norm(got[name].astype(cp.float64) - r) / cp.linalg.norm(r))
        assert err <= tol, (name, err)


def _checked_against_float64(cp, cell, host):
    """Runs ``host``'s inputs through the persistent path in float32 and the GEMM path in float64,
    asserts they agree, and returns the persistent forward's and backward's RunStats."""
    got, fs, bs = _run(cp, cell, host, np.float32, "persistent")
    ref, _, _ = _run(cp, cell, host, np.float64, "gemm")
    _assert_close(cp, got, ref)
    return fs, bs


def _cases():
    for name in sorted(CELLS):
        for hidden, batch, steps in (("small", 8, 5), ("mid", 3, 6), ("max", 1, 6), ("max", 8, 4)):
            yield name, hidden, batch, steps


@pytest.mark.parametrize("name,size,batch,steps", list(_cases()))
def test_matches_float64_gemm(cupy, name, size, batch, steps):
    cell = CELLS[name]
    top = prnn.max_hidden_size(name)
    hidden = {"small": 48, "mid": top // 2 + 7, "max": top}[size]
    host = _host_inputs(cell, hidden, batch, steps, seed=hidden + batch)
    for s in _checked_against_float64(cupy, cell, host):
        assert s.algo == "persistent" and not s.emulated and s.fallback is None


@pytest.mark.parametrize("most, ctas", [(None, 16), (8, 8), (0, 0)])
def test_cluster_placements_match_float64_gemm(cupy, settings, most, ctas):
    """GRU H=256 as a 16-CTA cluster of 4 warps (a non-portable size: the attribute must be set
    for the launch), as an 8-CTA cluster of 8 warps, and on the grid path (max_cluster_ctas)."""
    prnn.configure(max_cluster_ctas=most)
    cell = CELLS["gru"]
    host = _host_inputs(cell, 256, 2, 6, seed=16)
    for s in _checked_against_float64(cupy, cell, host):
        assert s.algo == "persistent" and s.fallback is None and s.restarts == 0
        placed = [d for d in s.details if "prnn_persistent" in d]
        want = f"'PRNN_CLUSTER': {ctas}" if ctas else "PRNN_GATHER_QUADS"
        assert placed and all(want in d for d in placed), placed


def test_many_steps_at_max_size(cupy):
    cell = CELLS["lstm"]
    host = _host_inputs(cell, prnn.max_hidden_size("lstm"), 4, 48, seed=1)
    got, fs, bs = _run(cupy, cell, host, np.float32, "persistent")
    ref, _, _ = _run(cupy, cell, host, np.float64, "gemm")
    _assert_close(cupy, got, ref)
    assert fs.restarts == 0 and bs.restarts == 0


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_tanh"])
def test_stall_restarts_with_bitwise_identical_results(cupy, settings, name):
    prnn.configure(gpu_timeout_ms=20)
    cell = CELLS[name]
    host = _host_inputs(cell, 256, 4, 8, seed=7)
    plain, _, _ = _run(cupy, cell, host, np.float32, "persistent")
    with prnn.inject_stall(block=3, step=4, duration_ms=200):
        stalled, fs, bs = _run(cupy, cell, host, np.float32, "persistent")
    assert fs.restarts >= 1 and bs.restarts >= 1 and fs.fallback is None and bs.fallback is None
    for key, value in plain.items():
        assert (value is None and stalled[key] is None) or bool(cupy.array_equal(value, stalled[key])), key


def test_restart_cap_falls_back_to_gemm(cupy, settings):
    prnn.configure(gpu_timeout_ms=10, max_restarts=0)
    cell = CELLS["lstm"]
    host = _host_inputs(cell, 200, 3, 8, seed=2)
    with prnn.inject_stall(block=0, step=3, duration_ms=100):
        got, fs, bs = _run(cupy, cell, host, np.float32, "persistent")
    ref, _, _ = _run(cupy, cell, host, np.float64, "gemm")
    _assert_close(cupy, got, ref)
    assert "barrier timeouts" in fs.fallback and "barrier timeouts" in bs.fallback


def test_two_streams_more_ctas_than_the_gpu_holds(cupy, settings):
    # Two kernels that each fill every SM, on two streams at once: whether they overlap (and
    # time out, restart or fall back) is up to the GPU's scheduler; either way the results
    # must be right and the stats must say consistently what happened.
    prnn.configure(gpu_timeout_ms=20)
    cell = CELLS["lstm"]
    hidden = prnn.max_hidden_size("lstm")  # one kernel alone fills every SM
    hosts = [_host_inputs(cell, hidden, 2, 24, seed=s) for s in (11, 12)]
    results, errors = [None, None], []

    def worker(i):
        try:
            with cupy.cuda.Stream(non_blocking=True):
                results[i] = _run(cupy, cell, hosts[i], np.float32, "persistent")
                cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:  # reported below, on the main thread
            errors.append(exc)

    # Each thread runs in a copy of this context, so it sees the test's settings.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(worker, i))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(not t.is_alive() for t in threads)
    for host, (got, fs, bs) in zip(hosts, results):
        ref, _, _ = _run(cupy, cell, host, np.float64, "gemm")
        _assert_close(cupy, got, ref)
        for stats in (fs, bs):
            assert stats.algo == "persistent" and 0 <= stats.restarts <= prnn.configure().max_restarts
            assert stats.fallback is None or stats.restarts == prnn.configure().max_restarts, stats


def test_layer_api_persistent_and_auto(cupy):
    x = cupy.asarray(np.random.default_rng(0).standard_normal((7, 4, 12)), np.float32)
    layers = {algo: prnn.LSTM(12, 64, num_layers=2, bidirectional=True, algo=algo, seed=3)
              for algo in ("persistent", "auto", "gemm")}
    outs = {algo: layer.forward(x)[0] for algo, layer in layers.items()}
    assert layers["persistent"].last_run.algo == "persistent"
    assert layers["auto"].last_run.algo == "persistent"
    assert layers["gemm"].last_run.algo == "gemm"
    for algo in ("persistent", "auto"):
        assert float(cupy.abs(outs[algo] - outs["gemm"]).max()) < 1e-5
    big = prnn.LSTM(12, 64, algo="auto", seed=3)
    big.forward(cupy.zeros((3, prnn.configure().auto_max_batch + 1, 12), np.float32) + 0.1)
    assert big.last_run.algo == "gemm" and "batch" in big.last_run.fallback


# The cases racecheck runs (bench/racecheck.py): under it the exchange waits of cluster-fp16-lstm
# and cluster16-fp32-gru time out (docs/benchmarks.md, "Racecheck and the cluster exchange").
RACECHECK_CASES = ("cluster-fp32-gru,cluster-fp32-lstm,cluster-fp32-rnn_tanh,cluster-fp32-rnn_relu,"
                   "grid-fp32-lstm,grid-fp16-gru,grid-fp32-gru")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_is_clean(cupy, tool, tmp_path):
    """Every case of tests/gpu_sanitize_case.py under ``tool`` (racecheck: bench/racecheck.py,
    which passes only the cluster exchange's deliberate pairs); its whole output goes to
    ``$PRNN_SANITIZER_LOGS/sanitizer-<tool>.log`` where that is set (bench/run_gpu_suite.sh),
    written as it runs so that a run cut short still leaves its log."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    env = dict(os.environ, PRNN_TIMEOUT_MS="30000", PRNN_LINEINFO="1")
    log = Path(os.environ.get("PRNN_SANITIZER_LOGS") or tmp_path) / f"sanitizer-{tool}.log"
    if tool == "racecheck":
        command = [sys.executable, str(TESTS.parent / "bench" / "racecheck.py"), "run", "--cases",
                   RACECHECK_CASES, "--case-limit", "60", "--budget", "800", "--sanitizer", sanitizer]
    else:
        command = [sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable,
                   str(TESTS / "gpu_sanitize_case.py")]
    with log.open("w") as sink:
        proc = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True,
                              timeout=840, env=env, cwd=TESTS.parent)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    if tool == "racecheck":
        assert out.rstrip().endswith("racecheck: ok"), out[-4000:]
    else:
        assert "all passed" in out and "ERROR SUMMARY: 0 errors" in out, out[-4000:]


def test_cooperative_launch_option(cupy, settings):
    prnn.configure(cooperative=True)
    cell = CELLS["gru"]
    host = _host_inputs(cell, 300, 2, 5, seed=5)
    fs, _ = _checked_against_float64(cupy, cell, host)
    assert fs.algo == "persistent" and fs.restarts == 0


def test_forward_is_capturable_in_a_cuda_graph(cupy):
    """No host synchronisation inside a forward: captured on a stream, replayed, same results
    (under capture last_run cannot report the replays, and the stats say so). Equal within fp32
    round-off, not bit for bit: the captured input projections run the library's own GEMM
    (matmul.py; CuPy refuses cuBLAS under capture), which sums in another order than cuBLAS."""
    layer = prnn.LSTM(12, 64, num_layers=2, bidirectional=True, algo="persistent", seed=3)
    x = cupy.asarray(np.random.default_rng(1).standard_normal((7, 4, 12)), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        eager = layer.forward(x)[0].get()  # builds and caches the engines, warms the pool
        stream.begin_capture()
        y, _ = layer.forward(x)
        graph = stream.end_capture()
        y[...] = 0
        graph.launch(stream)
        stream.synchronize()
    assert layer.last_run.algo == "persistent"
    assert any("captured" in d for d in layer.last_run.details)
    np.testing.assert_allclose(y.get(), eager, rtol=1e-5, atol=1e-5)
