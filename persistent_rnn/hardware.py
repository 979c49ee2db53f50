"""The GPU limits the planner sizes the persistent kernels by: one table, no GPU needed.

``WARP`` .. ``MAX_REGISTERS_PER_THREAD`` hold on every supported architecture (sm_80, sm_90);
``PROFILES`` are the named devices the planner and the CPU emulation plan for; ``current_device``
reads the same fields from the current CuPy device. Figures from NVIDIA's CUDA C++ Programming
Guide (compute capability tables) and the A100/H100 whitepapers.
"""
from __future__ import annotations

from dataclasses import dataclass

WARP = 32
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated to a warp in units of 256
SUB_PARTITIONS = 4  # an SM's register file is split among 4 schedulers; a warp lives in one
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536  # every supported GPU; the shipped tiles are sized for it
# Bytes per weight of the dtypes the persistent kernels hold W_hh in: fp32 one weight per 32-bit
# register, 16-bit a packed pair of adjacent columns per register (persistent_common.cuh).
WEIGHT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Most registers of weights one thread of a shipped tile holds (8 warps at the 255 cap): the rest
# (accumulators, staged values, 16-bit conversions, addresses) must fit beside them. ptxas kept
# every shipped tile within it with zero spills on sm_80 and sm_90 (fp32: 190-200, 16-bit: 180-196).
WEIGHT_REGISTER_BUDGET = 200
DEFAULT_FP32_LANES = 128  # FP32 FMA lanes per SM (sm_86, sm_89, sm_90)
FP32_LANES = {(8, 0): 64}  # where it differs, by compute capability (A100: 64)


def fp32_lanes_per_sm(major: int, minor: int) -> int:
    """FP32 FMA lanes per SM of a compute capability (the fp32 peak's per-SM width)."""
    return FP32_LANES.get((major, minor), DEFAULT_FP32_LANES)


@dataclass(frozen=True)
class DeviceProfile:
    """The device properties the planner needs."""

    name: str
    sm_count: int
    registers_per_sm: int = REGISTERS_PER_SM
    max_registers_per_thread: int = MAX_REGISTERS_PER_THREAD
    shared_per_block: int = 232448  # opt-in maximum of dynamic shared memory per block (sm_90)
    shared_per_sm: int = 233472
    max_threads_per_block: int = 1024
    arch: str = "sm_90"


PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", 132),
    "h200": DeviceProfile("h200", 132),
    "a100": DeviceProfile("a100", 108, shared_per_block=166912, shared_per_sm=167936, arch="sm_80"),
}


def current_device() -> DeviceProfile:
    """The profile of the current CuPy device (RuntimeError where there is no GPU or no CuPy)."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"CuPy is not installed ({exc}); pass device='h100' etc.") from exc
    try:
        dev = cupy.cuda.Device()
        attrs = dev.attributes
    except RuntimeError as exc:  # CuPy's CUDARuntimeError: no driver or no GPU
        raise RuntimeError(f"no CUDA device available to plan for ({exc}); pass device='h100' etc.") from exc
    return DeviceProfile(
        name=f"cuda:{dev.id}", sm_count=attrs["MultiProcessorCount"],
        registers_per_sm=attrs["MaxRegistersPerMultiprocessor"],
        shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
        shared_per_sm=attrs["MaxSharedMemoryPerMultiprocessor"],
        max_threads_per_block=attrs["MaxThreadsPerBlock"], arch=f"sm_{dev.compute_capability}")
