"""Print a short summary of a bench/run_gpu_suite.sh output directory.

    python bench/summarize.py DIR

Reads what is there (missing files are reported, not fatal): the device and fp32 peak, the best
TFLOP/s per algorithm at batch 1, 4 and 8 from the bench sweep, the grid-barrier floor and the
restart cost.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"  {path.name}: not available ({type(exc).__name__})")
        return None


def bench_lines(results: dict) -> list[str]:
    """Best TFLOP/s per (pass, batch, algo) over cells and hidden sizes, with the peak fraction."""
    lines = []
    for pass_ in ("forward", "forward_backward"):
        for batch in (1, 4, 8):
            best: dict[str, dict] = {}
            for p in (p for p in results["points"] if p["pass"] == pass_ and p["batch"] == batch):
                if p["tflops"] > best.get(p["algo"], {"tflops": -1.0})["tflops"]:
                    best[p["algo"]] = p
            cells = ", ".join(f"{a} {p['tflops']:.2f} ({p['cell']} H={p['hidden_size']}"
                              + (f", {100 * p['peak_fraction']:.1f}% peak)" if p["peak_fraction"] else ")")
                              for a, p in sorted(best.items()))
            lines.append(f"  {pass_:16} B={batch}: {cells or '-'}")
    return lines


def main(argv: list[str]) -> int:
    """Summarise ``argv[0]``."""
    out = Path(argv[0])
    info = _load(out / "info.json")
    if info and info.get("gpu"):
        dev = info["device"]
        print(f"  device: {dev['name']}, fp32 peak {dev['fp32_peak_tflops']:.1f} TFLOP/s")
    elif info:
        print(f"  device: {info['reason']}")
    results = _load(out / "bench" / "bench_results.json")
    if results:
        print(f"  bench: {len(results['points'])} points, {len(results['skipped'])} skipped; best TFLOP/s:")
        print("\n".join(bench_lines(results)))
    barrier = _load(out / "barrier_latency.json")
    if barrier and barrier["rows"]:
        last = barrier["rows"][-1]
        print(f"  grid barrier: {last['ns_per_barrier']:.0f} ns at {last['grid']} CTAs "
              f"(1 CTA: {barrier['rows'][0]['ns_per_barrier']:.0f} ns)")
    restart = _load(out / "restart_cost.json")
    if restart:
        costs = [r["cost_us"] for r in restart["rows"] if r["restarts"] > 0]
        print(f"  restart cost: median {statistics.median(costs):.0f} us over {len(costs)} stalls"
              if costs else "  restart cost: no run restarted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["."]))
