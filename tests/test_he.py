"""Encrypted inference with real SEAL contexts: correctness in both packings, key separation,
parameter security and every error path of :mod:`he`."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tenseal.sealapi as seal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import he
import polynets as pn
from he.backend import build_context
from he.params import MAX_MODULUS_BITS
from _models import Square


def _bn_eval(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Give BatchNorm layers non-trivial running statistics, then switch to eval mode."""
    model.train()
    with torch.no_grad():
        model(x)
    return model.eval()


def _roundtrip(model: nn.Module, x: torch.Tensor, packing: str, **kw) -> tuple:
    prog = he.compile(model, x, calibration=x, packing=packing, **kw)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    out = server.run(client.encrypt(x).to_bytes())
    y = client.decrypt(out.to_bytes())
    return prog, y


def _check_matches(model: nn.Module, x: torch.Tensor, packing: str, **kw) -> None:
    prog, y = _roundtrip(model, x, packing, **kw)
    with torch.no_grad():
        ref = model(x).double().numpy()
    sim = prog.simulate(x)
    assert y.shape == ref.shape
    float32_tol = 1e-4 * max(1.0, np.max(np.abs(ref)))
    assert np.max(np.abs(sim - ref)) < float32_tol
    assert np.max(np.abs(y - sim)) <= prog.params.expected_error
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + float32_tol


@pytest.fixture(scope="module")
def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
    return model, torch.randn(5, 6)


@pytest.fixture(scope="module")
def mlp_setup(mlp):
    model, x = mlp
    prog = he.compile(model, x, packing="batch")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    return prog, client, server, x


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_user_mlp_with_square_decrypts_to_model_output(mlp, packing):
    _check_matches(*mlp, packing)


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_mulayer_decrypts_to_model_output(packing):
    torch.manual_seed(1)
    model = pn.MuLayer(4, 3, hidden=4).eval()
    _check_matches(model, torch.randn(3, 2, 2, 4), packing)


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_polyblock_with_batchnorm_decrypts_to_model_output(packing):
    torch.manual_seed(2)
    x = torch.randn(8, 2, 2, 4)
    model = _bn_eval(pn.PolyBlock(4, expansion=1, shrinkage=2, norm="batch"), x)
    _check_matches(model, x[:3], packing)


@pytest.mark.parametrize("packing", ["batch", "vector"])
def test_linear_pom_decrypts_to_model_output(packing):
    torch.manual_seed(3)
    model = pn.PoM(4, degree=2, expand=1, activation="linear").eval()
    _check_matches(model, torch.randn(2, 3, 4), packing)


def test_small_monet_decrypts_to_model_output_in_batch_packing():
    torch.manual_seed(4)
    x = torch.rand(16, 1, 4, 4)
    model = _bn_eval(pn.MONet(img_size=4, in_chans=1, num_classes=3, patch_size=2, embed="patch",
                              embed_dim=4, depth=1, expansion=1, shrinkage=2, norm="batch"), x)
    _check_matches(model, x[:2], "batch")


@pytest.mark.slow
def test_small_monet_decrypts_to_model_output_in_vector_packing():
    torch.manual_seed(4)
    x = torch.rand(16, 1, 4, 4)
    model = _bn_eval(pn.MONet(img_size=4, in_chans=1, num_classes=3, patch_size=2, embed="patch",
                              embed_dim=4, depth=1, expansion=1, shrinkage=2, norm="batch"), x)
    _check_matches(model, x[:2], "vector")


def test_hand_built_program_compiles_without_a_model(hand_built_program):
    program, x = hand_built_program
    for packing in ("batch", "vector"):
        prog = he.compile(program, calibration=x, packing=packing)
        client = he.Client(prog)
        y = client.decrypt(he.Server(prog, client.public_context()).run(client.encrypt(x)))
        assert np.max(np.abs(y - program.simulate(x))) <= prog.params.expected_error



def test_compile_progress_bar_counts_the_candidates_and_changes_nothing(mlp, capsys):
    model, x = mlp
    quiet = he.compile(model, x, packing="auto")
    assert capsys.readouterr().err == ""
    shown = he.compile(model, x, packing="auto", progress=True)
    err = capsys.readouterr().err
    # one candidate per packing at least (vector, batch, tokens where it applies), each named
    assert "compile" in err and "vector, N=8192" in err and "batch, N=8192" in err
    assert shown.fingerprint == quiet.fingerprint

def test_vector_packing_generates_only_the_galois_keys_it_uses(mlp):
    model, x = mlp
    # the server's first map rotates (where the client applies it, this program rotates nothing)
    prog = he.compile(model, x, packing="vector", first_map="server")
    client = he.Client(prog)
    used = prog.plan.rotations()
    keys = he.Server(prog, client.public_context()).engine.galois_keys
    assert keys is not None and keys.size() == len(used)


def test_the_keys_a_server_uses_travel_seeded_and_load_to_working_keys(mlp):
    """Relinearisation and Galois keys leave the client in SEAL's seeded form (half the
    bytes of the keys the server loads them to), also from a reloaded secret context."""
    from he.container import unpack
    model, x = mlp
    prog = he.compile(model, x, packing="vector", first_map="server")
    client = he.Client(prog)
    again = he.Client.from_secret_context(prog, client.secret_context())
    assert again.public_context() == client.public_context()
    _, blobs = unpack(client.public_context(), "public-context", "context")
    server = he.Server(prog, client.public_context())
    for name, loaded in (("relin_keys", server.engine.relin_keys),
                         ("galois_keys", server.engine.galois_keys)):
        assert len(blobs[name][0]) < 0.6 * len(he.backend.save_object(loaded)), name
    y = again.decrypt(server.run(again.encrypt(x[:3])))
    assert np.max(np.abs(y - prog.simulate(x[:3]))) <= prog.params.expected_error


def test_server_and_public_context_hold_no_secret_key(mlp_setup):
    prog, client, server, x = mlp_setup
    public = client.public_context()
    secret_bytes = he.backend.save_object(client._secret_key)
    assert secret_bytes[32:96] not in public
    assert not any(hasattr(server, a) for a in ("_secret_key", "_decryptor"))
    with pytest.raises(he.SecretKeyError, match="cannot decrypt"):
        server.decrypt(server.run(client.encrypt(x)))


def test_server_refuses_a_context_with_the_secret_key(mlp_setup):
    prog, client, _, _ = mlp_setup
    with pytest.raises(he.SecretKeyError, match="secret key"):
        he.Server(prog, client.secret_context())


def test_client_restored_from_secret_context_decrypts(mlp_setup):
    prog, client, server, x = mlp_setup
    again = he.Client.from_secret_context(prog, client.secret_context())
    out = server.run(client.encrypt(x))
    assert np.allclose(again.decrypt(out), client.decrypt(out), atol=1e-4)


def test_ciphertext_from_another_key_set_is_refused(mlp_setup):
    prog, client, server, x = mlp_setup
    other = he.Client(prog)
    with pytest.raises(he.KeyMismatchError, match="key set"):
        server.run(other.encrypt(x))
    with pytest.raises(he.KeyMismatchError, match="key set"):
        other.decrypt(server.run(client.encrypt(x)))


def test_context_of_another_program_is_refused(mlp, mlp_setup):
    model, x = mlp
    prog, client, _, _ = mlp_setup
    prog2 = he.compile(model, x * 3, packing="batch")
    with pytest.raises(he.KeyMismatchError, match="compiled program"):
        he.Server(prog2, client.public_context())


def test_wrong_input_shape_names_the_expected_shape(mlp_setup):
    _, client, _, _ = mlp_setup
    with pytest.raises(he.InputShapeError, match=r"\(B, 6,\)"):
        client.encrypt(np.zeros((2, 5)))


@pytest.mark.parametrize("bad", ["hello", [[1.0, "a", 2.0, 3.0, 4.0, 5.0]], {"x": 1}])
def test_an_input_that_is_not_numbers_is_refused_with_the_expected_shape(mlp_setup, bad):
    _, client, _, _ = mlp_setup
    with pytest.raises(he.InputShapeError, match=r"batch of real numbers of shape \(B, 6,\)"):
        client.encrypt(bad)


@pytest.mark.parametrize("mangle", [lambda b: b[: len(b) // 2], lambda b: b"garbage" * 20,
                                    lambda b: b[:9] + b"\xff" * 40 + b[49:],
                                    lambda b: b[:-5000] + bytes(5000)])
def test_garbage_or_truncated_ciphertext_raises_serialization_error(mlp_setup, mangle):
    _, client, server, x = mlp_setup
    data = client.encrypt(x).to_bytes()
    with pytest.raises(he.SerializationError):
        server.run(mangle(data))


def test_garbage_context_and_program_bytes_raise_serialization_error(mlp_setup):
    prog, client, _, _ = mlp_setup
    public = client.public_context()
    with pytest.raises(he.SerializationError):
        he.Server(prog, public[:100])
    with pytest.raises(he.SerializationError):
        he.CompiledProgram.from_bytes(prog.to_bytes()[:-10])
    with pytest.raises(he.SerializationError):
        he.CompiledProgram.from_bytes(b"PNHE\x01garbage")


def test_compiled_program_round_trips_through_a_file(mlp_setup, tmp_path):
    prog, client, server, x = mlp_setup
    path = tmp_path / "model.he"
    prog.save(path)
    loaded = he.load_program(path)
    assert loaded.fingerprint == prog.fingerprint
    assert loaded.params == prog.params
    server2 = he.Server(loaded, client.public_context())
    y = client.decrypt(server2.run(client.encrypt(x)))
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error


def test_inputs_outside_the_calibrated_range_warn_with_precision_loss(mlp_setup):
    _, client, _, x = mlp_setup
    with pytest.warns(he.CalibrationRangeWarning, match="bits of precision"):
        client.encrypt(x * 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.encrypt(x)


def test_non_polynomial_model_is_refused_with_module_path():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    with pytest.raises(he.NotEncryptableError, match=r"1 \(GELU\)") as info:
        he.compile(model, torch.randn(2, 4))
    assert info.value.certificate is not None and not info.value.certificate.is_polynomial


def test_too_deep_program_reports_levels_needed_and_supported():
    layers: list[nn.Module] = []
    for _ in range(40):
        layers += [nn.Linear(2, 2), Square()]
    with pytest.raises(he.TooDeepError, match="needs 80 multiplicative levels") as info:
        he.compile(nn.Sequential(*layers).eval(), torch.randn(2, 2) * 0.1, packing="batch")
    assert info.value.levels_needed == 80 and 0 < info.value.levels_supported < 80


def test_chosen_parameters_are_accepted_by_seal_at_128_bit_security(mlp_setup):
    prog = mlp_setup[0]
    p = prog.params
    assert p.total_bits <= MAX_MODULUS_BITS[p.poly_modulus_degree]
    assert build_context(p).parameters_set()
    assert "levels" in p.why and str(p.poly_modulus_degree) in str(p)


def test_seal_refuses_an_insecure_parameter_set():
    enc = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    enc.set_poly_modulus_degree(8192)
    enc.set_coeff_modulus(seal.CoeffModulus.Create(8192, [60, 60, 60, 60]))   # 240 > 218 bits
    assert not seal.SEALContext(enc, True, seal.SEC_LEVEL_TYPE.TC128).parameters_set()
    with pytest.raises(he.ParameterError, match="128-bit"):
        he.CKKSParams(8192, (60, 60, 60, 60), 40, 2, 128, 0.0, 1.0, "").check()


def test_report_compares_model_simulation_and_decryption(mlp_setup, mlp):
    prog, client, server, x = mlp_setup
    model = mlp[0]
    labels = model(x).argmax(1).numpy()
    rep = he.report(model, prog, client, server, x, y_true=labels)
    assert rep.argmax_agreement == 1.0 and rep.acc_plain == 1.0 == rep.acc_enc
    assert rep.max_err_enc_sim <= prog.params.expected_error
    assert "accuracy drop report" in str(rep)


def test_cli_client_and_server_talk_through_files(mlp_setup, tmp_path, capsys):
    from polynets.cli import main

    prog, _, _, x = mlp_setup
    prog.save(tmp_path / "m.he")
    np.save(tmp_path / "x.npy", x.numpy())
    keys = str(tmp_path / "keys")
    assert main(["encrypt", str(tmp_path / "m.he"), str(tmp_path / "x.npy"), "--keys", keys,
                 "-o", str(tmp_path / "x.ct"), "--workers", "2"]) == 0
    assert main(["run", str(tmp_path / "m.he"), str(tmp_path / "x.ct"), "--context",
                 f"{keys}/public.ctx", "-o", str(tmp_path / "y.ct"), "--workers", "2"]) == 0
    assert main(["decrypt", str(tmp_path / "m.he"), str(tmp_path / "y.ct"), "--keys", keys,
                 "-o", str(tmp_path / "y.npy")]) == 0
    y = np.load(tmp_path / "y.npy", allow_pickle=False)
    assert np.max(np.abs(y - prog.simulate(x))) <= prog.params.expected_error
    assert "predictions:" in capsys.readouterr().out
    assert main(["run", str(tmp_path / "m.he"), str(tmp_path / "x.ct"), "--context",
                 f"{keys}/secret.ctx", "-o", str(tmp_path / "z.ct")]) == 2


def test_demo_quick_runs_end_to_end():
    from he.demo import run_demo

    res = run_demo(quick=True, progress=False, echo=lambda *a: None)
    assert abs(res.acc_plain - res.acc_encrypted) <= 0.005 + 1e-9


def test_cli_compiles_a_checkpoint_to_a_program_file(tmp_path, capsys):
    from polynets.training.checkpoint import save_checkpoint
    from polynets.cli import main

    kwargs = {"img_size": 4, "in_chans": 1, "num_classes": 3, "patch_size": 2, "embed": "patch",
              "embed_dim": 4, "depth": 1, "expansion": 1, "shrinkage": 2, "norm": "batch"}
    model = pn.MONet(**kwargs)
    save_checkpoint(tmp_path / "m.pt", model=model, model_name="monet", model_kwargs=kwargs)
    x = np.random.default_rng(0).random((8, 1, 4, 4))
    np.save(tmp_path / "cal.npy", x)
    assert main(["compile", str(tmp_path / "m.pt"), "--calibration", str(tmp_path / "cal.npy"),
                 "--packing", "batch", "-o", str(tmp_path / "m.he")]) == 0
    prog = he.load_program(tmp_path / "m.he")
    with torch.no_grad():
        ref = model.eval()(torch.as_tensor(x, dtype=torch.float32)).double().numpy()
    assert np.allclose(prog.simulate(x), ref, atol=1e-4)
    assert "CKKS N=" in capsys.readouterr().out


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 4), hidden=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       packing=st.sampled_from(["batch", "vector"]))
def test_torch_simulation_and_decryption_agree_for_random_square_mlps(width, hidden, seed,
                                                                       packing):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, hidden), Square(), nn.Linear(hidden, 2)).eval()
    _check_matches(model, torch.randn(3, width), packing)


def test_missing_program_file_gives_a_clear_error(tmp_path):
    with pytest.raises(he.SerializationError,
                       match="compiled program .*missing.he' does not exist; write one with"):
        he.load_program(tmp_path / "missing.he")


def test_fork_map_runs_tasks_in_worker_processes_in_order():
    import os

    from he.parallel import fork_map
    out = fork_map(lambda i: (i * i, os.getpid()), 6, 2)
    assert [r[0] for r in out] == [i * i for i in range(6)]
    assert os.getpid() not in {r[1] for r in out}
    assert fork_map(lambda i: os.getpid(), 3, 1) == [os.getpid()] * 3


def test_seeded_input_ciphertexts_are_about_half_a_full_one(mlp_setup):
    prog, client, _, x = mlp_setup
    blob = client.encrypt(x)._groups[0][0]
    pt = client.engine.encode_vector(np.zeros(client.engine.slots), 0, client.engine.scales[0])
    full = seal.Ciphertext()
    client._encryptor.encrypt_symmetric(pt, full)
    assert len(blob) < 0.6 * len(he.backend.save_object(full))


def test_parallel_server_decrypts_to_the_serial_results(mlp, mlp_setup):
    model, _ = mlp
    prog, client, server, _ = mlp_setup
    x = torch.rand(prog.params.slots + 7, 6) * 1.8 - 0.9
    ct = client.encrypt(x)
    assert len(ct._groups) == 2
    serial = client.decrypt(server.run(ct))
    parallel = client.decrypt(server.run(ct.to_bytes(), workers=2))
    assert np.array_equal(serial, parallel)
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.max(np.abs(parallel - ref)) <= prog.params.expected_error + 1e-4


def test_parallel_encryption_decrypts_to_the_same_values(mlp_setup):
    prog, client, server, _ = mlp_setup
    x = torch.rand(prog.params.slots + 3, 6) * 1.8 - 0.9
    serial, parallel = client.encrypt(x), client.encrypt(x, workers=2)
    assert [len(g) for g in parallel._groups] == [len(g) for g in serial._groups]
    y1 = client.decrypt(server.run(serial))
    y2 = client.decrypt(server.run(parallel, workers=2))
    assert np.max(np.abs(y1 - y2)) <= 2 * prog.params.expected_error


def test_parallel_vector_packing_matches_serial(mlp):
    model, x = mlp
    prog = he.compile(model, x, calibration=x, packing="vector")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x, workers=2)
    assert np.array_equal(client.decrypt(server.run(ct)), client.decrypt(server.run(ct,
                                                                                     workers=2)))


def test_a_corrupt_group_fails_the_same_way_in_a_worker(mlp_setup):
    prog, client, server, _ = mlp_setup
    ct = client.encrypt(np.zeros((prog.params.slots + 1, 6)))
    ct._groups[1][2] = ct._groups[1][2][:40] + bytes(len(ct._groups[1][2]) - 40)
    with pytest.raises(he.SerializationError, match="ciphertext part 1.2"):
        server.run(ct, workers=2)


def test_batch_packing_sends_only_the_inputs_that_reach_the_output():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 2, 2, stride=3), Square(), nn.Flatten(),
                          nn.Linear(8, 3)).eval()
    x = torch.rand(4, 1, 7, 7)
    prog = he.compile(model, x, calibration=x, packing="batch")
    jac = torch.autograd.functional.jacobian(lambda v: model(v).square().sum(), x[:1])
    assert np.array_equal(prog.batch_inputs, np.flatnonzero(jac.abs().numpy() > 0))
    assert prog.batch_inputs.size == 16
    client = he.Client(prog)
    ct = client.encrypt(x)
    assert [len(g) for g in ct._groups] == [16]
    y = client.decrypt(he.Server(prog, client.public_context()).run(ct.to_bytes()))
    with torch.no_grad():
        ref = model(x).double().numpy()
    assert np.max(np.abs(y - ref)) <= prog.params.expected_error + 1e-4


def test_an_input_with_only_zero_weights_is_not_encrypted(mlp):
    _, x = mlp
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
    with torch.no_grad():
        model[0].weight[:, 4] = 0.0
    prog = he.compile(model, x, calibration=x, packing="batch")
    assert prog.batch_inputs.tolist() == [0, 1, 2, 3, 5]
    _check_matches(model, x, "batch")


def test_memory_workers_fit_the_processes_to_the_memory():
    from he.parallel import memory_workers
    gib = 2 ** 30
    assert memory_workers(2, 5, 1 * gib, 8 * gib) == 2
    assert memory_workers(4, 2, 1 * gib, 8 * gib) == 2            # never more than the tasks
    assert memory_workers(0, 5, 3 * gib, 8 * gib) <= 2            # left to choose: what fits
    assert memory_workers(3, 5, None, 1) == 3                     # no prediction: no limit
    with pytest.raises(he.ResourceError, match="at most 2 fit"):
        memory_workers(3, 5, 3 * gib, 8 * gib)                    # asked for more than fit
    with pytest.raises(he.ResourceError, match="12.0 GiB .* more than the 8.0 GiB"):
        memory_workers(1, 1, 12 * gib, 8 * gib)
    for bad in (-2, 1.5, True, "2"):
        with pytest.raises(he.ParameterError, match="workers must be a non-negative int"):
            memory_workers(bad, 5, None, 1)


def test_a_batch_server_refuses_a_group_larger_than_the_memory_before_running(mlp_setup):
    prog, client, server, _ = mlp_setup
    assert 0 < prog.plan.predicted["working_memory_bytes"] < \
        prog.plan.predicted["server_memory_bytes"]
    ct = client.encrypt(np.zeros((2, 6)))
    # a server allowed less than a group needs, even in tiles
    short = he.Server(prog, client.public_context(), memory_budget=2 ** 20)
    with pytest.raises(he.ResourceError, match="batch-packed samples.*packing='vector'"):
        short.run(ct)
    assert client.decrypt(server.run(ct)).shape[0] == 2


def test_a_batch_server_counts_the_memory_seals_pool_kept_from_its_last_group(mlp_setup,
                                                                             monkeypatch):
    """SEAL's pool keeps what a group allocated and serves the next group of the same
    parameters from it: a second request is not refused for memory the first one holds."""
    import he.client as he_client
    from he.runtime import pool_held

    prog, client, server, _ = mlp_setup
    ct = client.encrypt(np.zeros((2, 6)))
    working = prog.plan.predicted["working_memory_bytes"]
    server.run(ct)
    assert pool_held(server._pool_key) >= working
    other = (server._pool_key[0], server._pool_key[1] + (60,))
    assert pool_held(other) == 0                    # other parameters: other sizes
    # half a group free beside the pool's: enough for this server's next group
    monkeypatch.setattr(he_client, "available_memory", lambda: int(working // 2))
    assert client.decrypt(server.run(ct)).shape[0] == 2
    # ... but not where the server is allowed less than a group needs, pool included
    short = he.Server(prog, client.public_context(), memory_budget=int(working // 4))
    with pytest.raises(he.ResourceError, match="batch-packed samples"):
        short.run(ct)
