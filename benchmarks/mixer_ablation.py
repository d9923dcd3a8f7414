"""Token mixers side by side on the digits pairs task: accuracy (mean ± std over seeds) and degree.

The task of ``examples/pom_sequence.py``: two 8x8 digits as 16 row tokens, label "same digit?";
the answer needs tokens 8 positions apart, so a model without token mixing stays near chance.
Every model is the same 2-block, width-64 polynomial classifier (BatchNorm, Mu-Layer
feed-forward, mean pooling) trained with the same recipe; only the token mixer changes:

* ``none``: a token-wise Mu-Layer of about PoM's size (the no-mixing control);
* ``pom``: the Polymorpher's linear PoM (degree 2, expand 2);
* ``padre2/3/4``: PADRe of degree 2, 3, 4 on the sequence (11-tap depthwise convolutions);
* ``conv2former``, ``castling``, ``hyena``: PADRe's Appendix B instances (11 taps; Castling with
  one head and a 3-tap local term; Hyena of order 2 with 16-tap non-causal long filters);
* ``cross_pom``: Cross-PoM between the two halves: the rows of each digit select from the state
  of the other digit's rows;
* ``pom_jump``, ``pom_selective``, ``pom_split2``, ``pom_split3``: the speech paper's variants.

Each model's polynomial degree in its input is certified with :func:`polynets.ir.certify`.
Usage: ``python benchmarks/mixer_ablation.py [--seeds 0 1 2] [--epochs 10] [--mixers ...]``;
writes ``benchmarks/results/mixer_ablation.json`` (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from pom_sequence import train_and_evaluate  # noqa: E402

import polynets as pn  # noqa: E402
from polynets.nn.models.polymorpher import PolymorpherClassifier  # noqa: E402
from polynets.nn.padre import PADRe, CastlingAttention, Conv2Former, Hyena  # noqa: E402
from polynets.nn.pom import PoM, SplitPoM  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SEQ_LEN, TOKEN, DIM, DEPTH = 16, 8, 64, 2


class CrossHalves(nn.Module):
    """Cross-PoM between the two halves of a sequence: ``[PoM(x_A, x_B); PoM(x_B, x_A)]``.

    One PoM, so both directions share weights. Shape: ``(B, 2n, d) -> (B, 2n, d)``.
    """

    def __init__(self, dim: int, **pom_kwargs) -> None:
        super().__init__()
        self.pom = PoM(dim, **pom_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        a, b = x.chunk(2, dim=1)
        return torch.cat([self.pom(a, b), self.pom(b, a)], dim=1)


MIXERS: dict[str, tuple[str, dict]] = {
    "none": ("no token mixing (token-wise Mu-Layer)", {"mixer": "token"}),
    "pom": ("Polymorpher (linear PoM, k=2)", {"mixer": "pom"}),
    "padre2": ("PADRe-2", {"mixer": lambda d: PADRe(d, degree=2, spatial_dims=1)}),
    "padre3": ("PADRe-3", {"mixer": lambda d: PADRe(d, degree=3, spatial_dims=1)}),
    "padre4": ("PADRe-4", {"mixer": lambda d: PADRe(d, degree=4, spatial_dims=1)}),
    "conv2former": ("Conv2Former", {"mixer": lambda d: Conv2Former(d, spatial_dims=1)}),
    "castling": ("Castling-ViT (inference)",
                 {"mixer": lambda d: CastlingAttention(d, spatial_dims=1)}),
    "hyena": ("Hyena (order 2)",
              {"mixer": lambda d: Hyena(d, order=2, max_len=SEQ_LEN, causal=False)}),
    "cross_pom": ("Cross-PoM (halves)", {"mixer": lambda d: CrossHalves(d, degree=2)}),
    "pom_jump": ("PoM mode jump", {"mixer": lambda d: PoM(d, degree=2, form="jump")}),
    "pom_selective": ("PoM selective", {"mixer": lambda d: PoM(d, degree=2, selective=True)}),
    "pom_split2": ("PoM 2-way split", {"mixer": lambda d: SplitPoM(d, ways=2, degree=2)}),
    "pom_split3": ("PoM 3-way split", {"mixer": lambda d: SplitPoM(d, ways=3, degree=2)}),
}


def builder(name: str) -> Callable[[], nn.Module]:
    """The classifier of mixer ``name`` (2 blocks, width 64, batch norm, Mu-Layer feed-forward)."""
    spec = MIXERS[name][1]
    return lambda: PolymorpherClassifier(SEQ_LEN, TOKEN, 2, dim=DIM, depth=DEPTH, degree=2,
                                         expand=2, ff="mu", **spec)


def certified_degree(name: str) -> int | None:
    """Degree of the (untrained, eval-mode) classifier's logits in its input tokens."""
    torch.manual_seed(0)
    cert = pn.certify(builder(name)().eval(), torch.randn(1, SEQ_LEN, TOKEN))
    return cert.degree if cert.is_polynomial else None


def run(mixers: list[str], seeds: list[int], epochs: int, progress: bool = False) -> dict:
    """Train every mixer with every seed; per mixer the runs and accuracy mean and std."""
    out: dict = {}
    for name in mixers:
        runs = []
        for seed in seeds:
            r = train_and_evaluate("pairs", name, epochs, seed=seed, progress=progress,
                                   build=builder(name))
            runs.append({"seed": seed, "test_accuracy": r["test_accuracy"],
                         "train_seconds": r["train_seconds"], "parameters": r["parameters"]})
            print(f"  {name:<14} seed {seed}: accuracy {r['test_accuracy']:.3f} "
                  f"({r['train_seconds']:.0f} s)", flush=True)
        acc = np.array([r["test_accuracy"] for r in runs])
        out[name] = {"label": MIXERS[name][0], "runs": runs,
                     "accuracy_mean": float(acc.mean()),
                     "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                     "parameters": runs[0]["parameters"], "degree": certified_degree(name),
                     "train_seconds_mean": float(np.mean([r["train_seconds"] for r in runs]))}
    return out


def table(results: dict) -> str:
    """Markdown table: mixer, degree of the classifier, parameters, accuracy mean ± std."""
    lines = ["| mixer | degree (certified) | parameters | test accuracy (mean ± std) |",
             "|---|---:|---:|---:|"]
    for r in results.values():
        lines.append(f"| {r['label']} | {r['degree']} | {r['parameters']:,} | "
                     f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = run(args.mixers, args.seeds, args.epochs)
    report = {
        "task": "digits pairs (examples/pom_sequence.py), 16 row tokens, 2 classes",
        "model": f"PolymorpherClassifier dim={DIM} depth={DEPTH} norm=batch ff=mu",
        "epochs": args.epochs, "seeds": args.seeds, "baseline": "none",
        "ratio_note": "accuracy_gain_over_none = accuracy_mean - none's accuracy_mean",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": args.threads,
                    "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "seconds": time.perf_counter() - start, "mixers": results,
    }
    if "none" in results:
        for r in results.values():
            r["accuracy_gain_over_none"] = r["accuracy_mean"] - results["none"]["accuracy_mean"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "mixer_ablation.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)
    print(table(results))
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
