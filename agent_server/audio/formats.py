"""Output formats: the engine's float32 24 kHz mono PCM -> what the client asked for.

One `AudioEncoder` per audio stream (context): a stateful soxr resampler (so chunk joins are seamless
and the output equals resampling the whole signal at once), float -> PCM16 (clip to [-1, 1], x32767,
round), G.711 mu-law / A-law (table lookup, bit-exact with the reference g711.c), and a framer.

Resampler latency: soxr 'HQ' holds back about 20-35 ms of output (filter delay plus its block size),
released by the next `push`. When the listener is about to run out of audio and nothing else is coming
yet, call `drain()`: it flushes the resampler exactly (the output the input so far determines, no
silence) and starts a fresh one for what follows; only a partial fixed frame is padded.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import soxr
from numpy.typing import NDArray

from synth.api import OUTPUT_SAMPLE_RATE_HZ

ENGINE_SAMPLE_RATE_HZ = OUTPUT_SAMPLE_RATE_HZ  # 24 000: S3Gen's rate

Encoding = Literal["pcm_s16le", "mulaw", "alaw"]
ENCODINGS: tuple[Encoding, ...] = get_args(Encoding)
PCM_SAMPLE_RATES_HZ = (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
G711_SAMPLE_RATE_HZ = 8_000
SAMPLE_RATES_HZ: Mapping[Encoding, tuple[int, ...]] = {
    "pcm_s16le": PCM_SAMPLE_RATES_HZ,
    "mulaw": (G711_SAMPLE_RATE_HZ,),
    "alaw": (G711_SAMPLE_RATE_HZ,),
}
BYTES_PER_SAMPLE: Mapping[Encoding, int] = {"pcm_s16le": 2, "mulaw": 1, "alaw": 1}
MIME_TYPES: Mapping[Encoding, str] = {
    "pcm_s16le": "audio/pcm",
    "mulaw": "audio/basic",  # RFC 2046: 8 kHz mono mu-law
    "alaw": "audio/x-alaw-basic",
}
MAX_FRAME_MS = 1_000
MS_PER_S = 1_000

PCM16_FULL_SCALE = 32_767
RESAMPLER_QUALITY = "HQ"  # 20-bit, >130 dB stop band, flat to ~0.9 Nyquist; VHQ holds back up to 4x more

# ---- G.711 (ITU-T G.711, as in the reference g711.c by Sun Microsystems) ---------------------------
ULAW_INPUT_SHIFT = 2  # 16-bit -> 14-bit
ULAW_CLIP = 8_159  # 14-bit magnitude
ULAW_BIAS = 0x84  # 132 in 16-bit terms, 33 in 14-bit
ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
ALAW_INPUT_SHIFT = 3  # 16-bit -> 13-bit
ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
ALAW_SEG1_OFFSET = 0x108
ALAW_POSITIVE_MASK = 0xD5  # even bits inverted, sign bit set
ALAW_NEGATIVE_MASK = 0x55
QUANT_MASK = 0x0F
SEG_SHIFT = 4
SIGN_BIT = 0x80
N_SEGMENTS = 8

# ---- WAV -----------------------------------------------------------------------------------------
WAVE_FORMAT_PCM = 1
WAVE_FORMAT_ALAW = 6
WAVE_FORMAT_MULAW = 7
WAV_FORMAT_TAGS: Mapping[Encoding, int] = {
    "pcm_s16le": WAVE_FORMAT_PCM,
    "mulaw": WAVE_FORMAT_MULAW,
    "alaw": WAVE_FORMAT_ALAW,
}
WAV_UNKNOWN_SIZE = 0xFFFF_FFFF  # streaming: length not known yet (what browsers and ffmpeg accept)
WAV_BITS = (8, 16, 24, 32)


@dataclass(frozen=True, slots=True)
class OutputFormat:
    encoding: Encoding
    sample_rate_hz: int
    frame_ms: int | None = None  # None: one frame per engine chunk; else fixed frames, the last may be short

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding: must be one of {', '.join(ENCODINGS)} (got {self.encoding!r})")
        rates = SAMPLE_RATES_HZ[self.encoding]
        if self.sample_rate_hz not in rates:
            allowed = ", ".join(str(r) for r in rates)
            raise ValueError(
                f"sample_rate_hz: {self.encoding} is served at {allowed} Hz (got {self.sample_rate_hz})"
            )
        if self.frame_ms is None:
            return
        if not 1 <= self.frame_ms <= MAX_FRAME_MS:
            raise ValueError(f"frame_ms: must be in [1, {MAX_FRAME_MS}] (got {self.frame_ms})")
        if self.sample_rate_hz * self.frame_ms % MS_PER_S:
            raise ValueError(
                f"frame_ms: {self.frame_ms} ms at {self.sample_rate_hz} Hz is not a whole number of samples"
            )

    @classmethod
    def parse(cls, encoding: object, sample_rate_hz: object, frame_ms: object = None) -> OutputFormat:
        """Validate untrusted values; the ValueError's message starts with the field's name."""
        if not isinstance(encoding, str):
            raise ValueError(f"encoding: must be a string (got {type(encoding).__name__})")
        rate = _as_int(sample_rate_hz)
        if rate is None:
            raise ValueError(f"sample_rate_hz: must be an integer (got {sample_rate_hz!r})")
        frame = None if frame_ms is None else _as_int(frame_ms)
        if frame_ms is not None and frame is None:
            raise ValueError(f"frame_ms: must be a whole number of milliseconds or null (got {frame_ms!r})")
        return cls(encoding, rate, frame)  # type: ignore[arg-type]

    @property
    def bytes_per_sample(self) -> int:
        return BYTES_PER_SAMPLE[self.encoding]

    @property
    def bytes_per_s(self) -> int:
        return self.sample_rate_hz * self.bytes_per_sample

    @property
    def frame_samples(self) -> int | None:
        return None if self.frame_ms is None else self.sample_rate_hz * self.frame_ms // MS_PER_S

    @property
    def frame_bytes(self) -> int | None:
        samples = self.frame_samples
        return None if samples is None else samples * self.bytes_per_sample

    @property
    def mime_type(self) -> str:
        return f"{MIME_TYPES[self.encoding]};rate={self.sample_rate_hz}"

    def samples_to_ms(self, n_samples: int) -> float:
        return n_samples * MS_PER_S / self.sample_rate_hz

    def wav_header(self, n_samples: int | None = None) -> bytes:
        bits = 8 * self.bytes_per_sample
        tag = WAV_FORMAT_TAGS[self.encoding]
        return wav_header(self.sample_rate_hz, bits=bits, n_samples=n_samples, format_tag=tag)


class AudioEncoder:
    """One per audio stream (a context). Stateful streaming resampler + encoder + framer."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._resampler = self._new_resampler()
        self._encode: Callable[[NDArray[Any]], bytes] = _ENCODERS[fmt.encoding]
        self._pending = bytearray()  # encoded output short of a whole frame
        self.samples_in = 0  # engine samples pushed
        self.samples_fed = 0  # engine samples given to the resampler (all of them: a drain feeds no silence)
        self.samples_resampled = 0  # output-rate samples the resampler has produced
        self.samples_out = 0  # output-rate samples in the frames returned so far (a drain's frame padding included)
        self.finished = False

    def push(self, pcm_24k: NDArray[Any]) -> list[bytes]:
        """Encoded frames ready now (maybe none: the resampler and the framer hold some back)."""
        self._require_open("push")
        x = _as_mono_float32(pcm_24k)
        self.samples_in += len(x)
        return self._frames(self._resample(x, last=False))

    def drain(self) -> list[bytes]:
        """Release everything held back; the stream stays open.

        Flushes the resampler: exactly the output its input determines comes out (what resampling the input
        since the last drain in one piece gives, no silence after it), and a fresh resampler takes what is
        pushed next. A partial fixed frame is then padded with silence to a whole one (the only padding).
        Use it when the listener is about to run out of audio, not between segments that follow each other:
        the restarted filter and a padded frame are not seamless.
        """
        self._require_open("drain")
        frames: list[bytes] = []
        if self._resampler is not None:
            frames += self._frames(self._resample(np.zeros(0, dtype=np.float32), last=True))
            self._resampler = self._new_resampler()
        frame_bytes = self.fmt.frame_bytes
        if frame_bytes is not None and self._pending:
            pad_samples = (frame_bytes - len(self._pending)) // self.fmt.bytes_per_sample
            frames += self._frame(self._encode(np.zeros(pad_samples, dtype=np.int16)))
        return frames

    def finish(self) -> list[bytes]:
        """Flush the resampler and the framer (the last frame may be short). The stream is then closed."""
        self._require_open("finish")
        frames = self._frames(self._resample(np.zeros(0, dtype=np.float32), last=True))
        if self._pending:
            frames.append(bytes(self._pending))
            self.samples_out += len(self._pending) // self.fmt.bytes_per_sample
            self._pending.clear()
        self.finished = True
        return frames

    def close(self) -> None:
        """Abandon the stream (a cancel): nothing more is encoded. Idempotent; nothing to release."""
        self.finished = True

    @property
    def samples_covered(self) -> int:
        """Output-rate samples a client can decode from the frames returned so far: all of `samples_out`."""
        return self.samples_out

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.fmt.sample_rate_hz == ENGINE_SAMPLE_RATE_HZ:
            return None
        return soxr.ResampleStream(ENGINE_SAMPLE_RATE_HZ, self.fmt.sample_rate_hz, 1, dtype="float32",
                                   quality=RESAMPLER_QUALITY)

    def _resample(self, x: NDArray[Any], last: bool) -> NDArray[Any]:
        # x: [samples] float32 at 24 kHz -> [samples'] float32 at the output rate
        self.samples_fed += len(x)
        y = x if self._resampler is None else self._resampler.resample_chunk(x, last=last)
        self.samples_resampled += len(y)
        return y

    def _frames(self, y: NDArray[Any]) -> list[bytes]:
        if not len(y):
            return []
        return self._frame(self._encode(float_to_pcm16(y)))

    def _frame(self, data: bytes) -> list[bytes]:
        frame_bytes = self.fmt.frame_bytes
        bps = self.fmt.bytes_per_sample
        if frame_bytes is None:
            self.samples_out += len(data) // bps
            return [data] if data else []
        self._pending += data
        whole = len(self._pending) // frame_bytes * frame_bytes
        frames = [bytes(self._pending[i : i + frame_bytes]) for i in range(0, whole, frame_bytes)]
        del self._pending[:whole]
        self.samples_out += whole // bps
        return frames

    def _require_open(self, verb: str) -> None:
        if self.finished:
            raise RuntimeError(f"AudioEncoder.{verb}() after finish()")


# ---- sample conversions ----------------------------------------------------------------------------


def float_to_pcm16(x: NDArray[Any]) -> NDArray[Any]:
    """[-1, 1] float -> int16: clip, scale by 32767, round half to even. NaN -> 0, +-inf -> full scale."""
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    pcm16: NDArray[np.int16] = np.rint(np.clip(x, -1.0, 1.0) * PCM16_FULL_SCALE).astype(np.int16)
    return pcm16


def pcm16_to_mulaw(pcm16: NDArray[Any]) -> NDArray[Any]:
    return _ULAW_ENCODE[np.asarray(pcm16, dtype=np.int16).view(np.uint16)]


def pcm16_to_alaw(pcm16: NDArray[Any]) -> NDArray[Any]:
    return _ALAW_ENCODE[np.asarray(pcm16, dtype=np.int16).view(np.uint16)]


def mulaw_to_pcm16(codes: NDArray[Any]) -> NDArray[Any]:
    return _ULAW_DECODE[np.asarray(codes, dtype=np.uint8)]


def alaw_to_pcm16(codes: NDArray[Any]) -> NDArray[Any]:
    return _ALAW_DECODE[np.asarray(codes, dtype=np.uint8)]


def wav_header(
    sample_rate_hz: int,
    n_channels: int = 1,
    bits: int = 16,
    n_samples: int | None = None,
    format_tag: int = WAVE_FORMAT_PCM,
) -> bytes:
    """A RIFF/WAVE header. n_samples None: a streaming header whose sizes say "unknown" (0xFFFFFFFF).

    Non-PCM tags (mu-law 7, A-law 6) get the 18-byte fmt chunk and the fact chunk the spec asks for.
    No pad byte is accounted for: for an odd data length the caller appends one if it cares.
    """
    if sample_rate_hz <= 0:
        raise ValueError("sample_rate_hz must be > 0")
    if n_channels < 1:
        raise ValueError("n_channels must be >= 1")
    if bits not in WAV_BITS:
        raise ValueError(f"bits must be one of {WAV_BITS}")
    if n_samples is not None and n_samples < 0:
        raise ValueError("n_samples must be >= 0")
    block_align = n_channels * bits // 8
    byte_rate = sample_rate_hz * block_align
    common = (format_tag, n_channels, sample_rate_hz, byte_rate, block_align, bits)
    if format_tag == WAVE_FORMAT_PCM:
        fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, *common)
        fact_chunk = b""
    else:
        fmt_chunk = struct.pack("<4sIHHIIHHH", b"fmt ", 18, *common, 0)
        fact_chunk = struct.pack("<4sII", b"fact", 4, WAV_UNKNOWN_SIZE if n_samples is None else n_samples)
    if n_samples is None:
        data_bytes = riff_bytes = WAV_UNKNOWN_SIZE
    else:
        data_bytes = n_samples * block_align
        riff_bytes = 4 + len(fmt_chunk) + len(fact_chunk) + 8 + data_bytes
        if riff_bytes >= WAV_UNKNOWN_SIZE:
            raise ValueError("n_samples: too long for a WAV file")
    riff_chunk = struct.pack("<4sI4s", b"RIFF", riff_bytes, b"WAVE")
    return riff_chunk + fmt_chunk + fact_chunk + struct.pack("<4sI", b"data", data_bytes)


# ---- internals -------------------------------------------------------------------------------------


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_mono_float32(pcm: NDArray[Any]) -> NDArray[Any]:
    x = np.ascontiguousarray(pcm, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"pcm_24k must be mono, shape [samples] (got shape {x.shape})")
    return x


def _all_int16_by_uint16_index() -> NDArray[Any]:
    """Every int16 value, in the order of its uint16 bit pattern (so tables index with .view(uint16))."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16).astype(np.int32)


def _build_ulaw_encode() -> NDArray[Any]:
    x = _all_int16_by_uint16_index() >> ULAW_INPUT_SHIFT
    negative = x < 0
    magnitude = np.minimum(np.abs(x), ULAW_CLIP) + (ULAW_BIAS >> ULAW_INPUT_SHIFT)
    seg = np.searchsorted(ULAW_SEGMENT_ENDS, magnitude)  # 0..8; 8: beyond the last segment
    in_range = np.minimum(seg, N_SEGMENTS - 1)
    code = (in_range << SEG_SHIFT) | ((magnitude >> (in_range + 1)) & QUANT_MASK)
    code = np.where(seg >= N_SEGMENTS, 0x7F, code)
    mask = np.where(negative, 0x7F, 0xFF)
    table: NDArray[np.uint8] = (code ^ mask).astype(np.uint8)
    return table


def _build_alaw_encode() -> NDArray[Any]:
    x = _all_int16_by_uint16_index() >> ALAW_INPUT_SHIFT
    negative = x < 0
    magnitude = np.where(negative, -x - 1, x)  # 0..4095
    seg = np.searchsorted(ALAW_SEGMENT_ENDS, magnitude)  # 0..7 for 16-bit input
    shift = np.where(seg < 2, 1, seg)
    code = (seg << SEG_SHIFT) | ((magnitude >> shift) & QUANT_MASK)
    mask = np.where(negative, ALAW_NEGATIVE_MASK, ALAW_POSITIVE_MASK)
    table: NDArray[np.uint8] = (code ^ mask).astype(np.uint8)
    return table


def _build_ulaw_decode() -> NDArray[Any]:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & QUANT_MASK) << 3) + ULAW_BIAS) << ((u & 0x70) >> SEG_SHIFT)
    return np.where(u & SIGN_BIT, ULAW_BIAS - t, t - ULAW_BIAS).astype(np.int16)


def _build_alaw_decode() -> NDArray[Any]:
    a = np.arange(256, dtype=np.int32) ^ ALAW_NEGATIVE_MASK
    t = (a & QUANT_MASK) << SEG_SHIFT
    seg = (a & 0x70) >> SEG_SHIFT
    t = np.where(seg == 0, t + 8, (t + ALAW_SEG1_OFFSET) << np.maximum(seg - 1, 0))
    return np.where(a & SIGN_BIT, t, -t).astype(np.int16)


_ULAW_ENCODE = _build_ulaw_encode()  # [65536] uint8, indexed by int16 bits
_ALAW_ENCODE = _build_alaw_encode()
_ULAW_DECODE = _build_ulaw_decode()  # [256] int16
_ALAW_DECODE = _build_alaw_decode()

_ENCODERS: Mapping[Encoding, Callable[[NDArray[Any]], bytes]] = {
    "pcm_s16le": lambda pcm16: pcm16.astype("<i2", copy=False).tobytes(),
    "mulaw": lambda pcm16: pcm16_to_mulaw(pcm16).tobytes(),
    "alaw": lambda pcm16: pcm16_to_alaw(pcm16).tobytes(),
}
