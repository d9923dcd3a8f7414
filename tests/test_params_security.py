"""Security levels of the CKKS parameters: budgets read from SEAL, 128/192/256-bit sets."""

from __future__ import annotations

import pytest
import tenseal.sealapi as seal

from he.backend import build_context
from he.errors import ParameterError, TooDeepError
from he.params import (MAX_MODULUS_BITS, SECURITY_LEVELS, CKKSParams, choose_params,
                       max_modulus_bits)

# HomomorphicEncryption.org standard, classical security, N = 8192 / 16384 / 32768
STANDARD = {128: (218, 438, 881), 192: (152, 305, 611), 256: (118, 237, 476)}
GAIN = (1.0, 1.0)


def test_budgets_are_seal_s_and_match_the_standard_table() -> None:
    for security, budgets in STANDARD.items():
        assert tuple(max_modulus_bits(n, security) for n in (8192, 16384, 32768)) == budgets
    assert MAX_MODULUS_BITS == {n: max_modulus_bits(n, 128) for n in MAX_MODULUS_BITS}
    assert max_modulus_bits(4096, 192) == seal.CoeffModulus.MaxBitCount(4096, seal.SEC_LEVEL_TYPE.TC192)


@pytest.mark.parametrize("security", SECURITY_LEVELS)
def test_chosen_sets_fit_the_budget_of_their_level_and_say_so(security: int) -> None:
    params = choose_params(4, max_abs=10.0, gain=GAIN, security=security)
    assert params.security_bits == security
    assert params.total_bits <= max_modulus_bits(params.poly_modulus_degree, security)
    assert f"{security}-bit" in str(params) and f"{security}-bit budget" in params.why
    assert CKKSParams.from_dict(params.to_dict()) == params
    build_context(params)  # SEAL accepts the chain


def test_higher_security_needs_a_larger_ring_for_the_same_depth() -> None:
    rings = {s: choose_params(4, max_abs=10.0, gain=GAIN, security=s).poly_modulus_degree
             for s in SECURITY_LEVELS}
    assert rings == {128: 8192, 192: 16384, 256: 16384}
    deep = choose_params(14, max_abs=10.0, gain=GAIN, security=128)
    with pytest.raises(TooDeepError, match="256-bit security"):
        choose_params(deep.levels + 8, max_abs=10.0, gain=GAIN, security=256,
                      ring_degree=deep.poly_modulus_degree)


def test_a_set_that_claims_more_security_than_its_modulus_allows_is_refused() -> None:
    params = choose_params(4, max_abs=10.0, gain=GAIN, security=128)
    assert params.poly_modulus_degree == 8192 and params.total_bits > max_modulus_bits(8192, 256)
    record = params.to_dict() | {"security_bits": 256}
    with pytest.raises(ParameterError, match="at 256-bit security"):
        CKKSParams.from_dict(record)


@pytest.mark.parametrize("security", [0, 100, 512, "128"])
def test_unknown_security_levels_are_refused(security) -> None:
    with pytest.raises(ParameterError, match=r"security must be one of \(128, 192, 256\)"):
        choose_params(2, max_abs=1.0, gain=GAIN, security=security)


@pytest.mark.parametrize("ring, bits", [(8192, 20), (16384, 22), (32768, 23)])
def test_ntt_prime_count_is_what_seal_can_build(ring, bits):
    import tenseal.sealapi as seal

    from he.params import ntt_primes

    n = ntt_primes(ring, bits, 1000)
    seal.CoeffModulus.Create(ring, [bits] * n)
    with pytest.raises(RuntimeError, match="enough qualifying primes"):
        seal.CoeffModulus.Create(ring, [bits] * (n + 1))


def test_a_small_scale_is_raised_until_the_ring_has_primes_for_every_level():
    from he.backend import build_context
    from he.params import choose_params, ntt_primes

    # 9 levels at a precision that asks for a ~22-bit scale: N=16384 has five 22-bit primes
    params = choose_params(9, 1.0, (1e-3, 1e-3), precision_bits=4, output_abs=1.0,
                           ring_degree=16384)
    assert ntt_primes(16384, params.scale_bits, 9) == 9
    build_context(params)
