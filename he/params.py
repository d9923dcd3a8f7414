"""CKKS parameter selection: ring degree, modulus chain and scale from depth and precision.

The user never types a modulus chain. :func:`choose_params` derives one from three facts about a
compiled program:

* ``levels``: rescales on the longest path (each plaintext or ciphertext multiplication costs one
  prime of the chain);
* ``max_abs``: the largest magnitude any intermediate value reaches on the calibration data,
  which sizes the first prime (decryption modulus) so nothing wraps around;
* ``gain``: how much a unit of rounding noise injected at every rescale grows by the output, so the
  scale can be picked for the requested output precision.

The ring degree is the smallest of 8192, 16384, 32768 whose modulus budget at the requested
classical security level holds the chain. The budgets are SEAL's own
(``CoeffModulus.MaxBitCount``, the HomomorphicEncryption.org standard's table): at 128 bits 218,
438 and 881 bits, at 192 bits 152, 305 and 611, at 256 bits 118, 237 and 476.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import tenseal.sealapi as seal

from he.errors import ParameterError, TooDeepError

__all__ = ["CKKSParams", "choose_params", "error_target", "fitting_precision", "wide_variant",
           "wide_prime_bits", "max_modulus_bits", "MAX_MODULUS_BITS", "RING_DEGREES",
           "SECURITY_LEVELS", "noise_unit", "most_levels", "check_products", "level_drops",
           "primes_dropped"]

#: Classical security levels (bits) SEAL has modulus budgets for.
SECURITY_LEVELS: tuple[int, ...] = (128, 192, 256)
_SEAL_LEVELS = {128: seal.SEC_LEVEL_TYPE.TC128, 192: seal.SEC_LEVEL_TYPE.TC192,
                256: seal.SEC_LEVEL_TYPE.TC256}
_ALL_RINGS = (1024, 2048, 4096, 8192, 16384, 32768)


@lru_cache(maxsize=None)
def seal_security_level(security: int) -> Any:
    """SEAL's ``SEC_LEVEL_TYPE`` for ``security`` bits (one of :data:`SECURITY_LEVELS`)."""
    if security not in _SEAL_LEVELS:
        raise ParameterError(f"security must be one of {SECURITY_LEVELS} bits, got {security!r}")
    return _SEAL_LEVELS[security]


def max_modulus_bits(ring_degree: int, security: int = 128) -> int:
    """Largest total coefficient-modulus bit count SEAL allows for ring degree ``ring_degree`` at
    ``security`` bits of classical security (``CoeffModulus.MaxBitCount``)."""
    if security not in _SEAL_LEVELS:
        raise ParameterError(f"security must be one of {SECURITY_LEVELS} bits, got {security!r}")
    if ring_degree not in _ALL_RINGS:
        raise ParameterError(f"ring degree {ring_degree} is not a power of two in "
                             f"{list(_ALL_RINGS)}")
    return int(seal.CoeffModulus.MaxBitCount(ring_degree, _SEAL_LEVELS[security]))


#: Largest total coefficient-modulus bit count at 128-bit classical security, per ring degree.
MAX_MODULUS_BITS: dict[int, int] = {n: max_modulus_bits(n) for n in _ALL_RINGS}
#: Ring degrees the compiler picks from (smaller rings are too shallow to be useful).
RING_DEGREES: tuple[int, ...] = (8192, 16384, 32768)
_MIN_SCALE_BITS = 20
_MAX_PRIME_BITS = 60
_MARGIN_BITS = 2
#: bits the special prime is kept above the widest data prime where the ring allows, against the
#: key-switching noise of rotations
ROTATION_BITS = 10
#: Key-switching noise of one rotation of a value at the scale, in units of the rescale noise
#: (:data:`_RESCALE_NOISE` N), where the special prime is as wide as the widest data prime; it
#: falls as 2^-boost with a special prime ``boost`` bits wider. It is heavy-tailed: measured
#: with SEAL 4 (TenSEAL 0.3.18) at N=8192, scale 2^32, over 4,096 slots and six key sets, a
#: standard deviation of 3-10 but a largest slot error of 50-600 under 60-bit primes and a
#: 60-bit special prime, 0.7 and 5-25 four bits wider, 0.67 and 3.3-4.5 (Gaussian, the modulus
#: switch's rounding, :data:`he.noise.ROTATION`) ten bits wider. The analysis promises
#: :data:`_TAIL` standard deviations, so this is the largest error seen over that factor.
KEY_SWITCHING = 80.0
#: Fewest bits of the plaintext scale of a map from a pending level (``wide prime - scale``):
#: where twice the scale exceeds the widest prime, the weights are encoded at less than the
#: scale, and the noise analysis decides whether the precision survives; below this, not tried
_WIDE_MIN_PLAIN_BITS = 16


#: Noise standard deviation of a fresh encryption, in units of the scale, per unit of sqrt(N):
#: the client (:class:`he.Client`, the only party that encrypts inputs) encrypts with the
#: secret key, whose noise is the error polynomial alone (a centred binomial of standard
#: deviation 3.2 per coefficient, 3.2 sqrt(N/2) per slot); measured with SEAL 4 (TenSEAL
#: 0.3.18): 2.28-2.30 sqrt(N) at N=8192, 16384 and 32768, a largest slot error of 3.9-4.4 of
#: them. A public-key encryption (0.166-0.167 N measured there) is 6.6 times noisier at
#: N=8192: the server's, of the constant elements of a batch-packed output, are counted
#: as a rescale each (:func:`he.noise.noise_gain`).
_ENC_NOISE = 3.5
#: Noise standard deviation of a rescale (or a rotation's modulus switch down), in units of the
#: scale, per unit of N: the rounding polynomial times the secret key grows as N, not sqrt(N);
#: measured with SEAL 4 (TenSEAL 0.3.18): 0.18-0.19 N per plaintext product and rescale, at
#: N=8192 and 16384.
_RESCALE_NOISE = 0.25
#: Safety factor of the promised error over the noise analysis' standard deviation of the
#: noisiest output element (a maximum over many elements reaches 3-4 of them).
_TAIL = 8.0


def noise_unit(ring_degree: int, scale_bits: int, gain: tuple[float, float],
               rotation: float = 0.0) -> float:
    """Promised max output error: encryption noise :data:`_ENC_NOISE` sqrt(N), rescale noise
    :data:`_RESCALE_NOISE` N plus ``rotation`` (the key-switching noise that grows with the
    largest prime over the special prime), in units of the scale, weighted by the program's
    gains ``(g_in, g_rs)`` (:func:`he.noise.noise_gain`), times the safety factor
    :data:`_TAIL`. The encryption's and the rescales' noise are independent, so their standard
    deviations add in quadrature, as the rescales' own do inside ``g_rs``."""
    g_in, g_rs = gain
    n = float(ring_degree)
    fresh = _ENC_NOISE * math.sqrt(n)
    return _TAIL * math.hypot(g_in * fresh, g_rs * (_RESCALE_NOISE * n + rotation)) \
        / 2.0 ** scale_bits


@dataclass(frozen=True)
class CKKSParams:
    """A CKKS parameter set and the reasons it was chosen.

    ``coeff_mod_bit_sizes`` is the whole chain: first (decryption) prime, ``levels`` primes of
    ``scale_bits`` bits, then the special (key-switching) prime.

    ``pending`` (0 or 1; -1: none) makes a *wide* chain: the levels of that parity are pending
    -- a value there carries the scale squared, and the next level is reached by a plaintext
    product and one rescale by a prime of twice the scale -- so the levels need half as many
    primes (a rotation costs about the square of the primes a ciphertext carries). Ciphertext
    products then happen only from the other parity (see :func:`wide_phase`).
    """

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int
    levels: int
    security_bits: int
    expected_error: float
    max_abs: float
    why: str
    pending: int = -1

    def chain_index(self, level: int) -> int:
        """Primes dropped from the chain by the time a value reaches ``level``."""
        return primes_dropped(level, self.pending)

    def drops(self, level: int) -> bool:
        """Whether a product from ``level`` to ``level + 1`` rescales (drops a prime)."""
        return level_drops(level, self.pending)

    def lift_rescales(self, level: int, target: int) -> bool:
        """Whether lifting a value from ``level`` to ``target`` (:meth:`he.backend.Engine.lift`)
        rescales: it does where the target lies on another chain (a product with an encoded 1
        and a rescale by the last prime above the target), not on the same one (the product
        alone)."""
        return self.chain_index(target) != self.chain_index(level)

    def lift_primitives(self, level: int, target: int) -> list[tuple[str, int]]:
        """The primitives a lift from ``level`` to ``target`` takes, each with the primes it
        runs on (none where ``target`` is not above ``level``)."""
        if target <= level:
            return []
        if not self.lift_rescales(level, target):
            return [("mul_plain", self.limbs(level))]
        above = self.limbs(target) + 1
        return [("mul_plain", above), ("rescale", above)]

    def switch_primitives(self, level: int, target: int) -> list[tuple[str, int]]:
        """The primitives a modulus switch of a value at ``level`` down to the primes of
        ``target`` takes (:meth:`he.backend.Engine.drop_to`): one per prime dropped, each
        about a rescale on the primes it starts from."""
        return [("rescale", limbs) for limbs in range(self.limbs(level),
                                                      self.limbs(target), -1)]

    def is_pending(self, level: int) -> bool:
        """Whether ``level`` is pending (:func:`level_pending`)."""
        return level_pending(level, self.pending)

    def scale_bits_at(self, level: int) -> int:
        """Bits of the scale a value carries at ``level`` (a pending level's is doubled)."""
        return self.scale_bits * (2 if self.is_pending(level) else 1)

    @property
    def weight_rounding(self) -> float:
        """How much more the weights of maps from a pending level round than at the scale: their
        plaintexts carry ``2^(wide prime - scale)`` (1 where the wide primes are twice the scale,
        and on a chain of one prime per level)."""
        if self.pending < 0:
            return 1.0
        return 2.0 ** max(0, 2 * self.scale_bits - self.coeff_mod_bit_sizes[1])

    @property
    def special_margin(self) -> int:
        """Bits the special (key-switching) prime has above the widest data prime."""
        return self.coeff_mod_bit_sizes[-1] - max(self.coeff_mod_bit_sizes[:-1])

    @property
    def switching_noise(self) -> float:
        """On a wide chain, what one key switching adds to a value at the scale beyond the
        modulus switch down's rounding, in units of the rescale noise: :data:`KEY_SWITCHING`
        times ``2^-boost``, ``boost`` the :attr:`special_margin`
        (:func:`he.noise.noise_gain` adds it to every value rotated at the scale; values at the
        squared scale get it 2^-scale_bits as large). 0 on a chain of one prime per level,
        whose special prime is kept :data:`ROTATION_BITS` bits wider where the ring allows
        and whose noise analysis adds ``N 2^-boost`` per rescale instead
        (:func:`noise_unit`)."""
        if self.pending < 0 or len(self.coeff_mod_bit_sizes) < 2:
            return 0.0
        return KEY_SWITCHING * 2.0 ** -self.special_margin

    @property
    def data_primes(self) -> int:
        """Primes a fresh ciphertext carries (the chain without the special prime)."""
        return len(self.coeff_mod_bit_sizes) - 1

    def limbs(self, level: int) -> int:
        """RNS primes a ciphertext carries at ``level`` (the special prime excluded)."""
        return self.data_primes - self.chain_index(level)

    @property
    def total_bits(self) -> int:
        return int(sum(self.coeff_mod_bit_sizes))

    @property
    def slots(self) -> int:
        return self.poly_modulus_degree // 2

    @property
    def scale(self) -> float:
        return 2.0 ** self.scale_bits

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["coeff_mod_bit_sizes"] = list(self.coeff_mod_bit_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CKKSParams":
        try:
            params = cls(poly_modulus_degree=int(d["poly_modulus_degree"]),
                         coeff_mod_bit_sizes=tuple(int(b) for b in d["coeff_mod_bit_sizes"]),
                         scale_bits=int(d["scale_bits"]), levels=int(d["levels"]),
                         security_bits=int(d["security_bits"]),
                         expected_error=float(d["expected_error"]), max_abs=float(d["max_abs"]),
                         why=str(d["why"]), pending=int(d.get("pending", -1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterError(f"malformed CKKS parameter record: {exc!r}") from exc
        params.check()
        return params

    def check(self) -> None:
        """Raise :class:`ParameterError` unless the set is well formed and as secure as it says
        (``security_bits``, one of :data:`SECURITY_LEVELS`)."""
        n = self.poly_modulus_degree
        budget = max_modulus_bits(n, self.security_bits)
        if self.pending not in (-1, 0, 1):
            raise ParameterError(f"pending must be -1, 0 or 1, got {self.pending}")
        if self.is_pending(self.levels):
            raise ParameterError("a wide chain's last level must not be a pending one")
        want = self.chain_index(self.levels) + 2
        if len(self.coeff_mod_bit_sizes) != want:
            raise ParameterError(f"a chain for {self.levels} levels has {want} primes, "
                                 f"got {len(self.coeff_mod_bit_sizes)}")
        if any(not 17 <= b <= _MAX_PRIME_BITS for b in self.coeff_mod_bit_sizes):
            raise ParameterError(f"prime sizes must lie in [17, {_MAX_PRIME_BITS}] bits, got "
                                 f"{list(self.coeff_mod_bit_sizes)}")
        if self.pending >= 0 and any(b - self.scale_bits < _WIDE_MIN_PLAIN_BITS
                                     for b in self.coeff_mod_bit_sizes[1:-1]):
            raise ParameterError(f"a wide chain's primes must exceed the scale by at least "
                                 f"{_WIDE_MIN_PLAIN_BITS} bits, got "
                                 f"{list(self.coeff_mod_bit_sizes)} at scale 2^{self.scale_bits}")
        if self.total_bits > budget:
            raise ParameterError(
                f"modulus of {self.total_bits} bits exceeds the {budget} bits allowed "
                f"at {self.security_bits}-bit security for N={n}")

    def __str__(self) -> str:
        chain = ", ".join(str(b) for b in self.coeff_mod_bit_sizes)
        return (f"CKKS N={self.poly_modulus_degree} ({self.slots} slots), moduli [{chain}] = "
                f"{self.total_bits} bits (<= "
                f"{max_modulus_bits(self.poly_modulus_degree, self.security_bits)} for "
                f"{self.security_bits}-bit security), scale 2^{self.scale_bits}, "
                f"{self.levels} levels" + (f" ({self.chain_index(self.levels)} wide primes, "
                                            f"levels of parity {self.pending} pending)"
                                            if self.pending >= 0 else "") +
                f", expected max output error {self.expected_error:.2e}\n"
                f"  why: {self.why}")


def level_pending(level: int, pending: int) -> bool:
    """Whether ``level`` is a pending one (its values carry the squared scale) on a chain whose
    levels of parity ``pending`` are pending (-1: one prime per level, where none is; see
    :class:`CKKSParams`)."""
    return pending >= 0 and int(level) % 2 == pending


def returned_level(level: int, last: int, pending: int) -> int:
    """The level whose primes a value the server returns at ``level`` travels on, ``last``
    being the program's deepest: the last level's, whose first prime holds any calibrated value
    at the scale (a modulus switch, no rescale), unless ``level`` is pending (its values carry
    the squared scale, which needs their own primes)."""
    return int(level) if level_pending(level, pending) else max(int(level), int(last))


def read_levels(reads: Sequence[int], levels: Sequence[int], pending: int
                ) -> list[tuple[int, int]]:
    """Per step of ``reads`` whose values the server returns, the level it is computed at and
    the one it travels on (:func:`returned_level`), ``levels`` being every step's."""
    last = max(levels, default=0)
    return [(int(levels[j]), returned_level(levels[j], last, pending)) for j in reads]


def level_drops(level: int, pending: int) -> bool:
    """Whether a product from ``level`` to ``level + 1`` rescales (drops a prime) on such a chain:
    from a pending level, or from every level where each has a prime of its own."""
    return pending < 0 or level_pending(level, pending)


def primes_dropped(level: int, pending: int) -> int:
    """Primes a value has dropped by ``level`` on such a chain (:func:`level_drops`)."""
    if pending < 0:
        return int(level)
    return sum(1 for lv in range(int(level)) if level_drops(lv, pending))


def _budget_levels(ring: int, first: int, special: int, scale_bits: int, security: int) -> int:
    return max(0, (max_modulus_bits(ring, security) - first - special) // scale_bits)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for ``n < 3.3e24`` (every prime SEAL takes)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=1024)
def ntt_primes(ring: int, bits: int, wanted: int) -> int:
    """How many primes of exactly ``bits`` bits are 1 modulo ``2 * ring`` (those a CKKS chain at
    ring degree ``ring`` can use), counted up to ``wanted``: small primes at large rings are few
    (22 bits at N=16384: five), and SEAL cannot build a chain that asks for more."""
    step = 2 * ring
    q = ((1 << bits) - 2) // step * step + 1
    found = 0
    while q >= 1 << (bits - 1) and found < wanted:
        found += _is_prime(q)
        q -= step
    return found


def _ring_chain(ring: int, levels: int, mag_bits: int, gain: tuple[float, float],
                err_target: float, scale_bits: int | None, rotations: bool, security: int
                ) -> tuple[int, int, int, int, float, int]:
    """Prime sizes for one ring: ``(first, scale, special, boost, promised error, levels the
    budget holds)``, the error :func:`noise_unit` gives that scale (above ``err_target`` only
    where large values narrowed the scale or ``scale_bits`` fixed it). The scale keeps the
    output error near ``err_target``; with rotations the special prime gets the largest extra
    (``boost``, even down from the maximum) that still leaves room for ``levels``, or none when
    even that does not fit."""
    boosts = tuple(range(ROTATION_BITS, -1, -2)) if rotations else (0,)
    for boost in boosts:
        # key switching's heavy tail, KEY_SWITCHING * 2^-boost rescales' noise per rotated
        # value, counted on every rescale (one prime per level rotates at the scale throughout)
        rot = ring * _RESCALE_NOISE * KEY_SWITCHING * 2.0 ** -boost if rotations else 0.0
        if scale_bits is None:
            want = math.log2(max(noise_unit(ring, 0, gain, rot), 1.0) / err_target)
            sb = max(_MIN_SCALE_BITS, math.ceil(want))
        else:
            sb = int(scale_bits)
        first = sb + mag_bits + _MARGIN_BITS
        if first > _MAX_PRIME_BITS:
            sb = max(_MIN_SCALE_BITS, _MAX_PRIME_BITS - mag_bits - _MARGIN_BITS)
        if scale_bits is None:
            # SEAL needs `levels` distinct primes of that size that are 1 mod 2N (checked
            # after any narrowing for large values: small primes at large rings are few)
            while sb < _MAX_PRIME_BITS and ntt_primes(ring, sb, levels) < levels:
                sb += 1
        first = min(_MAX_PRIME_BITS, sb + mag_bits + _MARGIN_BITS)
        special = min(_MAX_PRIME_BITS, max(first, sb) + boost)
        supported = _budget_levels(ring, first, special, sb, security)
        if levels <= supported:
            break
    return first, sb, special, boost, noise_unit(ring, sb, gain, rot), supported


def wide_prime_bits(scale_bits: int) -> list[int]:
    """Bits a wide chain's primes may have for a scale, widest first: twice the scale (or the
    widest prime SEAL allows), then narrower by two bits at a time, which leaves the special
    prime wider (quieter key switching) and encodes the weights of maps from pending levels at
    ``2^(prime - scale)``, less than the scale; none that leave that plaintext scale fewer than
    :data:`_WIDE_MIN_PLAIN_BITS` bits."""
    top = min(2 * int(scale_bits), _MAX_PRIME_BITS)
    return list(range(top, int(scale_bits) + _WIDE_MIN_PLAIN_BITS - 1, -2))


#: Scales a wide chain tries below the one-prime-per-level chain's: a wide chain's primes stop at
#: 60 bits, so where twice that scale exceeds them its weights round at 2^(prime - scale); a
#: scale a bit or two lower rounds them less at the price of more encryption and rescale noise,
#: and :func:`wide_variant` keeps whichever promises the least error
WIDE_SCALE_STEPS = 2


def wide_variant(params: CKKSParams, pending: int,
                 gain: Callable[["CKKSParams"], tuple[float, float]],
                 err_target: float, scales: Sequence[int] | None = None) -> CKKSParams | None:
    """``params`` with a wide chain (see :class:`CKKSParams`): the same first prime, one prime
    per pending level, the widest special prime (up to 60 bits) the ring's budget leaves. The
    scale (``scales``; by default ``params``' and up to :data:`WIDE_SCALE_STEPS` bits below it)
    and the primes' size are searched (:func:`wide_prime_bits`): narrower primes round the
    weights of maps from pending levels more, wider ones leave key switching noisier, a lower
    scale rounds the weights less and leaves the encryption and the rescales noisier;
    ``gain(p)`` gives the program's noise gains (:func:`he.noise.noise_gain`) on chain ``p``,
    which count the first two (:attr:`CKKSParams.weight_rounding`,
    :attr:`CKKSParams.switching_noise`), and the chain of least promised error is kept. None
    when no chain fits the ring's budget and keeps the precision the narrow chain promises."""
    if level_pending(params.levels, pending):
        return None
    if scales is None:
        scales = range(params.scale_bits, params.scale_bits - WIDE_SCALE_STEPS - 1, -1)
    n = sum(1 for lv in range(params.levels) if level_pending(lv, pending))
    budget = max_modulus_bits(params.poly_modulus_degree, params.security_bits)
    best: tuple[float, CKKSParams, int] | None = None
    for sb in (int(s) for s in scales if int(s) >= _MIN_SCALE_BITS):
        for wide in wide_prime_bits(sb):
            data = (params.coeff_mod_bit_sizes[0],) + (wide,) * n
            # the widest special prime the budget leaves (key-switching noise falls with it)
            chain = data + (min(_MAX_PRIME_BITS, budget - sum(data)),)
            out = dataclasses.replace(params, coeff_mod_bit_sizes=chain, pending=pending,
                                      scale_bits=sb)
            if out.special_margin < 0 or chain[-1] < 17:
                continue
            # key switching is in the gains, rotation by rotation (values at the squared scale
            # rotate almost noiselessly), not added to every rescale as on a narrow chain
            error = noise_unit(params.poly_modulus_degree, sb, gain(out))
            if best is None or error < best[0]:
                best = (error, out, wide)
    if best is None or best[0] > max(err_target, params.expected_error):
        return None
    error, out, wide = best
    sb, chain = out.scale_bits, out.coeff_mod_bit_sizes
    why = (f"wide chain: levels of parity {pending} pending (scale 2^{2 * sb}), each followed "
           f"by a rescale by a {wide}-bit prime: {n} primes for {params.levels} levels; "
           + (f"weights of maps from pending levels encoded at 2^{wide - sb}; "
              if wide < 2 * sb else "")
           + (f"scale 2^{sb}, {params.scale_bits - sb} bit(s) below one prime per level's, "
              f"so those weights round less; " if sb < params.scale_bits else "")
           + f"special prime {chain[-1]} bits (+{out.special_margin}); {sum(chain)} bits <= "
           f"{budget}; the first prime as for one prime per level: " + params.why)
    out = dataclasses.replace(out, expected_error=error, why=why)
    out.check()
    return out


def error_target(output_abs: float, precision_bits: int) -> float:
    """The output error ``precision_bits`` bits of precision allow: ``2^-bits`` of the output's
    calibrated range (at least 1e-3, so that a near-zero output does not ask for every bit)."""
    return max(float(output_abs), 1e-3) * 2.0 ** -int(precision_bits)


def most_levels(security: int = 128, rings: Sequence[int] = RING_DEGREES) -> int:
    """An upper bound on the levels any chain of ``rings`` holds at ``security``: every prime at
    the smallest scale, the first and the special prime no wider than the scale and the margin
    need. A program with more ciphertext products in a row than this fits no parameters, however
    low its precision, so a compiler can refuse it before lowering it."""
    least = _MIN_SCALE_BITS + _MARGIN_BITS
    return max(_budget_levels(int(r), least, least, _MIN_SCALE_BITS, security) for r in rings)


def check_products(depth: int, security: int = 128) -> None:
    """Refuse a program with ``depth`` ciphertext products in a row when that is more than
    :func:`most_levels`: each product costs a level in every packing, so no parameters exist for
    it, whatever its precision; a compiler calls this before lowering or calibrating anything."""
    most = most_levels(security)
    if depth > most:
        raise TooDeepError(
            f"the program has {depth} ciphertext products in a row, a multiplicative level each, "
            f"but no chain at {security}-bit security holds more than {most} levels, even at the "
            f"smallest scale (2^{_MIN_SCALE_BITS}, N={max(RING_DEGREES)}); SEAL has no "
            f"bootstrapping: reduce the model's depth (fewer Mu-Layers/blocks, degree-2 layers)",
            depth, most)


def _magnitude_bits(max_abs: float) -> int:
    """Bits the first prime holds above the scale for the largest calibrated value."""
    return max(0, math.ceil(math.log2(max(max_abs, 1.0))))


def _first_prime_holds(mag_bits: int) -> bool:
    """Whether a first prime of at most :data:`_MAX_PRIME_BITS` bits holds ``mag_bits`` bits of
    magnitude above the smallest scale. The first prime is all a value at the last level keeps:
    an output it cannot hold would wrap around whatever the noise, so no precision makes the
    parameters usable."""
    return mag_bits + _MARGIN_BITS + _MIN_SCALE_BITS <= _MAX_PRIME_BITS


def fitting_precision(levels: int, max_abs: float, gain: tuple[float, float], ring: int, *,
                      below: int, output_abs: float = 1.0, rotations: bool = False,
                      security: int = 128) -> int | None:
    """The most bits of output precision (fewer than ``below``) at which ``levels`` levels fit
    ring ``ring`` at ``security`` bits, the scale chosen as :func:`choose_params` chooses it;
    None where even one bit does not fit them. What a program rejected from a ring for its
    depth at the precision asked could have there (:func:`choose_params` at that many bits
    takes the ring)."""
    mag_bits = _magnitude_bits(max_abs)
    if not _first_prime_holds(_magnitude_bits(output_abs)):
        return None
    for bits in range(int(below) - 1, 0, -1):
        target = error_target(output_abs, bits)
        *_, expected, supported = _ring_chain(ring, int(levels), mag_bits, gain, target, None,
                                              rotations, security)
        # held, and at a scale the values left large enough for that precision
        if supported >= levels and expected <= target:
            return bits
    return None


def _refuse_magnitude(max_abs: float, mag_bits: int, scale_bits: int, expected: float,
                      output_abs: float, precision_bits: int) -> None:
    """Raise :class:`ParameterError` for values too large for the precision asked: the first
    prime (at most :data:`_MAX_PRIME_BITS` bits) holds a value's magnitude on top of the scale,
    so large values leave a scale too small for the noise to stay below the target (a chain
    with a smaller scale would decrypt to an answer that much less precise, or to garbage)."""
    if not _first_prime_holds(mag_bits):
        raise ParameterError(
            f"the model's values reach {max_abs:.3g} on the calibration data: more than a "
            f"first prime of at most {_MAX_PRIME_BITS} bits holds at any scale (values up to "
            f"2^{_MAX_PRIME_BITS - _MARGIN_BITS - _MIN_SCALE_BITS}); bring them down (normalise "
            f"the inputs, a BatchNorm or smaller weights before the products)")
    fits = math.floor(math.log2(max(float(output_abs), 1e-3) / expected))
    hint = (f", or ask for precision_bits={fits} or fewer" if fits >= 1 else "")
    raise ParameterError(
        f"the model's values reach {max_abs:.3g} on the calibration data ({mag_bits} bits above "
        f"the scale): a first prime of at most {_MAX_PRIME_BITS} bits leaves a scale of "
        f"2^{scale_bits}, whose noise (expected max output error {expected:.3g}) keeps fewer "
        f"than the {precision_bits} bits of output precision asked; bring the values down "
        f"(normalise the inputs, a BatchNorm or smaller weights before the products){hint}")


def choose_params(levels: int, max_abs: float, gain: tuple[float, float], *,
                  precision_bits: int = 16, output_abs: float = 1.0, slots_needed: int = 1,
                  ring_degree: int | None = None, scale_bits: int | None = None,
                  rotations: bool = False, security: int = 128) -> CKKSParams:
    """Pick the smallest secure CKKS parameter set for a program.

    Args:
        levels: rescales on the longest path of the program.
        max_abs: largest |value| of any intermediate node on the calibration data.
        gain: ``(g_in, g_rs)`` output error per unit of encryption and of rescale noise (see
            :func:`noise_unit`), from the compiler's error propagation.
        precision_bits: wanted bits of output precision relative to ``output_abs``.
        output_abs: largest |output| on the calibration data.
        slots_needed: slots one ciphertext must hold (vector packing's widest value).
        ring_degree, scale_bits: overrides (tests); the set must still be secure.
        rotations: the program rotates ciphertexts; the special prime then gets up to 10 extra
            bits (as many as the smallest ring allows), since key-switching noise scales with
            (largest prime / special prime).
        security: classical security in bits, one of :data:`SECURITY_LEVELS`; higher levels
            allow smaller moduli per ring, so fewer levels or a larger ring.

    Returns:
        :class:`CKKSParams`. Raises :class:`TooDeepError` when no secure set has enough levels.
    """
    levels = int(levels)
    max_modulus_bits(RING_DEGREES[0], security)  # refuses an unknown security level
    mag_bits = _magnitude_bits(max_abs)
    rings = (ring_degree,) if ring_degree is not None else RING_DEGREES
    if ring_degree is not None and ring_degree not in MAX_MODULUS_BITS:
        raise ParameterError(f"ring degree {ring_degree} is not one of {sorted(MAX_MODULUS_BITS)}")
    best_supported = 0
    sb = _MIN_SCALE_BITS
    reasons: list[str] = []
    err_target = error_target(output_abs, precision_bits)
    for ring in rings:
        if ring // 2 < slots_needed:
            reasons.append(f"N={ring}: {ring // 2} slots < {slots_needed} needed")
            continue
        first, sb, special, boost, expected, supported = _ring_chain(
            ring, levels, mag_bits, gain, err_target, scale_bits, rotations, security)
        best_supported = max(best_supported, supported)
        if levels > supported:
            reasons.append(f"N={ring}: {first}+{levels}x{sb}+{special} bits > "
                           f"{max_modulus_bits(ring, security)}")
            continue
        chain = (first,) + (sb,) * levels + (special,)
        why = (f"{levels} rescaling levels on the longest path -> {levels} primes of {sb} bits; "
               f"scale 2^{sb} so encryption/rounding noise (gains {gain[0]:.3g}/{gain[1]:.3g} to "
               f"the output) stays near 2^-{precision_bits} of the output range "
               f"{output_abs:.3g}; first prime {first} bits = scale + {mag_bits} bits for the "
               f"largest calibrated value {max_abs:.3g} + {_MARGIN_BITS} bits margin; special "
               f"prime {special} bits" + (f" (+{boost} against rotation noise)" if rotations
                                          else "") + f"; N={ring} is the smallest ring whose "
               f"{security}-bit budget ({max_modulus_bits(ring, security)} bits) holds "
               f"{sum(chain)} bits" + (" (" + "; ".join(reasons) + ")" if reasons else ""))
        if (scale_bits is None and expected > err_target) or \
                not _first_prime_holds(_magnitude_bits(output_abs)):
            _refuse_magnitude(max_abs, mag_bits, sb, expected, output_abs, precision_bits)
        params = CKKSParams(poly_modulus_degree=ring, coeff_mod_bit_sizes=chain, scale_bits=sb,
                            levels=levels, security_bits=security, expected_error=expected,
                            max_abs=float(max_abs), why=why)
        params.check()
        return params
    if all(ring // 2 < slots_needed for ring in rings):
        raise TooDeepError(f"a value needs {slots_needed} slots but the largest ring allowed "
                           f"holds {max(rings) // 2}; use packing='batch'", levels, best_supported)
    if scale_bits is not None:
        scale, hint = f"scale 2^{sb}, as asked", ", or a smaller scale_bits"
    else:
        # the scale follows from the precision asked and the noise growth of the calibrated
        # values, so the same architecture may fit once trained (or with other statistics)
        scale = (f"scale 2^{sb}, which {precision_bits} bits of output precision need with the "
                 f"noise growth of this model's calibrated values")
        fits = fitting_precision(levels, max_abs, gain, max(rings), below=precision_bits,
                                 output_abs=output_abs, rotations=rotations, security=security)
        hint = (f", or ask for precision_bits={fits} or fewer, at which they fit ('argmax' for "
                f"a classifier)" if fits is not None else
                f" (no precision fits them: even the smallest scale, 2^{_MIN_SCALE_BITS}, "
                f"holds fewer)")
    raise TooDeepError(
        f"the program needs {levels} multiplicative levels but the largest supported at "
        f"{security}-bit security is {best_supported} (N={max(rings)}, {scale}); SEAL has no "
        f"bootstrapping: reduce the model's depth (fewer Mu-Layers/blocks, degree-2 layers)"
        f"{hint}", levels, best_supported)
