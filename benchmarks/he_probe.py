"""How well the probe scales the shipped cost table to this machine: vector servers' time
against the prediction, with the factor the probe reads now and with the rule it used before.

Without a table measured on the machine (``polynets he-costs``), the compiler prices plans with
the table shipped in the package times one factor, the machine's speed against the table's,
which :func:`he.costmodel.probe_speed` reads from a few rounds of SEAL's primitives at the first
compile of a process. Each round times every primitive as the table did (the best of three
loops). The factor takes each primitive's median round (:func:`he.costmodel.speed_factor`); it
used to take the least of the rounds.

Per model of ``he_family.py`` (users' token models, the library's blocks; trained briefly, as
the timings do not depend on accuracy), in a process of its own: the plan compiled with the
shipped table as it is (factor 1), its server timed (median of ``--runs`` runs of one request,
after a warm-up run), and probes of ``--rounds`` rounds right before and right after the
timing. The measured seconds over the factor-1 prediction is the factor a perfect probe would
have read; each rule's error is its prediction over the measurement, less one, with the probe
taken before the timing (as the compiler takes it) and after.

    python benchmarks/he_probe.py --data-dir ../shared/data/mnist [--models a,b] [--quick]
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
from typing import Callable

import tenseal as ts
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import he  # noqa: E402
from he.costmodel import probe_rounds, shipped_model, speed_factor  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402
from he_family import MODELS, ProcessDied, chosen_models, isolated  # noqa: E402
from he_inference import load_mnist, train  # noqa: E402

#: the rule of the probe now, and the one it replaced (the same rounds under both)
RULES: dict[str, Callable[[list[float]], float]] = {"median_round": statistics.median,
                                                    "least_round": min}
DEFAULT_MODELS = ("p4_d32_mean,p2_d32,rows_d64,p7_d32,p4_d48_x2,conv_seq,polyblock1,monet1,pom,"
                  "padre,mixer,p14_h128")


def measure_model(name: str, data: tuple[torch.Tensor, ...], epochs: int, runs: int,
                  rounds: int) -> dict:
    xtr, ytr, xte, _ = data
    table = shipped_model()
    model = train(MODELS[name](), xtr, ytr, epochs, augment=True, lr=2e-3)
    prog = he.compile(model, xtr[:1], calibration=xtr[:2000], cost_model=table)
    predicted = prog.plan.predicted["seconds_per_ciphertext"]
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    request = client.encrypt(xte[:prog.plan.interleave])
    server.run(request)                                  # warm: buffers, plaintexts
    before = probe_rounds(table, rounds)
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        server.run(request)
        seconds.append(time.perf_counter() - t0)
    after = probe_rounds(table, rounds)
    measured = statistics.median(seconds)
    row = {"ring": prog.params.poly_modulus_degree, "levels": prog.plan.levels,
           "samples_per_ciphertext": prog.plan.interleave,
           "server_threads": prog.plan.predicted["server_threads"],
           "predicted_s_at_table_speed": predicted, "server_median_s": measured,
           "server_runs_s": seconds, "factor_of_the_measurement": measured / predicted}
    for rule, stat in RULES.items():
        for when, got in (("before", before), ("after", after)):
            factor = speed_factor(table, got, stat)[0]
            row[f"{rule}_{when}_factor"] = factor
            row[f"{rule}_{when}_error"] = predicted * factor / measured - 1
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--runs", type=int, default=7, help="server runs timed per model")
    ap.add_argument("--rounds", type=int, default=he.costmodel.PROBE_ROUNDS,
                    help="probe rounds before and after each model's timing")
    ap.add_argument("--quick", action="store_true", help="two models, 3 runs")
    ap.add_argument("--output", default=str(HERE / "results" / "he_probe.json"))
    args = ap.parse_args(argv)
    names = chosen_models("p4_d32_mean,polyblock1" if args.quick else args.models)
    runs = 3 if args.quick else args.runs
    torch.set_num_threads(1)
    data = load_mnist(args.data_dir)
    result: dict = {
        "benchmark": "he_probe", "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tenseal": ts.__version__,
            "load_average_at_start": os.getloadavg()},
        "rules": {"median_round": "the probe now (he.costmodel.speed_factor)",
                  "least_round": "the probe before: each primitive's least round"},
        "rounds": args.rounds, "runs": runs, "epochs": args.epochs, "models": {}}
    out = Path(args.output)
    for name in names:
        try:
            row = isolated(lambda: measure_model(name, data, args.epochs, runs, args.rounds))
        except (ProcessDied, RuntimeError) as exc:
            row = {"error": str(exc)}
            print(f"{name:12s} {row['error']}", flush=True)
        else:
            print(f"{name:12s} N={row['ring']:5d} server {row['server_median_s'] * 1e3:7.1f} ms"
                  f" = {row['factor_of_the_measurement']:.2f}x the table's prediction; probe "
                  + ", ".join(f"{rule} {row[f'{rule}_before_factor']:.2f}x "
                              f"({row[f'{rule}_before_error']:+.0%}; after "
                              f"{row[f'{rule}_after_error']:+.0%})" for rule in RULES),
                  flush=True)
        result["models"][name] = row
        atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    done = [r for r in result["models"].values() if "error" not in r]
    if not done:
        raise SystemExit("no model finished")
    summary = {}
    for rule in RULES:
        errs = [r[f"{rule}_{when}_error"] for r in done for when in ("before", "after")]
        summary[rule] = {"error_range": [min(errs), max(errs)],
                         "median_abs_error": statistics.median(abs(e) for e in errs),
                         "within_30_percent": sum(abs(e) <= 0.3 for e in errs),
                         "probes": len(errs)}
    summary["models_failed"] = sorted(k for k, r in result["models"].items() if "error" in r)
    result["summary"] = summary
    print(json.dumps(summary, indent=1))
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
