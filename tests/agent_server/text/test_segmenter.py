from __future__ import annotations

import itertools
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_server.text.segmenter import (
    CJK_PUNCT,
    DEFAULT_FIRST_WAIT_MS,
    MIN_MAX_CHARS,
    REASONS,
    Segment,
    Segmenter,
    weighted_len,
)

WAIT_S = DEFAULT_FIRST_WAIT_MS / 1000.0


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def feed(pieces: list[str], seg: Segmenter | None = None, *, end: bool = True) -> list[Segment]:
    seg = seg or Segmenter()
    out: list[Segment] = []
    for piece in pieces:
        out += seg.push(piece, 0.0)
    if end:
        out += seg.end(0.0)
    return out


def texts(segments: list[Segment]) -> list[str]:
    return [s.text for s in segments]


CJK_RANGES = [(0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
              (0xFF66, 0xFF9F), (0x20000, 0x3134F)]  # fmt: skip


def is_cjk(ch: str) -> bool:
    return any(lo <= ord(ch) <= hi for lo, hi in CJK_RANGES)


# ---- first segment ---------------------------------------------------------------------------------


def test_first_segment_at_clause_break_after_min_words() -> None:
    seg = Segmenter()
    assert seg.push("Sure, I can", 0.0) == []  # "Sure," is one word: too short to go alone
    assert seg.push(" help you,", 0.0) == []  # the comma needs the next character to count
    out = seg.push(" tell", 0.0)
    assert [(s.text, s.reason) for s in out] == [("Sure, I can help you,", "clause")]


def test_trailing_comma_kept() -> None:
    out = feed(["Well, let me see, ", "okay."])
    assert out[0].text == "Well, let me see,"


def test_first_segment_after_max_words_without_punctuation() -> None:
    seg = Segmenter()
    assert seg.push("one two three four five six", 0.0) == []  # "six" may still be "sixty"
    out = seg.push(" seven", 0.0)
    assert [(s.text, s.reason) for s in out] == [("one two three four five six", "words")]


def test_first_sentence_goes_at_once_however_short() -> None:
    out = Segmenter().push("Hi. How are", 0.0)
    assert [(s.text, s.reason) for s in out] == [("Hi.", "sentence")]


def test_punctuation_alone_is_not_a_first_segment() -> None:
    seg = Segmenter()
    assert seg.push("... ! — ", 0.0) == []
    out = seg.push("Hello there. Bye", 0.0)
    assert [(s.text, s.start_char) for s in out] == [("... ! — Hello there.", 0)]


# ---- later segments ----------------------------------------------------------------------------------


def test_later_segments_only_at_sentence_ends() -> None:
    out = feed(pieces_of("Hi. Sure, I can help you with that, and with more, of course. Bye now, friend.", 4))
    assert texts(out) == [
        "Hi.",
        "Sure, I can help you with that, and with more, of course.",
        "Bye now, friend.",
    ]
    assert [s.reason for s in out] == ["sentence", "sentence", "end"]


def test_short_later_sentences_ride_with_the_next() -> None:
    out = feed(["Hello! Yes. No. I think that is right. OK."])
    assert texts(out) == ["Hello!", "Yes. No. I think that is right.", "OK."]


@pytest.mark.parametrize(
    "sentence",
    [
        "It costs 3.14 dollars and more words here.",
        "Mr. Smith and Dr. Jones met at St. Louis today.",
        "We use tools, e.g. hammers, i.e. things, in the U.S. Army now.",
        "He bought apples, pears, etc. and went home again.",
        "Well... maybe we should wait a little longer here.",
        "Visit example.com/path.html or ask again later today.",
        "It was No. 5 on the list and also approx. 3 metres long.",
        'She asked "why?" and then walked away without a word.',
        "Visit 456 Oak Ave. Suite 200 or Acme Inc. Customer Service today.",  # capitalised: no sentence end
        "The clinic is open Mon. Tue. and Wed. from Dec. Fifth onwards.",
    ],
)
def test_no_sentence_end_inside(sentence: str) -> None:
    out = feed(["Okay. ", sentence, " Next one here."])
    assert texts(out) == ["Okay.", sentence, "Next one here."]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_sentence_end_decided_the_same_for_any_piece_size(size: int) -> None:
    text = "Okay. The value is 3.14 today. Mr. Smith agrees with that! Does he? Yes... He does."
    assert texts(feed(pieces_of(text, size))) == [
        "Okay.",
        "The value is 3.14 today.",
        "Mr. Smith agrees with that!",
        "Does he? Yes... He does.",
    ]


def test_ellipsis_before_a_capital_ends_the_sentence() -> None:
    out = feed(["Okay. I was going to say something... Then it hit me hard."])
    assert texts(out) == ["Okay.", "I was going to say something...", "Then it hit me hard."]


def test_line_breaks_and_list_markers() -> None:
    text = "Here are the options:\n1. The first option here.\n2. The second option here.\nlower case goes on"
    out = feed(pieces_of(text, 3))
    assert texts(out) == [
        "Here are the options:",
        "1. The first option here.",
        "2. The second option here. lower case goes on",
    ]


def test_cjk_sentences_and_clauses() -> None:
    out = feed(list("你好，我是你的助手。今天天气很好，我们去公园吧！好的。"))
    assert texts(out) == ["你好，我是你的助手。", "今天天气很好，我们去公园吧！", "好的。"]


def test_cjk_first_clause_break_and_ascii_punctuation() -> None:
    out = feed(list("我们今天去哪里,去公园吧.好"))
    assert texts(out)[0] == "我们今天去哪里,"
    assert out[0].reason == "clause"


def test_other_scripts_and_emoji() -> None:
    text = "Привет, как дела у тебя? 👋 मैं ठीक हूँ। مرحبا كيف حالك؟ Done 👨\u200d👩\u200d👧 here."
    out = feed(list(text))
    assert "".join(texts(out)).replace(" ", "") == text.replace(" ", "")
    assert out[0].text == "Привет, как дела у тебя?"


# ---- whitespace, pieces, offsets ---------------------------------------------------------------------


def test_odd_whitespace_is_normalised_and_counted() -> None:
    text = "\t Hello,\u00a0\u00a0world\nhow\r\n are   you\u3000doing today? "
    out = feed(pieces_of(text, 2))
    assert texts(out) == ["Hello, world how are you doing", "today?"]  # the 6-word first-segment rule
    assert (out[0].start_char, out[-1].end_char) == (0, len(text))


def test_pieces_that_split_words_never_split_segments() -> None:
    out = feed(["Hel", "lo wor", "ld, fan", "tas", "tic to", "day. Ano", "ther one", " he", "re."])
    assert texts(out) == ["Hello world, fantastic today.", "Another one here."]


def test_whitespace_only_input_gives_one_silent_segment() -> None:
    seg = Segmenter()
    assert seg.push("  \n\t ", 0.0) == []
    assert seg.flush(0.0) == []
    out = seg.end(0.0)
    assert [(s.text, s.start_char, s.end_char, s.speakable) for s in out] == [("", 0, 5, False)]


def test_punctuation_tail_after_the_last_segment_is_accounted_for() -> None:
    seg = Segmenter()
    assert texts(seg.push("Hello there. !!", 0.0)) == ["Hello there."]
    out = seg.end(0.0)
    assert [(s.text, s.start_char, s.end_char) for s in out] == [("", 12, 15)]


def test_end_absorbs_a_trailing_tail_into_the_segment_it_cuts() -> None:
    out = feed(["Okay then. Bye now. \n "])
    assert [(s.text, s.end_char) for s in out] == [("Okay then.", 10), ("Bye now.", 22)]


def test_offsets_map_back_to_the_input() -> None:
    text = "  Sure,  I can\thelp you with that.\n\nAnd this is the next sentence!  "
    out = feed(pieces_of(text, 5))
    for s in out:
        assert s.text == " ".join(text[s.start_char : s.end_char].split())
    assert [s.index for s in out] == list(range(len(out)))


# ---- max_chars ---------------------------------------------------------------------------------------


def test_long_sentence_split_at_clause_break() -> None:
    seg = Segmenter(max_chars=40, min_chars=10)
    text = "Okay. This sentence is long, it has a clause break, and it goes on and on without end."
    out = feed(pieces_of(text, 3), seg)
    assert texts(out) == [
        "Okay.",
        "This sentence is long,",
        "it has a clause break,",
        "and it goes on and on without end.",
    ]
    assert [s.reason for s in out] == ["sentence", "max_chars", "max_chars", "end"]


def test_long_sentence_split_at_whitespace_when_no_clause_break() -> None:
    seg = Segmenter(max_chars=20, min_chars=5)
    out = feed(["Go. Aaaa bbbb cccc dddd eeee ffff gggg"], seg)
    assert texts(out) == ["Go.", "Aaaa bbbb cccc dddd", "eeee ffff gggg"]
    assert all(weighted_len(s.text) <= 20 for s in out)


def test_hard_cut_only_without_whitespace_and_keeps_graphemes_whole() -> None:
    seg = Segmenter(max_chars=16, min_chars=8)
    url = "https://example.com/" + "e\u0301" * 20
    out = feed(pieces_of(url, 3), seg)
    assert "".join(texts(out)) == url
    assert all(len(s.text) <= 16 for s in out)
    for s in out[1:]:
        assert unicodedata.category(url[s.start_char]) != "Mn"


def test_hard_cut_keeps_zwj_emoji_whole() -> None:
    family = "👨\u200d👩\u200d👧"
    text = "x" * 14 + family + "y" * 10
    out = feed([text], Segmenter(max_chars=16, min_chars=8))
    assert texts(out) == ["x" * 14, family + "y" * 10]


def test_cjk_is_weighted_and_split_between_characters() -> None:
    seg = Segmenter(max_chars=30)
    text = "好" * 25
    out = feed(list(text), seg)
    assert [len(s.text) for s in out] == [10, 10, 5]
    assert all(weighted_len(s.text) <= 30 for s in out)


def test_long_whitespace_run_does_not_grow_the_buffer() -> None:
    seg = Segmenter(max_chars=20, min_chars=8)
    out = seg.push("Hello" + " " * 10_000, 0.0)
    assert texts(out) == ["Hello"]
    assert len(seg.pending_text) == 0 and seg.pending_chars == 10_000
    assert seg.push(" " * 10_000, 0.0) == []
    assert len(seg.pending_text) == 0


def test_symbols_only_window_becomes_a_silent_segment() -> None:
    seg = Segmenter(max_chars=16, min_chars=8)
    out = feed(["Hi. ", "-- " * 10, "and then more words."], seg)
    assert out[0].text == "Hi."
    assert [s.text for s in out[1:]] == ["", "", "and then more", "words."]  # no word cut in two
    assert out[1].reason == "max_chars"


# ---- time, flush, end --------------------------------------------------------------------------------


def test_poll_emits_first_segment_after_the_wait() -> None:
    seg = Segmenter()
    assert seg.push("Okay,", 1.0) == []
    assert seg.poll(1.0 + WAIT_S * 0.5) == []
    out = seg.poll(1.0 + WAIT_S * 1.01)
    assert [(s.text, s.reason) for s in out] == [("Okay,", "timeout")]


def test_timeout_keeps_a_possibly_unfinished_last_word() -> None:
    seg = Segmenter()
    seg.push("Okay, let me check", 0.0)
    out = seg.poll(1.0)
    assert [(s.text, s.reason) for s in out] == [("Okay, let me", "timeout")]
    assert seg.pending_text == "check"
    out = seg.push("ing that. Sure thing.", 1.1)
    assert seg.end(1.2)[-1].text == "checking that. Sure thing."


@pytest.mark.parametrize(
    ("first", "rest", "cut", "spoken_after"),
    [
        ("It costs $1,", "234 today.", "It costs", "$1,234 today."),
        ("We have 12,", "000 users.", "We have", "12,000 users."),
        ("Pi is about 3.", "14 or so.", "Pi is about", "3.14 or so."),
        ("We meet at 9:", "30 tomorrow.", "We meet at", "9:30 tomorrow."),
        ("Call +1 415", " 555 0100 now.", "Call", "+1 415 555 0100 now."),  # digit groups: one number
        ("Call us at (415)", " 555-0100 now.", "Call us at", "(415) 555-0100 now."),  # an area code
        ("Your appointment is with Dr.", " Patel today.", "Your appointment is with", "Dr. Patel today."),
    ],
)
def test_timeout_does_not_split_a_number_at_its_separator(
    first: str, rest: str, cut: str, spoken_after: str
) -> None:
    """An LLM pause after "$1," must not say "one dollar" then "two hundred thirty-four"."""
    seg = Segmenter()
    seg.push(first, 0.0)
    out = seg.poll(1.0)
    assert [(s.text, s.reason) for s in out] == [(cut, "timeout")]
    seg.push(rest, 1.1)
    assert [s.text for s in seg.end(1.2)] == [spoken_after]


def test_timeout_cuts_after_a_number_that_ends_a_clause() -> None:
    seg = Segmenter()
    seg.push("It costs $12, ", 0.0)
    out = seg.poll(1.0)
    assert [(s.text, s.reason) for s in out] == [("It costs $12,", "timeout")]


def test_timeout_needs_a_complete_word() -> None:
    seg = Segmenter()
    seg.push("Hmm", 0.0)
    assert seg.poll(5.0) == []


def test_push_after_a_long_gap_applies_the_timeout_first() -> None:
    seg = Segmenter()
    seg.push("Okay, ", 0.0)
    out = seg.push("so", 1.0)
    assert [(s.text, s.reason) for s in out] == [("Okay,", "timeout")]


def test_no_timeout_after_the_first_segment() -> None:
    seg = Segmenter()
    seg.push("Hi there. How are you doing", 0.0)
    assert seg.poll(10.0) == []


def test_flush_forces_pending_text_and_keeps_trailing_whitespace_pending() -> None:
    seg = Segmenter()
    assert texts(seg.push("Hi there. How are you ", 0.0)) == ["Hi there."]
    out = seg.flush(0.0)
    assert [(s.text, s.reason, s.end_char) for s in out] == [("How are you", "flush", 21)]
    assert seg.flush(0.0) == []
    out = seg.push("today?", 0.0) + seg.end(0.0)
    assert [(s.text, s.start_char) for s in out] == [("today?", 21)]


def test_end_closes() -> None:
    seg = Segmenter()
    seg.push("Hello", 0.0)
    assert texts(seg.end(0.0)) == ["Hello"]
    assert seg.end(0.0) == [] and seg.flush(0.0) == [] and seg.poll(9.0) == []
    with pytest.raises(ValueError):
        seg.push("more", 0.0)


def test_empty_context() -> None:
    seg = Segmenter()
    assert seg.push("", 0.0) == [] and seg.end(0.0) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"first_min_words": 0}, "first_min_words"),
        ({"first_min_words": 5, "first_max_words": 4}, "first_max_words"),
        ({"first_wait_ms": -1.0}, "first_wait_ms"),
        ({"max_chars": MIN_MAX_CHARS - 1}, "max_chars"),
        ({"min_chars": 300}, "min_chars"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Segmenter(**kwargs)  # type: ignore[arg-type]


# ---- properties --------------------------------------------------------------------------------------

FRAGMENTS = [
    "Hello", "world", "I", "can", "help", "you", "today", "with", "that", "the", "big", "fantastic",
    "3.14", "1,000", "Mr.", "Dr.", "U.S.", "e.g.", "etc.", "don't", "https://ex.com/a?b=c", "naïve",
    "cafe\u0301", "Привет", "你好", "我是", "谢谢", "こんにちは", "안녕하세요", "مرحبا", "हिंदी",
    "😀", "👨\u200d👩\u200d👧", "🇫🇷", "👍🏽", "x" * 30,
    ",", ".", "!", "?", ";", ":", "—", "…", "...", "。", "，", "！", "、", '"', "'", "(", ")", "「", "」",
    "-", "1.", "\u200b",
    " ", " ", " ", " ", "  ", "\t", "\n", "\n\n", "\u00a0", "\u3000", " " * 20,
]  # fmt: skip

fragment_texts = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)
any_texts = st.one_of(fragment_texts, fragment_texts, st.text(max_size=120))
configs = st.fixed_dictionaries(
    {
        "max_chars": st.integers(MIN_MAX_CHARS, 80),
        "min_chars": st.integers(0, MIN_MAX_CHARS),
        "first_min_words": st.integers(1, 4),
        "first_max_words": st.integers(4, 8),
    }
)
PROPERTY_SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def check_invariants(segments: list[Segment], text: str, max_chars: int, *, timed: bool = False) -> None:
    # (a) the ranges tile the input
    pos = 0
    for i, s in enumerate(segments):
        assert s.index == i
        assert s.start_char == pos < s.end_char
        assert s.reason in REASONS
        pos = s.end_char
    assert pos == len(text)
    merged_words: list[str] = []
    for prev, s in zip([None, *segments], segments, strict=False):
        raw = text[s.start_char : s.end_char]
        # (b) the text is the range, whitespace-normalised; silent ranges have nothing to say
        if s.speakable:
            assert s.text == " ".join(raw.split())
        else:
            assert not any(ch.isalnum() for ch in raw)
        # (c) never longer than max_chars (weighted; no slack)
        assert weighted_len(s.text) <= max_chars
        words = raw.split()
        x = s.start_char
        if prev is not None and words and not raw[0].isspace() and merged_words:
            check_mid_token_boundary(prev, text, x, timed=timed)
            merged_words[-1] += words.pop(0)
        merged_words += words
    # (b) the words, put back together across mid-token boundaries, are the input's words
    assert merged_words == text.split()


def check_mid_token_boundary(prev: Segment, text: str, x: int, *, timed: bool) -> None:
    """A boundary with no whitespace on either side: only around CJK, or a hard cut, or a timeout."""
    left, right = text[x - 1], text[x]
    if is_cjk(left) and is_cjk(right):
        return
    after_cjk_punct = any(ch in CJK_PUNCT for ch in text[prev.start_char : x]) or is_cjk(right)
    if not left.isalnum() and after_cjk_punct:
        return
    if timed and prev.reason == "flush":
        return  # the client asked for it, mid-word or not
    if timed and prev.reason == "timeout":
        assert not (left.isalnum() and right.isalnum()) or is_cjk(left) or is_cjk(right)
        return
    assert prev.reason == "max_chars", f"word split at {x} by a {prev.reason!r} cut"
    first_alnum = next((i for i, ch in enumerate(prev.text) if ch.isalnum()), len(prev.text))
    assert " " not in prev.text[first_alnum:], "hard cut although whitespace was available"


@PROPERTY_SETTINGS
@given(text=any_texts, data=st.data(), config=configs)
def test_property_tiles_words_lengths(text: str, data: st.DataObject, config: dict[str, int]) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    out = feed(split_at(text, cuts), Segmenter(**config))
    check_invariants(out, text, config["max_chars"])


@PROPERTY_SETTINGS
@given(text=any_texts, data=st.data(), config=configs)
def test_property_piece_sizes_do_not_matter(text: str, data: st.DataObject, config: dict[str, int]) -> None:
    def run(pieces: list[str], flush_first: bool) -> list[tuple[str, int, int, str]]:
        seg = Segmenter(**config)
        out = feed(pieces, seg, end=False)
        if flush_first:
            out += seg.flush(0.0)
        out += seg.end(0.0)
        return [(s.text, s.start_char, s.end_char, s.reason) for s in out]

    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    whole = run([text], False)
    assert run(split_at(text, cuts), False) == whole
    assert run(list(text), False) == whole
    assert run(split_at(text, cuts), True) == run([text], True)


@PROPERTY_SETTINGS
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(FRAGMENTS), st.floats(0.0, 0.4), st.booleans(), st.booleans()), max_size=40
    ),
    config=configs,
)
def test_property_with_time_polls_and_flushes(
    steps: list[tuple[str, float, bool, bool]], config: dict[str, int]
) -> None:
    make = Segmenter(**config)
    now_s = 0.0
    out: list[Segment] = []
    for piece, gap_s, poll, flush in steps:
        now_s += gap_s
        if poll:
            out += make.poll(now_s)
        out += make.push(piece, now_s)
        if flush and poll:
            out += make.flush(now_s)
    out += make.end(now_s)
    check_invariants(out, "".join(p for p, *_ in steps), config["max_chars"], timed=True)
