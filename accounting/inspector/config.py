"""What to inspect: `InspectConfig`, the one place the inspector's defaults are declared."""

from __future__ import annotations

import re
from dataclasses import dataclass

from accounting.inspector.tensor_stats import SUPPORTED_STATS

# activation: the module's input; output: its output; gradient: the gradient arriving at the
# output (TE's naming); dgrad: the gradient with respect to the input; weight: `module.weight`.
# (TE's LayerNorm+Linear modules log the normalised GEMM input as "activation": see nvdlfw.py.)
SUPPORTED_TENSORS = ("activation", "weight", "output", "gradient", "dgrad")


@dataclass(frozen=True)
class InspectConfig:
    """Which layers, tensors and statistics to record, and how often (every `every`-th step)."""

    layers: str = r".*(fc1|fc2)"
    tensors: tuple[str, ...] = ("activation", "weight", "gradient")
    stats: tuple[str, ...] = SUPPORTED_STATS
    every: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"every = {self.every!r}: must be a positive int (inspect every N-th step)")
        for field, values, allowed in (
            ("tensors", self.tensors, SUPPORTED_TENSORS),
            ("stats", self.stats, SUPPORTED_STATS),
        ):
            if not values:
                raise ValueError(f"{field} is empty: name at least one of {allowed}")
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"{field} = {values!r}: {unknown} not supported; choose from {allowed}")
        try:
            re.compile(self.layers)
        except re.error as err:
            raise ValueError(f"layers = {self.layers!r} is not a valid regex: {err}") from err

    def is_inspection_step(self, step: int) -> bool:
        """True on steps 0, every, 2*every, ... (nvdlfw-inspect's `freq` rule with start 0)."""
        return step % self.every == 0
