"""``python -m persistent_rnn.demo``: forward and backward of each cell with a printed summary.

Runs on NumPy (no GPU needed): a small bidirectional two-layer stack per cell with unsorted
sequence lengths, and reports shapes, what ran (``last_run``), timings and a gradient check
against a central finite difference.
"""
from __future__ import annotations

import time

import numpy as np

import persistent_rnn as prnn
from persistent_rnn.cells import CELLS, layer_args

T, B, I, H = 16, 4, 8, 32


def _loss(layer, x, lengths, dy) -> float:
    y, _ = layer.forward(x, lengths=lengths)
    return float((y * dy).sum())


def run_cell(name: str, layer) -> str:
    """Forward, backward and a finite-difference check of one layer; one summary line."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, I))
    lengths = np.array([16, 5, 11, 1])
    start = time.perf_counter()
    y, _ = layer.forward(x, lengths=lengths)
    fwd_ms = (time.perf_counter() - start) * 1e3
    forward_run = layer.last_run
    dy = rng.standard_normal(y.shape)
    start = time.perf_counter()
    dx, _ = layer.backward(dy)
    bwd_ms = (time.perf_counter() - start) * 1e3
    w = layer.params["weight_hh_l0"]
    eps, old = 1e-6, w[3, 5]
    w[3, 5] = old + eps
    up = _loss(layer, x, lengths, dy)
    w[3, 5] = old - eps
    down = _loss(layer, x, lengths, dy)
    w[3, 5] = old
    fd_err = abs((up - down) / (2 * eps) - layer.grads["weight_hh_l0"][3, 5])
    return (f"{name:9s} y {tuple(y.shape)}  dx {tuple(dx.shape)}  algo={forward_run.algo:<10s} "
            f"restarts={forward_run.restarts}  fwd {fwd_ms:6.1f} ms  bwd {bwd_ms:6.1f} ms  "
            f"|grad - finite diff| = {fd_err:.1e}")


def main() -> None:
    """Print one summary line per cell."""
    print(f"persistent_rnn {prnn.__version__} demo on NumPy: T={T} B={B} input={I} hidden={H}, "
          f"2 layers, bidirectional, lengths [16, 5, 11, 1], float64")
    kw = dict(num_layers=2, bidirectional=True, dtype="float64", seed=0)
    for spec in CELLS.values():
        mode, args = layer_args(spec.name)
        print(run_cell(spec.label, getattr(prnn, mode)(I, H, **args, **kw)))


if __name__ == "__main__":
    main()
