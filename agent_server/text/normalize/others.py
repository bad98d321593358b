"""Every other language num2words speaks: markdown, then what they keep as written, then the rules they share
with English (numbers.READERS: numbers, percents, money, ISO dates and phone numbers, thousands grouped by a space
too); and number ranges ("3-5 Werktage": drei bis fünf), for the languages whose own readings are only those
(German, French and Spanish have more: de.py, fr.py, es.py). spoken_form (__init__.py) puts a language's own
rules after markdown and before these."""

from __future__ import annotations

import re

from agent_server.text.normalize import numbers
from agent_server.text.normalize.core import RULES_MARKDOWN, LanguageRules, Reader, read_kept
from agent_server.text.normalize.en import RULES as ENGLISH_RULES
from agent_server.text.normalize.numbers import AMOUNT, number

# No English words here (ordinal suffixes, am/pm, "and", months), and each language's own decimal mark. The
# numbers inside a clock time, a ratio, a date, a phone number, a version or a temperature are not quantities:
# "9:30" is not "neuf:trente", "14:00" not "vierzehn:null null"; with no reading of their own here, they stay as
# written ("keep" comes first: at one place the earlier rule wins).
_KEEP = (
    "keep",
    r"(?<![\d.,])(?:\d+(?::\d+)+"  # 9:30, 14:00:05, 16:9
    r"|\d{1,4}[/.]\d{1,2}[/.]\d{2,4}(?![\d.,]\d)"  # 01/05/2024, 1.5.24
    r"|\+\d[\d .-]*\d"  # +33 1 23 45 67 89
    r"|\d+(?:\.\d+){2,}"  # 1.2.3
    r"|-?\d+(?:[.,]\d+)?\s?°[CFK]?)(?!\d)",  # 72°F, -3,5 °C
)
# other languages group thousands with a space too ("1 500 euros", "2 345,67 €"; a no-break or thin space)
_AMOUNT_SPACED = r"\d{1,3}(?:[,.][ \u00a0\u202f]?\d{3}|[ \u00a0\u202f]\d{3})+(?:[.,]\d+)?|\d+(?:[.,]\d+)?"
RULES = (*RULES_MARKDOWN, _KEEP, *((name, body.replace(AMOUNT, _AMOUNT_SPACED)) for name, body in ENGLISH_RULES
                                   if name in numbers.READERS))
PLAIN_RANGE_RULE = ("plain_range", r"(?<![\d.,\w-])(?P<pr_lo>\d{1,4})[ \t]?[-–][ \t]?(?P<pr_hi>\d{1,4})"
                                   r"(?![\d.,]\d|[\w%°:-])")
RANGES_ONLY = ("it", "pt", "nl", "pl", "sv", "da", "no")  # the languages whose own readings are PLAIN_RANGE_RULE alone
_RANGE_WORDS = {"de": "bis", "fr": "à", "es": "a", "it": "a", "pt": "a", "nl": "tot", "pl": "do", "sv": "till",
                "da": "til", "no": "til"}


def read_plain_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    word = _RANGE_WORDS.get(lang)
    low, high = number(match["pr_lo"], lang, rules), number(match["pr_hi"], lang, rules)
    if word is None or low is None or high is None or int(match["pr_lo"]) >= int(match["pr_hi"]):
        return None
    return f"{low} {word} {high}"


READERS: dict[str, Reader] = {"keep": read_kept, "plain_range": read_plain_range}
