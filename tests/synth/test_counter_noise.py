"""synth/counter_noise.py: a value depends on (seed, domain, counter) only; the draws look like the distribution."""

from __future__ import annotations

import torch

from synth import counter_noise as cn


def test_a_counter_has_one_value_whatever_run_draws_it() -> None:
    keys = cn.stream_keys(torch.tensor([7, 2**62 + 3]), cn.FLOW_NOISE)
    whole = cn.normal_run(keys, torch.tensor([0, 0]), 4000)
    part = cn.normal_run(keys, torch.tensor([1200, 1200]), 800)
    assert torch.equal(part, whole[:, 1200:2000])
    alone = cn.normal_run(keys[1:], torch.tensor([1200]), 800)  # batch-mates do not matter
    assert torch.equal(alone[0], whole[1, 1200:2000])
    counters = torch.arange(100, 300)[None, :]
    whole_range = cn.uniform(keys[:, None], torch.arange(0, 400)[None])
    assert torch.equal(cn.uniform(keys[:, None], counters), whole_range[:, 100:300])


def test_seeds_and_domains_give_other_values() -> None:
    seeds = torch.tensor([1, 2, 2**32 + 1])  # the last differs from the first only in the high word
    a = cn.normal_run(cn.stream_keys(seeds, cn.FLOW_NOISE), torch.zeros(3, dtype=torch.int64), 20000)
    b = cn.normal_run(cn.stream_keys(seeds, cn.SINE_NOISE), torch.zeros(3, dtype=torch.int64), 20000)
    rows = [a[0], a[1], a[2], b[0]]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert abs(float(torch.corrcoef(torch.stack([rows[i], rows[j]]))[0, 1])) < 0.03


def test_draws_look_normal_and_uniform() -> None:
    keys = cn.stream_keys(torch.tensor([12345]), cn.SINE_NOISE)
    z = cn.normal_run(keys, torch.tensor([0]), 200_000)[0]
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1.0) < 0.01
    assert abs(float((z.abs() > 1.96).float().mean()) - 0.05) < 0.003  # the tails too
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < 0.01  # no lag-1 correlation
    u = cn.uniform(keys[:, None], torch.arange(200_000)[None])[0]
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.005
    assert torch.histc(u, bins=10, min=0, max=1).sub(20_000).abs().max() < 600
