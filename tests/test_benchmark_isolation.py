"""The benchmarks' isolated model processes (``benchmarks/he_inference.py``): a child killed
while it draws a progress bar must not leave the parent waiting on the bar's lock."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

he_inference = pytest.importorskip("he_inference")


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_child_killed_holding_the_progress_lock_does_not_hang_the_parent():
    for _ in tqdm.tqdm(range(1), disable=False):
        pass                        # the parent's lock exists before the fork, as in a run

    def killed_in_a_bar() -> dict:
        tqdm.tqdm.get_lock().acquire()
        os.kill(os.getpid(), signal.SIGKILL)
        return {}

    with pytest.raises(he_inference.ProcessDied, match="killed for memory"):
        he_inference.isolated(killed_in_a_bar)
    done = threading.Event()

    def bar() -> None:
        for _ in tqdm.tqdm(range(2)):
            pass
        done.set()

    worker = threading.Thread(target=bar, daemon=True)
    worker.start()
    worker.join(30)
    assert done.is_set(), "the parent's next progress bar waited on the dead child's lock"
