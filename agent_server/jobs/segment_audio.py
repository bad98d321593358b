"""How a finished job segment's audio is stored: Ogg Opus, one small file per segment, decoded to the same PCM
by every replica.

    blob = encode_segment(pcm_24k)     # float32 24 kHz mono -> Ogg Opus bytes (b"" for no audio)
    pcm = decode_segment(blob)         # -> float32 24 kHz mono, exactly as many samples as were encoded

Encoding: our own `codecs.CompressedEncoder` (libopus at 24 kHz, `SEGMENT_BITRATE_BPS`, bitexact Ogg: the same
PCM always gives the same bytes). Decoding: FFmpeg's Opus decoder through PyAV, which renders 48 kHz and trims
the encoder's pre-skip and the last packet's padding from the Ogg granule positions (so exactly twice the
samples encoded come out), then one soxr 'HQ' pass down to 24 kHz, of the whole segment at once. All of it is
deterministic: a segment decodes to the same samples on every call, so any replica assembles the same file.

Opus is lossy: the decoded PCM is close to, not equal to, what the engine made (32 kbit/s mono speech is
near-transparent). Stored size: ~5.7 kB per audio second on a voiced test signal (scripts/bench_jobs_cpu.py), of which
~1.4 kB/s is Ogg page headers (the streaming muxer writes a page per 20 ms packet); a 200,000-character job is
~3.5 h of audio, ~70 MB stored, 1/17 of float32 PCM.
"""

from __future__ import annotations

import io

import av
import numpy as np
import numpy.typing as npt
import soxr

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.audio.formats import ENGINE_SAMPLE_RATE_HZ, RESAMPLER_QUALITY

Pcm = npt.NDArray[np.float32]

SEGMENT_BITRATE_BPS = 32_000
SEGMENT_FORMAT = StreamFormat("ogg", "opus", ENGINE_SAMPLE_RATE_HZ, SEGMENT_BITRATE_BPS)
OPUS_DECODE_RATE_HZ = 48_000  # what FFmpeg's Opus decoder renders, whatever the input rate was


class SegmentAudioError(ValueError):
    """A stored segment that does not decode (a corrupted or foreign blob)."""


def encode_segment(pcm_24k: Pcm) -> bytes:
    pcm = np.ascontiguousarray(pcm_24k, dtype=np.float32).reshape(-1)
    if pcm.size == 0:
        return b""
    encoder = make_encoder(SEGMENT_FORMAT)
    return b"".join(encoder.push(pcm)) + b"".join(encoder.finish())


def decode_segment(blob: bytes) -> Pcm:
    if not blob:
        return np.zeros(0, dtype=np.float32)
    try:
        with av.open(io.BytesIO(blob), "r") as container:
            stream = container.streams.audio[0]
            if stream.codec_context.name != "opus":
                raise SegmentAudioError(f"a segment holds {stream.codec_context.name}, not opus")
            planes = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
    except av.FFmpegError as exc:
        raise SegmentAudioError(f"segment audio does not decode: {exc}") from exc
    # pcm_48k: [2 * samples] float32, the granule-trimmed decode
    pcm_48k = np.concatenate(planes).astype(np.float32, copy=False) if planes else np.zeros(0, dtype=np.float32)
    if pcm_48k.size % 2:
        raise SegmentAudioError(f"{pcm_48k.size} samples at 48 kHz: not a whole number at 24 kHz")
    pcm: Pcm = soxr.resample(pcm_48k, OPUS_DECODE_RATE_HZ, ENGINE_SAMPLE_RATE_HZ, quality=RESAMPLER_QUALITY)
    return pcm.astype(np.float32, copy=False)
