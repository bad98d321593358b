"""The readings every language shares: numbers, percents, money, ISO dates and phone numbers, in num2words'
words, with English's own where num2words has none ("point", "minus", month names). Other languages take these
rules over from English's (others.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from num2words import CONVERTER_CLASSES, num2words

from agent_server.text.normalize.core import LanguageRules, Reader

MAX_CARDINAL_DIGITS = 15  # longer integers are read digit by digit (an ID, not a quantity)
YEAR_RANGE = range(1100, 2100)
EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
EN_MAGNITUDES = {"k": "thousand", "thousand": "thousand", "m": "million", "mn": "million", "million": "million",
                 "b": "billion", "bn": "billion", "billion": "billion", "trillion": "trillion"}
EN_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
             "November", "December")


@dataclass(frozen=True, slots=True)
class Currency:
    code: str  # ISO 4217, for num2words
    one: str  # English unit, singular and plural
    many: str
    cent_one: str
    cent_many: str


CURRENCIES: dict[str, Currency] = {
    "$": Currency("USD", "dollar", "dollars", "cent", "cents"),
    "€": Currency("EUR", "euro", "euros", "cent", "cents"),
    "£": Currency("GBP", "pound", "pounds", "penny", "pence"),
    "¥": Currency("JPY", "yen", "yen", "sen", "sen"),
    "₹": Currency("INR", "rupee", "rupees", "paisa", "paise"),
}
AMOUNT = r"\d{1,3}(?:[,.]\d{3})+(?:[.,]\d+)?|\d+(?:[.,]\d+)?"
SYMBOLS = "".join(re.escape(s) for s in CURRENCIES)
NOT_IN_NUMBER = r"(?<![\d.,])"


def unspaced(written: str, rules: LanguageRules) -> str:
    """Other languages' grouping spaces ("1 500", "2 345,67", a no-break or thin space) as the language's group
    mark; beside a mark already there ("1. 500"), dropped."""
    group_mark = "," if rules.decimal_mark == "." else "."
    return re.sub(r"[ \u00a0\u202f]", "" if re.search(r"[,.][ \u00a0\u202f]", written) else group_mark, written)


def amount(written: str, rules: LanguageRules) -> Decimal | None:
    """'1,234.5' (English), '1.234,5' (German) -> Decimal; None where the marks do not read as one number in this
    language ('1,5' in English, '3.5' in German)."""
    group_mark = "," if rules.decimal_mark == "." else "."
    written = unspaced(written, rules)
    whole, mark, fraction = written.partition(rules.decimal_mark)
    if (mark and not fraction.isdigit()) or not re.fullmatch(rf"\d{{1,3}}(?:{re.escape(group_mark)}\d{{3}})*|\d+",
                                                                 whole):
        return None
    return Decimal(whole.replace(group_mark, "") + ("." + fraction if mark else ""))


def words(value: Decimal | int, lang: str, *, to: str = "cardinal") -> str:
    said: str = num2words(value, lang=lang, to=to)
    if lang == "en":  # American reading: no "and", no commas inside a number
        said = said.replace(",", "").replace(" and ", " ")
    return said


def digits(written: str, lang: str) -> str:
    if lang == "en":
        return " ".join(EN_DIGITS[int(c)] for c in written if c.isdigit())
    return " ".join(words(int(c), lang) for c in written if c.isdigit())


def number(written: str, lang: str, rules: LanguageRules) -> str | None:
    """A quantity said as one; digit by digit where it is not one (a leading zero, too many digits)."""
    written = unspaced(written, rules)
    plain = written.replace(",", "").replace(".", "")
    value = amount(written, rules)
    if value is None:
        return None
    integer = written.split(rules.decimal_mark)[0] if rules.decimal_mark in written else written
    if (len(integer) > 1 and integer[0] == "0" and integer.isdigit()) or len(plain) > MAX_CARDINAL_DIGITS:
        return digits(written, lang)
    if value == value.to_integral_value() and "." not in written and (rules.decimal_mark != "," or "," not in written):
        return words(int(value), lang)
    if lang == "en":
        whole, _, fraction = written.replace(",", "").partition(".")
        return f"{words(int(whole or '0'), lang)} point {digits(fraction, lang)}"
    return words(value, lang) if rules.decimals else None


def read_integer(written: str, lang: str, rules: LanguageRules) -> str | None:
    """A number as written; a lone four-digit 1100-2099 in English is a year."""
    if lang == "en" and re.fullmatch(r"\d{4}", written) and int(written) in YEAR_RANGE:
        return words(int(written), lang, to="year")
    return number(written, lang, rules)


def read_number(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["n"]
    said = number(written, lang, rules) if match["n_neg"] else read_integer(written, lang, rules)
    if said is None or not match["n_neg"]:
        return said
    return f"{'minus' if lang == 'en' else words(-1, lang).split()[0]} {said}"


def read_percent(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    said = number(match["pc"], lang, rules)
    if said is None:
        return None
    if match["pc_neg"]:
        said = f"{'minus' if lang == 'en' else words(-1, lang).split()[0]} {said}"
    return rules.percent.format(said)


def read_money(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    groups = match.groupdict()
    symbol = groups.get("m_sym") or groups["ma_sym"]
    written = groups.get("m_num") or groups["ma_num"]
    said = say_money(CURRENCIES[symbol], written, (groups.get("m_mag") or "").lower(), lang, rules)
    return f"minus {said}" if said is not None and groups.get("m_neg") else said


def say_money(currency: Currency, written: str, magnitude: str, lang: str, rules: LanguageRules) -> str | None:
    value = amount(written, rules)
    if value is None:
        return None
    if lang != "en":
        if magnitude or not rules.currency:
            return None
        said = str(num2words(value, lang=lang, to="currency", currency=currency.code))
        return without_zero_cents(said, lang, currency.code) if value == int(value) and value else said
    if magnitude:
        return f"{number(written, lang, rules)} {EN_MAGNITUDES[magnitude]} {currency.many}"
    units = int(value)
    cents = int((value - units) * 100) if currency.code != "JPY" else 0
    if value != units and (currency.code == "JPY" or len(written.rpartition(".")[2]) != 2):
        return f"{number(written, lang, rules)} {currency.many}"  # "$1.5": one point five dollars
    parts = []
    if units or not cents:
        parts.append(f"{words(units, lang)} {currency.one if units == 1 else currency.many}")
    if cents:
        parts.append(f"{words(cents, lang)} {currency.cent_one if cents == 1 else currency.cent_many}")
    return " and ".join(parts)


CENTS_CONJUNCTIONS = frozenset({"und", "et", "con", "e", "y", "ja", "i", "и", "och", "og", "en"})


def without_zero_cents(said: str, lang: str, code: str) -> str:
    """num2words' "zwanzig Euro und null Cent" for a whole amount: "zwanzig Euro"."""
    zero = str(CONVERTER_CLASSES[lang]._cents_verbose(0, code))
    at = said.rfind(zero)
    if at <= 0:
        return said
    head = said[:at].rstrip().removesuffix("ו").rstrip(" ,")  # (Hebrew glues its "and" to the word)
    last = head.rsplit(" ", 1)
    return last[0].rstrip(" ,") if len(last) == 2 and last[1] in CENTS_CONJUNCTIONS else head


def read_date(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    year, month, day = int(match["d_y"]), int(match["d_m"]), int(match["d_d"])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    if lang != "en":
        return match[0]  # kept as written: a date is said in a language's own order and words
    return f"{EN_MONTHS[month - 1]} {words(day, lang, to='ordinal')}, {words(year, lang, to='year')}"


def say_digit_groups(groups: Sequence[str], lang: str, *, plus: bool = False) -> str:
    """A phone number's groups, digit by digit, a pause between them ("plus one, four one five, ...")."""
    said = ", ".join(digits(group, lang) for group in groups)
    return f"{'plus' if lang == 'en' else '+'} {said}" if plus else said


def read_phone(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["ph"]
    groups = re.split(r"[ .-]", written.lstrip("+"))
    if sum(map(len, groups)) < 7 or (len(groups) == 2 and (len(groups[0]), len(groups[1])) != (3, 4)):
        return None  # "10-20", "2023-2024", "2 500": a range or a number (the rules after this one)
    if all(len(group) == 3 for group in groups[1:]) and len(groups[0]) <= 3 and written[len(groups[0])] in " .":
        return number("".join(groups), lang, rules)  # "1.234.567", "1 234 567": thousands grouped
    return say_digit_groups(groups, lang, plus=written.startswith("+"))


# the rules every language reads alike, in the order they stand among English's (en.RULES); other languages
# take them with thousands grouped by a space too (others.RULES)
RULES: tuple[tuple[str, str], ...] = (
    ("money", rf"(?P<m_neg>(?<![\w-])-)?(?P<m_sym>[{SYMBOLS}])\s?(?P<m_num>{AMOUNT})"
              r"(?:\s?(?P<m_mag>thousand|million|billion|trillion|bn|mn|[kKmMbB])\b)?"),
    ("money_after", rf"{NOT_IN_NUMBER}(?P<ma_num>{AMOUNT})\s?(?P<ma_sym>€)"),
    ("date", r"(?<!\d)(?P<d_y>\d{4})-(?P<d_m>\d{2})-(?P<d_d>\d{2})(?!\d)"),
    ("phone", r"(?<![\w+])(?P<ph>\+?\d{1,4}(?:[ .-]\d{2,4}){1,5})(?![\w]|[.,]\d)"),
    ("percent", rf"{NOT_IN_NUMBER}(?P<pc_neg>-)?(?P<pc>{AMOUNT})\s?%"),
    ("number", rf"{NOT_IN_NUMBER}(?P<n_neg>(?<![\w-])-)?(?P<n>{AMOUNT})(?![\d])"),
)
# number ranges outside English ("3-5 Werktage": drei bis fünf), said with the language's word for "to"; a
# language's own rules put it among theirs (de.py, fr.py, es.py, others.RANGES_ONLY)
PLAIN_RANGE_RULE = ("plain_range", r"(?<![\d.,\w-])(?P<pr_lo>\d{1,4})[ \t]?[-–][ \t]?(?P<pr_hi>\d{1,4})"
                                   r"(?![\d.,]\d|[\w%°:-])")
_RANGE_WORDS = {"de": "bis", "fr": "à", "es": "a", "it": "a", "pt": "a", "nl": "tot", "pl": "do", "sv": "till",
                "da": "til", "no": "til"}


def read_plain_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    word = _RANGE_WORDS.get(lang)
    low, high = number(match["pr_lo"], lang, rules), number(match["pr_hi"], lang, rules)
    if word is None or low is None or high is None or int(match["pr_lo"]) >= int(match["pr_hi"]):
        return None
    return f"{low} {word} {high}"


READERS: dict[str, Reader] = {
    "plain_range": read_plain_range,
    "money": read_money,
    "money_after": read_money,
    "date": read_date,
    "phone": read_phone,
    "percent": read_percent,
    "number": read_number,
}
