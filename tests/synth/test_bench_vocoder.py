"""scripts/bench_vocoder.py --mode batched end to end on the tiny preset (the GPU check runs it full size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_batched_mode_runs_on_the_tiny_preset(tmp_path: Path) -> None:
    out = tmp_path / "bv.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_vocoder.py", "--mode", "batched", "--preset", "tiny", "--device", "cpu",
         "--variants", "turbo", "--batch-sizes", "1", "3", "--reps", "1", "--threads", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["results"]
    assert {(r["shape"], r["batch"]) for r in rows} == {(s, b) for s in ("first_chunk_12", "chunk_24", "chunk_48")
                                                          for b in (1, 3)}
    assert len({r["ops_per_tick"] for r in rows}) == 1  # the same ops whatever the batch and the tick's point
    assert all(r["stream0_bitwise_as_alone"] for r in rows)
    assert all(r["eager_ms_median"] > 0 and r["eager_audio_s_per_s"] > 0 for r in rows)
