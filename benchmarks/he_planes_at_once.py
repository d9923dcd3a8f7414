"""A vector server's planes steps run at once on its threads, against the same steps in turn.

The planes steps of a vector plan read only the client's input ciphertexts (the first maps,
from the input planes the client arranged), so a server with several threads runs them all at
once before the other steps, and the cost model prices their makespan. The baseline is the same
server running them one after another (as it did before), toggled request by request in one
process, so that the machine's drift hits both alike: 24 requests of ciphertext bytes
alternating between the two, the median of each. The models are ``he_family.py``'s, trained the
same way (their default 16 bits); a model whose plan has no planes steps is the control.

    python benchmarks/he_planes_at_once.py [--models p4_d48_x2,pom] [--requests 24]
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

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import he  # noqa: E402
from he.compiler import _predict_vector  # noqa: E402
from he.costmodel import default_model  # noqa: E402
from he.plan import VectorPlan  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402
from he_family import MODELS, chosen_models  # noqa: E402
from he_inference import load_mnist, train  # noqa: E402

DEFAULT = "p4_d48_x2,pom,conv_seq,p7_pos_d64,p4_shift_x2,polyblock1"


def measure(name: str, xtr: torch.Tensor, ytr: torch.Tensor, xte: torch.Tensor, epochs: int,
            requests: int) -> dict:
    model = train(MODELS[name](), xtr, ytr, epochs, augment=True, lr=2e-3).eval()
    prog = he.compile(model, xte[:1], calibration=xtr[:512], packing="vector")
    plan, params = prog.plan, prog.params
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    cts = [client.encrypt(xte[i:i + 1]).to_bytes() for i in range(4)]
    server.run(cts[0])                       # warm: keys, plaintexts, pools
    at_once = VectorPlan.concurrent_planes
    in_turn = lambda self: []               # noqa: E731
    costs = default_model()
    times: dict[str, list[float]] = {"at_once": [], "in_turn": []}
    predicted = {}
    try:
        for key, fn in (("at_once", at_once), ("in_turn", in_turn)):
            VectorPlan.concurrent_planes = fn
            predicted[key] = _predict_vector(plan, params, costs, server.engine.pool.threads)[
                "seconds_per_ciphertext"]
        for r in range(requests):
            key = "at_once" if r % 2 == 0 else "in_turn"
            VectorPlan.concurrent_planes = at_once if key == "at_once" else in_turn
            t0 = time.perf_counter()
            out = server.run(cts[r % len(cts)])
            times[key].append(time.perf_counter() - t0)
    finally:
        VectorPlan.concurrent_planes = at_once
    y = client.decrypt(out)
    ref = prog.simulate(xte[(requests - 1) % len(cts):(requests - 1) % len(cts) + 1].numpy())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"planes_steps": len(plan.concurrent_planes()),
            "input_ciphertexts": len(plan.input_layout), "server_threads":
            server.engine.pool.threads, "ring": params.poly_modulus_degree,
            "median_s": med, "speedup": med["in_turn"] / med["at_once"],
            "predicted_s": predicted,
            "prediction_error": {k: predicted[k] / med[k] - 1 for k in med},
            "max_abs_error_vs_simulation": float(abs(y - ref).max()),
            "promised_error": params.expected_error}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=DEFAULT)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24, help="requests per model, alternating")
    ap.add_argument("--output", default=str(HERE / "results" / "he_planes_at_once.json"))
    args = ap.parse_args(argv)
    if args.requests < 4:
        raise SystemExit("--requests must be at least 4")
    names = chosen_models(args.models)
    torch.set_num_threads(1)
    xtr, ytr, xte, _ = load_mnist(args.data_dir)
    result = {"benchmark": "he_planes_at_once",
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_at_start": os.getloadavg()},
              "requests": args.requests, "models": {}}
    for name in names:
        row = measure(name, xtr, ytr, xte, args.epochs, args.requests)
        result["models"][name] = row
        m, p = row["median_s"], row["prediction_error"]
        print(f"{name:12s} {row['planes_steps']} planes steps, {row['input_ciphertexts']:2d} "
              f"input ciphertexts: at once {m['at_once'] * 1e3:6.1f} ms (predicted "
              f"{p['at_once']:+.0%}), in turn {m['in_turn'] * 1e3:6.1f} ms (predicted "
              f"{p['in_turn']:+.0%}): {row['speedup']:.3f}x", flush=True)
    atomic_write_bytes(args.output, json.dumps(result, indent=1).encode())
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
