"""Drop-in ``torch.nn.RNN``, ``GRU`` and ``LSTM`` whose recurrence runs in persistent_rnn.

Each class subclasses its ``torch.nn`` counterpart, so the constructor, the parameters, their
initialisation, ``state_dict`` keys, ``repr`` and ``isinstance`` checks are torch's own; only
``forward`` is replaced. Extra keyword: ``algo`` ("auto", "gemm" or "persistent"), passed to
the library. Not supported (``ValueError`` at construction): ``dropout != 0``, ``proj_size``.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ..cells import cell_spec
from ..runtime import ALGOS
from ..stats import RunStats
from .function import RecurrentFunction, RecurrentSpec


class _PersistentRNNMixin:
    """The forward pass shared by the three modules (mixed in before the torch.nn class)."""

    mode: str
    nonlinearity: str
    last_run: RunStats | None

    def _init_persistent(self, algo: str) -> None:
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
        if self.dropout != 0:
            raise ValueError(f"dropout must be 0 (inter-layer dropout is not supported by "
                             f"persistent_rnn), got {self.dropout}")
        if getattr(self, "proj_size", 0) != 0:
            raise ValueError(f"proj_size must be 0 (LSTM projections are not supported by "
                             f"persistent_rnn), got {self.proj_size}")
        self.algo = algo
        self.last_run = None

    def _spec(self, batch_first: bool) -> RecurrentSpec:
        mode = "RNN" if self.mode.startswith("RNN") else self.mode
        return RecurrentSpec(cell_spec(mode, getattr(self, "nonlinearity", "tanh")),
                             tuple(self._flat_weights_names), self.num_layers,
                             self.bidirectional, batch_first, self.algo)

    def _check_args(self, x: torch.Tensor, hx, batch_sizes: torch.Tensor | None) -> None:
        # torch.nn's own shape checks, so that errors read exactly as torch.nn's
        if hx is None:
            self.check_input(x, batch_sizes)
        else:
            self.check_forward_args(x, hx, batch_sizes)

    def _check_like_input(self, x: torch.Tensor, hx) -> None:
        tensors = {"hx": hx} if isinstance(hx, torch.Tensor) else {
            f"hx[{i}]": h for i, h in enumerate(hx or ())}
        tensors.update(zip(self._flat_weights_names, self._flat_weights))
        for name, t in tensors.items():
            if t.dtype != x.dtype or t.device != x.device:
                raise TypeError(f"{name} must have the input's dtype and device "
                                f"({x.dtype}, {x.device}), got ({t.dtype}, {t.device})")

    def forward(self, input, hx=None):
        """torch.nn's forward: ``input, hx -> output, h_n`` (LSTM: ``output, (h_n, c_n)``)."""
        lstm = self.mode == "LSTM"
        if isinstance(input, PackedSequence):
            self._check_args(input.data, hx, input.batch_sizes)
            x, lengths = pad_packed_sequence(input)  # time-major, the caller's batch order
            batch_first, unbatched = False, False
        else:
            x, lengths, batch_first = input, None, self.batch_first
            unbatched = x.dim() == 2
            if unbatched:
                x = x.unsqueeze(0 if batch_first else 1)
                hx = _map(hx, _unsqueeze_hidden)
            self._check_args(x, hx, None)
        self._check_like_input(x, hx)
        h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (None, None)
        y, hn, cn, self.last_run = RecurrentFunction.apply(
            self._spec(batch_first), x, lengths, h0, c0, *self._flat_weights)
        if isinstance(input, PackedSequence):
            y = _repack(y, lengths, input)
        elif unbatched:
            y = y.squeeze(0 if batch_first else 1)
            hn, cn = _squeeze_hidden(hn), _map(cn, _squeeze_hidden)
        return y, ((hn, cn) if lstm else hn)


def _unsqueeze_hidden(h: torch.Tensor) -> torch.Tensor:
    if h.dim() != 2:
        raise ValueError(f"hx must be 2-D (num_layers * num_directions, hidden_size) for "
                         f"unbatched 2-D input, got a {h.dim()}-D tensor")
    return h.unsqueeze(1)


def _squeeze_hidden(h: torch.Tensor) -> torch.Tensor:
    return h.squeeze(1)


def _map(hx, fn):
    """Apply ``fn`` to a hidden state that is ``None``, a tensor or an LSTM ``(h, c)`` tuple."""
    if hx is None:
        return None
    return tuple(fn(h) for h in hx) if isinstance(hx, tuple) else fn(hx)


def _repack(y: torch.Tensor, lengths: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """Pack time-major ``y`` with exactly ``like``'s batch sizes and permutation."""
    if like.sorted_indices is not None:
        y, lengths = y.index_select(1, like.sorted_indices), lengths[like.sorted_indices.cpu()]
    data = pack_padded_sequence(y, lengths, enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


class RNN(_PersistentRNNMixin, torch.nn.RNN):
    """Drop-in ``torch.nn.RNN`` (tanh or relu) running on persistent_rnn; extra keyword ``algo``."""

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_persistent(algo)


class GRU(_PersistentRNNMixin, torch.nn.GRU):
    """Drop-in ``torch.nn.GRU`` running on persistent_rnn; extra keyword ``algo``."""

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_persistent(algo)


class LSTM(_PersistentRNNMixin, torch.nn.LSTM):
    """Drop-in ``torch.nn.LSTM`` running on persistent_rnn; extra keyword ``algo``."""

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_persistent(algo)
