"""Degree and depth analysis of polynomial programs, and the certificate of a model.

For each node of a :class:`~polynets.ir.program.PolyProgram` the analysis computes

* ``degree``: the total degree of the node's value as a polynomial of the input (structural:
  exact unless coefficients cancel, which random or trained weights do not do);
* ``depth``: the multiplicative depth, i.e. the longest chain of ciphertext-ciphertext products;
* ``levels``: CKKS levels consumed on the longest path, counted on the program's CKKS lowering
  (:mod:`polynets.ir.lowering`, the one place that decides which multiplication costs a level, also
  used by the compiler): one per ciphertext product, one per composed affine map between
  products, none for a multiplication by a small integer; ``plain_mults`` counts the affine maps
  on that path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polynets.ir.lowering import (EXACT_LOWERING_LIMIT, Lowered, affine_is_free, client_variants,
                                  lower, node_cost)
from polynets.ir.program import Interpreter, Node, PolyProgram

if TYPE_CHECKING:  # the program analysis runs without torch (a ciphertext server loads it)
    from torch import nn

__all__ = ["NodeInfo", "Certificate", "analyse", "certify", "certify_lowered", "degree_depth",
           "lowered_levels", "levels_exact", "EXACT_LOWERING_TOTAL"]

#: All values of a program together (elements of one sample) beyond which ``pn.certify`` does
#: not lower it exactly: the sparse maps the lowering composes grow with them.
EXACT_LOWERING_TOTAL = 64 * EXACT_LOWERING_LIMIT


@dataclass(frozen=True)
class NodeInfo:
    """Per-node result of :func:`analyse`."""

    degree: int
    depth: int
    levels: int
    plain_mults: int


def analyse(program: PolyProgram) -> list[NodeInfo]:
    """Degree and multiplicative depth of every node, in node order; the output node also
    carries the CKKS ``levels`` and ``plain_mults`` of the whole program: exactly those of the
    lowering the compiler uses (:func:`lowered_levels`, vector packing), or, for a program with
    values too large for any packing, the upper bound that counts every linear map and every
    non-integer constant multiplication (:func:`levels_exact` tells which)."""
    infos = _Analysis().run(program)
    if levels_exact(program):
        infos[program.output] = _counted_on(infos[program.output], lower(program))
    return infos


def _counted_on(info: NodeInfo, lowered: Lowered) -> NodeInfo:
    """The output's ``info`` with its levels and plaintext multiplications those of
    ``lowered``."""
    return NodeInfo(info.degree, info.depth, *lowered_levels(lowered))


def degree_depth(program: PolyProgram) -> tuple[int, int]:
    """The output's total degree in the input and its multiplicative depth (the longest chain of
    ciphertext products), from the program's nodes alone (no lowering). Every product costs a
    level in every packing, so the depth is a lower bound on any packing's levels."""
    info = _Analysis().run(program)[program.output]
    return int(info.degree), int(info.depth)


class _Analysis(Interpreter):
    """Per node: degree and depth, and the levels and plaintext multiplications on the longest
    path counted node by node (:func:`~polynets.ir.lowering.node_cost`, an upper bound)."""

    def input(self, i: int, node: Node) -> NodeInfo:
        return NodeInfo(1, 0, 0, 0)

    def mul(self, i: int, node: Node, a: NodeInfo, b: NodeInfo) -> NodeInfo:
        return self._path(node, a.degree + b.degree, max(a.depth, b.depth) + 1, a, b)

    def _same_degree(self, i: int, node: Node, *ins: NodeInfo) -> NodeInfo:
        return self._path(node, max(s.degree for s in ins), max(s.depth for s in ins), *ins)

    linear = add = mul_const = add_const = gather = _same_degree

    @staticmethod
    def _path(node: Node, degree: int, depth: int, *ins: NodeInfo) -> NodeInfo:
        levels, plain = max((s.levels, s.plain_mults) for s in ins)
        cost = node_cost(node)
        return NodeInfo(degree, depth, levels + cost[0], plain + cost[1])


def levels_exact(program: PolyProgram) -> bool:
    """Whether :func:`analyse` counts levels on the exact lowering: every value a CKKS packing
    must hold -- the input, the output, every ciphertext product and its operands -- has at
    most :data:`~polynets.ir.lowering.EXACT_LOWERING_LIMIT` elements, and all values together
    at most :data:`EXACT_LOWERING_TOTAL`. Linear intermediates larger than the limit (the
    patches a convolution gathers, say) are composed into the maps around them, as the compiler
    does, so they do not make the count an upper bound."""
    nodes = program.nodes
    held = {program.output} | {i for i, n in enumerate(nodes) if n.op == "input"}
    for i, n in enumerate(nodes):
        if n.op == "mul":
            held.add(i)
            held.update(n.inputs)
    return max(nodes[i].numel for i in held) <= EXACT_LOWERING_LIMIT and \
        sum(n.numel for n in nodes) <= EXACT_LOWERING_TOTAL


def lowered_levels(lowered: Lowered, packing: str = "vector") -> tuple[int, int]:
    """Levels on the longest path of the lowering and the affine maps (plaintext
    multiplications) on it."""
    best: list[tuple[int, int]] = []
    for st in lowered.steps:
        top = max((best[j] for j in st.inputs), default=(0, 0))
        if st.kind == "mul":
            top = (top[0] + 1, top[1])
        elif st.kind == "affine" and not affine_is_free(st, packing):
            top = (top[0] + 1, top[1] + 1)
        best.append(top)
    return max(best[j] for j in lowered.outputs)


@dataclass
class Certificate:
    """What a model computes, as far as encryption and symbolic expansion care.

    ``is_polynomial``: every op is an addition, a multiplication or affine; ``degree``: total
    degree of the output in the input; ``depth``: ciphertext-ciphertext multiplicative depth;
    ``levels``: CKKS levels (rescales) on the longest path; ``plain_mults``: plaintext
    multiplications on that path; ``client_levels``: the levels where the client applies the
    program's last map (vector packing's ``final_map``, :func:`polynets.ir.lowering.client_map`;
    None where it ends with no such map or the count is an upper bound); ``first_levels``:
    where the client applies the program's first maps (vector packing's ``first_map``,
    :func:`polynets.ir.lowering.client_first`; None where it has none), and
    ``first_client_levels`` where it applies both; ``offending``: the modules that break
    polynomiality.
    """

    model: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    is_polynomial: bool
    degree: int | None = None
    depth: int | None = None
    levels: int | None = None
    levels_exact: bool = True
    plain_mults: int | None = None
    client_levels: int | None = None
    first_levels: int | None = None
    first_client_levels: int | None = None
    offending: list[Any] = field(default_factory=list)
    program: PolyProgram | None = None
    op_counts: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.is_polynomial

    def __str__(self) -> str:
        head = f"Certificate for {self.model}: input {self.input_shape} -> " \
               f"output {self.output_shape}"
        if not self.is_polynomial:
            lines = [head, "  polynomial:   no -- it cannot be encrypted or expanded as is.",
                     "  offending modules:"]
            lines += [f"    - {o}" for o in self.offending]
            return "\n".join(lines)
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.op_counts.items()))
        return "\n".join([
            head,
            "  polynomial:   yes",
            f"  degree:       {self.degree} (total degree of the output in the input)",
            f"  depth:        {self.depth} (longest chain of ciphertext-ciphertext products)",
            f"  CKKS levels:  {self.levels} on the longest path "
            f"({self.depth} products + {self.plain_mults} plaintext multiplications)" +
            ("" if self.levels_exact else " -- an upper bound: the model is too large to "
             "lower exactly (and to encrypt)") +
            ("" if self.client_levels is None else f"; {self.client_levels} where the client "
             f"applies the last map (vector packing)") +
            ("" if self.first_levels is None else f"; {self.first_levels} where it applies the "
             f"first maps" + ("" if self.first_client_levels is None else
                              f", {self.first_client_levels} with the last as well")),
            f"  program:      {sum(self.op_counts.values())} ops ({ops})",
        ])


def certify(model: nn.Module, example_input: Any) -> Certificate:
    """Trace ``model`` on ``example_input`` and certify whether it is a polynomial.

    Never raises for a non-polynomial model: the certificate lists every offending module with
    its qualified name, type and a hint. Unknown ops still raise
    :class:`~polynets.errors.UnsupportedOpError`.
    """
    return certify_lowered(model, example_input)[0]


def certify_lowered(model: nn.Module, example_input: Any, max_depth: int | None = None
                    ) -> tuple[Certificate, Lowered | None]:
    """:func:`certify`, and the CKKS lowering of the certified program its level count was read
    from (None where there is none, or the count is an upper bound), for a compiler that would
    otherwise lower the program again. ``max_depth``: a program of more ciphertext products in
    a row than that, which the compiler will refuse, is not lowered (its level count is then the
    node-by-node upper bound)."""
    from polynets.ir.passes import optimize
    from polynets.ir.trace import record

    nodes, out, offences, meta = record(model, example_input, strict=False)
    name = type(model).__name__
    in_shape, out_shape = tuple(meta["input_shape"]), tuple(meta["output_shape"])
    if offences:
        return Certificate(name, in_shape, out_shape, False, offending=offences), None
    if out is None:
        return Certificate(name, in_shape, out_shape, True, degree=0, depth=0, levels=0,
                           plain_mults=0), None
    program = optimize(PolyProgram(nodes, out, meta=meta))
    info = _Analysis().run(program)[program.output]
    exact = levels_exact(program) and (max_depth is None or info.depth <= max_depth)
    lowered = lower(program) if exact else None
    clients: dict[tuple[bool, bool], int] = {}
    if lowered is not None:
        info = _counted_on(info, lowered)
        clients = {key: lowered_levels(low)[0]
                   for key, (low, _) in client_variants(lowered, "vector").items()}
    return Certificate(name, in_shape, out_shape, True, degree=info.degree, depth=info.depth,
                       levels=info.levels, levels_exact=exact,
                       client_levels=clients.get((True, False)),
                       first_levels=clients.get((False, True)),
                       first_client_levels=clients.get((True, True)),
                       plain_mults=info.plain_mults, program=program,
                       op_counts=program.op_counts()), lowered
