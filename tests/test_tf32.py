"""TF32 on the tensor cores (``settings.allow_tf32``, issue 28): the instruction, then the tiles.

* ``prnn_tf32_bits`` (cvt.rna.tf32.f32) rounds to nearest, ties away from zero, in the emulation.
* ``prnn_mma_tf32`` (mma.sync m16n8k8 .tf32, fp32 accumulation) through
  tests/cuda/mma_fragments.cu (dtype 3): random fp32 A, B and C, rounded by the kernel, against
  float64 products of the rounded operands; swapping two lanes' fragments fails it; the source
  compiles to HMMA.1688.F32.TF32.
* The TF32 tiles (``tiles.TF32_TILES``, ``MMA_CLUSTER_TILES`` for fp32 layers; emulated), forward
  and backward: with ``allow_tf32`` y, h_n, c_n and every gradient against the float64 layer
  within docs/api.md's TF32 bound, bitwise run to run; a step of the relu RNN forward and back,
  element by element, within the documented per-product bound and equal to float64 of the
  TF32-rounded operands up to fp32's sums (an operand left unrounded fails it); B = 17 (three
  n-tiles); a stall restarts bitwise identically; the planner takes them only where allowed and
  from ``plan.TF32_MIN_BATCH`` / ``TF32_BACKWARD_MIN_BATCH`` rows, where the latency model puts
  the lines; prnn.torch's modules follow the library's setting, not torch's TF32 flags.
  CI: LSTM on the grid, GRU in a cluster, B 17, one stall; ``PRNN_TEST_EVERY_KERNEL=1``: every
  cell on both placements, B 1 to 32, both stalls, and batch groups against the whole batch.
* Every float32 GEMM in TF32 with the setting (``matmul.matmul``): ``matmul.tf32_rounded`` is the
  emulated cvt.rna; NumPy products are float64 of the rounded operands up to fp32's sums (off,
  and for float64, numpy.matmul's bits); the GEMM path's LSTM (``EVERY_KERNEL``: and GRU) within
  the bound of float64 and not fp32's bits; a planned call bitwise the full path's in TF32; the
  model prices the GEMMs at TF32's rate. GPU: the TF32 product not fp32's and within the bound,
  eager and captured the same bits, CuPy's compute type untouched; a planned TF32 call's replays
  the full path's bits.
"""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, matmul
from persistent_rnn import plan as planner
from persistent_rnn.cells import layer_args

from full_set import EVERY_KERNEL
from test_mma import EMULATED_ULPS, SOURCE, SWAPS, _within

TF32 = 3  # mma_fragments.cu's dtype code


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to TF32, to nearest, ties away from zero (finite values)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)).view(np.float32)


def _operands(warps: int, seed: int) -> dict[str, np.ndarray]:
    """Random fp32 A (16 x 8), B (8 x 8), C (16 x 8) per warp, over a few binades."""
    rng = np.random.default_rng(seed)
    scale = lambda *shape: np.exp2(rng.integers(-3, 4, shape))
    a = (rng.standard_normal((warps, 16, 8)) * scale(warps, 16, 1)).astype(np.float32)
    b = (rng.standard_normal((warps, 8, 8)) * scale(warps, 1, 8)).astype(np.float32)
    c = (rng.standard_normal((warps, 16, 8)) * 4).astype(np.float32)
    return {"a": a, "b": b, "c": c}


def _launch(module, xp, ops, swap=(0, 0, 0), warps_per_block=2):
    warps = ops["a"].shape[0]
    a = np.ascontiguousarray(ops["a"]).view(np.uint32)
    bt = np.ascontiguousarray(ops["b"].transpose(0, 2, 1)).view(np.uint32)
    d, e = xp.full((warps, 16, 8), np.nan, np.float32), xp.full((warps, 16, 8), np.nan, np.float32)
    args = (xp.asarray(a), xp.asarray(bt), xp.asarray(ops["c"]), d, e, np.int32(TF32),
            np.int32(0), *(np.int32(s) for s in swap))
    module.launch("mma_m16n8k16", warps // warps_per_block, 32 * warps_per_block,
                  512 * warps_per_block, args)
    return [x if xp is np else x.get() for x in (d, e)]


def _matches(ops, d, e, ulps: int = EMULATED_ULPS) -> bool:
    """D = A B + C and E = A B + D with A and B rounded to TF32 (9 terms: within 16 ulps)."""
    a, b = _round_tf32(ops["a"]), _round_tf32(ops["b"])
    return _within(d, a, b, ops["c"], ulps) and _within(e, a, b, d, ulps)


@pytest.fixture(scope="module")
def fragments():
    return emulate.get_module(SOURCE, {})


def test_tf32_rounding_is_to_nearest_ties_away():
    # 1 + k 2^-23 for k around the half unit (2^-11 = 4096 units of 2^-23), both signs
    module = emulate.get_module(SOURCE, {})
    ops = {"a": np.zeros((2, 16, 8), np.float32), "b": np.zeros((2, 8, 8), np.float32),
           "c": np.zeros((2, 16, 8), np.float32)}
    ks = np.array([0, 1, 4095, 4096, 4097, 8191, 8192, 12288], np.uint32)
    row = (np.float32(1.0).view(np.uint32) + ks).view(np.float32)
    ops["a"][0, 0, :] = row
    ops["a"][1, 0, :] = -row
    ops["b"][:, 0, 0] = 1.0  # D[0][0] = A[0][0]: read each value back through B's first column
    got = []
    for j in range(8):
        ops["b"][:, :, 0] = 0.0
        ops["b"][:, j, 0] = 1.0
        d, _ = _launch(module, np, ops)
        got.append(d[:, 0, 0])
    got = np.array(got).T
    want = np.float32(1.0) + np.array([0, 0, 0, 1, 1, 1, 1, 2], np.float32) * np.float32(2.0**-10)
    assert np.array_equal(got[0], want) and np.array_equal(got[1], -want)
    assert np.array_equal(got[0], _round_tf32(row))


@pytest.mark.parametrize("seed", range(3))
def test_emulated_tf32_mma_is_a_plain_product(fragments, seed):
    ops = _operands(warps=4, seed=seed)
    d, e = _launch(fragments, np, ops)
    assert _matches(ops, d, e)
    # the operands' rounding shows: the unrounded product is farther than the bound allows
    assert not _within(d, ops["a"], ops["b"], ops["c"], 1)


@pytest.mark.parametrize("operand", SWAPS)
@pytest.mark.parametrize("lanes", [(0, 1), (3, 20), (9, 31)])
def test_swapped_tf32_fragments_fail_the_layout_test(fragments, operand, lanes):
    ops = _operands(warps=2, seed=3)
    d, e = _launch(fragments, np, ops, swap=(SWAPS[operand], *lanes))
    assert not _matches(ops, d, e)
    d, e = _launch(fragments, np, ops, swap=(SWAPS[operand], lanes[0], lanes[0]))
    assert _matches(ops, d, e)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32_mma_compiles_to_hmma(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels, sass_analysis
    compiled = kernels.compile_source(SOURCE, {}, arch)
    code, _ = sass_analysis.parse(sass_analysis.disassemble(compiled.cubin_path,
                                                            sass_analysis.nvdisasm()))
    opcodes = [op for op, *_ in code]
    assert opcodes.count("HMMA.1688.F32.TF32") == 2, sorted(set(opcodes))


@pytest.mark.gpu
def test_gpu_tf32_mma_is_a_plain_product(cupy):
    from persistent_rnn import kernels
    from test_mma import GPU_ULPS
    gpu = kernels.get_module(SOURCE, {})
    for seed in range(4):
        ops = _operands(warps=8, seed=seed)
        d, e = _launch(gpu, cupy, ops)
        assert _matches(ops, d, e, GPU_ULPS), seed
    d, e = _launch(gpu, cupy, ops, swap=(SWAPS["A"], 3, 20))
    assert not _matches(ops, d, e, GPU_ULPS)


# ---- the TF32 forward tiles -------------------------------------------------------------------
TOLERANCE = 5e-3  # docs/api.md, "TF32": relative to max |float64|, the fp16 layers' bound
RELU_TF32_GRADIENTS = 1e-4  # the relu RNN's gradients against the GEMM path's TF32 (6.3e-6 seen)
CASES = [("lstm", "grid"), ("gru", "cluster")]
if EVERY_KERNEL:
    CASES = [(c, p) for c in ("lstm", "gru", "rnn_tanh", "rnn_relu") for p in ("grid", "cluster")]
BATCHES = (1, 8, 17, 32) if EVERY_KERNEL else (17,)


@pytest.fixture
def tf32(settings, fresh_plans, monkeypatch):
    """TF32 allowed, a generous barrier timeout, and the TF32 tiles (forward and backward) taken
    at every batch."""
    prnn.configure(emulation_timeout_ms=20_000, allow_tf32=True)
    monkeypatch.setattr(planner, "TF32_MIN_BATCH", {"grid": 1, "cluster": 1})
    monkeypatch.setattr(planner, "TF32_BACKWARD_MIN_BATCH", 1)


def _layers(name: str, hidden: int, algo: str = "persistent"):
    mode, kw = layer_args(name)
    kern = getattr(prnn, mode)(5, hidden, algo=algo, seed=7, **kw)
    ref = getattr(prnn, mode)(5, hidden, dtype="float64", algo="gemm", **kw)
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    return kern, ref


def _data(layer, steps: int, batch: int, seed: int, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps, batch, 5))
    shape = (1, batch, layer.hidden_size)
    hx = tuple(rng.standard_normal(shape) * 0.5 for _ in range(2 if layer.cell.has_cell_state else 1))
    dy = rng.standard_normal((steps, batch, layer.hidden_size))
    dhn = tuple(rng.standard_normal(shape) for _ in hx)
    cast = lambda a: tuple(v.astype(dtype) for v in a) if len(a) > 1 else a[0].astype(dtype)  # noqa: E731
    return x.astype(dtype), cast(hx), dy.astype(dtype), cast(dhn)


def _run(layer, data) -> list[np.ndarray]:
    """Forward and backward: y, h_n (c_n), dx, dhx, the parameter gradients, as float64."""
    x, hx, dy, dhn = data
    flat = lambda a: list(a) if isinstance(a, tuple) else [a]  # noqa: E731
    y, hn = layer.forward(x, hx)
    layer.zero_grad()
    dx, dhx = layer.backward(dy, dhn)
    host = lambda a: np.asarray(a.get() if hasattr(a, "get") else a, np.float64)  # noqa: E731 (CuPy)
    return [host(a) for a in [y, *flat(hn), dx, *flat(dhx), *layer.grads.values()]]


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _ran_tf32(run, cluster: bool, backward: bool = False) -> None:
    """``run`` (a layer's ``last_run`` or a backward's stats) ran the TF32 tile of its pass."""
    assert run.algo == "persistent" and run.emulated and run.fallback is None
    assert f"'PRNN_MMA': {1 + backward}" in run.details[0], run.details
    assert "PRNN_WEIGHT_DTYPE" not in run.details[0]
    assert ("PRNN_CLUSTER" in run.details[0]) == cluster, run.details


def _check(name: str, hidden: int, batch: int, cluster: bool) -> None:
    kern, ref = _layers(name, hidden)
    data = _data(kern, 4, batch, 3)
    kern.forward(*data[:2])
    _ran_tf32(kern.last_run, cluster)
    got = _run(kern, data)
    _ran_tf32(kern.last_run, cluster, backward=True)
    want = _run(ref, _data(kern, 4, batch, 3, np.float64))
    # (the relu RNN's gradients have no float64 bound: a pre-activation near zero that the TF32
    # operands move across it flips relu's derivative - docs/api.md, "TF32"; they are held to
    # the GEMM path's TF32 computation instead, up to the order of fp32 sums)
    forward = 2 + kern.cell.has_cell_state  # y, h_n (, c_n)
    tf32_gemm = _run(_layers(name, hidden, algo="gemm")[0], data) if name == "rnn_relu" else None
    for i, (a, r) in enumerate(zip(got, want)):
        if name == "rnn_relu" and i >= forward:
            assert _relerr(a, tf32_gemm[i]) <= RELU_TF32_GRADIENTS, i
        else:
            assert _relerr(a, r) <= TOLERANCE, i
    fresh = _data(kern, 4, batch, 4)  # run to run, on fresh inputs: bitwise
    assert all(np.array_equal(a, b) for a, b in zip(_run(kern, fresh), _run(kern, fresh)))


@pytest.mark.parametrize("name,placement", CASES)
def test_tf32_forward_matches_float64(tf32, request, name, placement):
    if placement == "grid":
        request.getfixturevalue("grid_path")
        _check(name, hidden=40, batch=9, cluster=False)
    else:
        _check(name, hidden=24, batch=3, cluster=True)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", ["rnn_tanh", "rnn_relu"] if EVERY_KERNEL else ["rnn_relu"])
def test_tf32_step_within_the_product_bound(tf32, grid_path, name, batch):
    # One step from h0: |h1 - h1_64| <= 2^-10 sum_j (|W_ij h0_j| + |W_ih x|) (+ fp32's sums)
    # element by element, as tanh' and relu' are at most 1 (docs/api.md, "TF32": the kernel's
    # product and the input projection's GEMM both in TF32).
    kern, ref = _layers(name, 40)
    x, h0, _, _ = _data(kern, 1, batch, batch)
    y, _ = kern.forward(x, h0)
    _ran_tf32(kern.last_run, cluster=False)
    y64, _ = ref.forward(x.astype(np.float64), h0.astype(np.float64))
    w = np.abs(kern.params["weight_hh_l0"].astype(np.float64))
    products = np.abs(h0[0].astype(np.float64)) @ w.T
    terms = products + np.abs(x[0].astype(np.float64)) @ np.abs(kern.params["weight_ih_l0"]).T
    fp32_sums = 2.0**-20 * (terms + 1.0)
    assert (np.abs(y[0] - y64[0]) <= 2.0**-10 * terms + fp32_sums).all()
    assert not (np.abs(y[0] - y64[0]) <= fp32_sums).all()  # TF32's rounding shows
    # and it is the rounding documented: float64 of W_hh and h0, x and W_ih rounded to TF32
    # (cvt.rna) gives the same step up to fp32's sums (relu: no activation's approximation in
    # between)
    ref.load_params(dict(ref.params, **{k: _round_tf32(kern.params[k]).astype(np.float64)
                                        for k in ("weight_hh_l0", "weight_ih_l0")}))
    y_rounded, _ = ref.forward(_round_tf32(x).astype(np.float64),
                               _round_tf32(h0).astype(np.float64))
    if name == "rnn_relu":
        assert (np.abs(y[0] - y_rounded[0]) <= fp32_sums).all()


@pytest.mark.parametrize("batch", BATCHES)
def test_tf32_backward_step_within_the_product_bound(tf32, grid_path, batch, monkeypatch):
    # Two steps of the relu RNN back. The kernel's one product: dh_0 = dy_0 + dgh_1 W_hh, with
    # dgh_t = dh_t relu'(pre_t) from the run's own y; then dhx = dgh_0 W_hh (a GEMM after the
    # kernel, kept fp32 here: test_tf32_products_* hold its TF32). dh_0 within 2^-10
    # sum_j |dgh_1j W_ji| of float64 (seen through dhx), and equal to the product of the
    # TF32-rounded operands up to fp32's sums.
    monkeypatch.setattr(matmul, "tf32_rounded", lambda x, out=None: x)
    kern, _ = _layers("rnn_relu", 40)
    x, h0, dy, dhn = _data(kern, 2, batch, batch)
    y, _ = kern.forward(x, h0)
    kern.zero_grad()
    _, dhx = kern.backward(dy, dhn)
    _ran_tf32(kern.last_run, cluster=False, backward=True)
    w32 = kern.params["weight_hh_l0"]
    w = w32.astype(np.float64)
    dgh1 = ((dy[1] + dhn[0]) * (y[1] > 0)).astype(np.float32)
    after = lambda dh0: ((dy[0] + dh0) * (y[0] > 0)) @ w  # noqa: E731  (dhx from dh_0)
    products = np.abs(dgh1.astype(np.float64)) @ np.abs(w)
    fp32_sums = 2.0**-20 * ((np.abs(dy[0]) + products) @ np.abs(w) + 1.0)
    got = dhx[0].astype(np.float64)
    exact = after(dgh1.astype(np.float64) @ w)
    assert (np.abs(got - exact) <= 2.0**-10 * products @ np.abs(w) + fp32_sums).all()
    rounded = after(_round_tf32(dgh1).astype(np.float64) @ _round_tf32(w32).astype(np.float64))
    assert (np.abs(got - rounded) <= fp32_sums).all()
    assert not (np.abs(got - exact) <= fp32_sums).all()  # TF32's rounding shows


@pytest.mark.parametrize("placement", ["grid", "cluster"] if EVERY_KERNEL else ["grid"])
def test_tf32_stall_restarts_bitwise_identically(tf32, request, placement):
    cluster = placement == "cluster"
    if not cluster:
        request.getfixturevalue("grid_path")
    kern, _ = _layers("lstm", 24)
    x, hx, _, _ = _data(kern, 6, 3, 9)
    clean = kern.forward(x, hx)
    _ran_tf32(kern.last_run, cluster)
    prnn.configure(emulation_timeout_ms=300)
    with prnn.inject_stall(block=1, step=3, duration_ms=2000):
        stalled = kern.forward(x, hx)
    assert kern.last_run.restarts >= 1 and kern.last_run.fallback is None
    assert np.array_equal(stalled[0], clean[0])
    assert all(np.array_equal(a, b) for a, b in zip(stalled[1], clean[1]))


def test_the_planner_takes_tf32_tiles_only_where_allowed_and_from_their_batches():
    from dataclasses import replace
    h100 = planner.resolve_device("h100")
    tf32 = replace(h100, allow_tf32=True)
    for hidden, placement in ((256, "cluster"), (1024, "grid")):
        least = planner.TF32_MIN_BATCH[placement]
        for batch in (least - 1, least, 8):
            off, on = (planner.make_plan("lstm", hidden, batch, "float32", d) for d in (h100, tf32))
            assert not off.tile.mma and "PRNN_MMA" not in off.backward.defines
            assert on.tile.mma == (batch >= least), (hidden, batch)
            assert bool(on.tile.cluster) == (placement == "cluster")
            # the backward in TF32 from its own batch, else the fp32 one of the tile's units
            tf32_backward = on.tile.mma and batch >= planner.TF32_BACKWARD_MIN_BATCH
            assert on.backward.defines.get("PRNN_MMA") == (2 if tf32_backward else None)
            assert "PRNN_WEIGHT_DTYPE" not in on.forward.defines
    # 16-bit layers are not affected
    assert planner.make_plan("lstm", 1024, 8, "float16", tf32) == planner.make_plan("lstm", 1024, 8, "float16", h100)
    # GRU H 1024 has no TF32 tile (tiles.TF32_TILES): the fp32 plan
    assert not planner.make_plan("gru", 1024, 8, "float32", tf32).tile.mma


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (CI: tests/test_mma_groups.py's 16-bit groups)")
def test_tf32_batch_groups_match_the_whole_batch_bitwise(tf32, grid_path, monkeypatch):
    # The grid's TF32 tiles group their batch where the whole batch's staged vector does not fit
    # (LSTM H 1024 from B 16: docs/design.md, "TF32 tiles"), as the 16-bit ones do: here on an
    # emulated device whose shared memory holds groups of 8 rows only (the fp32 CUDA-core tiles,
    # which would hold the batch in less, left out), grouped passes equal the whole batch's.
    from dataclasses import replace
    from persistent_rnn import runtime
    from persistent_rnn.cells import CELLS
    cell, batch = CELLS["lstm"], 16
    tile = planner.mma_tiles_for(cell, "float32", tf32=True)[0]
    limit = max(planner.shared_bytes(cell, tile, b, batch, batch_group=8) for b in (False, True))
    assert planner.shared_bytes(cell, tile, True, batch) > limit
    kern, _ = _layers("lstm", 40)
    data = _data(kern, 4, batch, 5)
    whole = _run(kern, data)
    _ran_tf32(kern.last_run, cluster=False, backward=True)
    assert "PRNN_BATCH_GROUP" not in kern.last_run.details[0]
    monkeypatch.setattr(planner, "tiles_for", lambda *_: ())
    monkeypatch.setattr(runtime, "EMULATED_DEVICE", replace(
        runtime.EMULATED_DEVICE, shared_per_block=limit, shared_per_sm=limit))
    runtime._cached_engine.cache_clear()
    grouped = _run(kern, data)
    _ran_tf32(kern.last_run, cluster=False, backward=True)
    assert "'PRNN_BATCH_GROUP': 8" in kern.last_run.details[0]
    assert all(np.array_equal(a, b) for a, b in zip(grouped, whole))


def _tf32_step_us(name: str, hidden: int, batch: int, backward: bool, tf32: bool,
                  monkeypatch) -> float:
    """The latency model's step (h100, sm_90 SASS; a prediction) of a float32 layer's pass,
    on the TF32 tiles (at any batch) or the fp32 ones."""
    from dataclasses import replace
    from persistent_rnn import latency
    from persistent_rnn.cells import CELLS
    pytest.importorskip("persistent_rnn.sass_analysis").nvdisasm() or pytest.skip("no nvdisasm")
    monkeypatch.setattr(planner, "TF32_MIN_BATCH", {"grid": 1, "cluster": 1})
    monkeypatch.setattr(planner, "TF32_BACKWARD_MIN_BATCH", 1)
    device = replace(planner.resolve_device("h100"), allow_tf32=tf32)
    plan = planner.make_plan(name, hidden, batch, "float32", device)
    p = plan.backward if backward else plan.forward
    assert bool(p.defines.get("PRNN_MMA")) == tf32
    terms = latency.step_terms(latency.pass_sass(p, "sm_90"),
                               latency.PassShape(CELLS[name], p, batch, hidden), device)
    return terms.total_us


def test_the_model_predicts_tf32_faster_from_its_batches(monkeypatch):
    # Where plan.TF32_MIN_BATCH and TF32_BACKWARD_MIN_BATCH put the lines (predictions): in a
    # cluster (LSTM H 256) the TF32 forward slower at B = 2, faster from B = 4 (the same two
    # kernels at both batches); the full set also the grid (LSTM H 1024 forward at B = 3, the
    # backward at B = 3 slower and B = 4 faster) and docs/design.md's shapes at B = 8.
    step = lambda *shape, backward=False, tf32: _tf32_step_us(  # noqa: E731
        *shape, backward, tf32, monkeypatch)
    assert planner.TF32_MIN_BATCH == {"grid": 3, "cluster": 4}
    assert planner.TF32_BACKWARD_MIN_BATCH == 4
    assert step("lstm", 256, 2, tf32=True) > step("lstm", 256, 2, tf32=False)
    assert step("lstm", 256, 4, tf32=True) < step("lstm", 256, 4, tf32=False)
    if EVERY_KERNEL:
        assert step("lstm", 1024, 3, tf32=True) < step("lstm", 1024, 3, tf32=False)
        assert step("lstm", 1024, 3, backward=True, tf32=True) \
            > step("lstm", 1024, 3, backward=True, tf32=False)
        for shape in (("lstm", 1024, 4), ("lstm", 1024, 8), ("gru", 256, 8), ("rnn_tanh", 1024, 8)):
            for backward in (False, True):
                assert step(*shape, backward=backward, tf32=True) \
                    < step(*shape, backward=backward, tf32=False), (shape, backward)


def test_torch_modules_follow_the_library_setting_only(tf32, grid_path):
    # docs/api.md, "TF32": prnn.torch's modules take TF32 from settings.allow_tf32, whatever
    # torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 say.
    torch = pytest.importorskip("torch")
    from persistent_rnn.torch import LSTM
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    module, x = LSTM(5, 40, algo="persistent"), torch.randn(4, 9, 5)
    held = matmul.allow_tf32
    try:
        for library, torch_flag in ((False, True), (True, False)):
            matmul.allow_tf32 = torch_flag
            # (cudnn's flags only through its context manager: torch's own test harness, which
            # tests/test_pytorch_rnn_suite.py imports, forbids setting them directly)
            with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                             deterministic=cudnn.deterministic, allow_tf32=torch_flag), \
                    prnn.override_settings(allow_tf32=library):
                module(x)
            assert ("'PRNN_MMA': 1" in module.last_run.details[0]) == library
    finally:
        matmul.allow_tf32 = held


@pytest.mark.gpu
@pytest.mark.parametrize("name,hidden,batch", [("lstm", 1024, 8), ("gru", 256, 8), ("rnn_relu", 512, 4)])
def test_gpu_tf32_layer_matches_float64(cupy, settings, fresh_plans, name, hidden, batch):
    # The planned TF32 passes (forward and backward; grid and cluster) on the GPU: the layer and
    # its gradients against float64 within docs/api.md's TF32 bound, bitwise run to run.
    prnn.configure(allow_tf32=True)
    kern, ref = _layers(name, hidden)
    data = _data(kern, 6, batch, 11)
    on_gpu = [tuple(cupy.asarray(v) for v in a) if isinstance(a, tuple) else cupy.asarray(a)
              for a in data]
    x, hx, dy, dhn = on_gpu
    kern.forward(x, hx)
    assert kern.last_run.algo == "persistent" and not kern.last_run.emulated
    assert "'PRNN_MMA': 1" in kern.last_run.details[0]
    got = _run(kern, on_gpu)
    assert "'PRNN_MMA': 2" in kern.last_run.details[0]
    want = _run(ref, _data(kern, 6, batch, 11, np.float64))
    for a, r in zip(got, want):
        assert _relerr(a, r) <= TOLERANCE
    again = _run(kern, on_gpu)
    assert all(np.array_equal(a, b) for a, b in zip(got, again))


# ---- every float32 GEMM in TF32 (matmul.matmul) --------------------------------------------------
def _sum_bound(a: np.ndarray, b: np.ndarray, per_product: float = 0.0) -> np.ndarray:
    """|a @ b - float64's| allowed for fp32 products of a k-term sum: (k + 1) unit roundoffs of
    sum_k |a_ik| |b_kj|, plus ``per_product`` of it (each product's relative error)."""
    return ((a.shape[1] + 1) * 2.0**-24 + per_product) * (np.abs(a.astype(np.float64))
                                                          @ np.abs(b.astype(np.float64)))


def test_tf32_rounded_is_the_emulated_cvt_rna():
    # matmul.tf32_rounded (what the NumPy GEMMs take with allow_tf32) rounds as _round_tf32, the
    # emulated cvt.rna.tf32.f32 (test_tf32_rounding_is_to_nearest_ties_away): over many binades,
    # both signs, at and around ties, on a transposed view; NaN stays NaN (also one whose payload
    # is in the 13 bits dropped, which the bit arithmetic alone would turn into Inf or -0).
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(4096) * np.exp2(rng.integers(-60, 60, 4096))).astype(np.float32)
    near = np.array([0xFFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001], np.uint32)
    ties = (np.float32(1.5).view(np.uint32) + near).view(np.float32)
    values = np.concatenate([values, ties, -ties, [np.inf, -np.inf, 0.0, -0.0]]).astype(np.float32)
    got = matmul.tf32_rounded(values.reshape(-1, 2).T)
    np.testing.assert_array_equal(got, _round_tf32(values.reshape(-1, 2).T))
    assert np.signbit(got[1, -1]) and (got.view(np.uint32) & 0x1FFF == 0).all()
    nans = np.array([0x7F800001, 0x7FFFFFFF, 0xFFFFF001, 0x7FC00000], np.uint32).view(np.float32)
    assert np.isnan(matmul.tf32_rounded(nans)).all()


def test_tf32_products_round_float32_operands_only_where_allowed(settings):
    # NumPy's products (the CPU paths' GEMMs) with allow_tf32: float64 of the operands rounded to
    # TF32 up to fp32's sums, farther from the unrounded product than fp32's sums alone, within
    # docs/api.md's per-product bound; off, and for float64 operands, numpy.matmul bit for bit.
    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 33)).astype(np.float32)
    b = rng.standard_normal((19, 33)).astype(np.float32).T  # a transposed view, as W^T
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_array_equal(matmul.matmul(a, b), np.matmul(a, b))
    prnn.configure(allow_tf32=True)
    out = np.full((7, 19), np.nan, np.float32)
    assert matmul.matmul(a, b, out) is out
    rounded = _round_tf32(a).astype(np.float64) @ _round_tf32(b).astype(np.float64)
    assert (np.abs(out - rounded) <= _sum_bound(a, b)).all()
    assert (np.abs(out - a64 @ b64) <= _sum_bound(a, b, 2.0**-10 + 2.0**-22)).all()
    assert not (np.abs(out - a64 @ b64) <= _sum_bound(a, b)).all()  # TF32's rounding shows
    np.testing.assert_array_equal(matmul.matmul(a64, b64), np.matmul(a64, b64))


@pytest.mark.parametrize("name", ["lstm", "gru"] if EVERY_KERNEL else ["lstm"])
def test_tf32_gemm_path_matches_float64(settings, name):
    # The GEMM path (every product a GEMM: the input projection, each step's W_hh product, the
    # gradients) with allow_tf32: y, h_n (c_n), dx, dhx and every parameter gradient within
    # docs/api.md's TF32 bound of the float64 layer, and none of them fp32's bits.
    kern, ref = _layers(name, 40, algo="gemm")
    data = _data(kern, 4, 6, 3)
    fp32 = _run(kern, data)
    prnn.configure(allow_tf32=True)
    got = _run(kern, data)
    assert kern.last_run.algo == "gemm"
    want = _run(ref, _data(kern, 4, 6, 3, np.float64))
    for a, f, r in zip(got, fp32, want):
        assert _relerr(a, r) <= TOLERANCE and not np.array_equal(a, f)


def test_tf32_planned_calls_equal_full_calls_bitwise(settings, grid_path, monkeypatch):
    # A planned call (call_plans: its GEMMs inside its chains) takes them in TF32 as the full
    # path does: bitwise the full path's results (the fp32 recurrence at B 2), not fp32's.
    from test_call_plans import _Hits, _step
    from test_call_plans import _data as _call_data, _layer as _call_layer
    prnn.configure(allow_tf32=True)
    hits = _Hits(monkeypatch)
    planned, full, reference = (_call_layer("LSTM") for _ in range(3))
    for seed in range(4):  # call 1 full, call 2 full and planned, then planned
        x, dy = _call_data(seed)
        got = _step(planned, x, dy)
        full._plan = None
        for a, b in zip(got, _step(full, x, dy)):
            np.testing.assert_array_equal(a, b)
    assert (hits.forwards, hits.backwards) == (2, 1)
    assert "PRNN_MMA" not in planned.last_run.details[0]
    with prnn.override_settings(allow_tf32=False):
        fp32 = _step(reference, x, dy)
    assert not any(np.array_equal(a, b) for a, b in zip(got, fp32))


def test_the_model_prices_tf32_gemms_at_the_tensor_cores_tf32_rate():
    # latency._gemm_us on a profile that allows TF32: an fp32 GEMM at the m16n8k8 rate
    # (hardware.HMMA_TF32_INTERVAL) and the 16-bit GEMM's fraction of it, faster than SGEMM; a
    # 16-bit GEMM's price unchanged. A call's GEMMs follow (call_costs: LSTM H 1024 B 4 T 100's
    # backward, mostly its weight GEMMs, 172 -> 116 us beside the steps; predictions).
    from dataclasses import replace
    from persistent_rnn import hardware as hw, latency
    from persistent_rnn.cells import CELLS
    h100 = planner.resolve_device("h100")
    tf32 = replace(h100, allow_tf32=True)
    flops = 2.0 * 400 * 1024 * 4096
    rate = h100.sm_count * h100.clock_mhz * 1e6 * 2 * hw.TENSOR_GEMM_PEAK_FRACTION \
        * hw.SUB_PARTITIONS * hw.MMA_TF32_FMA / hw.HMMA_TF32_INTERVAL
    assert latency._gemm_us(flops, tf32) == pytest.approx(hw.GEMM_LAUNCH_US + flops / rate * 1e6)
    assert latency._gemm_us(flops, tf32) < latency._gemm_us(flops, h100)
    assert latency._gemm_us(flops, tf32, True) == latency._gemm_us(flops, h100, True)
    cost = lambda d: latency.call_costs(CELLS["lstm"], 1024, 4, 100, 64, True, d).device_us  # noqa: E731
    assert (round(cost(h100)), round(cost(tf32))) == (172, 116)


@pytest.mark.gpu
def test_gpu_tf32_products_are_tf32_eager_and_captured(cupy, settings, monkeypatch):
    # matmul.matmul's float32 products with allow_tf32 on the GPU: not cupy.matmul's fp32 bits,
    # within docs/api.md's GEMM bound of float64 (cuBLAS rounds operands to nearest or truncates:
    # 2^-9 a product); a strided operand and a strided output (copied / written through a
    # temporary) the same bits; the product a chain captures (cublas_capture.gemm_ex) replays
    # the eager one's bits; CuPy's own compute type, which the user's cupy.matmul reads, unchanged.
    from cupy._core import _routines_linalg as linalg
    from persistent_rnn import chain_graphs
    held = linalg.get_compute_type(np.float32)
    rng = np.random.default_rng(5)
    a_host = rng.standard_normal((27, 80)).astype(np.float32)
    w_host = rng.standard_normal((192, 40)).astype(np.float32)
    a, w = cupy.asarray(a_host), cupy.asarray(w_host)
    prnn.configure(allow_tf32=True)
    eager = matmul.matmul(a[:, ::2], w.T)
    a_host = a_host[:, ::2]
    assert not cupy.array_equal(eager, cupy.matmul(a[:, ::2], w.T))
    exact = a_host.astype(np.float64) @ w_host.T.astype(np.float64)
    assert (np.abs(eager.get() - exact) <= _sum_bound(a_host, w_host.T, 2.0**-9)).all()
    strided_out = cupy.full((192, 27), np.nan, np.float32).T
    matmul.matmul(cupy.ascontiguousarray(a[:, ::2]), w.T, strided_out)
    np.testing.assert_array_equal(strided_out.get(), eager.get())
    stream, capturing = cupy.cuda.Stream(non_blocking=True), [False]
    monkeypatch.setattr(chain_graphs, "capturing", lambda: capturing[0])
    x = cupy.ascontiguousarray(a[:, ::2])
    with stream:
        want = matmul.matmul(x, w.T)
        replayed = cupy.full_like(want, np.nan)
        stream.begin_capture()
        capturing[0] = True  # (as chain_graphs._capture sets it)
        matmul.matmul(x, w.T, replayed)
        capturing[0] = False
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(replayed.get(), want.get())
    assert linalg.get_compute_type(np.float32) == held


@pytest.mark.gpu
def test_gpu_tf32_planned_calls_replay_their_chains_with_the_full_calls_bits(cupy, settings,
                                                                             monkeypatch):
    # With allow_tf32 a planned call's chains (its TF32 GEMMs recorded through
    # cublas_capture.gemm_ex) replay bitwise the full path's calls (eager TF32 GEMMs).
    from test_gpu_chain_graphs import _assert_replays_give_the_full_bits, _layer as _gpu_layer
    prnn.configure(allow_tf32=True)
    layer, x, dy = _gpu_layer(cupy, "LSTM", 1)
    full, _, _ = _gpu_layer(cupy, "LSTM", 1)
    _assert_replays_give_the_full_bits(cupy, monkeypatch, layer, full, x, dy, [9, 7, 4])
