"""Speech-style CTC on synthetic frames: packed bidirectional persistent_rnn.torch.GRU/LSTM.

Each utterance is a random label sequence; every label is rendered as 2-4 noisy frames of its
own random "spectrum", with silence frames between some labels. A bidirectional recurrent stack
reads the variable-length utterances as a PackedSequence and is trained with CTC; the script
prints the CTC loss, the greedy-decoding label error rate and frames/s.

    python examples/speech_ctc.py --steps 200
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import persistent_rnn.torch as prt

BLANK = 0


def synth_batch(protos: torch.Tensor, batch: int, max_labels: int, noise: float,
                gen: torch.Generator):
    """Frames ``(T, B, F)``, frame counts ``(B,)``, labels ``(B, L)`` padded, label counts ``(B,)``.

    ``protos[0]`` is silence and ``protos[k]`` the spectrum of label ``k`` (labels 1..K).
    """
    seqs, labels = [], []
    for _ in range(batch):
        lab = torch.randint(1, len(protos), (int(torch.randint(1, max_labels + 1, (1,),
                                                               generator=gen)),), generator=gen)
        frames = []
        for k in lab.tolist():
            reps = int(torch.randint(2, 5, (1,), generator=gen))
            frames += [k] * reps + [0] * int(torch.randint(0, 2, (1,), generator=gen))
        ids = torch.tensor(frames)
        seqs.append(protos[ids] + noise * torch.randn(len(ids), protos.shape[1], generator=gen))
        labels.append(lab)
    lengths = torch.tensor([len(s) for s in seqs])
    x = torch.nn.utils.rnn.pad_sequence(seqs)  # (T, B, F)
    target_lengths = torch.tensor([len(lab) for lab in labels])
    targets = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True)
    return x, lengths, targets, target_lengths


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks."""
    best = log_probs.argmax(-1).T  # (B, T)
    out = []
    for row, n in zip(best.tolist(), lengths.tolist()):
        seq = [k for i, k in enumerate(row[:n]) if k != BLANK and (i == 0 or k != row[i - 1])]
        out.append(seq)
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance between two label sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


class CTCModel(torch.nn.Module):
    """Bidirectional recurrent stack over packed frames, then per-frame label log-probabilities."""

    def __init__(self, features: int, hidden: int, layers: int, labels: int, cell: str,
                 algo: str) -> None:
        super().__init__()
        self.rnn = getattr(prt, cell)(features, hidden, num_layers=layers, bidirectional=True,
                                      algo=algo)
        self.head = torch.nn.Linear(2 * hidden, labels + 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(T, B, F)`` frames -> ``(T, B, labels + 1)`` log-probabilities (blank = 0)."""
        y, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        y, _ = pad_packed_sequence(y)
        return self.head(y).log_softmax(-1)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=int, default=8)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cell", choices=["GRU", "LSTM"], default="GRU")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-labels", type=int, default=6)
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--algo", default="auto", choices=["auto", "gemm", "persistent"])
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def train(args: argparse.Namespace) -> list[float]:
    """Train on fresh synthetic batches; returns the mean CTC loss of each logging interval."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    protos = torch.randn(args.labels + 1, args.features, generator=gen)
    model = CTCModel(args.features, args.hidden, args.layers, args.labels, args.cell, args.algo)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ctc = torch.nn.CTCLoss(blank=BLANK, zero_infinity=True)
    losses, running, frames, t0 = [], 0.0, 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        x, lengths, targets, target_lengths = synth_batch(protos, args.batch, args.max_labels,
                                                          args.noise, gen)
        log_probs = model(x, lengths)
        loss = ctc(log_probs, targets, lengths, target_lengths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running, frames = running + loss.item(), frames + int(lengths.sum())
        if step % args.log_every == 0 or step == args.steps:
            done = step % args.log_every or args.log_every
            hyps = greedy_decode(log_probs.detach(), lengths)
            refs = [t[:n].tolist() for t, n in zip(targets, target_lengths)]
            ler = sum(edit_distance(h, r) for h, r in zip(hyps, refs)) / sum(map(len, refs))
            losses.append(running / done)
            print(f"step {step:5d}  loss {running / done:.4f}  label error rate {ler:6.3f}  "
                  f"frames/s {frames / (time.perf_counter() - t0):9.0f}", flush=True)
            running, frames, t0 = 0.0, 0, time.perf_counter()
    return losses


if __name__ == "__main__":
    train(_parser().parse_args())
