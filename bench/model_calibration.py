"""Calibrate the per-step latency model (persistent_rnn/latency.py) on the recorded H200 runs.

For every recorded run under ``bench/results/h200-2026-11-23*`` that measured persistent points,
the kernels of the commit that ran (named in the run's README.md) are rebuilt from that commit's
``cuda_src`` with NVRTC through the current builder (no GPU needed), the model predicts each
recorded persistent point (microseconds per step of a call of T steps: the steps plus the
per-call terms spread over T), and the script prints predicted against measured per point with
the median and worst relative error. ``--fit`` refits the few fitted constants of
``hardware.py`` (block barrier, host work per forward and backward call) by least
squares on the relative errors and prints them; ``--json`` prints the whole comparison as JSON
(the committed record is ``bench/results/model-calibration-2026-11-24.json``).

    PYTHONPATH=$PWD python bench/model_calibration.py [--json] [--fit]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

import numpy as np

from persistent_rnn import benchmark
from persistent_rnn import hardware as hw
from persistent_rnn import latency
from persistent_rnn import plan as planner

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUN_GLOB = "h200-2026-11-23*"
FITTED = ("BLOCK_BARRIER", "HOST_FORWARD_US", "HOST_BACKWARD_US")


def run_commit(run: Path) -> str | None:
    """The commit a recorded run names in its README.md ("Commit: <sha>")."""
    match = re.search(r"Commit: ([0-9a-f]{7,40})", (run / "README.md").read_text())
    return match.group(1) if match else None


def recorded_points(run: Path) -> list[dict]:
    """Every persistent point of a run's JSON files that ran without restart or fallback."""
    points = []
    for path in sorted(run.rglob("*.json")):
        data = json.loads(path.read_text())
        input_size = _input_size(data.get("settings", {}))
        for p in data.get("points", data.get("rows", [])) if isinstance(data, dict) else []:
            if isinstance(p, dict) and p.get("algo") == "persistent" and not p.get("restarts") \
                    and p.get("fallback") is None and p.get("dtype", "float32") == "float32":
                points.append({**p, "input_size": input_size, "file": str(path.relative_to(RESULTS))})
    return points


def _input_size(settings: dict) -> int:
    if "input_size" in settings:
        return settings["input_size"]
    nested = [s.get("input_size") for s in settings.values() if isinstance(s, dict)]
    return next((s for s in nested if s), 64)


def checkout_sources(commit: str, into: Path) -> Path:
    """That commit's ``cuda_src`` (``git archive``) under ``into``; its path."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "cuda_src"],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "cuda_src"


def grid_plan(cell, hidden: int, batch: int, device) -> planner.Plan:
    """The plan those commits made: the first grid tile that serves ``hidden`` (they had no
    cluster tiles and the same grid tiles; their shared memory was smaller than today's)."""
    for tile in planner.tiles_for(cell):
        if planner.tile_max_hidden(cell, tile) >= hidden and -(-hidden // tile.units) <= device.sm_count:
            return planner.Plan(True, None, tile, planner.pass_plan(cell, tile, False, hidden, batch),
                                planner.pass_plan(cell, tile, True, hidden, batch))
    raise ValueError(f"{cell.name} H={hidden}: no grid tile serves it")


def predict_point(p: dict, src: Path, device) -> dict:
    """The model's µs per step for a recorded point, with the terms of both passes."""
    cell = planner.resolve_cell(p["cell"])
    plan = grid_plan(cell, p["hidden_size"], p["batch"], device)
    st = latency.predict_plan(cell, p["hidden_size"], p["batch"], plan, device, src,
                              seq_len=p["seq_len"], input_size=p["input_size"])
    both = p["pass"] == "forward_backward"
    return {"predicted_us": st.benchmark_us(p["seq_len"], both),
            "forward_terms": latency.terms_dict(st.forward),
            "backward_terms": latency.terms_dict(st.backward) if both else None,
            "call_us": st.forward_call_us + (st.backward_call_us if both else 0.0)}


def evaluate(points: list[dict], device) -> list[dict]:
    """Predictions for ``points`` (each carrying its ``src``) with the constants now in hardware."""
    with ThreadPoolExecutor(max_workers=2) as pool:  # compiles of both commits in parallel
        preds = list(pool.map(lambda p: predict_point(p, p["src"], device), points))
    rows = []
    for p, pred in zip(points, preds):
        err = pred["predicted_us"] / p["us_per_step"] - 1.0
        rows.append({k: p[k] for k in ("run", "commit", "file", "cell", "pass", "batch",
                                       "hidden_size", "seq_len")}
                    | {"measured_us": p["us_per_step"], **pred, "error": err})
    return rows


def fit(points: list[dict], device) -> dict[str, float]:
    """Least squares on the relative errors for the ``FITTED`` constants. The model is linear in
    them (piecewise, through the pointwise critical path), so each point's sensitivity is taken
    from one evaluation per constant."""
    base = {name: getattr(hw, name) for name in FITTED}
    pred0 = np.array([r["predicted_us"] for r in evaluate(points, device)])
    columns = []
    for name in FITTED:
        setattr(hw, name, base[name] * 2)
        columns.append((np.array([r["predicted_us"] for r in evaluate(points, device)]) - pred0) / base[name])
        setattr(hw, name, base[name])
    a = np.stack(columns, axis=1)
    free = pred0 - a @ np.array([base[n] for n in FITTED])
    measured = np.array([p["us_per_step"] for p in points])
    weights = 1.0 / measured
    x, *_ = np.linalg.lstsq(a * weights[:, None], (measured - free) * weights, rcond=None)
    return dict(zip(FITTED, (float(v) for v in x)))


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"points": len(rows), "median_abs_error": statistics.median(errors),
            "worst_abs_error": max(errors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--fit", action="store_true", help="refit the fitted constants first")
    args = parser.parse_args(argv)
    device = hw.PROFILES["h200"]
    with tempfile.TemporaryDirectory() as tmp:
        points = []
        for run in sorted(RESULTS.glob(RUN_GLOB)):
            commit = run_commit(run) if (run / "README.md").is_file() else None
            found = recorded_points(run) if commit else []
            if found:
                src = checkout_sources(commit, Path(tmp) / commit)
                points += [{**p, "run": run.name, "commit": commit, "src": src} for p in found]
        if args.fit:
            fitted = fit(points, device)
            for name, value in fitted.items():
                setattr(hw, name, value)
            print("fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in fitted.items()), file=sys.stderr)
        rows = evaluate(points, device)
    result = {"device_profile": device.name, "constants": {n: getattr(hw, n) for n in FITTED},
              "command": "PYTHONPATH=$PWD python bench/model_calibration.py --json",
              "nvrtc": benchmark.nvrtc_version(),  # the SASS the predictions read depends on it
              **summary(rows), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{'run':22} {'cell':8} {'pass':16} {'B':>3} {'H':>5} {'measured':>9} {'predicted':>9} {'error':>7}")
        for r in rows:
            print(f"{r['run']:22} {r['cell']:8} {r['pass']:16} {r['batch']:3d} {r['hidden_size']:5d} "
                  f"{r['measured_us']:9.2f} {r['predicted_us']:9.2f} {100 * r['error']:+6.1f}%")
        print(f"{result['points']} points: median |error| {100 * result['median_abs_error']:.1f} %, "
              f"worst {100 * result['worst_abs_error']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
