"""Optimisation passes on a :class:`~polynets.program.PolyProgram`.

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

from typing import Callable

import numpy as np

from polynets.program import Node, PolyProgram

__all__ = ["optimize"]

_CHANGED = -1  # a rule's return value: rewrote nodes in place, nothing to alias


def optimize(program: PolyProgram, *, max_rounds: int = 100) -> PolyProgram:
    """Return an equivalent program with affine chains folded and identities removed."""
    nodes = [Node(n.op, n.inputs, n.shape, dict(n.attrs), n.path) for n in program.nodes]
    output = program.output
    rules: list[Callable[[list[Node], int, list[list[int]]], int | None]] = [
        _identity, _compose_gathers, _merge_consts, _fold_after_linear, _fold_before_linear,
        _push_through_gather, _push_into_product, _fuse_linears,
    ]
    for _ in range(max_rounds):
        changed = False
        for rule in rules:
            users = _users(nodes)
            alias: dict[int, int] = {}
            for i in range(len(nodes)):
                if i in alias or nodes[i].op == "input":
                    continue
                nodes[i].inputs = tuple(alias.get(j, j) for j in nodes[i].inputs)
                result = rule(nodes, i, users)
                if result is None:
                    continue
                changed = True
                if result != _CHANGED:
                    alias[i] = result
                    for node in nodes:
                        node.inputs = tuple(alias.get(j, j) for j in node.inputs)
                users = _users(nodes)
            if alias:
                output = alias.get(output, output)
                for node in nodes:
                    node.inputs = tuple(alias.get(j, j) for j in node.inputs)
            nodes, output = _compact(nodes, output)
        if not changed:
            break
    meta = dict(program.meta)
    meta["optimized"] = True
    return PolyProgram(nodes, output, meta=meta)


# --------------------------------------------------------------------------------- utilities
def _users(nodes: list[Node]) -> list[list[int]]:
    users: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for j in node.inputs:
            users[j].append(i)
    return users


def _compact(nodes: list[Node], output: int) -> tuple[list[Node], int]:
    """Drop nodes that do not reach the output (the input always stays) and renumber."""
    live = [False] * len(nodes)
    live[output] = True
    for i in range(len(nodes) - 1, -1, -1):
        if live[i]:
            for j in nodes[i].inputs:
                live[j] = True
    for i, n in enumerate(nodes):
        if n.op == "input":
            live[i] = True
    new_id: dict[int, int] = {}
    kept: list[Node] = []
    for i, n in enumerate(nodes):
        if live[i]:
            new_id[i] = len(kept)
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
    w, b = lin.attrs["weight"], lin.attrs.get("bias")
    if n.op == "mul_const":
        attrs = {"axis": axis, "weight": w * prof[None, :],
                 "bias": None if b is None else b * prof}
    else:
        attrs = {"axis": axis, "weight": w, "bias": prof if b is None else b + prof}
    nodes[j] = Node("linear", lin.inputs, lin.shape, attrs, lin.path)
    return j


def _fold_before_linear(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    c = nodes[j]
    if c.op not in ("mul_const", "add_const") or not _single_user(users, j):
        return None
    src_shape = nodes[c.inputs[0]].shape
    if src_shape != c.shape:
        return None
    axis = n.attrs["axis"]
    prof = _only_along(c.attrs["value"], c.shape, axis)
    if prof is None:
        return None
    w, b = n.attrs["weight"], n.attrs.get("bias")
    if c.op == "mul_const":
        attrs = {"axis": axis, "weight": prof[:, None] * w, "bias": b}
    else:
        shift = prof @ w
        attrs = {"axis": axis, "weight": w, "bias": shift if b is None else b + shift}
    nodes[i] = Node("linear", c.inputs, n.shape, attrs, n.path)
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
    nodes[j] = Node(n.op, g.inputs, src.shape, {"value": pulled.reshape(src.shape)}, n.path)
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
        b = lin.attrs.get("bias")
        nodes[k] = Node("linear", lin.inputs, lin.shape,
                        {"axis": lin.attrs["axis"], "weight": lin.attrs["weight"] * prof[None, :],
                         "bias": None if b is None else b * prof}, lin.path)
        return j
    return None


def _fuse_linears(nodes: list[Node], i: int, users: list[list[int]]) -> int | None:
    n = nodes[i]
    if n.op != "linear":
        return None
    j = n.inputs[0]
    first = nodes[j]
    if first.op != "linear" or not _single_user(users, j) \
            or first.attrs["axis"] != n.attrs["axis"]:
        return None
    w1, b1 = first.attrs["weight"], first.attrs.get("bias")
    w2, b2 = n.attrs["weight"], n.attrs.get("bias")
    bias = None
    if b1 is not None:
        bias = b1 @ w2
    if b2 is not None:
        bias = b2 if bias is None else bias + b2
    nodes[i] = Node("linear", first.inputs, n.shape,
                    {"axis": n.attrs["axis"], "weight": w1 @ w2, "bias": bias}, n.path)
    return _CHANGED
