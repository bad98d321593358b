"""Fuzz every protocol's client-message parser: each input either parses or yields that protocol's own
error (a `FieldError`, returned by the native parser and raised by the others, or the JSON error its
endpoint answers for a body that is not JSON); anything else raised is a bug and stops the run.

    # atheris (libFuzzer), with the JSON dictionary; bounded by -runs / -max_total_time
    python scripts/fuzz_protocols.py -dict=scripts/fuzz_json.dict -runs=2000000 -max_total_time=300
    # without atheris: a hypothesis-driven bulk run (structured JSON + raw bytes), bounded by --examples
    python scripts/fuzz_protocols.py --hypothesis --examples 200000

Both end with a line `inputs=N parsed=P errors=E` (atheris: also libFuzzer's own `Done N runs`).
The first input byte picks the parser (TARGETS, in order) and the variant; the rest is the message.
`tests/agent_server/protocols/test_parsers_property.py` runs the same targets under hypothesis in the test suite.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import cast
from urllib.parse import parse_qsl

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

try:
    import atheris
except ImportError:
    atheris = None

from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.errors import FieldError
from agent_server.protocols import (
    cartesia,
    cartesia_http,
    deepgram,
    deepgram_http,
    elevenlabs,
    elevenlabs_http,
    jambonz,
    openai_speech,
    twilio,
)
from agent_server.protocols import native_wire as wire
from synth.api import Variant

VARIANTS = ("english", "turbo", "multilingual")
PARSED, ERROR = "parsed", "error"


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _query(data: bytes) -> dict[str, str]:
    return dict(parse_qsl(_text(data), keep_blank_values=True))


def _router(variant: str) -> Router:
    """The built-in route table over one loaded model (the parsers route a request's model and language)."""
    return Router(DEFAULT_ROUTES, (cast(Variant, variant),))


def native(data: bytes, variant: str) -> str:
    result = wire.parse(_text(data) if data[:1] != b"\x00" else data[1:])  # text, or binary
    if isinstance(result, FieldError):
        assert isinstance(result.field, str) and isinstance(result.message, str)
        wire.encode(wire.error_event(result))  # the error event must encode too
        return ERROR
    kinds = (wire.Open, wire.Text, wire.Flush, wire.End, wire.Cancel, wire.KeepAlive, wire.TwilioMessage)
    assert isinstance(result, kinds), result
    return PARSED


def elevenlabs_message(data: bytes, variant: str) -> str:
    elevenlabs.parse_message(data if data[:1] == b"\x00" else _text(data))
    return PARSED


def elevenlabs_query(data: bytes, variant: str) -> str:
    elevenlabs.parse_query(_query(data), _router(variant))
    return PARSED


def cartesia_request(data: bytes, variant: str) -> str:
    cartesia.parse_request(_text(data))
    return PARSED


def deepgram_message(data: bytes, variant: str) -> str:
    deepgram.parse_message(_text(data))
    return PARSED


def deepgram_query(data: bytes, variant: str) -> str:
    deepgram.parse_query(_query(data), _router(variant))
    return PARSED


def openai_body(data: bytes, variant: str) -> str:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ERROR  # the endpoint answers 400 "the body must be JSON"
    openai_speech.parse_request(body, _router(variant))
    return PARSED


def _json_body(data: bytes) -> object:
    """The decoded JSON of an HTTP body; FieldError where the endpoint answers "the body must be JSON"."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise FieldError("body", "the body must be JSON") from None


def _query_and_body(data: bytes) -> tuple[dict[str, str], object]:
    """An HTTP request's query (the input up to its first newline) and JSON body (the rest)."""
    query, _, body = data.partition(b"\n")
    return _query(query), _json_body(body)


def elevenlabs_http_request(data: bytes, variant: str) -> str:
    query, body = _query_and_body(data)
    elevenlabs_http.parse_request("v", query, body, _router(variant), streamed=True, timestamps=bool(data[:1] == b"t"))
    return PARSED


def cartesia_http_request(data: bytes, variant: str) -> str:
    cartesia_http.parse_request(_json_body(data), _router(variant), sse=bool(data[:1] == b"{"))
    return PARSED


def deepgram_http_request(data: bytes, variant: str) -> str:
    query, body = _query_and_body(data)
    deepgram_http.parse_request(query, body, _router(variant))
    return PARSED


def jambonz_http_request(data: bytes, variant: str) -> str:
    accept, _, body = data.partition(b"\n")  # the Accept header, then the body
    jambonz.parse_http(_json_body(body), _text(accept) or None)
    return PARSED


def jambonz_stream(data: bytes, variant: str) -> str:
    query, _, message = data.partition(b"\n")
    jambonz.parse_query(_query(query))
    jambonz.parse_message(message if message[:1] == b"\x00" else _text(message))
    return PARSED


def twilio_message(data: bytes, variant: str) -> str:
    twilio.parse_incoming(_text(data))
    return PARSED


TARGETS: dict[str, Callable[[bytes, str], str]] = {
    "native": native,
    "elevenlabs_message": elevenlabs_message,
    "elevenlabs_query": elevenlabs_query,
    "cartesia_request": cartesia_request,
    "deepgram_message": deepgram_message,
    "deepgram_query": deepgram_query,
    "openai_body": openai_body,
    "elevenlabs_http": elevenlabs_http_request,
    "cartesia_http": cartesia_http_request,
    "deepgram_http": deepgram_http_request,
    "jambonz_http": jambonz_http_request,
    "jambonz_stream": jambonz_stream,
    "twilio": twilio_message,
}
TARGET_LIST = list(TARGETS.values())
COUNTS: Counter[str] = Counter()


def check(target: str, data: bytes, variant: str = "english") -> str:
    """PARSED or ERROR; raises on anything else (a bug)."""
    try:
        return TARGETS[target](data, variant)
    except FieldError as exc:
        assert isinstance(exc.field, str) and isinstance(exc.message, str)
        return ERROR


def one_input(data: bytes) -> None:
    """libFuzzer entry point: byte 0 picks the parser and the variant."""
    if not data:
        return
    selector = data[0]
    name = list(TARGETS)[selector % len(TARGETS)]
    variant = VARIANTS[(selector // len(TARGETS)) % len(VARIANTS)]
    COUNTS[check(name, data[1:], variant)] += 1
    total = COUNTS[PARSED] + COUNTS[ERROR]
    if total & (total - 1) == 0 and total >= 1024:  # powers of two, like libFuzzer's own reports
        report()


def report() -> None:
    total = COUNTS[PARSED] + COUNTS[ERROR]
    print(f"inputs={total} parsed={COUNTS[PARSED]} errors={COUNTS[ERROR]}", flush=True)


def run_atheris(argv: list[str]) -> None:
    import atexit

    atexit.register(report)  # libFuzzer may end the process itself: then its `Done N runs` line counts
    atheris.instrument_all()  # coverage feedback from every function already imported (the parsers)
    atheris.Setup([sys.argv[0], *argv], one_input)
    atheris.Fuzz()


def run_hypothesis(examples: int, seed: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.agent_server.protocols.test_parsers_property import targeted_inputs  # one strategy for both

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(pair=targeted_inputs, variant=st.sampled_from(VARIANTS))
    def bulk(pair: tuple[str, bytes], variant: str) -> None:
        target, data = pair
        COUNTS[check(target, data, variant)] += 1

    started_s = time.monotonic()
    bulk()
    report()
    print(f"elapsed_s={time.monotonic() - started_s:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hypothesis", action="store_true", help="hypothesis bulk run instead of atheris")
    parser.add_argument("--examples", type=int, default=100_000, help="hypothesis: inputs to try")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis: seed")
    args, rest = parser.parse_known_args()
    if args.hypothesis:
        run_hypothesis(args.examples, args.seed)
        return
    if atheris is None:
        print("atheris is not installed (pip install atheris); falling back to --hypothesis", file=sys.stderr)
        run_hypothesis(args.examples, args.seed)
        return
    run_atheris(rest)


if __name__ == "__main__":
    main()
