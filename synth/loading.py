"""Load the models the way users have them: a local checkpoint directory, the Hugging Face cache, the hub.

The file layout and load strictness are chatterbox's own `from_local` (tts.py, tts_turbo.py, mtl_tts.py).
We rebuild the modules ourselves rather than calling `from_local` because it hard-codes the full-size
configs; reading the state dict first tells us which preset a checkpoint is (a real one is always full).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.t3 import T3
from chatterbox.models.t3.modules.cond_enc import T3Cond
from chatterbox.models.voice_encoder import VoiceEncoder
from safetensors.torch import load_file

from synth.api import MULTILINGUAL_LANGUAGES, EngineConfig, Variant
from synth.presets import (
    BUILTIN_VOICE_FILE,
    CHECKPOINT_FILES,
    ENGLISH_TEXT_VOCAB,
    HUB_REPOS,
    MULTILINGUAL_TEXT_VOCAB,
    Size,
    build_random_modules,
    build_t3,
    t3_size_of_state,
    write_grapheme_tokenizer,
    write_turbo_tokenizer,
)
from synth.tiny_s3gen import build_s3gen

log = logging.getLogger(__name__)

WeightsKind = Literal["checkpoint", "random"]
CHECKPOINT_ENV = "AGENT_SERVER_CHECKPOINT"
HUB_ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.pt", "*.model"]


@dataclass(slots=True)
class ModelBundle:
    """Everything one variant needs, on its device, in eval mode."""

    variant: Variant
    size: Size
    t3: T3
    s3gen: S3Gen
    ve: VoiceEncoder
    tokenizer: Any  # EnTokenizer | MTLTokenizer | transformers PreTrainedTokenizerFast
    builtin_conds: dict[str, Any] | None  # conds.pt contents ({"t3": {...}, "gen": {...}}) or None
    random_weights: bool
    source: str  # human-readable: the directory, "hf-cache:<dir>", "hub:<repo>", "random-tiny", ...
    device: torch.device


def resolve_device(device: str) -> torch.device:
    """"auto", "cpu", "cuda" or "cuda:N" -> a device; a CUDA one always with its index (this thread's current
    device for a bare "cuda"), so that every engine thread binds the same device (`gpu.bind_thread`: a new thread's
    current device is cuda:0, and torch.cuda.set_device refuses a device without an index)."""
    resolved = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                            "cpu" if device == "auto" else device)
    index: int | None = resolved.index  # (None for a bare "cuda", whatever torch's stubs say)
    if resolved.type == "cuda" and index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def config_problem(config: EngineConfig) -> str | None:
    """What in `config` this machine cannot run, found before any weights load (the CLI refuses to start
    with it: a supervisor restarting the process would not fix it). None: nothing. The engine checks the
    same when it is built."""
    from synth.invariant_ops import bf16_gemms_supported

    device = resolve_device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"device={config.device!r}, but torch finds no CUDA device here"
    for name in ("cuda_graphs", "vocoder_graphs"):
        if getattr(config, name) == "on" and device.type != "cuda":
            return f"{name}='on' needs a CUDA device (device={config.device!r} is {device.type} here)"
    if config.cpu_weights == "bf16" and (device.type != "cpu" or config.dtype != "float32"):
        return "cpu_weights='bf16' is for the CPU with dtype float32 (on a GPU use dtype bfloat16)"
    if config.cpu_vocoder == "bf16" and (device.type != "cpu" or not bf16_gemms_supported()):
        return "cpu_vocoder='bf16' needs the CPU and one with AVX512-BF16 or AMX; use cpu_vocoder='fp32'"
    return None


def load_models(variant: Variant, weights: str, device: str = "auto") -> ModelBundle:
    """`weights`: "random-tiny" | "random-full" | "auto" | a checkpoint directory."""
    dev = resolve_device(device)
    if weights in ("random-tiny", "random-full"):
        size: Size = "tiny" if weights == "random-tiny" else "full"
        return random_bundle(variant, size, dev)
    if weights != "auto":
        return load_checkpoint_dir(Path(weights), variant, dev, source=str(weights))
    found = find_checkpoint(variant)
    if found is not None:
        path, source = found
        return load_checkpoint_dir(path, variant, dev, source=source)
    log.warning("!!! NO CHECKPOINT FOUND for %s: running on RANDOM WEIGHTS (full size). The audio will be noise. "
                "Point --weights (or %s) at a checkpoint directory, or let this machine reach the Hugging Face "
                "hub.", variant, CHECKPOINT_ENV)
    return random_bundle(variant, "full", dev)


def find_checkpoint(variant: Variant) -> tuple[Path, str] | None:
    """The `auto` search: $AGENT_SERVER_CHECKPOINT, then the Hugging Face cache, then a hub download."""
    env_dir = os.environ.get(CHECKPOINT_ENV)
    if env_dir and _is_checkpoint_dir(Path(env_dir), variant):
        return Path(env_dir), env_dir
    from huggingface_hub import snapshot_download

    repo = HUB_REPOS[variant]
    try:
        cached = Path(snapshot_download(repo_id=repo, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
        if _is_checkpoint_dir(cached, variant):
            return cached, f"hf-cache:{cached}"
    except Exception as exc:
        log.info("no %s checkpoint in the Hugging Face cache (%s)", repo, type(exc).__name__)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return None
    try:
        log.info("downloading %s from the Hugging Face hub", repo)
        downloaded = Path(snapshot_download(repo_id=repo, allow_patterns=HUB_ALLOW_PATTERNS,
                                            token=os.environ.get("HF_TOKEN") or None))
        if _is_checkpoint_dir(downloaded, variant):
            return downloaded, f"hub:{repo}"
    except Exception as exc:
        log.warning("hub download of %s failed: %s", repo, exc)
    return None


def _is_checkpoint_dir(path: Path, variant: Variant) -> bool:
    files = CHECKPOINT_FILES[variant]
    return all((path / files[k]).exists() for k in ("ve", "t3", "s3gen"))


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint_dir(directory: Path, variant: Variant, device: torch.device, source: str) -> ModelBundle:
    files = CHECKPOINT_FILES[variant]
    if not _is_checkpoint_dir(directory, variant):
        missing = [files[k] for k in ("ve", "t3", "s3gen") if not (directory / files[k]).exists()]
        raise FileNotFoundError(f"{directory} is not a {variant} checkpoint directory: missing {missing}")

    t3_state = _read_state(directory / files["t3"])
    if "model" in t3_state:  # same quirk as from_local
        t3_state = cast(dict[str, torch.Tensor], t3_state["model"][0])
    size = t3_size_of_state(t3_state)
    t3 = build_t3(variant, size)
    t3.load_state_dict(t3_state)  # strict, as from_local
    if variant == "turbo":
        del t3.tfmr.wte  # as from_local: GPT-2's token embedding is unused (T3 feeds embeddings)

    s3gen = build_s3gen(size, meanflow=(variant == "turbo"))
    s3gen.load_state_dict(_read_state(directory / files["s3gen"]), strict=(variant == "turbo"))

    ve = VoiceEncoder()
    ve.load_state_dict(_read_state(directory / files["ve"]))

    tokenizer = _load_tokenizer(directory, variant)
    conds = None
    if (directory / BUILTIN_VOICE_FILE).exists():
        conds = torch.load(directory / BUILTIN_VOICE_FILE, map_location="cpu", weights_only=True)
    bundle = ModelBundle(variant=variant, size=size, t3=t3, s3gen=s3gen, ve=ve, tokenizer=tokenizer,
                         builtin_conds=conds, random_weights=False, source=source, device=device)
    _to_device(bundle)
    log.info("loaded %s checkpoint (%s preset) from %s on %s", variant, size, source, device)
    return bundle


def _load_tokenizer(directory: Path, variant: Variant) -> Any:
    if variant == "english":
        from chatterbox.models.tokenizers import EnTokenizer

        return EnTokenizer(str(directory / CHECKPOINT_FILES[variant]["tokenizer"]))
    if variant == "multilingual":
        return _load_mtl_tokenizer(directory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


CANGJIE_FILE = "Cangjie5_TC.json"


def _load_mtl_tokenizer(directory: Path) -> Any:
    """MTLTokenizer, with its Chinese Cangjie table read from the checkpoint directory.

    The library fetches that table with `hf_hub_download` inside the constructor, which on a machine
    without network retries for ~25 s before giving up. We hand it the local file when the checkpoint
    has one (from_pretrained downloads it beside the weights) and otherwise make it fail at once: the
    tokenizer then works without Chinese Cangjie conversion, as the library does when the hub is away.
    """
    import chatterbox.models.tokenizers.tokenizer as tok_module

    def local_only(repo_id: str, filename: str, **_: Any) -> str:
        candidate = directory / filename
        if candidate.exists():
            return str(candidate)
        raise FileNotFoundError(f"{filename} not in {directory}")

    original = tok_module.hf_hub_download
    tok_module.hf_hub_download = local_only
    try:
        return tok_module.MTLTokenizer(str(directory / CHECKPOINT_FILES["multilingual"]["tokenizer"]))
    finally:
        tok_module.hf_hub_download = original


def random_bundle(variant: Variant, size: Size, device: torch.device, seed: int = 0) -> ModelBundle:
    """Random weights of the real architecture; tokenizers are synthetic but load through the real classes."""
    import tempfile

    log.warning("!!! %s model on RANDOM WEIGHTS (%s preset): the audio will be noise, timings are real.",
                variant, size)
    t3, s3gen, ve = build_random_modules(variant, size, seed)
    if variant == "turbo":
        del t3.tfmr.wte
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        if variant == "english":
            write_grapheme_tokenizer(tmp_dir / CHECKPOINT_FILES[variant]["tokenizer"], ENGLISH_TEXT_VOCAB)
        elif variant == "multilingual":
            write_grapheme_tokenizer(tmp_dir / CHECKPOINT_FILES[variant]["tokenizer"], MULTILINGUAL_TEXT_VOCAB,
                                     languages=MULTILINGUAL_LANGUAGES)
        else:
            write_turbo_tokenizer(tmp_dir)
        tokenizer = _load_tokenizer(tmp_dir, variant)
    bundle = ModelBundle(variant=variant, size=size, t3=t3, s3gen=s3gen, ve=ve, tokenizer=tokenizer,
                         builtin_conds=None, random_weights=True, source=f"random-{size}", device=device)
    _to_device(bundle)
    return bundle


def _to_device(bundle: ModelBundle) -> None:
    for module in (bundle.t3, bundle.s3gen, bundle.ve):
        module.to(bundle.device).eval()


def builtin_t3_cond(conds: dict[str, Any], device: torch.device) -> T3Cond:
    return T3Cond(**conds["t3"]).to(device=device)
