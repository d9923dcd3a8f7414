"""Tokens packing (:mod:`he.tokens`): the decomposition into channel maps, offsets, masks and
gathered input planes is exact (slot-vector simulation == the lowered program) on the token
models users build, the padding is chosen by the cost model, and real CKKS runs agree with the
model within the promised error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from torch import nn

import he
import polynets as pn
from he.compiler import _lower
from he.tokens import (build_token_plan, simulate_tokens, token_grid,
                       token_paddings)
from polynets.ir.lowering import evaluate_steps, lower


def _randomise(model: nn.Module, seed: int) -> nn.Module:
    """Random BatchNorm statistics and biases, so every bias and folded scale is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
            mod.running_mean.copy_(torch.rand(mod.running_mean.shape, generator=g) - 0.5)
            mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
            mod.weight.data.copy_(torch.rand(mod.weight.shape, generator=g) + 0.5)
            mod.bias.data.copy_(torch.rand(mod.bias.shape, generator=g) - 0.5)
        elif isinstance(mod, (nn.Linear, nn.Conv2d)) and mod.bias is not None:
            mod.bias.data.copy_(0.2 * torch.rand(mod.bias.shape, generator=g) - 0.1)
    return model.eval()


class _TokenNet(nn.Module):
    """Patch embedding + Mu-Layers (optionally with the spatial shift) + a flattening head."""

    def __init__(self, img: int, patch: int, dim: int, depth: int, shift: bool):
        super().__init__()
        self.embed = nn.Conv2d(1, dim, patch, patch)
        self.grid = img // patch
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch", spatial_shift=shift)
                                 for _ in range(depth))
        self.head = nn.Linear(dim * self.grid ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).permute(0, 2, 3, 1)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "monet_d1": pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2,
                             embed="patch", embed_dim=8, depth=1, expansion=2, norm="batch"),
        "monet_d2": pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2,
                             embed="patch", embed_dim=8, depth=2, expansion=2, norm="batch"),
        "monet_pyramid": pn.MONet(img_size=16, in_chans=1, num_classes=10, patch_size=2,
                                  embed_dim=8, depth=2, merges=1, norm="batch"),
        # patches of one element: a token per pixel of a one-channel image
        "monet_1x1": pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=1,
                              embed="patch", embed_dim=4, depth=1, norm="batch"),
        "tokens_shift": _TokenNet(12, 2, 6, 2, True),
        "tokens_plain": _TokenNet(8, 4, 8, 2, False),
    }


def _lowered(name: str, seed: int = 0):
    model = _randomise(_models()[name], seed)
    size = {"monet_pyramid": 16, "tokens_shift": 12}.get(name, 8)
    prog, _ = _lower(model, torch.zeros(1, 1, size, size))
    return model, _kept(prog), size


def _kept(prog):
    """The lowering that keeps values read by several maps (a shifted grid) as steps of their
    own, as tokens packing lays them out (the compiler prices composing them elsewhere)."""
    return lower(prog, lower(prog).shared)


@pytest.mark.parametrize("name", list(_models()))
def test_every_padding_of_the_token_grid_computes_the_program(name):
    """The slot-vector simulation (rotations as cyclic shifts, masks, gathered input planes)
    equals the lowered program in float64 for every padding the compiler prices."""
    _, low, size = _lowered(name)
    x = np.random.default_rng(1).uniform(-1, 1, (3, size * size))
    ref = evaluate_steps(low, x)
    for padded in token_paddings(token_grid(low)):
        plan = build_token_plan(low, 8192, padded)
        y = simulate_tokens(plan, x)
        assert np.max(np.abs(y - ref)) <= 1e-12 * np.max(np.abs(ref)), padded


@settings(max_examples=8)
@given(seed=hst.integers(0, 10 ** 6), depth=hst.integers(1, 2), shift=hst.booleans(),
       dim=hst.sampled_from([4, 6, 8]))
def test_random_token_models_decompose_exactly(seed, depth, shift, dim):
    model = _randomise(_TokenNet(8, 2, dim, depth, shift), seed)
    prog, _ = _lower(model, torch.zeros(1, 1, 8, 8))
    low = _kept(prog)
    x = np.random.default_rng(seed).uniform(-1, 1, (2, 64))
    ref = evaluate_steps(low, x)
    for padded in token_paddings(token_grid(low)):
        y = simulate_tokens(build_token_plan(low, 4096, padded), x)
        assert np.max(np.abs(y - ref)) <= 1e-12 * np.max(np.abs(ref))


def test_a_shift_that_keeps_its_border_costs_masks_only_after_the_input():
    """MONet's first Poly-Block reads the input through the client's gathered planes (no
    rotation, no mask); the second block's shift reads a computed value: rotated partial sums
    through masks (a level), no slot-vector weight per channel pair."""
    _, low, _ = _lowered("monet_d2")
    plan = build_token_plan(low, 8192, (8, 8))
    first = [st for st in plan.steps if st.kind == "affine" and 0 in st.inputs]
    assert all(not any(q.delta for q in st.parts) for st in first)
    masked = [st for st in plan.steps if st.copy_of]
    assert masked and all(all(q.copy for q in st.parts if q.delta) for st in masked)
    assert all(not st.vterms or all(v.src == len(st.inputs) for v in st.vterms)
               for st in plan.steps)          # slot vectors only for border-dependent biases
    assert max(plan.levels) == low.depth_levels("tokens") + 1


def test_a_model_without_token_structure_is_refused_with_the_reason():
    model = nn.Sequential(nn.Linear(6, 5), pn.MuLayer(5), nn.Linear(5, 3)).eval()
    x = torch.randn(64, 6)
    with pytest.raises(he.NotEncryptableError, match="tokens packing does not apply"):
        he.compile(model, x[:1], calibration=x, packing="tokens")
    prog = he.compile(model, x[:1], calibration=x, packing="auto", objective="throughput")
    assert prog.packing in ("vector", "batch")


def test_the_cost_model_chooses_the_padding():
    """Without padding every shift wraps onto tokens, so its weights are slot vectors; the
    compiler prices each padding at its own levels and keeps the cheapest, and says so."""
    model, low, _ = _lowered("monet_d2")
    x = torch.rand(64, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=x, packing="tokens", precision_bits=10)
    chosen = tuple(prog.options["token_grid"])
    assert chosen in token_paddings(token_grid(low))
    assert "chosen against" in prog.plan.why and "tokens padded to" in prog.plan.why
    unpadded = build_token_plan(low, prog.params.slots, (4, 4))
    assert sum(len(st.vterms) for st in unpadded.steps) > sum(
        len(st.vterms) for st in build_token_plan(low, prog.params.slots, (8, 8)).steps)
    assert chosen != (4, 4)


@pytest.mark.parametrize("name", ["monet_d1", "tokens_plain", "monet_1x1"])
def test_encrypted_tokens_packing_agrees_with_the_model(name, encrypted_roundtrip):
    model, _, size = _lowered(name, seed=3)
    x = torch.rand(32, 1, size, size)
    encrypted_roundtrip(model, x, packing="tokens")


def test_a_group_of_samples_and_the_program_file_round_trip():
    model, _, _ = _lowered("monet_d1", seed=4)
    x = torch.rand(64, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=x, packing="tokens", precision_bits=10)
    again = he.CompiledProgram.from_bytes(prog.to_bytes())
    assert again.fingerprint == prog.fingerprint and again.packing == "tokens"
    assert again.plan.interleave == prog.plan.interleave
    client = he.Client(prog)
    server = he.Server(again, client.public_context())
    xs = x[:prog.plan.interleave + 3].numpy()         # two groups, the second part-filled
    y = client.decrypt(server.run(client.encrypt(xs).to_bytes()).to_bytes())
    assert y.shape == (len(xs), 10)
    assert np.max(np.abs(y - prog.simulate(xs))) <= prog.params.expected_error
    with pytest.raises(he.SerializationError):
        bad = client.encrypt(xs[:2])
        bad._groups[0] = bad._groups[0][:-1]            # the mask plane missing
        server.run(bad)


def test_a_warm_tokens_server_builds_at_its_start_what_requests_reuse():
    """A tokens server runs a group of encryptions of zero as it starts: its fused maps and
    encoded weights are those every request uses (the first builds nothing more), with the
    answers of a server that did not."""
    model, _, _ = _lowered("monet_d1", seed=6)
    x = torch.rand(64, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=x, packing="tokens", precision_bits=10)
    client = he.Client(prog)
    ct = client.encrypt(x[:5].numpy()).to_bytes()
    warm = he.Server(prog, client.public_context())
    cold = he.Server(prog, client.public_context(), warm=False)
    kern = warm.token_kernels
    assert warm.warm_seconds > 0 and cold.warm_seconds == 0
    assert kern.fused and kern.vectors and not cold.token_kernels.vectors
    built = (set(kern.fused), set(kern.vectors))
    y = client.decrypt(warm.run(ct))
    assert (set(kern.fused), set(kern.vectors)) == built
    assert np.array_equal(y, client.decrypt(cold.run(ct)))
    assert np.max(np.abs(y - prog.simulate(x[:5].numpy()))) <= prog.params.expected_error


def test_a_tokens_group_the_memory_does_not_hold_is_refused_before_it_runs():
    """A tokens server does not warm a group predicted over its memory, and a request is
    refused with the numbers before anything runs; once a group has run, only its ciphertexts
    count (the weights are kept)."""
    model, _, _ = _lowered("monet_d1", seed=7)
    x = torch.rand(64, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=x, packing="tokens", precision_bits=10)
    pred = prog.plan.predicted
    weights = pred["server_memory_bytes"] - prog.key_bytes() - pred["working_memory_bytes"]
    assert weights > 0
    client = he.Client(prog)
    ct = client.encrypt(x[:3].numpy())
    tight = he.Server(prog, client.public_context(), memory_budget=pred["working_memory_bytes"])
    assert tight.warm_seconds == 0 and not tight.token_kernels.vectors
    with pytest.raises(he.ResourceError, match=r"tokens-packed samples .*packing='vector'"):
        tight.run(ct)
    roomy = he.Server(prog, client.public_context(),
                      memory_budget=pred["server_memory_bytes"] - prog.key_bytes())
    assert roomy.warm_seconds > 0
    roomy._memory_budget = pred["working_memory_bytes"]     # the weights are held now
    y = client.decrypt(roomy.run(ct))
    assert np.max(np.abs(y - prog.simulate(x[:3].numpy()))) <= prog.params.expected_error


@pytest.mark.slow
def test_two_poly_blocks_with_masked_shifts_run_encrypted(encrypted_roundtrip):
    model, _, _ = _lowered("monet_d2", seed=5)
    encrypted_roundtrip(model, torch.rand(32, 1, 8, 8), packing="tokens")


@pytest.mark.parametrize("name", ["conv_seq", "p4_h128", "p7_pos_d64", "rows_d64"])
def test_user_token_models_decompose_exactly(name):
    """Models as users write them (``benchmarks/he_family.py``): channels-first convolutions,
    tokens as a flat ``(49, C)`` sequence, a learned position embedding, rows as tokens."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "he_family.py"
    spec = importlib.util.spec_from_file_location("he_family_models", path)
    family = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(family)
    model = _randomise(family.MODELS[name](), 2)
    prog, _ = _lower(model, torch.zeros(1, 1, 28, 28))
    low = _kept(prog)
    x = np.random.default_rng(2).uniform(0, 1, (2, 784))
    ref = evaluate_steps(low, x)
    plan = build_token_plan(low, 8192)
    assert all(st.tokens for st in plan.steps[:-1] if st.kind != "input")
    assert np.max(np.abs(simulate_tokens(plan, x) - ref)) <= 1e-12 * np.max(np.abs(ref))
