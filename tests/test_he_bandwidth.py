"""The link between client and server: predicted request sizes, and a slow link priced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import he
import polynets as pn
from _models import Square


class Tokens(nn.Module):
    """4x4 patches of MNIST-sized images, two Mu-Layers: its first maps can read the client's
    input planes (several input ciphertexts) or rotate one input ciphertext."""

    def __init__(self, dim: int = 48):
        super().__init__()
        self.embed = pn.PatchEmbed(28, 4, 1, dim)
        self.mus = nn.ModuleList(pn.MuLayer(dim) for _ in range(2))
        self.head = nn.Linear(dim * 49, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x)
        for mu in self.mus:
            t = t + mu(t)
        return self.head(t.flatten(1))


def _data():
    torch.manual_seed(0)
    return Tokens().eval(), torch.rand(64, 1, 28, 28)


@pytest.mark.parametrize("packing", ["vector", "batch"])
def test_predicted_request_sizes_match_the_serialised_ciphertexts(packing):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Square(), nn.Linear(4, 3)).eval()
    x = torch.rand(16, 6)
    prog = he.compile(model, x[:1], calibration=x, packing=packing)
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    ct = client.encrypt(x[:2])
    up = he.Ciphertext.from_bytes(ct.to_bytes())
    down = he.Ciphertext.from_bytes(server.run(up).to_bytes())
    predicted = prog.plan.predicted
    # each ciphertext in the compact form (he.wire), whose size the compiler knows exactly,
    # where the client's encryptions expose their words (SEAL's own form otherwise)
    sent = [b for g in up._groups for b in g]
    if all(b[:4] == b"PNCT" for b in sent):
        assert predicted["upload_bytes"] == sum(len(b) for b in sent)
    assert predicted["upload_bytes"] == pytest.approx(sum(len(b) for b in sent), rel=0.25)
    assert predicted["download_bytes"] == sum(len(b) for g in down._groups for b in g)
    assert np.max(np.abs(client.decrypt(down) - model(x[:2]).detach().numpy())) \
        <= prog.params.expected_error


def test_a_slow_link_makes_the_compiler_send_fewer_input_ciphertexts(monkeypatch):
    model, x = _data()
    # rotations at SEAL's price, where the client's input planes win on compute (with hoisted
    # baby steps, rotating one input ciphertext may win anyway)
    monkeypatch.setenv("POLYNETS_NO_HOISTING", "1")
    # the head on the server (by the client, the chain is shorter, N=8192, and one input
    # ciphertext wins on compute too)
    # and the first maps on the server too: the subject is how it reads the client's input
    fast = he.compile(model, x[:1], calibration=x, final_map="server", first_map="server")
    slow = he.compile(model, x[:1], calibration=x, bandwidth=1e6,     # 8 Mbit/s
                      final_map="server", first_map="server")
    assert fast.plan.cost()["input_ciphertexts"] > 1    # the planes win on compute alone
    assert slow.plan.cost()["input_ciphertexts"] == 1
    assert slow.plan.predicted["upload_bytes"] < fast.plan.predicted["upload_bytes"]
    assert slow.options["bandwidth"] == 1e6 and "bandwidth" not in fast.options
    assert "MiB up" in slow.summary()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "fast", True])
def test_a_bandwidth_that_is_not_a_positive_rate_is_refused(bad):
    model, x = _data()
    with pytest.raises(he.NotEncryptableError, match="bandwidth"):
        he.compile(model, x[:1], calibration=x, bandwidth=bad)
