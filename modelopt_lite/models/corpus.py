"""The default models' corpus: English text every CPython install carries, read at run time.

Documents, in a fixed order: the ``__doc__`` of a fixed, sorted list of standard-library modules and of their
public classes, methods and functions (each defined in that module, 40 characters or more, first occurrence
of a text kept), then every ``pydoc_data.topics`` entry (the reference manual's topics) in key order.

The split is by document: a document is held out when the first 8 hex digits of the SHA-256 of its text, as
an integer, are below ``HELDOUT_PERCENT`` percent of 2**32. It therefore does not depend on the order or on
which other documents exist, and a text is on the same side on every machine and every Python version.

The benchmark models use a three-way split of the same documents: ``"test"`` is exactly ``"heldout"``;
``"validation"`` is the training documents whose next 8 hex digits (digits 8 to 15 of the same SHA-256) are
below ``VALIDATION_PERCENT`` percent of 2**32 (about a tenth of ``"train"``); ``"fit"`` is the rest of
``"train"``, what a benchmark model trains on. ``"train"``, ``"heldout"`` and ``"all"`` are unchanged.
The corpus itself differs a little between CPython versions (docstrings change); ``corpus_digest`` names it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "HELDOUT_PERCENT",
    "SPLITS",
    "VALIDATION_PERCENT",
    "Document",
    "corpus_digest",
    "corpus_documents",
    "corpus_texts",
]

Split = Literal["train", "heldout", "all", "fit", "validation", "test"]
SPLITS: tuple[str, ...] = ("train", "heldout", "all", "fit", "validation", "test")
HELDOUT_PERCENT = 10
VALIDATION_PERCENT = 10


@dataclass(frozen=True)
class Document:
    """One corpus document: ``name`` says where it came from (``re.compile``, ``topics:assert``)."""

    name: str
    text: str

    @property
    def heldout(self) -> bool:
        """In ``"heldout"`` (= ``"test"``): the SHA-256's first 8 hex digits below ``HELDOUT_PERCENT`` %."""
        return int(self._digest()[:8], 16) < HELDOUT_PERCENT * (1 << 32) // 100

    @property
    def validation(self) -> bool:
        """In ``"validation"``: a training document whose SHA-256 hex digits 8 to 15 are below
        ``VALIDATION_PERCENT`` % (a slice independent of the held-out one)."""
        return not self.heldout and int(self._digest()[8:16], 16) < VALIDATION_PERCENT * (1 << 32) // 100

    @property
    def split(self) -> str:
        """The document's side in the three-way split: ``"fit"``, ``"validation"`` or ``"test"``."""
        return "test" if self.heldout else "validation" if self.validation else "fit"

    def _digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[Document, ...]:
    """Every document, in the fixed order (stdlib docstrings, then ``pydoc_data.topics``), texts unique.

    Read by a fresh, isolated interpreter (``python -I -S _stdlib_docs.py``): libraries imported here patch
    standard library objects (transformers adds ``logging.Logger.warning_advice``, torch replaces
    ``inspect.getfile``), which would change the corpus and with it the default models' version."""
    script = Path(__file__).with_name("_stdlib_docs.py")
    if not sys.executable:
        raise RuntimeError("reading the default corpus needs sys.executable (a Python interpreter to start)")
    done = subprocess.run([sys.executable, "-I", "-S", str(script)], capture_output=True, text=True,
                          encoding="utf-8", check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"reading the default corpus with {sys.executable} {script} failed:\n{done.stderr}"
        )
    seen: set[str] = set()
    docs: list[Document] = []
    for name, text in json.loads(done.stdout):
        doc = Document(name, text)
        if doc.text not in seen:
            seen.add(doc.text)
            docs.append(doc)
    return tuple(docs)


def corpus_texts(split: Split = "train") -> list[str]:
    """The texts of one split, in the corpus order: ``"train"``, ``"heldout"`` (about ``HELDOUT_PERCENT`` %
    of the documents, never seen in training) or ``"all"``; or, for the benchmark models, ``"fit"``,
    ``"validation"`` (about ``VALIDATION_PERCENT`` % of ``"train"``) and ``"test"`` (= ``"heldout"``)."""
    if split not in SPLITS:
        raise ValueError(f"corpus split {split!r}: choose one of {list(SPLITS)}")
    docs = corpus_documents()
    if split == "all":
        return [d.text for d in docs]
    if split in ("train", "heldout"):
        return [d.text for d in docs if d.heldout == (split == "heldout")]
    return [d.text for d in docs if d.split == split]


def corpus_digest() -> str:
    """SHA-256 (16 hex digits) over the names and texts of every document, in order: names this corpus."""
    h = hashlib.sha256()
    for doc in corpus_documents():
        h.update(doc.name.encode("utf-8") + b"\0" + doc.text.encode("utf-8") + b"\0")
    return h.hexdigest()[:16]
