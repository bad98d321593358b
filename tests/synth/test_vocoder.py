"""StreamingVocoder on tiny random S3Gens (English: 10 CFM steps + CFG; Turbo: 2 mean-flow steps), CPU: streams,
the prompt cache against the library's modules, and batched renders (one batch vs each stream alone)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
from chatterbox.models.s3gen.transformer import upsample_encoder

from synth import counter_noise
from synth.flow_encoder import EncoderPrefix
from synth.flow_estimator import StepPrefix
from synth.render_graphs import ShapeGraphs
from synth.tiny_s3gen import build_s3gen
from synth.vocoder import (
    FLOW_BUCKET_TOKENS,
    SAMPLES_PER_TOKEN,
    SILENCE_TOKEN,
    Pcm,
    RenderJob,
    StreamingVocoder,
    VocoderStream,
    VocoderVoice,
)

from tests.synth.op_counter import OpCounter, count_ops

SAMPLE_RATE_HZ = 24_000
PROMPT_TOKENS = 50  # the 3 s test reference has 75 tokens: prompts are trimmed
UTTERANCE_TOKENS = 84
VARIANTS = {"english": (10, False, 0), "turbo": (2, True, 3)}  # steps, meanflow, appended silence tokens


def reference_wav(seconds: float = 3.0) -> Pcm:
    t_s = np.arange(int(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    noise = np.random.default_rng(0).standard_normal(t_s.size)
    wav: Pcm = (0.3 * np.sin(2 * np.pi * 180 * t_s) + 0.05 * noise).astype(np.float32)
    return wav


@dataclasses.dataclass
class Setup:
    s3gen: S3Gen
    ref_dict: dict[str, Any]
    vocoder: StreamingVocoder
    voice: VocoderVoice
    steps: int
    meanflow: bool
    silence: int


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest) -> Setup:
    steps, meanflow, silence = VARIANTS[request.param]
    torch.manual_seed(0)
    s3gen = build_s3gen("tiny", meanflow)
    ref_dict = s3gen.embed_ref(reference_wav(), SAMPLE_RATE_HZ)
    vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                               prompt_max_tokens=PROMPT_TOKENS)
    return Setup(s3gen, ref_dict, vocoder, vocoder.prepare_voice(ref_dict), steps, meanflow, silence)


def utterance(n: int = UTTERANCE_TOKENS, seed: int = 3) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(tiny: Setup, tokens: list[int], schedule: list[int], seed: int = 7,
           vocoder: StreamingVocoder | None = None) -> tuple[VocoderStream, list[Pcm]]:
    """Push `tokens` in pushes of the given sizes (the last push is final); returns the stream and chunks."""
    assert sum(schedule) == len(tokens)
    s = (vocoder or tiny.vocoder).open(tiny.voice, seed=seed)
    chunks, start = [], 0
    for i, size in enumerate(schedule):
        pcm, n_tokens = s.push(tokens[start:start + size], final=i == len(schedule) - 1)
        assert pcm.dtype == np.float32 and pcm.ndim == 1 and pcm.size == SAMPLES_PER_TOKEN * n_tokens
        chunks.append(pcm)
        start += size
    return s, chunks


def relative_error(x: Pcm, reference: Pcm) -> float:
    return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))


SCHEDULES = {
    "growing": [12, 24, 48],
    "irregular": [5, 7, 11, 13, 17, 19, 12],
    "all_at_once": [UTTERANCE_TOKENS],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_total_samples_exact(tiny: Setup, name: str) -> None:
    tokens = utterance()
    _, chunks = stream(tiny, tokens, SCHEDULES[name])
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * (len(tokens) + tiny.silence)


def test_one_token_at_a_time(tiny: Setup) -> None:
    tokens = utterance(20)
    _, chunks = stream(tiny, tokens, [1] * len(tokens))
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * (len(tokens) + tiny.silence)
    # Nothing comes out until lookahead (3 tokens) and the held-back crossfade frames (4 tokens) are exceeded.
    first_audio = next(i for i, c in enumerate(chunks) if c.size)
    assert first_audio == tiny.vocoder.latency_tokens
    assert_no_seams(np.concatenate(chunks), chunks)


def test_final_push_without_tokens(tiny: Setup) -> None:
    tokens = utterance(30)
    s = tiny.vocoder.open(tiny.voice, seed=1)
    _, n_first = s.push(tokens, final=False)
    _, n_last = s.push([], final=True)
    assert n_first == len(tokens) - tiny.vocoder.latency_tokens
    assert n_first + n_last == len(tokens) + tiny.silence
    with pytest.raises(RuntimeError):
        s.push([1], final=True)


def test_empty_stream(tiny: Setup) -> None:
    s = tiny.vocoder.open(tiny.voice, seed=1)
    pcm, n_tokens = s.push([], final=True)
    assert n_tokens == tiny.silence and pcm.size == SAMPLES_PER_TOKEN * tiny.silence


def test_rejects_control_tokens(tiny: Setup) -> None:
    s = tiny.vocoder.open(tiny.voice, seed=1)
    with pytest.raises(ValueError):
        s.push([6561], final=False)
    with pytest.raises(ValueError):
        s.push([-1], final=False)


def test_same_seed_same_pcm_other_seed_other_pcm(tiny: Setup) -> None:
    tokens = utterance()
    _, a = stream(tiny, tokens, SCHEDULES["growing"], seed=11)
    _, b = stream(tiny, tokens, SCHEDULES["growing"], seed=11)
    _, c = stream(tiny, tokens, SCHEDULES["growing"], seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=False))
    assert not np.allclose(np.concatenate(a), np.concatenate(c))


def test_all_at_once_is_bitwise_oneshot(tiny: Setup) -> None:
    s, chunks = stream(tiny, utterance(), SCHEDULES["all_at_once"])
    assert np.array_equal(chunks[0], s.oneshot())


def test_global_rng_untouched(tiny: Setup) -> None:
    before = torch.get_rng_state()
    voice = tiny.vocoder.prepare_voice(tiny.ref_dict)
    s = tiny.vocoder.open(voice, seed=5)
    s.push(utterance(30), final=False)
    s.push(utterance(10, seed=4), final=True)
    s.oneshot()
    assert torch.equal(before, torch.get_rng_state())


def flow_noise(seed: int, frames: int) -> torch.Tensor:
    """A stream's flow noise [1, 80, frames] from its first frame (what its renders draw)."""
    keys = counter_noise.stream_keys(torch.tensor([seed]), counter_noise.FLOW_NOISE)
    return counter_noise.normal_run(keys, torch.tensor([0]), frames * 80).view(1, frames, 80).transpose(1, 2)


def capture_flow_mels(vocoder: StreamingVocoder) -> tuple[list[Pcm], object]:
    """Record every mel the vocoder's flow hands to HiFT (restore with `del vocoder._render_flow`)."""
    rendered: list[Pcm] = []
    original = vocoder._render_flow

    def capture(jobs: Sequence[RenderJob]) -> list[Pcm | None]:
        mels = original(jobs)
        rendered.extend(m for m in mels if m is not None)
        return mels

    vocoder._render_flow = capture  # type: ignore[method-assign]
    return rendered, original


def hift_with_seed(tiny: Setup, mel: Pcm, seed: int) -> Pcm:
    """The one-shot HiFT call on `mel` [M, 80] with another stream's source noise (trim fade applied)."""
    other = tiny.vocoder.open(tiny.voice, seed=seed)
    job = RenderJob(stream=other, window_first=0, stop=0, final=True)
    frames = mel.shape[0]
    wav, _ = tiny.vocoder._hift_group([(job, mel)], -(-frames // 16) * 16)
    out = wav[0, :frames * 480].copy()
    out[:tiny.s3gen.trim_fade.numel()] *= tiny.s3gen.trim_fade.numpy()
    return out


def test_streamed_agrees_with_oneshot(tiny: Setup) -> None:
    """Streaming vs one-shot render of the same tokens and noise, waveform and mel.

    Waveform: HiFT draws its sine source's harmonic phases and additive noise per call and restarts the sine
    phase where the carried-over source ends, so chunked HiFT cannot match a one-shot call sample for sample.
    The yardstick (floor) is the same one-shot mel vocoded with another stream's HiFT noise. Measured here:
    streamed vs one-shot 0.093 (English) / 0.069 (Turbo) relative error, floor 0.091 / 0.070 (full-size
    models, 90 tokens: 0.150 vs 0.149 and 0.237 vs 0.238): the flow's windowing adds ~nothing on top of HiFT's
    own randomness. A wrong or misaligned frame gives errors of order 1 (the signal is noise-like: its
    sample-to-sample steps are as large as the signal), so the bound is 1.25 x floor.

    Mel: with full attention inside the window every frame depends on every other, and with random weights
    that dependence is spread evenly; a window sees 3 tokens ahead and 25 behind, the one-shot render sees
    everything. Measured: 0.141 (English) / 0.124 (Turbo) relative error; 0.3-0.5 per frame in the first,
    smallest window. Bound: 0.25.
    """
    vocoder = tiny.vocoder
    tokens = utterance()
    rendered, _ = capture_flow_mels(vocoder)
    try:
        s, chunks = stream(tiny, tokens, SCHEDULES["growing"])
        streamed_mel = np.concatenate(rendered)
        oneshot = s.oneshot()
        oneshot_mel = rendered[-1]
    finally:
        del vocoder._render_flow
    streamed = np.concatenate(chunks)
    floor = relative_error(hift_with_seed(tiny, oneshot_mel, seed=999), oneshot)
    assert streamed.size == oneshot.size
    assert relative_error(streamed, oneshot) <= 1.25 * floor
    assert float(np.linalg.norm(streamed_mel - oneshot_mel) / np.linalg.norm(oneshot_mel)) <= 0.25


def test_other_schedule_same_length_and_same_bound(tiny: Setup) -> None:
    """Across schedules: equal sample counts and agreement at HiFT's noise level (measured 0.066-0.093
    relative error between the two schedules and against one-shot), not bitwise equality."""
    tokens = utterance()
    s, growing = stream(tiny, tokens, SCHEDULES["growing"])
    _, irregular = stream(tiny, tokens, SCHEDULES["irregular"])
    a, b, oneshot = np.concatenate(growing), np.concatenate(irregular), s.oneshot()
    assert a.size == b.size == oneshot.size
    assert relative_error(b, oneshot) < 0.15 and relative_error(a, b) < 0.15


def assert_no_seams(pcm: Pcm, chunks: list[Pcm]) -> None:
    """Every join's sample step stays within the signal's own step distribution (its 99.9th percentile).

    Measured (tiny): the largest join step is 0.5-0.9 x the median step, the 99.9th percentile 1.5-2.4 x;
    full-size: 2.3-2.4 x against 3.5 x (English), 0.6-0.7 x against 2.5 x (Turbo).
    """
    steps = np.abs(np.diff(pcm))
    joins = np.cumsum([c.size for c in chunks])[:-1]
    joins = joins[(joins > 0) & (joins < pcm.size)]
    assert joins.size > 0
    assert np.all(np.abs(pcm[joins] - pcm[joins - 1]) <= np.percentile(steps, 99.9))


@pytest.mark.parametrize("name", ["growing", "irregular"])
def test_no_seams(tiny: Setup, name: str) -> None:
    _, chunks = stream(tiny, utterance(), SCHEDULES[name])
    assert_no_seams(np.concatenate(chunks), chunks)


def test_start_fade_on_first_chunk_only(tiny: Setup) -> None:
    _, chunks = stream(tiny, utterance(), SCHEDULES["growing"])
    silence_samples = tiny.s3gen.trim_fade.numel() // 2  # trim_fade: 20 ms of zeros, then a 20 ms rise
    assert np.all(chunks[0][:silence_samples] == 0.0)
    for chunk in chunks[1:]:
        assert np.abs(chunk[:silence_samples]).max() > 0.0


def test_silence_appended_on_final(tiny: Setup) -> None:
    tokens = utterance(40)
    s, chunks = stream(tiny, tokens, [20, 20])
    assert s.tokens == tokens + [SILENCE_TOKEN] * tiny.silence
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * (40 + tiny.silence)
    assert s.oneshot().size == SAMPLES_PER_TOKEN * (40 + tiny.silence)


def test_prompt_is_standardised(tiny: Setup) -> None:
    voice = tiny.voice
    tokens = tiny.ref_dict["prompt_token"]  # [1, 75]
    assert voice.prompt_token_count == PROMPT_TOKENS
    assert torch.equal(voice.prompt_tokens, tokens[:, -PROMPT_TOKENS:])  # the end of the reference
    feats = tiny.ref_dict["prompt_feat"]  # [1, 150, 80]
    assert torch.equal(voice.prompt_mels, feats[:, -2 * PROMPT_TOKENS:].transpose(1, 2))
    roomy = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                             prompt_max_tokens=500, cache_prompt=False)
    assert roomy.prepare_voice(tiny.ref_dict).prompt_token_count == tokens.shape[1]


def test_uncached_render_is_the_library_flow(tiny: Setup) -> None:
    """cache_prompt=False renders exactly what `flow.inference(finalize=True)` renders with the same noise
    (the window padded to its bucket and masked changes nothing)."""
    vocoder = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                               prompt_max_tokens=PROMPT_TOKENS, cache_prompt=False)
    voice = vocoder.prepare_voice(tiny.ref_dict)
    tokens = torch.tensor([utterance(34)])  # [1, 34]: the window is padded (84 -> 88 tokens with the prompt)
    assert (PROMPT_TOKENS + 34) % FLOW_BUCKET_TOKENS
    noise = flow_noise(seed=5, frames=68)
    with torch.random.fork_rng():  # the library redraws the prompt region's noise from the global RNG
        torch.manual_seed(123)
        library, _ = tiny.s3gen.flow.inference(
            token=tokens, token_len=torch.tensor([34]), prompt_token=voice.prompt_tokens,
            prompt_token_len=torch.tensor([voice.prompt_token_count]), prompt_feat=voice.prompt_mels.transpose(1, 2),
            prompt_feat_len=None, embedding=tiny.ref_dict["embedding"], finalize=True, n_timesteps=tiny.steps,
            noised_mels=noise, meanflow=tiny.meanflow)
        torch.manual_seed(123)
        prompt_noise = torch.randn(1, 80, voice.prompt_frames + 68)[:, :, :voice.prompt_frames]
    same_noise = dataclasses.replace(voice, prompt_noise=prompt_noise)
    s = vocoder.open(same_noise, seed=5)
    s.add(tokens[0].tolist(), final=True)
    job = s.next_job()
    assert job is not None and job.final and job.window_first == 0
    ours = vocoder._render_flow([job])[0]  # [68, 80]
    torch.testing.assert_close(torch.from_numpy(ours).T[None], library, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def library_encoder_with_prompt_alone(flow: CausalMaskedDiffWithXvec, prompt: torch.Tensor) -> Iterator[None]:
    """The library's own encoder, run on [prompt | window], with prompt positions seeing only the prompt.

    Its attention masks are replaced by a prefix mask (prompt positions see the prompt; the window sees
    everything), and the pre-lookahead conv's outputs at prompt positions by those of the prompt alone (where
    the conv reads zeros past the prompt's end instead of the window's first tokens).
    """
    encoder = flow.encoder
    prompt_tokens = prompt.shape[1]
    with torch.inference_mode():
        embedded, _, _ = encoder.embed(flow.input_embedding(prompt), torch.ones(1, 1, prompt_tokens, dtype=torch.bool))
        prompt_alone = encoder.pre_lookahead_layer(embedded)  # [1, P, 512]
    calls: list[int] = []

    def prefix_mask(xs: torch.Tensor, *_: object) -> torch.Tensor:
        positions = xs.shape[1]
        calls.append(positions)
        prefix = prompt_tokens * (1 if len(calls) == 1 else 2)  # token rate, then frame rate
        mask = torch.ones(1, positions, positions, dtype=torch.bool)
        mask[:, :prefix, prefix:] = False
        return mask

    def prompt_positions_alone(_module: torch.nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([prompt_alone, out[:, prompt_tokens:]], dim=1)

    original = upsample_encoder.add_optional_chunk_mask
    handle = encoder.pre_lookahead_layer.register_forward_hook(prompt_positions_alone)
    upsample_encoder.add_optional_chunk_mask = prefix_mask
    try:
        yield
    finally:
        upsample_encoder.add_optional_chunk_mask = original
        handle.remove()
    assert len(calls) == 2


def library_encode(flow: CausalMaskedDiffWithXvec, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [1, N] -> mu [1, 80, 2N] by the library's encoder, as flow.inference does (batch 1, no padding)."""
    with torch.inference_mode():
        h, _ = flow.encoder(flow.input_embedding(tokens), torch.tensor([tokens.shape[1]]))  # [1, 2N, 512]
        return cast(torch.Tensor, flow.encoder_proj(h).transpose(1, 2).contiguous())


def prompt_alone_mu(vocoder: StreamingVocoder, voice: VocoderVoice, window: list[int]) -> torch.Tensor:
    """mu [1, 80, 2W] of the window after the prompt, by the library's encoder under the prompt-alone mask."""
    flow = vocoder.s3gen.flow
    with library_encoder_with_prompt_alone(flow, voice.prompt_tokens):
        mu = library_encode(flow, torch.cat([voice.prompt_tokens, torch.tensor([window])], dim=1))
    return mu[:, :, voice.prompt_frames:]


def encode_after_prompt(vocoder: StreamingVocoder, voice: VocoderVoice, window: list[int]) -> torch.Tensor:
    """mu [1, 80, 2W] of the window by the prefix-cached encoder."""
    cache = vocoder.prompt_cache(voice)
    assert cache is not None
    prefix = cache.encoder
    mu = vocoder.encoder.encode(prefix, torch.tensor([window]), torch.tensor([len(window)]))
    return mu.transpose(1, 2)


@pytest.mark.parametrize("window_tokens", [1, 19, 52, 124])  # up to longer than the prompt (50)
def test_encoder_prefix_cache_is_the_library_encoder_with_the_prompt_alone(tiny: Setup, window_tokens: int) -> None:
    """A window encoded after the cached prompt equals the library's encoder on [prompt | window] in which
    prompt positions see only the prompt; and it is not the unmasked encoding (the mask does something)."""
    vocoder, voice = tiny.vocoder, tiny.voice
    flow = vocoder.s3gen.flow
    window = utterance(window_tokens, seed=window_tokens)
    cached = encode_after_prompt(vocoder, voice, window)
    reference = prompt_alone_mu(vocoder, voice, window)
    assert cached.shape == reference.shape == (1, 80, 2 * window_tokens)
    torch.testing.assert_close(cached, reference, rtol=1e-5, atol=1e-5)
    unmasked = library_encode(flow, torch.cat([voice.prompt_tokens, torch.tensor([window])], dim=1))
    assert not torch.allclose(unmasked[:, :, voice.prompt_frames:], reference, atol=1e-3)
    cache = vocoder.prompt_cache(voice)
    assert cache is not None
    torch.testing.assert_close(cache.encoder.mu.transpose(1, 2), library_encode(flow, voice.prompt_tokens),
                               rtol=1e-5, atol=1e-5)


def test_prompt_cache_is_exact(tiny: Setup) -> None:
    """The cached render equals a render of [prompt | window] in which prompt positions see only the prompt.

    Encoder: the library's encoder under the prompt-alone mask (above). Decoder: the library's own Euler solver
    and estimator with static_chunk_size set to the prompt length, whose chunk mask is then exactly that prefix
    mask (for a window no longer than the prompt); its causal convs see the prompt's tail.
    """
    vocoder, voice = tiny.vocoder, tiny.voice
    window = utterance(30)
    s = vocoder.open(voice, seed=6)
    s.prompt = vocoder.prompt_cache(voice)
    s.add(window, final=True)
    window = s.tokens  # with Turbo's appended silence
    assert len(window) % FLOW_BUCKET_TOKENS  # the window is padded to its bucket (and masked)
    frames = 2 * len(window)
    job = s.next_job()
    assert job is not None and job.final
    cached = torch.from_numpy(vocoder._render_flow([job])[0]).T[None]  # [1, 80, frames]
    decoder = tiny.s3gen.flow.decoder
    with torch.inference_mode():
        prompt_mu = library_encode(tiny.s3gen.flow, voice.prompt_tokens)
        mu = torch.cat([prompt_mu, prompt_alone_mu(vocoder, voice, window)], dim=2)
        x = torch.cat([voice.prompt_noise, flow_noise(seed=6, frames=frames)], dim=2)
        cond = F.pad(voice.prompt_mels, (0, frames))
        mask = torch.ones_like(x[:, :1])
        decoder.estimator.static_chunk_size = voice.prompt_frames
        try:
            if tiny.meanflow:
                reference = decoder.basic_euler(x, vocoder._t_span, mu, mask, voice.speaker, cond)
            else:
                reference = decoder.solve_euler(x, vocoder._t_span, mu, mask, voice.speaker, cond)
        finally:
            decoder.estimator.static_chunk_size = 0
    torch.testing.assert_close(cached, reference[:, :, voice.prompt_frames:], rtol=1e-4, atol=1e-4)


def test_prompt_cache_lru_rebuilds_identically(tiny: Setup) -> None:
    small = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                             append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS,
                             prompt_cache_bytes=1)
    first = small.prepare_voice(tiny.ref_dict)
    one_voice_bytes = small.prompt_cache_nbytes
    second = small.prepare_voice(tiny.ref_dict)  # evicts the first voice's cache
    assert small.prompt_cache_nbytes == one_voice_bytes > 0
    tokens = utterance(30)
    a = small.open(first, seed=3).push(tokens, final=True)[0]  # rebuilt on demand
    b = small.open(second, seed=3).push(tokens, final=True)[0]
    assert np.array_equal(a, b)


def test_tiny_s3gen_is_the_library_class_deterministic_and_works(tiny: Setup) -> None:
    s3gen = tiny.s3gen
    assert type(s3gen) is S3Gen and not s3gen.training and s3gen.meanflow == tiny.meanflow
    torch.manual_seed(0)
    again = build_s3gen("tiny", tiny.meanflow)
    assert all(torch.equal(a, b) for a, b in zip(s3gen.state_dict().values(), again.state_dict().values(),
                                                         strict=True))
    tokens = torch.tensor([utterance(25)])
    wav, _ = s3gen.inference(tokens, ref_dict=tiny.ref_dict, n_cfm_timesteps=tiny.steps)
    assert wav.shape == (1, 25 * SAMPLES_PER_TOKEN) and torch.isfinite(wav).all()
    mel = s3gen.flow_inference(tokens, ref_dict=tiny.ref_dict, finalize=True)
    assert mel.shape == (1, 80, 50)
    assert s3gen.hift_inference(mel)[0].shape == (1, 25 * SAMPLES_PER_TOKEN)


def test_one_token_prompt_renders_uncached(tiny: Setup) -> None:
    """A prompt too short for the encoder's cross-boundary convs is not cached; it still renders."""
    short = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                             append_silence_tokens=tiny.silence, prompt_max_tokens=1)
    voice = short.prepare_voice(tiny.ref_dict)
    assert voice.prompt_token_count == 1 and short.prompt_cache(voice) is None and short.prompt_cache_nbytes == 0
    s = short.open(voice, seed=7)
    pcm, n_tokens = s.push(utterance(20), final=True)
    assert n_tokens == 20 + tiny.silence and np.isfinite(pcm).all()


# --- batched renders ----------------------------------------------------------------------------------------


def clone(s: VocoderStream) -> VocoderStream:
    """An independent copy of a stream's state (to render it alone and in a batch from the same point)."""
    return dataclasses.replace(s, tokens=list(s.tokens),
                               held_mel=None if s.held_mel is None else s.held_mel.copy(),
                               held_source=None if s.held_source is None else s.held_source.copy(),
                               held_wav=None if s.held_wav is None else s.held_wav.copy())


def advanced_stream(vocoder: StreamingVocoder, voice: VocoderVoice, seed: int, tokens: list[int],
                    chunks: list[int], final: bool) -> VocoderStream:
    """A stream with `tokens` in whose first len(chunks) chunks of the given sizes have been rendered."""
    s = vocoder.open(voice, seed=seed)
    s.prompt = vocoder.prompt_cache(voice)
    s.add(tokens, final=final)
    for size in chunks:
        job = s.next_job(size)
        assert job is not None
        vocoder.render([job])
    return s


@pytest.fixture(scope="module")
def second_voice(tiny: Setup) -> VocoderVoice:
    """Another voice: the reference's speaker embedding perturbed (its prompt cache differs too)."""
    ref = dict(tiny.ref_dict)
    ref["embedding"] = ref["embedding"] + 0.5 * torch.randn(ref["embedding"].shape,
                                                             generator=torch.Generator().manual_seed(8))
    return tiny.vocoder.prepare_voice(ref)


def mixed_streams(tiny: Setup, second_voice: VocoderVoice, vocoder: StreamingVocoder | None = None
                  ) -> list[VocoderStream]:
    """Seven streams at different points: two voices, first chunks and later ones, windows of several buckets,
    final renders, and an empty stream's final flush (nothing to render for English; Turbo's 3 silence tokens)."""
    vocoder = vocoder or tiny.vocoder
    specs = [  # (voice, seed, tokens, chunks rendered before, final)
        (tiny.voice, 1, utterance(40, seed=1), [], False),
        (second_voice, 2, utterance(40, seed=2), [], False),
        (tiny.voice, 3, utterance(70, seed=3), [12], False),
        (second_voice, 4, utterance(90, seed=4), [12, 24], False),
        (tiny.voice, 5, utterance(30, seed=5), [12], True),
        (second_voice, 6, utterance(17, seed=6), [], True),
        (tiny.voice, 7, [], [], True),
    ]
    return [advanced_stream(vocoder, voice, seed, tokens, chunks, final)
            for voice, seed, tokens, chunks, final in specs]


def bf16_vocoder(tiny: Setup) -> StreamingVocoder:
    """The tiny vocoder with bfloat16 products (`--cpu-vocoder bf16`)."""
    return StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                            append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS,
                            gemm_dtype=torch.bfloat16)


@pytest.mark.parametrize("row_invariant,gemm_dtype", [(True, torch.float32), (False, torch.float32),
                                                      (True, torch.bfloat16)],
                         ids=["cpu-kernels", "cuda-kernels", "cpu-kernels-bf16"])
def test_batched_render_equals_each_stream_alone(tiny: Setup, second_voice: VocoderVoice,
                                                 row_invariant: bool, gemm_dtype: torch.dtype) -> None:
    """One batched render of seven streams (two voices, several window lengths and chunk indices, final and
    not) gives each stream what rendering it alone gives: bitwise with the CPU's row-invariant kernels (in
    float32 or with bfloat16 products), within 1e-5 with the cuBLAS/cuDNN path (here on the CPU:
    F.linear/F.conv1d, whose rows do depend on the batch). The next render after the batch also agrees (the
    carried state is the same)."""
    if gemm_dtype == torch.bfloat16:
        vocoder = bf16_vocoder(tiny)
    else:
        vocoder = tiny.vocoder if row_invariant else StreamingVocoder(
            tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow, append_silence_tokens=tiny.silence,
            prompt_max_tokens=PROMPT_TOKENS, row_invariant=False)
    batch = mixed_streams(tiny, second_voice, vocoder)
    alone = [clone(s) for s in batch]
    maybe_jobs = [s.next_job(24) for s in batch]
    assert all(job is not None for job in maybe_jobs)
    jobs = [job for job in maybe_jobs if job is not None]
    assert len({(job.stop - job.window_first + 7) // 8 for job in jobs}) >= 3  # several flow buckets
    assert any(job.new_tokens == 0 for job in jobs) == (tiny.silence == 0) and any(job.final for job in jobs)
    batched = vocoder.render(jobs)
    singles = [vocoder.render([s.next_job(24)])[0] for s in alone]  # type: ignore[list-item]
    for _s, single, together in zip(alone, singles, batched, strict=False):
        assert single.size == together.size
        if row_invariant:
            assert np.array_equal(single, together)
        else:
            np.testing.assert_allclose(together, single, rtol=0, atol=1e-5)
    follow = [s.next_job(24) for s in batch]
    follow_alone = [s.next_job(24) for s in alone]
    for job, job_alone in zip(follow, follow_alone, strict=False):
        assert (job is None) == (job_alone is None)
        if job is not None and job_alone is not None:
            a, b = vocoder.render([job])[0], vocoder.render([job_alone])[0]
            assert np.array_equal(a, b) if row_invariant else np.allclose(a, b, rtol=0, atol=1e-5)


def test_graphed_renders_equal_eager_renders(tiny: Setup, second_voice: VocoderVoice) -> None:
    """`use_graphs` (on a GPU: a CUDA graph per input signature of the encoder, the estimator step and HiFT, captured
    on first use) runs here without the capture: the same copies into each signature's static inputs and out of
    its static outputs, around an eager call. Six streams of two voices at different points, four ticks of
    varying chunk sizes together (batches padded to powers of two, signatures met again with new inputs), then
    each stream alone to its end: bitwise the PCM of the plain vocoder, chunk by chunk."""
    graphed = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                               append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS)
    graphs = graphed.use_graphs(capture=False)
    assert graphed._batch_bucket([1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5, 5, 5, 5]
    specs = [(tiny.voice if i % 2 else second_voice, 30 + i, utterance(150 + 10 * i, seed=30 + i), [12] * (i % 3))
             for i in range(6)]
    plain_streams, graphed_streams = ([advanced_stream(vocoder, voice, seed, tokens, chunks, final=True)
                                       for voice, seed, tokens, chunks in specs]
                                      for vocoder in (tiny.vocoder, graphed))
    pairs = list(zip(plain_streams, graphed_streams, strict=True))
    calls = 0
    for chunk in (12, 24, 12, 18):  # together
        jobs = [(p.next_job(chunk), g.next_job(chunk)) for p, g in pairs]
        expected = tiny.vocoder.render([pj for pj, _ in jobs])  # type: ignore[misc]
        got = graphed.render([gj for _, gj in jobs])  # type: ignore[misc]
        calls += len(jobs)
        assert len(got) == 6 and all(np.array_equal(want, have) for want, have in zip(expected, got, strict=True))
    for p, g in pairs:  # alone, to the end
        while not p.finished:
            pj, gj = p.next_job(24), g.next_job(24)
            assert pj is not None and gj is not None
            calls += 1
            assert np.array_equal(tiny.vocoder.render([pj])[0], graphed.render([gj])[0])
        assert g.finished
    functions = [graphed._encode_fn, graphed._estimate_fn, graphed._hift_fn]
    assert all(isinstance(fn, ShapeGraphs) for fn in functions)
    sizes = [len(cast(ShapeGraphs, fn)) for fn in functions]
    assert 0 < sizes[2] < calls / 2  # HiFT's signatures were met again
    assert graphs.captured == sum(sizes)


# what a CUDA graph cannot hold: a device value read on the host, a tensor made from host data, an output whose
# shape depends on values (each one a sync on a GPU; a capture fails on it or bakes one call's value in)
HOST_BOUND_OPS = ("aten.item", "aten._local_scalar_dense", "aten.lift_fresh", "aten.lift_fresh_copy", "aten.nonzero",
                  "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
                  "aten.repeat_interleave.Tensor", "aten.equal", "aten.is_nonzero")


def test_graphed_functions_read_no_host_value(tiny: Setup, second_voice: VocoderVoice) -> None:
    """Inside the three functions `use_graphs` captures (encoder, estimator step, HiFT), with the kernels a GPU
    runs, over a tick of mixed streams, no op reads a device value on the host, makes a tensor from host data or
    has a value-dependent output shape: what a replayed graph would silently freeze or a capture refuse."""
    graphed = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                               append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS,
                               row_invariant=False)  # the kernels a GPU runs (cuBLAS/cuDNN's, F.linear, F.conv1d)
    graphed.use_graphs(capture=False)
    inside = OpCounter()
    for fn in (graphed._encode_fn, graphed._estimate_fn, graphed._hift_fn):
        assert isinstance(fn, ShapeGraphs)

        def counted(*args: Any, _fn: Callable[..., Any] = fn.fn) -> Any:
            with inside:
                return _fn(*args)

        fn.fn = counted
    batch = mixed_streams(tiny, second_voice, graphed)
    graphed.render([job for job in (s.next_job(24) for s in batch) if job is not None])
    assert inside.total > 100 and "aten.conv1d" in inside.ops
    assert "aten.repeat_interleave.self_int" in inside.overloads  # an int count: expand + copy, no host read
    assert not {name for name in inside.overloads if name.startswith(HOST_BOUND_OPS)}


def test_one_voice_batch_reads_the_prompt_cache_without_copying_it(tiny: Setup) -> None:
    """Streams of one voice batch its prompt cache as a view (Turbo: one row per stream), not a copy per stream
    (a full-size Turbo cache is ~98 MB: 4 copies per tick were a tenth of a tick's time); each stream still
    renders what it renders alone, bitwise. English's cache has two rows per stream (cond, uncond): copied."""
    streams = [advanced_stream(tiny.vocoder, tiny.voice, seed=20 + i, tokens=utterance(90, seed=20 + i),
                               chunks=chunks, final=False) for i, chunks in enumerate([[], [12], [12, 24], []])]
    prompt = tiny.vocoder.prompt_cache(tiny.voice)
    assert prompt is not None
    batched_prefix = StepPrefix.cat([prompt.steps[0]] * 3)
    batched_encoder = EncoderPrefix.cat([prompt.encoder] * 3)
    assert batched_prefix.keys[0].shape[0] == 3 * tiny.vocoder.cfg_rows
    assert batched_encoder.layer_kv[0].shape[0] == 3
    shares = [batched_prefix.keys[0].data_ptr() == prompt.steps[0].keys[0].data_ptr(),
              batched_encoder.layer_kv[0].data_ptr() == prompt.encoder.layer_kv[0].data_ptr()]
    assert shares == [tiny.meanflow, True]
    alone = [clone(s) for s in streams]
    batched = tiny.vocoder.render([s.next_job(24) for s in streams])  # type: ignore[misc]
    for s, together in zip(alone, batched, strict=True):
        single = tiny.vocoder.render([s.next_job(24)])[0]  # type: ignore[list-item]
        assert together.size > 0 and np.array_equal(single, together)


def test_unseeded_streams_render_apart_through_the_library_kernels(tiny: Setup, second_voice: VocoderVoice) -> None:
    """A tick mixing reproducible streams (the client gave the seed) with others: the reproducible ones stay
    bitwise their lone render (row-invariant kernels), the others run in a batch of their own through the
    library's kernels (`F.conv1d`, `F.linear` in the tick, absent from a reproducible-only one)
    and agree with the row-invariant render of the same stream to float rounding."""
    batch = mixed_streams(tiny, second_voice)
    for index, s in enumerate(batch):
        s.reproducible = index % 2 == 0
    reference = [dataclasses.replace(clone(s), reproducible=True) for s in batch]
    jobs = [s.next_job(24) for s in batch]
    with count_ops() as mixed_ops:
        rendered = tiny.vocoder.render(jobs)  # type: ignore[arg-type]
    seeded_jobs = [s.next_job(24) for s in reference]
    with count_ops() as seeded_ops:
        expected = tiny.vocoder.render(seeded_jobs)  # type: ignore[arg-type]
    library_ops = ("aten.conv1d", "aten.convolution", "aten.linear")  # the name the dispatcher shows varies
    assert sum(mixed_ops.ops[op] for op in library_ops) > 0 and sum(seeded_ops.ops[op] for op in library_ops) == 0
    for s, got, want in zip(batch, rendered, expected, strict=True):
        assert got.size == want.size
        if s.reproducible:
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert any(not np.array_equal(got, want) for got, want in zip(rendered, expected, strict=True))


def test_bf16_products_render_the_fp32_audio_to_bf16_rounding(tiny: Setup) -> None:
    """`--cpu-vocoder bf16`: a stream streamed chunk by chunk with bfloat16 products is the float32 stream's
    audio to bf16 rounding (not bitwise: its products really are bf16), and a seeded stream reproduces
    exactly; the estimator's attention, the norms and HiFT's STFT stay float32."""
    tokens = utterance()
    lowered = bf16_vocoder(tiny)
    _, exact_chunks = stream(tiny, tokens, SCHEDULES["growing"])
    _, bf16_chunks = stream(tiny, tokens, SCHEDULES["growing"], vocoder=lowered)
    _, again = stream(tiny, tokens, SCHEDULES["growing"], vocoder=lowered)
    exact, bf16 = np.concatenate(exact_chunks), np.concatenate(bf16_chunks)
    assert bf16.size == exact.size and np.array_equal(bf16, np.concatenate(again))
    assert not np.array_equal(bf16, exact)
    assert relative_error(bf16, exact) < 0.02  # measured 0.6 % (English), 0.4 % (Turbo)
    with pytest.raises(ValueError, match="gemm_dtype"):
        StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                         gemm_dtype=torch.float16)


def test_ops_per_tick_do_not_grow_with_streams(tiny: Setup, second_voice: VocoderVoice) -> None:
    """A render tick runs the same aten ops for 1, 4 and 16 streams due at once (two voices among them): the
    batch is built on the host and every tensor op covers all rows."""
    counts = {}
    for n in (1, 4, 16):
        streams = []
        for i in range(n):
            voice = tiny.voice if i % 2 == 0 else second_voice
            s = tiny.vocoder.open(voice, seed=100 + i)
            s.prompt = tiny.vocoder.prompt_cache(voice)
            s.add(utterance(30, seed=i), final=False)
            streams.append(s)
        jobs = [s.next_job(12) for s in streams]
        with count_ops() as ops:
            tiny.vocoder.render(jobs)  # type: ignore[arg-type]
        counts[n] = ops.total
    assert counts[1] == counts[4] == counts[16] > 0, counts


def test_renders_and_prompt_caches_do_not_depend_on_the_thread_count(tiny: Setup) -> None:
    """The same voice prepared and the same stream rendered with 1 and with 2 torch threads: bitwise equal
    (a voice may be prepared on the preparation thread and rendered on the vocoder's, with other counts)."""
    saved = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            vocoder = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                                       append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS)
            voice = vocoder.prepare_voice(tiny.ref_dict)
            _, chunks = stream(tiny, utterance(), SCHEDULES["growing"], vocoder=vocoder)
            cache = vocoder.prompt_cache(voice)
            assert cache is not None
            outputs.append((np.concatenate(chunks), cache.steps[-1].keys[0], cache.encoder.layer_kv[-1]))
    finally:
        torch.set_num_threads(saved)
    (pcm1, keys1, kv1), (pcm2, keys2, kv2) = outputs
    assert torch.equal(keys1, keys2) and torch.equal(kv1, kv2)
    assert np.array_equal(pcm1, pcm2)


@pytest.mark.timeout(300)
def test_compiled_renders_what_eager_renders(tiny: Setup) -> None:
    """StreamingVocoder.compile() (the GPU path: torch.compile of the encoder, the estimator step and HiFT, batches
    padded to powers of two) traced by dynamo with the eager backend here: the same PCM, bitwise, for a batch of
    three (padded to four)."""
    outputs = []
    for compiled in (False, True):
        vocoder = StreamingVocoder(tiny.s3gen, n_cfm_timesteps=tiny.steps, meanflow=tiny.meanflow,
                                   append_silence_tokens=tiny.silence, prompt_max_tokens=PROMPT_TOKENS)
        if compiled:
            vocoder.compile(backend="eager")
            assert vocoder._batch_bucket([1, 2, 3]) == [1, 2, 3, 3]
        voice = vocoder.prepare_voice(tiny.ref_dict)
        streams = [advanced_stream(vocoder, voice, seed=i, tokens=utterance(50, seed=i), chunks=[12], final=False)
                   for i in range(3)]
        outputs.append(vocoder.render([s.next_job(24) for s in streams]))  # type: ignore[misc]
    for eager, compiled_pcm in zip(*outputs, strict=False):
        assert eager.size > 0 and np.array_equal(eager, compiled_pcm)
