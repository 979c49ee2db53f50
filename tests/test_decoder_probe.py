"""The decoder's probe (resident_decoder.cu, PRNN_DECODER_PROBE; bench/decoder_probe.py): every
stage of every step stamped, in the order a step runs, in the CPU emulation (its timer a virtual
clock, ordered as the events are); the shipped build has no probe."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import persistent_rnn as prnn
from persistent_rnn import decoder

ROOT = Path(__file__).resolve().parents[1]
# A step's stamps in the order its stages run (resident CTA 0's own; the step kernel's thread 0)
ORDER = ("start", "posting", "post_seen", "staged", "projected", "gathered", "pointwise",
         "publishing", "done_seen", "end")


def test_the_probe_stamps_every_stage_of_every_step_in_order(tmp_path):
    """bench/decoder_probe.py --cpu --free-polls 8: each step of the loop (but its first, whose
    wait began before it) has every stamp, each no earlier than the stage before; every
    resident CTA saw the post after it was released and released its done word before the step
    kernel saw them all; the bench's own check and its table agree - for the shipped kernels
    and those whose hand-off waits poll 8 times before they sleep."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "decoder_probe.py"), "--cpu",
                          "--free-polls", "8", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((tmp_path / "decoder_probe.json").read_text())
    assert [r["free_polls"] for r in doc["results"]] == [0, 8]
    assert "eager loop, 8 free polls" in run.stdout
    raw = np.load(tmp_path / "decoder_probe_rows.npz")
    word = {name: i for i, name in enumerate(decoder.PROBE_WORDS)}
    for result in doc["results"]:
        assert result["problems"] == [] and "stamp problem" not in run.stdout
        rows = raw[result["rows"]].astype(np.int64)
        rows = rows[rows[:, word["step"]] != 0]
        rows = rows[np.argsort(rows[:, word["step"]])][1:]
        assert len(rows) == doc["steps"] - 1 == result["steps"]
        ctas = result["ctas"]
        seen = rows[:, decoder.PROBE_CTA_WORDS:][:, :ctas]
        released = rows[:, decoder.PROBE_CTA_WORDS + decoder.PROBE_CTAS:][:, :ctas]
        for row, cta_seen, cta_released in zip(rows, seen, released):
            stamps = [row[word[name]] for name in ORDER]
            assert all(stamps), dict(zip(ORDER, stamps))
            assert stamps == sorted(stamps), dict(zip(ORDER, stamps))
            assert 0 < row[word["wait_start"]] <= row[word["post_seen"]]
            assert row[word["ahead"]] in (1, 2)
            assert np.all(cta_seen >= row[word["posting"]]) and np.all(cta_released >= cta_seen)
            assert np.all(cta_released <= row[word["done_seen"]])
        assert all(i["median_ns"] is not None for i in result["intervals"].values())
        assert "post_seen_cta0" in run.stdout and "done_polls" in run.stdout


def test_the_shipped_decoder_has_no_probe(monkeypatch):
    """Without PROBE_ENV the kernels are built without the probe (no buffer in the module,
    probe_buffer refuses); with it, a stack is refused (the probe stamps one layer)."""
    monkeypatch.delenv(decoder.PROBE_ENV, raising=False)
    with prnn.LSTMCell(8, 16, seed=0, algo="persistent").decoder(batch=1) as dec:
        with pytest.raises(ValueError, match="probe"):
            decoder.probe_buffer(dec)
        with pytest.raises(ValueError):  # (ctypes: no such symbol)
            ctypes.c_ulonglong.in_dll(dec._layers.module._lib, decoder.PROBE_SYMBOL)
    monkeypatch.setenv(decoder.PROBE_ENV, "1")
    with pytest.raises(ValueError, match="one-layer"):
        prnn.LSTM(8, 16, num_layers=2, seed=0, algo="persistent").decoder(batch=1)


def test_free_polls_come_from_the_environment_as_a_count(monkeypatch):
    """``decoder.FREE_POLLS_ENV`` (an experiment): unset, nothing; a count, its -D; anything
    else, a ValueError naming it when a decoder is made."""
    monkeypatch.delenv(decoder.FREE_POLLS_ENV, raising=False)
    assert decoder._free_polls() == {}
    monkeypatch.setenv(decoder.FREE_POLLS_ENV, "32")
    assert decoder._free_polls() == {"PRNN_DECODER_FREE_POLLS": 32}
    monkeypatch.setenv(decoder.FREE_POLLS_ENV, "-1")
    with pytest.raises(ValueError, match="PRNN_DECODER_FREE_POLLS must be a count"):
        prnn.LSTMCell(8, 16, seed=0, algo="persistent").decoder(batch=1)
