"""Saving and loading polynomial programs: safetensors (format 2) against ``.npz`` (format 1).

A program is traced from a real model (default: timm's ``monet_t`` at 224 x 224, its folded
weights and the gathers of every layout op), then, several times each, in this process:

* ``save``: :meth:`PolyProgram.to_bytes` + an atomic write of the file (format 2, safetensors);
* ``load``: reading the file + :meth:`PolyProgram.from_bytes` (header, byte ranges and digest
  checked, every node's shapes validated);
* the baseline, measured in the same run on the same arrays and header: format 1, the
  ``numpy.savez_compressed`` archive earlier versions wrote, and its checked reader.

Prints and writes JSON (medians, sizes and the ratios baseline / safetensors).

    python benchmarks/program_io.py [--model monet_t] [--img-size 224] [--runs 3]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import polynets as pn  # noqa: E402
from polynets._io import atomic_write_bytes, read_bytes_limited, read_safetensors  # noqa: E402
from polynets.errors import ProgramFormatError  # noqa: E402
from polynets.ir.program import MAX_ARRAY_BYTES, PolyProgram  # noqa: E402


def npz_bytes(program: PolyProgram) -> bytes:
    """The program as format 1 wrote it: the same arrays and header in ``savez_compressed``."""
    meta, arrays = read_safetensors(program.to_bytes(), "program", MAX_ARRAY_BYTES)
    header = json.loads(meta["polynets-program"])
    header["version"] = 1
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="monet_t", help="a timm model name (polynets registers "
                                                       "monet_*, padre_vit_*)")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                         "program_io.json"))
    args = ap.parse_args(argv)

    import timm
    import torch

    torch.manual_seed(0)
    model = timm.create_model(args.model, img_size=args.img_size).eval()
    t0 = time.perf_counter()
    program = pn.trace(model, torch.randn(1, 3, args.img_size, args.img_size))
    trace_s = time.perf_counter() - t0
    arrays = sum(v.nbytes for n in program.nodes for v in n.attrs.values()
                 if isinstance(v, np.ndarray))
    with tempfile.TemporaryDirectory() as tmp:
        new_path, old_path = Path(tmp) / "p.safetensors", Path(tmp) / "p.npz"

        def save_new() -> None:
            atomic_write_bytes(new_path, program.to_bytes())

        def save_old() -> None:
            atomic_write_bytes(old_path, npz_bytes(program))

        def load(path: Path) -> PolyProgram:
            return PolyProgram.from_bytes(read_bytes_limited(path, "program",
                                                             ProgramFormatError))

        res = {"model": args.model, "img_size": args.img_size, "nodes": len(program.nodes),
               "array_bytes": arrays, "trace_s": trace_s,
               "safetensors": {"save_s": _median(save_new, args.runs)},
               "npz_baseline": {"save_s": _median(save_old, args.runs)}}
        # the baseline's save includes writing format 2 first (npz_bytes reads it back): time
        # that part alone and leave it out
        res["npz_baseline"]["save_s"] -= _median(program.to_bytes, args.runs)
        res["safetensors"]["file_bytes"] = new_path.stat().st_size
        res["npz_baseline"]["file_bytes"] = old_path.stat().st_size
        res["safetensors"]["load_s"] = _median(lambda: load(new_path), args.runs)
        res["npz_baseline"]["load_s"] = _median(lambda: load(old_path), args.runs)
        x = np.random.default_rng(0).standard_normal((1, 3, args.img_size, args.img_size))
        res["same_outputs"] = bool(np.array_equal(load(new_path).run(x), load(old_path).run(x)))
    res["save_speedup"] = res["npz_baseline"]["save_s"] / res["safetensors"]["save_s"]
    res["load_speedup"] = res["npz_baseline"]["load_s"] / res["safetensors"]["load_s"]
    res["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    print(f"{args.model} at {args.img_size}: {len(program.nodes)} nodes, "
          f"{arrays / 2 ** 20:.0f} MiB of arrays (traced in {trace_s:.1f} s)")
    for name in ("safetensors", "npz_baseline"):
        r = res[name]
        print(f"  {name:13s} save {r['save_s']:.2f} s, load {r['load_s']:.2f} s, file "
              f"{r['file_bytes'] / 2 ** 20:.0f} MiB")
    print(f"  save {res['save_speedup']:.1f}x, load {res['load_speedup']:.1f}x faster; same "
          f"outputs: {res['same_outputs']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
