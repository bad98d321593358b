"""The bf16-weight projection kernel (synth/linear_bf16w.c) against oneDNN fp32 (the engine's fp32 kernels).

Turbo-sized: 24 layers of GPT-2-medium projections (1024->3072, 1024->1024, 1024->4096, 4096->1024), all
distinct weights (1.2 GB fp32 / 0.6 GB bf16, far beyond the caches), so a pass streams the weights from memory
as a decode step does. Prints ms per pass for each row count and writes JSON.

    python scripts/bench_linear_bf16w.py --threads 1 --rows 1 2 8 16 32 --out out/bench_linear_bf16w.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from synth import linear_bf16w

SHAPES = [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]  # (in, out) per GPT-2-medium block
LAYERS = 24


def best_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/bench_linear_bf16w.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g).to(torch.bfloat16).float() for k, n in SHAPES] for _ in range(LAYERS)]
    packed_bf16 = [[linear_bf16w.pack(w) for w in layer] for layer in weights]
    packed_onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in weights]
    del weights
    rows_out = []
    print(f"{'rows':>5} {'bf16w ms':>9} {'oneDNN fp32 ms':>15} {'ratio':>6}")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (1024, 4096)}

        def run_bf16(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in packed_bf16:
                for (k, n), p in zip(SHAPES, layer, strict=True):
                    linear_bf16w.linear(xs[k], p, n)

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer in packed_onednn:
                for (k, _), p in zip(SHAPES, layer, strict=True):
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")

        bf16_ms, onednn_ms = best_ms(run_bf16, args.repeats), best_ms(run_onednn, args.repeats)
        rows_out.append({"rows": m, "bf16w_ms": bf16_ms, "onednn_fp32_ms": onednn_ms, "ratio": onednn_ms / bf16_ms})
        print(f"{m:5d} {bf16_ms:9.1f} {onednn_ms:15.1f} {onednn_ms / bf16_ms:6.2f}", flush=True)
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
                          "torch": torch.__version__}, "layers": LAYERS, "shapes": SHAPES, "results": rows_out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
