"""The shape of the code, checked: no import cycles among psdk's modules, no oversized ps, client or fuzzer module.

Imports are read from the source (``ast``), at any depth: one inside a
function counts too, since it is the same dependency loaded later. Only
imports under ``if TYPE_CHECKING:`` are left out: they exist for
annotations and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[1] / "psdk"
MAX_LINES = 500
SIZE_CHECKED = ("ps", "client", "protocol.py", "transport", "recovery.py", "fuzz")
BEHIND_THE_TRANSPORT = ("psdk.ps", "psdk.client")
THE_INTERFACE = {"psdk.transport", "psdk.transport.contract", "psdk.transport.wire"}
"""All of psdk.transport the ps and the client may import: the contract and its messages."""
WIRING = {"psdk.ps.main"}
"""Where a ps process chooses and builds its transport from its options (as psdk.connect does a worker's)."""
LOW_LEVEL = {"zmq", "mmap", "fcntl", "socket", "select", "selectors"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The psdk modules ``path`` imports when it runs."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    # A package's __init__ is not a dependency of its submodules here: psdk's are lazy or empty.
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, once each (as the path from its smallest module round to it)."""
    found: list[list[str]] = []
    for start in sorted(graph):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append(path)
                elif nxt > start and nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_module_of_psdk_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert "psdk.ps.server" in graph and "psdk.ps.shard" in graph["psdk.ps.server"]
    found = [c for c in cycles(graph) if not all(m == "psdk" for m in c)]
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found[:10])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {name.split(".")[0] for name in names}


def test_the_ps_and_the_client_speak_only_the_transport_interface() -> None:
    """No socket, memory file, pipe or key in the ps or the client: shared memory and CURVE live in the transport."""
    graph = import_graph()
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    checked = [m for m in graph if m.startswith(BEHIND_THE_TRANSPORT) and m not in WIRING]
    assert "psdk.ps.server" in checked and "psdk.client.client" in checked
    reached = {m: {d for d in graph[m] if d.startswith("psdk.transport") and d not in THE_INTERFACE} for m in checked}
    assert not any(reached.values()), {m: sorted(d) for m, d in reached.items() if d}
    low = {m: _top_level_imports(paths[m]) & LOW_LEVEL for m in checked}
    assert not any(low.values()), {m: sorted(d) for m, d in low.items() if d}


def test_the_ps_the_client_the_transport_and_the_fuzzers_are_made_of_modules_of_at_most_500_lines() -> None:
    checked = [
        p
        for name in SIZE_CHECKED
        for p in ([PACKAGE / name] if name.endswith(".py") else (PACKAGE / name).rglob("*.py"))
    ]
    assert len(checked) > 10
    large = {str(p.relative_to(PACKAGE)): n for p in checked if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not large, f"modules over {MAX_LINES} lines: {large}"


TOOLING = ("psdk.testing", "psdk.fuzz")
"""What ships for tests, not for jobs: the plugin-author kit and psdk's own fuzzers."""
TOOLING_ENTRY_POINTS = {"psdk.commands": ("psdk.fuzz",)}
"""Product modules that may reach tooling, and which: the ``psdk fuzz`` command, inside its function only."""


def _is_under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def tooling_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each product module's imports of tooling its entry-point allowance does not cover; the kit's of the fuzzers."""
    found: dict[str, list[str]] = {}
    for module, imported in graph.items():
        if _is_under(module, ("psdk.fuzz",)):
            continue  # psdk's own tooling may use the kit and anything else
        barred = ("psdk.fuzz",) if _is_under(module, ("psdk.testing",)) else TOOLING
        allowed = TOOLING_ENTRY_POINTS.get(module, ())
        bad = sorted(d for d in imported if _is_under(d, barred) and not _is_under(d, allowed))
        if bad:
            found[module] = bad
    return found


def _module_level_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: outside any function body."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.update(id(child) for child in ast.walk(node))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_product_module_imports_the_test_kit_or_the_fuzzers() -> None:
    """A job, the bench and the CLI load no test tooling; ``psdk fuzz`` alone reaches the fuzzers, when it runs."""
    graph = import_graph()
    assert "psdk.fuzz.runner" in graph and "psdk.testing.conformance" in graph and "psdk.bench.zmtp" in graph
    assert not tooling_imports(graph), tooling_imports(graph)
    for module, allowed in TOOLING_ENTRY_POINTS.items():
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        eager = {m for m in _module_level_imports(path) if _is_under(m, allowed)}
        assert not eager, f"{module} imports {sorted(eager)} when it is imported, not when its command runs"


def test_the_tooling_check_finds_a_product_module_that_imports_tooling() -> None:
    graph = {
        "psdk.bench.flood": {"psdk.testing.zmtp"},
        "psdk.commands": {"psdk.fuzz.runner", "psdk.testing"},
        "psdk.testing.jobs": {"psdk.fuzz.harness", "psdk.metrics"},
        "psdk.fuzz.harness": {"psdk.testing.ps"},
    }
    assert tooling_imports(graph) == {
        "psdk.bench.flood": ["psdk.testing.zmtp"],
        "psdk.commands": ["psdk.testing"],
        "psdk.testing.jobs": ["psdk.fuzz.harness"],
    }
