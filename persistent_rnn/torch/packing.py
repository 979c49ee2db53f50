"""Padding and packing of variable-length batches as plain gathers.

torch's own pad/pack kernels (``pad_packed_sequence``, ``pack_padded_sequence``) do not run
under torch.func transforms; a gather with a precomputed index does, and is also what the
library's time-major padded layout needs on every path (the module's input and output, dropout
between layers on packed data, the differentiable recompute of the backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import PackedSequence


@dataclass(frozen=True)
class PackedLayout:
    """Where each step of each sequence of a packed batch lives in its packed data."""

    batch_sizes: torch.Tensor       # (T,) CPU int64, as in PackedSequence
    sorted_indices: torch.Tensor    # (B,) the caller's sequence at each sorted position
    unsorted_indices: torch.Tensor  # (B,) the sorted position of each caller's sequence
    rows: torch.Tensor              # (T, B) packed row of step t of sequence b (caller's order)
    valid: torch.Tensor             # (T, B) whether step t is within sequence b's length
    order: torch.Tensor             # (N,) padded position t * B + b of each packed row
    lengths: torch.Tensor           # (B,) CPU int64, the caller's order

    @classmethod
    def of(cls, packed: PackedSequence) -> "PackedLayout":
        """The layout of ``packed`` (its batch sizes and permutation)."""
        sizes = packed.batch_sizes
        batch = int(sizes[0])
        if packed.sorted_indices is None:
            order = torch.arange(batch)
            return cls._build(sizes, order, order, packed.data.device)
        return cls._build(sizes, packed.sorted_indices.cpu(), packed.unsorted_indices.cpu(),
                          packed.data.device)

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, device: torch.device) -> "PackedLayout":
        """The layout ``pack_padded_sequence(x, lengths, enforce_sorted=False)`` would make."""
        lengths = lengths.cpu()
        sorted_lengths, sorted_indices = torch.sort(lengths, descending=True)
        steps = int(sorted_lengths[0])
        sizes = (sorted_lengths[None, :] > torch.arange(steps)[:, None]).sum(1)
        return cls._build(sizes, sorted_indices, sorted_indices.argsort(), device)

    @classmethod
    def _build(cls, sizes: torch.Tensor, sorted_indices: torch.Tensor,
               unsorted_indices: torch.Tensor, device: torch.device) -> "PackedLayout":
        batch, total = int(sizes[0]), int(sizes.sum())
        valid = (torch.arange(batch)[None, :] < sizes[:, None])[:, unsorted_indices]
        rows = ((sizes.cumsum(0) - sizes)[:, None] + torch.arange(batch)[None, :])[
            :, unsorted_indices]
        order = torch.empty(total, dtype=torch.long)
        order[rows[valid]] = torch.arange(valid.numel()).view_as(valid)[valid]
        return cls(sizes, sorted_indices.to(device), unsorted_indices.to(device),
                   rows.clamp(max=total - 1).to(device), valid.to(device), order.to(device),
                   valid.sum(0))

    def pad(self, data: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Packed ``data`` (N, F) as time-major (T, B, F), zero past each length; ``steps``
        pads to more steps than the longest sequence."""
        padded = torch.where(self.valid[..., None], data[self.rows], data.new_zeros(()))
        extra = 0 if steps is None else steps - padded.shape[0]
        return padded if extra <= 0 else torch.cat(
            [padded, padded.new_zeros((extra, *padded.shape[1:]))])

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """Time-major ``y`` (T', B, F), T' >= T, as packed data (N, F)."""
        return y[:len(self.batch_sizes)].flatten(0, 1)[self.order]
