"""One object per segment: everything the engine thread knows about it. Only the engine thread touches it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from synth.api import Priority, SamplingParams, SegmentRequest
from synth.outlet import Outlet

SPEECH_VOCAB_SIZE = 6561  # ids >= this (BOS 6561, EOS 6562, ...) are never given to S3Gen


class Status(enum.IntEnum):
    """Lifecycle. Order matters: >= GENERATED means T3 no longer runs; >= FINISHED means terminal."""

    WAITING = 0  # in the admission queue
    RUNNING = 1  # holds cache rows, decoding
    GENERATED = 2  # T3 done (EOS / limit), rows released; the vocoder may still owe audio
    FINISHED = 10
    CANCELLED = 11
    REJECTED = 12
    FAILED = 13


@dataclass(slots=True, eq=False)
class SegmentState:
    request: SegmentRequest
    outlet: Outlet  # where its output goes, from this thread or the vocoder worker's (synth/outlet.py)
    params: SamplingParams  # resolved: every field set, seed included
    voice: Any  # synth.voices.Voice (kept by reference: a voice deleted meanwhile stays usable here)
    text_ids: list[int]  # T3 text tokens, SOT/EOT included where the variant uses them
    max_new_tokens: int
    uses_cfg: bool  # two cache rows (cond, uncond)
    status: Status = Status.WAITING
    gen: int = 0  # claim counter: output is delivered only while this matches the rows' owner
    rows: tuple[int, ...] = ()  # cache rows: (cond,) or (cond, uncond)
    prefix: Any = None  # synth.kv_cache.PrefixKV the rows attend to (shared; kept alive while running)
    # the position its rows write first after the prefill ([prefix | text | BOS block]); while it runs, the
    # scheduler's RowTable keeps its positions and ids (synth/rows.py)
    next_pos: int = 0
    tokens: list[int] = field(default_factory=list)  # every sampled id, EOS included: set when its generation ends
    n_valid: int = 0  # of them, ids < SPEECH_VOCAB_SIZE (what the vocoder takes): set with `tokens`
    finish_reason: str = ""
    queued: int = 0  # its place in the admission queue (the scheduler's arrival count), kept when preempted
    aligner: Any = None  # the multilingual alignment analyzer of this segment (synth.alignment), when on
    # timestamps (time.monotonic seconds)
    admitted_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_live(self) -> bool:
        return self.request.priority == Priority.LIVE

    @property
    def is_done(self) -> bool:
        return self.status >= Status.FINISHED
