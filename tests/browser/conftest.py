"""Browser tests: Debian's chromium driven by Playwright (never a downloaded browser), against a live server
with a FakeEngine that reports StepStats. Screenshots go to out/browser/ (ignored by git).

Without chromium or playwright (scripts/ci_browser_deps.sh installs both) the tests skip, except under CI
(CI=true), where they fail instead so that a broken install cannot pass silently."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from agent_server.settings import Settings

from tests.browser.support import VIEWPORT, StatsFakeEngine, Tab, metrics_server

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


def _missing() -> str | None:
    if shutil.which(CHROMIUM) is None:
        return f"{CHROMIUM} not found (scripts/ci_browser_deps.sh installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright not installed (scripts/ci_browser_deps.sh installs it)"
    return None


@pytest.fixture(scope="module")  # not per session: Playwright's sync API keeps an event loop running in
def chromium() -> Iterator[Any]:  # this thread while it is open, and later tests' asyncio.run() would fail
    missing = _missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # 2x faster than real time, a little engine latency: audio streams for a while, so barge-in has
    # something to cut and the worklet's jitter buffer has real work.
    engine = StatsFakeEngine(max_slots=16, realtime_factor=0.5, first_chunk_delay_s=0.04)
    settings = Settings(data_dir=tmp_path_factory.mktemp("data"))
    with metrics_server(engine, settings, sample_period_s=0.25) as (live, _metrics):
        yield live


@pytest.fixture
def tab(chromium: Any) -> Iterator[Tab]:
    context = chromium.new_context(viewport=VIEWPORT, device_scale_factor=1)
    tab = Tab(context.new_page(), [])
    tab.page.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    tab.page.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" else None)
    try:
        yield tab
    finally:
        context.close()
