"""The shape of the code, checked: no import cycles, the ps and the worker apart, no oversized module.

Imports are read from the source (``ast``), at any depth: one inside a
function counts too, since it is the same dependency loaded later, and so
does one under ``if TYPE_CHECKING:``: a module that needs another's types
depends on it as much as one that calls it, and a cycle of annotations is
a cycle a reader has to untangle. ``from pkg import mod`` depends on
``pkg.mod``, not on ``pkg``, whose ``__init__`` is lazy or empty.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[1] / "psdk"
MAX_LINES = 500
SIZE_CHECKED = ("ps", "client", "protocol", "transport", "fuzz")
BEHIND_THE_TRANSPORT = ("psdk.ps", "psdk.client")
THE_INTERFACE = {"psdk.transport", "psdk.transport.contract", "psdk.transport.wire"}
"""All of psdk.transport the ps and the client may import: the contract and its messages."""
WIRING = {"psdk.ps.main"}
"""Where a ps process chooses and builds its transport from its options (as psdk.connect does a worker's)."""
LOW_LEVEL = {"zmq", "mmap", "fcntl", "socket", "select", "selectors"}
PS_SIDE = "psdk.ps"
WORKER_SIDE = "psdk.client"
"""The two sides of a job (``docs/architecture.md``): each may import the shared contracts
(``psdk.protocol``, ``psdk.config``, ``psdk.transport``, ``psdk.runtime``, the plugin system), never the other side."""
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
TOP_LEVEL = {"__init__.py", "__main__.py", "_moved.py", "api.py", "errors.py", "rules.py"}
"""The only modules in psdk/ itself: the public names. Everything else lives in the package of its concept."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The psdk modules ``path`` imports, to run or for its annotations."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found.update(submodules if len(submodules) == len(node.names) else {node.module, *submodules})
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


def test_an_import_for_annotations_only_counts(tmp_path: Path) -> None:
    module = tmp_path / "a.py"
    module.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from psdk.b import B\n")
    assert _imports(module, {"psdk.b"}) == {"psdk.b"}


def _side(module: str) -> str | None:
    return next((s for s in (PS_SIDE, WORKER_SIDE) if module == s or module.startswith(s + ".")), None)


def crossings(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module of one side that imports modules of the other side, and those modules."""
    found = {m: {d for d in deps if _side(d) not in (None, _side(m))} for m, deps in graph.items() if _side(m)}
    return {m: deps for m, deps in found.items() if deps}


def test_no_ps_module_imports_a_worker_module_nor_the_reverse() -> None:
    graph = import_graph()
    assert "psdk.ps.store" in graph and "psdk.client.recovery" in graph
    found = crossings(graph)
    assert not found, {m: sorted(d) for m, d in found.items()}


def test_the_crossing_finder_finds_a_crossing() -> None:
    graph = {
        "psdk.ps.store": {"psdk.protocol.ops"},
        "psdk.client.client": {"psdk.ps.store", "psdk.protocol.ops"},
        "psdk.protocol.ops": {"psdk.ps.store"},
    }
    assert crossings(graph) == {"psdk.client.client": {"psdk.ps.store"}}


def named_paths(text: str) -> set[str]:
    """The psdk modules and packages a page names by path (``psdk/ps/store.py``, ``psdk/launch/``)."""
    return {m.rstrip("/") for m in re.findall(r"\bpsdk/[\w/]*\w(?:\.py|/)?", text)}


def unnamed_and_missing(text: str, package: Path) -> tuple[list[str], list[str]]:
    """psdk's packages and top-level modules the page does not name, and the paths it names that do not exist."""
    named = named_paths(text)
    top = [f"psdk/{p.name}" for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    unnamed = sorted(
        path
        for path in top
        if not path.startswith("psdk/_") and not any(n == path or n.startswith(path + "/") for n in named)
    )
    missing = sorted(n for n in named if not (package.parent / n).exists())
    return unnamed, missing


def test_psdk_itself_holds_only_the_public_names() -> None:
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL


def test_architecture_md_names_every_package_of_the_tree_and_nothing_else() -> None:
    unnamed, missing = unnamed_and_missing(ARCHITECTURE.read_text(), PACKAGE)
    assert len(named_paths(ARCHITECTURE.read_text())) > 40
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_architecture_check_finds_a_stale_page(tmp_path: Path) -> None:
    (tmp_path / "psdk" / "ps").mkdir(parents=True)
    (tmp_path / "psdk" / "ps" / "__init__.py").write_text("")
    (tmp_path / "psdk" / "api.py").write_text("")
    assert unnamed_and_missing("`psdk/ps/` and `psdk/store.py`", tmp_path / "psdk") == (
        ["psdk/api.py"],
        ["psdk/store.py"],
    )


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
TOOLING_ENTRY_POINTS = {"psdk.launch.commands": ("psdk.fuzz",)}
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
        "psdk.launch.commands": {"psdk.fuzz.runner", "psdk.testing"},
        "psdk.testing.jobs": {"psdk.fuzz.harness", "psdk.metrics"},
        "psdk.fuzz.harness": {"psdk.testing.ps"},
    }
    assert tooling_imports(graph) == {
        "psdk.bench.flood": ["psdk.testing.zmtp"],
        "psdk.launch.commands": ["psdk.testing"],
        "psdk.testing.jobs": ["psdk.fuzz.harness"],
    }
