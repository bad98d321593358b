"""agent_server.jobs request parsing, segment plans and the record: pure, no I/O."""

from __future__ import annotations

import orjson
import pytest

from agent_server.jobs.model import Job, JobError, JobStatus, iso, new_job_id, valid_job_id
from agent_server.jobs.request import JOB_FORMATS, JobRequest, job_format, one_model, parse_job_request
from agent_server.jobs.segments import JOB_MAX_CHARS, JOB_MAX_NEW_TOKENS, plan_segments
from agent_server.text.segmenter import weighted_len
from synth.api import max_tokens_for_text


def parse(obj: object, variant: str = "english", max_job_chars: int = 1_000) -> JobRequest:
    return parse_job_request(orjson.dumps(obj), route=one_model(variant), max_job_chars=max_job_chars)


def refusal(obj: object, variant: str = "english") -> JobError:
    with pytest.raises(JobError) as caught:
        parse(obj, variant)
    return caught.value


def test_only_text_is_required_and_the_rest_defaults_as_the_native_protocol() -> None:
    assert parse({"text": "Hello."}) == JobRequest("Hello.", "default", "pcm", None, (), None, None)


def test_every_field_is_read() -> None:
    request = parse({"text": "Bonjour.", "voice": "ann", "output_format": "opus", "seed": 9,
                     "sampling": {"temperature": 0.5, "max_new_tokens": 300}, "language": "FR",
                     "webhook_url": "https://hooks.example:8443/tts?k=1"}, variant="multilingual")
    assert request == JobRequest("Bonjour.", "ann", "opus", 9, (("temperature", 0.5), ("max_new_tokens", 300)), "fr",
                                 "https://hooks.example:8443/tts?k=1")


def test_the_formats_are_the_http_endpoints_names_at_the_native_rate() -> None:
    assert JOB_FORMATS == ("mp3", "opus", "aac", "flac", "wav", "pcm")
    assert {name: (job_format(name).container, job_format(name).sample_rate_hz) for name in JOB_FORMATS} == {
        "mp3": ("mp3", 24_000), "opus": ("ogg", 24_000), "aac": ("adts", 24_000), "flac": ("flac", 24_000),
        "wav": ("wav", 24_000), "pcm": ("raw", 24_000)}
    error = refusal({"text": "Hi.", "output_format": "mp3_44100_128"})
    assert (error.status_code, error.field) == (422, "output_format")


@pytest.mark.parametrize(("obj", "field"), [
    ({"text": "Hi.", "webhook_url": "https://user:pw@hooks.example/"}, "webhook_url"),
    ({"text": "Hi.", "webhook_url": "https:///nohost"}, "webhook_url"),
    ({"text": "Hi.", "webhook_url": "http://hooks.example:0/"}, "webhook_url"),
    ({"text": "Hi.", "webhook_url": "http://hooks.example:99999/"}, "webhook_url"),
    ({"text": "Hi.", "webhook_url": "https://x.example/" + "a" * 2048}, "webhook_url"),
    ({"text": "Hi.", "seed": 2**63}, "seed"),
    ({"text": "Hi.", "seed": True}, "seed"),
    ({"text": "Hi.", "sampling": {"top_k": 1.5}}, "sampling.top_k"),
    ({"text": "Hi.", "language": "english"}, "language"),
    ({"text": "Hi.", "voice": 3}, "voice"),
    ({"text": "Hi.", "output_format": 3}, "output_format"),
    ({"text": "x" * 1_001}, "text"),
])
def test_a_bad_field_is_a_422_naming_it(obj: object, field: str) -> None:
    error = refusal(obj, "multilingual")
    assert (error.status_code, error.field) == (422, field)
    assert error.body() == {"error": {"field": field, "message": error.message, "code": error.code}}


def test_a_body_that_is_no_json_object_is_a_400() -> None:
    for body in (b"", b"{", b"[]", b'"text"'):
        with pytest.raises(JobError) as caught:
            parse_job_request(body, route=one_model("english"))
        assert (caught.value.status_code, caught.value.field) == (400, "body")


# ---- the plan ---------------------------------------------------------------------------------------------


def test_a_plan_covers_the_text_in_order_in_short_normalised_segments() -> None:
    text = ("Chapter 1. It was a bright cold day in April, and the clocks were striking 13. " * 30
            + "The total came to $4.50 on 12/05/2026!  ...  🙂")
    plan = plan_segments(text)
    assert [seg.index for seg in plan] == list(range(len(plan)))
    ends = [(seg.start_char, seg.end_char) for seg in plan]
    assert all(a < b for a, b in ends)
    assert all(ends[i][1] <= ends[i + 1][0] for i in range(len(ends) - 1))  # in order, no overlap
    assert plan[0].start_char == 0
    for seg in plan:
        assert weighted_len(text[seg.start_char:seg.end_char].strip()) <= JOB_MAX_CHARS
        assert seg.max_new_tokens == min(max_tokens_for_text(seg.text), JOB_MAX_NEW_TOKENS)
    assert plan[0].text == "Chapter one."
    assert "thirteen" in plan[1].text
    assert any("four dollars and fifty cents" in seg.text for seg in plan)
    assert not any(seg.text in ("...", "🙂", "... 🙂") for seg in plan)  # nothing to say: no segment


def test_a_text_with_nothing_to_say_has_no_plan() -> None:
    assert plan_segments("... !!! 🙂") == ()


# ---- the record -----------------------------------------------------------------------------------------


def test_job_ids_sort_by_creation_and_are_recognised() -> None:
    first, second = new_job_id(1_796_000_000.0), new_job_id(1_796_000_000.001)
    assert first < second
    assert valid_job_id(first) and valid_job_id(second)
    assert not valid_job_id("job_123") and not valid_job_id(first.upper()) and not valid_job_id("x" + first[1:])


def test_a_record_round_trips_keeps_fields_it_does_not_know_and_says_when_it_expired() -> None:
    job = Job(id=new_job_id(100.0), key_id="k", created_at_s=100.0, voice="v", output_format="mp3", seed=1,
              text_chars=10, sampling=(("temperature", 0.7),), language="de", webhook_url="http://h/",
              segments_total=4, extra={"priority": "low"})
    progress = {"status": JobStatus.DONE, "segments_done": 4, "audio_samples": 48_000, "started_at_s": 101.0,
                "finished_at_s": 160.5, "error": None, "claims": 1}
    back = Job.from_stored(job.spec_json(), progress)
    assert back.extra == {"priority": "low"}
    assert (back.sampling, back.language, back.status, back.audio_seconds) == ((("temperature", 0.7),), "de",
                                                                              JobStatus.DONE, 2.0)
    assert back.status_json() == {"id": job.id, "status": "done", "segments_done": 4, "segments_total": 4,
                                  "audio_seconds": 2.0, "created_at": iso(100.0), "finished_at": iso(160.5),
                                  "error": None}
    assert not back.expired(160.5 + 99.999, 100.0)
    assert back.expired(160.5 + 100.0, 100.0)
    assert not job.expired(10**12, 100.0)  # unfinished: never
    assert [s.finished for s in JobStatus] == [False, False, True, True, True]
