"""The polynets command: --help everywhere, errors, plugins, and a train -> eval -> certify -> plot tour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polynets import cli
from _models import Square


def subcommands() -> list[str]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    assert f"usage: polynets {command}" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "lots"])
def test_compile_refuses_a_memory_budget_that_is_not_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", "model.pt", "--memory-budget", value])
    assert exit_.value.code == 2
    assert "expected a positive number of GiB" in capsys.readouterr().err


def test_a_named_model_is_sized_by_the_input_shape_and_warnings_are_one_line(tmp_path, capsys):
    assert cli.main(["certify", "--model", "monet", "--input-shape", "1,16,16"]) == 0
    assert "input (1, 1, 16, 16) -> output (1, 10)" in capsys.readouterr().out
    out = tmp_path / "m.he"
    run = subprocess.run([sys.executable, "-m", "polynets.cli", "compile", "monet",
                          "--input-shape", "1,8,8", "--model-args", '{"depth": 1, "embed_dim": 8}',
                          "--memory-budget", "0.0001", "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.replace("\r", "\n").splitlines() if "warning" in line]
    assert warned and warned[0].startswith("polynets: warning: the server is predicted to need")
    assert out.exists()


def test_builtin_subcommands_are_present():
    assert {"train", "eval", "certify", "plot", "bench"} <= set(subcommands())


def test_importing_the_cli_does_not_import_plugin_packages_and_help_runs_in_a_fresh_process():
    code = ("import sys\nfrom polynets import cli\nprint('he' in sys.modules, 'symbolic' in sys.modules)\n"
            "cli.main(['--help'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first, *rest = out.stdout.splitlines()
    assert first.split() == ["False", "False"]
    assert "usage: polynets" in "\n".join(rest) and "train" in "\n".join(rest)


def test_polynets_errors_print_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polynets: error: no checkpoint at") and "Traceback" not in err
    assert cli.main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "absent")]) == 2
    assert "t10k-images-idx3-ubyte" in capsys.readouterr().err


def test_model_args_parse_as_json_with_string_fallback():
    assert cli.parse_model_args(["embed_dim=64", "depth=[2,2]", "norm=batch", "bias=false"]) == {
        "embed_dim": 64, "depth": [2, 2], "norm": "batch", "bias": False}
    assert cli.main(["train", "--model-arg", "oops"]) == 2


def _install_plugin_distribution(root, entry_points: str) -> None:
    """A minimal installed distribution (a .dist-info with entry points) on ``root``."""
    info = root / "fake_polynets_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-polynets-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[polynets.commands]\n" + entry_points)


def test_plugins_come_from_entry_points_and_broken_or_missing_ones_are_skipped(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake_polynets_plugin.py").write_text(
        "def register(subparsers):\n"
        "    p = subparsers.add_parser('hello', help='say hello')\n"
        "    p.set_defaults(func=lambda args: print('hello from plugin') or 0)\n"
        "def clash(subparsers):\n"
        "    subparsers.add_parser('train')\n")
    (tmp_path / "broken_polynets_plugin.py").write_text("import no_such_dependency_anywhere\n")
    _install_plugin_distribution(tmp_path, "hello = fake_polynets_plugin:register\n"
                                           "gone = uninstalled_polynets_plugin.cli:register\n"
                                           "broken = broken_polynets_plugin:register\n"
                                           "clash = fake_polynets_plugin:clash\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["hello"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "hello from plugin"
    warnings = captured.err.splitlines()
    assert len(warnings) == 2, warnings
    assert "plugin broken" in warnings[0] and "no_such_dependency_anywhere" in warnings[0]
    assert "plugin clash" in warnings[1]
    assert {"demo", "compile", "discover", "train"} <= set(subcommands())


def test_the_distribution_declares_the_he_and_symbolic_commands():
    from importlib.metadata import entry_points

    declared = {p.name: p.value for p in entry_points(group=cli.COMMAND_GROUP)}
    assert declared["he"] == "he.cli:register" and declared["symbolic"] == "symbolic.cli:register"
    source = Path(cli.__file__).read_text()
    assert "he.cli" not in source and "symbolic.cli" not in source


def test_bench_lists_the_benchmark_scripts(capsys):
    assert cli.main(["bench"]) == 0
    assert "training_throughput" in capsys.readouterr().out
    assert cli.main(["bench", "no_such_benchmark"]) == 2


def test_train_eval_certify_plot_tour(tmp_path, capsys):
    run = tmp_path / "run"
    code = cli.main(["train", "--epochs", "2", "--model-arg", "embed_dim=16", "--model-arg", "depth=1",
                     "--max-train-samples", "320", "--batch-size", "32", "--lr", "3e-3", "--out", str(run),
                     "--no-progress", "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert "training monet" in out and "test accuracy" in out
    assert (run / "last.pt").exists() and (run / "metrics.jsonl").exists()

    assert cli.main(["eval", str(run / "last.pt"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dataset"] == "digits" and result["samples"] == 360 and 0.0 <= result["accuracy"] <= 1.0

    assert cli.main(["train", "--epochs", "3", "--model-arg", "embed_dim=16", "--model-arg", "depth=1",
                     "--max-train-samples", "320", "--batch-size", "32", "--out", str(run), "--resume",
                     "--no-progress", "--device", "cpu"]) == 0
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "epoch"]
    assert epochs == [1, 2, 3], "resuming continues the run instead of starting over"
    capsys.readouterr()

    assert cli.main(["certify", str(run / "last.pt")]) == 0
    assert "polynomial" in capsys.readouterr().out

    assert cli.main(["plot", str(run), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_train_takes_timm_optimizer_and_schedule_names(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["train", "--epochs", "1", "--model-arg", "embed_dim=8", "--model-arg", "depth=1",
            "--max-train-samples", "64", "--batch-size", "32", "--no-progress", "--device", "cpu"]
    assert cli.main(base + ["--opt", "sgd", "--sched", "tanh", "--layer-decay", "0.8", "--out", str(run)]) == 0
    config = json.loads((run / "run.json").read_text())["config"]
    assert (config["opt"], config["sched"], config["layer_decay"]) == ("sgd", "tanh", 0.8)
    capsys.readouterr()
    assert cli.main(base + ["--opt", "no_such_optimizer"]) == 2
    assert "timm.optim.list_optimizers()" in capsys.readouterr().err


def test_image_model_on_tabular_data_is_refused_with_a_hint(capsys):
    assert cli.main(["train", "--dataset", "wine", "--epochs", "1"]) == 2
    assert "takes images" in capsys.readouterr().err


def test_sequence_model_gets_the_sequence_geometry():
    from polynets.training.data import load_dataset

    _, _, info = load_dataset("digits_rows")
    kwargs = cli.model_kwargs_for("polymorpher_classifier", info, {"dim": 16})
    assert kwargs == {"seq_len": 8, "in_features": 8, "num_classes": 10, "dim": 16}
    _, _, images = load_dataset("digits")
    assert cli.model_kwargs_for("monet_t", images, {}) == {"num_classes": 10, "in_chans": 1, "img_size": 8}


# ---------------------------------------------------------------------------- misuse of the encrypted-inference commands
@pytest.fixture(scope="module")
def he_files(tmp_path_factory):
    """A compiled program, data, a key set, an input and a result ciphertext in one directory."""
    import numpy as np
    import torch
    from torch import nn

    he = pytest.importorskip("he")

    root = tmp_path_factory.mktemp("he_cli")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), Square(), nn.Linear(5, 3)).eval()
    x = torch.randn(4, 6)
    he.compile(model, x, packing="batch").save(root / "m.he")
    np.save(root / "x.npy", x.numpy())
    np.save(root / "wide.npy", np.zeros((4, 7)))
    np.save(root / "flat.npy", np.zeros((4, 2, 3)))
    np.save(root / "scalar.npy", np.float64(1.0))
    np.save(root / "strings.npy", np.array(["a", "b"]))
    (root / "x.csv").write_text("\n".join(",".join(str(v) for v in row) for row in x.numpy().tolist()))
    (root / "text.csv").write_text("a,b,c\n")
    (root / "file").write_text("x")
    torch.save({"model": "nothing"}, root / "foreign.pt")
    keys = str(root / "keys")
    assert cli.main(["encrypt", str(root / "m.he"), str(root / "x.npy"), "--keys", keys, "-o",
                     str(root / "x.ct")]) == 0
    assert cli.main(["run", str(root / "m.he"), str(root / "x.ct"), "--context", f"{keys}/public.ctx", "-o",
                     str(root / "y.ct")]) == 0
    return root


def _fails_cleanly(argv, capsys, message):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err and err[-1].startswith("polynets: error: ") and "Traceback" not in "\n".join(err)
    assert message in err[-1], err[-1]


@pytest.mark.parametrize("argv, message", [
    (["encrypt", "{r}/m.he", "{r}/x.npy", "--keys", "{r}/keys", "-o", "{r}"], "is a directory"),
    (["encrypt", "{r}/m.he", "{r}/x.npy", "--keys", "{r}/keys", "-o", "{r}/file/x.ct"], "is a file"),
    (["encrypt", "{r}/m.he", "{r}/x.npy", "--keys", "{r}/file", "-o", "{r}/o.ct"], "is a file"),
    (["encrypt", "{r}/m.he", "{r}/wide.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "expected (B, 6,)"),
    (["encrypt", "{r}/m.he", "{r}/flat.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "expected (B, 6,)"),
    (["encrypt", "{r}/m.he", "{r}/scalar.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "expected a batch"),
    (["encrypt", "{r}/m.he", "{r}/strings.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "only numbers"),
    (["encrypt", "{r}/m.he", "{r}/text.csv", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "comma-separated"),
    (["encrypt", "{r}/m.he", "{r}/missing.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "does not exist"),
    (["encrypt", "/dev/zero", "{r}/x.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "not a regular file"),
    (["encrypt", "{r}/x.npy", "{r}/x.npy", "--keys", "{r}/keys", "-o", "{r}/o.ct"], "bad magic"),
    (["run", "{r}/m.he", "/dev/zero", "--context", "{r}/keys/public.ctx", "-o", "{r}/o.ct"], "not a regular file"),
    (["run", "{r}/m.he", "{r}", "--context", "{r}/keys/public.ctx", "-o", "{r}/o.ct"], "is a directory"),
    (["run", "{r}/m.he", "{r}/x.ct", "--context", "{r}/keys/secret.ctx", "-o", "{r}/o.ct"], "secret key"),
    (["run", "{r}/m.he", "{r}/x.ct", "--context", "{r}/keys/public.ctx", "-o", "{r}/keys"], "is a directory"),
    (["run", "{r}/m.he", "{r}/y.ct", "--context", "{r}/keys/public.ctx", "-o", "{r}/o.ct"], "input ciphertext"),
    (["run", "{r}/m.he", "{r}/x.ct", "--context", "{r}/keys/public.ctx", "-o", "{r}/o.ct",
      "--threads", "0"], "threads must be a positive int"),
    (["decrypt", "{r}/m.he", "/dev/zero", "--keys", "{r}/keys"], "not a regular file"),
    (["decrypt", "{r}/m.he", "{r}/y.ct", "--keys", "{r}/nokeys"], "no keys"),
    (["decrypt", "{r}/m.he", "{r}/y.ct", "--keys", "{r}/keys", "-o", "{r}/file/y.npy"], "is a file"),
    (["decrypt", "{r}/m.he", "{r}/y.ct", "--keys", "{r}/keys", "-o", "{r}/y.txt"],
     "written as .npy or .csv"),
    (["compile", "{r}/missing.pt", "-o", "{r}/z.he", "--input-shape", "6"], "no checkpoint at"),
    (["compile", "{r}/foreign.pt", "-o", "{r}/z.he", "--input-shape", "6"], "not a polynets checkpoint"),
    (["compile", "{r}", "-o", "{r}/z.he", "--input-shape", "6"], "is a directory"),
    (["compile", "no_such_model", "-o", "{r}/z.he", "--input-shape", "6"], "neither a checkpoint"),
    (["compile", "monet", "-o", "{r}/z.he", "--input-shape", "1,8,8", "--model-args", "[1, 2]"], "JSON object"),
    (["compile", "monet", "-o", "{r}/z.he", "--input-shape", "1,8,8", "--model-args", "{oops"], "malformed JSON"),
    (["compile", "monet", "-o", "{r}/z.he", "--input-shape", "1,8,8", "--model-args", '{"embed_dim": 200000}'],
     "refusing to build"),
    (["compile", "monet", "-o", "{r}/z.he", "--input-shape", "1,8,8", "--calibration", "{r}/x.npy"],
     "expected (B, 1, 8, 8)"),
    (["compile", "monet", "-o", "{r}/z.he", "--calibration", "{r}/scalar.npy"], "expected a batch"),
    (["compile", "monet", "-o", "{r}", "--input-shape", "1,8,8"], "is a directory"),
    (["compile", "monet", "-o", "{r}/z.he", "--input-shape", "1,8,8", "--bandwidth", "-5"],
     "bandwidth must be a positive"),
    (["he-costs", "-o", "{r}"], "is a directory"),
    (["he-costs", "-o", "{r}/t.json", "--repeats", "0"], "repeats must be a positive int"),
    (["run", "{r}/m.he", "{r}/x.ct", "--context", "{r}/keys/public.ctx", "-o", "{r}/o.ct",
      "--profile"], "--profile times the steps of a vector-packed program"),
])
def test_misused_encrypted_inference_commands_fail_with_one_line(he_files, capsys, argv, message):
    _fails_cleanly([a.replace("{r}", str(he_files)) for a in argv], capsys, message)


def test_a_missing_eval_checkpoint_is_reported_as_missing(tmp_path, capsys):
    _fails_cleanly(["eval", str(tmp_path / "missing.pt")], capsys, "does not exist")
    _fails_cleanly(["certify", str(tmp_path / "missing.pt")], capsys, "does not exist")
    _fails_cleanly(["eval", str(tmp_path)], capsys, "is a directory")


def test_encrypt_repairs_a_missing_public_context_and_refuses_a_lost_secret_key(he_files, tmp_path, capsys):
    import shutil

    keys = tmp_path / "keys"
    shutil.copytree(he_files / "keys", keys)
    (keys / "public.ctx").unlink()
    assert cli.main(["encrypt", str(he_files / "m.he"), str(he_files / "x.csv"), "--keys", str(keys),
                     "-o", str(tmp_path / "x.ct")]) == 0
    assert "missing public context" in capsys.readouterr().out
    assert (keys / "public.ctx").read_bytes() == (he_files / "keys" / "public.ctx").read_bytes()
    assert cli.main(["run", str(he_files / "m.he"), str(tmp_path / "x.ct"), "--context", str(keys / "public.ctx"),
                     "-o", str(tmp_path / "y.ct")]) == 0
    (keys / "public.ctx").write_bytes(b"the public context of another key set")
    assert cli.main(["encrypt", str(he_files / "m.he"), str(he_files / "x.npy"), "--keys", str(keys),
                     "-o", str(tmp_path / "x.ct")]) == 0
    assert "did not belong to the key set" in capsys.readouterr().out
    assert (keys / "public.ctx").read_bytes() == (he_files / "keys" / "public.ctx").read_bytes()
    (keys / "secret.ctx").unlink()
    _fails_cleanly(["encrypt", str(he_files / "m.he"), str(he_files / "x.npy"), "--keys", str(keys), "-o",
                    str(tmp_path / "z.ct")], capsys, "secret key of that key set is gone")
    assert not (tmp_path / "z.ct").exists()


def test_key_files_are_private_and_public_files_follow_the_umask(he_files):
    import os

    assert (he_files / "keys" / "secret.ctx").stat().st_mode & 0o777 == 0o600
    mask = os.umask(0)
    os.umask(mask)
    for name in ("keys/public.ctx", "x.ct", "y.ct", "m.he"):
        assert (he_files / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_misused_training_commands_fail_with_one_line(tmp_path, capsys):
    (tmp_path / "file").write_bytes(b"\xbe\xef")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b"\xbe\xef\n")
    _fails_cleanly(["train", "--out", str(tmp_path / "file")], capsys, "is a file")
    _fails_cleanly(["train", "--model-arg", "embed_dim=200000"], capsys, "refusing to build")
    _fails_cleanly(["plot", str(tmp_path / "file")], capsys, "not a run directory")
    _fails_cleanly(["plot", str(tmp_path / "run")], capsys, "malformed")
    _fails_cleanly(["eval", "/dev/zero"], capsys, "not a regular file")
    _fails_cleanly(["certify", "--model", "monet", "--input-shape", "0,8"], capsys, "positive sizes")
    _fails_cleanly(["train", "--model-arg", "depth=" + "[" * 100_000], capsys, "bytes of JSON")
    _fails_cleanly(["train", "--model-arg", "depth=" + "[" * 20 + "]" * 20], capsys, "nested")
    _fails_cleanly(["train", "--model-arg", "depth=[1, 2"], capsys, "malformed JSON")
    _fails_cleanly(["train", "--model", "mixer_s16_224"], capsys,
                   "cannot run on digits inputs of shape (1, 8, 8)")
    _fails_cleanly(["train", "--max-train-samples", "0"], capsys, "must be a positive int")
    _fails_cleanly(["train", "--model", "polymorpher_classifier"], capsys,
                   "needs seq_len, in_features, which dataset 'digits' (image data")


def test_a_checkpoint_with_a_malformed_run_record_fails_with_one_line(tmp_path, capsys):
    import torch

    from polynets.training.checkpoint import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(2, 2)
    for run_info in ({"dataset": ["digits"]}, {"dataset": "digits", "seed": "0"}, {"input_shape": "1,8,8"}, [1]):
        path = save_checkpoint(tmp_path / "c.pt", model=model, model_name="monet", extra={"run_info": run_info})
        assert load_checkpoint(path)["extra"]["run_info"] == run_info
        command = "certify" if isinstance(run_info, dict) and "input_shape" in run_info else "eval"
        _fails_cleanly([command, str(path)], capsys, "c.pt")
