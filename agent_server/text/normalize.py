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

What is rewritten (English; other languages: see `_LANGUAGES`):
- money: $ € £ ¥ before (or € after) an amount, "$5 million", "$0.99"; `_CURRENCIES`;
- percent "12.5%"; units after a number "72°F", "5 km", "16 GB" (`_EN_UNITS`); ordinals "21st";
  times "9:30", "9:05 pm", "14:00"; ratios and scores "16:9", "3:2" ("sixteen to nine": a one-digit second
  number is no clock's); ISO dates "2024-05-01";
- years "1999", "2024" (a lone four-digit number 1100-2099 without a thousands comma);
- digit strings said digit by digit: phone-like groups "555-123-4567", "+1 415 555 0100", numbers with a
  leading zero "007", and runs longer than `MAX_CARDINAL_DIGITS`;
- decimals "3.14" ("three point one four"), grouped thousands "1,234,567", negatives "-5", plain integers;
- "&" between words ("and"), "*" or "×" between numbers ("times");
- dates: "12/25/2025" (month first, or day first where the first number cannot be a month: "25/12/2025"),
  "Dec 25, 2025", "December 25th", "25 December 2025" ("December twenty-fifth, twenty twenty-five", "the
  twenty-fifth of December, ..."); clock hours "3pm", "11 a.m." ("three p m"); decades "the 1990s", "the
  '80s", "in her 20s"; "a/b": a fraction up to tenths ("3/4": three quarters), else a month and day ("12/25"),
  else two numbers ("24/7"); phone numbers "(415) 555-0100", "+1 (415) 555-0100", "1-800-FLOWERS", "911",
  international ones "+44 7700 900123", "07700 900123";
- identifiers, digit by digit: a number after the word that names it ("order number 123456", "card ending in
  1234", "PIN: 1234", "zip code 90210", `_ID_WORDS`), a ZIP after a state ("DC 20500"); codes letter by
  letter ("ABC123", "QW4E7R", "A-1234", "INV-2024-0042");
- ranges with "to": "9am-5pm", "9:30-10:30", "9-5", "3-2" (a score), "$10-$15", "15-20%", "10-15 min",
  "Dec 20-23"; days "Mon-Fri" ("Monday through Friday");
- "$14.99/mo" ("per month", `_PER_UNITS`), "50¢", "₹2,500", "USD 20", "-$5"; "4.5/5" and "pain level 3/10"
  ("out of"), "120/80" ("one twenty over eighty"), "1 1/2", "½"; "9x13" ("by"), "2 + 2 = 4", "*67" ("star"),
  "7.30pm", "~5" ("about"), an expiry "09/2028";
- email addresses ("bob at example dot com"), web addresses "https://example.com/docs", "www.example.com",
  "example.io/path" ("example dot com slash docs": the scheme and the query are not read), "#5" and "No. 5"
  ("number five"), "e.g.", "i.e.", "etc.", "vs.", "approx.", the titles "Dr.", "Mr.", "Mrs.", "Ms.",
  "Prof." before a name, "Main St.", "Oak Ave", "Apt 4B", "St. Louis".
A number glued to letters ("A17", "mp3", "5km") is set apart by a space. Anything the rules do not know
stays as written. Other languages also read thousands grouped by a space ("1 500 euros"), a whole amount
of money without "zero cents", number ranges ("3-5 Werktage": drei bis fünf) and, in German, French and
Spanish, their own ordinals, years and clock times (`_RULES_BY_LANG`).

Markdown, in every language (an LLM writes it; read as text its marks would be said or garble the
prosody): "**bold**", "*italic*", "_italic_", "__bold__" and "`code`" lose their marks, "~~struck~~" text and
emoji are not said, "[text](https://...)" is said as its text (its marks and address take no time), a
heading's "#"s and a list item's bullet at a line's start (or, lines joined by the segmenter, after a
sentence's end) are not said. A mark dropped between two letters leaves a space. Languages num2words does
not have (el, hi, ms, sw, zh) get only this.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np
from num2words import CONVERTER_CLASSES, num2words

MAX_CARDINAL_DIGITS = 15  # longer integers are read digit by digit (an ID, not a quantity)
YEAR_RANGE = range(1100, 2100)

_EN_DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_EN_MAGNITUDES = {"k": "thousand", "thousand": "thousand", "m": "million", "mn": "million", "million": "million",
                  "b": "billion", "bn": "billion", "billion": "billion", "trillion": "trillion"}
_EN_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December")
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


@dataclass(frozen=True, slots=True)
class Currency:
    code: str  # ISO 4217, for num2words
    one: str  # English unit, singular and plural
    many: str
    cent_one: str
    cent_many: str


_CURRENCIES: dict[str, Currency] = {
    "$": Currency("USD", "dollar", "dollars", "cent", "cents"),
    "€": Currency("EUR", "euro", "euros", "cent", "cents"),
    "£": Currency("GBP", "pound", "pounds", "penny", "pence"),
    "¥": Currency("JPY", "yen", "yen", "sen", "sen"),
    "₹": Currency("INR", "rupee", "rupees", "paisa", "paise"),
}
# ISO codes written next to an amount ("USD 20", "2,500 INR"), English
_CURRENCY_CODES: dict[str, Currency] = {
    "USD": _CURRENCIES["$"], "EUR": _CURRENCIES["€"], "GBP": _CURRENCIES["£"], "JPY": _CURRENCIES["¥"],
    "INR": _CURRENCIES["₹"], "CAD": Currency("CAD", "Canadian dollar", "Canadian dollars", "cent", "cents"),
    "AUD": Currency("AUD", "Australian dollar", "Australian dollars", "cent", "cents"),
}


@dataclass(frozen=True, slots=True)
class LanguageRules:
    decimal_mark: str  # how the language writes 3.14
    percent: str  # how "7%" is said, the number's words in place of {}
    currency: bool  # num2words' to="currency" is right for $ € £ in this language
    decimals: bool = True  # num2words reads a Decimal right in this language


# Languages num2words speaks and what they write; English has its own rules (below) on top.
_LANGUAGES: dict[str, LanguageRules] = {
    "en": LanguageRules(".", "{} percent", True),
    "de": LanguageRules(",", "{} Prozent", True),
    "fr": LanguageRules(",", "{} pour cent", True),
    "es": LanguageRules(",", "{} por ciento", True),
    "it": LanguageRules(",", "{} per cento", True, decimals=False),  # num2words: 3,5 is "three"
    "pt": LanguageRules(",", "{} por cento", True),
    "nl": LanguageRules(",", "{} procent", True),
    "pl": LanguageRules(",", "{} procent", True),
    "fi": LanguageRules(",", "{} prosenttia", True),
    "ru": LanguageRules(",", "{} процентов", True),
    "he": LanguageRules(".", "{} אחוז", True),
    "sv": LanguageRules(",", "{} procent", False),
    "da": LanguageRules(",", "{} procent", False),
    "no": LanguageRules(",", "{} prosent", False),
    "tr": LanguageRules(",", "yüzde {}", False, decimals=False),  # num2words: 3,5 is "three fifty"
    "ar": LanguageRules(".", "{} بالمئة", False, decimals=False),  # num2words: riyals for any currency, 3.5 wrong
    "ja": LanguageRules(".", "{} パーセント", False),
    "ko": LanguageRules(".", "{} 퍼센트", False),
}


@dataclass(frozen=True, slots=True)
class Span:
    """written[written_start:written_end] is said as spoken[spoken_start:spoken_end]."""

    written_start: int
    written_end: int
    spoken_start: int
    spoken_end: int


@dataclass(frozen=True, slots=True)
class Spoken:
    written: str
    text: str  # what the engine is given
    # the rewritten spans, in order; each has written characters (a dropped markdown mark: no spoken ones);
    # between them the texts are the same
    rewrites: tuple[Span, ...]

    def written_times(self, starts_ms: Sequence[int], durations_ms: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per-character (start, duration) of the spoken text -> the same for the written text: a kept
        character keeps its time; a rewritten span's time (from its first spoken character's start to its last
        one's end) is shared out equally over its written characters; a dropped mark's characters take no time,
        at the place where the spoken text goes on."""
        if not self.rewrites:
            return list(starts_ms), list(durations_ms)
        spoken_starts = np.asarray(starts_ms, dtype=np.int64)
        spoken_ends = spoken_starts + np.asarray(durations_ms, dtype=np.int64)
        starts = np.zeros(len(self.written), dtype=np.int64)
        ends = np.zeros(len(self.written), dtype=np.int64)
        written_at = spoken_at = 0
        for span in (*self.rewrites, Span(len(self.written), len(self.written), len(self.text), len(self.text))):
            kept = span.written_start - written_at  # == span.spoken_start - spoken_at
            starts[written_at:span.written_start] = spoken_starts[spoken_at:span.spoken_start]
            ends[written_at:span.written_start] = spoken_ends[spoken_at:span.spoken_start]
            written_at, spoken_at = written_at + kept, spoken_at + kept
            n = span.written_end - span.written_start
            if n and span.spoken_end == span.spoken_start:  # a mark said as nothing: no time, where the text goes on
                at_ms = (spoken_starts[span.spoken_start] if span.spoken_start < len(self.text)
                         else spoken_ends[-1] if len(self.text) else 0)
                starts[span.written_start:span.written_end] = at_ms
                ends[span.written_start:span.written_end] = at_ms
            elif n:  # (the sentinel after the last rewrite has none)
                begin_ms, end_ms = spoken_starts[span.spoken_start], spoken_ends[span.spoken_end - 1]
                edges = np.rint(np.linspace(begin_ms, end_ms, n + 1)).astype(np.int64)
                starts[span.written_start:span.written_end] = edges[:-1]
                ends[span.written_start:span.written_end] = edges[1:]
            written_at, spoken_at = span.written_end, span.spoken_end
        return starts.tolist(), (ends - starts).tolist()


def unchanged(text: str) -> Spoken:
    return Spoken(text, text, ())


def spoken_form(text: str, language: str | None = None) -> Spoken:
    """The text with what the rules know written out as words (module docstring); `language`: None is English."""
    lang = _lang(language)
    rules = _LANGUAGES.get(lang, _MARKDOWN_ONLY)
    if not _MAYBE_READ.search(text):
        return unchanged(text)
    pieces: list[str] = []
    rewrites: list[Span] = []
    written_at = spoken_len = 0
    pos = 0
    scan = _Rewrites(text, lang, rules)
    while (found := scan.after(pos)) is not None:
        match, said = found
        pos = match.end()
        if said == match[0]:
            continue  # a rule that keeps what it matched as written (an ISO date outside English)
        before = text[written_at:match.start()]
        spaced_before = match.start() > 0 and _is_spaced(text[match.start() - 1])
        spaced_after = match.end() < len(text) and _is_spaced(text[match.end()])
        if not said:  # a dropped mark: a space only where it stood between two words ("a**b")
            said = " " if spaced_before and spaced_after else ""
        else:
            said = (" " if spaced_before else "") + said + (" " if spaced_after else "")
            if said.startswith(" ") and (before or (pieces[-1] if pieces else "")).endswith(" "):
                said = said[1:]  # "9x13": the number's words already ended with the space
        pieces.append(before)
        spoken_len += len(before)
        rewrites.append(Span(match.start(), match.end(), spoken_len, spoken_len + len(said)))
        pieces.append(said)
        spoken_len += len(said)
        written_at = match.end()
    pieces.append(text[written_at:])
    return Spoken(text, "".join(pieces), tuple(rewrites))


def _is_spaced(char: str) -> bool:
    """A letter a number's words must not be glued to ("A17" -> "A seventeen"); CJK scripts use no spaces."""
    return char.isalnum() and ord(char) < 0x2E80


# ---- the rules ------------------------------------------------------------------------------------

Reader = Callable[[re.Match[str], str, LanguageRules], str | None]

_AMOUNT = r"\d{1,3}(?:[,.]\d{3})+(?:[.,]\d+)?|\d+(?:[.,]\d+)?"
_SYMBOLS = "".join(re.escape(s) for s in _CURRENCIES)
_NOT_IN_NUMBER = r"(?<![\d.,])"
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
# markdown (every language): at one place these come first
_RULES_MARKDOWN: tuple[tuple[str, str], ...] = (
    # a link "[text](url)": its "[" (where its "](url)" follows, or no "]" does: a link the segmenter cut in
    # two) and its "](url)" are not said, its text is read as any text
    ("md_link_open", r"\[(?=[^\[\]\n]{1,300}\]\([^()\s]{1,2000}\)|[^\[\]]*$)"),
    ("md_link_close", r"\]\([^()\s]{1,2000}\)"),
    ("md_heading", r"(?m)^[ \t]{0,3}#{1,6}[ \t]+"),
    ("md_bullet", r"(?m)^[ \t]*[-+*•][ \t]+"),
    # the segmenter joins a list's lines: a bullet after a line's end punctuation, "•" and "##" anywhere
    ("md_bullet_joined", r"(?<=[.!?:;,)][ \t])[-+*•][ \t]+(?=\S)|(?<=\s)•[ \t]*|(?<!\S)#{2,6}[ \t]+(?=\S)"),
    ("md_strike", r"~~[^~\n]{1,300}~~"),  # struck-out text is not said: "~~$50~~ $35"
    ("md_mark", r"\*{1,3}|_{2,3}|~~|`{1,3}|(?<![\w\\])_(?=\w)|(?<=\w)_(?![\w])"),
    ("emoji", "[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\uFE0F\u200D]+"),  # pictographs: not said
)
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
_RULES_EN: tuple[tuple[str, str], ...] = (
    ("times", r"(?<=\d)[ \t]?[*×][ \t]?(?=\d)"),
    ("star", r"(?<![\w*])\*(?=\d)"),  # "Dial *67": star sixty-seven
    *_RULES_MARKDOWN,
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
    ("money_range", rf"(?P<mr_sym>[{_SYMBOLS}])[ \t]?(?P<mr_a>{_AMOUNT})[ \t]?[-–][ \t]?(?:[{_SYMBOLS}])?[ \t]?"
                    rf"(?P<mr_b>{_AMOUNT})(?![\d%]|[ \t]?(?:thousand|million|billion|[kKmMbB]\b))"),
    ("money_code", rf"\b(?:(?P<mc_code>USD|EUR|GBP|INR|JPY|CAD|AUD)[ \t]?(?P<mc_num>{_AMOUNT})"
                   rf"|(?P<mc_num2>{_AMOUNT})[ \t]?(?P<mc_code2>USD|EUR|GBP|INR|JPY|CAD|AUD)\b)"),
    ("cents", r"(?<![\d.,])(?P<ce>\d{1,2})[ \t]?¢"),
    ("percent_range", rf"{_NOT_IN_NUMBER}(?P<pr_a>{_AMOUNT})[ \t]?%?[ \t]?[-–][ \t]?(?P<pr_b>{_AMOUNT})[ \t]?%"),
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
    ("money", rf"(?P<m_neg>(?<![\w-])-)?(?P<m_sym>[{_SYMBOLS}])\s?(?P<m_num>{_AMOUNT})"
              r"(?:\s?(?P<m_mag>thousand|million|billion|trillion|bn|mn|[kKmMbB])\b)?"),
    ("money_after", rf"{_NOT_IN_NUMBER}(?P<ma_num>{_AMOUNT})\s?(?P<ma_sym>€)"),
    ("date", r"(?<!\d)(?P<d_y>\d{4})-(?P<d_m>\d{2})-(?P<d_d>\d{2})(?!\d)"),
    ("phone_area", r"(?<![\w+])(?P<pa_cc>\+\d{1,3}[ .-]?)?\((?P<pa_area>\d{2,4})\)[ .-]?"
                   r"(?P<pa_rest>\d{2,4}(?:[ .-]\d{2,4}){1,2})(?!\w|[.,]\d)"),  # (415) 555-0100, (02) 9876 5432
    ("vanity", r"(?<![\w+])1[ -](?P<va_code>8[0-8]{2})[ -](?P<va_word>[A-Z]{4,})\b"),  # 1-800-FLOWERS
    ("emergency", r"(?<![\w.,-])911(?![\w]|[.,]\d)"),
    ("phone_intl", r"(?<![\w+])(?P<pi>(?:\+\d{1,3}|0\d{1,4})(?:[ .-]\d{2,6}){1,4})(?![\w]|[.,]\d)"),  # 07700 900123
    ("phone", r"(?<![\w+])(?P<ph>\+?\d{1,4}(?:[ .-]\d{2,4}){1,5})(?![\w]|[.,]\d)"),
    ("decade", r"(?:(?<![\w.,'])(?P<de_year>1[1-9]\d0|20\d0)|(?:'|(?:(?<=\bthe )|(?<=\bThe )|(?<=\bearly )|(?<=\blate )"
               r"|(?<=\bmid-)|(?<=\bmid )|(?<=\btheir )|(?<=\bher )|(?<=\bhis )|(?<=\bmy )|(?<=\byour )"
               r"|(?<=\bour ))(?<![\w.,]))(?P<de_short>[1-9]0))'?s\b"),  # the 1990s, the '80s, in her 20s
    ("fraction", r"(?<![\w/.,-])(?P<fr_a>\d{1,3}(?:\.\d)?)/(?P<fr_b>\d{1,3})(?![\w/]|[.,]\d)"),
    ("time", r"(?<![\d:])(?P<t_h>\d{1,2}):(?P<t_m>\d{2})(?::(?P<t_s>\d{2}))?(?![\d:])"
             r"(?:\s?(?P<t_ap>[aApP]\.?[mM])(?!\w)" + _AMPM_DOT + ")?"),
    ("ratio", r"(?<![\d:.,])(?P<ra_a>\d{1,3}):(?P<ra_b>\d{1,3})(?![\d:]|[.,]\d)"),  # not a time: 16:9, 3:2, 12:1
    ("version", r"(?<![\d.,])(?P<v>\d+(?:\.\d+){2,})(?![\w]|[.,]\d)"),
    ("range", rf"{_NOT_IN_NUMBER}(?<![\w-])(?P<r_a>\d{{1,4}})\s?[-–]\s?(?P<r_b>\d{{1,4}})(?![\d.,]\d|[\w%])"
              rf"(?:[ \t]?(?P<r_u>{_UNIT_NAMES})(?![\w/]))?"),
    ("percent", rf"{_NOT_IN_NUMBER}(?P<pc_neg>-)?(?P<pc>{_AMOUNT})\s?%"),
    ("measure", rf"{_NOT_IN_NUMBER}(?P<u_neg>(?<![\w-])-)?(?P<u_num>{_AMOUNT})\s?"
                rf"(?P<u>{_UNIT_NAMES})(?![\w/])(?:\.(?=[ \t]+[a-z]))?"),  # "15 min. early": the dot is no end
    ("ordinal", r"(?<![\d.,])(?P<o>\d+)(?P<o_suf>st|nd|rd|th)\b"),
    ("number", rf"{_NOT_IN_NUMBER}(?P<n_neg>(?<![\w-])-)?(?P<n>{_AMOUNT})(?![\d])"),
    ("amp", r"(?<=\w\s)&(?=\s\w)"),
)
# other languages: no English words (ordinal suffixes, am/pm, "and", months) and their own decimal mark. The
# numbers inside a clock time, a ratio, a date, a phone number, a version or a temperature are not quantities:
# "9:30" is not "neuf:trente", "14:00" not "vierzehn:null null"; with no reading of their own here, they stay as
# written ("keep" comes first: at one place the earlier rule wins).
_ENGLISH_ONLY = frozenset({"ordinal", "amp", "time", "ratio", "range", "version", "measure", "times", "email", "url",
                           "domain", "slash_date", "month_day", "day_month", "hour", "about", "number_sign",
                           "phone_area", "vanity", "emergency", "decade", "fraction", "abbreviation", "title",
                           "star", "id_number", "code_token", "letter_code", "zip", "time_range", "day_range",
                           "dot_time", "money_range", "money_code", "cents", "percent_range", "per_unit", "by",
                           "times_x", "plus", "equals", "street", "saint", "unit_no", "expiry", "mixed_fraction",
                           "vulgar", "phone_intl"})
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
_RULES_OTHER = (*_RULES_MARKDOWN, _KEEP, *((name, body.replace(_AMOUNT, _AMOUNT_SPACED)) for name, body in _RULES_EN
                                          if name not in _ENGLISH_ONLY and (name, body) not in _RULES_MARKDOWN))
# a language num2words does not speak: its markdown only (the readers of which need no LanguageRules)
_MARKDOWN_ONLY = LanguageRules(".", "{}", False)
# a text with none of these no rule can match (a short plain sentence costs one scan)
_MAYBE_READ = re.compile(r"[\d&@*×_~`#\[/.\-+•$€£¥₹¢%°:½⅓⅔¼¾⅛⅜⅝⅞]|\bvs\b"
                         "|[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF]")


# a language's own readings, before the shared ones (after markdown): ordinals, clock times, ranges, years
_DE_MONTHS = (r"Januar|Februar|März|April|Mai|Juni|Juli|August|September|Oktober|November|Dezember"
              r"|Jan|Feb|Mär|Apr|Jun|Jul|Aug|Sept?|Okt|Nov|Dez")
_PLAIN_RANGE = r"(?<![\d.,\w-])(?P<pr_lo>\d{1,4})[ \t]?[-–][ \t]?(?P<pr_hi>\d{1,4})(?![\d.,]\d|[\w%°:-])"
_RANGE_WORDS = {"de": "bis", "fr": "à", "es": "a", "it": "a", "pt": "a", "nl": "tot", "pl": "do", "sv": "till",
                "da": "til", "no": "til"}
_RULES_BY_LANG: dict[str, tuple[tuple[str, str], ...]] = {
    "de": (
        ("de_article_ordinal", r"\b(?P<da>[Dd]er|[Dd]ie|[Dd]as|[Dd]en|[Dd]em|[Dd]es|[Aa]m|[Zz]um|[Vv]om|[Ii]m|[Bb]eim)"
                               r"[ \t](?P<dn>\d{1,3})\.(?=[ \t][A-ZÄÖÜ])"),  # der 3. Anrufer, am 1. Januar
        ("de_date_ordinal", rf"(?<![\d.,\w])(?P<dd>\d{{1,2}})\.(?=[ \t]?(?:{_DE_MONTHS})\b)"),  # 1. Januar
        ("de_year", r"(?<![\d.,\w-])(?P<dy>1[1-9]\d\d)(?![\d.,]\d|[\w%°-])"),  # 1985: neunzehnhundert...
        ("plain_range", _PLAIN_RANGE),
    ),
    "fr": (
        ("fr_ordinal", r"(?<![\d.,\w])(?P<fo>\d{1,3})(?P<fo_suf>ères?|ers?|res?|èmes?|es?)(?![\w])"),  # 1er, 2e
        ("fr_time", r"(?<![\d.,:\w])(?P<fh>[01]?\d|2[0-4])[ \t]?h(?:[ \t]?(?P<fm>[0-5]\d))?(?![\w])"),  # 14h30
        ("plain_range", _PLAIN_RANGE),
    ),
    "es": (
        ("es_ordinal", r"(?<![\d.,\w])(?P<eo>\d{1,2})\.?(?P<eo_suf>º|ª|°|er)(?![\w])"),  # 1.º, 2.ª, 3.er
        ("plain_range", _PLAIN_RANGE),
    ),
    **dict.fromkeys(("it", "pt", "nl", "pl", "sv", "da", "no"), (("plain_range", _PLAIN_RANGE),)),
}


def _rules_for(lang: str) -> tuple[tuple[re.Pattern[str], Reader], ...]:
    rules = _COMPILED.get(lang)
    if rules is None:
        chosen = _RULES_EN if lang == "en" else (
            (*_RULES_MARKDOWN, *_RULES_BY_LANG.get(lang, ()), *_RULES_OTHER[len(_RULES_MARKDOWN):])
            if lang in _LANGUAGES else _RULES_MARKDOWN)
        rules = _COMPILED[lang] = tuple((re.compile(body), _READERS[name]) for name, body in chosen)
    return rules


class _Rewrites:
    """The rewrites of one text, left to right: at each place the earliest match a rule can say; at one place the
    earlier rule wins. A rule that matches but cannot say it (a month 13, an ordinal "3th") leaves the place to
    the rules after it. Each rule's next sayable match is kept until the text before it is consumed, so a text
    is searched about once per rule, not once per rule per rewrite."""

    def __init__(self, text: str, lang: str, language: LanguageRules) -> None:
        self.text, self.lang, self.language = text, lang, language
        self.rules = _rules_for(lang)
        self._next: list[tuple[re.Match[str], str] | None] = [None] * len(self.rules)
        self._searched = [False] * len(self.rules)

    def after(self, pos: int) -> tuple[re.Match[str], str] | None:
        best: tuple[re.Match[str], str] | None = None
        for i, (pattern, reader) in enumerate(self.rules):
            found = self._next[i]
            if not self._searched[i] or (found is not None and found[0].start() < pos):
                found = self._next[i] = self._first_sayable(pattern, reader, pos)
                self._searched[i] = True
            if found is not None and (best is None or found[0].start() < best[0].start()):
                best = found
        return best

    def _first_sayable(self, pattern: re.Pattern[str], reader: Reader, pos: int) -> tuple[re.Match[str], str] | None:
        match = pattern.search(self.text, pos)
        while match is not None:
            said = _say(reader, match, self.lang, self.language)
            if said is not None:
                return match, said
            match = pattern.search(self.text, match.start() + 1)
        return None


def _say(reader: Reader, match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    try:
        return reader(match, lang, rules)
    except (NotImplementedError, OverflowError, InvalidOperation, ValueError, TypeError):
        return None  # num2words lacks it for this language: say it as written


def _lang(language: str | None) -> str:
    return (language or "en").lower().split("-")[0]


def _unspaced(written: str, rules: LanguageRules) -> str:
    """Other languages' grouping spaces ("1 500", "2 345,67", a no-break or thin space) as the language's group
    mark; beside a mark already there ("1. 500"), dropped."""
    group_mark = "," if rules.decimal_mark == "." else "."
    return re.sub(r"[ \u00a0\u202f]", "" if re.search(r"[,.][ \u00a0\u202f]", written) else group_mark, written)


def _amount(written: str, rules: LanguageRules) -> Decimal | None:
    """'1,234.5' (English), '1.234,5' (German) -> Decimal; None where the marks do not read as one number in this
    language ('1,5' in English, '3.5' in German)."""
    group_mark = "," if rules.decimal_mark == "." else "."
    written = _unspaced(written, rules)
    whole, mark, fraction = written.partition(rules.decimal_mark)
    if (mark and not fraction.isdigit()) or not re.fullmatch(rf"\d{{1,3}}(?:{re.escape(group_mark)}\d{{3}})*|\d+",
                                                                 whole):
        return None
    return Decimal(whole.replace(group_mark, "") + ("." + fraction if mark else ""))


def _words(value: Decimal | int, lang: str, *, to: str = "cardinal") -> str:
    said: str = num2words(value, lang=lang, to=to)
    if lang == "en":  # American reading: no "and", no commas inside a number
        said = said.replace(",", "").replace(" and ", " ")
    return said


def _digits(written: str, lang: str) -> str:
    if lang == "en":
        return " ".join(_EN_DIGITS[int(c)] for c in written if c.isdigit())
    return " ".join(_words(int(c), lang) for c in written if c.isdigit())


def _number(written: str, lang: str, rules: LanguageRules) -> str | None:
    """A quantity said as one; digit by digit where it is not one (a leading zero, too many digits)."""
    written = _unspaced(written, rules)
    plain = written.replace(",", "").replace(".", "")
    value = _amount(written, rules)
    if value is None:
        return None
    integer = written.split(rules.decimal_mark)[0] if rules.decimal_mark in written else written
    if (len(integer) > 1 and integer[0] == "0" and integer.isdigit()) or len(plain) > MAX_CARDINAL_DIGITS:
        return _digits(written, lang)
    if value == value.to_integral_value() and "." not in written and (rules.decimal_mark != "," or "," not in written):
        return _words(int(value), lang)
    if lang == "en":
        whole, _, fraction = written.replace(",", "").partition(".")
        return f"{_words(int(whole or '0'), lang)} point {_digits(fraction, lang)}"
    return _words(value, lang) if rules.decimals else None


def _read_integer(written: str, lang: str, rules: LanguageRules) -> str | None:
    """A number as written; a lone four-digit 1100-2099 in English is a year."""
    if lang == "en" and re.fullmatch(r"\d{4}", written) and int(written) in YEAR_RANGE:
        return _words(int(written), lang, to="year")
    return _number(written, lang, rules)


def _read_number(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["n"]
    said = _number(written, lang, rules) if match["n_neg"] else _read_integer(written, lang, rules)
    if said is None or not match["n_neg"]:
        return said
    return f"{'minus' if lang == 'en' else _words(-1, lang).split()[0]} {said}"


def _read_percent(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    said = _number(match["pc"], lang, rules)
    if said is None:
        return None
    if match["pc_neg"]:
        said = f"{'minus' if lang == 'en' else _words(-1, lang).split()[0]} {said}"
    return rules.percent.format(said)


def _read_money(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    groups = match.groupdict()
    symbol = groups.get("m_sym") or groups["ma_sym"]
    written = groups.get("m_num") or groups["ma_num"]
    said = _say_money(_CURRENCIES[symbol], written, (groups.get("m_mag") or "").lower(), lang, rules)
    return f"minus {said}" if said is not None and groups.get("m_neg") else said


def _read_money_code(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _say_money(_CURRENCY_CODES[match["mc_code"] or match["mc_code2"]], match["mc_num"] or match["mc_num2"],
                      "", lang, rules)


def _read_cents(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    cents = int(match["ce"])
    return f"{_words(cents, lang)} {'cent' if cents == 1 else 'cents'}"


def _read_money_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """$10-$15, $20-30: "ten to fifteen dollars"; with cents, each amount whole."""
    currency = _CURRENCIES[match["mr_sym"]]
    first, last = match["mr_a"], match["mr_b"]
    low, high = _amount(first, rules), _amount(last, rules)
    if low is None or high is None or low >= high:
        return None
    last_said = _say_money(currency, last, "", lang, rules)
    if last_said is None:
        return None
    if low == int(low) and high == int(high):
        return f"{_number(first, lang, rules)} to {last_said}"
    first_said = _say_money(currency, first, "", lang, rules)
    return None if first_said is None else f"{first_said} to {last_said}"


def _say_money(currency: Currency, written: str, magnitude: str, lang: str, rules: LanguageRules) -> str | None:
    value = _amount(written, rules)
    if value is None:
        return None
    if lang != "en":
        if magnitude or not rules.currency:
            return None
        said = str(num2words(value, lang=lang, to="currency", currency=currency.code))
        return _without_zero_cents(said, lang, currency.code) if value == int(value) and value else said
    if magnitude:
        return f"{_number(written, lang, rules)} {_EN_MAGNITUDES[magnitude]} {currency.many}"
    units = int(value)
    cents = int((value - units) * 100) if currency.code != "JPY" else 0
    if value != units and (currency.code == "JPY" or len(written.rpartition(".")[2]) != 2):
        return f"{_number(written, lang, rules)} {currency.many}"  # "$1.5": one point five dollars
    parts = []
    if units or not cents:
        parts.append(f"{_words(units, lang)} {currency.one if units == 1 else currency.many}")
    if cents:
        parts.append(f"{_words(cents, lang)} {currency.cent_one if cents == 1 else currency.cent_many}")
    return " and ".join(parts)


_CENTS_CONJUNCTIONS = frozenset({"und", "et", "con", "e", "y", "ja", "i", "и", "och", "og", "en"})


def _without_zero_cents(said: str, lang: str, code: str) -> str:
    """num2words' "zwanzig Euro und null Cent" for a whole amount: "zwanzig Euro"."""
    zero = str(CONVERTER_CLASSES[lang]._cents_verbose(0, code))
    at = said.rfind(zero)
    if at <= 0:
        return said
    head = said[:at].rstrip().removesuffix("ו").rstrip(" ,")  # (Hebrew glues its "and" to the word)
    last = head.rsplit(" ", 1)
    return last[0].rstrip(" ,") if len(last) == 2 and last[1] in _CENTS_CONJUNCTIONS else head


def _read_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hour, minute = int(match["t_h"]), int(match["t_m"])
    ampm = match["t_ap"]
    if hour > 24 or minute > 59 or (ampm and not 1 <= hour <= 12):
        return None
    if match["t_s"] is not None:  # "1:02:03": a duration or a clock with seconds, said as its numbers
        return " ".join(_words(int(part), lang) for part in (match["t_h"], match["t_m"], match["t_s"]))
    said = _words(hour, lang)
    if minute == 0:
        said += "" if ampm else " hundred" if hour > 12 or match["t_h"].startswith("0") else " o'clock"
    elif minute < 10:
        said += f" oh {_words(minute, lang)}"
    else:
        said += f" {_words(minute, lang)}"
    if ampm:
        said += " a m" if ampm[0] in "aA" else " p m"
    return said


def _read_date(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    year, month, day = int(match["d_y"]), int(match["d_m"]), int(match["d_d"])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    if lang != "en":
        return match[0]  # kept as written: a date is said in a language's own order and words
    return f"{_EN_MONTHS[month - 1]} {_words(day, lang, to='ordinal')}, {_words(year, lang, to='year')}"


def _read_measure(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["u_num"]
    said = _number(written, lang, rules)
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
    return _words(value, lang, to="ordinal")


def _say_digit_groups(groups: Sequence[str], lang: str, *, plus: bool = False) -> str:
    """A phone number's groups, digit by digit, a pause between them ("plus one, four one five, ...")."""
    said = ", ".join(_digits(group, lang) for group in groups)
    return f"{'plus' if lang == 'en' else '+'} {said}" if plus else said


def _read_phone(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    written = match["ph"]
    groups = re.split(r"[ .-]", written.lstrip("+"))
    if sum(map(len, groups)) < 7 or (len(groups) == 2 and (len(groups[0]), len(groups[1])) != (3, 4)):
        return None  # "10-20", "2023-2024", "2 500": a range or a number (the rules after this one)
    if all(len(group) == 3 for group in groups[1:]) and len(groups[0]) <= 3 and written[len(groups[0])] in " .":
        return _number("".join(groups), lang, rules)  # "1.234.567", "1 234 567": thousands grouped
    return _say_digit_groups(groups, lang, plus=written.startswith("+"))


def _read_version(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    parts = match["v"].split(".")
    if len(parts) == 4 and all(int(part) <= 255 for part in parts):  # an IPv4 address
        return " dot ".join(_digits(part, lang) for part in parts)
    return " point ".join(_number(part, lang, rules) or part for part in parts)


def _read_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """"10-20", "9-5" (hours), "3-2" (a score): "ten to twenty", "nine to five", "three to two"; a unit after
    it is said in full ("10-15 min": ten to fifteen minutes)."""
    first, last = match["r_a"], match["r_b"]
    said = f"{_read_integer(first, lang, rules)} to {_read_integer(last, lang, rules)}"
    unit = match["r_u"]
    return f"{said} {_EN_UNITS[unit][1]}" if unit else said


def _read_ratio(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{_read_integer(match['ra_a'], lang, rules)} to {_read_integer(match['ra_b'], lang, rules)}"


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
            said.append(_digits(piece, "en"))
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
    return next(i for i, name in enumerate(_EN_MONTHS) if name.startswith(written[:3]))


def _say_date(month: int, day: int, year: str | None, *, day_first: bool = False) -> str | None:
    if not (1 <= month <= 12 and 1 <= day <= (29 if month == 2 else 30 if month in (4, 6, 9, 11) else 31)):
        return None
    said = (f"the {_words(day, 'en', to='ordinal')} of {_EN_MONTHS[month - 1]}" if day_first
            else f"{_EN_MONTHS[month - 1]} {_words(day, 'en', to='ordinal')}")
    if year is not None:
        said += f", {_read_integer(year, 'en', _LANGUAGES['en'])}"
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
    said = f"{first_said} to {_words(int(last), lang, to='ordinal')}"
    return said + (f", {_read_integer(match['md_y'], lang, rules)}" if match["md_y"] else "")


def _read_day_month(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    said = _say_date(_month(match["dm_m"]) + 1, int(match["dm_d"]), match["dm_y"], day_first=True)
    if said is not None and re.search(r"(?i)\bthe\s*$", match.string[:match.start()]):
        said = said.removeprefix("the ")  # "on the 15th of March": one "the"
    return said


def _read_hour(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hour = int(match["h_h"])
    if not 1 <= hour <= 12:
        return None
    return f"{_words(hour, lang)} {'a m' if match['h_ap'][0] in 'aA' else 'p m'}"


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
    return _say_digit_groups(groups, lang, plus=written.startswith("+"))


def _read_phone_area(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    country = match["pa_cc"]
    groups = [*([country.strip(" .-+")] if country else []), match["pa_area"], *re.split(r"[ .-]", match["pa_rest"])]
    return _say_digit_groups(groups, lang, plus=bool(country))


def _read_vanity(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    code = match["va_code"]
    return f"one {_words(int(code), lang) if code == '800' else _digits(code, lang)} {match['va_word']}"


def _read_emergency(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return "nine one one"


def _read_decade(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    year = match["de_year"]
    said = _words(int(year), lang, to="year") if year else _words(int(match["de_short"]), lang)
    return said[:-1] + "ies" if said.endswith("y") else said + "s"


_EN_FRACTION_NAMES = {2: ("half", "halves"), 4: ("quarter", "quarters")}


def _read_fraction(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """a/b: a fraction with a denominator up to 10 ("3/4": three quarters); else a month and a day ("12/25":
    December twenty-fifth); else the two numbers ("24/7": twenty-four seven)."""
    written_a, b = match["fr_a"], int(match["fr_b"])
    before = match.string[:match.start()]
    if "." in written_a or (b in (5, 10, 100) and re.search(
            r"(?i)\b(?:rated|rating|rates|scored?|scores|level|stars?|reviews?|grade)\W*$", before)):
        return f"{_number(written_a, lang, rules)} out of {_words(b, lang)}"  # a rating: 4.5/5, pain level 3/10
    a = int(written_a)
    if 70 <= a <= 250 and 40 <= b <= 150 and a > b:  # a blood pressure: one twenty over eighty
        high = _words(a, lang) if a < 100 or a % 100 == 0 else (
            f"{_words(a // 100, lang)} {_words(a % 100, lang) if a % 100 >= 10 else 'oh ' + _words(a % 100, lang)}")
        return f"{high} over {_words(b, lang)}"
    if a > 99 or b > 99:
        return None
    if 0 < a < b <= 10:
        return _say_fraction(a, b, lang)
    if 1 <= a <= 12 and b >= 1:
        said = _say_date(a, b, None)
        if said is not None:
            return said
    return f"{_words(a, lang)} {_words(b, lang)}"


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
    return keyword + separator.join(_digits(group, lang) for group in groups)


def _spell(written: str, lang: str) -> str:
    """A code said character by character: its letters one by one, its digits one by one."""
    return " ".join(_digits(piece, lang) if piece.isdigit() else " ".join(piece)
                    for piece in re.findall(r"[A-Za-z]+|\d+", written))


def _read_code_token(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _spell(match["ct"], lang)


def _read_letter_code(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return ", ".join(_spell(part, lang) for part in match["lc"].split("-"))


def _read_zip(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return f"{match['zip_state']} {', '.join(_digits(part, lang) for part in match['zip'].split('-'))}"


def _read_time_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """9am-5pm, 9:30-10:30, 12-2pm: "nine a m to five p m" (one side at least a clock time)."""
    first, last = match["tr_a"], match["tr_b"]
    if not re.search(r"[:aApP]", first + last):
        return None  # two plain numbers: the range rule's
    return f"{spoken_form(first, lang).text.rstrip('.')} to {spoken_form(last, lang).text}"


def _read_day_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    first, last = match["dr_a"], match["dr_b"]
    if (len(first) == 1) != (len(last) == 1):
        return None  # "M-Sat"? not a pair we know
    return f"{_EN_DAYS[first[:3].lower()]} through {_EN_DAYS[last[:3].lower()]}"


def _read_dot_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return spoken_form(f"{match['dt_h']}:{match['dt_m']} {match['dt_ap']}", lang).text


def _read_percent_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    first, last = _number(match["pr_a"], lang, rules), _number(match["pr_b"], lang, rules)
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
    return f"{_EN_MONTHS[int(match['ex_m']) - 1]} {_words(int(match['ex_y']), lang, to='year')}"


_EN_FRACTION_WORDS = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅛": (1, 8), "⅜": (3, 8),
                      "⅝": (5, 8), "⅞": (7, 8)}


def _say_fraction(a: int, b: int, lang: str, *, article: bool = False) -> str:
    one, many = _EN_FRACTION_NAMES.get(b) or (_words(b, lang, to="ordinal"), _words(b, lang, to="ordinal") + "s")
    if a == 1:
        return f"{'a' if article else 'one'} {one}"
    return f"{_words(a, lang)} {many}"


def _read_mixed_fraction(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    a, b = int(match["mf_a"]), int(match["mf_b"])
    if not 0 < a < b <= 10:
        return None
    return f"{_words(int(match['mf_w']), lang)} and {_say_fraction(a, b, lang, article=True)}"


def _read_vulgar(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    a, b = _EN_FRACTION_WORDS[match["vu"]]
    whole = match["vu_w"]
    if whole is None:
        return _say_fraction(a, b, lang)
    return f"{_words(int(whole), lang)} and {_say_fraction(a, b, lang, article=True)}"


def _read_de_article_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """der 3. Anrufer: der dritte; am 1. Januar: am ersten (the weak endings after an article)."""
    article = match["da"]
    ending = "" if article.lower() in ("der", "die", "das") else "n"
    return f"{article} {_words(int(match['dn']), lang, to='ordinal')}{ending}"


def _read_de_date_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    """1. Januar with no article before it ("Montag, 1. Januar"): erster."""
    return _words(int(match["dd"]), lang, to="ordinal") + "r"


def _read_de_year(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return _words(int(match["dy"]), lang, to="year")


def _read_plain_range(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    word = _RANGE_WORDS.get(lang)
    low, high = _number(match["pr_lo"], lang, rules), _number(match["pr_hi"], lang, rules)
    if word is None or low is None or high is None or int(match["pr_lo"]) >= int(match["pr_hi"]):
        return None
    return f"{low} {word} {high}"


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
    return _words(value, lang, to="ordinal") + plural


def _read_fr_time(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    hours = int(match["fh"])
    number = _words(hours, lang)
    number = number[:-2] + "une" if number.endswith("un") else number  # une heure, vingt et une heures
    said = number + (" heure" if hours <= 1 else " heures")
    minutes = match["fm"]
    return f"{said} {_words(int(minutes), lang)}" if minutes and int(minutes) else said


def _read_es_ordinal(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    value, suffix = int(match["eo"]), match["eo_suf"]
    said = _words(value, lang, to="ordinal")
    if suffix == "ª":
        return said[:-1] + "a" if said.endswith("o") else said
    if suffix == "er":
        return said[:-1] if value in (1, 3) and said.endswith("o") else None  # primer, tercer
    if value in (1, 3) and re.match(r"[ \t]+[a-zñ]", match.string[match.end():]):
        return said[:-1]  # before its noun: "1.º piso", el primer piso
    return said


def _read_about(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    before = match.string[:match.start()]
    if re.search(r"(?i)\b(?:about|around|approximately|roughly|approx\.)\s*$", before):
        return ""  # "about ~5": said once
    after = match.string[match.end():match.end() + 1]
    return "about " if after and not after.isalnum() else "about"  # (before "$20": a word of its own)




def _read_kept(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
    return match[0]


def _said_as(words: str) -> Reader:
    """A rule whose match is always said the same: a word ("&": and), or nothing (a markdown mark)."""
    def read(match: re.Match[str], lang: str, rules: LanguageRules) -> str | None:
        return words

    return read


_read_dropped = _said_as("")


_READERS: dict[str, Reader] = {
    "money": _read_money,
    "money_after": _read_money,
    "date": _read_date,
    "phone": _read_phone,
    "time": _read_time,
    "percent": _read_percent,
    "version": _read_version,
    "range": _read_range,
    "ratio": _read_ratio,
    "measure": _read_measure,
    "ordinal": _read_ordinal,
    "number": _read_number,
    "amp": _said_as("and"),
    "keep": _read_kept,
    "times": _said_as("times"),
    "about": _read_about,
    "de_article_ordinal": _read_de_article_ordinal,
    "de_date_ordinal": _read_de_date_ordinal,
    "de_year": _read_de_year,
    "plain_range": _read_plain_range,
    "fr_ordinal": _read_fr_ordinal,
    "fr_time": _read_fr_time,
    "es_ordinal": _read_es_ordinal,
    "md_strike": _read_dropped,
    "emoji": _read_dropped,
    "star": _said_as("star"),
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
    "by": _said_as("by"),
    "times_x": _said_as("times"),
    "plus": _said_as("plus"),
    "equals": _said_as("equals"),
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
    "md_heading": _read_dropped,
    "md_link_open": _read_dropped,
    "md_link_close": _read_dropped,
    "md_bullet": _read_dropped,
    "md_bullet_joined": _read_dropped,
    "md_mark": _read_dropped,
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
_COMPILED: dict[str, tuple[tuple[re.Pattern[str], Reader], ...]] = {}

assert set(_LANGUAGES) <= set(CONVERTER_CLASSES), "every language with rules is one num2words speaks"
