"""The demo page in headless Chromium: it connects, streams a text like an LLM, plays the audio through the
AudioWorklet, shows the time to first audio, stops playback on barge-in, and makes a voice from a clip."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from agent_server.core.voices import encode_wav_pcm16

from tests.browser.support import Tab, screenshot, set_range

pytestmark = pytest.mark.timeout(90)

SHORT_TEXT = "Hello there. Your table for two is booked for eight tonight."
LONG_TEXT = (
    "Sure, I can help with that. Your flight to Lisbon leaves tomorrow at nine fifteen from gate twelve, "
    "and boarding starts forty minutes before. Would you like me to add a seat with extra legroom?"
)
NATIVE_RATE_HZ = 24_000


def open_demo(tab: Tab, url: str) -> Any:
    page = tab.page
    page.goto(url + "/")
    page.wait_for_function("window.__demo && window.__demo.ready", timeout=10_000)
    return page


def speak_and_wait(page: Any, timeout_ms: int = 20_000) -> None:
    """Click Speak and wait until the new turn has played out (or ended otherwise)."""
    turns = page.evaluate("window.__demo.turns")
    page.click("#speak")
    page.wait_for_function(f"window.__demo.turns > {turns}", timeout=5_000)
    finished = "['done', 'cancelled', 'busy', 'failed'].includes(window.__demo.turnState)"
    page.wait_for_function(finished, timeout=timeout_ms)


def demo_state(page: Any) -> dict[str, Any]:
    state: dict[str, Any] = page.evaluate("() => ({...window.__demo})")
    return state


def test_streams_like_an_llm_plays_and_shows_ttfb(tab: Tab, server: Any) -> None:
    page = open_demo(tab, server.http_url)
    assert page.is_visible("#random-banner"), "random weights must be said plainly"
    assert "noise" in page.inner_text("#random-banner")
    assert page.input_value("#model") == "english"

    page.fill("#text", SHORT_TEXT)
    set_range(page, "#rate", 60)
    page.click("#speak")
    page.wait_for_function("window.__demo.ttfbMs !== null", timeout=10_000)
    ttfb_text = page.inner_text("#ttfb").replace("\n", "")
    assert re.fullmatch(r"\d+ms", ttfb_text), ttfb_text
    page.wait_for_function("window.__demo.samplesPlayed > 0", timeout=10_000)
    page.wait_for_function("window.__demo.turnState === 'done'", timeout=20_000)
    state = demo_state(page)
    assert state["lastReason"] == "completed"
    assert 0 < state["ttfbMs"] < 2000
    # everything received was played: the text's audio at 1.5 tokens per character, 40 ms per token
    sentences = ["Hello there.", "Your table for two is booked for eight tonight."]
    expected_s = 0.04 * sum(round(1.5 * len(s)) for s in sentences)
    assert state["samplesPlayed"] == pytest.approx(expected_s * NATIVE_RATE_HZ, rel=0.2)
    assert page.inner_text("#srv-ttfa").endswith("ms")
    assert "first audio" in page.inner_text("#turns .turn-head")
    screenshot(page, "demo-turn.png", full_page=True)

    # telephony format, sent at once: decoded (mu-law) and played at 8 kHz
    played_before = state["samplesPlayed"]
    page.select_option("#format", "mulaw/8000")
    page.click("label:has(> input[value=whole])")
    page.fill("#text", "Thanks, goodbye.")
    speak_and_wait(page)
    state = demo_state(page)
    assert state["turnState"] == "done"
    assert state["samplesPlayed"] - played_before > 0.3 * 8000
    assert tab.errors == []


def test_barge_in_stops_playback(tab: Tab, server: Any) -> None:
    page = open_demo(tab, server.http_url)
    page.fill("#text", LONG_TEXT)
    set_range(page, "#rate", 80)
    page.click("#speak")
    page.wait_for_function(f"window.__demo.samplesPlayed > {0.8 * NATIVE_RATE_HZ}", timeout=15_000)
    assert demo_state(page)["turnState"] == "speaking"
    page.click("#barge")
    page.wait_for_function("window.__demo.lastReason === 'cancelled'", timeout=5_000)
    state = demo_state(page)
    assert state["turnState"] == "cancelled"
    time.sleep(0.6)  # playback stopped at once: not one more sample
    after = demo_state(page)
    assert after["samplesPlayed"] == state["samplesPlayed"]
    assert after["samplesPlayed"] < 0.04 * 1.5 * len(LONG_TEXT) * NATIVE_RATE_HZ * 0.6, "barge-in came too late to test"
    assert page.is_disabled("#barge")
    assert "cancelled" in page.inner_text("#turn-state")
    screenshot(page, "demo-barge-in.png", full_page=True)
    assert tab.errors == []


def test_upload_a_voice_and_use_it(tab: Tab, server: Any, tmp_path: Path) -> None:
    rate_hz = 16_000
    t_s = np.arange(6 * rate_hz) / rate_hz
    clip = tmp_path / "me.wav"
    clip.write_bytes(encode_wav_pcm16((0.3 * np.sin(2 * np.pi * 180 * t_s)).astype(np.float32), rate_hz))
    page = open_demo(tab, server.http_url)
    page.set_input_files("#clip", str(clip))
    page.fill("#clip-name", "Browser test voice")
    page.click("#upload")
    page.wait_for_function("document.querySelector('#upload-msg').textContent.includes('ready')", timeout=10_000)
    voice_id = page.input_value("#voice")
    assert voice_id != "default" and voice_id in [v.voice_id for v in server.hub.voices.list()]
    assert "Browser test voice" in page.inner_text("#voice")
    assert page.input_value("#clip-name") == "" and page.evaluate("$ => document.querySelector('#clip').files.length",
                                                                  None) == 0  # made: the form is ready for another

    page.click("label:has(> input[value=whole])")
    page.fill("#text", "This is my own voice.")
    speak_and_wait(page)
    assert demo_state(page)["turnState"] == "done"
    assert server.hub.engine.submits[-1].voice_id == voice_id
    assert "Browser test voice" in page.inner_text("#turns")  # the timeline names the voice, not its id
    assert tab.errors == []


def test_speed_slider_plays_the_turn_faster(tab: Tab, server: Any) -> None:
    page = open_demo(tab, server.http_url)
    page.click("label:has(> input[value=whole])")
    page.fill("#text", SHORT_TEXT)
    set_range(page, "#speed", 1.5)
    assert page.inner_text("#speed-out") == "1.50×"
    speak_and_wait(page)
    state = demo_state(page)
    assert state["turnState"] == "done"
    sentences = ["Hello there.", "Your table for two is booked for eight tonight."]
    spoken_s = 0.04 * sum(round(1.5 * len(s)) for s in sentences)  # the engine's audio, as in the test above
    assert state["samplesPlayed"] == pytest.approx(spoken_s / 1.5 * NATIVE_RATE_HZ, rel=0.1)
    assert tab.errors == []


def test_with_auth_on_the_page_asks_for_a_key_and_uses_a_token(tab: Tab, tmp_path: Path) -> None:
    """A server with keys: the page opened bare says it needs a key (not "disconnected, retrying" forever);
    a key pasted into its field connects it; opened as /?token=<a token minted with the key> it connects at
    once (the WebSocket carries the token in its URL, the fetches in a header)."""
    from agent_server.settings import Settings

    from tests.agent_server.fake_engine import FakeEngine
    from tests.agent_server.live_server import live_server

    key = "sk-browser-demo-0123456789"
    with live_server(FakeEngine(realtime_factor=0.2), Settings(data_dir=tmp_path, api_keys=(key,))) as live:
        page = tab.page
        page.goto(live.http_url + "/")
        page.wait_for_selector("#auth-banner", state="visible", timeout=10_000)
        assert "needs an API key" in page.inner_text("#server-pill")
        assert not page.evaluate("window.__demo.ready")
        page.fill("#credential", key)
        page.click("#credential-use")
        page.wait_for_function("window.__demo && window.__demo.ready", timeout=10_000)
        assert page.is_hidden("#auth-banner")
        speak_and_wait(page)
        assert demo_state(page)["lastReason"] == "completed"

        token = httpx.post(live.http_url + "/v1/tokens", headers={"Authorization": f"Bearer {key}"}).json()["token"]
        fresh = tab.page.context.new_page()  # a tab of its own: sessionStorage does not carry over
        fresh.goto(f"{live.http_url}/?token={token}")
        fresh.wait_for_function("window.__demo && window.__demo.ready", timeout=10_000)
        assert fresh.is_hidden("#auth-banner") and fresh.evaluate("window.__demo.voices") == ["default"]
        assert "token=" not in fresh.url  # taken out of the address bar (kept for the tab), not left in history
        fresh.reload()
        fresh.wait_for_function("window.__demo && window.__demo.ready", timeout=10_000)
    unexpected = [e for e in tab.errors if "401" not in e and "WebSocket" not in e]  # but the refusals before the key
    assert unexpected == [], tab.errors


def test_an_idle_page_keeps_its_session_and_a_played_turn_stays_done(tab: Tab, tmp_path: Path) -> None:
    """The server closes a session silent for its inactivity timeout (here 2 s): the page keeps its socket with
    keep-alives paced by `session_started.inactivity_timeout_s`, so the turn that played is "done", not "failed ·
    connection lost", and the page never reconnects."""
    from agent_server.settings import Settings

    from tests.agent_server.fake_engine import FakeEngine
    from tests.agent_server.live_server import live_server

    settings = Settings(data_dir=tmp_path, inactivity_timeout_s=2.0)
    with live_server(FakeEngine(realtime_factor=0.2), settings) as live:
        page = open_demo(tab, live.http_url)
        page.fill("#text", SHORT_TEXT)
        speak_and_wait(page)
        page.wait_for_timeout(5_000)  # idle: more than twice the timeout
        state = demo_state(page)
        assert state["turnState"] == "done" and state["sessions"] == 1 and state["ready"], state
    assert tab.errors == []


def test_a_double_click_on_speak_starts_one_turn_at_a_time(tab: Tab, server: Any) -> None:
    page = open_demo(tab, server.http_url)
    page.fill("#text", SHORT_TEXT)
    page.dblclick("#speak")
    finished = "['done', 'cancelled', 'busy', 'failed'].includes(window.__demo.turnState)"
    page.wait_for_function(f"window.__demo.turns >= 1 && {finished}", timeout=20_000)
    page.wait_for_timeout(500)
    state = demo_state(page)
    assert state["turns"] == 1 and state["turnState"] == "done", state  # the second click came while it started
    assert tab.errors == []


def test_a_seed_that_is_no_whole_number_is_refused_in_the_page(tab: Tab, server: Any) -> None:
    page = open_demo(tab, server.http_url)
    page.click("#sampling summary")
    for bad in ("-5", "1.5", "99999999999999999999"):
        page.fill("#seed", bad)
        turns = demo_state(page)["turns"]
        page.click("#speak")
        page.wait_for_timeout(200)
        assert "seed" in page.inner_text("#speak-msg") and demo_state(page)["turns"] == turns
    page.fill("#seed", "")
