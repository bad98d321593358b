"""The engine's public vocabulary: what callers submit and what they get back.

Everything here is plain data, safe to create on any thread. The engine thread is the only one that
turns these into tensors; callers only ever see `numpy` PCM and these dataclasses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

Variant = Literal["english", "turbo", "multilingual"]
# The languages the multilingual checkpoint speaks, ISO 639-1 code -> English name (equal to
# chatterbox.mtl_tts.SUPPORTED_LANGUAGES, tests/synth/test_api.py); the other variants speak English.
LANGUAGE_NAMES: Mapping[str, str] = {
    "ar": "Arabic", "da": "Danish", "de": "German", "el": "Greek", "en": "English", "es": "Spanish",
    "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "ms": "Malay", "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese",
    "ru": "Russian", "sv": "Swedish", "sw": "Swahili", "tr": "Turkish", "zh": "Chinese",
}
MULTILINGUAL_LANGUAGES: tuple[str, ...] = tuple(LANGUAGE_NAMES)


def languages_of(variant: Variant) -> tuple[str, ...]:
    return MULTILINGUAL_LANGUAGES if variant == "multilingual" else ("en",)
VARIANTS: tuple[Variant, ...] = ("english", "turbo", "multilingual")

OUTPUT_SAMPLE_RATE_HZ = 24_000  # S3Gen renders 24 kHz mono
SAMPLES_PER_SPEECH_TOKEN = 960  # 25 speech tokens/s -> 50 mel frames/s -> 960 samples per token at 24 kHz
HARD_MAX_NEW_TOKENS = 1000  # the reference's own cap (40 s of speech)
MAX_SEGMENT_TEXT_TOKENS = 320  # text tokens a derived KV length leaves room for (the segmenter cuts at ~250 chars)
CACHED_REASON = "cached"  # SegmentEvent.reason of a segment replayed from a cache instead of generated


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-segment sampling and conditioning settings, in the reference's meaning.

    Fields a variant does not use are ignored by it (Turbo has no CFG, min_p or exaggeration;
    English and Multilingual have no top_k), exactly as chatterbox's own `generate()` ignores them.
    """

    temperature: float = 0.8
    top_p: float = 1.0
    min_p: float = 0.05
    top_k: int = 1000
    repetition_penalty: float = 1.2
    cfg_weight: float = 0.5
    exaggeration: float = 0.5
    # None: derived from the text length (see `max_tokens_for_text`), never above HARD_MAX_NEW_TOKENS.
    max_new_tokens: int | None = None
    # None: the engine draws one. With a seed, the tokens and the audio do not depend on what else runs.
    seed: int | None = None

    @staticmethod
    def defaults(variant: Variant) -> SamplingParams:
        if variant == "turbo":
            return SamplingParams(top_p=0.95, min_p=0.0, cfg_weight=0.0, exaggeration=0.0)
        if variant == "multilingual":
            return SamplingParams(repetition_penalty=2.0)
        return SamplingParams()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not (self.temperature > 0.0):
            raise ValueError("temperature must be > 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not (self.repetition_penalty > 0.0):
            raise ValueError("repetition_penalty must be > 0")
        if not (0.0 <= self.cfg_weight <= 10.0):
            raise ValueError("cfg_weight must be in [0, 10]")
        if not (0.0 <= self.exaggeration <= 2.0):
            raise ValueError("exaggeration must be in [0, 2]")
        if self.max_new_tokens is not None and not (1 <= self.max_new_tokens <= HARD_MAX_NEW_TOKENS):
            raise ValueError(f"max_new_tokens must be in [1, {HARD_MAX_NEW_TOKENS}]")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError("seed must be in [0, 2**63)")


def max_tokens_for_text(text: str) -> int:
    """Generation bound derived from the text: generous for real speech, always finite.

    Real speech runs at about 12-16 characters per second, i.e. 1.5-2 speech tokens per character; a
    model that never says EOS (random weights do not) stops at 4 tokens per character plus a margin.
    """
    return min(HARD_MAX_NEW_TOKENS, 25 + 4 * len(text))


class EventKind(enum.IntEnum):
    """What happened to a segment. Order matters: everything >= DONE is terminal."""

    STARTED = 0  # admitted into a slot, prefill done
    GENERATED = 1  # T3 finished (EOS or limit); audio may still be coming
    DONE = 10  # last audio chunk delivered
    CANCELLED = 11
    BUSY = 12  # refused: no free slot and the request asked not to wait (or the wait queue is full)
    FAILED = 13


class Priority(enum.IntEnum):
    """Who a segment serves. Order matters: a lower value is always admitted first."""

    LIVE = 0  # a caller is listening
    JOB = 1  # a long text behind 202 Accepted: only rows no live segment wants


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """A piece of a segment's waveform: float32 mono at OUTPUT_SAMPLE_RATE_HZ."""

    request_id: str
    seq: int  # 0, 1, 2 ... per segment
    pcm: npt.NDArray[np.float32]  # [samples] float32
    speech_tokens: int  # valid speech tokens this chunk renders (samples == 960 * speech_tokens)
    ready_monotonic_s: float  # time.monotonic() when the engine handed it out


@dataclass(frozen=True, slots=True)
class SegmentEvent:
    request_id: str
    kind: EventKind
    at_monotonic_s: float
    # GENERATED / DONE: number of valid speech tokens (ids < 6561) the segment produced.
    speech_tokens: int = 0
    # GENERATED: every id T3 sampled, EOS included (for tests and debugging).
    token_ids: tuple[int, ...] = ()
    reason: str = ""  # BUSY / FAILED / CANCELLED / GENERATED: why ("eos", "max_tokens", ...)


EngineOutput = AudioChunk | SegmentEvent
Sink = Callable[[EngineOutput], None]


class ListenerClock:
    """How much audio a stream's listener holds: the session writes it (any thread), the engine reads it.

    The session reports the audio it has sent so far and when its listener started playing (its first frame);
    the listener is taken to play in real time from then, so at time t it holds `sent - (t - started)` seconds
    (negative: it has run dry that long). The engine's vocoder renders the streams about to run dry first and
    sizes chunks by what the listener holds. One clock per context: every segment of a turn shares it, so a
    segment that starts while the previous one is still playing sees that audio. A report is one reference
    swap (atomic in CPython): no lock.

    `speed`: the listener plays the engine's audio that much faster (the session's speed setting); reports are in
    seconds as played, `buffered_s` in seconds of the engine's audio (what the vocoder's chunk sizes are in).
    """

    __slots__ = ("_report", "speed")

    def __init__(self, speed: float = 1.0) -> None:
        self._report: tuple[float, float] | None = None  # (sent_audio_s, started_monotonic_s)
        self.speed = speed

    def report(self, sent_audio_s: float, started_monotonic_s: float) -> None:
        self._report = (sent_audio_s, started_monotonic_s)

    def buffered_s(self, now_monotonic_s: float) -> float | None:
        """Seconds of the engine's audio the listener holds at `now` (None: nothing reported yet)."""
        report = self._report
        if report is None:
            return None
        sent_audio_s, started_monotonic_s = report
        return (sent_audio_s - (now_monotonic_s - started_monotonic_s)) * self.speed


@dataclass(slots=True)
class SegmentRequest:
    """One speakable piece of text to turn into audio. Each is its own T3 generation."""

    request_id: str  # unique among live requests
    text: str
    # called on the engine or vocoder thread, under the engine's emit lock: must not block (hand the output on, e.g.
    # loop.call_soon_threadsafe) nor call the engine (that raises SinkReentryError: synth/outlet.py)
    sink: Sink
    voice_id: str = "default"
    params: SamplingParams = field(default_factory=SamplingParams)
    language: str | None = None  # multilingual only, e.g. "fr"
    # Requests of a session that has not heard anything yet are admitted first (that is TTFB).
    first_audio_pending: bool = True
    # False: answer BUSY at once when no slot is free. True: wait in the (bounded) admission queue.
    may_wait: bool = True
    # JOB: admitted only into rows no LIVE segment waits for, and preempted (its rows taken back, its generation
    # restarted from scratch later, the same ids when seeded) when a LIVE segment needs them. A preempted attempt
    # leaves no trace: a JOB segment's ids reach the vocoder, and its STARTED event the sink, only once its generation
    # has ended, so its sink hears STARTED, GENERATED, the audio, DONE exactly once whatever was preempted meanwhile
    # (synth/scheduler.py).
    priority: Priority = Priority.LIVE
    submitted_monotonic_s: float = 0.0
    # The listener's playback (shared by the segments of one context), read by the vocoder's chunk policy.
    listener: ListenerClock | None = None
    model: Variant | None = None  # which loaded model speaks it (None: the default model)


# CPU threads: the decode thread and the vocoder worker each run their own OpenMP team (synth/cpu_threads.py
# says why they must not add up to more threads than cores).
EVENT_LOOP_RESERVE_FROM_CORES = 4


@dataclass(frozen=True, slots=True)
class ThreadBudget:
    decode: int  # OpenMP/MKL threads of the engine's decode thread
    vocoder: int  # of the vocoder worker

    @staticmethod
    def split(cores: int) -> ThreadBudget:
        """The automatic split of `cores` CPUs."""
        usable = max(1, cores - (1 if cores >= EVENT_LOOP_RESERVE_FROM_CORES else 0))
        decode = max(1, usable // 2)
        return ThreadBudget(decode=decode, vocoder=max(1, usable - decode))

    @staticmethod
    def resolve(decode: int, vocoder: int, cores: int) -> ThreadBudget:
        """Explicit counts where given (> 0), the automatic split of `cores` CPUs for the rest."""
        if decode < 0 or vocoder < 0:
            raise ValueError("thread counts must be >= 0 (0: automatic)")
        auto = ThreadBudget.split(cores)
        return ThreadBudget(decode=decode or auto.decode, vocoder=vocoder or auto.vocoder)

    @staticmethod
    def parse(spec: str) -> tuple[int, int]:
        """'auto' -> (0, 0); 'N' -> the split of N cores; 'D,V' -> (D, V). Raises ValueError."""
        text = spec.strip().lower()
        if text == "auto":
            return 0, 0
        parts = [p.strip() for p in text.split(",")]
        try:
            counts = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"threads must be 'auto', N or D,V (got {spec!r})") from None
        if len(counts) == 1 and counts[0] >= 1:
            budget = ThreadBudget.split(counts[0])
            return budget.decode, budget.vocoder
        if len(counts) == 2 and min(counts) >= 1:
            return counts[0], counts[1]
        raise ValueError(f"threads must be 'auto', N >= 1 or D,V >= 1 (got {spec!r})")


class EngineError(RuntimeError):
    """Raised to callers for requests the engine cannot take (unknown voice, bad params, stopped)."""


class EngineConfigError(EngineError):
    """The engine cannot be built with this configuration on this machine (slots that do not fit the memory, with
    the numbers): no restart fixes it, so the server exits as for a bad flag (models-contract.md)."""


class EngineFull(EngineError):
    """A submit refused because the engine's inbox is full (its thread is behind): try again later. Nothing of
    the request was taken."""


@dataclass(frozen=True, slots=True)
class StepStats:
    """One model's batch in one engine iteration: an engine with several models records one per model per step
    (`model` names it; the other fields are that model's), so a consumer counting steps counts one model's."""

    at_monotonic_s: float
    decode_rows: int  # T3 rows in the decode batch (CFG sessions count 2)
    active_segments: int  # segments holding a slot
    max_slots: int
    waiting_segments: int  # admitted-later queue depth
    decode_ms: float
    prefill_ms: float
    prefill_segments: int
    vocoder_ms: float
    audio_s: float  # seconds of audio emitted this step
    preempted: int  # job segments whose rows this step took back for live ones (Priority)
    model: Variant  # the model whose batch this is
    job_rows_paused: int = 0  # job rows that sat out this step for a live turn's first ids (SchedulerConfig)
    job_steps_withdrawn: int = 0  # 1: a jobs-only step stopped mid-step for a live turn (Scheduler.withdraw)
    job_audio_s: float = 0.0  # of audio_s, the seconds job segments emitted (the rest is live)
    renders_only: bool = False  # no step: the vocoder's renders while T3 was idle (not an engine iteration)


class EngineLike:
    """What agent_server relies on. `synth.engine.Engine` implements it; tests may fake it.

    Every method is thread-safe and returns at once (none waits for the GPU).
    """

    variant: Variant  # the default model
    random_weights: bool  # True when the model runs on randomly initialised weights (audio is noise)
    max_slots: int  # every model's together

    @property
    def models(self) -> tuple[Variant, ...]:
        """The loaded models, the default first."""
        return (self.variant,)

    def max_slots_of(self, model: Variant) -> int:
        return self.max_slots if model == self.variant else 0

    def submit(self, request: SegmentRequest) -> None:
        """Queue a segment. Raises EngineError (unknown voice, bad params, engine stopped), EngineFull when the
        inbox holds as many items as it may."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """Stop a segment: no chunk of it reaches the sink after this returns; its slot is free next step."""
        raise NotImplementedError

    def voice_ids(self) -> list[str]:
        raise NotImplementedError

    def add_voice(self, voice_id: str, wav: npt.NDArray[np.float32], sample_rate_hz: int) -> None:
        """Compute a voice's conditioning from a reference clip (>= 5 s) on the caller's thread. Slow."""
        raise NotImplementedError

    def remove_voice(self, voice_id: str) -> None:
        """Forget a voice; segments already using it keep their own reference."""
        raise NotImplementedError

    def export_voice(self, voice_id: str, model: Variant | None = None) -> bytes:
        """A voice's computed conditioning for `model` (None: the default) as bytes, for another process of the
        same weights (`import_voice`). Raises EngineError for an unknown voice."""
        raise NotImplementedError

    def import_voice(self, voice_id: str, conditioning: bytes, model: Variant | None = None) -> None:
        """Add (or replace) a voice from `export_voice`'s bytes, without running the voice encoders.
        Raises EngineError on bytes it cannot use."""
        raise NotImplementedError

    def status(self) -> dict[str, object]:
        """JSON-able snapshot: variant, random_weights, weights_source, device, dtype, max_slots,
        slots_in_use, waiting, steps."""
        raise NotImplementedError

    def set_stats_listener(self, listener: Callable[[StepStats], None] | None) -> None:
        """Called on the engine thread once per step; must be cheap and never block."""
        raise NotImplementedError

    def start(self) -> None:
        """Start the engine thread and warm up; `ready` turns True when done."""
        raise NotImplementedError

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; pending segments get a CANCELLED event (reason "shutdown")."""
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        """Models loaded, warmed up, step loop running."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """False once the engine thread has died (the server must turn not-ready)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ModelOverrides:
    """One model's own values where it differs from the engine-wide ones (None: the engine-wide value)."""

    max_slots: int | None = None  # 0: auto from free memory
    weights: str | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    variant: Variant = "english"
    # The models to load, the default first (empty: `variant` alone); each its own runner, cache and vocoder.
    models: tuple[Variant, ...] = ()
    per_model: Mapping[Variant, ModelOverrides] = field(default_factory=dict)
    # "auto": a local checkpoint if one is found (AGENT_SERVER_CHECKPOINT dir or the Hugging Face cache), else a hub
    # download, else random weights (with a loud warning). "random-tiny" / "random-full": random weights of the real
    # architecture at test / true size. Anything else: a local checkpoint directory in chatterbox's file layout.
    weights: str = "auto"
    device: str = "auto"  # "auto" -> cuda if available else cpu
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16" (T3; S3Gen stays float32 on CPU)
    # CPU only, with dtype float32: "bf16" stores T3's projection weights as bfloat16 (rounded once, in place) and
    # runs them in fp32 on those exact values: half the bytes per decode step, so one segment decodes ~2-3x faster
    # (BENCHMARKS.md). Lossy only in that rounding (an fp32 checkpoint's weights move by <= 2^-9 relative).
    cpu_weights: str = "fp32"  # "fp32" | "bf16"
    # CPU only, S3Gen in float32: "bf16" runs the vocoder's linear layers and convolutions as bfloat16 products
    # with float32 results (synth/invariant_ops.Kernels), about 2x the render throughput on a CPU with
    # AVX512-BF16 or AMX (BENCHMARKS.md, issue 15). The audio moves by bf16 rounding (~1e-2 relative); seeded
    # streams still give the same bits alone or batched.
    cpu_vocoder: str = "fp32"  # "fp32" | "bf16"
    # concurrent segments in the T3 batch (KV cache rows are allocated for this many once). 0: "auto", as many as
    # the free device memory holds beside the vocoder's graphs, the prefix pool and headroom (synth/gpu.py; 16 on
    # a CPU without memory_budget_gb). A count that does not fit the budget is refused at construction.
    max_slots: int = 16
    # The memory budget for slots, in GB (0: the device's free memory once the models are loaded; a CPU: no check).
    memory_budget_gb: float = 0.0
    max_waiting: int = 256  # admission queue bound; beyond it submit answers BUSY
    # KV positions per row after the voice's conditioning (text + BOS block + speech; each row also holds a copy
    # of its conditioning prefix, which is added to this).
    # 0: enough for the longest segment the server cuts (MAX_SEGMENT_TEXT_TOKENS) plus HARD_MAX_NEW_TOKENS.
    max_context_tokens: int = 0
    # The decode step and sampling captured as CUDA graphs per row / key bucket at start-up and replayed:
    # "auto" (on with a CUDA device), "on" (a CUDA device is required), "off" (eager, as on a CPU). With "auto" a
    # capture that fails, or a replay that differs from eager at start-up, means eager (the reason in status());
    # with "on" the engine refuses to start.
    cuda_graphs: str = "auto"
    # The vocoder's three batched functions (encoder, estimator step, HiFT) replayed as CUDA graphs, one per input
    # signature (batch padded to a power of two, length bucket), each captured the first time it is met
    # (synth/render_graphs.py): "auto" (on with a CUDA device; eager after a failure at start-up), "on" (a CUDA
    # device is required), "off" (eager). Off by default until a GPU figure shows it pays.
    vocoder_graphs: str = "off"
    # TF32 for the vocoder's float32 matmuls on CUDA: "auto" (when T3 is not float32: torch's switch is process-wide),
    # "on", "off" (synth/gpu.use_vocoder_tf32).
    vocoder_tf32: str = "auto"
    # Launch step k+1 before reading step k's ids, so that the host's work on them overlaps the device's:
    # "auto" (on with the decode's CUDA graphs), "on", "off". Never with the alignment analyzer.
    overlap_steps: str = "auto"
    # CPU, fp32 with the C attention kernel: a step decodes only the rows its plan names (T3Runner.compact_rows), so
    # job rows can sit out a live turn's first ids. False: every row of the bucket, as a GPU step (tests run it).
    compact_steps: bool = True
    first_chunk_tokens: int = 12
    # Chunks after the first: for seeded requests (reproducible audio) this fixed schedule; otherwise sized by the
    # audio the listener holds, between first_chunk_tokens and the schedule's largest (synth/vocoder_worker.py).
    chunk_schedule_tokens: tuple[int, ...] = (24, 48, 96)
    prefill_budget_segments: int = 4  # prefills per iteration, so decode of running segments keeps its pace
    alignment_analyzer: bool = False  # multilingual only
    seed: int | None = None  # seeds segments that bring none (None: from os.urandom)
    # CPU threads of the decode thread and of the vocoder worker (0: automatic, synth/cpu_threads.py).
    decode_threads: int = 0
    vocoder_threads: int = 0
    # CPU: the decode thread's cores lent to the vocoder for a turn's first chunk and while the decode has no
    # work (synth/cpu_threads.CoreLease); off: each keeps its own count.
    lend_threads: bool = True
    # CPU, with lend_threads: decode steps also run on the vocoder's threads while it has nothing to render, where
    # that makes them faster on this machine (synth/cpu_threads.BorrowGain learns it from the steps)
    decode_borrows_threads: bool = True
    vocoder_max_batch: int = 0  # streams rendered in one vocoder tick at most (0: 4 on a CPU, 64 on a GPU)
