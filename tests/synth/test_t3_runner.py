"""The runner's shared prefixes, packed prefill and slot cache agree with a plain full-sequence forward of
the same T3 (HF's own module over the whole row, as the reference builds it)."""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
from chatterbox.models.t3 import T3

from synth.api import Variant
from synth.kv_cache import PrefixKV
from synth.t3_runner import PrefillItem, T3Runner

from tests.synth.conftest import TEST_DEVICE, synthetic_voice, tiny_bundle

# fp32, tiny model: the runner changes the shapes of the matmuls (prefix once, then packed new positions,
# attention in two key blocks under one softmax) and adds masking, which moves logits by rounding only
# (~1e-6 observed). 1e-4 absolute on logits of magnitude ~1 is far below anything that could matter and
# far above rounding noise; a wrong position, mask or key block moves them by ~1e-1.
PREFIX_TOLERANCE = 1e-4
# the shared tiny bundle's device: a runner elsewhere would move the bundle's T3 away from the other tests' (in place)
DEVICE = torch.device(TEST_DEVICE)
TEXTS = {"english": ([255, 12, 13, 14, 15, 16, 0], [255, 40, 41, 0]), "turbo": ([12, 13, 14, 15, 16], [40, 41, 42])}


def _full(t3: T3, *parts: torch.Tensor) -> torch.Tensor:
    """Last-position logits of HF's own forward over the concatenated [1, *, dim] parts."""
    with torch.inference_mode():
        hidden = t3.tfmr(inputs_embeds=torch.cat(parts, dim=1)).last_hidden_state
        return cast(torch.Tensor, t3.speech_head(hidden[:, -1]))


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < PREFIX_TOLERANCE


def _set_row(runner: T3Runner, row: int, token: int, speech_pos: int, pos: int) -> None:
    """Host inputs of one running row: feed `token` at whole-row position `pos`."""
    ints = runner.inputs.ints
    ints["token"][row], ints["speech_pos"][row] = token, speech_pos
    ints["pos"][row] = ints["write"][row] = pos
    ints["keys"][row] = pos + 1


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_shared_prefix_packed_prefill_and_decode_match_full_forwards(variant: Variant) -> None:
    bundle = tiny_bundle(variant)
    t3 = bundle.t3
    runner = T3Runner(t3, max_rows=4, max_len=600, device=DEVICE, dtype=torch.float32)
    voices = [synthetic_voice(bundle, name, seed=seed) for name, seed in (("a", 11), ("b", 12))]
    conds = [runner.cond_embeds(v.t3_cond(0.5, runner.device)) for v in voices]  # [1, P, dim] each
    prefixes = [runner.compute_prefix(c) for c in conds]
    tails = [torch.cat([runner.text_embeds(ids), runner.bos_embeds()])[None] for ids in TEXTS[variant]]
    # two segments with different voices, prefilled in ONE packed pass into rows 2 and 0
    got = runner.prefill([PrefillItem(2, prefixes[0], prefixes[0].cond_len, tails[0][0]),
                          PrefillItem(0, prefixes[1], prefixes[1].cond_len, tails[1][0])])
    _close(got[0:1], _full(t3, conds[0], tails[0]))
    _close(got[1:2], _full(t3, conds[1], tails[1]))
    # one decode step over the row bucket [0, 4) (rows 1 and 3 idle: scratch position), two voices, one call
    lens = [p.cond_len + t.shape[1] for p, t in zip(prefixes, tails, strict=True)]  # whole-row lengths so far
    runner.inputs.idle_rows(4)
    _set_row(runner, 2, 100, 1, lens[0])
    _set_row(runner, 0, 101, 1, lens[1])
    runner.inputs.upload()
    n_rows, n_keys = runner.step_shape(2, max(lens) + 1)
    assert n_rows == 4 and n_keys in runner.key_buckets and n_keys > max(lens)
    step = runner.decode(n_rows, n_keys)
    for row, i, token in ((2, 0, 100), (0, 1, 101)):
        nxt = runner.speech_embeds(torch.tensor([token], device=DEVICE), torch.tensor([1], device=DEVICE))
        _close(step[row:row + 1], _full(t3, conds[i], tails[i], nxt))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a CPU guarantee (row-invariant attention and GEMMs); on CUDA a "
                    "row's bits hold within one (row bucket, key bucket) pair only: t3_runner's docstring")
@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_a_rows_logits_are_bit_identical_in_every_row_and_key_bucket(variant: Variant) -> None:
    """CPU determinism: a row's logits do not depend on the bucket its step runs in (rows [0, R), keys
    [0, L)) nor on the other rows' content: what keeps a seeded segment's tokens independent of the batch."""
    bundle = tiny_bundle(variant)
    runner = T3Runner(bundle.t3, max_rows=8, max_len=1024, device=DEVICE, dtype=torch.float32)
    voices = [synthetic_voice(bundle, n, seed=s) for n, s in (("a", 21), ("b", 22))]
    prefixes = [runner.compute_prefix(runner.cond_embeds(v.t3_cond(0.5, runner.device))) for v in voices]
    tail = torch.cat([runner.text_embeds(TEXTS[variant][0]), runner.bos_embeds()])
    length = prefixes[0].cond_len + tail.shape[0]
    results = []
    _, least = runner.step_shape(0, length + 1)  # the smallest key bucket that holds the row
    assert least < 1024
    for n_rows, n_keys, others in ((1, least, 0), (8, least, 7), (8, 1024, 3), (4, 1024, 3), (2, least, 1)):
        runner.prefill([PrefillItem(0, prefixes[0], prefixes[0].cond_len, tail)]
                       + [PrefillItem(r, prefixes[r % 2], prefixes[r % 2].cond_len, tail[: 3 + r])
                          for r in range(1, others + 1)])
        runner.inputs.idle_rows(n_rows)
        _set_row(runner, 0, 100, 1, length)
        for r in range(1, others + 1):
            _set_row(runner, r, 200 + r, 1, prefixes[r % 2].cond_len + 3 + r)
        runner.inputs.upload()
        results.append(runner.decode(n_rows, n_keys)[0].clone())
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU thread counts")
@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_a_rows_prefill_and_decode_logits_do_not_depend_on_the_thread_count(variant: Variant) -> None:
    """A seeded segment's tokens do not depend on the decode's thread count (`--threads D,V`): a server restarted
    with other counts, or a machine with more cores, says the same tokens for the same seed (what a phrase cache
    keyed on the seed relies on). The full-size models were checked the same way (BENCHMARKS.md, issue 15)."""
    bundle = tiny_bundle(variant)
    runner = T3Runner(bundle.t3, max_rows=4, max_len=512, device=DEVICE, dtype=torch.float32)
    voice = synthetic_voice(bundle, "a", seed=31)
    prefix = runner.compute_prefix(runner.cond_embeds(voice.t3_cond(0.5, runner.device)))
    tail = torch.cat([runner.text_embeds(TEXTS[variant][0] * 6), runner.bos_embeds()])
    length = prefix.cond_len + tail.shape[0]
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            prefill = runner.prefill([PrefillItem(0, prefix, prefix.cond_len, tail)]).clone()
            steps = []
            for i in range(3):
                runner.inputs.idle_rows(4)
                _set_row(runner, 0, 100 + i, 1 + i, length + i)
                runner.inputs.upload()
                steps.append(runner.decode(*runner.step_shape(0, length + i + 1))[0].clone())
            results.append((prefill, torch.stack(steps)))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_uncond_row_reads_the_shared_text_block() -> None:
    """CFG: the uncond row's text block (zeroed tokens, kept positions) lives in the voice prefix, grown on
    demand; the row itself only runs the BOS block. Same logits as the reference's full uncond row."""
    bundle = tiny_bundle("english")
    t3 = bundle.t3
    runner = T3Runner(t3, max_rows=4, max_len=600, device=DEVICE, dtype=torch.float32)
    cond = runner.cond_embeds(synthetic_voice(bundle, "a", seed=11).t3_cond(0.5, runner.device))
    prefix = runner.compute_prefix(cond)
    bos = runner.bos_embeds()
    for text_ids, row in (([255, 12, 13, 0], 1), ([255, 12, 13, 14, 15, 16, 17, 0], 3), ([255, 9, 0], 2)):
        n = len(text_ids)
        runner.extend_uncond_text(prefix, n)
        assert prefix.length == prefix.cond_len + max(n, 8 if row != 1 else n)
        got = runner.prefill([PrefillItem(row, prefix, prefix.cond_len + n, bos)])
        with torch.inference_mode():
            uncond_text = torch.zeros(1, n, cond.shape[-1], device=DEVICE) + t3.text_pos_emb(
                torch.tensor([text_ids], device=DEVICE))
        _close(got, _full(t3, cond, uncond_text, bos[None]))


def test_prefix_extension_never_writes_the_old_tensors() -> None:
    """Running segments hold the prefix object; growing it replaces tensors, it does not mutate them."""
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=2, max_len=128, device=DEVICE, dtype=torch.float32)
    prefix: PrefixKV = runner.compute_prefix(
        runner.cond_embeds(synthetic_voice(bundle, "a", seed=1).t3_cond(0.5, runner.device)))
    before = [k.clone() for k in prefix.keys]
    old = list(prefix.keys)
    runner.extend_uncond_text(prefix, 10)
    assert all(torch.equal(a, b) for a, b in zip(old, before, strict=True))
    assert all(torch.equal(k[:, :prefix.cond_len], b) for k, b in zip(prefix.keys, before, strict=True))


def test_cache_is_allocated_once_and_sized_by_config() -> None:
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=6, max_len=128, device=DEVICE, dtype=torch.float32)
    cache = runner.cache
    assert len(cache.keys) == runner.n_layers
    assert cache.keys[0].shape == (6, runner.n_heads, 128, runner.head_dim)
    assert cache.usable_len == 127 and cache.scratch_pos == 127


def test_a_released_rows_cfg_partner_stays_inside_a_smaller_row_bucket() -> None:
    """A CFG pair claimed as rows (3, 9) (rows 4-8 taken), then released: a later 4-row step has row 3 idle, and
    sampling reads each row's partner's logits within the bucket (an index past it is an error on the CPU and a
    device-side assert on CUDA)."""
    bundle = tiny_bundle("english")
    runner = T3Runner(bundle.t3, max_rows=16, max_len=128, device=DEVICE, dtype=torch.float32)
    ints = runner.inputs.ints
    ints["partner"][3], ints["partner"][9] = 9, 9  # as admission writes them: the cond row reads the uncond row's
    runner.release((3, 9))
    runner.inputs.idle_rows(4)
    runner.inputs.upload()
    runner.sample(4)  # raised IndexError before the release reset the partners
    assert ints["partner"][3] == 3 and ints["partner"][9] == 9


def test_rope_phases_stay_float32_when_the_model_computes_in_bf16() -> None:
    """Module.to(bfloat16) casts RoPE's inv_freq buffer too (0.1939 becomes 0.1943 on the tiny model), which turns
    a phase by ~0.5 rad past position 1,000; and an fp32 outer product computed as a matmul would round in TF32
    where the vocoder has turned TF32 on. The runner keeps inv_freq in float32 (taken before the cast) and
    multiplies elementwise: cos/sin equal the float32 model's, rounded once to bf16."""
    fp32_t3 = copy.deepcopy(tiny_bundle("english").t3).eval()
    pos = torch.arange(0, 2048, 97, device=DEVICE)[None]  # [1, S]
    h32 = torch.zeros(1, pos.shape[1], 8, device=DEVICE)
    cos32, sin32 = fp32_t3.to(DEVICE).tfmr.rotary_emb(h32, pos)
    runner = T3Runner(copy.deepcopy(fp32_t3), max_rows=2, max_len=256, device=DEVICE, dtype=torch.bfloat16)
    cos, sin = runner._rope(pos, torch.bfloat16)
    assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))
    bf16_cos, _ = runner.t3.tfmr.rotary_emb(h32.to(torch.bfloat16), pos)  # what the cast module computes
    assert not torch.equal(bf16_cos, cos32.to(torch.bfloat16))  # (so the test sees the difference)
