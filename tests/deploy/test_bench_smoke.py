"""The fleet benchmarks run end to end (tiny sizes; the figures are not looked at here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import require

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run(script: str, tmp_path: Path, *args: str) -> dict[str, object]:
    require("redis-server")
    require("haproxy")
    result = subprocess.run([sys.executable, f"scripts/{script}", "--out", str(tmp_path), *args], cwd=REPO,
                            check=False, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (written,) = tmp_path.glob("*.json")
    summary: dict[str, object] = json.loads(written.read_text())
    return summary


def test_bench_balancer(tmp_path: Path) -> None:
    summary = run("bench_balancer.py", tmp_path, "--clients", "2", "--turns", "2")
    runs = summary["runs"]
    assert isinstance(runs, dict) and set(runs) == {"direct_1", "haproxy_3", "haproxy_3_same"}
    assert all(r["failed_turns"] == 0 and r["ttfa_ms"]["n"] > 0 for r in runs.values())


def test_bench_phrase_cache(tmp_path: Path) -> None:
    summary = run("bench_phrase_cache.py", tmp_path, "--phrases", "1")
    ttfa = summary["ttfa_ms"]
    assert isinstance(ttfa, dict) and all(ttfa[k]["n"] == 1 for k in ("miss", "hit_remote", "hit_local"))
