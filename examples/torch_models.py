"""Three recurrent models written for torch.nn, runnable unchanged with persistent_rnn.torch.

Each model takes the module namespace that provides ``GRU``/``LSTM`` (``torch.nn`` or
``persistent_rnn.torch``) and extra keyword arguments for those layers (e.g. ``algo="gemm"``);
everything else is plain torch.nn, with dropout and projections where their recipes set them.

* ``SpeechCTC``: DeepSpeech2-like. A 2-D convolutional front end over (frequency, time) frames
  (time stride 2), 3 bidirectional GRU layers (dropout 0.1) over a PackedSequence, a linear
  read-out and CTC.
* ``WordLM``: a 2-layer LSTM language model (dropout 0.2) with tied input and output embeddings,
  trained by truncated back-propagation through time: the state carries over between windows,
  detached.
* ``StepDecoder``: an LSTM decoder (2 layers, projections, dropout 0.1) called one step at a time
  with teacher forcing, as attention and transducer decoders call it.

``MODELS`` maps each name to a ``Workload``: how to build the model, make one batch of synthetic
data and run one training step. bench/torch_models.py times the steps; tests/test_torch_models.py
checks that both namespaces give the same losses.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class SpeechCTC(nn.Module):
    """Conv front end -> 3 bidirectional GRU layers over packed frames -> CTC log-probabilities."""

    def __init__(self, rnn: ModuleType, features: int = 40, channels: int = 32,
                 hidden: int = 256, labels: int = 29, dropout: float = 0.1, **rnn_kwargs) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=(11, 11), stride=(2, 2), padding=(5, 5)),
            nn.BatchNorm2d(channels), nn.Hardtanh(0, 20, inplace=True))
        self.rnn = rnn.GRU(channels * ((features + 1) // 2), hidden, num_layers=3,
                           bidirectional=True, dropout=dropout, **rnn_kwargs)
        self.head = nn.Linear(2 * hidden, labels + 1)

    def forward(self, frames: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``frames`` (B, F, T), ``lengths`` (B,) -> log-probabilities (T', B, labels + 1)."""
        x = self.conv(frames.unsqueeze(1))                    # (B, C, F', T')
        x = x.flatten(1, 2).permute(2, 0, 1).contiguous()     # (T', B, C*F')
        lengths = (lengths + 1) // 2
        y, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        y, _ = pad_packed_sequence(y, total_length=x.shape[0])
        return self.head(y).log_softmax(-1)


class WordLM(nn.Module):
    """Embedding -> 2-layer LSTM -> linear read-out sharing the embedding's weight."""

    def __init__(self, rnn: ModuleType, vocab: int = 2000, hidden: int = 256,
                 dropout: float = 0.2, **rnn_kwargs) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = rnn.LSTM(hidden, hidden, num_layers=2, dropout=dropout, **rnn_kwargs)
        self.head = nn.Linear(hidden, vocab)
        self.head.weight = self.embed.weight  # tied embeddings

    def forward(self, tokens: torch.Tensor, state):
        """``tokens`` (T, B) -> logits (T, B, vocab) and the final ``(h, c)``."""
        y, state = self.rnn(self.drop(self.embed(tokens)), state)
        return self.head(self.drop(y)), state


class StepDecoder(nn.Module):
    """An LSTM decoder with projections, advanced one token at a time."""

    def __init__(self, rnn: ModuleType, vocab: int = 500, embed: int = 128, hidden: int = 256,
                 proj: int = 128, dropout: float = 0.1, **rnn_kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = rnn.LSTM(embed, hidden, num_layers=2, proj_size=proj, dropout=dropout,
                            **rnn_kwargs)
        self.head = nn.Linear(proj or hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (T, B): logits (T, B, vocab), each step fed the previous (teacher forcing)."""
        state, logits = None, []
        for t in range(tokens.shape[0]):
            y, state = self.rnn(self.embed(tokens[t:t + 1]), state)
            logits.append(self.head(y))
        return torch.cat(logits)


@dataclass(frozen=True)
class Workload:
    """How to build one model, draw one batch and run one training step on it."""

    build: Callable[[ModuleType, dict, dict], nn.Module]   # (rnn namespace, sizes, layer kwargs)
    batch: Callable[[torch.Generator, dict], tuple]        # (generator, sizes) -> synthetic data
    step: Callable[[nn.Module, tuple, dict], torch.Tensor]  # (model, data, carry) -> loss
    sizes: dict[str, dict[str, int]]                       # "full" (benchmark), "small" (tests)


def _speech_build(rnn: ModuleType, s: dict, kw: dict) -> nn.Module:
    return SpeechCTC(rnn, s["features"], s["channels"], s["hidden"], s["labels"], **kw)


def _speech_batch(gen: torch.Generator, s: dict) -> tuple:
    batch, frames = s["batch"], s["frames"]
    lengths = torch.randint(frames // 2, frames + 1, (batch,), generator=gen)
    lengths[0] = frames
    x = torch.randn(batch, s["features"], frames, generator=gen)
    x = x * (torch.arange(frames)[None, None, :] < lengths[:, None, None])
    target_lengths = torch.randint(2, frames // 8, (batch,), generator=gen)
    targets = torch.randint(1, s["labels"] + 1, (batch, int(target_lengths.max())), generator=gen)
    return x, lengths, targets, target_lengths


def _speech_step(model: nn.Module, data: tuple, _carry: dict) -> torch.Tensor:
    x, lengths, targets, target_lengths = data
    log_probs = model(x, lengths)
    loss = nn.functional.ctc_loss(log_probs, targets, (lengths + 1) // 2, target_lengths,
                                  zero_infinity=True)
    loss.backward()
    return loss


def _lm_build(rnn: ModuleType, s: dict, kw: dict) -> nn.Module:
    return WordLM(rnn, s["vocab"], s["hidden"], **kw)


def _tokens(gen: torch.Generator, s: dict) -> tuple:
    return (torch.randint(0, s["vocab"], (s["steps"] + 1, s["batch"]), generator=gen),)


def _lm_step(model: nn.Module, data: tuple, carry: dict) -> torch.Tensor:
    (tokens,) = data
    state = carry.get("state")
    if state is not None:
        state = tuple(h.detach() for h in state)  # truncated BPTT
    logits, carry["state"] = model(tokens[:-1], state)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[1:].flatten())
    loss.backward()
    return loss


def _decoder_build(rnn: ModuleType, s: dict, kw: dict) -> nn.Module:
    return StepDecoder(rnn, s["vocab"], s["embed"], s["hidden"], s["proj"], **kw)


def _decoder_step(model: nn.Module, data: tuple, _carry: dict) -> torch.Tensor:
    (tokens,) = data
    logits = model(tokens[:-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[1:].flatten())
    loss.backward()
    return loss


MODELS: dict[str, Workload] = {
    "speech_ctc": Workload(_speech_build, _speech_batch, _speech_step, {
        "full": dict(batch=8, features=40, frames=200, channels=32, hidden=256, labels=29),
        "small": dict(batch=3, features=6, frames=24, channels=2, hidden=5, labels=4)}),
    "word_lm": Workload(_lm_build, _tokens, _lm_step, {
        "full": dict(batch=20, steps=35, vocab=2000, hidden=256),
        "small": dict(batch=3, steps=6, vocab=11, hidden=5)}),
    "step_decoder": Workload(_decoder_build, _tokens, _decoder_step, {
        "full": dict(batch=8, steps=20, vocab=500, embed=128, hidden=256, proj=128),
        "small": dict(batch=3, steps=5, vocab=11, embed=4, hidden=5, proj=3)}),
}


def train(name: str, rnn: ModuleType, steps: int, size: str = "full", seed: int = 0,
          lr: float = 0.1, layer_kwargs: dict[str, Any] | None = None,
          dtype: torch.dtype = torch.float32, compile: bool = False,
          on_step: Callable[[int], None] | None = None) -> list[float]:
    """Train model ``name`` built from ``rnn`` for ``steps`` SGD steps on fresh synthetic
    batches; return the losses. The same ``seed`` gives the same weights, data and (on the CPU)
    dropout masks with either namespace. ``compile`` runs the model through ``torch.compile``;
    ``on_step(i)`` is called after step ``i``."""
    work = MODELS[name]
    sizes = work.sizes[size]
    torch.manual_seed(seed)
    model = work.build(rnn, sizes, layer_kwargs or {}).to(dtype)
    run = torch.compile(model) if compile else model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    carry: dict = {}
    losses = []
    for i in range(steps):
        data = tuple(t.to(dtype) if t.is_floating_point() else t for t in work.batch(gen, sizes))
        opt.zero_grad(set_to_none=True)
        losses.append(work.step(run, data, carry).item())
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if on_step is not None:
            on_step(i)
    return losses
