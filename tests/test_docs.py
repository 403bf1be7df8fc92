"""The docs hold together: every relative link in README.md and docs/*.md resolves, anchors included,
and every docs page is linked from the README. Plain file reading: no Ray, no omni_serve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\n[ \t]*\n).)+?\1", re.DOTALL)  # within one paragraph
# [text](target) or [text](target "title"), images too; the text may wrap onto the next line and
# hold brackets one level deep.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """``text`` with fenced code blocks and code spans blanked out, line breaks kept (so offsets
    still give line numbers)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(lines))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and '_'
    removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # keeps letters, digits, '_', '-' and spaces
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of ``path`` get, duplicates numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``path``'s prose, code spans excluded."""
    text = prose(path.read_text())
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in LINK.finditer(text)]


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
        elif anchor and linked.suffix != ".md":
            problems.append(f"{where}: an anchor into a file that is not markdown")
    return problems


def test_there_are_docs_pages() -> None:
    assert DOCS, "docs/*.md is empty"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _, t in links(readme) if not EXTERNAL.match(t)}
    assert [str(p.relative_to(ROOT)) for p in DOCS if p.resolve() not in linked] == []


def test_the_checker_sees_what_it_checks() -> None:
    """The slug rules and the link finder on cases the docs use, so a checker that finds nothing fails."""
    assert slug("Against native `vllm serve` (the same engine)") == "against-native-vllm-serve-the-same-engine"
    assert slug("vLLM-Omni on CPU (`graphs/tiny_omni_vllm.yaml`)") == "vllm-omni-on-cpu-graphstiny_omni_vllmyaml"
    assert slug("Omni input: images, audio and video in chat messages") == (
        "omni-input-images-audio-and-video-in-chat-messages"
    )
    assert any(target.startswith("docs/") for _, target in links(ROOT / "README.md"))
    assert "design" in anchors(ROOT / "README.md")
