"""Each cell's gate layout and pointwise math: the NumPy reference.

This module and ``cuda_src/cells.cuh`` are the two places where the cell equations are written;
they follow ``torch.nn.RNN/GRU/LSTM`` exactly (LSTM gates i, f, g, o; GRU gates r, z, n with
``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``). ``CELLS`` is the one registry of cells: the
layer modes and nonlinearities, the names and messages of the API, the planner, the demo and the
tests' cell lists all derive from it, and ``CellSpec.kind`` is the cell's ``prnn::CellKind`` in
``cells.cuh`` (tests/test_cells.py holds the two together). Adding a cell means its math here
and in ``cells.cuh``, its entry in ``CELLS`` (its kernel tiles: a family of ``tiles.py``), its
docs and its test (docs/design.md, "How to add a cell").

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
    """``1 / (1 + exp(-x))``, the same operations in place on one new array (a third of the
    allocations: the GEMM path's per-step cost on NumPy)."""
    s = xp.negative(x)
    xp.exp(s, out=s)
    s += 1.0
    return xp.divide(1.0, s, out=s)


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
    pre = gi + gh
    width = pre.shape[-1] // 4
    # i and f in one sigmoid (elementwise: the same values as two; fewer operations per step)
    i_f = _sigmoid(xp, pre[..., :2 * width])
    i, f, g = i_f[..., :width], i_f[..., width:], xp.tanh(pre[..., 2 * width:3 * width])
    o = _sigmoid(xp, pre[..., 3 * width:])
    c = f * c_prev + i * g
    h = o * xp.tanh(c)
    return h, c, xp.concatenate([i_f, g, o], axis=1)


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
    width = gi.shape[-1] // 3
    # r and z in one sigmoid (elementwise: the same values as two; fewer operations per step)
    rz = _sigmoid(xp, gi[..., :2 * width] + gh[..., :2 * width])
    r, z, gh_n = rz[..., :width], rz[..., width:], gh[..., 2 * width:]
    n = xp.tanh(gi[..., 2 * width:] + r * gh_n)
    h = 1.0 - z  # h = (1 - z) * n + z * h_prev, in place
    h *= n
    h += z * h_prev
    return h, None, xp.concatenate([rz, n, gh_n], axis=1)


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

    name: str             # "rnn_tanh", "rnn_relu", "lstm" or "gru"; torch.nn's mode lower-cased
    kind: int             # prnn::CellKind in cuda_src/cells.cuh (enumerator ``name.upper()``)
    gates: int            # G: weight_ih has G*H rows
    saved: int            # S: activations saved per unit for backward
    has_cell_state: bool  # LSTM's c
    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    tiles: str            # its family of kernel tiles in tiles.py ("rnn": both Elman cells)
    label: str = ""                 # how the demo and messages show it ("RNN tanh", "GRU")
    separate_dgh: bool = False      # dgh differs from dgi (GRU: r scales the n gate's W_hh part)
    projection: bool = False        # takes torch.nn's proj_size (LSTM)
    cpu_autocast: bool = True       # torch's CPU autocast casts the layer (torch.nn.GRU: it does not)
    in_torch: bool = True           # torch.nn has it (the drop-in modules and torch comparisons)

    @property
    def mode(self) -> str:
        """torch.nn's mode string ("RNN_TANH", "RNN_RELU", "GRU", "LSTM")."""
        return self.name.upper()


CELLS: dict[str, CellSpec] = {spec.name: spec for spec in (
    CellSpec("rnn_tanh", 0, 1, 0, False, _rnn_tanh_forward, _rnn_tanh_backward, "rnn", "RNN tanh"),
    CellSpec("rnn_relu", 1, 1, 0, False, _rnn_relu_forward, _rnn_relu_backward, "rnn", "RNN relu"),
    CellSpec("lstm", 2, 4, 4, True, _lstm_forward, _lstm_backward, "lstm", "LSTM",
             projection=True),
    CellSpec("gru", 3, 3, 4, False, _gru_forward, _gru_backward, "gru", "GRU", separate_dgh=True,
             cpu_autocast=False),
)}

# The cell that takes torch.nn's proj_size (its kernels: cuda_src/persistent_projection_*.cu).
PROJECTION_CELL: CellSpec = next(spec for spec in CELLS.values() if spec.projection)



def _first_of_each_family() -> tuple[str, ...]:
    first: dict[str, str] = {}
    for spec in CELLS.values():
        first.setdefault(spec.tiles, spec.name)
    return tuple(first.values())


# One cell per family of kernel tiles (``CellSpec.tiles``), the first of each in CELLS: the cells
# whose plans differ (``prnn info``'s table, the benchmarks' default sweeps).
FAMILY_CELLS: tuple[str, ...] = _first_of_each_family()

# The layer modes ("RNN", "GRU", "LSTM") and the RNN's nonlinearities, from the cells' names.
NONLINEARITIES: tuple[str, ...] = tuple(n.partition("_")[2] for n in CELLS if "_" in n)
LAYER_MODES: tuple[str, ...] = tuple(dict.fromkeys(n.partition("_")[0].upper() for n in CELLS))


def _quoted(names) -> str:
    return ", ".join(repr(n) for n in names)


def cell_spec(mode: str, nonlinearity: str = "tanh") -> CellSpec:
    """Return the cell for a layer ``mode`` ("RNN", "GRU", "LSTM") and RNN ``nonlinearity``."""
    mode = mode.upper()
    if mode not in LAYER_MODES:
        raise ValueError(f"mode must be one of {_quoted(LAYER_MODES)}, got {mode!r}")
    if mode.lower() in CELLS:
        return CELLS[mode.lower()]
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(f"nonlinearity must be one of {_quoted(NONLINEARITIES)}, "
                         f"got {nonlinearity!r}")
    return CELLS[f"{mode.lower()}_{nonlinearity}"]


def resolve(cell: "CellSpec | str") -> CellSpec:
    """A ``CellSpec`` from a spec or a name: a key of ``CELLS`` or a layer mode, any case
    ("RNN" is the tanh RNN); ValueError listing the names otherwise."""
    if isinstance(cell, CellSpec):
        return cell
    if not isinstance(cell, str):
        raise TypeError(f"cell must be a str or CellSpec, got {type(cell).__name__}")
    name = cell.lower()
    if name in CELLS:
        return CELLS[name]
    if name.upper() in LAYER_MODES:
        return cell_spec(name)
    raise ValueError(f"cell must be one of {_quoted(LAYER_MODES + tuple(CELLS))}, got {cell!r}")


def from_mode(mode: str) -> CellSpec:
    """The cell of a torch.nn mode string ("RNN_TANH", "RNN_RELU", "GRU", "LSTM")."""
    modes = {spec.mode: spec for spec in CELLS.values()}
    if mode not in modes:
        raise ValueError(f"mode must be one of {tuple(modes)}, got {mode!r}")
    return modes[mode]


def layer_args(name: str) -> tuple[str, dict[str, str]]:
    """The layer ``mode`` and keyword arguments that build cell ``name`` (a key of ``CELLS``):
    ``"rnn_relu"`` -> ``("RNN", {"nonlinearity": "relu"})``, ``"gru"`` -> ``("GRU", {})``.
    The inverse of ``cell_spec``; ``torch.nn`` takes the same ``mode`` names and arguments."""
    if name not in CELLS:
        raise ValueError(f"cell must be one of {', '.join(CELLS)}, got {name!r}")
    mode, _, nonlinearity = name.partition("_")
    return mode.upper(), ({"nonlinearity": nonlinearity} if nonlinearity else {})
