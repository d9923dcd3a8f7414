"""NODE vs Poly-NODE and ANODE vs Poly-ANODE on the inner-disk / annulus task (MONet App. G).

Points inside the disk ``|x| <= 0.5`` have label -1, points of the annulus ``1 <= |x| <= 1.5``
label +1 (Dupont et al.). Four flows ``y = W z(1) + b`` are trained with the same recipe:

* NODE: ``dz/dt = MLP(z)`` (ReLU, hidden 32) on ``z = x``;
* Poly-NODE: ``dz/dt = MuLayer(z)`` (degree 2, hidden 32) on ``z = x``;
* ANODE and Poly-ANODE: the same fields on the augmented state ``z = [x, 0]``.

A flow of the plane is a homeomorphism: it cannot carry the whole inner disk out through the
annulus, so a linear readout of the plain NODEs' final state can only separate the finitely many
training points by squeezing them through gaps; the augmented flows lift the disk along the
extra dimension. Writes ``losses.json`` and ``losses.png`` (two panels, as MONet's Fig. 10-11)
into ``--out``.

Run: ``python examples/poly_anode.py [--epochs 20] [--points 1024] [--out runs/poly_anode]``
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from polynets.nn.node import ODEFlow, PolyANODE, annulus_data, train_flow  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402


class MLPField(nn.Module):
    """The NODE baseline's vector field: ``f(z) = W_3 relu(W_2 relu(W_1 z))`` (Dupont et al.)."""

    def __init__(self, dim: int, hidden: int = 32) -> None:
        super().__init__()
        self.dim = dim
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, t: Tensor | float, z: Tensor) -> Tensor:
        return self.net(z)


def make_models(hidden: int = 32, steps: int = 5) -> dict[str, nn.Module]:
    """The four flows of the comparison, all integrated with ``steps`` RK4 steps over [0, 1]."""
    return {
        "NODE": ODEFlow(MLPField(2, hidden), 2, steps=steps),
        "Poly-NODE": PolyANODE(2, augment=0, hidden=hidden, init_scale=1.0, steps=steps),
        "ANODE": ODEFlow(MLPField(3, hidden), 2, augment=1, steps=steps),
        "Poly-ANODE": PolyANODE(2, augment=1, hidden=hidden, init_scale=1.0, steps=steps),
    }


def run(epochs: int = 20, points: int = 1024, lr: float = 3e-3, seed: int = 0,
        steps: int = 5) -> dict[str, dict]:
    """Train the four flows on the same points; per model the epoch losses and seconds."""
    x, y = annulus_data(points, seed=seed)
    results = {}
    for name in make_models(steps=steps):
        torch.manual_seed(seed)
        model = make_models(steps=steps)[name]
        start = time.perf_counter()
        losses = train_flow(model, x, y, epochs=epochs, lr=lr, seed=seed)
        results[name] = {"loss": losses, "seconds": time.perf_counter() - start,
                         "parameters": sum(p.numel() for p in model.parameters())}
    return results


def plot(results: dict[str, dict], path: Path) -> None:
    """Two panels: NODE vs Poly-NODE, ANODE vs Poly-ANODE (training MSE per epoch)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, pair in zip(axes, (("NODE", "Poly-NODE"), ("ANODE", "Poly-ANODE"))):
        for name, style in zip(pair, ("--", "-")):
            losses = results[name]["loss"]
            ax.plot(range(1, len(losses) + 1), losses, style, label=name)
        ax.set_xlabel("epoch")
        ax.set_title(f"{pair[0]} vs {pair[1]}")
        ax.legend()
    axes[0].set_ylabel("training MSE")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--points", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=5, help="RK4 steps over [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/poly_anode")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args.epochs, args.points, args.lr, args.seed, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "losses.json", json.dumps(
        {"epochs": args.epochs, "points": args.points, "lr": args.lr, "steps": args.steps,
         "seed": args.seed, "models": results}, indent=2).encode())
    plot(results, out / "losses.png")
    for name, r in results.items():
        print(f"{name:<11} params {r['parameters']:>5}  first {r['loss'][0]:.3f}  "
              f"last {r['loss'][-1]:.3f}  {r['seconds']:.0f} s")
    print(f"wrote {out / 'losses.png'} and {out / 'losses.json'}")
    return results


if __name__ == "__main__":
    main()
