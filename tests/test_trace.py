"""The polynomial program: tracing, folding, certification, simulation, serialisation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import sympy
import timm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import polynets as pn
from polynets.ir.certify import analyse
from polynets.errors import UnsupportedOpError, check_int
from polynets.ir.program import ArrayInterpreter, Interpreter, Node, PolyProgram
from _models import Square


class Cube(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x ** 3


def _randomise_norms(model: nn.Module, seed: int) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g))
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.randn(n, generator=g))
                m.bias.data.copy_(torch.randn(n, generator=g))
    return model.eval()


def _reference(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    import copy

    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(x.double()).numpy()


def _assert_close(got: np.ndarray, ref: np.ndarray, rtol: float = 1e-9) -> None:
    assert got.shape == ref.shape
    scale = max(np.abs(ref).max(), 1e-12)
    assert np.abs(got - ref).max() <= rtol * scale, np.abs(got - ref).max() / scale


def _models(seed: int, width: int) -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(seed)
    b = 3
    tokens = torch.randn(b, 5, width)
    grid = torch.randn(b, 4, 4, width)
    return [
        ("mulayer", pn.MuLayer(width, width + 1, norm="batch"), torch.randn(b, width)),
        ("mulayer-noshortcut", pn.MuLayer(width, shortcut=False, bias=False), tokens),
        ("mulayer-shift", pn.MuLayer(width, spatial_shift=True, norm="batch"), grid),
        ("polyblock", pn.PolyBlock(width), grid),
        ("monet", pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2,
                           embed_dim=width, depth=2, norm="batch"), torch.randn(b, 1, 8, 8)),
        ("pom", pn.PoM(width, degree=2), tokens),
        ("pom-causal", pn.PoM(width, degree=3, mask="causal"), tokens),
        ("polymorpher", pn.PolymorpherClassifier(seq_len=5, in_features=width, num_classes=3,
                                                 dim=8, depth=1), tokens),
        ("polynode", pn.PolyNODE(3, hidden=width, depth=2, time_input=True),
         torch.randn(b, 4)),
        ("mlp-square", nn.Sequential(nn.Linear(width, 7), nn.BatchNorm1d(7), Square(),
                                     nn.Linear(7, 3)), torch.randn(b, width)),
        ("conv-square", nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1),
                                      nn.BatchNorm2d(3), Cube(), nn.AvgPool2d(2),
                                      nn.Flatten(), nn.Linear(12, 4)),
         torch.randn(b, 2, 8, 8)),
    ]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), width=st.sampled_from([4, 8, 12]))
def test_simulation_equals_model_for_every_shipped_model(seed: int, width: int) -> None:
    for name, model, x in _models(seed, width):
        _randomise_norms(model, seed)
        ref = _reference(model.as_polynomial() if name == "polynode" else model, x)
        raw = pn.trace(model, x, optimize=False)
        opt = pn.optimize(raw)
        _assert_close(raw.simulate(x), ref)
        _assert_close(opt.simulate(x), ref)
        assert len(opt) < len(raw) or name == "pom", name


@pytest.mark.parametrize("name", ["monet_t", "monet_s", "monet_ms_t", "monet_ms_s"])
def test_timm_models_trace_exactly(name: str) -> None:
    # The registered architecture at a small resolution and with two blocks per stage keeps this
    # fast (and the degree-2^depth polynomial inside float64 range); the program is of one kind.
    size = {"monet_t": 28, "monet_s": 32, "monet_ms_t": 32, "monet_ms_s": 32}[name]
    stages = len(timm.create_model(name, num_classes=5, img_size=size).stages)
    model = timm.create_model(name, num_classes=5, in_chans=1, img_size=size,
                              depth=[1] * stages if stages > 1 else 2)
    _randomise_norms(model, 0)
    x = torch.randn(2, 1, size, size)
    program = pn.trace(model, x)
    _assert_close(program.simulate(x), _reference(model, x), rtol=1e-8)


def test_folding_strictly_reduces_ops_on_monet_with_batch_norm() -> None:
    model = _randomise_norms(pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2,
                                      embed_dim=16, depth=2, norm="batch"), 1)
    x = torch.randn(2, 1, 8, 8)
    raw = pn.trace(model, x, optimize=False)
    opt = pn.optimize(raw)
    assert len(opt) < len(raw)
    assert raw.op_counts().get("mul_const", 0) > 0
    assert opt.op_counts().get("mul_const", 0) < raw.op_counts()["mul_const"]
    assert analyse(opt)[opt.output].levels < analyse(raw)[raw.output].levels
    _assert_close(opt.simulate(x), raw.simulate(x))


def test_certify_mulayer_degree_two_and_polyblock_degree_four() -> None:
    mu = pn.certify(pn.MuLayer(6), torch.randn(2, 6))
    assert mu.is_polynomial and mu.degree == 2 and mu.depth == 1
    block = pn.certify(_randomise_norms(pn.PolyBlock(8), 0), torch.randn(2, 4, 4, 8))
    assert block.is_polynomial and block.degree == 4 and block.depth == 2


def _sympy_degree(model: nn.Module) -> int:
    """Total degree of a 2-input model's first output, by sympy expansion of its forward."""
    x, y = sympy.symbols("x y")
    program = pn.trace(model, torch.randn(1, 2))
    expr = sympy.expand(program.run(np.array([[x, y]], dtype=object))[0, 0])
    return sympy.Poly(expr, x, y).total_degree()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_certified_degree_matches_sympy_expansion_of_stacks(depth: int) -> None:
    torch.manual_seed(depth)
    layers: list[nn.Module] = [pn.MuLayer(2, 3)]
    layers += [pn.MuLayer(3, 3) for _ in range(depth - 1)]
    model = nn.Sequential(*layers).eval()
    cert = pn.certify(model, torch.randn(1, 2))
    assert cert.degree == 2 ** depth == _sympy_degree(model)
    assert cert.depth == depth


def test_depth_counts_product_levels_on_longest_path() -> None:
    # x^3 by binary exponentiation: x*x, then (x*x)*x -> two product levels; x^4: two as well.
    cube = pn.certify(Cube(), torch.randn(2, 3))
    assert (cube.degree, cube.depth) == (3, 2)
    quartic = pn.certify(nn.Sequential(Square(), Square()), torch.randn(2, 3))
    assert (quartic.degree, quartic.depth) == (4, 2)
    mixed = pn.certify(nn.Sequential(nn.Linear(3, 3), Square(), nn.Linear(3, 3)),
                       torch.randn(2, 3))
    assert mixed.levels == mixed.depth + mixed.plain_mults == 3


def test_certify_names_every_non_polynomial_module_with_path_and_hint() -> None:
    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU(),
                          nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()), Attention())
    cert = pn.certify(model, torch.randn(2, 3, 4))
    assert not cert.is_polynomial
    found = {(o.path, o.module_type) for o in cert.offending}
    assert {("1", "LayerNorm"), ("2", "GELU"), ("3.1", "Sigmoid"), ("4", "Attention")} <= found
    report = str(cert)
    assert 'norm="batch"' in report and "3.1 (Sigmoid)" in report and "pn.PoM" in report
    with pytest.raises(pn.NonPolynomialError, match="LayerNorm"):
        pn.trace(model, torch.randn(2, 3, 4))


def test_pom_with_gelu_and_sigmoid_is_reported_non_polynomial() -> None:
    cert = pn.certify(pn.PoM(8, activation="gelu", gate="sigmoid"), torch.randn(2, 5, 8))
    assert not cert.is_polynomial
    assert {o.op for o in cert.offending} >= {"aten.gelu", "aten.sigmoid"}


def test_unknown_op_raises_naming_op_and_module() -> None:
    class Weird(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.logcumsumexp(x, dim=-1)

    model = nn.Sequential(nn.Linear(3, 3), Weird())
    with pytest.raises(pn.UnsupportedOpError, match=r"logcumsumexp.*'1' \(Weird\)"):
        pn.trace(model, torch.randn(2, 3))


def test_in_place_slice_assignment_is_refused_with_advice() -> None:
    class InPlaceShift(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.0
            y[:, 1:] = x[:, :-1]
            return y

    with pytest.raises(pn.UnsupportedOpError, match="out of place"):
        pn.trace(InPlaceShift(), torch.randn(2, 4))


def test_bilinear_matmul_of_two_input_dependent_tensors_is_lowered() -> None:
    class Gram(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ x.transpose(-1, -2)

    x = torch.randn(3, 4, 5)
    cert = pn.certify(Gram(), x)
    assert cert.degree == 2
    _assert_close(pn.trace(Gram(), x).simulate(x), _reference(Gram(), x))


def test_program_accepts_any_batch_and_checks_sample_shape() -> None:
    model = pn.MuLayer(4)
    program = pn.trace(model, torch.randn(1, 4))
    assert program.simulate(np.random.randn(7, 4)).shape == (7, 4)
    with pytest.raises(pn.ShapeError, match=r"\('B', 4\)"):
        program.simulate(np.random.randn(7, 5))


def test_program_round_trips_through_bytes_and_files(tmp_path) -> None:
    model = _randomise_norms(pn.PolyBlock(8), 3)
    x = torch.randn(2, 4, 4, 8)
    program = pn.trace(model, x)
    path = tmp_path / "block.npz"
    program.save(path)
    loaded = PolyProgram.load(path)
    _assert_close(loaded.simulate(x), program.simulate(x), rtol=0)
    assert repr(loaded) == repr(program)


@pytest.mark.parametrize("data", [b"", b"not a zip", b"PK\x03\x04garbage"])
def test_garbage_program_bytes_raise_format_error(data: bytes) -> None:
    with pytest.raises(pn.ProgramFormatError):
        PolyProgram.from_bytes(data)


def test_truncated_program_bytes_raise_format_error() -> None:
    data = pn.trace(pn.MuLayer(4), torch.randn(1, 4)).to_bytes()
    with pytest.raises(pn.ProgramFormatError):
        PolyProgram.from_bytes(data[: len(data) // 2])


def test_program_validation_rejects_inconsistent_nodes() -> None:
    with pytest.raises(pn.ProgramFormatError, match="weight must be"):
        PolyProgram([Node("input", (), (1, 3)),
                     Node("linear", (0,), (1, 2), {"axis": 1, "weight": np.ones((4, 2)),
                                                   "bias": None})], 1)
    with pytest.raises(pn.ProgramFormatError, match="does not precede"):
        PolyProgram([Node("input", (), (1, 3)), Node("mul", (0, 2), (1, 3))], 1)


def test_repr_lists_one_op_per_line_with_shapes() -> None:
    program = pn.trace(nn.Sequential(nn.Linear(3, 2), Square()), torch.randn(1, 3))
    lines = repr(program).splitlines()
    assert lines[0].startswith("PolyProgram(3 nodes")
    assert "linear(%0, axis=1, weight(3, 2), bias) : (1, 2)" in lines[2]
    assert lines[3].endswith("-> output")


def test_to_torch_runs_the_program() -> None:
    model = _randomise_norms(pn.MONet(img_size=8, in_chans=1, num_classes=3, patch_size=2,
                                      embed_dim=8, depth=1), 2)
    x = torch.randn(4, 1, 8, 8)
    module = pn.trace(model, x).to_torch()
    _assert_close(module(x.double()).detach().numpy(), _reference(model, x))



def test_to_torch_holds_the_constants_as_buffers_not_parameters() -> None:
    module = pn.trace(pn.MuLayer(3, 2), torch.randn(1, 3)).to_torch()
    assert not list(module.parameters())
    assert {name.split("_")[-1] for name, _ in module.named_buffers()} == {"weight", "bias"}


def test_an_interpreter_names_the_op_it_does_not_handle() -> None:
    class InputOnly(Interpreter):
        def input(self, i: int, node: Node) -> int:
            return 0

    program = pn.trace(nn.Sequential(nn.Linear(3, 2), Square()), torch.randn(1, 3))
    with pytest.raises(UnsupportedOpError, match="InputOnly does not handle the program op "
                                                 "'linear' .*it handles input"):
        InputOnly().run(program)


def test_the_numpy_and_torch_back_ends_release_values_no_later_node_reads() -> None:
    program = pn.trace(nn.Sequential(nn.Linear(3, 4), Square(), nn.Linear(4, 2)),
                       torch.randn(1, 3))
    x = np.random.default_rng(0).normal(size=(5, 1, 3))
    kept = ArrayInterpreter(x).run(program)
    released = ArrayInterpreter(x).run(program, release=True)
    assert all(v is not None for v in kept)
    assert released[program.input_id] is None and released[program.output] is not None
    np.testing.assert_array_equal(released[program.output], kept[program.output])


def test_check_int_names_the_argument_and_what_it_must_be() -> None:
    assert check_int(3, "dim") == 3
    assert check_int(0, "merges", minimum=0) == 0
    with pytest.raises(pn.ConfigError, match="dim must be a positive int, got True"):
        check_int(True, "dim")
    with pytest.raises(pn.ConfigError, match="merges must be a non-negative int, got -1"):
        check_int(-1, "merges", minimum=0)
    with pytest.raises(pn.ShapeError, match="k must be an int >= 2, got 1.0"):
        check_int(1.0, "k", minimum=2, error=pn.ShapeError)

def test_bad_example_input_is_rejected() -> None:
    with pytest.raises(pn.ShapeError, match="batch"):
        pn.trace(pn.MuLayer(3), torch.randn(0, 3))
    with pytest.raises(pn.ShapeError, match="NaN"):
        pn.trace(pn.MuLayer(3), torch.full((1, 3), float("nan")))
    with pytest.raises(pn.TraceError, match="nn.Module"):
        pn.trace(lambda x: x, torch.randn(1, 3))  # type: ignore[arg-type]


def test_constant_masks_are_selections_and_data_dependent_masks_are_refused() -> None:
    mask = torch.tensor([True, False, True, False])

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.where(mask, x * x, 2.5) + x.masked_fill(~mask, -1.0)
            return torch.where(mask, y, x)

    x = torch.randn(3, 4)
    program = pn.trace(Masked(), x)
    _assert_close(program.simulate(x), _reference(Masked(), x))
    assert pn.certify(Masked(), x).degree == 2

    class DataMask(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x > 0, x, 0.0)

    cert = pn.certify(DataMask(), x)
    assert not cert.is_polynomial
    assert any(o.op == "aten.gt" for o in cert.offending)


def test_a_map_read_only_by_maps_is_fused_into_each_and_saves_its_level():
    """Mu-Layers stacked without a residual: each layer's C is read by the next layer's A and D;
    fused into both, C costs no level of its own (2 per Mu-Layer plus the first map)."""
    torch.manual_seed(0)
    model = nn.Sequential(pn.MuLayer(8, hidden=16, norm="batch"),
                          pn.MuLayer(8, hidden=16, norm="batch"),
                          pn.MuLayer(8, hidden=16, norm="batch")).train()
    x = torch.randn(32, 5, 8)
    with torch.no_grad():
        model(x)
    model.eval()
    cert = pn.certify(model, x[:1])
    assert cert.depth == 3 and cert.levels == 2 * 3 + 1
    program = pn.trace(model, x[:1])
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.allclose(program.simulate(x.numpy().astype(np.float64)), ref, atol=1e-5)


def test_wide_maps_over_a_large_patch_embedding_compose_with_it():
    """7x7 patches embedded in 64 channels, read by maps to 128: each output's bound on the
    pixels it reads (64 channels x 49 pixels) is far above the local limit, but all channels read
    the same 49 pixels, so the maps compose with the embedding and read the input directly."""
    torch.manual_seed(0)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = pn.PatchEmbed(28, 7, 1, 64)
            self.pos = nn.Parameter(0.1 * torch.randn(1, 4, 4, 64))
            self.mu = pn.MuLayer(64, hidden=128)
            self.head = nn.Linear(64, 3)

        def forward(self, x):
            t = self.embed(x) + self.pos
            return self.head((t + self.mu(t)).mean((1, 2)))

    model = Tokens().eval()
    x = torch.randn(4, 1, 28, 28)
    cert = pn.certify(model, x[:1])
    assert cert.depth == 1 and cert.levels == 3
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.allclose(pn.trace(model, x[:1]).simulate(x.numpy().astype(np.float64)), ref,
                       atol=1e-5)


def test_a_model_in_training_mode_is_traced_in_eval_mode_with_a_warning_at_the_callers_line():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"training mode.*'1' \(BatchNorm1d\), '2' \(Dropout\)"
                      ) as caught:
        program = pn.trace(model, x[:1])
    assert caught[0].filename == __file__
    with torch.no_grad():
        np.testing.assert_allclose(program(x.numpy()), model.eval().double()(x.double()).numpy(),
                                   atol=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pn.trace(model, x[:1])                    # in eval mode: nothing to warn of
