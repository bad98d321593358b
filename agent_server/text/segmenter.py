"""Text segmenter: an LLM's token stream -> speakable segments, each its own T3 generation.

Pure and synchronous: no I/O, no clock (callers pass `now_s`). One `Segmenter` per context (turn).

When a segment is cut
- First segment of the turn (until one with speech has gone out), as soon as it is speakable:
  a sentence end (any length); a clause break (, ; : — – …, and their CJK forms) once it holds
  `first_min_words` words; a word end once `first_max_words` words are in; or, from `poll`, after
  `first_wait_ms` with no new text (reason "timeout": everything up to the last complete word; a
  word ending in a digit and "," "." or ":" is not complete, "$1," may be "$1,234"; digit groups before a
  held number are held with it, "+1 415" may be "+1 415 555 0100").
- Later segments: at sentence ends (. ! ? … and their CJK, Devanagari, Arabic ... forms, or a line
  break before a non-lowercase start), once the segment holds `min_chars` characters; shorter
  sentences ride along with the next one (fewer, longer generations: better prosody).
- Not sentence ends: "3.14", "example.com" (no space after the dot); "Mr." and other titles; initials
  "U.S." "e.g." "J."; a list marker "1." at a line start; a "." or "…" followed by a lowercase word
  or a digit ("etc. and", "Well... maybe").
- Anything that would run past `max_chars` is split inside the limit at the best break: sentence end,
  then clause break (both only if the piece holds `min_chars`), then whitespace, then between two
  CJK characters, then a hard cut that keeps grapheme clusters (combining marks, ZWJ emoji) whole.
- `flush` forces out what is pending; `end` does too and closes.

Guarantees
- Offsets: `start_char`/`end_char` index the concatenation of everything pushed. The ranges of the
  segments tile it: no character is dropped or duplicated. Whitespace between two segments belongs to
  the later one; `end` extends the last segment it cuts over any trailing whitespace/punctuation.
- `text` is the range with whitespace normalised (tabs, newlines, NBSP, runs -> one space, ends
  stripped), punctuation kept (a trailing comma stays: the reference normaliser would add "." and
  change the intonation).
- A range with nothing to say (no letter or digit: whitespace, punctuation, emoji) gets `text == ""`
  (`speakable` is False): do not synthesise it. Such silent segments only appear for input that has no
  speech to attach them to (a punctuation-only tail after `end`, a window of `max_chars` symbols).
- A word is split only by a hard cut (a `max_chars` window with no whitespace after its first letter).
- Without `poll` timeouts the result does not depend on how the text was cut into pieces: every
  decision waits for the characters it looks at (at most the next word's first letter, or
  `LOOKAHEAD_WS_CHARS` of whitespace), so pushing token by token gives the same segments as pushing
  the whole text at once. `max_chars` is never exceeded (in weighted characters, see below).

Lengths (`max_chars`, `min_chars`) are weighted by how long the characters take to say: a CJK
ideograph or kana counts 3, a Hangul syllable 2, an ASCII digit 4 (said as words: "1999" is "nineteen
ninety-nine"), anything else 1. 250 then means about 15 s of speech in any script, well inside T3's 1000-token
(40 s) cap; 250 raw Chinese characters would not be.
Word counts count a CJK character as half a word.

Defaults and why
- first_min_words=3: "Sure," alone is too short for good prosody; three words (~1 s of speech) are
  enough, and a clause break usually comes within the first few LLM tokens.
- first_max_words=6: about 2 s of speech, ~100 ms of LLM output at typical rates; the engine then has
  those 2 s to get the rest of the sentence ready.
- first_wait_ms=150: LLM streams usually gap 10-50 ms between tokens; a longer silence (tool call,
  slow network) means the text so far is all there is for now.
- max_chars=250 (weighted): ~15 s of speech per generation.
- min_chars=20: merges "Sure." / "OK." with the next sentence after the first segment.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

Reason = Literal["clause", "sentence", "words", "timeout", "max_chars", "flush", "end"]
REASONS: tuple[Reason, ...] = ("clause", "sentence", "words", "timeout", "max_chars", "flush", "end")

DEFAULT_FIRST_MIN_WORDS = 3
DEFAULT_FIRST_MAX_WORDS = 6
DEFAULT_FIRST_WAIT_MS = 150.0
DEFAULT_MAX_CHARS = 250
DEFAULT_MIN_CHARS = 20
MIN_MAX_CHARS = 16  # a window must hold a few characters of any weight

# A whitespace run longer than this settles a pending "." / line-break decision without seeing the
# next word (a long gap is a break); it also bounds how much text a decision ever waits for.
LOOKAHEAD_WS_CHARS = 16

CJK_CHAR_WEIGHT = 3  # ideographs and kana: about 3 Latin characters of speech each
HANGUL_CHAR_WEIGHT = 2
DIGIT_CHAR_WEIGHT = 4  # a digit is said as a word or more ("1999", "$4.50": agent_server/text/normalize/)
CJK_CHARS_PER_WORD = 2
MS_PER_S = 1000.0

# ---- character classes ---------------------------------------------------------------------------

CJK_TERMINALS = "。！？｡"
CJK_CLAUSE_MARKS = "，、；："
DEFINITE_TERMINALS = frozenset("!?‼⁇⁈⁉؟।॥۔።။։\u037e" + CJK_TERMINALS)  # always end a sentence
PERIODS = frozenset(".…")  # end a sentence unless the context says otherwise
TERMINALS = DEFINITE_TERMINALS | PERIODS
CLAUSE_MARKS = frozenset(",;:—–،؛" + CJK_CLAUSE_MARKS)
CJK_PUNCT = frozenset(CJK_TERMINALS + CJK_CLAUSE_MARKS)
CLOSERS = frozenset("\"'”’»)]}」』）】〉》›*`")
OPENERS = "\"'“‘«([{「『（【〈《‹¿¡*`"
DASH_TOKENS = frozenset({"-", "--", "—", "–"})
LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
NUMBER_SEPARATORS = frozenset(".,:")  # inside a number when a digit follows: "1,234" "3.5" "9:30"
# Straight quotes may open as well as close, so they do not make a word end safe for a timeout cut.
TIMEOUT_SAFE_ENDS = (TERMINALS | CLAUSE_MARKS | CLOSERS) - frozenset("\"'")

# Titles and other abbreviations whose "." never ends a sentence ("Mr. Smith", "Fig. 3").
TITLE_ABBREVIATIONS = frozenset(
    ["mr", "mrs", "ms", "mx", "dr", "prof", "st", "sr", "jr", "rev", "hon", "gen", "gov", "sen", "rep", "pres",
     "col", "capt", "cmdr", "lt", "sgt", "maj", "adm", "mt", "ft", "vs", "fig", "figs", "eq", "approx", "cf",
     "viz", "dept"]
)

# Abbreviations whose "." ends no sentence when they are capitalised ("Oak Ave. Suite 200", "Acme Inc. and",
# "Mon. to Fri.", "Dec. 5"); lower-case, most are words ("the sun.", "a co."), and do end one.
CAPITALISED_ABBREVIATIONS = frozenset(
    ["Ave", "Blvd", "Rd", "Ln", "Ct", "Hwy", "Pkwy", "Apt", "Ste", "Bldg", "Inc", "Ltd", "Co", "Corp", "Bros", "Est",
     "Ext", "Mon", "Tue", "Tues", "Wed", "Thu", "Thur", "Thurs", "Fri", "Sat", "Sun", "Jan", "Feb", "Mar", "Apr",
     "Jun", "Jul", "Aug", "Sep", "Sept", "Oct", "Nov", "Dec", "No", "Nos", "Vol", "Ch", "Sec", "Pt"]
)

_CJK = "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f"
_HANGUL = "\uac00-\ud7af"
_CJK_RE = re.compile(f"[{_CJK}]")
_HANGUL_RE = re.compile(f"[{_HANGUL}]")
_HEAVY_RE = re.compile(f"[{_CJK}{_HANGUL}0-9]")
_ALNUM_RE = re.compile(r"[^\W_]")  # exactly str.isalnum()
_TOKEN_RE = re.compile(r"\S+")
_WS_RE = re.compile(r"\s*")
_AREA_CODE_RE = re.compile(r"\+?\d{0,3}\(\d{2,4}\)")
_INITIALS_RE = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")  # "U.S" "e.g" "J" (the final "." stripped)
_punct_class = re.escape("".join(sorted(TERMINALS | CLAUSE_MARKS)))
_closer_class = re.escape("".join(sorted(CLOSERS)))
# A token may break inside itself only around CJK: after CJK punctuation, or punctuation then a CJK char.
_INNER_HINT_RE = re.compile(
    f"[{re.escape(''.join(sorted(CJK_PUNCT)))}]|[{_punct_class}][{_closer_class}]*[{_CJK}]"
)

ZWJ = "\u200d"


class Strength(enum.IntEnum):
    """How strongly a position ends a phrase. Order matters."""

    NONE = 0
    CLAUSE = 1
    SENTENCE = 2


class _SplitClass(enum.IntEnum):
    """Preference among break positions inside a `max_chars` window. Order matters."""

    HARD = 0
    SCRIPT = 1  # between two CJK characters
    SPACE = 2
    CLAUSE = 3
    SENTENCE = 4


@dataclass(frozen=True, slots=True)
class Segment:
    index: int  # 0, 1, 2 ... within the context, silent segments included
    text: str  # what to speak; "" when the range has nothing to say
    start_char: int  # [start_char, end_char) in the concatenation of all text pushed to the context
    end_char: int
    reason: Reason

    @property
    def speakable(self) -> bool:
        return bool(self.text)


@dataclass(frozen=True, slots=True)
class _Cut:
    pos: int  # cut the pending body at this index
    reason: Reason


class Segmenter:
    """Partial sentences in, speakable segments out (see the module docstring for the rules)."""

    def __init__(
        self,
        *,
        first_min_words: int = DEFAULT_FIRST_MIN_WORDS,
        first_max_words: int = DEFAULT_FIRST_MAX_WORDS,
        first_wait_ms: float = DEFAULT_FIRST_WAIT_MS,
        max_chars: int = DEFAULT_MAX_CHARS,
        min_chars: int = DEFAULT_MIN_CHARS,
    ) -> None:
        if first_min_words < 1:
            raise ValueError("first_min_words must be >= 1")
        if first_max_words < first_min_words:
            raise ValueError("first_max_words must be >= first_min_words")
        if not first_wait_ms >= 0.0:
            raise ValueError("first_wait_ms must be >= 0")
        if max_chars < MIN_MAX_CHARS:
            raise ValueError(f"max_chars must be >= {MIN_MAX_CHARS}")
        if not 0 <= min_chars <= max_chars:
            raise ValueError("min_chars must be in [0, max_chars]")
        self._first_min_words = first_min_words
        self._first_max_words = first_max_words
        self._first_wait_s = first_wait_ms / MS_PER_S
        self._max_chars = max_chars
        self._min_chars = min_chars
        # Pending input = `_lead_chars` whitespace characters (counted, not stored), then `_body`,
        # which is empty or starts with a non-whitespace character.
        self._body = ""
        self._lead_chars = 0
        self._lead_line_start = True  # the body's first token starts a line (or the input)
        self._consumed_chars = 0  # end of the last segment's range
        self._received_chars = 0
        self._next_index = 0
        self._spoke = False  # a segment with speech went out: the first-segment rules are over
        self._last_text_s: float | None = None
        self._ended = False
        # Where the scan of `_body` resumes: every break before `_scan_pos` was decided "no cut".
        self._scan_pos = 0
        self._scan_words = 0
        self._scan_line_start = True

    # ---- the four verbs ------------------------------------------------------------------------

    def push(self, text: str, now_s: float) -> list[Segment]:
        if self._ended:
            raise ValueError("push after end()")
        out = self._timeout_cut(now_s)  # what a timely poll() would have cut before this text
        if text:
            self._append(text)
            self._last_text_s = now_s
            out += self._drain(final=False)
        return out

    def poll(self, now_s: float) -> list[Segment]:
        """Cut the pending first segment once `first_wait_ms` passed without new text."""
        if self._ended:
            return []
        return self._timeout_cut(now_s)

    def flush(self, now_s: float) -> list[Segment]:
        """Force out everything pending that has something to say; trailing whitespace stays pending."""
        if self._ended:
            return []
        out = self._drain(final=True)
        if _ALNUM_RE.search(self._body):
            out.append(self._cut(len(self._body.rstrip()), "flush"))
        return out

    def end(self, now_s: float) -> list[Segment]:
        """Force out everything and close. Later calls return []; `push` raises ValueError."""
        if self._ended:
            return []
        self._ended = True
        out = self._drain(final=True)
        if self.pending_chars == 0:
            return out
        if _ALNUM_RE.search(self._body) or not out:
            out.append(self._cut(len(self._body), "end"))
        else:
            out[-1] = self._absorb_tail(out[-1])
        return out

    # ---- views ---------------------------------------------------------------------------------

    @property
    def pending_text(self) -> str:
        """Text received and not yet in a segment, leading whitespace dropped."""
        return self._body

    @property
    def pending_chars(self) -> int:
        return self._received_chars - self._consumed_chars

    @property
    def consumed_chars(self) -> int:
        return self._consumed_chars

    @property
    def ended(self) -> bool:
        return self._ended

    # ---- cutting -------------------------------------------------------------------------------

    def _append(self, text: str) -> None:
        self._received_chars += len(text)
        if self._body:
            self._body += text
            return
        body = text.lstrip()
        lead = text[: len(text) - len(body)]
        self._lead_chars += len(lead)
        self._lead_line_start = self._lead_line_start or _has_line_break(lead)
        self._body = body
        self._reset_scan()

    def _drain(self, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while (cut := self._next_cut(final)) is not None:
            out.append(self._cut(cut.pos, cut.reason))
        return out

    def _next_cut(self, final: bool) -> _Cut | None:
        body = self._body
        if not body:
            return None
        window = self._window_end(body)
        cut = self._scan(body, window, final)
        if cut is not None:
            return cut
        if len(body.rstrip()) > window or len(body) > window + LOOKAHEAD_WS_CHARS + 1:
            # Every break inside the window is decided by now (see _window_split).
            return _Cut(self._window_split(body, window), "max_chars")
        return None

    def _scan(self, body: str, window: int, final: bool) -> _Cut | None:
        """The first decided cut at or before `window`, walking tokens from the resume point."""
        words = self._scan_words
        line_start = self._scan_line_start
        for match in _TOKEN_RE.finditer(body, self._scan_pos):
            a, b = match.span()
            if a >= window:
                return None
            if _INNER_HINT_RE.search(body, a, b):
                for q, strength in _inner_breaks(body, a, b):
                    if q > window:
                        return None
                    cut = self._decide(q, strength, words + _word_count(body[a:q]))
                    if cut is not None:
                        return cut
            if b > window or b == len(body):
                return None  # the token may go on, or a cut here would be too long
            c = _ws_end(body, b)
            end_strength = _token_end_strength(body, a, b, c, line_start, final)
            if end_strength is None:
                return None  # needs text not received yet
            words += _word_count(body[a:b])
            cut = self._decide(b, end_strength, words)
            if cut is not None:
                return cut
            line_start = _has_line_break(body[b:c])
            if c < len(body):  # the next token's start is known: nothing before it changes again
                self._scan_pos, self._scan_words, self._scan_line_start = c, words, line_start
        return None

    def _decide(self, pos: int, strength: Strength, words: int) -> _Cut | None:
        if words == 0:
            return None  # nothing to say yet
        if not self._spoke:
            if strength >= Strength.SENTENCE:
                return _Cut(pos, "sentence")
            if strength >= Strength.CLAUSE and words >= self._first_min_words:
                return _Cut(pos, "clause")
            if words >= self._first_max_words:
                return _Cut(pos, "words")
            return None
        if strength >= Strength.SENTENCE and weighted_len(self._body[:pos]) >= self._min_chars:
            return _Cut(pos, "sentence")
        return None

    def _timeout_cut(self, now_s: float) -> list[Segment]:
        if self._spoke or self._last_text_s is None or not self._body:
            return []
        if now_s - self._last_text_s < self._first_wait_s:
            return []
        body = self._body
        pos = _timeout_pos(body)
        if pos == 0:
            return []
        window = self._window_end(body)
        if pos > window:
            first = self._cut(self._window_split(body, window), "max_chars")
        else:
            first = self._cut(pos, "timeout")
        return [first, *self._drain(final=False)]

    def _window_end(self, body: str) -> int:
        """The longest prefix of `body` whose weighted length fits in max_chars."""
        limit = self._max_chars
        if not _HEAVY_RE.search(body, 0, limit):
            return min(len(body), limit)
        weight = 0
        for i, ch in enumerate(body):
            weight += _char_weight(ch)
            if weight > limit:
                return i
        return len(body)

    def _window_split(self, body: str, window: int) -> int:
        """Where to cut a body too long for one segment: the best break inside `window`.

        Called only when text beyond the window's breaks has arrived (non-space text past the window,
        or a whitespace run longer than LOOKAHEAD_WS_CHARS), so every break in it is decided and the
        choice does not depend on how the text arrived.
        """
        first_alnum = _ALNUM_RE.search(body)
        speech_from = first_alnum.start() + 1 if first_alnum else len(body) + 1
        best: tuple[_SplitClass, int] | None = None
        silent_end = 0  # the last break before anything speakable

        def consider(split: _SplitClass, q: int) -> None:
            nonlocal best
            if q >= speech_from and (best is None or (split, q) > best):
                best = (split, q)

        line_start = self._lead_line_start
        for match in _TOKEN_RE.finditer(body):
            a, b = match.span()
            if a >= window:
                break
            for q, strength in _inner_breaks(body, a, b):
                if q <= window:
                    consider(self._split_class(body, q, strength, _SplitClass.SCRIPT), q)
            for q in range(a + 1, min(b, window + 1)):
                if _is_cjk(body[q - 1]) and _is_cjk(body[q]):
                    consider(_SplitClass.SCRIPT, q)
            if b <= window and b < len(body):
                c = _ws_end(body, b)
                strength = _token_end_strength(body, a, b, c, line_start, final=True) or Strength.NONE
                consider(self._split_class(body, b, strength, _SplitClass.SPACE), b)
                if b < speech_from:
                    silent_end = b
                line_start = _has_line_break(body[b:c])
        if best is not None:
            return best[1]
        if silent_end:  # nothing to say before a break: a silent piece, so the next word starts whole
            return silent_end
        return _hard_cut(body, window)

    def _split_class(self, body: str, q: int, strength: Strength, floor: _SplitClass) -> _SplitClass:
        if strength == Strength.NONE or weighted_len(body[:q]) < self._min_chars:
            return floor
        return _SplitClass.SENTENCE if strength == Strength.SENTENCE else _SplitClass.CLAUSE

    def _cut(self, pos: int, reason: Reason) -> Segment:
        raw = self._body[:pos]
        text = " ".join(raw.split())
        if not _ALNUM_RE.search(text):
            text = ""
        start = self._consumed_chars
        end = start + self._lead_chars + pos
        seg = Segment(self._next_index, text, start, end, reason)
        self._next_index += 1
        self._consumed_chars = end
        rest = self._body[pos:]
        self._body = rest.lstrip()
        lead = rest[: len(rest) - len(self._body)]
        self._lead_chars = len(lead)
        self._lead_line_start = _has_line_break(lead)
        self._spoke = self._spoke or bool(text)
        self._reset_scan()
        return seg

    def _absorb_tail(self, seg: Segment) -> Segment:
        """`seg`, extended over the pending tail (which has nothing to say) up to the input's end."""
        tail = " ".join(self._body.split())
        sep = " " if self._lead_chars and tail else ""
        text = seg.text + sep + tail if seg.text else ""
        self._consumed_chars = self._received_chars
        self._body, self._lead_chars = "", 0
        self._reset_scan()
        return replace(seg, text=text, end_char=self._received_chars)

    def _reset_scan(self) -> None:
        self._scan_pos, self._scan_words, self._scan_line_start = 0, 0, self._lead_line_start


# ---- pure helpers ----------------------------------------------------------------------------------


def _token_end_strength(body: str, a: int, b: int, c: int, line_start: bool, final: bool) -> Strength | None:
    """How strongly the token body[a:b], followed by whitespace body[b:c], ends a phrase.

    None: undecided, the whitespace may still grow or the next word's first letter is needed. With
    `final`, the end of `body` is the end of the text.
    """
    run_chars = c - b
    gap = run_chars > LOOKAHEAD_WS_CHARS
    if c == len(body) and not final and not gap:
        return None
    following = "" if gap or c == len(body) else body[c]
    strength = _punct_strength(body, a, b, following, line_start)
    if _has_line_break(body[b : min(c, b + LOOKAHEAD_WS_CHARS + 1)]) and not following.islower():
        strength = Strength.SENTENCE
    return strength


def _punct_strength(body: str, a: int, b: int, following: str, line_start: bool) -> Strength:
    """The break after token body[a:b] from its punctuation; `following`: the next word's first char."""
    k = b
    while k > a and body[k - 1] in CLOSERS:
        k -= 1
    j = k
    while j > a and body[j - 1] in TERMINALS:
        j -= 1
    run = body[j:k]
    if run:
        if any(ch in DEFINITE_TERMINALS for ch in run):
            quoted_mid_sentence = k < b and following.islower()
            return Strength.CLAUSE if quoted_mid_sentence else Strength.SENTENCE
        ellipsis = run != "."
        stem = body[a:j].lstrip(OPENERS)
        if not ellipsis and (_is_abbreviation(stem) or (line_start and stem.isdigit())):
            return Strength.NONE
        if following.islower() or following.isdigit():
            return Strength.CLAUSE if ellipsis else Strength.NONE
        return Strength.SENTENCE
    if k > a and body[k - 1] in CLAUSE_MARKS:
        return Strength.CLAUSE
    if body[a:b] in DASH_TOKENS:
        return Strength.CLAUSE
    return Strength.NONE


def _inner_breaks(body: str, a: int, b: int) -> Iterator[tuple[int, Strength]]:
    """Breaks strictly inside token body[a:b]: after CJK punctuation, or punctuation before CJK text."""
    i = a
    while i < b:
        if body[i] not in TERMINALS and body[i] not in CLAUSE_MARKS:
            i += 1
            continue
        j = i
        while j < b and (body[j] in TERMINALS or body[j] in CLAUSE_MARKS):
            j += 1
        run = body[i:j]
        while j < b and body[j] in CLOSERS:
            j += 1
        if j < b and (any(ch in CJK_PUNCT for ch in run) or _is_cjk(body[j])):
            yield j, _run_strength(run)
        i = j


def _run_strength(run: str) -> Strength:
    if any(ch in DEFINITE_TERMINALS for ch in run):
        return Strength.SENTENCE
    if "." in run or "…" in run:
        return Strength.CLAUSE if (".." in run or "…" in run) else Strength.SENTENCE
    return Strength.CLAUSE


def _ws_end(body: str, start: int) -> int:
    """The end of the whitespace run starting at `start` (== start when there is none)."""
    match = _WS_RE.match(body, start)
    assert match is not None  # r"\s*" always matches
    return match.end()


def _timeout_pos(body: str) -> int:
    """Where a timeout cuts: after the last word known to be complete; 0 if there is none."""
    content_end = len(body.rstrip())
    last = body[content_end - 1]
    # "$1," "3." "9:" may be a number going on ("$1,234", "3.5", "9:30"): not known to be complete.
    in_number = last in NUMBER_SEPARATORS and content_end >= 2 and body[content_end - 2].isdigit()
    last_token = body[_last_space_before(body, content_end) + 1:content_end]
    # "Dr." may be "Dr. Patel", "(415)" may be "(415) 555-0100": not known to be complete either
    held = (last == "." and _is_abbreviation(last_token[:-1].lstrip(OPENERS))) or _AREA_CODE_RE.fullmatch(last_token)
    if content_end < len(body) or (last in TIMEOUT_SAFE_ENDS and not in_number and not held) or _is_cjk(last):
        pos = content_end
    else:  # the last word may go on in the next piece: leave it pending
        token_start = _last_space_before(body, content_end) + 1
        pos = len(body[:token_start].rstrip())
        # a group of digits before a held number is the same number ("+1 415", "555 12"): held with it
        while pos and body[pos - 1].isdigit() and body[_ws_end(body, pos):_ws_end(body, pos) + 1].isdigit():
            pos = len(body[:_last_space_before(body, pos) + 1].rstrip())
    return pos if _ALNUM_RE.search(body, 0, pos) else 0


def _last_space_before(body: str, end: int) -> int:
    i = end - 1
    while i >= 0 and not body[i].isspace():
        i -= 1
    return i


def _hard_cut(body: str, window: int) -> int:
    """Cut at the window's end, moved back so that no grapheme cluster is split (if it can be)."""
    q = window
    while q > 1 and q < len(body) and _joined(body[q - 1], body[q]):
        q -= 1
    if q < len(body) and _joined(body[q - 1], body[q]):
        return window  # one cluster fills the whole window: split it after all
    return q


def _joined(left: str, right: str) -> bool:
    """True when no grapheme boundary lies between these two characters (approximately UAX #29)."""
    if not right:
        return False
    cp = ord(right)
    if unicodedata.category(right) in ("Mn", "Mc", "Me") or right == ZWJ or left == ZWJ:
        return True
    if 0xFE00 <= cp <= 0xFE0F or 0xE0100 <= cp <= 0xE01EF:  # variation selectors
        return True
    if 0x1F3FB <= cp <= 0x1F3FF or 0xE0020 <= cp <= 0xE007F:  # skin tones, emoji tag sequences
        return True
    return _is_regional_indicator(left) and _is_regional_indicator(right)


def _is_regional_indicator(ch: str) -> bool:
    return len(ch) == 1 and 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _is_abbreviation(stem: str) -> bool:
    return (stem.lower() in TITLE_ABBREVIATIONS or stem in CAPITALISED_ABBREVIATIONS
            or _INITIALS_RE.fullmatch(stem) is not None)


def _is_cjk(ch: str) -> bool:
    return _CJK_RE.match(ch) is not None


def _char_weight(ch: str) -> int:
    if _CJK_RE.match(ch):
        return CJK_CHAR_WEIGHT
    if _HANGUL_RE.match(ch):
        return HANGUL_CHAR_WEIGHT
    if "0" <= ch <= "9":
        return DIGIT_CHAR_WEIGHT
    return 1


def weighted_len(text: str) -> int:
    """The length `max_chars` and `min_chars` are measured in (CJK 3, digits 4, Hangul 2, others 1 per char)."""
    cjk = len(_CJK_RE.findall(text))
    hangul = len(_HANGUL_RE.findall(text))
    digits = sum(1 for ch in text if "0" <= ch <= "9")
    return (len(text) + (CJK_CHAR_WEIGHT - 1) * cjk + (HANGUL_CHAR_WEIGHT - 1) * hangul
            + (DIGIT_CHAR_WEIGHT - 1) * digits)


def _word_count(text: str) -> int:
    words = 0
    for token in text.split():
        cjk = len(_CJK_RE.findall(token))
        if cjk:
            words += -(-cjk // CJK_CHARS_PER_WORD)
        elif _ALNUM_RE.search(token):
            words += 1
    return words


def _has_line_break(text: str) -> bool:
    return any(ch in LINE_BREAKS for ch in text)
