"""The program's last map applied by the client: the lowering, the compiler's choice, the round
trip, the stored program and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import he
import polynets as pn
from he.compiler import CompiledProgram
from he.errors import NotEncryptableError
from polynets.ir.lowering import ClientMap, client_map, evaluate_steps, lower, summed_columns


class MuTokens(nn.Module):
    """Tokens through two residual Mu-Layers and a flattened linear head: the head, after the
    last product, is a weighted map that reads the product, its operand and the residual."""

    def __init__(self, tokens: int = 4, dim: int = 8, classes: int = 3, depth: int = 2):
        super().__init__()
        self.mus = nn.ModuleList(pn.MuLayer(dim) for _ in range(depth))
        self.head = nn.Linear(tokens * dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mu in self.mus:
            x = x + mu(x)
        return self.head(x.flatten(1))


def _model(seed: int = 0, depth: int = 2) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return MuTokens(depth=depth).eval(), torch.rand(16, 4, 8) * 2 - 1


def _roundtrip(prog: he.CompiledProgram, x: np.ndarray) -> tuple[np.ndarray, he.Ciphertext]:
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    out = server.run(client.encrypt(x).to_bytes())
    return client.decrypt(out.to_bytes()), out


def _decrypts_as_simulated_and_modelled(prog: he.CompiledProgram, model: nn.Module,
                                        x: torch.Tensor) -> he.Ciphertext:
    """decrypt == simulate (within the promise) == model on ``x``; the server's result."""
    sample = x.numpy()
    y, out = _roundtrip(prog, sample)
    want = prog.simulate(sample)
    assert y.shape == want.shape == (len(x), 3)
    assert np.max(np.abs(y - want)) <= prog.params.expected_error
    with torch.no_grad():
        np.testing.assert_allclose(want, model(x).double().numpy(), rtol=1e-5, atol=1e-5)
    return out


# ----------------------------------------------------------------------------- lowering
@pytest.mark.parametrize("seed,depth", [(0, 1), (1, 2), (2, 3)])
def test_the_client_map_computes_the_same_function_a_level_shorter(seed, depth):
    model, x = _model(seed, depth)
    program = pn.trace(model, x[:1])
    low = lower(program)
    mapped = client_map(low)
    assert mapped is not None and mapped.post is not None
    flat = x.numpy().reshape(len(x), -1).astype(np.float64)
    want = program.simulate(x.numpy()).reshape(len(x), -1)
    np.testing.assert_allclose(evaluate_steps(mapped, flat), want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(evaluate_steps(low, flat), want, rtol=1e-9, atol=1e-12)
    assert mapped.depth_levels() == low.depth_levels() - 1
    # the server returns what the map read; the output is the deepest of them
    head = low.steps[low.output]
    assert len(mapped.outputs) == len(head.inputs) == len(mapped.post.terms)
    levels = mapped.levels()
    assert levels[mapped.output] == max(levels[j] for j in mapped.outputs)
    assert len(mapped.steps) == len(low.steps) - 1
    assert client_map(mapped) is None          # applied once


def test_no_client_map_for_a_map_that_reads_only_the_input():
    program = pn.trace(nn.Sequential(nn.Linear(4, 3)).eval(), torch.rand(1, 4))
    low = lower(program)
    assert low.steps[low.output].inputs == (0,) and client_map(low) is None


def test_a_program_ending_with_a_product_has_no_client_map():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    program = pn.trace(nn.Sequential(nn.Linear(4, 4), Square()).eval(), torch.rand(1, 4))
    low = lower(program)
    assert low.steps[low.output].kind == "mul" and client_map(low) is None


# ----------------------------------------------------------------------------- compiler
def test_decrypt_equals_simulate_and_the_model_with_the_client_map():
    model, x = _model()
    server_side = he.compile(model, x[:1], calibration=x, final_map="server")
    prog = he.compile(model, x[:1], calibration=x, final_map="client")
    assert prog.options["client_map"] is True and "client_map" not in server_side.options
    assert prog.params.levels == server_side.params.levels - 1
    assert prog.lowered.post is not None
    out = _decrypts_as_simulated_and_modelled(prog, model, x[:5])
    # one ciphertext per value the map reads, for every group of interleaved samples
    k = prog.plan.interleave
    groups = out._groups
    assert len(groups) == -(-5 // k)
    assert all(len(g) == len(prog.plan.results) == len(prog.lowered.outputs) for g in groups)
    # each travels on the last level's primes (the returned values shallower than the product
    # switched down to them), as the compiler predicts; the client's decryptions are priced
    assert len(prog.plan.results) > 1
    one = he.Ciphertext.from_bytes(out.to_bytes())
    sizes = {len(b) for b in one._groups[0]}
    assert len(sizes) == 1
    assert prog.plan.predicted["download_bytes"] == sum(sizes) * len(prog.plan.results)
    assert prog.plan.predicted["client_decrypt_seconds"] > 0


def test_auto_keeps_the_cheaper_and_says_so():
    model, x = _model()
    prog = he.compile(model, x[:1], calibration=x)          # final_map="auto"
    server_side = he.compile(model, x[:1], calibration=x, final_map="server")
    client_side = he.compile(model, x[:1], calibration=x, final_map="client")
    cost = {p.options.get("client_map", False): p.plan.predicted["round_trip_seconds"]
            for p in (server_side, client_side)}
    assert prog.options.get("client_map", False) == (cost[True] < cost[False])
    assert "applied by the client" in prog.plan.why
    assert prog.plan.predicted["round_trip_seconds"] == pytest.approx(min(cost.values()))


class MeanTokens(MuTokens):
    """:class:`MuTokens` with a mean-pooled head: the map weighs a channel's tokens alike."""

    def __init__(self, tokens: int = 4, dim: int = 8, classes: int = 3, depth: int = 2):
        super().__init__(tokens, dim, classes, depth)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mu in self.mus:
            x = x + mu(x)
        return self.head(x.mean(1))


def test_tokens_packing_keeps_the_last_map_on_the_server():
    torch.manual_seed(0)
    model = pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed="patch",
                     embed_dim=8, depth=1, expansion=2, norm="batch").eval()
    x = torch.rand(16, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=x, packing="tokens", final_map="client",
                      precision_bits=10)
    assert prog.packing == "tokens"
    assert "client_map" not in prog.options and prog.lowered.post is None


@pytest.mark.parametrize("mean", [False, True])
def test_batch_packing_returns_sums_the_client_maps(mean):
    """Batch packing: the server returns, per value the head reads, the sums of the elements
    it weighs alike (a channel's tokens under a mean pooling; every element of a flattened
    head); decrypt == simulate == model, a level shorter, the download as predicted."""
    torch.manual_seed(3)
    model = (MeanTokens() if mean else MuTokens()).eval()
    x = torch.rand(16, 4, 8) * 2 - 1
    server_side = he.compile(model, x[:1], calibration=x, packing="batch", final_map="server")
    prog = he.compile(model, x[:1], calibration=x, packing="batch", final_map="client")
    assert prog.options["client_map"] is True and prog.lowered.post is not None
    assert prog.params.levels == server_side.params.levels - 1
    post = prog.lowered.post
    assert post.sums is not None
    flat = x.numpy().reshape(len(x), -1).astype(np.float64)
    np.testing.assert_allclose(evaluate_steps(prog.lowered, flat),
                               evaluate_steps(server_side.lowered, flat), rtol=1e-9, atol=1e-12)
    # a mean weighs the 4 tokens of a channel alike: 8 sums per value, not 32 elements
    per_value = {post.sums[k].shape[1]: post.returned()[k] for k in range(len(post.reads))}
    if mean:
        assert per_value.get(32) == 8
    else:
        assert per_value.get(32) == 32
    out = _decrypts_as_simulated_and_modelled(prog, model, x[:5])
    one = he.Ciphertext.from_bytes(out.to_bytes())
    assert len(one._groups[0]) == sum(post.returned())
    assert prog.plan.predicted["download_bytes"] == sum(len(b) for b in one._groups[0])
    assert prog.plan.predicted["client_decrypt_seconds"] > 0
    assert f"{sum(post.returned())} ciphertexts" in prog.summary()


def test_batch_auto_compares_groups_of_two_rings_per_sample():
    """With the head on the server the program needs N=16384, with it on the client N=8192:
    half the samples per group, so ``auto`` compares them per sample, not per round trip."""
    model, x = _model()
    server_side = he.compile(model, x[:1], calibration=x, packing="batch", final_map="server")
    client_side = he.compile(model, x[:1], calibration=x, packing="batch", final_map="client")
    assert server_side.params.slots != client_side.params.slots
    auto = he.compile(model, x[:1], calibration=x, packing="batch")
    per_sample = {p.options.get("client_map", False): p.plan.predicted["seconds_per_sample"]
                  for p in (server_side, client_side)}
    assert auto.options.get("client_map", False) == (per_sample[True] < per_sample[False])
    assert "s per sample against" in auto.plan.why


def test_summed_columns_groups_equal_columns_only():
    m = sp.csr_matrix(np.array([[1.0, 2.0, 1.0, 0.0, 2.0, 3.0],
                                [4.0, 5.0, 4.0, 0.0, 5.0, 4.0]]))
    post = ClientMap((1,), [m], np.array([0.5, -0.5]), (2,))
    summed = summed_columns(post)
    # columns 0 and 2 alike, 1 and 4 alike, 5 alone; 3 read by nothing
    assert summed.returned() == [3]
    np.testing.assert_array_equal(summed.sums[0].toarray(),
                                  [[1, 0, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(summed.step_terms()[0].toarray(), m.toarray())
    v = np.random.default_rng(0).normal(size=(4, 6))
    np.testing.assert_allclose(summed.apply([v]), post.apply([v]), rtol=1e-12)
    assert summed_columns(summed) is summed


def test_a_batch_program_with_the_client_map_round_trips_through_a_file(tmp_path):
    torch.manual_seed(4)
    model = MeanTokens().eval()
    x = torch.rand(16, 4, 8) * 2 - 1
    prog = he.compile(model, x[:1], calibration=x, packing="batch", final_map="client")
    path = tmp_path / "b.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.options["client_map"] is True and loaded.lowered.post is not None
    assert loaded.lowered.post.returned() == prog.lowered.post.returned()
    sample = x[:3].numpy()
    client = he.Client(loaded)
    out = he.Server(loaded, client.public_context()).run(client.encrypt(sample))
    y = client.decrypt(out)
    assert np.max(np.abs(y - prog.simulate(sample))) <= prog.params.expected_error
    out._groups[0] = out._groups[0][:-1]
    with pytest.raises(he.SerializationError, match="a result group holds"):
        client.decrypt(out)


def test_the_stored_program_rebuilds_the_client_map(tmp_path):
    model, x = _model()
    prog = he.compile(model, x[:1], calibration=x, final_map="client")
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.options["client_map"] is True and loaded.fingerprint == prog.fingerprint
    assert loaded.lowered.post is not None
    assert loaded.plan.results == prog.plan.results
    assert loaded.plan.op_counts() == prog.plan.op_counts()
    sample = x[:2].numpy()
    y, _ = _roundtrip(loaded, sample)
    assert np.max(np.abs(y - prog.simulate(sample))) <= prog.params.expected_error


# ----------------------------------------------------------------------------- errors
def test_an_unknown_final_map_is_refused():
    model, x = _model()
    with pytest.raises(NotEncryptableError, match="final_map must be one of"):
        he.compile(model, x[:1], final_map="both")


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_stored_client_map_that_is_not_a_bool_is_refused(bad):
    model, x = _model()
    prog = he.compile(model, x[:1], calibration=x, final_map="client")
    with pytest.raises(ValueError, match="client_map must be true or false"):
        CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                        {**prog.options, "client_map": bad})


def test_a_stored_client_map_on_a_program_without_one_is_refused():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    model = nn.Sequential(nn.Linear(4, 4), Square()).eval()
    x = torch.rand(8, 4)
    prog = he.compile(model, x[:1], calibration=x)
    with pytest.raises(ValueError, match="does not end with a map the client can apply"):
        CompiledProgram(prog.program, prog.params, "vector", prog.calibration,
                        {**prog.options, "client_map": True})


def test_a_result_with_the_wrong_number_of_ciphertexts_is_refused():
    model, x = _model()
    prog = he.compile(model, x[:1], calibration=x, final_map="client")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    out = server.run(client.encrypt(x[:1].numpy()))
    out._groups[0] = out._groups[0][:1]
    with pytest.raises(he.SerializationError, match="ciphertext\\(s\\) per"):
        client.decrypt(out)


def test_certify_reports_the_levels_with_the_client_map():
    model, x = _model()
    cert = pn.certify(model, x[:1])
    low = lower(cert.program)
    assert cert.client_levels == client_map(low).depth_levels() == cert.levels - 1
    assert f"{cert.client_levels} where the client applies the last map" in str(cert)


# ----------------------------------------------------------------------------- split values
class WideTokens(nn.Module):
    """8 x 8 tokens of 80 channels (5,120 elements: more than N=8192's 4,096 slots), a shifted
    Mu-Layer, a flattened head."""

    def __init__(self, side: int = 8, dim: int = 80):
        super().__init__()
        self.embed = pn.PatchEmbed(side, 1, 1, dim)
        self.mu = pn.MuLayer(dim, norm="batch", spatial_shift=True)
        self.head = nn.Linear(side * side * dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        return self.head((t + self.mu(t)).flatten(1))


def _wide() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    x = torch.rand(24, 1, 8, 8)
    model = WideTokens()
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval(), x


@pytest.mark.parametrize("axis", [-1, 0])
def test_a_split_lowering_keeps_the_client_map_reading_every_block(axis):
    from he.split import split_lowered

    model, x = _wide()
    mapped = client_map(lower(pn.trace(model, x[:1])))
    split = split_lowered(mapped, 4096, axis)
    assert split is not None and split.lowered.post is not None
    new = split.lowered
    assert all(s.n <= 4096 for s in new.steps)
    assert len(new.outputs) > len(mapped.outputs)       # a wide value read in blocks
    flat = x[:4].numpy().reshape(4, -1).astype(np.float64)
    np.testing.assert_allclose(evaluate_steps(new, flat), evaluate_steps(mapped, flat),
                               rtol=1e-12, atol=1e-12)
    assert new.depth_levels() == mapped.depth_levels()


def test_a_split_program_with_the_client_map_decrypts_within_its_promise(tmp_path):
    model, x = _wide()
    prog = he.compile(model, x, calibration=x, ring_degree=8192, precision_bits=8,
                      final_map="client")
    assert prog.options["client_map"] is True and prog.options["split"]["slots"] == 4096
    assert len(prog.plan.results) == len(prog.lowered.outputs) > 1
    path = tmp_path / "p.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.plan.results == prog.plan.results
    sample = x[:2].numpy()
    y, _ = _roundtrip(loaded, sample)
    assert np.max(np.abs(y - prog.simulate(sample))) <= prog.params.expected_error


# ----------------------------------------------------------------------------- returned values
def test_a_returned_value_travels_on_the_last_levels_primes_unless_its_level_is_pending():
    from he.params import returned_level

    assert returned_level(1, 4, -1) == 4              # one prime per level: the last's
    assert returned_level(4, 4, -1) == 4
    assert returned_level(1, 4, 0) == 4               # canonical on a wide chain: the last's
    assert returned_level(2, 5, 0) == 2               # pending (squared scale): its own


def test_read_levels_pairs_each_read_with_its_level_and_the_one_it_travels_on():
    from he.params import read_levels

    levels = [0, 1, 2, 3, 5]                          # every step's level; the deepest is 5
    assert read_levels([1, 3], levels, -1) == [(1, 5), (3, 5)]
    assert read_levels([2, 3], levels, 0) == [(2, 2), (3, 5)]   # level 2 pending: its own
    assert read_levels([], levels, 0) == []


def test_a_value_switched_down_to_the_last_level_decrypts_the_same():
    import tenseal.sealapi as seal

    from he.backend import Engine
    from he.params import CKKSParams

    params = CKKSParams(poly_modulus_degree=8192, coeff_mod_bit_sizes=(40, 30, 30, 30, 50),
                        scale_bits=30, levels=3, security_bits=128, expected_error=1e-3,
                        max_abs=8.0, why="")
    eng = Engine(params)
    keys = seal.KeyGenerator(eng.context)
    pk = seal.PublicKey()
    keys.create_public_key(pk)
    values = np.linspace(-8.0, 8.0, eng.slots)
    ct = seal.Ciphertext()
    seal.Encryptor(eng.context, pk).encrypt(eng.encode_vector(values, 0, eng.scales[0]), ct)
    low = eng.drop_to(ct, 3)
    assert eng.chain(low) == params.chain_index(3) and eng.chain(ct) == 0
    assert eng.drop_to(low, 3) is low                    # already there
    pt = seal.Plaintext()
    seal.Decryptor(eng.context, keys.secret_key()).decrypt(low, pt)
    np.testing.assert_allclose(eng.encoder.decode_double(pt), values, atol=1e-4)
