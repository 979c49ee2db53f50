"""ONNX export of the modules as ONNX's own ``RNN``, ``GRU`` and ``LSTM`` operators.

``torch.onnx.export(model, args, dynamo=True, dynamic_shapes=...)`` needs nothing more: while
it captures the model (``torch.onnx.is_in_onnx_export()``), the modules' recurrence — what the
library's custom op ``persistent_rnn::recurrence`` computes — is written as one standard ONNX
node per layer (both directions in one node, ``direction="bidirectional"``), chained, with
torch's public ``torch.onnx.ops.symbolic_multi_out``. The node's ``hidden_size`` is the only
shape it fixes: the time and batch axes stay as dynamic as the export declares them. Outside
ONNX export (eager, ``torch.compile``, ``torch.export``) nothing changes.

ONNX's operators differ from torch's in gate order (LSTM: ONNX i,o,f,c against torch's
i,f,g,o; GRU: z,r,h against r,z,n), in bias layout (the input and recurrent biases concatenated)
and in where the GRU's reset gate applies (``linear_before_reset=1`` is torch's GRU); the
weights are reordered here, in the graph, where the exporter folds them into constants.

ONNX's LSTM has no projection: an LSTM with ``proj_size`` is refused with a ``ValueError``.
``torch.export`` cannot capture packed input (for torch.nn's modules neither):
``padded_forward`` runs a module on a padded batch and its lengths, which export as the nodes'
``sequence_lens``. See docs/torch.md.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..cells import from_mode

ALGO = "onnx"  # the path name the modules pass down while exported to ONNX

# ONNX's gate order as indices of torch's gate blocks
_GATE_ORDER = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2), "RNN_TANH": (0,), "RNN_RELU": (0,)}
_RNN_ACTIVATION = {"RNN_TANH": "Tanh", "RNN_RELU": "Relu"}


def exporting() -> bool:
    """Whether ``torch.onnx.export(..., dynamo=True)`` is capturing the model (by any of its
    strategies: ``torch.export`` non-strict, then strict, then draft)."""
    return torch.compiler.is_compiling() and exporting_while_compiling()


def exporting_while_compiling() -> bool:
    """``exporting()`` where ``torch.compiler.is_compiling()`` is known true (a module's forward
    reads that once)."""
    return torch.onnx.is_in_onnx_export() or _flags_say_so()


def _flags_say_so() -> bool:
    # torch.onnx.is_in_onnx_export() reads this flag, but torch.compile's tracer (the exporter's
    # strict fallback) takes that function for False: the flag itself reads true there. Where a
    # later torch moves it, the strict fallback captures the library's op (no ONNX translation).
    from torch.onnx._internal.exporter import _flags
    return bool(getattr(_flags, "_is_onnx_exporting", False))


def padded_forward(module: torch.nn.Module, input: torch.Tensor, lengths: torch.Tensor,
                   hx: Any = None) -> tuple[torch.Tensor, Any]:
    """``module`` on a padded batch whose sequence ``b`` has ``lengths[b]`` steps (any order):
    ``pad_packed_sequence(module(pack_padded_sequence(input, lengths, enforce_sorted=False),
    hx), total_length=T)``, which ``torch.onnx.export`` also captures, the lengths as an input
    of the graph (the ONNX nodes' ``sequence_lens``).

    ``input`` is (T, B, I), or (B, T, I) for a ``batch_first`` module; ``lengths`` (B,) int64,
    each in 1..T. The output is zero past each length; the final states are those of each
    sequence's last step.
    """
    steps = input.shape[1 if module.batch_first else 0]
    if not exporting():
        packed = pack_padded_sequence(input, lengths.cpu(), batch_first=module.batch_first,
                                      enforce_sorted=False)
        out, state = module(packed, hx)
        out, _ = pad_packed_sequence(out, batch_first=module.batch_first, total_length=steps)
        return out, state
    lstm = module.mode == "LSTM"
    h0, c0 = (hx if hx is not None else (None, None)) if lstm else (hx, None)
    x = input.transpose(0, 1) if module.batch_first else input
    weights = [getattr(module, name) for name in module._flat_weights_names]
    y, hn, cn = recurrence_nodes(module, x, lengths, h0, c0, weights)
    y = y.transpose(0, 1) if module.batch_first else y
    return y, ((hn, cn) if lstm else hn)


def recurrence_nodes(module: torch.nn.Module, x: torch.Tensor, lengths: torch.Tensor | None,
                     h0: torch.Tensor | None, c0: torch.Tensor | None,
                     weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """``(y, h_n, c_n)`` of ``module``'s stack on time-major ``x`` as ONNX nodes (arguments as
    ``ops.recurrence`` takes them; ``c_n`` empty unless LSTM)."""
    if getattr(module, "proj_size", 0):
        raise ValueError("proj_size: ONNX's LSTM operator has no projection, so an LSTM with "
                         "proj_size > 0 cannot be exported to ONNX")
    if module.training and module.dropout and module.num_layers > 1:
        raise ValueError("dropout: ONNX's recurrent operators have none; call model.eval() "
                         "before torch.onnx.export")
    dirs = 2 if module.bidirectional else 1
    per_layer = len(weights) // module.num_layers
    lens = None if lengths is None else lengths.to(torch.int32)
    hs, cs = [], []
    for layer in range(module.num_layers):
        states = [None if s is None else s[layer * dirs:(layer + 1) * dirs] for s in (h0, c0)]
        y, *finals = _layer_node(module.mode, weights[layer * per_layer:(layer + 1) * per_layer],
                                 dirs, x, lens, states)
        x = y.permute(0, 2, 1, 3).flatten(2)  # Y (T, D, B, H) as the next input (T, B, D*H)
        hs.append(finals[0])
        cs.extend(finals[1:])
    return x, torch.cat(hs), torch.cat(cs) if cs else x.new_empty(0)


def _layer_node(mode: str, weights: list[torch.Tensor], dirs: int, x: torch.Tensor,
                lens: torch.Tensor | None, states: list) -> list[torch.Tensor]:
    """One ONNX node for one layer, both directions: ``[Y, Y_h]`` (LSTM: ``[Y, Y_h, Y_c]``)."""
    cell = from_mode(mode)
    per_direction = len(weights) // dirs
    own = [weights[d * per_direction:(d + 1) * per_direction] for d in range(dirs)]
    hidden = own[0][1].shape[0] // cell.gates

    def onnx_order(t: torch.Tensor) -> torch.Tensor:  # slices, which the exporter folds
        return torch.cat([t[g * hidden:(g + 1) * hidden] for g in _GATE_ORDER[mode]])

    w = torch.stack([onnx_order(d[0]) for d in own])
    r = torch.stack([onnx_order(d[1]) for d in own])
    bias = (torch.stack([torch.cat([onnx_order(d[2]), onnx_order(d[3])]) for d in own])
            if per_direction == 4 else None)
    steps, batch = x.shape[0], x.shape[1]
    attrs: dict[str, Any] = {"hidden_size": hidden,
                             "direction": "bidirectional" if dirs > 1 else "forward"}
    inputs = [x, w, r, bias, lens, states[0]]
    if mode == "GRU":
        attrs["linear_before_reset"] = 1
    elif mode != "LSTM":
        attrs["activations"] = [_RNN_ACTIVATION[mode]] * dirs
    else:
        inputs.append(states[1])
    outputs = 3 if cell.has_cell_state else 2
    return list(torch.onnx.ops.symbolic_multi_out(
        "RNN" if mode.startswith("RNN") else mode, inputs, attrs,
        dtypes=[x.dtype] * outputs,
        shapes=[(steps, dirs, batch, hidden)] + [(dirs, batch, hidden)] * (outputs - 1)))
