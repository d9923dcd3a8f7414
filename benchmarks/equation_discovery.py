"""Equation discovery: polynets (Poly-NODE + exact expansion + trajectory refits) vs PySINDy.

For Lotka-Volterra (MONet's setup), Van der Pol (mu=1) and Lorenz (10, 28, 8/3) at noise 0, 1 %
and 5 % of each variable's standard deviation, both methods see the same samples in the same run.

* polynets: ``symbolic.EquationDiscovery(degree)`` with default settings (no noise level given,
  no knowledge of the true support).
* PySINDy: STLSQ with a PolynomialLibrary of the same degree, FiniteDifference and
  SmoothedFiniteDifference derivatives, threshold from a grid. Per differentiation method the
  threshold is chosen honestly by AIC on the derivative residuals (``N ln(RSS/N) + 2k``), and
  separately the best configuration in hindsight (fewest missed + spurious terms, then lowest
  error) is chosen using the ground truth -- an upper bound on what PySINDy can do here.

Metrics per cell: max relative coefficient error over the true terms (a missed term counts as
100 %), missed terms, spurious terms, wall time (PySINDy: the whole threshold grid). Prints a
table and writes JSON (default ``benchmarks/results/equation_discovery.json``).

Run: ``nice python benchmarks/equation_discovery.py`` (about 5-10 minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import sympy
import torch

from polynets.program import atomic_write_bytes
from symbolic import EquationDiscovery
from symbolic.systems import SYSTEMS, generate

THRESHOLDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "equation_discovery.json"


def score(found: list[dict[str, float]], truth: list[dict[str, float]]) -> dict:
    """Max relative error on true terms (missed = 1.0), missed and spurious term counts."""
    rel, missed, spurious = 0.0, 0, 0
    for est, true in zip(found, truth):
        for term, value in true.items():
            rel = max(rel, abs(est.get(term, 0.0) - value) / abs(value))
            missed += term not in est
        spurious += len(set(est) - set(true))
    return {"max_rel_error": rel, "missed": missed, "spurious": spurious}


def sindy_terms(model, names: list[str]) -> list[dict[str, float]]:
    """PySINDy coefficients as ``{str(sympy monomial): value}`` per equation."""
    syms = {n: sympy.Symbol(n) for n in names}
    monomials = []
    for feature in model.get_feature_names():
        term = sympy.Integer(1)
        for factor in feature.split():
            if factor == "1":
                continue
            base, _, power = factor.partition("^")
            term *= syms[base] ** int(power or 1)
        monomials.append(str(term))
    return [{m: float(c) for m, c in zip(monomials, row) if c != 0.0}
            for row in model.coefficients()]


def run_sindy(t: np.ndarray, X: np.ndarray, degree: int, names: list[str],
              truth: list[dict[str, float]]) -> dict[str, dict]:
    import pysindy as ps

    out: dict[str, dict] = {}
    candidates = []
    for label, diff in (("FD", ps.FiniteDifference), ("SFD", ps.SmoothedFiniteDifference)):
        start = time.perf_counter()
        fits = []
        for threshold in THRESHOLDS:
            differentiation = diff()
            model = ps.SINDy(optimizer=ps.STLSQ(threshold=threshold),
                             feature_library=ps.PolynomialLibrary(degree=degree),
                             differentiation_method=differentiation)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.fit(X, t=t, feature_names=names)
                x_dot = differentiation(X, t)
                resid = model.predict(X) - x_dot
            rss = float(np.sum(resid**2))
            k = int(np.count_nonzero(model.coefficients()))
            aic = resid.size * np.log(max(rss, 1e-300) / resid.size) + 2 * k
            terms = sindy_terms(model, names)
            fits.append({"threshold": threshold, "aic": aic, "coefficients": terms,
                         **score(terms, truth)})
        seconds = time.perf_counter() - start
        chosen = min(fits, key=lambda f: f["aic"])
        out[f"pysindy_{label.lower()}_aic"] = {**chosen, "seconds": seconds,
                                               "label": f"PySINDy STLSQ + {label}, AIC threshold"}
        candidates += [dict(f, differentiation=label, seconds=seconds) for f in fits]
    best = min(candidates, key=lambda f: (f["missed"] + f["spurious"], f["max_rel_error"]))
    out["pysindy_best_hindsight"] = {**best, "label": "PySINDy best in hindsight (uses truth)"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["lotka_volterra", "van_der_pol",
                                                         "lorenz"], choices=sorted(SYSTEMS))
    parser.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.01, 0.05])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import pysindy

    cases = []
    for name in args.systems:
        for noise in args.noise:
            traj = generate(name, noise=noise, seed=args.seed)
            names = list(traj.system.variables)
            start = time.perf_counter()
            ours = EquationDiscovery(degree=traj.system.degree, variables=names,
                                     progress=False, seed=args.seed).fit(traj.t, traj.X)
            seconds = time.perf_counter() - start
            found = ours.coefficients()
            row = {"system": name, "noise": noise, "n": len(traj.t),
                   "t_end": float(traj.t[-1]), "truth": traj.truth,
                   "polynets": {**score(found, traj.truth), "coefficients": found,
                                "seconds": seconds, "label": "polynets EquationDiscovery"}}
            row.update(run_sindy(traj.t, traj.X, traj.system.degree, names, traj.truth))
            best = row["pysindy_best_hindsight"]
            row["polynets_wins"] = bool(
                row["polynets"]["max_rel_error"] < best["max_rel_error"]
                and row["polynets"]["missed"] <= best["missed"]
                and row["polynets"]["spurious"] <= best["spurious"])
            cases.append(row)
            print(f"{name} noise={noise:.0%}: polynets {row['polynets']['max_rel_error']:.2e} "
                  f"({seconds:.1f} s), PySINDy best {best['max_rel_error']:.2e}", flush=True)
    header = ("| system | noise | method | max rel. error | missed | spurious | time (s) |\n"
              "|---|---|---|---|---|---|---|")
    lines = [header]
    for row in cases:
        for key in ("polynets", "pysindy_fd_aic", "pysindy_sfd_aic", "pysindy_best_hindsight"):
            r = row[key]
            label = r["label"] + (f" (thr {r['threshold']:g}, {r['differentiation']})"
                                  if key == "pysindy_best_hindsight" else
                                  (f" (thr {r['threshold']:g})" if "threshold" in r else ""))
            lines.append(f"| {row['system']} | {row['noise']:.0%} | {label} | "
                         f"{r['max_rel_error']:.2e} | {r['missed']} | {r['spurious']} | "
                         f"{r['seconds']:.1f} |")
    table = "\n".join(lines)
    print(table)
    wins = sum(r["polynets_wins"] for r in cases)
    print(f"polynets better than PySINDy's best-in-hindsight configuration in {wins}/{len(cases)} "
          f"cells")
    result = {"benchmark": "equation_discovery",
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "pysindy": pysindy.__version__},
              "thresholds": list(THRESHOLDS), "cases": cases, "wins": wins,
              "cells": len(cases), "table_markdown": table}
    atomic_write_bytes(args.out, (json.dumps(result, indent=2) + "\n").encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
