"""German's own readings (before the shared ones, after markdown): ordinals ("der 3. Anrufer", "1. Januar"), years
("1985") and number ranges."""

from __future__ import annotations

import re

from agent_server.text.normalize.core import LanguageRules, Reader
from agent_server.text.normalize.numbers import PLAIN_RANGE_RULE, words

_DE_MONTHS = (r"Januar|Februar|März|April|Mai|Juni|Juli|August|September|Oktober|November|Dezember"
              r"|Jan|Feb|Mär|Apr|Jun|Jul|Aug|Sept?|Okt|Nov|Dez")
RULES: tuple[tuple[str, str], ...] = (
    ("de_article_ordinal", r"\b(?P<da>[Dd]er|[Dd]ie|[Dd]as|[Dd]en|[Dd]em|[Dd]es|[Aa]m|[Zz]um|[Vv]om|[Ii]m|[Bb]eim)"
                           r"[ \t](?P<dn>\d{1,3})\.(?=[ \t][A-ZÄÖÜ])"),  # der 3. Anrufer, am 1. Januar
    ("de_date_ordinal", rf"(?<![\d.,\w])(?P<dd>\d{{1,2}})\.(?=[ \t]?(?:{_DE_MONTHS})\b)"),  # 1. Januar
    ("de_year", r"(?<![\d.,\w-])(?P<dy>1[1-9]\d\d)(?![\d.,]\d|[\w%°-])"),  # 1985: neunzehnhundert...
    PLAIN_RANGE_RULE,
)


def _read_de_article_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """der 3. Anrufer: der dritte; am 1. Januar: am ersten (the weak endings after an article)."""
    article = match["da"]
    ending = "" if article.lower() in ("der", "die", "das") else "n"
    return f"{article} {words(int(match['dn']), lang, to='ordinal')}{ending}"


def _read_de_date_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """1. Januar with no article before it ("Montag, 1. Januar"): erster."""
    return words(int(match["dd"]), lang, to="ordinal") + "r"


def _read_de_year(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return words(int(match["dy"]), lang, to="year")


READERS: dict[str, Reader] = {
    "de_article_ordinal": _read_de_article_ordinal,
    "de_date_ordinal": _read_de_date_ordinal,
    "de_year": _read_de_year,
}
