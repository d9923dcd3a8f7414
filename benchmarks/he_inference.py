"""Encrypted MNIST inference: compiled polynets models vs TenSEAL's own tutorial recipe.

Baseline (TenSEAL "Encrypted Convolution on MNIST" tutorial, high-level API): conv 7x7 stride 3
with 4 kernels -> x^2 -> fc 256-64 -> x^2 -> fc 64-10; ring 8192, moduli [31, 26 x 6, 31],
scale 2^26, ``ts.im2col_encoding`` + ``conv2d_im2col`` + ``square_`` + ``mm``; trained with the
tutorial's recipe (Adam, lr 1e-3, 10 epochs, batch 64).

Ours, a family of models trained on the same images, traced, certified and compiled by
``he.compile`` (parameters, layouts and samples per ciphertext chosen by the compiler):

* ``handnet``: conv 5x5 stride 3 (8 channels) + BatchNorm -> x^2 -> fc 512-24 + BatchNorm -> x^2
  -> fc 24-10 (designed for encryption);
* ``token1`` / ``token2``: a 4x4 patch embedding (7x7 tokens, 32 channels) + BatchNorm, one or two
  residual Mu-Layers (BatchNorm) on the tokens, a linear head on the flattened tokens;
* ``monet2``: ``pn.MONet`` with two Poly-Blocks (spatial shift, BatchNorm), a pyramid patch
  embedding (2x2 patches, one merge: 7x7 tokens, 32 channels), mean pooling (degree 16).

For each: vector packing latency (one image per round trip: encrypt, serialise, server, decrypt),
the server time of one ciphertext next to the cost model's prediction, the same model compiled
with hoisted rotations off (``he.hoist.ENV_NO_HOISTING``) and its server timed on the same
images (the same-run baseline of hoisting), where the program folds a group of rotations at a
time the same model folding one at a time (``he.compiler.folds_one_at_a_time``, alternated on
the same images), images/s when the
ciphertext is filled with as many images as the plan interleaves, and batch packing (one image per
slot) with one process and with ``--workers`` processes -- run when the cost model predicts a
group within ``--batch-budget`` seconds, otherwise reported as predicted only -- and tokens
packing (one ciphertext per channel, the tokens of a group of images in its slots: every test
image once, with the process's memory while compiling, making keys and serving).

Data: the MNIST test-set files (idx); train on the first 8,000 images, evaluate on the last 2,000.
All models and the baseline are measured in the same run; the JSON has the machine, the figures
and the ratios.

    python benchmarks/he_inference.py --data-dir ../shared/data/mnist [--models token1,monet2]
        [--n-latency 10] [--workers 2] [--quick] [--orion]

``--orion`` adds Orion (``pip install -e ".[orion]"``, see ``orion_baseline.py``) to the same run:
its own LoLA example and each model converted to Orion layers with the same trained weights.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tenseal as ts
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

import he
import he.hoist
import he.wire
import polynets as pn
from he import _kernels as he_kernels
from he.compiler import shared_values_as_steps
from he.runtime import available_memory, eager_products
from polynets.ir.lowering import lower
from polynets.training.data import read_idx
from polynets.ir.program import atomic_write_bytes


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


class TokenNet(nn.Module):
    """Patch embedding + BatchNorm, ``depth`` residual Mu-Layers on the tokens, a linear head."""

    def __init__(self, depth: int = 1, dim: int = 32, patch: int = 4, img: int = 28):
        super().__init__()
        self.embed = pn.PatchEmbed(img, patch, 1, dim)
        self.norm = pn.layers.ChannelsLastBatchNorm(dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim, norm="batch") for _ in range(depth))
        self.head = nn.Linear(dim * (img // patch) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(self.embed(x))
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


def make_model(name: str) -> nn.Module:
    if name == "handnet":
        return polynets_net()
    if name in ("token1", "token2"):
        return TokenNet(depth=int(name[-1]))
    if name == "monet2":
        return pn.MONet(img_size=28, in_chans=1, num_classes=10, patch_size=2, embed_dim=32,
                        depth=2, merges=1, norm="batch", init="trunc_normal")
    raise SystemExit(f"unknown model {name!r}; one of handnet, token1, token2, monet2")


#: (epochs, learning rate) per model at full length
RECIPES = {"handnet": (25, 3e-3), "token1": (15, 2e-3), "token2": (15, 2e-3),
           "monet2": (15, 2e-3)}


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
def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _PeakRSS:
    """The process's largest resident memory while the block runs (sampled every 50 ms)."""

    def __enter__(self) -> "_PeakRSS":
        import threading

        self.peak_mib = _rss_mib()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.05):
                self.peak_mib = max(self.peak_mib, _rss_mib())
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, _rss_mib())


def _batch_pass(client: he.Client, server: he.Server, images: torch.Tensor,
                workers: int, warm: bool = False) -> dict:
    """Client encrypt + serialise, server load + run + serialise, client decrypt; timed. A
    server that did not allocate its ciphertext memory as it started (``he.Server(...,
    warm=False)``) pays for first-touching it in its first request (SEAL's pool keeps it for the
    next); ``warm`` runs the same request once more and times that too, a serving process's
    steady state."""
    t0 = time.perf_counter()
    ct = client.encrypt(images, progress=True, workers=workers).to_bytes()
    rss0 = _rss_mib()
    t1 = time.perf_counter()
    with _PeakRSS() as rss:
        out = server.run(ct, progress=True, workers=workers).to_bytes()
    t2 = time.perf_counter()
    logits = client.decrypt(out)
    t3 = time.perf_counter()
    n = len(images)
    res = {"logits": logits, "images": n, "workers": workers, "seconds": t3 - t0,
           "encrypt_s": t1 - t0, "server_s": t2 - t1, "decrypt_s": t3 - t2,
           "images_per_s": n / (t3 - t0), "server_images_per_s": n / (t2 - t1),
           "ciphertext_bytes": len(ct),
           # what the server's run added to this process at its peak (one process only)
           "server_peak_rss_added_mib": rss.peak_mib - rss0 if workers == 1 else None,
           "server_tiles": {str(e): k for e, k in server.tiles.items()},
           # the product steps it left unrelinearised (he.compiler.batch_group_memory)
           "server_lazy_products": list(server.lazy_products),
           # rows its tiles wrote to disk and read back (none where the tiles fit)
           "server_spilled_rows": server.spilled}
    if warm:
        t4 = time.perf_counter()
        server.run(ct, workers=workers).to_bytes()
        res["warm_server_s"] = time.perf_counter() - t4
        res["warm_server_images_per_s"] = n / res["warm_server_s"]
        res["warm_images_per_s"] = n / (t1 - t0 + res["warm_server_s"] + t3 - t2)
    return res


def _compiled(model: nn.Module, xcal: torch.Tensor, packing: str, precision_bits: int,
              costs: he.costmodel.CostModel | None, **compile_kwargs: Any
              ) -> tuple[Any, he.Client, bytes, he.Server, float, float, float, float]:
    """Compile, make keys and a server: the program, client, public context, server, the
    seconds of compiling and of keys and server, and the MiB this process grew by with them
    and at its peak while compiling."""
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    with _PeakRSS() as compile_rss:
        prog = he.compile(model, xcal[:1], calibration=xcal, packing=packing,
                          precision_bits=precision_bits, cost_model=costs, **compile_kwargs)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(prog, public)
    setup_s = time.perf_counter() - t0
    return (prog, client, public, server, compile_s, setup_s, _rss_mib() - rss0,
            compile_rss.peak_mib - rss0)


def plan_line(prog: Any) -> str:
    """The vector plan's line of ``prog.summary()`` (rotations, hoisted baby steps, keys,
    products)."""
    return next(line.strip() for line in prog.summary().splitlines()
                if line.strip().startswith("vector plan"))


def ours_vector(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, n: int,
                precision_bits: int, costs: he.costmodel.CostModel | None = None,
                **compile_kwargs: Any) -> dict:
    """Latency (one image per round trip) and the filled-ciphertext throughput
    (``compile_kwargs``: more arguments of ``he.compile``, e.g. ``ring_degree``)."""
    prog, client, public, server, compile_s, setup_s, rss, _ = _compiled(
        model, xcal, "vector", precision_bits, costs, **compile_kwargs)
    outs, times, server_times, ct_sizes, enc_times = [], [], [], [], []
    for i in tqdm(range(n), desc="polynets vector packing", leave=False):
        t0 = time.perf_counter()
        ct = client.encrypt(x[i:i + 1]).to_bytes()
        t1 = time.perf_counter()
        out = server.run(ct).to_bytes()
        t2 = time.perf_counter()
        outs.append(client.decrypt(out)[0])
        times.append(time.perf_counter() - t0)
        server_times.append(t2 - t1)
        enc_times.append(t1 - t0)
        ct_sizes.append(len(ct))
    # the same requests from a client and on a server of one thread each: the baselines of
    # the threaded client's encryption and the threaded server
    single = he.Server(prog, public, threads=1)
    single_client = he.Client.from_secret_context(prog, client.secret_context(), threads=1)
    # where the server kept one thread against the compiler's (he.Server.warm): those threads
    # on the same requests, the baseline of that choice
    forced = he.Server(prog, public, threads=prog.server_threads) \
        if server.engine.pool.threads != prog.server_threads else None
    one_thread, enc_one_thread, compiler_threads = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        ct = single_client.encrypt(x[i:i + 1]).to_bytes()
        t1 = time.perf_counter()
        single.run(ct)
        one_thread.append(time.perf_counter() - t1)
        enc_one_thread.append(t1 - t0)
        if forced is not None:
            t0 = time.perf_counter()
            forced.run(ct)
            compiler_threads.append(time.perf_counter() - t0)
    k = prog.plan.interleave
    full = _batch_pass(client, server, x[torch.arange(k) % len(x)], 1)
    del single, single_client, forced
    gc.collect()
    blocks = _block_baseline(client, server, x, n) if server.engine.hoister is not None else {}
    step_profile = _profile(client, server, x)
    folds = _folds_baseline(model, xcal, prog, client, server, x, n, precision_bits, costs,
                            **compile_kwargs) if "fold_hoist" in prog.options else {}
    # forked while this process holds one server, not two: a fork's memory adds to this one's
    unhoisted = isolated(lambda: _unhoisted(model, xcal, x, n, precision_bits, costs,
                                            **compile_kwargs)) \
        if prog.plan.uses_hoister else {}
    final_map = _map_baseline(model, xcal, client, server, x, n, precision_bits, costs, "final",
                              **compile_kwargs) if prog.options.get("client_map") else {}
    gc.collect()
    first_map = _map_baseline(model, xcal, client, server, x, n, precision_bits, costs, "first",
                              **compile_kwargs) if prog.options.get("client_first") else {}
    gc.collect()
    both = _map_baseline(model, xcal, client, server, x, n, precision_bits, costs, "both",
                         **compile_kwargs) \
        if prog.options.get("client_first") and prog.options.get("client_map") else {}
    pred = prog.plan.predicted
    # the cost model's seconds on the threads the server kept (it times the compiler's
    # against one as it starts: he.Server.warm)
    pred_server = server.predicted_seconds or pred["seconds_per_ciphertext"]
    err = float(np.max(np.abs(np.array(outs) - prog.simulate(x[:n].numpy()))))
    return {"logits": np.array(outs), "median_s": statistics.median(times),
            "max_abs_error_vs_simulation": err, "promised_error": prog.params.expected_error,
            "within_promise": err <= prog.params.expected_error,
            "server_median_s": statistics.median(server_times),
            "server_threads": server.engine.pool.threads, "threads_note": server.threads_note,
            "compiler_threads": prog.server_threads, "threads_why": server.threads_why,
            "threads_trial_s": {str(k): v for k, v in server.threads_trial.items()},
            "server_warm_s": server.warm_seconds,
            **({"compiler_threads_server_median_s": statistics.median(compiler_threads)}
               if compiler_threads else {}),
            "server_one_thread_median_s": statistics.median(one_thread),
            "client_encrypt_median_s": statistics.median(enc_times),
            "client_threads": client.threads if client._native is not None
            and client._native.ok else 1,
            "client_encrypt_one_thread_median_s": statistics.median(enc_one_thread),
            "predicted_client_s": pred["client_seconds"],
            "threads_speedup": statistics.median(one_thread) / statistics.median(server_times),
            "predicted_server_s": pred_server,
            "prediction_error": pred_server / statistics.median(server_times) - 1,
            "images_per_ciphertext": k, "filled_images_per_s": full["images_per_s"],
            "filled_server_s": full["server_s"],
            "ciphertext_bytes": int(np.median(ct_sizes)), "public_context_bytes": len(public),
            "compile_s": compile_s, "keys_and_server_s": setup_s,
            "rss_after_keys_and_server_mib": rss, "predicted_memory_mib":
            pred["server_memory_bytes"] / 2 ** 20, "params": str(prog.params),
            "ring": prog.params.poly_modulus_degree, "levels": prog.params.levels,
            "plan": plan_line(prog),
            "why": prog.plan.why, "counts": pred["counts"],
            "layouts": prog.plan.orders, **unhoisted, **folds, **blocks, **final_map,
            **first_map, **both, "client_map": bool(prog.options.get("client_map")),
            "client_first": bool(prog.options.get("client_first")),
            "input_ciphertexts": len(prog.plan.input_layout),
            "server_returns": len(prog.plan.results),
            "step_profile": step_profile,
            **({"hoisting_speedup": unhoisted["unhoisted_server_median_s"] /
                statistics.median(server_times)} if unhoisted else {})}


class ProcessDied(RuntimeError):
    """A model's process ended before it answered (killed for memory, or a crash in SEAL)."""


def _own_progress_locks() -> None:
    """A forked process's own progress-bar locks: tqdm's lock is shared with the parent (a
    multiprocessing lock made before the fork), so a child killed for memory while it held it
    would leave the parent waiting at its next progress bar for ever."""
    import threading

    from tqdm.std import TqdmDefaultWriteLock
    from tqdm.std import tqdm as std_tqdm

    TqdmDefaultWriteLock.th_lock = threading.RLock()
    TqdmDefaultWriteLock.mp_lock = multiprocessing.RLock()
    std_tqdm.set_lock(TqdmDefaultWriteLock())


def isolated(fn: Callable[[], dict]) -> dict:
    """``fn()`` in a forked process of its own, so that each model's keys, ciphertexts and SEAL's
    memory pool (which keeps what it once allocated) go back to the system when it ends, and a
    model killed for memory does not end the run (:class:`ProcessDied`); an exception in it is
    raised here. In this process where ``fork`` is unavailable."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return fn()
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        _own_progress_locks()
        try:
            send.send(("ok", fn()))
        except ProcessDied as exc:               # a process of its own died: so did this
            send.send(("died", str(exc)))
        except BaseException as exc:             # noqa: BLE001 - reported to the parent
            send.send(("error", f"{type(exc).__name__}: {exc}"))

    process = ctx.Process(target=child)
    process.start()
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        process.join()
        raise ProcessDied(f"the model's process ended with exit code {process.exitcode} before "
                          f"it answered (killed for memory?)") from None
    finally:
        receive.close()
    process.join()
    if status == "died":
        raise ProcessDied(value)
    if status == "error":
        raise RuntimeError(f"in the model's process: {value}")
    return value


def _folds_baseline(model: nn.Module, xcal: torch.Tensor, prog: Any, client: he.Client,
                    server: he.Server, x: torch.Tensor, n: int, precision_bits: int,
                    costs: he.costmodel.CostModel | None, **compile_kwargs: Any) -> dict:
    """Where the program folds a group of rotations at a time (``he.plan.fold_groups``), the
    same model compiled folding one rotation at a time
    (:func:`he.compiler.folds_one_at_a_time`), its own keys and server, timed on the same
    images alternated with the grouped server: the baseline of the grouping."""
    with he.compiler.folds_one_at_a_time():
        base, base_client, _, base_server, *_ = _compiled(model, xcal, "vector", precision_bits,
                                                          costs, **compile_kwargs)
    times: dict[str, list[float]] = {"grouped": [], "single": []}
    for i in range(n):
        for name, c, s in (("grouped", client, server), ("single", base_client, base_server)):
            ct = c.encrypt(x[i:i + 1]).to_bytes()
            t0 = time.perf_counter()
            s.run(ct)
            times[name].append(time.perf_counter() - t0)
    grouped, single = statistics.median(times["grouped"]), statistics.median(times["single"])
    return {"fold_groups": prog.plan.hoisted_folds(),
            "folds_grouped_server_median_s": grouped, "folds_single_server_median_s": single,
            "folds_single_predicted_server_s": base_server.predicted_seconds
            or base.plan.predicted["seconds_per_ciphertext"],
            "folds_single_server_threads": base_server.engine.pool.threads,
            "folds_grouping_speedup": single / grouped}


#: per map :func:`_map_baseline` compares: the compile arguments, the names of the results with
#: the server applying it and with the client, and its words (``"both"``: every map on the
#: server, the whole network evaluated there, as Orion and the recipe do)
MAP_BASELINES = {"final": (("final_map",), "server_map", "client_map", "the last map"),
                 "first": (("first_map",), "server_first", "client_first", "the first maps"),
                 "both": (("final_map", "first_map"), "server_all", "client_maps", "every map")}


def _map_baseline(model: nn.Module, xcal: torch.Tensor, client: he.Client, server: he.Server,
                  x: torch.Tensor, n: int, precision_bits: int,
                  costs: he.costmodel.CostModel | None, which: str, **compile_kwargs: Any
                  ) -> dict:
    """Where the client applies the program's last map (``which="final"``, ``final_map``), its
    first maps (``"first"``, ``first_map``) or either (``"both"``), the same model compiled
    with those on the server, its own keys and server, timed on the same images alternated
    with the client's program, round trips (encryption, server, decryption and the client's
    maps) and servers alone: the baseline of the client's maps."""
    args, on_server, on_client, _ = MAP_BASELINES[which]
    base = he.compile(model, xcal[:1], calibration=xcal, packing="vector",
                      precision_bits=precision_bits, cost_model=costs,
                      **{arg: "server" for arg in args}, **compile_kwargs)
    # a second server beside the first: where this machine's memory would not hold it, no
    # baseline (said in the results) rather than a process killed for memory
    need = float(base.plan.predicted.get("server_memory_bytes", 0))
    free = he.runtime.available_memory()
    if 1.5 * need > free:
        return {f"{on_client}_baseline_skipped":
                f"a second server predicted at {need / 2 ** 30:.1f} GiB, "
                f"{free / 2 ** 30:.1f} GiB available"}
    base_client = he.Client(base)
    base_server = he.Server(base, base_client.public_context())
    rounds: dict[str, list[float]] = {"client": [], "server": []}
    serves: dict[str, list[float]] = {"client": [], "server": []}
    for i in range(n):
        for name, c, s in (("client", client, server), ("server", base_client, base_server)):
            t0 = time.perf_counter()
            ct = c.encrypt(x[i:i + 1]).to_bytes()
            t1 = time.perf_counter()
            out = s.run(ct).to_bytes()
            t2 = time.perf_counter()
            c.decrypt(out)
            rounds[name].append(time.perf_counter() - t0)
            serves[name].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    smed = {k: statistics.median(v) for k, v in serves.items()}
    return {f"{on_server}_median_s": med["server"], f"{on_client}_median_s": med["client"],
            f"{on_server}_server_median_s": smed["server"],
            f"{on_client}_server_median_s": smed["client"],
            f"{on_server}_ring": base.params.poly_modulus_degree,
            f"{on_server}_levels": base.params.levels,
            f"{on_server}_input_ciphertexts": len(base.plan.input_layout),
            f"{on_server}_predicted_server_s": base_server.predicted_seconds
            or base.plan.predicted["seconds_per_ciphertext"],
            f"{on_client}_speedup": med["server"] / med["client"]}


def _block_baseline(client: he.Client, server: he.Server, x: torch.Tensor, n: int) -> dict:
    """The hoisted loops' block (``he.hoist.PRODUCT_BLOCK`` words) against 512, the size used
    before: the same server and plan, the hoister's block switched between requests on the
    same images, alternated (the results are the same words)."""
    hoister = server.engine.hoister
    times: dict[int, list[float]] = {he.hoist.PRODUCT_BLOCK: [], 512: []}
    try:
        for i in range(n):
            ct = client.encrypt(x[i:i + 1]).to_bytes()
            for block in times:
                hoister.block = block
                t0 = time.perf_counter()
                server.run(ct)
                times[block].append(time.perf_counter() - t0)
    finally:
        hoister.block = he.hoist.PRODUCT_BLOCK
    now, before = (statistics.median(times[b]) for b in (he.hoist.PRODUCT_BLOCK, 512))
    return {"block_server_median_s": now, "block512_server_median_s": before,
            "products_block_speedup": before / now}


def _profile(client: he.Client, server: he.Server, x: torch.Tensor) -> dict:
    """The first image's steps timed one by one beside their predictions
    (:meth:`he.Server.profile`, the median of three)."""
    ct = client.encrypt(x[:1]).to_bytes()
    runs = [server.profile(ct) for _ in range(3)]
    rows = []
    for i, r in enumerate(runs[0].rows):
        rows.append({"steps": list(r.steps), "kind": r.kind, "level": r.level, "work": r.work,
                     "predicted_s": r.predicted,
                     "measured_s": statistics.median(p.rows[i].measured for p in runs)})
    print(runs[len(runs) // 2], flush=True)
    return {"threads": runs[0].threads, "note": runs[0].note, "rows": rows}


def _unhoisted(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, n: int,
               precision_bits: int, costs: he.costmodel.CostModel | None,
               **compile_kwargs: Any) -> dict:
    """The same-run baseline of hoisting: the model compiled with hoisting off
    (``he.hoist.ENV_NO_HOISTING``: SEAL's rotations one by one, the BSGS splits that minimise
    the rotations), its server timed on the same images."""
    saved = os.environ.get(he.hoist.ENV_NO_HOISTING)
    os.environ[he.hoist.ENV_NO_HOISTING] = "1"
    try:
        prog, client, _, server, *_ = _compiled(model, xcal, "vector", precision_bits, costs,
                                                **compile_kwargs)
        times = []
        for i in range(n):
            ct = client.encrypt(x[i:i + 1]).to_bytes()
            t0 = time.perf_counter()
            server.run(ct)
            times.append(time.perf_counter() - t0)
    finally:
        if saved is None:
            os.environ.pop(he.hoist.ENV_NO_HOISTING, None)
        else:
            os.environ[he.hoist.ENV_NO_HOISTING] = saved
    pred = prog.plan.predicted
    return {"unhoisted_server_median_s": statistics.median(times),
            "unhoisted_predicted_server_s": server.predicted_seconds
            or pred["seconds_per_ciphertext"],
            "unhoisted_server_threads": server.engine.pool.threads,
            "unhoisted_counts": pred["counts"]}


#: predicted seconds of a batch group below which ``--batch-once`` still times a second pass
#: (and the lazy products' baseline, :func:`_lazy_baseline`)
BATCH_REPEAT_S = 60.0


def _lazy_baseline(client: he.Client, server: he.Server, images: torch.Tensor) -> dict:
    """The same server, keys and request with every product relinearised and rescaled
    (:func:`he.runtime.eager_products`), in the same tiles: the baseline of the lazy products,
    timed between two warm passes with them."""
    ct = client.encrypt(images).to_bytes()
    times = {}
    for name in ("lazy", "eager", "lazy_again"):
        with contextlib.ExitStack() as stack:
            if name == "eager":
                stack.enter_context(eager_products())
            t0 = time.perf_counter()
            server.run(ct).to_bytes()
            times[name] = time.perf_counter() - t0
    lazy = min(times["lazy"], times["lazy_again"])
    return {"lazy_products": list(server.lazy_products),
            "lazy_products_tiles": {str(e): k for e, k in server.tiles.items()},
            "eager_products_server_s": times["eager"], "lazy_products_server_s": lazy,
            "lazy_products_speedup": times["eager"] / lazy}


def _loads_baseline(client: he.Client, server: he.Server, images: torch.Tensor) -> dict:
    """The same server and request with its inputs loaded through SEAL's own stream, one at a
    time (:func:`he.wire.seal_loads`): the baseline of the direct loads on the server's
    threads. Two passes each, alternated, the faster of each kept: the first pass through
    SEAL's stream in a process also takes the memory its loads stage in."""
    ct = client.encrypt(images).to_bytes()
    times: dict[str, list[float]] = {"direct": [], "seal": []}
    for name in ("direct", "seal", "seal", "direct"):
        with contextlib.ExitStack() as stack:
            if name == "seal":
                stack.enter_context(he.wire.seal_loads())
            t0 = time.perf_counter()
            server.run(ct).to_bytes()
            times[name].append(time.perf_counter() - t0)
    direct, seal_s = min(times["direct"]), min(times["seal"])
    return {"seal_loads_server_s": seal_s, "direct_loads_server_s": direct,
            "direct_loads_speedup": seal_s / direct, "loads_passes_s": times}


def composed_shared(prog: Any) -> list[int]:
    """The thin values several maps read (``polynets.ir.lowering.Lowered.shared``) that the
    program composed into each of them (those it did not keep apart)."""
    kept_apart = set(prog.options.get("kept_apart") or ())
    return [n for n in lower(prog.program).shared if n not in kept_apart]


def _shared_baseline(model: nn.Module, xcal: torch.Tensor, prog: Any, client: he.Client,
                     server: he.Server, images: torch.Tensor, precision_bits: int,
                     costs: he.costmodel.CostModel | None, budget: int | None) -> dict:
    """Where the program composed thin values several maps read into each of them
    (``polynets.ir.lowering.Lowered.shared``), the same model compiled with them kept as steps
    of their own (:func:`he.compiler.shared_values_as_steps`), its own keys and request: the
    baseline of composing them. Two passes each, alternated, the faster of each kept."""
    shared = composed_shared(prog)
    if not shared:
        return {}                               # none composed
    with shared_values_as_steps():
        kept = he.compile(model, xcal[:1], calibration=xcal, packing="batch",
                          precision_bits=precision_bits, cost_model=costs, memory_budget=budget)
    kclient = he.Client(kept)
    kserver = he.Server(kept, kclient.public_context(), memory_budget=budget)
    requests = {"composed": (server, client.encrypt(images).to_bytes()),
                "kept": (kserver, kclient.encrypt(images).to_bytes())}
    times: dict[str, list[float]] = {"composed": [], "kept": []}
    for name in ("composed", "kept", "kept", "composed"):
        srv, ct = requests[name]
        t0 = time.perf_counter()
        srv.run(ct).to_bytes()
        times[name].append(time.perf_counter() - t0)
    composed, kept_s = min(times["composed"]), min(times["kept"])
    return {"shared_composed": shared, "shared_kept_levels": kept.params.levels,
            "shared_kept_predicted_s": kept.plan.predicted["seconds_per_ciphertext"],
            "shared_kept_server_s": kept_s, "shared_composed_server_s": composed,
            "shared_composed_speedup": kept_s / composed, "shared_passes_s": times}


def ours_batch(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, precision_bits: int,
               workers: int, budget_s: float,
               costs: he.costmodel.CostModel | None = None,
               memory_gib: float | None = None, once: bool = False) -> dict:
    """Batch packing: the test images fill the slots of ``workers`` ciphertext groups (repeated
    up to that many samples, so the figure is the amortised cost of full groups); the client
    encrypts and the server evaluates with ``workers`` processes (independent groups run side by
    side). Accuracy uses the first ``len(x)`` samples, i.e. every test image once. The same
    program and keys also run one group in one process, for the single-core figure. Skipped
    (predicted figures only) when the cost model predicts a group above ``budget_s``.
    ``memory_gib``: the memory the compiler and the server may use (default: what is free), so
    a group larger than that runs in tiles; ``once``: one group in one process only (no
    NumPy-loops pass, no several processes; a second pass only where the group is predicted
    under :data:`BATCH_REPEAT_S`), for groups of minutes."""
    budget = None if memory_gib is None else int(memory_gib * 2 ** 30)
    prog = he.compile(model, xcal[:1], calibration=xcal, packing="batch",
                      precision_bits=precision_bits, cost_model=costs, memory_budget=budget)
    pred = prog.plan.predicted
    slots = prog.params.slots
    res = {"params": str(prog.params), "ring": prog.params.poly_modulus_degree,
           "levels": prog.params.levels, "slots": slots,
           "predicted_group_s": pred["seconds_per_ciphertext"],
           "predicted_images_per_s": slots / pred["seconds_per_ciphertext"],
           "counts": pred["counts"], "why": prog.plan.why,
           "predicted_tiles": pred.get("tiles", {}),
           "predicted_spills": pred.get("spills", {}),
           "predicted_untiled_memory_gib": pred.get("untiled_memory_bytes", 0) / 2 ** 30}
    if pred["seconds_per_ciphertext"] > budget_s:
        res["skipped"] = (f"predicted {pred['seconds_per_ciphertext']:.0f} s per group > "
                          f"--batch-budget {budget_s:.0f} s")
        return res
    client = he.Client(prog)
    public = client.public_context()
    server = he.Server(prog, public, memory_budget=budget)
    # the server allocated a group's ciphertext memory as it started (he.Server.warm), which
    # its first request then reuses: timed apart from the requests
    res.update(server_warm_s=server.warm_seconds, server_warm_gib=server.warm_bytes / 2 ** 30)
    try:
        # a group of seconds is timed twice even with ``once``: one pass of a noisy shared
        # machine can be 20% off the next (token1: 7.7 s, then 6.4 s, on one server)
        single = _batch_pass(client, server, x[torch.arange(slots) % len(x)], 1,
                             warm=not once or pred["seconds_per_ciphertext"] < BATCH_REPEAT_S)
    except he.ResourceError as exc:           # the group does not fit the memory free now
        res["skipped"] = str(exc)
        res["predicted_working_memory_gib"] = pred["working_memory_bytes"] / 2 ** 30
        return res
    if once:
        res.update({k: v for k, v in single.items() if k != "logits"})
        res["logits"] = single["logits"][:len(x)]
        res["prediction_error"] = pred["seconds_per_ciphertext"] / single["server_s"] - 1
        if "warm_server_s" in single:
            res["prediction_error_next"] = pred["seconds_per_ciphertext"] / \
                single["warm_server_s"] - 1
        res["predicted_working_memory_gib"] = pred.get("working_memory_bytes", 0) / 2 ** 30
        res.update(public_context_bytes=len(public), groups=1)
        if pred["seconds_per_ciphertext"] < BATCH_REPEAT_S:
            if server.lazy_products:
                res.update(_lazy_baseline(client, server, x[torch.arange(slots) % len(x)]))
            res.update(_loads_baseline(client, server, x[torch.arange(slots) % len(x)]))
            res.update(_shared_baseline(model, xcal, prog, client, server,
                                        x[torch.arange(slots) % len(x)], precision_bits,
                                        costs, budget))
        return res
    if server.lazy_products:
        res.update(_lazy_baseline(client, server, x[torch.arange(slots) % len(x)]))
    res.update(_loads_baseline(client, server, x[torch.arange(slots) % len(x)]))
    res.update(_shared_baseline(model, xcal, prog, client, server,
                                x[torch.arange(slots) % len(x)], precision_bits, costs, budget))
    if he_kernels.expected():
        # the same program and request with the fused maps' NumPy loops: the baseline of the
        # compiled ones (he._kernels), one warm server pass each
        ct = client.encrypt(x[torch.arange(slots) % len(x)]).to_bytes()
        with he_kernels.numpy_loops():
            t0 = time.perf_counter()
            server.run(ct).to_bytes()
            res["numpy_loops_server_s"] = time.perf_counter() - t0
        res["compiled_loops_speedup"] = res["numpy_loops_server_s"] / single["warm_server_s"]
    # each worker holds a group's ciphertexts: as many workers as the memory allows
    fit = int(available_memory() // max(1.5 * pred["server_memory_bytes"], 1))
    workers = max(1, min(workers, fit))
    res["memory_limited_workers"] = workers
    full = x[torch.arange(workers * slots) % len(x)]
    par = _batch_pass(client, server, full, workers) if workers > 1 else dict(single)
    res.update({k: v for k, v in par.items() if k != "logits"})
    res["logits"] = par["logits"][:len(x)]
    res["single_process"] = {k: v for k, v in single.items() if k != "logits"}
    res["prediction_error"] = pred["seconds_per_ciphertext"] / single["server_s"] - 1
    # a serving process's steady state, the same request again
    res["prediction_error_warm"] = pred["seconds_per_ciphertext"] / single["warm_server_s"] - 1
    res["predicted_working_memory_gib"] = pred.get("working_memory_bytes", 0) / 2 ** 30
    res.update(public_context_bytes=len(public), groups=workers)
    return res


def ours_tokens(model: nn.Module, xcal: torch.Tensor, x: torch.Tensor, precision_bits: int,
                workers: int, costs: he.costmodel.CostModel | None = None) -> dict:
    """Tokens packing (one ciphertext per channel, the tokens of ``plan.interleave`` images in
    its slots): every test image once, in groups, with one process and with ``workers``; the
    process's peak memory while compiling, making keys and serving is reported beside the
    prediction."""
    prog, client, public, server, compile_s, setup_s, keys_mib, compile_mib = _compiled(
        model, xcal, "tokens", precision_bits, costs)
    pred = prog.plan.predicted
    k = prog.plan.interleave
    single = _batch_pass(client, server, x, 1)
    groups = -(-len(x) // k)
    res = {"params": str(prog.params), "ring": prog.params.poly_modulus_degree,
           "levels": prog.params.levels, "images_per_group": k, "groups": groups,
           "plan": next(line.strip() for line in prog.summary().splitlines()
                        if line.strip().startswith("tokens plan")),
           "why": prog.plan.why, "counts": pred["counts"],
           "predicted_group_s": pred["seconds_per_ciphertext"],
           "predicted_images_per_s": k / pred["seconds_per_ciphertext"],
           "predicted_server_memory_mib": pred["server_memory_bytes"] / 2 ** 20,
           "compile_s": compile_s, "compile_peak_rss_added_mib": compile_mib,
           "keys_and_server_s": setup_s, "rss_after_keys_and_server_mib": keys_mib,
           "public_context_bytes": len(public),
           "promised_error": prog.params.expected_error}
    res.update({k_: v for k_, v in single.items() if k_ != "logits"})
    res["logits"] = single["logits"]
    res["server_memory_mib"] = keys_mib + single["server_peak_rss_added_mib"]
    res["prediction_error"] = pred["seconds_per_ciphertext"] * groups / single["server_s"] - 1
    res["max_abs_error_vs_simulation"] = float(np.max(np.abs(
        single["logits"] - prog.simulate(x.numpy()))))
    if workers > 1:
        par = _batch_pass(client, server, x, workers)
        res["processes"] = {k_: v for k_, v in par.items() if k_ != "logits"}
    # what the compiler picks for throughput when the server may use 4 GiB
    auto = he.compile(model, xcal[:1], calibration=xcal, packing="auto", objective="throughput",
                      precision_bits=precision_bits, cost_model=costs, memory_budget=4 * 2 ** 30)
    res["auto_4gib"] = {"packing": auto.packing, "why": auto.plan.why,
                        "predicted_server_memory_mib":
                        auto.plan.predicted["server_memory_bytes"] / 2 ** 20}
    return res


class Drift:
    """How many times slower this machine runs SEAL's primitives now than when the run's cost
    model was set up: :func:`he.costmodel.probe_speed` now over the same probe at the start. A
    shared machine's speed drifts over a run by more than the cost model's error, so each
    measurement is bracketed by two probes and its prediction is also reported scaled by their
    geometric mean (next to the unscaled one, which the compiler's choices used)."""

    def __init__(self, costs: he.costmodel.CostModel | None):
        self.reference = costs or he.costmodel.default_model()
        self.start = self._probe()

    def _probe(self) -> float:
        return he.costmodel.probe_speed(self.reference)[0]

    def now(self) -> float:
        return self._probe() / self.start

    def annotate(self, entry: dict, before: float, after: float | None = None) -> None:
        """Add ``machine_drift`` and ``prediction_error_drift_corrected`` to a result whose
        ``prediction_error`` is predicted over measured seconds, less one (``after``: the
        drift read after the measurement, if already read)."""
        if "prediction_error" not in entry:
            return
        drift = float(np.sqrt(before * (self.now() if after is None else after)))
        entry["machine_drift"] = drift
        entry["prediction_error_drift_corrected"] = (1 + entry["prediction_error"]) * drift - 1


def _print_vector(name: str, e: dict, v: dict) -> None:
    print(f"{name}: degree {e['degree']}, plaintext {100 * e['plain_accuracy']:.2f}%; "
          f"vector N={v['ring']} latency {v['median_s'] * 1e3:.0f} ms "
          f"({v['latency_speedup_vs_baseline']:.1f}x vs baseline), server "
          f"{v['server_median_s']:.3f} s on {v['server_threads']} threads (predicted "
          f"{v['predicted_server_s']:.3f} s, {100 * v['prediction_error']:+.0f}%; "
          f"{100 * v.get('prediction_error_drift_corrected', float('nan')):+.0f}% at the "
          f"machine's speed then; one thread {v['server_one_thread_median_s']:.3f}"
          f" s), client encryption {v['client_encrypt_median_s'] * 1e3:.1f} ms on "
          f"{v['client_threads']} threads (predicted {v['predicted_client_s'] * 1e3:.1f} ms; "
          f"one thread {v['client_encrypt_one_thread_median_s'] * 1e3:.1f} ms), "
          f"{v['images_per_ciphertext']} images per ciphertext -> "
          f"{v['filled_images_per_s']:.1f} img/s; max error vs simulation "
          f"{v['max_abs_error_vs_simulation']:.2e} (promised {v['promised_error']:.2e})")
    if "hoisting_speedup" in v:
        print(f"   without hoisting (compiled in the same run): server "
              f"{v['unhoisted_server_median_s']:.3f} s (predicted "
              f"{v['unhoisted_predicted_server_s']:.3f} s) -> hoisting "
              f"{v['hoisting_speedup']:.2f}x")
    for _, on_server, on_client, what in MAP_BASELINES.values():
        if f"{on_client}_speedup" not in v:
            continue
        print(f"   {what} on the server (compiled in the same run, alternated): round "
              f"trip {v[f'{on_server}_median_s'] * 1e3:.0f} ms at N={v[f'{on_server}_ring']}, "
              f"{v[f'{on_server}_levels']} levels (server "
              f"{v[f'{on_server}_server_median_s']:.3f} s, predicted "
              f"{v[f'{on_server}_predicted_server_s']:.3f} s) against "
              f"{v[f'{on_client}_median_s'] * 1e3:.0f} ms with the client applying them "
              f"(server {v[f'{on_client}_server_median_s']:.3f} s) -> "
              f"{v[f'{on_client}_speedup']:.2f}x")
    if "products_block_speedup" in v:
        print(f"   hoisted loops in blocks of 512 words (the same server, alternated): "
              f"{v['block512_server_median_s']:.3f} s against "
              f"{v['block_server_median_s']:.3f} s in blocks of {he.hoist.PRODUCT_BLOCK} -> "
              f"{v['products_block_speedup']:.2f}x")
    if "folds_grouping_speedup" in v:
        print(f"   folds one rotation at a time (compiled in the same run, alternated): server "
              f"{v['folds_single_server_median_s']:.3f} s (predicted "
              f"{v['folds_single_predicted_server_s']:.3f} s) against "
              f"{v['folds_grouped_server_median_s']:.3f} s grouped -> grouping "
              f"{v['folds_grouping_speedup']:.2f}x")
    if "latency_speedup_vs_orion" in v:
        print(f"   Orion, same network and weights: "
              f"{e['orion_same_network']['latency']['median_round_trip_s'] * 1e3:.0f} ms "
              f"-> {v['latency_speedup_vs_orion']:.1f}x")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" /
                                              "data" / "mnist"))
    ap.add_argument("--models", default="handnet,token1,token2,monet2")
    ap.add_argument("--n-latency", type=int, default=10, help="images timed one by one")
    ap.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    ap.add_argument("--precision-bits", type=int, default=8,
                    help="output precision asked of the compiler (argmax needs few bits)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="processes for batch packing (client and server); one group each")
    ap.add_argument("--batch-budget", type=float, default=240.0,
                    help="run batch packing only when a group is predicted within this many s")
    ap.add_argument("--batch-memory", type=float, default=None,
                    help="GiB the batch compiler and server may use (default: the free "
                         "memory); a group larger than that runs in tiles")
    ap.add_argument("--packings", default="vector,batch,tokens",
                    help="which of our packings to run: vector, batch, tokens (the baseline "
                         "runs whatever)")
    ap.add_argument("--batch-once", action="store_true",
                    help="batch packing: one group in one process only (no NumPy loops or "
                         "several processes, no second pass where a group is predicted over "
                         "a minute), for groups of minutes")
    ap.add_argument("--quick", action="store_true", help="1 epoch, 200 test images, 2 timed")
    ap.add_argument("--orion", action="store_true",
                    help="also run Orion (optional extra [orion]) in the same run: its LoLA "
                         "example and each of our models with our weights")
    ap.add_argument("--orion-models", default="handnet,token1",
                    help="our models also run in Orion (token2 needs ~10 GB there; monet2 has "
                         "no Orion form)")
    ap.add_argument("--orion-accuracy", type=int, default=100,
                    help="test images Orion classifies encrypted")
    ap.add_argument("--shipped-costs", action="store_true",
                    help="plan with the cost table shipped with the package (scaled by a probe "
                         "of this machine) or its cached one instead of timing SEAL's primitives "
                         "at the start of the run "
                         "(the machine's speed drifts; predictions are compared with "
                         "measurements of the same run)")
    ap.add_argument("--output", default=str(Path(__file__).resolve().parent / "results" /
                                            "he_inference.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_mnist(args.data_dir)
    if args.quick:
        xte, yte = xte[:200], yte[:200]
        args.n_latency = min(args.n_latency, 2)
    ynp = yte.numpy()
    n = args.n_latency

    costs = None if args.shipped_costs else he.costmodel.measure(progress=True)
    drift = Drift(costs)
    t0 = time.perf_counter()
    base_model = train(TutorialConvNet(), xtr, ytr, 1 if args.quick else 10, augment=False,
                       lr=1e-3, tutorial=True)
    with torch.no_grad():
        base_plain = base_model(xte).double().numpy()
    base = baseline(base_model, xte, n)
    res: dict = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "tenseal": ts.__version__,
                    "torch": torch.__version__},
        "data": {"train": len(xtr), "test": len(xte), "latency_images": n},
        "cost_model": (costs or he.costmodel.default_model()).source
        + ("" if costs is None else " (timed at the start of this run)"),
        "baseline_tenseal_tutorial": {
            "plain_accuracy": accuracy(base_plain, ynp),
            "encrypted_accuracy_latency_subset": accuracy(base["logits"], ynp[:n]),
            "median_latency_s": base["median_s"], "ciphertext_bytes": base["ciphertext_bytes"],
            "public_context_bytes": base["public_context_bytes"], "params": base["params"]},
        "models": {}}
    orion = None
    if args.orion:
        # Orion runs in processes of its own: its runtime keeps what it allocated (23.5 GB
        # after the 2-Mu-Layer token model), which ran the next model out of memory here
        import orion_baseline as orion
        if not isolated(orion.available):
            raise SystemExit(orion.INSTALL_HINT)
        lola = isolated(lambda: orion.run_lola((xtr, ytr), (xte, yte),
                                               epochs=1 if args.quick else 20, n_latency=n,
                                               n_accuracy=args.orion_accuracy))
        res["baseline_orion_lola"] = lola
    for name in args.models.split(","):
        epochs, lr = RECIPES[name] if name in RECIPES else (10, 2e-3)
        epochs = 1 if args.quick else (args.epochs or epochs)
        t0 = time.perf_counter()
        model = train(make_model(name), xtr, ytr, epochs, augment=True, lr=lr)
        train_s = time.perf_counter() - t0
        with torch.no_grad():
            plain = model(xte).double().numpy()
        cert = pn.certify(model, xte[:1])
        print(cert)
        packings = args.packings.split(",")
        vec = bat = None
        if "vector" in packings:
            before = drift.now()
            vec = ours_vector(model, xtr, xte, n, args.precision_bits, costs)
            drift.annotate(vec, before)
        if "batch" in packings:
            before = drift.now()
            bat = ours_batch(model, xtr, xte, args.precision_bits, max(1, args.workers),
                             args.batch_budget, costs, args.batch_memory, args.batch_once)
            drift.annotate(bat, before)
        else:
            bat = {"skipped": "--packings", "ring": 0, "predicted_images_per_s": float("nan")}
        entry = {"epochs": epochs, "train_seconds": train_s, "degree": cert.degree,
                 "certified_levels": cert.levels, "plain_accuracy": accuracy(plain, ynp),
                 "batch": {k: v for k, v in bat.items() if k != "logits"}}
        if "tokens" in packings:
            tok = ours_tokens(model, xtr, xte, args.precision_bits, max(1, args.workers), costs)
            entry["tokens"] = {k: v for k, v in tok.items() if k != "logits"}
            entry["tokens"]["encrypted_accuracy"] = accuracy(tok["logits"], ynp)
            entry["tokens"]["argmax_agreement"] = float(np.mean(
                tok["logits"].argmax(1) == plain.argmax(1)))
            entry["tokens"]["max_abs_error"] = float(np.max(np.abs(tok["logits"] - plain)))
        if vec is not None:
            entry["vector"] = {k: v for k, v in vec.items() if k != "logits"}
            entry["vector"]["argmax_agreement_latency_subset"] = float(np.mean(
                vec["logits"].argmax(1) == plain[:n].argmax(1)))
            entry["vector"]["latency_speedup_vs_baseline"] = base["median_s"] / vec["median_s"]
        if "logits" in bat:
            entry["batch"]["encrypted_accuracy"] = accuracy(bat["logits"], ynp)
            entry["batch"]["argmax_agreement"] = float(np.mean(
                bat["logits"].argmax(1) == plain.argmax(1)))
            entry["batch"]["max_abs_error"] = float(np.max(np.abs(bat["logits"] - plain)))
        if orion is not None and name in args.orion_models.split(","):
            try:
                o = isolated(lambda: orion.run_network(model, (xtr, ytr), (xte, yte),
                                                       n_latency=n,
                                                       n_accuracy=args.orion_accuracy))
            except Exception as exc:            # a network Orion cannot express is reported
                # (or one that ran out of memory: ProcessDied)
                o = {"error": f"{type(exc).__name__}: {exc}"}
            entry["orion_same_network"] = o
            if "latency" in o and vec is not None:
                entry["vector"]["latency_speedup_vs_orion"] = (
                    o["latency"]["median_round_trip_s"] / vec["median_s"])
        res["models"][name] = entry
        atomic_write_bytes(args.output, json.dumps(res, indent=2).encode())
    b = res["baseline_tenseal_tutorial"]
    print(f"\nbaseline (TenSEAL tutorial): plaintext accuracy {100 * b['plain_accuracy']:.2f}%, "
          f"median latency {b['median_latency_s'] * 1e3:.0f} ms")
    if "baseline_orion_lola" in res:
        lat = res["baseline_orion_lola"]["latency"]
        print(f"baseline (Orion's LoLA example): median round trip "
              f"{lat['median_round_trip_s'] * 1e3:.0f} ms")
    for name, e in res["models"].items():
        v, t = e.get("vector"), e["batch"]
        if v is None:
            print(f"{name}: degree {e['degree']}, plaintext {100 * e['plain_accuracy']:.2f}%")
        else:
            _print_vector(name, e, v)
        if "tokens" in e:
            tk = e["tokens"]
            extra = ""
            if "processes" in tk:
                extra = (f", {tk['processes']['images_per_s']:.1f} img/s with "
                         f"{tk['processes']['workers']} processes")
            print(f"   tokens N={tk['ring']}: encrypted accuracy "
                  f"{100 * tk['encrypted_accuracy']:.2f}%, {tk['images_per_s']:.1f} img/s with 1 "
                  f"process (server alone {tk['server_images_per_s']:.1f}; predicted "
                  f"{tk['predicted_images_per_s']:.1f}){extra}; {tk['images_per_group']} images "
                  f"per group; server memory {tk['server_memory_mib']:.0f} MiB (predicted "
                  f"{tk['predicted_server_memory_mib']:.0f}), compile peak "
                  f"{tk['compile_peak_rss_added_mib']:.0f} MiB; packing='auto' for throughput "
                  f"within 4 GiB: {tk['auto_4gib']['packing']}")
        if "skipped" in t:
            print(f"   batch N={t['ring']}: {t['skipped']} (predicted "
                  f"{t['predicted_images_per_s']:.1f} img/s per process)")
        elif "single_process" not in t:           # --batch-once
            tiles = t["server_tiles"] or "none"
            print(f"   batch N={t['ring']}: encrypted accuracy {100 * t['encrypted_accuracy']:.2f}%"
                  f", {t['images_per_s']:.1f} img/s with 1 process (server alone "
                  f"{t['server_images_per_s']:.1f}; predicted {t['predicted_images_per_s']:.1f},"
                  f" error {100 * t['prediction_error']:+.0f}%, "
                  f"{100 * t.get('prediction_error_drift_corrected', float('nan')):+.0f}% at the"
                  f" machine's speed then); tiles {tiles}: server memory added "
                  f"{t['server_peak_rss_added_mib']:.0f} MiB"
                  f" (predicted {t['predicted_working_memory_gib'] * 1024:.0f} MiB, untiled "
                  f"{t['predicted_untiled_memory_gib'] * 1024:.0f} MiB)"
                  + (f"; {t['server_spilled_rows']} rows spilled to disk and read back"
                     if t.get("server_spilled_rows") else "")
                  + (f"; next request: server {t['warm_server_images_per_s']:.0f} img/s, "
                     f"error {100 * t['prediction_error_next']:+.0f}%"
                     if "prediction_error_next" in t else ""))
        else:
            one = t["single_process"]
            print(f"   batch N={t['ring']}: encrypted accuracy {100 * t['encrypted_accuracy']:.2f}%"
                  f", {one['images_per_s']:.0f} img/s with 1 process (server alone "
                  f"{one['server_images_per_s']:.0f}; predicted {t['predicted_images_per_s']:.0f}),"
                  f" {t['images_per_s']:.0f} img/s with {t['workers']} processes; next request "
                  f"{one['warm_images_per_s']:.0f} img/s (server alone "
                  f"{one['warm_server_images_per_s']:.0f})")
            if "compiled_loops_speedup" in t:
                print(f"   fused maps' compiled loops: server {one['warm_server_s']:.1f} s, "
                      f"NumPy loops {t['numpy_loops_server_s']:.1f} s in the same run -> "
                      f"{t['compiled_loops_speedup']:.2f}x")
        if "lazy_products_speedup" in t:
            print(f"   lazy products (steps {t['lazy_products']}): server "
                  f"{t['lazy_products_server_s']:.1f} s, every product finished "
                  f"{t['eager_products_server_s']:.1f} s in the same run -> "
                  f"{t['lazy_products_speedup']:.2f}x")
        if "direct_loads_speedup" in t:
            print(f"   direct loads on the server's threads: server "
                  f"{t['direct_loads_server_s']:.2f} s, SEAL's stream "
                  f"{t['seal_loads_server_s']:.2f} s in the same run -> "
                  f"{t['direct_loads_speedup']:.2f}x")
        if "shared_composed_speedup" in t:
            print(f"   shared values composed into their readers (program nodes "
                  f"{t['shared_composed']}): server {t['shared_composed_server_s']:.2f} s, kept "
                  f"as steps {t['shared_kept_server_s']:.2f} s (predicted "
                  f"{t['shared_kept_predicted_s']:.2f} s) in the same run -> "
                  f"{t['shared_composed_speedup']:.2f}x")
    print(f"wrote {args.output}")
    return res


if __name__ == "__main__":
    main()
