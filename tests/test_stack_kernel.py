"""Stack mode: the planner places every layer of a unidirectional stack in one launch where
their weights fit the register files together; the wavefront kernels (``cuda_src/stack_*.cu``)
run the stack through the CPU emulation against the float64 GEMM path, with stalls in any layer
and CTAs that are not co-resident."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan as planner

pytestmark = pytest.mark.timeout(600)


def test_four_lstm_layers_of_384_fit_one_launch_on_an_h100():
    p = planner.make_stack_plan("LSTM", 384, 4, 4, device="h100")
    assert p.fits and p.launches == 1 and p.reason is None
    for pp in (p.forward, p.backward):
        assert pp.grid <= 132 and pp.grid % 4 == 0 and pp.source.startswith("stack_")
        assert pp.shared_bytes <= planner.resolve_device("h100").shared_per_block
    # each layer's CTAs hold [W_ih | W_hh] (forward) and [W_hh^T | W_ih^T of the layer above]
    units = p.tile.units
    assert p.forward.weights_per_thread * p.forward.block * (p.forward.grid // 4) >= 8 * 384 * 384
    assert units * (p.forward.grid // 4) >= 384


def test_stacks_that_do_not_fit_run_one_launch_per_layer_with_the_reason():
    big = planner.make_stack_plan("LSTM", 1024, 4, 3, device="h100")
    assert not big.fits and big.launches == 3 and "do not fit" in big.reason
    many = planner.make_stack_plan("LSTM", 384, 4, 6, device="h100")  # 6 x 32 CTAs > 132 SMs
    assert not many.fits and "SMs" in many.reason
    bidir = planner.make_stack_plan("GRU", 64, 2, 3, bidirectional=True, device="h100")
    assert not bidir.fits and bidir.launches == 6
    half = planner.make_stack_plan("GRU", 64, 2, 3, dtype="float16", device="h100")
    assert not half.fits and "fp32" in half.reason
    with pytest.raises(ValueError, match="layers"):
        planner.make_stack_plan("GRU", 64, 2, 0, device="h100")


def test_launches_count_one_per_layer_direction_without_stack_mode(settings):
    prnn.configure(stack=False)
    layer = prnn.GRU(3, 16, num_layers=2, bidirectional=True, algo="persistent", seed=0)
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    layer.forward(x)
    assert layer.last_run.launches == 4
    gemm = prnn.GRU(3, 16, num_layers=2, algo="gemm", seed=0)
    gemm.forward(x)
    assert gemm.last_run.launches == 0
