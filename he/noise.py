"""How CKKS noise grows through a lowered program: the gains behind the promised output error.

A CKKS value carries noise from its encryption and from every rescale (and, in vector packing,
from the rounding of encoded weight diagonals and from key switching). Its growth is followed on
the lowered steps (:mod:`polynets.ir.lowering`), the maps the server actually applies, element by
element: a weighted affine step sends the noise variances of its inputs through the squared
weights and adds one unit for its rescale plus the rounding of its encoded weights times the
inputs' calibrated mean squares (in vector packing, each input also gets one unit for the key
switching of its rotations before the weights apply); a product of two values multiplies each
one's noise by the other's calibrated magnitude (added coherently, since both may carry the same
upstream noise) and adds a rescale; a lift to a higher level adds a rescale. On a wide chain
(:class:`he.params.CKKSParams`) only the steps that drop a prime add one: a product from a
non-pending level lands on the squared scale without a rescale. The calibrated
magnitudes are per element (root mean square over the calibration data), so a wide activation's
largest element does not stand in for all of them. In batch and tokens packing, an output
element no input reaches is returned as the server's encryption of a constant with the public
key, which counts one unit of rescale noise.

:func:`noise_gain` returns ``(g_in, g_rs)``: the standard deviation of the noisiest output
element per unit of encryption noise and per unit of rescale noise, which
:func:`he.params.noise_unit` turns into the promised maximum error for a ring and a scale.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from he.params import level_drops, level_pending, primes_dropped
from polynets.ir.lowering import Lowered, affine_is_free, evaluate_steps, step_levels

__all__ = ["step_values_msq", "noise_gain"]

#: Rounding of an encoded weight, per unit of the input it multiplies (standard deviation, in
#: units of the rescale noise): a scalar (batch packing) rounds once; a slot vector (vector
#: packing) through the canonical embedding, about 0.29 sqrt(N) / scale, which against a
#: rescale's 0.25 N / scale is 0.013 at N=8192 and less above (measured: below 0.012). Tokens
#: packing has both; the scalars' rounding bounds them.
ROUNDING = {"batch": 1.0 / 12.0, "vector": 0.02, "tokens": 1.0 / 12.0}
#: Key-switching noise of a rotation, in units of the rescale noise, added to every input a
#: weighted step rotates (its baby steps) at the scale: measured, a rotation adds about as much
#: as a rescale (its modulus switch down from the special prime rounds the same way), however
#: large the special prime; a value at the squared scale (a wide chain's pending level, a giant
#: step before its rescale) gets it relatively 2^-scale_bits as large, so nothing there. Tokens
#: packing counts two: a rotation and, where a map reads a shifted value through masks, the
#: rescale of the partial sums before the masks.
ROTATION = {"batch": 0.0, "vector": 1.0, "tokens": 2.0}


def step_values_msq(lowered: Lowered, x: np.ndarray) -> list[np.ndarray]:
    """Per step, the mean square of each element of its value over the samples ``x``
    (``(B, n_input)``, the flattened calibration inputs), evaluated step by step."""
    msq: list[np.ndarray] = [np.zeros(0)] * len(lowered.steps)

    def visit(si: int, v: np.ndarray) -> None:
        msq[si] = np.mean(np.square(v), axis=0)

    evaluate_steps(lowered, x, visit)
    return msq


def noise_gain(lowered: Lowered, msq: Sequence[np.ndarray], packing: str,
               pending: tuple[int, float] | None = None,
               rotation_hops: float = 1.0, switching: float = 0.0) -> tuple[float, float]:
    """``(g_in, g_rs)`` of the output: the noise standard deviation of its noisiest element per
    unit of encryption noise and per unit of rescale noise (see the module docstring).
    ``pending=(parity, a)``: on a wide chain whose levels of that parity are pending, the
    weights multiplied there are encoded at ``1/a`` of the scale, so they round ``a`` times
    more (:func:`he.params.wide_variant`), and only the products from them rescale
    (:func:`he.params.level_drops`). ``rotation_hops``: key switchings per rotation (more
    than one where rotations are composed from a key basis, :func:`he.plan.rotation_path`).
    ``switching``: what one key switching adds beyond :data:`ROTATION` to a value at the scale,
    in units of the rescale noise (the part that grows with the primes over the special prime,
    :attr:`he.params.CKKSParams.switching_noise`; a value at the squared scale gets it
    relatively 2^-scale_bits as large, so nothing there): added to each input a map rotates
    (a stacked map's half is rotated before its rescale, at the product's scale: nothing)."""
    steps = lowered.steps
    levels = step_levels(steps, packing)
    # on a wide chain only a product from a pending level rescales; one from the other levels
    # (every ciphertext product among them) lands on the squared scale, exact but for its key
    # switching there, relatively 2^-scale_bits as large: nothing
    parity = pending[0] if pending is not None else -1
    base = ROUNDING[packing]
    switching = switching if ROTATION[packing] else 0.0     # batch packing rotates nothing
    v_in: list[np.ndarray] = []
    v_rs: list[np.ndarray] = []
    for si, st in enumerate(steps):
        if st.kind == "input":
            v_in.append(np.ones(st.n))
            v_rs.append(np.zeros(st.n))
            continue
        level = max(levels[j] for j in st.inputs)
        # an input below the step's level is lifted by a product with 1, and a rescale where
        # the lift drops a prime
        ins = [(v_in[j], v_rs[j] + (1.0 if st.kind != "mul_int" and primes_dropped(
                    levels[j], parity) < primes_dropped(level, parity) else 0.0))
               for j in st.inputs]
        # a product from here rescales: on a wide chain, exactly where its inputs are pending
        # (at the squared scale)
        rescales = 1.0 if level_drops(level, parity) else 0.0
        squared = level_pending(level, parity)
        if st.kind == "affine":
            a = np.zeros(st.n)
            r = np.zeros(st.n)
            free = affine_is_free(st, packing)
            rot = 0.0 if free or squared else (ROTATION[packing] + switching) * rotation_hops
            for m, (ai, ri), j in zip(st.terms, ins, st.inputs):
                m2 = m.multiply(m).tocsr()
                a += m2 @ ai
                r += m2 @ (ri + rot)
            if not free:
                r += rescales
                if packing == "tokens" and st.bias is not None:
                    # the bias is a weight on the encrypted mask plane, which carries the
                    # encryption noise of an input element
                    a += np.square(np.asarray(st.bias, dtype=np.float64))
                rounding = base * (pending[1] if squared else 1.0)
                for m, j in zip(st.terms, st.inputs):
                    pattern = m.copy().tocsr()
                    pattern.data = np.ones_like(pattern.data)
                    r += rounding ** 2 * (pattern @ msq[j])
        elif st.kind == "mul":
            (a0, r0), (a1, r1) = ins
            m0, m1 = (np.sqrt(msq[j]) for j in st.inputs)
            a = (m0 * np.sqrt(a1) + m1 * np.sqrt(a0)) ** 2
            r = (m0 * np.sqrt(r1) + m1 * np.sqrt(r0)) ** 2 + rescales
        else:
            f2 = float(st.factor) ** 2
            a, r = f2 * ins[0][0], f2 * ins[0][1]
        v_in.append(a)
        v_rs.append(r)
    if lowered.post is not None:
        # the client's map, in float64 on the decrypted values: their noise through its
        # squared weights, no rescale and no rounding
        # squared weights of each element (a sum the server returns adds its elements' noise)
        post = lowered.post
        maps = post.step_terms()
        a = sum(m.multiply(m).tocsr() @ v_in[j] for m, j in zip(maps, post.reads))
        r = sum(m.multiply(m).tocsr() @ v_rs[j] for m, j in zip(maps, post.reads))
    else:
        a, r = v_in[lowered.output], v_rs[lowered.output]
    if packing != "vector":
        # an output element no input reaches is returned as the server's encryption of a
        # constant, with the public key: noisier than the client's, about a rescale
        r = np.where((a == 0.0) & (r == 0.0), 1.0, r)
    return (float(np.sqrt(np.max(a, initial=0.0))), float(np.sqrt(np.max(r, initial=0.0))))
