"""Each cell's gate layout and pointwise math: the NumPy reference.

This module and ``cuda_src/cells.cuh`` are the two places where the cell equations are written;
they follow ``torch.nn.RNN/GRU/LSTM`` exactly (LSTM gates i, f, g, o; GRU gates r, z, n with
``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``).

The functions are array-module generic: they take NumPy or CuPy arrays and use only operators
and ``xp`` functions both provide. Shapes, per batch row and hidden unit ``j``:

* ``gi``, ``gh``: ``(B, G*H)`` input and recurrent pre-activations (``W_ih x + b_ih`` and
  ``W_hh h + b_hh``); gate ``g`` of unit ``j`` is column ``g*H + j``.
* ``saved``: ``(B, S*H)`` activations kept for backward (activation ``s`` of unit ``j`` at
  column ``s*H + j``); for the vanilla RNN ``S == 0`` and the output ``h`` itself is used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Array = Any  # numpy.ndarray or cupy.ndarray


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


def _split(a, parts: int):
    width = a.shape[-1] // parts
    return [a[..., k * width:(k + 1) * width] for k in range(parts)]


def _rnn_tanh_forward(xp, gi, gh, h_prev, c_prev):
    h = xp.tanh(gi + gh)
    return h, None, h[:, :0]


def _rnn_tanh_backward(xp, dh, dc, saved, h, c, h_prev, c_prev):
    dpre = dh * (1.0 - h * h)
    return dpre, dpre, xp.zeros_like(dh), None


def _rnn_relu_forward(xp, gi, gh, h_prev, c_prev):
    h = xp.maximum(gi + gh, 0.0)
    return h, None, h[:, :0]


def _rnn_relu_backward(xp, dh, dc, saved, h, c, h_prev, c_prev):
    dpre = dh * (h > 0)
    return dpre, dpre, xp.zeros_like(dh), None


def _lstm_forward(xp, gi, gh, h_prev, c_prev):
    pi, pf, pg, po = _split(gi + gh, 4)
    i, f, g, o = _sigmoid(xp, pi), _sigmoid(xp, pf), xp.tanh(pg), _sigmoid(xp, po)
    c = f * c_prev + i * g
    h = o * xp.tanh(c)
    return h, c, xp.concatenate([i, f, g, o], axis=1)


def _lstm_backward(xp, dh, dc, saved, h, c, h_prev, c_prev):
    i, f, g, o = _split(saved, 4)
    tc = xp.tanh(c)
    dct = dc + dh * o * (1.0 - tc * tc)
    dpre = xp.concatenate([dct * g * i * (1.0 - i),
                           dct * c_prev * f * (1.0 - f),
                           dct * i * (1.0 - g * g),
                           dh * tc * o * (1.0 - o)], axis=1)
    return dpre, dpre, xp.zeros_like(dh), dct * f


def _gru_forward(xp, gi, gh, h_prev, c_prev):
    gi_r, gi_z, gi_n = _split(gi, 3)
    gh_r, gh_z, gh_n = _split(gh, 3)
    r = _sigmoid(xp, gi_r + gh_r)
    z = _sigmoid(xp, gi_z + gh_z)
    n = xp.tanh(gi_n + r * gh_n)
    h = (1.0 - z) * n + z * h_prev
    return h, None, xp.concatenate([r, z, n, gh_n], axis=1)


def _gru_backward(xp, dh, dc, saved, h, c, h_prev, c_prev):
    r, z, n, gh_n = _split(saved, 4)
    dn = dh * (1.0 - z) * (1.0 - n * n)
    dz = dh * (h_prev - n) * z * (1.0 - z)
    dr = dn * gh_n * r * (1.0 - r)
    dgi = xp.concatenate([dr, dz, dn], axis=1)
    dgh = xp.concatenate([dr, dz, dn * r], axis=1)
    return dgi, dgh, dh * z, None


@dataclass(frozen=True)
class CellSpec:
    """A recurrent cell: its gate layout and its pointwise forward and backward.

    ``forward(xp, gi, gh, h_prev, c_prev) -> (h, c, saved)`` and
    ``backward(xp, dh, dc, saved, h, c, h_prev, c_prev) -> (dgi, dgh, dh_prev_direct, dc_prev)``,
    where ``c``/``dc``/``c_prev``/``dc_prev`` are ``None`` for cells without a cell state and
    ``dh_prev_direct`` excludes the part through ``W_hh`` (added by the caller).
    """

    name: str             # "rnn_tanh", "rnn_relu", "lstm" or "gru"
    kind: int             # prnn::CellKind in cuda_src/cells.cuh
    gates: int            # G: weight_ih has G*H rows
    saved: int            # S: activations saved per unit for backward
    has_cell_state: bool  # LSTM's c
    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    cpu_autocast: bool = True  # torch's CPU autocast casts this layer (torch.nn.GRU: it does not)


CELLS: dict[str, CellSpec] = {
    "rnn_tanh": CellSpec("rnn_tanh", 0, 1, 0, False, _rnn_tanh_forward, _rnn_tanh_backward),
    "rnn_relu": CellSpec("rnn_relu", 1, 1, 0, False, _rnn_relu_forward, _rnn_relu_backward),
    "lstm": CellSpec("lstm", 2, 4, 4, True, _lstm_forward, _lstm_backward),
    "gru": CellSpec("gru", 3, 3, 4, False, _gru_forward, _gru_backward, cpu_autocast=False),
}


def cell_spec(mode: str, nonlinearity: str = "tanh") -> CellSpec:
    """Return the cell for a layer ``mode`` ("RNN", "GRU", "LSTM") and RNN ``nonlinearity``."""
    mode = mode.upper()
    if mode == "RNN":
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        return CELLS["rnn_" + nonlinearity]
    if mode in ("GRU", "LSTM"):
        return CELLS[mode.lower()]
    raise ValueError(f"mode must be 'RNN', 'GRU' or 'LSTM', got {mode!r}")


def layer_args(name: str) -> tuple[str, dict[str, str]]:
    """The layer ``mode`` and keyword arguments that build cell ``name`` (a key of ``CELLS``):
    ``"rnn_relu"`` -> ``("RNN", {"nonlinearity": "relu"})``, ``"gru"`` -> ``("GRU", {})``.
    The inverse of ``cell_spec``; ``torch.nn`` takes the same ``mode`` names and arguments."""
    if name not in CELLS:
        raise ValueError(f"cell must be one of {', '.join(CELLS)}, got {name!r}")
    mode, _, nonlinearity = name.partition("_")
    return mode.upper(), ({"nonlinearity": nonlinearity} if nonlinearity else {})
