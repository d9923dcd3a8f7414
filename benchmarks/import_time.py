"""Start-up cost of the packages: ``import he``, ``import polynets`` and friends in fresh processes.

Each statement runs in a new interpreter (``python -c``), several times; the script records the
median, minimum and maximum of two times, and which heavy libraries the statement loaded
(``torch``, ``timm``, ``tenseal``, ``sympy`` in ``sys.modules`` afterwards):

* ``import_s``: the statement alone, timed inside the child with ``time.perf_counter``;
* ``process_s``: the whole child process, interpreter start-up included, timed by the parent.

Baseline measured in the same run: ``import torch`` (what every import of the packages cost while
they loaded torch eagerly), and ``pass`` (the interpreter's own start-up); ``ratio_to_torch`` is
``import_s / import_s(torch)``. The target is ``import he`` under 1 s without torch: a process
that only serves ciphertexts should start fast.

    python benchmarks/import_time.py [--runs 7] [--out benchmarks/results/import_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "timm", "tenseal", "sympy")
STATEMENTS = {
    "pass": "pass",
    "import torch": "import torch",
    "import he": "import he",
    "import polynets": "import polynets",
    "import symbolic": "import symbolic",
    "he.Server (attribute)": "import he; he.Server; he.Ciphertext",
    "polynets.MuLayer (attribute)": "import polynets; polynets.MuLayer",
}
TARGET_S = 1.0
ROOT = Path(__file__).resolve().parent.parent

_CHILD = """\
import sys, time, json
t0 = time.perf_counter()
{statement}
elapsed = time.perf_counter() - t0
print(json.dumps({{"import_s": elapsed, "loaded": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def measure(statement: str, runs: int) -> dict:
    """Run ``statement`` in ``runs`` fresh interpreters; medians and ranges of both times."""
    inner, outer, loaded = [], [], set()
    code = _CHILD.format(statement=statement, heavy=HEAVY)
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              check=False)
        outer.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise RuntimeError(f"{statement!r} failed:\n{done.stderr}")
        record = json.loads(done.stdout.strip().splitlines()[-1])
        inner.append(record["import_s"])
        loaded.update(record["loaded"])
    return {
        "statement": statement, "runs": runs,
        "import_s": {"median": statistics.median(inner), "min": min(inner), "max": max(inner)},
        "process_s": {"median": statistics.median(outer), "min": min(outer), "max": max(outer)},
        "loads": {name: name in loaded for name in HEAVY},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per statement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "import_time.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    results = {}
    for label, statement in STATEMENTS.items():
        results[label] = measure(statement, args.runs)
        r = results[label]
        heavy = ", ".join(name for name, on in r["loads"].items() if on) or "none"
        print(f"{label:30s} import {r['import_s']['median']:7.3f} s   process "
              f"{r['process_s']['median']:7.3f} s   loads: {heavy}", flush=True)
    torch_s = results["import torch"]["import_s"]["median"]
    for r in results.values():
        r["ratio_to_torch"] = r["import_s"]["median"] / torch_s
    he = results["import he"]
    verdict = {"target_s": TARGET_S, "import_he_s": he["import_s"]["median"],
               "torch_loaded": he["loads"]["torch"],
               "met": he["import_s"]["median"] < TARGET_S and not he["loads"]["torch"]}
    print(f"import he: {verdict['import_he_s']:.3f} s ({he['ratio_to_torch']:.2f} x import torch), "
          f"torch loaded: {verdict['torch_loaded']}; target < {TARGET_S} s without torch: "
          f"{'met' if verdict['met'] else 'NOT met'}")
    report = {
        "benchmark": "import_time",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor()},
        "baseline": "import torch",
        "results": results,
        "target": verdict,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
