"""Encrypted MNIST latency of token models whose values are wider than a ring's slots: the
compiler's choice (values split over several ciphertexts of the smaller ring, or whole in the
larger, priced by the cost model) against the same model compiled whole at the smallest ring
that holds its widest value (``ring_degree=...``, what the compiler did before splitting), and
TenSEAL's tutorial recipe, all measured in the same run.

Models, written as users write them (``he_family.PatchTokens``, ``pn.MONet``): 2x2 patches give
14 x 14 = 196 tokens, so 32 channels are 6,272 elements (more than N=8192's 4,096 slots), 48
channels 9,408 and 64 channels 12,544 (more than N=16384's 8,192); a hidden expansion to 128
channels is 25,088 elements, more than any ring holds whole (its baseline is then "none"), and
6,272 over the 7 x 7 tokens of 4x4 patches.
Trained briefly on the first 8,000 MNIST test images (the timings do not depend on accuracy),
compiled with the compiler's defaults (``--precision-bits`` to change), timed one image per
round trip (encrypt, serialise, server, decrypt; median of ``--n-latency``); the recipe is timed
again after each model.

    python benchmarks/he_wide_values.py --data-dir ../shared/data/mnist [--models a,b] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import tenseal as ts
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import he  # noqa: E402
import polynets as pn  # noqa: E402
from he.plan import next_pow2  # noqa: E402
from he.params import RING_DEGREES  # noqa: E402
from polynets.ir.lowering import lower  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402
from he_family import PatchTokens, chosen_models  # noqa: E402
from he_inference import (TutorialConvNet, accuracy, baseline, load_mnist,  # noqa: E402
                          ours_vector, train)

MODELS: dict[str, Callable[[], nn.Module]] = {
    "p2_d32": lambda: PatchTokens(patch=2),
    "p2_d48": lambda: PatchTokens(patch=2, dim=48),
    "p2_d64_x2": lambda: PatchTokens(patch=2, dim=64, depth=2),
    "p2_d64_mean": lambda: PatchTokens(patch=2, dim=64, pool="mean"),
    "p2_d32_h128": lambda: PatchTokens(patch=2, hidden=128),
    "p4_d32_h128": lambda: PatchTokens(patch=4, hidden=128),
    "monet_p2_d48": lambda: pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=2,
                                     embed_dim=48, depth=1, merges=0, norm="batch"),
}


def whole_ring(model: nn.Module, x: torch.Tensor) -> int | None:
    """The smallest ring whose slots hold the widest value whole (None: none does)."""
    widest = max(next_pow2(st.n) for st in lower(pn.trace(model, x[:1])).steps)
    return next((r for r in RING_DEGREES if r // 2 >= widest), None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--n-latency", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--precision-bits", default=16,
                    type=lambda v: v if v == "argmax" else int(v))
    ap.add_argument("--quick", action="store_true", help="1 epoch, 2 images timed")
    ap.add_argument("--shipped-costs", action="store_true",
                    help="plan with the shipped table (scaled by a probe of this machine) or the "
                         "cached one instead of timing SEAL's primitives at the start of the run")
    ap.add_argument("--output", default=str(HERE / "results" / "he_wide_values.json"))
    args = ap.parse_args(argv)
    names = chosen_models(args.models, MODELS)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_mnist(args.data_dir)
    n = 2 if args.quick else args.n_latency
    epochs = 1 if args.quick else args.epochs
    costs = (he.costmodel.default_model() if args.shipped_costs
             else he.costmodel.measure(progress=True))
    tut = train(TutorialConvNet(), xtr, ytr, epochs, augment=False, lr=1e-3, tutorial=True)
    result: dict = {
        "benchmark": "he_wide_values", "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tenseal": ts.__version__,
            "load_average_at_start": os.getloadavg()},
        "precision_bits": args.precision_bits, "cost_model": costs.source,
        "data": {"train": len(xtr), "test": len(xte), "latency_images": n, "epochs": epochs},
        "models": {}}
    for name in names:
        model = train(MODELS[name](), xtr, ytr, epochs, augment=True, lr=2e-3)
        with torch.no_grad():
            plain = model(xte).double().numpy()
        row: dict = {"plain_accuracy": accuracy(plain, yte.numpy())}
        chosen = ours_vector(model, xtr, xte, n, args.precision_bits, costs)
        ring = whole_ring(model, xte)
        whole = None if ring is None else ours_vector(model, xtr, xte, n, args.precision_bits,
                                                      costs, ring_degree=ring)
        recipe_s = baseline(tut, xte, n)["median_s"]
        for key, r in (("chosen", chosen), ("whole", whole)):
            if r is None:
                row[key] = None
                continue
            r = {k: v for k, v in r.items() if k not in ("logits", "layouts")}
            r["argmax_agreement"] = float(np.mean(
                (chosen if key == "chosen" else whole)["logits"].argmax(1) == plain[:n].argmax(1)))
            r["split"] = "split over" in r["why"] and "values wider" in r["why"]
            row[key] = r
        row["recipe_latency_s"] = recipe_s
        row["chosen_vs_recipe"] = recipe_s / chosen["median_s"]
        row["whole_latency_s"] = None if whole is None else whole["median_s"]
        row["chosen_vs_whole"] = None if whole is None else whole["median_s"] / chosen["median_s"]
        result["models"][name] = row
        w = "none holds it" if whole is None else (
            f"N={whole['ring']} {whole['median_s'] * 1e3:.0f} ms")
        print(f"{name:13s} chosen N={chosen['ring']} split={row['chosen']['split']} "
              f"{chosen['median_s'] * 1e3:.0f} ms (server {chosen['server_median_s'] * 1e3:.0f} "
              f"ms, predicted {chosen['prediction_error']:+.0%}, {chosen['plan']}); whole: {w}; "
              f"recipe {recipe_s * 1e3:.0f} ms; {row['chosen_vs_recipe']:.1f}x the recipe"
              + ("" if whole is None else f", {row['chosen_vs_whole']:.2f}x whole"),
              flush=True)
        atomic_write_bytes(Path(args.output), json.dumps(result, indent=1).encode())
    rows = list(result["models"].values())
    vs_whole = [r["chosen_vs_whole"] for r in rows if r["chosen_vs_whole"] is not None]
    result["summary"] = {
        "chosen_vs_whole": {"min": min(vs_whole, default=None),
                            "median": statistics.median(vs_whole) if vs_whole else None,
                            "max": max(vs_whole, default=None)},
        "chosen_vs_recipe_median": statistics.median(r["chosen_vs_recipe"] for r in rows),
        "all_within_promise": all(r[k]["within_promise"] for r in rows
                                  for k in ("chosen", "whole") if r[k] is not None),
        "compiled_only_split": [k for k, r in result["models"].items() if r["whole"] is None]}
    print(json.dumps(result["summary"], indent=1))
    atomic_write_bytes(Path(args.output), json.dumps(result, indent=1).encode())
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
