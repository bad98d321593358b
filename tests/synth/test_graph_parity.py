"""CUDA graph replay against the eager functions it captured, driven at the runner level: identical inputs, identically
reseeded generators, STEPS steps, no engine thread and no timing (which bucket pair runs is chosen here, not by
when segments arrive).

- Decode + sampling (synth/t3_runner.py): Turbo and English, tiny and full size, fp32 and bf16, on three (row
  bucket, key bucket) pairs. The KV cache holds the same random keys and values in both runs, rows of different
  lengths; each step feeds the id sampled at the step before from the device, as the engine does. The sampled ids
  must be identical at every step; the logits bitwise, or within synth/t3_runner.PARITY_TOLERANCE with the same
  argmax. Which of the two held is printed (and written to $SYNTH_PARITY_JSON when set: scripts/gpu_check.sh).
- The vocoder's render graphs (synth/render_graphs.py): tiny and full-size S3Gen, Turbo and English, several ticks
  (captures, then replays with new inputs), PCM to GRAPH_PCM_TOLERANCE.

CUDA only: a graph is captured and replayed on a CUDA device; elsewhere these tests skip and say so (on the CPU
the same functions run eagerly in every other test, and tests/synth/test_engine_graphs.py simulates the capture).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from synth.presets import build_t3, make_peaky_
from synth.step_buffers import bucket
from synth.t3_runner import PARITY_TOLERANCE, T3Runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only: graph capture and replay need a CUDA device (scripts/"
    "gpu_check.sh runs these on a GPU); the CPU runs the same functions eagerly in every other test")]

STEPS = 20
MAX_ROWS = 16
MAX_LEN = 1024
PAIRS = ((1, 64), (4, 448), (16, 1024))  # (row bucket, key bucket): short rows, Turbo-prefix-long rows, the longest
DTYPES = (torch.float32, torch.bfloat16)  # fp32 first: the runner casts its T3 in place
RESULTS_ENV = "SYNTH_PARITY_JSON"


def _record(result: dict[str, Any]) -> None:
    print(json.dumps(result))
    path = os.environ.get(RESULTS_ENV)
    if path:
        with Path(path).open("a") as out:
            out.write(json.dumps(result) + "\n")


def _fill_cache(runner: T3Runner, n_rows: int, n_keys: int, seed: int) -> None:
    """Random keys and values where the step reads them (the bucket's rows and keys), drawn on the cache's device:
    a full-size cache holds billions of values, which a host generator takes tens of seconds to draw."""
    g = torch.Generator(device=runner.cache.all_keys.device).manual_seed(seed)
    for tensor in (runner.cache.all_keys, runner.cache.all_values):
        part = tensor[:, :n_rows, :, :n_keys]
        part.copy_(0.5 * torch.randn(part.shape, generator=g, device=part.device, dtype=torch.float32))


def _set_params(runner: T3Runner, n_rows: int) -> None:
    floats, ints = runner.inputs.floats, runner.inputs.ints
    rows = np.arange(n_rows)
    for name, value in (("temperature", 0.8), ("top_p", 0.95), ("min_p", 0.05),
                        ("top_k", 1000.0 if runner.is_gpt else 0.0), ("repetition_penalty", 1.2),
                        ("cfg_weight", 0.0 if runner.is_gpt else 0.5)):
        floats[name][:n_rows] = value
    ints["partner"][:n_rows] = rows if runner.is_gpt else np.minimum(rows ^ 1, n_rows - 1)  # (cond, uncond) pairs


def _write_step(runner: T3Runner, n_rows: int, n_keys: int, step: int) -> None:
    ints = runner.inputs.ints
    rows = np.arange(n_rows)
    runner.inputs.idle_rows(MAX_ROWS)
    cond = rows if runner.is_gpt else rows - rows % 2  # the row whose id a row feeds
    base = n_keys - STEPS - 1 - rows % 5  # rows of different lengths, the longest filling the key bucket
    ints["feed"][:n_rows] = -1 if step == 0 else cond
    ints["token"][:n_rows] = (37 * cond + 11) % 6000  # the first step's ids, from the host
    ints["pos"][:n_rows] = ints["write"][:n_rows] = base + step
    ints["keys"][:n_rows] = base + step + 1
    ints["speech_pos"][:n_rows] = step + 1
    ints["reset"][:n_rows] = 1 if step == 0 else 0
    runner.inputs.upload()


def _run(runner: T3Runner, n_rows: int, n_keys: int, snapshot: tuple[torch.Tensor, ...], graphed: bool
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys, values, seen = snapshot
    runner.cache.all_keys[:, :n_rows].copy_(keys)
    runner.cache.all_values[:, :n_rows].copy_(values)
    runner.seen.copy_(seen)
    runner.sampled.zero_()
    for row in range(n_rows):
        runner.generators[row].manual_seed(1000 + row)
    logits, ids = [], []
    with torch.inference_mode():
        for step in range(STEPS):
            _write_step(runner, n_rows, n_keys, step)
            if graphed:
                runner.decode(n_rows, n_keys)
                runner.sample(n_rows)
            else:
                runner._decode_eager(n_rows, n_keys)
                runner._sample_eager(n_rows)
            logits.append(runner.logits[:n_rows].clone())
            ids.append(runner.sampled[:n_rows].clone())
    return logits, ids


@pytest.mark.parametrize("size", ["tiny", "full"])
@pytest.mark.parametrize("variant", ["turbo", "english"])
def test_graphed_decode_and_sampling_equal_eager_step_by_step(variant: str, size: str) -> None:
    torch.manual_seed(0)
    t3 = make_peaky_(build_t3(variant, size)) if size == "tiny" else build_t3(variant, size)  # type: ignore[arg-type]
    device = torch.device("cuda")
    for dtype in DTYPES:
        runner = T3Runner(t3, max_rows=MAX_ROWS, max_len=MAX_LEN, device=device, dtype=dtype, cuda_graphs=True)
        assert runner.use_graphs
        atol, rtol = PARITY_TOLERANCE[dtype]
        for n_rows, n_keys in PAIRS:
            assert bucket(runner.key_buckets, n_keys) == n_keys and bucket(runner.row_buckets, n_rows) == n_rows
            runner.inputs.idle_rows(MAX_ROWS)
            runner.inputs.upload()
            runner.decode(n_rows, n_keys)  # the captures (their warm-up runs write only what is reset below)
            runner.sample(n_rows)
            assert runner._decode_graphs[(n_rows, n_keys)].captured and runner._sample_graphs[n_rows].captured
            _fill_cache(runner, n_rows, n_keys, seed=n_rows)
            _set_params(runner, n_rows)
            snapshot = (runner.cache.all_keys[:, :n_rows].clone(), runner.cache.all_values[:, :n_rows].clone(),
                        torch.zeros_like(runner.seen))
            eager_logits, eager_ids = _run(runner, n_rows, n_keys, snapshot, graphed=False)
            graph_logits, graph_ids = _run(runner, n_rows, n_keys, snapshot, graphed=True)
            worst = max((a - b).abs().max().item() for a, b in zip(eager_logits, graph_logits, strict=True))
            bitwise = all(torch.equal(a, b) for a, b in zip(eager_logits, graph_logits, strict=True))
            same_ids = [torch.equal(a, b) for a, b in zip(eager_ids, graph_ids, strict=True)]
            _record({"test": "decode_sampling", "variant": variant, "size": size, "dtype": str(dtype),
                     "rows": n_rows, "keys": n_keys, "steps": STEPS, "bitwise": bitwise, "max_abs_diff": worst,
                     "ids_equal_steps": sum(same_ids)})
            assert all(same_ids), f"{variant} {size} {dtype} ({n_rows}, {n_keys}): ids differ from step " \
                                  f"{same_ids.index(False)}"
            for step, (a, b) in enumerate(zip(eager_logits, graph_logits, strict=True)):
                excess = ((b - a).abs() - (atol + rtol * a.abs())).max().item()
                assert excess <= 0 and torch.equal(a.argmax(-1), b.argmax(-1)), (
                    f"{variant} {size} {dtype} ({n_rows}, {n_keys}) step {step}: logits differ by "
                    f"{(b - a).abs().max().item():.3g}")
        del runner
        torch.cuda.empty_cache()


@pytest.mark.parametrize("size", ["tiny", "full"])
@pytest.mark.parametrize("variant", ["turbo", "english"])
def test_captured_vocoder_renders_equal_eager_renders(variant: str, size: str) -> None:
    """Five streams, five ticks of mixed chunk sizes (captures, then replays with new inputs): the graphed
    vocoder's PCM equals the eager one's to GRAPH_PCM_TOLERANCE, and no capture fell back to eager."""
    from synth.tiny_s3gen import build_s3gen
    from synth.vocoder import GRAPH_PCM_TOLERANCE, StreamingVocoder

    from tests.synth.test_vocoder import PROMPT_TOKENS, SAMPLE_RATE_HZ, VARIANTS, reference_wav, utterance

    steps, meanflow, silence = VARIANTS[variant]
    torch.manual_seed(0)
    device = torch.device("cuda")
    s3gen = build_s3gen(size, meanflow).to(device)  # type: ignore[arg-type]
    ref_dict = s3gen.embed_ref(reference_wav(), SAMPLE_RATE_HZ, device=device)
    outputs = []
    for graphed in (False, True):
        vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                                   prompt_max_tokens=PROMPT_TOKENS)
        graphs = vocoder.use_graphs() if graphed else None
        voice = vocoder.prepare_voice(ref_dict)
        streams = []
        for i in range(5):
            stream = vocoder.open(voice, seed=40 + i)
            stream.prompt = vocoder.prompt_cache(voice)
            stream.add(utterance(120, seed=40 + i), final=True)
            streams.append(stream)
        pcm: list[list[float]] = [[] for _ in streams]
        for chunk in (12, 24, 24, 12, 24):
            live = [(i, job) for i, job in enumerate(s.next_job(chunk) for s in streams) if job is not None]
            for (index, _), out in zip(live, vocoder.render([job for _, job in live]), strict=True):
                pcm[index].extend(out.tolist())
        outputs.append(pcm)
        if graphs is not None:
            assert graphs.captured > 0 and graphs.failed == 0
    worst = 0.0
    for eager, replayed in zip(*outputs, strict=True):
        assert len(eager) == len(replayed) > 0
        worst = max(worst, max(abs(a - b) for a, b in zip(eager, replayed, strict=True)))
    _record({"test": "vocoder_renders", "variant": variant, "size": size, "max_abs_diff": worst})
    assert worst <= GRAPH_PCM_TOLERANCE
