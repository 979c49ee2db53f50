"""The timing of the first GPU call (bench/first_call.py): every algorithm side by side.

Each timing layer (``first_cases.TIMING``) at T = 100 and T = 300, forward and
forward+backward, with the persistent kernel and the GEMM path (CuPy layers), the drop-in
``persistent_rnn.torch`` module (algo="persistent") and torch.nn (cuDNN), in one process:
``persistent_rnn.benchmark.measure_point`` (CUDA events, the median of the repeats after warm-up,
rotating three input sets; restarts and fallback over every call). The per-step slope
``(t(300) - t(100)) / 200`` is the recurrence's own cost per step, the intercept the per-call
cost (input projection, host work, launches); ``first_report`` sets both beside the model.
Step ``time_tf32`` (``tf32=True``) times ``first_cases.TF32_TIMING`` so, with ``allow_tf32`` on
for the process (its predictions follow the setting: ``runtime.planning_device``).
"""
from __future__ import annotations

from typing import Iterator

from first_cases import (CPU_SEQ_LENS, CPU_TIMING, SEQ_LENS, TF32_ALGOS, TF32_TIMING, TIMING,
                         TIMING_ALGOS, TimingConfig)
from first_checks import configured

from persistent_rnn import benchmark

GPU_REPEATS, GPU_WARMUP = 15, 3
CPU_REPEATS, CPU_WARMUP = 1, 0


def points(cpu: bool, tf32: bool = False) -> Iterator[tuple[TimingConfig, int, str, str]]:
    """(config, T, pass, algo) in the order they are measured: the headline layer first. The
    ``--cpu`` check times ``CPU_TIMING`` only (the fp32 grid headline and the 16-bit one; the
    others repeat the same code at the tiny sizes). ``tf32``: ``TF32_TIMING`` by ``TF32_ALGOS``."""
    configs, algos = ((TF32_TIMING,), TF32_ALGOS) if tf32 else (
        CPU_TIMING if cpu else TIMING, TIMING_ALGOS)
    for config in configs:
        for seq_len in (CPU_SEQ_LENS if cpu else SEQ_LENS):
            for pass_ in benchmark.PASSES:
                for algo in algos:
                    yield config.sized(cpu), seq_len, pass_, algo


def point_key(config: TimingConfig, seq_len: int, pass_: str, algo: str) -> str:
    """The name a point is recorded (and resumed) under."""
    return f"{config.name}/T{seq_len}/{pass_}/{algo}"


def measure(config: TimingConfig, seq_len: int, pass_: str, algo: str, cpu: bool) -> dict:
    """One point: its ``persistent_rnn.benchmark`` record (µs per step, restarts, fallback, the
    model's per-call-included prediction at this T), and whether it ran cleanly."""
    sweep = benchmark.Sweep(cells=(config.cell,), hidden_sizes=(config.hidden,),
                            seq_lens=(seq_len,), batches=(config.batch,), passes=(pass_,),
                            algos=(algo,), dtype=config.dtype, input_size=config.input_size,
                        repeats=CPU_REPEATS if cpu else GPU_REPEATS,
                        warmup=CPU_WARMUP if cpu else GPU_WARMUP)
    with configured(config.settings, None, cpu):
        point = benchmark.measure_point(sweep, config.cell, pass_, algo, config.batch,
                                        config.hidden, seq_len, gpu=not cpu,
                                        peak_tflops=None).to_json()
    problems = []
    if algo != "cudnn" and (point["restarts"] or point["fallback"]):
        problems.append(f"restarts {point['restarts']}, fallback {point['fallback']} over "
                        f"{point['passes_checked']} passes")
    return {"config": config.name, "input_size": config.input_size, "settings": config.settings,
            **point,
            "call_us": point["us_per_step"] * seq_len, "problems": problems, "ok": not problems}
