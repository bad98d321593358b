"""A runner without a model: the engine's step plumbing on the host, made-up ids, no tensor work.

It does what the real runner does on the host for a step (the plan's inputs written into a `StepInputs` host
mirror, the bucket shapes) and returns, for the k-th step it executes, id (7 k + row) mod 6000 for every row: never
EOS and always a valid speech id, so segments run to their token limit. What it leaves out is all tensor work: the
prefill, the decode, the sampling and their graphs. scripts/bench_host_step.py measures the host's share of a step
with it (`Engine(..., runner_factory=NullRunner)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from synth.rows import IntArray
from synth.scheduler import StepOutput, StepPlan
from synth.step_buffers import StepInputs, bucket, key_ladder, ladder

NULL_ID_MODULUS = 6000


class NullRunner:
    shared_prefix_attention = False
    compact_rows = False  # its steps never leave a row out (it keeps no rows)
    use_graphs = False
    graph_parity = ""

    def __init__(self, t3: Any, *, max_rows: int, max_len: int, device: torch.device, **_: Any) -> None:
        self.is_gpt = bool(t3.is_gpt)
        self.bos_positions = 1 if self.is_gpt else 2
        cfg = t3.cfg
        self.n_layers = int(cfg.n_layer if self.is_gpt else cfg.num_hidden_layers)
        self.n_heads = int(cfg.n_head if self.is_gpt else cfg.num_attention_heads)
        self.usable_len = max_len - 1
        self.row_buckets = ladder(max_rows)
        self.key_buckets = key_ladder(max_len)
        self.inputs = StepInputs(max_rows, torch.device("cpu"), max_len - 1, t3.hp.start_speech_token)
        self._steps = 0

    def execute(self, plan: StepPlan, interrupt: Callable[[], bool] | None = None) -> StepOutput:
        """`interrupt` is never asked: a null step has no layers to stop between (compact_rows is False)."""
        n_rows = bucket(self.row_buckets, max(plan.rows_needed, 1))
        bucket(self.key_buckets, plan.longest_keys)
        self.inputs.write_plan(plan, n_rows)
        self._steps += 1
        ids: IntArray = (7 * self._steps + np.arange(n_rows, dtype=np.int64)) % NULL_ID_MODULUS
        return StepOutput(plan, 0.0, lambda: ids)

    def release(self, rows: tuple[int, ...]) -> None:
        pass

    def prefix_for(self, voice: Any, exaggeration: float) -> None:
        return None

    def capture_graphs(self) -> None:
        return None

    def check_graphs(self) -> str:
        return ""

    def drop_graphs(self) -> None:
        pass

    def use_analyzer(self) -> None:
        raise ValueError("the null runner has no attention to analyse")

    def bind_thread(self) -> None:
        pass
