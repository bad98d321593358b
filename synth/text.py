"""Text front-end per variant: the reference's own normaliser and tokenizer, then T3's text ids."""

from __future__ import annotations

from typing import Any

from synth.api import EngineError, Variant

SOT_TOKEN = 255
EOT_TOKEN = 0


def supported_languages() -> dict[str, str]:
    from chatterbox.mtl_tts import SUPPORTED_LANGUAGES

    return dict(SUPPORTED_LANGUAGES)


def text_token_ids(variant: Variant, tokenizer: Any, text: str, language: str | None) -> list[int]:
    """What `generate()` feeds `T3.inference` / `inference_turbo` for one row (SOT/EOT added where used)."""
    if not text.strip():
        raise EngineError("text is empty")
    if variant == "turbo":
        from chatterbox.tts_turbo import punc_norm as turbo_norm

        return list(tokenizer(turbo_norm(text), return_tensors="pt").input_ids[0].tolist())
    if variant == "multilingual":
        from chatterbox.mtl_tts import punc_norm as mtl_norm

        lang = (language or "en").lower()
        if lang not in supported_languages():
            raise EngineError(f"unsupported language {language!r}")
        ids = tokenizer.text_to_tokens(mtl_norm(text), language_id=lang)[0].tolist()
    else:
        from chatterbox.tts import punc_norm

        ids = tokenizer.text_to_tokens(punc_norm(text))[0].tolist()
    return [SOT_TOKEN, *ids, EOT_TOKEN]
