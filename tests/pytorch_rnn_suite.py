"""Run PyTorch's own tests of nn.RNN, nn.GRU, nn.LSTM and their cells (nn.RNNCell, nn.GRUCell,
nn.LSTMCell) against persistent_rnn.torch.

PyTorch's test files (``test/test_nn.py``, ``test/test_modules.py`` of the PyTorch source tree,
not shipped in torch's wheel) construct ``torch.nn.RNN/GRU/LSTM`` and the cells by name and take
the modules of ``torch.testing._internal.common_modules.module_db``. This runner puts this
library's modules in their place, with ``algo`` forced, so that every forward and backward of
those tests runs the library (the GEMM path, or the persistent kernels — for the cells the fused
step kernel — emulated on CPU tensors), then runs the tests with pytest and prints a summary::

    python tests/pytorch_rnn_suite.py --algo gemm PATH/test_nn.py PATH/test_modules.py
    python tests/pytorch_rnn_suite.py --algo persistent PATH/test_nn.py -k lstm

The tests are selected by name (``-k``, pytest's syntax; the default picks the recurrent ones).
The summary counts, per outcome, the tests that built at least one of the library's modules;
tests selected by name that never built one are listed apart, as are the tests torch itself
skips here (CUDA-only, cuDNN-only, multi-GPU). On the persistent path a
float64 test fails with the library's refusal (its kernels hold float32 or 16-bit weights): those
are counted as refusals, not as failures. The exit status is 1 if any test failed otherwise.

What is replaced: the ``RNN``, ``GRU``, ``LSTM``, ``RNNCell``, ``GRUCell`` and ``LSTMCell``
attributes of ``torch.nn`` and ``torch.nn.modules``, and the ``module_cls`` of their ``module_db``
entries. ``torch.nn.RNNBase``, ``torch.nn.RNNCellBase`` and ``torch.nn.utils.rnn`` stay torch's.
The replacements are subclasses of persistent_rnn.torch's modules named like torch.nn's (same
``repr``) whose ``algo`` defaults to
the forced one; they pickle by reference to this module and are registered as safe globals for
``torch.load``. See docs/torch.md ("PyTorch's own tests") for the files and the counts.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
import torch

import persistent_rnn.torch as prt

NAMES = ("RNN", "GRU", "LSTM", "RNNCell", "GRUCell", "LSTMCell")
# The recurrent-layer and cell tests of test_nn.py and test_modules.py by name (pytest -k matches
# substrings, case-insensitively).
DEFAULT_SELECTION = ("rnn or gru or lstm or pack or variable_sequence or cudnn_forward_exception "
                     "or cudnn_weight or flat_weights or device_mask")
# How the library refuses float64 on the persistent path (runtime.py for the layers, cell_step.py
# for the cells' fused kernel): a failure by design.
FLOAT64_REFUSALS = ("algo='persistent' cannot run this layer: dtype is float64",
                    "algo='persistent' cannot run this cell: dtype is float64")


@dataclass
class Tally:
    """Per test (pytest node id): library modules constructed (or tried: torch.nn's argument
    checks may refuse them) and forwards that ran the library."""

    built: Counter = field(default_factory=Counter)
    ran: Counter = field(default_factory=Counter)
    current: str | None = None


TALLY = Tally()


def _forced(base: type, algo: str) -> type:
    """``base`` (one of persistent_rnn.torch's modules) with ``algo`` defaulting to ``algo``,
    counting constructions and library forwards per test in ``TALLY``."""

    def __init__(self, *args, algo: str = algo, **kwargs) -> None:
        TALLY.built[TALLY.current] += 1  # counted before torch.nn's argument checks run
        base.__init__(self, *args, algo=algo, **kwargs)

    def forward(self, input, hx=None):
        result = base.forward(self, input, hx)
        if self.last_run is not None and self.last_run.algo == self.algo:
            TALLY.ran[TALLY.current] += 1
        return result

    cls = type(base.__name__, (base,), {"__init__": __init__, "forward": forward,
                                         "__module__": __name__,
                                         "__qualname__": f"Forced{base.__name__}",
                                         "__doc__": f"{base.__name__} with algo={algo!r}."})
    setattr(sys.modules[__name__], cls.__qualname__, cls)  # found by pickle
    return cls


class ForceLibrary:
    """pytest plugin: replaces torch.nn's recurrent modules before the test files are imported,
    tallies every test's outcome, restores torch.nn at the end."""

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self.saved: list[tuple[object, str, object]] = []
        self.outcomes: dict[str, tuple[str, str]] = {}  # nodeid -> (outcome, detail)

    def _replace(self, owner, attr: str, value) -> None:
        self.saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def pytest_configure(self, config) -> None:
        from torch.testing._internal import common_modules  # needs 'expecttest'
        forced = {name: _forced(getattr(prt, name), self.algo) for name in NAMES}
        originals = {getattr(torch.nn, name): name for name in NAMES}
        for name, cls in forced.items():
            self._replace(torch.nn, name, cls)
            self._replace(torch.nn.modules, name, cls)
        for info in common_modules.module_db:
            if info.module_cls in originals:
                self._replace(info, "module_cls", forced[originals[info.module_cls]])
        torch.serialization.add_safe_globals(list(forced.values()))

    def pytest_unconfigure(self, config) -> None:
        for owner, attr, value in reversed(self.saved):
            setattr(owner, attr, value)
        self.saved.clear()

    def pytest_runtest_setup(self, item) -> None:
        TALLY.current = item.nodeid

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
                report.longrepr)
            self.outcomes[report.nodeid] = ("skipped", reason.removeprefix("Skipped: "))
        elif report.failed:
            text = str(report.longrepr)
            refused = self.algo == "persistent" and any(r in text for r in FLOAT64_REFUSALS)
            self.outcomes[report.nodeid] = ("refused" if refused else "failed",
                                            _last_error_line(text))
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, ("passed", ""))


def _last_error_line(text: str) -> str:
    """The ``E   ...`` line that names the exception in a pytest failure report."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    named = [e for e in errors if "Error" in e or "assert" in e.lower()]
    if named or errors:
        return (named or errors)[-1]
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def summarize(plugin: ForceLibrary) -> tuple[str, Counter]:
    """The printed summary and the counts of the tests that built a library module."""
    counts: Counter = Counter()
    lines: list[str] = []
    groups: dict[str, list[str]] = defaultdict(list)
    for nodeid, (outcome, detail) in sorted(plugin.outcomes.items()):
        ours = TALLY.built[nodeid] > 0
        if outcome == "skipped":
            counts["skipped"] += 1
            groups[f"skipped by torch here: {detail}"].append(nodeid)
        elif not ours:
            counts["no library module"] += 1
            groups[f"{outcome}, built no library module"].append(nodeid)
        else:
            counts[outcome] += 1
            if outcome != "passed":
                groups[f"{outcome}"].append(f"{nodeid}: {detail}")
            elif TALLY.ran[nodeid] == 0:
                groups["passed, but no forward ran the library"].append(nodeid)
    for title, ids in sorted(groups.items()):
        lines.append(f"{title} ({len(ids)}):")
        lines.extend(f"    {i}" for i in ids)
    lines.append(f"algo={plugin.algo}: {counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['refused']} refused (float64 on the persistent kernels); "
                 f"{counts['skipped']} skipped by torch, {counts['no library module']} "
                 f"selected but built no library module")
    return "\n".join(lines), counts


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="PyTorch test files (test_nn.py, ...)")
    parser.add_argument("--algo", choices=("gemm", "persistent"), required=True)
    parser.add_argument("-k", default=DEFAULT_SELECTION, help="pytest -k selection")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after '--': more pytest arguments")
    args = parser.parse_args(argv)
    extra = [a for a in args.pytest_args if a != "--"]
    plugin = ForceLibrary(args.algo)
    pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-k", args.k,
                 *args.paths, *extra], plugins=[plugin])
    text, counts = summarize(plugin)
    print(text)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
