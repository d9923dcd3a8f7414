"""Distributed data parallel: two CPU processes on gloo, launched with torchrun, train and checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from polynets.training.checkpoint import load_checkpoint, load_model

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import polynets as pn
    from torch.utils.data import Subset
    from polynets.training.data import load_dataset
    from polynets.training.train import TrainConfig, Trainer

    out = sys.argv[1]
    kwargs = dict(img_size=8, in_chans=1, num_classes=10, patch_size=2, embed_dim=16, depth=1)
    torch.manual_seed(int(os.environ["RANK"]))  # different initial weights: DDP must broadcast rank 0's
    model = pn.MONet(**kwargs)
    train, test, _ = load_dataset("digits")
    config = TrainConfig(epochs=2, batch_size=16, lr=3e-3, device="cpu", progress=False, out_dir=out, log_every=2)
    trainer = Trainer(model, config, model_name="monet", model_kwargs=kwargs)
    history = trainer.fit(Subset(train, range(320)), Subset(test, range(101)))
    weights = {k: v.double().sum().item() for k, v in trainer.model.state_dict().items()}
    with open(os.path.join(out, f"rank{trainer.dist.rank}.json"), "w") as fh:
        json.dump({"world_size": trainer.dist.world_size, "history": history, "weights": weights,
                   "backend": torch.distributed.get_backend()}, fh)
""")


def test_two_gloo_processes_train_in_sync_and_rank0_checkpoints(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["backend"] == "gloo"
    assert ranks[0]["weights"] == ranks[1]["weights"], "replicas diverged"
    # 320 samples split over 2 ranks, batches of 16: 10 optimizer steps per epoch
    assert [h["step"] for h in ranks[0]["history"]] == [10, 20]
    timeless = [[{k: v for k, v in h.items() if k not in ("samples_per_s", "time_s")} for h in r["history"]]
                for r in ranks]
    assert timeless[0] == timeless[1], "epoch metrics are all-reduced"

    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["epoch"] == 2 and ckpt["step"] == 20
    assert not any(k.startswith("module.") for k in ckpt["model"]), "the unwrapped module is saved"
    model = load_model(out / "last.pt")
    sums = {k: v.double().sum().item() for k, v in model.state_dict().items()}
    assert sums == ranks[0]["weights"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in steps if r["kind"] == "epoch"]) == 2, "only rank 0 writes the log"
    assert not any(p.name.startswith(".tmp") for p in out.iterdir()), "no temporary files are left"
    assert torch.equal(model.head.weight, ckpt["model"]["head.weight"])
