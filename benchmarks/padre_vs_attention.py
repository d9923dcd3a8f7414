"""PADRe-2/3/4 vs scaled-dot-product attention vs PoM: time and peak memory against tokens.

The PADRe paper's latency comparison (Section 4.3, Table 6) at DeiT-Tiny width: one token mixer,
width 192, batch 1, 256 / 1024 / 2304 / 4096 tokens (16x16 to 64x64 grids). Mixers, each with its
own projections: 3-head attention (Q/K/V and output projections around
``torch.nn.functional.scaled_dot_product_attention``), PADRe of degree 2, 3 and 4 (11x11
depthwise token convolutions, the paper's instance), PoM (degree 2, expand 2, linear), and the
Appendix B instances Conv2Former (11x11) and Castling-ViT's inference form (3 heads). Attention
and PoM read the tokens as a sequence ``(1, N, 192)``, the others as a grid ``(1, H, W, 192)``.

Timing and memory use the helpers of ``benchmarks/pom_vs_attention.py`` (median of repeats after
a warm-up; CPU peak memory as the growth of the resident high-water mark in a fresh process per
measurement; GPU peak memory from ``torch.cuda.max_memory_allocated``).

Usage: ``python benchmarks/padre_vs_attention.py [--threads 1] [--sides 16 32 48 64] [--out DIR]``.
Writes ``DIR/padre_vs_attention.json`` and prints the table with each mixer's speed-up over
attention. Absolute times depend on the machine and its load; the ratios, measured side by side
in the same run, are the result. The paper reports 11-43x over attention at 4096 tokens on a
server GPU and a mobile NPU, and 106 vs 145 MB of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pom_vs_attention import (Attention, _atomic_write, _forward,  # noqa: E402
                              _forward_backward, machine_info, measure_cuda_memory,
                              memory_pool, time_call)

from polynets.nn.padre import PADRe, CastlingAttention, Conv2Former  # noqa: E402
from polynets.nn.pom import PoM  # noqa: E402

WIDTH = 192
HEADS = 3
KERNEL = 11
MIXERS = ("sdpa", "padre2", "padre3", "padre4", "pom", "conv2former", "castling")
LABELS = {"sdpa": "SDPA attention (3 heads)", "padre2": "PADRe-2", "padre3": "PADRe-3",
          "padre4": "PADRe-4", "pom": "PoM", "conv2former": "Conv2Former",
          "castling": "Castling-ViT (inference)"}
SEQUENCE_INPUT = {"sdpa", "pom"}
RESULTS = Path(__file__).resolve().parent / "results"


def build(mixer: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    if mixer == "sdpa":
        module: nn.Module = Attention(WIDTH, HEADS)
    elif mixer.startswith("padre"):
        module = PADRe(WIDTH, degree=int(mixer[-1]), kernel_size=KERNEL)
    elif mixer == "pom":
        module = PoM(WIDTH, degree=2, expand=2)
    elif mixer == "conv2former":
        module = Conv2Former(WIDTH, kernel_size=KERNEL)
    else:
        module = CastlingAttention(WIDTH, heads=HEADS)
    return module.to(device)


def tokens(mixer: str, side: int, device: str) -> torch.Tensor:
    shape = (1, side * side, WIDTH) if mixer in SEQUENCE_INPUT else (1, side, side, WIDTH)
    return torch.randn(shape, device=device)


def measure_cpu_memory_here(mixer: str, side: int, threads: int) -> dict:
    """Peak RSS growth of one forward and one forward+backward (run inside a fresh process)."""
    torch.set_num_threads(threads)
    module = build(mixer, "cpu")
    warm = tokens(mixer, 4, "cpu")
    _forward(module, warm)
    _forward_backward(module, warm)
    module.zero_grad(set_to_none=True)
    x = tokens(mixer, side, "cpu")
    scale = 1 if sys.platform == "darwin" else 1024
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    _forward(module, x)
    after_forward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    _forward_backward(module, x)
    after_backward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return {"forward_bytes": after_forward - base, "forward_backward_bytes": after_backward - base}


def run_device(device: str, sides: list[int], threads: int, budget_s: float,
               pool: ProcessPoolExecutor) -> dict:
    rows = []
    for side in sides:
        row: dict = {"tokens": side * side, "grid": [side, side]}
        for mixer in MIXERS:
            module = build(mixer, device)
            x = tokens(mixer, side, device)
            row[mixer] = {
                "forward": time_call(_forward, module, x, device, budget_s),
                "forward_backward": time_call(_forward_backward, module, x, device, budget_s),
                "memory": (pool.submit(measure_cpu_memory_here, mixer, side, threads).result()
                           if device == "cpu" else measure_cuda_memory(
                               module, lambda: tokens(mixer, side, "cuda"))),
                "params": sum(p.numel() for p in module.parameters()),
            }
            print(f"[{device}] {side * side:>5} tokens {LABELS[mixer]:<26} forward "
                  f"{row[mixer]['forward']['median_s']:.4f} s", flush=True)
        for mixer in MIXERS:
            for key in ("forward", "forward_backward"):
                row[mixer][f"speedup_{key}_vs_sdpa"] = (row["sdpa"][key]["median_s"]
                                                        / row[mixer][key]["median_s"])
        rows.append(row)
    return {"device": device, "rows": rows}


def print_report(result: dict) -> None:
    for run in result["runs"]:
        print(f"\n[{run['device']}] forward median ms (speed-up over attention), peak MiB "
              f"of forward+backward")
        print(f"{'mixer':<26}" + "".join(f"{r['tokens']:>22}" for r in run["rows"]))
        for mixer in MIXERS:
            cells = []
            for r in run["rows"]:
                m = r[mixer]
                cells.append(f"{m['forward']['median_s'] * 1e3:8.1f} ({m['speedup_forward_vs_sdpa']:4.1f}x)"
                             f"{m['memory']['forward_backward_bytes'] / 2 ** 20:6.0f}")
            print(f"{LABELS[mixer]:<26}" + "".join(f"{c:>22}" for c in cells))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--sides", type=int, nargs="+", default=[16, 32, 48, 64],
                        help="token grid sides (tokens = side^2)")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of repeats per measurement before the 3-repeat floor")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    start = time.time()
    result = {
        "benchmark": "padre_vs_attention",
        "config": {"width": WIDTH, "batch": 1, "heads": HEADS, "kernel_size": KERNEL,
                   "tokens": [s * s for s in args.sides], "mixers": LABELS,
                   "timing": "median wall time of 3-15 runs after one warm-up run",
                   "memory_method": {"cpu": "ru_maxrss growth in a fresh forked process per "
                                            "(mixer, tokens), after a 16-token warm-up",
                                     "cuda": "torch.cuda.max_memory_allocated minus the "
                                             "allocation before the run"}},
        "machine": machine_info(args.threads),
    }
    with memory_pool() as pool:
        result["runs"] = [run_device(d, args.sides, args.threads, args.budget, pool)
                          for d in devices]
    result["total_seconds"] = time.time() - start
    if hasattr(os, "getloadavg"):
        result["machine"]["load_average_end"] = os.getloadavg()
    out_json = args.out / "padre_vs_attention.json"
    _atomic_write(out_json, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=2)))
    print_report(result)
    print(f"wrote {out_json} in {result['total_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
