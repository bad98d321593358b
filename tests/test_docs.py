"""The documentation's own links, and BENCHMARKS.md's shape.

Every relative link in README.md, BENCHMARKS.md and docs/ names a file that exists and, with a `#fragment`, a
heading of that file (GitHub's anchors). BENCHMARKS.md is one page of today's figures: each of its subject
sections names a machine from its table, a date and a command, and it links every history file in docs/bench/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]
BENCHMARKS = REPO / "BENCHMARKS.md"
HISTORY = REPO / "docs" / "bench"
SUBJECTS = ("GPU", "CPU capacity", "Server overhead", "Output formats", "Fleet", "Phrase cache")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXAMPLES = {"url"}  # "[text](url)": how markdown is said, not a link (docs/compatibility.md, docs/protocol.md)


def prose(path: Path) -> str:
    return CODE_SPAN.sub("", CODE_BLOCK.sub("", path.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    repeats: dict[str, int] = {}  # a repeated heading's anchor gets -1, -2, ...
    for heading in re.findall(r"^#{1,6}\s+(.+)$", CODE_BLOCK.sub("", path.read_text()), re.MULTILINE):
        base = slug(heading)
        n = repeats.get(base, 0)
        repeats[base] = n + 1
        out.add(f"{base}-{n}" if n else base)
    return out


def test_slug_is_githubs() -> None:
    assert slug("TLS: no session tickets (2026-12-05, CPU-3)") == "tls-no-session-tickets-2026-12-05-cpu-3"
    assert slug("Engine: batched step loop vs chatterbox's sequential `T3.inference` (issue 2)") == \
        "engine-batched-step-loop-vs-chatterboxs-sequential-t3inference-issue-2"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target) or target in EXAMPLES:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def sections(path: Path) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", path.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_benchmarks_is_one_page_of_figures_with_machine_date_and_command() -> None:
    page = sections(BENCHMARKS)
    assert set(SUBJECTS) <= set(page), set(SUBJECTS) - set(page)
    machines = re.findall(r"^\| (H200|CPU-[\w]+) \|", page["Machines"], re.MULTILINE)
    assert machines
    for title, text in page.items():
        if title in ("Machines", "History"):
            continue
        assert re.search(r"\b2026-\d\d-\d\d\b", text), f"{title}: no date"
        assert any(re.search(rf"\b{re.escape(m)}\b", text) for m in machines), f"{title}: no machine of the table"
        assert re.search(r"`(?:[A-Z_]+=\S+ )*(?:python|pytest) [^`]+`", text), f"{title}: no command"
    assert len(BENCHMARKS.read_text().splitlines()) <= 300, "one page: history goes to docs/bench/"


def test_every_history_file_and_plot_is_reachable() -> None:
    linked = {(BENCHMARKS.parent / t).resolve() for t in LINK.findall(prose(BENCHMARKS))}
    index_links = {(HISTORY / t).resolve() for t in LINK.findall(prose(HISTORY / "README.md"))}
    for history in sorted(HISTORY.glob("*.md")):
        assert history in linked, f"BENCHMARKS.md does not link {history.name}"
        if history.name != "README.md":
            assert history in index_links, f"docs/bench/README.md does not list {history.name}"
    shown = "".join(p.read_text() for p in HISTORY.glob("*.md"))
    for plot in sorted(HISTORY.glob("*.png")):
        assert plot.name in shown, f"{plot.name} is shown nowhere"
