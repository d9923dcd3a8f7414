"""Polynomial Mixer vs scaled-dot-product attention: time and peak memory against sequence length.

Both token mixers have width 256 and their own projections: PoM (degree 2, expand 2, the linear
polynomial variant, no mask) and multi-head attention (Q/K/V and output projections around
``torch.nn.functional.scaled_dot_product_attention``, 4 heads of 64). Batch 1, lengths 256 to
16384. For each length: forward (inference mode) and forward+backward time, median of several
repeats, measured in the same run on the CPU and, when present, on the GPU.

Peak memory. CPU: every (mixer, length) runs in a fresh process (forked from a server that has
imported torch once) that first warms up on 16 tokens, reads its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``), runs one forward, reads it again, then one
forward+backward and reads it again; the figures are the growth of that high-water mark over
the warmed-up baseline (tracemalloc cannot see torch's allocations). Blocks of 64 KiB and more
are served by mmap in those processes (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the
resident set and the high-water mark follows the live tensors, not heap fragmentation. GPU: ``torch.cuda.max_memory_allocated`` over the allocation before the run.

Usage: ``python benchmarks/pom_vs_attention.py [--threads 1] [--max-len 16384] [--out DIR]``.
Writes ``DIR/pom_vs_attention.json`` and ``DIR/pom_vs_attention.png`` (log-log) and prints the
table, the crossover length and the ratio at the longest length. Absolute times depend on the
machine and on other load; the ratios, measured side by side, are the result.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from polynets.nn.pom import PoM

WIDTH = 256
HEADS = 4
MIXERS = ("pom", "sdpa")
LABELS = {"pom": "PoM", "sdpa": "SDPA attention"}
RESULTS = Path(__file__).resolve().parent / "results"


class Attention(nn.Module):
    """Multi-head self-attention: ``W_o SDPA(W_q X, W_k X, W_v X)``; (B, N, d) -> (B, N, d)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


def build(mixer: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    module = PoM(WIDTH, degree=2, expand=2) if mixer == "pom" else Attention(WIDTH, HEADS)
    return module.to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _forward(module: nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        module(x)


def _forward_backward(module: nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


def time_call(fn, module: nn.Module, x: torch.Tensor, device: str, budget_s: float) -> dict:
    """Median wall time of ``fn(module, x)``: 3 to 15 repeats within budget after one warm-up.

    A warm-up run longer than a second is kept as a sample (first-call overheads are negligible
    next to it), which keeps the long attention runs affordable.
    """
    _sync(device)
    start = time.perf_counter()
    fn(module, x)
    _sync(device)
    first = time.perf_counter() - start
    repeats = max(3, min(15, int(budget_s / max(first, 1e-6))))
    times = [first] if first > 1.0 else []
    while len(times) < repeats:
        module.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        fn(module, x)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "repeats": repeats,
            "min_s": min(times), "max_s": max(times)}


def _maxrss_bytes() -> int:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def measure_cpu_memory_here(mixer: str, n: int, threads: int) -> dict:
    """Peak RSS growth of one forward and one forward+backward (run inside a fresh process)."""
    torch.set_num_threads(threads)
    module = build(mixer, "cpu")
    warm = torch.randn(1, 16, WIDTH)
    _forward(module, warm)
    _forward_backward(module, warm)
    module.zero_grad(set_to_none=True)
    x = torch.randn(1, n, WIDTH)
    base = _maxrss_bytes()
    _forward(module, x)
    after_forward = _maxrss_bytes()
    _forward_backward(module, x)
    after_backward = _maxrss_bytes()
    return {"forward_bytes": after_forward - base, "forward_backward_bytes": after_backward - base}


def measure_cpu_memory(pool: ProcessPoolExecutor, mixer: str, n: int, threads: int) -> dict:
    """Run :func:`measure_cpu_memory_here` in a fresh child process (one per measurement)."""
    return pool.submit(measure_cpu_memory_here, mixer, n, threads).result()


def memory_pool() -> ProcessPoolExecutor:
    """Children forked from a server that imported torch once: each task gets its own process."""
    # Large blocks come from mmap and go back to the OS when freed, so the peak RSS is the peak of
    # live tensors rather than of a fragmented heap (read by glibc when the server starts).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "polynets.nn.pom", "__main__"])
    return ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1)


def measure_cuda_memory(module: nn.Module, make_input: Callable[[], torch.Tensor]) -> dict:
    """Peak CUDA allocation above the pre-run allocation for forward and forward+backward, each
    on a fresh input from ``make_input``."""
    out = {}
    for key, fn in (("forward_bytes", _forward), ("forward_backward_bytes", _forward_backward)):
        x = make_input()
        module.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(module, x)
        torch.cuda.synchronize()
        out[key] = torch.cuda.max_memory_allocated() - base
        del x
    module.zero_grad(set_to_none=True)
    return out


def crossover(rows: list[dict], key: str) -> int | None:
    """Smallest measured length from which PoM is faster than SDPA at every longer length."""
    best = None
    for row in reversed(rows):
        if row["pom"][key]["median_s"] < row["sdpa"][key]["median_s"]:
            best = row["n"]
        else:
            break
    return best


def loglog_slope(rows: list[dict], mixer: str, key: str, min_len: int) -> float:
    """Least-squares slope of log(time) against log(length) for lengths >= min_len."""
    pts = [(math.log(r["n"]), math.log(r[mixer][key]["median_s"])) for r in rows
           if r["n"] >= min_len]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return (sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts))


def theoretical_crossover(d: int, expand: int, degree: int) -> float:
    """PoM paper Eq. 11: PoM needs fewer multiplications when n >= (D(3d + k + 1) - 4d^2) / 2d."""
    big_d = expand * d
    return (big_d * (3 * d + degree + 1) - 4 * d * d) / (2 * d)


def run_device(device: str, lengths: list[int], threads: int, budget_s: float,
               pool: ProcessPoolExecutor) -> dict:
    rows = []
    for n in tqdm(lengths, desc=f"{device} lengths"):
        row: dict = {"n": n}
        for mixer in MIXERS:
            module = build(mixer, device)
            x = torch.randn(1, n, WIDTH, device=device)
            row[mixer] = {
                "forward": time_call(_forward, module, x, device, budget_s),
                "forward_backward": time_call(_forward_backward, module, x, device, budget_s),
                "memory": (measure_cpu_memory(pool, mixer, n, threads) if device == "cpu"
                           else measure_cuda_memory(
                               module, lambda: torch.randn(1, n, WIDTH, device="cuda"))),
            }
        for key in ("forward", "forward_backward"):
            row[f"speedup_{key}"] = row["sdpa"][key]["median_s"] / row["pom"][key]["median_s"]
        rows.append(row)
    summary = {}
    for key in ("forward", "forward_backward"):
        summary[key] = {
            "crossover_length": crossover(rows, key),
            "speedup_at_longest": rows[-1][f"speedup_{key}"],
            "pom_loglog_slope_from_1024": loglog_slope(rows, "pom", key, 1024),
            "sdpa_loglog_slope_from_1024": loglog_slope(rows, "sdpa", key, 1024),
            "pom_not_slower_from_1024": all(r[f"speedup_{key}"] >= 1.0 for r in rows
                                            if r["n"] >= 1024),
        }
    return {"device": device, "rows": rows, "summary": summary}


def machine_info(threads: int) -> dict:
    info = {"platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": threads,
            "python": platform.python_version(),
            "note": ("CPU cores may be shared with other jobs while this runs, so absolute times "
                     "are noisy; PoM and SDPA are measured alternately in the same run and the "
                     "ratios are the result.")}
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("forward", "forward time (s)"), ("forward_backward", "forward+backward time (s)"),
              ("memory", "peak memory, forward+backward (MiB)"))
    for run in result["runs"]:
        ns = [r["n"] for r in run["rows"]]
        for ax, (key, label) in zip(axes, panels):
            for mixer, style in (("pom", "o-"), ("sdpa", "s--")):
                if key == "memory":
                    ys = [max(r[mixer]["memory"]["forward_backward_bytes"], 1) / 2 ** 20
                          for r in run["rows"]]
                else:
                    ys = [r[mixer][key]["median_s"] for r in run["rows"]]
                ax.loglog(ns, ys, style, base=2, label=f"{LABELS[mixer]} ({run['device']})")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"PoM vs SDPA attention, width {WIDTH}, batch 1")
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def print_report(result: dict) -> None:
    for run in result["runs"]:
        print(f"\n[{run['device']}] median seconds; speedup = SDPA / PoM; memory = peak growth MiB "
              "(forward+backward)")
        print(f"{'N':>6} {'PoM fwd':>9} {'SDPA fwd':>9} {'x':>6} {'PoM f+b':>9} {'SDPA f+b':>9} "
              f"{'x':>6} {'PoM MiB':>8} {'SDPA MiB':>9}")
        for r in run["rows"]:
            mem = [r[m]["memory"]["forward_backward_bytes"] / 2 ** 20 for m in MIXERS]
            print(f"{r['n']:>6} {r['pom']['forward']['median_s']:>9.4f} "
                  f"{r['sdpa']['forward']['median_s']:>9.4f} {r['speedup_forward']:>6.1f} "
                  f"{r['pom']['forward_backward']['median_s']:>9.4f} "
                  f"{r['sdpa']['forward_backward']['median_s']:>9.4f} "
                  f"{r['speedup_forward_backward']:>6.1f} {mem[0]:>8.1f} {mem[1]:>9.1f}")
        for key, s in run["summary"].items():
            print(f"{key}: crossover length {s['crossover_length']}, speedup at "
                  f"N={run['rows'][-1]['n']}: {s['speedup_at_longest']:.1f}x, log-log slope from "
                  f"1024: PoM {s['pom_loglog_slope_from_1024']:.2f}, SDPA "
                  f"{s['sdpa_loglog_slope_from_1024']:.2f}")
    print(f"Eq. 11 multiplication-count crossover: n >= {result['theoretical_crossover']:.0f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--budget", type=float, default=1.5,
                        help="seconds of repeats per measurement before the 3-repeat floor")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = []
    n = args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    start = time.time()
    result = {
        "benchmark": "pom_vs_attention",
        "config": {"width": WIDTH, "batch": 1, "heads": HEADS, "pom": {"degree": 2, "expand": 2,
                   "activation": "linear", "gate": "linear", "mask": None},
                   "lengths": lengths, "timing": "median wall time of 3-15 runs after one warm-up run "
                             "(kept as a sample when longer than 1 s)",
                   "memory_method": {"cpu": "ru_maxrss growth in a fresh forked process per "
                                            "(mixer, length), after a 16-token warm-up, glibc "
                                            "MALLOC_MMAP_THRESHOLD_=65536",
                                     "cuda": "torch.cuda.max_memory_allocated minus the "
                                             "allocation before the run"}},
        "machine": machine_info(args.threads),
        "theoretical_crossover": theoretical_crossover(WIDTH, 2, 2),
    }
    with memory_pool() as pool:
        result["runs"] = [run_device(d, lengths, args.threads, args.budget, pool)
                          for d in devices]
    result["total_seconds"] = time.time() - start
    if hasattr(os, "getloadavg"):
        result["machine"]["load_average_end"] = os.getloadavg()
    out_json = args.out / "pom_vs_attention.json"
    _atomic_write(out_json, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=2)))
    plot(result, args.out / "pom_vs_attention.png")
    print_report(result)
    print(f"wrote {out_json} and {args.out / 'pom_vs_attention.png'} "
          f"in {result['total_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
