"""The first call on a lent GPU, step by step (bench/run_gpu_suite.sh, part ``first``).

    python bench/first_call.py STEP --out DIR [--cpu] [--group fp32|tf32|struct|half]

Steps, each run by the suite under its own time limit, in the order of what matters first:

* ``env``      versions (Python, torch, CuPy, NumPy, NVRTC, CUDA, cuDNN), tools (nvidia-smi,
               nvdisasm - also triton's copy -, compute-sanitizer), the GPU, the commit
* ``predict``  the latency model's prediction of every layer the call runs, in parallel
               processes (each compiles its kernels with NVRTC: the later steps find them built)
* ``correct``  ``--group``: ``first_checks.check_case`` of each case of the group
* ``stall``    ``first_checks.check_stall`` of each stall case
* ``time``     ``first_timing.measure`` of each point
* ``time_tf32`` the same of the TF32 points (``first_cases.TF32_TIMING``, ``allow_tf32`` on)
* ``report``   ``first_report``: first_summary.json and the tables (first_summary.txt)

Every record is a JSON line carrying ``device``, ``date``, ``commit`` (``PRNN_COMMIT``),
``nvrtc`` and ``command``. The item steps (correct, stall, time) write a ``start`` line before
each item and its result after it; a watchdog ends the process with status 75 when an item runs
past its own limit, after recording it as ``hung`` with every thread's stack; run again, the
step skips what finished, records an item that started and never finished (the step was
killed in it) as hung, and goes on with the rest. Exit status: 0 all ok, 1 something failed,
75 an item hung (the suite runs the step again while its time lasts).

``--cpu``: the harness on a machine without a GPU - CPU tensors and NumPy arrays, the kernels'
CPU emulation, tiny sizes, predictions on the h100 profile. Its figures mean nothing. With
``PRNN_FIRST_CPU_SAMPLE=1`` the correctness steps run ``first_cases.CPU_SAMPLE`` only (the test
suite's check of the harness; before a GPU slot the whole ``--cpu`` check runs).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import traceback
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import first_cases
import first_checks
import first_report
import first_timing

from persistent_rnn import benchmark

FILES = {"correct": "correct.jsonl", "stall": "stall.jsonl", "time": "time.jsonl",
         "time_tf32": "time_tf32.jsonl", "predict": "predict.jsonl", "env": "env.json"}
ITEM_LIMIT_S = {"correct": 40, "stall": 30, "time": 40, "time_tf32": 40}  # per item on a GPU
CPU_ITEM_LIMIT_S = 240  # the emulation builds a kernel on first use (minutes on a busy machine)
HUNG_EXIT = 75  # EX_TEMPFAIL: not 3, which compute-sanitizer and others use
SAMPLE = "PRNN_FIRST_CPU_SAMPLE"  # set: the --cpu correctness steps run first_cases.CPU_SAMPLE


def device_name(cpu: bool) -> str:
    """The GPU's name, or ``"cpu (emulation)"``."""
    if cpu:
        return "cpu (emulation)"
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


class Journal:
    """A JSON-lines file of stamped records, each written and flushed at once (a killed step
    keeps what it finished)."""

    def __init__(self, path: Path, stamp: dict[str, Any]):
        self.path, self.stamp = path, stamp

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` with the stamp and the time."""
        line = json.dumps({**self.stamp, "t": time.strftime("%H:%M:%S"), **record}, default=str)
        with self.path.open("a") as f:
            f.write(line + "\n")

    def read(self) -> list[dict]:
        """Every record written so far (a torn last line is skipped)."""
        return first_report.read_jsonl(self.path)


def run_items(journal: Journal, items: Iterable[tuple[str, Callable[[], dict]]],
              limit_s: float) -> int:
    """Run each (name, fn) not finished before, under a watchdog of ``limit_s`` each; record
    ``start`` and the result. The exit status of the step (see the module docstring)."""
    rows = journal.read()
    finished = {r["name"] for r in rows if r.get("phase") == "done"}
    for name in [r["name"] for r in rows if r.get("phase") == "start"]:
        if name not in finished:  # the step was killed while it ran: a hang, or far too slow
            journal.write({"name": name, "phase": "done", "ok": False, "hung": True,
                           "problems": ["killed by the step's time limit while running"]})
            finished.add(name)
            print(f"{name}: HUNG (the step was killed while it ran)", flush=True)
    failed = 0
    for name, fn in items:
        if name in finished:
            continue
        journal.write({"name": name, "phase": "start"})
        watchdog = threading.Timer(limit_s, _hung, (journal, name, limit_s))
        watchdog.daemon = True
        watchdog.start()
        t0 = time.perf_counter()
        try:
            record = fn()
        except Exception as exc:  # noqa: BLE001 - any failure is the item's result
            record = {"ok": False, "problems": [f"raised {type(exc).__name__}: {str(exc)[:500]}"],
                      "traceback": traceback.format_exc()[-2500:]}
        watchdog.cancel()
        record = {"name": name, "phase": "done", "seconds": round(time.perf_counter() - t0, 2),
                  **record}
        journal.write(record)
        failed += not record["ok"]
        print(first_report.item_line(record), flush=True)
    return 1 if failed else 0


def _hung(journal: Journal, name: str, limit_s: float) -> None:
    """The watchdog's end of a process whose item hangs: record it, dump the stacks, exit 75."""
    journal.write({"name": name, "phase": "done", "ok": False, "hung": True,
                   "problems": [f"hung: still running after {limit_s:g} s (watchdog)"]})
    print(f"{name}: HUNG after {limit_s:g} s; the stacks:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(HUNG_EXIT)


def _tools() -> dict[str, str | None]:
    found = {t: shutil.which(t) for t in ("nvidia-smi", "nvcc", "nvdisasm", "cuobjdump",
                                          "compute-sanitizer", "g++")}
    try:
        import triton
        folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        found["triton nvdisasm"] = str(folder / "nvdisasm") if (folder / "nvdisasm").exists() else None
    except ImportError:
        found["triton nvdisasm"] = None
    try:  # the one the latency model runs (PATH, else the nvidia-cuda-nvdisasm wheel)
        from persistent_rnn import sass_analysis
        found["model nvdisasm"] = sass_analysis.nvdisasm()
    except (ImportError, AttributeError):
        found["model nvdisasm"] = None
    return found


def _versions() -> dict[str, Any]:
    import importlib.metadata as md
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "nvrtc": benchmark.nvrtc_version()}
    for name in ("torch", "cupy-cuda13x", "cupy-cuda12x", "numpy", "ml_dtypes", "triton",
                 "pytest", "pytest-timeout", "nvidia-cuda-nvrtc"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _gpu(cpu: bool) -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if cpu:
        return info
    import cupy
    props = torch.cuda.get_device_properties(0)
    info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                cudnn=torch.backends.cudnn.version(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                cuda_driver=cupy.cuda.runtime.driverGetVersion())
    query = ("name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,"
             "memory.used,compute_mode")
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                             capture_output=True, text=True, timeout=15)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return info


def step_env(args, stamp: dict) -> int:
    """Versions, tools, the GPU, settings and limits into env.json (printed too)."""
    import persistent_rnn as prnn
    env = {**stamp, "versions": _versions(), "tools": _tools(), "gpu": _gpu(args.cpu),
           "settings": asdict(prnn.configure()), "path": os.environ.get("PATH")}
    if not args.cpu:
        env["max_hidden_size"] = {f"{c} {d}": prnn.max_hidden_size(c, d)
                                  for c in ("LSTM", "GRU", "RNN") for d in ("float32", "float16")}
    (args.out / FILES["env"]).write_text(json.dumps(env, indent=1, default=str) + "\n")
    for key in ("versions", "tools", "gpu", "max_hidden_size"):
        print(f"{key}: {json.dumps(env.get(key), default=str)}", flush=True)
    return 0


def predict_one(job: dict, device: str | None) -> dict:
    """The model's figures for one layer (or stack) of ``prediction_jobs`` (a prediction)."""
    import persistent_rnn as prnn
    from persistent_rnn import latency
    from persistent_rnn import plan as planner
    t0 = time.perf_counter()
    try:
        if job["tf32"]:  # planned as with allow_tf32 (``prnn plan ... --tf32``)
            device = replace(planner.resolve_device(device), allow_tf32=True)
        if job.get("proj_size"):
            out = {"note": benchmark.NO_PROJECTION_MODEL}
        elif job["layers"] > 1 or job["bidirectional"]:
            st = latency.predict_stack_time(job["cell"], job["hidden"], job["batch"], job["layers"],
                                            100, job["bidirectional"], dtype=job["dtype"],
                                            device=device)
            out = {"stack_fits": st.plan.fits, "forward_pass_us_t100": st.forward_us,
                   "backward_pass_us_t100": st.backward_us}
        else:
            st = prnn.predict_step_time(job["cell"], job["hidden"], job["batch"], job["dtype"],
                                        device=device)
            out = {"placement": "cluster" if st.plan.tile.cluster else "grid",
                   "tensor_cores": st.plan.tile.mma,
                   "forward_ctas": st.plan.forward.grid, "forward_us": st.forward_us,
                   "backward_us": st.backward_us, "forward_call_us": st.forward_call_us,
                   "backward_call_us": st.backward_call_us}
            for seq_len in first_cases.SEQ_LENS:
                out[f"forward_us_per_step_t{seq_len}"] = st.benchmark_us(seq_len, False)
                out[f"forward_backward_us_per_step_t{seq_len}"] = st.benchmark_us(seq_len, True)
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - no nvdisasm, an NVRTC failure: recorded
        out = {"ok": False, "problems": [f"{type(exc).__name__}: {str(exc)[:400]}"]}
    return {**job, **out, "seconds": round(time.perf_counter() - t0, 2)}


def step_predict(args, stamp: dict) -> int:
    """Every prediction, ``--workers`` processes at a time (each compiles its kernels with NVRTC
    and disassembles them; spawned, since this process has the GPU open already), each recorded
    as it finishes (a hung one leaves the others' records)."""
    journal = Journal(args.out / FILES["predict"], stamp)
    jobs = first_cases.prediction_jobs(args.cpu)
    device = "h100" if args.cpu else None
    failed = 0
    with ProcessPoolExecutor(max_workers=max(1, min(args.workers, len(jobs))),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(predict_one, job, device) for job in jobs]):
            record = future.result()
            journal.write({"phase": "done", **record})
            failed += not record["ok"]
            print(first_report.prediction_line(record), flush=True)
    return 1 if failed else 0


def step_items(args, stamp: dict) -> int:
    """``correct``, ``stall``, ``time`` or ``time_tf32``: its items through ``run_items``."""
    if not args.cpu:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    journal = Journal(args.out / FILES[args.step], stamp)
    limit = CPU_ITEM_LIMIT_S if args.cpu else ITEM_LIMIT_S[args.step]
    if args.step == "correct":
        items = [(c.name, lambda c=c: {"group": c.group, **first_checks.check_case(c, args.cpu)})
                 for c in first_cases.group_cases(args.group, args.cpu,
                                                  args.cpu and bool(os.environ.get(SAMPLE)))]
    elif args.step == "stall":
        items = [(s.name, lambda s=s: first_checks.check_stall(s.sized(args.cpu), args.cpu))
                 for s in first_cases.STALLS]
    else:
        items = [(first_timing.point_key(*p), lambda p=p: first_timing.measure(*p, args.cpu))
                 for p in first_timing.points(args.cpu, args.step == "time_tf32")]
    return run_items(journal, items, limit)


def step_report(args, stamp: dict) -> int:
    """first_summary.json and first_summary.txt from everything recorded (printed last)."""
    doc, text = first_report.build(args.out)
    (args.out / "first_summary.json").write_text(json.dumps({**stamp, **doc}, indent=1,
                                                            default=str) + "\n")
    (args.out / "first_summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if doc["verdict"]["all_ok"] else 1


STEPS = {"env": step_env, "predict": step_predict, "correct": step_items, "stall": step_items,
         "time": step_items, "time_tf32": step_items, "report": step_report}


def main(argv: list[str] | None = None) -> int:
    """Run one step (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=tuple(STEPS))
    p.add_argument("--out", type=Path, required=True, help="the folder of the records (created)")
    p.add_argument("--cpu", action="store_true", help="the emulation at tiny sizes (no GPU)")
    p.add_argument("--group", choices=first_cases.GROUPS, help="correct: which cases")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = p.parse_args(argv)
    if args.step == "correct" and not args.group:
        p.error("correct needs --group")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = {"device": device_name(args.cpu),
             **benchmark.run_stamp(["python", "bench/first_call.py", *(argv or sys.argv[1:])])}
    return STEPS[args.step](args, stamp)


if __name__ == "__main__":
    sys.exit(main())
