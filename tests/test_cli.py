"""``prnn`` command line: parsing of every subcommand, bad arguments, delegation."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_rnn import cli


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
    assert 'pip install "persistent-rnn[cuda13]"' in line


def test_bench_refuses_an_unwritable_out_before_measuring(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(cli.bench, "benchmark", lambda *a, **k: pytest.fail("sweep ran"))
    out = tmp_path / "file" / "results"
    assert cli.main(["bench", "--cpu", "--out", str(out), "--no-progress"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"prnn bench: error: --out {out}: cannot write there")


def test_bench_without_matplotlib_writes_json_and_says_which_extra(tmp_path, monkeypatch, capsys):
    _uninstall(monkeypatch, "matplotlib")
    argv = ["bench", "--cpu", "--out", str(tmp_path), "--no-progress", "--cells", "gru",
            "--batches", "1", "--hidden", "8", "--seq-len", "2", "--passes", "forward"]
    assert cli.main(argv) == 0
    assert 'no plot: pip install "persistent-rnn[bench]"' in capsys.readouterr().out
    assert json.loads((tmp_path / "bench_results.json").read_text())["points"]
    assert not (tmp_path / "bench_tflops.png").exists()


def test_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "persistent_rnn.cli", "info", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before the first line, as `| head -0` would
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()
