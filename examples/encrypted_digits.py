"""Encrypted digit classification with a MONet, end to end, on data that ships with scikit-learn.

Train a small MONet (BatchNorm folds into the affine maps, so it stays a polynomial), certify it,
compile it to CKKS, let a server classify encrypted test images it cannot read (only bytes cross
the client/server boundary), decrypt, and print the accuracy drop report.

    python examples/encrypted_digits.py [--epochs 30] [--packing batch|vector] [--n 360]
"""

from __future__ import annotations

import argparse

import torch

import he
import polynets as pn
from he.demo import load_digits_split, train_classifier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--packing", choices=he.PACKINGS, default="batch")
    ap.add_argument("--n", type=int, default=360, help="test images to encrypt")
    args = ap.parse_args()

    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_digits_split()
    xte, yte = xte[:args.n], yte[:args.n]
    model = pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=4, embed="patch",
                     embed_dim=16, depth=1, expansion=2, norm="batch")
    train_classifier(model, xtr, ytr, epochs=args.epochs)
    print(pn.certify(model, torch.as_tensor(xte[:1])))

    # Client side: compile (parameters chosen from depth and calibrated ranges), make keys.
    prog = he.compile(model, torch.as_tensor(xtr[:1]), calibration=xtr, packing=args.packing)
    print(prog.summary())
    client = he.Client(prog)

    # Server side: the program and the public context, both as bytes; no secret key.
    server = he.Server(he.CompiledProgram.from_bytes(prog.to_bytes()), client.public_context())

    # he.report encrypts, sends bytes to the server, decrypts, and compares with the model.
    print(he.report(model, prog, client, server, xte, y_true=yte))


if __name__ == "__main__":
    main()
