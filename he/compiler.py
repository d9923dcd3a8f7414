"""``he.compile``: trace, certify, calibrate, choose parameters and plan a packing.

A :class:`CompiledProgram` is everything a client and a server agree on: the polynomial program,
the CKKS parameters, the packing and its plan, and the calibrated range of every value. It
serialises to bytes (the program's own safetensors format plus a JSON header; no pickle) and loads
back with the same fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import json
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
from tqdm.auto import tqdm

from he.backend import build_context
from he.container import pack, unpack
from he.costmodel import SHARED_ROTATION_HANDOFFS, CostModel, default_model
from he.native import default_threads, native_platform
from he.errors import (InputShapeError, MemoryBudgetWarning, NotEncryptableError,
                       SerializationError, TooDeepError, batch_of)
from he.noise import noise_gain, step_values_msq
from he.params import (RING_DEGREES, ROTATION_BITS, SECURITY_LEVELS, CKKSParams, check_products,
                       choose_params, error_target, fitting_precision, most_levels,
                       read_levels, wide_variant)
from he.hoist import expected as hoist_expected
from he.plan import (MAX_PLANES, BatchPlan, VectorPlan, batch_counts, batch_lifts,
                     build_vector_plan, choose_fanin, choose_lazy, choose_plane_packing, key_basis,
                     lazy_candidates, next_pow2, padded_layouts_fit, planes_readers, rotation_path,
                     search_layouts, widest_period)
from he.split import MAX_BLOCKS, SPLIT_AXES, Split, split_lowered
from he.tokens import (TokenPlan, TokensNotApplicable, build_token_plan, chosen_giants,
                       peak_ciphertexts, plaintexts_held, token_grid, token_paddings,
                       token_step_counts)
from he.runtime import PLAIN_CACHE_BYTES, available_memory, live_rows
from he.tiling import (Segment, allocations, buffer_bytes, choose_tiles, find_segments,
                       row_bytes_of, spills)
from he.wire import ciphertext_bytes
from polynets._io import atomic_write_bytes, read_bytes_limited
from polynets.errors import ProgramFormatError, TraceError, check_int
from polynets.ir.lowering import (CLIENT_FIRST_PACKINGS, CLIENT_MAP_PACKINGS, Lowered,
                                  affine_is_free, client_variants, lower, step_levels)
from polynets.ir.program import PolyProgram

__all__ = ["CompiledProgram", "compile", "load_program", "PACKINGS", "OBJECTIVES", "FINAL_MAPS",
           "FIRST_MAPS", "argmax_precision", "ARGMAX_QUANTILE"]

#: Packings a compiled program can have; ``compile`` also takes ``"auto"``.
PACKINGS = ("vector", "batch", "tokens")
OBJECTIVES = ("latency", "throughput")
#: who applies a program's last affine map (:func:`compile`'s ``final_map``)
FINAL_MAPS = ("auto", "server", "client")
#: who applies a program's first affine maps, those of the input alone (:func:`compile`'s
#: ``first_map``; the packings where the client may apply these maps or the last:
#: :data:`polynets.ir.lowering.CLIENT_MAP_PACKINGS` and ``CLIENT_FIRST_PACKINGS``)
FIRST_MAPS = ("auto", "server", "client")
_OBJECTIVE_WORDS = {"latency": "round trip", "throughput": "seconds per sample"}


def _program_digest(program: PolyProgram) -> str:
    h = hashlib.sha256()
    for node in program.nodes:
        h.update(json.dumps([node.op, list(node.inputs), list(node.shape)]).encode())
        for key in sorted(node.attrs):
            v = node.attrs[key]
            h.update(key.encode())
            if isinstance(v, np.ndarray):
                h.update(str(v.dtype).encode() + str(v.shape).encode())
                h.update(np.ascontiguousarray(v).tobytes())
            else:
                h.update(repr(v).encode())
    h.update(str(program.output).encode())
    return h.hexdigest()


#: Calibration samples the noise analysis reads (per-element mean squares of every step).
_NOISE_SAMPLES = 1024
#: ``precision_bits="argmax"``: the promised error stays below half the gap between the two
#: largest outputs of all but this fraction of the calibration samples
ARGMAX_QUANTILE = 0.01
#: the fewest calibration samples whose outputs the argmax rule accepts (it reads them all)
ARGMAX_MIN_SAMPLES = 20


def argmax_precision(outputs: Any, output_abs: float, quantile: float = ARGMAX_QUANTILE
                     ) -> tuple[int, str]:
    """Bits of output precision a classifier read by its argmax needs, from its outputs on the
    calibration data, and the reason.

    The error promised at ``b`` bits is at most ``max|output| * 2^-b``
    (:func:`he.params.choose_params`); the class of a sample survives any error below half the
    gap between its two largest outputs. ``b`` is the fewest bits (1 to 40) that keep that
    promise below half the gap of all but ``quantile`` of the samples: the samples closer to a
    tie than that are ones the plaintext model itself barely separates.

    Raises:
        NotEncryptableError: the output is not one vector of at least two scores per sample,
            fewer than :data:`ARGMAX_MIN_SAMPLES` samples are given, or every one is a tie.
    """
    out = np.asarray(outputs, dtype=np.float64)
    if out.ndim != 2 or out.shape[1] < 2:
        raise NotEncryptableError(
            f"precision_bits='argmax' needs an output of shape (B, classes) with at least two "
            f"classes, got {tuple(out.shape)}; give precision_bits as a number of bits")
    if out.shape[0] < ARGMAX_MIN_SAMPLES:
        raise NotEncryptableError(
            f"precision_bits='argmax' reads the gaps between the two largest outputs of the "
            f"calibration samples: give calibration= at least {ARGMAX_MIN_SAMPLES} samples "
            f"(got {out.shape[0]}), or precision_bits as a number of bits")
    top = np.sort(out, axis=1)[:, -2:]
    gaps = top[:, 1] - top[:, 0]
    positive = gaps[gaps > 0]
    if positive.size == 0:
        raise NotEncryptableError("precision_bits='argmax': every calibration sample has tied "
                                  "top outputs; give precision_bits as a number of bits")
    gap = float(np.quantile(positive, quantile))
    scale = error_target(output_abs, 0)
    bits = int(min(40, max(1, math.ceil(math.log2(scale / (gap / 2))))))
    why = (f"precision_bits='argmax': {bits} bits, so the promised error (at most "
           f"{error_target(output_abs, bits):.3g}) stays below half the gap between the two "
           f"largest outputs ({gap:.3g}) of {100 * (1 - quantile):.0f}% of the {out.shape[0]} "
           f"calibration samples")
    return bits, why


def program_degree_depth(program: PolyProgram) -> tuple[int, int]:
    from polynets.ir.certify import degree_depth

    return degree_depth(program)


def _server_budget(memory_budget: int | None) -> int:
    """Bytes a server may use: ``memory_budget`` where given, else the memory available here
    now."""
    return available_memory() if memory_budget is None else int(memory_budget)


def _server_memory(params: CKKSParams, plaintexts: list[tuple[int, int]], galois_keys: int,
                   slots_ciphertexts: int = 0, special_rows: int = 0) -> int:
    """Bytes the server holds: encoded plaintexts (``(count, level)`` pairs; ``special_rows``
    of them extended by the special prime's row, :mod:`he.hoist`), relinearisation and Galois
    keys (a hoisted step's key counts twice: :class:`he.hoist.Hoister` keeps a permuted copy),
    and ``slots_ciphertexts`` live ciphertexts at the top level."""
    n = params.poly_modulus_degree
    top = params.data_primes
    plain = sum(count * n * params.limbs(lv) * 8 for count, lv in plaintexts) \
        + special_rows * n * 8
    key = 2 * n * (top + 1) * top * 8
    return int(plain + key * (1 + galois_keys) + slots_ciphertexts * 2 * n * top * 8)


#: op_counts entries that are not primitives: plaintexts held, and the work among the
#: primitives that the server spreads over its threads (baby and giant steps, the giant steps'
#: products; :meth:`he.plan.VectorPlan.op_counts`)
_NOT_PRIMITIVES = ("plaintexts", "plaintexts_ext", "alone", "babies", "giants", "baby_items",
                   "giant_items", "giant_products", "giant_zero", "giant_zero_products",
                   "fold_groups", "fold_copies")


def client_threads() -> int:
    """Threads a client on this machine encrypts a request's ciphertexts on (:class:`he.Client`
    's default: every core, where SEAL's encryption can be called without the GIL), which the
    predictions of a round trip assume."""
    return default_threads() if native_platform() else 1


def _threads(options: dict[str, Any]) -> int:
    """Server threads a compiled program's predictions assume (programs saved before the
    option: one)."""
    return int(options.get("server_threads", 1))


#: Threads serve a vector plan only where the cost model predicts them this much faster than one
#: (the Python work between SEAL calls, which threads contend for, is not priced)
MIN_THREAD_GAIN = 1.1


def _chosen_threads(threads: int, serial: dict[str, Any], on: Callable[[int], dict[str, Any]],
                    what: str) -> tuple[int, str, dict[str, Any]]:
    """The server threads a plan runs on, why, and the prediction on them: ``threads`` where
    the cost model predicts them (``on(threads)``) at least :data:`MIN_THREAD_GAIN` times as
    fast as one thread (``serial``), else one."""
    if threads <= 1:
        return 1, "one server thread (as asked)", serial
    predicted = on(threads)
    gain = serial["seconds_per_ciphertext"] / max(predicted["seconds_per_ciphertext"], 1e-12)
    if gain < MIN_THREAD_GAIN:
        return 1, (f"one server thread: {threads} would be predicted only {gain:.2f}x as fast "
                   f"(below {MIN_THREAD_GAIN}x; only {what} run on several threads, and the "
                   f"Python work between SEAL calls does not)"), serial
    return threads, (f"{threads} server threads for {what}, predicted {gain:.2f}x as fast as "
                     f"one"), predicted


def _makespan(items: Sequence[float], threads: int, efficiency: float,
              handoff: float = 0.0) -> float:
    """Seconds ``items`` (each its seconds on one thread alone) take on ``threads`` threads,
    each thread taking the next item as it frees, longest first; while several run at once
    each runs ``1/efficiency`` times as long (they share the cores and the memory), while one
    runs alone it runs at full speed. Handing several items to the threads and waiting for
    them costs ``handoff`` seconds once (:meth:`he.costmodel.CostModel.map_handoff`)."""
    left = sorted((float(t) for t in items if t > 0), reverse=True)
    running: list[float] = []           # work left of the items running
    clock = handoff if threads > 1 and len(left) > 1 else 0.0
    while left or running:
        while left and len(running) < threads:
            running.append(left.pop(0))
        rate = 1.0 if len(running) == 1 else efficiency
        step = min(running)
        clock += step / rate
        running = [w - step for w in running if w - step > 1e-15]
    return clock


def _threaded_seconds(c: dict[str, int], price: Any, threads: int, efficiency: float,
                      handoff: float = 0.0) -> float:
    """Seconds of one vector step whose baby-step rotations, then giant steps, are spread over
    ``threads`` threads (:func:`he.runtime._affine`). A giant step sums its plaintext products
    then rotates the sum, so its products and their additions run on the threads with its
    rotation (``giant_items`` steps, ``giant_products`` products; ``giant_zero`` of them, with
    ``giant_zero_products`` products, rotate nothing, so the threads may wait on the others).
    Where the plan shares rotations (``alone`` in the counts: its folds among the
    rotations), each fold's key switching, a single giant step's work and a single input's
    decomposition are shared among the threads: each takes its share of the work plus
    ``handoff`` seconds (:meth:`he.costmodel.CostModel.shared_handoff`); each phase spread
    over the threads costs a hand-off of its own, ``handoff /``
    :data:`~he.costmodel.SHARED_ROTATION_HANDOFFS`.
    Hoisted baby steps (``rotate_hoisted`` of the ``baby_items``) follow their inputs'
    decompositions (``decompose``, spread too), and their giant steps' extended products
    (``mul_ext``) and divisions (``mod_down``) run with the giant steps. Each phase takes what
    :func:`_makespan` gives its items at ``efficiency``; the rest of the step (the folds, the
    rescale) runs in one thread. Counts without ``giant_items`` (saved before it) spread the
    giant rotations alone, without ``giant_zero`` the products evenly."""
    serial = price({k: v for k, v in c.items() if k not in _NOT_PRIMITIVES})
    babies, giants = c.get("babies", 0), c.get("giants", 0)
    items, products = c.get("giant_items", giants), c.get("giant_products", 0)
    baby_items = c.get("baby_items", babies)
    alone = c.get("alone", 0)
    shares = "alone" in c

    def apart(seconds: float) -> list[float]:
        """Work that runs alone, on the threads where the plan shares it: one item, which
        :func:`_makespan` runs at full speed, of its share of the work and the hand-offs."""
        return [seconds / threads + handoff if shares and threads > 1 else seconds]

    if alone:
        # folds hoisted one by one, each key switching's stages shared among the threads
        # (he.backend.Engine.rotate_alone)
        lone = apart(price({"decompose": 1, "rotate_hoisted": 1, "mod_down": 1}))[0]
        serial -= alone * (price({"rotate": 1}) - lone)
    groups, copies = c.get("fold_groups", 0), c.get("fold_copies", 0)
    if groups:
        # hoisted folds (he.runtime._fold): per group a decomposition and a division, shared
        # among the threads where the step's work that runs alone is, and its rotated copies
        # spread over them
        per = copies / groups
        if shares and threads > 1:
            serial += groups * (apart(price({"decompose": 1}))[0]
                                + apart(price({"mod_down": 1}))[0]
                                + _makespan([price({"rotate_hoisted": 1})] * int(round(per)),
                                            threads, efficiency,
                                            handoff / SHARED_ROTATION_HANDOFFS))
        else:
            serial += price({"decompose": groups, "mod_down": groups,
                             "rotate_hoisted": copies})
    if threads <= 1 or baby_items + items == 0:
        return serial
    lifted, ext = c.get("rotate_hoisted", 0), c.get("mul_ext", 0)
    zero, zero_products = c.get("giant_zero", 0), c.get("giant_zero_products", 0)
    if zero >= items:
        zero, zero_products = 0, 0
    rot_items = items - zero

    def sums(n_products: float) -> float:
        """One giant step's products and the additions that sum them, extended products in
        proportion to their share."""
        share = ext / products if products else 0.0
        counts = {"mul_plain": n_products * (1 - share), "mul_ext": n_products * share,
                  "add": max(0.0, n_products * (1 - share) - 1)}
        return price({k: v for k, v in counts.items() if v})

    n_decompose, n_divide = c.get("decompose", 0), c.get("mod_down", 0)
    decompose = [price({"decompose": 1})] * n_decompose if n_decompose else []
    plain_babies = baby_items - lifted
    baby = [price({"rotate_hoisted": 1})] * lifted if lifted else []
    if plain_babies:
        baby += [price({"rotate": babies / plain_babies})] * plain_babies
    divide = price({"mod_down": n_divide / items}) if items and n_divide else 0.0
    giant = []
    if rot_items:
        giant += [sums((products - zero_products) / rot_items) + divide +
                  price({"rotate": giants / rot_items})] * rot_items
    if zero:
        giant += [sums(zero_products / zero) + divide] * zero
    # the serial price counts every product and addition once: what the items hold comes out
    spread = sum(decompose) + sum(baby) + sum(giant)
    # one input's decomposition, and a single giant step, share their work among the threads
    # where the plan shares work that runs alone (he.runtime._affine)
    if len(decompose) == 1:
        decompose = apart(decompose[0])
    if len(giant) == 1:
        giant = apart(giant[0])
    per_map = handoff / SHARED_ROTATION_HANDOFFS
    return serial - spread + sum(_makespan(items, threads, efficiency, per_map)
                                 for items in (decompose, baby, giant))


def wire_bytes(params: CKKSParams, level: int, ciphertexts: int, polys: int) -> int:
    """Bytes ``ciphertexts`` ciphertexts of ``polys`` polynomials at ``level`` take serialised
    (:func:`he.wire.ciphertext_bytes`): a client's fresh encryption is one polynomial and a
    seed (the other is regenerated from it); a server's result is two."""
    bits = params.coeff_mod_bit_sizes[:params.limbs(level)]
    return int(ciphertexts) * ciphertext_bytes(params.poly_modulus_degree, bits, polys)


def _vector_held(plan: VectorPlan, counts: list[dict[str, int]]) -> int:
    """Ciphertexts a vector server holds at its peak: a value per step (an upper bound: values
    are freed once read) and, while the widest map runs, its baby-step rotations and its giant
    steps' results, which :func:`he.runtime._affine` keeps until it sums them (a hoisted input's
    decomposition as ``(L + 1) / 2`` ciphertexts, ``L`` the primes at the top level)."""
    half = (plan.levels + 2) / 2
    inner = max((c.get("babies", 0) + c.get("rotate_hoisted", 0) + c.get("decompose", 0) * half
                 + c.get("giant_items", c.get("giants", 0)) for c in counts), default=0)
    # a hoisted fold's rotated copies (extended: a prime more) and its decomposition
    inner = max([inner] + [c["fold_copies"] / c["fold_groups"] + 1 + half
                           for c in counts if c.get("fold_groups")])
    return len(plan.steps) + int(math.ceil(inner))


def _predict_vector(plan: VectorPlan, params: CKKSParams, costs: CostModel,
                    threads: int = 1) -> dict[str, Any]:
    counts = plan.op_counts()
    ring = params.poly_modulus_degree
    plaintexts: list[tuple[int, int]] = []
    early = set(plan.concurrent_planes())
    # per step: its work on the server's threads and the lifts of its inputs (values lifted
    # to a higher level, on the server's main thread before the step)
    lifts = plan.lifts()
    steps = [0.0] * len(counts)
    for si, (c, moves) in enumerate(zip(counts, lifts)):
        lin = plan.runs_at(si)
        steps[si] = _threaded_seconds(
            c, lambda cs, limbs=params.limbs(lin): costs.price(cs, ring, limbs), threads,
            costs.parallel_efficiency(ring), costs.shared_handoff(ring) or 0.0) + sum(
            costs.seconds(op, ring, limbs) for a, b in moves
            for op, limbs in params.lift_primitives(a, b))
        plaintexts.append((c["plaintexts"], lin))
    # the planes steps all at once on the server's threads (he.runtime.run_vector)
    at_once = _makespan([steps[si] for si in sorted(early)], threads,
                        costs.parallel_efficiency(ring), costs.map_handoff(ring))
    total = {k: sum(c.get(k, 0) for c in counts) for k in {k for c in counts for k in c}}
    total["lift"] = sum(len(moves) for moves in lifts)
    # the server deserialises each input ciphertext before anything else
    total["load"] = len(plan.input_layout)
    loads = total["load"] * costs.seconds("load", ring, params.limbs(0))
    seconds = loads + at_once + sum(t for si, t in enumerate(steps) if si not in early)
    k = plan.interleave
    client = costs.client_seconds(len(plan.input_layout), ring, params.limbs(0), client_threads())
    returned = plan.returned_levels(params.pending)
    decrypt = _decrypt_seconds(costs, params, returned)
    # the results switched down to the primes they travel on and serialised (about a load)
    back = sum(costs.seconds(op, ring, limbs)
               for j, to in zip(plan.results, returned)
               for op, limbs in params.switch_primitives(plan.steps[j].level, to)) + \
        sum(costs.seconds("load", ring, params.limbs(to)) for to in returned)
    seconds += back
    return {"seconds_per_ciphertext": seconds, "client_seconds": client,
            "client_decrypt_seconds": decrypt,
            "round_trip_seconds": seconds + client + decrypt, "samples_per_ciphertext": k,
            "seconds_per_sample": (seconds + client + decrypt) / k, "counts": total,
            "upload_bytes": wire_bytes(params, 0, len(plan.input_layout), 1),
            "download_bytes": sum(wire_bytes(params, lv, 1, 2) for lv in returned),
            "server_threads": threads,
            # what he.Server.profile sets beside its measurements
            "step_seconds": steps, "planes_at_once_seconds": at_once, "load_seconds": loads,
            "return_seconds": back,
            "server_memory_bytes": _server_memory(
                params, plaintexts, len(plan.galois_steps()) + len(plan.hoisted_steps()),
                _vector_held(plan, counts), total.get("plaintexts_ext", 0))}


def _decrypt_seconds(costs: CostModel, params: CKKSParams, returned: Sequence[int]) -> float:
    """The client's decryptions of results on the primes of the levels ``returned`` (one per
    ciphertext): each read from its bytes (a load), a product by the key and a decoding
    (about a plaintext product and an encoding)."""
    ring = params.poly_modulus_degree
    return sum(costs.seconds(op, ring, params.limbs(lv))
               for lv in returned for op in ("load", "mul_plain", "encode"))


def _return_seconds(costs: CostModel, params: CKKSParams, levels: Sequence[int],
                    returned: Sequence[int]) -> float:
    """The server's work on its results: each switched from its level (``levels``) down to
    the primes of the one it travels on (``returned``,
    :meth:`he.params.CKKSParams.switch_primitives`), then written to bytes (about a load).
    Priced for batch groups, which may return thousands; a vector program's prediction is the
    sum of its steps' (:meth:`he.Server.profile`), its one to few results left out."""
    ring = params.poly_modulus_degree
    return sum(costs.seconds(op, ring, limbs) for lv, to in zip(levels, returned)
               for op, limbs in [*params.switch_primitives(lv, to), ("load", params.limbs(to))])


def _batch_returned(lowered: Lowered, live: list[np.ndarray], params: CKKSParams
                    ) -> tuple[list[int], list[int], dict[int, int]]:
    """``(levels, returned, additions)``: per ciphertext a batch group returns, the level it
    is computed at and the one it travels on (:func:`he.params.returned_level`), and by level
    the additions of the server's sums for the client's map
    (:attr:`polynets.ir.lowering.ClientMap.sums`)."""
    levels = step_levels(lowered.steps, "batch")
    post = lowered.post
    if post is None:
        n = int(live[lowered.output].sum())
        return [levels[lowered.output]] * n, [levels[lowered.output]] * n, {}
    assert post.sums is not None
    at: list[int] = []
    out: list[int] = []
    adds: dict[int, int] = {}
    for s, (lv, to) in zip(post.sums, read_levels(post.reads, levels, params.pending)):
        at += [lv] * s.shape[0]
        out += [to] * s.shape[0]
        adds[lv] = adds.get(lv, 0) + int(s.nnz) - s.shape[0]
    return at, out, adds


def _level_moduli(params: CKKSParams) -> list[list[int]]:
    """Stand-ins for the primes of every level (their sizes are what the fused maps' digits
    depend on)."""
    bits = params.coeff_mod_bit_sizes[:-1]
    return [[2 ** b - 1 for b in bits[:params.limbs(lv)]] for lv in range(params.levels + 1)]


def _batch_fanin(lowered: Lowered, live: list[np.ndarray], params: CKKSParams,
                 costs: CostModel) -> list[int]:
    """Per step, the fan-in from which batch packing fuses rows, chosen by the cost model."""
    ring = params.poly_modulus_degree
    return choose_fanin(lowered, live, _level_moduli(params), params.scale,
                        lambda counts, level: costs.price(counts, ring, params.limbs(level)))


def _batch_lazy(lowered: Lowered, live: list[np.ndarray], params: CKKSParams,
                costs: CostModel, fanin: list[int]) -> list[int]:
    """The product steps batch packing leaves unrelinearised and unrescaled, chosen by the cost
    model (:func:`he.plan.choose_lazy`)."""
    ring = params.poly_modulus_degree
    return choose_lazy(lowered, live, _level_moduli(params), params.scale, fanin,
                       lambda counts, level: costs.price(counts, ring, params.limbs(level)))


#: Batch packing's primitives that a server spreads over its threads: ciphertext products with
#: their relinearisations, and rescales (:func:`he.runtime._threaded`), and the fused maps'
#: compiled loops and products (:meth:`he.fused.FusedMap.apply`); the rest run in one thread
_BATCH_THREADED = ("mul_ct", "mul_lazy", "rescale", "fused_mac", "fused_in", "fused_out")


class GroupMemory(NamedTuple):
    """What one batch group holds (:func:`batch_group_memory`): ``tiles`` per segment end (empty:
    the group runs whole), ``working`` bytes with them (its ``buffers``) and ``untiled`` bytes
    without (every product finished; both with the encoded weights' cache), and ``lazy``, the
    product steps left unrelinearised (those asked for where the group fits with them, else
    none)."""

    tiles: dict[int, int]
    untiled: float
    lazy: tuple[int, ...]
    #: the ciphertext buffers it allocates (:func:`he.tiling.allocations`: bytes -> how many)
    buffers: dict[float, int]
    #: the inputs are loaded tile by tile (:attr:`he.tiling.Segment.load`): a server that owns
    #: them validates every one first and loads each again in the tile that first reads it
    loads: bool = False
    #: rows written to disk and read back between the tiles that read them
    #: (:func:`he.tiling.spills`), where the tiles alone do not fit: ``(step, how many times)``
    spills: tuple[tuple[int, int], ...] = ()

    @property
    def working(self) -> float:
        return buffer_bytes(self.buffers) + PLAIN_CACHE_BYTES


def batch_group_memory(lowered: Lowered, live: list[np.ndarray], params: CKKSParams,
                       budget: float | None, segments: list[Segment] | None = None,
                       keep_inputs: bool = False, lazy: Sequence[int] = (),
                       lazy_in_tiles: bool = False) -> GroupMemory:
    """Tiles per segment (:mod:`he.tiling`) that keep one batch group within ``budget`` bytes
    of free memory (None: no limit, no tiles), and the group's working memory (ciphertexts at
    their peak and the encoded weights' cache) with them and without. ``keep_inputs``: the
    group's input ciphertexts are the caller's and live to the end (a server frees those it
    loaded from bytes once read). ``lazy``: product steps to leave unrelinearised (larger
    ciphertexts), kept where the group fits with them: whole, else in tiles that need no spill
    where it does not fit whole with every product finished either, or where
    ``lazy_in_tiles`` (the compiler's choice, ``program.options["lazy_in_tiles"]``: the cost
    model prices lazy products in tiles below finished ones in a whole group). Otherwise every
    product is finished. Where no number of tiles fits, the tiles also spill the rows they hold for
    later tiles to disk (:func:`he.tiling.spills`), the fewest tiles that fit so (each spill
    costs a write and a read). The one rule for the compiler's prediction and a server's
    choice."""
    room = float("inf") if budget is None else float(budget) - PLAIN_CACHE_BYTES
    ring = params.poly_modulus_degree
    lazy = tuple(int(m) for m in lazy)
    lazy_bytes = row_bytes_of(lowered, ring, params.limbs, lazy)
    if lazy:
        made = allocations(lowered, live, lazy_bytes, keep_inputs=keep_inputs)
        whole = buffer_bytes(made)
        if whole <= room:
            return GroupMemory({}, whole + PLAIN_CACHE_BYTES, lazy, made)
    row_bytes = row_bytes_of(lowered, ring, params.limbs)
    made = allocations(lowered, live, row_bytes, keep_inputs=keep_inputs)
    whole = buffer_bytes(made)
    untiled = whole + PLAIN_CACHE_BYTES
    if whole <= room and not (lazy and lazy_in_tiles):    # whole: no segments to look for
        return GroupMemory({}, untiled, (), made)
    whole_made = made
    if segments is None:
        # the cuts by the finished products' sizes: the same segments for either tiling
        segments = find_segments(lowered, live, row_bytes, keep_inputs)

    def loads(tiles: dict[int, int]) -> bool:
        return not keep_inputs and any(seg.load is not None and tiles.get(seg.end, 1) > 1
                                       for seg in segments)

    if lazy and segments:
        tiles = choose_tiles(lowered, live, lazy_bytes, segments, room, keep_inputs)
        made = allocations(lowered, live, lazy_bytes, segments, tiles, keep_inputs)
        if buffer_bytes(made) <= room:
            return GroupMemory({e: k for e, k in tiles.items() if k > 1}, untiled, lazy, made,
                               loads(tiles))
    if whole <= room:
        return GroupMemory({}, untiled, (), whole_made)
    tiles = choose_tiles(lowered, live, row_bytes, segments, room, keep_inputs) \
        if segments else {}
    made = allocations(lowered, live, row_bytes, segments, tiles, keep_inputs)
    spilled: dict[int, int] = {}
    if segments and buffer_bytes(made) > room:
        on_disk = choose_tiles(lowered, live, row_bytes, segments, room, keep_inputs, True)
        with_spill = allocations(lowered, live, row_bytes, segments, on_disk, keep_inputs, True)
        if buffer_bytes(with_spill) < buffer_bytes(made):
            tiles, made = on_disk, with_spill
            for seg in segments:
                if tiles.get(seg.end, 1) > 1:
                    for s, v in spills(lowered, seg, tiles[seg.end]).items():
                        if v[0].size:
                            spilled[s] = spilled.get(s, 0) + int(v[0].size)
    return GroupMemory({e: k for e, k in tiles.items() if k > 1}, untiled, (), made,
                       loads(tiles), tuple(sorted(spilled.items())))


def _predict_batch(lowered: Lowered, live: list[np.ndarray], params: CKKSParams,
                   costs: CostModel, fanin: list[int], threads: int = 1,
                   budget: float | None = None, lazy: Sequence[int] = (),
                   lazy_in_tiles: bool = False) -> dict[str, Any]:
    """Predicted time, work and memory of one batch group; ``lazy`` products are left
    unrelinearised only where the group fits ``budget`` with them (as a server does,
    :func:`batch_group_memory`)."""
    # ciphertexts held at once, in tiles where the whole group would not fit the budget
    mem = batch_group_memory(lowered, live, params, budget, lazy=lazy,
                             lazy_in_tiles=lazy_in_tiles)
    counts = batch_counts(lowered, live, _level_moduli(params), params.scale, fanin, mem.lazy)
    levels = step_levels(lowered.steps, "batch")
    ring = params.poly_modulus_degree
    # products, rescales and fused maps on several threads run at their measured efficiency
    speedup = threads * costs.batch_efficiency(ring) if threads > 1 else 1.0
    seconds = 0.0
    for st, c in zip(lowered.steps, counts):
        lin = max((levels[j] for j in st.inputs), default=0)
        par = {k: v for k, v in c.items() if k in _BATCH_THREADED}
        rest = {k: v for k, v in c.items() if k not in _BATCH_THREADED}
        seconds += costs.price(rest, ring, params.limbs(lin)) + \
            costs.price(par, ring, params.limbs(lin)) / speedup
    # the inputs of steps of sums lifted to the step's level first, on the server's threads
    # (he.runtime._affine_batch)
    for si, lifts in enumerate(batch_lifts(lowered, live, mem.lazy)):
        level = max((levels[j] for j in lowered.steps[si].inputs), default=0)
        for lv, n in lifts.items():
            for op, limbs in params.lift_primitives(lv, level):
                counts[si][op] = counts[si].get(op, 0) + n
                seconds += n * costs.seconds(op, ring, limbs) / speedup
    tiles, working, untiled = mem.tiles, mem.working, mem.untiled
    total = {k: sum(c.get(k, 0) for c in counts) for k in {k for c in counts for k in c}}
    # the server loads each input ciphertext on its threads (he.runtime._load_inputs): all
    # before anything else, or each where a tile first reads it, every one checked first then
    total["load"] = int(live[0].sum())
    total["check"] = total["load"] if mem.loads else 0
    seconds += (total["load"] * costs.seconds("load", ring, params.limbs(0))
                + total["check"] * costs.seconds("check", ring, params.limbs(0))) / speedup
    # a row spilled is written out and read back, checksummed each way, at its level's size
    total["spill"] = sum(n for _, n in mem.spills)
    seconds += sum(n * costs.seconds("spill", ring, params.limbs(levels[s])) for s, n in mem.spills)
    # the sums returned for the client's map (additions on the server's main thread), and the
    # client's decryptions of what comes back
    at, returned, adds = _batch_returned(lowered, live, params)
    for lv, n in adds.items():
        total["add"] = total.get("add", 0) + n
        seconds += n * costs.seconds("add", ring, params.limbs(lv))
    seconds += _return_seconds(costs, params, at, returned)
    decrypt = _decrypt_seconds(costs, params, returned)
    client = costs.client_seconds(int(live[0].sum()), ring, params.limbs(0), client_threads())
    return {"seconds_per_ciphertext": seconds, "client_seconds": client,
            "client_decrypt_seconds": decrypt,
            "round_trip_seconds": seconds + client + decrypt,
            "samples_per_ciphertext": params.slots,
            "seconds_per_sample": (seconds + client + decrypt) / params.slots, "counts": total,
            "upload_bytes": wire_bytes(params, 0, int(live[0].sum()), 1),
            "download_bytes": sum(wire_bytes(params, lv, 1, 2) for lv in returned),
            "server_threads": threads,
            "server_memory_bytes": _server_memory(params, [], 0) + working,
            # what evaluating one group adds to a server whose keys are loaded
            "working_memory_bytes": working, "untiled_memory_bytes": untiled,
            "tiles": {str(e): k for e, k in tiles.items()},
            "spills": {str(s): n for s, n in mem.spills},
            "lazy_products": list(mem.lazy)}


def _stored_lowering(program: PolyProgram, split: Any, keep: Any = (),
                     client: Any = False, packing: str = "vector", first: Any = False
                     ) -> Lowered:
    """The lowered program a stored plan runs on: the program's own (with the nodes ``keep``
    kept apart, see :func:`polynets.ir.lowering.lower`; with its last map applied by the
    client where ``client``, :func:`polynets.ir.lowering.client_map`; with its first maps
    applied by the client where ``first``, :func:`polynets.ir.lowering.client_first`), or its
    values split over several ciphertexts as ``split`` (``{"slots": int, "axis": int}``,
    checked) says."""
    if not isinstance(keep, (list, tuple)) or any(type(k) is not int for k in keep):
        raise ValueError(f"kept_apart must be a list of node indices, got {keep!r}")
    for name, on in (("client_map", client), ("client_first", first)):
        if type(on) is not bool:
            raise ValueError(f"{name} must be true or false, got {on!r}")
    lowered = lower(program, keep)
    variants = client_variants(lowered, packing, {(client, first)})
    for name, on, key, packings, missing in (
            ("client_map", client, (True, False), CLIENT_MAP_PACKINGS,
             "does not end with a map the client can apply"),
            ("client_first", first, (client, True), CLIENT_FIRST_PACKINGS,
             "has no first map the client can apply")):
        if on and key not in variants:
            raise ValueError(f"{name}: " + (f"this program {missing}" if packing in packings
                                            else f"only {' and '.join(packings)} packing has "
                                                 f"the client apply that map"))
    lowered = variants[client, first][0]
    if split is None:
        return lowered
    sizes = sorted({r // d for r in RING_DEGREES for d in (2, 4)})   # slots, or half of them
    if not isinstance(split, dict) or set(split) != {"slots", "axis"} or \
            any(type(v) is not int for v in split.values()) or split["axis"] not in SPLIT_AXES \
            or split["slots"] not in sizes:
        raise ValueError(f"split must be {{'slots': one of {sizes}, 'axis': one of "
                         f"{list(SPLIT_AXES)}}}, got {split!r}")
    done = split_lowered(lowered, split["slots"], split["axis"])
    if done is None:
        raise ValueError(f"split {split!r} does not apply to this program")
    return done.lowered


class CompiledProgram:
    """A polynomial program compiled for CKKS: parameters, packing plan, calibrated ranges.

    Attributes:
        program: the :class:`~polynets.ir.program.PolyProgram` (float64 weights).
        params: the chosen :class:`~he.params.CKKSParams` (``str(params)`` says why).
        packing: ``"vector"`` (``plan.interleave`` samples per ciphertext, interleaved) or
            ``"batch"`` (one sample per slot).
        calibration: per-node max |value| on the calibration data.
        degree, depth: total degree and ciphertext-ciphertext multiplicative depth.
        lowered: the program's CKKS steps (:func:`polynets.ir.lowering.lower`).
        plan: the lowering chosen -- a :class:`~he.plan.VectorPlan` (layouts, rotations,
            samples per ciphertext) or a :class:`~he.plan.BatchPlan` -- with op counts, the cost
            model's predicted time per ciphertext and per sample, the server's memory and why
            it was chosen (``plan.predicted``, ``plan.why``).
    """

    def __init__(self, program: PolyProgram, params: CKKSParams, packing: str,
                 calibration: list[float], options: dict[str, Any], certificate: str = "",
                 *, _lowered: Lowered | None = None, _plan: VectorPlan | None = None,
                 _degree_depth: tuple[int, int] | None = None):
        self.program = program
        self.params = params
        self.packing = packing
        self.calibration = [float(c) for c in calibration]
        self.options = dict(options)
        threads = self.options.get("server_threads", 1)
        if type(threads) is not int or threads < 1:
            raise ValueError(f"server_threads must be a positive int, got {threads!r}")
        one = self.options.get("predicted_one_thread_s")
        if one is not None and (type(one) not in (int, float) or not math.isfinite(one)
                                or one <= 0):
            raise ValueError(f"predicted_one_thread_s must be a positive number of seconds, got "
                             f"{one!r}")
        budget = self.options.get("memory_budget")
        if budget is not None and (type(budget) is not int or budget < 0):
            raise ValueError(f"memory_budget must be a non-negative int, got {budget!r}")
        self.certificate = certificate
        self.degree, self.depth = _degree_depth if _degree_depth is not None else \
            program_degree_depth(program)
        self.lowered = _lowered if _lowered is not None else _stored_lowering(
            program, self.options.get("split"), self.options.get("kept_apart", []),
            self.options.get("client_map", False), packing,
            self.options.get("client_first", False))
        self.plan: VectorPlan | BatchPlan | TokenPlan
        if _plan is not None:
            self.plan = _plan
        elif packing == "tokens":
            self.plan = _stored_token_plan(self.lowered, params.slots, self.options)
        elif packing == "vector":
            orders = self.options.get("layouts")
            per_ct = self.options.get("planes_per_ct")
            stacked = self.options.get("stacked", [])
            if not isinstance(stacked, list) or any(
                    not isinstance(p, list) or len(p) != 2 or any(type(i) is not int for i in p)
                    for p in stacked):
                raise ValueError("stacked must be a list of [step, step] pairs")
            max_planes = self.options.get("max_planes", MAX_PLANES)
            if type(max_planes) is not int or not 0 <= max_planes <= MAX_PLANES:
                raise ValueError(f"max_planes must be an int in [0, {MAX_PLANES}], got "
                                 f"{max_planes!r}")
            self.plan = build_vector_plan(
                self.lowered, params.slots,
                None if orders is None else [None if o is None else tuple(o) for o in orders],
                max_planes=max_planes,
                interleave=self.options.get("interleave"),
                output_shape=tuple(program.output_shape),
                max_input_ciphertexts=int(self.options["max_input_ciphertexts"]),
                planes_per_ct=None if per_ct is None else {int(k): int(v)
                                                           for k, v in per_ct.items()},
                stacked=stacked, hoist_weights=_stored_weights(self.options.get("hoist")),
                share_rotations=_stored_share(self.options),
                fold_weights=_stored_weights(self.options.get("fold_hoist"), "fold_hoist"))
            keys = self.options.get("keys", "direct")
            if keys not in ("direct", "basis"):
                raise ValueError(f"keys must be 'direct' or 'basis', got {keys!r}")
            if keys == "basis":
                self.plan.key_steps = key_basis(params.slots)

        else:
            live = live_rows(self.lowered)
            self.plan = BatchPlan(live, np.flatnonzero(live[0]), params.slots)
            fanin = self.options.get("fused_fanin")
            if fanin is not None and (
                    not isinstance(fanin, list) or len(fanin) != len(self.lowered.steps)
                    or any(type(f) is not int or f < 0 for f in fanin)):
                raise ValueError("fused_fanin must hold one non-negative integer per step")
            lazy = self.options.get("lazy_products", [])
            if not isinstance(lazy, list) or any(type(m) is not int for m in lazy) \
                    or not set(lazy) <= set(lazy_candidates(self.lowered)):
                raise ValueError("lazy_products must list product steps read only by "
                                 "weighted maps")
            if type(self.options.get("lazy_in_tiles", False)) is not bool:
                raise ValueError("lazy_in_tiles must be true or false")
        self.plan.predicted = dict(self.options.get("predicted", {}))
        self.plan.why = str(self.options.get("why", ""))
        meta = json.dumps({"params": params.to_dict(), "packing": packing,
                           "options": self.options}, sort_keys=True)
        self.fingerprint = hashlib.sha256(
            (_program_digest(program) + meta).encode()).hexdigest()[:24]

    # ------------------------------------------------------------------ shapes and simulation
    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample as the model sees it (without the batch axis)."""
        return tuple(self.program.input_shape[1:]) if self.program.input_shape[:1] == (1,) \
            else tuple(self.program.input_shape)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.program.output_shape[1:]) if self.program.output_shape[:1] == (1,) \
            else tuple(self.program.output_shape)

    @property
    def batch_inputs(self) -> np.ndarray:
        """Flat indices of the input elements that batch packing encrypts: those that can reach
        the output (e.g. not the pixels a strided convolution skips); int64, ascending."""
        if not isinstance(self.plan, BatchPlan):
            raise AttributeError("batch_inputs exists in batch packing only")
        return self.plan.inputs

    @property
    def samples_per_ciphertext(self) -> int:
        """Samples one ciphertext (group) holds: the plan's interleave, or the slots."""
        return self.plan.interleave

    @property
    def input_range(self) -> float:
        return self.calibration[self.program.input_id]

    @property
    def levels(self) -> int:
        return self.params.levels

    def simulate(self, x: Any) -> np.ndarray:
        """Float64 run of the same program: ``(B, *input_shape) -> (B, *output_shape)``."""
        return self.program.simulate(x)

    @property
    def server_threads(self) -> int:
        """Threads the compiler chose for the server (``options["server_threads"]``; one for
        programs saved before the option)."""
        return _threads(self.options)

    @property
    def memory_budget(self) -> int | None:
        """Bytes the server may use, as given to :func:`compile` (None: not given; the compiler
        then planned for the memory available where it ran)."""
        return self.options.get("memory_budget")

    def key_bytes(self) -> int:
        """Bytes of the relinearisation and Galois keys a client makes and a server loads."""
        return _server_memory(self.params, [], len(self.plan.galois_steps()))

    def server_room(self) -> int | None:
        """What a server sizes by itself out of :attr:`memory_budget` (None where no budget was
        given): beyond the keys, a batch group's ciphertexts (its tiles are chosen to fit), and
        in vector packing beyond the values a sample holds at once, the encoded plaintexts kept
        between requests (those beyond are encoded at each use). :class:`~he.client.Server`
        takes it as its own ``memory_budget`` unless told otherwise, so that it plans as the
        compiler did."""
        budget = self.memory_budget
        if budget is None or self.packing == "tokens":
            return None
        held = _vector_held(self.plan, self.plan.op_counts()) if self.packing == "vector" else 0
        return max(0, budget - _server_memory(self.params, [], len(self.plan.galois_steps()),
                                              held))

    def summary(self) -> str:
        lines = [f"compiled program {self.fingerprint} ({self.packing} packing, degree "
                 f"{self.degree}, multiplicative depth {self.depth}, {len(self.program)} ops, "
                 f"{len(self.lowered.steps)} CKKS steps)",
                 str(self.params)]
        if self.options.get("precision"):
            lines.append(f"  precision: {self.options['precision']}")
        p = self.plan.predicted
        if isinstance(self.plan, VectorPlan):
            s = self.plan.cost()
            hoisted = (f" and {s['hoisted_rotations']} hoisted baby steps from "
                       f"{s['decompositions']} decompositions" if s["hoisted_rotations"] else "")
            if s["fold_groups"]:
                hoisted += (f", {s['fold_copies']} fold rotations hoisted in {s['fold_groups']} "
                            f"group(s)")
            lines.append(f"  vector plan: {self.plan.interleave} sample(s) per ciphertext, "
                         f"{s['rotations']} rotations{hoisted} ({len(self.plan.galois_steps())} "
                         f"Galois keys), "
                         f"{s['plain_mults']} plaintext and {s['ct_mults']} ciphertext "
                         f"multiplications, {s['input_ciphertexts']} input ciphertext(s) per "
                         f"group" + (" (the client computes the first maps' values)"
                                     if self.options.get("client_first") else "") +
                         (f"; the client applies the last map to the "
                                     f"{len(self.plan.results)} ciphertexts returned per group"
                                     if self.lowered.post is not None else ""))
        elif isinstance(self.plan, TokenPlan):
            s = self.plan.op_summary()
            lines.append(f"  tokens plan: {self.plan.interleave} samples per group, "
                         f"{len(self.plan.input_layout)} input ciphertexts, "
                         f"{s['rotations']} rotations ({len(self.plan.galois_steps())} Galois "
                         f"keys), {s['scalar_weights']} scalar and {s['vector_weights']} "
                         f"slot-vector weights")
        else:
            post = self.lowered.post
            lines.append(f"  batch plan: {self.params.slots} samples per ciphertext, "
                         f"{self.batch_inputs.size} input ciphertexts per group (of "
                         f"{int(np.prod(self.input_shape))} input elements, the others never "
                         f"reach the output)" + (
                             f"; the client applies the last map to the "
                             f"{sum(post.returned())} ciphertexts (sums of the elements it "
                             f"weighs alike) returned per group" if post is not None else ""))
        if p:
            threads = p.get("server_threads", 1)
            on = f" on {threads} server threads" if threads > 1 else ""
            lines.append(f"  predicted: {p['seconds_per_ciphertext']:.3g} s per ciphertext{on} "
                         f"({p['samples_per_ciphertext']} samples), "
                         f"{p['seconds_per_sample'] * 1e3:.3g} ms per sample, server memory "
                         f"{p['server_memory_bytes'] / 2 ** 20:.0f} MiB"
                         + (f", {p['upload_bytes'] / 2 ** 20:.3g} MiB up and "
                            f"{p['download_bytes'] / 2 ** 20:.3g} MiB down per request"
                            if "upload_bytes" in p else ""))
        if self.plan.why:
            lines.append(f"  why: {self.plan.why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    __repr__ = __str__

    # ------------------------------------------------------------------ files
    def to_bytes(self) -> bytes:
        header = {"params": self.params.to_dict(), "packing": self.packing,
                  "calibration": self.calibration, "options": self.options,
                  "certificate": self.certificate, "fingerprint": self.fingerprint}
        return pack("compiled-program", header, {"program": [self.program.to_bytes()]})

    @classmethod
    def from_bytes(cls, data: bytes) -> "CompiledProgram":
        """Load bytes from :meth:`to_bytes`; malformed data raises SerializationError."""
        head, blobs = unpack(data, "compiled-program", "compiled program")
        try:
            program = PolyProgram.from_bytes(blobs["program"][0])
            params = CKKSParams.from_dict(head["params"])
            packing = str(head["packing"])
            if packing not in PACKINGS:
                raise SerializationError(f"compiled program: unknown packing {packing!r}")
            calibration = [float(c) for c in head["calibration"]]
            if len(calibration) != len(program.nodes):
                raise SerializationError("compiled program: calibration does not match program")
            prog = cls(program, params, packing, calibration, dict(head["options"]),
                       str(head.get("certificate", "")))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError,
                ProgramFormatError) as exc:
            if isinstance(exc, SerializationError):
                raise
            raise SerializationError(f"compiled program: malformed ({exc})") from exc
        if prog.fingerprint != head.get("fingerprint"):
            raise SerializationError("compiled program: content does not match its fingerprint "
                                     "(corrupted or edited)")
        return prog

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically to ``path``."""
        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CompiledProgram":
        """Read a regular file of bounded size (a FIFO or device is refused, never read) and
        parse it with :meth:`from_bytes`."""
        try:
            data = read_bytes_limited(path, "compiled program", SerializationError)
        except SerializationError as exc:
            hint = "CompiledProgram.from_bytes parses bytes" if isinstance(
                path, (bytes, bytearray, memoryview)) else \
                "write one with 'polynets compile' or CompiledProgram.save"
            raise SerializationError(f"{exc}; {hint}") from exc
        return cls.from_bytes(data)


def load_program(path: str | os.PathLike) -> CompiledProgram:
    """Load a compiled program written by :meth:`CompiledProgram.save` (runs no code)."""
    return CompiledProgram.load(path)


#: Why a model whose output is the same whatever its input is not compiled.
CONSTANT_OUTPUT = ("the model cannot be compiled to CKKS: its output does not depend on its "
                   "input, so there is nothing to encrypt")


def _lower(model: Any, example_input: Any) -> tuple[PolyProgram, str]:
    program, cert, _ = _traced(model, example_input)
    return program, cert


def _traced(model: Any, example_input: Any, security: int = 128
            ) -> tuple[PolyProgram, str, Lowered | None]:
    """The model's program, its certificate as text, and the lowering the certificate counted
    its levels on (None where there is none to reuse; and none for a program of more
    ciphertext products in a row than any chain at ``security`` holds, which the compiler
    refuses: :func:`he.params.check_products`)."""
    if isinstance(model, PolyProgram):
        return model, "", None
    if isinstance(model, CompiledProgram):
        return model.program, model.certificate, None
    from polynets.ir.certify import certify_lowered

    if example_input is None:
        raise NotEncryptableError("he.compile needs an example_input to trace a model")
    try:
        cert, lowered = certify_lowered(model, example_input, most_levels(security))
    except TraceError as exc:
        raise NotEncryptableError(f"the model cannot be compiled to CKKS: {exc}") from exc
    if not cert.is_polynomial:
        raise NotEncryptableError(f"the model is not a polynomial, so it cannot be encrypted:\n"
                                  f"{cert}", cert)
    if cert.program is None:
        raise NotEncryptableError(CONSTANT_OUTPUT, cert)
    return cert.program, str(cert), lowered


def _calibration_data(program: PolyProgram, example_input: Any, calibration: Any) -> np.ndarray:
    data = calibration if calibration is not None else example_input
    if data is None:
        rng = np.random.default_rng(0)
        data = rng.standard_normal((16,) + tuple(program.input_shape[1:]))
    if hasattr(data, "detach"):
        data = data.detach().cpu().double().numpy()
    data = np.asarray(data, dtype=np.float64)
    sample = tuple(program.input_shape[1:])
    if data.ndim != len(sample) + 1 or tuple(data.shape[1:]) != sample or data.shape[0] < 1:
        what = "calibration" if calibration is not None else "example_input"
        raise InputShapeError(f"{what} must be a batch of at least one sample of the traced "
                              f"shape, {batch_of(sample)}, got {tuple(data.shape)}")
    return data


def _objective_cost(predicted: dict[str, Any], objective: str, batch_size: int | None,
                    bandwidth: float | None = None) -> float:
    """Predicted seconds the objective minimises: one round trip (latency), or per sample when
    requests of ``batch_size`` samples (default: full ciphertexts) are sent (throughput). With
    a ``bandwidth`` (bytes per second between client and server), a round trip also moves its
    ciphertexts, and a stream of requests goes no faster than the link carries them."""
    wire = 0.0
    if bandwidth:
        wire = (predicted.get("upload_bytes", 0) + predicted.get("download_bytes", 0)) / bandwidth
    compute = float(predicted["round_trip_seconds"])
    if objective == "latency":
        return compute + wire
    per_ct = predicted["samples_per_ciphertext"]
    groups = 1 if batch_size is None else math.ceil(batch_size / per_ct)
    samples = per_ct if batch_size is None else batch_size
    return groups * max(compute, wire) / samples


def _dense_widest(lowered: Lowered) -> int:
    return max(next_pow2(st.n) for st in lowered.steps)


def _vector_choice(program: PolyProgram, lowered: Lowered, params: CKKSParams, costs: CostModel,
                   options: dict[str, Any], samples: int | None
                   ) -> tuple[VectorPlan, dict[str, Any]]:
    """The vector plan the cost model prefers at these parameters (layouts searched, then the
    samples per ciphertext for the objective) and the options that rebuild it on loading."""
    ring, slots = params.poly_modulus_degree, params.slots

    def price(counts: dict[str, int], level: int) -> float:
        return costs.price({k: v for k, v in counts.items() if k != "plaintexts"}, ring,
                           params.limbs(level))

    def plane_price(counts: dict[str, int]) -> float:
        """Input planes: the client's encryptions (on its threads) and the server's folds."""
        rest = {k: v for k, v in counts.items() if k != "encrypt"}
        return costs.price(rest, ring, params.limbs(0)) + costs.client_seconds(
            counts.get("encrypt", 0), ring, params.limbs(0), client_threads())

    def served(trial: VectorPlan) -> tuple[int, str, dict[str, Any]]:
        """The server threads ``trial`` would run on, why, and its prediction on them: every
        candidate is priced as it would be served, so that the one kept is the cheapest as
        served (not the cheapest on threads the rule then declines). Where it hoists and
        the cost model prices sharing, ``trial`` shares the work that runs alone among the
        threads (:attr:`VectorPlan.shares_rotations`) if that is predicted faster; where it
        may group its folds (:attr:`VectorPlan.fold_weights`), it does if that is."""
        grouped = trial.fold_weights

        def cheapest(n: int, sharing: Sequence[bool]) -> dict[str, Any]:
            best: tuple[dict[str, Any], Any, bool] | None = None
            for folds_by in (None, grouped) if grouped is not None else (None,):
                for shares in sharing:
                    trial.fold_weights, trial.shares_rotations = folds_by, shares
                    p = _predict_vector(trial, params, costs, n)
                    if best is None or \
                            p["seconds_per_ciphertext"] < best[0]["seconds_per_ciphertext"]:
                        best = (p, folds_by, shares)
            assert best is not None
            trial.fold_weights, trial.shares_rotations = best[1], best[2]
            return best[0]

        serial = cheapest(1, (False,))
        serial_folds = trial.fold_weights
        threads, why, predicted = _chosen_threads(
            _threads(options), serial, lambda n: cheapest(n, (False, True) if share else
                                                         (False,)),
            "baby-step rotations and giant steps (their products and rotation)")
        if threads == 1:
            trial.fold_weights, trial.shares_rotations = serial_folds, False
        return threads, why, predicted

    objective = options["objective"]
    # baby steps hoisted where this machine can and the cost model finds it cheaper (he.hoist;
    # a server validates its hoister, and rotates with SEAL where that fails), on parameters
    # whose noise analysis covers the baby steps it favours
    weights = hoist_weights(params, costs) \
        if hoist_expected() and hoisting_noise_covered(params) else None
    # sharing among the threads is priced only where the cost model measured its hand-offs
    share = weights is not None and costs.shared_handoff(ring) is not None
    # folds hoisted in groups where the cost model prices that cheaper (he.plan.fold_groups),
    # where baby steps may be
    folds = fold_weights(params, costs) if weights is not None and not _FOLDS_ALONE[0] \
        else None
    # the first maps from the client's input planes (no rotation; an input ciphertext per few
    # planes), or from the input itself (one ciphertext; the maps rotate it)
    plane_options = (MAX_PLANES, 0) if planes_readers(lowered, MAX_PLANES) else (MAX_PLANES,)
    best: tuple[float, Any, Any, Any, Any, int] | None = None
    scores: dict[int, float] = {}
    for max_planes in plane_options:
        orders, _ = search_layouts(lowered, slots, price, max_planes=max_planes)
        most = slots // widest_period(lowered, orders)
        tries = [samples] if samples is not None else \
            [most >> i for i in range(most.bit_length())][:8]
        for k in tries:
            per_ct = choose_plane_packing(lowered, orders, slots // k, plane_price,
                                          max_planes=max_planes)
            trial = build_vector_plan(lowered, slots, orders, interleave=k,
                                      output_shape=tuple(program.output_shape),
                                      max_planes=max_planes,
                                      max_input_ciphertexts=int(options["max_input_ciphertexts"]),
                                      planes_per_ct=per_ct, price=price,
                                      hoist_weights=_stored_weights(weights),
                                      fold_weights=_stored_weights(folds, "fold_hoist"))
            threads, threads_why, predicted = served(trial)
            score = _objective_cost(predicted, objective, options.get("batch_size"),
                                    options.get("bandwidth"))
            scores[max_planes] = min(score, scores.get(max_planes, score))
            if best is None or score < best[0]:
                best = (score, trial, per_ct, predicted, orders, max_planes, threads,
                        threads_why)
    assert best is not None
    score, plan, per_ct, predicted, orders, max_planes, threads, threads_why = best
    most = slots // widest_period(lowered, orders)
    planes_why = ""
    if len(scores) > 1:
        planes_why = (f"; the first maps from the client's input planes: {scores[MAX_PLANES]:.3g}"
                      f" s, from one input ciphertext: {scores[0]:.3g} s")
    changed = sum(o is not None for o in orders)
    shared_why = "; folds and lone giant steps shared among them" if plan.shares_rotations \
        else ""
    opts = {**options, "server_threads": threads, "threads_why": threads_why,
            "layouts": [None if o is None else list(o) for o in orders],
            "planes_per_ct": {str(i): v for i, v in per_ct.items()},
            "interleave": plan.interleave, "stacked": [list(p) for p in plan.stacked],
            "predicted": predicted,
            "why": (f"layouts searched under the cost model ({costs.source}): {changed} of "
                    f"{len(orders)} values in a strided layout; {len(plan.stacked)} pairs of "
                    f"maps stacked; widest value {plan.widest} slots, room for {most} samples "
                    f"per ciphertext; {plan.interleave} chosen for {objective} "
                    f"({_OBJECTIVE_WORDS[objective]} {score:.3g} s, client encryption "
                    f"included){planes_why}; {threads_why}{shared_why}")}
    if threads > 1:
        # what a server that finds one thread faster as it starts (he.Server.warm) predicts
        opts["predicted_one_thread_s"] = _predict_vector(plan, params, costs, 1)[
            "seconds_per_ciphertext"]
    if max_planes != MAX_PLANES:
        opts["max_planes"] = max_planes
    if weights is not None:
        opts["hoist"] = weights
        opts["share_rotations"] = plan.shares_rotations
    if plan.fold_weights is not None:
        opts["fold_hoist"] = folds
        grouped = plan.hoisted_folds()
        one_at_a_time = _predict_vector(dataclasses.replace(plan, fold_weights=None), params,
                                        costs, threads)["seconds_per_ciphertext"]
        opts["why"] += (f"; {sum(len(g) for g in grouped)} fold rotations in {len(grouped)} "
                        f"group(s), each group's rotated copies made from one decomposition "
                        f"and summed before one division by the special prime: predicted "
                        f"{predicted['seconds_per_ciphertext']:.3g} s against "
                        f"{one_at_a_time:.3g} s folding one rotation at a time")
    return plan, opts


def hoisting_noise_covered(params: CKKSParams) -> bool:
    """Whether the noise analysis covers the baby steps a hoisted plan favours: their key
    switching happens at the input's scale and the weights multiply it. A wide chain prices
    that switching explicitly (:attr:`~he.params.CKKSParams.switching_noise`); a chain of one
    prime per level prices it as a rescale's, which holds where the special prime has its
    margin over the widest prime (:data:`he.params.ROTATION_BITS`). Below it (a first prime
    as wide as the special one, for large values) a rotation at the scale was measured at
    about 100 rescales' noise, and a hoisted plan of more baby steps broke its promise 8-fold
    where the plan of fewer kept it; such parameters are planned without hoisting."""
    return params.pending >= 0 or params.special_margin >= ROTATION_BITS


def _in_rotations(params: CKKSParams, costs: CostModel, parts: Sequence[Sequence[str]]
                  ) -> dict[str, list[float]]:
    """Per level (a string, as stored in a program's options), the price of each of ``parts``
    (the primitives summed in each) in rotations at that level under ``costs``; four
    significant digits, so that a stored program rebuilds the same plan."""
    ring = params.poly_modulus_degree
    out = {}
    for lv in range(params.levels + 1):
        limbs = params.limbs(lv)
        rot = costs.seconds("rotate", ring, limbs)
        out[str(lv)] = [float(f"{sum(costs.seconds(op, ring, limbs) for op in ops) / rot:.4g}")
                        for ops in parts]
    return out


def hoist_weights(params: CKKSParams, costs: CostModel) -> dict[str, list[float]]:
    """Per level, the prices of a hoisted baby step, an input's decomposition and a giant
    step's division by the special prime, each in rotations at that level under ``costs``
    (:data:`he.plan.HoistWeights`, :func:`_in_rotations`)."""
    return _in_rotations(params, costs, [("rotate_hoisted",), ("decompose",), ("mod_down",)])


def fold_weights(params: CKKSParams, costs: CostModel) -> dict[str, list[float]]:
    """Per level, the prices of a hoisted fold's parts, each in rotations at that level under
    ``costs`` (:data:`he.plan.FoldWeights`, :func:`_in_rotations`): a rotated copy and its
    addition in the extended primes, the decomposition, the division by the special prime."""
    return _in_rotations(params, costs, [("rotate_hoisted", "add"), ("decompose",),
                                         ("mod_down",)])


def _stored_share(options: dict[str, Any]) -> bool:
    """A program's ``share_rotations`` option (programs saved before it: shared); raises
    ValueError where it is not a bool."""
    share = options.get("share_rotations", True)
    if type(share) is not bool:
        raise ValueError(f"share_rotations must be a bool, got {share!r}")
    return share


def _stored_weights(stored: Any, name: str = "hoist"
                    ) -> Callable[[int], tuple[float, float, float]] | None:
    """The :data:`he.plan.HoistWeights` of a program's ``hoist`` option, or the
    :data:`he.plan.FoldWeights` of its ``fold_hoist`` (``name``) (None: neither, as programs
    saved before them); raises ValueError on anything but positive prices per level."""
    if stored is None:
        return None
    if not isinstance(stored, dict) or any(
            not isinstance(v, list) or len(v) != 3
            or any(type(x) not in (int, float) or not 0 < x < 1e6 for x in v)
            for v in stored.values()):
        raise ValueError(f"{name} must map levels to three positive prices")
    table = {int(k): tuple(float(x) for x in v) for k, v in stored.items()}

    def weights(level: int) -> tuple[float, float, float]:
        if level not in table:
            raise ValueError(f"{name} holds no prices for level {level}")
        return table[level]

    return weights


def wide_phases(lowered: Lowered) -> list[int]:
    """Parities whose levels may be pending in a wide chain: no ciphertext product from them
    and not the output's level (see :class:`~he.params.CKKSParams`)."""
    levels = step_levels(lowered.steps, "vector")
    muls = {max(levels[j] for j in st.inputs) % 2 for st in lowered.steps if st.kind == "mul"}
    last = max(levels) % 2
    return [ph for ph in (0, 1) if ph not in muls and ph != last]


def _narrow_or_wide(program: PolyProgram, lowered: Lowered, params: CKKSParams,
                    costs: CostModel, options: dict[str, Any], samples: int | None,
                    msq: list[np.ndarray], err_target: float, scale_fixed: bool = False
                    ) -> tuple[CKKSParams, VectorPlan, dict[str, Any]]:
    """The vector plan at ``params`` and, where the program allows a wide chain of the same
    ring that keeps the precision, the one the cost model predicts cheaper for the objective
    (``scale_fixed``: the wide chain keeps ``params``' scale, as asked)."""
    plan, opts = _vector_choice(program, lowered, params, costs, options, samples)
    best = (_objective_cost(opts["predicted"], options["objective"], options.get("batch_size"),
                            options.get("bandwidth")),
            params, plan, opts)
    for phase in wide_phases(lowered):
        wide = wide_variant(params, phase, lambda p: _vector_gain(lowered, msq, p), err_target,
                            scales=(params.scale_bits,) if scale_fixed else None)
        if wide is None:
            continue
        build_context(wide)
        w_plan, w_opts = _vector_choice(program, lowered, wide, costs, options, samples)
        score = _objective_cost(w_opts["predicted"], options["objective"],
                                options.get("batch_size"), options.get("bandwidth"))
        if score < best[0]:
            w_opts["why"] += (f"; wide chain chosen: predicted {score:.3g} s against "
                              f"{best[0]:.3g} s with one prime per level")
            best = (score, wide, w_plan, w_opts)
    return best[1], best[2], best[3]


def _vector_gain(lowered: Lowered, msq: list[np.ndarray], params: CKKSParams,
                 hops: float = 1.0) -> tuple[float, float]:
    """The noise gains of a vector program on ``params``' chain (a wide chain's weights at
    pending levels encoded at ``2^(prime - scale)``, its key switchings as noisy as its
    special prime makes them), ``hops`` key switchings per rotation."""
    pending = (params.pending, params.weight_rounding) if params.pending >= 0 else None
    return noise_gain(lowered, msq, "vector", pending, hops, params.switching_noise)


def _fit_keys(plan: VectorPlan, params: CKKSParams, costs: CostModel, opts: dict[str, Any],
              memory_budget: int | None, lowered: Lowered, msq: list[np.ndarray]
              ) -> tuple[CKKSParams, dict[str, Any]]:
    """``params`` and the options of ``plan`` with its Galois keys a power-of-two basis (each
    rotation composed from a few of them, :func:`he.plan.rotation_path`) where one key per
    distinct rotation would put the server over ``memory_budget`` (default: the memory
    available now) and the basis needs fewer keys; else both unchanged. The promised error
    grows with the key switchings of the longest composed rotation."""
    budget = _server_budget(memory_budget)
    old = opts["predicted"]
    direct = plan.rotations()
    basis = key_basis(plan.slots)
    if old["server_memory_bytes"] <= budget or len(basis) >= len(direct):
        return params, opts
    plan.key_steps = basis
    new = _predict_vector(plan, params, costs, _threads(opts))
    hops = max(len(rotation_path(r, plan.slots, basis)) for r in direct)
    g_one, g_hops = _vector_gain(lowered, msq, params)[1], _vector_gain(lowered, msq, params,
                                                                        hops)[1]
    params = dataclasses.replace(
        params, expected_error=params.expected_error * max(1.0, g_hops / max(g_one, 1e-300)))
    gib = 2.0 ** 30
    why = (f"; Galois keys for {len(direct)} distinct rotations would put the server at "
           f"{old['server_memory_bytes'] / gib:.1f} GiB > {budget / gib:.1f} GiB: rotations "
           f"composed from {len(basis)} power-of-two keys ({new['server_memory_bytes'] / gib:.1f}"
           f" GiB; predicted {new['seconds_per_ciphertext']:.3g} s per ciphertext against "
           f"{old['seconds_per_ciphertext']:.3g} s)")
    return params, {**opts, "keys": "basis", "predicted": new, "why": opts["why"] + why}


def _batch_choice(lowered: Lowered, params: CKKSParams, costs: CostModel,
                  options: dict[str, Any], budget: int) -> dict[str, Any]:
    """Options of a batch-packed program: the fan-in from which each step's rows are fused
    (the cost model's choice) and the prediction, with a group in tiles where it would not fit
    ``budget`` bytes beside the keys."""
    live = live_rows(lowered)
    fanin = _batch_fanin(lowered, live, params, costs)
    fused = sum(f > 0 for f in fanin)
    room = budget - _server_memory(params, [], 0)
    lazy = _batch_lazy(lowered, live, params, costs, fanin)
    serial = _predict_batch(lowered, live, params, costs, fanin, budget=room, lazy=lazy)
    # where the group fits whole only with every product finished: the lazy products in tiles
    # instead, if the cost model prices them lower
    in_tiles = _predict_batch(lowered, live, params, costs, fanin, budget=room, lazy=lazy,
                              lazy_in_tiles=True) if lazy and not serial["lazy_products"] \
        and not serial["tiles"] else None
    first = in_tiles is not None and bool(in_tiles["lazy_products"]) \
        and in_tiles["seconds_per_ciphertext"] < serial["seconds_per_ciphertext"]
    finished = serial
    if first:
        serial = in_tiles
    threads, threads_why, predicted = _chosen_threads(
        _threads(options), serial,
        lambda n: _predict_batch(lowered, live, params, costs, fanin, n, budget=room,
                                 lazy=lazy, lazy_in_tiles=first),
        "a group's products, rescales and fused maps")
    why = (f"one sample per slot; dead inputs and outputs skipped; {fused} weighted steps as "
           f"fused integer matrix products (rows from the fan-in the cost model chose); "
           f"{threads_why}")
    if lazy:
        n_lazy = sum(int(live[m].sum()) for m in lazy)
        why += (f"; the {n_lazy} products of {len(lazy)} product step(s) left unrelinearised "
                f"and unrescaled, read at their primes by the maps that read them, which "
                f"relinearise and rescale their own outputs instead (cheaper under the cost "
                f"model)")
        if first:
            why += (f"; the group does not fit whole with them at this memory budget: in tiles "
                    f"with them, predicted {in_tiles['seconds_per_ciphertext']:.3g} s on one "
                    f"thread against {finished['seconds_per_ciphertext']:.3g} s whole with every "
                    f"product finished")
        elif not predicted["lazy_products"]:
            why += (", where a group fits with them (whole, or in tiles that need no spill): "
                    "not at this memory budget")
    if predicted["tiles"]:
        gib = 2.0 ** 30
        why += "; " if first else (
            f"; a group would hold {predicted['untiled_memory_bytes'] / gib:.1f} GiB of "
            f"ciphertexts > {room / gib:.1f} GiB free: ")
        why += (f"{len(predicted['tiles'])} segment(s) of steps run in tiles "
                f"({', '.join(f'{k} at step {e}' for e, k in predicted['tiles'].items())}), "
                f"{predicted['working_memory_bytes'] / gib:.1f} GiB")
        if predicted.get("spills"):
            why += (f", where tiles alone would not fit: {sum(predicted['spills'].values())} "
                    f"rows written to disk and read back between the tiles that read them")
    out = {**options, "fused_fanin": fanin, "server_threads": threads,
           "threads_why": threads_why, "predicted": predicted, "why": why}
    if lazy:
        out["lazy_products"] = [int(m) for m in lazy]
    if first:
        out["lazy_in_tiles"] = True
    return out


class TokensUnfit(NotEncryptableError):
    """The program lacks the token structure tokens packing needs (``packing="auto"`` then
    prices the others)."""


def _stored_token_plan(lowered: Lowered, slots: int, options: dict[str, Any]) -> TokenPlan:
    """The tokens plan a compiled program's options describe (its padded grid and the offsets
    whose partial sums are rotated)."""
    padded = options.get("token_grid")
    giants = options.get("token_giants", {})
    if not isinstance(padded, list) or any(type(p) is not int or p < 1 for p in padded):
        raise ValueError("token_grid must be a list of positive ints")
    if not isinstance(giants, dict) or any(
            not isinstance(v, list) or any(type(d) is not int for d in v)
            for v in giants.values()):
        raise ValueError("token_giants must map steps to lists of offsets")
    try:
        return build_token_plan(lowered, slots, padded,
                                {int(k): [int(d) for d in v] for k, v in giants.items()})
    except (TokensNotApplicable, ValueError) as exc:
        raise ValueError(f"tokens plan: {exc}") from None


def _predict_tokens(plan: TokenPlan, params: CKKSParams, costs: CostModel,
                    threads: int = 1) -> dict[str, Any]:
    """Predicted time, work and memory of one group of ``plan.interleave`` samples."""
    from he.fused import FUSED_MIN_FANIN

    ring = params.poly_modulus_degree
    moduli = _level_moduli(params)
    speedup = threads * costs.batch_efficiency(ring) if threads > 1 else 1.0
    seconds = 0.0
    total: dict[str, float] = {}
    for si in range(len(plan.steps)):
        for level, c in token_step_counts(plan, si, moduli, params.scale, FUSED_MIN_FANIN):
            par = {k: v for k, v in c.items() if k in _BATCH_THREADED}
            rest = {k: v for k, v in c.items() if k not in _BATCH_THREADED}
            seconds += costs.price(rest, ring, params.limbs(level)) + \
                costs.price(par, ring, params.limbs(level)) / speedup
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
    n_in = len(plan.input_layout)
    total["load"] = n_in
    seconds += n_in * costs.seconds("load", ring, params.limbs(0))
    client = costs.client_seconds(n_in, ring, params.limbs(0), client_threads())
    k = plan.interleave
    out = plan.steps[plan.output]
    held = plaintexts_held(plan)
    # the group's ciphertexts at their peak, and the encoded scalars batch packing's rule keeps
    working = peak_ciphertexts(plan) * 2 * ring * params.data_primes * 8 + PLAIN_CACHE_BYTES
    return {"seconds_per_ciphertext": seconds, "client_seconds": client,
            "round_trip_seconds": seconds + client, "samples_per_ciphertext": k,
            "seconds_per_sample": (seconds + client) / k, "counts": total,
            "upload_bytes": wire_bytes(params, 0, n_in, 1),
            "download_bytes": wire_bytes(params, plan.levels[plan.output], out.width, 2),
            "server_threads": threads,
            "server_memory_bytes": _server_memory(params, held, len(plan.galois_steps()))
            + working,
            "working_memory_bytes": working, "plaintexts": sum(n for n, _ in held),
            **plan.op_summary()}


def _tokens_choice(plan: TokenPlan, params: CKKSParams, costs: CostModel,
                   options: dict[str, Any]) -> dict[str, Any]:
    """Options of a tokens-packed program: its padded grid and rotation choices, the server
    threads and the prediction."""
    serial = _predict_tokens(plan, params, costs)
    threads, threads_why, predicted = _chosen_threads(
        _threads(options), serial, lambda n: _predict_tokens(plan, params, costs, n),
        "a group's products, rescales and fused maps")
    masked = sum(1 for st in plan.steps if st.copy_of)
    why = (f"one ciphertext per channel, the {plan.grid} tokens padded to {plan.padded} "
           f"({plan.period} positions) of {plan.interleave} samples in its slots; "
           f"{predicted['rotations']} rotations, {predicted['plaintexts']} slot-vector "
           f"weights and masks, {predicted['scalar_weights']} scalar weights as fused "
           f"integer products; {len(plan.input_layout)} input ciphertexts (the input's "
           f"planes as the first maps read them, and the mask plane that carries the biases)")
    if masked:
        why += (f"; {masked} map(s) read a shifted value through masks (a level each, "
                f"{params.levels} levels in all)")
    why += f"; {threads_why}"
    return {**options, "token_grid": [int(p) for p in plan.padded],
            "token_giants": {str(k): v for k, v in chosen_giants(plan).items()},
            "server_threads": threads, "threads_why": threads_why, "predicted": predicted,
            "why": why}


def _lowerings(lowered: Lowered, msq: list[np.ndarray], packing: str, slots: int
               ) -> list[tuple[Lowered, list[np.ndarray], Split | None]]:
    """The lowered programs ``packing`` can run at ``slots`` slots, with their values' mean
    squares: the program itself where its values fit (batch packing: always); in vector
    packing, where they do not, its splits over several ciphertexts
    (:func:`he.split.split_lowered`) along each axis that admits one; and where the values (or
    the blocks) fit only in unpadded layouts, also splits into blocks of half the slots, which
    fit padded."""
    if packing != "vector":
        return [(lowered, msq, None)]
    out: list[tuple[Lowered, list[np.ndarray], Split | None]] = []
    if _dense_widest(lowered) <= slots:
        out.append((lowered, msq, None))
        if padded_layouts_fit(lowered, slots):
            return out
        targets = [slots // 2]
    else:
        targets = [slots, slots // 2]
    for axis in SPLIT_AXES:
        for target in targets:
            split = split_lowered(lowered, target, axis)
            if split is None:
                break
            out.append((split.lowered, split.slice_values(msq), split))
            if padded_layouts_fit(split.lowered, slots):
                break       # smaller blocks only where these fit only unpadded
    return out


def _layout_words(prog: "CompiledProgram") -> str:
    split = prog.options.get("split")
    where = f"N={prog.params.poly_modulus_degree}"
    if prog.packing == "tokens":
        return f"{where} with the tokens padded to {tuple(prog.options['token_grid'])}"
    return (f"{where} with every value whole" if split is None else
            f"{where} with values split along axis {split['axis']} into blocks of at most "
            f"{split['slots']} elements")


def _compile_packing(program: PolyProgram, lowered: Lowered, packing: str, cert: str,
                     maxabs: list[float], msq: list[np.ndarray], options: dict[str, Any],
                     rings: tuple[int, ...], costs: CostModel, precision_bits: int,
                     scale_bits: int | None, samples: int | None,
                     memory_budget: int | None = None,
                     priced: Callable[[str], None] | None = None) -> CompiledProgram:
    """The program compiled at the smallest ring whose chain holds it. In vector packing,
    where a value is wider than that ring's slots (or fits it only unpadded), its splits over
    several ciphertexts (:func:`_lowerings`) are priced, and every larger ring up to the first
    that holds the program whole: the cheapest for the objective whose server fits
    ``memory_budget`` is kept (:func:`_rank`). ``priced(what)`` is called as each candidate
    (ring, split or token padding) is taken up."""
    notes: list[str] = []
    error: TooDeepError | None = None
    best: tuple[tuple[bool, float], CompiledProgram] | None = None
    budget = _server_budget(memory_budget)
    compared = False
    info = program_degree_depth(program)
    for ring in rings:
        slots = ring // 2
        if packing == "tokens":
            # every padding of the token grid, each with the levels its masks need
            try:
                cands = [(lowered, msq, padded) for padded in token_paddings(
                    token_grid(lowered))]
            except TokensNotApplicable as exc:
                notes.append(str(exc))
                break
        else:
            cands = _lowerings(lowered, msq, packing, slots)
        if not cands:
            notes.append(f"N={ring}: a value needs {_dense_widest(lowered)} slots and "
                         f"splits over at most {MAX_BLOCKS} ciphertexts do not hold it")
            continue
        for low, m, split in cands:
            if priced is not None:
                priced(f"{packing}, N={ring}" + (
                    "" if split is None else f", tokens padded to {split}"
                    if packing == "tokens" else f", values split over {split.blocks}"))
            levels = low.depth_levels(packing)
            tplan = None
            if packing == "tokens":
                try:
                    tplan = build_token_plan(low, slots, split)
                except TokensNotApplicable as exc:
                    notes.append(f"N={ring}, tokens padded to {split}: {exc}")
                    continue
                levels = max(tplan.levels)
            gain = noise_gain(low, m, packing)
            chain_kw = dict(output_abs=maxabs[program.output],
                            rotations=packing in ("vector", "tokens"),
                            security=int(options.get("security", 128)))
            try:
                params = choose_params(levels, max(maxabs), gain, precision_bits=precision_bits,
                                       slots_needed=1, ring_degree=ring, scale_bits=scale_bits,
                                       **chain_kw)
            except TooDeepError as exc:
                note = f"N={ring}: {levels} levels do not fit"
                if scale_bits is None:
                    fits = fitting_precision(levels, max(maxabs), gain, ring,
                                             below=precision_bits, **chain_kw)
                    if fits is not None:
                        note += (f" at {precision_bits} bits of precision (they do at up to "
                                 f"{fits}: precision_bits={fits}, or 'argmax' for a "
                                 f"classifier)")
                if note not in notes:
                    notes.append(note)
                error = exc
                continue
            if notes:
                params = dataclasses.replace(params,
                                             why=params.why + "; rejected " + "; ".join(notes))
            build_context(params)   # SEAL must accept the chain now, not when a client is made
            if packing == "vector":
                opts = dict(options)
                if split is not None:
                    opts["split"] = {"slots": split.slots, "axis": split.axis}
                err_target = error_target(maxabs[program.output], precision_bits)
                params, plan, opts = _narrow_or_wide(program, low, params, costs, opts,
                                                     samples, m, err_target,
                                                     scale_fixed=scale_bits is not None)
                params, opts = _fit_keys(plan, params, costs, opts, memory_budget, low, m)
                if split is not None:
                    opts["why"] += (f"; values wider than {split.slots} slots split over up to "
                                    f"{split.blocks} ciphertexts along axis {split.axis} of "
                                    f"their layout shape")
            elif packing == "tokens":
                assert tplan is not None
                plan, opts = tplan, _tokens_choice(tplan, params, costs, options)
            else:
                plan, opts = None, _batch_choice(low, params, costs, options, budget)
            prog = CompiledProgram(program, params, packing, maxabs, opts, cert, _lowered=low,
                                   _plan=plan, _degree_depth=info)
            score = _rank(prog, options["objective"], options.get("batch_size"), budget)
            if best is not None:
                # a split at a smaller ring against another ring, axis or block size
                compared = True
                (ws, won), (ls, lost) = sorted([best, (score, prog)], key=lambda t: t[0])
                won.options["why"] += (
                    f"; chosen against {_layout_words(lost)}: predicted {ws[-1]:.3g} s against "
                    f"{ls[-1]:.3g} s" + (" (over the memory budget)" if ls[0] and not ws[0]
                                        else ""))
            if best is None or score < best[0]:
                best = (score, prog)
        if best is not None and (packing == "tokens" or any(c[2] is None for c in cands)):
            break           # the program whole at this ring was priced: larger rings cost more
    if best is not None:
        chosen = best[1]
        if not compared:
            return chosen
        # rebuilt so that the plan's why and the fingerprint include the comparisons
        return _with_why(chosen, chosen.options["why"])
    if error is not None:
        raise error
    if packing == "tokens":
        raise TokensUnfit("tokens packing does not apply: " + "; ".join(notes))
    raise TooDeepError("no ring degree holds the program's widest value: " + "; ".join(notes))


def _check_settings(packing: str, objective: str, batch_size: int | None, security: int,
                    memory_budget: int | None, samples_per_ciphertext: int | None,
                    **bounded: int | None) -> None:
    """Refuse out-of-range compiler settings (never clamp them)."""
    bounds = {"precision_bits": (1, 40), "scale_bits": (20, 60),
              "max_input_ciphertexts": (1, 4096)}
    for name, value in bounded.items():
        lo, hi = bounds[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not lo <= value <= hi):
            also = " or 'argmax'" if name == "precision_bits" else ""
            raise NotEncryptableError(f"{name} must be an int in [{lo}, {hi}]{also}, got "
                                      f"{value!r}")
    if packing not in PACKINGS + ("auto",):
        raise NotEncryptableError(f"packing must be one of {PACKINGS + ('auto',)}, "
                                  f"got {packing!r}")
    if objective not in OBJECTIVES:
        raise NotEncryptableError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if batch_size is not None:
        check_int(batch_size, "batch_size", error=NotEncryptableError)
    if security not in SECURITY_LEVELS:
        raise NotEncryptableError(f"security must be one of {SECURITY_LEVELS} bits, got "
                                  f"{security!r}")
    if memory_budget is not None:
        check_int(memory_budget, "memory_budget (bytes)", error=NotEncryptableError)
    if samples_per_ciphertext is not None and (
            int(samples_per_ciphertext) < 1 or int(samples_per_ciphertext) & (
            int(samples_per_ciphertext) - 1)):
        raise NotEncryptableError(f"samples_per_ciphertext must be a power of two, got "
                                  f"{samples_per_ciphertext!r}")


def _rank(prog: "CompiledProgram", objective: str, batch_size: int | None, budget: int
          ) -> tuple[bool, float, float]:
    """Sort key of candidate programs, ``(over, memory over, cost)``: those whose server fits
    ``budget`` bytes first, by the predicted cost for ``objective`` (the last item); where none
    fits, the one that needs the least memory (a server refuses a group it cannot hold)."""
    memory = float(prog.plan.predicted.get("server_memory_bytes", 0))
    over = memory > budget
    return over, memory if over else 0.0, _objective_cost(
        prog.plan.predicted, objective, batch_size, prog.options.get("bandwidth"))


def _with_why(prog: "CompiledProgram", why: str) -> "CompiledProgram":
    """``prog`` rebuilt with ``why`` as its plan's reason, so that the fingerprint includes it
    (the lowering and vector plan are reused)."""
    return CompiledProgram(prog.program, prog.params, prog.packing, prog.calibration,
                           {**prog.options, "why": why}, prog.certificate,
                           _lowered=prog.lowered,
                           _plan=prog.plan if prog.packing in ("vector", "tokens") else None,
                           _degree_depth=(prog.degree, prog.depth))


def _choose(found: list["CompiledProgram"], packing: str, objective: str,
            batch_size: int | None, memory_budget: int | None) -> "CompiledProgram":
    """The candidate packing with the lowest predicted cost for ``objective`` whose server fits
    ``memory_budget`` (the one needing least memory, when none fits); with ``packing="auto"``
    its ``why`` says so."""
    budget = _server_budget(memory_budget)
    ranked = [_rank(p, objective, batch_size, budget) for p in found]
    scores = [r[-1] for r in ranked]
    memory = [float(p.plan.predicted.get("server_memory_bytes", 0)) for p in found]
    fits = [not r[0] for r in ranked]
    best = found[min(range(len(found)), key=lambda i: ranked[i])]
    if packing == "auto":
        others = "; ".join(
            f"{p.packing}: {s:.3g} s (N={p.params.poly_modulus_degree}"
            + ("" if f else f", server {m / 2 ** 30:.1f} GiB > budget {budget / 2 ** 30:.1f} GiB")
            + ")" for p, s, f, m in zip(found, scores, fits, memory))
        best = _with_why(best, f"packing='auto', objective={objective!r}: predicted "
                               f"{_OBJECTIVE_WORDS[objective]} {others} -> {best.packing}; "
                               + best.plan.why)
    return best


def compile(model: Any, example_input: Any = None, *, calibration: Any = None,
            packing: str = "vector", objective: str = "latency",
            precision_bits: int | str = 16,
            ring_degree: int | None = None, scale_bits: int | None = None,
            max_input_ciphertexts: int = 8, samples_per_ciphertext: int | None = None,
            batch_size: int | None = None, cost_model: CostModel | None = None,
            memory_budget: int | None = None, security: int = 128,
            server_threads: int | None = None,
            bandwidth: float | None = None, final_map: str = "auto",
            first_map: str = "auto", progress: bool = False) -> CompiledProgram:
    """Compile a polynomial model (or a :class:`PolyProgram`) to CKKS.

    The compiler prices its candidates with ``cost_model`` and keeps the cheapest for
    ``objective``: the packing (``packing="auto"``), the ring and any split of values wider
    than its slots, a chain of one prime per level or a wide one, every value's layout (the
    input's among them, laid out by its patches where the maps reading it read it so), the
    baby/giant split of every map, whether local first maps read the client's input planes or
    rotate one input ciphertext, the samples per ciphertext, and whether linear maps whose
    composition would multiply the work are kept apart at a level each. ``prog.plan.why`` and
    ``prog.params.why`` say what was chosen against what.

    Args:
        model: an ``nn.Module`` (traced and certified on ``example_input``) or a PolyProgram.
        example_input: a batch ``(B, *sample)``; also the calibration data by default.
        calibration: data ``(B, *sample)`` whose per-node ranges size the modulus chain; inputs
            outside the input's calibrated range later trigger a CalibrationRangeWarning.
        packing: ``"vector"`` (latency: a sample's values in slot vectors, with as many samples
            interleaved per ciphertext as the widest value leaves room for), ``"batch"``
            (throughput: one sample per slot) or ``"auto"`` (the cost model picks for
            ``objective``; ``prog.plan.why`` says why).
        objective: ``"latency"`` (least predicted round trip, client encryption and server, for
            one ciphertext) or ``"throughput"`` (least predicted time per sample); picks the
            packing when ``packing="auto"`` and the samples per ciphertext in vector packing.
        precision_bits: wanted output precision, in bits relative to the output range; or
            ``"argmax"`` for a classifier read by its largest output: the fewest bits whose
            promised error keeps the class of 99% of the calibration samples
            (:func:`argmax_precision`; the reason is in ``prog.options["precision"]`` and the
            summary). Fewer bits mean a smaller scale, often a shorter chain or a smaller ring.
        ring_degree, scale_bits: overrides of the automatic choice (still 128-bit secure).
        max_input_ciphertexts: input ciphertexts per sample the client may send so that the
            first map needs no rotation (vector packing).
        samples_per_ciphertext: vector packing's interleave (a power of two); default: the one
            the cost model predicts best for ``objective`` (more samples per ciphertext leave
            fewer slots to pack the client's input planes).
        batch_size: with ``objective="throughput"``, the samples a client sends at once (a
            partly filled ciphertext costs as much as a full one); default: full ciphertexts.
        cost_model: prices of SEAL's primitives (default :func:`he.costmodel.default_model`).
        security: classical security in bits, 128, 192 or 256 (SEAL's modulus budgets; higher
            levels hold fewer levels per ring, so may need a larger ring).
        server_threads: threads a server may use (default: the cores of this machine): in
            vector packing for a sample's rotations, in batch packing for a group's products,
            rescales and fused maps; the compiler keeps them where the cost model predicts
            them at least :data:`MIN_THREAD_GAIN` times as fast as one, else one thread
            (``prog.options["server_threads"]``, why in ``["threads_why"]``), and
            ``he.Server`` runs on that many unless told otherwise.
        bandwidth: bytes per second between client and server; where given, the objective
            counts the time the ciphertexts take on the link (``prog.plan.predicted`` has
            ``"upload_bytes"`` and ``"download_bytes"`` per request either way): a slow link
            favours fewer input ciphertexts and, for throughput, as many samples per byte as
            the plan allows (default: not counted).
        memory_budget: bytes the server may use; with ``packing="auto"`` a packing whose
            predicted server memory exceeds it is chosen only when none fits, and a vector plan
            whose Galois keys (one per distinct rotation) would exceed it composes its rotations
            from a power-of-two key basis instead (default: the memory available on this
            machine now). Where no candidate fits, the one needing least memory is returned
            with a :class:`~he.errors.MemoryBudgetWarning`. A given budget is kept with the
            program (``prog.memory_budget``), and a server given none of its own plans within
            what it leaves beside the keys (:meth:`CompiledProgram.server_room`).
        final_map: who applies the program's last affine map (a classifier's head, say) when
            the program ends with one after its last product, in vector and batch packing:
            ``"server"``; ``"client"``, which decrypts the values that map reads (vector
            packing: one ciphertext each; batch packing: a ciphertext per sum of the elements
            the map weighs alike, e.g. a channel's tokens under a mean pooling) and applies it
            in float64, so the server's chain is a level shorter on every path through it and
            the server skips the map; or ``"auto"``: both priced, the cheaper kept
            (``prog.plan.why`` says which). The client holds the compiled program, weights
            included, so it learns nothing it could not compute; the server still sees only
            ciphertexts. Tokens packing keeps it on the server.
        first_map: who applies the program's first affine maps, those that read only the
            input or what such maps compute (a patch embedding or a convolution, with the
            first Mu-Layer's projections the lowering composes into it), in vector packing:
            ``"server"`` (from the client's input, or its input planes); ``"client"``, which
            computes their values in float64 from the input it holds and encrypts each in the
            layout the server reads it in (:func:`polynets.ir.lowering.client_first`), so the
            server's chain is a level shorter on every path through them and the server skips
            them; or ``"auto"``: both priced (the upload included), the cheaper kept. As for
            ``final_map``, the client learns nothing it could not compute from the program it
            holds; a deployment that withholds the weights passes ``"server"`` to both.
        progress: show a progress bar of the candidates priced (each packing, chain of maps
            composed or kept apart, ring, and split of values wider than the slots; each a
            layout search under the cost model, seconds apiece for deep models).

    Raises:
        NotEncryptableError: the model is not a polynomial (message names the modules), or an
            argument is out of range.
        TooDeepError: more levels than any secure parameter set offers.
    """
    argmax = isinstance(precision_bits, str) and precision_bits == "argmax"
    if final_map not in FINAL_MAPS:
        raise NotEncryptableError(f"final_map must be one of {FINAL_MAPS}, got {final_map!r}")
    if first_map not in FIRST_MAPS:
        raise NotEncryptableError(f"first_map must be one of {FIRST_MAPS}, got {first_map!r}")
    _check_settings(packing, objective, batch_size, security, memory_budget,
                    samples_per_ciphertext, precision_bits=None if argmax else precision_bits,
                    scale_bits=scale_bits, max_input_ciphertexts=max_input_ciphertexts)
    program, cert, certified = _traced(model, example_input, security)
    check_products(program_degree_depth(program)[1], security)
    calib = _calibration_data(program, example_input, calibration)
    chunks: list[np.ndarray] | None = [] if argmax else None
    maxabs = program.max_abs(calib, outputs=chunks)
    if not all(np.isfinite(maxabs)):
        raise NotEncryptableError("the calibration data drives the model to non-finite values")
    precision_why = ""
    if chunks is not None:
        # the outputs of the same pass over the calibration data
        outputs = np.concatenate([np.asarray(c, dtype=np.float64) for c in chunks])
        precision_bits, precision_why = argmax_precision(
            outputs.reshape(outputs.shape[0], -1) if outputs.ndim > 2 else outputs,
            maxabs[program.output])
    if server_threads is not None:
        check_int(server_threads, "server_threads", error=NotEncryptableError)
    if bandwidth is not None and (isinstance(bandwidth, bool) or
                                  not isinstance(bandwidth, (int, float)) or
                                  not math.isfinite(bandwidth) or bandwidth <= 0):
        raise NotEncryptableError(f"bandwidth must be a positive number of bytes per second, "
                                  f"got {bandwidth!r}")
    options = {"precision_bits": int(precision_bits),
               "max_input_ciphertexts": int(max_input_ciphertexts), "objective": objective,
               "batch_size": None if batch_size is None else int(batch_size),
               "security": int(security),
               "server_threads": default_threads() if server_threads is None
               else int(server_threads)}
    if precision_why:
        options["precision"] = precision_why
    if bandwidth is not None:
        options["bandwidth"] = float(bandwidth)
    if memory_budget is not None:
        options["memory_budget"] = int(memory_budget)
    rings = (ring_degree,) if ring_degree is not None else RING_DEGREES
    costs = cost_model if cost_model is not None else default_model()
    kinds = PACKINGS if packing == "auto" else (packing,)
    found: list[CompiledProgram] = []
    error: TooDeepError | None = None
    calib64 = np.asarray(calib, dtype=np.float64)
    lowered_by_keep: dict[tuple[int, ...], tuple[Lowered, list[np.ndarray]]] = {}
    # a few dozen updates at most, each after seconds of work: every one is shown
    with tqdm(desc="compile", unit=" candidates", disable=not progress, leave=False,
              mininterval=0) as bar:
        def priced(what: str, kept_apart: bool) -> None:
            bar.set_postfix_str(what + (", maps kept apart" if kept_apart else ""),
                                refresh=False)
            bar.update(1)

        for kind in kinds:
            tried: list[CompiledProgram] = []
            unfit: TokensUnfit | None = None
            for keep, lowered, msq in _candidate_lowerings(program, calib64, certified, kind,
                                                           lowered_by_keep):
                for (client, first), low, m in _client_variants(lowered, msq, kind,
                                                                 final_map, first_map):
                    opts = {**options, "kept_apart": list(keep)} if keep else dict(options)
                    if client:
                        opts["client_map"] = True
                    if first:
                        opts["client_first"] = True
                    try:
                        tried.append(_compile_packing(program, low, kind, cert, maxabs, m,
                                                      opts, rings, costs, precision_bits,
                                                      scale_bits, samples_per_ciphertext,
                                                      memory_budget,
                                                      functools.partial(priced,
                                                                        kept_apart=bool(keep))))
                    except TooDeepError as exc:
                        if error is None or not (keep or client or first):
                            error = exc
                    except TokensUnfit as exc:
                        # another lowering may lay out by tokens (one that keeps a shift apart)
                        unfit = unfit or exc
            if not tried and unfit is not None and packing != "auto":
                raise unfit
            if tried:
                found.append(_keep_or_compose(tried, objective, batch_size, memory_budget))
    if not found:
        assert error is not None
        raise error
    chosen = _choose(found, packing, objective, batch_size, memory_budget)
    _warn_over_budget(chosen, memory_budget)
    return chosen


def _client_variants(lowered: Lowered, msq: list[np.ndarray], kind: str, final_map: str,
                     first_map: str) -> list[tuple[tuple[bool, bool], Lowered, list[np.ndarray]]]:
    """``((the client applies the last map, the client applies the first maps), lowered,
    per-step mean squares)`` of ``lowered`` in packing ``kind`` as ``final_map`` and
    ``first_map`` ask (:func:`compile`; the lowerings:
    :func:`polynets.ir.lowering.client_variants`): for ``"auto"`` both ways, for
    ``"client"`` the client's where it applies, for ``"server"`` the server's."""
    variants = client_variants(lowered, kind)

    def asked(on: bool, ask: str, clients: tuple[bool, bool]) -> bool:
        # "client": the server's way only where the client's does not apply
        return not on if ask == "server" else on or ask == "auto" or clients not in variants

    return [((last, first), low, [msq[i] for i in kept])
            for (last, first), (low, kept) in variants.items()
            if asked(last, final_map, (True, first)) and asked(first, first_map, (last, True))]


def _warn_over_budget(prog: CompiledProgram, memory_budget: int | None) -> None:
    """A :class:`~he.errors.MemoryBudgetWarning` where ``prog``'s server is predicted over the
    budget (``memory_budget``, else the memory available here): no candidate fitted."""
    budget = _server_budget(memory_budget)
    need = float(prog.plan.predicted.get("server_memory_bytes", 0))
    if need <= budget:
        return
    gib = 2.0 ** 30
    where = (f"memory_budget={budget / gib:.1f} GiB" if memory_budget is not None else
             f"the {budget / gib:.1f} GiB of memory available here (pass memory_budget= the "
             f"server's memory where it runs elsewhere)")
    warnings.warn(
        f"the server is predicted to need {need / gib:.1f} GiB (keys "
        f"{prog.key_bytes() / gib:.1f} GiB), more than {where}; none of the candidates the "
        f"compiler priced fits, so it kept the one that needs least. Fewer bits of "
        f"precision (precision_bits, or 'argmax' for a classifier) or a shallower or narrower "
        f"model shorten the chain", MemoryBudgetWarning, stacklevel=3)


def _candidate_lowerings(program: PolyProgram, calib: np.ndarray,
                         lowered: Lowered | None = None, kind: str = "vector",
                         cache: dict[tuple[int, ...], tuple[Lowered, list[np.ndarray]]]
                         | None = None
                         ) -> list[tuple[tuple[int, ...], Lowered, list[np.ndarray]]]:
    """``(kept apart, lowered, per-step mean squares)`` of the lowerings the compiler prices
    in packing ``kind``: every linear map composed (the fewest levels); where thin values
    several maps read were composed into each of them
    (:attr:`~polynets.ir.lowering.Lowered.shared`), those kept as steps of their own (fewer
    terms), and instead of the first, those composed only where composing pays in ``kind``
    (:func:`_worth_composing`; none: not priced); where some compositions in the kept one made
    a map much denser than its parts (:attr:`~polynets.ir.lowering.Lowered.dense_joins`),
    those kept apart too (a level more on their paths, maybe far fewer operations).
    ``cache``: lowerings already made, by what they keep (one compile's packings share them).

    Raises NotEncryptableError where no input element reaches the output (its weights cancel
    or are zero): the output is a constant, which no ciphertext can carry."""
    x = calib[:_NOISE_SAMPLES]
    cache = {} if cache is None else cache

    def made(keep: tuple[int, ...]) -> tuple[tuple[int, ...], Lowered, list[np.ndarray]]:
        if keep not in cache:
            low = lowered if not keep and lowered is not None else lower(program, keep)
            if not keep and not live_rows(low)[0].any():  # every path meets a zero weight
                raise NotEncryptableError(CONSTANT_OUTPUT)
            # per-element magnitudes of every step, for the noise growth (a bounded sample)
            cache[keep] = (low, step_values_msq(low, x))
        return (keep, *cache[keep])

    composed = made(())
    shared = composed[1].shared
    if not shared:
        out, base = [composed], composed[1]
    else:
        kept = made(tuple(shared))
        base, out = kept[1], [kept]
        worth = () if _SHARED_AS_STEPS[0] else _worth_composing(kind, kept[1], shared)
        if worth:
            out.insert(0, made(tuple(n for n in shared if n not in worth)))
    if base.dense_joins:
        out.append(made(tuple(sorted({*shared, *base.dense_joins}))))
    return out


#: set within :func:`shared_values_as_steps`
_SHARED_AS_STEPS = [False]


@contextmanager
def shared_values_as_steps() -> Iterator[None]:
    """Within it, :func:`compile` keeps every thin value several maps read
    (:attr:`~polynets.ir.lowering.Lowered.shared`) as a step of its own, without pricing
    them composed into their readers: the baseline composing them is measured against."""
    before = _SHARED_AS_STEPS[0]
    _SHARED_AS_STEPS[0] = True
    try:
        yield
    finally:
        _SHARED_AS_STEPS[0] = before


_FOLDS_ALONE = [False]


@contextmanager
def folds_one_at_a_time() -> Iterator[None]:
    """Within it, :func:`compile` plans every fold of a vector program as a rotation of its
    own (no hoisted groups, :func:`he.plan.fold_groups`): the baseline grouping them is
    measured against."""
    before = _FOLDS_ALONE[0]
    _FOLDS_ALONE[0] = True
    try:
        yield
    finally:
        _FOLDS_ALONE[0] = before


def _worth_composing(kind: str, kept: Lowered, shared: Sequence[int]) -> tuple[int, ...]:
    """Of the thin values several maps read (``shared``), those that may cost less composed
    into every reader than as a step of their own (their steps in ``kept``) in packing
    ``kind``: a step that costs a level there (a scaling; in vector packing a shift too), or
    in batch packing a sum of values of several levels, which it lifts first (a plaintext
    product and a rescale per ciphertext, :func:`he.plan.batch_lifts`). A sum of values of
    one level is additions only, and a selection in batch packing a reindexing: composed, they
    would only add terms to every reader (in vector packing, rotations)."""
    levels = step_levels(kept.steps, kind)
    out = []
    for node in shared:
        si = kept.kept_steps.get(node)
        if si is None:
            continue
        st = kept.steps[si]
        if not affine_is_free(st, kind) or (
                kind == "batch" and len({levels[j] for j in st.inputs}) > 1):
            out.append(node)
    return tuple(out)


def _keep_or_compose(tried: list["CompiledProgram"], objective: str, batch_size: int | None,
                     memory_budget: int | None) -> "CompiledProgram":
    """The cheaper for ``objective`` (server within ``memory_budget`` first) of one packing's
    programs compiled from every candidate lowering, its ``why`` saying what the other cost."""
    if len(tried) == 1:
        return tried[0]
    budget = _server_budget(memory_budget)
    unit = "s"
    groups = {int(p.plan.predicted["samples_per_ciphertext"]) for p in tried}
    if batch_size is None and len(groups) > 1 and all(p.packing == "batch" for p in tried):
        # batch programs of groups of several sizes (rings) compared on requests of the same
        # samples, the largest group's: a smaller group's round trip is not a faster answer
        objective, batch_size, unit = "throughput", max(groups), "s per sample"
    ((*_, best_s), best), ((*_, other_s), other) = sorted(
        ((_rank(p, objective, batch_size, budget), p) for p in tried), key=lambda t: t[0])[:2]

    def lowering(p: "CompiledProgram") -> str:
        kept = p.options.get("kept_apart")
        return (f"program nodes {kept} kept apart as steps of their own, the rest composed "
                f"into the maps that read them" if kept else
                "every value composed into the maps that read it") + (
            f", the last map applied by the client to the {len(p.lowered.outputs)} values the "
            f"server returns" + (f" ({sum(p.lowered.post.returned())} ciphertexts per group)"
                                 if p.packing == "batch" and p.lowered.post else "")
            if p.options.get("client_map") else "") + (
            ", the first maps applied by the client, which encrypts their values"
            if p.options.get("client_first") else "")

    why = (f"; of {len(tried)} lowerings priced, {lowering(best)}: {best.params.levels} levels, "
           f"predicted {best_s:.3g} {unit} against {other_s:.3g} {unit} with {lowering(other)} "
           f"({other.params.levels} levels)")
    return _with_why(best, str(best.options.get("why", "")) + why)
