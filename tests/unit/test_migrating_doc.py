"""Every code example of ``docs/migrating.md`` runs as written (issue 31).

The page's fenced blocks run in order in one namespace, as a reader would paste them: ```` ```python ````
blocks are executed, ```` ```pycon ```` blocks are doctests (each ``>>>`` line's output, or the exception it
raises, must be what the page shows; ``...`` stands for any text). A block in any other language would escape
this test, so there must be none."""

import doctest
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line number, language, code)`` of each fenced block of a markdown page."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def run_blocks(text: str, name: str) -> dict:
    """Run a page's blocks in order in one namespace; raise ``AssertionError`` naming the first block that
    fails. Returns the namespace."""
    namespace: dict = {"__name__": "migrating_doc"}
    parser = doctest.DocTestParser()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for line, language, code in code_blocks(text):
        where = f"{name}:{line} ({language} block)"
        if language == "python":
            try:
                exec(compile(code, where, "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"{where} raised {type(err).__name__}: {err}") from err
        elif language == "pycon":
            test = parser.get_doctest(code, namespace, where, name, line)
            runner = doctest.DocTestRunner(optionflags=flags)
            report: list[str] = []
            runner.run(test, out=report.append, clear_globs=False)
            if runner.failures:
                raise AssertionError(f"{where}: its output differs from the page:\n{''.join(report)}")
        else:
            raise AssertionError(f"{where}: only python and pycon blocks are allowed (they are run)")
    return namespace


def test_migrating_page_has_examples_in_runnable_languages_only():
    blocks = code_blocks(PAGE.read_text(encoding="utf-8"))
    languages = {language for _, language, _ in blocks}
    assert languages == {"python", "pycon"}
    assert len(blocks) >= 5


def test_every_example_of_the_migrating_page_runs_as_written():
    namespace = run_blocks(PAGE.read_text(encoding="utf-8"), "docs/migrating.md")
    assert "model" in namespace  # the page's set-up ran


def test_the_runner_fails_when_an_example_stops_working():
    good = "```python\nx = 1 + 1\n```\n\n```pycon\n>>> x\n2\n>>> int('a')\n"
    good += "Traceback (most recent call last):\n    ...\n"
    good += "ValueError: invalid literal for int() with base 10: 'a'\n```\n"
    assert run_blocks(good, "good")["x"] == 2
    with pytest.raises(AssertionError, match=r"bad:1 \(python block\) raised NameError"):
        run_blocks("```python\ny = undefined_name\n```\n", "bad")
    with pytest.raises(AssertionError, match="its output differs"):
        run_blocks(good.replace("\n2\n", "\n3\n"), "bad")
    with pytest.raises(AssertionError, match="its output differs"):
        run_blocks(good.replace("'a'\n```", "'b'\n```"), "bad")
    with pytest.raises(AssertionError, match="only python and pycon"):
        run_blocks("```text\n>>> 1\n```\n", "bad")


_MTQ_NAME = re.compile(r"\bmtq\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_IMPORT_LINE = re.compile(r"^\| `[^`]*` \| `((?:import|from) modelopt_lite[^`]*)` \|$", re.M)


def test_every_mtq_name_the_page_lists_exists():
    """``import modelopt_lite.quantization as mtq; mtq.<name>`` for every ``mtq.<name>`` the page names
    (presets, config classes, entry points, ``mtq.nn.*``, ``mtq.calib.*``, ``mtq.tensor_quant``)."""
    import modelopt_lite.quantization as mtq

    names = sorted(set(_MTQ_NAME.findall(PAGE.read_text(encoding="utf-8"))))
    assert len(names) >= 25, names
    missing = []
    for dotted in names:
        obj = mtq
        for part in dotted.split("."):
            if not hasattr(obj, part):
                missing.append(f"mtq.{dotted}")
                break
            obj = getattr(obj, part)
    assert not missing, missing


def test_every_import_line_of_the_page_runs():
    lines = _IMPORT_LINE.findall(PAGE.read_text(encoding="utf-8"))
    assert len(lines) >= 6, lines
    for line in lines:
        exec(compile(line, "docs/migrating.md (the import lines)", "exec"), {})
