// Jitter-buffered player for streamed PCM: a ring buffer of float32 samples, played at the context's rate.
//
// Main thread -> worklet (port messages):
//   {type: "start", turn, prebufferSamples}  a new turn: clear, wait for `prebufferSamples` before playing
//   {type: "push", pcm: Float32Array}        more audio (transferred)
//   {type: "end"}                            no more audio for this turn: play out what is left
//   {type: "stop"}                           barge-in: drop everything at once
// Worklet -> main thread:
//   {type: "playing", turn}                  the turn's first sample went out
//   {type: "underrun", turn, buffered}       the buffer ran dry before the turn's end (re-buffering now)
//   {type: "resumed", turn}                  playing again after an underrun
//   {type: "drained", turn}                  everything of an ended turn was played
//   {type: "stats", turn, played, turnPlayed, buffered, underruns}  every STATS_EVERY_S while playing

const STATS_EVERY_S = 0.05;

class JitterPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const seconds = (options.processorOptions && options.processorOptions.capacitySeconds) || 120;
    this.ring = new Float32Array(Math.ceil(seconds * sampleRate));
    this.readPos = 0;
    this.writePos = 0;
    this.buffered = 0;
    this.turn = null;
    this.prebuffer = 0;
    this.buffering = true; // waiting for the prebuffer (at a turn's start, and after an underrun)
    this.ended = false;
    this.started = false;
    this.played = 0; // all turns together
    this.turnPlayed = 0;
    this.underruns = 0;
    this.lastStatsAt = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "push") {
      this.write(msg.pcm);
    } else if (msg.type === "start") {
      this.clear();
      this.turn = msg.turn;
      this.prebuffer = msg.prebufferSamples | 0;
      this.turnPlayed = 0;
      this.started = false;
      this.ended = false;
    } else if (msg.type === "end") {
      this.ended = true;
    } else if (msg.type === "stop") {
      this.clear();
      this.ended = false;
      this.sendStats();
    }
  }

  clear() {
    this.readPos = this.writePos = this.buffered = 0;
    this.buffering = true;
  }

  write(pcm) {
    const ring = this.ring;
    let n = pcm.length;
    if (n > ring.length - this.buffered) n = ring.length - this.buffered; // full: drop the excess
    const first = Math.min(n, ring.length - this.writePos);
    ring.set(pcm.subarray(0, first), this.writePos);
    if (n > first) ring.set(pcm.subarray(first, n), 0);
    this.writePos = (this.writePos + n) % ring.length;
    this.buffered += n;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (this.buffering) {
      if (this.buffered > 0 && (this.buffered >= this.prebuffer || this.ended)) {
        this.buffering = false;
        if (this.started) this.port.postMessage({ type: "resumed", turn: this.turn }); // after an underrun
      } else if (this.ended) {
        this.finishTurn(); // ended with nothing (more) to play
      }
    }
    let n = 0;
    if (!this.buffering) {
      n = Math.min(out.length, this.buffered);
      const ring = this.ring;
      const first = Math.min(n, ring.length - this.readPos);
      out.set(ring.subarray(this.readPos, this.readPos + first), 0);
      if (n > first) out.set(ring.subarray(0, n - first), first);
      this.readPos = (this.readPos + n) % ring.length;
      this.buffered -= n;
      if (n > 0 && !this.started) {
        this.started = true;
        this.port.postMessage({ type: "playing", turn: this.turn });
      }
      this.played += n;
      this.turnPlayed += n;
      if (n < out.length) {
        // ran dry inside this quantum: the turn is over, or the network / engine fell behind
        this.buffering = true;
        if (this.ended) {
          this.finishTurn();
        } else {
          this.underruns += 1;
          this.port.postMessage({ type: "underrun", turn: this.turn, buffered: this.buffered });
        }
      }
    }
    out.fill(0, n); // silence for the rest of the quantum
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (n > 0 && currentTime - this.lastStatsAt >= STATS_EVERY_S) this.sendStats();
    return true;
  }

  finishTurn() {
    this.ended = false;
    this.port.postMessage({ type: "drained", turn: this.turn });
    this.sendStats();
  }

  sendStats() {
    this.lastStatsAt = currentTime;
    this.port.postMessage({
      type: "stats",
      turn: this.turn,
      played: this.played,
      turnPlayed: this.turnPlayed,
      buffered: this.buffered,
      underruns: this.underruns,
    });
  }
}

registerProcessor("jitter-player", JitterPlayer);
