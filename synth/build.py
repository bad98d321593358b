"""What an engine builds from its config, and the checks on it: the T3 runner, the streaming vocoder, the slot count.
Torch lives here and in what it builds, so that synth/engine.py imports none."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from synth import gpu, invariant_ops, linear_bf16w
from synth.api import MAX_SEGMENT_TEXT_TOKENS, EngineConfig
from synth.loading import ModelBundle
from synth.t3_runner import PREFIX_CACHE_ENTRIES, T3Runner, projections

log = logging.getLogger(__name__)

CPU_AUTO_SLOTS = 16  # max_slots "auto" on a CPU with no memory budget: the CPU's speed, not its memory, limits
S3GEN_SILENCE_TOKENS_TURBO = 3
VOCODER_MAX_BATCH = {"cpu": 4, "cuda": 64}  # streams per render tick: short ticks on a CPU (latency), wide on a GPU


@dataclass(frozen=True, slots=True)
class EngineParts:
    bundle: ModelBundle
    config: EngineConfig
    dtype: torch.dtype
    bf16_weights: bool  # T3's projections rounded to bf16 (CPU)
    vocoder_gemm_dtype: torch.dtype
    decode_graphs: bool  # capture the decode step's graphs at start-up
    vocoder_graphs: bool  # replay the vocoder's renders as graphs
    vocoder_tf32: bool

    @staticmethod
    def resolve(bundle: ModelBundle, config: EngineConfig, *, render_audio: bool) -> EngineParts:
        """Check `config` against the device; ValueError names what is wrong. Rounds T3's weights in place for
        cpu_weights="bf16" and sets torch's TF32 switches for the vocoder (both process-wide, once)."""
        device = bundle.device
        if config.dtype not in gpu.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(gpu.DTYPES)}, not {config.dtype!r}")
        dtype = gpu.DTYPES[config.dtype]
        if config.max_slots < 0 or config.memory_budget_gb < 0:
            raise ValueError("max_slots (0: auto) and memory_budget_gb (0: the device's free memory) must be >= 0")
        cuda = device.type == "cuda"
        return EngineParts(
            bundle=bundle, config=config, dtype=dtype,
            bf16_weights=_round_weights_for(config, bundle, dtype),
            vocoder_gemm_dtype=_vocoder_gemm_dtype_for(config, device),
            decode_graphs=config.cuda_graphs != "off" and cuda,
            vocoder_graphs=render_audio and config.vocoder_graphs != "off" and cuda,
            vocoder_tf32=render_audio and gpu.use_vocoder_tf32(config.vocoder_tf32, device, dtype))

    def build_runner(self, t3: Any, **kwargs: Any) -> T3Runner:
        return T3Runner(t3, **kwargs)

    def build_vocoder(self) -> Any:
        """The streaming vocoder (synth.vocoder.StreamingVocoder), with its graphs when they are wanted (each
        (batch, bucket) captured when first met; the first chunks' at start-up: Engine._warmup)."""
        from synth.vocoder import StreamingVocoder

        config = self.config
        turbo = self.bundle.variant == "turbo"
        schedule = config.chunk_schedule_tokens
        vocoder = StreamingVocoder(self.bundle.s3gen, n_cfm_timesteps=2 if turbo else 10, meanflow=turbo,
                                   append_silence_tokens=S3GEN_SILENCE_TOKENS_TURBO if turbo else 0,
                                   max_chunk_tokens=max((config.first_chunk_tokens, *schedule)),
                                   gemm_dtype=self.vocoder_gemm_dtype)
        if self.vocoder_graphs:
            vocoder.use_graphs(capture=True)
        return vocoder

    def vocoder_max_batch(self) -> int:
        device = self.bundle.device.type
        return self.config.vocoder_max_batch or VOCODER_MAX_BATCH.get(device, VOCODER_MAX_BATCH["cpu"])

    def plan_slots(self, max_len: int, rows_per_slot: int, prefix_positions: int, vocoder: Any) -> gpu.SlotPlan | None:
        """The slot count against the memory budget (the device's free memory now, the models loaded, or
        `memory_budget_gb`), or None where nothing is checked (a CPU with no budget and an explicit count)."""
        config, device = self.config, self.bundle.device
        free, total = gpu.device_memory(device)
        budget = int(config.memory_budget_gb * gpu.GB) or free
        if not budget:  # a CPU with no budget: the KV cache lives in RAM, and the CPU's speed is the limit
            if config.max_slots == 0:
                return gpu.SlotPlan(CPU_AUTO_SLOTS, rows_per_slot * T3Runner.kv_bytes_per_row(
                    self.bundle.t3, max_len, self.dtype), 0, auto=True)
            return None
        per_row = T3Runner.kv_bytes_per_row(self.bundle.t3, max_len, self.dtype)
        # the prefix pool: each entry a voice's conditioning and, for CFG, the unconditional text block after it
        entry_positions = prefix_positions + (MAX_SEGMENT_TEXT_TOKENS + 2 if rows_per_slot == 2 else 0)
        reserved = {"prefix pool": PREFIX_CACHE_ENTRIES * per_row * min(entry_positions, max_len) // max_len}
        if vocoder is not None and vocoder.graphs is not None:
            # static prompt inputs for every power-of-two batch up to the largest: 2 max - 1 streams' worth
            streams = 2 * self.vocoder_max_batch() - 1
            reserved["vocoder graphs"] = streams * vocoder.prompt_cache_bytes_estimate()
        return gpu.plan_slots(config.max_slots, budget_bytes=budget, total_bytes=total or budget,
                              per_slot_bytes=rows_per_slot * per_row, reserved=reserved)


def _round_weights_for(config: EngineConfig, bundle: ModelBundle, dtype: torch.dtype) -> bool:
    """cpu_weights="bf16": round T3's projection weights to bf16 in place (once; the bundle's model then holds the
    values the engine computes with, so chatterbox's own inference on it stays the reference)."""
    if config.cpu_weights == "fp32":
        return False
    if config.cpu_weights != "bf16":
        raise ValueError(f"cpu_weights must be 'fp32' or 'bf16', not {config.cpu_weights!r}")
    if bundle.device.type != "cpu" or dtype != torch.float32:
        raise ValueError("cpu_weights='bf16' is for the CPU with dtype float32 (on a GPU use dtype bfloat16)")
    try:
        linear_bf16w.available(raise_error=True)
    except linear_bf16w.KernelUnavailable as exc:
        raise ValueError(str(exc)) from exc
    changed = linear_bf16w.round_to_bf16_(projections(bundle.t3))
    if changed:
        log.warning("cpu_weights=bf16: rounded %d T3 projection weights to bfloat16 (fp32 math on the rounded "
                    "values; the model is no longer bit-identical to the checkpoint)", changed)
    return True


def _vocoder_gemm_dtype_for(config: EngineConfig, device: torch.device) -> torch.dtype:
    """cpu_vocoder="bf16": S3Gen's products in bfloat16 (CPU only, where the CPU runs them natively)."""
    if config.cpu_vocoder == "fp32":
        return torch.float32
    if config.cpu_vocoder != "bf16":
        raise ValueError(f"cpu_vocoder must be 'fp32' or 'bf16', not {config.cpu_vocoder!r}")
    if device.type != "cpu":
        raise ValueError("cpu_vocoder='bf16' is for the CPU")
    if not invariant_ops.bf16_gemms_supported():
        raise ValueError("cpu_vocoder='bf16' needs a CPU with AVX512-BF16 or AMX (bf16 products elsewhere are "
                         "slower than fp32); use cpu_vocoder='fp32'")
    return torch.bfloat16
