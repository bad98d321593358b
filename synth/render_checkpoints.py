"""Points inside a vocoder render where the thread rendering may stop it: how a job segment's render gives way.

    with render_checkpoints.stop_when(live_turn_waits):
        pcm = vocoder.render(jobs)          # RenderInterrupted from the first checkpoint after it said True

A render is a pure function of its streams until its last line (StreamingVocoder.render applies each stream's
result, `VocoderStream._emit`, only after every stage has run; its noise is counter-based, a function of the seed
and the position, never drawn from a generator), so a render stopped half-way leaves its streams exactly as they
were, and rendering them again later gives the same bits. The vocoder worker stops a job segment's render this way
on a CPU, where a render cannot share the cores with another, when a live turn starts waiting for its first
audio (synth/vocoder_worker.JobYield): the live chunk then waits for one stage of the job's render at most, not
for all of it.

The checkpoints sit between the stages of a render: after the flow encoder, after each Euler step, after HiFT's
source and after each of its upsampling levels. `checkpoint()` costs one thread-local read where no predicate is
set (every render but a stoppable job render), and does nothing inside torch.compile's tracing (a compiled or
graphed render, on a GPU, has no checkpoints: it is not stopped).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

_local = threading.local()


class RenderInterrupted(Exception):
    """A render stopped at a checkpoint: nothing of it was applied to its streams."""


@contextlib.contextmanager
def stop_when(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, on this thread, each checkpoint asks `should_stop()` and raises RenderInterrupted when it
    says True. Nests: the inner predicate holds inside."""
    previous = getattr(_local, "should_stop", None)
    _local.should_stop = should_stop
    try:
        yield
    finally:
        _local.should_stop = previous


def checkpoint() -> None:
    if torch.compiler.is_compiling():  # (first: traced, this is a constant, and the thread-local is never read)
        return
    should_stop = getattr(_local, "should_stop", None)
    if should_stop is not None and should_stop():
        raise RenderInterrupted
