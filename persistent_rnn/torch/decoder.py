"""``decoder(batch=B)`` of the torch modules (``RNNCell``/``GRUCell``/``LSTMCell`` and the
unidirectional ``RNN``/``GRU``/``LSTM``): the resident decoder (``persistent_rnn.decoder``) on
tensors, for inference (no autograd history; docs/torch.md, "The resident decoder").

Which path runs: CUDA float32 tensors the library's decoder on the GPU (resident where the rule
allows, else the fused step kernel), CPU float32 tensors with ``algo="persistent"`` the same
decoder in the CPU emulation (a test path), everything else the module's own forward one step at
a time (torch's kernels), with ``reason`` saying why.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..cell_step import step_forward
from ..cells import CellSpec
from ..decoder import Decoder
from .interop import library_stream, to_array, to_tensor

TORCH = "torch"      # the module's own forward per step
LIBRARY = "library"  # persistent_rnn.decoder.Decoder


def _path(algo: str, weight: Tensor) -> tuple[str, str | None]:
    """``(path, why torch's kernels run)`` for a module's weights."""
    if algo == "gemm":
        return TORCH, "algo='gemm': the module's own step"
    if weight.dtype != torch.float32:
        return TORCH, f"dtype {weight.dtype}: the resident kernel computes float32"
    if weight.is_cuda:
        return LIBRARY, None
    if weight.device.type == "cpu" and algo == "persistent":
        return LIBRARY, None  # the CPU emulation (a test path)
    return TORCH, (f"{weight.device.type} tensors: torch's kernels step the module "
                   "(algo='persistent' on the CPU runs the emulated decoder)")


class TorchDecoder:
    """Single steps of a torch module with its recurrent weights resident (``Decoder``) or,
    where the library cannot run them, by the module's own forward. A context manager."""

    def __init__(self, module: torch.nn.Module, batch: int, cell: CellSpec,
                 layers: list[dict[str, Tensor]], input_size: int, hidden: int, stacked: bool):
        self._module, self._stacked = module, stacked
        self.path, self.reason = _path(module.algo, layers[0]["weight_hh"])
        self._dec: Decoder | None = None
        self._anchor = layers[0]["weight_hh"]  # (its device and stream: where resume() runs)
        self._cuda = self._anchor.is_cuda  # (a CPU decoder has no device or stream to enter)
        if self.path == LIBRARY:
            with torch.no_grad(), library_stream(self._anchor):
                arrays = [{k: to_array(v.detach()) for k, v in p.items()} for p in layers]
                self._dec = Decoder(cell, arrays, batch, input_size, hidden, stacked,
                                    fallback=step_forward, algo=module.algo)
            self.reason = self._dec.reason
        # The last step's state as tensors, its arrays and its stamp (``_stamp``): a loop that
        # passes it back unchanged is not handed over again
        self._handed: tuple = (None, None, None)

    @property
    def resident(self) -> bool:
        """Whether the steps run on the resident kernel."""
        return self._dec is not None and self._dec.resident

    @property
    def relaunches(self) -> int:
        """Launches of the resident kernel after its first (``Decoder.relaunches``)."""
        return 0 if self._dec is None else self._dec.relaunches

    def __enter__(self) -> "TorchDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resume(self) -> None:
        """Relaunch exited resident kernels before a captured loop's replay
        (``Decoder.resume``); nothing to do for a decoder that runs torch's kernels."""
        if self._dec is not None:
            with library_stream(self._anchor):
                self._dec.resume()

    def close(self) -> None:
        """Stop the resident kernels (``Decoder.close``): ``STOP`` posted on torch's current
        stream, as the steps were, so that it follows the steps still queued there."""
        if self._dec is not None:
            self._handed = (None, None, None)
            with library_stream(self._anchor):
                self._dec.close()

    def step(self, x: Tensor, state: Any = None) -> Any:
        """One step, as ``Decoder.step`` with tensors: a cell's ``h'`` (LSTM ``(h', c')``), a
        layer's ``(y, h')`` (LSTM ``(y, (h', c'))``)."""
        if self._dec is not None:
            return self._library(x, None, state)
        with torch.no_grad():
            if not self._stacked:
                return self._module(x, state)
            time = 1 if self._module.batch_first else 0
            y, hn = self._module(x.unsqueeze(time), state)
            return y.squeeze(time), hn

    def step_projected(self, gi: Tensor, state: Any = None) -> Any:
        """``Decoder.step_projected`` with tensors: ``gi = x W_ih^T + b_ih`` (batch, G*H) given
        (the kernels' own projection skipped). Resident decoders only."""
        if self._dec is None:
            raise ValueError(f"step_projected(): the decoder is not resident ({self.reason})")
        return self._library(None, gi, state)

    def _library(self, x: Tensor | None, gi: Tensor | None, state: Any) -> Any:
        """The decoder's step (``x`` given) or projected step (``gi``) on tensors: on a GPU on
        the input's stream (the outputs' hand-over too), in one ``library_stream`` entry. No
        ``torch.no_grad()``: nothing here is recorded by autograd (the hand-over reads a
        tensor's memory detached) and it cost five Python calls a step."""
        if not self._cuda:
            return self._handed_step(x, gi, state)
        with library_stream(x if gi is None else gi):
            return self._handed_step(x, gi, state)

    def _handed_step(self, x: Tensor | None, gi: Tensor | None, state: Any) -> Any:
        """``_library``'s step inside the hand-over: the inputs as arrays - the state the last
        step returned, passed back unchanged (the same tensors, ``_stamp``), as the arrays it
        was made from, without a hand-over or the decoder's checks (``own``) -, the outputs as
        tensors: a resident step's one allocation handed over once (``Decoder._advance``'s
        ``joint``) and its rows taken in torch."""
        last, arrays, stamp = self._handed
        own = state is last and state is not None and _stamp(state) == stamp
        dec = self._dec
        hn, cn, joint = dec._advance(None if x is None else to_array(x),
                                     arrays if own else _arrays(state),
                                     None if gi is None else to_array(gi), own)
        if joint is None:  # (the fallback's separate arrays)
            return _tensors(dec._shaped(hn, cn))
        rows = to_tensor(joint)
        out = dec._shaped(rows[0], rows[1] if cn is not None else None)
        state = out[1] if self._stacked else out
        arrays = dec._shaped(hn, cn)
        self._handed = (state, arrays[1] if self._stacked else arrays, _stamp(state))
        return out


def _stamp(state: Tensor | tuple) -> tuple:
    """What an in-place change of a state's tensors changes (as ``ops.WeightViews`` checks its
    weights): each one's memory, version counter (every in-place operation bumps it, ``t_()``
    and ``resize_()`` too), shape and contiguity."""
    if type(state) is tuple:
        h, c = state
        return (h.data_ptr(), h._version, h.shape, h.is_contiguous(),
                c.data_ptr(), c._version, c.shape, c.is_contiguous())
    return state.data_ptr(), state._version, state.shape, state.is_contiguous()


def _arrays(state: Any) -> Any:
    """A state's tensors as arrays: h, an (h, c) pair (the steady state: no recursion), or
    anything else element by element (for the decoder's own checks and errors)."""
    if isinstance(state, Tensor):
        return to_array(state)
    if type(state) is tuple and len(state) == 2:
        h, c = state
        if isinstance(h, Tensor) and isinstance(c, Tensor):
            return to_array(h), to_array(c)
    if isinstance(state, (tuple, list)):
        return tuple([_arrays(o) for o in state])
    return state


def _tensors(out: Any) -> Any:
    """A step's outputs as tensors: an array, a pair of arrays, or ``(y, (h, c))``."""
    if not isinstance(out, tuple):
        return to_tensor(out)
    first, second = out
    if isinstance(second, tuple):
        return to_tensor(first), (to_tensor(second[0]), to_tensor(second[1]))
    return to_tensor(first), to_tensor(second)


def module_layers(module: torch.nn.Module, layers: int) -> list[dict[str, Tensor]]:
    """A torch.nn layer's parameters per layer under the cell's names (weight_ih, ...)."""
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return [{n: getattr(module, f"{n}_l{i}") for n in names if hasattr(module, f"{n}_l{i}")}
            for i in range(layers)]
