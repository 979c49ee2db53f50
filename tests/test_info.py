"""``prnn info``: the fp32 peak formula and the report without a GPU."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from persistent_rnn import cli, info, plan
from persistent_rnn.extras import install_hint


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
    import pynvml
    no_driver = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monkeypatch.setattr(info, "gpu_info", lambda: (_ for _ in ()).throw(no_driver))
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "no GPU" in text and "a100: 108 SMs" in text and "max_hidden_size float32" in text


def test_info_tells_cupy_not_installed_from_no_gpu(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails as if not installed
    monkeypatch.setattr(info, "gpu_info", lambda: pytest.fail("looked for a GPU without CuPy"))
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"CuPy is not installed, so no GPU is used: {install_hint('cuda13')}" in text
    assert "no GPU:" not in text and "h200: 132 SMs" in text


def test_info_lets_unexpected_errors_through(monkeypatch):
    monkeypatch.setattr(info, "gpu_info", lambda: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError, match="bug"):
        info.collect()


@pytest.mark.gpu
def test_info_json_on_a_gpu(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu"] is True
    dev = report["device"]
    assert dev["sm_count"] > 0 and dev["registers_per_sm"] >= 65536 and dev["fp32_peak_tflops"] > 1
    assert report["max_hidden_size"]["lstm"]["float32"] > 0


def _fake_gpu_modules(monkeypatch):
    """Stand-ins for pynvml and cupy that describe an H200 with one other process."""
    class NVMLError(Exception):
        pass
    handle = object()
    nvml = SimpleNamespace(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: handle,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=141 * 2**30, used=2**30),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=4242, usedGpuMemory=2**30)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: (_ for _ in ()).throw(NVMLError("not supported")),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetClockInfo=lambda h, kind: 1755,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980 if kind == 1 else 3201,
        nvmlSystemGetDriverVersion=lambda: "580.65.06", nvmlSystemGetCudaDriverVersion_v2=lambda: 13000)
    attrs = {"MultiProcessorCount": 132, "MaxRegistersPerMultiprocessor": 65536,
             "MaxSharedMemoryPerBlockOptin": 232448, "ClockRate": 1980000}
    cupy = SimpleNamespace(cuda=SimpleNamespace(
        Device=lambda i=0: SimpleNamespace(id=i, attributes=attrs, compute_capability="90"),
        runtime=SimpleNamespace(runtimeGetVersion=lambda: 13020)))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(plan, "current_device", lambda: plan.PROFILES["h200"])


def test_info_with_a_gpu_reads_nvml_and_cupy(monkeypatch, capsys):
    _fake_gpu_modules(monkeypatch)
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    dev = report["device"]
    assert report["gpu"] is True and dev["name"] == "NVIDIA H200" and dev["sm_count"] == 132
    assert dev["other_processes"] == [{"pid": 4242, "used_memory_bytes": 2**30}]
    assert dev["fp32_peak_tflops"] == pytest.approx(66.908, abs=1e-3)
    assert (report["driver_version"], report["cuda_driver_version"], report["cuda_runtime_version"]) == \
        ("580.65.06", "13.0", "13.2")
    assert report["max_hidden_size"]["lstm"]["float32"] == plan.max_hidden_size("lstm", device="h200")
    text = info.format_text(report)
    assert "NVIDIA H200" in text and "pid 4242" in text and "66.9 TFLOP/s" in text
