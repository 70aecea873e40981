"""Interval throughput from the cumulative FLOPs counter: TFLOP/s per GPU, MFU, tokens/s.

The numerator and the denominator cover the same window: the FLOPs added to the cumulative
counter since the previous log, over the wall time since the previous log. Anchoring at the
checkpointed counter on resume means the first interval after a restart is not a spike.
MFU never stops a training job: a device or dtype the peak table does not hold gives MFU None
and one logged reason; an interval above the peak is flagged (and logged) as a likely FLOPs
over-count, never clipped. Under mixed precision (`precision=`, e.g. a TE FP8 recipe: linear
layers in FP8, attention in BF16) MFU weighs each term's FLOPs by its own precision's peak
(`accounting.precisions`), with the single-peak MFU beside it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from accounting.precisions import resolve_precisions, seconds_at_peak

__all__ = ["PEAK_FLOPS", "IntervalReport", "IntervalThroughput", "device_key", "lookup_peak", "peak_flops"]

logger = logging.getLogger(__name__)

# Dense (non-sparse) matrix-unit peaks in FLOP/s per GPU, from the vendors' datasheets. NVIDIA
# datasheets print the sparse figure for FP8/BF16 with the footnote "with sparsity"; the dense
# figure taken here is half of it. AMD's print both ("with structured sparsity" is the doubled one);
# the dense one is taken.
# - A100 SXM/PCIe: BF16 312 TFLOPS dense (624 with sparsity); no FP8 tensor cores.
#   (NVIDIA A100 Tensor Core GPU datasheet.)
#   A100 PCIe and SXM share the figure, so they share the key.
# - H100 SXM: BF16 989.4 TFLOPS, FP8 1978.9 TFLOPS dense (1979 / 3958 with sparsity).
#   H100 PCIe: BF16 756 TFLOPS, FP8 1513 TFLOPS dense. (NVIDIA H100 Tensor Core GPU datasheet.)
# - H100 NVL: BF16 835.5, FP8 1670.5 TFLOPS dense (NVIDIA H100 Tensor Core GPU datasheet, H100 NVL
#   column, per GPU: 1,671 / 3,341 with sparsity); a 350-400 W PCIe card, below the SXM figures.
# - H200 SXM: same tensor cores and clocks as H100 SXM: BF16 989.4, FP8 1978.9 TFLOPS dense
#   (NVIDIA H200 Tensor Core GPU datasheet: 1979 / 3958 with sparsity).
# - H200 NVL: BF16 835.5, FP8 1670.5 TFLOPS dense (NVIDIA H200 Tensor Core GPU datasheet, H200 NVL
#   column: 1,671 / 3,341 with sparsity); the 600 W PCIe part, below the 700 W SXM.
# - GH200: its Hopper GPU has the H100 SXM's figures (NVIDIA GH200 Grace Hopper Superchip
#   datasheet: FP8 3958, BF16 1979 TFLOPS with sparsity): BF16 989.4, FP8 1978.9 dense.
# - B200 (HGX B200, per GPU): BF16 2.25 PFLOPS, FP8 4.5 PFLOPS dense (4.5 / 9 with sparsity).
#   (NVIDIA HGX B200 / DGX B200 datasheets.)
# - B300 (HGX B300, per GPU): NVIDIA HGX B300 datasheet, 8 GPUs: FP16/BF16 36 PFLOPS, FP8/FP6
#   72 PFLOPS with sparsity -> BF16 2.25, FP8 4.5 PFLOPS dense per GPU (Blackwell Ultra raises
#   FP4, not BF16/FP8, over the B200).
# - GB200 (NVL72, per GPU): NVIDIA GB200 NVL72 specifications, 72 GPUs: FP16/BF16 360 PFLOPS,
#   FP8/FP6 720 PFLOPS with sparsity (10 / 20 per 2-GPU superchip) -> BF16 2.5, FP8 5 PFLOPS dense
#   (the GB200's B200 runs at 1.2 kW, above the HGX B200's 1 kW, hence above the B200 row).
# - GB300 (NVL72, per GPU): NVIDIA GB300 NVL72 specifications, 72 GPUs: FP16/BF16 360 PFLOPS,
#   FP8/FP6 720 PFLOPS with sparsity -> BF16 2.5, FP8 5 PFLOPS dense.
# - L40S: NVIDIA L40S datasheet: BF16 Tensor Core 733 TFLOPS with sparsity, FP8 733 dense (1,466
#   with sparsity). Taken: BF16 366.5 (half the sparse figure, as for the others; the same
#   datasheet's dense column says 362.05, 1.2% lower, but 142 SMs x 2.52 GHz boost x 1024 FLOP
#   per SM per clock gives 366.4, and the higher peak never overstates MFU), FP8 733.
#   (Not the L40: BF16 181 dense.)
# - MI300X: AMD Instinct MI300X datasheet: peak BF16 1307.4 TFLOPS, FP8 2614.9 TFLOPS (2614.9 /
#   5229.8 with structured sparsity). Check: 304 CUs x 2.1 GHz x 2048 (BF16) / 4096 (FP8) FLOP
#   per CU per clock.
# - MI325X: AMD Instinct MI325X datasheet: the same CDNA 3 compute and clock as the MI300X
#   (more HBM only): BF16 1307.4, FP8 2614.9 TFLOPS dense.
# - MI355X: AMD Instinct MI355X datasheet: FP16/BF16 2.5 PFLOPS, FP8 5 PFLOPS dense (5 / 10.1
#   with structured sparsity); exact: 256 CUs x 2.4 GHz x 4096 (BF16) / 8192 (FP8) FLOP per CU
#   per clock = 2516.6 / 5033.2 TFLOPS.
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("A100", "bf16"): 312e12,
    ("H100", "bf16"): 989.4e12,
    ("H100", "fp8"): 1978.9e12,
    ("H100 PCIe", "bf16"): 756e12,
    ("H100 PCIe", "fp8"): 1513e12,
    ("H100 NVL", "bf16"): 835.5e12,
    ("H100 NVL", "fp8"): 1670.5e12,
    ("H200", "bf16"): 989.4e12,
    ("H200", "fp8"): 1978.9e12,
    ("H200 NVL", "bf16"): 835.5e12,
    ("H200 NVL", "fp8"): 1670.5e12,
    ("GH200", "bf16"): 989.4e12,
    ("GH200", "fp8"): 1978.9e12,
    ("B200", "bf16"): 2250e12,
    ("B200", "fp8"): 4500e12,
    ("B300", "bf16"): 2250e12,
    ("B300", "fp8"): 4500e12,
    ("GB200", "bf16"): 2500e12,
    ("GB200", "fp8"): 5000e12,
    ("GB300", "bf16"): 2500e12,
    ("GB300", "fp8"): 5000e12,
    ("L40S", "bf16"): 366.5e12,
    ("L40S", "fp8"): 733e12,
    ("MI300X", "bf16"): 1307.4e12,
    ("MI300X", "fp8"): 2614.9e12,
    ("MI325X", "bf16"): 1307.4e12,
    ("MI325X", "fp8"): 2614.9e12,
    ("MI355X", "bf16"): 2516.6e12,
    ("MI355X", "fp8"): 5033.2e12,
}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "fp8": "fp8", "float8": "fp8"}
# Model numbers as they appear in `torch.cuda.get_device_name()` ("NVIDIA GB200", "AMD Instinct
# MI300X"). Matched as whole model numbers: not after a letter or digit ("GB200" is not a B200,
# "GH200" not an H200) and not before a digit ("RTX A1000" is not an A100).
_MODELS = (
    "GB300",
    "GB200",
    "GH200",
    "B300",
    "B200",
    "H200",
    "H100",
    "A100",
    "L40S",
    "MI355X",
    "MI325X",
    "MI300X",
)


# The parts of one model whose peaks differ from its SXM figure, as the name's words say them
# (an SXM part's name carries no such word, or "SXM4"/"SXM5"). The A100's PCIe part peaks at
# the SXM figure: one key.
_PARTS = {"H100": ("PCIe", "NVL"), "H200": ("NVL",)}


def device_key(device_name: str) -> str | None:
    """The peak table's key for a device name ("NVIDIA H100 PCIe" -> "H100 PCIe"); None when unknown.

    The name is what `torch.cuda.get_device_name()` gives in the rank that runs the model (it
    names the rank's own device, after CUDA_VISIBLE_DEVICES), so NVL and PCIe parts are told
    from the SXM part of the same model wherever their peaks differ.
    """
    name = str(device_name).upper()
    words = set(re.split(r"[^0-9A-Z]+", name))
    for model in _MODELS:
        if re.search(rf"(?<![0-9A-Z]){model}(?![0-9A-Z])", name):
            part = next((p for p in _PARTS.get(model, ()) if p.upper() in words), None)
            return f"{model} {part}" if part else model
    return None


def lookup_peak(device_name: str, dtype: str = "bf16") -> tuple[float | None, str]:
    """`(peak FLOP/s, table key)`, or `(None, the reason)` when the table cannot say (never raises)."""
    key = device_key(device_name)
    if key is None:
        return None, (
            f"no peak FLOP/s known for device {device_name!r} (known: {', '.join(_MODELS)}; "
            "pass peak_flops_per_gpu= for another device)"
        )
    kind = _DTYPE_ALIASES.get(str(dtype).lower())
    if kind is None or (key, kind) not in PEAK_FLOPS:
        held = ", ".join(d for k, d in PEAK_FLOPS if k == key)
        why = " (the A100 has no FP8 tensor cores)" if (key, kind) == ("A100", "fp8") else ""
        return None, f"no {dtype} peak FLOP/s known for {key}{why}; the table holds {held} for it"
    return PEAK_FLOPS[(key, kind)], key


def peak_flops(device_name: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of one GPU for `dtype` ("bf16" or "fp8"); ValueError when unknown."""
    peak, key_or_reason = lookup_peak(device_name, dtype)
    if peak is None:
        raise ValueError(key_or_reason)
    return peak


@dataclass(frozen=True)
class IntervalReport:
    """One logging interval: what was done, over how long, per GPU and against the peak.

    `device`, `dtype` and `peak_flops_per_gpu` say which peak the single-peak MFU is against.
    `mfu_over_one` flags an MFU above 1, which no hardware reaches: the FLOPs are likely
    over-counted (a DP x CP group, a VPP chunk counted twice) or the peak is wrong.
    `mfu_basis` labels `mfu`: "single peak" (`F / (T x N x peak)`, the `dtype` peak), or "by
    precision" (each term at its own precision's peak, `peaks` holding each one used; the
    single-peak figure is then `mfu_single_peak`, beside it). `mfu_unavailable` says why `mfu`
    is None, when it is.
    """

    elapsed_s: float
    flops: int
    tokens: int
    tflops_per_gpu: float
    mfu: float | None
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    device: str | None = None
    dtype: str | None = None
    peak_flops_per_gpu: float | None = None
    mfu_over_one: bool = False
    mfu_basis: str = "single peak"
    mfu_single_peak: float | None = None
    peaks: dict[str, float] | None = None
    mfu_unavailable: str | None = None


def _check_peak(peak: object) -> None:
    if peak is not None and (
        isinstance(peak, bool) or not isinstance(peak, (int, float)) or not 0 < peak < float("inf")
    ):
        raise ValueError(f"peak_flops_per_gpu = {peak!r} must be a positive, finite FLOP/s figure")


class IntervalThroughput:
    """Throughput of each logging interval from cumulative counters and an injectable clock.

    `world_size` is the number of GPUs the FLOPs were spread over. Give either `peak_flops_per_gpu`
    or `device_name` (+ `dtype`) to get MFU; otherwise `mfu` is None. A device or dtype the peak
    table does not hold gives `mfu` None and one logged warning (`mfu_unavailable` says why),
    never an error that stops training. Construct it (or call `reset`) with the counters
    restored from a checkpoint, so the first interval after a resume covers only the FLOPs done
    since then.

    `precision` (with `device_name`) makes MFU precision-weighted: a TE recipe name ("delayed",
    "tensorwise", "mxfp8", "blockwise": linear layers in FP8), one precision, or a mapping of term
    groups or terms to precisions (`accounting.precisions`); terms it leaves out run in `dtype`.
    `log` then needs the cumulative FLOPs by term (`terms=acc.total_terms`).
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
        precision: str | Mapping[str, str] | None = None,
        start_terms: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size = {world_size!r} must be a positive int")
        _check_peak(peak_flops_per_gpu)
        self.world_size = world_size
        self.device, self.dtype = device_name, (dtype if device_name is not None else None)
        self.mfu_unavailable: str | None = None
        if peak_flops_per_gpu is None and device_name is not None:
            peak_flops_per_gpu, key_or_reason = lookup_peak(device_name, dtype)
            if peak_flops_per_gpu is None:
                self.mfu_unavailable = key_or_reason
                logger.warning("MFU will not be reported: %s", key_or_reason)
            else:
                self.device = key_or_reason
        self.peak_flops_per_gpu = peak_flops_per_gpu
        self.clock = clock
        self.device_name = device_name
        self.precisions = None if precision is None else resolve_precisions(precision, dtype)
        self._warned: set[str] = set()
        if self.precisions is not None and device_name is None:
            self._warn_once("MFU by precision needs device_name= (the peak of each precision)")
        self.reset(start_flops, start_tokens, start_terms)

    def _warn_once(self, reason: str) -> str:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("MFU will not be reported: %s", reason)
        return reason

    def reset(self, total_flops: int, total_tokens: int = 0, terms: Mapping[str, int] | None = None) -> None:
        """Anchors the next interval at these cumulative counters and now (e.g. after a resume)."""
        self._flops = int(total_flops)
        self._tokens = int(total_tokens)
        self._terms = {name: int(value) for name, value in (terms or {}).items()}
        self._time = self.clock()

    def _by_precision(
        self, flops: int, terms: dict[str, int] | None, elapsed: float
    ) -> tuple[float | None, dict[str, float] | None, str | None]:
        """(precision-weighted MFU, the peaks used, None) or (None, None, the reason)."""
        if self.device_name is None:
            return None, None, "MFU by precision needs device_name= (the peak of each precision)"
        if terms is None:
            return None, None, self._warn_once("MFU by precision needs log(..., terms=acc.total_terms)")
        if sum(terms.values()) != flops:
            return (
                None,
                None,
                self._warn_once(
                    f"the terms' FLOPs ({sum(terms.values())}) do not add up to the interval's ({flops}): "
                    "anchor both at the same counters (start_terms= / reset(..., terms=))"
                ),
            )
        seconds, peaks, reason = seconds_at_peak(
            terms, self.precisions, lambda precision: lookup_peak(self.device_name, precision)
        )
        if seconds is None:
            return None, None, self._warn_once(reason)
        return (seconds / elapsed / self.world_size if elapsed > 0 else 0.0), peaks, None

    def log(
        self, total_flops: int, total_tokens: int = 0, *, terms: Mapping[str, int] | None = None
    ) -> IntervalReport:
        """The interval since the previous log (or reset) ending now; then re-anchors.

        A counter that went backwards (a reload of an older checkpoint without `reset`) yields a
        zero interval instead of a negative one. An MFU above 1 is flagged and logged. `terms`
        is the cumulative model FLOPs by term (`FlopsAccumulator.total_terms`), for MFU by precision.
        """
        now = self.clock()
        elapsed = now - self._time
        flops = max(int(total_flops) - self._flops, 0)
        tokens = max(int(total_tokens) - self._tokens, 0)
        self._flops, self._tokens, self._time = int(total_flops), int(total_tokens), now
        deltas = None
        if terms is not None:
            current = {name: int(value) for name, value in terms.items()}
            deltas = {name: max(value - self._terms.get(name, 0), 0) for name, value in current.items()}
            self._terms = current
        peak = self.peak_flops_per_gpu
        where = {"device": self.device, "dtype": self.dtype, "peak_flops_per_gpu": peak}
        single = (
            (0.0 if peak else None)
            if elapsed <= 0
            else (flops / elapsed / self.world_size / peak if peak else None)
        )
        extra = {"mfu_single_peak": single, "mfu_unavailable": None if peak else self.mfu_unavailable}
        mfu = single
        if self.precisions is not None:
            mfu, peaks, reason = self._by_precision(flops, deltas, elapsed)
            extra.update(mfu_basis="by precision", peaks=peaks, mfu_unavailable=reason)
        if elapsed <= 0:
            return IntervalReport(elapsed, flops, tokens, 0.0, mfu, 0.0, 0.0, **where, **extra)
        per_gpu = flops / elapsed / self.world_size
        over = mfu is not None and mfu > 1
        if over:
            logger.warning(
                "interval MFU %.3f > 1 against %s's %s peak of %.4g FLOP/s per GPU: the FLOPs are likely "
                "over-counted (a DP x CP group instead of the pure DP group, a VPP chunk counted twice) "
                "or the peak is wrong",
                mfu,
                self.device or "the given",
                self.dtype or "configured" if self.precisions is None else "per-term precision",
                peak or float("nan"),
            )
        return IntervalReport(
            elapsed_s=elapsed,
            flops=flops,
            tokens=tokens,
            tflops_per_gpu=per_gpu / 1e12,
            mfu=mfu,
            tokens_per_s=tokens / elapsed,
            tokens_per_s_per_gpu=tokens / elapsed / self.world_size,
            mfu_over_one=over,
            **where,
            **extra,
        )
