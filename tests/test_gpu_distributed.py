"""persistent_rnn.distributed.allreduce_grads: bucketing on the CPU, NCCL on a GPU."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from persistent_rnn.distributed import allreduce_grads


def _gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver or no device
        return 0


def _nccl_available() -> bool:
    try:
        from cupy.cuda import nccl
        return bool(nccl.available)
    except Exception:
        return False


def _needs_nccl_gpu(test):
    """Mark ``test`` as a GPU test that skips without a GPU or without NCCL."""
    for mark in (pytest.mark.gpu,
                 pytest.mark.skipif(_gpu_count() < 1, reason="needs a CUDA GPU"),
                 pytest.mark.skipif(not _nccl_available(),
                                    reason="CuPy finds no NCCL (pip install nvidia-nccl-cu13)")):
        test = mark(test)
    return test


class _ThreadComm:
    """A collective over threads: what an NCCL communicator does, for a CPU test."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier):
        self.rank, self.world_size, self.slots, self.barrier = rank, len(slots), slots, barrier

    def all_reduce(self, in_array, out_array, op="sum", stream=None):
        assert op == "sum"
        self.slots[self.rank] = in_array.copy()
        self.barrier.wait(timeout=10)
        total = sum(self.slots)
        self.barrier.wait(timeout=10)  # everyone has read the slots before they are reused
        out_array[...] = total


def _grads(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"weight_ih_l0": rng.standard_normal((8, 3)), "weight_hh_l0": rng.standard_normal((8, 2)),
            "bias_ih_l0": rng.standard_normal(8).astype(np.float32),
            "bias_hh_l0": rng.standard_normal(8).astype(np.float32)}


@pytest.mark.parametrize("average", [True, False])
def test_bucketed_allreduce_over_threads(average):
    world = 3
    layers = [SimpleNamespace(grads=_grads(r)) for r in range(world)]
    want = {k: sum(_grads(r)[k] for r in range(world)) / (world if average else 1)
            for k in layers[0].grads}
    arrays = [dict(layer.grads) for layer in layers]  # the layers' own arrays are updated
    slots, barrier = [None] * world, threading.Barrier(world)
    threads = [threading.Thread(target=allreduce_grads,
                                args=(layers[r], _ThreadComm(r, slots, barrier), average))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for r in range(world):
        for k, v in want.items():
            assert layers[r].grads[k] is arrays[r][k]
            assert layers[r].grads[k].dtype == v.dtype
            np.testing.assert_allclose(layers[r].grads[k], v, rtol=1e-6 if v.dtype == np.float32
                                       else 1e-12)


def test_bad_arguments():
    comm = _ThreadComm(0, [None], threading.Barrier(1))
    with pytest.raises(TypeError, match="grads"):
        allreduce_grads(SimpleNamespace(), comm)
    with pytest.raises(TypeError, match="number of ranks"):
        allreduce_grads(SimpleNamespace(grads=_grads(0)), object())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer_grads_on_gpu(rank: int):
    """A real persistent_rnn LSTM on CuPy after one backward on rank ``rank``'s data."""
    import cupy

    import persistent_rnn as prnn

    layer = prnn.LSTM(8, 16, seed=0)
    layer.load_params({k: cupy.asarray(v) for k, v in layer.params.items()})
    rng = np.random.default_rng(10 + rank)
    x = cupy.asarray(rng.standard_normal((5, 2, 8)).astype(np.float32))
    dy = cupy.asarray(rng.standard_normal((5, 2, 16)).astype(np.float32))
    layer.forward(x)
    layer.backward(dy)
    return layer


@_needs_nccl_gpu
@pytest.mark.parametrize("average", [True, False])
def test_nccl_one_rank(average):
    import cupy
    import cupyx.distributed

    layer = _layer_grads_on_gpu(0)
    before = {k: v.copy() for k, v in layer.grads.items()}
    comm = cupyx.distributed.init_process_group(1, 0, host="127.0.0.1", port=_free_port())
    allreduce_grads(layer, comm, average=average)
    cupy.cuda.get_current_stream().synchronize()
    for k, v in before.items():
        assert cupy.array_equal(layer.grads[k], v), k



def _two_rank_worker(rank: int, port: int) -> None:
    import cupy
    import cupyx.distributed

    cupy.cuda.Device(rank).use()
    layer = _layer_grads_on_gpu(rank)
    mine = {k: v.copy() for k, v in layer.grads.items()}
    other = _layer_grads_on_gpu(1 - rank).grads  # the other rank's gradients, recomputed here
    comm = cupyx.distributed.init_process_group(2, rank, host="127.0.0.1", port=port)
    allreduce_grads(layer, comm)
    for k in mine:
        cupy.testing.assert_allclose(layer.grads[k], (mine[k] + other[k]) / 2, rtol=1e-6)


@_needs_nccl_gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_two_ranks():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port)],
                              env=dict(os.environ), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)


if __name__ == "__main__":
    _two_rank_worker(int(sys.argv[1]), int(sys.argv[2]))
