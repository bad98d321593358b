"""S3Gen's token encoder with the voice prompt's state cached: a render encodes its window's tokens only.

The flow's encoder (`UpsampleConformerEncoder`: a pre-lookahead conv, 6 conformer layers at token rate, a 2x
upsampling conv, 4 conformer layers at frame rate, relative-position self-attention throughout) is what turns
[prompt | window] tokens into the decoder's `mu`. Run as the library runs it, every render re-encodes the
prompt (100 tokens) with the window, and the prompt dominates the cost of a small first chunk.

Here the prompt is encoded once, alone, by the library's own encoder, and what the tokens after it read is
kept (`EncoderPrefix`): every layer's attention keys/values of the prompt positions, and the last prompt
positions that the two convolutions read across the boundary. A window is then encoded on its own
positions: its queries attend to [prompt keys | window keys] with the relative positions they have in
[prompt | window], its convs read the prompt's tail. The prompt positions do not see the window, the same
prefix semantics as the decoder's prompt cache (`synth/vocoder.py`): what one gets from the library's encoder
on [prompt | window] with attention masked so prompt positions see only the prompt, and the prompt's
pre-lookahead conv reading zeros past the prompt's end, as it does when the prompt is encoded alone
(`tests/synth/test_vocoder.py` checks exactly that, with the library's encoder under such a mask).

Only the library's modules and weights are used (`embed`, `pre_lookahead_layer`, each layer's `norm_mha`,
`self_attn` projections and position biases, `norm_ff`, `feed_forward`, `up_layer`, `up_embed`,
`after_norm`, the flow's `input_embedding` and `encoder_proj`); what is written here is the attention over a
cached prefix, which the library's `RelPositionMultiHeadedAttention` cannot do (its `rel_shift` assumes as
many queries as keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.transformer.attention import RelPositionMultiHeadedAttention
from chatterbox.models.s3gen.transformer.embedding import EspnetRelPositionalEncoding
from chatterbox.models.s3gen.transformer.upsample_encoder import UpsampleConformerEncoder

# Prompt positions a window's first positions read through the convs: the pre-lookahead layer's second conv
# (kernel 3, left-padded) reads 2 tokens back; the upsampling conv (kernel 5 after 2x nearest upsampling,
# left-padded) reads 4 frames = 2 tokens back.
PRE_LOOKAHEAD_CONTEXT_TOKENS = 2
UPSAMPLE_CONTEXT_TOKENS = 2
MIN_PREFIX_TOKENS = max(PRE_LOOKAHEAD_CONTEXT_TOKENS, UPSAMPLE_CONTEXT_TOKENS)  # shorter prompts: no cache


@dataclass(frozen=True, slots=True, eq=False)
class EncoderPrefix:
    """A prompt's encoder state; read-only, shared by every render of its voice."""

    mu: torch.Tensor  # [1, 80, 2P] the prompt's own mu (encoded alone)
    embedded_tail: torch.Tensor  # [1, 2, 512] the last prompt positions entering the pre-lookahead layer
    hidden_tail: torch.Tensor  # [1, 512, 2] the last prompt positions entering the upsampling conv
    layer_kv: tuple[torch.Tensor, ...]  # per conformer layer, token-rate then frame-rate: [1, H, P or 2P, 2 d_k]

    @property
    def tokens(self) -> int:
        return int(self.layer_kv[0].shape[2])

    @property
    def nbytes(self) -> int:
        return nbytes_of((self.mu, self.embedded_tail, self.hidden_tail, *self.layer_kv))


def nbytes_of(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PrefixCachedEncoder:
    """Encodes prompts once (`encode_prefix`) and windows after them (`encode_window`) with one flow's encoder."""

    def __init__(self, flow: torch.nn.Module) -> None:
        encoder = flow.encoder
        if not isinstance(encoder, UpsampleConformerEncoder):
            raise RuntimeError(f"prefix cache expects UpsampleConformerEncoder, got {type(encoder).__name__}")
        layers = [*encoder.encoders, *encoder.up_encoders]
        plain = encoder.global_cmvn is None and encoder.normalize_before and all(
            layer.normalize_before and layer.feed_forward_macaron is None and layer.conv_module is None
            and isinstance(layer.self_attn, RelPositionMultiHeadedAttention) for layer in layers)
        position_encodings = (encoder.embed.pos_enc, encoder.up_embed.pos_enc)
        if not plain or not all(isinstance(p, EspnetRelPositionalEncoding) for p in position_encodings):
            raise RuntimeError("prefix cache expects pre-norm conformer layers with espnet relative positions")
        assert encoder.pre_lookahead_layer.conv2.kernel_size == (PRE_LOOKAHEAD_CONTEXT_TOKENS + 1,)
        # The upsampling conv is left-padded by 2 x stride frames (2 tokens), kernel 2 x stride + 1.
        assert encoder.up_layer.conv.kernel_size == (2 * encoder.up_layer.stride + 1,)
        self.flow = flow
        self.encoder = encoder

    @torch.inference_mode()
    def encode_prefix(self, tokens: torch.Tensor) -> EncoderPrefix:
        """tokens [1, P] (P >= 2): the library's encoder on the prompt alone, with what windows need kept."""
        if tokens.shape[0] != 1 or tokens.shape[1] < MIN_PREFIX_TOKENS:
            raise ValueError(f"a cached prompt needs batch 1 and >= {MIN_PREFIX_TOKENS} tokens, "
                             f"got {tuple(tokens.shape)}")
        encoder = self.encoder
        captured: dict[str, torch.Tensor] = {}
        layer_kv: list[torch.Tensor] = []

        def keep_input(name: str):
            def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                captured[name] = args[0]
            return hook

        def keep_kv(_module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            layer_kv.append(output[1])  # the library's own cache layout: cat(keys, values) on the last dim

        handles = [encoder.pre_lookahead_layer.register_forward_pre_hook(keep_input("embedded")),
                   encoder.up_layer.register_forward_pre_hook(keep_input("hidden"))]
        handles += [layer.self_attn.register_forward_hook(keep_kv)
                    for layer in (*encoder.encoders, *encoder.up_encoders)]
        try:
            lengths = torch.tensor([tokens.shape[1]], device=tokens.device)  # [1]
            h, _ = encoder(self.flow.input_embedding(tokens), lengths)  # [1, 2P, 512]
        finally:
            for handle in handles:
                handle.remove()
        mu = self.flow.encoder_proj(h).transpose(1, 2).contiguous()  # [1, 80, 2P]
        assert len(layer_kv) == len(encoder.encoders) + len(encoder.up_encoders)
        return EncoderPrefix(
            mu=mu,
            embedded_tail=captured["embedded"][:, -PRE_LOOKAHEAD_CONTEXT_TOKENS:].contiguous(),  # [1, 2, 512]
            hidden_tail=captured["hidden"][:, :, -UPSAMPLE_CONTEXT_TOKENS:].contiguous(),  # [1, 512, 2]
            layer_kv=tuple(kv.contiguous() for kv in layer_kv),
        )

    @torch.inference_mode()
    def encode_window(self, prefix: EncoderPrefix, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1, W] following the prompt -> their mu [1, 80, 2W]."""
        encoder = self.encoder
        width = tokens.shape[1]
        ones = torch.ones(1, 1, width, dtype=torch.bool, device=tokens.device)  # [1, 1, W]: no padding
        xs, _, _ = encoder.embed(self.flow.input_embedding(tokens), ones)  # [1, W, 512], scaled
        xs = torch.cat([prefix.embedded_tail, xs], dim=1)  # [1, 2 + W, 512]
        xs = encoder.pre_lookahead_layer(xs)[:, PRE_LOOKAHEAD_CONTEXT_TOKENS:]  # [1, W, 512]
        kv = iter(prefix.layer_kv)
        for layer in encoder.encoders:
            xs = _layer_after_prefix(layer, xs, next(kv), encoder.embed.pos_enc)
        hidden = torch.cat([prefix.hidden_tail, xs.transpose(1, 2)], dim=2)  # [1, 512, 2 + W]
        lengths = torch.tensor([hidden.shape[2]], device=hidden.device)  # [1]
        up, _ = encoder.up_layer(hidden, lengths)  # [1, 512, 2 (2 + W)]
        skip_frames = UPSAMPLE_CONTEXT_TOKENS * encoder.up_layer.stride
        xs = up[:, :, skip_frames:].transpose(1, 2)  # [1, 2W, 512]
        xs, _, _ = encoder.up_embed(xs, ones)  # (the mask is passed through unused)
        for layer in encoder.up_encoders:
            xs = _layer_after_prefix(layer, xs, next(kv), encoder.up_embed.pos_enc)
        xs = encoder.after_norm(xs)
        return self.flow.encoder_proj(xs).transpose(1, 2).contiguous()  # [1, 80, 2W]


def _layer_after_prefix(layer: torch.nn.Module, x: torch.Tensor, prefix_kv: torch.Tensor,
                        positions: EspnetRelPositionalEncoding) -> torch.Tensor:
    """One pre-norm conformer layer (attention, feed-forward) on x [1, T, D] following P cached positions."""
    x = x + _attention_after_prefix(layer.self_attn, layer.norm_mha(x), prefix_kv, positions)
    return x + layer.ff_scale * layer.feed_forward(layer.norm_ff(x))


def _attention_after_prefix(attn: RelPositionMultiHeadedAttention, x: torch.Tensor, prefix_kv: torch.Tensor,
                            positions: EspnetRelPositionalEncoding) -> torch.Tensor:
    """Transformer-XL relative-position attention of T queries over [P cached | T new] keys.

    Query i sits at position P + i, key j at position j; the position term of the pair uses the encoding of
    the distance P + i - j, as the library's `rel_shift` gives it when queries and keys are the same T.
    """
    queries = x.shape[1]
    q, k, v = attn.forward_qkv(x, x, x)  # [1, H, T, d_k] each
    prefix_k, prefix_v = prefix_kv.split(attn.d_k, dim=-1)  # [1, H, P, d_k] each
    k = torch.cat([prefix_k, k], dim=2)  # [1, H, P + T, d_k]
    v = torch.cat([prefix_v, v], dim=2)
    keys = k.shape[2]
    positions.extend_pe(x.new_empty(1, keys))
    center = positions.pe.shape[1] // 2  # pe[center - d] encodes distance d (key d positions to the left)
    # Distances run from P + T - 1 (query T - 1, key 0) down to -(T - 1) (query 0, key P + T - 1).
    distance_pe = positions.pe[:, center - (keys - 1): center + queries]  # [1, P + 2T - 1, D]
    p = attn.linear_pos(distance_pe).view(1, -1, attn.h, attn.d_k).transpose(1, 2)  # [1, H, P + 2T - 1, d_k]
    q = q.transpose(1, 2)  # [1, T, H, d_k]
    q_u = (q + attn.pos_bias_u).transpose(1, 2)  # [1, H, T, d_k]
    q_v = (q + attn.pos_bias_v).transpose(1, 2)
    content = torch.matmul(q_u, k.transpose(-2, -1))  # [1, H, T, P + T]
    by_distance = torch.matmul(q_v, p.transpose(-2, -1))  # [1, H, T, P + 2T - 1]
    # Pair (i, j) has distance P + i - j, at index (keys - 1) - (P + i - j) = T - 1 - i + j of by_distance.
    index = (queries - 1 - torch.arange(queries, device=x.device)[:, None]
             + torch.arange(keys, device=x.device)[None, :])  # [T, P + T]
    position = torch.gather(by_distance, 3, index.expand(1, attn.h, queries, keys))  # [1, H, T, P + T]
    weights = torch.softmax((content + position) / math.sqrt(attn.d_k), dim=-1)
    out = torch.matmul(weights, v).transpose(1, 2).reshape(1, queries, attn.h * attn.d_k)  # [1, T, D]
    return attn.linear_out(out)
