"""Values read by several maps: the lowering composes a thin one (a product plus the value it
multiplied, a scaling) into every map that reads it; the compiler prices keeping it as a step of
its own where composing may pay (a level, or batch packing's lifts) and keeps the cheaper
program, which computes the model either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.compiler import _candidate_lowerings, _keep_or_compose, _worth_composing
from he.plan import batch_lifts
from he.runtime import live_rows
from polynets.ir.lowering import SHARED_ROW_NNZ, affine_is_free, evaluate_steps, lower

from _models import compile_candidates


class ResidualMus(nn.Module):
    """Two residual Mu-Layers on ``(tokens, dim)``: the first one's ``AX * BDX + AX`` is read
    by the second one's maps and by the head (its ``C`` composed into each of them)."""

    def __init__(self, tokens: int = 4, dim: int = 4, depth: int = 2):
        super().__init__()
        self.mus = nn.ModuleList(pn.MuLayer(dim) for _ in range(depth))
        self.head = nn.Linear(tokens * dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mu in self.mus:
            x = x + mu(x)
        return self.head(x.flatten(1))


def _model_and_data(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return ResidualMus().eval(), torch.rand(32, 4, 4)


def _lifts(low) -> int:
    return sum(n for step in batch_lifts(low, live_rows(low)) for n in step.values())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_thin_shared_value_is_composed_into_its_readers_and_computes_the_same(seed):
    model, x = _model_and_data(seed)
    program = pn.trace(model, x[:1])
    composed = lower(program)
    assert composed.shared, "the first Mu-Layer's sum is read by three maps"
    kept = lower(program, composed.shared)
    assert kept.shared == ()
    flat = x[:8].numpy().reshape(8, -1).astype(np.float64)
    want = program.simulate(x[:8].numpy()).reshape(8, -1)
    for low in (composed, kept):
        np.testing.assert_allclose(evaluate_steps(low, flat), want, rtol=1e-9, atol=1e-12)
    # one step fewer, never a level more; kept, the sum adds a product to a value a level
    # below it, which batch packing lifts first (a plaintext product and a rescale each)
    assert len(composed.steps) == len(kept.steps) - len(composed.shared)
    for kind in ("vector", "batch"):
        assert composed.depth_levels(kind) <= kept.depth_levels(kind)
    assert _lifts(composed) == 0 < _lifts(kept)
    assert set(kept.kept_steps) == set(composed.shared)
    assert _worth_composing("batch", kept, composed.shared) == composed.shared
    # in vector packing a lift is one ciphertext's product: composing only adds rotations
    assert _worth_composing("vector", kept, composed.shared) == ()

def test_a_value_a_product_reads_or_a_dense_one_is_still_a_step():
    """A value read by a ciphertext product is materialised for it anyway; a dense one (a
    linear map read by several maps) would multiply every reader's work."""
    torch.manual_seed(0)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.out = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x * x
            h = self.lin(s)                      # dense, read by the product and the head
            return self.out(h * h + h)

    program = pn.trace(Both().eval(), torch.rand(1, 8))
    low = lower(program)
    assert low.shared == ()
    assert SHARED_ROW_NNZ < 8


def test_batch_packing_prices_both_lowerings_and_keeps_the_cheaper():
    model, x = _model_and_data()
    program = pn.trace(model, x[:1])
    calib = x.numpy().astype(np.float64)
    cands = _candidate_lowerings(program, calib, kind="batch")
    assert [bool(keep) for keep, _, _ in cands] == [False, True]
    assert [keep for keep, _, _ in _candidate_lowerings(program, calib)] == \
        [lower(program).shared]
    tried = compile_candidates(program, calib, "batch", (8192, 16384))
    best = _keep_or_compose(tried, "latency", None, None)
    seconds = [p.plan.predicted["round_trip_seconds"] for p in tried]
    assert best.plan.predicted["round_trip_seconds"] == min(seconds)
    assert "2 lowerings priced" in best.plan.why
    assert best.params.levels == best.lowered.depth_levels("batch")
    # the composed program skips the lifts the kept one pays for
    composed, kept = tried
    assert composed.plan.predicted["counts"]["rescale"] < kept.plan.predicted["counts"]["rescale"]


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_the_program_chosen_decrypts_to_the_model_output(packing, tmp_path):
    model, x = _model_and_data(3)
    prog = he.compile(model, x[:1], calibration=x, packing=packing)
    program = prog.program
    shared = lower(program).shared
    kept = prog.options.get("kept_apart", [])
    if packing == "vector":
        assert kept == list(shared), prog.plan.why       # no level to save: kept as a step
    else:
        assert "lowerings priced" in prog.plan.why
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.options.get("kept_apart", []) == kept
    assert len(loaded.lowered.steps) == len(prog.lowered.steps)
    client = he.Client(loaded)
    server = he.Server(loaded, client.public_context())
    sample = x[:4].numpy()
    out = client.decrypt(server.run(client.encrypt(sample).to_bytes()).to_bytes())
    want = prog.simulate(sample)
    assert np.max(np.abs(out - want)) <= prog.params.expected_error
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x[:4]).double().numpy(), rtol=1e-5, atol=1e-5)


def test_shared_values_as_steps_is_the_baseline_lowering():
    from he.compiler import shared_values_as_steps
    model, x = _model_and_data()
    composed = he.compile(model, x[:1], calibration=x, packing="batch")
    with shared_values_as_steps():
        kept = he.compile(model, x[:1], calibration=x, packing="batch")
    assert kept.options.get("kept_apart") == list(lower(kept.program).shared)
    assert composed.options.get("kept_apart") is None, composed.plan.why
    assert len(kept.lowered.steps) > len(composed.lowered.steps)
    sample = x[:2].numpy()
    np.testing.assert_allclose(kept.simulate(sample), composed.simulate(sample), rtol=1e-9)


def test_only_the_values_worth_composing_in_a_packing_are_composed():
    """A shared value whose step is weighted (the shifted patch embedding of a MONet) costs a
    level in every packing: worth composing in both; a sum over two levels costs lifts in batch
    packing only."""
    torch.manual_seed(0)
    model = pn.MONet(img_size=8, in_chans=1, num_classes=3, patch_size=2, embed_dim=8, depth=1,
                     norm="batch").eval()
    program = pn.trace(model, torch.rand(1, 1, 8, 8))
    composed = lower(program)
    kept = lower(program, composed.shared)
    weighted = {n for n in composed.shared
                if not affine_is_free(kept.steps[kept.kept_steps[n]], "batch")}
    levels = kept.levels("batch")
    two_level_sums = {n for n in composed.shared if n not in weighted and len(
        {levels[j] for j in kept.steps[kept.kept_steps[n]].inputs}) > 1}
    assert weighted and two_level_sums
    assert set(_worth_composing("batch", kept, composed.shared)) == weighted | two_level_sums
    assert set(_worth_composing("vector", kept, composed.shared)) == weighted
    x = np.random.default_rng(0).uniform(0, 1, (2, 64))
    for kind in ("batch", "vector"):
        for keep, low, _ in _candidate_lowerings(program, x.reshape(2, 1, 8, 8), kind=kind):
            np.testing.assert_allclose(evaluate_steps(low, x), evaluate_steps(composed, x),
                                       rtol=1e-9, atol=1e-12)
