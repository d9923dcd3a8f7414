"""The metrics log of a training run (``metrics.jsonl``): the trainer writes it, plots and the
command line read it; one JSON object per line, ``{"kind": "step"|"epoch", ...}``. No torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polynets._io import atomic_write_bytes

__all__ = ["MetricsLog", "read_metrics_log"]


def read_metrics_log(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines metrics log, skipping lines that do not parse (a torn last line)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLog:
    """Append-only JSON-lines log, ``{"kind": "step"|"epoch", ...}`` per line."""

    def __init__(self, path: Path, *, keep_until_step: int | None) -> None:
        self.path = path
        if keep_until_step is None or not path.exists():
            path.write_text("")
            return
        kept = [json.dumps(r) + "\n" for r in read_metrics_log(path) if r.get("step", 0) <= keep_until_step]
        atomic_write_bytes(path, "".join(kept).encode())

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
