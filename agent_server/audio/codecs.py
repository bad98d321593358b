"""Streaming encoders: every output format a client can ask for, behind one interface.

`StreamFormat` says what goes on the wire (container, codec, sample rate, bit rate, raw framing) and
`make_encoder(fmt)` builds the per-context encoder. Every encoder, raw or compressed, is a
`StreamEncoder`:

    enc = make_encoder(fmt)
    enc.push(pcm_24k) -> list[bytes]   # what can go out now (the first push always yields bytes)
    enc.drain() -> list[bytes]         # the listener runs dry: release everything held back (pads to a frame)
    enc.finish() -> list[bytes]        # the end: flush and close; the pieces concatenate to a valid file
    enc.close()                        # abandon (a cancel): release the codec, emit nothing

Raw PCM16 / mu-law / A-law are `audio.AudioEncoder` itself; float32 PCM and WAV wrap it; MP3 (LAME),
Opus (in Ogg or WebM), AAC (ADTS) and FLAC go through PyAV, whose wheels bundle these encoders. The
compressed encoders reuse `AudioEncoder` as their front end (soxr resampling to the codec's rate, drain),
then cut codec frames, encode and mux into an in-memory sink; muxers are set to write every packet at
once (Ogg pages and WebM clusters of one packet), so bytes come out with each chunk, not at the end.

Counters (what `core/stream.SpeechStream` reads to place segments on the output timeline), the same meaning
for every encoder: `samples_in` (24 kHz samples pushed), `samples_fed` (where the next sample pushed sits on
the 24 kHz timeline: the samples given to the resampler), `samples_resampled` (output-rate samples the
resampler made), `samples_out` (output-rate samples in the stream so far, padding included: after a drain,
`samples_out - samples_resampled` is the padding added so far), `samples_covered` (how many of
`samples_out` a client can decode from the bytes returned so far: a codec returns a frame's packet a few
frames later; `samples_out - samples_covered` is what it still holds).

A drain costs silence (a partial codec frame padded, then silent frames until the codec's held-back packets
are out: 20-300 ms by codec and bit rate, docs/compatibility.md), so a stream drains only when its listener
would otherwise run dry; between segments that follow each other the codec simply goes on, a frame
straddling the boundary, and priming and encoder delay are paid once per context.

Timeline as a client decodes it: MP3 and ADTS AAC carry no gapless metadata in a stream, so a decoder
plays the encoder's priming first (LAME 1105 samples, AAC 1024 samples: 46 ms and 43 ms at 24 kHz) and a
last frame's padding after; Ogg/WebM Opus and FLAC say where the audio starts and ends, so they decode
to exactly the samples pushed (plus drain silence).

Encoding costs CPU: run pushes off the event loop (`agent_server.encode_lane`). Encoders are not
thread-safe; one context's operations must run one at a time, in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import av
import numpy as np
import numpy.typing as npt
from av.audio.stream import AudioStream

from agent_server.audio.formats import (
    ENGINE_SAMPLE_RATE_HZ,
    PCM_SAMPLE_RATES_HZ,
    SAMPLE_RATES_HZ,
    WAVE_FORMAT_ALAW,
    WAVE_FORMAT_MULAW,
    WAVE_FORMAT_PCM,
    AudioEncoder,
    OutputFormat,
    wav_header,
)

Container = Literal["raw", "wav", "mp3", "ogg", "webm", "adts", "flac"]
Codec = Literal["pcm_s16le", "pcm_f32le", "mulaw", "alaw", "mp3", "opus", "aac", "flac"]
CONTAINERS: tuple[Container, ...] = get_args(Container)
CHANNELS = 1  # every vendor format served is mono
PCM16_SCALE = 32_768.0  # int16 -> float in [-1, 1)
WAVE_FORMAT_IEEE_FLOAT = 3

# Which codecs each container carries.
CONTAINER_CODECS: Mapping[Container, tuple[Codec, ...]] = {
    "raw": ("pcm_s16le", "pcm_f32le", "mulaw", "alaw"),
    "wav": ("pcm_s16le", "pcm_f32le", "mulaw", "alaw"),
    "mp3": ("mp3",),
    "ogg": ("opus",),
    "webm": ("opus",),
    "adts": ("aac",),
    "flac": ("flac",),
}
OPUS_SAMPLE_RATES_HZ = (8_000, 16_000, 24_000, 48_000)  # libopus' input rates that the resampler serves
CODEC_SAMPLE_RATES_HZ: Mapping[Codec, tuple[int, ...]] = {
    "pcm_s16le": SAMPLE_RATES_HZ["pcm_s16le"],
    "pcm_f32le": SAMPLE_RATES_HZ["pcm_s16le"],
    "mulaw": SAMPLE_RATES_HZ["mulaw"],
    "alaw": SAMPLE_RATES_HZ["alaw"],
    "mp3": PCM_SAMPLE_RATES_HZ,
    "opus": OPUS_SAMPLE_RATES_HZ,
    "aac": PCM_SAMPLE_RATES_HZ,
    "flac": PCM_SAMPLE_RATES_HZ,
}
OPUS_BITRATE_RANGE_BPS = (6_000, 510_000)
AAC_MIN_BITRATE_BPS = 8_000
AAC_BITS_PER_FRAME_PER_CHANNEL = 6_144  # ffmpeg's aac: at most 6144 bits per 1024-sample frame and channel
AAC_FRAME_SAMPLES = 1_024
MP3_MPEG1_MIN_RATE_HZ = 32_000  # MPEG-1 layer III: 32-48 kHz, 32-320 kbit/s
MP3_MPEG2_MIN_RATE_HZ = 16_000  # MPEG-2: 16-24 kHz, 8-160 kbit/s; below: MPEG-2.5, 8-64 kbit/s
MP3_BITRATE_RANGES_BPS = ((32_000, 320_000), (8_000, 160_000), (8_000, 64_000))
DEFAULT_BITRATES_BPS: Mapping[Codec, int] = {"mp3": 128_000, "opus": 64_000, "aac": 64_000}
# What a decoder plays before the first pushed sample in streams without gapless metadata (MP3 frames,
# ADTS): LAME's encoder delay, AAC's priming frame. Ogg/WebM Opus and FLAC signal theirs: zero lead.
PRIMING_SAMPLES: Mapping[Codec, int] = {"mp3": 1_105, "aac": 1_024}
MS_PER_S = 1_000.0
MIME_TYPES: Mapping[Container, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "ogg": "audio/ogg",
    "webm": "audio/webm",
    "adts": "audio/aac",
    "flac": "audio/flac",
}


def bitrate_range_bps(codec: Codec, sample_rate_hz: int) -> tuple[int, int] | None:
    """The bit rates `codec` takes at `sample_rate_hz` (inclusive), or None when it has no bit rate."""
    if codec == "mp3":
        if sample_rate_hz >= MP3_MPEG1_MIN_RATE_HZ:
            return MP3_BITRATE_RANGES_BPS[0]
        return MP3_BITRATE_RANGES_BPS[1 if sample_rate_hz >= MP3_MPEG2_MIN_RATE_HZ else 2]
    if codec == "opus":
        return OPUS_BITRATE_RANGE_BPS
    if codec == "aac":
        top = AAC_BITS_PER_FRAME_PER_CHANNEL * CHANNELS * sample_rate_hz // AAC_FRAME_SAMPLES
        return AAC_MIN_BITRATE_BPS, top
    return None


def clamp_bitrate_bps(codec: Codec, sample_rate_hz: int, bitrate_bps: int | None) -> int | None:
    """The nearest bit rate `codec` takes at that rate (None for codecs without one, or when None given)."""
    span = bitrate_range_bps(codec, sample_rate_hz)
    if span is None or bitrate_bps is None:
        return None
    return min(max(bitrate_bps, span[0]), span[1])


@dataclass(frozen=True, slots=True)
class StreamFormat:
    """What one context's audio looks like on the wire. Validated on construction (ValueError naming the
    field). `bitrate_bps` None: the codec's default (compressed) or none (PCM, FLAC). `frame_ms`: fixed
    frames for raw PCM/G.711 (see audio.OutputFormat); None for everything else."""

    container: Container
    codec: Codec
    sample_rate_hz: int
    bitrate_bps: int | None = None
    frame_ms: int | None = None

    def __post_init__(self) -> None:
        if self.container not in CONTAINERS:
            raise ValueError(f"container: must be one of {', '.join(CONTAINERS)} (got {self.container!r})")
        allowed = CONTAINER_CODECS[self.container]
        if self.codec not in allowed:
            raise ValueError(f"codec: a {self.container} stream carries {', '.join(allowed)} (got {self.codec!r})")
        rates = CODEC_SAMPLE_RATES_HZ[self.codec]
        if self.sample_rate_hz not in rates:
            listed = ", ".join(str(r) for r in rates)
            raise ValueError(f"sample_rate_hz: {self.codec} is served at {listed} Hz (got {self.sample_rate_hz})")
        span = bitrate_range_bps(self.codec, self.sample_rate_hz)
        if self.bitrate_bps is not None:
            if span is None:
                raise ValueError(f"bitrate_bps: {self.codec} has no bit rate to choose (got {self.bitrate_bps})")
            if not span[0] <= self.bitrate_bps <= span[1]:
                raise ValueError(
                    f"bitrate_bps: {self.codec} at {self.sample_rate_hz} Hz takes {span[0]}..{span[1]} "
                    f"bit/s (got {self.bitrate_bps})"
                )
        if self.frame_ms is not None and self.container != "raw":
            raise ValueError("frame_ms: fixed frames are for raw PCM only")
        if self.container in ("raw", "wav"):
            _ = self.pcm_format  # OutputFormat checks frame_ms against the rate

    @classmethod
    def raw(cls, fmt: OutputFormat) -> StreamFormat:
        """The raw stream of a PCM/G.711 `OutputFormat` (the native protocol's formats)."""
        return cls("raw", fmt.encoding, fmt.sample_rate_hz, frame_ms=fmt.frame_ms)

    @property
    def is_compressed(self) -> bool:
        """Encoded by a codec library (CPU work worth moving off the event loop)."""
        return self.container not in ("raw", "wav")

    @property
    def pcm_format(self) -> OutputFormat:
        """The PCM/G.711 stream underneath a raw or WAV format (float32 is made from PCM16)."""
        if self.is_compressed:
            raise ValueError(f"{self.container} is not a PCM stream")
        encoding = "pcm_s16le" if self.codec == "pcm_f32le" else self.codec
        return OutputFormat(encoding, self.sample_rate_hz, self.frame_ms)  # type: ignore[arg-type]

    @property
    def effective_bitrate_bps(self) -> int | None:
        if self.bitrate_bps is not None or bitrate_range_bps(self.codec, self.sample_rate_hz) is None:
            return self.bitrate_bps
        return clamp_bitrate_bps(self.codec, self.sample_rate_hz, DEFAULT_BITRATES_BPS[self.codec])

    @property
    def lead_ms(self) -> float:
        """How much later than our timeline a client's decoder plays each sample (`timestamps.lead_ms`)."""
        return PRIMING_SAMPLES.get(self.codec, 0) * MS_PER_S / self.sample_rate_hz

    @property
    def mime_type(self) -> str:
        if self.container == "raw":
            if self.codec == "pcm_f32le":
                return f"audio/pcm;rate={self.sample_rate_hz};encoding=float"
            return self.pcm_format.mime_type
        return MIME_TYPES[self.container]


@dataclass(frozen=True, slots=True)
class EncoderCounts:
    """A `StreamEncoder`'s counters at one moment (what a stream reads of an encoder that runs on
    another thread: a snapshot taken by that thread after each call)."""

    samples_fed: int = 0
    samples_resampled: int = 0
    samples_out: int = 0
    samples_covered: int = 0

    @classmethod
    def of(cls, encoder: StreamEncoder) -> EncoderCounts:
        return cls(encoder.samples_fed, encoder.samples_resampled, encoder.samples_out, encoder.samples_covered)


class StreamEncoder(Protocol):
    """One per context. Not thread-safe: one operation at a time, in order."""

    @property
    def samples_in(self) -> int: ...
    @property
    def samples_fed(self) -> int: ...
    @property
    def samples_resampled(self) -> int: ...
    @property
    def samples_out(self) -> int: ...
    @property
    def samples_covered(self) -> int: ...
    @property
    def finished(self) -> bool: ...

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> list[bytes]: ...
    def drain(self) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...
    def close(self) -> None: ...


def make_encoder(fmt: StreamFormat, speed: float = 1.0) -> StreamEncoder:
    """The encoder of `fmt`; with `speed` != 1, the audio is played that much faster (`TempoEncoder`)."""
    inner: StreamEncoder
    if fmt.is_compressed:
        inner = CompressedEncoder(fmt)
    else:
        inner = AudioEncoder(fmt.pcm_format)
        if fmt.codec == "pcm_f32le":
            inner = Float32Encoder(inner)
        if fmt.container == "wav":
            inner = WavEncoder(inner, _streaming_wav_header(fmt))
    return inner if speed == 1.0 else TempoEncoder(inner, speed)


def _streaming_wav_header(fmt: StreamFormat) -> bytes:
    """RIFF sizes 0xFFFFFFFF ("unknown"), what ffmpeg, browsers and Python's wave module accept."""
    tags = {"pcm_s16le": WAVE_FORMAT_PCM, "pcm_f32le": WAVE_FORMAT_IEEE_FLOAT, "mulaw": WAVE_FORMAT_MULAW,
            "alaw": WAVE_FORMAT_ALAW}
    bits = {"pcm_s16le": 16, "pcm_f32le": 32, "mulaw": 8, "alaw": 8}
    return wav_header(fmt.sample_rate_hz, CHANNELS, bits[fmt.codec], None, tags[fmt.codec])


# ---- wrappers over AudioEncoder ---------------------------------------------------------------------


class _Wrapper:
    """Delegates the counters to the wrapped encoder."""

    def __init__(self, inner: StreamEncoder) -> None:
        self._inner = inner

    @property
    def samples_in(self) -> int:
        return self._inner.samples_in

    @property
    def samples_fed(self) -> int:
        return self._inner.samples_fed

    @property
    def samples_resampled(self) -> int:
        return self._inner.samples_resampled

    @property
    def samples_out(self) -> int:
        return self._inner.samples_out

    @property
    def samples_covered(self) -> int:
        return self._inner.samples_covered

    @property
    def finished(self) -> bool:
        return self._inner.finished

    def close(self) -> None:
        self._inner.close()


class Float32Encoder(_Wrapper):
    """Little-endian float32 PCM made from the PCM16 stream (each sample exactly int16 / 32768)."""

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> list[bytes]:
        return self._convert(self._inner.push(pcm_24k))

    def drain(self) -> list[bytes]:
        return self._convert(self._inner.drain())

    def finish(self) -> list[bytes]:
        return self._convert(self._inner.finish())

    @staticmethod
    def _convert(frames: list[bytes]) -> list[bytes]:
        return [(np.frombuffer(f, dtype="<i2").astype("<f4") / np.float32(PCM16_SCALE)).tobytes() for f in frames]


class WavEncoder(_Wrapper):
    """A streaming WAV file: the header goes out with the first output, then the wrapped stream."""

    def __init__(self, inner: StreamEncoder, header: bytes) -> None:
        super().__init__(inner)
        self._header: bytes | None = header

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> list[bytes]:
        return self._with_header(self._inner.push(pcm_24k))

    def drain(self) -> list[bytes]:
        return self._with_header(self._inner.drain())

    def finish(self) -> list[bytes]:
        return self._with_header(self._inner.finish())

    def _with_header(self, frames: list[bytes]) -> list[bytes]:
        if self._header is None:
            return frames
        header, self._header = self._header, None
        return [header, *frames]


# ---- speed: FFmpeg's atempo ----------------------------------------------------------------------------

MIN_SPEED = 0.25
MAX_SPEED = 4.0
ATEMPO_MIN, ATEMPO_MAX = 0.5, 2.0  # one atempo filter's best range; beyond it, two in a chain
TEMPO_FRAME_SAMPLES = 480  # 20 ms: what the filter is fed at a time (_Tempo.push)


def atempo_factors(speed: float) -> list[float]:
    """`speed` as a chain of atempo factors, each in [0.5, 2] (where the filter keeps its quality)."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}] (got {speed})")
    if speed < ATEMPO_MIN:
        return [ATEMPO_MIN, speed / ATEMPO_MIN]
    if speed > ATEMPO_MAX:
        return [ATEMPO_MAX, speed / ATEMPO_MAX]
    return [speed]


class _Tempo:
    """One run of FFmpeg's `atempo` (WSOLA: the tempo changes, the pitch does not) on 24 kHz float PCM.
    It holds back ~100 ms (its window, and the frame it answers only when the next comes) until more audio or
    `flush`, after which it is spent."""

    def __init__(self, speed: float) -> None:
        graph = av.filter.Graph()
        node = graph.add_abuffer(format="flt", sample_rate=ENGINE_SAMPLE_RATE_HZ, layout="mono")
        for factor in atempo_factors(speed):
            tempo = graph.add("atempo", f"{factor:.9g}")
            node.link_to(tempo)
            node = tempo
        node.link_to(graph.add("abuffersink"))
        graph.configure()
        self._graph = graph

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """What the filter gives back for `pcm_24k`. It is fed in 20 ms frames: atempo answers a frame only when
        the next one comes, so one whole chunk in one frame would hold that chunk back until the next (the
        first audio of a turn with it); fed in small frames, it holds back ~100 ms."""
        pcm = np.ascontiguousarray(pcm_24k, dtype=np.float32)
        pieces: list[npt.NDArray[np.float32]] = []
        for at in range(0, pcm.size, TEMPO_FRAME_SAMPLES):
            frame = av.AudioFrame.from_ndarray(pcm[None, at:at + TEMPO_FRAME_SAMPLES], format="flt", layout="mono")
            frame.sample_rate = ENGINE_SAMPLE_RATE_HZ
            self._graph.push(frame)
            pieces.append(self._pull())
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def flush(self) -> npt.NDArray[np.float32]:
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> npt.NDArray[np.float32]:
        pieces: list[npt.NDArray[np.float32]] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            pieces.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


class TempoEncoder(_Wrapper):
    """The wrapped encoder fed audio played `speed` times faster, its pitch kept (FFmpeg's atempo through
    PyAV): n samples in come out as n / speed. A drain or the finish flushes the filter first (so nothing it
    holds is lost), and a drain starts a fresh filter for what follows.

    Counters: `samples_in` is the engine's audio pushed; `samples_fed`, where the next sample pushed will sit
    on the output's 24 kHz timeline (the inner encoder's count, plus what the filter holds, at the new tempo),
    so segments are placed where they play."""

    def __init__(self, inner: StreamEncoder, speed: float) -> None:
        super().__init__(inner)
        self.speed = speed
        self._tempo: _Tempo | None = _Tempo(speed)
        self._in = 0  # samples pushed into the current filter
        self._out = 0  # samples it gave back
        self._samples_in = 0

    @property
    def samples_in(self) -> int:
        return self._samples_in

    @property
    def samples_fed(self) -> int:
        return self._inner.samples_fed + round(self._in / self.speed) - self._out

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> list[bytes]:
        self._samples_in += pcm_24k.size
        self._in += pcm_24k.size
        faster = self._filter().push(pcm_24k)
        self._out += faster.size
        return self._inner.push(faster) if faster.size else []

    def drain(self) -> list[bytes]:
        frames = self._flush()
        return frames + self._inner.drain()

    def finish(self) -> list[bytes]:
        frames = self._flush()
        return frames + self._inner.finish()

    def _filter(self) -> _Tempo:
        if self._tempo is None:
            self._tempo = _Tempo(self.speed)
        return self._tempo

    def _flush(self) -> list[bytes]:
        tempo, self._tempo = self._tempo, None
        rest = tempo.flush() if tempo is not None and self._in else np.zeros(0, dtype=np.float32)
        self._in = self._out = 0
        return self._inner.push(rest) if rest.size else []


# ---- compressed: PyAV -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _AvSetup:
    codec: str  # FFmpeg encoder
    muxer: str  # FFmpeg muxer
    sample_format: str  # what the encoder takes: "fltp"/"flt" float, "s16" int16
    muxer_options: Mapping[str, str] = field(default_factory=dict)
    held_packets: int = 0  # packets the muxer keeps until the next one comes (Ogg keeps its last page open)


# every packet written through at once; bitexact: no random serials/UIDs nor version tags, so the same audio
# gives the same bytes (as the engine's seeds promise)
_FLUSH_EACH_PACKET = {"flush_packets": "1", "fflags": "+bitexact"}
_AV_SETUPS: Mapping[Container, _AvSetup] = {
    # no ID3 tag and no Xing frame (a stream cannot go back to fill it in): plain MPEG frames
    "mp3": _AvSetup("libmp3lame", "mp3", "fltp", {**_FLUSH_EACH_PACKET, "id3v2_version": "0", "write_xing": "0"}),
    # one page per packet (page_duration in microseconds; the default 1 s holds audio back for a second)
    "ogg": _AvSetup("libopus", "ogg", "flt", {**_FLUSH_EACH_PACKET, "page_duration": "1"}, held_packets=1),
    # a cluster per packet (cluster_time_limit in ms), written as a live stream
    "webm": _AvSetup("libopus", "webm", "flt", {**_FLUSH_EACH_PACKET, "live": "1", "cluster_time_limit": "0"},
                     held_packets=2),
    "adts": _AvSetup("aac", "adts", "fltp", _FLUSH_EACH_PACKET),
    "flac": _AvSetup("flac", "flac", "s16", _FLUSH_EACH_PACKET),
}
MAX_DRAIN_FRAMES = 16  # silent codec frames a drain may feed to get the codec's held-back audio out


class _Sink:
    """A write-only, non-seekable file for the muxer: collects what it writes until taken."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self._buf)
        self._buf.clear()
        return data


class CompressedEncoder:
    """MP3 / Opus (Ogg, WebM) / AAC (ADTS) / FLAC through PyAV. The container header is ready at
    construction and goes out with the first push."""

    def __init__(self, fmt: StreamFormat) -> None:
        if not fmt.is_compressed:
            raise ValueError(f"{fmt.container} is not a compressed format")
        setup = _AV_SETUPS[fmt.container]
        self.fmt = fmt
        self._front = AudioEncoder(OutputFormat("pcm_s16le", fmt.sample_rate_hz))  # resampler + drain
        self._sink = _Sink()
        self._container = av.open(self._sink, "w", format=setup.muxer, options=dict(setup.muxer_options))
        stream = self._container.add_stream(setup.codec, rate=fmt.sample_rate_hz)
        if not isinstance(stream, AudioStream):
            raise TypeError(f"{setup.codec} did not make an audio stream")
        ctx = stream.codec_context
        ctx.layout = "mono"
        ctx.format = setup.sample_format
        bitrate = fmt.effective_bitrate_bps
        if bitrate is not None:
            ctx.bit_rate = bitrate
        self._stream = stream
        self._container.start_encoding()  # opens the codec, writes the container header into the sink
        self._sample_format = setup.sample_format
        self._held_packets = setup.held_packets
        self._frame_samples: int = ctx.frame_size
        self._pending: npt.NDArray[np.int16] = np.zeros(0, dtype=np.int16)  # output-rate samples short of a codec frame
        self._next_pts = 0  # output-rate samples given to the codec so far
        self._encoded_end = 0  # end (in samples) of the audio the packets so far cover
        self.finished = False

    # ---- counters: the front end's, plus the codec-frame padding ----

    @property
    def samples_in(self) -> int:
        return self._front.samples_in

    @property
    def samples_fed(self) -> int:
        return self._front.samples_fed

    @property
    def samples_resampled(self) -> int:
        return self._front.samples_resampled

    @property
    def samples_out(self) -> int:
        return self._next_pts

    @property
    def samples_covered(self) -> int:
        held_by_muxer = self._held_packets * self._frame_samples  # (Ogg keeps its last page open)
        return max(0, min(self._encoded_end, self._next_pts) - held_by_muxer)

    # ---- the interface ----

    def push(self, pcm_24k: npt.NDArray[np.float32]) -> list[bytes]:
        self._require_open("push")
        self._queue(self._front.push(pcm_24k))
        self._encode_whole_frames()
        return self._take()

    def drain(self) -> list[bytes]:
        """Everything pushed so far is out after this (as Ogg/WebM pages, MP3/AAC frames): the resampler's
        tail, the partial codec frame padded with silence, and the frames the codec holds back (fed
        silent frames until its packets cover the real audio). The stream stays open."""
        self._require_open("drain")
        self._queue(self._front.drain())
        self._encode_whole_frames()
        real_end = self._next_pts + len(self._pending)
        if self._pending.size:
            pad = self._frame_samples - self._pending.size
            self._pending = np.concatenate([self._pending, np.zeros(pad, dtype=np.int16)])
            self._encode_whole_frames()
        silent = np.zeros(self._frame_samples, dtype=np.int16)
        extra = self._held_packets  # then push the packets the muxer holds back out
        for _ in range(MAX_DRAIN_FRAMES):
            if self._encoded_end >= real_end:
                if extra == 0:
                    break
                extra -= 1
            self._encode(silent)
        return self._take()

    def finish(self) -> list[bytes]:
        self._require_open("finish")
        self._queue(self._front.finish())
        self._encode_whole_frames()
        if self._pending.size:  # every codec here takes a short last frame
            self._encode(self._pending)
            self._pending = self._pending[:0]
        self._mux(self._stream.encode(None))
        self._container.close()  # trailer
        self.finished = True
        data = self._take()
        self._release()
        return data

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._front.close()
        self._container.close()
        self._release()

    def _release(self) -> None:
        """Drop the codec now: its resampler's filter graph holds worker threads (2 per encoder) until the codec
        context is freed, which a reference cycle would leave to the garbage collector (threads piled up by the
        dozen on a busy server)."""
        del self._stream, self._container

    # ---- internals ----

    def _require_open(self, verb: str) -> None:
        if self.finished:
            raise RuntimeError(f"CompressedEncoder.{verb}() after finish() or close()")

    def _queue(self, frames: list[bytes]) -> None:
        if frames:
            self._pending = np.concatenate([self._pending, *(np.frombuffer(f, dtype="<i2") for f in frames)])

    def _encode_whole_frames(self) -> None:
        n = self._frame_samples
        whole = self._pending.size // n * n
        for i in range(0, whole, n):
            self._encode(self._pending[i : i + n])
        self._pending = self._pending[whole:]

    def _encode(self, pcm16: npt.NDArray[np.int16]) -> None:
        # pcm16: [samples] int16 at the codec's rate
        planes: npt.NDArray[np.generic]  # [1, samples]: one plane (mono), the encoder's sample type
        if self._sample_format == "s16":
            planes = pcm16[None, :]
        else:
            planes = (pcm16.astype(np.float32) / np.float32(PCM16_SCALE))[None, :]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes), format=self._sample_format, layout="mono")
        frame.sample_rate = self.fmt.sample_rate_hz
        frame.pts = self._next_pts
        self._next_pts += pcm16.size
        self._mux(self._stream.encode(frame))

    def _mux(self, packets: list[av.Packet]) -> None:  # type: ignore[type-arg]
        for packet in packets:
            if packet.pts is not None and packet.duration:
                self._encoded_end = max(self._encoded_end, packet.pts + packet.duration)
            self._container.mux(packet)

    def _take(self) -> list[bytes]:
        data = self._sink.take()
        return [data] if data else []

