"""Instructions one Python statement executes, counted by callgrind: what a call's primitives cost.

    python bench/snippet_instructions.py SETUP STATEMENT [STATEMENT ...] [--runs 1000]

``SETUP`` runs once (imports, the objects the statements use); each ``STATEMENT`` is made the
body of a function that callgrind counts ``--runs`` times inside ``functools.reduce`` (the only
region counted, as ``bench/call_instructions.py`` counts a layer call), after a warm-up, less an
empty statement's count: instructions per execution, the same run after run on any load. For
weighing one way of writing a hot path against another before changing it (docs/design.md,
"What the primitives cost"), e.g.

    python bench/snippet_instructions.py "import threading; lock = threading.Lock()" \\
        "with lock: pass" "lock.acquire(); lock.release()"
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

from call_instructions import _COLLECTED, has_valgrind


def child(setup: str, statement: str, runs: int) -> None:
    """In the callgrind process: the statement as a function's body, warmed up, then run
    ``runs`` times inside ``functools.reduce``."""
    space: dict = {}
    exec(setup, space)  # noqa: S102 -- the caller's own code, as with timeit
    exec(f"def _statement():\n    {statement}\n", space)  # noqa: S102
    run = space["_statement"]
    for _ in range(100):
        run()
    functools.reduce(lambda done, _: run(), range(runs), None)


def count(setup: str, statement: str, runs: int) -> float:
    """Instructions per execution of ``statement`` (its loop's own included)."""
    command = ["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
               "--callgrind-out-file=/dev/null", sys.executable, __file__, "--child", setup,
               statement, "--runs", str(runs)]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind of {statement!r} failed ({done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return int(found.group(1)) / runs


def main(argv: list[str] | None = None) -> int:
    """Count each statement in its own callgrind process; print instructions per execution."""
    p = argparse.ArgumentParser(prog="bench/snippet_instructions.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("setup", help="code run once before the statements")
    p.add_argument("statements", nargs="+", help="statements, each counted on its own")
    p.add_argument("--runs", type=int, default=1000, help="executions counted per statement")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.setup, args.statements[0], args.runs)
        return 0
    if not has_valgrind("bench/snippet_instructions.py"):
        return 2
    empty = count(args.setup, "pass", args.runs)
    for statement in args.statements:
        print(f"{count(args.setup, statement, args.runs) - empty:>10,.0f}  {statement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
