"""``prnn`` command line: parsing of every subcommand, bad arguments, delegation."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_rnn import cli
from persistent_rnn.extras import install_hint


def _parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_bench_options_parse_into_a_sweep():
    args = _parse("bench", "--quick", "--json", "--out", "d", "--cells", "lstm,GRU", "--batches", "1,4",
                  "--hidden", "32", "--seq-len", "8,16", "--passes", "forward", "--algos", "gemm",
                  "--repeats", "12", "--max-seconds", "5", "--input-size", "3")
    sweep = cli._sweep_from_args(args, gpu=False)
    assert (args.quick, args.json, args.out) == (True, True, Path("d"))
    assert sweep.cells == ("lstm", "gru") and sweep.batches == (1, 4) and sweep.hidden_sizes == (32,)
    assert sweep.seq_lens == (8, 16) and sweep.passes == ("forward",) and sweep.algos == ("gemm",)
    assert (sweep.repeats, sweep.max_seconds, sweep.input_size) == (12, 5.0, 3)


def test_bench_defaults_follow_quick_and_device():
    quick_cpu = cli._sweep_from_args(_parse("bench", "--quick"), gpu=False)
    assert quick_cpu.algos == ("gemm",) and quick_cpu.batches == (1, 2, 4, 8, 16, 32, 64)
    assert quick_cpu.repeats >= 10
    full_gpu = cli._sweep_from_args(_parse("bench"), gpu=True)
    assert set(full_gpu.algos) == {"persistent", "gemm", "cudnn"} and len(full_gpu.cells) == 3


def test_info_and_demo_parse():
    assert _parse("info").json is False and _parse("info", "--json").json is True
    assert _parse("demo").command == "demo"


@pytest.mark.parametrize("argv, message", [
    (["bench", "--batches", "0,4"], "positive integers"),
    (["bench", "--batches", "a"], "positive integers"),
    (["bench", "--hidden", ""], "positive integers"),
    (["bench", "--cells", "lstm,transformer"], "subset of"),
    (["bench", "--algos", "cublas"], "subset of"),
    (["bench", "--passes", "backward"], "subset of"),
    (["bench", "--repeats", "3"], ">= 10"),
    (["bench", "--max-seconds", "x"], "float"),
    (["bench", "--bogus"], "unrecognized arguments"),
    (["info", "--verbose"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_gpu_only_algorithms_on_cpu_are_a_clear_error(tmp_path, capsys):
    assert cli.main(["bench", "--cpu", "--algos", "persistent", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "only gemm" in capsys.readouterr().err
    assert not (tmp_path / "bench_results.json").exists()


def test_kernels_delegates_to_kernel_report(monkeypatch):
    from persistent_rnn import kernel_report
    seen = []
    monkeypatch.setattr(kernel_report, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["kernels", "--arch", "90", "--json"]) == 7
    assert seen == [["--arch", "90", "--json"]]


def test_demo_runs_the_demo_main(monkeypatch):
    from persistent_rnn import demo
    calls = []
    monkeypatch.setattr(demo, "main", calls.append)
    assert cli.main(["demo"]) == 0 and calls == [["--out", "out"]]


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "persistent_rnn.cli", "info", "--json"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert "max_hidden_size" in out.stdout


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_kernels_with_an_arch_the_kernels_cannot_use_is_one_line(capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    assert cli.main(["kernels", "--arch", "75"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("prnn kernels: error: arch 'sm_75'") and "sm_80" in line


def _uninstall(monkeypatch, package: str) -> None:
    """Make ``import package`` (and its submodules) fail as if it were not installed."""
    for name in [n for n in sys.modules if n.split(".")[0] == package] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


def test_kernels_without_cupy_names_the_extra(monkeypatch, capsys):
    _uninstall(monkeypatch, "cupy_backends")
    assert cli.main(["kernels", "--arch", "90"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert install_hint("cuda13") in line


def test_bench_refuses_an_unwritable_out_before_measuring(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(cli.benchmark, "benchmark", lambda *a, **k: pytest.fail("sweep ran"))
    out = tmp_path / "file" / "results"
    assert cli.main(["bench", "--cpu", "--out", str(out), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"prnn bench: error: --out {out}: cannot write there")


def test_bench_without_matplotlib_writes_json_and_says_which_extra(tmp_path, monkeypatch, capsys):
    _uninstall(monkeypatch, "matplotlib")
    argv = ["bench", "--cpu", "--out", str(tmp_path), "--no-progress", "--cells", "gru",
            "--batches", "1", "--hidden", "8", "--seq-len", "2", "--passes", "forward"]
    assert cli.main(argv) == 0
    assert f"no plot: {install_hint('bench')}" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench_results.json").read_text())["points"]
    assert not (tmp_path / "bench_tflops.png").exists()


def test_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "persistent_rnn.cli", "info", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before the first line, as `| head -0` would
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()


# issue 31's example was H=768, then H=1024, which the tensor-core tiles now fit (issue 28; H
# 1024 in batch groups)
TOO_BIG = ["plan", "LSTM", "1280", "--batch", "16", "--dtype", "float16"]


def test_plan_of_a_layer_that_does_not_fit_is_three_lines(capsys):
    assert cli.main(TOO_BIG) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line) < 200 for line in lines), lines
    assert lines[0] == ("lstm H=1280 B=16 float16 does not fit h100: limited by shared memory "
                        "(345664 bytes of shared memory > 232448)")
    assert lines[1].startswith("the largest hidden size that fits at B=16 float16 is 1024; "
                               'algo="auto" runs the layer on the GEMM path instead')
    assert "Tile(" not in "".join(lines) and "--verbose" in lines[2]


def test_plan_largest_fitting_size_is_the_largest(capsys):
    from persistent_rnn import plan
    assert plan.make_plan("lstm", 1024, 16, "float16", "h100").fits
    assert not any(plan.make_plan("lstm", h, 16, "float16", "h100").fits for h in range(1025, 1281))


@pytest.mark.parametrize("argv, line", [
    (["GRU", "256", "--batch", "32", "--dtype", "float16"],
     "(backward on the fp32 tile, 8 units per CTA, float16 weights widened to fp32: predicted "
     "faster than the float16 tiles at this batch)"),  # (plan._mma_forward)
    (["LSTM", "512", "--batch", "4", "--dtype", "float16"],
     "(backward on the grid, 8 units per CTA: predicted faster there)")])  # (_grid_backward)
def test_plan_names_a_backward_on_another_tile(argv, line, capsys):
    # the placement line gives the forward's tile; a backward on another says how many units
    # a CTA of it holds (its CTA count alone would leave that to arithmetic)
    assert cli.main(["plan", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "  " + line
    assert cli.main(["plan", "GRU", "256", "--batch", "16", "--dtype", "float16"]) == 0
    assert "(backward on" not in capsys.readouterr().out  # (one tile: no such line)


def test_plan_tile_detail_only_on_request(capsys):
    assert cli.main(TOO_BIG + ["--verbose"]) == 1
    out = capsys.readouterr().out
    assert out.count("\n  Tile(units=") == 11 and "tiles tried:" in out
    assert cli.main(TOO_BIG + ["--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert not record["fits"] and len(record["tried"]) == 11 and len(record["explanation"]) == 2
    assert record["reason"] == record["explanation"][0]


@pytest.mark.parametrize("hidden, batch, limit", [(4096, 1, "registers (hidden_size 4096 > "),
                                                  (1250, 64, "shared memory (")])
def test_plan_names_what_limits(capsys, hidden, batch, limit):
    assert cli.main(["plan", "LSTM", str(hidden), "--batch", str(batch)]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert f"lstm H={hidden} B={batch} does not fit h100: limited by {limit}" in first


def test_a_layers_refusal_uses_the_plans_words():
    import numpy as np

    import persistent_rnn as prnn
    from persistent_rnn import plan, runtime
    reason = plan.make_plan("gru", 1500, 1, device=runtime.EMULATED_DEVICE).reason
    assert "limited by registers" in reason
    layer = prnn.GRU(4, 1500, algo="persistent", dtype="float32")
    with pytest.raises(ValueError) as err:
        layer.forward(np.zeros((2, 1, 4), np.float32))
    assert str(err.value) == f"algo='persistent' cannot run this layer: {reason}"


def test_plan_of_a_projection_names_its_size_and_what_limits(capsys):
    # H 768 / P 384 at B 16: the backward's staged dg (4H) does not fit, on any projection tile
    argv = ["plan", "LSTM", "768", "--batch", "16", "--proj-size", "384", "--dtype", "float16"]
    assert cli.main(argv + ["--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    first, second = record["explanation"]
    assert first.startswith("lstm H=768 proj_size=384 B=16 float16 does not fit h100: limited "
                            "by shared memory"), first
    assert "with proj_size=384" in second
    assert record["proj_size"] == 384 and any("mma=True" in str(t) for t in record["tried"])
