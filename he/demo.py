"""``polynets demo``: train, certify, compile and classify encrypted digits end to end.

On scikit-learn's bundled 8x8 digits (no download): train a small MONet with BatchNorm (which
folds into the affine maps), print its polynomial certificate, compile it to CKKS (the compiler
picks the packing, the layouts and how many images share a ciphertext from its cost model),
classify the encrypted test images through a client/server split that only exchanges bytes, time
one image alone, and print plaintext vs encrypted accuracy, latency, throughput, the plan and the
parameters chosen.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DemoResult", "run_demo", "add_arguments", "main", "load_digits_split",
           "train_classifier"]


@dataclass
class DemoResult:
    """Figures printed by the demo."""

    n_test: int
    acc_plain: float
    acc_encrypted: float
    agreement: float
    seconds: float
    latency_ms: float | None
    packing: str
    params: str



#: Output precision asked of the compiler: a classifier is read by its argmax, so the compiler
#: chooses the bits from the gaps between the two largest outputs on the training images (the
#: error promised and measured is printed below).
PRECISION_BITS = "argmax"


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as ``(N, 1, 8, 8)`` float32 in [0, 1]; stratified 80/20 split (360 test images)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return xtr, ytr, xte, yte


def train_classifier(model: Any, x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float = 3e-3,
                     seed: int = 0, progress: bool = True) -> Any:
    """Train ``model`` with polynets' Trainer (AdamW, warm-up + cosine, clipping) on CPU, on one
    intra-op thread: the model is small, and with more threads OpenMP's barriers wait on any
    core that other work keeps busy (on 2 cores with one busy, an epoch took 100x longer)."""
    import torch
    from torch.utils.data import TensorDataset

    from polynets.training.train import TrainConfig, Trainer

    ds = TensorDataset(torch.as_tensor(x), torch.as_tensor(y))
    cfg = TrainConfig(epochs=epochs, batch_size=64, lr=lr, weight_decay=5e-4,
                      warmup_epochs=min(1.0, epochs / 4), clip_grad=1.0, device="cpu",
                      seed=seed, progress=progress, label_smoothing=0.05, num_classes=10,
                      num_threads=1)
    Trainer(model, cfg).fit(ds)
    return model.eval()


def _accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(logits.reshape(len(y), -1).argmax(1) == y))


def _classify(prog: Any, client: Any, server: Any, xte: np.ndarray, progress: bool,
              echo: Any) -> tuple[np.ndarray, float]:
    """Encrypt the test images, run them on the server, decrypt: the logits and the seconds."""
    k = prog.samples_per_ciphertext
    echo(f"== 5. classify {len(xte)} encrypted test images ({prog.packing} packing, {k} images "
         f"per ciphertext)")
    t0 = time.perf_counter()
    ct_bytes = client.encrypt(xte).to_bytes()
    t1 = time.perf_counter()
    out_bytes = server.run(ct_bytes, progress=progress).to_bytes()
    t2 = time.perf_counter()
    dec = client.decrypt(out_bytes)
    t3 = time.perf_counter()
    echo(f"   encrypt {t1 - t0:.1f} s ({len(ct_bytes) / 2 ** 20:.1f} MiB), server {t2 - t1:.1f} s "
         f"(predicted {prog.plan.predicted['seconds_per_ciphertext'] * -(-len(xte) // k):.1f} s), "
         f"decrypt {t3 - t2:.2f} s -> {len(xte) / (t3 - t0):.1f} images/s")
    return dec, t3 - t0


def _latency(model: Any, xtr: np.ndarray, xte: np.ndarray, dec: np.ndarray, n: int,
             echo: Any) -> float:
    """Compile ``model`` for latency and time ``n`` test images alone, one round trip each;
    milliseconds per image (median). Says so if a class differs from the batch run's ``dec``."""
    import torch

    import he

    echo(f"== 6. latency: compile for objective='latency' and time {n} image(s) alone, one "
         f"round trip each")
    fast = he.compile(model, torch.as_tensor(xtr[:1]), calibration=xtr, packing="auto",
                      objective="latency", precision_bits=PRECISION_BITS)
    echo("\n".join(line for line in fast.summary().splitlines()
                    if line.lstrip().startswith(("vector plan", "batch plan", "predicted"))))
    fclient = he.Client(fast)
    fserver = he.Server(fast, fclient.public_context())
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        one = fclient.decrypt(fserver.run(fclient.encrypt(xte[i:i + 1]).to_bytes()).to_bytes())
        times.append(time.perf_counter() - t0)
        if one.argmax(1)[0] != dec[i].argmax():
            echo(f"   image {i}: the latency program's class differs from the batch run's")
    latency_ms = float(np.median(times)) * 1e3
    pred = fast.plan.predicted
    # on the threads the server kept (it times the compiler's against one: he.Server.warm)
    trip = pred["round_trip_seconds"] - pred["seconds_per_ciphertext"] + \
        (fserver.predicted_seconds or pred["seconds_per_ciphertext"])
    echo(f"   {latency_ms:.0f} ms per image round trip (encrypt, server, decrypt; predicted "
         f"{trip * 1e3:.0f} ms; {fserver.engine.pool.threads} server thread(s)); "
         f"N={fast.params.poly_modulus_degree}, {fast.samples_per_ciphertext} image(s) per "
         f"ciphertext")
    return latency_ms


def run_demo(*, quick: bool = False, epochs: int | None = None, embed_dim: int = 16,
             vector_samples: int = 3, seed: int = 0, progress: bool = True,
             echo: Any = print) -> DemoResult:
    """Run the whole story; ``quick`` trains briefly on a tiny model and encrypts 40 images."""
    import torch

    import he
    import polynets as pn

    torch.manual_seed(seed)
    xtr, ytr, xte, yte = load_digits_split(seed)
    if quick:
        xte, yte = xte[:40], yte[:40]
        embed_dim = min(embed_dim, 8)
        vector_samples = 0
    n_epochs = epochs if epochs is not None else (3 if quick else 30)
    echo(f"== 1. train a MONet on scikit-learn digits ({len(xtr)} train / {len(xte)} test "
         f"images, 8x8) for {n_epochs} epochs")
    model = pn.MONet(img_size=8, in_chans=1, num_classes=10, patch_size=4, embed="patch",
                     embed_dim=embed_dim, depth=1, expansion=2, norm="batch")
    t0 = time.perf_counter()
    train_classifier(model, xtr, ytr, epochs=n_epochs, seed=seed, progress=progress)
    with torch.no_grad():
        plain = model(torch.as_tensor(xte)).double().numpy()
    acc_plain = _accuracy(plain, yte)
    echo(f"   trained in {time.perf_counter() - t0:.1f} s; plaintext test accuracy "
         f"{100 * acc_plain:.2f}%")

    echo("== 2. certify: is it a polynomial of its input?")
    echo(str(pn.certify(model, torch.as_tensor(xte[:1]))))

    echo("== 3. compile to CKKS: parameters, packing and layouts chosen by the cost model")
    t0 = time.perf_counter()
    prog = he.compile(model, torch.as_tensor(xtr[:1]), calibration=xtr, packing="auto",
                      objective="throughput", batch_size=len(xte), precision_bits=PRECISION_BITS)
    echo(prog.summary())
    echo(f"   compiled in {time.perf_counter() - t0:.2f} s")

    echo("== 4. client makes keys; server gets the public context only (bytes)")
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(he.CompiledProgram.from_bytes(prog.to_bytes()), public)
    echo(f"   public context {len(public) / 2 ** 20:.1f} MiB (public, relinearisation and "
         f"{len(prog.plan.galois_steps())} Galois keys, no secret key)")
    if server.warm_bytes:
        echo(f"   server allocated a group's {server.warm_bytes / 2 ** 20:.0f} MiB of ciphertexts "
             f"as it started ({server.warm_seconds:.1f} s), which its requests write into")

    k = prog.samples_per_ciphertext
    dec, total_s = _classify(prog, client, server, xte, progress, echo)
    acc_enc = _accuracy(dec, yte)
    agree = float(np.mean(dec.argmax(1) == plain.argmax(1)))

    latency_ms = None
    if vector_samples > 0:
        latency_ms = _latency(model, xtr, xte, dec, vector_samples, echo)

    echo("== result")
    echo(f"   plaintext accuracy  {100 * acc_plain:.2f}%")
    echo(f"   encrypted accuracy  {100 * acc_enc:.2f}%  (argmax agreement {100 * agree:.2f}%, "
         f"max |plain - decrypted| {np.max(np.abs(plain - dec)):.2e})")
    echo(f"   throughput          {len(xte) / total_s:.1f} images/s ({prog.packing} packing, "
         f"{k} per ciphertext)" +
         (f"; latency {latency_ms:.0f} ms per image alone" if latency_ms is not None else ""))
    echo(f"   parameters          {prog.params}")
    return DemoResult(len(xte), acc_plain, acc_enc, agree, total_s, latency_ms, prog.packing,
                      str(prog.params))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 3 epochs, 40 test images, no vector timing")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 30)")
    parser.add_argument("--embed-dim", type=int, default=16, help="MONet width (default 16)")
    parser.add_argument("--vector-samples", type=int, default=3,
                        help="images timed alone, one round trip each (0 to skip; default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def main(args: argparse.Namespace) -> int:
    run_demo(quick=args.quick, epochs=args.epochs, embed_dim=args.embed_dim,
             vector_samples=args.vector_samples, seed=args.seed, progress=not args.no_progress)
    return 0
