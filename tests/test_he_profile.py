"""A vector server's step profile (each step timed beside the cost model's prediction for it) and
cost tables combined by their median."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import he
from he.costmodel import CostModel, calibrate, median_model, shipped_model
from he.errors import KeyMismatchError
from tests._models import Square


def _token_model() -> nn.Module:
    """An embedding of 8 tokens, a square, a channel map and a flattened head."""
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 6)
            self.sq = Square()
            self.mix = nn.Linear(6, 6)
            self.head = nn.Linear(48, 3)

        def forward(self, x):
            t = self.embed(x.reshape(x.shape[0], 8, 8))
            return self.head(self.mix(self.sq(t)).flatten(1))

    torch.manual_seed(0)
    return Tokens().eval()


@pytest.fixture(scope="module")
def served():
    x = torch.rand(8, 1, 8, 8)
    # the first maps on the server, so that affine steps and planes are profiled too
    prog = he.compile(_token_model(), x[:1], calibration=x, packing="vector",
                      cost_model=shipped_model(), first_map="server")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    return prog, client, server, client.encrypt(x[:1].numpy()), x


def test_every_step_is_timed_once_beside_its_prediction(served):
    prog, client, server, ct, _ = served
    p = server.profile(ct)
    steps = [s for r in p.rows for s in r.steps]
    wanted = [si for si, st in enumerate(prog.plan.steps) if st.kind != "input"]
    assert sorted(steps) == wanted
    assert p.rows[0].kind == "load" and p.rows[0].steps == ()
    assert all(r.measured > 0 for r in p.rows)
    assert p.measured == pytest.approx(sum(r.measured for r in p.rows))
    assert p.threads == server.engine.pool.threads
    if server.engine.pool.threads == prog.server_threads:
        # the steps' predictions are the program's, split: they sum to it
        assert p.note == ""
        assert all(r.predicted is not None and r.predicted >= 0 for r in p.rows)
        assert p.predicted == pytest.approx(prog.options["predicted"]["seconds_per_ciphertext"],
                                            rel=1e-9)
    text = str(p)
    assert "step profile on" in text and "predicted" in text
    assert len(text.splitlines()) == 2 + len(p.rows)
    assert p.slowest(1)[0].measured == max(r.measured for r in p.rows)


def test_profiling_evaluates_as_run_does(served):
    prog, client, server, ct, x = served
    server.profile(ct)
    # the profile leaves the server as it was: a request after it decrypts within the promise
    got = client.decrypt(server.run(ct))
    assert np.max(np.abs(got - prog.simulate(x[:1].numpy()))) <= prog.params.expected_error


def test_the_command_line_server_prints_the_profile(served, tmp_path, capsys):
    from polynets import cli

    prog, _, _, _, x = served
    prog.save(tmp_path / "m.he")
    np.save(tmp_path / "x.npy", x[:2].numpy())
    keys = str(tmp_path / "keys")
    assert cli.main(["encrypt", str(tmp_path / "m.he"), str(tmp_path / "x.npy"), "--keys", keys,
                     "-o", str(tmp_path / "x.ct")]) == 0
    capsys.readouterr()
    assert cli.main(["run", str(tmp_path / "m.he"), str(tmp_path / "x.ct"), "--context",
                     f"{keys}/public.ctx", "-o", str(tmp_path / "y.ct"), "--profile"]) == 0
    out = capsys.readouterr().out
    assert "step profile on" in out and "load" in out and "affine" in out
    assert (tmp_path / "y.ct").exists()


def test_a_server_on_other_threads_shows_no_predictions(served):
    prog, client, _, ct, _ = served
    other = 2 if prog.server_threads == 1 else 1
    server = he.Server(prog, client.public_context(), threads=other, warm=False)
    if server.engine.pool.threads == prog.server_threads:
        pytest.skip("this machine cannot run the other number of threads")
    p = server.profile(ct)
    assert all(r.predicted is None for r in p.rows) and p.predicted is None
    assert "not this server's" in p.note


def test_bad_requests_are_refused(served):
    prog, client, server, ct, _ = served
    with pytest.raises(ValueError, match="group must be below 1"):
        server.profile(ct, group=1)
    with pytest.raises(ValueError, match="non-negative int"):
        server.profile(ct, group=-1)
    other = he.Client(prog)
    with pytest.raises(KeyMismatchError):
        server.profile(other.encrypt(np.zeros((1, 1, 8, 8))))


def test_a_batch_program_is_refused_with_what_to_time_instead():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2), Square(), nn.Linear(2, 2)).eval()
    x = torch.rand(4, 1, 2, 2)
    prog = he.compile(model, x[:1], calibration=x, packing="batch")
    client = he.Client(prog)
    server = he.Server(prog, client.public_context())
    with pytest.raises(ValueError, match="vector-packed.*Server.run"):
        server.profile(client.encrypt(x.numpy()))


def _perturbed(model: CostModel, factor: float) -> CostModel:
    d = model.to_dict()
    d["table"] = {r: {op: [[p[0], p[1] * factor] for p in pts] for op, pts in ops.items()}
                  for r, ops in d["table"].items()}
    d["word_speed"] *= factor
    d["probe_seconds"] = {k: v * factor for k, v in d["probe_seconds"].items()}
    d["parallel_efficiency"] = {k: min(1.0, v * factor)
                                for k, v in d["parallel_efficiency"].items()}
    return CostModel.from_dict(d)


def test_the_median_of_tables_is_each_figures_middle_value():
    base = shipped_model()
    runs = [_perturbed(base, f) for f in (1.3, 0.9, 1.1)]
    med = median_model(runs)
    middle = runs[2]
    for ring in base.table:
        for op in base.table[ring]:
            assert med.seconds(op, ring, 3) == pytest.approx(middle.seconds(op, ring, 3))
    assert med.word_speed == pytest.approx(middle.word_speed)
    assert med.probe == pytest.approx(middle.probe)
    assert med.parallel == pytest.approx(middle.parallel)
    assert "median of 3 calibrations" in med.source
    # what calibrate writes reads back as the same table
    again = CostModel.from_dict(json.loads(json.dumps(med.to_dict())))
    assert again.to_dict() == med.to_dict()


def test_tables_that_differ_in_shape_are_not_combined():
    base = shipped_model()
    d = base.to_dict()
    ring = next(iter(d["table"]))
    d["table"][ring]["rotate"] = d["table"][ring]["rotate"][:-1]
    with pytest.raises(ValueError, match="different limb counts"):
        median_model([base, CostModel.from_dict(d)])
    with pytest.raises(ValueError, match="at least one"):
        median_model([])


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_calibrate_refuses_a_bad_repeat_count_before_measuring(repeats, tmp_path):
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        calibrate(tmp_path / "t.json", repeats=repeats)
    assert not (tmp_path / "t.json").exists()
