"""The Orion baseline module: importable without Orion; end to end on a tiny network with it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("orion_baseline",
                                                  ROOT / "benchmarks" / "orion_baseline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("orion_baseline", mod)
    spec.loader.exec_module(mod)
    return mod


def test_imports_and_configs_without_running_orion():
    ob = _load()
    assert isinstance(ob.available(), bool)
    lola = ob.describe_config(ob.LOLA_CONFIG)
    assert lola["ring_degree"] == 8192 and lola["levels"] == 5
    assert lola["log_qp"] <= lola["he_standard_max_log_qp"]
    for levels in (1, 5, 6, 10, 20):
        p = ob.describe_config(ob.leveled_config(levels))
        assert p["levels"] == levels
        assert p["log_qp"] <= p["he_standard_max_log_qp"]
    assert ob.leveled_config(6)["ckks_params"]["LogN"] == 13
    assert ob.leveled_config(10)["ckks_params"]["LogN"] == 14


def test_script_without_orion_says_how_to_install(monkeypatch, capsys):
    ob = _load()
    monkeypatch.setattr(ob, "available", lambda: False)
    with pytest.raises(SystemExit) as e:
        ob.main([])
    assert e.value.code == 2
    assert 'pip install -e ".[orion]"' in capsys.readouterr().err


class _Square(nn.Module):
    def forward(self, x):
        return x * x


def _data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g)
    return x, torch.randint(0, 10, (n,), generator=g)


@pytest.mark.slow
def test_tiny_sequential_network_end_to_end():
    pytest.importorskip("orion")
    ob = _load()
    if not ob.available():
        pytest.skip("the installed 'orion' is not orion-fhe")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 7, stride=7), nn.BatchNorm2d(2), _Square(),
                          nn.Flatten(), nn.Linear(32, 10)).eval()
    xtr, ytr = _data(64)
    with torch.no_grad():  # non-trivial BatchNorm statistics
        model[1].running_mean.uniform_(-0.2, 0.2)
        model[1].running_var.uniform_(0.5, 1.5)
    xte, yte = _data(4, seed=1)
    res = ob.run_network(model, (xtr, ytr), (xte, yte), n_latency=2, n_accuracy=3,
                         n_calibration=64, progress=False)
    assert res["conversion_max_abs_diff"] < 1e-5
    assert res["params"]["bootstraps"] == 0
    assert res["params"]["levels"] == res["orion_depth"] == 3
    assert res["encrypted"]["images"] == 3
    assert res["encrypted"]["max_abs_error"] < 0.05
    assert res["latency"]["median_server_s"] > 0
    assert res["sizes"]["rotation_key_bytes_each"] > 0


@pytest.mark.slow
def test_token_network_converts_exactly():
    pytest.importorskip("orion")
    ob = _load()
    if not ob.available():
        pytest.skip("the installed 'orion' is not orion-fhe")
    import polynets as pn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = pn.PatchEmbed(28, 7, 1, 8)
            self.norm = pn.layers.ChannelsLastBatchNorm(8)
            self.mus = nn.ModuleList([pn.MuLayer(8, norm="batch")])
            self.head = nn.Linear(8 * 16, 10)

        def forward(self, x):
            t = self.norm(self.embed(x))
            for mu in self.mus:
                t = t + mu(t)
            return self.head(t.flatten(1))

    torch.manual_seed(0)
    model = Tiny()
    xtr, _ = _data(128)
    model.train()
    with torch.no_grad():  # BatchNorm statistics from data
        for _ in range(3):
            model(xtr)
    model.eval()
    net = ob.to_orion(model)
    with torch.no_grad():
        assert torch.allclose(net(xtr[:16]), model(xtr[:16]), atol=1e-4)
    assert ob.orion_depth(net) == 6
