"""Character-level language model: embedding -> persistent_rnn.torch.LSTM -> linear.

Trains on text files (by default the project's own README.md and docs/*.md) and prints the loss
and the throughput in tokens/s. Runs on one CPU or GPU, or data-parallel under torchrun
(DistributedDataParallel; NCCL on CUDA, gloo on CPU) with a per-GPU batch as small as 1:

    python examples/char_lm.py --steps 300
    torchrun --nproc_per_node=8 examples/char_lm.py --batch 2 --hidden 1024
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import persistent_rnn.torch as prt

ROOT = Path(__file__).resolve().parents[1]


class CharLM(torch.nn.Module):
    """Embedding, a (persistent) LSTM stack and a linear read-out to next-character logits."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, algo: str) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.lstm = prt.LSTM(embed, hidden, num_layers=layers, batch_first=True, algo=algo)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(batch, time)`` token ids -> ``(batch, time, vocab)`` logits."""
        y, _ = self.lstm(self.embed(tokens))
        return self.head(y)


def load_text(paths: list[Path]) -> tuple[torch.Tensor, list[str]]:
    """The concatenated files as token ids, and the sorted character vocabulary."""
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), vocab


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Random windows of ``seq_len + 1`` characters: inputs and next-character targets."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def setup_distributed(device_arg: str) -> tuple[torch.device, int, int]:
    """Device, rank and world size; joins the process group when started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return device, rank, world


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=Path, nargs="+",
                    default=[ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per process (per GPU)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--algo", default="auto", choices=["auto", "gemm", "persistent"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def train(args: argparse.Namespace) -> list[float]:
    """Train and return the losses printed (rank 0's view of the mean over all ranks)."""
    device, rank, world = setup_distributed(args.device)
    data, vocab = load_text(args.text)
    if len(data) <= args.seq_len + 1:
        raise ValueError(f"--text has {len(data)} characters; need more than --seq-len + 1 = "
                         f"{args.seq_len + 1}")
    torch.manual_seed(args.seed)  # same initial model on every rank (DDP also broadcasts it)
    model = CharLM(len(vocab), args.embed, args.hidden, args.layers, args.algo).to(device)
    ddp = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own windows
    if rank == 0:
        print(f"char_lm: {len(data)} characters, vocab {len(vocab)}, world {world}, "
              f"device {device}, per-process batch {args.batch}", flush=True)
    losses, running, t0 = [], torch.zeros((), device=device), time.perf_counter()
    for step in range(1, args.steps + 1):
        x, target = (t.to(device) for t in sample_batch(data, args.batch, args.seq_len, gen))
        loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += loss.detach()
        if step % args.log_every == 0 or step == args.steps:
            done = step % args.log_every or args.log_every
            if world > 1:
                dist.all_reduce(running)
            mean = running.item() / (done * world)  # .item() waits for the device
            tokens_per_s = done * args.batch * args.seq_len * world / (time.perf_counter() - t0)
            losses.append(mean)
            if rank == 0:
                print(f"step {step:5d}  loss {mean:.4f}  ppl {math.exp(mean):8.2f}  "
                      f"tokens/s {tokens_per_s:10.0f}  algo {model.lstm.last_run.algo}", flush=True)
            running.zero_()
            t0 = time.perf_counter()
    if world > 1:
        # Drop DDP before the process group: otherwise its reducer holds the group's last reference
        # and destroys it at return while holding the GIL, which can deadlock with a gloo worker
        # thread that needs the GIL to release a tensor (pytorch/pytorch#56297; seen here).
        del ddp
        dist.barrier()  # no rank closes its connections while another still uses them
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    train(_parser().parse_args())
