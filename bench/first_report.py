"""The summary of the first GPU call (bench/first_call.py ``report``): tables and a verdict.

Reads what the steps recorded in OUT (``env.json``, ``predict.jsonl``, ``correct.jsonl``,
``stall.jsonl``, ``time.jsonl``, ``time_tf32.jsonl``, the suite's ``steps.jsonl``; whatever is
missing is reported as missing) and returns the summary document and its text: the steps'
status, each case's errors and path, the stalls, and the timing table - µs per step of every
algorithm at T = 100, the per-step slope between T = 100 and 300 and the per-call cost, beside
the latency model's *predictions* (kernel step and whole call) and the measured-over-predicted
ratios; the TF32 layer's row (``first_cases.TF32_TIMING``) under the same layer's fp32 row, and
its figures set beside that row's persistent and cuDNN ones.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from first_cases import TF32_TIMING, TIMING, TIMING_ALGOS

from persistent_rnn import benchmark

ALGO_SHORT = {"persistent": "pers", "gemm": "gemm", "prnn_torch": "prt", "cudnn": "cudnn"}


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ([] where it is missing; a torn line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _f(value: Any, spec: str = "8.2f") -> str:
    width = int(spec.split(".")[0] or 0)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-".rjust(width)
    return format(value, spec)


def item_line(r: dict) -> str:
    """One line for a finished item of ``correct``, ``stall`` or ``time``."""
    verdict = "ok" if r.get("ok") else "FAIL: " + "; ".join(r.get("problems", []))[:300]
    if "us_per_step" in r:
        return f"{r['name']:44} {r['us_per_step']:9.3f} us/step  {verdict}"
    if "restart_bitwise" in r:
        return (f"{r['name']:36} restarts {r['stalled_forward']['restarts']}/"
                f"{r['stalled_backward']['restarts']}, bitwise {r['restart_bitwise']}: {verdict}")
    if "err_f64" in r:
        return (f"{r['name']:36} {r['dtype']:8} err f64 {_f(r['err_f64'], '9.2e')} torch.nn "
                f"{_f(r.get('err_torch_nn'), '9.2e')} path {(r['forward'] or {}).get('placement')}"
                f"  {verdict}")
    return f"{r['name']:36} {verdict}"


def prediction_line(r: dict) -> str:
    """One line for a prediction record."""
    what = f"{r['name']:36} {r['cell']} H={r['hidden']} B={r['batch']} {r['dtype']}"
    if not r.get("ok"):
        return f"{what}: no prediction: {'; '.join(r.get('problems', []))[:300]}"
    if "note" in r:
        return f"{what}: no prediction: {r['note']}"
    if "stack_fits" in r:
        return (f"{what} x{r['layers']}{' bidirectional' if r['bidirectional'] else ''}: stack "
                f"fits {r['stack_fits']}, forward pass {_f(r['forward_pass_us_t100'], '.1f')} us "
                "at T=100 (predicted)")
    return (f"{what}{' TF32' if r.get('tf32') else ''}: {r['placement']} {r['forward_ctas']} "
            f"CTAs, {r['forward_us']:.2f} / {r['backward_us']:.2f} us per step fwd/bwd "
            "(predicted)")


def _done(rows: list[dict]) -> list[dict]:
    """The finished items, and as failed those that started and never finished (the step was
    killed in them and not run again)."""
    done = [r for r in rows if r.get("phase") == "done"]
    finished = {r.get("name") for r in done}
    for r in rows:
        if r.get("phase") == "start" and r["name"] not in finished:
            finished.add(r["name"])
            done.append({"name": r["name"], "ok": False, "hung": True,
                         "problems": ["killed by the step's time limit while running"]})
    return done


def timing_rows(points: list[dict], predictions: dict[str, dict]) -> list[dict]:
    """Per (config, pass): each algorithm's µs/step at the shorter T, slope and per-call cost,
    beside the model's kernel step and whole-call prediction."""
    rows = []
    by_key = {(p["config"], p["pass"], p["algo"], p["seq_len"]): p for p in points if "us_per_step" in p}
    seq_lens = sorted({p["seq_len"] for p in points if "seq_len" in p})
    for config in (TIMING[0], TF32_TIMING, *TIMING[1:]):  # (TF32 under its fp32 layer)
        for pass_ in benchmark.PASSES:
            row: dict[str, Any] = {"config": config.name, "pass": pass_}
            for algo in TIMING_ALGOS:
                got = {t: by_key.get((config.name, pass_, algo, t)) for t in seq_lens}
                first = got.get(seq_lens[0]) if seq_lens else None
                if first is None:
                    continue
                row[f"{algo}_us_per_step"] = first["us_per_step"]
                row[f"{algo}_clean"] = all(p["ok"] for p in got.values() if p)
                row["spread"] = max(row.get("spread", 0.0), first.get("spread", 0.0))
                last = got.get(seq_lens[-1])
                if last is not None and len(seq_lens) > 1:
                    slope = (last["call_us"] - first["call_us"]) / (seq_lens[-1] - seq_lens[0])
                    row[f"{algo}_slope_us"] = slope
                    row[f"{algo}_per_call_us"] = first["call_us"] - slope * seq_lens[0]
                if first.get("predicted_us_per_step") is not None:
                    row["predicted_call_us_per_step"] = first["predicted_us_per_step"]
            model = predictions.get(config.name)
            if model and model.get("ok"):
                row["placement"] = model["placement"]
                row["predicted_step_us"] = model["forward_us"] + (
                    model["backward_us"] if pass_ == "forward_backward" else 0.0)
            if row.get("persistent_slope_us") and row.get("predicted_step_us"):
                row["slope_over_predicted"] = row["persistent_slope_us"] / row["predicted_step_us"]
            if row.get("persistent_us_per_step") and row.get("cudnn_us_per_step"):
                row["persistent_over_cudnn"] = row["persistent_us_per_step"] / row["cudnn_us_per_step"]
            rows.append(row)
    _beside_fp32(rows)
    return rows


def _beside_fp32(rows: list[dict]) -> None:
    """The TF32 rows' persistent figure over the same layer's fp32 persistent and cuDNN ones
    (``tf32_over_fp32``, ``persistent_over_cudnn``: from the fp32 row of the same pass)."""
    fp32 = {r["pass"]: r for r in rows if r["config"] == TIMING[0].name}
    for row in rows:
        twin = fp32.get(row["pass"]) if row["config"] == TF32_TIMING.name else None
        ours = row.get("persistent_us_per_step")
        if twin is None or not ours:
            continue
        if twin.get("persistent_us_per_step"):
            row["tf32_over_fp32"] = ours / twin["persistent_us_per_step"]
        if twin.get("cudnn_us_per_step"):
            row["persistent_over_cudnn"] = ours / twin["cudnn_us_per_step"]


def _tf32_text(rows: list[dict]) -> list[str]:
    """The TF32 layer beside the same layer in fp32 and cuDNN's (µs per step at the shorter T,
    each with the model's prediction)."""
    fp32 = {r["pass"]: r for r in rows if r["config"] == TIMING[0].name}
    lines = [f"TF32 ({TF32_TIMING.name}, allow_tf32; us per step, pred: the model's PREDICTION "
             "of the whole call per step):"]
    for row in rows:
        if row["config"] != TF32_TIMING.name:
            continue
        twin = fp32.get(row["pass"], {})
        lines.append(f"  {('fwd' if row['pass'] == 'forward' else 'fwd+bwd'):7} tf32 "
                     f"{_f(row.get('persistent_us_per_step'), '.2f')} (pred "
                     f"{_f(row.get('predicted_call_us_per_step'), '.2f')}), fp32 "
                     f"{_f(twin.get('persistent_us_per_step'), '.2f')} (pred "
                     f"{_f(twin.get('predicted_call_us_per_step'), '.2f')}), cudnn "
                     f"{_f(twin.get('cudnn_us_per_step'), '.2f')}; tf32/fp32 "
                     f"{_f(row.get('tf32_over_fp32'), '.2f')}, tf32/cudnn "
                     f"{_f(row.get('persistent_over_cudnn'), '.2f')}")
    return lines if len(lines) > 1 else lines + ["  none recorded"]


def _cell(row: dict, algo: str) -> str:
    """µs per step of ``algo`` in 7 characters, the last a '!' where a call restarted or fell back."""
    value = row.get(f"{algo}_us_per_step")
    if value is None:
        return f"{'-':>7}"
    return f"{value:6.2f}" + (" " if row.get(f"{algo}_clean", True) else "!")


def _timing_text(rows: list[dict], seq_lens: list[int]) -> list[str]:
    lo, hi = (seq_lens[0], seq_lens[-1]) if seq_lens else ("-", "-")
    lines = [f"timing (us per step; whole call at T={lo} / T; slope: per-step cost from T={lo} "
             f"and {hi}; call: the per-call cost in us; pred: the latency model's PREDICTION, "
             "kernel step / whole call per step at T=100; spread: (max - min) / median of the "
             "repeats, the worst column's; '!': restarts or fallback in a call)",
             f"{'config':20} {'pass':7} {'path':7} " + " ".join(
                 f"{ALGO_SHORT[a]:>7}" for a in TIMING_ALGOS)
             + f" {'slope':>7} {'call':>8} {'pred':>6} {'pr.call':>7} {'sl/pr':>6} {'p/cudnn':>7}"
             f" {'spread':>6}"]
    for r in rows:
        cells = " ".join(_cell(r, a) for a in TIMING_ALGOS)
        lines.append(f"{r['config']:20} {('fwd' if r['pass'] == 'forward' else 'fwd+bwd'):7} "
                     f"{r.get('placement', '-'):7} {cells} {_f(r.get('persistent_slope_us'), '7.2f')} "
                     f"{_f(r.get('persistent_per_call_us'), '8.1f')} "
                     f"{_f(r.get('predicted_step_us'), '6.2f')} "
                     f"{_f(r.get('predicted_call_us_per_step'), '7.2f')} "
                     f"{_f(r.get('slope_over_predicted'), '6.2f')} "
                     f"{_f(r.get('persistent_over_cudnn'), '7.2f')} {_f(r.get('spread'), '6.2f')}")
    return lines


def build(out: Path) -> tuple[dict, str]:
    """The summary document and its text (see the module docstring)."""
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    steps = read_jsonl(out / "steps.jsonl")
    predictions = _done(read_jsonl(out / "predict.jsonl"))
    cases, stalls = _done(read_jsonl(out / "correct.jsonl")), _done(read_jsonl(out / "stall.jsonl"))
    points = _done(read_jsonl(out / "time.jsonl")) + _done(read_jsonl(out / "time_tf32.jsonl"))
    by_name = {p["name"]: p for p in predictions}
    rows = timing_rows(points, by_name)
    seq_lens = sorted({p["seq_len"] for p in points if "seq_len" in p})
    failed = [r["name"] for r in (*cases, *stalls, *points) if not r.get("ok")]
    hung = [r["name"] for r in (*cases, *stalls, *points) if r.get("hung")]
    bad_steps = [s["step"] for s in steps if s.get("status") not in ("ok", "dry")]
    verdict = {"cases": len(cases), "cases_ok": sum(r["ok"] for r in cases),
               "stalls": len(stalls), "stalls_ok": sum(r["ok"] for r in stalls),
               "points": len(points), "points_ok": sum(r["ok"] for r in points),
               "predictions_failed": [p["name"] for p in predictions if not p["ok"]],
               "failed": failed, "hung": hung, "steps_not_ok": bad_steps,
               "all_ok": bool(cases) and not failed and not bad_steps}
    versions = env.get("versions", {})
    lines = [f"first call on {env.get('device', '?')}: commit {env.get('commit', '?')}, "
             f"{env.get('date', '?')}, NVRTC {versions.get('nvrtc')}, torch {versions.get('torch')}, "
             f"cupy {versions.get('cupy-cuda13x') or versions.get('cupy-cuda12x')}, nvdisasm "
             f"{(env.get('tools') or {}).get('model nvdisasm')}",
             "steps: " + (", ".join(f"{s['step']} {s['status']} ({s['seconds']}/{s['limit']} s)"
                                    for s in steps) or "no steps.jsonl"), "",
             "correctness (persistent_rnn.torch algo='persistent'; err: max|a-ref|/max|ref| over "
             "every output and gradient against float64 on the CPU and torch.nn on the device):"]
    lines += [item_line(r) for r in cases] or ["  none recorded"]
    lines += ["", "stall + restart (bits equal to the run without the stall):"]
    lines += [item_line(r) for r in stalls] or ["  none recorded"]
    lines += [""] + _timing_text(rows, seq_lens) + [""] + _tf32_text(rows)
    lines += ["", f"verdict: cases {verdict['cases_ok']}/{verdict['cases']} ok, stalls "
              f"{verdict['stalls_ok']}/{verdict['stalls']} ok, timing points "
              f"{verdict['points_ok']}/{verdict['points']} clean; failed: "
              f"{', '.join(failed) or 'none'}; hung: {', '.join(hung) or 'none'}; steps not ok: "
              f"{', '.join(bad_steps) or 'none'}"]
    doc = {"env": env, "steps": steps, "predictions": predictions, "correctness": cases,
           "stalls": stalls, "timing": {"points": points, "table": rows}, "verdict": verdict}
    return doc, "\n".join(lines)
