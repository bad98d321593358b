"""Seams a listener would hear at the streaming vocoder's joins (synth/vocoder.py), on tiny S3Gens built so that a
seam is large and nothing else is.

test_vocoder.py bounds a stream's distance from its one-shot render by HiFT's noise floor over the whole utterance and
checks sample steps only at the chunk boundaries: a reversed crossfade or a left context of 0 passes both. A seam's
damage lies after the boundary: the crossfade runs over the 8 held-back frames (160 ms) after it, and the first frames
of a new render (where a window without left context goes wrong) follow those.

The S3Gen here is the tiny Turbo one (2 mean-flow steps) with its flow made local: the output projection of every
attention layer (encoder and estimator) is zeroed, so a mel frame depends only on the tokens and noise a few frames
around it (the convolutions), and a window with 25 tokens of left context and 3 of lookahead renders exactly the frames
the one-shot render does. Its f0 predictor says unvoiced (f0 < 10 Hz), so HiFT's source is the stream's counter noise
by absolute sample, the same in both. A streamed utterance is then its one-shot render (measured: 0.2 % relative
error) except where a join leaves a mark.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from chatterbox.models.s3gen import S3Gen

from synth.tiny_s3gen import build_s3gen
from synth.vocoder import SAMPLES_PER_MEL_FRAME, SAMPLES_PER_TOKEN, Pcm, RenderJob, StreamingVocoder, VocoderStream

from tests.synth.test_vocoder import reference_wav, utterance

PROMPT_TOKENS = 50
SCHEDULE = [10, 6, 9, 14, 7, 20, 12, 6]  # pushes of an 84-token utterance: 7 joins, chunks of 2 to 19 tokens
VOICED_F0_HZ = 150.0
ATTENTION_LAYERS = 8  # the tiny flow's: encoder 1 + 4 (up-blocks), estimator 3 (down, mid, up)

# Band-energy distance to the one-shot render: 20 ms Hann frames every 5 ms, 16 equal bands from 50 Hz to 12 kHz.
FRAME_SAMPLES = 480
HOP_SAMPLES = 120
BANDS = 16
# What a join may cost, per frame: RMS over the bands of the level difference in dB. Measured at the 7 joins:
# 0.13-0.26 dB as built; 0.9-1.55 dB with a left context of 0 (the first frames of each window), 1.0-1.4 dB with
# the held-back mel frames one frame early, 4.7-5.9 dB with the crossfade reversed or the held tail dropped.
MAX_JOIN_DB = 0.5
# The crossfade partners (the tail held back from one HiFT call and the next call's render of the same frames), over
# the middle half of the overlap, relative difference. Measured: 1.3-2.0 % as built; 8.3-10.6 % when the next call's
# sine source restarts instead of carrying the previous call's excitation (its harmonics' phases differ).
MAX_PARTNER_DIFFERENCE = 0.05


def seam_s3gen(voiced: bool) -> S3Gen:
    """The tiny Turbo S3Gen with a local flow (attention outputs zeroed); unvoiced, or voiced at a steady 150 Hz
    (the f0 predictor's output bias; its weights are small), where HiFT's sine source and its phase matter."""
    torch.manual_seed(0)
    s3gen = build_s3gen("tiny", meanflow=True)
    zeroed = []
    with torch.no_grad():
        for name, module in s3gen.flow.named_modules():
            if name.endswith(("self_attn.linear_out", "attn1.to_out.0")):
                module.weight.zero_()
                module.bias.zero_()
                zeroed.append(name)
        if voiced:
            s3gen.mel2wav.f0_predictor.classifier.bias.fill_(VOICED_F0_HZ)
    assert len(zeroed) == ATTENTION_LAYERS, zeroed  # the library's layers still have these names
    return s3gen


@dataclass
class Streamed:
    vocoder: StreamingVocoder
    stream: VocoderStream
    chunks: list[Pcm]


def open_stream(voiced: bool) -> tuple[StreamingVocoder, VocoderStream]:
    s3gen = seam_s3gen(voiced)
    vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=2, meanflow=True, prompt_max_tokens=PROMPT_TOKENS)
    voice = vocoder.prepare_voice(s3gen.embed_ref(reference_wav(), 24_000))
    return vocoder, vocoder.open(voice, seed=7)


def push_all(stream: VocoderStream, tokens: Sequence[int]) -> list[Pcm]:
    """Push `tokens` in SCHEDULE's sizes (the last push final); returns the chunks."""
    chunks, start = [], 0
    for index, size in enumerate(SCHEDULE):
        pcm, _ = stream.push(tokens[start:start + size], final=index == len(SCHEDULE) - 1)
        chunks.append(pcm)
        start += size
    return chunks


@pytest.fixture(scope="module")
def unvoiced() -> Streamed:
    vocoder, stream = open_stream(voiced=False)
    return Streamed(vocoder, stream, push_all(stream, utterance()))


def band_levels_db(pcm: Pcm) -> Pcm:
    """Level per band and frame, dB [frames, BANDS]; frame f covers samples [f * HOP, f * HOP + FRAME)."""
    frames = np.lib.stride_tricks.sliding_window_view(pcm, FRAME_SAMPLES)[::HOP_SAMPLES]  # [frames, 480]
    power = np.abs(np.fft.rfft(frames * np.hanning(FRAME_SAMPLES), axis=1)) ** 2  # [frames, 241]
    edges = np.linspace(1, power.shape[1], BANDS + 1).astype(int)
    bands = np.stack([power[:, lo:hi].sum(axis=1) for lo, hi in itertools.pairwise(edges)], axis=1)
    levels: Pcm = (10 * np.log10(bands + 1e-10)).astype(np.float32)
    return levels


def test_every_join_sounds_like_the_oneshot_render(unvoiced: Streamed) -> None:
    """Around each join (from 40 ms before it to the end of the crossfade and 2 tokens of the next render), every 20 ms
    frame's band levels are within MAX_JOIN_DB of the one-shot render's at the same place."""
    pcm, oneshot = np.concatenate(unvoiced.chunks), unvoiced.stream.oneshot()
    assert pcm.size == oneshot.size
    distance_db = np.sqrt(np.mean((band_levels_db(pcm) - band_levels_db(oneshot)) ** 2, axis=1))  # [frames]
    starts = np.arange(distance_db.size) * HOP_SAMPLES
    crossfade_samples = unvoiced.vocoder.crossfade_mel_frames * SAMPLES_PER_MEL_FRAME
    joins = np.cumsum([chunk.size for chunk in unvoiced.chunks])[:-1]
    joins = np.unique(joins[(joins > 0) & (joins < pcm.size)])
    assert joins.size == len(SCHEDULE) - 1
    worst = {}
    for join in joins:
        near = (starts >= join - 2 * FRAME_SAMPLES) & (starts < join + crossfade_samples + 2 * SAMPLES_PER_TOKEN)
        worst[int(join)] = round(float(distance_db[near].max()), 2)
    assert max(worst.values()) <= MAX_JOIN_DB, worst


def test_crossfade_partners_are_the_same_audio() -> None:
    """Voiced: the two waveforms each crossfade mixes (the tail held back from one HiFT call, and the next call's
    render of the same mel frames) are the same audio up to HiFT's edge effects, because the next call's source
    starts with the previous call's excitation. If it restarted its sine instead, the partners' harmonics would
    have other phases and the crossfade would mix them half and half."""
    vocoder, stream = open_stream(voiced=True)
    partners: list[tuple[Pcm, Pcm]] = []
    render_hift = vocoder._render_hift

    def spy(jobs: Sequence[RenderJob], mels: list[Pcm | None]) -> list[tuple[Pcm, Pcm] | None]:
        out = render_hift(jobs, mels)
        for job, rendered in zip(jobs, out, strict=True):
            held = job.stream.held_wav
            if held is not None and rendered is not None:
                partners.append((held.copy(), rendered[0][:held.size].copy()))
        return out

    vocoder._render_hift = spy  # type: ignore[method-assign]
    push_all(stream, utterance())
    assert len(partners) == len(SCHEDULE) - 1
    differences = []
    for held, new in partners:
        middle = slice(held.size // 4, 3 * held.size // 4)
        differences.append(round(float(np.linalg.norm(new[middle] - held[middle]) / np.linalg.norm(held[middle])), 3))
    assert max(differences) <= MAX_PARTNER_DIFFERENCE, differences
