"""Drop-in ``torch.nn.RNN``, ``GRU``, ``LSTM`` modules and ``RNNCell``, ``GRUCell``, ``LSTMCell``
cells backed by persistent_rnn.

    from persistent_rnn.torch import LSTM   # instead of torch.nn.LSTM
    lstm = LSTM(input_size, hidden_size, num_layers=2, batch_first=True)

CUDA float32, float16 and bfloat16 layers that fit run the persistent kernel (a ``torch.library``
custom op, ``torch.ops.persistent_rnn.recurrence``); everything else runs torch's own kernels for
the layer (CPU tensors under torch.compile: the library's GEMM path). ``module.last_run`` says
which and why. The cells run one step through the library
(``torch.ops.persistent_rnn.cell_step``: the fused step kernel on CUDA float32 tensors) and
torch's own cell elsewhere. See docs/torch.md.
"""
import torch

from .cells import GRUCell, LSTMCell, RNNCell
from .modules import GRU, LSTM, RNN
from .ops import LastRun

# Whole-model checkpoints load with torch.load(f, weights_only=True) (torch's default).
torch.serialization.add_safe_globals([RNN, GRU, LSTM, RNNCell, GRUCell, LSTMCell])

__all__ = ["RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell", "LastRun"]
