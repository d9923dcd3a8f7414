"""A PADRe vision transformer on 8x8 digits: train, certify its degree, optionally encrypt.

Trains ``padre_vit_mini`` (4 blocks ``X + PADRe(BN X)``, ``+ MuLayer(BN .)`` on 4x4 tokens) with
the library's trainer on scikit-learn's digits, prints the test accuracy and the certificate
(a polynomial of degree ``(2 * degree) ** depth``), and with ``--encrypt N`` classifies N test
images under CKKS and reports the agreement with the plaintext model.

    python examples/padre_digits.py [--epochs 30] [--degree 2] [--depth 4] [--encrypt 0]

``--depth 1 --embed-dim 16 --encrypt 100`` gives a model shallow enough for CKKS (8 levels).
"""

from __future__ import annotations

import argparse
import json

import timm
import torch

import polynets as pn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--degree", type=int, default=2, help="PADRe degree of every block")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--embed-dim", type=int, default=64)
    ap.add_argument("--kernel-size", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, auto (CUDA > MPS > CPU)")
    ap.add_argument("--encrypt", type=int, default=0, help="test images to classify encrypted")
    ap.add_argument("--out", help="run directory for checkpoints and metrics")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    train, test, info = pn.load_dataset("digits", seed=args.seed)
    model = timm.create_model("padre_vit_mini", degree=args.degree, depth=args.depth,
                              embed_dim=args.embed_dim, kernel_size=args.kernel_size)
    config = pn.TrainConfig(epochs=args.epochs, batch_size=64, lr=2e-3, warmup_epochs=2,
                            device=args.device, seed=args.seed, progress=False, out_dir=args.out)
    trainer = pn.Trainer(model, config, model_name="padre_vit_mini",
                         model_kwargs={"degree": args.degree, "depth": args.depth,
                                       "embed_dim": args.embed_dim,
                                       "kernel_size": args.kernel_size})
    history = trainer.fit(train, test)
    result = {"params": sum(p.numel() for p in model.parameters()), "epochs": args.epochs,
              "degree": args.degree, "train_time_s": round(sum(h["time_s"] for h in history), 1),
              "test_accuracy": history[-1]["val_accuracy"]}
    model = model.cpu().eval()
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    cert = pn.certify(model, x[:1])
    print(cert)
    result.update(certified_degree=cert.degree, depth=cert.depth)

    if args.encrypt:
        import he

        n = args.encrypt
        prog = he.compile(model, x[:1], calibration=x, packing="batch")
        client = he.Client(prog)
        server = he.Server(prog, client.public_context())
        logits = client.decrypt(server.run(client.encrypt(x[:n])))
        with torch.no_grad():
            plain = model(x[:n]).argmax(1)
        enc = torch.as_tensor(logits).argmax(1)
        result.update(encrypted_images=n, encrypted_accuracy=float((enc == y[:n]).float().mean()),
                      agreement=float((enc == plain).float().mean()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
