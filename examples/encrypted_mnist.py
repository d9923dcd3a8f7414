"""Encrypted MNIST: train a polynomial CNN, compile it to CKKS, classify encrypted digits.

The network (conv 5x5/3 + BatchNorm -> x^2 -> fc + BatchNorm -> x^2 -> fc) trains on the first
8,000 images of the MNIST test-set files and is evaluated, encrypted, on the last 2,000 (or
``--n``). Only the idx files are needed, in the directory you name; nothing is downloaded.

    python examples/encrypted_mnist.py --data-dir DIR [--epochs 25] [--packing batch|vector]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import he
import polynets as pn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from he_inference import load_mnist, polynets_net, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True,
                    help="directory with t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--packing", choices=he.PACKINGS, default="batch")
    ap.add_argument("--n", type=int, default=2000, help="test images to encrypt")
    args = ap.parse_args()
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        if not (Path(args.data_dir) / name).exists():
            sys.exit(f"missing {Path(args.data_dir) / name}: put the MNIST test-set idx files "
                     f"in --data-dir")

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_mnist(args.data_dir)
    xte, yte = xte[:args.n], yte[:args.n]
    model = train(polynets_net(), xtr, ytr, args.epochs, augment=True, lr=3e-3)
    print(pn.certify(model, xte[:1]))

    prog = he.compile(model, xtr[:1], calibration=xtr, packing=args.packing, precision_bits=8)
    print(prog.summary())
    client = he.Client(prog)
    server = he.Server(he.CompiledProgram.from_bytes(prog.to_bytes()), client.public_context())
    print(he.report(model, prog, client, server, xte, y_true=yte.numpy()))


if __name__ == "__main__":
    main()
