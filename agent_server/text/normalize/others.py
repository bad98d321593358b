"""Every other language num2words speaks: markdown, then what they keep as written, then the rules every language
reads alike (numbers.RULES: numbers, percents, money, ISO dates and phone numbers), their thousands grouped by a
space too. spoken_form (__init__.py) puts a language's own rules after markdown and before these: German's,
French's and Spanish's (de.py, fr.py, es.py), and for the rest only number ranges (RANGES_ONLY)."""

from __future__ import annotations

from agent_server.text.normalize import numbers
from agent_server.text.normalize.core import RULES_MARKDOWN, Reader, read_kept
from agent_server.text.normalize.numbers import AMOUNT

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
RULES = (*RULES_MARKDOWN, _KEEP, *((name, body.replace(AMOUNT, _AMOUNT_SPACED)) for name, body in numbers.RULES))
RANGES_ONLY = ("it", "pt", "nl", "pl", "sv", "da", "no")  # whose own readings are numbers.PLAIN_RANGE_RULE alone
READERS: dict[str, Reader] = {"keep": read_kept}
