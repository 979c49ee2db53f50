"""Compile every shipped persistent-kernel configuration and report its resource use.

``kernel_records`` compiles each cell's forward and backward kernel for every tile the planner
can choose, for each architecture, with NVRTC (no GPU needed; cached by ``kernels``), and reads
ptxas' report back: registers per thread and spill bytes. The library requires zero spills and
registers within the plan. Command line: ``prnn kernels --arch 80,90 --json`` or
``python -m persistent_rnn.kernel_report --arch 80,90 --json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from . import kernels, plan as planner
from .cells import CELLS

REPORT_BATCH = 8  # shared memory is reported for the largest batch algo="auto" runs persistently


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers and spill bytes from an ``-Xptxas=-v`` log (one kernel per compilation)."""
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    if regs is None or stores is None or loads is None:
        raise RuntimeError(f"unexpected ptxas report:\n{log}")
    return {"registers": int(regs.group(1)),
            "spill_bytes": int(stores.group(1)) + int(loads.group(1))}


def _jobs(archs):
    for cell in CELLS.values():
        for tile in planner.tiles_for(cell):
            hidden = planner.tile_max_hidden(cell, tile)
            for backward in (False, True):
                p = planner.pass_plan(cell, tile, backward, hidden, REPORT_BATCH)
                for arch in archs:
                    yield cell, p, arch


def _record(job) -> dict:
    cell, p, arch = job
    compiled = kernels.compile_source(p.source, p.defines, arch)
    return {"cell": cell.name, "pass": "backward" if "backward" in p.kernel else "forward",
            "arch": arch, "config": dict(p.defines), "hidden_size": p.max_hidden,
            "block": p.block, "weights_per_thread": p.weights_per_thread,
            **parse_ptxas(compiled.log), "shared_bytes": p.shared_bytes,
            "planned_registers": p.registers}


def kernel_records(archs=("sm_80", "sm_90")) -> list[dict]:
    """One record per shipped (cell, tile, pass, arch): ``cell``, ``pass``, ``arch``, ``config``
    (the -D macros), ``hidden_size`` (largest H the configuration serves), ``registers``,
    ``spill_bytes``, ``shared_bytes`` (dynamic shared memory at batch 8) and
    ``planned_registers`` (the register cap the planner counts on)."""
    archs = [a if str(a).startswith("sm_") else f"sm_{a}" for a in archs]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return list(pool.map(_record, list(_jobs(archs))))


def main(argv: list[str] | None = None) -> int:
    """``kernels --arch 80,90 [--json]``: print the records (JSON or a table); exit 1 on spills."""
    parser = argparse.ArgumentParser(prog="prnn kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    records = kernel_records(tuple(f"sm_{a.strip()}" for a in args.arch.split(",") if a.strip()))
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(f"{'cell':9} {'pass':8} {'arch':6} {'H max':>6} {'block':>5} {'weights':>7} "
              f"{'regs':>4}/{'plan':<4} {'spill':>5} {'smem@B8':>8}")
        for r in records:
            print(f"{r['cell']:9} {r['pass']:8} {r['arch']:6} {r['hidden_size']:6d} {r['block']:5d} "
                  f"{r['weights_per_thread']:7d} {r['registers']:4d}/{r['planned_registers']:<4d} "
                  f"{r['spill_bytes']:5d} {r['shared_bytes']:8d}")
    bad = [r for r in records if r["spill_bytes"] or r["registers"] > r["planned_registers"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
