"""The examples run from a fresh clone on the CPU at tiny sizes, alone and data-parallel."""
from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAR_LM_TINY = ["--steps", "30", "--hidden", "32", "--seq-len", "32", "--log-every", "10", "--lr", "1e-2",
        "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss (\d+\.\d+)", log)]


def _example(name: str, args: list[str], env: dict = ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / name), *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# A guard against a hang, not a speed check: each example takes about 5 s alone, but on a loaded
# 2-core machine (two DDP ranks importing torch) it was seen to pass 60 s.
EXAMPLE_TIMEOUT_S = 240


def _run_all(procs: list[subprocess.Popen], timeout: float = EXAMPLE_TIMEOUT_S) -> list[str]:
    """The processes' output once all have ended; one that fails, or the timeout, ends the
    others (a DDP rank whose peer failed would wait for it until the timeout)."""
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as readers:
        outputs = [readers.submit(lambda p=p: p.communicate()[0]) for p in procs]
        deadline = time.monotonic() + timeout
        try:
            while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
                   and all(p.returncode in (None, 0) for p in procs)):
                time.sleep(0.1)
        finally:  # never leave a process behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return [out.result() for out in outputs]


def test_char_lm_loss_goes_down():
    proc = _example("char_lm.py", CHAR_LM_TINY + ["--batch", "4"])
    (log,) = _run_all([proc])
    assert proc.returncode == 0, log
    losses = _losses(log)
    assert len(losses) == 3, log
    assert losses[-1] < losses[0] - 0.3, log
    assert re.search(r"tokens/s\s+\d+", log), log


# The port is free when the test probes it, but another process on the machine may take it
# before rank 0's store binds it: only that failure is run again, on a new port.
_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)
DDP_TRIES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks() -> tuple[list[subprocess.Popen], list[str]]:
    """char_lm.py's two ranks, run until neither failed on a port taken under it."""
    for _ in range(DDP_TRIES):
        port = _free_port()
        envs = [{**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
        procs = [_example("char_lm.py", CHAR_LM_TINY + ["--batch", "1"], env) for env in envs]
        logs = _run_all(procs)
        failed = any(p.returncode != 0 for p in procs)
        if not (failed and any(_PORT_TAKEN.search(log) for log in logs)):
            break
    return procs, logs


def test_char_lm_under_two_process_ddp():
    """The environment torchrun sets (RANK, WORLD_SIZE, ...), on gloo, per-process batch 1."""
    procs, logs = _two_ranks()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    assert "world 2" in logs[0] and len(_losses(logs[0])) == 3, logs[0]
    assert _losses(logs[1]) == [], logs[1]  # only rank 0 reports


def test_speech_ctc_loss_goes_down():
    proc = _example("speech_ctc.py", ["--steps", "30", "--hidden", "16", "--layers", "1",
                                      "--log-every", "10", "--lr", "1e-2"])
    (log,) = _run_all([proc])
    assert proc.returncode == 0, log
    losses = _losses(log)
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], log


def test_torch_models_benchmark_writes_its_record(tmp_path):
    """bench/torch_models.py (one model, one step): the JSON carries what bench/results needs."""
    import json

    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "torch_models.py"), "--out",
                             str(tmp_path), "--device", "cpu", "--models", "word_lm", "--steps",
                             "1", "--warmup", "0"], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    (log,) = _run_all([proc], timeout=120)
    assert proc.returncode == 0, log
    doc = json.loads((tmp_path / "torch_models.json").read_text())
    assert {"device", "date", "commit", "command", "settings", "rows"} <= doc.keys()
    (row,) = doc["rows"]
    assert row["model"] == "word_lm" and row["ratio"] > 0
    assert row["persistent_rnn_last_run"]["algo"] == "torch"
