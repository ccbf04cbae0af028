"""The README and docs/ speak of the project only: nothing a clone lacks, no tool calls of the
systems the project was built with, no issue numbers; every relative link resolves in the repo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.sh")])

# (what, pattern): each names something a reader of a clone cannot see or use
FORBIDDEN = [
    ("a path outside the repository", re.compile(r"\.\./shared|/work/")),
    ("a tool call of another system", re.compile(r"\brun\(\s*command\s*=|\bcarry\s*=|\btimeout_s\s*=")),
    ("an issue number", re.compile(r"(?i)\bissues?\s*(?:#\s*)?\d+|(?<![\w/&#\[(])#\d+\b")),
    ("a machine lent by someone else", re.compile(r"(?i)\blent\b|\bKINDS\.md\b")),
    ("the people or jobs that built it", re.compile(
        r"(?i)other engineers|engineers' jobs|helper's job|\bthe lead('s)?\b|other agents|"
        r"a session whose task")),
    ("a design file that is not in the repository", re.compile(r"(?<![\w/])DESIGN\.md")),
]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_project_only(path):
    text = path.read_text()
    found = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {what}: {m.group(0)!r}"
             for what, pattern in FORBIDDEN for m in pattern.finditer(text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", [p for p in DOCS if p.suffix == ".md"], ids=lambda p: p.name)
def test_relative_links_resolve_in_the_repository(path):
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if not file.exists() or ROOT.resolve() not in file.parents:
            missing.append(target)
    assert not missing, f"{path.name} links to what a clone lacks: {missing}"


def test_the_checker_catches_what_it_is_for():
    """Each pattern matches the kind of text it exists to keep out (a check that cannot fail
    proves nothing), and none matches ordinary prose about the project."""
    bad = ['run(command="bench/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=540)',
           "see ../shared/DESIGN.md", "as issue 14 says", "fixed in #23", "the lent H200",
           "the other engineers' jobs", "a device-resident runtime is the lead's change"]
    for text in bad:
        assert any(p.search(text) for _, p in FORBIDDEN), text
    good = ["`bench/gpu_check.sh` writes gpu_check.json", "the transport issues collectives",
            "docs/design.md#transports", "a 1.5x straggler", "pytree helpers over optree"]
    for text in good:
        assert not any(p.search(text) for _, p in FORBIDDEN), text
