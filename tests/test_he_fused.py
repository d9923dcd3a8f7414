"""Batch packing's fused linear maps: exact integer matrix products over the ciphertexts' RNS
words must equal SEAL's own multiply_plain/add chain word for word, and the compiled programs
that use them must decrypt to the simulation."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import tenseal.sealapi as seal
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import he
from he.backend import Engine
from he.compiler import _predict_batch
from he.costmodel import CostModel, default_model
from he import _kernels
from he.fused import RawAccess, fuse_map, raw_access
from he.params import CKKSParams
from he.plan import batch_counts
from he.runtime import live_rows


@pytest.fixture(scope="module")
def setup():
    params = CKKSParams(8192, (35, 27, 27, 45), 27, 2, 128, 0.0, 1.0, "fused tests")
    eng = Engine(params)
    keygen = seal.KeyGenerator(eng.context)
    pk = seal.PublicKey()
    keygen.create_public_key(pk)
    encryptor = seal.Encryptor(eng.context, pk)
    decryptor = seal.Decryptor(eng.context, keygen.secret_key())
    rng = np.random.default_rng(0)
    values = rng.uniform(-1, 1, size=(24, 8))
    cts = []
    for v in values:
        ct = seal.Ciphertext()
        encryptor.encrypt(eng.encode_vector(np.resize(v, eng.slots), 0, eng.scales[0]), ct)
        cts.append(ct)
    return eng, cts, values, decryptor


def _moduli(eng: Engine, ct) -> list[int]:
    return [m.value() for m in eng.context.get_context_data(ct.parms_id()).parms()
            .coeff_modulus()]


def _outputs(eng: Engine, template, n: int) -> list:
    outs = []
    for _ in range(n):
        out = seal.Ciphertext()
        eng.evaluator.negate(template, out)
        outs.append(out)
    return outs


def test_probe_confirms_the_layout(setup):
    eng, cts, _, _ = setup
    raw = raw_access(cts[0])
    assert raw.ok, raw.reason
    view = raw.view(cts[3])
    assert view.shape == (2 * cts[3].coeff_modulus_size(), eng.params.poly_modulus_degree)
    assert int(view[0, 0]) == cts[3].data(0)
    assert int(view[cts[3].coeff_modulus_size(), 0]) == cts[3].data(1)


def test_probe_rejects_a_wrong_layout(setup):
    _, cts, _, _ = setup
    bad = RawAccess(cts[0], [1, 2, 3, 4])          # not this ciphertext's parameters id
    assert not bad.ok and "parameters id" in bad.reason


@pytest.fixture(params=["compiled", "numpy"])
def kernel(request, monkeypatch):
    """Each fused-map test runs on both paths: the compiled loops and the NumPy reference."""
    if request.param == "numpy":
        monkeypatch.setenv(_kernels.ENV_DISABLE, "1")
    else:
        pytest.importorskip("numba")
        monkeypatch.delenv(_kernels.ENV_DISABLE, raising=False)
        assert _kernels.kernels() is not None, _kernels.reason()
    return request.param


def test_compiled_loops_are_used_where_numba_is_installed(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv(_kernels.ENV_DISABLE, raising=False)
    assert _kernels.kernels() is not None and _kernels.reason() == ""
    with _kernels.numpy_loops():
        assert _kernels.kernels() is None
    assert _kernels.kernels() is not None         # restored on exit
    monkeypatch.setenv(_kernels.ENV_DISABLE, "1")
    assert _kernels.kernels() is None and _kernels.ENV_DISABLE in _kernels.reason()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_map_on_threads_writes_the_same_words(setup, threads):
    """The compiled loops' tiles spread over a pool's threads (each its own scratch arrays):
    word for word what one thread writes, constants included, tiles split where the blocks
    are fewer than the threads."""
    pytest.importorskip("numba")
    from he.native import Pool

    eng, cts, _, _ = setup
    raw = raw_access(cts[0])
    rng = np.random.default_rng(7)
    w = rng.normal(size=(9, len(cts)))
    moduli = _moduli(eng, cts[0])
    scale = eng.scales[0]
    fmap, covered = fuse_map([sp.csr_matrix(w)], [np.ones(len(cts), bool)],
                             [np.full(len(cts), scale)], np.arange(9), moduli)
    consts = [round(v * scale * scale) for v in rng.normal(size=covered.size)]
    one, many = _outputs(eng, cts[0], covered.size), _outputs(eng, cts[0], covered.size)
    fmap.apply(raw, cts, one, moduli, consts)
    fmap.apply(raw, cts, many, moduli, consts, Pool(threads))
    for a, b in zip(one, many):
        np.testing.assert_array_equal(raw.view(a), raw.view(b))


@pytest.mark.parametrize("density", [0.3, 1.0])
def test_fused_map_is_word_identical_to_seals_chain(setup, density, kernel):
    eng, cts, _, _ = setup
    raw = raw_access(cts[0])
    rng = np.random.default_rng(1)
    w = rng.normal(size=(10, len(cts))) * 2.0
    w[rng.random(w.shape) > density] = 0.0
    w[:, 0] = 0.0                                   # a column nobody reads
    moduli = _moduli(eng, cts[0])
    scale = eng.scales[0]
    fmap, covered = fuse_map([sp.csr_matrix(w)], [np.ones(len(cts), bool)],
                             [np.full(len(cts), scale)], np.arange(10), moduli)
    assert fmap is not None
    outs = _outputs(eng, cts[0], covered.size)
    fmap.apply(raw, cts, outs, moduli)
    for r, out in zip(covered, outs):
        acc = None
        for c in np.flatnonzero(w[r]):
            term = eng.mul_plain(cts[c], eng.encode_scalar(float(w[r, c]), 0, scale))
            acc = term if acc is None else eng.add(acc, term)
        np.testing.assert_array_equal(raw.view(out), raw.view(acc))


def test_constants_join_the_first_polynomial(setup, kernel):
    """A constant (bias) folded into the map equals SEAL's chain plus the constant's plaintext,
    word for word, on both paths."""
    eng, cts, values, decryptor = setup
    raw = raw_access(cts[0])
    moduli = _moduli(eng, cts[0])
    scale = eng.scales[0]
    w = np.random.default_rng(5).normal(size=(3, 8))
    fmap, covered = fuse_map([sp.csr_matrix(w)], [np.ones(8, bool)], [np.full(8, scale)],
                             np.arange(3), moduli)
    consts = [round(v * scale * scale) for v in (0.75, -2.5, 0.0)]
    outs = _outputs(eng, cts[0], 3)
    fmap.apply(raw, cts[:8], outs, moduli, consts)
    for r, out in enumerate(outs):
        acc = None
        for c in range(8):
            term = eng.mul_plain(cts[c], eng.encode_scalar(float(w[r, c]), 0, scale))
            acc = term if acc is None else eng.add(acc, term)
        view = raw.view(acc)
        for limb, q in enumerate(moduli):       # the constant polynomial's NTT form
            view[limb] = (view[limb] + np.uint64(consts[r] % q)) % np.uint64(q)
        np.testing.assert_array_equal(raw.view(out), view)
        out.scale = scale * scale
        pt = seal.Plaintext()
        decryptor.decrypt(eng.rescale(out), pt)
        got = np.array(eng.encoder.decode_double(pt))[:8]
        np.testing.assert_allclose(got, w[r] @ values[:8] + consts[r] / scale ** 2, atol=1e-3)


def test_lower_level_inputs_are_read_at_the_output_level(setup, kernel):
    """An input a level below the step's (one limb more) is switched down by dropping its last
    limb; its weights carry the scale that brings its products to the others'. Word-identical to
    SEAL's mod_switch + multiply_plain, and decrypts to the weighted sum."""
    eng, cts, values, decryptor = setup
    raw = raw_access(cts[0])
    level = 1
    high = [eng.lift(c, level) for c in cts[:3]]           # level 1
    low = cts[3:6]                                          # level 0: one limb more
    inputs = high + low
    levels = np.array([1, 1, 1, 0, 0, 0])
    product = eng.scales[level] ** 2
    col_scales = product / np.asarray(eng.scales)[levels]
    moduli = _moduli(eng, high[0])
    w = np.random.default_rng(2).normal(size=(4, 6))
    fmap, covered = fuse_map([sp.csr_matrix(w)], [np.ones(6, bool)], [col_scales],
                             np.arange(4), moduli)
    assert fmap is not None and covered.size == 4
    outs = _outputs(eng, high[0], 4)
    fmap.apply(raw, inputs, outs, moduli)
    for r, out in enumerate(outs):
        acc = None
        for c, e in enumerate(inputs):
            if levels[c] < level:
                switched = seal.Ciphertext()
                eng.evaluator.mod_switch_to(e, eng.parms_ids[level], switched)
                e = switched
            term = eng.mul_plain(e, eng.encode_scalar(float(w[r, c]), level, col_scales[c]))
            acc = term if acc is None else eng.add(acc, term)
        np.testing.assert_array_equal(raw.view(out), raw.view(acc))
        out.scale = product
        res = eng.rescale(out)
        pt = seal.Plaintext()
        decryptor.decrypt(res, pt)
        got = np.array(eng.encoder.decode_double(pt))[:8]
        np.testing.assert_allclose(got, w[r] @ values[:6], atol=1e-3)


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(1, 16, 2, stride=2)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)           # (B, 16 tokens, 16 channels)
        t = t * t                    # the channel maps below read a product, not the input
        t = t + self.mix(t) * self.mix(t * 0.5)
        return self.head(t.flatten(1))


def test_batch_packing_with_fused_maps_decrypts_to_the_simulation(kernel):
    torch.manual_seed(0)
    model = TokenNet().eval()
    x = torch.randn(5, 1, 8, 8)
    prog = he.compile(model, x[:1], calibration=torch.randn(64, 1, 8, 8), packing="batch",
                      precision_bits=8)
    counts = prog.plan.predicted["counts"]
    assert counts.get("fused_mac", 0) > 0, counts          # the fused path is what is priced
    assert max(prog.options["fused_fanin"]) > 0
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())
    want = prog.simulate(x.numpy())
    np.testing.assert_allclose(got, want, atol=prog.params.expected_error)
    np.testing.assert_allclose(want, model(x).detach().numpy(), atol=1e-6)


def test_fused_rows_are_counted_once_and_chosen_where_cheaper():
    torch.manual_seed(0)
    model = TokenNet().eval()
    prog = he.compile(model, torch.randn(1, 1, 8, 8), packing="batch", precision_bits=8)
    lowered = prog.lowered
    live = live_rows(lowered)
    plain = batch_counts(lowered, live)
    bits = prog.params.coeff_mod_bit_sizes[:-1]
    moduli = [[2 ** b - 1 for b in bits[:prog.params.levels + 1 - lv]]
              for lv in range(prog.params.levels + 1)]
    fanin = prog.options["fused_fanin"]
    assert any(fanin)
    fused = batch_counts(lowered, live, moduli, prog.params.scale, fanin)
    for a, b in zip(plain, fused):
        # every weighted output is rescaled once either way; fused rows leave the chain
        assert a["rescale"] == b["rescale"]
        assert b["mul_plain"] <= a["mul_plain"]
    costs = default_model()
    threads = prog.server_threads
    lazy = prog.options.get("lazy_products", ())
    chosen = _predict_batch(lowered, live, prog.params, costs, fanin, threads, lazy=lazy)
    unfused = _predict_batch(lowered, live, prog.params, costs, [0] * len(fanin), threads,
                             lazy=lazy)
    assert chosen["seconds_per_ciphertext"] < unfused["seconds_per_ciphertext"]
    assert chosen["seconds_per_ciphertext"] == prog.plan.predicted["seconds_per_ciphertext"]


def test_cost_table_word_costs_are_validated():
    d = default_model().to_dict()
    assert set(d["words"]) == {"fused_mac", "fused_in", "fused_out"}
    # a table written when fresh outputs were priced still reads (that cost is ignored)
    old = dict(d, words={**d["words"], "alloc": 2e-9})
    assert CostModel.from_dict(old).words == CostModel.from_dict(d).words
    d["words"]["fused_mac"] = -1.0
    with pytest.raises(ValueError, match="fused_mac"):
        CostModel.from_dict(d)
    d["words"] = {"bogus": 1.0}
    with pytest.raises(ValueError, match="bogus"):
        CostModel.from_dict(d)


def test_auto_packing_keeps_the_server_within_the_memory_budget():
    """Batch packing wins on throughput, but its server does not fit a small budget: auto
    packing takes vector packing then, and says why."""
    torch.manual_seed(0)
    model = TokenNet().eval()
    x = torch.randn(1, 1, 8, 8)
    cal = torch.randn(64, 1, 8, 8)
    free = he.compile(model, x, calibration=cal, packing="auto", objective="throughput",
                      precision_bits=8)
    assert free.packing == "batch"
    batch_mem = free.plan.predicted["server_memory_bytes"]
    # just below the group's memory: batch packing still fits, with every product finished
    # (smaller ciphertexts than lazy ones), then, below that, in tiles
    budget = int(batch_mem) - 1
    for _ in range(2):
        tiled = he.compile(model, x, calibration=cal, packing="auto", objective="throughput",
                           precision_bits=8, memory_budget=budget)
        assert tiled.packing == "batch"
        assert tiled.plan.predicted["server_memory_bytes"] <= budget < batch_mem
        if tiled.plan.predicted["tiles"]:
            break
        assert free.options.get("lazy_products") and "not at this memory budget" in \
            tiled.plan.why
        budget = int(tiled.plan.predicted["server_memory_bytes"]) - 1
    assert tiled.plan.predicted["tiles"]
    with pytest.warns(he.MemoryBudgetWarning, match="more than memory_budget=0.0 GiB"):
        least = he.compile(model, x, calibration=cal, packing="batch", precision_bits=8,
                           memory_budget=1).plan.predicted["server_memory_bytes"]
    tight = he.compile(model, x, calibration=cal, packing="auto", objective="throughput",
                       precision_bits=8, memory_budget=int(least) - 1)
    assert tight.packing == "vector"
    assert "> budget" in tight.plan.why
    with pytest.raises(he.NotEncryptableError, match="memory_budget"):
        he.compile(model, x, calibration=cal, packing="auto", memory_budget=0)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.sampled_from([4, 8]), st.sampled_from([4, 12]),
       st.sampled_from([8, 16]), st.integers(0, 1000))
def test_random_mulayer_token_models_agree_fused_or_not(side, dim, hidden, precision, seed):
    """Batch packing of random Mu-Layer token models (BatchNorm biases, a spatial shift's zero
    padding, a residual read a level below its partner): every weighted row through SEAL's chain
    and every row fused give the simulation within the promised error."""
    import polynets as pn

    torch.manual_seed(seed)
    model = nn.Sequential(pn.MuLayer(dim, hidden=hidden, norm="batch", spatial_shift=True),
                          nn.Flatten(1), nn.Linear(side * side * dim, 2))
    x = torch.rand(6, side, side, dim) * 2 - 1
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x, calibration=x, packing="batch", precision_bits=precision)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x[:3]).to_bytes()
    want = prog.simulate(x[:3].numpy())
    n = len(prog.lowered.steps)
    got = []
    for fanin in ([0] * n, [1] * n):
        server.program.options["fused_fanin"] = fanin
        got.append(client.decrypt(server.run(ct).to_bytes()))
        assert np.max(np.abs(got[-1] - want)) <= prog.params.expected_error
    with torch.no_grad():
        assert np.max(np.abs(want - model(x[:3]).double().numpy())) <= 1e-6


@pytest.mark.parametrize("security", [192, 256])
def test_higher_security_levels_compile_run_and_are_enforced_by_seal(security):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Flatten(1)).eval()
    x = torch.randn(8, 4)
    prog = he.compile(model, x[:1], calibration=x, packing="batch", security=security)
    assert prog.params.security_bits == security
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())
    np.testing.assert_allclose(got, model(x).detach().numpy(), atol=prog.params.expected_error)
    with pytest.raises(he.NotEncryptableError, match="security"):
        he.compile(model, x[:1], calibration=x, security=100)


def test_a_batch_server_builds_the_compiled_loops_when_it_starts(monkeypatch):
    """The compiled loops are built and checked once per process: a batch server whose program
    fuses rows does it when it starts, so its first request does not pay for it."""
    pytest.importorskip("numba")
    monkeypatch.delenv(_kernels.ENV_DISABLE, raising=False)
    torch.manual_seed(0)
    prog = he.compile(TokenNet().eval(), torch.randn(1, 1, 8, 8), packing="batch",
                      precision_bits=8)
    assert any(prog.options["fused_fanin"])
    monkeypatch.setattr(_kernels, "_STATE", {})           # a fresh process's state
    he.Server(prog, he.Client(prog).public_context())
    assert _kernels._STATE.get("kernels") is not None, _kernels.reason()
