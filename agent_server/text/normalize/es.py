"""Spanish's own readings (before the shared ones, after markdown): ordinals ("1.º", "2.ª", "3.er") and number
ranges."""

from __future__ import annotations

import re

from agent_server.text.normalize.core import LanguageRules, Reader
from agent_server.text.normalize.numbers import PLAIN_RANGE_RULE, words

RULES: tuple[tuple[str, str], ...] = (
    ("es_ordinal", r"(?<![\d.,\w])(?P<eo>\d{1,2})\.?(?P<eo_suf>º|ª|°|er)(?![\w])"),  # 1.º, 2.ª, 3.er
    PLAIN_RANGE_RULE,
)


def _read_es_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    value, suffix = int(match["eo"]), match["eo_suf"]
    said = words(value, lang, to="ordinal")
    if suffix == "ª":
        return said[:-1] + "a" if said.endswith("o") else said
    if suffix == "er":
        return said[:-1] if value in (1, 3) and said.endswith("o") else None  # primer, tercer
    if value in (1, 3) and re.match(r"[ \t]+[a-zñ]", match.string[match.end():]):
        return said[:-1]  # before its noun: "1.º piso", el primer piso
    return said


READERS: dict[str, Reader] = {"es_ordinal": _read_es_ordinal}
