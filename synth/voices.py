"""Voices: the conditioning computed once from a reference clip, then shared read-only by every segment.

`make_voice` follows chatterbox's `prepare_conditionals` (tts.py / tts_turbo.py / mtl_tts.py) step by
step, using the library's own S3 tokenizer, CAMPPlus x-vector, mel extractor and voice encoder.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import librosa
import numpy as np
import numpy.typing as npt
import safetensors.torch
import torch
from chatterbox.models.s3gen import S3GEN_SR
from chatterbox.models.s3tokenizer import S3_SR
from chatterbox.models.t3.modules.cond_enc import T3Cond

from synth.api import EngineError, Variant
from synth.cpu_threads import fixed_threads

MIN_REFERENCE_S = 5.0
S3GEN_PROMPT_S = 10.0  # DEC_COND_LEN in every variant
T3_PROMPT_S: dict[Variant, float] = {"english": 6.0, "multilingual": 6.0, "turbo": 15.0}  # ENC_COND_LEN
TURBO_TARGET_LUFS = -27.0
VOICE_THREADS = 1  # a voice's conditioning is computed single-threaded: the same bits on any machine, any load


@dataclass(slots=True, eq=False)
class Voice:
    voice_id: str
    speaker_emb: torch.Tensor  # [1, 256] voice-encoder embedding
    prompt_speech_tokens: torch.Tensor | None  # [1, P] S3 tokens of the reference (T3 conditioning prompt)
    s3gen_ref: dict[str, Any]  # S3Gen.embed_ref output: prompt_token, prompt_token_len, prompt_feat, ..., embedding
    builtin: bool = False
    # SHA-256 of the conditioning (not of the id): what the engine's per-voice caches are keyed by, so a voice
    # removed and re-added under the same id with another clip never reuses the old voice's prefix or prompt.
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = conditioning_key(self.speaker_emb, self.prompt_speech_tokens, self.s3gen_ref)

    def t3_cond(self, exaggeration: float, device: torch.device) -> T3Cond:
        """A fresh T3Cond (T3.prepare_conditioning writes into the object it is given)."""
        return T3Cond(speaker_emb=self.speaker_emb, cond_prompt_speech_tokens=self.prompt_speech_tokens,
                      emotion_adv=exaggeration * torch.ones(1, 1, 1)).to(device=device)


def conditioning_key(speaker_emb: torch.Tensor, prompt_speech_tokens: torch.Tensor | None,
                     s3gen_ref: dict[str, Any]) -> str:
    """Content hash of a voice's conditioning: equal conditioning, equal key; anything else differs."""
    digest = hashlib.sha256()

    def add(name: str, value: object) -> None:
        digest.update(name.encode() + b"\0")
        if torch.is_tensor(value):
            tensor = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{tensor.dtype}{tuple(value.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(repr(value).encode())

    add("speaker_emb", speaker_emb)
    add("prompt_speech_tokens", prompt_speech_tokens)
    for name in sorted(s3gen_ref):
        add(f"s3gen.{name}", s3gen_ref[name])
    return digest.hexdigest()


VOICE_BLOB_FORMAT = "synth-voice"
VOICE_BLOB_VERSION = "1"  # bump when the layout changes: an old blob is refused, its clip recomputed
SAFETENSORS_LEN_BYTES = 8  # a safetensors file opens with its JSON header's length (u64, little-endian)
_S3GEN_PREFIX = "s3gen."


def voice_to_bytes(voice: Voice) -> bytes:
    """A voice's conditioning as bytes (safetensors: its tensors, plus JSON metadata for the rest), so a
    second process can serve the voice without running the voice encoders again (`voice_from_bytes`)."""
    tensors: dict[str, torch.Tensor] = {"speaker_emb": voice.speaker_emb.detach().to("cpu").contiguous()}
    if voice.prompt_speech_tokens is not None:
        tensors["prompt_speech_tokens"] = voice.prompt_speech_tokens.detach().to("cpu").contiguous()
    plain: dict[str, Any] = {}
    for name, value in voice.s3gen_ref.items():
        if torch.is_tensor(value):
            tensors[_S3GEN_PREFIX + name] = value.detach().to("cpu").contiguous()
        else:
            plain[name] = value
    # one metadata entry: safetensors writes a metadata map in a per-process random order, and these bytes
    # must be equal for equal voices (their hash is the voice's version across replicas)
    header = {"format": VOICE_BLOB_FORMAT, "version": VOICE_BLOB_VERSION, "s3gen_plain": plain}
    return bytes(safetensors.torch.save(tensors, metadata={VOICE_BLOB_FORMAT: json.dumps(header, sort_keys=True)}))


def voice_from_bytes(voice_id: str, blob: bytes, device: torch.device) -> Voice:
    """The inverse of `voice_to_bytes`. Raises EngineError on bytes it cannot read."""
    try:
        header_bytes = int.from_bytes(blob[:SAFETENSORS_LEN_BYTES], "little")
        header = json.loads(blob[SAFETENSORS_LEN_BYTES:SAFETENSORS_LEN_BYTES + header_bytes])
        metadata = json.loads((header.get("__metadata__") or {}).get(VOICE_BLOB_FORMAT, "{}"))
        tensors = safetensors.torch.load(blob)
    except Exception as exc:  # safetensors raises its own SafetensorError; json a ValueError
        raise EngineError(f"unreadable voice blob: {exc}") from None
    if metadata.get("format") != VOICE_BLOB_FORMAT or metadata.get("version") != VOICE_BLOB_VERSION:
        raise EngineError(f"not a voice blob of format {VOICE_BLOB_FORMAT} v{VOICE_BLOB_VERSION}")
    plain = metadata.get("s3gen_plain") or {}
    speaker_emb = tensors.pop("speaker_emb", None)
    if speaker_emb is None:
        raise EngineError("a voice blob without its speaker embedding")
    prompt_tokens = tensors.pop("prompt_speech_tokens", None)
    s3gen_ref: dict[str, Any] = dict(plain)
    for name, tensor in tensors.items():
        if not name.startswith(_S3GEN_PREFIX):
            raise EngineError(f"unexpected tensor {name!r} in a voice blob")
        s3gen_ref[name[len(_S3GEN_PREFIX):]] = tensor.to(device)
    return Voice(voice_id=voice_id, speaker_emb=speaker_emb.to(device),
                 prompt_speech_tokens=None if prompt_tokens is None else prompt_tokens.to(device), s3gen_ref=s3gen_ref)


def voice_from_conds(voice_id: str, conds: dict[str, Any], device: torch.device) -> Voice:
    """A voice from a checkpoint's conds.pt ({"t3": T3Cond fields, "gen": S3Gen ref dict})."""
    t3 = conds["t3"]
    gen = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in conds["gen"].items()}
    return Voice(voice_id=voice_id, speaker_emb=t3["speaker_emb"].to(device),
                 prompt_speech_tokens=(t3["cond_prompt_speech_tokens"].to(device)
                                       if t3.get("cond_prompt_speech_tokens") is not None else None),
                 s3gen_ref=gen, builtin=True)


def _norm_loudness(wav: npt.NDArray[np.float64], sample_rate_hz: int) -> npt.NDArray[np.float64]:
    """Turbo normalises the reference to -27 LUFS before anything else (tts_turbo.norm_loudness)."""
    import pyloudnorm

    try:
        loudness = pyloudnorm.Meter(sample_rate_hz).integrated_loudness(wav)
    except ValueError:
        return wav
    gain = 10.0 ** ((TURBO_TARGET_LUFS - loudness) / 20.0)
    return wav * gain if math.isfinite(gain) and gain > 0.0 else wav


def make_voice(bundle: Any, voice_id: str, wav: npt.NDArray[np.float32], sample_rate_hz: int) -> Voice:
    """Conditioning from a reference clip (mono float, >= 5 s). Raises EngineError on a clip it cannot use.

    Computed with VOICE_THREADS threads whatever the caller's count or the machine's load: torch's FFTs (the mel
    and the x-vector's features) give other bits with other thread counts, and a voice's conditioning is what
    every seeded render of it starts from (same clip, same seed, same audio on any server)."""
    with fixed_threads(VOICE_THREADS):
        return _make_voice(bundle, voice_id, wav, sample_rate_hz)


@torch.inference_mode()
def _make_voice(bundle: Any, voice_id: str, wav: npt.NDArray[np.float32], sample_rate_hz: int) -> Voice:
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise EngineError("reference clip must be mono")
    if not np.all(np.isfinite(wav)):
        raise EngineError("reference clip contains NaN or infinite samples")
    if wav.size < MIN_REFERENCE_S * sample_rate_hz:
        raise EngineError(f"reference clip must be at least {MIN_REFERENCE_S:g} s long "
                          f"(got {wav.size / sample_rate_hz:.2f} s)")
    device = bundle.device
    ref_24k = librosa.resample(wav, orig_sr=sample_rate_hz, target_sr=S3GEN_SR) if sample_rate_hz != S3GEN_SR else wav
    if bundle.variant == "turbo":
        ref_24k = _norm_loudness(ref_24k.astype(np.float64), S3GEN_SR).astype(np.float32)
    ref_16k = librosa.resample(ref_24k, orig_sr=S3GEN_SR, target_sr=S3_SR)
    s3gen_ref = bundle.s3gen.embed_ref(ref_24k[: int(S3GEN_PROMPT_S * S3GEN_SR)], S3GEN_SR, device=device)
    prompt_tokens = None
    if plen := bundle.t3.hp.speech_cond_prompt_len:
        enc_len = int(T3_PROMPT_S[bundle.variant] * S3_SR)
        prompt_tokens, _ = bundle.s3gen.tokenizer.forward([ref_16k[:enc_len]], max_len=plen)
        prompt_tokens = torch.atleast_2d(prompt_tokens).to(device)  # type: ignore[no-untyped-call]
    ve_embed = torch.from_numpy(bundle.ve.embeds_from_wavs([ref_16k], sample_rate=S3_SR))
    ve_embed = ve_embed.mean(dim=0, keepdim=True).to(device)
    return Voice(voice_id=voice_id, speaker_emb=ve_embed, prompt_speech_tokens=prompt_tokens, s3gen_ref=s3gen_ref)


class VoiceRegistry:
    """Thread-safe id -> Voice map. Removing a voice never affects segments that already hold it."""

    def __init__(self) -> None:
        self._voices: dict[str, Voice] = {}
        self._lock = threading.Lock()

    def add(self, voice: Voice) -> None:
        with self._lock:
            self._voices[voice.voice_id] = voice

    def remove(self, voice_id: str) -> None:
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise EngineError(f"unknown voice {voice_id!r}")
            if voice.builtin:
                raise EngineError(f"voice {voice_id!r} is built in and cannot be removed")
            del self._voices[voice_id]

    def get(self, voice_id: str) -> Voice:
        with self._lock:
            voice = self._voices.get(voice_id)
        if voice is None:
            raise EngineError(f"unknown voice {voice_id!r}")
        return voice

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)
