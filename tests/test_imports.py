"""What importing the packages loads: lazy exports, a torch-free ciphertext server, timm registration.

Each check runs in a fresh interpreter, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn

ROOT = Path(__file__).resolve().parent.parent


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


HEAVY = "{m: m in sys.modules for m in ('torch', 'timm', 'polynets.nn.models', 'he.client')}"
LOADED = f"json.dumps({HEAVY})"


def test_import_he_and_its_server_names_load_neither_torch_nor_timm() -> None:
    loaded = _fresh(f"""
        import json, sys
        import he
        he.Server, he.Ciphertext, he.HEError, he.load_program
        print({LOADED})
    """)
    assert loaded == {"torch": False, "timm": False, "polynets.nn.models": False, "he.client": True}


def test_import_polynets_loads_nothing_heavy_until_a_name_is_used() -> None:
    loaded = _fresh(f"""
        import json, sys
        import polynets
        before = {HEAVY}
        polynets.MuLayer
        after = {HEAVY}
        print(json.dumps([before, after]))
    """)
    assert loaded[0] == {"torch": False, "timm": False, "polynets.nn.models": False, "he.client": False}
    assert loaded[1]["torch"] is True


@pytest.mark.parametrize("order", ["import polynets, timm", "import timm, polynets"])
def test_timm_knows_the_polynets_models_whichever_is_imported_first(order: str) -> None:
    found = _fresh(f"""
        import json
        {order}
        print(json.dumps([timm.is_model(n) for n in ("monet_t", "monet_ms_s", "padre_vit_mini")]))
    """)
    assert found == [True, True, True]


def test_every_exported_name_resolves_to_the_object_its_module_defines() -> None:
    for package in (pn, he):
        listed = set(dir(package))
        for name in package.__all__:
            assert name in listed, name
            value = getattr(package, name)
            if name != "__version__":
                assert value is getattr(sys.modules[package._exports[name]], name)
        with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
            getattr(package, "NoSuchThing")
    assert pn.MONet is pn.models.MONet and pn.checkpoint.build_model is not None
    # what a package's __init__ imports for its own use is not part of what it lists
    for package in (pn, he):
        public = {n for n in dir(package) if not n.startswith("_")}
        assert not public & {"Any", "sys", "importlib", "annotations", "ModuleType"}, public


def test_an_exported_function_keeps_its_name_when_its_same_named_submodule_is_imported() -> None:
    kinds = _fresh("""
        import json
        import polynets.ir.certify, polynets.certify, polynets.trace, he.report
        import polynets, he
        print(json.dumps([type(x).__name__ for x in (polynets.certify, polynets.trace,
                                                      he.report, polynets.ir.certify)]))
    """)
    assert kinds == ["function", "function", "function", "module"]


def test_modules_of_the_flat_layout_import_as_the_moved_modules() -> None:
    import importlib

    for old, new in pn._MOVED.items():
        module = importlib.import_module(f"polynets.{old}")
        assert module is importlib.import_module(f"polynets.{new}")
        assert module.__name__ == module.__spec__.name == f"polynets.{new}"
    from polynets.layers import MuLayer
    assert MuLayer is pn.MuLayer and MuLayer.__module__ == "polynets.nn.layers"


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_a_server_process_without_torch_runs_ciphertexts_the_client_decrypts(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _Square(), nn.Linear(3, 2)).eval()
    x = torch.randn(2, 4)
    prog = he.compile(model, x, packing="batch")
    prog.save(tmp_path / "m.he")
    client = he.Client(prog)
    (tmp_path / "public.ctx").write_bytes(client.public_context())
    (tmp_path / "x.ct").write_bytes(client.encrypt(x.numpy()).to_bytes())

    loaded = _fresh(f"""
        import json, sys
        from pathlib import Path
        import he
        root = Path({str(tmp_path)!r})
        server = he.Server(he.load_program(root / "m.he"), (root / "public.ctx").read_bytes())
        out = server.run((root / "x.ct").read_bytes())
        (root / "y.ct").write_bytes(out.to_bytes())
        print({LOADED})
    """)
    assert loaded["torch"] is False and loaded["timm"] is False
    y = client.decrypt(he.Ciphertext.from_bytes((tmp_path / "y.ct").read_bytes()))
    with torch.no_grad():
        expected = model(x).numpy()
    assert np.allclose(y, expected, atol=1e-3)


def test_import_contracts_hold() -> None:
    """he -> polynets <- symbolic, as declared in pyproject.toml's [tool.importlinter]."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e .[dev])")
    done = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
