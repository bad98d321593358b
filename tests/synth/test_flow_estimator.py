"""synth/flow_estimator.py against the library's ConditionalDecoder (tiny random S3Gens, English and Turbo)."""

from __future__ import annotations

import pytest
import torch
from chatterbox.models.s3gen.decoder import ConditionalDecoder

from synth import invariant_ops as ops
from synth.flow_estimator import PrefixCachedEstimator, StepPrefix
from synth.tiny_s3gen import build_s3gen


@pytest.fixture(scope="module", params=["english", "turbo"])
def estimator(request: pytest.FixtureRequest) -> ConditionalDecoder:
    torch.manual_seed(0)
    return build_s3gen("tiny", meanflow=request.param == "turbo").flow.decoder.estimator


def inputs(rows: int, frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 80, frames, generator=g), torch.randn(rows, 80, frames, generator=g),
            torch.randn(rows, 80, frames, generator=g), torch.randn(rows, 80, generator=g))


@pytest.mark.parametrize("invariant", [True, False])
def test_is_the_library_estimator(estimator: ConditionalDecoder, invariant: bool) -> None:
    mine = PrefixCachedEstimator(estimator, ops.Kernels(invariant))
    x, mu, cond, spks = inputs(2, 37, seed=1)
    t, r = torch.tensor([0.3]), torch.tensor([0.7])
    with torch.inference_mode():
        reference = estimator(x, mask=torch.ones(2, 1, 37), mu=mu, t=t.expand(2), spks=spks, cond=cond,
                              r=r.expand(2) if mine.meanflow else None)
        ours = mine(x.transpose(1, 2), torch.ones(2, 37, 1), mu.transpose(1, 2),
                    mine.time_embedding(t, r if mine.meanflow else None), spks, cond.transpose(1, 2), None)
    torch.testing.assert_close(ours.transpose(1, 2), reference, rtol=1e-5, atol=1e-5)


def test_window_after_a_recorded_prompt_is_the_library_under_a_prompt_chunk_mask(estimator: ConditionalDecoder) -> None:
    """record(prompt) then the window after it equals the library on [prompt | window] with static_chunk_size =
    prompt frames (its chunk mask: prompt frames see the prompt only, the window sees everything)."""
    mine = PrefixCachedEstimator(estimator, ops.Kernels(True))
    prompt_frames, window_frames = 40, 24
    x, mu, cond, spks = inputs(1, prompt_frames + window_frames, seed=2)
    t, r = torch.tensor([0.5]), torch.tensor([0.75])
    time_emb = mine.time_embedding(t, r if mine.meanflow else None)
    def cl(a: torch.Tensor) -> torch.Tensor:
        return a.transpose(1, 2)
    with torch.inference_mode():
        _, prefix = mine.record(cl(x[:, :, :prompt_frames]), cl(mu[:, :, :prompt_frames]), time_emb, spks,
                                cl(cond[:, :, :prompt_frames]))
        window = mine(cl(x[:, :, prompt_frames:]), torch.ones(1, window_frames, 1), cl(mu[:, :, prompt_frames:]),
                      time_emb, spks, cl(cond[:, :, prompt_frames:]), prefix)
        estimator.static_chunk_size = prompt_frames
        try:
            reference = estimator(x, mask=torch.ones(1, 1, prompt_frames + window_frames), mu=mu, t=t, spks=spks,
                                  cond=cond, r=r if mine.meanflow else None)
        finally:
            estimator.static_chunk_size = 0
    torch.testing.assert_close(cl(window), reference[:, :, prompt_frames:], rtol=1e-5, atol=1e-5)


def test_padded_rows_and_left_padded_prefixes_change_nothing(estimator: ConditionalDecoder) -> None:
    """A row padded to a longer window (masked, with junk in the padding) and a prefix left-padded to more
    frames (masked) give the row's own result (to float rounding: attention over more keys sums in another
    order; a stream's padded length is its own, so in the vocoder this never depends on its batch)."""
    mine = PrefixCachedEstimator(estimator, ops.Kernels(True))
    def cl(a: torch.Tensor) -> torch.Tensor:
        return a.transpose(1, 2)
    t = torch.tensor([0.4])
    time_emb = mine.time_embedding(t, t if mine.meanflow else None)
    x, mu, cond, spks = inputs(1, 30 + 17, seed=3)
    with torch.inference_mode():
        _, prefix = mine.record(cl(x[:, :, :30]), cl(mu[:, :, :30]), time_emb, spks, cl(cond[:, :, :30]))
        own = mine(cl(x[:, :, 30:]), torch.ones(1, 17, 1), cl(mu[:, :, 30:]), time_emb, spks, cl(cond[:, :, 30:]),
                   prefix)
        pad = 7
        mask = torch.nn.functional.pad(torch.ones(1, 17, 1), (0, 0, 0, pad))
        padded = mine(torch.nn.functional.pad(cl(x[:, :, 30:]), (0, 0, 0, pad)), mask,
                      torch.nn.functional.pad(cl(mu[:, :, 30:]), (0, 0, 0, pad), value=3.0), time_emb, spks,
                      torch.nn.functional.pad(cl(cond[:, :, 30:]), (0, 0, 0, pad), value=-2.0),
                      prefix.left_padded(36))
    torch.testing.assert_close(padded[:, :17], own, rtol=1e-5, atol=1e-5)
    assert isinstance(StepPrefix.cat([prefix, prefix]).keys[0], torch.Tensor)
