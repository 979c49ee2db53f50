"""``prnn bench``: FLOP and activation formulas, timing, and the results JSON/PNG of a CPU run."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_rnn import bench, cli, timing


@pytest.mark.parametrize("cell, batch, hidden, pass_, flops", [
    ("rnn_tanh", 1, 1024, "forward", 2 * 1 * 1 * 1024 ** 2),
    ("lstm", 4, 512, "forward", 2 * 4 * 4 * 512 ** 2),            # 8_388_608
    ("lstm", 4, 512, "forward_backward", 4 * 4 * 4 * 512 ** 2),
    ("gru", 8, 100, "forward", 480_000),
    ("gru", 8, 100, "forward_backward", 960_000),
    ("rnn_relu", 3, 7, "forward_backward", 588),
])
def test_flops_formula(cell, batch, hidden, pass_, flops):
    assert bench.recurrence_flops_per_step(cell, batch, hidden, pass_) == flops


def test_flops_formula_rejects_an_unknown_pass():
    with pytest.raises(ValueError, match="pass must be one of"):
        bench.recurrence_flops_per_step("lstm", 1, 8, "backward")


def test_activation_bytes():
    # LSTM keeps y, cs and 4 saved gates: 6 values per unit; GRU y + 4; RNN y only.
    assert bench.activation_bytes("lstm", 2, 8, 5, "float32") == 5 * 2 * 8 * 6 * 4
    assert bench.activation_bytes("gru", 2, 8, 5, "float64") == 5 * 2 * 8 * 5 * 8
    assert bench.activation_bytes("rnn_tanh", 1, 4, 3, "float32") == 48


def test_median_seconds_rotates_inputs_and_takes_the_median():
    seen = []

    class FakeClock:
        name = "fake"
        ticks = iter([5.0, 1.0, 3.0, 2.0, 4.0])

        def measure(self, fn):
            fn()
            return next(self.ticks)
    assert timing.median_seconds(seen.append, ["a", "b", "c"], repeats=5, warmup=2, clock=FakeClock()) == 3.0
    assert seen == ["a", "b", "a", "b", "c", "a", "b"]


def test_quick_cpu_run_writes_results_json_and_png(tmp_path, capsys):
    out = tmp_path / "res"
    assert cli.main(["bench", "--quick", "--json", "--cpu", "--out", str(out), "--cells", "lstm,gru",
                     "--batches", "1,4", "--no-progress"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert "GPU figures need a GPU" in captured.err and "us/step" in captured.err
    written = json.loads((out / bench.JSON_NAME).read_text())
    assert written == printed
    assert written["schema_version"] == bench.SCHEMA_VERSION and written["device"] == "cpu"
    assert written["commit"] and written["date"] and written["command"].startswith("prnn bench --quick")
    assert written["settings"]["repeats"] >= 10 and "perf_counter" in written["settings"]["timing"]
    assert "2*G*B*H^2" in written["flops_formula"]
    points = written["points"]
    assert len(points) == 2 * 1 * 1 * 2 * 1 * 2 and not written["skipped"]
    for p in points:
        assert {"cell", "pass", "algo", "batch", "hidden_size", "seq_len", "dtype", "us_per_step", "tflops",
                "peak_fraction", "activation_bytes", "restarts", "fallback"} <= set(p)
        assert p["algo"] == "gemm" and p["us_per_step"] > 0 and p["peak_fraction"] is None
        flops = bench.recurrence_flops_per_step(p["cell"], p["batch"], p["hidden_size"], p["pass"])
        assert p["tflops"] == pytest.approx(flops / p["us_per_step"] / 1e6)
    assert {(p["batch"], p["hidden_size"]) for p in points} == {(1, 64), (4, 64)}
    assert (out / bench.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_budget_skips_the_rest(monkeypatch):
    sweep = bench.Sweep(cells=("rnn_tanh",), hidden_sizes=(8,), seq_lens=(2,), batches=(1, 2),
                        passes=("forward",), algos=("gemm",), max_seconds=0.0)
    points, skipped = bench.run_sweep(sweep, gpu=False, peak_tflops=None, progress=False)
    assert points == [] and len(skipped) == 2 and "time budget" in skipped[0]["reason"]


@pytest.mark.gpu
def test_quick_gpu_run(tmp_path, capsys):
    out = tmp_path / "gpu"
    assert cli.main(["bench", "--quick", "--json", "--out", str(out), "--batches", "1,8",
                     "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["device"] != "cpu" and results["fp32_peak_tflops"] > 1
    algos = {p["algo"] for p in results["points"]}
    assert {"persistent", "gemm"} <= algos
    assert all(0 < p["peak_fraction"] < 1 for p in results["points"])


STUDIES = ("batch_sweep", "hidden_sweep", "restart_cost", "barrier_latency")
BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.skipif(bench.gpu_available(), reason="checks the no-GPU exit; a GPU is present")
@pytest.mark.parametrize("study", STUDIES)
def test_studies_exit_2_with_a_message_without_a_gpu(study, tmp_path):
    run = subprocess.run([sys.executable, str(BENCH_DIR / f"{study}.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
    assert not list(tmp_path.iterdir())


def _bench_script(name: str):
    """Import ``bench/<name>.py`` (the scripts import ``_study`` from their own folder)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_study_size_ladders():
    hidden_sweep, barrier_latency = _bench_script("hidden_sweep"), _bench_script("barrier_latency")
    assert hidden_sweep.hidden_sizes(1280, quick=False) == (128, 256, 512, 1024, 1280)
    assert hidden_sweep.hidden_sizes(1280, quick=True) == (128, 512, 1280)
    assert barrier_latency.grid_sizes(132, quick=False) == [1, 2, 4, 8, 16, 32, 64, 128, 132]
    assert barrier_latency.grid_sizes(108, quick=True) == [1, 8, 108]


def _point(algo, batch, tflops, peak=None):
    return {"cell": "lstm", "pass": "forward", "algo": algo, "batch": batch, "hidden_size": 512,
            "tflops": tflops, "peak_fraction": peak}


def test_summarize_reports_best_points_barrier_and_restart(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    (tmp_path / "info.json").write_text(json.dumps(
        {"gpu": True, "device": {"name": "NVIDIA H200", "fp32_peak_tflops": 66.9}}))
    points = [_point("persistent", 4, 2.5, 0.0374), _point("persistent", 4, 1.5, 0.02), _point("gemm", 4, 0.25)]
    (tmp_path / "bench" / bench.JSON_NAME).write_text(json.dumps({"points": points, "skipped": [{}]}))
    (tmp_path / "barrier_latency.json").write_text(json.dumps(
        {"rows": [{"grid": 1, "ns_per_barrier": 410.0}, {"grid": 132, "ns_per_barrier": 980.4}]}))
    (tmp_path / "restart_cost.json").write_text(json.dumps(
        {"rows": [{"restarts": 0, "cost_us": 1.0}, {"restarts": 1, "cost_us": 30.0},
                  {"restarts": 1, "cost_us": 50.0}, {"restarts": 1, "cost_us": 40.0}]}))
    assert _bench_script("summarize").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200, fp32 peak 66.9 TFLOP/s" in out
    assert "3 points, 1 skipped" in out
    assert "B=4: gemm 0.25 (lstm H=512), persistent 2.50 (lstm H=512, 3.7% peak)" in out
    assert "980 ns at 132 CTAs (1 CTA: 410 ns)" in out
    assert "restart cost: median 40 us over 3 stalls" in out


def test_summarize_reports_missing_files(tmp_path, capsys):
    assert _bench_script("summarize").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "info.json: not available" in out and "bench_results.json: not available" in out


def test_barrier_latency_kernel_compiles_for_sm_90(tmp_path, monkeypatch):
    """The kernel bench/barrier_latency.py launches exists under its name and compiles (NVRTC, no GPU)."""
    from persistent_rnn import _sources, kernels
    if not (_sources.cuda_src_dir() / "grid_barrier.cu").is_file():
        pytest.skip("cuda_src/grid_barrier.cu (the emulation helper's) is not in the tree")
    monkeypatch.setenv("PRNN_CACHE_DIR", str(tmp_path))
    log = kernels.compile_source("grid_barrier.cu", {}, "sm_90").log
    assert f"'{_bench_script('barrier_latency').KERNEL}'" in log and "0 bytes spill stores" in log
