"""Drop-in ``torch.nn.RNN``, ``GRU`` and ``LSTM`` modules backed by persistent_rnn.

    from persistent_rnn.torch import LSTM   # instead of torch.nn.LSTM
    lstm = LSTM(input_size, hidden_size, num_layers=2, batch_first=True)

CPU tensors run on the library's NumPy path and CUDA tensors on its CuPy path (persistent kernel
where it fits), exchanged through DLPack without copies. See docs/torch.md.
"""
from .modules import GRU, LSTM, RNN

__all__ = ["RNN", "GRU", "LSTM"]
