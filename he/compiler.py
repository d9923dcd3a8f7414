"""``he.compile``: trace, certify, calibrate, choose parameters and plan a packing.

A :class:`CompiledProgram` is everything a client and a server agree on: the polynomial program,
the CKKS parameters, the packing and its plan, and the calibrated range of every value. It
serialises to bytes (the program's own ``.npz`` format plus a JSON header; no pickle) and loads
back with the same fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

import numpy as np

from he.container import pack, unpack
from he.errors import NotEncryptableError, SerializationError, TooDeepError
from he.params import RING_DEGREES, CKKSParams, choose_params
from he.plan import VectorPlan, batch_levels, plan_summary, plan_vector
from he.runtime import live_inputs
from polynets.errors import ProgramFormatError, TraceError
from polynets.program import PolyProgram, atomic_write_bytes

__all__ = ["CompiledProgram", "compile", "load_program", "PACKINGS"]

PACKINGS = ("vector", "batch")


def _program_digest(program: PolyProgram) -> str:
    h = hashlib.sha256()
    for node in program.nodes:
        h.update(json.dumps([node.op, list(node.inputs), list(node.shape)]).encode())
        for key in sorted(node.attrs):
            v = node.attrs[key]
            h.update(key.encode())
            if isinstance(v, np.ndarray):
                h.update(str(v.dtype).encode() + str(v.shape).encode())
                h.update(np.ascontiguousarray(v).tobytes())
            else:
                h.update(repr(v).encode())
    h.update(str(program.output).encode())
    return h.hexdigest()


def _noise_gain(program: PolyProgram, maxabs: list[float], rms: list[float],
                packing: str) -> tuple[float, float]:
    """Linearised output error per unit of input (encryption) noise and of rescale noise.

    Independent noise adds in quadrature through a linear map, so a map's gain is the largest
    column 2-norm of its weight; each plaintext multiplication adds one unit for its rescale and
    the rounding of its encoded weights (per unit of input magnitude, summed in quadrature over
    the k inputs, so it scales with the calibrated RMS of the input); products propagate
    worst-case through the calibrated ranges.

    Returns ``(g_in, g_rs)``: the output error is about ``g_in * e_enc + g_rs * e_rescale``.
    """
    # encoded weights round to 1/scale: a scalar (batch) exactly, a slot vector (vector packing)
    # through the canonical embedding, about sqrt(N) times more
    rounding = 1.0 / 12.0 if packing == "batch" else 1.0
    e: list[tuple[float, float]] = []
    for node in program.nodes:
        ins = [e[j] for j in node.inputs]
        a = node.attrs
        if node.op == "input":
            g = (1.0, 0.0)
        elif node.op == "linear":
            w = float(np.sqrt((np.asarray(a["weight"], dtype=np.float64) ** 2).sum(axis=0)).max(
                initial=0.0))
            # + rescale rounding + rounding of the encoded weights times the input's magnitude
            k = np.asarray(a["weight"]).shape[0]
            g = (w * ins[0][0], w * ins[0][1] + 1.0 + rms[node.inputs[0]] * np.sqrt(k) * rounding)
        elif node.op == "mul":
            ma, mb = (maxabs[j] for j in node.inputs)
            g = (ma * ins[1][0] + mb * ins[0][0], ma * ins[1][1] + mb * ins[0][1] + 1.0)
        elif node.op == "add":
            g = (ins[0][0] + ins[1][0], ins[0][1] + ins[1][1])
        elif node.op == "mul_const":
            v = np.asarray(a["value"], dtype=np.float64)
            c = float(np.abs(v).max(initial=0.0))
            exact = bool(np.all(v == np.round(v)))
            g = (c * ins[0][0],
                 c * ins[0][1] + (0.0 if exact else 1.0 + rms[node.inputs[0]] * rounding))
        else:
            g = (max(i[0] for i in ins), max(i[1] for i in ins))
        e.append(g)
    return e[program.output]


def _degree_depth(program: PolyProgram) -> tuple[int, int]:
    from polynets.certify import analyse

    info = analyse(program)[program.output]
    return int(info.degree), int(info.depth)


class CompiledProgram:
    """A polynomial program compiled for CKKS: parameters, packing plan, calibrated ranges.

    Attributes:
        program: the :class:`~polynets.program.PolyProgram` (float64 weights).
        params: the chosen :class:`~he.params.CKKSParams` (``str(params)`` says why).
        packing: ``"vector"`` (one sample per ciphertext) or ``"batch"`` (one per slot).
        calibration: per-node max |value| on the calibration data.
        degree, depth: total degree and ciphertext-ciphertext multiplicative depth.
        plan: the vector-packing plan (None for batch packing).
    """

    def __init__(self, program: PolyProgram, params: CKKSParams, packing: str,
                 calibration: list[float], options: dict[str, Any], certificate: str = ""):
        self.program = program
        self.params = params
        self.packing = packing
        self.calibration = [float(c) for c in calibration]
        self.options = dict(options)
        self.certificate = certificate
        self.degree, self.depth = _degree_depth(program)
        self.plan: VectorPlan | None = None
        if packing == "vector":
            self.plan = plan_vector(program, params.slots,
                                    max_input_ciphertexts=int(options["max_input_ciphertexts"]))
        meta = json.dumps({"params": params.to_dict(), "packing": packing,
                           "options": self.options}, sort_keys=True)
        self.fingerprint = hashlib.sha256(
            (_program_digest(program) + meta).encode()).hexdigest()[:24]

    # ------------------------------------------------------------------ shapes and simulation
    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample as the model sees it (without the batch axis)."""
        return tuple(self.program.input_shape[1:]) if self.program.input_shape[:1] == (1,) \
            else tuple(self.program.input_shape)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.program.output_shape[1:]) if self.program.output_shape[:1] == (1,) \
            else tuple(self.program.output_shape)

    @functools.cached_property
    def batch_inputs(self) -> np.ndarray:
        """Flat indices of the input elements that batch packing encrypts: those that can reach
        the output (e.g. not the pixels a strided convolution skips); int64, ascending."""
        return np.flatnonzero(live_inputs(self.program))

    @property
    def input_range(self) -> float:
        return self.calibration[self.program.input_id]

    @property
    def levels(self) -> int:
        return self.params.levels

    def simulate(self, x: Any) -> np.ndarray:
        """Float64 run of the same program: ``(B, *input_shape) -> (B, *output_shape)``."""
        return self.program.simulate(x)

    def summary(self) -> str:
        lines = [f"compiled program {self.fingerprint} ({self.packing} packing, degree "
                 f"{self.degree}, multiplicative depth {self.depth}, {len(self.program)} ops)",
                 str(self.params)]
        if self.plan is not None:
            s = plan_summary(self.plan)
            lines.append(f"  vector plan: {s['rotations']} rotations ({s['rotation_keys']} Galois "
                         f"keys), {s['plain_mults']} plaintext and {s['ct_mults']} ciphertext "
                         f"multiplications, {s['input_ciphertexts']} input ciphertext(s) per "
                         f"sample")
        else:
            lines.append(f"  batch plan: {self.params.slots} samples per ciphertext, "
                         f"{self.batch_inputs.size} input ciphertexts per group (of "
                         f"{int(np.prod(self.input_shape))} input elements, the others never "
                         f"reach the output)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    __repr__ = __str__

    # ------------------------------------------------------------------ files
    def to_bytes(self) -> bytes:
        header = {"params": self.params.to_dict(), "packing": self.packing,
                  "calibration": self.calibration, "options": self.options,
                  "certificate": self.certificate, "fingerprint": self.fingerprint}
        return pack("compiled-program", header, {"program": [self.program.to_bytes()]})

    @classmethod
    def from_bytes(cls, data: bytes) -> "CompiledProgram":
        """Load bytes from :meth:`to_bytes`; malformed data raises SerializationError."""
        head, blobs = unpack(data, "compiled-program", "compiled program")
        try:
            program = PolyProgram.from_bytes(blobs["program"][0])
            params = CKKSParams.from_dict(head["params"])
            packing = str(head["packing"])
            if packing not in PACKINGS:
                raise SerializationError(f"compiled program: unknown packing {packing!r}")
            calibration = [float(c) for c in head["calibration"]]
            if len(calibration) != len(program.nodes):
                raise SerializationError("compiled program: calibration does not match program")
            prog = cls(program, params, packing, calibration, dict(head["options"]),
                       str(head.get("certificate", "")))
        except (KeyError, IndexError, TypeError, ValueError, ProgramFormatError) as exc:
            if isinstance(exc, SerializationError):
                raise
            raise SerializationError(f"compiled program: malformed ({exc})") from exc
        if prog.fingerprint != head.get("fingerprint"):
            raise SerializationError("compiled program: content does not match its fingerprint "
                                     "(corrupted or edited)")
        return prog

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically to ``path``."""
        atomic_write_bytes(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CompiledProgram":
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise SerializationError(f"cannot read compiled program {os.fspath(path)!r}: "
                                     f"{exc.strerror}; write one with 'polynets compile' or "
                                     f"CompiledProgram.save") from exc
        return cls.from_bytes(data)


def load_program(path: str | os.PathLike) -> CompiledProgram:
    """Load a compiled program written by :meth:`CompiledProgram.save` (runs no code)."""
    return CompiledProgram.load(path)


def _lower(model: Any, example_input: Any) -> tuple[PolyProgram, str]:
    if isinstance(model, PolyProgram):
        return model, ""
    if isinstance(model, CompiledProgram):
        return model.program, model.certificate
    import polynets as pn

    if example_input is None:
        raise NotEncryptableError("he.compile needs an example_input to trace a model")
    try:
        cert = pn.certify(model, example_input)
    except TraceError as exc:
        raise NotEncryptableError(f"the model cannot be compiled to CKKS: {exc}") from exc
    if not cert.is_polynomial or cert.program is None:
        raise NotEncryptableError(f"the model is not a polynomial, so it cannot be encrypted:\n"
                                  f"{cert}", cert)
    return cert.program, str(cert)


def _calibration_data(program: PolyProgram, example_input: Any, calibration: Any) -> np.ndarray:
    data = calibration if calibration is not None else example_input
    if data is None:
        rng = np.random.default_rng(0)
        data = rng.standard_normal((16,) + tuple(program.input_shape[1:]))
    if hasattr(data, "detach"):
        data = data.detach().cpu().double().numpy()
    return np.asarray(data, dtype=np.float64)


def compile(model: Any, example_input: Any = None, *, calibration: Any = None,
            packing: str = "vector", precision_bits: int = 16, ring_degree: int | None = None,
            scale_bits: int | None = None, max_input_ciphertexts: int = 8) -> CompiledProgram:
    """Compile a polynomial model (or a :class:`PolyProgram`) to CKKS.

    Args:
        model: an ``nn.Module`` (traced and certified on ``example_input``) or a PolyProgram.
        example_input: a batch ``(B, *sample)``; also the calibration data by default.
        calibration: data ``(B, *sample)`` whose per-node ranges size the modulus chain; inputs
            outside the input's calibrated range later trigger a CalibrationRangeWarning.
        packing: ``"vector"`` (latency: one sample per ciphertext) or ``"batch"`` (throughput:
            one sample per slot).
        precision_bits: wanted output precision, in bits relative to the output range.
        ring_degree, scale_bits: overrides of the automatic choice (still 128-bit secure).
        max_input_ciphertexts: vector packing may send the input as this many ciphertexts when
            that saves the server its first layer's rotations.

    Raises:
        NotEncryptableError: the model is not a polynomial (message names the modules).
        TooDeepError: more levels than any secure parameter set offers.
    """
    if packing not in PACKINGS:
        raise NotEncryptableError(f"packing must be one of {PACKINGS}, got {packing!r}")
    program, cert = _lower(model, example_input)
    calib = _calibration_data(program, example_input, calibration)
    values = program.run(calib, keep=True)
    maxabs = [float(np.max(np.abs(v), initial=0.0)) for v in values]
    if not all(np.isfinite(maxabs)):
        raise NotEncryptableError("the calibration data drives the model to non-finite values")
    rms = [float(np.sqrt(np.mean(np.square(v)))) if v.size else 0.0 for v in values]
    gain = _noise_gain(program, maxabs, rms, packing)
    out_abs = maxabs[program.output]
    options = {"precision_bits": int(precision_bits),
               "max_input_ciphertexts": int(max_input_ciphertexts)}
    rings = (ring_degree,) if ring_degree is not None else RING_DEGREES
    notes: list[str] = []
    error: TooDeepError | None = None
    for ring in rings:
        if packing == "vector":
            plan = plan_vector(program, ring // 2, max_input_ciphertexts=max_input_ciphertexts)
            if plan.widest > ring // 2:
                notes.append(f"N={ring}: a value needs {plan.widest} slots")
                continue
            levels = plan.levels
            slots_needed = plan.widest
        else:
            levels = max(batch_levels(program))
            slots_needed = 1
        try:
            params = choose_params(levels, max(maxabs), gain, precision_bits=precision_bits,
                                   output_abs=out_abs, slots_needed=slots_needed,
                                   ring_degree=ring, scale_bits=scale_bits,
                                   rotations=packing == "vector" and bool(plan.rotations()))
        except TooDeepError as exc:
            notes.append(f"N={ring}: {levels} levels do not fit")
            error = exc
            continue
        if notes:
            params = dataclasses.replace(params, why=params.why + "; rejected " + "; ".join(notes))
        return CompiledProgram(program, params, packing, maxabs, options, cert)
    if error is not None:
        raise error
    raise TooDeepError("no ring degree holds the program's widest value: " + "; ".join(notes))

