"""The package's structure: its import graph (module-level and function-level imports alike)
has no cycle, so any module can be read, tested and changed from its dependencies up."""
from __future__ import annotations

import ast
from pathlib import Path

import persistent_rnn

PACKAGE = Path(persistent_rnn.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)]
            module = ".".join(base + [node.module]) if node.level and node.module else \
                ".".join(base) if node.level else node.module or ""
            out |= {f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["persistent_rnn.latency"] >= {"persistent_rnn.sass_analysis"}  # the graph is read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# The persistent kernels whose pointwise steps are written once (issue 30): the forward's in
# persistent_common.cuh (forward_pointwise), the backward's in backward_pointwise.cuh. (The LSTM
# projection's backward runs its own step: dh comes from the W_hr^T product.)
SHARED_STEP_KERNELS = ("persistent_forward.cu", "persistent_backward.cu",
                       "persistent_projection_forward.cu", "stack_forward.cu", "stack_backward.cu")


def test_the_persistent_kernels_run_the_cells_through_the_shared_steps():
    """None of these kernels calls a cell's masked forward or backward itself: a copy of the
    pointwise loop, the near-copy that ``duplicates`` found, would have to."""
    from persistent_rnn._sources import read_source

    for source in SHARED_STEP_KERNELS:
        text = read_source(source)
        assert "forward_pointwise" in text or "backward_pointwise" in text, source
        for call in ("cell_forward_masked", "cell_backward_masked"):
            assert call not in text, f"{source} calls {call} itself"
    assert "cell_forward_masked" in read_source("persistent_common.cuh")
    assert "cell_backward_masked" in read_source("backward_pointwise.cuh")
