"""Client / server split of encrypted inference.

The :class:`Client` makes the keys and is the only holder of the secret key; it encrypts inputs
and decrypts results. :func:`Client.public_context` exports the public key, the relinearisation
keys and only the Galois keys the program's rotations need. The :class:`Server` runs a compiled
program on :class:`Ciphertext` objects (or their bytes) and never sees a secret key: it refuses a
context that contains one.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import numpy as np
import tenseal.sealapi as seal
from tqdm.auto import tqdm

from he import _kernels, wire
from he.backend import Engine, galois_elements, load_object, save_object
from he.compiler import PACKINGS, CompiledProgram, GroupMemory, batch_group_memory
from he.container import digest, pack, unpack
from he.errors import (CalibrationRangeWarning, HEError, InputShapeError, KeyMismatchError,
                       ParameterError, ResourceError, SecretKeyError, SerializationError,
                       batch_of)
from he.parallel import fork_map, memory_workers, resolve_workers
from he.native import NativeEncryptor, Pool, default_threads
from he.report import ProfileRow, StepProfile, work_words
from he.runtime import (SpillFile, VectorKernels, available_memory, keep_spare, note_pool,
                        pool_held, run_batch, run_vector, spare_buffers, take_spare)
from he.tiling import buffer_bytes, find_segments, row_bytes_of
from he.tokens import TokenKernels, decode_outputs, encode_inputs, run_tokens
from polynets.errors import ConfigError, check_int
from polynets.ir.lowering import client_inputs

__all__ = ["Ciphertext", "Client", "Server"]


class Ciphertext:
    """Encrypted data of a compiled program: inputs from a client or results from a server.

    ``groups``: batch packing -- one group per ``slots`` samples, each a list of one ciphertext
    per element of the sample shape; vector packing -- one group per ``plan.interleave``
    samples (interleaved slot by slot), holding their input ciphertexts (the input and the
    client's input planes) or their single result ciphertext.
    Carries the packing, the program fingerprint and the key-set id, which are checked on use.
    """

    def __init__(self, *, packing: str, fingerprint: str, key_id: str, role: str,
                 n_samples: int, groups: list[list[Any]]):
        self.packing = packing
        self.fingerprint = fingerprint
        self.key_id = key_id
        self.role = role
        self.n_samples = int(n_samples)
        self._groups = groups

    def __len__(self) -> int:
        return self.n_samples

    def __repr__(self) -> str:
        return (f"Ciphertext({self.role}, {self.packing} packing, {self.n_samples} samples, "
                f"{sum(len(g) for g in self._groups)} SEAL ciphertexts, key set {self.key_id})")

    def to_bytes(self) -> bytes:
        """Serialise (each SEAL ciphertext in :mod:`he.wire`'s form, inside a polynets
        container)."""
        blobs = {f"g{i}": [b if _unloaded(b) else wire.dumps(b) for b in g]
                 for i, g in enumerate(self._groups)}
        header = {"packing": self.packing, "fingerprint": self.fingerprint,
                  "key_id": self.key_id, "role": self.role, "n_samples": self.n_samples,
                  "groups": len(self._groups)}
        return pack("ciphertext", header, blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Ciphertext":
        """Parse bytes from :meth:`to_bytes`; SEAL data is validated when the keys' owner uses it.

        Raises :class:`~he.errors.SerializationError` for garbage or truncated bytes.
        """
        # views of ``data`` where it is bytes (immutable), not copies: a batch request is
        # hundreds of MB, whose copy in fresh memory cost its first request seconds
        head, blobs = unpack(data, "ciphertext", "ciphertext", views=True)
        try:
            n_groups = int(head["groups"])
            groups = [list(blobs[f"g{i}"]) for i in range(n_groups)]
            ct = cls(packing=str(head["packing"]), fingerprint=str(head["fingerprint"]),
                     key_id=str(head["key_id"]), role=str(head["role"]),
                     n_samples=int(head["n_samples"]), groups=groups)
        except (KeyError, TypeError, ValueError) as exc:
            raise SerializationError(f"ciphertext: malformed header ({exc!r})") from exc
        if ct.role not in ("input", "output") or n_groups < 1 or ct.n_samples < 1 \
                or n_groups != len(blobs) or ct.n_samples > 2 ** 31 - 1 \
                or ct.packing not in PACKINGS:
            raise SerializationError("ciphertext: malformed header (role/groups/samples/packing)")
        return ct

    def _seal_groups(self, context: Any) -> list[list[Any]]:
        return [_load_group(context, self, gi) for gi in range(len(self._groups))]

    @property
    def nbytes(self) -> int:
        return len(self.to_bytes())


def _unloaded(b: Any) -> bool:
    """Whether a part of a :class:`Ciphertext` is still serialised (bytes, or a view of the
    request it was read from) rather than a SEAL ciphertext."""
    return isinstance(b, (bytes, memoryview))


def _load_group(context: Any, ct: Ciphertext, gi: int) -> list[Any]:
    """SEAL ciphertexts of group ``gi`` of ``ct`` (bytes are loaded and validated)."""
    return [wire.loads(context, b, f"ciphertext part {gi}.{k}")
            if _unloaded(b) else b for k, b in enumerate(ct._groups[gi])]


def _as_ciphertext(ct: Any) -> Ciphertext:
    if isinstance(ct, Ciphertext):
        return ct
    if isinstance(ct, (bytes, bytearray, memoryview)):
        return Ciphertext.from_bytes(bytes(ct))
    raise SerializationError(f"expected an he.Ciphertext or its bytes, got {type(ct).__name__}")


def _check(ct: Ciphertext, prog: CompiledProgram, key_id: str, role: str, who: str) -> None:
    if ct.fingerprint != prog.fingerprint:
        raise KeyMismatchError(
            f"{who}: this ciphertext was made for compiled program {ct.fingerprint}, not "
            f"{prog.fingerprint}; encrypt with a client of the same compiled program")
    if ct.key_id != key_id:
        raise KeyMismatchError(
            f"{who}: this ciphertext was encrypted under key set {ct.key_id}, but the keys here "
            f"are {key_id}; use the public context of the client that encrypted it")
    if ct.packing != prog.packing:
        raise KeyMismatchError(f"{who}: ciphertext uses {ct.packing} packing, the program "
                               f"{prog.packing}")
    if ct.role != role:
        raise KeyMismatchError(f"{who}: expected an {role} ciphertext, got an {ct.role} one")
    groups = -(-ct.n_samples // prog.samples_per_ciphertext)
    if len(ct._groups) != groups:
        raise SerializationError(f"{who}: {ct.n_samples} samples fill {groups} ciphertext "
                                 f"group(s) of {prog.samples_per_ciphertext}, but the ciphertext "
                                 f"holds {len(ct._groups)} (corrupted or edited header)")


def _check_program(program: Any, who: str) -> None:
    """Refuse anything but a compiled program, naming what was given and where one comes from."""
    if not isinstance(program, CompiledProgram):
        raise ParameterError(f"{who} needs a compiled program (he.compile(model, x), or "
                             f"he.load_program(path) for a file), got "
                             f"{type(program).__name__}")


def _check_key_memory(program: CompiledProgram, doing: str) -> None:
    """Refuse, before SEAL allocates them, keys that alone exceed the memory available."""
    need, free = program.key_bytes(), available_memory()
    if need > free:
        gib = 2.0 ** 30
        raise ResourceError(
            f"{doing} needs {need / gib:.1f} GiB for the keys alone "
            f"({len(program.plan.galois_steps())} Galois keys at N="
            f"{program.params.poly_modulus_degree}, {program.params.data_primes} data primes), "
            f"more than the {free / gib:.1f} GiB available; compile with memory_budget= the "
            f"memory there is (rotations are then composed from a power-of-two key basis), or "
            f"with fewer bits of precision or a shallower model for a shorter chain")


def _seal_call(fn: Callable[[], Any], what: str) -> Any:
    try:
        return fn()
    except HEError:
        raise
    except (ValueError, RuntimeError, TypeError) as exc:
        raise KeyMismatchError(f"{what} failed inside SEAL ({exc}); the ciphertext does not fit "
                               f"these keys or parameters") from exc


class Client:
    """Key owner: makes keys, encrypts inputs, decrypts results.

    ``Client(program)`` generates a fresh key set; ``Client.from_secret_context(program, data)``
    reloads one saved with :meth:`secret_context`. ``threads``: threads that encrypt a request's
    ciphertexts at once in this process (default: every core it may use), where SEAL's
    encryption can be called without the GIL (:class:`he.native.NativeEncryptor`; otherwise
    one); the ciphertexts decrypt to the same values whatever the number.
    """

    def __init__(self, program: CompiledProgram, *, threads: int | None = None,
                 _secret: bytes | None = None):
        _check_program(program, "he.Client")
        self.program = program
        if threads is not None:
            check_int(threads, "Client threads", error=ParameterError)
        if _secret is None:
            _check_key_memory(program, "making this program's keys")
        self.threads = default_threads() if threads is None else int(threads)
        self._native: NativeEncryptor | None = None
        self._pool = Pool(self.threads)
        self.engine = Engine(program.params)
        ctx = self.engine.context
        if _secret is None:
            keygen = seal.KeyGenerator(ctx)
            self._secret_key = keygen.secret_key()
            self.public_key = seal.PublicKey()
            keygen.create_public_key(self.public_key)
            # the keys only a server uses are made in SEAL's seeded form, each key's random
            # half replaced by its seed (half the bytes; the server regenerates it as it
            # loads them), and kept here as those bytes alone
            self._relin_bytes = save_object(keygen.create_relin_keys())
            self._galois_bytes: bytes | None = None
            steps = program.plan.galois_steps()
            if steps:
                elements = galois_elements(steps, program.params.poly_modulus_degree)
                self._galois_bytes = save_object(keygen.create_galois_keys(elements),
                                                 large=True)
            self._public_key_bytes = save_object(self.public_key)
            self.key_id = key_set_id(self._public_key_bytes)
        else:
            head, blobs = _unpack_context(_secret, ("secret-context",), program)
            self.key_id = str(head["key_id"])
            self._secret_key = load_object(seal.SecretKey, ctx, blobs["secret_key"][0],
                                           "secret key")
            self._public_key_bytes = bytes(blobs["public_key"][0])
            self.public_key = load_object(seal.PublicKey, ctx, self._public_key_bytes,
                                          "public key")
            # passed on to servers as they are (a server validates them as it loads them)
            self._relin_bytes = bytes(blobs["relin_keys"][0])
            self._galois_bytes = bytes(blobs["galois_keys"][0]) if blobs["galois_keys"] \
                else None
        # the key owner encrypts with the secret key: half the work of public-key encryption and
        # less noise; servers only ever see public material
        self._encryptor = seal.Encryptor(ctx, self.public_key, self._secret_key)
        self._decryptor = seal.Decryptor(ctx, self._secret_key)

    # ------------------------------------------------------------------ keys
    def _public_blobs(self) -> dict[str, list[bytes]]:
        return {"public_key": [self._public_key_bytes], "relin_keys": [self._relin_bytes],
                "galois_keys": [self._galois_bytes] if self._galois_bytes else []}

    def public_context(self) -> bytes:
        """Public, relinearisation and the needed Galois keys (no secret key), as bytes."""
        return pack("public-context", {"fingerprint": self.program.fingerprint,
                                       "key_id": self.key_id}, self._public_blobs())

    def secret_context(self) -> bytes:
        """Everything, secret key included: keep it on the client side only."""
        blobs = self._public_blobs()
        blobs["secret_key"] = [save_object(self._secret_key)]
        return pack("secret-context", {"fingerprint": self.program.fingerprint,
                                       "key_id": self.key_id}, blobs)

    @classmethod
    def from_secret_context(cls, program: CompiledProgram, data: bytes, *,
                            threads: int | None = None) -> "Client":
        return cls(program, threads=threads, _secret=data)

    # ------------------------------------------------------------------ encrypt / decrypt
    def _check_input(self, x: Any) -> np.ndarray:
        if hasattr(x, "detach"):
            x = x.detach().cpu().double().numpy()
        try:
            x = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputShapeError(f"encrypt expects a batch of real numbers of shape "
                                  f"{batch_of(self.program.input_shape)}, got "
                                  f"{type(x).__name__} ({exc})") from None
        want = self.program.input_shape
        if x.ndim != len(want) + 1 or tuple(x.shape[1:]) != want:
            raise InputShapeError(f"encrypt expects a batch of shape {batch_of(want)}, got "
                                  f"{tuple(x.shape)}")
        if x.shape[0] < 1:
            raise InputShapeError("encrypt needs at least one sample")
        if not np.all(np.isfinite(x)):
            raise InputShapeError("encrypt got NaN or infinite values")
        calibrated = self.program.input_range
        peak = float(np.max(np.abs(x)))
        params = self.program.params
        # an encoded input must fit the modulus it is encrypted under (all but the special prime)
        bits = sum(params.coeff_mod_bit_sizes[:-1]) - params.scale_bits_at(0) - 1
        if peak >= 2.0 ** bits:
            raise InputShapeError(f"encrypt got |x| = {peak:.4g}; these parameters hold values "
                                  f"below 2^{bits} (calibrated input range {calibrated:.4g}); "
                                  f"recompile with calibration data that covers these inputs")
        if calibrated > 0 and peak > calibrated * (1 + 1e-9):
            ratio = peak / calibrated
            d = max(1, self.program.degree)
            growth = ratio ** d
            params = self.program.params
            headroom = params.coeff_mod_bit_sizes[0] - params.scale_bits - 1
            warnings.warn(CalibrationRangeWarning(
                f"inputs reach |x| = {peak:.4g}, {ratio:.3g}x the calibrated range "
                f"{calibrated:.4g}; a degree-{d} program may grow intermediate values up to "
                f"{growth:.3g}x, losing about {math.log2(growth):.1f} bits of precision (expected "
                f"output error up to ~{params.expected_error * growth:.2e}) and overflowing the "
                f"modulus if values pass 2^{headroom}; "
                f"recompile with calibration data that covers these inputs"), stacklevel=3)
        return x

    def _encrypt_vector(self, values: np.ndarray) -> bytes:
        """One slot vector encrypted with the secret key, serialised seeded: the random half
        of the ciphertext is replaced by its seed, so it is half the size and the reader
        regenerates it when loading (:func:`he.wire.encrypt_bytes`)."""
        eng = self.engine
        pt = eng.encode_vector(values, 0, eng.scales[0])
        return wire.encrypt_bytes(pt, self._encryptor, self._native_encryptor())

    def _native_encryptor(self) -> NativeEncryptor:
        """The native encryptor (:class:`he.native.NativeEncryptor`), validated once: where it
        is usable, it encrypts without the GIL and its ciphertexts are written in the compact
        form (:mod:`he.wire`), whatever the number of threads."""
        if self._native is None:
            eng = self.engine
            probe = eng.encode_vector(np.linspace(-1.0, 1.0, eng.slots), 0, eng.scales[0])
            self._native = NativeEncryptor(eng.context, self._encryptor, self._decryptor,
                                           eng.encoder, probe)
        return self._native

    def _encryption_threads(self, n: int) -> int:
        """Threads that encrypt ``n`` ciphertexts here: :attr:`threads` where SEAL's encryption
        runs without the GIL (validated once, :meth:`_native_encryptor`), else one."""
        if self.threads < 2 or n < 2:
            return 1
        return min(self.threads, n) if self._native_encryptor().ok else 1

    def encrypt(self, x: Any, progress: bool = False, workers: int = 1) -> Ciphertext:
        """Encrypt a batch ``x`` of shape ``(B, *input_shape)``.

        Batch packing: ``ceil(B / slots)`` groups of one ciphertext per input element that can
        reach the output (``program.batch_inputs``, the same for every input); vector
        packing: one group per ``plan.interleave`` samples (one ciphertext, or the plan's input
        planes), the samples interleaved slot by slot.
        ``workers``: processes that encode, encrypt and serialise (``0``: one per CPU core); with
        one, the client's :attr:`threads` encrypt at once where they can; the ciphertexts
        decrypt to the same values whatever the number.
        """
        x = self._check_input(x)
        b = x.shape[0]
        flat = x.reshape(b, -1)
        slots = self.engine.slots
        columns: list[np.ndarray] = []
        sizes: list[int] = []
        if self.program.packing == "batch":
            live = self.program.batch_inputs
            for start in range(0, b, slots):
                block = np.ascontiguousarray(flat[start:start + slots, live].T)
                columns.extend(block)
                sizes.append(block.shape[0])
        elif self.program.packing == "tokens":
            k = self.program.plan.interleave
            for start in range(0, b, k):
                vecs = encode_inputs(self.program.plan, flat[start:start + k])
                columns.extend(vecs)
                sizes.append(len(vecs))
        else:
            plan = self.program.plan
            k = plan.interleave
            for start in range(0, b, k):
                # the input, and the values of the first maps where the client applies them
                block = client_inputs(self.program.lowered, flat[start:start + k])
                ext = np.concatenate([block, np.zeros((block.shape[0], 1))], axis=1)
                for idx in plan.input_layout:
                    vec = np.zeros((idx.size, k))
                    vec[:, :block.shape[0]] = ext[:, np.where(idx < 0, ext.shape[1] - 1, idx)].T
                    columns.append(vec.ravel())
                sizes.append(len(plan.input_layout))
        n_workers = resolve_workers(workers)
        threads = self._encryption_threads(len(columns)) if n_workers == 1 else 1
        if threads > 1:
            with tqdm(total=len(columns), desc="encrypt", disable=not progress,
                      leave=False) as bar:
                def one(j: int) -> bytes:
                    blob = self._encrypt_vector(columns[j])
                    bar.update()
                    return blob
                blobs = iter(self._pool.map(one, range(len(columns))))
        else:
            chunks = np.array_split(np.arange(len(columns)), max(
                1, len(columns) if n_workers == 1 else min(len(columns), 8 * n_workers)))
            parts = fork_map(lambda i: [self._encrypt_vector(columns[j]) for j in chunks[i]],
                             len(chunks), n_workers, desc="encrypt", progress=progress)
            blobs = iter([blob for part in parts for blob in part])
        groups: list[list[Any]] = [[next(blobs) for _ in range(size)] for size in sizes]
        return Ciphertext(packing=self.program.packing, fingerprint=self.program.fingerprint,
                          key_id=self.key_id, role="input", n_samples=b, groups=groups)

    def decrypt(self, ct: Any) -> np.ndarray:
        """Decrypt a server result to an array of shape ``(B, *output_shape)``."""
        ct = _as_ciphertext(ct)
        _check(ct, self.program, self.key_id, "output", "decrypt")
        groups = ct._seal_groups(self.engine.context)
        eng = self.engine
        out_n = int(np.prod(self.program.output_shape, dtype=np.int64))

        def dec(c: Any) -> np.ndarray:
            pt = seal.Plaintext()
            self._decryptor.decrypt(c, pt)
            return np.asarray(eng.encoder.decode_double(pt))

        rows = []
        if self.program.packing == "batch":
            post = self.program.lowered.post
            # the output's elements, or the sums the client's last map reads (per value)
            counts = [out_n] if post is None else post.returned()
            remaining = ct.n_samples
            for g in groups:
                if len(g) != sum(counts):
                    raise SerializationError(f"decrypt: a result group holds {len(g)} "
                                             f"ciphertexts, expected {sum(counts)}")
                take = min(remaining, eng.slots)
                cols = [_seal_call(lambda c=c: dec(c), "decryption")[:take] for c in g]
                if post is None:
                    rows.append(np.stack(cols, axis=1))
                else:
                    ends = np.cumsum(counts)
                    rows.append(post.apply_returned(
                        [np.stack(cols[e - c:e], axis=1)
                         for e, c in zip(ends, counts)]))
                remaining -= take
        elif self.program.packing == "tokens":
            plan = self.program.plan
            k = plan.interleave
            width = plan.steps[plan.output].width
            if len(groups) != -(-ct.n_samples // k) or any(len(g) != width for g in groups):
                raise SerializationError(f"decrypt: a tokens-packed result needs {width} "
                                         f"ciphertexts per {k} samples")
            remaining = ct.n_samples
            for g in groups:
                take = min(remaining, k)
                vecs = [_seal_call(lambda c=c: dec(c), "decryption") for c in g]
                rows.append(decode_outputs(plan, vecs, take))
                remaining -= take
        else:
            plan = self.program.plan
            k = plan.interleave
            results = plan.results
            if len(groups) != -(-ct.n_samples // k) or \
                    any(len(g) != len(results) for g in groups):
                raise SerializationError(f"decrypt: a vector result needs {len(results)} "
                                         f"ciphertext(s) per {k} sample(s)")
            post = self.program.lowered.post
            remaining = ct.n_samples
            for g in groups:
                take = min(remaining, k)
                values = []
                for c, si in zip(g, results):
                    vec = _seal_call(lambda c=c: dec(c), "decryption").reshape(-1, k)
                    values.append(vec[plan.steps[si].slots_of, :take].T)
                # the program's last map, where the client applies it (in float64)
                rows.append(values[0] if post is None else post.apply(values))
                remaining -= take
        y = np.concatenate(rows, axis=0)
        return y.reshape((ct.n_samples,) + self.program.output_shape)


def _unpack_context(data: Any, kinds: tuple[str, ...], program: CompiledProgram
                    ) -> tuple[dict[str, Any], dict[str, list[bytes]]]:
    head, blobs = unpack(data, ("public-context", "secret-context"), "context", views=True)
    if head["kind"] not in kinds:
        if head["kind"] == "secret-context":
            raise SecretKeyError("this context contains the client's secret key; a server must "
                                 "only receive client.public_context()")
        raise SecretKeyError("this context has no secret key; a client needs the secret "
                             "context it saved")
    if head.get("fingerprint") != program.fingerprint:
        raise KeyMismatchError(f"context made for compiled program {head.get('fingerprint')}, "
                               f"not {program.fingerprint}; use keys of the same compiled program")
    for name in ("public_key", "relin_keys", "galois_keys"):
        if name not in blobs:
            raise SerializationError(f"context: missing {name.replace('_', ' ')}")
    if "key_id" not in head:
        raise SerializationError("context: missing key set id")
    if head["key_id"] != key_set_id(blobs["public_key"][0]):
        raise KeyMismatchError("context: its key set id does not name its public key "
                               "(relabelled from another key set, or corrupted)")
    return head, blobs


def key_set_id(public_key_bytes: bytes) -> str:
    """A key set's id: a digest of its serialised public key, so a label cannot be moved."""
    return digest(public_key_bytes)[:16]


def _load_public(ctx: Any, blobs: dict[str, list[bytes]]) -> tuple[Any, Any, Any]:
    pk = load_object(seal.PublicKey, ctx, blobs["public_key"][0], "public key")
    rk = load_object(seal.RelinKeys, ctx, blobs["relin_keys"][0], "relinearisation keys")
    gk = (load_object(seal.GaloisKeys, ctx, blobs["galois_keys"][0], "Galois keys")
          if blobs["galois_keys"] else None)
    return pk, rk, gk


#: the most seconds the cost model may predict a vector server's first run, and its timing of
#: its threads against one, to take as it starts (:meth:`Server.warm`)
THREAD_TRIAL_SECONDS = 2.0
#: runs on each number of threads that timing takes at most (alternating)
THREAD_TRIAL_ROUNDS = 3


def _seconds_option(value: Any) -> float | None:
    """A program's predicted seconds (``value``, read from a file: anything) as a positive
    finite float, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def _predicted(options: dict[str, Any]) -> float | None:
    """The compiler's predicted seconds per ciphertext (group) on the threads it chose."""
    pred = options.get("predicted")
    return _seconds_option(pred.get("seconds_per_ciphertext")) if isinstance(pred, dict) \
        else None


class Server:
    """Runs a compiled program on ciphertexts with public keys only.

    ``Server(program, public_context)``: ``public_context`` is :meth:`Client.public_context`'s
    bytes; a context holding a secret key is refused with :class:`~he.errors.SecretKeyError`.
    ``memory_budget``: bytes of encoded plaintexts (vector packing's diagonals) to keep; those
    beyond it are encoded at each use (default: half the memory available); in batch packing,
    bytes a group may hold (default: the memory available), beyond which segments of its steps
    run in tiles (:mod:`he.tiling`; same results, less memory), and where no number of tiles
    fits, tiles that spill the rows they hold for later tiles to disk (:func:`he.tiling.spills`,
    :attr:`spilled` counts them). Where the program was compiled with a ``memory_budget``, the
    default is what that budget leaves beside the keys
    (:meth:`~he.compiler.CompiledProgram.server_room`), so that the server plans as the
    compiler did. ``threads``:
    threads that rotate one sample's values at once (vector packing), or compute a group's
    ciphertext products and rescales (batch packing; divided among the processes of
    :meth:`run`'s ``workers``); default: those the compiler chose,
    ``program.options["server_threads"]`` and why in ``["threads_why"]``, on no more cores
    than this process may use; SEAL is then called without Python's GIL, see
    :mod:`he.native`, and ``threads_note`` says why not where that is unavailable. A vector
    server on the compiler's threads times them against one as it starts and keeps the faster
    (:meth:`warm`, :attr:`threads_why`). Results are the same whatever the number. A vector
    program compiled with hoisting (the default where numba is installed) rotates its baby
    steps from one decomposition per input (:mod:`he.hoist`, validated against SEAL as the
    server starts); ``hoist_note`` says why not where that is unavailable, and SEAL then
    rotates them one by one. ``warm``: prepare now what the first request would (vector
    packing runs one and times its threads, batch packing allocates a group's ciphertext
    memory, tokens packing builds its fused maps and encodes its weights, :meth:`warm`), so
    that it runs at the speed of the next ones.
    """

    def __init__(self, program: CompiledProgram, public_context: bytes, *,
                 memory_budget: int | None = None, threads: int | None = None,
                 warm: bool = True):
        _check_program(program, "he.Server")
        if not isinstance(public_context, (bytes, bytearray, memoryview)):
            raise SerializationError(f"Server needs the public context as bytes, got "
                                     f"{type(public_context).__name__}")
        self.program = program
        if memory_budget is None:
            memory_budget = program.server_room()
        head, blobs = _unpack_context(public_context, ("public-context",), program)
        if "secret_key" in blobs:
            raise SecretKeyError("the public context carries a secret key; refusing it")
        _check_key_memory(program, "loading this program's keys")
        self.key_id = str(head["key_id"])
        self.engine = Engine(program.params)
        pk, rk, gk = _load_public(self.engine.context, blobs)
        self.engine.relin_keys = rk
        self.engine.galois_keys = gk
        if program.packing == "vector" and program.plan.key_steps is not None:
            self.engine.key_steps = frozenset(program.plan.key_steps)
        self._encryptor = seal.Encryptor(self.engine.context, pk)
        self.context_bytes = len(public_context)
        #: why the plan's hoisted baby steps rotate with SEAL one by one ("" where they are
        #: hoisted, or the plan hoists none)
        self.hoist_note = ""
        if program.packing == "vector" and gk is not None and program.plan.uses_hoister:
            self.hoist_note = self.engine.use_hoisting(self._encrypt_constant(1.0),
                                                       program.plan.galois_steps()[0])
            self.engine.share_rotations = program.plan.shares_rotations
        self.kernels = VectorKernels(self.engine, program.plan, memory_budget) \
            if program.packing == "vector" else None
        self.token_kernels = TokenKernels(self.engine, program.plan) \
            if program.packing == "tokens" else None
        self.threads_note = ""
        self._tiles: dict[int, int] = {}
        #: the tiles spill the rows they hold for later tiles to disk (he.tiling.spills)
        self._spill = False
        #: rows this server has written to disk and read back (batch packing, in tiles that
        #: would not fit otherwise)
        self.spilled = 0
        #: product steps the last request left unrelinearised
        self._lazy: tuple[int, ...] = ()
        #: segments of steps a group can run in tiles, found when a group first needs them
        self._segments: list[Any] | None = None
        self._memory_budget = memory_budget
        #: the ciphertext sizes this server allocates (see he.runtime.pool_held)
        self._pool_key = (program.params.poly_modulus_degree,
                          tuple(program.params.coeff_mod_bit_sizes))
        #: bytes and seconds :meth:`warm` took (0 where it did nothing)
        self.warm_bytes, self.warm_seconds = 0, 0.0
        #: tokens packing: a group has run, so its weights and masks are encoded and kept
        self._tokens_ready = False
        #: vector packing: the median seconds of a run on each number of threads timed as the
        #: server started (:meth:`warm`; empty where it timed none), and why it runs on the
        #: threads it does
        self.threads_trial: dict[int, float] = {}
        self.threads_why = str(program.options.get("threads_why", ""))
        #: the threads may be timed against one (the compiler chose them, the caller did not)
        self._may_trial = threads is None and program.server_threads > 1
        if threads is not None:
            check_int(threads, "Server threads", error=ParameterError)
            self.threads_why = f"{threads} server thread(s), as asked"
        if threads is None:
            # the compiler's choice, on no more cores than this process may use
            threads = min(program.server_threads, default_threads())
        if self.kernels is not None and program.plan.galois_steps():
            self.threads_note = self.engine.use_threads(
                threads, self._encrypt_constant(1.0), program.plan.galois_steps()[0])
        elif program.packing in ("batch", "tokens"):
            steps = program.plan.galois_steps() if program.packing == "tokens" else []
            self.threads_note = self.engine.use_threads(threads, self._encrypt_constant(1.0),
                                                        steps[0] if steps else None)
            if any(program.options.get("fused_fanin") or ()) or \
                    program.options.get("lazy_products"):
                # the fused maps' compiled loops (which the maps reading lazy products use too,
                # whatever the fan-in) are built and checked once per process (about a
                # second): at the server's start, not in its first request
                _kernels.kernels()
        if warm:
            self.warm()

    def warm(self) -> float:
        """Prepare for the first request what the next ones reuse, so that it runs as the cost
        model predicts; returns the seconds it took (``warm_seconds``; 0 where there is nothing
        to prepare).

        * Vector packing encodes its plaintexts as the server starts anyway; an encryption of
          zero runs through the program once (a first request ran 2.4x as long as the next ones
          on the hand-designed network of ``benchmarks/he_inference.py``: the first touches of
          the server's memory). Where it runs on the several
          threads the compiler chose (not on threads the caller asked for), it then runs on
          one thread and on those threads in turn, and the server keeps the faster
          (:attr:`threads_trial`, :attr:`threads_why`; the results are the same words either
          way): the cost model prices the threads' share of the work, not how the machine
          serves them (other processes on its cores, the Python work between SEAL calls).
          Nothing runs where the cost model predicts a run to take over
          :data:`THREAD_TRIAL_SECONDS`, and the threads are not timed where that would
          (:data:`THREAD_TRIAL_ROUNDS` runs on each).

        * Batch packing: allocate and write the ciphertexts one group writes its results
          into, in NTT form (each a copy of an encryption of zero, the server's own with the
          public key, at its level: the fused maps write their results word by word into
          buffers that must have the form already), inputs loaded from bytes among them
          (tiles as the memory available now asks for,
          :func:`he.compiler.batch_group_memory`; ``warm_bytes``), less those this process
          already holds free (another server's of the same parameters, an earlier group's).
          A group takes them as its free buffers, the smallest that holds each result, and
          leaves its own free ones for the next. A process's first touch of fresh memory costs
          the kernel a page fault and zeroing per page, a few seconds per GiB on some virtual
          machines. Where the group would not fit the memory available, nothing is allocated
          (the request will say why).
        * Tokens packing: one group of encryptions of zero (the server's own, with the public
          key) runs through the program: the fused maps are built, the slot-vector weights and
          masks encoded, the group's memory allocated, as the first request would; nothing
          where that is predicted not to fit the memory available (the request will say why).
        """
        t0 = time.perf_counter()
        if self.program.packing == "batch":
            free = self._free_memory()
            mem = self._group_memory(free, keep=False)
            if mem.working > free:
                return 0.0
            # what this process holds already (another server's, an earlier group's) serves too
            have = spare_buffers(self._pool_key)
            made = self.engine.prefault({b: k - have.get(b, 0) for b, k in mem.buffers.items()
                                         if k > have.get(b, 0)},
                                        like=self._encrypt_constant(0.0))
            keep_spare(self._pool_key, made)
            self.warm_bytes = int(buffer_bytes(mem.buffers))
            note_pool(self._pool_key, buffer_bytes(spare_buffers(self._pool_key)))
        elif self.program.packing == "tokens":
            if self._tokens_need() > self._free_memory(pool=False):
                return 0.0          # the request will say why
            zeros = [self._encrypt_constant(0.0) for _ in self.program.plan.input_layout]
            self._run_group(zeros)
            self._tokens_ready = True
        elif not self._warm_vector():
            return 0.0
        self.warm_seconds = time.perf_counter() - t0
        return self.warm_seconds

    def _warm_vector(self) -> bool:
        """Vector packing (:meth:`warm`): one untimed run, then where the threads may be timed,
        runs on one thread and on the engine's threads in turn, keeping the faster; False
        where nothing ran."""
        eng, prog = self.engine, self.program
        threads = eng.pool.threads
        many = _predicted(prog.options)
        if self.kernels is None or many is None or many > THREAD_TRIAL_SECONDS:
            return False            # a long run (or a program saved without predictions)
        zeros = [self._encrypt_constant(0.0) for _ in prog.plan.input_layout]
        self._run_group(zeros)          # first touches of the server's memory
        one = prog.options.get("predicted_one_thread_s")     # checked as the program loaded
        if not self._may_trial or threads < 2 or one is None:
            return True
        rounds = min(THREAD_TRIAL_ROUNDS, int((THREAD_TRIAL_SECONDS - many) // (one + many)))
        if rounds < 2:
            self.threads_why += (f"; not timed against one thread as the server started "
                                 f"(predicted {2 * (one + many):.1f} s)")
            return True
        many_pool, one_pool = eng.pool, Pool(1)
        times: dict[int, list[float]] = {1: [], threads: []}
        for r in range(rounds):
            for pool in (one_pool, many_pool) if r % 2 == 0 else (many_pool, one_pool):
                eng.pool = pool
                t0 = time.perf_counter()
                self._run_group(zeros)
                times[pool.threads].append(time.perf_counter() - t0)
        self.threads_trial = {n: float(np.median(t)) for n, t in times.items()}
        t1, tn = self.threads_trial[1], self.threads_trial[threads]
        eng.pool = many_pool if tn <= t1 else one_pool
        self.threads_why = (
            f"{eng.pool.threads} server thread(s): timed as the server started, {threads} "
            f"threads ran a request in {tn * 1e3:.1f} ms, one in {t1 * 1e3:.1f} ms (median of "
            f"{rounds}; predicted {many * 1e3:.1f} and {one * 1e3:.1f} ms)")
        return True

    @property
    def predicted_seconds(self) -> float | None:
        """The cost model's seconds for one request on the threads this server runs on (vector
        packing; a batch or tokens group; None where the program does not say)."""
        opts = self.program.options
        if self.program.packing == "vector" and self.engine.pool.threads == 1 \
                and self.program.server_threads > 1:
            return opts.get("predicted_one_thread_s")    # checked as the program loaded
        return _predicted(opts)

    def _free_memory(self, pool: bool = True) -> float:
        """Bytes a batch group of this process may hold: the memory available and, with
        ``pool``, what SEAL's pool kept from this process's earlier groups (or :meth:`warm`;
        forked processes cannot use it), within the budget."""
        free = float(available_memory() + (pool_held(self._pool_key) if pool else 0))
        if self._memory_budget is not None:
            free = min(free, float(self._memory_budget))
        return free

    def _tokens_need(self) -> float:
        """Tokens packing: bytes a group is predicted to take beyond the keys this server
        holds: its ciphertexts at their peak and, until a group has run (:meth:`warm` or a
        request), the slot-vector weights and masks it encodes and keeps."""
        pred = self.program.plan.predicted
        working = float(pred.get("working_memory_bytes", 0))
        if self._tokens_ready:
            return working
        return max(working, float(pred.get("server_memory_bytes", 0)) - self.program.key_bytes())

    @property
    def tiles(self) -> dict[int, int]:
        """Batch packing: the segments of steps (by the step they end at) that the last request
        ran in tiles, and in how many (:mod:`he.tiling`; empty where a group fit whole)."""
        return dict(self._tiles)

    def _group_memory(self, free: float, keep: bool) -> GroupMemory:
        """Tiles per segment that keep a group within ``free`` bytes, its working memory, the
        product steps it leaves lazy and the buffers it allocates
        (:func:`he.compiler.batch_group_memory`); the segments are
        looked for the first time a group does not fit whole (a search of seconds for deep
        programs)."""
        prog = self.program
        args = (prog.lowered, prog.plan.live, prog.params, free)
        lazy = tuple(prog.options.get("lazy_products", ()))
        first = bool(prog.options.get("lazy_in_tiles", False))
        mem = batch_group_memory(*args, self._segments or [], keep_inputs=keep, lazy=lazy,
                                 lazy_in_tiles=first)
        if self._segments is None and (mem.working > free or (lazy and first and not mem.lazy)):
            self._segments = find_segments(prog.lowered, prog.plan.live, row_bytes_of(
                prog.lowered, prog.params.poly_modulus_degree, prog.params.limbs),
                keep_inputs=False)
            mem = batch_group_memory(*args, self._segments, keep_inputs=keep, lazy=lazy,
                                     lazy_in_tiles=first)
        return mem

    @property
    def lazy_products(self) -> tuple[int, ...]:
        """Batch packing: the product steps the last request left unrelinearised and unrescaled
        for the maps that read them (``program.options["lazy_products"]`` where the group fit
        with them, whole or in tiles without spilling; else empty)."""
        return tuple(self._lazy)

    def _encrypt_constant(self, value: float) -> Any:
        eng = self.engine
        pt = eng.encode_vector(np.full(eng.slots, value), 0, eng.scales[0])
        ct = seal.Ciphertext()
        self._encryptor.encrypt(pt, ct)
        return ct

    def _run_group(self, g: list[Any], owned: bool = False, gi: int = 0) -> list[Any]:
        """One group's outputs; ``owned``: ``g`` was loaded for this call alone (from bytes),
        so its ciphertexts are freed as soon as the steps reading them have run. Batch packing
        takes ``g`` (group ``gi`` of a request) as given, bytes or SEAL ciphertexts: bytes are
        validated first and, where a segment run in tiles reads every input, each is loaded in
        the tile that first reads it (:attr:`he.tiling.Segment.load`), else all at once."""
        prog = self.program
        if prog.packing == "batch":
            live = prog.batch_inputs
            if len(g) != live.size:
                raise SerializationError(f"server: an input group holds {len(g)} ciphertexts, "
                                         f"expected {live.size}")
            ctx = self.engine.context
            by_end = {seg.end: seg for seg in self._segments or ()}
            tiles = [(by_end[e], k) for e, k in self._tiles.items()]
            part = {id(b): k for k, b in enumerate(g)}

            def load(k: int, b: Any, into: Any = None) -> Any:
                return wire.loads(ctx, b, f"ciphertext part {gi}.{k}", into) \
                    if _unloaded(b) else b

            # bytes handed over are loaded by the evaluation into its free buffers: all first,
            # or each in the tile that first reads it (every part validated here first)
            if owned and any(seg.load is not None for seg, k in tiles if k > 1):
                self.engine.pool.map(
                    lambda kb: wire.check(ctx, kb[1], f"ciphertext part {gi}.{kb[0]}"),
                    [(k, b) for k, b in enumerate(g) if _unloaded(b)])
            elif not owned:
                g = [load(k, b) for k, b in enumerate(g)]
            full: list[Any] = [0.0] * int(np.prod(prog.input_shape, dtype=np.int64))
            for k, c in zip(live, g):
                full[k] = c
            if owned:
                g.clear()
            fanin = prog.options.get("fused_fanin")
            spare = take_spare(self._pool_key)
            spill = SpillFile() if self._spill and tiles else None
            try:
                res = _seal_call(lambda: run_batch(
                    self.engine, prog.lowered, prog.plan.live, full, fanin=fanin, tiles=tiles,
                    own_inputs=owned, lazy=self._lazy,
                    load=(lambda b, into: load(part.get(id(b), -1), b, into)) if owned else None,
                    spare=spare,
                    spill=spill), "evaluation")
            finally:
                keep_spare(self._pool_key, spare)
                if spill is not None:
                    self.spilled += spill.written
                    spill.close()
            return [self._encrypt_constant(e) if isinstance(e, float) else e for e in res]
        if prog.packing == "tokens":
            assert self.token_kernels is not None
            n_in = len(prog.plan.input_layout)
            if len(g) != n_in:
                raise SerializationError(f"server: an input group holds {len(g)} "
                                         f"ciphertexts, expected {n_in}")
            res = _seal_call(lambda: run_tokens(self.engine, prog.plan, self.token_kernels, g),
                             "evaluation")
            return [self._encrypt_constant(e) if isinstance(e, float) else e for e in res]
        plan = prog.plan
        assert plan is not None and self.kernels is not None
        n_in = len(plan.input_layout)
        if len(g) != n_in:
            raise SerializationError(f"server: a sample holds {len(g)} input ciphertexts, "
                                     f"expected {n_in}")
        return _seal_call(lambda: run_vector(self.engine, plan, self.kernels, g), "evaluation")

    def _group_of(self, ct: Ciphertext, i: int) -> list[Any]:
        """Group ``i`` of a request as :meth:`_run_group` takes it: batch packing loads its own
        (some parts maybe later), the other packings get SEAL ciphertexts."""
        if self.program.packing == "batch":
            return list(ct._groups[i])
        return _load_group(self.engine.context, ct, i)

    def run(self, ct: Any, progress: bool = False, workers: int = 1) -> Ciphertext:
        """Evaluate the program on encrypted inputs; returns the encrypted outputs.

        ``workers``: processes that evaluate independent groups (batch packing: groups of
        ``slots`` samples; vector packing: samples) at the same time (``0``: one per CPU core,
        and in batch packing no more than the available memory holds); results are the same
        whatever the number. Raises :class:`~he.errors.ResourceError`, before evaluating
        anything, where a batch-packed group (or ``workers`` of them) is predicted to need
        more memory than is available.
        """
        ct = _as_ciphertext(ct)
        _check(ct, self.program, self.key_id, "input", "server")
        if self.program.packing == "vector":
            n_workers = resolve_workers(workers)
        elif self.program.packing == "tokens":
            # as many processes as the memory holds, each a group's ciphertexts (and, before
            # a group has run, its weights)
            what = f"evaluating a group of {self.program.plan.interleave} tokens-packed samples"
            try:
                n_workers = memory_workers(workers, len(ct._groups), self._tokens_need(),
                                           self._free_memory(pool=False), what)
            except ResourceError as exc:
                raise ResourceError(
                    f"{exc}; vector packing holds one sample at a time (he.compile(..., "
                    f"packing='vector')), or run on a machine with more memory") from None
        else:
            # a group's ciphertexts dwarf the keys: as many processes as the memory holds,
            # each group in tiles where it would not fit whole
            slots = self.program.params.slots
            # what SEAL's pool kept from this process's earlier groups serves this one too
            free = self._free_memory()
            # inputs given as SEAL objects are the caller's; those loaded here are freed
            keep = not all(_unloaded(b) for grp in ct._groups for b in grp)
            mem = self._group_memory(free, keep)
            self._tiles, working, self._lazy = mem.tiles, mem.working, mem.lazy
            self._spill = bool(mem.spills)
            what = f"evaluating a group of {slots} batch-packed samples"
            try:
                n_workers = memory_workers(workers, len(ct._groups), working, free, what)
                if n_workers > 1 and pool_held(self._pool_key):
                    # forked processes cannot reuse this one's pool, which stays resident:
                    # they share the memory available without it (or one group runs here)
                    alone = self._free_memory(pool=False)
                    if alone >= working:
                        n_workers = memory_workers(workers, len(ct._groups), working, alone,
                                                   what)
                    elif workers:
                        gib = 2.0 ** 30
                        raise ResourceError(
                            f"{n_workers} processes each holding {working / gib:.1f} GiB "
                            f"({what}) cannot use the {pool_held(self._pool_key) / gib:.1f} "
                            f"GiB this process's SEAL pool holds, and {alone / gib:.1f} GiB "
                            f"are available besides: workers=1 runs the groups here, "
                            f"workers=0 chooses")
                    else:
                        n_workers = 1
            except ResourceError as exc:
                raise ResourceError(
                    f"{exc}; vector packing holds one sample at a time (he.compile(..., "
                    f"packing='vector')), or run on a machine with more memory") from None
        if n_workers == 1 or len(ct._groups) == 1:
            # each group loaded when its turn comes, and handed over where loaded from bytes
            out_groups = fork_map(
                lambda i: self._run_group(self._group_of(ct, i), owned=all(
                    _unloaded(b) for b in ct._groups[i]), gi=i),
                len(ct._groups), 1, desc="server", progress=progress)
            if self.program.packing == "batch":
                note_pool(self._pool_key, working)
            self._tokens_ready = self.program.packing == "tokens"
        else:
            eng = self.engine
            pool = eng.pool
            if self.program.packing == "batch":
                # the processes share the cores: each runs a group on its part of the threads
                eng.pool = Pool(max(1, pool.threads // n_workers))
            try:
                out_groups = fork_map(
                    lambda i: [wire.dumps(c) for c in self._run_group(
                        self._group_of(ct, i),
                        owned=all(_unloaded(b) for b in ct._groups[i]), gi=i)],
                    len(ct._groups), n_workers, desc="server", progress=progress)
            finally:
                eng.pool = pool
        return Ciphertext(packing=self.program.packing, fingerprint=self.program.fingerprint,
                          key_id=self.key_id, role="output", n_samples=ct.n_samples,
                          groups=out_groups)

    def profile(self, ct: Any, group: int = 0) -> StepProfile:
        """Time each step of a vector-packed request's group ``group`` (its first samples) on
        this server, beside the cost model's prediction for the step on these threads
        (``program.options["predicted"]``): where the time goes, and where the prediction
        misses. Loading the input ciphertexts is a row of its own; the planes steps, which
        run at once, share one. The group is evaluated as :meth:`run` evaluates it (the same
        result, not returned). A batch- or tokens-packed program evaluates its steps over
        whole groups of samples: time :meth:`run` instead."""
        ct = _as_ciphertext(ct)
        _check(ct, self.program, self.key_id, "input", "server")
        prog = self.program
        if prog.packing != "vector":
            raise ConfigError(f"Server.profile times the steps of a vector-packed program; "
                              f"this one is {prog.packing}-packed (time Server.run instead)")
        check_int(group, "group", minimum=0)
        if group >= len(ct._groups):
            raise ConfigError(f"group must be below {len(ct._groups)} (the request's groups of "
                             f"{prog.plan.interleave} sample(s)), got {group}")
        plan = prog.plan
        assert self.kernels is not None
        start = time.perf_counter()
        g = _load_group(self.engine.context, ct, group)
        loaded = time.perf_counter() - start
        timings: dict[Any, float] = {}
        out = _seal_call(lambda: run_vector(self.engine, plan, self.kernels, g, timings),
                         "evaluation")
        start = time.perf_counter()
        for c in out:
            wire.dumps(c)
        saved = time.perf_counter() - start
        predicted = prog.options.get("predicted", {})
        threads = self.engine.pool.threads
        if "step_seconds" not in predicted:
            note, pred = "the program was compiled without per-step predictions", None
        elif predicted.get("server_threads") != threads:
            note = (f"predicted for {predicted.get('server_threads')} thread(s), not this "
                    f"server's {threads}: none shown")
            pred = None
        else:
            note, pred = "", predicted
        counts = plan.op_counts()

        def said(key: str, i: int | None = None) -> float | None:
            if pred is None:
                return None
            v = pred[key] if i is None else pred[key][i]
            return float(v)

        rows = [ProfileRow((), "load", 0, f"{len(g)} input ciphertext(s) deserialised",
                           said("load_seconds"), loaded)]
        early = plan.concurrent_planes()
        if "planes" in timings:
            total = {k: sum(counts[si].get(k, 0) for si in early)
                     for k in {k for si in early for k in counts[si]}}
            rows.append(ProfileRow(tuple(early), "planes", plan.steps[early[0]].level,
                                   f"{len(early)} at once: {work_words(total)}",
                                   said("planes_at_once_seconds"), timings["planes"]))
        for si in plan.order():
            if si in timings:
                st = plan.steps[si]
                rows.append(ProfileRow((si,), st.kind, plan.runs_at(si), work_words(counts[si]),
                                       said("step_seconds", si), timings[si]))
        # programs compiled before the results were priced leave them out of the prediction
        if pred is None or "return_seconds" in pred:
            rows.append(ProfileRow((), "return", plan.levels, f"{len(out)} result ciphertext(s) "
                                   f"switched down and serialised", said("return_seconds"),
                                   timings.get("return", 0.0) + saved))
        return StepProfile(rows, threads, note)

    def decrypt(self, *args: Any, **kwargs: Any) -> None:
        """A server holds no secret key, so it cannot decrypt: always raises SecretKeyError."""
        raise SecretKeyError("the server holds only public keys and cannot decrypt; send the "
                             "result to the client")
