"""The device side of an engine's set-up: the device each engine thread uses, how many slots fit in its memory, and
the vocoder's TF32 mode. Torch is imported here (and by the runner and the vocoder), never by synth/engine.py.

Slots (`plan_slots`): a slot's KV rows are allocated once at start-up, so the count must fit in the device memory
that is free once the models are loaded, beside what grows later: the vocoder's graph pools (their static inputs
hold a prompt cache per stream for every batch size captured), the voice prefix pool, and headroom for activations,
prefill, cuBLAS workspaces and the allocator's fragmentation. `max_slots=0` ("auto") takes as many as fit (at
most MAX_AUTO_SLOTS); an explicit count that does not fit is refused before anything is allocated, with the
numbers. The budget is the device's free memory, or `EngineConfig.memory_budget_gb` when set (a GPU shared with
another process; the tests, on a CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GB = 1e9
HEADROOM_FRACTION = 0.08  # of the device's total memory, kept free ...
HEADROOM_MIN_BYTES = 2 * 2**30  # ... and at least this
MAX_AUTO_SLOTS = 256


class SlotsDoNotFit(ValueError):
    """An explicit slot count needs more memory than the budget holds (the message has the numbers)."""


def bind_thread(device: torch.device) -> None:
    """First call of every thread that runs the engine's torch work (the engine's step thread, the vocoder worker,
    the voice preparation thread): its CUDA calls and streams go to `device` (cuda:N, not the process's current
    device, which is cuda:0 on a new thread), and it computes no gradients."""
    torch.set_grad_enabled(False)
    if device.type == "cuda" and device.index is not None:  # (a bare "cuda": the thread's current device,
        torch.cuda.set_device(device)                        # which torch.cuda.set_device refuses to be told)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device now; (0, 0) elsewhere."""
    if device.type != "cuda":
        return 0, 0
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass(frozen=True, slots=True)
class SlotPlan:
    slots: int
    per_slot_bytes: int  # KV rows of one slot (two for a CFG variant)
    budget_bytes: int  # free memory at start (or the configured budget)
    reserved: dict[str, int] = field(default_factory=dict)  # what else must fit, by name
    auto: bool = False

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.per_slot_bytes

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value / GB:.2f} GB" for name, value in self.reserved.items())
        how = "auto" if self.auto else "as configured"
        return (f"max_slots {self.slots} ({how}): KV {self.per_slot_bytes / GB:.3f} GB a slot, "
                f"{self.kv_bytes / GB:.2f} GB in all, of {self.budget_bytes / GB:.2f} GB free less {parts}")


def plan_slots(requested: int, *, budget_bytes: int, total_bytes: int, per_slot_bytes: int,
               reserved: dict[str, int], max_auto: int = MAX_AUTO_SLOTS) -> SlotPlan:
    """`requested` slots (0: as many as fit, at most `max_auto`) checked against `budget_bytes` less `reserved`
    less the headroom. Raises SlotsDoNotFit for an explicit count that does not fit, or when not even one does."""
    if requested < 0 or per_slot_bytes <= 0:
        raise ValueError("requested must be >= 0 and per_slot_bytes > 0")
    reserve = dict(reserved)
    reserve["headroom"] = max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * total_bytes))
    room = budget_bytes - sum(reserve.values())
    fits = max(0, room // per_slot_bytes)
    if requested:
        plan = SlotPlan(requested, per_slot_bytes, budget_bytes, reserve)
        if requested > fits:
            raise SlotsDoNotFit(f"max_slots {requested} does not fit: {plan.kv_bytes / GB:.2f} GB of KV "
                                f"({per_slot_bytes / GB:.3f} GB a slot) but {budget_bytes / GB:.2f} GB free less "
                                f"{', '.join(f'{k} {v / GB:.2f} GB' for k, v in reserve.items())} leaves "
                                f"{max(0, room) / GB:.2f} GB: {fits} slots fit")
        return plan
    if fits < 1:
        raise SlotsDoNotFit(f"not one slot fits: {per_slot_bytes / GB:.3f} GB of KV a slot, {budget_bytes / GB:.2f} "
                            f"GB free less {', '.join(f'{k} {v / GB:.2f} GB' for k, v in reserve.items())}")
    return SlotPlan(int(min(fits, max_auto)), per_slot_bytes, budget_bytes, reserve, auto=True)


def use_vocoder_tf32(mode: str, device: torch.device, t3_dtype: torch.dtype) -> bool:
    """TF32 for the vocoder's float32 products on CUDA (its matmuls and convolutions; ~8x the fp32 rate on a
    Hopper GPU). torch's switches are process-wide, so "auto" turns them on only when T3 does not compute in
    float32 itself (bf16/fp16 products are unaffected by them); "on" turns them on in any case, "off" turns them off
    (both: torch's default for convolutions is TF32 on). Returns whether they are on."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"vocoder_tf32 must be 'auto', 'on' or 'off', not {mode!r}")
    if device.type != "cuda":
        return False
    on = not (mode == "off" or (mode == "auto" and t3_dtype == torch.float32))
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on
