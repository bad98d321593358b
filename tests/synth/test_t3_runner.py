"""The runner's shared prefixes, packed prefill and slot cache agree with a plain full-sequence forward of
the same T3 (HF's own module over the whole row, as the reference builds it)."""

from __future__ import annotations

import pytest
import torch

from synth.api import Variant
from synth.kv_cache import PrefixKV
from synth.t3_runner import DecodeBatch, PrefillItem, PrefixGroup, T3Runner

from tests.synth.conftest import synthetic_voice, tiny_bundle

# fp32, tiny model: the runner changes the shapes of the matmuls (prefix once, then packed new positions,
# attention in two key blocks under one softmax) and adds masking, which moves logits by rounding only
# (~1e-6 observed). 1e-4 absolute on logits of magnitude ~1 is far below anything that could matter and
# far above rounding noise; a wrong position, mask or key block moves them by ~1e-1.
PREFIX_TOLERANCE = 1e-4
TEXTS = {"english": ([255, 12, 13, 14, 15, 16, 0], [255, 40, 41, 0]), "turbo": ([12, 13, 14, 15, 16], [40, 41, 42])}


def _full(t3, *parts: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Last-position logits of HF's own forward over the concatenated [1, *, dim] parts."""
    with torch.inference_mode():
        hidden = t3.tfmr(inputs_embeds=torch.cat(parts, dim=1)).last_hidden_state
        return t3.speech_head(hidden[:, -1])


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < PREFIX_TOLERANCE


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_shared_prefix_packed_prefill_and_decode_match_full_forwards(variant: Variant) -> None:
    bundle = tiny_bundle(variant)
    t3 = bundle.t3
    runner = T3Runner(t3, max_rows=4, max_len=600, device=torch.device("cpu"), dtype=torch.float32)
    voices = [synthetic_voice(bundle, name, seed=seed) for name, seed in (("a", 11), ("b", 12))]
    conds = [runner.cond_embeds(v.t3_cond(0.5, runner.device)) for v in voices]  # [1, P, dim] each
    prefixes = [runner.compute_prefix(c) for c in conds]
    tails = [torch.cat([runner.text_embeds(ids), runner.bos_embeds()])[None] for ids in TEXTS[variant]]
    # two segments with different voices, prefilled in ONE packed pass into rows 2 and 0
    got = runner.prefill([PrefillItem(2, prefixes[0], prefixes[0].cond_len, tails[0][0]),
                          PrefillItem(0, prefixes[1], prefixes[1].cond_len, tails[1][0])])
    _close(got[0:1], _full(t3, conds[0], tails[0]))
    _close(got[1:2], _full(t3, conds[1], tails[1]))
    # one decode step over rows 0..2 (row 1 idle: scratch position, no group)
    lens = [p.cond_len + t.shape[1] for p, t in zip(prefixes, tails)]  # whole-sequence lengths so far
    slot = [tails[0].shape[1], tails[1].shape[1]]
    batch = DecodeBatch(
        n_rows=3, token_ids=torch.tensor([101, 6561, 100]), speech_pos=torch.tensor([1, 0, 1]),
        rope_pos=torch.tensor([lens[1], 0, lens[0]]), write_pos=torch.tensor([slot[1], 599, slot[0]]),
        attend_len=torch.tensor([slot[1] + 1, 1, slot[0] + 1]), span_len=max(slot) + 1,
        groups=(PrefixGroup(prefixes[0], torch.tensor([2]), torch.tensor([prefixes[0].cond_len]), prefixes[0].cond_len),
                PrefixGroup(prefixes[1], torch.tensor([0]), torch.tensor([prefixes[1].cond_len]), prefixes[1].cond_len)))
    step = runner.decode(batch)
    for row, i, token in ((2, 0, 100), (0, 1, 101)):
        nxt = runner.speech_embeds(torch.tensor([token]), torch.tensor([1]))
        _close(step[row:row + 1], _full(t3, conds[i], tails[i], nxt))


def test_uncond_row_reads_the_shared_text_block() -> None:
    """CFG: the uncond row's text block (zeroed tokens, kept positions) lives in the voice prefix, grown on
    demand; the row itself only runs the BOS block. Same logits as the reference's full uncond row."""
    bundle = tiny_bundle("english")
    t3 = bundle.t3
    runner = T3Runner(t3, max_rows=4, max_len=600, device=torch.device("cpu"), dtype=torch.float32)
    cond = runner.cond_embeds(synthetic_voice(bundle, "a", seed=11).t3_cond(0.5, runner.device))
    prefix = runner.compute_prefix(cond)
    bos = runner.bos_embeds()
    for text_ids, row in (([255, 12, 13, 0], 1), ([255, 12, 13, 14, 15, 16, 17, 0], 3), ([255, 9, 0], 2)):
        n = len(text_ids)
        runner.extend_uncond_text(prefix, n)
        assert prefix.length == prefix.cond_len + max(n, 8 if row != 1 else n)
        got = runner.prefill([PrefillItem(row, prefix, prefix.cond_len + n, bos)])
        with torch.inference_mode():
            uncond_text = torch.zeros(1, n, cond.shape[-1]) + t3.text_pos_emb(torch.tensor([text_ids]))
        _close(got, _full(t3, cond, uncond_text, bos[None]))


def test_prefix_extension_never_writes_the_old_tensors() -> None:
    """Running segments hold the prefix object; growing it replaces tensors, it does not mutate them."""
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=2, max_len=128, device=torch.device("cpu"), dtype=torch.float32)
    prefix: PrefixKV = runner.compute_prefix(
        runner.cond_embeds(synthetic_voice(bundle, "a", seed=1).t3_cond(0.5, runner.device)))
    before = [k.clone() for k in prefix.keys]
    old = list(prefix.keys)
    runner.extend_uncond_text(prefix, 10)
    assert all(torch.equal(a, b) for a, b in zip(old, before))
    assert all(torch.equal(k[:, :prefix.cond_len], b) for k, b in zip(prefix.keys, before))


def test_cache_is_allocated_once_and_sized_by_config() -> None:
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=6, max_len=128, device=torch.device("cpu"), dtype=torch.float32)
    cache = runner.cache
    assert len(cache.keys) == runner.n_layers
    assert cache.keys[0].shape == (6, runner.n_heads, 128, runner.head_dim)
    assert cache.usable_len == 127 and cache.scratch_pos == 127
