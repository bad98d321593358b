"""scripts/bench_engine.py --ops end to end on the tiny presets: a row per (variant, segments, voices) with the
counts of a real decode step, the table printed, the JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_bench_engine_ops_on_tiny_weights(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "--ops", "--ops-sizes", "tiny", "--ops-segments", "1", "3",
         "--ops-turbo-segments", "2", "--ops-steps", "1", "--ops-timed-steps", "1", "--threads", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["ops"]
    assert [(r["variant"], r["segments"], r["voices"]) for r in rows] == [
        ("english", 1, 1), ("english", 3, 1), ("english", 3, 3), ("turbo", 2, 1), ("turbo", 2, 2)]
    for row in rows:
        assert row["checkout"] == "this" and row["size"] == "tiny"
        assert row["ops"] > 20 * 2  # two tiny layers, each well over 20 ops
        assert row["ops_per_layer"] == pytest.approx(row["ops"] / 2, abs=0.05)
        assert 0 < row["kernel_ops"] < row["ops"]
        assert row["device_to_host"] >= 1  # the sampled ids come back, whatever the engine
        assert row["ms"] > 0
    assert "ops/layer" in proc.stdout
