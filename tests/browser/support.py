"""Shared by the metrics and browser tests: a FakeEngine that reports StepStats, a live server with the
metrics routes and listener wired in (`agent_server.metrics.install` + `routes()`, whether or not
`create_app` already does it), and small Playwright helpers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_server import metrics
from agent_server.app import create_app
from agent_server.cli import build_server
from agent_server.settings import Settings
from synth.api import OUTPUT_SAMPLE_RATE_HZ, SAMPLES_PER_SPEECH_TOKEN, StepStats

from tests.agent_server.fake_engine import FakeEngine, make_engine
from tests.agent_server.live_server import STARTUP_TIMEOUT_S, LiveServer

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "out" / "browser"  # screenshots (ignored by git)
VIEWPORT = {"width": 1440, "height": 1000}
CFG_ROWS_PER_SEGMENT = 2
SECONDS_PER_TOKEN = SAMPLES_PER_SPEECH_TOKEN / OUTPUT_SAMPLE_RATE_HZ  # 0.04


@dataclass
class StatsFakeEngine(FakeEngine):
    """FakeEngine whose step loop calls the stats listener once per step that did work, like synth.Engine."""

    def _admit(self) -> None:
        before = len(self._running)
        t0_s = time.perf_counter()
        super()._admit()
        self._step_prefills = len(self._running) - before
        self._step_prefill_ms = (time.perf_counter() - t0_s) * 1000.0

    def _emit_due(self) -> None:
        running = list(self._running)
        tokens_before = sum(seg.emitted_tokens for seg in running)
        t0_s = time.perf_counter()
        super()._emit_due()
        decode_ms = (time.perf_counter() - t0_s) * 1000.0
        tokens = sum(seg.emitted_tokens for seg in running) - tokens_before
        prefills = getattr(self, "_step_prefills", 0)
        listener = self._stats_listener
        if listener is None or (not tokens and not prefills):
            return
        listener(
            StepStats(
                at_monotonic_s=time.monotonic(),
                decode_rows=CFG_ROWS_PER_SEGMENT * len(running) if tokens else 0,
                active_segments=len(running),
                max_slots=self.max_slots,
                waiting_segments=len(self._waiting),
                decode_ms=decode_ms if tokens else 0.0,
                prefill_ms=getattr(self, "_step_prefill_ms", 0.0),
                prefill_segments=prefills,
                vocoder_ms=0.0,
                audio_s=tokens * SECONDS_PER_TOKEN,
                preempted=0,
                model=self.variant,
            )
        )


def make_stats_engine(settings: object) -> FakeEngine:
    """Engine factory for `AGENT_SERVER_ENGINE_FACTORY=tests.browser.support:make_stats_engine`: the real CLI with
    an engine that reports its steps as synth.Engine does (options as `fake_engine.make_engine`'s)."""
    return make_engine(settings, StatsFakeEngine)


def wire_metrics(app: Any, **options: Any) -> metrics.Metrics:
    """What create_app will do once the lead wires it; a no-op where it already does."""
    m = metrics.install(app, **options)
    if not any(getattr(route, "path", None) == "/metrics" for route in app.router.routes):
        app.router.routes.extend(metrics.routes())
    return m


@contextlib.contextmanager
def metrics_server(
    engine: FakeEngine, settings: Settings, **options: Any
) -> Iterator[tuple[LiveServer, metrics.Metrics]]:
    """tests.agent_server.live_server.live_server, plus the metrics wiring."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = settings.replace(host="127.0.0.1", port=port)
    app = create_app(engine, settings)
    m = wire_metrics(app, **options)
    server = build_server(app, settings, access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    live = LiveServer(server, thread, port, app)
    try:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        live.wait_ready()
        yield live, m
    finally:
        if thread.is_alive():
            live.stop()
        sock.close()


# ---- browser helpers ------------------------------------------------------------------------------


@dataclass
class Tab:
    page: Any
    errors: list[str]  # uncaught exceptions and console errors: the tests expect none


def set_range(page: Any, selector: str, value: float) -> None:
    """Move a slider the way a user does (the page listens to `input`)."""
    page.eval_on_selector(selector, "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value)


def screenshot(page: Any, name: str, **kwargs: Any) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    page.screenshot(path=str(path), **kwargs)
    return path
