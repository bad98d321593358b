"""S3Gen's flow estimator (`ConditionalDecoder`) as an explicit function over a batch, with a cached prefix.

The library's estimator is a 1-D U-Net: a causal ResNet block and transformer blocks going down, mid blocks,
and the same coming up, all at frame rate (causal convolutions, full self-attention over the frames). Each
Euler step of a render calls it once. Run as the library runs it, every render re-processes the voice prompt
(200 frames) with the window.

Here the prompt is processed once per voice (`record`): at every Euler step and for each CFG row, what the
frames after it read from it is kept (`EstimatorPrefix`): every attention layer's keys and values of the
prompt frames, and the last input frames of every causal convolution. A window is then run on its own frames
only, its attention over [prompt keys | window keys] and its causal convolutions reading the prompt's tail
where the library pads zeros. The prompt frames do not see the window: the prefix semantics of
`synth/flow_encoder.py`, what the library's estimator computes on [prompt | window] under a chunk mask that
lets prompt frames attend to the prompt only (tests/synth/test_vocoder.py checks exactly that).

Everything runs channels-last ([rows, frames, channels]) on a batch whose rows may belong to different voices
and different window lengths: windows are padded to a bucket length and masked (padded frames are zeroed
before each convolution, as the library's `mask` does, and are never attended to), prefixes of shorter
prompts are left-padded and masked. Only the library's weights and modules are used (LayerNorms,
`SinusoidalPosEmb`, the weights of every linear and convolution, through `synth/invariant_ops.py`); the code
here is the wiring of `ConditionalDecoder.forward`, `CausalResnetBlock1D`, `CausalBlock1D`,
`BasicTransformerBlock` and diffusers' `AttnProcessor2_0`, with a prefix added. No hooks, no processor swaps:
the function holds no state between calls, so renders and voice preparations may run on different threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.decoder import (
    CausalBlock1D,
    CausalConv1d,
    CausalResnetBlock1D,
    ConditionalDecoder,
)

from synth import invariant_ops as ops
from synth.flow_encoder import batch_rows
from synth.render_checkpoints import checkpoint

MASKED_BIAS = -1.0e10  # the library's mask_to_bias value for a masked key


@dataclass(frozen=True, slots=True, eq=False)
class StepPrefix:
    """What one Euler step's windows read from the prompt; rows as the batch (CFG: cond, uncond per stream)."""

    keys: tuple[torch.Tensor, ...]  # per attention layer: [rows, P, inner]
    values: tuple[torch.Tensor, ...]  # per attention layer: [rows, P, inner]
    conv_tails: tuple[torch.Tensor, ...]  # per causal conv: [rows, kernel - 1, C_in], the prompt's last inputs
    key_mask: torch.Tensor  # [rows, P] bool: False for the left padding of a shorter prompt

    @staticmethod
    def cat(parts: list[StepPrefix]) -> StepPrefix:
        """Rows of several prefixes as one batch (one op per tensor slot, whatever the number of parts)."""
        return StepPrefix(
            keys=tuple(batch_rows(layer) for layer in zip(*(p.keys for p in parts), strict=False)),
            values=tuple(batch_rows(layer) for layer in zip(*(p.values for p in parts), strict=False)),
            conv_tails=tuple(batch_rows(conv) for conv in zip(*(p.conv_tails for p in parts), strict=False)),
            key_mask=batch_rows([p.key_mask for p in parts]),
        )

    def left_padded(self, frames: int) -> StepPrefix:
        """The same prefix with `frames` key positions, the missing ones in front and masked."""
        missing = frames - self.key_mask.shape[1]
        if missing < 0:
            raise ValueError(f"prefix of {self.key_mask.shape[1]} frames is longer than {frames}")
        if missing == 0:
            return self
        return StepPrefix(
            keys=tuple(F.pad(k, (0, 0, missing, 0)) for k in self.keys),
            values=tuple(F.pad(v, (0, 0, missing, 0)) for v in self.values),
            conv_tails=self.conv_tails,
            key_mask=F.pad(self.key_mask, (missing, 0), value=False),
        )

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *self.conv_tails, self.key_mask)
        return sum(t.numel() * t.element_size() for t in tensors)


class _Recorder:
    """Collects a prompt's keys/values and conv tails during `record`."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.conv_tails: list[torch.Tensor] = []


class _ResnetBlock:
    def __init__(self, block: Any, kernels: ops.Kernels) -> None:
        if not (isinstance(block, CausalResnetBlock1D) and isinstance(block.block1, CausalBlock1D)):
            raise TypeError("the cached estimator expects causal ResNet blocks")
        self.conv1, self.norm1 = ops.Conv1d(block.block1.block[0], kernels), block.block1.block[2]
        self.conv2, self.norm2 = ops.Conv1d(block.block2.block[0], kernels), block.block2.block[2]
        self.time_proj = ops.Linear.of(block.mlp[1], kernels)  # after Mish
        self.res_conv = ops.Linear.of(block.res_conv, kernels)


class _TransformerBlock:
    def __init__(self, block: Any, kernels: ops.Kernels) -> None:
        attn = block.attn1
        plain = (block.attn2 is None and not block.use_ada_layer_norm and not block.use_ada_layer_norm_zero
                 and block._chunk_size is None and attn.spatial_norm is None and attn.group_norm is None
                 and attn.norm_cross is None and not attn.residual_connection and attn.rescale_output_factor == 1.0)
        if not plain:
            raise RuntimeError("the cached estimator expects plain self-attention transformer blocks")
        self.norm1, self.norm3 = block.norm1, block.norm3
        self.heads = int(attn.heads)
        self.to_q, self.to_k, self.to_v = (ops.Linear.of(attn.to_q, kernels), ops.Linear.of(attn.to_k, kernels),
                                           ops.Linear.of(attn.to_v, kernels))
        self.to_out = ops.Linear.of(attn.to_out[0], kernels)
        gelu, out = block.ff.net[0], block.ff.net[2]
        self.ff_in, self.ff_approximate, self.ff_out = ops.Linear.of(gelu.proj, kernels), gelu.approximate, \
            ops.Linear.of(out, kernels)


class PrefixCachedEstimator:
    """The estimator of one flow as a pure function; `record` for prompts, `__call__` for windows after them."""

    def __init__(self, estimator: Any, kernels: ops.Kernels) -> None:
        if not isinstance(estimator, ConditionalDecoder) or not estimator.causal:
            raise TypeError("the cached estimator expects chatterbox's causal ConditionalDecoder")
        if len(estimator.down_blocks) != 1 or len(estimator.up_blocks) != 1:
            raise RuntimeError("the cached estimator expects one down and one up block (S3Gen's channels=[256])")
        (down_resnet, down_tf, downsample), = estimator.down_blocks
        (up_resnet, up_tf, upsample), = estimator.up_blocks
        if not (isinstance(downsample, CausalConv1d) and isinstance(upsample, CausalConv1d)):
            raise RuntimeError("the cached estimator expects frame-rate causal down/up-sampling convolutions")
        self.meanflow = bool(estimator.meanflow)
        self.time_embeddings = estimator.time_embeddings  # SinusoidalPosEmb (elementwise)
        mlp = estimator.time_mlp
        self.time_linear_1 = ops.Linear.of(mlp.linear_1, kernels)
        self.time_linear_2 = ops.Linear.of(mlp.linear_2, kernels)
        self.time_act = mlp.act
        self.time_mixer = ops.Linear.of(estimator.time_embed_mixer, kernels) if self.meanflow else None
        self.down = (_ResnetBlock(down_resnet, kernels), [_TransformerBlock(b, kernels) for b in down_tf],
                     ops.Conv1d(downsample, kernels))
        self.mid = [(_ResnetBlock(resnet, kernels), [_TransformerBlock(b, kernels) for b in tfs])
                    for resnet, tfs in estimator.mid_blocks]
        self.up = (_ResnetBlock(up_resnet, kernels), [_TransformerBlock(b, kernels) for b in up_tf],
                   ops.Conv1d(upsample, kernels))
        final = estimator.final_block
        self.final_conv, self.final_norm = ops.Conv1d(final.block[0], kernels), final.block[2]
        self.final_proj = ops.Linear.of(estimator.final_proj, kernels)
        self.dtype = estimator.final_proj.weight.dtype

    @property
    def attention_layers(self) -> int:
        return len(self.down[1]) + sum(len(tfs) for _, tfs in self.mid) + len(self.up[1])

    @property
    def causal_convs(self) -> int:
        return 3 * (2 + len(self.mid)) + 1  # 2 per ResNet block, the down/up convs, the final block's

    def time_embedding(self, t: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """t, r: [1] -> [1, D] (every row of a step shares it)."""
        emb = self.time_linear_2(self.time_act(self.time_linear_1(self.time_embeddings(t).to(t.dtype))))
        if self.time_mixer is None:
            return emb
        assert r is not None
        emb_r = self.time_linear_2(self.time_act(self.time_linear_1(self.time_embeddings(r).to(t.dtype))))
        return self.time_mixer(torch.cat([emb, emb_r], dim=1))

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, time_emb: torch.Tensor,
                 spks: torch.Tensor, cond: torch.Tensor, prefix: StepPrefix | None,
                 recorder: _Recorder | None = None) -> torch.Tensor:
        """The velocity [R, T, 80] at frames x [R, T, 80] (mask [R, T, 1]; mu, cond [R, T, 80]; spks [R, 80];
        time_emb [1, D]). With `prefix`, the frames follow the prompt it was recorded from; without, they stand
        alone (the library's estimator exactly), and a `recorder` keeps what later windows need."""
        frames = x.shape[1]
        h = torch.cat([x, mu, spks[:, None, :].expand(-1, frames, -1), cond], dim=2)  # [R, T, 320]
        bias = self._key_bias(mask, prefix)  # [R, 1, 1, P + T]
        cursor = _Cursor(prefix, recorder)
        resnet, transformers, downsample = self.down
        h = self._resnet(resnet, h, mask, time_emb, cursor)
        for block in transformers:
            h = self._transformer(block, h, bias, cursor)
        checkpoint()
        skip = h
        h = self._causal_conv(downsample, h * mask, cursor)
        for resnet, transformers in self.mid:
            h = self._resnet(resnet, h, mask, time_emb, cursor)
            for block in transformers:
                h = self._transformer(block, h, bias, cursor)
            checkpoint()
        resnet, transformers, upsample = self.up
        h = self._resnet(resnet, torch.cat([h, skip], dim=2), mask, time_emb, cursor)
        for block in transformers:
            h = self._transformer(block, h, bias, cursor)
        h = self._causal_conv(upsample, h * mask, cursor)
        h = F.mish(self.final_norm(self._causal_conv(self.final_conv, h * mask, cursor))) * mask
        return self.final_proj(h * mask) * mask

    def record(self, x: torch.Tensor, mu: torch.Tensor, time_emb: torch.Tensor, spks: torch.Tensor,
               cond: torch.Tensor) -> tuple[torch.Tensor, StepPrefix]:
        """Run on prompt frames alone (no padding); returns (velocity, what windows after it need)."""
        recorder = _Recorder()
        mask = x.new_ones(x.shape[0], x.shape[1], 1)
        velocity = self(x, mask, mu, time_emb, spks, cond, None, recorder)
        key_mask = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
        return velocity, StepPrefix(tuple(recorder.keys), tuple(recorder.values), tuple(recorder.conv_tails),
                                    key_mask)

    # --- blocks ------------------------------------------------------------------------------------------

    @staticmethod
    def _key_bias(mask: torch.Tensor, prefix: StepPrefix | None) -> torch.Tensor:
        keys_valid = mask[:, :, 0] > 0  # [R, T]
        if prefix is not None:
            keys_valid = torch.cat([prefix.key_mask, keys_valid], dim=1)  # [R, P + T]
        return ((~keys_valid).to(mask.dtype) * MASKED_BIAS)[:, None, None, :]

    def _causal_conv(self, conv: ops.Conv1d, x: torch.Tensor, cursor: _Cursor) -> torch.Tensor:
        """x [R, T, C] (already masked) after the prompt's last inputs (or zeros) -> [R, T, C_out]."""
        tail_frames = conv.receptive_field - 1
        tail = cursor.next_conv_tail()
        if tail is None:
            tail = x.new_zeros(x.shape[0], tail_frames, x.shape[2])
        if cursor.recorder is not None:
            cursor.recorder.conv_tails.append(torch.cat([tail, x], dim=1)[:, -tail_frames:])
        return conv(torch.cat([tail, x], dim=1))

    def _resnet(self, block: _ResnetBlock, x: torch.Tensor, mask: torch.Tensor, time_emb: torch.Tensor,
                cursor: _Cursor) -> torch.Tensor:
        h = F.mish(block.norm1(self._causal_conv(block.conv1, x * mask, cursor))) * mask
        h = h + block.time_proj(F.mish(time_emb))[:, None, :]
        h = F.mish(block.norm2(self._causal_conv(block.conv2, h * mask, cursor))) * mask
        return h + block.res_conv(x * mask)

    def _transformer(self, block: _TransformerBlock, x: torch.Tensor, bias: torch.Tensor,
                     cursor: _Cursor) -> torch.Tensor:
        rows, frames, _ = x.shape
        normed = block.norm1(x)
        query, key, value = block.to_q(normed), block.to_k(normed), block.to_v(normed)  # [R, T, inner]
        if cursor.recorder is not None:
            cursor.recorder.keys.append(key)
            cursor.recorder.values.append(value)
        prefix = cursor.next_attention()
        if prefix is not None:
            key = torch.cat([prefix[0], key], dim=1)  # [R, P + T, inner]
            value = torch.cat([prefix[1], value], dim=1)
        heads = block.heads
        head_dim = key.shape[-1] // heads
        query = query.view(rows, frames, heads, head_dim).transpose(1, 2)  # [R, H, T, d]
        key = key.view(rows, -1, heads, head_dim).transpose(1, 2)  # [R, H, P + T, d]
        value = value.view(rows, -1, heads, head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)  # [R, H, T, d]
        attended = attended.transpose(1, 2).reshape(rows, frames, heads * head_dim).to(query.dtype)
        x = x + block.to_out(attended)
        hidden = F.gelu(block.ff_in(block.norm3(x)), approximate=block.ff_approximate)
        return x + block.ff_out(hidden)


class _Cursor:
    """Walks a prefix's attention layers and convs in the order the forward pass meets them."""

    def __init__(self, prefix: StepPrefix | None, recorder: _Recorder | None) -> None:
        self.prefix, self.recorder = prefix, recorder
        self._attention = 0
        self._conv = 0

    def next_attention(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.prefix is None:
            return None
        index = self._attention
        self._attention += 1
        return self.prefix.keys[index], self.prefix.values[index]

    def next_conv_tail(self) -> torch.Tensor | None:
        if self.prefix is None:
            return None
        index = self._conv
        self._conv += 1
        return self.prefix.conv_tails[index]

