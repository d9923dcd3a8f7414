"""Compositions that multiply the work: the lowering names them, the compiler prices keeping
them apart (a level more each) and keeps the cheaper program, which still computes the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from he.compiler import CompiledProgram, _keep_or_compose
from polynets.ir.lowering import DENSE_JOIN_FACTOR, evaluate_steps, lower

from _models import compile_candidates


class PadreTokens(nn.Module):
    """A degree-2 PADRe block with a residual over a ``side x side`` token grid, flattened head:
    its channel mixing composed into the 11x11 depthwise token mixing reads every token."""

    def __init__(self, dim: int = 16, side: int = 7, degree: int = 2):
        super().__init__()
        self.mix = pn.PADRe(dim, degree=degree, kernel_size=11)
        self.head = nn.Linear(dim * side * side, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.mix(x)).flatten(1))


def _model_and_data(seed: int = 0, dim: int = 16) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return PadreTokens(dim).eval(), torch.randn(64, 7, 7, dim)


def test_dense_joins_are_named_and_keeping_them_apart_computes_the_same_function():
    model, x = _model_and_data()
    program = pn.trace(model, x[:1])
    composed = lower(program)
    assert composed.dense_joins, "the channel mixing composed into the token mixing is dense"
    apart = lower(program, composed.dense_joins)
    flat = x[:8].numpy().reshape(8, -1).astype(np.float64)
    want = program.simulate(x[:8].numpy()).reshape(8, -1)
    for low in (composed, apart):
        np.testing.assert_allclose(evaluate_steps(low, flat), want, rtol=1e-9, atol=1e-9)
    # a level more on the kept maps' paths, far fewer weights
    assert apart.depth_levels() > composed.depth_levels()
    def nnz(low):
        return sum(m.nnz for s in low.steps if s.kind == "affine" for m in s.terms)

    assert nnz(apart) * 4 < nnz(composed)
    assert not apart.dense_joins or set(apart.dense_joins) != set(composed.dense_joins)


def test_maps_that_do_not_densify_are_not_named():
    """Stacked Mu-Layers (each C fused into the next A and D) compose without densifying."""
    torch.manual_seed(0)
    model = nn.Sequential(pn.MuLayer(8, hidden=16), pn.MuLayer(8, hidden=16)).eval()
    program = pn.trace(model, torch.randn(1, 4, 8))
    assert lower(program).dense_joins == ()
    assert DENSE_JOIN_FACTOR > 1


def test_keep_outside_the_program_is_refused():
    model, x = _model_and_data()
    program = pn.trace(model, x[:1])
    with pytest.raises(ValueError, match="outside the program"):
        lower(program, [len(program.nodes)])


def test_the_compiler_keeps_the_cheaper_lowering_and_says_why():
    model, x = _model_and_data()
    program = pn.trace(model, x[:1])
    calib = x.numpy().astype(np.float64)
    tried = compile_candidates(program, calib, "vector", (8192, 16384, 32768))
    assert len(tried) == 2
    best = _keep_or_compose(tried, "latency", None, None)
    seconds = [p.plan.predicted["round_trip_seconds"] for p in tried]
    assert best.plan.predicted["round_trip_seconds"] == min(seconds)
    assert "kept apart" in best.plan.why and "composed" in best.plan.why
    assert best.params.levels == best.lowered.depth_levels()


def test_a_program_compiled_with_maps_kept_apart_decrypts_to_the_model_output(tmp_path):
    # 24 channels: at 16, the composed maps' four levels take a wide chain, which the cost
    # model prefers to keeping them apart
    model, x = _model_and_data(dim=24)
    prog = he.compile(model, x[:1], calibration=x, final_map="server", first_map="server")
    kept = prog.options.get("kept_apart")
    assert kept, prog.plan.why       # the cost model prefers the maps apart here
    cert = pn.certify(model, x[:1])
    assert prog.params.levels == lower(cert.program, kept).depth_levels() > cert.levels
    # the stored program rebuilds the same lowering
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.options["kept_apart"] == kept and loaded.fingerprint == prog.fingerprint
    assert loaded.plan.op_counts() == prog.plan.op_counts()
    client = he.Client(loaded)
    server = he.Server(loaded, client.public_context())
    sample = x[:1]
    out = client.decrypt(server.run(client.encrypt(sample)))
    want = prog.simulate(sample.numpy())
    assert np.max(np.abs(out - want)) <= prog.params.expected_error
    with torch.no_grad():
        np.testing.assert_allclose(want, model(sample).double().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["3", [1.5], [10 ** 6], [-1]])
def test_a_stored_kept_apart_that_is_not_node_indices_is_refused(bad):
    model, x = _model_and_data()
    prog = he.compile(model, x[:1], calibration=x)
    with pytest.raises(ValueError, match="kept_apart|outside the program"):
        CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                        {**prog.options, "kept_apart": bad})
