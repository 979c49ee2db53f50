"""Shared plumbing of the bench/ study scripts: arguments, the GPU check, the JSON + PNG they write.

Every study writes ``<out>/<name>.json`` (schema_version, device, driver, cuda, commit, command,
date, settings, rows) and ``<out>/<name>.png``. Without a GPU a study exits with status 2 and says
why, since its figures only mean something on one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from persistent_rnn import benchmark

SCHEMA_VERSION = 1


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every study takes (``--out``, ``--quick``)."""
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time budget of the sweep")
    return p


def require_gpu(name: str) -> None:
    """Exit with status 2 and a clear message where no CUDA device is visible."""
    if not benchmark.gpu_available():
        print(f"bench/{name}.py: needs a CUDA GPU (CuPy sees none); nothing measured", file=sys.stderr)
        sys.exit(2)


def document(settings: dict[str, Any], rows: list[dict], gpu: bool = True) -> dict[str, Any]:
    """A study's results: device (the CPU where not ``gpu``), driver, CUDA, commit, command, date,
    settings and rows."""
    device = benchmark.device_record(gpu=gpu)
    return {"schema_version": SCHEMA_VERSION, **device,
            **benchmark.run_stamp(["python", *sys.argv]),
            "settings": settings, "rows": rows}


def save(out: Path, name: str, doc: dict[str, Any], draw: Callable[[Any, dict[str, Any]], None]) -> None:
    """Write ``<name>.json`` and ``<name>.png`` (``draw(axes, doc)`` fills one matplotlib axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, doc)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{name}: {doc['device']}, commit {doc['commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / name}.json and .png")


def tflops_lines(x_key: str, x_label: str) -> Callable[[Any, dict[str, Any]], None]:
    """A ``draw`` for ``save``: TFLOP/s against ``x_key`` (log 2 axis), one line per
    (cell, algo, pass); forward solid, forward+backward dashed."""
    def draw(ax, doc: dict[str, Any]) -> None:
        for key in sorted({(p["cell"], p["algo"], p["pass"]) for p in doc["rows"]}):
            pts = sorted((p[x_key], p["tflops"]) for p in doc["rows"]
                         if (p["cell"], p["algo"], p["pass"]) == key)
            ax.plot(*zip(*pts), marker="o", label=" ".join(key),
                    linestyle="-" if key[2] == "forward" else "--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel("TFLOP/s (recurrence)")
        ax.legend(fontsize=6, ncol=2)
    return draw
