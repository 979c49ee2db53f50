"""persistent_rnn: RNN, GRU and LSTM layers whose recurrence runs in a persistent CUDA kernel.

NumPy arrays run on the CPU, CuPy arrays on the GPU; see ``docs/api.md``.
"""
from .cell_step import GRUCell, LSTMCell, RNNCell
from .layers import GRU, LSTM, RNN
from .latency import StepTime, predict_step_time
from .plan import max_hidden_size
from .settings import Settings, configure, inject_stall, override_settings
from .stats import RunStats

__version__ = "0.1.0"

__all__ = ["GRU", "GRUCell", "LSTM", "LSTMCell", "RNN", "RNNCell", "RunStats", "Settings", "configure", "inject_stall",
           "StepTime", "max_hidden_size", "override_settings", "predict_step_time", "__version__"]
