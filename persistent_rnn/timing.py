"""Timing of a callable: warm-up, then the median of repetitions rotating among input sets.

On a GPU the clock is a pair of CUDA events around each repetition on the current (legacy default)
stream, which torch's default stream shares, so CuPy and torch work are timed alike; on the CPU it is
``time.perf_counter``. Rotating the inputs keeps one input set from sitting in cache across repetitions.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Protocol, Sequence


class Clock(Protocol):
    """Measures the seconds one call of ``fn`` takes."""

    name: str

    def measure(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn()`` took."""


class CpuClock:
    """Wall-clock time with ``time.perf_counter``."""

    name = "perf_counter"

    def measure(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn()`` took on the host."""
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class CudaEventClock:
    """GPU time between two CUDA events recorded on the current stream around the call."""

    name = "cuda_events"

    def __init__(self) -> None:
        import cupy
        self._cupy = cupy

    def measure(self, fn: Callable[[], Any]) -> float:
        """Seconds between events before and after ``fn()``'s work on the current stream."""
        start, end = self._cupy.cuda.Event(), self._cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return self._cupy.cuda.get_elapsed_time(start, end) / 1e3


def sample_seconds(fn: Callable[[Any], Any], inputs: Sequence[Any], repeats: int, warmup: int,
                   clock: Clock) -> list[float]:
    """Seconds of each of ``repeats`` calls ``fn(inputs[i % len(inputs)])`` after ``warmup`` calls."""
    if repeats < 1 or warmup < 0 or not inputs:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and inputs, got {repeats}, {warmup}, {len(inputs)}")
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    return [clock.measure(lambda i=i: fn(inputs[i % len(inputs)])) for i in range(repeats)]


def median_seconds(fn: Callable[[Any], Any], inputs: Sequence[Any], repeats: int, warmup: int,
                   clock: Clock) -> float:
    """Median of ``sample_seconds``."""
    return statistics.median(sample_seconds(fn, inputs, repeats, warmup, clock))


def spread(samples: Sequence[float]) -> float:
    """(slowest - fastest) / median of ``samples``: how far apart repeats of one thing fall, the
    noise under which two figures cannot be told apart."""
    middle = statistics.median(samples)
    return (max(samples) - min(samples)) / middle if middle > 0 else 0.0
