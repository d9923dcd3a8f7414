"""The polynets command: --help everywhere, errors, plugins, and a train -> eval -> certify -> plot tour."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polynets import cli


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


def test_plugins_add_subcommands_and_missing_ones_are_skipped(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake_polynets_plugin.py").write_text(
        "def register(subparsers):\n"
        "    p = subparsers.add_parser('hello', help='say hello')\n"
        "    p.set_defaults(func=lambda args: print('hello from plugin') or 0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "PLUGINS", ("fake_polynets_plugin", "absent_polynets_plugin.cli"))
    assert cli.main(["hello"]) == 0
    assert capsys.readouterr().out.strip() == "hello from plugin"


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


def test_image_model_on_tabular_data_is_refused_with_a_hint(capsys):
    assert cli.main(["train", "--dataset", "wine", "--epochs", "1"]) == 2
    assert "takes images" in capsys.readouterr().err


def test_sequence_model_gets_the_sequence_geometry():
    from polynets.data import load_dataset

    _, _, info = load_dataset("digits_rows")
    kwargs = cli.model_kwargs_for("polymorpher_classifier", info, {"dim": 16})
    assert kwargs == {"seq_len": 8, "in_features": 8, "num_classes": 10, "dim": 16}
    _, _, images = load_dataset("digits")
    assert cli.model_kwargs_for("monet_t", images, {}) == {"num_classes": 10, "in_chans": 1, "img_size": 8}
