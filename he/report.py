"""The accuracy drop report: plaintext model vs float64 simulation vs decrypted CKKS outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from he.errors import InputShapeError

__all__ = ["Report", "report"]


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
