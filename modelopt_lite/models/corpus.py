"""The default models' corpus: English text every CPython install carries, read at run time.

Documents, in a fixed order: the ``__doc__`` of a fixed, sorted list of standard-library modules and of their
public classes, methods and functions (each defined in that module, 40 characters or more, first occurrence
of a text kept), then every ``pydoc_data.topics`` entry (the reference manual's topics) in key order.

The split is by document: a document is held out when the first 8 hex digits of the SHA-256 of its text, as
an integer, are below ``HELDOUT_PERCENT`` percent of 2**32. It therefore does not depend on the order or on
which other documents exist, and a text is on the same side on every machine and every Python version.
The corpus itself differs a little between CPython versions (docstrings change); ``corpus_digest`` names it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import warnings
from dataclasses import dataclass
from typing import Literal

__all__ = ["HELDOUT_PERCENT", "MODULES", "Document", "corpus_digest", "corpus_documents", "corpus_texts"]

Split = Literal["train", "heldout", "all"]
SPLITS: tuple[str, ...] = ("train", "heldout", "all")
HELDOUT_PERCENT = 10
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


@dataclass(frozen=True)
class Document:
    """One corpus document: ``name`` says where it came from (``re.compile``, ``topics:assert``)."""

    name: str
    text: str

    @property
    def heldout(self) -> bool:
        digest = hashlib.sha256(self.text.encode("utf-8")).hexdigest()
        return int(digest[:8], 16) < HELDOUT_PERCENT * (1 << 32) // 100


def _own_doc(obj: object) -> str | None:
    """The object's own docstring, cleaned (``inspect.getdoc`` would inherit a base class's text)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc if len(doc) >= _MIN_CHARS else None


def _module_documents(name: str) -> list[Document]:
    with warnings.catch_warnings():  # deprecated modules and aliases (typing.io) warn on import / access
        warnings.simplefilter("ignore", DeprecationWarning)
        return _walk(name)


def _walk(name: str) -> list[Document]:
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
    return [Document(n, text) for n, text in found if text is not None]


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[Document, ...]:
    """Every document, in the fixed order (stdlib docstrings, then ``pydoc_data.topics``), texts unique."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    docs: list[Document] = []
    candidates = [d for name in MODULES for d in _module_documents(name)]
    candidates += [Document(f"topics:{key}", topics[key].strip()) for key in sorted(topics)]
    for doc in candidates:
        if doc.text not in seen:
            seen.add(doc.text)
            docs.append(doc)
    return tuple(docs)


def corpus_texts(split: Split = "train") -> list[str]:
    """The texts of one split, ``"train"``, ``"heldout"`` (about ``HELDOUT_PERCENT`` % of the documents,
    never seen in training) or ``"all"``, in the corpus order."""
    if split not in SPLITS:
        raise ValueError(f"corpus split {split!r}: choose one of {list(SPLITS)}")
    docs = corpus_documents()
    if split == "all":
        return [d.text for d in docs]
    return [d.text for d in docs if d.heldout == (split == "heldout")]


def corpus_digest() -> str:
    """SHA-256 (16 hex digits) over the names and texts of every document, in order: names this corpus."""
    h = hashlib.sha256()
    for doc in corpus_documents():
        h.update(doc.name.encode("utf-8") + b"\0" + doc.text.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]
