"""The Autobahn TestSuite's core cases (1-7 and 10: framing, pings, reserved bits, opcodes,
fragmentation, UTF-8, closing, limits; 9 is performance, 12-13 compression, which we switch off)
against `/v1/stream` of the real `agent-server` process, driven by `kosoku` (the Autobahn case files
under a maintained Python 3 runner; the original runner needs Python 2 and Docker).

The cases assume an echo server. Ours speaks a JSON protocol: it greets every session with
`session_started` and answers a text that is not a JSON message with an `error` event, never an echo.
So a case may "fail" only for that reason, and such a failure is listed and explained, not counted:

- *echo artefact*: the case expected its messages echoed; what came back is our greeting and error
  events; kosoku waited for the echo, then (its `killAfter` timer) failed the connection itself;
- *greeting artefact*: the frames and the closing handshake behaved as required (pongs, close codes
  and who closed all match), and the only difference is our `session_started` (or an error event)
  among the events.

Any other failure (a wrong close code, an unclean close the case requires clean, a missing pong, a
connection the server failed where it must not) is a genuine one: there must be none.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
from kosoku import FailureError, run_fuzzingclient

from tests.agent_server.live_server import cli_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CORE_CASES = ["1.*", "2.*", "3.*", "4.*", "5.*", "6.*", "7.*", "10.*"]
MIN_CORE_CASES = 240
ACCEPTABLE = ("OK", "NON-STRICT", "INFORMATIONAL")
OUR_EVENT_TYPES = frozenset({"session_started", "error"})
CONCURRENCY = 8


def is_ours(event: Any) -> bool:
    """A message our protocol sends on its own: the greeting, or an error event for what it could not read."""
    if not (isinstance(event, (tuple, list)) and event and event[0] == "message" and not event[2]):
        return False
    try:
        message = orjson.loads(event[1])
    except orjson.JSONDecodeError:
        return False
    return isinstance(message, dict) and message.get("type") in OUR_EVENT_TYPES


def without_messages(events: list[Any]) -> list[Any]:
    return [e for e in events if not (isinstance(e, (tuple, list)) and e and e[0] == "message")]


def classify(result: Any) -> str:
    """passed | echo artefact | greeting artefact | genuine."""
    if result.passed:
        return "passed"
    received = list(result.received)
    expectations = [list(events) for events in dict(result.expected).values()]
    ours_only = all(is_ours(e) for e in received if isinstance(e, (tuple, list)) and e and e[0] == "message")
    frames_match = any(without_messages(received) == without_messages(expected) for expected in expectations)
    expects_echo = any(any(e[0] == "message" for e in expected) for expected in expectations)
    close_ok = result.behavior_close.value in ACCEPTABLE
    if not (ours_only and frames_match):
        return "genuine"
    if close_ok:
        return "greeting artefact"
    killed_waiting_for_echo = (
        expects_echo and result.failed_by_me and result.dropped_by_me and dict(result.expected_close)["closedByMe"]
    )
    return "echo artefact" if killed_waiting_for_echo else "genuine"


def test_autobahn_core_cases_against_the_native_endpoint(tmp_path: Path) -> None:
    with cli_server(tmp_path, {"AGENT_SERVER_LOG_LEVEL": "warning"}) as (_, port, _):
        url = f"ws://127.0.0.1:{port}/v1/stream"

        async def run() -> list[Any]:
            try:
                return list(await run_fuzzingclient(url, cases=CORE_CASES, concurrency=CONCURRENCY))
            except FailureError as failure:
                return failure.results

        results = asyncio.run(run())
    verdicts = {result.case_id: classify(result) for result in results}
    counts = Counter(verdicts.values())
    by_kind: dict[str, list[str]] = {}
    for case_id, verdict in verdicts.items():
        by_kind.setdefault(verdict, []).append(case_id)
    print(f"\nAutobahn core cases: {len(results)}; {dict(counts)}")
    for kind in ("echo artefact", "greeting artefact"):
        print(f"{kind}s: {' '.join(by_kind.get(kind, []))}")
    genuine = [
        (r.case_id, r.behavior.value, r.behavior_close.value, r.remote_close_code, r.result_close)
        for r in results if verdicts[r.case_id] == "genuine"
    ]
    assert len(results) >= MIN_CORE_CASES
    assert genuine == []
    # (how many pass outright depends on timing: whether our greeting goes out before the case's first
    # frame is answered; a loaded machine turns passes into greeting artefacts, never into failures)


def test_the_classifier_calls_a_wrong_close_code_genuine() -> None:
    """Case 7.1.5 as websockets-sansio answers it (1002 where 1000 is due): not an artefact."""

    class Value:
        def __init__(self, value: str) -> None:
            self.value = value

    class Result:
        case_id = "7.1.5"
        passed = False
        received: ClassVar[list[Any]] = []
        expected: ClassVar[dict[str, list[Any]]] = {"OK": []}
        expected_close: ClassVar[dict[str, Any]] = {"closedByMe": True, "closeCode": [1000], "requireClean": True}
        behavior = Value("FAILED")
        behavior_close = Value("WRONG CODE")
        failed_by_me = False
        dropped_by_me = False

    assert classify(Result()) == "genuine"
    greeting = ("message", orjson.dumps({"type": "session_started"}).decode(), False)
    Result.received = [greeting]
    Result.behavior_close = Value("OK")
    assert classify(Result()) == "greeting artefact"
    Result.received = [greeting, ("message", "Hello World!", False)]  # an echo is not ours
    assert classify(Result()) == "genuine"
