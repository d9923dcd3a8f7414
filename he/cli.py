"""Encrypted-inference subcommands of the ``polynets`` command.

``register(subparsers)`` adds ``compile``, ``encrypt``, ``run``, ``decrypt`` and ``demo``. Client
and server talk through files only:

    polynets compile ckpt.pt --input-shape 1,8,8 --calibration x.npy -o model.he
    polynets encrypt model.he x.npy --keys keys/ -o x.ct           # client (writes keys/public.ctx)
    polynets run model.he x.ct --context keys/public.ctx -o y.ct   # server, public keys only
    polynets decrypt model.he y.ct --keys keys/ -o y.npy           # client
"""

from __future__ import annotations

import argparse
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from he.errors import (InputShapeError, NotEncryptableError, SecretKeyError, SerializationError,
                       batch_of)
from polynets._io import (MAX_FILE_BYTES, atomic_write_bytes, load_npy_bytes,
                          loads_json_strict, read_bytes_limited)
from polynets.errors import CheckpointError, ConfigError, WriteError

__all__ = ["register"]

_SECRET = "secret.ctx"
_PUBLIC = "public.ctx"
_MAX_ELEMENTS = 1 << 28
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")


def _read(path: str | os.PathLike, what: str) -> bytes:
    """A regular file's bytes (directories, pipes and devices such as /dev/zero are refused)."""
    return read_bytes_limited(path, f"{what} file", SerializationError, MAX_FILE_BYTES)


def _program(path: str) -> Any:
    import he

    return he.CompiledProgram.from_bytes(_read(path, "compiled program"))


def _check_output(path: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse an output path that cannot be a file, or (where ``suffixes`` are given) whose
    name does not say one of the formats written, before any work is done."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise WriteError(f"cannot write {path!r}: it is a directory; name a file in it")
    if suffixes and not path.endswith(suffixes):
        raise WriteError(f"cannot write {path!r}: outputs are written as "
                         f"{' or '.join(suffixes)}; name the file so")
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise WriteError(f"cannot write {path!r}: {parent!r} is a file, not a directory")


def _load_array(path: str, what: str) -> np.ndarray:
    """Read ``.npy`` (numbers only, no pickle) or ``.csv`` (one sample per row) as float64."""
    data = read_bytes_limited(path, f"{what} file", InputShapeError, MAX_FILE_BYTES)
    if path.endswith(".csv"):
        try:
            arr = np.loadtxt(io.BytesIO(data), delimiter=",", dtype=np.float64, ndmin=2)
        except (ValueError, UnicodeDecodeError, IndexError) as exc:
            raise InputShapeError(f"cannot read {what} from {path!r}: expected comma-separated "
                                  f"numbers, one sample per row ({exc})") from exc
    else:
        arr = load_npy_bytes(data, f"{what} file {path!r} (.npy or .csv expected)",
                             InputShapeError)
        if arr.dtype.kind not in "biuf":
            raise InputShapeError(f"{what} file {path!r} holds {arr.dtype} data; expected numbers")
        arr = arr.astype(np.float64)
    if arr.ndim < 2 or arr.shape[0] < 1:
        raise InputShapeError(f"{what} in {path!r} has shape {arr.shape}; expected a batch of "
                              f"samples, shape (B, *sample_shape) with B >= 1")
    if not np.all(np.isfinite(arr)):
        raise InputShapeError(f"{what} in {path!r} holds NaN or infinite values")
    return arr


def _as_batch(arr: np.ndarray, shape: tuple[int, ...], path: str, what: str) -> np.ndarray:
    """``arr`` as ``(B, *shape)``: exact for .npy; a .csv row is one flattened sample."""
    if tuple(arr.shape[1:]) == tuple(shape):
        return arr
    size = math.prod(shape)
    if path.endswith(".csv") and arr.ndim == 2 and arr.shape[1] == size:
        return arr.reshape((arr.shape[0],) + tuple(shape))
    raise InputShapeError(f"{what} in {path!r} has shape {arr.shape}; expected "
                          f"{batch_of(tuple(shape))}"
                          + (f" or, for .csv, rows of {size} values" if path.endswith(".csv")
                             else ""))


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(t) for t in text.replace("x", ",").split(",") if t.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"shape must look like 1,28,28, got {text!r}") from exc
    if not shape or any(d < 1 for d in shape) or math.prod(shape) > _MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(f"shape must be positive sizes such as 1,28,28 (at most "
                                         f"{_MAX_ELEMENTS} elements), got {text!r}")
    return shape


def _load_model(spec: str, model_args: str | None, shape: tuple[int, ...] | None = None) -> Any:
    """A checkpoint file, or a registered model name built with the JSON ``--model-args``, sized
    for samples of ``shape`` (``--input-shape``) where it is a square image."""
    from polynets.cli import shaped_model_kwargs
    from polynets.training.checkpoint import build_model, check_model_kwargs, load_model, model_builder

    if os.path.lexists(spec):
        if model_args:
            raise ConfigError("--model-args applies to a model name; a checkpoint brings its own "
                              "arguments")
        return load_model(spec)
    if os.sep in spec or spec.endswith(_CHECKPOINT_SUFFIXES):
        raise CheckpointError(f"no checkpoint at {spec}: the file does not exist")
    try:
        model_builder(spec)
    except ConfigError as exc:
        raise ConfigError(f"{spec!r} is neither a checkpoint file nor a known model name: "
                          f"{exc}") from exc
    kwargs: Any = {}
    if model_args:
        kwargs = loads_json_strict(model_args, "--model-args", ConfigError, max_bytes=1 << 16,
                                   max_depth=8)
    kwargs = check_model_kwargs(kwargs, "--model-args")
    if shape is not None:
        kwargs = shaped_model_kwargs(spec, shape, kwargs)
    return build_model(spec, **kwargs).eval()


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a checkpoint (or a registered model name) to a CKKS program file."""
    import he

    _check_output(args.output)
    if args.bandwidth is not None and not (math.isfinite(args.bandwidth) and args.bandwidth > 0):
        raise NotEncryptableError(f"bandwidth must be a positive number of Mbit/s, got "
                                  f"{args.bandwidth}")
    model = _load_model(args.model, args.model_args, args.input_shape)
    calib = _load_array(args.calibration, "calibration data") if args.calibration else None
    if args.input_shape:
        shape = args.input_shape
        if calib is not None:
            calib = _as_batch(calib, shape, args.calibration, "calibration data")
        example = calib[:1] if calib is not None else np.zeros((1,) + shape)
    elif calib is not None:
        example = calib[:1]
    else:
        raise InputShapeError("compile needs --input-shape (e.g. 1,28,28) or --calibration data")
    prog = he.compile(model, example.astype(np.float32), calibration=calib, packing=args.packing,
                      objective=args.objective, batch_size=args.batch_size,
                      precision_bits=args.precision_bits, security=args.security,
                      memory_budget=None if args.memory_budget is None
                      else max(1, int(args.memory_budget * 2 ** 30)),
                      bandwidth=None if args.bandwidth is None else args.bandwidth * 1e6 / 8,
                      final_map=args.final_map, first_map=args.first_map,
                      progress=True)
    prog.save(args.output)
    print(prog.summary())
    print(f"wrote {args.output}")
    return 0


def _client(program: Any, keys: str, create: bool) -> Any:
    """The client of the key set in ``keys``: loaded from its secret context, or (``create``)
    a new key set. A secret context without its public context gets the public one written
    again; a public context without the secret one is refused (its secret key is gone)."""
    import he

    folder = Path(keys)
    secret, public = folder / _SECRET, folder / _PUBLIC
    if folder.exists() and not folder.is_dir():
        raise SerializationError(f"--keys {keys!r} is a file; it must name a key directory")
    if secret.exists() or secret.is_symlink():
        client = he.Client.from_secret_context(program, _read(secret, "secret key"))
        if create:
            expected = client.public_context()
            if not public.exists():
                atomic_write_bytes(public, expected)
                print(f"wrote the missing public context {public} of key set {client.key_id}")
            elif _read(public, "public context") != expected:
                atomic_write_bytes(public, expected)
                print(f"replaced {public}: it did not belong to the key set in {secret}; send the "
                      f"new one to the server")
        return client
    if not create:
        raise SecretKeyError(f"no keys in {keys!r} (expected {secret}); run 'polynets encrypt' "
                             f"with --keys {keys} first")
    if public.exists():
        raise SecretKeyError(f"{keys!r} holds {_PUBLIC} but not {_SECRET}: the secret key of "
                             f"that key set is gone, so its results could never be decrypted; "
                             f"restore {secret}, or remove {public} to make a new key set")
    client = he.Client(program)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"cannot create the key directory {keys!r}: {exc.strerror}") from exc
    atomic_write_bytes(secret, client.secret_context(), private=True)
    atomic_write_bytes(public, client.public_context())
    print(f"made a new key set {client.key_id} in {keys}/ ({_SECRET} stays here; send "
          f"{_PUBLIC} to the server)")
    return client


def cmd_encrypt(args: argparse.Namespace) -> int:
    """Client: encrypt data (.npy shape (B, *input_shape), or .csv one sample per row) with the
    key set in --keys."""
    _check_output(args.output)
    prog = _program(args.program)
    x = _as_batch(_load_array(args.input, "input data"), prog.input_shape, args.input,
                  "input data")
    client = _client(prog, args.keys, create=True)
    ct = client.encrypt(x, progress=True, workers=args.workers)
    atomic_write_bytes(args.output, ct.to_bytes())
    print(f"encrypted {len(ct)} samples -> {args.output}; public context: "
          f"{Path(args.keys) / _PUBLIC}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Server: run the compiled program on a ciphertext file with the public context only."""
    import he

    _check_output(args.output)
    prog = _program(args.program)
    if args.profile and prog.packing != "vector":
        raise ConfigError(f"--profile times the steps of a vector-packed program; this one is "
                          f"{prog.packing}-packed")
    # one request: nothing to prepare ahead of it (he.Server.warm)
    server = he.Server(prog, _read(args.context, "public context"), threads=args.threads,
                       warm=False)
    if server.threads_note:
        print(f"one server thread: {server.threads_note}")
    request = _read(args.ciphertext, "ciphertext")
    out = server.run(request, progress=True, workers=args.workers)
    atomic_write_bytes(args.output, out.to_bytes())
    print(f"evaluated {len(out)} samples -> {args.output}")
    if args.profile:
        # the first sample again, step by step, now that the server is warm
        print(server.profile(request))
    return 0


def cmd_decrypt(args: argparse.Namespace) -> int:
    """Client: decrypt a result file; write .npy or .csv and print the predictions."""
    if args.output:
        _check_output(args.output, (".npy", ".csv"))
    prog = _program(args.program)
    client = _client(prog, args.keys, create=False)
    y = client.decrypt(_read(args.result, "result"))
    if args.output:
        if args.output.endswith(".csv"):
            text = "\n".join(",".join(f"{v:.8g}" for v in row) for row in y.reshape(len(y), -1))
            atomic_write_bytes(args.output, (text + "\n").encode())
        else:
            buf = io.BytesIO()
            np.save(buf, y, allow_pickle=False)
            atomic_write_bytes(args.output, buf.getvalue())
        print(f"wrote {args.output}")
    preds = y.reshape(len(y), -1).argmax(1)
    print("predictions:", " ".join(str(int(p)) for p in preds))
    return 0


def cmd_costs(args: argparse.Namespace) -> int:
    from he.costmodel import cache_path, calibrate

    if args.output:
        _check_output(args.output)
    model = calibrate(args.output, progress=True, repeats=args.repeats)
    for ring in sorted(model.table):
        ops = ", ".join(f"{op} {model.seconds(op, ring, 2) * 1e3:.2f} ms"
                        for op in model.table[ring])
        print(f"N={ring} (2 primes): {ops}")
    where = Path(args.output) if args.output else cache_path()
    if where.resolve() == cache_path().resolve():
        print(f"wrote {where}; he.compile now plans with these costs")
    else:
        print(f"wrote {where}; he.compile plans with them given as cost_model="
              f"he.costmodel.CostModel.from_dict(json.loads(Path({str(where)!r}).read_text()))"
              f", or by default once copied to {cache_path()}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a small MONet on digits, certify, compile to CKKS, classify encrypted test images."""
    from he.demo import main

    return main(args)


def _precision(text: str) -> int | str:
    """``--precision-bits``: a number of bits or ``argmax``."""
    if text == "argmax":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits or 'argmax', got {text!r}")


def _gib(text: str) -> float:
    """``--memory-budget``: a positive number of GiB."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def register(subparsers: Any) -> None:
    """Add the encrypted-inference subcommands to the ``polynets`` parser."""
    from he.demo import add_arguments

    p = subparsers.add_parser("compile", help="compile a model to a CKKS program file",
                              description=cmd_compile.__doc__)
    p.add_argument("model", help="checkpoint path, or a registered model name")
    p.add_argument("-o", "--output", required=True, help="compiled program file to write")
    p.add_argument("--input-shape", type=_shape, help="sample shape, e.g. 1,28,28")
    p.add_argument("--calibration", help=".npy/.csv samples used to size the parameters")
    p.add_argument("--packing", choices=("vector", "batch", "tokens", "auto"), default="vector",
                   help="vector (latency), batch (one sample per slot), tokens (one ciphertext "
                        "per channel, tokens and samples in its slots) or auto (the cost model "
                        "picks for --objective)")
    p.add_argument("--objective", choices=("latency", "throughput"), default="latency",
                   help="what the cost model minimises: one round trip, or time per sample")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples sent at once, for --objective throughput (default: full "
                        "ciphertexts)")
    p.add_argument("--precision-bits", type=_precision, default=16, metavar="BITS|argmax",
                   help="wanted output precision in bits, or 'argmax' for a classifier: the "
                        "fewest bits that keep the class of 99%% of the calibration samples")
    p.add_argument("--security", type=int, choices=(128, 192, 256), default=128,
                   help="classical security level in bits (default 128)")
    p.add_argument("--memory-budget", type=_gib, default=None, metavar="GIB",
                   help="server memory allowed, GiB (--packing auto avoids plans beyond it)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="MBIT/S",
                   help="link between client and server, Mbit/s: the objective then counts "
                        "the ciphertexts' time on it (default: not counted)")
    p.add_argument("--final-map", choices=("auto", "server", "client"), default="auto",
                   help="who applies the model's last linear map in vector and batch packing: "
                        "the client after decrypting (a level less for the server), the "
                        "server, or auto: the cheaper (default)")
    p.add_argument("--first-map", choices=("auto", "server", "client"), default="auto",
                   help="who applies the model's first linear maps (those of the input alone) "
                        "in vector packing: the client before encrypting their values (a "
                        "level less for the server), the server, or auto: the cheaper "
                        "(default)")
    p.add_argument("--model-args", help="JSON keyword arguments when MODEL is a name")
    p.set_defaults(func=cmd_compile)

    p = subparsers.add_parser("encrypt", help="client: encrypt data, make or reuse keys",
                              description=cmd_encrypt.__doc__)
    p.add_argument("program", help="compiled program file")
    p.add_argument("input", help=".npy data of shape (B, *input_shape), or .csv with one "
                                 "flattened sample per row")
    p.add_argument("--keys", required=True, help="key directory (created if missing)")
    p.add_argument("-o", "--output", required=True, help="ciphertext file to write")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that encrypt (0: one per CPU core)")
    p.set_defaults(func=cmd_encrypt)

    p = subparsers.add_parser("run", help="server: evaluate a program on a ciphertext",
                              description=cmd_run.__doc__)
    p.add_argument("program", help="compiled program file")
    p.add_argument("ciphertext", help="ciphertext file from 'polynets encrypt'")
    p.add_argument("--context", required=True, help="public context file (keys/public.ctx)")
    p.add_argument("-o", "--output", required=True, help="result ciphertext file to write")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that evaluate independent groups/samples (0: one per core)")
    p.add_argument("--threads", type=int, default=None,
                   help="vector packing: threads that rotate one sample's values at once "
                        "(default: the compiler's choice, on no more cores than this machine's)")
    p.add_argument("--profile", action="store_true",
                   help="vector packing: then run the first sample step by step and print each "
                        "step's time beside the cost model's prediction")
    p.set_defaults(func=cmd_run)

    p = subparsers.add_parser("decrypt", help="client: decrypt a result, print predictions",
                              description=cmd_decrypt.__doc__)
    p.add_argument("program", help="compiled program file")
    p.add_argument("result", help="result file from 'polynets run'")
    p.add_argument("--keys", required=True, help="key directory used by 'polynets encrypt'")
    p.add_argument("-o", "--output", help="write outputs to .npy or .csv")
    p.set_defaults(func=cmd_decrypt)

    p = subparsers.add_parser("he-costs", help="measure SEAL's primitive costs on this machine "
                                               "for the compiler's cost model (5-10 minutes on "
                                               "2 cores per calibration)")
    p.add_argument("-o", "--output", default=None,
                   help="where to write the table (default: the per-user cache he.compile reads)")
    p.add_argument("--repeats", type=int, default=1,
                   help="calibrations one after another, each figure's median kept (a shared "
                        "machine's speed drifts; 3 gives a steadier table)")
    p.set_defaults(func=cmd_costs)

    p = subparsers.add_parser("demo", help="encrypted digits classification, end to end",
                              description=cmd_demo.__doc__)
    add_arguments(p)
    p.set_defaults(func=cmd_demo)

