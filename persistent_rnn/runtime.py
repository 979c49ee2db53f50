"""Run one layer-direction's recurrence: choose the algorithm, launch, report.

This is the seam between the layer code (``functional``) and the two recurrence engines: the
GEMM path (``gemm``) and the persistent kernel (GPU or CPU emulation). Inputs are time-major
and already projected: ``gi = x @ W_ih^T + b_ih`` for all steps.

Buffers of one layer-direction (T steps, batch B, hidden H, cell with G gates, S saved):

* ``y``     (T, B, H)   h_t for every step (frozen past a sequence's length), so ``y[T-1]``
                        is the final state; the layer zeroes outputs past lengths afterwards.
* ``cs``    (T, B, H)   c_t for every step (LSTM only, else ``None``), frozen likewise.
* ``saved`` (T, B, S*H) activations the cell's backward needs.
* ``dgi``, ``dgh`` (T, B, G*H) gradients of the input and recurrent pre-activations (the same
  array unless the cell is GRU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import gemm
from .cells import CellSpec
from .stats import RunStats

Array = Any


@dataclass
class ForwardResult:
    """The state buffers of one layer-direction's forward recurrence."""

    y: Array
    cs: Array | None
    saved: Array


@dataclass
class BackwardResult:
    """Gradients of one layer-direction's backward recurrence."""

    dgi: Array
    dgh: Array
    dh0: Array
    dc0: Array | None


def run_forward(cell: CellSpec, gi: Array, w_hh: Array, b_hh: Array | None, h0: Array,
                c0: Array | None, lengths: Array | None, algo: str, stats: RunStats) -> ForwardResult:
    """Run the forward recurrence over all steps of ``gi`` and record what ran in ``stats``."""
    y, cs, saved = gemm.allocate_forward(cell, gi)
    gemm.forward_steps(cell, gi, w_hh, b_hh, h0, c0, lengths, y, cs, saved, start=0)
    stats.merge(RunStats(algo="gemm"))
    return ForwardResult(y, cs, saved)


def run_backward(cell: CellSpec, dy: Array, dhn: Array, dcn: Array | None, w_hh: Array,
                 h0: Array, c0: Array | None, lengths: Array | None, fwd: ForwardResult,
                 algo: str, stats: RunStats) -> BackwardResult:
    """Run backward through time over all steps; ``dy`` must be zero past each length."""
    dgi, dgh = gemm.allocate_backward(cell, dy)
    dh0, dc0 = gemm.backward_steps(cell, dy, w_hh, h0, c0, lengths, fwd.y, fwd.cs, fwd.saved,
                                   dgi, dgh, dh_carry=dhn, dc_carry=dcn, stop=dy.shape[0])
    stats.merge(RunStats(algo="gemm"))
    return BackwardResult(dgi, dgh, dh0, dc0)
