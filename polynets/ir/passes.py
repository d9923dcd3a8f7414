"""Optimisation passes on a :class:`~polynets.ir.program.PolyProgram`.

Every pass rewrites the program without changing the function it computes:

* identities (gathers that copy, multiplication by one, addition of zero, identity weights)
  are dropped;
* chains of gathers compose into one gather;
* element-wise constants (folded BatchNorm, scalings, shifts) that vary only along a linear
  map's axis fold into that map's weight and bias, after being moved backwards through layout
  ops and into one factor of a product where needed;
* consecutive linear maps on the same axis fuse into one (one CKKS level instead of two);
* nodes that do not reach the output are removed.

Fewer linear maps and constant multiplications mean fewer CKKS levels (rescales) on the
critical path, so these passes directly shrink the encryption parameters.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from polynets.ir.lowering import node_cost
from polynets.ir.program import ArrayInterpreter, Node, PolyProgram

__all__ = ["optimize"]

_CHANGED = -1  # a rule's return value: rewrote nodes in place, nothing to alias


_DENSE_LIMIT = 1 << 20  # entries of a weight made by fusing linear maps on two axes


def optimize(program: PolyProgram, *, max_rounds: int = 100) -> PolyProgram:
    """Return an equivalent program with affine chains folded and identities removed."""
    nodes = [Node(n.op, n.inputs, n.shape, dict(n.attrs), n.path) for n in program.nodes]
    output = program.output
    rules: list[Rule] = [
        _identity, _compose_gathers, _merge_consts, _fold_after_linear, _fold_before_linear,
        _push_through_gather, _push_into_product, _fuse_linears, _sink_reshape,
        _DistributeOverAdd(), _fuse_across_axes,
    ]
    revision = _Revision()
    nodes, output = _run(nodes, output, rules, max_rounds, revision)
    # dense collapsing last: structured maps first get every fold and fusion they can
    nodes, output = _run(nodes, output, [_collapse_chain] + rules, max_rounds, revision)
    meta = dict(program.meta)
    meta["optimized"] = True
    return PolyProgram(nodes, output, meta=meta)


Rule = Callable[[list[Node], int, list[list[int]]], "int | None"]


def _run(nodes: list[Node], output: int, rules: list[Rule], max_rounds: int,
         revision: "_Revision") -> tuple[list[Node], int]:
    """Apply ``rules`` over the program until nothing changes; ``revision`` counts the rewrites."""
    for _ in range(max_rounds):
        changed = False
        for rule in rules:
            nodes = _NodeList(nodes, revision)
            users = _users(nodes)
            dead: set[int] = set()
            start = revision.count
            for i in range(len(nodes)):
                if i in dead or nodes[i].op == "input":
                    continue
                result = rule(nodes, i, users)
                if result is None:
                    continue
                changed = True
                revision.count += 1
                _update_users(users, nodes)
                if result != _CHANGED:
                    dead.add(i)
                    output = result if output == i else output
                    _redirect(nodes, users, i, result)
            if revision.count != start:
                nodes, output = _compact(nodes, output)
        if not changed:
            break
    return nodes, output


class _Revision:
    """The number of rewrites one :func:`optimize` call has made so far, so that a rule can
    keep an analysis of the program while the count is unchanged."""

    def __init__(self) -> None:
        self.count = 0


class _NodeList(list):
    """A list of nodes that remembers which entries rules replaced or appended, and the
    rewrite count of the program it holds (``revision``)."""

    def __init__(self, nodes: Iterable[Node], revision: _Revision):
        super().__init__(nodes)
        self.touched: dict[int, tuple[int, ...] | None] = {}
        self.revision = revision

    def __setitem__(self, k, node) -> None:  # type: ignore[override]
        self.touched.setdefault(k, self[k].inputs)
        super().__setitem__(k, node)

    def append(self, node: Node) -> None:
        self.touched.setdefault(len(self), None)
        super().append(node)


def _update_users(users: list[list[int]], nodes: _NodeList) -> None:
    """Bring the reader lists up to date after a rule replaced or appended nodes."""
    users.extend([] for _ in range(len(nodes) - len(users)))
    for k, old in nodes.touched.items():
        for j in old or ():
            users[j].remove(k)
        for j in nodes[k].inputs:
            users[j].append(k)
    nodes.touched.clear()


def _redirect(nodes: list[Node], users: list[list[int]], old: int, new: int) -> None:
    """Make every reader of ``old`` read ``new``; ``old`` is dead afterwards."""
    for j in nodes[old].inputs:
        while old in users[j]:
            users[j].remove(old)
    for u in sorted(set(users[old])):
        nodes[u].inputs = tuple(new if j == old else j for j in nodes[u].inputs)
        users[new].extend([u] * nodes[u].inputs.count(new))
    users[old] = []


# --------------------------------------------------------------------------------- utilities
def _users(nodes: list[Node]) -> list[list[int]]:
    users: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for j in node.inputs:
            users[j].append(i)
    return users


def _topological(nodes: list[Node], roots: list[int]) -> list[int]:
    """The nodes that ``roots`` depend on (and the roots), inputs before readers."""
    order: list[int] = []
    state = [0] * len(nodes)  # 0 new, 1 on the stack, 2 done
    for root in roots:
        stack = [root]
        while stack:
            i = stack[-1]
            if state[i] == 2:
                stack.pop()
                continue
            state[i] = 1
            pending = [j for j in nodes[i].inputs if state[j] == 0]
            if pending:
                stack.extend(pending)
            else:
                state[i] = 2
                order.append(i)
                stack.pop()
    return order


def _compact(nodes: list[Node], output: int) -> tuple[list[Node], int]:
    """Keep the input and the nodes that reach the output, in a topological order."""
    order = _topological(nodes, [i for i, n in enumerate(nodes) if n.op == "input"] + [output])
    new_id = {old: new for new, old in enumerate(order)}
    kept = []
    for old in order:
        n = nodes[old]
        n.inputs = tuple(new_id[j] for j in n.inputs)
        kept.append(n)
    return kept, new_id[output]


def _only_along(value: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray | None:
    """If ``value`` broadcast to ``shape`` varies only along ``axis``, that 1-D profile."""
    if value.ndim > len(shape):
        return None
    full = np.broadcast_to(value, shape)
    moved = np.moveaxis(full, axis, -1).reshape(-1, shape[axis])
    if moved.shape[0] == 0:
        return None
    row = moved[0]
    if not np.array_equal(moved, np.broadcast_to(row, moved.shape)):
        return None
    return np.array(row, dtype=np.float64)


def _regular_fill(value: np.ndarray, read: np.ndarray) -> np.ndarray:
    """Fill the entries nobody reads so the constant varies along one axis only, if it can.

    Entries that a gather never reads may take any value; choosing them well lets the constant
    fold into a linear map on that axis (e.g. a BatchNorm after a shift that drops a border).
    """
    for axis in range(value.ndim):
        moved = np.moveaxis(value, axis, -1).reshape(-1, value.shape[axis])
        mask = np.moveaxis(read, axis, -1).reshape(-1, value.shape[axis])
        profile = np.empty(value.shape[axis])
        for c in range(value.shape[axis]):
            seen = moved[mask[:, c], c]
            if seen.size and np.any(seen != seen[0]):
                break
            profile[c] = seen[0] if seen.size else moved[0, c]
        else:
            shape = [1] * value.ndim
            shape[axis] = value.shape[axis]
            return np.broadcast_to(profile.reshape(shape), value.shape).copy()
    return value


def _after(attrs: dict, op: str, prof: np.ndarray) -> dict:
    """Attributes of ``const(linear(x))`` as one linear map; ``prof`` lies along the output axis."""
    w, b = attrs["weight"], attrs.get("bias")
    if op == "mul_const":
        return {"axis": attrs["axis"], "weight": w * prof[None, :],
                "bias": None if b is None else b * prof}
    return {"axis": attrs["axis"], "weight": w, "bias": prof if b is None else b + prof}


def _before(attrs: dict, op: str, prof: np.ndarray) -> dict:
    """Attributes of ``linear(const(x))`` as one linear map; ``prof`` lies along the input axis."""
    w, b = attrs["weight"], attrs.get("bias")
    if op == "mul_const":
        return {"axis": attrs["axis"], "weight": prof[:, None] * w, "bias": b}
    shift = prof @ w
    return {"axis": attrs["axis"], "weight": w, "bias": shift if b is None else b + shift}


def _single_user(users: list[list[int]], j: int) -> bool:
    return len(users[j]) == 1


# --------------------------------------------------------------------------------- rules
# Each rule looks at node i; it may rewrite nodes in place (never inserting). It returns None
# when it changed nothing, _CHANGED after an in-place rewrite, or the index of a node that now
# computes node i's value (node i is then dropped).

def _identity(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op == "gather" and len(n.inputs) == 1:
        src = nodes[n.inputs[0]]
        idx = n.attrs["index"]
        if src.shape == n.shape and np.array_equal(idx.ravel(), np.arange(idx.size)):
            return n.inputs[0]
    if n.op in ("mul_const", "add_const") and nodes[n.inputs[0]].shape == n.shape:
        v = n.attrs["value"]
        if (n.op == "mul_const" and np.all(v == 1.0)) or (n.op == "add_const" and not v.any()):
            return n.inputs[0]
    if n.op == "linear" and n.attrs.get("bias") is None:
        w = n.attrs["weight"]
        if w.shape[0] == w.shape[1] and np.array_equal(w, np.eye(w.shape[0])):
            return n.inputs[0]
    return None


def _compose_gathers(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op != "gather" or not any(nodes[j].op == "gather" for j in n.inputs):
        return None
    new_inputs: list[int] = []
    offsets: dict[int, int] = {}

    def offset_of(j: int) -> int:
        if j not in offsets:
            offsets[j] = sum(nodes[k].numel for k in new_inputs)
            new_inputs.append(j)
        return offsets[j]

    # translation of n's flat source positions -> positions in the new concatenated source
    pieces = []
    for j in n.inputs:
        src = nodes[j]
        if src.op == "gather":
            inner = src.attrs["index"].ravel()  # refers to src's own inputs, concatenated
            start = 0
            bases = []
            for k in src.inputs:
                bases.append((start, start + nodes[k].numel, offset_of(k)))
                start += nodes[k].numel
            mapped = np.full(inner.shape, -1, dtype=np.int64)
            for lo, hi, base in bases:
                sel = (inner >= lo) & (inner < hi)
                mapped[sel] = inner[sel] - lo + base
            pieces.append(mapped)
        else:
            pieces.append(np.arange(src.numel, dtype=np.int64) + offset_of(j))
    translation = np.concatenate(pieces + [np.array([-1], dtype=np.int64)])
    idx = n.attrs["index"]
    new_index = translation[np.where(idx < 0, len(translation) - 1, idx)]
    nodes[i] = Node("gather", tuple(new_inputs), n.shape, {"index": new_index.astype(np.int64)},
                    n.path)
    return _CHANGED


def _merge_consts(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op not in ("mul_const", "add_const"):
        return None
    j = n.inputs[0]
    inner = nodes[j]
    if inner.op not in ("mul_const", "add_const") or not _single_user(users, j) \
            or inner.shape != n.shape:
        return None
    v_out, v_in = n.attrs["value"], inner.attrs["value"]
    if inner.op == n.op:
        merged = v_out * v_in if n.op == "mul_const" else v_out + v_in
        nodes[i] = Node(n.op, inner.inputs, n.shape, {"value": np.asarray(merged)}, n.path)
        return _CHANGED
    if n.op == "mul_const":  # (x + d) * c  ->  x * c + d * c
        nodes[j] = Node("mul_const", inner.inputs, n.shape, {"value": v_out}, n.path)
        nodes[i] = Node("add_const", (j,), n.shape, {"value": np.asarray(v_in * v_out)},
                        inner.path)
        return _CHANGED
    return None


def _fold_after_linear(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op not in ("mul_const", "add_const"):
        return None
    j = n.inputs[0]
    lin = nodes[j]
    if lin.op != "linear" or not _single_user(users, j) or lin.shape != n.shape:
        return None
    axis = lin.attrs["axis"]
    prof = _only_along(n.attrs["value"], n.shape, axis)
    if prof is None:
        return None
    nodes[j] = Node("linear", lin.inputs, lin.shape, _after(lin.attrs, n.op, prof), lin.path)
    return j


def _fold_before_linear(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """linear(const(x)) -> linear'(x); a constant read by several linear maps folds into all."""
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    c = nodes[j]
    if c.op not in ("mul_const", "add_const") or nodes[c.inputs[0]].shape != c.shape:
        return None
    readers = sorted(set(users[j]))
    profiles = {}
    for k in readers:
        reader = nodes[k]
        if reader.op != "linear" or reader.inputs[0] != j:
            return None
        prof = _only_along(c.attrs["value"], c.shape, reader.attrs["axis"])
        if prof is None:
            return None
        profiles[k] = prof
    for k, prof in profiles.items():
        reader = nodes[k]
        nodes[k] = Node("linear", c.inputs, reader.shape, _before(reader.attrs, c.op, prof),
                        reader.path)
    return _CHANGED


def _push_through_gather(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """const(gather(x)) -> gather(const'(x)) when the constant pulls back consistently."""
    n = nodes[i]
    if n.op not in ("mul_const", "add_const"):
        return None
    j = n.inputs[0]
    g = nodes[j]
    if g.op != "gather" or len(g.inputs) != 1 or not _single_user(users, j) \
            or g.shape != n.shape:
        return None
    src = nodes[g.inputs[0]]
    if src.op not in ("linear", "mul_const", "add_const", "gather"):
        return None
    idx = g.attrs["index"].ravel()
    full = np.broadcast_to(n.attrs["value"], n.shape).ravel()
    used = idx >= 0
    if n.op == "add_const" and np.any(full[~used] != 0):
        return None
    pulled = np.full(src.numel, 1.0 if n.op == "mul_const" else 0.0)
    pulled[idx[used]] = full[used]
    if not np.array_equal(pulled[idx[used]], full[used]):
        return None
    read = np.zeros(src.numel, dtype=bool)
    read[idx[used]] = True
    pulled = _regular_fill(pulled.reshape(src.shape), read.reshape(src.shape))
    nodes[j] = Node(n.op, g.inputs, src.shape, {"value": pulled}, n.path)
    nodes[i] = Node("gather", (j,), g.shape, dict(g.attrs), g.path)
    return _CHANGED


def _push_into_product(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """mul_const(a * b) -> (a') * b when the constant folds into the linear map a."""
    n = nodes[i]
    if n.op != "mul_const":
        return None
    j = n.inputs[0]
    m = nodes[j]
    if m.op != "mul" or not _single_user(users, j) or m.inputs[0] == m.inputs[1]:
        return None
    for k in m.inputs:
        lin = nodes[k]
        if lin.op != "linear" or not _single_user(users, k) or lin.shape != m.shape:
            continue
        prof = _only_along(n.attrs["value"], m.shape, lin.attrs["axis"])
        if prof is None:
            continue
        nodes[k] = Node("linear", lin.inputs, lin.shape, _after(lin.attrs, "mul_const", prof),
                        lin.path)
        return j
    return None


def _fuse_linears(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """linear_b(linear_a(x)) on one axis -> one linear map.

    A map read only by linear maps on its axis is fused into each of them (a Mu-Layer's ``C``
    read by the next layer's ``A`` and ``D``): the shared value is then never computed, which
    saves the level it would take, at the price of one larger map per reader.
    """
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    first = nodes[j]
    if first.op != "linear" or first.attrs["axis"] != n.attrs["axis"]:
        return None
    w1, b1 = first.attrs["weight"], first.attrs.get("bias")
    w2, b2 = n.attrs["weight"], n.attrs.get("bias")
    if not _single_user(users, j):
        readers = [nodes[k] for k in set(users[j])]
        if any(r.op != "linear" or r.inputs[0] != j or r.attrs["axis"] != n.attrs["axis"]
               or w1.shape[0] * r.attrs["weight"].shape[1] > _DENSE_LIMIT for r in readers):
            return None
    bias = None
    if b1 is not None:
        bias = b1 @ w2
    if b2 is not None:
        bias = b2 if bias is None else bias + b2
    nodes[i] = Node("linear", first.inputs, n.shape,
                    {"axis": n.attrs["axis"], "weight": w1 @ w2, "bias": bias}, n.path)
    return _CHANGED


def _fuse_across_axes(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """linear_b(linear_a(x)) on two different axes -> one linear on the merged axes (kron).

    Done only when the merged weight stays small; it saves a CKKS level (e.g. token pooling
    followed by the classifier head become one map).
    """
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    first = nodes[j]
    if first.op != "linear" or not _single_user(users, j) \
            or first.attrs["axis"] == n.attrs["axis"]:
        return None
    w1, b1, a1 = first.attrs["weight"], first.attrs.get("bias"), first.attrs["axis"]
    w2, b2, a2 = n.attrs["weight"], n.attrs.get("bias"), n.attrs["axis"]
    if w1.size * w2.size > _DENSE_LIMIT:
        return None
    src = nodes[first.inputs[0]]
    # order the two axes as (lo, hi); weights follow the same order
    (lo, wl), (hi, wh) = sorted([(a1, w1), (a2, w2)], key=lambda t: t[0])
    rest = [d for d in range(len(src.shape)) if d not in (lo, hi)]
    perm = rest[:lo] + [lo, hi] + rest[lo:]
    idx = np.arange(src.numel).reshape(src.shape).transpose(perm)
    merged_shape = tuple(src.shape[d] for d in rest[:lo]) + (wl.shape[0] * wh.shape[0],) + \
        tuple(src.shape[d] for d in rest[lo:])
    weight = np.kron(wl, wh)
    # constant part: first's bias pushed through the second map, plus the second's bias
    c1 = np.zeros(w1.shape[1]) if b1 is None else b1
    if a1 == lo:
        const = np.outer(c1, w2.sum(axis=0))
    else:
        const = np.outer(w2.sum(axis=0), c1)
    if b2 is not None:
        const = const + (b2[None, :] if a2 == hi else b2[:, None])
    bias = const.reshape(-1) if np.any(const) else None
    out_mid = tuple(n.shape[d] for d in rest[:lo]) + (wl.shape[1] * wh.shape[1],) + \
        tuple(n.shape[d] for d in rest[lo:])
    perm_out = rest[:lo] + [lo, hi] + rest[lo:]
    back_shape = tuple(n.shape[d] for d in perm_out)
    back = np.arange(int(np.prod(out_mid))).reshape(back_shape)
    back = back.transpose(np.argsort(perm_out))
    g_in = Node("gather", first.inputs, merged_shape, {"index": idx.reshape(merged_shape)},
                first.path)
    nodes.append(g_in)
    lin = Node("linear", (len(nodes) - 1,), out_mid,
               {"axis": len(rest[:lo]), "weight": weight, "bias": bias}, n.path)
    nodes.append(lin)
    nodes[i] = Node("gather", (len(nodes) - 1,), n.shape, {"index": back.copy()}, n.path)
    return _CHANGED


def _levels_and_slack(nodes: list[Node], users: list[list[int]]) -> tuple[list[int], list[int]]:
    """CKKS levels of every node, and how many levels each could grow without delaying a user."""
    order = _topological(nodes, list(range(len(nodes))))
    level = [0] * len(nodes)
    for i in order:
        node = nodes[i]
        if node.inputs:
            level[i] = max(level[j] for j in node.inputs) + node_cost(node)[0]
    latest = [max(level)] * len(nodes)
    for i in reversed(order):
        if users[i]:
            latest[i] = min(latest[k] - node_cost(nodes[k])[0] for k in users[i])
    return level, [latest[i] - level[i] for i in range(len(nodes))]


class _DistributeOverAdd:
    """L(a + b) with a = linear(u) on L's axis -> (L o a)(u) + L(b): one level less on u's path.

    Residual connections (y = x + C(u), then the next layer's maps read y) are the common case.
    Applied only where it shortens a critical path (no slack, and u's path is the longer one),
    so residual streams are not unrolled.
    """

    def __init__(self) -> None:
        self._revision = -1     # the rewrite count the cached levels and slack belong to
        self._level: list[int] = []
        self._slack: list[int] = []

    def __call__(self, nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
        n = nodes[i]
        if n.op != "linear":
            return None
        j = n.inputs[0]
        s = nodes[j]
        if s.op != "add" or s.inputs[0] == s.inputs[1]:
            return None
        revision = nodes.revision.count  # type: ignore[attr-defined]  # a _NodeList
        if self._revision != revision or len(self._slack) != len(nodes):
            self._level, self._slack = _levels_and_slack(nodes, users)
            self._revision = revision
        if i >= len(self._slack) or self._slack[i] != 0:
            return None
        axis = n.attrs["axis"]
        for k, other in ((s.inputs[0], s.inputs[1]), (s.inputs[1], s.inputs[0])):
            a = nodes[k]
            if a.op != "linear" or a.attrs["axis"] != axis or len(set(users[k])) != 1:
                continue
            if self._level[a.inputs[0]] < self._level[other]:
                continue
            w, b = n.attrs["weight"], n.attrs.get("bias")
            wa, ba = a.attrs["weight"], a.attrs.get("bias")
            fused_bias = None if ba is None else ba @ w
            nodes.append(Node("linear", a.inputs, n.shape,
                              {"axis": axis, "weight": wa @ w, "bias": fused_bias}, a.path))
            left = len(nodes) - 1
            nodes.append(Node("linear", (other,), n.shape,
                              {"axis": axis, "weight": w, "bias": b}, n.path))
            nodes[i] = Node("add", (left, len(nodes) - 1), n.shape, {}, s.path)
            return _CHANGED
        return None


def _sink_reshape(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """linear(reshape(x)) on a last axis that the reshape keeps -> reshape(linear(x)).

    ``nn.Linear`` on a (B, H, W, C) tensor runs as view -> matmul -> view; moving the views
    outward lets them cancel and exposes linear maps to folding, fusion and distribution.
    """
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    g = nodes[j]
    if g.op != "gather" or len(g.inputs) != 1:
        return None
    src = nodes[g.inputs[0]]
    axis = n.attrs["axis"]
    if axis != len(g.shape) - 1 or not src.shape or src.shape[-1] != g.shape[-1]:
        return None
    if not np.array_equal(g.attrs["index"].ravel(), np.arange(g.numel)) or g.numel != src.numel:
        return None
    out_src = src.shape[:-1] + (n.shape[-1],)
    nodes.append(Node("linear", g.inputs, out_src,
                      {"axis": len(src.shape) - 1, "weight": n.attrs["weight"],
                       "bias": n.attrs.get("bias")}, n.path))
    total = int(np.prod(n.shape, dtype=np.int64))
    nodes[i] = Node("gather", (len(nodes) - 1,), n.shape,
                    {"index": np.arange(total).reshape(n.shape)}, g.path)
    return _CHANGED


def _collapse_chain(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    """A chain of layout ops and two or more linear maps -> one dense linear map, when small.

    E.g. a channel map, a transpose, token pooling and the classifier head: one level, not three.
    """
    n = nodes[i]
    if n.op != "linear":
        return None
    chain = [i]
    cur = n.inputs[0]
    while (nodes[cur].op == "linear" or (nodes[cur].op == "gather"
                                         and len(nodes[cur].inputs) == 1)) \
            and _single_user(users, cur):
        chain.append(cur)
        cur = nodes[cur].inputs[0]
    if sum(nodes[k].op == "linear" for k in chain) < 2:
        return None
    src = nodes[cur]
    n_in, n_out = src.numel, n.numel
    widest = max([n_in, n_out] + [nodes[k].numel for k in chain])
    if (n_in + 1) * widest > _DENSE_LIMIT:     # the basis pushed through the chain, densely
        return None
    basis = np.concatenate([np.zeros((1, n_in)), np.eye(n_in)]).reshape((n_in + 1,) + src.shape)
    value, numpy = basis, ArrayInterpreter(basis)
    for k in reversed(chain):
        value = numpy.step(k, nodes[k], [value])
    flat = value.reshape(n_in + 1, n_out)
    bias = flat[0]
    weight = flat[1:] - bias[None, :]
    nodes.append(Node("gather", (cur,), (n_in,), {"index": np.arange(n_in)}, n.path))
    nodes.append(Node("linear", (len(nodes) - 1,), (n_out,),
                      {"axis": 0, "weight": weight, "bias": bias if np.any(bias) else None},
                      n.path))
    nodes[i] = Node("gather", (len(nodes) - 1,), n.shape,
                    {"index": np.arange(n_out).reshape(n.shape)}, n.path)
    return _CHANGED
