"""NVRTC build of the ``cuda_src/`` kernels, cached on disk, and the GPU launcher.

Compilation goes through NVRTC's C API (CuPy's low-level binding), which needs neither a GPU nor
a host compiler, so ``kernel_report`` can compile every shipped configuration anywhere. Cubins
and the compiler log (with ptxas' register and spill report) are kept in the verified cache
(``cache``, docs/cache.md) under ``<cache>/nvrtc``, keyed by a hash of the source, every header in
``cuda_src/``, the options, the architecture and the NVRTC version.

``PRNN_LINEINFO=1`` (read when a kernel is built) adds ``-lineinfo``: a line table beside the same
SASS (checked for every cluster kernel of tests/gpu_sanitize_case.py), so that compute-sanitizer
and ``nvdisasm -g`` name the source line of an instruction (bench/racecheck.py needs it).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from . import cache, hardware
from ._sources import cuda_src_dir
from .plan import WARP, register_cap

_LOCK = threading.Lock()
MIN_ARCH = 80  # the kernels use cp.async and other sm_80 instructions
LINEINFO_ENV = "PRNN_LINEINFO"
_LOADED: list[Path] = []  # the cubin of every module loaded in this process, in load order


@dataclass(frozen=True)
class Compiled:
    """A compiled kernel source: the cubin file and NVRTC's log (ptxas -v output included)."""

    cubin_path: Path
    log: str


def compile_options(defines: Mapping[str, int], arch: str, src_dir: Path | None = None,
                    lineinfo: bool = False) -> list[str]:
    """NVRTC options for ``defines`` on ``arch`` ("sm_90"), headers from ``src_dir`` (default:
    the package's ``cuda_src``); ``lineinfo`` adds ``-lineinfo`` (source lines, same code).

    A persistent-kernel configuration (``PRNN_WARPS`` defined) is compiled with the register cap
    that lets one CTA of its block size fit an SM, so ptxas must keep the weights within it.
    """
    options = [f"-arch={arch}", f"-I{src_dir or cuda_src_dir()}", "--std=c++17", "-Xptxas=-v"]
    if lineinfo:
        options.append("-lineinfo")
    if "PRNN_WARPS" in defines:
        options.append(f"--maxrregcount={register_cap(WARP * int(defines['PRNN_WARPS']))}")
    options += [f"-D{name}={int(value)}" for name, value in sorted(defines.items())]
    return options


def _headers_digest(src_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(src_dir.iterdir()):
        if path.suffix in (".cuh", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compile_source(source: str, defines: Mapping[str, int], arch: str,
                   src_dir: Path | None = None) -> Compiled:
    """Compile ``cuda_src/<source>`` with ``defines`` for ``arch`` to a cubin (cached on disk).

    ``src_dir``: another directory of the same sources (an earlier commit's ``cuda_src``, for
    ``bench/model_calibration.py``); the cache key covers its text and headers. ``source`` may
    also be the absolute path of a kernel outside it (the tests' own kernels, tests/cuda), which
    includes its headers.

    A cached cubin is returned only after its digest matches the one recorded when it was built;
    a missing or damaged one is compiled again. Raises ValueError for an ``arch`` the kernels
    cannot be compiled for here, RuntimeError with NVRTC's full log when the compilation fails,
    and cache.CacheError when the cache directory is not private. With ``PRNN_LINEINFO=1`` in
    the environment the cubin carries a line table (``compile_options``).
    """
    from cupy_backends.cuda.libs import nvrtc

    check_arch(arch)
    src_dir = src_dir or cuda_src_dir()
    text = (src_dir / source).read_text()
    options = compile_options(defines, arch, src_dir, lineinfo_requested())
    key = hashlib.sha256("\0".join([text, _headers_digest(src_dir), *options, str(nvrtc.getVersion())])
                         .encode()).hexdigest()[:32]
    entry = cache.fetch(cache.cache_dir("nvrtc"), key, ".cubin",
                        lambda path: {"log": _compile(text, source, options, path)})
    return Compiled(entry.path, entry.meta["log"])


def lineinfo_requested() -> bool:
    """Whether ``PRNN_LINEINFO`` asks for line tables ("1"; unset, "" or "0": no)."""
    value = os.environ.get(LINEINFO_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{LINEINFO_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def loaded_cubins() -> list[Path]:
    """The cubin of every module this process has loaded on the GPU, in load order: what a
    compute-sanitizer report's ``kernel+offset`` refers to (bench/racecheck.py)."""
    return list(_LOADED)


def check_arch(arch: str) -> None:
    """ValueError unless ``arch`` is ``sm_XY`` with XY >= ``MIN_ARCH`` and known to this NVRTC."""
    from cupy_backends.cuda.libs import nvrtc

    usable = [a for a in nvrtc.getSupportedArchs() if a >= MIN_ARCH]
    match = re.fullmatch(r"sm_(\d+)", arch)
    if match is None or int(match.group(1)) not in usable:
        major, minor = nvrtc.getVersion()
        raise ValueError(f"arch {arch!r}: the kernels need sm_{MIN_ARCH} or newer, and NVRTC "
                         f"{major}.{minor} builds them for "
                         f"{', '.join(f'sm_{a}' for a in usable)}")


def _compile(text: str, source: str, options: list[str], out: Path) -> str:
    """Compile ``text`` to the cubin ``out``; NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(text, source, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed to compile {source} with {options}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        out.write_bytes(_cubin_image(prog))
        return nvrtc.getProgramLog(prog).rstrip("\0")
    finally:
        nvrtc.destroyProgram(prog)


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


# CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h): without it, neither a launch nor
# the occupancy query accepts a cluster of more than 8 CTAs.
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class GpuModule:
    """A compiled source loaded on the current GPU; ``launch`` mirrors the emulated module's."""

    def __init__(self, compiled: Compiled, cooperative: bool = False, cluster_ctas: int = 0):
        import cupy
        self._module = cupy.RawModule(path=str(compiled.cubin_path),
                                      enable_cooperative_groups=cooperative)
        self._kernels: dict[str, Any] = {}
        self._cluster_ctas = cluster_ctas

    def function(self, kernel: str, shared_bytes: int = 0):
        """The CuPy kernel ``kernel``, allowed ``shared_bytes`` of dynamic shared memory (and a
        cluster shape above the portable size, where it was compiled with one)."""
        fn = self._kernels.get(kernel)
        if fn is None:
            fn = self._kernels[kernel] = self._module.get_function(kernel)
            if self._cluster_ctas > hardware.PORTABLE_CLUSTER_CTAS:
                from cupy_backends.cuda.api import driver
                driver.funcSetAttribute(fn.kernel.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        if shared_bytes > fn.max_dynamic_shared_size_bytes:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        return fn

    def max_active_blocks(self, kernel: str, block: int, shared_bytes: int) -> int:
        """CTAs of this kernel that fit one SM at once (CUDA's occupancy calculator)."""
        from cupy_backends.cuda.api import driver
        fn = self.function(kernel, shared_bytes)
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, block, shared_bytes)

    def max_active_clusters(self, kernel: str, grid: int, block: int, shared_bytes: int) -> int:
        """Clusters of this kernel (built with a cluster shape of ``grid`` CTAs) that the device
        can hold at once (``cuOccupancyMaxActiveClusters``; 0: none fits)."""
        fn = self.function(kernel, shared_bytes)
        return max_active_clusters(fn.kernel.ptr, grid, block, shared_bytes)

    def launch(self, kernel: str, grid: int, block: int, shared_bytes: int, args: tuple) -> None:
        """Launch ``kernel`` on the current stream (asynchronous)."""
        self.function(kernel, shared_bytes)((grid,), (block,), args, shared_mem=shared_bytes)


class LaunchConfig(ctypes.Structure):
    """The driver API's ``CUlaunchConfig`` (cuda.h): grid, block, dynamic shared memory, stream,
    launch attributes."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def max_active_clusters(function: int, grid: int, block: int, shared_bytes: int) -> int:
    """``cuOccupancyMaxActiveClusters`` for the CUfunction ``function`` launched as one cluster
    of ``grid`` CTAs (its compiled-in cluster shape; no launch attributes). CuPy's driver
    bindings lack it, so it is called through ctypes on the driver library CuPy has loaded."""
    lib = ctypes.CDLL("libcuda.so.1")
    config = LaunchConfig((grid, 1, 1), (block, 1, 1), shared_bytes, None, None, 0)
    count = ctypes.c_int()
    status = lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(function),
                                              ctypes.byref(config))
    if status:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed (CUresult {status})")
    return count.value


def get_module(source: str, defines: Mapping[str, int], cooperative: bool = False) -> GpuModule:
    """The GPU module of ``cuda_src/<source>`` (or of a kernel at an absolute path that includes
    cuda_src's headers) built with ``defines`` for the current device."""
    return _module(source, tuple(sorted((k, int(v)) for k, v in defines.items())), device_arch(),
                   cooperative, _device_id())


def _device_id() -> int:
    import cupy
    return cupy.cuda.Device().id


@lru_cache(maxsize=None)
def _module(source: str, defines: tuple, arch: str, cooperative: bool, device: int) -> GpuModule:
    with _LOCK:
        compiled = compile_source(source, dict(defines), arch)
        module = GpuModule(compiled, cooperative, dict(defines).get("PRNN_CLUSTER", 0))
        _LOADED.append(compiled.cubin_path)
        return module
