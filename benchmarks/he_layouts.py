"""Vector-packing layouts on a family of MONets and token models: the full layout search against
the padded-only search (every inner axis padded to a power of two, the search space before
unpadded layouts and odd-stride BSGS units), both priced by the same cost model in the same run.

For each model (random weights, BatchNorm statistics from the calibration images, so nothing
here depends on training): the compiler's predicted server seconds per image, rotations,
plaintext multiplications and server memory under both searches. With ``--run NAME`` the named
models are also encrypted and run (one image, full search), the measured server time next to
the prediction and to TenSEAL's tutorial recipe (the baseline of ``he_inference.py``) timed in
the same process.

    python benchmarks/he_layouts.py [--run monet2_d48] [--output results/he_layouts.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import numpy as np
import torch
from torch import nn

import he
import he.plan
import polynets as pn
from polynets.ir.program import atomic_write_bytes

HERE = Path(__file__).resolve().parent


def _token_net(depth: int, dim: int, patch: int) -> nn.Module:
    from he_inference import TokenNet

    return TokenNet(depth=depth, dim=dim, patch=patch)


def _monet(**kw: Any) -> nn.Module:
    return pn.MONet(img_size=28, in_chans=1, num_classes=10, norm="batch", **kw)


#: name -> constructor; channel counts and token grids the benchmark's own models do not use
MODELS: dict[str, Callable[[], nn.Module]] = {
    "token1_d16": lambda: _token_net(1, 16, 4),
    "token2_d64": lambda: _token_net(2, 64, 4),
    "token1_p7": lambda: _token_net(1, 32, 7),
    "token3_d32": lambda: _token_net(3, 32, 4),
    "monet1_d32": lambda: _monet(patch_size=4, embed_dim=32, depth=1, merges=0),
    "monet2_d16": lambda: _monet(patch_size=2, embed_dim=16, depth=2, merges=1),
    "monet2_d32": lambda: _monet(patch_size=2, embed_dim=32, depth=2, merges=1),
    "monet2_d48": lambda: _monet(patch_size=4, embed_dim=48, depth=2, merges=0),
    "monet2_d40": lambda: _monet(patch_size=4, embed_dim=40, depth=2, merges=0),
}


def _padded_only(shape: Any, max_axes: int = 3) -> list:
    return [o for o in _FULL(shape, max_axes) if o is None or o[0] >= 0]


_FULL = he.plan.candidate_orders
_STEPS = he.plan._step_candidates


def _compile(model: nn.Module, x: torch.Tensor, padded_only: bool) -> tuple[Any, float]:
    t0 = time.perf_counter()
    if padded_only:
        with mock.patch.object(he.plan, "candidate_orders", _padded_only), \
                mock.patch.object(he.plan, "_step_candidates",
                                  lambda keys, period: _STEPS(keys, period)[:1]):
            prog = he.compile(model, x[:1], calibration=x, packing="vector", precision_bits=8)
    else:
        prog = he.compile(model, x[:1], calibration=x, packing="vector", precision_bits=8)
    return prog, time.perf_counter() - t0


def _summary(prog: Any, seconds: float) -> dict:
    p = prog.plan.predicted
    return {"ring": prog.params.poly_modulus_degree, "levels": prog.params.levels,
            "predicted_server_s": p["seconds_per_ciphertext"],
            "predicted_memory_gib": p["server_memory_bytes"] / 2 ** 30,
            "rotations": p["counts"]["rotate"], "plain_mults": p["counts"]["mul_plain"],
            "unpadded_values": sum(o is not None and o[0] < 0 for o in prog.plan.orders),
            "galois_keys": len(prog.plan.galois_steps()),
            "key_basis": prog.plan.key_steps is not None, "wide_chain": prog.params.pending >= 0,
            "compile_s": seconds}


def _run_encrypted(prog: Any, x: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    setup = time.perf_counter() - t0
    ct = client.encrypt(x[:1]).to_bytes()
    t0 = time.perf_counter()
    out = server.run(ct).to_bytes()
    server_s = time.perf_counter() - t0
    err = float(np.max(np.abs(client.decrypt(out) - prog.simulate(x[:1].numpy()))))
    return {"server_s": server_s, "keys_and_server_s": setup,
            "prediction_error": prog.plan.predicted["seconds_per_ciphertext"] / server_s - 1,
            "max_abs_error_vs_simulation": err, "promised_error": prog.params.expected_error,
            "within_promise": err <= prog.params.expected_error}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--run", default="", help="models also encrypted and run (one image)")
    ap.add_argument("--output", default=str(HERE / "results" / "he_layouts.json"))
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names + [n for n in args.run.split(",") if n] if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28)
    rows: dict[str, dict] = {}
    for name in names:
        model = MODELS[name]()
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(x)
        model.eval()
        base, base_s = _compile(model, x, padded_only=True)
        full, full_s = _compile(model, x, padded_only=False)
        row = {"padded_only": _summary(base, base_s), "full_search": _summary(full, full_s)}
        row["predicted_speedup"] = (row["padded_only"]["predicted_server_s"] /
                                    row["full_search"]["predicted_server_s"])
        if name in args.run.split(","):
            row["full_search"]["measured"] = _run_encrypted(full, x)
        rows[name] = row
        print(f"{name:12s} padded-only {row['padded_only']['predicted_server_s']:7.3f} s "
              f"({row['padded_only']['rotations']} rot, {row['padded_only']['plain_mults']} pmul, "
              f"{row['padded_only']['predicted_memory_gib']:.1f} GiB)  full "
              f"{row['full_search']['predicted_server_s']:7.3f} s "
              f"({row['full_search']['rotations']} rot, {row['full_search']['plain_mults']} "
              f"pmul, {row['full_search']['predicted_memory_gib']:.1f} GiB)  "
              f"x{row['predicted_speedup']:.2f}", flush=True)
        if "measured" in row["full_search"]:
            m = row["full_search"]["measured"]
            print(f"{'':12s} measured server {m['server_s']:.2f} s (prediction "
                  f"{m['prediction_error']:+.0%}), error {m['max_abs_error_vs_simulation']:.2e} "
                  f"<= {m['promised_error']:.2e}: {m['within_promise']}", flush=True)
    result: dict[str, Any] = {"benchmark": "he_layouts", "machine": {
        "platform": platform.platform(), "python": platform.python_version()},
        "baseline": "padded-only layout search (the previous search space), same cost model",
        "models": rows}
    if args.run:
        from he_inference import TutorialConvNet, baseline

        tut = TutorialConvNet().eval()
        result["baseline_tenseal_tutorial_median_s"] = baseline(tut, x, 3)["median_s"]
        print(f"TenSEAL tutorial recipe (same run): "
              f"{result['baseline_tenseal_tutorial_median_s']:.2f} s per image")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    return result


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE))
    main()
