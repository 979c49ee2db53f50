"""One step of a cell: ``RNNCell``, ``GRUCell`` and ``LSTMCell`` of the NumPy/CuPy layer API.

A decoder that feeds each output back as the next input advances one step per call, which the
whole-sequence layers cannot do. A step here is ``torch.nn``'s cell: ``h' = cell(W_ih x + b_ih,
W_hh h + b_hh, h, c)`` with the cell's math from ``cells.py`` (NumPy/CuPy reference) or
``cuda_src/cells.cuh`` (the kernels), never written again here. Two ways to run it:

* ``"gemm"``: two matrix products with the array module (cuBLAS on the GPU) and ``cells.py``'s
  pointwise forward;
* ``"persistent"``: the fused step kernel ``cuda_src/fused_step.cu`` — both products and the
  cell in one launch, fp32 accumulation, weights read from L2/HBM — on the GPU for CuPy arrays
  and in the CPU emulation for NumPy arrays (a test path). float32 only, as the kernels.

``"auto"`` runs the fused kernel for CuPy float32 and ``"gemm"`` otherwise. The backward of a
step is the same for both (the cell's ``cells.py`` backward and three matrix products), from the
activations the forward saved.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping

import numpy as np

from . import validation
from .buffers import array_module
from .cells import CellSpec, cell_spec
from .matmul import matmul
from .stats import RunStats
from .validation import CallOrderError

Array = Any

_WARPS_PER_BLOCK = 4  # fused kernel: one warp per (batch tile, j)
BATCH_TILE = 4  # batch rows per warp of the fused kernel (-D PRNN_BATCH_TILE of fused_step.cu)
FUSED_SOURCE = "fused_step.cu"
FUSED_KERNEL = "prnn_fused_step_f32"
STEP_ALGOS = validation.ALGOS


@dataclass
class StepContext:
    """What a step's backward needs: its inputs, outputs and saved activations."""

    cell: CellSpec
    x: Array
    h_prev: Array
    c_prev: Array | None
    h: Array
    c: Array | None
    saved: Array


def param_names(bias: bool) -> list[str]:
    """torch.nn's parameter names of a cell, in its order."""
    return ["weight_ih", "weight_hh", *(["bias_ih", "bias_hh"] if bias else [])]


def step_algo(algo: str, xp, dtype: np.dtype) -> str:
    """The concrete algorithm of a step: ``"gemm"`` or ``"persistent"`` (the fused kernel);
    ValueError where ``algo="persistent"`` cannot run ``dtype``."""
    if algo == "auto":
        return "persistent" if xp is not np and dtype == np.float32 else "gemm"
    if algo == "persistent" and dtype != np.float32:
        raise ValueError(f"algo='persistent' cannot run this cell: dtype is {dtype.name} (the fused "
                         f"step kernel computes float32); use algo='gemm'")
    return algo


def step_forward(cell: CellSpec, params: Mapping[str, Array], x: Array, h: Array,
                 c: Array | None, algo: str) -> tuple[Array, Array | None, StepContext, RunStats]:
    """One step on ``x`` (B, I), ``h`` (B, H) and, for LSTM, ``c`` (B, H) (all of one dtype and
    array module; ``algo`` concrete, see ``step_algo``): ``(h', c', context, stats)``."""
    xp = array_module(x)
    if algo == "persistent":
        h_new, c_new, saved = fused_step(cell, params, x, h, c)
        stats = RunStats(algo="persistent", emulated=xp is np, launches=1)
    else:
        gi, gh = _affine(x, params, "ih"), _affine(h, params, "hh")
        h_new, c_new, saved = cell.forward(xp, gi, gh, h, c)
        stats = RunStats(algo="gemm")
    return h_new, c_new, StepContext(cell, x, h, c, h_new, c_new, saved), stats


def _affine(a: Array, params: Mapping[str, Array], kind: str) -> Array:
    out = matmul(a, params[f"weight_{kind}"].T)
    bias = params.get(f"bias_{kind}")
    return out if bias is None else out + bias


def step_backward(ctx: StepContext, params: Mapping[str, Array], dh: Array,
                  dc: Array | None) -> tuple[Array, Array, Array | None, dict[str, Array]]:
    """Gradients of a step from the gradients ``dh`` (and ``dc``) of its outputs:
    ``(dx, dh_prev, dc_prev, grads)`` with ``grads`` keyed like ``params``."""
    xp = array_module(dh)
    if ctx.cell.has_cell_state and dc is None:
        dc = xp.zeros_like(ctx.c)
    dgi, dgh, dh_direct, dc_prev = ctx.cell.backward(xp, dh, dc, ctx.saved, ctx.h, ctx.c,
                                                     ctx.h_prev, ctx.c_prev)
    grads = {"weight_ih": matmul(dgi.T, ctx.x), "weight_hh": matmul(dgh.T, ctx.h_prev)}
    if "bias_ih" in params:
        grads["bias_ih"], grads["bias_hh"] = dgi.sum(axis=0), dgh.sum(axis=0)
    dx = matmul(dgi, params["weight_ih"])
    dh_prev = matmul(dgh, params["weight_hh"]) + dh_direct
    return dx, dh_prev, dc_prev, grads


def fused_launcher(xp, cell: CellSpec) -> Callable[[int, tuple], None]:
    """The fused step kernel of ``cell`` as a call of its grid and arguments: on a GPU (CuPy,
    the current device's build) CuPy's kernel function itself, so that a step runs none of the
    launcher's Python (``kernels.GpuModule.launch``, ``function``, whose shared-memory check
    queries the kernel's attribute from the driver); in the CPU emulation (NumPy) its module's
    launch."""
    return _fused_launcher(xp, cell.kind, None if xp is np else xp.cuda.Device().id)


@lru_cache(maxsize=None)
def _fused_launcher(xp, kind: int, device: int | None) -> Callable[[int, tuple], None]:
    """``fused_launcher``, made once per (array module, cell kind, device): a step then runs
    none of the build cache's Python (the defines' key, the device's architecture)."""
    defines = {"PRNN_CELL": kind, "PRNN_BATCH_TILE": BATCH_TILE}
    block = 32 * _WARPS_PER_BLOCK
    if xp is np:
        from . import emulate
        module = emulate.get_module(FUSED_SOURCE, defines)
        return lambda grid, args: module.launch(FUSED_KERNEL, grid, block, 0, args)
    from . import kernels
    kernel = kernels.get_module(FUSED_SOURCE, defines).function(FUSED_KERNEL)
    return lambda grid, args: kernel((grid,), (block,), args)


def fused_grid(batch: int, hidden: int) -> int:
    """CTAs of ``_WARPS_PER_BLOCK`` warps a fused step launches: a warp per (tile of
    ``BATCH_TILE`` batch rows, unit j)."""
    return -(-(-(-batch // BATCH_TILE)) * hidden // _WARPS_PER_BLOCK)


def fused_step(cell: CellSpec, params: Mapping[str, Array], x: Array, h: Array,
               c: Array | None, out: tuple | None = None) -> tuple[Array, Array | None, Array]:
    """``(h', c', saved)`` from one launch of the fused step kernel: float32 arrays of one module
    (CuPy: the GPU; NumPy: the emulation), ``saved`` (B, S*H) as ``cells.py`` lays it out.

    ``out``: ``(h', c', saved)`` buffers to write (``c'`` ``None`` unless LSTM); with contiguous
    inputs the call then allocates nothing and never synchronises, so a CuPy step can be
    captured in a CUDA graph and replayed."""
    xp = array_module(x)
    batch, hidden = h.shape
    if out is None:  # (the array module's own constructor: no Python of ``empty``'s)
        out = (xp.ndarray(h.shape, np.float32),
               xp.ndarray(h.shape, np.float32) if cell.has_cell_state else None,
               xp.ndarray((batch, cell.saved * hidden), np.float32))
    h_new, c_new, saved = out
    has_bias = "bias_ih" in params
    # (placeholders: valid buffers the cell never touches; ascontiguousarray - Python in CuPy -
    # only where an operand is not C-contiguous, in a loop: no generator's frames)
    operands = [x, h, h if c is None else c, params["weight_ih"], params["weight_hh"],
                params["bias_ih" if has_bias else "weight_ih"],
                params["bias_hh" if has_bias else "weight_hh"]]
    for i, a in enumerate(operands):
        if not a.flags.c_contiguous:
            operands[i] = xp.ascontiguousarray(a)
    sizes, bias_flag, grid = _launch_constants(batch, x.shape[1], hidden, has_bias)
    args = (*sizes, *operands, bias_flag, h_new, h_new if c_new is None else c_new,
            saved if saved.size else h_new)
    if grid:  # an empty batch launches nothing
        fused_launcher(xp, cell)(grid, args)
    return h_new, c_new, saved


@lru_cache(maxsize=256)
def _launch_constants(batch: int, inputs: int, hidden: int, has_bias: bool) -> tuple:
    """A fused step's arguments that only its shape decides - the sizes, the bias flag (NumPy
    scalars: each made afresh cost more than this look-up) - and its grid, made once a shape."""
    return ((np.int32(batch), np.int32(inputs), np.int32(hidden)), np.int32(has_bias),
            fused_grid(batch, hidden))


class _Cell:
    """One cell, one step per ``forward``; see ``RNNCell``, ``GRUCell`` and ``LSTMCell``."""

    mode = ""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 dtype: Any = "float32", algo: str = "auto", seed: int | None = None,
                 nonlinearity: str = "tanh"):
        self.input_size = validation.positive_int("input_size", input_size)
        self.hidden_size = validation.positive_int("hidden_size", hidden_size)
        self.cell: CellSpec = cell_spec(self.mode, nonlinearity)
        self.bias = bool(bias)
        self.dtype = validation.float_dtype("dtype", dtype)
        if self.dtype.name in validation.HALF_DTYPES:
            raise ValueError(f"dtype={self.dtype.name!r}: the cells run float32 and float64")
        self.algo = validation.choice("algo", algo, STEP_ALGOS)
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(self.hidden_size)  # torch.nn's initialisation
        self.params = {k: rng.uniform(-bound, bound, size=s).astype(self.dtype)
                       for k, s in self.param_shapes().items()}
        self.grads = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.last_run: RunStats | None = None
        self._ctx: StepContext | None = None
        self._unbatched = False

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.input_size}, {self.hidden_size}, bias={self.bias}, "
                f"dtype={self.dtype.name!r}, algo={self.algo!r})")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names (``torch.nn``'s cell's, in its order) and shapes."""
        rows = self.cell.gates * self.hidden_size
        shapes = {"weight_ih": (rows, self.input_size), "weight_hh": (rows, self.hidden_size)}
        return shapes | ({"bias_ih": (rows,), "bias_hh": (rows,)} if self.bias else {})

    def load_params(self, mapping: Mapping[str, Any]) -> None:
        """Replace every parameter from ``mapping`` (e.g. a torch cell's state_dict as NumPy),
        copied in the cell's dtype onto the parameters' device."""
        validation.params_mapping(mapping, self.param_shapes())
        xp = array_module(self.params["weight_ih"])
        self.params = {k: validation.param_array(xp, k, mapping[k], self.dtype)
                       for k in self.params}

    def zero_grad(self) -> None:
        """Set every gradient to zero."""
        for g in self.grads.values():
            g[...] = 0

    def decoder(self, batch: int):
        """A resident decoder of this cell for ``batch`` rows: single steps with W_hh held in
        registers between them (``persistent_rnn.decoder``; docs/api.md); the weights are
        those of this call. A context manager."""
        from .decoder import Decoder
        return Decoder(self.cell, [self.params], batch, self.input_size, self.hidden_size,
                       stacked=False, fallback=step_forward, algo=self.algo)

    def forward(self, x: Array, hx: Any = None) -> Any:
        """One step: ``x`` (B, input_size) or unbatched (input_size,); ``hx`` ``None`` (zeros),
        h (B, H) (unbatched (H,)) or, for LSTM, ``(h, c)``. Returns h' (LSTM: ``(h', c')``),
        shaped like ``hx``."""
        steady = self._steady(x, hx)
        x, h, c, xp = self._checked(x, hx) if steady is None else steady
        algo = step_algo(self.algo, xp, self.dtype)
        h_new, c_new, self._ctx, self.last_run = step_forward(self.cell, self.params, x, h, c,
                                                              algo)
        return self._shaped(h_new, c_new)

    def _steady(self, x: Array, hx: Any) -> tuple | None:
        """``(x, h, c, xp)`` where a step's arrays are what a decoding loop passes: ``x``
        (B, input_size) and ``hx`` h (B, H) or, for LSTM, an ``(h, c)`` tuple, each an array of
        the parameters' type (so of their module) and of the cell's dtype - what every check of
        ``_checked`` passes, accepted by identity and shape checks; ``None`` for anything else
        (``_checked`` then raises or makes it so)."""
        kind, dtype = type(self.params["weight_ih"]), self.dtype
        if type(x) is not kind or x.dtype != dtype or x.ndim != 2 or x.shape[1] != self.input_size:
            return None
        shape = (x.shape[0], self.hidden_size)
        h, c = hx, None
        if self.cell.has_cell_state:
            if type(hx) is not tuple or len(hx) != 2:
                return None
            h, c = hx
            if type(c) is not kind or c.dtype != dtype or c.shape != shape:
                return None
        if type(h) is not kind or h.dtype != dtype or h.shape != shape:
            return None
        self._unbatched = False
        return x, h, c, array_module(x)

    def _checked(self, x: Array, hx: Any) -> tuple:
        """``(x, h, c, xp)`` of ``forward``'s arguments, checked (the errors documented for
        them), ``x`` and the state batched, the state's zeros where ``hx`` is None, the
        parameters moved onto ``xp``'s device."""
        if x is None:
            raise TypeError("x must be a numpy.ndarray or cupy.ndarray, got None")
        h, c = validation.state("hx", hx, self.cell.has_cell_state)
        xp = validation.common_module(x=x, hx=h, **({"hx[1]": c} if c is not None else {}))
        if x.ndim not in (1, 2):
            raise ValueError(f"x must be (B, input_size) or (input_size,), got shape {x.shape}")
        self._unbatched = x.ndim == 1
        x = x[None] if self._unbatched else x
        validation.array("x", x, (None, self.input_size), "(B, input_size)", self.dtype)
        h, c = (self._state(xp, name, a, x.shape[0]) for name, a in
                (("hx[0]" if self.cell.has_cell_state else "hx", h), ("hx[1]", c)))
        self._to_device(xp)
        return x, h, c if self.cell.has_cell_state else None, xp

    def backward(self, dh: Array, dc: Array | None = None) -> tuple[Array, Any]:
        """Backward of the last ``forward`` from ``dh`` (like h') and, for LSTM, ``dc`` (like
        c'; ``None``: zero). Adds the parameter gradients into ``grads``; returns
        ``(dx, dhx)``, dhx like ``hx`` (LSTM: ``(dh, dc)``). Once per forward."""
        if self._ctx is None:
            raise CallOrderError("backward needs a preceding forward (and runs once per forward); "
                                 "call forward first")
        ctx, self._ctx = self._ctx, None
        shape = ctx.h.shape[1:] if self._unbatched else ctx.h.shape
        for name, a in (("dh", dh), ("dc", dc)):
            if a is not None:
                validation.array(name, a, shape, "like the forward's h", self.dtype)
        lift = (lambda a: a[None]) if self._unbatched else (lambda a: a)
        dx, dh_prev, dc_prev, grads = step_backward(ctx, self.params, lift(dh),
                                                    None if dc is None else lift(dc))
        for key, g in grads.items():
            self.grads[key] += g
        self.last_run = RunStats(algo="gemm")
        return self._squeezed(dx), self._shaped(dh_prev, dc_prev)

    def _state(self, xp, name: str, a: Array | None, batch: int) -> Array | None:
        if name == "hx[1]" and not self.cell.has_cell_state:
            return None
        if a is None:
            return xp.zeros((batch, self.hidden_size), dtype=self.dtype)
        a = a[None] if self._unbatched and a.ndim == 1 else a
        dims = "(hidden_size,)" if self._unbatched else "(B, hidden_size)"
        validation.array(name, a, (batch, self.hidden_size), dims, self.dtype)
        return a

    def _squeezed(self, a: Array) -> Array:
        return a[0] if self._unbatched else a

    def _shaped(self, h: Array, c: Array | None) -> Any:
        h = self._squeezed(h)
        return (h, self._squeezed(c)) if self.cell.has_cell_state else h

    def _to_device(self, xp) -> None:
        """Move parameters and gradients to ``xp``'s device if they are elsewhere (once)."""
        if array_module(self.params["weight_ih"]) is xp:
            return
        move = xp.asarray if xp is not np else (lambda a: a.get())
        self.params = {k: move(v) for k, v in self.params.items()}
        self.grads = {k: move(v) for k, v in self.grads.items()}


class RNNCell(_Cell):
    """``torch.nn.RNNCell``: ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``, act ``tanh`` or
    ``relu``. ``RNNCell(input_size, hidden_size, bias=True, nonlinearity="tanh",
    dtype="float32", algo="auto", seed=None)``."""

    mode = "RNN"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", dtype: Any = "float32", algo: str = "auto",
                 seed: int | None = None):
        validation.choice("nonlinearity", nonlinearity, validation.NONLINEARITIES)
        super().__init__(input_size, hidden_size, bias, dtype, algo, seed, nonlinearity)


class GRUCell(_Cell):
    """``torch.nn.GRUCell`` (gates r, z, n). ``GRUCell(input_size, hidden_size, bias=True,
    dtype="float32", algo="auto", seed=None)``."""

    mode = "GRU"


class LSTMCell(_Cell):
    """``torch.nn.LSTMCell`` (gates i, f, g, o); ``hx`` and the result are ``(h, c)`` pairs.
    ``LSTMCell(input_size, hidden_size, bias=True, dtype="float32", algo="auto", seed=None)``."""

    mode = "LSTM"
