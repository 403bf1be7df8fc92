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


# A code span that names a file of this repository (`omni_serve/api/http.py`, `api/http.py:42`,
# `graphs/tiny_omni.yaml`), a module (`omni_serve.api.http`) or a module's function or class
# (`omni_serve.api.http:read_form`, `api/failure_status.from_failure`, `omni_serve.app:build_app`).
REPO_PATH = re.compile(r"^(?:omni_serve|tests|benchmarks|graphs|docs|deploy|\.ci|\.gpu)/[\w./-]*\w(?::[\w.]+)?$")
PACKAGE_PATH = re.compile(r"^(?:api|graph|engines|models|media|cli|checkpoints|platforms)/[\w/]+\.(?:py|[a-z_]+)$")
DOTTED = re.compile(r"^omni_serve(?:\.\w+)+(?::\w+)?$")


def code_spans(path: Path) -> list[tuple[int, str]]:
    """(line number, content) of every code span outside fenced blocks (commands live in those)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    text = "\n".join(lines)
    return [(text.count("\n", 0, m.start()) + 1, m.group(0).strip("`").strip()) for m in CODE_SPAN.finditer(text)]


def _defines(file: Path, name: str) -> bool:
    return bool(
        re.search(rf"^\s*(?:async def|def|class) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]", file.read_text(), re.M)
    )


def resolves(span: str) -> bool:
    """Whether the file, module or name ``span`` names exists (True for a span that names none of them)."""
    if REPO_PATH.match(span) or PACKAGE_PATH.match(span):
        file, _, suffix = span.partition(":")
        base = ROOT / file if REPO_PATH.match(span) else ROOT / "omni_serve" / file
        if base.exists():
            return not suffix or suffix.isdigit() or _defines(base, suffix.split(".")[0]) if base.is_file() else True
        stem, _, name = file.rpartition(".")  # api/failure_status.from_failure
        module = base.parent / f"{Path(stem).name}.py"
        return module.is_file() and _defines(module, name)
    if DOTTED.match(span):
        dotted, _, name = span.partition(":")
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ROOT.joinpath(*parts[:cut])
            rest = parts[cut:] + ([name] if name else [])
            for file in (module.with_suffix(".py"), module / "__init__.py"):
                if file.is_file():
                    return not rest or _defines(file, rest[0])
        return False
    return True


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_module_and_function_a_page_names_exists(path: Path) -> None:
    assert [f"{path.relative_to(ROOT)}:{n}: `{span}`" for n, span in code_spans(path) if not resolves(span)] == []


def test_every_module_is_named_in_the_readmes_map_or_the_design_page() -> None:
    """Each module of omni_serve/ appears in the README's package map by its file name, or on docs/design.md by its
    path or dotted name."""
    readme = (ROOT / "README.md").read_text()
    package_map = readme[readme.index("## Design") :].split("```")[1]
    design = (ROOT / "docs" / "design.md").read_text()
    unnamed = []
    for file in sorted((ROOT / "omni_serve").rglob("*.py")):
        relative = file.relative_to(ROOT / "omni_serve")
        if file.name == "__init__.py" and relative.parent != Path("."):
            continue  # a package is named by its folder
        dotted = "omni_serve." + ".".join(relative.with_suffix("").parts)
        in_map = re.search(rf"(?<![\w/]){re.escape(file.name)}", package_map)
        if file.name != "__init__.py" and not (in_map or f"omni_serve/{relative}" in design or dotted in design):
            unnamed.append(str(relative))
    assert unnamed == []


def test_the_span_checker_tells_what_exists() -> None:
    assert resolves("omni_serve/api/http.py") and resolves("api/http.py") and resolves("omni_serve.api.http")
    assert resolves("omni_serve.api.http:read_form") and resolves("api/failure_status.from_failure")
    assert resolves("omni_serve.app:build_app") and resolves("omni_serve/api/http.py:12")
    assert not resolves("omni_serve/api/nowhere.py") and not resolves("omni_serve.api.http:no_such_function")
    assert not resolves("api/errors.from_failure") and not resolves("omni_serve.graph.orchestrator.OmniRequest")
    assert resolves("make serve") and resolves("--pace thinker=0.05")  # names no file: nothing to check
