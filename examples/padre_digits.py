"""A PADRe vision transformer on 8x8 digits: train, certify its degree, optionally encrypt.

Trains ``padre_vit_mini`` (4 blocks ``X + PADRe(BN X)``, ``+ MuLayer(BN .)`` on 4x4 tokens) with
the library's trainer on scikit-learn's digits, prints the test accuracy and the certificate
(a polynomial of degree ``(2 * degree) ** depth``), and with ``--encrypt N`` classifies N test
images under CKKS in each of ``--packing`` (vector and batch by default) and reports accuracy,
agreement with the plaintext model, throughput and one image's round trip.

    python examples/padre_digits.py [--epochs 30] [--degree 2] [--depth 4] [--encrypt 0]
        [--packing vector,batch]

``--depth 1 --embed-dim 16 --encrypt 100`` gives a model shallow enough for CKKS (8 levels).
"""

from __future__ import annotations

import argparse
import json
import time

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
    ap.add_argument("--packing", default="vector,batch",
                    help="packings to encrypt in (comma-separated: vector, batch, auto)")
    ap.add_argument("--precision-bits", type=int, default=10,
                    help="output precision asked of the compiler (argmax needs few bits)")
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
        result["encrypted"] = {p: encrypted(model, x, y, args.encrypt, p, args.precision_bits)
                               for p in args.packing.split(",")}
    print(json.dumps(result, indent=1))


def encrypted(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, packing: str,
              precision_bits: int) -> dict:
    """Classify ``n`` test images under CKKS in one packing: accuracy, agreement with the
    plaintext model, the server's time for them all, and one image's round trip."""
    import he

    prog = he.compile(model, x[:1], calibration=x, packing=packing,
                      precision_bits=precision_bits)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    t0 = time.perf_counter()
    ct = client.encrypt(x[:n]).to_bytes()
    t1 = time.perf_counter()
    out = server.run(ct).to_bytes()
    t2 = time.perf_counter()
    logits = client.decrypt(out)
    t3 = time.perf_counter()
    one = time.perf_counter()
    client.decrypt(server.run(client.encrypt(x[:1]).to_bytes()).to_bytes())
    one = time.perf_counter() - one
    with torch.no_grad():
        plain = model(x[:n]).argmax(1)
    enc = torch.as_tensor(logits).argmax(1)
    return {"ring": prog.params.poly_modulus_degree, "levels": prog.params.levels,
            "samples_per_ciphertext": prog.samples_per_ciphertext, "images": n,
            "accuracy": float((enc == y[:n]).float().mean()),
            "agreement": float((enc == plain).float().mean()),
            "server_s": round(t2 - t1, 3), "images_per_s": round(n / (t3 - t0), 2),
            "one_image_round_trip_s": round(one, 3)}


if __name__ == "__main__":
    main()
