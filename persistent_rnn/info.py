"""``prnn info``: the GPU (through NVML and CuPy), its fp32 peak and what the persistent kernel fits.

Without a GPU the report says why (CuPy is not installed or does not import; NVML or CUDA cannot
initialise, or there is no device) and lists the planner's named device profiles (h100, h200,
a100) instead; it never raises for a missing GPU.

The fp32 peak is ``SMs x max SM clock x FP32 lanes per SM x 2`` (an FMA counts two FLOPs): 128
lanes per SM on every supported architecture except sm_80 (A100: 64). The clock is NVML's maximum
SM clock (CuPy's ``ClockRate`` attribute where NVML does not report one).
"""
from __future__ import annotations

from typing import Any

from . import plan
from .cells import FAMILY_CELLS
from .extras import install_hint
from .hardware import fp32_lanes_per_sm
DTYPES = ("float32", "float16", "bfloat16")


def fp32_peak_tflops(sm_count: int, clock_mhz: float, major: int, minor: int) -> float:
    """Device fp32 peak in TFLOP/s: ``SMs x clock x lanes x 2`` (see the module docstring)."""
    return sm_count * clock_mhz * 1e6 * fp32_lanes_per_sm(major, minor) * 2 / 1e12


def max_hidden_table(device: plan.DeviceProfile | str | None) -> dict[str, dict[str, int]]:
    """``max_hidden_size`` per cell and dtype on ``device`` (0: the persistent kernel does not run
    it): one cell per family of tiles (``cells.FAMILY_CELLS``; the others plan as their family's
    first)."""
    return {cell: {dt: plan.max_hidden_size(cell, dt, device) for dt in DTYPES}
            for cell in FAMILY_CELLS}


def _nvml_device(pynvml, index: int) -> dict[str, Any]:
    """NVML's view of device ``index``: name, memory, clocks and the processes using it."""
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    procs = []
    for query in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            procs += [{"pid": p.pid, "used_memory_bytes": p.usedGpuMemory} for p in query(h)]
        except pynvml.NVMLError:  # not supported on this device/driver: report what is known
            pass
    name = pynvml.nvmlDeviceGetName(h)
    return {
        "index": index,
        "name": name.decode() if isinstance(name, bytes) else name,
        "memory_total_bytes": mem.total,
        "memory_used_bytes": mem.used,
        "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
        "max_memory_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
        "other_processes": procs,
    }


def _cupy_device(index: int) -> dict[str, Any]:
    """CuPy's device attributes the planner and the peak formula need."""
    import cupy
    dev = cupy.cuda.Device(index)
    attrs = dev.attributes
    major, minor = divmod(int(dev.compute_capability), 10)  # CuPy gives e.g. "90" for sm_90
    return {
        "compute_capability": f"{major}.{minor}",
        "sm_count": attrs["MultiProcessorCount"],
        "registers_per_sm": attrs["MaxRegistersPerMultiprocessor"],
        "shared_per_block_optin_bytes": attrs["MaxSharedMemoryPerBlockOptin"],
        "clock_mhz_cuda": attrs.get("ClockRate", 0) / 1000.0,  # kHz; absent from newer CUDA
        "fp32_lanes_per_sm": fp32_lanes_per_sm(major, minor),
    }


def gpu_info(index: int = 0) -> dict[str, Any]:
    """Device ``index`` with driver/CUDA versions and fp32 peak; raises where there is no GPU."""
    import cupy
    import pynvml
    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() <= index:
            raise RuntimeError(f"NVML sees {pynvml.nvmlDeviceGetCount()} devices, no device {index}")
        dev = _nvml_device(pynvml, index)
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda_driver = pynvml.nvmlSystemGetCudaDriverVersion_v2()
    finally:
        pynvml.nvmlShutdown()
    dev.update(_cupy_device(index))
    clock = dev["max_sm_clock_mhz"] or dev["clock_mhz_cuda"]
    major, minor = (int(c) for c in dev["compute_capability"].split("."))
    dev["fp32_peak_tflops"] = fp32_peak_tflops(dev["sm_count"], clock, major, minor)
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    return {
        "device": dev,
        "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
        "cuda_driver_version": f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}",
        "cuda_runtime_version": f"{runtime // 1000}.{runtime % 1000 // 10}",
    }


def collect() -> dict[str, Any]:
    """The ``prnn info`` report: the GPU, or why there is none plus the named planner profiles."""
    import pynvml

    from . import __version__
    report: dict[str, Any] = {"persistent_rnn_version": __version__}
    try:
        import cupy  # noqa: F401  (only whether it imports)
    except ImportError as exc:
        return _without_gpu(report, _cupy_missing(exc))
    try:
        report.update(gpu_info())
    # No NVML library or driver; no CUDA driver or device (CuPy's CUDA errors are RuntimeErrors).
    except (pynvml.NVMLError, RuntimeError) as exc:
        return _without_gpu(report, f"no GPU: {type(exc).__name__}: {exc}")
    report["gpu"] = True
    report["max_hidden_size"] = max_hidden_table(plan.current_device())
    return report


def _cupy_missing(exc: ImportError) -> str:
    """Why there is no GPU when CuPy does not import."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
        return f"CuPy is not installed, so no GPU is used: {install_hint('cuda13')}"
    return f"CuPy is installed but does not import ({type(exc).__name__}: {exc}), so no GPU is used"


def _without_gpu(report: dict[str, Any], reason: str) -> dict[str, Any]:
    """``report`` for a machine without a usable GPU: ``reason`` and the planner profiles."""
    report.update(gpu=False, reason=reason)
    report["profiles"] = {
        name: {"sm_count": p.sm_count, "registers_per_sm": p.registers_per_sm, "arch": p.arch,
               "max_hidden_size": max_hidden_table(p)}
        for name, p in plan.PROFILES.items()}
    return report


def _hidden_lines(table: dict[str, dict[str, int]], indent: str) -> list[str]:
    """One line per dtype: the largest hidden size of each cell."""
    return [f"{indent}max_hidden_size {dt}: " + ", ".join(f"{cell} {row[dt]}" for cell, row in table.items())
            for dt in DTYPES]


def format_text(report: dict[str, Any]) -> str:
    """Human-readable form of ``collect()``'s report."""
    lines = [f"persistent_rnn {report['persistent_rnn_version']}"]
    if report["gpu"]:
        d = report["device"]
        lines += [
            f"GPU {d['index']}: {d['name']} (compute capability {d['compute_capability']})",
            f"  SMs {d['sm_count']}, registers/SM {d['registers_per_sm']}, "
            f"shared/block (opt-in) {d['shared_per_block_optin_bytes']} B",
            f"  SM clock {d['sm_clock_mhz']} MHz (max {d['max_sm_clock_mhz']}), memory clock max "
            f"{d['max_memory_clock_mhz']} MHz, memory {d['memory_used_bytes'] / 2**30:.1f} / "
            f"{d['memory_total_bytes'] / 2**30:.1f} GiB used",
            f"  fp32 peak {d['fp32_peak_tflops']:.1f} TFLOP/s "
            f"(SMs x max clock x {d['fp32_lanes_per_sm']} lanes x 2)",
            f"  other processes on the GPU: "
            + (", ".join(f"pid {p['pid']}" for p in d["other_processes"]) or "none"),
            f"driver {report['driver_version']}, CUDA driver {report['cuda_driver_version']}, "
            f"CUDA runtime {report['cuda_runtime_version']}",
        ]
        lines += _hidden_lines(report["max_hidden_size"], "  ")
    else:
        lines.append(report["reason"])
        lines.append("planner profiles (0: the persistent kernel does not run that dtype):")
        for name, p in report["profiles"].items():
            lines.append(f"  {name}: {p['sm_count']} SMs, {p['registers_per_sm']} registers/SM, {p['arch']}")
            lines += _hidden_lines(p["max_hidden_size"], "    ")
    return "\n".join(lines)
