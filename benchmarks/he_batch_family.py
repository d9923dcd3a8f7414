"""Batch-packed encrypted MNIST on the family of token models of ``he_family.py``: the fused
maps' compiled loops (:mod:`he._kernels`) against their NumPy loops, and against the NumPy loops
with BLAS's own thread count (the server before its products ran on one BLAS thread): same
program, same request, same run.

Each model is trained briefly (the timings do not depend on accuracy; the parameters do, through
the calibrated ranges), compiled with ``he.compile(model, x, calibration=x_train,
packing="batch")`` and nothing else, and one full group of ``slots`` images is encrypted once.
The server evaluates it four times: compiled, NumPy, NumPy on BLAS's threads, compiled (the first
pass of a process also page-faults its memory in; the compiled figure is the faster of two); the
decryption is compared with the program's simulation against the promised error, and the cost
model's prediction with the measured compiled pass. Models whose predicted group exceeds
``--budget`` seconds are listed with their prediction only.

    python benchmarks/he_batch_family.py --data-dir ../shared/data/mnist [--models a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tenseal as ts
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import he  # noqa: E402
from he import _kernels  # noqa: E402
from he import fused as he_fused  # noqa: E402
from he_family import MODELS, chosen_models  # noqa: E402
from he_inference import load_mnist, train  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402

DEFAULT_MODELS = ("p4_d32_mean,p4_d48_x2,p2_d32,p7_d32,p4_h128,conv_seq,rows_d64,mixer,pom,"
                  "stack_x3,p7_pos_d64")


#: server variants timed: this version; its NumPy loops; the NumPy loops with BLAS's own
#: thread count, as before the products ran on one BLAS thread
VARIANTS = ("compiled", "numpy", "numpy_blas_threads")


def _server_pass(server: he.Server, request: bytes, variant: str) -> float:
    saved = he_fused.threadpool_limits
    if variant == "numpy_blas_threads":
        he_fused.threadpool_limits = lambda **_: contextlib.nullcontext()
    try:
        with _kernels.numpy_loops() if variant != "compiled" else contextlib.nullcontext():
            t0 = time.perf_counter()
            server.run(request).to_bytes()
            return time.perf_counter() - t0
    finally:
        he_fused.threadpool_limits = saved


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--train-images", type=int, default=6000)
    ap.add_argument("--budget", type=float, default=90.0,
                    help="skip models whose predicted group takes longer (seconds)")
    ap.add_argument("--output", default=str(HERE / "results" / "he_batch_family.json"))
    args = ap.parse_args(argv)
    names = chosen_models(args.models)
    if _kernels.kernels() is None:
        raise SystemExit(f"the compiled loops are unavailable here: {_kernels.reason()}")
    torch.set_num_threads(2)
    xtr, ytr, xte, _ = load_mnist(args.data_dir)
    xtr, ytr = xtr[:args.train_images], ytr[:args.train_images]
    result: dict = {
        "benchmark": "he_batch_family", "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tenseal": ts.__version__,
            "load_average_at_start": os.getloadavg()},
        "data": {"train": len(xtr), "epochs": args.epochs}, "models": {}}
    for name in names:
        torch.manual_seed(0)
        model = train(MODELS[name](), xtr, ytr, args.epochs, augment=False, lr=2e-3)
        t0 = time.perf_counter()
        prog = he.compile(model, xte[:1], calibration=xtr[:2048], packing="batch")
        compile_s = time.perf_counter() - t0
        pred = prog.plan.predicted["seconds_per_ciphertext"]
        slots = prog.params.slots
        row: dict = {"ring": prog.params.poly_modulus_degree, "levels": prog.params.levels,
                     "slots": slots, "compile_s": compile_s, "predicted_group_s": pred,
                     "counts": prog.plan.predicted["counts"]}
        if pred > args.budget:
            row["skipped"] = f"predicted {pred:.0f} s per group > --budget {args.budget:.0f} s"
            result["models"][name] = row
            print(f"{name:12s} {row['skipped']}", flush=True)
            continue
        client = he.Client(prog)
        server = he.Server(prog, client.public_context())
        images = xte[torch.arange(slots) % len(xte)]
        request = client.encrypt(images).to_bytes()
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        try:
            # the first pass also page-faults the process's ciphertext memory in
            for variant in ("compiled", "numpy", "numpy_blas_threads", "compiled"):
                times[variant].append(_server_pass(server, request, variant))
        except he.ResourceError as exc:          # the group does not fit the memory free now
            row["skipped"] = str(exc)
            result["models"][name] = row
            print(f"{name:12s} {exc}", flush=True)
            continue
        got = client.decrypt(server.run(request).to_bytes())
        want = prog.simulate(images[:64].numpy())
        err = float(np.max(np.abs(got[:64] - want)))
        compiled, numpy_s = min(times["compiled"]), min(times["numpy"])
        before = min(times["numpy_blas_threads"])
        row.update({"server_s_compiled": compiled, "server_s_numpy": numpy_s,
                    "server_s_numpy_blas_threads": before,
                    "passes": times, "speedup": numpy_s / compiled,
                    "speedup_vs_blas_threads": before / compiled,
                    "images_per_s_compiled": slots / compiled,
                    "images_per_s_numpy": slots / numpy_s,
                    "prediction_error": pred / compiled - 1,
                    "max_abs_error_vs_simulation": err,
                    "promised_error": prog.params.expected_error,
                    "within_promise": err <= prog.params.expected_error})
        result["models"][name] = row
        print(f"{name:12s} N={row['ring']} {row['levels']} levels: compiled loops "
              f"{compiled:.1f} s ({slots / compiled:.0f} img/s), NumPy loops {numpy_s:.1f} s "
              f"-> {row['speedup']:.2f}x, NumPy loops on BLAS's threads {before:.1f} s -> "
              f"{row['speedup_vs_blas_threads']:.2f}x; predicted {pred:.1f} s "
              f"({row['prediction_error']:+.0%}); error {err:.1e} <= {row['promised_error']:.1e}: {row['within_promise']}",
              flush=True)
        atomic_write_bytes(args.output, json.dumps(result, indent=1).encode())
    ran = [r for r in result["models"].values() if "speedup" in r]
    if ran:
        result["summary"] = {
            "models_run": len(ran),
            "speedup_min": min(r["speedup"] for r in ran),
            "speedup_median": statistics.median(r["speedup"] for r in ran),
            "speedup_max": max(r["speedup"] for r in ran),
            "speedup_vs_blas_threads_median": statistics.median(
                r["speedup_vs_blas_threads"] for r in ran),
            "prediction_error_range": [min(r["prediction_error"] for r in ran),
                                       max(r["prediction_error"] for r in ran)],
            "all_within_promise": all(r["within_promise"] for r in ran)}
        print(json.dumps(result["summary"], indent=1))
    result["machine"]["load_average_at_end"] = os.getloadavg()
    atomic_write_bytes(args.output, json.dumps(result, indent=1).encode())
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
