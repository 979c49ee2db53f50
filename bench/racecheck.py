"""Racecheck of tests/gpu_sanitize_case.py, a process per case, and a verdict on every race.

compute-sanitizer's racecheck runs each case in a process of its own (bench/run_gpu_suite.sh,
part ``tests``), only over the library's kernels (``--kernel-name kns=prnn_``).

Racecheck cannot see the cluster exchange's protocol (cuda_src/persistent_common.cuh, ExchangeOf):
every CTA stores its tagged words into each CTA's shared memory with
``st.relaxed.cluster.shared::cluster`` (a DSMEM store: SASS ``ST.E.STRONG.GPU`` to a ``mapa``
address) while the owner polls them with ``ld.relaxed.cluster.shared::cta`` (SASS ``LDS``) until
they carry the step's tag. No barrier orders the two - the tag does - so racecheck reports each
such pair as a race between the poll's read and the store's write. Those pairs are deliberate;
anything else it reports is a finding.

A race is **deliberate** when its read is an ``LDS`` whose source line holds
``ld.relaxed.cluster.shared::cta`` and its write is a generic store (``ST``) whose source line holds
``st.relaxed.cluster.shared::cluster``, both in the cubin the case ran: each case runs in a process
of its own with ``--cubins`` (so a kernel name means one cubin) and ``PRNN_LINEINFO=1`` (the cubin's
line table, same SASS: persistent_rnn/kernels.py), and the offsets racecheck prints are looked up
in ``nvdisasm -c -g`` of that cubin. A race that is not deliberate, a report line this does not
understand, a case that fails, or a race in a kernel whose cubin is unknown fails the step, named.

``run`` (the suite's step) runs the cases under racecheck, each within ``--case-limit`` seconds
and all within ``--budget``, printing every sanitizer output and then the verdicts; exit 0 when
every case ran, passed and every race was deliberate, 1 on a finding, 124 when nothing was found
but a case timed out or was not reached. ``check LOG`` gives the verdicts of a saved step log.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from persistent_rnn import sass_analysis  # noqa: E402
from persistent_rnn._sources import cuda_src_dir  # noqa: E402

# The exchange's two accesses (cuda_src/hw.cuh), by the PTX on their source line and the SASS
# opcode it becomes: the owner's poll and the other CTAs' DSMEM store.
POLL_PTX, POLL_SASS = "ld.relaxed.cluster.shared::cta", ("LDS",)
DSMEM_STORE_PTX, DSMEM_STORE_SASS = "st.relaxed.cluster.shared::cluster", ("ST",)
SANITIZER_FLAGS = ("--tool", "racecheck", "--kernel-name", "kns=prnn_", "--print-limit", "0")
CASE_MARK = "== racecheck case "
INCOMPLETE = 124

# ``kernel+0xOFF``; with a line table the name is the inlined device function's (its signature
# may hold spaces) and ``in FILE:LINE`` follows; the offset is the kernel's either way
_ACCESS = r"(Read|Write) access at (.+?)\+0x([0-9a-fA-F]+)(?: in (\S+):(\d+))?"
_RACE = re.compile(r"(Error|Warning): Race reported between " + _ACCESS)
_AND = re.compile(r"^=+\s+and " + _ACCESS + r"\s*\[(\d+) hazards?\]")
_REPORT = re.compile(r"^=+ (Error|Warning)")
_CUBIN = re.compile(r"^cubin: (.+)$")
_RESULT = re.compile(r"^(\S+): (ok|.+)$")
_LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)')
_SECTION = re.compile(r"^\.text\.(\S+):$")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


@dataclass(frozen=True)
class Access:
    """One side of a race: read or write, at ``kernel+offset`` (``kernel``: the name racecheck
    printed, an inlined function's where the cubin has a line table, with ``file``/``line``)."""

    kind: str
    kernel: str
    offset: int
    file: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.kind} at {self.kernel}+{self.offset:#x}"


@dataclass(frozen=True)
class Race:
    """A pair of accesses racecheck reports, and how many hazards it saw between them."""

    first: Access
    second: Access
    hazards: int


@dataclass(frozen=True)
class Instruction:
    """A SASS instruction: its opcode and its source line (None without a line table)."""

    opcode: str
    file: str | None
    line: int | None

    def where(self) -> str:
        return f"{Path(self.file).name}:{self.line}" if self.file else "no line table"


def parse_races(text: str) -> tuple[list[Race], list[str]]:
    """The races of a racecheck output (analysis reports: a first access, then one ``and``
    line per other access with its hazard count) and every other error or warning line."""
    races, other = [], []
    first = None
    for line in text.splitlines():
        start, more = _RACE.search(line), _AND.search(line)
        if start:
            first = _access(*start.groups()[1:])
        elif more and first is not None:
            races.append(Race(first, _access(*more.groups()[:5]), int(more.group(6))))
        elif _REPORT.search(line) or " access at " in line:  # a report line not understood
            other.append(line.strip("= ").strip())
    return races, other


def _access(kind: str, name: str, offset: str, file: str | None, line: str | None) -> Access:
    return Access(kind, name, int(offset, 16), file, None if line is None else int(line))


def cubins_of(text: str) -> list[Path]:
    """The cubins ``gpu_sanitize_case.py --cubins`` listed."""
    return [Path(m.group(1).strip()) for m in map(_CUBIN.match, text.splitlines()) if m]


def instructions(disassembly: str) -> dict[str, dict[int, Instruction]]:
    """kernel -> offset -> instruction of ``nvdisasm -c -g`` output (the line table's innermost
    location of each instruction, where the cubin has one)."""
    kernels: dict[str, dict[int, Instruction]] = {}
    current: dict[int, Instruction] = {}
    file, line = None, None
    for text in disassembly.splitlines():
        section, location, insn = (_SECTION.match(text.strip()), _LOCATION.search(text),
                                   _INSN.search(text))
        if section:
            current = kernels.setdefault(section.group(1), {})
            file, line = None, None
        elif location:
            file, line = location.group(1), int(location.group(2))
        elif insn:
            current[int(insn.group(1), 16)] = Instruction(insn.group(2), file, line)
    return kernels


@lru_cache(maxsize=None)
def disassemble_with_lines(cubin: Path) -> str:
    """``nvdisasm -c -g`` of ``cubin`` (raises RuntimeError without nvdisasm)."""
    tool = sass_analysis.nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found (PATH or the nvidia-cuda-nvdisasm wheel)")
    proc = subprocess.run([tool, "-c", "-g", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}:\n{proc.stderr}")
    return proc.stdout


@lru_cache(maxsize=None)
def source_line(file: str, line: int) -> str:
    """Line ``line`` of ``file`` as the cubin names it, else of the file of that name in
    ``cuda_src`` (the copy that ran); "" if there is none."""
    path = Path(file)
    if not path.is_file():
        path = cuda_src_dir() / path.name
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return ""
    return lines[line - 1] if 0 < line <= len(lines) else ""


def role(ins: Instruction, line_text: Callable[[str, int], str] = source_line) -> str | None:
    """"poll" (the exchange's poll of this CTA's words), "dsmem store" (another CTA's store
    into them) or None, from the opcode and the PTX on the instruction's source line."""
    if ins.file is None or ins.line is None:
        return None
    text, base = line_text(ins.file, ins.line), ins.opcode.split(".")[0]
    if base in POLL_SASS and POLL_PTX in text:
        return "poll"
    if base in DSMEM_STORE_SASS and DSMEM_STORE_PTX in text:
        return "dsmem store"
    return None


def verdict(race: Race, code: dict[str, dict[int, Instruction]],
            line_text: Callable[[str, int], str] = source_line) -> str | None:
    """None for a deliberate race (the exchange's poll read against a DSMEM store), else what
    it is. Where racecheck named an inlined function rather than the kernel, the race is looked
    up in every kernel the case loaded whose instructions at both offsets are on the source
    lines racecheck printed; it is deliberate if one of them shows the two roles."""
    named = race.first.kernel if race.first.kernel == race.second.kernel else None
    kernels = [named] if named in code else [k for k in code if _located(race, code[k])]
    for access in (race.first, race.second):
        if not any(access.offset in code[k] for k in kernels):
            return f"{access}: no such instruction in the cubins the case loaded"
    why = ""
    for kernel in kernels:
        sides = [(a, code[kernel][a.offset]) for a in (race.first, race.second)]
        roles = {a.kind: role(ins, line_text) for a, ins in sides}
        if roles == {"Read": "poll", "Write": "dsmem store"}:
            return None
        why = " vs ".join(f"{a} ({ins.opcode}, {ins.where()}, {roles[a.kind] or 'not the exchange'})"
                          for a, ins in sides)
    return why


def _located(race: Race, insns: dict[int, Instruction]) -> bool:
    """Whether ``insns`` has an instruction at both of the race's offsets, each on the source
    line racecheck printed for it (if it printed one)."""
    for access in (race.first, race.second):
        ins = insns.get(access.offset)
        if ins is None or (access.line is not None and (
                ins.line != access.line or Path(ins.file or "").name != Path(access.file).name)):
            return False
    return True


def case_verdicts(output: str, code: dict[str, dict[int, Instruction]] | None = None,
                  line_text: Callable[[str, int], str] = source_line) -> tuple[list[str], int]:
    """Findings in one case's sanitizer output (``code``: its kernels' instructions, default the
    disassembly of the cubins it listed) and how many races were deliberate."""
    races, other = parse_races(output)
    findings = [f"unrecognised sanitizer report: {line}" for line in other]
    if code is None:
        code = {}
        if races and not cubins_of(output):
            findings.append("the case listed no cubin (gpu_sanitize_case.py --cubins): "
                            "its races cannot be told apart")
        for cubin in cubins_of(output):
            for kernel, insns in instructions(disassemble_with_lines(cubin)).items():
                if kernel in code and races:  # (a race's offset then names no one instruction)
                    findings.append(f"kernel {kernel} is in two cubins the case loaded")
                code[kernel] = insns
    deliberate = 0
    for race in races:
        why = verdict(race, code, line_text)
        if why is None:
            deliberate += 1
        else:
            findings.append(f"NOT DELIBERATE ({race.hazards} hazards): {why}")
    return findings, deliberate


def case_outcome(name: str, output: str, rc: int | None) -> str | None:
    """What went wrong with the case itself (None: it ran and passed)."""
    if rc is None:
        return "timed out"
    results = [m.group(2) for m in map(_RESULT.match, output.splitlines()) if m and m.group(1) == name]
    if rc != 0 or results != ["ok"]:
        return f"exit {rc}, result {results[0] if results else 'none'}"
    return None


def run_case(sanitizer: str, name: str, limit_s: float) -> tuple[str, int | None]:
    """Racecheck over case ``name`` (its own process group, ended after ``limit_s``): its whole
    output and exit status (None: timed out)."""
    command = [sanitizer, *SANITIZER_FLAGS, sys.executable, str(ROOT / "tests" / "gpu_sanitize_case.py"),
               "--only", name, "--cubins"]
    env = {**os.environ, "PRNN_LINEINFO": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
        return output, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return output, None


def report(name: str, output: str, rc: int | None) -> tuple[list[str], str]:
    """(findings, summary line) of one case's run."""
    problem = case_outcome(name, output, rc)
    findings, deliberate = case_verdicts(output)
    if problem and problem != "timed out":
        findings.insert(0, f"case failed: {problem}")
    state = "TIMED OUT" if problem == "timed out" else "FINDINGS" if findings else "ok"
    return findings, f"racecheck {name}: {state}, {deliberate} deliberate race pairs " \
                     f"(exchange poll vs DSMEM store), {len(findings)} findings"


def run(cases: list[str], case_limit: float, budget: float, sanitizer: str) -> int:
    """The suite's step: each case under racecheck in turn, then the verdicts."""
    end = time.monotonic() + budget
    summaries, findings, incomplete = [], [], []
    for name in cases:
        left = end - time.monotonic()
        if left < 5:
            incomplete.append(f"{name}: not reached ({budget:.0f} s budget spent)")
            continue
        print(f"{CASE_MARK}{name}", flush=True)
        started = time.monotonic()
        output, rc = run_case(sanitizer, name, min(case_limit, left))
        print(output, end="" if output.endswith("\n") else "\n", flush=True)
        found, summary = report(name, output, rc)
        summaries.append(f"{summary} ({time.monotonic() - started:.0f} s)")
        findings += [f"{name}: {f}" for f in found]
        if rc is None:
            incomplete.append(f"{name}: timed out after {min(case_limit, left):.0f} s")
    return conclude(summaries, findings, incomplete)


def conclude(summaries: list[str], findings: list[str], incomplete: list[str]) -> int:
    """Print the verdicts; the step's exit status."""
    print("== racecheck verdicts")
    for line in summaries + findings + incomplete:
        print(line)
    status = 1 if findings else INCOMPLETE if incomplete else 0
    print(f"racecheck: {['ok', 'FINDINGS'][bool(findings)]}"
          + (f", incomplete ({len(incomplete)} cases)" if incomplete else ""))
    return status


def check(log: str) -> int:
    """The verdicts of a saved step log (split at the case marks; cubins must still exist)."""
    summaries, findings, incomplete = [], [], []
    for chunk in log.split(CASE_MARK)[1:]:
        name, _, output = chunk.partition("\n")
        results = [m.group(2) for m in map(_RESULT.match, output.splitlines()) if m and m.group(1) == name]
        if not results:
            incomplete.append(f"{name}: no result in the log (timed out or killed)")
        found, summary = report(name, output, 0 if results else None)
        summaries.append(summary)
        findings += [f"{name}: {f}" for f in found]
    return conclude(summaries, findings, incomplete)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="racecheck the cases, one process each, then the verdicts")
    r.add_argument("--cases", required=True, help="comma-separated case names, in priority order")
    r.add_argument("--case-limit", type=float, default=30.0, help="seconds per case")
    r.add_argument("--budget", type=float, required=True, help="seconds for all the cases")
    r.add_argument("--sanitizer", default="compute-sanitizer")
    c = sub.add_parser("check", help="the verdicts of a saved log of `run`")
    c.add_argument("log", type=Path)
    args = p.parse_args(argv)
    if args.command == "check":
        return check(args.log.read_text())
    return run(args.cases.split(","), args.case_limit, args.budget, args.sanitizer)


if __name__ == "__main__":
    sys.exit(main())
