"""Streaming S3Gen vocoder: speech tokens in, final 24 kHz PCM out, chunk by chunk, many streams per render.

Each render of a stream covers one window of the flow (token -> mel) model,

    [voice prompt | left-context tokens | new tokens | 3 lookahead tokens]

and keeps only the mel frames of the new tokens. The flow-matching noise is fixed per stream and indexed by
absolute frame, so overlapping renders start from the same noise. The new mel frames go through HiFT
(mel -> waveform) after the last few mel frames of the previous render, whose sine-source excitation is
carried over; the waveform of those re-rendered frames is crossfaded with the tail held back last time.

Batches (`render`): every stream due in a tick is rendered in one call, whatever its voice, window length or
chunk index. Windows are grouped by a padded length (`FLOW_BUCKET_TOKENS`), the encoder, the Euler loop of the
estimator (English: both CFG rows of every stream in one batch) and HiFT (`HIFT_BUCKET_FRAMES`) run once per
group on padded, masked tensors, and nothing in a render is per stream except host-side bookkeeping in numpy:
the torch ops of a tick do not grow with the number of streams (tests/synth/test_vocoder.py counts them).
A stream's audio does not depend on what it is batched with: padding is masked out (flow) or fixed by the
stream's own length (HiFT's bucket), its noise is drawn from its own seed by position (`synth/counter_noise.py`,
no global RNG), and on the CPU every matrix product of a reproducible stream (the client gave the seed) is
row-invariant (`synth/invariant_ops.py`), so a seeded stream gives the same bits alone or among 63 others. The
other streams of a tick render in a batch of their own through the library's kernels (oneDNN, MKL: 2-3x faster
on this CPU, to float rounding of the same values).

Prompt cache (`cache_prompt=True`, the default): the voice prompt's activations are computed once per voice,
in the encoder (`synth/flow_encoder.py`) and in the estimator at every Euler step (`synth/flow_estimator.py`),
and each render runs both on the window's positions only, so no chunk re-processes the prompt. The prompt is
then encoded and denoised as if alone (a prefix mask: the prompt does not see the window, as with CosyVoice2's
chunk-causal mask for a prompt that ends on a chunk boundary). With `cache_prompt=False` (or a prompt shorter
than MIN_PREFIX_TOKENS) every render runs the library's exact one-shot semantics on [prompt | window].

What a stream guarantees:
- total samples = 960 x (tokens added + appended silence), whatever the render schedule;
- its PCM is a pure function of (voice, seed, tokens, render boundaries): same inputs, bitwise same PCM, whatever
  else runs and on whichever thread (CPU), when opened `reproducible` (the default); otherwise to float rounding;
- rendering everything at once gives exactly `oneshot()`;
- other schedules give the same length and differ from `oneshot()` by about as much as two one-shot renders
  that differ only in HiFT's random source, plus the flow's windowing.

Threads: the modules hold no state between calls; `prepare_voice` may run on one thread while `render` runs on
another. A stream is not thread-safe (its owner renders it); the prompt-cache table has its own lock.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.s3gen.const import S3GEN_SIL, S3GEN_SR

from synth import counter_noise, invariant_ops
from synth.flow_encoder import (
    MIN_PREFIX_TOKENS,
    EncoderPrefix,
    PrefixCachedEncoder,
)
from synth.flow_estimator import PrefixCachedEstimator, StepPrefix
from synth.hift import BatchedHift
from synth.invariant_ops import row_invariant_default
from synth.render_checkpoints import checkpoint
from synth.render_graphs import DEFAULT_MAX_GRAPHS, GraphSet

log = logging.getLogger(__name__)

Pcm = npt.NDArray[np.float32]  # host float32 arrays: PCM, mels, carried sources

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
# every render pays for these frames; cached, the prompt costs memory instead: per prompt frame, steps x CFG
# rows x attention layers x (K, V) in the decoder, i.e. 4.6 MB (English, fp32) or 0.46 MB (Turbo), so 0.9 GB /
# 92 MB per voice at 100 tokens, plus 5.8 MB for the encoder's keys/values.
DEFAULT_PROMPT_MAX_TOKENS = 100
# Tokens before the new ones that are re-rendered as context (1 s); bounds a window at
# 25 + chunk + 3 tokens (plus the prompt when uncached) whatever the utterance length.
DEFAULT_LEFT_CONTEXT_TOKENS = 25
# Mel frames held back at the end of each HiFT call, re-rendered next call and crossfaded in the waveform
# (160 ms, as CosyVoice2's `mel_cache_len`). HiFT's edge error falls below 0.1% of the signal's RMS 8 frames
# from an edge (full-size model), so the crossfade never mixes in badly-conditioned samples. Must be even.
DEFAULT_CROSSFADE_MEL_FRAMES = 8
DEFAULT_MAX_CHUNK_TOKENS = 96  # new tokens one render covers at most (bounds the window and its bucket)
GRAPH_PCM_TOLERANCE = 1e-3  # start-up check of the graphs: PCM (full scale 1) replayed vs eager, at most this apart
GRAPH_CHECK_SEED = 4321
DEFAULT_PROMPT_CACHE_BYTES = 2 * 2**30  # LRU budget for prompt caches not in use (streams hold theirs)
PROMPT_NOISE_SEED = 0  # the prompt region's flow noise is fixed per voice (not per stream)
# Padded lengths: rendered window tokens round up to a multiple of FLOW_BUCKET_TOKENS, HiFT inputs to a
# multiple of HIFT_BUCKET_FRAMES. The usual windows (16, 49, 73, 121 tokens) waste 0-14 %; HiFT's
# (32, 56, 104, 200 frames) 0-14 %. Each distinct bucket is one batched call per tick (and, on a GPU, one
# captured graph per batch size).
FLOW_BUCKET_TOKENS = 8
HIFT_BUCKET_FRAMES = 16
COMPILED_SHAPES = 256  # dynamo's per-function cache: one entry per (batch size, bucket) a compiled render meets


_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _without_grad(method: _F) -> _F:
    """Run a StreamingVocoder method in its grad mode: inference mode, or no_grad once compiled (torch.compile
    cannot take inference tensors through views)."""
    @functools.wraps(method)
    def wrapper(self: StreamingVocoder, *args: Any, **kwargs: Any) -> Any:
        with (torch.no_grad() if self.compiled else torch.inference_mode()):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


_voice_keys = iter(range(1, 2**62))
_voice_keys_lock = threading.Lock()


def _next_voice_key() -> int:
    with _voice_keys_lock:
        return next(_voice_keys)


@dataclass(frozen=True, slots=True, eq=False)
class VocoderVoice:
    """A voice's standardised S3Gen prompt; computed once, shared read-only by every stream."""

    prompt_tokens: torch.Tensor  # [1, P] long, speech tokens of the last P tokens of the reference
    prompt_mels: torch.Tensor  # [1, 80, 2P] their mel frames (decoder `cond` layout)
    prompt_noise: torch.Tensor  # [1, 80, 2P] flow noise of the prompt region
    speaker: torch.Tensor  # [1, 80] projected x-vector (flow.spk_embed_affine_layer(normalize(xvec)))
    key: int = field(init=False, default_factory=_next_voice_key)  # identifies its prompt cache

    @property
    def prompt_token_count(self) -> int:
        return int(self.prompt_tokens.shape[1])

    @property
    def prompt_frames(self) -> int:
        return int(self.prompt_mels.shape[2])


@dataclass(frozen=True, slots=True, eq=False)
class PromptCache:
    """A prompt's encoder state and estimator activations at every Euler step; read-only."""

    encoder: EncoderPrefix  # left-padded to prompt_max_tokens
    steps: tuple[StepPrefix, ...]  # per Euler step; rows (cond, uncond) with CFG, else (cond,)

    @property
    def nbytes(self) -> int:
        return self.encoder.nbytes + sum(step.nbytes for step in self.steps)


@dataclass(frozen=True, slots=True, eq=False)
class RenderJob:
    """One stream's share of a tick: its next window, planned from its state (which render() then advances)."""

    stream: VocoderStream
    window_first: int  # first token of the window (left context included)
    stop: int  # mel frames are rendered for tokens [mel_tokens, stop)
    final: bool  # the last render of the stream: everything left comes out

    @property
    def new_tokens(self) -> int:
        return self.stop - self.stream.mel_tokens

    @property
    def window_tokens(self) -> list[int]:
        end = self.stop if self.final else self.stop + LOOKAHEAD_TOKENS
        return self.stream.tokens[self.window_first:end]


class StreamingVocoder:
    """Turns speech-token streams into PCM with one shared S3Gen, many streams per render."""

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
        max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
        cache_prompt: bool = True,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        row_invariant: bool | None = None,
        gemm_dtype: torch.dtype = torch.float32,
    ) -> None:
        if n_cfm_timesteps < 1:
            raise ValueError("n_cfm_timesteps must be >= 1")
        if min(append_silence_tokens, prompt_max_tokens, left_context_tokens, prompt_cache_bytes) < 0:
            raise ValueError("token counts and byte budgets must be >= 0")
        if max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        if crossfade_mel_frames < 0 or crossfade_mel_frames % MEL_FRAMES_PER_TOKEN:
            raise ValueError(f"crossfade_mel_frames must be a non-negative multiple of {MEL_FRAMES_PER_TOKEN}")
        flow = s3gen.flow
        if not (flow.token_mel_ratio == MEL_FRAMES_PER_TOKEN and flow.pre_lookahead_len == LOOKAHEAD_TOKENS
                and int(s3gen.mel2wav.f0_upsamp.scale_factor) == SAMPLES_PER_MEL_FRAME
                and flow.vocab_size == SPEECH_VOCAB_SIZE and flow.output_size == MEL_BINS):
            raise RuntimeError("this S3Gen's rates or sizes differ from chatterbox 0.1.7's")
        self.s3gen = s3gen
        self.n_cfm_timesteps = n_cfm_timesteps
        self.meanflow = meanflow
        self.append_silence_tokens = append_silence_tokens
        self.prompt_max_tokens = prompt_max_tokens
        self.left_context_tokens = left_context_tokens
        self.crossfade_mel_frames = crossfade_mel_frames
        self.max_chunk_tokens = max_chunk_tokens
        self.prompt_cache_bytes = prompt_cache_bytes
        param = next(flow.parameters())
        self.device, self.dtype = param.device, param.dtype
        invariant = row_invariant_default(self.device) if row_invariant is None else row_invariant
        self.row_invariant = invariant
        if gemm_dtype != torch.float32 and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError("bfloat16 products (gemm_dtype) are for a float32 S3Gen on the CPU")
        self.gemm_dtype = gemm_dtype
        kernels = invariant_ops.Kernels(invariant, gemm_dtype)
        self.encoder = PrefixCachedEncoder(flow, kernels)
        self.estimator = PrefixCachedEstimator(flow.decoder.estimator, kernels)
        self.hift = BatchedHift(s3gen.mel2wav, kernels)
        self.cache_prompt = cache_prompt
        self.cfg_rows = 1 if meanflow else 2  # English: rows (cond, uncond); the mean-flow decoder folds CFG in
        self._t_span = _time_span(n_cfm_timesteps, meanflow, flow.decoder.t_scheduler, self.device, self.dtype)
        self._cfg_rate = float(flow.decoder.inference_cfg_rate)
        self._fade_in = _raised_cosine(crossfade_mel_frames * SAMPLES_PER_MEL_FRAME)  # [crossfade samples]
        self._trim_fade = s3gen.trim_fade.detach().float().cpu().numpy()  # [960]: 20 ms of silence, 20 ms rise
        self._time_embeddings = [self.estimator.time_embedding(t[None], r[None] if meanflow else None)
                                 for t, r in zip(self._t_span[:-1], self._t_span[1:], strict=False)]
        self._prompt_caches: OrderedDict[int, PromptCache] = OrderedDict()  # voice key -> cache, LRU order
        self._prompt_lock = threading.Lock()
        self.compiled = False
        self.graphs: GraphSet | None = None  # `use_graphs`: the three functions replayed per input signature
        # The three batched functions of a render, on tensors only (replaced in `compile` or `use_graphs`).
        self._encode_fn: Callable[..., torch.Tensor] = self._encode_after_prompt
        self._estimate_fn: Callable[..., torch.Tensor] = self._estimate_after_prompt
        self._hift_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self.hift.__call__

    def compile(self, mode: str = "reduce-overhead", backend: str = "inductor") -> None:
        """Compile the encoder, the estimator step (cached prompts) and HiFT; on CUDA, mode "reduce-overhead"
        captures a CUDA graph per input shape, i.e. per (batch size, bucket), batch sizes padded to powers of two.
        Tensor inputs only: the host-side batch building stays eager."""
        import torch._dynamo

        with self._prompt_lock:
            if self._prompt_caches:
                raise RuntimeError("compile() before preparing voices (their caches would be inference tensors)")
        if self.graphs is not None:
            raise RuntimeError("a vocoder replays graphs or runs compiled functions, not both")
        self.compiled = True
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILED_SHAPES)
        compile_mode = mode if backend == "inductor" else None
        self._encode_fn = torch.compile(self._encode_after_prompt, dynamic=False, backend=backend, mode=compile_mode)
        self._estimate_fn = torch.compile(self._estimate_after_prompt, dynamic=False, backend=backend,
                                          mode=compile_mode)
        self._hift_fn = torch.compile(self.hift.__call__, dynamic=False, backend=backend, mode=compile_mode)

    def use_graphs(self, capture: bool | None = None, max_graphs: int = DEFAULT_MAX_GRAPHS) -> GraphSet:
        """Replay the encoder, the estimator step (cached prompts) and HiFT as one CUDA graph per input signature,
        each captured the first time it is met (synth/render_graphs.py); batches are padded to powers of two.
        `capture` (default: on a CUDA device) False runs the same static-buffer plumbing eagerly (the tests)."""
        if self.compiled:
            raise RuntimeError("a vocoder replays graphs or runs compiled functions, not both")
        capture = self.device.type == "cuda" if capture is None else capture
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a vocoder on a CUDA device")
        graphs = GraphSet(capture, max_graphs)
        self._encode_fn = graphs.wrap(self._encode_after_prompt, "encoder")
        self._estimate_fn = graphs.wrap(self._estimate_after_prompt, "estimator")
        self._hift_fn = graphs.wrap(self.hift.__call__, "hift")
        self.graphs = graphs
        return graphs

    def drop_graphs(self) -> None:
        """Render eagerly from now on (a capture failed, or a replay differed from eager at start-up)."""
        self._encode_fn = self._encode_after_prompt
        self._estimate_fn = self._estimate_after_prompt
        self._hift_fn = self.hift.__call__
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def check_graphs(self, voice: VocoderVoice, chunk_tokens: int) -> str:
        """A first chunk of one stream rendered through the graphs and again eagerly (the same functions called
        directly), from identical streams: '' when the PCM agrees (bitwise, or within GRAPH_PCM_TOLERANCE of
        full scale), else how far apart they are. The signatures are the warm-up's: no new capture."""
        if self.graphs is None:
            return ""
        graphed = self._first_chunk(voice, chunk_tokens)
        saved = (self._encode_fn, self._estimate_fn, self._hift_fn)
        self._encode_fn, self._estimate_fn, self._hift_fn = (self._encode_after_prompt, self._estimate_after_prompt,
                                                             self.hift.__call__)
        try:
            eager = self._first_chunk(voice, chunk_tokens)
        finally:
            self._encode_fn, self._estimate_fn, self._hift_fn = saved
        if graphed.shape != eager.shape or not eager.size:
            return f"a first chunk rendered {graphed.shape} samples through the graphs, {eager.shape} eagerly"
        worst = float(np.abs(graphed - eager).max())
        if worst > GRAPH_PCM_TOLERANCE:
            return f"a first chunk's PCM differs from eager by up to {worst:.3g} (tolerance {GRAPH_PCM_TOLERANCE:g})"
        return ""

    def _first_chunk(self, voice: VocoderVoice, chunk_tokens: int) -> Pcm:
        stream = self.open(voice, GRAPH_CHECK_SEED, reproducible=False)  # the warm-up's signatures
        stream.prompt = self.prompt_cache(voice)
        stream.add([(7 * i + 3) % SPEECH_VOCAB_SIZE for i in range(chunk_tokens + self.latency_tokens)], final=False)
        job = stream.next_job(chunk_tokens)
        if job is None:
            raise RuntimeError("no first chunk to render")
        return self.render([job])[0]

    @_without_grad
    def prompt_cache_bytes_estimate(self) -> int:
        """Device bytes of one stream's prompt cache at the longest prompt (what a graph's static inputs copy per
        stream), from a prompt cache built for a silent prompt of that length."""
        frames = self.prompt_max_tokens * MEL_FRAMES_PER_TOKEN
        speaker_in = self.s3gen.flow.spk_embed_affine_layer.in_features
        voice = VocoderVoice(
            prompt_tokens=torch.zeros(1, self.prompt_max_tokens, dtype=torch.long, device=self.device),
            prompt_mels=torch.zeros(1, MEL_BINS, frames, device=self.device, dtype=self.dtype),
            prompt_noise=torch.zeros(1, MEL_BINS, frames, device=self.device, dtype=self.dtype),
            speaker=self.s3gen.flow.spk_embed_affine_layer(torch.zeros(1, speaker_in, device=self.device,
                                                                      dtype=self.dtype)))
        if not self.uses_prompt_cache(voice):
            return 0
        return self._build_prompt_cache(voice).nbytes

    def _encode_after_prompt(self, mu: torch.Tensor, embedded_tail: torch.Tensor, hidden_tail: torch.Tensor,
                             layer_kv: tuple[torch.Tensor, ...], key_mask: torch.Tensor, tokens: torch.Tensor,
                             lengths: torch.Tensor) -> torch.Tensor:
        """The encoder over the windows after each row's prompt (or none), on tensors only."""
        prefix = EncoderPrefix(mu=mu, embedded_tail=embedded_tail, hidden_tail=hidden_tail, layer_kv=layer_kv,
                               key_mask=key_mask, token_layers=len(self.encoder.token_layers))
        return self.encoder.encode(prefix, tokens, lengths)

    def _estimate_after_prompt(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, time_emb: torch.Tensor,
                               spks: torch.Tensor, cond: torch.Tensor, keys: tuple[torch.Tensor, ...],
                               values: tuple[torch.Tensor, ...], conv_tails: tuple[torch.Tensor, ...],
                               key_mask: torch.Tensor) -> torch.Tensor:
        """One estimator call after cached prompts, on tensors only (what `compile` wraps)."""
        return self.estimator(x, mask, mu, time_emb, spks, cond, StepPrefix(keys, values, conv_tails, key_mask))

    @property
    def latency_tokens(self) -> int:
        """Tokens pushed but not yet returned while a stream is open: lookahead plus held-back frames."""
        return LOOKAHEAD_TOKENS + self.hold_tokens

    @property
    def hold_tokens(self) -> int:
        return self.crossfade_mel_frames // MEL_FRAMES_PER_TOKEN

    @property
    def prompt_cache_nbytes(self) -> int:
        with self._prompt_lock:
            return sum(cache.nbytes for cache in self._prompt_caches.values())

    # --- voices ------------------------------------------------------------------------------------------

    @_without_grad
    def prepare_voice(self, ref_dict: dict[str, Any]) -> VocoderVoice:
        """Standardise `S3Gen.embed_ref(...)` output (the last `prompt_max_tokens` tokens) and cache its prompt.

        With the cache on this runs the estimator over the prompt once (about one uncached render's cost).
        Thread-safe: it may run on any thread while others render.
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
        self.prompt_cache(voice)
        return voice

    def uses_prompt_cache(self, voice: VocoderVoice) -> bool:
        return self.cache_prompt and voice.prompt_token_count >= MIN_PREFIX_TOKENS

    def cached_prompt(self, voice: VocoderVoice) -> PromptCache | None:
        """The voice's prompt cache if it is resident (no computation)."""
        with self._prompt_lock:
            cache = self._prompt_caches.get(voice.key)
            if cache is not None:
                self._prompt_caches.move_to_end(voice.key)
            return cache

    @_without_grad
    def prompt_cache(self, voice: VocoderVoice) -> PromptCache | None:
        """The voice's prompt activations, computed if not resident (LRU within `prompt_cache_bytes`; a rebuilt
        cache is bitwise the same). None for a voice that renders uncached."""
        if not self.uses_prompt_cache(voice):
            return None
        cache = self.cached_prompt(voice)
        if cache is not None:
            return cache
        cache = self._build_prompt_cache(voice)
        with self._prompt_lock:
            self._prompt_caches[voice.key] = cache
            while len(self._prompt_caches) > 1 and \
                    sum(c.nbytes for c in self._prompt_caches.values()) > self.prompt_cache_bytes:
                self._prompt_caches.popitem(last=False)
        log.debug("prompt cache for voice %d: %d frames, %.1f MB", voice.key, voice.prompt_frames, cache.nbytes / 1e6)
        return cache

    def _build_prompt_cache(self, voice: VocoderVoice) -> PromptCache:
        encoder = self.encoder.encode_prefix(voice.prompt_tokens)  # the prompt encoded alone
        rows = self.cfg_rows
        x = voice.prompt_noise.transpose(1, 2)  # [1, 2P, 80]
        mu = _cfg_rows(encoder.mu, rows)
        spks = _cfg_rows(voice.speaker, rows)
        cond = _cfg_rows(voice.prompt_mels.transpose(1, 2), rows)
        steps: list[StepPrefix] = []
        for step, time_emb in enumerate(self._time_embeddings):
            velocity, prefix = self.estimator.record(_repeat_rows(x, rows), mu, time_emb, spks, cond)
            x = self._euler_step(x, velocity, step)
            steps.append(prefix.left_padded(self.prompt_max_tokens * MEL_FRAMES_PER_TOKEN))
        return PromptCache(encoder=encoder.left_padded(self.prompt_max_tokens), steps=tuple(steps))

    # --- streams -----------------------------------------------------------------------------------------

    def open(self, voice: VocoderVoice, seed: int, reproducible: bool = True) -> VocoderStream:
        """A stream; `reproducible=False` (nobody asked for this seed's audio again) lets its renders run the
        library's faster kernels on the CPU, whose bits depend on the batch."""
        if not 0 <= seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        return VocoderStream(vocoder=self, voice=voice, seed=seed, reproducible=reproducible)

    def warm_first_chunks(self, voice: VocoderVoice, chunk_tokens: int, max_batch: int) -> int:
        """With graphs (`use_graphs`): render a first chunk of 1, 2, 4, ... max_batch streams of `voice` (synthetic
        tokens; the PCM goes nowhere), so that the signatures of every later first-chunk tick are captured before
        a listener waits on one (a first chunk's window and HiFT input have one length whatever the voice).
        Returns the graphs it built (0 without graphs)."""
        if self.graphs is None:
            return 0
        before = self.graphs.captured
        prompt = self.prompt_cache(voice)
        batch = 1
        while True:
            streams = [self.open(voice, seed, reproducible=False) for seed in range(batch)]
            for stream in streams:
                stream.prompt = prompt
                stream.add([0] * (chunk_tokens + self.latency_tokens), final=False)
            jobs = [stream.next_job(chunk_tokens) for stream in streams]
            self.render([job for job in jobs if job is not None])
            if batch >= max_batch:
                return self.graphs.captured - before
            batch = min(2 * batch, max_batch)

    # --- the batched render ------------------------------------------------------------------------------

    @_without_grad
    def render(self, jobs: Sequence[RenderJob]) -> list[Pcm]:
        """Render one window of each job's stream (one job per stream), all in one batch; returns each job's PCM
        (float32 [960 n]) that is final now, in job order, and advances the streams."""
        if len({job.stream for job in jobs}) != len(jobs):
            raise ValueError("one job per stream per render")
        if any(job.stream.vocoder is not self for job in jobs):
            raise ValueError("a job of another vocoder's stream")
        out: list[Pcm] = [np.zeros(0, dtype=np.float32)] * len(jobs)
        for reproducible in (True, False):  # at most two batches: row-invariant kernels, then the library's
            indices = [i for i, job in enumerate(jobs) if job.stream.reproducible == reproducible]
            if not indices:
                continue
            part = [jobs[i] for i in indices]
            with invariant_ops.library_kernels(not reproducible):
                mels = self._render_flow(part)  # per job: [2 * new tokens, 80], or None when nothing new is rendered
                waves = self._render_hift(part, mels)
            for index, job, mel, wave in zip(indices, part, mels, waves, strict=True):
                out[index] = job.stream._emit(job, mel, wave)
        return out

    @_without_grad
    def _render_flow(self, jobs: Sequence[RenderJob]) -> list[Pcm | None]:
        """Mel frames [2 * new tokens, 80] (host float32) of each job with new tokens, grouped by padded length."""
        groups: dict[tuple[bool, int], list[int]] = {}
        for index, job in enumerate(jobs):
            if job.new_tokens <= 0:
                continue
            cached = job.stream.prompt is not None
            rendered = job.stop - job.window_first + (0 if cached else job.stream.voice.prompt_token_count)
            groups.setdefault((cached, _round_up(rendered, FLOW_BUCKET_TOKENS)), []).append(index)
        out: list[Pcm | None] = [None] * len(jobs)
        for (cached, bucket_tokens), indices in sorted(groups.items()):
            group = self._batch_bucket([jobs[i] for i in indices])
            mel = self._flow_group(group, cached, bucket_tokens).float().cpu().numpy()  # [B, frames, 80]
            for row, (index, job) in enumerate(zip(indices, group, strict=False)):
                stream = job.stream
                offset = 0 if cached else stream.voice.prompt_frames
                keep = (stream.mel_tokens - job.window_first) * MEL_FRAMES_PER_TOKEN + offset
                out[index] = mel[row, keep:keep + job.new_tokens * MEL_FRAMES_PER_TOKEN]
        return out

    def _flow_group(self, jobs: list[RenderJob], cached: bool, bucket_tokens: int) -> torch.Tensor:
        """One padded batch through the encoder and the Euler loop -> mel [B, 2 * bucket_tokens, 80]."""
        batch, device = len(jobs), self.device
        width = bucket_tokens + LOOKAHEAD_TOKENS
        tokens = np.zeros((batch, width), dtype=np.int64)
        lengths = np.zeros(batch, dtype=np.int64)
        rendered = np.zeros(batch, dtype=np.int64)
        first_frame = np.zeros(batch, dtype=np.int64)
        for row, job in enumerate(jobs):
            window = job.window_tokens
            if not cached:
                window = job.stream.voice.prompt_tokens[0].tolist() + window
            tokens[row, :len(window)] = window
            lengths[row] = len(window)
            rendered[row] = job.stop - job.window_first + (0 if cached else job.stream.voice.prompt_token_count)
            first_frame[row] = job.window_first * MEL_FRAMES_PER_TOKEN
        frames = bucket_tokens * MEL_FRAMES_PER_TOKEN
        voices = [job.stream.voice for job in jobs]
        prompts = [job.stream.prompt for job in jobs]
        prefix = EncoderPrefix.cat([p.encoder for p in prompts if p is not None]) if cached else \
            self.encoder.empty_prefix(batch, device, self.dtype)
        mu = self._encode_fn(prefix.mu, prefix.embedded_tail, prefix.hidden_tail, prefix.layer_kv, prefix.key_mask,
                             torch.from_numpy(tokens).to(device), torch.from_numpy(lengths).to(device))
        mu = mu[:, :frames]  # [B, frames, 80]: the lookahead tokens' frames are not rendered (finalize=False)
        checkpoint()
        frame_mask = (torch.arange(frames, device=device)[None, :]
                      < torch.from_numpy(rendered * MEL_FRAMES_PER_TOKEN).to(device)[:, None])
        frame_mask = frame_mask[:, :, None].to(self.dtype)  # [B, frames, 1]
        seeds = torch.tensor([job.stream.seed for job in jobs], dtype=torch.int64, device=device)
        keys = counter_noise.stream_keys(seeds, counter_noise.FLOW_NOISE)
        x = counter_noise.normal_run(keys, torch.from_numpy(first_frame * MEL_BINS).to(device), frames * MEL_BINS,
                                     self.dtype).view(batch, frames, MEL_BINS)  # [B, frames, 80]
        speaker = torch.cat([voice.speaker for voice in voices])  # [B, 80]
        cond = torch.zeros_like(x)
        if not cached:  # [prompt | window]: the prompt region's own noise and mels, as flow.inference has them
            prompt_frames = voices[0].prompt_frames
            if any(voice.prompt_frames != prompt_frames for voice in voices):
                raise RuntimeError("uncached renders of one batch need equal prompt lengths")
            prompt_noise = torch.cat([voice.prompt_noise for voice in voices]).transpose(1, 2)  # [B, P, 80]
            prompt_mels = torch.cat([voice.prompt_mels for voice in voices]).transpose(1, 2)
            x = torch.cat([prompt_noise, x[:, :frames - prompt_frames]], dim=1)
            cond = torch.cat([prompt_mels, cond[:, :frames - prompt_frames]], dim=1)
        x = x * frame_mask
        return self._solve(x, frame_mask, mu, speaker, cond, prompts if cached else None)

    def _batch_bucket(self, group: list[_T]) -> list[_T]:
        """Compiled or graphed: the group padded to a power of two with copies of its last row (read, never
        advanced), so a CUDA graph serves every batch size up to it. Eager: as it is."""
        if not self.compiled and self.graphs is None:
            return group
        size = 1 << (len(group) - 1).bit_length()
        return group + [group[-1]] * (size - len(group))

    def _solve(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, speaker: torch.Tensor,
               cond: torch.Tensor, prompts: list[PromptCache | None] | None) -> torch.Tensor:
        """Euler integration of the flow from noise x [B, T, 80] (mask [B, T, 1], mu, cond [B, T, 80], speaker
        [B, 80]), with the rows' cached prompts or none. English: rows (cond, uncond) per stream, interleaved."""
        rows = self.cfg_rows
        mask_r, mu_r, spks_r, cond_r = (_repeat_rows(mask, rows), _cfg_rows(mu, rows), _cfg_rows(speaker, rows),
                                        _cfg_rows(cond, rows))
        for step, time_emb in enumerate(self._time_embeddings):
            x_r = _repeat_rows(x, rows)
            if prompts is None:
                velocity = self.estimator(x_r, mask_r, mu_r, time_emb, spks_r, cond_r, None)
            else:
                prefix = StepPrefix.cat([p.steps[step] for p in prompts if p is not None])
                velocity = self._estimate_fn(x_r, mask_r, mu_r, time_emb, spks_r, cond_r, prefix.keys, prefix.values,
                                             prefix.conv_tails, prefix.key_mask)
            x = self._euler_step(x, velocity, step)
            checkpoint()
        return x

    def _euler_step(self, x: torch.Tensor, velocity: torch.Tensor, step: int) -> torch.Tensor:
        """CausalConditionalCFM's update: rows (cond, uncond) combined with the CFG rate, or mean-flow's one row."""
        t, r = self._t_span[step], self._t_span[step + 1]
        if self.cfg_rows == 1:
            return x + (r - t) * velocity
        v = velocity.view(x.shape[0], 2, *x.shape[1:])
        return x + (r - t) * ((1.0 + self._cfg_rate) * v[:, 0] - self._cfg_rate * v[:, 1])

    def _render_hift(self, jobs: Sequence[RenderJob], mels: list[Pcm | None]
                     ) -> list[tuple[Pcm, Pcm] | None]:
        """HiFT on [held frames | new frames] of each job with new frames -> (wav, source) (host float32)."""
        groups: dict[int, list[int]] = {}
        for index, (job, mel) in enumerate(zip(jobs, mels, strict=False)):
            if mel is not None:
                frames = mel.shape[0] + job.stream.held_frames
                groups.setdefault(_round_up(frames, HIFT_BUCKET_FRAMES), []).append(index)
        out: list[tuple[Pcm, Pcm] | None] = [None] * len(jobs)
        for bucket, indices in sorted(groups.items()):
            group = self._batch_bucket([(jobs[i], mels[i]) for i in indices])
            wav, source = self._hift_group(group, bucket)  # type: ignore[arg-type]
            for row, index in enumerate(indices):
                mel = mels[index]
                assert mel is not None
                samples = (mel.shape[0] + jobs[index].stream.held_frames) * SAMPLES_PER_MEL_FRAME
                out[index] = (wav[row, :samples], source[row, :samples])
        return out

    @_without_grad
    def _hift_group(self, group: list[tuple[RenderJob, Pcm]], frames: int) -> tuple[Pcm, Pcm]:
        batch, device = len(group), self.device
        samples = frames * SAMPLES_PER_MEL_FRAME
        carried_width = self.crossfade_mel_frames * SAMPLES_PER_MEL_FRAME
        mel = np.zeros((batch, frames, MEL_BINS), dtype=np.float32)
        carried = np.zeros((batch, carried_width), dtype=np.float32)
        carried_samples = np.zeros(batch, dtype=np.int64)
        first_frame = np.zeros(batch, dtype=np.int64)
        for row, (job, new_mel) in enumerate(group):
            stream = job.stream
            hift_in = new_mel if stream.held_mel is None else np.concatenate([stream.held_mel, new_mel])
            mel[row, :hift_in.shape[0]] = hift_in
            mel[row, hift_in.shape[0]:] = hift_in[-1]  # padding repeats the last frame (the bucket is the row's own)
            if stream.held_source is not None:
                carried[row, :stream.held_source.shape[0]] = stream.held_source
                carried_samples[row] = stream.held_source.shape[0]
            first_frame[row] = stream.emitted_samples // SAMPLES_PER_MEL_FRAME  # the held frames follow emitted ones
        seeds = torch.tensor([job.stream.seed for job, _ in group], dtype=torch.int64, device=device)
        first = torch.from_numpy(first_frame).to(device)
        harmonics = self.hift.harmonics
        phase_keys = counter_noise.stream_keys(seeds, counter_noise.SINE_PHASE)
        phase_counters = first[:, None] * harmonics + torch.arange(harmonics, device=device)[None, :]
        phases = (counter_noise.uniform(phase_keys[:, None], phase_counters) * (2 * np.pi) - np.pi).to(self.dtype)
        phases[:, 0] = 0.0  # SineGen: the fundamental starts at phase 0
        noise_keys = counter_noise.stream_keys(seeds, counter_noise.SINE_NOISE)
        noise = counter_noise.normal_run(noise_keys, first * SAMPLES_PER_MEL_FRAME * harmonics, samples * harmonics,
                                         self.dtype).view(batch, samples, harmonics).transpose(1, 2)
        wav, source = self._hift_fn(torch.from_numpy(mel).to(device, self.dtype), phases, noise,
                                torch.from_numpy(carried).to(device, self.dtype),
                                torch.from_numpy(carried_samples).to(device))
        return wav.float().cpu().numpy(), source.float().cpu().numpy()


@dataclass(slots=True, eq=False)
class VocoderStream:
    """One utterance's vocoder state; not thread-safe (its owner renders it)."""

    vocoder: StreamingVocoder
    voice: VocoderVoice
    seed: int
    reproducible: bool = True  # row-invariant kernels: bitwise the same PCM in any batch (CPU)
    tokens: list[int] = field(default_factory=list)  # every token added (+ appended silence once final)
    final: bool = False  # every token is in (the silence appended)
    mel_tokens: int = 0  # tokens whose mel frames have been rendered (and handed to HiFT)
    emitted_samples: int = 0
    finished: bool = False  # the last render is done
    prompt: PromptCache | None = None  # resolved before the first render of a cached voice (held: never evicted)
    # HiFT carry-over: the last mel frames of the previous HiFT call, their source excitation and waveform.
    held_mel: Pcm | None = None  # [H, 80]
    held_source: Pcm | None = None  # [H * 480]
    held_wav: Pcm | None = None  # [H * 480], rendered without right context, not yet returned

    @property
    def emitted_tokens(self) -> int:
        return self.emitted_samples // SAMPLES_PER_TOKEN

    @property
    def held_frames(self) -> int:
        return 0 if self.held_mel is None else int(self.held_mel.shape[0])

    @property
    def renderable_until(self) -> int:
        """The last token whose mel frames can be rendered now (3 lookahead tokens must follow, unless final)."""
        return len(self.tokens) if self.final else max(0, len(self.tokens) - LOOKAHEAD_TOKENS)

    @property
    def needs_prompt(self) -> bool:
        return self.prompt is None and self.vocoder.uses_prompt_cache(self.voice)

    def add(self, tokens: Sequence[int], final: bool) -> None:
        """Add speech tokens (ids < 6561); with final=True the stream's tokens are complete."""
        if self.final:
            raise RuntimeError("tokens after final")
        new = [int(t) for t in tokens]
        if any(not 0 <= t < SPEECH_VOCAB_SIZE for t in new):
            raise ValueError(f"speech token ids must be in [0, {SPEECH_VOCAB_SIZE})")
        self.tokens.extend(new)
        if final:
            self.tokens.extend([SILENCE_TOKEN] * self.vocoder.append_silence_tokens)
            self.final = True

    @property
    def ready_tokens(self) -> int:
        """Tokens of audio a render could put out now: the most `next_job(n)` accepts before the stream is final."""
        return max(0, self.renderable_until - self.emitted_tokens - self.vocoder.hold_tokens)

    def next_job(self, chunk_tokens: int | None = None) -> RenderJob | None:
        """The next render: `chunk_tokens` more tokens of audio out (None: as many as are renderable), capped at
        max_chunk_tokens; None when not enough tokens are in yet (or the stream is finished)."""
        if self.finished:
            return None
        vocoder = self.vocoder
        limit = self.renderable_until
        if chunk_tokens is None:
            stop = limit
        else:
            stop = self.emitted_tokens + vocoder.hold_tokens + chunk_tokens  # this much audio out after the render
            if stop > limit:
                if not self.final:
                    return None
                stop = limit
        stop = min(stop, self.mel_tokens + vocoder.max_chunk_tokens)
        final = self.final and stop == len(self.tokens)
        if stop <= self.mel_tokens and not final:
            return None
        if self.needs_prompt:
            raise RuntimeError("the stream's prompt cache is not resolved")
        first = max(0, self.mel_tokens - vocoder.left_context_tokens)
        return RenderJob(stream=self, window_first=first, stop=stop, final=final)

    def push(self, tokens: Sequence[int], final: bool) -> tuple[Pcm, int]:
        """Add tokens and render everything renderable, alone. Returns (pcm float32 [960 n], n)."""
        self.add(tokens, final)
        if self.needs_prompt:
            self.prompt = self.vocoder.prompt_cache(self.voice)
        pieces = []
        while (job := self.next_job()) is not None:
            pieces.append(self.vocoder.render([job])[0])
        pcm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        return pcm, pcm.size // SAMPLES_PER_TOKEN

    def oneshot(self) -> Pcm:
        """All tokens added so far rendered in one window and one HiFT call, with this stream's noise."""
        twin = VocoderStream(vocoder=self.vocoder, voice=self.voice, seed=self.seed, reproducible=self.reproducible,
                             tokens=list(self.tokens),
                             final=True, prompt=self.prompt or self.vocoder.prompt_cache(self.voice))
        if not twin.tokens:
            return np.zeros(0, dtype=np.float32)
        job = RenderJob(stream=twin, window_first=0, stop=len(twin.tokens), final=True)
        return self.vocoder.render([job])[0]

    def _emit(self, job: RenderJob, mel: Pcm | None, hift: tuple[Pcm, Pcm] | None
              ) -> Pcm:
        """Apply a render's result: crossfade, hold back the tail (unless final), the start fade; advance."""
        vocoder = self.vocoder
        self.mel_tokens = job.stop
        if hift is None:  # nothing new rendered
            wav = self.held_wav if job.final and self.held_wav is not None else np.zeros(0, dtype=np.float32)
        else:
            assert mel is not None
            wav, source = hift
            hift_in = mel if self.held_mel is None else np.concatenate([self.held_mel, mel])
            if self.held_wav is not None:
                overlap = self.held_wav.shape[0]
                fade_in = vocoder._fade_in if overlap == vocoder._fade_in.shape[0] else _raised_cosine(overlap)
                wav = np.concatenate([self.held_wav * (1.0 - fade_in) + wav[:overlap] * fade_in, wav[overlap:]])
            if not job.final:
                hold_frames = min(vocoder.crossfade_mel_frames, hift_in.shape[0])
                hold_samples = hold_frames * SAMPLES_PER_MEL_FRAME
                self.held_mel = hift_in[hift_in.shape[0] - hold_frames:].copy()
                self.held_source = source[source.shape[0] - hold_samples:].copy()
                self.held_wav = wav[wav.shape[0] - hold_samples:].copy()
                wav = wav[:wav.shape[0] - hold_samples]
        if job.final:
            self.held_mel = self.held_source = self.held_wav = None
            self.finished = True
        wav = _apply_trim_fade(np.asarray(wav, dtype=np.float32), vocoder._trim_fade, self.emitted_samples)
        self.emitted_samples += wav.shape[0]
        if wav.size % SAMPLES_PER_TOKEN:
            raise RuntimeError(f"render returned {wav.size} samples, not whole tokens")
        return wav


# --- helpers ----------------------------------------------------------------------------------------------


def _repeat_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row repeated `rows` times, interleaved ([a, a, b, b] for 2)."""
    return x if rows == 1 else x.repeat_interleave(rows, dim=0)


def _cfg_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """CFG conditioning rows: (x, zeros) per row, interleaved; x itself without CFG."""
    if rows == 1:
        return x
    return torch.stack([x, torch.zeros_like(x)], dim=1).flatten(0, 1)


def _time_span(n_steps: int, meanflow: bool, scheduler: str, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """The Euler time grid of CausalConditionalCFM.forward: cosine-warped unless mean-flow."""
    t_span = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)  # [n + 1]
    if not meanflow and scheduler == "cosine":
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
    return t_span


def _raised_cosine(n: int) -> Pcm:
    """Fade-in weights [n] rising from ~0 to ~1; (1 - w) is the matching fade-out (they sum to 1)."""
    weights: Pcm = ((1.0 - np.cos(np.pi * (np.arange(n) + 0.5) / max(n, 1))) / 2.0).astype(np.float32)
    return weights


def _apply_trim_fade(wav: Pcm, trim_fade: Pcm, first_sample: int) -> Pcm:
    """S3Gen's start-of-utterance fade, applied to the utterance's first samples only."""
    fade_samples = trim_fade.shape[0] - first_sample
    if fade_samples <= 0 or wav.shape[0] == 0:
        return wav
    n = min(fade_samples, wav.shape[0])
    out = wav.copy()
    out[:n] *= trim_fade[first_sample:first_sample + n]
    return out
