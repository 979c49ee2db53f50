"""TF32 on the tensor cores (``settings.allow_tf32``, issue 28): the instruction, then the tiles.

* ``prnn_tf32_bits`` (cvt.rna.tf32.f32) rounds to nearest, ties away from zero, in the emulation.
* ``prnn_mma_tf32`` (mma.sync m16n8k8 .tf32, fp32 accumulation) through
  tests/cuda/mma_fragments.cu (dtype 3): random fp32 A, B and C, rounded by the kernel, against
  float64 products of the rounded operands; swapping two lanes' fragments fails it; the source
  compiles to HMMA.1688.F32.TF32.
"""
from __future__ import annotations

import numpy as np
import pytest

from persistent_rnn import emulate

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
