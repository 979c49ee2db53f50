"""bench/run_gpu_suite.sh without a GPU: every part fits its device call (dry run), the first
call's part runs end to end in the CPU emulation (``--cpu``; the full set,
``PRNN_TEST_EVERY_KERNEL=1``, and before every GPU slot: docs/benchmarks.md), and its pieces - a
hung item recorded and skipped, the report's slope and per-call split, pytest resumed past a hung
test - do what they say. So the suite cannot rot while no GPU is lent."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from full_set import EVERY_KERNEL

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "run_gpu_suite.sh"
BENCH = ROOT / "bench"
FIRST_CALL_S, LATER_CALL_S = 420, 360  # 7 minutes, then 6: 15 minutes with the machine's start
FIRST_STEPS = ["first_env", "first_predict", "first_correct_fp32", "first_correct_tf32",
               "first_correct_struct", "first_correct_half", "first_stall", "first_time",
               "first_time_tf32", "first_report"]


def _suite(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def _steps(stdout: str) -> list[tuple[str, int]]:
    """(name, limit) of each step a dry run lists."""
    return [(line.split()[1], int(line.split("(limit ")[1].split("s)")[0]))
            for line in stdout.splitlines() if line.startswith("== ") and "(limit " in line]


@pytest.mark.parametrize("part, call_s", [("first", FIRST_CALL_S), ("tests", LATER_CALL_S),
                                          ("bench", LATER_CALL_S), ("compare", LATER_CALL_S),
                                          ("studies", LATER_CALL_S), ("sweeps", LATER_CALL_S),
                                          ("fresh", LATER_CALL_S)])
def test_each_part_fits_its_device_call(part, call_s, tmp_path):
    run = _suite("--dry-run", str(tmp_path / "out"), part)
    assert run.returncode == 0, run.stderr
    steps = _steps(run.stdout)
    assert 0 < sum(limit for _, limit in steps) <= call_s
    assert f"== part {part}: time limits {sum(limit for _, limit in steps)}s" in run.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    if part == "first":
        assert [name for name, _ in steps] == FIRST_STEPS
    if part == "tests":  # pytest first, then each sanitizer over the cluster and grid cases apart
        names = [name for name, _ in steps]
        assert names[0] == "gpu_tests" and {"sanitize_memcheck_cluster", "sanitize_memcheck_grid",
                                            "sanitize_racecheck_cluster",
                                            "sanitize_racecheck_grid"} <= set(names)
        gpu_tests = next(line for line in run.stdout.splitlines() if "== gpu_tests" in line)
        budget = int(gpu_tests.split("--budget ")[1].split()[0])
        per_test = int(gpu_tests.split("--timeout=")[1].split()[0])
        assert per_test < budget < dict(steps)["gpu_tests"]


def test_the_default_part_is_first_and_bad_requests_are_refused(tmp_path):
    assert [n for n, _ in _steps(_suite("--dry-run", str(tmp_path)).stdout)] == FIRST_STEPS
    bad = _suite("--dry-run", str(tmp_path), "everything")
    assert bad.returncode == 2 and "unknown part" in bad.stderr
    cpu = _suite("--dry-run", "--cpu", str(tmp_path), "tests")
    assert cpu.returncode == 2 and "--cpu runs part 'first' only" in cpu.stderr


def test_the_bench_steps_parse_with_the_cli(tmp_path):
    """Every prnn bench command of the later parts is accepted by the CLI (no GPU needed); the
    bf16 sweep reaches the library through persistent_rnn.torch."""
    from persistent_rnn import cli
    run = _suite("--dry-run", str(tmp_path), "bench", "compare", "studies", "sweeps")
    commands = [line.split(": ", 1)[1] for line in run.stdout.splitlines()
                if line.startswith("== bench")]
    assert len(commands) == 1 + 5 + 5 + 2
    for command in commands:
        parsed = cli.build_parser().parse_args(command.split("persistent_rnn.cli ", 1)[1].split())
        sweep = cli._sweep_from_args(parsed, gpu=True)
        assert sweep.max_seconds >= 15 and sweep.seq_lens == (100,)
        if sweep.dtype == "bfloat16":
            assert sweep.algos == ("prnn_torch", "cudnn")


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not EVERY_KERNEL, reason="the full set's (~85 s of one CI worker); the "
                    "--cpu check runs before every GPU slot")
def test_the_first_part_runs_end_to_end_in_the_emulation(tmp_path):
    """The harness end to end on the sample of cases that takes each of its roads once (the
    whole ``--cpu`` check, 14 cases, runs before a GPU slot); the emulated kernels are those
    other tests build."""
    out = tmp_path / "first"
    run = _suite("--cpu", str(out), "first", timeout=840,
                 env={"PRNN_COMMIT": "feedface", "PRNN_FIRST_CPU_SAMPLE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = _records(out, "steps.jsonl")
    assert [s["step"] for s in steps] == FIRST_STEPS and {s["status"] for s in steps} == {"ok"}
    summary = json.loads((out / "first_summary.json").read_text())
    verdict = summary["verdict"]
    assert verdict["all_ok"] and not verdict["failed"] and not verdict["hung"]
    # the harness's roads once (first_cases.CPU_SAMPLE; the whole --cpu check runs 14 cases);
    # the --cpu check times 2 of the 5 layers (first_timing.points): 2 x 2 T x 2 passes x 4 roads,
    # and the TF32 layer: 2 T x 2 passes x 2 roads
    assert (verdict["cases"], verdict["stalls"], verdict["points"]) == (6, 3, 40)
    # every record says where, when, from which commit, with which NVRTC and command it came
    for name in ("predict.jsonl", "correct.jsonl", "stall.jsonl", "time.jsonl",
                 "time_tf32.jsonl"):
        for record in _records(out, name):
            assert record["device"] == "cpu (emulation)" and record["commit"] == "feedface"
            assert record["date"] and "nvrtc" in record
            assert record["command"].startswith("python bench/first_call.py")
    cases = {r["name"]: r for r in summary["correctness"]}
    assert cases["lstm_h256_b3"]["forward"]["placement"] == "cluster"
    assert cases["lstm_h1024_b4"]["forward"]["placement"] == "grid"
    assert all(r["repeat_bitwise"] and r["err_torch_nn"] is not None for r in cases.values())
    # the TF32 tiles in both passes of the TF32 case (and its error TF32's, far above fp32's),
    # in no other case
    tf32 = cases.pop("lstm_h1024_b4_tf32")
    assert tf32["forward"]["tf32"] and tf32["backward"]["tf32"] and tf32["err_f64"] > 1e-5
    assert not any(r[p]["tf32"] for r in cases.values() for p in ("forward", "backward"))
    assert {r["name"]: r["restart_bitwise"] for r in summary["stalls"]} == {
        "stall_grid_lstm_h1024_b4": True, "stall_cluster_gru_h256_b1": True,
        "stall_stack2_lstm_h256_b3": True}
    table = {(r["config"], r["pass"]): r for r in summary["timing"]["table"]}
    headline = table[("lstm_h1024_b4", "forward")]
    for algo in ("persistent", "gemm", "prnn_torch", "cudnn"):
        assert headline[f"{algo}_us_per_step"] > 0 and f"{algo}_slope_us" in headline
    assert headline["predicted_step_us"] > 0  # the model's figure on the h100 profile
    beside = table[("lstm_h1024_b4_tf32", "forward")]  # TF32 beside fp32 and cuDNN, and the model
    assert beside["tf32_over_fp32"] > 0 and beside["persistent_over_cudnn"] > 0
    assert 0 < beside["predicted_step_us"] < headline["predicted_step_us"]
    text = (out / "first_summary.txt").read_text()
    assert "verdict: cases 6/6 ok, stalls 3/3 ok, timing points 40/40 clean" in text
    assert "TF32 (lstm_h1024_b4_tf32, allow_tf32" in text
    assert text.strip() in run.stdout  # printed, the last thing before the step list
    assert "parts: first" in (out / "suite-first.txt").read_text()


def test_a_hung_item_is_recorded_and_the_rest_still_run(tmp_path):
    """The watchdog ends a process whose item hangs (status 75, the item recorded as hung); run
    again, the step skips what finished and goes on; an item the step was killed in (started,
    never finished) is recorded as hung on the next run."""
    script = tmp_path / "items.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(BENCH)!r})
        import first_call
        from pathlib import Path
        journal = first_call.Journal(Path({str(tmp_path)!r}) / "items.jsonl", {{"device": "x"}})
        items = [("a", lambda: {{"ok": True}}), ("b", lambda: time.sleep(60)),
                 ("c", lambda: {{"ok": False, "problems": ["wrong"]}})]
        sys.exit(first_call.run_items(journal, items, limit_s=1.0))
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60, env=env)
    assert first.returncode == 75 and "b: HUNG after 1 s" in first.stderr
    second = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, env=env)
    assert second.returncode == 1  # c ran and failed
    done = [r for r in _records(tmp_path, "items.jsonl") if r["phase"] == "done"]
    assert [(r["name"], r["ok"], r.get("hung", False)) for r in done] == [
        ("a", True, False), ("b", False, True), ("c", False, False)]
    sys.path.insert(0, str(BENCH))
    try:
        import first_report
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "correct.jsonl").write_text(json.dumps({"name": "killed", "phase": "start"}) + "\n")
    doc, text = first_report.build(tmp_path)
    assert doc["verdict"]["hung"] == ["killed"] and not doc["verdict"]["all_ok"]
    assert "killed by the step's time limit" in text


def test_the_report_splits_slope_and_per_call_cost():
    sys.path.insert(0, str(BENCH))
    try:
        import first_report
    finally:
        sys.path.remove(str(BENCH))

    def point(algo, seq_len, call_us, ok=True, predicted=None, config="lstm_h1024_b4"):
        return {"config": config, "pass": "forward", "algo": algo, "seq_len": seq_len,
                "us_per_step": call_us / seq_len, "call_us": call_us, "ok": ok,
                "predicted_us_per_step": predicted}
    points = [point("persistent", 100, 250.0 + 2.5 * 100, predicted=7.1),
              point("persistent", 300, 250.0 + 2.5 * 300),
              point("cudnn", 100, 1000.0, ok=False), point("cudnn", 300, 2500.0),
              point("persistent", 100, 400.0, predicted=3.5, config="lstm_h1024_b4_tf32")]
    prediction = {"lstm_h1024_b4": {"ok": True, "placement": "grid", "forward_us": 2.0,
                                    "backward_us": 3.9}}
    rows = first_report.timing_rows(points, prediction)
    row = rows[0]
    assert row["persistent_slope_us"] == pytest.approx(2.5)
    assert row["persistent_per_call_us"] == pytest.approx(250.0)
    assert row["slope_over_predicted"] == pytest.approx(2.5 / 2.0)
    assert row["persistent_over_cudnn"] == pytest.approx(5.0 / 10.0)
    assert row["predicted_call_us_per_step"] == 7.1 and row["cudnn_clean"] is False
    # the TF32 row under its fp32 layer's, beside that row's persistent and cuDNN figures
    tf32 = rows[2]
    assert (tf32["config"], tf32["pass"]) == ("lstm_h1024_b4_tf32", "forward")
    assert tf32["tf32_over_fp32"] == pytest.approx(4.0 / 5.0)
    assert tf32["persistent_over_cudnn"] == pytest.approx(4.0 / 10.0)
    assert "fwd     tf32 4.00 (pred 3.50), fp32 5.00 (pred 7.10), cudnn 10.00" in "\n".join(
        first_report._tf32_text(rows))


def _fresh_ab_on_the_cpu(tmp_path, step: str, limit: int, script: str = "gpu_call_cost"):
    """Run the fresh part's step ``step`` (bench/``script``.py) with its arguments as the suite
    names them, plus ``--cpu``, into ``tmp_path/out``, after checking its time limit is at most
    ``limit`` s; returns the script's module."""
    run = _suite("--dry-run", str(tmp_path / "out"), "fresh")
    seconds, = [s for n, s in _steps(run.stdout) if n == step]
    assert seconds <= limit
    line = next(x for x in run.stdout.splitlines() if x.startswith(f"== {step} "))
    args = line.split(f"bench/{script}.py ", 1)[1].split()
    sys.path.insert(0, str(BENCH))
    try:
        module = importlib.import_module(script)
    finally:
        sys.path.remove(str(BENCH))
    assert module.main([*args, "--cpu"]) == 0
    return module


def test_the_fresh_parts_round_anatomy_runs_on_the_cpu(tmp_path, capsys):
    """The fresh part's round anatomy (bench/barrier_latency.py --anatomy, its command as the
    suite names it plus ``--cpu``: the emulation at 1 and 4 CTAs, a few rounds; a check of the
    script, its figures mean nothing), early in the part and within 15 s on a GPU: a row per part
    and grid size and the timer's, in a record that says where, when and from what it came, and
    the table of each part beside its full round."""
    run = _suite("--dry-run", str(tmp_path / "out"), "fresh")
    names = [n for n, _ in _steps(run.stdout)]
    assert names.index("round_anatomy") == names.index("inputs_ahead") + 1
    barrier_latency = _fresh_ab_on_the_cpu(tmp_path, "round_anatomy", 15, "barrier_latency")
    doc = json.loads((tmp_path / "out" / "round_anatomy.json").read_text())
    assert doc["device"] == "cpu" and doc["settings"]["cpu"] and doc["commit"] and doc["date"]
    assert "nvrtc" in doc and doc["command"]  # (sys.argv: the suite runs the script itself)
    rows = [r for r in doc["rows"] if "grid" in r]
    assert {(r["part"], r["grid"]) for r in rows} == {
        (p.name, g) for p in barrier_latency.ANATOMY for g in barrier_latency.CPU_GRIDS}
    assert all(r["ns_per_round"] > 0 for r in rows)
    timer, = [r for r in doc["rows"] if r["part"] == "timer"]
    assert timer["read_ns"] > 0 and timer["backoff_ns"] > 0
    out = capsys.readouterr().out
    assert "quad_acquire" in out and "(100%)" in out and "__nanosleep(20)" in out


def test_the_fresh_parts_inputs_ahead_ab_runs_on_the_cpu(tmp_path, capsys):
    """The fresh part's A/B of plan.CLUSTER_INPUTS_AHEAD, its command as the suite names it plus
    ``--cpu`` (bench/gpu_call_cost.py --inputs-ahead; a check of the script, its CPU figures mean
    nothing): within 15 s on a GPU, a row per setting with its prediction, run with one input
    buffer more than the steps it fetches ahead, and the planner's setting left as it was."""
    from persistent_rnn import plan
    gpu_call_cost = _fresh_ab_on_the_cpu(tmp_path, "inputs_ahead", 15)
    rows = json.loads((tmp_path / "out" / "inputs_ahead.json").read_text())["rows"]
    assert [(r["inputs_ahead"], r["ran"]["input_buffers"]) for r in rows] == [(1, 2), (2, 3)]
    assert all(r["ran"]["cluster"] and r["predicted_us"] > 0 for r in rows)
    assert plan.CLUSTER_INPUTS_AHEAD == 1
    assert ": 2 / 1 " in capsys.readouterr().out
    # a layer planned before, inside and after the setting runs what the planner says then (the
    # runtime's cached engines dropped on entry and on exit)
    dev, layer = gpu_call_cost.Device(cpu=True), gpu_call_cost.KNOBS["inputs_ahead"].cpu_layers[0]

    def buffers() -> int:
        return gpu_call_cost.forward_ran(dev, *layer)["input_buffers"]
    assert buffers() == 2
    with gpu_call_cost.planner_setting("CLUSTER_INPUTS_AHEAD", 2):
        assert buffers() == 3
    assert buffers() == 2


def test_the_fresh_parts_free_polls_ab_runs_on_the_cpu(tmp_path, capsys):
    """The fresh part's A/B of plan.GRID_FREE_POLLS (bench/gpu_call_cost.py --free-polls, its
    command as the suite names it plus ``--cpu``): a grid layer's forward with the kernels' two
    free polls (no define: the shipped build) and with 32 compiled in, each with its prediction,
    and the planner's setting left as it was."""
    from persistent_rnn import plan
    _fresh_ab_on_the_cpu(tmp_path, "free_polls_layers", 20)
    rows = json.loads((tmp_path / "out" / "free_polls.json").read_text())["rows"]
    assert [(r["free_polls"], r["ran"]["grid_free_polls"]) for r in rows] == [(2, 0), (32, 32)]
    assert all(not r["ran"]["cluster"] and r["predicted_us"] > 0 for r in rows)
    assert plan.GRID_FREE_POLLS == plan.KERNEL_GRID_FREE_POLLS == 2
    assert ": 32 / 2 " in capsys.readouterr().out


def test_the_fresh_parts_stack_call_cost_runs_on_the_cpu(tmp_path, capsys):
    """The fresh part's stack calls (bench/gpu_call_cost.py --stack, its command as the suite
    names it plus ``--cpu``; a check of the script, its CPU figures mean nothing): within 10 s
    on a GPU, every road and pass has a row, the persistent ones the model's host prediction of
    a planned stack's call (``latency.stack_call_costs``), labelled a prediction."""
    from persistent_rnn import latency, plan, runtime
    gpu_call_cost = _fresh_ab_on_the_cpu(tmp_path, "stack_call_cost", 10)
    rows = json.loads((tmp_path / "out" / "stack_call_cost.json").read_text())["rows"]
    assert {(r["road"], r["passes"]) for r in rows} == {
        (road, p) for road in gpu_call_cost.STACK_ROADS for p in ("fwd", "fwd+bwd")}
    assert all("error" not in r and r["host_us"] > 0 for r in rows), rows
    cell, hidden, batch, layers = gpu_call_cost.CPU_STACK
    device, spec = runtime.planning_device(False), plan.resolve_cell(cell)
    forward = latency.stack_call_costs(spec, hidden, batch, 3, gpu_call_cost.INPUT, False,
                                       device, layers).host_us
    predicted = {r["passes"]: r["predicted_host_us"] for r in rows if r["road"] == "persistent"}
    assert predicted["fwd"] == pytest.approx(forward) and predicted["fwd+bwd"] > forward
    assert "(PREDICTION)" in capsys.readouterr().out


def test_pytest_resume_goes_past_a_hung_test(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(textwrap.dedent("""
        import time
        def test_a(): pass
        def test_hangs(): time.sleep(60)
        def test_b(): pass
    """))
    run = subprocess.run([sys.executable, str(BENCH / "pytest_resume.py"), "--budget", "90",
                          "--", "-p", "no:cacheprovider", "--timeout=2", "-o",
                          "timeout_method=thread", "tests/"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    assert "tests/test_fake.py::test_b PASSED" in run.stdout
    assert run.stdout.rstrip().endswith(
        "pytest_resume: 2 tests finished; hung: tests/test_fake.py::test_hangs")


def test_the_cpu_check_runs_each_distinct_case_once_and_the_gpu_every_case():
    sys.path.insert(0, str(BENCH))
    try:
        import first_cases
    finally:
        sys.path.remove(str(BENCH))
    for group in first_cases.GROUPS:
        gpu = first_cases.group_cases(group, False)
        assert gpu == [c for c in first_cases.CASES if c.group == group]
        cpu = first_cases.group_cases(group, True)
        names = {c.name for c in cpu}
        # every GPU case is represented by a CPU case that runs the same tiny layer
        for case in gpu:
            tiny = case.sized(True)
            assert any((c.mode, c.hidden, c.dtype, c.placement, c.options, c.lengths)
                       == (tiny.mode, tiny.hidden, tiny.dtype, tiny.placement, tiny.options,
                           tiny.lengths) for c in cpu), case.name
        assert len(names) == len(cpu)
    assert sum(len(first_cases.group_cases(g, True)) for g in first_cases.GROUPS) == 14
    sample = [c.name for g in first_cases.GROUPS for c in first_cases.group_cases(g, True, True)]
    assert sample == list(first_cases.CPU_SAMPLE)  # each named case exists, in the order run


def test_every_test_file_and_script_the_suite_names_exists():
    """A path the GPU suite names that does not exist would cost a step of a device call."""
    text = SUITE.read_text()
    named = set(re.findall(r"\b((?:tests|bench)/[\w/]+\.(?:py|sh))\b", text))
    assert "tests/test_gpu_decoder.py" in named and len(named) > 10
    root = SUITE.parents[1]
    assert [p for p in sorted(named) if not (root / p).is_file()] == []


def test_the_checks_hold_each_case_to_the_tf32_tiles_exactly_where_it_allows_them():
    """``last_run``'s kernel defines say whether a pass ran the TF32 tiles (docs/api.md, "TF32":
    ``PRNN_MMA`` without ``PRNN_WEIGHT_DTYPE``); a case that allows them must run them in both
    passes, and every other case must not; its bound is TF32's."""
    sys.path.insert(0, str(BENCH))
    try:
        import first_cases
        import first_checks
    finally:
        sys.path.remove(str(BENCH))

    def stats(kernel: str):
        return type("Stats", (), {"algo": "persistent", "restarts": 0, "fallback": None,
                                  "emulated": False, "launches": 3,
                                  "details": [f"prnn_persistent_forward: {kernel}", "x"]})()
    tf32 = first_checks.stats_dict(stats("{'PRNN_CELL': 2, 'PRNN_MMA': 1, 'PRNN_WARPS': 4}"))
    fp32 = first_checks.stats_dict(stats("{'PRNN_CELL': 2, 'PRNN_WARPS': 4}"))
    half = first_checks.stats_dict(stats("{'PRNN_MMA': 1, 'PRNN_WEIGHT_DTYPE': 1}"))
    assert (tf32["tf32"], fp32["tf32"], half["tf32"]) == (True, False, False)
    assert first_checks.path_problems("forward", tf32, False, "grid", tf32=True) == []
    assert first_checks.path_problems("forward", fp32, False, "grid") == []
    assert first_checks.path_problems("forward", fp32, False, "grid", tf32=True) == [
        "forward ran not on the TF32 tiles"]
    assert first_checks.path_problems("forward", tf32, False, "grid") == [
        "forward ran on the TF32 tiles"]
    case = next(c for c in first_cases.CASES if c.group == "tf32")
    assert case.tf32 and case.tolerance() == first_cases.TOLERANCE["tf32"] == 5e-3
    assert case.sized(True).batch >= 4  # the emulation's TF32 tiles too (forward from 3, back 4)
    assert not any(c.tf32 for c in first_cases.CASES if c.group != "tf32")
    jobs = {j["name"]: j for j in first_cases.prediction_jobs(False)}
    assert jobs["lstm_h1024_b4_tf32"]["tf32"] and not jobs["lstm_h1024_b4"]["tf32"]
