"""Where a resident decoder's step spends its time, stage by stage (issue 29): the probe's stamps.

    python bench/decoder_probe.py --out DIR [--steps 200] [--cpu]

A captured loop of LSTM H=640 B=1 decoder steps measured 6.36 µs of device time per step on an
H200 (2026-11-27) where the latency model predicts 1.95 µs. This runs the decoder with its
kernels built with the probe (``decoder.PROBE_ENV``: ``resident_decoder.cu``'s
``PRNN_DECODER_PROBE``, which stamps each stage of a step with ``%globaltimer``) for LSTM H=640
B=1 and H=256 B=1, each step's input the last step's h: a loop of ``--steps`` steps captured in
a CUDA graph and replayed (``resume()`` first), and the same loop eagerly, each after a warm-up.
Per loop it prints, per interval between two stamps, the median and 90th percentile in ns over
the loop's steps (the first left out: its wait began before the loop), the failed polls of each
wait (``post_polls``: resident CTA 0 waiting for the post; ``done_polls``: the step kernel's
thread 0 waiting for its slices' done words; each poll sleeps ``__nanosleep(20)``), and beside
them the model's terms (``latency.predict_decoder_step``, labelled predicted). Writes
``DIR/decoder_probe.json`` and the raw rows (uint64 ns, ``decoder.PROBE_WORDS`` then each CTA's
post seen and done word released) in ``DIR/decoder_probe_rows.npz``.

``--cpu``: the emulation (NumPy; its timer is a virtual clock: the figures mean nothing), LSTM
H=16 B=1, the eager loop only, a few steps - a check of the probe's plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

import persistent_rnn as prnn
from persistent_rnn import benchmark, decoder, hardware, latency
from persistent_rnn.runtime import planning_device

SIZES = (("LSTM", 640, 1), ("LSTM", 256, 1))
CPU_SIZES = (("LSTM", 16, 1),)
CPU_STEPS = 6
W = {name: i for i, name in enumerate(decoder.PROBE_WORDS)}
# The stages in the order of a step (each stamped after the one before it; "last_*": the
# latest of every resident CTA's), and the intervals between them: (name, from, to, the model's
# term it is set beside - a key of predict_decoder_step's record, a share of it, or None)
CHAIN = ("start", "posting", "post_seen", "last_post_seen", "staged", "projected", "gathered",
         "pointwise", "publishing", "last_publishing", "done_seen", "end")
INTERVALS = (
    ("gap_before", "end of the step before", "start", "graph_gap_us", 1.0),
    ("launch_to_post", "start", "posting", None, 0.0),
    ("post_seen_cta0", "posting", "post_seen", "handoff_us", 1 / 3),
    ("post_seen_last_cta", "posting", "last_post_seen", "handoff_us", 1 / 3),
    ("staged", "post_seen", "staged", "handoff_us", 1 / 3),
    ("projected_warp0", "staged", "projected", "projection_us", 1.0),
    ("gathered", "projected", "gathered", None, 0.0),
    ("pointwise", "gathered", "pointwise", "resident_step_us", 1.0),
    ("to_publish", "pointwise", "publishing", None, 0.0),
    ("last_cta_publish", "publishing", "last_publishing", None, 0.0),
    ("done_seen", "last_publishing", "done_seen", "handoff_us", 1 / 3),
    ("exit", "done_seen", "end", None, 0.0),
    ("step_kernel", "start", "end", None, 0.0),
    ("period", "start of the step before", "start", "captured_us", 1.0),
)
POLLS = ("post_polls", "done_polls")


def chains(rows: np.ndarray, ctas: int) -> dict[str, np.ndarray]:
    """Per stage of CHAIN (and the polls, the step, whether the ahead part was used), one value
    per step of the loop, steps in order, the loop's first left out; 0 where a stamp is missing.
    ``rows``: the probe buffer after the loop (zeroed before it), ``ctas`` the resident CTAs."""
    taken = rows[rows[:, W["step"]] != 0]
    taken = taken[np.argsort(taken[:, W["step"]])][1:].astype(np.int64)
    seen = taken[:, decoder.PROBE_CTA_WORDS:decoder.PROBE_CTA_WORDS + ctas]
    done = taken[:, decoder.PROBE_CTA_WORDS + decoder.PROBE_CTAS:][:, :ctas]
    out = {name: taken[:, W[name]] for name in decoder.PROBE_WORDS}
    out["last_post_seen"] = np.where(seen.min(axis=1) > 0, seen.max(axis=1), 0)
    out["last_publishing"] = np.where(done.min(axis=1) > 0, done.max(axis=1), 0)
    return out


def problems(chain: dict[str, np.ndarray]) -> list[str]:
    """What is wrong with a loop's stamps: a step whose stamp is missing, or stamped before the
    stage it follows (CHAIN; resident CTA 0's wait begins before it sees the post)."""
    found = []
    steps = chain["step"]
    if len(steps) == 0:
        return ["no steps stamped"]
    for name in CHAIN + ("wait_start",):
        missing = steps[chain[name] == 0]
        if len(missing):
            found.append(f"{name}: no stamp in steps {missing.tolist()}")
    for before, after in list(zip(CHAIN, CHAIN[1:])) + [("wait_start", "post_seen")]:
        bad = steps[chain[after] < chain[before]]
        if len(bad):
            found.append(f"{after} before {before} in steps {bad.tolist()}")
    if not np.all(np.diff(steps) == 1):
        found.append(f"steps not consecutive: {steps.tolist()}")
    return found


def intervals(chain: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each INTERVALS entry's ns per step (the ones over the step before: from the second on)."""
    out = {}
    for name, frm, to, _, _ in INTERVALS:
        if frm == "end of the step before":
            out[name] = chain[to][1:] - chain["end"][:-1]
        elif frm == "start of the step before":
            out[name] = np.diff(chain[to])
        else:
            out[name] = chain[to] - chain[frm]
    return out


def summary(chain: dict[str, np.ndarray], predicted: dict[str, Any]) -> dict[str, Any]:
    """Medians and 90th percentiles (ns) of the intervals and polls, the model's terms beside."""
    terms = dict(predicted, graph_gap_us=hardware.GRAPH_GAP_US)
    out: dict[str, Any] = {"steps": len(chain["step"]), "intervals": {}}
    for name, values in intervals(chain).items():
        _, frm, to, key, share = next(i for i in INTERVALS if i[0] == name)
        out["intervals"][name] = {
            "from": frm, "to": to, "median_ns": float(np.median(values)) if len(values) else None,
            "p90_ns": float(np.percentile(values, 90)) if len(values) else None,
            "predicted_ns": None if key is None or terms.get(key) is None
            else 1e3 * share * terms[key], "predicted_term": key}
    for name in POLLS:
        out[name] = {"median": float(np.median(chain[name])), "max": int(chain[name].max())}
    out["ahead_used_share"] = float(np.mean(chain["ahead"] == 1))
    return out


def table(title: str, s: dict[str, Any]) -> str:
    lines = [f"== {title}: {s['steps']} steps (ns; predicted: the latency model's terms)",
             f"{'interval':20s} {'median':>9s} {'p90':>9s} {'predicted':>10s}  from -> to"]
    for name, r in s["intervals"].items():
        pred = "-" if r["predicted_ns"] is None else f"{r['predicted_ns']:.0f}"
        lines.append(f"{name:20s} {r['median_ns'] or 0:9.0f} {r['p90_ns'] or 0:9.0f} {pred:>10s}"
                     f"  {r['from']} -> {r['to']}")
    for name in POLLS:
        lines.append(f"{name:20s} median {s[name]['median']:.0f}, max {s[name]['max']}")
    lines.append(f"ahead part used in {100 * s['ahead_used_share']:.0f} % of the steps")
    return "\n".join(lines)


def _loop(dec, x0, steps: int):
    def loop():
        x, state = x0, None
        for _ in range(steps):
            state = dec.step(x, state)
            x = state[0]
        return x
    return loop


def _roads(xp, dec, loop, cpu: bool):
    """(name, run) of each loop to probe: eager, and (a GPU) captured in a CUDA graph and
    replayed after ``resume()``; each run ends with its steps done."""
    def eager():
        loop()
        if not cpu:
            xp.cuda.get_current_stream().synchronize()
    roads = [("eager", eager)]
    if not cpu:
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            loop()
            graph = stream.end_capture()

        def captured():
            dec.resume()
            graph.launch(stream)
            stream.synchronize()
        roads.insert(0, ("captured", captured))
    return roads


def probe_size(mode: str, hidden: int, batch: int, steps: int, cpu: bool,
               raw: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Both loops of one size: a result per loop (its raw rows into ``raw``)."""
    if cpu:
        xp = np
    else:
        import cupy as xp
    device = planning_device(not cpu)
    predicted = latency.predict_decoder_step(mode, hidden, batch, device=device)
    cell = getattr(prnn, f"{mode}Cell")(hidden, hidden, seed=0)
    x0 = xp.asarray(np.random.default_rng(0).standard_normal((batch, hidden)).astype(np.float32))
    cell.params = {k: xp.asarray(v) for k, v in cell.params.items()}  # (no step run to move them)
    results = []
    with cell.decoder(batch=batch) as dec:
        if not dec.resident:
            return [{"cell": mode, "hidden": hidden, "batch": batch, "error": dec.reason}]
        buffer = decoder.probe_buffer(dec)
        loop = _loop(dec, x0, steps)
        for road, run in _roads(xp, dec, loop, cpu):
            run()  # warm-up
            buffer.fill(0)
            run()
            rows = buffer if cpu else buffer.get()
            key = f"{mode}_{hidden}_{batch}_{road}"
            raw[key] = rows.copy()
            chain = chains(rows, dec.sms_held)
            s = summary(chain, predicted)
            results.append({"cell": mode, "hidden": hidden, "batch": batch, "road": road,
                            "ctas": dec.sms_held, "rows": key, "problems": problems(chain),
                            **s, "predicted": predicted})
            print(table(f"{mode} H={hidden} B={batch}, {road} loop", s), flush=True)
            for p in results[-1]["problems"]:
                print(f"  stamp problem: {p}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cpu", action="store_true", help="the emulation, a tiny size, a few steps")
    args = p.parse_args(argv)
    steps = CPU_STEPS if args.cpu else args.steps
    if not 2 <= steps < decoder.PROBE_STEPS:
        p.error(f"--steps must be 2 to {decoder.PROBE_STEPS - 1} (the probe's rows)")
    os.environ[decoder.PROBE_ENV] = "1"  # (read when a decoder is made)
    raw: dict[str, np.ndarray] = {}
    results = []
    for mode, hidden, batch in CPU_SIZES if args.cpu else SIZES:
        try:
            results += probe_size(mode, hidden, batch, steps, args.cpu, raw)
        except Exception as exc:  # noqa: BLE001 -- a size that fails is reported, the next runs
            print(f"{mode} H={hidden} B={batch}: {type(exc).__name__}: {exc}", flush=True)
            results.append({"cell": mode, "hidden": hidden, "batch": batch,
                            "error": f"{type(exc).__name__}: {exc}"})
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**benchmark.run_stamp(["python", *sys.argv]), "cpu": args.cpu, "steps": steps,
           "timing": "%globaltimer stamps in the kernels (ns), medians over a loop's steps",
           "words": list(decoder.PROBE_WORDS), "results": results}
    (args.out / "decoder_probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    np.savez_compressed(args.out / "decoder_probe_rows.npz", **raw)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
