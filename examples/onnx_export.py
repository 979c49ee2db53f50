"""Export a persistent_rnn LSTM tagger to ONNX and run it in onnxruntime.

    python examples/onnx_export.py [tagger.onnx]    (needs torch, onnx, onnxscript, onnxruntime)

The model is exported once, with a dynamic time and batch axis, and run on a batch of another
size and length; the ONNX graph holds ONNX's own LSTM nodes (no custom operator).
"""
import sys

import numpy as np
import onnxruntime
import torch

import persistent_rnn.torch as prt
from persistent_rnn.torch.onnx import padded_forward


class Tagger(torch.nn.Module):
    """A 2-layer bidirectional LSTM over padded sequences with per-step scores."""

    def __init__(self, features: int = 20, hidden: int = 64, tags: int = 5) -> None:
        super().__init__()
        self.rnn = prt.LSTM(features, hidden, num_layers=2, bidirectional=True,
                            batch_first=True)
        self.out = torch.nn.Linear(2 * hidden, tags)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        y, _ = padded_forward(self.rnn, x, lengths)  # packed-sequence semantics
        return self.out(y)


def main() -> None:
    model = Tagger().eval()
    x, lengths = torch.randn(2, 9, 20), torch.tensor([9, 4])
    batch, steps = torch.export.Dim("batch"), torch.export.Dim("steps")
    program = torch.onnx.export(model, (x, lengths), dynamo=True, verbose=False,
                                dynamic_shapes=({0: batch, 1: steps}, {0: batch}))
    path = sys.argv[1] if len(sys.argv) > 1 else "tagger.onnx"
    program.save(path)
    print("ONNX nodes:", sorted({node.op_type for node in program.model.graph}))

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    x, lengths = torch.randn(5, 30, 20), torch.tensor([30, 7, 22, 1, 15])
    (scores,) = session.run(None, {"x": x.numpy(), "lengths": lengths.numpy()})
    with torch.no_grad():
        expected = model(x, lengths).numpy()
    print(f"onnxruntime on batch 5 x 30 steps: scores {scores.shape}, "
          f"max |onnxruntime - torch| = {np.abs(scores - expected).max():.1e}")


if __name__ == "__main__":
    main()
