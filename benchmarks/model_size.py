"""Parameters and FLOPs of the four MONet variants at 224x224 and 1000 classes vs the paper.

Each registered model (``monet_t``, ``monet_s``, ``monet_ms_t``, ``monet_ms_s``) is built through
``timm.create_model`` on the meta device (no memory, no arithmetic) and run once on a
``(1, 3, 224, 224)`` input under ``torch.utils.flop_counter.FlopCounterMode``.

Conventions, stated because papers mix them:

* ``flops``: what FlopCounterMode reports, 2 FLOPs per multiply-accumulate of every linear layer
  and convolution (matmul convention).
* ``macs``: ``flops / 2``, multiply-accumulates of linear layers and convolutions. The paper's
  "FLOPs" column (Table 1, Appendix J, computed with fvcore-style counters) counts MACs.
* ``hadamard``: element-wise products of two activations (the Mu-Layers' ``*``), counted
  separately by a dispatch hook; Appendix J adds them to its FLOPs (Eq. 13), they are < 0.2 %.
* ``paper_convention_gmacs = (macs + hadamard) / 1e9`` is the figure to set against Table 1.

Baseline measured in the same run with the same counter: timm's ``mixer_s16_224`` (MLP-Mixer
S/16, timm lists 18.5M parameters and 3.8 GMACs), which checks the counter's convention.

    python benchmarks/model_size.py [--out benchmarks/results/model_size.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import polynets  # noqa: F401  (registers the MONet models in timm)
from polynets.ir.program import atomic_write_bytes

# Table 1 of the MONet paper: parameters (millions) and FLOPs (G, multiply-accumulates).
PAPER = {
    "monet_t": (14.0, 3.6),
    "monet_s": (56.8, 11.2),
    "monet_ms_t": (10.3, 2.8),
    "monet_ms_s": (32.9, 6.8),
}
BASELINE = "mixer_s16_224"


class HadamardCounter(TorchDispatchMode):
    """Counts output elements of ``aten.mul`` between two tensors of more than one element."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.mul and len(args) == 2 and all(
                isinstance(a, torch.Tensor) and a.numel() > 1 for a in args):
            self.count += out.numel()
        return out


def measure(name: str, img_size: int = 224, num_classes: int = 1000) -> dict:
    """Parameters, FLOPs, MACs and Hadamard products of one timm model for a single image."""
    with torch.device("meta"):
        model = timm.create_model(name, num_classes=num_classes)
        x = torch.empty(1, 3, img_size, img_size)
    model.eval()
    flop_counter = FlopCounterMode(display=False)
    hadamard = HadamardCounter()
    with torch.no_grad(), flop_counter, hadamard:
        model(x)
    flops = flop_counter.get_total_flops()
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": name,
        "params": params,
        "params_m": round(params / 1e6, 3),
        "flops": flops,
        "macs": flops // 2,
        "hadamard": hadamard.count,
        "gflops": round(flops / 1e9, 3),
        "gmacs": round(flops / 2e9, 3),
        "paper_convention_gmacs": round((flops // 2 + hadamard.count) / 1e9, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "model_size.json")
    args = parser.parse_args()

    rows = []
    for name, (paper_params_m, paper_gflops) in PAPER.items():
        row = measure(name)
        row["paper_params_m"] = paper_params_m
        row["paper_gflops_as_macs"] = paper_gflops
        row["params_ratio_vs_paper"] = round(row["params"] / (paper_params_m * 1e6), 4)
        row["gmacs_ratio_vs_paper"] = round(row["paper_convention_gmacs"] / paper_gflops, 4)
        rows.append(row)
    baseline = measure(BASELINE)

    header = (f"{'model':<14}{'params (M)':>11}{'paper (M)':>10}{'ratio':>7}"
              f"{'GMACs':>8}{'paper':>7}{'ratio':>7}{'GFLOPs (2xMAC)':>16}")
    print(header)
    print("-" * len(header))
    for row in [*rows, baseline]:
        paper_m = row.get("paper_params_m")
        print(f"{row['model']:<14}{row['params_m']:>11.2f}"
              f"{paper_m if paper_m is not None else '-':>10}"
              f"{row.get('params_ratio_vs_paper', '-'):>7}"
              f"{row['paper_convention_gmacs']:>8.2f}"
              f"{row.get('paper_gflops_as_macs', '-'):>7}"
              f"{row.get('gmacs_ratio_vs_paper', '-'):>7}{row['gflops']:>16.2f}")
    print(f"\nBaseline {BASELINE} (same counter): {baseline['params_m']:.2f}M parameters, "
          f"{baseline['gmacs']:.2f} GMACs (timm lists 18.5M, 3.8 GMACs).")

    result = {
        "benchmark": "model_size",
        "input": [1, 3, 224, 224],
        "num_classes": 1000,
        "conventions": {
            "flops": "torch.utils.flop_counter.FlopCounterMode total: 2 per multiply-accumulate "
                     "of linear layers and convolutions",
            "macs": "flops / 2",
            "hadamard": "element-wise products of two activations (aten.mul), counted apart",
            "paper_convention_gmacs": "(macs + hadamard) / 1e9, the convention of the paper's "
                                      "FLOPs column (Table 1, Appendix J)",
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "timm": timm.__version__},
        "models": rows,
        "baseline": baseline,
    }
    atomic_write_bytes(args.out, (json.dumps(result, indent=2) + "\n").encode())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
