"""The README is a front page and every link in it and in docs/ leads somewhere.

Checks: README.md is at most 250 lines and its first code block holds the two
commands a new user runs; every relative link in README.md and docs/*.md names
a file that exists, and every ``#anchor`` a heading of the file it points to
(GitHub's rules: lowercase, spaces to '-', punctuation other than '-' and '_'
dropped, a repeated heading gets ``-1``, ``-2``...); nothing there points outside
the repository.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 250
FORBIDDEN = ("../shared", "DESIGN.md", "STYLE.md")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        seen = counts.get(base, 0)
        counts[base] = seen + 1
        found.add(base if seen == 0 else f"{base}-{seen}")
    return found


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` whose file or anchor does not exist, as ``file:line: target (why)``."""
    problems = []
    for number, target in links(path):
        if EXTERNAL.match(target):
            continue
        where = f"{path.name}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{where} (no such file)")
            continue
        if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where} (no heading with that anchor in {linked.name})")
    return problems


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; it is a front page of at most {MAX_README_LINES}: move details to docs/"
    )


def test_the_readme_starts_with_make_run_and_make_test() -> None:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md has no code block"
    assert "make run" in block.group(1) and "make test" in block.group(1), block.group(1)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_nothing_points_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert [word for word in FORBIDDEN if word in text] == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Shared memory: doorbells\n" * 2)
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#shared-memory-doorbells) [fine too](other.md#shared-memory-doorbells-1) [here](#page)\n"
        "[gone](missing.md) [no anchor](other.md#doorbells) [web](https://example.com/x.md)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
    )
    assert [problem.split(": ", 1)[1] for problem in broken_links(page)] == [
        "missing.md (no such file)",
        "other.md#doorbells (no heading with that anchor in other.md)",
    ]


def test_anchors_follow_githubs_rules() -> None:
    assert slug("Workers and a ps on one host: shared memory") == "workers-and-a-ps-on-one-host-shared-memory"
    assert slug("`TF_CONFIG`: a Kubeflow TFJob") == "tf_config-a-kubeflow-tfjob"
    assert slug("1. One command per host, as in TensorFlow 1.x") == "1-one-command-per-host-as-in-tensorflow-1x"
    assert slug("python -m psdk report") == "python--m-psdk-report"


def test_the_protocol_page_describes_every_declared_op_field_reply_and_error_kind() -> None:
    from psdk import protocol

    page = (REPO / "docs" / "protocol.md").read_text()
    for op in protocol.OPS.values():
        section = page.split(f"### `{op.name}`\n", 1)
        assert len(section) == 2, f"docs/protocol.md has no section for {op.name}"
        body = section[1].split("\n### ", 1)[0]
        for field in op.fields:
            assert f"| `{field.name}` | {field.type.name}" in body, f"{op.name}.{field.name} is not described"
        assert op.sender.value in body
    for reply in protocol.REPLIES.values():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{reply.name}` |")), None)
        assert row is not None and all(f"`{name}`" in row for name in reply.fields), reply.name
    for kind in protocol.ERROR_KINDS:
        assert f"| `{kind}` |" in page
