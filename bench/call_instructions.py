"""Instructions a planned call executes on the CPU, counted by callgrind: deterministic, unlike times.

    python bench/call_instructions.py [--out DIR] [--calls 300] [--cell GRU|LSTM] [--parts]

The layer API's persistent layer (H=8, B=1, T=1, the emulated path) as a GPU replays it in
steady state - the replayed stand-in of ``bench/call_breakdown.py --stubbed`` (the graph key
built over the call's arrays, ``id`` for device pointers, hashed as its look-up hashes it; the
replay and the emulated launches stubbed), its stubs set once rather than around every call.
Each row runs in its own ``valgrind --tool=callgrind`` process that counts instructions only
inside ``functools.reduce`` (``--toggle-collect``), through which the child makes ``--calls``
calls after its warm-up: start-up, imports and warm-up are not counted, and the count is the same
run after run on any load (times on the shared 2-core machine move by 10-20 %). Per call, less
the loop's own (the ``nothing`` row). ``--parts``: also the forward's parts, each called alone
with the arguments of a steady-state call (``matches``, ``Plan.forward``, ``PreparedPass.run``,
the key ``PreparedPass.arguments_key``, two ``numpy.empty``).

Python calls (tests/test_call_cost.py) are not the cost: an interpreted bytecode is some tens of
instructions, a Python frame a few hundred, and a change that removes frames may add as much in
dicts, tuples and their deallocation. Writes ``DIR/call_instructions.json`` with ``--out``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

ROWS = ("forward", "forward+backward")
PARTS = ("matches", "Plan.forward", "PreparedPass.run", "PreparedPass.arguments_key", "numpy.empty x2")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _stand_in(cell: str) -> dict[str, Callable[[], object]]:
    """The replayed stand-in's calls by row name (the stubs set for the process)."""
    import persistent_rnn as prnn
    from persistent_rnn import chain_graphs, emulate, launch, runtime
    sys.path.insert(0, str(Path(__file__).parent))
    from call_breakdown import _host_addresses, _host_value, _looked_up
    layer = getattr(prnn, cell)(8, 8, algo="persistent", seed=0)
    x = np.random.default_rng(0).standard_normal((1, 1, 8)).astype(np.float32)
    dy = np.ones((1, 1, 8), np.float32)
    for _ in range(3):  # (planned for real: kernels built, caches filled)
        layer.forward(x)
        layer.backward(dy)
    emulate.EmulatedModule._launch = lambda self, *args, **named: None
    launch.Chain.on_device = True
    chain_graphs.value, chain_graphs.addresses = _host_value, _host_addresses
    chain_graphs.run = _looked_up

    def step() -> object:
        layer.forward(x)
        return layer.backward(dy)
    for _ in range(3):
        step()
    plan = layer._plan
    arrays = runtime.forward_arrays(plan.results, plan.h0, plan.c0, None)
    arrays.update(x=x, x_given=None, out=np.empty(plan.y_shape, np.float32),
                  h_n=np.empty(plan.state_shape, np.float32))
    if plan.c0 is not None:
        arrays["c_n"] = np.empty(plan.c_shape, np.float32)
    params, prepared = layer.params, plan.forward_pass
    return {"forward": lambda: layer.forward(x), "forward+backward": step,
            "matches": lambda: plan.matches(x, None, params, layer.algo, None),
            "Plan.forward": lambda: plan.forward(x, None, params, None),
            "PreparedPass.run": lambda: prepared.run(arrays, captured=False),
            "PreparedPass.arguments_key": lambda: prepared.arguments_key(arrays),
            "numpy.empty x2": lambda: (np.empty(plan.y_shape, np.float32),
                                       np.empty(plan.state_shape, np.float32)),
            "nothing": lambda: None}


def child(row: str, calls: int, cell: str) -> None:
    """In the callgrind process: warm the row up, then make ``calls`` calls inside
    ``functools.reduce`` (the only region counted)."""
    call = _stand_in(cell)[row]
    for _ in range(50):
        call()
    functools.reduce(lambda done, _: call(), range(calls), None)


def count(row: str, calls: int, cell: str, script: str = __file__) -> int:
    """Instructions of ``calls`` calls of ``row`` (a callgrind process of its own, running
    ``script --child row``: this script's stand-in, or another script's with the same child
    arguments, ``bench/step_instructions.py``)."""
    command = ["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
               "--callgrind-out-file=/dev/null", sys.executable, script, "--child", row,
               "--calls", str(calls), "--cell", cell]
    env = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env},
                          check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind of {row!r} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def count_rows(rows: Sequence[str], calls: int, cell: str, what: str, script: str = __file__
               ) -> tuple[float, list[dict]]:
    """Each of ``rows`` counted (``count``) less the loop's own (the ``nothing`` row), per
    ``what`` ("call", "step"), printed as it comes; ``(loop, rows' records)``."""
    loop = count("nothing", calls, cell, script) / calls
    done = []
    for row in rows:
        per = count(row, calls, cell, script) / calls - loop
        done.append({"row": row, f"instructions_per_{what}": round(per)})
        print(f"{row:<26} {per:>10,.0f} instructions a {what}", flush=True)
    return loop, done


def write_record(path: Path, note: str, settings: dict, loop: float, rows: list[dict]) -> None:
    """The counts as JSON at ``path`` (its folder made): the machine, the run's stamp (command,
    commit), ``settings`` with valgrind's and Python's versions and the loop's own count."""
    from persistent_rnn import benchmark
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    doc = {**benchmark.device_record(gpu=False), "note": note,
           **benchmark.run_stamp(["python", *sys.argv]),
           "settings": {**settings, "valgrind": version.stdout.strip(),
                        "python": sys.version.split()[0], "loop_instructions": round(loop)},
           "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def has_valgrind(script: str) -> bool:
    """Whether valgrind is on PATH; if not, says so for ``script`` (which then exits 2: never a
    figure it did not count)."""
    if shutil.which("valgrind") is not None:
        return True
    print(f"{script}: needs valgrind (callgrind) on PATH", file=sys.stderr)
    return False


def main(argv: list[str] | None = None) -> int:
    """Count every row in its own callgrind process; print a table, write the JSON."""
    p = argparse.ArgumentParser(prog="bench/call_instructions.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="output directory (created)")
    p.add_argument("--calls", type=int, default=300, help="calls counted per row")
    p.add_argument("--cell", default="GRU", choices=("GRU", "LSTM"))
    p.add_argument("--parts", action="store_true", help="also the forward's parts")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args.child, args.calls, args.cell)
        return 0
    if not has_valgrind("bench/call_instructions.py"):
        return 2
    loop, rows = count_rows(ROWS + (PARTS if args.parts else ()), args.calls, args.cell, "call")
    if args.out is not None:
        write_record(args.out / "call_instructions.json",
                     "CPU run: instructions counted by callgrind, the emulated path stubbed",
                     {"cell": args.cell, "hidden": 8, "batch": 1, "steps": 1,
                      "calls": args.calls}, loop, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
