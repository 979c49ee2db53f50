"""``prnn info``: the fp32 peak formula and the report without a GPU."""
from __future__ import annotations

import json

import pytest

from persistent_rnn import cli, info, plan


def test_peak_formula():
    # H100 SXM: 132 SMs x 1980 MHz x 128 lanes x 2 = 66.9 TFLOP/s; A100: 108 x 1410 x 64 x 2 = 19.5.
    assert info.fp32_peak_tflops(132, 1980, 9, 0) == pytest.approx(66.908, abs=1e-3)
    assert info.fp32_peak_tflops(108, 1410, 8, 0) == pytest.approx(19.492, abs=1e-3)
    assert info.fp32_lanes_per_sm(8, 9) == 128


def test_info_json_without_a_gpu(monkeypatch, capsys):
    def no_gpu():
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setattr(info, "gpu_info", no_gpu)
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu"] is False and "NVML Shared Library Not Found" in report["reason"]
    assert set(report["profiles"]) == {"h100", "h200", "a100"}
    h200 = report["profiles"]["h200"]
    assert h200["sm_count"] == 132
    assert h200["max_hidden_size"]["lstm"]["float32"] == plan.max_hidden_size("lstm", "float32", "h200") > 0


def test_info_text_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(info, "gpu_info", lambda: (_ for _ in ()).throw(OSError("no driver")))
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "no GPU" in text and "a100: 108 SMs" in text and "max_hidden_size float32" in text


@pytest.mark.gpu
def test_info_json_on_a_gpu(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu"] is True
    dev = report["device"]
    assert dev["sm_count"] > 0 and dev["registers_per_sm"] >= 65536 and dev["fp32_peak_tflops"] > 1
    assert report["max_hidden_size"]["lstm"]["float32"] > 0
