"""agent_server/text/normalize/: numbers, money, times and dates said as words, in the languages num2words speaks,
with the spans that put the times measured on the spoken text back on the written characters; and through the
speech stream: the engine is given the spoken form, the client's alignment is on what it sent."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_server.core.events import SegmentDone, StreamSpec
from agent_server.core.stream import SpeechStream, char_alignment
from agent_server.text.normalize import spoken_form
from agent_server.text.segmenter import Segmenter, weighted_len
from synth.api import EventKind, SamplingParams

from tests.agent_server.core.test_stream import PCM24, ManualEngine, Recorder, sync_post

ENGLISH = [
    ("It costs $4.50 today.", "It costs four dollars and fifty cents today."),
    ("That's $1,234,567.89", "That's one million two hundred thirty-four thousand five hundred sixty-seven dollars"
                             " and eighty-nine cents"),
    ("$0.99 or $1 or $2.5", "ninety-nine cents or one dollar or two point five dollars"),
    ("$5 million, $3bn", "five million dollars, three billion dollars"),
    ("€20 or 20 € or £3.50 or ¥1500", "twenty euros or twenty euros or three pounds and fifty pence or one thousand"
                                      " five hundred yen"),
    ("Call 555-123-4567 or +1 415 555 0100.", "Call five five five, one two three, four five six seven or plus one,"
                                              " four one five, five five five, zero one zero zero."),
    ("At 9:30 pm, 14:00, 9:05am, 7:00 or 1:02:03", "At nine thirty p m, fourteen hundred, nine oh five a m, seven"
                                                   " o'clock or one two three"),
    ("Come at 10:15 p.m.", "Come at ten fifteen p m."),  # the sentence keeps its full stop
    ("a 16:9 screen, won 3:2, odds of 12:1; 1.5:2", "a sixteen to nine screen, won three to two, odds of twelve to"
                                                    " one; one point five:two"),
    ("On 2024-05-01 in 1999", "On May first, twenty twenty-four in nineteen ninety-nine"),
    ("about 12.5% of 3.14, -5% and -5", "about twelve point five percent of three point one four, minus five"
                                        " percent and minus five"),
    ("the 21st, 3rd and 11th; 3th", "the twenty-first, third and eleventh; three th"),
    ("order 00731, id 1234567890123456789", "order zero zero seven three one, id one two three four five six seven"
                                            " eight nine zero one two three four five six seven eight nine"),
    ("10-20 minutes, 2023-2024, a 10-5 win", "ten to twenty minutes, twenty twenty-three to twenty twenty-four, a"
                                             " ten to five win"),  # a score too: "ten to five"
    ("A17, mp3, 5km, COVID-19", "A seventeen, mp three, five kilometers, COVID-nineteen"),
    ("Tom & Jerry; v2.4.1 at 192.168.1.1", "Tom and Jerry; v two point four point one at one nine two dot one six"
                                           " eight dot one dot one"),
    ("1,5 is not a number in English; 1,234 is", "1,5 is not a number in English; one thousand two hundred"
                                                 " thirty-four is"),
    ("72°F, -5 °C, 1 km at 10 km/h, 16 GB, 300 ms, 5 in", "seventy-two degrees Fahrenheit, minus five degrees Celsius,"
                                                        " one kilometer at ten kilometers per hour, sixteen gigabytes,"
                                                        " three hundred milliseconds, five in"),
    ("No digits here.", "No digits here."),
    # dates written otherwise, clock hours, signs
    ("on 12/25/2025, 25/12/25, 1/2/99; 2/30/2024", "on December twenty-fifth, twenty twenty-five, December"
                                                   " twenty-fifth, twenty twenty-five, January second, nineteen"
                                                   " ninety-nine; two/thirty/twenty twenty-four"),
    ("Dec 25, 2025, Sept. 3 and May 1st; 25 December 2025, 3rd of March", "December twenty-fifth, twenty"
     " twenty-five, September third and May first; the twenty-fifth of December, twenty twenty-five, the third of"
     " March"),
    ("at 3pm, 11 a.m. or 3 p.m. Then", "at three p m, eleven a m or three p m. Then"),
    ("#5, No. 7, ~5 min, 5*3 and 4 × 2", "number five, number seven, about five minutes, five times three and four"
                                        " times two"),
    # addresses: the scheme and the query are not read
    ("Mail bob.smith42@example.com or see https://docs.example.org/get-started?utm=x. Or www.example.com, x.ai/a_b/",
     "Mail bob dot smith four two at example dot com or see docs dot example dot org slash get dash started. Or w w w"
     " dot example dot com, x dot ai slash a underscore b"),
    ("Node.js, file.txt, e.g and a.b", "Node.js, file.txt, e.g and a.b"),  # no known top-level domain
    # abbreviations
    ("Dr. Smith vs. Mr. Jones, e.g. cats, i.e. pets, etc. Then approx. 3, and so on, etc.", "Doctor Smith versus"
     " Mister Jones, for example cats, that is pets, et cetera. Then approximately three, and so on, et cetera."),
    ("the dr. said", "the dr. said"),  # a title only before a name
    # markdown
    ("**Sure!** Here's *one* and __two__ and `four`.", "Sure! Here's one and two and four."),
    ("Now ~~$50~~ $35 🎉, was ~~old~~", "Now  thirty-five dollars , was "),  # struck-out text and emoji: not said
    ("### Options\n- **Pizza**: $5\n* Tacos\n1. [Our menu](https://x.com/menu) today", "Options\nPizza: five"
                                                                                     " dollars\nTacos\none. Our"
                                                                                     " menu today"),
    ("my_var, _it_, __init__ and a**b", "my_var, it, init and a b"),
    # phone numbers as Americans write them, decades, fractions and a month/day without a year
    ("Call +1 (415) 555-0100, (555) 123-4567, 1-800-FLOWERS or 911.", "Call plus one, four one five, five five five,"
     " zero one zero zero, five five five, one two three, four five six seven, one eight hundred FLOWERS or nine"
     " one one."),
    ("the 1990s, the '80s, the mid-60s, in her 20s, the 2000s; wait 30s", "the nineteen nineties, the eighties, the"
     " mid-sixties, in her twenties, the two thousands; wait thirty s"),
    ("3/4 cup, 1/2, 5/8, due 12/25, 9/11, 24/7, 13/40", "three quarters cup, one half, five eighths, due December"
     " twenty-fifth, September eleventh, twenty-four seven, thirteen forty"),
    ("see http://localhost:8000/v1?x=1 now", "see localhost colon eight zero zero zero slash v one now"),
    # identifiers after their word, codes: character by character (found reading an agent corpus)
    ("Your OTP is 482913. Order #123456789. Card ending in 1234. PIN: 1234. I have 2 orders.", "Your OTP is four"
     " eight two nine one three. Order number one two three four five six seven eight nine. Card ending in one two"
     " three four. PIN: one two three four. I have two orders."),
    ("Code ABC123, ref QW4E7R, #A-1234, INV-2024-0042, DC 20500; A17, COVID-19, H100", "Code A B C one two three,"
     " ref Q W four E seven R, number A, one two three four, I N V, two zero two four, zero zero four two, DC two zero"
     " five zero zero; A seventeen, COVID-nineteen, H one hundred"),
    ("order 100 units in case 200 people come; I-95, SHA-256; in St. Louis", "order one hundred units in case two"
     " hundred people come; I-ninety-five, SHA-two hundred fifty-six; in Saint Louis"),  # quantities stay quantities
    # ranges: hours, days, money, percent, units, dates
    ("9am-5pm, 9:30-10:30, 12-2pm, 9-5, Mon-Fri, M-F", "nine a m to five p m, nine thirty to ten thirty, twelve to"
     " two p m, nine to five, Monday through Friday, Monday through Friday"),
    ("$10-$15, $20-30, 15-20%, 10-15 min, 70-75°F, Dec 20-23", "ten to fifteen dollars, twenty to thirty dollars,"
     " fifteen to twenty percent, ten to fifteen minutes, seventy to seventy-five degrees Fahrenheit, December"
     " twentieth to twenty-third"),
    ("$14.99/mo, $25/night; arrive 15 min. early; on the 15th of March", "fourteen dollars and ninety-nine cents per"
     " month, twenty-five dollars per night; arrive fifteen minutes early; on the fifteenth of March"),
    ("Rated 4.5/5, pain level 3/10, BP 120/80, 1 1/2 cups, ½ cup, expiry 09/2028", "Rated four point five out of"
     " five, pain level three out of ten, BP one twenty over eighty, one and a half cups, one half cup, expiry"
     " September twenty twenty-eight"),
    ("123 Main St., Apt 4B; Mr. and Mrs. Jones; 9x13, 2x faster, 7.30pm, *67, 2 + 2 = 4", "one hundred twenty-three"
     " Main Street, Apartment four B; Mister and Missus Jones; nine by thirteen, two times faster, seven thirty p m,"
     " star sixty-seven, two plus two equals four"),
    ("₹2,500, USD 20, 50¢, -$5.00, ~$20, about ~5", "two thousand five hundred rupees, twenty dollars, fifty cents,"
     " minus five dollars, about twenty dollars, about five"),
    ("+44 7700 900123, (02) 9876 5432", "plus four four, seven seven zero zero, nine zero zero one two three, zero"
     " two, nine eight seven six, five four three two"),
    ("steps: - Unplug it. - Wait. ## Tips • Call us", "steps: Unplug it. Wait. Tips Call us"),  # lines joined
    # a link cut in two by the segmenter; brackets that are no link
    ("see [our", "see our"), ("site](https://x.com/menu).", "site."), ("see [1] and (2)", "see [one] and (two)"),
]


@pytest.mark.parametrize(("written", "said"), ENGLISH)
def test_english(written: str, said: str) -> None:
    assert spoken_form(written).text == said
    assert spoken_form(written, "en").text == said


@pytest.mark.parametrize(("language", "written", "said"), [
    ("de", "4,50 €, 1.234 Stück, 12,5 %", "vier Euro und fünfzig Cent, eintausendzweihundertvierunddreißig Stück,"
                                          " zwölf Komma fünf Prozent"),
    ("fr", "3,5 %, 21 h", "trois virgule cinq pour cent, vingt et une heures"),
    ("ru", "25470 рублей", "двадцать пять тысяч четыреста семьдесят рублей"),  # chatterbox#284: skipped as digits
    ("tr", "%7 ve 7%", "%yedi ve yüzde yedi"),
    ("ja", "25470円", "二万五千四百七十円"),  # no space between CJK and a number's words
    ("ar", "3.5 و 25", "3.5 و خمسة و عشرون"),  # num2words reads Arabic decimals wrong: left as written
    # no reading of times, dates, phone numbers, versions, temperatures here: as written, not number by number
    ("de", "am 2024-05-01 um 9:30 Uhr, 14:00, Format 16:9", "am 2024-05-01 um 9:30 Uhr, 14:00, Format 16:9"),
    ("fr", "le 01/05/2024, au +33 1 23 45 67 89, version 1.2.3", "le 01/05/2024, au +33 1 23 45 67 89, version 1.2.3"),
    ("de", "72°F, -3,5 °C, am 1.5.24 und 3 Katzen", "72°F, -3,5 °C, am 1.5.24 und drei Katzen"),
    ("it", "alle 18:00 e 25 euro", "alle 18:00 e venticinque euro"),
    # markdown in every language; English's readings (addresses, dates, "#") are not another language's
    ("es", "**Hola**, ve [aquí](https://x.es/a) o a x.com el 12/25/2025 #5", "Hola, ve aquí o a x.com el"
                                                                             " 12/25/2025 #cinco"),
    ("zh", "**你好** `3`", "你好 3"),
    # grouping spaces; a whole amount has no "zero cents"
    ("fr", "1 500 euros, 2 345,67 €", "mille cinq cents euros, deux mille trois cent quarante-cinq euros et"
                                       " soixante-sept centimes"),
    ("de", "Das kostet 20 € und 1 €.", "Das kostet zwanzig Euro und ein Euro."),
    # a language's own ordinals, clock times, ranges and years
    ("de", "Am 1. Januar 1985 war der 3. Anrufer da; Montag, 1. Mai; 3-5 Werktage; wir haben 3. Das", "Am ersten"
     " Januar neunzehnhundertfünfundachtzig war der dritte Anrufer da; Montag, erster Mai; drei bis fünf Werktage;"
     " wir haben drei. Das"),
    ("fr", "Le 1er janvier, la 1re fois, le 21e siècle, à 14h30, de 9h à 17h, 1h, 3-5 jours", "Le premier janvier,"
     " la première fois, le vingt et unième siècle, à quatorze heures trente, de neuf heures à dix-sept heures, une"
     " heure, trois à cinq jours"),
    ("es", "el 1.º piso, la 2.ª vez, el 3.er día, 3-5 días", "el primer piso, la segunda vez, el tercer día, tres a"
     " cinco días"),
    ("es", "Cuesta $20.", "Cuesta veinte dólares."),
])
def test_other_languages(language: str, written: str, said: str) -> None:
    assert spoken_form(written, language).text == said


def test_languages_without_number_words_are_left_as_written() -> None:
    for language in ("zh", "hi", "el", "ms", "sw"):
        assert spoken_form("It is 25470.", language).text == "It is 25470."
    assert spoken_form("7", "pt").text == "sete" and spoken_form("7", "pt-BR").text == "sete"


PIECES = st.sampled_from(["$4.50", "12.5%", "5 km", "72°F", "9:30 pm", "21st", "555-123-4567", "1999", "A17", "&",
                          "10-20", "word", "x", "3.14", "€20", "-5", " ", "  ", ", ", ". ", "007", "1,234", "日本",
                          "**", "`", "_", "\n- ", "\n# ", "[a link](https://x.com)", "bob@x.com", "x.io/a",
                          "12/25/2025", "Dec 5", "3pm", "e.g.", "Dr. X"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.sampled_from(["en", "de", "ja", "zh"]))
def test_spans_tile_both_texts_and_put_times_on_every_written_character(pieces: list[str], language: str) -> None:
    written = "".join(pieces)
    spoken = spoken_form(written, language)
    assert spoken.written == written
    # between rewrites the texts are the same
    w = s = 0
    for span in spoken.rewrites:
        assert written[w:span.written_start] == spoken.text[s:span.spoken_start]
        assert span.written_end > span.written_start and span.spoken_end >= span.spoken_start
        w, s = span.written_end, span.spoken_end
    assert written[w:] == spoken.text[s:]
    starts, durations = spoken.written_times(*char_alignment(spoken.text, 100.0, 2_000.0))
    assert len(starts) == len(durations) == len(written)
    ends = [a + d for a, d in zip(starts, durations, strict=True)]
    assert all(d >= 0 for d in durations)
    assert all(b >= a for a, b in pairwise(starts))  # in order
    assert all(e <= b for e, b in zip(ends, starts[1:], strict=False))  # no overlap, no gap jumped back
    if spoken.text:  # (only marks: nothing to say, a segment the engine never gets)
        assert starts[0] == 100 and ends[-1] == 2_100  # the whole segment, start to end


def test_a_rewritten_span_takes_the_time_of_its_words() -> None:
    spoken = spoken_form("Pay $4.50 now")
    char_starts, char_durations = char_alignment(spoken.text, 0.0, 3_000.0)
    starts, durations = spoken.written_times(char_starts, char_durations)
    said_from = spoken.text.index("four")
    said_to = spoken.text.index(" now")
    assert starts[4] == char_starts[said_from]  # "$" starts where "four" does
    assert starts[8] + durations[8] == char_starts[said_to - 1] + char_durations[said_to - 1]  # "0" ends with "cents"
    assert starts[:4] == char_starts[:4] and starts[-3:] == char_starts[-3:]  # the kept text keeps its times


def test_digits_weigh_in_the_segmenter_as_the_words_they_become() -> None:
    assert weighted_len("1999") == 16 and weighted_len("abcd") == 4
    segmenter = Segmenter(max_chars=60, min_chars=20)
    text = "Your code is 1234 5678 9012 3456 and the total is 99. Thanks"
    cut = [seg.text for seg in segmenter.push(text, 0.0)] + [seg.text for seg in segmenter.end(0.0)]
    assert all(weighted_len(seg) <= 60 for seg in cut)
    assert "".join(cut).replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("normalize", [True, False])
def test_the_engine_hears_the_words_and_the_client_gets_times_on_its_text(normalize: bool) -> None:
    engine = ManualEngine()
    recorder = Recorder()
    spec = StreamSpec(voice_id="default", params=SamplingParams(seed=1), output_format=PCM24, normalize=normalize)
    stream = SpeechStream("s1/1", spec, engine=engine, segmenter=Segmenter(), post=sync_post, emit=recorder)
    stream.open()
    stream.push_text("Total: $4.50 at 9:30 pm.", 0.0)
    stream.end(0.0)
    said = "Total: four dollars and fifty cents at nine thirty p m."
    assert [r.text for r in engine.submitted] == [said if normalize else "Total: $4.50 at 9:30 pm."]
    engine.chunk(0, 50)
    engine.event(0, EventKind.GENERATED)
    engine.event(0, EventKind.DONE)
    [done] = recorder.of(SegmentDone)
    assert done.text == "Total: $4.50 at 9:30 pm."  # what the client sent, character for character
    assert len(done.char_start_ms) == len(done.char_duration_ms) == len(done.text)
    dollar, pm = done.text.index("$"), done.text.index("pm")
    share = (len("four dollars and fifty cents") / len(said)) if normalize else 5 / len(done.text)
    span_ms = done.char_start_ms[dollar + 4] + done.char_duration_ms[dollar + 4] - done.char_start_ms[dollar]
    assert span_ms == pytest.approx(share * done.audio_ms, rel=0.15)
    assert done.char_start_ms[pm] > done.char_start_ms[dollar]


def test_an_llm_s_markdown_streamed_token_by_token_is_not_said() -> None:
    """Marks split over the pieces an LLM streams, and over segments: the engine gets the words alone, the client
    gets every character it sent back in the alignment, the marks with no time."""
    engine = ManualEngine()
    recorder = Recorder()
    spec = StreamSpec(voice_id="default", params=SamplingParams(seed=1), output_format=PCM24)
    stream = SpeechStream("s1/1", spec, engine=engine, segmenter=Segmenter(max_chars=40, min_chars=10),
                          post=sync_post, emit=recorder)
    stream.open()
    pieces = ["**", "Sure", "!**", " Here", " are", " the", " options", ":\n", "- ", "*", "Pizza", "*", " at", " [our",
              " site", "](https://x.com/", "menu", ")", "\n", "- ", "`Tacos`", " on", " 12", "/25", "/2025."]
    for piece in pieces:
        stream.push_text(piece, 0.0)
    stream.end(0.0)
    made = 0
    while made < len(engine.submitted):  # each segment is submitted once the one before it is generated
        engine.chunk(made, 50)
        engine.event(made, EventKind.GENERATED)
        engine.event(made, EventKind.DONE)
        made += 1
    said = " ".join(r.text for r in engine.submitted)
    assert not set("*`[]()#/") & set(said), said
    words = "Sure! Here are the options: Pizza at our site Tacos on December twenty-fifth, twenty twenty-five."
    assert said.split() == words.split(" ")
    done = recorder.of(SegmentDone)
    assert "".join(d.text for d in done).replace(" ", "").replace("\n", "") == "".join(pieces).replace(
        " ", "").replace("\n", "")
    for d in done:
        assert len(d.char_start_ms) == len(d.char_duration_ms) == len(d.text)
        for i, char in enumerate(d.text):
            if char in "*`" or "](" in d.text[:i + 2]:  # a mark, a link's address: not said
                assert d.char_duration_ms[i] == 0, (d.text, i)
            elif char.isalpha():
                assert d.char_duration_ms[i] > 0, (d.text, i)
