"""docs/architecture.md names files and the functions each step of its walks lives in: every one of them is
there (the page is a map; a map whose places moved is worse than none)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:[a-z_]+/)*[a-z_]+(?:\.py|/))`")
# `core/session.py` `Session.push_text`, `close`: a file and the names right after it
PLACE = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.py)`((?:,? `[A-Za-z_][\w.]*(?:\(\))?`)+)")


def _resolve(path: str) -> Path | None:
    for base in (ROOT, ROOT / "agent_server", ROOT / "tests" / "agent_server"):
        if (base / path).exists():
            return base / path
    return None


def test_every_file_the_page_names_is_there() -> None:
    missing = sorted({p for p in PATH.findall(DOC.read_text()) if _resolve(p) is None})
    assert not missing, missing


def test_every_function_a_walk_names_is_in_its_file() -> None:
    wrong: list[str] = []
    for path, names in PLACE.findall(DOC.read_text()):
        found = _resolve(path)
        assert found is not None, path
        source = found.read_text()
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", names):
            if name.endswith(".py"):
                continue  # a file beside it (the first test's)
            last = re.escape(name.split(".")[-1])
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{last}\b|^{last}\s*(?::[^=\n]+)?=", source, re.M):
                wrong.append(f"{path}: {name}")
    assert not wrong, wrong
