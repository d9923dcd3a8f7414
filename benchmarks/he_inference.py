"""Encrypted MNIST inference: compiled polynets models vs TenSEAL's own tutorial recipe.

Baseline (TenSEAL "Encrypted Convolution on MNIST" tutorial, high-level API): conv 7x7 stride 3
with 4 kernels -> x^2 -> fc 256-64 -> x^2 -> fc 64-10; ring 8192, moduli [31, 26 x 6, 31],
scale 2^26, ``ts.im2col_encoding`` + ``conv2d_im2col`` + ``square_`` + ``mm``; trained with the
tutorial's recipe (Adam, lr 1e-3, 10 epochs, batch 64).

Ours: a conv 5x5 stride 3 (8 channels) + BatchNorm -> x^2 -> fc 512-24 + BatchNorm -> x^2 ->
fc 24-10 network, trained on the same images, traced, certified and compiled by ``he.compile``
(parameters chosen automatically) in vector packing (latency, one process) and batch packing
(throughput: ``--workers`` groups of 4096 images, encrypted by the client and evaluated by the
server with ``--workers`` processes, one group each; the same keys also run one group in one
process for the single-core figure).

Data: the MNIST test-set files (idx); train on the first 8,000 images, evaluate on the last 2,000.
Both models are measured in the same run; the JSON has the machine, the figures and the ratios.

    python benchmarks/he_inference.py --data-dir ../shared/data/mnist [--n-latency 20] [--workers 2]
        [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import tenseal as ts
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import he
import polynets as pn
from polynets.data import read_idx
from polynets.program import atomic_write_bytes


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class TutorialConvNet(nn.Module):
    """The TenSEAL tutorial's network: conv(1->4, 7, stride 3) -> x^2 -> fc1 -> x^2 -> fc2."""

    def __init__(self, hidden: int = 64, output: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=7, padding=0, stride=3)
        self.fc1 = nn.Linear(256, hidden)
        self.fc2 = nn.Linear(hidden, output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = x * x
        x = x.view(-1, 256)
        x = self.fc1(x)
        x = x * x
        return self.fc2(x)


def polynets_net(channels: int = 8, hidden: int = 24, kernel: int = 5) -> nn.Module:
    """Conv(kernel, stride 3)/BN/x^2 features and a BN/x^2 hidden layer: five CKKS levels."""
    side = (28 - kernel) // 3 + 1
    return nn.Sequential(nn.Conv2d(1, channels, kernel, stride=3), nn.BatchNorm2d(channels),
                         Square(), nn.Flatten(), nn.Linear(channels * side * side, hidden),
                         nn.BatchNorm1d(hidden), Square(), nn.Linear(hidden, 10))


def load_mnist(data_dir: str) -> tuple[torch.Tensor, ...]:
    d = Path(data_dir)
    x = read_idx(d / "t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    y = read_idx(d / "t10k-labels-idx1-ubyte.gz").astype(np.int64)
    x = torch.as_tensor(x)[:, None]
    y = torch.as_tensor(y)
    return x[:8000], y[:8000], x[8000:], y[8000:]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, *, augment: bool,
          lr: float, seed: int = 0, tutorial: bool = False) -> nn.Module:
    """AdamW + one-cycle, label smoothing, clipping; random shifts of up to 2 px if augment.

    ``tutorial``: the TenSEAL tutorial's own recipe instead (Adam at a constant lr, plain
    cross-entropy, no clipping)."""
    torch.manual_seed(seed)
    gen = np.random.default_rng(seed)
    steps = epochs * (len(x) // 64)
    if tutorial:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)
    model.train()
    for _ in tqdm(range(epochs), desc=f"train {type(model).__name__}", leave=False):
        perm = torch.randperm(len(x))
        for i in range(0, len(x) - 63, 64):
            xb, yb = x[perm[i:i + 64]], y[perm[i:i + 64]]
            if augment:
                dx, dy = (int(v) for v in gen.integers(-2, 3, 2))
                xb = torch.roll(xb, (dx, dy), (2, 3))
            loss = F.cross_entropy(model(xb), yb, label_smoothing=0.1 if augment else 0.0)
            opt.zero_grad()
            loss.backward()
            if not tutorial:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model.eval()


def accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(logits.argmax(1) == y))


# ------------------------------------------------------------------------------ baseline
def baseline(model: TutorialConvNet, x: torch.Tensor, n: int) -> dict:
    """TenSEAL tutorial evaluation, faithful to its recipe, on the first ``n`` images."""
    bits_scale = 26
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192,
                     coeff_mod_bit_sizes=[31] + [bits_scale] * 6 + [31])
    ctx.global_scale = 2 ** bits_scale
    ctx.generate_galois_keys()
    kernel_shape = model.conv1.kernel_size
    stride = model.conv1.stride[0]
    conv_w = model.conv1.weight.data.view(model.conv1.out_channels, kernel_shape[0],
                                          kernel_shape[1]).tolist()
    conv_b = model.conv1.bias.data.tolist()
    fc1_w = model.fc1.weight.T.data.tolist()
    fc1_b = model.fc1.bias.data.tolist()
    fc2_w = model.fc2.weight.T.data.tolist()
    fc2_b = model.fc2.bias.data.tolist()
    outs, times, ct_sizes = [], [], []
    for i in tqdm(range(n), desc="baseline (TenSEAL tutorial)", leave=False):
        image = x[i, 0].tolist()
        t0 = time.perf_counter()
        enc_x, windows_nb = ts.im2col_encoding(ctx, image, kernel_shape[0], kernel_shape[1],
                                               stride)
        ct_sizes.append(len(enc_x.serialize()))
        enc_channels = []
        for kernel, bias in zip(conv_w, conv_b):
            y = enc_x.conv2d_im2col(kernel, windows_nb) + bias
            enc_channels.append(y)
        enc = ts.CKKSVector.pack_vectors(enc_channels)
        enc.square_()
        enc = enc.mm(fc1_w) + fc1_b
        enc.square_()
        enc = enc.mm(fc2_w) + fc2_b
        outs.append(enc.decrypt())
        times.append(time.perf_counter() - t0)
    public = ctx.copy()
    public.make_context_public()
    return {"logits": np.array(outs), "median_s": statistics.median(times),
            "ciphertext_bytes": int(np.median(ct_sizes)),
            "public_context_bytes": len(public.serialize(save_galois_keys=True,
                                                         save_relin_keys=True)),
            "params": "N=8192, moduli [31, 26x6, 31], scale 2^26, all Galois keys"}


# ------------------------------------------------------------------------------ ours
def ours_vector(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, n: int,
                precision_bits: int) -> dict:
    prog = he.compile(model, xcal[:1], calibration=xcal, packing="vector",
                      precision_bits=precision_bits)
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(prog, public)
    outs, times, ct_sizes = [], [], []
    for i in tqdm(range(n), desc="polynets vector packing", leave=False):
        t0 = time.perf_counter()
        ct = client.encrypt(x[i:i + 1]).to_bytes()
        out = server.run(ct).to_bytes()
        outs.append(client.decrypt(out)[0])
        times.append(time.perf_counter() - t0)
        ct_sizes.append(len(ct))
    return {"logits": np.array(outs), "median_s": statistics.median(times),
            "ciphertext_bytes": int(np.median(ct_sizes)), "public_context_bytes": len(public),
            "params": str(prog.params), "plan": prog.summary().splitlines()[-1].strip()}


def _batch_pass(client: he.Client, server: he.Server, images: torch.Tensor,
                workers: int) -> dict:
    """Client encrypt + serialise, server load + run + serialise, client decrypt; timed."""
    t0 = time.perf_counter()
    ct = client.encrypt(images, progress=True, workers=workers).to_bytes()
    t1 = time.perf_counter()
    out = server.run(ct, progress=True, workers=workers).to_bytes()
    t2 = time.perf_counter()
    logits = client.decrypt(out)
    t3 = time.perf_counter()
    n = len(images)
    return {"logits": logits, "images": n, "workers": workers, "seconds": t3 - t0,
            "encrypt_s": t1 - t0, "server_s": t2 - t1, "decrypt_s": t3 - t2,
            "images_per_s": n / (t3 - t0), "server_images_per_s": n / (t2 - t1),
            "ciphertext_bytes": len(ct)}


def ours_batch(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, precision_bits: int,
               workers: int) -> dict:
    """Batch packing: the test images fill the slots of ``workers`` ciphertext groups (repeated
    up to that many samples, so the figure is the amortised cost of full groups); the client
    encrypts and the server evaluates with ``workers`` processes (independent groups run side by
    side). Accuracy uses the first ``len(x)`` samples, i.e. every test image once. The same
    program and keys also run one group in one process, for the single-core figure."""
    prog = he.compile(model, xcal[:1], calibration=xcal, packing="batch",
                      precision_bits=precision_bits)
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(prog, public)
    slots = prog.params.slots
    single = _batch_pass(client, server, x[torch.arange(slots) % len(x)], 1)
    full = x[torch.arange(workers * slots) % len(x)]
    par = _batch_pass(client, server, full, workers)
    par["logits"] = par["logits"][:len(x)]
    par["single_process"] = {k: v for k, v in single.items() if k != "logits"}
    par.update(public_context_bytes=len(public), slots=slots, groups=workers,
               params=str(prog.params))
    return par


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" /
                                              "data" / "mnist"))
    ap.add_argument("--n-latency", type=int, default=20, help="images timed one by one")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--precision-bits", type=int, default=8,
                    help="output precision asked of the compiler (argmax needs few bits)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="processes for batch packing (client and server); one group each")
    ap.add_argument("--quick", action="store_true", help="1 epoch, 200 test images, 3 timed")
    ap.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" /
                                            "he_inference.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_mnist(args.data_dir)
    epochs = 1 if args.quick else args.epochs
    if args.quick:
        xte, yte = xte[:200], yte[:200]
        args.n_latency = min(args.n_latency, 3)
    ynp = yte.numpy()

    t0 = time.perf_counter()
    base_model = train(TutorialConvNet(), xtr, ytr, min(epochs, 10), augment=False, lr=1e-3,
                       tutorial=True)
    our_model = train(polynets_net(), xtr, ytr, epochs, augment=True, lr=3e-3)
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        base_plain = base_model(xte).double().numpy()
        our_plain = our_model(xte).double().numpy()
    print(pn.certify(our_model, xte[:1]))

    n = args.n_latency
    base = baseline(base_model, xte, n)
    vec = ours_vector(our_model, xtr, xte, n, args.precision_bits)
    bat = ours_batch(our_model, xtr, xte, args.precision_bits, max(1, args.workers))

    res = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "tenseal": ts.__version__,
                    "torch": torch.__version__},
        "data": {"train": len(xtr), "test": len(xte), "latency_images": n},
        "train_seconds": train_s,
        "baseline_tenseal_tutorial": {
            "plain_accuracy": accuracy(base_plain, ynp),
            "encrypted_accuracy_latency_subset": accuracy(base["logits"], ynp[:n]),
            "argmax_agreement_latency_subset": float(np.mean(
                base["logits"].argmax(1) == base_plain[:n].argmax(1))),
            "median_latency_s": base["median_s"], "ciphertext_bytes": base["ciphertext_bytes"],
            "public_context_bytes": base["public_context_bytes"], "params": base["params"]},
        "polynets_vector": {
            "median_latency_s": vec["median_s"],
            "argmax_agreement_latency_subset": float(np.mean(
                vec["logits"].argmax(1) == our_plain[:n].argmax(1))),
            "encrypted_accuracy_latency_subset": accuracy(vec["logits"], ynp[:n]),
            "ciphertext_bytes": vec["ciphertext_bytes"],
            "public_context_bytes": vec["public_context_bytes"], "params": vec["params"],
            "plan": vec["plan"]},
        "polynets_batch": {
            "plain_accuracy": accuracy(our_plain, ynp),
            "encrypted_accuracy": accuracy(bat["logits"], ynp),
            "argmax_agreement": float(np.mean(bat["logits"].argmax(1) == our_plain.argmax(1))),
            "max_abs_error": float(np.max(np.abs(bat["logits"] - our_plain))),
            "images_per_s": bat["images_per_s"],
            "server_images_per_s": bat["server_images_per_s"], "seconds": bat["seconds"],
            "encrypt_s": bat["encrypt_s"], "server_s": bat["server_s"],
            "decrypt_s": bat["decrypt_s"], "slots": bat["slots"], "groups": bat["groups"],
            "images": bat["images"], "workers": bat["workers"],
            "method": (f"{bat['images']} images ({bat['groups']} groups of {bat['slots']}, the "
                       f"test images repeated) encrypted + serialised by the client with "
                       f"{bat['workers']} processes, loaded + evaluated + serialised by the "
                       f"server with {bat['workers']} processes (one group each), decrypted; "
                       f"images/s = images / wall-clock seconds of the whole pass"),
            "single_process": bat["single_process"],
            "ciphertext_bytes": bat["ciphertext_bytes"],
            "public_context_bytes": bat["public_context_bytes"], "params": bat["params"]},
    }
    res["latency_speedup_vs_baseline"] = base["median_s"] / vec["median_s"]
    atomic_write_bytes(args.output, json.dumps(res, indent=2).encode())
    b, v, t = res["baseline_tenseal_tutorial"], res["polynets_vector"], res["polynets_batch"]
    print(f"\n{'':34s}{'TenSEAL tutorial':>18s}{'polynets':>14s}")
    print(f"{'plaintext accuracy (2000)':34s}{100 * b['plain_accuracy']:17.2f}%"
          f"{100 * t['plain_accuracy']:13.2f}%")
    print(f"{'encrypted accuracy (2000, batch)':34s}{'':>18s}"
          f"{100 * t['encrypted_accuracy']:13.2f}%")
    print(f"{'argmax agreement (2000, batch)':34s}{'':>18s}{100 * t['argmax_agreement']:13.2f}%")
    print(f"{f'median latency ({n} images)':34s}{b['median_latency_s'] * 1e3:15.0f} ms"
          f"{v['median_latency_s'] * 1e3:11.0f} ms   ({res['latency_speedup_vs_baseline']:.1f}x)")
    one = t["single_process"]
    for label, r in ((f"batch, {t['workers']} processes", t), ("batch, 1 process", one)):
        print(f"{label:34s}{'':>18s}{r['images_per_s']:10.0f} img/s "
              f"(server alone {r['server_images_per_s']:.0f} img/s)")
    print(f"wrote {args.output}")
    return res


if __name__ == "__main__":
    main()
