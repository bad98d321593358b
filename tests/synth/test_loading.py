"""Random-weight checkpoints written here load back through the real loading paths with equal weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from synth.api import Variant
from synth.loading import find_checkpoint, load_models
from synth.presets import CHECKPOINT_FILES, HUB_REPOS, build_random_modules, write_checkpoint


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, skip: tuple[str, ...] = ()) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    keys = [k for k in sa if not k.startswith(skip)]
    assert keys and all(k in sb for k in keys)
    for k in keys:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("variant", ["english", "turbo", "multilingual"])
def test_checkpoint_dir_roundtrip(tmp_path: Path, variant: Variant) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", variant, "tiny", seed=3)
    for name in ("ve", "t3", "s3gen", "tokenizer"):
        assert (ckpt / CHECKPOINT_FILES[variant][name]).exists()
    bundle = load_models(variant, str(ckpt), device="cpu")
    assert bundle.size == "tiny" and not bundle.random_weights and bundle.source == str(ckpt)
    t3, s3gen, ve = build_random_modules(variant, "tiny", seed=3)
    _assert_same_state(bundle.t3, t3, skip=("tfmr.wte",))
    _assert_same_state(bundle.s3gen, s3gen)
    _assert_same_state(bundle.ve, ve)
    assert not hasattr(bundle.t3.tfmr, "wte") or variant != "turbo"  # from_local drops Turbo's wte too


def test_builtin_voice_is_loaded(tmp_path: Path) -> None:
    t3_conds = {"speaker_emb": torch.randn(1, 256), "cond_prompt_speech_tokens": torch.randint(0, 6561, (1, 150)),
                "emotion_adv": 0.5 * torch.ones(1, 1, 1)}
    conds: dict[str, object] = {
        "t3": t3_conds,
        "gen": {"prompt_token": torch.randint(0, 6561, (1, 50)), "prompt_token_len": torch.tensor([50]),
                "prompt_feat": torch.randn(1, 100, 80), "prompt_feat_len": None, "embedding": torch.randn(1, 192)}}
    ckpt = write_checkpoint(tmp_path / "ckpt", "english", "tiny", builtin_voice=conds)
    bundle = load_models("english", str(ckpt), device="cpu")
    assert bundle.builtin_conds is not None
    assert torch.equal(bundle.builtin_conds["t3"]["speaker_emb"], t3_conds["speaker_emb"])


def test_missing_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "t3_cfg.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"ve\.safetensors"):
        load_models("english", str(tmp_path), device="cpu")


def test_auto_finds_the_hugging_face_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` finds a checkpoint laid out the way huggingface_hub caches a snapshot, with no network."""
    repo_dir = tmp_path / "hub" / ("models--" + HUB_REPOS["english"].replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    write_checkpoint(repo_dir / "snapshots" / revision, "english", "tiny", seed=5)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("AGENT_SERVER_CHECKPOINT", raising=False)
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    found = find_checkpoint("english")
    assert found is not None and found[1].startswith("hf-cache:")
    bundle = load_models("english", "auto", device="cpu")
    assert not bundle.random_weights and bundle.source.startswith("hf-cache:")


def test_auto_without_checkpoint_falls_back_to_random(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("AGENT_SERVER_CHECKPOINT", raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert find_checkpoint("turbo") is None


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_random_bundles_tokenize_alike(variant: Variant) -> None:
    """Two random bundles (any process) give the same text the same ids: the synthetic tokenizers are built in a
    fixed order (Turbo's byte alphabet came in hash-set order, so each bundle tokenized differently and two
    engines on the same seed and weights diverged; seen failing without the sort)."""
    from synth.loading import random_bundle
    from synth.text import text_token_ids

    text = "Hello there, how are you today? 3.14!"
    first, second = (random_bundle(variant, "tiny", torch.device("cpu")) for _ in range(2))
    assert text_token_ids(variant, first.tokenizer, text, None) == text_token_ids(variant, second.tokenizer, text, None)
