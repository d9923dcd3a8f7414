"""Hoisted folds: a map's sums across slot blocks taken a group of rotations at a time, the
groups chosen under the cost model, the results within the promise whatever rotates them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import he
from he.compiler import _stored_weights, fold_weights, folds_one_at_a_time
from he.costmodel import shipped_model
from he.hoist import ENV_NO_HOISTING, expected
from he.plan import MAX_FOLD_RADIX, fold_groups

CHAIN = [4, 8, 16, 32, 64, 128]


def _cost(groups: list[list[int]], weights: tuple[float, float, float]) -> float:
    copy, decompose, divide = weights
    return sum(1.0 if len(g) == 1 else decompose + len(g) * copy + divide for g in groups)


def _partitions(n: int, most: int):
    """Every split of a chain of ``n`` folds into runs of at most ``most`` folds."""
    if n == 0:
        yield []
        return
    for t in range(1, min(most, n) + 1):
        for rest in _partitions(n - t, most):
            yield [t] + rest


@pytest.mark.parametrize("weights", [(0.1, 0.4, 0.5), (0.2, 0.5, 0.5), (0.35, 0.3, 0.4),
                                     (0.5, 0.4, 0.6), (1.0, 1.0, 1.0), (0.05, 2.0, 2.0)])
def test_the_grouping_is_the_cheapest_of_every_split_of_the_chain(weights):
    groups = fold_groups(CHAIN, weights)
    most = MAX_FOLD_RADIX.bit_length() - 1
    best = math.inf
    for runs in _partitions(len(CHAIN), most):
        lo, split = 0, []
        for t in runs:
            split.append([j * CHAIN[lo] for j in range(1, 1 << t)])
            lo += t
        best = min(best, _cost(split, weights))
    assert _cost(groups, weights) == pytest.approx(best)


def test_groups_cover_the_chain_and_hold_its_doubling_steps():
    groups = fold_groups(CHAIN, (0.1, 0.4, 0.5))
    assert any(len(g) > 1 for g in groups)
    assert all(len(g) + 1 <= MAX_FOLD_RADIX for g in groups)
    # each group [b, 2b, ... (r - 1) b] sums the copies log2(r) folds would, so the steps
    # of the folds it replaces are among its own (the runtime's fallback rotates by those)
    for g in groups:
        assert g == [j * g[0] for j in range(1, len(g) + 1)]
        assert (len(g) + 1) & len(g) == 0
    doubling = [f for g in groups for f in (g[(1 << i) - 1]
                                            for i in range(len(g).bit_length()))]
    assert doubling == CHAIN


def test_expensive_copies_nothing_to_weigh_or_no_doubling_chain_fold_one_at_a_time():
    assert fold_groups(CHAIN, (1.0, 1.0, 1.0)) == [[f] for f in CHAIN]
    assert fold_groups(CHAIN, None) == [[f] for f in CHAIN]
    assert fold_groups([4, 12, 16], (0.01, 0.01, 0.01)) == [[4], [12], [16]]
    assert fold_groups([], (0.1, 0.1, 0.1)) == []


def _pooled_model() -> nn.Module:
    """A linear embedding, a square and a mean over 16 tokens: the head sums across blocks."""
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            t = self.embed(x.reshape(x.shape[0], 16, 4))
            return self.head((t * t).mean(1))

    torch.manual_seed(0)
    return Pooled().eval()


@pytest.fixture(scope="module")
def pooled():
    if not expected():
        pytest.skip("no hoisting on this platform")
    x = torch.rand(16, 1, 8, 8)
    model = _pooled_model()
    # the shipped table, so that the choice does not depend on a table this machine cached;
    # the head (the folds of its mean over the tokens) on the server
    return he.compile(model, x[:1], calibration=x, packing="vector", final_map="server",
                      cost_model=shipped_model()), x, model


def test_grouped_folds_have_keys_and_counts_and_the_baseline_has_none(pooled):
    prog, x, model = pooled
    plan = prog.plan
    folds = [g for si in range(len(plan.steps)) for g in plan.step_folds(si)]
    assert folds, "the head sums across token blocks"
    assert "fold_hoist" in prog.options
    keys = set(plan.rotations())
    assert {f * plan.interleave % plan.slots for g in folds for f in g} <= keys
    grouped = prog.plan.hoisted_folds()
    counts = plan.predicted["counts"]
    assert counts.get("fold_groups", 0) == len(grouped)
    assert counts.get("fold_copies", 0) == sum(len(g) for g in grouped)
    assert {f * plan.interleave % plan.slots for g in grouped for f in g} <= \
        set(plan.hoisted_steps())
    with folds_one_at_a_time():
        single = he.compile(model, x[:1], calibration=x, packing="vector",
                            final_map="server", cost_model=shipped_model())
    assert "fold_hoist" not in single.options and not single.plan.hoisted_folds()
    assert single.plan.predicted["counts"].get("fold_groups", 0) == 0


def test_the_stored_weights_rebuild_the_same_groups(pooled, tmp_path):
    prog, _, _ = pooled
    path = tmp_path / "prog.pnhe"
    prog.save(path)
    again = he.load_program(path)
    assert [again.plan.step_folds(si) for si in range(len(again.plan.steps))] == \
        [prog.plan.step_folds(si) for si in range(len(prog.plan.steps))]
    assert again.plan.rotations() == prog.plan.rotations()


def test_fold_weights_are_prices_relative_to_a_rotation_per_level(pooled):
    prog, _, _ = pooled
    from he.costmodel import default_model
    w = fold_weights(prog.params, default_model())
    assert sorted(w) == [str(lv) for lv in range(prog.params.levels + 1)]
    assert all(len(v) == 3 and all(0 < p < 10 for p in v) for v in w.values())
    assert _stored_weights(w, "fold_hoist")(0) == tuple(w["0"])


@pytest.mark.parametrize("bad", [{"0": [1.0, 2.0]}, {"0": [-1.0, 1.0, 1.0]}, "x"])
def test_bad_fold_prices_in_a_program_are_refused(bad):
    with pytest.raises(ValueError, match="fold_hoist must map levels to three positive prices"):
        _stored_weights(bad, "fold_hoist")


def _force_groups(prog):
    """The program with its folds grouped as far as they go (cheap copies at every level),
    rebuilt from its stored options as a loaded program is."""
    opts = dict(prog.options)
    opts["fold_hoist"] = {str(lv): [0.01, 0.1, 0.1] for lv in range(prog.params.levels + 1)}
    return he.compiler.CompiledProgram(prog.program, prog.params, prog.packing,
                                       prog.calibration, opts, prog.certificate)


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_folds_decrypt_within_the_promise_hoisted_or_not(pooled, threads,
                                                                 monkeypatch):
    prog, x, model = pooled
    forced = _force_groups(prog)
    grouped = forced.plan.hoisted_folds()
    assert grouped and max(len(g) for g in grouped) + 1 == MAX_FOLD_RADIX
    client = he.Client(forced)
    public = client.public_context()
    xs = x[:forced.plan.interleave].numpy()
    request = client.encrypt(xs).to_bytes()
    sim = forced.simulate(xs)
    with torch.no_grad():
        np.testing.assert_allclose(sim, model(torch.as_tensor(xs)).double().numpy(),
                                   atol=1e-5)
    server = he.Server(forced, public, threads=threads)
    assert server.engine.hoister is not None
    got = client.decrypt(server.run(request).to_bytes())
    assert np.abs(got - sim).max() <= forced.params.expected_error
    # a server without a hoister folds each group by its doubling steps, whose keys it has
    monkeypatch.setenv(ENV_NO_HOISTING, "1")
    plain = he.Server(forced, public, threads=threads)
    assert plain.engine.hoister is None
    got = client.decrypt(plain.run(request).to_bytes())
    assert np.abs(got - sim).max() <= forced.params.expected_error


def test_extended_sums_are_reduced_modulo_each_prime(pooled):
    prog, x, _ = pooled
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    hoister = server.engine.hoister
    limbs = 2
    q = hoister._level(limbs).moduli
    rng = np.random.default_rng(1)
    words = [np.stack([np.stack([rng.integers(0, int(p), hoister.ring, dtype=np.uint64)
                                 for p in q]) for _ in range(2)]) for _ in range(5)]
    want = sum(w.astype(object) for w in words) % q.astype(object).reshape(1, -1, 1)
    exts = [he.hoist.Extended(None, w.copy()) for w in words]
    got = hoister.add_ext(exts).words
    assert got.dtype == np.uint64 and (got.astype(object) == want).all()
    with pytest.raises(ValueError, match="different levels"):
        hoister.add_ext([he.hoist.Extended(None, words[0].copy()),
                         he.hoist.Extended(None, words[0][:, :2].copy())])
