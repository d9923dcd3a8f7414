"""The two CKKS interpreters of a polynomial program.

* :func:`run_batch`: batch packing. A value of sample shape ``S`` is a flat list of ``prod(S)``
  elements, each a SEAL ciphertext (one sample per slot) or a Python float (a value known in the
  clear, e.g. a zero from padding or a constant). Linear maps are sums of plaintext-scalar
  products rescaled once per output; zero weights are skipped; gathers are reindexing. A
  product step the compiler marks lazy (``program.options["lazy_products"]``) leaves its
  products unrelinearised and unrescaled, and the weighted maps reading them finish their own
  outputs (:func:`_mul_step`, :func:`_lazy_rows`).
* :func:`run_vector`: vector packing over a :class:`~he.plan.VectorPlan` with plaintexts encoded
  once by :class:`VectorKernels`.
"""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from he.backend import Engine
from he.errors import SerializationError
from he.fused import FUSED_MIN_FANIN, fuse_map, raw_access
from he.hoist import Extended
from he.params import read_levels
from he.plan import VectorPlan, rows_reading
from he.tiling import Segment, finish_chunk, release_points, tile_plan
from polynets.ir.lowering import Lowered, Step, affine_is_free, integer_factor, step_levels

__all__ = ["live_rows", "run_batch", "eager_products", "VectorKernels", "run_vector",
           "take_spare", "keep_spare", "spare_buffers", "SpillFile"]

Elem = Any  # a seal.Ciphertext or a float


def _is_ct(e: Elem) -> bool:
    return not isinstance(e, float)


def _scale_elem(eng: Engine, e: Elem, v: float) -> Elem:
    if not _is_ct(e):
        return e * v
    if v == 0.0:
        return 0.0
    k = integer_factor(v)
    if k is not None:
        return eng.mul_int(e, k)
    return eng.rescale(eng.mul_scalar(e, v))


def _mul_step(eng: Engine, xs: list[Elem], ys: list[Elem], rows: np.ndarray,
              buffers: "_Buffers", lazy: bool = False) -> list[Elem]:
    """A product step's live rows. Products of two ciphertexts are computed in recycled
    three-polynomial buffers, relinearised and rescaled into recycled ones, spread over the
    engine's threads (:func:`_threaded`); a product with a clear value is a scaling. ``lazy``
    (a step :func:`he.plan.choose_lazy` chose): the products are left unrelinearised and
    unrescaled, three polynomials at their inputs' level carrying the square of their scale,
    which the maps reading them finish (:func:`_lazy_rows`)."""
    out: list[Elem] = [0.0] * len(rows)
    pairs = []
    for i in np.flatnonzero(rows):
        a, b = xs[i], ys[i]
        if _is_ct(a) and _is_ct(b):
            pairs.append(int(i))
        else:
            out[i] = _scale_elem(eng, a, b) if _is_ct(a) else _scale_elem(eng, b, a)

    def prepare(i: int) -> tuple[Any, int, Callable[[Any], Any]]:
        a, b = xs[i], ys[i]
        level = max(eng.level(a), eng.level(b))
        scratch = buffers.take(eng, level, 3)
        if lazy:
            # the product is the result: no buffer of the next level
            return scratch, None, lambda _: eng.multiply_lazy(a, b, scratch)
        return scratch, level + 1, lambda into: eng.multiply(a, b, out=scratch, into=into)

    for i, res in zip(pairs, _threaded(eng, buffers, pairs, prepare)):
        out[i] = res
    return out


_EAGER = [False]


@contextmanager
def eager_products() -> Iterator[None]:
    """Within it, batch servers of this process finish every product (relinearise and rescale
    it) even where their program leaves some unrelinearised for the maps that read them
    (``program.options["lazy_products"]``): the baseline the lazy products are measured
    against, with the same program, keys and request."""
    before = _EAGER[0]
    _EAGER[0] = True
    try:
        yield
    finally:
        _EAGER[0] = before


def _is_lazy(e: Elem) -> bool:
    """Whether ``e`` is a product left unrelinearised and unrescaled (three polynomials)."""
    return _is_ct(e) and e.size() == 3


def _threaded(eng: Engine, buffers: "_Buffers", items: Sequence[Any],
              prepare: Callable[[Any], tuple[Any, int | None, Callable[[Any], Any]]]
              ) -> list[Any]:
    """For every item, ``prepare(item)`` gives ``(scratch, level, compute)``; returns each
    ``compute(into)``, ``into`` a recycled buffer of ``level`` (None: no buffer, the result
    is ``scratch``), and frees whichever of ``scratch`` and ``into`` the result is not. The
    computations (SEAL calls that release the GIL, :mod:`he.native`) run on the engine's
    threads, a few chunks' worth at a time: buffers are taken and returned in this thread, so a
    chunk's freed buffers serve the next and the memory held stays that of a few rows."""
    results: list[Any] = []
    chunk = finish_chunk(eng.pool.threads)
    for k in range(0, len(items), chunk):
        jobs = [prepare(x) for x in items[k:k + chunk]]
        intos = [None if level is None else buffers.take(eng, level) for _, level, _ in jobs]
        done = eng.pool.map(lambda pair: pair[0](pair[1]),
                            [(compute, into) for (_, _, compute), into in zip(jobs, intos)])
        for (scratch, _, _), into, res in zip(jobs, intos, done):
            spare = scratch if res is into else into
            if spare is not None:
                buffers.recycle(spare)
        results.extend(done)
    return results


def _load_inputs(eng: Engine, buffers: "_Buffers", load: Callable[[Any, Any], Any],
                 items: Sequence[Any]) -> list[Any]:
    """``items`` with every serialised input loaded (``load(x, into)``; constants pass), each
    into a free buffer of the inputs' level, on the engine's threads: a direct load releases
    the GIL while SEAL regenerates a seeded ciphertext's random half (:func:`he.wire.loads`). A
    load that did not use its buffer is copied into one, so that its own storage goes back to
    SEAL's pool for the next load."""
    todo = [i for i, x in enumerate(items) if not isinstance(x, float)]
    intos = [buffers.take(eng, 0) for _ in todo]
    done = eng.pool.map(lambda j: load(items[todo[j]], intos[j]), range(len(todo)))
    out = list(items)
    for i, into, ct in zip(todo, intos, done):
        if ct is not into:
            buffers.recycle(into)
            ct = buffers.adopt(eng, ct)
        out[i] = ct
    return out


def live_rows(lowered: Lowered) -> list[np.ndarray]:
    """For every step, which of its elements can reach the output (bool masks).

    An element is dead when every path from it meets a zero weight or a gather that drops it
    (e.g. pixels a strided convolution never covers); batch packing neither computes, encrypts
    nor sends it. Which elements are dead depends on the public program only, never on the data.
    """
    steps = lowered.steps
    live = [np.zeros(st.n, dtype=bool) for st in steps]
    if lowered.post is None:
        live[lowered.output][:] = True
    else:
        # the elements the client's map weighs (those the server sums for it)
        post = lowered.post
        for j, m in zip(post.reads, post.sums or post.terms):
            live[j] |= np.asarray(abs(m.tocsc()).sum(axis=0)).ravel() > 0
    for si in range(len(steps) - 1, -1, -1):
        st, rows = steps[si], live[si]
        if not rows.any():
            continue
        if st.kind == "affine":
            for j, m in zip(st.inputs, st.terms):
                used = np.asarray(abs(m.tocsr()[rows]).sum(axis=0)).ravel() > 0
                live[j] |= used
        else:
            for j in st.inputs:
                live[j] |= rows
    return live


def _lift_all(eng: Engine, xs: list[Elem], level: int) -> list[Elem]:
    return [eng.lift(e, level) if _is_ct(e) else e for e in xs]


#: Bytes of encoded weights batch packing keeps for reuse (each distinct weight is encoded once
#: while it fits).
PLAIN_CACHE_BYTES = 256 * 2 ** 20


def _plain_cache_size(eng: Engine, level: int) -> int:
    """Encoded scalars that fit :data:`PLAIN_CACHE_BYTES` at ``level``."""
    per = eng.params.poly_modulus_degree * eng.params.limbs(level) * 8
    return max(64, PLAIN_CACHE_BYTES // per)


def _moduli(eng: Engine, level: int) -> list[int]:
    return [m.value() for m in eng.context.get_context_data(eng.parms_ids[level]).parms()
            .coeff_modulus()]


class _Buffers:
    """Ciphertexts of released values and scratch space, reused as output buffers: SEAL writes
    into an existing ciphertext without allocating while its storage holds the result, so a
    buffer of a higher level (more primes) or of three polynomials serves any smaller result.
    Fresh memory costs more than the arithmetic written into it (the kernel zero-fills every
    page on first touch). A ciphertext is recycled only when no live value holds it."""

    def __init__(self) -> None:
        #: free ciphertexts by the words their storage holds
        self.free: dict[int, list[Any]] = {}
        self._parked: set[int] = set()      # their ids: a ciphertext is parked once

    def recycle(self, ct: Any) -> None:
        if id(ct) not in self._parked:
            self._parked.add(id(ct))
            self.free.setdefault(int(ct.dyn_array().capacity()), []).append(ct)

    def release(self, dead: list[Elem], live: Iterable[list[Elem] | None],
                pinned: Iterable[int] = ()) -> None:
        """Recycle the ciphertexts of a value that died, except those a live value or the
        caller (``pinned`` ids) still holds."""
        held = {id(e) for x in live if x is not None for e in x if _is_ct(e)} | set(pinned)
        for e in dead:
            if _is_ct(e) and id(e) not in held:
                self.recycle(e)

    def take(self, eng: Engine, level: int, size: int = 2) -> Any:
        """A ciphertext whose storage holds ``size`` polynomials at ``level``, to be overwritten
        by a SEAL result: the smallest free buffer that holds them (resized), else an empty
        one (SEAL sizes it when it writes)."""
        return self._take(eng, eng.parms_ids[level], eng.params.limbs(level), size)

    def _take(self, eng: Engine, parms_id: Any, limbs: int, size: int) -> Any:
        need = size * eng.params.poly_modulus_degree * limbs
        cap = min((c for c, pool in self.free.items() if c >= need and pool), default=None)
        if cap is None:
            return eng.new_ciphertext()
        out = self.free[cap].pop()
        self._parked.discard(id(out))
        out.resize(eng.context, parms_id, size)
        return out

    def adopt(self, eng: Engine, ct: Any) -> Any:
        """``ct`` (just loaded) in the smallest free buffer that holds it, its words copied, so
        that its own storage goes back to SEAL's pool for the next load; ``ct`` itself where
        none does."""
        need = ct.size() * eng.params.poly_modulus_degree * ct.coeff_modulus_size()
        if not any(c >= need and pool for c, pool in self.free.items()):
            return ct
        out = self._take(eng, ct.parms_id(), ct.coeff_modulus_size(), ct.size())
        eng.copy_into(ct, out)
        return out

    def like(self, eng: Engine, ct: Any) -> Any:
        """A ciphertext with ``ct``'s level, size, scale and NTT form (words to be overwritten)."""
        out = self._take(eng, ct.parms_id(), ct.coeff_modulus_size(), ct.size())
        if not out.is_ntt_form():
            eng.evaluator.negate(ct, out)      # an empty buffer takes the form from a copy
        out.scale = ct.scale
        return out


def _fused_rows(eng: Engine, si: int, st: Step, srcs: list[list[Elem]], rows: np.ndarray,
                level: int, min_fanin: int, cache: dict[Any, Any],
                buffers: _Buffers, partial: np.ndarray | None = None) -> dict[int, Elem]:
    """The rows of a weighted affine step computed as one integer matrix product
    (:mod:`he.fused`), constants added, rescaled once; rows left to SEAL's chain are absent.

    Inputs below ``level`` are read at ``level``'s limbs (a switch down without rescaling) with
    their weights encoded at the scale that brings each product to the common one, so no input
    is lifted or copied. ``partial``: a part of the rows' sums (:func:`_affine_batch`): left at
    the product's scale, without the bias; the clear inputs' share is added to ``partial``."""
    if min_fanin <= 0:
        return {}
    cts = [np.fromiter((_is_ct(e) for e in x), dtype=bool, count=len(x)) for x in srcs]
    first = next((e for x in srcs for e in x if _is_ct(e)), None)
    if first is None or not raw_access(first).ok:
        return {}
    raw = raw_access(first)
    moduli = _moduli(eng, level)
    product = eng.scales[level] ** 2
    lv = [np.array([eng.level(e) if is_ct else level for e, is_ct in zip(x, c)])
          for x, c in zip(srcs, cts)]
    key = (si, level, rows.tobytes(), b"".join(c.tobytes() + v.tobytes() for c, v in zip(cts, lv)))
    if key not in cache:
        col_scales = [product / np.asarray(eng.scales)[v] for v in lv]
        cache[key] = fuse_map([m.tocsr() for m in st.terms], cts, col_scales,
                              np.flatnonzero(rows), moduli, min_fanin=min_fanin)
    fmap, covered = cache[key]
    if fmap is None:
        return {}
    inputs = [e for x, c in zip(srcs, cts) for e, is_ct in zip(x, c) if is_ct]
    template = next((e for e in inputs if eng.level(e) == level), None)
    spare = None
    if template is None:
        # none of the inputs (a tile's part of them) at the step's level: the outputs' shape
        # from one switched down to its primes (a copy of words, no product)
        template = spare = buffers.take(eng, level)
        eng.evaluator.mod_switch_to(inputs[0], eng.parms_ids[level], template)
    outputs = [buffers.like(eng, template) for _ in range(covered.size)]
    if spare is not None:
        buffers.recycle(spare)
    # clear values (constants, padding) and the bias join at the product's scale
    const = np.zeros(covered.size)
    if st.bias is not None and partial is None:
        const += np.asarray(st.bias, dtype=np.float64)[covered]
    for x, m, c in zip(srcs, st.terms, cts):
        if (~c).any():
            clear = np.array([0.0 if is_ct else float(e) for e, is_ct in zip(x, c)])
            const += m.tocsr()[covered] @ clear
    if partial is not None:
        partial[covered] += const
        const[:] = 0.0
    fmap.apply(raw, inputs, outputs, moduli, [round(v * product) for v in const], eng.pool)
    if partial is not None:
        for out in outputs:
            out.scale = product
        return {int(r): out for r, out in zip(covered, outputs)}

    def prepare(out: Any) -> tuple[Any, int, Callable[[Any], Any]]:
        out.scale = product
        # rescaled into a recycled buffer; the product's serves a later row
        return out, level + 1, lambda into: eng.to_level(out, level + 1, into=into)

    return {int(r): res for r, res in zip(covered, _threaded(eng, buffers, outputs, prepare))}


def _affine_batch(eng: Engine, si: int, st: Step, srcs: list[list[Elem]], rows: np.ndarray,
                  plains: dict[tuple[float, int, float], Any], min_fanin: int,
                  fused_maps: dict[Any, Any], buffers: _Buffers, level: int | None = None,
                  partial: np.ndarray | None = None) -> list[Elem]:
    """One affine step on batch-packed elements: each live output is a sum of plaintext-scalar
    products rescaled once (or a plain sum when the step is a selection). Rows with several
    ciphertext terms are one fused integer matrix product (:mod:`he.fused`) where the process
    allows it; the rest use SEAL's multiply/add chain at a common level, inputs below it read
    at its primes as the fused rows read them (``level``: the step's, where not every input is
    given, as in a tile).

    ``partial`` (a weighted step): ``srcs`` hold a part of the inputs (the rest ``0.0``); the
    rows' sums over that part are returned at the product's scale, not rescaled, without the
    bias (``0.0`` where the part has no ciphertext), and the clear inputs' share is added to
    ``partial`` (per row): parts summed and finished by :func:`_finish_sums` give the step."""
    if level is None:
        level = max((eng.level(e) for x in srcs for e in x if _is_ct(e)), default=0)
    mats = [m.tocsr() for m in st.terms]
    free = affine_is_free(st, "batch")
    out: list[Elem] = [0.0] * st.n
    fused = {} if free else _fused_rows(eng, si, st, srcs, rows, level, min_fanin, fused_maps,
                                        buffers, partial)
    for r, e in fused.items():
        out[r] = e
    rest = np.array([r for r in np.flatnonzero(rows) if r not in fused], dtype=np.int64)
    if rest.size == 0:
        return out
    lifted: dict[tuple[int, int], Elem] = {}

    def elem(t: int, c: int) -> Elem:
        if (t, c) not in lifted:
            e = srcs[t][c]
            if _is_ct(e) and eng.level(e) != level:
                # its primes dropped to the step's level, its scale kept: its weights are
                # encoded at the scale that brings its products to the others' (as fused rows)
                down = buffers.take(eng, level)
                eng.evaluator.mod_switch_to(e, eng.parms_ids[level], down)
                e = down
                copies.append(e)
            lifted[(t, c)] = e
        return lifted[(t, c)]

    copies: list[Any] = []         # inputs brought to the step's level, in buffers
    if free:
        # the inputs below the step's level that live rows read, lifted on the engine's threads
        # (a product with an encoded one and a rescale each, he.plan.batch_lifts; computed a
        # prime above the step's level, so in buffers of that size)
        low = sorted({(t, int(c)) for t, m in enumerate(mats)
                      for c in m[rest].indices if _is_ct(srcs[t][int(c)])
                      and eng.level(srcs[t][int(c)]) != level})
        outs = [buffers.take(eng, max(level - 1, 0)) for _ in low]
        done = eng.pool.map(lambda i: eng.lift(srcs[low[i][0]][low[i][1]], level,
                                               out=outs[i]), range(len(low)))
        for key, e in zip(low, done):
            lifted[key] = e
            copies.append(e)

    term = eng.new_ciphertext()
    scale = eng.scales[level] if level < len(eng.scales) else 0.0
    for r in rest:
        const = float(st.bias[r]) if st.bias is not None and partial is None else 0.0
        acc, summed = None, False
        for t, m in enumerate(mats):
            lo, hi = m.indptr[r], m.indptr[r + 1]
            for c, w in zip(m.indices[lo:hi], m.data[lo:hi]):
                e = elem(t, int(c))
                if not _is_ct(e):
                    const += float(w) * e
                elif not free and abs(w) * scale < 0.5:
                    continue                # encodes to zero: SEAL refuses the empty product
                elif free:
                    if acc is None:
                        acc = e
                    elif summed:
                        eng.add_inplace(acc, e)
                    else:           # the first sum of the row goes to a buffer of its own
                        acc, summed = eng.add(acc, e, out=buffers.take(eng, level)), True
                else:
                    # the products' common scale is scale^2 (an input switched down keeps
                    # its own scale)
                    at = scale if e.scale == scale else scale * scale / e.scale
                    key = (float(w), level, at)
                    if key not in plains:
                        if len(plains) >= _plain_cache_size(eng, level):
                            plains.clear()
                        plains[key] = eng.encode_scalar(float(w), level, at)
                    if acc is None:         # the row's sum, in a recycled buffer
                        acc = buffers.take(eng, level)
                        eng.mul_plain_into(e, plains[key], acc)
                    else:
                        eng.mul_plain_into(e, plains[key], term)
                        eng.add_inplace(acc, term)
        if partial is not None:
            partial[r] += const
            out[r] = acc if acc is not None else 0.0
            continue
        if acc is None:
            out[r] = const
            continue
        if free and not summed:             # the input itself: a constant needs a copy
            out[r] = eng.add_plain_scalar(acc, const) if const != 0.0 else acc
            continue
        res = acc
        if not free:                        # rescaled into a recycled buffer
            into = buffers.take(eng, level + 1)
            res = eng.to_level(acc, level + 1, into=into)
            buffers.recycle(acc if res is into else into)
        if const != 0.0:
            eng.add_scalar_inplace(res, const)
        out[r] = res
    kept = {id(e) for e in out if _is_ct(e)}
    for e in copies:
        if id(e) not in kept:
            buffers.recycle(e)
    return out


def _add_sums(eng: Engine, sums: dict[int, Any], part: list[Elem], buffers: _Buffers) -> None:
    """Add a part's sums (:func:`_affine_batch` with ``partial``) into ``sums`` (by row)."""
    for r, e in enumerate(part):
        if not _is_ct(e):
            continue
        if r in sums:
            eng.add_inplace(sums[r], e)
            buffers.recycle(e)
        else:
            sums[r] = e


def _lazy_rows(eng: Engine, si: int, st: Step, srcs: list[list[Elem]], rows: np.ndarray,
               level: int, cache: dict[Any, Any], buffers: _Buffers) -> dict[int, Any]:
    """The rows of a weighted step (computed at ``level``) over its lazy inputs only
    (``srcs``: the three-polynomial products of :func:`_mul_step`, ``0.0`` elsewhere): their
    sums at the products' primes (one fused map where it can be, else SEAL's chain), weights at
    the scale of ``level``, three polynomials each (by row; summed over a reduction's tiles
    before :func:`_finish_lazy`)."""
    lo = level - 1
    cts = [np.fromiter((_is_ct(e) for e in x), dtype=bool, count=len(x)) for x in srcs]
    mats = [m.tocsr() for m in st.terms]
    out_rows = np.flatnonzero(rows & rows_reading(mats, cts))
    inputs = [e for x, c in zip(srcs, cts) for e, is_ct in zip(x, c) if is_ct]
    if out_rows.size == 0 or not inputs:
        return {}
    w_scale = eng.scales[level]
    moduli = _moduli(eng, lo)
    key = ("lazy", si, out_rows.tobytes(), b"".join(c.tobytes() for c in cts))
    if key not in cache:
        cache[key] = fuse_map(mats, cts, [np.full(len(x), w_scale) for x in srcs], out_rows,
                              moduli, min_fanin=1)
    fmap, covered = cache[key]
    sums: dict[int, Any] = {}
    raw = raw_access(inputs[0])
    if fmap is not None and raw.ok:
        outputs = [buffers.like(eng, inputs[0]) for _ in range(covered.size)]
        fmap.apply(raw, inputs, outputs, moduli, None, eng.pool)
        sums = {int(r): o for r, o in zip(covered, outputs)}
    term = eng.new_ciphertext()
    for r in out_rows:
        if int(r) in sums:
            continue
        acc = None
        for t, m in enumerate(mats):
            lo_i, hi_i = m.indptr[r], m.indptr[r + 1]
            for c, w in zip(m.indices[lo_i:hi_i], m.data[lo_i:hi_i]):
                e = srcs[t][int(c)]
                if not _is_ct(e) or abs(w) * w_scale < 0.5:
                    continue
                pt = eng.encode_scalar(float(w), lo, w_scale)
                if acc is None:
                    acc = buffers.take(eng, lo, 3)
                    eng.mul_plain_into(e, pt, acc)
                else:
                    eng.mul_plain_into(e, pt, term)
                    eng.add_inplace(acc, term)
        if acc is not None:
            sums[int(r)] = acc
    return sums


def _finish_lazy(eng: Engine, sums: dict[int, Any], level: int,
                 buffers: _Buffers) -> dict[int, Any]:
    """Sums of :func:`_lazy_rows`, each relinearised and rescaled by the prime the products
    kept, so that it lands on the primes and product scale of the step's ``level``, as the
    rest of its sum (:func:`_affine_batch` with ``partial``)."""
    product = eng.scales[level] ** 2
    out: dict[int, Any] = {}
    for r, acc in sums.items():
        eng.evaluator.relinearize_inplace(acc, eng.relin_keys)
        dst = buffers.take(eng, level)
        eng.rescale_into(acc, dst)
        dst.scale = product
        buffers.recycle(acc)
        out[r] = dst
    return out


def _affine_lazy(eng: Engine, si: int, st: Step, srcs: list[list[Elem]], rows: np.ndarray,
                 plains: dict[tuple[float, int, float], Any], min_fanin: int,
                 fused_maps: dict[Any, Any], buffers: _Buffers, level: int,
                 partial: np.ndarray | None = None,
                 lazy_sums: dict[int, Any] | None = None) -> list[Elem]:
    """A weighted step that reads lazy products (:func:`_mul_step`): its sums over the other
    inputs at the product's scale (:func:`_affine_batch` with ``partial``) plus those over the
    lazy ones (:func:`_lazy_rows`, :func:`_finish_lazy`), each row rescaled once with its bias
    and clear share added (:func:`_finish_sums`).

    ``partial`` (a reduction's tile, :func:`_affine_batch`): returns the part's sums over the
    other inputs only, and adds those over the lazy ones to ``lazy_sums`` (three polynomials,
    by row), to be finished once after the last tile (:func:`_finish_parts`)."""
    normal = [[0.0 if _is_lazy(e) else e for e in x] for x in srcs]
    lazy = [[e if _is_lazy(e) else 0.0 for e in x] for x in srcs]
    clear = np.zeros(st.n) if partial is None else partial
    part = _affine_batch(eng, si, st, normal, rows, plains, min_fanin, fused_maps, buffers,
                         level, clear)
    raw = _lazy_rows(eng, si, st, lazy, rows, level, fused_maps, buffers)
    if partial is not None:
        assert lazy_sums is not None
        _add_sums(eng, lazy_sums, [raw.get(r, 0.0) for r in range(st.n)], buffers)
        return part
    sums = {r: e for r, e in enumerate(part) if _is_ct(e)}
    return _finish_parts(eng, st, sums, raw, clear, rows, level, buffers)


def _finish_parts(eng: Engine, st: Step, sums: dict[int, Any], lazy_sums: dict[int, Any],
                  clear: np.ndarray, rows: np.ndarray, level: int,
                  buffers: _Buffers) -> list[Elem]:
    """A weighted step from its sums over its other inputs (``sums``, at the product's scale)
    and over its lazy products (``lazy_sums``, :func:`_lazy_rows`): the latter finished
    (:func:`_finish_lazy`) and added to the former, then :func:`_finish_sums`."""
    finished = _finish_lazy(eng, lazy_sums, level, buffers)
    _add_sums(eng, sums, [finished.get(r, 0.0) for r in range(st.n)], buffers)
    return _finish_sums(eng, st, sums, clear, rows, level, buffers)


def _finish_sums(eng: Engine, st: Step, sums: dict[int, Any], clear: np.ndarray,
                 rows: np.ndarray, level: int, buffers: _Buffers) -> list[Elem]:
    """A weighted step from its summed parts: each row's sum rescaled once, its bias and clear
    inputs' share added (a row with no ciphertext is that constant)."""
    const = clear + (np.asarray(st.bias, dtype=np.float64) if st.bias is not None else 0.0)
    out: list[Elem] = [0.0] * st.n
    for r in np.flatnonzero(rows):
        if int(r) not in sums:
            out[r] = float(const[r])
    have = sorted(sums)

    def prepare(r: int) -> tuple[Any, int, Callable[[Any], Any]]:
        acc = sums[r]
        return acc, level + 1, lambda into: eng.to_level(acc, level + 1, into=into)

    for r, res in zip(have, _threaded(eng, buffers, have, prepare)):
        if const[r] != 0.0:
            eng.add_scalar_inplace(res, float(const[r]))
        out[r] = res
    return out


class SpillFile:
    """Rows of a batch group written out between the tiles that read them
    (:func:`he.tiling.spills`) and read back into ciphertext buffers.

    An unlinked temporary file (private to this process, gone once closed, on disk: not in
    ``/dev/shm``): each row's words go to an offset that is reused once the row is read back,
    so the file holds at most the rows out at once. Its scale and a CRC-32 of its words are
    kept here; a row that comes back short or with another checksum raises
    :class:`~he.errors.SerializationError`: a corrupted file is an error, never a wrong
    answer. Where the words cannot be reached in place (:mod:`he.fused`'s validated layout),
    :meth:`write` writes nothing and returns False: rows then stay in memory.
    """

    def __init__(self) -> None:
        self._file: Any = None
        self._raw: Any = None
        self._free: dict[int, list[int]] = {}
        self._end = 0
        self._rows: dict[Any, tuple[int, int, float, int, Any]] = {}
        #: rows written out, and read back
        self.written = self.read_back = 0

    def write(self, key: Any, ct: Any) -> bool:
        """Write ``ct``'s words out under ``key``; False (nothing written) where it cannot."""
        if self._raw is None:
            self._raw = raw_access(ct)
        if not self._raw.ok or key in self._rows:
            return False
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="polynets-spill-")
        words = memoryview(self._raw.view(ct)).cast("B")
        size = words.nbytes
        offsets = self._free.get(size)
        if offsets:
            at = offsets.pop()
        else:
            at, self._end = self._end, self._end + size
        fd, done = self._file.fileno(), 0
        while done < size:
            done += os.pwrite(fd, words[done:], at + done)
        self._rows[key] = (at, size, float(ct.scale), zlib.crc32(words), ct.parms_id())
        self.written += 1
        return True

    def read(self, key: Any, ct: Any, context: Any) -> Any:
        """The row written under ``key``, its words read into ``ct`` (a buffer of ``context``,
        resized to the row's level and two polynomials, flagged in NTT form), its scale
        restored."""
        at, size, scale, crc, parms_id = self._rows.pop(key)
        ct.resize(context, parms_id, 2)
        self._raw.mark_ntt_form(ct)
        words = memoryview(self._raw.view(ct)).cast("B")
        if words.nbytes != size:
            raise SerializationError(f"a row spilled to disk was {size} bytes, its buffer "
                                     f"holds {words.nbytes}")
        fd, done = self._file.fileno(), 0
        while done < size:
            got = os.preadv(fd, [words[done:]], at + done)
            if got <= 0:
                raise SerializationError("a row spilled to disk came back short (the file was "
                                         "truncated)")
            done += got
        if zlib.crc32(words) != crc:
            raise SerializationError("a row spilled to disk came back corrupted (checksum "
                                     "mismatch)")
        ct.scale = scale
        self._free.setdefault(size, []).append(at)
        self.read_back += 1
        return ct

    def holds(self, key: Any) -> bool:
        return key in self._rows

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._rows.clear()
        self._free.clear()
        self._end = 0


def run_batch(eng: Engine, lowered: Lowered, live: list[np.ndarray], inputs: list[Any],
              progress: bool = False, fanin: Sequence[int] | None = None,
              tiles: Sequence[tuple[Segment, int]] = (), own_inputs: bool = False,
              lazy: Sequence[int] = (), load: Callable[[Any, Any], Any] | None = None,
              spare: list[Any] | None = None, spill: SpillFile | None = None) -> list[Elem]:
    """Evaluate the lowered program on one group of batch-packed input ciphertexts (flat input
    order; dead inputs, see :func:`live_rows`, may be given as ``0.0``). ``fanin[s]``: the
    fan-in from which step ``s``'s weighted rows are fused (the compiler's choice; ``0``: none;
    default :data:`~he.fused.FUSED_MIN_FANIN`). ``tiles``: segments (:mod:`he.tiling`) run in
    that many tiles each, their inner values held one tile at a time (same results).
    ``own_inputs``: the input ciphertexts are handed over (no one else holds them): they are
    dropped from ``inputs`` and reused once every step reading them has run. ``lazy``: product
    steps left unrelinearised and unrescaled for the maps that read them
    (:func:`he.plan.choose_lazy`; a reduction in tiles sums its tiles' parts over them and
    finishes each row once; not with ``spill``). ``load``: the inputs are handed over
    unloaded (serialised ciphertexts, validated), ``load(x, into)`` a ciphertext of one
    (``into``: a free buffer it may load into; on the engine's threads, :func:`_load_inputs`):
    a segment that reads every input loads each in the tile that first reads it
    (:attr:`he.tiling.Segment.load`), into the buffer of a value that died where one holds it;
    without such a segment all are loaded first, each into a ``spare`` buffer that holds it.
    ``spare``: free ciphertexts (of an earlier group, or allocated before the first,
    :meth:`he.Server.warm`) that results are written into, the smallest that holds each, before
    any new storage is taken; handed over, and refilled with the group's free buffers at its
    end. ``spill``: the segments' tiles write the
    rows they hold for a later tile out to it and read them back there
    (:func:`he.tiling.spills`; same results), their buffers reused meanwhile."""
    steps = lowered.steps
    tiles = [(seg, k) for seg, k in tiles if k > 1]
    buffers = _Buffers()
    if spare is not None:
        for ct in spare:
            buffers.recycle(ct)
        spare.clear()
    if load is not None:
        if not own_inputs:
            raise ValueError("inputs handed over unloaded are owned by the evaluation")
        if not any(seg.load is not None for seg, _ in tiles):
            # each into a free buffer, its own storage back to SEAL's pool for the next load
            # (a request's inputs in fresh memory, left free at the end, would grow the free
            # buffers a process keeps by a request's inputs at every request)
            inputs[:] = _load_inputs(eng, buffers, load, inputs)
            load = None
    # inputs still to load (by row), absent (0.0) until a tile loads them
    pending = {r: e for r, e in enumerate(inputs) if not isinstance(e, float)} \
        if load is not None else {}
    for r in pending:
        inputs[r] = 0.0
    lazy = frozenset() if _EAGER[0] else frozenset(int(m) for m in lazy)
    if lazy and spill is not None:
        raise ValueError("lazy products are for a group whose tiles need no spill")
    end_of = {seg.end: (seg, k) for seg, k in tiles}
    inner = {s for seg, _ in tiles for s in seg.steps if s != seg.end}   # run at the end
    ever_inner = {s for seg, _ in tiles for s in seg.inner}
    remaining = [0] * len(steps)
    for st in steps:
        for j in set(st.inputs):
            remaining[j] += 1
    vals: list[list[Elem] | None] = [None] * len(steps)
    plains: dict[tuple[float, int, float], Any] = {}
    fused_maps: dict[Any, Any] = {}
    # the caller's: never recycled
    pinned = set() if own_inputs else {id(e) for e in inputs if _is_ct(e)}

    levels = step_levels(steps, "batch")

    def in_level(si: int) -> int:
        """The level a weighted step's rows are computed at: its inputs' (read in a tile, some
        of them may be absent)."""
        return max((levels[j] for j in steps[si].inputs if live[j].any()), default=0)

    def compute(si: int, ins: list[list[Elem]], rows: np.ndarray, part: bool = False,
                partial: np.ndarray | None = None,
                lazy_sums: dict[int, Any] | None = None) -> list[Elem]:
        """Step ``si``'s ``rows``; ``part``: ``ins`` hold a tile's rows only (the step's level
        is its own, not that of the rows given); ``partial``: a reduction's part
        (:func:`_affine_batch`; its sums over lazy products go to ``lazy_sums``,
        :func:`_affine_lazy`)."""
        st = steps[si]
        if st.kind == "affine" and lazy.intersection(st.inputs):
            return _affine_lazy(eng, si, st, ins, rows, plains,
                                FUSED_MIN_FANIN if fanin is None else int(fanin[si]),
                                fused_maps, buffers, in_level(si), partial, lazy_sums)
        if st.kind == "affine":
            return _affine_batch(eng, si, st, ins, rows, plains,
                                 FUSED_MIN_FANIN if fanin is None else int(fanin[si]),
                                 fused_maps, buffers, in_level(si) if part else None, partial)
        if st.kind == "mul":
            return _mul_step(eng, ins[0], ins[1], rows, buffers, lazy=si in lazy)
        return [_scale_elem(eng, p, float(st.factor)) if r else 0.0
                for p, r in zip(ins[0], rows)]

    def segment(seg: Segment, k: int) -> None:
        """Runs the segment's steps tile by tile (:func:`he.tiling.tile_plan`): each tile's
        rows, then a reduction's part, then the inner rows no later tile reads are freed; its
        kept values go to ``vals`` whole."""
        end = steps[seg.end]
        held: dict[int, list[Elem]] = {s: [0.0] * steps[s].n for s in seg.steps
                                       if not (seg.reduce and s == seg.end)}
        # the values from before the segment do not change while it runs (the inputs a server
        # owns may be freed in it)
        outside = pinned | {id(e) for s, x in enumerate(vals) if x is not None
                            and not (s == 0 and own_inputs and 0 in seg.last)
                            for e in x if _is_ct(e)}
        sums: dict[int, Any] = {}
        lazy_sums: dict[int, Any] = {}      # a reduction's sums over lazy products
        clear = np.zeros(end.n)
        points = release_points(lowered, seg)

        def free(js: Sequence[int], tile: Any) -> None:
            """The rows of values ``js`` no later step or tile reads, recycled."""
            dead: list[Elem] = []
            for s in js:
                if s == 0 and not own_inputs:
                    continue                    # the caller's
                value = held[s] if s else vals[0]
                for r in np.flatnonzero(tile.free[s]):
                    dead.append(value[r])
                    value[r] = 0.0
                    if s == 0:
                        inputs[r] = 0.0
            if dead:
                buffers.release(dead, [*held.values(), vals[0]], outside)

        def spill_out(tile: Any) -> None:
            """The rows this tile holds for a later one, written out and their buffers freed
            (those that cannot be stay)."""
            dead: list[Elem] = []
            for s, rows in tile.spill.items():
                value = held[s]
                for r in np.flatnonzero(rows):
                    e = value[r]
                    if _is_ct(e) and spill.write((s, r), e):
                        # absent until read back, as rows not computed yet are: no step of
                        # the tiles in between reads it (he.tiling.spills)
                        dead.append(e)
                        value[r] = 0.0
            if dead:
                buffers.release(dead, [*held.values(), vals[0]], outside)

        for i, tile in enumerate(tile_plan(seg, k, lowered if spill is not None else None)):
            for s, rows in tile.reload.items():
                for r in np.flatnonzero(rows):
                    if spill.holds((s, r)):
                        held[s][r] = spill.read((s, r), buffers.take(eng, levels[s]),
                                                eng.context)
            if load is not None and seg.load is not None:
                rows = [int(r) for r in np.flatnonzero(tile.load) if r in pending]
                for r, ct in zip(rows, _load_inputs(eng, buffers, load,
                                                    [pending.pop(r) for r in rows])):
                    vals[0][r] = inputs[r] = ct
            for s in seg.steps:
                if s in held and tile.compute[s].any():
                    ins = [held[j] if j in held else vals[j] for j in steps[s].inputs]
                    out = compute(s, ins, tile.compute[s], part=True)
                    for r in np.flatnonzero(tile.compute[s]):
                        held[s][r] = out[r]
                if s in points and not (seg.reduce and s == seg.end):
                    free(points[s], tile)
            if seg.reduce:
                # the rows this tile computed (and, once, the inputs from before the segment)
                srcs = [[e if m else 0.0 for e, m in zip(held[j], tile.compute[j])]
                        if j in held else (vals[j] if i == 0 else [0.0] * steps[j].n)
                        for j in end.inputs]
                part = compute(seg.end, srcs, live[seg.end], part=True, partial=clear,
                               lazy_sums=lazy_sums)
                _add_sums(eng, sums, part, buffers)
                free(points.get(seg.end, ()), tile)
            if spill is not None:
                spill_out(tile)
        if seg.reduce:
            held[seg.end] = _finish_parts(eng, end, sums, lazy_sums, clear, live[seg.end],
                                          in_level(seg.end), buffers)
        for s in seg.keep:
            vals[s] = held[s]

    # no bar object at all without progress: this also runs in forked workers
    order = tqdm(range(len(steps)), desc="batch steps", leave=False) if progress else \
        range(len(steps))
    for si in order:
        if si in inner:
            continue                        # computed with its segment
        st = steps[si]
        if st.kind == "input":
            vals[si] = list(inputs)
        elif si in end_of:
            segment(*end_of[si])
        else:
            vals[si] = compute(si, [vals[j] for j in st.inputs], live[si])
        ran = end_of[si][0].steps if si in end_of else (si,)
        for j in {j for s in ran for j in steps[s].inputs if j not in ever_inner}:
            remaining[j] -= sum(j in set(steps[s].inputs) for s in ran)
            if remaining[j] == 0 and j not in lowered.outputs:
                dead, vals[j] = vals[j], None
                if steps[j].kind == "input" and own_inputs:
                    inputs[:] = [0.0] * len(inputs)
                elif steps[j].kind == "input":
                    continue
                if dead is not None:
                    buffers.release(dead, vals, pinned)
    if lowered.post is None:
        result = vals[lowered.output]
        assert result is not None
    else:
        result = _returned_sums(eng, lowered, vals, levels)
    if spare is not None:
        keep = {id(e) for e in result if _is_ct(e)} | pinned
        spare.extend(ct for pool in buffers.free.values() for ct in pool if id(ct) not in keep)
    return result


def _returned_sums(eng: Engine, lowered: Lowered, vals: list[list[Elem] | None],
                   levels: Sequence[int]) -> list[Elem]:
    """What a batch group returns for the client's last map (:attr:`Lowered.post`): per value
    it reads, the sums of its elements that map weighs alike
    (:attr:`~polynets.ir.lowering.ClientMap.sums`), additions only, each on the fewest primes
    that hold it (:func:`he.params.returned_level`), in the order of the reads."""
    post = lowered.post
    assert post is not None and post.sums is not None
    out: list[Elem] = []
    for j, s, (_, level) in zip(post.reads, post.sums,
                                read_levels(post.reads, levels, eng.params.pending)):
        value = vals[j]
        assert value is not None
        s = s.tocsr()
        for g in range(s.shape[0]):
            cts = [value[e] for e in s.indices[s.indptr[g]:s.indptr[g + 1]]]
            const = sum(float(e) for e in cts if not _is_ct(e))
            cts = [e for e in cts if _is_ct(e)]
            if not cts:
                out.append(const)
                continue
            if len(cts) == 1 and not const:
                out.append(eng.drop_to(cts[0], level))
                continue
            # a new ciphertext: an element may be another's too (a selection copies none)
            if len(cts) > 1:
                acc = eng.add(cts[0], cts[1])
            else:
                acc = eng.new_ciphertext()
                eng.copy_into(cts[0], acc)
            for e in cts[2:]:
                eng.add_inplace(acc, e)
            if const:
                eng.add_scalar_inplace(acc, const)
            out.append(eng.drop_to(acc, level, inplace=True))
    return out


#: per process and parameter set, the most ciphertext memory a batch group evaluated in this
#: process held: SEAL's memory pool keeps what it allocated (it never hands it back to the
#: system) and serves later allocations of the same sizes from it
_POOL_HELD: dict[tuple[int, Any], int] = {}


#: per process and parameter set, the ciphertexts batch groups of this process left free (and
#: those a server allocated before its first request, :meth:`he.Server.warm`): the next group
#: of the same parameters takes them as its free buffers
_SPARE: dict[tuple[int, Any], list[Any]] = {}


def take_spare(key: Any) -> list[Any]:
    """The free ciphertexts of parameters ``key`` this process holds, handed over (empty in a
    forked process: the parent's pages would be copied as soon as written)."""
    return _SPARE.pop((os.getpid(), key), [])


def keep_spare(key: Any, cts: Iterable[Any]) -> None:
    """Keep ``cts`` (free ciphertexts of parameters ``key``) for the next batch group."""
    _SPARE.setdefault((os.getpid(), key), []).extend(cts)


def spare_buffers(key: Any) -> dict[float, int]:
    """The free ciphertexts of parameters ``key`` this process holds: bytes of one's storage ->
    how many."""
    out: dict[float, int] = {}
    for ct in _SPARE.get((os.getpid(), key), []):
        b = float(8 * ct.dyn_array().capacity())
        out[b] = out.get(b, 0) + 1
    return out


def pool_held(key: Any) -> int:
    """Bytes SEAL's memory pool in this process holds from earlier batch groups of parameters
    ``key`` (memory a group of the same parameters reuses, which ``MemAvailable`` does not
    count)."""
    return _POOL_HELD.get((os.getpid(), key), 0)


def note_pool(key: Any, working_bytes: float | None) -> None:
    """Record that a batch group of parameters ``key`` holding ``working_bytes`` was evaluated
    in this process."""
    if working_bytes:
        k = (os.getpid(), key)
        _POOL_HELD[k] = max(_POOL_HELD.get(k, 0), int(working_bytes))


def available_memory() -> int:
    """Bytes of memory this process may still take: the least of what the system has available
    (``MemAvailable``, or the physical total where it cannot be read), what the memory limits
    of the process's control group and of its ancestors leave (:func:`cgroup_room`: a
    container's limit, which ``MemAvailable`` does not see) and what its address-space limit
    leaves above its virtual size (``ulimit -v``, :func:`address_space_room`)."""
    system = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    system = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if system is None:
        system = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    rooms = [r for r in (cgroup_room(), address_space_room()) if r is not None]
    return max(0, min([system, *rooms]))


def _read_int(path: str) -> int | None:
    """The integer a control-group file holds (None: absent, unreadable or ``max``)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_room(mountinfo: str = "/proc/self/mountinfo",
                cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes the memory limits of this process's control group and of its ancestors leave (the
    least of limit - usage over them; cgroup v2's ``memory.max`` and ``memory.current``, v1's
    ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``), or None where no limit is set or
    none can be read. ``mountinfo`` and ``cgroup`` are the files that say where the hierarchies
    are mounted and which group the process is in."""
    try:
        with open(cgroup) as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    rooms = []
    for fields in mounts:
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 3 or len(fields) < 5:
            continue
        fstype, options = fields[sep + 1], fields[-1].split(",")
        root, point = fields[3], fields[4]
        if fstype == "cgroup2":
            files = ("memory.max", "memory.current")
            path = next((p for h, c, p in groups if h == "0" and c == ""), None)
        elif fstype == "cgroup" and "memory" in options:
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            path = next((p for h, c, p in groups if "memory" in c.split(",")), None)
        else:
            continue
        if path is None:
            continue
        # the group's directory under the mount (which may show a subtree: a container's)
        rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if rel.startswith(".."):
            rel = ""
        parts = [q for q in rel.split("/") if q and q != "."]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(point, *parts[:depth])
            limit, usage = _read_int(os.path.join(d, files[0])), \
                _read_int(os.path.join(d, files[1]))
            # cgroup v1 writes "no limit" as the largest page-aligned 64-bit value
            if limit is not None and usage is not None and limit < 1 << 62:
                rooms.append(limit - usage)
    return max(0, min(rooms)) if rooms else None


def address_space_room() -> int | None:
    """Bytes this process's address-space limit (``RLIMIT_AS``, ``ulimit -v``) leaves above its
    virtual size now, or None where there is no limit: SEAL reserves its memory there, and past
    it an allocation fails inside a computation."""
    try:
        import resource
    except ImportError:                 # not a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(0, int(soft) - size)


class _Plaintexts:
    """Plaintexts by key: encoded once while they fit the byte budget, else encoded at each use
    (slower, but the server's memory stays within the budget). An extended plaintext (the
    level's primes and the special one, for hoisted baby steps: :mod:`he.hoist`) is a word
    array rather than a SEAL plaintext."""

    def __init__(self, encode: Any, bytes_of: Any, budget: int, zero: Any):
        self._zero = zero
        self._encode = encode
        self._bytes_of = bytes_of
        self.budget = budget
        self.kept_bytes = 0
        self.lazy = 0
        self._pt: dict[Any, Any] = {}
        self._raw: dict[Any, tuple[np.ndarray, int, float, bool]] = {}

    def add(self, key: Any, vec: np.ndarray, level: int, scale: float,
            extended: bool = False) -> None:
        size = self._bytes_of(level, extended)
        if self._zero(vec, scale):
            return                          # encodes to zero: the product is skipped
        if self.kept_bytes + size <= self.budget:
            self._pt[key] = self._encode(vec, level, scale, extended)
            self.kept_bytes += size
        else:
            self._raw[key] = (vec, level, scale, extended)
            self.lazy += 1

    def __getitem__(self, key: Any) -> Any:
        pt = self._pt.get(key)
        return pt if pt is not None else self._encode(*self._raw[key])

    def __contains__(self, key: Any) -> bool:
        return key in self._pt or key in self._raw


class VectorKernels:
    """Plaintexts of a vector plan (diagonals, planes, biases) at the level where each is used,
    tiled to the plan's virtual slots and interleaved for its samples; encoded once while they
    fit ``memory_budget`` bytes (default: half the memory available), encoded at each use
    beyond it. The diagonals of hoisted baby steps (:meth:`he.plan.VectorPlan.hoists`, where
    the engine has a validated :class:`he.hoist.Hoister`) are extended plaintexts."""

    def __init__(self, eng: Engine, plan: VectorPlan, memory_budget: int | None = None):
        self.interleave = plan.interleave
        #: the plan's grouping of folds and the level each step runs at
        self.fold_plan = plan.fold_plan
        self.runs_at = plan.runs_at
        vslots = plan.virtual_slots
        budget = int(available_memory() // 2 if memory_budget is None else memory_budget)
        n = eng.params.poly_modulus_degree
        hoister = eng.hoister
        #: whether a baby step ``(input, level, step)`` is hoisted (its products are extended)
        self.hoists: Callable[[tuple[int, int, int]], bool] = \
            plan.hoists if hoister is not None else (lambda key: False)

        def encode(vec: np.ndarray, level: int, scale: float, extended: bool) -> Any:
            full = np.repeat(np.tile(vec, vslots // vec.size), plan.interleave)
            if extended:
                return hoister.extend_plain(eng.encoder, full.tolist(), scale,
                                            eng.params.limbs(level))
            return eng.encode_vector(full, level, scale)

        store = _Plaintexts(encode, lambda level, ext: n * (eng.params.limbs(level) + ext) * 8,
                            budget, lambda vec, scale: float(np.max(np.abs(vec), initial=0.0))
                            * scale < 0.5)
        self.store = store
        # the cheapest to keep first: plaintexts of late (low-limb) steps are the smallest
        for si in sorted(range(len(plan.steps)), key=lambda i: -plan.steps[i].level):
            st = plan.steps[si]
            lin = max((plan.steps[s].level for s in st.inputs), default=0)
            for ti, (src, mv) in enumerate(zip(st.sources(), st.matvecs)):
                if mv is None:
                    continue
                for gi, group in enumerate(mv.groups):
                    for b, vec in group.items():
                        store.add(("d", si, ti, gi, b), vec, lin, eng.plain_scales[lin],
                                  self.hoists((src, lin, b)))
            for j, w in enumerate(st.planes):
                store.add(("p", si, j), w, 0, eng.plain_scales[0])
            if st.bias is not None:
                store.add(("b", si), st.bias, st.level, eng.scales[st.level])


def _accumulate(eng: Engine, terms: Iterable[Any]) -> Any:
    """Sum ciphertexts in place into the first one."""
    acc = None
    for term in terms:
        if acc is None:
            acc = term
        else:
            eng.add_inplace(acc, term)
    return acc


def _fold(eng: Engine, ct: Any, groups: Sequence[Sequence[int]], k: int,
          alone: bool = False) -> Any:
    """Add rotated copies of ``ct`` onto itself (sums across slot blocks), a group of
    rotations (virtual slots, :meth:`he.plan.VectorPlan.fold_plan`) at a time: a group of one
    adds one rotation; a larger one ``[b, 2b, ... (r - 1) b]`` adds all its copies, rotated
    from one decomposition of ``ct`` and summed before one division by the special prime
    where the engine's hoister takes them (its copies spread over the engine's threads where
    they share work that runs alone), else folded ``log2(r)`` times (its keys include those
    steps). ``alone``: nothing else runs beside (:meth:`Engine.rotate_alone`)."""
    rotate = eng.rotate_alone if alone else eng.rotate
    hoister = eng.hoister
    for group in groups:
        steps = [f * k for f in group]
        if len(steps) > 1 and hoister is not None and \
                all(hoister.accepts(ct, s) for s in steps):
            pool = eng.shared_pool() if alone else None
            dec = hoister.decompose(ct, pool)
            copies = [hoister.rotate_ext(dec, s) for s in steps] if pool is None else \
                pool.map(lambda s: hoister.rotate_ext(dec, s), steps)
            ct = eng.add(ct, hoister.mod_down(hoister.add_ext(copies), ct.scale, pool))
            continue
        # one rotation, or the group's doubling steps b, 2b, 4b...
        for f in (steps[(1 << i) - 1] for i in range(len(steps).bit_length())):
            ct = eng.add(ct, rotate(ct, f))
    return ct


def _summed_inputs(eng: Engine, st: Any, xs: list[Any]) -> list[Any]:
    """The inputs of an affine step's terms, those of one map summed (see ``VStep.sources``):
    the sum in the first term's place, None in the others'."""
    if not st.sums:
        return xs
    return [None if not g else xs[t] if len(g) == 1 else
            _accumulate(eng, [eng.add(xs[g[0]], xs[g[1]]), *(xs[u] for u in g[2:])])
            for t, g in enumerate(st.sums)]


def _affine(eng: Engine, kern: VectorKernels, si: int, st: Any, srcs: Sequence[Any],
            xs: list[Any], rotated: dict[tuple[int, int, int], Any],
            halves: dict[int, Any] | None = None, half_shift: int = 0) -> Any:
    """An affine step by the BSGS diagonal method: baby-step rotations of an input shared with
    every map that reads it (``rotated``), giant-step rotations shared by the terms of one input
    period, one rescale, the folds of the widest term shared (folding is linear), then the
    identity terms added. A stacked map (``half_shift``: its ``half`` step's rotation) also
    leaves in ``halves[si]`` its sum rotated by that before the rescale, at the product's
    scale, where key switching adds no noise worth counting (after the rescale it would add
    a heavy-tailed error where the special prime is hardly wider than the primes)."""
    k = kern.interleave
    lin = max(eng.level(x) for x in xs if x is not None)
    # (period, giant) -> the baby-step terms summed before the giant rotation, in order
    terms: dict[tuple[int, int], list[tuple[tuple[int, int, int], Any]]] = {}
    folds_of: dict[int, list[int]] = {}
    babies: dict[tuple[int, int, int], Any] = {}
    for ti, (src, mv, x) in enumerate(zip(srcs, st.matvecs, xs)):
        if mv is None or src is None:
            continue
        folds_of[mv.p_in] = mv.folds
        for gi, (giant, group) in enumerate(zip(mv.giants, mv.groups)):
            for b, _ in group.items():
                if ("d", si, ti, gi, b) not in kern.store:
                    continue                # a diagonal that encodes to zero
                if (src, lin, b) not in rotated:
                    babies.setdefault((src, lin, b), x)
                terms.setdefault((mv.p_in, giant), []).append(
                    ((src, lin, b), ("d", si, ti, gi, b)))
    # baby steps, then each giant step's sum and rotation, spread over the engine's threads;
    # every sum is taken in the same order whatever the threads, so results are bit-identical.
    # Hoisted baby steps (kern.hoists) decompose each input once, rotate it by every step
    # without the division by the special prime, and their giant step divides the sum of
    # its plaintext products once (he.hoist)
    keys = list(babies)
    lifted = [key for key in keys if kern.hoists(key)]
    if lifted:
        hoister = eng.hoister
        first = {}
        for key in lifted:
            first.setdefault(key[:2], babies[key])
        # one input: its decomposition's rows shared among the threads (where the plan shares
        # work that runs alone); several: one each
        if len(first) == 1:
            decomposed = {src: hoister.decompose(x, eng.shared_pool()) for src, x in
                          first.items()}
        else:
            decomposed = dict(zip(first, eng.pool.map(hoister.decompose, first.values())))
        for key, ext in zip(lifted, eng.pool.map(
                lambda key: hoister.rotate_ext(decomposed[key[:2]], key[2] * k), lifted)):
            rotated[key] = ext
    plain = [key for key in keys if not kern.hoists(key)]
    for key, ct in zip(plain, eng.pool.map(lambda key: eng.rotate(babies[key], key[2] * k),
                                           plain)):
        rotated[key] = ct

    def giant_step(item: tuple[tuple[int, int], list[Any]], shared: bool = False) -> Any:
        """A giant step's products summed, then rotated; ``shared``: the step runs alone, its
        extended products, division and rotation shared among the engine's threads."""
        (_, giant), group = item
        pool = eng.shared_pool() if shared else None
        ext = [(kern.store[d], rotated[r]) for r, d in group if isinstance(rotated[r], Extended)]
        acc = _accumulate(eng, (eng.mul_plain(rotated[r], kern.store[d]) for r, d in group
                                if not isinstance(rotated[r], Extended)))
        if ext:
            total = eng.hoister.mod_down(eng.hoister.product_sum(ext, pool),
                                         ext[0][1].source.scale * eng.plain_scales[lin], pool)
            if acc is None:
                acc = total
            else:
                eng.add_inplace(acc, total)
        return eng.rotate_alone(acc, giant * k) if shared else eng.rotate(acc, giant * k)

    items = list(terms.items())
    # a single giant step runs alone: its work is shared among the threads instead
    done = [giant_step(items[0], shared=True)] if len(items) == 1 else \
        eng.pool.map(giant_step, items)
    by_period: dict[int, list[Any]] = {}
    for ((p, _), _), ct in zip(items, done):
        by_period.setdefault(p, []).append(ct)
    parts = sorted(((folds_of[p], _accumulate(eng, cts)) for p, cts in by_period.items()),
                   key=lambda t: -len(t[0]))
    out = None
    folds: list[int] = []
    for term_folds, ct in parts:
        if out is None:
            out, folds = ct, list(term_folds)
            continue
        out = _fold(eng, out, kern.fold_plan(folds[len(term_folds):], kern.runs_at(si)), k,
                    alone=True)
        eng.add_inplace(out, ct)
        folds = list(term_folds)
    if out is not None:
        # folded before the rescale: at the product's scale a rotation's key-switching noise
        # and the copies' rescale noise (summed over the blocks) are negligible
        out = _fold(eng, out, kern.fold_plan(folds, kern.runs_at(si)), k, alone=True)
        if halves is not None and half_shift:
            halves[si] = eng.rotate_alone(out, half_shift * k)
        out = eng.to_level(out, lin + 1)
    for mv, x in zip(st.matvecs, xs):
        if mv is None and x is not None:
            out = x if out is None else eng.add(out, x)
    return out


def _planes(eng: Engine, kern: VectorKernels, si: int, st: Any, inputs: Sequence[Any]) -> Any:
    """A planes step: the client's input ciphertexts times their planes, summed, folded and
    rescaled."""
    acc = _accumulate(eng, (eng.mul_plain(inputs[c], kern.store["p", si, j])
                            for j, c in enumerate(st.plane_cts) if ("p", si, j) in kern.store))
    return eng.to_level(_fold(eng, acc, kern.fold_plan(st.plane_folds, kern.runs_at(si)),
                              kern.interleave), st.level)


def run_vector(eng: Engine, plan: VectorPlan, kern: VectorKernels, inputs: Sequence[Any],
               timings: dict[Any, float] | None = None) -> list[Any]:
    """Evaluate a vector plan on one ciphertext group (``plan.interleave`` samples); returns the
    ciphertexts of the steps it returns (:attr:`VectorPlan.results`: the output, or the values
    the client's last map reads). The planes steps, which read only the inputs, run first, all
    at once on the engine's threads (:meth:`VectorPlan.concurrent_planes`). ``timings``: filled
    with each step's wall-clock seconds (lifts of its inputs included) by step index, and those of
    the planes steps run at once under the key ``"planes"``."""
    clock = time.perf_counter
    vals: list[Any] = [None] * len(plan.steps)
    rotated: dict[tuple[int, int, int], Any] = {}
    # stacked maps' sums rotated by their half's shift before the rescale, until the half runs
    halves: dict[int, Any] = {}
    shift_of = {a: plan.steps[b].shift for a, b in plan.stacked}
    early = plan.concurrent_planes()
    start = clock()
    ready = dict(zip(early, eng.pool.map(
        lambda si: _planes(eng, kern, si, plan.steps[si], inputs), early)))
    if timings is not None and early:
        timings["planes"] = clock() - start
    ready_at_once = set(ready)
    # the last step reading each input at a level: its baby steps are dropped after it
    last_reader: dict[tuple[Any, int], int] = {}
    for si in plan.order():
        st = plan.steps[si]
        if st.kind == "affine":
            lin = max(plan.steps[s].level for s in st.inputs)
            for src in st.sources():
                last_reader[src, lin] = si
    for si in plan.order():
        st = plan.steps[si]
        if st.kind == "input":
            # the input, or a value the client computed from it: its own ciphertext, where a
            # step reads it (the planes steps read the input's arrangements instead)
            vals[si] = inputs[st.plane_cts[0]] if st.plane_cts else None
            continue
        start = clock()
        if st.kind == "planes":
            out = ready.pop(si) if si in ready else _planes(eng, kern, si, st, inputs)
        elif st.kind == "affine":
            lin = max(plan.steps[s].level for s in st.inputs)
            out = _affine(eng, kern, si, st, st.sources(),
                          _summed_inputs(eng, st, [eng.lift(vals[s], lin) for s in st.inputs]),
                          rotated, halves, shift_of.get(si, 0))
            for key in [key for key in rotated if last_reader.get(key[:2]) == si]:
                del rotated[key]
        elif st.kind == "mul":
            out = eng.multiply(vals[st.inputs[0]], vals[st.inputs[1]])
        elif st.kind == "half":
            out = eng.to_level(halves.pop(st.inputs[0]), st.level)
        else:
            out = eng.mul_int(vals[st.inputs[0]], st.factor)
        if ("b", si) in kern.store:
            out = eng.add_plain(eng.lift(out, st.level), kern.store["b", si])
        vals[si] = out
        if timings is not None and si not in ready_at_once:
            timings[si] = clock() - start
    if not plan.outputs:
        return [vals[plan.output]]
    # the values the client's last map reads, on the fewest primes that hold them: they
    # serialise, travel and decrypt as the last one does
    start = clock()
    out = [eng.drop_to(vals[o], level)
           for o, level in zip(plan.outputs, plan.returned_levels(eng.params.pending))]
    if timings is not None:
        timings["return"] = clock() - start
    return out
