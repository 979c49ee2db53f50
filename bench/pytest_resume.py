"""pytest in a time budget where a hung test costs that test only.

    python bench/pytest_resume.py --budget S -- PYTEST_ARGS...

Runs ``python -m pytest -v PYTEST_ARGS`` and echoes its output. pytest-timeout (the thread
method the project sets, since a hung kernel wait cannot be interrupted) ends the whole run
when a test passes ``--timeout``; with ``-v`` the test that was running is the last one whose
line carries no outcome. This names it, then runs pytest again with every test that finished and
the hung ones deselected, while at least ``--min-left`` seconds of the budget remain. The last line
says what ran, what hung and what was left. Exit status: pytest's, or 1 where a test hung.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
STARTED = re.compile(r"^(tests/\S+::\S+) ")
TIMEOUT_BANNER = "Timeout +"


def run_once(args: list[str], deselect: list[str], seconds: float) -> tuple[int, list[str], str | None]:
    """One pytest run: its exit status, the tests it finished, the test it hung in (None: none,
    or the budget ran out first - said on the output)."""
    command = [sys.executable, "-m", "pytest", "-v", *args,
               *(f"--deselect={t}" for t in deselect)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finished, running, timed_out = [], None, False
    deadline = time.monotonic() + seconds
    for line in proc.stdout:  # type: ignore[union-attr]
        sys.stdout.write(line)
        sys.stdout.flush()
        done = OUTCOME.match(line)
        if done:
            finished.append(done.group(1))
            running = None
        elif STARTED.match(line):
            running = STARTED.match(line).group(1)
        timed_out = timed_out or TIMEOUT_BANNER in line
        if time.monotonic() > deadline:
            proc.kill()
            print(f"pytest_resume: the budget ran out in {running}", flush=True)
            proc.wait()
            return 1, finished, None
    return proc.wait(), finished, running if timed_out else None


def main(argv: list[str] | None = None) -> int:
    """Run pytest until it ends without a hang or the budget is spent."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, required=True, help="seconds for all the runs")
    p.add_argument("--min-left", type=float, default=20.0,
                   help="seconds of budget a further run needs")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"]
    end = time.monotonic() + args.budget
    finished: list[str] = []
    hung: list[str] = []
    status = 0
    while True:
        status, done, stuck = run_once(pytest_args, finished + hung, end - time.monotonic())
        finished += done
        if stuck is None:
            break
        hung.append(stuck)
        left = end - time.monotonic()
        print(f"pytest_resume: {stuck} HUNG; {len(finished)} tests finished, "
              f"{left:.0f} s of the budget left", flush=True)
        if left < args.min_left:
            break
    print(f"pytest_resume: {len(finished)} tests finished; hung: {', '.join(hung) or 'none'}",
          flush=True)
    return 1 if hung else status


if __name__ == "__main__":
    sys.exit(main())
