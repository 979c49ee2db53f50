"""The LSTM-with-projection kernels as one thread-block cluster (``tiles.PROJECTION_CLUSTER_TILES``;
both exchanges in distributed shared memory, ``cuda_src/persistent_projection.cuh``) in the CPU
emulation of an H100: fp32 against ``torch.nn.LSTM(proj_size=P)`` in float64 with and without
lengths and initial states, 16-bit weights against the float64 layer, a stall at three steps
(bitwise identical restarts), sabotaged kernels that each fail, and the planner's choice.
CI: small H on clusters of 2-4 CTAs; ``PRNN_TEST_EVERY_KERNEL=1`` adds the larger tile at its
full cluster and the other dtypes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import emulate, runtime, tiles
from persistent_rnn import plan as planner
from full_set import EVERY_KERNEL
from sabotage import sabotaged
from test_projection_persistent import (LENGTHS, TOLERANCE, T, _inputs, _rel, _run, _torch,
                                        check_shared_bytes_are_exact, check_stall_restarts)

pytestmark = pytest.mark.timeout(300)

FORWARD = "persistent_projection_forward.cu"


def _assert_cluster(got: dict, restarts: int = 0) -> None:
    """Both passes ran the emulated cluster kernels, with ``restarts`` restarts."""
    for stats in (got["fwd"], got["bwd"]):
        assert stats.algo == "persistent" and stats.emulated and stats.fallback is None, stats
        assert stats.restarts == restarts, stats
        launched = [d for d in stats.details if "launch(es)" in d or "grid " in d]
        assert launched and all("prnn_projection_" in d and "PRNN_CLUSTER" in d
                                for d in launched), stats.details


def _check(hidden: int, proj: int, lengths=None, initial: bool = True, seed: int = 1) -> None:
    """fp32 forward and backward as a cluster against torch.nn in float64."""
    data = _inputs(np.random.default_rng(seed), hidden, proj)
    if not initial:
        data["hx"] = tuple(np.zeros_like(a) for a in data["hx"])
    got = _run("float32", "persistent", data, hidden, proj, lengths)
    _assert_cluster(got)
    ref = _torch(got["params"], data, hidden, proj, lengths)
    for a, b in zip(got["arrays"], ref["arrays"]):
        assert a.shape == b.shape and _rel(a, b) <= 1e-5
    for key, g in ref["grads"].items():
        assert _rel(got["grads"][key], g) <= 1e-5, key


# (H, P) on the 4-warp tile: 2 CTAs, each owning units and rows of r; H 20 / P 13: 4 CTAs, of
# which 2 own rows of r alone, and exchanged rows of odd length.
@pytest.mark.parametrize("hidden,proj", [(32, 8), (20, 13)])
@pytest.mark.parametrize("lengths,initial", [(None, True), (LENGTHS, False)],
                         ids=["full-h0c0", "lengths-zero-state"])
def test_fp32_cluster_matches_torch_nn_float64(hidden, proj, lengths, initial):
    assert planner.make_plan("lstm", hidden, 3, device="h100", proj_size=proj).tile.cluster
    _check(hidden, proj, lengths, initial, seed=hidden)


@pytest.mark.skipif(not EVERY_KERNEL, reason="PRNN_TEST_EVERY_KERNEL=1: the full set")
@pytest.mark.parametrize("hidden,proj", [(256, 64), (72, 66), (300, 100)])
def test_full_set_cluster_tiles_match_torch_nn_float64(hidden, proj):
    """The 4-warp tile at its full cluster of 16 CTAs, the 8-warp tile at 9 CTAs (rows of r
    alone on 6) and 10."""
    _check(hidden, proj, LENGTHS)


@pytest.mark.parametrize("dtype", sorted(TOLERANCE) if EVERY_KERNEL else ["float16"])
def test_16bit_cluster_within_tolerance_of_float64(dtype):
    """A 16-bit layer's passes in a cluster are the fp32 cluster tile's, the weights widened
    (the forward reads the 16-bit words and rounds r_t: PRNN_WIDENED_FROM)."""
    hidden, proj = 20, 7
    data = _inputs(np.random.default_rng(5), hidden, proj)
    got = _run(dtype, "persistent", data, hidden, proj, LENGTHS)
    _assert_cluster(got)
    assert all("PRNN_WIDENED_FROM" in d and "PRNN_WEIGHT_DTYPE" not in d
               for d in got["fwd"].details if "grid " in d)
    assert not any("PRNN_WEIGHT_DTYPE" in d for d in got["bwd"].details)
    ref = _run("float64", "gemm", data, hidden, proj, LENGTHS,
               params={k: np.asarray(v, np.float64) for k, v in got["params"].items()})
    for a, b in zip(got["arrays"] + list(got["grads"].values()),
                    ref["arrays"] + [ref["grads"][k] for k in got["grads"]]):
        assert _rel(a, b) <= TOLERANCE[dtype]


@pytest.mark.parametrize("step", [0, 3, T - 1], ids=["first", "middle", "last"])
def test_stall_restarts_with_bitwise_identical_results(settings, step):
    """CTA 1 of the cluster stalls at ``step``: the chain's resume launches finish both passes,
    bitwise equal to a run without the stall."""
    _assert_cluster(check_stall_restarts(32, 8, step))


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_shared_bytes_with_both_exchanges_are_what_the_kernel_carves_out(monkeypatch, settings,
                                                                         fresh_plans, backward):
    """The cluster's layout ends with its copies of both exchanges (EXCHANGE, EXCHANGE_B)."""
    check_shared_bytes_are_exact(monkeypatch, backward, 32, 8)


# ---- sabotages: each breaks the cluster's r_t exchange and must fail _check -------------------

def _forward_from(monkeypatch, src_dir) -> None:
    """The runtime builds the projection forward from ``src_dir`` (tests with fresh_plans)."""
    build = emulate.get_module
    monkeypatch.setattr(emulate, "get_module", lambda source, defines: build(
        source, defines, src_dir if source == FORWARD else None))


def test_a_missing_wait_on_r_fails(settings, tmp_path, monkeypatch, fresh_plans):
    """Tile A's warps read r_{t-1}'s words without waiting for their tags (an exchange whose
    published length is 0: wait_lane checks no word): they read stale r (delayed stores make
    it certain; it fails without them too)."""
    sabotaged(tmp_path, FORWARD, "  const Exchange xr = begin_exchange(exchange_r, sh, batch, proj, batch * V);\n",
              "  const Exchange xr = begin_exchange(exchange_r, sh, batch, proj, batch * V);\n"
              "  Exchange unwaited = xr;\n  unwaited.k_len = 0;\n")
    src = sabotaged(tmp_path, FORWARD, "projection_product(gates, xr, t - 1,",
                    "projection_product(gates, unwaited, t - 1,")
    _forward_from(monkeypatch, src)
    prnn.configure(emulation_timeout_ms=50, max_restarts=0)
    with emulate.modes("delayed", seed=3), pytest.raises(AssertionError):
        _check(32, 8)


def test_r_published_to_part_of_the_cluster_fails(settings, tmp_path, monkeypatch, fresh_plans):
    """r_t stored into every CTA's copy but the last's: that CTA waits in vain, the pass times
    out and ends on the completion kernel."""
    src = sabotaged(tmp_path, FORWARD, "      xr.publish(t, b, q, r);\n",
                    "      for (int cta = 0; cta + 1 < PRNN_CLUSTER; ++cta) {\n"
                    "        prnn_store_cluster_u32(xr.words + (t & 1) * xr.slot() + b * kPadded + q,"
                    " cta, prnn_tagged(r, prnn_step_tag(t)));\n      }\n")
    _forward_from(monkeypatch, src)
    prnn.configure(emulation_timeout_ms=50, max_restarts=0)
    with pytest.raises(AssertionError):
        _check(32, 8)


# ---- the planner -------------------------------------------------------------------------------

def test_the_planner_tries_the_cluster_first_where_it_fits():
    p = planner.make_plan("lstm", 256, 1, device="h100", proj_size=64)
    assert p.tile in tiles.PROJECTION_CLUSTER_TILES and p.forward.grid == 16
    assert p.forward.defines["PRNN_CLUSTER"] == p.backward.defines["PRNN_CLUSTER"] == 16
    assert "PRNN_GATHER_QUADS" not in p.forward.defines
    big = planner.make_plan("lstm", 512, 4, device="h100", proj_size=128)
    assert big.tile is tiles.PROJECTION_CLUSTER_TILES[1] and big.forward.grid == 16
    # Past the cluster (H 513 needs 17 CTAs) and on an A100 (sm_80): the grid. Where clusters
    # hold 8 CTAs, H 256 takes the 8-warp tile, H 300 (10 CTAs) the grid.
    for hidden, device in ((513, "h100"), (256, "a100")):
        assert not planner.make_plan("lstm", hidden, 1, device=device, proj_size=64).tile.cluster
    portable = dataclasses.replace(planner.resolve_device("h100"), max_cluster_ctas=8)
    assert planner.make_plan("lstm", 256, 1, device=portable, proj_size=64).forward.grid == 8
    assert not planner.make_plan("lstm", 300, 1, device=portable, proj_size=64).tile.cluster
    # 16-bit layers: the fp32 cluster tile, the weights widened, at any batch.
    for batch in (1, 8):
        half = planner.make_plan("lstm", 256, batch, "float16", "h100", proj_size=64)
        assert half.tile is p.tile and half.forward.defines["PRNN_WIDENED_FROM"] == 1
        assert half.backward == planner.make_plan("lstm", 256, batch, device="h100",
                                                  proj_size=64).backward
    # The largest H with a projection is the grid tiles' still.
    assert prnn.max_hidden_size("lstm", "float32", "h100", proj_size=64) > 512
