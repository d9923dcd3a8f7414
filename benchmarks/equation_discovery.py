"""Equation discovery: polynets (Poly-NODE + weak-form starts + trajectory refits) vs PySINDy.

Twelve polynomial systems (``symbolic.systems.SYSTEMS``: the project's Lotka-Volterra, Van der
Pol, Lorenz and cubic oscillator, and eight it was not developed on: SIR, 4-species
Lotka-Volterra, Brusselator, FitzHugh-Nagumo, Duffing, Rossler, Chen, Hopf) at noise 0, 1, 5 and
10 % of each variable's standard deviation; both methods see the same samples in the same run.

* polynets: ``symbolic.EquationDiscovery(degree)`` with default settings (no noise level given,
  no knowledge of the true support). An exception is a failure, counted as such.
* PySINDy: STLSQ with a PolynomialLibrary of the same degree and FiniteDifference or
  SmoothedFiniteDifference derivatives, and the weak form (WeakPDELibrary), thresholds from a
  grid. For FD and SFD the threshold is chosen honestly by AIC on the derivative residuals
  (``N ln(RSS/N) + 2k``); separately the best configuration in hindsight over all three (fewest
  missed + spurious terms, then lowest error) is chosen using the ground truth -- an upper bound
  on what PySINDy can do here.

Metrics per cell: max relative coefficient error over the true terms (a missed term counts as
100 %), missed terms, spurious terms, wall time (PySINDy: per threshold grid). polynets wins a
cell with a lower error than PySINDy's best in hindsight and no more missed or spurious terms
(``polynets_wins``); the summary also splits the cells into wins, ties (both exact with errors
below ``FLOOR`` = 1e-8: the numerical floor, where which is lower says nothing) and losses.
Prints a table and a summary and writes JSON (default
``benchmarks/results/equation_discovery.json``).

The summary is given per noise seed and pooled over the seeds. Run:
``nice python benchmarks/equation_discovery.py`` (seeds 0, 1, 2; about 10 minutes per seed on
2 idle cores); ``--systems``, ``--noise`` and ``--seeds 0,1`` shrink or grow the grid (the
validation systems ``lorenz_84``, ``halvorsen``, ``genesio_tesi`` may be named too, and
``--systems heldout`` runs the eleven held-out systems of ``symbolic.systems.HELDOUT_SYSTEMS``,
e.g. with ``--seeds 3,4 --out benchmarks/results/equation_discovery_heldout.json``, and
``--systems check`` the five of ``symbolic.systems.CHECK_SYSTEMS``, ``--systems fresh`` the fifteen
of ``symbolic.systems.FRESH_SYSTEMS``, ``--systems novel`` the eleven of
``symbolic.systems.NOVEL_SYSTEMS``);
``--quick`` is a smoke run of a few minutes.
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

from polynets.ir.program import atomic_write_bytes
from symbolic import EquationDiscovery
from symbolic.systems import (ALL_SYSTEMS, CHECK_SYSTEMS, EXTRA_SYSTEMS, FRESH_SYSTEMS,
                              HELDOUT_SYSTEMS, NOVEL_SYSTEMS, PROJECT_SYSTEMS, SYSTEMS,
                              VALIDATION_SYSTEMS,
                              generate, score_terms)

THRESHOLDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "equation_discovery.json"


GROUPS = {"benchmark": sorted(SYSTEMS), "validation": sorted(VALIDATION_SYSTEMS),
          "heldout": sorted(HELDOUT_SYSTEMS), "check": sorted(CHECK_SYSTEMS),
          "fresh": sorted(FRESH_SYSTEMS), "novel": sorted(NOVEL_SYSTEMS),
          "extra": sorted(EXTRA_SYSTEMS)}
"""Names that ``--systems`` expands to a group of systems."""

QUICK = {"systems": ["lotka_volterra", "sir", "brusselator"], "noise": [0.0, 0.05],
         "seeds": [0]}
"""``--quick``: a smoke run for CI (a few minutes)."""


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
              truth: list[dict[str, float]], seed: int = 0) -> dict[str, dict]:
    """All PySINDy configurations on one cell. The weak form draws its subdomain centres from
    NumPy's global generator, which is seeded with ``seed`` first, so the baseline of a cell is
    the same in every run (and whatever ran before it in the process)."""
    import pysindy as ps

    np.random.seed(seed)
    out: dict[str, dict] = {}
    candidates = []
    start = time.perf_counter()
    weak = []
    for threshold in THRESHOLDS:
        library = ps.WeakPDELibrary(function_library=ps.PolynomialLibrary(degree=degree),
                                    spatiotemporal_grid=t, K=200, p=4)
        model = ps.SINDy(optimizer=ps.STLSQ(threshold=threshold), feature_library=library)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.fit(X, t=t, feature_names=names)
            terms = sindy_terms(model, names)
        except Exception as exc:                         # noqa: BLE001 - a failed grid point
            weak.append({"threshold": threshold, "error": f"{type(exc).__name__}: {exc}"})
            continue
        weak.append({"threshold": threshold, "coefficients": terms, **score_terms(terms, truth)})
    seconds = time.perf_counter() - start
    out["pysindy_weak_grid_seconds"] = seconds
    candidates += [dict(f, differentiation="weak", seconds=seconds) for f in weak
                   if "error" not in f]
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
                         **score_terms(terms, truth)})
        seconds = time.perf_counter() - start
        chosen = min(fits, key=lambda f: f["aic"])
        out[f"pysindy_{label.lower()}_aic"] = {**chosen, "seconds": seconds,
                                               "label": f"PySINDy STLSQ + {label}, AIC threshold"}
        candidates += [dict(f, differentiation=label, seconds=seconds) for f in fits]
    best = min(candidates, key=lambda f: (f["missed"] + f["spurious"], f["max_rel_error"]))
    out["pysindy_best_hindsight"] = {**best, "label": "PySINDy best in hindsight (uses truth)"}
    weak_ok = [f for f in weak if "error" not in f]
    if weak_ok:
        best_weak = min(weak_ok, key=lambda f: (f["missed"] + f["spurious"], f["max_rel_error"]))
        out["pysindy_weak_hindsight"] = {**best_weak, "seconds": seconds,
                                         "label": "PySINDy weak form, best threshold (uses truth)"}
    return out


FLOOR = 1e-8
"""Relative coefficient error below which a fit is at the numerical floor (the data are
integrated at rtol 1e-13): a cell where both methods find the exact terms this accurately is a
tie, whichever error is lower."""


def exact(cell: dict) -> bool:
    return "error" not in cell and cell["missed"] == 0 and cell["spurious"] == 0


def outcome(row: dict) -> str:
    """``"tie"`` when polynets and PySINDy's best in hindsight both find the exact terms with
    errors below ``FLOOR``; otherwise ``"win"`` when polynets has the lower error with no more
    missed or spurious terms (``polynets_wins``, the target's definition), else ``"loss"``."""
    ours, best = row["polynets"], row["pysindy_best_hindsight"]
    if exact(ours) and exact(best) and max(ours["max_rel_error"], best["max_rel_error"]) < FLOOR:
        return "tie"
    return "win" if row["polynets_wins"] else "loss"


def run_polynets(traj, seed: int) -> dict:
    names = list(traj.system.variables)
    start = time.perf_counter()
    try:
        ours = EquationDiscovery(degree=traj.system.degree, variables=names, progress=False,
                                 seed=seed).fit(traj.t, traj.X)
    except Exception as exc:                             # noqa: BLE001 - counted as a failure
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start,
                "max_rel_error": float("inf"), "missed": None, "spurious": None,
                "label": "polynets EquationDiscovery"}
    found = ours.coefficients()
    return {**score_terms(found, traj.truth), "coefficients": found, "start": ours.start_,
            "converged": bool(ours.converged_), "seconds": time.perf_counter() - start,
            "label": "polynets EquationDiscovery"}


def summarise(cases: list[dict]) -> dict:
    """Counts per noise band and method: exact-terms cells, failures, wins, times; a failed
    fit counts as a cell without exact terms and without a win."""
    bands = {"<=5%": lambda n: n <= 0.05 + 1e-12, "10%": lambda n: n > 0.05 + 1e-12,
             "all": lambda n: True}
    out = {}
    for band, keep in bands.items():
        rows = [r for r in cases if keep(r["noise"])]
        if not rows:
            continue
        entry = {"cells": len(rows),
                 "polynets_exact": sum(exact(r["polynets"]) for r in rows),
                 "polynets_failures": sum("error" in r["polynets"] for r in rows),
                 "polynets_wins": sum(r["polynets_wins"] for r in rows),
                 "polynets_outcomes": {name: sum(outcome(r) == name for r in rows)
                                       for name in ("win", "tie", "loss")}}
        for key in ("pysindy_fd_aic", "pysindy_sfd_aic", "pysindy_weak_hindsight",
                    "pysindy_best_hindsight"):
            entry[f"{key}_exact"] = sum(exact(r[key]) for r in rows if key in r)
        out[band] = entry
    ours = [r["polynets"]["seconds"] for r in cases]
    weak = [r["pysindy_weak_grid_seconds"] for r in cases]
    for band in [b for b in bands if b in out]:
        entry = out[band]
        entry["polynets_exact_fraction"] = entry["polynets_exact"] / entry["cells"]
        entry["polynets_wins_fraction"] = entry["polynets_wins"] / entry["cells"]
    out["median_seconds_polynets"] = float(np.median(ours))
    out["max_seconds_polynets"] = float(np.max(ours))
    out["median_seconds_pysindy_weak_grid"] = float(np.median(weak))
    out["median_time_ratio_vs_weak_grid"] = float(np.median(np.array(ours) / np.array(weak)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=sorted(SYSTEMS),
                        choices=sorted(ALL_SYSTEMS) + sorted(GROUPS),
                        help="systems or groups: 'benchmark' (the default twelve), 'validation', "
                             "'heldout' (symbolic.systems.HELDOUT_SYSTEMS), 'check' "
                             "(symbolic.systems.CHECK_SYSTEMS), 'fresh' "
                             "(symbolic.systems.FRESH_SYSTEMS), 'novel' "
                             "(symbolic.systems.NOVEL_SYSTEMS), 'extra' "
                             "(symbolic.systems.EXTRA_SYSTEMS)")
    parser.add_argument("--noise", nargs="+", type=float, default=[0.0, 0.01, 0.05, 0.1])
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help="samples per trajectory over each system's usual time span (default: "
                             "each system's own, 500-2000); fewer samples mean a coarser step")
    parser.add_argument("--seeds", default="0,1,2",
                        help="comma-separated noise seeds (default 0,1,2)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: systems {QUICK['systems']}, noise {QUICK['noise']}, "
                             f"seed 0 (overrides --systems, --noise, --seeds)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine the cells of earlier runs (e.g. seeds run as separate "
                             "processes; the last file wins a repeated cell) into --out and exit")
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 10:
        parser.error(f"--samples must be at least 10, got {args.samples}")
    args.seeds = [int(v) for v in str(args.seeds).replace(" ", ",").split(",") if v != ""]
    args.systems = list(dict.fromkeys(n for name in args.systems
                                      for n in GROUPS.get(name, [name])))
    if args.quick:
        args.systems, args.noise, args.seeds = QUICK["systems"], QUICK["noise"], QUICK["seeds"]
    if args.merge:
        cells: dict[tuple, dict] = {}
        seconds = 0.0
        for path in args.merge:
            run = json.loads(Path(path).read_text())
            seconds += float(run.get("seconds", 0.0))
            for row in run["cases"]:
                cells[(row["system"], row["noise"], row["seed"])] = row
        cases = sorted(cells.values(), key=lambda r: (r["seed"], r["system"], r["noise"]))
        args.systems = sorted({r["system"] for r in cases})
        args.noise = sorted({r["noise"] for r in cases})
        args.seeds = sorted({r["seed"] for r in cases})
        complete = len(cases) == len(args.systems) * len(args.noise) * len(args.seeds)
        write(args, cases, time.perf_counter() - seconds, complete=complete, verbose=True)
        return 0
    torch.set_num_threads(1)
    import pysindy  # noqa: F401 - fail early when the baseline is missing

    cases = []
    began = time.perf_counter()
    for seed in args.seeds:
        for name in args.systems:
            for noise in args.noise:
                traj = generate(name, n=args.samples, noise=noise, seed=seed)
                names = list(traj.system.variables)
                row = {"system": name, "held_out": name not in PROJECT_SYSTEMS, "noise": noise,
                       "seed": seed, "n": len(traj.t), "t_end": float(traj.t[-1]),
                       "truth": traj.truth, "polynets": run_polynets(traj, seed)}
                row.update(run_sindy(traj.t, traj.X, traj.system.degree, names, traj.truth,
                                     seed=seed))
                best, ours = row["pysindy_best_hindsight"], row["polynets"]
                row["polynets_wins"] = bool(
                    "error" not in ours and ours["max_rel_error"] < best["max_rel_error"]
                    and ours["missed"] <= best["missed"] and ours["spurious"] <= best["spurious"])
                row["outcome"] = outcome(row)
                cases.append(row)
                status = ours.get("error", f"{ours['max_rel_error']:.2e} missed "
                                           f"{ours['missed']} spurious {ours['spurious']}")
                print(f"{name} noise={noise:.0%} seed={seed}: polynets {status} "
                      f"({ours['seconds']:.1f} s), PySINDy best {best['max_rel_error']:.2e} "
                      f"missed {best['missed']} spurious {best['spurious']}: {row['outcome']} "
                      f"[{time.perf_counter() - began:.0f} s]", flush=True)
                write(args, cases, began, complete=False)
    write(args, cases, began, complete=True, verbose=True)
    return 0


def write(args: argparse.Namespace, cases: list[dict], began: float, *, complete: bool,
          verbose: bool = False) -> None:
    """Write the table, the per-seed and pooled summaries and every cell to ``args.out``
    (atomically; also after every cell, with ``complete`` False, so a long run can be read
    while it goes)."""
    import pysindy

    header = ("| system | noise | seed | method | max rel. error | missed | spurious | time (s) |\n"
              "|---|---|---|---|---|---|---|---|")
    lines = [header]
    for row in cases:
        for key in ("polynets", "pysindy_fd_aic", "pysindy_sfd_aic", "pysindy_weak_hindsight",
                    "pysindy_best_hindsight"):
            if key not in row:
                continue
            r = row[key]
            if "error" in r:
                lines.append(f"| {row['system']} | {row['noise']:.0%} | {row['seed']} | "
                             f"{r['label']} | failed: {r['error'][:60]} | - | - | "
                             f"{r['seconds']:.1f} |")
                continue
            label = r["label"] + (f" (thr {r['threshold']:g}, {r['differentiation']})"
                                  if key == "pysindy_best_hindsight" else
                                  (f" (thr {r['threshold']:g})" if "threshold" in r else ""))
            lines.append(f"| {row['system']} | {row['noise']:.0%} | {row['seed']} | {label} | "
                         f"{r['max_rel_error']:.2e} | {r['missed']} | {r['spurious']} | "
                         f"{r['seconds']:.1f} |")
    table = "\n".join(lines)
    seeds = [s for s in args.seeds if any(r["seed"] == s for r in cases)]
    summary = {"pooled": summarise(cases),
               "per_seed": {str(seed): summarise([r for r in cases if r["seed"] == seed])
                            for seed in seeds}}
    if verbose:
        print(table)
        print(json.dumps(summary, indent=2))
    result = {"benchmark": "equation_discovery", "complete": complete,
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "pysindy": pysindy.__version__},
              "systems": args.systems, "noise": args.noise, "seeds": args.seeds,
              "samples": args.samples,
              "quick": bool(args.quick),
              "thresholds": list(THRESHOLDS), "seconds": time.perf_counter() - began,
              "summary": summary, "cases": cases, "table_markdown": table}
    atomic_write_bytes(args.out, (json.dumps(result, indent=2) + "\n").encode())
    if verbose:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
