"""The ``polynets`` command: ``train``, ``eval``, ``certify``, ``plot``, ``bench`` and plugin subcommands.

Plugins: every entry point of the group :data:`COMMAND_GROUP` (``polynets.commands``) names a
function ``register(subparsers)`` that adds subcommands; the distribution declares those of ``he``
(``demo``, ``compile``, ``encrypt``, ``run``, ``decrypt``, ...) and ``symbolic`` (``discover``) in
``pyproject.toml``, and any other installed package can add its own. polynets never names the
packages that depend on it. Errors of the polynets hierarchy print as ``polynets: error: <message>`` with exit code 2.
Under ``torchrun --nproc_per_node N -m polynets.cli train ...`` training is distributed.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polynets.errors import CheckpointError, ConfigError, DataError, PolynetsError, check_int
from polynets.ir.program import loads_json_strict

__all__ = ["COMMAND_GROUP", "build_parser", "main"]

COMMAND_GROUP = "polynets.commands"
BENCHMARK_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
TIMM_SIZE_KEYS = ("num_classes", "in_chans", "img_size")


# ------------------------------------------------------------------------------ helpers
def parse_model_args(items: Sequence[str] | None) -> dict[str, Any]:
    """``["embed_dim=64", "depth=[2,2]", "norm=batch"]`` -> dict; values are JSON when they parse, else strings.

    Lists and objects must be valid JSON within bounds (see :func:`~polynets.training.checkpoint.check_model_kwargs`).
    """
    from polynets.training.checkpoint import check_model_kwargs

    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--model-arg expects KEY=VALUE (e.g. embed_dim=64), got {item!r}")
        try:
            value = loads_json_strict(raw, f"--model-arg {key.strip()}", ConfigError, max_bytes=1 << 16, max_depth=8)
        except ConfigError:
            if raw.lstrip()[:1] in ("[", "{"):
                raise
            value = {"true": True, "false": False, "none": None}.get(raw.lower(), raw)
        out[key.strip()] = value
    return check_model_kwargs(out, "--model-arg")


def model_kwargs_for(name: str, info: Any, user: dict[str, Any]) -> dict[str, Any]:
    """Arguments that build model ``name`` for dataset ``info``: geometry from the data, then ``user``.

    The data's sizes (num_classes, in_chans/img_size or seq_len/in_features) are passed when the
    builder names them (timm builders get num_classes, in_chans, img_size). ``monet`` on small
    images (<= 32 px) also gets a small default: width 64, depth 4, 2x2 patches merged once
    (1x1 when the side is not a multiple of 4), so 8 px digits give 2x2 tokens, 28 px MNIST 7x7,
    and truncated-normal (std 0.02) init, which keeps the degree-256 output small at the start.
    """
    import timm

    from polynets.training.checkpoint import model_builder

    builder = model_builder(name)
    params = inspect.signature(builder).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    takes_images = "img_size" in params or "in_chans" in params or timm.is_model(name)
    if info.kind != "image" and takes_images:
        raise ConfigError(
            f"model {name!r} takes images (B, C, H, W), but dataset {info.name!r} is {info.kind} data with samples "
            f"of shape {info.input_shape}; for sequences use --model polymorpher_classifier, for tabular data a "
            "model that takes in_features (Python API)")
    kwargs = {k: v for k, v in info.model_kwargs().items()
              if k in params or (open_kwargs and k in TIMM_SIZE_KEYS)}
    if name.lower() == "monet" and info.kind == "image" and info.img_size <= 32:
        kwargs.update(patch_size=2 if info.img_size % 4 == 0 else 1, embed_dim=64, depth=4, init="trunc_normal")
    kwargs.update(user)
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(
            f"model {name!r} needs {', '.join(missing)}, which dataset {info.name!r} ({info.kind} data, samples "
            f"of shape {info.input_shape}) does not give; for images use --model monet or a timm name, for "
            f"sequences --model polymorpher_classifier, or pass them with --model-arg KEY=VALUE")
    return kwargs


def shaped_model_kwargs(name: str, shape: Sequence[int], user: dict[str, Any],
                        num_classes: int | None = None) -> dict[str, Any]:
    """Arguments that build model ``name`` for samples of ``shape`` (``--input-shape``): for a
    square image ``(C, H, H)`` its geometry as :func:`model_kwargs_for` gives it for such data
    (``num_classes`` only where given), then ``user``; other shapes: ``user`` alone."""
    from polynets.training.data import DatasetInfo

    if len(shape) != 3 or shape[1] != shape[2]:
        return dict(user)
    info = DatasetInfo(name=f"samples of shape {tuple(shape)}", kind="image",
                       num_classes=num_classes or 1, num_train=0, num_test=0,
                       in_chans=int(shape[0]), img_size=int(shape[1]))
    kwargs = model_kwargs_for(name, info, user)
    if num_classes is None and "num_classes" not in user:
        kwargs.pop("num_classes", None)
    return kwargs


def _run_info(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """The dataset record a checkpoint was trained with (an empty dict when there is none)."""
    info = checkpoint["extra"].get("run_info") or {}
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: extra['run_info'] must be a dict, got {type(info).__name__}")
    expected = {"dataset": (str,), "data_dir": (str,), "seed": (int,), "test_size": (float, int),
                "img_size": (int,)}
    for key, types in expected.items():
        value = info.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise CheckpointError(f"{path}: the recorded {key} {value!r} is not a {types[0].__name__}; pass "
                                  f"--{key.replace('_', '-')} explicitly or use another checkpoint")
    return info


def _load_data(args: argparse.Namespace, run_info: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    from polynets.training.data import load_dataset

    saved = run_info or {}
    defaults = {"dataset": None, "data_dir": None, "seed": 0, "test_size": 0.2, "img_size": 224}
    chosen = {k: getattr(args, k, None) if getattr(args, k, None) is not None else saved.get(k, default)
              for k, default in defaults.items()}
    if not chosen["dataset"]:
        raise ConfigError("no dataset given and the checkpoint does not record one; pass --dataset NAME")
    augment = {k: getattr(args, k) for k in ("auto_augment", "re_prob") if hasattr(args, k)}
    if augment.get("auto_augment", "").lower() == "none":
        augment["auto_augment"] = None
    return load_dataset(chosen["dataset"], data_dir=chosen["data_dir"], seed=chosen["seed"],
                        test_size=chosen["test_size"], img_size=chosen["img_size"], **augment)


def _add_data_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    from polynets.training.data import available_datasets

    p.add_argument("--dataset", default="digits" if required else None,
                   help=f"one of {', '.join(available_datasets())}" + (" (default: digits)" if required else
                                                                       " (default: the one recorded at training)"))
    p.add_argument("--data-dir", help="directory holding mnist / fashion_mnist / cifar / imagefolder files")
    p.add_argument("--test-size", type=float, default=0.2 if required else None,
                   help="held-out fraction when a set is split (default: 0.2)")
    p.add_argument("--img-size", type=int, default=224 if required else None,
                   help="image side for imagefolder (default: 224)")


def _add_model_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--model", default=default, help="model name: monet, polymorpher_classifier, monet_t, a timm "
                                                    "name ..." + (f" (default: {default})" if default else ""))
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="model argument, repeatable; values parse as JSON (embed_dim=64, depth=[2,2], norm=batch)")


def _finish_distributed() -> None:
    from polynets.training.device import finish_distributed

    finish_distributed()


# ------------------------------------------------------------------------------ commands
def _check_runs_on(model: Any, name: str, dataset: str, shape: tuple[int, ...]) -> None:
    """Run ``model`` once on two samples of zeros of the dataset's input shape, so that a model
    that cannot take them (a patch larger than the image) is refused before training, with
    what it raised."""
    import torch

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, *shape))
    except Exception as exc:        # the model's own code: whatever it raises, it cannot run
        raise ConfigError(f"model {name!r} cannot run on {dataset} inputs of shape "
                          f"{tuple(shape)} ({type(exc).__name__}: {str(exc).strip()}); choose "
                          f"another model or size it with --model-arg") from exc
    finally:
        model.train(was)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model on a dataset and write run.json, metrics.jsonl, last.pt/best.pt to --out."""
    from polynets.training.checkpoint import build_model
    from polynets.training.train import TrainConfig, Trainer

    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out!r} is a file; it must name a run directory")
    train_ds, test_ds, info = _load_data(args)
    if args.max_train_samples is not None:
        from torch.utils.data import Subset

        check_int(args.max_train_samples, "--max-train-samples")

        train_ds = Subset(train_ds, range(min(args.max_train_samples, len(train_ds))))
    kwargs = model_kwargs_for(args.model, info, parse_model_args(args.model_arg))
    model = build_model(args.model, **kwargs)
    _check_runs_on(model, args.model, info.name, info.input_shape)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, opt=args.opt, sched=args.sched, lr=args.lr,
                         weight_decay=args.weight_decay, layer_decay=args.layer_decay, warmup_epochs=args.warmup_epochs, min_lr=min(args.min_lr, args.lr),
                         label_smoothing=args.label_smoothing, clip_grad=args.clip_grad, device=args.device,
                         amp=args.amp, compile=args.compile, ema_decay=args.ema_decay, mixup=args.mixup,
                         cutmix=args.cutmix, seed=args.seed, out_dir=args.out, checkpoint_every=args.checkpoint_every,
                         num_workers=args.num_workers, log_every=args.log_every, progress=not args.no_progress,
                         deterministic=args.deterministic, resume=args.resume, num_classes=info.num_classes,
                         num_threads=args.threads)
    run_info = {"dataset": info.name, "data_dir": args.data_dir, "seed": args.seed, "test_size": args.test_size,
                "img_size": args.img_size, "input_shape": list(info.input_shape), "info": info.as_dict()}
    trainer = Trainer(model, config, model_name=args.model, model_kwargs=kwargs, run_info=run_info)
    n_params = sum(p.numel() for p in model.parameters())
    if trainer.dist.is_main:
        print(f"training {args.model} ({n_params:,} parameters, {json.dumps(kwargs)}) on {info.name} "
              f"({info.num_train} train / {info.num_test} test) on {trainer.device}"
              f"{f' x{trainer.dist.world_size} processes' if trainer.dist.enabled else ''}")
    try:
        history = trainer.fit(train_ds, test_ds)
    except KeyboardInterrupt:
        print("polynets: interrupted; run the same command with --resume to continue", file=sys.stderr)
        return 130
    finally:
        _finish_distributed()
    if trainer.dist.is_main:
        last = history[-1]
        print(f"done: epoch {last['epoch']}, train accuracy {last['train_accuracy']:.4f}, "
              f"test accuracy {last['val_accuracy']:.4f}, test loss {last['val_loss']:.4f}")
        if args.out:
            print(f"checkpoint: {Path(args.out) / 'last.pt'}   metrics: {Path(args.out) / 'metrics.jsonl'}")
            if args.plot:
                from polynets.training.plot import plot_run

                print(f"curves: {plot_run(args.out)}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint on the test split (or --split train) of its dataset."""
    from polynets.training.checkpoint import load_checkpoint, load_model
    from polynets.training.train import TrainConfig, Trainer

    run_info = _run_info(load_checkpoint(args.checkpoint), args.checkpoint)
    model = load_model(args.checkpoint)
    train_ds, test_ds, info = _load_data(args, run_info)
    trainer = Trainer(model, TrainConfig(batch_size=args.batch_size, device=args.device, progress=False))
    metrics = trainer.evaluate(train_ds if args.split == "train" else test_ds)
    result = {"checkpoint": str(args.checkpoint), "dataset": info.name, "split": args.split,
              "samples": info.num_train if args.split == "train" else info.num_test, **metrics}
    _finish_distributed()
    if trainer.dist.is_main:
        print(json.dumps(result) if args.json else
              f"{info.name} {args.split} ({result['samples']} samples): accuracy {metrics['accuracy']:.4f}, "
              f"loss {metrics['loss']:.4f}")
    return 0


def cmd_certify(args: argparse.Namespace) -> int:
    """Certify that a model is a polynomial of its input; prints degree and multiplicative depth."""
    import torch

    import polynets
    from polynets.training.checkpoint import build_model, load_checkpoint, load_model

    certify = getattr(polynets, "certify", None)
    if certify is None:
        raise ConfigError("this polynets installation has no certifier (polynets.ir.certify)")
    if args.checkpoint:
        shape = _run_info(load_checkpoint(args.checkpoint), args.checkpoint).get("input_shape")
        if shape is not None and not (isinstance(shape, list) and 0 < len(shape) <= 8 and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 < d <= 1 << 16 for d in shape)):
            raise CheckpointError(f"{args.checkpoint}: the recorded input shape {shape!r} is not a list of "
                                  "positive sizes; pass --input-shape C,H,W")
        model = load_model(args.checkpoint)
    if args.input_shape:
        try:
            given = [int(s) for s in args.input_shape.split(",")]
        except ValueError as exc:
            raise ConfigError(f"--input-shape expects comma-separated integers such as 1,8,8, got "
                              f"{args.input_shape!r}") from exc
        if not given or any(d < 1 or d > 1 << 16 for d in given):
            raise ConfigError(f"--input-shape expects positive sizes such as 1,8,8, got {args.input_shape!r}")
    if not args.checkpoint:
        if not args.model:
            raise ConfigError("certify needs a checkpoint path or --model NAME")
        _, _, info = _load_data(args)
        user = parse_model_args(args.model_arg)
        # a model named with --input-shape is sized for it, else for the dataset
        kwargs = shaped_model_kwargs(args.model, given, user, info.num_classes) \
            if args.input_shape else model_kwargs_for(args.model, info, user)
        model = build_model(args.model, **kwargs)
        shape = list(info.input_shape)
    if args.input_shape:
        shape = given
    if not shape:
        raise ConfigError("the input shape is unknown; pass --input-shape C,H,W (one sample, no batch dimension)")
    example = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    certificate = certify(model.eval(), example)
    print(str(certificate))
    return 0 if getattr(certificate, "is_polynomial", True) else 1


def cmd_plot(args: argparse.Namespace) -> int:
    """Draw a run's training curves (loss, accuracy, learning rate) to a PNG."""
    from polynets.training.plot import plot_run

    if not Path(args.run).is_dir():
        raise DataError(f"{args.run} is not a run directory; expected one written by `polynets train --out DIR`")
    try:
        print(plot_run(args.run, args.output))
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"the metrics log in {args.run} is malformed ({type(exc).__name__}: {exc}); expected the "
                        "metrics.jsonl written by `polynets train`") from exc
    return 0


def _benchmarks() -> dict[str, tuple[Path, str]]:
    if not BENCHMARK_DIR.is_dir():
        raise ConfigError(f"benchmarks live in a source checkout ({BENCHMARK_DIR} does not exist); clone the "
                          "repository and install it with `pip install -e .`")
    found = {}
    for script in sorted(BENCHMARK_DIR.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        except SyntaxError:
            doc = ""
        found[script.stem] = (script, doc.strip().splitlines()[0] if doc.strip() else "")
    return found


def cmd_bench(args: argparse.Namespace) -> int:
    """List the benchmark scripts, or run one (extra arguments go to the script)."""
    scripts = _benchmarks()
    if not args.name:
        width = max((len(n) for n in scripts), default=0)
        for name, (_, summary) in scripts.items():
            print(f"{name:<{width}}  {summary}")
        if not scripts:
            print(f"no benchmark scripts in {BENCHMARK_DIR}")
        return 0
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in scripts:
        raise ConfigError(f"no benchmark {args.name!r}; available: {', '.join(scripts) or 'none'}")
    return subprocess.call([sys.executable, str(scripts[name][0]), *args.args])


# ------------------------------------------------------------------------------ parser
class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action) or text


def _add_train(sub: Any) -> None:
    from polynets.training.data import DEFAULT_AUTO_AUGMENT
    from polynets.training.train import SCHEDULES

    p = sub.add_parser("train", help="train a polynomial network", description=cmd_train.__doc__,
                       formatter_class=_DefaultsFormatter)
    _add_model_args(p, "monet")
    _add_data_args(p, required=True)
    p.add_argument("--max-train-samples", type=int, help="train on the first N training samples only")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--opt", default="adamw", help="optimizer, any name of timm.optim.list_optimizers()")
    p.add_argument("--sched", default="cosine", choices=SCHEDULES, help="learning-rate decay after the warm-up")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--layer-decay", type=float, help="layer-wise learning-rate decay (e.g. 0.75)")
    p.add_argument("--warmup-epochs", type=float, default=2.0)
    p.add_argument("--min-lr", type=float, default=1e-5, help="final learning rate of the decay")
    p.add_argument("--auto-augment", default=DEFAULT_AUTO_AUGMENT,
                   help="timm augmentation policy for imagefolder training images ('none': off)")
    p.add_argument("--reprob", dest="re_prob", type=float, default=0.25,
                   help="random-erasing probability for imagefolder training images")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, help="clip the global gradient norm to this value")
    p.add_argument("--ema-decay", type=float, help="keep an EMA of the weights with this decay (e.g. 0.999)")
    p.add_argument("--mixup", type=float, default=0.0, help="Mixup alpha (images)")
    p.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (images)")
    p.add_argument("--device", default="auto", help="auto (CUDA > MPS > CPU), cpu, cuda, cuda:N or mps")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"], help="autocast on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory for checkpoints and metrics (none: nothing is written)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    p.add_argument("--checkpoint-every", type=int, default=1, help="epochs between checkpoints")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads while training (default: torch's; 1 suits small "
                        "models on a busy CPU)")
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log records")
    p.add_argument("--deterministic", action="store_true", help="use deterministic kernels")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--plot", action="store_true", help="draw OUT/curves.png at the end")
    p.set_defaults(func=cmd_train)


def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint", description=cmd_eval.__doc__)
    p.add_argument("checkpoint", help="a checkpoint written by `polynets train` (e.g. runs/x/last.pt)")
    _add_data_args(p, required=False)
    p.add_argument("--split", choices=["test", "train"], default="test")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, help="split seed (default: the one recorded at training)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)


def _add_certify(sub: Any) -> None:
    p = sub.add_parser("certify", help="certify a model is a polynomial (degree, depth)",
                       description=cmd_certify.__doc__)
    p.add_argument("checkpoint", nargs="?", help="checkpoint to certify (or give --model)")
    _add_model_args(p, None)
    _add_data_args(p, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-shape", help="one sample's shape, e.g. 1,8,8 (default: from the checkpoint or dataset)")
    p.set_defaults(func=cmd_certify)


def _add_plot(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw a run's training curves", description=cmd_plot.__doc__)
    p.add_argument("run", help="run directory (holding metrics.jsonl)")
    p.add_argument("-o", "--output", help="PNG path (default: RUN/curves.png)")
    p.set_defaults(func=cmd_plot)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="list or run benchmarks (source checkout)", description=cmd_bench.__doc__)
    p.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    p.set_defaults(func=cmd_bench)


def _register_plugins(sub: Any) -> list[str]:
    """Let each entry point of :data:`COMMAND_GROUP` add its subcommands; returns the names of those that did.

    A plugin whose own module is gone (stale metadata of an uninstalled package) is skipped quietly; one that
    fails in any other way is skipped with a warning, so a broken plugin never takes the command line down.
    """
    from importlib.metadata import entry_points

    loaded = []
    for point in sorted(entry_points(group=COMMAND_GROUP), key=lambda p: p.name):
        try:
            register = point.load()
        except Exception as exc:  # a plugin's import error must not break the built-in commands
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if missing and (point.module == missing or point.module.startswith(missing + ".")):
                continue
            print(f"polynets: warning: plugin {point.name} ({point.value}) could not be loaded: {exc}",
                  file=sys.stderr)
            continue
        if not callable(register):
            print(f"polynets: warning: plugin {point.name} ({point.value}) is not a function", file=sys.stderr)
            continue
        try:
            register(sub)
        except argparse.ArgumentError as exc:
            print(f"polynets: warning: plugin {point.name} ({point.value}) was skipped: {exc}", file=sys.stderr)
            continue
        loaded.append(point.name)
    return loaded


def build_parser() -> argparse.ArgumentParser:
    """The ``polynets`` argument parser with built-in and plugin subcommands."""
    import polynets

    parser = argparse.ArgumentParser(
        prog="polynets", description="Activation-free polynomial networks: train, certify, encrypt, discover.")
    parser.add_argument("--version", action="version", version=f"polynets {polynets.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_train, _add_eval, _add_certify, _add_plot, _add_bench):
        add(sub)
    _register_plugins(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``polynets`` command line; returns the exit code (2 for polynets errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    shown = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> str:
        # the library's own warnings as lines of the command, not Python's source listing
        if category.__module__.split(".")[0] in ("polynets", "he", "symbolic"):
            return f"polynets: warning: {_one_line(message)}\n"
        return shown(message, category, *rest, **kw)

    warnings.formatwarning = formatwarning
    try:
        return int(func(args) or 0)
    except PolynetsError as exc:
        print(f"polynets: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"polynets: error: cannot use{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = shown


def _one_line(exc: BaseException) -> str:
    """The error's message (a multi-line one, e.g. a certificate, is kept whole but indented)."""
    return str(exc).replace("\n", "\n  ")


if __name__ == "__main__":
    raise SystemExit(main())
