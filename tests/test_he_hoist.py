"""Hoisted baby steps (he.hoist): exact against SEAL where the arithmetic is the same, within
SEAL's own error elsewhere, refused where anything differs, chosen by the cost model."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal.sealapi as seal
import torch

import he
from he.hoist import ENV_NO_HOISTING, Hoister, expected
from he.native import default_threads, galois_element, native_platform
from he.plan import bsgs_plan, shared_splits

pytestmark = pytest.mark.skipif(not expected(), reason="no hoisting on this platform")

STEPS = (1, 3, -5, 8)


@pytest.fixture(scope="module")
def ckks():
    """A small 128-bit context (N=4096, two data primes and a special one), its keys, a
    ciphertext of random values and SEAL's tools."""
    ring = 4096
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(ring)
    parms.set_coeff_modulus(seal.CoeffModulus.Create(ring, [36, 30, 36]))
    ctx = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    keygen = seal.KeyGenerator(ctx)
    gk = seal.GaloisKeys()
    keygen.create_galois_keys([galois_element(s, ring) for s in STEPS], gk)
    pk = seal.PublicKey()
    keygen.create_public_key(pk)
    encoder, ev = seal.CKKSEncoder(ctx), seal.Evaluator(ctx)
    x = np.random.default_rng(0).uniform(-1, 1, ring // 2)
    pt = seal.Plaintext()
    encoder.encode(x.tolist(), 2.0 ** 30, pt)
    ct = seal.Ciphertext()
    seal.Encryptor(ctx, pk).encrypt(pt, ct)
    dec = seal.Decryptor(ctx, keygen.secret_key())

    def decrypt(c):
        out = seal.Plaintext()
        dec.decrypt(c, out)
        return np.array(encoder.decode_double(out))

    return {"ctx": ctx, "gk": gk, "encoder": encoder, "ev": ev, "ct": ct, "x": x,
            "decrypt": decrypt, "ring": ring}


def _hoister(ckks):
    h, why = Hoister.validated(ckks["ctx"], ckks["gk"], ckks["ev"], ckks["encoder"],
                               ckks["ct"], 1)
    assert h is not None, why
    return h


def test_hoisted_rotations_decrypt_as_seals_do(ckks):
    # the errors of all the steps together: on this chain (a special prime no wider than the
    # widest prime) a key switching's error is heavy-tailed, so one rotation's largest error
    # differed from SEAL's by up to 9x either way over 100 rotations (its root mean square by
    # up to 3x); a wrong slot, key or division errs by the values themselves (about 1; the
    # largest error of 40 draws of these four rotations was 5e-4)
    h = _hoister(ckks)
    d = h.decompose(ckks["ct"])
    errs, errs_seal = [], []
    for s in STEPS:
        want = np.roll(ckks["x"], -s)
        ref = seal.Ciphertext()
        ckks["ev"].rotate_vector(ckks["ct"], s, ckks["gk"], ref)
        errs_seal.append(ckks["decrypt"](ref) - want)
        errs.append(ckks["decrypt"](h.rotate(d, s)) - want)
    assert np.abs(errs).max() < 1e-2
    assert np.sqrt(np.mean(np.square(errs))) < 3 * np.sqrt(np.mean(np.square(errs_seal)))


def test_a_giant_steps_sum_is_divided_once_and_decrypts_to_its_products(ckks):
    h = _hoister(ckks)
    rng = np.random.default_rng(1)
    d = h.decompose(ckks["ct"])
    limbs = ckks["ct"].coeff_modulus_size()
    diags = [rng.uniform(-1, 1, ckks["ring"] // 2) for _ in STEPS]
    terms = [(h.extend_plain(ckks["encoder"], v.tolist(), 2.0 ** 20, limbs), h.rotate_ext(d, s))
             for v, s in zip(diags, STEPS)]
    out = h.mod_down(h.product_sum(terms), ckks["ct"].scale * 2.0 ** 20)
    want = sum(v * np.roll(ckks["x"], -s) for v, s in zip(diags, STEPS))
    # SEAL's own: rotate, multiply, add
    acc = None
    for v, s in zip(diags, STEPS):
        r, p = seal.Ciphertext(), seal.Plaintext()
        ckks["ev"].rotate_vector(ckks["ct"], s, ckks["gk"], r)
        ckks["encoder"].encode(v.tolist(), ckks["ct"].parms_id(), 2.0 ** 20, p)
        ckks["ev"].multiply_plain_inplace(r, p)
        if acc is None:
            acc = r
        else:
            ckks["ev"].add_inplace(acc, r)
    err_seal = np.abs(ckks["decrypt"](acc) - want).max()
    assert np.abs(ckks["decrypt"](out) - want).max() < max(4 * err_seal, 1e-5)


def test_a_constant_second_polynomial_rotates_to_seals_very_words(ckks):
    """The validation's identity, on a lower level too: SEAL's digits of a constant are the
    hoister's, so the words must match exactly."""
    from he.fused import raw_access
    h = _hoister(ckks)
    ct = seal.Ciphertext()
    ckks["ev"].mod_switch_to_next(ckks["ct"], ct)
    limbs = ct.coeff_modulus_size()
    words = raw_access(ct).view(ct)
    moduli = np.array([m.value() for m in ckks["ctx"].get_context_data(ct.parms_id())
                       .parms().coeff_modulus()], dtype=np.uint64)
    words[limbs:] = (np.uint64(977) % moduli)[:, None]
    for s in STEPS:
        ref = seal.Ciphertext()
        ckks["ev"].rotate_vector(ct, s, ckks["gk"], ref)
        got = h.rotate(h.decompose(ct), s)
        assert np.array_equal(raw_access(got).view(got), raw_access(ref).view(ref))


def test_a_hoister_whose_keys_are_wrong_is_refused(ckks, monkeypatch):
    h = _hoister(ckks)
    perm, keys = h._step(1)
    bad = keys.copy()
    bad[0, 0, 0, :4] ^= np.uint64(1)
    monkeypatch.setattr(Hoister, "_step", lambda self, step: (perm, bad))
    got, why = Hoister.validated(ckks["ctx"], ckks["gk"], ckks["ev"], ckks["encoder"],
                                 ckks["ct"], 1)
    assert got is None and "differs from SEAL's" in why


def test_a_probe_step_without_a_key_is_refused(ckks):
    got, why = Hoister.validated(ckks["ctx"], ckks["gk"], ckks["ev"], ckks["encoder"],
                                 ckks["ct"], 2)
    assert got is None and "no Galois key for the probe step 2" in why


def test_the_environment_turns_hoisting_off(monkeypatch):
    monkeypatch.setenv(ENV_NO_HOISTING, "1")
    assert not expected()
    assert he.hoist.refused() == f"{ENV_NO_HOISTING} is set"


def _dense_terms(n: int = 64, period: int = 64):
    return [(0, (0,), 1, period, np.arange(n))]


def test_cheap_baby_steps_get_more_of_them_and_fewer_giants():
    terms = _dense_terms()
    plain = shared_splits(terms)
    assert bsgs_plan(terms)[0] == plain and not bsgs_plan(terms)[1]
    cheap, hoisted = bsgs_plan(terms, weights=lambda lv: (0.25, 0.5, 0.3))
    assert hoisted == {((0,), 1)}
    assert cheap[0, 64][1] > plain[0, 64][1]          # more baby steps
    # hoisting that costs more than it saves is not chosen, and the split is the plain one
    dear, none = bsgs_plan(terms, weights=lambda lv: (1.0, 5.0, 1.0))
    assert not none and dear == plain


def _token_model():
    """A patch embedding, a Mu-Layer, a flattened head: its maps rotate where the server applies
    the first ones (compiled so below; by the client, the server would only multiply)."""
    torch.manual_seed(0)

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            import polynets as pn
            self.embed = pn.PatchEmbed(8, 2, 1, 8)
            self.mu = pn.MuLayer(8)
            self.head = torch.nn.Linear(8 * 16, 10)

        def forward(self, x):
            t = self.embed(x)
            return self.head((t + self.mu(t)).flatten(1))

    return Tokens().eval()


@pytest.fixture(scope="module")
def token_program():
    x = torch.rand(16, 1, 8, 8)
    prog = he.compile(_token_model(), x[:1], calibration=x, packing="vector", first_map="server")
    return prog, x


def test_a_hoisted_plan_runs_within_its_promise_and_so_does_seal_on_it(token_program,
                                                                       monkeypatch):
    prog, x = token_program
    counts = prog.plan.predicted["counts"]
    assert counts["rotate_hoisted"] > 0 and counts["decompose"] > 0 and counts["mod_down"] > 0
    assert "hoisted baby steps" in prog.summary()
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(prog, public)
    assert server.hoist_note == "" and server.engine.hoister is not None
    xs = x[:2].numpy()
    request = client.encrypt(xs).to_bytes()
    sim = prog.simulate(xs)
    assert np.abs(client.decrypt(server.run(request).to_bytes()) - sim).max() \
        <= prog.params.expected_error
    # the same program with SEAL rotating every baby step (the environment says so)
    monkeypatch.setenv(ENV_NO_HOISTING, "1")
    plain = he.Server(prog, public)
    assert plain.engine.hoister is None and ENV_NO_HOISTING in plain.hoist_note
    assert np.abs(client.decrypt(plain.run(request).to_bytes()) - sim).max() \
        <= prog.params.expected_error


def test_a_saved_hoisted_program_rebuilds_the_same_plan(token_program, tmp_path):
    prog, _ = token_program
    path = tmp_path / "prog.pnhe"
    prog.save(path)
    again = he.load_program(path)
    assert again.plan.hoisted_sources == prog.plan.hoisted_sources
    assert again.plan.op_counts() == prog.plan.op_counts()


def test_a_program_compiled_without_hoisting_hoists_nothing(monkeypatch):
    monkeypatch.setenv(ENV_NO_HOISTING, "1")
    x = torch.rand(8, 1, 8, 8)
    prog = he.compile(_token_model(), x[:1], calibration=x, packing="vector", first_map="server")
    assert "hoist" not in prog.options and not prog.plan.hoisted_sources
    assert prog.plan.predicted["counts"].get("rotate_hoisted", 0) == 0


@pytest.mark.parametrize("bad", [{"0": [1.0, 2.0]}, {"0": [0.0, 1.0, 1.0]}, [1, 2, 3],
                                 {"0": ["a", 1.0, 1.0]}])
def test_bad_hoisting_prices_in_a_program_are_refused(bad):
    from he.compiler import _stored_weights
    with pytest.raises(ValueError, match="hoist must map levels to three positive prices"):
        _stored_weights(bad)


def test_cost_tables_without_hoisted_primitives_price_them_as_parts_of_others():
    from he.costmodel import _DERIVED_PART, HOISTED_PRIMITIVES, CostModel, shipped_model
    shipped = shipped_model()
    assert not shipped.derived.get(8192, frozenset()) & set(HOISTED_PRIMITIVES)
    old = shipped.to_dict()
    for ops in old["table"].values():
        for op in HOISTED_PRIMITIVES:
            ops.pop(op)
    model = CostModel.from_dict(old)
    for op in HOISTED_PRIMITIVES:
        like, part = _DERIVED_PART[op]
        assert op in model.derived[8192]
        assert model.seconds(op, 8192, 3) == pytest.approx(part * model.seconds(like, 8192, 3))
    assert model.seconds("rotate_hoisted", 8192, 3) < model.seconds("rotate", 8192, 3)


def test_tables_that_timed_extended_products_in_cache_price_them_as_parts_of_products():
    """A table that does not say its extended products were timed over distinct terms timed
    them from the caches: its own figure is set aside for a part of a plaintext product."""
    from he.costmodel import _DERIVED_PART, MUL_EXT_TIMED, CostModel, shipped_model
    shipped = shipped_model()
    d = shipped.to_dict()
    assert d["mul_ext_timed"] == MUL_EXT_TIMED
    assert "mul_ext" not in shipped.derived.get(8192, frozenset())
    del d["mul_ext_timed"]
    old = CostModel.from_dict(d)
    like, part = _DERIVED_PART["mul_ext"]
    assert "mul_ext" in old.derived[8192]
    assert old.seconds("mul_ext", 8192, 3) == pytest.approx(part * old.seconds(like, 8192, 3))
    assert old.seconds("rotate", 8192, 3) == pytest.approx(shipped.seconds("rotate", 8192, 3))
    # saved again, it says how its extended products are priced, and keeps pricing them so
    again = CostModel.from_dict(old.to_dict())
    assert again.seconds("mul_ext", 8192, 3) == pytest.approx(old.seconds("mul_ext", 8192, 3))


def test_a_measured_level_times_the_hoisted_primitives():
    import tenseal.sealapi as seal_api

    from he.costmodel import HOISTED_PRIMITIVES, _time_level, _tools
    ctx, tools = _tools(8192, 2)
    assert tools.hoister is not None
    values = np.linspace(-1, 1, 4096).tolist()
    got = _time_level(seal_api, tools, ctx.first_context_data().parms_id(), values, 2, 2)
    assert all(got[op] > 0 for op in HOISTED_PRIMITIVES)


class _Recorded:
    """An evaluator whose calls of ``names`` record the addresses of their operands."""

    def __init__(self, inner, names):
        self._inner, self.calls = inner, {n: [] for n in names}

    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if name not in self.calls:
            return fn

        def recorded(*args):
            self.calls[name].append(tuple(a if isinstance(a, int) else id(a) for a in args))
            return fn(*args)
        return recorded


def test_primitives_are_timed_on_distinct_operands_larger_than_the_cache(monkeypatch):
    """A server's plaintexts, ciphertexts and Galois keys are distinct and together larger than
    the caches: each pass of a timed primitive reads operands of its own per call, its
    rotations by every key made, a giant step's products in sums of distinct terms."""
    import tenseal.sealapi as seal_api

    from he import costmodel as cm
    ring, limbs = 8192, 2
    ctx, tools = cm._tools(ring, limbs, cm.rotation_keys(ring, limbs))
    assert len(tools.steps) == cm.rotation_keys(ring, limbs) > 1
    ev = _Recorded(tools.evaluator, ("rotate_vector", "multiply_plain", "add"))
    tools = tools._replace(evaluator=ev)
    sums: list[list[int]] = []
    real = type(tools.hoister).product_sum

    def recorded(self, terms, pool=None):
        sums.append([a.ctypes.data for pt, ext in terms for a in (pt, ext.words)])
        return real(self, terms, pool)

    monkeypatch.setattr(type(tools.hoister), "product_sum", recorded)
    values = np.linspace(-1, 1, ring // 2).tolist()
    cm._time_level(seal_api, tools, ctx.first_context_data().parms_id(), values, 2, limbs)
    poly = 8 * ring * limbs
    rotations = ev.calls["rotate_vector"]
    n = cm.distinct_calls(4 * poly + cm.key_bytes(ring, limbs))
    # the first pass (untimed) and three timed ones, each through n inputs and every key
    assert len(rotations) == 4 * n
    assert len({r[0] for r in rotations[:n]}) == n
    assert {r[1] for r in rotations} == set(tools.steps)
    products = ev.calls["multiply_plain"]
    assert len({(p[0], p[1]) for p in products}) >= cm.distinct_calls(5 * poly)
    adds = ev.calls["add"][:cm.distinct_calls(6 * poly)]
    assert len({a[0] for a in adds}) == len(adds) == cm.distinct_calls(6 * poly)
    terms = cm.product_terms(ring, limbs)
    sizes = {len(s) // 2 for s in sums}
    assert sizes == {cm.SUM_TERMS[0], min(cm.SUM_TERMS[1], terms)}
    assert all(len(set(s)) == len(s) for s in sums)
    few = [s for s in sums if len(s) == 2 * cm.SUM_TERMS[0]][:terms // cm.SUM_TERMS[0]]
    assert len({a for s in few for a in s}) == 2 * cm.SUM_TERMS[0] * len(few)


def test_the_timed_operands_outgrow_the_cache_within_bounds():
    from he.costmodel import (OPERAND_SETS, distinct_calls, key_bytes, last_level_cache,
                              product_terms, rotation_keys)
    cache = 32 * 2 ** 20
    for ring, limbs in ((8192, 1), (8192, 4), (16384, 6), (32768, 12)):
        n = product_terms(ring, limbs, cache)
        term = 3 * ring * (limbs + 1) * 8
        assert OPERAND_SETS[0] <= n <= OPERAND_SETS[1]
        assert n * term >= 2 * cache or n == OPERAND_SETS[1]
        assert (n - 1) * term < 2 * cache or n == OPERAND_SETS[0]
        keys = rotation_keys(ring, limbs, cache)
        calls = distinct_calls(4 * 8 * ring * limbs + key_bytes(ring, limbs), cache)
        # enough keys to outgrow twice the cache (or every rotation timed), and no more
        assert keys * key_bytes(ring, limbs) >= 2 * cache or keys == calls
        assert (keys - 1) * key_bytes(ring, limbs) < 2 * cache or keys == 1
    assert product_terms(32768, 24, cache) == OPERAND_SETS[0]
    assert product_terms(4096, 1, 2 ** 40) == OPERAND_SETS[1]
    assert rotation_keys(32768, 24, cache) == 1
    # no cache to outgrow: the fewest operands (what the probe times)
    assert distinct_calls(1, 0) == OPERAND_SETS[0]
    assert last_level_cache() > 0


def test_a_decomposition_shared_among_threads_is_the_same(ckks):
    from he.native import Pool
    h = _hoister(ckks)
    one, two = h.decompose(ckks["ct"]), h.decompose(ckks["ct"], Pool(2))
    assert np.array_equal(one.digits, two.digits) and np.array_equal(one.c0, two.c0)


def test_many_primes_take_the_blocked_products_and_still_match_seal():
    """Six data primes: more digits than the register loop takes."""
    from he.hoist import _FEW_DIGITS
    ring = 8192
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(ring)
    parms.set_coeff_modulus(seal.CoeffModulus.Create(ring, [30] * 6 + [36]))
    ctx = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    keygen = seal.KeyGenerator(ctx)
    gk = seal.GaloisKeys()
    keygen.create_galois_keys([galois_element(s, ring) for s in (1, -1)], gk)
    pk = seal.PublicKey()
    keygen.create_public_key(pk)
    encoder, ev = seal.CKKSEncoder(ctx), seal.Evaluator(ctx)
    pt, ct = seal.Plaintext(), seal.Ciphertext()
    encoder.encode(np.linspace(-1, 1, ring // 2).tolist(), 2.0 ** 25, pt)
    seal.Encryptor(ctx, pk).encrypt(pt, ct)
    assert ct.coeff_modulus_size() > _FEW_DIGITS
    h, why = Hoister.validated(ctx, gk, ev, encoder, ct, 1)
    assert h is not None, why
    # the blocked loop's words do not depend on its block (one that does not divide the ring,
    # one word, the ring whole)
    d = h.decompose(ct)
    want = h.rotate_ext(d, -1).words
    for block in (7, 1, ring):
        h.block = block
        assert np.array_equal(h.rotate_ext(d, -1).words, want)


@pytest.mark.parametrize("block", [1, 5, 512, 4096 + 3])
def test_a_sums_words_do_not_depend_on_the_products_block(ckks, block):
    from he.hoist import PRODUCT_BLOCK
    h = _hoister(ckks)
    d = h.decompose(ckks["ct"])
    limbs = ckks["ct"].coeff_modulus_size()
    rng = np.random.default_rng(2)
    terms = [(h.extend_plain(ckks["encoder"], rng.uniform(-1, 1, ckks["ring"] // 2).tolist(),
                             2.0 ** 20, limbs), h.rotate_ext(d, s)) for s in STEPS]
    assert h.block == PRODUCT_BLOCK
    want = h.product_sum(terms).words
    h.block = block
    assert np.array_equal(h.product_sum(terms).words, want)


def test_a_rotation_shared_among_threads_is_the_hoisted_one(ckks):
    from he.fused import raw_access
    from he.native import Pool
    h = _hoister(ckks)
    for s in STEPS:
        one = h.rotate(h.decompose(ckks["ct"]), s)
        two = h.rotate_shared(ckks["ct"], s, Pool(2))
        assert np.array_equal(raw_access(one).view(one), raw_access(two).view(two))


def test_parameters_whose_noise_analysis_misses_baby_steps_are_planned_without_hoisting():
    """A first prime as wide as the special one (large values): a rotation at the scale is far
    noisier than the rescale the analysis prices it as, so no hoisted plan (which favours baby
    steps) is made, and the promise holds."""
    import dataclasses

    from he.compiler import hoisting_noise_covered
    from he.params import ROTATION_BITS

    torch.manual_seed(0)
    x = torch.randn(32, 5, dtype=torch.float64)

    class Square(torch.nn.Module):
        def forward(self, v):
            return v * v

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), Square()).double()
    with torch.no_grad():
        model[0].weight.mul_(3e4)
    prog = he.compile(model, x[:1], calibration=x, precision_bits=8)
    assert prog.params.special_margin < ROTATION_BITS and not hoisting_noise_covered(prog.params)
    assert "hoist" not in prog.options
    wide = dataclasses.replace(prog.params, coeff_mod_bit_sizes=(50, 27, 27, 60))
    assert hoisting_noise_covered(wide)
    client = he.Client(prog)
    got = client.decrypt(he.Server(prog, client.public_context()).run(client.encrypt(x[:4])))
    assert np.max(np.abs(got - model(x[:4]).detach().numpy())) <= prog.params.expected_error


def _handoff_model(seconds):
    """The shipped table with the hand-off of a shared rotation set to ``seconds`` per ring."""
    from dataclasses import replace

    from he.costmodel import shipped_model
    return replace(shipped_model(), shared={r: seconds for r in (8192, 16384, 32768)})


@pytest.mark.skipif(default_threads() < 2 or not native_platform(),
                    reason="a server shares work among threads on a native platform of 2 cores")
def test_work_that_runs_alone_is_shared_only_where_the_cost_model_finds_it_faster():
    from he.compiler import _predict_vector

    x = torch.rand(16, 1, 8, 8)
    progs = {h: he.compile(_token_model(), x[:1], calibration=x, packing="vector",
                           first_map="server", server_threads=2, cost_model=_handoff_model(h))
             for h in (0.0, 0.5)}
    free, dear = progs[0.0], progs[0.5]
    assert free.options["server_threads"] == 2 and free.plan.shares_rotations
    assert free.options["share_rotations"] is True and "shared among them" in free.plan.why
    assert not dear.plan.shares_rotations and dear.options["share_rotations"] is False
    # the choice is the cheaper prediction of the two
    costs = _handoff_model(0.0)
    shared = _predict_vector(free.plan, free.params, costs, 2)["seconds_per_ciphertext"]
    free.plan.shares_rotations = False
    apart = _predict_vector(free.plan, free.params, costs, 2)["seconds_per_ciphertext"]
    free.plan.shares_rotations = True
    assert shared < apart
    # a server does as its program says, and sharing changes no word of the result
    client = he.Client(free)
    public = client.public_context()
    request = client.encrypt(x[:2].numpy()).to_bytes()
    one, two = he.Server(free, public, threads=1), he.Server(free, public, threads=2)
    assert two.engine.share_rotations and two.engine.hoister is not None
    out = two.run(request).to_bytes()
    assert out == one.run(request).to_bytes()
    assert np.abs(client.decrypt(out) - free.simulate(x[:2].numpy())).max() \
        <= free.params.expected_error


def test_a_table_without_measured_hand_offs_never_shares():
    from he.costmodel import CostModel, shipped_model
    d = shipped_model().to_dict()
    assert CostModel.from_dict(d).shared_handoff(8192) > 0
    d.pop("shared_handoff_seconds")
    model = CostModel.from_dict(d)
    assert model.shared_handoff(8192) is None
    x = torch.rand(16, 1, 8, 8)
    prog = he.compile(_token_model(), x[:1], calibration=x, packing="vector",
                      first_map="server", server_threads=2, cost_model=model)
    assert not prog.plan.shares_rotations


@pytest.mark.parametrize("bad", [{"8192": -1e-3}, {"8192": 2.0}])
def test_bad_hand_offs_in_a_cost_table_are_refused(bad):
    from he.costmodel import CostModel, shipped_model
    d = shipped_model().to_dict()
    d["shared_handoff_seconds"] = bad
    with pytest.raises(ValueError, match="shared hand-off seconds"):
        CostModel.from_dict(d)


def test_hand_offs_scale_with_the_machine_and_survive_a_round_trip():
    from he.costmodel import CostModel
    model = _handoff_model(1e-3)
    assert model.scaled(2.0, "slower").shared_handoff(16384) == pytest.approx(2e-3)
    assert CostModel.from_dict(model.to_dict()).shared == model.shared


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_bad_sharing_choice_in_a_program_is_refused(bad):
    from he.compiler import _stored_share
    assert _stored_share({}) is True            # saved before the choice: shared
    with pytest.raises(ValueError, match="share_rotations must be a bool"):
        _stored_share({"share_rotations": bad})


def test_a_shared_item_costs_its_share_of_the_work_and_the_hand_off():
    from he.compiler import _threaded_seconds
    prices = {"decompose": 1.0, "rotate_hoisted": 0.25, "mod_down": 0.5, "mul_ext": 0.1,
              "rotate": 2.0, "rescale": 0.3, "add": 0.01}

    def price(counts):
        return sum(n * prices[op] for op, n in counts.items())

    c = {"decompose": 1, "rotate_hoisted": 4, "mul_ext": 4, "mod_down": 1, "rescale": 1,
         "add": 0, "baby_items": 4, "giant_items": 1, "giant_products": 4}
    apart = _threaded_seconds(c, price, 2, 1.0, handoff=0.2)
    shared = _threaded_seconds({**c, "alone": 0}, price, 2, 1.0, handoff=0.2)
    # the decomposition (1.0) and the single giant step (0.4 + 0.5) each: half, plus 0.2
    assert apart - shared == pytest.approx((1.0 - 0.7) + (0.9 - (0.45 + 0.2)))


@pytest.mark.skipif(default_threads() < 2, reason="no threads to hand work to")
def test_a_measured_hand_off_is_a_few_milliseconds_at_most():
    from he.costmodel import _shared_handoff
    assert 0.0 <= _shared_handoff(8192) < 0.1


def test_one_core_measures_no_hand_off(monkeypatch):
    import he.native
    from he.costmodel import _shared_handoff
    monkeypatch.setattr(he.native, "default_threads", lambda: 1)
    assert np.isnan(_shared_handoff(8192))
