"""Saving and loading polynomial programs: safetensors (format 2) against ``.npz`` (format 1).

Everything is measured in this process, several times each (medians), the baselines on the same
arrays and headers in the same run:

* a traced program of realistic size (default: timm's ``monet_t`` at 224 x 224, 308 MiB of folded
  weights and gathers: the array storage of a program that size):

  - ``save``: :meth:`PolyProgram.to_bytes` + an atomic write (format 2, safetensors); the
    baseline writes the same arrays and JSON header with ``numpy.savez_compressed``, as
    format 1's ``to_bytes`` did, + the same atomic write;
  - ``load``: reading the file + :meth:`PolyProgram.from_bytes` (header, byte ranges and digest
    checked, every node's shapes validated); the baseline reads the ``.npz`` through the same
    call (format 1 still loads: every member's ``.npy`` header checked, then inflated);
  - ``framed``: the same bytes inside the compiled-program container (BLAKE2b digests of header
    and blob written and checked), as a compiled program's file holds them;

* a compiled program (``he.compile`` of he_inference's ``monet2``, vector packing; untrained
  weights, which do not change the sizes): :meth:`CompiledProgram.save` / :func:`he.load_program`
  against the same container holding the program as format 1. Loading a compiled program also
  rebuilds its CKKS plan, which dominates at this size.

Prints and writes JSON (sizes, medians and the ratios baseline / safetensors).

    python benchmarks/program_io.py [--model monet_t] [--img-size 224] [--in-chans 3] [--runs 3]
                                    [--compiled monet2 | --compiled none]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import polynets as pn  # noqa: E402
from he.container import pack, unpack  # noqa: E402
from polynets._io import atomic_write_bytes, read_bytes_limited, read_safetensors  # noqa: E402
from polynets.errors import ProgramFormatError  # noqa: E402
from polynets.ir.program import MAX_ARRAY_BYTES, PolyProgram  # noqa: E402

_MAGIC = "polynets-program"


def format1_parts(program: PolyProgram) -> dict[str, np.ndarray]:
    """What format 1's ``to_bytes`` handed to ``savez_compressed``: the program's arrays (the
    same names and values format 2 stores) and its JSON header as a ``uint8`` array."""
    meta, arrays = read_safetensors(program.to_bytes(), "program", MAX_ARRAY_BYTES)
    header = json.loads(meta[_MAGIC])
    header["version"] = 1
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    return arrays


def npz_bytes(parts: dict[str, np.ndarray]) -> bytes:
    """Format 1's writer."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **parts)
    return buf.getvalue()


def _median(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _read(path: Path) -> bytes:
    return read_bytes_limited(path, "program", ProgramFormatError)


def _framed(blob: bytes) -> bytes:
    return pack("compiled-program", {"benchmark": True}, {"program": [blob]})


def _unframed(data: bytes) -> bytes:
    return unpack(data, "compiled-program", "program")[1]["program"][0]


def traced(args: argparse.Namespace, tmp: Path) -> dict:
    import timm
    import torch

    torch.manual_seed(0)
    shape = (1, args.in_chans, args.img_size, args.img_size)
    model = timm.create_model(args.model, img_size=args.img_size, in_chans=args.in_chans).eval()
    t0 = time.perf_counter()
    program = pn.trace(model, torch.randn(shape))
    trace_s = time.perf_counter() - t0
    arrays = sum(v.nbytes for n in program.nodes for v in n.attrs.values()
                 if isinstance(v, np.ndarray))
    parts = format1_parts(program)
    new, old = tmp / "p.safetensors", tmp / "p.npz"
    new_f, old_f = tmp / "pf.safetensors", tmp / "pf.npz"
    res: dict[str, Any] = {"model": args.model, "img_size": args.img_size,
                           "in_chans": args.in_chans, "nodes": len(program.nodes),
                           "array_bytes": arrays, "trace_s": trace_s}
    res["safetensors"] = {
        "save_s": _median(lambda: atomic_write_bytes(new, program.to_bytes()), args.runs),
        "file_bytes": new.stat().st_size,
        "load_s": _median(lambda: PolyProgram.from_bytes(_read(new)), args.runs),
        "framed_save_s": _median(lambda: atomic_write_bytes(new_f, _framed(program.to_bytes())),
                                 args.runs),
        "framed_load_s": _median(lambda: PolyProgram.from_bytes(_unframed(_read(new_f))),
                                 args.runs)}
    res["npz_baseline"] = {
        "save_s": _median(lambda: atomic_write_bytes(old, npz_bytes(parts)), args.runs),
        "file_bytes": old.stat().st_size,
        "load_s": _median(lambda: PolyProgram.from_bytes(_read(old)), args.runs),
        "framed_save_s": _median(lambda: atomic_write_bytes(old_f, _framed(npz_bytes(parts))),
                                 args.runs),
        "framed_load_s": _median(lambda: PolyProgram.from_bytes(_unframed(_read(old_f))),
                                 args.runs)}
    x = np.random.default_rng(0).standard_normal(shape)
    res["same_outputs"] = bool(np.array_equal(PolyProgram.from_bytes(_read(new)).run(x),
                                              PolyProgram.from_bytes(_read(old)).run(x)))
    _ratios(res)
    return res


def compiled(name: str, runs: int, tmp: Path) -> dict:
    import torch

    import he

    if name != "monet2":
        raise SystemExit(f"--compiled: monet2 or none, not {name!r}")
    torch.manual_seed(0)
    model = pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=2, embed_dim=32,
                     depth=2, merges=1, norm="batch", init="trunc_normal").eval()
    x = torch.rand(64, 1, 28, 28)
    t0 = time.perf_counter()
    prog = he.compile(model, x[:1], calibration=x, packing="vector")
    compile_s = time.perf_counter() - t0
    head, _ = unpack(prog.to_bytes(), "compiled-program", "compiled program")
    head = {k: v for k, v in head.items() if k not in ("kind", "blobs")}
    parts = format1_parts(prog.program)
    new, old = tmp / "c.he", tmp / "c1.he"

    def save_old() -> None:  # the same container, the program in format 1
        atomic_write_bytes(old, pack("compiled-program", head, {"program": [npz_bytes(parts)]}))

    res: dict[str, Any] = {"model": name, "packing": "vector", "compile_s": compile_s,
                           "array_bytes": sum(a.nbytes for k, a in parts.items()
                                              if k != "__header__")}
    res["safetensors"] = {"save_s": _median(lambda: prog.save(new), runs),
                          "file_bytes": new.stat().st_size,
                          "load_s": _median(lambda: he.load_program(new), runs)}
    res["npz_baseline"] = {"save_s": _median(save_old, runs), "file_bytes": old.stat().st_size,
                           "load_s": _median(lambda: he.load_program(old), runs)}
    res["same_fingerprint"] = he.load_program(old).fingerprint == prog.fingerprint == \
        he.load_program(new).fingerprint
    _ratios(res)
    return res


def _ratios(res: dict) -> None:
    new, old = res["safetensors"], res["npz_baseline"]
    for key in [k for k in new if k.endswith("_s")]:
        res[key[:-2] + "_speedup"] = old[key] / new[key]


def _show(title: str, res: dict) -> None:
    print(title)
    for name in ("safetensors", "npz_baseline"):
        r = res[name]
        times = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3g} s" for k, v in r.items()
                          if k.endswith("_s"))
        print(f"  {name:13s} {times}, file {r['file_bytes'] / 2 ** 20:.3g} MiB")
    print("  npz / safetensors: " + ", ".join(f"{k[:-8].replace('_', ' ')} {v:.2f}x"
                                              for k, v in res.items() if k.endswith("_speedup")))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="monet_t", help="a timm model name (polynets registers "
                                                       "monet_*, padre_vit_*)")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--in-chans", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compiled", default="monet2", help="a compiled program to time too "
                                                         "(monet2), or none")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                         "program_io.json"))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        res = traced(args, Path(tmp))
        _show(f"{args.model} at {args.img_size}: {res['nodes']} nodes, "
              f"{res['array_bytes'] / 2 ** 20:.0f} MiB of arrays (traced in "
              f"{res['trace_s']:.1f} s); same outputs: {res['same_outputs']}", res)
        if args.compiled != "none":
            res["compiled"] = compiled(args.compiled, args.runs, Path(tmp))
            c = res["compiled"]
            _show(f"compiled {c['model']} ({c['packing']} packing, compiled in "
                  f"{c['compile_s']:.1f} s, {c['array_bytes'] / 2 ** 20:.2g} MiB of arrays); "
                  f"same fingerprint: {c['same_fingerprint']}", c)
    res["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                      "numpy": np.__version__, "cpus": os.cpu_count(),
                      # other work on the machine slows both formats alike
                      "load_average_before_after": [round(load_before[0], 2),
                                                    round(os.getloadavg()[0], 2)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
