"""Inline markup in streamed text: the vendors' pause tags become real pauses, their other tags are not spoken.

ElevenLabs (`<break time="1.5s" />`, `<phoneme ...>word</phoneme>`) and Cartesia (`<break time="500ms"/>`,
`<speed ratio="1.2"/>`, `<volume .../>`, `<emotion .../>`, `<spell>ABC</spell>`) let a client put tags in the
text; an LLM prompted for those services writes them. Read as text, a tag would be spoken ("less than break time
equals ..."). `MarkupFilter` cuts a context's text pieces into text and `Pause`s, as the pieces come:

- `<break time="...">` (seconds `1.5s` or milliseconds `500ms`, at most MAX_BREAK_MS) is a `Pause`: the speech
  stream ends the segment there and adds a segment of that much silence (`speech.SpeechStream`: a segment with
  no text, never submitted to the engine; its events carry no characters);
- the other tags of the dialect are removed and the text they enclose is spoken (`<spell>ABC</spell>` says
  "ABC"; this engine has no per-word speed, volume, emotion or phonemes);
- everything else is text: a `<` that does not open a tag of the dialect ("x < y", "<3"), or an unknown tag;
- a tag split across pieces is held until its `>` arrives (at most MAX_TAG_CHARS, past which its `<` is text);
- ElevenLabs' v3 audio tags (`[laughs]`, `[whispers]`, `[clears throat]`: square brackets around 1..MAX_AUDIO_TAG_CHARS
  letters, spaces, hyphens and apostrophes), in the dialects that have them (AUDIO_TAG in `tags`: the v3 models and
  text to dialogue), are removed: this engine has no such events, and read as text they would be said.

SSML (jambonz, Riva): `ssml_text` turns a `<speak>` document into text with its breaks as `<break time=.../>`
(`SSML_TAGS`), the rest of its markup left out.

A break whose time cannot be read or is too long is not spoken either; `take_problems` returns what was wrong
for the session to report (the protocol's error), and the text goes on.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.etree import ElementTree

from agent_server.errors import FieldError

MAX_TAG_CHARS = 200  # a `<` followed by this many characters without `>` opens no tag
MAX_BREAK_MS = 10_000
MAX_AUDIO_TAG_CHARS = 40  # "[" + this many characters without "]": the "[" is text
BREAK = "break"
AUDIO_TAG = "[audio]"  # in a dialect's tags: it has ElevenLabs v3's square-bracket audio tags
ELEVENLABS_TAGS = frozenset({BREAK, "phoneme"})
ELEVENLABS_V3_TAGS = ELEVENLABS_TAGS | {AUDIO_TAG}
V3_MODEL_PREFIXES = ("eleven_v3", "eleven_v4")  # the ElevenLabs models that read audio tags
CARTESIA_TAGS = frozenset({BREAK, "speed", "volume", "emotion", "spell"})
SSML_TAGS = frozenset({BREAK})  # jambonz's SSML, once protocols/jambonz.ssml_text has kept only its breaks

_TAG = re.compile(r"<\s*(/?)\s*([A-Za-z][A-Za-z0-9_-]*)\b([^<>]*?)(/?)\s*>")
_TAG_PREFIX = re.compile(r"<\s*/?\s*[A-Za-z][A-Za-z0-9_-]*")  # what must follow `<` for it to open a tag
_AUDIO_TAG = re.compile(rf"\[[A-Za-z][A-Za-z' -]{{0,{MAX_AUDIO_TAG_CHARS - 1}}}\]")
_AUDIO_TAG_PREFIX = re.compile(rf"\[(?:[A-Za-z][A-Za-z' -]{{0,{MAX_AUDIO_TAG_CHARS - 1}}})?")
_TIME = re.compile(r"""\btime\s*=\s*["']?\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*["']?""", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Pause:
    duration_ms: int
    # where its tag is in the text fed (MarkupFilter's count of characters fed), [raw_start, raw_end)
    raw_start: int = field(default=0, compare=False)
    raw_end: int = field(default=0, compare=False)


Piece = str | Pause


@dataclass(slots=True)
class MarkupFilter:
    tags: frozenset[str]
    held: str = ""  # an unfinished tag (from its `<`), waiting for its `>`
    problems: list[str] = field(default_factory=list)  # what was wrong with a tag (reported, not spoken)
    last_char: str = ""  # the last character of the text given out so far
    fed_chars: int = 0  # characters fed so far
    text_chars: int = 0  # characters given out as text so far
    # (text offset, fed offset) where the text given out stops following the text fed one for one (a tag
    # removed, text held): `fed_offset` maps back through them
    _runs: list[tuple[int, int]] = field(default_factory=list)

    def fed_offset(self, text_offset: int) -> int:
        """Where the character given out at `text_offset` was in the text fed."""
        at = bisect.bisect_right(self._runs, (text_offset, math.inf)) - 1
        if at < 0:
            return text_offset
        run_text, run_fed = self._runs[at]
        return run_fed + text_offset - run_text

    def fed_span(self, start: int, end: int) -> tuple[int, int]:
        """A range of the text given out -> the range of the text fed its characters came from."""
        if end <= start:
            at = self.fed_offset(start)
            return at, at
        return self.fed_offset(start), self.fed_offset(end - 1) + 1

    def _give(self, pieces: list[Piece], text: str, fed_at: int) -> None:
        """Give out `text`, which starts at `fed_at` in the text fed."""
        if not text:
            return
        if self.fed_offset(self.text_chars) != fed_at:
            self._runs.append((self.text_chars, fed_at))
        self.text_chars += len(text)
        _add_text(pieces, text)

    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes, in order (text pieces joined where nothing came between)."""
        pieces = self._feed(text)
        said = [piece for piece in pieces if isinstance(piece, str) and piece]
        if said:
            self.last_char = said[-1][-1]
        return pieces

    def _feed(self, text: str) -> list[Piece]:
        base = self.fed_chars - len(self.held)  # where buffer[0] is in the text fed
        self.fed_chars += len(text)
        buffer = self.held + text
        self.held = ""
        pieces: list[Piece] = []
        at = 0
        while True:
            opening = self._next_opening(buffer, at)
            if opening < 0:
                self._give(pieces, buffer[at:], base + at)
                return pieces
            self._give(pieces, buffer[at:opening], base + at)
            if buffer[opening] == "[":
                at = self._audio_tag(buffer, opening, pieces, base)
                if at < 0:
                    return pieces  # held until its "]"
                continue
            closing = buffer.find(">", opening)
            if closing < 0:
                rest = buffer[opening:]
                if len(rest) <= MAX_TAG_CHARS and self._may_open_a_tag(rest):
                    self.held = rest
                    return pieces
                self._give(pieces, "<", base + opening)  # not a tag after all
                at = opening + 1
                continue
            match = _TAG.fullmatch(buffer, opening, closing + 1)
            if match is None or match.group(2).lower() not in self.tags:
                self._give(pieces, "<", base + opening)  # text, or a tag this dialect does not have: as written
                at = opening + 1
                continue
            self._tag(match, pieces, base + opening)
            at = closing + 1

    def _next_opening(self, buffer: str, at: int) -> int:
        angle = buffer.find("<", at)
        if AUDIO_TAG not in self.tags:
            return angle
        square = buffer.find("[", at)
        return square if angle < 0 or 0 <= square < angle else angle

    def _audio_tag(self, buffer: str, opening: int, pieces: list[Piece], base: int) -> int:
        """At a "[": skip an audio tag, hold an unfinished one (-1), or keep the "[" as text. Returns where
        the text goes on."""
        match = _AUDIO_TAG.match(buffer, opening)
        if match is not None:  # removed, said as nothing; between two words it leaves a space ("Well[sighs]okay")
            before = buffer[opening - 1] if opening else self.last_char
            after = buffer[match.end()] if match.end() < len(buffer) else ""
            if before and not before.isspace() and (not after or after.isalnum()):
                self._give(pieces, " ", base + opening)
            return match.end()
        prefix = _AUDIO_TAG_PREFIX.match(buffer, opening)
        if prefix is not None and prefix.end() == len(buffer):
            self.held = buffer[opening:]
            return -1
        self._give(pieces, "[", base + opening)
        return opening + 1

    def end(self) -> list[Piece]:
        """The input ended: an unfinished tag is text (an unclosed `<break` is reported too)."""
        held, self.held = self.held, ""
        if BREAK in self.tags and re.match(r"<\s*break\b", held, re.IGNORECASE):
            self.problems.append(f"{held[:60]!r}: a <break> that never closes ('>'): said as text")
        pieces: list[Piece] = []
        self._give(pieces, held, self.fed_chars - len(held))
        return pieces

    def take_problems(self) -> list[str]:
        problems, self.problems = self.problems, []
        return problems

    def _may_open_a_tag(self, rest: str) -> bool:
        prefix = _TAG_PREFIX.match(rest)
        if prefix is None:  # "<", "< ", "</": may still become one; "<3", "< y": not
            return bool(re.fullmatch(r"<\s*/?\s*", rest))
        name = re.sub(r"[<\s/]", "", prefix.group(0)).lower()
        return any(tag.startswith(name) for tag in self.tags) if prefix.end() == len(rest) else name in self.tags

    def _tag(self, match: re.Match[str], pieces: list[Piece], fed_at: int) -> None:
        if match.group(2).lower() != BREAK or match.group(1):
            return  # removed; the text it encloses goes on as text
        time = _TIME.search(match.group(3))
        if time is None:
            self.problems.append(f"{match.group(0)!r}: a break needs time=\"1.5s\" or \"500ms\"")
            return
        duration_ms = round(float(time.group(1)) * (1 if time.group(2).lower() == "ms" else 1000))
        if not 0 < duration_ms <= MAX_BREAK_MS:
            self.problems.append(f"{match.group(0)!r}: a break lasts more than 0 and at most {MAX_BREAK_MS / 1000:g} s")
            return
        pieces.append(Pause(duration_ms, fed_at, fed_at + len(match.group(0))))


def elevenlabs_tags(model_id: str | None) -> frozenset[str]:
    """The markup an ElevenLabs request's text may carry: v3 models' audio tags too."""
    return ELEVENLABS_V3_TAGS if model_id and model_id.lower().startswith(V3_MODEL_PREFIXES) else ELEVENLABS_TAGS


def _add_text(pieces: list[Piece], text: str) -> None:
    if not text:
        return
    if pieces and isinstance(pieces[-1], str):
        pieces[-1] += text
    else:
        pieces.append(text)


def spoken_text(pieces: Sequence[Piece]) -> str:
    """The text of `pieces` (pauses left out): what a whole request speaks."""
    return "".join(piece for piece in pieces if isinstance(piece, str))


# SSML `<break strength>` without a time, in ms (what SSML engines commonly make of them)
BREAK_STRENGTH_MS = {"none": 0, "x-weak": 100, "weak": 250, "medium": 400, "strong": 700, "x-strong": 1000}


def ssml_text(ssml: str) -> str:
    """The text an SSML document speaks, its `<break>`s as `<break time="..."/>` (played as pauses, above);
    the rest of its markup is not rendered here, the text it encloses is spoken."""
    try:
        root = ElementTree.fromstring(ssml)
    except ElementTree.ParseError as exc:
        raise FieldError("text", f"the SSML is not well-formed: {exc}") from None
    parts: list[str] = []

    def walk(element: ElementTree.Element) -> None:
        if element is not root and element.tag.rsplit("}", 1)[-1] == BREAK:
            parts.append(_break(element))
        elif element.text:
            parts.append(element.text)
        for child in element:
            walk(child)
            if child.tail:
                parts.append(child.tail)

    walk(root)
    text = " ".join("".join(parts).split())
    pieces = MarkupFilter(SSML_TAGS).feed(text)
    if not spoken_text(pieces).strip() and not any(isinstance(piece, Pause) for piece in pieces):
        raise FieldError("text", "the SSML says nothing: no text and no <break>")
    return text  # a document of breaks alone is that much silence (a telephony prompt's pause)


def _break(element: ElementTree.Element) -> str:
    time = element.get("time")
    if time is None:
        strength = element.get("strength", "medium")
        if strength not in BREAK_STRENGTH_MS:
            raise FieldError("text", f"<break strength={strength!r}>: one of {', '.join(BREAK_STRENGTH_MS)}")
        if not BREAK_STRENGTH_MS[strength]:
            return " "
        time = f"{BREAK_STRENGTH_MS[strength]}ms"
    return f' <break time="{time}"/> '
