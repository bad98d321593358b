"""T3's projections with bfloat16-stored weights on the CPU: fp32 math, half the bytes per decode step.

A decode step at a few rows is bound by how fast the projection weights stream from memory (Turbo: 1.2 GB of
fp32 per step; English: 2 GB). Stored as bf16 they are half that, and since bf16 -> fp32 is exact, the kernel
(`linear_bf16w.c`, compiled here on first use with the machine's C compiler) does fp32 FMAs on the weights'
exact values. What changes is the weights themselves: `round_projections_to_bf16` rounds an fp32 model's
projection weights to the nearest bf16 in place, so that the model's own modules (chatterbox's `T3.inference`)
and the engine compute with the same values. That rounding is the one lossy step (relative 2^-9 per weight),
which is why it is opt-in (`EngineConfig.cpu_weights = "bf16"`).

Each output of the kernel is one sequential FMA chain over the input dimension, so a row's result does not
depend on the other rows of the call (bitwise): the batch-invariance the engine needs (tests/synth/
test_linear_bf16w.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import cast

import torch

from synth import ckernel

log = logging.getLogger(__name__)
KernelUnavailable = ckernel.KernelUnavailable  # (re-exported: callers catch it from here)

SOURCE = Path(__file__).with_name("linear_bf16w.c")
BLOCK_OUTPUTS = 64  # GROUP_OUT in the C source: outputs per packed group
CFLAGS = ckernel.OPENMP_CFLAGS


@functools.cache
def _library() -> ctypes.CDLL:
    """Compile (once per source, compiler and machine; cached on disk) and load the kernel."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        raise KernelUnavailable(f"cpu_weights='bf16' needs an AVX-512 CPU (this one offers {capability}); "
                                "use cpu_weights='fp32'")
    lib = ckernel.build(SOURCE, CFLAGS, purpose="cpu_weights='bf16'")
    fn = lib.linear_f32_bf16w
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    return lib


def available(raise_error: bool = False) -> bool:
    """Whether the kernel compiles and loads here (raise_error: raise KernelUnavailable with the reason)."""
    try:
        _library()
    except KernelUnavailable:
        if raise_error:
            raise
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (any float dtype; rounded to bf16) -> the kernel's layout [ceil(N/64), K, 64] bf16."""
    n, k = weight.shape
    blocks = -(-n // BLOCK_OUTPUTS)
    padded = torch.zeros(blocks * BLOCK_OUTPUTS, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach().to(torch.bfloat16)
    return padded.view(blocks, BLOCK_OUTPUTS, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T + b for fp32 x [..., K] and W packed by `pack`; bitwise independent of x's other rows."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"linear_bf16w takes float32 CPU input, got {x.dtype} on {x.device}")
    k = packed.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, out_features), dtype=torch.float32)
    panel = torch.empty(m * k, dtype=torch.float32)  # the kernel's k-major copy of x (kept alive over the call)
    if m:
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        _library().linear_f32_bf16w(x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                                    None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                                    m, out_features, k, torch.get_num_threads(), panel.data_ptr())
    return y.view(*lead, out_features)


@torch.no_grad()
def round_to_bf16_(modules: list[torch.nn.Module]) -> int:
    """Round each module's weight to the nearest bf16 in place (idempotent); returns how many values changed."""
    changed = 0
    for module in modules:
        weight = cast(torch.Tensor, module.weight)
        rounded = weight.to(torch.bfloat16).to(weight.dtype)
        changed += int((rounded != weight).sum())
        weight.copy_(rounded)
    return changed


class Bf16WeightLinears:
    """Every projection of T3 packed once as bf16 for `linear` (CPU, fp32 activations). Call
    `round_to_bf16_` on the modules first so they and the engine hold the same values."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        _library()  # compile / load now, not on the first step
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}
        for module in modules:
            weight = cast(torch.Tensor, module.weight).detach()
            if type(module).__name__ == "Conv1D":  # GPT-2's transposed linear: weight [in, out]
                weight = weight.t()
            if not torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight):
                raise ValueError("Bf16WeightLinears needs bf16-representable weights: call round_to_bf16_ first")
            bias = None if module.bias is None else cast(torch.Tensor, module.bias).detach().float().contiguous()
            self._packed[id(module)] = (pack(weight), weight.shape[0], bias)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p, _, _ in self._packed.values())

    def covers(self, module: torch.nn.Module) -> bool:
        return id(module) in self._packed

    def __call__(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed, out_features, bias = self._packed[id(module)]
        return linear(x, packed, out_features, bias)
