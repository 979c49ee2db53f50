"""The tensor-core mma of hw.cuh (``prnn_mma_f16``, ``prnn_mma_bf16``: mma.sync m16n8k16 with fp32
accumulation) through cuda_src/mma_fragments.cu, whose warps load random A, B and C into fragments
in the PTX ISA's layout and compute D = A B + C, then E = A B + D.

* Emulated: against float64 products of the 16-bit-rounded inputs, within the error bound of the
  emulation's fp32 k-sum; bitwise the sum in the documented order; under the ``schedule`` mode.
* The layout test fails when two lanes swap a fragment (A, B or C), and an mma without all 32
  lanes of its warp fails the launch.
* ``prnn_ldmatrix_x4`` (ldmatrix .m8n8.x4) loads A's fragments from shared memory as well.
* The source compiles with NVRTC for sm_80 and sm_90 to HMMA.16816.F32 (and .BF16) and LDSM.
* On a GPU (``gpu``): the hardware's D and E against the same float64 products.
"""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from persistent_rnn import emulate

SOURCE = str(Path(__file__).resolve().parent / "cuda" / "mma_fragments.cu")  # test-only kernel
DTYPES = {"float16": (np.float16, 1), "bfloat16": (ml_dtypes.bfloat16, 2)}
SWAPS = {"A": 1, "B": 2, "C": 3}
# Bound of the recursive fp32 sum of 17 terms (c and 16 products): 16 roundings to nearest, each
# within half an ulp of a partial sum, so below 8 ulps of sum(|terms|); 16 keeps it rigorous. The
# hardware orders and rounds the k-sum its own way (docs/emulation.md): twice that.
EMULATED_ULPS = 16
GPU_ULPS = 32


def _operands(dtype: str, warps: int, seed: int) -> dict[str, np.ndarray]:
    """Random A (16 x 16), B (16 x 8) and C (16 x 8) per warp, A and B rounded to ``dtype``, with
    magnitudes spread over a few binades so that a misplaced element shows."""
    rng = np.random.default_rng(seed)
    scale = lambda *shape: np.exp2(rng.integers(-3, 4, shape))
    half = DTYPES[dtype][0]
    a = (rng.standard_normal((warps, 16, 16)) * scale(warps, 16, 1)).astype(half)
    b = (rng.standard_normal((warps, 16, 8)) * scale(warps, 1, 8)).astype(half)
    c = (rng.standard_normal((warps, 16, 8)) * 4).astype(np.float32)
    return {"a": a, "b": b, "c": c}


def _words(ops: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A row-major and B column-major as 32-bit words of two 16-bit values, element 2j low."""
    a = np.ascontiguousarray(ops["a"]).view(np.uint16).view(np.uint32)
    bt = np.ascontiguousarray(ops["b"].transpose(0, 2, 1)).view(np.uint16).view(np.uint32)
    return a, bt


def _launch(module, xp, ops, dtype, warps_per_block=2, swap=(0, 0, 0), block=None,
            ldmatrix=False):
    warps = ops["a"].shape[0]
    a, bt = _words(ops)
    d, e = xp.full((warps, 16, 8), np.nan, np.float32), xp.full((warps, 16, 8), np.nan, np.float32)
    args = (xp.asarray(a), xp.asarray(bt), xp.asarray(ops["c"]), d, e, np.int32(DTYPES[dtype][1]),
            np.int32(ldmatrix), *(np.int32(s) for s in swap))
    module.launch("mma_m16n8k16", warps // warps_per_block, block or 32 * warps_per_block,
                  512 * warps_per_block, args)
    return [x if xp is np else x.get() for x in (d, e)]


def _reference(a, b, c) -> tuple[np.ndarray, np.ndarray]:
    """A B + C in float64 and the sum of the magnitudes of its terms."""
    a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
    return a @ b + c, np.abs(a) @ np.abs(b) + np.abs(c)


def _within(got, a, b, c, ulps: int) -> bool:
    want, magnitude = _reference(a, b, c)
    return bool((np.abs(got - want) <= ulps * np.spacing(magnitude.astype(np.float32))).all())


def _matches(ops, d, e, ulps: int) -> bool:
    """D = A B + C, and E = A B + D (on the D that came back)."""
    a, b = ops["a"], ops["b"]
    return _within(d, a, b, ops["c"], ulps) and _within(e, a, b, d, ulps)


@pytest.fixture(scope="module")
def module():
    return emulate.get_module(SOURCE, {})


@pytest.mark.parametrize("ldmatrix", [False, True], ids=["global", "ldmatrix"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_emulated_mma_is_a_plain_product(module, dtype, seed, ldmatrix):
    ops = _operands(dtype, warps=4, seed=seed)  # 2 blocks of 2 warps, each warp its own matrices
    d, e = _launch(module, np, ops, dtype, ldmatrix=ldmatrix)
    assert _matches(ops, d, e, EMULATED_ULPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_mma_sums_in_the_documented_order(module, dtype):
    # c + a[r][0] b[0][n] + ... + a[r][15] b[15][n], each addition rounded in fp32 (emulation.h).
    ops = _operands(dtype, warps=2, seed=7)
    d, _ = _launch(module, np, ops, dtype)
    a, b = (ops[k].astype(np.float32) for k in "ab")
    want = ops["c"].copy()
    for k in range(16):
        want += a[:, :, k, None] * b[:, None, k, :]
    assert np.array_equal(d, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_mma_under_random_schedules(module, dtype):
    # Fibers in random order and a random lagging warp: the collective's barrier orders the slots.
    for seed in range(3):
        ops = _operands(dtype, warps=4, seed=10 + seed)
        with emulate.modes("schedule", seed=seed):
            d, e = _launch(module, np, ops, dtype, warps_per_block=4, ldmatrix=seed % 2 == 1)
        assert _matches(ops, d, e, EMULATED_ULPS)


@pytest.mark.parametrize("operand", [*SWAPS, "A by ldmatrix"])
@pytest.mark.parametrize("lanes", [(0, 1), (3, 20), (9, 31)])
def test_swapped_fragments_fail_the_layout_test(module, operand, lanes):
    ops = _operands("float16", warps=2, seed=3)
    ldmatrix = operand == "A by ldmatrix"  # two lanes pass each other's row of A
    swap = SWAPS[operand[0]]
    d, e = _launch(module, np, ops, "float16", swap=(swap, *lanes), ldmatrix=ldmatrix)
    assert not _matches(ops, d, e, EMULATED_ULPS)
    d, e = _launch(module, np, ops, "float16", swap=(swap, lanes[0], lanes[0]), ldmatrix=ldmatrix)
    assert _matches(ops, d, e, EMULATED_ULPS)  # a lane "swapped" with itself: nothing moved


def test_mma_without_the_whole_warp_fails_the_launch(module):
    ops = _operands("float16", warps=2, seed=0)
    with pytest.raises(emulate.EmulationError, match="warp 1 ran an .aligned warp collective"):
        _launch(module, np, ops, "float16", block=48)  # the second warp has 16 lanes


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_mma_compiles_to_hmma(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from persistent_rnn import kernels, sass_analysis
    tool = sass_analysis.nvdisasm()
    assert tool, "nvdisasm missing: install the test extra (nvidia-cuda-nvdisasm)"
    compiled = kernels.compile_source(SOURCE, {}, arch)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in compiled.log
    code, _ = sass_analysis.parse(sass_analysis.disassemble(compiled.cubin_path, tool))
    opcodes = [op for op, *_ in code]
    assert opcodes.count("HMMA.16816.F32") == 2, opcodes  # fp16: D, then E
    assert opcodes.count("HMMA.16816.F32.BF16") == 2, opcodes
    assert opcodes.count("LDSM.16.M88.4") == 1, opcodes  # prnn_ldmatrix_x4
    assert not any(op.startswith(("LDL", "STL")) for op in opcodes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_mma_is_a_plain_product(cupy, dtype):
    from persistent_rnn import kernels
    gpu = kernels.get_module(SOURCE, {})
    for seed in range(4):
        ops = _operands(dtype, warps=8, seed=seed)
        d, e = _launch(gpu, cupy, ops, dtype, ldmatrix=seed % 2 == 1)
        assert _matches(ops, d, e, GPU_ULPS), seed
    d, e = _launch(gpu, cupy, ops, dtype, swap=(SWAPS["A"], 3, 20))
    assert not _matches(ops, d, e, GPU_ULPS)
