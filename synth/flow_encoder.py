"""S3Gen's token encoder as an explicit batched function, with the voice prompt's state cached.

The flow's encoder (`UpsampleConformerEncoder`: a pre-lookahead conv, 6 conformer layers at token rate, a 2x
upsampling conv, 4 conformer layers at frame rate, relative-position self-attention throughout) is what turns
[prompt | window] tokens into the decoder's `mu`. Run as the library runs it, every render re-encodes the
prompt (100 tokens) with the window, and the prompt dominates the cost of a small first chunk.

Here the prompt is encoded once, alone (`encode` with an empty prefix, keeping what windows need:
`EncoderPrefix`): every layer's attention keys/values of the prompt positions, and the last prompt positions
that the two convolutions read across the boundary. A window is then encoded on its own positions: its
queries attend to [prompt keys | window keys] with the relative positions they have in [prompt | window], its
convs read the prompt's tail. The prompt positions do not see the window, the same prefix semantics as the
estimator's (`synth/flow_estimator.py`): what one gets from the library's encoder on [prompt | window] with
attention masked so prompt positions see only the prompt, and the prompt's pre-lookahead conv reading zeros
past the prompt's end, as it does when the prompt is encoded alone (`tests/synth/test_vocoder.py` checks
exactly that, with the library's encoder under such a mask).

Batches: windows of different lengths are right-padded to one length; padded positions are zeroed before the
pre-lookahead conv (which reads 3 tokens ahead, and reads zeros past a window's end when it runs alone) and
are never attended to; the upsampling conv and everything after it only read backwards or per position.
Prefixes of shorter prompts are left-padded (relative distances are kept) and masked. So every row's `mu` is
what its window gives alone (to float rounding; bitwise with the row-invariant kernels of
`synth/invariant_ops.py` when the padded lengths are equal).

Only the library's modules and weights are used (`embed`, `pre_lookahead_layer`, each layer's `norm_mha`,
`self_attn` projections and position biases, `norm_ff`, `feed_forward`, `up_layer`, `up_embed`,
`after_norm`, the flow's `input_embedding` and `encoder_proj`); what is written here is the attention over a
cached prefix, which the library's `RelPositionMultiHeadedAttention` cannot do (its `rel_shift` assumes as
many queries as keys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.transformer.attention import (
    RelPositionMultiHeadedAttention,
)
from chatterbox.models.s3gen.transformer.embedding import EspnetRelPositionalEncoding
from chatterbox.models.s3gen.transformer.upsample_encoder import (
    UpsampleConformerEncoder,
)

from synth import invariant_ops as ops
from synth.render_checkpoints import checkpoint

# Prompt positions a window's first positions read through the convs: the pre-lookahead layer's second conv
# (kernel 3, left-padded) reads 2 tokens back; the upsampling conv (kernel 5 after 2x nearest upsampling,
# left-padded) reads 4 frames = 2 tokens back.
PRE_LOOKAHEAD_CONTEXT_TOKENS = 2
UPSAMPLE_CONTEXT_TOKENS = 2
MIN_PREFIX_TOKENS = max(PRE_LOOKAHEAD_CONTEXT_TOKENS, UPSAMPLE_CONTEXT_TOKENS)  # shorter prompts: no cache
POSITION_TABLE_POSITIONS = 4096  # relative-position table built once (longer windows extend it)


@dataclass(frozen=True, slots=True, eq=False)
class EncoderPrefix:
    """A prompt's encoder state (or a batch of them, one row each); read-only, shared by every render."""

    mu: torch.Tensor  # [B, 2P, 80] the prompt's own mu (encoded alone)
    embedded_tail: torch.Tensor  # [B, 2 or 0, 512] the last prompt positions entering the pre-lookahead layer
    hidden_tail: torch.Tensor  # [B, 2 or 0, 512] the last prompt positions entering the upsampling conv
    layer_kv: tuple[torch.Tensor, ...]  # per conformer layer, token-rate then frame-rate: [B, H, P or 2P, 2 d_k]
    key_mask: torch.Tensor  # [B, P] bool, token rate: False for the left padding of a shorter prompt
    token_layers: int  # how many of layer_kv are token-rate (the rest are frame-rate)

    @property
    def tokens(self) -> int:
        return int(self.key_mask.shape[1])

    @property
    def nbytes(self) -> int:
        return nbytes_of((self.mu, self.embedded_tail, self.hidden_tail, *self.layer_kv, self.key_mask))

    @staticmethod
    def empty(batch: int, layers: int, token_layers: int, heads: int, d_k: int, width: int, device: torch.device,
              dtype: torch.dtype) -> EncoderPrefix:
        """No prompt: windows are encoded alone, exactly as the library encodes them."""
        return EncoderPrefix(
            mu=torch.zeros(batch, 0, 80, device=device, dtype=dtype),
            embedded_tail=torch.zeros(batch, 0, width, device=device, dtype=dtype),
            hidden_tail=torch.zeros(batch, 0, width, device=device, dtype=dtype),
            layer_kv=tuple(torch.zeros(batch, heads, 0, 2 * d_k, device=device, dtype=dtype) for _ in range(layers)),
            key_mask=torch.zeros(batch, 0, dtype=torch.bool, device=device), token_layers=token_layers)

    @staticmethod
    def cat(parts: list[EncoderPrefix]) -> EncoderPrefix:
        """Several prefixes (of equal token count) as one batch: one op per tensor slot."""
        return EncoderPrefix(
            mu=batch_rows([p.mu for p in parts]),
            embedded_tail=batch_rows([p.embedded_tail for p in parts]),
            hidden_tail=batch_rows([p.hidden_tail for p in parts]),
            layer_kv=tuple(batch_rows(layer) for layer in zip(*(p.layer_kv for p in parts), strict=False)),
            key_mask=batch_rows([p.key_mask for p in parts]), token_layers=parts[0].token_layers)

    def left_padded(self, tokens: int) -> EncoderPrefix:
        """The same prefix with `tokens` key positions, the missing ones in front and masked."""
        missing = tokens - self.tokens
        if missing < 0:
            raise ValueError(f"prefix of {self.tokens} tokens is longer than {tokens}")
        if missing == 0:
            return self
        return EncoderPrefix(
            mu=self.mu, embedded_tail=self.embedded_tail, hidden_tail=self.hidden_tail,
            layer_kv=tuple(F.pad(kv, (0, 0, missing * (1 if i < self.token_layers else 2), 0))
                           for i, kv in enumerate(self.layer_kv)),
            key_mask=F.pad(self.key_mask, (missing, 0), value=False), token_layers=self.token_layers)


def nbytes_of(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def batch_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Several streams' cached prompt tensors [1, ...] as one batch [n, ...]: a view of the one tensor when every
    stream has the same voice (no copy; its readers concatenate it with the window's own keys or inputs, which
    copies once anyway), else their concatenation. One op either way, whatever the number of streams."""
    first = parts[0]
    if first.shape[0] == 1 and all(part is first for part in parts):
        return first.expand(len(parts), *first.shape[1:])
    return torch.cat(list(parts))


class _Layer:
    def __init__(self, layer: Any, kernels: ops.Kernels) -> None:
        attn = layer.self_attn
        self.norm_mha, self.norm_ff, self.ff_scale = layer.norm_mha, layer.norm_ff, float(layer.ff_scale)
        self.heads, self.d_k = int(attn.h), int(attn.d_k)
        self.linear_q, self.linear_k, self.linear_v = (ops.Linear.of(attn.linear_q, kernels),
                                                       ops.Linear.of(attn.linear_k, kernels),
                                                       ops.Linear.of(attn.linear_v, kernels))
        self.linear_out, self.linear_pos = ops.Linear.of(attn.linear_out, kernels), ops.Linear.of(attn.linear_pos,
                                                                                                    kernels)
        self.pos_bias_u, self.pos_bias_v = attn.pos_bias_u, attn.pos_bias_v  # [H, d_k]
        ff = layer.feed_forward
        self.ff_in, self.ff_activation, self.ff_out = ops.Linear.of(ff.w_1, kernels), ff.activation, \
            ops.Linear.of(ff.w_2, kernels)


class PrefixCachedEncoder:
    """Encodes prompts once and windows after them, in batches, with one flow's encoder (callers set the grad
    mode: inference mode, or no_grad under torch.compile)."""

    def __init__(self, flow: Any, kernels: ops.Kernels) -> None:
        encoder = flow.encoder
        if not isinstance(encoder, UpsampleConformerEncoder):
            raise TypeError(f"prefix cache expects UpsampleConformerEncoder, got {type(encoder).__name__}")
        layers = [*encoder.encoders, *encoder.up_encoders]
        plain = encoder.global_cmvn is None and encoder.normalize_before and all(
            layer.normalize_before and layer.feed_forward_macaron is None and layer.conv_module is None
            and isinstance(layer.self_attn, RelPositionMultiHeadedAttention) for layer in layers)
        position_encodings = (encoder.embed.pos_enc, encoder.up_embed.pos_enc)
        if not plain or not all(isinstance(p, EspnetRelPositionalEncoding) for p in position_encodings):
            raise RuntimeError("prefix cache expects pre-norm conformer layers with espnet relative positions")
        lookahead = encoder.pre_lookahead_layer
        if lookahead.conv2.kernel_size != (PRE_LOOKAHEAD_CONTEXT_TOKENS + 1,):
            raise RuntimeError("unexpected pre-lookahead conv")
        # The upsampling conv is left-padded by 2 x stride frames (2 tokens), kernel 2 x stride + 1.
        if encoder.up_layer.conv.kernel_size != (2 * encoder.up_layer.stride + 1,) or encoder.up_layer.stride != 2:
            raise RuntimeError("unexpected upsampling conv")
        self.input_embedding = flow.input_embedding
        self.lookahead_tokens = int(lookahead.pre_lookahead_len)
        self.embed_linear, self.embed_norm = ops.Linear.of(encoder.embed.out[0], kernels), encoder.embed.out[1]
        self.embed_positions: EspnetRelPositionalEncoding = encoder.embed.pos_enc
        self.lookahead_conv1 = ops.Conv1d(lookahead.conv1, kernels)
        self.lookahead_conv2 = ops.Conv1d(lookahead.conv2, kernels)
        self.token_layers = [_Layer(layer, kernels) for layer in encoder.encoders]
        self.up_conv = ops.Conv1d(encoder.up_layer.conv, kernels)
        self.up_linear, self.up_norm = ops.Linear.of(encoder.up_embed.out[0], kernels), encoder.up_embed.out[1]
        self.up_positions: EspnetRelPositionalEncoding = encoder.up_embed.pos_enc
        self.frame_layers = [_Layer(layer, kernels) for layer in encoder.up_encoders]
        self.after_norm = encoder.after_norm
        self.proj = ops.Linear.of(flow.encoder_proj, kernels)
        self.width = int(self.embed_linear.out_features)
        self.dtype = flow.encoder_proj.weight.dtype  # activations' (the products may run lower: ops.Kernels)
        for positions in (self.embed_positions, self.up_positions):
            positions.extend_pe(torch.empty(1, POSITION_TABLE_POSITIONS, device=flow.encoder_proj.weight.device))

    @property
    def layers(self) -> int:
        return len(self.token_layers) + len(self.frame_layers)

    def empty_prefix(self, batch: int, device: torch.device, dtype: torch.dtype) -> EncoderPrefix:
        layer = self.token_layers[0]
        return EncoderPrefix.empty(batch, self.layers, len(self.token_layers), layer.heads, layer.d_k, self.width,
                                   device, dtype)

    def encode_prefix(self, tokens: torch.Tensor) -> EncoderPrefix:
        """tokens [1, P] (P >= 2): the prompt encoded alone, with what windows need kept."""
        if tokens.shape[0] != 1 or tokens.shape[1] < MIN_PREFIX_TOKENS:
            raise ValueError(f"a cached prompt needs batch 1 and >= {MIN_PREFIX_TOKENS} tokens, "
                             f"got {tuple(tokens.shape)}")
        dtype = self.dtype
        lengths = torch.tensor([tokens.shape[1]], device=tokens.device)
        mu, kept = self._encode(self.empty_prefix(1, tokens.device, dtype), tokens, lengths, keep=True)
        assert kept is not None
        embedded, hidden, layer_kv = kept
        return EncoderPrefix(
            mu=mu, embedded_tail=embedded[:, -PRE_LOOKAHEAD_CONTEXT_TOKENS:].contiguous(),
            hidden_tail=hidden[:, -UPSAMPLE_CONTEXT_TOKENS:].contiguous(),
            layer_kv=tuple(kv.contiguous() for kv in layer_kv),
            key_mask=torch.ones(1, tokens.shape[1], dtype=torch.bool, device=tokens.device),
            token_layers=len(self.token_layers))

    def encode(self, prefix: EncoderPrefix, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """tokens [B, W] (rows right-padded; real lengths [B]) following each row's prefix -> mu [B, 2W, 80]."""
        mu, _ = self._encode(prefix, tokens, lengths, keep=False)
        return mu

    def _encode(self, prefix: EncoderPrefix, tokens: torch.Tensor, lengths: torch.Tensor, keep: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None]:
        width = tokens.shape[1]
        valid = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]  # [B, W]
        xs = self.input_embedding(tokens.clamp(min=0))  # [B, W, 512]
        xs = self.embed_norm(self.embed_linear(xs)) * self.embed_positions.xscale
        xs = xs * valid[:, :, None]  # padded positions read as the zeros past a window's end
        embedded = xs
        tail = prefix.embedded_tail  # [B, 2 or 0, 512]
        lookahead_in = torch.cat([tail, xs], dim=1)  # [B, tail + W, 512]
        conv1 = F.leaky_relu(self.lookahead_conv1(F.pad(lookahead_in, (0, 0, 0, self.lookahead_tokens))))
        conv2 = self.lookahead_conv2(F.pad(conv1, (0, 0, PRE_LOOKAHEAD_CONTEXT_TOKENS, 0)))
        xs = (conv2 + lookahead_in)[:, tail.shape[1]:]  # [B, W, 512]
        token_keys_valid = torch.cat([prefix.key_mask, valid], dim=1)  # [B, P + W]
        layer_kv: list[torch.Tensor] | None = [] if keep else None
        prefix_kv = iter(prefix.layer_kv)
        for layer in self.token_layers:
            xs = self._layer(layer, xs, next(prefix_kv), token_keys_valid, self.embed_positions, layer_kv)
            checkpoint()
        hidden = xs
        hidden_tail = prefix.hidden_tail
        up_in = torch.cat([hidden_tail, xs], dim=1).repeat_interleave(2, dim=1)  # [B, 2 (tail + W), 512]
        up = self.up_conv(F.pad(up_in, (0, 0, 2 * UPSAMPLE_CONTEXT_TOKENS, 0)))  # [B, 2 (tail + W), 512]
        xs = up[:, 2 * hidden_tail.shape[1]:]  # [B, 2W, 512]
        xs = self.up_norm(self.up_linear(xs)) * self.up_positions.xscale
        frame_keys_valid = token_keys_valid.repeat_interleave(2, dim=1)  # [B, 2 (P + W)]
        for layer in self.frame_layers:
            xs = self._layer(layer, xs, next(prefix_kv), frame_keys_valid, self.up_positions, layer_kv)
            checkpoint()
        mu = self.proj(self.after_norm(xs))  # [B, 2W, 80]
        return mu, (None if layer_kv is None else (embedded, hidden, layer_kv))

    def _layer(self, layer: _Layer, x: torch.Tensor, prefix_kv: torch.Tensor, keys_valid: torch.Tensor,
               positions: EspnetRelPositionalEncoding, kept: list[torch.Tensor] | None) -> torch.Tensor:
        """One pre-norm conformer layer (attention, feed-forward) on x [B, T, D] following P cached positions."""
        x = x + self._attention(layer, layer.norm_mha(x), prefix_kv, keys_valid, positions, kept)
        return x + layer.ff_scale * layer.ff_out(layer.ff_activation(layer.ff_in(layer.norm_ff(x))))

    @staticmethod
    def _attention(layer: _Layer, x: torch.Tensor, prefix_kv: torch.Tensor, keys_valid: torch.Tensor,
                   positions: EspnetRelPositionalEncoding, kept: list[torch.Tensor] | None) -> torch.Tensor:
        """Transformer-XL relative-position attention of T queries over [P cached | T new] keys.

        Query i sits at position P + i, key j at position j; the position term of the pair uses the encoding of
        the distance P + i - j, as the library's `rel_shift` gives it when queries and keys are the same T.
        """
        batch, queries, _ = x.shape
        heads, d_k = layer.heads, layer.d_k
        q = layer.linear_q(x).view(batch, queries, heads, d_k)  # [B, T, H, d_k]
        k = layer.linear_k(x).view(batch, queries, heads, d_k).transpose(1, 2)  # [B, H, T, d_k]
        v = layer.linear_v(x).view(batch, queries, heads, d_k).transpose(1, 2)
        if kept is not None:
            kept.append(torch.cat([k, v], dim=-1))  # the library's cache layout: cat(keys, values) on the last dim
        prefix_k, prefix_v = prefix_kv[..., :d_k], prefix_kv[..., d_k:]  # [B, H, P, d_k] each
        k = torch.cat([prefix_k, k], dim=2)  # [B, H, P + T, d_k]
        v = torch.cat([prefix_v, v], dim=2)
        keys = k.shape[2]
        if positions.pe.shape[1] < 2 * keys - 1:
            positions.extend_pe(x.new_empty(1, keys))
        center = positions.pe.shape[1] // 2  # pe[center - d] encodes distance d (key d positions to the left)
        # Distances run from P + T - 1 (query T - 1, key 0) down to -(T - 1) (query 0, key P + T - 1).
        distance_pe = positions.pe[:, center - (keys - 1): center + queries].to(x.dtype)  # [1, P + 2T - 1, D]
        p = layer.linear_pos(distance_pe).view(1, -1, heads, d_k).transpose(1, 2)  # [1, H, P + 2T - 1, d_k]
        q_u = (q + layer.pos_bias_u).transpose(1, 2)  # [B, H, T, d_k]
        q_v = (q + layer.pos_bias_v).transpose(1, 2)
        content = torch.matmul(q_u, k.transpose(-2, -1))  # [B, H, T, P + T]
        by_distance = torch.matmul(q_v, p.transpose(-2, -1))  # [B, H, T, P + 2T - 1]
        # Pair (i, j) has distance P + i - j, at index (keys - 1) - (P + i - j) = T - 1 - i + j of by_distance.
        index = (queries - 1 - torch.arange(queries, device=x.device)[:, None]
                 + torch.arange(keys, device=x.device)[None, :])  # [T, P + T]
        position = torch.gather(by_distance, 3, index.expand(batch, heads, queries, keys))  # [B, H, T, P + T]
        scores = (content + position) / math.sqrt(d_k)
        masked = ~keys_valid[:, None, None, :]  # [B, 1, 1, P + T]
        weights = torch.softmax(scores.masked_fill(masked, -float("inf")), dim=-1).masked_fill(masked, 0.0)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(batch, queries, heads * d_k)  # [B, T, D]
        return layer.linear_out(out)
