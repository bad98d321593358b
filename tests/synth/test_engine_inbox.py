"""The engine's inbox is bounded like every other queue: past `max_inbox_items` a submit is refused (EngineFull),
while cancels always get in (a full inbox never blocks the event loop's cancel)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from synth.api import EngineFull, EventKind, SamplingParams, SegmentRequest

from tests.synth.conftest import Collector, make_engine, synthetic_voice, tiny_bundle


def _request(collector: Collector, rid: str, seed: int) -> SegmentRequest:
    params = replace(SamplingParams.defaults("english"), seed=seed, max_new_tokens=5)
    return SegmentRequest(request_id=rid, text="short text", voice_id="default", params=params,
                          sink=collector.sink_for(rid))


def test_a_full_inbox_refuses_the_submit_and_still_takes_cancels() -> None:
    eng = make_engine("english", render_audio=False, max_slots=1, max_waiting=2)
    eng.voices.add(synthetic_voice(tiny_bundle("english"), "default", 1))
    col = Collector()
    assert eng.max_inbox_items == 3  # max_slots + max_waiting: what the scheduler could take at once
    for i in range(3):  # not started: nothing drains the inbox
        eng.submit(_request(col, f"s{i}", seed=i))
    with pytest.raises(EngineFull, match="inbox is full"):
        eng.submit(_request(col, "over", seed=9))
    eng.cancel("s0")  # past the bound: a cancel is never refused
    eng._drain_inbox(block=False)  # what the engine thread does at each step (not started here)
    eng.submit(_request(col, "over", seed=9))  # room again; the refused submit left nothing behind (no duplicate)
    assert EventKind.FAILED not in col.kinds("over")
    assert col.kinds("s0") == [EventKind.CANCELLED]
