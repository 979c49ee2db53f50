"""The CI slice of the seeded differential campaign (tests/campaign.py), and the accuracy
measures of docs/api.md that it checks.

The seeds are fixed and chosen so that together they take every option the campaign draws
(``test_ci_slice_covers_every_option``) on kernel configurations the rest of the suite builds
too (H 13 and 40), which keeps the slice well under two minutes on two cores. The long run is
``python -m tests.campaign --minutes N`` (README, "Commands").
"""
from __future__ import annotations

import numpy as np
import pytest

import campaign
from campaign import Case, draw_case, run_case

pytestmark = pytest.mark.timeout(600)

LAYER_SEEDS = [185, 200, 37, 81, 279, 44, 189, 3, 343, 394, 232, 339, 46, 94, 297, 203, 123]
MODULE_SEEDS = [0, 1, 605, 9, 3, 35, 6]
BAD_SEEDS = range(80)


@pytest.mark.parametrize("seed", LAYER_SEEDS)
def test_layer_case(seed):
    run_case(draw_case(seed, "ci", "layer"))


@pytest.mark.parametrize("seed", MODULE_SEEDS)
def test_module_case(seed):
    pytest.importorskip("torch")
    run_case(draw_case(seed, "ci", "module"))


@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_bad_input_case(seed):
    pytest.importorskip("torch")
    run_case(draw_case(seed, "ci", "bad"))


def test_ci_slice_covers_every_option():
    layer = [draw_case(s, "ci", "layer") for s in LAYER_SEEDS]
    got = set().union(*(campaign.features(c) for c in layer))
    assert got >= campaign.LAYER_FEATURES, campaign.LAYER_FEATURES - got
    module = [draw_case(s, "ci", "module") for s in MODULE_SEEDS]
    assert {c.algo for c in module} == {"auto", "gemm", "persistent"}
    assert {c.path for c in module if c.algo == "persistent"} == {"cluster", "grid"}
    assert any(campaign.ran_tf32(c) for c in module)
    assert {c.bad for c in (draw_case(s, "ci", "bad") for s in BAD_SEEDS)} == set(
        campaign.BAD_INPUTS)


def test_cases_replay_from_their_seed():
    assert draw_case(12345, "long") == draw_case(12345, "long")
    case = draw_case(7, "ci", "layer")
    assert f"--case 7 --kind layer --profile ci" in case.command()


def test_a_failure_names_the_seed_and_the_command(monkeypatch):
    # a wrong result must come back as the case, its seed and the one line that replays it
    monkeypatch.setitem(campaign.FREE_RUNNING, "float32", 0.0)
    case = draw_case(12, "ci", "layer")
    with pytest.raises(campaign.CampaignFailure, match=r"(?s)against the float64 layer.*seed=12"
                       r".*reproduce: PYTHONPATH=\. python -m tests\.campaign --case 12 "
                       r"--kind layer --profile ci"):
        run_case(case)


@pytest.mark.parametrize("profile", ["ci", "long"])
def test_the_replay_command_draws_the_same_case(profile):
    # a long run draws the kind too: its replay must not name it (naming it skips that draw)
    for seed in range(20):
        case = draw_case(seed, profile)
        args = case.command().split("-m tests.campaign ")[1].split()
        kind = args[args.index("--kind") + 1] if "--kind" in args else None
        assert draw_case(int(args[args.index("--case") + 1]), profile, kind) == case


# The relu RNN of issue 19: H 160, B 7, T 5, bidirectional, bfloat16 (the GEMM path rounds h_t
# where the kernels do, and gives the same errors).
RELU_CASE = Case(seed=22, kind="layer", profile="ci", cell="rnn_relu", input_size=5, hidden=160,
                 batch=7, steps=5, bidirectional=True, lengths=True, hx=True, dtype="bfloat16",
                 algo="gemm")


def test_relu_16bit_gradients_have_no_bound_against_unrounded_float64():
    """What docs/api.md says of relu: rounding h_t to 16 bits moves near-zero pre-activations
    across zero, relu's derivative jumps there, and the gradients leave the bound the other
    cells keep (the bound documented before issue 19 claimed it for relu too)."""
    data = campaign._data(RELU_CASE, np.random.default_rng(RELU_CASE.seed + 1))
    ours = campaign._layer(RELU_CASE, "bfloat16", "gemm")
    ref = campaign._layer(RELU_CASE, "float64", "gemm",
                          {k: v.astype(np.float64) for k, v in ours.params.items()})
    out, _, _, _ = campaign._run_layer(ours, data)
    want, _, _, _ = campaign._run_layer(ref, data)
    bound = campaign.FREE_RUNNING["bfloat16"]
    assert max(campaign.relerr(out[k], want[k]) for k in ("y", "hn[0]")) <= bound
    assert max(campaign.relerr(out[k], want[k]) for k in out if k.startswith("weight")) > bound


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_relu_16bit_gradients_are_exact_along_the_rounded_states(dtype):
    """The measure docs/api.md states for every cell, relu included: each state within one
    rounding of its float64 step, each gradient within one rounding of the float64 backward
    through the run's own states."""
    errors = run_case(RELU_CASE if dtype == "bfloat16" else
                      Case(**{**RELU_CASE.__dict__, "dtype": dtype}))
    assert errors[f"trajectory backward {dtype}"] <= campaign.UNIT_ROUNDOFF[dtype] + campaign.FP32


def test_a_case_starts_with_no_residency_cooldown():
    """An earlier case's cooldown (CTAs held back) must not send a later case to the GEMM path:
    the 30-minute run of 2026-11-24 failed so at its 1128th case."""
    from persistent_rnn import runtime
    runtime.COOLDOWNS.start(("earlier case",))
    campaign.run_case(campaign.draw_case(3, "ci", kind="bad"))
    assert runtime.COOLDOWNS.reason(("earlier case",)) is None


def test_a_planned_call_unlike_the_full_path_fails_its_case(monkeypatch):
    """The repeat of a case's call (``check_repeat``) holds the planned path to the full path's
    bits: one ulp off in a planned forward's output fails the case."""
    from persistent_rnn import call_plans
    forward = call_plans.Plan.forward

    def off_by_one_ulp(plan, *args):
        y, hn, ctx = forward(plan, *args)
        y[0, 0, 0] = np.nextafter(y[0, 0, 0], np.inf)
        return y, hn, ctx
    monkeypatch.setattr(call_plans.Plan, "forward", off_by_one_ulp)
    with pytest.raises(campaign.CampaignFailure, match="y: the planned call differs"):
        run_case(draw_case(339, "ci", "layer"))


def test_ctas_held_back_in_the_backward_pass_count():
    """A case whose forward grid fits ``max_resident`` but whose backward grid does not holds CTAs
    back in its backward (the short timeout, a restart or fallback expected): the 2026-11-27 long
    run (seed 303) failed so on a bfloat16 rnn_tanh, H 283, forward grid 18, backward 36."""
    case = draw_case(1023865560, "long")
    grids = campaign._grid(case), campaign._grid(case, "backward")
    assert (case.max_resident, *grids) == (18, 18, 36)
    assert campaign._held_back(case) and campaign._held_back(case, "backward")
    assert not campaign._held_back(case, "forward")
