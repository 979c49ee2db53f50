"""Drop-in ``torch.nn.RNNCell``, ``GRUCell`` and ``LSTMCell`` whose step runs in persistent_rnn.

The classes derive from torch.nn's cells (constructor, parameters, their initialisation,
``state_dict``, ``repr`` are torch.nn's; ``isinstance(cell, torch.nn.LSTMCell)`` holds) and add
the keyword ``algo``. ``forward`` keeps torch.nn's semantics — unbatched input, the zero default
state, torch.nn's exceptions and messages for bad input (its size checks, in its order and words,
before the library sees anything) — and runs one step through the library's custom op
``persistent_rnn::cell_step`` (``persistent_rnn.cell_step``): on CUDA float32 tensors the fused
step kernel (both matrix products and the cell in one launch), with ``algo="gemm"`` two matrix
products and the cell's pointwise math, on CPU tensors with ``algo="persistent"`` the fused
kernel's CPU emulation. ``algo="auto"`` runs the fused kernel on CUDA float32 tensors and
torch's own cell everywhere else (CPU tensors, float64, 16-bit dtypes, autocast, CUDA graph
capture, other devices); ``last_run`` says which and why, as for the layers.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, _VF

from .. import cell_step
from ..cells import NONLINEARITIES, CellSpec, cell_spec, from_mode
from ..stats import RunStats
from . import paths
from .interop import NUMPY_DTYPES, library_stream, to_array, to_tensor
from .ops import (MODES, LastRun, Recorded, _loop_vmap_rule, _record_backward, _record_forward,
                  forward_settings, under_forward_settings)
from .ops import _params as ops_params

CELL_DTYPES = (torch.float32, torch.float64)  # what the library's cells compute in
_BY_MODE = {mode: from_mode(mode) for mode in MODES}  # a dict: torch.compile traces lookups


def _cell(mode: str) -> CellSpec:
    return _BY_MODE[mode]


_NAMES = {n: tuple(cell_step.param_names(bias=n == 4)) for n in (2, 4)}  # by len(weights)


def _params(weights: list[Tensor], slot: int | None = None) -> dict:
    """The weights as the library's arrays under the cell's names; ``slot``: the cell's
    ``RunRecord`` slot, whose ``WeightViews`` remembers the arrays for the next step on the same
    weights (``ops._params``: no hand-over a step)."""
    return dict(zip(_NAMES[len(weights)], ops_params(weights, 1, False, slot).values()))


def _tensor(a) -> Tensor:
    """A library result as a tensor that owns its memory (a zero-width view is copied: a custom
    op's outputs must not alias each other)."""
    return to_tensor(a if a.base is None or a.size else a.copy())


def _step(x: Tensor, h: Tensor, c: Optional[Tensor], weights: list[Tensor], mode: str,
          algo: str, stats_slot: int) -> tuple[Tensor, Tensor, Tensor]:
    """One step of cell ``mode`` (torch.nn's mode string): ``(h', c', saved)``, ``c'`` empty
    unless LSTM; ``x`` (B, I), ``h``/``c`` (B, H); ``algo`` ``"gemm"`` or ``"persistent"``."""
    return _stepped(x, h, c, weights, mode, algo, stats_slot, True)


def _stepped(x: Tensor, h: Tensor, c: Optional[Tensor], weights: list[Tensor], mode: str,
             algo: str, stats_slot: int, saved: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``_step``; ``saved`` ``None`` unless asked for (an eager inference step: no backward
    reads it, so it is not handed over)."""
    with library_stream(x):
        hn, cn, ctx, stats = cell_step.step_forward(_BY_MODE[mode], _params(weights, stats_slot),
                                                    to_array(x), to_array(h), to_array(c), algo)
        outputs = (_tensor(hn), x.new_empty(0) if cn is None else _tensor(cn),
                   _tensor(ctx.saved) if saved else None)
    _record_forward(stats_slot, 0, stats, str(x.dtype).removeprefix("torch."))
    return outputs


cell_step_op = torch.library.custom_op("persistent_rnn::cell_step", _step, mutates_args=(),
                                       tags=(torch.Tag.cudagraph_unsafe,))


@cell_step_op.register_fake
def _(x, h, c, weights, mode, algo, stats_slot):
    cell = _cell(mode)
    cn = torch.empty_like(h) if cell.has_cell_state else x.new_empty(0)
    return torch.empty_like(h), cn, h.new_empty((h.shape[0], cell.saved * h.shape[1]))


@torch.library.custom_op("persistent_rnn::cell_step_backward", mutates_args=(),
                         tags=(torch.Tag.cudagraph_unsafe,))
def cell_step_backward(dh: Tensor, dc: Optional[Tensor], x: Tensor, h: Tensor,
                       c: Optional[Tensor], hn: Tensor, cn: Optional[Tensor], saved: Tensor,
                       weights: list[Tensor], mode: str,
                       stats_slot: int) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of ``cell_step``: ``(dx, dh, dc, dweights)`` (``dc`` empty unless LSTM)."""
    cell = _cell(mode)
    with library_stream(dh):
        ctx = cell_step.StepContext(cell, to_array(x), to_array(h), to_array(c), to_array(hn),
                                    to_array(cn), to_array(saved))
        params = _params(weights)
        dx, dh0, dc0, grads = cell_step.step_backward(ctx, params, to_array(dh), to_array(dc))
        outputs = (_tensor(dx), _tensor(dh0), x.new_empty(0) if dc0 is None else _tensor(dc0),
                   [_tensor(grads[name]) for name in params])
    _record_backward(stats_slot, True, RunStats(algo="gemm"))
    return outputs


@cell_step_backward.register_fake
def _(dh, dc, x, h, c, hn, cn, saved, weights, mode, stats_slot):
    dc0 = torch.empty_like(c) if c is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(h), dc0, [torch.empty_like(w) for w in weights]


def _setup_context(ctx, inputs, output) -> None:
    x, h, c, weights, mode, algo, slot = inputs
    hn, cn, saved = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(saved)
    ctx.static = (mode, slot)
    ctx.settings = forward_settings()
    ctx.lstm = c is not None
    ctx.save_for_backward(x, h, c, hn, cn if ctx.lstm else None, saved, *weights)


def _backward(ctx, dhn, dcn, _dsaved):
    with under_forward_settings(ctx):
        return _backward_in_force(ctx, dhn, dcn)


def _backward_in_force(ctx, dhn, dcn):
    """``_backward`` under its forward's settings (``settings.in_force``)."""
    x, h, c, hn, cn, saved, *weights = ctx.saved_tensors
    mode, slot = ctx.static
    dhn = torch.zeros_like(hn) if dhn is None else dhn
    dcn = torch.zeros_like(cn) if ctx.lstm and dcn is None else (dcn if ctx.lstm else None)
    if torch.is_grad_enabled():  # create_graph: differentiate torch's own cell (double backward)
        dx, dh, dc, dweights = _differentiable_grads(x, h, c, weights, mode, dhn, dcn)
    else:
        dx, dh, dc, dweights = cell_step_backward(dhn, dcn, x, h, c, hn, cn, saved, weights,
                                                  mode, slot)
    return dx, dh, dc if ctx.lstm else None, list(dweights), None, None, None


cell_step_op.register_autograd(_backward, setup_context=_setup_context)
for _op in (cell_step_op, cell_step_backward):
    torch.library.register_vmap(_op, _loop_vmap_rule(_op))


class _CellStep(torch.autograd.Function):
    """``cell_step_op`` with the same autograd formula as a new-style ``autograd.Function``:
    torch.func transforms (``grad``, ``vmap``) take only those (not ``register_autograd``)."""

    generate_vmap_rule = True  # vmap runs the op's own (loop) rule

    @staticmethod
    def forward(x, h, c, static, *weights):
        return cell_step_op(x, h, c, list(weights), *static)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, h, c, static, *weights = inputs
        _setup_context(ctx, (x, h, c, weights, *static), output)

    @staticmethod
    def backward(ctx, dhn, dcn, dsaved):
        dx, dh, dc, dweights, *_ = _backward(ctx, dhn, dcn, dsaved)
        return dx, dh, dc, None, *dweights


def torch_cell(x: Tensor, h: Tensor, c: Tensor | None, weights: list[Tensor],
               mode: str) -> tuple[Tensor, Tensor | None]:
    """``(h', c')`` of the step computed by torch's own cell function (``torch._VF``)."""
    run = getattr(_VF, f"{_cell(mode).name}_cell")  # torch's functions are named as the cells
    bias = weights[2:] if len(weights) == 4 else [None, None]
    if c is None:
        return run(x, h, weights[0], weights[1], *bias), None
    return run(x, (h, c), weights[0], weights[1], *bias)


def _differentiable_grads(x, h, c, weights, mode, dhn, dcn):
    """The step's gradients as differentiable functions of its inputs (torch's cell); ``None``
    for an input that does not require grad."""
    inputs = [x, h, c, *weights]
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    result: list = [None] * len(inputs)
    with torch.enable_grad():
        outputs = [o for o in torch_cell(x, h, c, weights, mode) if o is not None]
        grads = torch.autograd.grad(outputs, [inputs[i] for i in wanted],
                                    [dhn, dcn][:len(outputs)], create_graph=True,
                                    allow_unused=True, materialize_grads=True)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result[0], result[1], result[2], result[3:]


class _LibraryCell(Recorded):
    """What the three cells share: path choice, torch.nn's checks, the library step, run
    records. Mixed into a subclass of the torch.nn cell ``_torch_cls``."""

    _torch_cls: type
    _mode: str  # torch.nn's mode string of the cell

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        self._torch_cls.__init__(self, *args, **kwargs)  # (torch.nn may be patched by now)
        self._start_recording(algo)

    def forward(self, input, hx=None):
        """torch.nn's forward: ``input, hx -> h'`` (LSTMCell: ``(h', c')``)."""
        path, why = self._choose(input)
        if path == paths.TORCH:
            if not torch.compiler.is_compiling():
                self._record.last = LastRun(algo=paths.TORCH, fallback=why)
            return self._torch_cls.forward(self, input, hx)
        return self._library_forward(input, hx, path)

    def decoder(self, batch: int):
        """A decoder of this cell for ``batch`` rows (``persistent_rnn.torch.decoder``): single
        steps with W_hh resident between them (inference); the weights are those of this call."""
        from .decoder import TorchDecoder
        params = {"weight_ih": self.weight_ih, "weight_hh": self.weight_hh}
        if self.bias:
            params.update(bias_ih=self.bias_ih, bias_hh=self.bias_hh)
        return TorchDecoder(self, batch, _cell(self._mode), [params], self.input_size,
                            self.hidden_size, stacked=False)

    def _choose(self, x: Tensor) -> tuple[str, str | None]:
        """``(path, why)``: torch's cell or the library's step algorithm, and why the fused
        kernel does not run (``None`` where it may or was not asked for)."""
        blocker = _library_blocker(x)
        if self.algo != "auto":
            if blocker is not None:
                raise ValueError(f"algo={self.algo!r} cannot run this cell: {blocker}")
            paths.prepare_capture(x, x.dtype)
            return cell_step.step_algo(self.algo, None, NUMPY_DTYPES[x.dtype]), None
        blocker = blocker or paths.captured_auto(x)
        if blocker is not None:
            return paths.TORCH, blocker
        if not x.is_cuda:
            return paths.TORCH, "CPU tensors: torch's CPU kernels"
        if x.dtype != torch.float32:
            return paths.TORCH, (f"dtype {x.dtype}: the fused step kernel computes float32; "
                                 f"torch's kernels run it")
        return "persistent", None

    def _library_forward(self, input: Tensor, hx, algo: str):
        mode = self._mode
        lstm = _BY_MODE[mode].has_cell_state
        states = self._checked_dims(input, hx, lstm)
        if states is None:  # not a pair where torch.nn wants one: torch.nn's own error
            return self._torch_cls.forward(self, input, hx)
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        if not states:  # torch.nn's default state (two tensors: compile refuses one twice)
            states = tuple(torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype,
                                       device=x.device) for _ in range(1 + lstm))
        elif not batched:
            states = tuple(s.unsqueeze(0) for s in states)
        p = self._parameters  # (what ``self.weight_ih`` reads, without Module.__getattr__)
        weights = [p["weight_ih"], p["weight_hh"], *([p["bias_ih"], p["bias_hh"]]
                                                     if self.bias else [])]
        if not _plain(x, states, weights):  # torch.nn's forward raises its own error
            return self._torch_cls.forward(self, input, hx)
        _check_sizes(x, states, weights)
        args = (x, states[0], states[1] if lstm else None)
        static = (mode, algo, self._record.slot)
        if _needs_graph(args, weights):
            hn, cn, _ = _CellStep.apply(*args, static, *weights)
        else:  # eager inference: the step itself, without the op's dispatch (most of its cost)
            hn, cn, _ = _stepped(*args, weights, *static, False)
        if not batched:
            hn, cn = hn.squeeze(0), cn.squeeze(0) if lstm else cn
        return (hn, cn) if lstm else hn

    def _checked_dims(self, input: Tensor, hx, lstm: bool) -> tuple | None:
        """torch.nn's dimension checks (its exceptions and messages); the states as a tuple
        (empty: none given), or ``None`` where torch.nn's own forward must raise."""
        name = self._torch_cls.__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: Expected input to be 1D or 2D, got {input.dim()}D instead")
        if hx is None:
            return ()
        if not lstm:
            if hx.dim() not in (1, 2):
                raise ValueError(f"{name}: Expected hidden to be 1D or 2D, got {hx.dim()}D "
                                 f"instead")
            return (hx,)
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            return None
        for idx, value in enumerate(hx):
            if value.dim() not in (1, 2):
                raise ValueError(f"{name}: Expected hx[{idx}] to be 1D or 2D, got "
                                 f"{value.dim()}D instead")
        return tuple(hx)


def _needs_graph(args: tuple, weights: list[Tensor]) -> bool:
    """Whether the step must go through the op: under torch.compile/export, a torch.func
    transform or fake tensors, or when autograd records it. (Loops, not comprehensions: no
    frames a step.)"""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    grad = torch.is_grad_enabled()
    for t in (*args, *weights):
        if t is None:
            continue
        if type(t) is not Tensor and (isinstance(t, torch._subclasses.FakeTensor)
                                      or not isinstance(t, torch.nn.Parameter)):
            return True
        if grad and t.requires_grad:
            return True
    return False


def _plain(x: Tensor, states: tuple, weights: list[Tensor]) -> bool:
    """Whether the step's tensors are all 2-D (biases 1-D) and of the input's dtype and device:
    what the library's step takes; anything else goes to torch.nn's forward, which raises.
    (A loop, not comprehensions: no frames a step.)"""
    matrices, dtype, device = len(states) + 3, x.dtype, x.device
    for i, t in enumerate((x, *states, *weights)):
        if t.dtype != dtype or t.device != device or t.dim() != (2 if i < matrices else 1):
            return False
    return True


def _check_sizes(x: Tensor, states: tuple, weights: list[Tensor]) -> None:
    """torch's cell size checks (``check_rnn_cell_forward_input`` / ``_hidden`` in ATen), in
    their order, with their exception type and messages; every tensor 2-D (``_plain``). Read
    from ``shape``s: a ``size(i)`` call parses its argument, several times the cost."""
    input_size, hidden_size = weights[0].shape[1], weights[1].shape[1]
    batch, width = x.shape
    if width != input_size:
        raise RuntimeError(f"input has inconsistent input_size: got {width} expected "
                           f"{input_size}")
    for label, h in enumerate(states):
        rows, columns = h.shape
        if rows != batch:
            raise RuntimeError(f"Input batch size {batch} doesn't match hidden{label} batch "
                               f"size {rows}")
        if columns != hidden_size:
            raise RuntimeError(f"hidden{label} has inconsistent hidden_size: got {columns}, "
                               f"expected {hidden_size}")


def _library_blocker(x: Tensor) -> str | None:
    """Why the library cannot run a step on ``x`` at all, or ``None``."""
    kind = x.device.type
    if kind not in ("cpu", "cuda"):
        return f"device {kind}: the library runs CPU and CUDA tensors; torch's kernels run it"
    if paths.autocast_dtype(kind) is not None:
        return "autocast: torch's kernels run the cell in autocast's dtype"
    if x.dtype not in CELL_DTYPES:
        return (f"dtype {x.dtype}: the library's cells run float32 and float64; torch's kernels "
                f"run it")
    return paths.library_blocker(x, x.dtype)


class RNNCell(_LibraryCell, torch.nn.RNNCell):
    """Drop-in ``torch.nn.RNNCell`` (tanh or relu); extra keyword ``algo``."""

    _torch_cls = torch.nn.RNNCell

    @property
    def _mode(self) -> str:
        return cell_spec("RNN", self.nonlinearity).mode

    def _choose(self, x: Tensor) -> tuple[str, str | None]:
        if self.nonlinearity not in NONLINEARITIES:  # torch.nn's forward raises its error
            return paths.TORCH, None
        return super()._choose(x)


class GRUCell(_LibraryCell, torch.nn.GRUCell):
    """Drop-in ``torch.nn.GRUCell``; extra keyword ``algo``."""

    _torch_cls = torch.nn.GRUCell
    _mode = "GRU"


class LSTMCell(_LibraryCell, torch.nn.LSTMCell):
    """Drop-in ``torch.nn.LSTMCell``; extra keyword ``algo``."""

    _torch_cls = torch.nn.LSTMCell
    _mode = "LSTM"
