"""Ciphertexts as bytes (:mod:`he.wire`): the compact form loads to exactly what SEAL's own
serialisation loads to, its size is what the compiler predicts, and malformed bytes are refused
before SEAL sees them or by SEAL's own checks."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal.sealapi as seal

import he
from he import wire
from he.backend import load_object, save_object
from he.native import NativeEncryptor

_N = 4096
_CHAIN = [30, 20, 20, 30]


@pytest.fixture(scope="module")
def kit():
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(_N)
    parms.set_coeff_modulus(seal.CoeffModulus.Create(_N, _CHAIN))
    ctx = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    keygen = seal.KeyGenerator(ctx)
    secret = keygen.secret_key()
    public = seal.PublicKey()
    keygen.create_public_key(public)
    relin = seal.RelinKeys()
    keygen.create_relin_keys(relin)
    encoder = seal.CKKSEncoder(ctx)
    encryptor = seal.Encryptor(ctx, public, secret)
    decryptor = seal.Decryptor(ctx, secret)
    values = np.random.default_rng(0).uniform(-1, 1, _N // 2)
    plain = seal.Plaintext()
    encoder.encode(values.tolist(), 2.0 ** 20, plain)
    native = NativeEncryptor(ctx, encryptor, decryptor, encoder, plain)
    if not native.ok:
        pytest.skip(f"no native encryption here: {native.reason}")
    return dict(ctx=ctx, encoder=encoder, encryptor=encryptor, decryptor=decryptor,
                evaluator=seal.Evaluator(ctx), relin=relin, values=values, plain=plain,
                native=native)


def _decrypt(kit, ct) -> np.ndarray:
    out = seal.Plaintext()
    kit["decryptor"].decrypt(ct, out)
    return np.asarray(kit["encoder"].decode_double(out))


def _full(kit, level: int = 0, size: int = 2):
    ct = seal.Ciphertext()
    kit["encryptor"].encrypt(kit["plain"], ct)
    if size == 3:
        kit["evaluator"].square_inplace(ct)
    for _ in range(level):
        kit["evaluator"].mod_switch_to_next_inplace(ct)
    return ct


def test_a_seeded_encryption_loads_to_what_seals_own_bytes_load_to(kit):
    ct = kit["native"].encrypt(kit["plain"])
    blob = wire.dumps(ct)
    assert blob[:4] == b"PNCT"
    ours = wire.loads(kit["ctx"], blob, "seeded")
    theirs = load_object(seal.Ciphertext, kit["ctx"], save_object(ct), "seeded")
    # the same random half regenerated from the same seed: the same ciphertext, word for word
    assert save_object(ours) == save_object(theirs)
    assert np.abs(_decrypt(kit, ours) - kit["values"]).max() < 1e-3
    assert len(blob) == wire.ciphertext_bytes(_N, _CHAIN[:-1], 1)
    assert len(blob) < 0.6 * len(wire.dumps(_full(kit)))


@pytest.mark.parametrize("level,size", [(0, 2), (1, 2), (2, 2), (0, 3)])
def test_full_ciphertexts_round_trip_word_for_word(kit, level, size):
    ct = _full(kit, level, size)
    blob = wire.dumps(ct)
    back = wire.loads(kit["ctx"], blob, "full")
    assert save_object(back) == save_object(ct)
    assert len(blob) == wire.ciphertext_bytes(_N, _CHAIN[:len(_CHAIN) - 1 - level], size)


def test_seals_own_form_still_loads_and_is_written_where_words_are_hidden(kit):
    ct = _full(kit)
    assert save_object(wire.loads(kit["ctx"], save_object(ct), "seal")) == save_object(ct)
    # SEAL's Serializable wrapper hides the words: its own (seeded) form is written
    hidden = kit["encryptor"].encrypt_symmetric(kit["plain"])
    blob = wire.dumps(hidden)
    assert blob[:2] == b"\x5e\xa1"
    assert np.abs(_decrypt(kit, wire.loads(kit["ctx"], blob, "seal")) - kit["values"]).max() \
        < 1e-3


def _fields(blob: bytes) -> list:
    return list(wire._FIXED.unpack_from(blob))


def _with(blob: bytes, index: int, value) -> bytes:
    fields = _fields(blob)
    fields[index] = value
    return wire._FIXED.pack(*fields) + blob[wire._FIXED.size:]


@pytest.mark.parametrize("index,value,message", [
    (1, 2, "unknown format version 2"),
    (2, 0, "unknown flags"),
    (2, 0x6, "unknown flags"),
    (3, 2, "polynomials stored"),
    (4, 0, "limbs"),
    (4, 65, "limbs"),
    (9, 3000, "ring degree 3000"),
    (10, 1, "size 1"),
    (10, 17, "size 17"),
    (11, float("nan"), "scale or correction factor"),
    (11, -1.0, "scale or correction factor"),
    (12, 2, "scale or correction factor"),
])
def test_forged_header_fields_are_refused_before_seal_reads_anything(kit, index, value, message):
    blob = wire.dumps(kit["native"].encrypt(kit["plain"]))
    with pytest.raises(he.SerializationError, match=message):
        wire.loads(kit["ctx"], _with(blob, index, value), "input")


def test_bad_widths_lengths_and_unreduced_words_are_refused(kit):
    ctx = kit["ctx"]
    blob = wire.dumps(_full(kit))
    head = wire._FIXED.size
    limbs = len(_CHAIN) - 1
    for width in (0, 9):
        bad = blob[:head] + bytes([width]) + blob[head + 1:]
        with pytest.raises(he.SerializationError, match="word widths"):
            wire.loads(ctx, bad, "output")
    for cut in (0, 3, head - 1, head + 1, head + limbs + 7, len(blob) - 1):
        # too short for the magic: not this form, nor SEAL's
        with pytest.raises(he.SerializationError,
                           match="malformed ciphertext bytes" if cut >= 4 else "not SEAL data"):
            wire.loads(ctx, blob[:cut], "output")
    with pytest.raises(he.SerializationError, match="bytes where the header describes"):
        wire.loads(ctx, blob + b"\x00", "output")
    # the top byte plane of the first limb all ones: every such word above its 30-bit prime
    widths = list(blob[head:head + limbs])
    top = head + limbs + _N * (widths[0] - 1) * limbs
    top -= _N * sum(1 for w in widths[1:] if w < widths[0])
    bad = bytearray(blob)
    bad[top:top + _N] = b"\xff" * _N
    with pytest.raises(he.SerializationError, match="malformed, truncated or for other"):
        wire.loads(ctx, bytes(bad), "output")
    # a parameters id no level of this context has
    with pytest.raises(he.SerializationError):
        wire.loads(ctx, _with(blob, 5, 12345), "output")


def test_a_ciphertext_of_other_parameters_is_refused(kit):
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(_N)
    parms.set_coeff_modulus(seal.CoeffModulus.Create(_N, [30, 25, 30]))
    other = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    with pytest.raises(he.SerializationError):
        wire.loads(other, wire.dumps(_full(kit)), "input")


@pytest.fixture(params=["direct", "seal"])
def path(request, kit):
    """Either way :func:`he.wire.loads` reads the compact form: straight into a ciphertext's
    words (:class:`he.wire.DirectLoad`), or through SEAL's own stream."""
    if request.param == "direct":
        if wire._direct(kit["ctx"]) is None:
            pytest.skip(f"no direct load here: {wire.DirectLoad(kit['ctx']).reason}")
        yield request.param
    else:
        with wire.seal_loads():
            yield request.param


def test_a_direct_load_is_seals_load_word_for_word_in_the_buffer_it_is_given(kit):
    ctx = kit["ctx"]
    if wire._direct(ctx) is None:
        pytest.skip(f"no direct load here: {wire.DirectLoad(ctx).reason}")
    for ct in (kit["native"].encrypt(kit["plain"]), _full(kit), _full(kit, 2), _full(kit, 0, 3)):
        blob = wire.dumps(ct)
        theirs = load_object(seal.Ciphertext, ctx, wire._to_seal(blob, wire._parse(blob, "x")),
                             "x")
        # a buffer holding another ciphertext (three polynomials, other words) is overwritten
        buf = _full(kit, 0, 3)
        ours = wire.loads(ctx, blob, "x", into=buf)
        assert ours is buf
        assert save_object(ours) == save_object(theirs)
    seeded = wire.loads(ctx, wire.dumps(kit["native"].encrypt(kit["plain"])), "x")
    assert np.abs(_decrypt(kit, seeded) - kit["values"]).max() < 1e-3


def test_both_paths_refuse_the_same_bytes_and_check_refuses_what_loads_refuses(kit, path):
    ctx = kit["ctx"]
    blob = wire.dumps(kit["native"].encrypt(kit["plain"]))
    head = wire._parse(blob, "x")
    record = head.words_at - wire._SEED_BYTES      # SEAL's seed record: header, generator, seed
    gen = record + wire._SEAL_HEADER.size
    top = head.words_at + _N * (head.widths[0] - 1) * head.limbs
    top -= _N * sum(1 for w in head.widths[1:] if w < head.widths[0])
    bad = {
        "truncated": (blob[:-1], "bytes where the header describes"),
        "no generator": (blob[:gen] + b"\x00" + blob[gen + 1:], "seed record"),
        "a generator SEAL lacks": (blob[:gen] + b"\x07" + blob[gen + 1:], "seed record"),
        "a seed record of other size": (blob[:record + 8] + b"\x52" + blob[record + 9:],
                                        "seed record"),
        "unreduced words": (blob[:top] + b"\xff" * _N + blob[top + _N:],
                            "malformed, truncated or for other"),
        "an unknown parameters id": (_with(blob, 5, 12345), "malformed, truncated or for other"),
    }
    for what, (data, message) in bad.items():
        with pytest.raises(he.SerializationError, match=message):
            wire.loads(ctx, data, what)
        with pytest.raises(he.SerializationError, match=message):
            wire.check(ctx, data, what)
    wire.check(ctx, blob, "good")
    wire.check(ctx, memoryview(blob), "a view")
    assert np.abs(_decrypt(kit, wire.loads(ctx, memoryview(blob), "x")) - kit["values"]).max() \
        < 1e-3
