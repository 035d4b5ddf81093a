"""The library's import graph: no cycle between any two of its modules, counting every import statement
(function-level and ``TYPE_CHECKING`` ones too) and a package's ``__init__`` as a module of its own (the
``acyclic_siblings`` contract of ``lint-imports`` checks packages against their siblings; this test checks
the modules themselves, e.g. a module that imports its own package's ``__init__`` back); the console
scripts are the command lines of ``modelopt_lite.cli``; internal modules that moved are gone from their old
paths."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(graph, component: list[str]) -> str:
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = ", ".join(f"line {d['line_number']}" for d in details)
            lines.append(f"  {importer} -> {imported} ({where})")
    return "\n".join(lines)


def test_no_import_cycle():
    graph = grimp.build_graph("modelopt_lite", cache_dir=None)
    assert len(graph.modules) > 50  # the whole library, this checkout's
    assert "modelopt_lite.cli.ptq" in graph.modules
    cycles = _cycles(graph)
    assert not cycles, "import cycles (move what the modules share into a module both import):\n" + "\n".join(
        _describe(graph, c) for c in cycles
    )


def test_the_cycle_finder_finds_a_cycle():
    """The check itself, on a made-up graph: three modules in a cycle, and one that only imports into it."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(name)
    edges = [("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.d", "pkg.a")]
    for importer, imported in edges:
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_console_scripts_are_the_command_lines():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"modelopt-lite-ptq", "modelopt-lite-default-model"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert module.startswith("modelopt_lite.cli."), (name, target)
        main = getattr(importlib.import_module(module), attr)
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        assert exit_.value.code == 0, name


@pytest.mark.parametrize(
    "old",
    ["modelopt_lite.export.ptq", "modelopt_lite.export.ptq_config", "modelopt_lite.models.cli",
     "modelopt_lite.export.packers"],
)  # fmt: skip
def test_moved_internal_paths_are_gone(old):
    """Internal modules that moved have no shim at their old path (their public names did not move:
    ``modelopt_lite.export.PACKERS`` / ``get_packer`` / ``register_packer`` still work)."""
    with pytest.raises(ModuleNotFoundError, match=old.rpartition(".")[2]):
        importlib.import_module(old)


def test_export_names_the_packers_of_quantization():
    import modelopt_lite.export as export
    from modelopt_lite.quantization.compress import packers

    for name in ("PACKERS", "Packer", "get_packer", "register_packer"):
        assert getattr(export, name) is getattr(packers, name)
