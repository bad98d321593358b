// The demo page: one native-protocol session (docs/protocol.md), audio played as it arrives through an
// AudioWorklet jitter buffer (audio-worklet.js), a timeline per turn, barge-in, simulated load, voice upload.
// No dependencies, no build step. `window.__demo` exposes what the browser tests check.

const $ = (id) => document.getElementById(id);
const WS_URL = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/stream`;
// With auth on (docs/operations.md, "Access") the page needs a credential: its own URL's ?token= (a short-lived
// token your backend minted with POST /v1/tokens) or ?api_key=, or one pasted into the field a 401 shows (kept
// for this tab only). WebSockets carry it in the URL (browsers cannot set their headers), fetches in a header.
const CREDENTIAL_STORE = "agent-server-credential";
const pageQuery = new URLSearchParams(location.search);
const auth = {
  credential: pageQuery.get("token") || pageQuery.get("api_key") || pageQuery.get("access_token")
    || sessionStorage.getItem(CREDENTIAL_STORE) || "",
  needed: false,
};
// A credential from the URL is kept for this tab and taken out of the address bar (and the history): a reload
// must not bring back a refused one over a key pasted since, and a key must not sit in the URL.
if (["token", "api_key", "access_token"].some((name) => pageQuery.has(name))) {
  if (auth.credential) sessionStorage.setItem(CREDENTIAL_STORE, auth.credential);
  for (const name of ["token", "api_key", "access_token"]) pageQuery.delete(name);
  const rest = pageQuery.toString();
  history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
}
const HEADER_BYTES = 12;
const ENCODING_NAMES = { 1: "pcm_s16le", 2: "mulaw", 3: "alaw" };
const MAX_TURNS_SHOWN = 4;
const RECONNECT_MS = 1500; // the first retry; then doubling, up to RECONNECT_MAX_MS
const RECONNECT_MAX_MS = 15000;
const KEEPALIVE_MS = 10000; // at most; a third of the server's inactivity timeout (session_started) if shorter
const RING_SECONDS = 150;
const VARIANTS = ["english", "turbo", "multilingual"];
const SAMPLING_DEFAULTS = {
  english: { temperature: 0.8, top_p: 1.0, cfg_weight: 0.5, exaggeration: 0.5 },
  multilingual: { temperature: 0.8, top_p: 1.0, cfg_weight: 0.5, exaggeration: 0.5 },
  turbo: { temperature: 0.8, top_p: 0.95, cfg_weight: 0.0, exaggeration: 0.0 },
};
const LOAD_TEXTS = [
  "Okay, let me check that for you. The store opens at ten and closes at six on weekdays.",
  "Hello! I found three restaurants nearby. The closest one is Italian, about five minutes away.",
  "Right, your balance is two hundred dollars. Is there anything else I can do for you today?",
  "Got it, the meeting moves to Thursday at two. I will send the new invitation to everyone now.",
];
const COLORS = {
  text: "#6ea8fe", segment: "#b392f0", frame: "#5b6b80", play: "#3fd0b6", underrun: "#ff6b6b",
  barge: "#f2b84b", grid: "#263140", label: "#8b98a8", ink: "#e6edf3",
};

// What the browser tests read.
const demo = (window.__demo = {
  ready: false, variant: null, randomWeights: null, samplesPlayed: 0, underruns: 0, framesReceived: 0,
  ttfbMs: null, turnState: "idle", turns: 0, lastReason: null, voices: [], sessions: 0,
  load: { sessions: 0, turns: 0, busy: 0, p50Ms: null },
});

// ---- the session ------------------------------------------------------------------------------------

const conn = { ws: null, info: null, retries: 0, keepalive: null, retryTimer: null };
const turnsById = new Map();
const turnsByStream = new Map();
const turns = []; // newest first
let current = null;

function wsUrl() {
  return auth.credential ? `${WS_URL}?token=${encodeURIComponent(auth.credential)}` : WS_URL;
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (auth.credential) headers.set("Authorization", `Bearer ${auth.credential}`);
  const r = await fetch(path, { ...options, headers });
  if (r.status === 401) askForCredential();
  return r;
}

function askForCredential() {
  auth.needed = true;
  $("auth-banner").hidden = false;
  setPill("bad", auth.credential ? "the key or token was refused" : "this server needs an API key");
}

function useCredential() {
  const given = $("credential").value.trim();
  if (!given) return setPill("bad", "paste an API key or a token first");
  auth.credential = given;
  sessionStorage.setItem(CREDENTIAL_STORE, auth.credential);
  auth.needed = false;
  $("auth-banner").hidden = true;
  loadStatus();
  loadVoices();
  conn.retries = 0;
  const old = conn.ws; // a session without the credential (or none): a new one with it, now
  conn.ws = null;
  if (old) old.close();
  connect();
}

function connect() {
  clearTimeout(conn.retryTimer);
  if (auth.needed) return; // until a credential is given (useCredential connects)
  if (conn.ws && conn.ws.readyState <= WebSocket.OPEN) return; // one session at a time
  const ws = new WebSocket(wsUrl());
  ws.binaryType = "arraybuffer";
  conn.ws = ws;
  ws.onmessage = (e) => (typeof e.data === "string" ? onEvent(JSON.parse(e.data)) : onFrame(e.data));
  ws.onclose = () => {
    if (conn.ws !== ws) return;
    clearInterval(conn.keepalive);
    const started = conn.info !== null;
    demo.ready = false;
    conn.info = null;
    // a turn whose audio all came (context_done "completed") plays on: only one still coming is lost
    if (current && !current.finished && !current.completed) finishTurn(current, "failed", "connection lost");
    if (!started) loadStatus(); // refused before the session started: a 401 shows the key field
    if (!auth.needed) setPill("bad", "disconnected, retrying…");
    const delay = Math.min(RECONNECT_MS * 2 ** conn.retries, RECONNECT_MAX_MS);
    conn.retries += 1;
    conn.retryTimer = setTimeout(connect, delay);
  };
}

function send(obj) {
  if (conn.ws && conn.ws.readyState === WebSocket.OPEN) conn.ws.send(JSON.stringify(obj));
}

function onEvent(ev) {
  const turn = ev.context_id ? turnsById.get(ev.context_id) : null;
  switch (ev.type) {
    case "session_started":
      conn.info = ev;
      conn.retries = 0;
      clearInterval(conn.keepalive); // an idle page keeps its session: well inside the server's timeout
      conn.keepalive = setInterval(() => send({ type: "keepalive" }),
        Math.min(KEEPALIVE_MS, ((ev.inactivity_timeout_s || 20) * 1000) / 3));
      demo.ready = true;
      demo.sessions += 1;
      showMsg("speak-msg", ""); // what was said while not connected ("busy: loading") is over
      demo.variant = ev.variant;
      demo.randomWeights = ev.random_weights;
      showServer(ev.variant, ev.random_weights);
      break;
    case "context_started":
      if (!turn) return;
      turn.streamId = ev.stream_id;
      turnsByStream.set(ev.stream_id, turn);
      setState(turn, "streaming");
      break;
    case "segment_started":
      if (!turn) return;
      turn.segments.push({ index: ev.segment_index, text: ev.text, startAt: rel(turn), doneAt: null });
      break;
    case "segment_done": {
      const seg = turn && turn.segments.find((s) => s.index === ev.segment_index);
      if (seg) seg.doneAt = rel(turn);
      break;
    }
    case "context_done":
      if (!turn) return;
      turn.doneAt = rel(turn);
      turn.timing = ev.timing || null;
      turn.audioMs = ev.audio_ms;
      demo.lastReason = ev.reason;
      if (ev.reason === "completed") {
        turn.completed = true; // all of its audio is here: it plays to its end whatever the socket does
        audio.node && audio.node.port.postMessage({ type: "end" });
        if (turn.samples === 0) finishTurn(turn, "done");
      } else if (!turn.finished) {
        finishTurn(turn, ev.reason === "cancelled" ? "cancelled" : ev.reason, ev.detail);
      }
      renderNumbers(turn);
      break;
    case "busy":
      if (turn) finishTurn(turn, "busy", ev.reason);
      else showMsg("speak-msg", `server busy: ${ev.reason}`, "err");
      break;
    case "error": {
      if (turn && turn.finished && ev.code === "unknown_context") break; // its text after the first error: moot
      showMsg("speak-msg", `${ev.field ? `${ev.field}: ` : ""}${ev.message} (${ev.code})`, "err");
      if (turn && !turn.finished && turn.state === "opening") finishTurn(turn, "failed", ev.message);
      break;
    }
  }
  markDirty(turn);
}

function onFrame(buf) {
  const view = new DataView(buf);
  const turn = turnsByStream.get(view.getUint32(4, true));
  if (!turn || turn.cancelled) return; // barge-in: what was still in flight is dropped
  const t = rel(turn);
  if (turn.firstFrameAt === null) {
    turn.firstFrameAt = t;
    turn.ttfbMs = t - (turn.firstTextAt ?? 0);
    demo.ttfbMs = turn.ttfbMs;
    showTtfb(turn.ttfbMs);
    setState(turn, "speaking");
  }
  turn.frames.push(t);
  const pcm = decodeAudio(ENCODING_NAMES[view.getUint8(1)], buf);
  turn.samples += pcm.length;
  demo.framesReceived += 1;
  if (audio.node && audio.rate === turn.rateHz) audio.node.port.postMessage({ type: "push", pcm }, [pcm.buffer]);
  if (turn.frames.length % 10 === 1) renderNumbers(turn);
  markDirty(turn);
}

// ---- audio --------------------------------------------------------------------------------------------

const audio = { ctx: null, node: null, rate: 0, playedBase: 0, lastPlayed: 0 };

async function ensureAudio(rateHz) {
  if (audio.ctx && audio.rate === rateHz) {
    if (audio.ctx.state !== "running") await audio.ctx.resume();
    return;
  }
  if (audio.ctx) {
    audio.playedBase += audio.lastPlayed;
    audio.lastPlayed = 0;
    audio.ctx.close();
  }
  const ctx = new AudioContext({ sampleRate: rateHz, latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/static/audio-worklet.js");
  const node = new AudioWorkletNode(ctx, "jitter-player", {
    numberOfInputs: 0, outputChannelCount: [1], processorOptions: { capacitySeconds: RING_SECONDS },
  });
  node.connect(ctx.destination);
  node.port.onmessage = (e) => onWorklet(e.data);
  Object.assign(audio, { ctx, node, rate: rateHz });
  await ctx.resume();
}

function onWorklet(msg) {
  const turn = turnsById.get(msg.turn);
  if (msg.type === "stats") {
    audio.lastPlayed = msg.played;
    demo.samplesPlayed = audio.playedBase + msg.played;
    $("played").textContent = demo.samplesPlayed.toLocaleString("en-US");
  } else if (msg.type === "playing" && turn) {
    turn.playingAt = rel(turn);
    turn.played.push([turn.playingAt, null]);
  } else if (msg.type === "resumed" && turn && !turn.cancelled) {
    turn.played.push([rel(turn), null]);
  } else if (msg.type === "underrun" && turn && !turn.cancelled) {
    turn.underruns.push(rel(turn));
    closePlayback(turn);
    demo.underruns += 1;
    const el = $("underruns");
    el.textContent = String(demo.underruns);
    el.classList.toggle("bad", demo.underruns > 0);
  } else if (msg.type === "drained" && turn) {
    turn.drainedAt = rel(turn);
    closePlayback(turn);
    if (!turn.finished) finishTurn(turn, "done");
  }
  markDirty(turn);
}

function closePlayback(turn) {
  const last = turn.played[turn.played.length - 1];
  if (last && last[1] === null) last[1] = rel(turn);
}

const MULAW = new Float32Array(256);
const ALAW = new Float32Array(256);
for (let i = 0; i < 256; i++) {
  let u = ~i & 0xff; // G.711 mu-law
  let t = ((u & 0x0f) << 3) + 0x84;
  t <<= (u & 0x70) >> 4;
  MULAW[i] = ((u & 0x80) ? 0x84 - t : t - 0x84) / 32768;
  let a = i ^ 0x55; // G.711 A-law
  let m = (a & 0x0f) << 4;
  const seg = (a & 0x70) >> 4;
  m = seg === 0 ? m + 8 : seg === 1 ? m + 0x108 : (m + 0x108) << (seg - 1);
  ALAW[i] = ((a & 0x80) ? m : -m) / 32768;
}

function decodeAudio(encoding, buf) {
  if (encoding === "pcm_s16le") {
    const ints = new Int16Array(buf, HEADER_BYTES, (buf.byteLength - HEADER_BYTES) >> 1);
    const out = new Float32Array(ints.length);
    for (let i = 0; i < ints.length; i++) out[i] = ints[i] / 32768;
    return out;
  }
  const bytes = new Uint8Array(buf, HEADER_BYTES);
  const table = encoding === "mulaw" ? MULAW : ALAW;
  const out = new Float32Array(bytes.length);
  for (let i = 0; i < bytes.length; i++) out[i] = table[bytes[i]];
  return out;
}

// ---- turns ----------------------------------------------------------------------------------------------

let turnNumber = 0;

function rel(turn) {
  return performance.now() - turn.t0;
}

let starting = false; // a turn is being started (its audio context may take a moment): one at a time

async function speak() {
  if (starting) return;
  starting = true;
  $("speak").disabled = true;
  try {
    await startTurn();
  } finally {
    starting = false;
    $("speak").disabled = false;
  }
}

async function startTurn() {
  if (!demo.ready) return showMsg("speak-msg", auth.needed ? "give an API key first" : "not connected yet", "err");
  const text = $("text").value.trim();
  if (!text) return showMsg("speak-msg", "type something first", "err");
  const seed = $("seed").value.trim();
  if (seed !== "" && !(/^\d+$/.test(seed) && BigInt(seed) < 2n ** 63n)) {
    return showMsg("speak-msg", "seed: a whole number from 0 (or empty for a random one)", "err");
  }
  if (current && !current.finished) bargeIn();
  showMsg("speak-msg", "");
  demo.turnState = "starting"; // (the audio context may take a moment: a new rate means a new one)
  $("turn-state").textContent = "starting";
  const [encoding, rate] = $("format").value.split("/");
  const rateHz = Number(rate);
  await ensureAudio(rateHz);
  const mode = document.querySelector("input[name=mode]:checked").value;
  const tokensPerS = Number($("rate").value);
  const turn = newTurn(text, mode, tokensPerS, encoding, rateHz);
  const jitterSamples = Math.round((Number($("jitter-ms").value) / 1000) * rateHz);
  audio.node.port.postMessage({ type: "start", turn: turn.id, prebufferSamples: jitterSamples });
  const open = {
    type: "open", context_id: turn.id, voice: $("voice").value,
    output_format: { encoding, sample_rate_hz: rateHz, frame_ms: Number($("frame-ms").value) },
  };
  if ($("model").value) open.model = $("model").value;
  const sampling = samplingOverrides();
  if (Object.keys(sampling).length) open.sampling = sampling;
  if (seed !== "") open.seed = Number(seed);
  if (Number($("speed").value) !== 1) open.speed = Number($("speed").value);
  send(open);
  if (mode === "whole") {
    sendText(turn, text);
    sendEnd(turn);
  } else {
    feed(turn, llmTokens(text), tokensPerS);
  }
  $("barge").disabled = false;
}

function newTurn(text, mode, tokensPerS, encoding, rateHz) {
  turnNumber += 1;
  const turn = {
    id: `turn-${turnNumber}-${Math.random().toString(36).slice(2, 7)}`, number: turnNumber, text, mode,
    tokensPerS, encoding, rateHz, voice: $("voice").selectedOptions[0]?.textContent || $("voice").value,
    t0: performance.now(), wall: new Date(),
    pieces: [], firstTextAt: null, endAt: null, segments: [], frames: [], samples: 0, firstFrameAt: null,
    ttfbMs: null, playingAt: null, played: [], drainedAt: null, underruns: [], bargeAt: null, doneAt: null, timing: null,
    audioMs: null, streamId: null, state: "opening", finished: false, cancelled: false, el: null, dirty: true,
  };
  turnsById.set(turn.id, turn);
  turns.unshift(turn);
  for (const old of turns.splice(MAX_TURNS_SHOWN)) {
    old.el && old.el.remove();
    turnsById.delete(old.id);
    turnsByStream.delete(old.streamId);
  }
  current = turn;
  demo.turns = turnNumber;
  demo.ttfbMs = null;
  showTtfb(null);
  setState(turn, "opening");
  renderNumbers(turn);
  buildTurnElement(turn);
  return turn;
}

/** Cut text the way an LLM's tokens arrive: words with their leading space, long words in pieces. */
function llmTokens(text) {
  const out = [];
  for (const m of text.matchAll(/\s*[\p{L}\p{N}']+|\s*[^\s\p{L}\p{N}']|\s+/gu)) {
    const word = m[0];
    if (word.length <= 7) out.push(word);
    else for (let i = 0; i < word.length; i += 4) out.push(word.slice(i, i + 4));
  }
  return out;
}

function feed(turn, pieces, tokensPerS) {
  const intervalMs = 1000 / tokensPerS;
  const startedAt = performance.now();
  let i = 0;
  const tick = () => {
    if (turn.finished) return;
    const due = Math.floor((performance.now() - startedAt) / intervalMs) + 1;
    while (i < pieces.length && i < due) sendText(turn, pieces[i++]);
    if (i >= pieces.length) return sendEnd(turn);
    turn.feedTimer = setTimeout(tick, Math.max(0, startedAt + i * intervalMs - performance.now()));
  };
  tick();
}

function sendText(turn, text) {
  const t = rel(turn);
  if (turn.firstTextAt === null) turn.firstTextAt = t;
  turn.pieces.push(t);
  send({ type: "text", context_id: turn.id, text });
  markDirty(turn);
}

function sendEnd(turn) {
  turn.endAt = rel(turn);
  send({ type: "end", context_id: turn.id });
  markDirty(turn);
}

function bargeIn() {
  const turn = current;
  if (!turn || turn.finished) return;
  clearTimeout(turn.feedTimer);
  send({ type: "cancel", context_id: turn.id });
  audio.node && audio.node.port.postMessage({ type: "stop" });
  turn.bargeAt = rel(turn);
  turn.cancelled = true;
  closePlayback(turn);
  finishTurn(turn, "cancelled");
}

function finishTurn(turn, state, detail) {
  turn.finished = true;
  clearTimeout(turn.feedTimer);
  turn.endedAt = rel(turn);
  if (detail) turn.detail = detail;
  setState(turn, state);
  if (turn === current && turn.firstFrameAt === null) showTtfb(undefined); // no audio came: no time to show
  if (turn === current) $("barge").disabled = true;
  markDirty(turn);
}

function setState(turn, state) {
  turn.state = state;
  if (turn !== current) return;
  demo.turnState = state;
  const el = $("turn-state");
  el.textContent = state;
  el.className = `state ${state}`;
}

// ---- numbers --------------------------------------------------------------------------------------------

function showTtfb(ms) {
  const el = $("ttfb");
  el.classList.toggle("pending", ms == null);
  el.innerHTML = ms === null ? "…" : ms === undefined ? "—" : `${Math.round(ms)}<span class="unit">ms</span>`;
}

function renderNumbers(turn) {
  if (turn !== current) return;
  const timing = turn.timing;
  $("srv-ttfa").textContent = timing && timing.ttfa_ms != null ? `${Math.round(timing.ttfa_ms)} ms` : "—";
  $("srv-overhead").textContent =
    timing && timing.server_overhead_ms != null ? `${timing.server_overhead_ms.toFixed(1)} ms` : "—";
  $("audio-len").textContent = turn.samples ? `${(turn.samples / turn.rateHz).toFixed(2)} s` : "—";
}

function fmtMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(ms >= 10000 ? 0 : 1)} s` : `${Math.round(ms)} ms`;
}

// ---- the timeline -----------------------------------------------------------------------------------

const LANES = ["text", "segments", "audio in", "playback"];
const LANE_H = 24;
const PAD = { left: 78, right: 14, top: 22, bottom: 22 };

function buildTurnElement(turn) {
  const box = $("turns");
  const empty = box.querySelector(".empty");
  if (empty) empty.remove();
  const el = document.createElement("div");
  el.className = "turn";
  el.innerHTML = `<div class="turn-head"><span class="title"></span><span class="meta"></span></div>
    <canvas></canvas><div class="said"></div>`;
  turn.el = el;
  turn.canvas = el.querySelector("canvas");
  el.querySelector(".said").textContent = `“${turn.text}”`;
  box.prepend(el);
}

function markDirty(turn) {
  if (turn) turn.dirty = true;
}

function turnEnd(turn) {
  const marks = [turn.drainedAt, turn.doneAt, turn.endedAt, turn.bargeAt, turn.endAt, ...turn.pieces.slice(-1)];
  return Math.max(0, ...marks.filter((x) => x != null));
}

function isLive(turn) {
  return !turn.finished || (turn.state === "done" && turn.drainedAt === null && turn.samples > 0);
}

function drawLoop() {
  for (const turn of turns) {
    if (turn.dirty || isLive(turn)) {
      turn.dirty = false;
      drawTurn(turn);
    }
  }
  requestAnimationFrame(drawLoop);
}

function niceStep(spanMs, targetTicks) {
  const raw = spanMs / targetTicks;
  for (const step of [10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 30000, 60000]) {
    if (step >= raw) return step;
  }
  return 120000;
}

function drawTurn(turn) {
  const head = turn.el.querySelector(".turn-head");
  const segs = turn.segments.length;
  head.querySelector(".title").textContent =
    `Turn ${turn.number} · ${turn.state}` + (turn.ttfbMs !== null ? ` · first audio ${fmtMs(turn.ttfbMs)}` : "");
  head.querySelector(".meta").textContent = [
    turn.wall.toLocaleTimeString("en-GB"),
    turn.mode === "llm" ? `streamed at ${turn.tokensPerS} tokens/s` : "sent at once",
    `${turn.encoding} ${turn.rateHz / 1000} kHz`,
    `voice ${turn.voice}`,
    `${segs} segment${segs === 1 ? "" : "s"}`,
    turn.samples ? `${(turn.samples / turn.rateHz).toFixed(1)} s audio` : null,
    turn.underruns.length ? `${turn.underruns.length} underrun${turn.underruns.length === 1 ? "" : "s"}` : null,
    turn.detail || null,
  ].filter(Boolean).join(" · ");

  const canvas = turn.canvas;
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (!w) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  g.textBaseline = "middle";

  const now = isLive(turn) ? rel(turn) : turnEnd(turn);
  const spanMs = Math.max(1000, now * 1.04);
  const x = (t) => PAD.left + (Math.min(t, spanMs) / spanMs) * (w - PAD.left - PAD.right);
  const laneY = (i) => PAD.top + i * (LANE_H + 4);
  const bottom = laneY(LANES.length) - 4;

  // grid and axis
  const step = niceStep(spanMs, Math.max(3, Math.floor((w - PAD.left) / 90)));
  g.strokeStyle = COLORS.grid;
  g.fillStyle = COLORS.label;
  g.lineWidth = 1;
  g.textAlign = "center";
  for (let t = 0; t <= spanMs; t += step) {
    const px = Math.round(x(t)) + 0.5;
    g.beginPath();
    g.moveTo(px, PAD.top - 4);
    g.lineTo(px, bottom);
    g.stroke();
    g.fillText(t === 0 ? "0" : fmtMs(t), px, bottom + 11);
  }
  g.textAlign = "right";
  LANES.forEach((name, i) => g.fillText(name, PAD.left - 10, laneY(i) + LANE_H / 2));
  g.textAlign = "left";

  // text pieces
  const y0 = laneY(0);
  g.fillStyle = COLORS.text;
  for (const t of turn.pieces) g.fillRect(Math.round(x(t)), y0 + 4, 2, LANE_H - 8);
  if (turn.endAt !== null) {
    g.fillStyle = COLORS.label;
    g.fillText("end", x(turn.endAt) + 5, y0 + LANE_H / 2);
  }

  // segments
  const y1 = laneY(1);
  turn.segments.forEach((seg, i) => {
    const next = turn.segments[i + 1];
    const x0 = x(seg.startAt);
    const x1 = Math.max(x0 + 3, x(seg.doneAt ?? now));
    g.fillStyle = "rgba(179, 146, 240, 0.28)";
    g.fillRect(x0, y1 + 3, x1 - x0, LANE_H - 6);
    g.fillStyle = COLORS.segment;
    g.fillRect(x0, y1 + 3, 2, LANE_H - 6);
    const room = (next ? x(next.startAt) : w - PAD.right) - x0 - 10;
    if (room > 24) {
      g.save();
      g.beginPath();
      g.rect(x0 + 5, y1, room, LANE_H);
      g.clip();
      g.fillStyle = COLORS.ink;
      g.fillText(`#${seg.index} ${seg.text}`, x0 + 6, y1 + LANE_H / 2);
      g.restore();
    }
  });

  // frames received
  const y2 = laneY(2);
  g.fillStyle = COLORS.frame;
  for (const t of turn.frames) g.fillRect(Math.round(x(t)), y2 + 4, 1, LANE_H - 8);

  // playback, underruns
  const y3 = laneY(3);
  g.fillStyle = "rgba(63, 208, 182, 0.55)";
  for (const [start, stop] of turn.played) {
    const end = stop ?? (turn.finished && turn.state !== "done" ? turn.endedAt : now);
    g.fillRect(x(start), y3 + 4, Math.max(2, x(end) - x(start)), LANE_H - 8);
  }
  g.fillStyle = COLORS.underrun;
  for (const t of turn.underruns) {
    const px = x(t);
    g.fillRect(px - 1, y3, 3, LANE_H);
    g.beginPath();
    g.moveTo(px - 5, y3 - 2);
    g.lineTo(px + 5, y3 - 2);
    g.lineTo(px, y3 + 5);
    g.fill();
  }

  // first audio and barge-in markers
  if (turn.firstFrameAt !== null) marker(g, x(turn.firstFrameAt), bottom, COLORS.play, `first audio ${fmtMs(turn.ttfbMs)}`, w);
  if (turn.bargeAt !== null) marker(g, x(turn.bargeAt), bottom, COLORS.barge, "barge-in", w);
}

function marker(g, px, bottom, color, label, w) {
  g.save();
  g.strokeStyle = color;
  g.fillStyle = color;
  g.setLineDash([4, 3]);
  g.lineWidth = 1.5;
  g.beginPath();
  g.moveTo(px, PAD.top - 8);
  g.lineTo(px, bottom);
  g.stroke();
  g.font = "600 11px system-ui, sans-serif";
  const tw = g.measureText(label).width;
  g.textAlign = px + tw + 8 > w ? "right" : "left";
  g.fillText(label, g.textAlign === "right" ? px - 5 : px + 5, PAD.top - 12);
  g.restore();
}

// ---- simulated load ---------------------------------------------------------------------------------

const load = { sessions: [], running: false, turns: 0, busy: 0, ttfas: [], timer: null };

class SimSession {
  constructor(index) {
    this.index = index;
    this.n = 0;
    this.open = false;
    this.stopped = false;
    this.ctx = null;
    this.ws = new WebSocket(wsUrl());
    this.ws.binaryType = "arraybuffer";
    this.ws.onmessage = (e) => this.onMessage(e.data);
    this.ws.onclose = () => {
      this.open = false;
      clearTimeout(this.timer);
    };
  }

  onMessage(data) {
    if (typeof data !== "string") {
      if (this.ctx && this.ctx.firstFrameAt === null) {
        this.ctx.firstFrameAt = performance.now();
        load.ttfas.push(this.ctx.firstFrameAt - this.ctx.firstTextAt);
        if (load.ttfas.length > 200) load.ttfas.shift();
      }
      return;
    }
    const ev = JSON.parse(data);
    if (ev.type === "session_started") {
      this.open = true;
      this.timer = setTimeout(() => this.speak(), 100 + Math.random() * 400);
    } else if (ev.type === "context_done" && this.ctx && ev.context_id === this.ctx.id) {
      if (ev.reason === "completed") load.turns += 1;
      this.ctx = null;
      if (!this.stopped) this.timer = setTimeout(() => this.speak(), 200 + Math.random() * 600);
    } else if (ev.type === "busy") {
      load.busy += 1;
      if (!ev.context_id) this.stop();
    }
  }

  speak() {
    if (this.stopped || this.ws.readyState !== WebSocket.OPEN) return;
    this.n += 1;
    const id = `sim-${this.index}-${this.n}`;
    const pieces = llmTokens(LOAD_TEXTS[(this.index + this.n) % LOAD_TEXTS.length]);
    this.ctx = { id, firstTextAt: null, firstFrameAt: null };
    this.ws.send(JSON.stringify({ type: "open", context_id: id }));
    const intervalMs = 1000 / Number($("rate").value);
    let i = 0;
    const tick = () => {
      if (this.stopped || !this.ctx || this.ctx.id !== id || this.ws.readyState !== WebSocket.OPEN) return;
      if (this.ctx.firstTextAt === null) this.ctx.firstTextAt = performance.now();
      this.ws.send(JSON.stringify({ type: "text", context_id: id, text: pieces[i++] }));
      if (i < pieces.length) this.timer = setTimeout(tick, intervalMs);
      else this.ws.send(JSON.stringify({ type: "end", context_id: id }));
    };
    tick();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}

function toggleLoad() {
  if (load.running) {
    load.sessions.forEach((s) => s.stop());
    load.sessions = [];
    load.running = false;
    $("load-toggle").textContent = "Start load";
    showMsg("load-msg", "stopped");
  } else {
    const n = Number($("load-n").value);
    Object.assign(load, { running: true, turns: 0, busy: 0, ttfas: [] });
    for (let i = 0; i < n; i++) load.sessions.push(new SimSession(i));
    $("load-toggle").textContent = "Stop load";
  }
  renderLoad();
}

function quantile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
}

function renderLoad() {
  const open = load.sessions.filter((s) => s.open).length;
  const p50 = quantile(load.ttfas, 0.5);
  const p95 = quantile(load.ttfas, 0.95);
  Object.assign(demo.load, { sessions: open, turns: load.turns, busy: load.busy, p50Ms: p50 });
  $("load-sessions").textContent = String(open);
  $("load-turns").textContent = String(load.turns);
  $("load-p50").textContent = p50 === null ? "—" : fmtMs(p50);
  $("load-p95").textContent = p95 === null ? "—" : fmtMs(p95);
  $("load-busy").textContent = String(load.busy);
  if (load.running) {  // what is true now: the sessions the server took, not the ones asked for
    const asked = load.sessions.length;
    showMsg("load-msg", open === asked ? `${open} sessions talking` : `${open} of ${asked} connected`,
            open === asked ? "ok" : "err");
  }
}

// ---- voices, status, controls -----------------------------------------------------------------------

async function loadVoices(select) {
  const r = await api("/v1/voices");
  if (!r.ok) return;
  const { voices } = await r.json();
  const el = $("voice");
  const keep = select || el.value || "default";
  el.innerHTML = "";
  for (const v of voices) {
    if (v.status === "deleting") continue;
    const opt = document.createElement("option");
    opt.value = v.voice_id;
    opt.textContent = v.builtin ? `${v.voice_id} (built in)` : `${v.name || v.voice_id}${v.status === "ready" ? "" : ` (${v.status})`}`;
    el.append(opt);
  }
  el.value = voices.some((v) => v.voice_id === keep) ? keep : "default";
  demo.voices = voices.map((v) => v.voice_id);
}

async function upload() {
  const file = $("clip").files[0];
  if (!file) return showMsg("upload-msg", "choose a WAV file first", "err");
  const form = new FormData();
  form.append("file", file);
  if ($("clip-name").value.trim()) form.append("name", $("clip-name").value.trim());
  showMsg("upload-msg", "computing the voice…");
  $("upload").disabled = true;
  try {
    const r = await api("/v1/voices", { method: "POST", body: form });
    const body = await r.json();
    if (!r.ok) return showMsg("upload-msg", (body.error && body.error.message) || `HTTP ${r.status}`, "err");
    await loadVoices(body.voice_id);
    showMsg("upload-msg", `voice “${body.name || body.voice_id}” is ready and selected (${body.duration_s} s clip)`, "ok");
    $("clip").value = ""; // made: a second click would make the same voice again
    $("clip-name").value = "";
  } catch (err) {
    showMsg("upload-msg", err instanceof TypeError ? "the server cannot be reached: try again" : String(err), "err");
  } finally {
    $("upload").disabled = false;
  }
}

async function loadStatus() {
  try {
    const r = await api("/v1/status");
    if (r.status === 401) return;
    const s = await r.json();
    showServer(s.variant, s.random_weights, s.engine && s.engine.max_slots, s.status);
  } catch (err) {
    setPill("bad", "server unreachable");
  }
}

let serverMaxSlots = null;

function showServer(variant, randomWeights, maxSlots, status) {
  if (maxSlots) serverMaxSlots = maxSlots;
  $("random-banner").hidden = !randomWeights;
  const parts = [variant, serverMaxSlots ? `${serverMaxSlots} slots` : null, randomWeights ? "random weights" : null];
  const ready = demo.ready || status === "ready";
  setPill(randomWeights ? "warn" : ready ? "ok" : "bad", parts.filter(Boolean).join(" · ") + (ready ? "" : ` · ${status || "connecting"}`));
  const model = $("model");
  if (model.dataset.variant !== variant && variant) {
    model.dataset.variant = variant;
    model.innerHTML = "";
    for (const v of VARIANTS) {
      const opt = document.createElement("option");
      opt.value = v;
      opt.textContent = v === variant ? `${v} (this server)` : `${v} (not served here)`;
      opt.disabled = v !== variant;
      model.append(opt);
    }
    model.value = variant;
    resetSampling();
  }
}

function setPill(kind, text) {
  const pill = $("server-pill");
  pill.className = `pill ${kind}`;
  pill.textContent = text;
}

function showMsg(id, text, kind = "") {
  const el = $(id);
  el.textContent = text;
  el.className = `msg ${kind}`;
}

function samplingInputs() {
  return [...document.querySelectorAll("#sampling input[type=range]")];
}

function samplingOverrides() {
  const out = {};
  for (const input of samplingInputs()) if (input.dataset.dirty && !input.disabled) out[input.dataset.key] = Number(input.value);
  return out;
}

function resetSampling() {
  const variant = $("model").value || "english";
  const defaults = SAMPLING_DEFAULTS[variant] || SAMPLING_DEFAULTS.english;
  for (const input of samplingInputs()) {
    input.value = defaults[input.dataset.key];
    delete input.dataset.dirty;
    input.disabled = variant === "turbo" && (input.dataset.key === "cfg_weight" || input.dataset.key === "exaggeration");
    input.nextElementSibling.textContent = Number(input.value).toFixed(2);
  }
}

function bindRange(id, fmt) {
  const input = $(id);
  const out = $(`${id}-out`);
  const show = () => (out.textContent = fmt(input.value));
  input.addEventListener("input", show);
  show();
}

function init() {
  bindRange("rate", (v) => `${v}/s`);
  bindRange("frame-ms", (v) => `${v} ms`);
  bindRange("jitter-ms", (v) => `${v} ms`);
  bindRange("speed", (v) => `${Number(v).toFixed(2)}×`);
  bindRange("load-n", (v) => v);
  for (const input of samplingInputs()) {
    input.addEventListener("input", () => {
      input.dataset.dirty = "1";
      input.nextElementSibling.textContent = Number(input.value).toFixed(2);
    });
  }
  resetSampling();
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => {
      const streamed = document.querySelector("input[name=mode]:checked").value === "llm";
      $("rate-field").style.opacity = streamed ? 1 : 0.4;
      $("rate").disabled = !streamed;
    });
  }
  $("speak").addEventListener("click", () => speak().catch((err) => showMsg("speak-msg", String(err), "err")));
  $("barge").addEventListener("click", bargeIn);
  $("sampling-reset").addEventListener("click", resetSampling);
  $("upload").addEventListener("click", upload);
  $("load-toggle").addEventListener("click", toggleLoad);
  $("credential-use").addEventListener("click", useCredential);
  $("credential").addEventListener("keydown", (e) => e.key === "Enter" && useCredential());
  $("text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("speak").click();
  });
  setInterval(renderLoad, 500);
  window.addEventListener("resize", () => turns.forEach(markDirty));
  loadStatus();
  loadVoices();
  connect();
  requestAnimationFrame(drawLoop);
}

init();
