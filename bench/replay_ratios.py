"""Interleaved before / after runs of the replayed stand-in, summed up: the ratios the latency
model's per-call Python takes (``hardware.PYTHON_*_US``, ``PYTHON_GROUP_US``).

    python bench/replay_ratios.py BEFORE AFTER [--results DIR]

Reads ``DIR/replayed-<BEFORE>-<config>-before-N/call_breakdown.json`` and
``DIR/replayed-<AFTER>-<config>-after-N/...`` (``bench/call_breakdown.py --stubbed`` runs; configs
``single``, ``layers3``, ``pair1``, ``nostack3``) for every N both have, and prints per config
the forward and backward (forward+backward less forward, per run) stand-in: medians of the runs'
medians, their range, the median of the pairs' after / before ratios, and for the multi-chain
configs the increment per further layer-direction over the same round's single layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FORWARD = "persistent forward, replayed stand-in (layer API)"
BOTH = "persistent forward+backward, replayed stand-in (layer API)"
CONFIGS = ("single", "layers3", "pair1", "nostack3")
FURTHER = {"layers3": 2, "pair1": 1, "nostack3": 2}  # layer-directions beyond the first


def stand_in(folder: Path) -> tuple[float, float]:
    """(forward, backward) µs of one run: its rows' medians."""
    rows = {r["entry"]: r["median_us"]
            for r in json.loads((folder / "call_breakdown.json").read_text())["rows"]}
    return rows[FORWARD], rows[BOTH] - rows[FORWARD]


def runs(results: Path, sha: str, side: str, config: str) -> dict[int, tuple[float, float]]:
    """Run number -> stand-in of every run of ``sha``'s ``config`` on ``side``."""
    found = {}
    for folder in results.glob(f"replayed-{sha}-{config}-{side}-*"):
        if folder.is_dir():
            found[int(folder.name.rsplit("-", 1)[1])] = stand_in(folder)
    return found


def report(results: Path, before: str, after: str) -> list[str]:
    """The summary lines (module docstring)."""
    got = {(c, s): runs(results, sha, s, c) for c in CONFIGS
           for s, sha in (("before", before), ("after", after))}
    pairs = sorted(set.intersection(*(set(r) for r in got.values())))
    lines = [f"pairs: {pairs}"]
    for config in CONFIGS:
        for i, what in enumerate(("forward", "backward")):
            b = [got[config, "before"][n][i] for n in pairs]
            a = [got[config, "after"][n][i] for n in pairs]
            line = (f"{config:9s} {what:8s} before {statistics.median(b):6.1f} "
                    f"({min(b):.1f}-{max(b):.1f}) after {statistics.median(a):6.1f} "
                    f"({min(a):.1f}-{max(a):.1f}) ratio "
                    f"{statistics.median([y / x for x, y in zip(b, a)]):.3f}")
            if config in FURTHER:
                inc = {side: [(got[config, side][n][i] - got["single", side][n][i])
                              / FURTHER[config] for n in pairs] for side in ("before", "after")}
                line += (f" | increment before {statistics.median(inc['before']):5.1f} after "
                         f"{statistics.median(inc['after']):5.1f} ratio "
                         f"{statistics.median([y / x for x, y in zip(*inc.values())]):.3f}")
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--results", type=Path,
                        default=Path(__file__).parent / "results" / "cpu-2026-11-27")
    args = parser.parse_args(argv)
    print("\n".join(report(args.results, args.before, args.after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
