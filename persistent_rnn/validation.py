"""Argument checks for the public API.

Every failure is a ``ValueError`` (wrong value, shape or size) or ``TypeError`` (wrong kind of
object, dtype or device) whose message names the argument, what was expected and what was given.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, Mapping

import numpy as np

from .cells import NONLINEARITIES  # the registry's (re-exported for the layers)

ALGOS = ("auto", "gemm", "persistent")
DTYPES = ("float32", "float64", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")  # computed in fp32, stored (and h_t rounded) in 16 bits

Array = Any


class CallOrderError(RuntimeError, ValueError):
    """``backward`` called without a matching ``forward``, or twice for one forward."""


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` >= 1 (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def choice(name: str, value: Any, options: Iterable[str]) -> str:
    """``value`` if it is one of ``options``."""
    options = tuple(options)
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def dtype_name(name: str, value: Any) -> str:
    """The name of ``value`` (a name, ``numpy.dtype`` or scalar type), one of ``DTYPES``."""
    found = value if isinstance(value, str) else getattr(value, "name", None)
    if found is None and isinstance(value, type):
        found = getattr(value, "__name__", None)  # numpy.float16, ml_dtypes.bfloat16
    if isinstance(found, str) and found not in DTYPES:
        try:  # NumPy's other spellings: "f4", "single", "half", ...
            found = np.dtype(found).name
        except TypeError:
            pass
    if found not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {value!r}")
    return found


def float_dtype(name: str, value: Any) -> np.dtype:
    """``value`` (a name or dtype-like) as a NumPy dtype, one of ``DTYPES``; bfloat16 is
    ``ml_dtypes.bfloat16`` (NumPy has none), imported only when asked for."""
    found = dtype_name(name, value)
    if found != "bfloat16":
        return np.dtype(found)
    try:
        import ml_dtypes
    except ImportError as exc:
        raise ImportError(f"{name}='bfloat16' needs the ml_dtypes package for bfloat16 NumPy "
                          f"arrays (pip install ml_dtypes): {exc}") from exc
    return np.dtype(ml_dtypes.bfloat16)


def common_module(**arrays: Array):
    """The common array module (``numpy`` or ``cupy``) of the named arrays (``None`` skipped).

    ``TypeError`` if one is not an array or NumPy and CuPy arrays are mixed.
    """
    cupy = sys.modules.get("cupy")
    found: dict[str, str] = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            found[name] = "numpy"
        elif cupy is not None and isinstance(a, cupy.ndarray):
            found[name] = "cupy"
        else:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, "
                            f"got {type(a).__module__}.{type(a).__name__}")
    kinds = set(found.values())
    if len(kinds) > 1:
        listing = ", ".join(f"{n}: {k}" for n, k in found.items())
        raise TypeError(f"arrays must all be NumPy or all CuPy (one device), got {listing}")
    return cupy if kinds == {"cupy"} else np


def array(name: str, a: Array, shape: tuple[int | None, ...], dims: str, dtype: np.dtype) -> None:
    """Check ``a``'s rank, sizes (``None`` = any) and dtype; ``dims`` names the axes."""
    if a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape {dims} = ({want}), got {tuple(a.shape)}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype.name} (the layer's dtype), "
                        f"got {_dtype_text(a.dtype)}")


def _dtype_text(dtype: np.dtype) -> str:
    """A dtype's name, with its byte order where that is not the native one (``>f4`` and
    ``<f4`` are both called float32; only one of them is the layer's dtype)."""
    if dtype.byteorder not in "=|" and dtype != dtype.newbyteorder("="):
        order = "big" if dtype.byteorder == ">" else "little"
        return (f"{dtype.name} in {order}-endian byte order ({dtype.str!r}; convert with "
                f".astype({dtype.name!r}))")
    return dtype.name


def has_steps(name: str, a: Array, steps: int, dims: str) -> None:
    """ValueError unless the sequence length ``steps`` of ``a`` is at least 1 (as torch.nn)."""
    if steps < 1:
        raise ValueError(f"{name} must have at least one time step (T >= 1), got shape "
                         f"{tuple(a.shape)} for {dims}")


def lengths(value: Any, batch: int, steps: int, xp) -> Array:
    """Sequence lengths (any integer sequence or array) as int32 on ``xp``, each in 1..steps.

    NumPy lengths are accepted with CuPy data (like torch's CPU lengths); CuPy lengths with
    NumPy data are a ``TypeError``.
    """
    if xp is np and type(value).__module__.startswith("cupy"):
        raise TypeError("lengths must be on the CPU (list or numpy.ndarray) for NumPy inputs, "
                        "got cupy.ndarray")
    host = value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) else value
    host = np.asarray(host)
    if host.size == 0 and not isinstance(value, np.ndarray) and not hasattr(value, "get"):
        host = host.astype(np.int32)  # an empty list (B = 0) holds no non-integer
    if host.dtype.kind not in "iu":
        raise TypeError(f"lengths must hold integers, got dtype {host.dtype.name}")
    if host.shape != (batch,):
        raise ValueError(f"lengths must have shape (batch,) = ({batch},), got {host.shape}")
    if host.size and (host.min() < 1 or host.max() > steps):
        raise ValueError(f"lengths must be in 1..{steps} (the sequence length T), "
                         f"got min {host.min()} and max {host.max()}")
    return xp.asarray(host.astype(np.int32))


def state(name: str, hx: Any, has_cell_state: bool,
          partial: bool = False) -> tuple[Array | None, Array | None]:
    """Split an initial state or its gradient: a single array, or an ``(h, c)`` pair for LSTM.

    ``partial``: whether one array of the pair may be ``None`` (a gradient that is zero, as
    autograd passes ``None``); an initial state is both arrays or ``None``, as in torch.nn.LSTM.
    """
    if hx is None:
        return None, None
    if has_cell_state:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"{name} must be a pair (h, c) of arrays for LSTM, "
                            f"got {type(hx).__name__}")
        missing = [f"{name}[{i}]" for i, a in enumerate(hx) if a is None]
        if missing and not partial:
            raise TypeError(f"{name} must be None or a pair (h0, c0) of two arrays for LSTM "
                            f"(as torch.nn.LSTM), got None for {' and '.join(missing)}")
        return hx[0], hx[1]
    if isinstance(hx, (tuple, list)):
        raise TypeError(f"{name} must be a single array (only LSTM takes a pair), got "
                        f"{type(hx).__name__}")
    return hx, None


def params_mapping(mapping: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Check that ``mapping`` has exactly the ``expected`` names with the expected shapes."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, "
                        f"got {type(mapping).__name__}")
    missing = [k for k in expected if k not in mapping]
    if missing:
        raise ValueError(f"params is missing {missing[0]!r} (expected keys {list(expected)})")
    unknown = [k for k in mapping if k not in expected]
    if unknown:
        raise ValueError(f"params has unknown key {unknown[0]!r} (expected keys {list(expected)})")
    for key, shape in expected.items():
        got = tuple(np.shape(mapping[key]))
        if got != shape:
            raise ValueError(f"params[{key!r}] must have shape {shape}, got {got}")


def param_array(xp, key: str, value: Any, dtype: np.dtype) -> Any:
    """``params[key]``'s ``value`` (any array: NumPy, CuPy, a list) copied onto the array module
    ``xp`` in ``dtype`` (``load_params``); TypeError naming ``params[key]`` where it holds no
    real numbers (complex values would lose their imaginary part; objects such as ``None``
    would become NaN) or does not convert."""
    try:
        if xp is np and not isinstance(value, np.ndarray) and hasattr(value, "get"):
            value = value.get()  # a CuPy array loaded into a layer living on the CPU
        elif not isinstance(value, (np.ndarray, xp.ndarray)):
            value = np.asarray(value)
        if value.dtype.kind not in "biuf" and value.dtype != dtype:
            raise TypeError(f"its dtype {value.dtype} holds no real numbers")
        return xp.array(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"params[{key!r}] cannot be converted to a {np.dtype(dtype).name} "
                        f"array: {exc}") from exc


def proj_size(value: Any, hidden_size: int, has_projection: bool) -> int:
    """``value`` as an LSTM's ``proj_size``: 0 (none) or 0 < P < ``hidden_size``, with
    torch.nn's messages; ``has_projection``: whether the cell can have one (LSTM only)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"proj_size must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError("proj_size should be a positive integer or zero to disable projections")
    if value and not has_projection:
        raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
    if value >= hidden_size:
        raise ValueError(f"proj_size has to be smaller than hidden_size (proj_size={value}, "
                         f"hidden_size={hidden_size})")
    return int(value)
