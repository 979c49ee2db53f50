"""The GEMM path on NumPy: resuming forward at ``start``, backward split at ``stop`` with carries,
the lengths mask, and the fused pointwise kernels compiled by NVRTC (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

from persistent_rnn import buffers, gemm
from persistent_rnn._sources import cuda_src_dir, read_source
from persistent_rnn.cells import CELLS

T, B, H = 7, 3, 5


def _setup(name: str, rng: np.random.Generator):
    cell = CELLS[name]
    gi = rng.standard_normal((T, B, cell.gates * H))
    w_hh = rng.standard_normal((cell.gates * H, H)) * 0.4
    b_hh = rng.standard_normal(cell.gates * H)
    h0 = rng.standard_normal((B, H))
    c0 = rng.standard_normal((B, H)) if cell.has_cell_state else None
    return cell, gi, w_hh, b_hh, h0, c0


def _forward(cell, gi, w_hh, b_hh, h0, c0, lengths):
    y, cs, saved = buffers.allocate_forward(cell, gi)
    gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=0)
    return y, cs, saved


@pytest.mark.parametrize("name", sorted(CELLS))
def test_forward_resumes_at_start(name):
    rng = np.random.default_rng(1)
    cell, gi, w_hh, b_hh, h0, c0 = _setup(name, rng)
    lengths = np.array([7, 2, 5], dtype=np.int32)
    y, cs, saved = _forward(cell, gi, w_hh, b_hh, h0, c0, lengths)
    y2, cs2, saved2 = buffers.allocate_forward(cell, gi)
    y2[:4], saved2[:4] = y[:4], saved[:4]
    if cs is not None:
        cs2[:4] = cs[:4]
    y2[4:] = np.nan  # must be overwritten
    gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y2, cs2, saved2, start=4)
    np.testing.assert_array_equal(y2, y)
    if cs is not None:
        np.testing.assert_array_equal(cs2, cs)


@pytest.mark.parametrize("name", sorted(CELLS))
def test_state_frozen_past_length(name):
    rng = np.random.default_rng(2)
    cell, gi, w_hh, b_hh, h0, c0 = _setup(name, rng)
    lengths = np.array([7, 1, 4], dtype=np.int32)
    y, cs, _ = _forward(cell, gi, w_hh, b_hh, h0, c0, lengths)
    for b, n in enumerate(lengths):
        assert np.all(y[n:, b] == y[n - 1, b])
        assert not np.array_equal(y[n - 1, b], h0[b])
        if cs is not None:
            assert np.all(cs[n:, b] == cs[n - 1, b])
    full, _, _ = _forward(cell, gi, w_hh, b_hh, h0, c0, None)
    np.testing.assert_array_equal(y[:, 0], full[:, 0])  # the full-length sequence is unaffected


@pytest.mark.parametrize("name", sorted(CELLS))
def test_backward_split_at_stop_and_mask(name):
    rng = np.random.default_rng(3)
    cell, gi, w_hh, b_hh, h0, c0 = _setup(name, rng)
    lengths = np.array([7, 3, 5], dtype=np.int32)
    y, cs, saved = _forward(cell, gi, w_hh, b_hh, h0, c0, lengths)
    dy = rng.standard_normal(y.shape)
    dy[np.arange(T)[:, None] >= lengths[None, :]] = 0.0
    dhn = rng.standard_normal((B, H))
    dcn = rng.standard_normal((B, H)) if cell.has_cell_state else None
    dgi, dgh = buffers.allocate_backward(cell, dy)
    dh0, dc0 = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, y, cs, saved, dgi, dgh,
                                   dhn, dcn, stop=T)
    assert (dgh is dgi) == (name != "gru")
    past = np.arange(T)[:, None] >= lengths[None, :]
    assert np.all(dgi[past] == 0) and np.all(dgh[past] == 0)
    # run the top 3 steps, then finish from the carries: the same gradients
    dgi2, dgh2 = buffers.allocate_backward(cell, dy)
    top_h, top_c = _top_steps(cell, dy, w_hh, h0, c0, lengths, y, cs, saved, dgi2, dgh2, dhn, dcn)
    dh0b, dc0b = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, y, cs, saved, dgi2, dgh2,
                                     top_h, top_c, stop=4)
    np.testing.assert_allclose(dgi2, dgi, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dh0b, dh0, rtol=1e-13, atol=1e-15)
    if dc0 is not None:
        np.testing.assert_allclose(dc0b, dc0, rtol=1e-13, atol=1e-15)
    # a sequence shorter than T gets dh_n (dc_n) straight through to its last active step: its
    # gradients equal those of a run over its own n steps that starts from dh_n (dc_n)
    b, n = 1, int(lengths[1])
    part = (lambda a: None if a is None else a[:n])
    dgi3, dgh3 = buffers.allocate_backward(cell, dy[:n])
    dh0c, dc0c = gemm.backward_steps(cell, dy[:n], w_hh, h0, c0, np.minimum(lengths, n), y[:n],
                                     part(cs), saved[:n], dgi3, dgh3, dhn, dcn, stop=n)
    np.testing.assert_allclose(dgi3[:, b], dgi[:n, b], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dh0c[b], dh0[b], rtol=1e-13, atol=1e-15)
    if dc0 is not None:
        np.testing.assert_allclose(dc0c[b], dc0[b], rtol=1e-13, atol=1e-15)


def _top_steps(cell, dy, w_hh, h0, c0, lengths, y, cs, saved, dgi, dgh, dhn, dcn):
    """Gradients reaching h_3 / c_3 from steps 4..T-1: backward over the tail as its own run
    (h0/c0 of the tail are y[3] / cs[3])."""
    tail = slice(4, T)
    dh, dc = gemm.backward_steps(
        cell, dy[tail], w_hh, y[3], None if cs is None else cs[3], lengths - 4, y[tail],
        None if cs is None else cs[tail], saved[tail], dgi[tail], dgh[tail], dhn, dcn, stop=T - 4)
    return dh, dc


def test_dh_carry_none_means_zero():
    rng = np.random.default_rng(4)
    cell, gi, w_hh, b_hh, h0, c0 = _setup("lstm", rng)
    y, cs, saved = _forward(cell, gi, w_hh, b_hh, h0, c0, None)
    dy = rng.standard_normal(y.shape)
    out = []
    for carry in (None, np.zeros((B, H))):
        dgi, dgh = buffers.allocate_backward(cell, dy)
        out.append(gemm.backward_steps(cell, dy, w_hh, h0, c0, None, y, cs, saved, dgi, dgh,
                                       carry, carry, stop=T))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_pointwise_kernels_compile_without_spills(arch):
    """Every fused pointwise kernel builds with NVRTC for the shipped architectures, no spills."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc  # compiles without a GPU (the nvidia-cuda-nvrtc wheel)
    names = [f"prnn_pointwise_{w}_{s}" for w in ("forward", "backward") for s in ("f32", "f64")]
    for cell in CELLS.values():  # one build per cell (-D PRNN_CELL)
        prog = nvrtc.createProgram(read_source("pointwise.cu"), "pointwise.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", "-I" + str(cuda_src_dir()), "--std=c++17",
                                        "-Xptxas=-v", f"-DPRNN_CELL={cell.kind}"])
        finally:
            log = nvrtc.getProgramLog(prog)
        for name in names:
            assert f"entry function '{name}'" in log, (cell.name, name)
        assert log.count("0 bytes spill stores, 0 bytes spill loads") >= len(names), log


def test_sizes_the_pointwise_kernels_cannot_index_are_refused():
    """Checked before any allocation (a stand-in module plays CuPy: the sizes are what matters)."""
    gpu = object()
    gemm._check_sizes(gpu, 10, 2**16, 2**15)  # B*H = 2^31 threads: fine with 64-bit indices
    for sizes in ((2**31, 1, 1), (1, 2**31, 1), (1, 2**20, 2**30)):
        with pytest.raises(ValueError, match="too large"):
            gemm._check_sizes(gpu, *sizes)
    gemm._check_sizes(np, 2**31, 1, 1)  # NumPy has no such limit
