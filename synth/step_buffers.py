"""The decode step's static inputs and its graphs: what makes one step a pure function over fixed buffers.

- `StepInputs`: every per-row input of a decode step and of sampling (token ids, positions, sampling
  parameters, ...) in ONE host buffer (pinned on CUDA) with numpy views the engine writes in place, and its
  device twin. `upload()` is one non-blocking copy per step; the step reads only the device twin, so a captured
  graph never reads a host value.
- Buckets: a step runs over rows [0, row bucket) and keys [0, key bucket), both from fixed ladders, so each
  bucket pair has one shape forever (one graph each on CUDA). Rows: powers of two. Keys: steps of 64 up to 512,
  then 1.25x (rounded up to 64): a row of ~520 keys reads 576, not the 1,024 of a power-of-two ladder.
- `StepGraph`: a zero-argument function over static buffers; on CUDA captured once (side-stream warm-up, then a
  capture in torch's thread-local mode) and replayed, elsewhere (or with graphs off) called eagerly: the code CI
  runs on the CPU is the code the GPU replays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from synth.scheduler import StepPlan

# per-row int64 inputs
INT_FIELDS = (
    "feed",  # the row whose id sampled at the last step this row feeds (its segment's cond row); -1: feed `token`
    "token",  # the token fed by a row that feeds no sampled id (BOS for idle rows)
    "speech_pos",  # tokens the segment sampled before this step: the learned speech position (Llama); 0 = first
    "pos",  # the token's position in the whole row (prefix included): RoPE / GPT-2 position
    "write",  # cache position the token's keys go to: `pos`, or the scratch position for idle rows
    "keys",  # keys [0, keys) of the row are visible after the write (1 for idle rows)
    "partner",  # the row whose logits are this row's CFG uncond logits (itself without CFG)
    "reset",  # 1 on the step that samples a segment's first token: its seen-token set restarts at {BOS}
    # not per row: a compact step's rows (T3Runner.compact_rows), the first `decode_rows_n` / `sample_rows_n` entries
    "decode_rows",  # the rows it decodes (`plan.decode_rows`)
    "sample_rows",  # the rows it samples (`plan.sample_rows`: cond rows, decoding and admitted)
)
# per-row float32 sampling parameters
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "top_k", "repetition_penalty", "cfg_weight")
FLOAT_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "top_k": 0.0, "repetition_penalty": 1.0,
                  "cfg_weight": 0.0}
KEY_BUCKET_STEP = 64  # key buckets: multiples of this ...
KEY_BUCKET_LINEAR_UNTIL = 512  # ... one step apart up to here, then
KEY_BUCKET_GROWTH = 1.25  # this factor apart


def ladder(limit: int, first: int = 1) -> tuple[int, ...]:
    """first, 2*first, 4*first, ... below `limit`, then `limit` itself (the row buckets)."""
    steps = []
    size = first
    while size < limit:
        steps.append(size)
        size *= 2
    return (*steps, limit)


def key_ladder(limit: int, step: int = KEY_BUCKET_STEP, linear_until: int = KEY_BUCKET_LINEAR_UNTIL,
               growth: float = KEY_BUCKET_GROWTH) -> tuple[int, ...]:
    """step, 2*step, ... up to `linear_until`, then each about `growth` times the last (a multiple of `step`), below
    `limit`; then `limit` itself. A row pays at most one step of padding below `linear_until` and under 25 % above."""
    sizes = []
    size = min(step, limit)
    while size < limit:
        sizes.append(size)
        if size < linear_until:
            size += step
        else:
            size = -(-math.ceil(size * growth) // step) * step
    return (*sizes, limit)


def bucket(ladder_sizes: Sequence[int], need: int) -> int:
    """The smallest size of the ladder that holds `need`."""
    for size in ladder_sizes:
        if size >= need:
            return size
    raise ValueError(f"{need} exceeds the largest bucket {ladder_sizes[-1]}")


class StepInputs:
    """Host mirror (numpy views over one pinned buffer) and device twin of every per-row step input.

    `ints[field]` / `floats[field]` are the host arrays [max_rows] the engine writes; `device_int(field)` /
    `device_float(field)` are the device tensors the step reads. `upload` copies the host mirror through one of two
    pinned staging buffers on CUDA (alternating), so the mirror may be rewritten at once, even with two steps in
    flight.
    """

    def __init__(self, max_rows: int, device: torch.device, scratch_pos: int, bos_token: int) -> None:
        self.max_rows = max_rows
        self.scratch_pos = scratch_pos
        self.bos_token = bos_token
        int_bytes = len(INT_FIELDS) * max_rows * 8
        float_bytes = len(FLOAT_FIELDS) * max_rows * 4
        pin = device.type == "cuda"
        self.host = torch.zeros(int_bytes + float_bytes, dtype=torch.uint8)
        self._host_bytes = self.host.numpy()
        # CUDA: two pinned staging copies, alternating, so that writing the next step's inputs never changes a
        # buffer whose non-blocking upload the device has not done yet (with overlapped steps the host writes step
        # k+1's inputs before step k has run; step k-1's upload is done, since its ids were read)
        self._staging = [torch.zeros(int_bytes + float_bytes, dtype=torch.uint8, pin_memory=True)
                         for _ in range(2 if pin else 0)]
        self._staging_bytes = [buffer.numpy() for buffer in self._staging]
        # each slot's last copy, recorded on the stream: the host writes a slot again only once that copy is done
        # (the engine has read a later step's ids by then, so it never waits; a caller that launches steps without
        # reading any, as the parity test does, would otherwise overwrite inputs still queued for the device)
        self._copied: list[Any] = [None] * len(self._staging)
        self._slot = 0
        self.device_bytes = torch.zeros(int_bytes + float_bytes, dtype=torch.uint8, device=device)
        host_ints = self.host[:int_bytes].view(torch.int64).view(len(INT_FIELDS), max_rows).numpy()
        host_floats = self.host[int_bytes:].view(torch.float32).view(len(FLOAT_FIELDS), max_rows).numpy()
        self.ints: dict[str, npt.NDArray[np.int64]] = {n: host_ints[i] for i, n in enumerate(INT_FIELDS)}
        self.floats: dict[str, npt.NDArray[np.float32]] = {n: host_floats[i] for i, n in enumerate(FLOAT_FIELDS)}
        dev_ints = self.device_bytes[:int_bytes].view(torch.int64).view(len(INT_FIELDS), max_rows)
        dev_floats = self.device_bytes[int_bytes:].view(torch.float32).view(len(FLOAT_FIELDS), max_rows)
        self._dev_int = {n: dev_ints[i] for i, n in enumerate(INT_FIELDS)}
        self._dev_float = {n: dev_floats[i] for i, n in enumerate(FLOAT_FIELDS)}
        self.ints["partner"][:] = np.arange(max_rows)
        self.decode_rows_n = self.sample_rows_n = 0  # entries of "decode_rows" / "sample_rows" (`write_plan`)
        for name, value in FLOAT_DEFAULTS.items():
            self.floats[name][:] = value
        self.idle_rows(max_rows)
        self.upload()

    def device_int(self, name: str) -> torch.Tensor:
        return self._dev_int[name]  # [max_rows] int64

    def device_float(self, name: str) -> torch.Tensor:
        return self._dev_float[name]  # [max_rows] float32

    def idle_rows(self, n_rows: int) -> None:
        """Rows [0, n_rows) take no part in the next step unless written after this: they feed BOS at
        position 0, write the scratch position and see one key (their outputs are never read)."""
        ints = self.ints
        ints["feed"][:n_rows] = -1
        ints["token"][:n_rows] = self.bos_token
        ints["speech_pos"][:n_rows] = 0
        ints["pos"][:n_rows] = 0
        ints["write"][:n_rows] = self.scratch_pos
        ints["keys"][:n_rows] = 1
        ints["reset"][:n_rows] = 0

    def write_plan(self, plan: StepPlan, n_rows: int) -> None:
        """A step's per-row inputs, one numpy write per field whatever the rows: rows [0, n_rows) idle by default,
        then the decoding rows' feeds and positions, and the admitted rows' seen-set reset."""
        ints = self.ints
        self.idle_rows(n_rows)
        rows = plan.decode_rows
        if rows.size:
            ints["feed"][rows] = plan.decode_feed
            ints["speech_pos"][rows] = plan.decode_speech_pos  # sampled id i is embedded at speech position i+1
            ints["pos"][rows] = plan.decode_pos
            ints["write"][rows] = plan.decode_pos
            ints["keys"][rows] = plan.decode_pos + 1
        for state in plan.prefill:
            ints["reset"][list(state.rows)] = 1
        self.decode_rows_n, self.sample_rows_n = int(rows.size), int(plan.sample_rows.size)
        ints["decode_rows"][:self.decode_rows_n] = rows
        ints["sample_rows"][:self.sample_rows_n] = plan.sample_rows

    def upload(self) -> None:
        """The step's one host-to-device copy (on CUDA non-blocking, from the staging buffer not used last)."""
        if not self._staging:
            self.device_bytes.copy_(self.host)
            return
        slot, self._slot = self._slot, 1 - self._slot
        copied = self._copied[slot]
        if copied is None:
            copied = self._copied[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        else:
            copied.synchronize()
        self._staging_bytes[slot][:] = self._host_bytes
        self.device_bytes.copy_(self._staging[slot], non_blocking=True)
        copied.record()


class StepGraph:
    """`fn` (no arguments, reads and writes only static buffers) captured as a CUDA graph, or run eagerly.

    Capture follows torch's recipe (a few eager runs on a side stream for lazy initialisation, cuBLAS workspaces and
    autotuning, then one capture into a pool shared by every graph of its owner) with two differences from
    `torch.cuda.graph`: the capture runs in torch's thread-local capture mode, so that another thread's CUDA calls
    (the vocoder's, or an allocation by any thread) neither fail nor invalidate it, and it neither synchronizes the
    device nor empties the allocator's cache first (both would reach into the other threads' work). Generators the
    function draws from are registered with the graph so that replays advance them. A capture that raises leaves
    no graph behind: its caller decides (synth/t3_runner.py: eager, with the reason).
    """

    WARMUP_RUNS = 2

    def __init__(self, fn: Callable[[], None], *, capture: bool, device: torch.device | None = None, pool: Any = None,
                 generators: Sequence[torch.Generator] = (), stream: Any = None) -> None:
        """`stream`: the side stream to warm up and capture on, one per owner of a pool (its warm-up temporaries
        stay cached on one stream, not spread over torch's pool of streams); None: a new one."""
        self.fn = fn
        self.graph: Any = None
        if capture:
            self.graph = self._capture(fn, device, pool, generators, stream)

    @classmethod
    def _capture(cls, fn: Callable[[], None], device: torch.device | None, pool: Any,
                 generators: Sequence[torch.Generator], stream: Any = None) -> Any:
        side = stream if stream is not None else torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(cls.WARMUP_RUNS):
                fn()
            graph = torch.cuda.CUDAGraph()
            for generator in generators:
                graph.register_generator_state(generator)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            except BaseException:
                try:  # end the capture so that the stream is usable again; the first error is the one that counts
                    graph.capture_end()
                except Exception:
                    _end_pool_capture(graph, device)
                raise
            graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        return graph

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def pool(self) -> Any:
        return self.graph.pool() if self.graph is not None else None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def _end_pool_capture(graph: Any, device: torch.device | None) -> None:
    """After a capture_end that raised (an invalidated capture: cudaStreamEndCapture fails before the allocator is
    told the capture ended): tell the allocator, and let go of the pool's reference, as torch.cuda.use_mem_pool
    does. Otherwise the allocator keeps the capture "underway" for the rest of the process, and a later
    empty_cache (dropping the graphs for eager) fails an internal assert (pytorch#180395, fixed after torch 2.11).
    Nothing to do where capture_end got that far (endAllocateToPool then says it is not recording)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    try:
        pool = graph.pool()
        torch._C._cuda_endAllocateToPool(index, pool)
    except Exception:
        return
    try:
        torch._C._cuda_releasePool(index, pool)
    except Exception:
        pass
