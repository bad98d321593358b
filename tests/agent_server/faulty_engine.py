"""A FakeEngine with faults on cue, for tests/agent_server/test_faults.py.

A segment whose text holds one of these words misbehaves:
- `BOOM`: `submit` raises RuntimeError on the event loop (a bug in serving one session);
- `VOCODER`: the segment fails on the engine thread (a FAILED event, as the real engine's vocoder guard sends);
- `DIE`: the engine thread raises and dies (the server must turn not-ready and, under the CLI, exit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from synth.api import EventKind, SegmentRequest

from tests.agent_server.fake_engine import FakeEngine, FakeStatus

BOOM = "BOOM"
VOCODER = "VOCODER"
DIE = "DIE"


@dataclass
class FaultyEngine(FakeEngine):
    def submit(self, request: SegmentRequest) -> None:
        if BOOM in request.text:
            raise RuntimeError("injected bug while submitting")
        super().submit(request)

    def _accept(self, request: SegmentRequest) -> None:
        if DIE in request.text:
            raise RuntimeError("injected engine failure")  # kills the engine thread
        super()._accept(request)
        seg = self._segments[request.request_id]
        if VOCODER in request.text and seg.status < FakeStatus.DONE:
            if seg in self._waiting:
                self._waiting.remove(seg)
            self._finish(seg, EventKind.FAILED, reason="vocoder failure: injected")


def make_engine(settings: object) -> FaultyEngine:
    """`AGENT_SERVER_ENGINE_FACTORY=tests.agent_server.faulty_engine:make_engine` (FAKE_ENGINE_OPTIONS as in
    fake_engine)."""
    options = json.loads(os.environ.get("FAKE_ENGINE_OPTIONS", "{}"))
    options.setdefault("variant", getattr(settings, "variant", "english"))
    return FaultyEngine(**options)

