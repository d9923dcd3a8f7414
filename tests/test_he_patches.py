"""The input laid out by patches: the client encrypts a patch embedding's input with every
patch's elements at a common stride, so the embedding is a map repeated over patches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.costmodel import PRIMITIVES, default_model
from he.plan import build_vector_plan, input_patches, layout_shapes, search_layouts
from polynets.ir.lowering import lower, step_levels


class ColorPatches(nn.Module):
    """3-channel images, ``patch x patch`` patches (3 * 64 inputs each: not a local map), one
    Mu-Layer, mean-pooled head."""

    def __init__(self, img: int = 16, patch: int = 8, dim: int = 8):
        super().__init__()
        self.embed = pn.PatchEmbed(img, patch, 3, dim)
        self.mu = pn.MuLayer(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        t = t + self.mu(t)
        return self.head(t.flatten(1, 2).mean(1))


def _lowered(model: nn.Module, shape: tuple[int, ...]):
    torch.manual_seed(0)
    return lower(pn.trace(model.eval(), torch.rand(1, *shape)))


def test_a_patch_embeddings_input_is_refined_by_its_patches():
    low = _lowered(ColorPatches(img=32, patch=8), (3, 32, 32))
    refined, orders = input_patches(low)
    assert refined == (1, 3, 4, 8, 4, 8)        # (channel, patch row, row in patch, ...)
    # features (channel, row and column in the patch) outermost, or the patches outermost
    assert orders == [(1, 3, 5, 2, 4), (2, 4, 1, 3, 5)]
    assert layout_shapes(low)[0] == refined


def test_inputs_read_across_patches_are_not_refined():
    """A convolution whose windows overlap reads an element from several patches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=1), nn.Flatten(), nn.Linear(4 * 36, 2))
    assert input_patches(_lowered(model, (3, 8, 8))) is None


def test_a_token_sequence_is_refined_by_its_tokens():
    model = nn.Sequential(nn.Linear(8, 16), pn.MuLayer(16), nn.Flatten(), nn.Linear(16 * 12, 2))
    refined, orders = input_patches(_lowered(model, (12, 8)))
    assert refined == (1, 12, 8) and orders == [(2, 1), (1, 2)]


def test_the_search_prices_the_patch_layout_and_it_is_cheaper_here():
    low = _lowered(ColorPatches(img=32, patch=8, dim=16), (3, 32, 32))
    costs = default_model()
    slots = 4096

    def price(counts, level):
        return costs.price({k: v for k, v in counts.items() if k in PRIMITIVES}, 8192, 4)

    orders, _ = search_layouts(low, slots, price)
    assert orders[0] in input_patches(low)[1]
    row_major = [None if i == 0 else o for i, o in enumerate(orders)]
    chosen = build_vector_plan(low, slots, orders, interleave=1, price=price)
    plain = build_vector_plan(low, slots, row_major, interleave=1, price=price)
    levels = step_levels(low.steps, "vector")

    def modelled(plan):
        return sum(price(c, levels[si]) for si, c in enumerate(plan.op_counts()))

    assert modelled(chosen) < modelled(plain)
    assert chosen.cost()["rotations"] < plain.cost()["rotations"]


def test_a_program_with_its_input_laid_out_by_patches_decrypts_to_the_model_output(tmp_path):
    torch.manual_seed(0)
    model = ColorPatches(img=16, patch=8, dim=8).eval()
    x = torch.rand(32, 3, 16, 16)
    # the server applies the embedding (the client could: its input is then not encrypted)
    prog = he.compile(model, x[:1], calibration=x, first_map="server")
    assert prog.plan.orders[0] in input_patches(prog.lowered)[1]
    loaded = _stored_and_run(prog, model, x[:2], tmp_path)
    assert loaded.plan.orders[0] == prog.plan.orders[0]


def _stored_and_run(prog: he.CompiledProgram, model: nn.Module, x: torch.Tensor,
                    tmp_path) -> he.CompiledProgram:
    """``prog`` saved and loaded; the loaded one's decryption of ``x`` is within the promise of
    the simulation, which is the model's output. Returns the loaded program."""
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    client = he.Client(loaded)
    server = he.Server(loaded, client.public_context())
    out = client.decrypt(server.run(client.encrypt(x)))
    want = prog.simulate(x.numpy())
    assert np.max(np.abs(out - want)) <= prog.params.expected_error
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x).double().numpy(), rtol=1e-5, atol=1e-6)
    return loaded


def test_a_stored_input_layout_outside_its_candidates_is_refused():
    torch.manual_seed(0)
    model = ColorPatches(img=16, patch=8, dim=8).eval()
    x = torch.rand(8, 3, 16, 16)
    prog = he.compile(model, x[:1], calibration=x, first_map="server")
    bad = [list(o) if o is not None else None for o in prog.plan.orders]
    bad[0] = [2, 1, 3, 4, 5]
    with pytest.raises(ValueError, match="not an order"):
        he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                           {**prog.options, "layouts": bad})


class SmallTokens(nn.Module):
    """2x2 patches of an 8x8 image, one Mu-Layer, mean pool: its first maps read 4 pixels per
    output, so the client's input planes can replace them."""

    def __init__(self):
        super().__init__()
        self.embed = pn.PatchEmbed(8, 2, 1, 8)
        self.mu = pn.MuLayer(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        t = t + self.mu(t)
        return self.head(t.flatten(1, 2).mean(1))


def _small(**compile_kwargs: Any) -> tuple[he.CompiledProgram, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallTokens().eval()
    x = torch.rand(32, 1, 8, 8)
    # the server's first maps: from the client's input planes or one input ciphertext
    compile_kwargs.setdefault("first_map", "server")
    return he.compile(model, x[:1], calibration=x, **compile_kwargs), model, x


def test_the_compiler_prices_input_planes_against_one_input_ciphertext():
    import re

    prog, _, _ = _small()
    found = re.search(r"input planes: ([0-9.e+-]+) s, from one input ciphertext: ([0-9.e+-]+) s",
                      prog.plan.why)
    assert found, prog.plan.why
    planes, single = (float(v) for v in found.groups())
    chosen = prog.plan.predicted["round_trip_seconds"]
    # the reason prints three significant digits: within half a unit of the third
    assert chosen == pytest.approx(min(planes, single), rel=5e-3)
    no_planes = prog.options.get("max_planes") == 0
    if single != planes:            # (the reason prints three digits: a near tie reads equal)
        assert no_planes == (single < planes)
    assert (prog.plan.cost()["input_ciphertexts"] == 1) or not no_planes


def test_a_program_whose_first_maps_read_one_input_ciphertext_decrypts_and_round_trips(tmp_path):
    prog, model, x = _small(bandwidth=1e6)      # 8 Mbit/s: fewer ciphertexts to send win
    assert prog.options.get("max_planes") == 0, prog.plan.why
    assert not any(s.kind == "planes" for s in prog.plan.steps)
    loaded = _stored_and_run(prog, model, x[:3], tmp_path)
    assert loaded.options["max_planes"] == 0 and loaded.plan.op_counts() == prog.plan.op_counts()


@pytest.mark.parametrize("bad", [-1, 65, 2.0, "0"])
def test_a_stored_max_planes_out_of_range_is_refused(bad):
    prog, _, _ = _small()
    with pytest.raises(ValueError, match="max_planes"):
        he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                           {**prog.options, "max_planes": bad})
