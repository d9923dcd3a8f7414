"""Encrypted MNIST with Orion (CKKS on Lattigo for PyTorch models): a second baseline.

Orion (``pip install orion-fhe``, imported as ``orion``) takes a network written with its own
layers (``orion.nn``), measures per-layer value ranges on cleartext data (``orion.fit``), packs
every convolution and linear layer into diagonals of one big matrix, places bootstraps where the
modulus chain runs out (``orion.compile``) and then runs the same module on ciphertexts.

Two kinds of networks are measured, each on the same MNIST split as ``he_inference.py`` (first
8,000 test-set images to train, last 2,000 to evaluate):

* ``lola``: Orion's own MNIST example, the LoLA network (``orion.models.LoLA``: conv 2x2 stride 2,
  5 channels + BatchNorm -> x^2 -> fc 980-100 + BatchNorm -> x^2 -> fc 100-10), with Orion's
  example configuration (``LOLA_CONFIG``) and Orion's training recipe (SGD, momentum 0.9, lr 0.1,
  cosine schedule, batch 128, inputs normalised by the MNIST mean and deviation), trained here;
* our networks (``handnet``, ``token1``, ``token2`` of ``he_inference.py``), trained with our
  recipe and converted layer by layer into Orion modules carrying our weights (``to_orion``):
  convolutions, linear maps, BatchNorm (folded by Orion into the preceding layer), squares, and
  for the token models the patch embedding (a convolution with stride = patch), the per-token
  channel maps of each Mu-Layer as 1x1 convolutions and the Hadamard product of its two branches
  as Orion's ciphertext-ciphertext ``Mult``.

Orion keeps ciphertexts inside its Go runtime and has no ciphertext serialisation in its Python
API, so the round trip here is encode + encrypt, server, decrypt + decode, without the bytes on
the wire; ciphertext sizes are computed from the parameters (two polynomials of ``N``
coefficients, 8 bytes per residue), evaluation-key sizes from one serialised rotation key times
the number of distinct keys Orion generated. Each configuration is leveled (no bootstrapping) and
within the HomomorphicEncryption.org bound for 128-bit security; ``leveled_config`` picks the
smallest ring that holds the depth.

    python benchmarks/orion_baseline.py --data-dir ../shared/data/mnist
        [--models lola,handnet,token1,monet2] [--n-latency 10] [--n-accuracy 100] [--quick]

Needs the optional extra: ``pip install -e ".[orion]"``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INSTALL_HINT = ('Orion is not installed. Install the optional extra with\n'
                '    pip install -e ".[orion]"\n'
                '(or "pip install orion-fhe"); it brings Orion and its Lattigo library.')

HERE = Path(__file__).resolve().parent

#: Largest log2(Q*P) for 128-bit classical security with a ternary secret, per log2 of the ring
#: degree (HomomorphicEncryption.org security standard, table for uniform ternary secrets).
HE_STANDARD_MAX_LOGQP = {13: 218, 14: 438, 15: 881, 16: 1772}

#: Orion's configuration for its LoLA example (the repository's ``configs/lola.yml``): ring degree
#: 2^13 over the conjugate-invariant ring (8192 real slots), five 26-bit levels above a 29-bit
#: base prime, two 29-bit special primes, scale 2^26: log2(QP) = 217 <= 218.
LOLA_CONFIG: dict[str, Any] = {
    "ckks_params": {"LogN": 13, "LogQ": [29, 26, 26, 26, 26, 26], "LogP": [29, 29],
                    "LogScale": 26, "H": 8192, "RingType": "ConjugateInvariant"},
    "orion": {"margin": 2, "embedding_method": "hybrid", "backend": "lattigo",
              "fuse_modules": True, "debug": False, "io_mode": "none"},
}

#: MNIST mean and deviation used by Orion's data loaders (its LoLA example's preprocessing).
ORION_MNIST_NORM = (0.1307, 0.3081)


#: Why a spatial shift does not convert.
SHIFT_NOTE = ("; its spatial shift moves channel groups by one token and repeats the border token: "
              "a zero-padded shift would be a depthwise 3x3 convolution with one-hot kernels, but "
              "the repeated border is not translation-invariant, so it is no convolution, and "
              "Orion has no layer that multiplies by a fixed per-position mask to patch it")


class OrionConversionError(ValueError):
    """A layer of a PyTorch model that has no counterpart among Orion's layers."""


# ------------------------------------------------------------------------------ Orion access
def available() -> bool:
    """True when Orion (the ``orion-fhe`` distribution) can be imported."""
    if importlib.util.find_spec("orion") is None:
        return False
    try:
        import orion
    except Exception:  # a broken or foreign ``orion`` package counts as absent
        return False
    return all(hasattr(orion, name) for name in ("init_scheme", "fit", "compile", "encrypt"))


def _orion():
    """Import Orion lazily; a clear error with the install command when it is missing."""
    if not available():
        raise RuntimeError(INSTALL_HINT)
    import orion
    import orion.nn as on
    return orion, on


def orion_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("orion-fhe")
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------ parameters
def leveled_config(levels: int, *, scale_bits: int = 26, base_bits: int = 29,
                   special_bits: int = 29, ring_type: str = "ConjugateInvariant",
                   min_logn: int = 13) -> dict[str, Any]:
    """Orion configuration with ``levels`` rescaling levels and no bootstrapping.

    Moduli as in Orion's LoLA configuration (a ``base_bits`` prime, ``levels`` primes of
    ``scale_bits``, special primes of ``special_bits``). The ring degree is the smallest
    ``2^logn >= 2^min_logn`` whose 128-bit budget holds log2(QP) with at least one special prime;
    within it, the number of special primes that makes a key-switching key smallest
    (Lattigo's keys hold ``ceil(|Q| / |P|)`` ciphertexts of ``|Q| + |P|`` residues)."""
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    logq = [base_bits] + [scale_bits] * levels
    for logn in sorted(HE_STANDARD_MAX_LOGQP):
        if logn < min_logn:
            continue
        fits = [k for k in range(1, len(logq) + 1)
                if sum(logq) + k * special_bits <= HE_STANDARD_MAX_LOGQP[logn]]
        if not fits:
            continue
        n_special = min(fits, key=lambda k: ((len(logq) + k) * math.ceil(len(logq) / k), -k))
        return {"ckks_params": {"LogN": logn, "LogQ": logq, "LogP": [special_bits] * n_special,
                                "LogScale": scale_bits, "H": 1 << logn, "RingType": ring_type},
                "orion": dict(LOLA_CONFIG["orion"])}
    raise ValueError(f"{levels} levels of {scale_bits} bits exceed every ring up to 2^16")


def describe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The CKKS parameters of an Orion configuration, with its security budget."""
    ck = cfg["ckks_params"]
    logn, logq, logp = ck["LogN"], list(ck["LogQ"]), list(ck["LogP"])
    ring_type = ck.get("RingType", "Standard")
    conj = ring_type.lower() != "standard"
    total = sum(logq) + sum(logp)
    bound = HE_STANDARD_MAX_LOGQP[logn]
    return {"ring_degree": 1 << logn, "log_n": logn, "ring_type": ring_type,
            "slots": (1 << logn) if conj else (1 << (logn - 1)),
            "log_q": logq, "log_p": logp, "log_scale": ck.get("LogScale", logq[-1]),
            "levels": len(logq) - 1, "secret_hamming_weight": ck.get("H", 192),
            "log_qp": total, "he_standard_max_log_qp": bound,
            "security": (f"log2(QP) = {total} <= {bound}: 128-bit by the HE standard table for "
                         f"N = 2^{logn}" + (" (table is for power-of-two cyclotomics; the "
                                            "conjugate-invariant ring of the same degree is "
                                            "taken as equivalent)" if conj else ""))
            if total <= bound else f"log2(QP) = {total} > {bound}: below 128 bits"}


# ------------------------------------------------------------------------------ conversion
def _is_square(m: nn.Module) -> bool:
    """A parameter-free module computing x * x."""
    if any(True for _ in m.parameters()) or any(True for _ in m.children()):
        return False
    probe = torch.linspace(-2.0, 2.0, 12).reshape(3, 4)
    try:
        with torch.no_grad():
            out = m(probe)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.shape == probe.shape and \
        torch.allclose(out, probe * probe)


def _copy_params(dst: nn.Module, src: nn.Module) -> None:
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    real_missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if real_missing or unexpected:
        raise OrionConversionError(f"weights of {type(src).__name__} do not map onto "
                                   f"{type(dst).__name__}: missing {real_missing}, "
                                   f"unexpected {unexpected}")


def _conv(on, m: nn.Conv2d, path: str) -> nn.Module:
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        raise OrionConversionError(f"{path}: Conv2d padding {m.padding!r}/{m.padding_mode!r}; "
                                   "Orion takes integer zero padding")
    if m.stride[0] != m.stride[1]:
        raise OrionConversionError(f"{path}: Conv2d stride {m.stride}; Orion's packing needs "
                                   "equal strides")
    c = on.Conv2d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride,
                  padding=m.padding, dilation=m.dilation, groups=m.groups,
                  bias=m.bias is not None)
    _copy_params(c, m)
    return c


def _linear(on, m: nn.Linear, weight: torch.Tensor | None = None) -> nn.Module:
    lin = on.Linear(m.in_features, m.out_features, bias=m.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(m.weight if weight is None else weight)
        if m.bias is not None:
            lin.bias.copy_(m.bias)
    return lin


def _batchnorm(on, m: nn.Module, kind: str) -> nn.Module:
    cls = on.BatchNorm2d if kind == "2d" else on.BatchNorm1d
    bn = cls(m.num_features, eps=m.eps, affine=m.affine)
    _copy_params(bn, m)
    return bn


def _bias(m: nn.Linear) -> torch.Tensor:
    if m.bias is None:
        return torch.zeros(m.out_features, dtype=torch.float64)
    return m.bias.detach().double()


def _fold_norm(lin: nn.Linear, norm: nn.Module, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of ``norm(lin(x))`` as one affine map (float64); norm in eval mode."""
    w, b = lin.weight.detach().double(), _bias(lin)
    if isinstance(norm, nn.Identity):
        return w, b
    if not isinstance(norm, nn.BatchNorm1d) or not norm.track_running_stats:
        raise OrionConversionError(f"{path}: {type(norm).__name__} has no Orion counterpart "
                                   "(BatchNorm folds into the preceding map; LayerNorm "
                                   "divides by data)")
    scale = 1.0 / torch.sqrt(norm.running_var.double() + norm.eps)
    if norm.affine:
        scale = scale * norm.weight.detach().double()
    shift = -norm.running_mean.double() * scale
    if norm.affine:
        shift = shift + norm.bias.detach().double()
    return w * scale[:, None], b * scale + shift


def _pointwise_from(on, w: torch.Tensor, b: torch.Tensor) -> nn.Module:
    """A per-token channel map ``y = W x + b`` as a 1x1 convolution on NCHW tokens."""
    c = on.Conv2d(w.shape[1], w.shape[0], 1, bias=True)
    with torch.no_grad():
        c.weight.copy_(w[:, :, None, None].float())
        c.bias.copy_(b.float())
    return c


_CLASSES: dict[str, type] = {}


def _classes() -> dict[str, type]:
    """Orion module classes for converted networks (defined once Orion is importable)."""
    if _CLASSES:
        return _CLASSES
    _, on = _orion()

    class OrionSequential(on.Module):
        """Orion layers applied in order."""

        def __init__(self, layers: list[nn.Module]):
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def forward(self, x):
            return self.layers(x)

    class OrionMuLayer(on.Module):
        """``Y = C[N_a(A X) * N_b(B D X) + N_a(A X)]`` on channels-first tokens, in the form
        ``Y = C' [P * (B' P)]`` with ``P = [N_a A; D] X`` (one 1x1 convolution with ``m + l``
        outputs), ``B' = [[0, N_b B], [0, 0]]`` carrying the shortcut as ``+1`` on its first
        ``m`` biases (``a * b + a = a * (b + 1)``) and ``C' = [C, 0]``.

        Same function, same depth (four levels), exact up to float rounding of the folded
        BatchNorms. The form is needed because Orion's level solver takes only forks of two
        branches: ``X`` feeding A, D and the residual sum is a three-way fork, and ``a`` feeding
        both the product and the shortcut sum would be a second fork overlapping the first."""

        def __init__(self, mu: nn.Module, path: str):
            super().__init__()
            if getattr(mu, "spatial_shift", False):
                raise OrionConversionError(f"{path}: spatial shift" + SHIFT_NOTE)
            if getattr(mu, "a_rank", None) is not None:
                raise OrionConversionError(f"{path}: factorised A (a_rank) is not converted")
            wa, ba = _fold_norm(mu.A, mu.norm_a, f"{path}.norm_a")
            wb, bb = _fold_norm(mu.B, mu.norm_b, f"{path}.norm_b")
            m, l = mu.A.out_features, mu.D.out_features
            o = mu.C.out_features
            w_p = torch.cat([wa, mu.D.weight.detach().double()])
            b_p = torch.cat([ba, _bias(mu.D)])
            w_b = torch.zeros(m + l, m + l, dtype=torch.float64)
            w_b[:m, m:] = wb
            b_b = torch.zeros(m + l, dtype=torch.float64)
            b_b[:m] = bb + (1.0 if mu.shortcut else 0.0)
            w_c = torch.zeros(o, m + l, dtype=torch.float64)
            w_c[:, :m] = mu.C.weight.detach().double()
            self.P = _pointwise_from(on, w_p, b_p)
            self.B = _pointwise_from(on, w_b, b_b)
            self.C = _pointwise_from(on, w_c, _bias(mu.C))
            self.mult = on.Mult()

        def forward(self, x):
            p = self.P(x)
            return self.C(self.mult(p, self.B(p)))

    class OrionTokenNet(on.Module):
        """Patch embedding + norm, residual Mu-Layers, a linear head on the flattened tokens."""

        def __init__(self, model: nn.Module):
            super().__init__()
            self.embed = _conv(on, model.embed.proj, "embed.proj")
            self.norm = _token_norm(on, model.norm, "norm")
            self.mus = nn.ModuleList(OrionMuLayer(mu, f"mus.{i}")
                                     for i, mu in enumerate(model.mus))
            self.adds = nn.ModuleList(on.Add() for _ in model.mus)
            grid = model.embed.grid_size
            dim = model.embed.embed_dim
            head = model.head
            if head.in_features != dim * grid[0] * grid[1]:
                raise OrionConversionError("head: expects the flattened tokens "
                                           f"({dim} x {grid[0]} x {grid[1]}), got "
                                           f"{head.in_features} inputs")
            # ours flattens tokens channels-last (h, w, c); Orion flattens NCHW (c, h, w)
            w = head.weight.detach().reshape(head.out_features, grid[0] * grid[1], dim)
            self.flatten = on.Flatten()
            self.head = _linear(on, head, w.permute(0, 2, 1).reshape(head.out_features, -1))

        def forward(self, x):
            t = self.embed(x)
            if self.norm is not None:
                t = self.norm(t)
            for mu, add in zip(self.mus, self.adds):
                t = add(t, mu(t))
            return self.head(self.flatten(t))

    _CLASSES.update(OrionSequential=OrionSequential, OrionMuLayer=OrionMuLayer,
                    OrionTokenNet=OrionTokenNet)
    return _CLASSES


def _token_norm(on, m: nn.Module, path: str) -> nn.Module | None:
    if isinstance(m, nn.Identity):
        return None
    if isinstance(m, nn.BatchNorm1d):  # a channels-last BatchNorm over tokens
        return _batchnorm(on, m, "2d")
    raise OrionConversionError(f"{path}: {type(m).__name__} has no Orion counterpart "
                               "(BatchNorm folds into the preceding layer; LayerNorm divides "
                               "by data)")


def _sequential_layers(on, model: nn.Sequential) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for name, m in model.named_children():
        if isinstance(m, nn.Conv2d):
            layers.append(_conv(on, m, name))
        elif isinstance(m, nn.Linear):
            layers.append(_linear(on, m))
        elif isinstance(m, nn.BatchNorm2d):
            layers.append(_batchnorm(on, m, "2d"))
        elif isinstance(m, nn.BatchNorm1d):
            layers.append(_batchnorm(on, m, "1d"))
        elif isinstance(m, nn.Flatten):
            if m.start_dim != 1 or m.end_dim != -1:
                raise OrionConversionError(f"{name}: Flatten({m.start_dim}, {m.end_dim}); "
                                           "Orion flattens from dim 1 to the end")
            layers.append(on.Flatten())
        elif isinstance(m, nn.AvgPool2d):
            layers.append(on.AvgPool2d(m.kernel_size, stride=m.stride, padding=m.padding))
        elif isinstance(m, nn.Identity):
            continue
        elif _is_square(m):
            layers.append(on.Quad())
        else:
            raise OrionConversionError(
                f"{name}: {type(m).__name__} has no Orion counterpart among the layers this "
                "converter maps (Conv2d, Linear, BatchNorm, Flatten, AvgPool2d, x*x)")
    return layers


def to_orion(model: nn.Module) -> nn.Module:
    """An Orion module computing the same function as ``model``, with its weights.

    Handles ``nn.Sequential`` stacks of convolutions, linear layers, BatchNorm, Flatten and
    squares, and the token networks of ``he_inference.py`` (``PatchEmbed`` + channels-last
    BatchNorm + residual Mu-Layers + a linear head). Anything else raises
    ``OrionConversionError`` naming the layer."""
    _, on = _orion()
    cls = _classes()
    if isinstance(model, nn.Sequential):
        net = cls["OrionSequential"](_sequential_layers(on, model))
    elif all(hasattr(model, a) for a in ("embed", "norm", "mus", "head")) and \
            hasattr(model.embed, "proj") and not getattr(model.embed, "merge", None):
        net = cls["OrionTokenNet"](model)
    else:
        uses_shift = any(getattr(m, "spatial_shift", False) for m in model.modules())
        raise OrionConversionError(
            f"{type(model).__name__}: no Orion conversion (supported: nn.Sequential of "
            "Conv2d/Linear/BatchNorm/Flatten/x*x, and patch-embedding + Mu-Layer token nets)"
            + (SHIFT_NOTE if uses_shift else ""))
    net.eval()
    return net


def orion_depth(net: nn.Module) -> int:
    """Multiplicative depth of a converted network as Orion counts it (BatchNorm right after a
    convolution or linear layer is fused and free; a product or a square costs one level)."""
    _, on = _orion()
    cls = _classes()

    def seq_depth(mods) -> int:
        d, prev_linear = 0, False
        for m in mods:
            if isinstance(m, (on.Conv2d, on.Linear)):
                d, prev_linear = d + 1, True
                continue
            if isinstance(m, (on.BatchNorm1d, on.BatchNorm2d)):
                d += 0 if prev_linear else 2
            elif isinstance(m, (on.Quad, on.AvgPool2d)):
                d += 1
            prev_linear = False
        return d

    if isinstance(net, cls["OrionSequential"]):
        return seq_depth(list(net.layers))
    if isinstance(net, cls["OrionTokenNet"]):
        # embedding (its norm fused), per Mu-Layer P, B', the product and C', the head
        return 1 + 4 * len(net.mus) + 1
    return seq_depth(list(net.modules())[1:])


# ------------------------------------------------------------------------------ measurement
def _rss_mib() -> float:
    """Resident memory of this process now (MiB); the peak where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _calibration_loader(x: torch.Tensor, n: int):
    from torch.utils.data import DataLoader, TensorDataset
    xs = x[:n]
    # batch size 1 is the batch Orion packs for; fit() widens it while collecting ranges
    return DataLoader(TensorDataset(xs, torch.zeros(len(xs))), batch_size=1, shuffle=False)


def _galois_element(k: int, ring_degree: int, conjugate_invariant: bool) -> int:
    nth_root = (4 if conjugate_invariant else 2) * ring_degree
    return pow(5, k, nth_root)


def _key_sizes(scheme, params: dict) -> dict[str, Any]:
    """Evaluation keys Orion generated: one serialised rotation key times the distinct keys."""
    conj = params["ring_type"].lower() != "standard"
    lt_keys = {int(k) for k in scheme.lt_evaluator.saved_rotation_keys}
    po2 = {_galois_element(1 << i, params["ring_degree"], conj)
           for i in range(int(math.log2(params["slots"])))}
    keys = lt_keys | po2
    if not keys:
        return {"rotation_keys": 0}
    serial, ptr = scheme.backend.GenerateAndSerializeRotationKey(min(keys))
    try:
        each = len(serial)
    finally:
        scheme.backend.FreeCArray(ptr)
    return {"rotation_keys": len(keys), "rotation_keys_of_linear_layers": len(lt_keys),
            "rotation_keys_power_of_two": len(po2), "rotation_key_bytes_each": each,
            "evaluation_key_bytes": (len(keys) + 1) * each,
            "evaluation_key_note": "distinct Galois keys x one serialised key (Lattigo binary), "
                                   "plus the relinearisation key counted at the same size"}


def _ciphertext_bytes(params: dict, level: int) -> int:
    return 2 * params["ring_degree"] * (level + 1) * 8


def run_orion(net: nn.Module, config: dict[str, Any], calib: torch.Tensor,
              x: torch.Tensor, y: torch.Tensor, *, n_latency: int = 10,
              n_accuracy: int = 100, n_calibration: int = 8000,
              preprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Fit, compile and run an Orion module on encrypted images; a JSON-able dict of figures.

    ``calib``: training images for Orion's range fitting; ``x``/``y``: test images and labels
    (the first ``n_accuracy`` are classified encrypted, the first ``n_latency`` of those timed);
    ``preprocess``: client-side input transform applied before encoding."""
    orion, on = _orion()
    prep = preprocess or (lambda t: t)
    params = describe_config(config)
    n_accuracy = max(n_accuracy, n_latency, 1)
    net.eval()
    with torch.no_grad():
        clear_all = net(prep(x)).double().numpy()
    scheme = orion.init_scheme(config)
    out: dict[str, Any] = {"params": params, "orion_version": orion_version()}
    try:
        t0 = time.perf_counter()
        orion.fit(net, _calibration_loader(prep(calib), n_calibration))
        out["fit_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        input_level = orion.compile(net)
        out["compile_s"] = time.perf_counter() - t0
        boots = sum(isinstance(m, on.Bootstrap) for m in net.modules())
        params.update(input_level=int(input_level), bootstraps=int(boots))
        out["rss_after_compile_mib"] = _rss_mib()
        out.update(_key_sizes(scheme, params))
        net.he()
        logits, enc_t, srv_t, dec_t, n_ct = [], [], [], [], None
        # one untimed image first: Orion's first encrypted call also warms up PyTorch
        order = [0] + list(range(n_accuracy))
        for j, i in enumerate(_progress(order, progress, "orion encrypted")):
            xi = prep(x[i:i + 1])
            t0 = time.perf_counter()
            ct = orion.encrypt(orion.encode(xi, input_level))
            t1 = time.perf_counter()
            res = net(ct)
            t2 = time.perf_counter()
            val = res.decrypt().decode()
            t3 = time.perf_counter()
            n_ct = len(ct.ids)
            out_level = res.level()
            del ct, res
            if j == 0:
                continue
            logits.append(np.asarray(val, dtype=np.float64).reshape(-1)[:clear_all.shape[1]])
            if len(enc_t) < n_latency:
                enc_t.append(t1 - t0)
                srv_t.append(t2 - t1)
                dec_t.append(t3 - t2)
        net.eval()
        enc = np.stack(logits)
        clear = clear_all[:len(enc)]
        yn = y.numpy()
        out.update({
            "clear_accuracy": float(np.mean(clear_all.argmax(1) == yn)),
            "encrypted": {
                "images": len(enc),
                "accuracy": float(np.mean(enc.argmax(1) == yn[:len(enc)])),
                "clear_accuracy_same_images": float(np.mean(clear.argmax(1) == yn[:len(enc)])),
                "argmax_agreement_with_clear": float(np.mean(enc.argmax(1) == clear.argmax(1))),
                "max_abs_error": float(np.max(np.abs(enc - clear))),
                "clear_max_abs_logit": float(np.max(np.abs(clear)))},
            "latency": {
                "images": len(srv_t),
                "median_round_trip_s": statistics.median(
                    a + b + c for a, b, c in zip(enc_t, srv_t, dec_t)),
                "median_server_s": statistics.median(srv_t),
                "median_encode_encrypt_s": statistics.median(enc_t),
                "median_decrypt_decode_s": statistics.median(dec_t),
                "round_trip_note": "encode+encrypt, server, decrypt+decode in one process; "
                                   "Orion exposes no ciphertext serialisation"},
            "sizes": {"input_ciphertexts": n_ct,
                      "input_ciphertext_bytes": n_ct * _ciphertext_bytes(params, input_level),
                      "output_ciphertext_bytes": _ciphertext_bytes(params, out_level),
                      "output_level": int(out_level),
                      "ciphertext_note": "computed: 2 polynomials x N x (level+1) residues x "
                                         "8 bytes"},
            "rss_mib": _rss_mib(),
            "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        for k in ("rotation_keys", "rotation_key_bytes_each", "evaluation_key_bytes",
                  "rotation_keys_of_linear_layers", "rotation_keys_power_of_two",
                  "evaluation_key_note"):
            if k in out:
                out["sizes"][k] = out.pop(k)
        return out
    finally:
        _release(orion, scheme, net)


def _release(orion, scheme, net: nn.Module) -> None:
    """Free Orion's state so another network can be compiled in the same process.

    Orion's linear layers and tensors delete their Go-side objects by id when collected, so they
    must go before the scheme is reset (ids restart from zero in the next scheme)."""
    scheme.traced = None
    for m in net.modules():
        if hasattr(m, "transform_ids") and m.transform_ids:
            try:
                scheme.lt_evaluator.delete_transforms(m.transform_ids)
            except Exception:
                pass
            m.transform_ids = {}
        for attr in list(vars(m)):
            if attr.endswith("_ptxt"):
                setattr(m, attr, None)
    gc.collect()
    orion.delete_scheme()
    gc.collect()


def _progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm
    return tqdm(it, desc=desc, leave=False)


# ------------------------------------------------------------------------------ LoLA
def lola_model() -> nn.Module:
    """Orion's LoLA MNIST network (``orion.models.LoLA``)."""
    _orion()
    import orion.models as models
    return models.LoLA()


def orion_normalise(x: torch.Tensor) -> torch.Tensor:
    mean, std = ORION_MNIST_NORM
    return (x - mean) / std


def train_orion_recipe(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 20,
                       lr: float = 0.1, batch: int = 128, seed: int = 0,
                       preprocess: Callable[[torch.Tensor], torch.Tensor] = orion_normalise,
                       progress: bool = True) -> nn.Module:
    """Orion's training recipe: SGD (momentum 0.9, weight decay 5e-4), cosine schedule over the
    epochs, plain cross-entropy, batch 128, normalised inputs."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    xp = preprocess(x)
    for _ in _progress(range(epochs), progress, "train LoLA (Orion recipe)"):
        net.train()
        perm = torch.randperm(len(xp))
        for i in range(0, len(xp), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(net(xp[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
    net.eval()
    return net


def run_lola(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
             *, epochs: int = 20, config: dict[str, Any] | None = None, seed: int = 0,
             **kw) -> dict[str, Any]:
    """Orion's LoLA example trained on ``train`` with Orion's recipe, run encrypted on ``test``
    under Orion's LoLA configuration (or ``config``)."""
    xtr, ytr = train
    xte, yte = test
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    net = train_orion_recipe(lola_model(), xtr, ytr, epochs=epochs, seed=seed,
                             progress=kw.get("progress", True))
    train_s = time.perf_counter() - t0
    res = run_orion(net, config or LOLA_CONFIG, xtr, xte, yte, preprocess=orion_normalise, **kw)
    res.update(model="Orion LoLA (orion.models.LoLA): conv 2x2/2 x5 + BN -> x^2 -> fc 980-100 "
                     "+ BN -> x^2 -> fc 100-10",
               weights="trained here with Orion's recipe", epochs=epochs, train_seconds=train_s,
               config="Orion's LoLA configuration" if config is None else "given")
    return res


# ------------------------------------------------------------------------------ our networks
def run_network(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor],
                test: tuple[torch.Tensor, torch.Tensor], *, config: dict[str, Any] | None = None,
                **kw) -> dict[str, Any]:
    """A trained PyTorch model of ours converted into Orion (same weights), run encrypted.

    ``config``: an Orion configuration; by default ``leveled_config`` at the depth Orion needs
    for the converted network (no bootstrapping)."""
    model = model.eval()
    xtr, _ = train
    xte, yte = test
    net = to_orion(model)
    with torch.no_grad():
        ref = model(xte[:256]).double()
        got = net(xte[:256]).double()
    depth = orion_depth(net)
    cfg = config or leveled_config(depth)
    res = run_orion(net, cfg, xtr, xte, yte, **kw)
    res.update(orion_depth=depth,
               conversion_max_abs_diff=float((ref - got).abs().max()),
               weights="ours, loaded into Orion layers")
    return res


# ------------------------------------------------------------------------------ script
def _he_inference():
    """The sibling benchmark, for its data split, model definitions and training recipe."""
    spec = importlib.util.spec_from_file_location("he_inference", HERE / "he_inference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("he_inference", mod)
    spec.loader.exec_module(mod)
    return mod


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


def print_table(res: dict[str, Any]) -> None:
    rows = [("model", "N", "L", "boot", "clear acc", "enc acc (n)", "server ms", "round trip ms",
             "input ct", "eval keys")]
    for name, e in res["models"].items():
        if "error" in e:
            rows.append((name, "-", "-", "-", "-", e["error"][:60], "", "", "", ""))
            continue
        p, enc, lat, s = e["params"], e["encrypted"], e["latency"], e["sizes"]
        rows.append((name, str(p["ring_degree"]), str(p["levels"]), str(p["bootstraps"]),
                     f"{100 * e['clear_accuracy']:.2f}%",
                     f"{100 * enc['accuracy']:.1f}% ({enc['images']})",
                     f"{1e3 * lat['median_server_s']:.0f}",
                     f"{1e3 * lat['median_round_trip_s']:.0f}",
                     _fmt_bytes(s.get("input_ciphertext_bytes")),
                     _fmt_bytes(s.get("evaluation_key_bytes"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(HERE.parents[1] / "shared" / "data" / "mnist"))
    ap.add_argument("--models", default="lola,handnet,token1,monet2",
                    help="lola (Orion's example) and any of he_inference.py's handnet, token1, "
                         "token2, monet2 (token2 needs a 2^14 ring in Orion; its compilation "
                         "peaks near 10 GB of memory; monet2 is reported as not expressible)")
    ap.add_argument("--n-latency", type=int, default=10, help="images timed one by one")
    ap.add_argument("--n-accuracy", type=int, default=100,
                    help="test images classified encrypted")
    ap.add_argument("--epochs", type=int, default=None, help="override every model's epochs")
    ap.add_argument("--quick", action="store_true", help="1 epoch, 3 timed, 10 encrypted")
    ap.add_argument("--output", default=str(HERE / "results" / "orion_baseline.json"))
    args = ap.parse_args(argv)
    if not available():
        print(INSTALL_HINT, file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    hi = _he_inference()
    xtr, ytr, xte, yte = hi.load_mnist(args.data_dir)
    if args.quick:
        args.n_latency, args.n_accuracy = min(args.n_latency, 3), min(args.n_accuracy, 10)
    kw = dict(n_latency=args.n_latency, n_accuracy=args.n_accuracy)
    res: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "orion_fhe": orion_version(), "load_average_at_start": list(os.getloadavg()),
                    "timing_note": "shared machine: latencies scale with the load average"},
        "data": {"train": len(xtr), "test": len(xte), "encrypted_images": args.n_accuracy,
                 "latency_images": args.n_latency},
        "ours_for_comparison": "benchmarks/results/he_inference.json (same split, same "
                               "recipes, he.compile on TenSEAL)",
        "models": {}}
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        name = name.strip()
        print(f"\n=== {name} ===", flush=True)
        try:
            if name == "lola":
                epochs = 1 if args.quick else (args.epochs or 20)
                entry = run_lola((xtr, ytr), (xte, yte), epochs=epochs, **kw)
            else:
                to_orion(hi.make_model(name))  # expressible in Orion? (before training)
                epochs, lr = hi.RECIPES.get(name, (10, 2e-3))
                epochs = 1 if args.quick else (args.epochs or epochs)
                t0 = time.perf_counter()
                torch.manual_seed(0)
                model = hi.train(hi.make_model(name), xtr, ytr, epochs, augment=True, lr=lr)
                train_s = time.perf_counter() - t0
                entry = run_network(model, (xtr, ytr), (xte, yte), **kw)
                entry.update(epochs=epochs, train_seconds=train_s)
        except OrionConversionError as e:
            entry = {"error": f"not expressible in Orion: {e}"}
        entry["load_average_after"] = list(os.getloadavg())
        res["models"][name] = entry
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=2))
        os.replace(tmp, out_path)
    print()
    print_table(res)
    print(f"wrote {out_path}")
    return res


if __name__ == "__main__":
    main()
