"""The multilingual alignment analyzer in the batched engine: chatterbox's own analyzer logic, fed from the
runner's attention, gives each segment the reference's tokens and the reference's alignment matrix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from chatterbox.models.t3.inference.alignment_stream_analyzer import AlignmentStreamAnalyzer

import synth.alignment
from synth.api import EngineConfig, EngineError, SamplingParams, SegmentRequest
from synth.engine import Engine
from synth.loading import ModelBundle
from synth.presets import TINY_ALIGNED_LLAMA, build_t3
from synth.text import text_token_ids

from tests.synth.conftest import TEST_DEVICE, Collector, synthetic_voice, tiny_bundle

# The analyzer's matrix is the mean of three heads' softmax rows; ours and the reference's differ by
# rounding only (different matmul shapes), ~1e-7. 1e-5 is far above that and far below any real change.
ALIGNMENT_TOLERANCE = 1e-5
CASES = [  # (request id, text, language, seed, temperature, cfg)
    ("a", "Bonjour, comment allez-vous?", "fr", 1, 0.8, 0.5),
    ("b", "Hello there, general.", "en", 2, 0.8, 0.5),
    ("c", "Hola", "es", 3, 0.3, 0.0),
    ("d", "Guten Morgen, wie geht es Ihnen heute?", "de", 4, 1.2, 0.7),
]
N_TOKENS = 30


@pytest.fixture(scope="module")
def aligned_bundle() -> ModelBundle:
    base = tiny_bundle("multilingual")
    torch.manual_seed(0)
    return dataclasses.replace(base, t3=build_t3("multilingual", "tiny", backbone=TINY_ALIGNED_LLAMA).to(base.device))


def _params(seed: int, temperature: float, cfg: float) -> SamplingParams:
    return dataclasses.replace(SamplingParams.defaults("multilingual"), seed=seed, temperature=temperature,
                               cfg_weight=cfg, max_new_tokens=N_TOKENS)


def test_engine_analyzer_matches_reference(aligned_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[AlignmentStreamAnalyzer] = []
    original = synth.alignment.new_analyzer

    def recording(*args: int, **kwargs: int) -> AlignmentStreamAnalyzer:
        analyzer = original(*args, **kwargs)
        created.append(analyzer)
        return analyzer

    monkeypatch.setattr(synth.alignment, "new_analyzer", recording)
    engine = Engine(aligned_bundle, EngineConfig(variant="multilingual", weights="random-tiny", device=TEST_DEVICE,
                                                 max_slots=4, max_context_tokens=256, alignment_analyzer=True),
                    render_audio=False)
    voices = [synthetic_voice(aligned_bundle, f"v{i}", seed=20 + i) for i in range(2)]
    for voice in voices:
        engine.voices.add(voice)
    collector = Collector()
    engine.start()
    try:
        assert engine.wait_ready(60)
        created.clear()  # the engine's own warm-up segment had one too
        for i, (rid, text, lang, seed, temp, cfg) in enumerate(CASES):  # all in one batch
            engine.submit(SegmentRequest(request_id=rid, text=text, voice_id=f"v{i % 2}", language=lang,
                                         params=_params(seed, temp, cfg), sink=collector.sink_for(rid)))
        collector.wait_done([c[0] for c in CASES], 120)
        got = {rid: collector.tokens(rid) for rid, *_ in CASES}
    finally:
        engine.stop()
    ours = dict(zip([c[0] for c in CASES], created, strict=True))  # admitted in submission order
    assert len(created) == len(CASES)

    t3 = aligned_bundle.t3
    for i, (rid, text, lang, seed, temp, cfg) in enumerate(CASES):
        p = _params(seed, temp, cfg)
        ids = torch.tensor([text_token_ids("multilingual", aligned_bundle.tokenizer, text, lang)],
                           device=aligned_bundle.device)
        torch.manual_seed(seed)
        expected = t3.inference(t3_cond=voices[i % 2].t3_cond(p.exaggeration, aligned_bundle.device),
                                text_tokens=torch.cat([ids, ids]), max_new_tokens=N_TOKENS, temperature=temp,
                                cfg_weight=cfg, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                                top_p=p.top_p)[0].tolist()
        reference = t3.patched_model.alignment_stream_analyzer  # the analyzer that call used
        assert got[rid] == expected, rid
        assert ours[rid].alignment.shape == reference.alignment.shape, rid
        assert ours[rid].alignment.shape[0] == len(expected) + 1  # BOS block's two rows, then one per step
        assert ours[rid].alignment.abs().sum() > 0
        assert (ours[rid].alignment - reference.alignment).abs().max().item() < ALIGNMENT_TOLERANCE, rid
        assert ours[rid].text_position == reference.text_position and ours[rid].complete == reference.complete


def test_analyzer_is_refused_where_it_cannot_run(aligned_bundle: ModelBundle) -> None:
    with pytest.raises(EngineError, match="multilingual model only"):
        Engine(tiny_bundle("english"), EngineConfig(variant="english", alignment_analyzer=True), render_audio=False)
    with pytest.raises(EngineError, match="lacks"):  # the 2-layer tiny preset has no layer 9, 12 or 13
        Engine(tiny_bundle("multilingual"), EngineConfig(variant="multilingual", alignment_analyzer=True),
               render_audio=False)
