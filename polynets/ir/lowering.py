"""Lowering of a polynomial program to CKKS steps: the one place that decides what costs a level.

Under CKKS every plaintext or ciphertext multiplication by a non-integer is followed by a rescale,
which consumes one prime of the modulus chain (a *level*). Affine work between two ciphertext
products can be composed into a single map, so a program is lowered to a short list of steps over
flat values (row-major order of each node's sample shape):

============  ===============================================================================
step          meaning
============  ===============================================================================
``input``     the encrypted input, level 0; or, where the client applies the first maps
              (:func:`client_first`), a value it computes from the input as ``terms[0] @ x
              + bias`` and encrypts, level 0 too
``affine``    ``y = sum_k M_k x_k + b``: every linear map, layout op (gather), constant scaling
              and addition between two products composed into one map (scipy CSR ``M_k``)
``mul``       ``y = x_a * x_b``, element-wise ciphertext product (``a == b``: a square)
``mul_int``   ``y = k x`` for one integer ``k``: exact, no rescale
============  ===============================================================================

The rules, each written once here and used by :func:`polynets.ir.certify`, the optimisation passes
and the CKKS compiler:

* :func:`integer_factor`: a constant multiplication is level-free iff it multiplies by one
  integer, repeated, of magnitude below ``2**20``;
* :func:`node_cost`: per node of the program, before composition (the upper bound
  :func:`polynets.ir.certify` and the passes count with), a product, a linear map and a constant
  multiplication that is not free cost one level each;
* :func:`affine_is_free`: an affine step costs one level unless every term is free for the
  packing -- the identity in every packing, and in batch packing (one sample per slot) also any
  selection (each output copies at most one input element with weight 1: shifts, slices,
  padding), which is a reindexing of ciphertexts;
* :func:`step_levels`: ``mul`` costs one level above the higher operand, ``mul_int`` none;
* a value read by several consumers is materialised once as its own step, unless it is thin:
  read by no ciphertext product and its rows reading at most :data:`SHARED_ROW_NNZ` elements
  (a product plus the value it multiplied, a scaling), which is composed into every reader
  (:attr:`Lowered.shared`; kept as steps with ``keep``);
* a map of zeros (a zero weight, a scaling by 0, a selection of none of a step's elements) is
  no term: a value of no term is a constant, never a step, and a product with a constant is a
  scaling composed into the affine map that reads it;
* a map that reads the input only through a local affine map (each output reads at most
  :data:`LOCAL_ROW_NNZ` input elements: a convolution, a patch embedding) is composed with it and
  reads the input directly, one level earlier -- the client can then pre-arrange the input for it
  (vector packing's input planes); steps left without readers are dropped;
* :func:`client_map`: where the program ends with a weighted affine map, the client, which
  holds the compiled program, may apply it to the decrypted values it reads
  (:attr:`Lowered.post`): the server returns those values, and its chain is one level shorter
  on every path through that map (in batch packing, one ciphertext per element, it first sums
  the elements that map weighs alike: :func:`summed_columns`);
* :func:`client_first`: the weighted maps that read only the input (a patch embedding with the
  first Mu-Layer's projections composed into it, a convolution), and the maps that read only
  what those compute, are affine functions of the input, which the client holds in the clear:
  it may compute them in float64 and encrypt their values, which the server reads as inputs;
  every path through such a map is a level shorter and the server skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

import numpy as np
import scipy.sparse as sp

from polynets.ir.program import Interpreter, Node, PolyProgram

__all__ = ["Step", "Lowered", "ClientMap", "client_map", "client_first", "client_inputs",
           "client_variants", "input_offsets", "summed_columns", "lower",
           "CLIENT_MAP_PACKINGS", "CLIENT_FIRST_PACKINGS",
           "integer_factor", "node_cost", "affine_is_free", "evaluate_steps", "is_identity",
           "step_levels", "EXACT_LOWERING_LIMIT", "LOCAL_ROW_NNZ", "PACKING_KINDS",
           "MAX_INTEGER_FACTOR", "DENSE_JOIN_FACTOR"]

#: Packings whose level rules differ: one sample per ciphertext vector, one per slot, or one
#: channel per ciphertext with tokens and samples in its slots (``"tokens"``, whose maps rotate
#: like vector packing's: only the identity is free).
PACKING_KINDS = ("vector", "batch", "tokens")
#: Integer factors at or above this magnitude are encoded like any other constant (one level).
MAX_INTEGER_FACTOR = 2 ** 20
#: A map of the input whose outputs each read at most this many input elements is *local*.
LOCAL_ROW_NNZ = 64
#: Local products are formed in row blocks of at most this bounded work (sum of the row bounds)
_LOCAL_PRODUCT_WORK = 4_000_000
#: Products whose bounded work exceeds this are not tried as local maps
_LOCAL_TOTAL_WORK = 64 * _LOCAL_PRODUCT_WORK
#: Linear maps composed into one are *dense joins* when the composed map's rows read more than
#: this many times the inputs any of its maps' rows read (:attr:`Lowered.dense_joins`)
DENSE_JOIN_FACTOR = 4
#: A value read by several nodes whose rows each read at most this many elements (a sum of a
#: few values, a scaling: cheap to compose into every reader) is composed into them, not
#: materialised as a step of its own (:attr:`Lowered.shared`)
SHARED_ROW_NNZ = 4
#: Programs with a value a packing must hold (input, output, a ciphertext product or its
#: operands) of more elements are not lowered exactly by ``pn.certify`` (too large for any CKKS
#: packing; the level count is then the per-node upper bound, see
#: :func:`polynets.ir.certify.levels_exact`).
EXACT_LOWERING_LIMIT = 2 ** 16
#: Packings in which the client may apply the program's last map (:func:`client_map`; tokens
#: packing keeps it on the server) and its first maps (:func:`client_first`: vector packing,
#: which encrypts each of their values in one ciphertext where batch packing would need one
#: per element)
CLIENT_MAP_PACKINGS = ("vector", "batch")
CLIENT_FIRST_PACKINGS = ("vector",)
#: Most multiply-adds composing one map the client applies to its input (:func:`client_first`),
#: a bound on its weights: maps that read only what such maps compute are composed with them,
#: which can make them dense (a token-mixing map after a patch embedding: 1,568 x 784, 1.2
#: million); a denser one stays on the server (the program holds these maps, 12 bytes a weight)
CLIENT_MAP_NNZ = 1 << 23


def integer_factor(value: np.ndarray | float) -> int | None:
    """The integer ``k`` if multiplying by ``value`` is multiplying by one integer ``k`` with
    ``|k| < 2**20`` (exact in CKKS, no rescale, no level); otherwise None."""
    v = np.asarray(value, dtype=np.float64).ravel()
    if v.size == 0 or not np.all(v == v[0]):
        return None
    k = float(v[0])
    return int(k) if np.isfinite(k) and k == round(k) and abs(k) < MAX_INTEGER_FACTOR else None



def node_cost(node: Node) -> tuple[int, int]:
    """``(levels, plaintext multiplications)`` a node costs on its own, before lowering composes
    affine work: a ciphertext product ``(1, 0)``; a linear map or a constant multiplication that
    is not by one integer (:func:`integer_factor`) ``(1, 1)``; anything else ``(0, 0)``. Summed
    along a path this bounds the levels of the exact lowering from above."""
    if node.op == "mul":
        return 1, 0
    if node.op == "linear" or (node.op == "mul_const"
                               and integer_factor(node.attrs["value"]) is None):
        return 1, 1
    return 0, 0


@dataclass
class Step:
    """One CKKS step over a flat value of ``numel(shape)`` elements (see the module docstring)."""

    kind: str
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    terms: list[sp.csr_matrix] = field(default_factory=list)   # affine: (n, n_in) per input
    bias: np.ndarray | None = None
    factor: int = 1

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Lowered:
    """Steps of a program in evaluation order, and which one is the output.

    ``dense_joins``: program nodes (linear values) whose composition into the map that reads
    them made that map's rows read far more inputs than any of its maps' (more than
    :data:`DENSE_JOIN_FACTOR` times): lowering
    again with them kept apart (``lower(program, keep=dense_joins)``) costs a level each on
    their paths and may cost fewer operations, which a compiler can price.

    ``shared``: program nodes read by several nodes whose values, thin, were composed into
    every reader instead of materialised once (see the module docstring): lowering again with
    them kept (``lower(program, keep=shared)``) gives each a step of its own, fewer terms in
    its readers, maybe a level more or (batch packing) inputs lifted to sum them.

    ``kept_steps``: the step each node kept (``keep``) was materialised as.

    ``post``: the program's last affine map where the client applies it (:func:`client_map`);
    the server then returns the values of every step it reads (:attr:`outputs`), and
    ``output`` is the one of them on the longest path.
    """

    steps: list[Step]
    output: int
    dense_joins: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()
    kept_steps: dict[int, int] = field(default_factory=dict)
    post: "ClientMap | None" = None

    @property
    def outputs(self) -> tuple[int, ...]:
        """The steps whose values the server returns: the output, or what ``post`` reads."""
        return self.post.reads if self.post is not None else (self.output,)

    def levels(self, packing: str = "vector") -> list[int]:
        return step_levels(self.steps, packing)

    def depth_levels(self, packing: str = "vector") -> int:
        """Levels (rescales) on the longest path: the modulus chain's length."""
        return max(self.levels(packing), default=0)


@dataclass
class ClientMap:
    """``y = sum_k terms[k] @ value(reads[k]) + bias``: the program's last affine map, applied
    by the client in float64 to the decrypted values of the steps ``reads``
    (:func:`client_map`); ``shape``: the program output's sample shape.

    ``sums`` (batch packing, one ciphertext per element): per read, a 0/1 matrix
    ``(G_k, n_k)`` whose rows sum the elements the map weighs alike (its equal columns, e.g.
    the tokens of a mean pooling); the server returns those sums, additions only, and
    ``terms[k]`` is then ``(n, G_k)``, over them (:func:`summed_columns`)."""

    reads: tuple[int, ...]
    terms: list[sp.csr_matrix]
    bias: np.ndarray | None
    shape: tuple[int, ...]
    sums: tuple[sp.csr_matrix, ...] | None = None

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def step_terms(self) -> list[sp.csr_matrix]:
        """Per read, the map ``(n, n_k)`` from that step's value (``terms[k] @ sums[k]``)."""
        if self.sums is None:
            return list(self.terms)
        return [(m @ s).tocsr() for m, s in zip(self.terms, self.sums)]

    def returned(self) -> list[int]:
        """Per read, how many values the server returns: its sums, or its elements."""
        if self.sums is None:
            return [m.shape[1] for m in self.terms]
        return [s.shape[0] for s in self.sums]

    def apply(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """``(B, n)`` from the values of ``reads`` (each ``(B, n_k)``), in float64."""
        if self.sums is not None:
            values = [(s @ np.asarray(v, dtype=np.float64).T).T
                      for s, v in zip(self.sums, values)]
        return self.apply_returned(values)

    def apply_returned(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """``(B, n)`` from what the server returns for each read (``(B, returned()[k])``)."""
        y = sum((m @ np.asarray(v, dtype=np.float64).T).T for m, v in zip(self.terms, values))
        if self.bias is not None:
            y = y + np.asarray(self.bias, dtype=np.float64)[None, :]
        return np.asarray(y, dtype=np.float64)


def summed_columns(post: ClientMap) -> ClientMap:
    """``post`` with its equal columns summed by the server (:attr:`ClientMap.sums`): per read,
    the elements its map weighs alike (bitwise equal columns) make one returned sum, and
    elements it does not read (zero columns) none. The same map of the same values."""
    if post.sums is not None:
        return post
    sums, terms = [], []
    for m in post.terms:
        csc = m.tocsc()
        csc.sort_indices()
        group: dict[bytes, int] = {}
        rows: list[int] = []
        cols: list[int] = []
        firsts: list[int] = []
        for j in range(csc.shape[1]):
            lo, hi = csc.indptr[j], csc.indptr[j + 1]
            if hi == lo or not np.any(csc.data[lo:hi]):
                continue
            key = csc.indices[lo:hi].tobytes() + csc.data[lo:hi].tobytes()
            g = group.setdefault(key, len(group))
            if g == len(firsts):
                firsts.append(j)
            rows.append(g)
            cols.append(j)
        s = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(firsts), m.shape[1]))
        sums.append(s)
        terms.append(csc[:, firsts].tocsr())
    return ClientMap(post.reads, terms, post.bias, post.shape, tuple(sums))


def client_map(lowered: Lowered, packing: str = "vector") -> Lowered | None:
    """``lowered`` with its last step, a weighted affine map, applied by the client
    (:attr:`Lowered.post`) to the values the server returns (the steps that map reads); None
    where the output is no such map (a product, a free map: nothing to save) or reads only
    the input. The server's chain loses the level that map cost on every path through it.
    In batch packing the server returns the sums of the elements the map weighs alike
    (:func:`summed_columns`)."""
    if lowered.post is not None:
        return None
    out = lowered.steps[lowered.output]
    if out.kind != "affine" or affine_is_free(out, packing) or set(out.inputs) <= {0}:
        return None
    levels = step_levels(lowered.steps, packing)
    primary = max(out.inputs, key=lambda j: (levels[j], j))
    # the output is the last step (every step before it is read, :func:`_drop_unread`), so the
    # others keep their indices and every one of them is still read, by a step or the client
    assert lowered.output == len(lowered.steps) - 1
    low = Lowered(lowered.steps[:-1], primary, lowered.dense_joins, lowered.shared,
                  {n: j for n, j in lowered.kept_steps.items() if j != lowered.output})
    post = ClientMap(tuple(out.inputs), list(out.terms), out.bias, tuple(out.shape))
    # batch packing returns a ciphertext per element: the server sums those weighed alike
    low.post = summed_columns(post) if packing == "batch" else post
    return low


def client_first(lowered: Lowered, packing: str = "vector"
                 ) -> tuple[Lowered, list[int]] | None:
    """``lowered`` with its first maps applied by the client, and the index in ``lowered`` of
    each step it keeps; None where no map becomes one.

    An affine step that reads only the input, or only values computed so, is an affine function
    of the input (its terms composed with theirs, within :data:`CLIENT_MAP_NNZ`): it
    becomes an ``input`` step whose ``terms[0]`` (``(n, n_input)``) and ``bias`` the client
    applies to the input in float64 before encrypting the value (:func:`client_inputs`), at
    level 0 where the server's map would have left it at level 1. The program's output stays
    the server's (a program that is one affine map has nothing to give the client); a value the
    server returns to the client's last map may be one the client computed, which the server
    returns as it got it. Steps only the client's maps read are dropped; the input stays step
    0, read or not. ``packing`` decides which maps are free (:func:`affine_is_free`): a free
    map of the input is left to the server (it costs no level there)."""
    steps = lowered.steps
    n_in = steps[0].n
    # the program's output stays the server's; a value the server returns to the client's last
    # map may be one the client computed (the server returns its ciphertext, switched down)
    returned = {lowered.output} if lowered.post is None else set()
    maps: dict[int, tuple[sp.csr_matrix, np.ndarray | None]] = {}
    for si, st in enumerate(steps):
        if st.kind == "input":
            if si == 0:
                maps[si] = (_eye(n_in), None)
            elif st.terms:
                maps[si] = (st.terms[0].tocsr(), st.bias)
            continue
        if st.kind != "affine" or si in returned or affine_is_free(st, packing) or \
                any(j not in maps for j in st.inputs):
            continue
        # the products' work bounds their weights: none is formed beyond the bound
        if sum(_product_work(t, maps[j][0]) for t, j in zip(st.terms, st.inputs)) > \
                CLIENT_MAP_NNZ:
            continue
        m = sp.csr_matrix((st.n, n_in))
        bias = np.zeros(st.n) if st.bias is None else np.asarray(st.bias, dtype=np.float64)
        for t, j in zip(st.terms, st.inputs):
            w, b = maps[j]
            m = m + (t @ w).tocsr()
            if b is not None:
                bias = bias + t @ b
        m.eliminate_zeros()
        maps[si] = (m, bias if np.any(bias) else None)
    converted = [si for si in maps if si != 0 and steps[si].kind == "affine"]
    if not converted:
        return None
    new = [Step("input", (), st.shape, [maps[si][0]], maps[si][1]) if si in converted else st
           for si, st in enumerate(steps)]
    read = np.zeros(len(new), dtype=bool)
    read[0] = True
    read[list({lowered.output, *lowered.outputs})] = True
    for i in range(len(new) - 1, -1, -1):
        if read[i]:
            read[list(new[i].inputs)] = True
    kept = [i for i in range(len(new)) if read[i]]
    index = {old: k for k, old in enumerate(kept)}
    out = Lowered([Step(new[i].kind, tuple(index[j] for j in new[i].inputs), new[i].shape,
                        new[i].terms, new[i].bias, new[i].factor) for i in kept],
                  index[lowered.output], lowered.dense_joins, lowered.shared,
                  {n: index[j] for n, j in lowered.kept_steps.items() if j in index})
    if lowered.post is not None:
        post = lowered.post
        out.post = ClientMap(tuple(index[j] for j in post.reads), post.terms, post.bias,
                             post.shape, post.sums)
    return out, kept


def _product_work(a: sp.spmatrix, b: sp.csr_matrix) -> int:
    """Multiply-adds of the sparse product ``a @ b`` (at least its nonzeros): per nonzero of
    ``a``, the nonzeros of the row of ``b`` it reads."""
    a = sp.csr_matrix(a)
    return int(np.diff(b.indptr).astype(np.int64)[a.indices].sum())


def client_variants(lowered: Lowered, packing: str = "vector",
                    wanted: Collection[tuple[bool, bool]] | None = None
                    ) -> dict[tuple[bool, bool], tuple[Lowered, list[int]]]:
    """The lowerings of ``lowered`` in ``packing`` keyed ``(the client applies the last map,
    the client applies the first maps)``, each with the index in ``lowered`` of every step it
    keeps: ``(False, False)`` is ``lowered`` itself; the others where they apply
    (:func:`client_map` in :data:`CLIENT_MAP_PACKINGS`, :func:`client_first` in
    :data:`CLIENT_FIRST_PACKINGS`, the first maps after the last) and are ``wanted`` (default:
    all)."""
    out = {(False, False): (lowered, list(range(len(lowered.steps))))}
    wanted = {(a, b) for a in (False, True) for b in (False, True)} if wanted is None \
        else set(wanted)
    mapped = client_map(lowered, packing) if packing in CLIENT_MAP_PACKINGS and any(
        last for last, _ in wanted) else None
    if mapped is not None:
        # the same steps but the last (the map)
        out[True, False] = (mapped, [i for i in range(len(lowered.steps))
                                     if i != lowered.output])
    if packing in CLIENT_FIRST_PACKINGS:
        for last in (False, True):
            if (last, False) in out and (last, True) in wanted:
                base, idx = out[last, False]
                firsts = client_first(base, packing)
                if firsts is not None:
                    out[last, True] = (firsts[0], [idx[i] for i in firsts[1]])
    return out


def _client_value(st: Step, x: np.ndarray) -> np.ndarray:
    """The value of an input step the client computes (:func:`client_first`) on ``x``
    (``(B, n_input)``), ``(B, n)`` in float64."""
    v = np.asarray((st.terms[0] @ np.asarray(x, dtype=np.float64).T).T)
    if st.bias is not None:
        v = v + np.asarray(st.bias, dtype=np.float64)[None, :]
    return v


def input_offsets(lowered: Lowered) -> dict[int, int]:
    """Per input step, where its value starts in :func:`client_inputs`' rows."""
    out, at = {}, 0
    for si, st in enumerate(lowered.steps):
        if st.kind == "input":
            out[si] = at
            at += st.n
    return out


def client_inputs(lowered: Lowered, x: np.ndarray) -> np.ndarray:
    """What the client encrypts from ``x`` (``(B, n_input)``): the values of the program's input
    steps one after the other (:func:`input_offsets`), the input itself first and the values
    of the maps it applies (:func:`client_first`) after it; ``x`` itself where there are none."""
    x = np.asarray(x)
    parts = [x if not st.terms else _client_value(st, x)
             for st in lowered.steps if st.kind == "input"]
    return parts[0] if len(parts) == 1 else np.concatenate(
        [np.asarray(p, dtype=np.float64) for p in parts], axis=1)


def evaluate_steps(lowered: Lowered, x: np.ndarray,
                   visit: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
    """Float64 evaluation of the steps on a batch ``x`` (``(B, n_input)``, flattened inputs):
    the program's output ``(B, n)`` (the output step's value, or the client's map of the
    values it reads, :attr:`Lowered.post`). ``visit(i, value)`` sees every step's value as it
    is computed; a value is released once its last reader has run."""
    steps = lowered.steps
    last = [0] * len(steps)
    for si, st in enumerate(steps):
        for j in st.inputs:
            last[j] = si
    vals: list[np.ndarray | None] = [None] * len(steps)
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    for si, st in enumerate(steps):
        ins = [vals[j] for j in st.inputs]
        if st.kind == "input":
            v = x if not st.terms else _client_value(st, x)
        elif st.kind == "affine":
            v = sum((m @ a.T).T for m, a in zip(st.terms, ins))
            if st.bias is not None:
                v = v + np.asarray(st.bias, dtype=np.float64)[None, :]
            v = np.broadcast_to(v, (len(x), st.n)) if np.ndim(v) < 2 else v
        elif st.kind == "mul":
            v = ins[0] * ins[1]
        else:
            v = ins[0] * float(st.factor)
        vals[si] = v
        if visit is not None:
            visit(si, v)
        for j in st.inputs:
            if last[j] == si and j not in lowered.outputs:
                vals[j] = None
    if lowered.post is not None:
        return lowered.post.apply([vals[j] for j in lowered.post.reads])  # type: ignore[misc]
    out = vals[lowered.output]
    assert out is not None
    return out


def _eye(n: int) -> sp.csr_matrix:
    return sp.identity(n, format="csr", dtype=np.float64)


def is_identity(m: sp.csr_matrix) -> bool:
    """True for a square identity matrix (a term that needs no multiplication)."""
    return m.shape[0] == m.shape[1] and (m - _eye(m.shape[0])).count_nonzero() == 0


def _max_row_nnz(m: sp.csr_matrix) -> int:
    m = m.tocsr()
    return int(np.diff(m.indptr).max(initial=0))


def _is_selection(m: sp.csr_matrix) -> bool:
    m = m.tocsr()
    return bool(np.all(np.diff(m.indptr) <= 1) and np.all(m.data == 1.0))


def affine_is_free(step: Step, packing: str) -> bool:
    """True when the affine step needs no plaintext multiplication (so no level) in ``packing``."""
    if packing not in PACKING_KINDS:
        raise ValueError(f"packing must be one of {PACKING_KINDS}, got {packing!r}")
    test = _is_selection if packing == "batch" else is_identity
    return all(test(m) for m in step.terms)


def step_levels(steps: Sequence[Step], packing: str = "vector",
                extra: Sequence[int] | None = None) -> list[int]:
    """Level (rescales so far) of every step's result in ``packing``; ``extra[i]``: levels a
    packing spends on step ``i`` beyond the rule (tokens packing's masks, :mod:`he.tokens`)."""
    levels: list[int] = []
    for si, st in enumerate(steps):
        top = max((levels[j] for j in st.inputs), default=0)
        if st.kind == "mul":
            top += 1
        elif st.kind == "affine" and not affine_is_free(st, packing):
            top += 1
        levels.append(top + (int(extra[si]) if extra is not None else 0))
    return levels


# ----------------------------------------------------------------------------- affine values
@dataclass
class _Aff:
    """A not yet materialised affine function of materialised steps."""

    terms: dict[int, sp.csr_matrix]
    bias: np.ndarray | None
    shape: tuple[int, ...]
    #: ``(node, fan-in)`` of the linear maps composed into it since its inputs were materialised
    linears: tuple[tuple[int, int], ...] = ()

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _linear_matrix(shape: tuple[int, ...], axis: int, weight: np.ndarray) -> sp.csr_matrix:
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    w = sp.csr_matrix(np.asarray(weight, dtype=np.float64).T)
    return sp.kron(sp.kron(_eye(pre), w), _eye(post), format="csr")


def _broadcast_matrix(src: tuple[int, ...], dst: tuple[int, ...]) -> sp.csr_matrix:
    n_src = int(np.prod(src, dtype=np.int64))
    idx = np.broadcast_to(np.arange(n_src).reshape(src), dst).ravel()
    n = idx.size
    return sp.csr_matrix((np.ones(n), (np.arange(n), idx)), shape=(n, n_src))


def _bias_along(shape: tuple[int, ...], axis: int, bias: np.ndarray) -> np.ndarray:
    view = [1] * len(shape)
    view[axis] = bias.shape[0]
    return np.broadcast_to(bias.reshape(view), shape).ravel().astype(np.float64)


def _read(terms: dict[int, sp.csr_matrix]) -> dict[int, sp.csr_matrix]:
    """The terms that read their step: a map of zeros (a zero weight, a selection of none of
    its elements, a scaling by 0) is no term, so a value of none is a constant (its bias)."""
    for m in terms.values():
        m.eliminate_zeros()
    return {k: m for k, m in terms.items() if m.nnz}


def _compose(a: sp.csr_matrix, x: _Aff, shape: tuple[int, ...]) -> _Aff:
    terms = _read({k: (a @ m).tocsr() for k, m in x.terms.items()})
    bias = None if x.bias is None else a @ x.bias
    return _Aff(terms, bias, shape, x.linears)


def _sum(shape: tuple[int, ...], *affs: _Aff) -> _Aff:
    terms: dict[int, sp.csr_matrix] = {}
    bias = None
    linears = tuple(sorted({lin for f in affs for lin in f.linears}))
    for f in affs:
        for k, m in f.terms.items():
            terms[k] = (terms[k] + m).tocsr() if k in terms else m
        if f.bias is not None:
            bias = f.bias.copy() if bias is None else bias + f.bias
    return _Aff(_read(terms), bias, shape, linears)


def _constant(f: _Aff) -> np.ndarray | None:
    """The value of ``f`` if it reads no step (flat), else None."""
    if f.terms:
        return None
    return np.zeros(f.n) if f.bias is None else np.asarray(f.bias, dtype=np.float64)


def _with_bias(f: _Aff, b: np.ndarray) -> _Aff:
    return _Aff(dict(f.terms), b.copy() if f.bias is None else f.bias + b, f.shape, f.linears)


def _gather(node: Node, program: PolyProgram, ins: list[_Aff]) -> _Aff:
    index = np.asarray(node.attrs["index"]).ravel()
    sizes = [program.nodes[j].numel for j in node.inputs]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    parts = []
    for k, f in enumerate(ins):
        sel = (index >= offsets[k]) & (index < offsets[k + 1])
        rows = np.nonzero(sel)[0]
        m = sp.csr_matrix((np.ones(rows.size), (rows, index[sel] - offsets[k])),
                          shape=(index.size, sizes[k]))
        parts.append(_compose(m, f, tuple(node.shape)))
    return _sum(tuple(node.shape), *parts)


def lower(program: PolyProgram, keep: Collection[int] = ()) -> Lowered:
    """Lower ``program`` to steps (see the module docstring); float64, exact composition.
    ``keep``: program nodes materialised as steps of their own instead of composed into their
    readers (each costs its paths one level; see :attr:`Lowered.dense_joins`)."""
    keep = frozenset(int(k) for k in keep)
    bad = sorted(k for k in keep if not 0 <= k < len(program.nodes))
    if bad:
        raise ValueError(f"keep names nodes {bad} outside the program's {len(program.nodes)}")
    lowering = _Lowering(program, keep)
    values = lowering.run(program)
    out = lowering.materialise(values[program.output])
    low = _drop_unread(lowering.steps, out, lowering.kept_steps)
    low.dense_joins = tuple(sorted(lowering.dense_joins))
    low.shared = tuple(sorted(lowering.shared))
    return low


class _Lowering(Interpreter):
    """The CKKS-step back end: a node's value is an affine function (:class:`_Aff`) of the
    steps materialised so far; products, and values read by several nodes, become steps."""

    def __init__(self, program: PolyProgram, keep: frozenset[int] = frozenset()):
        self.program = program
        self.steps: list[Step] = []
        self.users = program.consumers()
        self.keep = keep
        self.dense_joins: set[int] = set()
        self.shared: set[int] = set()
        self.kept_steps: dict[int, int] = {}

    def add_step(self, step: Step) -> _Aff:
        self.steps.append(step)
        i = len(self.steps) - 1
        return _Aff({i: _eye(step.n)}, None, step.shape)

    def materialise(self, f: _Aff) -> int:
        """The step that holds ``f``: an existing one if ``f`` is one, else a new affine step."""
        if len(f.terms) == 1 and f.bias is None:
            (src, m), = f.terms.items()
            if is_identity(m) and self.steps[src].n == f.n:
                return src
        if not f.terms:  # a constant output (which a compiler refuses)
            self.add_step(Step("affine", (), f.shape, [], _constant(f)))
            return len(self.steps) - 1
        f = self._through_local_input_map(f)
        self._note_dense_join(f)
        self.add_step(Step("affine", tuple(f.terms), f.shape, list(f.terms.values()), f.bias))
        return len(self.steps) - 1

    def _note_dense_join(self, f: _Aff) -> None:
        """Record the linear maps composed into ``f`` but the last (:attr:`Lowered.dense_joins`)
        when ``f``'s rows read more than :data:`DENSE_JOIN_FACTOR` times the inputs that any
        of its maps' rows read: composing them multiplied the work. Those whose values are
        wider than ``f`` are not (keeping them would hold more values, not fewer)."""
        if len(f.linears) < 2:
            return
        fan_in = int(sum(np.diff(m.tocsr().indptr) for m in f.terms.values()).max(initial=0))
        if fan_in <= DENSE_JOIN_FACTOR * max(k for _, k in f.linears):
            return
        last = max(node for node, _ in f.linears)
        self.dense_joins.update(node for node, _ in f.linears
                                if node != last and self.program.nodes[node].numel <= f.n)

    def _through_local_input_map(self, f: _Aff) -> _Aff:
        steps = self.steps
        if len(f.terms) != 1:
            return f
        (src, m), = f.terms.items()
        s = steps[src]
        if s.kind != "affine" or len(s.inputs) != 1 or steps[s.inputs[0]].kind != "input" \
                or is_identity(m):
            return f
        composed = _local_product(m.tocsr(), s.terms[0].tocsr())
        if composed is None:
            return f
        bias = None if s.bias is None else m @ s.bias
        if f.bias is not None:
            bias = f.bias if bias is None else bias + f.bias
        return _Aff({s.inputs[0]: composed}, bias, f.shape, f.linears)

    def _operand(self, j: int, f: _Aff, shape: tuple[int, ...]) -> _Aff:
        """Node ``j``'s value ``f`` broadcast to ``shape``."""
        src = tuple(self.program.nodes[j].shape)
        return f if src == shape else _compose(_broadcast_matrix(src, shape), f, shape)

    def input(self, i: int, node: Node) -> _Aff:
        return self.add_step(Step("input", (), tuple(node.shape)))

    def linear(self, i: int, node: Node, x: _Aff) -> _Aff:
        a, shape = node.attrs, tuple(node.shape)
        src_shape = tuple(self.program.nodes[node.inputs[0]].shape)
        own = _linear_matrix(src_shape, a["axis"], a["weight"])
        val = _compose(own, x, shape)
        val.linears = val.linears + ((i, _max_row_nnz(own)),)
        if a.get("bias") is not None:
            val = _with_bias(val, _bias_along(shape, a["axis"],
                                              np.asarray(a["bias"], dtype=np.float64)))
        return val

    def gather(self, i: int, node: Node, *xs: _Aff) -> _Aff:
        return _gather(node, self.program, list(xs))

    def add_const(self, i: int, node: Node, x: _Aff) -> _Aff:
        shape = tuple(node.shape)
        f = self._operand(node.inputs[0], x, shape)
        return _with_bias(f, np.broadcast_to(np.asarray(node.attrs["value"], np.float64),
                                             shape).ravel())

    def mul_const(self, i: int, node: Node, x: _Aff) -> _Aff:
        shape = tuple(node.shape)
        f = self._operand(node.inputs[0], x, shape)
        k = integer_factor(node.attrs["value"])
        src = next(iter(f.terms)) if len(f.terms) == 1 else None
        if k and src is not None and f.bias is None and is_identity(f.terms[src]):
            return self.add_step(Step("mul_int", (src,), shape, factor=k))
        v = np.broadcast_to(np.asarray(node.attrs["value"], dtype=np.float64), shape).ravel()
        return _compose(sp.diags(v, format="csr"), f, shape)

    def add(self, i: int, node: Node, a: _Aff, b: _Aff) -> _Aff:
        shape = tuple(node.shape)
        return _sum(shape, self._operand(node.inputs[0], a, shape),
                    self._operand(node.inputs[1], b, shape))

    def mul(self, i: int, node: Node, a: _Aff, b: _Aff) -> _Aff:
        shape = tuple(node.shape)
        fa = self._operand(node.inputs[0], a, shape)
        fb = self._operand(node.inputs[1], b, shape)
        ca, cb = _constant(fa), _constant(fb)
        if ca is not None or cb is not None:  # a product with a constant is a scaling
            if ca is not None and cb is not None:
                return _Aff({}, ca * cb, shape)
            c, f = (ca, fb) if ca is not None else (cb, fa)
            return _compose(sp.diags(c, format="csr"), f, shape)
        xa = self.materialise(fa)
        xb = xa if node.inputs[0] == node.inputs[1] else self.materialise(fb)
        return self.add_step(Step("mul", (xa, xb), shape))

    def finish(self, i: int, node: Node, value: _Aff) -> _Aff:
        """A value read by several nodes is materialised once, as its own step (and one the
        caller keeps apart, see :func:`lower`)."""
        if (len(self.users[i]) > 1 or i in self.keep) and value.terms:
            if i not in self.keep and self._thin_shared(i, value):
                self.shared.add(i)
                return value
            j = self.materialise(value)
            if i in self.keep:
                self.kept_steps[i] = j
            return _Aff({j: _eye(self.steps[j].n)}, None, tuple(node.shape))
        return value

    def _thin_shared(self, i: int, value: _Aff) -> bool:
        """Whether node ``i``'s value, read by several nodes, is composed into each of them
        instead of materialised (:attr:`Lowered.shared`): no reader multiplies it by a
        ciphertext, and each of its rows reads at most :data:`SHARED_ROW_NNZ` elements."""
        if len(value.terms) == 1 and value.bias is None:
            (src, m), = value.terms.items()
            if is_identity(m) and self.steps[src].n == value.n:
                return False            # a step already: nothing to materialise
        return all(self.program.nodes[u].op != "mul" for u in self.users[i]) and \
            _row_reads(value) <= SHARED_ROW_NNZ


def _row_reads(f: _Aff) -> int:
    """The most elements any row of ``f`` reads, over all its terms."""
    return int(sum(np.diff(m.tocsr().indptr) for m in f.terms.values()).max(initial=0))


def _local_product(m: sp.csr_matrix, inner: sp.csr_matrix) -> sp.csr_matrix | None:
    """``m @ inner`` when every row of it reads at most :data:`LOCAL_ROW_NNZ` columns, else None.

    Each output row reads at most ``bound`` inputs (the rows of ``inner`` it sums); a map of
    many channels over a patch embedding bounds that loosely (64 channels of 49 pixels each:
    3,136) while the product is local (every channel reads the same 49 pixels). The product is
    formed in blocks of rows of bounded work, so a map that is not local is found, and given
    up, after one block.
    """
    bound = abs(m).astype(bool).astype(np.int64) @ np.diff(inner.indptr)
    if int(bound.max(initial=0)) <= LOCAL_ROW_NNZ:
        blocks = [(0, m.shape[0])]
    else:
        if int(bound.sum()) > _LOCAL_TOTAL_WORK:
            return None
        ends = np.searchsorted(np.cumsum(bound), np.arange(1, int(bound.sum()) //
                                                           _LOCAL_PRODUCT_WORK + 1)
                               * _LOCAL_PRODUCT_WORK)
        cuts = np.unique(np.concatenate([[0], np.minimum(ends + 1, m.shape[0]),
                                         [m.shape[0]]]))
        blocks = list(zip(cuts[:-1], cuts[1:]))
    parts = []
    for lo, hi in blocks:
        part = (m[lo:hi] @ inner).tocsr()
        part.eliminate_zeros()
        if _max_row_nnz(part) > LOCAL_ROW_NNZ:
            return None
        parts.append(part)
    return parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")


def _drop_unread(steps: list[Step], out: int, named: dict[int, int] | None = None) -> Lowered:
    """Remove steps no other step (nor the output) reads; renumber the rest (and the steps
    ``named`` maps program nodes to, as :attr:`Lowered.kept_steps`)."""
    keep = np.zeros(len(steps), dtype=bool)
    keep[out] = True
    keep[0] = True                      # the input stays, read or not
    for i in range(len(steps) - 1, -1, -1):
        if keep[i]:
            keep[list(steps[i].inputs)] = True
    new = np.cumsum(keep) - 1
    kept = [Step(st.kind, tuple(int(new[j]) for j in st.inputs), st.shape, st.terms, st.bias,
                 st.factor) for st, k in zip(steps, keep) if k]
    return Lowered(kept, int(new[out]), kept_steps={
        n: int(new[j]) for n, j in (named or {}).items() if keep[j]})
