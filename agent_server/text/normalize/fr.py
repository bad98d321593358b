"""French's own readings (before the shared ones, after markdown): ordinals ("1er", "2e"), clock times ("14h30")
and number ranges."""

from __future__ import annotations

import re

from agent_server.text.normalize.core import LanguageRules, Reader
from agent_server.text.normalize.numbers import PLAIN_RANGE_RULE, words

RULES: tuple[tuple[str, str], ...] = (
    ("fr_ordinal", r"(?<![\d.,\w])(?P<fo>\d{1,3})(?P<fo_suf>ères?|ers?|res?|èmes?|es?)(?![\w])"),  # 1er, 2e
    ("fr_time", r"(?<![\d.,:\w])(?P<fh>[01]?\d|2[0-4])[ \t]?h(?:[ \t]?(?P<fm>[0-5]\d))?(?![\w])"),  # 14h30
    PLAIN_RANGE_RULE,
)


def _read_fr_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    value, suffix = int(match["fo"]), match["fo_suf"]
    plural = "s" if suffix.endswith("s") and value > 1 else ""
    if value == 1:
        if suffix.rstrip("s") in ("er",):
            return "premier" + ("s" if suffix.endswith("s") else "")
        if suffix.rstrip("s") in ("re", "ère"):
            return "première" + ("s" if suffix.endswith("s") else "")
        return None
    if suffix.rstrip("s") in ("er", "re", "ère"):
        return None  # "2er" is no ordinal
    return words(value, lang, to="ordinal") + plural


def _read_fr_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hours = int(match["fh"])
    number = words(hours, lang)
    number = number[:-2] + "une" if number.endswith("un") else number  # une heure, vingt et une heures
    said = number + (" heure" if hours <= 1 else " heures")
    minutes = match["fm"]
    return f"{said} {words(int(minutes), lang)}" if minutes and int(minutes) else said


READERS: dict[str, Reader] = {"fr_ordinal": _read_fr_ordinal, "fr_time": _read_fr_time}
