"""Which implementation runs a module's forward: the library (persistent or GEMM) or torch's own.

``algo="auto"`` runs the persistent kernel where it runs and pays — CUDA float32, float16 and
bfloat16 tensors (also under CUDA autocast), a layer that fits the register file with its whole
batch staged at once (not in batch groups: ``plan.Plan.in_batch_groups``, which the latency model
predicts slower than cuDNN's persistent 16-bit kernels where those run), a batch up to
``auto_max_batch``, not under a caller's CUDA-graph capture — and torch's own implementation of
the same layer everywhere else (cuDNN on the GPU, torch's CPU kernels; under ``torch.compile`` a
CPU layer runs the library's GEMM op), so that swapping torch.nn for these modules never slows a
model down. ``algo="gemm"`` and ``algo="persistent"`` run the library (also under capture) and
raise ``ValueError`` where it cannot run the layer.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from .. import plan as planner
from .. import settings
from ..cells import CellSpec
from ..validation import ALGOS

TORCH = "torch"  # the path name reported in last_run.algo
LIBRARY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
PERSISTENT_DTYPES = {torch.float32: "float32", torch.float16: "float16",
                     torch.bfloat16: "bfloat16"}  # what the persistent kernels hold W_hh in


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower precision autocast casts to on ``device_type``, or ``None`` outside autocast."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def compute_dtype(cell: CellSpec, x: torch.Tensor) -> torch.dtype:
    """The dtype torch.nn computes this layer in on ``x``: autocast's lower precision where
    autocast casts the layer, else the input's dtype (which torch.nn requires the weights to
    have). CUDA autocast casts every recurrent layer (cuDNN's RNN is on its lower-precision
    list); torch's CPU autocast casts ``cell.cpu_autocast`` cells only (not GRU)."""
    low = autocast_dtype(x.device.type)
    if low is None or (x.device.type == "cpu" and not cell.cpu_autocast):
        return x.dtype
    return low


def library_blocker(x: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why the library cannot run this layer on ``x`` in ``dtype`` at all, or ``None``."""
    if dtype not in LIBRARY_DTYPES:
        return (f"dtype {dtype}: the library runs float32, float64, float16 and bfloat16; "
                f"torch's kernels run it")
    return None


def captured_auto(x: torch.Tensor) -> str | None:
    """Why ``algo="auto"`` runs torch's kernels on ``x`` under a caller's CUDA-graph capture, or
    ``None`` (not capturing). A forced ``"persistent"`` or ``"gemm"`` runs the library there:
    its calls enqueue everything on the capturing stream and read nothing back (restarts and
    fallback decided on the device); ``"auto"`` keeps torch's kernels, whose capture has run
    on GPUs, until the library's captured path has too. (Under torch.compile, capture is the
    compiler's business: the ops are tagged ``cudagraph_unsafe``.)"""
    if x.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
        return ("CUDA graph capture: algo='auto' runs torch's kernels there (algo='persistent' "
                "or 'gemm' captures the library's)")
    return None


_PREPARED: set[tuple[int, type]] = set()  # (device, dtype) whose captured products are loaded


def prepare_capture(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Before a forced algorithm's first CUDA call on a device outside capture: load the kernel
    the library's matrix products run under capture (``matmul.load_captured_kernel``: CuPy may
    not call cuBLAS there, and a module cannot be loaded during a capture in torch's default
    global mode), so that the caller's capture after its warm-up calls finds it loaded."""
    if not x.is_cuda:
        return
    key = (x.get_device(), np.float64 if dtype == torch.float64 else np.float32)
    if key in _PREPARED or torch.compiler.is_compiling() \
            or torch.cuda.is_current_stream_capturing():
        return
    from .. import matmul
    from .interop import library_stream
    with library_stream(x):
        matmul.load_captured_kernel(key[1])
    _PREPARED.add(key)


class Decision(NamedTuple):
    """What runs a module's forward (``choose``)."""

    path: str                    # "torch", or the library algo to run
    why: str | None              # why the persistent kernel does not run (None: it may)
    dtype: torch.dtype           # compute_dtype: what the layer is computed in
    autocast: bool               # autocast is on for the input's device (inputs are cast)


_DECISIONS: dict[tuple, Decision] = {}
MAX_DECISIONS = 256  # signatures remembered; the table is emptied when it is full


def choose(algo: str, cell: CellSpec, x: torch.Tensor, hidden: int, proj_size: int,
           batch) -> Decision:
    """The ``Decision`` for an eager forward on ``x`` (outside torch.compile, which ``decide``
    serves: the caller reads which): ``path`` is ``"torch"`` or the library ``algo`` to run;
    ``why`` says why the persistent kernel does not run (``None`` where it may).

    The library runs in ``compute_dtype`` (under autocast the module casts the input, states
    and weights to it, as autocast casts an op's inputs). ``batch`` is a callable giving the
    batch size (read only where it matters: it is a tensor element for packed input).
    The decision is remembered per signature: everything it depends on (the algo, cell, sizes,
    dtype, device, autocast, CUDA capture, and for ``"auto"`` on CUDA the batch and
    ``auto_max_batch``); an error is never remembered.
    """
    # (outside every autocast, as usual, no device type is read: reading it and asking per
    # device costs more than the rest of this function; a CPU tensor's device object is not
    # made either: ``None`` in the key stands for the CPU)
    autocast = torch._C._is_any_autocast_enabled()
    if x.is_cpu:
        low = autocast_dtype("cpu") if autocast else None
        key = (algo, cell.name, x.dtype, None, low, hidden, proj_size)  # (a name hashes fast)
    else:
        device = x.device
        low = autocast_dtype(device.type) if autocast else None
        key = (algo, cell.name, x.dtype, device, low, hidden, proj_size)
        if x.is_cuda:
            # (torch.cuda.is_current_stream_capturing's own binding, without its Python frame)
            key += (torch._C._cuda_isCurrentStreamCapturing(),)
            if algo == "auto":
                key += (int(batch()), settings.current().auto_max_batch)
    found = _DECISIONS.get(key)
    if found is None:
        found = decide(algo, cell, x, hidden, proj_size, batch)
        if len(_DECISIONS) >= MAX_DECISIONS:
            _DECISIONS.clear()
        _DECISIONS[key] = found
    return found


def decide(algo: str, cell: CellSpec, x: torch.Tensor, hidden: int, proj_size: int,
           batch) -> Decision:
    """``choose``'s decision, made afresh (under torch.compile: traced once per graph, guarded
    by the compiler)."""
    dtype = compute_dtype(cell, x)
    path, why = _path(algo, cell, x, hidden, proj_size, batch, dtype)
    return Decision(path, why, dtype, autocast_dtype(x.device.type) is not None)


def _path(algo: str, cell: CellSpec, x: torch.Tensor, hidden: int, proj_size: int, batch,
          dtype: torch.dtype) -> tuple[str, str | None]:
    """``(path, why)`` of ``Decision``: the implementation that runs the layer in ``dtype``."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    blocker = library_blocker(x, dtype)
    if algo != "auto":
        if blocker is not None:
            raise ValueError(f"algo={algo!r} cannot run this layer: {blocker}")
        prepare_capture(x, dtype)
        return algo, None
    blocker = blocker or captured_auto(x)
    if blocker is not None:
        return TORCH, blocker
    if not x.is_cuda:
        if torch.compiler.is_compiling():
            # torch's CPU RNN kernel (oneDNN) fails to compile in training (torch 2.13), and
            # torch.nn graph-breaks on it: the library's GEMM op compiles as one opaque op.
            return "gemm", None
        return TORCH, "CPU tensors: torch's CPU kernels"
    weights = PERSISTENT_DTYPES.get(dtype)
    if weights is None:
        return TORCH, (f"dtype {dtype}: the persistent kernels run float32, float16 and "
                       f"bfloat16; torch's kernels run it")
    size = batch()
    if size <= persistent_batch_limit(cell, hidden, x.device.index or 0, weights, proj_size):
        return "auto", None
    if torch.compiler.is_compiling():  # (last_run is not written for this path while compiled)
        return TORCH, None
    return TORCH, persistent_blocker(cell, hidden, int(size), x.device.index or 0, weights,
                                     proj_size)


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (1.4 s,
    which every ``import persistent_rnn.torch`` paid): that function only sets this marker, which
    dynamo reads when it meets ``fn`` (tests/test_torch_features.py checks the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile  # static arguments: one constant of a compiled graph
def persistent_batch_limit(cell: CellSpec, hidden: int, device_index: int,
                           weights: str = "float32", proj_size: int = 0) -> int:
    """Largest batch for which ``algo="auto"`` runs this CUDA layer (an LSTM projection of
    ``proj_size``, 0: none) in the persistent kernel with W_hh (and W_hr) held in ``weights``
    (0: none): at most ``auto_max_batch``, and the plan must fit without batch groups.
    Under torch.compile the batch (possibly dynamic) is compared with it, which guards the graph
    instead of tracing the planner."""
    return _largest_fitting_batch(cell, hidden, device_index, settings.current().auto_max_batch,
                                  weights, proj_size)


@lru_cache(maxsize=1024)
def _largest_fitting_batch(cell: CellSpec, hidden: int, device_index: int, limit: int,
                           weights: str, proj_size: int) -> int:
    device = _device_profile(device_index)
    for batch in range(limit, 0, -1):
        plan = planner.make_plan(cell, hidden, batch, weights, device, proj_size)
        if plan.fits and not plan.in_batch_groups:
            return batch
    return 0


def persistent_blocker(cell: CellSpec, hidden: int, batch: int, device_index: int,
                       weights: str = "float32", proj_size: int = 0) -> str:
    """Why ``algo="auto"`` does not run this CUDA layer in the persistent kernel."""
    limit = settings.current().auto_max_batch
    if batch > limit:
        return f"batch {batch} > {limit} (auto_max_batch): torch's kernels run it"
    plan = planner.make_plan(cell, hidden, batch, weights, _device_profile(device_index),
                             proj_size)
    if plan.fits:  # (in batch groups: ``persistent_batch_limit``)
        return (f"batch {batch} runs the persistent kernel in batch groups only, predicted "
                f"slower than cuDNN's kernels: torch's kernels run it")
    return f"{plan.reason}; torch's kernels run it"


@lru_cache(maxsize=None)
def _device_profile(device_index: int) -> planner.DeviceProfile:
    import cupy
    with cupy.cuda.Device(device_index):
        return planner.current_device()
