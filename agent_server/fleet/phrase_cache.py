"""Phrase cache: a segment's audio rendered once, replayed for every identical request after it.

Voice agents say the same things all day ("One moment, please.", greetings, confirmations). A segment's
audio is a pure function of what shapes it, so the cache keys each *segment* by a hash of exactly that
(`phrase_key`): the normalised text, the serving model, its weights' identity, the voice id and version, every
sampling parameter, the seed and the language. The value is the segment's native PCM (24 kHz float32, as the
engine made it: any output format is encoded per request, by the same encoder as engine audio).

What is cached (docs/protocol.md):
- a segment of a *seeded* request: stored once the engine finished it, replayed for the same seed (the
  segment's own seed, `seed + index`) and everything else equal;
- the pre-warm list (`--prewarm FILE`, `Prewarm`): rendered at start-up and stored under the *unseeded* key
  too, so a request without a seed whose segment matches a pre-warmed phrase is served from the cache;
- nothing else (an unseeded request is never stored), and nothing for a request that opts out (native
  `"cache": false`).

Where (`PhraseCache`): an in-process LRU with a byte budget (pre-warmed entries are pinned), backed by Redis
when the server has one (`--cache-redis-url`, else `--redis-url`): entries there carry a TTL and the
instance should run `maxmemory-policy allkeys-lru` (deploy/), so another replica's render is a hit here.

How a hit is served (`CachedSource`): the hub gives each SpeechStream a `CachedSource` as the target of its
segments in place of the engine (`hub.open_stream`, under the session core: every protocol gets it); a hit
is replayed through the segment's own sink as STARTED (reason "cached"), one AudioChunk, GENERATED and DONE,
so it takes the very path of engine audio (same encoder and framing, same metrics) and its first frame goes
out at once. A miss is handed to the engine with a sink that also records the audio, stored when the segment
is DONE (never a cancelled or failed one).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import struct
import time
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import structlog
from redis.exceptions import RedisError

from synth.api import (
    CACHED_REASON,
    SAMPLES_PER_SPEECH_TOKEN,
    AudioChunk,
    EngineError,
    EngineFull,
    EngineLike,
    EngineOutput,
    EventKind,
    SamplingParams,
    SegmentEvent,
    SegmentRequest,
)

log = structlog.get_logger("agent_server.phrase_cache")

Pcm = npt.NDArray[np.float32]

KEY_VERSION = 1  # bump when what the key covers changes: old entries then simply miss
VALUE_MAGIC = b"PHC1"
VALUE_HEADER = struct.Struct("<4sII")  # magic, speech tokens, samples; then float32 little-endian samples
REMOTE_TIMEOUT_S = 0.1  # a remote lookup slower than this counts as a miss (the engine starts instead)
REMOTE_RETRY_S = 1.0  # after a remote failure, the remote tier is skipped for this long
MAX_REMOTE_WRITES = 16  # stores in flight to Redis at once; more are dropped (counted), never queued
MIB = 1024 * 1024
WEIGHT_FILE_SUFFIXES = (".safetensors", ".pt", ".json", ".bin")
WEIGHT_FILE_SAMPLE_BYTES = 1 * MIB  # identity of a checkpoint file: its name, size, first and last MiB


def normalise_text(text: str) -> str:
    """NFC, runs of whitespace as one space, no leading or trailing space: a strict subset of what the
    engine's own text normaliser erases, so two texts that normalise alike always sound alike."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def phrase_key(
    text: str,
    *,
    model: str,
    weights_id: str,
    voice_id: str,
    voice_version: str,
    params: SamplingParams,
    language: str | None,
) -> str:
    """The cache key of one segment: everything that shapes its audio, hashed."""
    fields = {
        "v": KEY_VERSION,
        "text": normalise_text(text),
        "variant": model,  # the model that speaks it (the name kept: a one-model server's keys stay the same)
        "weights": weights_id,
        "voice": voice_id,
        "voice_version": voice_version,
        "language": language or "",
        "params": dataclasses.asdict(params),
    }
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()


def weights_identity(engine_status: dict[str, object], variant: str) -> str:
    """What makes two replicas' audio for the same request the same: the model and how it runs.

    A checkpoint directory is identified by each weight file's name, size and first and last MiB (a
    changed checkpoint changes them; reading every byte of several GB at each start-up would not pay).
    """
    source = str(engine_status.get("weights_source") or "")
    parts: dict[str, object] = {
        "variant": variant,
        "source": source,
        "preset": engine_status.get("preset"),
        "dtype": engine_status.get("dtype"),
        "cpu_weights": engine_status.get("cpu_weights"),
        "cpu_vocoder": engine_status.get("cpu_vocoder", "fp32"),
        "decode_attention": engine_status.get("decode_attention", "torch"),  # the C kernel's logits' last bits differ
        "vocoder_graphs": engine_status.get("vocoder_graphs", "off"),  # padded batches: a GPU row's last bits move
        "device": str(engine_status.get("device") or "").split(":")[0],
    }
    directory = Path(source.split(":", 1)[1] if source.startswith("hf-cache:") else source)
    if source and directory.is_dir():
        parts["source"] = "checkpoint"  # the same files in another directory are the same weights
        parts["files"] = _files_fingerprint(directory)
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def _files_fingerprint(directory: Path) -> list[list[object]]:
    out: list[list[object]] = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.suffix not in WEIGHT_FILE_SUFFIXES:
            continue
        size = path.stat().st_size
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            digest.update(fh.read(WEIGHT_FILE_SAMPLE_BYTES))
            if size > 2 * WEIGHT_FILE_SAMPLE_BYTES:
                fh.seek(size - WEIGHT_FILE_SAMPLE_BYTES)
                digest.update(fh.read(WEIGHT_FILE_SAMPLE_BYTES))
        out.append([path.name, size, digest.hexdigest()])
    return out


# ---- values -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CachedAudio:
    pcm: Pcm  # [samples] float32 at 24 kHz, read-only
    speech_tokens: int

    @property
    def nbytes(self) -> int:
        return int(self.pcm.nbytes)

    def to_bytes(self) -> bytes:
        return VALUE_HEADER.pack(VALUE_MAGIC, self.speech_tokens, len(self.pcm)) + self.pcm.astype("<f4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> CachedAudio:
        """Raises ValueError on anything but a value of this format."""
        if len(data) < VALUE_HEADER.size:
            raise ValueError("phrase cache value too short")
        magic, speech_tokens, samples = VALUE_HEADER.unpack_from(data)
        if magic != VALUE_MAGIC or len(data) != VALUE_HEADER.size + 4 * samples:
            raise ValueError("not a phrase cache value")
        pcm = np.frombuffer(data, dtype="<f4", offset=VALUE_HEADER.size).astype(np.float32)
        pcm.setflags(write=False)
        return cls(pcm, speech_tokens)

    @classmethod
    def join(cls, pieces: list[Pcm], speech_tokens: int) -> CachedAudio:
        pcm = np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)
        pcm.setflags(write=False)
        return cls(pcm, speech_tokens)


@dataclass(slots=True)
class _Entry:
    audio: CachedAudio
    pinned: bool = False


@dataclass(slots=True)
class CacheStats:
    hits_local: int = 0
    hits_remote: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    remote_errors: int = 0
    remote_timeouts: int = 0
    remote_writes_dropped: int = 0


# ---- the remote tier (Redis) ----------------------------------------------------------------------


class RedisTier:
    """GET/SET of values with a TTL in Redis, failing fast: a tier that erred is skipped for REMOTE_RETRY_S."""

    def __init__(self, url: str, *, prefix: str, ttl_s: float) -> None:
        import redis.asyncio as aioredis

        self.ttl_s = ttl_s
        self.prefix = prefix + "phrase:"
        self.down_until_s = 0.0
        self.detail = "connected"
        self._redis: Any = aioredis.Redis.from_url(url, socket_timeout=REMOTE_TIMEOUT_S * 4,
                                                   socket_connect_timeout=REMOTE_TIMEOUT_S * 4)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until_s

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(self.prefix + key)
        return None if value is None else bytes(value)

    async def set(self, key: str, value: bytes) -> None:
        await self._redis.set(self.prefix + key, value, px=int(self.ttl_s * 1000))

    def failed(self, exc: BaseException) -> None:
        if self.available:
            log.warning("phrase_cache_remote_down", error=f"{type(exc).__name__}: {exc}"[:300])
        self.down_until_s = time.monotonic() + REMOTE_RETRY_S
        self.detail = f"{type(exc).__name__}: {exc}"[:200]

    async def close(self) -> None:
        await self._redis.aclose()


# ---- the cache ----------------------------------------------------------------------------------------


class PhraseCache:
    """In-process LRU (byte budget, pinned entries never evicted) over an optional remote tier. Loop thread."""

    def __init__(self, budget_bytes: int, remote: RedisTier | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.remote = remote
        self.stats = CacheStats()
        self.bytes = 0
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._writes: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    def get_local(self, key: str) -> CachedAudio | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.audio

    async def get_remote(self, key: str) -> CachedAudio | None:
        """The remote tier's value (kept locally from then on), or None: absent, slow, down or unreadable."""
        remote = self.remote
        if remote is None or not remote.available:
            return None
        try:
            async with asyncio.timeout(REMOTE_TIMEOUT_S):
                data = await remote.get(key)
        except TimeoutError:  # slow, not down: this lookup is a miss, the next one tries again
            self.stats.remote_timeouts += 1
            return None
        except (RedisError, OSError) as exc:  # down or refusing: skip the tier for a while
            self.stats.remote_errors += 1
            remote.failed(exc)
            return None
        if data is None:
            return None
        try:
            audio = CachedAudio.from_bytes(data)
        except ValueError:
            log.error("phrase_cache_value_unreadable", key=key)
            return None
        self._put_local(key, audio, pinned=False)
        return audio

    def put(self, key: str, audio: CachedAudio, *, pinned: bool = False, remote: bool = True) -> None:
        """Keep the value here, and (unless `remote` is False) write it to the remote tier in the background."""
        self._put_local(key, audio, pinned)
        self.stats.stores += 1
        if remote and self.remote is not None and self.remote.available:
            if len(self._writes) >= MAX_REMOTE_WRITES:
                self.stats.remote_writes_dropped += 1
                return
            task = asyncio.get_running_loop().create_task(self._write(self.remote, key, audio.to_bytes()))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    def pin(self, keys: Iterable[str], pinned: bool = True) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pinned = pinned
        if not pinned:
            self._evict()

    async def flush(self) -> None:
        """Wait for the remote writes in flight (tests, shutdown)."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    async def close(self) -> None:
        await self.flush()
        if self.remote is not None:
            await self.remote.close()

    def status_json(self) -> dict[str, object]:
        remote = self.remote
        return {
            "enabled": self.enabled,
            "entries": self.entries,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "remote": None if remote is None else {"available": remote.available, "detail": remote.detail,
                                                   "ttl_s": remote.ttl_s},
            **dataclasses.asdict(self.stats),
        }

    # ---- internals ---------------------------------------------------------------------------------

    def _put_local(self, key: str, audio: CachedAudio, pinned: bool) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.audio.nbytes
            pinned = pinned or old.pinned
        self._entries[key] = _Entry(audio, pinned)
        self.bytes += audio.nbytes
        self._evict()

    def _evict(self) -> None:
        if self.bytes <= self.budget_bytes:
            return
        for key in [k for k, e in self._entries.items() if not e.pinned]:  # oldest first
            if self.bytes <= self.budget_bytes:
                break
            entry = self._entries.pop(key)
            self.bytes -= entry.audio.nbytes
            self.stats.evictions += 1

    async def _write(self, remote: RedisTier, key: str, value: bytes) -> None:
        try:
            await remote.set(key, value)
        except (RedisError, OSError) as exc:
            self.stats.remote_errors += 1
            remote.failed(exc)


# ---- what a stream submits to ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CachePolicy:
    lookup: bool = True  # look a segment up before the engine renders it
    store_seeded: bool = True  # store a seeded segment under its seeded key
    store_unseeded: bool = False  # store under the unseeded key too (the pre-warm list)


NO_CACHE = CachePolicy(lookup=False, store_seeded=False)
PREWARM = CachePolicy(lookup=True, store_seeded=True, store_unseeded=True)


@dataclass(frozen=True, slots=True)
class KeyContext:
    """What, besides the request, shapes a stream's audio."""

    model: str  # the loaded model that speaks the stream (every model keys apart)
    weights_id: str  # that model's
    voice_id: str
    voice_version: str  # of that model's conditioning
    language: str | None

    def key(self, text: str, params: SamplingParams) -> str:
        return phrase_key(text, model=self.model, weights_id=self.weights_id, voice_id=self.voice_id,
                          voice_version=self.voice_version, params=params, language=self.language)


@dataclass(slots=True)
class _Recording:
    """A forwarded segment's audio as the engine emits it (appended on the engine thread until DONE)."""

    keys: list[str]
    pins: bool
    pieces: list[Pcm] = field(default_factory=list)
    speech_tokens: int = 0


class CachedSource:
    """A SpeechStream's segment target (speech.SegmentTarget: submit / cancel) that serves cached segments
    and hands the rest to the engine, recording their audio.

    Loop thread, like the stream. `post` hands a callable to the loop (the engine thread records, the loop
    stores)."""

    def __init__(self, engine: EngineLike, cache: PhraseCache, context: KeyContext, policy: CachePolicy,
                 post: Callable[..., object], *, pin: bool = False) -> None:
        self.engine = engine
        self.cache = cache
        self.context = context
        self.policy = policy
        self.pin = pin  # pre-warm: keep what is stored in memory for good
        self.stored_keys: list[str] = []  # every key this source stored (pre-warm pins and reloads them)
        self.hits = 0
        self._post = post
        # request id -> its remote lookup while one is in flight, None once it went to the engine (a segment
        # replayed from the cache is not in it: there is nothing to cancel)
        self._open: dict[str, asyncio.Task[None] | None] = {}

    # ---- the verbs a SpeechStream uses -----------------------------------------------------------------

    def submit(self, request: SegmentRequest) -> None:
        if not self.policy.lookup or not self.cache.enabled:
            self._forward(request)
            return
        key = self._lookup_key(request)
        audio = self.cache.get_local(key)
        if audio is not None:
            self.cache.stats.hits_local += 1
            self._replay(request, audio, key)
            return
        remote = self.cache.remote
        if remote is None or not remote.available:
            self.cache.stats.misses += 1
            self._forward(request)
            return
        self._open[request.request_id] = asyncio.get_running_loop().create_task(self._look_remote(request, key))

    def cancel(self, request_id: str) -> None:
        if request_id not in self._open:
            return  # replayed, or unknown
        lookup = self._open.pop(request_id)
        if lookup is not None:
            lookup.cancel()  # the lookup never forwards it now
        else:
            self.engine.cancel(request_id)

    # ---- internals ---------------------------------------------------------------------------------

    def _lookup_key(self, request: SegmentRequest) -> str:
        return self.context.key(request.text, request.params)

    def _store_keys(self, request: SegmentRequest) -> list[str]:
        keys = []
        if self.policy.store_seeded and request.params.seed is not None:
            keys.append(self.context.key(request.text, request.params))
        if self.policy.store_unseeded:
            keys.append(self.context.key(request.text, dataclasses.replace(request.params, seed=None)))
        return keys

    async def _look_remote(self, request: SegmentRequest, key: str) -> None:
        audio = await self.cache.get_remote(key)  # (cancelled by `cancel`, which forgot the request)
        if audio is not None:
            del self._open[request.request_id]
            self.cache.stats.hits_remote += 1
            self._replay(request, audio, key)
            return
        self.cache.stats.misses += 1
        try:
            self._forward(request)
        except EngineFull as exc:  # the stream's submit returned long ago: busy through its sink, as a submit would be
            request.sink(SegmentEvent(request.request_id, EventKind.BUSY, time.monotonic(), reason=str(exc)))
        except EngineError as exc:  # ... and a refusal, failed through it
            request.sink(SegmentEvent(request.request_id, EventKind.FAILED, time.monotonic(), reason=str(exc)))

    def _replay(self, request: SegmentRequest, audio: CachedAudio, key: str) -> None:
        self.hits += 1
        extra = [k for k in self._store_keys(request) if k != key]
        for other in extra:  # a pre-warm hit under one key: make sure the others exist too
            self.cache.put(other, audio, pinned=self.pin)
        self.stored_keys.extend([key, *extra])
        if self.pin:
            self.cache.pin([key])
        rid, sink, now_s = request.request_id, request.sink, time.monotonic()
        tokens = audio.speech_tokens
        sink(SegmentEvent(rid, EventKind.STARTED, now_s, reason=CACHED_REASON))
        if len(audio.pcm):
            sink(AudioChunk(rid, 0, audio.pcm, tokens, now_s))
        sink(SegmentEvent(rid, EventKind.GENERATED, now_s, speech_tokens=tokens, reason=CACHED_REASON))
        sink(SegmentEvent(rid, EventKind.DONE, now_s, speech_tokens=tokens, reason=CACHED_REASON))

    def _forward(self, request: SegmentRequest) -> None:
        keys = self._store_keys(request) if self.cache.enabled else []
        if keys:
            request = dataclasses.replace(request, sink=self._recording_sink(request, _Recording(keys, self.pin)))
        self._open[request.request_id] = None  # (before submit: a synchronous engine may call back into cancel)
        try:
            self.engine.submit(request)  # raises EngineError: the stream fails the segment
        except BaseException:
            del self._open[request.request_id]
            raise

    def _recording_sink(self, request: SegmentRequest, recording: _Recording) -> Callable[[EngineOutput], None]:
        sink, post, store = request.sink, self._post, self._store

        def record_then_pass(out: EngineOutput) -> None:  # engine thread
            if isinstance(out, AudioChunk):
                recording.pieces.append(out.pcm)
                recording.speech_tokens += out.speech_tokens
            elif out.kind == EventKind.STARTED:  # (again: the engine took a job segment's row back, it starts over)
                recording.pieces.clear()
                recording.speech_tokens = 0
            elif out.kind == EventKind.DONE:
                try:
                    post(store, recording)
                except RuntimeError:  # the loop is closed
                    pass
            sink(out)

        return record_then_pass

    def _store(self, recording: _Recording) -> None:
        audio = CachedAudio.join(recording.pieces, recording.speech_tokens)
        if len(audio.pcm) != recording.speech_tokens * SAMPLES_PER_SPEECH_TOKEN:
            log.error("phrase_cache_store_refused", samples=len(audio.pcm), speech_tokens=recording.speech_tokens)
            return
        for key in recording.keys:
            self.cache.put(key, audio, pinned=recording.pins)
        self.stored_keys.extend(recording.keys)


# ---- the pre-warm list --------------------------------------------------------------------------------


PREWARM_CONCURRENCY = 4  # phrases rendered at once (they share the engine with live traffic after a reload)
PREWARM_FIELDS = frozenset({"text", "voice", "seed", "language", "sampling", "model"})
MAX_PREWARM_TEXT_CHARS = 4096


@dataclass(frozen=True, slots=True)
class PrewarmEntry:
    text: str
    voice_id: str = "default"
    seed: int | None = None  # None: rendered with a drawn seed, served to requests without one
    language: str | None = None
    sampling: tuple[tuple[str, float | int], ...] = ()  # overrides of the model's defaults, as clients send
    model: str | None = None  # a model name as clients send it, routed as theirs (None: by the language alone)


def parse_prewarm(raw: bytes) -> list[PrewarmEntry]:
    """The pre-warm file: a JSON list whose items are a phrase (the default voice) or an object
    {"text", "voice"?, "seed"?, "language"?, "sampling"?, "model"?}. Raises ValueError naming the bad item."""
    try:
        items = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(items, list):
        raise ValueError("must be a JSON list of phrases")
    entries = []
    for i, item in enumerate(items):
        where = f"item {i}"
        if isinstance(item, str):
            item = {"text": item}
        if not isinstance(item, dict) or set(item) - PREWARM_FIELDS:
            raise ValueError(f"{where}: a string or an object with {', '.join(sorted(PREWARM_FIELDS))}")
        text, voice, seed = item.get("text"), item.get("voice", "default"), item.get("seed")
        language, sampling, model = item.get("language"), item.get("sampling", {}), item.get("model")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_PREWARM_TEXT_CHARS:
            raise ValueError(f"{where}: text must be a non-empty string of at most {MAX_PREWARM_TEXT_CHARS} characters")
        if not isinstance(voice, str) or not voice:
            raise ValueError(f"{where}: voice must be a voice id")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"{where}: seed must be an integer in [0, 2**63)")
        if language is not None and not isinstance(language, str):
            raise ValueError(f"{where}: language must be a string")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"{where}: model must be a model name")
        if not isinstance(sampling, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in sampling.items()
        ):
            raise ValueError(f"{where}: sampling must be an object of numbers")
        unknown = set(sampling) - set(SamplingParams.__dataclass_fields__) - {"seed"}
        if unknown or "seed" in sampling:
            raise ValueError(f"{where}: unknown sampling field(s) {sorted(unknown | ({'seed'} & set(sampling)))}")
        entries.append(PrewarmEntry(text, voice, seed, language, tuple(sorted(sampling.items())), model))
    return entries


class Prewarm:
    """The `--prewarm` list: rendered into the phrase cache (pinned) at start-up and on `reload()`."""

    def __init__(self, path: Path | None, cache: PhraseCache) -> None:
        self.path = path
        self.cache = cache
        self.entries: list[PrewarmEntry] = self.load(path) if path is not None else []
        self.pinned_keys: set[str] = set()
        self.rendered = 0  # phrases the last run had the engine render
        self.cached = 0  # phrases the last run found in a cache already (here or in Redis)
        self.failed = 0
        self.runs = 0
        self.running = False

    @staticmethod
    def load(path: Path) -> list[PrewarmEntry]:
        """The list in `path`. Raises ValueError naming the file (unreadable) or the bad item."""
        try:
            return parse_prewarm(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read the pre-warm list {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"pre-warm list {path}: {exc}") from None

    def status_json(self) -> dict[str, object]:
        return {"file": str(self.path) if self.path else None, "phrases": len(self.entries), "runs": self.runs,
                "rendered": self.rendered, "cached": self.cached, "failed": self.failed, "running": self.running,
                "pinned_entries": len(self.pinned_keys)}

    async def run(self, speak: Callable[[PrewarmEntry], Any]) -> None:
        """Render every phrase (`speak(entry)` -> (stored keys, hit?)); pin what the list holds now and
        unpin what it no longer does. A phrase that fails is logged and counted, never fatal."""
        self.running = True
        limit = asyncio.Semaphore(PREWARM_CONCURRENCY)
        rendered = cached = failed = 0
        started_s = time.monotonic()

        async def one(entry: PrewarmEntry) -> list[str]:
            nonlocal rendered, cached, failed
            async with limit:
                try:
                    keys, hit = await speak(entry)
                except Exception as exc:
                    failed += 1
                    log.error("prewarm_phrase_failed", text=entry.text[:80], voice=entry.voice_id, error=str(exc))
                    return []
            if hit:
                cached += 1
            else:
                rendered += 1
            return list(keys)

        try:
            results = await asyncio.gather(*(one(e) for e in self.entries))
        finally:
            self.running = False
        keys = {k for ks in results for k in ks}
        self.cache.pin(self.pinned_keys - keys, pinned=False)
        self.cache.pin(keys)
        self.pinned_keys = keys
        self.rendered, self.cached, self.failed = rendered, cached, failed
        self.runs += 1
        log.info("prewarm_done", phrases=len(self.entries), rendered=rendered, cached=cached, failed=failed,
                 duration_s=round(time.monotonic() - started_s, 3))

    async def reload(self, speak: Callable[[PrewarmEntry], Any]) -> None:
        """Read the file again and render what is new; a file that became unusable keeps the old list."""
        if self.path is None:
            log.warning("prewarm_reload_without_list")
            return
        try:
            self.entries = self.load(self.path)
        except ValueError as exc:
            log.error("prewarm_reload_failed", error=str(exc))
            return
        await self.run(speak)
