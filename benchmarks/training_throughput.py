"""Training throughput (images/s, forward + backward + AdamW step) of MONet variants vs timm's MLP-Mixer.

Every model runs in the same process on the same random batch; timing rounds are interleaved
(each round times every model once), so load from other processes hits all models alike, and
the median over rounds is reported, both per wall-clock second and per CPU second of this
process (on a shared CPU the second is the steadier figure; CPU runs default to one thread). Each MONet is compared with the baseline Mixer closest to it
in parameter count (``mixer_s16_224`` for MONet-T). On CUDA the step runs under bf16 autocast
with channels-last memory; on CPU in float32.
``--compile`` adds each model under ``torch.compile``; ``--profile N`` keeps the N costliest ops
of one step. Prints a table and writes
``benchmarks/results/training_throughput.json``.

    python benchmarks/training_throughput.py                    # CPU: 224 px and a reduced 112 px
    python benchmarks/training_throughput.py --img-size 224 --batch-size 64 --rounds 5   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import timm
import torch
from tqdm.auto import tqdm

import polynets  # noqa: F401  (registers monet_t, monet_s, monet_ms_t, monet_ms_s in timm)
from polynets.training.device import autocast_dtype, select_device

RESULTS = Path(__file__).resolve().parent / "results" / "training_throughput.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="monet_t,monet_ms_t", help="comma-separated MONet variants")
    p.add_argument("--baselines", default="mixer_s16_224", help="comma-separated timm Mixer baselines")
    p.add_argument("--img-size", default=None, help="comma-separated input sizes (CPU default 224,112; GPU 224)")
    p.add_argument("--batch-size", default=None,
                   help="batch per input size, comma-separated (CPU default 2,4; GPU 64)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (CPU default 3; GPU 5)")
    p.add_argument("--steps", type=int, default=None, help="steps per model per round (CPU default 1; GPU 10)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU default 1)")
    p.add_argument("--compile", action="store_true",
                   help="also time each model under torch.compile (rows named MODEL+compile)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile one step of each model and keep its N costliest ops (self time "
                        "on the device)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args()


class Runner:
    """One model with its optimizer; ``step()`` is a full training step on a fixed batch."""

    def __init__(self, name: str, img_size: int, batch: int, device: torch.device, amp: torch.dtype | None,
                 compiled: bool = False) -> None:
        torch.manual_seed(0)
        self.name = f"{name}+compile" if compiled else name
        self.model = timm.create_model(name, img_size=img_size, num_classes=1000).to(device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.channels_last = device.type == "cuda"
        memory = torch.channels_last if self.channels_last else torch.contiguous_format
        self.model = self.model.to(memory_format=memory).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.forward = torch.compile(self.model) if compiled else self.model
        self.x = torch.randn(batch, 3, img_size, img_size, device=device).contiguous(memory_format=memory)
        self.y = torch.randint(0, 1000, (batch,), device=device)
        self.device, self.amp = device, amp
        self.rates: list[float] = []
        self.cpu_rates: list[float] = []

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            loss = torch.nn.functional.cross_entropy(self.forward(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> None:
        """Run ``steps`` steps; records images per wall-clock second and per CPU second."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        images = steps * self.x.shape[0]
        self.rates.append(images / (time.perf_counter() - start))
        self.cpu_rates.append(images / (time.process_time() - cpu_start))


    def profile(self, top: int) -> list[dict[str, Any]]:
        """The ``top`` ops of one step by self time on the device (on the CPU without one)."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            self.step()
            if cuda:
                torch.cuda.synchronize(self.device)
        events = prof.key_averages()
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        total = sum(getattr(e, attr) for e in events) or 1.0
        rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:top]
        return [{"op": e.key, "calls": e.count, "self_us": getattr(e, attr),
                 "share": getattr(e, attr) / total} for e in rows]


def measure(names: list[str], img_size: int, batch: int, rounds: int, steps: int, device: torch.device,
            amp: torch.dtype | None, compiled: bool = False,
            profile_top: int = 0) -> dict[str, dict[str, Any]]:
    runners = [Runner(n, img_size, batch, device, amp) for n in names]
    if compiled:
        runners += [Runner(n, img_size, batch, device, amp, compiled=True) for n in names]
    for r in tqdm(runners, desc=f"warm-up {img_size}px", leave=False):
        r.step()
    for _ in tqdm(range(rounds), desc=f"rounds {img_size}px", leave=False):
        for r in runners:
            r.timed(steps)
    profiles = {r.name: r.profile(profile_top) for r in runners} if profile_top else {}
    return {r.name: {"params": r.params, "images_per_s": statistics.median(r.rates),
                     "images_per_cpu_s": statistics.median(r.cpu_rates), "rounds": r.rates,
                     "cpu_rounds": r.cpu_rates,
                     **({"profile": profiles[r.name]} if r.name in profiles else {})}
            for r in runners}


def nearest_baseline(params: int, results: dict[str, dict[str, Any]], baselines: list[str]) -> str:
    return min(baselines, key=lambda b: abs(results[b]["params"] - params))


def main() -> None:
    args = parse_args()
    device = select_device(args.device)
    cuda = device.type == "cuda"
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    amp = autocast_dtype(device, "auto")
    sizes = [int(s) for s in (args.img_size or ("224" if cuda else "224,112")).split(",")]
    batches = [int(b) for b in (args.batch_size or ("64" if cuda else "2,4")).split(",")]
    batches = (batches * len(sizes))[: len(sizes)] if len(batches) == 1 else batches
    if len(batches) != len(sizes):
        raise SystemExit("--batch-size needs one value, or one per --img-size")
    rounds = args.rounds or (5 if cuda else 3)
    steps = args.steps or (10 if cuda else 1)
    models = [m for m in args.models.split(",") if m]
    baselines = [b for b in args.baselines.split(",") if b]
    settings = []
    for img_size, batch in zip(sizes, batches):
        results = measure(models + baselines, img_size, batch, rounds, steps, device, amp,
                          compiled=args.compile, profile_top=args.profile)
        rows = []
        variants = [""] + (["+compile"] if args.compile else [])
        for name in [m + v for v in variants for m in models]:
            # a compiled model against the compiled baselines
            suffix = "+compile" if name.endswith("+compile") else ""
            base = nearest_baseline(results[name]["params"], results, [b + suffix for b in baselines])
            rows.append({"model": name, **results[name], "baseline": base,
                         "baseline_params": results[base]["params"],
                         "baseline_images_per_s": results[base]["images_per_s"],
                         "ratio_vs_baseline": results[name]["images_per_s"] / results[base]["images_per_s"],
                         "cpu_ratio_vs_baseline":
                             results[name]["images_per_cpu_s"] / results[base]["images_per_cpu_s"]})
        for name in [b + v for v in variants for b in baselines]:
            rows.append({"model": name, **results[name], "baseline": None})
        settings.append({"img_size": img_size, "batch_size": batch, "rows": rows})
        print(f"\n{img_size}x{img_size}, batch {batch}, {rounds} rounds x {steps} steps on {device}"
              f"{f' ({amp})' if amp else ''}")
        print(f"{'model':<16}{'params (M)':>11}{'images/s':>10}{'images/cpu-s':>14}  vs baseline (wall, cpu)")
        for row in rows:
            vs = (f"{row['ratio_vs_baseline']:.2f}x, {row['cpu_ratio_vs_baseline']:.2f}x {row['baseline']}"
                  if row["baseline"] else "baseline")
            print(f"{row['model']:<16}{row['params'] / 1e6:>11.1f}{row['images_per_s']:>10.2f}"
                  f"{row['images_per_cpu_s']:>14.2f}  {vs}")
        for row in rows:
            for op in row.get("profile", []):
                print(f"  {row['model']:<22}{op['share']:>7.1%} {op['calls']:>6} x  {op['op'][:70]}")
    report = {
        "benchmark": "training_throughput",
        "what": "images per wall-clock and per CPU second of forward + backward + AdamW step, median over "
                "interleaved rounds",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "timm": timm.__version__, "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor(),
                    "threads": torch.get_num_threads(), "amp": str(amp) if amp else None,
                    "channels_last": cuda, "load_average": os.getloadavg()},
        "rounds": rounds, "steps_per_round": steps, "settings": settings,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
