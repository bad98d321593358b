"""Streaming S3Gen vocoder: speech tokens in, final 24 kHz PCM out, chunk by chunk.

Each `push` renders one window of the flow (token -> mel) model,

    [voice prompt | left-context tokens | new tokens | 3 lookahead tokens]

and keeps only the mel frames of the new tokens. The flow-matching noise is fixed per stream and indexed by
absolute frame, so overlapping renders start from the same noise. The new mel frames go through HiFT
(mel -> waveform) after the last few mel frames of the previous call, whose sine-source excitation is carried
over; the waveform of those re-rendered frames is crossfaded with the tail held back last time.

Prompt cache (`cache_prompt=True`, the default): the voice prompt's activations are computed once per voice,
in the encoder (every layer's attention keys and values, the conv inputs at the prompt's end:
`synth/flow_encoder.py`) and in the decoder (attention keys and values and causal-conv tails at every Euler
step), and each render then runs both on the window's positions only, so no chunk re-processes the prompt.
That requires that prompt positions not attend to the positions after them, which the library's full
attention lets them do: the cache uses a prefix mask instead (as the chunk-causal mask of CosyVoice2 streaming
does for a prompt that ends on a chunk boundary), i.e. the prompt is encoded and denoised as if alone. With
`cache_prompt=False` every render runs the library's exact one-shot semantics on [prompt | window] (and pays
for the prompt's positions each time).

The library's own modules do the work (`flow.input_embedding`, `flow.encoder`, `flow.encoder_proj`,
`flow.decoder.estimator`, `s3gen.hift_inference`); this module only calls them on windows, taps the
estimator's attention processors and causal convs for the prompt cache, and carries state between calls. It
runs the Euler loop of `CausalConditionalCFM.solve_euler` / `basic_euler` itself because
`CausalConditionalCFM.forward` redraws the prompt-region noise from the global RNG and
`flow.inference(finalize=False)` crashes (see INSTALL-NOTES).

Global RNG: HiFT's sine source draws from the global generator (harmonic phases, additive noise). Every HiFT
call here runs inside `torch.random.fork_rng` with the global generator reseeded from (stream seed, absolute
frame), so the caller's global RNG state is untouched.

What a stream guarantees:
- total samples = 960 x (tokens pushed + appended silence), whatever the push schedule;
- its PCM is a pure function of (voice, seed, tokens, push schedule): same inputs, bitwise same PCM, whatever
  else runs (streams never share a render);
- pushing everything at once with final=True gives exactly `oneshot()`;
- other schedules give the same length and differ from `oneshot()` by about as much as two one-shot renders
  that differ only in HiFT's random source (each HiFT call draws its own source noise and restarts the sine
  phase where the carried-over source ends), plus the flow's windowing (a window sees 3 tokens ahead and
  `left_context_tokens` behind, the one-shot render sees everything).

Threads: the prompt cache swaps the estimator's attention processors and hooks its convs for the duration of a
render, so `prepare_voice` and every `push`/`oneshot` of one S3Gen's streams must run on one thread (the
engine's); nothing else may use the global RNG or that S3Gen's estimator concurrently.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.s3gen.const import S3GEN_SIL, S3GEN_SR
from chatterbox.models.s3gen.decoder import CausalConv1d
from diffusers.models.attention_processor import Attention

from synth.flow_encoder import MIN_PREFIX_TOKENS, EncoderPrefix, PrefixCachedEncoder, nbytes_of

log = logging.getLogger(__name__)

SAMPLE_RATE_HZ = S3GEN_SR  # 24 kHz mono out
SPEECH_VOCAB_SIZE = 6561  # ids >= this are T3 control tokens; S3Gen's embedding has 6561 rows
SILENCE_TOKEN = S3GEN_SIL  # Turbo appends 3 of these before S3Gen
MEL_BINS = 80
MEL_FRAMES_PER_TOKEN = 2  # 25 tokens/s -> 50 mel frames/s (flow.token_mel_ratio)
SAMPLES_PER_MEL_FRAME = 480  # HiFT upsampling 8*5*3, then iSTFT hop 4
SAMPLES_PER_TOKEN = MEL_FRAMES_PER_TOKEN * SAMPLES_PER_MEL_FRAME  # 960
LOOKAHEAD_TOKENS = 3  # the encoder's pre-lookahead conv reads 3 tokens ahead (flow.pre_lookahead_len)

# Prompt: the last 100 tokens (4 s, 200 mel frames) of the reference. 4 s is within the 3-10 s prompts
# S3Gen/CosyVoice zero-shot voices use (the speaker x-vector still comes from the whole reference). Uncached,
# every render pays for these frames (time to first chunk is linear in them: scripts/bench_vocoder.py);
# cached, the prompt costs memory instead: per prompt frame, steps x CFG rows x attention layers x (K, V)
# in the decoder, i.e. 4.6 MB (English, fp32) or 0.46 MB (Turbo), so 0.9 GB / 92 MB per voice at 100
# tokens, plus 5.8 MB for the encoder's keys/values.
DEFAULT_PROMPT_MAX_TOKENS = 100
# Tokens before the new ones that are re-rendered as context (1 s); bounds a window at
# 25 + chunk + 3 tokens (plus the prompt when uncached) whatever the utterance length.
DEFAULT_LEFT_CONTEXT_TOKENS = 25
# Mel frames held back at the end of each HiFT call, re-rendered next call and crossfaded in the waveform
# (160 ms, as CosyVoice2's `mel_cache_len`). HiFT's edge error falls below 0.1% of the signal's RMS 8 frames
# from an edge (full-size model), so the crossfade never mixes in badly-conditioned samples. Must be even.
DEFAULT_CROSSFADE_MEL_FRAMES = 8
DEFAULT_PROMPT_CACHE_BYTES = 2 * 2**30  # LRU budget for prompt caches (a voice's is rebuilt when evicted)
PROMPT_NOISE_SEED = 0  # the prompt region's flow noise is fixed per voice (not per stream)
NOISE_BLOCK_FRAMES = 64  # stream noise is drawn block by block, so frame f's noise depends on (seed, f) only

_voice_keys = itertools.count()


@dataclass(frozen=True, slots=True, eq=False)
class VocoderVoice:
    """A voice's standardised S3Gen prompt; computed once, shared read-only by every stream."""

    prompt_tokens: torch.Tensor  # [1, P] long, speech tokens of the last P tokens of the reference
    prompt_mels: torch.Tensor  # [1, 80, 2P] their mel frames (decoder `cond` layout)
    prompt_noise: torch.Tensor  # [1, 80, 2P] flow noise of the prompt region
    speaker: torch.Tensor  # [1, 80] projected x-vector (flow.spk_embed_affine_layer(normalize(xvec)))
    key: int = field(init=False, default_factory=lambda: next(_voice_keys))  # identifies its prompt cache

    @property
    def prompt_token_count(self) -> int:
        return int(self.prompt_tokens.shape[1])

    @property
    def prompt_frames(self) -> int:
        return int(self.prompt_mels.shape[2])


class StreamingVocoder:
    """Turns speech-token streams into PCM with one shared S3Gen; streams never share a render."""

    def __init__(
        self,
        s3gen: S3Gen,
        *,
        n_cfm_timesteps: int,
        meanflow: bool,
        append_silence_tokens: int = 0,
        prompt_max_tokens: int = DEFAULT_PROMPT_MAX_TOKENS,
        left_context_tokens: int = DEFAULT_LEFT_CONTEXT_TOKENS,
        crossfade_mel_frames: int = DEFAULT_CROSSFADE_MEL_FRAMES,
        cache_prompt: bool = True,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
    ) -> None:
        if n_cfm_timesteps < 1:
            raise ValueError("n_cfm_timesteps must be >= 1")
        if min(append_silence_tokens, prompt_max_tokens, left_context_tokens, prompt_cache_bytes) < 0:
            raise ValueError("token counts and byte budgets must be >= 0")
        if crossfade_mel_frames < 0 or crossfade_mel_frames % MEL_FRAMES_PER_TOKEN:
            raise ValueError(f"crossfade_mel_frames must be a non-negative multiple of {MEL_FRAMES_PER_TOKEN}")
        flow = s3gen.flow
        assert flow.token_mel_ratio == MEL_FRAMES_PER_TOKEN and flow.pre_lookahead_len == LOOKAHEAD_TOKENS
        assert int(s3gen.mel2wav.f0_upsamp.scale_factor) == SAMPLES_PER_MEL_FRAME
        assert flow.vocab_size == SPEECH_VOCAB_SIZE and flow.output_size == MEL_BINS
        self.s3gen = s3gen
        self.n_cfm_timesteps = n_cfm_timesteps
        self.meanflow = meanflow
        self.append_silence_tokens = append_silence_tokens
        self.prompt_max_tokens = prompt_max_tokens
        self.left_context_tokens = left_context_tokens
        self.crossfade_mel_frames = crossfade_mel_frames
        self.prompt_cache_bytes = prompt_cache_bytes
        param = next(flow.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._t_span = _time_span(n_cfm_timesteps, meanflow, flow.decoder.t_scheduler, self.device, self.dtype)
        self._cfg_rate = float(flow.decoder.inference_cfg_rate)
        fade_in_np = _raised_cosine(crossfade_mel_frames * SAMPLES_PER_MEL_FRAME)
        self._fade_in = torch.from_numpy(fade_in_np).to(self.device, self.dtype)  # [crossfade samples]
        self._trim_fade = s3gen.trim_fade.to(self.device, self.dtype)  # [960]: 20 ms of silence, 20 ms rise
        self._tap = _EstimatorTap(flow.decoder.estimator)
        self._encoder = PrefixCachedEncoder(flow) if cache_prompt else None
        self._prompt_caches: OrderedDict[int, _PromptCache] = OrderedDict()  # voice key -> cache, LRU order

    @property
    def cache_prompt(self) -> bool:
        return self._encoder is not None

    @property
    def latency_tokens(self) -> int:
        """Tokens pushed but not yet returned while a stream is open: lookahead plus held-back frames."""
        return LOOKAHEAD_TOKENS + self.crossfade_mel_frames // MEL_FRAMES_PER_TOKEN

    @property
    def prompt_cache_nbytes(self) -> int:
        return sum(cache.nbytes for cache in self._prompt_caches.values())

    @torch.inference_mode()
    def prepare_voice(self, ref_dict: dict[str, Any]) -> VocoderVoice:
        """Standardise `S3Gen.embed_ref(...)` output (the last `prompt_max_tokens` tokens); cache the prompt.

        With the cache on this runs the decoder over the prompt once (about one uncached render's cost).
        """
        tokens = torch.as_tensor(ref_dict["prompt_token"]).to(self.device).long().reshape(1, -1)  # [1, T]
        feats = torch.as_tensor(ref_dict["prompt_feat"]).to(self.device, self.dtype)
        feats = feats.reshape(1, -1, MEL_BINS)  # [1, F, 80]
        xvector = torch.as_tensor(ref_dict["embedding"]).to(self.device, self.dtype).reshape(1, -1)  # [1, 192]
        # Token i covers mel frames 2i, 2i+1 (both counted from the start of the reference).
        usable_tokens = min(tokens.shape[1], feats.shape[1] // MEL_FRAMES_PER_TOKEN)
        kept_tokens = min(usable_tokens, self.prompt_max_tokens)
        first = usable_tokens - kept_tokens
        prompt_mels = feats[:, first * MEL_FRAMES_PER_TOKEN: usable_tokens * MEL_FRAMES_PER_TOKEN]
        generator = torch.Generator().manual_seed(PROMPT_NOISE_SEED)
        prompt_noise = torch.randn(1, MEL_BINS, prompt_mels.shape[1], generator=generator)
        if kept_tokens < self.prompt_max_tokens:
            log.info("voice prompt has %d tokens (< prompt_max_tokens=%d)", kept_tokens, self.prompt_max_tokens)
        voice = VocoderVoice(
            prompt_tokens=tokens[:, first:usable_tokens],
            prompt_mels=prompt_mels.transpose(1, 2).contiguous(),
            prompt_noise=prompt_noise.to(self.device, self.dtype),
            speaker=self.s3gen.flow.spk_embed_affine_layer(F.normalize(xvector, dim=1)),
        )
        self._prompt_cache(voice)
        return voice

    def open(self, voice: VocoderVoice, seed: int) -> "VocoderStream":
        if not 0 <= seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return VocoderStream(vocoder=self, voice=voice, seed=seed,
                             noise_generator=torch.Generator().manual_seed(seed))

    # --- renders (no per-stream state here) ---------------------------------------------------------------

    @torch.inference_mode()
    def render_mel(self, voice: VocoderVoice, tokens: Sequence[int], noise: torch.Tensor,
                   keep_from_token: int, final: bool) -> torch.Tensor:
        """Mel frames [1, 80, 2 * kept tokens] of tokens[keep_from_token : len - (0 if final else 3)].

        `tokens` is the whole window (left context, new tokens and, unless final, the 3 lookahead tokens);
        `noise` [1, 80, 2 * rendered tokens] is the flow noise of the window's rendered frames.
        """
        rendered_tokens = len(tokens) - (0 if final else LOOKAHEAD_TOKENS)
        assert 0 <= keep_from_token < rendered_tokens, (keep_from_token, rendered_tokens)
        window_frames = rendered_tokens * MEL_FRAMES_PER_TOKEN
        assert noise.shape == (1, MEL_BINS, window_frames), noise.shape
        noise = noise.to(self.device, self.dtype)
        window = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, W]
        cache = self._prompt_cache(voice)
        if cache is not None:
            mu = self._encode_window(cache.encoder, window)[:, :, :window_frames]  # [1, 80, window frames]
            mel = self._solve(noise, mu, torch.zeros_like(noise), voice.speaker, cache)  # [1, 80, window frames]
        else:
            mu = self._encode(torch.cat([voice.prompt_tokens, window], dim=1))  # [1, 80, 2 (P + W)]
            mu = mu[:, :, :voice.prompt_frames + window_frames]  # without the lookahead frames (finalize=False)
            x = torch.cat([voice.prompt_noise, noise], dim=2)  # [1, 80, P + window frames]
            cond = F.pad(voice.prompt_mels, (0, window_frames))  # [1, 80, P + window frames]
            mel = self._solve(x, mu, cond, voice.speaker)[:, :, voice.prompt_frames:]
        return mel[:, :, keep_from_token * MEL_FRAMES_PER_TOKEN:]

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor, rng_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """HiFT on mel [1, 80, M] -> (wav [M * 480], source [1, 1, M * 480]), global RNG untouched."""
        with _private_global_rng(rng_seed, self.device):
            wav, source = self.s3gen.hift_inference(mel.to(self.dtype), cache_source)
        return wav[0], source

    def _encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1, N] -> mu [1, 80, 2N], as flow.inference does (batch 1, no padding)."""
        flow = self.s3gen.flow
        lengths = torch.tensor([tokens.shape[1]], device=self.device)  # [1]
        h, _ = flow.encoder(flow.input_embedding(tokens), lengths)  # [1, 2N, 512]
        return flow.encoder_proj(h).transpose(1, 2).contiguous()  # [1, 80, 2N]

    def _encode_window(self, prefix: EncoderPrefix, window: torch.Tensor) -> torch.Tensor:
        """window [1, W] after the cached prompt -> mu [1, 80, 2W]."""
        assert self._encoder is not None
        return self._encoder.encode_window(prefix, window)

    def _solve(self, x: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, speaker: torch.Tensor,
               prompt_cache: "_PromptCache | None" = None, record: bool = False) -> torch.Tensor:
        """Euler integration of the flow from noise x [1, 80, T] (mu, cond: [1, 80, T]; speaker [1, 80]).

        With `prompt_cache`, the frames follow the cached prompt (record=False) or are the prompt (record=True).
        """
        estimator = self.s3gen.flow.decoder.estimator
        mode = None if prompt_cache is None else (_TapMode.RECORD if record else _TapMode.EXTEND)
        tap = self._tap.active(mode, prompt_cache) if mode is not None else contextlib.nullcontext()
        mask = torch.ones_like(x[:, :1])  # [1, 1, T]
        t_span = self._t_span
        with tap:
            if self.meanflow:  # distilled with CFG folded in: one row
                for step, (t, r) in enumerate(zip(t_span[:-1], t_span[1:])):
                    self._tap.step = step
                    t, r = t[None], r[None]
                    velocity = estimator(x, mask=mask, mu=mu, t=t, spks=speaker, cond=cond, r=r)
                    x = x + (r - t) * velocity
                return x
            # CFG: rows (cond, uncond); the unconditional row has mu, speaker and cond zeroed.
            mask2 = torch.cat([mask, mask])  # [2, 1, T]
            mu2 = torch.cat([mu, torch.zeros_like(mu)])  # [2, 80, T]
            speaker2 = torch.cat([speaker, torch.zeros_like(speaker)])  # [2, 80]
            cond2 = torch.cat([cond, torch.zeros_like(cond)])  # [2, 80, T]
            for step, (t, r) in enumerate(zip(t_span[:-1], t_span[1:])):
                self._tap.step = step
                velocity = estimator(torch.cat([x, x]), mask=mask2, mu=mu2, t=t.expand(2), spks=speaker2,
                                     cond=cond2)
                v_cond, v_uncond = velocity.chunk(2)  # [1, 80, T] each
                x = x + (r - t) * ((1.0 + self._cfg_rate) * v_cond - self._cfg_rate * v_uncond)
            return x

    def _prompt_cache(self, voice: VocoderVoice) -> "_PromptCache | None":
        """The voice's prompt activations (LRU within `prompt_cache_bytes`; rebuilt identically on a miss)."""
        if self._encoder is None or voice.prompt_token_count < MIN_PREFIX_TOKENS:
            return None
        cache = self._prompt_caches.get(voice.key)
        if cache is not None:
            self._prompt_caches.move_to_end(voice.key)
            return cache
        with torch.inference_mode():
            encoder = self._encoder.encode_prefix(voice.prompt_tokens)  # the prompt encoded alone
            cache = _PromptCache.empty(self.n_cfm_timesteps, self._tap, encoder)
            self._solve(voice.prompt_noise, encoder.mu, voice.prompt_mels, voice.speaker, cache, record=True)
        cache.seal()
        self._prompt_caches[voice.key] = cache
        while len(self._prompt_caches) > 1 and self.prompt_cache_nbytes > self.prompt_cache_bytes:
            self._prompt_caches.popitem(last=False)
        log.debug("prompt cache for voice %d: %d frames, %.1f MB", voice.key, voice.prompt_frames,
                  cache.nbytes / 1e6)
        return cache


@dataclass(slots=True, eq=False)
class VocoderStream:
    """One utterance's vocoder state; not thread-safe (the engine thread owns it)."""

    vocoder: StreamingVocoder
    voice: VocoderVoice
    seed: int
    noise_generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # every token pushed (+ appended silence once final)
    mel_tokens: int = 0  # tokens whose mel frames have been rendered (and handed to HiFT)
    emitted_samples: int = 0
    finished: bool = False
    noise: torch.Tensor = field(default_factory=lambda: torch.empty(1, MEL_BINS, 0))  # [1, 80, drawn frames] CPU
    # HiFT carry-over: the last mel frames of the previous HiFT call, their source excitation and waveform.
    held_mel: torch.Tensor | None = None  # [1, 80, H]
    held_source: torch.Tensor | None = None  # [1, 1, H * 480]
    held_wav: torch.Tensor | None = None  # [H * 480], rendered without right context, not yet returned

    @property
    def emitted_tokens(self) -> int:
        return self.emitted_samples // SAMPLES_PER_TOKEN

    @torch.inference_mode()
    def push(self, tokens: Sequence[int], final: bool) -> tuple[np.ndarray, int]:
        """Add speech tokens (ids < 6561). Returns (pcm float32 [960 * n], n): the audio that is now final.

        With final=True everything left is returned, the appended silence tokens included.
        """
        if self.finished:
            raise RuntimeError("push after final")
        new = [int(t) for t in tokens]
        if any(not 0 <= t < SPEECH_VOCAB_SIZE for t in new):
            raise ValueError(f"speech token ids must be in [0, {SPEECH_VOCAB_SIZE})")
        self.tokens.extend(new)
        if final:
            self.tokens.extend([SILENCE_TOKEN] * self.vocoder.append_silence_tokens)
            self.finished = True
        mel = self._render_new_mel(final)  # [1, 80, M]
        wav = self._vocode(mel, final)  # [samples]
        pcm = wav.float().cpu().numpy()
        assert pcm.size % SAMPLES_PER_TOKEN == 0, pcm.size
        return pcm, pcm.size // SAMPLES_PER_TOKEN

    @torch.inference_mode()
    def oneshot(self) -> np.ndarray:
        """All tokens pushed so far rendered in one window and one HiFT call, with this stream's noise."""
        vocoder = self.vocoder
        if not self.tokens:
            return np.zeros(0, dtype=np.float32)
        mel = vocoder.render_mel(self.voice, self.tokens, self._noise(0, len(self.tokens)), 0, final=True)
        wav, _ = vocoder.vocode(mel, _empty_source(vocoder), self._hift_seed(0))
        wav = _apply_trim_fade(wav, vocoder._trim_fade, 0)
        return wav.float().cpu().numpy()

    def _render_new_mel(self, final: bool) -> torch.Tensor:
        vocoder = self.vocoder
        stop = len(self.tokens) if final else len(self.tokens) - LOOKAHEAD_TOKENS
        if stop <= self.mel_tokens:
            return torch.empty(1, MEL_BINS, 0, device=vocoder.device, dtype=vocoder.dtype)
        first = max(0, self.mel_tokens - vocoder.left_context_tokens)
        window = self.tokens[first:]  # left context | new | lookahead (none when final)
        mel = vocoder.render_mel(self.voice, window, self._noise(first, stop), self.mel_tokens - first, final)
        self.mel_tokens = stop
        return mel

    def _vocode(self, mel: torch.Tensor, final: bool) -> torch.Tensor:
        """HiFT on [held frames | new frames]; returns the samples that are final now."""
        vocoder = self.vocoder
        if mel.shape[2] == 0 and (not final or self.held_wav is None):
            return torch.empty(0, device=vocoder.device, dtype=vocoder.dtype)
        if mel.shape[2] == 0:  # final with nothing new: the held tail is all that is left
            wav = self.held_wav
        else:
            hift_in = mel if self.held_mel is None else torch.cat([self.held_mel, mel], dim=2)  # [1, 80, H + M]
            source_in = _empty_source(vocoder) if self.held_source is None else self.held_source
            first_frame = self.emitted_samples // SAMPLES_PER_MEL_FRAME  # the held frames follow the emitted ones
            wav, source = vocoder.vocode(hift_in, source_in, self._hift_seed(first_frame))
            if self.held_wav is not None:
                overlap = self.held_wav.shape[0]
                fade_in = vocoder._fade_in if overlap == vocoder._fade_in.shape[0] \
                    else torch.from_numpy(_raised_cosine(overlap)).to(wav)
                wav = torch.cat([self.held_wav * (1.0 - fade_in) + wav[:overlap] * fade_in, wav[overlap:]])
            if not final:
                hold_frames = min(vocoder.crossfade_mel_frames, hift_in.shape[2])
                hold_samples = hold_frames * SAMPLES_PER_MEL_FRAME
                self.held_mel = hift_in[:, :, hift_in.shape[2] - hold_frames:]
                self.held_source = source[:, :, source.shape[2] - hold_samples:]
                self.held_wav = wav[wav.shape[0] - hold_samples:]
                wav = wav[:wav.shape[0] - hold_samples]
        if final:
            self.held_mel = self.held_source = self.held_wav = None
        wav = _apply_trim_fade(wav, vocoder._trim_fade, self.emitted_samples)
        self.emitted_samples += wav.shape[0]
        return wav

    def _noise(self, first_token: int, stop_token: int) -> torch.Tensor:
        """Flow noise [1, 80, 2 * (stop - first)] of the utterance's frames from token `first_token` on."""
        first_frame, stop_frame = first_token * MEL_FRAMES_PER_TOKEN, stop_token * MEL_FRAMES_PER_TOKEN
        while self.noise.shape[2] < stop_frame:
            block = torch.randn(1, MEL_BINS, NOISE_BLOCK_FRAMES, generator=self.noise_generator)
            self.noise = torch.cat([self.noise, block], dim=2)
        return self.noise[:, :, first_frame:stop_frame]

    def _hift_seed(self, first_frame: int) -> int:
        return int(np.random.SeedSequence([self.seed, first_frame]).generate_state(1, np.uint64)[0]) >> 1


# --- prompt cache: taps on the estimator's attention layers and causal convs ------------------------------


class _TapMode(enum.Enum):
    RECORD = 1  # the estimator runs on the prompt frames: store their keys/values and conv tails
    EXTEND = 2  # the estimator runs on frames that follow the prompt: prepend the stored ones


@dataclass(slots=True, eq=False)
class _PromptCache:
    """A prompt's encoder state and decoder activations at every Euler step; read-only once sealed."""

    keys: list[list[torch.Tensor | None]]  # [step][attention layer] -> [rows, P, inner]
    values: list[list[torch.Tensor | None]]  # [step][attention layer] -> [rows, P, inner]
    conv_tails: list[list[torch.Tensor | None]]  # [step][causal conv] -> [rows, C_in, kernel - 1]
    encoder: EncoderPrefix  # the prompt's encoder state (synth/flow_encoder.py)
    nbytes: int = 0

    @staticmethod
    def empty(steps: int, tap: "_EstimatorTap", encoder: EncoderPrefix) -> "_PromptCache":
        return _PromptCache(
            encoder=encoder,
            keys=[[None] * len(tap.attentions) for _ in range(steps)],
            values=[[None] * len(tap.attentions) for _ in range(steps)],
            conv_tails=[[None] * len(tap.convs) for _ in range(steps)],
        )

    def seal(self) -> None:
        tensors = [t for table in (self.keys, self.values, self.conv_tails) for row in table for t in row]
        assert all(t is not None for t in tensors), "prompt cache incomplete"
        self.nbytes = self.encoder.nbytes + nbytes_of(tensors)


class _EstimatorTap:
    """Installs, for the duration of a render, attention processors and conv hooks on the estimator."""

    def __init__(self, estimator: torch.nn.Module) -> None:
        self.attentions = [m for m in estimator.modules() if isinstance(m, Attention)]
        self.convs = [m for m in estimator.modules() if isinstance(m, CausalConv1d)]
        # Caching is exact only if attention and causal convs are the only ops that mix frames.
        for module in estimator.modules():
            mixes_frames = isinstance(module, torch.nn.ConvTranspose1d) or (
                isinstance(module, torch.nn.Conv1d) and not isinstance(module, CausalConv1d)
                and module.kernel_size != (1,))
            if mixes_frames:
                raise RuntimeError(f"prompt cache cannot handle {type(module).__name__} in the estimator")
        for attn in self.attentions:
            plain = (attn.spatial_norm is None and attn.group_norm is None and attn.norm_cross is None
                     and not attn.residual_connection and attn.rescale_output_factor == 1.0)
            if not plain:
                raise RuntimeError("prompt cache expects plain self-attention in the estimator")
        self.mode: _TapMode | None = None
        self.cache: _PromptCache | None = None
        self.step = 0

    @contextlib.contextmanager
    def active(self, mode: _TapMode, cache: _PromptCache) -> Iterator[None]:
        saved = [attn.processor for attn in self.attentions]
        handles = []
        self.mode, self.cache, self.step = mode, cache, 0
        try:
            for slot, attn in enumerate(self.attentions):
                attn.set_processor(_TapProcessor(self, slot, saved[slot]))
            for slot, conv in enumerate(self.convs):
                handles.append(conv.register_forward_pre_hook(functools.partial(self._conv_input, slot)))
                handles.append(conv.register_forward_hook(self._conv_output))
            yield
        finally:
            for attn, processor in zip(self.attentions, saved):
                attn.set_processor(processor)
            for handle in handles:
                handle.remove()
            self.mode, self.cache = None, None

    def _conv_input(self, slot: int, conv: CausalConv1d, args: tuple[torch.Tensor, ...]) -> Any:
        x = args[0]  # [rows, C_in, T]
        tail_frames = conv.causal_padding[0]
        assert self.cache is not None
        if self.mode is _TapMode.RECORD:
            self.cache.conv_tails[self.step][slot] = F.pad(x, (max(0, tail_frames - x.shape[2]), 0))[..., -tail_frames:]
            return None
        tail = self.cache.conv_tails[self.step][slot]
        assert tail is not None
        return (torch.cat([tail, x], dim=2),)  # the prompt's last input frames replace the zero padding

    def _conv_output(self, conv: CausalConv1d, args: Any, output: torch.Tensor) -> Any:
        if self.mode is _TapMode.EXTEND:
            return output[:, :, conv.causal_padding[0]:]  # drop the outputs of the prepended tail
        return None


class _TapProcessor:
    """Attention processor: records the prompt's keys/values, or attends over [prompt | frames]."""

    def __init__(self, tap: _EstimatorTap, slot: int, inner: Any) -> None:
        self.tap, self.slot, self.inner = tap, slot, inner

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        tap, cache = self.tap, self.tap.cache
        assert encoder_hidden_states is None and cache is not None
        if tap.mode is _TapMode.RECORD:
            cache.keys[tap.step][self.slot] = attn.to_k(hidden_states)
            cache.values[tap.step][self.slot] = attn.to_v(hidden_states)
            return self.inner(attn, hidden_states, None, attention_mask, temb)
        prompt_keys, prompt_values = cache.keys[tap.step][self.slot], cache.values[tap.step][self.slot]
        assert prompt_keys is not None and prompt_values is not None
        rows, frames, _ = hidden_states.shape  # hidden_states: [rows, T, dim]
        prompt_frames = prompt_keys.shape[1]
        key = torch.cat([prompt_keys, attn.to_k(hidden_states)], dim=1)  # [rows, P + T, inner]
        value = torch.cat([prompt_values, attn.to_v(hidden_states)], dim=1)  # [rows, P + T, inner]
        head_dim = key.shape[-1] // attn.heads
        query = attn.to_q(hidden_states).view(rows, frames, attn.heads, head_dim).transpose(1, 2)  # [rows, H, T, d]
        key = key.view(rows, prompt_frames + frames, attn.heads, head_dim).transpose(1, 2)  # [rows, H, P + T, d]
        value = value.view(rows, prompt_frames + frames, attn.heads, head_dim).transpose(1, 2)
        bias = None
        if attention_mask is not None:  # additive bias [rows, 1 or T, T] over the frames; prompt keys visible
            bias = F.pad(attention_mask, (prompt_frames, 0))[:, None]  # [rows, 1, 1 or T, P + T]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)  # [rows, H, T, d]
        out = out.transpose(1, 2).reshape(rows, frames, attn.heads * head_dim).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


# --- helpers ----------------------------------------------------------------------------------------------


def _time_span(n_steps: int, meanflow: bool, scheduler: str, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """The Euler time grid of CausalConditionalCFM.forward: cosine-warped unless mean-flow."""
    t_span = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)  # [n + 1]
    if not meanflow and scheduler == "cosine":
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    return t_span


def _raised_cosine(n: int) -> np.ndarray:
    """Fade-in weights [n] rising from ~0 to ~1; (1 - w) is the matching fade-out (they sum to 1)."""
    return ((1.0 - np.cos(np.pi * (np.arange(n) + 0.5) / max(n, 1))) / 2.0).astype(np.float32)


def _empty_source(vocoder: StreamingVocoder) -> torch.Tensor:
    return torch.zeros(1, 1, 0, device=vocoder.device, dtype=vocoder.dtype)


def _apply_trim_fade(wav: torch.Tensor, trim_fade: torch.Tensor, first_sample: int) -> torch.Tensor:
    """S3Gen's start-of-utterance fade, applied to the utterance's first samples only."""
    fade_samples = trim_fade.shape[0] - first_sample
    if fade_samples <= 0 or wav.shape[0] == 0:
        return wav
    n = min(fade_samples, wav.shape[0])
    return torch.cat([wav[:n] * trim_fade[first_sample:first_sample + n], wav[n:]])


@contextlib.contextmanager
def _private_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run with the global generator(s) of `device` reseeded, restoring the caller's state afterwards."""
    cuda = device.type == "cuda"
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield
