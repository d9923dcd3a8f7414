"""The CKKS compiler's choices: one level rule for certify and the compiler, layouts chosen by
the cost model, several samples per ciphertext, automatic packing -- each checked against real
SEAL ciphertexts where it changes what runs."""

from __future__ import annotations

import json
import warnings

import numpy as np
import scipy.sparse as sp
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import he
import polynets as pn
from he.costmodel import CostModel, default_model, measure
from he.plan import (_bsgs, _rotations_of, build_vector_plan, candidate_orders, dense,
                     layout_groups, layout_shapes, make_matvec,
                     search_layouts, shared_splits, slot_map)
from polynets.ir.lowering import client_map, client_variants, integer_factor, lower
from _models import Square


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class TokenMLP(nn.Module):
    """Per-token channel maps (one map repeated over tokens) between squares, a token-mixing
    head. The first square keeps the channel map from reading the input directly (which the
    client's input planes would make free in any layout)."""

    def __init__(self, tokens: int, dim: int, hidden: int, classes: int = 3) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(tokens * dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x * x
        h = self.up(s)
        return self.head((s + self.down(h * h)).flatten(1))


def _roundtrip(prog: he.CompiledProgram, x: np.ndarray) -> np.ndarray:
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    return client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())


def _bn_eval(model: nn.Module, x: torch.Tensor) -> nn.Module:
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval()


# ----------------------------------------------------------------------------- levels
def test_integer_factor_is_the_level_free_rule():
    assert integer_factor(np.array(2.0)) == 2
    assert integer_factor(np.full((3, 1), -3.0)) == -3
    assert integer_factor(np.array(2.0 ** 21)) is None      # too large to multiply exactly
    assert integer_factor(np.array([1.0, 2.0])) is None     # not one repeated integer
    assert integer_factor(np.array(0.5)) is None


@pytest.mark.parametrize("factor,levels", [(2.0, 1), (-1.0, 1), (0.5, 2), (2.0 ** 21, 2)])
def test_constant_scaling_levels_agree_between_certify_and_both_packings(factor, levels):
    model = nn.Sequential(Square(), Scale(factor)).eval()
    x = torch.rand(4, 3) * 0.9
    cert = pn.certify(model, x)
    assert cert.levels == levels
    # a scaling that costs a level is a last map the client can apply instead
    assert cert.client_levels == (levels - 1 if levels == 2 else None)
    for packing, final_map in (("vector", "server"), ("vector", "client"), ("batch", "server"),
                               ("batch", "client")):
        prog = he.compile(model, x, packing=packing, final_map=final_map)
        client = prog.options.get("client_map", False)
        assert client == (final_map == "client" and levels == 2)
        assert prog.params.levels == (cert.client_levels if client else levels)
        y = _roundtrip(prog, x.numpy())
        assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error


@st.composite
def _layer_stacks(draw):
    layers: list[nn.Module] = []
    width = draw(st.integers(2, 5))
    first = width
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["linear", "square", "int", "frac"]))
        if kind == "linear":
            out = draw(st.integers(2, 5))
            layers.append(nn.Linear(width, out))
            width = out
        elif kind == "square":
            layers.append(Square())
        else:
            layers.append(Scale(3.0 if kind == "int" else 0.25))
    return nn.Sequential(*layers).eval(), first


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(_layer_stacks(), st.integers(0, 2 ** 16))
def test_certify_levels_equal_the_compilers_on_random_programs(stack, seed):
    model, width = stack
    torch.manual_seed(seed)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5)
    x = torch.rand(3, width) * 0.5
    cert = pn.certify(model, x)
    lowered = lower(cert.program)
    assert cert.levels == lowered.depth_levels("vector")
    try:
        prog = he.compile(model, x, packing="vector")
    except he.TooDeepError:
        return
    # maps the cost model kept apart (a level more each, said in plan.why) are counted on the
    # lowering that keeps them so; certify counts the fewest levels
    kept = prog.options.get("kept_apart", [])
    # the last map, the first maps applied by the client: a level less each where they cost one
    key = (prog.options.get("client_map", False), prog.options.get("client_first", False))
    low = client_variants(lower(cert.program, kept))[key][0]
    certified = {(False, False): cert.levels, (True, False): cert.client_levels,
                 (False, True): cert.first_levels, (True, True): cert.first_client_levels}[key]
    assert certified is not None
    assert prog.params.levels == low.depth_levels("vector")
    assert prog.plan.levels == prog.params.levels >= certified
    if not kept:
        assert prog.params.levels == certified
    batch = he.compile(model, x, packing="batch")
    kept = batch.options.get("kept_apart", [])
    low = lower(cert.program, kept)
    client = batch.options.get("client_map", False)
    if client:
        low = client_map(low, "batch")
        assert low is not None
    assert batch.params.levels == low.depth_levels("batch")
    if not kept:
        assert batch.params.levels <= (cert.client_levels if client else cert.levels)


def test_certify_counts_exactly_through_large_linear_intermediates():
    """A depthwise 11x11 token mixing gathers 121 patches per token (a value of ~570k elements,
    larger than any packing holds) but composes into the maps around it: ``pn.certify`` counts
    the compiler's levels, not the per-node upper bound."""
    from polynets.ir.certify import levels_exact

    torch.manual_seed(0)
    model = nn.Sequential(pn.PatchEmbed(28, 4, 1, 32), pn.PADRe(32, degree=3), nn.Flatten(),
                          nn.Linear(49 * 32, 10)).eval()
    x = torch.rand(1, 1, 28, 28)
    cert = pn.certify(model, x)
    assert max(n.numel for n in cert.program.nodes) > 2 ** 16
    assert levels_exact(cert.program) and cert.levels_exact
    assert cert.levels == lower(cert.program).depth_levels("vector") == 6
    assert "upper bound" not in str(cert)


def test_certify_gives_an_upper_bound_where_a_product_is_too_large_to_pack():
    from polynets.ir.certify import levels_exact

    class Wide(nn.Module):
        def forward(self, x):
            return (x * x).sum(-1, keepdim=True)

    x = torch.rand(1, 2 ** 16 + 1)
    cert = pn.certify(Wide(), x)
    assert not levels_exact(cert.program) and not cert.levels_exact
    assert "upper bound" in str(cert)


# ----------------------------------------------------------------------------- layouts
def test_slot_maps_are_injective_and_pad_inner_axes_to_powers_of_two():
    shape = (1, 7, 5, 3)
    for order in candidate_orders(shape):
        m = slot_map(shape, order)
        assert np.unique(m).size == m.size
    m = slot_map(shape, (3, 1, 2))      # channels outermost: stride 8 * 8 = 64
    idx = np.arange(105).reshape(shape)
    assert m[idx[0, 0, 0, 1]] == 64 and m[idx[0, 1, 0, 0]] == 8 and m[idx[0, 0, 1, 0]] == 1


def test_dense_layouts_pad_nothing_and_are_candidates_where_padding_widens():
    shape = (1, 7, 5, 3)
    m = slot_map(shape, dense((3, 1, 2)))   # channels outermost, unpadded: stride 7 * 5 = 35
    idx = np.arange(105).reshape(shape)
    assert np.unique(m).size == m.size and m.max() == 104
    assert m[idx[0, 0, 0, 1]] == 35 and m[idx[0, 1, 0, 0]] == 5 and m[idx[0, 0, 1, 0]] == 1
    assert dense((3, 1, 2)) in candidate_orders(shape)
    # nothing to gain where the inner axes are powers of two already
    assert candidate_orders((1, 8, 4, 2)) == [o for o in candidate_orders((1, 8, 4, 2))
                                             if o is None or o[0] >= 0]


def _apply_matvec(mv, x: np.ndarray, slots: int) -> np.ndarray:
    """What the server computes for a MatVec, on a plaintext slot vector (rotations to the
    left, diagonals tiled to the slots)."""
    y = np.zeros(slots)
    for giant, group in zip(mv.giants, mv.groups):
        inner = sum(np.tile(diag, slots // diag.size) * np.roll(x, -b) for b, diag in group.items())
        y += np.roll(inner, -giant)
    for f in mv.folds:
        y = y + np.roll(y, -f)
    return y


@pytest.mark.parametrize("shifts", [(0,), (0, 1, -1, 7, -7)])
def test_a_channel_map_over_an_unpadded_token_grid_takes_few_rotations_and_is_exact(shifts):
    """48 -> 144 channels over 49 tokens laid out channel-major unpadded (stride 49, which does
    not divide the period): the diagonals are multiples of 49 modulo 4096, wrapped; in units of
    49 a baby/giant split needs about 2 sqrt(#diagonals) rotations, not one per diagonal."""
    rng = np.random.default_rng(0)
    cin, cout, tokens, p_in, p_out = 48, 144, 49, 4096, 8192
    rows, cols, vals = [], [], []
    for s in shifts:
        w = rng.standard_normal((cout, cin))
        t = np.arange(tokens)
        t = t[(t + s >= 0) & (t + s < tokens)]
        for co in range(cout):
            for ci in range(cin):
                rows += list(co * tokens + t)
                cols += list(ci * tokens + t + s)
                vals += [w[co, ci]] * t.size
    a = sp.coo_matrix((vals, (rows, cols)), shape=(cout * tokens, cin * tokens)).tocsr()
    mv = make_matvec(a, p_in, p_out)
    n_diag = mv.n_diagonals
    rotations = len(mv.rotations())
    # one stride: about 2 sqrt(#diagonals); five token shifts on top of it spread the units
    # over five arcs, still a small multiple of sqrt(#diagonals)
    bound = 2 * np.sqrt(n_diag) + 8 if len(shifts) == 1 else 4 * np.sqrt(n_diag)
    assert rotations <= bound, (rotations, n_diag)
    x = rng.standard_normal(cin * tokens)
    slot_x = np.tile(np.pad(x, (0, p_in - x.size)), p_out // p_in)
    y = _apply_matvec(mv, slot_x, p_out)
    assert np.allclose(y[:cout * tokens], a @ x, atol=1e-9)


def test_cost_model_picks_the_cheaper_layout_for_a_per_token_channel_map():
    """A map 8 -> 24 channels on each of 16 tokens: token-major (row-major) slots give it one
    diagonal per (token, offset) pair; channel-major slots one per channel offset."""
    torch.manual_seed(0)
    model = TokenMLP(tokens=16, dim=8, hidden=24).eval()
    x = torch.rand(2, 16, 8)
    program = pn.trace(model, x[:1])
    lowered = lower(program)
    costs = default_model()

    def price(counts, level):
        return costs.price({k: v for k, v in counts.items() if k != "plaintexts"}, 8192,
                           4 - level)

    orders, chosen = search_layouts(lowered, 4096, price)
    dense = build_vector_plan(lowered, 4096, None)
    plan = build_vector_plan(lowered, 4096, orders)
    assert any(o is not None for o in orders)
    assert plan.cost()["rotations"] < dense.cost()["rotations"]
    assert plan.cost()["plain_mults"] < dense.cost()["plain_mults"] / 2
    wide = [i for i, s in enumerate(lowered.steps) if s.shape[-1] == 24]
    assert wide and all(orders[i][0] == 2 for i in wide)      # channel axis outermost
    groups = layout_groups(lowered)
    for i, g in enumerate(groups):
        assert orders[i] == orders[g]


def _plan_rotations(terms, splits):
    babies, giants = {}, 0
    union = {}
    for si, j, lvl, p_in, d in terms:
        babies.setdefault((j, lvl), set()).update(_rotations_of(splits[si, p_in], d, p_in)[0])
        union.setdefault((si, p_in), []).append(d)
    for v, ds in union.items():
        giants += len(_rotations_of(splits[v], np.unique(np.concatenate(ds)), v[1])[1])
    return giants + sum(len(b) for b in babies.values())


def test_maps_of_one_input_share_baby_steps_and_take_fewer_giants():
    """A shifted channel map (32 channel offsets x 5 token shifts, as a Poly-Block's first
    Mu-Layer has) read by two steps: alone each picks 8+16 rotations; sharing the baby steps,
    more babies and fewer giants cost fewer rotations in all."""
    chans = np.arange(32) * 64
    keys = np.unique((chans[:, None] + np.array([0, 1, 8, -8, -1])[None]).ravel() % 2048)
    terms = [(1, 0, 2, 2048, keys), (2, 0, 2, 2048, keys)]
    alone = {(1, 2048): _bsgs(keys, 2048), (2, 2048): _bsgs(keys, 2048)}
    shared = shared_splits(terms)
    assert shared[1, 2048] == shared[2, 2048]
    assert _plan_rotations(terms, shared) < _plan_rotations(terms, alone)
    # a map that shares nothing keeps its own best split
    assert shared_splits([(3, 1, 0, 2048, keys)]) == {(3, 2048): _bsgs(keys, 2048)}


class SharedHead(nn.Module):
    """One head read by three values of different degrees (a residual stack's read-out)."""

    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x * x
        u = self.mix(s) * s
        return self.head(s) + self.head(u) + self.head(x * u)


def test_one_map_on_several_inputs_runs_once_on_their_sum():
    torch.manual_seed(3)
    model = SharedHead().eval()
    x = torch.rand(4, 8) * 2 - 1
    # the head on the server (the client could apply it: every term is then a value it reads)
    prog = he.compile(model, x, calibration=x, packing="vector", final_map="server")
    summed = [s for s in prog.plan.steps if any(len(g) > 1 for g in s.sums)]
    assert summed, "the head's terms were not merged"
    last = prog.plan.steps[prog.plan.output]
    assert sum(mv is not None for mv in last.matvecs) < len(last.inputs)
    y = _roundtrip(prog, x.numpy())
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4


class GridTokens(nn.Module):
    """Patch embedding + BatchNorm, residual Mu-Layers, a linear head (the benchmark's token
    model in small): the residual stream is a (tokens, channels) value, the Mu-Layers' a
    (h, w, channels) grid."""

    def __init__(self, depth: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.embed = pn.PatchEmbed(8, 2, 1, dim)
        self.norm = pn.layers.ChannelsLastBatchNorm(dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch") for _ in range(depth))
        self.head = nn.Linear(16 * dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(self.embed(x))
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


@pytest.mark.parametrize("bits", [8, 16])
def test_the_plan_prices_every_lift_the_server_takes(monkeypatch, bits):
    """Values brought up to a higher level (an affine step's inputs of different levels, the
    residual stream joining the Mu-Layer's output, a product's lower input) cost a product
    with an encoded 1, and a rescale where the level lies on another chain: ``plan.lifts()``
    lists exactly the lifts the server takes, and the prediction counts them."""
    from collections import Counter

    from he import backend
    torch.manual_seed(0)
    x = torch.rand(8, 1, 8, 8)
    net = _bn_eval(GridTokens(), x)
    prog = he.compile(net, x, calibration=x, packing="vector", precision_bits=bits)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    request = client.encrypt(x[:1].numpy()).to_bytes()
    taken = []
    lift = backend.Engine.lift

    def recording(self, ct, level, out=None):
        if self.level(ct) != level:
            taken.append((self.level(ct), level))
        return lift(self, ct, level, out)

    monkeypatch.setattr(backend.Engine, "lift", recording)
    reply = server.run(request).to_bytes()
    monkeypatch.undo()
    planned = [move for moves in prog.plan.lifts() for move in moves]
    assert taken and Counter(taken) == Counter(planned)
    assert prog.plan.predicted["counts"]["lift"] == len(taken)
    params = prog.params
    for a, b in planned:
        ops = params.lift_primitives(a, b)
        assert [op for op, _ in ops] == (["mul_plain", "rescale"] if params.lift_rescales(a, b)
                                         else ["mul_plain"])
        assert all(1 <= limbs <= params.limbs(a) for _, limbs in ops)
    assert params.lift_primitives(2, 2) == [] and params.lift_primitives(3, 1) == []
    y = client.decrypt(reply)
    assert np.max(np.abs(y - prog.simulate(x[:1]))) <= prog.params.expected_error


def test_token_grid_and_its_flat_tokens_share_one_layout():
    """The flat (16, 8) tokens and the (4, 4, 8) grid are one row-major order: the flat value
    is laid out by the grid's shape, so one channel-major layout serves both and the maps that
    read both keep one diagonal per channel offset."""
    from he.plan import layout_shapes
    torch.manual_seed(0)
    x = torch.rand(8, 1, 8, 8)
    net = _bn_eval(GridTokens(), x)
    program = pn.trace(net, x[:1])
    composed = lower(program)
    # the flat tokens are read by several maps: vector packing keeps them as a step of their
    # own, composing them into the maps saves no level here
    assert composed.shared and composed.depth_levels() == lower(program, composed.shared
                                                                ).depth_levels()
    low = lower(program, composed.shared)
    shapes = layout_shapes(low)
    flat = [i for i, st in enumerate(low.steps) if tuple(st.shape) == (1, 16, 8)]
    assert flat and all(shapes[i] == (1, 4, 4, 8) for i in flat)
    prog = he.compile(net, x, calibration=x, packing="vector")
    y = _roundtrip(prog, x[:2].numpy())
    assert np.max(np.abs(y - prog.simulate(x[:2]))) <= prog.params.expected_error


@pytest.mark.parametrize("packing", ["vector", "batch"])
def test_token_model_in_chosen_layouts_decrypts_to_model_output(packing):
    torch.manual_seed(1)
    model = TokenMLP(tokens=16, dim=8, hidden=24).eval()
    x = torch.rand(5, 16, 8) * 2 - 1
    prog = he.compile(model, x, calibration=x, packing=packing)
    if packing == "vector":
        assert any(o is not None for o in prog.plan.orders)
    y = _roundtrip(prog, x.numpy())
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.sampled_from([4, 8]), st.sampled_from([4, 12]),
       st.sampled_from([None, 1, 2]), st.integers(0, 1000))
def test_random_mulayer_token_models_agree_in_every_layout(side, dim, hidden, interleave, seed):
    """decrypt(server(encrypt(x))) == simulate(x) == model(x) for Mu-Layers on a token grid,
    whatever layout the search picks and however many samples share a ciphertext."""
    torch.manual_seed(seed)
    model = nn.Sequential(pn.MuLayer(dim, hidden=hidden, norm="batch", spatial_shift=True),
                          nn.Flatten(1), nn.Linear(side * side * dim, 2))
    x = torch.rand(6, side, side, dim) * 2 - 1
    model = _bn_eval(model, x)
    prog = he.compile(model, x, calibration=x, packing="vector",
                      samples_per_ciphertext=interleave)
    if interleave is not None:
        assert prog.plan.interleave == interleave
    y = _roundtrip(prog, x[:3].numpy())
    with torch.no_grad():
        ref = model(x[:3]).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x[:3]))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4


def test_a_mulayer_in_dense_layouts_decrypts_to_the_model_output():
    """Every value that has an unpadded layout laid out in it (a 7 x 7 grid: stride 49 tokens),
    the plan rebuilt from those stored layouts: decrypt == simulate == model."""
    torch.manual_seed(3)
    side, dim = 7, 6
    model = nn.Sequential(pn.MuLayer(dim, hidden=18, norm="batch", spatial_shift=True),
                          nn.Flatten(1), nn.Linear(side * side * dim, 2))
    x = torch.rand(6, side, side, dim) * 2 - 1
    model = _bn_eval(model, x)
    prog = he.compile(model, x, calibration=x, packing="vector", samples_per_ciphertext=1)
    shapes = layout_shapes(prog.lowered)
    layouts = []
    for sh in shapes:
        dense_orders = [o for o in candidate_orders(sh) if o is not None and o[0] < 0]
        layouts.append(list(dense_orders[0]) if dense_orders else None)
    assert sum(o is not None for o in layouts) >= 3
    opts = {**prog.options, "layouts": layouts, "stacked": [], "planes_per_ct": None}
    forced = he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration, opts)
    assert [None if o is None else list(o) for o in forced.plan.orders] == layouts
    y = _roundtrip(forced, x[:3].numpy())
    with torch.no_grad():
        ref = model(x[:3]).double().numpy()
    assert np.max(np.abs(y - forced.simulate(x[:3]))) <= forced.params.expected_error
    assert np.max(np.abs(y - ref)) <= forced.params.expected_error + 1e-4


def test_interleaved_samples_fill_partial_and_several_groups():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
    x = torch.rand(11, 6) * 2 - 1
    prog = he.compile(model, x, packing="vector", samples_per_ciphertext=4)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x)
    assert len(ct._groups) == 3          # 4 + 4 + 3 samples
    y = client.decrypt(server.run(ct))
    assert y.shape == (11, 3)
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error


def test_samples_per_ciphertext_must_be_a_power_of_two():
    model = nn.Sequential(nn.Linear(3, 2), Square()).eval()
    with pytest.raises(he.NotEncryptableError, match="power of two"):
        he.compile(model, torch.rand(2, 3), samples_per_ciphertext=3)


def test_plan_survives_a_file_round_trip(tmp_path):
    torch.manual_seed(3)
    model = TokenMLP(tokens=16, dim=8, hidden=24).eval()
    x = torch.rand(4, 16, 8)
    prog = he.compile(model, x, packing="vector")
    prog.save(tmp_path / "m.he")
    loaded = he.load_program(tmp_path / "m.he")
    assert loaded.fingerprint == prog.fingerprint
    assert loaded.plan.orders == prog.plan.orders
    assert loaded.plan.interleave == prog.plan.interleave
    assert loaded.plan.rotations() == prog.plan.rotations()
    assert loaded.plan.predicted == prog.plan.predicted


# ----------------------------------------------------------------------------- auto packing
def test_auto_packing_follows_the_objective_and_says_why():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
    x = torch.rand(8, 6)
    fast = he.compile(model, x, packing="auto", objective="latency")
    many = he.compile(model, x, packing="auto", objective="throughput")
    assert fast.packing == "vector" and many.packing == "batch"
    for prog in (fast, many):
        assert "packing='auto'" in prog.plan.why and "vector" in prog.plan.why \
            and "batch" in prog.plan.why
        assert prog.plan.predicted["seconds_per_ciphertext"] > 0
    assert many.plan.predicted["seconds_per_sample"] <= fast.plan.predicted["seconds_per_sample"]
    assert "predicted" in str(fast)
    with pytest.raises(he.NotEncryptableError, match="objective"):
        he.compile(model, x, objective="speed")


# ----------------------------------------------------------------------------- cost model
def test_cost_model_round_trips_and_interpolates():
    model = default_model()
    assert set(model.table) >= {8192, 16384, 32768}
    again = CostModel.from_dict(model.to_dict())
    for op in ("rotate", "mul_plain", "mul_ct", "rescale", "add", "encode"):
        assert again.seconds(op, 16384, 3) == pytest.approx(model.seconds(op, 16384, 3))
        assert model.seconds(op, 16384, 2) > 0
    assert model.seconds("rotate", 32768, 10) > model.seconds("rotate", 8192, 3)
    with pytest.raises(ValueError, match="unknown primitive"):
        model.seconds("bootstrap", 8192, 2)
    with pytest.raises(ValueError, match="lacks"):
        CostModel.from_dict({"table": {"8192": {"rotate": [[1, 0.001]]}}})


@pytest.mark.parametrize("bad", [[], {"table": 3}, {"table": {"8192": [1, 2]}}, {"x": 1}])
def test_a_file_that_is_not_a_cost_table_is_a_value_error(bad):
    with pytest.raises((ValueError, KeyError), match="cost table|table"):
        CostModel.from_dict(bad)


def test_measured_costs_grow_with_the_limbs():
    model = measure(rings=(8192,))
    rot = dict(model.table[8192]["rotate"])
    assert min(rot) == 1 and max(rot) >= 2
    assert model.seconds("rotate", 8192, max(rot)) > model.seconds("add", 8192, max(rot))
    # a row spilled to disk and read back is timed, not derived
    assert dict(model.table[8192]["spill"])[max(rot)] > 0


def test_a_scaled_cost_model_prices_every_primitive_alike_and_chooses_the_same_plan():
    model = default_model()
    slow = model.scaled(2.0, "twice as slow")
    assert "twice as slow" in slow.source and slow.speed == pytest.approx(2 * model.speed)
    for op in ("rotate", "mul_plain", "rescale", "fused_mac", "fused_out"):
        assert slow.seconds(op, 16384, 4) == pytest.approx(2 * model.seconds(op, 16384, 4))
    assert slow.seconds("rotate", 65536, 4) == pytest.approx(2 * model.seconds("rotate", 65536, 4))
    assert CostModel.from_dict(slow.to_dict()).speed == pytest.approx(slow.speed)
    torch.manual_seed(4)
    net = TokenMLP(tokens=16, dim=8, hidden=24).eval()
    x = torch.rand(8, 16, 8) * 2 - 1
    for packing in ("vector", "batch", "auto"):
        a = he.compile(net, x[:1], calibration=x, packing=packing, cost_model=model)
        b = he.compile(net, x[:1], calibration=x, packing=packing, cost_model=slow)
        assert str(a.params) == str(b.params)
        assert b.plan.predicted["seconds_per_ciphertext"] == pytest.approx(
            2 * a.plan.predicted["seconds_per_ciphertext"])
        assert a.plan.predicted["counts"] == b.plan.predicted["counts"]
        chosen = {k: v for k, v in a.options.items() if k not in ("predicted", "why")}
        assert chosen == {k: v for k, v in b.options.items() if k not in ("predicted", "why")}
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            model.scaled(bad, "")
    with pytest.raises(ValueError, match="speed factor"):
        CostModel.from_dict({**model.to_dict(), "speed": -2})


def test_a_measured_table_prices_the_word_loops_at_this_machine_s_own_speed():
    """SEAL's primitives and the fused maps' word loops need not differ by one factor between
    machines: a table measured here carries the words' own factor, saved and read back, on top
    of the primitives' (a table scaled by the probe keeps it)."""
    from he import costmodel

    shipped = costmodel.shipped_model()
    assert shipped.word_speed > 0
    d = shipped.to_dict()
    d["word_speed"] = 2.0 * shipped.word_speed
    slow = CostModel.from_dict(d)
    assert CostModel.from_dict(slow.to_dict()).word_speed == slow.word_speed
    for op in costmodel.WORD_PRIMITIVES:
        assert slow.seconds(op, 8192, 3) == pytest.approx(2 * shipped.seconds(op, 8192, 3))
    # the primitives keep their own prices; the probe's factor scales both
    assert slow.seconds("rotate", 8192, 3) == shipped.seconds("rotate", 8192, 3)
    both = slow.scaled(3.0, "")
    assert both.word_speed == slow.word_speed
    assert both.seconds("fused_mac", 8192, 3) == pytest.approx(6 * shipped.seconds("fused_mac",
                                                                                   8192, 3))
    for bad in (0, -1, "fast", float("inf")):
        with pytest.raises(ValueError, match="word speed"):
            CostModel.from_dict({**d, "word_speed": bad})
    # read on real fused maps and ciphertexts, as measure() does
    got = costmodel._word_speed(shapes=((48, 8),), reps=1)
    assert np.isfinite(got) and got > 0


def test_rescales_are_priced_on_two_polynomials_whatever_the_table_timed():
    """Servers rescale ciphertexts of two polynomials, as the shipped table timed them; a table
    that does not say what it timed (older ones) timed three, and is read with its rescales
    scaled by 2/3."""
    from he import costmodel

    d = json.loads(costmodel._SHIPPED.read_text())
    assert d["rescale_polys"] == 2
    del d["rescale_polys"]
    old = CostModel.from_dict(d)
    said = CostModel.from_dict({**d, "rescale_polys": 2})
    for ring in (8192, 16384):
        assert old.seconds("rescale", ring, 3) == pytest.approx(
            2 / 3 * said.seconds("rescale", ring, 3))
        assert old.seconds("rotate", ring, 3) == said.seconds("rotate", ring, 3)
    # written out it says two, and reads back unchanged (no second scaling)
    again = CostModel.from_dict(old.to_dict())
    assert again.to_dict()["rescale_polys"] == 2
    assert again.seconds("rescale", 8192, 3) == old.seconds("rescale", 8192, 3)
    with pytest.raises(ValueError, match="polynomials"):
        CostModel.from_dict({**d, "rescale_polys": 4})


def _older_table(model: CostModel) -> CostModel:
    """``model`` as a table saved before tables kept their probe's seconds, and before they
    timed spills and the two parts of a ciphertext product (priced from others' timings)."""
    d = model.to_dict()
    del d["probe_seconds"]
    for ops in d["table"].values():
        for op in ("spill", "relin", "mul_lazy"):
            ops.pop(op, None)
    return CostModel.from_dict(d)


def test_the_probe_reads_each_primitive_s_median_round_against_the_table():
    """The table keeps the probe's own seconds on the machine it was measured on (each the
    median round, as a probe now reads them): the factor compares like with like. The median
    round, not the least (the best of every round's loops together), which read a shared
    machine fast."""
    from he import costmodel

    shipped = costmodel.shipped_model()
    ops = ("rotate", "mul_plain", "add")
    assert set(shipped.probe) >= set(ops)
    for table, base in ((shipped, shipped.probe),
                        (_older_table(shipped), {op: shipped.seconds(op, costmodel.PROBE_RING,
                                                                     costmodel.PROBE_LIMBS)
                                                 for op in ops})):
        # rounds at 1x, 2x and 3x the reference, one primitive's rounds out of order
        rounds = [{op: base[op] * k for op in ops} for k in (2.0, 1.0, 3.0)]
        factor, ratios = costmodel.speed_factor(table, rounds)
        assert ratios == pytest.approx({op: 2.0 for op in ops}) and factor == pytest.approx(2.0)
        least, _ = costmodel.speed_factor(table, rounds, min)
        assert least == pytest.approx(1.0)
        # per primitive, then the geometric mean over primitives
        mixed = [{"rotate": base["rotate"] * 4, "add": base["add"]}] * 3
        assert costmodel.speed_factor(table, mixed)[0] == pytest.approx(2.0)
        # a table already carrying a factor is compared without it
        assert costmodel.speed_factor(table.scaled(5.0, ""), rounds)[0] == pytest.approx(2.0)
        assert costmodel.speed_factor(table, []) == (1.0, {})
    # an older table derives some primitives from others' timings: those are not compared
    older = _older_table(shipped)
    rounds = [{"spill": 1.0, "rotate": shipped.seconds("rotate", 8192, 3) * 2}] * 3
    assert set(costmodel.speed_factor(older, rounds)[1]) == {"rotate"}
    assert costmodel.PROBE_ROUNDS % 2 == 1         # a median that is one of the rounds
    got = costmodel.probe_rounds(shipped, 2)
    assert len(got) == 2 and set(got[0]) >= set(ops) and all(t > 0 for t in got[0].values())
    assert set(got[0]) >= set(shipped.probe)


def test_a_table_keeps_its_probe_seconds_and_refuses_bad_ones():
    from he import costmodel

    shipped = costmodel.shipped_model()
    again = CostModel.from_dict(shipped.to_dict())
    assert again.probe == shipped.probe and again.probe
    for bad in (-1.0, 0.0, "fast", float("inf")):
        d = shipped.to_dict()
        d["probe_seconds"] = {**d["probe_seconds"], "rotate": bad}
        with pytest.raises(ValueError, match="probe seconds"):
            CostModel.from_dict(d)


def test_the_shipped_table_is_scaled_to_this_machine_by_a_probe(monkeypatch):
    from he import costmodel

    shipped = costmodel.shipped_model()
    factor, ratios = costmodel.probe_speed(shipped)
    assert set(ratios) >= {"rotate", "mul_plain", "mul_ct", "rescale", "add"}
    assert all(r > 0 for r in ratios.values())
    assert min(ratios.values()) <= factor <= max(ratios.values())
    # an older table: the primitives it derives from another's timing are not compared (a
    # spill priced at half a load read 0.56x against 1.31-1.63x for every measured one)
    older = _older_table(shipped)
    assert older.derived[costmodel.PROBE_RING] >= {"spill", "relin", "mul_lazy"}
    _, old_ratios = costmodel.probe_speed(older)
    assert old_ratios and not set(old_ratios) & older.derived[costmodel.PROBE_RING]
    assert CostModel.from_dict(older.to_dict()).derived == older.derived
    assert older.scaled(2.0, "").derived == older.derived
    # no cached table: the shipped one, scaled by the probe or by the environment's factor
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-polynets-cache")
    monkeypatch.setattr(costmodel, "_CACHE", {})
    probed = costmodel.default_model()
    assert "to this machine by a probe" in probed.source and probed.speed > 0
    monkeypatch.setattr(costmodel, "_CACHE", {})
    monkeypatch.setenv(costmodel.SPEED_ENV, "1")
    assert costmodel.default_model().speed == 1.0
    assert costmodel.default_model().seconds("rotate", 8192, 3) == shipped.seconds("rotate",
                                                                                   8192, 3)
    monkeypatch.setattr(costmodel, "_CACHE", {})
    monkeypatch.setenv(costmodel.SPEED_ENV, "2.5")
    assert costmodel.default_model().speed == pytest.approx(2.5)
    # a table that neither holds the probe's ring nor kept probe seconds has nothing to
    # compare: its factor is 1
    only_big = CostModel({r: t for r, t in shipped.table.items() if r != costmodel.PROBE_RING},
                         "no N=8192")
    assert costmodel.probe_speed(only_big) == (1.0, {})
    for bad in ("fast", "0", "-1", "inf"):
        monkeypatch.setattr(costmodel, "_CACHE", {})
        monkeypatch.setenv(costmodel.SPEED_ENV, bad)
        with pytest.raises(ValueError, match=f"POLYNETS_HE_SPEED='{bad}': expected a positive"):
            costmodel.default_model()


def test_server_within_a_memory_budget_encodes_plaintexts_at_use_with_the_same_results():
    torch.manual_seed(5)
    model = TokenMLP(tokens=16, dim=8, hidden=24).eval()
    x = torch.rand(3, 16, 8) * 2 - 1
    prog = he.compile(model, x, packing="vector")
    client = he.Client(prog)
    public = client.public_context()
    roomy = he.Server(prog, public)
    tight = he.Server(prog, public, memory_budget=0)
    assert roomy.kernels.store.lazy == 0 and roomy.kernels.store.kept_bytes > 0
    assert tight.kernels.store.kept_bytes == 0 and tight.kernels.store.lazy > 0
    ct = client.encrypt(x)
    y_roomy = client.decrypt(roomy.run(ct))
    y_tight = client.decrypt(tight.run(ct))
    assert np.max(np.abs(y_tight - y_roomy)) <= 2 * prog.params.expected_error
    assert np.max(np.abs(y_tight - prog.simulate(x))) <= prog.params.expected_error


def test_a_context_relabelled_with_another_key_sets_id_is_refused():
    from he.container import pack, unpack

    model = nn.Sequential(nn.Linear(3, 2), Square()).eval()
    prog = he.compile(model, torch.rand(2, 3), packing="batch")
    ours, theirs = he.Client(prog), he.Client(prog)
    head, blobs = unpack(theirs.public_context(), "public-context", "context")
    forged = pack("public-context", {**{k: head[k] for k in ("fingerprint",)},
                                     "key_id": ours.key_id}, blobs)
    with pytest.raises(he.KeyMismatchError, match="key set id"):
        he.Server(prog, forged)


@pytest.mark.parametrize("kw,match", [({"precision_bits": 1000}, "precision_bits"),
                                      ({"scale_bits": 61}, "scale_bits"),
                                      ({"precision_bits": 2.5}, "precision_bits"),
                                      ({"max_input_ciphertexts": 0}, "max_input_ciphertexts")])
def test_out_of_range_compiler_settings_are_refused_not_clamped(kw, match):
    model = nn.Sequential(nn.Linear(3, 2), Square()).eval()
    with pytest.raises(he.NotEncryptableError, match=match):
        he.compile(model, torch.rand(2, 3), **kw)


@pytest.mark.parametrize("seed", range(4))
def test_compile_returns_only_chains_seal_can_build(seed):
    """Deep programs at low precision: either the compiler refuses them, or SEAL builds the
    chain it chose (a client can be made)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(10):
        layers += [nn.Linear(2, 2), Square()]
    model = nn.Sequential(*layers).eval()
    try:
        prog = he.compile(model, torch.rand(2, 2) * 0.1, precision_bits=4, packing="batch")
    except (he.ParameterError, he.TooDeepError, he.NotEncryptableError):
        return
    he.Client(prog)


def test_canonical_scales_stay_near_the_scale_on_the_longest_chains():
    """S[l+1] = S[l]^2 / q_l would double any offset at every level; 25 levels at N=32768
    must keep every level's scale within a fraction of a bit of 2^scale_bits."""
    import math

    from he.backend import Engine
    from he.params import CKKSParams

    params = CKKSParams(32768, (34,) + (30,) * 25 + (44,), 30, 25, 128, 0.0, 1.0, "")
    scales = [math.log2(s) for s in Engine(params).scales]
    assert len(scales) == 26
    assert max(abs(s - 30) for s in scales) < 0.1


def test_inputs_beyond_what_the_modulus_holds_are_refused_before_encoding():
    model = nn.Sequential(nn.Linear(3, 2), Square()).eval()
    prog = he.compile(model, torch.rand(2, 3), packing="batch")
    client = he.Client(prog)
    with pytest.raises(he.InputShapeError, match="these parameters hold values below"):
        client.encrypt(np.full((1, 3), 1e300))


@pytest.mark.parametrize("packing", ["vector", "batch"])
def test_weights_that_encode_to_zero_are_skipped_not_sent_to_seal(packing):
    """A weight far below the scale's resolution (BatchNorm folding leaves such residues)
    encodes to an all-zero plaintext, whose product SEAL refuses as transparent."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 3), Square(), nn.Linear(3, 2)).eval()
    with torch.no_grad():
        model[0].weight[0, 0] = 1e-15
        model[2].weight[1, 2] = -1e-14
    x = torch.rand(4, 3)
    prog = he.compile(model, x, packing=packing)
    y = _roundtrip(prog, x.numpy())
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error


def test_a_stored_layout_that_is_not_an_order_of_the_values_axes_is_refused():
    torch.manual_seed(0)
    x = torch.rand(8, 1, 8, 8)
    net = _bn_eval(GridTokens(depth=1), x)
    prog = he.compile(net, x, calibration=x, packing="vector")
    from he.plan import layout_groups
    groups = layout_groups(prog.lowered)
    bad = [None if o is None else list(o) for o in prog.plan.orders]
    # an order of the flat (16, 8) shape, not of its (4, 4, 8) grid, for step 1 and the steps
    # that share its layout (each group's orders are checked to agree first)
    for i, g in enumerate(groups):
        if g == groups[1]:
            bad[i] = [2, 1]
    with pytest.raises(ValueError, match="not an order of the axes"):
        he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                           {**prog.options, "layouts": bad})


def test_the_two_maps_of_a_product_run_stacked_where_that_is_cheaper():
    """A Mu-Layer's AX and BDX read the same input: in half the slots they run as one map
    stacked in a doubled period, BDX's half rotated into place; the result, and what the
    shortcut's ``+ AX`` carries, decrypt to the model's output."""
    torch.manual_seed(2)
    x = torch.rand(8, 1, 8, 8)
    net = _bn_eval(GridTokens(depth=2), x)
    prog = he.compile(net, x, calibration=x, packing="vector", samples_per_ciphertext=1)
    assert prog.plan.stacked
    a, b = prog.plan.stacked[0]
    assert prog.plan.steps[b].kind == "half"
    mul = next(s for s in prog.plan.steps if s.kind == "mul" and set(s.inputs) == {a, b})
    assert prog.plan.steps[a].period == 2 * mul.period
    apart = build_vector_plan(prog.lowered, prog.params.slots, prog.plan.orders, interleave=1,
                              stacked=[])
    assert prog.plan.cost()["plain_mults"] < apart.cost()["plain_mults"]
    y = _roundtrip(prog, x[:3].numpy())
    with torch.no_grad():
        ref = net(x[:3]).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x[:3]))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4
    again = he.CompiledProgram.from_bytes(prog.to_bytes())
    assert again.plan.stacked == prog.plan.stacked
    with pytest.raises(ValueError, match="stacked"):
        he.CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                           {**prog.options, "stacked": [[a, a]]})


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 11), st.integers(0, 11),
       st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 4095)), max_size=80),
       st.sampled_from([1, 2, 3, 5, 7, 12, 49, 98]))
def test_bsgs_counting_kernels_match_their_definitions(log_in, log_out, entries, step):
    """The vectorised kernels of the layout search (diagonal offsets, distinct units, rotation
    counts, odd-stride candidates) agree with direct definitions on random sparsity patterns."""
    from he.plan import (MAX_ODD_STRIDE, _cyclic_span, _diagonals_of, _key_units,
                         _step_candidates, _unit_rotations, _units)
    p_in, p_out = 1 << log_in, 1 << log_out
    r = np.array([e[0] % p_out for e in entries], dtype=np.int64)
    c = np.array([e[1] % p_in for e in entries], dtype=np.int64)
    rows, d, big = _diagonals_of(r, c, p_in, p_out)
    # a nonzero (r, c) sits on the diagonal d of the row block it is moved to: c = row + d
    assert big == max(p_in, p_out)
    assert np.all((rows - r) % p_out == 0) and np.all((c - rows - d) % p_in == 0)
    assert np.all((0 <= d) & (d < p_in))
    keys = np.unique(d)
    units = _units(keys, step, p_in)
    raw = _key_units(keys, step, p_in)
    assert (units is None) == (raw is None)
    if units is None:
        return
    assert units.tolist() == sorted(set(raw.tolist()))
    for n1 in (1, 2, 4, 8, 32):
        want = len({u % n1 for u in units.tolist()} - {0}) + \
            len({u // n1 for u in units.tolist()} - {0})
        assert _unit_rotations(units, n1) == want
    cands = _step_candidates(keys, p_in)
    g = int(np.gcd.reduce(keys)) if keys.size else 1
    assert cands[0] == (g or 1)
    if len(cands) > 1:
        # the extra candidate is the first odd stride with the shortest arc, shorter than g's
        a = (cands[0] & -cands[0]).bit_length() - 1
        m = p_in >> a
        spans = {odd: _cyclic_span(np.unique(((keys >> a) * pow(odd, -1, m)) % m), m)
                 for odd in range(3, min(MAX_ODD_STRIDE, m) + 1, 2)}
        best = min(spans.values())
        assert cands[1] == min(o for o, s in spans.items() if s == best) << a
        assert best < _cyclic_span(_units(keys, cands[0], p_in), m)


def test_odd_stride_candidate_packs_an_unpadded_token_grid():
    """Offsets of a 7 x 7 token grid laid out unpadded (multiples of 49 modulo 4096) get the odd
    stride 49 as a unit, which packs them into a short arc."""
    from he.plan import _step_candidates
    keys = np.unique((49 * np.arange(-12, 13)) % 4096).astype(np.int64)
    assert _step_candidates(keys, 4096) == [1, 49]


def test_a_stacked_pair_whose_half_comes_first_runs_after_its_map():
    """A Polymorpher's polynomial mixer multiplies two maps of one input whose second (the one
    feeding only the product) is lowered before the first: its ``half`` step then precedes
    the stacked map it rotates, and the server runs it right after that map (it read an
    unevaluated value before)."""
    torch.manual_seed(0)
    net = pn.PolymorpherClassifier(16, 8, 10, dim=32, depth=1)
    x = torch.rand(64, 16, 8)
    net = _bn_eval(net, x)
    # a slow link (8 Mbit/s): one input ciphertext, whose first maps are such a pair (with
    # the client's planes, the first maps read those instead)
    prog = he.compile(net, x[:1], calibration=x, packing="vector", bandwidth=1e6)
    halves = [(si, s.inputs[0]) for si, s in enumerate(prog.plan.steps) if s.kind == "half"]
    assert any(a > si for si, a in halves)
    order = prog.plan.order()
    assert sorted(order) == list(range(len(prog.plan.steps)))
    pos = {si: i for i, si in enumerate(order)}
    assert all(pos[j] < pos[si] for si, s in enumerate(prog.plan.steps) for j in s.inputs)
    y = _roundtrip(prog, x[:2].numpy())
    with torch.no_grad():
        ref = net(x[:2]).double().numpy()
    assert np.max(np.abs(y - prog.simulate(x[:2]))) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-5


def test_a_calibration_takes_every_ring_to_the_speed_its_probes_read(monkeypatch):
    """A shared machine's speed drifts over a calibration: each ring's timings are scaled by
    the probes taken before and after them to the speed of the probe's seconds the table
    keeps (each primitive's median over the probes), and so are the word loops'."""
    from he import costmodel

    # probes before each ring, after the last, after the word loops: the machine slows to 2x
    # over the second ring's timings, and is back at 1x after the word loops
    speeds = iter([1.0, 1.0, 2.0, 1.0])
    base = {"rotate": 2e-3, "mul_plain": 2e-4, "add": 1e-4}
    monkeypatch.setattr(costmodel, "probe_rounds", lambda *a, **k: [
        {op: t * s for op, t in base.items()} for s in [next(speeds)] * 3])
    ring_speed = {8192: 1.0, 16384: 2.0}
    monkeypatch.setattr(costmodel, "_measure_ring", lambda ring, progress: {
        op: [(1, 1e-3 * ring_speed[ring]), (4, 4e-3 * ring_speed[ring])]
        for op in costmodel.PRIMITIVES})
    for name in ("_parallel_efficiency", "_client_efficiency", "_batch_efficiency"):
        monkeypatch.setattr(costmodel, name, lambda ring: 0.8)
    monkeypatch.setattr(costmodel, "_shared_handoff", lambda ring: 1e-3)
    monkeypatch.setattr(costmodel, "_word_speed", lambda: 1.5)
    model = costmodel.measure((8192, 16384))
    assert model.probe == pytest.approx(base)
    # ring 8192 between two probes at 1x: as timed
    assert model.seconds("rotate", 8192, 1) == pytest.approx(1e-3)
    # ring 16384 timed at 2x between probes at 1x and 2x: read at 1.41x, taken down by that
    assert model.seconds("rotate", 16384, 4) == pytest.approx(8e-3 / np.sqrt(2))
    assert model.word_speed == pytest.approx(1.5 / np.sqrt(2))
    assert model.parallel == {8192: 0.8, 16384: 0.8}


def test_a_cached_table_timed_from_the_caches_is_used_with_a_warning(monkeypatch, tmp_path):
    """A table an earlier version cached timed one operand set from the caches: it is still
    this machine's, but prices servers low, and the compile says to measure it again."""
    from he import costmodel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(costmodel.SPEED_ENV, "1")
    d = costmodel.shipped_model().to_dict()
    assert d["operands_timed"] == costmodel.OPERANDS_TIMED
    path = costmodel.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(d))
    monkeypatch.setattr(costmodel, "_CACHE", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert costmodel.default_model().seconds("rotate", 8192, 3) == pytest.approx(
            costmodel.shipped_model().seconds("rotate", 8192, 3))
    del d["operands_timed"]
    path.write_text(json.dumps(d))
    monkeypatch.setattr(costmodel, "_CACHE", {})
    with pytest.warns(UserWarning, match="timed from the caches.*polynets he-costs"):
        model = costmodel.default_model()
    assert model.source == d["source"]
