"""Voices: the engine's built-in ones plus reference clips uploaded over HTTP, kept on disk or shared.

Alone (no shared state): `<data_dir>/voices/<voice_id>.wav` (mono 16-bit PCM at the clip's own rate) and
`<voice_id>.json` (metadata). At start-up every stored clip is handed to the engine again.

Several models (--variant turbo,multilingual): one clip gives each loaded model its own conditioning, computed once
per model (`EngineLike.add_voice`), and each model's has its own version (`Voice.versions`; the phrase cache keys by
the serving model's).

Shared (`--redis-url`): a voice lives in Redis with its clip and its computed conditioning, one per model's weights
(`EngineLike.export_voice(voice, model)`, keyed by the model's weights identity), so every replica serves every voice
without running the voice encoders again (`import_voice`); a replica with a model whose conditioning is not there yet
(other weights, another model) computes it from the clip and adds it for the replicas after it. Each replica imports
the voices of the shared index as it changes (polled every shared_state.SYNC_PERIOD_S), so a voice created on one
replica is spoken by the others within about that. The disk is not used then (Redis needs persistence).

Every voice has a `version`: the first 16 hex digits of the SHA-256 of its conditioning. A voice deleted and
created again from another clip has another version, so caches keyed by it (the phrase cache) miss.

A context holds a lease on its voice for its whole life. DELETE removes the files at once (so the voice
does not come back after a restart) and hides the voice from new contexts; the engine forgets it when the
last lease goes. `engine.add_voice` is slow (it computes the conditioning) and runs on a worker thread.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import io
import re
import secrets
import wave
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import structlog
from numpy.typing import NDArray
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from agent_server.errors import BAD_REQUEST, FieldError
from agent_server.fleet.shared_state import SharedState, SharedStateUnavailable, VoiceData, VoiceRecord
from synth.api import EngineError, EngineLike, Variant

log = structlog.get_logger("agent_server.voices")

VOICE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_VOICE_ID_CHARS = 64
MAX_NAME_CHARS = 200
MAX_DESCRIPTION_CHARS = 1000
LANGUAGE_CODE = re.compile(r"^[a-z]{2,3}$")
PCM16_FULL_SCALE = 32767.0
VERSION_HEX = 16
UNVERSIONED = "unversioned"  # an engine that cannot export a voice's conditioning


class VoiceStatus(enum.IntEnum):
    LOADING = 0  # conditioning being computed
    READY = 1
    DELETING = 2  # deleted; the engine forgets it when the last context using it ends


@dataclass(slots=True)
class Voice:
    voice_id: str
    builtin: bool
    status: VoiceStatus
    name: str = ""
    duration_s: float = 0.0
    sample_rate_hz: int = 0
    created_at: str = ""
    description: str = ""
    language: str = ""  # ISO 639 code of the clip's language as the uploader gave it ("": not given)
    leases: int = 0  # contexts using it now
    version: str = ""  # content hash of the conditioning the engine holds for it (the default model's)
    versions: dict[str, str] = field(default_factory=dict)  # each loaded model's (the default's is `version`)
    shared_version: str = ""  # the shared record's version it was made from ("": not shared); sync compares it

    def to_json(self) -> dict[str, Any]:
        return {
            "voice_id": self.voice_id,
            "name": self.name,
            "builtin": self.builtin,
            "category": "premade" if self.builtin else "cloned",  # ElevenLabs' word (its SDK and LiveKit read it)
            "status": self.status.name.lower(),
            "duration_s": round(self.duration_s, 3),
            "sample_rate_hz": self.sample_rate_hz,
            "created_at": self.created_at,
            "description": self.description,
            "language": self.language,
            "in_use": self.leases,
            "version": self.version,
            "versions": dict(self.versions),
        }

    def version_of(self, model: str) -> str:
        """The content hash of `model`'s conditioning of this voice."""
        return self.versions.get(model, self.version)


class VoiceError(FieldError):
    """A voice request refused: a FieldError (a context opened on an unusable voice is refused with it in
    every protocol's own form) that knows its HTTP status (the /v1/voices routes answer with it)."""

    def __init__(self, status_code: int, field: str, message: str, code: str = BAD_REQUEST) -> None:
        super().__init__(field, message, code)
        self.status_code = status_code

    def response(self) -> JSONResponse:
        body = {"error": {"field": self.field, "message": self.message, "code": self.code}}
        return JSONResponse(body, status_code=self.status_code)


def conditioning_version(conditioning: bytes) -> str:
    return hashlib.sha256(conditioning).hexdigest()[:VERSION_HEX]


class VoiceStore:
    def __init__(self, voices_dir: Path, *, min_clip_s: float = 5.0, max_clip_s: float = 60.0,
                 shared: SharedState | None = None) -> None:
        self.voices_dir = voices_dir
        self.min_clip_s = min_clip_s
        self.max_clip_s = max_clip_s
        self.shared = shared if shared is not None and shared.shared else None  # None: the disk store
        self.weights_ids: Mapping[Variant, str] = {}  # each loaded model's weights identity
        self.attached_unix_s = 0  # when the engine's voices were registered (a model's `created` time)
        self._voices: dict[str, Voice] = {}
        self._engine: EngineLike | None = None
        self._synced_generation = -1
        self._sync_task: asyncio.Task[None] | None = None
        self._sync_wanted = asyncio.Event()

    # ---- start-up ------------------------------------------------------------------------------

    async def attach(self, engine: EngineLike, weights_ids: Mapping[Variant, str] | None = None) -> None:
        """Register the engine's built-in voices, then hand every stored (or shared) voice to the engine.
        `weights_ids`: each loaded model's weights identity (which shared conditioning it may import)."""
        self._engine = engine
        self.weights_ids = dict(weights_ids or {})
        attached_at = _now()
        self.attached_unix_s = int(datetime.fromisoformat(attached_at).timestamp())
        for voice_id in engine.voice_ids():  # built in: created when the engine loaded them
            voice = self._voices[voice_id] = Voice(voice_id, builtin=True, status=VoiceStatus.READY,
                                                   name=voice_id, created_at=attached_at)
            await asyncio.to_thread(self._set_versions, voice)
        if self.shared is not None:
            await self.sync()
            self._sync_task = asyncio.create_task(self._sync_loop(self.shared), name="voices-sync")
            return
        if not self.voices_dir.is_dir():
            return
        for meta_path in sorted(self.voices_dir.glob("*.json")):
            voice_id = meta_path.stem
            try:
                meta = orjson.loads(meta_path.read_bytes())
                wav, sample_rate_hz = decode_wav(self._wav_path(voice_id).read_bytes())
                voice = Voice(
                    voice_id,
                    builtin=False,
                    status=VoiceStatus.LOADING,
                    name=str(meta.get("name", "")),
                    duration_s=len(wav) / sample_rate_hz,
                    sample_rate_hz=sample_rate_hz,
                    created_at=str(meta.get("created_at", "")),
                    description=str(meta.get("description", "")),
                    language=str(meta.get("language", "")),
                )
                self._voices[voice_id] = voice
                await asyncio.to_thread(engine.add_voice, voice_id, wav, sample_rate_hz)
                await asyncio.to_thread(self._set_versions, voice)
                voice.status = VoiceStatus.READY
                log.info("voice_restored", voice_id=voice_id, duration_s=round(voice.duration_s, 2))
            except (OSError, ValueError, EngineError) as exc:  # one bad file must not stop the server
                self._voices.pop(voice_id, None)
                log.error("voice_restore_failed", voice_id=voice_id, error=str(exc))

    async def detach(self) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
            await asyncio.gather(self._sync_task, return_exceptions=True)

    # ---- the shared index (RedisState) -----------------------------------------------------------

    async def sync(self) -> None:
        """Make this replica's voices match the shared index: import new or changed voices, forget deleted
        ones. One voice that cannot be imported is logged and skipped (it is tried again next change)."""
        shared, engine = self.shared, self._engine
        if shared is None or engine is None or not shared.available:
            return
        generation = shared.mirror.generation
        index = shared.voice_index()
        for voice_id, record in sorted(index.items()):
            voice = self._voices.get(voice_id)
            if voice is not None and (voice.builtin or voice.status == VoiceStatus.LOADING):
                continue
            if voice is not None and voice.status == VoiceStatus.READY and voice.shared_version == record.version:
                continue  # current
            try:
                await self._import(engine, shared, record)
            except SharedStateUnavailable:
                return  # the next sync after Redis is back does the rest
            except (OSError, ValueError, EngineError) as exc:
                log.error("voice_import_failed", voice_id=voice_id, error=str(exc))
        current = shared.voice_index()  # read again: a voice created here meanwhile is in it by now
        for voice in list(self._voices.values()):
            if not voice.builtin and voice.status == VoiceStatus.READY and voice.voice_id not in current:
                self._retire(voice)
        self._synced_generation = generation

    async def _sync_loop(self, shared: SharedState) -> None:
        while True:
            await asyncio.sleep(shared.sync_period_s)
            if shared.mirror.generation != self._synced_generation:
                try:
                    await self.sync()
                except Exception:  # the loop must outlive one bad voice
                    log.exception("voices_sync_failed")

    async def _import(self, engine: EngineLike, shared: SharedState, record: VoiceRecord) -> None:
        data = await shared.get_voice(record.voice_id)
        if data is None:
            return  # deleted since the index was read
        record = data.record
        replacing = self._voices.get(record.voice_id)
        voice = Voice(record.voice_id, False, VoiceStatus.LOADING, record.name, record.duration_s,
                      record.sample_rate_hz, record.created_at, record.description, record.language)
        self._voices[record.voice_id] = voice
        missing = [model for model in engine.models if self.weights_ids.get(model) not in data.conditioning]
        try:
            if not missing:  # every model's conditioning is there: no encoder runs
                for model in engine.models:
                    conditioning = data.conditioning[self.weights_ids[model]]
                    await asyncio.to_thread(engine.import_voice, record.voice_id, conditioning, model)
            else:  # a model (other weights, another model) without it: computed here from the clip, for every model
                wav, sample_rate_hz = decode_wav(data.clip_wav)
                await asyncio.to_thread(engine.add_voice, record.voice_id, wav, sample_rate_hz)
            await asyncio.to_thread(self._set_versions, voice)
            voice.shared_version = record.version
        except BaseException:
            if replacing is not None:
                self._voices[record.voice_id] = replacing
            else:
                self._voices.pop(record.voice_id, None)
            raise
        if replacing is not None:
            replacing.status = VoiceStatus.DELETING  # its contexts finish on the conditioning they hold
        voice.status = VoiceStatus.READY
        log.info("voice_imported", voice_id=record.voice_id, version=voice.version, computed_for=",".join(missing))
        if missing:  # the models computed here: for the replicas after this one
            await self._add_conditioning(engine, shared, voice, record, missing)

    def _retire(self, voice: Voice) -> None:
        """Deleted elsewhere: hide it now, forget it once its last context ends."""
        voice.status = VoiceStatus.DELETING
        if voice.leases == 0:
            self._forget(voice)
        log.info("voice_retired", voice_id=voice.voice_id, in_use=voice.leases)

    def _set_versions(self, voice: Voice) -> None:
        """The content hash of each loaded model's conditioning of `voice` (worker thread)."""
        engine = self._require_engine()
        try:
            voice.versions = {model: conditioning_version(engine.export_voice(voice.voice_id, model))
                              for model in engine.models}
        except NotImplementedError:
            voice.versions = dict.fromkeys(engine.models, UNVERSIONED)
        voice.version = voice.versions[engine.variant]

    # ---- leases (contexts) -----------------------------------------------------------------------

    def acquire(self, voice_id: str) -> Voice:
        voice = self._voices.get(voice_id)
        if voice is None or voice.status == VoiceStatus.DELETING:
            raise VoiceError(404, "voice", f"unknown voice {voice_id!r}", code="unknown_voice")
        if voice.status == VoiceStatus.LOADING:
            raise VoiceError(409, "voice", f"voice {voice_id!r} is still being prepared", code="voice_not_ready")
        voice.leases += 1
        return voice

    def release(self, voice: Voice) -> None:
        voice.leases -= 1
        if voice.leases == 0 and voice.status == VoiceStatus.DELETING:
            self._forget(voice)

    # ---- HTTP operations -------------------------------------------------------------------------

    def list(self) -> list[Voice]:
        return [v for v in self._voices.values() if v.status != VoiceStatus.DELETING]

    def get(self, voice_id: str) -> Voice:
        voice = self._voices.get(voice_id)
        if voice is None or voice.status == VoiceStatus.DELETING:
            raise VoiceError(404, "voice_id", f"unknown voice {voice_id!r}", code="unknown_voice")
        return voice

    async def create(self, clip: bytes, name: str = "", voice_id: str | None = None, *, description: str = "",
                     language: str = "") -> Voice:
        """A voice from a reference clip (WAV bytes). `language`: an ISO 639 code (a region is dropped:
        "en-US" -> "en") describing the clip; the voice speaks whatever language a request asks for."""
        engine = self._require_engine()
        await self._catch_up()
        if voice_id is None:
            voice_id = "v_" + secrets.token_hex(6)
        elif not (1 <= len(voice_id) <= MAX_VOICE_ID_CHARS) or not set(voice_id) <= VOICE_ID_CHARS:
            raise VoiceError(400, "voice_id", f"must be 1-{MAX_VOICE_ID_CHARS} characters of [A-Za-z0-9_-]")
        if voice_id in self._voices or (self.shared is not None and voice_id in self.shared.voice_index()):
            raise VoiceError(409, "voice_id", f"voice {voice_id!r} already exists", code="conflict")
        if self.shared is not None and not self.shared.available:
            raise VoiceError(503, "voice", "voices cannot be added now: the shared state is unavailable",
                             code="shared_state_unavailable")
        if len(name) > MAX_NAME_CHARS:
            raise VoiceError(400, "name", f"at most {MAX_NAME_CHARS} characters")
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise VoiceError(400, "description", f"at most {MAX_DESCRIPTION_CHARS} characters")
        language = _language_code(language)
        try:
            wav, sample_rate_hz = decode_wav(clip)
        except ValueError as exc:
            raise VoiceError(400, "file", str(exc)) from exc
        duration_s = len(wav) / sample_rate_hz
        if duration_s < self.min_clip_s:
            raise VoiceError(
                422, "file", f"reference clip too short: {duration_s:.2f} s, need at least {self.min_clip_s:g} s"
            )
        if duration_s > self.max_clip_s:
            raise VoiceError(422, "file", f"reference clip too long: {duration_s:.1f} s, at most {self.max_clip_s:g} s")
        voice = Voice(voice_id, False, VoiceStatus.LOADING, name, duration_s, sample_rate_hz, _now(), description,
                      language)
        self._voices[voice_id] = voice
        try:
            await asyncio.to_thread(engine.add_voice, voice_id, wav, sample_rate_hz)
        except (EngineError, ValueError) as exc:
            self._voices.pop(voice_id, None)
            raise VoiceError(422, "file", f"the engine refused the clip: {exc}") from exc
        except BaseException:
            self._voices.pop(voice_id, None)
            raise
        try:
            await asyncio.to_thread(self._set_versions, voice)
            if self.shared is not None:
                await self._publish(engine, self.shared, voice, clip)
            else:
                await asyncio.to_thread(self._write, voice, wav)
        except BaseException:
            self._voices.pop(voice_id, None)
            engine.remove_voice(voice_id)
            raise
        voice.status = VoiceStatus.READY
        log.info("voice_added", voice_id=voice_id, duration_s=round(duration_s, 2), sample_rate_hz=sample_rate_hz)
        return voice

    async def delete(self, voice_id: str) -> Voice:
        await self._catch_up()
        voice = self.get(voice_id)
        if voice.builtin:
            raise VoiceError(409, "voice_id", f"{voice_id!r} is a built-in voice and cannot be deleted", "conflict")
        if voice.status == VoiceStatus.LOADING:
            raise VoiceError(409, "voice_id", f"voice {voice_id!r} is still being prepared", "voice_not_ready")
        if self.shared is not None:
            try:
                await self.shared.delete_voice(voice_id)
            except SharedStateUnavailable:
                raise VoiceError(503, "voice_id", "voices cannot be deleted now: the shared state is unavailable",
                                 "shared_state_unavailable") from None
        else:
            await asyncio.to_thread(self._unlink, voice_id)
        voice.status = VoiceStatus.DELETING
        if voice.leases == 0:
            self._forget(voice)
        log.info("voice_deleted", voice_id=voice_id, in_use=voice.leases)
        return voice

    # ---- helpers -------------------------------------------------------------------------------

    async def _publish(self, engine: EngineLike, shared: SharedState, voice: Voice, clip: bytes) -> None:
        """Put the voice (the clip as uploaded, and its conditioning) in the shared state. Raises VoiceError
        409 when another replica created the same id first, 503 when the shared state is unavailable."""
        conditioning = {self.weights_ids.get(model, model): await asyncio.to_thread(engine.export_voice,
                                                                                      voice.voice_id, model)
                        for model in engine.models}
        record = VoiceRecord(voice.voice_id, voice.version, voice.name, voice.created_at, voice.duration_s,
                             voice.sample_rate_hz, self.weights_ids.get(engine.variant, ""), voice.description,
                             voice.language)
        try:
            created = await shared.put_voice(VoiceData(record, clip, conditioning))
        except SharedStateUnavailable:
            raise VoiceError(503, "voice", "voices cannot be added now: the shared state is unavailable",
                             code="shared_state_unavailable") from None
        if not created:
            raise VoiceError(409, "voice_id", f"voice {voice.voice_id!r} already exists", code="conflict")
        voice.shared_version = record.version

    async def _add_conditioning(self, engine: EngineLike, shared: SharedState, voice: Voice, record: VoiceRecord,
                                models: Sequence[Variant]) -> None:
        """Share the conditioning of `models`, computed here, under the shared voice it was made from (none of it
        when that voice changed meanwhile). A failure only costs the next replica a computation."""
        try:
            for model in models:
                if model in self.weights_ids:
                    conditioning = await asyncio.to_thread(engine.export_voice, voice.voice_id, model)
                    await shared.add_conditioning(record.voice_id, record.version, self.weights_ids[model],
                                                  conditioning)
        except (SharedStateUnavailable, EngineError) as exc:
            log.warning("voice_conditioning_not_shared", voice_id=voice.voice_id, error=str(exc))

    async def _catch_up(self) -> None:
        """Shared: read the index now, so that a change made on another replica a moment ago counts (the
        periodic sync could be up to a period behind). Raises VoiceError 503 while it is unavailable."""
        if self.shared is None:
            return
        try:
            await self.shared.refresh()
        except SharedStateUnavailable:
            raise VoiceError(503, "voice", "voices cannot be changed now: the shared state is unavailable",
                             code="shared_state_unavailable") from None
        await self.sync()

    def _require_engine(self) -> EngineLike:
        if self._engine is None:
            raise VoiceError(503, "engine", "the model is still loading", code="not_ready")
        return self._engine

    def _forget(self, voice: Voice) -> None:
        if self._voices.get(voice.voice_id) is not voice:
            return  # replaced under its id by a newer version (the engine holds that one now)
        del self._voices[voice.voice_id]
        if self._engine is not None:
            self._engine.remove_voice(voice.voice_id)

    def _wav_path(self, voice_id: str) -> Path:
        return self.voices_dir / f"{voice_id}.wav"

    def _write(self, voice: Voice, wav: NDArray[Any]) -> None:
        self.voices_dir.mkdir(parents=True, exist_ok=True)
        wav_tmp = self.voices_dir / f".{voice.voice_id}.wav.tmp"
        wav_tmp.write_bytes(encode_wav_pcm16(wav, voice.sample_rate_hz))
        wav_tmp.replace(self._wav_path(voice.voice_id))
        meta = {"voice_id": voice.voice_id, "name": voice.name, "created_at": voice.created_at,
                "description": voice.description, "language": voice.language}
        meta_tmp = self.voices_dir / f".{voice.voice_id}.json.tmp"
        meta_tmp.write_bytes(orjson.dumps(meta))
        meta_tmp.replace(self.voices_dir / f"{voice.voice_id}.json")  # last: a voice exists once this does

    def _unlink(self, voice_id: str) -> None:
        (self.voices_dir / f"{voice_id}.json").unlink(missing_ok=True)
        self._wav_path(voice_id).unlink(missing_ok=True)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _language_code(raw: str) -> str:
    """"en", "en-US", "pt_BR" -> "en", "pt"; "" stays ""; anything else is refused (400 `language`)."""
    code = raw.strip().replace("_", "-").split("-", 1)[0].lower()
    if raw and not LANGUAGE_CODE.match(code):
        raise VoiceError(400, "language", f"not a language code: {raw!r} (ISO 639, e.g. \"en\" or \"pt-BR\")")
    return code


def decode_wav(data: bytes) -> tuple[NDArray[Any], int]:
    """WAV bytes -> (mono float32 in [-1, 1], sample rate). PCM 8/16/24/32-bit via the stdlib; float and
    other formats through soundfile when it is installed. Raises ValueError with a readable message."""
    try:
        with wave.open(io.BytesIO(data), "rb") as reader:
            channels = reader.getnchannels()
            width_bytes = reader.getsampwidth()
            sample_rate_hz = reader.getframerate()
            raw = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        return _decode_with_soundfile(data, exc)
    if sample_rate_hz <= 0 or channels <= 0:
        raise ValueError("a WAV file with a sample rate and at least one channel is expected")
    if width_bytes == 1:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width_bytes == 2:
        samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width_bytes == 3:
        triples = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)) << 8 >> 8
        samples = ints.astype(np.float32) / 8388608.0
    else:
        samples = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    frames = len(samples) // channels
    mono = samples[: frames * channels].reshape(frames, channels).mean(axis=1, dtype=np.float32)
    return mono, sample_rate_hz


def _decode_with_soundfile(data: bytes, first_error: Exception) -> tuple[NDArray[Any], int]:
    try:
        import soundfile  # optional
    except ImportError:
        raise ValueError(f"not a PCM WAV file ({first_error}); upload 8/16/24/32-bit PCM WAV") from None
    try:
        samples, sample_rate_hz = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own LibsndfileError (a RuntimeError)
        detail = getattr(exc, "error_string", None) or re.sub(r"Error opening <[^>]*>: ", "", str(exc))
        raise ValueError(f"unreadable audio file ({detail.rstrip('.')}): upload a WAV, FLAC or OGG clip") from None
    return samples.mean(axis=1, dtype=np.float32), int(sample_rate_hz)


def encode_wav_pcm16(wav: NDArray[Any], sample_rate_hz: int) -> bytes:
    pcm = (np.clip(wav, -1.0, 1.0) * PCM16_FULL_SCALE).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate_hz)
        writer.writeframes(pcm.tobytes())
    return out.getvalue()


# ---- HTTP handlers ------------------------------------------------------------------------------


def _store(request: Request) -> VoiceStore:
    store: VoiceStore = request.app.state.hub.voices
    return store


async def list_voices(request: Request) -> Response:
    return JSONResponse({"voices": [v.to_json() for v in _store(request).list()]})


async def get_voice(request: Request) -> Response:
    try:
        return JSONResponse(_store(request).get(request.path_params["voice_id"]).to_json())
    except VoiceError as exc:
        return exc.response()


async def create_voice(request: Request) -> Response:
    """multipart/form-data with `file` (a WAV clip, >= 5 s) and optional `name`, `voice_id`, `description`,
    `language`; or the WAV itself as the body (Content-Type audio/wav) with those as query parameters."""
    try:
        body = await read_body(request, request.app.state.hub.settings.max_voice_upload_bytes)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            async with read_form(request, body, max_files=1) as form:
                fields = form_fields(form, NATIVE_FORM_FIELDS, frozenset({"file"}))
                clip = await form_file(form, "file")
        else:
            if not body:
                raise VoiceError(400, "file", "empty body: send a WAV clip (multipart field `file` or the raw body)")
            fields, clip = dict(request.query_params), body
        voice = await _store(request).create(clip, name=fields.get("name", ""), voice_id=fields.get("voice_id") or None,
                                             description=fields.get("description", ""),
                                             language=fields.get("language", ""))
    except VoiceError as exc:
        return exc.response()
    return JSONResponse(voice.to_json(), status_code=201)


NATIVE_FORM_FIELDS = frozenset({"name", "voice_id", "description", "language"})
MAX_FORM_FIELDS = 16


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; 413 (field `file`) past `max_bytes`, whether it declared its length or not
    (a chunked upload is counted as it arrives)."""
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        declared = 0
    if declared > max_bytes:
        raise VoiceError(413, "file", f"upload too large: at most {max_bytes} bytes", "too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise VoiceError(413, "file", f"upload too large: at most {max_bytes} bytes", "too_large")
    return bytes(body)


@asynccontextmanager
async def read_form(request: Request, body: bytes, *, max_files: int) -> AsyncIterator[FormData]:
    """`body` (from `read_body`) parsed as the request's multipart/form-data; a malformed one is 400 `file`."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    # without "app" in its scope Starlette raises a parse error rather than answering it as plain text
    replay = Request({key: value for key, value in request.scope.items() if key != "app"}, receive)
    try:
        async with replay.form(max_files=max_files, max_fields=MAX_FORM_FIELDS) as form:
            yield form
    except MultiPartException as exc:
        raise VoiceError(400, "file", f"malformed multipart/form-data: {exc.message}") from None


def form_fields(form: FormData, text: frozenset[str], files: frozenset[str]) -> dict[str, str]:
    """The form's text fields (each of `text` at most once); any other field, or a file where text is
    expected (or text where a file is), is refused: 400 naming the field."""
    fields: dict[str, str] = {}
    for name, value in form.multi_items():
        if name not in text and name not in files:
            raise VoiceError(400, name, f"unknown field {name!r}")
        if isinstance(value, str) != (name in text):
            raise VoiceError(400, name, f"field {name!r} must be {'text' if name in text else 'a file'}")
        if name in fields:
            raise VoiceError(400, name, f"field {name!r} given twice")
        if isinstance(value, str):
            fields[name] = value
    return fields


async def form_file(form: FormData, name: str) -> bytes:
    """The one file in field `name` (400 when it is missing, or not a file)."""
    files = form.getlist(name)
    if len(files) != 1 or isinstance(files[0], str):
        raise VoiceError(400, name, f"a multipart field `{name}` holding one WAV clip is required")
    return await files[0].read()


async def delete_voice(request: Request) -> Response:
    try:
        voice = await _store(request).delete(request.path_params["voice_id"])
    except VoiceError as exc:
        return exc.response()
    status = "deleted" if voice.leases == 0 else "deleting"
    return JSONResponse({"voice_id": voice.voice_id, "status": status, "in_use": voice.leases})


routes = [
    Route("/v1/voices", list_voices, methods=["GET"]),
    Route("/v1/voices", create_voice, methods=["POST"]),
    Route("/v1/voices/{voice_id}", get_voice, methods=["GET"]),
    Route("/v1/voices/{voice_id}", delete_voice, methods=["DELETE"]),
]
