"""SASS analysis: disassembly of a cubin (``nvdisasm``) and the control flow of a persistent
kernel's time loop - the loop itself (``time_loop``), its inner loops and what each does
(``loop_kind``), the path a successful wait takes (``ready_path``, ``steady_step``), static
counts of what a step may issue (``sass_loop_counts``) and register dependency chains
(``critical_path``).

``kernel_report`` uses it for its records and checks, the latency model (``model``) for the
instructions a step issues; it depends on neither.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# What the report counts, by SASS opcode (the first dot-separated part decides).
SASS_KINDS = {
    "block_barriers": ("BAR",),             # BAR.SYNC, BAR.RED.OR, BAR.ARV (not MEMBAR)
    "global_loads": ("LDG",),               # incl. LDG.E.STRONG.GPU (relaxed) loads
    "async_copies": ("LDGSTS",),            # cp.async global -> shared
    "global_stores": ("STG",),
    "atomics": ("ATOM", "ATOMG", "RED"),
    "fences": ("MEMBAR", "FENCE"),
    "l1_invalidates": ("CCTL",),
    "local_memory": ("LDL", "STL"),         # a run-time indexed array or a spill: never wanted
    "tensor_core_mma": ("HMMA",),           # the mma tiles' product (cuda_src/mma_tile.cuh)
}


def step_atomic(opcode: str) -> bool:
    """Whether an atomic of the time loop is one a step runs: not the compare-and-swap of
    ``prnn_abort`` (cuda_src/exchange.cuh: the first abort reason wins), which only a wait that
    gives up runs, once per launch."""
    return opcode.split(".")[0] in SASS_KINDS["atomics"] and ".CAS" not in opcode


_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^\s*(\.L\w+|\$[\w$.]+):")
_TARGET = re.compile(r"`\(([^)]+)\)")


def cuda_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``nvdisasm``, ``cuobjdump``): on PATH, else from its
    ``nvidia-cuda-<name>`` wheel; None if absent."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def nvdisasm() -> str | None:
    """Path of ``nvdisasm`` (``cuda_tool``)."""
    return cuda_tool("nvdisasm")


@lru_cache(maxsize=1024)
def disassemble(cubin: Path, tool: str) -> str:
    """``nvdisasm -c`` of a cubin (code sections only, with branch labels). Kept per process:
    a cached cubin's name is the digest of what built it (``kernels``), so the same path is the
    same code, and the report and the latency model read each one once."""
    proc = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {cubin}:\n{proc.stderr}")
    return proc.stdout


def parse(sass: str) -> tuple[list[tuple[str, str, str | None, str]], dict[str, int]]:
    """Instructions as (opcode, predicate, branch target label, operand text) and label ->
    instruction index."""
    code, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(code)
            continue
        ins = _INSTRUCTION.search(line)
        if ins:
            target = _TARGET.search(ins.group(4))
            code.append((ins.group(3), (ins.group(2) or "").strip(), target.group(1) if target else None,
                         ins.group(4)))
    return code, labels


def _successors(code, labels, converged: bool = False) -> list[list[int]]:
    """Control-flow successors of each instruction. Calls of functions (``$...``) return; a
    ``CALL.REL.NOINC`` to a local label is how sm_80 code leaves a loop (a jump that may also
    fall through); EXIT/RET end a path. ``BRA.DIV`` branches only when the warp has diverged
    (the compiler's fallback before a warp-synchronous instruction such as a shuffle): with
    ``converged`` it falls through, as every warp does that reaches it converged."""
    succ = []
    for i, (op, pred, target, _) in enumerate(code):
        base = op.split(".")[0]
        always = pred in ("", "@PT")
        nxt = [i + 1] if i + 1 < len(code) else []
        if converged and op.startswith("BRA.DIV"):
            succ.append(nxt)
        elif base in ("BRA", "JMP") and target in labels:
            succ.append([labels[target]] + ([] if always and op == "BRA" else nxt))
        elif base == "CALL" and target in labels and target.startswith(".L"):
            succ.append([labels[target]] + nxt)
        elif base in ("EXIT", "RET") and always:
            succ.append([])
        else:
            succ.append(nxt)
    return succ


def _natural_loop(succ: list[list[int]], tail: int, head: int, reachable: list[bool]) -> set[int]:
    """Instructions of the natural loop of the back edge tail -> head (code that cannot be
    reached from the entry, such as a fallback no branch leads to, is in no loop)."""
    pred: list[list[int]] = [[] for _ in succ]
    for i, targets in enumerate(succ):
        for j in targets:
            if reachable[i]:
                pred[j].append(i)
    body, stack = {head, tail}, [tail]
    while stack:
        for p in pred[stack.pop()]:
            if p not in body:
                body.add(p)
                stack.append(p)
    return body


def _dominators(succ: list[list[int]]) -> list[int]:
    """Per instruction, the set of instructions that dominate it (a bit set; entry: instruction 0;
    unreachable instructions get the empty set)."""
    order, seen, stack = [], {0}, [(0, iter(succ[0]))]
    while stack:  # depth-first, for a reverse postorder
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(succ[child])))
    order.reverse()
    pred: list[list[int]] = [[] for _ in succ]
    for i, targets in enumerate(succ):
        for j in targets:
            pred[j].append(i)
    full = (1 << len(succ)) - 1
    dom = [0] * len(succ)
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for node in order[1:]:
            new = full
            for p in pred[node]:
                if p in seen:
                    new &= dom[p] if dom[p] else full
            new |= 1 << node
            if new != dom[node]:
                dom[node], changed = new, True
    return dom


@dataclass(frozen=True)
class TimeLoop:
    """The time loop of a persistent kernel's SASS: ``code`` (every instruction of the cubin's
    code as ``parse`` gives it), ``succ`` (each instruction's successors, as the loop was found
    with them), ``body`` (the loop's instruction indices), ``inner`` (the natural loops inside
    it, by header index, each a set of instruction indices) and ``head`` (its header)."""

    code: list[tuple[str, str, str | None, str]]
    succ: list[list[int]]
    body: frozenset[int]
    inner: dict[int, frozenset[int]]
    head: int


@lru_cache(maxsize=64)  # the report's counts and the latency model read the same loop
def time_loop(sass: str, converged: bool = False) -> TimeLoop:
    """The time loop: the largest natural loop (back edges - edges to an instruction that
    dominates their source - to one header merged) that holds a block barrier, or a warp vote
    where the warps of a step work alone (a cluster's warp teams: the vote of their warp
    barrier is the step's only synchronisation inside the CTA). Out-of-line code
    the compiler placed after the kernel's exit (divergent shuffles, slow paths) belongs to the
    loop when it returns into it. ``converged``: only the code a converged warp executes (no
    ``BRA.DIV`` fallback; ``_successors``) - what a step issues, which the latency model counts;
    without it, every instruction the loop may execute (the report's bounds)."""
    code, labels = parse(sass)
    succ = _successors(code, labels, converged)
    dom = _dominators(succ)
    reachable = [d != 0 for d in dom]
    loops: dict[int, set[int]] = {}
    for tail, targets in enumerate(succ):
        for head in targets:
            if reachable[tail] and dom[tail] >> head & 1:
                loops.setdefault(head, set()).update(_natural_loop(succ, tail, head, reachable))
    with_barrier = [(head, body) for head, body in loops.items()
                    if any(code[i][0].split(".")[0] in ("BAR", "VOTE") for i in body)]
    if not with_barrier:
        raise RuntimeError("no loop with a block barrier or a warp vote in the SASS: is this a "
                           "persistent kernel?")
    head, body = max(with_barrier, key=lambda hb: len(hb[1]))
    inner = {h: frozenset(b) for h, b in loops.items() if h != head and h in body and b <= body}
    return TimeLoop(code, succ, frozenset(body), inner, head)


def sass_loop_counts(sass: str) -> dict[str, int]:
    """Static counts of ``SASS_KINDS`` in the time loop (``time_loop``). Each instruction of the
    body counts once, inner loops included, so the counts bound what one step issues."""
    loop = time_loop(sass)
    counts = {kind: 0 for kind in SASS_KINDS}
    for i in loop.body:
        opcode = loop.code[i][0]
        base = opcode.split(".")[0]
        for kind, opcodes in SASS_KINDS.items():
            counts[kind] += base in opcodes and (kind != "atomics" or step_atomic(opcode))
    counts["instructions"] = len(loop.body)
    return counts


_REGISTER = re.compile(r"\b([RP]\d+)\b")
# Opcodes whose first register operand is a source, not a destination.
_NO_DEST = ("ST", "STS", "STG", "STL", "RED", "BAR", "BRA", "BSSY", "BSYNC", "NOP", "EXIT", "LDGSTS",
            "MEMBAR", "WARPSYNC", "YIELD", "NANOSLEEP", "CCTL", "DEPBAR", "CALL", "RET", "FENCE")


def opcode_base(op: str) -> str:
    """The opcode without its modifiers (``LDG.E.64`` -> ``LDG``)."""
    return op.split(".")[0]


def own_instructions(loop: TimeLoop, head: int) -> frozenset[int]:
    """Instructions of the inner loop ``head`` that no loop nested in it holds."""
    body = loop.inner[head]
    nested = [b for h, b in loop.inner.items() if h != head and b < body]
    return body.difference(*nested) if nested else body


def _children(loop: TimeLoop, head: int) -> list[int]:
    """Headers of the loops nested directly in the inner loop ``head``."""
    inside = [h for h, b in loop.inner.items() if b < loop.inner[head]]
    return [h for h in inside if not any(loop.inner[h] < loop.inner[o] for o in inside)]


def _own_kind(loop: TimeLoop, head: int) -> str | None:
    own = [loop.code[i][0] for i in own_instructions(loop, head)]
    bases = [opcode_base(op) for op in own]
    if "NANOSLEEP" in bases:
        return "spin"
    if "HMMA" in bases:
        return "mma"
    if bases.count("FFMA") >= 8 and "MUFU" not in bases:
        return "matrix"
    if "MUFU" in bases or "STG" in bases:  # the backward's pointwise step has no MUFU
        return "pointwise"
    if any(op.startswith("LDGSTS") and op.endswith(".128") for op in own):
        return "copy"
    if "LDGSTS" in bases:
        return "prefetch"
    if "LDG" in bases and "STS" in bases:
        return "fallback"
    return None


def loop_kind(loop: TimeLoop, head: int) -> str:
    """What an inner loop of the time loop does, from its own instructions (nested loops
    excluded): "spin" (a wait: NANOSLEEP), "mma" (HMMA: an mma tile's product, one trip per
    n-tile of 8 batch rows), "matrix" (FFMAs, no MUFU: one trip per batch row),
    "pointwise" (MUFU or global stores), "copy" (16-byte cp.async: the exchanged vector), "prefetch" (4-byte
    cp.async: the next step's inputs), "fallback" (ld/st staging, taken only for rows that are
    not 16-byte aligned); else from where it sits: "levels" (inside the matrix loop: the
    reduce-scatter's halving levels, where a tile indexes its accumulators at run time),
    "groups" (holds an mma loop: the batch groups of ``-D PRNN_BATCH_GROUP``, one trip per group),
    "chunks" (holds loops that are not waits: the gather's batches of quads with their loads and
    checks), "scan" (holds a wait: the gather's batches of quads, each with its polling loop),
    "other"."""
    kind = _own_kind(loop, head)
    if kind:
        return kind
    children = {_own_kind(loop, h) for h in _children(loop, head)}
    if "mma" in children:
        return "groups"
    if any(loop.inner[head] < b and _own_kind(loop, h) == "matrix" for h, b in loop.inner.items()):
        return "levels"
    if children - {"spin"}:
        return "chunks"
    return "scan" if children else "other"


def ready_path(loop: TimeLoop, head: int) -> frozenset[int]:
    """The instructions of the wait loop ``head`` that a poll which finds its words issues: the
    shortest control-flow path (fewest instructions, along ``loop.succ``: a converged warp's where
    the loop was found with ``converged=True``, as ``step_terms`` does) from the loop's header to
    its exit. The rest of the loop (finding which words are missing, the timer, the abort word,
    the sleep) runs only on a miss, whose cost is the ``exchange`` term's."""
    succ = loop.succ
    body = loop.inner[head]
    came_from: dict[int, int | None] = {head: None}
    frontier = [head]
    while frontier:
        nxt = []
        for i in frontier:
            if any(j not in body for j in succ[i]):  # leaves the wait: the words were there
                path = []
                while i is not None:
                    path.append(i)
                    i = came_from[i]
                return frozenset(path)
            for j in succ[i]:
                if j not in came_from:
                    came_from[j] = i
                    nxt.append(j)
        frontier = nxt
    return body  # no exit (not a wait): every instruction


def steady_step(loop: TimeLoop, spins: list[int]) -> frozenset[int]:
    """The instructions of the time loop that a step whose waits succeed can reach: from the
    loop's header, leaving each wait loop in ``spins`` (headers) only from its ``ready_path``.
    The code a wait runs after it gave up (the abort word, the status store: ``prnn_keep_polling``
    failing) often sits outside the wait loop, where the compiler put the branch to it; it runs
    only on a timeout or abort, so a step neither issues it nor waits on it."""
    ready = {h: ready_path(loop, h) for h in spins}
    seen, frontier = {loop.head}, [loop.head]
    while frontier:
        i = frontier.pop()
        for j in loop.succ[i]:
            if j in seen or j not in loop.body:
                continue
            if any(i in loop.inner[h] and j not in loop.inner[h] and i not in ready[h] for h in spins):
                continue  # a wait that gave up
            seen.add(j)
            frontier.append(j)
    return frozenset(seen)


def critical_path(code: list[tuple[str, str, str | None, str]], latency) -> float:
    """Cycles of the longest register dependency chain through ``code`` in program order (the
    first register operand of an instruction that writes one is its destination);
    ``latency(opcode)`` gives each instruction's latency."""
    ready: dict[str, float] = {}
    longest = 0.0
    for op, _, _, operands in code:
        regs = _REGISTER.findall(operands)
        writes = opcode_base(op) not in _NO_DEST and operands.strip()[:1] in ("R", "P") and regs
        sources = regs[1:] if writes else regs
        done = max((ready.get(r, 0.0) for r in sources), default=0.0) + latency(op)
        if writes:
            ready[regs[0]] = done
        longest = max(longest, done)
    return longest


def exchange_word_bytes(ops: list[str]) -> int:
    """Bytes per exchanged value of a tagged exchange, from the width of the strong (relaxed,
    GPU-scope) stores that publish it in the time loop: 8 for {value, tag} words (``STG.E.64``),
    4 for values whose low mantissa bits carry the tag."""
    strong = [op for op in ops if opcode_base(op) == "STG" and ".STRONG." in op]
    return 8 if any(".64" in op for op in strong) else 4
