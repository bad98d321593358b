"""Text normalisation: a segment's numbers, money, times, dates and addresses written out as the words to say, its
markdown marks dropped. Pure.

Chatterbox reads what it is given: its tokenizers have digits, but the models say them badly or not at all
(resemble-ai/chatterbox#284: numbers skipped in Russian), and an agent's replies are full of them (prices,
times, order numbers, phone numbers). The hosted APIs normalise by default (ElevenLabs
`apply_text_normalization: "auto"`, Cartesia, Deepgram Aura, OpenAI), so a client expects "$4.50" to be said
"four dollars and fifty cents". Number words come from `num2words` (most of Chatterbox's languages).

`spoken_form(text, language)` returns a `Spoken`: the text to synthesise and the spans that map it back onto
the written text (they tile both), so times measured on what was said land on the characters the client
sent (`Spoken.written_times`): "$4.50" gets the time of "four dollars and fifty cents".

Split per language over a shared core: core.py (Spoken and its spans, the languages, the rule engine, markdown),
numbers.py (the readings every language shares: numbers, percents, money, ISO dates, phone numbers), en.py
(English's rules, in order, and its own readers), others.py (every other language num2words speaks: what they
share with English, number ranges), de.py, fr.py, es.py (their own ordinals, years, clock times). This file
puts a language's rules together (`rules_for`) and reads a text with them (`spoken_form`).

What is rewritten (English, en.py; other languages: core.LANGUAGES):
- money: $ € £ ¥ before (or € after) an amount, "$5 million", "$0.99"; `numbers.CURRENCIES`;
- percent "12.5%"; units after a number "72°F", "5 km", "16 GB" (`en._EN_UNITS`); ordinals "21st";
  times "9:30", "9:05 pm", "14:00"; ratios and scores "16:9", "3:2" ("sixteen to nine": a one-digit second
  number is no clock's); ISO dates "2024-05-01";
- years "1999", "2024" (a lone four-digit number 1100-2099 without a thousands comma);
- digit strings said digit by digit: phone-like groups "555-123-4567", "+1 415 555 0100", numbers with a
  leading zero "007", and runs longer than `numbers.MAX_CARDINAL_DIGITS`;
- decimals "3.14" ("three point one four"), grouped thousands "1,234,567", negatives "-5", plain integers;
- "&" between words ("and"), "*" or "×" between numbers ("times");
- dates: "12/25/2025" (month first, or day first where the first number cannot be a month: "25/12/2025"),
  "Dec 25, 2025", "December 25th", "25 December 2025" ("December twenty-fifth, twenty twenty-five", "the
  twenty-fifth of December, ..."); clock hours "3pm", "11 a.m." ("three p m"); decades "the 1990s", "the
  '80s", "in her 20s"; "a/b": a fraction up to tenths ("3/4": three quarters), else a month and day ("12/25"),
  else two numbers ("24/7"); phone numbers "(415) 555-0100", "+1 (415) 555-0100", "1-800-FLOWERS", "911",
  international ones "+44 7700 900123", "07700 900123";
- identifiers, digit by digit: a number after the word that names it ("order number 123456", "card ending in
  1234", "PIN: 1234", "zip code 90210", `en._ID_WORDS`), a ZIP after a state ("DC 20500"); codes letter by
  letter ("ABC123", "QW4E7R", "A-1234", "INV-2024-0042");
- ranges with "to": "9am-5pm", "9:30-10:30", "9-5", "3-2" (a score), "$10-$15", "15-20%", "10-15 min",
  "Dec 20-23"; days "Mon-Fri" ("Monday through Friday");
- "$14.99/mo" ("per month", `en._PER_UNITS`), "50¢", "₹2,500", "USD 20", "-$5"; "4.5/5" and "pain level 3/10"
  ("out of"), "120/80" ("one twenty over eighty"), "1 1/2", "½"; "9x13" ("by"), "2 + 2 = 4", "*67" ("star"),
  "7.30pm", "~5" ("about"), an expiry "09/2028";
- email addresses ("bob at example dot com"), web addresses "https://example.com/docs", "www.example.com",
  "example.io/path" ("example dot com slash docs": the scheme and the query are not read), "#5" and "No. 5"
  ("number five"), "e.g.", "i.e.", "etc.", "vs.", "approx.", the titles "Dr.", "Mr.", "Mrs.", "Ms.",
  "Prof." before a name, "Main St.", "Oak Ave", "Apt 4B", "St. Louis".
A number glued to letters ("A17", "mp3", "5km") is set apart by a space. Anything the rules do not know
stays as written. Other languages also read thousands grouped by a space ("1 500 euros"), a whole amount
of money without "zero cents", number ranges ("3-5 Werktage": drei bis fünf) and, in German, French and
Spanish, their own ordinals, years and clock times (de.py, fr.py, es.py).

Markdown, in every language (an LLM writes it; read as text its marks would be said or garble the
prosody): "**bold**", "*italic*", "_italic_", "__bold__" and "`code`" lose their marks, "~~struck~~" text and
emoji are not said, "[text](https://...)" is said as its text (its marks and address take no time), a
heading's "#"s and a list item's bullet at a line's start (or, lines joined by the segmenter, after a
sentence's end) are not said. A mark dropped between two letters leaves a space. Languages num2words does
not have (el, hi, ms, sw, zh) get only this.
"""

from __future__ import annotations

import re

from agent_server.text.normalize import core, de, en, es, fr, numbers, others
from agent_server.text.normalize.core import (
    LANGUAGES,
    MARKDOWN_ONLY,
    RULES_MARKDOWN,
    Reader,
    Span,
    Spoken,
    compile_rules,
    language_code,
    speak,
    unchanged,
)

__all__ = ["Span", "Spoken", "spoken_form", "unchanged"]

# a language's own readings, put after markdown and before the rules it shares (others.RULES)
OWN_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "de": de.RULES, "fr": fr.RULES, "es": es.RULES, **dict.fromkeys(others.RANGES_ONLY, (numbers.PLAIN_RANGE_RULE,)),
}
READERS: dict[str, Reader] = {**core.READERS, **numbers.READERS, **en.READERS, **others.READERS, **de.READERS,
                              **fr.READERS, **es.READERS}
_COMPILED: dict[str, tuple[tuple[re.Pattern[str], Reader], ...]] = {}


def spoken_form(text: str, language: str | None = None) -> Spoken:
    """The text with what the rules know written out as words (module docstring); `language`: None is English."""
    lang = language_code(language)
    return speak(text, lang, LANGUAGES.get(lang, MARKDOWN_ONLY), rules_for(lang))


def rules_for(lang: str) -> tuple[tuple[re.Pattern[str], Reader], ...]:
    """A language's rules, compiled once, with their readers."""
    rules = _COMPILED.get(lang)
    if rules is None:
        if lang == "en":
            rules = _COMPILED[lang] = en.compiled()
        else:
            chosen = ((*RULES_MARKDOWN, *OWN_RULES.get(lang, ()), *others.RULES[len(RULES_MARKDOWN):])
                      if lang in LANGUAGES else RULES_MARKDOWN)
            rules = _COMPILED[lang] = compile_rules(chosen, READERS)
    return rules
