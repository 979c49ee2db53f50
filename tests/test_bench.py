"""``prnn bench``: FLOP and activation formulas, timing, and the results JSON/PNG of a CPU run."""
from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_rnn import benchmark, cli, timing


@pytest.mark.parametrize("cell, batch, hidden, pass_, flops", [
    ("rnn_tanh", 1, 1024, "forward", 2 * 1 * 1 * 1024 ** 2),
    ("lstm", 4, 512, "forward", 2 * 4 * 4 * 512 ** 2),            # 8_388_608
    ("lstm", 4, 512, "forward_backward", 4 * 4 * 4 * 512 ** 2),
    ("gru", 8, 100, "forward", 480_000),
    ("gru", 8, 100, "forward_backward", 960_000),
    ("rnn_relu", 3, 7, "forward_backward", 588),
])
def test_flops_formula(cell, batch, hidden, pass_, flops):
    assert benchmark.recurrence_flops_per_step(cell, batch, hidden, pass_) == flops


def test_flops_formula_rejects_an_unknown_pass():
    with pytest.raises(ValueError, match="pass must be one of"):
        benchmark.recurrence_flops_per_step("lstm", 1, 8, "backward")


def test_activation_bytes():
    # LSTM keeps y, cs and 4 saved gates: 6 values per unit; GRU y + 4; RNN y only.
    assert benchmark.activation_bytes("lstm", 2, 8, 5, "float32") == 5 * 2 * 8 * 6 * 4
    assert benchmark.activation_bytes("gru", 2, 8, 5, "float64") == 5 * 2 * 8 * 5 * 8
    assert benchmark.activation_bytes("rnn_tanh", 1, 4, 3, "float32") == 48


def test_median_seconds_rotates_inputs_and_takes_the_median():
    seen = []

    class FakeClock:
        name = "fake"
        ticks = iter([5.0, 1.0, 3.0, 2.0, 4.0])

        def measure(self, fn):
            fn()
            return next(self.ticks)
    assert timing.median_seconds(seen.append, ["a", "b", "c"], repeats=5, warmup=2, clock=FakeClock()) == 3.0
    assert timing.spread([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx(4.0 / 3.0)
    assert seen == ["a", "b", "a", "b", "c", "a", "b"]


def test_quick_cpu_run_writes_results_json_and_png(tmp_path, capsys):
    out = tmp_path / "res"
    assert cli.main(["bench", "--quick", "--json", "--cpu", "--out", str(out), "--cells", "lstm,gru",
                     "--batches", "1,4", "--no-progress"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert "GPU figures need a GPU" in captured.err and "us/step" in captured.err
    written = json.loads((out / benchmark.JSON_NAME).read_text())
    assert written == printed
    assert written["schema_version"] == benchmark.SCHEMA_VERSION and written["device"] == "cpu"
    assert written["commit"] and written["date"] and written["command"].startswith("prnn bench --quick")
    assert written["settings"]["repeats"] >= 10 and "perf_counter" in written["settings"]["timing"]
    assert "2*G*B*H^2" in written["flops_formula"]
    points = written["points"]
    assert len(points) == 2 * 1 * 1 * 2 * 1 * 2 and not written["skipped"]
    for p in points:
        assert {"cell", "pass", "algo", "batch", "hidden_size", "seq_len", "dtype", "us_per_step", "tflops",
                "peak_fraction", "activation_bytes", "restarts", "fallback"} <= set(p)
        assert p["algo"] == "gemm" and p["us_per_step"] > 0 and p["peak_fraction"] is None
        flops = benchmark.recurrence_flops_per_step(p["cell"], p["batch"], p["hidden_size"],
                                                    p["pass"])
        assert p["tflops"] == pytest.approx(flops / p["us_per_step"] / 1e6)
    assert {(p["batch"], p["hidden_size"]) for p in points} == {(1, 64), (4, 64)}
    assert (out / benchmark.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_budget_skips_the_rest(monkeypatch):
    sweep = benchmark.Sweep(cells=("rnn_tanh",), hidden_sizes=(8,), seq_lens=(2,), batches=(1, 2),
                            passes=("forward",), algos=("gemm",), max_seconds=0.0)
    points, skipped = benchmark.run_sweep(sweep, gpu=False, peak_tflops=None, progress=False)
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


@pytest.mark.skipif(benchmark.gpu_available(), reason="checks the no-GPU exit; a GPU is present")
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
    assert barrier_latency.grid_sizes(108, quick=True) == [1, 8, 16, 108]


def _point(algo, batch, tflops, peak=None, us=10.0, predicted=None, **extra):
    return {"cell": "lstm", "pass": "forward", "algo": algo, "batch": batch, "hidden_size": 512,
            "seq_len": 100, "tflops": tflops, "peak_fraction": peak, "us_per_step": us,
            "predicted_us_per_step": predicted, **extra}


def test_summarize_reports_best_points_barrier_and_restart(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    (tmp_path / "info.json").write_text(json.dumps(
        {"gpu": True, "device": {"name": "NVIDIA H200", "fp32_peak_tflops": 66.9}}))
    points = [_point("persistent", 4, 2.5, 0.0374), _point("persistent", 4, 1.5, 0.02), _point("gemm", 4, 0.25)]
    (tmp_path / "bench" / benchmark.JSON_NAME).write_text(json.dumps({"points": points, "skipped": [{}]}))
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


def test_summarize_sets_the_rounds_parts_beside_the_round(tmp_path, capsys):
    """``round_anatomy.json`` (``barrier_latency.py --anatomy``): each part in ns and as a share
    of its path's full round, at each grid size; the timer's costs."""
    rows = [{"part": "exchange", "grid": 1, "ns_per_round": 800.0},
            {"part": "exchange", "grid": 16, "ns_per_round": 1200.0},
            {"part": "quad", "grid": 1, "ns_per_round": 400.0},
            {"part": "cluster", "grid": 1, "ns_per_round": 500.0},
            {"part": "cluster_local", "grid": 1, "ns_per_round": 125.0},
            {"part": "timer", "read_ns": 30.0, "tick_min_ns": 32, "tick_mean_ns": 32.5,
             "backoff_ns": 480.0}]
    (tmp_path / "round_anatomy.json").write_text(json.dumps({"rows": rows}))
    assert _bench_script("summarize").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the exchange round's parts" in out
    quad = next(line for line in out.splitlines() if line.split()[:1] == ["quad"])
    assert "400.0 ( 50%)" in quad
    local = next(line for line in out.splitlines() if line.split()[:1] == ["cluster_local"])
    assert "125.0 ( 25%)" in local
    assert "__nanosleep(20)) 480.0 ns" in out


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
    barrier_latency = _bench_script("barrier_latency")
    assert f"'{barrier_latency.KERNEL}'" in log and "0 bytes spill stores" in log
    # --anatomy's kernels, the grid's and (at 16 CTAs, its largest grid) the cluster's
    parts = barrier_latency.ANATOMY
    assert all(f"'{p.kernel}'" in log for p in parts if not p.cluster) and "'timer_probe'" in log
    # the cluster exchange at the small layers' cluster size (16 CTAs on H100/H200)
    assert barrier_latency.MAX_CLUSTER == 16 == max(barrier_latency.ANATOMY_GRIDS)
    log = kernels.compile_source("grid_barrier.cu", {"PRNN_CLUSTER": 16}, "sm_90").log
    assert f"'{barrier_latency.CLUSTER_KERNEL}'" in log
    assert all(f"'{p.kernel}'" in log for p in parts if p.cluster)
    # --free-polls' builds (``PRNN_GRID_FREE_POLLS``)
    log = kernels.compile_source("grid_barrier.cu", {"PRNN_GRID_FREE_POLLS": 64}, "sm_90").log
    assert f"'{barrier_latency.EXCHANGE_KERNEL}'" in log and "0 bytes spill stores" in log
    assert barrier_latency.free_polls("2,16, 64") == (2, 16, 64)
    with pytest.raises(ValueError, match="--free-polls"):
        barrier_latency.free_polls("2,-1")


# --- projections, stacks, predictions, the commit stamp, the GPU suite's pieces on the CPU ---

def test_flops_with_a_projection_and_a_stack():
    # LSTM H=8, P=4, B=2: W_hh (32 x 4) r and W_hr (4 x 8) h per batch row, 2 FLOPs a product.
    assert (benchmark.recurrence_flops_per_step("lstm", 2, 8, "forward", proj_size=4)
            == 2 * 2 * (128 + 32))
    assert benchmark.recurrence_flops_per_step("lstm", 2, 8, "forward_backward", proj_size=4,
                                               num_layers=3) == 2 * 640 * 3
    assert (benchmark.recurrence_flops_per_step("gru", 1, 8, "forward", num_layers=2)
            == 2 * 2 * 3 * 64)


def test_activation_bytes_with_a_projection_and_a_stack():
    # LSTMP T=5 B=2 H=8 P=4: y (P wide) 40, cs 80, hs 80, saved 320 values.
    assert benchmark.activation_bytes("lstm", 2, 8, 5, "float32", proj_size=4) == (40 + 80 + 80 + 320) * 4
    # Two GRU layers: layer 1's input (80) + per layer y 80 and saved 320, in fp32 for fp16.
    assert benchmark.activation_bytes("gru", 2, 8, 5, "float16", num_layers=2) == (80 + 2 * 400) * 4


def test_commit_comes_from_prnn_commit_where_set(monkeypatch):
    monkeypatch.setenv(benchmark.COMMIT_ENV, "0123abcd")
    assert benchmark.git_commit() == "0123abcd"
    assert benchmark.run_stamp(["prnn", "x"])["commit"] == "0123abcd"
    monkeypatch.setenv(benchmark.COMMIT_ENV, " ")
    assert benchmark.git_commit() != " " and benchmark.git_commit()


def test_cpu_run_of_a_projected_stack_records_its_shape(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(benchmark.COMMIT_ENV, "feedbeef")
    out = tmp_path / "res"
    assert cli.main(["bench", "--json", "--cpu", "--out", str(out), "--cells", "lstm", "--hidden", "16",
                     "--proj-size", "4", "--layers", "2", "--batches", "1,3", "--seq-len", "5",
                     "--passes", "forward", "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["commit"] == "feedbeef" and results["schema_version"] == 3
    assert "nvrtc" in results  # None where CuPy's NVRTC does not load
    assert results["settings"]["prnn_settings"]["gemm_graphs"] is False
    assert [(p["batch"], p["proj_size"], p["num_layers"]) for p in results["points"]] == [(1, 4, 2), (3, 4, 2)]
    for p in results["points"]:
        assert p["flops_per_step"] == benchmark.recurrence_flops_per_step("lstm", p["batch"], 16, "forward", 4, 2)
        assert p["activation_bytes"] == benchmark.activation_bytes("lstm", p["batch"], 16, 5, "float32", 4, 2)
        assert p["predicted_us_per_step"] is None  # GEMM points carry no prediction
        # every call's forward was read: 2 warm-up + 10 timed
        assert p["passes_checked"] == 12 and p["restarts"] == 0 and p["fallback"] is None


def test_a_point_reports_the_restarts_and_fallback_of_every_call(monkeypatch):
    """A fallback in the first (warm-up) call and restarts in a timed one both reach the point,
    though the last call ran cleanly."""
    import numpy as np
    import persistent_rnn as prnn
    from persistent_rnn.stats import RunStats
    script = iter([RunStats("gemm", 3, "barrier timeout"), RunStats("persistent", 2),
                   *[RunStats("persistent")] * 20])

    class ScriptedLSTM:
        def __init__(self, input_size, hidden, **kwargs):
            self.params, self.last_run = {}, None

        def forward(self, x):
            self.last_run = next(script)
            return np.zeros((x.shape[0], x.shape[1], 8), np.float32), None

    monkeypatch.setattr(prnn, "LSTM", ScriptedLSTM)
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(8,), seq_lens=(2,), batches=(1,),
                            passes=("forward",), algos=("persistent",), repeats=10, warmup=2)
    point = benchmark.measure_point(sweep, "lstm", "forward", "persistent", 1, 8, 2, gpu=False,
                                    peak_tflops=None)
    assert (point.restarts, point.fallback, point.passes_checked) == (5, "barrier timeout", 12)


def test_the_full_gpu_sweep_measures_the_headline_first():
    sweep = benchmark.default_sweep(gpu=True, quick=False)
    assert (sweep.cells[0], sweep.hidden_sizes[0]) == ("lstm", 1024)
    # prnn_torch runs only when asked for by name
    assert "prnn_torch" in benchmark.BENCH_ALGOS and "prnn_torch" not in sweep.algos
    assert benchmark.resolve_sweep(sweep, gpu=False).algos == ("gemm",)


def test_projection_needs_the_lstm(capsys):
    assert cli.main(["bench", "--cpu", "--cells", "gru", "--proj-size", "4"]) == 2
    assert "--proj-size needs --cells lstm" in capsys.readouterr().err


def test_info_json_is_stamped(capsys, monkeypatch):
    monkeypatch.setenv(benchmark.COMMIT_ENV, "c0ffee")
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["commit"] == "c0ffee" and report["command"] == "prnn info --json" and report["date"]
    assert report["nvrtc"] == benchmark.nvrtc_version()


def test_prediction_is_the_models_benchmark_figure():
    from persistent_rnn import latency, plan
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(256,), seq_lens=(100,))
    step = latency.predict_step_time("lstm", 256, 4, device="h100")
    for pass_, backward in (("forward", False), ("forward_backward", True)):
        got, note = benchmark.predicted_us_per_step(sweep, "lstm", pass_, 4, 256, 100,
                                                    device="h100")
        assert note is None and got == pytest.approx(step.benchmark_us(100, backward), rel=1e-12)
    # Another T (and input size): the per-call GEMMs are of that size, spread over T steps.
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(256,), seq_lens=(20,), input_size=32)
    got, _ = benchmark.predicted_us_per_step(sweep, "lstm", "forward", 4, 256, 20, device="h100")
    at20 = latency.predict_plan(plan.resolve_cell("lstm"), 256, 4, step.plan,
                                plan.resolve_device("h100"), seq_len=20, input_size=32)
    assert got == pytest.approx(at20.benchmark_us(20), rel=1e-12)


def test_prediction_of_a_stack_follows_the_stack_setting():
    from persistent_rnn import latency, settings
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(64,), seq_lens=(10,), num_layers=2)
    st = latency.predict_stack_time("lstm", 64, 2, 2, 10, device="h100")
    assert st.plan.fits
    got, _ = benchmark.predicted_us_per_step(sweep, "lstm", "forward_backward", 2, 64, 10, device="h100")
    assert got == pytest.approx((st.forward_us + st.backward_us) / 10, rel=1e-12)
    with settings.override_settings(stack=False):
        apart, _ = benchmark.predicted_us_per_step(sweep, "lstm", "forward", 2, 64, 10,
                                                   device="h100")
    assert apart == pytest.approx(st.apart_forward_us / 10, rel=1e-12) and apart != st.forward_us / 10


def test_no_prediction_for_projections_or_when_the_model_fails(monkeypatch):
    from persistent_rnn import latency
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(64,), seq_lens=(10,), proj_size=16)
    assert benchmark.predicted_us_per_step(sweep, "lstm", "forward", 1, 64, 10, "h100") == \
        (None, benchmark.NO_PROJECTION_MODEL)

    def broken(*args, **kwargs):
        raise RuntimeError("nvdisasm is not installed")
    monkeypatch.setattr(latency, "predict_plan", broken)
    got, note = benchmark.predicted_us_per_step(benchmark.Sweep(("lstm",), (64,), (10,)), "lstm",
                                                "forward", 1, 64, 10, "h100")
    assert got is None and "nvdisasm is not installed" in note


def test_summarize_prints_every_run_side_by_side_and_the_prediction_error(tmp_path, capsys):
    for name, graphs, points in (
            ("bench", False, [_point("persistent", 4, 2.0, us=10.0, predicted=12.0),
                              _point("persistent", 8, 2.0, us=20.0, predicted=19.0),
                              _point("cudnn", 4, 1.0, us=16.0), _point("gemm", 4, 0.5, us=40.0)]),
            ("bench_lstmp", True, [_point("persistent", 1, 1.0, us=5.0, proj_size=128,
                                          prediction_note=benchmark.NO_PROJECTION_MODEL)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / benchmark.JSON_NAME).write_text(json.dumps(
            {"points": points, "skipped": [], "commit": "abc", "settings": {
                "dtype": "float32", "prnn_settings": {"gemm_graphs": graphs}}}))
    assert _bench_script("summarize").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bench: 4 points, 0 skipped (float32, gemm_graphs off; commit abc)" in out
    assert "bench_lstmp: 1 points" in out and "gemm_graphs on" in out
    assert "persistent    10.00  gemm    40.00  cudnn    16.00  persistent/cudnn 0.62x" in out
    assert "a prediction" in out and "median |error| 12.5%, worst 20.0% over 2 points" in out
    assert "measured    10.00  predicted    12.00  error  +20.0%" in out
    assert "error   -5.0%" in out and "lstm forward float32 H=512 P=128 T=100 B=1" in out
    assert f"no prediction: {benchmark.NO_PROJECTION_MODEL}" in out


def _sanitize_case():
    spec = importlib.util.spec_from_file_location("gpu_sanitize_case",
                                                  Path(__file__).parent / "gpu_sanitize_case.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_sanitize_cases_run_in_the_emulation():
    case = _sanitize_case()
    names = [c.name for c in case.cases()]
    assert {"grid-fp32-lstm", "grid-fp16-gru", "cluster-fp16-lstm", "stall-restart-grid-lstm",
            "lstmp-fp32", "stack-fp32-lstm-2"} <= set(names)
    assert sum(n.startswith("cluster-fp32-") for n in names) == 4
    assert case.main(["--cpu", "--only", "cluster-fp32-lstm,lstmp-fp32,stack-fp32-lstm-2"]) == 0
    groups = {g: [n for n in names if case.group_of(n) == g] for g in case.GROUPS}
    assert groups["grid"] == ["grid-fp32-lstm", "grid-fp32-gru", "grid-fp16-gru"]
    assert len(groups["cluster"]) == 6 and "cluster16-fp32-gru" in groups["cluster"]
    assert sum(map(len, groups.values())) == len(names)


def test_sanitize_case_checks_the_placement_and_launches():
    import numpy as np
    case = _sanitize_case()
    assert "planned cluster, not grid" in case.layer_case("GRU", 64, placement="grid")(np)[0]
    assert "took 1 launches, not 2" in " ".join(case.layer_case("GRU", 64, num_layers=2, launches=2)(np))


def test_sanitize_stall_case_fails_without_a_restart(monkeypatch):
    import numpy as np
    case = _sanitize_case()
    monkeypatch.setattr(case, "STALL_MS", 100.0)  # shorter than the barrier timeout: no restart
    assert case.stall_case(np) == ["no restart (forward 0, backward 0)"]


def test_summarize_checks_the_issue_17_targets():
    summarize = _bench_script("summarize")
    fp16 = dict(dtype="float16", hidden_size=1024)
    runs = [{"points": [
        _point("persistent", 1, 1.0, us=0.9, hidden_size=256),            # small layer: met
        _point("persistent", 4, 1.0, us=2.6, hidden_size=1024),           # H 1024 B 4: missed
        _point("cudnn", 4, 1.0, us=3.0, hidden_size=1024),                # persistent faster: met
        _point("persistent", 8, 1.0, us=5.0, **fp16), _point("cudnn", 8, 1.0, us=10.0, **fp16),
        _point("persistent", 16, 1.0, us=8.0, **fp16), _point("cudnn", 16, 1.0, us=10.0, **fp16),
        _point("persistent", 4, 1.0, us=9.0, hidden_size=1024, num_layers=2)]}]  # a stack: not counted
    lines = summarize.target_lines(runs)
    assert "small layers (H <= 256, B 1) forward <= 1.0 us/step: met (1 points)" in lines[1]
    assert "MISSED (1 points; lstm forward float32 H=1024 T=100 B=4 2.60 > 2.50)" in lines[2]
    assert "cuDNN at B <= 8, H >= 256 (fp32, us/step): met (1 points)" in lines[3]
    assert "MISSED (2 points; lstm forward float16 H=1024 T=100 B=16 persistent/cudnn 0.80 > 0.67)" in lines[4]
    assert summarize.target_lines([{"points": []}])[1].endswith("not measured")


def test_summarize_marks_points_that_restarted_or_fell_back():
    summarize = _bench_script("summarize")
    lines = summarize.side_by_side_lines({"points": [
        _point("persistent", 4, 1.0, us=5.0, restarts=2, fallback=None),
        _point("prnn_torch", 4, 1.0, us=6.0, restarts=0, fallback="barrier timeout"),
        _point("cudnn", 4, 1.0, us=10.0)]})
    assert "persistent     5.00!  prnn_torch     6.00!  cudnn    10.00  persistent/cudnn 0.50x" in lines[0]


def test_gpu_call_cost_runs_on_the_cpu(tmp_path, capsys):
    """bench/gpu_call_cost.py --cpu: every road and pass has a row with its counters, the slope
    and both profiles are written (a check of the script; its CPU figures mean nothing)."""
    gpu_call_cost = _bench_script("gpu_call_cost")
    assert gpu_call_cost.main(["--cpu", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_call_cost.json").read_text())
    rows = record["rows"]
    assert {(r["road"], r["passes"]) for r in rows} == {
        (road, p) for road in gpu_call_cost.ROADS for p in ("fwd", "fwd+bwd")}
    assert all("error" not in r and r["host_us"] > 0 for r in rows), rows
    persistent = [r for r in rows if r["road"] == "persistent"]
    assert all(r["per_call"]["launches"] >= 1 for r in persistent)
    assert len(record["slopes"]) == 1 and record["commit"]
    for road in ("persistent", "prnn_torch"):
        for name in (f"profile_{road}_gru_fwd.txt", f"profile_{road}_gru_fwd_bwd.txt"):
            text = (tmp_path / name).read_text()
            # per call, in µs; the warm-up planned the call, so the profile is the planned one
            assert text.startswith("cProfile of 1 call(s), per call") and "call_plans.py" in text


def test_profile_text_reports_microseconds_per_call():
    """``benchmark.profile_text`` divides by the calls profiled and keeps sub-millisecond
    times (pstats' own listing prints 0.000 for them)."""
    from persistent_rnn import benchmark

    def called() -> None:
        sum(range(100))

    text = benchmark.profile_text(lambda: [called() for _ in range(50)], calls=50)
    row = next(line for line in text.splitlines() if line.rstrip().endswith(") called") or
               " called (" in line)
    made, own, total = (float(v) for v in row.split()[:3])
    assert made == 1.0 and 0 < own <= total < 1000.0


def test_decode_loop_runs_on_the_cpu(tmp_path):
    """bench/decode_loop.py --cpu: every CPU road of every size has a figure and no error, and
    each decoder road its close() time and relaunches apart (a check of the script; its CPU
    figures mean nothing)."""
    decode_loop = _bench_script("decode_loop")
    assert decode_loop.main(["--cpu", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "decode_loop.json").read_text())
    assert len(record["rows"]) == len(decode_loop.CPU_SIZES) and not record["skipped"]
    assert "caller's stream" in record["timing"]
    for row in record["rows"]:
        assert all(row[road] > 0 for road in decode_loop.CPU_ROADS), row
        for road in ("decoder", "decoder_projected"):
            assert row[f"{road}_close_ms"] > 0 and row[f"{road}_relaunches"] >= 0, row


def test_call_kernels_runs_on_the_cpu(tmp_path):
    """bench/call_kernels.py --cpu: a row per layer, pass and road, each with its host time."""
    call_kernels = _bench_script("call_kernels")
    assert call_kernels.main(["--cpu", "--calls", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "call_kernels.json").read_text())["rows"]
    assert len(rows) == len(call_kernels.LAYERS) * 2 * 2
    assert all("error" not in r and r["host_us_per_call"] > 0 for r in rows), rows
    assert "us/call" in (tmp_path / "call_kernels.txt").read_text()


def test_interop_cost_runs_on_the_cpu(tmp_path):
    """bench/interop_cost.py --cpu: a positive host time for every operation it names."""
    interop_cost = _bench_script("interop_cost")
    assert interop_cost.main(["--cpu", "--out", str(tmp_path)]) == 0
    us = json.loads((tmp_path / "interop_cost.json").read_text())["us"]
    assert {"library_stream", "to_array", "to_tensor", "decoder.step",
            "torch.nn.LSTMCell step"} <= set(us) and all(v > 0 for v in us.values()), us


def test_decoder_profile_runs_on_the_cpu(tmp_path):
    """bench/decoder_profile.py --cpu: a host profile of each stepping road."""
    decoder_profile = _bench_script("decoder_profile")
    assert decoder_profile.main(["--cpu", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "decoder_profile.txt").read_text()
    assert text.count("eager steps") == 3 and text.count("cProfile of 3 call(s), per call") == 3


def test_decoder_profile_lists_the_resident_kernel_apart_from_the_steps():
    """bench/decoder_profile.py's device table: kernels launched once a step or more per step,
    with their sum; the resident kernel's launch (its lifetime: ~100 ms per 50-step replay on the
    H200 of 2026-11-27, where it had read 2010 us a step) and other once-a-loop work per loop."""
    decoder_profile = _bench_script("decoder_profile")
    found = {"prnn_resident_decoder": (2010.11, 0.02), "prnn_decoder_step": (6.36, 1.0),
             "gemv": (11.06, 2.0), "Memset (Unknown)": (0.05, 0.04)}
    lines = decoder_profile.activity_table(found, 50).splitlines()
    assert lines[:3] == ["    11.06 us/step x2.00  gemv",
                         "     6.36 us/step x1.00  prnn_decoder_step", "    17.42 us/step in all"]
    assert lines[3].startswith("less than once a step (per loop of 50 steps")
    assert lines[4].startswith("100505.50 us x1  prnn_resident_decoder  (its lifetime")
    assert lines[5] == "     2.50 us x2  Memset (Unknown)"


def test_replay_ratios_pairs_the_runs_and_takes_increments(tmp_path):
    """bench/replay_ratios.py: per config the medians, the pairs' after / before ratio and a
    multi-chain config's increment per further layer-direction over its round's single layer."""
    ratios = _bench_script("replay_ratios")
    stand_ins = {("single", "before"): (10.0, 20.0), ("single", "after"): (8.0, 15.0),
                 ("layers3", "before"): (30.0, 40.0), ("layers3", "after"): (18.0, 31.0),
                 ("pair1", "before"): (20.0, 30.0), ("pair1", "after"): (16.0, 25.0),
                 ("nostack3", "before"): (50.0, 60.0), ("nostack3", "after"): (38.0, 55.0)}
    for (config, side), (fwd, bwd) in stand_ins.items():
        for n in (1, 2):
            folder = tmp_path / f"replayed-{'b' if side == 'before' else 'a'}-{config}-{side}-{n}"
            folder.mkdir()
            rows = [{"entry": ratios.FORWARD, "median_us": fwd * n},
                    {"entry": ratios.BOTH, "median_us": (fwd + bwd) * n}]
            (folder / "call_breakdown.json").write_text(json.dumps({"rows": rows}))
    lines = ratios.report(tmp_path, "b", "a")
    assert lines[0] == "pairs: [1, 2]"
    single, stack_backward = lines[1], lines[4]
    assert "before   15.0 (10.0-20.0) after   12.0 (8.0-16.0) ratio 0.800" in single
    # (layers3 backward: increments (40 - 20) / 2 = 10 before, (31 - 15) / 2 = 8 after)
    assert "increment before  15.0 after  12.0 ratio 0.800" in stack_backward
