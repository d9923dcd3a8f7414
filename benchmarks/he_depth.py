"""How many Poly-Blocks fit under CKKS at 128-bit security, per ring degree, and the deepest run.

For MONets of 1, 2, ... Poly-Blocks (spatial shift, BatchNorm, pyramid embedding of 2x2 patches
with one merge: 7x7 tokens of width 32 on 28x28 inputs), ``he.compile`` reports the levels, the
ring it needs and the cost model's predicted time and server memory, until the program is too
deep for N=32768 (SEAL has no bootstrapping). The deepest model whose predicted footprint fits
a third of ``--memory-gib`` is then run encrypted (vector packing, one image; client and server
in one process hold the keys about three times: the client's, the public context's bytes, the
server's; compiled with that third as ``memory_budget``, so its rotations may come from a key
basis) and its decryption checked against the plaintext simulation. BatchNorm statistics come
from random images (the weights are not trained: this measures depth, not accuracy).

    python benchmarks/he_depth.py [--max-blocks 8] [--memory-gib 18]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import numpy as np
import torch

import he
import polynets as pn
from polynets.ir.program import atomic_write_bytes


def monet(depth: int, x: torch.Tensor) -> torch.nn.Module:
    torch.manual_seed(depth)
    model = pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=2, embed_dim=32,
                     depth=depth, merges=1, norm="batch", init="trunc_normal")
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    return model.eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-blocks", type=int, default=8)
    ap.add_argument("--memory-gib", type=float, default=18.0,
                    help="run the deepest model whose predicted server memory fits a third of "
                         "this (client and server in one process hold the keys about 3 times)")
    ap.add_argument("--precision-bits", type=int, default=8)
    ap.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" /
                                            "he_depth.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.rand(64, 1, 28, 28)
    rows, progs = [], {}
    for depth in range(1, args.max_blocks + 1):
        model = monet(depth, x)
        cert = pn.certify(model, x[:1])
        t0 = time.perf_counter()
        try:
            prog = he.compile(model, x[:1], calibration=x, packing="vector",
                              precision_bits=args.precision_bits)
        except he.TooDeepError as exc:
            rows.append({"blocks": depth, "levels": cert.levels, "fits": False,
                         "why": str(exc).split(";")[0]})
            print(f"{depth} blocks: {cert.levels} levels -- too deep ({exc.levels_supported} "
                  f"supported at N=32768)")
            break
        p = prog.plan.predicted
        row = {"blocks": depth, "levels": cert.levels, "fits": True,
               "ring": prog.params.poly_modulus_degree, "scale_bits": prog.params.scale_bits,
               "compile_s": time.perf_counter() - t0,
               "predicted_server_s": p["seconds_per_ciphertext"],
               "predicted_round_trip_s": p["round_trip_seconds"],
               "predicted_server_memory_gib": p["server_memory_bytes"] / 2 ** 30,
               "galois_keys": len(prog.plan.galois_steps()),
               "key_basis": prog.plan.key_steps is not None,
               "primes": prog.params.data_primes, "wide_chain": prog.params.pending >= 0,
               "params": str(prog.params)}
        rows.append(row)
        progs[depth] = (model, prog)
        print(f"{depth} blocks: {cert.levels} levels, N={row['ring']}, predicted "
              f"{row['predicted_round_trip_s']:.1f} s per image, server "
              f"{row['predicted_server_memory_gib']:.1f} GiB")
    res: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                 "cost_model": he.costmodel.default_model().source, "depths": rows}
    # client and server in one process hold the keys about three times at once (the client's,
    # the public-context bytes, the server's): the run gets a third of the memory as the
    # server's budget, over which the compiler composes rotations from a key basis
    share = int(args.memory_gib * 2 ** 30 / 3)
    fits = None
    for d in sorted(progs, reverse=True):
        prog = he.compile(progs[d][0], x[:1], calibration=x, packing="vector",
                          precision_bits=args.precision_bits, memory_budget=share)
        if prog.plan.predicted["server_memory_bytes"] <= share:
            fits = (d, prog)
            break
    if fits:
        depth, prog = fits
        model = progs[depth][0]
        t0 = time.perf_counter()
        client = he.Client(prog)
        server = he.Server(prog, client.public_context())
        keys_s = time.perf_counter() - t0
        ct = client.encrypt(x[:1])
        t0 = time.perf_counter()
        out = server.run(ct)
        server_s = time.perf_counter() - t0
        y = client.decrypt(out)
        err = float(np.max(np.abs(y - prog.simulate(x[:1]))))
        res["run"] = {"blocks": depth, "ring": prog.params.poly_modulus_degree,
                      "levels": prog.params.levels, "params": str(prog.params),
                      "galois_keys": len(prog.plan.galois_steps()),
                      "key_basis": prog.plan.key_steps is not None,
                      "memory_budget_gib": share / 2 ** 30, "keys_and_server_s": keys_s,
                      "server_s": server_s,
                      "predicted_server_s": prog.plan.predicted["seconds_per_ciphertext"],
                      "max_abs_error": err, "promised_error": prog.params.expected_error,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}
        r = res["run"]
        print(f"ran {depth} blocks at N={r['ring']} ({r['galois_keys']} Galois keys"
              f"{', a key basis' if r['key_basis'] else ''}): server {r['server_s']:.1f} s "
              f"(predicted "
              f"{r['predicted_server_s']:.1f} s), max error {err:.2e} (promised "
              f"{r['promised_error']:.2e}), peak RSS {r['peak_rss_gib']:.1f} GiB")
    atomic_write_bytes(args.output, json.dumps(res, indent=2).encode())
    print(f"wrote {args.output}")
    return res


if __name__ == "__main__":
    main()
