"""Polymorpher vs a token-wise model on tasks built from scikit-learn's bundled digits.

Each 8x8 digit is a sequence of 8 row tokens (8 pixels each). Two tasks:

* ``pairs`` (default): two digits side by side in time, 16 tokens (rows of digit A then rows of
  digit B); the label says whether A and B are the same digit. The answer depends on tokens 8
  positions apart: a token-wise model (same blocks with the mixer replaced by a token-wise
  Mu-Layer of the same size; only the final mean pooling sees all tokens, so its logits are a sum
  of per-token terms) cannot compare the two digits and stays near chance.
* ``rows``: plain 10-class digits from 8 row tokens.

Both models use the polynomial configuration (linear PoM, Mu-Layer feed-forward, BatchNorm), have
about the same number of parameters and are trained with the same recipe. Train/test digits are
disjoint; test pairs are drawn from test digits only. ``--variants`` adds the papers' original
non-polynomial PoM (GELU, sigmoid gate, GELU MLP, LayerNorm) for reference.

Usage: ``python examples/pom_sequence.py [--task pairs|rows] [--epochs 15] [--threads 1]
[--variants pom,token,original]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from polynets.errors import ConfigError
from polynets.nn.models.polymorpher import PolymorpherClassifier

TASKS = ("pairs", "rows")


def digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn digits as (n, 8, 8) row tokens in [0, 1], split 75/25 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    return tuple(torch.from_numpy(a) for a in (xtr, ytr, xte, yte))  # type: ignore[return-value]


def sample_pairs(x: torch.Tensor, y: torch.Tensor, n: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of 16 row tokens [digit A; digit B], label 1 iff same class; about half same."""
    first = torch.randint(len(x), (n,), generator=gen)
    other = torch.randint(len(x), (n,), generator=gen)
    # A partner of the same class: a random member of class y[first].
    order = torch.argsort(y, stable=True)
    starts = torch.searchsorted(y[order], y[first])
    sizes = torch.bincount(y, minlength=int(y.max()) + 1)[y[first]]
    same_class = order[starts + (torch.rand(n, generator=gen) * sizes).long()]
    partner = torch.where(torch.rand(n, generator=gen) < 0.5, same_class, other)
    return torch.cat([x[first], x[partner]], dim=1), (y[first] == y[partner]).long()


VARIANTS = {
    # The polynomial configuration: linear PoM, Mu-Layer feed-forward, BatchNorm.
    "pom": {"mixer": "pom", "activation": "linear", "gate": "linear", "ff": "mu", "norm": "batch"},
    # The same blocks with the mixer replaced by a token-wise Mu-Layer of the same size.
    "token": {"mixer": "token", "ff": "mu", "norm": "batch"},
    # The papers' original: GELU PoM with a sigmoid gate, GELU MLP, LayerNorm (not polynomial).
    "original": {"mixer": "pom", "activation": "gelu", "gate": "sigmoid", "ff": "mlp",
                 "norm": "layer"},
}
LABELS = {"pom": "Polymorpher (linear PoM)", "token": "token-wise (no mixing)",
          "original": "original PoM (GELU/sigmoid)"}


def make_model(task: str, variant: str, dim: int = 64, depth: int = 2) -> PolymorpherClassifier:
    """A 2-block, width-64 classifier of the given variant (see ``VARIANTS``) for ``task``."""
    if variant not in VARIANTS:
        raise ConfigError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)}")
    seq_len, classes = (16, 2) if task == "pairs" else (8, 10)
    return PolymorpherClassifier(seq_len, 8, classes, dim=dim, depth=depth, degree=2, expand=2,
                                 **VARIANTS[variant])


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train_and_evaluate(task: str, variant: str, epochs: int, *, seed: int = 0,
                       pairs_per_epoch: int = 6000, batch: int = 64, lr: float = 2e-3,
                       progress: bool = True,
                       build: Callable[[], torch.nn.Module] | None = None) -> dict:
    """Train one model on ``task`` and return its test accuracy, parameter count and time.

    ``build`` makes the model (called after seeding) instead of ``make_model(task, variant)``;
    ``variant`` then only labels the result.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; expected one of {TASKS}")
    xtr, ytr, xte, yte = digits_split(seed)
    gen = torch.Generator().manual_seed(seed)
    if task == "pairs":
        xte, yte = sample_pairs(xte, yte, 2000, gen)
    torch.manual_seed(seed)
    model = build() if build is not None else make_model(task, variant)
    steps_per_epoch = (pairs_per_epoch if task == "pairs" else len(xtr)) // batch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * steps_per_epoch)
    start = time.perf_counter()
    bar = tqdm(range(epochs), desc=f"{task}/{variant}", disable=not progress)
    for _ in bar:
        model.train()
        xa, ya = sample_pairs(xtr, ytr, pairs_per_epoch, gen) if task == "pairs" else (xtr, ytr)
        perm = torch.randperm(len(xa), generator=gen)
        for k in range(steps_per_epoch):
            idx = perm[k * batch:(k + 1) * batch]
            loss = F.cross_entropy(model(xa[idx]), ya[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    return {"task": task, "variant": variant, "epochs": epochs,
            "test_accuracy": accuracy(model, xte, yte), "train_seconds": seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
            "majority_baseline": torch.bincount(yte).max().item() / len(yte)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="pairs")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="pom,token",
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default pom,token)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; expected some of {sorted(VARIANTS)}")
    results = [train_and_evaluate(args.task, v, args.epochs, seed=args.seed) for v in variants]
    print(f"\ntask={args.task}, epochs={args.epochs}, majority-class accuracy "
          f"{results[0]['majority_baseline']:.3f}")
    for r in results:
        print(f"{LABELS[r['variant']]:<28} params {r['parameters']:>6}  test accuracy {r['test_accuracy']:.3f}  "
              f"train {r['train_seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
