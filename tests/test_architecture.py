"""The package's shape, checked: data flows one way and no module imports itself in a circle.

sources → Snapshot → analysis → exposition (docs/architecture.md). Lazy imports inside functions
count too: a cycle dodged by importing late is still a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "exporter"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module of the package that `name` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        out.update(c for c in candidates if c in MODULES and c != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def _importers(prefix: str, imported: str) -> list[str]:
    return sorted(f"{m} imports {d}" for m, deps in GRAPH.items() if m.startswith(prefix)
                  for d in deps if d.startswith(imported))


def test_the_checker_sees_the_imports():
    """Relative, absolute and lazy imports are all edges (else the checks below pass vacuously)."""
    assert "exporter.sources.source" in GRAPH["exporter.daemon"]  # from .sources.source import
    assert "exporter.sim.scenario" in GRAPH["exporter.runtime"]  # imported inside a function
    assert "exporter.model" in GRAPH["exporter.analysis.engine"]  # from ..model import


def test_no_import_cycle():
    assert _cycles() == []


def test_sources_import_nothing_from_analysis_or_what_follows_it():
    for later in ("exporter.analysis", "exporter.serve", "exporter.postmortem", "exporter.daemon"):
        assert _importers("exporter.sources", later) == []


def test_analysis_does_no_io_of_its_own():
    for io in ("exporter.sources", "exporter.serve", "exporter.postmortem", "exporter.runtime",
               "exporter.boundedio"):
        assert _importers("exporter.analysis", io) == []


def test_nothing_but_the_wiring_knows_the_simulator():
    outside = [line for line in _importers("exporter", "exporter.sim")
               if not line.startswith(("exporter.sim", "exporter.runtime", "exporter.cli", "exporter.service"))]
    assert outside == []


def test_the_live_tick_and_the_offline_tools_keep_apart():
    """What runs on every tick (the daemon, its reactions) is apart from the post-mortem tools:
    the tools never import the live loop, and the loop reaches the tools only for the trace
    format the recorder writes (and the one way to write a file)."""
    assert _importers("exporter.postmortem", "exporter.reactions") == []
    assert _importers("exporter.postmortem", "exporter.daemon") == []
    live = [line for prefix in ("exporter.daemon", "exporter.reactions")
            for line in _importers(prefix, "exporter.postmortem")]
    assert all(line.endswith(("exporter.postmortem.trace", "exporter.postmortem.atomic")) for line in live), live


def test_the_command_line_only_turns_arguments_into_objects():
    """cli.py holds no logic of its own (the daemon's assembly is service.py, its reload
    reload.py): no function there is over 40 lines."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 40}
    assert long == {}
