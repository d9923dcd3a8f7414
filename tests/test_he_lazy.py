"""Batch packing's lazy products: a product step read only by weighted maps may leave its
products unrelinearised and unrescaled, the maps reading them at their primes and finishing
their own (fewer) outputs instead; the compiler keeps it where the cost model says it pays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.compiler import CompiledProgram, batch_group_memory
from he.costmodel import CostModel, default_model
from he.plan import lazy_candidates, step_readers
from he.runtime import eager_products, live_rows
from he.tiling import allocated_memory, row_bytes_of
from polynets.ir.lowering import step_levels


class _Classifier(nn.Module):
    """Patch embedding, one Mu-Layer on the tokens, a linear head over every token: the
    Mu-Layer's products are read only by the head (three outputs)."""

    def __init__(self, residual: bool = True) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(8, 2, 1, 8)
        self.mu = pn.MuLayer(8, norm="batch")
        self.head = nn.Linear(16 * 8, 3)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        t = t + self.mu(t) if self.residual else self.mu(t)
        return self.head(t.flatten(1))


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    x = torch.rand(64, 1, 8, 8)
    model = _Classifier()
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x[:1], calibration=x, packing="batch")
    client = he.Client(prog)
    return model, x, prog, client, client.public_context()


def _run(prog, client, public, xs, **server_kw) -> tuple[np.ndarray, he.Server]:
    server = he.Server(prog, public, **server_kw)
    out = server.run(client.encrypt(xs).to_bytes()).to_bytes()
    return client.decrypt(out), server


def test_a_classifiers_last_products_are_left_lazy_and_decrypt_to_the_model(compiled):
    model, x, prog, client, public = compiled
    muls = [si for si, st in enumerate(prog.lowered.steps) if st.kind == "mul"]
    assert prog.options["lazy_products"] == muls[-1:]
    assert "unrelinearised" in prog.plan.why
    # the prediction counts the lazy products, and the head's outputs relinearised
    counts = prog.plan.predicted["counts"]
    assert counts["mul_lazy"] == int(prog.plan.live[muls[-1]].sum()) and counts["relin"] == 3
    xs = x[:4].numpy()
    y, server = _run(prog, client, public, xs)
    assert server.lazy_products == tuple(muls[-1:])
    sim = prog.simulate(xs)
    assert np.max(np.abs(y - sim)) <= prog.params.expected_error
    with torch.no_grad():
        assert np.max(np.abs(sim - model.double()(x[:4].double()).numpy())) <= 1e-9
    # the same program with every product finished: the same values within the promise
    with eager_products():
        y_eager, _ = _run(prog, client, public, xs)
    assert np.max(np.abs(y_eager - sim)) <= prog.params.expected_error


def test_lazy_rows_left_to_seals_chain_give_the_same_values(compiled, monkeypatch):
    """Where no fused map applies, the lazy products' weighted sums go through SEAL's
    plaintext products on three-polynomial ciphertexts."""
    import he.runtime as runtime

    _, x, prog, client, public = compiled
    monkeypatch.setattr(runtime, "fuse_map",
                        lambda *a, **k: (None, np.zeros(0, dtype=np.int64)))
    xs = x[:2].numpy()
    y, server = _run(prog, client, public, xs)
    assert server.lazy_products
    assert np.max(np.abs(y - prog.simulate(xs))) <= prog.params.expected_error


def test_only_products_read_by_weighted_maps_may_be_lazy(compiled):
    _, x, prog, _, _ = compiled
    steps = prog.lowered.steps
    for m in lazy_candidates(prog.lowered):
        assert steps[m].kind == "mul" and m != prog.lowered.output
        for st in steps:
            if m in st.inputs:
                assert st.kind == "affine" and any(t.nnz for t in st.terms)
    # a product that is the output is never lazy
    torch.manual_seed(0)
    square = pn.PolyProgram([pn.Node("input", (), (1, 4)), pn.Node("mul", (0, 0), (1, 4))], 1)
    sq = he.compile(square, np.random.default_rng(0).uniform(-1, 1, (8, 4)), packing="batch")
    assert lazy_candidates(sq.lowered) == [] and "lazy_products" not in sq.options


def test_a_program_naming_a_product_that_cannot_be_lazy_is_refused(compiled):
    _, _, prog, _, _ = compiled
    not_lazy = [si for si in range(len(prog.lowered.steps))
                if si not in lazy_candidates(prog.lowered)]
    with pytest.raises(ValueError, match="lazy_products"):
        CompiledProgram(prog.program, prog.params, prog.packing, prog.calibration,
                        {**prog.options, "lazy_products": not_lazy[:1]}, prog.certificate)
    with pytest.raises(ValueError, match="lazy_products"):
        CompiledProgram(prog.program, prog.params, prog.packing, prog.calibration,
                        {**prog.options, "lazy_products": "1"}, prog.certificate)


def test_a_group_that_fits_only_with_finished_products_runs_them_eagerly(compiled):
    """Lazy products are larger (three polynomials, one more prime): under a budget that holds
    the group whole only with every product finished, the server finishes them."""
    _, x, prog, client, public = compiled
    low, live, params = prog.lowered, live_rows(prog.lowered), prog.params
    lazy = prog.options["lazy_products"]
    n = params.poly_modulus_degree
    eager = allocated_memory(low, live, row_bytes_of(low, n, params.limbs), keep_inputs=False)
    lazy_bytes = allocated_memory(low, live, row_bytes_of(low, n, params.limbs, lazy),
                                  keep_inputs=False)
    assert lazy_bytes > eager
    from he.runtime import PLAIN_CACHE_BYTES
    budget = int(PLAIN_CACHE_BYTES + (eager + lazy_bytes) / 2)
    mem = batch_group_memory(low, live, params, budget, lazy=lazy)
    assert mem.tiles == {} and mem.lazy == ()
    assert batch_group_memory(low, live, params, None, lazy=lazy).lazy == tuple(lazy)
    xs = x[:2].numpy()
    y, server = _run(prog, client, public, xs, memory_budget=budget)
    assert server.lazy_products == () and server.tiles == {}
    assert np.max(np.abs(y - prog.simulate(xs))) <= prog.params.expected_error


def test_cost_tables_without_the_lazy_primitives_price_them_as_parts_of_a_product():
    d = default_model().to_dict()
    for ring in d["table"].values():
        ring.pop("mul_lazy", None)
        ring.pop("relin", None)
    old = CostModel.from_dict(d)
    for ring in old.table:
        for limbs in (2, 4):
            full = old.seconds("mul_ct", ring, limbs)
            assert old.seconds("relin", ring, limbs) == pytest.approx(0.85 * full)
            assert old.seconds("mul_lazy", ring, limbs) == pytest.approx(0.15 * full)


def test_products_read_by_a_map_at_a_deeper_level_are_finished():
    # a degree-3 product Polymorpher: one of its products is read by a map whose other inputs
    # lie a level deeper; left lazy, its three polynomials sat at their inputs' primes and SEAL
    # refused to add them to the rest of the map's sums
    torch.manual_seed(0)
    model = pn.PolymorpherClassifier(seq_len=6, in_features=3, num_classes=4, dim=8, depth=1,
                                     degree=3, form="products")
    x = torch.randn(64, 6, 3)
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x[:1], calibration=x, packing="batch")
    steps = prog.lowered.steps
    levels = step_levels(steps, "batch")
    readers = step_readers(prog.lowered)
    deeper = [si for si, st in enumerate(steps) if st.kind == "mul" and any(
        max(levels[j] for j in steps[r].inputs) > levels[si] for r in readers.get(si, ()))]
    assert deeper, "the model no longer has a product read at a deeper level"
    assert not set(deeper) & set(lazy_candidates(prog.lowered))
    client = he.Client(prog)
    got, _ = _run(prog, client, client.public_context(), x[:3])
    assert np.max(np.abs(got - prog.simulate(x[:3].numpy()))) <= prog.params.expected_error
    with torch.no_grad():
        assert np.max(np.abs(got - model(x[:3]).numpy())) <= prog.params.expected_error


def test_a_server_builds_the_compiled_loops_its_lazy_products_need_as_it_starts(compiled):
    # the maps reading lazy products use the fused loops whatever the fan-in the cost model
    # chose for the rest: built at the server's start, not in its first request
    from he import _kernels

    _, _, prog, _, public = compiled
    assert prog.options["lazy_products"]
    if not _kernels.expected():
        pytest.skip("no compiled loops on this machine")
    fanin = prog.options["fused_fanin"]
    prog.options["fused_fanin"] = [0] * len(fanin)
    state = _kernels._STATE.pop("kernels", None)
    try:
        he.Server(prog, public)
        assert _kernels._STATE.get("kernels") is not None
    finally:
        prog.options["fused_fanin"] = fanin
        if state is not None:
            _kernels._STATE["kernels"] = state
