"""One ``torch.autograd.Function`` over ``persistent_rnn.functional``'s forward and backward."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .. import functional
from ..cells import CellSpec
from .interop import lengths_array, library_stream, to_array, to_tensor


@dataclass(frozen=True)
class RecurrentSpec:
    """Everything about a recurrent stack that is not a tensor."""

    cell: CellSpec
    names: tuple[str, ...]   # parameter names, in the order the weights are passed
    num_layers: int
    bidirectional: bool
    batch_first: bool
    algo: str


class RecurrentFunction(torch.autograd.Function):
    """``(x, lengths, h0, c0, *weights) -> (y, h_n, c_n, stats)`` through the library.

    ``h0``/``c0`` may be ``None`` (zeros), ``c0``/``c_n`` are ``None`` unless the cell is an
    LSTM, ``lengths`` is ``None`` or a CPU int64 tensor (packed-sequence semantics) and
    ``stats`` is the run's ``RunStats``. Backward is computed by the library and is not itself
    differentiable.
    """

    @staticmethod
    def forward(ctx, spec: RecurrentSpec, x: torch.Tensor, lengths: torch.Tensor | None,
                h0: torch.Tensor | None, c0: torch.Tensor | None, *weights: torch.Tensor):
        with library_stream(x):
            xa = to_array(x)
            params = {name: to_array(w) for name, w in zip(spec.names, weights)}
            hx = None if h0 is None else (
                (to_array(h0), to_array(c0)) if spec.cell.has_cell_state else to_array(h0))
            lens = None if lengths is None else lengths_array(lengths, xa)
            y, hn, fctx = functional.forward(
                spec.cell, params, xa, hx, lens, num_layers=spec.num_layers,
                bidirectional=spec.bidirectional, batch_first=spec.batch_first, algo=spec.algo)
            hn, cn = hn if spec.cell.has_cell_state else (hn, None)
            outputs = to_tensor(y), to_tensor(hn), to_tensor(cn)
        ctx.spec, ctx.fctx, ctx.has_h0 = spec, fctx, h0 is not None
        # The library keeps views of these tensors' memory: saving them lets autograd's version
        # counters reject a backward after they were modified in place (as torch.nn does).
        ctx.save_for_backward(x, h0, c0, *weights)
        return (*outputs, fctx.stats)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor, dhn: torch.Tensor, dcn: torch.Tensor | None, _stats):
        ctx.saved_tensors  # raises if an input was modified in place since forward
        spec = ctx.spec
        with library_stream(dy):
            dhx = (to_array(dhn), to_array(dcn)) if spec.cell.has_cell_state else to_array(dhn)
            dx, dh0, grads = functional.backward(ctx.fctx, to_array(dy), dhx)
            dh0, dc0 = dh0 if spec.cell.has_cell_state else (dh0, None)
            dweights = [to_tensor(grads[name]) for name in spec.names]
            dx = to_tensor(dx)
            dh0, dc0 = (to_tensor(dh0), to_tensor(dc0)) if ctx.has_h0 else (None, None)
        return (None, dx, None, dh0, dc0, *dweights)
