"""The README and every docs/ page hold: each relative link reaches a file (and its `#anchor` a
heading there, by GitHub's slug), each image exists, each ```python block compiles (as an
IPython cell: `%load_ext`, `%%traceml` and `!cmd` lines count) and each ```bash block passes
`bash -n`. Pure reading, plus one `bash -n` per shell block."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO
from IPython.core.inputtransformer2 import TransformerManager

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str


def split_page(path: Path) -> tuple[list[tuple[int, str]], list[Block]]:
    """The page's prose lines (outside fenced blocks) with their numbers, and its fenced blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence: str | None = None
    start, language, body = 0, "", []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            opened = FENCE.match(line.lstrip())
            if opened:
                fence, start, language, body = opened.group(1), number, opened.group(2).lower(), []
            else:
                prose.append((number, line))
        elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append(Block(path, start, language, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{path.name}:{start}: a fenced block is never closed"
    return prose, blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, lower case, punctuation dropped (word
    characters, hyphens and spaces stay), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug on a page, duplicates numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in split_page(path)[0]:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in the page's prose, code spans left out."""
    found: list[tuple[int, str]] = []
    for number, line in split_page(path)[0]:
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken_link(page: Path, target: str) -> str | None:
    """Why a link from `page` does not resolve, or None when it does (web links are not fetched)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    linked = (page.parent / file_part).resolve() if file_part else page
    if not linked.exists():
        return f"{file_part} does not exist"
    inside = ROOT in page.resolve().parents
    if inside and ROOT not in linked.parents and linked != ROOT:  # GitHub would not show it
        return f"{file_part} is outside the repository"
    if anchor:
        if linked.suffix != ".md":
            return f"#{anchor} on a file that is not Markdown"
        if anchor not in anchors(linked):
            return f"#{anchor}: no such heading in {linked.name}"
    return None


def all_blocks(language: str) -> list[Block]:
    return [b for page in PAGES for b in split_page(page)[1] if b.language == language]


def block_id(block: Block) -> str:
    return f"{block.page.relative_to(ROOT)}:{block.line}"


def test_the_pages_are_there() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "api.md", "steps.md", "verdicts.md", "testing.md"} <= names
    assert all_blocks("python") and all_blocks("bash")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_image_resolves(page: Path) -> None:
    problems = [
        f"{page.relative_to(ROOT)}:{number}: ({target}) {why}"
        for number, target in links(page)
        if (why := broken_link(page, target)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reached_from_the_readme() -> None:
    readme = ROOT / "README.md"
    reached = {(readme.parent / t.partition("#")[0]).resolve() for _, t in links(readme)}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in reached]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("block", all_blocks("python"), ids=block_id)
def test_python_blocks_compile(block: Block) -> None:
    source = TransformerManager().transform_cell(block.text)
    try:
        compile(source, block_id(block), "exec")
    except SyntaxError as exc:
        raise AssertionError(f"{block_id(block)}: {exc}\n{block.text}") from None


def test_bash_blocks_parse() -> None:
    problems = []
    for block in all_blocks("bash"):
        checked = subprocess.run(
            ["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=10
        )
        if checked.returncode != 0:
            problems.append(f"{block_id(block)}: {checked.stderr.strip()}")
    assert not problems, "\n".join(problems)


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 250  # read in five minutes
    first = split_page(readme)[1][0]
    assert first.language == "bash"
    commands = [line.split("#")[0].split() for line in first.text.splitlines() if line.strip()]
    assert [c[0] for c in commands] == ["./scripts/demo.sh", "./scripts/test.sh"]
    for (command, *_) in commands:
        script = ROOT / command
        assert script.is_file() and script.stat().st_mode & 0o111, f"{command} is not executable"


# The checker itself, on cases whose answer is known.


def test_github_slugs() -> None:
    assert github_slug("Measure the fix before you apply it: `%traceml tune`") == (
        "measure-the-fix-before-you-apply-it-traceml-tune"
    )
    assert github_slug("Scripts: `!python train.py`, `!torchrun`, and a command line") == (
        "scripts-python-trainpy-torchrun-and-a-command-line"
    )
    assert github_slug("The JSON: `--save PATH.json`, `run.to_dict()`") == (
        "the-json---save-pathjson-runto_dict"
    )
    assert github_slug("Long sessions (real kernels)") == "long-sessions-real-kernels"


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Part one\n\n## Part one\n\n"
        "[ok](#part-one-1) [bad](#part-three) [gone](missing.md) ![img](pic.png)\n"
        "`[not a link](nowhere.md)` [web](https://example.com/x)\n"
        "```python\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    found = links(page)
    assert [t for _, t in found] == [
        "#part-one-1", "#part-three", "missing.md", "pic.png", "https://example.com/x",
    ]
    verdicts = {t: broken_link(page, t) for _, t in found}
    assert verdicts["#part-one-1"] is None and verdicts["https://example.com/x"] is None
    assert verdicts["#part-three"] and verdicts["missing.md"] and verdicts["pic.png"]
    (block,) = split_page(page)[1]
    assert block.language == "python" and block.line == 9


def test_ipython_cells_count_as_python() -> None:
    cell = "%%traceml --name x\n!echo hi\nfor x in loader:\n    pass\n"
    compile(TransformerManager().transform_cell(cell), "cell", "exec")
    with pytest.raises(SyntaxError):
        compile(TransformerManager().transform_cell("for x in loader\n    pass\n"), "cell", "exec")
