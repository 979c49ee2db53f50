"""The data-parallel scaling study's cost model, checked against hand-computed values."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scaling", ROOT / "bench" / "scaling.py")
scaling = importlib.util.module_from_spec(_spec)
sys.modules["scaling"] = scaling  # dataclasses resolve their module by name
_spec.loader.exec_module(scaling)

FAB = scaling.Fabric("test", bandwidth=1e9, latency=1e-5)


def test_ring_allreduce_hand_values():
    # 2 (p-1)/p * bytes/bw + 2 (p-1) * lat
    assert scaling.ring_allreduce_seconds(1e6, 1, FAB) == 0.0
    assert scaling.ring_allreduce_seconds(1e6, 2, FAB) == pytest.approx(1e-3 + 2e-5, rel=1e-12)
    assert scaling.ring_allreduce_seconds(1e6, 4, FAB) == pytest.approx(1.5e-3 + 6e-5, rel=1e-12)
    assert scaling.ring_allreduce_seconds(8e6, 8, FAB) == pytest.approx(14e-3 + 14e-5, rel=1e-12)
    with pytest.raises(ValueError, match="p must be"):
        scaling.ring_allreduce_seconds(1.0, 0, FAB)


def test_step_overlap_hand_values():
    c = scaling.StepTime(fwd_s=1e-3, bwd_s=2e-3)
    assert scaling.step_seconds(c, 1.5e-3, overlap=0.0) == pytest.approx(4.5e-3)
    # half of backward (1 ms) hides 1 ms of the 1.5 ms all-reduce
    assert scaling.step_seconds(c, 1.5e-3, overlap=0.5) == pytest.approx(3.5e-3)
    # fully hidden: the all-reduce costs nothing beyond compute
    assert scaling.step_seconds(c, 1.5e-3, overlap=1.0) == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="overlap"):
        scaling.step_seconds(c, 0.0, overlap=1.5)


def test_gradient_bytes_matches_torch_lstm():
    torch = pytest.importorskip("torch")
    m = torch.nn.LSTM(7, 5, num_layers=2, bidirectional=True)
    n = sum(p.numel() for p in m.parameters())
    assert scaling.gradient_bytes("lstm", 7, 5, 2, True, "float32") == 4 * n
    g = torch.nn.GRU(3, 4)
    assert scaling.gradient_bytes("gru", 3, 4, 1, False, "float64") == 8 * sum(
        p.numel() for p in g.parameters())


def test_gpu_counts_and_fabric_choice():
    assert scaling.gpu_counts(512, 2, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert scaling.gpu_counts(512, 8, 1024) == [1, 2, 4, 8, 16, 32, 64]
    nv, ib = scaling.FABRICS["nvlink"], scaling.FABRICS["infiniband"]
    assert scaling.fabric_for(8, 8, nv, ib) is nv
    assert scaling.fabric_for(16, 8, nv, ib) is ib


def test_projection_hand_values():
    # compute time proportional to batch: 1 us fwd + 2 us bwd per sample
    compute = lambda b: scaling.StepTime(1e-6 * b, 2e-6 * b)  # noqa: E731
    rows = scaling.project(compute, nbytes=1e6, global_batch=8, counts=[1, 2, 4],
                           gpus_per_node=2, intra=FAB,
                           inter=scaling.Fabric("slow", 1e8, 1e-4), overlap=0.0)
    step1 = 24e-6
    step2 = 12e-6 + (1e-3 + 2e-5)                 # inside the node
    step4 = 6e-6 + (1.5 * 1e6 / 1e8 + 6e-4)       # across nodes: the slow fabric
    assert [r["fabric"] for r in rows] == ["test", "test", "slow"]
    assert [r["step_ms"] for r in rows] == pytest.approx([1e3 * s for s in (step1, step2, step4)])
    assert [r["efficiency"] for r in rows] == pytest.approx(
        [1.0, step1 / (2 * step2), step1 / (4 * step4)])
    assert rows[1]["samples_per_s"] == pytest.approx(8 / step2)


def test_interpolation_between_measured_batches():
    at = scaling.interpolate({2: scaling.StepTime(1.0, 2.0), 6: scaling.StepTime(3.0, 4.0)})
    assert at(4) == scaling.StepTime(2.0, 3.0)
    with pytest.raises(ValueError, match="outside the measured range"):
        at(8)


def test_cli_from_json_writes_json_and_png(tmp_path):
    records = [{"batch": b, "fwd_ms": 0.5 + 0.01 * b, "bwd_ms": 1.0 + 0.02 * b}
               for b in (2, 4, 8, 16, 32, 64, 128, 256, 512)]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"results": records}))
    out = tmp_path / "scaling"
    rows = scaling.main(["--from-json", str(src), "--hidden", "64", "--out", str(out),
                         "--overlap", "0.5"])
    assert [r["per_gpu_batch"] for r in rows] == [512, 256, 128, 64, 32, 16, 8, 4, 2]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["gradient_bytes"] == 4 * 4 * 64 * (64 + 64 + 2)
    assert report["projection"][0]["efficiency"] == pytest.approx(1.0)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_measurements_rejects_bad_records(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"batch": 2, "ms": 1.0}]))
    with pytest.raises(ValueError, match="fwd_ms"):
        scaling.load_measurements(bad)


def test_measured_numpy_run(tmp_path):
    """The study measures a real (tiny) persistent_rnn layer when no JSON is given."""
    rows = scaling.main(["--hidden", "8", "--seq-len", "3", "--global-batch", "8",
                         "--repeats", "1", "--algo", "gemm", "--out", str(tmp_path / "s")])
    assert [r["gpus"] for r in rows] == [1, 2, 4]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and 0 < r["efficiency"] <= 1 for r in rows)


BENCH_JSON = ROOT / "bench" / "results" / "h200-2026-11-23-run2" / "bench" / "bench_results.json"


def test_from_json_reads_prnn_bench_results(tmp_path):
    points = json.loads(BENCH_JSON.read_text())["points"]
    mine = {(p["pass"], p["batch"]): p["us_per_step"] * p["seq_len"] / 1e6 for p in points
            if (p["cell"], p["hidden_size"], p["algo"]) == ("lstm", 1024, "persistent")}
    out = tmp_path / "s"
    rows = scaling.main(["--from-json", str(BENCH_JSON), "--cell", "lstm", "--hidden", "1024",
                         "--algo", "persistent", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    measured = {int(b): t for b, t in report["measured"].items()}
    assert set(measured) == {b for _, b in mine} == {1, 2, 4, 8}
    for b, t in measured.items():
        assert t["fwd_s"] == pytest.approx(mine["forward", b])
        assert t["fwd_s"] + t["bwd_s"] == pytest.approx(mine["forward_backward", b])
    # the global batch defaults to the largest batch measured; input size from the bench settings
    assert [r["per_gpu_batch"] for r in rows] == [8, 4, 2]
    assert report["config"]["input_size"] == 64 and report["config"]["num_layers"] == 1
    assert report["gradient_bytes"] == 4 * 4 * 1024 * (64 + 1024 + 2)
    assert all(0 < r["efficiency"] <= 1 for r in rows)


def test_from_json_auto_takes_persistent_where_measured_else_gemm(tmp_path):
    out = tmp_path / "s"
    scaling.main(["--from-json", str(BENCH_JSON), "--cell", "lstm", "--hidden", "1024",
                  "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    points = {(p["algo"], p["pass"], p["batch"]): p["us_per_step"] * p["seq_len"] / 1e6
              for p in json.loads(BENCH_JSON.read_text())["points"]
              if (p["cell"], p["hidden_size"]) == ("lstm", 1024)}
    assert report["config"]["algo"] == "auto"
    for b, t in report["measured"].items():
        algo = "persistent" if ("persistent", "forward", int(b)) in points else "gemm"
        assert t["fwd_s"] == pytest.approx(points[algo, "forward", int(b)])
    assert {int(b) for b in report["measured"]} == {1, 2, 4, 8, 16, 32, 64}


def test_from_json_reads_its_own_output(tmp_path):
    first = scaling.main(["--from-json", str(BENCH_JSON), "--cell", "gru", "--hidden", "512",
                          "--algo", "gemm", "--out", str(tmp_path / "a")])
    again = scaling.main(["--from-json", str(tmp_path / "a.json"), "--out", str(tmp_path / "b")])
    assert again == first


@pytest.mark.parametrize("argv, message", [
    ([], "choose one with --cell"),
    (["--cell", "lstm"], "choose one with --hidden"),
    (["--cell", "lstm", "--hidden", "1024", "--algo", "nope"], "--algo"),
    (["--cell", "lstm", "--hidden", "1024", "--layers", "2"], "--layers"),
    (["--cell", "lstm", "--hidden", "1024", "--global-batch", "512"], "outside the measured"),
])
def test_from_json_says_what_to_choose(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        scaling.main(["--from-json", str(BENCH_JSON), "--out", str(tmp_path / "s"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_efficiency_never_exceeds_one_when_small_batches_are_faster_per_sample():
    # compute superlinear in the batch (as on a CPU whose caches fit small batches): p GPUs at
    # b = B/p are more than p times faster, and t_step(1) / (p t_step(p)) would pass 1
    compute = lambda b: scaling.StepTime(1e-6 * b * b, 2e-6 * b * b)  # noqa: E731
    rows = scaling.project(compute, nbytes=1e3, global_batch=64, counts=[1, 2, 4, 8],
                           gpus_per_node=8, intra=FAB, inter=FAB, overlap=0.0)
    assert all(0 < r["efficiency"] <= 1 for r in rows)
    best = 8 / compute(8).total_s  # samples/s of one GPU at its best batch
    assert rows[-1]["efficiency"] == pytest.approx(64 / (rows[-1]["step_ms"] / 1e3) / (8 * best))
    assert rows[0]["efficiency"] < 1  # one GPU at batch 64 is below its best per-sample rate
