"""synth/decode_attention: the CPU decode attention that reads each voice's prefix once.

Against the torch attention it replaces (matmul, masked softmax, matmul over each row's own cache copy): equal to
float rounding; and a row's output bitwise the same alone, in any batch, with any key bucket and thread count.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from synth import decode_attention
from synth.decode_attention import RowPrefixes

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine (the runner then keeps torch's attention)")

HEADS, DIM, MAX_ROWS, MAX_LEN, LAYERS = 4, 64, 6, 96, 2
SCALE = DIM ** -0.5


def setup(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[torch.Tensor], list[torch.Tensor]]],
                                  RowPrefixes, list[int], torch.Tensor]:
    """A cache whose rows start with a copy of one of two voices' prefixes (as admission leaves them), the
    prefixes themselves, and per-row lengths."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(LAYERS, MAX_ROWS, HEADS, MAX_LEN, DIM, generator=g)
    cache_v = torch.randn(LAYERS, MAX_ROWS, HEADS, MAX_LEN, DIM, generator=g)
    voices = [([torch.randn(HEADS, n, DIM, generator=g) for _ in range(LAYERS)],
               [torch.randn(HEADS, n, DIM, generator=g) for _ in range(LAYERS)]) for n in (30, 41)]
    prefixes = RowPrefixes(MAX_ROWS, LAYERS)
    shared = [30, 41, 30, 20, 0, 41]  # row 3 shares only part of its voice's positions; row 4 none
    voice_of = [0, 1, 0, 0, 0, 1]
    for row in range(MAX_ROWS):
        keys, values = voices[voice_of[row]]
        for layer in range(LAYERS):
            cache_k[layer, row, :, :shared[row]] = keys[layer][:, :shared[row]]
            cache_v[layer, row, :, :shared[row]] = values[layer][:, :shared[row]]
        if shared[row]:
            prefixes.set(row, keys, values, shared[row])
    visible = torch.tensor([60, 77, 31, 45, 12, 1], dtype=torch.int64)
    return cache_k, cache_v, voices, prefixes, shared, visible


def torch_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                    n_keys: int) -> torch.Tensor:
    """The runner's CPU attention over each row's own copy, keys [0, n_keys) with those >= visible hidden."""
    hidden = (torch.arange(n_keys)[None, :] >= visible[:, None])[:, None, None, :]
    scores = torch.matmul(q, keys[:, :, :n_keys].transpose(-1, -2)) * SCALE
    return torch.matmul(torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1), values[:, :, :n_keys])


def test_equals_the_torch_attention_over_the_rows_own_copies() -> None:
    cache_k, cache_v, _, prefixes, _, visible = setup()
    q = torch.randn(MAX_ROWS, HEADS, 1, DIM, generator=torch.Generator().manual_seed(1))
    for layer in range(LAYERS):
        mine = decode_attention.attention(q, cache_k[layer], cache_v[layer], prefixes, layer, visible, 80, SCALE)
        torch.testing.assert_close(mine, torch_attention(q, cache_k[layer], cache_v[layer], visible, 80),
                                   rtol=1e-5, atol=1e-6)


def test_reads_the_prefix_not_the_rows_copy() -> None:
    """Positions below `shared` come from the voice's prefix: spoil the rows' copies and the result stands; spoil
    a position after `shared` and it moves."""
    cache_k, cache_v, _, prefixes, _, visible = setup()
    q = torch.randn(MAX_ROWS, HEADS, 1, DIM, generator=torch.Generator().manual_seed(2))
    before = decode_attention.attention(q, cache_k[0], cache_v[0], prefixes, 0, visible, 80, SCALE)
    cache_k[0, 0, :, :30] = 100.0
    assert torch.equal(decode_attention.attention(q, cache_k[0], cache_v[0], prefixes, 0, visible, 80, SCALE), before)
    cache_v[0, 0, :, 30] += 1.0
    after = decode_attention.attention(q, cache_k[0], cache_v[0], prefixes, 0, visible, 80, SCALE)
    assert not torch.equal(after[0], before[0]) and torch.equal(after[1:], before[1:])


def test_a_rows_bits_do_not_depend_on_its_batch_bucket_or_threads() -> None:
    cache_k, cache_v, _, prefixes, _, visible = setup()
    q = torch.randn(MAX_ROWS, HEADS, 1, DIM, generator=torch.Generator().manual_seed(3))
    full = decode_attention.attention(q, cache_k[1], cache_v[1], prefixes, 1, visible, 80, SCALE)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows, n_keys in ((1, 64), (2, 80), (4, 96), (MAX_ROWS, 96)):
                part = decode_attention.attention(q[:rows], cache_k[1], cache_v[1], prefixes, 1, visible, n_keys, SCALE)
                assert torch.equal(part, full[:rows]), (threads, rows, n_keys)
    finally:
        torch.set_num_threads(saved)


def test_any_set_of_cache_rows_gives_each_row_the_bits_it_has_in_the_full_batch() -> None:
    """A step that decodes only some rows (the runner's compact CPU step: job rows sitting out a live turn's first
    ids, or idle rows between running ones) passes their cache rows: q's row r reads cache row row_ids[r], its own
    prefix and its own length, and gets the bits it gets in the batch of every row."""
    cache_k, cache_v, _, prefixes, _, visible = setup()
    q = torch.randn(MAX_ROWS, HEADS, 1, DIM, generator=torch.Generator().manual_seed(5))
    full = decode_attention.attention(q, cache_k[1], cache_v[1], prefixes, 1, visible, 80, SCALE)
    for picked in ([3], [1, 4], [0, 2, 5], [5, 0]):
        ids = np.array(picked, dtype=np.int64)
        part = decode_attention.attention(q[ids], cache_k[1], cache_v[1], prefixes, 1, visible[ids], 80, SCALE,
                                          row_ids=ids)
        assert torch.equal(part, full[ids]), picked
    with pytest.raises(ValueError, match="outside the cache"):
        decode_attention.attention(q[:1], cache_k[1], cache_v[1], prefixes, 1, visible[:1], 80, SCALE,
                                   row_ids=np.array([MAX_ROWS], dtype=np.int64))


def test_the_lane_tree_as_vector_halves_gives_the_bits_of_the_tree_through_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dot product's last additions as vector shuffles (GCC 12+, clang) and through memory (older compilers,
    or PORTABLE_FLAG): the same lanes added in the same order, so the same output, bitwise."""
    cache_k, cache_v, _, prefixes, _, visible = setup()
    q = torch.randn(MAX_ROWS, HEADS, 1, DIM, generator=torch.Generator().manual_seed(4))
    outputs, build = [], decode_attention._library  # cached per flags
    for flags in (decode_attention.FLAGS, (*decode_attention.FLAGS, decode_attention.PORTABLE_FLAG)):
        monkeypatch.setattr(decode_attention, "_library", lambda flags=flags: build(flags))
        outputs.append(decode_attention.attention(q, cache_k[0], cache_v[0], prefixes, 0, visible, 80, SCALE))
    assert torch.equal(outputs[0], outputs[1])


def test_it_compiles_here_and_the_cpu_runner_uses_it() -> None:
    """With a compiler the kernel must build (a build error is a failure, not a skip), and an fp32 CPU runner
    takes it."""
    assert decode_attention.available()
    from tests.synth.conftest import TEST_DEVICE, make_engine

    engine = make_engine("turbo", render_audio=False, max_slots=1)
    assert engine.runner.shared_prefix_attention == (TEST_DEVICE == "cpu")
    assert engine.status()["decode_attention"] == ("shared-prefix" if TEST_DEVICE == "cpu" else "torch")


def test_refuses_a_prefix_it_cannot_read() -> None:
    prefixes = RowPrefixes(2, 1)
    keys = [torch.randn(HEADS, 10, DIM)]
    with pytest.raises(ValueError, match="more positions"):
        prefixes.set(0, keys, keys, 11)
    with pytest.raises(ValueError, match="contiguous float32"):
        prefixes.set(0, [keys[0].transpose(0, 1)], keys, 3)
    prefixes.set(1, keys, keys, 10)
    assert prefixes.holding() == [1]
    prefixes.clear(1)
    assert prefixes.shared[1] == 0 and prefixes.keys[0, 1] == 0 and prefixes.holding() == []
