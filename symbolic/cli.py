"""``polynets discover``: equation discovery from CSV trajectories on the command line.

Registered into the ``polynets`` command by :func:`register`. Each CSV file holds one trajectory:
a header row, a time column (default ``t``) and one column per state variable.
"""

from __future__ import annotations

import argparse
import csv
import json
from typing import Any

import numpy as np

from polynets.ir.program import atomic_write_bytes
from symbolic.errors import SymbolicDataError

__all__ = ["register", "read_csv", "cmd_discover"]

FORMATS = ("text", "latex", "python", "json")


def read_csv(path: str, *, time_column: str = "t",
             columns: list[str] | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read ``t`` (n,), ``X`` (n, dim) and the state names from a CSV file with a header row."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise SymbolicDataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SymbolicDataError(f"{path} is not a CSV text file ({exc}); expected a header row "
                                f"and one row of numbers per time") from exc
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) < 2:
        raise SymbolicDataError(f"{path}: expected a header row and data rows")
    header = [h.strip() for h in rows[0]]
    if time_column not in header:
        raise SymbolicDataError(f"{path}: no time column {time_column!r} in the header "
                                f"{header}; name it with --time-column")
    if columns and time_column in columns:
        raise SymbolicDataError(f"{path}: the time column {time_column!r} cannot be a state "
                                f"column too (--columns names the states only)")
    states = columns or [h for h in header if h != time_column]
    missing = [c for c in states if c not in header]
    if missing or not states:
        raise SymbolicDataError(f"{path}: state columns {missing or states} not found in the "
                                f"header {header}")
    index = [header.index(c) for c in [time_column] + states]
    try:
        data = np.array([[float(r[i]) for i in index] for r in rows[1:]], dtype=np.float64)
    except (ValueError, IndexError) as exc:
        raise SymbolicDataError(f"{path}: every data row needs a number in each of the columns "
                                f"{[time_column] + states} ({exc})") from exc
    return data[:, 0], data[:, 1:], states


def cmd_discover(args: argparse.Namespace) -> int:
    """Discover a sparse polynomial ODE dx/dt = f(x) from one or more CSV trajectories."""
    from symbolic.discovery import EquationDiscovery

    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    ts, Xs, names = [], [], None
    for path in args.csv:
        t, X, states = read_csv(path, time_column=args.time_column, columns=columns)
        if names is not None and states != names:
            raise SymbolicDataError(f"{path}: state columns {states} differ from {names}")
        names = states
        ts.append(t)
        Xs.append(X)
    model = EquationDiscovery(
        degree=args.degree, variables=names, threshold=args.threshold,
        significance=args.significance, noise=args.noise,
        window=None if args.window == 0 else args.window, node_steps=args.steps,
        snap_tol=args.snap, progress=not args.quiet, seed=args.seed)
    model.fit(ts if len(ts) > 1 else ts[0], Xs if len(Xs) > 1 else Xs[0])
    if args.format == "text":
        out = str(model) + "\n"
    elif args.format == "latex":
        out = model.to_latex() + "\n"
    elif args.format == "python":
        out = model.to_python()
    else:
        out = json.dumps({"variables": names, "degree": args.degree,
                          "equations": str(model).splitlines(),
                          "coefficients": model.coefficients(),
                          "score": model.score(ts if len(ts) > 1 else ts[0],
                                               Xs if len(Xs) > 1 else Xs[0]),
                          "seconds": model.timings_["total"]}, indent=2) + "\n"
    if args.output:
        atomic_write_bytes(args.output, out.encode())
        if not args.quiet:
            print(str(model))
    else:
        print(out, end="")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``discover`` subcommand to the ``polynets`` command's subparsers."""
    p = subparsers.add_parser("discover", help="discover polynomial ODEs from CSV trajectories",
                              description=cmd_discover.__doc__)
    p.add_argument("csv", nargs="+", help="CSV file(s), one trajectory each, with a header row")
    p.add_argument("--time-column", default="t", help="name of the time column (default: t)")
    p.add_argument("--columns", help="comma-separated state columns (default: all but time)")
    p.add_argument("--degree", type=int, default=2, help="maximal monomial degree (default: 2)")
    p.add_argument("--threshold", type=float, default=1e-3,
                   help="drop terms below this share of their equation's RMS (default: 1e-3)")
    p.add_argument("--significance", type=float, default=4.0,
                   help="drop terms whose z-score stays below this (default: 4)")
    p.add_argument("--noise", type=float, default=None,
                   help="known noise level, fraction of each variable's std (e.g. 0.05)")
    p.add_argument("--window", type=int, default=50,
                   help="samples per multiple-shooting window (0: whole trajectories)")
    p.add_argument("--steps", type=int, default=100, help="Poly-NODE training steps")
    p.add_argument("--snap", type=float, default=None,
                   help="snap coefficients within this relative distance of round numbers")
    p.add_argument("--format", choices=FORMATS, default="text", help="output format")
    p.add_argument("-o", "--output", help="write the result to this file (atomically)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_discover)
