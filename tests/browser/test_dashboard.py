"""The dashboard in headless Chromium, fed by a short load that the demo page itself generates."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.support import Tab, screenshot, set_range

pytestmark = pytest.mark.timeout(90)

CHARTS = ("ttfa", "hist", "decode", "slots", "audio", "sessions", "waiting", "busy", "models")
LOAD_SESSIONS = 6


def test_load_from_the_demo_page_fills_the_dashboard(tab: Tab, chromium: Any, server: Any) -> None:
    demo = tab.page
    demo.goto(server.http_url + "/")
    demo.wait_for_function("window.__demo && window.__demo.ready", timeout=10_000)
    set_range(demo, "#load-n", LOAD_SESSIONS)
    demo.click("#load-toggle")

    dash = tab.page.context.new_page()
    dash.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    dash.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" else None)
    dash.goto(server.http_url + "/dashboard")
    dash.wait_for_function("window.__dash && window.__dash.connected", timeout=10_000)
    demo.wait_for_function(f"window.__demo.load.sessions === {LOAD_SESSIONS}", timeout=10_000)
    demo.wait_for_function("window.__demo.load.turns >= 4 && window.__demo.load.p50Ms !== null", timeout=30_000)
    # every chart has drawn points, the first-audio quantiles are numbers
    dash.wait_for_function(
        "() => { const d = window.__dash.drawn; return " + " && ".join(f"d.{c} > 0" for c in CHARTS) + "; }",
        timeout=10_000,
    )
    for q in ("q50", "q95", "q99"):
        assert dash.inner_text(f"#{q}").replace("\n", "").endswith("ms")
    assert "native" in dash.inner_text("#protocols")
    assert dash.inner_text("#models").startswith("english")  # the server's one model, its row
    assert dash.is_visible("#random-banner")
    assert dash.evaluate("() => window.__dash.samples") >= 4
    screenshot(demo, "demo-load.png", full_page=True)
    screenshot(dash, "dashboard.png", full_page=True)

    demo.click("#load-toggle")
    demo.wait_for_function("window.__demo.load.sessions === 0", timeout=10_000)
    assert tab.errors == []
