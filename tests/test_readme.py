"""The README and docs/*.md: every ``python`` example runs as written (those importing
an engine in the engine's own virtual environment, from
tests/integrations/<engine>/test_readme_example.py; the rest here), every relative
link points at a file and heading that exist, and the README stays a front door."""

import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ENGINES = ("vllm", "sglang")
README_MAX_LINES = 200

# NOTE: a fence opens and closes at the start of a line; the info string is the language
_FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def pages() -> list[Path]:
    """The README, then every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


class Block(NamedTuple):
    """One fenced code block: its page, the page line its code starts on, its language."""

    page: Path
    line: int
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(lang: str | None = None) -> list[Block]:
    """Every fenced block of every page, in page order (only ``lang`` ones if given)."""
    out = []
    for page in pages():
        text = page.read_text()
        for m in _FENCE.finditer(text):
            info = m.group(1).strip()
            if lang is None or info == lang:
                out.append(Block(page, text.count("\n", 0, m.start(2)) + 1, info, m.group(2)))
    return out


def engine_of(code: str) -> str | None:
    """The engine a block imports, if any."""
    return next((e for e in ENGINES if re.search(rf"^\s*(from|import) {e}\b", code, flags=re.M)), None)


def python_blocks(engine: str | None = None) -> list[Block]:
    """The ``python`` blocks that import ``engine`` (None: those importing no engine)."""
    return [b for b in blocks("python") if engine_of(b.code) == engine]


def run_block(block: Block) -> None:
    # padded so that a traceback names the page and its own line numbers
    code = "\n" * (block.line - 1) + block.code
    exec(compile(code, str(block.page), "exec"), {"__name__": "__main__"})


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code (links and headings live outside them)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", page.read_text())):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(page.read_text())) if not _SCHEME.match(t)]


# -- examples --------------------------------------------------------------------------------------------
def test_pages_have_python_examples():
    found = python_blocks() + [b for e in ENGINES for b in python_blocks(e)]
    assert found, "no python example in README.md or docs/*.md"
    assert any(b.page == README for b in found), "README.md has no python example"


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.name)
def test_python_example_runs(block):
    run_block(block)


def test_engine_examples_are_run_where_the_engine_is():
    for engine in ENGINES:
        if python_blocks(engine):
            assert (Path(__file__).parent / "integrations" / engine / "test_readme_example.py").exists(), engine


def test_sglang_flags_are_a_valid_configuration():
    from kvtier.integrations.sglang.settings import Settings

    flags = [b for b in blocks() if "--hicache-storage-backend-extra-config '" in b.code]
    assert flags, "no page shows sglang's --hicache-storage-backend-extra-config"
    for block in flags:
        (config,) = re.findall(r"--hicache-storage-backend-extra-config '([^']*)'", block.code)
        extra = json.loads(config)
        assert extra["module_path"] == "kvtier.integrations.sglang" and extra["class_name"] == "KVTierStorage"
        assert Settings.parse(extra).interface_v1, block.name
        assert "--hicache-storage-backend dynamic" in block.code, block.name


# -- links and shape -------------------------------------------------------------------------------------
def test_relative_links_resolve():
    broken = []
    for page in pages():
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_every_doc_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert sorted(DOCS.glob("*.md")), "docs/ has no pages"
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_readme_is_a_front_door():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_pages_name_nothing_outside_the_repository():
    found = [f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for page in pages() for text in [page.read_text()]
             for m in re.finditer(r"(?i:\bissues?\s*#?\d+)|\bDESIGN\b", text)]
    assert not found, "references to issues or files outside the repository:\n" + "\n".join(found)
