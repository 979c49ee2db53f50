"""RNN-T greedy decoding: a prediction LSTM stepped one token at a time, written twice.

An RNN-T decoder walks the encoder's frames; at each frame the joint network scores the
vocabulary from the frame and the prediction network's output, and the argmax is either blank
(next frame) or a token that is fed back into the prediction network (at most
``--max-symbols`` per frame). The prediction network's next input depends on its last output,
so it advances one step per call: the case the resident decoder is for.

* ``torch.nn``: ``torch.nn.LSTMCell`` called per token;
* ``decoder``: ``persistent_rnn.torch.LSTMCell(...).decoder(batch=1)``, the same weights: the
  LSTM's W_hh stays in registers of a resident kernel between the calls (on the CPU with
  ``algo="persistent"``: its CPU emulation, slow and only a check).

Both are run on the same encoder output; the script prints both token sequences and whether
they agree (the models are untrained: random weights, random "encoder" frames).

    python examples/rnnt_greedy.py --device cuda --hidden 640 --frames 200
    python examples/rnnt_greedy.py --device cpu --hidden 16 --frames 6     # the emulation
"""
from __future__ import annotations

import argparse
import time

import torch

import persistent_rnn.torch as prt

BLANK = 0


class Model(torch.nn.Module):
    """Embedding, prediction LSTM cell, joint network (untrained)."""

    def __init__(self, vocab: int, embed: int, hidden: int, encoder: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.prediction = prt.LSTMCell(embed, hidden, algo="persistent")
        self.joint_enc = torch.nn.Linear(encoder, hidden)
        self.joint_pred = torch.nn.Linear(hidden, hidden, bias=False)
        self.joint_out = torch.nn.Linear(hidden, vocab)

    def joint(self, frame: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        return self.joint_out(torch.tanh(self.joint_enc(frame) + self.joint_pred(pred)))


def greedy(model: Model, frames: torch.Tensor, step, max_symbols: int) -> list[int]:
    """Tokens of greedy RNN-T decoding of ``frames`` (T, encoder) with ``step(x, (h, c)) -> (h,
    c)`` as the prediction network (batch 1)."""
    tokens: list[int] = []
    start = model.embed(torch.tensor([BLANK], device=frames.device))
    state = step(start, None)
    for frame in frames:
        for _ in range(max_symbols):
            label = int(model.joint(frame[None], state[0]).argmax(dim=-1))
            if label == BLANK:
                break
            tokens.append(label)
            state = step(model.embed(torch.tensor([label], device=frames.device)), state)
    return tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--embed", type=int, default=None, help="embedding size (default: hidden)")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--encoder", type=int, default=64)
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--max-symbols", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    model = Model(args.vocab, args.embed or args.hidden, args.hidden, args.encoder).to(args.device)
    frames = torch.randn(args.frames, args.encoder, device=args.device)
    reference = torch.nn.LSTMCell(model.prediction.input_size, args.hidden).to(args.device)
    reference.load_state_dict(model.prediction.state_dict())
    results = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        results["torch.nn"] = greedy(model, frames, reference, args.max_symbols)
        t1 = time.perf_counter()
        with model.prediction.decoder(batch=1) as dec:
            t2 = time.perf_counter()
            results["decoder"] = greedy(model, frames, dec.step, args.max_symbols)
            t3 = time.perf_counter()
            how = "resident" if dec.resident else f"not resident: {dec.reason}"
    for name, secs in (("torch.nn", t1 - t0), ("decoder", t3 - t2)):
        print(f"{name:9} {len(results[name])} tokens in {secs * 1e3:.1f} ms: {results[name]}")
    same = results["torch.nn"] == results["decoder"]
    print(f"decoder ({how}): {'the same tokens' if same else 'DIFFERENT tokens'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
