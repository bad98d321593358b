"""Batched T3 forward passes over shared voice prefixes and the slot KV cache. Tensors only: the
scheduler decides what runs.

The layers are the library's own modules (HF Llama / GPT-2 blocks inside chatterbox's T3); this file
only re-drives them so that every row of the batch has its own position and its own cache length,
which HF's generate() cannot do. Embeddings follow `T3.inference` / `T3.inference_turbo` exactly:

English / Multilingual (Llama, learned text and speech positions, RoPE along the whole row):
    cond row:   [speaker 1][perceiver 32][emotion 1] [SOT text EOT] [BOS@0] [BOS@0] then token i at speech position i+1
    uncond row: the same with the text token embeddings zeroed (text positions kept)
Turbo (GPT-2, learned absolute positions added per row):
    [speaker 1][prompt] [text BPE ids] [BOS] then tokens with no speech position embedding

Prefix pool: a voice's conditioning (and, for CFG, the unconditional text block) is computed once into a
shared `PrefixKV`; admission copies the positions a row needs into the row's slot (one copy per layer), so a
row's keys are one contiguous run [prefix | text | BOS block | speech] of its own cache row. The decode step is
then one masked SDPA call per layer over rows [0, row bucket) and keys [0, key bucket), whatever the mix of
voices: ops per step depend on the bucket only. (A block table over the pool would avoid the copy and let rows
of one voice read its prefix once; with plain torch ops that needs a gather per layer, i.e. the same copy made
every step instead of once, or a paged-attention kernel, which torch does not ship. The price of the copy is
that each row reads its own prefix: Turbo's 376 positions per row and layer.)
Prefill packs every admitted segment into one sequence with a block-diagonal mask, so N admissions cost one
pass over the weights, not N; it is not captured (shapes vary), it runs once per segment.

`execute(plan) -> StepOutput` is the boundary with the engine (vLLM's model runner): the runner owns the step
buffers, the prefill packing, each segment's sampling parameters and generator seed, the prefix pool and the
alignment analyzer's edit; the engine (no torch) keeps the inbox, the scheduling, the hand-off and the emits. A
step's inputs come from the plan as numpy arrays over its rows (one write per field, not per row), and a decoding
row feeds the id its cond row sampled at the step before straight from the device buffer: no step needs the host to
have read the one before, so the engine may launch step k+1 before it reads step k's ids (`StepOutput.result`).

Compact steps (CPU, fp32, the C attention kernel, no CUDA graphs: `compact_rows`): a step decodes and samples
only the rows its plan names, gathered, not every row of the bucket. Rows between them cost nothing, and a row left
out of a step keeps everything it has: its cache (nothing is written), its generator (no draw) and its seen set. That
is what lets the scheduler leave job rows out of a live turn's first steps (SchedulerConfig.pause_jobs_below_ids)
and resume them later with the same ids. A row's bits are the same in a compact step as in a bucket (row-invariant
projections and attention, below), so seeded tokens do not change.

CUDA graphs (`capture_graphs`, start-up only): every (row bucket, key bucket) decode step and every row bucket's
sampling, captured in thread-local mode, then `check_graphs` replays each beside the eager function on the same
inputs. Any failure is reported to the caller, which serves eagerly (`drop_graphs`) or refuses to start.

Determinism: a row's logits must not depend on the other rows of its step. On the CPU the projections run
through oneDNN (`PackedLinears`, row-invariant, checked for 1..300 rows) and SDPA computes each (row, head)
by plain matmuls and a masked fp32 softmax (the CPU SDPA kernel is not row-invariant), with masked keys
contributing exact zeros; the bucket sizes therefore do not change a row's result
(tests/synth/test_t3_runner.py checks it bit for bit across row and key buckets). On CUDA nothing
documents that guarantee: cuBLAS and the SDPA backends may pick another kernel (another reduction order)
for another M (row bucket) or key length, so tokens are identical alone and in a batch only within one
(row bucket, key bucket) pair; fixed buckets make it a function of the bucket, not of the batch's content.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from chatterbox.models.t3 import T3
from chatterbox.models.t3.modules.cond_enc import T3Cond

from synth import alignment, decode_attention, gpu
from synth.kv_cache import PrefixKV, SlotKVCache
from synth.linear_bf16w import Bf16WeightLinears
from synth.request import SegmentState
from synth.sampling import RowParams, sample_gpt2, sample_llama
from synth.scheduler import StepOutput, StepPlan
from synth.step_buffers import FLOAT_FIELDS, StepGraph, StepInputs, bucket, key_ladder, ladder

log = logging.getLogger(__name__)

# attend(layer, q, k, v) -> attention output; q, k, v: [B, H, S, D] for the new positions
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Compact = tuple[str, int]  # a compact step's rows: the StepInputs field that holds them, and how many
# a sampling hook: rewrites rows of the guided logits [rows, V] (the multilingual alignment analyzer)
EditGuided = Callable[[torch.Tensor], torch.Tensor]

PREFIX_CACHE_ENTRIES = 64  # voice prefixes kept (per voice and exaggeration), least recently used dropped
# Graph replay against the eager step at start-up (`check_graphs`): bitwise is expected (the same kernels on the
# same shapes); where the kernels allow no more, a replay passes with logits within ATOL + RTOL * |eager| (about
# one unit in the last place of the dtype the logits are computed in: 2^-7 for bf16's 8-bit significand) and the
# same argmax, and the sampled ids must be identical (the noise is the same generators' draws).
PARITY_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0**-7, 2.0**-7),
                    torch.float16: (2.0**-10, 2.0**-10)}  # dtype -> (ATOL, RTOL)
PARITY_SEED = 1234


class _Interrupted(Exception):
    """A jobs-only compact step stopped between layers of its prefill or its decode (`T3Runner.execute`'s
    `interrupt`)."""


@dataclass(frozen=True, slots=True)
class GraphReport:
    """What `capture_graphs` built."""

    graphs: int  # decode and sampling graphs
    capture_s: float
    pool_bytes: int  # device memory the capture reserved (the graphs' shared pool)


@dataclass(frozen=True, slots=True)
class PrefillItem:
    """New positions for one cache row: `embeds` [n, dim] follow the first `prefix_len` positions of
    `prefix`; the row gets a copy of those prefix positions at [0, prefix_len) and the new ones after them."""

    row: int
    prefix: PrefixKV
    prefix_len: int
    embeds: torch.Tensor


class PackedLinears:
    """Every projection of T3 prepacked once for oneDNN (CPU, fp32). The reason that holds everywhere:
    oneDNN's result for a row does not depend on how many other rows share the call, so a segment's
    logits do not change with the batch it is in (MKL's do, by rounding, from 2 rows up). Speed depends
    on the CPU (BENCHMARKS.md): on an AVX2 Xeon MKL's sgemm ran 1.5-3x slower at 1-32 rows; on an AVX-512
    Xeon oneDNN is 25-45 % slower at 1-2 rows and 1.3-1.8x faster from 16 rows up.
    The modules themselves are left untouched: chatterbox's own inference still runs them as shipped."""

    ROWS_HINT = 16  # the packing's batch-size hint; checked invariant for 1..300 rows

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for module in modules:
            weight = cast(torch.Tensor, module.weight).detach()
            if type(module).__name__ == "Conv1D":  # GPT-2's transposed linear: weight [in, out]
                weight = weight.t()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.ROWS_HINT)
            bias = None if module.bias is None else cast(torch.Tensor, module.bias).detach()
            self._packed[id(module)] = (packed, bias)

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()

    def covers(self, module: torch.nn.Module) -> bool:
        return id(module) in self._packed

    def __call__(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._packed[id(module)]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def projections(t3: T3) -> list[torch.nn.Module]:
    """T3's linear layers: every projection of every block, and the speech head."""
    tfmr = t3.tfmr
    blocks: list[tuple[torch.nn.Module, ...]]
    if t3.is_gpt:
        blocks = [(b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj) for b in tfmr.h]
    else:
        blocks = [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj) for layer in tfmr.layers]
    return [m for block in blocks for m in block] + [t3.speech_head]


def fuse_qkv_(t3: T3) -> list[torch.nn.Linear]:
    """One projection per Llama layer for q, k and v: a linear layer whose weight is [q; k; v] (rows), so a
    step runs one GEMM where it ran three. The library's q/k/v modules are re-pointed at views of it (the same
    values, one copy in memory), so chatterbox's own inference keeps running them as shipped."""
    fused = []
    for layer in t3.tfmr.layers:
        parts = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        weights = [cast(torch.Tensor, p.weight).detach() for p in parts]
        biases = [None if p.bias is None else cast(torch.Tensor, p.bias).detach() for p in parts]
        weight = torch.cat(weights)  # [(H + 2 Hkv) D, dim]
        bias = None if any(b is None for b in biases) else torch.cat(cast(list[torch.Tensor], biases))
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias, requires_grad=False)
        start = 0
        for part, part_weight, part_bias in zip(parts, weights, biases, strict=True):
            rows = part_weight.shape[0]
            part.weight.data = weight[start:start + rows]
            if bias is not None and part_bias is not None:
                part.bias.data = bias[start:start + rows]
            start += rows
        fused.append(module.eval())
    return fused


class T3Runner:
    def __init__(self, t3: T3, *, max_rows: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 packed_linears: bool = True, bf16_weights: bool = False, cuda_graphs: bool = False,
                 compact_steps: bool = True) -> None:
        # RoPE's inverse frequencies in float32, taken before the cast below (Module.to casts that buffer too: in
        # bf16 a phase drifts by ~0.5 rad past position 1,000); None for GPT-2 (learned positions)
        rope = None if t3.is_gpt else t3.tfmr.rotary_emb
        self._rope_inv_freq = None if rope is None else rope.inv_freq.detach().to(device, torch.float32).clone()
        self._rope_scale = 1.0 if rope is None else float(rope.attention_scaling)
        self.t3 = t3.to(device=device, dtype=dtype).eval()
        self.qkv = [] if t3.is_gpt else fuse_qkv_(self.t3)  # Llama: one q/k/v projection per layer
        split = {id(m) for layer in ([] if t3.is_gpt else self.t3.tfmr.layers)
                 for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)}
        own = [m for m in projections(self.t3) if id(m) not in split] + list(self.qkv)  # what a step runs
        self.linears: PackedLinears | Bf16WeightLinears | None = None
        if bf16_weights:  # the caller rounded the projections (linear_bf16w.round_to_bf16_)
            if device.type != "cpu" or dtype != torch.float32:
                raise ValueError("bf16-stored weights are a CPU fp32 mode (on a GPU, use dtype bfloat16)")
            self.linears = Bf16WeightLinears(own)
        elif packed_linears and PackedLinears.available(device, dtype):
            self.linears = PackedLinears(own)
        self.is_gpt = bool(t3.is_gpt)
        self._gelu_tanh = self.is_gpt and type(t3.tfmr.h[0].mlp.act).__name__ in ("NewGELUActivation", "GELUTanh")
        self.device = device
        self.dtype = dtype
        cfg = t3.cfg
        self.n_layers = cfg.num_hidden_layers if not self.is_gpt else cfg.n_layer
        self.n_heads = cfg.num_attention_heads if not self.is_gpt else cfg.n_head
        self.n_kv_heads = self.n_heads if self.is_gpt else cfg.num_key_value_heads
        if self.n_kv_heads != self.n_heads:
            raise ValueError("grouped-query attention is not supported (chatterbox's T3 has none)")
        self.head_dim = cfg.hidden_size // self.n_heads if self.is_gpt else cfg.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.cache = SlotKVCache(n_layers=self.n_layers, max_rows=max_rows, n_heads=self.n_heads, max_len=max_len,
                                 head_dim=self.head_dim, device=device, dtype=dtype)
        self.start_speech_token = t3.hp.start_speech_token
        self.stop_speech_token = t3.hp.stop_speech_token
        # CPU, fp32: the decode attention reads each row's voice prefix from the voice's PrefixKV (one copy per
        # voice, not per row) and no key past a row's length (synth/decode_attention.py); else torch's.
        self.shared_prefix_attention = (device.type == "cpu" and dtype == torch.float32
                                        and decode_attention.supports(self.head_dim) and decode_attention.available())
        self.row_prefixes = decode_attention.RowPrefixes(max_rows, self.n_layers)
        if device.type == "cpu" and dtype == torch.float32 and not self.shared_prefix_attention:
            log.warning("decode attention: torch's (the C kernel did not build here or does not take head size %d): "
                        "every row reads its own copy of the voice prefix, slower with many segments on a voice",
                        self.head_dim)
        # Attention probabilities of these (layer, head) pairs are kept by passes run with capture=True
        # (the multilingual alignment analyzer reads them): decode -> `captured_decode` [rows, keys] over the
        # row's own positions; prefill -> `captured_prefill` [T, prefix columns + T] with the packed layout
        # (prefix columns, item starts) in `captured_layout`. Captured passes run eagerly, never from a graph.
        self.capture_heads: tuple[tuple[int, int], ...] = ()
        self.captured_decode: dict[tuple[int, int], torch.Tensor] = {}
        self.captured_prefill: dict[tuple[int, int], torch.Tensor] = {}
        self.captured_layout: tuple[int, list[int]] = (0, [])
        # --- the decode step's static buffers (allocated once; a step reads and writes only these) ---
        self.inputs = StepInputs(max_rows, device, self.cache.scratch_pos, self.start_speech_token)
        self.row_buckets = ladder(max_rows)
        self.key_buckets = key_ladder(max_len)
        vocab = t3.hp.speech_tokens_dict_size
        self.vocab = vocab
        self.logits = torch.zeros((max_rows, vocab), dtype=torch.float32, device=device)  # [R, V] fp32
        self.noise = torch.ones((max_rows, vocab), dtype=torch.float32, device=device)  # [R, V] Exp(1) draws
        self._noise_rows = [self.noise[row:row + 1] for row in range(max_rows)]  # [1, V] views, made once
        self.seen = torch.zeros((max_rows, vocab), dtype=torch.bool, device=device)  # [R, V] penalised ids
        self.sampled = torch.zeros(max_rows, dtype=torch.long, device=device)  # [R] this step's ids
        self._row_index = torch.arange(max_rows, device=device)  # [R]
        self._key_index = torch.arange(max_len, device=device)  # [L]
        # one generator per row, reseeded at admission: row i's noise is exactly what torch.multinomial would
        # draw from a generator seeded with the segment's seed, whatever else the step holds
        self.generators = [torch.Generator(device=device) for _ in range(max_rows)]
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self._decode_graphs: dict[tuple[int, int], StepGraph] = {}
        self._sample_graphs: dict[int, StepGraph] = {}
        self._graph_pool: Any = None
        self._capture_stream: Any = None  # the side stream every capture of this runner warms up and captures on
        self.graph_parity = ""  # `check_graphs`: "bitwise" or "within tolerance"
        # each step's sampled ids go to the host through one of two buffers (two steps may be in flight)
        pin = device.type == "cuda"
        self._host_ids = [torch.zeros(max_rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_ids_np = [buffer.numpy() for buffer in self._host_ids]
        self._host_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._host_slot = 0
        # the prefix pool: keyed by Voice.key (a content hash) and exaggeration, never by id(): a freed voice's
        # address is reused at once
        self._prefixes: OrderedDict[tuple[str, float], PrefixKV] = OrderedDict()
        self.bos_positions = 1 if self.is_gpt else 2
        self.analyzer = False  # the multilingual alignment analyzer per segment (`use_analyzer`)
        self.compact_steps = compact_steps
        self.steps_interrupted = 0  # jobs-only compact steps stopped mid-step (`execute`'s `interrupt`), so far

    @property
    def compact_rows(self) -> bool:
        """Steps decode and sample only their plan's rows (the module docstring); else every row of the bucket."""
        return self.compact_steps and self.shared_prefix_attention and not self.use_graphs

    @property
    def usable_len(self) -> int:
        return self.cache.usable_len

    def bind_thread(self) -> None:
        """The step thread's first call: its CUDA work goes to this runner's device, and no gradients."""
        gpu.bind_thread(self.device)

    @staticmethod
    def kv_bytes_per_row(t3: T3, max_len: int, dtype: torch.dtype) -> int:
        """Device memory of one cache row (keys and values, every layer), before building a runner."""
        cfg = t3.cfg
        if t3.is_gpt:
            n_layers, hidden = cfg.n_layer, cfg.hidden_size
        else:
            n_layers, hidden = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
        return 2 * n_layers * hidden * max_len * torch.empty(0, dtype=dtype).element_size()

    def use_analyzer(self) -> None:
        """Give every admitted segment an alignment analyzer (multilingual, full size: the engine checks)."""
        self.analyzer = True
        self.capture_heads = alignment.ALIGNED_HEADS

    # --- embeddings --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def cond_embeds(self, cond: T3Cond) -> torch.Tensor:
        """[1, P, dim] conditioning prefix. `cond` must be a fresh T3Cond: prepare_conditioning caches into it."""
        return self.t3.prepare_conditioning(cond.to(device=self.device, dtype=self.dtype))

    @torch.inference_mode()
    def text_embeds(self, text_ids: list[int]) -> torch.Tensor:
        """[n, dim]: token embeddings plus learned text positions (Llama)."""
        (ids,) = self._upload(np.asarray([text_ids], dtype=np.int64))  # [1, n]
        emb = self.t3.text_emb(ids)
        if self.t3.hp.input_pos_emb == "learned":
            emb = emb + self.t3.text_pos_emb(ids)
        return emb[0]

    @torch.inference_mode()
    def speech_embeds(self, token_ids: torch.Tensor, speech_pos: torch.Tensor) -> torch.Tensor:
        """token_ids, speech_pos: [R] -> [R, 1, dim]."""
        emb = self.t3.speech_emb(token_ids[:, None])
        if self.t3.hp.input_pos_emb == "learned":
            emb = emb + self.t3.speech_pos_emb.emb(speech_pos[:, None])
        return emb

    def bos_embeds(self) -> torch.Tensor:
        """The speech-start block that ends a prefill: [2 (Llama) or 1 (GPT-2), dim]."""
        bos = torch.full((1,), self.start_speech_token, dtype=torch.long, device=self.device)
        one = self.speech_embeds(bos, torch.zeros_like(bos))[0]  # [1, dim]
        return one if self.is_gpt else torch.cat([one, one])

    def _lin(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x) if self.linears is None else self.linears(module, x)

    # --- shared prefixes ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def compute_prefix(self, cond_emb: torch.Tensor) -> PrefixKV:
        """Run the conditioning ([1, P, dim]) once and keep its per-layer keys and values."""
        n_pos = cond_emb.shape[1]
        _, keys, values = self._run_packed([(None, 0, cond_emb[0])], collect=True)
        assert keys[0].shape[1] == n_pos
        return PrefixKV(keys, values)

    @torch.inference_mode()
    def extend_uncond_text(self, prefix: PrefixKV, text_len: int) -> None:
        """Make `prefix` cover the unconditional row's text block up to `text_len` text positions."""
        have = prefix.length - prefix.cond_len
        if have >= text_len:
            return
        positions = torch.arange(have, text_len, device=self.device)
        embeds = self.t3.text_pos_emb.emb(positions).to(self.dtype)  # zeroed token embedding + text position
        _, keys, values = self._run_packed([(prefix, prefix.length, embeds)], collect=True)
        prefix.extend(keys, values)

    # --- forward passes ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem], capture: bool = False, interrupt: Callable[[], bool] | None = None
                ) -> torch.Tensor:
        """Copy each item's prefix positions into its row, run every item's new positions in one packed pass
        after them; returns each item's last-position logits [N, V]. `interrupt`: asked before each layer, raises
        `_Interrupted` when it says yes."""
        for item in items:
            if item.prefix_len + item.embeds.shape[0] >= self.cache.usable_len:
                raise ValueError("segment does not fit the KV cache")
            self.cache.install_prefix(item.row, item.prefix, item.prefix_len)
            if self.shared_prefix_attention:
                self.row_prefixes.set(item.row, item.prefix.keys, item.prefix.values, item.prefix_len)
        logits, _, _ = self._run_packed([(i.prefix, i.prefix_len, i.embeds) for i in items],
                                        rows=[i.row for i in items], capture=capture, interrupt=interrupt)
        return logits

    def release(self, rows: tuple[int, ...]) -> None:
        """These rows' segment is gone: hold nothing of its voice (a removed voice's prefix is freed), and each row
        is its own CFG partner again (an idle row's partner must lie inside any row bucket that holds the row: a
        pair claimed as rows (3, 9) leaves row 3 idle in a 4-row bucket)."""
        for row in rows:
            self.row_prefixes.clear(row)
        self.inputs.ints["partner"][list(rows)] = rows

    # --- the prefix pool ---------------------------------------------------------------------------------

    def prefix_for(self, voice: Any, exaggeration: float) -> PrefixKV:
        """The voice's conditioning prefix (computed once per voice and exaggeration; LRU)."""
        key = (voice.key, float(exaggeration) if not self.is_gpt else 0.0)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self.compute_prefix(self.cond_embeds(voice.t3_cond(exaggeration, self.device)))
            self._prefixes[key] = prefix
            if len(self._prefixes) > PREFIX_CACHE_ENTRIES:
                self._prefixes.popitem(last=False)
        else:
            self._prefixes.move_to_end(key)
        return prefix

    # --- one step ----------------------------------------------------------------------------------------

    def execute(self, plan: StepPlan, interrupt: Callable[[], bool] | None = None) -> StepOutput:
        """Prefill the admitted (one packed pass), decode the decoding rows (one static-shape step over the row
        bucket), sample every row of the bucket; the ids come back through `StepOutput.result()`.

        `interrupt`: asked before each layer of a jobs-only compact step (`plan.jobs_only`, `compact_rows`: job rows
        decoding, job segments prefilled); when it says yes the step stops there, before it samples, and comes back
        `interrupted` (the scheduler withdraws it: the decoding rows decode that step again later, the prefilled
        segments wait to be admitted again). What the stopped step wrote is written again before anything reads
        it: a decoding row's keys and values at its write position, with the same values; a prefilled segment's
        rows, prefix copy, parameters and generator seed, at its next admission."""
        interrupt = interrupt if self.compact_rows and plan.jobs_only else None
        t0 = time.perf_counter()
        items = [item for state in plan.prefill for item in self._admit(state)]
        analyzed = self.analyzer and any(s.aligner is not None for s in plan.prefill)
        try:
            prefill_logits = self.prefill(items, capture=analyzed, interrupt=interrupt) if items else None  # [N, V]
        except _Interrupted:
            self.steps_interrupted += 1
            return StepOutput(plan, (time.perf_counter() - t0) * 1e3, None)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        n_rows, n_keys = self._write_inputs(plan)
        self.inputs.upload()  # the step's one host-to-device copy
        capture = self.analyzer and any(s.aligner is not None for s in plan.decode)
        if self.compact_rows:
            return self._execute_compact(plan, items, prefill_logits, n_rows, n_keys, prefill_ms, capture, interrupt)
        if plan.decode_rows.size:
            self.decode(n_rows, n_keys, capture=capture)
        if prefill_logits is not None:
            self.place_logits([item.row for item in items], prefill_logits)
        self.sample(n_rows, self._analyzer_edit(plan, items) if self.analyzer else None)
        return self._read_back(plan, n_rows, prefill_ms)

    def _execute_compact(self, plan: StepPlan, items: list[PrefillItem], prefill_logits: torch.Tensor | None,
                         n_rows: int, n_keys: int, prefill_ms: float, capture: bool,
                         interrupt: Callable[[], bool] | None) -> StepOutput:
        """`execute` over the plan's rows only: it decodes its decoding rows and samples its sample rows (cond rows;
        CFG uncond rows are read as partners), as uploaded (StepInputs.write_plan: "decode_rows", "sample_rows").
        The analyzer's heads are captured for the decoding rows and its edit reads the sample rows' logits."""
        if plan.decode_rows.size:
            try:
                self.decode(n_rows, n_keys, capture=capture, compact=("decode_rows", self.inputs.decode_rows_n),
                            interrupt=interrupt)
            except _Interrupted:
                self.steps_interrupted += 1
                return StepOutput(plan, prefill_ms, None)
        if prefill_logits is not None:
            self.place_logits([item.row for item in items], prefill_logits)
        sample_rows = ("sample_rows", self.inputs.sample_rows_n)
        edit = self._analyzer_edit(plan, items, self._step_rows(sample_rows)[0]) if self.analyzer else None
        self.sample(n_rows, edit, compact=sample_rows)
        return self._read_back(plan, n_rows, prefill_ms)

    def _write_inputs(self, plan: StepPlan) -> tuple[int, int]:
        """The host mirror of the step's inputs (StepInputs.write_plan); returns (row bucket, key bucket)."""
        n_rows, n_keys = self.step_shape(max(plan.rows_needed, 1) - 1, plan.longest_keys)
        self.inputs.write_plan(plan, n_rows)
        return n_rows, n_keys

    def _read_back(self, plan: StepPlan, n_rows: int, prefill_ms: float) -> StepOutput:
        """The step's ids to the host: on CUDA one non-blocking copy into a pinned buffer (two alternate, for two
        steps in flight) and an event to wait on; on the CPU a copy of the device buffer, read when asked."""
        event = self._host_events[self._host_slot]
        if event is None:
            snapshot = self.sampled[:n_rows].clone()  # the next step overwrites `sampled`
            return StepOutput(plan, prefill_ms, lambda: snapshot.numpy())
        slot = self._host_slot
        self._host_slot = 1 - slot
        self._host_ids[slot][:n_rows].copy_(self.sampled[:n_rows], non_blocking=True)
        event.record()

        def read() -> np.ndarray:
            event.synchronize()
            return self._host_ids_np[slot][:n_rows].copy()

        return StepOutput(plan, prefill_ms, read)

    def _admit(self, state: SegmentState) -> list[PrefillItem]:
        """A segment's prefill: the cond row gets the voice prefix and runs its text and BOS block; a CFG uncond row
        gets the prefix and the shared unconditional text block of the same length, and runs only its BOS block.
        Also writes its rows' sampling parameters and seeds the cond row's generator."""
        prefix = self.prefix_for(state.voice, state.params.exaggeration)
        n_text = len(state.text_ids)
        bos = self.bos_embeds()
        items = [PrefillItem(state.rows[0], prefix, prefix.cond_len,
                             torch.cat([self.text_embeds(state.text_ids), bos]))]
        if state.uses_cfg:
            self.extend_uncond_text(prefix, n_text)
            items.append(PrefillItem(state.rows[1], prefix, prefix.cond_len + n_text, bos))
        if prefix.cond_len + n_text + bos.shape[0] != state.next_pos:
            raise RuntimeError(f"{state.request_id}: the scheduler planned its rows from position {state.next_pos}, "
                               f"the prefill ends at {prefix.cond_len + n_text + bos.shape[0]}")
        state.prefix = prefix
        if self.analyzer:
            state.aligner = alignment.new_analyzer(prefix.cond_len, n_text, self.stop_speech_token)
        self._write_row_params(state)
        return items

    def _write_row_params(self, state: SegmentState) -> None:
        """A claimed segment's rows: sampling parameters, CFG partner, and the cond row's generator seeded."""
        inputs, params, rows = self.inputs, state.params, state.rows
        for row in rows:
            for name in FLOAT_FIELDS:
                inputs.floats[name][row] = getattr(params, name)
            inputs.ints["partner"][row] = row
        inputs.ints["partner"][rows[0]] = rows[-1]  # the uncond row's logits (its own without CFG)
        if params.seed is None:  # resolved at submit: never None here
            raise ValueError(f"{state.request_id}: unseeded segment")
        self.generators[rows[0]].manual_seed(params.seed)

    def _analyzer_edit(self, plan: StepPlan, items: list[PrefillItem],
                       sample_rows: npt.NDArray[np.int64] | None = None) -> EditGuided | None:
        """The alignment analyzers' step on the guided logits of the segments that have one (`plan.decode` and the
        segments' `tokens` are kept for it: SchedulerConfig.track_states). The guided logits have one row per cache
        row of the bucket, or per entry of `sample_rows` in a compact step."""
        rows: list[tuple[int, SegmentState, list[torch.Tensor]]] = []  # (cond row, state, text probs)
        for state in plan.decode:
            if state.aligner is not None:  # the text block sits right after the conditioning in the row
                n_text, cols = len(state.text_ids), state.prefix.cond_len
                rows.append((state.rows[0], state, [self.captured_decode[h][state.rows[0], cols:cols + n_text][None]
                                                    for h in alignment.ALIGNED_HEADS]))
        prefix_cols, starts = self.captured_layout
        cond_items = [k for k, item in enumerate(items) if item.row in {s.rows[0] for s in plan.prefill}]
        for state, item in zip(plan.prefill, cond_items, strict=True):
            if state.aligner is not None:  # the BOS block's two queries over the item's own text keys
                n_text, start = len(state.text_ids), starts[item]
                end = start + items[item].embeds.shape[0]
                cols = prefix_cols + start
                rows.append((state.rows[0], state, [self.captured_prefill[h][end - 2:end, cols:cols + n_text]
                                                    for h in alignment.ALIGNED_HEADS]))
        if not rows:
            return None

        at = {int(row): k for k, row in enumerate(sample_rows)} if sample_rows is not None else None

        def edit(logits: torch.Tensor) -> torch.Tensor:
            for row, state, text_probs in rows:
                alignment.feed(state.aligner, text_probs)
                last = state.tokens[-1] if state.tokens else self.start_speech_token
                k = row if at is None else at[row]
                logits[k:k + 1] = state.aligner.step(logits[k:k + 1], next_token=last)
            return logits

        return edit

    def place_logits(self, rows: list[int], logits: torch.Tensor) -> None:
        """Prefill logits [N, V] become the sampling input of `rows` (the step's other rows come from decode)."""
        (index,) = self._upload(np.asarray(rows, dtype=np.int64))
        self.logits.index_copy_(0, index, logits.float())

    def _upload(self, *arrays: npt.NDArray[np.int64]) -> list[torch.Tensor]:
        """int64 host arrays -> device tensors of their shapes, in one copy. On CUDA from pinned memory without
        blocking: torch.tensor(list, device=cuda) copies from pageable memory, which waits for the stream's work
        (with overlapped steps, the step in flight), and an admission's prefill builds several."""
        flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.int64)
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(self.device, non_blocking=True)
        out, start = [], 0
        for a in arrays:
            out.append(on_device[start:start + a.size].view(a.shape))
            start += a.size
        return out

    def step_shape(self, highest_row: int, longest_row_keys: int) -> tuple[int, int]:
        """(row bucket, key bucket) holding rows [0, highest_row] and `longest_row_keys` keys per row."""
        return bucket(self.row_buckets, highest_row + 1), bucket(self.key_buckets, longest_row_keys)

    def decode(self, n_rows: int, n_keys: int, capture: bool = False, compact: Compact | None = None,
               interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        """One token for every row in [0, n_rows) (a row bucket), from the uploaded `inputs`: writes and
        returns logits [n_rows, V] fp32 (a view of the static `logits`). `compact` (`compact_rows`): only the
        rows of this input field (its first n entries); `interrupt` (compact only): asked before each layer, raises
        `_Interrupted` when it says yes."""
        if compact is not None:
            self._decode_eager(n_rows, n_keys, capture, compact=compact, interrupt=interrupt)
        elif capture and self.capture_heads:
            self._decode_eager(n_rows, n_keys, capture=True)
        else:
            self._decode_graph(n_rows, n_keys)()
        return self.logits[:n_rows]

    def sample(self, n_rows: int, edit_guided: EditGuided | None = None, compact: Compact | None = None
               ) -> torch.Tensor:
        """Sample every row in [0, n_rows) from `logits` with its own parameters and generator: writes and
        returns the ids [n_rows] (a view of the static `sampled`). `compact` (`compact_rows`): only the rows of
        this input field (its first n entries)."""
        if edit_guided is not None or compact is not None:
            self._sample_eager(n_rows, edit_guided, compact=compact)
        else:
            self._sample_graph(n_rows)()
        return self.sampled[:n_rows]

    def _decode_graph(self, n_rows: int, n_keys: int) -> StepGraph:
        graph = self._decode_graphs.get((n_rows, n_keys))
        if graph is None:
            graph = self._decode_graphs[(n_rows, n_keys)] = self._graph(lambda: self._decode_eager(n_rows, n_keys), [])
        return graph

    def _sample_graph(self, n_rows: int) -> StepGraph:
        graph = self._sample_graphs.get(n_rows)
        if graph is None:
            graph = self._sample_graphs[n_rows] = self._graph(lambda: self._sample_eager(n_rows),
                                                              self.generators[:n_rows])
        return graph

    # --- CUDA graphs: start-up only ----------------------------------------------------------------------

    def capture_graphs(self) -> GraphReport:
        """Capture every bucket's step graphs now (start-up, with no other thread using the device), so that no
        step ever waits for a capture. Raises what a capture raised (the caller falls back or refuses)."""
        if not self.use_graphs:
            return GraphReport(0, 0.0, 0)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for n_rows in self.row_buckets:
                for n_keys in self.key_buckets:
                    self._decode_graph(n_rows, n_keys)
                self._sample_graph(n_rows)
        if cuda:
            torch.cuda.synchronize(self.device)
        pool_bytes = torch.cuda.memory_reserved(self.device) - reserved if cuda else 0
        return GraphReport(len(self._decode_graphs) + len(self._sample_graphs), time.perf_counter() - t0, pool_bytes)

    def check_graphs(self) -> str:
        """Replay every captured graph beside the eager function it captured, on the same inputs ('' when every
        replay agrees; else what differed). Decode: rows of every length up to the key bucket over whatever the
        cache holds (the writes go to the scratch position, the same in both runs), logits compared bitwise, else
        to PARITY_TOLERANCE with the same argmax. Sampling: the same logits, seen sets and reseeded generators,
        sampled ids and seen sets identical. Leaves every row idle (admission writes what a segment needs)."""
        parity = "bitwise"
        atol, rtol = PARITY_TOLERANCE[self.dtype]
        with torch.inference_mode():
            for (n_rows, n_keys), graph in sorted(self._decode_graphs.items()):
                self._parity_inputs(n_rows, n_keys)
                self._decode_eager(n_rows, n_keys)
                eager = self.logits[:n_rows].clone()
                self.logits.zero_()  # a replay that writes nothing cannot pass
                graph()
                replayed = self.logits[:n_rows].clone()
                if torch.equal(eager, replayed):
                    continue
                excess = ((replayed - eager).abs() - (atol + rtol * eager.abs())).max().item()
                if excess > 0 or not torch.equal(eager.argmax(-1), replayed.argmax(-1)):
                    return (f"decode graph ({n_rows} rows, {n_keys} keys): logits differ from eager by up to "
                            f"{(replayed - eager).abs().max().item():.3g} (tolerance {atol:g} + {rtol:g} |x|)")
                parity = "within tolerance"
            g = torch.Generator().manual_seed(PARITY_SEED)
            logits = (3 * torch.randn(self.logits.shape, generator=g)).to(self.device)
            for n_rows, graph in sorted(self._sample_graphs.items()):
                self._parity_inputs(n_rows, 1)
                self.logits.copy_(logits)
                seen = self.seen.clone()
                for row in range(n_rows):
                    self.generators[row].manual_seed(PARITY_SEED + row)
                self._sample_eager(n_rows)
                eager, eager_seen = self.sampled[:n_rows].clone(), self.seen.clone()
                self.seen.copy_(seen)
                self.sampled.fill_(-1)
                for row in range(n_rows):
                    self.generators[row].manual_seed(PARITY_SEED + row)
                graph()
                if not (torch.equal(eager, self.sampled[:n_rows]) and torch.equal(eager_seen, self.seen)):
                    differ = int((eager != self.sampled[:n_rows]).sum().item())
                    return f"sampling graph ({n_rows} rows): {differ} of {n_rows} sampled ids differ from eager"
        self.inputs.idle_rows(self.inputs.max_rows)
        self.inputs.upload()
        self.graph_parity = parity
        return ""

    def _parity_inputs(self, n_rows: int, n_keys: int) -> None:
        """Rows [0, n_rows) of every length up to `n_keys` keys, fed from the last sampled ids or distinct host
        tokens, writing to the scratch position; sampling parameters that make every processor decide something."""
        inputs, rows = self.inputs, np.arange(n_rows)
        ints, floats = inputs.ints, inputs.floats
        inputs.idle_rows(self.inputs.max_rows)
        keys = n_keys - rows % min(n_keys, 7)
        ints["feed"][:n_rows] = np.where(rows % 2 == 0, rows, -1)  # half the rows feed `sampled`, half `token`
        ints["token"][:n_rows] = (37 * rows + 11) % (self.start_speech_token - 1)
        ints["speech_pos"][:n_rows] = rows % 16 + 1
        ints["pos"][:n_rows] = keys - 1
        ints["keys"][:n_rows] = keys
        ints["reset"][:n_rows] = rows % 2
        ints["partner"][:n_rows] = np.minimum(rows ^ 1, n_rows - 1)  # CFG pairs (Llama reads them)
        for name, value in (("temperature", 0.8), ("top_p", 0.95), ("min_p", 0.05), ("top_k", 1000.0 if self.is_gpt
                            else 0.0), ("repetition_penalty", 1.2), ("cfg_weight", 0.0 if self.is_gpt else 0.5)):
            floats[name][:n_rows] = value
        inputs.upload()

    def drop_graphs(self) -> None:
        """Serve eagerly from now on (a capture failed, or a replay differed): the graphs and their pool go."""
        self.use_graphs = False
        self._decode_graphs.clear()
        self._sample_graphs.clear()
        self._graph_pool = None
        self.graph_parity = ""
        if self.device.type == "cuda":
            try:  # (a failed capture may have left the allocator unable to: eager serves all the same)
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            except RuntimeError as exc:
                log.warning("the graphs' memory was not returned to the device: %s", exc)

    @property
    def graphs_captured(self) -> int:
        return sum(graph.captured for graph in (*self._decode_graphs.values(), *self._sample_graphs.values()))

    def _graph(self, fn: Callable[[], None], generators: list[torch.Generator]) -> StepGraph:
        def run() -> None:
            with torch.inference_mode():
                fn()

        if self.use_graphs and self.device.type == "cuda" and self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = StepGraph(run, capture=self.use_graphs, device=self.device, pool=self._graph_pool,
                          generators=generators, stream=self._capture_stream)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        return graph

    def _decode_eager(self, n_rows: int, n_keys: int, capture: bool = False, compact: Compact | None = None,
                      interrupt: Callable[[], bool] | None = None) -> None:
        """The decode step over static buffers: no host value read, no allocation that depends on the batch.
        `compact`: decode only the rows that input field names, not the bucket [0, n_rows)."""
        inp, cache, scale = self.inputs, self.cache, self.scale
        rows, row_ids = self._step_rows(compact)
        take = _taker(n_rows, row_ids)
        feed = take(inp.device_int("feed"))  # [R]: the row whose last sampled id it feeds, -1: `token`
        token = torch.where(feed >= 0, self.sampled.index_select(0, feed.clamp(min=0)),
                            take(inp.device_int("token")))  # [R]
        pos = take(inp.device_int("pos"))  # [R]
        write = take(inp.device_int("write"))  # [R]
        keys_visible = take(inp.device_int("keys"))  # [R]
        cache_rows = row_ids if row_ids is not None else self._row_index[:n_rows]
        if compact is not None and not self.shared_prefix_attention:
            raise ValueError("a compact step needs the C attention kernel")
        embeds = self.speech_embeds(token, take(inp.device_int("speech_pos"))).to(self.dtype)  # [R, 1, dim]
        mask = (self._key_index[None, :n_keys] < keys_visible[:, None])[:, None, None, :]  # [R, 1, 1, L]
        hidden_keys = self._key_index[None, :n_keys] >= keys_visible[:, None]  # [R, L]: ~mask, computed once
        hidden = hidden_keys[:, None, None, :]  # [R, 1, 1, L]
        all_keys = cache.all_keys[:, :n_rows, :, :n_keys]  # [layers, R, H, L, D]: the bucket, once per step
        all_values = cache.all_values[:, :n_rows, :, :n_keys]
        captured_heads = [(layer, head) for layer, head in self.capture_heads if capture]
        if capture:
            self.captured_decode = {}

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if interrupt is not None and interrupt():  # before this layer writes anything
                raise _Interrupted
            cache.write(layer, cache_rows, write, k[:, :, 0], v[:, :, 0])
            keys, values = all_keys[layer], all_values[layer]  # [R, H, L, D]
            for captured_layer, head in captured_heads:  # the same probabilities, spelled out for one head
                if captured_layer == layer:  # (the row's cache holds its prefix too: install_prefix)
                    head_keys = keys[:, head] if row_ids is None else keys[:, head].index_select(0, row_ids)
                    scores = torch.matmul(q[:, head], head_keys.transpose(-1, -2))[:, 0].float() * scale
                    probs = torch.softmax(scores.masked_fill(hidden_keys, float("-inf")), dim=-1)  # [R, L]
                    if row_ids is not None:  # indexed by cache row, as the analyzer's edit reads it
                        probs = torch.zeros((n_rows, n_keys), dtype=probs.dtype,
                                            device=probs.device).index_copy_(0, row_ids, probs)
                    self.captured_decode[(layer, head)] = probs
            if self.shared_prefix_attention:
                return decode_attention.attention(q, cache.keys[layer], cache.values[layer], self.row_prefixes, layer,
                                                  keys_visible, n_keys, scale, row_ids=rows)
            return self._attention(q, keys, values, mask, hidden)  # [R, H, 1, D]

        last = self._layers(embeds, pos[:, None], attend)
        logits = self._lin(self.t3.speech_head, last[:, -1])
        if row_ids is not None:
            self.logits.index_copy_(0, row_ids, logits.float())
        else:
            self.logits[:n_rows].copy_(logits)

    def _step_rows(self, compact: Compact | None) -> tuple[npt.NDArray[np.int64] | None, torch.Tensor | None]:
        """A compact step's rows, on the host and uploaded (None, None: the whole bucket)."""
        if compact is None:
            return None, None
        field, n = compact
        return self.inputs.ints[field][:n], self.inputs.device_int(field)[:n]

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   hidden: torch.Tensor) -> torch.Tensor:
        """One attention call for the step: q [R, H, 1, D] over keys, values [R, H, L, D] where mask [R, 1, 1, L]
        (hidden [R, 1, 1, L] = ~mask).

        CUDA: SDPA (its kernels accumulate scores and softmax in fp32 whatever the dtype). CPU: the same
        arithmetic spelled out in fp32 (matmul, masked softmax, matmul), because the CPU SDPA kernel is not
        row-invariant (a row's output changes in the last bit with the batch size; checked), while these ops
        give a row the same bits for any row and key bucket (tests/synth/test_t3_runner.py). A CPU runner in fp32
        with the C kernel of synth/decode_attention.py uses that instead (it reads the voice prefix once)."""
        if q.is_cuda:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        if q.dtype != torch.float32:  # (in fp32 the casts are no-ops, but each is still an op per layer)
            q, keys, values = q.float(), keys.float(), values.float()
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale)  # [R, H, 1, L] fp32
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)
        out = torch.matmul(probs, values)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _sample_eager(self, n_rows: int, edit_guided: EditGuided | None = None, compact: Compact | None = None
                      ) -> None:
        """Sampling over static buffers, every row with its own parameters, seen set and generator. `compact`: only
        the rows that input field names; the others keep their seen sets and generators as they are."""
        inp = self.inputs
        rows, row_ids = self._step_rows(compact)
        take = _taker(n_rows, row_ids)
        logits = take(self.logits)  # [R, V] fp32
        seen = take(self.seen)  # [R, V] (a copy in a compact step: written back below)
        reset = take(inp.device_int("reset")).bool()  # [R]: a segment's first token: seen = {BOS}
        seen.logical_and_(~reset[:, None])
        seen[:, self.start_speech_token].logical_or_(reset)
        params = RowParams(**{name: take(inp.device_float(name))[:, None] for name in FLOAT_FIELDS})
        # one draw per row from the row's own generator, as torch.multinomial draws it
        for row in (range(n_rows) if rows is None else rows.tolist()):
            self._noise_rows[row].exponential_(1.0, generator=self.generators[row])
        noise = take(self.noise)
        if self.is_gpt:
            tokens = sample_gpt2(logits, seen, params, noise)
            # inference_turbo penalises BOS only for its first token; afterwards only generated ids count
            first = take(inp.device_int("speech_pos")) == 0
            seen.logical_and_(~first[:, None])
        else:
            # a partner outside the bucket is an error (tests/synth/test_t3_runner.py); a compact step reads any row
            partners = logits if row_ids is None else self.logits
            uncond = partners.index_select(0, take(inp.device_int("partner")))  # [R, V]
            tokens = sample_llama(logits, uncond, seen, params, noise, edit_guided)
        seen.scatter_(1, tokens[:, None], True)
        if row_ids is not None:
            self.seen.index_copy_(0, row_ids, seen)
            self.sampled.index_copy_(0, row_ids, tokens)
        else:
            self.sampled[:n_rows].copy_(tokens)

    def _run_packed(self, items: list[tuple[PrefixKV | None, int, torch.Tensor]], rows: list[int] | None = None,
                    collect: bool = False, capture: bool = False, interrupt: Callable[[], bool] | None = None
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Items (prefix, prefix_len, embeds [n, dim]) packed into one sequence; each item sees the first
        prefix_len positions of its prefix and, causally, its own new positions. Either writes the new
        keys/values to slot `rows` and returns (last-position logits per item [N, V], [], []), or collects
        them for a prefix and returns (empty, keys, values) with per layer [H, total, D]."""
        dev = self.device
        lengths = [e.shape[0] for _, _, e in items]
        total = sum(lengths)
        h = torch.cat([e for _, _, e in items]).to(self.dtype)[None]  # [1, T, dim]
        # the index tensors are computed on the host and uploaded in one non-blocking copy (`_upload`)
        lengths_np = np.asarray(lengths, dtype=np.int64)
        item_of_np = np.repeat(np.arange(len(items), dtype=np.int64), lengths_np)  # the item of each new token: [T]
        starts_np = np.concatenate([[0], np.cumsum(lengths_np)[:-1]]).astype(np.int64)
        visible_np = np.asarray([p for _, p, _ in items], dtype=np.int64)
        pos_np = visible_np[item_of_np] + np.arange(total, dtype=np.int64) - starts_np[item_of_np]  # [T]
        starts = starts_np.tolist()
        # key columns: each distinct prefix once (as far as its items need), then the T new positions
        blocks: list[tuple[PrefixKV, int]] = []
        block_of_item: list[int] = []
        for prefix, prefix_len, _ in items:
            if prefix is None:
                block_of_item.append(-1)
                continue
            index = next((b for b, (p, _) in enumerate(blocks) if p is prefix), None)
            if index is None:
                blocks.append((prefix, 0))
                index = len(blocks) - 1
            blocks[index] = (prefix, max(blocks[index][1], prefix_len))
            block_of_item.append(index)
        col_block_np = np.concatenate([np.full(n, b, dtype=np.int64) for b, (_, n) in enumerate(blocks)] or
                                      [np.zeros(0, np.int64)])
        col_offset_np = np.concatenate([np.arange(n, dtype=np.int64) for _, n in blocks] or [np.zeros(0, np.int64)])
        tok_block_np = np.asarray(block_of_item, dtype=np.int64)[item_of_np]
        row_of_tok_np = np.asarray(rows, dtype=np.int64)[item_of_np] if rows is not None else np.zeros(0, np.int64)
        last_np = np.cumsum(lengths_np) - 1
        item_of, pos_flat, col_block, col_offset, tok_block, tok_visible, row_of_tok_all, last = self._upload(
            item_of_np, pos_np, col_block_np, col_offset_np, tok_block_np, visible_np[item_of_np], row_of_tok_np,
            last_np)
        pos = pos_flat[None]  # [1, T]
        sees_prefix = (col_block[None] == tok_block[:, None]) & (col_offset[None] < tok_visible[:, None])
        new = torch.arange(total, device=dev)
        sees_new = (item_of[None] == item_of[:, None]) & (new[None] <= new[:, None])
        mask = torch.cat([sees_prefix, sees_new], dim=1)[None, None]  # [1, 1, T, P_all + T]
        collected_k: list[torch.Tensor] = []
        collected_v: list[torch.Tensor] = []
        row_of_tok = row_of_tok_all if rows is not None else None
        captured_heads = [(layer, head) for layer, head in self.capture_heads if capture]
        if capture:
            self.captured_prefill = {}
            self.captured_layout = (sum(n for _, n in blocks), starts)

        # CPU, per item: the whole visible prefix, then causal over its own tokens ([n, seen + n])
        seen_of_item = [prefix_len if prefix is not None else 0 for prefix, prefix_len, _ in items]
        item_masks = [torch.ones(n, seen + n, dtype=torch.bool, device=dev).tril_(seen)
                      for seen, n in zip(seen_of_item, lengths, strict=True)] if dev.type != "cuda" else []

        def attend_per_item(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            """CPU: each item's attention over [its prefix | its own new keys], one call per item, so an item's
            bits do not depend on what it was packed with: the packed call's key axis holds the other items'
            prefixes and tokens, and the CPU SDPA kernel's blocking follows that length (on an Intel Xeon with
            AMX a packed item's keys changed in the last bit: tests/synth/test_t3_runner.py)."""
            outs = []
            for (prefix, _, _), seen, start, n, item_mask in zip(items, seen_of_item, starts, lengths,
                                                                  item_masks, strict=True):
                own_k, own_v = k[:, :, start:start + n], v[:, :, start:start + n]
                if prefix is not None and seen:
                    own_k = torch.cat([prefix.keys[layer][None, :, :seen], own_k], dim=2)
                    own_v = torch.cat([prefix.values[layer][None, :, :seen], own_v], dim=2)
                outs.append(F.scaled_dot_product_attention(q[:, :, start:start + n], own_k, own_v,
                                                           attn_mask=item_mask[None, None], scale=self.scale))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if interrupt is not None and interrupt():
                raise _Interrupted
            if row_of_tok is not None:
                self.cache.write(layer, row_of_tok, pos[0], k[0].transpose(0, 1), v[0].transpose(0, 1))
            if collect:
                collected_k.append(k[0].contiguous())
                collected_v.append(v[0].contiguous())
            if not q.is_cuda and not captured_heads:
                return attend_per_item(layer, q, k, v)
            keys = torch.cat([p.keys[layer][:, :n] for p, n in blocks] + [k[0]], dim=1)[None]
            values = torch.cat([p.values[layer][:, :n] for p, n in blocks] + [v[0]], dim=1)[None]
            for captured_layer, head in captured_heads:  # the same probabilities, spelled out for one head
                if captured_layer == layer:
                    scores = (q[0, head] @ keys[0, head].T).mul_(self.scale).masked_fill_(~mask[0, 0], float("-inf"))
                    self.captured_prefill[(layer, head)] = torch.softmax(scores, dim=-1, dtype=torch.float32)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)

        hidden = self._layers(h, pos, attend)
        if collect:
            return hidden.new_zeros(0), collected_k, collected_v
        return self._lin(self.t3.speech_head, hidden[0, last]), collected_k, collected_v

    def _layers(self, h: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """h: [B, S, dim]; pos: [B, S] positions. Returns the final-norm hidden."""
        return self._gpt2_layers(h, pos, attend) if self.is_gpt else self._llama_layers(h, pos, attend)

    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, S, D] at positions `pos` [B, S]: LlamaRotaryEmbedding's forward, with its outer product
        written as a broadcast multiply (each element is one product either way: the same bits in float32) so that
        neither a bf16 inv_freq nor TF32 matmuls (on for the vocoder beside a bf16 T3) round the phases."""
        assert self._rope_inv_freq is not None
        freqs = pos[..., None].to(torch.float32) * self._rope_inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def _llama_layers(self, h: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """LlamaDecoderLayer's forward, in fewer ops: one q/k/v projection (`fuse_qkv_`), RMSNorm as the fused
        F.rms_norm (LlamaRMSNorm's six ops, to rounding), RoPE on q and k at once with rotate_half(x) * sin
        written as roll(x, D / 2) * (sin with its first half negated) (the same bits)."""
        tfmr, lin = self.t3.tfmr, self._lin
        n_batch, n_new, _ = h.shape
        n_q, n_kv, half = self.n_heads, self.n_kv_heads, self.head_dim // 2
        cos, sin = self._rope(pos, h.dtype)  # [B, S, D]
        cos = cos[:, None]  # [B, 1, S, D]: every head
        sin_rotated = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]
        for i, layer in enumerate(tfmr.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = self._rms_norm(layer.input_layernorm, h)
            qkv = lin(self.qkv[i], x).view(n_batch, n_new, n_q + 2 * n_kv, self.head_dim).transpose(1, 2)
            qk = qkv[:, :n_q + n_kv]  # [B, H + Hkv, S, D]
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin_rotated
            o = attend(i, qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv:])
            h = h + lin(attn.o_proj, o.transpose(1, 2).reshape(n_batch, n_new, -1))
            x = self._rms_norm(layer.post_attention_layernorm, h)
            h = h + lin(mlp.down_proj, mlp.act_fn(lin(mlp.gate_proj, x)) * lin(mlp.up_proj, x))  # LlamaMLP
        return self._rms_norm(tfmr.norm, h)

    @staticmethod
    def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), cast(torch.Tensor, norm.weight), float(cast(Any, norm).variance_epsilon))

    def _gpt2_layers(self, h: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        tfmr, lin = self.t3.tfmr, self._lin
        n_batch, n_new, dim = h.shape
        h = h + tfmr.wpe(pos)
        for i, block in enumerate(tfmr.h):
            x = block.ln_1(h)
            qkv = lin(block.attn.c_attn, x).view(n_batch, n_new, 3, self.n_heads, self.head_dim)  # (q | k | v)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]: 3 view ops where there were 7
            o = attend(i, q, k, v)
            h = h + lin(block.attn.c_proj, o.transpose(1, 2).reshape(n_batch, n_new, dim))
            h = h + lin(block.mlp.c_proj, self._gpt2_act(lin(block.mlp.c_fc, block.ln_2(h))))  # GPT2MLP (eval)
        return tfmr.ln_f(h)

    def _gpt2_act(self, x: torch.Tensor) -> torch.Tensor:
        """GPT-2's "gelu_new" (transformers' NewGELUActivation: 8 ops, spelled out in Python) as the one fused op
        it equals up to rounding, F.gelu(approximate="tanh"): 7 ops fewer per layer and step. Any other
        activation runs as the checkpoint's config names it."""
        if self._gelu_tanh:
            return F.gelu(x, approximate="tanh")
        return cast(torch.Tensor, self.t3.tfmr.h[0].mlp.act(x))


def _taker(n_rows: int, row_ids: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of a per-row buffer for one step: the bucket [0, n_rows) (views), or the compact step's rows (copies)."""
    if row_ids is None:
        return lambda buffer: buffer[:n_rows]
    return lambda buffer: buffer.index_select(0, row_ids)
