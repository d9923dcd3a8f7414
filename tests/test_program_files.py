"""Compiled program files: the polynomial program's arrays as safetensors (program format 2)
inside the container, with its JSON header, digests and the format 1 (``.npz``) fallback.

Every damaged or lying file must raise :class:`he.SerializationError` (a
:class:`~polynets.errors.ProgramFormatError` for a bare program) naming what is wrong, never load
as another model; the byte-level cases are built both as damage the container's digests catch and
as a re-framed container (valid digests around a program blob that lies), which only the
safetensors checks stand between and the arrays.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets._io as pio
from he.container import pack, unpack
from polynets._io import dump_safetensors, read_safetensors
from polynets.errors import ProgramFormatError
from polynets.ir.program import _digest as program_digest
from polynets.ir.program import FORMAT_VERSION, PolyProgram
from _models import Square

_MAGIC = "polynets-program"


@pytest.fixture(scope="module", params=["mlp", "hand-built"])
def setup(request, hand_built_program):
    if request.param == "mlp":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
        x = torch.randn(5, 6)
        prog = he.compile(model, x, packing="batch")
        x = x.numpy().astype(np.float64)
    else:
        program, x = hand_built_program
        prog = he.compile(program, calibration=x, packing="vector")
    client = he.Client(prog)
    public = client.public_context()
    ct = client.encrypt(x).to_bytes()
    y = client.decrypt(he.Server(prog, public).run(ct))
    return {"prog": prog, "client": client, "public": public, "ct": ct, "y": y, "x": x}


# ---------------------------------------------------------------------------- helpers
def _program_blob(data: bytes) -> tuple[dict, bytes]:
    """The container header (without ``kind`` and ``blobs``) and the program blob."""
    head, blobs = unpack(data, "compiled-program", "test")
    return {k: v for k, v in head.items() if k not in ("kind", "blobs")}, blobs["program"][0]


def _reframed(data: bytes, blob: bytes) -> bytes:
    """``data`` with its program blob replaced, the container's digests recomputed: damage the
    container cannot see, left to the program reader."""
    head, _ = _program_blob(data)
    return pack("compiled-program", head, {"program": [blob]})


def _parts(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    meta, arrays = read_safetensors(blob, "test", 1 << 31)
    return json.loads(meta[_MAGIC]), arrays


def _signed(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A program blob with its digest recomputed (an edit on purpose, not corruption)."""
    text = json.dumps(header)
    return dump_safetensors(arrays, {_MAGIC: text, "sha256": program_digest(text, arrays)})


def _raw(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _v1(blob: bytes) -> bytes:
    """The program as format 1 wrote it: the same arrays and header in ``savez_compressed``."""
    header, arrays = _parts(blob)
    header["version"] = 1
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def _refused(data: bytes, match: str) -> None:
    with pytest.raises(he.SerializationError, match=match):
        he.CompiledProgram.from_bytes(data)


# ---------------------------------------------------------------------------- round trip
def test_a_compiled_program_round_trips_through_a_file(setup, tmp_path):
    prog = setup["prog"]
    path = tmp_path / "model.he"
    prog.save(path)
    assert path.read_bytes() == prog.to_bytes()  # deterministic bytes
    loaded = he.load_program(path)
    assert loaded.to_bytes() == prog.to_bytes()
    assert (loaded.fingerprint, loaded.params, loaded.packing, loaded.certificate) == \
        (prog.fingerprint, prog.params, prog.packing, prog.certificate)
    assert loaded.options == prog.options and loaded.calibration == prog.calibration
    assert loaded.program.output == prog.program.output
    assert loaded.program.meta == prog.program.meta
    assert len(loaded.program.nodes) == len(prog.program.nodes)
    for a, b in zip(loaded.program.nodes, prog.program.nodes):
        assert (a.op, a.inputs, a.shape, a.path) == (b.op, b.inputs, b.shape, b.path)
        assert sorted(a.attrs) == sorted(b.attrs)
        for key, value in b.attrs.items():
            if isinstance(value, np.ndarray):
                assert a.attrs[key].dtype == value.dtype and np.array_equal(a.attrs[key], value)
            else:
                assert a.attrs[key] == value


def test_a_loaded_program_decrypts_to_the_same_values(setup, tmp_path):
    prog, client = setup["prog"], setup["client"]
    prog.save(tmp_path / "model.he")
    loaded = he.load_program(tmp_path / "model.he")
    y = client.decrypt(he.Server(loaded, setup["public"]).run(setup["ct"]))
    assert np.array_equal(y, setup["y"])
    assert np.max(np.abs(y - prog.simulate(setup["x"]))) <= prog.params.expected_error


def test_a_program_given_as_bytes_or_not_at_all_is_refused_with_where_one_comes_from(setup):
    prog, public = setup["prog"], setup["public"]
    with pytest.raises(he.SerializationError, match="from_bytes parses bytes"):
        he.load_program(prog.to_bytes())
    for wrong in ("model.he", None, prog.to_bytes()):
        with pytest.raises(he.ParameterError, match="he.Client needs a compiled program"):
            he.Client(wrong)
        with pytest.raises(he.ParameterError, match="he.Server needs a compiled program"):
            he.Server(wrong, public)


def test_the_program_inside_is_safetensors_with_the_json_header_in_its_metadata(setup):
    from safetensors.numpy import load

    _, blob = _program_blob(setup["prog"].to_bytes())
    (size,) = struct.unpack("<Q", blob[:8])
    table = json.loads(blob[8:8 + size])
    meta = table.pop("__metadata__")
    assert set(meta) == {_MAGIC, "sha256"}
    header = json.loads(meta[_MAGIC])
    assert header["format"] == _MAGIC and header["version"] == FORMAT_VERSION == 2
    theirs = load(blob)  # the reference reader
    _, ours = _parts(blob)
    assert sorted(theirs) == sorted(ours) == sorted(table)
    for name, value in ours.items():
        assert theirs[name].dtype == value.dtype and np.array_equal(theirs[name], value)


def test_the_reader_accepts_what_the_reference_writer_writes():
    from safetensors.numpy import save

    arrays = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.array([1, -1], np.int64),
              "c": np.zeros((0, 4), np.float32)}
    meta, back = read_safetensors(save(arrays, metadata={"k": "v"}), "test", 1 << 20)
    assert meta == {"k": "v"} and sorted(back) == sorted(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and np.array_equal(back[name], value)


# ---------------------------------------------------------------------------- damaged files
def test_a_truncated_file_is_refused_wherever_it_is_cut(setup, tmp_path):
    data = setup["prog"].to_bytes()
    _refused(data[:len(data) - 1], r"truncated \(the header lists")
    _refused(data[:len(data) // 2], "truncated")
    _refused(data[:60], "truncated or damaged header")
    _refused(data[:10], "bad magic or truncated")
    (tmp_path / "cut.he").write_bytes(data[:-100])
    with pytest.raises(he.SerializationError, match="truncated"):
        he.load_program(tmp_path / "cut.he")


def test_a_flipped_byte_is_refused_naming_the_damaged_part(setup):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    start = len(data) - len(blob)
    for at in (start + 3, start + len(blob) // 2, len(data) - 1):  # length, metadata, arrays
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        _refused(bytes(flipped), "blob 'program' #0 is damaged")
    flipped = bytearray(data)
    flipped[100] ^= 0x01  # in the container's JSON header
    _refused(bytes(flipped), "the header is damaged")


def test_damage_behind_valid_container_digests_is_caught_by_the_program_digest(setup):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01  # the last byte of the last array
    _refused(_reframed(data, bytes(flipped)), "does not match its digest")
    _refused(_reframed(data, blob[:-8]), "truncated or trailing bytes")
    _refused(_reframed(data, blob + bytes(8)), "truncated or trailing bytes")
    _refused(_reframed(data, blob[:5]), "too short for a safetensors header")


def test_an_oversized_safetensors_header_is_refused_before_it_is_read(setup, monkeypatch):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    _refused(_reframed(data, struct.pack("<Q", 1 << 62) + blob[8:]),
             r"header of 4611686018427387904 bytes .* \(truncated or not safetensors\)")
    # a header within the data but above the bound on JSON headers
    (size,) = struct.unpack("<Q", blob[:8])
    monkeypatch.setattr(pio, "MAX_JSON_BYTES", size - 1)
    _refused(_reframed(data, blob), f"header of {size} bytes")
    with pytest.raises(ProgramFormatError, match=f"header of {size} bytes"):
        PolyProgram.from_bytes(blob)


def _first_array(blob: bytes, suffix: str) -> tuple[dict, dict[str, np.ndarray], str]:
    header, arrays = _parts(blob)
    return header, arrays, next(k for k in sorted(arrays) if k.endswith(suffix))


@pytest.mark.parametrize("dtype, match", [
    ("BF16", "is malformed .*KeyError"),       # a dtype the format does not load
    ("C64", "is malformed .*KeyError"),
    ("F32", "needs .* bytes, its range holds"),  # disagrees with the byte range
    (5, "is malformed"),
])
def test_a_wrong_dtype_in_the_safetensors_header_is_refused(setup, dtype, match):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    (size,) = struct.unpack("<Q", blob[:8])
    table = json.loads(blob[8:8 + size])
    name = next(k for k in sorted(table) if k.endswith("_weight"))
    table[name]["dtype"] = dtype
    _refused(_reframed(data, _raw(table, blob[8 + size:])), match)


def test_a_shape_that_disagrees_with_the_byte_range_is_refused_before_allocation(setup):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    (size,) = struct.unpack("<Q", blob[:8])
    table = json.loads(blob[8:8 + size])
    name = next(k for k in sorted(table) if k.endswith("_weight"))
    table[name]["shape"] = [1 << 40, 1 << 20]
    _refused(_reframed(data, _raw(table, blob[8 + size:])),
             f"array '{name}': shape .* needs 9223372036854775808 bytes")
    table[name]["shape"] = [-1, 2]
    _refused(_reframed(data, _raw(table, blob[8 + size:])), "invalid shape")


def test_arrays_that_do_not_fit_the_program_are_refused_even_with_a_valid_digest(setup):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    header, arrays, name = _first_array(blob, "_weight")
    _refused(_reframed(data, _signed(header, {**arrays, name: arrays[name].T.copy()})),
             "weight must be")
    _refused(_reframed(data, _signed(header, {**arrays, name: arrays[name].reshape(-1)})),
             "weight must be")
    # another dtype, digest recomputed: the compiled program's fingerprint still differs
    _refused(_reframed(data, _signed(header, {**arrays, name: arrays[name].astype(np.float32)})),
             "does not match its fingerprint")


def test_a_gather_index_stored_as_floats_is_refused(hand_built_program):
    program, _ = hand_built_program
    header, arrays, name = _first_array(program.to_bytes(), "_index")
    with pytest.raises(ProgramFormatError, match="index must be an integer array"):
        PolyProgram.from_bytes(_signed(header, {**arrays, name: arrays[name].astype(np.float64)}))


# ---------------------------------------------------------------------------- format versions
def test_a_compiled_program_holding_a_format_1_npz_program_still_loads(setup):
    prog = setup["prog"]
    data = prog.to_bytes()
    _, blob = _program_blob(data)
    old = _reframed(data, _v1(blob))
    loaded = he.CompiledProgram.from_bytes(old)
    assert loaded.fingerprint == prog.fingerprint
    assert loaded.to_bytes() == data  # saved again in format 2
    y = setup["client"].decrypt(he.Server(loaded, setup["public"]).run(setup["ct"]))
    assert np.array_equal(y, setup["y"])


@pytest.mark.parametrize("form, version", [("safetensors", 1), ("safetensors", 3),
                                           ("npz", 2), ("safetensors", True)])
def test_a_version_the_container_does_not_hold_is_refused_with_the_versions_read(setup, form,
                                                                                  version):
    data = setup["prog"].to_bytes()
    _, blob = _program_blob(data)
    header, arrays = _parts(blob)
    header["version"] = version
    if form == "npz":  # written by hand: _v1 would set the version to 1
        arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        edited = buf.getvalue()
    else:
        edited = _signed(header, arrays)
    _refused(_reframed(data, edited),
             rf"program format version {version!r} is not supported .* writes version 2 "
             rf"\(safetensors\) and reads version 1 \(.npz\) too")


def test_a_container_of_another_version_is_refused(setup):
    data = bytearray(setup["prog"].to_bytes())
    data[4] = 1
    _refused(bytes(data), "format version 1 is not supported")


def test_every_array_keeps_its_shape_and_dtype_zero_dimensional_ones_too(tmp_path,
                                                                         hand_built_program):
    program, x = hand_built_program
    program.save(tmp_path / "p.safetensors")
    loaded = PolyProgram.load(tmp_path / "p.safetensors")
    for a, b in zip(loaded.nodes, program.nodes):
        for key, value in b.attrs.items():
            if isinstance(value, np.ndarray):
                assert (a.attrs[key].shape, a.attrs[key].dtype) == (value.shape, value.dtype)
    assert loaded.nodes[3].attrs["value"].shape == ()
    assert loaded.to_bytes() == program.to_bytes()
    assert np.array_equal(loaded.run(x), program.run(x))


def test_the_io_benchmark_runs_on_a_small_model(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "program_io.py"
    spec = importlib.util.spec_from_file_location("program_io_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--model", "padre_vit_mini", "--img-size", "8", "--in-chans", "1",
                      "--runs", "1", "--compiled", "none", "--out", str(tmp_path / "r.json")])
    assert res["same_outputs"] and json.loads((tmp_path / "r.json").read_text())["nodes"] > 0
    for name in ("safetensors", "npz_baseline"):
        assert res[name]["file_bytes"] > 0 and res[name]["load_s"] > 0
    assert res["save_speedup"] > 0 and "framed_load_speedup" in res
