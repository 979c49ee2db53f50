"""``make demo`` without a GPU: the NumPy run, then predicted persistent step times beside the
recorded cuDNN figures, each labelled, and their plot (one layer here, for time)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from persistent_rnn import benchmark, demo, latency

ROOT = Path(__file__).resolve().parents[1]
GRU = demo.Layer("gru", 256, 1)


def test_recorded_cudnn_figures_are_the_cited_runs():
    results = json.loads((ROOT / demo.RECORDED).read_text())
    assert results["device"] == "NVIDIA H200" and results["settings"]["dtype"] == "float32"
    # docs/benchmarks.md's table: LSTM 1024, batch 4: cuDNN 13.1 µs forward, 46.0 fwd+bwd
    got = demo.recorded_cudnn(demo.Layer("lstm", 1024, 4), results)
    assert round(got["forward"], 1) == 13.1 and round(got["forward_backward"], 1) == 46.0
    assert demo.recorded_cudnn(demo.Layer("lstm", 1024, 4, "float16"), results) == {}
    assert demo.recorded_cudnn(demo.Layer("lstm", 384, 4, layers=4), results) == {}


def test_prediction_is_the_latency_models_at_the_recorded_length():
    st = latency.predict_step_time("GRU", 256, 1, device="h100")
    got = demo.predicted_us(GRU)
    # a call takes the GPU's time (its steps and per-call work) or the host's, the longer
    device_us = st.forward_us * demo.SEQ_LEN + st.forward_call_us
    assert got["forward"] == pytest.approx(max(device_us, st.forward_host_us) / demo.SEQ_LEN)
    assert got["forward_backward"] == pytest.approx(st.benchmark_us(demo.SEQ_LEN, backward=True))


@pytest.mark.slow
def test_demo_without_gpu_prints_labelled_figures_and_plots(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(benchmark, "gpu_available", lambda: False)
    monkeypatch.setattr(demo, "TYPICAL", (GRU,))
    demo.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "|grad - finite diff|" in out
    assert "predicted = persistent kernels, latency model on the H100 profile" in out
    assert f"measured  = torch.nn on cuDNN, recorded: {demo.RECORDED} (NVIDIA H200" in out
    row = next(line for line in out.splitlines() if line.startswith("GRU H=256 B=1"))
    predicted, measured = demo.predicted_us(GRU), demo.recorded_cudnn(
        GRU, json.loads((ROOT / demo.RECORDED).read_text()))
    assert row.split()[3:] == [f"{v:.1f}" for v in (*predicted.values(), *measured.values())]
    assert (tmp_path / "demo_persistent_vs_cudnn.png").stat().st_size > 10_000
