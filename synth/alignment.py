"""The multilingual alignment analyzer, fed from the batched runner instead of hooks on HF attention.

chatterbox's `T3.inference` attaches an `AlignmentStreamAnalyzer` to multilingual models: it hooks three
attention heads (forcing eager attention on the whole model), reads the cond row's attention over the text
every step, and edits the guided logits before the repetition penalty: EOS is suppressed until the
alignment reaches the end of the text, and forced on a long tail, on alignment repetition or on a repeated
token. Here the runner keeps those heads' probabilities (it computes them anyway), and each segment owns
one analyzer whose `step()` is the library's own code: only the attention it reads is supplied differently.
Optional (EngineConfig.alignment_analyzer), off by default; it costs a host copy of three attention rows
per analyzed segment per step.
"""

from __future__ import annotations

import torch
from chatterbox.models.t3.inference.alignment_stream_analyzer import LLAMA_ALIGNED_HEADS, AlignmentStreamAnalyzer

ALIGNED_HEADS: tuple[tuple[int, int], ...] = tuple((int(layer), int(head)) for layer, head in LLAMA_ALIGNED_HEADS)


def missing_heads(n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """The analyzer's (layer, head) pairs a backbone of this shape does not have (tiny presets lack them)."""
    return [(layer, head) for layer, head in ALIGNED_HEADS if layer >= n_layers or head >= n_heads]


def new_analyzer(cond_len: int, text_len: int, eos_token: int) -> AlignmentStreamAnalyzer:
    """The library's analyzer for one segment, in the state its __init__ leaves it, minus the model hooks."""
    analyzer = AlignmentStreamAnalyzer.__new__(AlignmentStreamAnalyzer)
    start, stop = cond_len, cond_len + text_len
    analyzer.text_tokens_slice = (start, stop)
    analyzer.eos_idx = eos_token
    analyzer.alignment = torch.zeros(0, stop - start)
    analyzer.curr_frame_pos = 0
    analyzer.text_position = 0
    analyzer.started = False
    analyzer.started_at = None
    analyzer.complete = False
    analyzer.completed_at = None
    analyzer.generated_tokens = []
    analyzer.last_aligned_attns = [None] * len(ALIGNED_HEADS)
    return analyzer


def feed(analyzer: AlignmentStreamAnalyzer, text_probs: list[torch.Tensor]) -> None:
    """Give the analyzer this step's attention of its heads over the text, in the shapes its hooks produce.

    text_probs[h]: [Q, L] probabilities of the cond row's newest queries over the L text keys: Q = 2 (the
    BOS block) for the first step, which reads rows [stop:] of a square map; Q = 1 afterwards.
    """
    start, stop = analyzer.text_tokens_slice
    maps = []
    for probs in text_probs:
        n_queries = probs.shape[0]
        full = torch.zeros(n_queries + (stop if analyzer.curr_frame_pos == 0 else 0), stop)
        full[full.shape[0] - n_queries:, start:stop] = probs.cpu()
        maps.append(full)
    analyzer.last_aligned_attns = maps
