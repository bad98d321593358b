"""English: its rules, in order (at one place the earlier rule wins), and the readers of the ones that are
English's alone: times, dates, units, ordinals, ranges, identifiers, addresses, fractions, abbreviations."""

from __future__ import annotations

import re

from agent_server.text.normalize import core, numbers
from agent_server.text.normalize.core import (
    LANGUAGES,
    RULES_MARKDOWN,
    LanguageRules,
    Reader,
    compile_rules,
    said_as,
    speak,
)
from agent_server.text.normalize.numbers import (
    AMOUNT,
    CURRENCIES,
    EN_MONTHS,
    NOT_IN_NUMBER,
    SYMBOLS,
    Currency,
    amount,
    digits,
    number,
    read_integer,
    say_digit_groups,
    say_money,
    words,
)

# unit symbol -> (singular, plural): only symbols that mean nothing else after a number ("in", "m", "s" do)
_EN_UNITS: dict[str, tuple[str, str]] = {
    "°C": ("degree Celsius", "degrees Celsius"), "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"), "km": ("kilometer", "kilometers"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"),
    "lb": ("pound", "pounds"), "lbs": ("pounds", "pounds"), "oz": ("ounce", "ounces"), "ft": ("foot", "feet"),
    "mi": ("mile", "miles"), "mph": ("mile per hour", "miles per hour"), "km/h": ("kilometer per hour",
    "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"), "ml": ("milliliter", "milliliters"),
    "KB": ("kilobyte", "kilobytes"), "MB": ("megabyte", "megabytes"), "GB": ("gigabyte", "gigabytes"),
    "TB": ("terabyte", "terabytes"), "ms": ("millisecond", "milliseconds"), "hrs": ("hours", "hours"),
    "min": ("minute", "minutes"), "mins": ("minutes", "minutes"), "sec": ("second", "seconds"),
    "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"), "kWh": ("kilowatt hour",
    "kilowatt hours"), "hr": ("hour", "hours"), "h": ("hour", "hours"), "g": ("gram", "grams"),
    "L": ("liter", "liters"), "mL": ("milliliter", "milliliters"), "tbsp": ("tablespoon", "tablespoons"),
    "tsp": ("teaspoon", "teaspoons"), "sq ft": ("square foot", "square feet"), "mAh": ("milliamp hour",
    "milliamp hours"), "bpm": ("beat per minute", "beats per minute"), "wk": ("week", "weeks"),
    "wks": ("weeks", "weeks"), "yd": ("yard", "yards"), "yds": ("yards", "yards"), "gal": ("gallon", "gallons"),
    "qt": ("quart", "quarts"), "kcal": ("kilocalorie", "kilocalories"), "mg/dL": ("milligram per deciliter",
    "milligrams per deciliter"),
}
# ISO codes written next to an amount ("USD 20", "2,500 INR"), English
_CURRENCY_CODES: dict[str, Currency] = {
    "USD": CURRENCIES["$"], "EUR": CURRENCIES["€"], "GBP": CURRENCIES["£"], "JPY": CURRENCIES["¥"],
    "INR": CURRENCIES["₹"], "CAD": Currency("CAD", "Canadian dollar", "Canadian dollars", "cent", "cents"),
    "AUD": Currency("AUD", "Australian dollar", "Australian dollars", "cent", "cents"),
}
_UNIT_NAMES = "|".join(re.escape(u) for u in sorted(_EN_UNITS, key=len, reverse=True))
_MONTH_NAMES = (r"(?P<{}>Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
                r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_URL_CHARS = r"[^\s<>()\[\]{}\"']"  # inside a web address; it does not end on punctuation
_URL_END = r"[^\s<>()\[\]{}\"'.,;:!?]"
_HOST = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+"
_URL_HOST = rf"(?:{_HOST}|localhost)(?::\d{{1,5}})?"  # after a scheme
_TLDS = "com|org|net|io|ai|dev|app|co|gov|edu|info|biz|me|tv|us|uk|ca|de|fr|eu"
_URL_TAIL = (rf"(?P<PATH>/(?:(?:(?![?#]){_URL_CHARS})*(?:(?![?#]){_URL_END}))?)?"  # the path, said
             rf"(?:[?#](?:{_URL_CHARS}*{_URL_END})?)?(?!\w)")  # the query or fragment, not said
# the full stop of "p.m." is read with it inside a sentence, and kept where it may end one
_AMPM_DOT = r"(?:\.(?=[ \t]*[a-z,;:]))?"
_US_STATES = ("AL|AK|AZ|AR|CA|CO|CT|DE|DC|FL|GA|HI|ID|IL|IN|IA|KS|KY|LA|ME|MD|MA|MI|MN|MS|MO|MT|NE|NV|NH|NJ|NM|NY|"
              "NC|ND|OH|OK|OR|PA|RI|SC|SD|TN|TX|UT|VT|VA|WA|WV|WI|WY")
# words after which a number is an identifier, read digit by digit: "PIN 1234", "zip code 90210"; the words that
# are verbs or common nouns too ("order 100 units", "in case 200 people") only with a word that says so
# ("order number 123456", "account ending in 4321", "case #2024", "card: 1234")
_ID_WORDS = (r"acct|confirmation|reference|ref|booking|tracking|invoice|membership|serial|routing|zip|postal"
             r"|verification|otp|pin|passcode|code|id|extension|ext")
_ID_WORDS_NAMED = r"order|account|card|ticket|case|member|policy|claim|security|access"
_ID_FILLERS = r"(?:number|no\.?|num|code|id|#|is|was|will[ \t]be|ending[ \t]in|ends[ \t]in|:)"
_DAYS = (r"Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tues?|Wed|Thu(?:rs?)?|Fri|Sat|Sun|M|F")
_EN_DAYS = {"mon": "Monday", "tue": "Tuesday", "wed": "Wednesday", "thu": "Thursday", "fri": "Friday",
            "sat": "Saturday", "sun": "Sunday", "m": "Monday", "f": "Friday"}
_PER_UNITS = {"mo": "month", "month": "month", "day": "day", "night": "night", "hr": "hour", "hour": "hour",
              "wk": "week", "week": "week", "yr": "year", "year": "year", "lb": "pound", "oz": "ounce",
              "kg": "kilogram", "g": "gram", "person": "person", "pp": "person", "each": "each", "user": "user",
              "seat": "seat", "mile": "mile", "mi": "mile", "km": "kilometer", "min": "minute", "minute": "minute",
              "sq ft": "square foot", "gallon": "gallon", "gal": "gallon", "head": "head", "unit": "unit",
              "item": "item", "ticket": "ticket", "visit": "visit", "session": "session", "class": "class"}
SHARED = dict(numbers.RULES)  # the rules every language reads alike, put here in English's order
RULES: tuple[tuple[str, str], ...] = (
    ("times", r"(?<=\d)[ \t]?[*×][ \t]?(?=\d)"),
    ("star", r"(?<![\w*])\*(?=\d)"),  # "Dial *67": star sixty-seven
    *RULES_MARKDOWN,
    ("id_number", rf"(?i:\b(?P<id_kw>(?:{_ID_WORDS})\b(?:[ \t]*{_ID_FILLERS})*[ \t]*"
                  rf"|(?:{_ID_WORDS_NAMED})\b(?:[ \t]*{_ID_FILLERS})+[ \t]*))"
                  r"(?P<id_num>\d[\d \t-]*\d|\d)(?![\w]|[.,]\d)"),
    ("code_token", r"(?<![\w-])(?P<ct>(?=[A-Z0-9]*\d)(?=(?:[0-9]*[A-Z]){2})[A-Z0-9]{5,})(?![\w-])"),  # ABC123
    ("letter_code", r"(?<![\w-])(?P<lc>[A-Z]{1,4}(?:-\d{4,}|(?:-\d{2,}){2,3}))(?![\w-])"),  # A-1234, INV-2024-0042
    ("zip", rf"\b(?P<zip_state>{_US_STATES}),?[ \t](?P<zip>\d{{5}}(?:-\d{{4}})?)(?![\w-])"),  # DC 20500
    ("time_range", r"(?<![\d:.,])(?P<tr_a>\d{1,2}(?::\d{2})?(?:[ \t]?[aApP]\.?[mM]\.?)?)[ \t]?[-–][ \t]?"
                   r"(?P<tr_b>\d{1,2}(?::\d{2})?(?:[ \t]?[aApP]\.?[mM])?)(?![\w:]|[.,]\d)" + _AMPM_DOT),
    ("day_range", rf"\b(?P<dr_a>{_DAYS})\.?[ \t]?[-–][ \t]?(?P<dr_b>{_DAYS})\b" + _AMPM_DOT),
    ("dot_time", r"(?<![\d.,])(?P<dt_h>\d{1,2})\.(?P<dt_m>[0-5]\d)[ \t]?(?P<dt_ap>[aApP]\.?[mM])(?!\w)"
                 + _AMPM_DOT),  # 7.30pm
    ("money_range", rf"(?P<mr_sym>[{SYMBOLS}])[ \t]?(?P<mr_a>{AMOUNT})[ \t]?[-–][ \t]?(?:[{SYMBOLS}])?[ \t]?"
                    rf"(?P<mr_b>{AMOUNT})(?![\d%]|[ \t]?(?:thousand|million|billion|[kKmMbB]\b))"),
    ("money_code", rf"\b(?:(?P<mc_code>USD|EUR|GBP|INR|JPY|CAD|AUD)[ \t]?(?P<mc_num>{AMOUNT})"
                   rf"|(?P<mc_num2>{AMOUNT})[ \t]?(?P<mc_code2>USD|EUR|GBP|INR|JPY|CAD|AUD)\b)"),
    ("cents", r"(?<![\d.,])(?P<ce>\d{1,2})[ \t]?¢"),
    ("percent_range", rf"{NOT_IN_NUMBER}(?P<pr_a>{AMOUNT})[ \t]?%?[ \t]?[-–][ \t]?(?P<pr_b>{AMOUNT})[ \t]?%"),
    ("per_unit", r"(?<=\d)/(?P<pu>sq[ \t]?ft|month|night|hour|week|year|person|each|user|seat|mile|minute|gallon"
                 r"|head|unit|item|ticket|visit|session|class|day|mo|hr|wk|yr|lb|oz|kg|pp|mi|km|min|gal|g)\b"),
    ("by", r"(?<=\d)[ \t]?[xX][ \t]?(?=\d)"),  # 9x13, 2 x 4
    ("times_x", r"(?<=\d)x(?=[ \t]+[a-z])"),  # 2x faster
    ("plus", r"(?<=\d)[ \t]?\+[ \t]?(?=\d)"),
    ("equals", r"(?<=\d)[ \t]?=[ \t]?(?=[\d$])"),
    ("street", r"\b(?P<sn>[A-Z][a-z]+)[ \t](?P<st>St|Ave|Blvd|Rd|Ln|Ct|Hwy|Pkwy)\b\.?(?=[ \t]*(?:[,;]|$|[a-z0-9(]"
               r"|(?:Apt|Ste|Suite|N|S|E|W|NW|NE|SW|SE)\b))"),  # Main St., Oak Ave, Pennsylvania Ave NW
    ("saint", r"(?<![\w.])St\.(?=[ \t][A-Z])"),  # St. Louis (not after a capitalised word: "Main St. Then")
    ("unit_no", r"\b(?P<un>Apt|Ste|Bldg|Rm)\.?(?=[ \t]*#?[0-9A-Z])"),  # Apt 4B, Ste. 200
    ("email", r"(?<![\w.+-])(?P<em_user>[A-Za-z0-9][\w.+-]*)@(?P<em_host>" + _HOST + r")(?![\w-])"),
    ("url", rf"(?<![\w@/.])(?:(?P<url_scheme>[Hh][Tt][Tt][Pp][Ss]?://)(?P<url_host>{_URL_HOST})"
            rf"|(?P<url_www>www\.{_HOST})){_URL_TAIL.replace('PATH', 'url_path')}"),
    ("domain", rf"(?<![\w@/.-])(?P<dom>(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+(?:{_TLDS}))"
               rf"{_URL_TAIL.replace('PATH', 'dom_path')}"),
    ("expiry", r"(?<![\d/.,])(?P<ex_m>0[1-9]|1[0-2])/(?P<ex_y>20\d{2})(?![\d/]|[.,]\d)"),  # 09/2028
    ("mixed_fraction", r"(?<![\d/.,])(?P<mf_w>\d{1,3})[ \t](?P<mf_a>\d)/(?P<mf_b>\d{1,2})(?![\w/]|[.,]\d)"),
    ("vulgar", r"(?:(?<![\d.,])(?P<vu_w>\d{1,3})[ \t]?)?(?P<vu>[½⅓⅔¼¾⅛⅜⅝⅞])"),
    ("slash_date", r"(?<![\d/.,])(?P<sd_a>\d{1,2})/(?P<sd_b>\d{1,2})/(?P<sd_y>\d{4}|\d{2})(?![\d/]|[.,]\d)"),
    ("month_day", rf"\b{_MONTH_NAMES.format('md_m')}\.?[ \t](?P<md_d>\d{{1,2}})(?:st|nd|rd|th)?"
                  r"(?:[ \t]?[-–][ \t]?(?P<md_d2>\d{1,2})(?:st|nd|rd|th)?)?(?![\w:.,]\d|\w)"
                  r"(?:,?[ \t](?P<md_y>\d{4})(?!\w|[.,:]\d))?"),
    ("day_month", rf"(?<![\w.,])(?P<dm_d>\d{{1,2}})(?:st|nd|rd|th)?[ \t](?:of[ \t])?{_MONTH_NAMES.format('dm_m')}\b"
                  r"(?:,?[ \t](?P<dm_y>\d{4})(?!\w|[.,:]\d))?"),
    ("hour", r"(?<![\w:.,])(?P<h_h>\d{1,2})[ \t]?(?P<h_ap>[aApP]\.?[mM])(?!\w)" + _AMPM_DOT),
    ("about", r"(?<!\S)~[ \t]?(?=[$€£¥₹]?\d)"),
    ("number_sign", r"(?:(?<!\S)|(?<=\())(?:#|No\.[ \t]?)(?=\d|[A-Z]{1,4}-?\d)"),
    ("abbreviation", r"(?<![\w.])(?:e\.g\.|i\.e\.|etc\.|vs\.?|approx\.)(?!\w)"),
    ("title", r"\b(?P<ti>Dr|Mr|Mrs|Ms|Prof)\.(?=[ \t](?:[A-Z]|and[ \t]+(?:Dr|Mr|Mrs|Ms|Prof)\.))"),
    ("money", SHARED["money"]),
    ("money_after", SHARED["money_after"]),
    ("date", SHARED["date"]),
    ("phone_area", r"(?<![\w+])(?P<pa_cc>\+\d{1,3}[ .-]?)?\((?P<pa_area>\d{2,4})\)[ .-]?"
                   r"(?P<pa_rest>\d{2,4}(?:[ .-]\d{2,4}){1,2})(?!\w|[.,]\d)"),  # (415) 555-0100, (02) 9876 5432
    ("vanity", r"(?<![\w+])1[ -](?P<va_code>8[0-8]{2})[ -](?P<va_word>[A-Z]{4,})\b"),  # 1-800-FLOWERS
    ("emergency", r"(?<![\w.,-])911(?![\w]|[.,]\d)"),
    ("phone_intl", r"(?<![\w+])(?P<pi>(?:\+\d{1,3}|0\d{1,4})(?:[ .-]\d{2,6}){1,4})(?![\w]|[.,]\d)"),  # 07700 900123
    ("phone", SHARED["phone"]),
    ("decade", r"(?:(?<![\w.,'])(?P<de_year>1[1-9]\d0|20\d0)|(?:'|(?:(?<=\bthe )|(?<=\bThe )|(?<=\bearly )|(?<=\blate )"
               r"|(?<=\bmid-)|(?<=\bmid )|(?<=\btheir )|(?<=\bher )|(?<=\bhis )|(?<=\bmy )|(?<=\byour )"
               r"|(?<=\bour ))(?<![\w.,]))(?P<de_short>[1-9]0))'?s\b"),  # the 1990s, the '80s, in her 20s
    ("fraction", r"(?<![\w/.,-])(?P<fr_a>\d{1,3}(?:\.\d)?)/(?P<fr_b>\d{1,3})(?![\w/]|[.,]\d)"),
    ("time", r"(?<![\d:])(?P<t_h>\d{1,2}):(?P<t_m>\d{2})(?::(?P<t_s>\d{2}))?(?![\d:])"
             r"(?:\s?(?P<t_ap>[aApP]\.?[mM])(?!\w)" + _AMPM_DOT + ")?"),
    ("ratio", r"(?<![\d:.,])(?P<ra_a>\d{1,3}):(?P<ra_b>\d{1,3})(?![\d:]|[.,]\d)"),  # not a time: 16:9, 3:2, 12:1
    ("version", r"(?<![\d.,])(?P<v>\d+(?:\.\d+){2,})(?![\w]|[.,]\d)"),
    ("range", rf"{NOT_IN_NUMBER}(?<![\w-])(?P<r_a>\d{{1,4}})\s?[-–]\s?(?P<r_b>\d{{1,4}})(?![\d.,]\d|[\w%])"
              rf"(?:[ \t]?(?P<r_u>{_UNIT_NAMES})(?![\w/]))?"),
    ("percent", SHARED["percent"]),
    ("measure", rf"{NOT_IN_NUMBER}(?P<u_neg>(?<![\w-])-)?(?P<u_num>{AMOUNT})\s?"
                rf"(?P<u>{_UNIT_NAMES})(?![\w/])(?:\.(?=[ \t]+[a-z]))?"),  # "15 min. early": the dot is no end
    ("ordinal", r"(?<![\d.,])(?P<o>\d+)(?P<o_suf>st|nd|rd|th)\b"),
    ("number", SHARED["number"]),
    ("amp", r"(?<=\w\s)&(?=\s\w)"),
)


def _read_money_code(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return say_money(_CURRENCY_CODES[match["mc_code"] or match["mc_code2"]], match["mc_num"] or match["mc_num2"],
                      "", lang, rules)


def _read_cents(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    cents = int(match["ce"])
    return f"{words(cents, lang)} {'cent' if cents == 1 else 'cents'}"


def _read_money_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """$10-$15, $20-30: "ten to fifteen dollars"; with cents, each amount whole."""
    currency = CURRENCIES[match["mr_sym"]]
    first, last = match["mr_a"], match["mr_b"]
    low, high = amount(first, rules), amount(last, rules)
    if low is None or high is None or low >= high:
        return None
    last_said = say_money(currency, last, "", lang, rules)
    if last_said is None:
        return None
    if low == int(low) and high == int(high):
        return f"{number(first, lang, rules)} to {last_said}"
    first_said = say_money(currency, first, "", lang, rules)
    return None if first_said is None else f"{first_said} to {last_said}"


def _read_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hour, minute = int(match["t_h"]), int(match["t_m"])
    ampm = match["t_ap"]
    if hour > 24 or minute > 59 or (ampm and not 1 <= hour <= 12):
        return None
    if match["t_s"] is not None:  # "1:02:03": a duration or a clock with seconds, said as its numbers
        return " ".join(words(int(part), lang) for part in (match["t_h"], match["t_m"], match["t_s"]))
    said = words(hour, lang)
    if minute == 0:
        said += "" if ampm else " hundred" if hour > 12 or match["t_h"].startswith("0") else " o'clock"
    elif minute < 10:
        said += f" oh {words(minute, lang)}"
    else:
        said += f" {words(minute, lang)}"
    if ampm:
        said += " a m" if ampm[0] in "aA" else " p m"
    return said


def _read_measure(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["u_num"]
    said = number(written, lang, rules)
    if said is None:
        return None
    singular, plural = _EN_UNITS[match["u"]]
    unit = singular if written == "1" else plural
    return f"{'minus ' if match['u_neg'] else ''}{said} {unit}"


def _read_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    value = int(match["o"])
    expected = {1: "st", 2: "nd", 3: "rd"}.get(value % 10 if value % 100 not in (11, 12, 13) else 0, "th")
    if match["o_suf"] != expected:
        return None  # "3th" is not an ordinal we know how to say
    return words(value, lang, to="ordinal")


def _read_version(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    parts = match["v"].split(".")
    if len(parts) == 4 and all(int(part) <= 255 for part in parts):  # an IPv4 address
        return " dot ".join(digits(part, lang) for part in parts)
    return " point ".join(number(part, lang, rules) or part for part in parts)


def _read_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """"10-20", "9-5" (hours), "3-2" (a score): "ten to twenty", "nine to five", "three to two"; a unit after
    it is said in full ("10-15 min": ten to fifteen minutes)."""
    first, last = match["r_a"], match["r_b"]
    said = f"{read_integer(first, lang, rules)} to {read_integer(last, lang, rules)}"
    unit = match["r_u"]
    return f"{said} {_EN_UNITS[unit][1]}" if unit else said


def _read_ratio(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{read_integer(match['ra_a'], lang, rules)} to {read_integer(match['ra_b'], lang, rules)}"


_EN_SAID_CHARS = {".": "dot", "-": "dash", "_": "underscore", "+": "plus", "/": "slash", "~": "tilde",
                  ":": "colon"}
_EN_ABBREVIATIONS = {"e.g.": "for example", "i.e.": "that is", "etc.": "et cetera", "vs.": "versus", "vs": "versus",
                     "approx.": "approximately"}
_EN_TITLES = {"Dr": "Doctor", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor"}


def _spell_address(written: str) -> str:
    """A piece of an email or web address: its words as written, its digits one by one, its marks by name."""
    said: list[str] = []
    for piece in re.findall(r"[A-Za-z]+|\d+|.", written):
        if piece.isdigit():
            said.append(digits(piece, "en"))
        elif piece in _EN_SAID_CHARS:
            said.append(_EN_SAID_CHARS[piece])
        elif piece.isalpha():
            said.append("w w w" if piece.lower() == "www" else piece)
    return " ".join(said)


def _read_email(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{_spell_address(match['em_user'])} at {_spell_address(match['em_host'])}"


def _read_url(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """A web address said as its host and path: "https://" and a query or fragment are not read."""
    groups = match.groupdict()
    host = groups.get("url_host") or groups.get("url_www") or groups["dom"]
    path = (groups.get("url_path") or groups.get("dom_path") or "").rstrip("/")
    return _spell_address(host + path)


def _month(written: str) -> int:
    return next(i for i, name in enumerate(EN_MONTHS) if name.startswith(written[:3]))


def _say_date(month: int, day: int, year: str | None, *, day_first: bool = False) -> str | None:
    if not (1 <= month <= 12 and 1 <= day <= (29 if month == 2 else 30 if month in (4, 6, 9, 11) else 31)):
        return None
    said = (f"the {words(day, 'en', to='ordinal')} of {EN_MONTHS[month - 1]}" if day_first
            else f"{EN_MONTHS[month - 1]} {words(day, 'en', to='ordinal')}")
    if year is not None:
        said += f", {read_integer(year, 'en', LANGUAGES['en'])}"
    return said


def _read_slash_date(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """Month first, as in the US; day first where the first number cannot be a month (25/12/2025). A two-digit
    year is 2000-2069 or 1970-1999."""
    first, second, year = int(match["sd_a"]), int(match["sd_b"]), match["sd_y"]
    if len(year) == 2:
        year = str((2000 if int(year) < 70 else 1900) + int(year))
    if first > 12:
        first, second = second, first
    return _say_date(first, second, year)


def _read_month_day(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    month = _month(match["md_m"]) + 1
    last = match["md_d2"]
    if last is None:
        return _say_date(month, int(match["md_d"]), match["md_y"])
    first_said = _say_date(month, int(match["md_d"]), None)  # Dec 20-23: December twentieth to twenty-third
    if first_said is None or not 1 <= int(last) <= 31:
        return None
    said = f"{first_said} to {words(int(last), lang, to='ordinal')}"
    return said + (f", {read_integer(match['md_y'], lang, rules)}" if match["md_y"] else "")


def _read_day_month(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    said = _say_date(_month(match["dm_m"]) + 1, int(match["dm_d"]), match["dm_y"], day_first=True)
    if said is not None and re.search(r"(?i)\bthe\s*$", match.string[:match.start()]):
        said = said.removeprefix("the ")  # "on the 15th of March": one "the"
    return said


def _read_hour(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hour = int(match["h_h"])
    if not 1 <= hour <= 12:
        return None
    return f"{words(hour, lang)} {'a m' if match['h_ap'][0] in 'aA' else 'p m'}"


def _read_number_sign(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    if re.search(r"(?i)\bnumber\W*(?:is\W*)?$", match.string[:match.start()]):
        return ""  # "order number is #A-1234": "number" once
    return "number"


def _read_abbreviation(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    said = _EN_ABBREVIATIONS[match[0]]
    rest = match.string[match.end():]
    if match[0] == "etc." and (not rest.strip() or re.match(r"\s+[A-Z]", rest)):
        said += "."  # "etc." ended the sentence: it keeps its full stop
    return said


def _read_title(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _EN_TITLES[match["ti"]]


def _read_phone_intl(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["pi"]
    groups = re.split(r"[ .-]", written.lstrip("+"))
    if sum(map(len, groups)) < 8 or all(len(group) <= 4 for group in groups):
        return None  # short, or groups the phone rule reads (and tells from thousands)
    return say_digit_groups(groups, lang, plus=written.startswith("+"))


def _read_phone_area(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    country = match["pa_cc"]
    groups = [*([country.strip(" .-+")] if country else []), match["pa_area"], *re.split(r"[ .-]", match["pa_rest"])]
    return say_digit_groups(groups, lang, plus=bool(country))


def _read_vanity(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    code = match["va_code"]
    return f"one {words(int(code), lang) if code == '800' else digits(code, lang)} {match['va_word']}"


def _read_emergency(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return "nine one one"


def _read_decade(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    year = match["de_year"]
    said = words(int(year), lang, to="year") if year else words(int(match["de_short"]), lang)
    return said[:-1] + "ies" if said.endswith("y") else said + "s"


_EN_FRACTION_NAMES = {2: ("half", "halves"), 4: ("quarter", "quarters")}


def _read_fraction(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """a/b: a fraction with a denominator up to 10 ("3/4": three quarters); else a month and a day ("12/25":
    December twenty-fifth); else the two numbers ("24/7": twenty-four seven)."""
    written_a, b = match["fr_a"], int(match["fr_b"])
    before = match.string[:match.start()]
    if "." in written_a or (b in (5, 10, 100) and re.search(
            r"(?i)\b(?:rated|rating|rates|scored?|scores|level|stars?|reviews?|grade)\W*$", before)):
        return f"{number(written_a, lang, rules)} out of {words(b, lang)}"  # a rating: 4.5/5, pain level 3/10
    a = int(written_a)
    if 70 <= a <= 250 and 40 <= b <= 150 and a > b:  # a blood pressure: one twenty over eighty
        high = words(a, lang) if a < 100 or a % 100 == 0 else (
            f"{words(a // 100, lang)} {words(a % 100, lang) if a % 100 >= 10 else 'oh ' + words(a % 100, lang)}")
        return f"{high} over {words(b, lang)}"
    if a > 99 or b > 99:
        return None
    if 0 < a < b <= 10:
        return _say_fraction(a, b, lang)
    if 1 <= a <= 12 and b >= 1:
        said = _say_date(a, b, None)
        if said is not None:
            return said
    return f"{words(a, lang)} {words(b, lang)}"


def _read_id_number(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """An identifier after its word ("order number 123456", "ending in 4321", "PIN: 1234"): its digits one by one,
    its groups apart. Fewer than three digits: a quantity after all ("order 2")."""
    written = match["id_num"]
    groups = [group for group in re.split(r"[ \t-]+", written) if group]
    if sum(map(len, groups)) < 3:
        return None
    keyword = match["id_kw"].replace("#", "number ")
    keyword = re.sub(r"\s+", " ", keyword)
    if keyword and not keyword.endswith(" "):
        keyword += " "
    separator = ", " if "-" in written or any(len(group) > 4 for group in groups[:-1]) else " "
    return keyword + separator.join(digits(group, lang) for group in groups)


def _spell(written: str, lang: str) -> str:
    """A code said character by character: its letters one by one, its digits one by one."""
    return " ".join(digits(piece, lang) if piece.isdigit() else " ".join(piece)
                    for piece in re.findall(r"[A-Za-z]+|\d+", written))


def _read_code_token(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _spell(match["ct"], lang)


def _read_letter_code(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return ", ".join(_spell(part, lang) for part in match["lc"].split("-"))


def _read_zip(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{match['zip_state']} {', '.join(digits(part, lang) for part in match['zip'].split('-'))}"


def _read_time_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """9am-5pm, 9:30-10:30, 12-2pm: "nine a m to five p m" (one side at least a clock time)."""
    first, last = match["tr_a"], match["tr_b"]
    if not re.search(r"[:aApP]", first + last):
        return None  # two plain numbers: the range rule's
    return f"{_said(first).rstrip('.')} to {_said(last)}"


def _read_day_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    first, last = match["dr_a"], match["dr_b"]
    if (len(first) == 1) != (len(last) == 1):
        return None  # "M-Sat"? not a pair we know
    return f"{_EN_DAYS[first[:3].lower()]} through {_EN_DAYS[last[:3].lower()]}"


def _read_dot_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _said(f"{match['dt_h']}:{match['dt_m']} {match['dt_ap']}")


def _read_percent_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    first, last = number(match["pr_a"], lang, rules), number(match["pr_b"], lang, rules)
    return None if first is None or last is None else f"{first} to {last} percent"


def _read_per_unit(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    unit = re.sub(r"[ \t]+", " ", match["pu"])
    return f"per {_PER_UNITS[unit]}"


def _read_street(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    names = {"St": "Street", "Ave": "Avenue", "Blvd": "Boulevard", "Rd": "Road", "Ln": "Lane", "Ct": "Court",
             "Hwy": "Highway", "Pkwy": "Parkway"}
    said = f"{match['sn']} {names[match['st']]}"
    return said + "." if match[0].endswith(".") and not match.string[match.end():].strip() else said


def _read_saint(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    previous = re.search(r"(\S+)\s*$", match.string[:match.start()])
    if previous is not None and previous[1][0].isupper() and not previous[1].endswith((".", "!", "?", ":")):
        return None  # "Main St. Then", "Visit St. Louis": a street, or no telling
    return "Saint"


def _read_unit_no(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return {"Apt": "Apartment", "Ste": "Suite", "Bldg": "Building", "Rm": "Room"}[match["un"]]


def _read_expiry(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{EN_MONTHS[int(match['ex_m']) - 1]} {words(int(match['ex_y']), lang, to='year')}"


_EN_FRACTION_WORDS = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅛": (1, 8), "⅜": (3, 8),
                      "⅝": (5, 8), "⅞": (7, 8)}


def _say_fraction(a: int, b: int, lang: str, *, article: bool = False) -> str:
    one, many = _EN_FRACTION_NAMES.get(b) or (words(b, lang, to="ordinal"), words(b, lang, to="ordinal") + "s")
    if a == 1:
        return f"{'a' if article else 'one'} {one}"
    return f"{words(a, lang)} {many}"


def _read_mixed_fraction(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    a, b = int(match["mf_a"]), int(match["mf_b"])
    if not 0 < a < b <= 10:
        return None
    return f"{words(int(match['mf_w']), lang)} and {_say_fraction(a, b, lang, article=True)}"


def _read_vulgar(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    a, b = _EN_FRACTION_WORDS[match["vu"]]
    whole = match["vu_w"]
    if whole is None:
        return _say_fraction(a, b, lang)
    return f"{words(int(whole), lang)} and {_say_fraction(a, b, lang, article=True)}"


def _read_about(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    before = match.string[:match.start()]
    if re.search(r"(?i)\b(?:about|around|approximately|roughly|approx\.)\s*$", before):
        return ""  # "about ~5": said once
    after = match.string[match.end():match.end() + 1]
    return "about " if after and not after.isalnum() else "about"  # (before "$20": a word of its own)


# the readers of English's own rules (those it shares with every language: numbers.READERS)
READERS: dict[str, Reader] = {
    "time": _read_time,
    "version": _read_version,
    "range": _read_range,
    "ratio": _read_ratio,
    "measure": _read_measure,
    "ordinal": _read_ordinal,
    "amp": said_as("and"),
    "times": said_as("times"),
    "about": _read_about,
    "star": said_as("star"),
    "id_number": _read_id_number,
    "code_token": _read_code_token,
    "letter_code": _read_letter_code,
    "zip": _read_zip,
    "time_range": _read_time_range,
    "day_range": _read_day_range,
    "dot_time": _read_dot_time,
    "money_range": _read_money_range,
    "money_code": _read_money_code,
    "cents": _read_cents,
    "percent_range": _read_percent_range,
    "per_unit": _read_per_unit,
    "by": said_as("by"),
    "times_x": said_as("times"),
    "plus": said_as("plus"),
    "equals": said_as("equals"),
    "street": _read_street,
    "saint": _read_saint,
    "unit_no": _read_unit_no,
    "expiry": _read_expiry,
    "mixed_fraction": _read_mixed_fraction,
    "vulgar": _read_vulgar,
    "phone_intl": _read_phone_intl,
    "phone_area": _read_phone_area,
    "vanity": _read_vanity,
    "emergency": _read_emergency,
    "decade": _read_decade,
    "fraction": _read_fraction,
    "email": _read_email,
    "url": _read_url,
    "domain": _read_url,
    "slash_date": _read_slash_date,
    "month_day": _read_month_day,
    "day_month": _read_day_month,
    "hour": _read_hour,
    "number_sign": _read_number_sign,
    "abbreviation": _read_abbreviation,
    "title": _read_title,
}

_COMPILED: list[tuple[tuple[re.Pattern[str], Reader], ...]] = []  # English's rules compiled, once


def compiled() -> tuple[tuple[re.Pattern[str], Reader], ...]:
    """English's rules, compiled once, with their readers (its own, the shared ones and markdown's)."""
    if not _COMPILED:
        _COMPILED.append(compile_rules(RULES, {**core.READERS, **numbers.READERS, **READERS}))
    return _COMPILED[0]


def _said(text: str) -> str:
    """A piece of a match read whole as English (each side of a time range, a clock time written "7.30pm")."""
    return speak(text, "en", LANGUAGES["en"], compiled()).text
