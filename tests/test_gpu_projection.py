"""The persistent LSTM-with-projection kernels on a real GPU (marked ``gpu``): the issue's sizes
(H 1024 / P 256, H 2048 / P 512) against the float64 GEMM path, and a stall's restart that does
not change results. CPU evidence for the same kernels: tests/test_projection_persistent.py."""
from __future__ import annotations

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import plan

pytestmark = pytest.mark.gpu
I, T = 64, 20


def _run(cp, hidden, proj, batch, dtype, algo, params=None):
    rng = np.random.default_rng(hidden + batch)
    layer = prnn.LSTM(I, hidden, proj_size=proj, dtype=dtype, algo=algo, seed=5)
    if params is not None:
        layer.load_params({k: np.asarray(v, dtype) for k, v in params.items()})
    x = cp.asarray(rng.standard_normal((T, batch, I)), dtype)
    lengths = [T - (3 * i) % T for i in range(batch)]
    y, (hn, cn) = layer.forward(x, None, lengths)
    fwd = layer.last_run
    dx, (dh0, dc0) = layer.backward(cp.asarray(rng.standard_normal(y.shape), dtype))
    return dict(arrays=[y, hn, cn, dx, dh0, dc0, *layer.grads.values()], params=layer.params,
                fwd=fwd, bwd=layer.last_run)


@pytest.mark.parametrize("hidden,proj,batch", [(1024, 256, 1), (1024, 256, 8), (2048, 512, 1),
                                               (2048, 512, 6)])
def test_issue_sizes_match_float64(cupy, hidden, proj, batch):
    assert plan.make_plan("lstm", hidden, batch, proj_size=proj).fits
    got = _run(cupy, hidden, proj, batch, "float32", "persistent")
    assert got["fwd"].algo == got["bwd"].algo == "persistent" and not got["fwd"].emulated
    assert got["fwd"].restarts == got["bwd"].restarts == 0
    ref = _run(cupy, hidden, proj, batch, "float64", "gemm",
               {k: cupy.asnumpy(v) for k, v in got["params"].items()})
    for a, b in zip(got["arrays"], ref["arrays"]):
        err = float(cupy.abs(a.astype(cupy.float64) - b).max() / cupy.abs(b).max())
        assert err <= 1e-5, err


def test_stall_restarts_with_bitwise_identical_results(cupy, settings):
    prnn.configure(gpu_timeout_ms=20)
    plain = _run(cupy, 1024, 256, 4, "float32", "persistent")
    with prnn.inject_stall(block=3, step=4, duration_ms=200):
        stalled = _run(cupy, 1024, 256, 4, "float32", "persistent")
    assert stalled["fwd"].restarts >= 1 and stalled["bwd"].restarts >= 1
    assert stalled["fwd"].fallback is None and stalled["bwd"].fallback is None
    for a, b in zip(plain["arrays"], stalled["arrays"]):
        assert bool(cupy.array_equal(a, b))


# docs/api.md's 16-bit tolerance against the float64 layer on the same fp16 parameters (the
# layer API takes no CuPy bfloat16 arrays; bf16 runs in the emulation, tests/test_mma_projection.py).
FP16_TOLERANCE = 5e-3


@pytest.mark.parametrize("hidden,proj,batch", [(1024, 256, 8), (768, 384, 4)])
def test_fp16_projection_on_the_tensor_cores_within_the_16bit_bounds(cupy, hidden, proj, batch):
    """The mma projection tiles (both passes on the tensor cores from B = 4) on the GPU."""
    dtype = "float16"
    got = _run(cupy, hidden, proj, batch, dtype, "persistent")
    for stats, mma in ((got["fwd"], 1), (got["bwd"], 2)):
        assert stats.algo == "persistent" and not stats.emulated and stats.restarts == 0
        assert f"'PRNN_MMA': {mma}" in stats.details[0], stats.details
    params = {k: cupy.asnumpy(v).astype(np.float64) for k, v in got["params"].items()}
    ref = _run(cupy, hidden, proj, batch, "float64", "gemm", params)
    for a, b in zip(got["arrays"], ref["arrays"]):
        err = float(cupy.abs(a.astype(cupy.float64) - b).max() / cupy.abs(b).max())
        assert err <= FP16_TOLERANCE, err


@pytest.mark.parametrize("hidden,proj,batch,dtype", [(256, 64, 1, "float32"),
                                                     (512, 128, 4, "float32"),
                                                     (256, 64, 4, "float16")])
def test_cluster_projection_within_bounds_of_float64(cupy, hidden, proj, batch, dtype):
    """Small projections as one thread-block cluster on sm_90 (tiles.PROJECTION_CLUSTER_TILES;
    fp16 on the fp32 tile, widened), on the grid elsewhere. Not yet run on a GPU."""
    got = _run(cupy, hidden, proj, batch, dtype, "persistent")
    # (H 256 fits a cluster of 8 too, where the device holds no 16-CTA cluster; H 512 then not)
    cluster = plan.has_clusters(plan.resolve_device(None))
    for stats in (got["fwd"], got["bwd"]):
        assert stats.algo == "persistent" and not stats.emulated and stats.restarts == 0
        if not cluster or hidden <= 256:
            assert ("PRNN_CLUSTER" in stats.details[0]) == cluster, stats.details
    params = {k: cupy.asnumpy(v).astype(np.float64) for k, v in got["params"].items()}
    ref = _run(cupy, hidden, proj, batch, "float64", "gemm", params)
    for a, b in zip(got["arrays"], ref["arrays"]):
        err = float(cupy.abs(a.astype(cupy.float64) - b).max() / cupy.abs(b).max())
        assert err <= (1e-5 if dtype == "float32" else FP16_TOLERANCE), err
