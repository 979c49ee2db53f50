"""Data-parallel gradient all-reduce for CuPy users (``cupyx.distributed``, NCCL).

    import cupyx.distributed
    comm = cupyx.distributed.init_process_group(world_size, rank)   # one GPU per process
    layer.backward(dy)
    allreduce_grads(layer, comm)            # layer.grads now hold the mean over all ranks

All of a layer's gradients travel in one flat buffer per dtype: one collective (and one of
cupyx's host-side barriers) per step instead of one per parameter, which matters at the tiny
per-GPU batches this library is built for, where the all-reduce's latency term dominates.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Communicator(Protocol):
    """What ``allreduce_grads`` needs of a communicator (``cupyx.distributed.NCCLBackend``)."""

    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        """Sum ``in_array`` over all ranks into ``out_array``."""


def world_size(comm: Communicator) -> int:
    """Number of ranks of ``comm`` (cupyx keeps it in ``_n_devices``; it has no public getter)."""
    size = getattr(comm, "world_size", None) or getattr(comm, "_n_devices", None)
    if not isinstance(size, int) or size < 1:
        raise TypeError(f"comm must expose its number of ranks (world_size or _n_devices), "
                        f"got {type(comm).__name__}")
    return size


def allreduce_grads(layer: Any, comm: Communicator, average: bool = True) -> None:
    """Sum (``average=True``: average) ``layer.grads`` over all ranks of ``comm``, in place.

    ``layer`` is a ``persistent_rnn`` layer (or anything with a ``grads`` dict of CuPy arrays);
    every rank must hold the same parameter names, shapes and dtypes. Runs on CuPy's current
    stream; returns when the collective is enqueued.
    """
    grads = getattr(layer, "grads", None)
    if not isinstance(grads, dict) or not grads:
        raise TypeError(f"layer must have a non-empty dict 'grads', got {type(layer).__name__}")
    scale = 1.0 / world_size(comm) if average else 1.0
    by_dtype: dict[Any, list[Any]] = {}
    for g in grads.values():
        by_dtype.setdefault(g.dtype, []).append(g)
    xp = np if isinstance(next(iter(grads.values())), np.ndarray) else _cupy()
    for group in by_dtype.values():
        flat = xp.concatenate([g.reshape(-1) for g in group])
        comm.all_reduce(flat, flat, op="sum")
        if average:
            flat *= scale
        offset = 0
        for g in group:  # write back into the layer's own arrays (they accumulate across calls)
            g[...] = flat[offset:offset + g.size].reshape(g.shape)
            offset += g.size


def _cupy():
    import cupy  # only CuPy users need it; NumPy grads (tests, CPU ranks) work without it
    return cupy
