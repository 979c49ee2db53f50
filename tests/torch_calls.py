"""Calling a torch module and collecting what it returns, shared by the tests that compare
persistent_rnn.torch with torch.nn (kept apart from test_torch_module_db.py, whose import of
torch's own test suite needs 'expecttest')."""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence


def tensors(obj) -> list[torch.Tensor]:
    """The tensors of a forward argument or result, in order (a PackedSequence's data)."""
    if isinstance(obj, PackedSequence):
        return [obj.data]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    return [obj]


def forward_backward(module, args, cotangent_seed: int):
    """Forward of ``args``, then backward of a fixed random projection of every output:
    ``(outputs, input gradients, parameter gradients)``."""
    module.zero_grad(set_to_none=True)
    outputs = tensors(module(*args))
    gen = torch.Generator().manual_seed(cotangent_seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
               for o in outputs)
    loss.backward()
    inputs = [t.grad for t in tensors(args) if t.requires_grad]
    return outputs, inputs, [p.grad for p in module.parameters()]


def raised(module, args) -> tuple[type, str] | None:
    """The type and message of the exception ``module(*args)`` raises, or None."""
    try:
        module(*args)
    except Exception as exc:  # noqa: BLE001 -- the exception itself is what is compared
        return type(exc), str(exc)
    return None
