"""One small case of every persistent kernel on the GPU, for compute-sanitizer.

Run as ``compute-sanitizer --tool memcheck python tests/gpu_sanitize_case.py`` (and racecheck);
exits 1 when a result differs from the float64 GEMM reference. Used by test_gpu_persistent.py.
"""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from persistent_rnn import runtime
from persistent_rnn.cells import CELLS
from persistent_rnn.stats import RunStats


def run_case(cell, hidden=40, batch=2, steps=3) -> float:
    """Forward and backward of ``cell`` persistent vs GEMM (float64); the worst relative error."""
    rng = np.random.default_rng(0)
    g = cell.gates
    host = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in
            ((steps, batch, g * hidden), (g * hidden, hidden), (g * hidden,), (batch, hidden),
             (batch, hidden), (steps, batch, hidden), (batch, hidden), (batch, hidden))]
    host[1] /= np.float32(np.sqrt(hidden))
    lengths = cp.asarray(np.array([steps, steps - 1][:batch], np.int32))
    host[5][steps - 1, 1:] = 0  # dy is zero past each length
    worst = 0.0
    results = {}
    for dtype, algo in ((np.float32, "persistent"), (np.float64, "gemm")):
        gi, w, b, h0, c0, dy, dhn, dcn = (cp.asarray(a, dtype) for a in host)
        if not cell.has_cell_state:
            c0 = dcn = None
        fwd = runtime.run_forward(cell, gi, w, b, h0, c0, lengths, algo, RunStats())
        bwd = runtime.run_backward(cell, dy, dhn, dcn, w, h0, c0, lengths, fwd, algo, RunStats())
        results[algo] = [fwd.y, fwd.saved, bwd.dgi, bwd.dgh, bwd.dh0]
    for a, r in zip(results["persistent"], results["gemm"]):
        if r.size:
            worst = max(worst, float(cp.linalg.norm(a.astype(cp.float64) - r) / cp.linalg.norm(r)))
    return worst


def main() -> int:
    status = 0
    for name, cell in sorted(CELLS.items()):
        err = run_case(cell)
        print(f"{name}: relative error {err:.2e}")
        status |= err > 1e-5
    cp.cuda.Device().synchronize()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
