"""A job's text -> its segment plan: the existing segmenter and normaliser, run once at submission.

Each segment is one T3 generation, like a live context's. The cut: `segmenter.Segmenter` with the later-segment
rules from the first segment on (a job has no first audio to hurry: sentence ends, with short sentences riding
along with the next), `max_chars` lower than a live context's so that one segment is short; then
`normalize.spoken_form` on each segment's text, as `speech.SpeechStream` does for a live segment. Segments with
nothing to say (punctuation, emoji) are dropped; the plan's indices count the spoken ones.

What bounds how long one job segment holds an engine row (the wait a live segment can see behind it, when the
scheduler does not preempt):
- its text: at most `JOB_MAX_CHARS` weighted characters (segmenter weights: a digit 4, a CJK character 3), about
  7 s of speech, about 180 speech tokens for real weights;
- its generation: `max_new_tokens` = `synth.api.max_tokens_for_text` of the spoken text (25 + 4 per character,
  twice real speech's rate), never above `JOB_MAX_NEW_TOKENS` (600 tokens, 24 s of audio): a model that never
  says EOS (random weights) stops there.
So a job segment holds a row for at most its prefill plus `JOB_MAX_NEW_TOKENS` decode steps, typically a third
of that. docs: /work/notes/jobs-plan.md (the engine side: live segments admitted first, job segments only in
rows no live segment waits for).
"""

from __future__ import annotations

from agent_server.jobs.model import JobSegment
from agent_server.text.normalize import spoken_form
from agent_server.text.segmenter import Segmenter
from synth.api import max_tokens_for_text

JOB_MAX_CHARS = 120  # weighted (segmenter.weighted_len): ~7 s of speech; a live context's segments go to 250
JOB_MIN_CHARS = 40  # shorter sentences ride along with the next (fewer, better-sounding generations)
JOB_MAX_NEW_TOKENS = 600  # 24 s of audio: the most decode steps one job segment may take
NO_FIRST_SEGMENT_RULES = 1_000_000  # first_min/max_words: the first segment is cut like the others


def plan_segments(text: str, language: str | None = None, *, normalize: bool = True,
                  max_chars: int = JOB_MAX_CHARS, min_chars: int = JOB_MIN_CHARS) -> tuple[JobSegment, ...]:
    """The speakable segments of `text`, in order (empty: nothing to say). Pure; about linear in the text."""
    segmenter = Segmenter(first_min_words=NO_FIRST_SEGMENT_RULES, first_max_words=NO_FIRST_SEGMENT_RULES,
                          max_chars=max_chars, min_chars=min_chars)
    cut = segmenter.push(text, 0.0) + segmenter.end(0.0)
    plan: list[JobSegment] = []
    for seg in cut:
        if not seg.speakable:
            continue
        said = spoken_form(seg.text, language).text if normalize else seg.text
        budget = min(max_tokens_for_text(said), JOB_MAX_NEW_TOKENS)
        plan.append(JobSegment(len(plan), said, seg.start_char, seg.end_char, budget))
    return tuple(plan)
