"""Which loaded model speaks a request: ONE table, read from the model and language fields clients already send.

A request may name a model: a vendor's (ElevenLabs' `model_id`, OpenAI's `model`, Cartesia's `model_id`, Deepgram's
`model`) or ours (`turbo`, `chatterbox-multilingual`, ...), and a language (ElevenLabs' `language_code`, Cartesia's
`language`, Riva's `language_code`, jambonz's `language`, the native `language`). A name may carry its language as
a last part, as Deepgram's do (`aura-2-celeste-es`); a request without a language field is read that way.

The table maps vendor names (patterns, `*` for any run of characters, first match wins) to the models they prefer,
in order. The first loaded model in that order that speaks the request's language serves it. The built-in table
(`DEFAULT_ROUTES`): low-latency names prefer Turbo, quality names English, and both end with Multilingual, so a
language Turbo and English cannot speak goes to Multilingual when it is loaded. A name no rule matches, and a
request that names none, prefer the table's `default` order, and without one the loaded models in their order
(`--variant`'s: the default model first). Our own names always mean exactly that model: a table cannot send `turbo`
elsewhere.

A request the loaded models cannot serve is refused (`FieldError`, rendered by each protocol in its own shape),
never given another language: the language names a model none of the loaded ones is, or no loaded model in the
name's order speaks it. `--model-routes FILE` replaces the table (JSON, the shape `RouteTable.to_json` gives);
`/v1/status` and the vendors' `/v1/models` show the table in force.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson

from agent_server.errors import FieldError
from synth.api import LANGUAGE_NAMES, VARIANTS, Variant, languages_of

SERVED_MODEL_HEADER = "x-served-model"  # every HTTP answer's (and gRPC call's metadata): the model that spoke it
MODEL_NOT_SERVED = "model_not_served"  # FieldError code: the model named is not loaded here
LANGUAGE_NOT_SERVED = "language_not_served"  # FieldError code: no loaded model (of the name's order) speaks it
BUILT_IN = "built-in"
# Our own names: always exactly that model, whatever the table says.
OWN_NAMES: Mapping[str, Variant] = {
    "english": "english", "chatterbox": "english", "chatterbox-english": "english",
    "turbo": "turbo", "chatterbox-turbo": "turbo",
    "multilingual": "multilingual", "chatterbox-multilingual": "multilingual",
}
_LANGUAGE = re.compile(r"^([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]+)*$")
_NAME_LANGUAGE = re.compile(r"^(.+)-([a-z]{2})$")  # aura-2-celeste-es
# ISO 639-1: a two-letter suffix that is one of these after a name we know is a language (tts-1-zu), not a name.
_ISO_639_1_CODES = """
aa ab ae af ak am an ar as av ay az ba be bg bh bi bm bn bo br bs ca ce ch co cr cs cu cv cy da de dv dz ee el en eo
es et eu fa ff fi fj fo fr fy ga gd gl gn gu gv ha he hi ho hr ht hu hy hz ia id ie ig ii ik io is it iu ja jv ka kg
ki kj kk kl km kn ko kr ks ku kv kw ky la lb lg li ln lo lt lu lv mg mh mi mk ml mn mr ms mt my na nb nd ne ng nl nn
no nr nv ny oc oj om or os pa pi pl ps pt qu rm rn ro ru rw sa sc sd se sg si sk sl sm sn so sq sr ss st su sv sw ta
te tg th ti tk tl tn to tr ts tt tw ty ug uk ur uz ve vi vo wa wo xh yi yo za zh zu"""
ISO_639_1 = frozenset(_ISO_639_1_CODES.split())


@dataclass(frozen=True, slots=True)
class Rule:
    names: tuple[str, ...]  # patterns: `*` is any run of characters; case does not matter
    models: tuple[Variant, ...]  # in the order preferred
    note: str = ""

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern.lower()) for pattern in self.names)


@dataclass(frozen=True, slots=True)
class RouteTable:
    rules: tuple[Rule, ...]
    default: tuple[Variant, ...] = ()  # a name no rule matches, or none: these in order (empty: the loaded order)
    source: str = BUILT_IN

    def order_for(self, name: str) -> tuple[Variant, ...]:
        """The models a vendor name prefers (empty: the loaded order)."""
        rule = next((rule for rule in self.rules if rule.matches(name)), None)
        return rule.models if rule is not None else self.default

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "routes": [{"names": list(rule.names), "models": list(rule.models), **({"note": rule.note} if rule.note
                                                                                  else {})} for rule in self.rules],
            "default": list(self.default) or "the loaded models, the default first",
            "own_names": dict(OWN_NAMES),
        }

    @classmethod
    def from_json(cls, data: object, source: str) -> RouteTable:
        """A table from its JSON (the file of --model-routes). Raises ValueError naming the place at fault."""
        if not isinstance(data, dict) or not set(data) <= {"routes", "default", "source", "own_names"}:
            raise ValueError("a route table is a JSON object with `routes` (and optionally `default`)")
        routes = data.get("routes")
        if not isinstance(routes, list):
            raise ValueError("`routes` must be a list of {\"names\": [...], \"models\": [...]}")
        rules = []
        for i, item in enumerate(routes):
            where = f"routes[{i}]"
            if not isinstance(item, dict) or not set(item) <= {"names", "models", "note"}:
                raise ValueError(f"{where} must be an object with `names`, `models` (and optionally `note`)")
            names = item.get("names")
            if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"{where}.names must be a list of model names (patterns with *)")
            own = [n for n in names if n.lower() in OWN_NAMES]
            if own:
                raise ValueError(f"{where}.names: {own[0]!r} is one of our own names, which always mean that model")
            note = item.get("note", "")
            if not isinstance(note, str):
                raise ValueError(f"{where}.note must be a string")
            rules.append(Rule(tuple(names), _models(item.get("models"), f"{where}.models"), note))
        default = data.get("default")
        if default is None or isinstance(default, str):  # (to_json's description of the loaded order)
            return cls(tuple(rules), (), source)
        return cls(tuple(rules), _models(default, "default"), source)


def _models(value: object, where: str) -> tuple[Variant, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a list of models ({', '.join(VARIANTS)})")
    for name in value:
        if name not in VARIANTS:
            raise ValueError(f"{where}: {name!r} is not a model ({', '.join(VARIANTS)})")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} names a model twice")
    return tuple(cast(Variant, name) for name in value)


FAST: tuple[Variant, ...] = ("turbo", "english", "multilingual")
QUALITY: tuple[Variant, ...] = ("english", "turbo", "multilingual")
DEFAULT_ROUTES = RouteTable((
    Rule(("eleven_flash_*", "eleven_turbo_*", "tts-1", "sonic-turbo*", "aura-*", "aura"), FAST, "low latency"),
    Rule(("eleven_*", "tts-1-hd", "gpt-4o*", "sonic*"), QUALITY, "quality"),
))


def load_routes(path: Path) -> RouteTable:
    """The table of a --model-routes file. Raises ValueError saying what is wrong (the file named)."""
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    try:
        return RouteTable.from_json(data, str(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Routed:
    """The model that serves a request, and the language it is asked in."""

    model: Variant
    language: str | None  # a code of LANGUAGE_NAMES for Multilingual; None: the model's own (English)


class Router:
    """The table over the models this server loaded (the default first)."""

    __slots__ = ("loaded", "table")

    def __init__(self, table: RouteTable, loaded: Sequence[Variant]) -> None:
        self.table = table
        self.loaded = tuple(loaded)

    def route(self, *, model_field: str = "model", model: str | None = None, language_field: str = "language",
              language: str | None = None) -> Routed:
        """The model for a request's model name and language (either may be absent). Raises FieldError naming the
        field at fault, with MODEL_NOT_SERVED or LANGUAGE_NOT_SERVED when the loaded models cannot serve it."""
        code = _language_code(language_field, language)
        name = (model or "").strip().lower()
        named_language = _NAME_LANGUAGE.match(name)
        if named_language is not None and self._says_language(name, named_language.group(1), named_language.group(2)):
            name = named_language.group(1)
            if code is None:
                code, language_field = named_language.group(2), model_field
            elif code != named_language.group(2):
                raise FieldError(language_field, f"{language!r} differs from the language of the model "
                                                 f"{model!r} ({named_language.group(2)!r})")
        own = OWN_NAMES.get(name)
        if own is not None:
            if own not in self.loaded:
                raise FieldError(model_field, f"this server does not run {model!r} (it runs {self._runs()})",
                                 MODEL_NOT_SERVED)
            order: tuple[Variant, ...] = (own,)
        else:
            order = tuple(m for m in self.table.order_for(name) or self.loaded if m in self.loaded)
            if not order:
                raise FieldError(model_field, f"{model!r} is served by {', '.join(self.table.order_for(name))}, none "
                                              f"of which this server runs (it runs {self._runs()})", MODEL_NOT_SERVED)
        for candidate in order:
            if code is None or code in languages_of(candidate):
                return Routed(candidate, code if candidate == "multilingual" else None)
        assert code is not None  # (with no language the first candidate serves)
        raise FieldError(language_field, self._unspoken(code, model, order), LANGUAGE_NOT_SERVED)

    def _says_language(self, name: str, stem: str, suffix: str) -> bool:
        """Whether `name` is `stem` + a language suffix: a language some model speaks (aura-2-celeste-es), or another
        ISO 639-1 code after a name we know that the whole name is not (tts-1-zu: Zulu, refused; tts-1-hd: a name)."""
        return suffix in LANGUAGE_NAMES or (suffix in ISO_639_1 and self._known(stem) and not self._known(name))

    def _known(self, name: str) -> bool:
        return name in OWN_NAMES or any(rule.matches(name) for rule in self.table.rules)

    def names_served_by(self, model: Variant) -> list[str]:
        """The model names a request in English (or naming no language) reaches `model` with here: our own names
        for it, the table's patterns whose first loaded model it is, and `*` (any other name, and none) for the
        default order's first."""
        names = [name for name, own in OWN_NAMES.items() if own == model and model in self.loaded]
        for rule in self.table.rules:
            first = next((m for m in rule.models if m in self.loaded), None)
            if first == model:
                names += rule.names
        fallback = next((m for m in self.table.default or self.loaded if m in self.loaded), None)
        return [*names, "*"] if fallback == model else names

    def _runs(self) -> str:
        return ", ".join(self.loaded)

    def _unspoken(self, code: str, model: str | None, order: tuple[Variant, ...]) -> str:
        said = f"{code!r} ({LANGUAGE_NAMES[code]})" if code in LANGUAGE_NAMES else repr(code)
        speakers = [m for m in VARIANTS if code in languages_of(m)]
        if not speakers:
            return f"no model speaks {said}"
        if speakers[0] not in self.loaded:
            return f"no model this server runs speaks {said}: {', '.join(speakers)} would, and it is not loaded " \
                   f"here (it runs {self._runs()})"
        return f"the model {model!r} is served by {', '.join(order)} here, which do not speak {said}"


def _language_code(field: str, requested: str | None) -> str | None:
    """"en", "en-US", "fr_FR" -> the 2-3 letter code; None when not given."""
    if not requested:
        return None
    match = _LANGUAGE.match(requested)
    if match is None:
        raise FieldError(field, f"not a language code: {requested!r}")
    return match.group(1).lower()
