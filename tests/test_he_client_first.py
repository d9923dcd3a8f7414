"""The program's first maps applied by the client: the lowering, the compiler's choice, the round
trip (interleaved samples, split values, a stored program), certify's count and the errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import he
import polynets as pn
from he.compiler import CompiledProgram
from he.errors import NotEncryptableError
from he.split import split_lowered
from polynets.ir.lowering import (client_first, client_inputs, client_variants, evaluate_steps,
                                  input_offsets, lower)


class PatchTokens(nn.Module):
    """Patches of a small image embedded (BatchNorm), ``depth`` residual Mu-Layers (a spatial
    shift in the first where asked), mean pooling, a linear head: the embedding and the first
    Mu-Layer's projections are affine in the input, the client's first maps."""

    def __init__(self, side: int = 8, patch: int = 2, dim: int = 8, depth: int = 1,
                 shift: bool = False):
        super().__init__()
        self.embed = pn.PatchEmbed(side, patch, 1, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch", spatial_shift=shift and i == 0)
                                 for i in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1, 2).mean(1))


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def _model(seed: int = 0, **kwargs) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = PatchTokens(**kwargs)
    x = torch.rand(48, 1, kwargs.get("side", 8), kwargs.get("side", 8))
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval(), x


def _roundtrip(prog: he.CompiledProgram, x: np.ndarray) -> np.ndarray:
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    return client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())


def _within_promise(prog: he.CompiledProgram, model: nn.Module, x: torch.Tensor) -> None:
    """decrypt == simulate (within the promise) == model on ``x``."""
    y = _roundtrip(prog, x.numpy())
    want = prog.simulate(x.numpy())
    assert y.shape == want.shape
    assert np.max(np.abs(y - want)) <= prog.params.expected_error
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x).double().numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- lowering
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.booleans(), st.integers(0, 1000))
def test_the_client_first_maps_compute_the_same_function_levels_shorter(depth, patch, shift,
                                                                          seed):
    model, x = _model(seed, depth=depth, patch=patch, shift=shift)
    low = lower(pn.trace(model, x[:1]))
    done = client_first(low)
    assert done is not None
    first, kept = done
    flat = x.numpy().reshape(len(x), -1).astype(np.float64)
    np.testing.assert_allclose(evaluate_steps(first, flat), evaluate_steps(low, flat),
                               rtol=1e-9, atol=1e-12)
    # the embedding (and what it feeds alone) cost a level on every path: not any more
    assert first.depth_levels() == low.depth_levels() - 1
    assert first.steps[0].kind == "input" and not first.steps[0].terms
    n_in = low.steps[0].n
    computed = [si for si, s in enumerate(first.steps) if s.kind == "input" and s.terms]
    assert computed and all(first.steps[si].terms[0].shape == (first.steps[si].n, n_in)
                            for si in computed)
    # each kept step is the one it was, converted or not
    for si, old in enumerate(kept):
        assert first.steps[si].shape == low.steps[old].shape
        assert first.steps[si].kind == low.steps[old].kind or si in computed
    # what the client encrypts: every input step's value at its offset
    values = client_inputs(first, flat)
    offsets = input_offsets(first)
    assert values.shape[1] == sum(first.steps[si].n for si in offsets)
    seen: dict[int, np.ndarray] = {}
    evaluate_steps(first, flat, lambda si, v: seen.__setitem__(si, v))
    for si, at in offsets.items():
        np.testing.assert_allclose(values[:, at:at + first.steps[si].n], seen[si], rtol=1e-12)
    assert client_first(first) is None           # applied once


def test_a_program_that_is_one_map_of_the_input_keeps_it_on_the_server():
    model = nn.Sequential(nn.Flatten(1), nn.Linear(12, 4)).eval()
    low = lower(pn.trace(model, torch.rand(1, 3, 4)))
    assert client_first(low) is None
    assert set(client_variants(low)) == {(False, False)}


def test_a_product_of_the_input_itself_leaves_the_input_encrypted():
    """``x * (W x)``: the client computes ``W x``, the server still needs ``x``."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(6, 6)
            self.head = nn.Linear(6, 2)

        def forward(self, x):
            return self.head(x * self.w(x))

    torch.manual_seed(0)
    model = Gate().eval()
    x = torch.rand(32, 6)
    low = lower(pn.trace(model, x[:1]))
    first, _ = client_first(low)
    reads = {j for s in first.steps for j in s.inputs}
    assert 0 in reads and first.depth_levels() == low.depth_levels() - 1
    prog = he.compile(model, x[:1], calibration=x, first_map="client")
    assert prog.options["client_first"] is True
    assert prog.plan.cost()["input_ciphertexts"] == 2
    _within_promise(prog, model, x[:3])


def test_client_variants_has_each_way_and_certify_counts_them():
    model, x = _model(1, depth=2)
    cert = pn.certify(model, x[:1])
    variants = client_variants(lower(cert.program))
    assert set(variants) == {(False, False), (True, False), (False, True), (True, True)}
    levels = {k: low.depth_levels() for k, (low, _) in variants.items()}
    assert (cert.levels, cert.client_levels, cert.first_levels, cert.first_client_levels) == \
        (levels[False, False], levels[True, False], levels[False, True], levels[True, True])
    assert levels[True, True] == levels[False, False] - 2
    text = str(cert)
    assert f"{cert.first_levels} where it applies the first maps" in text
    assert f"{cert.first_client_levels} with the last as well" in text


def test_a_split_lowering_splits_the_clients_values_by_their_rows():
    model, x = _model(2, side=8, patch=1, dim=20)           # 64 tokens x 20 channels
    first, _ = client_first(lower(pn.trace(model, x[:1])))
    split = split_lowered(first, 512, -1)
    assert split is not None
    new = split.lowered
    assert sum(s.kind == "input" and bool(s.terms) for s in new.steps) > \
        sum(s.kind == "input" and bool(s.terms) for s in first.steps)
    flat = x.numpy().reshape(len(x), -1).astype(np.float64)
    np.testing.assert_allclose(evaluate_steps(new, flat), evaluate_steps(first, flat),
                               rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- encrypted
@pytest.mark.parametrize("depth,shift", [(1, False), (2, True)])
def test_decrypt_equals_simulate_and_the_model_with_the_first_maps_on_the_client(depth, shift):
    model, x = _model(3, depth=depth, shift=shift)
    server_first = he.compile(model, x[:1], calibration=x, first_map="server")
    prog = he.compile(model, x[:1], calibration=x, first_map="client")
    assert prog.options["client_first"] is True and "client_first" not in server_first.options
    assert prog.params.levels == server_first.params.levels - 1
    # no step of the server's reads the input planes: the client encrypted the maps' values
    assert not any(s.kind == "planes" for s in prog.plan.steps)
    _within_promise(prog, model, x[:3])


def test_auto_keeps_the_cheaper_and_says_so():
    model, x = _model(4, depth=2)
    prog = he.compile(model, x[:1], calibration=x)
    found = re.search(r"of (\d+) lowerings priced", prog.plan.why)
    assert found and int(found.group(1)) >= 4, prog.plan.why
    if prog.options.get("client_first"):
        assert "the first maps applied by the client, which encrypts their values:" in \
            prog.plan.why
    _within_promise(prog, model, x[:2])


def test_interleaved_samples_each_get_their_own_first_maps():
    model, x = _model(5, side=8, patch=4, dim=8)
    prog = he.compile(model, x[:1], calibration=x, first_map="client",
                      samples_per_ciphertext=4)
    assert prog.plan.interleave == 4 and prog.options["client_first"] is True
    _within_promise(prog, model, x[:6])                       # two groups, the last partial


def test_a_split_program_with_the_first_maps_on_the_client_decrypts_within_its_promise():
    model, x = _model(6, side=8, patch=1, dim=80)            # 5,120 elements per value
    prog = he.compile(model, x[:1], calibration=x, ring_degree=8192, precision_bits=8,
                      first_map="client")
    assert prog.options["client_first"] is True and "split" in prog.options
    assert max(s.n for s in prog.lowered.steps) <= 4096
    _within_promise(prog, model, x[:2])


def test_the_stored_program_rebuilds_the_first_maps(tmp_path):
    model, x = _model(7, depth=2)
    prog = he.compile(model, x[:1], calibration=x, first_map="client")
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.options["client_first"] is True
    assert loaded.params.levels == prog.params.levels
    assert loaded.plan.op_counts() == prog.plan.op_counts()
    assert len(loaded.plan.input_layout) == len(prog.plan.input_layout)
    _within_promise(loaded, model, x[:2])


def test_the_profile_times_every_step_the_server_runs():
    model, x = _model(8, depth=2)
    prog = he.compile(model, x[:1], calibration=x, first_map="client")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    profile = server.profile(client.encrypt(x[:1].numpy()))
    timed = sorted(s for r in profile.rows for s in r.steps)
    assert timed == [si for si, st in enumerate(prog.plan.steps) if st.kind != "input"]
    assert profile.rows[0].kind == "load"
    assert f"{len(prog.plan.input_layout)} input ciphertext(s)" in profile.rows[0].work


def test_a_program_left_with_one_product_needs_no_rotation_key():
    """Linear, square, linear: the client applies both maps; the server squares."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), _Square(), nn.Linear(5, 3)).eval()
    x = torch.randn(16, 6)
    prog = he.compile(model, x[:1], calibration=x)
    assert prog.options.get("client_first") and prog.options.get("client_map")
    assert prog.params.levels == 1 and prog.plan.galois_steps() == []
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    assert server.engine.galois_keys is None
    y = client.decrypt(server.run(client.encrypt(x[:2].numpy())))
    assert np.max(np.abs(y - prog.simulate(x[:2].numpy()))) <= prog.params.expected_error


# ----------------------------------------------------------------------------- errors
def test_an_unknown_first_map_is_refused():
    model, x = _model(0)
    with pytest.raises(NotEncryptableError, match="first_map must be one of"):
        he.compile(model, x[:1], first_map="both")


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_stored_client_first_that_is_not_a_bool_is_refused(bad):
    model, x = _model(0)
    prog = he.compile(model, x[:1], calibration=x, first_map="client")
    with pytest.raises(ValueError, match="client_first must be true or false"):
        CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                        {**prog.options, "client_first": bad})


def test_a_stored_client_first_on_a_program_without_first_maps_is_refused():
    model = nn.Sequential(nn.Flatten(1), _Square(), nn.Linear(6, 2)).eval()
    x = torch.rand(8, 2, 3)
    prog = he.compile(model, x[:1], calibration=x, first_map="server")
    with pytest.raises(ValueError, match="no first map the client can apply"):
        CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                        {**prog.options, "client_first": True})


def test_batch_packing_keeps_the_first_maps_on_the_server():
    model, x = _model(0)
    prog = he.compile(model, x[:1], calibration=x, packing="batch", first_map="client")
    assert "client_first" not in prog.options
    with pytest.raises(ValueError, match="only vector packing"):
        CompiledProgram(prog.program, prog.params, "batch", prog.calibration,
                        {**prog.options, "client_first": True})
