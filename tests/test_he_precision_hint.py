"""The precision at which a ring rejected for depth would hold the program: the compiler's hint
(``rejected N=8192: 5 levels do not fit at 16 bits of precision (they do at up to 12 ...)``)
is :func:`he.params.choose_params`' own answer at that many bits, and the next bit's refusal."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn

import he
import polynets as pn
from he.backend import build_context
from he.errors import ParameterError, TooDeepError
from he.params import choose_params, error_target, fitting_precision


@settings(max_examples=60, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(levels=st.integers(1, 12), max_abs=st.floats(0.5, 1e14),
       g_in=st.floats(0.1, 50.0), g_rs=st.floats(0.1, 50.0), out_abs=st.floats(0.05, 50.0),
       below=st.integers(2, 30), rotations=st.booleans())
@example(levels=1, max_abs=500.0, g_in=50.0, g_rs=50.0, out_abs=0.05, below=30,
         rotations=False)
def test_the_hint_is_the_most_precision_the_ring_holds(levels, max_abs, g_in, g_rs, out_abs,
                                                       below, rotations):
    kw = dict(max_abs=max_abs, gain=(g_in, g_rs), output_abs=out_abs, ring_degree=8192,
              rotations=rotations)
    bits = fitting_precision(levels, max_abs, (g_in, g_rs), 8192, below=below,
                             output_abs=out_abs, rotations=rotations)
    # refused for depth, or for values too large for the precision at any depth
    if bits is None:
        with pytest.raises((TooDeepError, ParameterError)):
            choose_params(levels, precision_bits=1, **kw)
        return
    params = choose_params(levels, precision_bits=bits, **kw)
    assert params.poly_modulus_degree == 8192
    assert params.expected_error <= error_target(out_abs, bits)
    # the most: every precision above it, up to the one asked, is refused
    for more in range(bits + 1, below):
        with pytest.raises((TooDeepError, ParameterError)):
            choose_params(levels, precision_bits=more, **kw)


def test_a_scale_narrowed_by_large_values_still_has_its_primes():
    # 36 bits of magnitude leave a 22-bit scale under a 60-bit first prime; N=16384 has five
    # 22-bit primes that are 1 mod 2N, too few for six levels: the scale grows to 23 bits
    params = choose_params(6, max_abs=2.0 ** 36, gain=(1.0, 1.0), precision_bits=1,
                           output_abs=2.0 ** 36, ring_degree=16384)
    assert params.scale_bits >= 23 and params.coeff_mod_bit_sizes[0] <= 60
    build_context(params)           # SEAL finds the primes


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_values_no_first_prime_holds_are_refused_not_garbage():
    torch.manual_seed(0)
    x = torch.randn(16, 5)
    with pytest.raises(ParameterError, match="more than a first prime of at most 60 bits"):
        he.compile(nn.Sequential(*[_Square() for _ in range(6)]), x[:1], calibration=x)


def test_an_output_no_first_prime_holds_is_refused_at_any_precision():
    """The first prime is all the output keeps at the last level: an output of 2^45 at the
    smallest scale (2^20) needs 67 bits, more than SEAL's 60, so it would wrap around however
    little noise the program makes, even where its precision asks for almost nothing."""
    kw = dict(max_abs=2.0 ** 45, gain=(1.0, 1.0), output_abs=2.0 ** 45)
    for bits in (1, 8):
        with pytest.raises(ParameterError, match="more than a first prime of at most 60 bits"):
            choose_params(1, precision_bits=bits, **kw)
    assert fitting_precision(1, ring=8192, below=16, **kw) is None
    # an intermediate that large is held by the primes above the first: not refused for it
    choose_params(2, max_abs=2.0 ** 45, gain=(1.0, 1.0), output_abs=8.0, precision_bits=1)


def test_large_values_name_the_precision_they_leave():
    torch.manual_seed(0)
    x = torch.randn(32, 5, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(5, 3), _Square()).double()
    with torch.no_grad():
        model[0].weight.mul_(3e4)
    with pytest.raises(ParameterError, match=r"precision_bits=(\d+) or fewer") as info:
        he.compile(model, x[:1], calibration=x)
    bits = int(re.search(r"precision_bits=(\d+)", str(info.value)).group(1))
    # the most it holds: one bit more is refused as the default was
    with pytest.raises(ParameterError, match="precision_bits="):
        he.compile(model, x[:1], calibration=x, precision_bits=bits + 1)
    prog = he.compile(model, x[:1], calibration=x, precision_bits=bits)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:4])))
    with torch.no_grad():
        ref = model(x[:4]).numpy()
    assert np.max(np.abs(got - ref)) <= prog.params.expected_error


class _Tokens(nn.Module):
    """Two residual Mu-Layers on 4x4 tokens: five levels, too many for N=8192 at 24 bits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(8, 2, 1, 4)
        self.mus = nn.ModuleList(pn.MuLayer(4, norm="batch") for _ in range(2))
        self.head = nn.Linear(4 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


def test_a_program_raised_to_a_larger_ring_by_its_depth_says_what_precision_the_smaller_holds():
    torch.manual_seed(0)
    model = _Tokens()
    x = torch.rand(16, 1, 8, 8)
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    # the first maps on the server: a level more, which the subject needs
    kw = dict(calibration=x, packing="vector", samples_per_ciphertext=1, first_map="server")
    deep = he.compile(model, x[:1], precision_bits=24, **kw)
    assert deep.params.poly_modulus_degree > 8192
    hint = deep.params.why.split("they do at up to ")
    assert len(hint) == 2, deep.params.why
    bits = int(hint[1].split(":")[0])
    assert f"precision_bits={bits}" in deep.params.why
    assert he.compile(model, x[:1], precision_bits=bits, **kw).params.poly_modulus_degree == 8192
    # a scale fixed by hand gets no hint: the precision does not choose it
    fixed = he.compile(model, x[:1], precision_bits=24, scale_bits=40, **kw)
    assert "they do at up to" not in fixed.params.why


def test_a_depth_refusal_says_at_what_precision_the_largest_ring_holds_the_levels():
    """The scale depends on the precision asked and on the calibrated noise growth, so the
    refusal says which precision the largest ring holds the levels at (or that none does),
    rather than only the levels it holds at this scale."""
    kw = dict(max_abs=4.0, gain=(3.0, 3.0), output_abs=4.0, ring_degree=32768, rotations=True)
    levels = next(n for n in range(10, 60)
                  if fitting_precision(n, 4.0, (3.0, 3.0), 32768, below=17, output_abs=4.0,
                                       rotations=True) not in (None, 16))
    bits = fitting_precision(levels, 4.0, (3.0, 3.0), 32768, below=16, output_abs=4.0,
                             rotations=True)
    assert bits is not None and bits < 16
    with pytest.raises(TooDeepError, match=rf"needs {levels} multiplicative levels .*which 16 "
                       rf"bits of output precision need .*precision_bits={bits} or fewer"):
        choose_params(levels, precision_bits=16, **kw)
    assert choose_params(levels, precision_bits=bits, **kw).levels == levels
    with pytest.raises(TooDeepError, match=r"no precision fits them"):
        choose_params(200, precision_bits=16, **kw)
    with pytest.raises(TooDeepError, match=r"scale 2\^50, as asked.*a smaller scale_bits"):
        choose_params(levels, precision_bits=16, scale_bits=50, **kw)
