"""Encrypted MNIST latency on a family of token models as users write them, with the compiler's
defaults, against TenSEAL's tutorial recipe measured in the same run.

``he_inference.py`` measures four models, one of them designed for the compiler; this script
asks how the compiler does on models it was not developed on. Each is a polynomial token model
written the way a user would (patch sizes 2, 4 and 7, widths 32-64, one to three Mu-Layers,
flattened or mean-pooled heads, hidden expansion, ``nn.Conv2d`` patchify on a ``(B, N, C)``
sequence, image rows as tokens, token-mixing Mu-Layers, Poly-Blocks with spatial shift, a
one-block ``pn.MONet``, the polynomial mixers ``pn.PoM`` and ``pn.PADRe``, Mu-Layers stacked in an
``nn.Sequential`` without residuals, widening or not, a ViT-like model of 7x7 patches with a
position embedding, 14x14 patches (too wide for the client's input planes) with a hidden
expansion, a degree-3 PADRe with its 11x11 token mixing, and ``pn.PolymorpherClassifier`` on
image rows), trained briefly on
the same images (the timings do not depend on accuracy, the parameters do through the
calibrated ranges), then compiled with ``he.compile(model, x, calibration=x_train)`` and nothing
else: ``precision_bits=16``, vector packing, latency objective. ``--precision-bits argmax``
repeats it at the precision the compiler chooses from the calibration data for a classifier
read by its argmax (``--precision-bits 8``: a fixed number of bits).

Per model: the ring and chain chosen, rotations, the round trip (encrypt, serialise, server,
decrypt; median of ``--n-latency`` images), the server's time next to the cost model's prediction
(primitives timed at the start of the run), the decryption's error next to the promise, and the
ratio to the recipe's latency, measured again right after each model (a shared machine's speed
drifts over a run). Each model runs in a forked process of its own: its memory goes back to the
system when it ends, and a model killed for memory is reported as failed while the run goes on.

    python benchmarks/he_family.py --data-dir ../shared/data/mnist [--models a,b] [--quick]
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
from polynets.ir.program import atomic_write_bytes  # noqa: E402
from he_inference import ProcessDied, isolated  # noqa: E402,F401 (re-exported)
from he_inference import (MAP_BASELINES, Square, TutorialConvNet, accuracy,  # noqa: E402
                          baseline, load_mnist, ours_vector, train)


class PatchTokens(nn.Module):
    """``pn.PatchEmbed`` + BatchNorm, residual Mu-Layers, a flattened or mean-pooled head."""

    def __init__(self, patch: int = 4, dim: int = 32, depth: int = 1, pool: str = "flatten",
                 hidden: int | None = None, shift: bool = False):
        super().__init__()
        self.embed = pn.PatchEmbed(28, patch, 1, dim)
        self.norm = pn.layers.ChannelsLastBatchNorm(dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, hidden=hidden, norm="batch",
                                            spatial_shift=shift) for _ in range(depth))
        self.pool = pool
        self.head = nn.Linear(dim * (28 // patch) ** 2 if pool == "flatten" else dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(self.embed(x))
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1) if self.pool == "flatten" else t.flatten(1, 2).mean(1))


class ConvSequence(nn.Module):
    """``nn.Conv2d`` patchify to a ``(B, N, C)`` sequence, BatchNorm1d, Mu-Layers without norm,
    mean pooling."""

    def __init__(self, dim: int = 48, patch: int = 4, depth: int = 2):
        super().__init__()
        self.conv = nn.Conv2d(1, dim, patch, patch)
        self.bn = nn.BatchNorm1d(dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.bn(self.conv(x).flatten(2)).transpose(1, 2)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.mean(1))


class RowTokens(nn.Module):
    """Image rows as 28 tokens of 28 pixels: a linear embedding, Mu-Layers, flattened head."""

    def __init__(self, dim: int = 64, depth: int = 1):
        super().__init__()
        self.embed = nn.Linear(28, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch") for _ in range(depth))
        self.head = nn.Linear(28 * dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.flatten(1, 2))
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


class PolymorpherRows(nn.Module):
    """Image rows as 28 tokens of 28 pixels through ``pn.PolymorpherClassifier`` (PoM token
    mixer, Mu-Layer feed-forward, BatchNorm, mean pooling)."""

    def __init__(self, dim: int = 32, depth: int = 1):
        super().__init__()
        self.net = pn.PolymorpherClassifier(28, 28, 10, dim=dim, depth=depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1, 2))


class MixerTokens(nn.Module):
    """MLP-Mixer shape: a Mu-Layer across tokens, then one across channels, mean pooling."""

    def __init__(self, dim: int = 32, patch: int = 4):
        super().__init__()
        n = (28 // patch) ** 2
        self.embed = pn.PatchEmbed(28, patch, 1, dim)
        self.tokens = pn.MuLayer(n)
        self.channels = pn.MuLayer(dim, norm="batch")
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(1, 2)
        t = t + self.tokens(t.transpose(1, 2)).transpose(1, 2)
        t = t + self.channels(t)
        return self.head(t.mean(1))


class PolyBlockTokens(nn.Module):
    """``pn.PatchEmbed`` and ``pn.PolyBlock`` stacked by hand, mean pooling."""

    def __init__(self, dim: int = 32, patch: int = 4, depth: int = 1):
        super().__init__()
        self.embed = pn.PatchEmbed(28, patch, 1, dim)
        self.blocks = nn.Sequential(*(pn.PolyBlock(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).flatten(1, 2).mean(1))


class MixerBlockTokens(nn.Module):
    """A polynomial token mixer (``pn.PoM`` on the token sequence; ``pn.PADRe``,
    ``pn.CastlingAttention`` or ``pn.Conv2Former`` on the grid) in a residual block after a
    BatchNorm'd patch embedding, mean pooling."""

    def __init__(self, mixer: str = "pom", dim: int = 32, patch: int = 4, degree: int = 2,
                 kernel_size: int = 3):
        super().__init__()
        self.embed = pn.PatchEmbed(28, patch, 1, dim)
        self.norm = pn.layers.ChannelsLastBatchNorm(dim)
        self.sequence = mixer == "pom"
        self.mix = {"pom": lambda: pn.PoM(dim, degree=degree),
                    "padre": lambda: pn.PADRe(dim, degree=degree, kernel_size=kernel_size),
                    "castling": lambda: pn.CastlingAttention(dim, heads=2,
                                                             kernel_size=kernel_size),
                    "conv2former": lambda: pn.Conv2Former(dim, kernel_size=kernel_size)}[mixer]()
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(self.embed(x))
        t = t.flatten(1, 2) if self.sequence else t
        t = t + self.mix(t)
        return self.head(t.flatten(1, -2).mean(1))


class SquareCNN(nn.Module):
    """A small CNN as written without this library: strided convolution, BatchNorm, square,
    average pooling, a second convolution, global average pooling, a linear head."""

    def __init__(self, c1: int = 8, c2: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 5, stride=2, padding=2), nn.BatchNorm2d(c1), Square(),
            nn.AvgPool2d(2), nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), Square(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c2, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DepthwiseTokens(nn.Module):
    """Depthwise-separable: a patchifying convolution, BatchNorm, a residual branch of a 3x3
    depthwise convolution squared and a 1x1 convolution, a flattened head."""

    def __init__(self, dim: int = 16, patch: int = 4):
        super().__init__()
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.bn = nn.BatchNorm2d(dim)
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.pw = nn.Conv2d(dim, dim, 1)
        self.head = nn.Linear(dim * (28 // patch) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.bn(self.embed(x))
        d = self.dw(t)
        return self.head((t + self.pw(d * d)).flatten(1))


class StackedMuLayers(nn.Module):
    """``pn.PatchEmbed``, then Mu-Layers stacked in an ``nn.Sequential`` with no residual (each
    Mu-Layer keeps its own ``+ AX`` shortcut), optionally widening ``dims[i] -> dims[i + 1]``,
    a flattened or mean-pooled head."""

    def __init__(self, dims: tuple[int, ...] = (16, 16, 16, 16), hidden: int | None = 32,
                 pool: str = "flatten"):
        super().__init__()
        self.embed = pn.PatchEmbed(28, 4, 1, dims[0])
        self.mus = nn.Sequential(*(pn.MuLayer(a, b, hidden=hidden, norm="batch")
                                   for a, b in zip(dims[:-1], dims[1:])))
        self.pool = pool
        self.head = nn.Linear(dims[-1] * (49 if pool == "flatten" else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.mus(self.embed(x))
        return self.head(t.flatten(1) if self.pool == "flatten" else t.mean((1, 2)))


class PositionalTokens(nn.Module):
    """ViT-like: 7x7 patches embedded in ``dim`` channels plus a learned position embedding,
    residual Mu-Layers of hidden width ``hidden``, mean pooling."""

    def __init__(self, dim: int = 64, hidden: int = 128, depth: int = 2):
        super().__init__()
        self.embed = pn.PatchEmbed(28, 7, 1, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 4, 4, dim))
        self.mus = nn.ModuleList(pn.MuLayer(dim, hidden=hidden, norm="batch")
                                 for _ in range(depth))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x) + self.pos
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.mean((1, 2)))


#: name -> constructor
MODELS: dict[str, Callable[[], nn.Module]] = {
    "p4_d32_mean": lambda: PatchTokens(pool="mean"),
    "p4_d48_x2": lambda: PatchTokens(dim=48, depth=2),
    "p4_d32_x3": lambda: PatchTokens(depth=3),
    "p2_d32": lambda: PatchTokens(patch=2),
    "p2_d64_x2": lambda: PatchTokens(patch=2, dim=64, depth=2),
    "p7_d32": lambda: PatchTokens(patch=7),
    "p4_h128": lambda: PatchTokens(hidden=128),
    "p4_shift_x2": lambda: PatchTokens(depth=2, shift=True, pool="mean"),
    "conv_seq": lambda: ConvSequence(),
    "rows_d64": lambda: RowTokens(),
    "mixer": lambda: MixerTokens(),
    "polyblock1": lambda: PolyBlockTokens(),
    "pom": lambda: MixerBlockTokens("pom"),
    "padre": lambda: MixerBlockTokens("padre"),
    "monet1": lambda: pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=4,
                               embed_dim=32, depth=1, merges=0, norm="batch"),
    "stack_x3": lambda: StackedMuLayers(),
    "stack_widen": lambda: StackedMuLayers((16, 32, 64), hidden=None, pool="mean"),
    "p7_pos_d64": lambda: PositionalTokens(),
    "p14_h128": lambda: PatchTokens(patch=14, dim=64, hidden=128),
    "padre3_k11": lambda: MixerBlockTokens("padre", degree=3, kernel_size=11),
    "polymorpher_rows": lambda: PolymorpherRows(),
    "cnn_avgpool": lambda: SquareCNN(),
    "depthwise": lambda: DepthwiseTokens(),
    "castling": lambda: MixerBlockTokens("castling"),
    "conv2former": lambda: MixerBlockTokens("conv2former"),
}


def chosen_models(spec: str, known: dict[str, Callable[[], nn.Module]] = MODELS) -> list[str]:
    """The comma-separated model names of ``spec``; unknown names end the script with the list."""
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {sorted(known)}")
    return names


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--n-latency", type=int, default=5, help="images timed one by one")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--precision-bits", default=None,
                    type=lambda v: v if v == "argmax" else int(v),
                    help="passed to he.compile: bits, or 'argmax' (chosen from the calibration "
                         "outputs); default: the compiler's own default")
    ap.add_argument("--quick", action="store_true", help="1 epoch, 2 images timed")
    ap.add_argument("--shipped-costs", action="store_true",
                    help="plan with the shipped table (scaled by a probe of this machine) or the "
                         "cached one instead of timing SEAL's primitives at the start of the run")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    names = chosen_models(args.models)
    out = Path(args.output or HERE / "results" / (
        "he_family.json" if args.precision_bits is None
        else f"he_family_{args.precision_bits}.json"))
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_mnist(args.data_dir)
    n = 2 if args.quick else args.n_latency
    epochs = 1 if args.quick else args.epochs
    ynp = yte.numpy()
    costs = (he.costmodel.default_model() if args.shipped_costs
             else he.costmodel.measure(progress=True))
    tut = train(TutorialConvNet(), xtr, ytr, epochs, augment=False, lr=1e-3, tutorial=True)
    base = baseline(tut, xte, n)
    print(f"TenSEAL tutorial recipe: {base['median_s'] * 1e3:.0f} ms per image (at the start)",
          flush=True)
    kwargs = {} if args.precision_bits is None else {"precision_bits": args.precision_bits}
    result: dict = {
        "benchmark": "he_family", "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tenseal": ts.__version__,
            "load_average_at_start": os.getloadavg()},
        "compile_arguments": kwargs or "defaults",
        "cost_model": costs.source + ("" if args.shipped_costs
                                      else " (timed at the start of this run)"),
        "data": {"train": len(xtr), "test": len(xte), "latency_images": n, "epochs": epochs},
        "baseline_tenseal_tutorial": {"median_latency_s": base["median_s"],
                                      "params": base["params"]},
        "models": {}}
    def measure(name: str) -> dict:
        model = train(MODELS[name](), xtr, ytr, epochs, augment=True, lr=2e-3)
        with torch.no_grad():
            plain = model(xte).double().numpy()
        cert = pn.certify(model, xte[:1])
        vec = _vector(model, xtr, xte, n, costs, kwargs)
        # the recipe again right after each model: a shared machine's speed drifts over a run
        recipe_s = baseline(tut, xte, n)["median_s"]
        row = {"plain_accuracy": accuracy(plain, ynp), "degree": cert.degree,
               "certified_levels": cert.levels,
               **{k: v for k, v in vec.items() if k != "logits"}}
        row["argmax_agreement"] = float(np.mean(vec["logits"].argmax(1) ==
                                                plain[:n].argmax(1)))
        row["recipe_latency_s"] = recipe_s
        row["speedup_vs_recipe"] = recipe_s / vec["median_s"]
        return row

    for name in names:
        try:
            row = isolated(lambda: measure(name))
        except ProcessDied as exc:
            row = {"error": str(exc)}
            print(f"{name:12s} {row['error']}", flush=True)
        else:
            print(f"{name:12s} N={row['ring']:5d} {row['levels']} levels, {row['plan']}\n"
                  f"{'':12s} {row['median_s'] * 1e3:6.0f} ms per image "
                  f"({row['speedup_vs_recipe']:.1f}x the recipe's "
                  f"{row['recipe_latency_s'] * 1e3:.0f} ms), server "
                  f"{row['server_median_s'] * 1e3:.0f} ms (predicted "
                  f"{row['prediction_error']:+.0%}), error "
                  f"{row['max_abs_error_vs_simulation']:.1e} <= {row['promised_error']:.1e}: "
                  f"{row['within_promise']}", flush=True)
            if "products_block_speedup" in row:
                print(f"{'':12s} hoisted loops in blocks of {he.hoist.PRODUCT_BLOCK} words "
                      f"{row['products_block_speedup']:.2f}x as fast as in blocks of 512 "
                      f"(server {row['block512_server_median_s'] * 1e3:.0f} ms, alternated)",
                      flush=True)
            for _, on_server, on_client, what in MAP_BASELINES.values():
                if f"{on_client}_speedup" in row:
                    print(f"{'':12s} the client applying {what}: "
                          f"{row[f'{on_client}_speedup']:.2f}x as fast a round trip as the "
                          f"server (N={row[f'{on_server}_ring']}, "
                          f"{row[f'{on_server}_levels']} levels, "
                          f"{row[f'{on_server}_median_s'] * 1e3:.0f} ms, alternated)",
                          flush=True)
                if f"{on_client}_baseline_skipped" in row:
                    print(f"{'':12s} no baseline of {what} on the server: "
                          f"{row[f'{on_client}_baseline_skipped']}", flush=True)
            if "folds_grouping_speedup" in row:
                print(f"{'':12s} folds a group at a time {row['folds_grouping_speedup']:.2f}x as "
                      f"fast as one rotation at a time (server "
                      f"{row['folds_single_server_median_s'] * 1e3:.0f} ms, alternated)",
                      flush=True)
        result["models"][name] = row
        atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    done = [r for r in result["models"].values() if "error" not in r]
    if not done:
        raise SystemExit("no model finished")
    ratios = [r["speedup_vs_recipe"] for r in done]
    preds = [r["prediction_error"] for r in done]
    result["summary"] = {
        "speedup_min": min(ratios), "speedup_median": statistics.median(ratios),
        "speedup_max": max(ratios), "prediction_error_range": [min(preds), max(preds)],
        "all_within_promise": all(r["within_promise"] for r in done),
        "folds_grouping_speedups": {k: r["folds_grouping_speedup"]
                                    for k, r in result["models"].items()
                                    if "folds_grouping_speedup" in r},
        "client_map_speedups": {k: r["client_map_speedup"]
                                for k, r in result["models"].items()
                                if "client_map_speedup" in r},
        "client_first_speedups": {k: r["client_first_speedup"]
                                  for k, r in result["models"].items()
                                  if "client_first_speedup" in r},
        "client_maps_speedups": {k: r["client_maps_speedup"]
                                 for k, r in result["models"].items()
                                 if "client_maps_speedup" in r},
        "products_block_speedups": {k: r["products_block_speedup"]
                                    for k, r in result["models"].items()
                                    if "products_block_speedup" in r},
        "models_failed": sorted(k for k, r in result["models"].items() if "error" in r)}
    print(json.dumps(result["summary"], indent=1))
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    print(f"wrote {out}")
    return result


def _vector(model: nn.Module, xtr: torch.Tensor, xte: torch.Tensor, n: int,
            costs: he.costmodel.CostModel, kwargs: dict) -> dict:
    """``he_inference.ours_vector`` at the compiler's default precision unless asked."""
    bits = kwargs.get("precision_bits")
    if bits is None:
        import inspect

        bits = inspect.signature(he.compile).parameters["precision_bits"].default
    return ours_vector(model, xtr, xte, n, bits, costs)


if __name__ == "__main__":
    main()
