"""The examples run from a fresh clone on the CPU at tiny sizes, alone and data-parallel."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
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
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # never leave a process behind (e.g. after a timeout)
            if p.poll() is None:
                p.kill()
                p.wait()


def test_char_lm_loss_goes_down():
    proc = _example("char_lm.py", CHAR_LM_TINY + ["--batch", "4"])
    (log,) = _run_all([proc])
    assert proc.returncode == 0, log
    losses = _losses(log)
    assert len(losses) == 3, log
    assert losses[-1] < losses[0] - 0.3, log
    assert re.search(r"tokens/s\s+\d+", log), log


def test_char_lm_under_two_process_ddp():
    """The environment torchrun sets (RANK, WORLD_SIZE, ...), on gloo, per-process batch 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs = [{**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(2)]
    procs = [_example("char_lm.py", CHAR_LM_TINY + ["--batch", "1"], env) for env in envs]
    logs = _run_all(procs)
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
