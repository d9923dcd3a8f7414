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
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from he.errors import InputShapeError, SerializationError
from polynets.program import atomic_write_bytes

__all__ = ["register"]

_SECRET = "secret.ctx"
_PUBLIC = "public.ctx"


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SerializationError(f"cannot read the {what} file {path!r}: {exc.strerror}") from exc


def _load_array(path: str) -> np.ndarray:
    """Read ``.npy`` (no pickle) or ``.csv`` (one sample per row) data."""
    try:
        if path.endswith(".csv"):
            return np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
        return np.load(path, allow_pickle=False).astype(np.float64)
    except (OSError, ValueError) as exc:
        raise InputShapeError(f"cannot read data from {path!r} (.npy or .csv expected): {exc}") \
            from exc


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.replace("x", ",").split(",") if t.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"shape must look like 1,28,28, got {text!r}") from exc


def _load_model(spec: str, model_args: str | None) -> Any:
    from polynets.checkpoint import build_model, load_model

    if os.path.exists(spec):
        return load_model(spec)
    kwargs = json.loads(model_args) if model_args else {}
    return build_model(spec, **kwargs).eval()


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a checkpoint (or a registered model name) to a CKKS program file."""
    import he

    model = _load_model(args.model, args.model_args)
    calib = _load_array(args.calibration) if args.calibration else None
    if args.input_shape:
        shape = args.input_shape
        if calib is not None:
            calib = calib.reshape((-1,) + shape)
        example = calib[:1] if calib is not None else np.zeros((1,) + shape)
    elif calib is not None:
        example = calib[:1]
    else:
        raise InputShapeError("compile needs --input-shape (e.g. 1,28,28) or --calibration data")
    prog = he.compile(model, example.astype(np.float32), calibration=calib, packing=args.packing,
                      precision_bits=args.precision_bits)
    prog.save(args.output)
    print(prog.summary())
    print(f"wrote {args.output}")
    return 0


def _client(program: Any, keys: str, create: bool) -> Any:
    import he

    secret = Path(keys) / _SECRET
    if secret.exists():
        return he.Client.from_secret_context(program, _read(str(secret), "secret key"))
    if not create:
        raise SerializationError(f"no keys in {keys!r} (expected {secret}); run "
                                 f"'polynets encrypt' with --keys {keys} first")
    client = he.Client(program)
    os.makedirs(keys, exist_ok=True)
    atomic_write_bytes(secret, client.secret_context())
    os.chmod(secret, 0o600)
    atomic_write_bytes(Path(keys) / _PUBLIC, client.public_context())
    print(f"made a new key set {client.key_id} in {keys}/ ({_SECRET} stays here; send "
          f"{_PUBLIC} to the server)")
    return client


def cmd_encrypt(args: argparse.Namespace) -> int:
    """Client: encrypt data (.npy/.csv, shape (B, *input_shape)) with the key set in --keys."""
    import he

    prog = he.load_program(args.program)
    client = _client(prog, args.keys, create=True)
    x = _load_array(args.input)
    if x.ndim == 2 and len(prog.input_shape) > 1:
        x = x.reshape((x.shape[0],) + prog.input_shape)
    ct = client.encrypt(x, progress=True, workers=args.workers)
    atomic_write_bytes(args.output, ct.to_bytes())
    print(f"encrypted {len(ct)} samples -> {args.output}; public context: "
          f"{Path(args.keys) / _PUBLIC}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Server: run the compiled program on a ciphertext file with the public context only."""
    import he

    prog = he.load_program(args.program)
    server = he.Server(prog, _read(args.context, "public context"))
    out = server.run(_read(args.ciphertext, "ciphertext"), progress=True, workers=args.workers)
    atomic_write_bytes(args.output, out.to_bytes())
    print(f"evaluated {len(out)} samples -> {args.output}")
    return 0


def cmd_decrypt(args: argparse.Namespace) -> int:
    """Client: decrypt a result file; write .npy or .csv and print the predictions."""
    import he

    prog = he.load_program(args.program)
    client = _client(prog, args.keys, create=False)
    y = client.decrypt(_read(args.result, "result"))
    if args.output:
        if args.output.endswith(".csv"):
            text = "\n".join(",".join(f"{v:.8g}" for v in row) for row in y.reshape(len(y), -1))
            atomic_write_bytes(args.output, (text + "\n").encode())
        else:
            import io

            buf = io.BytesIO()
            np.save(buf, y, allow_pickle=False)
            atomic_write_bytes(args.output, buf.getvalue())
        print(f"wrote {args.output}")
    preds = y.reshape(len(y), -1).argmax(1)
    print("predictions:", " ".join(str(int(p)) for p in preds))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a small MONet on digits, certify, compile to CKKS, classify encrypted test images."""
    from he.demo import main

    return main(args)


def register(subparsers: Any) -> None:
    """Add the encrypted-inference subcommands to the ``polynets`` parser."""
    from he.demo import add_arguments

    p = subparsers.add_parser("compile", help="compile a model to a CKKS program file",
                              description=cmd_compile.__doc__)
    p.add_argument("model", help="checkpoint path, or a registered model name")
    p.add_argument("-o", "--output", required=True, help="compiled program file to write")
    p.add_argument("--input-shape", type=_shape, help="sample shape, e.g. 1,28,28")
    p.add_argument("--calibration", help=".npy/.csv samples used to size the parameters")
    p.add_argument("--packing", choices=("vector", "batch"), default="vector",
                   help="vector: one sample per ciphertext (latency); batch: one per slot")
    p.add_argument("--precision-bits", type=int, default=16, help="wanted output precision")
    p.add_argument("--model-args", help="JSON keyword arguments when MODEL is a name")
    p.set_defaults(func=cmd_compile)

    p = subparsers.add_parser("encrypt", help="client: encrypt data, make or reuse keys",
                              description=cmd_encrypt.__doc__)
    p.add_argument("program", help="compiled program file")
    p.add_argument("input", help=".npy or .csv data, shape (B, *input_shape)")
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
    p.set_defaults(func=cmd_run)

    p = subparsers.add_parser("decrypt", help="client: decrypt a result, print predictions",
                              description=cmd_decrypt.__doc__)
    p.add_argument("program", help="compiled program file")
    p.add_argument("result", help="result file from 'polynets run'")
    p.add_argument("--keys", required=True, help="key directory used by 'polynets encrypt'")
    p.add_argument("-o", "--output", help="write outputs to .npy or .csv")
    p.set_defaults(func=cmd_decrypt)

    p = subparsers.add_parser("demo", help="encrypted digits classification, end to end",
                              description=cmd_demo.__doc__)
    add_arguments(p)
    p.set_defaults(func=cmd_demo)

