"""Wide modulus chains: two levels per prime (a pending level at the squared scale, then one
rescale by a prime of twice the scale), chosen by the cost model in vector packing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.backend import Engine
from he.compiler import wide_phases
from he.errors import ParameterError
from he.params import KEY_SWITCHING, WIDE_SCALE_STEPS, CKKSParams, wide_variant


class _TokenNet(nn.Module):
    """A patch embedding, residual Mu-Layers on the tokens, a linear head: the products start
    from odd levels only, so the even ones can be pending."""

    def __init__(self, depth: int, dim: int = 4, img: int = 8, patch: int = 2) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(img, patch, 1, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch", spatial_shift=True)
                                 for _ in range(depth))
        self.head = nn.Linear(dim * (img // patch) ** 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


def _token_model(depth: int = 2) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _TokenNet(depth)
    x = torch.rand(8, 1, 8, 8)
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval(), x


def _wide_program(model: nn.Module, x: torch.Tensor) -> he.CompiledProgram:
    """The model compiled as usual, then re-planned on the wide chain of the same ring."""
    # N=16384: at N=8192 two Mu-Layers' wide primes exceed the 218-bit budget
    # the head on the server: applied by the client it would end the chain on the products'
    # parity, which leaves no level pending
    prog = he.compile(model, x, calibration=x, packing="vector", samples_per_ciphertext=1,
                      scale_bits=26, ring_degree=16384, final_map="server")
    phases = wide_phases(prog.lowered)
    assert phases, "the model's products should all start from one parity"
    wide = wide_variant(prog.params, phases[0], lambda p: (1.0, 1.0), 1.0)
    assert wide is not None
    return he.CompiledProgram(prog.program, wide, "vector", prog.calibration, prog.options)


def test_a_wide_chain_holds_two_levels_per_prime():
    base = CKKSParams(poly_modulus_degree=16384, coeff_mod_bit_sizes=(36,) + (26,) * 5 + (36,),
                      scale_bits=26, levels=5, security_bits=128, expected_error=1e-3,
                      max_abs=4.0, why="")
    wide = wide_variant(base, 0, lambda p: (1.0, 1.0), 1.0)
    assert wide is not None
    assert wide.coeff_mod_bit_sizes == (36, 52, 52, 52, 60)
    assert [wide.chain_index(lv) for lv in range(6)] == [0, 1, 1, 2, 2, 3]
    assert [wide.limbs(lv) for lv in range(6)] == [4, 3, 3, 2, 2, 1]
    assert [wide.drops(lv) for lv in range(5)] == [True, False, True, False, True]
    assert wide.scale_bits_at(0) == 52 and wide.scale_bits_at(1) == 26
    # the record round-trips; a record without the field is a one-prime-per-level chain
    assert CKKSParams.from_dict(wide.to_dict()) == wide
    d = base.to_dict()
    d.pop("pending")
    assert CKKSParams.from_dict(d) == base
    # a pending output level, a pending value that is not 0/1 and a wrong prime count are refused
    with pytest.raises(ParameterError, match="last level"):
        dataclasses.replace(wide, pending=1).check()
    with pytest.raises(ParameterError, match="pending must be"):
        dataclasses.replace(wide, pending=2).check()
    with pytest.raises(ParameterError, match="primes"):
        dataclasses.replace(wide, coeff_mod_bit_sizes=(36, 52, 52, 60)).check()
    # a wide record whose primes leave the weights too few bits is refused
    with pytest.raises(ParameterError, match="exceed the scale"):
        dataclasses.replace(wide, coeff_mod_bit_sizes=(36, 40, 52, 52, 60)).check()


def test_a_scale_above_30_bits_gets_60_bit_primes_and_the_noise_analysis_decides():
    """Twice a 31-bit scale exceeds SEAL's widest prime: the primes are at most 60 bits, the
    weights of maps from pending levels are encoded below the scale (2^29 at 60 bits, rounding
    2^2 times more), a special prime hardly wider switches keys noisily (counted rotation by
    rotation), and the chain is taken only if the noise analysis keeps the precision."""
    base = CKKSParams(poly_modulus_degree=16384, coeff_mod_bit_sizes=(41,) + (31,) * 5 + (41,),
                      scale_bits=31, levels=5, security_bits=128, expected_error=1e-3,
                      max_abs=4.0, why="")
    seen: list[tuple[float, float]] = []

    def gain(p: CKKSParams) -> tuple[float, float]:
        seen.append((p.weight_rounding, p.switching_noise))
        return (1.0, p.weight_rounding)

    wide = wide_variant(base, 0, gain, 1.0, scales=(31,))
    # every prime size from 60 bits down to the weights' 16 bits is priced, the special prime
    # 60 bits throughout: wider primes round the weights less, narrower ones switch keys
    # more quietly; with these gains the least rounding wins
    assert seen[0] == (2.0 ** 2, KEY_SWITCHING) and len(seen) == 7
    assert seen[-1] == (2.0 ** 14, KEY_SWITCHING * 2.0 ** -12)
    assert wide is not None and wide.coeff_mod_bit_sizes == (41, 60, 60, 60, 60)
    assert "encoded at 2^29" in wide.why and "(+0)" in wide.why
    eng = Engine(wide)
    assert 2 ** 28 < eng.plain_scales[0] < 2 ** 30
    # the same chain is refused where the amplified rounding breaks the promise
    assert wide_variant(base, 0, lambda p: (1.0, p.weight_rounding * 1e9), 1e-3) is None
    # at 45 bits the weights would get 15 bits: not tried
    big = dataclasses.replace(base, scale_bits=45, coeff_mod_bit_sizes=(55,) + (45,) * 5 + (55,))
    assert wide_variant(big, 0, lambda p: (1.0, 1.0), 1.0, scales=(45,)) is None


def test_a_wide_chain_may_take_a_lower_scale_whose_weights_round_less():
    """By default the scale is searched too, down to :data:`WIDE_SCALE_STEPS` bits below one
    prime per level's: at 2^30 the 60-bit primes encode the weights at the full scale, which
    here (the rounding weighing as much as the rescales) promises less error than 2^31's
    weights at 2^29, though encryption and rescales are twice as noisy against the scale."""
    base = CKKSParams(poly_modulus_degree=16384, coeff_mod_bit_sizes=(41,) + (31,) * 5 + (41,),
                      scale_bits=31, levels=5, security_bits=128, expected_error=1e-3,
                      max_abs=4.0, why="narrow")

    def gain(p: CKKSParams) -> tuple[float, float]:
        return (1.0, p.weight_rounding)

    kept = wide_variant(base, 0, gain, 1.0, scales=(31,))
    searched = wide_variant(base, 0, gain, 1.0)
    assert kept is not None and searched is not None
    assert searched.scale_bits == 30 and searched.weight_rounding == 1.0
    assert searched.coeff_mod_bit_sizes == (41, 60, 60, 60, 60)
    assert searched.expected_error < kept.expected_error
    assert "1 bit(s) below one prime per level's" in searched.why
    assert searched.why.endswith("narrow")
    assert Engine(searched).plain_scales[0] == pytest.approx(2.0 ** 30, rel=1e-6)
    # the 45-bit scale's weights would get 15 bits; two bits lower they get 17
    big = dataclasses.replace(base, scale_bits=45, coeff_mod_bit_sizes=(55,) + (45,) * 5 + (55,))
    lower = wide_variant(big, 0, lambda p: (1.0, 1.0), 1.0)
    assert lower is not None and 45 - WIDE_SCALE_STEPS <= lower.scale_bits < 45


def test_a_special_prime_wider_than_the_wide_primes_quiets_key_switching():
    """Key switching adds :data:`KEY_SWITCHING` (its heavy tail over the promise's safety
    factor) where the special prime is as wide as the widest data prime, halved per bit it is
    wider; none is added on a chain of one prime per level, whose rescales carry its share."""
    narrow = CKKSParams(poly_modulus_degree=16384, coeff_mod_bit_sizes=(36,) + (25,) * 5 + (45,),
                        scale_bits=25, levels=5, security_bits=128, expected_error=1e-3,
                        max_abs=4.0, why="")
    assert narrow.switching_noise == 0.0
    flush = dataclasses.replace(narrow, coeff_mod_bit_sizes=(36, 50, 50, 50, 50), pending=0)
    wider = dataclasses.replace(flush, coeff_mod_bit_sizes=(36, 50, 50, 50, 60))
    assert flush.switching_noise == KEY_SWITCHING
    assert wider.switching_noise == pytest.approx(KEY_SWITCHING / 2 ** 10)


def test_engine_scales_on_a_wide_chain_land_products_on_the_next_level():
    base = CKKSParams(poly_modulus_degree=8192, coeff_mod_bit_sizes=(30, 25, 25, 25, 40),
                      scale_bits=25, levels=3, security_bits=128, expected_error=1e-3,
                      max_abs=4.0, why="")
    wide = wide_variant(base, 0, lambda p: (1.0, 1.0), 1.0)
    eng = Engine(wide)
    assert eng.scales == [2.0 ** 50, 2.0 ** 25, 2.0 ** 50, 2.0 ** 25]
    # from a pending level: S[l] * p / q = S[l+1]; from the others: S[l] * p = S[l+1]
    q = [m.value() for m in eng.context.first_context_data().parms().coeff_modulus()]
    assert np.isclose(eng.scales[0] * eng.plain_scales[0] / q[-1], eng.scales[1])
    assert np.isclose(eng.scales[1] * eng.plain_scales[1], eng.scales[2])
    assert 2 ** 24 < eng.plain_scales[0] < 2 ** 26


@pytest.mark.parametrize("depth", [1, 2])
def test_a_token_model_on_a_wide_chain_decrypts_to_its_simulation_and_the_model(depth):
    model, x = _token_model(depth=depth)
    prog = _wide_program(model, x)
    assert prog.params.pending >= 0
    assert prog.params.data_primes < prog.params.levels + 1
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x[:3].numpy()).to_bytes()).to_bytes())
    with torch.no_grad():
        ref = model(x[:3]).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x[:3]))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4
    # the program file keeps the chain
    again = he.CompiledProgram.from_bytes(prog.to_bytes())
    assert again.params == prog.params


def test_a_ciphertext_product_from_a_pending_level_is_refused():
    import tenseal.sealapi as seal

    base = CKKSParams(poly_modulus_degree=8192, coeff_mod_bit_sizes=(30, 25, 25, 25, 40),
                      scale_bits=25, levels=3, security_bits=128, expected_error=1e-3,
                      max_abs=4.0, why="")
    eng = Engine(wide_variant(base, 0, lambda p: (1.0, 1.0), 1.0))
    pk = seal.PublicKey()
    seal.KeyGenerator(eng.context).create_public_key(pk)
    ct = seal.Ciphertext()
    seal.Encryptor(eng.context, pk).encrypt(eng.encode_vector(np.ones(eng.slots), 0,
                                                              eng.scales[0]), ct)
    assert eng.level(ct) == 0
    with pytest.raises(ParameterError, match="pending level 0"):
        eng.multiply(ct, ct)


def test_the_compiler_takes_a_wide_chain_where_the_cost_model_prices_it_cheaper():
    """Deep enough that one prime per level needs many primes: the wide chain carries about half
    as many, so its rotations and products cost less, and the compiler says why it took it;
    where the wide chain would lose precision, it keeps one prime per level."""
    model, x = _token_model(depth=3)
    kw = dict(calibration=x, packing="vector", samples_per_ciphertext=1, scale_bits=26,
              ring_degree=16384)
    prog = he.compile(model, x, precision_bits=4, **kw)
    assert prog.params.pending >= 0, prog.params
    assert "wide chain chosen" in prog.plan.why
    # at a 36-bit scale the wide primes (56 bits) leave the weights 20 bits: their rounding
    # would break the precision of one prime per level, so the compiler keeps that
    narrow = he.compile(model, x, precision_bits=30, **{**kw, "scale_bits": 36})
    assert narrow.params.pending == -1
    assert (prog.plan.predicted["seconds_per_ciphertext"] <
            narrow.plan.predicted["seconds_per_ciphertext"])
