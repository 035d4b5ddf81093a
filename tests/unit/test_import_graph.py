"""The library's import graph: no cycle between any two of its modules, counting every import statement
(function-level and ``TYPE_CHECKING`` ones too) and a package's ``__init__`` as a module of its own (the
``acyclic_siblings`` contract of ``lint-imports`` checks packages against their siblings; this test checks
the modules themselves, e.g. a module that imports its own package's ``__init__`` back); the console
scripts are the command lines of ``modelopt_lite.cli``; internal modules that moved are gone from their old
paths; no module is over 400 lines and no folder holds more than 12 modules."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "modelopt_lite"
MAX_LINES = 400  # per module
MAX_MODULES = 12  # per folder: its .py files, __init__.py included (subpackages are folders of their own)


def oversized(package: Path) -> list[str]:
    """Every module of ``package`` over ``MAX_LINES`` lines and every folder with more than ``MAX_MODULES``
    modules, as messages."""
    problems = []
    for module in sorted(package.rglob("*.py")):
        lines = len(module.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            problems.append(f"{module.relative_to(package.parent)}: {lines} lines (at most {MAX_LINES})")
    for folder in sorted({package, *(p for p in package.rglob("*") if p.is_dir())}):
        modules = sorted(folder.glob("*.py"))
        if len(modules) > MAX_MODULES:
            problems.append(
                f"{folder.relative_to(package.parent)}/: {len(modules)} modules (at most {MAX_MODULES}): "
                "split it by concept into subpackages"
            )
    return problems


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
    assert set(scripts) == {"modelopt-lite-ptq", "modelopt-lite-default-model", "modelopt-lite-eval"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert module.startswith("modelopt_lite.cli."), (name, target)
        main = getattr(importlib.import_module(module), attr)
        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
        assert exit_.value.code == 0, name


def test_no_module_over_400_lines_no_folder_over_12_modules():
    assert (PACKAGE / "quantization" / "model_quant.py").is_file()  # this checkout's library
    problems = oversized(PACKAGE)
    assert not problems, "split along a real seam:\n" + "\n".join(problems)


def test_the_size_check_finds_a_long_module_and_a_crowded_folder(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    for i in range(MAX_MODULES + 1):
        (package / "sub" / f"m{i}.py").write_text("")
    for i in range(MAX_MODULES - 2):  # with long.py and short.py: as many as allowed
        (package / f"n{i}.py").write_text("")
    problems = oversized(package)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"pkg/long.py: {MAX_LINES + 1} lines")
    assert problems[1].startswith(f"pkg/sub/: {MAX_MODULES + 1} modules")


@pytest.mark.parametrize(
    "old",
    ["modelopt_lite.export.ptq", "modelopt_lite.export.ptq_config", "modelopt_lite.models.cli",
     "modelopt_lite.export.packers", "modelopt_lite.quantization.packers",
     "modelopt_lite.quantization.calibrate", "modelopt_lite.quantization.awq",
     "modelopt_lite.quantization.auto_quantize_groups", "modelopt_lite.quantization.compressed",
     "modelopt_lite.quantization.config_models", "modelopt_lite.quantization.presets",
     "modelopt_lite.formats.fused", "modelopt_lite.export.loader", "modelopt_lite.nn.tensor_quantizer",
     "modelopt_lite.nn.quantizer_attributes", "modelopt_lite.models._staging"],
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


_DOTTED = re.compile(r"\bmodelopt_lite(?:\.[A-Za-z_]\w*)+")


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the library, or an attribute of one (the longest importable
    prefix, then attributes)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for part in parts[k:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_library_path_the_docs_name_resolves():
    """The module and name paths that README.md, docs/ and examples/ name (``modelopt_lite.x.y``) are still
    there: a module that moved is named at its new path, in the pages as in the code."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pages += sorted((ROOT / "examples").rglob("*.py"))
    found = {
        (page.relative_to(ROOT).as_posix(), dotted)
        for page in pages
        for dotted in _DOTTED.findall(page.read_text(encoding="utf-8"))
        if not dotted.startswith("modelopt_lite.examples.")  # the examples' logger names
    }
    assert len(found) > 10
    stale = sorted(f"{page}: {dotted}" for page, dotted in found if not resolves(dotted))
    assert not stale, "\n".join(stale)
    assert not resolves("modelopt_lite.quantization.packers.get_packer")
