// The live dashboard: snapshots pushed by the server (/dashboard/stream, server-sent events, computed from
// the same registry as /metrics), drawn on plain canvases. No dependencies. `window.__dash` is for tests.

const $ = (id) => document.getElementById(id);
const C = {
  accent: "#3fd0b6", blue: "#6ea8fe", violet: "#b392f0", warn: "#f2b84b", danger: "#ff6b6b",
  grid: "#263140", label: "#8b98a8", ink: "#e6edf3",
};
const PAD = { left: 46, right: 10, top: 16, bottom: 20 };

const dash = (window.__dash = { connected: false, samples: 0, drawn: {}, hello: null });
let hello = null;
let samples = [];
let maxSamples = 240;
let dirty = false;

// ---- the feed -----------------------------------------------------------------------------------------

function connect() {
  // with --metrics-auth, open the page as /dashboard?token=… (EventSource cannot set a header): passed on
  const source = new EventSource("/dashboard/stream" + location.search);
  source.addEventListener("hello", (e) => {
    hello = JSON.parse(e.data);
    dash.hello = hello;
    dash.connected = true;
    document.body.classList.remove("stale");
    maxSamples = Math.max(10, Math.round(120 / hello.sample_period_s));
    samples = hello.history.slice(-maxSamples);
    $("random-banner").hidden = !hello.random_weights;
    $("ttfa-window").textContent = `over the last ${hello.ttfa_window_s} s`;
    dirty = true;
  });
  source.addEventListener("sample", (e) => {
    samples.push(JSON.parse(e.data));
    if (samples.length > maxSamples) samples.splice(0, samples.length - maxSamples);
    dirty = true;
  });
  source.onerror = () => {
    dash.connected = false;
    setPill("bad", "reconnecting…");
    document.body.classList.add("stale"); // the figures are the last ones seen, not live
  };
}

const AUDIO_RATE_WINDOW_S = 4;

function rollingMean(values, span) {
  const out = [];
  let sum = 0;
  for (let i = 0; i < values.length; i++) {
    sum += values[i] || 0;
    if (i >= span) sum -= values[i - span] || 0;
    out.push(sum / Math.min(i + 1, span));
  }
  return out;
}

function setPill(kind, text) {
  const pill = $("pill");
  pill.className = `pill ${kind}`;
  pill.textContent = text;
}

// ---- drawing ------------------------------------------------------------------------------------------

function frame() {
  if (dirty) {
    dirty = false;
    render();
  }
  requestAnimationFrame(frame);
}

function render() {
  dash.samples = samples.length;
  const last = samples[samples.length - 1];
  if (!last || !hello) return;
  const status = last.status;
  setPill(
    status !== "ready" ? "bad" : hello.random_weights ? "warn" : "ok",
    [hello.variant, status, hello.random_weights ? "random weights" : null].filter(Boolean).join(" · "),
  );
  $("updated").textContent = `updated ${new Date(last.t * 1000).toLocaleTimeString("en-GB")} · every ${hello.sample_period_s} s`;

  const t = samples.map((s) => s.t);
  const col = (f) => samples.map(f);

  // time to first audio
  const q = last.ttfa;
  $("q50").innerHTML = ms(q.p50_ms);
  $("q95").innerHTML = ms(q.p95_ms);
  $("q99").innerHTML = ms(q.p99_ms);
  $("qn").textContent = String(q.n);
  line("ttfa", t, [
    { name: "p50", color: C.accent, values: col((s) => s.ttfa.p50_ms) },
    { name: "p95", color: C.blue, values: col((s) => s.ttfa.p95_ms) },
    { name: "p99", color: C.violet, values: col((s) => s.ttfa.p99_ms) },
  ], { unit: "ms" });
  $("now-ttfa-total").innerHTML = `${q.total}<small>turns total</small>`;
  histogram("hist", hello.ttfa_buckets_ms, q.hist);

  // engine
  $("now-decode").innerHTML = last.decode.mean_ms == null ? "idle" : `${last.decode.mean_ms.toFixed(1)}<small>ms mean</small>`;
  line("decode", t, [
    { name: "mean", color: C.accent, values: col((s) => s.decode.mean_ms) },
    { name: "p95", color: C.blue, values: col((s) => s.decode.p95_ms) },
  ], { unit: "ms" });
  $("now-slots").innerHTML = `${fmt(last.slots.in_use)}<small>of ${fmt(last.slots.max)} slots</small>`;
  line("slots", t, [
    { name: "in use (mean per step)", color: C.accent, values: col((s) => s.slots.mean), fill: true },
    { name: "max", color: C.danger, values: col((s) => s.slots.max), dashed: true },
  ], { min: 0 });
  // the engine makes audio in bursts (a chunk per segment and step): per 0.5 s sample the rate swings between 0
  // and several s/s, so it is shown as the mean over the last AUDIO_RATE_WINDOW_S
  const span = Math.max(1, Math.round(AUDIO_RATE_WINDOW_S / hello.sample_period_s));
  // the engine's audio split by who got it (as each chunk renders): live sessions, and jobs beside them
  const liveRate = rollingMean(col((s) => s.live_audio_per_s ?? s.audio_per_s), span);
  const jobRate = rollingMean(col((s) => (s.jobs ? s.jobs.audio_per_s : 0)), span);
  // (a mean of float deltas can come out a hair below zero: never show "-0.00")
  const rate = (values) => Math.max(0, values[values.length - 1]).toFixed(2);
  $("now-audio").innerHTML = `${rate(liveRate)}<small>s/s live</small> ${rate(jobRate)}<small>s/s jobs</small>`;
  line("audio", t, [
    { name: `live audio s per s (${AUDIO_RATE_WINDOW_S} s mean)`, color: C.accent, values: liveRate, fill: true },
    { name: "jobs", color: C.violet, values: jobRate },
  ], {});

  // sessions
  const sessionsNow = Object.values(last.sessions).reduce((a, b) => a + b, 0);
  $("now-sessions").innerHTML = `${sessionsNow}<small>sessions</small> ${last.contexts}<small>contexts</small>`;
  line("sessions", t, [
    { name: "sessions", color: C.blue, values: col((s) => Object.values(s.sessions).reduce((a, b) => a + b, 0)) },
    { name: "contexts", color: C.accent, values: col((s) => s.contexts) },
  ], { integer: true });
  $("now-waiting").innerHTML = `${fmt(last.waiting)}<small>waiting</small>`;
  line("waiting", t, [{ name: "segments waiting", color: C.warn, values: col((s) => s.waiting), fill: true }], { integer: true });
  $("now-busy").innerHTML = `${last.busy.total}<small>total</small>`;
  bars("busy", t, col((s) => s.busy.new), C.danger);
  // jobs: the fleet's queue (submitted, not claimed yet) and the jobs this replica renders
  const jobs = last.jobs || { queue: 0, running: 0 };
  $("now-jobs").innerHTML = `${jobs.running}<small>running</small> ${jobs.queue}<small>queued</small>`;
  line("jobs", t, [
    { name: "queued (fleet)", color: C.warn, values: col((s) => (s.jobs ? s.jobs.queue : 0)), fill: true },
    { name: "running here", color: C.accent, values: col((s) => (s.jobs ? s.jobs.running : 0)) },
  ], { integer: true });
  protocols(last);
  models(t, last);
}

const MODEL_COLORS = [C.accent, C.blue, C.violet, C.warn];

// each loaded model: its first-audio p95 over time, and a row of its figures now
function models(t, last) {
  const names = Object.keys(last.models || {}).sort();
  line("models", t, names.map((m, i) => ({
    name: m, color: MODEL_COLORS[i % MODEL_COLORS.length],
    values: samples.map((s) => (s.models && s.models[m] ? s.models[m].ttfa_p95_ms : null)),
  })), { unit: "ms" });
  $("models").innerHTML = names.map((m) => {
    const x = last.models[m];
    return `<tr><td>${m}</td><td>${ms(x.ttfa_p50_ms)}</td><td>${ms(x.ttfa_p95_ms)}</td><td>${x.ttfa_n}</td>` +
      `<td>${fmt(x.slots_in_use)} / ${fmt(x.max_slots)}</td><td>${fmt(x.waiting)}</td></tr>`;
  }).join("");
}

function ms(v) {
  return v == null ? "—" : `${v < 10 ? v.toFixed(1) : Math.round(v)}<small>ms</small>`;
}

function fmt(v) {
  return Number.isInteger(v) ? String(v) : v.toFixed(1);
}

function setup(name) {
  const canvas = document.querySelector(`canvas[data-chart="${name}"]`);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  return { g, w, h };
}

// The axis top: four equal steps of a round size (1, 2, 2.5 or 5 times a power of ten), so every tick reads
// round ("1k 2k 3k 4k", not "0.9k 1.9k 2.8k 3.8k"); whole steps for counts.
function niceMax(v, integer) {
  if (!(v > 0)) return integer ? 4 : 1;
  const need = v / 4;
  const p = Math.pow(10, Math.floor(Math.log10(need)));
  for (const m of [1, 2, 2.5, 5, 10]) {
    const step = m * p;
    if (step >= need && (!integer || Number.isInteger(step))) return 4 * step;
  }
  return 40 * p;
}

function label(v) {
  if (v >= 1000) return `${(v / 1000).toFixed(v % 1000 ? 1 : 0)}k`;
  return Number.isInteger(v) ? String(v) : v.toFixed(v < 1 ? 2 : 1);
}

function axes(g, w, h, top, unit, t0, t1) {
  const plotH = h - PAD.top - PAD.bottom;
  g.strokeStyle = C.grid;
  g.fillStyle = C.label;
  g.lineWidth = 1;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const y = Math.round(PAD.top + plotH - (i / 4) * plotH) + 0.5;
    g.beginPath();
    g.moveTo(PAD.left, y);
    g.lineTo(w - PAD.right, y);
    g.stroke();
    g.fillText(label((top * i) / 4) + (i === 4 && unit ? ` ${unit}` : ""), PAD.left - 6, y);
  }
  if (t1 > t0) {
    g.textAlign = "center";
    g.textBaseline = "top";
    const span = t1 - t0;
    const step = span > 90 ? 30 : span > 40 ? 15 : span > 16 ? 5 : 2;
    for (let ago = 0; ago <= span; ago += step) {
      const x = PAD.left + ((span - ago) / span) * (w - PAD.left - PAD.right);
      g.fillText(ago === 0 ? "now" : `-${ago}s`, Math.min(x, w - PAD.right - 10), h - PAD.bottom + 5);
    }
  }
}

function line(name, times, series, opts) {
  const { g, w, h } = setup(name);
  const t1 = times[times.length - 1];
  const t0 = Math.min(times[0], t1 - 10);
  let vmax = 0;
  for (const s of series) for (const v of s.values) if (v != null && v > vmax) vmax = v;
  const top = niceMax(vmax * 1.05, opts.integer);
  axes(g, w, h, top, opts.unit, t0, t1);
  const plotW = w - PAD.left - PAD.right;
  const plotH = h - PAD.top - PAD.bottom;
  const x = (t) => PAD.left + ((t - t0) / (t1 - t0)) * plotW;
  const y = (v) => PAD.top + plotH - (v / top) * plotH;
  let points = 0;
  for (const s of series) {
    g.strokeStyle = s.color;
    g.lineWidth = 2;
    g.setLineDash(s.dashed ? [5, 4] : []);
    let run = [];
    const flush = () => {
      if (!run.length) return;
      if (s.fill && run.length > 1) {
        g.fillStyle = s.color + "33";
        g.beginPath();
        g.moveTo(run[0][0], y(0));
        for (const [px, py] of run) g.lineTo(px, py);
        g.lineTo(run[run.length - 1][0], y(0));
        g.fill();
      }
      g.beginPath();
      run.forEach(([px, py], i) => (i ? g.lineTo(px, py) : g.moveTo(px, py)));
      if (run.length === 1) g.arc(run[0][0], run[0][1], 1.5, 0, 2 * Math.PI);
      g.stroke();
      run = [];
    };
    s.values.forEach((v, i) => {
      if (v == null) return flush();
      run.push([x(times[i]), y(v)]);
      points += 1;
    });
    flush();
  }
  g.setLineDash([]);
  legend(g, w, series);
  dash.drawn[name] = points;
}

function legend(g, w, series) {
  if (series.length < 2) return;
  g.textAlign = "right";
  g.textBaseline = "middle";
  let x = w - PAD.right;
  for (const s of [...series].reverse()) {
    const tw = g.measureText(s.name).width;
    g.fillStyle = C.label;
    g.fillText(s.name, x, 7);
    g.fillStyle = s.color;
    g.fillRect(x - tw - 14, 3, 9, 8);
    x -= tw + 26;
  }
}

function bars(name, times, values, color) {
  const { g, w, h } = setup(name);
  const t1 = times[times.length - 1];
  const t0 = Math.min(times[0], t1 - 10);
  const top = niceMax(Math.max(...values, 0), true);
  axes(g, w, h, top, "", t0, t1);
  const plotW = w - PAD.left - PAD.right;
  const plotH = h - PAD.top - PAD.bottom;
  const bw = Math.max(1, (plotW / Math.max(values.length, (t1 - t0) / (hello.sample_period_s || 1))) * 0.8);
  g.fillStyle = color;
  let drawn = 0;
  values.forEach((v, i) => {
    if (!v) return;
    const x = PAD.left + ((times[i] - t0) / (t1 - t0)) * plotW;
    const bh = (v / top) * plotH;
    g.fillRect(x - bw, PAD.top + plotH - bh, bw, bh);
    drawn += 1;
  });
  dash.drawn[name] = values.length; // an all-zero series is data too (no rejections)
  if (!drawn) {
    g.fillStyle = C.label;
    g.textAlign = "center";
    g.fillText("none", PAD.left + plotW / 2, PAD.top + plotH / 2);
  }
}

function histogram(name, boundsMs, counts) {
  const { g, w, h } = setup(name);
  const top = niceMax(Math.max(...counts, 0), true);
  axes(g, w, h, top, "", 0, 0);
  const plotW = w - PAD.left - PAD.right;
  const plotH = h - PAD.top - PAD.bottom;
  const n = counts.length;
  const slot = plotW / n;
  g.textAlign = "center";
  g.textBaseline = "top";
  counts.forEach((c, i) => {
    const x = PAD.left + i * slot;
    const bh = (c / top) * plotH;
    const slow = i > 0 && boundsMs[i - 1] >= 300;
    g.fillStyle = slow ? C.warn : C.accent;
    if (c) g.fillRect(x + 2, h - PAD.bottom - bh, slot - 4, bh);
    if (i % 2 === 0 || slot > 34) {
      g.fillStyle = C.label;
      const b = i < boundsMs.length ? boundsMs[i] : null;
      const text = b === null ? ">2s" : b >= 1000 ? `${b / 1000}s` : `${b}`;
      g.fillText(text, x + slot / 2, h - PAD.bottom + 5);
    }
  });
  g.fillStyle = C.label;
  g.textAlign = "left";
  g.textBaseline = "top";
  g.fillText("upper bound (ms)", PAD.left + 4, 2);
  dash.drawn[name] = counts.reduce((a, b) => a + b, 0);
}

function protocols(last) {
  const names = new Set([...Object.keys(last.sessions), ...Object.keys(last.opened), ...Object.keys(last.closed)]);
  $("protocols").innerHTML = [...names].sort().map((p) =>
    `<tr><td>${p}</td><td>${last.sessions[p] ?? 0}</td><td>${last.opened[p] ?? 0}</td><td>${last.closed[p] ?? 0}</td></tr>`,
  ).join("");
}

window.addEventListener("resize", () => (dirty = true));
connect();
requestAnimationFrame(frame);
