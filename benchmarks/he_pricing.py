"""How well two CKKS cost tables predict vector servers, on a family of models, in one process.

Each model is compiled twice with ``he.compile`` (vector packing): once under the table shipped
with the package and once under another (``--against``, a JSON table as ``polynets he-costs``
writes one, or the shipped table of an earlier commit), each scaled to this machine by its own
factor from the same probe's rounds (:func:`he.costmodel.speed_factor`). The two servers then
run the same requests alternately, so that a shared machine's drifting speed falls on both
alike, and each server's median time is set against its table's prediction, as compiled and at
the machine's speed while the servers ran (two probes bracket their runs, as in
``he_inference.py``). The plan and thread count each table chose are reported: where they are
the same, the two timings differ by noise alone.

    python benchmarks/he_pricing.py --against old_table.json \\
        [--models token1:8,token2:8,handnet:8,p2_d32,...] [--output he_pricing.json]

A model ``name:bits`` is compiled at ``precision_bits=bits`` (16 where not given). The models of
``he_inference.py`` (``handnet``, ``token1``, ``token2``, ``monet2``) train with its recipes, the
models of ``he_family.py`` for ``--epochs`` epochs (the timings do not depend on accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import he  # noqa: E402
from he import costmodel  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402
import he_family  # noqa: E402
import he_inference  # noqa: E402

DEFAULT_MODELS = ("token1:8,token2:8,handnet:8,p2_d32,p4_d48_x2,polyblock1,monet1,padre,"
                  "p4_d32_mean,stack_x3,conv_seq")


def make(name: str, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> torch.nn.Module:
    """A model of ``he_inference`` (its recipe) or of ``he_family`` (``epochs`` epochs)."""
    torch.manual_seed(seed)
    if name in he_family.MODELS:
        return he_inference.train(he_family.MODELS[name](), x, y, epochs, augment=False,
                                  lr=2e-3, seed=seed)
    if name in he_inference.RECIPES:
        ep, lr = he_inference.RECIPES[name]
        return he_inference.train(he_inference.make_model(name), x, y, ep, augment=True,
                                  lr=lr, seed=seed)
    raise SystemExit(f"unknown model {name!r}; choose from "
                     f"{sorted(he_family.MODELS) + sorted(he_inference.RECIPES)}")


def compare(model: torch.nn.Module, x: torch.Tensor, xte: torch.Tensor, bits: int,
            tables: dict[str, costmodel.CostModel], rounds: int,
            drift: he_inference.Drift) -> dict[str, Any]:
    """Each table's program and server; their medians over ``rounds`` alternating runs, the
    runs bracketed by two probes of the machine's speed (``drift``)."""
    servers = {}
    for tag, costs in tables.items():
        prog = he.compile(model, x[:1], calibration=x[:512], packing="vector",
                          cost_model=costs, precision_bits=bits)
        client = he.Client(prog)
        server = he.Server(prog, client.public_context())
        requests = [client.encrypt(xte[i:i + 1]).to_bytes() for i in range(3)]
        server.run(requests[0])                 # first run: pools and caches
        servers[tag] = (prog, server, requests)
    times: dict[str, list[float]] = {tag: [] for tag in servers}
    before = drift.now()
    for r in range(rounds):
        for tag in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
            _, server, requests = servers[tag]
            t0 = time.perf_counter()
            server.run(requests[r % len(requests)])
            times[tag].append(time.perf_counter() - t0)
    out = {}
    for tag, (prog, server, _) in servers.items():
        measured = statistics.median(times[tag])
        predicted = prog.plan.predicted["seconds_per_ciphertext"]
        out[tag] = {"measured_s": measured, "predicted_s": predicted,
                    "prediction_error": predicted / measured - 1,
                    "ring": prog.params.poly_modulus_degree,
                    "compiler_threads": prog.server_threads,
                    "server_threads": server.engine.pool.threads,
                    "plan": he_inference.plan_line(prog)}
    now = drift.now()
    for entry in out.values():
        drift.annotate(entry, before, now)
    a, b = out.values()
    # What the table decides: the plan and the compiler's threads. The server's own trial (two
    # thread counts timed at start) is a measurement and may differ between equal tables.
    out["same_plan"] = ((a["plan"], a["compiler_threads"]) ==
                        (b["plan"], b["compiler_threads"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the other cost table (JSON)")
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8, help="alternating runs per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    try:
        other = costmodel.CostModel.from_dict(json.loads(Path(args.against).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--against {args.against}: not a cost table ({exc})") from None
    shipped = costmodel.shipped_model()
    drift = he_inference.Drift(shipped)
    # one probe's rounds, each table's factor from them: against its own probe seconds where
    # it kept them, else its seconds at the probe's ring (a table measured elsewhere, or
    # timed otherwise, reads another factor from the same rounds)
    rounds = costmodel.probe_rounds(None)
    factors = {tag: costmodel.speed_factor(t, rounds)[0]
               for tag, t in (("shipped", shipped), ("against", other))}
    factor = factors["shipped"]
    tables = {tag: t.scaled(factors[tag], f"scaled x{factors[tag]:.2f} by one probe of this run")
              for tag, t in (("shipped", shipped), ("against", other))}
    xtr, ytr, xte, _ = he_inference.load_mnist(args.data_dir)
    res: dict[str, Any] = {"benchmark": "he_pricing",
                           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                       "load_average_at_start": os.getloadavg()},
                           "against": str(args.against), "probe_factor": factor,
                           "probe_factors": factors,
                           "rounds": args.rounds, "models": {}}
    for spec in (s for s in args.models.split(",") if s):
        name, _, bits = spec.partition(":")
        model = make(name, xtr, ytr, args.epochs, args.seed)
        r = compare(model, xtr, xte, int(bits) if bits else 16, tables, args.rounds, drift)
        res["models"][spec] = r
        s, o = r["shipped"], r["against"]
        print(f"{spec:14s} shipped {s['measured_s'] * 1e3:7.1f} ms, predicted "
              f"{s['prediction_error']:+.0%} | against {o['measured_s'] * 1e3:7.1f} ms, "
              f"predicted {o['prediction_error']:+.0%} | same plan: {r['same_plan']} | the "
              f"machine {s['machine_drift']:.2f}x as slow as at the start", flush=True)
        if args.output:
            atomic_write_bytes(args.output, json.dumps(res, indent=2).encode())
    for tag in ("shipped", "against"):
        for key, what in (("prediction_error", ""),
                          ("prediction_error_drift_corrected", " at the machine's speed then")):
            errs = [m[tag][key] for m in res["models"].values()]
            res[f"{tag}_{key}s"] = {"min": min(errs), "median": float(np.median(errs)),
                                    "max": max(errs),
                                    "within_30pct": sum(abs(e) <= 0.3 for e in errs),
                                    "models": len(errs)}
            print(f"{tag}: prediction errors{what} {min(errs):+.0%} to {max(errs):+.0%} "
                  f"(median {np.median(errs):+.0%}), "
                  f"{res[f'{tag}_{key}s']['within_30pct']} of {len(errs)} within +-30%")
    if args.output:
        atomic_write_bytes(args.output, json.dumps(res, indent=2).encode())
    return res


if __name__ == "__main__":
    main()
