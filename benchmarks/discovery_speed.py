"""Equation discovery with the compiled right-hand side against the NumPy one, same run.

The trajectory fits integrate each window's state with its sensitivities; the solver calls the
right-hand side hundreds of thousands of times per fit. ``symbolic._kernels`` compiles it
(numba); ``POLYNETS_NO_COMPILED_KERNELS=1`` keeps the NumPy path, the baseline. Each cell
(a system, a noise level, a noise seed, a sample count) is fitted with both, in alternating
order after an untimed warm-up fit with each, by ``EquationDiscovery(degree)`` with defaults; the script reports the wall time of each,
their ratio and whether both found the same terms with the same coefficients (to 1e-6).

    python benchmarks/discovery_speed.py [--cells lorenz:0.05:0,...] [--out PATH]

Writes JSON (default ``benchmarks/results/discovery_speed.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from polynets._compiled import numpy_loops
from polynets.ir.program import atomic_write_bytes
from symbolic import EquationDiscovery
from symbolic import _kernels
from symbolic.systems import ALL_SYSTEMS, generate, score_terms

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "discovery_speed.json"
#: ``system:noise:seed[:samples]``: one cell of each of four sets, and a short record
DEFAULT_CELLS = ("lotka_volterra:0.05:0", "lorenz:0.05:0", "sir:0.01:0", "rossler:0.1:0",
                 "lorenz_84:0.05:0", "cubic_3d:0.05:0", "chen_lee:0.05:0",
                 "dadras:0.05:51:510")


def fit_once(cell: str) -> dict:
    """One fit of ``cell``: seconds, terms found, coefficients and the score."""
    name, noise, seed, *samples = cell.split(":")
    system = ALL_SYSTEMS[name]
    if samples:
        system = dataclasses.replace(system, n=int(samples[0]))
    traj = generate(system, noise=float(noise), seed=int(seed))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = EquationDiscovery(degree=system.degree, variables=system.variables,
                                  progress=False, seed=int(seed)).fit(traj.t, traj.X)
    seconds = time.perf_counter() - start
    found = model.coefficients()
    return {"seconds": seconds, "coefficients": found, **score_terms(found, traj.truth)}


def same_model(a: list[dict[str, float]], b: list[dict[str, float]], rtol: float = 1e-6) -> bool:
    """Same terms in every equation, coefficients equal to ``rtol``."""
    return all(set(x) == set(y) and all(abs(x[k] - y[k]) <= rtol * max(abs(y[k]), 1e-12)
                                        for k in x) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                        help="comma-separated system:noise:seed[:samples]")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if _kernels.rhs() is None:
        print(f"the compiled right-hand side is not available: {_kernels.reason()}",
              file=sys.stderr)
        return 1
    # one untimed fit with each path first: torch, the solvers and the compiled code loaded
    fit_once("lotka_volterra:0.01:0")
    with numpy_loops():
        fit_once("lotka_volterra:0.01:0")
    rows = []
    for k, cell in enumerate(args.cells.split(",")):
        runs = {}
        for label in (("compiled", "numpy") if k % 2 == 0 else ("numpy", "compiled")):
            if label == "numpy":
                with numpy_loops():
                    runs[label] = fit_once(cell)
            else:
                runs[label] = fit_once(cell)
        row = {"cell": cell, "compiled_s": runs["compiled"]["seconds"],
               "numpy_s": runs["numpy"]["seconds"],
               "speedup": runs["numpy"]["seconds"] / runs["compiled"]["seconds"],
               "same_model": same_model(runs["compiled"]["coefficients"],
                                        runs["numpy"]["coefficients"]),
               "compiled": runs["compiled"], "numpy": runs["numpy"]}
        rows.append(row)
        print(f"{cell:26s} compiled {row['compiled_s']:7.1f} s  NumPy {row['numpy_s']:7.1f} s  "
              f"{row['speedup']:.2f}x  same model: {row['same_model']}  "
              f"(missed {runs['compiled']['missed']}, spurious {runs['compiled']['spurious']})",
              flush=True)
    ratios = np.array([r["speedup"] for r in rows])
    summary = {"cells": len(rows), "median_speedup": float(np.median(ratios)),
               "min_speedup": float(ratios.min()), "max_speedup": float(ratios.max()),
               "same_model": int(sum(r["same_model"] for r in rows)),
               "compiled_total_s": float(sum(r["compiled_s"] for r in rows)),
               "numpy_total_s": float(sum(r["numpy_s"] for r in rows))}
    print(f"median {summary['median_speedup']:.2f}x (min {summary['min_speedup']:.2f}x, max "
          f"{summary['max_speedup']:.2f}x); same model in {summary['same_model']} of "
          f"{len(rows)} cells; total {summary['compiled_total_s']:.0f} s against "
          f"{summary['numpy_total_s']:.0f} s")
    result = {"benchmark": "discovery_speed", "summary": summary, "rows": rows,
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, (json.dumps(result, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
