"""Batched sampling that gives every row exactly the token the reference would give it alone.

The reference (`T3.inference`, `T3.inference_turbo`) applies HF logits processors to a batch of one and
calls `torch.multinomial`. Here each row carries its own parameters as [N, 1] tensors and its own
noise, drawn by the caller from the row's own generator. Two facts make the batch invariant:
- every processor is elementwise or row-wise, so computing it for N rows at once gives each row the
  same floats as computing it alone (the arithmetic below mirrors the processors operation by operation;
  on CUDA, dividing by a Python float is done as a multiply by its float32 reciprocal, so we do the same);
- `torch.multinomial(p, 1)` is `argmax(p / q)` with `q = empty_like(p).exponential_(generator)`, so
  drawing q for each row from that row's own generator reproduces the row's token whatever the batch.
No host sync and no shape that depends on a value happens here (a CUDA graph captures it): the caller moves
the sampled ids to the host once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class RowParams:
    """Per-row sampling parameters for one step, N rows, on the logits' device."""

    temperature: torch.Tensor  # [N, 1] float32
    top_p: torch.Tensor  # [N, 1]
    min_p: torch.Tensor  # [N, 1]
    top_k: torch.Tensor  # [N, 1] (integral values, float32 or long); 0 = off
    repetition_penalty: torch.Tensor  # [N, 1]
    cfg_weight: torch.Tensor  # [N, 1]


def _div_like_reference(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """`x / python_float` as torch computes it: true division on CPU, times float32 reciprocal on CUDA."""
    if x.is_cuda:
        return x * (1.0 / divisor)
    return x / divisor


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor on the ids marked in `seen` ([N, V] bool)."""
    penalised = torch.where(scores < 0, scores * penalty, _div_like_reference(scores, penalty))
    return torch.where(seen, penalised, scores)


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF MinPLogitsWarper (min_tokens_to_keep=1)."""
    probs = torch.softmax(scores, dim=-1)
    top_probs = probs.amax(dim=-1, keepdim=True)
    to_remove = probs < (min_p * top_probs)
    keep = torch.topk(probs, 1, dim=-1).indices
    to_remove.scatter_(-1, keep, False)
    return scores.masked_fill(to_remove, NEG_INF)


def apply_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF TopPLogitsWarper (min_tokens_to_keep=1)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= (1 - top_p)
    sorted_remove[..., -1:].fill_(False)  # not `= False`: on CUDA that is a tensor from a host scalar, copied in
    to_remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(to_remove, NEG_INF)


def apply_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """HF TopKLogitsWarper with a per-row k (k-th largest value per row is the threshold). The whole row is
    sorted, whatever k: a k_max read from the device would be a host sync."""
    vocab = scores.shape[-1]
    k = top_k.clamp(min=1, max=vocab).long()
    ranked = torch.sort(scores, dim=-1, descending=True).values  # [N, V]
    threshold = ranked.gather(1, k - 1)  # [N, 1]
    return scores.masked_fill(scores < threshold, NEG_INF)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`torch.multinomial(probs[i:i+1], 1, generator=g_i)` for every row, given noise[i] = the Exp(1) draw
    of a [1, V] tensor from g_i (what multinomial draws): [N] long."""
    return (probs / noise).argmax(dim=-1)


def sample_llama(cond: torch.Tensor, uncond: torch.Tensor, seen: torch.Tensor, params: RowParams,
                 noise: torch.Tensor,
                 edit_guided: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """English / Multilingual order: CFG -> [alignment analyzer] -> repetition penalty -> temperature ->
    min_p -> top_p -> sample.

    cond, uncond: [N, V] logits (a row without CFG passes its cond logits as uncond, which makes the
    guidance term exactly zero); seen: [N, V] ids generated so far, BOS included. `edit_guided` may
    rewrite rows of the guided logits (the multilingual alignment analyzer's place in the reference).
    """
    logits = cond + params.cfg_weight * (cond - uncond)
    if edit_guided is not None:
        logits = edit_guided(logits)
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = _div_like_reference(logits, params.temperature)
    logits = apply_min_p(logits, params.min_p)
    logits = apply_top_p(logits, params.top_p)
    return sample_from_probs(torch.softmax(logits, dim=-1), noise)


def sample_gpt2(logits: torch.Tensor, seen: torch.Tensor, params: RowParams, noise: torch.Tensor) -> torch.Tensor:
    """Turbo order: temperature -> top_k -> top_p -> repetition penalty -> sample (each only when active,
    as `inference_turbo` builds its processor list)."""
    scaled = _div_like_reference(logits, params.temperature)
    logits = torch.where(params.temperature != 1.0, scaled, logits)
    logits = torch.where(params.top_k > 0, apply_top_k(logits, params.top_k), logits)
    logits = torch.where(params.top_p < 1.0, apply_top_p(logits, params.top_p), logits)
    penalised = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = torch.where(params.repetition_penalty != 1.0, penalised, logits)
    return sample_from_probs(torch.softmax(logits, dim=-1), noise)
