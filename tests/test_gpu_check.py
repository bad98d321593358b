"""scripts/gpu_check.sh, the one device call a lent GPU gets, on the CPU: its shell parses, and under a budget too
short for its stages it still ends on time with every stage recorded, the results and the bundle written, and no
more than the device tool brings back (8 files, no folder). The stages' own work runs on a GPU only; `--device cpu`
with the default stages is the end-to-end run (BENCHMARKS.md), too long for CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BUDGET_S = 25


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.timeout(BUDGET_S + 60)
def test_a_spent_budget_ends_the_check_on_time_with_every_stage_recorded(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_STAGES": "0 3", "GPU_CHECK_BUDGET_S": str(BUDGET_S),
           "PY": sys.executable}
    t0 = time.monotonic()
    subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], cwd=ROOT, env=env, check=True, timeout=BUDGET_S + 45,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took_s = time.monotonic() - t0
    assert took_s < BUDGET_S + 15, f"the check ran {took_s:.0f} s on a {BUDGET_S} s budget"
    files = sorted(p.name for p in out.iterdir())
    assert all((out / name).is_file() for name in files) and len(files) <= 8, files
    assert {"results.json", "gpu_check.log", "bundle.tar.gz", "gpumem.csv"} <= set(files)
    stages = json.loads((out / "results.json").read_text())["stages"]
    assert stages["0"]["status"] == "ok", stages["0"]
    assert stages["0"]["figures"]["versions.json"]["torch"]
    assert "1" not in stages and "2" not in stages  # not asked for
    parts = stages["3"]["status"].split("; ")
    assert [part.split(" ")[0] for part in parts] == ["turbo", "tf32", "english", "ticks"]
    assert "out of time (budget)" in parts[-1], stages["3"]  # the last one never started
    assert stages["all"]["status"] == "done"
    assert (out / "gpu_check.log").read_text().rstrip().endswith(f"results: {out}/results.json")
