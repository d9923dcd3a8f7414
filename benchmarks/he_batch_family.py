"""Batch-packed encrypted MNIST on the family of token models of ``he_family.py``: the server on
the threads the compiler chose (a group's ciphertext products, relinearisations and rescales
called without the GIL, :mod:`he.native`) against the same server on one thread, and optionally
against the fused maps' NumPy loops (``--numpy``): same program, same request, same run.

Each model is trained briefly (the timings do not depend on accuracy; the parameters do, through
the calibrated ranges), compiled with ``he.compile(model, x, calibration=x_train,
packing="batch")`` (or ``--packing tokens``) and nothing else, and one full group of images is
encrypted once.
The servers evaluate it in turns, twice each (each figure is the faster of two; the servers
prepare their first request as they start, ``he.Server.warm``, and the first pass is compared
with the prediction too); the decryption is compared with the program's
simulation against the promised error, and the cost model's predictions (on the chosen threads
and on one) with the measured passes. Models whose predicted group exceeds ``--budget`` seconds
are listed with their prediction only.

    python benchmarks/he_batch_family.py --data-dir ../shared/data/mnist [--models a,b] [--numpy]

Every model runs in a process of its own (``--in-process``: all in this one): SEAL's memory
pool keeps what a model's groups allocated, so a process that ran a large model could not hold
the next one's group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
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
from he.compiler import shared_values_as_steps  # noqa: E402
from he.runtime import eager_products  # noqa: E402
from he_family import MODELS, chosen_models  # noqa: E402
from he_inference import composed_shared, load_mnist, train  # noqa: E402
from he_probe import RULES  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402

DEFAULT_MODELS = ("p4_d32_mean,p4_d48_x2,p2_d32,p7_d32,p4_h128,conv_seq,rows_d64,mixer,pom,"
                  "stack_x3,p7_pos_d64")


#: server variants timed: this version (the compiler's threads); the same on one thread; the
#: same on the compiler's threads with every product finished (where the program leaves some
#: lazy, :func:`he.runtime.eager_products`); its fused maps' NumPy loops on one thread
#: (``--numpy``); on the compiler's threads in tiles, under a memory budget (``--tiled``), and
#: the same with every product finished where its tiles leave some lazy; in the most tiles,
#: held in memory and, under a budget those do not fit, spilling to disk (``--spilled``); the
#: program compiled with the thin values several maps read kept as steps
#: of their own where it composed them (``--shared``, its own keys and request)
VARIANTS = ("threads", "one_thread", "eager", "numpy", "tiled", "tiled_eager", "in_tiles",
            "spilled", "kept")


def _server_pass(servers: dict[str, he.Server], request: bytes, variant: str) -> float:
    server = servers["threads" if variant in ("threads", "eager") else
                     "tiled" if variant == "tiled_eager" else
                     variant if variant in ("tiled", "in_tiles", "spilled", "kept")
                     else "one_thread"]
    with _kernels.numpy_loops() if variant == "numpy" else \
            eager_products() if variant in ("eager", "tiled_eager") else \
            contextlib.nullcontext():
        t0 = time.perf_counter()
        server.run(request).to_bytes()
        return time.perf_counter() - t0


def _spill_servers(prog: he.CompiledProgram, ctx: bytes, row: dict) -> dict[str, he.Server]:
    """A server in the program's most tiles (the memory they allocate, just), and one under a
    budget halfway to what they allocate spilling (so they do not fit: it spills); none where
    the program has no segment or nothing to spill. Their memory joins ``row``."""
    from he.compiler import batch_group_memory
    from he.runtime import PLAIN_CACHE_BYTES
    from he.tiling import MAX_TILES, allocated_memory, find_segments, row_bytes_of

    low, live = prog.lowered, prog.plan.live
    rb = row_bytes_of(low, prog.params.poly_modulus_degree, prog.params.limbs)
    segments = find_segments(low, live, rb, keep_inputs=False)
    most = {s.end: min(s.components, MAX_TILES) for s in segments}
    floor = allocated_memory(low, live, rb, segments, most, False) + PLAIN_CACHE_BYTES
    spilling = allocated_memory(low, live, rb, segments, most, False, True) + PLAIN_CACHE_BYTES
    if not segments or spilling >= floor:
        return {}
    out = {}
    lazy = prog.options.get("lazy_products", ())
    for name, budget in (("in_tiles", int(floor) + 1), ("spilled", int((spilling + floor) / 2))):
        mem = batch_group_memory(low, live, prog.params, budget, segments, keep_inputs=False,
                                 lazy=lazy,
                                 lazy_in_tiles=prog.options.get("lazy_in_tiles", False))
        row.update({f"{name}_budget_mib": budget / 2 ** 20,
                    f"{name}_working_mib": mem.working / 2 ** 20, f"{name}_tiles": mem.tiles,
                    f"{name}_spills": sum(n for _, n in mem.spills),
                    f"{name}_predicted_s": _batch_prediction(prog, prog.server_threads,
                                                             budget)})
        out[name] = he.Server(prog, ctx, memory_budget=budget)
    return out


def _batch_prediction(prog: he.CompiledProgram, threads: int,
                      budget: float | None = None) -> float:
    """The cost model's prediction for the program's batch group on ``threads`` server
    threads, under a server memory budget of ``budget`` bytes (None: none; in tiles, lazy
    products kept where they fit)."""
    from he.compiler import _predict_batch
    from he.runtime import live_rows

    lowered = prog.lowered
    return _predict_batch(lowered, live_rows(lowered), prog.params, he.costmodel.default_model(),
                          prog.options["fused_fanin"], threads, budget,
                          lazy=prog.options.get("lazy_products", ()),
                          lazy_in_tiles=prog.options.get("lazy_in_tiles", False)
                          )["seconds_per_ciphertext"]


def _one_thread_prediction(prog: he.CompiledProgram) -> float:
    """The cost model's prediction for the program's group on one server thread."""
    from he.compiler import _predict_tokens

    if prog.packing == "tokens":
        return _predict_tokens(prog.plan, prog.params, he.costmodel.default_model(),
                               1)["seconds_per_ciphertext"]
    return _batch_prediction(prog, 1)


def _each_in_a_process(args: argparse.Namespace, names: list[str],
                       argv: list[str] | None) -> dict:
    """Runs every model in a process of its own (this script with ``--models <name>``) and
    merges their results: SEAL's memory pool never hands memory back, so a process that ran a
    large model's groups could not hold a later one's."""
    import subprocess
    import tempfile

    rest = list(sys.argv[1:] if argv is None else argv)
    # the arguments but --models and --output, which each child gets its own of
    keep: list[str] = []
    skip = False
    for a in rest:
        if skip:
            skip = False
            continue
        if a in ("--models", "--output", "--final-map"):
            skip = True
            continue
        if a.startswith(("--models=", "--output=", "--final-map=")) or \
                a == "--final-map-baseline":
            continue
        keep.append(a)
    keep += ["--final-map", args.final_map]
    result: dict = {"benchmark": "he_batch_family", "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "tenseal": ts.__version__,
        "load_average_at_start": os.getloadavg()}, "models": {},
        "method": "each model in a process of its own"}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = os.path.join(tmp, f"{name}.json")
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *keep,
                                   "--models", name, "--output", out])
            if done.returncode != 0 or not os.path.exists(out):
                result["models"][name] = {"skipped": f"its process ended with status "
                                                     f"{done.returncode}"}
                print(f"{name:12s} its process ended with status {done.returncode}", flush=True)
                continue
            with open(out) as f:
                child = json.load(f)
            result["data"] = child.get("data")
            result["models"].update(child["models"])
            row = result["models"][name]
            if args.final_map_baseline and row.get("client_map") and "server_s" in row:
                _final_map_baseline(name, row, keep, tmp)
            atomic_write_bytes(args.output, json.dumps(result, indent=1).encode())
    return _finish(result, args.output)


def _final_map_baseline(name: str, row: dict, keep: list[str], tmp: str) -> None:
    """The same model compiled with the last map on the server, in a process of its own right
    after: its images/s on the server's threads and end to end (the client's encryption and
    decryption of a group included) against the client map's, into ``row``."""
    import subprocess

    out = os.path.join(tmp, f"{name}_server_map.json")
    args = list(keep)
    args[args.index("--final-map") + 1] = "server"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args,
                           "--models", name, "--output", out])
    if done.returncode != 0 or not os.path.exists(out):
        row["server_map_skipped"] = f"its process ended with status {done.returncode}"
        return
    with open(out) as f:
        base = json.load(f)["models"][name]
    if "server_s" not in base:
        row["server_map_skipped"] = base.get("skipped", "not run")
        return

    def end_to_end(r: dict) -> float:
        return r["slots"] / (r["client_encrypt_s"] + r["server_s"] + r["client_decrypt_s"])

    row["server_map"] = {k: base[k] for k in (
        "ring", "levels", "slots", "server_s", "images_per_s", "predicted_group_s",
        "client_encrypt_s", "client_decrypt_s", "download_bytes", "prediction_error",
        "within_promise")}
    row.update({"client_map_server_speedup": row["images_per_s"] / base["images_per_s"],
                "end_to_end_images_per_s": end_to_end(row),
                "server_map_end_to_end_images_per_s": end_to_end(base),
                "client_map_end_to_end_speedup": end_to_end(row) / end_to_end(base)})
    print(f"{'':12s} the last map on the server: N={base['ring']} {base['levels']} levels, "
          f"{base['images_per_s']:.0f} img/s on the server, {end_to_end(base):.0f} end to end "
          f"-> the client's map {row['client_map_server_speedup']:.2f}x on the server, "
          f"{row['client_map_end_to_end_speedup']:.2f}x end to end ({end_to_end(row):.0f} "
          f"img/s; download {row['download_bytes'] / 2 ** 20:.0f} MiB per group against "
          f"{base['download_bytes'] / 2 ** 20:.0f})", flush=True)


def _finish(result: dict, output: str) -> dict:
    """The summary, the load average at the end, and the file written."""
    _summarise(result)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    atomic_write_bytes(output, json.dumps(result, indent=1).encode())
    print(f"wrote {output}")
    return result


def _summarise(result: dict) -> None:
    ran = [r for r in result["models"].values() if "speedup" in r]
    if ran:
        result["summary"] = {
            "models_run": len(ran),
            "speedup_min": min(r["speedup"] for r in ran),
            "speedup_median": statistics.median(r["speedup"] for r in ran),
            "speedup_max": max(r["speedup"] for r in ran),
            "prediction_error_range": [min(r["prediction_error"] for r in ran),
                                       max(r["prediction_error"] for r in ran)],
            "prediction_error_unscaled_range": [
                min(r.get("prediction_error_unscaled", r["prediction_error"]) for r in ran),
                max(r.get("prediction_error_unscaled", r["prediction_error"]) for r in ran)],
            "all_within_promise": all(r["within_promise"] for r in ran),
            "client_map_end_to_end_speedups": {
                k: r["client_map_end_to_end_speedup"] for k, r in result["models"].items()
                if "client_map_end_to_end_speedup" in r}}
        print(json.dumps(result["summary"], indent=1))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--train-images", type=int, default=6000)
    ap.add_argument("--budget", type=float, default=90.0,
                    help="skip models whose predicted group takes longer (seconds)")
    ap.add_argument("--packing", choices=("batch", "tokens"), default="batch",
                    help="batch (one image per slot) or tokens (one ciphertext per channel, the "
                         "tokens of a group of images in its slots)")
    ap.add_argument("--numpy", action="store_true",
                    help="also time the fused maps' NumPy loops (one thread)")
    ap.add_argument("--output", default=str(HERE / "results" / "he_batch_family.json"))
    ap.add_argument("--tiled", type=float, default=None, metavar="FRACTION",
                    help="also time a server whose memory budget is FRACTION of the group's "
                         "working memory whole, so that it runs in tiles (he.tiling): its time "
                         "against the whole group's and the memory it allocates")
    ap.add_argument("--spilled", action="store_true",
                    help="also time a server in the most tiles (memory just above what they "
                         "allocate) and one under a budget they do not fit, which spills the "
                         "rows its tiles hold for later tiles to disk (he.tiling.spills): its "
                         "time and memory against the first's")
    ap.add_argument("--shared", action="store_true",
                    help="where the program composed the thin values several maps read into "
                         "each of them (polynets.ir.lowering.Lowered.shared), also time it "
                         "compiled with them kept as steps of their own "
                         "(he.compiler.shared_values_as_steps): the baseline of composing them")
    ap.add_argument("--final-map", choices=he.compiler.FINAL_MAPS, default="auto",
                    help="who applies the program's last map (he.compile's final_map)")
    ap.add_argument("--final-map-baseline", action="store_true",
                    help="where the compiler gives the last map to the client, the same model "
                         "compiled with final_map='server' in a process of its own right after "
                         "(its own keys and request): images/s against it, the client's "
                         "encryption and decryption of a group included")
    ap.add_argument("--in-process", action="store_true",
                    help="run every model in this process (default: each in a process of its "
                         "own, since SEAL's memory pool keeps what a model's groups allocated)")
    args = ap.parse_args(argv)
    names = chosen_models(args.models)
    if (len(names) > 1 or args.final_map_baseline) and not args.in_process:
        return _each_in_a_process(args, names, argv)
    torch.set_num_threads(2)
    xtr, ytr, xte, _ = load_mnist(args.data_dir)
    xtr, ytr = xtr[:args.train_images], ytr[:args.train_images]
    result: dict = {
        "benchmark": "he_batch_family", "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "tenseal": ts.__version__,
            "load_average_at_start": os.getloadavg()},
        "data": {"train": len(xtr), "epochs": args.epochs},
        "cost_model": he.costmodel.default_model().source, "models": {}}
    for name in names:
        torch.manual_seed(0)
        model = train(MODELS[name](), xtr, ytr, args.epochs, augment=False, lr=2e-3)
        t0 = time.perf_counter()
        try:
            prog = he.compile(model, xte[:1], calibration=xtr[:2048], packing=args.packing,
                              final_map=args.final_map)
        except he.NotEncryptableError as exc:   # no token structure, for tokens packing
            result["models"][name] = {"skipped": str(exc)}
            print(f"{name:12s} {exc}", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        pred = prog.plan.predicted["seconds_per_ciphertext"]
        slots = prog.samples_per_ciphertext
        # the same prediction from the table as shipped, before the probe of this machine
        # scaled it (he.costmodel.probe_speed; 1 where a table measured here is cached)
        speed = he.costmodel.default_model().speed
        row: dict = {"packing": prog.packing, "ring": prog.params.poly_modulus_degree,
                     "cost_model_speed": speed, "predicted_unscaled_group_s": pred / speed,
                     "levels": prog.params.levels,
                     "predicted_server_memory_mib":
                     prog.plan.predicted["server_memory_bytes"] / 2 ** 20,
                     "slots": slots, "compile_s": compile_s, "predicted_group_s": pred,
                     "counts": prog.plan.predicted["counts"],
                     "client_map": bool(prog.options.get("client_map")),
                     "predicted_download_bytes": prog.plan.predicted["download_bytes"]}
        if pred > args.budget:
            row["skipped"] = f"predicted {pred:.0f} s per group > --budget {args.budget:.0f} s"
            result["models"][name] = row
            print(f"{name:12s} {row['skipped']}", flush=True)
            continue
        client = he.Client(prog)
        ctx = client.public_context()
        servers = {"threads": he.Server(prog, ctx), "one_thread": he.Server(prog, ctx, threads=1)}
        threads = servers["threads"].engine.pool.threads
        row.update({"server_threads": threads, "threads_why": prog.options.get("threads_why"),
                    "threads_note": servers["threads"].threads_note,
                    "predicted_one_thread_s": _one_thread_prediction(prog)})
        images = xte[torch.arange(slots) % len(xte)]
        t0 = time.perf_counter()
        request = client.encrypt(images).to_bytes()
        row["client_encrypt_s"] = time.perf_counter() - t0
        if args.tiled is not None and prog.packing == "batch":
            whole = servers["threads"]._group_memory(servers["threads"]._free_memory(),
                                                     keep=False).working
            servers["tiled"] = he.Server(prog, ctx, memory_budget=int(args.tiled * whole))
            tiled_mem = servers["tiled"]._group_memory(servers["tiled"]._free_memory(),
                                                       keep=False)
            row.update({"whole_working_mib": whole / 2 ** 20,
                        "tiled_budget_mib": args.tiled * whole / 2 ** 20,
                        "tiled_working_mib": tiled_mem.working / 2 ** 20,
                        "tiled_tiles": tiled_mem.tiles,
                        "tiled_lazy_products": list(tiled_mem.lazy),
                        "tiled_predicted_s": _batch_prediction(prog, prog.server_threads,
                                                                args.tiled * whole),
                        "tiled_warm_mib": servers["tiled"].warm_bytes / 2 ** 20})
        if args.spilled and prog.packing == "batch":
            servers.update(_spill_servers(prog, ctx, row))
        requests = {}
        shared = composed_shared(prog)
        if args.shared and prog.packing == "batch" and shared:
            with shared_values_as_steps():
                kept = he.compile(model, xte[:1], calibration=xtr[:2048], packing="batch")
            kclient = he.Client(kept)
            servers["kept"] = he.Server(kept, kclient.public_context())
            requests["kept"] = kclient.encrypt(images).to_bytes()
            row.update({"shared_composed": list(shared), "kept_levels": kept.params.levels,
                        "kept_predicted_s": kept.plan.predicted["seconds_per_ciphertext"]})
        variants = [v for v in VARIANTS if v in ("threads", "one_thread")
                    or (v == "numpy" and args.numpy)
                    or (v == "eager" and prog.options.get("lazy_products"))
                    or (v in ("tiled", "in_tiles", "spilled", "kept") and v in servers)
                    or (v == "tiled_eager" and row.get("tiled_lazy_products"))]
        times: dict[str, list[float]] = {v: [] for v in variants}
        # the machine's speed right before the passes, read by the probe's rule and the one
        # it replaced from the same rounds (benchmarks/he_probe.py)
        table = he.costmodel.shipped_model()
        rounds = he.costmodel.probe_rounds(table)
        row["probe_factors"] = {rule: he.costmodel.speed_factor(table, rounds, stat)[0]
                                for rule, stat in RULES.items()}
        try:
            # in turns
            for _ in range(2):
                for variant in variants:
                    times[variant].append(_server_pass(servers, requests.get(variant, request),
                                                       variant))
        except he.ResourceError as exc:          # the group does not fit the memory free now
            row["skipped"] = str(exc)
            result["models"][name] = row
            print(f"{name:12s} {exc}", flush=True)
            continue
        result_bytes = servers["threads"].run(request).to_bytes()
        t0 = time.perf_counter()
        got = client.decrypt(result_bytes)
        row.update({"client_decrypt_s": time.perf_counter() - t0,
                    "download_bytes": len(result_bytes)})
        want = prog.simulate(images[:64].numpy())
        err = float(np.max(np.abs(got[:64] - want)))
        fast, one = min(times["threads"]), min(times["one_thread"])
        row.update({"server_s": fast, "server_s_one_thread": one, "passes": times,
                    "speedup": one / fast,
                    "images_per_s": slots / fast, "images_per_s_one_thread": slots / one,
                    "prediction_error": pred / fast - 1,
                    # the first request of a server that prepared it as it started
                    "prediction_error_first": pred / times["threads"][0] - 1,
                    "server_warm_s": servers["threads"].warm_seconds,
                    "prediction_error_unscaled": pred / speed / fast - 1,
                    "prediction_error_by_rule": {
                        rule: pred / speed * f / fast - 1
                        for rule, f in row["probe_factors"].items()},
                    "prediction_error_one_thread": row["predicted_one_thread_s"] / one - 1,
                    "max_abs_error_vs_simulation": err,
                    "promised_error": prog.params.expected_error,
                    "within_promise": err <= prog.params.expected_error,
                    # the whole process's peak (training, compiling, keys, both servers)
                    "process_peak_rss_mib": resource.getrusage(
                        resource.RUSAGE_SELF).ru_maxrss / 1024})
        numpy_note = ""
        if "kept" in times:
            kept_s = min(times["kept"])
            row.update({"server_s_kept": kept_s, "shared_composed_speedup": kept_s / fast,
                        "kept_prediction_error": row["kept_predicted_s"] / kept_s - 1})
            numpy_note += (f", shared values {row['shared_composed']} kept as steps "
                           f"{kept_s:.1f} s (predicted {row['kept_predicted_s']:.1f} s) -> "
                           f"composing them {row['shared_composed_speedup']:.2f}x")
        if "tiled" in times:
            tiled_s = min(times["tiled"])
            tiled_got = client.decrypt(servers["tiled"].run(request).to_bytes())
            row.update({"server_s_tiled": tiled_s, "tiled_time_ratio": tiled_s / fast,
                        "tiled_prediction_error": row["tiled_predicted_s"] / tiled_s - 1,
                        "tiled_prediction_error_first":
                        row["tiled_predicted_s"] / times["tiled"][0] - 1,
                        "tiled_memory_ratio": row["tiled_working_mib"] / row["whole_working_mib"],
                        "tiled_max_abs_error_vs_simulation": float(np.max(np.abs(
                            tiled_got[:64] - want)))})
            numpy_note += (f", in tiles {row['tiled_tiles']} {tiled_s:.1f} s "
                           f"({row['tiled_time_ratio']:.2f}x the time, "
                           f"{row['tiled_memory_ratio']:.2f}x the memory)")
            if "tiled_eager" in times:
                tiled_eager_s = min(times["tiled_eager"])
                row.update({"server_s_tiled_eager_products": tiled_eager_s,
                            "tiled_speedup_vs_eager_products": tiled_eager_s / tiled_s})
                numpy_note += (f", lazy products {row['tiled_lazy_products']} in them against "
                               f"every product finished {tiled_eager_s:.1f} s -> "
                               f"{row['tiled_speedup_vs_eager_products']:.2f}x")
        if "spilled" in times:
            in_tiles_s, spilled_s = min(times["in_tiles"]), min(times["spilled"])
            spilled_got = client.decrypt(servers["spilled"].run(request).to_bytes())
            row.update({"server_s_in_tiles": in_tiles_s, "server_s_spilled": spilled_s,
                        # per request (timed ones and the one decrypted)
                        "spilled_rows": servers["spilled"].spilled // (len(times["spilled"]) + 1),
                        "spilled_time_ratio": spilled_s / in_tiles_s,
                        "spilled_memory_ratio": row["spilled_working_mib"] /
                        row["in_tiles_working_mib"],
                        "spilled_prediction_error": row["spilled_predicted_s"] / spilled_s - 1,
                        "spilled_max_abs_error_vs_simulation": float(np.max(np.abs(
                            spilled_got[:64] - want)))})
            numpy_note += (f", in {row['in_tiles_tiles']} tiles {in_tiles_s:.1f} s and "
                           f"{row['in_tiles_working_mib']:.0f} MiB, spilling in "
                           f"{row['spilled_tiles']} {spilled_s:.1f} s "
                           f"({row['spilled_time_ratio']:.2f}x the time, "
                           f"{row['spilled_memory_ratio']:.2f}x the memory, "
                           f"{row['spilled_rows']} rows out and back)")
        if "eager" in times:
            eager_s = min(times["eager"])
            row.update({"lazy_products": prog.options["lazy_products"],
                        "server_s_eager_products": eager_s,
                        "speedup_vs_eager_products": eager_s / fast})
            numpy_note += (f", every product finished {eager_s:.1f} s -> "
                           f"{row['speedup_vs_eager_products']:.2f}x")
        if "numpy" in times:
            numpy_s = min(times["numpy"])
            row.update({"server_s_numpy": numpy_s, "speedup_vs_numpy": numpy_s / fast})
            numpy_note += f", NumPy loops {numpy_s:.1f} s -> {row['speedup_vs_numpy']:.2f}x"
        result["models"][name] = row
        print(f"{name:12s} N={row['ring']} {row['levels']} levels: {threads} threads "
              f"{fast:.1f} s ({slots / fast:.0f} img/s), one thread {one:.1f} s "
              f"({slots / one:.0f} img/s) -> {row['speedup']:.2f}x{numpy_note}; predicted "
              f"{pred:.1f} s ({row['prediction_error']:+.0%}; first request "
              f"{row['prediction_error_first']:+.0%}), one thread "
              f"{row['predicted_one_thread_s']:.1f} s "
              f"({row['prediction_error_one_thread']:+.0%}); error {err:.1e} <= "
              f"{row['promised_error']:.1e}: {row['within_promise']}", flush=True)
        atomic_write_bytes(args.output, json.dumps(result, indent=1).encode())
    return _finish(result, args.output)


if __name__ == "__main__":
    main()
