"""Where a resident decoder's step spends its time, stage by stage (issue 29): the probe's stamps.

    python bench/decoder_probe.py --out DIR [--steps 200] [--cpu]

A captured loop of LSTM H=640 B=1 decoder steps measured 6.36 µs of device time per step on an
H200 (2026-11-27) where the latency model predicted 1.95 µs (4.59 with its hand-offs priced as
measured exchange rounds since). This runs the decoder with its
kernels built with the probe (``decoder.PROBE_ENV``: ``resident_decoder.cu``'s
``PRNN_DECODER_PROBE``, which stamps each stage of a step with ``%globaltimer``) for LSTM H=640
B=1 and H=256 B=1, each step's input the last step's h: a loop of ``--steps`` steps captured in
a CUDA graph and replayed (``resume()`` first), and the same loop eagerly, each after a warm-up.
Per loop it prints, per interval between two stamps (``INTERVALS``), its median, mean and 90th
percentile in ns over the loop's steps (the first left out: its wait began before the loop) -
and, where one thread took both stamps, its median by that SM's clock (``clock64``, stamped
beside; ``%globaltimer`` may tick far coarser than a ns: the smallest step between the loop's
stamps is printed as the tick) -, the failed polls of each wait (``post_polls``: resident CTA 0
waiting for the post; ``done_polls``: the step kernel's thread 0 waiting for its slices' done
words; each poll sleeps ``__nanosleep(20)``), and beside them the model's terms
(``latency.predict_decoder_step``, labelled predicted). Writes ``DIR/decoder_probe.json`` (after
each size) and the raw rows (uint64: ``decoder.PROBE_WORDS``, their SM clocks, each CTA's post
seen and done word released; ``decoder.probe_buffer``) in ``DIR/decoder_probe_rows.npz``.

``--free-polls N``: each size again with its kernels' hand-off waits polling N times before they
sleep between polls (``decoder.FREE_POLLS_ENV``; the shipped kernels sleep ``__nanosleep(20)``
after every failed poll), its results marked ``free_polls`` N beside the shipped kernels' (0):
whether the sleeps' wake-ups lengthen the hand-offs.

``--cpu``: the emulation (NumPy; its timer is a virtual clock: the figures mean nothing), LSTM
H=64 B=1 (4 resident CTAs), the eager loop only, a few steps - a check of the probe's plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import persistent_rnn as prnn
from persistent_rnn import benchmark, decoder, hardware, latency
from persistent_rnn.runtime import planning_device

SIZES = (("LSTM", 640, 1), ("LSTM", 256, 1))
CPU_SIZES = (("LSTM", 64, 1),)  # (4 resident CTAs)
CPU_STEPS = 6
W = {name: i for i, name in enumerate(decoder.PROBE_WORDS)}
# The stamps of the step kernel's thread 0 and resident CTA 0 in the order of a step, each no
# earlier than the one before; and the other stamps' order: (earlier, later) - "first_*",
# "last_*": the earliest and latest of every resident CTA's, "cta_*" each CTA's own
CHAIN = ("start", "posting", "post_seen", "staged", "projected", "gathered", "pointwise",
         "publishing", "done_seen", "end")
ORDERED = (("wait_start", "post_seen"), ("posting", "first_post_seen"),
           ("cta_post_seen", "cta_publishing"), ("last_publishing", "done_seen"))
CLOCKED = CHAIN + ("wait_start",)  # stamped with the SM's clock too
BEFORE = "the step before's "  # an interval from a stamp of the step before


@dataclass(frozen=True)
class Interval:
    """From stamp ``frm`` to ``to`` of a step (``frm`` may be BEFORE + a stamp); ``term``: the
    model's term set beside it (a key of ``predict_decoder_step``'s record);
    ``same_cta``: both stamps by one thread, so also timed by its SM's clock."""
    name: str
    frm: str
    to: str
    term: str | None = None
    same_cta: bool = False


INTERVALS = (
    Interval("gap_before", BEFORE + "end", "start", "graph_gap_us"),
    Interval("launch_to_post", "start", "posting", same_cta=True),
    Interval("post_seen_cta0", "posting", "post_seen", "handoff_round_us"),
    Interval("post_seen_last_cta", "posting", "last_post_seen", "handoff_round_us"),
    Interval("post_seen_spread", "first_post_seen", "last_post_seen"),
    Interval("staged", "post_seen", "staged", "round_trip_us", same_cta=True),
    Interval("projected_warp0", "staged", "projected", "projection_us", same_cta=True),
    Interval("gathered", "projected", "gathered", same_cta=True),
    Interval("pointwise", "gathered", "pointwise", "resident_step_us", same_cta=True),
    Interval("to_publish", "pointwise", "publishing", same_cta=True),
    Interval("last_cta_publish", "publishing", "last_publishing"),
    Interval("publish_spread", "first_publishing", "last_publishing"),
    Interval("done_seen", "last_publishing", "done_seen", "handoff_round_us"),
    Interval("exit", "done_seen", "end", same_cta=True),
    Interval("step_kernel", "start", "end", "kernel_us", same_cta=True),
    Interval("period", BEFORE + "start", "start", "captured_us"),
    # resident CTA 0 between steps: every slice's done word of the step before seen, then the
    # recurrent half computed ahead (wait_for_layer, staging, the product)
    Interval("ahead_part", BEFORE + "publishing", "wait_start", "ahead_us", same_cta=True),
)
POLLS = ("post_polls", "done_polls")


def chains(rows: np.ndarray, ctas: int) -> dict[str, np.ndarray]:
    """Per stage of CHAIN (and the polls, the step, whether the ahead part was used), one value
    per step of the loop, steps in order, the loop's first left out; 0 where a stamp is missing;
    ``<stage>@clock``: the SM's clock at a CLOCKED stamp. ``rows``: the probe buffer after the
    loop (zeroed before it), ``ctas`` the resident CTAs."""
    taken = rows[rows[:, W["step"]] != 0]
    taken = taken[np.argsort(taken[:, W["step"]])][1:].astype(np.int64)
    seen = taken[:, decoder.PROBE_CTA_WORDS:][:, :ctas]
    done = taken[:, decoder.PROBE_CTA_WORDS + decoder.PROBE_CTAS:][:, :ctas]
    out = {name: taken[:, W[name]] for name in decoder.PROBE_WORDS}
    out.update({f"{name}@clock": taken[:, decoder.PROBE_CHAIN + W[name]] for name in CLOCKED})
    for name, stamps in (("post_seen", seen), ("publishing", done)):
        whole = stamps.min(axis=1) > 0  # (a CTA's missing stamp: the stage's missing)
        out[f"first_{name}"] = np.where(whole, stamps.min(axis=1), 0)
        out[f"last_{name}"] = np.where(whole, stamps.max(axis=1), 0)
    out["cta_post_seen"], out["cta_publishing"] = seen, done
    stamps = np.concatenate([seen.ravel(), done.ravel()] + [out[n] for n in CLOCKED])
    out["tick"] = np.diff(np.unique(stamps[stamps > 0]))
    return out


def problems(chain: dict[str, np.ndarray]) -> list[str]:
    """What is wrong with a loop's stamps: a step whose stamp is missing, or stamped before one
    it follows (CHAIN, ORDERED)."""
    found = []
    steps = chain["step"]
    if len(steps) == 0:
        return ["no steps stamped"]
    names = {n for pair in ORDERED for n in pair} | set(CHAIN) | {f"{n}@clock" for n in CLOCKED}
    for name in sorted(names):
        missing = steps[(chain[name] == 0).reshape(len(steps), -1).any(axis=1)]
        if len(missing):
            found.append(f"{name}: no stamp in steps {missing.tolist()}")
    for before, after in list(zip(CHAIN, CHAIN[1:])) + list(ORDERED):
        bad = steps[(chain[after] < chain[before]).reshape(len(steps), -1).any(axis=1)]
        if len(bad):
            found.append(f"{after} before {before} in steps {bad.tolist()}")
    if not np.all(np.diff(steps) == 1):
        found.append(f"steps not consecutive: {steps.tolist()}")
    return found


def span(chain: dict[str, np.ndarray], i: Interval, suffix: str = "") -> np.ndarray:
    """``i``'s values per step, of the timer (ns) or, ``suffix`` "@clock", of the SM's clock."""
    if i.frm.startswith(BEFORE):
        return chain[i.to + suffix][1:] - chain[i.frm[len(BEFORE):] + suffix][:-1]
    return chain[i.to + suffix] - chain[i.frm + suffix]


def cycles_per_ns(chain: dict[str, np.ndarray]) -> float | None:
    """The SM clock's rate: resident CTA 0's clock over the timer from the loop's first post
    seen to its last (None for fewer than two steps)."""
    t, c = chain["post_seen"], chain["post_seen@clock"]
    return float((c[-1] - c[0]) / (t[-1] - t[0])) if len(t) > 1 and t[-1] > t[0] else None


def summary(chain: dict[str, np.ndarray], predicted: dict[str, Any]) -> dict[str, Any]:
    """Per interval, the median, mean and 90th percentile in ns (the timer's; the mean of a
    coarse timer's ticks still converges), the median by the SM's clock where one thread took
    both stamps, and the model's term; the polls; the timer's tick and the clock's rate."""
    # (the step kernel's own time: a captured step less the gap before it - what a profiler's
    # kernel time, 6.36 µs on the H200, is)
    terms = dict(predicted, graph_gap_us=hardware.GRAPH_GAP_US,
                 kernel_us=predicted["captured_us"] - hardware.GRAPH_GAP_US)
    rate = cycles_per_ns(chain)
    out: dict[str, Any] = {"steps": len(chain["step"]), "cycles_per_ns": rate,
                           "timer_tick_ns": int(chain["tick"].min()) if len(chain["tick"]) else None,
                           "intervals": {}}
    for i in INTERVALS:
        ns = span(chain, i)
        clock = span(chain, i, "@clock") if i.same_cta and rate else None
        out["intervals"][i.name] = {
            "from": i.frm, "to": i.to,
            "median_ns": float(np.median(ns)), "mean_ns": float(np.mean(ns)),
            "p90_ns": float(np.percentile(ns, 90)),
            "clock_median_ns": None if clock is None else float(np.median(clock)) / rate,
            "predicted_ns": None if i.term is None or terms.get(i.term) is None
            else 1e3 * terms[i.term], "predicted_term": i.term}
    for name in POLLS:
        out[name] = {"median": float(np.median(chain[name])), "max": int(chain[name].max())}
    out["ahead_used_share"] = float(np.mean(chain["ahead"] == 1))
    return out


def table(title: str, s: dict[str, Any]) -> str:
    """``summary`` as text."""
    def num(v):
        return "-" if v is None else f"{v:.0f}"
    lines = [f"== {title}: {s['steps']} steps; ns (timer tick {num(s['timer_tick_ns'])} ns; "
             f"clock: by the SM's clock, {s['cycles_per_ns'] or 0:.2f} cycles/ns; predicted: "
             f"the latency model's terms)",
             f"{'interval':20s} {'median':>8s} {'mean':>8s} {'p90':>8s} {'clock':>8s} "
             f"{'predicted':>9s}  from -> to"]
    for name, r in s["intervals"].items():
        lines.append(f"{name:20s} {num(r['median_ns']):>8s} {num(r['mean_ns']):>8s} "
                     f"{num(r['p90_ns']):>8s} {num(r['clock_median_ns']):>8s} "
                     f"{num(r['predicted_ns']):>9s}  {r['from']} -> {r['to']}")
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
               raw: dict[str, np.ndarray], free_polls: int = 0) -> list[dict[str, Any]]:
    """Both loops of one size: a result per loop (its raw rows into ``raw``); ``free_polls``
    > 0: its kernels built with that many free polls (``decoder.FREE_POLLS_ENV``)."""
    if free_polls:
        os.environ[decoder.FREE_POLLS_ENV] = str(free_polls)
    try:
        return _probe_size(mode, hidden, batch, steps, cpu, raw, free_polls)
    finally:
        os.environ.pop(decoder.FREE_POLLS_ENV, None)


def _probe_size(mode: str, hidden: int, batch: int, steps: int, cpu: bool,
                raw: dict[str, np.ndarray], free_polls: int) -> list[dict[str, Any]]:
    if cpu:
        xp = np
    else:
        import cupy as xp
    predicted = latency.predict_decoder_step(mode, hidden, batch, device=planning_device(not cpu))
    cell = getattr(prnn, f"{mode}Cell")(hidden, hidden, seed=0, algo="persistent")
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
            if not cpu:  # (the fill, on the current stream, before the graph's stream runs)
                xp.cuda.get_current_stream().synchronize()
            run()
            rows = buffer if cpu else buffer.get()
            key = f"{mode}_{hidden}_{batch}_{road}" + (f"_free{free_polls}" if free_polls else "")
            raw[key] = rows.copy()
            chain = chains(rows, dec.sms_held)
            s = summary(chain, predicted)
            results.append({"cell": mode, "hidden": hidden, "batch": batch, "road": road,
                            "free_polls": free_polls, "ctas": dec.sms_held, "rows": key,
                            "problems": problems(chain), **s, "predicted": predicted})
            polls = f", {free_polls} free polls" if free_polls else ""
            print(table(f"{mode} H={hidden} B={batch}, {road} loop{polls}", s), flush=True)
            for p in results[-1]["problems"]:
                print(f"  stamp problem: {p}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cpu", action="store_true", help="the emulation, a tiny size, a few steps")
    p.add_argument("--free-polls", type=int, default=0,
                   help="each size again with its hand-off waits polling this many times "
                        "before they sleep (0: not)")
    args = p.parse_args(argv)
    if args.free_polls < 0:
        p.error(f"--free-polls must be >= 0, got {args.free_polls}")
    steps = CPU_STEPS if args.cpu else args.steps
    if not 2 <= steps < decoder.PROBE_STEPS:
        p.error(f"--steps must be 2 to {decoder.PROBE_STEPS - 1} (the probe's rows)")
    os.environ[decoder.PROBE_ENV] = "1"  # (read when a decoder is made)
    raw: dict[str, np.ndarray] = {}
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [(size, polls) for size in (CPU_SIZES if args.cpu else SIZES)
            for polls in ((0, args.free_polls) if args.free_polls else (0,))]
    for (mode, hidden, batch), polls in runs:
        try:
            results += probe_size(mode, hidden, batch, steps, args.cpu, raw, polls)
        except Exception as exc:  # noqa: BLE001 -- a size that fails is reported, the next runs
            print(f"{mode} H={hidden} B={batch}: {type(exc).__name__}: {exc}", flush=True)
            results.append({"cell": mode, "hidden": hidden, "batch": batch,
                            "error": f"{type(exc).__name__}: {exc}"})
        write(args.out, steps, args.cpu, results, raw)  # (after each size: a run cut short keeps it)
    return 0 if all("error" not in r for r in results) else 1


def write(out: Path, steps: int, cpu: bool, results: list[dict[str, Any]],
          raw: dict[str, np.ndarray]) -> None:
    """``out/decoder_probe.json`` and the raw rows, ``out/decoder_probe_rows.npz``."""
    doc = {**benchmark.run_stamp(["python", *sys.argv]), "cpu": cpu, "steps": steps,
           "timing": "%globaltimer stamps (ns) and SM clocks in the kernels, over a loop's steps",
           "words": list(decoder.PROBE_WORDS), "results": results}
    (out / "decoder_probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    np.savez_compressed(out / "decoder_probe_rows.npz", **raw)


if __name__ == "__main__":
    sys.exit(main())
