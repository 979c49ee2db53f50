"""``prnn bench --dtype``: 16-bit points on the CPU, and what a GPU run would skip and why."""
from __future__ import annotations

import json

import numpy as np
import pytest

from persistent_rnn import benchmark, cli


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_bench_runs_16bit_layers(dtype, tmp_path, capsys):
    out = tmp_path / "res"
    assert cli.main(["bench", "--quick", "--json", "--cpu", "--out", str(out), "--cells", "gru",
                     "--batches", "1,2", "--dtype", dtype, "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["settings"]["dtype"] == dtype and not results["skipped"]
    points = results["points"]
    assert len(points) == 4 and {p["dtype"] for p in points} == {dtype}
    assert all(p["us_per_step"] > 0 and p["algo"] == "gemm" for p in points)


def test_16bit_activation_bytes_are_fp32():
    # 16-bit layers keep y, cs and saved in fp32 (h_t rounded to 16 bits in place)
    full = benchmark.activation_bytes("lstm", 2, 8, 3, "float32")
    assert benchmark.activation_bytes("lstm", 2, 8, 3, "float16") == full
    assert benchmark.activation_bytes("lstm", 2, 8, 3, "bfloat16") == full


def test_bfloat16_on_cupy_is_skipped_with_the_reason():
    sweep = benchmark.Sweep(cells=("lstm",), hidden_sizes=(8,), seq_lens=(2,), dtype="bfloat16")
    with pytest.raises(ValueError, match="does not take bfloat16"):
        benchmark._prnn_case(sweep, "lstm", "gemm", False, 1, 8, 2, xp=object())


def test_dtype_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtype", "float64"])
    assert "--dtype" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "--dtype", "float16"])
    assert cli._sweep_from_args(args, gpu=True).dtype == "float16"
    assert benchmark.BENCH_DTYPES == ("float32", "float16", "bfloat16")
    assert np.dtype(np.float16).name in benchmark.BENCH_DTYPES
