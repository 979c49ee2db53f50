"""16-bit stacks in stack mode on the tensor cores (``tiles.MMA_STACK_TILES``: the stack kernels
with mma_tile.cuh's forward and, from ``plan.MMA_STACK_BACKWARD_MIN_BATCH`` rows,
mma_split_tile.cuh's backward), through the CPU emulation.

* A 2-layer stack, forward and backward with lengths, odd H (rows of 16-bit words padded): one
  launch per pass, against the float64 stack on the same 16-bit parameters within docs/api.md's
  16-bit bounds, and against the same layers one launch per layer (the layer kernels) within one
  rounding of the dtype.
* Stalls in either layer at the first, a middle and the last step of each pass: the restarted
  passes are bitwise the undisturbed ones.
* CTAs not co-resident: the completion kernel finishes both layers from the 16-bit words.
* Sabotage: the layers' matrices handed to the kernels in the wrong order (a layer stride the
  kernels and ``stack.py`` disagree on) fails the float64 check.

CI: the LSTM in float16 (its layer kernels are tests/test_half_kernels.py's builds), the
backward's stall, its CUDA-core 16-bit backward against the mma one; bfloat16 in CI is the
campaign's bidirectional 16-bit stack case (GRU, seed 189: the mma forward and, at B = 2, the
widened fp32 backward, against float64) and the widened cases below.
``PRNN_TEST_EVERY_KERNEL=1``: every cell in both dtypes, a second n-tile (B = 9), both passes'
stalls at three steps in both layers, the CUDA-core 16-bit stack backward against the mma one at
the same batch, a bidirectional stack (both directions side by side), the latency model holding
``plan.MMA_STACK_BACKWARD_MIN_BATCH`` and ``prnn plan``'s line.

Below ``plan.MMA_STACK_BACKWARD_MIN_BATCH`` the backward is the fp32 stack's, its matrices
widened to float32 (``plan._widened_stack``): against float64 on the full path and the planned
call (CI an fp16 stack at B = 1 and a bf16 pair at B = 2), and 16-bit words handed to it on
either path (sabotage) fail that check.
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner, stack, stack_plans
from persistent_rnn.cells import CELLS, layer_args
from full_set import EVERY_KERNEL

TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}  # docs/api.md, "Accuracy" (16-bit)
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
HIDDEN, STEPS = 13, 5
CASES = [("lstm", "float16")]
if EVERY_KERNEL:
    CASES = [(c, d) for c in ("lstm", "gru", "rnn_tanh", "rnn_relu")
             for d in ("float16", "bfloat16")]
BATCHES = (3, 9) if EVERY_KERNEL else (3,)
# (pass, layer, step) of each stall: CI the backward's in layer 0 at a middle step (the last layer
# it runs: the mma backward restarted after the layer above finished), the full set both passes'
# in both layers at the first, a middle and the last step.
STALLS = ([(p, layer, step) for p in ("forward", "backward") for layer in (0, 1)
           for step in (0, STEPS // 2, STEPS - 1)] if EVERY_KERNEL else [("backward", 0, STEPS // 2)])

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def emulation(settings):
    """A generous barrier timeout: the emulated CTAs share two cores with other work."""
    prnn.configure(emulation_timeout_ms=20_000)


def _layers(name: str, dtype: str, bidirectional: bool = False):
    mode, kw = layer_args(name)
    make = getattr(prnn, mode)
    kern = make(5, HIDDEN, num_layers=2, bidirectional=bidirectional, dtype=dtype,
                algo="persistent", seed=5, **kw)
    ref = make(5, HIDDEN, num_layers=2, bidirectional=bidirectional, dtype="float64",
               algo="gemm", **kw)
    ref.load_params({k: v.astype(np.float64) for k, v in kern.params.items()})
    return kern, ref


def _inputs(layer, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS, batch, 5)).astype(layer.dtype)
    dy = rng.standard_normal((STEPS, batch, layer.directions * HIDDEN)).astype(layer.dtype)
    lengths = [STEPS] + [int(n) for n in rng.integers(1, STEPS + 1, batch - 1)]
    return x, dy, lengths


def _run(layer, x, dy, lengths, stall: dict | None = None, stall_pass: str = ""):
    """Forward and backward (``stall`` injected into ``stall_pass``): every result and gradient
    as float64, and the two passes' stats."""
    layer.zero_grad()
    with prnn.inject_stall(**stall) if stall_pass == "forward" else nullcontext():
        y, hn = layer.forward(x, lengths=lengths)
    forward = layer.last_run
    with prnn.inject_stall(**stall) if stall_pass == "backward" else nullcontext():
        dx, dhx = layer.backward(dy)
    flat = [y, *_tuple(hn), dx, *_tuple(dhx), *layer.grads.values()]
    return [np.asarray(a, np.float64) for a in flat], forward, layer.last_run


def _tuple(a):
    return a if isinstance(a, tuple) else (a,)


def _relerr(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _reference(ref, x, dy, lengths):
    return _run(ref, x.astype(np.float64), dy.astype(np.float64), lengths)[0]


def _ran_stack(stats, kernel: str, mma: int | None, launches: int = 1) -> None:
    assert (stats.algo, stats.launches, stats.restarts, stats.fallback) == (
        "persistent", launches, 0, None), stats
    assert kernel in stats.details[-1], stats.details
    on_tensor_cores = f"'PRNN_MMA': {mma}" if mma else "PRNN_MMA"
    assert (on_tensor_cores in stats.details[-1]) == bool(mma), stats.details


def _forward_mma(name: str, batch: int) -> int | None:
    """The forward's ``PRNN_MMA`` as planned: None where the fp32 stack's serves it widened
    (``plan.widens``: ``WIDENED_STACKS``)."""
    return None if planner.widens(CELLS[name], batch, False, False, stack_hidden=HIDDEN) else 1


def _backward_mma(name: str, batch: int) -> int | None:
    """The backward's ``PRNN_MMA`` as planned (widened: below ``MMA_STACK_BACKWARD_MIN_BATCH``,
    and ``WIDENED_STACKS``)."""
    return None if planner.widens(CELLS[name], batch, True, False, stack_hidden=HIDDEN) else 2


def _relu(name: str) -> bool:
    """The relu RNN's 16-bit gradients have no float64 bound (docs/api.md, "Accuracy"): its
    forward only against float64."""
    return name == "rnn_relu"


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,dtype", CASES)
def test_16bit_stack_matches_float64_and_the_layer_kernels(emulation, name, dtype, batch):
    kern, ref = _layers(name, dtype)
    x, dy, lengths = _inputs(kern, batch)
    got, fwd, bwd = _run(kern, x, dy, lengths)
    _ran_stack(fwd, "prnn_stack_forward", _forward_mma(name, batch))
    _ran_stack(bwd, "prnn_stack_backward", _backward_mma(name, batch))
    forward = 2 + kern.cell.has_cell_state  # y, h_n (, c_n)
    for i, (a, r) in enumerate(zip(got, _reference(ref, x, dy, lengths))):
        assert (_relu(name) and i >= forward) or _relerr(a, r) <= TOLERANCE[dtype], i
    with prnn.override_settings(stack=False):  # one launch per layer: the layer kernels
        apart, fwd, bwd = _run(kern, x, dy, lengths)
    assert fwd.launches == bwd.launches == 2
    for i, (a, b) in enumerate(zip(got, apart)):
        assert _relerr(a, b) <= UNIT_ROUNDOFF[dtype], i


@pytest.mark.parametrize("name,dtype", CASES[:1])
def test_16bit_stack_stalls_restart_bitwise_identically(emulation, name, dtype):
    kern, _ = _layers(name, dtype)
    x, dy, lengths = _inputs(kern, 3, seed=2)
    plain, _, _ = _run(kern, x, dy, lengths)
    prnn.configure(emulation_timeout_ms=300, max_restarts=8)
    per_layer = -(-HIDDEN // planner.make_stack_plan(
        name, HIDDEN, 3, 2, dtype=dtype, device=prnn.runtime.EMULATED_DEVICE).tile.units)
    for stall_pass, layer, step in STALLS:
        stall = dict(block=layer * per_layer + 1, step=step, duration_ms=900)
        stalled, fwd, bwd = _run(kern, x, dy, lengths, stall, stall_pass)
        stats = fwd if stall_pass == "forward" else bwd
        assert stats.fallback is None and stats.launches == 1 + stats.restarts, stats
        last = (1, STEPS - 1) if stall_pass == "forward" else (0, 0)  # nobody waits on it
        if (layer, step) != last:
            assert stats.restarts >= 1, (stall_pass, layer, step)
        for a, b in zip(plain, stalled):
            np.testing.assert_array_equal(a, b)


def test_16bit_stacks_are_planned_on_the_tensor_cores():
    """The planner (pure Python): a 16-bit stack takes ``tiles.MMA_STACK_TILES``, its forward on
    the tensor cores at every batch, its backward from ``MMA_STACK_BACKWARD_MIN_BATCH`` rows,
    below on the fp32 stack's (widened) where the fp32 stack fits, else on the CUDA-core 16-bit
    stack backward; layers that need more units than shipped run apart, with the reason."""
    for batch, backward in ((1, None), (2, None), (3, 2), (16, 2)):
        p = planner.make_stack_plan("LSTM", 384, batch, 4, dtype="bfloat16", device="h100")
        assert p.fits and p.launches == 1 and p.tile.mma and p.forward.grid == 128
        assert p.forward.defines["PRNN_MMA"] == 1 and p.backward.defines.get("PRNN_MMA") == backward
        assert p.forward.defines["PRNN_WEIGHT_DTYPE"] == 2
        wide = planner.make_stack_plan("LSTM", 384, batch, 4, device="h100").backward
        assert (p.backward == wide) == (batch < planner.MMA_STACK_BACKWARD_MIN_BATCH)
        assert ("PRNN_WEIGHT_DTYPE" in p.backward.defines) == (backward is not None)
    for batch in (1, 16):  # (past the fp32 stack tiles: the 16-bit backward at every batch)
        gru = planner.make_stack_plan("GRU", 512, batch, 2, dtype="float16", device="h100")
        assert gru.fits and gru.tile.units == 16 and gru.forward.source == "stack_forward.cu"
        assert gru.backward.defines["PRNN_WEIGHT_DTYPE"] == 1
    big = planner.make_stack_plan("LSTM", 512, 8, 4, dtype="float16", device="h100")
    assert not big.fits and big.launches == 4 and "hidden_size 512 > 384" in big.reason


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (NVRTC builds of the stack kernels)")
def test_prnn_plan_says_a_16bit_stack_runs_on_the_tensor_cores(capsys):
    from persistent_rnn import cli
    assert cli.main(["plan", "LSTM", "384", "--batch", "8", "--layers", "4", "--dtype",
                     "float16", "--device", "h100"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stack mode"))
    assert "1 launch per pass" in line and "forward and backward on the tensor cores" in line
    assert cli.main(["plan", "LSTM", "384", "--batch", "1", "--layers", "4", "--dtype",
                     "float16", "--device", "h100"]) == 0  # (the backward widened)
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("stack mode"))
    assert "forward on the tensor cores" in lines[at]
    assert "(backward on the fp32 stack's tiles" in lines[at + 1]
    assert cli.main(["plan", "RNN", "256", "--batch", "3", "--layers", "2", "--dtype",
                     "float16", "--device", "h100"]) == 0  # (plan.WIDENED_STACKS: both passes)
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("stack mode"))
    assert "tensor cores" not in lines[at]
    assert "(forward and backward on the fp32 stack's tiles" in lines[at + 1]


def test_16bit_stack_finishes_on_the_completion_kernel(emulation):
    """CTAs that cannot all be resident (3 of a layer's 4) time out; with no restart left the
    completion kernel (device_loop.cu) finishes both layers of both passes from the stack's
    16-bit words (its layer strides in words)."""
    kern, ref = _layers("lstm", "float16")
    x, dy, lengths = _inputs(kern, 3, seed=3)
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=3, max_restarts=0)
    got, fwd, bwd = _run(kern, x, dy, lengths)
    for stats in (fwd, bwd):
        assert "completion kernel" in stats.fallback and "layer 1" in stats.fallback, stats
    for i, (a, r) in enumerate(zip(got, _reference(ref, x, dy, lengths))):
        assert _relerr(a, r) <= TOLERANCE["float16"], i


def test_16bit_stack_sabotage_layers_swapped_fails_the_float64_check(emulation, monkeypatch):
    """The check above sees a stack whose kernels read another layer's matrices (a layer stride
    in words that stack.py and the kernels disagree on would do the same)."""
    kern, ref = _layers("lstm", "float16")
    x, dy, lengths = _inputs(kern, 3)
    matrices = stack._matrices
    monkeypatch.setattr(stack, "_matrices",
                        lambda xp, arrays, name, half: matrices(xp, arrays[::-1], name, half))
    kern.zero_grad()
    y, _ = kern.forward(x, lengths=lengths)
    _ran_stack(kern.last_run, "prnn_stack_forward", 1)
    want, _ = ref.forward(x.astype(np.float64), lengths=lengths)
    assert _relerr(np.asarray(y, np.float64), want) > TOLERANCE["float16"]


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (two NVRTC builds of large tiles, ~5 s)")
def test_the_model_predicts_the_planned_stack_backward_faster(monkeypatch):
    """Where plan.MMA_STACK_BACKWARD_MIN_BATCH puts the line (predictions of the latency model,
    h100, the stack kernel's step): at B = 3 the mma backward is faster (docs/design.md's
    4-layer LSTM H 384, 2-layer GRU H 512, 4-layer RNN H 512)."""
    from persistent_rnn import latency
    from persistent_rnn.cells import CELLS
    from persistent_rnn.hardware import PROFILES
    pytest.importorskip("persistent_rnn.sass_analysis").nvdisasm() or pytest.skip("no nvdisasm")

    monkeypatch.setattr(planner, "_widened_stack", lambda plan, *_: plan)  # (16-bit tiles only)

    def backward_us(cell, hidden, layers, batch, mma):
        monkeypatch.setattr(planner, "MMA_STACK_BACKWARD_MIN_BATCH", 1 if mma else 10**6)
        p = planner.make_stack_plan(cell, hidden, batch, layers, dtype="float16",
                                    device="h100").backward
        assert p.defines.get("PRNN_MMA") == (2 if mma else None)
        sass = latency.pass_sass(p, "sm_90")
        return latency.step_terms(sass, latency.PassShape(CELLS[cell], p, batch, hidden),
                                  PROFILES["h100"]).total_us

    assert planner.MMA_STACK_BACKWARD_MIN_BATCH == 3
    for cell, hidden, layers in (("lstm", 384, 4), ("gru", 512, 2), ("rnn_tanh", 512, 4)):
        assert backward_us(cell, hidden, layers, 3, True) < backward_us(cell, hidden, layers, 3,
                                                                         False)


@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's")
@pytest.mark.parametrize("name,dtype", CASES)
def test_16bit_bidirectional_stack_runs_both_directions_side_by_side(emulation, name, dtype):
    kern, ref = _layers(name, dtype, bidirectional=True)
    x, dy, lengths = _inputs(kern, 4)
    got, fwd, bwd = _run(kern, x, dy, lengths)
    _ran_stack(fwd, "prnn_stack_forward", _forward_mma(name, 4), launches=2)
    _ran_stack(bwd, "prnn_stack_backward", _backward_mma(name, 4), launches=2)
    forward = 2 + kern.cell.has_cell_state
    for i, (a, r) in enumerate(zip(got, _reference(ref, x, dy, lengths))):
        assert (_relu(name) and i >= forward) or _relerr(a, r) <= TOLERANCE[dtype], i


@pytest.mark.parametrize("name,dtype", CASES)
def test_16bit_stack_backward_on_the_cuda_cores_below_its_batch(emulation, monkeypatch, name,
                                                                dtype):
    """The mma backward against the CUDA-core 16-bit stack backward of the same tile, at the
    same batch: fp32 sums of exact products in other orders, results rounded to 16 bits. (CI
    too: below its batch a stack whose fp32 tile does not fit - GRU H 512 - still runs that
    backward, and no other CI test reaches it since the others widen.)"""
    monkeypatch.setattr(planner, "WIDENED_STACKS", {})  # (the mma backward at B = 3 for all)
    stack._cached_engine.cache_clear()
    kern, _ = _layers(name, dtype)
    x, dy, lengths = _inputs(kern, 3, seed=4)
    mma, _, bwd = _run(kern, x, dy, lengths)
    _ran_stack(bwd, "prnn_stack_backward", 2)
    monkeypatch.setattr(planner, "MMA_STACK_BACKWARD_MIN_BATCH", 4)
    monkeypatch.setattr(planner, "_widened_stack", lambda plan, *_: plan)  # (not the fp32 one)
    stack._cached_engine.cache_clear()
    try:
        core, _, bwd = _run(kern, x, dy, lengths)
    finally:
        stack._cached_engine.cache_clear()
    _ran_stack(bwd, "prnn_stack_backward", None)
    for i, (a, b) in enumerate(zip(mma, core)):
        assert _relerr(a, b) <= UNIT_ROUNDOFF[dtype], i


# Elman stacks of H <= 256 at B = 3-4 (plan.WIDENED_STACKS) run both passes on the fp32 stack's
# tiles: the forward takes the 16-bit words and rounds h_t as stored (PRNN_WIDENED_FROM). CI fp16
# unidirectional at B = 3, the full set relu bf16 pairs at B = 4 too.
WIDENED_FORWARD_CASES = [("rnn_tanh", "float16", 3, False)] + (
    [("rnn_relu", "bfloat16", 4, True)] if EVERY_KERNEL else [])


@pytest.mark.parametrize("name,dtype,batch,bidirectional", WIDENED_FORWARD_CASES)
def test_16bit_elman_stack_widened_forward_matches_float64(emulation, name, dtype, batch,
                                                           bidirectional):
    """Four calls of one layer - the full path twice, then planned calls (``stack_plans``) -
    each against the float64 stack within docs/api.md's 16-bit bounds, forward and backward,
    both passes on the fp32 stack kernels; the forward from the 16-bit words."""
    p = planner.make_stack_plan(name, HIDDEN, batch, 2, bidirectional, dtype,
                                prnn.runtime.EMULATED_DEVICE)
    assert p.fits and p.forward.defines["PRNN_WIDENED_FROM"] == planner.KERNEL_DTYPES[dtype]
    for q in (p.forward, p.backward):
        assert "PRNN_WEIGHT_DTYPE" not in q.defines and "PRNN_MMA" not in q.defines
    kern, ref = _layers(name, dtype, bidirectional)
    launches = 2 if bidirectional else 1
    for seed in (1, 2, 3, 4):
        x, dy, lengths = _inputs(kern, batch, seed)
        got, fwd, bwd = _run(kern, x, dy, lengths)
        _ran_stack(fwd, "prnn_stack_forward", None, launches)
        _ran_stack(bwd, "prnn_stack_backward", None, launches)
        assert "'PRNN_WIDENED_FROM'" in fwd.details[-1], fwd.details
        forward = 2 + kern.cell.has_cell_state
        for i, (a, r) in enumerate(zip(got, _reference(ref, x, dy, lengths))):
            assert (_relu(name) and i >= forward) or _relerr(a, r) <= TOLERANCE[dtype], (seed, i)


@pytest.mark.parametrize("path", ["full", "planned"])
def test_16bit_elman_stack_widened_forward_sabotage_float32_matrices_fail(emulation,
                                                                          monkeypatch, path):
    """The check above sees the widened forward handed float32 matrices where it reads 16-bit
    words: on the full path (``stack._weights_dtype`` answering None for it), or on the planned
    call only (``stack_plans._matrices`` holding float32 for it)."""
    if path == "full":
        monkeypatch.setattr(stack, "_weights_dtype", lambda engine: None)
    else:
        matrices = stack_plans._matrices
        monkeypatch.setattr(stack_plans, "_matrices", lambda xp, name, shape, words: matrices(
            xp, name, shape, None))
    with pytest.raises(AssertionError, match=r"\((1|3), 0\)"):  # (seed, y)
        test_16bit_elman_stack_widened_forward_matches_float64(None, "rnn_tanh", "float16", 3,
                                                               False)


# Below plan.MMA_STACK_BACKWARD_MIN_BATCH a 16-bit stack's backward is the fp32 stack's, its
# matrices widened to float32 (plan._widened_stack): CI fp16 unidirectional at B = 1 and bf16
# pairs at B = 2, the full set the other cells and both dtypes each way.
WIDENED_CASES = [("lstm", "float16", 1, False), ("gru", "bfloat16", 2, True)] + (
    [("gru", "float16", 2, False), ("lstm", "bfloat16", 1, True), ("rnn_tanh", "bfloat16", 1,
                                                                   False),
     ("rnn_tanh", "float16", 2, True)] if EVERY_KERNEL else [])


@pytest.mark.parametrize("name,dtype,batch,bidirectional", WIDENED_CASES)
def test_16bit_stack_widened_backward_matches_float64(emulation, name, dtype, batch,
                                                      bidirectional):
    """The planner gives the shape the fp32 stack's backward (no ``PRNN_WEIGHT_DTYPE``) beside
    the 16-bit mma forward; four calls of one layer - the full path twice, then planned calls
    (``stack_plans``; the fourth's backward the prepared one, reading float32 matrices) - each
    against the float64 stack within docs/api.md's 16-bit bounds, forward and backward."""
    p = planner.make_stack_plan(name, HIDDEN, batch, 2, bidirectional, dtype,
                                prnn.runtime.EMULATED_DEVICE)
    assert p.fits and p.forward.defines["PRNN_WEIGHT_DTYPE"] == planner.KERNEL_DTYPES[dtype]
    assert "PRNN_WEIGHT_DTYPE" not in p.backward.defines and "PRNN_MMA" not in p.backward.defines
    kern, ref = _layers(name, dtype, bidirectional)
    launches = 2 if bidirectional else 1
    for seed in (1, 2, 3, 4):
        x, dy, lengths = _inputs(kern, batch, seed)
        got, fwd, bwd = _run(kern, x, dy, lengths)
        _ran_stack(fwd, "prnn_stack_forward", 1, launches)
        _ran_stack(bwd, "prnn_stack_backward", None, launches)
        assert "PRNN_WEIGHT_DTYPE" not in bwd.details[-1], bwd.details
        forward = 2 + kern.cell.has_cell_state
        for i, (a, r) in enumerate(zip(got, _reference(ref, x, dy, lengths))):
            assert (_relu(name) and i >= forward) or _relerr(a, r) <= TOLERANCE[dtype], (seed, i)
    assert kern._plan.backward_pass["w_t"].dtype == np.float32  # (the planned call's)


@pytest.mark.parametrize("path", ["full", "planned"])
def test_16bit_stack_widened_backward_sabotage_words_fail_the_float64_check(emulation,
                                                                            monkeypatch, path):
    """The check above sees a widened backward handed the 16-bit words the mma stack kernels
    take: on the full path (``stack._weights_dtype`` answering the layer's dtype for it), or on
    the planned call only (``stack_plans._matrices`` holding words for it)."""
    if path == "full":
        monkeypatch.setattr(stack, "_weights_dtype", lambda engine: "float16")
    else:
        matrices = stack_plans._matrices
        monkeypatch.setattr(stack_plans, "_matrices", lambda xp, name, shape, words: matrices(
            xp, name, shape, words or "float16"))
    with pytest.raises(AssertionError, match=r"\((1|4), [3-9]\)"):  # (seed, a gradient)
        test_16bit_stack_widened_backward_matches_float64(None, "lstm", "float16", 1, False)
