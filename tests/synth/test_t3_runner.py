"""The slot cache + cached conditioning prefix agree with a plain full-sequence forward of the same T3."""

from __future__ import annotations

import pytest
import torch

from synth.api import Variant
from synth.t3_runner import DecodeBatch, T3Runner

from tests.synth.conftest import synthetic_voice, tiny_bundle

# fp32, tiny model: the prefix-cache path changes the shapes of the matmuls (P then S positions instead of
# P+S at once) and adds masking, which moves logits by rounding only (~1e-6 observed). 1e-4 absolute on
# logits of magnitude ~1 is far below anything that could matter and far above rounding noise.
PREFIX_TOLERANCE = 1e-4


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_prefix_cache_matches_full_prefill(variant: Variant) -> None:
    bundle = tiny_bundle(variant)
    t3 = bundle.t3
    voice = synthetic_voice(bundle, "v", seed=11)
    runner = T3Runner(t3, max_rows=4, max_len=600, device=torch.device("cpu"), dtype=torch.float32)
    text_ids = [255, 12, 13, 14, 15, 16, 0] if variant == "english" else [12, 13, 14, 15, 16]
    cond_emb = runner.cond_embeds(voice.t3_cond(0.5, runner.device))
    text = runner.text_embeds(text_ids, with_uncond_row=False)
    tail = torch.cat([text, runner.bos_embeds(1)], dim=1)  # [1, S, dim]
    # full forward with HF's own module over [cond | text | bos]
    full = torch.cat([cond_emb, tail], dim=1)
    with torch.inference_mode():
        hidden = t3.tfmr(inputs_embeds=full).last_hidden_state
        expected = t3.speech_head(hidden[:, -1])
    prefix = runner.compute_prefix(cond_emb)
    got = runner.prefill([2], prefix, tail)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < PREFIX_TOLERANCE
    # and one decode step on top (row 2 only; rows 0-1 idle, written at the scratch position)
    pos = prefix.length + tail.shape[1]
    batch = DecodeBatch(n_rows=3, token_ids=torch.tensor([6561, 6561, 100]), speech_pos=torch.tensor([0, 0, 1]),
                        write_pos=torch.tensor([599, 599, pos]), attend_len=torch.tensor([1, 1, pos + 1]),
                        span_len=pos + 1)
    step_logits = runner.decode(batch)[2:3]
    nxt = runner.speech_embeds(torch.tensor([100]), torch.tensor([1]))
    with torch.inference_mode():
        hidden = t3.tfmr(inputs_embeds=torch.cat([full, nxt], dim=1)).last_hidden_state
        expected_step = t3.speech_head(hidden[:, -1])
    assert (step_logits - expected_step).abs().max().item() < PREFIX_TOLERANCE


def test_cache_is_allocated_once_and_sized_by_config() -> None:
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=6, max_len=128, device=torch.device("cpu"), dtype=torch.float32)
    cache = runner.cache
    assert len(cache.keys) == runner.n_layers
    assert cache.keys[0].shape == (6, runner.n_heads, 128, runner.head_dim)
    assert cache.usable_len == 127 and cache.scratch_pos == 127
