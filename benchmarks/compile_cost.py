"""What ``he.compile`` costs: seconds and peak memory per model, against another revision.

Each model is compiled in a fresh process (vector packing, the defaults but ``precision_bits``),
so that its peak resident memory is its own; the models are untrained, with BatchNorm statistics
from random images (the compile cost does not depend on training). The same models are then
compiled by the baseline, ``--baseline PATH``: a checkout of another revision of this repository
(``git worktree add /tmp/base REV``), whose ``polynets`` and ``he`` packages the child process
imports instead of these. The two alternate model by model, so a slow spell of the machine hits
both. The family: MONets of 1 to 8 Poly-Blocks (the first too deep for any ring is refused; 8
blocks is 16 products in a row, more than N=32768 holds at 16 bits but not more than its chain
holds at its smallest scale), timm's ``monet_t`` on 28x28 inputs (64 products in a row, more
than any chain holds), token models of 1 and 2 Mu-Layers, and the 2-Mu-Layer PoM and PADRe
token models of ``he_family.py``.

    python benchmarks/compile_cost.py [--baseline /tmp/base] [--models monet2,monet_t]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: name -> (constructor expression evaluated in the child, input side)
MODELS: dict[str, str] = {
    **{f"monet{d}": f"pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=2, "
                    f"embed_dim=32, depth={d}, merges=1, norm='batch', init='trunc_normal')"
       for d in (1, 2, 4, 8)},
    "monet_t": "timm.create_model('monet_t', img_size=28, in_chans=1, num_classes=10)",
    "token1": "TokenNet(depth=1)",
    "token2": "TokenNet(depth=2)",
    "pom": "MODELS['pom']()",
    "padre": "MODELS['padre']()",
}

CHILD = r"""
import json, resource, sys, time
import torch
sys.path.insert(0, {bench!r})
import timm
import he
import polynets as pn
from he_inference import TokenNet
from he_family import MODELS
torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.rand(64, 1, 28, 28)
model = {expr}
model.train()
with torch.no_grad():
    for _ in range(2):
        model(x)
model.eval()
t0 = time.perf_counter()
row = {{}}
try:
    prog = he.compile(model, x[:1], calibration=x, packing="vector",
                      precision_bits={bits})
    row.update(result=f"{{prog.params.levels}} levels, N={{prog.params.poly_modulus_degree}}",
               levels=prog.params.levels, ring=prog.params.poly_modulus_degree)
except he.TooDeepError as exc:
    row.update(result="too deep", levels=exc.levels_needed)
row["compile_s"] = time.perf_counter() - t0
row["package"] = he.__file__
row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("ROW " + json.dumps(row))
"""


def measure(name: str, code: Path, bits: int, timeout: float) -> dict:
    """One compile of ``name`` in a fresh process importing the packages under ``code``."""
    env = dict(os.environ, PYTHONPATH=str(code))
    src = CHILD.format(bench=str(HERE), expr=MODELS[name], bits=bits)
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True,
                             text=True, timeout=timeout, cwd=str(code))
    except subprocess.TimeoutExpired:
        return {"result": f"timed out after {timeout:.0f} s", "compile_s": None}
    rows = [ln[4:] for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
    if out.returncode != 0 or not rows:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"result": "failed: " + " | ".join(tail), "compile_s": None,
                "process_s": time.perf_counter() - t0}
    row = json.loads(rows[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--baseline", default=None,
                    help="a checkout of another revision (its packages are imported instead)")
    ap.add_argument("--precision-bits", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per compile")
    ap.add_argument("--output", default=str(HERE / "results" / "compile_cost.json"))
    args = ap.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    base = Path(args.baseline).resolve() if args.baseline else None
    if base is not None and not (base / "he" / "compiler.py").is_file():
        raise SystemExit(f"--baseline {base} is not a checkout of this repository")
    rows = {}
    for name in names:
        row = {"this": measure(name, ROOT, args.precision_bits, args.timeout)}
        if base is not None:
            row["baseline"] = measure(name, base, args.precision_bits, args.timeout)
            a, b = row["this"].get("compile_s"), row["baseline"].get("compile_s")
            if a and b:
                row["speedup"] = b / a
        rows[name] = row
        line = f"{name:8s} {row['this']['result']:22s} {row['this'].get('compile_s') or 0:7.1f} s " \
               f"{row['this'].get('peak_rss_mib', 0):7.0f} MiB"
        if "baseline" in row:
            line += (f" | baseline {row['baseline']['result']:22s} "
                     f"{row['baseline'].get('compile_s') or 0:7.1f} s "
                     f"{row['baseline'].get('peak_rss_mib', 0):7.0f} MiB")
        print(line, flush=True)
    result = {"benchmark": "compile_cost",
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "precision_bits": args.precision_bits, "baseline": str(base) if base else None,
              "models": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
