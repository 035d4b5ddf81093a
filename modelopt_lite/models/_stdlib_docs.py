"""Print the default corpus' documents as JSON ``[[name, text], ...]``: run by ``corpus.corpus_documents``
in a fresh ``python -I -S`` so that no imported library has patched the standard library it reads.

Documents, in order: the own ``__doc__`` (40 characters or more) of each module in ``MODULES`` and of its
public classes, their public methods and its public functions (each defined in that module), then every
``pydoc_data.topics`` entry in key order. Standard library only.
"""

import importlib
import inspect
import json
import sys
import warnings

_MIN_CHARS = 40

# Pure-Python modules that import without side effects on Linux, macOS and Windows, CPython 3.10 and later
# (a module missing from some version is skipped; the digest records the difference).
MODULES: tuple[str, ...] = tuple(
    sorted(
        """abc argparse ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures
        configparser contextlib copy csv dataclasses datetime decimal difflib doctest email enum filecmp
        fnmatch fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html html.parser
        http.client http.server imaplib inspect io ipaddress itertools json logging lzma mailbox mimetypes
        numbers operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint queue quopri
        random re reprlib sched secrets selectors shelve shlex shutil smtplib socket socketserver sqlite3
        statistics string struct subprocess tarfile tempfile textwrap threading timeit tokenize trace
        traceback types typing unittest urllib.parse urllib.request uuid warnings wave weakref
        xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo""".split()
    )
)


def _own_doc(obj: object) -> str | None:
    """The object's own docstring, cleaned (``inspect.getdoc`` would inherit a base class's text)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc if len(doc) >= _MIN_CHARS else None


def _module_documents(name: str) -> list[tuple[str, str]]:
    with warnings.catch_warnings():  # deprecated modules and aliases (typing.io) warn on import / access
        warnings.simplefilter("ignore", DeprecationWarning)
        return _walk(name)


def _walk(name: str) -> list[tuple[str, str]]:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    found = [(name, _own_doc(module))]
    namespace = vars(module)
    for attr in sorted(namespace):
        obj = namespace[attr]
        if attr.startswith("_") or not isinstance(getattr(obj, "__module__", None), str):
            continue
        if obj.__module__ != module.__name__ or inspect.ismodule(obj):
            continue
        if inspect.isclass(obj):
            found.append((f"{name}.{attr}", _own_doc(obj)))
            members = vars(obj)
            found += [(f"{name}.{attr}.{m}", _own_doc(members[m])) for m in sorted(members)
                      if not m.startswith("_") and inspect.isfunction(members[m])]  # fmt: skip
        elif inspect.isfunction(obj):
            found.append((f"{name}.{attr}", _own_doc(obj)))
    return [(n, text) for n, text in found if text is not None]


def main() -> None:
    from pydoc_data.topics import topics

    found = [d for name in MODULES for d in _module_documents(name)]
    found += [(f"topics:{key}", topics[key].strip()) for key in sorted(topics)]
    sys.stdout.write(json.dumps(found))


if __name__ == "__main__":
    main()
