"""Random-weight models of the real Chatterbox architectures, and checkpoint files in chatterbox's layout.

Weights cannot be downloaded on our machines, so tests and benchmarks run on randomly initialised
instances of the library's own classes: `full` has the true sizes (cost is real), `tiny` shrinks the
widths and depths (what tests use). `write_checkpoint` lays such a model out exactly the way
chatterbox's `from_local` reads a downloaded one, so tests exercise the real loading path.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.t3 import T3
from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
from chatterbox.models.t3.modules.perceiver import Perceiver
from chatterbox.models.t3.modules.t3_config import T3Config
from chatterbox.models.voice_encoder import VoiceEncoder
from safetensors.torch import save_file

from synth.api import MULTILINGUAL_LANGUAGES, Variant

log = logging.getLogger(__name__)

Size = Literal["tiny", "full"]

TINY_WIDTH = 64
TINY_LAYERS = 2
TINY_HEADS = 4
PERCEIVER_QUERY_TOKENS = 32
PERCEIVER_HEADS = 4

ENGLISH_TEXT_VOCAB = 704
MULTILINGUAL_TEXT_VOCAB = 2454
TURBO_TEXT_VOCAB = 50276
TURBO_SPEECH_VOCAB = 6563
TURBO_PROMPT_TOKENS = 375

# File names, exactly as chatterbox's `from_local` reads them.
CHECKPOINT_FILES: dict[Variant, dict[str, str]] = {
    "english": {"ve": "ve.safetensors", "t3": "t3_cfg.safetensors", "s3gen": "s3gen.safetensors",
                "tokenizer": "tokenizer.json"},
    "turbo": {"ve": "ve.safetensors", "t3": "t3_turbo_v1.safetensors", "s3gen": "s3gen_meanflow.safetensors",
              "tokenizer": "tokenizer.json"},
    "multilingual": {"ve": "ve.pt", "t3": "t3_mtl23ls_v2.safetensors", "s3gen": "s3gen.pt",
                     "tokenizer": "grapheme_mtl_merged_expanded_v1.json"},
}
HUB_REPOS: dict[Variant, str] = {
    "english": "ResembleAI/chatterbox",
    "turbo": "ResembleAI/chatterbox-turbo",
    "multilingual": "ResembleAI/chatterbox",
}
BUILTIN_VOICE_FILE = "conds.pt"

_TINY_LLAMA = "Llama_tiny_agent_server"
_TINY_GPT2 = "GPT2_tiny_agent_server"
# Tiny width, but deep and wide enough to have the multilingual alignment analyzer's heads ((12, 15), (13, 11),
# (9, 2)): for the tests of that analyzer only (14 layers cost more than the 2 every other test uses).
TINY_ALIGNED_LLAMA = "Llama_tiny_aligned_agent_server"
TINY_ALIGNED_LAYERS = 14
TINY_ALIGNED_HEADS = 16
# heads x head size (256) need not be the width (64) in a Llama; 16 is the smallest head the CPU's decode attention
# kernel takes (synth/decode_attention.py), so the analyzer's tests run the CPU's compact steps too
TINY_ALIGNED_HEAD_DIM = 16


def _register_tiny_configs() -> None:
    """Add tiny backbones to chatterbox's config table (T3.__init__ looks configs up by name there)."""
    if _TINY_LLAMA not in LLAMA_CONFIGS:
        llama = copy.deepcopy(LLAMA_CONFIGS["Llama_520M"])
        llama.update(hidden_size=TINY_WIDTH, intermediate_size=4 * TINY_WIDTH, num_hidden_layers=TINY_LAYERS,
                     num_attention_heads=TINY_HEADS, num_key_value_heads=TINY_HEADS,
                     head_dim=TINY_WIDTH // TINY_HEADS)
        LLAMA_CONFIGS[_TINY_LLAMA] = llama
    if TINY_ALIGNED_LLAMA not in LLAMA_CONFIGS:
        llama = copy.deepcopy(LLAMA_CONFIGS[_TINY_LLAMA])
        llama.update(num_hidden_layers=TINY_ALIGNED_LAYERS, num_attention_heads=TINY_ALIGNED_HEADS,
                     num_key_value_heads=TINY_ALIGNED_HEADS, head_dim=TINY_ALIGNED_HEAD_DIM)
        LLAMA_CONFIGS[TINY_ALIGNED_LLAMA] = llama
    if _TINY_GPT2 not in LLAMA_CONFIGS:
        gpt2 = copy.deepcopy(LLAMA_CONFIGS["GPT2_medium"])
        gpt2.update(n_embd=TINY_WIDTH, hidden_size=TINY_WIDTH, n_layer=TINY_LAYERS, n_head=TINY_HEADS)
        LLAMA_CONFIGS[_TINY_GPT2] = gpt2


def t3_config(variant: Variant, size: Size) -> T3Config:
    """The T3 hyper-parameters chatterbox uses for `variant` (Turbo's are set inline in tts_turbo.py)."""
    _register_tiny_configs()
    if variant == "english":
        hp = T3Config.english_only()
    elif variant == "multilingual":
        hp = T3Config.multilingual()
    else:
        hp = T3Config(text_tokens_dict_size=TURBO_TEXT_VOCAB)
        hp.llama_config_name = "GPT2_medium"
        hp.speech_tokens_dict_size = TURBO_SPEECH_VOCAB
        hp.input_pos_emb = None
        hp.speech_cond_prompt_len = TURBO_PROMPT_TOKENS
        hp.use_perceiver_resampler = False
        hp.emotion_adv = False
    if size == "tiny":
        hp.llama_config_name = _TINY_GPT2 if variant == "turbo" else _TINY_LLAMA
    return hp


def build_t3(variant: Variant, size: Size, backbone: str | None = None) -> T3:
    """chatterbox's T3 class, random weights. Tiny also swaps in a Perceiver of the tiny width (the
    library builds it at width 1024 whatever the backbone), so conditioning keeps its 34 positions.
    `backbone` overrides the backbone config name (e.g. TINY_ALIGNED_LLAMA)."""
    hp = t3_config(variant, size)
    if backbone is not None:
        hp.llama_config_name = backbone
    t3 = T3(hp)
    if size == "tiny" and t3.cond_enc.perceiver is not None:
        t3.cond_enc.perceiver = Perceiver(pre_attention_query_token=PERCEIVER_QUERY_TOKENS,
                                          pre_attention_query_size=TINY_WIDTH, embedding_dim=TINY_WIDTH,
                                          num_attn_heads=PERCEIVER_HEADS)
    return t3.eval()


# --- the peaky tiny preset ---------------------------------------------------------------------------------
# Random init leaves a tiny T3 nearly flat: HF inits the projections with std 0.02 and the learned positions with
# 0.01-0.02, so attention is uniform (positions and RoPE cannot matter), the blocks add almost nothing to the
# residual stream and the head's logits have std ~0.6. A wrong position id, a 10 % wrong CFG weight, a missing
# uncond key or a dropped penalty then changes no sampled token. `make_peaky_` rescales the same random weights
# (no new randomness: deterministic in the preset's seed) so that:
#   - every projection has output rows of norm PEAKY_PROJECTION_GAIN (the blocks write O(1) into the residual);
#   - queries and keys rows of norm sqrt(PEAKY_SCORE_STD): attention scores have std ~PEAKY_SCORE_STD, so which
#     key sits at which position (RoPE, GPT-2's wpe) changes the output;
#   - learned text/speech/GPT-2 positions have std PEAKY_POSITION_STD (comparable to the token embeddings);
#   - the speech head's rows have norm PEAKY_LOGIT_STD: logits of std ~3 over the speech vocabulary, so the
#     top tokens carry real mass and min_p / top_p / the repetition penalty / CFG move the sample.
PEAKY_LOGIT_STD = 3.0
PEAKY_SCORE_STD = 3.0
PEAKY_PROJECTION_GAIN = 1.0
PEAKY_POSITION_STD = 1.0


def _rescale_rows_(weight: torch.Tensor, row_norm: float, out_dim: int) -> None:
    """Scale `weight` in place so its output rows (dimension `out_dim`) have RMS norm `row_norm` over inputs."""
    in_dim = 1 - out_dim
    rms = weight.pow(2).sum(dim=in_dim).mean().sqrt()
    weight.mul_(row_norm / rms)


def _rescale_std_(weight: torch.Tensor, std: float) -> None:
    weight.mul_(std / weight.std())


@torch.no_grad()
def make_peaky_(t3: T3) -> T3:
    """Rescale a (tiny) random T3's weights in place so its next-token distribution is sharply peaked and
    positions matter (see PEAKY_*); works on Llama (English, Multilingual) and GPT-2 (Turbo) backbones."""
    score_gain = PEAKY_SCORE_STD ** 0.5
    tfmr = t3.tfmr
    if t3.is_gpt:
        dim = t3.cfg.n_embd
        for block in tfmr.h:
            c_attn = block.attn.c_attn.weight  # Conv1D: [in, 3*dim], columns (q | k | v)
            for part, gain in ((0, score_gain), (1, score_gain), (2, PEAKY_PROJECTION_GAIN)):
                _rescale_rows_(c_attn[:, part * dim:(part + 1) * dim], gain, out_dim=1)
            for conv in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                _rescale_rows_(conv.weight, PEAKY_PROJECTION_GAIN, out_dim=1)
        _rescale_std_(tfmr.wpe.weight, PEAKY_POSITION_STD)
    else:
        for layer in tfmr.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear, gain in ((attn.q_proj, score_gain), (attn.k_proj, score_gain),
                                 (attn.v_proj, PEAKY_PROJECTION_GAIN), (attn.o_proj, PEAKY_PROJECTION_GAIN),
                                 (mlp.gate_proj, PEAKY_PROJECTION_GAIN), (mlp.up_proj, PEAKY_PROJECTION_GAIN),
                                 (mlp.down_proj, PEAKY_PROJECTION_GAIN)):
                _rescale_rows_(linear.weight, gain, out_dim=0)
    if t3.hp.input_pos_emb == "learned":
        _rescale_std_(t3.text_pos_emb.emb.weight, PEAKY_POSITION_STD)
        _rescale_std_(t3.speech_pos_emb.emb.weight, PEAKY_POSITION_STD)
    _rescale_rows_(t3.speech_head.weight, PEAKY_LOGIT_STD, out_dim=0)
    return t3


def t3_size_of_state(state: dict[str, torch.Tensor]) -> Size:
    """Which preset a T3 state dict belongs to (a real checkpoint is always `full`)."""
    width = state["speech_emb.weight"].shape[1]
    return "full" if width == LLAMA_CONFIGS["Llama_520M"]["hidden_size"] else "tiny"


# --- tokenizers --------------------------------------------------------------------------------------------

_GRAPHEME_SPECIALS = ["[STOP]", "[UNK]", "[SPACE]", "[START]", "[PAD]", "[SEP]", "[CLS]", "[MASK]"]


def _grapheme_vocab(vocab_size: int, languages: tuple[str, ...]) -> dict[str, int]:
    """A character-level vocabulary with no holes: specials, language tags, ASCII, Latin-1, then more BMP."""
    vocab: dict[str, int] = {}
    for tok in _GRAPHEME_SPECIALS + [f"[{lang}]" for lang in languages]:
        vocab[tok] = len(vocab)
    code_point = 0x21
    while len(vocab) < vocab_size:
        ch = chr(code_point)
        if ch.isprintable() and not ch.isspace() and ch not in vocab:
            vocab[ch] = len(vocab)
        code_point += 1
    return vocab


def write_grapheme_tokenizer(path: Path, vocab_size: int, languages: tuple[str, ...] = ()) -> None:
    """A `tokenizers` BPE file with no merges (one token per character), like chatterbox's grapheme files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = _grapheme_vocab(vocab_size, languages)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.add_special_tokens(_GRAPHEME_SPECIALS + [f"[{lang}]" for lang in languages])
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.save(str(path))


def write_turbo_tokenizer(directory: Path) -> None:
    """A byte-level BPE (256 byte tokens, no merges) saved the way `AutoTokenizer.from_pretrained` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # sorted: alphabet() comes in hash-set order, which changes from process to process (and from call to call):
    # unsorted, every random Turbo bundle tokenized the same text differently
    byte_vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    byte_vocab["<|endoftext|>"] = len(byte_vocab)
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.save_pretrained(str(directory))


# --- whole checkpoints -------------------------------------------------------------------------------------

def build_random_modules(variant: Variant, size: Size, seed: int = 0,
                         peaky: bool = False) -> tuple[T3, S3Gen, VoiceEncoder]:
    """Random T3, S3Gen and VoiceEncoder of `variant` at `size`, deterministic in `seed`; `peaky` rescales
    T3 with `make_peaky_` (the equivalence tests' preset)."""
    from synth.tiny_s3gen import build_s3gen

    devnull_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        t3 = build_t3(variant, size)
        s3gen = build_s3gen(size, meanflow=(variant == "turbo"))
        ve = VoiceEncoder().eval()
    finally:
        torch.set_rng_state(devnull_state)
    if peaky:
        make_peaky_(t3)
    return t3, s3gen, ve


def write_checkpoint(directory: Path, variant: Variant, size: Size = "tiny", seed: int = 0,
                     builtin_voice: dict[str, object] | None = None, peaky: bool = False) -> Path:
    """Write a random-weight checkpoint of `variant` in the file layout chatterbox's `from_local` reads.

    `builtin_voice`, if given, is a `Conditionals`-style dict (`{"t3": {...}, "gen": {...}}`) saved as conds.pt.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files = CHECKPOINT_FILES[variant]
    t3, s3gen, ve = build_random_modules(variant, size, seed, peaky=peaky)
    t3_state = {k: v.contiguous() for k, v in t3.state_dict().items()}
    s3_state = {k: v.contiguous() for k, v in s3gen.state_dict().items()}
    ve_state = {k: v.contiguous() for k, v in ve.state_dict().items()}
    save_file(t3_state, str(directory / files["t3"]))
    if variant == "multilingual":
        torch.save(ve_state, directory / files["ve"])
        torch.save(s3_state, directory / files["s3gen"])
        write_grapheme_tokenizer(directory / files["tokenizer"], MULTILINGUAL_TEXT_VOCAB,
                                 languages=MULTILINGUAL_LANGUAGES)
    else:
        save_file(ve_state, str(directory / files["ve"]))
        save_file(s3_state, str(directory / files["s3gen"]))
        if variant == "english":
            write_grapheme_tokenizer(directory / files["tokenizer"], ENGLISH_TEXT_VOCAB)
        else:
            write_turbo_tokenizer(directory)
    if builtin_voice is not None:
        torch.save(builtin_voice, directory / BUILTIN_VOICE_FILE)
    log.info("wrote random %s/%s checkpoint to %s", variant, size, directory)
    return directory




def synthetic_reference_wav(sample_rate_hz: int, seconds: float = 8.0, seed: int = 1234) -> np.ndarray:
    """A deterministic voice-like clip (harmonics with a wandering pitch, syllable envelope, breath noise).

    Used as the default voice when weights are random: there is no real voice to clone, but every voice
    code path (S3 tokenizer, x-vector, voice encoder, T3 prompt) runs on it as on a real clip.
    """
    rng = np.random.default_rng(seed)
    t_s = np.arange(int(seconds * sample_rate_hz)) / sample_rate_hz
    f0_hz = 140.0 + 25.0 * np.sin(2 * np.pi * 0.7 * t_s) + 10.0 * np.sin(2 * np.pi * 2.3 * t_s)
    phase = 2 * np.pi * np.cumsum(f0_hz) / sample_rate_hz
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 3.5 * t_s)) ** 2
    wav = 0.25 * envelope * voiced + 0.01 * rng.standard_normal(t_s.size)
    return (wav / np.abs(wav).max() * 0.8).astype(np.float32)
