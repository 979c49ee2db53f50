"""The CPU emulation of cuda_src: the barrier protocol, the pointwise kernels and the persistent
kernels through the public API, on NumPy float32 (compared with float64 and torch.nn)."""
from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, runtime
from persistent_rnn import plan as planner
from persistent_rnn._sources import cuda_src_dir
from persistent_rnn.cells import CELLS, layer_args
from sabotage import sabotaged
from full_set import EVERY_KERNEL

pytestmark = pytest.mark.timeout(240)

TIMEOUT_NS = np.uint64(300_000_000)  # 0.3 s: generous for host threads, short for a test


def _barrier(grid: int, rounds: int, stall=(-1, -1, 0), max_resident=None):
    module = emulate.get_module("grid_barrier.cu", {})
    ctl = np.zeros(2 + grid, np.uint32)
    elapsed = np.zeros(grid, np.uint64)
    args = (ctl, np.int32(rounds), TIMEOUT_NS, np.int32(stall[0]), np.int32(stall[1]),
            np.uint64(stall[2]), elapsed)
    module.launch("grid_barrier_rounds", grid, 64, 0, args, max_resident=max_resident)
    return ctl[0], ctl[1], ctl[2:].view(np.int32), elapsed


def test_grid_barrier_all_ctas_pass_every_round():
    arrivals, abort, progress, elapsed = _barrier(grid=4, rounds=20)
    assert (arrivals, abort) == (80, 0)
    assert progress.tolist() == [19] * 4 and (elapsed > 0).all()


def test_grid_barrier_times_out_on_a_stalled_cta():
    arrivals, abort, progress, _ = _barrier(grid=4, rounds=10, stall=(2, 3, 900_000_000))
    assert abort == 1
    # Every CTA wrote step 3; the others gave up waiting for CTA 2, which on arriving late finds
    # the count complete and may do step 4 before it sees the abort (harmless: replays of a step
    # are idempotent, and the runtime resumes at min(progress) + 1).
    assert progress.min() == 3 and progress.max() <= 4 and sorted(progress)[-2] == 3


def test_a_grid_whose_threads_cannot_start_is_an_error_not_a_crash():
    # Thread creation refused (EAGAIN, seen on a loaded machine) used to terminate the process.
    module = emulate.get_module("grid_barrier.cu", {"PRNN_EMU_THREAD_LIMIT": 2})
    ctl, elapsed = np.zeros(2 + 4, np.uint32), np.zeros(4, np.uint64)
    args = (ctl, np.int32(3), TIMEOUT_NS, np.int32(-1), np.int32(-1), np.uint64(0), elapsed)
    with pytest.raises(emulate.EmulationError, match="cannot start thread 3 of 4"):
        module.launch("grid_barrier_rounds", 4, 64, 0, args)
    assert ctl[0] == 0 and (elapsed == 0).all()  # no CTA ran: none waits for the missing ones


def test_a_whole_h100_grid_of_256_threads_gets_its_fiber_stacks():
    # 33792 fibers: a guard page each would need 67716 mappings, past vm.max_map_count (65530),
    # where mprotect fails and stacks go unguarded unnoticed; guards now stop at a budget and
    # every stack has a canary (below).
    module = emulate.get_module("grid_barrier.cu", {})
    grid = 132
    ctl, elapsed = np.zeros(2 + grid, np.uint32), np.zeros(grid, np.uint64)
    args = (ctl, np.int32(2), TIMEOUT_NS, np.int32(-1), np.int32(-1), np.uint64(0), elapsed)
    module.launch("grid_barrier_rounds", grid, 256, 0, args)
    assert (ctl[0], ctl[1]) == (2 * grid, 0)


STACK_HOG = """
#include "hw.cuh"
// Writes the top `bytes` of a local array larger than a fiber's 128 KiB stack, downwards.
PRNN_KERNEL void stack_hog(float* out, int bytes) {
  volatile unsigned char big[129 * 1024];
  for (int i = 0; i < bytes; i += 64) big[sizeof(big) - 1 - i] = 1;
  out[threadIdx.x] = big[sizeof(big) - 1];
}
"""


def test_a_fiber_that_overflows_an_unguarded_stack_is_reported(tmp_path):
    src = tmp_path / "cuda_src"
    shutil.copytree(cuda_src_dir(), src)
    (src / "stack_hog.cu").write_text(STACK_HOG)
    module = emulate.get_module("stack_hog.cu", {"PRNN_EMU_GUARDED_FIBERS": 0}, src)
    out = np.zeros(32, np.float32)
    module.launch("stack_hog", 1, 32, 0, (out, np.int32(1024)))  # within its stack: fine
    with pytest.raises(emulate.EmulationError, match="block 0: thread 0 overflowed its fiber stack"):
        module.launch("stack_hog", 1, 32, 0, (out, np.int32(129 * 1024)))
    module.launch("stack_hog", 1, 32, 0, (out, np.int32(1024)))  # the broken set is not reused


def test_grid_barrier_times_out_when_ctas_are_not_co_resident():
    arrivals, abort, progress, _ = _barrier(grid=4, rounds=5, max_resident=2)
    assert abort == 1 and arrivals < 4 * 5


def _exchange(grid: int, rounds: int, width: int = 3, stall=(-1, -1, 0), max_resident=None):
    module = emulate.get_module("grid_barrier.cu", {})
    length = grid * width
    exchange = np.zeros((2, -(-length // 4) * 4), np.uint32)
    ctl = np.zeros(2 + grid, np.uint32)
    elapsed, errors = np.zeros(grid, np.uint64), np.zeros(1, np.uint32)
    args = (exchange, ctl, np.int32(rounds), np.int32(width), TIMEOUT_NS,
            np.int32(stall[0]), np.int32(stall[1]), np.uint64(stall[2]), elapsed, errors)
    module.launch("exchange_rounds", grid, 64, 0, args, max_resident=max_resident)
    return ctl[0], ctl[1], ctl[2:].view(np.int32), int(errors[0]), exchange


# 64 threads, 8 quads in flight each: (3, 70) 53 quads; (5, 1), (3, 71) and (3, 69) lengths that
# end inside a quad (its zeros are published too); (5, 241) 302 quads, more than one batch of 8
# per thread.
@pytest.mark.parametrize("grid, width", [(4, 3), (5, 1), (3, 70), (3, 71), (3, 69), (5, 241)])
def test_tagged_exchange_delivers_every_round(grid, width):
    started, abort, progress, errors, exchange = _exchange(grid, rounds=25, width=width)
    assert (started, abort, errors) == (grid, 0, 0)  # every CTA started, no timeout, values right
    assert progress.tolist() == [24] * grid
    tags = exchange & np.uint32(3)  # round r's tag: 1 + (r // 2) % 3
    assert (tags[0] == 1 + 12 % 3).all() and (tags[1] == 1 + 11 % 3).all()  # the quad's zeros too


@pytest.mark.parametrize("step", [0, 4, 9])
def test_tagged_exchange_times_out_on_a_stalled_cta(step):
    _, abort, progress, errors, _ = _exchange(grid=4, rounds=10, width=40,
                                              stall=(2, step, 900_000_000))
    assert errors == 0
    # CTA 2 published nothing of round `step` in time: the others completed step-1 and gave up;
    # CTA 2, late, finds their round `step` words and may complete it before it sees the abort.
    assert abort == 1
    others = np.delete(progress, 2)
    assert (others == step - 1).all() and progress[2] in (step - 1, step)


def test_tagged_exchange_times_out_when_ctas_are_not_co_resident():
    started, abort, progress, errors, _ = _exchange(grid=4, rounds=5, max_resident=2)
    # The abort word says why: a wait timed out while CTAs 2 and 3 had not started (2), where a
    # stalled CTA of a resident grid gives 1 (above).
    assert abort == 2 and started == 4 and errors == 0 and progress.min() < 4


def _abort_reason(src_dir=None) -> tuple[int, int]:
    """abort_reasons on 4 CTAs of which 3 fit (deadlines 50, 100, 150, 200 ms after each starts):
    the CTAs that started and the recorded abort word."""
    module = emulate.get_module("grid_barrier.cu", {}, src_dir)
    ctl = np.zeros(2 + 4, np.uint32)
    module.launch("abort_reasons", 4, 32, 0, (ctl, np.uint64(50_000_000)), max_resident=3)
    return int(ctl[0]), int(ctl[1])


def _check_first_abort_reason_stays(src_dir=None) -> None:
    # The first deadline finds a CTA not started (2); the later ones, after it exited and the last
    # CTA started, find all four (1): the word must keep 2, or no residency cooldown starts.
    assert _abort_reason(src_dir) == (4, 2)


def test_the_first_abort_reason_stays():
    _check_first_abort_reason_stays()


def test_a_plain_store_of_the_abort_word_loses_the_reason(tmp_path):
    src = sabotaged(tmp_path, "exchange.cuh", "prnn_atomic_set_if_zero(&ctl->abort, why);",
                    "prnn_store_relaxed(&ctl->abort, why);")
    with pytest.raises(AssertionError):
        _check_first_abort_reason_stays(src)


def _special_floats(rng) -> np.ndarray:
    """fp32 values across the range (normal, subnormal, the largest, zeros) and every kind of NaN
    and Inf, including NaNs whose payload is only in the two lowest mantissa bits."""
    normal = rng.standard_normal(600) * np.exp2(rng.integers(-126, 127, 600))
    bits = np.array([0x7F800000, 0xFF800000, 0x7F800001, 0xFF800002, 0x7F800003, 0x7FC00000,
                     0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000003, 0x007FFFFF,
                     0x00000000, 0x80000000, 0x3F800003, 0xBF7FFFFF], np.uint32)
    return np.concatenate([normal.astype(np.float32), bits.view(np.float32),
                           rng.standard_normal(40).astype(np.float32)])


def test_tagged_words_round_toward_zero_and_keep_nan_and_inf():
    module = emulate.get_module("grid_barrier.cu", {})
    values = _special_floats(np.random.default_rng(5))
    out, tags = np.empty_like(values), np.empty(values.size, np.uint32)
    module.launch("exchange_word_round_trip", 2, 64, 0, (values, out, tags, np.int32(values.size)))
    assert (tags == 1 + np.arange(values.size) % 3).all()
    nan = np.isnan(values)
    assert (np.isnan(out) == nan).all()  # a NaN whose payload was only in the tag bits stays NaN
    v, o = values[~nan].astype(np.float64), out[~nan].astype(np.float64)
    assert (np.isinf(o) == np.isinf(v)).all() and (o[np.isinf(v)] == v[np.isinf(v)]).all()
    finite = np.isfinite(v)
    # The two tag bits are cleared: toward zero, same sign, at most 3 units in the last place of
    # fp32 (relative error below 2^-21 for normal values; no finite value becomes Inf).
    assert (np.signbit(o) == np.signbit(v)).all() and (np.abs(o) <= np.abs(v)).all()
    assert (values[~nan].view(np.uint32) & ~np.uint32(3) == out[~nan].view(np.uint32)).all()
    normal = finite & (np.abs(v) >= np.finfo(np.float32).tiny)
    assert (np.abs(o[normal] - v[normal]) < np.exp2(-21) * np.abs(v[normal])).all()


def _cluster_exchange(grid: int, rounds: int, width: int = 3, stall=(-1, -1, 0), max_resident=None):
    module = emulate.get_module("grid_barrier.cu", {"PRNN_CLUSTER": grid})
    length = grid * width
    ctl = np.zeros(2 + grid, np.uint32)
    elapsed, errors = np.zeros(grid, np.uint64), np.zeros(1, np.uint32)
    args = (ctl, np.int32(rounds), np.int32(width), TIMEOUT_NS, np.int32(stall[0]),
            np.int32(stall[1]), np.uint64(stall[2]), elapsed, errors)
    module.launch("cluster_exchange_rounds", grid, 64, 8 * -(-length // 4) * 4, args,
                  max_resident=max_resident)
    return ctl[1], ctl[2:].view(np.int32), int(errors[0])


@pytest.mark.parametrize("grid, width", [(4, 3), (8, 1), (2, 67)])
def test_cluster_exchange_delivers_every_round_even_on_a_busy_gpu(grid, width):
    # max_resident=1: a cluster is still resident whole (the GPU schedules clusters whole).
    abort, progress, errors = _cluster_exchange(grid, rounds=25, width=width, max_resident=1)
    assert (abort, errors) == (0, 0) and progress.tolist() == [24] * grid


def test_cluster_exchange_times_out_on_a_stalled_cta():
    abort, progress, errors = _cluster_exchange(4, rounds=10, stall=(1, 5, 900_000_000))
    assert abort == 1 and errors == 0
    assert (np.delete(progress, 1) == 4).all() and progress[1] in (4, 5)


def test_cluster_grid_must_be_whole_clusters():
    module = emulate.get_module("grid_barrier.cu", {"PRNN_CLUSTER": 4})
    args = (np.zeros(8, np.uint32), np.int32(1), np.int32(1), TIMEOUT_NS, np.int32(-1),
            np.int32(-1), np.uint64(0), np.zeros(6, np.uint64), np.zeros(1, np.uint32))
    with pytest.raises(emulate.EmulationError, match="not a multiple of the cluster size 4"):
        module.launch("cluster_exchange_rounds", 6, 32, 64, args)


def _pointwise_inputs(cell, rng, batch=3, hidden=5):
    g, s = cell.gates, cell.saved
    r = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    return dict(gi=r(batch, g * hidden), gh=r(batch, g * hidden), b_hh=r(g * hidden),
                h_prev=r(batch, hidden), c_prev=r(batch, hidden), dy=r(batch, hidden),
                dh_direct=r(batch, hidden), dh_rec=r(batch, hidden), dc=r(batch, hidden),
                lengths=np.array([1, 3, 2], np.int32), batch=batch, hidden=hidden, s=s, g=g)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_pointwise_kernels_equal_numpy_reference(name):
    cell, rng = CELLS[name], np.random.default_rng(7)
    a = _pointwise_inputs(cell, rng)
    module = emulate.get_module("pointwise.cu", {"PRNN_CELL": cell.kind})
    batch, hidden, t = a["batch"], a["hidden"], 1
    h, c = np.zeros((batch, hidden)), np.zeros((batch, hidden))
    saved = np.zeros((batch, max(a["s"], 1) * hidden))
    module.launch("prnn_pointwise_forward_f64", 1, 32, 0,
                  (np.int32(batch), np.int32(hidden), np.int32(t), a["lengths"], a["gi"], a["gh"],
                   a["b_hh"], np.int32(1), a["h_prev"], a["c_prev"], h, c, saved))
    c_prev = a["c_prev"] if cell.has_cell_state else None
    h_ref, c_ref, s_ref = cell.forward(np, a["gi"], a["gh"] + a["b_hh"], a["h_prev"], c_prev)
    active = (t < a["lengths"])[:, None]
    np.testing.assert_allclose(h, np.where(active, h_ref, a["h_prev"]), rtol=1e-13, atol=1e-13)
    if cell.has_cell_state:
        np.testing.assert_allclose(c, np.where(active, c_ref, c_prev), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(saved[:, :s_ref.shape[1]], s_ref, rtol=1e-13, atol=1e-13)

    dgi, dgh = np.zeros_like(a["gi"]), np.zeros_like(a["gi"])
    dh_out, dc_out = np.zeros((batch, hidden)), np.zeros((batch, hidden))
    module.launch("prnn_pointwise_backward_f64", 1, 32, 0,
                  (np.int32(batch), np.int32(hidden), np.int32(t), a["lengths"], a["dy"],
                   a["dh_direct"], a["dh_rec"], a["dc"], saved, h_ref, c_ref if c_ref is not None
                   else h_ref, a["h_prev"], a["c_prev"], dgi, dgh, dh_out, dc_out))
    dh = a["dy"] + a["dh_direct"] + a["dh_rec"]
    dc = a["dc"] if cell.has_cell_state else None
    r_dgi, r_dgh, r_dh, r_dc = cell.backward(np, dh, dc, s_ref, h_ref, c_ref, a["h_prev"], c_prev)
    np.testing.assert_allclose(dgi, np.where(active[:, :, None], r_dgi.reshape(batch, a["g"], hidden), 0).reshape(batch, -1), atol=1e-13)
    np.testing.assert_allclose(dgh, np.where(active[:, :, None], r_dgh.reshape(batch, a["g"], hidden), 0).reshape(batch, -1), atol=1e-13)
    np.testing.assert_allclose(dh_out, np.where(active, r_dh, dh), atol=1e-13)
    if cell.has_cell_state:
        np.testing.assert_allclose(dc_out, np.where(active, r_dc, dc), atol=1e-13)


# ---- the persistent kernels through the public API -------------------------------------------

def _run(name, dtype, algo, x, lengths, hx, dy, dhn, **options):
    mode, kwargs = layer_args(name)
    layer = getattr(prnn, mode)(x.shape[2], options.pop("hidden", 40), dtype=dtype, algo=algo,
                                seed=11, **kwargs, **options)
    cast = lambda a: None if a is None else a.astype(dtype)  # noqa: E731
    hx = tuple(cast(a) for a in hx) if isinstance(hx, tuple) else cast(hx)
    dhn = tuple(cast(a) for a in dhn) if isinstance(dhn, tuple) else cast(dhn)
    y, hn = layer.forward(x.astype(dtype), hx, lengths)
    fwd_stats = layer.last_run
    dx, dhx = layer.backward(dy.astype(dtype), dhn)
    return dict(y=y, hn=hn, dx=dx, dhx=dhx, grads={k: v.copy() for k, v in layer.grads.items()},
                fwd=fwd_stats, bwd=layer.last_run, layer=layer)


def _inputs(name, rng, steps=7, batch=3, inputs=6, hidden=40, layers=1, directions=1):
    states = layers * directions
    h0 = rng.standard_normal((states, batch, hidden))
    pair = CELLS[name].has_cell_state
    hx = (h0, rng.standard_normal((states, batch, hidden))) if pair else h0
    dhn = ((rng.standard_normal((states, batch, hidden)),) * 2 if pair
           else rng.standard_normal((states, batch, hidden)))
    return dict(x=rng.standard_normal((steps, batch, inputs)),
                lengths=np.array([steps, 2, steps - 3][:batch]), hx=hx,
                dy=rng.standard_normal((steps, batch, directions * hidden)), dhn=dhn)


def _flat(out):
    parts = [out["y"], out["dx"], *np.atleast_1d(out["hn"]), *np.atleast_1d(out["dhx"])]
    parts = [p for item in parts for p in (item if isinstance(item, tuple) else (item,))]
    return parts + [out["grads"][k] for k in sorted(out["grads"])]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# The emulation plans for an H100 (runtime.EMULATED_DEVICE), where small layers run as one
# thread-block cluster; the grid_path fixture (conftest) plans without clusters.
@pytest.fixture(params=["cluster", "cluster of 8 warps", "grid"])
def path(request, monkeypatch, fresh_plans):
    """Runs the test on every exchange path: one cluster (distributed shared memory) of the
    preferred 4-warp CTAs, or of 8-warp CTAs (what a device without 16-CTA clusters runs above
    H 128), and the grid (tagged words in global memory); _assert_path checks the planner chose
    it."""
    if request.param == "grid":
        request.getfixturevalue("grid_path")
    if request.param == "cluster of 8 warps":
        eight_warps = planner.cluster_tiles_for
        monkeypatch.setattr(planner, "cluster_tiles_for",
                            lambda cell, dtype="float32": eight_warps(cell, dtype)[1:])
    return request.param


def _assert_path(stats, path):
    clustered = any("PRNN_CLUSTER" in d for d in stats.details)
    assert clustered == path.startswith("cluster"), stats.details
    if clustered:
        warps = 8 if path == "cluster of 8 warps" else 4
        assert all(f"'PRNN_WARPS': {warps}" in d for d in stats.details if "PRNN_CLUSTER" in d)


# The relu RNN runs the tanh RNN's tiles with another activation: CI runs it on the grid path,
# the full set (PRNN_TEST_EVERY_KERNEL=1) on every path.
PATH_CASES = [(name, path) for name in sorted(CELLS)
              for path in ("cluster", "cluster of 8 warps", "grid")
              if EVERY_KERNEL or name != "rnn_relu" or path == "grid"]


@pytest.mark.parametrize("name,path", PATH_CASES, indirect=["path"])
def test_persistent_equals_float64_reference_and_torch(name, path):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    data = _inputs(name, rng)
    got = _run(name, "float32", "persistent", **data)
    ref = _run(name, "float64", "gemm", **data)
    assert got["fwd"].algo == "persistent" and got["fwd"].emulated and got["fwd"].fallback is None
    _assert_path(got["fwd"], path)
    _assert_path(got["bwd"], path)
    assert got["bwd"].algo == "persistent" and got["bwd"].restarts == 0
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5

    if not CELLS[name].in_torch:
        return  # torch.nn has no such layer: the float64 layer above is its reference
    mode, kwargs = layer_args(name)
    module = getattr(torch.nn, mode)(6, 40, dtype=torch.float64, **kwargs)
    module.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64))
                            for k, v in got["layer"].params.items()})
    x = torch.from_numpy(data["x"]).requires_grad_()
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.from_numpy(data["lengths"]),
                                                     enforce_sorted=False)
    pair = CELLS[name].has_cell_state
    hx = (tuple(torch.from_numpy(h) for h in data["hx"]) if pair
          else torch.from_numpy(data["hx"]))
    y, hn = module(packed, hx)
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])
    loss = (y * torch.from_numpy(data["dy"])).sum()
    for h, dh in zip(hn if pair else (hn,), data["dhn"] if pair else (data["dhn"],)):
        loss = loss + (h * torch.from_numpy(dh)).sum()
    loss.backward()
    assert _rel(got["y"], y.detach().numpy()) <= 1e-5
    assert _rel(got["dx"], x.grad.numpy()) <= 1e-5
    for key, p in module.named_parameters():
        assert _rel(got["grads"][key], p.grad.numpy()) <= 1e-5, key


@pytest.mark.parametrize("name, hidden", [("lstm", 250), ("gru", 256), ("rnn_tanh", 500)])
def test_a_sixteen_cta_cluster_equals_float64(name, hidden):
    """The largest cluster layers: 16 CTAs of 4 warps (CTA 15 partly past H at 250 and 500),
    forward and backward, against the float64 GEMM path."""
    data = _inputs(name, np.random.default_rng(12), steps=4, batch=2, hidden=hidden)
    got = _run(name, "float32", "persistent", **data, hidden=hidden)
    ref = _run(name, "float64", "gemm", **data, hidden=hidden)
    for stats in (got["fwd"], got["bwd"]):
        assert stats.algo == "persistent" and stats.restarts == 0 and stats.fallback is None
        assert any("'PRNN_CLUSTER': 16" in d and "x 128 threads" in d for d in stats.details)
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("most, placement", [(None, "'PRNN_CLUSTER': 16"), (8, "'PRNN_CLUSTER': 8"),
                                             (0, "prnn_persistent_forward")])
def test_max_cluster_ctas_picks_the_placement(settings, most, placement):
    """``max_cluster_ctas`` caps the cluster a layer runs as: 16 CTAs of 4 warps by default
    (H 256), 8 of 8 warps at the portable size, the grid path at 0 - the same results."""
    prnn.configure(max_cluster_ctas=most)
    data = _inputs("gru", np.random.default_rng(13), steps=3, batch=1, hidden=256)
    got = _run("gru", "float32", "persistent", **data, hidden=256)
    ref = _run("gru", "float64", "gemm", **data, hidden=256)
    (detail,) = [d for d in got["fwd"].details if "prnn_persistent_forward" in d]
    assert placement in detail and (most != 0 or "PRNN_CLUSTER" not in detail), detail
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("name", ["gru", "rnn_relu"])
def test_persistent_odd_hidden_size_equals_float64(name, path):
    """H = 13: exchange rows of odd length (H forward, 3H for the GRU backward) end in a padding
    word nobody publishes, which the gather must not wait for."""
    data = _inputs(name, np.random.default_rng(8), hidden=13)
    got = _run(name, "float32", "persistent", **data, hidden=13)
    ref = _run(name, "float64", "gemm", **data, hidden=13)
    _assert_path(got["fwd"], path)
    assert got["fwd"].restarts == got["bwd"].restarts == 0 and got["bwd"].fallback is None
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


def test_persistent_bidirectional_two_layers_equals_float64(path, settings):
    prnn.configure(stack=False)  # the layer kernels' paths (stack mode: test_stack_kernel)
    rng = np.random.default_rng(5)
    data = _inputs("gru", rng, layers=2, directions=2, hidden=24)
    got = _run("gru", "float32", "persistent", **data, hidden=24, num_layers=2, bidirectional=True)
    ref = _run("gru", "float64", "gemm", **data, hidden=24, num_layers=2, bidirectional=True)
    assert got["fwd"].algo == "persistent"
    _assert_path(got["fwd"], path)
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("name, step", [("lstm", 0), ("lstm", 3), ("gru", 6), ("rnn_tanh", 3)])
def test_stall_restarts_with_bitwise_identical_results(settings, path, name, step):
    """A stall at the first, a middle and the last step (T = 7) of the forward; the backward runs
    down, so its first step is the forward's last. Nobody waits on a pass's final step: a stall
    there only delays that CTA. (H = 72: CTA 1 owns units on both paths, in the RNN's cluster of
    64 units per CTA too.)"""
    prnn.configure(emulation_timeout_ms=300)
    data = _inputs(name, np.random.default_rng(9), hidden=72)
    plain = _run(name, "float32", "persistent", **data, hidden=72)
    with prnn.inject_stall(block=1, step=step, duration_ms=1200):
        stalled = _run(name, "float32", "persistent", **data, hidden=72)
    _assert_path(stalled["fwd"], path)
    assert (stalled["fwd"].restarts >= 1) == (step != 6) and stalled["fwd"].fallback is None
    assert (stalled["bwd"].restarts >= 1) == (step != 0) and stalled["bwd"].fallback is None
    for a, b in zip(_flat(plain), _flat(stalled)):
        assert np.array_equal(a, b)


# The grid's forward tiles whose warps finish their own units (plan.warp_teams) beyond the
# smallest, which the tests above run at H = 40 and 72: LSTM's 8-unit tiles.
TEAM_TILES = [t for t in planner.tiles_for(CELLS["lstm"])
              if t.units == 8 and planner.warp_teams(CELLS["lstm"], t.forward)]


@pytest.mark.parametrize("tile", TEAM_TILES, ids=lambda t: f"kpt{t.forward.kpt}")
def test_grid_warp_teams_equal_float64_and_restart_bitwise(settings, grid_path, fresh_plans,
                                                           monkeypatch, tile):
    """LSTM on an 8-unit warp-team grid tile (one block barrier per step, h staged by parity),
    H = 19: the last CTA's warps 3-7 own no unit but still gather and meet the barrier. Each
    CTA's last warp lags (PRNN_EMU_LAGGING_WARP): the others publish and gather the next h while
    it still multiplies the last one, which one staged buffer would not survive. Equal to
    float64, and a stall of CTA 1 at step 3 restarts to bitwise the same results."""
    assert len(TEAM_TILES) >= 2
    monkeypatch.setattr(planner, "tiles_for", lambda c, dtype="float32": (tile,))
    build = emulate.get_module
    monkeypatch.setattr(emulate, "get_module", lambda source, defines: build(
        source, {**defines, "PRNN_EMU_LAGGING_WARP": 8}))
    prnn.configure(emulation_timeout_ms=300)
    data = _inputs("lstm", np.random.default_rng(14), steps=5, batch=2, hidden=19)
    got = _run("lstm", "float32", "persistent", **data, hidden=19)
    ref = _run("lstm", "float64", "gemm", **data, hidden=19)
    assert f"'PRNN_KPT': {tile.forward.kpt}" in got["fwd"].details[0], got["fwd"].details
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5
    with prnn.inject_stall(block=1, step=3, duration_ms=1200):
        stalled = _run("lstm", "float32", "persistent", **data, hidden=19)
    assert stalled["fwd"].restarts >= 1 and stalled["fwd"].fallback is None
    for a, b in zip(_flat(got), _flat(stalled)):
        assert np.array_equal(a, b)


def test_ctas_not_co_resident_end_on_gemm_fallback(settings, grid_path):  # a cluster runs whole
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=1, max_restarts=1)
    data = _inputs("gru", np.random.default_rng(4))
    got = _run("gru", "float32", "persistent", **data)
    ref = _run("gru", "float64", "gemm", **data)
    assert got["fwd"].algo == "persistent" and "barrier timeouts" in got["fwd"].fallback
    assert "barrier timeouts" in got["bwd"].fallback
    again = _run("gru", "float32", "persistent", **data)  # the cooldown started: no timeouts now
    assert "residency_cooldown_s" in again["fwd"].fallback and again["fwd"].restarts == 0
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


def test_a_cluster_runs_whole_on_a_busy_gpu(settings):
    """A cluster's CTAs are co-scheduled (the GPU places a cluster whole or not at all): the
    emulation runs them together however few CTAs it may otherwise hold at once."""
    prnn.configure(emulation_max_resident=1)
    data = _inputs("lstm", np.random.default_rng(4))
    got = _run("lstm", "float32", "persistent", **data)
    ref = _run("lstm", "float64", "gemm", **data)
    _assert_path(got["fwd"], "cluster")
    assert got["fwd"].restarts == 0 and got["fwd"].fallback is None and got["bwd"].fallback is None
    for a, b in zip(_flat(got), _flat(ref)):
        assert _rel(a, b) <= 1e-5


def test_missing_host_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(emulate.EmulationError, match="host C\\+\\+ compiler"):
        emulate.host_compiler()


def _barrier_args(grid, timeout_ns, stall_ns):  # grid_barrier_rounds
    return (np.zeros(2 + grid, np.uint32), np.int32(4), np.uint64(timeout_ns), np.int32(1),
            np.int32(2), np.uint64(stall_ns), np.zeros(grid, np.uint64))


def test_launch_arguments_are_checked_against_the_kernel_signature():
    module = emulate.get_module("grid_barrier.cu", {})
    args = _barrier_args(3, 10**8, 0)
    with pytest.raises(TypeError, match="expected 7 arguments, got 6"):
        module.launch("grid_barrier_rounds", 3, 32, 0, args[:-1])
    with pytest.raises(TypeError, match="argument 2 must be np.uint64, got int32"):
        module.launch("grid_barrier_rounds", 3, 32, 0, (*args[:2], np.int32(5), *args[3:]))
    with pytest.raises(TypeError, match="argument 0 must be an array, got uint64"):
        module.launch("grid_barrier_rounds", 3, 32, 0, (np.uint64(0), *args[1:]))
    with pytest.raises(ValueError, match="block must be in 1..1024, got 2048"):
        module.launch("grid_barrier_rounds", 3, 2048, 0, args)


def test_watchdog_ends_a_launch_whose_barrier_would_wait_for_ever():
    module = emulate.get_module("grid_barrier.cu", {"PRNN_EMU_WATCHDOG_S": 1})
    args = _barrier_args(3, 10**15, 10**15)  # a stall and a barrier timeout of 11 days
    start = time.monotonic()
    with pytest.raises(emulate.EmulationError, match="watchdog"):
        module.launch("grid_barrier_rounds", 3, 32, 0, args)
    assert time.monotonic() - start < 5
    # Every CTA ran to its end (the watchdog moves the emulated clock past every deadline; the
    # stalled CTA may then arrive in time, so whether the barrier aborted is not fixed).
    assert (args[-1] > 0).all()
