"""The accuracy drop report (plaintext model vs float64 simulation vs decrypted CKKS outputs) and
a vector server's step profile (each step's time beside the cost model's prediction)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from he.errors import InputShapeError

__all__ = ["Report", "report", "StepProfile", "ProfileRow", "work_words"]


@dataclass
class Report:
    """Errors and agreement between the three ways of computing a model's outputs."""

    n: int
    max_err_sim: float          # max |model - simulation|
    max_err_enc: float          # max |model - decrypted|
    max_err_enc_sim: float      # max |simulation - decrypted|
    expected_error: float       # what the parameters promise for |simulation - decrypted|
    #: fraction of samples whose decrypted argmax == plaintext argmax (None: one output value
    #: per sample, a regression, which has no argmax)
    argmax_agreement: float | None
    acc_plain: float | None
    acc_enc: float | None
    seconds: float
    params: str

    def __str__(self) -> str:
        lines = [f"accuracy drop report ({self.n} samples)",
                 f"  max |model - simulation|     {self.max_err_sim:.3e}",
                 f"  max |model - decrypted|      {self.max_err_enc:.3e}",
                 f"  max |simulation - decrypted| {self.max_err_enc_sim:.3e}  "
                 f"(parameters promise ~{self.expected_error:.1e})"]
        if self.argmax_agreement is not None:
            lines.append(f"  argmax agreement             {100 * self.argmax_agreement:.2f}%")
        if self.acc_plain is not None:
            lines.append(f"  accuracy plaintext           {100 * self.acc_plain:.2f}%")
            lines.append(f"  accuracy encrypted           {100 * self.acc_enc:.2f}%  "
                         f"(drop {100 * (self.acc_plain - self.acc_enc):+.2f} points)")
        lines.append(f"  encrypted round trip         {self.seconds:.2f} s "
                     f"({self.seconds / max(self.n, 1) * 1e3:.1f} ms per sample)")
        lines.append("  " + self.params.replace("\n", "\n  "))
        return "\n".join(lines)


def _plain(model: Any, x: np.ndarray) -> np.ndarray:
    if hasattr(model, "simulate") and not hasattr(model, "forward"):
        return np.asarray(model.simulate(x))
    import torch

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            p = next(iter(model.parameters()), None)
            dtype = p.dtype if p is not None else torch.float32
            y = model(torch.as_tensor(x, dtype=dtype))
    finally:
        model.train(was)
    return y.detach().double().cpu().numpy()


def report(model: Any, prog: Any, client: Any, server: Any, x: Any,
           y_true: Any = None) -> Report:
    """Encrypt ``x``, run it on ``server``, decrypt and compare with ``model`` and simulation.

    ``model``: the torch model (or the compiled program itself); ``x``: ``(B, *input_shape)``;
    ``y_true``: optional labels ``(B,)`` for accuracies (argmax over the last axis).
    """
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    plain = _plain(model, x)
    sim = prog.simulate(x)
    t0 = time.perf_counter()
    dec = client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())
    seconds = time.perf_counter() - t0
    flat = plain.reshape(len(x), -1)
    scores = flat.shape[1] > 1
    pa, da = flat.argmax(1), dec.reshape(len(x), -1).argmax(1)
    acc_p = acc_e = None
    if y_true is not None:
        if not scores:
            raise InputShapeError("report: y_true holds class labels, but the model returns one "
                                  "value per sample (no class scores to take the argmax of)")
        y = np.asarray(y_true)
        if y.size != len(x):
            raise InputShapeError(f"report: y_true must hold one label per sample ({len(x)}), "
                                  f"got shape {y.shape}")
        y = y.reshape(-1)
        classes = flat.shape[1]
        if y.dtype.kind not in "iuf" or not np.all(np.isfinite(y)) or \
                np.any(y != np.round(y)) or y.min() < 0 or y.max() >= classes:
            raise InputShapeError(f"report: y_true must hold class indices 0 .. {classes - 1} "
                                  f"(the model returns {classes} class scores), got values "
                                  f"{y.min()!r} .. {y.max()!r} of type {y.dtype}")
        acc_p, acc_e = float(np.mean(pa == y)), float(np.mean(da == y))
    return Report(n=len(x), max_err_sim=float(np.max(np.abs(plain - sim))),
                  max_err_enc=float(np.max(np.abs(plain - dec))),
                  max_err_enc_sim=float(np.max(np.abs(sim - dec))),
                  expected_error=float(prog.params.expected_error),
                  argmax_agreement=float(np.mean(pa == da)) if scores else None,
                  acc_plain=acc_p, acc_enc=acc_e,
                  seconds=seconds, params=str(prog.params))


def work_words(counts: Mapping[str, float]) -> str:
    """A step's operation counts (:meth:`he.plan.VectorPlan.op_counts`) in words: rotations
    (SEAL's, and hoisted ones from their decompositions), fold groups, plaintext and ciphertext
    products."""
    parts = []
    rot, hoisted = counts.get("rotate", 0), counts.get("rotate_hoisted", 0)
    if rot:
        parts.append(f"{rot:g} rotation{'s' * (rot != 1)}")
    if hoisted:
        parts.append(f"{hoisted:g} hoisted from {counts.get('decompose', 0):g} "
                     f"decomposition{'s' * (counts.get('decompose', 0) != 1)}")
    if counts.get("fold_groups"):
        parts.append(f"{counts['fold_copies']:g} fold copies in {counts['fold_groups']:g} "
                     f"group(s)")
    products = counts.get("mul_plain", 0) + counts.get("mul_ext", 0)
    if products:
        parts.append(f"{products:g} plaintext product{'s' * (products != 1)}")
    if counts.get("mul_ct"):
        parts.append(f"{counts['mul_ct']:g} ciphertext product")
    return ", ".join(parts) or "additions"


@dataclass
class ProfileRow:
    """One step of a profile (several for the planes steps, which run at once): what it
    computes, its level, the seconds predicted (None where the program does not say) and
    measured."""

    steps: tuple[int, ...]
    kind: str
    level: int
    work: str
    predicted: float | None
    measured: float


@dataclass
class StepProfile:
    """A vector request's steps timed one by one on a server (:meth:`he.Server.profile`),
    beside the cost model's prediction for each on the server's threads."""

    rows: list[ProfileRow]
    threads: int
    #: where the predictions come from, or why there are none
    note: str = ""
    measured: float = field(init=False)
    predicted: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.measured = sum(r.measured for r in self.rows)
        known = [r.predicted for r in self.rows if r.predicted is not None]
        self.predicted = sum(known) if len(known) == len(self.rows) else None

    def slowest(self, n: int = 3) -> list[ProfileRow]:
        """The ``n`` rows that took longest."""
        return sorted(self.rows, key=lambda r: -r.measured)[:n]

    def __str__(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.1f}"

        lines = [f"step profile on {self.threads} server thread(s): measured "
                 f"{self.measured * 1e3:.1f} ms, predicted {ms(self.predicted)} ms"
                 + (f" ({self.note})" if self.note else ""),
                 f"  {'step':>8s} {'kind':8s} {'level':>5s} {'predicted':>9s} {'measured':>9s}"
                 f"  {'share':>5s}  work"]
        for r in self.rows:
            label = ",".join(map(str, r.steps)) if r.steps else "-"
            share = r.measured / self.measured if self.measured > 0 else 0.0
            lines.append(f"  {label:>8s} {r.kind:8s} {r.level:5d} {ms(r.predicted):>9s} "
                         f"{ms(r.measured):>9s}  {share:5.0%}  {r.work}")
        return "\n".join(lines)
