"""The noise analysis behind the promised output error: exact on small cases it can be checked by
hand, and a bound on the real CKKS error of deeper models."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import he
import polynets as pn
from he.noise import ROUNDING, noise_gain, step_values_msq
from he.params import noise_unit, primes_dropped
from polynets.ir.lowering import lower
from _models import Square


def _lowered(model: nn.Module, x: torch.Tensor):
    return lower(pn.trace(model.eval(), x[:1]))


def test_a_linear_map_sends_input_noise_through_its_row_norms():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(64, 5)
    low = _lowered(nn.Sequential(Square(), lin), x)
    msq = step_values_msq(low, x.numpy())
    g_in, g_rs = noise_gain(low, msq, "batch")
    # the square: each element's noise is 2 |x_j| (rms over the data) per unit of input noise
    rms = np.sqrt(np.mean(x.numpy() ** 2, axis=0))
    w = lin.weight.detach().numpy().astype(np.float64)
    want = np.sqrt(((w ** 2) @ (2 * rms) ** 2).max())
    assert np.isclose(g_in, want, rtol=1e-6)
    # one rescale after the square, one after the map, plus the weights' rounding
    assert g_rs >= np.sqrt(((w ** 2) @ np.ones(5)).max() + 1.0)


def test_a_product_of_two_branches_adds_their_noise_coherently():
    x = torch.full((8, 1), 3.0)
    low = _lowered(nn.Sequential(Square()), x)
    g_in, _ = noise_gain(low, step_values_msq(low, x.numpy()), "vector")
    assert np.isclose(g_in, 6.0)          # d(x^2) = 2 x dx, both factors carry the same noise


def test_the_promise_bounds_a_deep_monets_error_and_is_not_vacuous():
    """A degree-16 MONet: the decryption differs from the simulation by less than the promise,
    and the promise is within three orders of magnitude of it (the calibrated range of the
    output alone, as a worst-case bound would give, is far looser)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images[:256] / 16.0, dtype=torch.float32)[:, None]
    torch.manual_seed(0)
    model = pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=8, depth=2,
                     merges=0, norm="batch")
    model.train()
    with torch.no_grad():
        model(x)
    model.eval()
    prog = he.compile(model, x[:1], calibration=x, packing="vector", precision_bits=12)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:2]).to_bytes()).to_bytes())
    err = float(np.max(np.abs(got - prog.simulate(x[:2].numpy()))))
    assert err <= prog.params.expected_error
    assert err >= prog.params.expected_error * 1e-3


def _square_then_map():
    """A square, then a 6 -> 4 linear map: the map, the lowering, its values' mean squares on
    64 random inputs and the map's squared weights."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    x = torch.randn(64, 6)
    low = _lowered(nn.Sequential(Square(), lin), x)
    return lin, low, step_values_msq(low, x.numpy()), \
        lin.weight.detach().numpy().astype(np.float64) ** 2


def test_a_rotated_input_carries_key_switching_noise_in_vector_packing_only():
    """A rotation adds about one rescale's noise (measured): a weighted map in vector packing
    counts it on each input it rotates, batch packing (no rotations) does not, and a map reading
    a wide chain's pending level (the squared scale) does not either."""
    lin, low, msq, w2 = _square_then_map()
    _, vec = noise_gain(low, msq, "vector")
    # the map reads level 1 (after the square's rescale); as pending parity 1 it is squared
    _, pend = noise_gain(low, msq, "vector", (1, 1.0))
    assert vec ** 2 - pend ** 2 > 0.99 * (w2 @ np.ones(6)).max()
    assert vec > pend
    # a special prime no wider than the primes adds its key switching to the values a map
    # rotates at the scale, not to those at the squared scale
    _, noisy = noise_gain(low, msq, "vector", switching=13.0)
    rows = w2 @ np.ones(6)
    assert 0.99 * 13.0 * rows.min() <= noisy ** 2 - vec ** 2 <= 1.01 * 13.0 * rows.max()
    assert noise_gain(low, msq, "vector", (1, 1.0), switching=13.0) == \
        noise_gain(low, msq, "vector", (1, 1.0))
    assert noise_gain(low, msq, "batch", switching=13.0) == noise_gain(low, msq, "batch")


def test_a_wide_chain_counts_only_the_rescales_it_does():
    """On a wide chain only a product from a pending level rescales: the square from level 0
    (pending parity 1: level 0 is not pending) lands on the squared scale exactly, and the map
    from there rescales once, so the output's rescale noise is that one unit and the weights'
    rounding; one prime per level counts both rescales and the map's key switching."""
    lin, low, msq, w2 = _square_then_map()
    ones = (lin.weight.detach().numpy() != 0).astype(np.float64)
    rounding = ROUNDING["vector"] ** 2 * (ones @ msq[low.steps[-1].inputs[0]])
    _, wide = noise_gain(low, msq, "vector", (1, 1.0))
    assert np.isclose(wide ** 2, (1.0 + rounding).max(), rtol=1e-9)
    _, narrow = noise_gain(low, msq, "vector")
    assert np.isclose(narrow ** 2, (w2 @ np.full(6, 2.0) + 1.0 + rounding).max(), rtol=1e-9)
    # a lift into a pending level of the same prime is a product with 1: no rescale either
    assert [primes_dropped(lv, 1) for lv in range(4)] == [0, 0, 1, 1]
    assert [primes_dropped(lv, -1) for lv in range(4)] == [0, 1, 2, 3]


def test_encryption_and_rescale_noise_add_in_quadrature():
    """They are independent: the promise is the safety factor times the root of the sum of their
    squares, never more than their sum, and each alone gives its own term."""
    n, sb = 8192, 30
    fresh = noise_unit(n, sb, (1.0, 0.0))
    rescale = noise_unit(n, sb, (0.0, 1.0))
    both = noise_unit(n, sb, (3.0, 2.0))
    assert np.isclose(both, np.hypot(3.0 * fresh, 2.0 * rescale), rtol=1e-12)
    assert both < 3.0 * fresh + 2.0 * rescale


def test_folded_sums_keep_a_wide_heads_error_under_the_promise():
    """A head that sums 1,024 slots into 2 outputs folds its blocks 9 times: folded at the
    product's scale, before the one rescale, the sum adds one rescale's noise (folded after it,
    each fold's rotation and every block's rescale noise add up, about 30 times the promise's
    unit on such a head, and the error exceeded the promise)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), Square(), nn.Linear(1024, 2))
    # small inputs: the weights' rounding (which scales with them) does not hide the sum's noise
    x = 0.05 * torch.rand(16, 1, 32, 32)
    prog = he.compile(model, x[:1], calibration=x, packing="vector", samples_per_ciphertext=1,
                      ring_degree=8192, precision_bits=12)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    y = client.decrypt(server.run(client.encrypt(x[:4].numpy()).to_bytes()).to_bytes())
    err = np.max(np.abs(y - prog.simulate(x[:4].numpy())))
    assert err <= prog.params.expected_error


class _Pad(nn.Module):
    """Zero padding: in batch packing a selection, so no level, and its padded outputs are
    constants no input reaches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x, (0, 3))


class _Slice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :4]


def test_the_clients_fresh_encryption_is_as_quiet_as_the_promise_assumes():
    """The client encrypts with the secret key: a fresh ciphertext's noise grows as sqrt(N),
    within :data:`he.params._ENC_NOISE` of it, several times below a public-key encryption's
    (which grows as N), so a client that encrypted with the public key would break the
    promises."""
    import tenseal.sealapi as seal

    from he.params import _ENC_NOISE

    torch.manual_seed(0)
    x = torch.randn(4096, 5)
    prog = he.compile(_Pad(), x[:1], calibration=x, packing="batch")
    assert prog.params.levels == 0
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())
    n, scale = prog.params.poly_modulus_degree, client.engine.scales[0]
    fresh = (got[:, :5] - x.numpy()) * scale            # the inputs, returned as they came
    assert np.std(fresh) <= _ENC_NOISE * np.sqrt(n) / 1.3
    assert np.std(fresh) >= _ENC_NOISE * np.sqrt(n) / 3
    # the same plaintext under the public key
    eng = client.engine
    pt = eng.encode_vector(np.zeros(eng.slots), 0, scale)
    ct = seal.Ciphertext()
    seal.Encryptor(eng.context, client.public_key).encrypt(pt, ct)
    public = _decrypt_slots(client, ct) * scale
    assert np.std(public) >= 0.1 * n
    assert np.std(public) >= 4 * np.std(fresh)


def _decrypt_slots(client: he.Client, ct) -> np.ndarray:
    import tenseal.sealapi as seal

    out = seal.Plaintext()
    client._decryptor.decrypt(ct, out)
    return np.asarray(client.engine.encoder.decode_double(out))


def test_constant_outputs_the_server_encrypts_count_as_a_rescale():
    """In batch packing a constant output element is the server's encryption, with the public
    key (it holds no other): the analysis counts it as a rescale, and its error stays within the
    promise of a program that rescales nothing."""
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    low = _lowered(_Pad(), x)
    msq = step_values_msq(low, x.numpy())
    assert noise_gain(low, msq, "batch") == (1.0, 1.0)
    sliced = _lowered(_Slice(), x)                     # no constant output: no rescale
    assert noise_gain(sliced, step_values_msq(sliced, x.numpy()), "batch") == (1.0, 0.0)
    prog = he.compile(_Pad(), x[:1], calibration=x, packing="batch")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    got = client.decrypt(server.run(client.encrypt(x).to_bytes()).to_bytes())
    err = np.abs(got - prog.simulate(x.numpy()))
    assert err[:, 5:].max() > 2 * err[:, :5].max()      # the public key's noise is the larger
    assert err.max() <= prog.params.expected_error
