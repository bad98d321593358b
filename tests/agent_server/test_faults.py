"""Faults over a real server on 127.0.0.1: clients that stop reading, vanish, storm, idle by the thousand,
send too much or too little; bugs and a dying engine; SIGTERM during speech.

Figures the tests measure are printed (`pytest -s` shows them) and asserted against their bounds.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from agent_server.core.observers import ObservedEvent, SlowClientDropped
from agent_server.protocols.native import NativeProtocol
from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.faulty_engine import BOOM, DIE, VOCODER, FaultyEngine
from tests.agent_server.live_server import LiveServer, cli_server, live_server
from tests.agent_server.native_client import ContextLog, NativeClient

pytestmark = pytest.mark.timeout(90)

SENTENCE = "Sure, I can help with that right away. "
BIG_TEXT = " ".join(["Your flight to Lisbon leaves at nine fifteen tomorrow morning, from gate twelve."] * 40)
IDLE_SESSIONS = 1000
CUT_DEADLINE_S = 5.0  # a client that stops reading is cut within this (the bound)
TTFA_TOLERANCE = 0.20  # others' time to first audio: within 20 % of the unloaded figure


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def ttfa_once(url: str, context_id: str, seed: int) -> float:
    """Client-side time to first audio of one short turn on a new socket (seconds)."""
    client = await NativeClient.connect(url)
    log = await client.open(context_id, seed=seed, text=SENTENCE)
    await client.end(context_id)
    await asyncio.wait_for(log.finished.wait(), 20)
    await client.close()
    assert log.done is not None and log.done["reason"] == "completed", log.done
    assert log.first_text_sent_s is not None and log.first_frame_recv_s is not None
    return log.first_frame_recv_s - log.first_text_sent_s


async def ttfa_round(url: str, n: int, tag: str) -> list[float]:
    return list(await asyncio.gather(*(ttfa_once(url, f"{tag}{i}", i) for i in range(n))))


async def open_non_reader(server: LiveServer) -> ClientConnection:
    """A client that asks for a lot of audio and then never reads (a small receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    ws = await connect(server.ws_url, sock=sock, max_queue=1, max_size=None)
    await ws.recv()  # session_started
    fmt = {"encoding": "pcm_s16le", "sample_rate_hz": 48000, "frame_ms": 10}
    await ws.send(orjson.dumps({"type": "open", "context_id": "hog", "output_format": fmt, "text": BIG_TEXT}).decode())
    await ws.send(orjson.dumps({"type": "end", "context_id": "hog"}).decode())
    return ws


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---- flow control --------------------------------------------------------------------------------


@pytest.mark.timing
def test_non_reading_client_is_cut_and_others_keep_their_ttfa(tmp_path: Path) -> None:
    # 10x real time: the hog fills its socket in a fraction of a second; the others' TTFA is the
    # engine's first-chunk delay plus the server's own overhead.
    engine = FakeEngine(realtime_factor=0.1, first_chunk_delay_s=0.15, max_slots=8)
    # (no phrase cache: every round repeats the same seeded sentences, and the engine's TTFA is what is compared)
    # (default slow_client_stall_s: 3 s)
    with live_server(engine, Settings(data_dir=tmp_path, phrase_cache_mb=0)) as server:
        dropped: list[tuple[float, ObservedEvent]] = []
        server.hub.observers.subscribe(
            lambda e: dropped.append((time.monotonic(), e)) if isinstance(e, SlowClientDropped) else None
        )

        async def scenario() -> tuple[list[float], list[float], float]:
            await ttfa_round(server.ws_url, 4, "warm")
            unloaded = await ttfa_round(server.ws_url, 4, "a") + await ttfa_round(server.ws_url, 4, "b")
            hog = await open_non_reader(server)
            hog_started_s = time.monotonic()
            await asyncio.sleep(0.5)  # its socket is full by now: measure the others while it stalls
            loaded = await ttfa_round(server.ws_url, 4, "c") + await ttfa_round(server.ws_url, 4, "d")
            while not dropped and time.monotonic() - hog_started_s < 15:
                await asyncio.sleep(0.02)
            cut_after_s = dropped[0][0] - hog_started_s if dropped else float("inf")
            hog.transport.abort()
            return unloaded, loaded, cut_after_s

        unloaded, loaded, cut_after_s = run(scenario())
        unloaded_ms, loaded_ms = statistics.median(unloaded) * 1000, statistics.median(loaded) * 1000
        print(f"\nnon-reading client cut after {cut_after_s:.2f} s; TTFA median unloaded {unloaded_ms:.1f} ms, "
              f"with the non-reader {loaded_ms:.1f} ms ({(loaded_ms / unloaded_ms - 1) * 100:+.1f} %)")
        assert cut_after_s < CUT_DEADLINE_S
        assert loaded_ms <= unloaded_ms * (1 + TTFA_TOLERANCE)
        wait_until(lambda: not server.hub.sessions, 5, "the sessions to close")


FIRST_AUDIO_SLACK_S = 0.5  # from the open to the first audio (the engine's first chunk) and the watchdog's tick


def test_a_non_reader_fed_in_real_time_is_cut_within_5_s_and_a_reader_beside_it_is_not(tmp_path: Path) -> None:
    """Audio at 1x real time into a client that never reads, with the kernel's default receive buffer: it takes
    ~3 s of 24 kHz PCM unread before any stall shows, so the stall rule alone (3 s) cut it after ~6 s; the
    cumulative bound (`slow_client_behind_s`) cuts it within 5 s of its first audio. A client reading the same
    pace beside it is never cut."""
    engine = FakeEngine(realtime_factor=1.0, first_chunk_delay_s=0.05, max_slots=4)
    with live_server(engine, Settings(data_dir=tmp_path, phrase_cache_mb=0)) as server:
        dropped: list[float] = []
        server.hub.observers.subscribe(
            lambda e: dropped.append(time.monotonic()) if isinstance(e, SlowClientDropped) else None
        )

        async def scenario() -> tuple[float, ContextLog]:
            reader = await NativeClient.connect(server.ws_url)
            read_log = await reader.open("reader", seed=2, text=" ".join([SENTENCE] * 12))
            await reader.end("reader")
            ws = await connect(server.ws_url, max_queue=1, max_size=None)
            await ws.recv()  # session_started
            fmt = {"encoding": "pcm_s16le", "sample_rate_hz": 24000}
            opened_s = time.monotonic()
            await ws.send(orjson.dumps({"type": "open", "context_id": "hog", "output_format": fmt,
                                        "text": BIG_TEXT}).decode())
            await ws.send(orjson.dumps({"type": "end", "context_id": "hog"}).decode())
            while not dropped and time.monotonic() - opened_s < 15:
                await asyncio.sleep(0.02)
            ws.transport.abort()
            await asyncio.wait_for(read_log.finished.wait(), 30)
            await reader.close()
            return (dropped[0] - opened_s if dropped else float("inf")), read_log

        cut_after_s, read_log = run(scenario())
        assert cut_after_s <= 5.0 + FIRST_AUDIO_SLACK_S, cut_after_s
        assert len(dropped) == 1
        assert read_log.done is not None and read_log.done["reason"] == "completed"


def test_disconnects_mid_stream_free_their_slots(tmp_path: Path) -> None:
    engine = FakeEngine(realtime_factor=1.0, max_slots=4)
    with live_server(engine, Settings(data_dir=tmp_path)) as server:

        async def scenario() -> list[ContextLog]:
            clients = [await NativeClient.connect(server.ws_url) for _ in range(4)]
            logs = [await c.open(f"v{i}", text=BIG_TEXT) for i, c in enumerate(clients)]
            for c, log in zip(clients, logs, strict=False):
                await c.end(log.context_id)
            while not all(log.frames for log in logs):
                await asyncio.sleep(0.01)
            assert engine.status()["slots_in_use"] == 4
            clients[0].ws.transport.abort()  # a TCP reset: no close frame
            clients[1].ws.transport.close()  # a FIN: no close frame
            await clients[2].ws.close()  # a clean close
            await clients[3].close()
            deadline_s = time.monotonic() + 3
            while server.hub.sessions or engine.status()["slots_in_use"]:
                assert time.monotonic() < deadline_s, (len(server.hub.sessions), engine.status())
                await asyncio.sleep(0.02)
            fresh = [await NativeClient.connect(server.ws_url) for _ in range(4)]
            again = [await c.open(f"w{i}", text=SENTENCE) for i, c in enumerate(fresh)]
            for c, log in zip(fresh, again, strict=False):
                await c.end(log.context_id)
            await asyncio.wait_for(asyncio.gather(*(log.finished.wait() for log in again)), 20)
            for c in fresh:
                await c.close()
            return again

        again = run(scenario())
        assert all(log.done is not None and log.done["reason"] == "completed" for log in again)
        assert len(engine.cancels) >= 4  # each vanished client's segment was cancelled in the engine


def test_cancel_storm(tmp_path: Path) -> None:
    engine = FakeEngine(realtime_factor=0.2, max_slots=16)
    with live_server(engine, Settings(data_dir=tmp_path, max_contexts_per_session=8)) as server:

        async def storm(client: NativeClient, tag: str, rounds: int) -> list[ContextLog]:
            logs = []
            for i in range(rounds):
                log = await client.open(f"{tag}{i}", text=SENTENCE * 3)
                if i % 3:
                    await asyncio.sleep(0.002 * (i % 5))  # some get audio out before the cancel
                await client.cancel(log.context_id)
                await client.cancel(log.context_id)  # a second cancel is ignored
                await asyncio.wait_for(log.finished.wait(), 10)
                logs.append(log)
            return logs

        async def scenario() -> tuple[list[ContextLog], ContextLog, int]:
            clients = [await NativeClient.connect(server.ws_url) for _ in range(4)]
            results = await asyncio.gather(*(storm(c, f"s{n}_", 50) for n, c in enumerate(clients)))
            # "after" is a barrier on clients[0] (one socket delivers in order); the others get their own
            barriers = [await c.open("barrier", text="Done. ") for c in clients[1:]]
            for c in clients[1:]:
                await c.end("barrier")
            await asyncio.wait_for(asyncio.gather(*(b.finished.wait() for b in barriers)), 20)
            log = await clients[0].open("after", seed=2, text=SENTENCE)
            await clients[0].end("after")
            await asyncio.wait_for(log.finished.wait(), 20)
            stray = sum(c.stray_frames for c in clients)
            for c in clients:
                await c.close()
            return [log for logs in results for log in logs], log, stray

        logs, after, stray = run(scenario())
        assert len(logs) == 200 and stray == 0
        for log in logs:
            assert log.done is not None and log.done["reason"] in ("cancelled", "completed")
            assert log.order.count("event:context_done") == 1
            assert log.order[-1] == "event:context_done", "output after context_done"
            assert log.done["frames"] == len(log.frames)
        assert after.done is not None and after.done["reason"] == "completed"
        wait_until(lambda: engine.status()["slots_in_use"] == 0, 3, "the slots to free")


# ---- many idle sessions --------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timing
def test_a_thousand_idle_sessions_bounded_memory(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * IDLE_SESSIONS + 200:
        pytest.skip(f"needs {2 * IDLE_SESSIONS + 200} file descriptors (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * IDLE_SESSIONS)), hard))
    env = {"AGENT_SERVER_MAX_SESSIONS": str(IDLE_SESSIONS + 50), "AGENT_SERVER_INACTIVITY_TIMEOUT_S": "180",
           "AGENT_SERVER_LOG_LEVEL": "warning", "FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 0.1})}
    with cli_server(tmp_path, env) as (proc, port, _):
        url = f"ws://127.0.0.1:{port}/v1/stream"

        async def scenario() -> tuple[int, int, int, list[float], float]:
            await ttfa_round(url, 2, "warm")
            before = rss_bytes(proc.pid)
            started_s = time.monotonic()
            idle: list[ClientConnection] = []
            for _ in range(0, IDLE_SESSIONS, 50):
                idle += await asyncio.gather(*(connect(url, max_queue=4) for _ in range(50)))
            for ws in idle:
                assert orjson.loads(await ws.recv())["type"] == "session_started"
            opened_s = time.monotonic() - started_s
            sessions = httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["sessions"]
            await asyncio.sleep(1.0)  # the server settles (the ticker visits every session)
            held = rss_bytes(proc.pid)
            ttfas = await ttfa_round(url, 4, "busy")  # the few active ones still get audio promptly
            await asyncio.gather(*(ws.close() for ws in idle))
            return before, held, sessions, ttfas, opened_s

        before, held, sessions, ttfas, opened_s = run(scenario())
        per_session = (held - before) / IDLE_SESSIONS
        print(f"\n{IDLE_SESSIONS} idle sessions opened in {opened_s:.1f} s; server RSS {before / 2**20:.1f} -> "
              f"{held / 2**20:.1f} MiB: {per_session / 1024:.1f} KiB per idle session; "
              f"TTFA meanwhile {statistics.median(ttfas) * 1000:.0f} ms")
        assert sessions >= IDLE_SESSIONS
        assert per_session < 256 * 1024
        assert max(ttfas) < 2.0
        deadline_s = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["sessions"]:
            assert time.monotonic() < deadline_s, "idle sessions not released"
            time.sleep(0.1)


# ---- bad input -----------------------------------------------------------------------------------


def test_oversized_frames_close_1009_and_spare_the_others(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, max_message_bytes=64 * 1024)
    with live_server(FakeEngine(), settings) as server:

        async def scenario() -> tuple[list[int | None], ContextLog]:
            bystander = await NativeClient.connect(server.ws_url)
            codes = []
            for path in ("/v1/stream", "/v1/speak", "/tts/websocket"):
                async with connect(f"ws://127.0.0.1:{server.port}{path}", max_size=None) as ws:
                    if path == "/v1/stream":
                        await ws.recv()
                    await ws.send("x" * (64 * 1024 + 1))
                    try:
                        async with asyncio.timeout(5):
                            async for _ in ws:
                                pass
                    except ConnectionClosed:
                        pass
                    codes.append(ws.close_code)
            log = await bystander.open("ok", seed=1, text=SENTENCE)
            await bystander.end("ok")
            await asyncio.wait_for(log.finished.wait(), 10)
            await bystander.close()
            return codes, log

        codes, log = run(scenario())
        assert codes == [1009, 1009, 1009]
        assert log.done is not None and log.done["reason"] == "completed"


def test_handshake_deadline_drops_silent_and_dribbling_connections(tmp_path: Path) -> None:
    """uvicorn has no deadline for a request head; cli.HandshakeDeadlineProtocol adds one."""

    def still_open_after(port: int, wait_s: float, dribble: bool) -> bool:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.settimeout(0.2)
            end_s = time.monotonic() + wait_s
            head = b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            sent = 0
            while time.monotonic() < end_s:
                if dribble and sent < len(head):
                    sock.sendall(head[sent : sent + 1])
                    sent += 1
                try:
                    if sock.recv(1024) == b"":
                        return False
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    return False
            return True

    with live_server(FakeEngine(), Settings(data_dir=tmp_path, handshake_timeout_s=1.0)) as server:
        started_s = time.monotonic()
        assert not still_open_after(server.port, 3.0, dribble=False)
        silent_cut_s = time.monotonic() - started_s
        assert not still_open_after(server.port, 3.0, dribble=True)
        assert httpx.get(server.http_url + "/healthz").status_code == 200  # normal requests are unaffected

        async def handshake() -> str:
            client = await NativeClient.connect(server.ws_url)
            await client.close()
            return str(client.hello["type"])

        assert run(handshake()) == "session_started"
    print(f"\nsilent connection dropped after {silent_cut_s:.2f} s (deadline 1.0 s)")
    assert silent_cut_s < 2.0
    with live_server(FakeEngine(), Settings(data_dir=tmp_path, handshake_timeout_s=0)) as plain:
        assert still_open_after(plain.port, 1.5, dribble=False)  # plain uvicorn keeps it: hence the protocol


def test_inactivity_timeout_and_keepalive(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, inactivity_timeout_s=1.0)
    with live_server(FakeEngine(realtime_factor=1.0), settings) as server:

        async def scenario() -> tuple[int | None, bool, bool, float]:
            idle = await NativeClient.connect(server.ws_url)
            kept = await NativeClient.connect(server.ws_url)
            speaking = await NativeClient.connect(server.ws_url)
            log = await speaking.open("long", text=SENTENCE * 2)  # ~3 s of audio at real time
            await speaking.end("long")
            started_s = time.monotonic()

            async def keep_alive() -> None:
                for _ in range(6):
                    await asyncio.sleep(0.35)
                    await kept.send({"type": "keepalive"})

            pinging = asyncio.create_task(keep_alive())
            code = await asyncio.wait_for(idle.wait_closed(), 5)
            idle_closed_s = time.monotonic() - started_s
            await pinging  # 2.1 s: twice the timeout
            kept_open = kept.closed is None and not kept._reader.done()
            await asyncio.wait_for(log.finished.wait(), 10)
            speaking_ok = log.done is not None and log.done["reason"] == "completed"
            await kept.close()
            await speaking.close()
            return code, kept_open, speaking_ok, idle_closed_s

        code, kept_open, speaking_ok, idle_closed_s = run(scenario())
        assert code == 1000 and idle_closed_s < 2.0
        assert kept_open and speaking_ok
        with pytest.raises(ValueError):
            Settings(inactivity_timeout_s=181)


# ---- isolation -----------------------------------------------------------------------------------


def test_a_failure_in_one_session_leaves_the_others_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FaultyEngine(realtime_factor=0.5)
    original_open = NativeProtocol._open

    async def buggy_open(self: Any, message: Any, now_s: float) -> None:
        if message.context_id == "bug":
            raise RuntimeError("injected protocol bug")
        await original_open(self, message, now_s)

    monkeypatch.setattr(NativeProtocol, "_open", buggy_open)
    with live_server(engine, Settings(data_dir=tmp_path)) as server:

        async def scenario() -> dict[str, Any]:
            bystander = await NativeClient.connect(server.ws_url)
            long = await bystander.open("long", seed=4, text=SENTENCE * 2)
            await bystander.end("long")
            victim = await NativeClient.connect(server.ws_url)
            vocoder = await victim.open("voc", text=f"This one has a {VOCODER} failure. ")
            await victim.end("voc")
            boom = await victim.open("boom", text=f"This one hits a {BOOM} in submit. ")
            await victim.end("boom")
            await asyncio.wait_for(asyncio.gather(vocoder.finished.wait(), boom.finished.wait()), 10)
            fine = await victim.open("fine", seed=5, text=SENTENCE)  # the victim's session still works
            await victim.end("fine")
            await asyncio.wait_for(fine.finished.wait(), 10)
            await victim.open("bug")  # a bug in serving the session ends that session (1011) ...
            bug_code = await asyncio.wait_for(victim.wait_closed(), 5)
            await asyncio.wait_for(long.finished.wait(), 15)  # ... and nothing else
            await bystander.close()
            return {"voc": vocoder, "boom": boom, "fine": fine, "long": long, "bug_code": bug_code}

        result = run(scenario())
        for name in ("voc", "boom"):
            log = result[name]
            assert log.done["reason"] == "failed", (name, log.done)
            # (boom fails inside `open`, so the `end` after it names a context already gone: unknown_context)
            assert log.errors[0]["code"] == "engine_failed", (name, log.errors)
        assert result["fine"].done["reason"] == "completed"
        assert result["bug_code"] == 1011
        assert result["long"].done["reason"] == "completed"
        assert server.hub.ready


def test_a_bug_in_one_sessions_tick_ends_it_and_the_ticker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original_tick = NativeProtocol.on_tick

    def buggy_tick(self: Any, now_s: float) -> None:
        if "tickbug" in self.session.contexts:
            raise RuntimeError("injected tick bug")
        original_tick(self, now_s)

    monkeypatch.setattr(NativeProtocol, "on_tick", buggy_tick)
    settings = Settings(data_dir=tmp_path, inactivity_timeout_s=1.0)
    with live_server(FakeEngine(realtime_factor=1.0), settings) as server:

        async def scenario() -> tuple[int | None, int | None, ContextLog]:
            idle = await NativeClient.connect(server.ws_url)
            bystander = await NativeClient.connect(server.ws_url)
            log = await bystander.open("ok", seed=1, text=SENTENCE)
            await bystander.end("ok")
            victim = await NativeClient.connect(server.ws_url)
            await victim.open("tickbug", text=SENTENCE)
            victim_code = await asyncio.wait_for(victim.wait_closed(), 5)
            idle_code = await asyncio.wait_for(idle.wait_closed(), 5)  # the ticker still runs the others' timers
            await asyncio.wait_for(log.finished.wait(), 10)
            await bystander.close()
            return victim_code, idle_code, log

        victim_code, idle_code, log = run(scenario())
        assert victim_code == 1011 and idle_code == 1000
        assert log.done is not None and log.done["reason"] == "completed"


def test_engine_death_fails_sessions_and_exits_for_the_supervisor(tmp_path: Path) -> None:
    env = {"AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.faulty_engine:make_engine",
           "FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 1.0})}
    with cli_server(tmp_path, env) as (proc, port, log_path):
        url = f"ws://127.0.0.1:{port}/v1/stream"

        async def scenario() -> tuple[ContextLog, ContextLog, int | None, float]:
            client = await NativeClient.connect(url)
            speaking = await client.open("speaking", text=SENTENCE * 3)
            await client.end("speaking")
            while not speaking.frames:
                await asyncio.sleep(0.01)
            killer = await NativeClient.connect(url)
            fatal = await killer.open("fatal", text=f"Now {DIE} please. ")
            await killer.end("fatal")
            started_s = time.monotonic()
            await asyncio.wait_for(speaking.finished.wait(), 10)
            code = await asyncio.wait_for(client.wait_closed(), 10)
            await asyncio.wait_for(killer.wait_closed(), 10)
            return speaking, fatal, code, time.monotonic() - started_s

        speaking, fatal, code, failed_after_s = run(scenario())
        exit_code = proc.wait(15)
    print(f"\nengine death: sessions failed and closed {failed_after_s:.2f} s after the fatal request; "
          f"exit {exit_code}")
    assert speaking.done is not None and speaking.done["reason"] == "failed"
    assert [e["code"] for e in speaking.errors] == ["engine_failed"]
    assert speaking.done["frames"] == len(speaking.frames)  # nothing it had was cut
    assert fatal.done is not None and fatal.done["reason"] == "failed"
    assert code == 1001
    assert exit_code == 70
    events = [orjson.loads(line).get("event") for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert "engine_died" in events and "exiting_engine_failed" in events


def test_sigterm_during_speech_finishes_turns_whole(tmp_path: Path) -> None:
    env = {"FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 0.5})}
    with cli_server(tmp_path, env, "--shutdown-grace-s", "15") as (proc, port, _):
        url = f"ws://127.0.0.1:{port}/v1/stream"

        async def scenario() -> tuple[list[ContextLog], list[int | None], bool]:
            clients = [await NativeClient.connect(url) for _ in range(3)]
            logs = [await c.open(f"t{i}", seed=i, text=SENTENCE * 2) for i, c in enumerate(clients)]
            for c, log in zip(clients, logs, strict=False):
                await c.end(log.context_id)
            while not all(log.frames for log in logs):
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            refused = False
            deadline_s = time.monotonic() + 5
            while not refused and time.monotonic() < deadline_s:
                try:
                    client = await NativeClient.connect(url)
                except OSError:
                    refused = True  # the listener closed
                else:
                    await client.close()
                    await asyncio.sleep(0.05)
            codes = [await asyncio.wait_for(c.wait_closed(), 20) for c in clients]
            return logs, codes, refused

        logs, codes, refused = run(scenario())
        exit_code = proc.wait(20)
    assert refused
    assert codes == [1001, 1001, 1001]
    for log in logs:
        assert log.done is not None and log.done["reason"] == "completed"
        assert [h.seq for h, _, _ in log.frames] == list(range(log.done["frames"]))  # every frame, whole
        assert all(len(payload) == len(log.frames[0][1]) for _, payload, _ in log.frames[:-1])
    assert exit_code == 0  # every turn ended within the grace period
