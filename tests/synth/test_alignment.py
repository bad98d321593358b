"""The multilingual alignment analyzer in the batched engine: chatterbox's own analyzer logic, fed from the
runner's attention, gives each segment the reference's tokens and the reference's alignment matrix."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from chatterbox.models.t3.inference.alignment_stream_analyzer import AlignmentStreamAnalyzer

import synth.alignment
from synth.api import EngineConfig, EngineError, Priority, SamplingParams, SegmentRequest
from synth.engine import Engine
from synth.loading import ModelBundle
from synth.presets import TINY_ALIGNED_LLAMA, build_t3
from synth.text import text_token_ids
from synth.voices import Voice

from tests.synth.conftest import TEST_DEVICE, ArrivesAtLayer, Collector, synthetic_voice, tiny_bundle

# The analyzer's matrix is the mean of three heads' softmax rows; ours and the reference's differ by
# rounding only (different matmul shapes), ~1e-7. 1e-5 is far above that and far below any real change.
ALIGNMENT_TOLERANCE = 1e-5
CASES = [  # (request id, text, language, seed, temperature, cfg)
    ("a", "Bonjour, comment allez-vous?", "fr", 1, 0.8, 0.5),
    ("b", "Hello there, general.", "en", 2, 0.8, 0.5),
    ("c", "Hola", "es", 3, 0.3, 0.0),
    ("d", "Guten Morgen, wie geht es Ihnen heute?", "de", 4, 1.2, 0.7),
]
Case = tuple[str, str, str, int, float, float]
N_TOKENS = 30


@pytest.fixture(scope="module")
def aligned_bundle() -> ModelBundle:
    base = tiny_bundle("multilingual")
    torch.manual_seed(0)
    return dataclasses.replace(base, t3=build_t3("multilingual", "tiny", backbone=TINY_ALIGNED_LLAMA).to(base.device))


def _params(seed: int, temperature: float, cfg: float, n_tokens: int = N_TOKENS) -> SamplingParams:
    return dataclasses.replace(SamplingParams.defaults("multilingual"), seed=seed, temperature=temperature,
                               cfg_weight=cfg, max_new_tokens=n_tokens)


def _voices(bundle: ModelBundle) -> list[Voice]:
    return [synthetic_voice(bundle, f"v{i}", seed=20 + i) for i in range(2)]


def _record_analyzers(monkeypatch: pytest.MonkeyPatch) -> list[AlignmentStreamAnalyzer]:
    """Every analyzer the engine makes from now on, in the order it makes them (one per admission)."""
    created: list[AlignmentStreamAnalyzer] = []
    original = synth.alignment.new_analyzer

    def recording(*args: int, **kwargs: int) -> AlignmentStreamAnalyzer:
        made = original(*args, **kwargs)
        created.append(made)
        return made

    monkeypatch.setattr(synth.alignment, "new_analyzer", recording)
    return created


def _engine_run(bundle: ModelBundle, cases: list[Case], n_tokens: dict[str, int], compact: bool, analyzer: bool,
                monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[int]], dict[str, AlignmentStreamAnalyzer]]:
    """Every case in one batch (case i on voice i % 2); each case's tokens and the analyzer it was given."""
    created = _record_analyzers(monkeypatch)
    engine = Engine(bundle, EngineConfig(variant="multilingual", weights="random-tiny", device=TEST_DEVICE,
                                         max_slots=4, max_context_tokens=256, alignment_analyzer=analyzer,
                                         compact_steps=compact),
                    render_audio=False)
    assert engine.runner.compact_rows == (compact and TEST_DEVICE == "cpu")  # (the aligned preset's heads fit)
    for voice in _voices(bundle):
        engine.voices.add(voice)
    collector = Collector()
    engine.start()
    try:
        assert engine.wait_ready(60)
        created.clear()  # the engine's own warm-up segment had one too
        for i, (rid, text, lang, seed, temp, cfg) in enumerate(cases):  # all in one batch
            engine.submit(SegmentRequest(request_id=rid, text=text, voice_id=f"v{i % 2}", language=lang,
                                         params=_params(seed, temp, cfg, n_tokens[rid]), sink=collector.sink_for(rid)))
        collector.wait_done([c[0] for c in cases], 120)
        got = {rid: collector.tokens(rid) for rid, *_ in cases}
    finally:
        engine.stop()
    assert len(created) == (len(cases) if analyzer else 0)
    return got, dict(zip([c[0] for c in cases], created, strict=False))  # admitted in submission order


def _reference(bundle: ModelBundle, voices: list[Voice], i: int, case: Case, n_tokens: int
               ) -> tuple[list[int], AlignmentStreamAnalyzer]:
    """chatterbox's own inference of one case, alone, and the analyzer it used."""
    _, text, lang, seed, temp, cfg = case
    p = _params(seed, temp, cfg, n_tokens)
    t3 = bundle.t3
    ids = torch.tensor([text_token_ids("multilingual", bundle.tokenizer, text, lang)], device=bundle.device)
    torch.manual_seed(seed)
    expected = t3.inference(t3_cond=voices[i % 2].t3_cond(p.exaggeration, bundle.device),
                            text_tokens=torch.cat([ids, ids]), max_new_tokens=n_tokens, temperature=temp,
                            cfg_weight=cfg, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                            top_p=p.top_p)[0].tolist()
    return expected, t3.patched_model.alignment_stream_analyzer


def _check_against_reference(bundle: ModelBundle, cases: list[Case], n_tokens: dict[str, int],
                             got: dict[str, list[int]], ours: dict[str, AlignmentStreamAnalyzer]) -> None:
    voices = _voices(bundle)
    for i, case in enumerate(cases):
        rid = case[0]
        expected, reference = _reference(bundle, voices, i, case, n_tokens[rid])
        assert got[rid] == expected, rid
        assert ours[rid].alignment.shape == reference.alignment.shape, rid
        assert ours[rid].alignment.shape[0] == len(expected) + 1  # BOS block's two rows, then one per step
        assert ours[rid].alignment.abs().sum() > 0
        assert (ours[rid].alignment - reference.alignment).abs().max().item() < ALIGNMENT_TOLERANCE, rid
        assert ours[rid].text_position == reference.text_position and ours[rid].complete == reference.complete


@pytest.mark.parametrize("compact", [True, False], ids=["compact step", "bucket step"])
def test_engine_analyzer_matches_reference(aligned_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch,
                                           compact: bool) -> None:
    """Compact steps (the CPU's, with the C attention kernel) capture the analyzer's heads for the decoding rows
    only and edit the sample rows' guided logits; bucket steps (the GPU's) every row of the bucket."""
    n_tokens = {c[0]: N_TOKENS for c in CASES}
    got, ours = _engine_run(aligned_bundle, CASES, n_tokens, compact, True, monkeypatch)
    _check_against_reference(aligned_bundle, CASES, n_tokens, got, ours)


@pytest.fixture(scope="module")
def eos_biased_bundle(aligned_bundle: ModelBundle) -> ModelBundle:
    """The aligned model made to say EOS early: only the analyzer's suppression keeps most segments going."""
    torch.manual_seed(0)  # the aligned model's weights (a model of its own: the reference patches the one it runs)
    t3 = build_t3("multilingual", "tiny", backbone=TINY_ALIGNED_LLAMA).to(aligned_bundle.device)
    head = t3.speech_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, device=head.weight.device)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[t3.hp.stop_speech_token] = EOS_BOOST
    t3.speech_head = biased.eval()
    return dataclasses.replace(aligned_bundle, t3=t3)


EOS_BOOST = 12.0  # EOS ends every case within a few ids without the analyzer (the test checks it)


@pytest.mark.parametrize("compact", [True, False], ids=["compact step", "bucket step"])
def test_each_analyzer_edits_its_own_row(eos_biased_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch,
                                         compact: bool) -> None:
    """Each analyzer reads its own row's captured heads and edits its own row's guided logits, in a compact step
    (the CPU's: its rows are not the bucket's, a segment that ends early leaves a gap, and the sampled cond rows are
    every other row) and in a bucket step (the GPU's). With EOS made likely the edit decides the tokens (it
    suppresses EOS until the text is read), so an edit on the wrong row ends or prolongs a segment."""
    n_tokens = {"a": 24, "b": 24, "c": 6, "d": 24}  # c ends first: rows after it move in a compact step
    plain, _ = _engine_run(eos_biased_bundle, CASES, n_tokens, compact, analyzer=False, monkeypatch=monkeypatch)
    got, ours = _engine_run(eos_biased_bundle, CASES, n_tokens, compact, analyzer=True, monkeypatch=monkeypatch)
    _check_against_reference(eos_biased_bundle, CASES, n_tokens, got, ours)
    eos = eos_biased_bundle.t3.hp.stop_speech_token
    assert all(len(tokens) <= 4 and tokens[-1] == eos for tokens in plain.values()), plain  # EOS at once, unedited
    assert sum(len(got[rid]) > 8 for rid in ("a", "b", "d")) >= 2, got  # the analyzer kept them going


def test_job_rows_sit_out_and_a_withdrawn_job_step_leave_every_analyzer_as_the_reference(
        eos_biased_bundle: ModelBundle, monkeypatch: pytest.MonkeyPatch) -> None:
    """Multilingual with its analyzer now runs the CPU's compact steps, so its job rows sit out a live turn's first
    ids and a jobs-only step stops for the turn. Three cases decode as jobs, the fourth arrives as a live turn at
    layer 1 of a jobs-only step: that step is withdrawn (nothing sampled, no analyzer fed), the jobs sit out, and
    every case says the reference's tokens with the reference's alignment (hand-stepped: no timing)."""
    n_tokens = {"a": 24, "b": 24, "c": 12, "d": 24}
    *jobs, live = CASES[0], CASES[1], CASES[3], CASES[2]
    created = _record_analyzers(monkeypatch)
    engine = Engine(eos_biased_bundle, EngineConfig(variant="multilingual", weights="random-tiny", device=TEST_DEVICE,
                                                    max_slots=4, max_context_tokens=256, alignment_analyzer=True),
                    render_audio=False)
    if not engine.runner.compact_rows:
        pytest.skip("compact steps are the CPU's (fp32, the C attention kernel): the bucket step never pauses rows")
    voices = _voices(eos_biased_bundle)
    for voice in voices:
        engine.voices.add(voice)
    collector = Collector()
    order = {c[0]: i for i, c in enumerate(CASES)}  # case i speaks with voice i % 2, as the reference does

    def request(case: Case) -> SegmentRequest:
        rid, text, lang, seed, temp, cfg = case
        return SegmentRequest(request_id=rid, text=text, voice_id=f"v{order[rid] % 2}", language=lang,
                              params=_params(seed, temp, cfg, n_tokens[rid]), sink=collector.sink_for(rid))

    with torch.no_grad():
        for case in jobs:
            engine.submit(dataclasses.replace(request(case), priority=Priority.JOB, first_audio_pending=False))
        for _ in range(3):
            engine._step()
        assert len(engine.scheduler.running) == len(jobs)
        arrival = ArrivesAtLayer(1, lambda: engine.submit(request(live)))
        engine.turn_arrived = arrival
        engine._step()  # the jobs-only step the live turn arrives during
        assert engine.runner.steps_interrupted == 1 and engine.scheduler.job_steps_withdrawn == 1
        for _ in range(500):
            if engine.scheduler.idle:
                break
            engine._step()
    assert engine.scheduler.idle and engine.scheduler.job_rows_paused > 0
    got = {c[0]: collector.tokens(c[0]) for c in CASES}
    ours = dict(zip([c[0] for c in (*jobs, live)], created, strict=True))
    ordered = sorted(CASES, key=lambda c: order[c[0]])
    _check_against_reference(eos_biased_bundle, ordered, n_tokens, got, ours)


def test_analyzer_is_refused_where_it_cannot_run(aligned_bundle: ModelBundle) -> None:
    with pytest.raises(EngineError, match="multilingual model only"):
        Engine(tiny_bundle("english"), EngineConfig(variant="english", alignment_analyzer=True), render_audio=False)
    with pytest.raises(EngineError, match="lacks"):  # the 2-layer tiny preset has no layer 9, 12 or 13
        Engine(tiny_bundle("multilingual"), EngineConfig(variant="multilingual", alignment_analyzer=True),
               render_audio=False)
