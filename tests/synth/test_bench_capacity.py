"""scripts/bench_capacity.py end to end on the tiny preset: it starts the real server from a checkout given with
--repo, runs 1 and 2 native sessions, and writes the JSON the issue asks for; a checkout whose server does not
start is a row with the reason, not the end of the benchmark."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_bench_capacity_runs_on_tiny_weights(tmp_path: Path) -> None:
    out = tmp_path / "capacity"
    broken = tmp_path / "broken"  # a checkout whose server exits at once
    (broken / "agent_server").mkdir(parents=True)
    (broken / "agent_server" / "__init__.py").write_text("")
    (broken / "agent_server" / "cli.py").write_text("raise SystemExit('no engine today')\n")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_capacity.py", "--weights", "random-tiny", "--variant", "turbo",
         "--sessions", "1", "2", "--repo", f"broken={broken}", "--repo", f"mine={ROOT}", "--threads", "1,1",
         "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--", "--cpu-weights", "fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]  # 2: a checkout did not start
    report = json.loads(out.with_suffix(".json").read_text())
    failed, run = report["runs"]
    assert failed["label"] == "broken" and failed["rounds"] == []
    assert "server did not start" in failed["error"] and "no engine today" in failed["error"]
    assert failed["ready_s"] is None
    assert (tmp_path / "logs" / "capacity_mine_server.log").is_file()
    assert run["label"] == "mine" and run["repo"] == str(ROOT) and run["random_weights"] is True
    assert run["ready_s"] > 0  # the start-up's time (the GPU check reads what a full-size start costs)
    assert "--threads" in run["server_args"] and "--cpu-weights" in run["server_args"]
    assert [r["sessions"] for r in run["rounds"]] == [1, 2]
    for r in run["rounds"]:
        assert r["ok"] == r["sessions"] and r["failed"] == 0, r["errors"]
        assert 0 < r["ttfa_p50_s"] <= r["ttfa_p95_s"] < 60
        assert r["audio_s"] > 0 and r["audio_s_per_wall_s"] > 0
        assert r["underrun_mean_s"] >= 0 and r["underruns"] >= 0
    assert "audio-s/s" in proc.stdout and "mine" in proc.stdout


def test_playback_counts_dry_time() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    bench_capacity = importlib.import_module("bench_capacity")  # scripts/ is on sys.path at run time only

    # frames of 0.5 s: the second arrives on time, the third 0.3 s after the second has finished playing
    frames = [(10.0, 0.5), (10.4, 0.5), (11.3, 0.5), (11.5, 0.5)]
    dry_s, times = bench_capacity.playback(frames)
    assert times == 1 and dry_s == pytest.approx(0.3)
    assert bench_capacity.playback([(0.0, 1.0), (0.5, 1.0), (1.9, 1.0)]) == (0.0, 0)


@pytest.mark.timeout(600)
def test_bench_capacity_with_a_job_load(tmp_path: Path) -> None:
    """--job-load: round A (live alone), a jobs-only window, round B (live beside the backlog), in one run."""
    out = tmp_path / "jobs"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_capacity.py", "--weights", "random-tiny", "--variant", "turbo",
         "--sessions", "1", "--threads", "1,1", "--job-load", "2", "--job-chars", "3000", "--job-window-s", "4",
         "--repeat", "2", "--think-s", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (run,) = report["runs"]
    assert run["error"] == "" and "--max-running-jobs-per-key" in run["server_args"]
    assert run["saturation"]["engine_audio_s_per_wall_s"] > 0 and run["saturation"]["window_s"] >= 4
    (alone,) = run["rounds"]
    (beside,) = run["job_rounds"]
    live = beside["live"]
    assert live["sessions"] == 1 and live["ok"] + live["failed"] == 2  # --repeat 2
    # synth's scheduler honours Priority: job segments never keep a live session out (docs/jobs.md "Live first")
    assert live["ok"] == 2, live["errors"]
    # --think-s: the live round's turns are counted without the thinking, round B's rates over it all
    assert report["args"]["think_s"] == 1.0
    assert beside["wall_s"] >= live["wall_s"] + 1.0
    assert beside["live_audio_s_per_wall_s"] == pytest.approx(live["audio_s"] / beside["wall_s"])
    assert beside["ttfa_p95_vs_alone"] == pytest.approx(live["ttfa_p95_s"] / alone["ttfa_p95_s"])
    # (job audio beside a short live round may be 0: a job segment reaches the vocoder only once its generation
    # has ended, and a live arrival may restart it; the saturation window above shows the jobs render)
    assert beside["job_audio_s_per_wall_s"] >= 0
    # the share of the unused capacity the jobs took: None only when the live round left none unused (a short
    # saturation window on a loaded machine can measure less than the live round's own audio-s/s)
    room = run["saturation"]["engine_audio_s_per_wall_s"] - beside["live_audio_s_per_wall_s"]
    if room > 0:
        assert beside["unused_capacity_used"] == pytest.approx(beside["job_audio_s_per_wall_s"] / room)
    else:
        assert beside["unused_capacity_used"] is None
    assert "unused used" in proc.stdout and "idle filled" in proc.stdout
    # one second between the two turns: the jobs' audio of the round against the saturation over that second
    assert beside["idle_time_filled"] == pytest.approx(
        beside["job_audio_s_per_wall_s"] * beside["wall_s"] / (run["saturation"]["engine_audio_s_per_wall_s"] * 1.0))
