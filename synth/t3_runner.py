"""Batched T3 forward passes over the slot KV cache. Tensors only: the scheduler decides what runs.

The layers are the library's own modules (HF Llama / GPT-2 blocks inside chatterbox's T3); this file
only re-drives them so that every row of the batch has its own position and its own cache length,
which HF's generate() cannot do. Embeddings follow `T3.inference` / `T3.inference_turbo` exactly:

English / Multilingual (Llama, learned text and speech positions, RoPE along the whole row):
    [speaker 1][perceiver 32][emotion 1] [SOT text EOT] [BOS@0] [BOS@0] then token i at speech position i+1
Turbo (GPT-2, learned absolute positions added per row):
    [speaker 1][prompt 375] [text BPE ids] [BOS] then tokens with no speech position embedding
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatterbox.models.t3 import T3
from chatterbox.models.t3.modules.cond_enc import T3Cond

from synth.kv_cache import PrefixKV, SlotKVCache

try:  # transformers >= 4.48 keeps it here
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
except ImportError:  # pragma: no cover - older transformers
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # type: ignore[no-redef]


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode step over cache rows [0, n_rows). Rows not in the step are fed a dummy token and
    write to the scratch position; their outputs are ignored. All tensors are on the model's device."""

    n_rows: int
    token_ids: torch.Tensor  # [n_rows] long: last sampled token per row (dummy for idle rows)
    speech_pos: torch.Tensor  # [n_rows] long: learned speech position of that token (Llama only)
    write_pos: torch.Tensor  # [n_rows] long: cache position the token is written to (scratch for idle rows)
    attend_len: torch.Tensor  # [n_rows] long: keys [0, attend_len) are visible after the write
    span_len: int  # max(attend_len), host-side so shapes need no sync


class T3Runner:
    def __init__(self, t3: T3, *, max_rows: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.t3 = t3.to(device=device, dtype=dtype).eval()
        self.is_gpt = bool(t3.is_gpt)
        self.device = device
        self.dtype = dtype
        cfg = t3.cfg
        self.n_layers = cfg.num_hidden_layers if not self.is_gpt else cfg.n_layer
        self.n_heads = cfg.num_attention_heads if not self.is_gpt else cfg.n_head
        self.head_dim = cfg.hidden_size // self.n_heads if self.is_gpt else cfg.head_dim
        self.cache = SlotKVCache(n_layers=self.n_layers, max_rows=max_rows, n_heads=self.n_heads, max_len=max_len,
                                 head_dim=self.head_dim, device=device, dtype=dtype)
        self.start_speech_token = t3.hp.start_speech_token
        self.stop_speech_token = t3.hp.stop_speech_token

    # --- embeddings --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def cond_embeds(self, cond: T3Cond) -> torch.Tensor:
        """[1, P, dim] conditioning prefix. `cond` must be a fresh T3Cond: prepare_conditioning caches into it."""
        return self.t3.prepare_conditioning(cond.to(device=self.device))

    @torch.inference_mode()
    def text_embeds(self, text_ids: list[int], with_uncond_row: bool) -> torch.Tensor:
        """[1 or 2, n, dim]. The CFG row zeroes the token embeddings but keeps the text positions."""
        ids = torch.tensor([text_ids], dtype=torch.long, device=self.device)  # [1, n]
        emb = self.t3.text_emb(ids)
        if with_uncond_row:
            emb = torch.cat([emb, torch.zeros_like(emb)])
        if self.t3.hp.input_pos_emb == "learned":
            emb = emb + self.t3.text_pos_emb(ids)
        return emb

    @torch.inference_mode()
    def speech_embeds(self, token_ids: torch.Tensor, speech_pos: torch.Tensor) -> torch.Tensor:
        """token_ids, speech_pos: [R] -> [R, 1, dim]."""
        emb = self.t3.speech_emb(token_ids[:, None])
        if self.t3.hp.input_pos_emb == "learned":
            emb = emb + self.t3.speech_pos_emb.emb(speech_pos[:, None])
        return emb

    def bos_embeds(self, n_rows: int) -> torch.Tensor:
        """The speech-start block that ends a prefill: [n_rows, 2 (Llama) or 1 (GPT-2), dim]."""
        bos = torch.full((n_rows,), self.start_speech_token, dtype=torch.long, device=self.device)
        one = self.speech_embeds(bos, torch.zeros_like(bos))  # [R, 1, dim]
        return one if self.is_gpt else torch.cat([one, one], dim=1)

    # --- forward passes ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def compute_prefix(self, cond_emb: torch.Tensor) -> PrefixKV:
        """Run the conditioning prefix once ([1, P, dim]) and keep its per-layer keys and values."""
        n_pos = cond_emb.shape[1]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            keys.append(k.contiguous())
            values.append(v.contiguous())

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return keys[layer], values[layer]

        pos = torch.arange(n_pos, device=self.device)[None]  # [1, P]
        causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=self.device).tril()[None, None]
        self._layers(cond_emb.to(self.dtype), pos, causal, write, read)
        return PrefixKV(tuple(keys), tuple(values))

    @torch.inference_mode()
    def prefill(self, rows: list[int], prefix: PrefixKV, embeds: torch.Tensor) -> torch.Tensor:
        """Load the prefix into `rows`, run `embeds` [R, S, dim] after it; return last-position logits [R, V]."""
        assert embeds.shape[0] == len(rows), (embeds.shape, rows)
        self.cache.load_prefix(rows, prefix)
        start, n_new = prefix.length, embeds.shape[1]
        end = start + n_new
        assert end < self.cache.usable_len, "segment does not fit the KV cache"
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        cache = self.cache

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            cache.write_rows(layer, rows_t, start, k, v)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return cache.keys[layer][rows_t, :, :end], cache.values[layer][rows_t, :, :end]

        pos = torch.arange(start, end, device=self.device)[None].expand(len(rows), -1)  # [R, S]
        key_pos = torch.arange(end, device=self.device)
        mask = (key_pos[None, :] <= pos[0][:, None])[None, None]  # [1, 1, S, end] causal over prefix + new
        hidden = self._layers(embeds.to(self.dtype), pos, mask, write, read)
        return self.t3.speech_head(hidden[:, -1])

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """One token for every row in [0, n_rows): returns logits [n_rows, V]."""
        n_rows, span = batch.n_rows, batch.span_len
        cache = self.cache
        embeds = self.speech_embeds(batch.token_ids, batch.speech_pos).to(self.dtype)  # [R, 1, dim]
        rows_t = torch.arange(n_rows, device=self.device)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            cache.write(layer, rows_t, batch.write_pos, k, v)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return cache.keys[layer][:n_rows, :, :span], cache.values[layer][:n_rows, :, :span]

        key_pos = torch.arange(span, device=self.device)
        mask = (key_pos[None, :] < batch.attend_len[:, None])[:, None, None, :]  # [R, 1, 1, span]
        rope_pos = batch.write_pos.clamp(max=span - 1)[:, None]  # idle rows: any valid position
        hidden = self._layers(embeds, rope_pos, mask, write, read)
        return self.t3.speech_head(hidden[:, -1])

    def _layers(self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, write, read) -> torch.Tensor:  # noqa: ANN001
        """h: [B, S, dim]; pos: [B, S] positions; mask: bool [B|1, 1, S, L]. Returns the final-norm hidden."""
        return self._gpt2_layers(h, pos, mask, write, read) if self.is_gpt else self._llama_layers(
            h, pos, mask, write, read)

    def _llama_layers(self, h, pos, mask, write, read):  # noqa: ANN001, ANN202
        tfmr = self.t3.tfmr
        n_batch, n_new, _ = h.shape
        cos, sin = tfmr.rotary_emb(h, pos)
        for i, layer in enumerate(tfmr.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n_batch, n_new, -1, self.head_dim).transpose(1, 2)  # [B, H, S, D]
            k = attn.k_proj(x).view(n_batch, n_new, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(n_batch, n_new, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            write(i, k, v)
            keys, values = read(i)  # [B, H, L, D]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(n_batch, n_new, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return tfmr.norm(h)

    def _gpt2_layers(self, h, pos, mask, write, read):  # noqa: ANN001, ANN202
        tfmr = self.t3.tfmr
        n_batch, n_new, dim = h.shape
        h = h + tfmr.wpe(pos)
        for i, block in enumerate(tfmr.h):
            x = block.ln_1(h)
            q, k, v = block.attn.c_attn(x).split(dim, dim=2)
            q, k, v = (t.view(n_batch, n_new, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            write(i, k, v)
            keys, values = read(i)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            h = h + block.attn.c_proj(o.transpose(1, 2).reshape(n_batch, n_new, dim))
            h = h + block.mlp(block.ln_2(h))
        return tfmr.ln_f(h)
