"""agent_server/text/markup.py: vendors' inline tags cut out of streamed text, breaks as pauses, wherever the pieces
split; and through the speech stream: a pause is silence in the audio between segments."""

from __future__ import annotations

from itertools import pairwise

import pytest

from agent_server.text.markup import (
    CARTESIA_TAGS,
    ELEVENLABS_TAGS,
    ELEVENLABS_V3_TAGS,
    MAX_AUDIO_TAG_CHARS,
    MAX_TAG_CHARS,
    MarkupFilter,
    Pause,
    Piece,
    elevenlabs_tags,
)


def run(tags: frozenset[str], *pieces: str) -> tuple[list[Piece], list[str]]:
    markup = MarkupFilter(tags)
    out: list[Piece] = []
    for piece in pieces:
        out += markup.feed(piece)
    out += markup.end()
    merged: list[Piece] = []
    for item in out:  # pieces from separate feeds, joined as the segmenter sees them
        if merged and isinstance(item, str) and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged, markup.take_problems()


TEXT = 'Hold on. <break time="1.5s" /> Here it is: <spell>ABC</spell>, x < y and <3.<break time="250ms"/>Done'
EXPECTED: list[Piece] = ["Hold on. ", Pause(1500), " Here it is: ABC, x < y and <3.", Pause(250), "Done"]


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, len(TEXT)])
def test_breaks_and_tags_wherever_the_pieces_split(cut: int) -> None:
    pieces = [TEXT[i:i + cut] for i in range(0, len(TEXT), cut)]
    assert run(CARTESIA_TAGS, *pieces) == (EXPECTED, [])


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, len(TEXT)])
def test_what_is_given_out_maps_back_to_where_it_was_fed(cut: int) -> None:
    """The segmenter counts the text without its tags; a client's offsets count what it sent: each character
    given out maps back to itself in the text fed, each pause to its tag."""
    markup = MarkupFilter(CARTESIA_TAGS)
    out: list[Piece] = []
    for i in range(0, len(TEXT), cut):
        out += markup.feed(TEXT[i:i + cut])
    out += markup.end()
    given = "".join(piece for piece in out if isinstance(piece, str))
    assert markup.text_chars == len(given) and markup.fed_chars == len(TEXT)
    assert all(TEXT[markup.fed_offset(i)] == char for i, char in enumerate(given))
    assert [TEXT[p.raw_start:p.raw_end] for p in out if isinstance(p, Pause)] == ['<break time="1.5s" />',
                                                                                  '<break time="250ms"/>']
    assert markup.fed_span(0, len(given)) == (0, len(TEXT))


def test_each_dialect_keeps_the_tags_it_does_not_have_as_text() -> None:
    assert run(ELEVENLABS_TAGS, "<spell>AB</spell> <break time='2s'/>") == (["<spell>AB</spell> ", Pause(2000)], [])
    assert run(ELEVENLABS_TAGS, '<phoneme alphabet="ipa" ph="tə">tomato</phoneme>') == (["tomato"], [])
    assert run(CARTESIA_TAGS, '<speed ratio="1.2"/>Fast<emotion value="happy"/>!') == (["Fast!"], [])
    assert run(CARTESIA_TAGS, "<b>bold</b>") == (["<b>bold</b>"], [])


V3_TEXT = ("[giggling] Knock knock. [whispers]Who is it?<break time=\"1s\"/> See [1], [a b] and [not-a-tag!] "
           "[clears throat]")
V3_EXPECTED: list[Piece] = [" Knock knock. Who is it?", Pause(1000), " See [1],  and [not-a-tag!] "]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, len(V3_TEXT)])
def test_v3_audio_tags_are_not_said_wherever_the_pieces_split(cut: int) -> None:
    pieces = [V3_TEXT[i:i + cut] for i in range(0, len(V3_TEXT), cut)]
    assert run(ELEVENLABS_V3_TAGS, *pieces) == (V3_EXPECTED, [])


@pytest.mark.parametrize(("pieces", "said"), [
    (["Well[sighs]okay then."], "Well okay then."),  # a tag between two words leaves them two words
    (["That is great![laughs]Let us go."], "That is great! Let us go."),
    (["Well", "[si", "ghs]", "okay"], "Well okay"),  # wherever the pieces split
    (["Hi [laughs] there"], "Hi  there"),  # spaces already there: none added
    (["Hi[laughs]."], "Hi."),  # before punctuation: none
])
def test_a_removed_audio_tag_does_not_glue_its_neighbours(pieces: list[str], said: str) -> None:
    assert run(ELEVENLABS_V3_TAGS, *pieces) == ([said], [])


def test_audio_tags_only_where_the_dialect_has_them() -> None:
    assert run(ELEVENLABS_TAGS, "[laughs] Fine.") == (["[laughs] Fine."], [])
    assert elevenlabs_tags("eleven_v3") == ELEVENLABS_V3_TAGS == elevenlabs_tags("eleven_v3_conversational")
    assert elevenlabs_tags("eleven_flash_v2_5") == ELEVENLABS_TAGS == elevenlabs_tags(None)
    long_aside = "[" + "a" * (MAX_AUDIO_TAG_CHARS + 1) + "] x"
    assert run(ELEVENLABS_V3_TAGS, long_aside) == ([long_aside], [])  # too long for a tag: text
    markup = MarkupFilter(ELEVENLABS_V3_TAGS)
    assert markup.feed("so [sigh") == ["so "]
    assert markup.end() == ["[sigh"]  # the input ended inside it: text


def test_a_bad_break_is_reported_not_spoken_and_the_text_goes_on() -> None:
    pieces, problems = run(ELEVENLABS_TAGS, 'a <break time="forever"/> b <break time="30s"/> c')
    assert pieces == ["a  b  c"]
    assert len(problems) == 2 and "time=" in problems[0] and "at most 10 s" in problems[1]


def test_an_unfinished_tag_is_held_then_text() -> None:
    markup = MarkupFilter(ELEVENLABS_TAGS)
    assert markup.feed("wait <bre") == ["wait "]
    assert markup.end() == ["<bre"]  # the input ended inside it: text
    assert markup.take_problems() == []
    assert run(ELEVENLABS_TAGS, 'Unclosed <break time="1s" now.') == (
        ['Unclosed <break time="1s" now.'], ["'<break time=\"1s\" now.': a <break> that never closes ('>'): said as"
                                            " text"])  # a break that never closed: said, and reported
    assert markup.feed("<" + "x" * (MAX_TAG_CHARS + 1)) == ["<" + "x" * (MAX_TAG_CHARS + 1)]
    assert markup.feed("<break time=") == []
    assert markup.feed('"1s"' + " " * MAX_TAG_CHARS) == ['<break time="1s"' + " " * MAX_TAG_CHARS]


@pytest.mark.parametrize("cut", [3, 1000])
def test_segment_ranges_count_the_text_as_sent_tags_included(cut: int) -> None:
    """The native `breaks` protocol's `segment_started` [start_char, end_char): the range of the text the client
    pushed (its tags counted), a pause's the range of its tag; in order, never backwards."""
    from agent_server.core.events import SegmentStarted, StreamSpec
    from agent_server.core.stream import SpeechStream
    from agent_server.text.markup import SSML_TAGS
    from agent_server.text.segmenter import Segmenter
    from synth.api import EventKind, SamplingParams

    from tests.agent_server.core.test_stream import PCM24, ManualEngine, Recorder, sync_post

    text = 'Hello there my friend. <break time="1s"/> And then some more words here. Final bit.'
    engine, recorder = ManualEngine(), Recorder()
    spec = StreamSpec(voice_id="default", params=SamplingParams(seed=1), output_format=PCM24, markup=SSML_TAGS)
    stream = SpeechStream("s1/1", spec, engine=engine, segmenter=Segmenter(), post=sync_post, emit=recorder)
    stream.open()
    for i in range(0, len(text), cut):
        stream.push_text(text[i:i + cut], 0.0)
    stream.end(0.0)
    made = 0
    while made < len(engine.submitted):
        engine.chunk(made, 10)
        engine.event(made, EventKind.GENERATED)
        engine.event(made, EventKind.DONE)
        made += 1
    started = recorder.of(SegmentStarted)
    ranges = [text[s.start_char:s.end_char] for s in started]
    assert [s.text for s in started] == ["Hello there my friend.", "", "And then some more words here.", "Final bit."]
    assert [r.strip() for r in ranges] == ["Hello there my friend.", '<break time="1s"/>',
                                          "And then some more words here.", "Final bit."]
    assert started[0].start_char == 0 and started[-1].end_char == len(text)  # they tile what was sent
    assert all(a.end_char == b.start_char for a, b in pairwise(started))
