"""Calibrate the per-step latency model (persistent_rnn/latency.py) on recorded GPU runs.

Default (``--runs current``): the runs of today's kernels, 2026-11-26 (``CURRENT_RUNS``): the H200's
(``bench/results/h200-2026-11-26``: the persistent forward's per-step slope between T=1000 and
T=3000, ``gpu_call_cost.json``; the device time of the persistent kernels per T=100 call from
torch.profiler, ``call_kernels.json``; the whole T=100 forward replayed as a CUDA graph) and the
H100's (``bench/results/h100-2026-11-26``: slopes and graph replays of commits ef140d4 and 31db1e5,
predicted with today's kernels' SASS: the persistent kernels' code changed little since, the SASS
not at all for the moves that followed). The model predicts each point from the kernels the planner
picks (NVRTC, no GPU) and the script prints predicted against measured with the median and worst
relative error. ``--fit`` refits ``FITTED`` (least squares on the relative errors, each clipped to
its range in ``FIT_RANGES``) and prints them; ``--json`` prints the comparison as JSON (the
committed record: ``bench/results/model-calibration-2026-11-26.json``). ``--runs old``: the
counter-barrier kernels' runs of 2026-11-23 (rebuilt from their commits' ``cuda_src``; the record
``bench/results/model-calibration-2026-11-24.json``, fitted then on ``OLD_FITTED``). ``--runs
2026-11-27``: the H200's run of that day (``RUNS_2026_11_27``; no fit, its record
``bench/results/model-calibration-2026-11-27.json``), predicted with its cluster passes' inputs
fetched two steps ahead, as they ran.

    PYTHONPATH=$PWD python bench/model_calibration.py [--runs current|2026-11-27|old] [--json] [--fit]
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
from contextlib import nullcontext
from dataclasses import replace
from io import BytesIO
from pathlib import Path

import numpy as np

from persistent_rnn import benchmark
from persistent_rnn import hardware as hw
from persistent_rnn import latency
from persistent_rnn import plan as planner
from persistent_rnn import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_call_cost import planner_setting  # noqa: E402 (a sibling script)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUN_GLOB = "h200-2026-11-23*"
OLD_FITTED = ("BLOCK_BARRIER", "HOST_FORWARD_US", "HOST_BACKWARD_US")
# The runs of today's kernels: (run, device profile, kind, file). Kinds: "slope" (gpu_call_cost's
# per-step slopes of the persistent forward), "graph" (its T=100 forward replayed as a CUDA graph:
# the whole call on the device), "kernels" (torch.profiler's device time of the persistent kernels
# per T=100 call, call_kernels.json).
CURRENT_RUNS = (
    ("h200-2026-11-26", "h200", "slope", "call1-fresh/gpu_call_cost.json"),
    ("h200-2026-11-26", "h200", "graph", "call1-fresh/gpu_call_cost.json"),
    ("h200-2026-11-26", "h200", "kernels", "call2/call_kernels.json"),
    ("h100-2026-11-26", "h100", "slope", "call_cost_after/gpu_call_cost.json"),
    ("h100-2026-11-26", "h100", "slope", "call_cost_before/gpu_call_cost.json"),
    ("h100-2026-11-26", "h100", "graph", "call_cost_after/gpu_call_cost.json"),
)
# The H200's run of 2026-11-27 (commit a1f19a2, call 2; e12ca4a, call 4: the persistent kernels
# the same): each call's slopes and graph replays as points of their own.
RUNS_2026_11_27 = (
    ("h200-2026-11-27", "h200", "slope", "call2-fresh/gpu_call_cost.json"),
    ("h200-2026-11-27", "h200", "slope", "call4/gpu_call_cost.json"),
    ("h200-2026-11-27", "h200", "graph", "call2-fresh/gpu_call_cost.json"),
    ("h200-2026-11-27", "h200", "graph", "call4/gpu_call_cost.json"),
    ("h200-2026-11-27", "h200", "kernels", "call2-fresh/call_kernels.json"),
)
RUN_SETS = {"current": CURRENT_RUNS, "2026-11-27": RUNS_2026_11_27}
# What a run's kernels did that today's plans no longer do: the 2026-11-26 runs predate the
# backward mma tile and the launches' own settles; the 2026-11-27 run's cluster passes fetched
# their inputs two steps ahead (plan.CLUSTER_INPUTS_AHEAD 2 until 34e0d78).
PREDATES_SETTLES = {"h200-2026-11-26", "h100-2026-11-26"}
INPUTS_AHEAD = {"h200-2026-11-27": 2}
CALL_STEPS, CALL_INPUT = 100, 64  # gpu_call_cost.py's graph replay: T and input size
FITTED = ("BLOCK_BARRIER", "EXCHANGE_TRAFFIC_EXPOSED", "PREFETCH_LATENCY")
# Each fitted constant stays within what public figures or our measurements allow (hardware.py
# says why): a block barrier from a bare bar.sync (~20 cycles) to twice the earlier fit; a share;
# an L2 hit unloaded (222 cycles) to the measured one-CTA exchange round (1713).
FIT_RANGES = {"BLOCK_BARRIER": (20.0, 600.0), "EXCHANGE_TRAFFIC_EXPOSED": (0.0, 1.0),
              "PREFETCH_LATENCY": (222.0, 1713.0)}
LAYER = re.compile(r"^(?P<cell>[a-z_]+?)_h(?P<hidden>\d+)_b(?P<batch>\d+)(?:_(?P<dtype>float\d+|bfloat16))?$")


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


def layer_of(name: str) -> tuple[str, int, int, str]:
    """(cell, H, B, dtype) of a recorded layer name: "gru_h256_b1", "lstm_h1024_b8_float16"."""
    m = LAYER.match(name)
    if m is None:
        raise ValueError(f"not a layer name: {name!r}")
    return m["cell"], int(m["hidden"]), int(m["batch"]), m["dtype"] or "float32"


def current_points(runs: tuple = CURRENT_RUNS) -> list[dict]:
    """Every measured point of ``runs`` (``RUN_SETS``): what was measured (``measured_us``, µs per step,
    per call or per call's kernels), of which layer, pass and kernel launches."""
    points = []
    for run, device, kind, name in runs:
        data = json.loads((RESULTS / run / name).read_text())
        base = {"run": run, "device": device, "kind": kind, "file": f"{run}/{name}",
                "commit": data.get("commit")}
        if kind == "slope":
            points += [{**base, "layer": s["layer"], "pass": "forward", "measured_us": s["us_per_step"]}
                       for s in data["slopes"]]
        elif kind == "graph":
            points += [{**base, "layer": g["layer"], "pass": "forward", "measured_us": g["graph_us"]}
                       for g in data["graphs"] if g.get("graph_us")]
        else:
            for row in data["rows"]:
                layer, passes, road = row["case"].split()
                for kernel, cost in row["kernels"].items():
                    which = {"prnn_persistent_forward": "forward",
                             "prnn_persistent_backward": "backward"}.get(kernel)
                    # the forward's once, from the forward-only call
                    if which and road == "prnn_torch" and (which == "backward" or passes == "fwd"):
                        points.append({**base, "layer": layer, "pass": which,
                                       "measured_us": cost["us_per_call"],
                                       "launches": round(cost["count_per_call"])})
    return points


def predict_current(p: dict) -> dict:
    """The model's figure for a point of ``current_points`` with the constants now in hardware:
    the kernel step (slope), the whole T=100 forward on the device (graph: steps and the per-call
    device terms) or the persistent kernel's device time per T=100 call (kernels:
    ``latency.pass_kernel_us``)."""
    cell, hidden, batch, dtype = layer_of(p["layer"])
    spec, device = planner.resolve_cell(cell), hw.PROFILES[p["device"]]
    ahead = INPUTS_AHEAD.get(p["run"])
    with planner_setting("CLUSTER_INPUTS_AHEAD", ahead) if ahead else nullcontext():
        plan = planner.make_plan(spec, hidden, batch, dtype, device)
    backward, old = p["pass"] == "backward", p["run"] in PREDATES_SETTLES
    pp = plan.backward if backward else plan.forward
    if old and pp.defines.get("PRNN_MMA") == 2:  # the runs predate the backward mma tile: the same
        # tile's CUDA-core backward ran
        pp = replace(pp, defines={k: v for k, v in pp.defines.items() if k != "PRNN_MMA"})
    terms = latency.step_terms(latency.pass_sass(pp, device.arch),
                               latency.PassShape(spec, pp, batch, hidden), device)
    if p["kind"] == "slope":
        predicted = terms.total_us
    elif p["kind"] == "graph":  # (a run predating the launches' own settles: its chain had a
        # settle kernel after each launch and one memset more, no settle at a launch's end)
        old_chain_us = ((settings.current().max_restarts + 2) * hw.EMPTY_LAUNCH_US
                        - latency.SETTLE_TAIL_US) if old else 0.0
        predicted = CALL_STEPS * terms.total_us + old_chain_us + latency.call_us(
            spec, hidden, batch, CALL_STEPS, CALL_INPUT, False, device)
    else:
        predicted = latency.pass_kernel_us(terms.total_us, pp, CALL_STEPS, backward, p["launches"])
    return {"predicted_us": predicted, "terms": latency.terms_dict(terms),
            "placement": "cluster" if pp.defines.get("PRNN_CLUSTER") else "grid"}


def evaluate_current(points: list[dict]) -> list[dict]:
    """``current_points`` with the model's figure and its relative error."""
    rows = []
    for p in points:
        pred = predict_current(p)
        rows.append({**p, **pred, "error": pred["predicted_us"] / p["measured_us"] - 1.0})
    return rows


def fit(names: tuple[str, ...], predict, measured: np.ndarray,
        ranges: dict[str, tuple[float, float]] | None = None) -> dict[str, float]:
    """Least squares on the relative errors for the constants ``names`` of hardware.py;
    ``predict()`` gives every point's figure with the constants now set. The model is linear in
    each (piecewise: the pointwise critical path, the prefetch's max), so each point's
    sensitivity is taken from one evaluation per constant; a value outside its range is clipped
    and the others refitted with it held."""
    ranges = ranges or {}
    base = {name: getattr(hw, name) for name in names}
    pred0 = np.asarray(predict())
    columns = []
    for name in names:
        step = base[name] if base[name] else 1.0
        setattr(hw, name, base[name] + step)
        columns.append((np.asarray(predict()) - pred0) / step)
        setattr(hw, name, base[name])
    a = np.stack(columns, axis=1)
    free = pred0 - a @ np.array([base[n] for n in names])
    weights = 1.0 / measured
    held: dict[int, float] = {}
    while True:
        fixed = free + sum(a[:, i] * v for i, v in held.items())
        cols = [i for i in range(len(names)) if i not in held]
        x = dict(held)
        if cols:
            sol, *_ = np.linalg.lstsq(a[:, cols] * weights[:, None], (measured - fixed) * weights,
                                      rcond=None)
            x.update(zip(cols, sol))
        out = [i for i in cols if not ranges.get(names[i], (-np.inf, np.inf))[0] <= x[i]
               <= ranges.get(names[i], (-np.inf, np.inf))[1]]
        if not out:
            return {names[i]: float(x[i]) for i in range(len(names))}
        lo, hi = ranges[names[out[0]]]
        held[out[0]] = float(min(max(x[out[0]], lo), hi))


def summary(rows: list[dict], key: str = "error") -> dict:
    errors = [abs(r[key]) for r in rows]
    return {"points": len(rows), "median_abs_error": statistics.median(errors),
            "worst_abs_error": max(errors)}


def old_main(args) -> int:
    """The counter-barrier kernels' runs of 2026-11-23 (``RUN_GLOB``)."""
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
            measured = np.array([p["us_per_step"] for p in points])
            fitted = fit(OLD_FITTED, lambda: [r["predicted_us"] for r in evaluate(points, device)],
                         measured)
            for name, value in fitted.items():
                setattr(hw, name, value)
            print("fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in fitted.items()), file=sys.stderr)
        rows = evaluate(points, device)
    result = {"device_profile": device.name, "constants": {n: getattr(hw, n) for n in OLD_FITTED},
              "command": "PYTHONPATH=$PWD python bench/model_calibration.py --runs old --json",
              "nvrtc": benchmark.nvrtc_version(), **summary(rows), "rows": rows}
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


def current_result(fit_first: bool, runs: str = "current") -> dict:
    """The comparison on the run set ``runs`` of ``RUN_SETS`` (fitting ``FITTED`` first if
    asked): the constants, the exchange constants measured, and per point the figure before
    (``baseline_us``: the model as committed before this calibration, when given) and after."""
    points = current_points(RUN_SETS[runs])
    if fit_first:
        measured = np.array([p["measured_us"] for p in points])
        fitted = fit(FITTED, lambda: [predict_current(p)["predicted_us"] for p in points],
                     measured, FIT_RANGES)
        for name, value in fitted.items():
            setattr(hw, name, round(value, 3))
        print("fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in fitted.items()), file=sys.stderr)
    rows = evaluate_current(points)
    return {"device_profiles": sorted({p["device"] for p in points}),
            "constants": {n: getattr(hw, n) for n in FITTED}, "fit_ranges": FIT_RANGES,
            "measured_constants": {"EXCHANGE_ROUND_NS": hw.EXCHANGE_ROUND_NS,
                                   "CLUSTER_ROUND_NS": hw.CLUSTER_ROUND_NS,
                                   "DSMEM_STORE_NS": hw.DSMEM_STORE_NS},
            "command": RUN_COMMANDS[runs],
            "notes": ["every figure but measured_us is the latency model's prediction",
                      *RUN_NOTES[runs]],
            "nvrtc": benchmark.nvrtc_version(), **summary(rows), "rows": rows}


RUN_COMMANDS = {
    "current": "PYTHONPATH=$PWD python bench/model_calibration.py --json --baseline "
               "<the model before this calibration's figures>",
    "2026-11-27": "PYTHONPATH=$PWD python bench/model_calibration.py --runs 2026-11-27 --json"}
RUN_NOTES = {
    "current": ["h100 points: commits ef140d4 / 31db1e5, predicted from today's kernels' SASS",
                "baseline_us: the model before the 2026-11-26 calibration (commit eda4312); "
                "on 'kernels' points it had no launch term: its steps only"],
    "2026-11-27": ["commits a1f19a2 (call2-fresh) and e12ca4a (call4), predicted from today's "
                   "kernels' SASS with the cluster passes' inputs two steps ahead "
                   "(plan.CLUSTER_INPUTS_AHEAD 2, three buffers), as they ran; no refit: the "
                   "constants of the 2026-11-26 calibration"]}


def cluster_store_slope(table: dict[int, float]) -> float:
    """ns per store instruction into another CTA's shared memory: the least-squares slope of a
    measured cluster round against its CTA count (``hw.DSMEM_STORE_NS``)."""
    ctas = np.array(sorted(table), dtype=float)
    return float(np.polyfit(ctas, [table[int(n)] for n in ctas], 1)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", choices=(*RUN_SETS, "old"), default="current",
                        help="today's kernels' runs (2026-11-26), the H200's of 2026-11-27 or "
                             "the counter-barrier kernels'")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--fit", action="store_true", help="refit the fitted constants first")
    parser.add_argument("--baseline", type=Path,
                        help="a committed record whose rows' figures to show as 'before'")
    args = parser.parse_args(argv)
    if args.runs == "old":
        return old_main(args)
    result = current_result(args.fit, args.runs)
    if args.baseline:
        before = {(r["file"], r["kind"], r["layer"], r["pass"]): r.get("baseline_us", r["predicted_us"])
                  for r in json.loads(args.baseline.read_text())["rows"]}
        for r in result["rows"]:
            r["baseline_us"] = before.get((r["file"], r["kind"], r["layer"], r["pass"]))
            if r["baseline_us"] is not None:
                r["baseline_error"] = r["baseline_us"] / r["measured_us"] - 1.0
    result["dsmem_store_slope_ns"] = cluster_store_slope(hw.CLUSTER_ROUND_NS)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'run':16} {'kind':8} {'layer':22} {'pass':8} {'measured':>9} {'before':>9} {'after':>9} {'error':>7}")
    for r in result["rows"]:
        before = f"{r['baseline_us']:9.2f}" if r.get("baseline_us") is not None else f"{'':9}"
        print(f"{r['run']:16} {r['kind']:8} {r['layer']:22} {r['pass']:8} {r['measured_us']:9.2f} "
              f"{before} {r['predicted_us']:9.2f} {100 * r['error']:+6.1f}%")
    print(f"{result['points']} points: median |error| {100 * result['median_abs_error']:.1f} %, "
          f"worst {100 * result['worst_abs_error']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
