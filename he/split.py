"""Values wider than a ciphertext, split over several ciphertexts of a smaller ring.

Vector packing holds one value in one ciphertext, so a value of more elements than a ring's
slots (14 x 14 tokens of 64 channels: 12,544 elements) would force the next ring, whose every
primitive costs about twice as much. :func:`split_lowered` rewrites the lowered program instead:
each such value becomes ``k`` values, contiguous blocks along one axis of its layout shape
(channel groups, or rows of tokens), and every step follows:

* an affine step becomes one step per output block, with a term for every (input, input block)
  pair whose sub-matrix is not zero: a map acting on channels, split by channel groups, is a
  ``k x k`` block matrix whose blocks have ``1/k`` of its diagonals, and one acting on tokens is
  block diagonal;
* products and integer multiples act block by block (their operands share one split, as they
  share one layout, see :func:`he.plan.layout_groups`), and an identity term stays an identity
  between blocks of one split, so no step needs a level it did not need before.

The plans of :mod:`he.plan` then run unchanged on the rewritten program: baby-step rotations of an
input block are shared by every output block that reads it, giant steps by an output block's
terms. Baby steps and giant steps of a ``c``-channel map number about ``2 sqrt(c)``; over ``k``
blocks they number ``2 sqrt(k c)`` at half (for ``k = 2``) the price each, so a channel split in
the smaller ring is cheaper where it is possible, and the compiler prices both
(:func:`he.compiler.compile`). The program's input and output are never split: the client's
ciphertexts and the decryption stay as they are; where the client applies the program's last map
(:func:`polynets.ir.lowering.client_map`), the values it reads may be, and it reads each block
through its columns; a value the client computes from the input
(:func:`polynets.ir.lowering.client_first`) may be too, each block from its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from he.plan import layout_groups, layout_shapes
from polynets.ir.lowering import ClientMap, Lowered, Step

__all__ = ["Split", "split_lowered", "SPLIT_AXES", "MAX_BLOCKS"]

#: axes of a value's layout shape (of those longer than one) that a split is tried along: the
#: last (a token model's channels) and the first (its rows of tokens)
SPLIT_AXES: tuple[int, ...] = (-1, 0)
#: most ciphertexts one value is split over (the maps between them grow as the square)
MAX_BLOCKS = 8


@dataclass
class Split:
    """A lowered program with its wide values split: ``origin[i]`` is the step of the original
    program that new step ``i`` computes part of, and the original's flat element indices it
    holds (None: all of them)."""

    lowered: Lowered
    origin: list[tuple[int, np.ndarray | None]]
    axis: int
    slots: int
    blocks: int                       # ciphertexts of the widest split value

    def slice_values(self, per_step: list[np.ndarray]) -> list[np.ndarray]:
        """Per new step, its part of a per-element array of the original steps (such as
        :func:`he.noise.step_values_msq`'s)."""
        return [per_step[i] if idx is None else np.asarray(per_step[i])[idx]
                for i, idx in self.origin]


def _partition(shape: tuple[int, ...], axis: int, slots: int
               ) -> tuple[list[np.ndarray], list[tuple[int, ...]]] | None:
    """Contiguous blocks along ``axis`` (of the axes longer than one; from the end when
    negative) of a row-major value of ``shape``, as few as leave each at most ``slots``
    elements: the flat indices and shape of each. None when the axis cannot make blocks that
    small."""
    axes = [i for i, n in enumerate(shape) if n > 1]
    if not -len(axes) <= axis < len(axes):
        return None
    a = axes[axis]
    size = int(shape[a])
    rest = int(np.prod(shape, dtype=np.int64)) // max(size, 1)
    if size < 2 or rest > slots:
        return None
    k = next(k for k in range(2, size + 1) if -(-size // k) * rest <= slots)
    if k > MAX_BLOCKS:
        return None
    outer = int(np.prod(shape[:a], dtype=np.int64))
    inner = int(np.prod(shape[a + 1:], dtype=np.int64))
    idx = np.arange(outer * size * inner, dtype=np.int64).reshape(outer, size, inner)
    blocks, shapes = [], []
    for chunk in np.array_split(np.arange(size), k):
        lo, hi = int(chunk[0]), int(chunk[-1]) + 1
        blocks.append(idx[:, lo:hi, :].ravel())
        shapes.append(tuple(int(s) for s in shape[:a]) + (hi - lo,) +
                      tuple(int(s) for s in shape[a + 1:]))
    return blocks, shapes


def split_lowered(lowered: Lowered, slots: int, axis: int) -> Split | None:
    """``lowered`` with every value of more than ``slots`` elements split along ``axis`` of its
    layout shape (see the module docstring); None when nothing needs splitting, or when a value
    that does cannot be split along ``axis`` into at most :data:`MAX_BLOCKS` blocks, or is the
    program's input or output, or when a block of a map would read no input (its outputs have
    zero weights along that axis)."""
    steps = lowered.steps
    group = layout_groups(lowered)
    shapes = layout_shapes(lowered)
    parts: dict[int, tuple[list[np.ndarray], list[tuple[int, ...]]]] = {}
    for si, st in enumerate(steps):
        g = group[si]
        if st.n <= slots or g in parts:
            continue
        members = [i for i in range(len(steps)) if group[i] == g]
        if 0 in members or (lowered.post is None and lowered.output in members):
            return None
        shape = max((shapes[i] for i in members), key=lambda s: sum(n > 1 for n in s))
        part = _partition(shape, axis, slots)
        if part is None:
            return None
        parts[g] = part
    if not parts:
        return None
    new: list[Step] = []
    origin: list[tuple[int, np.ndarray | None]] = []
    index: list[list[int]] = []               # old step -> its new steps, one per block
    blocks_of: list[list[np.ndarray | None]] = []
    for si, st in enumerate(steps):
        blocks, bshapes = parts.get(group[si], ([None], [st.shape]))
        index.append([])
        blocks_of.append(list(blocks))
        for b, (blk, shape) in enumerate(zip(blocks, bshapes)):
            if st.kind == "affine":
                inputs, terms = [], []
                for t, j in enumerate(st.inputs):
                    m = st.terms[t].tocsr()
                    if blk is not None:
                        m = m[blk]
                    for jb, jblk in zip(index[j], blocks_of[j]):
                        sub = (m if jblk is None else m[:, jblk]).tocsr()
                        sub.eliminate_zeros()
                        if sub.nnz:
                            inputs.append(jb)
                            terms.append(sub)
                if not terms:
                    # a block no input reaches (outputs with zero weights) would be a constant,
                    # which no step computes: not along this axis
                    return None
                bias = None if st.bias is None else \
                    np.asarray(st.bias)[blk] if blk is not None else st.bias
                step = Step("affine", tuple(inputs), shape, terms, bias, st.factor)
            elif st.kind == "input" and st.terms:
                # a value the client computes (polynets.ir.lowering.client_first): its rows
                m = st.terms[0].tocsr()
                bias = st.bias if st.bias is None or blk is None else np.asarray(st.bias)[blk]
                step = Step("input", (), shape, [m if blk is None else m[blk]], bias)
            else:
                inputs = tuple(index[j][b] if len(index[j]) > 1 else index[j][0]
                               for j in st.inputs)
                step = Step(st.kind, inputs, shape, [], None, st.factor)
            index[si].append(len(new))
            new.append(step)
            origin.append((si, blk))
    widest = max(len(p[0]) for p in parts.values())
    out = Lowered(new, index[lowered.output][0])
    if lowered.post is not None:
        # the client's map reads every block of a value it read, through its columns
        reads, terms = [], []
        for j, m in zip(lowered.post.reads, lowered.post.terms):
            for jb, jblk in zip(index[j], blocks_of[j]):
                sub = (m.tocsr() if jblk is None else m.tocsr()[:, jblk]).tocsr()
                sub.eliminate_zeros()
                if sub.nnz:
                    reads.append(jb)
                    terms.append(sub)
        out.post = ClientMap(tuple(reads), terms, lowered.post.bias, lowered.post.shape)
    return Split(out, origin, axis, slots, widest)
