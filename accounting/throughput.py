"""Interval throughput from the cumulative FLOPs counter: TFLOP/s per GPU, MFU, tokens/s.

The numerator and the denominator cover the same window: the FLOPs added to the cumulative
counter since the previous log, over the wall time since the previous log. Anchoring at the
checkpointed counter on resume means the first interval after a restart is not a spike.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PEAK_FLOPS", "IntervalReport", "IntervalThroughput", "peak_flops"]

# Dense (non-sparse) tensor-core peaks in FLOP/s per GPU, from the vendors' datasheets. NVIDIA
# datasheets print the sparse figure for FP8/BF16 with the footnote "with sparsity"; the dense
# figure is half of it.
# - A100 SXM/PCIe: BF16 312 TFLOPS dense (624 with sparsity); no FP8 tensor cores.
#   (NVIDIA A100 Tensor Core GPU datasheet.)
# - H100 SXM: BF16 989.4 TFLOPS, FP8 1978.9 TFLOPS dense (1979 / 3958 with sparsity).
#   H100 PCIe: BF16 756 TFLOPS, FP8 1513 TFLOPS dense. (NVIDIA H100 Tensor Core GPU datasheet.)
# - H200 SXM: same tensor cores and clocks as H100 SXM: BF16 989.4, FP8 1978.9 TFLOPS dense
#   (datasheet: 1979 / 3958 with sparsity).
# - B200 (HGX B200, per GPU): BF16 2.25 PFLOPS, FP8 4.5 PFLOPS dense (4.5 / 9 with sparsity).
#   (NVIDIA HGX B200 / DGX B200 datasheets.)
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("A100", "bf16"): 312e12,
    ("H100", "bf16"): 989.4e12,
    ("H100", "fp8"): 1978.9e12,
    ("H100 PCIe", "bf16"): 756e12,
    ("H100 PCIe", "fp8"): 1513e12,
    ("H200", "bf16"): 989.4e12,
    ("H200", "fp8"): 1978.9e12,
    ("B200", "bf16"): 2250e12,
    ("B200", "fp8"): 4500e12,
}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "fp8": "fp8", "float8": "fp8"}


def _device_key(device_name: str) -> str:
    """Maps a `torch.cuda.get_device_name()` string to a table key ("NVIDIA H100 PCIe" -> "H100 PCIe")."""
    name = device_name.upper()
    for model in ("B200", "H200", "H100", "A100"):
        # Not inside a longer model number ("RTX A1000" is not an A100).
        if re.search(rf"(?<![0-9]){model}(?![0-9])", name):
            if model in ("H100", "H200") and "NVL" in name:  # NVL parts peak below the SXM figures
                break
            return f"{model} PCIe" if model == "H100" and "PCIE" in name else model
    raise ValueError(f"no peak FLOP/s known for device {device_name!r} (known: A100, H100, H200, B200)")


def peak_flops(device_name: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of one GPU for `dtype` ("bf16" or "fp8"); ValueError when unknown."""
    key = _device_key(device_name)
    kind = _DTYPE_ALIASES.get(str(dtype).lower())
    if kind is None or (key, kind) not in PEAK_FLOPS:
        raise ValueError(f"no {dtype} peak FLOP/s known for {key} (the A100 has no FP8 tensor cores)")
    return PEAK_FLOPS[(key, kind)]


@dataclass(frozen=True)
class IntervalReport:
    """One logging interval: what was done, over how long, per GPU and against the peak."""

    elapsed_s: float
    flops: int
    tokens: int
    tflops_per_gpu: float
    mfu: float | None
    tokens_per_s: float
    tokens_per_s_per_gpu: float


class IntervalThroughput:
    """Throughput of each logging interval from cumulative counters and an injectable clock.

    `world_size` is the number of GPUs the FLOPs were spread over. Give either `peak_flops_per_gpu`
    or `device_name` (+ `dtype`) to get MFU; otherwise `mfu` is None. Construct it (or call
    `reset`) with the counters restored from a checkpoint, so the first interval after a resume
    covers only the FLOPs done since then.
    """

    def __init__(
        self,
        world_size: int,
        *,
        start_flops: int = 0,
        start_tokens: int = 0,
        device_name: str | None = None,
        dtype: str = "bf16",
        peak_flops_per_gpu: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size = {world_size!r} must be a positive int")
        if peak_flops_per_gpu is None and device_name is not None:
            peak_flops_per_gpu = peak_flops(device_name, dtype)
        if peak_flops_per_gpu is not None and (
            isinstance(peak_flops_per_gpu, bool)
            or not isinstance(peak_flops_per_gpu, (int, float))
            or not 0 < peak_flops_per_gpu < float("inf")
        ):
            raise ValueError(
                f"peak_flops_per_gpu = {peak_flops_per_gpu!r} must be a positive, finite FLOP/s figure"
            )
        self.world_size = world_size
        self.peak_flops_per_gpu = peak_flops_per_gpu
        self.clock = clock
        self.reset(start_flops, start_tokens)

    def reset(self, total_flops: int, total_tokens: int = 0) -> None:
        """Anchors the next interval at these cumulative counters and now (e.g. after a resume)."""
        self._flops = int(total_flops)
        self._tokens = int(total_tokens)
        self._time = self.clock()

    def log(self, total_flops: int, total_tokens: int = 0) -> IntervalReport:
        """The interval since the previous log (or reset) ending now; then re-anchors.

        A counter that went backwards (a reload of an older checkpoint without `reset`) yields a
        zero interval instead of a negative one.
        """
        now = self.clock()
        elapsed = now - self._time
        flops = max(int(total_flops) - self._flops, 0)
        tokens = max(int(total_tokens) - self._tokens, 0)
        self._flops, self._tokens, self._time = int(total_flops), int(total_tokens), now
        if elapsed <= 0:
            return IntervalReport(
                elapsed, flops, tokens, 0.0, 0.0 if self.peak_flops_per_gpu else None, 0.0, 0.0
            )
        per_gpu = flops / elapsed / self.world_size
        mfu = per_gpu / self.peak_flops_per_gpu if self.peak_flops_per_gpu else None
        return IntervalReport(
            elapsed_s=elapsed,
            flops=flops,
            tokens=tokens,
            tflops_per_gpu=per_gpu / 1e12,
            mfu=mfu,
            tokens_per_s=tokens / elapsed,
            tokens_per_s_per_gpu=tokens / elapsed / self.world_size,
        )
