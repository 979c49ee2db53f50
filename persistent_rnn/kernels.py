"""NVRTC build of the ``cuda_src/`` kernels, cached on disk, and the GPU launcher.

Compilation goes through NVRTC's C API (CuPy's low-level binding), which needs neither a GPU nor
a host compiler, so ``kernel_report`` can compile every shipped configuration anywhere. Cubins
and the compiler log (with ptxas' register and spill report) are cached under
``$PRNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/persistent_rnn``, else ``~/.cache/persistent_rnn``
(created with mode 0o700), keyed by a hash of the source, every header in ``cuda_src/``, the
options, the architecture and the NVRTC version.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ._sources import cuda_src_dir, read_source
from .plan import WARP, register_cap

_LOCK = threading.Lock()
# Part of every cache key: bumped when what is cached changes meaning (v2: whole cubin images;
# v1 stored them one byte short).
_CACHE_FORMAT = "v2"


@dataclass(frozen=True)
class Compiled:
    """A compiled kernel source: the cubin file and NVRTC's log (ptxas -v output included)."""

    cubin_path: Path
    log: str


def cache_dir() -> Path:
    """The on-disk cache directory (created, mode 0o700)."""
    root = os.environ.get("PRNN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "persistent_rnn")
    path = Path(root)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def compile_options(defines: Mapping[str, int], arch: str) -> list[str]:
    """NVRTC options for ``defines`` on ``arch`` ("sm_90").

    A persistent-kernel configuration (``PRNN_WARPS`` defined) is compiled with the register cap
    that lets one CTA of its block size fit an SM, so ptxas must keep the weights within it.
    """
    options = [f"-arch={arch}", f"-I{cuda_src_dir()}", "--std=c++17", "-Xptxas=-v"]
    if "PRNN_WARPS" in defines:
        options.append(f"--maxrregcount={register_cap(WARP * int(defines['PRNN_WARPS']))}")
    options += [f"-D{name}={int(value)}" for name, value in sorted(defines.items())]
    return options


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(cuda_src_dir().iterdir()):
        if path.suffix in (".cuh", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compile_source(source: str, defines: Mapping[str, int], arch: str) -> Compiled:
    """Compile ``cuda_src/<source>`` with ``defines`` for ``arch`` to a cubin (cached on disk).

    Raises RuntimeError with NVRTC's full log when the compilation fails.
    """
    from cupy_backends.cuda.libs import nvrtc

    text = read_source(source)
    options = compile_options(defines, arch)
    key = hashlib.sha256("\0".join([_CACHE_FORMAT, text, _headers_digest(), *options,
                                   str(nvrtc.getVersion())]).encode()).hexdigest()[:32]
    folder = cache_dir()
    cubin_path, log_path = folder / f"{key}.cubin", folder / f"{key}.log"
    if cubin_path.is_file() and log_path.is_file():
        return Compiled(cubin_path, log_path.read_text())
    prog = nvrtc.createProgram(text, source, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed to compile {source} with {options}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        log, cubin = nvrtc.getProgramLog(prog).rstrip("\0"), _cubin_image(prog)
    finally:
        nvrtc.destroyProgram(prog)
    # Write-then-rename so that concurrent processes never read a partial file.
    for path, data in ((cubin_path, cubin), (log_path, log.encode())):
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return Compiled(cubin_path, log)


def _cubin_image(prog: int) -> bytes:
    """The whole cubin of the compiled NVRTC program ``prog``.

    CuPy's ``nvrtc.getCUBIN`` drops the image's last byte (it treats it as a NUL-terminated
    string), which leaves an ELF that cuobjdump and nvdisasm reject; so the image is read through
    NVRTC's C API, from the library CuPy has already loaded (matched by its soname).
    """
    from cupy_backends.cuda.libs import nvrtc

    lib = ctypes.CDLL(f"libnvrtc.so.{nvrtc.getVersion()[0]}")
    handle, size = ctypes.c_void_p(prog), ctypes.c_size_t()
    status = lib.nvrtcGetCUBINSize(handle, ctypes.byref(size))
    image = ctypes.create_string_buffer(size.value)
    status = status or lib.nvrtcGetCUBIN(handle, image)
    if status:
        raise RuntimeError(f"NVRTC could not return the cubin (nvrtcResult {status})")
    return image.raw


def device_arch() -> str:
    """``sm_XY`` of the current CuPy device."""
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"


class GpuModule:
    """A compiled source loaded on the current GPU; ``launch`` mirrors the emulated module's."""

    def __init__(self, compiled: Compiled, cooperative: bool = False):
        import cupy
        self._module = cupy.RawModule(path=str(compiled.cubin_path),
                                      enable_cooperative_groups=cooperative)
        self._kernels: dict[str, Any] = {}

    def function(self, kernel: str, shared_bytes: int = 0):
        """The CuPy kernel ``kernel``, allowed ``shared_bytes`` of dynamic shared memory."""
        fn = self._kernels.get(kernel)
        if fn is None:
            fn = self._kernels[kernel] = self._module.get_function(kernel)
        if shared_bytes > fn.max_dynamic_shared_size_bytes:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        return fn

    def max_active_blocks(self, kernel: str, block: int, shared_bytes: int) -> int:
        """CTAs of this kernel that fit one SM at once (CUDA's occupancy calculator)."""
        from cupy_backends.cuda.api import driver
        fn = self.function(kernel, shared_bytes)
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, block, shared_bytes)

    def launch(self, kernel: str, grid: int, block: int, shared_bytes: int, args: tuple) -> None:
        """Launch ``kernel`` on the current stream (asynchronous)."""
        self.function(kernel, shared_bytes)((grid,), (block,), args, shared_mem=shared_bytes)


def get_module(source: str, defines: Mapping[str, int], cooperative: bool = False) -> GpuModule:
    """The GPU module of ``cuda_src/<source>`` built with ``defines`` for the current device."""
    return _module(source, tuple(sorted((k, int(v)) for k, v in defines.items())), device_arch(),
                   cooperative, _device_id())


def _device_id() -> int:
    import cupy
    return cupy.cuda.Device().id


@lru_cache(maxsize=None)
def _module(source: str, defines: tuple, arch: str, cooperative: bool, device: int) -> GpuModule:
    with _LOCK:
        return GpuModule(compile_source(source, dict(defines), arch), cooperative)
