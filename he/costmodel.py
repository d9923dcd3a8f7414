"""Cost model of SEAL's CKKS primitives, so the compiler can price a plan before running it.

The time of every primitive is a function of the ring degree ``N`` and of the number of RNS
limbs (primes) the ciphertext still carries, which falls by one at every rescale. A
:class:`CostModel` holds, for each ring, measured seconds per call at a few limb counts and
interpolates linearly between them (costs grow about linearly in the limbs; key switching, in
``rotate`` and ``mul_ct``, about quadratically, which the piecewise-linear table follows).

Primitives: ``rotate`` (one key-switched rotation), ``mul_plain`` (ciphertext x plaintext),
``mul_ct`` (ciphertext x ciphertext + relinearisation), ``mul_lazy`` and ``relin`` (its two
parts: the three-polynomial product, and the relinearisation of one), ``rescale``, ``add``
(ciphertext + ciphertext), ``encode`` (one slot vector to a plaintext) and, on the client,
``encrypt`` (encrypt an encoded plaintext with the secret key and serialise the ciphertext).

Batch packing's fused linear maps (:mod:`he.fused`) are priced per word instead
(:data:`WORD_PRIMITIVES`, seconds per ring coefficient of work as
:meth:`he.fused.FusedMap.work` counts it): ``fused_mac`` (one multiply-accumulate of one digit),
``fused_in`` (one input word digit gathered) and ``fused_out`` (one output word digit reduced).
Their outputs are written into ciphertexts recycled from earlier rows, which a server allocates
(and the kernel zero-fills) once, as it starts (:meth:`he.Server.warm`): what a request costs
holds no fresh memory.

:func:`measure` times the primitives on this machine (about 6.5 minutes on 2 cores), each on
operands of its own per call that together outgrow the last-level cache, as a server's plaintexts,
ciphertexts and Galois keys do (:func:`distinct_calls`); :func:`default_model` returns the table
cached by :func:`calibrate` on this machine (``$XDG_CACHE_HOME/polynets/he-costs.json``) when
there is one, else the table shipped with the package (measured on a 2-core x86-64 machine),
scaled to this machine by a probe of a second or two (:func:`probe_speed`) against the probe's
seconds the table kept. Plans chosen from a model are stored in the
compiled program, so client and server agree whatever their own tables say.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from he import _kernels, hoist

__all__ = ["PRIMITIVES", "WORD_PRIMITIVES", "COMPILED_WORD_COSTS", "CostModel", "measure",
           "calibrate", "median_model", "default_model", "shipped_model", "cache_path",
           "probe_speed",
           "probe_rounds", "speed_factor"]

PRIMITIVES = ("rotate", "mul_plain", "mul_ct", "rescale", "add", "encode", "encrypt", "load",
              "mul_lazy", "relin", "spill", "decompose", "rotate_hoisted", "mul_ext", "mod_down",
              "check")
#: the primitives of hoisted baby steps (:mod:`he.hoist`): an input's decomposition, a rotation
#: without its division by the special prime, an extended plaintext product with its addition,
#: the division of a giant step's sum
HOISTED_PRIMITIVES = ("decompose", "rotate_hoisted", "mul_ext", "mod_down")
#: primitives a table measured before they existed prices like another (both (de)serialise one
#: ciphertext: the server's ``load`` of an input like the client's ``encrypt`` + save)
_DERIVED = {"load": "encrypt"}
#: primitives a table measured before they existed prices as a part of another: a ciphertext
#: product without its relinearisation, and the relinearisation alone (``mul_ct`` is both; on
#: a 2-core x86-64 machine the product took 14% of it at N=8192, three or four primes)
_DERIVED_PART = {"mul_lazy": ("mul_ct", 0.15), "relin": ("mul_ct", 0.85),
                 #: a row written to disk and read back, checksummed each way
                 #: (:class:`he.runtime.SpillFile`): 1.4 ms against a load's 2.8 ms at N=16384,
                 #: six primes, when a load was timed into reused memory (3.4 ms into fresh)
                 "spill": ("load", 0.5),
                 #: an input validated without being kept (:func:`he.wire.check`: its words
                 #: written and SEAL's check, its seed not expanded): 0.14 ms against a load's
                 #: 1.45 ms at N=8192, six primes, on a 2-core x86-64 machine
                 "check": ("load", 0.1),
                 #: hoisted baby steps, as parts of a rotation (of a plaintext product and its
                 #: addition for ``mul_ext``): the medians of N=8192 and 16384 at 1-14 primes of
                 #: 28 bits on a 2-core x86-64 machine (decomposition 0.29-0.75, hoisted
                 #: rotation 0.22-0.37, division 0.13-0.52); an extended product summed with
                 #: distinct terms (:func:`product_terms`) 1.1-3.2x a plaintext product in
                 #: cache (the median of N=8192-32768 at 1-24 primes)
                 "decompose": ("rotate", 0.5), "rotate_hoisted": ("rotate", 0.25),
                 "mod_down": ("rotate", 0.3), "mul_ext": ("mul_plain", 1.65)}
#: how a table's ``mul_ext`` was timed, as its JSON says: over distinct terms larger than the
#: caches (:func:`product_terms`). Tables that do not say timed one term summed over and over,
#: from the caches, and are read with ``mul_ext`` priced as a part of ``mul_plain``
MUL_EXT_TIMED = "distinct terms"
#: how a table's primitives were timed, as its JSON says: each on operands of its own per call,
#: together larger than the caches (:func:`distinct_calls`). A cached table that does not say
#: timed one operand set from the caches and prices servers' primitives 1.1-1.7x low: it is
#: used, with a warning to measure it again
OPERANDS_TIMED = "distinct operands"
WORD_PRIMITIVES = ("fused_mac", "fused_in", "fused_out")
#: polynomials of the ciphertext a table's ``rescale`` was timed on: two, as servers rescale
#: (after a plaintext product, a relinearisation or a fused map). Tables that do not say timed
#: an unrelinearised product of three (1.41-1.67x as long at N=8192 and 16384, three and four
#: primes); read, their rescales are scaled by the ratio of the work (one inverse NTT of the
#: dropped prime, then per prime left an NTT and a product, per polynomial)
RESCALE_POLYS = 2
_OLD_RESCALE_POLYS = 3
#: word costs of older tables that price nothing now (read and ignored)
_RETIRED_WORDS = ("alloc",)
#: Seconds per word of the fused primitives, as whole batch runs on a 2-core x86-64 machine show
#: them (fresh output memory, gathers larger than the caches): several times what small blocks
#: take on an idle machine, so :func:`measure` keeps these rather than timing small blocks.
DEFAULT_WORD_COSTS = {"fused_mac": 0.1e-9, "fused_in": 6e-9, "fused_out": 8e-9}
#: The same where the compiled loops of :mod:`he._kernels` gather, split and recombine the
#: words (one pass each instead of NumPy's several; the matrix products on one BLAS thread), as
#: batch runs on a 2-core x86-64 machine showed them (token model of 2 Mu-Layers, 6.6e10
#: multiply-accumulates, 1.4e9 digit words gathered, 1.2e9 recombined: 2.8 / 1.5 / 1.3 s under
#: a load average of 5, 2.5 / 1.35 / 1.14 s quiet).
COMPILED_WORD_COSTS = {"fused_mac": 0.05e-9, "fused_in": 1.1e-9, "fused_out": 1.1e-9}
_SHIPPED = Path(__file__).with_name("cost_table.json")
#: Speed-up per thread of rotations run on several threads at once (:mod:`he.native`), where a
#: table does not say: two cores of a 2-core x86-64 machine rotate 1.7x as fast as one. Plaintext
#: products and additions stream through memory and gain nothing.
DEFAULT_PARALLEL_EFFICIENCY = 0.85


def _number(value: Any) -> float:
    """``value`` as a float; NaN where it is not a number (refused by :func:`_is_speed`)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _is_speed(factor: float) -> bool:
    """Whether ``factor`` can scale a table's seconds: a finite positive number."""
    return bool(np.isfinite(factor) and factor > 0)


@dataclass
class CostModel:
    """Seconds per primitive call: ``table[N][op]`` is a list of ``(limbs, seconds)`` points."""

    table: dict[int, dict[str, list[tuple[int, float]]]]
    source: str = ""
    words: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WORD_COSTS))
    #: per ring, speed-up per thread of rotations on several threads at once (1: perfect)
    parallel: dict[int, float] = field(default_factory=dict)
    #: per ring, speed-up per thread of a client's encryptions (encode, encrypt, serialise) on
    #: several threads at once; none measured: no gain (:meth:`client_seconds`)
    client_parallel: dict[int, float] = field(default_factory=dict)
    #: this machine's seconds per second of the table's (every primitive and word cost times
    #: this; see :func:`probe_speed`)
    speed: float = 1.0
    #: per ring, the primitives the table prices from another's timing (:data:`_DERIVED`,
    #: :data:`_DERIVED_PART`) rather than its own: no measurement to compare a probe with
    derived: dict[int, frozenset[str]] = field(default_factory=dict)
    #: per ring, speed-up per thread of batch packing's threaded work (rescales, the fused maps'
    #: compiled loops) on several threads at once; none measured: the rotations' (above)
    batch_parallel: dict[int, float] = field(default_factory=dict)
    #: this machine's seconds of the fused maps' word work per second of the word costs'
    #: constants (:data:`COMPILED_WORD_COSTS`, batch runs on the shipped table's machine), on
    #: top of ``speed``: 1 for the shipped table; a table measured here reads it
    #: (:func:`_word_speed`), as SEAL's primitives and the word loops need not differ by the same
    #: factor from one machine to another
    word_speed: float = 1.0
    #: per ring, seconds one rotation whose key switching is shared among several threads
    #: takes beyond its share of the work (:func:`_shared_handoff`); none measured: sharing is
    #: not priced, so never chosen (:meth:`shared_handoff`)
    shared: dict[int, float] = field(default_factory=dict)
    #: seconds of each primitive :func:`probe_rounds` timed on the machine the table was
    #: measured on, as it measured the table (each primitive's median round): what
    #: :func:`speed_factor` compares a probe with; none (older tables): the table's own seconds
    #: at the probe's ring and primes
    probe: dict[str, float] = field(default_factory=dict)
    #: answers of :meth:`seconds` (a layout search asks the same few hundred thousands of times)
    _memo: dict[tuple[str, int, int], float] = field(default_factory=dict, init=False,
                                                     repr=False, compare=False)

    def seconds(self, op: str, ring: int, limbs: int) -> float:
        """Predicted seconds of one ``op`` on a ciphertext of ``limbs`` primes in ring ``ring``
        (for a word primitive: of one unit of :meth:`he.fused.FusedMap.work` per
        coefficient)."""
        compiled = op in COMPILED_WORD_COSTS and _kernels.expected()
        key = (op, ring, limbs, compiled)
        if key not in self._memo:
            self._memo[key] = self.speed * self._seconds(op, ring, limbs, compiled)
        return self._memo[key]

    def _seconds(self, op: str, ring: int, limbs: int, compiled: bool = False) -> float:
        if op in WORD_PRIMITIVES:
            per = COMPILED_WORD_COSTS[op] if compiled else \
                self.words.get(op, DEFAULT_WORD_COSTS[op])
            return per * ring * self.word_speed
        if op not in PRIMITIVES:
            raise ValueError(f"unknown primitive {op!r}; one of {PRIMITIVES + WORD_PRIMITIVES}")
        rings = sorted(self.table)
        if ring not in self.table:
            # scale from the nearest measured ring: costs are about N log N per limb
            near = min(rings, key=lambda r: abs(np.log2(r) - np.log2(ring)))
            f = (ring * np.log2(ring)) / (near * np.log2(near))
            return f * self._seconds(op, near, limbs, compiled)
        pts = self.table[ring][op]
        xs = np.array([p[0] for p in pts], dtype=np.float64)
        ys = np.array([p[1] for p in pts], dtype=np.float64)
        if limbs <= xs[0]:
            return float(ys[0] * max(limbs, 1) / xs[0])
        if limbs >= xs[-1] and len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return float(ys[-1] + slope * (limbs - xs[-1]))
        return float(np.interp(limbs, xs, ys))

    def price(self, counts: dict[str, float], ring: int, limbs: int) -> float:
        """Seconds of ``counts[op]`` calls of each primitive at one ring and limb count."""
        return sum(n * self.seconds(op, ring, limbs) for op, n in counts.items() if n)

    def client_seconds(self, n: int, ring: int, limbs: int, threads: int = 1) -> float:
        """Seconds a client takes to encode, encrypt and serialise ``n`` input ciphertexts of
        ``limbs`` primes on ``threads`` threads (:class:`he.Client`): ``n`` times ``encode`` and
        ``encrypt`` (which times the encryption and serialisation only), divided by the
        speed-up this table measured for a client's threads in this ring
        (:meth:`client_efficiency`; the encryptions run without the GIL, the encodings and
        serialisations take turns). A table that did not measure it assumes no gain."""
        one = self.seconds("encode", ring, limbs) + self.seconds("encrypt", ring, limbs)
        t = min(int(threads), int(n))
        if t < 2:
            return n * one
        return n * one / max(1.0, t * self.client_efficiency(ring))

    def client_efficiency(self, ring: int) -> float:
        """Speed-up per thread of a client's encryptions on several threads at once, in ring
        ``ring`` (the nearest measured ring's); ``0`` where the table measured none, so that
        :meth:`client_seconds` assumes no gain rather than one this machine may not give."""
        return _nearest(self.client_parallel, ring, 0.0)

    def scaled(self, speed: float, why: str) -> "CostModel":
        """The same table on a machine ``speed`` times as slow (``why`` joins the source)."""
        if not _is_speed(speed):
            raise ValueError(f"speed factor must be a positive number, not {speed!r}")
        return replace(self, source=f"{self.source}; {why}", speed=self.speed * float(speed))

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "words": dict(self.words), "speed": self.speed,
                "word_speed": self.word_speed, "rescale_polys": RESCALE_POLYS,
                "mul_ext_timed": MUL_EXT_TIMED, "operands_timed": OPERANDS_TIMED,
                "parallel_efficiency": {str(r): e for r, e in self.parallel.items()},
                "client_parallel_efficiency": {str(r): e
                                               for r, e in self.client_parallel.items()},
                "batch_parallel_efficiency": {str(r): e
                                              for r, e in self.batch_parallel.items()},
                "shared_handoff_seconds": {str(r): t for r, t in self.shared.items()},
                "probe_seconds": dict(self.probe),
                "table": {str(r): {op: [list(p) for p in pts] for op, pts in ops.items()
                                   if op not in self.derived.get(r, ())}
                          for r, ops in self.table.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        """The model a table's JSON holds; ValueError (or KeyError, TypeError) where it is not
        one."""
        if not isinstance(d, dict) or not isinstance(d.get("table"), dict) or not all(
                isinstance(ops, dict) for ops in d["table"].values()):
            raise ValueError("cost table: expected an object whose 'table' maps ring degrees "
                             "to primitives")
        table = {int(r): {str(op): [(int(p[0]), float(p[1])) for p in pts]
                          for op, pts in ops.items()} for r, ops in d["table"].items()}
        polys = d.get("rescale_polys", _OLD_RESCALE_POLYS)
        if polys not in (RESCALE_POLYS, _OLD_RESCALE_POLYS):
            raise ValueError(f"cost table: rescales timed on {polys!r} polynomials (2 or 3)")
        for ops in table.values():
            if "rescale" in ops and polys != RESCALE_POLYS:
                ops["rescale"] = [(limbs, t * RESCALE_POLYS / polys)
                                  for limbs, t in ops["rescale"]]
            if d.get("mul_ext_timed") != MUL_EXT_TIMED:
                # timed from the caches, at a third to a half of a server's: priced as a part
                # of a plaintext product instead (_DERIVED_PART)
                ops.pop("mul_ext", None)
        derived: dict[int, frozenset[str]] = {}
        for r, ops in table.items():
            made = set()
            for op, like in _DERIVED.items():
                if op not in ops and like in ops:
                    ops[op] = list(ops[like])
                    made.add(op)
            for op, (like, part) in _DERIVED_PART.items():
                if op not in ops and like in ops:
                    ops[op] = [(limbs, part * t) for limbs, t in ops[like]]
                    made.add(op)
            if made:
                derived[r] = frozenset(made)
            missing = set(PRIMITIVES) - set(ops)
            if missing or any(not pts for pts in ops.values()):
                raise ValueError(f"cost table for N={r} lacks {sorted(missing)}")
        words = dict(DEFAULT_WORD_COSTS)
        for k, v in dict(d.get("words", {})).items():
            if k in _RETIRED_WORDS:
                continue
            if k not in WORD_PRIMITIVES or not float(v) > 0:
                raise ValueError(f"cost table: bad word cost {k!r}: {v!r}")
            words[k] = float(v)
        parallel, client, batch, shared = (
            {int(r): float(e) for r, e in dict(d.get(key, {})).items()}
            for key in ("parallel_efficiency", "client_parallel_efficiency",
                        "batch_parallel_efficiency", "shared_handoff_seconds"))
        if not all(0.0 <= t < 1.0 for t in shared.values()):
            raise ValueError(f"cost table: shared hand-off seconds {shared} not all in [0, 1)")
        for what, eff in (("parallel", parallel), ("client parallel", client),
                          ("batch parallel", batch)):
            if not all(0.0 < e <= 1.0 for e in eff.values()):
                raise ValueError(f"cost table: {what} efficiencies {eff} not all in (0, 1]")
        probe = {str(op): _number(t) for op, t in dict(d.get("probe_seconds", {})).items()}
        if not all(_is_speed(t) for t in probe.values()):
            raise ValueError(f"cost table: probe seconds {probe} not all positive numbers")
        speed, word_speed = (_number(d.get(key, 1.0)) for key in ("speed", "word_speed"))
        if not _is_speed(speed):
            raise ValueError(f"cost table: bad speed factor {d.get('speed')!r}")
        if not _is_speed(word_speed):
            raise ValueError(f"cost table: bad word speed factor {d.get('word_speed')!r}")
        return cls(table, str(d.get("source", "")), words, parallel, client, speed, derived,
                   batch, word_speed, shared, probe)

    def parallel_efficiency(self, ring: int) -> float:
        """Speed-up per thread of rotations in ring ``ring`` run on several threads at once
        (the nearest measured ring's; :data:`DEFAULT_PARALLEL_EFFICIENCY` where none was)."""
        return _nearest(self.parallel, ring, DEFAULT_PARALLEL_EFFICIENCY)

    def batch_efficiency(self, ring: int) -> float:
        """Speed-up per thread of batch packing's threaded work (rescales, relinearisations,
        the fused maps' compiled loops; :func:`_batch_efficiency`) in ring ``ring`` on several
        threads at once: the nearest measured ring's, the rotations' where none was."""
        return _nearest(self.batch_parallel, ring, self.parallel_efficiency(ring))

    def map_handoff(self, ring: int) -> float:
        """Seconds one hand-off of work to the threads and back takes in ring ``ring``: a
        shared rotation's (:meth:`shared_handoff`) over the :data:`SHARED_ROTATION_HANDOFFS`
        it makes; 0 where the table measured none."""
        return (self.shared_handoff(ring) or 0.0) / SHARED_ROTATION_HANDOFFS

    def shared_handoff(self, ring: int) -> float | None:
        """Seconds one rotation (or decomposition, or giant step) shared among several threads
        takes beyond its share of the work in ring ``ring`` (:func:`_shared_handoff`): the
        nearest measured ring's times this machine's speed; None where the table measured
        none (sharing is then not priced)."""
        if not self.shared:
            return None
        return self.speed * _nearest(self.shared, ring, 0.0)


def _nearest(per_ring: dict[int, float], ring: int, default: float) -> float:
    """The value of the ring nearest ``ring`` (in log N) in ``per_ring``; ``default`` if empty."""
    if not per_ring:
        return default
    return per_ring[min(per_ring, key=lambda r: abs(np.log2(r) - np.log2(ring)))]


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polynets" / "he-costs.json"


def _time(fn: Any, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def measure(rings: Iterable[int] = (8192, 16384, 32768), *, progress: bool = False) -> CostModel:
    """Time SEAL's primitives on this machine at several limb counts per ring, and how much
    faster rotations, batch packing's rescales and a client's encryptions run on all its cores
    at once, and what sharing one rotation's stages among them adds: the median of readings
    spread through the timings (:data:`SPEEDUP_READINGS`). The probe (:func:`probe_rounds`)
    runs before and after each ring's timings and the word loops': the table keeps each
    primitive's median over them (``probe_seconds``) and every timing taken to that speed by
    the probes around it."""
    rings = list(rings)
    readings: dict[int, tuple[list[float], ...]] = {ring: ([], [], [], []) for ring in rings}

    def read_speed_ups() -> None:
        for ring in rings:
            readings[ring][0].append(_parallel_efficiency(ring))
            readings[ring][1].append(_client_efficiency(ring))
            readings[ring][2].append(_batch_efficiency(ring))
            readings[ring][3].append(_shared_handoff(ring))

    # the speed-ups per thread are read before each ring's table and after the last one (at
    # least SPEEDUP_READINGS times), and their median kept; the probe before and after each
    # ring's table and the word loops
    table, probes = {}, []
    for ring in rings:
        read_speed_ups()
        probes.append(_typical(probe_rounds()))
        table[ring] = _measure_ring(ring, progress)
    probes.append(_typical(probe_rounds()))
    for _ in range(max(1, SPEEDUP_READINGS - len(rings))):
        read_speed_ups()
    parallel, client, batch, shared = (
        {ring: float(np.median(r[k])) for ring, r in readings.items()} for k in range(4))
    words = _word_speed()
    probes.append(_typical(probe_rounds()))
    # the probe's seconds the table keeps, what a probe elsewhere compares with: each
    # primitive's median over the probes. A shared machine's speed drifts over a calibration
    # (by 1.4x within two minutes on a 2-core virtual machine): each ring's timings, and the
    # word loops', are taken to that speed by the probes around them
    probe = {op: float(np.median([p[op] for p in probes])) for op in probes[0]}
    for i, ring in enumerate(rings):
        f = _between(probes[i], probes[i + 1], probe)
        table[ring] = {op: [(limbs, t / f) for limbs, t in pts] for op, pts in table[ring].items()}
    words /= _between(probes[-2], probes[-1], probe)
    if progress:
        for what, eff in (("rotations", parallel), ("a client's encryptions", client),
                          ("batch rescales", batch)):
            print(f"  {what} on every core at once, speed-up per thread: " + ", ".join(
                f"N={ring} {e:.2f}" for ring, e in eff.items()))
        if all(np.isfinite(t) for t in shared.values()):
            print("  a rotation shared among every core, seconds beyond its share of the work: "
                  + ", ".join(f"N={ring} {t * 1e3:.2f} ms" for ring, t in shared.items()))
        print(f"  fused maps' word loops: {words:.2f}x the shipped word costs")
    return CostModel(table, f"measured on {platform.node()} ({platform.machine()}, "
                            f"{os.cpu_count()} CPUs) at {time.strftime('%Y-%m-%d %H:%M')}",
                     parallel=parallel, client_parallel={r: e for r, e in client.items() if e},
                     batch_parallel=batch, word_speed=words,
                     shared={r: t for r, t in shared.items() if np.isfinite(t)}, probe=probe)


#: (inputs, outputs) of the dense fused maps :func:`_word_speed` times: one whose work is
#: mostly multiply-accumulates, one mostly gathered input words (about 1.5 s and 140 MB of
#: ciphertexts on a 2-core machine)
WORD_SHAPES = ((256, 64), (512, 16))


def _word_speed(shapes: Sequence[tuple[int, int]] = WORD_SHAPES, reps: int = 3) -> float:
    """This machine's seconds of the fused maps' word work per second of the shipped word
    costs: dense maps of random integer weights (:func:`he.fused.fuse_map`) applied to fresh
    ciphertexts of N=8192 and two data primes on one thread, each the median of ``reps`` runs,
    over what the word costs price their :meth:`he.fused.FusedMap.work`; the geometric mean over
    ``shapes``. On one 2-core machine these maps read 1.55-2.31x while a batch server's own
    maps ran 1.87-2.17x the constants (token models, one thread)."""
    from he.fused import fuse_map, raw_access
    import scipy.sparse as sp
    import tenseal.sealapi as seal

    _kernels.kernels()                   # compiled and checked now (or NumPy's, and priced so)
    ring = 8192
    ctx, _, _, _, ct = _small_context(ring)
    moduli = [int(m.value()) for m in ctx.first_context_data().parms().coeff_modulus()]
    ev = seal.Evaluator(ctx)
    raw = raw_access(ct)
    unit = CostModel({}, "word costs as shipped")
    rng = np.random.default_rng(0)
    ratios = []
    for n_in, n_out in shapes:
        w = sp.csr_matrix(rng.normal(0.0, 1.0, (n_out, n_in)))
        fm, _ = fuse_map([w], [np.ones(n_in, bool)], [np.full(n_in, 2.0 ** 12)],
                         np.arange(n_out), moduli, min_fanin=1)
        if fm is None:
            raise RuntimeError(f"no fused map of {n_in} inputs and {n_out} outputs")
        cts = []
        for _ in range(n_in + n_out):
            c = seal.Ciphertext()
            ev.negate(ct, c)
            cts.append(c)
        ins, outs = cts[:n_in], cts[n_in:]
        fm.apply(raw, ins, outs, moduli)
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fm.apply(raw, ins, outs, moduli)
            runs.append(time.perf_counter() - t0)
        ratios.append(statistics.median(runs) / unit.price(fm.work(moduli), ring, len(moduli)))
        del cts, ins, outs
    return float(np.exp(np.mean(np.log(ratios))))


def _small_context(ring: int, data: Sequence[int] = (40, 28),
                   scale_bits: int = 28) -> tuple[Any, Any, Any, Any, Any]:
    """A context of ring ``ring`` with the data primes ``data`` (bits; by default two: small
    ciphertexts, where a call's fixed costs weigh most) and a 40-bit special prime: context, key
    generator, encoder, a plaintext of every slot at scale ``2**scale_bits``, and its public-key
    encryption."""
    import tenseal.sealapi as seal

    enc = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    enc.set_poly_modulus_degree(ring)
    enc.set_coeff_modulus(seal.CoeffModulus.Create(ring, [*data, 40]))
    ctx = seal.SEALContext(enc, True, seal.SEC_LEVEL_TYPE.TC128)
    keygen = seal.KeyGenerator(ctx)
    pk = seal.PublicKey()
    keygen.create_public_key(pk)
    encoder = seal.CKKSEncoder(ctx)
    pt = seal.Plaintext()
    encoder.encode(np.linspace(-1, 1, ring // 2).tolist(), 2.0 ** scale_bits, pt)
    ct = seal.Ciphertext()
    seal.Encryptor(ctx, pk).encrypt(pt, ct)
    return ctx, keygen, encoder, pt, ct


#: rounds :func:`_speedup_per_thread` times, each one map on one thread and one on all of them
SPEEDUP_ROUNDS = 7
#: the fewest readings of each speed-up per thread :func:`measure` takes, spread through its
#: timings (it keeps their median). One reading lasts about a second, and a shared machine
#: slows for longer: a single reading at the start of one benchmark run put the speed-up per
#: thread of rotations at N=16384 at 0.57 (1.13x predicted for a MONet's server on two threads),
#: and the server then ran 1.57x as fast on two threads as on one; readings on a quiet machine
#: were 0.77-0.87.
SPEEDUP_READINGS = 3


def _speedup_per_thread(task: Any, threads: int, rounds: int = SPEEDUP_ROUNDS,
                        then: Any = None) -> float:
    """Speed-up per thread of ``8 * threads`` calls of ``task`` on ``threads`` threads of
    :class:`he.native.Pool` against one (1: perfect; at least 0.1), ``then(results)`` (what
    follows them on one thread, if given) timed with them: the median over ``rounds``
    of the ratio within each round, whose one-thread and many-thread maps run back to back (in
    alternating order). A shared machine slows for seconds at a time, so timings taken apart
    compare different machines: the least of three rounds on each side, taken one side after
    the other, put the speed-up per thread of the same rotations at 0.76 at the start of one
    benchmark run and 0.92 at the start of the next, on the same server, whose batch ran at
    the same speed in both (30.0 and 30.8 images/s)."""
    from he.native import Pool

    tasks = list(range(8 * threads))
    one, many = Pool(1), Pool(threads)

    def timed(pool: Any) -> float:
        t0 = time.perf_counter()
        out = pool.map(task, tasks)
        if then is not None:
            then(out)
        return time.perf_counter() - t0

    ratios = [serial / (threads * parallel) for serial, parallel in
              _paired_rounds(lambda: timed(one), lambda: timed(many), rounds)]
    return float(min(1.0, max(0.1, np.median(ratios))))


def _paired_rounds(serial: Callable[[], float], parallel: Callable[[], float],
                   rounds: int) -> list[tuple[float, float]]:
    """``(serial(), parallel())`` (each a timing) in each of ``rounds`` rounds, the two run back
    to back in alternating order, after one untimed call of each (the first calls allocate,
    fill caches and start the pool's threads)."""
    serial(), parallel()
    out = []
    for r in range(max(1, int(rounds))):
        if r % 2:
            b, a = parallel(), serial()
        else:
            a, b = serial(), parallel()
        out.append((a, b))
    return out


def _parallel_efficiency(ring: int) -> float:
    """Speed-up per thread of giant steps (four plaintext products summed, one rotation; native,
    :mod:`he.native`) on every core of this process at once, against one thread (1: perfect;
    the default where there is one core or no native path)."""
    import tenseal.sealapi as seal

    from he.native import NativeEvaluator, default_threads, galois_element

    threads = default_threads()
    if threads < 2:
        return DEFAULT_PARALLEL_EFFICIENCY
    ctx, keygen, _, pt, ct = _small_context(ring)
    gk = seal.GaloisKeys()
    keygen.create_galois_keys([galois_element(1, ring)], gk)
    ev = seal.Evaluator(ctx)
    native = NativeEvaluator(ctx, ev, gk, ct, 1, pt)
    if not native.ok:
        return DEFAULT_PARALLEL_EFFICIENCY

    def giant_step(_: int) -> Any:
        # as the runtime's giant steps: plaintext products summed, then one rotation
        acc = native.multiply_plain(ct, pt)
        for _ in range(3):
            ev.add_inplace(acc, native.multiply_plain(ct, pt))
        return native.rotate(acc, 1)

    return _speedup_per_thread(giant_step, threads)


#: data primes of the ciphertexts :func:`_batch_efficiency` rescales (a batch program's are 3-6)
BATCH_PROBE_PRIMES = 4


def _batch_efficiency(ring: int) -> float:
    """Speed-up per thread of batch packing's threaded work on every core of this process at
    once, against one thread (1: perfect): rescales (native, :mod:`he.native`) of a ciphertext of
    :data:`BATCH_PROBE_PRIMES` data primes into a buffer of each call's own, as a batch server
    finishes its rows. Unlike the rotations' giant steps (:func:`_parallel_efficiency`), whose
    plaintext products and additions stream through memory, they compute on words in cache: two
    cores of a 2-core x86-64 machine rescaled 1.75x as fast as one and ran the fused maps'
    compiled loops 1.9x as fast, where they rotated 1.56x as fast."""
    import tenseal.sealapi as seal

    from he.native import NativeEvaluator, default_threads

    threads = default_threads()
    if threads < 2:
        return DEFAULT_PARALLEL_EFFICIENCY
    # a product's scale (2^60), which a rescale by a 30-bit prime keeps above 1
    ctx, _, _, pt, ct = _small_context(ring, (40,) + (30,) * BATCH_PROBE_PRIMES, 60)
    native = NativeEvaluator(ctx, seal.Evaluator(ctx), None, ct, None, pt)
    if not native.ok or not native.accepts_rescale(ct):
        return DEFAULT_PARALLEL_EFFICIENCY
    into = [seal.Ciphertext() for _ in range(8 * threads)]
    for buf in into:                # each call's buffer sized by a first rescale
        native.rescale(ct, buf)
    return _speedup_per_thread(lambda i: native.rescale(ct, into[i]), threads)


#: hand-offs to the threads and back in one shared rotation (:meth:`he.hoist.Hoister.
#: rotate_shared`): the decomposition's inverse transforms and its rows, the products with the
#: key, the division
SHARED_ROTATION_HANDOFFS = 4


def _shared_handoff(ring: int) -> float:
    """Seconds one rotation whose key switching's stages (decomposition, products with the
    key, division by the special prime) are shared among every core of this process
    (:meth:`he.hoist.Hoister.rotate_shared`) takes beyond its share of the work, on a
    ciphertext of one data prime (the least work, so the hand-offs show): the median over
    :data:`SPEEDUP_ROUNDS` paired rounds of the shared rotation's seconds less those of the
    same rotation on one thread divided by the threads; NaN where there is one core or no
    hoister here (nothing to measure: :func:`measure` then keeps none, and nothing is
    shared). Each stage is a hand-off to the threads and back: on a 2-core x86-64 machine
    about a millisecond per rotation at N=8192-16384, where one rotation of one prime takes
    1-3 ms on one thread."""
    import tenseal.sealapi as seal

    from he.native import Pool, default_threads

    threads = default_threads()
    if threads < 2 or not hoist.expected():
        return float("nan")
    _, tools = _tools(ring, 1)
    hoister, (encoder, _, encryptor) = tools.hoister, tools[:3]
    if hoister is None:
        return float("nan")
    pt, ct = seal.Plaintext(), seal.Ciphertext()
    encoder.encode(np.linspace(-1.0, 1.0, ring // 2).tolist(), 2.0 ** 20, pt)
    encryptor.encrypt(pt, ct)
    pool, n = Pool(threads), 8

    def timed(on: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            hoister.rotate_shared(ct, 1, on)
        return (time.perf_counter() - t0) / n

    extra = [max(0.0, shared - one / threads) for one, shared in
             _paired_rounds(lambda: timed(None), lambda: timed(pool), SPEEDUP_ROUNDS)]
    return float(np.median(extra))


def _client_efficiency(ring: int) -> float:
    """Speed-up per thread of a client's request (per input ciphertext: encode, encrypt with
    the secret key without the GIL, serialise; then the request's container;
    :class:`he.Client`) on every core of this process at once, against one thread; ``0`` where
    there is one core or no native encryption, as clients there encrypt on one thread."""
    import tenseal.sealapi as seal

    from he.container import pack
    from he.native import NativeEncryptor, default_threads
    from he.wire import encrypt_bytes

    threads = default_threads()
    if threads < 2:
        return 0.0
    ctx, keygen, encoder, pt, _ = _small_context(ring)
    secret = keygen.secret_key()
    encryptor = seal.Encryptor(ctx, secret)
    native = NativeEncryptor(ctx, encryptor, seal.Decryptor(ctx, secret), encoder, pt)
    if not native.ok:
        return 0.0
    values = np.random.default_rng(0).uniform(-1, 1, ring // 2)

    def one(_: int) -> bytes:
        # as he.Client: encode a slot vector, encrypt and serialise
        plain = seal.Plaintext()
        encoder.encode(values.tolist(), 2.0 ** 28, plain)
        return encrypt_bytes(plain, encryptor, native)

    def request(blobs: list[bytes]) -> bytes:
        # then the request's container (its digests, on every core where it is large)
        return pack("ciphertext", {"n_samples": 1}, {"g0": blobs})

    return _speedup_per_thread(one, threads, then=request)


def _measure_ring(ring: int, progress: bool) -> dict[str, list[tuple[int, float]]]:
    """Seconds of each primitive at a few limb counts of one ring, with primes of the size
    compiled programs use (the cost per limb does not depend on it), so the table reaches the
    limb counts they have: 6 at N=8192, 14 at 16384, 24 at 32768."""
    import tenseal.sealapi as seal

    from he.params import MAX_MODULUS_BITS

    primes = min(24, (MAX_MODULUS_BITS[ring] - 40) // 28)   # + one 40-bit special prime
    values = np.random.default_rng(0).uniform(-1, 1, ring // 2).tolist()
    reps = max(2, 65536 // ring)
    ops: dict[str, list[tuple[int, float]]] = {op: [] for op in PRIMITIVES}
    # each limb count in a context of its own, whose Galois keys are as large as a rotation at
    # that level reads (SEAL's keys are made at the top level)
    for limbs in sorted({primes, max(1, primes // 2), max(1, primes // 4), 2, 1}):
        ctx, tools = _tools(ring, limbs, rotation_keys(ring, limbs))
        for op, seconds in _time_level(seal, tools, ctx.first_parms_id(), values, reps,
                                       limbs).items():
            ops[op].append((limbs, seconds))
        del ctx, tools
        if progress:
            print(f"  N={ring} limbs={limbs}: " + ", ".join(
                f"{op} {pts[-1][1] * 1e3:.3f} ms" for op, pts in ops.items() if pts))
    for op in ops:
        ops[op].sort()
    # hoisted baby steps where this machine has none: priced as parts of others (from_dict)
    ops = {op: pts for op, pts in ops.items() if pts or op not in HOISTED_PRIMITIVES}
    if not ops["rescale"]:
        ops["rescale"] = [(1, ops["mul_plain"][0][1])]
    return ops


class _Tools(NamedTuple):
    """What :func:`_time_level` times with (:func:`_tools`)."""

    encoder: Any
    evaluator: Any
    encryptor: Any
    #: the client's native encryptor (:class:`he.native.NativeEncryptor`, maybe not usable)
    native: Any
    relin_keys: Any
    galois_keys: Any
    context: Any
    #: the validated :class:`he.hoist.Hoister` of the context (None: not here)
    hoister: Any
    #: the rotation steps ``galois_keys`` holds, one key each
    steps: tuple[int, ...]


def _tools(ring: int, primes: int, rotations: int = 1) -> tuple[Any, _Tools]:
    """A context of ``primes`` 28-bit data primes and a 40-bit special one, and what
    :func:`_time_level` times with, the Galois keys of ``rotations`` distinct steps (1, 2,
    ...) among them."""
    import tenseal.sealapi as seal

    from he.native import NativeEncryptor, galois_element

    enc = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    enc.set_poly_modulus_degree(ring)
    enc.set_coeff_modulus(seal.CoeffModulus.Create(ring, [28] * primes + [40]))
    ctx = seal.SEALContext(enc, True, seal.SEC_LEVEL_TYPE.TC128)
    keygen = seal.KeyGenerator(ctx)
    pk = seal.PublicKey()
    keygen.create_public_key(pk)
    rk = seal.RelinKeys()
    keygen.create_relin_keys(rk)
    steps = tuple(range(1, max(1, int(rotations)) + 1))
    gk = seal.GaloisKeys()
    keygen.create_galois_keys([galois_element(s, ring) for s in steps], gk)
    encoder = seal.CKKSEncoder(ctx)
    encryptor = seal.Encryptor(ctx, pk, keygen.secret_key())
    probe = seal.Plaintext()
    encoder.encode(np.linspace(-1.0, 1.0, ring // 2).tolist(), 2.0 ** 20, probe)
    native = NativeEncryptor(ctx, encryptor, seal.Decryptor(ctx, keygen.secret_key()), encoder,
                             probe)
    ev = seal.Evaluator(ctx)
    hoister = None
    if hoist.expected():
        ct = seal.Ciphertext()
        encryptor.encrypt(probe, ct)
        hoister, _ = hoist.Hoister.validated(ctx, gk, ev, encoder, ct, 1)
    return ctx, _Tools(encoder, ev, encryptor, native, rk, gk, ctx, hoister, steps)


#: the fewest and most distinct operands (ciphertexts, plaintexts, keys, a giant step's terms)
#: :func:`_time_level` cycles through to time a primitive (:meth:`he.hoist.Hoister.product_sum`
#: takes at most 256 terms)
OPERAND_SETS = (4, 256)
#: the terms per sum :func:`_time_level` times extended products in: a few, and as many as a
#: giant step of the benchmarks' plans sums (15-28 on average); the two give a sum's own work
#: (its output and reduction) and the work per term. Per term, long sums run faster: on a
#: 2-core x86-64 machine at N=8192 and three primes, 0.14 ms in sums of 4 distinct terms,
#: 0.11 in sums of 16, 0.10 in sums of 86, where servers' giant steps took 0.14-0.16 (two and
#: three primes)
SUM_TERMS = (4, 16)
#: a last-level cache's bytes where the system does not say
DEFAULT_CACHE_BYTES = 32 * 2 ** 20


@functools.lru_cache(maxsize=1)
def last_level_cache() -> int:
    """Bytes of this machine's largest cache (Linux says, in ``/sys``; elsewhere
    :data:`DEFAULT_CACHE_BYTES`), read once per process."""
    sizes = []
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2 ** 10, "M": 2 ** 20}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def distinct_calls(call_bytes: float, cache: int | None = None) -> int:
    """Calls, each on operands of its own that ``call_bytes`` bytes hold together, that read
    twice the last-level cache (``cache`` bytes; this machine's by default), within
    :data:`OPERAND_SETS`: how many :func:`_time_level` cycles through to time a primitive as a
    server runs it, on operands the caches do not hold (its plaintexts, rotations, keys are
    distinct, and together larger than the caches). On a 2-core x86-64 machine (32 MiB
    last-level cache) one operand set used over and over, from the caches, put servers'
    primitives at 0.6-0.9x what they took in them (rotations, plaintext products, additions,
    hoisted steps at N=8192 and 16384, three to five primes), an extended product summed 8
    times over one term at a third to a half."""
    need = -(-2 * (last_level_cache() if cache is None else int(cache)) // max(1, int(call_bytes)))
    return max(OPERAND_SETS[0], min(OPERAND_SETS[1], need))


def _poly_bytes(ring: int, limbs: int) -> int:
    """Bytes of one polynomial of ``limbs`` primes in ring ``ring``."""
    return 8 * int(ring) * int(limbs)


def product_terms(ring: int, limbs: int, cache: int | None = None) -> int:
    """Distinct terms of ``limbs`` primes (and the special one) at ring ``ring`` summed to time
    an extended product (:func:`distinct_calls`: a plaintext and a two-polynomial rotation
    each). On a 2-core x86-64 machine, at N=8192 and five primes, a server's giant steps (60
    distinct terms) took 1.4-1.8x longer per product than 16 distinct ones, which the cache
    held."""
    return distinct_calls(3 * _poly_bytes(ring, limbs + 1), cache)


def key_bytes(ring: int, limbs: int) -> int:
    """Bytes of the Galois key a rotation of a ciphertext of ``limbs`` primes reads: a
    two-polynomial ciphertext of ``limbs`` primes and the special one per prime."""
    return int(limbs) * 2 * _poly_bytes(ring, limbs + 1)


def rotation_keys(ring: int, limbs: int, cache: int | None = None) -> int:
    """Distinct Galois keys :func:`_time_level` rotates by at ``limbs`` primes: those whose
    words take twice the last-level cache, one at least, and no more than the rotations it
    times (:func:`distinct_calls` of a rotation's input, output and key)."""
    c = last_level_cache() if cache is None else int(cache)
    k = key_bytes(ring, limbs)
    calls = distinct_calls(4 * _poly_bytes(ring, limbs) + k, c)
    return max(1, min(calls, -(-2 * c // k)))


def load_set(ring: int) -> int:
    """Distinct ciphertexts :func:`_time_level` loads per round to time ``load``, each into a
    buffer of its own: 32 at N=8192, fewer at larger rings (at most about 0.1 GB of buffers)."""
    return max(4, 32 * 8192 // int(ring))


def _time_level(seal: Any, tools: _Tools, pid: Any, values: list[float], reps: int,
                limbs: int, cache: int | None = None) -> dict[str, float]:
    """Seconds of each primitive on a ciphertext at the level ``pid`` (``limbs`` primes).

    A server's operands are distinct and together larger than the caches: its plaintexts, the
    ciphertexts it adds and rotates, its Galois keys. Each of its primitives is timed so, as
    the seconds per call of one pass through :func:`distinct_calls` calls on operands of their
    own (the best of three passes), its rotations by the keys of :func:`rotation_keys` distinct
    steps (``tools.steps``, as many as the keys :func:`_tools` made). A client's ``encode`` and
    ``encrypt`` and a ``spill`` are timed on one operand, ``reps`` times. ``cache``: the
    last-level cache's bytes the operands outgrow (this machine's by default; 0: the fewest
    operands, which the caches hold, as :func:`probe_rounds` times)."""
    from he.container import digest
    from he.runtime import SpillFile
    from he.wire import check, encrypt_bytes, loads

    encoder, ev, encryptor, native, rk, gk, ctx = tools[:7]
    ring = int(ctx.key_context_data().parms().poly_modulus_degree())
    poly = _poly_bytes(ring, limbs)
    pt = seal.Plaintext()
    encoder.encode(values, pid, 2.0 ** 12, pt)
    ct = seal.Ciphertext()
    encryptor.encrypt(pt, ct)
    # calls per pass of each primitive, by the bytes one call reads and writes
    calls = {op: distinct_calls(n * poly, cache) for op, n in
             (("add", 6), ("mul_plain", 5), ("rescale", 5), ("mul_ct", 7))}
    calls["rotate"] = distinct_calls(4 * poly + key_bytes(ring, limbs), cache)
    n = max(calls.values()) + 1
    cts, pts, outs = [], [], []
    for _ in range(n):
        c, p, o = seal.Ciphertext(), seal.Plaintext(), seal.Ciphertext()
        ev.negate(ct, c)
        encoder.encode(values, pid, 2.0 ** 12, p)
        ev.multiply_plain(c, p, o)          # allocated and written before it is timed
        cts.append(c)
        pts.append(p)
        outs.append(o)
    steps = tools.steps
    # primitive -> its calls per pass (one absent is timed call by call, ``reps`` times)
    per_pass: dict[str, int] = {}

    def passes(op: str, call: Callable[[int], Any], n: int | None = None) -> Callable[[], None]:
        per_pass[op] = calls[op] if n is None else n

        def one_pass() -> None:
            for i in range(per_pass[op]):
                call(i)
        return one_pass

    timings = {
        "encode": lambda: encoder.encode(values, pid, 2.0 ** 12, seal.Plaintext()),
        "add": passes("add", lambda i: ev.add(cts[i], cts[i + 1], outs[i])),
        "mul_plain": passes("mul_plain", lambda i: ev.multiply_plain(cts[i], pts[i], outs[i])),
        "rotate": passes("rotate", lambda i: ev.rotate_vector(
            cts[i], steps[i % len(steps)], gk, outs[i])),
        # what a client does per input ciphertext, encoding aside (he.Client), the digest
        # its request's container keeps of it included
        "encrypt": lambda: digest(encrypt_bytes(pt, encryptor, native)),
    }
    # a batch server loads each of a request's ciphertexts and copies it into a free buffer of
    # its group (he.runtime.run_batch), the loaded one's storage going back to SEAL's pool for
    # the next load: timed so, into buffers written before
    blobs = [encrypt_bytes(pt, encryptor, native) for _ in range(load_set(ring))]
    buffers = []
    for _ in blobs:
        buf = seal.Ciphertext(ctx, pid, 2)
        buf.resize(ctx, pid, 2)
        buffers.append(buf)

    def load_into_buffers() -> None:
        for b, buf in zip(blobs, buffers):
            loaded = loads(ctx, b, "ciphertext", into=buf)
            if loaded is not buf:           # SEAL's own load, copied into the buffer
                ev.negate(loaded, buf)
                ev.negate_inplace(buf)

    def check_all() -> None:
        for b in blobs:
            check(ctx, b, "ciphertext")

    timings["load"] = load_into_buffers
    timings["check"] = check_all
    spill, back = SpillFile(), seal.Ciphertext()

    def spilled() -> None:
        spill.write(0, ct)
        spill.read(0, back, ctx)

    timings["spill"] = spilled
    hoister = tools.hoister
    if hoister is not None:
        # one decomposition rotated by every step (a server's baby steps), each rotation's
        # division by the special prime, decompositions of distinct ciphertexts
        dec = hoister.decompose(ct)
        exts = [hoister.rotate_ext(dec, s) for s in steps]
        plain = hoister.extend_plain(encoder, values, 2.0 ** 12, ct.coeff_modulus_size())
        k = len(steps)
        n_terms = product_terms(ring, limbs, cache)
        terms = [(plain.copy(), hoist.Extended(exts[i % k].source, exts[i % k].words.copy()))
                 for i in range(n_terms)]
        timings["decompose"] = passes("decompose", lambda i: hoister.decompose(cts[i]), k)
        timings["rotate_hoisted"] = passes("rotate_hoisted",
                                           lambda i: hoister.rotate_ext(dec, steps[i]), k)
        timings["mod_down"] = passes("mod_down", lambda i: hoister.mod_down(exts[i], ct.scale),
                                     k)
        # a giant step's products: sums of a few and of many distinct terms, each pass through
        # all of them (a sum's own work, its output and reduction, is then a giant step's
        # share, priced with its division below)
        few, many = SUM_TERMS[0], min(SUM_TERMS[1], n_terms)
        for size in sorted({few, many}):
            timings[f"sums of {size}"] = passes(f"sums of {size}", lambda i, size=size:
                                                hoister.product_sum(terms[i * size:][:size]),
                                                max(1, n_terms // size))
    if limbs > 1:
        def mul_ct(i: int) -> None:
            ev.multiply(cts[i], cts[i + 1], outs[i])
            ev.relinearize_inplace(outs[i], rk)

        def product_rescale(i: int) -> None:
            ev.multiply_plain(cts[i], pts[i], outs[i])
            ev.rescale_to_next_inplace(outs[i])

        timings["mul_ct"] = passes("mul_ct", mul_ct)
        timings["mul_lazy"] = passes("mul_lazy",
                                     lambda i: ev.multiply(cts[i], cts[i + 1], outs[i]),
                                     calls["mul_ct"])
        timings["rescale"] = passes("rescale", product_rescale)
    # a pass, a load of a set of ciphertexts: once each (the best of three)
    per_pass["load"] = per_pass["check"] = len(blobs)
    result = {op: _time(fn, 1 if op in per_pass else reps) / per_pass.get(op, 1)
              for op, fn in timings.items()}
    if hoister is not None:
        # seconds per sum of ``few`` and of ``many`` terms: per term, and per sum on top
        t_few = result.pop(f"sums of {few}")
        t_many = result.pop(f"sums of {many}") if many > few else t_few
        per_term = (t_many - t_few) / (many - few) if many > few else 0.0
        if per_term <= 0:                   # no slope to read: the many terms' mean
            per_term = t_many / many
        result["mul_ext"] = per_term
        result["mod_down"] += max(0.0, t_few - few * per_term)
    buffers.clear()
    spill.close()
    if limbs > 1:
        result["relin"] = max(result["mul_ct"] - result["mul_lazy"], 1e-7)
        # of two polynomials, as servers rescale (after a plaintext product, a relinearisation
        # or a fused map); a product left unrelinearised has three, and rescaling it took
        # 1.41-1.67x as long (N=8192 and 16384, three and four primes)
        result["rescale"] = max(result["rescale"] - result["mul_plain"], 1e-7)
    return result


def median_model(models: Sequence[CostModel], source: str | None = None) -> CostModel:
    """The element-wise median of tables measured one after another on one machine (every
    primitive's seconds at each ring and limb count, the word costs, the speed-ups per thread,
    the hand-offs and the probe's seconds): a shared machine's speed drifts over a calibration,
    and the median of three or more is steadier than any one. ``source``: the result's (by
    default the first's, with how many were combined). ValueError where the tables do not
    time the same primitives at the same points."""
    if not models:
        raise ValueError("median_model needs at least one cost model")
    dicts = [m.to_dict() for m in models]
    first = dicts[0]

    def med(values: Sequence[float]) -> float:
        return float(np.median(np.asarray(values, dtype=np.float64)))

    def keyed(key: str) -> dict[str, float]:
        keys = set(first.get(key, {}))
        if any(set(d.get(key, {})) != keys for d in dicts):
            raise ValueError(f"median_model: the tables' {key} differ in what they hold")
        return {k: med([d[key][k] for d in dicts]) for k in sorted(keys)}

    table: dict[str, dict[str, list[list[float]]]] = {}
    for ring, ops in first["table"].items():
        table[ring] = {}
        for op, pts in ops.items():
            others = [d["table"].get(ring, {}).get(op) for d in dicts]
            if any(o is None or [p[0] for p in o] != [p[0] for p in pts] for o in others):
                raise ValueError(f"median_model: the tables time {op} at N={ring} at different "
                                 f"limb counts")
            table[ring][op] = [[pts[i][0], med([o[i][1] for o in others])]  # type: ignore
                               for i in range(len(pts))]
    out = dict(first, table=table, speed=1.0,
               word_speed=med([d["word_speed"] for d in dicts]),
               source=source if source is not None else
               f"{first['source']}; the median of {len(dicts)} calibrations one after another")
    for key in ("words", "parallel_efficiency", "client_parallel_efficiency",
                "batch_parallel_efficiency", "shared_handoff_seconds", "probe_seconds"):
        out[key] = keyed(key)
    return CostModel.from_dict(out)


def calibrate(path: str | os.PathLike | None = None, *, progress: bool = False,
              repeats: int = 1) -> CostModel:
    """Measure this machine's costs (``repeats`` times one after another, keeping each
    figure's median, :func:`median_model`) and cache them (atomically) where
    :func:`default_model` looks; returns the model."""
    from polynets.errors import check_int
    from polynets.ir.program import atomic_write_bytes

    check_int(repeats, "repeats")
    runs = []
    for i in range(repeats):
        if progress and repeats > 1:
            print(f"calibration {i + 1} of {repeats}", flush=True)
        runs.append(measure(progress=progress))
    model = runs[0] if repeats == 1 else median_model(runs)
    target = Path(path) if path is not None else cache_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, json.dumps(model.to_dict(), indent=1).encode())
    return model


#: the ring and limb count :func:`probe_speed` times every primitive at (about a second on a
#: 2-core x86-64 machine, keys included)
PROBE_RING, PROBE_LIMBS = 8192, 3
#: rounds of timings the probe takes (each primitive's typical round is their median: odd)
PROBE_ROUNDS = 5
#: environment variable that fixes the speed factor of the shipped table instead of probing
#: (``1``: the table as shipped, e.g. for reproducible predictions)
SPEED_ENV = "POLYNETS_HE_SPEED"


def probe_rounds(reference: CostModel | None = None,
                 rounds: int = PROBE_ROUNDS) -> list[dict[str, float]]:
    """Seconds of every primitive :func:`measure` times, at N=:data:`PROBE_RING` and
    :data:`PROBE_LIMBS` primes, in ``rounds`` rounds one after another, each the best of three
    loops on the fewest operands (one key; the caches hold them: seconds, where the table's
    timings on operands larger than the caches take a minute); none where ``reference`` has
    nothing to compare them with (no probe of its own, nor that ring)."""
    import tenseal.sealapi as seal

    ring, limbs = PROBE_RING, PROBE_LIMBS
    if reference is not None and not reference.probe and ring not in reference.table:
        return []
    ctx, tools = _tools(ring, limbs)
    values = np.random.default_rng(0).uniform(-1, 1, ring // 2).tolist()
    return [_time_level(seal, tools, ctx.first_parms_id(), values, 4, limbs, cache=0)
            for _ in range(rounds)]


def _ratio(seconds: dict[str, float], base: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The geometric mean over the primitives both time of ``seconds`` over ``base``, and each
    ratio; ``(1.0, {})`` where they share none."""
    ratios = {op: t / base[op] for op, t in sorted(seconds.items()) if op in base and t > 0}
    if not ratios:
        return 1.0, {}
    return float(np.exp(np.mean(np.log(list(ratios.values()))))), ratios


def _between(before: dict[str, float], after: dict[str, float],
             reference: dict[str, float]) -> float:
    """How many times as slow as ``reference`` the machine ran between two probes' seconds
    (the geometric mean of the two)."""
    return float(np.sqrt(_ratio(before, reference)[0] * _ratio(after, reference)[0]))


def _typical(rounds: Sequence[dict[str, float]],
             statistic: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """``statistic`` of each primitive's seconds over ``rounds``."""
    return {op: float(statistic([r[op] for r in rounds])) for op in rounds[0]} if rounds else {}


def speed_factor(reference: CostModel, rounds: Sequence[dict[str, float]],
                 statistic: Callable[[list[float]], float] = statistics.median
                 ) -> tuple[float, dict[str, float]]:
    """The geometric mean, over the primitives the probe timed, of ``statistic`` of each one's
    seconds over ``rounds`` (:func:`probe_rounds`) over the probe's seconds on the table's
    machine (:attr:`CostModel.probe`; a table without them: over its own seconds at the
    probe's ring and primes, without the factor it may already carry). Returns the factor and
    each ratio; ``(1.0, {})`` where there is nothing to compare.

    The median round is the table's statistic: each of its seconds is the best of three loops
    timed once, and so is each round's. The least of the rounds (the best of their loops
    together) is not: on a shared machine whose speed varies from one moment to the next, it
    read the machine fast (``benchmarks/he_probe.py``, 12 models each timed between two probes
    on a shared machine: the median round predicted all 24 within -14% to +15%, the least
    round 22 within 30%, from -35% to +12%). A primitive the table
    derives from another's timing (a spill from a load) is priced by that one's ratio already;
    its own would compare a timing with a rule of thumb."""
    if not rounds or (not reference.probe and PROBE_RING not in reference.table):
        return 1.0, {}
    ring, limbs = PROBE_RING, PROBE_LIMBS
    if reference.probe:
        base = dict(reference.probe)
    else:
        derived = reference.derived.get(ring, frozenset())
        base = {op: reference.seconds(op, ring, limbs) / reference.speed
                for op in reference.table[ring] if op not in derived}
    return _ratio(_typical(rounds, statistic), base)


def probe_speed(reference: CostModel) -> tuple[float, dict[str, float]]:
    """How many times slower than ``reference`` this machine runs SEAL's primitives:
    :func:`speed_factor` over :data:`PROBE_ROUNDS` rounds of :func:`probe_rounds`. Returns the
    factor and each primitive's ratio.

    Machines of one kind differ: the table shipped with the package, measured on one 2-core
    virtual machine, ran 1.3-1.5x faster in every primitive than another such machine did.
    The factor scales every primitive alike, so the plans a model chooses do not change, only
    its predicted seconds."""
    return speed_factor(reference, probe_rounds(reference))


_CACHE: dict[str, CostModel] = {}


def shipped_model() -> CostModel:
    """The table shipped with the package as it is: no probe's factor, whatever this machine
    has cached (what :func:`default_model` scales when nothing is cached)."""
    return CostModel.from_dict(json.loads(_SHIPPED.read_text()))


def default_model() -> CostModel:
    """This machine's cached table if :func:`calibrate` wrote one; else the table shipped with
    the package, scaled to this machine by :func:`probe_speed` (once per process; the
    environment variable ``POLYNETS_HE_SPEED`` fixes the factor instead, ``1`` for the table
    as shipped)."""
    path = cache_path()
    for candidate in (path, _SHIPPED):
        key = str(candidate)
        if key in _CACHE:
            return _CACHE[key]
        try:
            d = json.loads(Path(candidate).read_text())
            model = CostModel.from_dict(d)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if candidate == _SHIPPED:
            model = _to_this_machine(model)
        elif d.get("operands_timed") != OPERANDS_TIMED:
            warnings.warn(f"{candidate}: a cost table whose primitives were timed from the "
                          f"caches, on one operand set (an earlier version's calibration), "
                          f"which prices servers' primitives 1.1-1.7x below what they take; "
                          f"'polynets he-costs' measures them again", stacklevel=2)
        _CACHE[key] = model
        return model
    raise FileNotFoundError(f"no CKKS cost table: the package's {_SHIPPED} is missing")


def _to_this_machine(model: CostModel) -> CostModel:
    """The shipped table scaled by :envvar:`POLYNETS_HE_SPEED` or :func:`probe_speed`."""
    fixed = os.environ.get(SPEED_ENV)
    if fixed is not None:
        factor = _number(fixed)
        if not _is_speed(factor):
            raise ValueError(f"{SPEED_ENV}={fixed!r}: expected a positive number (1: the "
                             f"shipped table as it is)")
        if factor == 1.0:
            return model
        return model.scaled(factor, f"scaled x{factor:.3g} by {SPEED_ENV}")
    factor, ratios = probe_speed(model)
    if not ratios:
        return model
    return model.scaled(factor, f"scaled x{factor:.2f} to this machine by a probe of its "
                                f"primitives at N={PROBE_RING} ({min(ratios.values()):.2f}-"
                                f"{max(ratios.values()):.2f}x the table's) at "
                                f"{time.strftime('%Y-%m-%d %H:%M')}")
