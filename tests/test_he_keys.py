"""Galois keys from a power-of-two basis: where one key per distinct rotation would not fit the
server's memory budget, rotations are composed from about 2 log2(slots) keys."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import he
from he.plan import key_basis, rotation_path


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([4096, 8192, 16384]), st.integers(-70000, 70000))
def test_a_rotation_composes_from_the_basis_with_few_key_switchings(slots, step):
    basis = key_basis(slots)
    assert len(basis) == 2 * (slots.bit_length() - 1) - 1
    path = rotation_path(step, slots, basis)
    assert sum(path) % slots == step % slots
    assert all(r in basis for r in path)
    # the non-adjacent form: at most one signed power of two per two bits
    assert len(path) <= (slots.bit_length() + 1) // 2
    # a step with its own key, or no key set at all, is one rotation; no rotation is none
    assert rotation_path(step, slots, None) == ([] if step % slots == 0 else [step % slots])
    assert rotation_path(0, slots, basis) == []


def test_a_key_set_without_the_needed_powers_is_refused():
    with pytest.raises(ValueError, match="lacks"):
        rotation_path(3, 4096, [1])


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(500, 250), _Square(), nn.Linear(250, 10)).eval()
    return model, torch.rand(8, 500) * 2 - 1


def test_over_the_memory_budget_the_compiler_composes_rotations_from_a_key_basis():
    model, x = _mlp()
    # the first map on the server, which rotates (by the client, nothing is left to rotate)
    kw = dict(calibration=x, packing="vector", samples_per_ciphertext=1, ring_degree=8192,
              first_map="server")
    with warnings.catch_warnings():
        warnings.simplefilter("error", he.MemoryBudgetWarning)
        direct = he.compile(model, x, **kw)
    # not even the key basis fits one byte: the least memory is kept, and the compiler says so
    with pytest.warns(he.MemoryBudgetWarning, match=r"predicted to need \d+\.\d GiB \(keys "
                      r"\d+\.\d GiB\), more than memory_budget=0\.0 GiB; none of the candidates"):
        basis = he.compile(model, x, memory_budget=1, **kw)
    assert direct.plan.key_steps is None and "keys" not in direct.options
    assert basis.options["keys"] == "basis"
    assert basis.plan.galois_steps() == key_basis(4096)
    assert len(basis.plan.galois_steps()) < len(direct.plan.galois_steps())
    assert f"for {len(direct.plan.galois_steps())} distinct rotations" in basis.plan.why
    assert f"from {len(key_basis(4096))} power-of-two keys" in basis.plan.why
    # a composed rotation switches keys several times: the promise counts each
    assert basis.params.expected_error >= direct.params.expected_error
    # the cost model counts every key switching of a composed rotation
    assert basis.plan.cost()["rotations"] > direct.plan.cost()["rotations"]
    assert (basis.plan.predicted["seconds_per_ciphertext"] >
            direct.plan.predicted["seconds_per_ciphertext"])
    assert (basis.plan.predicted["server_memory_bytes"] <
            direct.plan.predicted["server_memory_bytes"])
    outs = []
    for prog in (direct, basis):
        client = he.Client(prog)
        public = client.public_context()
        server = he.Server(prog, public)
        y = client.decrypt(server.run(client.encrypt(x[:2].numpy()).to_bytes()).to_bytes())
        assert np.max(np.abs(y - prog.simulate(x[:2].numpy()))) <= prog.params.expected_error
        outs.append((y, len(public)))
    assert outs[1][1] < outs[0][1]                     # fewer keys sent to the server
    # the program file keeps the key set
    again = he.CompiledProgram.from_bytes(basis.to_bytes())
    assert again.plan.key_steps == basis.plan.key_steps


def test_an_unknown_key_mode_is_refused():
    model, x = _mlp()
    prog = he.compile(model, x, calibration=x, packing="vector", samples_per_ciphertext=1,
                      ring_degree=8192)
    with pytest.raises(ValueError, match="keys must be"):
        he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                           {**prog.options, "keys": "all"})
