"""synth/api.py: the listener clock and the thread budget (pure data, no engine)."""

from __future__ import annotations

import os

import pytest

from synth.api import ListenerClock, ThreadBudget


def test_listener_clock_plays_in_real_time_from_its_start() -> None:
    clock = ListenerClock()
    assert clock.buffered_s(5.0) is None
    clock.report(sent_audio_s=2.0, started_monotonic_s=10.0)
    assert clock.buffered_s(10.0) == 2.0
    assert clock.buffered_s(11.5) == 0.5
    assert clock.buffered_s(13.0) == -1.0  # ran dry a second ago
    clock.report(sent_audio_s=4.0, started_monotonic_s=10.0)
    assert clock.buffered_s(13.0) == 1.0
    faster = ListenerClock(speed=2.0)  # the listener plays the engine's audio twice as fast
    faster.report(sent_audio_s=2.0, started_monotonic_s=10.0)
    assert faster.buffered_s(10.5) == 3.0  # 1.5 s still to play = 3 s of the engine's audio


def test_thread_budget_split_and_parse() -> None:
    assert ThreadBudget.split(1) == ThreadBudget(1, 1)  # both single-threaded: no OpenMP barriers at all
    assert ThreadBudget.split(2) == ThreadBudget(1, 1)
    assert ThreadBudget.split(4) == ThreadBudget(1, 2)  # one core left to the event loop
    assert ThreadBudget.split(16) == ThreadBudget(7, 8)
    for cores in range(1, 65):
        budget = ThreadBudget.split(cores)
        assert budget.decode + budget.vocoder <= max(2, cores)  # never more compute threads than cores
    assert ThreadBudget.parse("auto") == (0, 0)
    assert ThreadBudget.parse("3,5") == (3, 5)
    assert ThreadBudget.parse("8") == (3, 4)
    assert ThreadBudget.resolve(0, 3, cores=2) == ThreadBudget(1, 3)
    for bad in ("0", "1,0", "x", "1,2,3", "-2"):
        with pytest.raises(ValueError):
            ThreadBudget.parse(bad)


@pytest.mark.parametrize("dtype,capped", [("bfloat16", True), ("float16", True), ("float32", False)])
def test_a_reduced_precision_t3_on_the_cpu_caps_onednn_below_amx(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                                  capped: bool) -> None:
    """oneDNN's AMX bf16 kernels give a T3 row other bits from 64 rows up: an engine with T3 in bf16/fp16 on the CPU
    caps oneDNN (before its models load), a float32 one leaves AMX to the vocoder's bf16 products; an operator's
    own setting stays."""
    import synth

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    synth._cap_onednn_for_a_reduced_precision_t3(synth.EngineConfig(dtype=dtype, device="cpu"))
    assert (os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX512_CORE_BF16") == capped
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    synth._cap_onednn_for_a_reduced_precision_t3(synth.EngineConfig(dtype=dtype, device="cpu"))
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"


def test_the_language_table_is_chatterboxs() -> None:
    from chatterbox.mtl_tts import SUPPORTED_LANGUAGES

    from synth.api import LANGUAGE_NAMES, languages_of

    assert dict(LANGUAGE_NAMES) == dict(SUPPORTED_LANGUAGES)
    assert languages_of("multilingual") == tuple(SUPPORTED_LANGUAGES)
    assert languages_of("turbo") == languages_of("english") == ("en",)
