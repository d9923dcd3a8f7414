"""Trust boundaries: every malformed or misused input gets the package's own error, never a
crash, a hang or a wrong answer.

Deterministic corpora: every truncation of the container prefix and header plus a stride over the
blobs, seeded single-bit flips, forged headers (the digest recomputed, as a deliberate editor
would) with wrong types, huge and non-finite values and smuggled blobs, for real TenSEAL contexts,
ciphertexts and compiled programs with small parameters, and for polynomial program files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import threading
import time
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import he
import polynets as pn
from he.container import (BLOB_SCHEMAS, bool_field, dict_field, float_field, int_field,
                          list_field, pack, str_field, unpack)
from polynets.errors import PolynetsError, ProgramFormatError, ShapeError, WriteError
from polynets._io import dump_safetensors, read_safetensors
from polynets.ir.program import _digest as program_digest
from polynets.ir.program import (PolyProgram, atomic_write_bytes, load_npy_bytes,
                              loads_json_strict)
from _models import Square


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), Square()).eval()
    x = torch.randn(3, 3)
    prog = he.compile(model, x, packing="batch")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x).to_bytes()
    out = server.run(ct).to_bytes()
    return dict(prog=prog, client=client, server=server, x=x, ct=ct, out=out,
                public=client.public_context(), secret=client.secret_context(),
                expected=client.decrypt(out))


# ---------------------------------------------------------------------------- helpers
def _split(data: bytes) -> tuple[dict, list[bytes], int]:
    """Header, blobs in file order and the offset where the blobs start."""
    (hlen,) = struct.unpack(">I", data[37:41])
    head = json.loads(data[41:41 + hlen])
    pos, blobs = 41 + hlen, []
    for name in sorted(head["blobs"]):
        for n, _ in head["blobs"][name]:
            blobs.append(data[pos:pos + n])
            pos += n
    return head, blobs, 41 + hlen


def _forge(raw_header: bytes | str, body: bytes = b"", version: int = 2) -> bytes:
    """A container whose header digest is right, whatever the header says."""
    if isinstance(raw_header, str):
        raw_header = raw_header.encode()
    lead = b"PNHE" + bytes([version])
    length = struct.pack(">I", len(raw_header))
    check = hashlib.blake2b(lead + length + raw_header, digest_size=32).digest()
    return lead + check + length + raw_header + body


def _forge_blobs(kind: str, head: dict, blobs: dict[str, list[bytes]]) -> bytes:
    """What :func:`pack` writes, without its schema check: how an attacker builds a file."""
    head = dict(head, kind=kind, blobs={
        name: [[len(b), hashlib.blake2b(b, digest_size=32).hexdigest()] for b in items]
        for name, items in blobs.items()})
    body = b"".join(b for name in sorted(blobs) for b in blobs[name])
    return _forge(json.dumps(head, sort_keys=True), body)


def _mutations(data: bytes, *, flips: int, stride: int, seed: int = 0):
    """Truncations (every offset up to the blobs, then every ``stride``) and seeded bit flips
    (every bit of the prefix, then ``flips`` random ones)."""
    _, _, start = _split(data)
    for cut in list(range(0, start + 1)) + list(range(start + 1, len(data), stride)):
        yield f"truncated at {cut}", data[:cut]
    yield "one byte appended", data + b"\0"
    rng = np.random.default_rng(seed)
    positions = list(range(41 * 8)) + [int(p) for p in rng.integers(0, 8 * len(data), flips)]
    for bit in positions:
        mutated = bytearray(data)
        mutated[bit // 8] ^= 1 << (bit % 8)
        yield f"bit {bit} flipped", bytes(mutated)


def _all_refused(data: bytes, load, error: type[Exception], *, flips: int, stride: int) -> int:
    tried = 0
    for label, mutated in _mutations(data, flips=flips, stride=stride):
        with pytest.raises(error):
            load(mutated)
            pytest.fail(f"{label}: accepted")
        tried += 1
    return tried


# ---------------------------------------------------------------------------- containers
def test_every_truncation_and_bit_flip_of_ciphertexts_is_a_serialization_error(setup):
    server, client = setup["server"], setup["client"]
    n = _all_refused(setup["ct"], server.run, he.SerializationError, flips=200, stride=9973)
    n += _all_refused(setup["out"], client.decrypt, he.SerializationError, flips=200,
                      stride=9973)
    n += _all_refused(setup["ct"], he.Ciphertext.from_bytes, he.SerializationError, flips=100,
                      stride=4999)
    assert n > 1500


def test_a_request_is_read_in_place_from_bytes_and_copied_from_mutable_buffers(setup):
    """Immutable bytes are parsed without a copy of their ciphertexts (a batch request is
    hundreds of MB); a bytearray is copied as it is verified, so that editing it afterwards
    changes nothing the server reads."""
    data = setup["ct"]
    parts = he.Ciphertext.from_bytes(data)._groups[0]
    assert all(isinstance(b, memoryview) and b.obj is data for b in parts)
    buf = bytearray(data)
    ct = he.Ciphertext.from_bytes(buf)
    assert all(isinstance(b, bytes) for b in ct._groups[0])
    buf[len(buf) // 2:] = bytes(len(buf) - len(buf) // 2)      # the caller reuses its buffer
    client = setup["client"]
    np.testing.assert_allclose(client.decrypt(setup["server"].run(ct)), setup["expected"],
                               atol=1e-3)
    np.testing.assert_allclose(client.decrypt(setup["server"].run(data)), setup["expected"],
                               atol=1e-3)
    assert he.Ciphertext.from_bytes(data).to_bytes() == data


def test_every_truncation_and_bit_flip_of_contexts_is_a_serialization_error(setup):
    prog = setup["prog"]
    n = _all_refused(setup["public"], lambda b: he.Server(prog, b), he.SerializationError,
                     flips=60, stride=65521)
    n += _all_refused(setup["secret"], lambda b: unpack(b, "secret-context", "context"),
                      he.SerializationError, flips=60, stride=65521)
    rng = np.random.default_rng(2)
    for bit in rng.integers(0, 8 * len(setup["secret"]), 20):
        flipped = bytearray(setup["secret"])
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(he.SerializationError):
            he.Client.from_secret_context(prog, bytes(flipped))
    assert n > 1000


def test_every_truncation_and_bit_flip_of_a_compiled_program_is_refused(setup):
    data = setup["prog"].to_bytes()
    n = _all_refused(data, he.CompiledProgram.from_bytes, he.SerializationError, flips=400,
                     stride=7)
    assert n > 1000


def test_swapped_blobs_are_refused(setup):
    head, blobs, start = _split(setup["ct"])
    assert len(blobs) >= 2
    body = b"".join([blobs[1], blobs[0], *blobs[2:]])
    if len(blobs[0]) == len(blobs[1]):
        with pytest.raises(he.SerializationError, match="blob 'g0' #0 is damaged"):
            setup["server"].run(setup["ct"][:start] + body)
    else:
        with pytest.raises(he.SerializationError, match="damaged"):
            setup["server"].run(setup["ct"][:start] + body)


def test_a_secret_key_smuggled_into_a_public_context_is_refused(setup):
    prog = setup["prog"]
    _, secret_blobs = unpack(setup["secret"], "secret-context", "context")
    _, public_blobs = unpack(setup["public"], "public-context", "context")
    head = {"fingerprint": prog.fingerprint, "key_id": setup["client"].key_id}
    sk = secret_blobs["secret_key"][0]
    smuggled = [
        {**public_blobs, "extra": [sk]},
        {**public_blobs, "secretkey": [sk]},
        {**public_blobs, "secret_key": [sk]},
        {**public_blobs, "public_key": public_blobs["public_key"] + [sk]},
        {**public_blobs, "relin_keys": public_blobs["relin_keys"] + [sk]},
        {**public_blobs, "galois_keys": [sk, sk]},
    ]
    for name in ("relin_keys", "galois_keys"):  # in a slot of the schema: SEAL refuses it
        smuggled.append({**public_blobs, name: [sk]})  # as that key type
    for blobs in smuggled:
        with pytest.raises(he.SerializationError, match="blob|malformed"):
            he.Server(prog, _forge_blobs("public-context", head, blobs))
    # in the public key's slot it no longer matches the key set's id, a digest of that key
    with pytest.raises(he.KeyMismatchError, match="key set id"):
        he.Server(prog, _forge_blobs("public-context", head, {**public_blobs,
                                                               "public_key": [sk]}))
    with pytest.raises(he.SecretKeyError):
        he.Server(prog, _forge_blobs("secret-context", head, secret_blobs))


def test_ciphertext_groups_must_be_numbered_without_gaps(setup):
    head, _, _ = _split(setup["ct"])
    fields = {k: v for k, v in head.items() if k not in ("kind", "blobs")}
    _, blobs = unpack(setup["ct"], "ciphertext", "ciphertext")
    for renamed in ({"g1": blobs["g0"]}, {"g0": blobs["g0"], "g2": blobs["g0"]},
                    {"g0": blobs["g0"], "x": blobs["g0"]}, {}):
        with pytest.raises(he.SerializationError, match="blob names"):
            he.Ciphertext.from_bytes(_forge_blobs("ciphertext", fields, renamed))


def test_records_of_one_kind_are_refused_where_another_is_expected(setup):
    prog, server = setup["prog"], setup["server"]
    records = {"ciphertext": setup["ct"], "public-context": setup["public"],
               "secret-context": setup["secret"], "compiled-program": prog.to_bytes()}
    loaders = {"ciphertext": server.run, "public-context": lambda b: he.Server(prog, b),
               "compiled-program": he.CompiledProgram.from_bytes,
               "secret-context": lambda b: he.Client.from_secret_context(prog, b)}
    for expected, load in loaders.items():
        for kind, data in records.items():
            if kind == expected or {kind, expected} == {"public-context", "secret-context"}:
                continue
            with pytest.raises(he.SerializationError, match=f"holds a '{kind}' record"):
                load(data)
    with pytest.raises(he.SecretKeyError):
        he.Client.from_secret_context(prog, setup["public"])


def test_ciphertexts_and_contexts_of_another_program_are_refused(setup):
    torch.manual_seed(5)
    other = he.compile(nn.Sequential(nn.Linear(3, 2), Square()).eval(), setup["x"], packing="batch")
    other_client = he.Client(other)
    with pytest.raises(he.KeyMismatchError, match="compiled program"):
        setup["server"].run(other_client.encrypt(setup["x"]).to_bytes())
    with pytest.raises(he.KeyMismatchError, match="compiled program"):
        he.Server(setup["prog"], other_client.public_context())
    with pytest.raises(he.KeyMismatchError, match="compiled program"):
        setup["client"].decrypt(he.Server(other, other_client.public_context()).run(
            other_client.encrypt(setup["x"])).to_bytes())


@pytest.mark.parametrize("header", [
    "[" * 100_000 + "]" * 100_000,
    '{"kind": "ciphertext", "blobs": {}, "n": ' + "[" * 40 + "]" * 40 + "}",
    '{"kind": "ciphertext", "blobs": {}, "groups": Infinity}',
    '{"kind": "ciphertext", "blobs": {}, "groups": NaN}',
    '{"kind": "ciphertext", "blobs": {}, "groups": 1e400}',
    '{"kind": "ciphertext", "kind": "public-context", "blobs": {}}',
    '{"kind": "ciphertext", "blobs": []}',
    '{"kind": "ciphertext", "blobs": {"g0": [[-1, "00"]]}}',
    '{"kind": "ciphertext", "blobs": {"g0": [[1e300, "00"]]}}',
    '{"kind": "ciphertext", "blobs": {"g0": [["5", "00"]]}}',
    '{"kind": "ciphertext", "blobs": {"g0": [[10, "' + "0" * 64 + '"]]}}',
    '{"kind": "ciphertext", "blobs": {"g0": 5}}',
    '{"kind": "nonsense", "blobs": {}}',
    '"just a string"',
    "\xff\xfe not utf-8",
    "",
])
def test_malformed_headers_with_valid_digests_are_serialization_errors(setup, header):
    data = _forge(header.encode("latin-1") if header.startswith("\xff") else header)
    for load in (he.Ciphertext.from_bytes, setup["server"].run, setup["client"].decrypt,
                 lambda b: he.Server(setup["prog"], b), he.CompiledProgram.from_bytes):
        with pytest.raises(he.SerializationError):
            load(data)


@pytest.mark.parametrize("data", [b"", b"PNHE", b"PNHE\x01" + bytes(60), b"PNHE\x02" + bytes(40),
                                  b"XXXX\x02" + bytes(100), bytes(1000), b"PNHE\x02" + b"\xff" * 40,
                                  "not bytes", None, 12, memoryview(np.arange(8)[::2])])
def test_garbage_is_a_serialization_error(setup, data):
    for load in (he.Ciphertext.from_bytes, setup["server"].run, setup["client"].decrypt,
                 lambda b: he.Server(setup["prog"], b), he.CompiledProgram.from_bytes):
        with pytest.raises(he.SerializationError):
            load(data)


def test_a_huge_header_length_is_refused_before_reading():
    data = b"PNHE\x02" + bytes(32) + struct.pack(">I", 2**32 - 1) + b"{}"
    with pytest.raises(he.SerializationError, match="header"):
        unpack(data, "ciphertext", "ciphertext")


def test_pack_round_trips_and_refuses_blobs_outside_the_schema():
    data = pack("compiled-program", {"x": [1, 2.5, "s"]}, {"program": [b"abc"]})
    head, blobs = unpack(data, "compiled-program", "program")
    assert head["x"] == [1, 2.5, "s"] and blobs == {"program": [b"abc"]}
    head, blobs = unpack(pack("public-context", {}, {"public_key": [b"p"], "relin_keys": [b"r"]}),
                         "public-context", "context")
    assert blobs["galois_keys"] == [], "names with no blobs read as empty lists"
    for kind, bad in [("public-context", {"public_key": [b"p"], "relin_keys": [b"r"],
                                          "secret_key": [b"s"]}),
                      ("public-context", {"public_key": [b"p", b"q"], "relin_keys": [b"r"]}),
                      ("compiled-program", {}), ("ciphertext", {"g1": [b"x"]}),
                      ("unknown-kind", {})]:
        with pytest.raises(he.SerializationError):
            pack(kind, {}, bad)
    with pytest.raises(he.SerializationError, match="finite"):
        pack("compiled-program", {"x": float("inf")}, {"program": [b""]})
    assert set(BLOB_SCHEMAS) == {"public-context", "secret-context", "compiled-program",
                                 "ciphertext"}


def test_blobs_are_views_only_of_bytes_that_cannot_change():
    data = pack("public-context", {}, {"public_key": [b"pk"], "relin_keys": [b"rk"],
                                       "galois_keys": [b"gk" * 10]})
    _, shared = unpack(data, "public-context", "context", views=True)
    assert isinstance(shared["galois_keys"][0], memoryview)
    assert shared["galois_keys"][0] == b"gk" * 10 and shared["public_key"][0] == b"pk"
    # a mutable buffer could change after its digests were checked: its blobs are copies
    mutable = bytearray(data)
    _, copied = unpack(mutable, "public-context", "context", views=True)
    mutable[-1] ^= 0xFF
    assert copied["galois_keys"][0] == b"gk" * 10 and type(copied["galois_keys"][0]) is bytes
    _, plain = unpack(data, "public-context", "context")
    assert all(type(b) is bytes for items in plain.values() for b in items)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4), max_leaves=20)


@settings(max_examples=40)
@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("kind", "blobs")), _JSON,
                       max_size=5), st.binary(max_size=64))
def test_any_json_header_round_trips(header, blob):
    head, blobs = unpack(pack("compiled-program", header, {"program": [blob]}),
                         "compiled-program", "program")
    assert {k: v for k, v in head.items() if k not in ("kind", "blobs")} == header
    assert blobs == {"program": [blob]}


@settings(max_examples=60)
@given(st.binary(max_size=300), st.binary(max_size=64))
def test_arbitrary_bytes_are_serialization_errors(garbage, body):
    for data in (garbage, b"PNHE\x02" + garbage, _forge(garbage, body)):
        with pytest.raises(he.SerializationError):
            unpack(data, ("ciphertext", "public-context", "secret-context", "compiled-program"),
                   "data")


def test_header_field_helpers_check_types_and_bounds():
    head = {"i": 3, "b": True, "f": 2.5, "s": "batch", "l": [1], "d": {}}
    assert int_field(head, "i", "x", lo=1, hi=4) == 3
    assert float_field(head, "f", "x", lo=0) == 2.5 and float_field(head, "i", "x") == 3.0
    assert str_field(head, "s", "x", choices=("batch", "vector")) == "batch"
    assert bool_field(head, "b", "x") is True
    assert list_field(head, "l", "x") == [1] and dict_field(head, "d", "x") == {}
    assert int_field(head, "missing", "x", default=7) == 7
    for call in (lambda: int_field(head, "b", "x"), lambda: int_field(head, "f", "x"),
                 lambda: int_field(head, "i", "x", hi=2), lambda: int_field(head, "no", "x"),
                 lambda: float_field(head, "s", "x"), lambda: float_field(head, "b", "x"),
                 lambda: float_field(head, "f", "x", hi=1),
                 lambda: str_field(head, "s", "x", choices=("vector",)),
                 lambda: str_field(head, "i", "x"),
                 lambda: str_field(head, "s", "x", pattern="[0-9a-f]+"),
                 lambda: bool_field(head, "i", "x"), lambda: list_field(head, "d", "x"),
                 lambda: list_field(head, "l", "x", max_len=0), lambda: dict_field(head, "l", "x"),
                 lambda: int_field([], "i", "x")):
        with pytest.raises(he.SerializationError, match="x: "):
            call()


def test_strict_json_refuses_depth_non_finite_numbers_and_duplicates():
    assert loads_json_strict(b'{"a": "[[[[[[[[\\"", "b": [1.5, -2]}', "h") == {
        "a": '[[[[[[[["', "b": [1.5, -2]}
    for raw in (b"[" * 65 + b"]" * 65, b"[-Infinity]", b"[1e999]", b'{"a": 1, "a": 2}',
                b"\xc3\x28", b"[1, 2", b"1" * 5000):
        with pytest.raises(ProgramFormatError, match="h: "):
            loads_json_strict(raw, "h")


# ---------------------------------------------------------------------------- program files
@pytest.fixture(scope="module")
def program() -> PolyProgram:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), Square(), nn.Linear(4, 2)).eval()
    return pn.trace(model, torch.randn(1, 3))


def _npz(arrays: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, raw in arrays.items():
            z.writestr(name + ".npy", raw)
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n[:-4]: z.read(n) for n in z.namelist()}


def _parts(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    meta, arrays = read_safetensors(data, "program", 1 << 31)
    return json.loads(meta["polynets-program"]), arrays


def _signed(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A program file with a recomputed digest: what someone editing it on purpose writes."""
    text = json.dumps(header)
    return dump_safetensors(arrays, {"polynets-program": text,
                                     "sha256": program_digest(text, arrays)})


def _v1(program: PolyProgram) -> bytes:
    """The program as format version 1 wrote it (an .npz archive), which still loads."""
    header, arrays = _parts(program.to_bytes())
    header["version"] = 1
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _with_header(data: bytes, edit) -> bytes:
    header, arrays = _parts(data)
    edit(header)
    return _signed(header, arrays)


@pytest.mark.parametrize("form", ["safetensors", "npz"])
def test_every_truncation_and_bit_flip_of_a_program_file_is_refused_or_harmless(program, form):
    data = program.to_bytes() if form == "safetensors" else _v1(program)
    assert PolyProgram.from_bytes(data).to_bytes() == program.to_bytes()
    x = np.random.default_rng(0).standard_normal((5, 3))
    reference = program.run(x)
    rng = np.random.default_rng(1)
    mutated = [data[:cut] for cut in range(len(data))]
    for bit in list(range(0, 8 * len(data), 3)) + [int(b) for b in rng.integers(0, 8 * len(data),
                                                                                 300)]:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        mutated.append(bytes(flipped))
    loaded = 0
    for blob in mutated:
        try:
            again = PolyProgram.from_bytes(blob)
        except ProgramFormatError:
            continue
        loaded += 1  # a flip in a field nothing reads (a zip timestamp): the same program
        assert np.array_equal(again.run(x), reference)
    assert len(mutated) > 5000 and loaded < len(mutated) // 4


def test_an_npy_header_claiming_a_huge_shape_is_refused_before_allocation(program):
    members = _members(_v1(program))
    name = next(k for k in members if k.endswith("_weight"))
    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776, 2), }"
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header) + 1) + header + b"\n" + bytes(16)
    start = time.perf_counter()
    with pytest.raises(ProgramFormatError, match="header says shape"):
        PolyProgram.from_bytes(_npz({**members, name: raw}))
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ProgramFormatError, match="dtype"):
        PolyProgram.from_bytes(_npz({**members, name: _npy(np.array(["a", "b"]))}))


def _raw_safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize("header, body, match", [
    ({"w": {"dtype": "F64", "shape": [1 << 40, 2], "data_offsets": [0, 16]}}, bytes(16),
     "needs"),
    ({"w": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]},
      "v": {"dtype": "F64", "shape": [1], "data_offsets": [8, 16]}}, bytes(16), "overlap"),
    ({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, bytes(16), "trailing"),
    ({"w": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, bytes(2), "malformed"),
    ({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
      "__metadata__": {"polynets-program": 3}}, bytes(8), "strings"),
    ({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "no header"),
])
def test_safetensors_headers_that_lie_are_refused_before_allocation(header, body, match):
    start = time.perf_counter()
    with pytest.raises(ProgramFormatError, match=match):
        PolyProgram.from_bytes(_raw_safetensors(header, body))
    assert time.perf_counter() - start < 1.0


def test_a_safetensors_header_longer_than_the_file_is_refused():
    with pytest.raises(ProgramFormatError, match="truncated or not safetensors"):
        PolyProgram.from_bytes(struct.pack("<Q", 1 << 40) + b"{}")


def test_an_edited_weight_is_refused_unless_the_digest_is_recomputed(program):
    header, arrays = _parts(program.to_bytes())
    name = next(k for k in arrays if k.endswith("_weight"))
    arrays[name] = arrays[name] + 1.0
    text = json.dumps(header)
    stale = dump_safetensors(arrays, {"polynets-program": text,
                                      "sha256": program_digest(text, _parts(
                                          program.to_bytes())[1])})
    with pytest.raises(ProgramFormatError, match="digest"):
        PolyProgram.from_bytes(stale)
    edited = PolyProgram.from_bytes(_signed(header, arrays))
    assert not np.array_equal(edited.run(np.ones((1, 3))), program.run(np.ones((1, 3))))


def test_the_npz_files_of_format_version_1_still_load(program):
    again = PolyProgram.from_bytes(_v1(program))
    x = np.random.default_rng(2).standard_normal((4, 3))
    assert np.array_equal(again.run(x), program.run(x))


def test_every_bit_flip_and_truncation_of_an_npy_array_is_an_error_or_an_array():
    data = _npy(np.arange(12.0).reshape(3, 4))
    mutated = [data[:cut] for cut in range(len(data))]
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        mutated.append(bytes(flipped))
    refused = 0
    for blob in mutated:
        try:
            arr = load_npy_bytes(blob, "input data", he.InputShapeError)
        except he.InputShapeError:
            refused += 1
            continue
        assert arr.size == 12 and arr.dtype.kind in "biuf"
    assert refused > len(data)


def test_program_files_with_non_finite_weights_are_refused(program):
    header, arrays = _parts(program.to_bytes())
    name = next(k for k in arrays if k.endswith("_weight"))
    arrays[name].flat[0] = np.inf
    with pytest.raises(ProgramFormatError, match="NaN or infinite"):
        PolyProgram.from_bytes(_signed(header, arrays))


@pytest.mark.parametrize("edit", [
    lambda h: h["nodes"][1].update(attrs=[1, 2]),
    lambda h: h["nodes"][1].update(attrs="weight"),
    lambda h: h["nodes"][1]["attrs"].update(weight=5),
    lambda h: h["nodes"][1]["attrs"].update(weight={"array": 3}),
    lambda h: h["nodes"][1]["attrs"].update(weight={"array": "n0_missing"}),
    lambda h: h["nodes"][1]["attrs"].update(weight={"array": "n1_weight", "x": 1}),
    lambda h: h["nodes"][1]["attrs"].update(axis=True),
    lambda h: h["nodes"][1]["attrs"].update(axis=1.0),
    lambda h: h["nodes"][1]["attrs"].update(extra=[1]),
    lambda h: h["nodes"][1].update(inputs="0"),
    lambda h: h["nodes"][1].update(inputs=[0.0]),
    lambda h: h["nodes"][1].update(inputs=[5]),
    lambda h: h["nodes"][0].update(shape=[1, 2**31]),
    lambda h: h["nodes"][0].update(shape=[1, 65536, 65536]),
    lambda h: h["nodes"][0].update(shape=[1] * 40),
    lambda h: h["nodes"][0].update(shape=[1, -3]),
    lambda h: h["nodes"][0].update(shape="13"),
    lambda h: h["nodes"][1].update(op="exec"),
    lambda h: h["nodes"][1].update(op=["linear"]),
    lambda h: h["nodes"][1].update(path=7),
    lambda h: h["nodes"].__setitem__(1, "node"),
    lambda h: h.update(nodes={"0": 1}),
    lambda h: h.update(output="2"),
    lambda h: h.update(output=99),
    lambda h: h.update(meta=[1]),
    lambda h: h.update(version=True),
    lambda h: h.update(version=1),
    lambda h: h.update(version=3),
    lambda h: h.update(format="other"),
])
def test_program_headers_of_the_wrong_json_types_are_program_format_errors(program, edit):
    with pytest.raises(ProgramFormatError):
        PolyProgram.from_bytes(_with_header(program.to_bytes(), edit))


def test_program_load_refuses_missing_paths_directories_and_fifos(tmp_path, program):
    with pytest.raises(ProgramFormatError, match="does not exist"):
        PolyProgram.load(tmp_path / "missing.npz")
    with pytest.raises(ProgramFormatError, match="directory"):
        PolyProgram.load(tmp_path)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ProgramFormatError, match="is a file"):
        PolyProgram.load(tmp_path / "file" / "program.npz")
    with pytest.raises(ProgramFormatError, match="not a regular file"):
        PolyProgram.load("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            PolyProgram.load(fifo)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader so the test process can end
        with open(fifo, "wb"):
            pass
        pytest.fail("PolyProgram.load hangs on a FIFO")
    assert isinstance(outcome[0], ProgramFormatError) and "not a regular file" in str(outcome[0])
    program.save(tmp_path / "p.npz")
    assert np.array_equal(PolyProgram.load(tmp_path / "p.npz").run(np.ones((1, 3))),
                          program.run(np.ones((1, 3))))


# ---------------------------------------------------------------------------- numeric input
def test_integer_and_bool_inputs_are_computed_in_float64(program):
    ints = np.array([[1, -2, 3], [0, 4, 1]])
    floats = ints.astype(np.float64)
    assert program.run(ints).dtype == np.float64
    assert np.array_equal(program.run(ints), program.run(floats))
    bools = np.array([[True, False, True]])
    assert np.array_equal(program.run(bools), program.run(bools.astype(np.float64)))
    assert np.array_equal(program.run(np.array([[1, 2, 3]], dtype=np.uint8)),
                          program.run(np.array([[1.0, 2.0, 3.0]])))
    with pytest.raises(ShapeError, match="complex"):
        program.run(np.ones((1, 3), dtype=complex))
    with pytest.raises(ShapeError):
        program.run(np.array([["a", "b", "c"]]))


def test_to_torch_refuses_inputs_of_the_wrong_rank_or_size(program):
    module = program.to_torch()
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.allclose(module(x), torch.as_tensor(program.run(x.numpy())))
    assert torch.equal(module(torch.tensor([[1, 2, 3]])), module(torch.tensor([[1.0, 2, 3]],
                                                                              dtype=torch.float64)))
    for bad in (torch.randn(3), torch.randn(1, 1, 3), torch.randn(3, 1), torch.randn(2, 4),
                torch.randn(6)):
        with pytest.raises(ShapeError, match=r"\('B', 3\)"):
            module(bad)
    with pytest.raises(ShapeError, match="complex"):
        module(torch.ones(1, 3, dtype=torch.complex64))


def test_simulate_and_to_torch_refuse_what_they_cannot_compute(program):
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert np.array_equal(program.simulate(x.to(torch.bfloat16)), program.simulate(x.double()))
    assert np.array_equal(program.simulate(torch.tensor([[1, 0, 1]])),
                          program.run(np.array([[1.0, 0, 1]])))
    with pytest.raises(ShapeError, match="complex"):
        program.simulate(torch.ones(1, 3, dtype=torch.complex64))
    with pytest.raises(ShapeError, match="complex"):
        program.simulate(np.ones((1, 3), dtype=complex))
    with pytest.raises(pn.ConfigError, match="floating-point"):
        program.to_torch(torch.int64)


# ---------------------------------------------------------------------------- atomic writes
def test_public_files_follow_the_umask_and_private_files_are_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "public.ctx", b"p")
        atomic_write_bytes(tmp_path / "secret.ctx", b"s", private=True)
        os.umask(0o077)
        atomic_write_bytes(tmp_path / "other", b"o")
    finally:
        os.umask(old)
    assert (tmp_path / "public.ctx").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "secret.ctx").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "other").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "public.ctx").read_bytes() == b"p"


def test_failed_writes_leave_nothing_behind_and_name_the_problem(tmp_path):
    atomic_write_bytes(tmp_path / "f", b"old")
    with pytest.raises(TypeError):
        atomic_write_bytes(tmp_path / "f", object())  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert (tmp_path / "f").read_bytes() == b"old"
    with pytest.raises(WriteError, match="is a directory"):
        atomic_write_bytes(tmp_path, b"x")
    with pytest.raises(WriteError, match="parent of it is a file"):
        atomic_write_bytes(tmp_path / "f" / "g", b"x")
    assert isinstance(WriteError("x"), (OSError, PolynetsError))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_writer_killed_before_it_renames_leaves_a_temporary_file_the_next_write_removes(
        tmp_path):
    import signal
    import subprocess
    import sys

    target = tmp_path / "program.npz"
    package = os.path.dirname(pn.__file__)  # the module alone, without importing torch
    code = ("import os, signal, sys, types\n"
            f"sys.modules['polynets'] = types.ModuleType('polynets')\n"
            f"sys.modules['polynets'].__path__ = [{package!r}]\n"
            "import polynets.ir.program as p\n"
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"p.atomic_write_bytes({str(target)!r}, b'x' * 100000)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert run.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(left) == 1 and not target.exists()
    old = time.time() - 3600
    os.utime(left[0], (old, old))
    atomic_write_bytes(target, b"complete")
    assert [p.name for p in tmp_path.iterdir()] == ["program.npz"]


def test_temporary_files_of_killed_writers_are_removed_by_the_next_write(tmp_path):
    dead = tmp_path / ".tmp-out.bin.999999999.abc"
    alive = tmp_path / f".tmp-out.bin.{os.getppid()}.abc"
    recent = tmp_path / ".tmp-out.bin.999999998.abc"
    other = tmp_path / ".tmp-else.bin.999999999.abc"
    for p in (dead, alive, recent, other):
        p.write_bytes(b"half")
    old = time.time() - 3600
    for p in (dead, alive, other):
        os.utime(p, (old, old))
    atomic_write_bytes(tmp_path / "out.bin", b"new")
    assert not dead.exists()
    assert alive.exists() and recent.exists() and other.exists()
    assert (tmp_path / "out.bin").read_bytes() == b"new"


# ---------------------------------------------------------------------------- larger corpora (CI)
@pytest.mark.slow
def test_every_bit_flip_of_a_compiled_program_and_its_program_file(setup, program):
    data = setup["prog"].to_bytes()
    n = _all_refused(data, he.CompiledProgram.from_bytes, he.SerializationError,
                     flips=8 * len(data), stride=1)
    raw = program.to_bytes()
    x = np.random.default_rng(0).standard_normal((5, 3))
    reference = program.run(x)
    for bit in range(8 * len(raw)):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            again = PolyProgram.from_bytes(bytes(flipped))
        except ProgramFormatError:
            continue
        assert np.array_equal(again.run(x), reference), f"bit {bit}"
    assert n > 8 * len(data)


@pytest.mark.slow
def test_many_bit_flips_and_truncations_of_ciphertexts_and_contexts(setup):
    prog, server, client = setup["prog"], setup["server"], setup["client"]
    n = _all_refused(setup["ct"], server.run, he.SerializationError, flips=20000, stride=97)
    n += _all_refused(setup["out"], client.decrypt, he.SerializationError, flips=20000, stride=97)
    n += _all_refused(setup["public"], lambda b: he.Server(prog, b), he.SerializationError,
                      flips=3000, stride=4099)
    n += _all_refused(setup["secret"], lambda b: unpack(b, "secret-context", "context"),
                      he.SerializationError, flips=3000, stride=4099)
    assert n > 50000


def test_program_files_are_safetensors_the_reference_reader_loads(program):
    from safetensors.numpy import load

    data = program.to_bytes()
    _, arrays = _parts(data)
    theirs = load(data)
    assert sorted(theirs) == sorted(arrays)
    for name, value in arrays.items():
        assert theirs[name].dtype == value.dtype and np.array_equal(theirs[name], value)
