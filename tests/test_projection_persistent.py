"""The persistent LSTM-with-projection kernels (``cuda_src/persistent_projection_*.cu``) on the
grid in the CPU emulation: fp32 against ``torch.nn.LSTM(proj_size=P)`` in float64, 16-bit weights
against the float64 layer, stalls and restarts (bitwise identical), CTAs that are not co-resident
(GEMM fallback), the planner's sizes and its shared-memory formula. (The cluster placement:
tests/test_projection_cluster.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import persistent_rnn as prnn
from persistent_rnn import plan

T, B, I = 7, 3, 5
LENGTHS = np.array([7, 2, 4])


@pytest.fixture(autouse=True)
def _on_the_grid(grid_path):
    """The emulated device without clusters: these are the grid kernels' tests."""


def _rel(a, b) -> float:
    """max |a - b| / max |b| (docs/api.md's relative error)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _inputs(rng, hidden: int, proj: int, layers: int = 1, directions: int = 1) -> dict:
    states = layers * directions
    return dict(x=rng.standard_normal((T, B, I)),
                hx=(rng.standard_normal((states, B, proj)), rng.standard_normal((states, B, hidden))),
                dy=rng.standard_normal((T, B, directions * proj)),
                dhn=(rng.standard_normal((states, B, proj)), rng.standard_normal((states, B, hidden))))


def _run(dtype: str, algo: str, data: dict, hidden: int, proj: int, lengths=None,
         params: dict | None = None, **layer_args) -> dict:
    """Forward and backward of a ``prnn.LSTM`` with a projection; everything it returns."""
    layer = prnn.LSTM(I, hidden, proj_size=proj, dtype=dtype, algo=algo, seed=11, **layer_args)
    if params is not None:
        layer.load_params({k: np.asarray(v, layer.dtype) for k, v in params.items()})
    cast = lambda a: np.asarray(a, layer.dtype)  # noqa: E731
    y, hn = layer.forward(cast(data["x"]), tuple(map(cast, data["hx"])), lengths)
    fwd = layer.last_run
    dx, dhx = layer.backward(cast(data["dy"]), tuple(map(cast, data["dhn"])))
    return dict(arrays=[y, *hn, dx, *dhx], grads={k: v.copy() for k, v in layer.grads.items()},
                params=layer.params, fwd=fwd, bwd=layer.last_run)


def _torch(params: dict, data: dict, hidden: int, proj: int, lengths, **layer_args) -> dict:
    """The same computation with ``torch.nn.LSTM(proj_size=proj)`` in float64."""
    module = torch.nn.LSTM(I, hidden, proj_size=proj, dtype=torch.float64, **layer_args)
    module.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in params.items()})
    x = torch.from_numpy(data["x"]).requires_grad_()
    hx = tuple(torch.from_numpy(a).requires_grad_() for a in data["hx"])
    inp = x if lengths is None else torch.nn.utils.rnn.pack_padded_sequence(
        x, torch.from_numpy(lengths), enforce_sorted=False)
    y, (hn, cn) = module(inp, hx)
    if lengths is not None:
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=T)
    torch.autograd.backward((y, hn, cn), tuple(torch.from_numpy(a) for a in (data["dy"], *data["dhn"])))
    return dict(arrays=[a.detach().numpy() for a in (y, hn, cn, x.grad, *(h.grad for h in hx))],
                grads={k: p.grad.numpy() for k, p in module.named_parameters()})


def _assert_persistent(got: dict, restarts: int = 0) -> None:
    for stats in (got["fwd"], got["bwd"]):
        assert stats.algo == "persistent" and stats.emulated and stats.fallback is None, stats
        assert stats.restarts == restarts, stats
        assert all("prnn_projection_" in d for d in stats.details if "launch(es)" in d), stats.details


# (H, P): the small tile over 3 CTAs; H 9 / P 8: 4 CTAs own rows of r but only 3 own units, and
# the exchanged rows are of odd length (padding words nobody publishes).
@pytest.mark.parametrize("hidden,proj", [(12, 6), (9, 8)])
@pytest.mark.parametrize("layers,bidirectional,lengths", [(1, False, None), (2, True, LENGTHS)],
                         ids=["one-layer", "two-layer-bidirectional-lengths"])
def test_fp32_persistent_matches_torch_nn_float64(hidden, proj, layers, bidirectional, lengths):
    data = _inputs(np.random.default_rng(hidden + layers), hidden, proj, layers,
                   2 if bidirectional else 1)
    args = dict(num_layers=layers, bidirectional=bidirectional)
    got = _run("float32", "persistent", data, hidden, proj, lengths, **args)
    _assert_persistent(got)
    ref = _torch(got["params"], data, hidden, proj, lengths, **args)
    for a, b in zip(got["arrays"], ref["arrays"]):
        assert a.shape == b.shape and _rel(a, b) <= 1e-5
    assert set(got["grads"]) == set(ref["grads"])
    for key, g in ref["grads"].items():
        assert _rel(got["grads"][key], g) <= 1e-5, key


def test_medium_tile_matches_float64():
    """H 130 > the small tile's 128: the H 1024 / P 256 tile (8 warps, gate rows over two column
    chunks) on 17 CTAs."""
    hidden, proj = 130, 20
    from persistent_rnn import runtime
    assert plan.make_plan("lstm", hidden, B, device=runtime.EMULATED_DEVICE,
                          proj_size=proj).tile.units == 8
    data = _inputs(np.random.default_rng(2), hidden, proj)
    got = _run("float32", "persistent", data, hidden, proj, LENGTHS)
    _assert_persistent(got)
    ref = _run("float64", "gemm", data, hidden, proj, LENGTHS, params=got["params"])
    for a, b in zip(got["arrays"] + list(got["grads"].values()),
                    ref["arrays"] + [ref["grads"][k] for k in got["grads"]]):
        assert _rel(a, b) <= 1e-5


# docs/api.md's 16-bit tolerances against the float64 layer on the same (16-bit) parameters.
TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
def test_16bit_persistent_within_tolerance_of_float64(dtype):
    hidden, proj = 9, 5  # odd: both matrices' rows end in a padding half of a packed pair
    data = _inputs(np.random.default_rng(6), hidden, proj, 2, 2)
    args = dict(num_layers=2, bidirectional=True)
    got = _run(dtype, "persistent", data, hidden, proj, LENGTHS, **args)
    _assert_persistent(got)
    assert any("PRNN_WEIGHT_DTYPE" in d for d in got["fwd"].details)
    # B = 3 < plan.MMA_BACKWARD_MIN_BATCH: the backward on the fp32 tile, W^T widened
    assert not any("PRNN_WEIGHT_DTYPE" in d for d in got["bwd"].details)
    ref = _run("float64", "gemm", data, hidden, proj, LENGTHS,
               params={k: np.asarray(v, np.float64) for k, v in got["params"].items()}, **args)
    for a, b in zip(got["arrays"], ref["arrays"]):
        assert _rel(a, b) <= TOLERANCE[dtype]
    for key, g in ref["grads"].items():
        assert _rel(got["grads"][key], g) <= TOLERANCE[dtype], key


def check_stall_restarts(hidden: int, proj: int, step: int) -> dict:
    """CTA 1 stalls before publishing h_t (forward step ``step``) and dr_t (backward step
    ``step``): both passes time out and restart, bitwise equal to the run without the stall
    (returned)."""
    prnn.configure(emulation_timeout_ms=300)
    data = _inputs(np.random.default_rng(9), hidden, proj)
    plain = _run("float32", "persistent", data, hidden, proj, LENGTHS)
    with prnn.inject_stall(block=1, step=step, duration_ms=1200):
        stalled = _run("float32", "persistent", data, hidden, proj, LENGTHS)
    for stats in (stalled["fwd"], stalled["bwd"]):
        assert stats.algo == "persistent" and stats.restarts >= 1 and stats.fallback is None, stats
    for a, b in zip(plain["arrays"] + list(plain["grads"].values()),
                    stalled["arrays"] + list(stalled["grads"].values())):
        assert np.array_equal(a, b)
    return plain


@pytest.mark.parametrize("step", [0, 3, T - 1], ids=["first", "middle", "last"])
def test_stall_restarts_with_bitwise_identical_results(settings, step):
    """Every step has two exchanges, so even the last one waits on every CTA: both passes
    restart at all three positions."""
    _assert_persistent(check_stall_restarts(12, 6, step))


def test_ctas_not_co_resident_end_on_the_completion_kernel(settings):
    prnn.configure(emulation_timeout_ms=200, emulation_max_resident=1, max_restarts=1)
    hidden, proj = 12, 6
    data = _inputs(np.random.default_rng(4), hidden, proj)
    got = _run("float32", "persistent", data, hidden, proj, LENGTHS)
    for stats in (got["fwd"], got["bwd"]):
        assert stats.algo == "persistent" and stats.restarts == 1, stats
        assert "barrier timeouts" in stats.fallback and "completion kernel" in stats.fallback, stats
    ref = _torch(got["params"], data, hidden, proj, LENGTHS)
    for a, b in zip(got["arrays"], ref["arrays"]):
        assert _rel(a, b) <= 1e-5
    for key, g in ref["grads"].items():
        assert _rel(got["grads"][key], g) <= 1e-5, key


# ---- the planner ----------------------------------------------------------------------------

def test_max_hidden_size_with_projection():
    for dtype in ("float32", "float16", "bfloat16"):
        assert prnn.max_hidden_size("lstm", dtype, "h100", proj_size=512) >= 2048
        assert prnn.max_hidden_size("lstm", dtype, "h200", proj_size=256) >= 2048
    # The figure: H 2048 / P 512 holds 4H*P + P*H = 5.2 M fp32 weights in registers.
    p = plan.make_plan("lstm", 2048, 1, "float32", "h100", proj_size=512)
    assert p.fits and p.forward.grid <= 132
    held = p.forward.grid * p.forward.block * p.forward.weights_per_thread
    assert held >= 4 * 2048 * 512 + 512 * 2048
    # Without a projection the LSTM tops out far lower.
    assert prnn.max_hidden_size("lstm", "float32", "h100") < 2048
    # A100: 108 SMs cannot hold the 128 CTAs of P 512.
    assert prnn.max_hidden_size("lstm", "float32", "a100", proj_size=512) == 0


def test_projection_plan_refusals_name_the_reason():
    assert "shared memory" in plan.make_plan("lstm", 2048, 8, device="h100", proj_size=512).reason
    assert "proj_size 1024 >" in plan.make_plan("lstm", 2048, 1, device="h100", proj_size=1024).reason
    with pytest.raises(ValueError, match="smaller than hidden_size"):
        plan.make_plan("lstm", 64, 1, device="h100", proj_size=64)
    with pytest.raises(ValueError, match="only supported for LSTM"):
        plan.make_plan("gru", 64, 1, device="h100", proj_size=16)
    with pytest.raises(ValueError, match="proj_size"):
        prnn.max_hidden_size("lstm", device="h100", proj_size=-1)


def check_shared_bytes_are_exact(monkeypatch, backward: bool, hidden: int, proj: int) -> None:
    """Emulated launches (a canary follows shared memory) of the pass planned for ``hidden`` and
    ``proj``: the planned bytes run; 4 bytes short is reported as an overrun, so the formula is
    exact."""
    emulate = pytest.importorskip("persistent_rnn.emulate")
    from persistent_rnn import runtime
    data = _inputs(np.random.default_rng(1), hidden, proj)
    run = lambda: _run("float32", "persistent", data, hidden, proj)  # noqa: E731
    _assert_persistent(run())
    exact = plan.projection_shared_bytes
    tile = plan.make_plan("lstm", hidden, B, device=runtime.EMULATED_DEVICE, proj_size=proj).tile
    short = exact(tile, backward, B) - 4
    monkeypatch.setattr(plan, "projection_shared_bytes",
                        lambda t, bwd, *a, **k: short if bwd == backward else exact(t, bwd, *a, **k))
    runtime._cached_engine.cache_clear()
    with pytest.raises(emulate.EmulationError, match="wrote past its"):
        run()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_projection_shared_bytes_are_what_the_kernel_carves_out(monkeypatch, settings, fresh_plans,
                                                                backward):
    check_shared_bytes_are_exact(monkeypatch, backward, 12, 6)


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "h0-c0"])
def test_torch_module_runs_the_persistent_lstmp_kernels(initial):
    """``persistent_rnn.torch.LSTM(proj_size=P, algo="persistent")`` on CPU tensors: the emulated
    kernels, a bidirectional 2-layer stack, packed input, with and without h0/c0, against
    torch.nn in float64 (forward and backward: input, state and parameter gradients)."""
    from persistent_rnn import torch as prt
    hidden, proj = 12, 6
    torch.manual_seed(3)
    ours = prt.LSTM(I, hidden, num_layers=2, bidirectional=True, proj_size=proj, algo="persistent")
    ref = torch.nn.LSTM(I, hidden, num_layers=2, bidirectional=True, proj_size=proj,
                        dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x = torch.randn(T, B, I)
    h0, c0 = torch.randn(4, B, proj), torch.randn(4, B, hidden)
    outs = []
    for module, dtype in ((ours, torch.float32), (ref, torch.float64)):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (x, h0, c0)]
        packed = torch.nn.utils.rnn.pack_padded_sequence(leaves[0], torch.from_numpy(LENGTHS),
                                                         enforce_sorted=False)
        y, (hn, cn) = module(packed, tuple(leaves[1:]) if initial else None)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=T)
        (y.sum() + (hn * hn).sum() + cn.sum()).backward()
        grads = [t.grad for t in leaves[:3 if initial else 1]]
        outs.append([y, hn, cn, *grads] + [p.grad for p in module.parameters()])
    assert ours.last_run.algo == "persistent", ours.last_run
    assert ours.last_run.backward.algo == "persistent", ours.last_run
    for a, b in zip(*outs):
        assert _rel(a.detach().numpy(), b.detach().numpy()) <= 1e-5
