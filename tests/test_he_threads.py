"""Threaded vector servers: SEAL's rotations called without the GIL (:mod:`he.native`) give the
same ciphertexts as ``tenseal.sealapi``'s, on real SEAL contexts, and are refused where SEAL would
raise."""

from __future__ import annotations

import os

import platform

import numpy as np
import pytest
import tenseal.sealapi as seal
import torch
from torch import nn

import he
import polynets as pn
from he.backend import save_object
from he.costmodel import CostModel, default_model
from he.hoist import ENV_NO_HOISTING
from he.native import NATIVE_PLATFORMS, NativeEvaluator, default_threads, native_platform

#: where the native path is attempted (and so must validate); elsewhere servers run on one core
native_only = pytest.mark.skipif(
    (platform.system(), platform.machine()) not in NATIVE_PLATFORMS,
    reason="SEAL's symbols are called natively on Linux x86-64 and aarch64 only")


def _token_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(pn.MuLayer(8, hidden=16, norm="batch"),
                          pn.MuLayer(8, hidden=16, norm="batch"), nn.Flatten(), nn.Linear(32, 3))
    x = torch.randn(64, 4, 8)
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval(), x


def _compiled(packing: str) -> tuple[nn.Module, torch.Tensor, he.CompiledProgram, he.Client,
                                      bytes]:
    model, x = _token_model()
    prog = he.compile(model, x[:1], calibration=x, packing=packing, server_threads=2)
    client = he.Client(prog)
    return model, x, prog, client, client.public_context()


@pytest.fixture(scope="module")
def setup():
    return _compiled("vector")


@native_only
def test_threaded_server_gives_the_same_ciphertext_as_one_thread(setup):
    model, x, prog, client, ctx = setup
    one = he.Server(prog, ctx, threads=1)
    two = he.Server(prog, ctx, threads=2)
    assert one.engine.native is None
    assert two.engine.native is not None, two.threads_note
    ct = client.encrypt(x[:1])
    out_one, out_two = one.run(ct), two.run(ct)
    assert out_one.to_bytes() == out_two.to_bytes()
    y = client.decrypt(out_two)
    with torch.no_grad():
        ref = model(x[:1]).double().numpy()
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4


class _TwoMapsOfTheInput(nn.Module):
    """Two convolutions of the input multiplied: two planes steps, independent of each other."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, stride=2)
        self.b = nn.Conv2d(1, 4, 3, stride=2)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.a(x) * self.b(x)).flatten(1))


@native_only
def test_planes_steps_run_at_once_and_are_priced_by_their_makespan(monkeypatch):
    from he.compiler import _makespan, _predict_vector, _threaded_seconds

    torch.manual_seed(5)
    model, x = _TwoMapsOfTheInput().eval(), torch.randn(32, 1, 8, 8)
    # rotations at SEAL's price, so that the first maps read the client's input planes (with
    # hoisted baby steps the cost model has them rotate the input instead)
    monkeypatch.setenv("POLYNETS_NO_HOISTING", "1")
    prog = he.compile(model, x[:1], calibration=x, packing="vector", server_threads=2,
                      first_map="server")
    monkeypatch.delenv("POLYNETS_NO_HOISTING")
    plan, params = prog.plan, prog.params
    early = plan.concurrent_planes()
    assert len(early) == 2 and all(plan.steps[si].kind == "planes" for si in early)
    client = he.Client(prog)
    ctx = client.public_context()
    ct = client.encrypt(x[:1])
    one, two = he.Server(prog, ctx, threads=1), he.Server(prog, ctx, threads=2)
    assert two.engine.native is not None, two.threads_note
    out = two.run(ct)
    assert out.to_bytes() == one.run(ct).to_bytes()
    with torch.no_grad():
        ref = model(x[:1]).double().numpy()
    assert np.max(np.abs(client.decrypt(out) - ref)) <= prog.params.expected_error
    # the prediction: their makespan on the threads in place of their sum
    costs = default_model()
    eff = costs.parallel_efficiency(params.poly_modulus_degree)
    counts = plan.op_counts()
    ring = params.poly_modulus_degree
    items = [_threaded_seconds(counts[si], lambda cs, lv=plan.runs_at(si): costs.price(
        cs, ring, params.limbs(lv)), 2, eff, costs.shared_handoff(ring) or 0.0) for si in early]
    at_once = _predict_vector(plan, params, costs, 2)["seconds_per_ciphertext"]
    monkeypatch.setattr(type(plan), "concurrent_planes", lambda self: [])
    in_turn = _predict_vector(plan, params, costs, 2)["seconds_per_ciphertext"]
    handoff = costs.map_handoff(ring)
    assert in_turn - at_once == pytest.approx(sum(items) - _makespan(items, 2, eff, handoff),
                                              rel=1e-9)
    assert _makespan(items, 2, eff, handoff) < sum(items)


@native_only
def test_threads_are_kept_only_where_the_cost_model_predicts_them_faster(setup):
    from he.compiler import MIN_THREAD_GAIN, _predict_vector

    model, x, prog, _, ctx = setup
    serial = he.compile(model, x[:1], calibration=x, packing="vector", server_threads=1)
    assert serial.plan.predicted["server_threads"] == 1
    assert serial.options["server_threads"] == 1
    costs = he.costmodel.default_model()
    one = _predict_vector(prog.plan, prog.params, costs, 1)["seconds_per_ciphertext"]
    two = _predict_vector(prog.plan, prog.params, costs, 2)["seconds_per_ciphertext"]
    kept = prog.options["server_threads"]
    assert kept == (2 if one / two >= MIN_THREAD_GAIN else 1)
    assert prog.plan.predicted["server_threads"] == kept
    assert prog.options["threads_why"] in prog.plan.why
    # the server runs on the compiler's choice unless told otherwise (or it times one thread
    # faster as it starts: test_a_vector_server_keeps_the_faster_of_its_threads_and_one)
    assert he.Server(prog, ctx, warm=False).engine.pool.threads == kept
    assert he.Server(prog, ctx, threads=2).engine.pool.threads == 2
    if kept == 2:
        assert "on 2 server threads" in str(prog)


@native_only
def test_native_rotation_refuses_what_seal_would_raise_on(setup):
    _, x, prog, client, ctx = setup
    server = he.Server(prog, ctx, threads=2)
    native = server.engine.native
    assert isinstance(native, NativeEvaluator) and native.ok
    eng = server.engine
    ct = server._encrypt_constant(0.25)
    step = prog.plan.galois_steps()[0]
    assert native.accepts_rotation(ct, step)
    assert save_object(native.rotate(ct, step)) == save_object(eng.rotate(ct, step))
    # a product before relinearisation has three polynomials: SEAL refuses to rotate it
    big = seal.Ciphertext()
    eng.evaluator.multiply(ct, ct, big)
    assert big.size() == 3 and not native.accepts_rotation(big, step)
    # no Galois key for this step
    missing = next(s for s in range(1, eng.slots) if s not in prog.plan.galois_steps())
    assert not native.accepts_rotation(ct, missing)
    # the engine falls back to SEAL's own call, which raises a Python exception
    eng.key_steps = None
    with pytest.raises(Exception):
        eng.rotate(big, step)
    # plaintext products: the same bytes as SEAL's; a zero plaintext (a transparent result), a
    # plaintext of another level and a product whose scale leaves the modulus are SEAL's
    pt = eng.encode_vector(np.linspace(-1, 1, eng.slots), 0, eng.plain_scales[0])
    assert native.accepts_product(ct, pt)
    expect = seal.Ciphertext()
    eng.evaluator.multiply_plain(ct, pt, expect)
    assert save_object(native.multiply_plain(ct, pt)) == save_object(expect)
    assert not native.accepts_product(ct, eng.encode_vector(np.zeros(eng.slots), 0, 2.0 ** 20))
    assert not native.accepts_product(ct, eng.encode_vector(np.ones(eng.slots), 1,
                                                            eng.plain_scales[1]))
    c = ct
    for _ in range(40):             # products without rescale until SEAL's scale bound
        ok = native.accepts_product(c, pt)
        out = seal.Ciphertext()
        try:
            eng.evaluator.multiply_plain(c, pt, out)
        except Exception:
            assert not ok
            break
        c = out
    else:
        pytest.fail("SEAL never refused the growing scale")


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts_are_refused(setup, threads):
    _, x, prog, _, ctx = setup
    with pytest.raises(he.HEError, match="threads"):
        he.Server(prog, ctx, threads=threads)
    model, _, _, _, _ = setup
    with pytest.raises(he.HEError, match="server_threads"):
        he.compile(model, x[:1], calibration=x, server_threads=threads)


def test_a_threaded_server_forked_into_worker_processes_finishes_and_agrees(setup):
    """Worker processes forked after the server's threads started inherit none of them: each
    starts its own, and the results are those of one process."""
    _, x, prog, client, ctx = setup
    server = he.Server(prog, ctx, threads=2)
    ct = client.encrypt(x[:3 * prog.plan.interleave])
    one = server.run(ct)                    # starts the pool's threads in this process
    two = server.run(ct, workers=2)
    assert np.array_equal(client.decrypt(one), client.decrypt(two))


def test_cost_tables_carry_the_parallel_efficiency_of_each_ring():
    from he.costmodel import DEFAULT_PARALLEL_EFFICIENCY, CostModel, default_model

    d = default_model().to_dict()
    d["parallel_efficiency"] = {"8192": 0.5, "32768": 0.9}
    model = CostModel.from_dict(d)
    assert model.parallel_efficiency(8192) == 0.5
    assert model.parallel_efficiency(16384) in (0.5, 0.9)
    assert model.parallel_efficiency(32768) == 0.9
    assert CostModel.from_dict(model.to_dict()).parallel == model.parallel
    d.pop("parallel_efficiency")
    assert CostModel.from_dict(d).parallel_efficiency(8192) == DEFAULT_PARALLEL_EFFICIENCY
    d["parallel_efficiency"] = {"8192": 1.5}
    with pytest.raises(ValueError, match="parallel"):
        CostModel.from_dict(d)
    d.pop("parallel_efficiency")
    d["client_parallel_efficiency"] = {"8192": 0.0}
    with pytest.raises(ValueError, match="client parallel"):
        CostModel.from_dict(d)
    d.pop("client_parallel_efficiency")
    # batch packing's threaded work has its own speed-up, the rotations' where none was read
    d["parallel_efficiency"] = {"8192": 0.7}
    d["batch_parallel_efficiency"] = {"8192": 0.9}
    model = CostModel.from_dict(d)
    assert model.batch_efficiency(8192) == 0.9 and model.parallel_efficiency(8192) == 0.7
    assert CostModel.from_dict(model.to_dict()).batch_parallel == {8192: 0.9}
    d.pop("batch_parallel_efficiency")
    assert CostModel.from_dict(d).batch_efficiency(8192) == 0.7
    d["batch_parallel_efficiency"] = {"8192": 0.0}
    with pytest.raises(ValueError, match="batch parallel"):
        CostModel.from_dict(d)


@pytest.mark.skipif(not native_platform() or default_threads() < 2,
                    reason="needs native encryption and two cores")
def test_calibration_times_a_clients_threads_themselves():
    from he.costmodel import _client_efficiency

    # the client's own work per ciphertext (encode, native encryption, serialise) on every core
    # against one: a speed-up per thread in (0, 1]; 0 would mean the native encryption did not
    # validate, and the floor of 0.1 that threads ran five times slower than one
    e = _client_efficiency(8192)
    assert 0.1 < e <= 1.0


@pytest.mark.skipif(not native_platform() or default_threads() < 2,
                    reason="needs native rescales and two cores")
def test_calibration_reads_batch_rescales_on_every_core():
    from he.costmodel import DEFAULT_PARALLEL_EFFICIENCY, _batch_efficiency

    # native rescales of real ciphertexts, each into its own buffer: a speed-up per thread in
    # (0.1, 1]; exactly the default would mean the native rescale did not validate
    e = _batch_efficiency(8192)
    assert 0.1 < e <= 1.0 and e != DEFAULT_PARALLEL_EFFICIENCY


def test_the_speed_up_per_thread_is_a_ratio_within_paired_rounds():
    import threading
    import time

    from he.costmodel import _speedup_per_thread

    # work that waits without holding anything runs two at once: a speed-up per thread of
    # about 1 (waits, not computation, so another process's load on the cores does not move it)
    assert _speedup_per_thread(lambda _: time.sleep(0.004), 2, rounds=3) > 0.8

    # work that holds a lock for all it does runs one at a time: two threads take as long as
    # one (about 0.5 per thread)
    lock = threading.Lock()

    def serialised(_: int) -> None:
        with lock:
            time.sleep(0.004)

    assert _speedup_per_thread(serialised, 2, rounds=3) < 0.65


def test_calibration_keeps_the_median_of_speed_ups_read_through_its_timings(monkeypatch):
    import he.costmodel as cm

    # a machine slowed for a moment: one reading of three is low; the table is timed for real
    readings = iter([0.3, 0.8, 0.9])
    monkeypatch.setattr(cm, "_parallel_efficiency", lambda ring: next(readings))
    monkeypatch.setattr(cm, "_client_efficiency", lambda ring: 0.6)
    batch = iter([0.95, 0.5, 0.9])
    monkeypatch.setattr(cm, "_batch_efficiency", lambda ring: next(batch))
    model = cm.measure(rings=(8192,))
    assert next(readings, None) is None          # read SPEEDUP_READINGS = 3 times
    assert next(batch, None) is None
    assert model.parallel_efficiency(8192) == pytest.approx(0.8)
    assert model.client_parallel[8192] == pytest.approx(0.6)
    assert model.batch_efficiency(8192) == pytest.approx(0.9)


@pytest.mark.parametrize("babies,giants", [(0, 0), (1, 1), (3, 7), (8, 8), (16, 3)])
def test_threads_shorten_a_step_by_its_rotation_rounds_and_never_lengthen_it(babies, giants):
    from he.compiler import _threaded_seconds

    c = {"rotate": babies + giants + 4, "mul_plain": 20, "add": 24, "rescale": 1,
         "plaintexts": 20, "babies": babies, "giants": giants}
    prices = {"rotate": 1.0, "mul_plain": 0.1, "add": 0.01, "rescale": 0.3}

    def price(counts):
        return sum(n * prices[op] for op, n in counts.items())

    serial = _threaded_seconds(c, price, 1, 0.9)
    assert serial == pytest.approx(price({k: v for k, v in c.items()
                                          if k in prices}))
    two = _threaded_seconds(c, price, 2, 0.9)
    assert two <= serial
    # pairs of rotations run at once, each at 0.9 of its speed; an odd one runs alone
    rounds = sum(n // 2 / 0.9 + n % 2 for n in (babies, giants))
    assert serial - two == pytest.approx(babies + giants - rounds)


def test_a_giant_steps_products_run_on_the_threads_with_its_rotation():
    from he.compiler import _threaded_seconds

    # 2 baby steps; 4 giant steps (one of no rotation) summing 8 products each: the products
    # and their additions are spread with the giant rotations, the folds and rescale are not
    c = {"rotate": 2 + 3 + 2, "mul_plain": 32, "add": 32 + 2, "rescale": 1, "plaintexts": 32,
         "babies": 2, "baby_items": 2, "giants": 3, "giant_items": 4, "giant_products": 32}
    prices = {"rotate": 1.0, "mul_plain": 0.1, "add": 0.01, "rescale": 0.3}

    def price(counts):
        return sum(n * prices[op] for op, n in counts.items())

    serial = _threaded_seconds(c, price, 1, 0.8)
    two = _threaded_seconds(c, price, 2, 0.8)
    giant = 3 * 1.0 + 32 * 0.1 + (32 - 4) * 0.01
    rest = serial - 2 * 1.0 - giant
    assert two == pytest.approx(rest + 2 * 1.0 * (1 / 0.8) / 2 + giant * (2 / 0.8) / 4)
    # the same counts without the giant steps' products priced on the threads save less
    old = {k: v for k, v in c.items() if k not in ("giant_items", "giant_products",
                                                   "baby_items")}
    assert two < _threaded_seconds(old, price, 2, 0.8) < serial
    # where the giant step of no rotation is known, the threads wait for the three that rotate:
    # two at once (each at 0.8 of its speed), then the third with the short one, then alone
    uneven = {**c, "giant_zero": 1, "giant_zero_products": 8}
    g = 1.0 + 8 * 0.1 + 7 * 0.01
    short = 8 * 0.1 + 7 * 0.01
    assert _threaded_seconds(uneven, price, 2, 0.8) == pytest.approx(
        rest + 1.0 / 0.8 + g / 0.8 + short / 0.8 + (g - short))
    assert _threaded_seconds(uneven, price, 2, 0.8) > two


def test_the_makespan_of_items_on_threads():
    from he.compiler import _makespan

    assert _makespan([], 2, 0.9) == 0.0
    assert _makespan([3.0], 2, 0.5) == 3.0                  # alone: full speed
    assert _makespan([1.0, 1.0], 2, 0.5) == pytest.approx(2.0)
    assert _makespan([1.0, 1.0], 1, 0.5) == pytest.approx(2.0)
    # longest first: 4 and 1 start, 1 ends, 2 joins 4, then 4 finishes alone
    assert _makespan([1.0, 2.0, 4.0], 2, 0.5) == pytest.approx(1 / 0.5 + 2 / 0.5 + 1.0)
    assert _makespan([1.0] * 4, 4, 1.0) == pytest.approx(1.0)


def _scaling_model() -> CostModel:
    """The shipped table with threads that share the work perfectly: the compiler keeps two."""
    from dataclasses import replace

    from he.costmodel import shipped_model
    return replace(shipped_model(), parallel={r: 1.0 for r in (8192, 16384, 32768)})


@native_only
@pytest.mark.skipif(default_threads() < 2, reason="times two threads against one")
def test_a_vector_server_keeps_the_faster_of_its_threads_and_one():
    """As it starts, a server on the compiler's two threads times a request on them and on one
    thread and keeps the faster; its outputs are those of a one-thread server, its prediction
    is the cost model's for the threads it kept, and threads the caller asks for are kept."""
    from he.client import THREAD_TRIAL_ROUNDS

    model, x = _token_model()
    prog = he.compile(model, x[:1], calibration=x, packing="vector", server_threads=2,
                      cost_model=_scaling_model())
    assert prog.server_threads == 2
    one_s = prog.options["predicted_one_thread_s"]
    assert one_s > prog.plan.predicted["seconds_per_ciphertext"]
    client = he.Client(prog)
    ctx = client.public_context()
    server = he.Server(prog, ctx)
    assert set(server.threads_trial) == {1, 2} and server.warm_seconds > 0
    faster = min(server.threads_trial, key=lambda n: (server.threads_trial[n], -n))
    assert server.engine.pool.threads == faster
    assert f"median of {THREAD_TRIAL_ROUNDS}" in server.threads_why
    assert server.predicted_seconds == (
        one_s if faster == 1 else prog.plan.predicted["seconds_per_ciphertext"])
    ct = client.encrypt(x[:2])
    one = he.Server(prog, ctx, threads=1)
    assert server.run(ct).to_bytes() == one.run(ct).to_bytes()
    # asked for, or not warmed: nothing timed, the threads as given
    for asked in (he.Server(prog, ctx, threads=2), he.Server(prog, ctx, warm=False)):
        assert asked.threads_trial == {} and asked.engine.pool.threads == 2
        assert asked.predicted_seconds == prog.plan.predicted["seconds_per_ciphertext"]
    assert one.threads_trial == {} and "as asked" in one.threads_why
    assert one.predicted_seconds == one_s


@pytest.mark.parametrize("bad", ["fast", -1.0, 0, True, [1.0]])
def test_a_program_file_with_a_bad_one_thread_prediction_is_refused(setup, bad):
    _, _, prog, _, _ = setup
    other = he.CompiledProgram.from_bytes(prog.to_bytes())
    other.options["predicted_one_thread_s"] = bad
    with pytest.raises(he.SerializationError, match="predicted_one_thread_s"):
        he.CompiledProgram.from_bytes(other.to_bytes())


@pytest.mark.parametrize("bad", [0, -3, "many", 1.5, True, None])
def test_a_program_file_with_a_bad_thread_count_is_refused(setup, bad):
    _, _, prog, _, _ = setup
    other = he.CompiledProgram.from_bytes(prog.to_bytes())
    other.options["server_threads"] = bad
    with pytest.raises(he.SerializationError):
        he.CompiledProgram.from_bytes(other.to_bytes())


@pytest.fixture(scope="module")
def batch_setup():
    return _compiled("batch")


@native_only
def test_threaded_batch_server_gives_the_same_ciphertexts_as_one_thread(batch_setup):
    """A group's products, relinearisations and rescales on two threads (SEAL called without
    the GIL): byte-identical outputs, also with the group split between two processes."""
    model, x, prog, client, ctx = batch_setup
    one = he.Server(prog, ctx, threads=1)
    two = he.Server(prog, ctx, threads=2)
    assert one.engine.native is None
    assert two.engine.native is not None, two.threads_note
    assert two.engine.pool.threads == 2
    ct = client.encrypt(x)
    out_one, out_two = one.run(ct), two.run(ct)
    assert out_one.to_bytes() == out_two.to_bytes()
    y = client.decrypt(out_two)
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error
    # two groups in two processes: each process on one of the two threads, same results
    ct2 = client.encrypt(torch.cat([x] * (prog.params.slots // len(x) + 1))[:prog.params.slots + 3])
    assert np.array_equal(client.decrypt(two.run(ct2, workers=2)),
                          client.decrypt(one.run(ct2)))
    assert two.engine.pool.threads == 2


@native_only
def test_batch_threads_are_priced_and_kept_only_where_predicted_faster(batch_setup):
    from he.compiler import MIN_THREAD_GAIN, _predict_batch
    from he.runtime import live_rows

    model, x, prog, _, ctx = batch_setup
    costs = he.costmodel.default_model()
    live = live_rows(prog.lowered)
    fanin = prog.options["fused_fanin"]
    lazy = prog.options.get("lazy_products", ())
    one = _predict_batch(prog.lowered, live, prog.params, costs, fanin, 1, lazy=lazy)
    two = _predict_batch(prog.lowered, live, prog.params, costs, fanin, 2, lazy=lazy)
    # only the products and rescales are divided among the threads
    assert one["counts"] == two["counts"]
    assert one["seconds_per_ciphertext"] > two["seconds_per_ciphertext"] > \
        one["seconds_per_ciphertext"] / 2
    kept = prog.options["server_threads"]
    gain = one["seconds_per_ciphertext"] / two["seconds_per_ciphertext"]
    assert kept == (2 if gain >= MIN_THREAD_GAIN else 1)
    assert prog.plan.predicted["server_threads"] == kept
    assert prog.options["threads_why"] in prog.plan.why
    assert he.Server(prog, ctx).engine.pool.threads == kept
    # the same lowering (on one thread the client map may be priced the other way)
    serial = he.compile(model, x[:1], calibration=x, packing="batch", server_threads=1,
                        final_map="client" if prog.options.get("client_map") else "server")
    assert serial.options["server_threads"] == 1
    assert serial.plan.predicted["seconds_per_ciphertext"] == \
        pytest.approx(one["seconds_per_ciphertext"])
    # the threaded part runs at batch packing's own speed-up per thread, not the rotations'
    d = costs.to_dict()
    ring = str(prog.params.poly_modulus_degree)
    d["parallel_efficiency"] = {ring: 0.5}
    times = {}
    for eff in (0.5, 1.0):
        d["batch_parallel_efficiency"] = {ring: eff}
        c = he.costmodel.CostModel.from_dict(d)
        s1, s2 = (_predict_batch(prog.lowered, live, prog.params, c, fanin, t, lazy=lazy)
                  ["seconds_per_ciphertext"] for t in (1, 2))
        times[eff] = (s1, s2)
    assert times[0.5][0] == pytest.approx(times[1.0][0])      # one thread: no speed-up
    # 2 threads x 0.5: as one; 2 x 1.0: faster, whatever the rotations' 0.5
    assert times[0.5][1] == pytest.approx(times[0.5][0], rel=1e-9)
    assert times[1.0][1] < times[0.5][1]


@native_only
def test_native_products_and_rescales_refuse_what_seal_would_raise_on(batch_setup):
    _, _, prog, _, ctx = batch_setup
    server = he.Server(prog, ctx, threads=2)
    eng, native = server.engine, server.engine.native
    ct = server._encrypt_constant(0.5)
    other = server._encrypt_constant(-0.25)
    for b in (ct, other):                           # a square and a product: SEAL's bytes
        expect = seal.Ciphertext()
        if b is ct:
            eng.evaluator.square(ct, expect)
        else:
            eng.evaluator.multiply(ct, b, expect)
        eng.evaluator.relinearize_inplace(expect, eng.relin_keys)
        assert native.accepts_ct_product(ct, b)
        got = native.product(ct, b, seal.Ciphertext())
        assert save_object(got) == save_object(expect)
        assert native.accepts_rescale(got)
        into = seal.Ciphertext()
        eng.evaluator.rescale_to_next(expect, into)
        assert save_object(native.rescale(got, seal.Ciphertext())) == save_object(into)
    # three polynomials, another level, the chain's end: left to SEAL, which raises
    big = seal.Ciphertext()
    eng.evaluator.multiply(ct, ct, big)
    assert not native.accepts_ct_product(big, ct)
    low = eng.rescale(eng.mul_scalar(ct, 1.0))
    assert not native.accepts_ct_product(ct, low)
    c = ct
    while eng.chain(c) < prog.params.chain_index(prog.params.levels):
        c = eng.rescale(eng.mul_scalar(c, 1.0))
    assert not native.accepts_rescale(c)
    with pytest.raises(Exception):
        eng.evaluator.rescale_to_next_inplace(c)
    # products without rescale until SEAL's scale bound: refused before SEAL would raise
    c = ct
    for _ in range(40):
        ok = native.accepts_ct_product(c, c)
        out = seal.Ciphertext()
        try:
            eng.evaluator.square(c, out)
        except Exception:
            assert not ok
            break
        eng.evaluator.relinearize_inplace(out, eng.relin_keys)
        c = out
    else:
        pytest.fail("SEAL never refused the growing scale")


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def _planes_program(packing: str = "vector") -> tuple[nn.Module, torch.Tensor,
                                                       he.CompiledProgram]:
    """A convolution, squared: in vector packing the client feeds its first map from several
    input planes; in batch packing a group is one ciphertext per pixel."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), _Square(), nn.Flatten(),
                          nn.Linear(36, 3))
    x = torch.randn(16, 1, 8, 8)
    options: dict = {}
    if packing == "vector":
        # a client whose threads encrypt perfectly in parallel: the plan reads its planes from
        # several input ciphertexts (at this machine's measured speed-up it may pack them into
        # one, which leaves the threads nothing to share)
        d = default_model().to_dict()
        d["client_parallel_efficiency"] = {str(r): 1.0 for r in d["table"]}
        options = {"samples_per_ciphertext": 1, "cost_model": CostModel.from_dict(d),
                   "first_map": "server"}
    # rotations at SEAL's price: with hoisted baby steps the plan may rotate one input
    # ciphertext rather than read planes from several
    saved = os.environ.get(ENV_NO_HOISTING)
    os.environ[ENV_NO_HOISTING] = "1"
    try:
        prog = he.compile(model.eval(), x[:1], calibration=x, packing=packing, **options)
    finally:
        if saved is None:
            os.environ.pop(ENV_NO_HOISTING)
        else:
            os.environ[ENV_NO_HOISTING] = saved
    return model, x, prog


@native_only
@pytest.mark.parametrize("packing", ["vector", "batch"])
def test_a_client_encrypts_a_requests_ciphertexts_on_its_threads_to_the_same_values(packing):
    """Native secret-key encryption (GIL released, validated by decryption) on two threads
    gives ciphertexts that decrypt through the server to what one thread's do, within the
    promise of the model, and in the same seeded form."""
    model, x, prog = _planes_program(packing)
    if packing == "vector":
        assert len(prog.plan.input_layout) > 1
    one = he.Client(prog, threads=1)
    two = he.Client.from_secret_context(prog, one.secret_context(), threads=2)
    server = he.Server(prog, one.public_context())
    xs = x[:3]
    ct_one, ct_two = one.encrypt(xs), two.encrypt(xs)
    assert one._encryption_threads(3) == 1 and two._encryption_threads(3) == 2
    assert two._native is not None and two._native.ok, two._native and two._native.reason
    # fresh randomness, the same sizes (seeded form: half a ciphertext each)
    assert ct_one.to_bytes() != ct_two.to_bytes()
    assert len(ct_one.to_bytes()) == len(ct_two.to_bytes())
    with torch.no_grad():
        want = model(xs).double().numpy()
    promise = prog.params.expected_error
    for ct in (ct_one, ct_two):
        assert np.max(np.abs(one.decrypt(server.run(ct)) - want)) <= promise


@native_only
def test_native_encryption_refuses_what_seal_would_raise_on_and_needs_the_secret_key():
    from he.native import NativeEncryptor

    _, _, prog = _planes_program()
    client = he.Client(prog, threads=2)
    eng = client.engine
    probe = eng.encode_vector(np.linspace(-1.0, 1.0, eng.slots), 0, eng.scales[0])
    native = NativeEncryptor(eng.context, client._encryptor, client._decryptor, eng.encoder,
                             probe)
    assert native.ok, native.reason
    # a plaintext of another level's size, or not in NTT form, is refused before SEAL sees it
    lower = eng.encode_vector(np.ones(eng.slots), 1, eng.scales[1])
    assert native.accepts(lower)
    with pytest.raises(ValueError, match="NTT form"):
        native.encrypt(seal.Plaintext())
    # an encryptor without the secret key is found out by SEAL's own call, never natively
    public_only = seal.Encryptor(eng.context, client.public_key)
    refused = NativeEncryptor(eng.context, public_only, client._decryptor, eng.encoder, probe)
    assert not refused.ok and "secret key" in refused.reason


def test_client_threads_are_checked_and_the_round_trip_prices_them():
    _, _, prog = _planes_program()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(he.HEError, match="threads"):
            he.Client(prog, threads=bad)
    costs = default_model()
    ring, limbs = prog.params.poly_modulus_degree, prog.params.limbs(0)
    one = costs.client_seconds(6, ring, limbs, 1)
    # each input: its encoding, then its encryption and serialisation
    assert one == pytest.approx(6 * (costs.seconds("encode", ring, limbs)
                                     + costs.seconds("encrypt", ring, limbs)))
    # the speed-up the table measured for a client's threads, never below one thread
    d = costs.to_dict()
    for e in (0.7, 0.3, 1.0):
        d["client_parallel_efficiency"] = {str(ring): e}
        model = CostModel.from_dict(d)
        assert model.client_seconds(6, ring, limbs, 2) == pytest.approx(
            model.client_seconds(6, ring, limbs, 1) / max(1.0, 2 * e))
    # a table that measured none assumes no gain
    d.pop("client_parallel_efficiency")
    bare = CostModel.from_dict(d)
    assert bare.client_seconds(6, ring, limbs, 2) == bare.client_seconds(6, ring, limbs, 1)
    assert costs.client_seconds(1, ring, limbs, 8) == costs.client_seconds(1, ring, limbs, 1)


def test_handing_items_to_the_threads_costs_one_hand_off_per_map():
    from he.compiler import _makespan
    assert _makespan([1.0], 2, 0.8, 0.25) == pytest.approx(1.0)           # runs here
    assert _makespan([1.0, 1.0], 2, 0.8, 0.25) == pytest.approx(0.25 + 1.0 / 0.8)
    assert _makespan([1.0, 1.0], 1, 0.8, 0.25) == pytest.approx(2.0)      # one thread
