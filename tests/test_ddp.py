"""DistributedDataParallel over persistent_rnn.torch: 2 CPU processes (gloo) = 1 process.

The test starts two copies of this file as worker processes (no torchrun). Each rank trains on
its half of a fixed batch with a mean loss; DDP averages the gradients, which must equal the
gradients of the mean loss over the whole batch computed in one process.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

WORLD, BATCH, T, I, H = 2, 6, 5, 3, 4


def _model() -> torch.nn.Module:
    import persistent_rnn.torch as prt

    torch.manual_seed(0)
    # algo="gemm": the library's custom op under DDP (on CPU tensors "auto" runs torch's kernels)
    return torch.nn.ModuleDict({"rnn": prt.LSTM(I, H, num_layers=2, bidirectional=True,
                                                dtype=torch.float64, algo="gemm"),
                                "head": torch.nn.Linear(2 * H, 1, dtype=torch.float64)})


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, BATCH, I, dtype=torch.float64, generator=gen)
    lengths = torch.tensor([5, 2, 4, 3, 5, 1])
    target = torch.randn(BATCH, 1, dtype=torch.float64, generator=gen)
    return x, lengths, target


def _loss(model, x, lengths, target) -> torch.Tensor:
    """Mean squared error of the head applied to each sequence's final forward+backward state."""
    from torch.nn.utils.rnn import pack_padded_sequence

    _, (hn, _) = model["rnn"](pack_padded_sequence(x, lengths, enforce_sorted=False))
    last = torch.cat([hn[-2], hn[-1]], dim=1)  # top layer, both directions
    return torch.nn.functional.mse_loss(model["head"](last), target)


def _batch(rank: int | None = None):
    """The whole batch, or rank ``rank``'s contiguous share of it."""
    x, lengths, target = _data()
    if rank is None:
        return x, lengths, target
    part = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return x[:, part], lengths[part], target[part]


def _grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    loss.backward()  # under DDP, the gradient all-reduce runs during this call
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class _Wrapped(torch.nn.Module):
    """DDP wraps a module whose forward returns the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, lengths, target):
        return _loss(self.model, x, lengths, target)


def _worker(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    try:
        model = _model()
        ddp = DistributedDataParallel(_Wrapped(model))
        torch.save(_grads(model, ddp(*_batch(rank))), out / f"rank{rank}.pt")
        del ddp  # before the group it holds (the teardown deadlock noted in examples/char_lm.py)
        # Neither rank tears its gloo pairs down while the other may still use them: without this
        # barrier a rank aborted at exit now and then ("terminate called without an active
        # exception", seen in CI after both ranks had finished the all-reduce).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gradients_equal_single_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]  # a hang guard (slow when loaded)
    finally:
        for p in procs:  # never leave a worker behind (e.g. after a timeout)
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(logs)
    model = _model()
    want = _grads(model, _loss(model, *_batch()))
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    _worker(a.rank, a.port, a.out)
