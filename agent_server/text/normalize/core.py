"""The shared core of text normalisation: the spoken text and the spans that map it back onto the written one,
the languages it knows, the rule engine (`Rewrites`: at each place the earliest match a rule can say), and the
markdown every language drops."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import InvalidOperation

import numpy as np
from num2words import CONVERTER_CLASSES


@dataclass(frozen=True, slots=True)
class LanguageRules:
    decimal_mark: str  # how the language writes 3.14
    percent: str  # how "7%" is said, the number's words in place of {}
    currency: bool  # num2words' to="currency" is right for $ € £ in this language
    decimals: bool = True  # num2words reads a Decimal right in this language


# Languages num2words speaks and what they write; English has its own rules (en.py) on top.
LANGUAGES: dict[str, LanguageRules] = {
    "en": LanguageRules(".", "{} percent", True),
    "de": LanguageRules(",", "{} Prozent", True),
    "fr": LanguageRules(",", "{} pour cent", True),
    "es": LanguageRules(",", "{} por ciento", True),
    "it": LanguageRules(",", "{} per cento", True, decimals=False),  # num2words: 3,5 is "three"
    "pt": LanguageRules(",", "{} por cento", True),
    "nl": LanguageRules(",", "{} procent", True),
    "pl": LanguageRules(",", "{} procent", True),
    "fi": LanguageRules(",", "{} prosenttia", True),
    "ru": LanguageRules(",", "{} процентов", True),
    "he": LanguageRules(".", "{} אחוז", True),
    "sv": LanguageRules(",", "{} procent", False),
    "da": LanguageRules(",", "{} procent", False),
    "no": LanguageRules(",", "{} prosent", False),
    "tr": LanguageRules(",", "yüzde {}", False, decimals=False),  # num2words: 3,5 is "three fifty"
    "ar": LanguageRules(".", "{} بالمئة", False, decimals=False),  # num2words: riyals for any currency, 3.5 wrong
    "ja": LanguageRules(".", "{} パーセント", False),
    "ko": LanguageRules(".", "{} 퍼센트", False),
}


@dataclass(frozen=True, slots=True)
class Span:
    """written[written_start:written_end] is said as spoken[spoken_start:spoken_end]."""

    written_start: int
    written_end: int
    spoken_start: int
    spoken_end: int


@dataclass(frozen=True, slots=True)
class Spoken:
    written: str
    text: str  # what the engine is given
    # the rewritten spans, in order; each has written characters (a dropped markdown mark: no spoken ones);
    # between them the texts are the same
    rewrites: tuple[Span, ...]

    def written_times(self, starts_ms: Sequence[int], durations_ms: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per-character (start, duration) of the spoken text -> the same for the written text: a kept
        character keeps its time; a rewritten span's time (from its first spoken character's start to its last
        one's end) is shared out equally over its written characters; a dropped mark's characters take no time,
        at the place where the spoken text goes on."""
        if not self.rewrites:
            return list(starts_ms), list(durations_ms)
        spoken_starts = np.asarray(starts_ms, dtype=np.int64)
        spoken_ends = spoken_starts + np.asarray(durations_ms, dtype=np.int64)
        starts = np.zeros(len(self.written), dtype=np.int64)
        ends = np.zeros(len(self.written), dtype=np.int64)
        written_at = spoken_at = 0
        for span in (*self.rewrites, Span(len(self.written), len(self.written), len(self.text), len(self.text))):
            kept = span.written_start - written_at  # == span.spoken_start - spoken_at
            starts[written_at:span.written_start] = spoken_starts[spoken_at:span.spoken_start]
            ends[written_at:span.written_start] = spoken_ends[spoken_at:span.spoken_start]
            written_at, spoken_at = written_at + kept, spoken_at + kept
            n = span.written_end - span.written_start
            if n and span.spoken_end == span.spoken_start:  # a mark said as nothing: no time, where the text goes on
                at_ms = (spoken_starts[span.spoken_start] if span.spoken_start < len(self.text)
                         else spoken_ends[-1] if len(self.text) else 0)
                starts[span.written_start:span.written_end] = at_ms
                ends[span.written_start:span.written_end] = at_ms
            elif n:  # (the sentinel after the last rewrite has none)
                begin_ms, end_ms = spoken_starts[span.spoken_start], spoken_ends[span.spoken_end - 1]
                edges = np.rint(np.linspace(begin_ms, end_ms, n + 1)).astype(np.int64)
                starts[span.written_start:span.written_end] = edges[:-1]
                ends[span.written_start:span.written_end] = edges[1:]
            written_at, spoken_at = span.written_end, span.spoken_end
        return starts.tolist(), (ends - starts).tolist()


def unchanged(text: str) -> Spoken:
    return Spoken(text, text, ())


def is_spaced(char: str) -> bool:
    """A letter a number's words must not be glued to ("A17" -> "A seventeen"); CJK scripts use no spaces."""
    return char.isalnum() and ord(char) < 0x2E80


Reader = Callable[[re.Match[str], str, LanguageRules], str | None]
# markdown (every language): at one place these come first
RULES_MARKDOWN: tuple[tuple[str, str], ...] = (
    # a link "[text](url)": its "[" (where its "](url)" follows, or no "]" does: a link the segmenter cut in
    # two) and its "](url)" are not said, its text is read as any text
    ("md_link_open", r"\[(?=[^\[\]\n]{1,300}\]\([^()\s]{1,2000}\)|[^\[\]]*$)"),
    ("md_link_close", r"\]\([^()\s]{1,2000}\)"),
    ("md_heading", r"(?m)^[ \t]{0,3}#{1,6}[ \t]+"),
    ("md_bullet", r"(?m)^[ \t]*[-+*•][ \t]+"),
    # the segmenter joins a list's lines: a bullet after a line's end punctuation, "•" and "##" anywhere
    ("md_bullet_joined", r"(?<=[.!?:;,)][ \t])[-+*•][ \t]+(?=\S)|(?<=\s)•[ \t]*|(?<!\S)#{2,6}[ \t]+(?=\S)"),
    ("md_strike", r"~~[^~\n]{1,300}~~"),  # struck-out text is not said: "~~$50~~ $35"
    ("md_mark", r"\*{1,3}|_{2,3}|~~|`{1,3}|(?<![\w\\])_(?=\w)|(?<=\w)_(?![\w])"),
    ("emoji", "[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\uFE0F\u200D]+"),  # pictographs: not said
)
# a language num2words does not speak: its markdown only (the readers of which need no LanguageRules)
MARKDOWN_ONLY = LanguageRules(".", "{}", False)
# a text with none of these no rule can match (a short plain sentence costs one scan)
MAYBE_READ = re.compile(r"[\d&@*×_~`#\[/.\-+•$€£¥₹¢%°:½⅓⅔¼¾⅛⅜⅝⅞]|\bvs\b"
                        "|[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF]")


class Rewrites:
    """The rewrites of one text, left to right: at each place the earliest match a rule can say; at one place the
    earlier rule wins. A rule that matches but cannot say it (a month 13, an ordinal "3th") leaves the place to
    the rules after it. Each rule's next sayable match is kept until the text before it is consumed, so a text
    is searched about once per rule, not once per rule per rewrite."""

    def __init__(self, text: str, lang: str, language: LanguageRules,
                 rules: Sequence[tuple[re.Pattern[str], Reader]]) -> None:
        self.text, self.lang, self.language = text, lang, language
        self.rules = rules
        self._next: list[tuple[re.Match[str], str] | None] = [None] * len(self.rules)
        self._searched = [False] * len(self.rules)

    def after(self, pos: int) -> tuple[re.Match[str], str] | None:
        best: tuple[re.Match[str], str] | None = None
        for i, (pattern, reader) in enumerate(self.rules):
            found = self._next[i]
            if not self._searched[i] or (found is not None and found[0].start() < pos):
                found = self._next[i] = self._first_sayable(pattern, reader, pos)
                self._searched[i] = True
            if found is not None and (best is None or found[0].start() < best[0].start()):
                best = found
        return best

    def _first_sayable(self, pattern: re.Pattern[str], reader: Reader, pos: int) -> tuple[re.Match[str], str] | None:
        match = pattern.search(self.text, pos)
        while match is not None:
            said = say(reader, match, self.lang, self.language)
            if said is not None:
                return match, said
            match = pattern.search(self.text, match.start() + 1)
        return None


def say(reader: Reader, match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    try:
        return reader(match, lang, rules)
    except (NotImplementedError, OverflowError, InvalidOperation, ValueError, TypeError):
        return None  # num2words lacks it for this language: say it as written


def language_code(language: str | None) -> str:
    return (language or "en").lower().split("-")[0]


def read_kept(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return match[0]


def said_as(words: str) -> Reader:
    """A rule whose match is always said the same: a word ("&": and), or nothing (a markdown mark)."""
    def read(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
        return words

    return read


read_dropped = said_as("")


def speak(text: str, lang: str, language: LanguageRules, rules: Sequence[tuple[re.Pattern[str], Reader]]) -> Spoken:
    """`text` with what `rules` (compiled: `compile_rules`) can say written out as words, in `lang`."""
    if not MAYBE_READ.search(text):
        return unchanged(text)
    pieces: list[str] = []
    rewrites: list[Span] = []
    written_at = spoken_len = 0
    pos = 0
    scan = Rewrites(text, lang, language, rules)
    while (found := scan.after(pos)) is not None:
        match, said = found
        pos = match.end()
        if said == match[0]:
            continue  # a rule that keeps what it matched as written (an ISO date outside English)
        before = text[written_at:match.start()]
        spaced_before = match.start() > 0 and is_spaced(text[match.start() - 1])
        spaced_after = match.end() < len(text) and is_spaced(text[match.end()])
        if not said:  # a dropped mark: a space only where it stood between two words ("a**b")
            said = " " if spaced_before and spaced_after else ""
        else:
            said = (" " if spaced_before else "") + said + (" " if spaced_after else "")
            if said.startswith(" ") and (before or (pieces[-1] if pieces else "")).endswith(" "):
                said = said[1:]  # "9x13": the number's words already ended with the space
        pieces.append(before)
        spoken_len += len(before)
        rewrites.append(Span(match.start(), match.end(), spoken_len, spoken_len + len(said)))
        pieces.append(said)
        spoken_len += len(said)
        written_at = match.end()
    pieces.append(text[written_at:])
    return Spoken(text, "".join(pieces), tuple(rewrites))


def compile_rules(rules: Sequence[tuple[str, str]],
                  readers: Mapping[str, Reader]) -> tuple[tuple[re.Pattern[str], Reader], ...]:
    """Rules (name, pattern) compiled, each with its reader."""
    return tuple((re.compile(body), readers[name]) for name, body in rules)


# the markdown rules' readers: every mark is dropped
READERS: dict[str, Reader] = dict.fromkeys((name for name, _ in RULES_MARKDOWN), read_dropped)

assert set(LANGUAGES) <= set(CONVERTER_CLASSES), "every language with rules is one num2words speaks"
