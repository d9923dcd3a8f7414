"""Block size of the hoisted rotations' compiled loops: each size timed on the same operands.

A vector server's hoisted baby steps multiply the decomposed input by each step's Galois key
(:meth:`he.hoist.Hoister.rotate_ext`) and sum their plaintext products per giant step
(:meth:`he.hoist.Hoister.product_sum`); both loops keep 128-bit sums of a block of words while
every digit's (or term's) words of the block pass. This script times both at several rings,
prime counts and terms per sum for each block size, alternating the sizes round by round on the
same operands, each round starting at another size (the sums are checked to be the same words
whatever the size), and reports each
size against 512 words (the size used before :data:`he.hoist.PRODUCT_BLOCK`) from the same run.

    python benchmarks/he_hoist_kernels.py [--blocks 512,1024,2048,4096,8192] [--quick]
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

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from he import hoist  # noqa: E402
from he.costmodel import _tools  # noqa: E402
from polynets.ir.program import atomic_write_bytes  # noqa: E402

BASELINE = 512
#: (ring, data primes): the limb counts of the benchmarks' vector programs, a few digits (the
#: register loop, which no block changes, for the rotations) and many (the blocked loop)
SHAPES = ((8192, 3), (8192, 5), (16384, 3), (16384, 6), (32768, 10))
TERMS = (4, 16, 31, 64)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(ring: int, primes: int, blocks: list[int], rounds: int, reps: int) -> dict:
    """Milliseconds per hoisted rotation and per extended product (in sums of each of
    :data:`TERMS` distinct terms) for each block size, the median over ``rounds`` rounds."""
    import tenseal.sealapi as seal

    steps = 8
    _, tools = _tools(ring, primes, steps)
    h = tools.hoister
    if h is None:
        raise SystemExit("no hoister on this machine (numba missing or hoisting disabled)")
    pt = seal.Plaintext()
    tools.encoder.encode(np.linspace(-1, 1, ring // 2).tolist(), 2.0 ** 20, pt)
    ct = seal.Ciphertext()
    tools.encryptor.encrypt(pt, ct)
    dec = h.decompose(ct)
    # as many distinct terms as the longest sum (copies of the rotations by the keys' steps:
    # a giant step's terms lie apart in memory)
    first = [h.rotate_ext(dec, s) for s in range(1, steps + 1)]
    exts = [hoist.Extended(e.source, e.words.copy()) for e in first * (max(TERMS) // steps)]
    rng = np.random.default_rng(0)
    plains = [h.extend_plain(tools.encoder, rng.uniform(-1, 1, ring // 2).tolist(), 2.0 ** 20,
                             primes) for _ in range(max(TERMS))]
    rot: dict[int, list[float]] = {b: [] for b in blocks}
    sums: dict[tuple[int, int], list[float]] = {(b, t): [] for b in blocks for t in TERMS}
    words: dict[int, np.ndarray] = {}
    for r in range(rounds):
        # each round starts at another size: none is always timed first, after the others
        for b in blocks[r % len(blocks):] + blocks[:r % len(blocks)]:
            h.block = b
            rot[b].append(_best(lambda: [h.rotate_ext(dec, s) for s in range(1, steps + 1)],
                                reps) / steps)
            for t in TERMS:
                terms = list(zip(plains[:t], exts[:t]))
                sums[b, t].append(_best(lambda: h.product_sum(terms), reps) / t)
            got = h.product_sum(list(zip(plains, exts))).words
            if words and not np.array_equal(got, next(iter(words.values()))):
                raise SystemExit(f"block {b} summed different words")
            words[b] = got
    h.block = hoist.PRODUCT_BLOCK
    row = {"ring": ring, "primes": primes, "digits": primes,
           "rotation_loop": "blocked" if primes > hoist._FEW_DIGITS else "registers",
           "rotate_ext_ms": {b: statistics.median(v) * 1e3 for b, v in rot.items()},
           "product_ms_per_term": {f"{b}/{t}": statistics.median(v) * 1e3
                                   for (b, t), v in sums.items()}}
    base = row["rotate_ext_ms"][BASELINE]
    row["rotate_ext_speedup_vs_512"] = {b: base / v for b, v in row["rotate_ext_ms"].items()}
    row["product_speedup_vs_512"] = {
        f"{b}/{t}": row["product_ms_per_term"][f"{BASELINE}/{t}"] / row["product_ms_per_term"][
            f"{b}/{t}"] for b in blocks for t in TERMS}
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="512,1024,2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="two shapes, one round")
    ap.add_argument("--output", default=str(HERE / "results" / "he_hoist_kernels.json"))
    args = ap.parse_args(argv)
    blocks = sorted({int(b) for b in args.blocks.split(",")} | {BASELINE, hoist.PRODUCT_BLOCK})
    shapes = SHAPES[:2] if args.quick else SHAPES
    rounds = 1 if args.quick else args.rounds
    result: dict = {"benchmark": "he_hoist_kernels", "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "load_average_at_start": os.getloadavg()},
        "default_block": hoist.PRODUCT_BLOCK, "baseline_block": BASELINE, "blocks": blocks,
        "terms": list(TERMS), "rounds": rounds, "rows": []}
    for ring, primes in shapes:
        row = measure(ring, primes, blocks, rounds, reps=3)
        result["rows"].append(row)
        d = hoist.PRODUCT_BLOCK
        print(f"N={ring:5d} {primes:2d} primes: hoisted rotation "
              f"{row['rotate_ext_ms'][BASELINE]:.3f} ms at {BASELINE} words, "
              f"{row['rotate_ext_ms'][d]:.3f} at {d} ({row['rotate_ext_speedup_vs_512'][d]:.2f}x,"
              f" {row['rotation_loop']}); per extended product " + ", ".join(
                  f"{t} terms {row['product_ms_per_term'][f'{BASELINE}/{t}']:.3f} -> "
                  f"{row['product_ms_per_term'][f'{d}/{t}']:.3f} ms "
                  f"({row['product_speedup_vs_512'][f'{d}/{t}']:.2f}x)" for t in TERMS),
              flush=True)
        atomic_write_bytes(Path(args.output), json.dumps(result, indent=1).encode())
    d = hoist.PRODUCT_BLOCK
    result["summary"] = {
        "product_speedup_of_default_vs_512": [
            min(r["product_speedup_vs_512"][f"{d}/{t}"] for r in result["rows"] for t in TERMS),
            max(r["product_speedup_vs_512"][f"{d}/{t}"] for r in result["rows"] for t in TERMS)],
        "blocked_rotation_speedup_of_default_vs_512": [
            r["rotate_ext_speedup_vs_512"][d] for r in result["rows"]
            if r["rotation_loop"] == "blocked"],
        "best_block_per_shape": {
            f"{r['ring']}/{r['primes']}": min(blocks, key=lambda b: sum(
                r["product_ms_per_term"][f"{b}/{t}"] for t in TERMS)) for r in result["rows"]}}
    print(json.dumps(result["summary"], indent=1))
    atomic_write_bytes(Path(args.output), json.dumps(result, indent=1).encode())
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
