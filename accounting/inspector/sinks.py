"""Where records go: a TensorBoard-like scalar writer and/or a JSON lines file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from accounting.inspector.tensor_stats import SUPPORTED_STATS


class ScalarWriter(Protocol):
    """What the inspector needs from a TensorBoard `SummaryWriter` (or anything like it)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


class StatsSink:
    """Writes one step's records to a scalar writer and/or a JSON lines file.

    TensorBoard tags are `inspect/<layer>/<tensor>/<stat>`; each JSON line is one
    `{"step", "rank", "layer", "tensor", <stat>: value, ...}` record (NaN/inf written as the
    JSON extensions `NaN`/`Infinity`, which Python's json reads back).
    """

    def __init__(self, writer: ScalarWriter | None = None, jsonl_path: str | Path | None = None) -> None:
        self.writer = writer
        self.jsonl_path = Path(jsonl_path) if jsonl_path is not None else None
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, records: list[dict[str, Any]]) -> None:
        """Add every statistic of `records` to the writer and append the records to the file."""
        if self.writer is not None:
            for rec in records:
                for key, value in rec.items():
                    if key in SUPPORTED_STATS:
                        tag = f"inspect/{rec['layer']}/{rec['tensor']}/{key}"
                        self.writer.add_scalar(tag, value, rec["step"])
        if self.jsonl_path is not None and records:
            with self.jsonl_path.open("a") as fh:
                for rec in records:
                    fh.write(json.dumps(rec) + "\n")
