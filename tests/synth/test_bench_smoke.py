"""scripts/bench_engine.py end to end on the tiny presets: the benchmark runs, compares against chatterbox's
own inference and writes the JSON the issue asks for (`speedup` per number of segments, time to first audio)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_bench_engine_runs_on_tiny_weights(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "--weights", "random-tiny", "--segments", "1", "2",
         "--tokens", "6", "--sequential-segments", "2", "--ttfa-tokens", "60", "--threads", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for variant in ("english", "turbo"):
        entry = report["variants"][variant]
        assert set(report["speedup"][variant]) == {"1", "2"}
        assert all(value > 0 for value in report["speedup"][variant].values())
        assert [row["equal_to_reference"] for row in entry["batched"]] == ["1/1", "2/2"]  # seeded: same tokens
        assert entry["batch_invariant_segments"] == "1/1"
        ttfa = entry["time_to_first_audio"]
        assert ttfa["first_chunk_tokens"] == 12 and ttfa["steps_to_first_chunk"] >= 19
        assert 0 < ttfa["first_token_s"] < ttfa["first_chunk_s"]


@pytest.mark.skipif("AVX512" not in torch.backends.cpu.get_cpu_capability(),
                    reason="--cpu-weights bf16 needs an AVX-512 CPU")
@pytest.mark.timeout(600)
def test_bench_engine_with_bf16_weights(tmp_path: Path) -> None:
    """--cpu-weights bf16: the reference runs on the same rounded model, so the seeded tokens still agree."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "--weights", "random-tiny", "--variants", "turbo", "english",
         "--segments", "1", "3", "--tokens", "8", "--sequential-segments", "3", "--skip-ttfa", "--threads", "1",
         "--cpu-weights", "bf16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "projection weights rounded to bf16" in proc.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["cpu_weights"] == "bf16"
    for variant in ("turbo", "english"):
        entry = report["variants"][variant]
        assert [row["equal_to_reference"] for row in entry["batched"]] == ["1/1", "3/3"]
        assert entry["batch_invariant_segments"] == "1/1"


@pytest.mark.timeout(600)
def test_bench_host_step_runs_and_reports(tmp_path: Path) -> None:
    """scripts/bench_host_step.py (the engine with a null runner, host us per step) runs end to end and reports
    every row count; how fast is the benchmark's business (BENCHMARKS.md), not this test's."""
    out = tmp_path / "host_step.json"
    proc = subprocess.run([sys.executable, "scripts/bench_host_step.py", "--rows", "1", "8", "--steps", "20",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert [row["rows"] for row in run["rows"]] == [1, 8] and "error" not in run
    for row in run["rows"]:
        assert row["steps"] == 20 and 0 < row["median_us"] <= row["p90_us"]
        assert row["vocoder_feeds"] == 20  # every measured step handed its ids to the (null) vocoder worker
    assert "median us" in proc.stdout


@pytest.mark.timeout(600)
def test_bench_job_pause_runs_on_tiny_weights(tmp_path: Path) -> None:
    """scripts/bench_job_pause.py (issue 36): the four modes run with a live turn arriving mid-step; only the compact
    modes leave job rows out, and only `pause` may stop a job step (at most once a turn: the one it arrives in)."""
    out = tmp_path / "pause"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_job_pause.py", "--size", "tiny", "--jobs", "2", "--rounds", "2",
         "--arrival", "mid-step", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"alone", "pause", "pause, whole steps", "no pause"}
    for mode in ("pause", "pause, whole steps"):
        assert rows[mode]["job_rows_paused_per_turn"] >= 2 * 5  # two rows, at least the first ids' steps
    assert rows["alone"]["job_rows_paused_per_turn"] == rows["no pause"]["job_rows_paused_per_turn"] == 0
    assert 0 <= rows["pause"]["job_steps_withdrawn_per_turn"] <= 1
    assert all(rows[mode]["job_steps_withdrawn_per_turn"] == 0 for mode in ("alone", "pause, whole steps", "no pause"))
    assert all(row["first_chunk_ms_p50"] > 0 for row in rows.values())


@pytest.mark.timeout(600)
def test_bench_decode_step_survives_segments_that_end_while_it_times(tmp_path: Path) -> None:
    """scripts/bench_decode_step.py with more timed steps than a 64-position context holds: every segment ends
    (context_full) during the timing. The run completes, says so, and reports no bucket (it used to raise on the
    empty batch)."""
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_decode_step.py", "--sessions", "2", "--voices", "one", "--steps", "120",
         "--context-tokens", "64", "--threads", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "segments ended during the 120 timed steps" in proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["running"] == 0 and (row["row_bucket"], row["key_bucket"]) == (0, 0) and row["x_floor"] is None
    assert row["ms_per_step"] > 0 and row["ops_per_step"] > 0


@pytest.mark.timeout(600)
def test_bench_job_first_audio_runs_on_tiny_weights(tmp_path: Path) -> None:
    """scripts/bench_job_first_audio.py (issue 36): live turns beside a steady job load in one engine, the modes
    switched between rounds; every mode times its turns to their first audio, and the jobs kept going."""
    out = tmp_path / "first_audio"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_job_first_audio.py", "--size", "tiny", "--jobs", "1", "--rounds", "1",
         "--alone", "1", "--pause-s", "0.1", "0.2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"alone", "all", "pause 12", "vocoder not told", "neither"}
    assert rows["alone"]["turns"] == 2 and all(rows[m]["turns"] == 1 for m in ("all", "pause 12", "vocoder not told",
                                                                               "neither"))
    assert all(row["first_audio_ms_p50"] > 0 for row in rows.values())
    assert "job segment(s) in flight" in proc.stdout and set(report["engine"]) >= {"job_steps_withdrawn",
                                                                                   "job_renders_stopped"}


@pytest.mark.timeout(600)
def test_bench_job_first_audio_alone_between_the_rounds(tmp_path: Path) -> None:
    """`--modes all "alone between"`: the jobs stop (cancelled, the engine idle) for the alone turns of the rounds,
    resume after them, and the ratios are against those turns."""
    out = tmp_path / "between"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_job_first_audio.py", "--size", "tiny", "--jobs", "2", "--rounds", "2",
         "--alone", "1", "--pause-s", "0.1", "0.2", "--modes", "all", "alone between", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"alone", "all", "alone between"} and report["reference"] == "alone between"
    assert rows["all"]["turns"] == rows["alone between"]["turns"] == 2
    assert rows["alone between"]["x_alone_p50"] == 1.0 and rows["all"]["x_alone_p95"] > 0
