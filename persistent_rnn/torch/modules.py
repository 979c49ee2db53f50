"""Drop-in ``torch.nn.RNN``, ``GRU`` and ``LSTM`` whose recurrence runs in persistent_rnn.

The classes derive from ``torch.nn.RNNBase`` and take torch.nn's own constructor, checks,
``forward`` and hidden-state handling from ``torch.nn.RNN/GRU/LSTM``, so that parameters, their
initialisation, ``state_dict`` keys, ``repr``, error messages and every argument (``dropout``,
``proj_size``, ``batch_first``, ...) are torch.nn's. They are deliberately not subclasses of
``torch.nn.RNN/GRU/LSTM``: torch.compile refuses to trace any instance of those (a graph break,
an error under ``fullgraph=True``).

``forward`` picks a path per call (``paths.choose``): the library's custom op
(``ops.recurrence``) or torch.nn's own forward, and ``last_run`` says which and why.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from . import onnx, paths
from .packing import PackedLayout
from .ops import LastRun, Recorded, _cell, run_recurrence


class _RecurrentBase(Recorded, torch.nn.RNNBase):
    """What the three modules share: path choice, the library forward, run records."""

    _torch_forward: Any  # torch.nn's forward of the same layer (a plain function)
    _input_dims_error: str  # torch.nn's message (its wording differs between the classes)

    def __init__(self, mode: str, *args, algo: str = "auto", **kwargs) -> None:
        super().__init__(mode, *args, **kwargs)
        self._start_recording(algo)

    def decoder(self, batch: int):
        """A decoder of this layer for ``batch`` rows (``persistent_rnn.torch.decoder``): single
        steps with W_hh resident between them (inference; unidirectional, no projection); the
        weights are those of this call."""
        from .decoder import TorchDecoder, module_layers
        if self.bidirectional or self.proj_size:
            raise ValueError("decoder(): a decoder steps a unidirectional layer without a "
                             "projection (bidirectional=False, proj_size=0)")
        return TorchDecoder(self, batch, _cell(self.mode), module_layers(self, self.num_layers),
                            self.input_size, self.hidden_size, stacked=True)

    def __prepare_scriptable__(self):
        raise RuntimeError(f"{type(self).__name__} from persistent_rnn.torch cannot be compiled "
                           f"with TorchScript (torch.jit.script); use torch.compile or "
                           f"torch.export instead")

    def forward(self, input, hx=None):
        """torch.nn's forward: ``input, hx -> output, h_n`` (LSTM: ``output, (h_n, c_n)``)."""
        # torch.compile's flag read once a forward (the op's road below is told it; dynamo takes
        # the call for a constant); torch.jit.trace's where it is not compiling (is_tracing's
        # own test, is_scripting, is false outside TorchScript, which never runs this)
        compiling = torch.compiler.is_compiling()
        if compiling:
            if onnx.exporting_while_compiling():  # ONNX's own nodes, on any device (onnx.py)
                return self._library_forward(input, hx, onnx.ALGO)
        elif torch._C._is_tracing():
            _refuse_unsupported_export(type(self).__name__)
        packed = isinstance(input, PackedSequence)
        data = input.data if packed else input
        decision = (paths.decide if compiling else paths.choose)(
            self.algo, _cell(self.mode), data, self.hidden_size, self.proj_size,
            lambda: _batch_size(input, self.batch_first))
        if decision.path == paths.TORCH:
            if not compiling:  # under compile, only the op records runs
                self._record.last = LastRun(algo=paths.TORCH, fallback=decision.why)
            return self._torch_forward(input, hx)
        return self._library_forward(input, hx, decision.path, decision, not compiling)

    def _library_forward(self, input, hx, algo: str, decision: paths.Decision | None = None,
                         eager: bool = False):
        """The library's forward with ``algo``; ``decision``: ``paths.choose``'s for this input
        (its compute dtype and autocast), worked out here where not given; ``eager``: the caller
        found neither torch.compile nor torch.jit.trace tracing (``run_recurrence``'s)."""
        cell = _cell(self.mode)
        lstm = cell.has_cell_state
        packed = input if isinstance(input, PackedSequence) else None
        layout = None
        if lstm:
            _check_hidden_pair(hx)
        if packed is not None:
            self._check_args(packed.data, hx, packed.batch_sizes)
            rows = int(packed.batch_sizes.sum())
            if rows != packed.data.shape[0]:  # torch.nn's kernels raise RuntimeError here too
                raise RuntimeError(f"packed input: batch_sizes sum to {rows} rows but its data "
                                   f"has {packed.data.shape[0]} (lengths past the padded "
                                   f"length given to pack_padded_sequence?)")
            layout = PackedLayout.of(packed)
            x, lengths = layout.pad(packed.data), layout.lengths  # the caller's batch order
            unbatched = False
        else:
            x, lengths = input, None
            dims = x.dim()
            if dims not in (2, 3):  # torch.nn's check, before any other
                raise ValueError(self._input_dims_error.format(dims))
            unbatched = dims == 2
            if hx is not None:
                hx = _hidden_as_batch(hx, batched=not unbatched)
            if unbatched:
                x = x.unsqueeze(0 if self.batch_first else 1)
            self._check_args(x, hx, None)
            x = x.transpose(0, 1) if self.batch_first else x
            if x.shape[0] == 0:  # torch.nn's error (its kernels check this)
                raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        weights = _current_weights(self)
        if decision is None:
            decision = paths.Decision(algo, None, paths.compute_dtype(cell, x),
                                      paths.autocast_dtype(x.device.type) is not None)
        c_dtype = _cell_state_dtype(self, x, hx, decision.dtype) if lstm else None
        if decision.autocast:
            x, hx, weights = _autocast_inputs(x, hx, weights, decision.dtype)
        _check_like_input(x, hx, self._flat_weights_names, weights)
        h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (None, None)
        y, hn, cn = self._run_layers(x, lengths, h0, c0, weights, algo, layout, eager)
        cn = cn.to(c_dtype) if lstm else None
        if packed is not None:
            out = PackedSequence(layout.pack(y), packed.batch_sizes, packed.sorted_indices,
                                 packed.unsorted_indices)
            return out, ((hn, cn) if lstm else hn)
        y = y.transpose(0, 1) if self.batch_first else y
        if unbatched:
            y = y.squeeze(0 if self.batch_first else 1)
            return y, ((hn.squeeze(1), cn.squeeze(1)) if lstm else hn.squeeze(1))
        return y, ((hn, cn) if lstm else hn)

    def _run_layers(self, x, lengths, h0, c0, weights, algo: str, layout: PackedLayout | None,
                    eager: bool):
        """The stack in one op call, or (dropout in training) one call per layer with torch's
        dropout between layers, drawn as torch.nn's CPU kernels draw it (``eager``:
        ``run_recurrence``'s)."""
        if algo == onnx.ALGO:
            return onnx.recurrence_nodes(self, x, lengths, h0, c0, weights)
        layers, slot = self.num_layers, self._record.slot
        p = float(self.dropout) if self.training else 0.0
        if p == 0.0 or layers == 1:
            return run_recurrence(x, lengths, h0, c0, weights, self.mode, layers,
                                  self.bidirectional, algo, (slot, 0, 1), eager)
        dirs = 2 if self.bidirectional else 1
        per_layer = len(weights) // layers
        hs, cs = [], []
        for layer in range(layers):
            states = slice(layer * dirs, (layer + 1) * dirs)
            x, hn, cn = run_recurrence(
                x, lengths, None if h0 is None else h0[states], None if c0 is None else c0[states],
                weights[layer * per_layer:(layer + 1) * per_layer], self.mode, 1,
                self.bidirectional, algo, (slot, layer, layers), eager)
            hs.append(hn)
            cs.append(cn)
            if layer < layers - 1:
                x = _dropout_between_layers(x, layout, p)
        return x, torch.cat(hs), None if cs[0] is None else torch.cat(cs)

    def _check_args(self, x: torch.Tensor, hx, batch_sizes: torch.Tensor | None) -> None:
        """torch.nn's own checks (``check_input``, ``check_forward_args``), so that errors read
        exactly as torch.nn's; the usual call - no state, a 3-D input of the module's input size
        and of its first weight's dtype, which ``check_input`` passes - without their calls."""
        if hx is None:
            if (batch_sizes is None and x.dim() == 3 and x.shape[2] == self.input_size
                    and x.dtype == self._flat_weights[0].dtype):
                return
            self.check_input(x, batch_sizes)
        else:
            self.check_forward_args(x, hx, batch_sizes)


def _current_weights(module) -> list:
    """The module's weights as they are at this call, in ``_flat_weights_names`` order (not
    torch.nn's cached ``_flat_weights``: ``torch.func.functional_call`` swaps them in
    ``_parameters``, parametrizations make them properties; ``getattr`` sees both, and a
    parameter is read from ``_parameters`` at once, as ``getattr`` would find it)."""
    params, names = module._parameters, module._flat_weights_names
    try:
        return list(map(params.__getitem__, names))  # (the usual case: in C, no frame)
    except KeyError:  # (a parametrized weight: a property)
        return [params[name] if name in params else getattr(module, name) for name in names]


def _check_hidden_pair(hx) -> None:
    """torch.nn.LSTM's error for a state that is not a pair (before anything unpacks it)."""
    if isinstance(hx, (tuple, list)) and len(hx) != 2:
        raise RuntimeError("lstm expects two hidden states")


def _refuse_unsupported_export(name: str) -> None:
    """The error for a forward under torch.jit.trace (torch.jit.script never reaches forward:
    ``__prepare_scriptable__`` refuses first)."""
    raise RuntimeError(f"{name} from persistent_rnn.torch does not support TorchScript "
                       f"(torch.jit.trace, and the TorchScript-based ONNX exporter): use "
                       f"torch.export or torch.compile, and torch.onnx.export(..., "
                       f"dynamo=True) for ONNX")


def _batch_size(input, batch_first: bool) -> int:
    if isinstance(input, PackedSequence):
        return int(input.batch_sizes[0])
    if input.dim() == 2:
        return 1
    return input.shape[0 if batch_first else 1]


def _autocast_inputs(x: torch.Tensor, hx, weights: list, dtype: torch.dtype):
    """Inside autocast, the input, state and weights cast to ``dtype``, the dtype torch.nn
    computes the layer in (``paths.compute_dtype``), as autocast casts an op's inputs
    (differentiably: the gradients reach the float32 parameters)."""
    return x.to(dtype), _map(hx, lambda h: h.to(dtype)), [w.to(dtype) for w in weights]


def _cell_state_dtype(module, x: torch.Tensor, hx, dtype: torch.dtype) -> torch.dtype:
    """The dtype torch.nn returns c_n in: the compute dtype ``dtype``, except for an LSTM with
    projection under CPU autocast, whose c state keeps c0's dtype (the input's when c0 is not
    given): torch's CPU implementation of projections runs the cell update outside autocast."""
    if module.proj_size and x.device.type == "cpu" and dtype != x.dtype:
        return hx[1].dtype if isinstance(hx, tuple) else x.dtype
    return dtype


def _check_like_input(x: torch.Tensor, hx, names: list[str], weights: list) -> None:
    """torch.nn's exception (``RuntimeError``) for a state or weight that is not on the input's
    device (torch.nn's messages) or not of its dtype (where torch.nn's kernels fail, each with its
    own words, this names the tensor); ``names``: the weights' names. (The usual case, every
    tensor like ``x``, checked in loops without naming anything; on the CPU by ``is_cpu``:
    building a tensor's ``device`` object costs several times that.)"""
    states = (hx,) if isinstance(hx, torch.Tensor) else (hx or ())
    dtype = x.dtype
    if x.is_cpu:
        for t in (*states, *weights):
            if not t.is_cpu or t.dtype != dtype:
                break
        else:
            return
    else:
        device = x.device
        for t in (*states, *weights):
            if t.device != device or t.dtype != dtype:
                break
        else:
            return
    states = {"hx": hx} if isinstance(hx, torch.Tensor) else dict(zip(("h_0", "c_0"), hx or ()))
    for kind, tensors in (("hidden", states), ("parameter", dict(zip(names, weights)))):
        for name, t in tensors.items():
            if t.device != x.device:
                raise RuntimeError(f"Input and {kind} tensors are not at the same device, found "
                                   f"input tensor at {x.device} and {kind} tensor at {t.device}")
            if t.dtype != x.dtype:
                raise RuntimeError(f"{name} dtype ({t.dtype}) does not match the input dtype "
                                   f"({x.dtype}): convert it with {name}.to({x.dtype})")


def _dropout_between_layers(y: torch.Tensor, layout: PackedLayout | None,
                            p: float) -> torch.Tensor:
    """torch's dropout on a layer's time-major output, over the same elements in the same order
    as torch.nn's CPU kernels (the packed data for packed input), so that the same seed drops the
    same units."""
    if layout is None:
        return F.dropout(y, p, training=True)
    return layout.pad(F.dropout(layout.pack(y), p, training=True))


def _hidden_as_batch(hx, batched: bool):
    """The state checked as torch.nn checks it against batched 3-D or unbatched 2-D input
    (same exception and message), an unbatched state as a batch of one."""
    if hx is None:
        return None
    states = hx if isinstance(hx, tuple) else (hx,)
    dims = 3 if batched else 2
    if any(h.dim() != dims for h in states):
        got = ", ".join(f"{h.dim()}-D" for h in states)
        got = f"({got}) tensors" if isinstance(hx, tuple) else f"{got} tensor"
        what = "hx and cx" if isinstance(hx, tuple) else "hx"
        kind = "batched 3-D" if batched else "unbatched 2-D"
        raise RuntimeError(f"For {kind} input, {what} should also be {dims}-D but got {got}")
    return hx if batched else _map(hx, lambda h: h.unsqueeze(1))


def _map(hx, fn):
    """Apply ``fn`` to a hidden state that is ``None``, a tensor or an LSTM ``(h, c)`` tuple."""
    if hx is None:
        return None
    return tuple(fn(h) for h in hx) if isinstance(hx, tuple) else fn(hx)


class RNN(_RecurrentBase):
    """Drop-in ``torch.nn.RNN`` (tanh or relu); extra keyword ``algo``."""

    _torch_forward = torch.nn.RNN.forward
    _input_dims_error = "RNN: Expected input to be 2D or 3D, got {}D tensor instead"

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        args, nonlinearity = (args[:3] + args[4:], args[3]) if len(args) > 3 else (
            args, kwargs.pop("nonlinearity", "tanh"))
        modes = {"tanh": "RNN_TANH", "relu": "RNN_RELU"}
        if nonlinearity not in modes:
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or "
                             f"'relu'.")
        self.nonlinearity = nonlinearity
        super().__init__(modes[nonlinearity], *args, algo=algo, **kwargs)


class GRU(_RecurrentBase):
    """Drop-in ``torch.nn.GRU``; extra keyword ``algo``."""

    _torch_forward = torch.nn.GRU.forward
    _input_dims_error = "GRU: Expected input to be 2D or 3D, got {}D instead"

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        if "proj_size" in kwargs:
            raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
        super().__init__("GRU", *args, algo=algo, **kwargs)


class LSTM(_RecurrentBase):
    """Drop-in ``torch.nn.LSTM`` (with ``proj_size``); extra keyword ``algo``."""

    _torch_forward = torch.nn.LSTM.forward
    _input_dims_error = "LSTM: Expected input to be 2D or 3D, got {}D instead"
    get_expected_cell_size = torch.nn.LSTM.get_expected_cell_size
    check_forward_args = torch.nn.LSTM.check_forward_args
    permute_hidden = torch.nn.LSTM.permute_hidden

    def __init__(self, *args, algo: str = "auto", **kwargs) -> None:
        super().__init__("LSTM", *args, algo=algo, **kwargs)
