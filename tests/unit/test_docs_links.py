"""Every link in the repository's markdown (README.md, docs/, examples/) resolves inside the repository:
a relative link names an existing file or folder, an ``#anchor`` names a heading of the target page (GitHub's
slugs), and nothing points outside the repository except http(s) pages (issue 20). Users have only the
repository, so a link to a sibling folder of the checkout or to a local path is a broken link for them."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("examples/**/*.md")])

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
#: ``[text](target)`` and ``![alt](target)``; the target may carry a ``"title"``.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
#: ``[label]: target`` reference definitions.
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked (kept with
    ``keep_code``: a heading's code is part of its anchor)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line if keep_code else _CODE_SPAN.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code marks, emphasis and link targets dropped),
    lower case, punctuation other than ``-`` and ``_`` removed, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[`*]", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8"), keep_code=True):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition of a page, outside code."""
    found = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        found += [(number, m.group(1)) for m in _INLINE.finditer(line)]
        definition = _DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def link_problem(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) does not resolve inside the repository, or None when it does."""
    if re.match(r"https?://[^/\s]+", target):
        host = re.match(r"https?://([^/:\s]+)", target).group(1).lower()
        if host in ("localhost", "127.0.0.1", "0.0.0.0") or host.endswith(".local"):
            return f"{target}: not a public page"
        return None
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return f"{target}: only http(s) pages and paths inside the repository may be linked"
    if not target:
        return "an empty link"
    path_part, _, anchor = target.partition("#")
    if path_part.startswith("/"):
        return f"{target}: an absolute path (link relative to the page)"
    resolved = (page.parent / path_part).resolve() if path_part else page
    if not resolved.is_relative_to(REPO):
        return f"{target}: points outside the repository"
    if not resolved.exists():
        return f"{target}: {resolved.relative_to(REPO)} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}"
    return None


def test_the_pages_exist():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/accuracy.md", "docs/migrating.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_resolves_inside_the_repository(page):
    problems = [f"line {n}: {why}" for n, t in links(page) if (why := link_problem(page, t))]
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_names_a_folder_beside_the_checkout(page):
    text = page.read_text(encoding="utf-8")
    internal = ("../shared", "shared/NUMERICS", "shared/DESIGN", "shared/USERS")
    named = [name for name in internal if name in text]
    assert not named, f"{page.relative_to(REPO)} names {named}: users only have the repository"


def test_the_checker_catches_broken_links():
    page = REPO / "docs" / "accuracy.md"
    assert link_problem(page, "../README.md") is None
    assert link_problem(page, "migrating.md#the-import-lines") is None
    assert link_problem(page, "https://github.com/NVIDIA/Model-Optimizer") is None
    assert "does not exist" in link_problem(page, "missing.md")
    assert "no heading" in link_problem(page, "migrating.md#no-such-heading")
    assert "outside the repository" in link_problem(page, "../../shared/NUMERICS.md")
    assert "absolute path" in link_problem(page, "/etc/passwd")
    assert "only http(s)" in link_problem(page, "file:///etc/passwd")
    assert "not a public page" in link_problem(page, "http://localhost:8000/x")


def test_slugs_and_links_follow_github(tmp_path):
    assert slug("Train: QAT and QAD") == "train-qat-and-qad"
    assert slug("Several processes: DDP and FSDP2") == "several-processes-ddp-and-fsdp2"
    assert slug("`mtq.quantize` and *friends*") == "mtqquantize-and-friends"
    assert "with-mtq-directly" in anchors(REPO / "docs" / "distributed.md")  # code in a heading counts
    assert slug("NVFP4 (E2M1, block 16)") == "nvfp4-e2m1-block-16"
    page = tmp_path / "page.md"
    page.write_text(
        '# Top\n## Top\nSee [a](a.md), ![img](b.png "title") and [c][ref], not `[d](d.md)`.\n'
        "```\n[e](e.md)\n```\n[ref]: c.md#top-1\n"
    )
    assert links(page) == [(3, "a.md"), (3, "b.png"), (7, "c.md#top-1")]
    assert anchors(page) == {"top", "top-1"}
